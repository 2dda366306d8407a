"""What checkpointing every K steps costs training throughput: none, a synchronous save
(``save_checkpoint`` writes everything before it returns) and checkpoint.async_save (it returns
once the state is in host memory; a background thread writes it). A small GPT on 2 CPU ranks
(``--ranks``) of one `flowtrain launch` job trains in rounds that visit the three modes in an
order that rotates each round, so drift (other processes, the page cache) hits all alike. In a
checkpointing round a save comes at the first step of every K-step window, and the round's
time ends once its last save is published, so no write leaks into the next round. It prints
each mode's median throughput and the median over rounds of each mode's throughput ratio to
"none" (samples/s with checkpoints / without), with a verdict against the budget (5 %); also
how long the training loop waited per save, and the CPU time saves add. Where training already
fills every core (2 ranks on 2 cores), the writer's CPU work competes with the steps, so the
throughput gain of async over sync shows only where host cores are idle (GPU training, or
fewer ``--ranks`` than cores); the wait per save shows what async takes off the training loop.

    python benchmarks/async_checkpoint.py [--layers 4] [--width 256] [--every 10] [--rounds 24]
                                          [--ranks 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

MODES = ("none", "sync", "async")


def run_rank(args: argparse.Namespace, out: Path) -> None:
    """One rank: every round, every mode; rank 0 writes the timings to ``out``."""
    import torch.distributed as dist

    import flowtrain
    from flowtrain.checkpoint import save_engine
    from gpt import GPT, GPTConfig

    torch.set_num_threads(args.threads)
    flowtrain.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=args.seq, n_layer=args.layers, n_head=8,
                          n_embd=args.width))
    save_dir = out.parent / "ckpt"
    config = {"train_micro_batch_size_per_gpu": args.batch, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "checkpoint": {"save_dir": str(save_dir), "async_save": True}}
    engine, *_ = flowtrain.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, 512, (args.batch, args.seq), generator=g)
    targets = torch.randint(0, 512, (args.batch, args.seq), generator=g)

    def step() -> None:
        _, loss = engine(idx, targets)
        engine.backward(loss)
        engine.step()

    def save(mode: str, k: int) -> None:
        # two tags per mode, taking turns: each save replaces the one two saves back, so the
        # disk holds a bounded number of checkpoints and every mode removes as many
        tag = f"{mode}{k % 2}"
        if mode == "sync":
            save_engine(engine, str(save_dir), tag)
        else:
            engine.save_checkpoint(tag=tag)  # async_save is on in the config

    def timed_round(mode: str) -> tuple[float, float, float]:
        """(the round's seconds, the seconds the training loop spent in saves and in the
        final wait for the last one, the CPU seconds of both ranks, every thread)."""
        steps = args.every * args.windows
        blocked = 0.0
        dist.barrier()
        cpu = time.process_time()
        start = time.perf_counter()
        for i in range(steps):
            step()
            if mode != "none" and i % args.every == 0:
                began = time.perf_counter()
                save(mode, i // args.every)
                blocked += time.perf_counter() - began
        began = time.perf_counter()
        engine.wait_for_checkpoint()
        blocked += time.perf_counter() - began
        dist.barrier()
        seconds = time.perf_counter() - start
        cpu_both = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
        dist.all_reduce(cpu_both)
        return seconds, blocked, float(cpu_both)

    for _ in range(args.warmup):
        step()
    for mode in ("sync", "async"):  # the first save of each kind pays one-time costs
        save(mode, 0)
        engine.wait_for_checkpoint()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    blocked: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES[r % 3:] + MODES[:r % 3]:
            seconds, waited, used = timed_round(mode)
            times[mode].append(seconds)
            blocked[mode].append(waited)
            cpu[mode].append(used)
    engine.destroy()
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        out.write_text(json.dumps({"times": times, "blocked": blocked, "cpu": cpu,
                                   "params": params}))


def report(args: argparse.Namespace, data: dict[str, Any]) -> None:
    times = data["times"]
    steps = args.every * args.windows
    samples = steps * args.batch * args.ranks
    print(f"model: GPT {args.layers} layers x {args.width}, context {args.seq}, vocab 512 "
          f"({data['params']:,} parameters; a checkpoint holds them and AdamW's 2 moments in "
          f"fp32, {data['params'] * 12 / 2**20:.0f} MiB), {args.ranks} CPU rank(s) x batch "
          f"{args.batch}, "
          f"{args.threads} torch thread(s) each; a save every {args.every} steps, "
          f"{args.rounds} rounds of {steps} steps per mode")
    for mode in MODES:
        median = statistics.median(times[mode])
        print(f"{mode:>5}: median {samples / median:8.1f} samples/s "
              f"({median / steps * 1e3:.1f} ms per step)")
    for mode in ("sync", "async"):
        per_save = statistics.median(b / args.windows for b in data["blocked"][mode])
        print(f"{mode:>5}: the training loop waited {per_save * 1e3:.1f} ms per save (median; "
              f"the save call, and for the round's last save the wait for its write)")
    budget = args.budget
    verdicts = []
    for mode in ("sync", "async"):
        ratios = [none / t for none, t in zip(times["none"], times[mode], strict=True)]
        ratio = statistics.median(ratios)
        print(f"throughput {mode}/none: median of the rounds' ratios {ratio:.4f} "
              f"(rounds: {min(ratios):.4f}-{max(ratios):.4f}); ratio of the medians "
              f"{statistics.median(times['none']) / statistics.median(times[mode]):.4f}")
        verdicts.append((mode, ratio))
    for mode in ("sync", "async"):
        ratios = [c / none for none, c in zip(data["cpu"]["none"], data["cpu"][mode],
                                               strict=True)]
        print(f"CPU time {mode}/none (every rank, every thread: the work a save adds, which "
              f"competes with training when no core is idle): median of the rounds' ratios "
              f"{statistics.median(ratios):.4f}")
    ratio = dict(verdicts)["async"]
    ok = ratio >= 1 - budget
    print(f"verdict: async checkpointing every {args.every} steps costs {1 - ratio:.2%} of "
          f"throughput, {'WITHIN' if ok else 'OVER'} the {budget:.0%} budget (sync costs "
          f"{1 - dict(verdicts)['sync']:.2%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--width", type=int, default=256, help="embedding width")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sample")
    parser.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--windows", type=int, default=1,
                        help="checkpoint windows (of --every steps) per round")
    parser.add_argument("--rounds", type=int, default=24,
                        help="rounds (each runs every mode)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--ranks", type=int, default=2,
                        help="ranks (fewer than the host's cores leaves a core idle for the "
                             "writer, as a GPU host's cores mostly are)")
    parser.add_argument("--budget", type=float, default=0.05,
                        help="the throughput async checkpointing may cost (default 0.05)")
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)  # set for the ranks
    args = parser.parse_args()
    if args.out is not None:
        run_rank(args, Path(args.out))
        return
    scratch = Path(tempfile.mkdtemp(prefix="async-checkpoint-"))
    try:
        out = scratch / "times.json"
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1] / "examples"),
                                             env.get("PYTHONPATH", "")])
        cmd = [sys.executable, "-m", "flowtrain.cli", "launch", "--nproc-per-node",
               str(args.ranks), "-q",
               "--run-dir", str(scratch / "run"), __file__, *sys.argv[1:], "--out", str(out)]
        code = subprocess.run(cmd, env=env, timeout=3600).returncode
        if code != 0:
            sys.exit(code)
        report(args, json.loads(out.read_text()))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
