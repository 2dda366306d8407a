"""The order of ``FlowtrainEngine``'s gradient buckets (``BucketOrder``, a part the engine
holds): observed in the first step (the order gradients arrive in backward), settled after it,
and carried by checkpoints with whether a tied embedding's gradient is still reduced in two
parts.

A resumed run must reduce its gradients as the run it continues did. Which parameters share a
bucket, and where each lies in it, decide the order of additions in the float32 gradient norm
(one norm per bucket) and where the all-reduce cuts its chunks; the tied embedding's split adds
its rows after the dense reduce instead of before it. A resumed run that found these afresh
would take its first step another way, and its losses would part from the uninterrupted run's
in the last bits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from flowtrain.log import get_logger

if TYPE_CHECKING:
    from flowtrain.engine.buckets import GradBuckets

log = get_logger("flowtrain.engine")


class BucketOrder:
    """Whether the engine's buckets follow the order gradients were seen to arrive in, and
    whether that order is settled yet. ``observed``: the layout follows an observed order here
    (data parallel at stage 0, nothing that fixes the layout). Other layouts never change:
    ZeRO's shards are cut once, pipeline and tensor parallel stages are planned, a
    peer-recovery replacement builds the same buckets without asking, and "reverse" is a fixed
    order. The engine rebuilds its buckets in the order this returns."""

    def __init__(self, observed: bool) -> None:
        self.observed = observed
        self.settled = not observed
        self.settle_after = 0  # the first step that may settle the order

    def due(self, step: int) -> bool:
        """The order is to be settled after step ``step``."""
        return not self.settled and step >= self.settle_after

    def observe_again(self, buckets: GradBuckets, step: int) -> None:
        """The tied embedding's split was just switched off (on every rank at this step): its
        gradient is complete only at the end of backward again, so an order observed with the
        split (its bucket first, and buckets launch in order) would hold every reduce back until
        then. The next step observes the order afresh and the buckets are rebuilt from it."""
        if not self.observed:
            return
        buckets.observed_order.clear()
        self.settled = False
        self.settle_after = step + 1

    def settle(self, buckets: GradBuckets, params: int) -> list[int]:
        """After the first step: the order gradients actually arrived in (rank 0's observation,
        broadcast so every rank uses the same plan), over all ``params`` parameters."""
        self.settled = True
        seen: list[int] = []
        marks = set()
        for i in buckets.observed_order:
            if i not in marks:
                marks.add(i)
                seen.append(i)
        seen += [i for i in range(params) if i not in marks]
        order = torch.tensor(seen, dtype=torch.int64)
        dist.broadcast(order, src=0)
        return [int(i) for i in order.tolist()]

    def saved(self, layout: list[int]) -> list[int] | None:
        """What a checkpoint keeps: the observed order (the buckets' ``layout``) once it is
        settled; None where the layout is fixed or not yet observed (a run resumed from it
        observes its own)."""
        return layout if self.observed and self.settled else None

    def adopt(self, order: list[int], params: int) -> bool:
        """Takes a checkpoint's settled order (every rank loads the same one) as settled, and
        says so, where it fits this engine's ``params`` parameters and layout; one that does
        not (another model, a layout this engine does not observe) is left aside (False).
        Once adopted it is not observed again."""
        if not self.observed:
            return False
        if sorted(order) != list(range(params)):
            log.info("the checkpoint's bucket order does not fit this model's parameters; "
                     "observing the order afresh", saved=len(order), parameters=params)
            return False
        self.settled = True
        return True
