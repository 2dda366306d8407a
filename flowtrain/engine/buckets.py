"""Flat gradient buckets: each parameter's ``.grad`` is a view into its bucket's buffer, so a
full bucket is reduced in place by one collective with no gather copy."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from flowtrain.plan import BucketPlan


class GradBuckets:
    """The gradient memory of the trainable parameters, laid out as the plan's buckets.

    Autograd accumulates into ``param.grad`` in place because the view already exists with the
    parameter's layout; a post-accumulate hook per parameter counts arrivals per bucket and calls
    ``on_bucket_ready(index)`` when the last gradient of a bucket has landed. The engine hands
    that callback in for one backward at a time (``watch``); the buckets know nothing of what
    it does with a full bucket.

    With ``transient=True`` (ZeRO stages 2 and 3, which keep only a gradient shard) no buffer
    lives between uses: a bucket's buffer is taken from a pool when its first gradient lands,
    each gradient is added into it and the parameter's ``.grad`` dropped, and the buffer goes
    back to the pool once the reducer has reduce-scattered it. ``flat[i]`` is None while
    bucket i holds no gradient.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], plan: Sequence[BucketPlan],
                 pad_to: int = 1, transient: bool = False,
                 allocate: Callable[[int, torch.dtype], torch.Tensor | None] | None = None
                 ) -> None:
        # pad_to: each buffer's length is rounded up to a multiple of it (ZeRO: the world
        # size, so a bucket splits into equal shards); the padding stays zero.
        # allocate: where lasting buffers come from (zeroed; None from it: ordinary memory),
        # e.g. the shared-memory channel's arena, which reduces them without a copy
        self.params = list(params)
        self.plan = tuple(plan)
        self.transient = transient
        self._pool = _BufferPool()
        self._specs: list[tuple[int, torch.dtype, torch.device]] = []
        self.flat: list[torch.Tensor | None] = []
        self._bucket_of = [0] * len(self.params)
        self._sizes = [len(b.slots) for b in self.plan]
        self._arrived = [0] * len(self.plan)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self.on_bucket_ready: Callable[[int], None] | None = None
        self.record_order = False
        self.observed_order: list[int] = []
        for bucket in self.plan:
            first = self.params[bucket.slots[0].index]
            spec = (-(-bucket.numel // pad_to) * pad_to, first.dtype, first.device)
            self._specs.append(spec)
            flat = None
            if not transient:
                if allocate is not None and spec[2].type == "cpu":
                    flat = allocate(spec[0], spec[1])
                if flat is None:
                    flat = torch.zeros(spec[0], dtype=spec[1], device=spec[2])
            self.flat.append(flat)
            for slot in bucket.slots:
                param = self.params[slot.index]
                if param.dtype != first.dtype:
                    raise ValueError(f"parameter {slot.name} is {param.dtype}, its bucket "
                                     f"{bucket.index} holds {first.dtype}")
                self._bucket_of[slot.index] = bucket.index
        self._slot_of = {s.index: s for b in self.plan for s in b.slots}
        if not transient:
            self.attach_views()

    def buffer(self, index: int) -> torch.Tensor:
        """Bucket ``index``'s buffer, which a bucket that is not transient always holds."""
        flat = self.flat[index]
        if flat is None:
            raise RuntimeError(f"gradient bucket {index} holds no buffer: a transient bucket has "
                               "one only from its first gradient until the reducer takes it")
        return flat

    def buffers(self) -> list[torch.Tensor]:
        """Every bucket's buffer (buckets that are not transient)."""
        return [self.buffer(index) for index in range(len(self.flat))]

    # -- transient buffers (ZeRO stages 2 and 3) --------------------------------------------------

    def take(self, index: int) -> torch.Tensor:
        """Hands bucket ``index``'s buffer over (to the reducer): a zeroed one if no gradient
        landed in it; the bucket starts empty again."""
        buffer = self.flat[index]
        self.flat[index] = None
        return buffer if buffer is not None else self._pool.get(*self._specs[index])

    def release(self, buffer: torch.Tensor) -> None:
        """A reduced buffer goes back to the pool (called from the reducer's thread)."""
        self._pool.put(buffer)

    @property
    def numels(self) -> list[int]:
        """Each bucket's padded length (whether or not a buffer exists now)."""
        return [spec[0] for spec in self._specs]

    @property
    def pool_bytes(self) -> int:
        """Bytes of every transient buffer allocated so far (held or pooled)."""
        return self._pool.allocated

    def _stash(self, index: int) -> None:
        param = self.params[index]
        grad = param.grad
        if grad is None:
            return
        bucket = self._bucket_of[index]
        buffer = self.flat[bucket]
        if buffer is None:
            buffer = self.flat[bucket] = self._pool.get(*self._specs[bucket])
        slot = self._slot_of[index]
        buffer.narrow(0, slot.offset, slot.numel).view(slot.shape).add_(grad)
        param.grad = None

    def attach_views(self) -> None:
        """Points every parameter's ``.grad`` at its slice of the bucket buffers (again, if the
        user's code replaced or cleared them)."""
        if self.transient:
            return
        for bucket, flat in zip(self.plan, self.buffers()):
            for slot in bucket.slots:
                view = flat.narrow(0, slot.offset, slot.numel).view(slot.shape)
                self.params[slot.index].grad = view

    def views_intact(self) -> bool:
        if self.transient:
            return True
        for bucket, flat in zip(self.plan, self.buffers()):
            slot = bucket.slots[0]
            grad = self.params[slot.index].grad
            if grad is None or \
                    grad.data_ptr() != flat.data_ptr() + slot.offset * flat.element_size():
                return False
        return True

    def install_hooks(self) -> None:
        for index, param in enumerate(self.params):
            self._handles.append(param.register_post_accumulate_grad_hook(self._make_hook(index)))

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        bucket = self._bucket_of[index]

        def hook(_param: torch.Tensor) -> None:
            if self.transient:
                self._stash(index)
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

    @contextlib.contextmanager
    def watch(self, on_ready: Callable[[int], None] | None,
              record_order: bool = False) -> Iterator[None]:
        """For one backward: counts arrivals afresh and calls ``on_ready(index)`` as the last
        gradient of bucket ``index`` lands (None: nobody is told); with ``record_order``,
        appends each parameter's index to ``observed_order`` as its gradient arrives."""
        self.reset_arrivals()
        self.on_bucket_ready, self.record_order = on_ready, record_order
        try:
            yield
        finally:
            self.on_bucket_ready, self.record_order = None, False

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def zero_(self) -> None:
        for flat in self.flat:
            if flat is not None:
                flat.zero_()


class _BufferPool:
    """Zeroed flat buffers reused by size, dtype and device; thread-safe (the reducer returns
    buffers from the event loop's thread)."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.allocated = 0

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        with self._lock:
            free = self._free.get((numel, dtype, device))
            buffer = free.pop() if free else None
            if buffer is None:
                self.allocated += numel * torch.empty((), dtype=dtype).element_size()
        if buffer is None:
            return torch.zeros(numel, dtype=dtype, device=device)
        return buffer.zero_()

    def put(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault((buffer.numel(), buffer.dtype, buffer.device), []).append(buffer)
