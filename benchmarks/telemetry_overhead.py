"""What telemetry costs a training step, end to end. One rank, started by ``flowtrain launch``
as in a real job (the coordinator and the recorder live in the launcher), trains in blocks of
steps that alternate between telemetry off (no after_step stage) and telemetry on (the
Telemetry tap at after_step, its actor publishing through the control plane to the launcher,
which records every record), in pairs whose order flips each time so drift hits both alike.
The steps an "on" block leaves held are published between blocks, untimed; the actor's idle
timer ticks in both modes. Wall time is what training feels; the rank's CPU time (all its
threads) is the work telemetry adds. It prints each mode's median step, the ratio on/off of
the medians and the median of the rounds' ratios (with a bootstrap 90% interval), CPU per step
on the training thread and on the others, the CPU time of the actor's record building and
publishing, and a verdict: both median ratios within the budget (default 1%).

    python benchmarks/telemetry_overhead.py [--width 512] [--depth 4] [--batch 64]
    python benchmarks/telemetry_overhead.py --noop   # also a stage that ignores StepDone
    python benchmarks/telemetry_overhead.py --in-process   # the rank hosts its own coordinator
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

from flowtrain.engine.stages import StepDone
from flowtrain.runtime.actor import Actor, handler


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, width), nn.GELU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def timed_block(engine: Any, data: tuple[torch.Tensor, torch.Tensor],
                steps: int) -> tuple[float, float, float]:
    """Mean seconds per optimizer step over ``steps`` steps: wall, CPU of the whole process
    (all threads), CPU of the training thread."""
    x, y = data
    start, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
    for _ in range(steps):
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    return ((time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps,
            (time.thread_time() - own) / steps)


class NoopStage(Actor):
    """An after_step stage that ignores what it gets: what a message per step to an actor
    costs (the event loop's thread woken every step)."""

    @handler
    async def step_done(self, msg: StepDone) -> None:
        pass


def run(args: argparse.Namespace) -> dict[str, Any]:
    import flowtrain
    from flowtrain import telemetry
    from flowtrain.telemetry.actor import FlushTelemetry, TelemetryActor, TelemetryTap

    if os.environ.get("FLOWTRAIN_LAUNCHED") != "1":
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    torch.set_num_threads(args.threads)
    model = make_model(args.width, args.depth)
    config = {"train_batch_size": args.batch, "train_micro_batch_size_per_gpu": args.batch,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
              "steps_per_print": 10**9, "gradient_clipping": 0.0,
              "flowtrain": {"telemetry_hz": args.hz}}
    engine, _, _, _ = flowtrain.initialize(model=model, config=config)
    points = engine.stages.at["after_step"]
    # Under flowtrain launch, initialize has attached it already.
    tap = next((r for r in points if isinstance(r, TelemetryTap)), None)
    if tap is None:
        ref = telemetry.attach(engine, force=True)
        if ref is None:
            raise SystemExit("telemetry did not attach; is flowtrain.telemetry off in the config?")
        tap = ref._actor.tap
    actor: TelemetryActor = tap.ref._actor  # type: ignore[union-attr]
    # the actor's CPU seconds (loop thread), the tap's seconds (training thread), records
    spent = [0.0, 0.0, 0]
    counting = [True]
    flush, send = actor._flush, tap.send_from_thread

    def timed_flush() -> None:
        start, before = time.thread_time(), actor.published
        try:
            flush()
        finally:
            if counting[0]:
                spent[0] += time.thread_time() - start
                spent[2] += actor.published - before

    def timed_send(msg: StepDone, *, timeout: float | None = None) -> None:
        start = time.perf_counter()
        send(msg)
        spent[1] += time.perf_counter() - start

    actor._flush = timed_flush  # type: ignore[method-assign]
    tap.send_from_thread = timed_send  # type: ignore[method-assign]
    stages: dict[str, list[Any]] = {"off": [], "on": [tap]}
    if args.noop:
        stages["noop"] = [engine.add_stage(NoopStage(), at="after_step")]
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(args.batch, 64, generator=g), torch.randn(args.batch, 1, generator=g))
    points[:] = [tap]
    timed_block(engine, data, args.warmup)
    spent[:] = [0.0, 0.0, 0]
    times: dict[str, list[tuple[float, float, float]]] = {mode: [] for mode in stages}
    modes = list(stages)
    for block in range(args.blocks):
        # Flip (or rotate) which mode goes first so drift (other processes, clocks) hits all
        # alike; each round's blocks are adjacent in time, so their ratio is a fair pair.
        k = block % len(modes)
        for mode in (modes[k:] + modes[:k]):
            points[:] = stages[mode]
            times[mode].append(timed_block(engine, data, args.steps))
            if mode == "on":
                # The actor's timer publishes at its rate while steps come; the steps left
                # when a block ends go out now, untimed, not in the next block's time.
                counting[0] = False
                tap.ref.ask_from_thread(FlushTelemetry())  # type: ignore[union-attr]
                counting[0] = True
    on_steps = args.blocks * args.steps
    points[:] = [tap, *stages.get("noop", [])]
    engine.destroy()
    result: dict[str, Any] = {"times": times}
    for mode, samples in times.items():
        result[mode] = statistics.median(w for w, _, _ in samples)
        result[f"{mode}_cpu"] = statistics.median(c for _, c, _ in samples)
        result[f"{mode}_train"] = statistics.median(t for _, _, t in samples)
        result[f"{mode}_others"] = statistics.median(c - t for _, c, t in samples)
    return result | {
            "published": spent[2], "on_seconds": sum(w for w, _, _ in times["on"]) * args.steps,
            "dropped": actor.dropped,
            "actor_cpu": spent[0] / on_steps, "tap_s": spent[1] / on_steps,
            "params": sum(p.numel() for p in model.parameters())}


def paired(times: dict[str, list[tuple[float, float, float]]], mode: str,
           column: int) -> tuple[float, float, float]:
    """The median over rounds of ``mode``/off (wall: column 0, CPU: 1) and a bootstrap 90%
    interval of that median."""
    ratios = [m[column] / o[column] for m, o in zip(times[mode], times["off"], strict=True)]
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return statistics.median(ratios), boot[len(boot) // 20], boot[-len(boot) // 20 - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    parser.add_argument("--depth", type=int, default=4, help="hidden layers of the MLP")
    parser.add_argument("--batch", type=int, default=64, help="samples per step")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=250, help="blocks per mode")
    parser.add_argument("--warmup", type=int, default=30, help="untimed steps first")
    parser.add_argument("--hz", type=float, default=10.0, help="flowtrain.telemetry_hz")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--budget", type=float, default=0.01,
                        help="the overhead allowed, as a share of a step (default 0.01 = 1%%)")
    parser.add_argument("--noop", action="store_true",
                        help="also time a stage that ignores StepDone (a message per step)")
    parser.add_argument("--in-process", action="store_true",
                        help="no launcher: the rank hosts the coordinator (costs it more)")
    args = parser.parse_args()
    if not args.in_process and os.environ.get("FLOWTRAIN_LAUNCHED") != "1":
        sys.exit(relaunch())
    result = run(args)
    on, off = result["on"], result["off"]
    on_cpu, off_cpu = result["on_cpu"], result["off_cpu"]
    times = result["times"]
    print(f"model: MLP {args.depth}x{args.width} ({result['params']:,} parameters), "
          f"batch {args.batch}, {args.threads} torch thread(s), telemetry_hz {args.hz:g}; "
          f"{args.blocks} rounds of {args.steps}-step blocks")
    print(f"median step, telemetry off:  {off * 1e3:8.3f} ms wall  {off_cpu * 1e3:8.3f} ms CPU")
    if "noop" in times:
        noop_wall = paired(times, "noop", 0)[0]
        print(f"median step, no-op stage:    {result['noop'] * 1e3:8.3f} ms wall  "
              f"{result['noop_cpu'] * 1e3:8.3f} ms CPU  (paired ratio to off {noop_wall:.4f})")
    print(f"median step, telemetry on:   {on * 1e3:8.3f} ms wall  {on_cpu * 1e3:8.3f} ms CPU")
    wall, wall_lo, wall_hi = paired(times, "on", 0)
    cpu, cpu_lo, cpu_hi = paired(times, "on", 1)
    print(f"ratio on/off of the medians: wall {on / off:.4f}, CPU {on_cpu / off_cpu:.4f}")
    print(f"median of the rounds' ratios on/off: wall {wall:.4f} (90% {wall_lo:.4f}-"
          f"{wall_hi:.4f}), CPU {cpu:.4f} (90% {cpu_lo:.4f}-{cpu_hi:.4f})")
    print(f"CPU per step, training thread: off {result['off_train'] * 1e6:.0f} us, on "
          f"{result['on_train'] * 1e6:.0f} us; other threads (event loop, ZeroMQ I/O): off "
          f"{result['off_others'] * 1e6:.0f} us, on {result['on_others'] * 1e6:.0f} us "
          f"(medians)")
    print(f"telemetry's own work: actor {result['actor_cpu'] * 1e6:.1f} us CPU per step "
          f"({result['actor_cpu'] / off_cpu:.3%} of a step's CPU) for "
          f"{result['published'] / result['on_seconds']:.1f} records/s; tap on the training "
          f"thread {result['tap_s'] * 1e6:.2f} us per step, GIL waits included "
          f"({result['tap_s'] / off:.3%}); records dropped {result['dropped']}")
    ok = wall <= 1 + args.budget and cpu <= 1 + args.budget
    print(f"verdict: telemetry overhead {'WITHIN' if ok else 'OVER'} the {args.budget:.0%} "
          f"budget: {wall - 1:+.2%} wall, {cpu - 1:+.2%} CPU per step (median paired ratios; "
          f"90% intervals up to {wall_hi - 1:+.2%} wall, {cpu_hi - 1:+.2%} CPU)")


def relaunch() -> int:
    """Runs this script as the one rank of a `flowtrain launch` job, in a scratch run dir."""
    run_dir = tempfile.mkdtemp(prefix="telemetry-overhead-")
    try:
        cmd = [sys.executable, "-m", "flowtrain.cli", "launch", "--nproc-per-node", "1",
               "--run-dir", run_dir, __file__, *sys.argv[1:]]
        return subprocess.run(cmd, timeout=3600).returncode
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
