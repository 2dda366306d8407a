"""A GPU profile's kernel figures (the ``kernels`` section of a hardware profile): what a GEMM,
a flash-attention kernel, a memory-bound kernel and an NCCL collective reach on that GPU, as
published measurements show. ``sims.gpu_costs`` prices ops with them; every builtin figure has
its source beside it in ``sources``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from statistics import NormalDist
from typing import Any

from sims.profile_fields import ProfileError, check_curve, check_fields, check_int, check_number

ATTENTION_KERNELS = ("flash2", "flash3", "flash-triton")
RANGED = ("gemm_efficiency", "memory_efficiency", "network_efficiency", "overlap_slowdown",
          "device_spread")
COLLECTIVE_CURVES = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class GpuKernels:
    """How fast kernels run on one GPU.

    - ``sms`` streaming multiprocessors; ``gemm_tiles`` the output tiles (rows, columns) cuBLAS
      chooses among; ``gemm_efficiency`` (per dtype) the fraction of that dtype's dense peak a
      GEMM reaches when its tiles fill every wave and its inner dimension is long;
      ``gemm_k_overhead`` the inner-dimension length a tile's prologue and epilogue cost (a
      GEMM of inner size k runs at k / (k + it) of that);
      ``kernel_overhead_s`` the fixed time a kernel costs besides its work (ramp-up and tail).
    - ``attention``: per kernel ("flash2", "flash3", "flash-triton": FlashAttention in
      Triton, MPT's attn_impl "triton"), head dim -> [(seq, fraction of peak)], the
      forward+backward rate of a causal flash-attention kernel counted as the kernel's authors
      count (causal halves the FLOPs, backward is 2.5x forward).
    - ``memory_efficiency``: the fraction of nominal HBM bandwidth a streaming kernel reaches.
    - ``collectives``: op -> [(buffer bytes, bus bandwidth bytes/s)] of NCCL on the node's GPUs
      (nccl-tests' busbw, measured on 8 GPUs of one node).
    - ``network_efficiency``: the fraction of a NIC's nominal bandwidth an inter-node ring
      reaches; ``network_step_latency_s`` NCCL's latency per step across nodes,
      ``collective_base_latency_s`` its fixed latency per call.
    - ``p2p_efficiency``: fraction of the NVLink bandwidth a pipeline send reaches in a node.
    - ``overlap_slowdown``: how much longer compute takes while an NCCL kernel runs beside it.
    - ``device_spread``: the standard deviation, as a fraction of the median, of how fast
      GPUs of this one SKU run the same kernels across a cluster (manufacturing and power
      management); the kernel figures above are one GPU's, a synchronous job waits for its
      slowest (``slowest_device_factor``).
    """

    sms: int
    gemm_tiles: tuple[tuple[int, int], ...]
    gemm_efficiency: dict[str, float]
    gemm_k_overhead: float
    kernel_overhead_s: float
    attention: dict[str, dict[int, tuple[tuple[float, float], ...]]]
    memory_efficiency: float
    collectives: dict[str, tuple[tuple[float, float], ...]]
    network_efficiency: float
    network_step_latency_s: float
    collective_base_latency_s: float
    p2p_efficiency: float
    overlap_slowdown: float
    default_attention: str = "flash2"
    device_spread: float = 0.0
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    # the spread of published figures behind a value: field -> (optimistic, pessimistic);
    # "gemm_efficiency" scales every dtype's figure by the ratio to its bfloat16 one
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict, compare=False)

    def bounds(self) -> tuple[GpuKernels, GpuKernels]:
        """The optimistic and the pessimistic kernels within ``ranges``."""
        out = []
        for side in (0, 1):
            changes: dict[str, Any] = {}
            for name, pair in self.ranges.items():
                value = pair[side]
                if name == "gemm_efficiency":
                    base = self.gemm_efficiency.get("bfloat16") or \
                        next(iter(self.gemm_efficiency.values()))
                    changes[name] = {k: min(1.0, v * value / base)
                                     for k, v in self.gemm_efficiency.items()}
                else:
                    changes[name] = value
            out.append(replace(self, **changes))
        return out[0], out[1]

    def __post_init__(self) -> None:
        _validate(self)

    def slowest_device_factor(self, devices: int) -> float:
        """How much longer the slowest of ``devices`` GPUs takes over the spec's one GPU: the
        expected largest of ``devices`` normal draws (Blom's approximation of the normal
        order statistic) in units of ``device_spread``; 1 for one GPU."""
        if devices <= 1 or not self.device_spread:
            return 1.0
        z = NormalDist().inv_cdf((devices - 0.375) / (devices + 0.25))
        return 1.0 + self.device_spread * z

    def __hash__(self) -> int:
        return hash((self.sms, self.gemm_tiles, tuple(sorted(self.gemm_efficiency.items())),
                     self.gemm_k_overhead,
                     self.kernel_overhead_s, self.memory_efficiency, self.network_efficiency,
                     self.default_attention, self.device_spread,
                     tuple((kernel, tuple(sorted(curves.items())))
                           for kernel, curves in sorted(self.attention.items())),
                     tuple(sorted(self.collectives.items()))))

    def to_dict(self) -> dict[str, Any]:
        return {
            "sms": self.sms,
            "gemm_tiles": [list(t) for t in self.gemm_tiles],
            "gemm_efficiency": dict(self.gemm_efficiency),
            "gemm_k_overhead": self.gemm_k_overhead,
            "kernel_overhead_s": self.kernel_overhead_s,
            "attention": {kernel: {str(d): [list(p) for p in curve] for d, curve in by_dim.items()}
                          for kernel, by_dim in self.attention.items()},
            "default_attention": self.default_attention,
            "memory_efficiency": self.memory_efficiency,
            "collectives": {op: [list(p) for p in curve] for op, curve in self.collectives.items()},
            "network_efficiency": self.network_efficiency,
            "network_step_latency_s": self.network_step_latency_s,
            "collective_base_latency_s": self.collective_base_latency_s,
            "p2p_efficiency": self.p2p_efficiency,
            "overlap_slowdown": self.overlap_slowdown,
            "device_spread": self.device_spread,
            "sources": dict(self.sources),
            "ranges": {k: list(v) for k, v in self.ranges.items()},
        }


_FIELDS = ("sms", "gemm_tiles", "gemm_efficiency", "gemm_k_overhead", "kernel_overhead_s",
           "attention", "memory_efficiency", "collectives", "network_efficiency",
           "network_step_latency_s", "collective_base_latency_s",
           "p2p_efficiency", "overlap_slowdown")


def _validate(k: GpuKernels) -> None:
    check_int("kernels.sms", k.sms, 1)
    if not k.gemm_tiles:
        raise ProfileError("field 'kernels.gemm_tiles' must list at least one [rows, columns] "
                           "tile")
    for i, tile in enumerate(k.gemm_tiles):
        if len(tile) != 2:
            raise ProfileError(f"field 'kernels.gemm_tiles[{i}]' must be [rows, columns], "
                               f"got {tile!r}")
        for value in tile:
            check_int(f"kernels.gemm_tiles[{i}]", value, 1)
    if not isinstance(k.gemm_efficiency, dict) or not k.gemm_efficiency:
        raise ProfileError("field 'kernels.gemm_efficiency' must map dtype names to fractions "
                           f"of peak, got {k.gemm_efficiency!r}")
    for dtype, fraction in k.gemm_efficiency.items():
        check_number(f"kernels.gemm_efficiency.{dtype}", fraction, minimum=0.0, maximum=1.0,
                     strict=True)
    for name in ("memory_efficiency", "network_efficiency", "p2p_efficiency"):
        check_number(f"kernels.{name}", getattr(k, name), minimum=0.0, maximum=1.0,
                     strict=True)
    for name in ("gemm_k_overhead", "kernel_overhead_s", "network_step_latency_s",
                 "collective_base_latency_s", "overlap_slowdown"):
        check_number(f"kernels.{name}", getattr(k, name), minimum=0.0)
    check_number("kernels.device_spread", k.device_spread, minimum=0.0, maximum=0.5)
    if k.default_attention not in ATTENTION_KERNELS:
        raise ProfileError(f"field 'kernels.default_attention' must be one of "
                           f"{', '.join(ATTENTION_KERNELS)}, got {k.default_attention!r}")
    for kernel, by_dim in k.attention.items():
        if kernel not in ATTENTION_KERNELS:
            raise ProfileError(f"field 'kernels.attention' has unknown kernel {kernel!r}; "
                               f"valid: {', '.join(ATTENTION_KERNELS)}")
        for dim, curve in by_dim.items():
            check_int(f"kernels.attention.{kernel} head dim", dim, 1)
            check_curve(f"kernels.attention.{kernel}.{dim}", curve, maximum=1.0)
    if k.default_attention not in k.attention:
        raise ProfileError(f"field 'kernels.attention' has no curve for the default kernel "
                           f"{k.default_attention!r}")
    for op, curve in k.collectives.items():
        if op not in COLLECTIVE_CURVES:
            raise ProfileError(f"field 'kernels.collectives' has unknown op {op!r}; valid: "
                               f"{', '.join(COLLECTIVE_CURVES)}")
        check_curve(f"kernels.collectives.{op}", curve, maximum=None)
    for name, pair in k.ranges.items():
        if name not in RANGED:
            raise ProfileError(f"field 'kernels.ranges' has {name!r}; ranges apply to "
                               f"{', '.join(RANGED)}")
        if len(pair) != 2:
            raise ProfileError(f"field 'kernels.ranges.{name}' must be [optimistic, "
                               f"pessimistic], got {pair!r}")
        for bound in pair:
            check_number(f"kernels.ranges.{name}", bound, minimum=0.0,
                         maximum=None if name == "overlap_slowdown" else
                         0.5 if name == "device_spread" else 1.0)
    missing = set(COLLECTIVE_CURVES) - set(k.collectives)
    if missing:
        raise ProfileError(f"field 'kernels.collectives' needs a curve for "
                           f"{', '.join(sorted(missing))}")


def _pairs(path: str, value: Any) -> tuple[tuple[float, float], ...]:
    if not isinstance(value, list):
        raise ProfileError(f"field {path!r} must be a list of [x, y] pairs, got {value!r}")
    return tuple(tuple(p) if isinstance(p, list) else p for p in value)


def kernels_from(d: Any) -> GpuKernels:
    """The ``kernels`` section of a profile file; errors name the field."""
    if not isinstance(d, dict):
        raise ProfileError(f"field 'kernels' must be an object, got {d!r}")
    check_fields(d, _FIELDS, ("default_attention", "device_spread", "sources", "ranges"),
                 prefix="kernels.")
    ranges = d.get("ranges", {})
    if not isinstance(ranges, dict):
        raise ProfileError(f"field 'kernels.ranges' must be an object, got {ranges!r}")
    attention: dict[str, dict[int, tuple[tuple[float, float], ...]]] = {}
    if not isinstance(d["attention"], dict):
        raise ProfileError(f"field 'kernels.attention' must be an object, got {d['attention']!r}")
    for kernel, by_dim in d["attention"].items():
        if not isinstance(by_dim, dict):
            raise ProfileError(f"field 'kernels.attention.{kernel}' must map head dims to "
                               f"curves, got {by_dim!r}")
        attention[kernel] = {}
        for dim, curve in by_dim.items():
            try:
                attention[kernel][int(dim)] = _pairs(f"kernels.attention.{kernel}.{dim}", curve)
            except ValueError:
                raise ProfileError(f"field 'kernels.attention.{kernel}' keys must be head "
                                   f"dims, got {dim!r}") from None
    if not isinstance(d["collectives"], dict):
        raise ProfileError("field 'kernels.collectives' must be an object, got "
                           f"{d['collectives']!r}")
    tiles = d["gemm_tiles"]
    if not isinstance(tiles, list):
        raise ProfileError(f"field 'kernels.gemm_tiles' must be a list, got {tiles!r}")
    return GpuKernels(
        sms=d["sms"], gemm_tiles=tuple(tuple(t) if isinstance(t, list) else t for t in tiles),
        gemm_efficiency=dict(d["gemm_efficiency"]) if isinstance(d["gemm_efficiency"], dict)
        else d["gemm_efficiency"], gemm_k_overhead=d["gemm_k_overhead"],
        kernel_overhead_s=d["kernel_overhead_s"], attention=attention,
        memory_efficiency=d["memory_efficiency"],
        collectives={op: _pairs(f"kernels.collectives.{op}", c)
                     for op, c in d["collectives"].items()},
        network_efficiency=d["network_efficiency"],
        network_step_latency_s=d["network_step_latency_s"],
        collective_base_latency_s=d["collective_base_latency_s"],
        p2p_efficiency=d["p2p_efficiency"], overlap_slowdown=d["overlap_slowdown"],
        default_attention=d.get("default_attention", "flash2"),
        device_spread=d.get("device_spread", 0.0),
        sources=dict(d.get("sources", {})),
        ranges={k: tuple(v) if isinstance(v, list) else v for k, v in ranges.items()})
