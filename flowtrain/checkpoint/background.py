"""Asynchronous checkpoint saves (``checkpoint.async_save``): the tensors are copied to host
memory on the training thread, then one background thread writes the files and publishes the
checkpoint; at most one save is in flight, and the next save, a load or ``destroy`` waits
for it."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

from flowtrain.checkpoint.manifest import CheckpointError
from flowtrain.log import get_logger

log = get_logger("flowtrain.checkpoint")

# How long a save (or a load, or destroy) waits for the previous background write. A write
# that takes longer is stuck (a rank gone, a hung file system): its barriers time out at 300 s.
WAIT_TIMEOUT = 600.0


class BackgroundWriter:
    """One engine's background checkpoint writes: host-memory copies of the tensors (reused
    from one save to the next, since only one save is in flight), the writer thread, and a
    process group of its own, so that the write's collectives never interleave with
    training's."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._tag: str | None = None
        self._error: BaseException | None = None
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        # the buffers ``copy`` filled since the last ``stage``, and whether any came from a GPU
        self._fresh: set[int] = set()
        self._from_gpu = False
        # DCP key -> (layout, ShardedTensor over this writer's buffers): see save.Stager
        self.described: dict[str, tuple[Any, ShardedTensor]] = {}
        self._group: Any = None

    @property
    def busy(self) -> bool:
        """Whether a write is still running."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float = WAIT_TIMEOUT) -> None:
        """Returns once the previous save is published; raises its error, if it failed."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise CheckpointError(f"the background write of checkpoint {self._tag!r} has "
                                      f"not finished after {timeout:g} s (a rank gone or the "
                                      f"file system stuck); its 'latest' was not moved")
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def process_group(self) -> Any:
        """A gloo group over every rank for the write's collectives (made on the first save,
        when every rank is here), or None without torch.distributed."""
        if self._group is None and dist.is_initialized() and dist.get_world_size() > 1:
            from flowtrain import comm

            self._group = dist.new_group(backend="gloo",
                                         timeout=timedelta(seconds=comm.DEFAULT_TIMEOUT))
        return self._group

    def copy(self, key: str, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (block ``index`` of DCP key ``key``) copied into this writer's host
        buffer for it: ``save.snapshot`` builds the state dict over these copies."""
        buffer = self._buffers.get((key, index))
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                                 pin_memory=tensor.is_cuda)
            self._buffers[(key, index)] = buffer
        buffer.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
        self._from_gpu |= tensor.is_cuda
        self._fresh.add(id(buffer))
        return buffer

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` (``save.snapshot``'s, built with this writer) with every tensor in
        host memory, so training may change the originals while the write runs: the sharded
        tensors and the blocks ``copy`` made are kept, the other tensors (the module's
        buffers) are copied now."""
        staged: dict[str, Any] = {}
        for key, value in state_dict.items():
            if isinstance(value, ShardedTensor):
                if not all(id(s.tensor) in self._fresh for s in value.local_shards()):
                    raise RuntimeError(f"sharded tensor {key!r} was not built over this "
                                       f"writer's host copies (save.snapshot(..., stager))")
                staged[key] = value
            elif torch.is_tensor(value) and id(value) not in self._fresh:
                staged[key] = self.copy(key, 0, value)
            else:
                staged[key] = value
        if self._from_gpu:
            torch.cuda.synchronize()  # the non-blocking copies into pinned memory are done
        self._from_gpu = False
        self._fresh.clear()
        return staged

    def start(self, tag: str, work: Callable[[], None]) -> None:
        """Runs ``work`` (the rest of the save of ``tag``) on the writer thread. Not a daemon:
        the interpreter waits for it at exit, so a script that ends right after a save
        still publishes it."""
        if self.busy:
            raise RuntimeError(f"checkpoint {self._tag!r} is still being written; wait() first")
        self._tag, self._error = tag, None

        def run() -> None:
            lower_priority()
            try:
                work()
            except BaseException as exc:  # kept for wait(), which raises it on this rank
                self._error = exc
                log.error("background checkpoint write failed; 'latest' still names the "
                          "previous checkpoint", tag=tag, error=str(exc))

        self._thread = threading.Thread(target=run, name=f"flowtrain-checkpoint-{tag}")
        self._thread.start()


def lower_priority() -> None:
    """Makes the calling thread the lowest CPU priority (nice 19): the write serializes and
    copies on host cores that training also uses (data loading, a CPU rank's compute), and a
    training step should pre-empt it rather than share the core. Linux gives each thread its
    own nice value (it is keyed by the thread's id); where that is not so, the write runs at
    the process's priority."""
    if not hasattr(os, "setpriority"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError:
        pass
