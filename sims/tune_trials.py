"""``flowtrain tune --verify``: the top configurations of a search run as short real jobs on this
host's ranks (``flowtrain launch -m sims.tune_job``), measured, and the pick made by
measurement; and the largest micro-batch that fits confirmed by a trial that does not run out
of memory, backing off (halving) while one does."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from sims.tune import Candidate, Point, TuneError, TuneResult, largest_micro_batch


def _check_runnable(result: TuneResult) -> None:
    if ":" not in result.model:
        raise TuneError(f"--verify runs real trials, which need the model built: give a factory "
                        f"(--model pkg.module:function), not the preset {result.model!r}")
    if result.nodes != 1:
        raise TuneError(f"--verify launches its trials on this host; plan {result.nodes} nodes "
                        f"without it, or tune for one node")


# seconds of timed steps a trial gathers at least (steps of a few tens of ms vary by 10 % and
# more from one to the next on a shared host; their median over 2 s does not)
MIN_SECONDS = 2.0


def run_trial(result: TuneResult, candidate: Candidate, *, seq_len: int, steps: int = 4,
              warmup: int = 2, memory_limit: float = 0.0, timeout_s: float = 600.0,
              min_seconds: float = MIN_SECONDS) -> dict[str, Any]:
    """One launch of ``candidate`` on this host's ``result.devices_per_node`` ranks: the
    median step it measured (rank 0's; at least ``steps`` steps and ``min_seconds`` of them),
    whether any rank ran out of memory, and the error line of a trial that failed
    otherwise."""
    with tempfile.TemporaryDirectory(prefix="flowtrain-tune-") as tmp:
        cfg = Path(tmp) / "ds_config.json"
        cfg.write_text(json.dumps(candidate.ds_config(result.base_config)))
        out = Path(tmp) / "out"
        cmd = [sys.executable, "-m", "flowtrain.cli", "launch", "--nproc-per-node",
               str(result.devices_per_node), "--run-dir", str(Path(tmp) / "run"), "-m",
               "sims.tune_job", "--model", result.model, "--config", str(cfg), "--seq-len",
               str(seq_len), "--steps", str(steps), "--warmup", str(warmup),
               "--min-seconds", str(min_seconds), "--memory-limit", str(int(memory_limit)),
               "--out", str(out)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                                  check=False)
        except subprocess.TimeoutExpired:
            return {"oom": False, "error": f"did not finish within {timeout_s:g} s"}
        records = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))] \
            if out.is_dir() else []
        oom = any(r.get("oom") for r in records)
        if proc.returncode != 0 and not oom:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return {"oom": False, "error": f"exit {proc.returncode}: {last}"}
        rank0 = next((r for r in records if r.get("rank") == 0), None)
        steps_s = rank0.get("step_s", []) if rank0 else []
        return {"oom": oom, "step_s": statistics.median(steps_s) if steps_s and not oom
                else None, "used_bytes": max((r.get("used_bytes", 0) for r in records),
                                             default=0)}


def verify(result: TuneResult, k: int = 3, *, seq_len: int, steps: int = 4, warmup: int = 2,
           memory_limit: float = 0.0, timeout_s: float = 600.0) -> TuneResult:
    """Runs the ``k`` best-predicted points the simulator tells apart as trials, records what
    each measured, sets ``result.scale`` (the trials' median measured / predicted step: how far
    this host and run are from the profile now) and ``result.chosen``: the fastest by
    ``estimate`` (the best predicted when no trial ran to the end)."""
    _check_runnable(result)
    if k < 1:
        raise TuneError(f"--verify needs at least 1 trial, got {k}")
    ratios = []
    tried = distinct(result.ranked, k)
    for point in tried:
        trial = run_trial(result, point.candidate, seq_len=seq_len, steps=steps, warmup=warmup,
                          memory_limit=memory_limit, timeout_s=timeout_s)
        if trial.get("oom"):
            point.trial_error = "ran out of memory"
        elif trial.get("error"):
            point.trial_error = trial["error"]
        else:
            point.measured_step_s = trial["step_s"]
            if point.predicted_step_s:
                ratios.append(trial["step_s"] / point.predicted_step_s)
    measured = [p for p in tried if p.measured_step_s is not None]
    if ratios:
        result.scale = statistics.median(ratios)
    if measured:
        result.chosen = min(measured, key=lambda p: estimate(p, result.scale))
    else:
        result.notes.append("no trial ran to the end; the pick is the best predicted")
    return result


def estimate(point: Point, scale: float | None) -> float:
    """A tried point's step: the geometric mean of what its trial measured and its prediction
    refitted by the trials' scale. One short trial on a shared host is one sample, which can
    stray by as much as the model's error between close candidates; the refitted model is what
    every trial taught together, so each counts as much as the other."""
    measured = point.measured_step_s or 0.0
    predicted = point.predicted_step_s
    if not scale or not predicted:
        return measured
    return (measured * predicted * scale) ** 0.5


def distinct(points: list[Point], k: int) -> list[Point]:
    """The first ``k`` of ``points`` whose predictions differ: two configurations the
    simulator predicts alike to the last bit (a bucket larger than the whole model, say) run
    the same step, so a trial of one stands for both."""
    out: list[Point] = []
    seen: set[tuple[float, float]] = set()
    for p in points:
        key = (p.predicted_step_s or 0.0, p.memory_bytes or 0.0)
        if key in seen:
            continue
        seen.add(key)
        out.append(p)
        if len(out) == k:
            break
    return out


def confirm_largest_micro_batch(result: TuneResult, *, seq_len: int, memory_limit: float = 0.0,
                                timeout_s: float = 600.0, framework: str = "flowtrain"
                                ) -> dict[str, Any]:
    """The largest micro-batch the simulator predicts to fit the chosen configuration, then a
    trial of it, halving while a trial runs out of memory: {"predicted", "confirmed",
    "trials": [[micro_batch, "fits" | "out of memory" | error]]}."""
    _check_runnable(result)
    predicted = largest_micro_batch(result, seq_len=seq_len, framework=framework)
    c = result.best.candidate
    tried: list[list[Any]] = []
    mb, confirmed = predicted, 0
    while mb >= 1:
        out = run_trial(result, c.alone(mb), seq_len=seq_len, steps=1, warmup=1,
                        memory_limit=memory_limit, timeout_s=timeout_s, min_seconds=0.0)
        if out.get("oom"):
            tried.append([mb, "out of memory"])
            mb //= 2
            continue
        if out.get("error"):
            tried.append([mb, out["error"]])
            break
        tried.append([mb, "fits"])
        confirmed = mb
        break
    found = {"predicted": predicted, "confirmed": confirmed, "trials": tried}
    result.largest_micro_batch = found
    return found
