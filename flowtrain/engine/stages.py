"""The points of a training step where user actors (custom stages) are wired in, and the
messages they receive there.

- ``bucket_full``: a gradient bucket is complete and about to be reduced. The stage is asked with
  ``BucketFull`` and may change ``grad`` in place (compression, clipping, statistics); the reduce
  starts when it answers.
- ``after_reduce``: a bucket was reduced; ``BucketReduced`` is asked the same way.
- ``after_step``: the optimizer step finished (or was skipped); ``StepDone`` is sent.
- ``micro_batch``: ``MicroBatchStart`` before a forward and ``MicroBatchEnd`` after its backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

STAGE_POINTS = ("bucket_full", "after_reduce", "after_step", "micro_batch")


@dataclass(frozen=True)
class BucketFull:
    index: int
    grad: torch.Tensor  # the bucket's flat gradient buffer, before the reduce
    step: int


@dataclass(frozen=True)
class BucketReduced:
    index: int
    grad: torch.Tensor  # the bucket's flat gradient buffer, averaged over ranks
    step: int


@dataclass(frozen=True)
class StepDone:
    step: int
    skipped: bool
    loss: float | None
    lr: float
    grad_norm: float | None
    loss_scale: float


@dataclass(frozen=True)
class MicroBatchStart:
    step: int
    micro_step: int


@dataclass(frozen=True)
class MicroBatchEnd:
    step: int
    micro_step: int


@dataclass
class Stages:
    """The user actors wired in at each point, in the order they were added."""

    at: dict[str, list[Any]] = field(default_factory=lambda: {p: [] for p in STAGE_POINTS})

    def add(self, ref: Any, at: str) -> None:
        if at not in STAGE_POINTS:
            raise ValueError(f"unknown stage point {at!r}; the points are "
                             f"{', '.join(STAGE_POINTS)}")
        self.at[at].append(ref)

    def __getitem__(self, point: str) -> list[Any]:
        return self.at[point]
