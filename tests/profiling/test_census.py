"""A forward's other ops (``flowtrain.profiling.census``) and what the simulator makes of them:
the census of a small transformer block counted by hand, on real tensors and on the meta device;
the calibration fit of per-class op costs on recorded measurements; the profile's op_costs
field; and the planner adding exactly the census ops' measured cost to a forward and a
backward."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from flowtrain.profiling.census import OpCensus, attention_flops, op_class
from sim_helpers import cpu_profile, sim_config, tiny_workload
from sims.calibrate import ops as calibrate_ops
from sims.calibrate.fits import fit_op_costs
from sims.engine_costs import OP_COST_CLASSES
from sims.hardware import HardwareProfile, Link, ProfileError
from sims.planner import Layout, Workload, build_plan

B, T, C, H = 2, 8, 16, 4


class Block(nn.Module):
    """A pre-norm transformer block: 2 LayerNorms, qkv and output projections, causal
    attention, a GELU MLP, 2 residual adds."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.up, self.down = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


MATMUL_FLOPS = 2 * B * T * (C * 3 * C + C * C + C * 4 * C + 4 * C * C)
ATTENTION_FLOPS = 4 * B * H * T * T * (C // H)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_census_of_a_transformer_block_matches_the_hand_count(device: str) -> None:
    with torch.device(device):
        block = Block()
        x = torch.randn(B, T, C)
    with OpCensus() as census:
        block(x)
    got = census.summary()
    assert got["matmul_flops"] == MATMUL_FLOPS
    assert got["attention_calls"] == 1 and got["attention_flops"] == ATTENTION_FLOPS
    ops = got["ops"]
    assert ops["norm"] == [2, 2 * B * T * C]
    assert ops["activation"] == [1, B * T * 4 * C]
    # the residual adds at least (a reshape of the attention output may copy on meta)
    assert ops["elementwise"][0] >= 2 and ops["elementwise"][1] >= 2 * B * T * C
    assert ops["view"][0] >= 8 and ops["view"][1] == 0
    assert "softmax" not in ops  # attention's own softmax is inside its whole call


def test_census_flops_agree_with_the_flop_counter_on_meta() -> None:
    """On meta, attention runs as bmm's the flop counter counts: its total is the census's
    matmul plus attention FLOPs (on a CPU the fused kernel has no flop formula)."""
    with torch.device("meta"):
        block, x = Block(), torch.randn(B, T, C)
    with FlopCounterMode(display=False) as counter, OpCensus() as census:
        block(x)
    got = census.summary()
    assert counter.get_total_flops() == got["matmul_flops"] + got["attention_flops"]


def test_op_classes_and_attention_formula() -> None:
    assert op_class("addmm") is None and op_class("bmm") is None
    assert op_class("native_layer_norm") == "norm" and op_class("_log_softmax") == "softmax"
    assert op_class("gelu") == "activation" and op_class("transpose") == "view"
    assert op_class("some_new_op") == "elementwise"
    q = torch.empty(3, 5, 7, 4, device="meta")
    k = torch.empty(3, 5, 9, 4, device="meta")
    v = torch.empty(3, 5, 9, 6, device="meta")
    assert attention_flops(q, k, v) == 2 * 15 * 7 * 9 * 4 + 2 * 15 * 7 * 9 * 6


def _records(latency: float, per_element: float, threads: int = 1) -> list[dict]:
    """Recorded measurements of every class at two sizes from a known line (backward twice
    the forward)."""
    out = []
    for cls in OP_COST_CLASSES:
        for size in (1e3, 1e6):
            calls = 2 if cls == "elementwise" else 1
            size = 0.0 if cls == "view" else size
            fwd = calls * latency + size * per_element
            out.append({"threads": threads, "class": cls, "calls": calls, "size": size,
                        "forward_s": fwd, "backward_s": 2 * fwd})
    return out


def test_op_cost_fit_recovers_latency_and_rate_from_recorded_measurements() -> None:
    fitted = fit_op_costs(_records(5e-6, 1e-9) + _records(4e-6, 5e-10, 2))
    assert set(fitted) == {1, 2} and set(fitted[1]) == set(OP_COST_CLASSES)
    norm = fitted[1]["norm"]
    assert norm["forward"].latency_s == pytest.approx(5e-6)
    assert norm["forward"].bandwidth == pytest.approx(1e9)
    assert norm["backward"].latency_s == pytest.approx(1e-5)
    assert fitted[2]["elementwise"]["forward"].latency_s == pytest.approx(4e-6)
    assert fitted[2]["elementwise"]["forward"].bandwidth == pytest.approx(2e9)
    assert fitted[1]["view"]["forward"].latency_s == pytest.approx(5e-6)
    # a disturbed large size (no slower than the small one): its own rate, no latency
    flat = [dict(r, forward_s=1e-5) for r in _records(5e-6, 1e-9) if r["class"] == "norm"]
    link = fit_op_costs(flat)[1]["norm"]["forward"]
    assert link.latency_s == 0 and link.bandwidth == pytest.approx(1e6 / 1e-5)


def test_measured_op_costs_rise_with_size() -> None:
    """The live measurement (tiny settings): every class, both passes, positive times that grow
    with the elements (attention with its FLOPs)."""
    records = calibrate_ops.measure_ops([1], seconds_per_point=0.01, rounds=1)
    assert {r["class"] for r in records} == set(OP_COST_CLASSES)
    for cls in OP_COST_CLASSES:
        if cls == "view":
            continue
        small, large = sorted((r for r in records if r["class"] == cls),
                              key=lambda r: r["size"])
        assert 0 < small["forward_s"] < large["forward_s"], cls


def test_op_costs_round_trip_and_bad_classes_are_named(tmp_path: Path) -> None:
    costs = {1: {"norm": {"forward": Link(5e-6, 1e9), "backward": Link(1e-5, 5e8)}}}
    hw = cpu_profile(op_costs=costs)
    back = HardwareProfile.load(hw.save(tmp_path / "p.json"))
    assert back.engine.op_costs == costs and hash(back) == hash(hw)
    with pytest.raises(ProfileError, match="unknown op class 'rmsnorm'.*valid classes: view"):
        cpu_profile(op_costs={1: {"rmsnorm": {"forward": Link(1e-6, 1e9)}}})


def test_planner_adds_the_census_ops_cost_to_each_pass() -> None:
    """One rank: the forward grows by exactly the census ops' forward cost (at 2 threads, the
    nearest job factor), the backward by their backward cost, and attention FLOPs move from the
    matmul rate to attention's own."""
    link = {"forward": Link(1e-5, 1e9), "backward": Link(2e-5, 5e8)}
    hw = cpu_profile(op_costs={2: {cls: link for cls in OP_COST_CLASSES}})
    plain = tiny_workload()
    census = dataclasses.replace(plain, op_census=(("norm", 2.0, 100.0),
                                                   ("view", 6.0, 0.0)))
    cfg = sim_config(1)

    def passes(work: Workload) -> dict[str, float]:
        return {t.name: t.duration for t in build_plan(work, cfg, Layout(1, 1), hw).tasks}

    base, more = passes(plain), passes(census)
    micro = 2  # _cfg's micro-batch
    fwd = 8 * 1e-5 + 100 * micro / 1e9  # 8 calls; 100 norm elements per sample
    bwd = 8 * 2e-5 + 100 * micro / 5e8
    assert more["forward/mb0"] - base["forward/mb0"] == pytest.approx(1.25 * fwd)
    assert more["backward/mb0"] - base["backward/mb0"] == pytest.approx(1.25 * bwd)
    # half the FLOPs are attention: the matmul passes shrink, attention's cost is added
    attention = dataclasses.replace(plain, attention_calls=1.0,
                                    attention_flops_per_sample=plain.forward_flops_per_sample / 2)
    got = passes(attention)["forward/mb0"]
    half = dataclasses.replace(plain, forward_flops_per_sample=plain.forward_flops_per_sample / 2)
    expected = passes(half)["forward/mb0"] + 1.25 * (1e-5 + 1e5 / 2 * micro / 1e9)
    assert got == pytest.approx(expected)


def test_a_profile_without_op_costs_prices_the_census_at_nothing() -> None:
    hw = cpu_profile()
    census = dataclasses.replace(tiny_workload(), op_census=(("norm", 2.0, 100.0),))
    cfg = sim_config(1)
    assert [t.duration for t in build_plan(census, cfg, Layout(1, 1), hw).tasks] == \
        [t.duration for t in build_plan(tiny_workload(), cfg, Layout(1, 1), hw).tasks]


def test_a_collective_span_ends_when_its_collective_completed() -> None:
    """The reducer and the ZeRO-3 fetcher stamp a collective's end from its handle's completion
    callback (a shared-memory channel future, or a torch.distributed work's future), not when
    they later drain or await it."""
    import concurrent.futures
    import time
    from types import SimpleNamespace

    from flowtrain.engine.timing import completion_stamp, stamped_end

    channel_work: concurrent.futures.Future[None] = concurrent.futures.Future()
    future: torch.futures.Future[None] = torch.futures.Future()
    for work, done in ((channel_work, channel_work), (SimpleNamespace(get_future=lambda: future),
                                                      future)):
        stamp = completion_stamp(work)
        before = time.perf_counter()
        done.set_result(None)
        after = time.perf_counter()
        time.sleep(0.01)
        assert before <= stamped_end(stamp) <= after
    # a handle without a future (gloo's reduce-scatter): the time it is drained
    stamp = completion_stamp(SimpleNamespace())
    assert stamp == [] and stamped_end(stamp) >= after + 0.01


def test_weight_cost_fit_and_its_correction_of_a_linear_pass() -> None:
    """Equal-FLOP layers whose time grows 2e-11 s (forward) per byte of weights: the fit
    recovers the slope; a layer's pass is the curve's time plus the slope times its weights
    beyond the curve's own shapes' (log-interpolated by FLOPs), never below half the curve's."""
    from sims import costs
    from sims.calibrate.fits import fit_weight_cost
    from sims.calibrate.settings import WEIGHT_SHAPES

    records = [{"threads": 1, "rows": r, "in": i, "out": o, "flops": 2.0 * r * i * o,
                "forward_s": 1e-3 + 2e-11 * 4 * i * o, "backward_s": 2e-3 + 5e-11 * 4 * i * o}
               for r, i, o in WEIGHT_SHAPES]
    fitted = fit_weight_cost(records)
    assert fitted[1]["forward"] == pytest.approx(2e-11)
    assert fitted[1]["backward"] == pytest.approx(5e-11)
    hw = cpu_profile(weight_cost={1: {"forward": 2e-11, "backward": 5e-11}},
                     pass_weights=((1e4, 1e4), (1e6, 1e6)))
    base = costs.pass_seconds("forward", 1e5, 1, hw)
    # at 1e5 FLOPs the curve's shapes had 1e5 bytes of weights (log-linear between points)
    assert costs.pass_seconds("forward", 1e5, 1, hw, 1e5) == pytest.approx(base)
    assert costs.pass_seconds("forward", 1e5, 1, hw, 3e5) == pytest.approx(base + 2e-11 * 2e5)
    back = costs.pass_seconds("backward", 2e5, 1, hw)
    assert costs.pass_seconds("backward", 2e5, 1, hw, 3e5) == pytest.approx(back + 5e-11 * 2e5)
    assert costs.pass_seconds("forward", 1e5, 1, hw, 0.0) >= 0.5 * base
    with pytest.raises(ProfileError, match="engine.weight_cost.1.forward"):
        cpu_profile(weight_cost={1: {"forward": -1.0}}, pass_weights=((1e4, 1e4), (1e6, 1e6)))
