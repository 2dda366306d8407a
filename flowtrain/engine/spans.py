"""Measured task spans and the step plan, written into the run directory so that
``flowtrain simulate --compare runs/<id>`` can hold the run against its prediction.

``spans/rank{R}.jsonl``: one JSON object per optimizer step,
``{"v": 1, "step": N, "spans": [[name, start_s, end_s], ...]}``, times in seconds from the
step's start, names as the StepPlan names its tasks (``forward/mb0``, ``backward/mb0``,
``reduce/bucket3``, ``gather/bucket2``, ``optimizer/step``; ``comm/wait`` is the time the
step waited for reduces after the last backward). ``plan.json`` (rank 0): the config, world
size, parameter specs and the forward FLOPs of one micro-batch."""

from __future__ import annotations

import atexit
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

SCHEMA_VERSION = 1


class SpanRecorder:
    """Appends each step's spans to this rank's file, flushed every ``flush_every`` steps (one
    line per step: cheap) and at exit."""

    def __init__(self, run_dir: str | os.PathLike[str], rank: int, flush_every: int = 1) -> None:
        self.dir = Path(run_dir) / "spans"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"rank{rank}.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._flush_every = flush_every
        self._pending = 0
        atexit.register(self.close)

    def write_step(self, step: int, start: float,
                   spans: list[tuple[str, float, float]]) -> None:
        rows = [[name, round(a - start, 7), round(b - start, 7)] for name, a, b in spans]
        self._file.write(json.dumps({"v": SCHEMA_VERSION, "step": step, "spans": rows},
                                    separators=(",", ":")) + "\n")
        self._pending += 1
        if self._pending >= self._flush_every:
            self.flush()

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()
        self._pending = 0

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def write_plan(run_dir: str | os.PathLike[str], *, config: dict[str, Any], world_size: int,
               param_specs: list[tuple[str, tuple[int, ...], str, int]],
               forward_flops_per_micro_batch: float,
               forward_ops_per_micro_batch: dict[str, Any] | None = None,
               tied_embeddings: list[dict[str, Any]] | None = None) -> Path:
    """Rank 0's record of what the run planned (atomically replaced).
    ``forward_ops_per_micro_batch`` is the first forward's ``OpCensus.summary()`` (its matmul
    and attention FLOPs, and its other ops by class); ``tied_embeddings`` the embedding weights
    tied to a head, each ``{"param": name, "lookups_per_micro_batch": tokens looked up}``."""
    path = Path(run_dir) / "plan.json"
    data = {"v": SCHEMA_VERSION, "config": config, "world_size": world_size,
            "param_specs": [[n, list(s), d, e] for n, s, d, e in param_specs],
            "forward_flops_per_micro_batch": forward_flops_per_micro_batch,
            **({"forward_ops_per_micro_batch": forward_ops_per_micro_batch}
               if forward_ops_per_micro_batch is not None else {}),
            **({"tied_embeddings": tied_embeddings} if tied_embeddings else {}),
            "host": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                     "machine": platform.machine(), "torch": torch.__version__,
                     "cuda": torch.cuda.is_available()}}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)
    return path
