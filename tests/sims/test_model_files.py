"""sims.model_files and sims.hf_config: an architecture file and a Hugging Face config read into
the same Architecture as the preset they describe, parameter counts against transformers' own
models built from tiny configs, and errors that name the key."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

import hf_models
from sims.architecture import PRESETS, architecture_params
from sims.hf_config import architecture_from_hf
from sims.model_files import ModelFileError, architecture_dict, read_model_file
from sims.models import get_model

# the keys that matter of meta-llama/Meta-Llama-3-8B's and openai-community/gpt2's config.json
LLAMA3_8B_HF = hf_models.LLAMA3_8B
GPT2_HF = {**hf_models.GPT2_MEDIUM, "n_embd": 768, "n_head": 12, "n_layer": 12}


def _write(tmp_path: Path, name: str, data: dict[str, Any]) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("preset", ["llama3-8b", "gpt2", "llama2-70b", "gpt2-xl"])
def test_an_architecture_file_is_the_preset(tmp_path: Path, preset: str) -> None:
    arch = PRESETS[preset]
    path = _write(tmp_path, "arch.json", architecture_dict(arch, name=preset))
    from_file = get_model(path, seq_len=1024)
    from_preset = get_model(preset, seq_len=1024)
    assert from_file.arch == arch
    assert from_file.params == from_preset.params
    assert from_file.forward_flops_per_sample == from_preset.forward_flops_per_sample
    assert from_file.activation_bytes_per_sample == from_preset.activation_bytes_per_sample
    assert from_file.name == preset


@pytest.mark.parametrize("preset,config", [("llama3-8b", LLAMA3_8B_HF), ("gpt2", GPT2_HF)])
def test_a_hugging_face_config_is_the_preset(tmp_path: Path, preset: str,
                                             config: dict[str, Any]) -> None:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    spec = get_model(str(directory))  # a directory holding config.json
    expected = get_model(preset)
    assert spec.params == expected.params
    assert spec.forward_flops_per_sample == expected.forward_flops_per_sample
    assert spec.activation_bytes_per_sample == expected.activation_bytes_per_sample
    assert spec.seq_len == expected.seq_len  # the config's maximum positions, with a note
    assert any("maximum positions" in note for note in spec.notes)
    assert get_model(str(directory), seq_len=512).notes == ()


def _hf_count(model_type: str, **sizes: Any) -> tuple[int, dict[str, Any]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(model_type, **sizes)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()), config.to_dict()


_SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "vocab_size": 100, "max_position_embeddings": 32}


@pytest.mark.parametrize("model_type,sizes,unpriced", [
    ("llama", {**_SIZES, "intermediate_size": 176, "num_key_value_heads": 2}, 0),
    ("mistral", {**_SIZES, "intermediate_size": 176, "num_key_value_heads": 2}, 0),
    ("gemma", {**_SIZES, "intermediate_size": 176, "num_key_value_heads": 1, "head_dim": 32},
     0),
    ("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_positions": 32},
     0),
    ("gpt_neox", {**_SIZES, "intermediate_size": 256}, 0),
    ("opt", {**_SIZES, "ffn_dim": 256, "word_embed_proj_dim": 64}, 0),
    ("falcon", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "vocab_size": 100}, 0),
    ("falcon", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "vocab_size": 100, "new_decoder_architecture": True, "num_kv_heads": 2}, 0),
    ("starcoder2", {**_SIZES, "intermediate_size": 256, "num_key_value_heads": 2}, 0),
    # what an Architecture does not hold, each named in the notes: Qwen2's Q/K/V biases
    # (64 + 2 x 32 per layer), Phi's LM-head bias (100)
    ("qwen2", {**_SIZES, "intermediate_size": 176, "num_key_value_heads": 2}, 2 * 128),
    ("phi", {**_SIZES, "intermediate_size": 256}, 100),
])
def test_parameter_counts_equal_transformers_models(model_type: str, sizes: dict[str, Any],
                                                    unpriced: int) -> None:
    real, config = _hf_count(model_type, **sizes)
    arch, notes, _ = architecture_from_hf(config, model_type)
    ours = sum(math.prod(shape) for _, shape in architecture_params(arch))
    assert ours + unpriced == real
    if unpriced:
        assert any("not priced" in note for note in notes)


def test_features_the_model_type_fixes() -> None:
    neox, _, _ = architecture_from_hf({**_SIZES, "model_type": "gpt_neox",
                                       "intermediate_size": 256}, "x")
    assert (neox.norm, neox.activation, neox.position, neox.tied_embeddings) == \
        ("layernorm", "gelu", "rotary", False)
    gemma, _, _ = architecture_from_hf({**_SIZES, "model_type": "gemma", "head_dim": 32,
                                        "intermediate_size": 176,
                                        "hidden_act": "gelu_pytorch_tanh"}, "x")
    assert (gemma.activation, gemma.head_dim, gemma.q_dim) == ("geglu", 32, 128)
    falcon, _, _ = architecture_from_hf({"model_type": "falcon", "hidden_size": 64,
                                         "num_hidden_layers": 2, "num_attention_heads": 4,
                                         "vocab_size": 100, "multi_query": True}, "x", 128)
    assert (falcon.kv_heads, falcon.parallel_block, falcon.context) == (1, True, 128)


def test_an_unknown_model_type_reads_its_features_from_its_keys() -> None:
    arch, notes, _ = architecture_from_hf({**_SIZES, "model_type": "mymodel",
                                           "intermediate_size": 176, "hidden_act": "silu",
                                           "rms_norm_eps": 1e-6, "rope_theta": 1e4}, "x")
    assert (arch.norm, arch.activation, arch.position) == ("rmsnorm", "swiglu", "rotary")
    assert "not one flowtrain knows" in notes[0]


@pytest.mark.parametrize("config,message", [
    ({**_SIZES, "model_type": "mixtral", "num_local_experts": 8, "intermediate_size": 64},
     r"mixture of experts \(num_local_experts 8\)"),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10,
      "intermediate_size": 64}, r"no layers \(num_hidden_layers or n_layer"),
    ({**_SIZES, "model_type": "llama"}, "no intermediate_size for its gated MLP"),
    ({**_SIZES, "model_type": "gpt2", "activation_function": "mish"},
     "activation 'mish' is not known"),
])
def test_bad_hugging_face_configs(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        architecture_from_hf(config, "config.json")


@pytest.mark.parametrize("data,message", [
    ({"layers": 2, "hidden": 64, "heads": 4, "vocab": 10, "context": 8, "hiden": 3},
     r"hiden: unknown key; did you mean hidden\?"),
    ({"layers": 2, "hidden": 64, "heads": 4, "vocab": 10, "context": 8},
     "ffn is required with a gated activation"),
    ({"layers": "two", "hidden": 64, "heads": 4, "vocab": 10, "context": 8, "ffn": 8},
     "layers: Input should be a valid integer"),
    ({"layers": 2, "hidden": 64, "heads": 4, "vocab": 10, "ffn": 8},
     "give context .* or seq_len"),
    ({"layers": 2, "hidden": 64, "heads": 4, "vocab": 10, "context": 8, "ffn": 8,
      "kv_heads": 3}, "heads 4 must divide into kv_heads 3"),
    ({"layers": 2, "hidden": 64, "heads": 4, "vocab": 10, "context": 8, "ffn": 8,
      "norm": "batchnorm"}, "norm: Input should be 'layernorm' or 'rmsnorm'"),
])
def test_bad_architecture_files_name_the_key(tmp_path: Path, data: dict[str, Any],
                                             message: str) -> None:
    path = _write(tmp_path, "bad.json", data)
    with pytest.raises(ModelFileError, match=message):
        read_model_file(path)


def test_unreadable_model_files(tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ModelFileError, match="is not valid JSON"):
        read_model_file(str(broken))
    listed = tmp_path / "list.json"
    listed.write_text("[1]")
    with pytest.raises(ModelFileError, match="must hold a JSON object, got list"):
        read_model_file(str(listed))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFileError, match="a directory without a config.json"):
        read_model_file(str(tmp_path / "empty"))


def test_a_file_states_its_training_length(tmp_path: Path) -> None:
    data = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 10, "context": 4096,
            "seq_len": 1024, "ffn": 176}
    path = _write(tmp_path, "a.json", data)
    assert get_model(path).seq_len == 1024
    assert get_model(path, seq_len=256).seq_len == 256
    gpt = _write(tmp_path, "g.json", {**data, "family": "gpt2", "context": 512,
                                      "seq_len": 512})
    with pytest.raises(ValueError, match="longer than g's 512 learned positions"):
        get_model(gpt, seq_len=1024)
