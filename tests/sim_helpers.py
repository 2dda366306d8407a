"""What the simulator tests share: the recorded runs in tests/data/sim_run, a calibrated 2-core
CPU profile with round-number engine costs, a two-module workload and a config to plan it with."""

from __future__ import annotations

import dataclasses
from typing import Any

from flowtrain.config import load_config
from helpers import DATA
from sims.hardware import EngineCosts, HardwareProfile, Link
from sims.planner import Workload

SIM_RUN = DATA / "sim_run"
PIPELINE_RUN = SIM_RUN / "pipeline"
GB = 1e9


def engine_costs(**changes: Any) -> EngineCosts:
    """Round numbers: forward 1 GFLOP/s at 1e3 FLOPs rising to 10 GFLOP/s at 1e7 (1 thread),
    twice that with 2 threads; backward half the forward's rate."""
    base = EngineCosts(
        pass_rates={1: {"forward": ((1e3, 1e9), (1e7, 1e10)),
                        "backward": ((1e3, 5e8), (1e7, 5e9))},
                    2: {"forward": ((1e3, 2e9), (1e7, 2e10)),
                        "backward": ((1e3, 1e9), (1e7, 1e10))}},
        optimizer=Link(1e-5, 20 * GB), slowdown={2: 1.1, 4: 2.0},
        memory_slowdown={2: 1.5, 4: 3.0},
        channel={"all_reduce": {2: Link(1e-4, 5 * GB)},
                 "reduce_scatter": {2: Link(2e-4, 8 * GB)}},
        channel_interference=0.5, p2p=Link(2e-4, 2 * GB),
        factors={2: {"forward": 1.25, "backward": 1.25, "optimizer": 2.0}})
    return dataclasses.replace(base, **changes)


def cpu_profile(**engine_changes: Any) -> HardwareProfile:
    """A 2-core CPU host: 10 GFLOP/s, 20 GB/s memory, gloo all-reduce of 1 ms + 1 GB/s."""
    return HardwareProfile(
        name="cpu-test", kind="cpu", devices_per_node=2, device_memory_bytes=2**33,
        peak_flops={"float32": 1e10}, memory_bandwidth=20 * GB,
        intra_node=Link(1e-4, 1 * GB), inter_node=Link(1e-4, 2 * GB),
        host_to_device=Link(1e-6, 10 * GB), efficiency=((1e3, 0.5), (1e7, 1.0)),
        collectives={"all_reduce": {2: Link(1e-3, 1 * GB)},
                     "all_gather": {2: Link(1e-3, 1 * GB)},
                     "reduce_scatter": {2: Link(1e-3, 1 * GB)}},
        comm_compute_interference=0.3, host_memory_bandwidth=20 * GB,
        engine=engine_costs(**engine_changes))


def tiny_workload() -> Workload:
    """Two modules: a (8x4 weight + 8 bias, 40 elements), b (2x8 weight, 16 elements)."""
    return Workload("tiny", (("a.weight", (8, 4), "float32", 4), ("a.bias", (8,), "float32", 4),
                             ("b.weight", (2, 8), "float32", 4)), 1e5)


def sim_config(world: int, **extra: Any) -> Any:
    """A data-parallel AdamW config for ``world`` ranks, unsupported features allowed."""
    return load_config({"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **extra},
                       world_size=world, check_supported=False)
