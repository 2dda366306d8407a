"""Hardware profiles for the simulator: what one device computes, holds and moves per second.

Builtin eight-GPU nodes carry published figures (each with its source, in
``flowtrain.hardware.BUILTIN_NODES``, which the engine reads its peaks from); ``flowtrain
calibrate`` writes a measured profile of this host that loads through the same JSON schema.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowtrain.hardware import (
    BUILTIN_NODES,
    HOST_PROFILE_ENV,
    KINDS,
    PROFILE_VERSION,
    THIS_HOST,
    GpuNode,
    host_profile_path,
    read_profile_file,
    resolve_profile,
)
from sims import gpu_figures
from sims.engine_costs import ENGINE_FACTOR_KINDS, PASS_KINDS, EngineCosts, engine_from
from sims.gpu_kernels import GpuKernels, kernels_from
from sims.profile_fields import (
    Curve,
    Link,
    ProfileError,
    check_curve,
    check_fields,
    check_int,
    check_number,
    count_keys,
    link_from,
)

__all__ = [
    "BUILTIN_PROFILES",
    "COLLECTIVE_OPS",
    "ENGINE_FACTOR_KINDS",
    "PASS_KINDS",
    "THIS_HOST",
    "Curve",
    "EngineCosts",
    "HOST_PROFILE_ENV",
    "HardwareProfile",
    "Link",
    "ProfileError",
    "count_keys",
    "get_profile",
    "host_profile_path",
]

COLLECTIVE_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


@dataclass(frozen=True)
class HardwareProfile:
    """Per-device figures of one kind of node. ``inter_node.bandwidth`` is the whole node's
    network bandwidth (all NICs, one direction); one rank's share is that over
    ``devices_per_node``. ``host_memory_bandwidth`` is one device's share of the host DRAM
    bandwidth (CPU optimizer steps); 0 means not known."""

    name: str
    kind: str
    devices_per_node: int
    device_memory_bytes: int
    peak_flops: dict[str, float]
    memory_bandwidth: float
    intra_node: Link
    inter_node: Link
    host_to_device: Link
    efficiency: tuple[tuple[float, float], ...]
    collectives: dict[str, dict[int, Link]] = field(default_factory=dict)
    comm_compute_interference: float = 0.0
    sources: dict[str, str] = field(default_factory=dict)
    host_memory_bandwidth: float = 0.0
    engine: EngineCosts | None = None  # CPU hosts calibrated by `flowtrain calibrate`
    # CPU hosts: how much longer a gloo collective takes while its rank computes (the other
    # side of comm_compute_interference: the two share the cores)
    compute_comm_slowdown: float = 1.0
    # GPUs: what their kernels reach (GEMM by shape, flash attention, HBM streaming, NCCL by
    # message size); with it a known transformer is priced op by op
    kernels: GpuKernels | None = None

    def __post_init__(self) -> None:
        if isinstance(self.efficiency, list):  # hand-written profiles may use lists
            object.__setattr__(self, "efficiency",
                               tuple(tuple(p) if isinstance(p, list) else p
                                     for p in self.efficiency))
        _validate(self)

    @property
    def gpu_kernels(self) -> GpuKernels | None:
        """The kernel figures, on a GPU profile that has them (None on a CPU host's)."""
        return self.kernels if self.kind == "gpu" else None

    def __hash__(self) -> int:
        # The dict fields make the generated hash fail; a profile is still a value that caches
        # (functools.lru_cache over cost functions) may key on.
        return hash((self.name, self.kind, self.devices_per_node, self.device_memory_bytes,
                     tuple(sorted(self.peak_flops.items())), self.memory_bandwidth,
                     self.intra_node, self.inter_node, self.host_to_device, self.efficiency,
                     tuple((op, tuple(sorted(by_ranks.items())))
                           for op, by_ranks in sorted(self.collectives.items())),
                     self.comm_compute_interference, self.host_memory_bandwidth, self.engine,
                     self.compute_comm_slowdown, self.kernels))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``from_dict`` reads it back unchanged."""
        return {
            "v": PROFILE_VERSION,
            "name": self.name,
            "kind": self.kind,
            "devices_per_node": self.devices_per_node,
            "device_memory_bytes": self.device_memory_bytes,
            "peak_flops": dict(self.peak_flops),
            "memory_bandwidth": self.memory_bandwidth,
            "host_memory_bandwidth": self.host_memory_bandwidth,
            "intra_node": self.intra_node.to_dict(),
            "inter_node": self.inter_node.to_dict(),
            "host_to_device": self.host_to_device.to_dict(),
            "efficiency": [[f, e] for f, e in self.efficiency],
            # JSON keys are strings; from_dict turns the rank counts back into ints.
            "collectives": {op: {str(r): link.to_dict() for r, link in sorted(by_ranks.items())}
                            for op, by_ranks in self.collectives.items()},
            "comm_compute_interference": self.comm_compute_interference,
            "compute_comm_slowdown": self.compute_comm_slowdown,
            "sources": dict(self.sources),
            **({"engine": self.engine.to_dict()} if self.engine is not None else {}),
            **({"kernels": self.kernels.to_dict()} if self.kernels is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: Any, origin: str = "") -> HardwareProfile:
        """Builds a profile from ``to_dict``'s shape. Raises ProfileError naming the missing,
        unknown or malformed field; ``origin`` (a file path) is put in front of the message."""
        try:
            return _from_dict(d)
        except ProfileError as exc:
            if origin:
                raise ProfileError(f"{origin}: {exc}") from None
            raise

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Writes the profile as JSON (parent folders created); returns the path."""
        p = Path(path).expanduser()
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(p)  # a reader never sees a half-written profile
        return p

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> HardwareProfile:
        """Reads a profile written by ``save`` (or by hand); errors name the file and field."""
        return cls.from_dict(read_profile_file(path), origin=str(Path(path).expanduser()))


# ----------------------------------------------------------------------------- validation

_REQUIRED = ("name", "kind", "devices_per_node", "device_memory_bytes", "peak_flops",
             "memory_bandwidth", "intra_node", "inter_node", "host_to_device", "efficiency")
_OPTIONAL = ("v", "collectives", "comm_compute_interference", "compute_comm_slowdown",
             "sources", "host_memory_bandwidth", "engine", "kernels")


def _validate(p: HardwareProfile) -> None:
    """Range checks shared by the constructor and from_dict; every message names the field."""
    if not isinstance(p.name, str) or not p.name:
        raise ProfileError(f"field 'name' must be a non-empty string, got {p.name!r}")
    if p.kind not in KINDS:
        raise ProfileError(f"field 'kind' must be one of {', '.join(KINDS)}, got {p.kind!r}")
    check_int("devices_per_node", p.devices_per_node, 1)
    check_int("device_memory_bytes", p.device_memory_bytes, 1)
    if not isinstance(p.peak_flops, dict) or not p.peak_flops:
        raise ProfileError("field 'peak_flops' must map at least one dtype name to FLOP/s, "
                           f"got {p.peak_flops!r}")
    for dtype, flops in p.peak_flops.items():
        if not isinstance(dtype, str):
            raise ProfileError(f"field 'peak_flops' keys must be dtype names, got {dtype!r}")
        check_number(f"peak_flops.{dtype}", flops, minimum=0.0, strict=True)
    check_number("memory_bandwidth", p.memory_bandwidth, minimum=0.0, strict=True)
    check_number("host_memory_bandwidth", p.host_memory_bandwidth, minimum=0.0)
    for name in ("intra_node", "inter_node", "host_to_device"):
        if not isinstance(getattr(p, name), Link):
            raise ProfileError(f"field {name!r} must be a Link, got {getattr(p, name)!r}")
    _check_efficiency(p.efficiency)
    for op, by_ranks in p.collectives.items():
        if op not in COLLECTIVE_OPS:
            raise ProfileError(f"field 'collectives' has unknown op {op!r}; valid ops: "
                               f"{', '.join(COLLECTIVE_OPS)}")
        for ranks, link in by_ranks.items():
            check_int(f"collectives.{op} rank count", ranks, 2)
            if not isinstance(link, Link):
                raise ProfileError(f"field 'collectives.{op}.{ranks}' must be a Link, "
                                   f"got {link!r}")
    check_number("comm_compute_interference", p.comm_compute_interference,
                  minimum=0.0, maximum=1.0)
    check_number("compute_comm_slowdown", p.compute_comm_slowdown, minimum=1.0)
    for key, text in p.sources.items():
        if not isinstance(key, str) or not isinstance(text, str):
            raise ProfileError(f"field 'sources' must map names to text, got {key!r}: {text!r}")
    if p.engine is not None and not isinstance(p.engine, EngineCosts):
        raise ProfileError(f"field 'engine' must be EngineCosts, got {p.engine!r}")
    if p.kernels is not None and not isinstance(p.kernels, GpuKernels):
        raise ProfileError(f"field 'kernels' must be GpuKernels, got {p.kernels!r}")


def _check_efficiency(curve: Any) -> None:
    check_curve("efficiency", curve, maximum=1.0)


def _from_dict(d: Any) -> HardwareProfile:
    if not isinstance(d, dict):
        raise ProfileError(f"a hardware profile must be a JSON object, got {type(d).__name__}")
    check_fields(d, _REQUIRED, _OPTIONAL)
    if d.get("v", PROFILE_VERSION) != PROFILE_VERSION:
        raise ProfileError(f"field 'v' must be {PROFILE_VERSION}, got {d['v']!r}")
    for key in ("peak_flops", "sources"):
        if key in d and not isinstance(d[key], dict):
            raise ProfileError(f"field {key!r} must be an object, got {d[key]!r}")
    curve_in = d["efficiency"]
    if not isinstance(curve_in, list):
        raise ProfileError("field 'efficiency' must be a list of [FLOPs, fraction] pairs, "
                           f"got {curve_in!r}")
    curve = tuple(tuple(p) if isinstance(p, list) else p for p in curve_in)
    collectives: dict[str, dict[int, Link]] = {}
    raw = d.get("collectives", {})
    if not isinstance(raw, dict):
        raise ProfileError(f"field 'collectives' must be an object, got {raw!r}")
    for op, by_ranks in raw.items():
        if op not in COLLECTIVE_OPS:
            raise ProfileError(f"field 'collectives' has unknown op {op!r}; valid ops: "
                               f"{', '.join(COLLECTIVE_OPS)}")
        if not isinstance(by_ranks, dict):
            raise ProfileError(f"field 'collectives.{op}' must map rank counts to links, "
                               f"got {by_ranks!r}")
        collectives[op] = {}
        for key, link in by_ranks.items():
            try:
                ranks = int(key)
            except ValueError:
                raise ProfileError(f"field 'collectives.{op}' keys must be rank counts, "
                                   f"got {key!r}") from None
            collectives[op][ranks] = link_from(f"collectives.{op}.{key}", link)
    engine = engine_from(d["engine"]) if "engine" in d else None
    kernels = kernels_from(d["kernels"]) if "kernels" in d else None
    return HardwareProfile(
        name=d["name"], kind=d["kind"], devices_per_node=d["devices_per_node"],
        device_memory_bytes=d["device_memory_bytes"], peak_flops=dict(d["peak_flops"]),
        memory_bandwidth=d["memory_bandwidth"],
        intra_node=link_from("intra_node", d["intra_node"]),
        inter_node=link_from("inter_node", d["inter_node"]),
        host_to_device=link_from("host_to_device", d["host_to_device"]),
        efficiency=curve,  # checked by _validate
        collectives=collectives,
        comm_compute_interference=d.get("comm_compute_interference", 0.0),
        compute_comm_slowdown=d.get("compute_comm_slowdown", 1.0),
        sources=dict(d.get("sources", {})),
        host_memory_bandwidth=d.get("host_memory_bandwidth", 0.0),
        engine=engine,
        kernels=kernels,
    )


# ----------------------------------------------------------------------------- builtins

# GEMM efficiency by op size: the points of Calculon's systems/a100_80g.json
# ("gflops_efficiency": 1 GFLOP 0.6, 16 GFLOP 0.9, 128 GFLOP 0.95); their "0 GFLOP -> 0.1"
# entry is placed at 10 MFLOP here because the curve is interpolated in log(FLOPs).
_GPU_EFFICIENCY = ((1e7, 0.1), (1e9, 0.6), (1.6e10, 0.9), (1.28e11, 0.95))

_SRC_CALCULON = "calculon-ai/calculon systems/a100_80g.json, h100_80g_nvl8.json"
_COMMON_SOURCES = {
    "efficiency": f"{_SRC_CALCULON}: gflops_efficiency (lowest point placed at 1e7 FLOPs)",
    "intra_node.latency_s": f"{_SRC_CALCULON}: NVLink network latency 1e-6 s",
    "inter_node.latency_s": f"{_SRC_CALCULON}: InfiniBand network latency 2e-6 s",
    "host_to_device.latency_s": "assumption: ~10 us per host<->device copy (launch + DMA "
                                "setup), not a published figure",
    "devices_per_node": "HGX/DGX baseboard: 8 SXM GPUs per node",
}


# the kernel figures of each builtin node's GPU
_NODE_KERNELS = {"a100-40g-x8": gpu_figures.A100_40G, "a100-80g-x8": gpu_figures.A100_80G,
                 "h100-x8": gpu_figures.H100, "h100-hbm2e-x8": gpu_figures.H100,
                 "h200-x8": gpu_figures.H200}


def _gpu_node(node: GpuNode) -> HardwareProfile:
    return HardwareProfile(
        name=node.name, kind="gpu", devices_per_node=8, device_memory_bytes=int(node.hbm_bytes),
        peak_flops=node.peak_flops,
        memory_bandwidth=node.hbm_bw,
        intra_node=Link(1e-6, node.nvlink_dir),
        inter_node=Link(2e-6, node.ib_node),
        host_to_device=Link(10e-6, node.pcie_dir),
        efficiency=_GPU_EFFICIENCY,
        sources={**_COMMON_SOURCES, **node.sources},
        host_memory_bandwidth=node.host_dram_node / 8,
        kernels=_NODE_KERNELS.get(node.name),
    )


BUILTIN_PROFILES: dict[str, HardwareProfile] = {
    name: _gpu_node(node) for name, node in BUILTIN_NODES.items()}


def get_profile(name_or_path: str) -> HardwareProfile:
    """A builtin profile by name, a profile JSON file by path, or ``this-host`` (the profile
    ``flowtrain calibrate`` wrote). Unknown names raise ValueError listing the choices."""
    where = resolve_profile(name_or_path)
    if isinstance(where, Path):
        return HardwareProfile.load(where)
    return BUILTIN_PROFILES[where]
