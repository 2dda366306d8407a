"""Published kernel figures of the builtin GPUs (``sims.gpu_kernels.GpuKernels``), each with its
source. A100 figures serve both memory sizes except HBM streaming; H200 computes as H100 does.
"""

from __future__ import annotations

from collections.abc import Mapping

from sims.gpu_kernels import GpuKernels

GB = 1e9
KIB, MIB, GIB = 2**10, 2**20, 2**30

_STAS = "stas00/ml-engineering@744d01e"
_AZURE = "Azure/AI-benchmarking-guide@8fd0c6e Azure_Results"
_FA = "Dao-AILab/flash-attention@0251105 assets"
_NCCL_TUNING = "NVIDIA/nccl src/graph/tuning.cc"

# Output tiles cuBLAS chooses among for tensor-core GEMMs; the guide's worked example uses
# 256x128, smaller tiles serve small problems.
_TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128))


def _fraction(points: tuple[tuple[int, float], ...], peak_tflops: float
              ) -> tuple[tuple[float, float], ...]:
    return tuple((float(seq), tflops / peak_tflops) for seq, tflops in points)


def _combined(forward: tuple[float, ...], backward: tuple[float, ...]) -> tuple[float, ...]:
    """Forward+backward rate of separately measured passes, counting backward as 2.5x the
    forward's FLOPs (the flash-attention benchmarks' convention)."""
    return tuple(3.5 / (1 / f + 2.5 / b) for f, b in zip(forward, backward))


_SEQS = (512, 1024, 2048, 4096, 8192, 16384)

# FA2 forward+backward, causal, TFLOP/s as labelled on the bars
_FA2_A100 = {64: (88, 119, 140, 156, 165, 171), 128: (99, 133, 155, 173, 182, 189)}
_FA2_H100 = {64: (141, 192, 232, 257, 273, 284), 128: (163, 221, 265, 294, 308, 328)}
# FA3 (H100): forward causal as labelled; backward from the paper's figures, which time it
# without a causal mask
_FA3_H100_FWD = {64: (197, 265, 371), 128: (292, 423, 521, 579, 602, 616)}
_FA3_H100_BWD = {64: (272, 363, 422), 128: (316, 424, 501, 542, 559, 561)}
# FA3 hd128 forward without a causal mask (the paper's figure): a causal pass skips the blocks
# above the diagonal but idles on the blocks that straddle it, so it reaches only a share of
# the unmasked rate, a share that grows with the sequence; the causal backward is taken to
# reach the same share of its unmasked rate as the forward does
_FA3_H100_FWD_FULL_128 = (467, 565, 625, 638, 646, 648)
_CAUSAL_SHARE = tuple(c / f for c, f in zip(_FA3_H100_FWD[128], _FA3_H100_FWD_FULL_128))


# FlashAttention in Triton (the HazyResearch kernel MPT runs as attn_impl "triton"): the FA2
# paper (arXiv 2307.08691 Sec. 4.1, A100) finds FA2 1.3-1.5x faster in the forward pass and
# about 2x in the backward. The backward does 2.5x the forward's FLOPs at no higher a rate, so
# it takes at least 2.5/3.5 of FA2's time: the Triton kernel's forward+backward takes
# 0.29 x 1.4 + 0.71 x 2 = 1.83x FA2's. Both kernels use Ampere's mma instructions, so the
# ratio is taken to hold on Hopper too.
_TRITON_SLOWDOWN = (1 - 2.5 / 3.5) * 1.4 + 2.5 / 3.5 * 2.0
_TRITON_SOURCE = ("FA2's curve / 1.83: arXiv 2307.08691 Sec. 4.1 (A100): FA2 is 1.3-1.5x "
                  "faster than FlashAttention in Triton forward and ~2x backward; backward is "
                  "at least 2.5/3.5 of the time; taken to hold on Hopper (both kernels use "
                  "Ampere's mma)")


def _triton(fa2: Mapping[int, tuple[float, ...]]) -> dict[int, tuple[float, ...]]:
    return {d: tuple(v / _TRITON_SLOWDOWN for v in rates) for d, rates in fa2.items()}


def _attention_a100() -> dict[str, dict[int, tuple[tuple[float, float], ...]]]:
    return {kernel: {d: _fraction(tuple(zip(_SEQS, v)), 312.0) for d, v in rates.items()}
            for kernel, rates in (("flash2", _FA2_A100), ("flash-triton", _triton(_FA2_A100)))}


def _attention_h100() -> dict[str, dict[int, tuple[tuple[float, float], ...]]]:
    """The flash-attention benchmarks time short bursts; over a training step the tensor
    cores are power-limited as long GEMMs are, so the burst rates are scaled by the GEMMs'
    sustained-to-burst ratio."""
    fa3 = {d: _combined(tuple(map(float, _FA3_H100_FWD[d])),
                        tuple(b * share for b, share in zip(_FA3_H100_BWD[d], _CAUSAL_SHARE)))
           for d in _FA3_H100_FWD}
    sustained = 989.4 * _HOPPER_BURST / _HOPPER_SUSTAINED
    return {"flash2": {d: _fraction(tuple(zip(_SEQS, v)), sustained)
                       for d, v in _FA2_H100.items()},
            "flash-triton": {d: _fraction(tuple(zip(_SEQS, v)), sustained)
                             for d, v in _triton(_FA2_H100).items()},
            "flash3": {d: _fraction(tuple(zip(_SEQS, v)), sustained) for d, v in fa3.items()}}


def _busbw(points: tuple[tuple[float, float], ...], cap: float | None = None
           ) -> tuple[tuple[float, float], ...]:
    return tuple((float(size), min(gbps, cap) * GB if cap else gbps * GB)
                 for size, gbps in points)


# 8-GPU all_reduce bus bandwidth, GB/s by buffer size
_A100_ALL_REDUCE = ((32 * KIB, 1.31), (64 * KIB, 2.45), (256 * KIB, 7.47), (MIB, 18.0),
                    (4 * MIB, 72.33), (8 * MIB, 109.93), (32 * MIB, 138.49),
                    (128 * MIB, 176.92), (512 * MIB, 222.72), (GIB, 229.04), (4 * GIB, 233.88),
                    (16 * GIB, 234.89))
_H100_ALL_REDUCE = ((64 * KIB, 2.72), (256 * KIB, 10.86), (MIB, 43.70), (2 * MIB, 81.93),
                    (4 * MIB, 128.73), (8 * MIB, 172.13), (16 * MIB, 234.45), (32 * MIB, 295.53),
                    (64 * MIB, 361.78), (128 * MIB, 400.61), (256 * MIB, 423.38),
                    (512 * MIB, 438.46), (GIB, 466.35), (8 * GIB, 478.87))
_H200_ALL_REDUCE = ((64 * KIB, 3.72), (256 * KIB, 14.75), (MIB, 52.96), (2 * MIB, 88.78),
                    (4 * MIB, 138.44), (8 * MIB, 181.94), (16 * MIB, 240.41), (32 * MIB, 300.91),
                    (64 * MIB, 368.11), (128 * MIB, 412.45), (256 * MIB, 432.24),
                    (512 * MIB, 442.72), (GIB, 467.58), (8 * GIB, 479.98))
# the fraction of its peak a Hopper GEMM holds over a whole step (see _hopper)
_HOPPER_SUSTAINED = 0.70
# ... and a lone 8192^3 GEMM's (the short-burst rate benchmarks of a few ms measure)
_HOPPER_BURST = 0.806
# A tile's prologue and epilogue (filling the operand pipeline, writing the tile out) take
# about as many clocks on Hopper as on Ampere, while a Hopper SM's tensor cores do twice the
# dense work per clock (4096 against 2048 16-bit FLOP/clock/SM: 989.4 TFLOP/s = 132 SMs x
# 4096 x 1.83 GHz, 312 = 108 x 2048 x 1.41 GHz), so the fixed part spans twice the inner length
_HOPPER_K_OVERHEAD = 64.0
# Hopper all-gather and reduce-scatter run NCCL's ring (NVLink SHARP serves the all-reduce)
_HOPPER_RING_CAP = 362.0

_COMMON_SOURCES = {
    "gemm_tiles": f"{_STAS} training/performance/README.md 'Tile and wave quantization' (256x128 "
                  "cuBLAS tile example after NVIDIA's Matrix Multiplication Background guide); "
                  "smaller tiles: assumption that cuBLAS also has them for small problems",
    "gemm_k_overhead": "assumption from arXiv 2401.14489 Fig. 7 (A100 attention score GEMMs, "
                       "inner size = head dim, reach ~200-215 of 312 TFLOP/s, about 0.8 of a "
                       "large GEMM's rate): k / (k + 32) is 0.8 at k = 128",
    "kernel_overhead_s": "the gap between measured small square GEMMs (A100 1024^3 119.4, "
                         "2048^3 221.8 TFLOP/s, Azure; H100 1024^3 176.6, 2048^3 676.6, "
                         "zzc0721/torch-performance-test-data#79) and the wave model: 3-9 us",
    "collective_base_latency_s": f"{_NCCL_TUNING}: baseLat ring Simple 8.4 us",
    "gemm_efficiency.float32": "assumption: fp32 GEMMs reach the same fraction of the fp32 "
                               "peak as 16-bit ones of theirs (no measurement retrieved)",
    "overlap_slowdown": "arXiv 2507.03114: overlapping computation and communication gives an "
                        "average computational slowdown of 18.9% (A100, H100, MI250, MI210)",
    "device_spread": "arXiv 2208.11035 (Sinha et al., SC22, 'Not All GPUs Are Created "
                     "Equal'): 8% average performance variation (max 22%) between GPUs of one "
                     "SKU across five clusters (V100, MI60 and others; no A100/H100 study "
                     "found), outliers aside; read as the span of a normal distribution's "
                     "non-outlier points (Tukey's whiskers, +-2.7 sigma): sigma = 8% / 5.4",
}


# the spread of published figures (optimistic, pessimistic) behind the values above
_OVERLAP_RANGE = (0.0, 0.40)  # arXiv 2507.03114: no slowdown up to its 40.0% maximum
# the spread between GPUs of one SKU (see _COMMON_SOURCES["device_spread"]) and its bounds:
# identical GPUs, and the study's largest variation (22%) read the same way
_DEVICE_SPREAD = round(0.08 / 5.4, 4)
_DEVICE_SPREAD_RANGE = (0.0, round(0.22 / 5.4, 4))
_RANGE_SOURCES = {
    "ranges.device_spread": "arXiv 2208.11035: no spread (identical GPUs) to its largest "
                            "variation, 22%, read as 5.4 sigma",
    "ranges.overlap_slowdown": "arXiv 2507.03114: slowdown under overlap averages 18.9%, "
                               "maximum 40.0%",
    "ranges.network_efficiency": "NVIDIA/nccl-tests#290 (46-48 GB/s per 50 GB/s NIC) and "
                                 f"{_STAS} network README (a 4-node ring at 4 GiB reaching "
                                 "73% of the NICs' rate)",
}


def _a100(memory_efficiency: float, memory_source: str,
          memory_range: tuple[float, float]) -> GpuKernels:
    return GpuKernels(
        sms=108, gemm_tiles=_TILES,
        gemm_efficiency={"bfloat16": 0.82, "float16": 0.82, "float32": 0.82},
        gemm_k_overhead=32.0, kernel_overhead_s=5e-6, attention=_attention_a100(),
        memory_efficiency=memory_efficiency,
        collectives={"all_reduce": _busbw(_A100_ALL_REDUCE),
                     "all_gather": _busbw(_A100_ALL_REDUCE),
                     "reduce_scatter": _busbw(_A100_ALL_REDUCE)},
        network_efficiency=0.85, network_step_latency_s=9.6e-6,
        collective_base_latency_s=8.4e-6, p2p_efficiency=0.65, overlap_slowdown=0.189,
        default_attention="flash2",
        device_spread=_DEVICE_SPREAD,
        ranges={"gemm_efficiency": (0.869, 0.813), "memory_efficiency": memory_range,
                "network_efficiency": (0.96, 0.73), "overlap_slowdown": _OVERLAP_RANGE,
                "device_spread": _DEVICE_SPREAD_RANGE},
        sources={
            **_COMMON_SOURCES, **_RANGE_SOURCES,
            "ranges.gemm_efficiency": f"{_STAS} MAMF A100 SXM 271.2 of 312 (0.869); "
                                      f"{_AZURE} A100 FP16 8192^3 253.7 (0.813)",
            "ranges.memory_efficiency": memory_source,
            "sms": f"{_STAS} compute/accelerator/README.md: 108 SMs for A100 SXM",
            "gemm_efficiency": f"{_AZURE}/ND_A100_v4_results.md cuBLASLt FP16: 8192^3 253.7, "
                               "16384^3 256.5 TFLOP/s of 312 = 0.82 (the longest GEMM holds "
                               "its rate: A100 is not power-limited here)",
            "attention.flash-triton": _TRITON_SOURCE,
            "attention": f"{_FA}/flash2_a100_fwd_bwd_benchmark.png: causal fwd+bwd TFLOP/s "
                         "by seq len, head dim 64 and 128",
            "memory_efficiency": memory_source,
            "collectives": f"{_STAS} network README: all_reduce_perf -g 8 on an A100 node, "
                           "busbw 1.31 GB/s at 32 KiB to 234.89 at 16 GiB; all-gather and "
                           "reduce-scatter assumed the same ring bandwidth",
            "network_efficiency": "NVIDIA/nccl-tests#119: 3 A100 nodes, 4x HDR: average "
                                  "84.8 GB/s of a theoretical 100",
            "network_step_latency_s": f"{_NCCL_TUNING}@01afd20 (Ampere era): hwLat NET ring "
                                      "Simple 9.6 us",
            "p2p_efficiency": "li-plus/playground cuda/nccl.md: A100 sendrecv_perf 195 GB/s "
                              "one way of 300",
        })


def _hopper(all_reduce: tuple[tuple[float, float], ...], memory_efficiency: float,
            memory_source: str, p2p: float, p2p_source: str, collective_source: str,
            memory_range: tuple[float, float]) -> GpuKernels:
    return GpuKernels(
        sms=132, gemm_tiles=_TILES,
        # a training step keeps the tensor cores busy for seconds at a time, so it runs at the
        # rate of the longest measured GEMMs: on Hopper those are power-limited (10240^3 at
        # 0.728 (BF16) and 0.676 (FP16) of peak where 8192^3 reaches 0.806); fp8 GEMMs are
        # limited alike
        gemm_efficiency={"bfloat16": _HOPPER_SUSTAINED, "float16": _HOPPER_SUSTAINED,
                         "float8": round(0.709 * _HOPPER_SUSTAINED / _HOPPER_BURST, 3),
                         "float32": _HOPPER_SUSTAINED},
        gemm_k_overhead=64.0, kernel_overhead_s=5e-6, attention=_attention_h100(),
        memory_efficiency=memory_efficiency,
        collectives={"all_reduce": _busbw(all_reduce),
                     "all_gather": _busbw(all_reduce, _HOPPER_RING_CAP),
                     "reduce_scatter": _busbw(all_reduce, _HOPPER_RING_CAP)},
        network_efficiency=0.94, network_step_latency_s=14e-6,
        collective_base_latency_s=8.4e-6, p2p_efficiency=p2p, overlap_slowdown=0.189,
        default_attention="flash3",
        device_spread=_DEVICE_SPREAD,
        ranges={"gemm_efficiency": (0.806, 0.676), "memory_efficiency": memory_range,
                "network_efficiency": (0.96, 0.73), "overlap_slowdown": _OVERLAP_RANGE,
                "device_spread": _DEVICE_SPREAD_RANGE},
        sources={
            **_COMMON_SOURCES, **_RANGE_SOURCES,
            "gemm_k_overhead": "the A100 figure (32, from arXiv 2401.14489 Fig. 7) doubled: "
                               "a tile's prologue/epilogue takes about the same clocks while "
                               "the SM's dense 16-bit rate per clock doubles (NVIDIA H100 "
                               "whitepaper: 989.4 TFLOP/s = 132 SMs x 4096 FLOP/clk x 1.83 "
                               "GHz; A100 312 = 108 x 2048 x 1.41 GHz)",
            "ranges.gemm_efficiency": "zzc0721/torch-performance-test-data#79: H100 BF16 "
                                      "8192^3 797.5 (0.806) to FP16 10240^3 668.4 (0.676) "
                                      "TFLOP/s",
            "ranges.memory_efficiency": memory_source,
            "sms": f"{_STAS} compute/accelerator/README.md: 132 SMs for H100 SXM",
            "gemm_efficiency": "sustained rate: zzc0721/torch-performance-test-data#79: H100 "
                               "10240^3 BF16 719.7 and FP16 668.4 TFLOP/s, mean 0.70 of 989.4 "
                               "(8192^3 BF16 797.5, 4096^3 788.7: the longest GEMMs are "
                               f"power-limited); FP8: its MAMF 1402.6 of 1979 (0.709, {_STAS}) "
                               "limited in the same ratio (0.70 / 0.806); H200 the same",
            "attention.flash-triton": _TRITON_SOURCE,
            "attention": f"{_FA}/flash2_h100_fwd_bwd_benchmark.png (FA2 causal fwd+bwd) and "
                         "flash3_fp16_fwd.png (FA3 causal forward); FA3 backward (hd64, hd128) "
                         "from the FA3 paper's figures (arXiv 2407.08608), timed there without "
                         "a causal mask, scaled by the causal share of the hd128 forward "
                         "(causal / unmasked forward, 292/467 at 512 to 616/648 at 16k); "
                         "cuDNN's fused attention "
                         "is within ~10% of FA3 in the same figures; each burst rate scaled "
                         "by the GEMMs' sustained-to-burst ratio (0.70 / 0.806)",
            "default_attention": "flash3: Hopper frameworks run FA3 or cuDNN fused attention",
            "memory_efficiency": memory_source,
            "collectives": collective_source + "; all-gather and reduce-scatter run the ring: "
                           f"{_STAS} 8xH200 at 16 GiB, 361.4 and 362.9 GB/s",
            "network_efficiency": "NVIDIA/nccl-tests#290: 'For NDR @ 400Gbps you should see "
                                  "46-48GB/s per NIC' (of 50)",
            "network_step_latency_s": f"{_NCCL_TUNING}@b647562: hwLat NET ring Simple 14 us",
            "p2p_efficiency": p2p_source,
        })


A100_40G = _a100(0.87, "PTsolvers/gpu-workshop-JuliaCon23#7: A100 40GB memcopy 1355 of "
                       "1555 GB/s; range: that and mixbench ~1300 GB/s (ekondis/mixbench#18)",
                 (0.87, 0.84))
A100_80G = _a100(0.79, f"{_AZURE}/ND_A100_v4_results.md BabelStream Copy 1.61 of 2.039 TB/s; "
                       "range: a read-only kernel at 1.80 TB/s (NVIDIA forums 339083, 88%)",
                 (0.88, 0.79))
H100 = _hopper(_H100_ALL_REDUCE, 0.87,
               f"{_AZURE}/ND_H100_v5_results.md BabelStream Copy 2.90 of 3.35 TB/s; range: "
               "FBGEMM scatter_add at 2.54 TB/s (pytorch/FBGEMM#3993, 0.76)", 0.83,
               f"{_STAS}: H100 p2pBandwidthLatencyTest 376 of 450 GB/s",
               f"{_AZURE}/ND_H100_v5_results.md all_reduce_perf -g 8 busbw (NVLS at large "
               "sizes), 2.72 GB/s at 64 KiB to 478.87 at 8 GiB",
               (0.87, 0.76))
H200 = _hopper(_H200_ALL_REDUCE, 0.84,
               f"{_AZURE}/ND_H200_v5_results.md BabelStream Copy 4.01 of 4.8 TB/s; range: "
               "its Dot at 4.48 TB/s (0.93)", 0.88,
               f"{_STAS}: H200 nvbandwidth 396.40 of 450 GB/s",
               f"{_AZURE}/ND_H200_v5_results.md all_reduce_perf -g 8 busbw, 3.72 GB/s at "
               "64 KiB to 479.98 at 8 GiB",
               (0.93, 0.84))
