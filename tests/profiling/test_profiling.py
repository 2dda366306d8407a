"""The FLOPs profiler (flowtrain.profiling) against FLOPs counted by hand: 2*m*n*k per matmul,
attention's QK^T and AV included; per-module attribution, repeated calls, the printed report,
DeepSpeed's string formats, get_model_profile, the config section and the engine hook."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import engine_common as ec
from flowtrain.profiling import (
    FlopsProfiler,
    duration_to_string,
    flops_to_string,
    get_model_profile,
    macs_to_string,
    number_to_string,
    params_to_string,
)


@pytest.fixture(autouse=True)
def no_host_profile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A calibrated profile of the machine running the tests must not change the MFU lines."""
    monkeypatch.setenv("FLOWTRAIN_HOST_PROFILE", str(tmp_path / "no_such_profile.json"))


# -- models and their hand counts --------------------------------------------------------------

BATCH = 5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class LinearNet(nn.Module):
    """``block`` runs twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.block = Block()
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = self.block(self.block(h))
        return self.head(h)


def linear_net_flops(b: int) -> dict[str, int]:
    inp, up, down, head = 2 * b * 8 * 32, 2 * b * 32 * 64, 2 * b * 64 * 32, 2 * b * 32 * 3
    return {"": inp + 2 * (up + down) + head, "inp": inp, "block": 2 * (up + down),
            "block.up": 2 * up, "block.down": 2 * down, "head": head}


D, HEADS, SEQ, VOCAB, LAYERS, TBATCH = 16, 4, 6, 11, 2, 2
DH = D // HEADS


class Attention(nn.Module):
    def __init__(self, sdpa: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.sdpa = sdpa

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, HEADS, DH).transpose(1, 2)
                   for t in self.qkv(x).split(D, dim=-1))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(DH)
            y = att.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, s, D))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, 4 * D)
        self.out = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Layer(nn.Module):
    def __init__(self, sdpa: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.attn = Attention(sdpa)
        self.ln2 = nn.LayerNorm(D)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, sdpa: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Layer(sdpa) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))


def tiny_gpt_flops() -> dict[str, int]:
    tokens = TBATCH * SEQ
    qkv, proj = 2 * tokens * D * 3 * D, 2 * tokens * D * D
    scores = 2 * TBATCH * HEADS * SEQ * SEQ * DH  # QK^T: (S x dh) @ (dh x S) per batch and head
    mix = 2 * TBATCH * HEADS * SEQ * SEQ * DH  # AV: (S x S) @ (S x dh)
    fc, out = 2 * tokens * D * 4 * D, 2 * tokens * 4 * D * D
    head = 2 * tokens * D * VOCAB
    attn = qkv + scores + mix + proj
    layer = attn + fc + out
    return {"qkv": qkv, "proj": proj, "scores": scores, "mix": mix, "fc": fc, "out": out,
            "attn": attn, "mlp": fc + out, "layer": layer, "head": head,
            "total": LAYERS * layer + head}


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (TBATCH, SEQ), generator=torch.Generator().manual_seed(0))


def profiled(model: nn.Module, *args: Any, **kwargs: Any) -> FlopsProfiler:
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(*args, **kwargs)
    prof.stop_profile()
    return prof


# -- counting ------------------------------------------------------------------------------------

def test_linear_model_matches_hand_count_per_module() -> None:
    torch.manual_seed(0)
    model = LinearNet()
    prof = profiled(model, torch.randn(BATCH, 8))
    expected = linear_net_flops(BATCH)
    rows = {r.name: r for r in prof.module_rows()}
    assert prof.get_total_flops() == expected[""]
    assert {name: rows[name].flops for name in expected} == expected
    # every counted op is a contraction: MACs = in * out per sample and layer, FLOPs / 2
    assert prof.get_total_macs() == BATCH * (8 * 32 + 2 * (32 * 64 + 64 * 32) + 32 * 3)
    assert all(r.macs * 2 == r.flops for r in rows.values())
    # the block and its layers ran twice per forward: both calls counted
    assert (rows["block"].calls, rows["block.up"].calls, rows["inp"].calls) == (2, 2, 1)
    assert rows["block"].flops == 2 * (rows["block.up"].flops + rows["block.down"].flops) // 2
    assert prof.get_total_params() == sum(p.numel() for p in model.parameters()) == 4579
    assert {n: r.params for n, r in rows.items()} == {
        n: sum(p.numel() for p in m.parameters()) for n, m in model.named_modules()}
    assert all(r.duration > 0 for r in rows.values())
    assert prof.get_total_duration() == rows[""].duration
    # rows at each depth add up to the model's total (the model's own work is ReLUs only)
    depth1 = sum(r.flops for r in rows.values() if r.depth == 1)
    depth2 = sum(r.flops for r in rows.values() if r.depth == 2)
    assert depth1 == expected[""]
    assert depth2 + rows["inp"].flops + rows["head"].flops == expected[""]


def test_module_called_twice_counts_twice() -> None:
    class Twice(nn.Module):
        def __init__(self, calls: int) -> None:
            super().__init__()
            self.fc = nn.Linear(10, 10)
            self.calls = calls

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(self.calls):
                x = self.fc(x)
            return x

    once = profiled(Twice(1), torch.randn(3, 10))
    twice = profiled(Twice(2), torch.randn(3, 10))
    assert once.get_total_flops() == 2 * 3 * 10 * 10
    assert twice.get_total_flops() == 2 * once.get_total_flops()
    fc = {r.name: r for r in twice.module_rows()}["fc"]
    assert (fc.calls, fc.flops) == (2, 2 * 2 * 3 * 10 * 10)


@pytest.mark.parametrize("sdpa", [False, True], ids=["explicit-matmuls", "sdpa"])
def test_small_transformer_matches_hand_count(sdpa: bool) -> None:
    torch.manual_seed(0)
    model = TinyGPT(sdpa)
    prof = profiled(model, tokens())
    want = tiny_gpt_flops()
    rows = {r.name: r for r in prof.module_rows()}
    assert prof.get_total_flops() == want["total"]
    assert prof.get_total_macs() == want["total"] // 2
    for i in range(LAYERS):
        p = f"layers.{i}"
        assert rows[p].flops == want["layer"]
        assert rows[f"{p}.attn"].flops == want["attn"]
        assert rows[f"{p}.attn.qkv"].flops == want["qkv"]
        assert rows[f"{p}.attn.proj"].flops == want["proj"]
        assert rows[f"{p}.mlp"].flops == want["mlp"]
        assert rows[f"{p}.mlp.fc"].flops == want["fc"]
        assert rows[f"{p}.mlp.out"].flops == want["out"]
        assert rows[f"{p}.ln1"].flops == 0
        # attention's own QK^T and AV matmuls: in the attention module, in none of its children
        assert rows[f"{p}.attn"].flops - rows[f"{p}.attn.qkv"].flops - \
            rows[f"{p}.attn.proj"].flops == want["scores"] + want["mix"]
    assert rows["head"].flops == want["head"]
    assert rows["emb"].flops == 0
    assert (rows["layers"].flops, rows["layers"].calls) == (LAYERS * want["layer"], 0)

    def at(depth: int) -> int:
        return sum(r.flops for r in rows.values() if r.depth == depth)

    assert at(1) == want["total"]  # emb, layers, ln_f, head
    assert at(2) + want["head"] == want["total"]  # layers.0, layers.1
    assert at(3) + want["head"] == want["total"]  # ln1, attn, ln2, mlp of each layer
    assert at(4) + want["head"] + LAYERS * (want["scores"] + want["mix"]) == want["total"]
    assert prof.get_total_params() == sum(p.numel() for p in model.parameters())


def test_rows_agree_with_flop_counter_modes_own_attribution() -> None:
    """FlopCounterMode keys its per-module counts by class-name path ("TinyGPT.layers.0");
    the profiler's hook attribution gives the same figures under state-dict names."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = TinyGPT()
    x = tokens()
    prof = profiled(model, x)
    with FlopCounterMode(display=False) as counter:
        model(x)
    theirs = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    mine = {("TinyGPT." + r.name if r.name else "TinyGPT"): r.flops
            for r in prof.module_rows() if r.flops and r.calls}
    assert mine == {k: v for k, v in theirs.items() if k != "Global"}


def test_start_resets_stop_keeps_end_drops() -> None:
    model = LinearNet()
    x = torch.randn(BATCH, 8)
    total = linear_net_flops(BATCH)[""]
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x)
    model(x)
    prof.stop_profile()
    assert prof.get_total_flops() == 2 * total
    model(x)  # not profiled: the figures stay
    assert prof.get_total_flops() == 2 * total
    assert model._forward_pre_hooks == {} and model.block.up._forward_hooks == {}
    prof.start_profile()  # starts from zero again
    model(x)
    prof.reset_profile()
    model(x)
    prof.stop_profile()
    assert prof.get_total_flops() == total
    prof.end_profile()
    assert prof.get_total_flops() == 0
    with pytest.raises(RuntimeError, match="nothing was profiled"):
        prof.print_model_profile()


def test_ignore_list_and_containers_report_their_childrens_sum() -> None:
    """An ignored class gets no hooks, and a ModuleList is iterated, never called: both report
    the sum of their children (as DeepSpeed does), and the model's total is unchanged."""
    model = LinearNet()
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=[Block])
    model(torch.randn(BATCH, 8))
    prof.stop_profile()
    rows = {r.name: r for r in prof.module_rows()}
    expected = linear_net_flops(BATCH)
    assert prof.get_total_flops() == expected[""]
    assert (rows["block"].flops, rows["block"].calls) == (expected["block"], 0)
    assert rows["block.up"].flops == expected["block.up"]
    assert rows["block"].duration == rows["block.up"].duration + rows["block.down"].duration


# -- strings and the printed profile --------------------------------------------------------------

def test_string_formats_follow_deepspeed() -> None:
    assert number_to_string(1_234_000_000) == "1.23 G"
    assert flops_to_string(1.23e9) == "1.23 GFLOPS"
    assert flops_to_string(8.19e13) == "81.9 TFLOPS"
    assert flops_to_string(102.0e12) == "102 TFLOPS"
    assert macs_to_string(3_139_930_000_000) == "3.14 TMACs"
    assert macs_to_string(512) == "512 MACs"
    assert params_to_string(336_230_000) == "336.23 M"
    assert params_to_string(688_150) == "688.15 K"
    assert number_to_string(6_279_860_000_000, units="G") == "6279.86 G"
    assert (number_to_string(512), number_to_string(0)) == ("512", "0")
    assert duration_to_string(0.07667) == "76.67 ms"
    assert duration_to_string(34.09e-6) == "34.09 us"
    assert duration_to_string(1.84) == "1.84 s"
    prof = profiled(LinearNet(), torch.randn(BATCH, 8))
    total = linear_net_flops(BATCH)[""]  # 85_440
    assert prof.get_total_flops(as_string=True) == number_to_string(total) == "85.44 K"
    assert prof.get_total_macs(as_string=True) == "42.72 KMACs"
    assert prof.get_total_params(as_string=True) == "4.58 K"
    assert prof.get_total_duration(as_string=True).endswith(("s", "ms", "us"))


def test_print_model_profile_rows_and_output_file(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    model = LinearNet()
    prof = profiled(model, torch.randn(BATCH, 8))
    total = linear_net_flops(BATCH)[""]
    out = tmp_path / "profile.txt"
    prof.print_model_profile(profile_step=3, module_depth=1, top_modules=2, output_file=str(out))
    assert capsys.readouterr().out == ""
    text = out.read_text()
    assert "Profile summary at step 3:" in text
    assert f"{'fwd MACs per GPU:':<62} 42.72 KMACs" in text
    assert f"{'fwd flops per GPU:':<62} 85.44 K" in text
    assert f"{'params per GPU:':<62} 4.58 K" in text
    assert "MFU n/a (no peak known; pass peak_tflops or run flowtrain calibrate)" in text
    lines = text.splitlines()
    inp = next(line for line in lines if line.strip().startswith("(inp): Linear("))
    assert inp.strip().startswith("(inp): Linear(288, 6.29% Params, 1.28 KMACs, 3.00% MACs, "
                                  "2.56 K flops, ")
    block = next(line for line in lines if line.strip().startswith("(block): Block("))
    assert block.endswith(", 2 calls)")  # collapsed at module_depth 1, called twice
    assert not any("(up): Linear(" in line for line in lines)
    assert "depth 1:" in text and "depth 2:" not in text
    depth1 = lines[lines.index("depth 1:") + 2]
    assert depth1 == "    MACs        - {'Block': '40.96 KMACs', 'Linear': '1.76 KMACs'}"

    prof.print_model_profile(module_depth=-1, detailed=True)
    shown = capsys.readouterr().out
    assert "    (up): Linear(2.11 K, 46.12% Params, 20.48 KMACs, 47.94% MACs, 40.96 K flops" in \
        shown
    assert "depth 2:" in shown
    prof.print_model_profile(detailed=False)
    assert "Detailed profile" not in capsys.readouterr().out
    assert total == 85_440


def test_mfu_from_peak_tflops_and_calibrated_profile(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    model = LinearNet()
    x = torch.randn(BATCH, 8)
    prof = FlopsProfiler(model, peak_tflops=2e-6)  # 2 MFLOP/s
    prof.start_profile()
    model(x)
    prof.stop_profile()
    achieved = prof.get_total_flops() / prof.get_total_duration()
    prof.print_model_profile()
    text = capsys.readouterr().out
    assert f"{'MFU (forward only):':<62} {100 * achieved / 2e6:.2f}%" in text
    assert "(peak_tflops)" in text

    calibrated_cpu_profile(tmp_path, monkeypatch, float32=4e6)
    prof.peak_tflops = None
    prof.print_model_profile()
    text = capsys.readouterr().out
    assert f"{'MFU (forward only):':<62} {100 * achieved / 4e6:.2f}%" in text
    assert "this-host profile, float32" in text


def calibrated_cpu_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           float32: float) -> None:
    """Makes ``this-host`` a calibrated CPU profile with the given fp32 peak (FLOP/s)."""
    hardware = pytest.importorskip("sims.hardware")
    host = dataclasses.replace(hardware.get_profile("a100-80g-x8"), name="this-host", kind="cpu",
                               peak_flops={"float32": float32})
    path = tmp_path / "host.json"
    host.save(path)
    monkeypatch.setenv("FLOWTRAIN_HOST_PROFILE", str(path))


def test_peak_of_a_known_gpu_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from flowtrain.profiling.peak import dtype_key, find_peak

    pytest.importorskip("sims.hardware")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    peak = find_peak(torch.bfloat16, cuda)
    assert peak is not None and peak.flops_per_s == pytest.approx(989.4e12)
    assert "h200-x8" in peak.source
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert find_peak(torch.float32, cuda).flops_per_s == pytest.approx(66.9e12)  # type: ignore
        torch.backends.cuda.matmul.allow_tf32 = True
        assert dtype_key(torch.float32, cuda) == "tfloat32"
        assert find_peak(torch.float32, cuda).flops_per_s == pytest.approx(494.7e12)  # type: ignore
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    assert find_peak(torch.bfloat16, cuda) is None
    assert find_peak(torch.bfloat16, cuda, peak_tflops=100.0).flops_per_s == 100e12  # type: ignore


# -- get_model_profile -------------------------------------------------------------------------

def test_get_model_profile_same_figures(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    want = tiny_gpt_flops()["total"]
    params = sum(p.numel() for p in model.parameters())
    got = get_model_profile(model, args=[tokens()], print_profile=False, as_string=False)
    assert got == (want, want // 2, params)
    assert capsys.readouterr().out == ""
    got = get_model_profile(model, kwargs={"tokens": tokens()}, print_profile=False, warm_up=0)
    assert got == (number_to_string(want), macs_to_string(want // 2), params_to_string(params))
    lin = LinearNet()
    out = tmp_path / "p.txt"
    got = get_model_profile(lin, input_shape=(BATCH, 8), as_string=False, output_file=str(out),
                            module_depth=2)
    assert got == (85_440, 42_720, 4579)
    assert "(down): Linear(" in out.read_text()
    assert lin._forward_pre_hooks == {}  # nothing left behind


def test_bad_input_is_refused_with_the_right_form(tmp_path: Path) -> None:
    model = LinearNet()
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        FlopsProfiler("model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="recompute_fwd_factor must be a number >= 0.*got -1"):
        FlopsProfiler(model, recompute_fwd_factor=-1)
    with pytest.raises(ValueError, match="peak_tflops must be a positive number.*got 0"):
        FlopsProfiler(model, peak_tflops=0)
    prof = FlopsProfiler(model)
    with pytest.raises(TypeError, match="ignore_list must hold torch.nn.Module classes"):
        prof.start_profile(ignore_list=[int])
    with pytest.raises(TypeError, match="ignore_list must be a list"):
        prof.start_profile(ignore_list=nn.Linear)  # type: ignore[arg-type]
    prof.start_profile()
    with pytest.raises(RuntimeError, match="already running"):
        prof.start_profile()
    model(torch.randn(2, 8))
    prof.stop_profile()
    with pytest.raises(ValueError, match="module_depth must be an integer >= -1.*got -2"):
        prof.print_model_profile(module_depth=-2)
    with pytest.raises(ValueError, match="top_modules must be an integer >= 1.*got 0"):
        prof.print_model_profile(top_modules=0)
    missing = tmp_path / "nope" / "p.txt"
    with pytest.raises(ValueError, match="output_file .*nope.* does not exist"):
        prof.print_model_profile(output_file=str(missing))
    with pytest.raises(ValueError, match="needs the model's input"):
        get_model_profile(model)
    with pytest.raises(ValueError, match=r"input_shape must be a tuple of positive ints.*\(0, 8\)"):
        get_model_profile(model, input_shape=(0, 8))
    with pytest.raises(ValueError, match="either input_shape or args"):
        get_model_profile(model, input_shape=(2, 8), args=[torch.randn(2, 8)])
    with pytest.raises(ValueError, match="warm_up must be an integer >= 0.*got -1"):
        get_model_profile(model, input_shape=(2, 8), warm_up=-1)


# -- config and engine --------------------------------------------------------------------------

@pytest.mark.parametrize("section, message", [
    ({"profile_step": 0}, "flops_profiler.profile_step: expected an integer > 0, got 0"),
    ({"module_depth": -2}, "flops_profiler.module_depth: expected an integer >= -1, got -2"),
    ({"top_modules": 0}, "flops_profiler.top_modules: expected an integer > 0, got 0"),
    ({"recompute_fwd_factor": -1},
     "flops_profiler.recompute_fwd_factor: expected a number >= 0, got -1.0"),
    ({"output_file": 5}, "flops_profiler.output_file: expected a string, got 5"),
    ({"detailed": "yes"}, "flops_profiler.detailed: expected true or false, got \"yes\""),
])
def test_config_section_rejects_bad_values(section: dict[str, Any], message: str) -> None:
    from flowtrain.config import load_config
    from flowtrain.config.load import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 1, "flops_profiler": {"enabled": True, **section}})
    assert message in str(err.value)


def test_config_section_is_supported() -> None:
    from flowtrain.config import load_config

    cfg = load_config({"train_batch_size": 1, "flops_profiler": {
        "enabled": True, "profile_step": 3, "module_depth": 2, "top_modules": 4,
        "detailed": False, "output_file": "p.txt", "recompute_fwd_factor": 1.0}})
    fp = cfg.flops_profiler
    assert (fp.enabled, fp.profile_step, fp.module_depth, fp.top_modules, fp.detailed,
            fp.output_file, fp.recompute_fwd_factor) == (True, 3, 2, 4, False, "p.txt", 1.0)


def test_engine_prints_the_profile_once_at_profile_step(world1: Any, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    from flowtrain import initialize

    peak = 1e9
    calibrated_cpu_profile(tmp_path, monkeypatch, float32=peak)

    micro, gas = 4, 2
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
              "steps_per_print": 1000,
              "flops_profiler": {"enabled": True, "profile_step": 2, "top_modules": 2}}
    model = ec.make_model(7)
    engine, _, _, _ = initialize(model=model, optimizer=torch.optim.SGD(model.parameters(),
                                                                        lr=0.01), config=config)
    plain, _, _, _ = initialize(model=ec.make_model(7), optimizer=torch.optim.SGD(
        ec.make_model(7).parameters(), lr=0.01), config={"train_batch_size": 4})
    try:
        assert plain.flops_profiler is None
        hook = engine.flops_profiler
        assert hook is not None and not hook.printed
        forward = 2 * micro * (ec.IN_DIM * 16 + 16 * 16 + 16 * 1)  # fc1, fc2, head: 3200
        printed = []
        step_seconds = []
        for step in range(4):
            for m in range(gas):
                x, y = ec.micro_batch(step, 0, m, micro)
                engine.backward(nn.functional.mse_loss(engine(x), y))
                engine.step()
                printed.append(capsys.readouterr().out)
            step_seconds.append(engine.timer.breakdown(1)["step_s"])
        profiles = [i for i, out in enumerate(printed) if "flowtrain FLOPs profiler" in out]
        assert profiles == [5]  # after the last micro-batch of step 2 (the third step)
        text = printed[5]
        assert text.count("Profile summary at step 2:") == 1
        assert hook.totals is not None
        assert hook.totals["flops"] == forward
        assert hook.totals["macs"] == forward // 2
        assert hook.totals["params"] == sum(p.numel() for p in model.parameters()) == 448
        assert f"{'fwd flops per GPU:':<62} {number_to_string(forward)}" in text
        assert f"{'batch size per GPU:':<62} {micro}" in text
        step_flops = 3 * forward * gas
        assert f"step flops per GPU = 3 * fwd flops per GPU * {gas} micro-batches:" in text
        assert number_to_string(step_flops) in text
        assert "samples/second:" in text and "bwd latency" in text
        # MFU of the step: (3 x forward flops) x micro-batches over the step's wall time
        mfu = 100 * step_flops / step_seconds[2] / peak
        assert f"{'MFU (training step):':<62} {mfu:.2f}%" in text
        assert "(unused): Linear(15, 3.35% Params, 0 MACs" in text
        # everything removed afterwards: the class's step() and no hooks
        assert "step" not in engine.__dict__
        assert not engine._forward_pre_hooks and not engine._forward_hooks
    finally:
        engine.destroy()
        plain.destroy()
