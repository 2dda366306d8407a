"""Hardware profiles as the engine reads them: a device's peak FLOP/s per dtype and its memory
bandwidth (for MFU and MBU), from a builtin GPU node's published figures or from the profile
``flowtrain calibrate`` writes for this host. The simulator's full profile (``sims.hardware``)
builds its builtins from ``BUILTIN_NODES`` and reads the same files."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_VERSION = 1
KINDS = ("gpu", "cpu")
HOST_PROFILE_ENV = "FLOWTRAIN_HOST_PROFILE"
THIS_HOST = "this-host"


class ProfileError(ValueError):
    """A hardware profile that cannot be used: names the field, the value seen and what is valid."""


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_number(name: str, value: Any, *, minimum: float | None = None,
                 maximum: float | None = None, strict: bool = False) -> None:
    """One numeric field: a finite number within bounds (``strict``: above ``minimum``)."""
    if not is_number(value) or not math.isfinite(value):
        raise ProfileError(f"field {name!r} must be a finite number, got {value!r}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise ProfileError(f"field {name!r} must be {bound}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ProfileError(f"field {name!r} must be <= {maximum:g}, got {value!r}")


# ----------------------------------------------------------------------------- builtins

GB = 1e9
MiB = 2**20
TFLOPS = 1e12
# the memory the driver reports for each GPU (nvidia-smi's total; "80GB" is not 80e9 bytes)
_SMI = "modal-labs/modal-client#2797: nvidia-smi totals"
SRC_SIM = "/work/shared/reference/simulators.md (hardware table)"


@dataclass(frozen=True)
class GpuNode:
    """The published figures of a builtin eight-GPU node: per GPU (FLOP/s, HBM bytes and
    bytes/s, NVLink and PCIe bytes/s per direction), per node (InfiniBand and host DRAM
    bytes/s), and the source of each."""

    name: str
    fp32: float
    tf32: float
    bf16: float
    hbm_bytes: float
    hbm_bw: float
    nvlink_dir: float
    ib_node: float
    pcie_dir: float
    host_dram_node: float
    sources: dict[str, str] = field(default_factory=dict)
    fp8: float = 0.0  # dense FP8 tensor-core FLOP/s; 0 where the GPU has none

    @property
    def peak_flops(self) -> dict[str, float]:
        peaks = {"float32": self.fp32, "tfloat32": self.tf32, "bfloat16": self.bf16,
                 "float16": self.bf16}
        if self.fp8:
            peaks["float8"] = self.fp8
        return peaks


BUILTIN_NODES: dict[str, GpuNode] = {node.name: node for node in (
    GpuNode(
        "a100-80g-x8", fp32=19.5 * TFLOPS, tf32=156 * TFLOPS, bf16=312 * TFLOPS,
        hbm_bytes=81920 * MiB, hbm_bw=2039 * GB, nvlink_dir=300 * GB, ib_node=8 * 25 * GB,
        pcie_dir=32 * GB, host_dram_node=2 * 8 * 25.6 * GB,
        sources={
            "peak_flops.bfloat16": f"{SRC_SIM}: A100 BF16 dense 312 TFLOPS (624 sparse)",
            "peak_flops.float16": "A100 FP16 tensor core dense = BF16 rate (NVIDIA A100 "
                                  "datasheet)",
            "peak_flops.float32": "NVIDIA A100 datasheet: FP32 (non-tensor) 19.5 TFLOPS",
            "peak_flops.tfloat32": "NVIDIA A100 datasheet: TF32 tensor core 156 TFLOPS dense",
            "device_memory_bytes": f"{_SMI}: A100 80GB 81920 MiB",
            "memory_bandwidth": f"{SRC_SIM}: 80 GB HBM2e @ 2.039 TB/s",
            "intra_node.bandwidth": f"{SRC_SIM}: NVLink3 600 GB/s bidirectional = 300 GB/s "
                                    "per direction (NCCL achieves ~195 GB/s sendrecv)",
            "inter_node.bandwidth": f"{SRC_SIM}: InfiniBand HDR 200 Gb/s = 25 GB/s per port "
                                    "per direction, 8 ports per node",
            "host_to_device.bandwidth": f"{SRC_SIM}: PCIe Gen4 x16 32 GB/s per direction",
            "host_memory_bandwidth": "DGX A100: 2x AMD EPYC 7742, 8 channels DDR4-3200 each "
                                     "(25.6 GB/s per channel) = 409.6 GB/s per node, / 8 GPUs",
        }),
    GpuNode(
        "a100-40g-x8", fp32=19.5 * TFLOPS, tf32=156 * TFLOPS, bf16=312 * TFLOPS,
        hbm_bytes=40960 * MiB, hbm_bw=1555 * GB, nvlink_dir=300 * GB, ib_node=8 * 25 * GB,
        pcie_dir=32 * GB, host_dram_node=2 * 8 * 25.6 * GB,
        sources={
            "peak_flops.bfloat16": f"{SRC_SIM}: A100 BF16 dense 312 TFLOPS (624 sparse)",
            "peak_flops.float16": "A100 FP16 tensor core dense = BF16 rate (NVIDIA A100 "
                                  "datasheet)",
            "peak_flops.float32": "NVIDIA A100 datasheet: FP32 (non-tensor) 19.5 TFLOPS",
            "peak_flops.tfloat32": "NVIDIA A100 datasheet: TF32 tensor core 156 TFLOPS dense",
            "device_memory_bytes": f"{_SMI}: A100 40GB 40960 MiB",
            "memory_bandwidth": f"{SRC_SIM}: 40 GB @ 1.555 TB/s",
            "intra_node.bandwidth": f"{SRC_SIM}: NVLink3 600 GB/s bidirectional = 300 GB/s "
                                    "per direction",
            "inter_node.bandwidth": f"{SRC_SIM}: InfiniBand HDR 200 Gb/s = 25 GB/s per port "
                                    "per direction, 8 ports per node (as DGX A100)",
            "host_to_device.bandwidth": f"{SRC_SIM}: PCIe Gen4 x16 32 GB/s per direction",
            "host_memory_bandwidth": "DGX A100: 2x AMD EPYC 7742, 8 channels DDR4-3200 each "
                                     "(25.6 GB/s per channel) = 409.6 GB/s per node, / 8 GPUs",
        }),
    GpuNode(
        "h100-x8", fp32=66.9 * TFLOPS, tf32=494.7 * TFLOPS, bf16=989.4 * TFLOPS,
        hbm_bytes=81559 * MiB, hbm_bw=3350 * GB, nvlink_dir=450 * GB, ib_node=8 * 50 * GB,
        pcie_dir=64 * GB, host_dram_node=2 * 8 * 38.4 * GB, fp8=1978.9 * TFLOPS,
        sources={
            "peak_flops.float8": "stas00/ml-engineering compute/accelerator/README.md MAMF "
                                 "table: H100 SXM FP8 peak 1979 TFLOPS dense",
            "peak_flops.bfloat16": f"{SRC_SIM}: H100 SXM BF16 dense 989.4 TFLOPS "
                                   "(1979 sparse)",
            "peak_flops.float16": "glennklockwood.com/garden/processors/h100: FP16 matrix "
                                  "989.4 TFLOPS dense",
            "peak_flops.float32": "glennklockwood.com/garden/processors/h100: FP32 66.9 TFLOPS",
            "peak_flops.tfloat32": "glennklockwood.com/garden/processors/h100: TF32 matrix "
                                   "494.7 TFLOPS dense (989.4 is with sparsity)",
            "device_memory_bytes": f"{_SMI}: H100 81559 MiB (also NVIDIA/nccl#1264: 'NVIDIA "
                                   "H100 80GB HBM3 ... 0MiB / 81559MiB')",
            "memory_bandwidth": f"{SRC_SIM}: 80 GB HBM3 @ 3.35 TB/s",
            "intra_node.bandwidth": f"{SRC_SIM}: NVLink4 900 GB/s bidirectional (18x50) = "
                                    "450 GB/s per direction (all-reduce reaches 741 of 900)",
            "inter_node.bandwidth": f"{SRC_SIM}: NDR 400 Gb/s = 50 GB/s per ConnectX-7, "
                                    "8 per DGX H100 (3.2 Tb/s)",
            "host_to_device.bandwidth": f"{SRC_SIM}: PCIe Gen5 x16 64 GB/s per direction",
            "host_memory_bandwidth": "DGX H100: 2x Xeon Platinum 8480C, 8 channels DDR5-4800 "
                                     "each (38.4 GB/s per channel) = 614.4 GB/s per node, / 8",
        }),
    GpuNode(
        "h100-hbm2e-x8", fp32=66.9 * TFLOPS, tf32=494.7 * TFLOPS, bf16=912.2 * TFLOPS,
        hbm_bytes=96 * GB, hbm_bw=2400 * GB, nvlink_dir=450 * GB, ib_node=8 * 50 * GB,
        pcie_dir=64 * GB, host_dram_node=2 * 8 * 38.4 * GB, fp8=1824.4 * TFLOPS,
        sources={
            "peak_flops.bfloat16": "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan"
                                   ".md: an HBM2e SXM H100 with lower TDP (500 W) whose 'peak "
                                   "TFLOPs number is between SXM and NVL'; torchtitan "
                                   "tools/utils.py: SXM 989, NVL 835 dense BF16 -> the "
                                   "midpoint, 912.2 (either bound is 8% away)",
            "peak_flops.float16": "as BF16",
            "peak_flops.float8": "twice the BF16 figure, as on every Hopper SKU",
            "peak_flops.float32": "as H100 SXM (not published for this SKU)",
            "peak_flops.tfloat32": "as H100 SXM (not published for this SKU)",
            "device_memory_bytes": "torchtitan benchmark: 96GB HBM2e",
            "memory_bandwidth": "torchtitan benchmark: 'HBM2e with 2.4 TB/sec peak memory "
                                "bandwidth'",
            "intra_node.bandwidth": "torchtitan benchmark: 8 GPUs per host over NVLink "
                                    "(NVLink4, 450 GB/s per direction, as H100 SXM)",
            "inter_node.bandwidth": "torchtitan benchmark: '400 Gb/s per GPU' RDMA = 50 GB/s, "
                                    "8 per node",
            "host_to_device.bandwidth": "PCIe Gen5 x16 64 GB/s per direction (as H100 SXM)",
            "host_memory_bandwidth": "as DGX H100 (not published for this host)",
        }),
    GpuNode(
        "h200-x8", fp32=66.9 * TFLOPS, tf32=494.7 * TFLOPS, bf16=989.4 * TFLOPS,
        hbm_bytes=141 * GB, hbm_bw=4800 * GB, nvlink_dir=450 * GB, ib_node=8 * 50 * GB,
        pcie_dir=64 * GB, host_dram_node=2 * 8 * 38.4 * GB, fp8=1978.9 * TFLOPS,
        sources={
            "peak_flops.float8": "stas00/ml-engineering compute/accelerator/README.md MAMF "
                                 "table: H200 SXM FP8 peak 1979 TFLOPS dense",
            "peak_flops.bfloat16": f"{SRC_SIM}: H200 same compute as H100, 989 TFLOPS dense "
                                   "(1,979 listed elsewhere includes sparsity)",
            "peak_flops.float16": f"{SRC_SIM}: same compute as H100 (FP16 = BF16 dense)",
            "peak_flops.float32": f"{SRC_SIM}: same compute as H100; H100 FP32 66.9 TFLOPS "
                                  "(glennklockwood.com/garden/processors/h100)",
            "peak_flops.tfloat32": "same compute as H100: TF32 494.7 TFLOPS dense",
            "device_memory_bytes": f"{SRC_SIM}: 141 GB HBM3e (decimal GB)",
            "memory_bandwidth": f"{SRC_SIM}: 141 GB HBM3e @ 4.8 TB/s",
            "intra_node.bandwidth": f"{SRC_SIM}: NVLink 900 GB/s bidirectional = 450 GB/s "
                                    "per direction",
            "inter_node.bandwidth": f"{SRC_SIM}: NDR 400 Gb/s = 50 GB/s per port, 8 per node "
                                    "(as DGX H100)",
            "host_to_device.bandwidth": f"{SRC_SIM}: PCIe Gen5 x16 64 GB/s per direction",
            "host_memory_bandwidth": "DGX H200 uses the DGX H100 CPUs: 2x Xeon Platinum "
                                     "8480C, 614.4 GB/s DDR5 per node, / 8",
        }),
)}


# ----------------------------------------------------------------------------- reading

@dataclass(frozen=True)
class DevicePeaks:
    """What one device of a profile computes and streams at most: FLOP/s by dtype name, and
    memory bytes/s (read + write)."""

    name: str
    kind: str
    peak_flops: dict[str, float]
    memory_bandwidth: float


def host_profile_path() -> Path:
    """Where ``flowtrain calibrate`` writes and ``this-host`` reads the measured profile."""
    env = os.environ.get(HOST_PROFILE_ENV)
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/flowtrain/host_profile.json").expanduser()


def resolve_profile(name_or_path: str) -> str | Path:
    """A builtin profile's name as given, or the JSON file that ``name_or_path`` (``this-host``:
    the profile ``flowtrain calibrate`` wrote) names. Unknown names raise ProfileError listing
    the choices."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ProfileError(f"hardware must be a profile name or a JSON path, got "
                           f"{name_or_path!r}")
    if name_or_path in BUILTIN_NODES:
        return name_or_path
    if name_or_path == THIS_HOST:
        path = host_profile_path()
        if not path.is_file():
            raise ProfileError(f"no calibrated profile of this host at {str(path)!r}; run "
                               f"`flowtrain calibrate` first (or set ${HOST_PROFILE_ENV})")
        return path
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    looks_like_path = name_or_path.endswith(".json") or os.sep in name_or_path
    what = "no such profile file" if looks_like_path else "unknown hardware profile"
    raise ProfileError(f"{what} {name_or_path!r}; choices: {', '.join(BUILTIN_NODES)}, "
                       f"{THIS_HOST} (after `flowtrain calibrate`), or a path to a profile JSON")


def read_profile_file(path: str | os.PathLike[str]) -> Any:
    """A profile file's JSON; errors name the file."""
    p = Path(path).expanduser()
    try:
        text = p.read_text()
    except OSError as exc:
        raise ProfileError(f"cannot read hardware profile {str(p)!r}: {exc.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def device_peaks(name_or_path: str) -> DevicePeaks:
    """The peaks of a builtin profile, a profile JSON file or ``this-host``. Of a file, only
    the fields read here are checked (the simulator checks the rest); errors name the file and
    the field."""
    where = resolve_profile(name_or_path)
    if isinstance(where, str):
        node = BUILTIN_NODES[where]
        return DevicePeaks(node.name, "gpu", node.peak_flops, node.hbm_bw)
    d = read_profile_file(where)
    try:
        return _peaks_from(d)
    except ProfileError as exc:
        raise ProfileError(f"{where}: {exc}") from None


def _peaks_from(d: Any) -> DevicePeaks:
    if not isinstance(d, dict):
        raise ProfileError(f"a hardware profile must be a JSON object, got {type(d).__name__}")
    if d.get("v", PROFILE_VERSION) != PROFILE_VERSION:
        raise ProfileError(f"field 'v' must be {PROFILE_VERSION}, got {d['v']!r}")
    for key in ("name", "kind", "peak_flops", "memory_bandwidth"):
        if key not in d:
            raise ProfileError(f"missing field {key!r}")
    if d["kind"] not in KINDS:
        raise ProfileError(f"field 'kind' must be one of {', '.join(KINDS)}, got {d['kind']!r}")
    peaks = d["peak_flops"]
    if not isinstance(peaks, dict) or not peaks:
        raise ProfileError("field 'peak_flops' must map at least one dtype name to FLOP/s, "
                           f"got {peaks!r}")
    for dtype, flops in peaks.items():
        check_number(f"peak_flops.{dtype}", flops, minimum=0.0, strict=True)
    check_number("memory_bandwidth", d["memory_bandwidth"], minimum=0.0, strict=True)
    return DevicePeaks(str(d["name"]), d["kind"], dict(peaks), d["memory_bandwidth"])
