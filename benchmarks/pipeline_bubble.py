"""Measured pipeline bubble on this machine against (p - 1) / (m + p - 1) and the simulator.

Two ranks (p = 2 stages) train a stack of equal Linear+GELU layers with 1F1B for m = 4 and 8
micro-batches, launched with `flowtrain launch` so the engine records its spans in the run
directory. From each stage's spans: busy = forward + backward time, makespan = the stage's first
forward start to its last backward end, bubble = 1 - busy / makespan (median over steps after
warm-up, averaged over the stages).

"simulated" is the simulator's prediction for the same runs: the 1F1B schedule of
``sims.planner.pipeline_tasks`` run by ``sims.executor`` with the runs' own median forward and
backward times and this host's calibrated pipeline send (`flowtrain calibrate`; free sends when
there is no profile), the bubble read off its timeline the same way. "profile" predicts the
whole run from the calibrated profile alone (``flowtrain simulate --compare``).

Where the measured bubble is above the simulated one, the breakdown shows where a stage's
makespan went besides compute: waiting in recv for the neighbour's activations or gradients,
launching sends, and the gaps between spans (handing each op to the compute thread and back).

    python benchmarks/pipeline_bubble.py [--steps 12] [--width 512] [--layers 8] [--micro 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
WORKER = r'''
import sys, torch
from torch import nn
import flowtrain
from flowtrain.pipe import PipelineModule

m, steps, width, layers, micro = (int(a) for a in sys.argv[1:6])
torch.set_num_threads(1)
flowtrain.init_distributed()
torch.manual_seed(0)
blocks = []
for _ in range(layers):
    blocks += [nn.Linear(width, width), nn.GELU()]
module = PipelineModule(blocks, num_stages=2, loss_fn=nn.functional.mse_loss,
                        partition_method="uniform")
cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": m,
       "steps_per_print": 10**9, "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}
engine, *_ = flowtrain.initialize(model=module, config=cfg)
g = torch.Generator().manual_seed(1)
for step in range(steps):
    data = iter([(torch.randn(micro, width, generator=g), torch.randn(micro, width, generator=g))
                 for _ in range(m)])
    engine.train_batch(data)
engine.destroy()
'''
WARMUP = 2  # steps left out: plans, first allocations, the observed bucket order


def _stage_bubble(spans: list[tuple[str, float, float]]) -> dict[str, float]:
    """One stage's step: busy compute, makespan and where the rest of the makespan went."""
    compute = [(a, b) for n, a, b in spans if n.startswith(("forward/", "backward/"))]
    first = min(a for a, _ in compute)
    last = max(b for _, b in compute)
    inside = [(n, max(a, first), min(b, last)) for n, a, b in spans if b > first and a < last]
    busy = sum(b - a for a, b in compute)
    recv = sum(b - a for n, a, b in inside if n.startswith("recv_"))
    send = sum(b - a for n, a, b in inside if n.startswith("send_"))
    makespan = last - first
    return {"bubble": 1 - busy / makespan, "makespan": makespan, "busy": busy, "recv": recv,
            "send": send, "gaps": makespan - busy - recv - send,
            "ops": float(sum(1 for n, _, _ in inside if not n.startswith("optimizer")))}


def measure(m: int, steps: int, width: int, layers: int, micro: int,
            keep: Path | None) -> tuple[dict[str, Any], Path]:
    """Launches the 2-stage job and reads its run directory's spans."""
    from sims.compare import read_run

    tmp = tempfile.mkdtemp(prefix="pipeline_bubble_")
    script = Path(tmp) / "bubble_worker.py"
    script.write_text(WORKER)
    run_dir = (keep or Path(tmp)) / f"m{m}"
    cmd = [str(REPO / ".venv/bin/flowtrain"), "launch", "--nproc-per-node", "2",
           "--run-dir", str(run_dir), str(script), str(m), str(steps), str(width), str(layers),
           str(micro)]
    subprocess.run(cmd, check=True, timeout=600, capture_output=True,
                   env={**os.environ, "FLOWTRAIN_CONSOLE_LEVEL": "ERROR"})
    run = read_run(run_dir)
    per_stage: list[dict[str, float]] = []
    fwd: list[float] = []
    bwd: list[float] = []
    for rank in sorted(run.steps):
        rows = [_stage_bubble(spans) for spans in run.steps[rank][WARMUP:]]
        per_stage.append({k: statistics.median(r[k] for r in rows) for k in rows[0]})
        for spans in run.steps[rank][WARMUP:]:
            fwd += [b - a for n, a, b in spans if n.startswith("forward/")]
            bwd += [b - a for n, a, b in spans if n.startswith("backward/")]
    return {"stages": per_stage, "forward_s": statistics.median(fwd),
            "backward_s": statistics.median(bwd)}, run_dir


def simulated(m: int, fwd: float, bwd: float, send_s: float) -> float:
    """The simulator's bubble for 2 stages of m micro-batches with these pass and send times,
    read off its timeline as the measured one is."""
    from sims.executor import execute
    from sims.planner import pipeline_tasks

    timeline = execute(pipeline_tasks(2, m, fwd, bwd, send_s))
    bubbles = []
    for stage in range(2):
        spans = [(t.name, a, b) for t, a, b in timeline.spans() if t.stage == stage]
        bubbles.append(_stage_bubble(spans)["bubble"])
    return statistics.fmean(bubbles)


def profile_bubble(run_dir: Path, cluster: str) -> float | None:
    """The bubble of the whole run predicted from the calibrated profile (simulate --compare's
    plan of the run), read off the timeline the same way; None without a profile."""
    from flowtrain.config import load_config
    from sims.compare import read_run
    from sims.hardware import ProfileError, get_profile
    from sims.planner import Layout, Workload
    from sims.simulate import predict

    try:
        hw = get_profile(cluster)
    except ProfileError:
        return None
    run = read_run(run_dir)
    cfg = load_config(run.plan["config"], world_size=1, check_supported=False)
    work = Workload.from_stages(run.stages, cfg.train_micro_batch_size_per_gpu)
    prediction = predict(None, cfg, Layout(1, 2, 1, len(run.stages)), hw, cluster=cluster,
                         workload=work)
    bubbles = []
    for stage in range(len(run.stages)):
        spans = [(t.name, a, b) for t, a, b in prediction.timeline.spans() if t.stage == stage]
        bubbles.append(_stage_bubble(spans)["bubble"])
    return statistics.fmean(bubbles)


def send_seconds(cluster: str, nbytes: float) -> float:
    """This host's calibrated pipeline send of ``nbytes`` (0 without a profile)."""
    from sims.costs import p2p_seconds
    from sims.hardware import ProfileError, get_profile

    try:
        return p2p_seconds(nbytes, get_profile(cluster), inter_node=False)
    except ProfileError:
        return 0.0


def _probe_rank(rank: int, port: int, nbytes: int, count: int, out: Any) -> None:
    """One of two processes: one-way time of a pipeline message (an int64 header, then the
    float32 tensor) by ping-pong, waited on blocking, then through ``flowtrain.comm.wait``
    inside an event loop as the pipeline engine's stage actor waits on it."""
    import asyncio
    import time

    import torch
    import torch.distributed as dist

    from flowtrain import comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    peer = 1 - rank
    header, tensor = torch.zeros(64, dtype=torch.int64), torch.zeros(nbytes // 4)

    def blocking() -> None:
        for leg in range(2):  # there (rank 0 sends) and back
            if (rank == 0) == (leg == 0):
                dist.isend(header, peer).wait()
                dist.isend(tensor, peer).wait()
            else:
                dist.irecv(header, peer).wait()
                dist.irecv(tensor, peer).wait()

    async def through_the_loop() -> None:
        for leg in range(2):
            if (rank == 0) == (leg == 0):
                works = [dist.isend(header, peer), dist.isend(tensor, peer)]
                for work in works:
                    await comm.wait(work, "probe send", 60)
            else:
                await comm.wait(dist.irecv(header, peer), "probe header", 60)
                await comm.wait(dist.irecv(tensor, peer), "probe tensor", 60)

    async def timed_loop() -> float:
        await through_the_loop()
        start = time.perf_counter()
        for _ in range(count):
            await through_the_loop()
        return (time.perf_counter() - start) / count / 2

    blocking()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(count):
        blocking()
    one_way_blocking = (time.perf_counter() - start) / count / 2
    dist.barrier()
    one_way_loop = asyncio.run(timed_loop())
    if rank == 0:
        out.put((one_way_blocking, one_way_loop))
    dist.barrier()
    dist.destroy_process_group()


def delivery_probe(nbytes: int, count: int = 200) -> tuple[float, float]:
    """(blocking, through flowtrain.comm.wait) one-way seconds of one pipeline message of
    ``nbytes`` between two processes of this host."""
    import multiprocessing as mp

    from sims.calibrate import _free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_probe_rank, args=(r, port, nbytes, count, out))
             for r in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        result = out.get(timeout=300)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--micro", type=int, default=16, help="rows per micro-batch")
    ap.add_argument("--micro-batches", default="4,8", help="m values, comma-separated")
    ap.add_argument("--cluster", default="this-host", help="profile for the send cost")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    args = ap.parse_args()
    load = os.getloadavg()
    sent = args.micro * args.width * 4
    send_s = send_seconds(args.cluster, sent)
    print(f"2 stages, {args.layers} x Linear({args.width})+GELU, micro-batch {args.micro} rows "
          f"({sent / 1024:.0f} KiB sent per micro-batch, calibrated send "
          f"{send_s * 1e6:.0f} us); load average {load[0]:.2f}")
    print(f"{'m':>3} {'measured':>9} {'formula':>8} {'simulated':>9} {'profile':>8} "
          f"{'meas/sim':>8}   per micro-batch: forward, backward")
    details = []
    for m in (int(v) for v in args.micro_batches.split(",")):
        got, run_dir = measure(m, args.steps, args.width, args.layers, args.micro, args.keep)
        bubble = statistics.fmean(s["bubble"] for s in got["stages"])
        formula = (2 - 1) / (m + 2 - 1)
        sim = simulated(m, got["forward_s"], got["backward_s"], send_s)
        whole = profile_bubble(run_dir, args.cluster)
        print(f"{m:>3} {bubble:>9.3f} {formula:>8.3f} {sim:>9.3f} "
              f"{'-' if whole is None else f'{whole:.3f}':>8} {bubble / sim:>8.2f}   "
              f"{got['forward_s'] * 1e3:.2f} ms, {got['backward_s'] * 1e3:.2f} ms", flush=True)
        details.append((m, got))
    print("where each stage's makespan went (median step, ms; gaps: between spans, per op):")
    for m, got in details:
        for stage, s in enumerate(got["stages"]):
            print(f"  m={m} stage {stage}: makespan {s['makespan'] * 1e3:6.2f} = compute "
                  f"{s['busy'] * 1e3:6.2f} + recv wait {s['recv'] * 1e3:6.2f} + send "
                  f"{s['send'] * 1e3:5.2f} + gaps {s['gaps'] * 1e3:5.2f} "
                  f"({s['gaps'] / max(s['ops'], 1) * 1e6:.0f} us x {s['ops']:.0f} ops)")
    blocking, looped = delivery_probe(sent)
    print(f"one pipeline message ({sent / 1024:.0f} KiB: header + tensor) one way between two "
          f"idle processes: {blocking * 1e6:.0f} us waited on blocking, {looped * 1e6:.0f} us "
          f"through flowtrain.comm.wait in an event loop (a thread started per wait: gloo's "
          f"point-to-point work has no future)")
    print(json.dumps({"load_average_end": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
