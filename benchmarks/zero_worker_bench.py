"""One rank of benchmarks/zero_vs_deepspeed.py: trains the benchmark GPT with flowtrain or DeepSpeed
at one ZeRO stage, or with torch DDP (no sharding, the reference ZeRO's cost is measured
against), and appends one JSON line (samples/s, peak RSS and PSS, losses, what ran) to --out.

flowtrain ranks come from ``flowtrain launch``, DeepSpeed and DDP ranks from torchrun; all read
RANK and WORLD_SIZE from the environment. A flowtrain config the engine cannot run yet ("not
supported yet") is written as an ``unavailable`` line and the rank exits 0, so the benchmark goes
on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

# The vocabulary when --vocab is not given: a tiny one, so the blocks (what ZeRO shards and
# overlaps) dominate the step; --vocab 50304 gives a GPT-2-sized embedding and head instead.
VOCAB = 96


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def pss_mib() -> float:
    """This process's proportional set size: a page mapped by n processes counts 1/n in each,
    so the ranks' figures add up to what the host holds (RSS counts a shared page in full on
    every rank that maps it). psutil reads /proc/self/smaps_rollup where the kernel has it."""
    return psutil.Process().memory_full_info().pss / 2**20


def peak_pss_mib(run: Callable[[], object], interval_s: float = 0.005) -> float:
    """The largest PSS seen while ``run()`` runs, sampled from a thread every ``interval_s``.
    The kernel keeps no peak PSS as it does a peak RSS, and sampling costs CPU, so the caller
    runs it over untimed steps."""
    peak, done = pss_mib(), threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(interval_s):
            peak = max(peak, pss_mib())

    sampler = threading.Thread(target=sample, name="pss-sampler", daemon=True)
    sampler.start()
    try:
        run()
    finally:
        done.set()
        sampler.join(timeout=5)
    return max(peak, pss_mib())


def ds_config(args: argparse.Namespace) -> dict:
    """The DeepSpeed config both engines get (flowtrain adds its own section)."""
    zero: dict = {"stage": args.stage, "reduce_bucket_size": args.reduce_bucket_size,
                  "allgather_bucket_size": args.reduce_bucket_size,
                  "contiguous_gradients": True, "overlap_comm": args.overlap_comm}
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    adam = {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}
    if args.torch_adam:
        adam["torch_adam"] = True
    cfg = {"train_micro_batch_size_per_gpu": args.micro_batch,
           "gradient_accumulation_steps": args.grad_accum,
           "gradient_clipping": args.clip,
           "steps_per_print": int(os.environ.get("BENCH_PRINT", 10**9)),
           "wall_clock_breakdown": False,
           "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": adam}}
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if args.engine == "deepspeed" and args.offload and args.torch_adam:
        # ZeRO-Offload otherwise insists on DeepSpeedCPUAdam (a C++ op build).
        cfg["zero_force_ds_cpu_optimizer"] = False
    if args.engine == "flowtrain" and args.data_channel != "auto":
        cfg["flowtrain"] = {"data_channel": args.data_channel}
    return cfg


class DDPEngine:
    """torch DDP with the engines' surface (``engine(x, y)``, ``backward``, ``step`` once per
    micro-batch, the optimizer stepping at the accumulation boundary), so the timed loop is the
    same code for all three."""

    def __init__(self, model: torch.nn.Module, config: dict) -> None:
        self.model = torch.nn.parallel.DistributedDataParallel(model)
        params = config["optimizer"]["params"]
        # torch's fastest AdamW on this device: the peer at its best
        self.fused = not params.get("torch_adam", False)
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=params["lr"], betas=tuple(params["betas"]), eps=params["eps"],
            weight_decay=params["weight_decay"], fused=self.fused or None)
        self.grad_accum = config["gradient_accumulation_steps"]
        self.clip = config["gradient_clipping"]
        self.micro = 0

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> object:
        last = (self.micro + 1) % self.grad_accum == 0
        self._sync = contextlib.nullcontext() if last else self.model.no_sync()
        self._sync.__enter__()
        return self.model(x, y)

    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed's rule: the loss of each micro-batch is divided by the accumulation steps
        (loss / self.grad_accum).backward()
        self._sync.__exit__(None, None, None)

    def step(self) -> None:
        self.micro += 1
        if self.micro % self.grad_accum:
            return
        if self.clip and self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def ddp_initialize(model: torch.nn.Module, model_parameters: object, config: dict,
                   ) -> tuple[DDPEngine]:
    del model_parameters  # the same call as the engines'
    return (DDPEngine(model, config),)


def batches(args: argparse.Namespace, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed cycle of distinct micro-batches per rank, the same for both engines."""
    gen = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(args.data_batches):
        b = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len + 1), generator=gen)
        out.append((b[:, :-1].contiguous(), b[:, 1:].contiguous()))
    return out


def write(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["flowtrain", "deepspeed", "ddp"], required=True)
    parser.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=0,
                        help="ZeRO stage (flowtrain, deepspeed; ddp ignores it)")
    parser.add_argument("--offload", action="store_true", help="offload_optimizer device cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first")
    parser.add_argument("--micro-batch", type=int, default=8,
                        help="sequences per rank per micro-step")
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient_clipping")
    parser.add_argument("--reduce-bucket-size", type=int, default=500_000,
                        help="reduce_bucket_size and allgather_bucket_size (elements)")
    parser.add_argument("--overlap-comm", action="store_true", help="zero overlap_comm")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--torch-adam", action="store_true",
                        help="torch.optim.AdamW in both engines instead of their own kernels")
    parser.add_argument("--data-channel", choices=["auto", "shm", "torch"], default="shm",
                        help="flowtrain's data_channel")
    parser.add_argument("--n-layer", type=int, default=6, help="transformer blocks")
    parser.add_argument("--n-embd", type=int, default=256, help="model width")
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size")
    parser.add_argument("--data-batches", type=int, default=4,
                        help="distinct micro-batches per rank")
    parser.add_argument("--out", required=True, help="file to append the result line to")
    args = parser.parse_args()

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    t_start = time.perf_counter()
    if args.engine == "ddp" and (args.dtype != "fp32" or args.offload):
        write(args.out, {"engine": args.engine, "rank": rank,
                         "unavailable": "the torch DDP reference runs fp32 without offload"})
        return
    if args.engine == "ddp":
        dist.init_process_group("gloo")
        initialize = ddp_initialize
    elif args.engine == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        # Without oneccl_bindings_for_pytorch the CPU accelerator already picks gloo; say so.
        deepspeed.init_distributed(dist_backend="gloo")
        initialize = deepspeed.initialize
    else:
        import flowtrain

        initialize = flowtrain.initialize

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq_len, n_layer=args.n_layer,
                          n_head=args.n_head, n_embd=args.n_embd))
    params = sum(p.numel() for p in model.parameters())
    data = batches(args, rank)
    rss_before = peak_rss_mib()  # imports and the model, before the engine exists
    cfg = ds_config(args)
    t_import = time.perf_counter()
    try:
        engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=cfg)
    except Exception as exc:  # noqa: BLE001 - "not supported yet" is a result, not a crash
        if args.engine == "flowtrain" and "not supported yet" in str(exc):
            write(args.out, {"engine": args.engine, "rank": rank, "unavailable": str(exc)})
            return
        raise

    t_init = time.perf_counter()
    micro = 0

    def step() -> float:
        nonlocal micro
        total = 0.0
        for _ in range(args.grad_accum):
            x, y = data[micro % len(data)]
            micro += 1
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        return total / args.grad_accum

    losses = [step() for _ in range(args.warmup)]
    t_warm = time.perf_counter()
    if dist.is_initialized():
        dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    step_times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        losses.append(step())
        step_times.append(time.perf_counter() - t)
    if dist.is_initialized():
        dist.barrier()
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    # two more steps, untimed, for the peak PSS; their losses are not reported
    pss = peak_pss_mib(lambda: [step() for _ in range(2)]) if sys.platform == "linux" else 0.0

    if args.engine == "ddp":
        opt = f"{type(engine.optimizer).__name__} (fused={engine.fused})"
        backend = channel = dist.get_backend()
    elif args.engine == "deepspeed":
        opt = f"{type(engine.basic_optimizer).__name__} in {type(engine.optimizer).__name__}"
        backend = dist.get_backend() if dist.is_initialized() else "none"
        channel = backend
    else:
        inner = getattr(engine.optimizer, "optimizer", None)
        opt = type(engine.optimizer).__name__ + (f" in {type(inner).__name__}" if inner else "")
        backend = dist.get_backend() if dist.is_initialized() else "none"
        channel = "shm" if getattr(engine, "channel", None) is not None else backend
    write(args.out, {
        "engine": args.engine, "rank": rank, "world": world, "params": params,
        "samples_per_s": args.steps * args.grad_accum * args.micro_batch * world / elapsed,
        "step_s": elapsed / args.steps, "step_times": step_times,
        # this rank's CPU time (every thread) per step: other jobs on a shared machine disturb
        # it far less than the wall clock
        "cpu_step_s": cpu / args.steps,
        "samples_per_step": args.grad_accum * args.micro_batch * world,
        "peak_rss_mib": peak_rss_mib(), "peak_pss_mib": pss,
        "rss_before_engine_mib": rss_before, "losses": losses, "optimizer": opt,
        "backend": backend, "channel": channel,
        "threads": torch.get_num_threads(),
        "since_process_start_s": time.time() - psutil.Process().create_time(),
        "import_s": t_import - t_start, "init_s": t_init - t_import,
        "warmup_s": t_warm - t_init})
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main()
