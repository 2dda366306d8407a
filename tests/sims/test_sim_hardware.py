"""sims.hardware and sims.costs: builtin figures against their published values, the ring and
hierarchical collective formulas, the roofline with its efficiency curve, profile JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from sims.costs import (
    ADAM_BYTES_PER_PARAM,
    collective_seconds,
    compute_seconds,
    copy_seconds,
    efficiency_at,
    optimizer_seconds,
    p2p_seconds,
)
from sims.hardware import BUILTIN_PROFILES, HardwareProfile, Link, ProfileError, get_profile

GB = 1e9
T = 1e12


def small_profile(**changes: object) -> HardwareProfile:
    """A profile with round numbers, so every expected cost below is worked out by hand."""
    base = HardwareProfile(
        name="test", kind="gpu", devices_per_node=4, device_memory_bytes=16 * 2**30,
        peak_flops={"float32": 1e12, "bfloat16": 4e12}, memory_bandwidth=100 * GB,
        intra_node=Link(1e-6, 100 * GB), inter_node=Link(5e-6, 40 * GB),
        host_to_device=Link(1e-5, 10 * GB), efficiency=((1e6, 0.2), (1e8, 0.6)),
        host_memory_bandwidth=20 * GB)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


# Published per-GPU figures (simulators.md's hardware table; FP32 from NVIDIA's A100
# datasheet and glennklockwood.com's H100 page), in the profile's units.
PUBLISHED = [
    ("a100-80g-x8", "peak_flops.bfloat16", 312 * T),
    ("a100-80g-x8", "peak_flops.float16", 312 * T),
    ("a100-80g-x8", "peak_flops.float32", 19.5 * T),
    # what nvidia-smi reports: "80GB" cards hold 80 GiB less the driver's reserve
    ("a100-80g-x8", "device_memory_bytes", 81920 * 2**20),
    ("a100-80g-x8", "memory_bandwidth", 2.039e12),
    ("a100-80g-x8", "intra_node.bandwidth", 600 * GB / 2),  # NVLink3, per direction
    ("a100-80g-x8", "inter_node.bandwidth", 8 * 200e9 / 8),  # 8 x HDR 200 Gb/s
    ("a100-80g-x8", "host_to_device.bandwidth", 32 * GB),  # PCIe Gen4 x16
    ("h100-x8", "peak_flops.bfloat16", 989.4 * T),
    ("h100-x8", "peak_flops.float32", 66.9 * T),
    ("h100-x8", "device_memory_bytes", 81559 * 2**20),
    ("h100-x8", "memory_bandwidth", 3.35e12),
    ("h100-x8", "intra_node.bandwidth", 900 * GB / 2),  # NVLink4, per direction
    ("h100-x8", "inter_node.bandwidth", 8 * 400e9 / 8),  # 8 x NDR 400 Gb/s
    ("h100-x8", "host_to_device.bandwidth", 64 * GB),  # PCIe Gen5 x16
    ("h200-x8", "peak_flops.bfloat16", 989.4 * T),
    ("h200-x8", "device_memory_bytes", 141 * GB),
    ("h200-x8", "memory_bandwidth", 4.8e12),
    ("h200-x8", "intra_node.bandwidth", 450 * GB),
    ("h200-x8", "inter_node.bandwidth", 400 * GB),
]


def figure(profile: HardwareProfile, dotted: str) -> float:
    value: object = profile
    for part in dotted.split("."):
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    assert isinstance(value, (int, float))
    return float(value)


@pytest.mark.parametrize(("name", "field", "published"), PUBLISHED)
def test_builtin_figures_match_published_values(name: str, field: str, published: float) -> None:
    profile = get_profile(name)
    assert figure(profile, field) == pytest.approx(published, rel=1e-9)
    assert field in profile.sources, f"{name}: no source noted for {field}"


def test_builtins_are_eight_gpu_nodes_with_every_dtype() -> None:
    for profile in BUILTIN_PROFILES.values():
        assert profile.devices_per_node == 8 and profile.kind == "gpu"
        assert {"float32", "bfloat16", "float16"} <= set(profile.peak_flops)
        assert profile.peak_flops["float32"] < profile.peak_flops["bfloat16"]


# ----------------------------------------------------------------------------- collectives

def test_ring_all_reduce_reduce_scatter_all_gather_broadcast() -> None:
    hw = small_profile()
    nbytes, n, lat, bw = 1e9, 4, 1e-6, 100 * GB
    assert collective_seconds("all_reduce", nbytes, n, hw) == pytest.approx(
        2 * 3 * lat + 2 * 3 / 4 * nbytes / bw)  # 0.015000006 s
    for op in ("reduce_scatter", "all_gather"):
        assert collective_seconds(op, nbytes, n, hw) == pytest.approx(
            3 * lat + 3 / 4 * nbytes / bw)
    assert collective_seconds("broadcast", nbytes, n, hw) == pytest.approx(3 * lat + nbytes / bw)
    # Two ranks: all-reduce moves the whole buffer once (2 * 1/2), in two latency steps.
    assert collective_seconds("all_reduce", 8e6, 2, hw) == pytest.approx(2e-6 + 8e6 / bw)
    assert collective_seconds("all_reduce", 8e6, 1, hw) == 0.0


def test_h100_all_reduce_of_one_gigabyte_over_eight_gpus() -> None:
    # 2 * 7/8 * 1e9 B / 450e9 B/s + 14 * 1 us = 3.903 ms
    t = collective_seconds("all_reduce", 1e9, 8, get_profile("h100-x8"))
    assert t == pytest.approx(2 * 7 / 8 * 1e9 / 450e9 + 14e-6)


def test_hierarchical_collectives_follow_the_three_phases() -> None:
    hw = small_profile()
    S, g, m = 1e9, 4, 2  # 8 ranks on 2 nodes of 4
    nic_bw = 40 * GB / 4  # each rank's share of its node's network bandwidth
    intra_rs = 3 * 1e-6 + 3 / 4 * S / (100 * GB)
    inter_ar = 2 * 1 * 5e-6 + 2 * 1 / 2 * (S / g) / nic_bw
    assert collective_seconds("all_reduce", S, g * m, hw, nodes=m) == pytest.approx(
        intra_rs + inter_ar + intra_rs)
    inter_rs = 1 * 5e-6 + 1 / 2 * (S / g) / nic_bw
    assert collective_seconds("reduce_scatter", S, 8, hw, nodes=2) == pytest.approx(
        intra_rs + inter_rs)
    assert collective_seconds("all_gather", S, 8, hw, nodes=2) == pytest.approx(
        intra_rs + inter_rs)


@pytest.mark.parametrize("name", sorted(BUILTIN_PROFILES))
def test_crossing_nodes_costs_more_than_staying_in_one(name: str) -> None:
    hw = get_profile(name)
    assert hw.inter_node.bandwidth / hw.devices_per_node < hw.intra_node.bandwidth
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        flat = collective_seconds(op, 2**30, 8, hw)
        assert collective_seconds(op, 2**30, 16, hw, nodes=2) > flat
        assert collective_seconds(op, 2**30, 64, hw, nodes=8) > flat


def test_fitted_collective_link_wins_over_the_ring_formula() -> None:
    hw = small_profile(collectives={"all_reduce": {4: Link(1e-3, 1 * GB)}})
    assert collective_seconds("all_reduce", 1e6, 4, hw) == pytest.approx(1e-3 + 1e-3)
    # Other rank counts and ops keep the formula.
    assert collective_seconds("all_reduce", 1e6, 2, hw) == pytest.approx(2e-6 + 1e6 / (100 * GB))
    assert collective_seconds("all_gather", 1e6, 4, hw) == pytest.approx(
        3e-6 + 0.75 * 1e6 / (100 * GB))
    # Across nodes the fitted intra-node phases are used too.
    fitted_rs = small_profile(collectives={"reduce_scatter": {4: Link(2e-3, 1 * GB)}})
    plain = collective_seconds("reduce_scatter", 1e6, 8, hw, nodes=2)
    expected = plain - (3e-6 + 0.75 * 1e6 / (100 * GB)) + (2e-3 + 1e6 / GB)
    assert collective_seconds("reduce_scatter", 1e6, 8, fitted_rs, nodes=2) == pytest.approx(
        expected)


def test_collective_input_errors_name_the_problem() -> None:
    hw = small_profile()
    with pytest.raises(ValueError, match=r"unknown collective 'allreduce'.*all_reduce, "
                                         r"reduce_scatter, all_gather, broadcast"):
        collective_seconds("allreduce", 1.0, 2, hw)
    with pytest.raises(ValueError, match=r"ranks \(10\) must be a multiple of nodes \(4\)"):
        collective_seconds("all_reduce", 1.0, 10, hw, nodes=4)
    with pytest.raises(ValueError, match=r"nbytes must be a finite number >= 0, got -1"):
        collective_seconds("all_reduce", -1, 2, hw)


def test_p2p_copy_and_optimizer_costs() -> None:
    hw = small_profile()
    assert p2p_seconds(1e9, hw, inter_node=False) == pytest.approx(1e-6 + 1e9 / (100 * GB))
    assert p2p_seconds(1e9, hw, inter_node=True) == pytest.approx(5e-6 + 1e9 / (10 * GB))
    assert copy_seconds(32e9, get_profile("a100-80g-x8")) == pytest.approx(1.0 + 10e-6)
    n = 7 * 10**9
    assert optimizer_seconds(n, hw) == pytest.approx(n * ADAM_BYTES_PER_PARAM / (100 * GB))
    assert optimizer_seconds(n, hw, on_host=True) == pytest.approx(n * 28 / (20 * GB))
    cpu = small_profile(kind="cpu", host_memory_bandwidth=0.0)
    assert optimizer_seconds(n, cpu, on_host=True) == optimizer_seconds(n, cpu)
    with pytest.raises(ProfileError, match="no host_memory_bandwidth"):
        optimizer_seconds(n, small_profile(host_memory_bandwidth=0.0), on_host=True)


# ----------------------------------------------------------------------------- compute

def test_efficiency_is_log_linear_and_clamped() -> None:
    hw = small_profile()
    assert efficiency_at(1e7, hw) == pytest.approx(0.4)  # halfway in log10 between 1e6 and 1e8
    assert efficiency_at(10**6.5, hw) == pytest.approx(0.3)
    assert efficiency_at(1e3, hw) == 0.2
    assert efficiency_at(1e12, hw) == 0.6


def test_roofline_takes_the_slower_of_math_and_memory() -> None:
    hw = small_profile()
    assert compute_seconds(1e7, 0, "float32", hw) == pytest.approx(1e7 / (1e12 * 0.4))
    assert compute_seconds(1e10, 1e3, "bfloat16", hw) == pytest.approx(1e10 / (4e12 * 0.6))
    # 1 MFLOP over 1 GB is memory-bound: 10 ms at 100 GB/s.
    assert compute_seconds(1e6, 1e9, "float32", hw) == pytest.approx(1e9 / (100 * GB))
    # An H100 GEMM of 128 GFLOP in bf16 at 95 % of 989.4 TFLOPS.
    assert compute_seconds(1.28e11, 0, "bfloat16", get_profile("h100-x8")) == pytest.approx(
        1.28e11 / (989.4e12 * 0.95))
    with pytest.raises(ValueError, match=r"no peak FLOP/s for dtype 'int8'.*bfloat16, float32"):
        compute_seconds(1.0, 0, "int8", hw)


# ----------------------------------------------------------------------------- JSON

@pytest.mark.parametrize("name", sorted(BUILTIN_PROFILES))
def test_profile_json_round_trip(name: str, tmp_path: Path) -> None:
    profile = get_profile(name)
    path = profile.save(tmp_path / "sub" / f"{name}.json")
    assert get_profile(str(path)) == profile
    assert HardwareProfile.from_dict(json.loads(path.read_text())) == profile


def test_profiles_are_hashable_values(tmp_path: Path) -> None:
    h100 = get_profile("h100-x8")
    copy = HardwareProfile.load(h100.save(tmp_path / "h100.json"))
    assert copy is not h100 and hash(copy) == hash(h100)
    assert len({h100, copy, get_profile("h200-x8")}) == 2


def test_round_trip_keeps_fitted_collectives_and_interference(tmp_path: Path) -> None:
    profile = small_profile(kind="cpu", comm_compute_interference=0.35,
                            collectives={"all_gather": {2: Link(2e-4, 3e8), 4: Link(5e-4, 2e8)}})
    loaded = HardwareProfile.load(profile.save(tmp_path / "p.json"))
    assert loaded == profile
    assert loaded.collectives["all_gather"][4] == Link(5e-4, 2e8)


def test_this_host_reads_the_calibrated_profile(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "host.json"
    monkeypatch.setenv("FLOWTRAIN_HOST_PROFILE", str(path))
    with pytest.raises(ProfileError, match="run `flowtrain calibrate` first"):
        get_profile("this-host")
    small_profile(kind="cpu").save(path)
    assert get_profile("this-host") == small_profile(kind="cpu")


def broken(change: dict[str, object], drop: str | None = None) -> dict[str, object]:
    d = small_profile().to_dict()
    if drop:
        del d[drop]
    for dotted, value in change.items():
        target = d
        *parents, last = dotted.split(".")
        for part in parents:
            target = target[part]  # type: ignore[assignment]
        target[last] = value  # type: ignore[index]
    return d


@pytest.mark.parametrize(("data", "message"), [
    (broken({}, drop="memory_bandwidth"), r"missing field 'memory_bandwidth'"),
    (broken({"memory_bandwidth": "fast"}), r"field 'memory_bandwidth' must be a finite number, "
                                           r"got 'fast'"),
    (broken({"devices_per_node": 2.5}), r"field 'devices_per_node' must be an integer, got 2.5"),
    (broken({"kind": "tpu"}), r"field 'kind' must be one of gpu, cpu, got 'tpu'"),
    (broken({"inter_node.latency_s": -1}), r"field 'inter_node.latency_s' must be >= 0, got -1"),
    (broken({"intra_node": {"bandwidth": 1e9}}), r"missing field 'intra_node.latency_s'"),
    (broken({"peak_flops.bfloat16": 0}), r"field 'peak_flops.bfloat16' must be > 0, got 0"),
    (broken({"efficiency": [[1e8, 0.5], [1e6, 0.6]]}),
     r"field 'efficiency\[1\] FLOPs' must be > 1e\+08, got 1000000.0"),
    (broken({"comm_compute_interference": 1.5}),
     r"field 'comm_compute_interference' must be <= 1, got 1.5"),
    (broken({"collectives": {"alltoall": {}}}), r"unknown op 'alltoall'; valid ops: all_reduce"),
    (broken({"collectives": {"all_reduce": {"two": {"latency_s": 0, "bandwidth": 1}}}}),
     r"'collectives.all_reduce' keys must be rank counts, got 'two'"),
    (broken({"nvlink": 1}), r"unknown field 'nvlink'; valid fields: name, kind"),
    (broken({"v": 2}), r"field 'v' must be 1, got 2"),
])
def test_malformed_profiles_name_the_field(data: dict[str, object], message: str) -> None:
    with pytest.raises(ProfileError, match=message):
        HardwareProfile.from_dict(data)


def test_profile_file_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(broken({}, drop="kind")))
    with pytest.raises(ProfileError, match=rf"{path}: missing field 'kind'"):
        get_profile(str(path))
    path.write_text("{not json")
    with pytest.raises(ProfileError, match=rf"{path}: not valid JSON"):
        HardwareProfile.load(path)


def test_unknown_profile_name_lists_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown hardware profile 'b200'; choices: "
                                         r"a100-80g-x8, a100-40g-x8, h100-x8, h100-hbm2e-x8, "
                                         r"h200-x8, this-host"):
        get_profile("b200")
    with pytest.raises(ValueError, match=r"no such profile file 'nowhere/x.json'"):
        get_profile("nowhere/x.json")


def test_constructor_checks_ranges_too() -> None:
    with pytest.raises(ProfileError, match=r"field 'bandwidth' must be > 0, got 0"):
        Link(1e-6, 0)
    with pytest.raises(ProfileError, match=r"field 'efficiency\[0\] fraction' must be <= 1"):
        small_profile(efficiency=((1e6, 1.2),))
    assert math.isclose(small_profile(efficiency=[[1e6, 0.5]]).efficiency[0][1], 0.5)
