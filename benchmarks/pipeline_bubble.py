"""Measured pipeline bubble on this machine against (p - 1) / (m + p - 1) and the simulator.

Two ranks (p = 2 stages) train Linear(64, W) + L x (Linear(W, W) + GELU) with 1F1B for m = 4
and 8 micro-batches, launched with `flowtrain launch` so the engine records its spans in the
run directory. The input projection keeps the stages equal: stage 0 gets it and half the
blocks, stage 1 the other half and the loss; without it (--input-dim 0) stage 0's first block
computes no input gradient, so its backward is an eighth lighter. Defaults (W 1024, 16 blocks,
64 rows per micro-batch: about 15 ms of forward and 31 ms of backward per stage and
micro-batch on this host's cores, against about 0.4 ms for one 256 KiB message) make a stage's
compute per micro-batch about a hundred times one message's latency, as the formula assumes
communication small; --small (W 512, 8 blocks, 16 rows: about 1 ms of forward) shows what
per-message costs do when they are not. A default run takes about 70 s.

The bubble is counted as the formula counts it: each stage's idle share of the pipeline's
step, from the step's first forward (stage 0, micro-batch 0) to its last backward (stage 0,
the last micro-batch), averaged over the stages. Stage 0 runs both, so the step is read off
its spans (the ranks' span records are each relative to their own step start); a later stage's
idle head and tail count too. Median over the steps after warm-up; each m is launched
--repeat times and the run with the median bubble is reported, with the range.

"simulated" is the simulator's prediction for the same runs: the 1F1B schedule of
``sims.planner.pipeline_tasks`` run by ``sims.executor`` with the runs' median forward and
backward times (one figure for both stages) and this host's calibrated pipeline send
(`flowtrain calibrate`; free sends when there is no profile), the bubble read off its timeline
the same way. "per-stage" replays the same schedule with each stage's own median forward and
backward and the same send, so per-stage minus formula is what unequal stages add (processes
sharing cores need not run the same shapes at the same speed).
"replay" replays it with each step's own forward and backward times (median over steps):
what the run would take if nothing but its compute, as it happened, and the wire counted; so
measured minus replay is what the engine adds, and replay minus per-stage what the jitter of
the passes adds (with equal stages, 1F1B on 2 stages has no slack: a slow pass on either stage
delays both). "profile" predicts the whole run from the calibrated profile alone
(``flowtrain simulate --compare``).

--bind launches with `flowtrain launch --bind-cores-to-rank`, each rank on its own core (torch
threads 1 either way), to tell jitter from inside the machine (ranks preempted or moved between
cores) from jitter under it (a VM's vCPUs sharing the physical host). The measured-minus-replay
part is the per-micro-batch Python around the passes on the critical path: handing a send to
the sender thread and the engine's bookkeeping around each pass, which run cold right after a
pass and so cost several times what they cost run twice in a row.

The breakdown shows where each stage's step went: compute, waiting in recv for the
neighbour's activations or gradients, handing sends to the sender thread, the gaps between
spans, and the head and tail outside its own window.

    python benchmarks/pipeline_bubble.py [--small] [--repeat 3] [--steps 12] [--width 1024]
        [--layers 16] [--micro 64] [--input-dim 64] [--micro-batches 4,8] [--bind] [--keep DIR]
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

m, steps, width, layers, micro, in_dim = (int(a) for a in sys.argv[1:7])
torch.set_num_threads(1)
flowtrain.init_distributed()
torch.manual_seed(0)
# an input projection (in_dim > 0) on the first stage balances the stages: without it the
# first stage's first layer computes no input gradient (one matmul of its backward's two)
blocks = [nn.Linear(in_dim, width)] if in_dim else []
for _ in range(layers):
    blocks += [nn.Linear(width, width), nn.GELU()]
module = PipelineModule(blocks, num_stages=2, loss_fn=nn.functional.mse_loss,
                        partition_method="uniform")
cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": m,
       "steps_per_print": 10**9, "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}
engine, *_ = flowtrain.initialize(model=module, config=cfg)
g = torch.Generator().manual_seed(1)
for step in range(steps):
    data = iter([(torch.randn(micro, in_dim or width, generator=g),
                  torch.randn(micro, width, generator=g)) for _ in range(m)])
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


def _step_bubble(stage_spans: list[list[tuple[str, float, float]]]) -> float:
    """One step's bubble as (p - 1) / (m + p - 1) counts it: each stage's idle share of the
    pipeline's step, from its first forward to its last backward, averaged over the stages.
    Stage 0 runs both (micro-batch 0's forward starts the step; the last micro-batch's
    backward on stage 0 ends it), so the step is read off stage 0's own spans: the ranks'
    span records are each relative to their own step start, so they are not compared. A later
    stage's own window leaves out its idle head (waiting for the first activations) and tail
    (the earlier stages' last backwards)."""
    window = _stage_bubble(stage_spans[0])["makespan"]
    busy = [_stage_bubble(spans)["busy"] for spans in stage_spans]
    return 1 - statistics.fmean(busy) / window


def measure(m: int, steps: int, width: int, layers: int, micro: int, in_dim: int,
            keep: Path | None, name: str, bind: bool = False) -> tuple[dict[str, Any], Path]:
    """Launches the 2-stage job and reads its run directory's spans."""
    from sims.compare import read_run

    tmp = tempfile.mkdtemp(prefix="pipeline_bubble_")
    script = Path(tmp) / "bubble_worker.py"
    script.write_text(WORKER)
    run_dir = (keep or Path(tmp)) / name
    cmd = [str(REPO / ".venv/bin/flowtrain"), "launch", "--nproc-per-node", "2",
           *(["--bind-cores-to-rank"] if bind else []), "--run-dir", str(run_dir), str(script),
           str(m), str(steps), str(width), str(layers), str(micro), str(in_dim)]
    subprocess.run(cmd, check=True, timeout=600, capture_output=True,
                   env={**os.environ, "FLOWTRAIN_CONSOLE_LEVEL": "ERROR"})
    run = read_run(run_dir)
    ranks = sorted(run.steps)  # one rank per stage, in stage order
    count = min(len(run.steps[r]) for r in ranks)
    bubbles = [_step_bubble([run.steps[r][i] for r in ranks]) for i in range(WARMUP, count)]
    # each step's own forward and backward times per stage, for the replay
    passes = [[{n: b - a for n, a, b in run.steps[r][i] if n.startswith(("forward/",
                                                                          "backward/"))}
               for r in ranks] for i in range(WARMUP, count)]
    stage_rows: list[dict[str, float]] = []
    fwd: list[float] = []
    bwd: list[float] = []
    for rank in ranks:
        rows = [_stage_bubble(spans) for spans in run.steps[rank][WARMUP:count]]
        stage_rows.append({k: statistics.median(r[k] for r in rows) for k in rows[0]})
        stage_fwd = [b - a for spans in run.steps[rank][WARMUP:count]
                     for n, a, b in spans if n.startswith("forward/")]
        stage_bwd = [b - a for spans in run.steps[rank][WARMUP:count]
                     for n, a, b in spans if n.startswith("backward/")]
        stage_rows[-1].update(forward_s=statistics.median(stage_fwd),
                             backward_s=statistics.median(stage_bwd))
        fwd += stage_fwd
        bwd += stage_bwd
    return {"bubble": statistics.median(bubbles), "stages": stage_rows, "passes": passes,
            "forward_s": statistics.median(fwd), "backward_s": statistics.median(bwd)}, run_dir


def simulated(m: int, fwd: float, bwd: float, send_s: float) -> float:
    """The simulator's bubble for 2 stages of m micro-batches with these pass and send times,
    read off its timeline as the measured one is."""
    from sims.executor import execute
    from sims.planner import pipeline_tasks

    timeline = execute(pipeline_tasks(2, m, fwd, bwd, send_s))
    return _step_bubble([[(t.name, a, b) for t, a, b in timeline.spans() if t.stage == stage]
                         for stage in range(2)])


def per_stage(m: int, times: list[tuple[float, float]], send_s: float) -> float:
    """The 1F1B schedule replayed with each stage's own (forward, backward) seconds."""
    return replay(m, [{f"{kind}/mb{k}": t for k in range(m)
                       for kind, t in (("forward", f), ("backward", b))} for f, b in times],
                  send_s)


def replay(m: int, times: list[dict[str, float]], send_s: float) -> float:
    """The 1F1B schedule (``flowtrain.pipe.schedule.stage_ops``) replayed with each stage's
    forward and backward seconds by task name, and ``send_s`` from a send to its receive;
    nothing else takes time. The bubble read off it as the measured one is."""
    from flowtrain.pipe.schedule import stage_ops

    stages = len(times)
    ops = [stage_ops("1f1b", s, stages, m) for s in range(stages)]
    pos, clock = [0] * stages, [0.0] * stages
    sent: dict[tuple[str, int], float] = {}
    spans: list[list[tuple[str, float, float]]] = [[] for _ in range(stages)]
    while any(pos[s] < len(ops[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while pos[s] < len(ops[s]):
                op = ops[s][pos[s]]
                if op.kind.startswith("recv_"):
                    src = s - 1 if op.kind == "recv_act" else s + 1
                    key = (op.kind.removeprefix("recv_"), src, op.mb)
                    if key not in sent:
                        break
                    clock[s] = max(clock[s], sent[key] + send_s)
                elif op.kind.startswith("send_"):
                    sent[(op.kind.removeprefix("send_"), s, op.mb)] = clock[s]
                else:
                    took = times[s][op.task_name]
                    spans[s].append((op.task_name, clock[s], clock[s] + took))
                    clock[s] += took
                pos[s] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"the 1F1B schedule deadlocks at m={m}")
    return _step_bubble(spans)


def profile_bubble(run_dir: Path, cluster: str) -> float | None:
    """The bubble of the whole run predicted from the calibrated profile (simulate --compare's
    plan of the run), read off the timeline the same way; None without a profile."""
    from flowtrain.config import load_config
    from sims.compare import read_run
    from sims.hardware import ProfileError, get_profile
    from sims.planner import Layout, Workload
    from sims.prediction import predict

    try:
        hw = get_profile(cluster)
    except ProfileError:
        return None
    run = read_run(run_dir)
    cfg = load_config(run.plan["config"], world_size=1, check_supported=False)
    work = Workload.from_stages(run.stages, cfg.train_micro_batch_size_per_gpu)
    prediction = predict(None, cfg, Layout(1, 2, 1, len(run.stages)), hw, cluster=cluster,
                         workload=work)
    return _step_bubble([[(t.name, a, b) for t, a, b in prediction.timeline.spans()
                          if t.stage == stage] for stage in range(len(run.stages))])


def send_seconds(cluster: str, nbytes: float) -> float:
    """This host's calibrated pipeline send of ``nbytes`` (0 without a profile)."""
    from sims.costs import p2p_seconds
    from sims.hardware import ProfileError, get_profile

    try:
        return p2p_seconds(nbytes, get_profile(cluster), inter_node=False)
    except ProfileError:
        return 0.0


def _probe_rank(rank: int, port: int, nbytes: int, count: int, out: Any) -> None:
    """One of two processes: one-way time of a pipeline message (an int64 header and the
    float32 tensor) by ping-pong: through the pipeline engine's streams (its sender and
    receiver threads, every receive queued ahead as a schedule does), waited on blocking one
    after the other (what `flowtrain calibrate` times), and through ``flowtrain.comm.wait``
    inside an event loop (the engine's path before: a thread started per wait)."""
    import asyncio
    import time

    import torch
    import torch.distributed as dist

    from flowtrain import comm
    from flowtrain.pipe import p2p

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    peer = 1 - rank
    header, tensor = torch.zeros(64, dtype=torch.int64), torch.zeros(nbytes // 4)

    def streams() -> float:
        out_tags, in_tags = ((p2p.TAG_ACT, p2p.TAG_ACT_DATA), (p2p.TAG_GRAD, p2p.TAG_GRAD_DATA))[
            ::1 if rank == 0 else -1]
        sender = p2p.Sender(None, torch.device("cpu"), 60.0, "probe-send")
        receiver = p2p.Receiver(None, peer, in_tags, torch.device("cpu"), 60.0, "probe-recv")
        futures = [receiver.expect(1, k, "probe") for k in range(count + 1)]
        start = 0.0
        for k in range(count + 1):
            if k == 1:
                start = time.perf_counter()
            if rank == 0:
                sender.send((tensor,), peer, out_tags, k, "probe")
                futures[k].result(timeout=60)
            else:
                futures[k].result(timeout=60)
                sender.send((tensor,), peer, out_tags, k, "probe")
        elapsed = time.perf_counter() - start
        sender.drain().result(timeout=60)
        receiver.close()
        sender.close()
        return elapsed / count / 2

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

    one_way_streams = streams()
    dist.barrier()
    blocking()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(count):
        blocking()
    one_way_blocking = (time.perf_counter() - start) / count / 2
    dist.barrier()
    one_way_loop = asyncio.run(timed_loop())
    if rank == 0:
        out.put((one_way_streams, one_way_blocking, one_way_loop))
    dist.barrier()
    dist.destroy_process_group()


def delivery_probe(nbytes: int, count: int = 200) -> tuple[float, float, float]:
    """(the engine's streams, blocking, through flowtrain.comm.wait) one-way seconds of one
    pipeline message of ``nbytes`` between two processes of this host."""
    import multiprocessing as mp

    from sims.calibrate.collectives import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
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
    ap.add_argument("--width", type=int, default=None, help="default 1024 (512 with --small)")
    ap.add_argument("--layers", type=int, default=None,
                    help="Linear+GELU blocks, half per stage; default 16 (8 with --small)")
    ap.add_argument("--micro", type=int, default=None,
                    help="rows per micro-batch; default 64 (16 with --small)")
    ap.add_argument("--input-dim", type=int, default=64,
                    help="width of the first stage's input projection; 0: none (the first "
                         "stage then computes no input gradient for its first layer)")
    ap.add_argument("--small", action="store_true",
                    help="the small model: width 512, micro-batch 16, 8 blocks (about 1 ms "
                         "of forward per stage, where each message's costs show)")
    ap.add_argument("--micro-batches", default="4,8", help="m values, comma-separated")
    ap.add_argument("--repeat", type=int, default=3,
                    help="launches per m; the run with the median bubble is reported")
    ap.add_argument("--cluster", default="this-host", help="profile for the send cost")
    ap.add_argument("--bind", action="store_true",
                    help="launch with --bind-cores-to-rank: each rank pinned to its own share "
                         "of the cores; default: the ranks share every core")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    args = ap.parse_args()
    args.width = args.width or (512 if args.small else 1024)
    args.micro = args.micro or (16 if args.small else 64)
    args.layers = args.layers or (8 if args.small else 16)
    load = os.getloadavg()
    sent = args.micro * args.width * 4
    send_s = send_seconds(args.cluster, sent)
    proj = f"Linear({args.input_dim}, {args.width}) + " if args.input_dim else ""
    print(f"2 stages, {proj}{args.layers} x Linear({args.width})+GELU, micro-batch "
          f"{args.micro} rows ({sent / 1024:.0f} KiB sent per micro-batch, calibrated send "
          f"{send_s * 1e6:.0f} us), 1F1B, {args.steps} steps ({WARMUP} warm-up), "
          f"{args.repeat} launches per m, "
          f"{'each rank bound to its own cores' if args.bind else 'ranks not bound to cores'}; "
          f"load average {load[0]:.2f}")
    print(f"{'m':>3} {'measured':>9} {'(range)':>13} {'formula':>8} {'meas/form':>9} "
          f"{'simulated':>9} {'per-stage':>9} {'replay':>7} {'profile':>8}   per micro-batch: "
          f"forward, backward (stage 0 | stage 1)")
    details = []
    for m in (int(v) for v in args.micro_batches.split(",")):
        runs = [measure(m, args.steps, args.width, args.layers, args.micro, args.input_dim,
                        args.keep, f"m{m}" if args.repeat == 1 else f"m{m}-{i}", args.bind)
                for i in range(args.repeat)]
        runs.sort(key=lambda r: r[0]["bubble"])
        got, run_dir = runs[len(runs) // 2]
        bubble = got["bubble"]
        low, high = runs[0][0]["bubble"], runs[-1][0]["bubble"]
        formula = (2 - 1) / (m + 2 - 1)
        sim = simulated(m, got["forward_s"], got["backward_s"], send_s)
        stages = per_stage(m, [(s["forward_s"], s["backward_s"]) for s in got["stages"]],
                           send_s)
        replayed = statistics.median(replay(m, step, send_s) for step in got["passes"])
        whole = profile_bubble(run_dir, args.cluster)
        passes = " | ".join(f"{s['forward_s'] * 1e3:.2f}, {s['backward_s'] * 1e3:.2f}"
                            for s in got["stages"])
        print(f"{m:>3} {bubble:>9.3f} {f'({low:.3f}-{high:.3f})':>13} {formula:>8.3f} "
              f"{bubble / formula:>9.2f} {sim:>9.3f} {stages:>9.3f} {replayed:>7.3f} "
              f"{'-' if whole is None else f'{whole:.3f}':>8}   {passes} ms", flush=True)
        details.append((m, got))
    print("where each stage's step went (the reported run's median step, ms): its own window "
          "(first forward to last backward) = compute + recv wait + send hand-over + gaps "
          "(between spans, per op); outside it, the head and tail it waits while the other "
          "stage fills and drains")
    for m, got in details:
        step = got["stages"][0]["makespan"]
        for stage, s in enumerate(got["stages"]):
            print(f"  m={m} stage {stage}: {s['makespan'] * 1e3:6.2f} = compute "
                  f"{s['busy'] * 1e3:6.2f} + recv wait {s['recv'] * 1e3:6.2f} + send "
                  f"{s['send'] * 1e3:5.2f} + gaps {s['gaps'] * 1e3:5.2f} "
                  f"({s['gaps'] / max(s['ops'], 1) * 1e6:.0f} us x {s['ops']:.0f} ops); "
                  f"outside {max(step - s['makespan'], 0.0) * 1e3:5.2f}")
    streams, blocking, looped = delivery_probe(sent)
    print(f"one pipeline message ({sent / 1024:.0f} KiB: header + tensor) one way between two "
          f"idle processes: {streams * 1e6:.0f} us through the engine's sender and receiver "
          f"threads, {blocking * 1e6:.0f} us waited on blocking one after the other (what "
          f"calibration times), {looped * 1e6:.0f} us through flowtrain.comm.wait in an event "
          f"loop (the engine's path before: a thread started per wait)")
    print(json.dumps({"load_average_end": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
