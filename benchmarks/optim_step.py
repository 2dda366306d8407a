"""The optimizer step as the engine runs it (flowtrain's FusedAdam on the engine's parameters,
one rank, after a real backward) against torch.optim.AdamW(fused=True) and foreach on copies
of the same parameters and gradients; plus the fp16 step's unscale + overflow check and the
grad norm against torch's. Alternating rounds, medians, ratios (> 1: flowtrain is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

HP = dict(lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# wall clock by default; --clock cpu takes this process's CPU time instead, which a machine
# shared with other jobs disturbs far less (meaningful with one thread each:
# OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1, where no thread waits for another)
CLOCK: list[Callable[[], float]] = [time.perf_counter]


# What each timed call finds in the CPU caches. Every implementation steps its own copy of
# the state (~28 bytes a parameter, more than a last-level cache holds here), so a call
# timed straight after another implementation's finds whatever that one left, and a fixed
# order hands one side the same luck every round. "warm": an untimed call of the same
# implementation just before (its own data as cached as the host allows, as in a training
# loop whose model and optimizer state fit the cache); "cold": a write of CACHE_FLUSH_BYTES
# first, so every call streams its state from memory (a model larger than the cache).
CACHE = ["warm"]
CACHE_FLUSH_BYTES = 1 << 30


def _prepare(fn: Callable[[], object], flush: torch.Tensor | None) -> None:
    if CACHE[0] == "warm":
        fn()
    elif flush is not None:
        flush.add_(1)


def _race(impls: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    for fn in impls.values():  # warm: compile, page in, allocate state
        fn()
        fn()
    flush = torch.zeros(CACHE_FLUSH_BYTES // 4) if CACHE[0] == "cold" else None
    times: dict[str, list[float]] = {k: [] for k in impls}
    order = list(impls)
    for r in range(rounds):
        # alternate so drift hits every implementation alike, and rotate the order so each
        # follows every other equally often
        for k in order[r % len(order):] + order[:r % len(order)]:
            _prepare(impls[k], flush)
            _sync()
            t0 = CLOCK[0]()
            impls[k]()
            _sync()
            times[k].append(CLOCK[0]() - t0)
    return times


def _engine(args: argparse.Namespace, precision: str) -> tuple[object, torch.nn.Module]:
    import flowtrain

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=args.vocab, block_size=args.seq_len, n_layer=args.n_layer,
                       n_head=8, n_embd=args.n_embd)
    model = GPT(config).to(args.device)
    cfg: dict = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_clipping": 0.0,
                 "steps_per_print": 10**9,
                 "optimizer": {"type": "AdamW", "params": {"lr": HP["lr"],
                                                           "weight_decay": HP["weight_decay"]}}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    engine, *_ = flowtrain.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    batch = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len + 1),
                          generator=torch.Generator().manual_seed(1)).to(args.device)
    _, loss = engine(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
    engine.backward(loss)  # gradients in the engine's buckets; no step: they stay
    return engine, model


def _torch_optimizers(stepped: list[torch.Tensor]) -> dict[str, torch.optim.Optimizer]:
    """torch AdamW on fp32 copies of what the engine steps, gradients copied, each tensor its
    own allocation as in a plain torch training loop."""
    out: dict[str, torch.optim.Optimizer] = {}
    for name, kw in (("torch fused", {"fused": True}), ("torch foreach", {"foreach": True})):
        params = [torch.nn.Parameter(p.detach().clone()) for p in stepped]
        for q, p in zip(params, stepped):
            q.grad = p.grad.detach().clone()
        out[name] = torch.optim.AdamW(params, **HP, **kw)
    return out


def bench_step(args: argparse.Namespace, precision: str) -> dict[str, list[float]]:
    engine, model = _engine(args, precision)
    opt = engine.optimizer
    stepped = [p for g in opt.param_groups for p in g["params"]]
    optimizers = _torch_optimizers(stepped)
    peers: dict[str, Callable[[], object]] = {k: o.step for k, o in optimizers.items()}
    ours: Callable[[], object] = opt.step
    if precision != "fp32":
        # as the engine steps (flowtrain.engine.optim_step._folded_step): the kernel reads the
        # reduced half buckets with the loss-scale factor; torch's peers read unscaled fp32
        # gradients
        def ours() -> None:
            opt.read_grads_from(zip(engine.master.flat, engine.buckets.buffers()), 1.0 / 1024)
            opt.step()
    if precision != "fp32":
        # flowtrain's step also writes the half-precision model; torch's needs a copy after
        fused = optimizers["torch fused"]
        masters = [p for g in fused.param_groups for p in g["params"]]
        halves = [p.detach().clone() for p in model.parameters()]

        def fused_and_copy() -> None:
            fused.step()
            torch._foreach_copy_(halves, masters)

        peers["torch fused + model copy"] = fused_and_copy
    return _race({"flowtrain": ours, **peers}, args.rounds)


def bench_unscale_norm(args: argparse.Namespace) -> dict[str, list[float]]:
    """fp16, what comes before the step: flowtrain's one read of the reduced buckets (the norm,
    not finite exactly on overflow; the unscale rides in the step's kernel), and the same
    with the former unscale-into-fp32 pass; torch: the AMP unscale kernel over per-parameter
    fp32 gradients, then clip_grad_norm_'s norm."""
    from cuda_numba.ops import l2_norm
    from flowtrain.engine.mixed import total_grad_norm

    engine, model = _engine(args, "fp16")
    master = engine.master
    halves = engine.buckets.buffers()
    half = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    found = torch.zeros(1, device=args.device)
    # torch unscales in place: alternating 1/1024 and 1024 keeps the values where they were
    scales = [torch.full((1,), 1.0 / 1024, device=args.device),
              torch.full((1,), 1024.0, device=args.device)]
    fp32_grads = [g.float() for g in half]  # torch AMP's gradients: fp32, one per parameter

    def flowtrain_unscale() -> object:
        overflow = master.load_grads(engine.buckets, 1024.0)
        if overflow is None:  # before issue 21 the check was a separate pass
            from flowtrain.precision import has_inf_or_nan

            overflow = has_inf_or_nan(engine.buckets.flat)
        return overflow

    def torch_unscale() -> object:
        scales.reverse()
        torch._amp_foreach_non_finite_check_and_unscale_(fp32_grads, found, scales[0])
        return bool(found.item())

    def torch_norm() -> float:
        return float(torch.nn.utils.get_total_norm(fp32_grads, foreach=True))

    return _race({"flowtrain check + norm": lambda: float(l2_norm(halves)),
                  "flowtrain unscale pass + norm": lambda: (flowtrain_unscale(),
                                                            float(total_grad_norm(master.flat))),
                  "torch unscale + norm": lambda: (torch_unscale(), torch_norm()),
                  "torch unscale": torch_unscale}, args.rounds)


def _report(title: str, times: dict[str, list[float]], pairs: list[tuple[str, str]]) -> None:
    print(f"## {title}")
    print("| implementation | median ms | range ms |")
    print("|---|---:|---:|")
    for k, v in times.items():
        print(f"| {k} | {statistics.median(v) * 1e3:.2f} | {min(v) * 1e3:.2f}-"
              f"{max(v) * 1e3:.2f} |")
    for ours, peer in pairs:
        ratio = [b / a for a, b in zip(times[ours], times[peer])]  # per round, alternated
        print(f"{peer} / {ours}: median {statistics.median(ratio):.2f}x "
              f"(range {min(ratio):.2f}-{max(ratio):.2f})")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n-layer", type=int, default=8, help="transformer blocks")
    ap.add_argument("--n-embd", type=int, default=256, help="model width")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--vocab", type=int, default=96, help="vocabulary size")
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences in the backward")
    ap.add_argument("--rounds", type=int, default=31, help="alternating timed rounds")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"],
                    choices=["fp32", "bf16", "fp16"], help="the engine's precision(s)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall clock, or this process's CPU time (see CLOCK)")
    ap.add_argument("--cache", choices=["warm", "cold"], default="warm",
                    help="what each timed call finds in the CPU caches (see CACHE)")
    args = ap.parse_args()
    CACHE[0] = args.cache
    if args.clock == "cpu":
        CLOCK[0] = time.process_time
    import cuda_numba

    cuda_numba.warm_up()
    print(f"device: {args.device}   torch threads: {torch.get_num_threads()}   "
          f"clock: {args.clock}   cache: {args.cache}")
    for precision in args.precision:
        times = bench_step(args, precision)
        n = sum(p.numel() for p in GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq_len,
                                                 n_layer=args.n_layer, n_head=8,
                                                 n_embd=args.n_embd)).parameters())
        _report(f"optimizer step inside the engine, {precision}, {n / 1e6:.2f}M parameters",
                times, [("flowtrain", peer) for peer in times if peer != "flowtrain"])
    _report("fp16 before the step: unscale, overflow check, grad norm", bench_unscale_norm(args),
            [("flowtrain check + norm", "torch unscale + norm"),
             ("flowtrain check + norm", "torch unscale"),
             ("flowtrain unscale pass + norm", "torch unscale + norm")])


if __name__ == "__main__":
    main()
