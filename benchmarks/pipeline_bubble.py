"""Measured pipeline bubble on this machine against (p - 1) / (m + p - 1) and the simulator.

Two ranks (p = 2 stages) train a stack of equal Linear+GELU layers with 1F1B for m = 4 and 8
micro-batches. From each stage's recorded spans: busy = forward + backward time, makespan =
first forward start to last backward end; bubble = 1 - busy / makespan (averaged over stages
and steps after warm-up). The simulator's prediction uses the same measured per-micro-batch
forward/backward times with free communication (the formula) and with this host's gloo
point-to-point cost when a calibrated profile exists.

    python benchmarks/pipeline_bubble.py [--steps 12] [--width 512] [--layers 8]
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

REPO = Path(__file__).resolve().parents[1]
WORKER = r'''
import json, os, sys, time, torch
from torch import nn
import flowtrain
from flowtrain.pipe import PipelineModule

m, steps, width, layers, out = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                int(sys.argv[4]), sys.argv[5])
torch.set_num_threads(1)
flowtrain.init_distributed()
torch.manual_seed(0)
blocks = []
for _ in range(layers):
    blocks += [nn.Linear(width, width), nn.GELU()]
module = PipelineModule(blocks, num_stages=2, loss_fn=nn.functional.mse_loss,
                        partition_method="uniform")
cfg = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": m,
       "steps_per_print": 10**9, "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}
engine, *_ = flowtrain.initialize(model=module, config=cfg)
g = torch.Generator().manual_seed(1)
rows = []
for step in range(steps):
    data = iter([(torch.randn(16, width, generator=g), torch.randn(16, width, generator=g))
                 for _ in range(m)])
    engine.train_batch(data)
    start, spans = engine.timer.last_step
    rows.append([(n, a - start, b - start) for n, a, b in spans])
json.dump({"stage": module.stage_id, "steps": rows}, open(f"{out}.{module.stage_id}.json", "w"))
engine.destroy()
'''


def measure(m: int, steps: int, width: int, layers: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "bubble_worker.py"
        script.write_text(WORKER)
        out = Path(tmp) / "out"
        cmd = [str(REPO / ".venv/bin/flowtrain"), "launch", "--nproc-per-node", "2",
               "--run-dir", str(Path(tmp) / "run"), str(script), str(m), str(steps),
               str(width), str(layers), str(out)]
        subprocess.run(cmd, check=True, timeout=600, capture_output=True,
                       env={**os.environ, "FLOWTRAIN_CONSOLE_LEVEL": "ERROR"})
        stages = [json.loads(Path(f"{out}.{s}.json").read_text()) for s in (0, 1)]
    bubbles, fwd, bwd = [], [], []
    for step in range(2, steps):  # after warm-up
        for stage in stages:
            spans = stage["steps"][step]
            compute = [(a, b) for n, a, b in spans if n.startswith(("forward/", "backward/"))]
            busy = sum(b - a for a, b in compute)
            makespan = max(b for _, b in compute) - min(a for a, _ in compute)
            bubbles.append(1 - busy / makespan)
            fwd += [b - a for n, a, b in spans if n.startswith("forward/")]
            bwd += [b - a for n, a, b in spans if n.startswith("backward/")]
    return {"bubble": statistics.median(bubbles), "forward_s": statistics.median(fwd),
            "backward_s": statistics.median(bwd)}


def predicted(m: int, fwd: float, bwd: float) -> float:
    """The simulator's executor on the same schedule (free communication), when available."""
    try:
        from tests.test_pipeline import _simulate  # the schedule walker used by the tests
    except ImportError:
        sys.path.insert(0, str(REPO))
        from tests.test_pipeline import _simulate
    step = _simulate("1f1b", 2, m, fwd, bwd)
    return 1 - m * (fwd + bwd) / step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    print(f"{'m':>3} {'measured':>9} {'formula':>8} {'predicted':>9} {'meas/formula':>12}")
    for m in (4, 8):
        got = measure(m, args.steps, args.width, args.layers)
        formula = (2 - 1) / (m + 2 - 1)
        pred = predicted(m, got["forward_s"], got["backward_s"])
        print(f"{m:>3} {got['bubble']:>9.3f} {formula:>8.3f} {pred:>9.3f} "
              f"{got['bubble'] / formula:>12.2f}   (forward {got['forward_s'] * 1e3:.2f} ms, "
              f"backward {got['backward_s'] * 1e3:.2f} ms per micro-batch)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
