"""The order of ``FlowtrainEngine``'s gradient buckets (a mixin): observed in the first step
(the order gradients arrive in backward), settled after it, and carried by checkpoints with
whether a tied embedding's gradient is still reduced in two parts.

A resumed run must reduce its gradients as the run it continues did. Which parameters share a
bucket, and where each lies in it, decide the order of additions in the float32 gradient norm
(one norm per bucket) and where the all-reduce cuts its chunks; the tied embedding's split adds
its rows after the dense reduce instead of before it. A resumed run that found these afresh
would take its first step another way, and its losses would part from the uninterrupted run's
in the last bits."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from flowtrain.log import get_logger

if TYPE_CHECKING:
    from flowtrain.engine.buckets import GradBuckets
    from flowtrain.engine.strategy import Strategy
    from flowtrain.plan.spec import TrainingSpec
    from flowtrain.plan.step_plan import StepPlan

log = get_logger("flowtrain.engine")


class BucketOrder:
    # Set by FlowtrainEngine.__init__; declared for the checks of the methods below.
    spec: TrainingSpec
    buckets: GradBuckets
    plan: StepPlan
    trainable: list[torch.nn.Parameter]
    global_steps: int
    world_size: int
    strategy: Strategy
    model_parallel: bool
    peer: Any
    reducer: Any
    _reducer_actor: Any
    _rows: Any  # the tied embedding's split (flowtrain.engine.embedding_rows), or None
    _order_settled: bool
    _settle_after: int
    # methods of the engine (annotations only: stubs here would shadow them)
    _make_plan: Callable[[list[int] | None], Any]
    _make_buckets: Callable[[Any], Any]

    def _observed_layout(self) -> bool:
        """The buckets follow an observed order here (data parallel at stage 0, nothing that
        fixes the layout). Other layouts never change: ZeRO's shards are cut once, pipeline and
        tensor parallel stages are planned, a peer-recovery replacement builds the same buckets
        without asking, and "reverse" is a fixed order."""
        return self.world_size > 1 and self.strategy.observes_bucket_order and \
            not self.model_parallel and self.peer is None and \
            self.spec.host.bucket_order == "observed"

    def _observe_order_again(self) -> None:
        """The tied embedding's split was just switched off (on every rank at this step): its
        gradient is complete only at the end of backward again, so an order observed with the
        split (its bucket first, and buckets launch in order) would hold every reduce back until
        then. The next step observes the order afresh and the buckets are rebuilt from it."""
        if not self._observed_layout():
            return
        self.buckets.observed_order.clear()
        self._order_settled = False
        self._settle_after = self.global_steps + 1

    def _settle_bucket_order(self) -> None:
        """After the first step: rebuild the buckets in the order gradients actually arrived
        (rank 0's observation, broadcast so every rank uses the same plan)."""
        self._order_settled = True
        seen: list[int] = []
        marks = set()
        for i in self.buckets.observed_order:
            if i not in marks:
                marks.add(i)
                seen.append(i)
        seen += [i for i in range(len(self.trainable)) if i not in marks]
        order = torch.tensor(seen, dtype=torch.int64)
        dist.broadcast(order, src=0)
        if self._use_bucket_order(order.tolist()):
            log.debug("buckets rebuilt in observed gradient order",
                      buckets=len(self.plan.buckets))

    def _use_bucket_order(self, order: list[int]) -> bool:
        """Rebuilds the buckets with the parameters in ``order``; False when they already are."""
        if order == self.bucket_layout():
            return False
        self.buckets.remove_hooks()
        self.plan = self._make_plan(order)
        self.buckets = self._make_buckets(self.plan)
        if self.reducer is not None:
            self._reducer_actor.use_buckets(self.buckets)
        return True

    def bucket_layout(self) -> list[int]:
        """The index (in ``trainable``) of each parameter, in the order the buckets hold them."""
        return [slot.index for bucket in self.plan.buckets for slot in bucket.slots]

    def settled_bucket_order(self) -> list[int] | None:
        """What a checkpoint keeps: the observed order once it is settled; None where the
        layout is fixed or not yet observed (a run resumed from it observes its own)."""
        if not (self._observed_layout() and self._order_settled):
            return None
        return self.bucket_layout()

    def layout_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of how this engine reduces its gradients: the settled bucket
        order (``settled_bucket_order``) and whether the tied embedding's split is on (None
        without one)."""
        return {"bucket_order": self.settled_bucket_order(),
                "tied_rows_split": self._rows.enabled if self._rows is not None else None}

    def adopt_layout_state(self, state: dict[str, Any]) -> None:
        """A checkpoint's ``layout_state`` (every rank loads the same one). A split the saved
        run had switched off stays off from the first step here, which then reduces the tied
        gradient densely as that run did."""
        if state.get("tied_rows_split") is False and self._rows is not None:
            self._rows.enabled = False
        order = state.get("bucket_order")
        if order is not None:
            self.adopt_bucket_order(order)

    def adopt_bucket_order(self, order: list[int]) -> None:
        """A checkpoint's settled order (every rank loads the same one): the buckets are
        rebuilt in it and it is not observed again. An order that does not fit this engine's
        parameters (another model, a layout this engine does not observe) is left aside."""
        if not self._observed_layout():
            return
        if sorted(order) != list(range(len(self.trainable))):
            log.info("the checkpoint's bucket order does not fit this model's parameters; "
                     "observing the order afresh", saved=len(order),
                     parameters=len(self.trainable))
            return
        self._use_bucket_order(order)
        self.buckets.observed_order.clear()
        self._order_settled = True
