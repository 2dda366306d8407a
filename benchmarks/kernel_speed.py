"""CPU benchmark of the cuda_numba kernels against torch: AdamW step, unscale + overflow check
and grad norm, alternating implementations per round; medians and fraction of copy bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import cuda_numba as cn


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def copy_bandwidth(n: int, rounds: int) -> float:
    """Bytes/s of a large fp32 dst.copy_(src), counting the read and the write."""
    src, dst = torch.randn(n), torch.empty(n)
    dst.copy_(src)
    return 8 * n / statistics.median(_time(lambda: dst.copy_(src)) for _ in range(rounds))


def _race(impls: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    for fn in impls.values():  # warm: compile, page in, allocate state
        fn()
    times: dict[str, list[float]] = {k: [] for k in impls}
    for _ in range(rounds):
        for k, fn in impls.items():  # alternate so drift hits every implementation alike
            times[k].append(_time(fn))
    return {k: statistics.median(v) for k, v in times.items()}


def bench_adamw(n: int, rounds: int) -> dict[str, float]:
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    grad = torch.randn(n)
    p = torch.randn(n)
    m, v = torch.zeros(n), torch.zeros(n)
    state = {"step": 0}

    def ours() -> None:
        state["step"] += 1
        cn.adam_step(p, grad, m, v, step=state["step"], adamw=True, **hp)

    impls: dict[str, Callable[[], object]] = {"flowtrain": ours}
    for name, kw in (("torch fused", {"fused": True}), ("torch foreach", {"foreach": True})):
        tp = torch.nn.Parameter(torch.randn(n))
        tp.grad = grad.clone()
        opt = torch.optim.AdamW([tp], **hp, **kw)
        impls[name] = opt.step
    return _race(impls, rounds)


def bench_unscale(n: int, rounds: int) -> dict[str, float]:
    grad = torch.randn(n)
    out = torch.empty(n)
    inv = 1.0 / 1024
    found = torch.zeros(1)
    inv_t = torch.full((1,), inv)
    g2 = grad.clone()
    g3 = grad.clone()

    def torch_mul_isfinite() -> bool:
        torch.mul(grad, inv, out=out)
        return bool(torch.isfinite(grad).all())

    def torch_amp() -> None:
        # in place, so it scales g2 a little further each round; values stay finite
        torch._amp_foreach_non_finite_check_and_unscale_([g2], found, inv_t)

    # "flowtrain in place" (out is grad) moves the same bytes as torch's in-place amp kernel;
    # out of place also reads each destination line before writing it (write-allocate).
    # Like g2, g3 shrinks a little each round and stays finite.
    return _race({"flowtrain": lambda: cn.unscale_and_check(grad, out, inv),
                  "flowtrain in place": lambda: cn.unscale_and_check(g3, g3, inv),
                  "torch mul+isfinite": torch_mul_isfinite,
                  "torch amp_unscale_": torch_amp}, rounds)


def bench_norm(n: int, rounds: int) -> dict[str, float]:
    grad = torch.randn(n)
    return _race({"flowtrain": lambda: cn.l2_norm([grad]),
                  "torch vector_norm": lambda: torch.linalg.vector_norm(grad),
                  "torch _foreach_norm": lambda: torch._foreach_norm([grad])}, rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--big", action="store_true", help="also run 100M parameters")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()

    t0 = time.perf_counter()
    cn.warm_up()
    print(f"warm_up: {time.perf_counter() - t0:.2f}s   torch threads: {torch.get_num_threads()}")
    bw = copy_bandwidth(50_000_000, args.rounds)
    print(f"copy bandwidth (dst.copy_(src), 50M fp32, read+write): {bw / 1e9:.1f} GB/s\n")

    sizes = [10_000_000, 50_000_000] + ([100_000_000] if args.big else [])
    tables = (("AdamW step", bench_adamw, 28), ("unscale + inf/NaN check", bench_unscale, 8),
              ("grad L2 norm", bench_norm, 4))
    for title, bench, nbytes in tables:
        print(f"## {title} ({nbytes} bytes moved per element)")
        print("| size | implementation | median ms | GB/s | of copy bw | flowtrain speed-up |")
        print("|---:|---|---:|---:|---:|---:|")
        for n in sizes:
            res = bench(n, args.rounds)
            ours = res["flowtrain"]
            for name, t in res.items():
                gbs = nbytes * n / t
                print(f"| {n // 1_000_000}M | {name} | {t * 1e3:.1f} | {gbs / 1e9:.1f} | "
                      f"{gbs / bw:.0%} | {t / ours:.2f}x |")
        print()


if __name__ == "__main__":
    main()
