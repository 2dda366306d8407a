"""The published runs `flowtrain simulate` is judged against, and their split into a development
part and a frozen held-out part (``published_split.json``): which part a run is in, and the
checks that keep the split and the runs' inputs as they were frozen."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

RUNS = Path(__file__).with_name("published_runs.json")
SPLIT = Path(__file__).with_name("published_split.json")
SALT = "flowtrain-published-split:"
# what a run's prediction is made from; anything else (citation, derivation, assumptions) may
# be corrected freely
INPUT_FIELDS = ("hardware", "model", "parallel", "batch", "training", "step_time_s")
PARTS = ("held-out", "development")


def load_runs(path: Path = RUNS) -> list[dict[str, Any]]:
    return list(json.loads(path.read_text())["runs"])


def load_split(path: Path = SPLIT) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def held_out_sources(split: Mapping[str, Any]) -> set[str]:
    """Every held-out source, those joining one included."""
    known = {s for batch in split["batches"] for s in [*batch["sources"], *batch.get("joins", {})]}
    return {s for s in known if part_of(s, split) == PARTS[0]}


def part_of(source: str, split: Mapping[str, Any]) -> str:
    """"held-out" or "development"; a source no batch has split yet is an error, so that no run
    is scored before its part is decided. A source that joins an earlier one (another release
    of the same table) takes that one's part."""
    for batch in split["batches"]:
        joined = batch.get("joins", {}).get(source)
        if joined is not None:
            return part_of(joined, split)
        if source in batch["sources"]:
            return PARTS[0] if source in batch["held_out"] else PARTS[1]
    raise KeyError(f"source {source!r} is in no batch of {SPLIT.name}; split its batch with "
                   f"split_batch() before scoring any of its runs")


def split_batch(sources: Sequence[str]) -> list[str]:
    """The held-out sources of a new batch by the split's rule: sorted by their salted sha256,
    the first third (rounded up)."""
    order = sorted(set(sources), key=lambda s: hashlib.sha256((SALT + s).encode()).hexdigest())
    return sorted(order[:math.ceil(len(order) / 3)])


def fingerprint(run: Mapping[str, Any]) -> str:
    """The run's inputs (``INPUT_FIELDS``) as 16 hex digits of the sha256 of their canonical
    JSON."""
    inputs = {f: run[f] for f in INPUT_FIELDS}
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def split_problems(runs: Sequence[Mapping[str, Any]], split: Mapping[str, Any]) -> list[str]:
    """Everything that breaks the split's rules, one line each (none: the split holds):
    a batch not split by the rule, a source in two batches or in none, a run without a
    fingerprint, and a run whose inputs changed since its freeze without a quoted reason."""
    problems = []
    seen: set[str] = set()
    for i, batch in enumerate(split["batches"]):
        sources = list(batch["sources"])
        joins = dict(batch.get("joins", {}))
        again = seen & (set(sources) | set(joins))
        if again:
            problems.append(f"batch {i}: sources {sorted(again)} are in an earlier batch")
        for new, old in joins.items():
            if old not in seen:
                problems.append(f"batch {i}: {new!r} joins {old!r}, which no earlier batch has")
        seen |= set(sources) | set(joins)
        if sorted(batch["held_out"]) != split_batch(sources):
            problems.append(f"batch {i}: held out {sorted(batch['held_out'])}, the rule gives "
                            f"{split_batch(sources)}")
    prints = split["fingerprints"]
    for run in runs:
        rid = run["id"]
        if run["source"] not in seen:
            problems.append(f"run {rid}: source {run['source']!r} is in no batch")
        if rid not in prints:
            problems.append(f"run {rid}: no fingerprint of its inputs at freeze")
        elif prints[rid] != fingerprint(run):
            problems += [f"run {rid}: {p}" for p in change_problems(run)]
    return problems


def change_problems(run: Mapping[str, Any]) -> list[str]:
    """Why a run whose inputs differ from its freeze breaks the input rule: no logged change,
    a change without a quote from the source, or a logged value that is not the run's now."""
    changes = run.get("input_changes") or []
    if not changes:
        return ["inputs changed since the freeze, and input_changes logs no change"]
    out = []
    last: dict[str, tuple[int, Any]] = {}  # each field's latest logged value
    for j, change in enumerate(changes):
        for key in ("date", "field", "from", "to", "quote", "why"):
            if key not in change or change[key] in ("", None) and key != "from":
                out.append(f"input_changes[{j}] has no {key!r}")
        if "field" in change and "to" in change:
            last[str(change["field"])] = (j, change["to"])
    for field, (j, value) in last.items():
        if _at(run, field) != value:
            out.append(f"input_changes[{j}]: {field} is {_at(run, field)!r}, the log says "
                       f"{value!r}")
    return out


def _at(run: Mapping[str, Any], dotted: str) -> Any:
    value: Any = run
    for part in str(dotted).split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value
