"""Flat gradient buckets: each parameter's ``.grad`` is a view into its bucket's buffer, so a
full bucket is reduced in place by one collective with no gather copy."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from flowtrain.plan import BucketPlan


class GradBuckets:
    """The gradient memory of the trainable parameters, laid out as the plan's buckets.

    Autograd accumulates into ``param.grad`` in place because the view already exists with the
    parameter's layout; a post-accumulate hook per parameter counts arrivals per bucket and calls
    ``on_bucket_ready(index)`` when the last gradient of a bucket has landed.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], plan: Sequence[BucketPlan],
                 pad_to: int = 1) -> None:
        # pad_to: each buffer's length is rounded up to a multiple of it (ZeRO: the world
        # size, so a bucket splits into equal shards); the padding stays zero.
        self.params = list(params)
        self.plan = tuple(plan)
        self.flat: list[torch.Tensor] = []
        self._bucket_of = [0] * len(self.params)
        self._sizes = [len(b.slots) for b in self.plan]
        self._arrived = [0] * len(self.plan)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self.on_bucket_ready: Callable[[int], None] | None = None
        self.record_order = False
        self.observed_order: list[int] = []
        for bucket in self.plan:
            first = self.params[bucket.slots[0].index]
            flat = torch.zeros(-(-bucket.numel // pad_to) * pad_to, dtype=first.dtype,
                               device=first.device)
            self.flat.append(flat)
            for slot in bucket.slots:
                param = self.params[slot.index]
                if param.dtype != flat.dtype:
                    raise ValueError(f"parameter {slot.name} is {param.dtype}, its bucket "
                                     f"{bucket.index} holds {flat.dtype}")
                self._bucket_of[slot.index] = bucket.index
        self.attach_views()

    def attach_views(self) -> None:
        """Points every parameter's ``.grad`` at its slice of the bucket buffers (again, if the
        user's code replaced or cleared them)."""
        for bucket, flat in zip(self.plan, self.flat):
            for slot in bucket.slots:
                view = flat.narrow(0, slot.offset, slot.numel).view(slot.shape)
                self.params[slot.index].grad = view

    def views_intact(self) -> bool:
        for bucket, flat in zip(self.plan, self.flat):
            slot = bucket.slots[0]
            grad = self.params[slot.index].grad
            if grad is None or grad.data_ptr() != flat.data_ptr() + slot.offset * flat.element_size():
                return False
        return True

    def install_hooks(self) -> None:
        for index, param in enumerate(self.params):
            self._handles.append(param.register_post_accumulate_grad_hook(self._make_hook(index)))

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        bucket = self._bucket_of[index]

        def hook(_param: torch.Tensor) -> None:
            if self.record_order:
                self.observed_order.append(index)
            callback = self.on_bucket_ready
            if callback is None:
                return
            self._arrived[bucket] += 1
            if self._arrived[bucket] == self._sizes[bucket]:
                callback(bucket)

        return hook

    def reset_arrivals(self) -> None:
        self._arrived = [0] * len(self.plan)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def zero_(self) -> None:
        for flat in self.flat:
            flat.zero_()
