"""`flowtrain tune --verify 3` against an exhaustive run of its short list, on this host's ranks.

For each model (the demo GPT and a wider one), the simulator searches the space (ZeRO stage,
micro-batch with the accumulation that keeps the global batch, bucket and ZeRO-3 prefetch
sizes: 50 or more configurations), ``verify`` runs the top 3 as real trials and picks by
measurement, and the largest micro-batch is confirmed by a trial. Then every configuration of
the short list (the top ``--short-list`` predicted that the simulator tells apart) runs as a
trial, alternating over
``--rounds`` rounds, and the pick's measured step is set against the best one's: the gap, and
the trials each way. DeepSpeed's autotuner on the same space (its fast mode, the default) runs
a model-info profile and then, for each of the 4 ZeRO stages, a search for the largest
micro-batch and ``num_tuning_micro_batch_sizes`` (3) micro-batch trials: at least
1 + 4 x (1 + 3) = 17 experiments (deepspeed/autotuning/constants.py defaults; more when its
largest-micro-batch search takes more than one run).

    .venv/bin/python benchmarks/tune_vs_exhaustive.py                  # both models
    .venv/bin/python benchmarks/tune_vs_exhaustive.py --short-list 6 --rounds 3

Needs this host's profile (`flowtrain calibrate --quick`, as `make demo` runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "examples"),
                                            os.environ.get("PYTHONPATH", "")])

from sims import tune, tune_trials  # noqa: E402

MODELS = {"demo": ("gpt:build_demo_model", 64), "wider": ("gpt:build_wider_model", 128)}
# DeepSpeed's autotuner, fast mode, on the same ZeRO stages: its model-info profile run, then
# per stage at least one run of its largest-micro-batch search and 3 micro-batch trials
DEEPSPEED_AUTOTUNER_MIN = 1 + 4 * (1 + 3)


def one_model(name: str, factory: str, seq_len: int, cluster: str, short_list: int,
              rounds: int, steps: int) -> dict[str, Any]:
    config = json.loads((REPO / "examples" / "ds_config_gpt.json").read_text())
    result = tune.search(factory, config, cluster=cluster, seq_len=seq_len)
    searched = len(result.ranked) + len(result.dropped)
    tune_trials.verify(result, 3, seq_len=seq_len, steps=steps)
    largest = tune_trials.confirm_largest_micro_batch(result, seq_len=seq_len)
    pick = result.best
    listed = tune_trials.distinct(result.ranked, short_list)
    if pick not in listed:
        listed.append(pick)
    times: dict[int, list[float]] = {i: [] for i in range(len(listed))}
    for _ in range(rounds):  # alternate: each round runs every configuration once
        for i, point in enumerate(listed):
            out = tune_trials.run_trial(result, point.candidate, seq_len=seq_len, steps=steps)
            if out.get("step_s"):
                times[i].append(out["step_s"])
    medians = {i: statistics.median(t) for i, t in times.items() if t}
    best = min(medians, key=lambda i: medians[i])
    picked = listed.index(pick)
    return {"model": name, "searched": searched, "fits": len(result.ranked),
            "tune_trials": 3 + len(largest["trials"]), "verify_trials": 3,
            "exhaustive_trials": rounds * len(listed), "pick": pick.candidate.label(),
            "best": listed[best].candidate.label(),
            "pick_s": medians.get(picked), "best_s": medians[best],
            "ranges": {listed[i].candidate.label(): [min(t), max(t)] for i, t in times.items()
                       if t},
            "gap": (medians[picked] / medians[best] - 1) if picked in medians else None,
            "scale": result.scale, "largest_micro_batch": largest}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="demo,wider", help="comma list of: demo, wider")
    ap.add_argument("--cluster", default="this-host", help="the profile the search predicts on")
    ap.add_argument("--short-list", type=int, default=8,
                    help="configurations the exhaustive run measures (top predicted)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of it")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per trial")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    rows = []
    for name in args.models.split(","):
        factory, seq_len = MODELS[name]
        rows.append(one_model(name, factory, seq_len, args.cluster, args.short_list,
                              args.rounds, args.steps))
    for r in rows:
        gap = f"{100 * r['gap']:+.1f} %" if r["gap"] is not None else "pick did not run"
        print(f"{r['model']}: searched {r['searched']} ({r['fits']} fit); tune spent "
              f"{r['verify_trials']} trials + {r['tune_trials'] - r['verify_trials']} to confirm "
              f"the largest micro-batch; exhaustive short list {r['exhaustive_trials']} trials; "
              f"DeepSpeed autotuner >= {DEEPSPEED_AUTOTUNER_MIN}")
        pick_s = f"{r['pick_s']:.4f} s" if r["pick_s"] is not None else "-"
        scale = f"{r['scale']:.2f}" if r["scale"] is not None else "-"
        print(f"  pick:  {r['pick']}  {pick_s}")
        print(f"  best:  {r['best']}  {r['best_s']:.4f} s")
        print(f"  gap {gap} (target within 5 %); measured/predicted {scale}; "
              f"largest micro-batch {r['largest_micro_batch']['confirmed']} (predicted "
              f"{r['largest_micro_batch']['predicted']})")
        for label, (lo, hi) in r["ranges"].items():
            print(f"    {label}: {lo:.4f}-{hi:.4f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
