"""What one GPU's kernels reach on the shapes a transformer step runs, measured, for the
simulator's GPU kernel figures (sims/gpu_figures.py) and to check its per-op pricing.

    python benchmarks/gpu_calibrate.py --json out.json          # about two minutes on an H200
    python benchmarks/gpu_calibrate.py --quick --json out.json  # fewer shapes and repeats

Measures, in bf16 with CUDA events (median of the repeats after warm-up):
- GEMMs of transformer layers (forward, data-gradient and weight-gradient shapes of the QKV,
  attention-output and MLP projections) for a grid of widths, tensor-parallel splits and token
  counts, as TFLOP/s;
- a long matmul loop (seconds) against its first burst: the sustained (power/clock-limited)
  rate of the tensor cores against the short-benchmark one;
- causal scaled-dot-product attention forward and forward+backward per backend (flash, cuDNN)
  by sequence length and head dim, counted as the flash-attention authors count;
- memory-bound ops (layer norm, RMS norm, GELU, SiLU*mul, residual add, dropout, softmax
  cross-entropy) forward+backward, as GB/s of the bytes they must move;
- whole transformer layers (pre-norm, causal SDPA, GELU or SwiGLU MLP) forward+backward, eager,
  so the simulator's prediction for the same layer can be set beside it.

With no GPU it prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

DTYPE = torch.bfloat16


def timed(fn: Callable[[], Any], reps: int, warmup: int = 3) -> float:
    """Median seconds of one call, each call timed by its own CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def gemm_rate(m: int, k: int, n: int, reps: int) -> float:
    a = torch.randn(m, k, device="cuda", dtype=DTYPE)
    b = torch.randn(k, n, device="cuda", dtype=DTYPE)
    out = torch.empty(m, n, device="cuda", dtype=DTYPE)
    seconds = timed(lambda: torch.matmul(a, b, out=out), reps)
    return 2 * m * k * n / seconds / 1e12


def layer_gemms(h: int, ffn: int, tp: int, tokens: int, swiglu: bool, kv_frac: float
                ) -> list[tuple[str, int, int, int]]:
    """(name, m, k, n) of one layer's forward, data-grad and weight-grad GEMMs on one rank."""
    qkv = int(h * (1 + 2 * kv_frac)) // tp
    up = (2 if swiglu else 1) * ffn // tp
    out = []
    for name, k, n in (("qkv", h, qkv), ("proj", h // tp, h), ("fc1", h, up),
                       ("fc2", ffn // tp, h)):
        out.append((f"{name}.fwd", tokens, k, n))
        out.append((f"{name}.dgrad", tokens, n, k))
        out.append((f"{name}.wgrad", k, tokens, n))
    return out


def gemm_sweep(quick: bool, reps: int) -> list[dict[str, Any]]:
    cases = [(2048, 8192, 1, False, 1.0), (2560, 10240, 1, False, 1.0),
             (4096, 16384, 1, False, 1.0), (4096, 14336, 1, True, 0.25),
             (5120, 20480, 1, False, 1.0), (8192, 28672, 8, True, 0.125),
             (12288, 49152, 8, False, 1.0), (16384, 53248, 8, True, 0.0625),
             (8192, 32768, 4, False, 1.0), (20480, 81920, 8, False, 1.0)]
    token_counts = (4096, 16384) if quick else (2048, 4096, 8192, 16384)
    if quick:
        cases = cases[::2]
    rows = []
    seen: dict[tuple[int, int, int], float] = {}
    for h, ffn, tp, swiglu, kv in cases:
        for tokens in token_counts:
            for name, m, k, n in layer_gemms(h, ffn, tp, tokens, swiglu, kv):
                key = (m, k, n)
                if key not in seen:
                    seen[key] = gemm_rate(m, k, n, reps)
                rows.append({"h": h, "ffn": ffn, "tp": tp, "tokens": tokens, "gemm": name,
                             "m": m, "k": k, "n": n, "tflops": round(seen[key], 1)})
    for size in (1024, 2048, 4096, 8192, 16384):
        rows.append({"gemm": "square", "m": size, "k": size, "n": size,
                     "tflops": round(gemm_rate(size, size, size, reps), 1)})
    # short inner dimensions: attention-like and small-head GEMMs
    for k in (64, 128, 256, 512, 1024):
        rows.append({"gemm": "short_k", "m": 16384, "k": k, "n": 16384,
                     "tflops": round(gemm_rate(16384, k, 16384, reps), 1)})
    return rows


def sustained(seconds: float, size: int = 8192) -> dict[str, float]:
    """Back-to-back products for ``seconds``: the rate in the first 100 ms against the whole."""
    a = torch.randn(size, size, device="cuda", dtype=DTYPE)
    b = torch.randn(size, size, device="cuda", dtype=DTYPE)
    out = torch.empty(size, size, device="cuda", dtype=DTYPE)
    flops = 2 * size ** 3
    torch.cuda.synchronize()
    marks = []
    t0 = time.perf_counter()
    count = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            torch.matmul(a, b, out=out)
        count += 10
        torch.cuda.synchronize()
        marks.append((time.perf_counter() - t0, count))
    burst_t, burst_n = next((t, n) for t, n in marks if t >= 0.1)
    total_t, total_n = marks[-1]
    last_t = total_t - marks[len(marks) // 2][0]
    last_n = total_n - marks[len(marks) // 2][1]
    return {"size": size, "seconds": round(total_t, 2),
            "burst_tflops": round(burst_n * flops / burst_t / 1e12, 1),
            "whole_tflops": round(total_n * flops / total_t / 1e12, 1),
            "second_half_tflops": round(last_n * flops / last_t / 1e12, 1)}


def attention_times(shape: tuple[int, int, int, int], reps: int) -> tuple[float, float]:
    """Seconds of a causal SDPA forward, and of forward+backward, on q, k, v of ``shape``."""
    q, k, v = (torch.randn(shape, device="cuda", dtype=DTYPE, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=DTYPE)
    fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), reps)

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
    return fwd, timed(step, reps)


def attention_sweep(quick: bool, reps: int) -> list[dict[str, Any]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows: list[dict[str, Any]] = []
    seqs = (1024, 4096) if quick else (512, 1024, 2048, 4096, 8192, 16384)
    for backend_name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                                  ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        for dim in (64, 128):
            heads = 2048 // dim
            for seq in seqs:
                batch = max(1, 16384 // seq)
                shape = (batch, heads, seq, dim)
                try:
                    with sdpa_kernel(backend):
                        fwd, both = attention_times(shape, reps)
                except RuntimeError as err:
                    rows.append({"backend": backend_name, "dim": dim, "seq": seq,
                                 "error": str(err).splitlines()[0][:200]})
                    continue
                # causal: half the s^2 work; backward is 2.5x the forward's FLOPs
                fwd_flops = 4 * batch * heads * seq * seq * dim / 2
                rows.append({"backend": backend_name, "dim": dim, "seq": seq, "batch": batch,
                             "heads": heads,
                             "fwd_tflops": round(fwd_flops / fwd / 1e12, 1),
                             "fwd_bwd_tflops": round(3.5 * fwd_flops / both / 1e12, 1)})
    return rows


def memory_sweep(reps: int) -> list[dict[str, Any]]:
    """Forward+backward of memory-bound ops on 16384 tokens x 4096: GB/s of the bytes each must
    move (2 bytes an element; reads and writes of inputs, outputs and their gradients)."""
    tokens, width = 16384, 4096
    n = tokens * width
    x = torch.randn(tokens, width, device="cuda", dtype=DTYPE, requires_grad=True)
    y = torch.randn(tokens, width, device="cuda", dtype=DTYPE, requires_grad=True)
    g = torch.randn(tokens, width, device="cuda", dtype=DTYPE)
    w = torch.ones(width, device="cuda", dtype=DTYPE, requires_grad=True)
    b = torch.zeros(width, device="cuda", dtype=DTYPE, requires_grad=True)
    rows = []
    # bytes moved forward + backward, in elements of the activation: forward reads x (and y),
    # writes out; backward reads grad (and what the op saved), writes the input gradients
    ops: list[tuple[str, Callable[[], torch.Tensor], int]] = [
        ("layer_norm", lambda: F.layer_norm(x, (width,), w, b), 2 + 3),
        ("rms_norm", lambda: F.rms_norm(x, (width,), w), 2 + 3),
        ("gelu", lambda: F.gelu(x), 2 + 3),
        ("silu_mul", lambda: F.silu(x) * y, 3 + 5),
        ("add", lambda: x + y, 3 + 3),
        ("dropout", lambda: F.dropout(x, 0.1, training=True), 2 + 2),
    ]
    for name, fn, elems in ops:
        def step(fn: Callable[[], torch.Tensor] = fn) -> None:
            fn().backward(g)
        seconds = timed(step, reps)
        rows.append({"op": name, "elements": n, "bytes": elems * 2 * n,
                     "ms": round(seconds * 1e3, 3),
                     "gbps": round(elems * 2 * n / seconds / 1e9, 1)})
    vocab, ce_tokens = 50304, 8192
    logits = torch.randn(ce_tokens, vocab, device="cuda", dtype=DTYPE, requires_grad=True)
    target = torch.randint(0, vocab, (ce_tokens,), device="cuda")

    def ce() -> None:
        F.cross_entropy(logits.float(), target).backward()
    seconds = timed(ce, reps)
    ce_bytes = ce_tokens * vocab * 2 * 3  # read logits, write and read grad (bf16)
    rows.append({"op": "cross_entropy", "elements": ce_tokens * vocab, "bytes": ce_bytes,
                 "ms": round(seconds * 1e3, 3), "gbps": round(ce_bytes / seconds / 1e9, 1)})
    return rows


class Layer(torch.nn.Module):
    def __init__(self, h: int, heads: int, kv_heads: int, dim: int, ffn: int, swiglu: bool
                 ) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.norm1 = torch.nn.LayerNorm(h)
        self.qkv = torch.nn.Linear(h, (heads + 2 * kv_heads) * self.dim, bias=False)
        self.proj = torch.nn.Linear(heads * self.dim, h, bias=False)
        self.norm2 = torch.nn.LayerNorm(h)
        self.swiglu = swiglu
        self.fc1 = torch.nn.Linear(h, ffn * (2 if swiglu else 1), bias=False)
        self.fc2 = torch.nn.Linear(ffn, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.dim, self.kv_heads * self.dim, self.kv_heads * self.dim], -1)
        q = q.view(b, s, self.heads, self.dim).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.dim).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.kv_heads != self.heads)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, -1))
        u = self.fc1(self.norm2(x))
        if self.swiglu:
            gate, up = u.chunk(2, -1)
            u = F.silu(gate) * up
        else:
            u = F.gelu(u)
        return x + self.fc2(u)


# (name, hidden, heads, kv heads, head dim, ffn, swiglu, seq, micro-batch): one rank's slice
# of a published model's layer (tensor-parallel slices keep the full hidden size and take
# 1/tp of the heads and of the MLP)
LAYERS = [
    ("mpt-1b", 2048, 16, 16, 128, 8192, False, 2048, 8),
    ("mpt-7b", 4096, 32, 32, 128, 16384, False, 2048, 4),
    ("llama3-8b", 4096, 32, 8, 128, 14336, True, 8192, 1),
    ("gpt3-175b/tp8", 12288, 12, 12, 128, 6144, False, 2048, 1),
    ("llama3-70b/tp8", 8192, 8, 1, 128, 3584, True, 8192, 1),
]


def layer_sweep(reps: int) -> list[dict[str, Any]]:
    rows = []
    for name, h, heads, kv, dim, ffn, swiglu, seq, mb in LAYERS:
        layer = Layer(h, heads, kv, dim, ffn, swiglu).to("cuda", DTYPE)
        fwd, both = layer_times(layer, mb, seq, h, reps)
        params = sum(p.numel() for p in layer.parameters())
        del layer
        tokens = mb * seq
        attn_flops = 4 * mb * heads * seq * seq * dim / 2  # causal forward
        flops = 3 * (2 * tokens * params + attn_flops)
        rows.append({"layer": name, "h": h, "heads": heads, "kv_heads": kv, "head_dim": dim,
                     "ffn": ffn, "swiglu": swiglu, "seq": seq, "micro_batch": mb,
                     "fwd_ms": round(fwd * 1e3, 3), "fwd_bwd_ms": round(both * 1e3, 3),
                     "model_tflops": round(flops / both / 1e12, 1)})
    return rows


def layer_times(layer: Layer, mb: int, seq: int, h: int, reps: int) -> tuple[float, float]:
    x = torch.randn(mb, seq, h, device="cuda", dtype=DTYPE, requires_grad=True)
    g = torch.randn(mb, seq, h, device="cuda", dtype=DTYPE)
    fwd = timed(lambda: layer(x), reps)

    def step() -> None:
        layer(x).backward(g)
    return fwd, timed(step, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=0, help="repeats per timing (default 10/5)")
    ap.add_argument("--sustain-s", type=float, default=8.0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_calibrate: no CUDA GPU on this machine; nothing measured")
        return
    reps = args.reps or (5 if args.quick else 10)
    torch.backends.cuda.matmul.allow_tf32 = True
    props = torch.cuda.get_device_properties(0)
    result: dict[str, Any] = {
        "device": props.name, "sms": props.multi_processor_count,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(result), flush=True)
    for name, fn in (("sustained", lambda: sustained(args.sustain_s)),
                     ("gemm", lambda: gemm_sweep(args.quick, reps)),
                     ("attention", lambda: attention_sweep(args.quick, reps)),
                     ("memory", lambda: memory_sweep(reps)),
                     ("layers", lambda: layer_sweep(reps))):
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as err:  # one part's failure must not lose the others' figures
            result[name] = {"error": f"{type(err).__name__}: {err}"}
        rows = result[name]
        print(f"== {name} ({time.perf_counter() - t0:.1f} s)", flush=True)
        for row in rows if isinstance(rows, list) else [rows]:
            print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
