"""sims.models: preset parameter counts against published totals, matmul FLOPs against
torch's FlopCounterMode on real tiny models, activation bytes against Korthikanti et al.'s
formula (hand-computed) and against what autograd saves, and trace_module on the meta device."""

from __future__ import annotations

import math
import time

import psutil
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from flowtrain.engine.strategy import module_units
from sims import models
from sims.models import Architecture, get_model, trace_module


@pytest.fixture(scope="module")
def sim_models():
    import sim_models as module

    return module


# Published totals: Hugging Face ``model.num_parameters()`` / safetensors totals of
# openai-community/gpt2{,-medium,-large,-xl} (tied LM head counted once), meta-llama/Llama-2-*-hf,
# meta-llama/Meta-Llama-3-{8B,70B} (the same figures Llama 3.1 8B/70B report), facebook/opt-1.3b
# and tiiuae/falcon-7b.
PUBLISHED = {
    "gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200, "llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192, "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496,
    "opt-1.3b": 1_315_758_080, "falcon-7b": 6_921_720_704,
}


def test_every_preset_has_a_published_count() -> None:
    assert set(models.PRESETS) == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_count_matches_published(name: str) -> None:
    spec = get_model(name)
    assert spec.num_params == PUBLISHED[name]
    assert spec.seq_len == models.PRESETS[name].context


def test_preset_shapes_follow_hugging_face_layouts() -> None:
    gpt2 = dict(get_model("gpt2").params)
    assert gpt2["transformer.wte.weight"] == (50257, 768)
    assert gpt2["transformer.h.11.attn.c_attn.weight"] == (768, 2304)  # Conv1D: (in, out)
    assert "lm_head.weight" not in gpt2  # tied to wte
    llama3 = dict(get_model("llama3-8b").params)
    assert llama3["model.layers.0.self_attn.k_proj.weight"] == (1024, 4096)  # 8 KV heads x 128
    assert llama3["model.layers.31.mlp.gate_proj.weight"] == (14336, 4096)
    assert llama3["lm_head.weight"] == (128256, 4096)


def test_an_architecture_may_untie_or_tie_its_head() -> None:
    from dataclasses import replace

    gpt2 = models.PRESETS["gpt2"]
    untied = models.architecture_params(replace(gpt2, tied=False))
    # Megatron-Core's untied GPT: the head is its own (vocab, hidden) matrix after the norm
    assert untied[-1] == ("lm_head.weight", (50257, 768))
    assert sum(math.prod(s) for _, s in untied) == PUBLISHED["gpt2"] + 50257 * 768
    tied_llama = models.architecture_params(replace(models.PRESETS["llama3-8b"], tied=True))
    assert "lm_head.weight" not in dict(tied_llama)
    assert replace(gpt2, tied=False).tied_embeddings is False
    assert gpt2.tied_embeddings is True


def test_gpt2_flops_equal_the_textbook_closed_form() -> None:
    # Narayanan et al. 2021 (arXiv:2104.04473, Sec. 5.1): a GPT layer's forward is
    # 24·b·s·h² + 4·b·s²·h FLOPs, the logit layer 2·b·s·h·V.
    s, h, layers, vocab = 1024, 768, 12, 50257
    expected = layers * (24 * s * h * h + 4 * s * s * h) + 2 * s * h * vocab
    assert get_model("gpt2").forward_flops_per_sample == expected == 291_648_307_200


@pytest.mark.parametrize("factory,family", [("gpt2_tiny", "gpt2"), ("llama_tiny", "llama")])
def test_flops_equal_flop_counter_on_a_real_tiny_model(sim_models, factory: str,
                                                       family: str) -> None:
    shape = dict(sim_models.GPT2_TINY if family == "gpt2" else sim_models.LLAMA_TINY)
    shape.setdefault("kv_heads", shape["heads"])
    shape.setdefault("ffn", 4 * shape["hidden"])
    arch = Architecture(family, **shape)
    model = getattr(sim_models, factory)()
    batch, seq = 3, 20
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, shape["vocab"], (batch, seq)))
    assert counter.get_total_flops() == batch * models.forward_flops(arch, seq)
    # the preset layout is the real model's, name for name and shape for shape
    real = tuple((n, tuple(p.shape)) for n, p in model.named_parameters())
    assert models.architecture_params(arch) == real


def test_units_are_the_engine_s_zero3_module_units(sim_models) -> None:
    model = sim_models.gpt2_tiny()
    arch = Architecture("gpt2", **sim_models.GPT2_TINY, kv_heads=4, ffn=256)
    spec = models.spec_from_architecture("tiny", arch, 16)
    assert spec.units() == module_units(model, list(model.parameters()))
    assert [layer for layer in spec.layer_of() if layer >= 0] == [0] * 12 + [1] * 12


def test_korthikanti_layer_formula_by_hand() -> None:
    # GPT-3 175B's shape (a = 96, h = 12288, s = 2048), Korthikanti et al. 2022 Sec. 4:
    # s·h·(34 + 5·a·s/h) = 2048·12288·(34 + 80) per sample, and with t = 8 tensor ranks
    # s·h·(10 + 24/8 + 5·a·s/(8h)) = 2048·12288·(10 + 3 + 10).
    arch = Architecture("gpt2", 96, 12288, 96, 96, 4 * 12288, 50257, 2048)
    assert models.layer_activation_bytes(arch, 2048) == 2048 * 12288 * 114 == 2_868_903_936
    assert models.layer_activation_bytes(arch, 2048, tp=8) == 2048 * 12288 * 23 == 578_813_952


def test_llama_layer_bytes_by_hand() -> None:
    # Llama 2 7B at s = 4096, per token: norm inputs 2·2h, attention and MLP inputs 2h each,
    # Q and output-projection input 2h each, K and V 2h each (32 KV heads), SwiGLU 4·2f,
    # softmax maps 2·a·s; no dropout.
    h, f, a, s = 4096, 11008, 32, 4096
    per_token = 4 * h + 2 * h + 2 * h + 2 * h + 2 * h + 2 * h + 2 * h + 8 * f + 2 * a * s
    assert models.layer_activation_bytes(get_model("llama2-7b").arch, s) == s * per_token
    # Llama 3 8B keeps K and V of 8 heads of 128
    h, f, kv = 4096, 14336, 1024
    per_token = 12 * h + 4 * kv + 8 * f + 2 * 32 * 8192
    assert models.layer_activation_bytes(get_model("llama3-8b").arch, 8192) == 8192 * per_token


def test_preset_totals_compose_the_layer_formula() -> None:
    spec = get_model("gpt2", seq_len=512)
    s, h, vocab, layers = 512, 768, 50257, 12
    layer = s * h * (34 + 5 * 12 * s / h)
    outside = s * h + 4 * s * h + 4 * s * vocab  # embedding dropout mask, norm + head inputs,
    assert spec.activation_bytes_per_sample == layers * layer + outside  # fp32 logits
    assert spec.checkpointed_activation_bytes_per_sample == layers * 2 * s * h + layer + outside


def _norm_statistics(seq: int, norms: int, per_norm_floats: int) -> int:
    # fp32 per-token statistics the norm kernels keep (LayerNorm mean and rstd, RMSNorm rstd);
    # the formula leaves these s-sized terms out.
    return norms * per_norm_floats * 4 * seq


@pytest.mark.parametrize("factory,dropout,extra", [
    ("gpt2_tiny", False, (2, 2)), ("gpt2_tiny_dropout", True, (2, 2)),
    ("llama_tiny_mha", False, (2, 1))])
def test_traced_layer_bytes_equal_the_formula(sim_models, factory: str, dropout: bool,
                                              extra: tuple[int, int]) -> None:
    gpt = factory.startswith("gpt2")
    shape = dict(sim_models.GPT2_TINY if gpt else sim_models.LLAMA_TINY_MHA)
    shape.setdefault("kv_heads", shape["heads"])
    shape.setdefault("ffn", 4 * shape["hidden"])
    arch = Architecture("gpt2" if gpt else "llama", **shape, dropout=dropout)
    seq = 16
    spec = trace_module(f"sim_models:{factory}", seq_len=seq, batch=2)
    # On meta (as on CPU) dropout keeps its mask as a tensor of the activation dtype: 2 bytes.
    formula = models.layer_activation_bytes(arch, seq, mask_bytes=2)
    assert spec.layer_activation_bytes_per_sample == formula + _norm_statistics(seq, *extra)
    assert spec.layer_input_bytes_per_sample == 2 * seq * shape["hidden"]


def test_traced_outside_bytes_by_hand(sim_models) -> None:
    seq, batch = 16, 2
    h, vocab = sim_models.GPT2_TINY["hidden"], sim_models.GPT2_TINY["vocab"]
    spec = trace_module("sim_models:gpt2_tiny", seq_len=seq, batch=batch)
    expected = (8 * seq                 # token ids (int64), kept by the embedding
                + 8 * seq / batch       # position ids, one row for the whole batch
                + 2 * seq * h + 8 * seq  # final LayerNorm input and statistics
                + 2 * seq * h           # LM head input
                + 2 * seq * vocab)      # the logits returned, alive until backward
    assert spec.outside_activation_bytes_per_sample == expected
    assert spec.activation_bytes_per_sample == 2 * spec.layer_activation_bytes_per_sample + expected
    assert spec.checkpointed_activation_bytes_per_sample == (
        2 * spec.layer_input_bytes_per_sample + spec.layer_activation_bytes_per_sample + expected)


@pytest.mark.parametrize("factory", ["gpt2_tiny", "llama_tiny"])
def test_trace_equals_the_real_model(sim_models, factory: str) -> None:
    model = getattr(sim_models, factory)()
    batch, seq = 2, 24
    with FlopCounterMode(display=False) as counter:
        model(torch.zeros(batch, seq, dtype=torch.long))
    spec = trace_module(f"sim_models:{factory}", seq_len=seq, batch=batch)
    assert spec.params == tuple((n, tuple(p.shape)) for n, p in model.named_parameters())
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    assert spec.forward_flops_per_sample * batch == counter.get_total_flops()
    assert spec.layers == 2 and (spec.hidden, spec.heads, spec.vocab) == (0, 0, 0)


def test_trace_counts_sdpa_attention_on_meta() -> None:
    # F.scaled_dot_product_attention runs as matmuls on the meta device, so its FLOPs count
    eager = trace_module("sim_models:gpt2_tiny", seq_len=16)
    sdpa = trace_module("sim_models:gpt2_tiny_sdpa", seq_len=16)
    assert sdpa.forward_flops_per_sample == eager.forward_flops_per_sample


def test_trace_with_an_example_hook() -> None:
    plain = trace_module("sim_models:gpt2_tiny", seq_len=16, batch=2)
    with_loss = trace_module("sim_models:gpt2_tiny", seq_len=16, batch=2,
                             example="sim_models:tokens_and_targets")
    assert with_loss.params == plain.params
    assert with_loss.forward_flops_per_sample == plain.forward_flops_per_sample
    assert with_loss.layer_activation_bytes_per_sample == plain.layer_activation_bytes_per_sample


def test_billions_of_parameters_trace_in_seconds_without_memory() -> None:
    process = psutil.Process()
    before = process.memory_info().rss
    start = time.perf_counter()
    spec = trace_module("sim_models:llama2_7b_shaped", seq_len=256)
    elapsed = time.perf_counter() - start
    grown = process.memory_info().rss - before
    preset = get_model("llama2-7b", seq_len=256)
    assert spec.params == preset.params and spec.num_params == 6_738_415_616
    assert spec.forward_flops_per_sample == preset.forward_flops_per_sample
    assert elapsed < 15, f"tracing took {elapsed:.1f} s"
    assert grown < 300e6, f"RSS grew by {grown / 1e6:.0f} MB (bf16 weights would be 13.5 GB)"


def test_param_specs_feed_the_step_planner() -> None:
    from flowtrain.plan import plan_buckets

    spec = get_model("gpt2")
    buckets = plan_buckets(spec.param_specs(), bucket_numel=50_000_000)
    assert sum(b.numel for b in buckets) == spec.num_params
    assert spec.param_specs("float32")[0] == ("transformer.wte.weight", (50257, 768), "float32", 4)


# -- errors -------------------------------------------------------------------------------------

def test_unknown_preset_lists_the_choices() -> None:
    with pytest.raises(ValueError,
                       match=r"unknown model preset 'gpt3'.*gpt2, gpt2-medium.*llama3-70b"):
        get_model("gpt3")


@pytest.mark.parametrize("seq_len,message", [(0, "integer > 0, got 0"), (2.5, "got 2.5"),
                                             (2048, "longer than gpt2's 1024")])
def test_bad_seq_len(seq_len: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_model("gpt2", seq_len=seq_len)  # type: ignore[arg-type]


def test_llama_may_run_past_its_context() -> None:
    assert get_model("llama2-7b", seq_len=8192).seq_len == 8192


@pytest.mark.parametrize("factory", ["sim_models", "sim_models:", ":gpt2_tiny", "a:b:c",
                                     "sim models:gpt2_tiny"])
def test_malformed_factory_string(factory: str) -> None:
    with pytest.raises(ValueError, match=r"must look like 'package.module:function', got"):
        trace_module(factory, seq_len=8)


def test_factory_module_that_does_not_import() -> None:
    with pytest.raises(ValueError, match=r"cannot import 'no_such_module_xyz'"):
        trace_module("no_such_module_xyz:build", seq_len=8)


def test_missing_factory_lists_the_module_s_callables() -> None:
    with pytest.raises(ValueError, match=r"has no 'gpt3'; callables defined there: .*gpt2_tiny"):
        trace_module("sim_models:gpt3", seq_len=8)


def test_factory_that_returns_no_module() -> None:
    with pytest.raises(TypeError, match=r"returned int, not a torch.nn.Module"):
        trace_module("sim_models:not_a_module", seq_len=8)


def test_forward_failure_names_the_inputs_and_the_example_hook() -> None:
    # 64 tokens against a 32-position causal mask
    with pytest.raises(RuntimeError, match=r"failed on meta inputs \(\(1, 64\) int64\).*example="):
        trace_module("sim_models:gpt2_tiny", seq_len=64)


@pytest.mark.parametrize("kwargs,message", [
    ({"seq_len": 0}, "seq_len must be an integer > 0, got 0"),
    ({"seq_len": 8, "batch": 0}, "batch must be an integer > 0, got 0"),
    ({"seq_len": 8, "dtype": "int8"}, "dtype 'int8' is not supported; choose one of float32")])
def test_bad_trace_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        trace_module("sim_models:gpt2_tiny", **kwargs)


def test_bad_architecture() -> None:
    with pytest.raises(ValueError, match=r"family 'bert' is not known; choose one of gpt2, llama"):
        Architecture("bert", 2, 64, 4, 4, 256, 10, 16)
    with pytest.raises(ValueError, match=r"hidden 65 must divide into heads 4"):
        Architecture("gpt2", 2, 65, 4, 4, 256, 10, 16)


def test_the_package_exports_each_name_from_its_module() -> None:
    import importlib

    import sims

    assert sims.__all__ == sorted(sims._EXPORTS)  # the list is spelled out for linters
    for name, module in sims._EXPORTS.items():
        assert getattr(sims, name) is getattr(importlib.import_module(module), name), name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        sims.nope  # noqa: B018
