"""``flowtrain simulate --sweep``: sweep flags checked against the config schema, and every
combination of their values predicted, ranked by throughput."""

from __future__ import annotations

import argparse
import copy
import difflib
import itertools
import json
import sys
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sims.prediction import Prediction, SimulateError, predict_config

if TYPE_CHECKING:
    from sims.hardware import HardwareProfile
    from sims.models import ModelSpec

# Sweepable besides config keys: the cluster layout.
LAYOUT_KEYS = ("nodes", "tp", "pp")
_PROGRESS_FROM = 4  # sweeps of at least this many runs show progress (on a terminal)


def _annotation_parts(annotation: Any) -> list[Any]:
    args = typing.get_args(annotation)
    if not args:
        return [annotation]
    return [part for a in args for part in _annotation_parts(a)] + [annotation]


def config_keys() -> tuple[set[str], set[str]]:
    """Dotted keys of the config schema: (leaf keys, prefixes that take any sub-key: dict-valued
    params and sections that allow extra keys)."""
    from pydantic import BaseModel

    from flowtrain.config import FlowtrainConfig

    leaves: set[str] = set()
    open_prefixes: set[str] = set()

    def walk(model: type[BaseModel], prefix: str) -> None:
        if model.model_config.get("extra") == "allow" and prefix:
            open_prefixes.add(prefix.rstrip("."))
        for name, info in model.model_fields.items():
            path = prefix + name
            parts = _annotation_parts(info.annotation)
            sections = [a for a in parts if isinstance(a, type) and issubclass(a, BaseModel)]
            if sections:
                walk(sections[0], path + ".")
                continue
            leaves.add(path)
            if any(a is dict or typing.get_origin(a) is dict for a in parts):
                open_prefixes.add(path)

    walk(FlowtrainConfig, "")
    return leaves, open_prefixes


def parse_sweeps(specs: Sequence[str]) -> list[tuple[str, list[Any]]]:
    """``key=v1,v2`` flags as (key, values); keys checked against the config schema, values
    read as JSON scalars (a bare word is a string)."""
    if not specs:
        return []
    leaves, open_prefixes = config_keys()
    known = sorted(leaves | set(LAYOUT_KEYS))
    out: list[tuple[str, list[Any]]] = []
    for spec in specs:
        key, sep, values_text = spec.partition("=")
        key = key.strip()
        if not sep or not key or not values_text.strip():
            raise SimulateError(f"--sweep {spec!r}: expected KEY=V1,V2,... such as "
                                f"zero_optimization.stage=1,2,3")
        if key not in leaves and key not in LAYOUT_KEYS and \
                not any(key.startswith(p + ".") for p in open_prefixes):
            close = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else \
                f"; keys are dotted config paths such as zero_optimization.stage, or " \
                f"{', '.join(LAYOUT_KEYS)}"
            raise SimulateError(f"--sweep: unknown key {key!r}{hint}")
        if any(k == key for k, _ in out):
            raise SimulateError(f"--sweep: key {key!r} is given twice; list all its values in "
                                f"one --sweep")
        values = [_scalar(key, v.strip()) for v in values_text.split(",")]
        if key in LAYOUT_KEYS and not all(isinstance(v, int) and not isinstance(v, bool)
                                          and v > 0 for v in values):
            raise SimulateError(f"--sweep {key}: values must be integers > 0, got "
                                f"{values_text!r}")
        out.append((key, values))
    return out


def _scalar(key: str, text: str) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    if isinstance(value, (list, dict)):
        raise SimulateError(f"--sweep {key}: values must be JSON scalars (number, true/false, "
                            f"null or a word), got {text!r}")
    return value


def _with_value(raw: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value
    return out


class _Progress:
    """A progress bar on stderr for long sweeps (rich when installed, else a counter); silent
    when stderr is not a terminal."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self._rich: Any = None
        self._task: Any = None
        self.active = total >= _PROGRESS_FROM and sys.stderr.isatty()
        if not self.active:
            return
        try:
            from rich.console import Console
            from rich.progress import Progress

            self._rich = Progress(console=Console(stderr=True), transient=True)
            self._rich.start()
            self._task = self._rich.add_task("simulating", total=total)
        except ImportError:
            self._rich = None

    def advance(self) -> None:
        self.done += 1
        if not self.active:
            return
        if self._rich is not None:
            self._rich.update(self._task, advance=1)
        else:
            print(f"\rsimulated {self.done}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.active:
            return
        if self._rich is not None:
            self._rich.stop()
        else:
            print(file=sys.stderr)


def run_sweep(ns: argparse.Namespace, raw: dict[str, Any], hw: HardwareProfile, cluster: str,
              sweeps: list[tuple[str, list[Any]]], host_speed: float = 1.0,
              ) -> list[tuple[dict[str, Any], Any]]:
    """Every combination: (its values, a Prediction or the one-line reason it cannot run):
    those that fit the devices' memory first, best throughput first, then those predicted out
    of memory (best throughput first), then those that cannot run."""
    combos = list(itertools.product(*[values for _, values in sweeps]))
    progress = _Progress(len(combos))
    models: dict[tuple[Any, ...], ModelSpec] = {}
    results: list[tuple[dict[str, Any], Any]] = []
    try:
        for combo in combos:
            chosen = dict(zip([k for k, _ in sweeps], combo))
            config = raw
            layout_over: dict[str, int] = {}
            for key, value in chosen.items():
                if key in LAYOUT_KEYS:
                    layout_over[key] = value
                else:
                    config = _with_value(config, key, value)
            try:
                result: Any = predict_config(ns, config, hw, cluster, layout_over, "config",
                                             models, host_speed)
            except SimulateError as exc:
                if str(exc).startswith("--model"):
                    raise
                result = str(exc)
            results.append((chosen, result))
            progress.advance()
    finally:
        progress.close()
    results.sort(key=_rank)
    return results


def _rank(result: tuple[dict[str, Any], Any]) -> tuple[int, float]:
    predicted = result[1]
    if not isinstance(predicted, Prediction):
        return 2, 0.0
    return (1 if predicted.oom else 0), -predicted.samples_per_s
