"""How long `flowtrain simulate` takes on a big 3D-parallel step: llama2-70b (80 layers) on
128 nodes x 8 H100 (1,024 ranks: tp 8, pp 8, dp 16), ZeRO stage 1, 32 micro-batches; and the
largest step users plan, Megatron-LM's 1T-parameter GPT on 3,072 A100s (tp 8, pp 64 with 2
model chunks per stage, dp 6, 512 micro-batches: 395k tasks, and the executor's 260k
interference tasks of its collectives), predicted end to end as `flowtrain simulate` does it
(``predict``: the step, its figures, and the range from the optimistic and pessimistic ends of
the GPU figures, which prices the laid-out step twice more).

One representative rank per pipeline stage is simulated, so the cost follows the task count
(stages x micro-batches x layers), not the rank count; the 8-rank line (tp 8, pp 1 on one node,
same model and micro-batches) shows that. Targets: at most 2 s for the 1,024-rank step, 5 s for
the 1T prediction. The first simulation of a process also loads the executor's compiled loops
(numba's cache beside sims/schedule_kernels.py; they are compiled on the first run after an
install or an edit of that file, which then takes some seconds more).

    .venv/bin/python benchmarks/sim_speed.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from flowtrain.config import load_config
from sims.executor import execute, step_figures
from sims.hardware import get_profile
from sims.models import get_model
from sims.planner import Layout, Workload, build_plan

TARGET_S = 2.0
BIG_TARGET_S = 5.0
BIG_RUN = "megatron21-t1-1008b"  # benchmarks/published_runs.json


def simulate_once(layout: Layout, micro_batches: int) -> tuple[float, float, int, float]:
    """(plan seconds, execute+figures seconds, tasks, predicted step seconds)."""
    hw = get_profile("h100-x8")
    model = get_model("llama2-70b")
    cfg = load_config({"train_micro_batch_size_per_gpu": 1,
                       "gradient_accumulation_steps": micro_batches,
                       "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}},
                      world_size=layout.dp, check_supported=False)
    t0 = time.perf_counter()
    plan = build_plan(Workload.from_model(model, cfg.precision), cfg, layout, hw)
    t1 = time.perf_counter()
    figures = step_figures(execute(plan.tasks, interference=plan.interference))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, len(plan.tasks), figures.step_time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per layout; best is shown")
    parser.add_argument("--micro-batches", type=int, default=32)
    args = parser.parse_args()
    cases = [("1,024 ranks: 128 nodes x 8, tp 8, pp 8, dp 16", Layout(128, 8, tp=8, pp=8)),
             ("8 ranks: 1 node x 8, tp 8, pp 1", Layout(1, 8, tp=8, pp=1))]
    print(f"llama2-70b, ZeRO 1, bf16, micro-batch 1 x {args.micro_batches}, h100-x8; "
          f"best of {args.repeat}")
    results = {}
    for label, layout in cases:
        runs = [simulate_once(layout, args.micro_batches) for _ in range(args.repeat)]
        plan_s, exec_s, tasks, step = min(runs, key=lambda r: r[0] + r[1])
        results[label] = plan_s + exec_s
        print(f"  {label:<48} {tasks:>7,} tasks  plan {plan_s:6.3f} s  execute {exec_s:6.3f} s"
              f"  total {plan_s + exec_s:6.3f} s  (predicted step {step:.3f} s)")
    big = results[cases[0][0]]
    print(f"1,024-rank step simulated in {big:.3f} s (target <= {TARGET_S:.1f} s): "
          f"{'ok' if big <= TARGET_S else 'SLOWER THAN TARGET'}")
    first, best, prediction = predict_big(args.repeat)
    low, high = prediction.step_time_range_s or (prediction.step_time_s,) * 2
    print(f"1T GPT, tp 8, pp 64 (2 chunks), dp 6, 512 micro-batches ({BIG_RUN}): "
          f"{prediction.tasks:,} tasks, predicted step {prediction.step_time_s:.2f} s "
          f"({low:.2f}-{high:.2f} s)")
    print(f"  first of {args.repeat}: {first:.3f} s, best: {best:.3f} s")
    print(f"1T prediction in {best:.3f} s (target <= {BIG_TARGET_S:.1f} s): "
          f"{'ok' if best <= BIG_TARGET_S else 'SLOWER THAN TARGET'}")
    return 0


def predict_big(repeat: int) -> tuple[float, float, Any]:
    """(seconds of the first prediction, best seconds, the prediction) of ``BIG_RUN`` through
    ``predict``, as benchmarks/sim_published.py makes it."""
    import sim_published

    run = next(r for r in sim_published.load_runs() if r["id"] == BIG_RUN)
    times = []
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        prediction = sim_published.simulate(run)
        times.append(time.perf_counter() - t0)
    return times[0], min(times), prediction


if __name__ == "__main__":
    raise SystemExit(main())
