"""One rank of benchmarks/dp_vs_ddp.py: trains the benchmark GPT with flowtrain, torch DDP, or
no communication at all, and writes samples/s and peak RSS as JSON lines to --out."""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

# A step that faults in fewer fresh pages than this (400 KiB) found the heap at its size.
QUIET_FAULTS = 100


def warm_up(step: Callable[[], None], least: int, settle: int, most: int) -> int:
    """Runs ``least`` untimed steps, then more until ``settle`` steps in a row faulted fewer
    than QUIET_FAULTS fresh pages on every rank (at most ``most`` steps in all); returns how
    many ran. Until glibc's heap reaches its high-water mark, a step now and then places a
    large tensor (a 50k-vocabulary head's logits, 200 MB) in memory the process never
    touched: tens of thousands of minor faults, half a second to a second of kernel time,
    seen on this machine as late as the 12th step, and after three quiet steps in a row.
    With independent ranks that costs one rank's rate; with synchronous ones (DDP,
    flowtrain, the synced bound) every rank waits for it, so a short fixed warm-up charges
    those modes for the allocator's growth, not for their steady step. Every mode uses the
    same rule; ranks that talk agree on the count."""
    done, quiet = 0, 0
    talk = dist.is_initialized() and dist.get_world_size() > 1
    while done < most and (done < least or quiet < settle):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step()
        done += 1
        faults = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before])
        if talk:
            dist.all_reduce(faults, op=dist.ReduceOp.MAX)
        quiet = quiet + 1 if int(faults) < QUIET_FAULTS else 0
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["flowtrain", "ddp", "nocomm", "plain"], required=True)
    parser.add_argument("--comm-dtype", default="fp32", help="flowtrain's communication_data_type")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=8,
                        help="untimed steps first, at least (see --settle)")
    parser.add_argument("--settle", type=int, default=4,
                        help="then more untimed steps until this many in a row found the heap "
                             "steady on every rank (see warm_up), 0 for none")
    parser.add_argument("--warmup-max", type=int, default=30,
                        help="the most untimed steps --settle may take")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--n-layer", type=int, default=8, help="transformer blocks")
    parser.add_argument("--n-embd", type=int, default=256, help="model width")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--vocab", type=int, default=96, help="vocabulary size")
    parser.add_argument("--n-head", type=int, default=8, help="attention heads")
    parser.add_argument("--out", required=True, help="file to append the result line to")
    parser.add_argument("--kept-heap", action="store_true",
                        help="torch modes: glibc's malloc set as flowtrain.initialize sets it "
                             "(flowtrain/host_memory.py), to tell the engine's gain from the "
                             "allocator's")
    parser.add_argument("--bucket-numel", type=int, default=0,
                        help="flowtrain: zero_optimization.reduce_bucket_size in elements (0: "
                             "the engine's default)")
    parser.add_argument("--sync-steps", action="store_true",
                        help="nocomm: the ranks wait for each other after every step (a "
                             "barrier, no data), as any synchronous data parallel must: a "
                             "rank slowed by the host holds the others up")
    args = parser.parse_args()
    if args.sync_steps and args.mode != "nocomm":
        parser.error("--sync-steps is for --mode nocomm")

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=args.vocab, block_size=args.seq_len, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(config)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    batch = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len + 1),
                          generator=torch.Generator().manual_seed(rank))
    x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    if args.mode == "flowtrain":
        import flowtrain

        ds_config = {"train_micro_batch_size_per_gpu": args.micro_batch,
                     "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
                     "steps_per_print": int(os.environ.get("BENCH_PRINT", 10**9)),
                     "wall_clock_breakdown": True, "communication_data_type": args.comm_dtype,
                     "optimizer": {"type": "AdamW", "params": {
                         "lr": 3e-4, "weight_decay": 0.01,
                         **({"torch_adam": True} if os.environ.get("BENCH_TORCH_ADAM") else {})}},
                     **({"zero_optimization": {"stage": 0,
                                               "reduce_bucket_size": args.bucket_numel}}
                        if args.bucket_numel else {})}
        engine, *_ = flowtrain.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config)

        def step() -> None:
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
    else:
        if args.kept_heap:
            from flowtrain import host_memory

            if not host_memory.keep_freed_memory():
                raise SystemExit("--kept-heap: glibc's malloc settings could not be applied "
                                 f"({host_memory.user_has_chosen() or 'not glibc'})")
        if args.mode == "ddp" or args.sync_steps:
            dist.init_process_group("gloo")
        if args.mode == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)

        def step() -> None:
            _, loss = model(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if args.sync_steps:
                dist.barrier()

    warmup = warm_up(step, args.warmup, args.settle, args.warmup_max)
    if dist.is_initialized():
        dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        step()
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    result = {"mode": args.mode, "rank": rank, "world": world,
              "samples_per_s": args.steps * args.micro_batch * world / elapsed,
              "step_s": elapsed / args.steps,
              # this rank's CPU time (every thread: compute, reduces, the engine's loop) per
              # step, which other jobs on a shared machine disturb far less than the wall clock
              "cpu_step_s": cpu / args.steps,
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "params": sum(p.numel() for p in model.parameters()), "warmup_steps": warmup}
    with open(args.out, "a") as f:
        f.write(json.dumps(result) + "\n")
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main()
