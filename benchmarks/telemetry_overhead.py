"""What the Telemetry actor costs a training step. One rank, started by ``flowtrain launch`` as
in a real job (the coordinator and the recorder live in the launcher), trains in rotating
blocks of steps: without any after_step stage, with a stage that ignores StepDone (what any
stage costs, paid by telemetry too), and with the Telemetry actor. Prints the median step time
of each mode and the ratio telemetry on / off. Wall time is what training feels; the rank's
CPU time (all its threads) is the work telemetry adds. On a machine other jobs share, both swing
by several percent between blocks, so the script also times the actor's own handlers (CPU time
of the thread running them): that figure over the step's CPU time is the share telemetry takes.

    python benchmarks/telemetry_overhead.py [--width 512] [--depth 4] [--batch 64]
    python benchmarks/telemetry_overhead.py --in-process   # the rank hosts its own coordinator
"""

from __future__ import annotations

import argparse
import os
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
                steps: int) -> tuple[float, float]:
    """Mean wall and process-CPU seconds per optimizer step over ``steps`` steps."""
    x, y = data
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps


class NoopStage(Actor):
    """An after_step stage that ignores what it gets."""

    @handler
    async def step_done(self, msg: StepDone) -> None:
        pass


def run(args: argparse.Namespace) -> dict[str, Any]:
    import flowtrain
    from flowtrain import telemetry
    from flowtrain.telemetry.actor import TelemetryActor

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
    ref = next((r for r in points if isinstance(r._actor, TelemetryActor)), None) or \
        telemetry.attach(engine, force=True)
    if ref is None:
        raise SystemExit("telemetry did not attach; is flowtrain.telemetry off in the config?")
    actor = ref._actor
    noop = engine.add_stage(NoopStage(), at="after_step")
    spent = [0.0]

    def timed(fn: Any) -> Any:
        async def wrapper(msg: Any) -> Any:
            start = time.thread_time()
            try:
                return await fn(msg)
            finally:
                spent[0] += time.thread_time() - start
        return wrapper

    # Handlers are looked up on the instance by name, so these wrappers are what runs.
    actor.step_done = timed(actor.step_done)
    actor.flush = timed(actor.flush)
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(args.batch, 64, generator=g), torch.randn(args.batch, 1, generator=g))
    timed_block(engine, data, args.warmup)
    spent[0] = 0.0
    times: dict[str, list[tuple[float, float]]] = {"off": [], "noop": [], "on": []}
    stages = {"off": [], "noop": [noop], "on": [ref]}
    modes = list(times)
    for block in range(args.blocks):
        # Rotate which mode goes first so drift (other processes, clocks) hits all alike.
        for mode in modes[block % 3:] + modes[:block % 3]:
            points[:] = stages[mode]
            times[mode].append(timed_block(engine, data, args.steps))
    points[:] = [ref, noop]
    engine.destroy()
    result: dict[str, Any] = {}
    for mode, samples in times.items():
        result[mode] = statistics.median(w for w, _ in samples)
        result[f"{mode}_cpu"] = statistics.median(c for _, c in samples)
    return result | {
            "published": actor.published, "dropped": actor.dropped,
            "actor_cpu": spent[0] / (args.blocks * args.steps),
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    parser.add_argument("--depth", type=int, default=4, help="hidden layers of the MLP")
    parser.add_argument("--batch", type=int, default=64, help="samples per step")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=40, help="blocks per mode")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    parser.add_argument("--hz", type=float, default=10.0, help="flowtrain.telemetry_hz")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--in-process", action="store_true",
                        help="no launcher: the rank hosts the coordinator (costs it more)")
    args = parser.parse_args()
    if not args.in_process and os.environ.get("FLOWTRAIN_LAUNCHED") != "1":
        sys.exit(relaunch())
    result = run(args)
    on, off = result["on"], result["off"]
    print(f"model: MLP {args.depth}x{args.width} ({result['params']:,} parameters), "
          f"batch {args.batch}, {args.threads} torch thread(s), telemetry_hz {args.hz:g}")
    on_cpu, off_cpu = result["on_cpu"], result["off_cpu"]
    print(f"median step, telemetry off:  {off * 1e3:8.3f} ms wall  {off_cpu * 1e3:8.3f} ms CPU")
    print(f"median step, no-op stage:    {result['noop'] * 1e3:8.3f} ms wall  "
          f"{result['noop_cpu'] * 1e3:8.3f} ms CPU")
    print(f"median step, telemetry on:   {on * 1e3:8.3f} ms wall  {on_cpu * 1e3:8.3f} ms CPU")
    print(f"ratio on/off: wall {on / off:.4f} ({(on - off) * 1e6:+.1f} us per step), "
          f"CPU {on_cpu / off_cpu:.4f} ({(on_cpu - off_cpu) * 1e6:+.1f} us per step); "
          f"records published {result['published']}, dropped {result['dropped']}")
    print(f"telemetry actor handlers: {result['actor_cpu'] * 1e6:.1f} us CPU per step = "
          f"{result['actor_cpu'] / off_cpu:.3%} of a step's CPU time")


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
