"""A shared-memory data channel for CPU ranks on one host: all-reduce through a mapped file in
/dev/shm instead of gloo's loopback sockets, so a reduce costs a few passes over memory and no
kernel copies. Collectives run one at a time on the channel's own thread."""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flowtrain import comm
from flowtrain.log import get_logger

log = get_logger("flowtrain.shm")

_FLAG_STRIDE = 8  # int64 slots per flag (64 bytes) so ranks do not share cache lines
_HEADER_BYTES = 4096
_SHM_DIR = Path("/dev/shm")


class ShmTimeout(TimeoutError):
    """A peer did not reach the collective in time; names the ranks that were missing."""


def available() -> bool:
    return _SHM_DIR.is_dir() and os.access(_SHM_DIR, os.W_OK)


class ShmChannel:
    """All-reduce (sum) of CPU tensors among the ``world_size`` ranks of one host.

    Each rank owns one slot of ``slot_bytes``: it copies its tensor in, raises its ``written``
    flag, waits for every rank's flag, sums all slots in rank order into its tensor (the same
    order everywhere, so every rank gets bit-identical results), then raises its ``read`` flag.
    A slot is reused only after every rank has read the previous round. Tensors larger than a
    slot go through in slot-sized chunks.
    """

    def __init__(self, path: str | os.PathLike[str], *, rank: int, world_size: int,
                 slot_bytes: int, create: bool, timeout: float = 600.0) -> None:
        if world_size < 2 or world_size * 2 * _FLAG_STRIDE * 8 > _HEADER_BYTES:
            raise ValueError(f"shared-memory channel needs 2..{_HEADER_BYTES // 128} ranks, "
                             f"got {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.slot_bytes = slot_bytes - slot_bytes % 64
        self.timeout = timeout
        self.path = Path(path)
        size = _HEADER_BYTES + world_size * self.slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise ValueError(f"shared-memory file {self.path} has {os.fstat(fd).st_size} "
                                 f"bytes, expected {size}: ranks disagree on the channel size")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        header = np.frombuffer(self._map, dtype=np.int64, count=_HEADER_BYTES // 8)
        self._written = header[0: world_size * _FLAG_STRIDE: _FLAG_STRIDE]
        self._read = header[world_size * _FLAG_STRIDE: 2 * world_size * _FLAG_STRIDE: _FLAG_STRIDE]
        self._seq = 0
        self._slots = [torch.frombuffer(self._map, dtype=torch.uint8, count=self.slot_bytes,
                                        offset=_HEADER_BYTES + r * self.slot_bytes)
                       for r in range(world_size)]
        self._requests: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="flowtrain-shm", daemon=True)
        self._thread.start()
        self._closed = False

    # -- public --------------------------------------------------------------------------------

    def all_reduce_async(self, tensor: torch.Tensor) -> concurrent.futures.Future[None]:
        """Queues a sum all-reduce of ``tensor`` in place; the future completes when it is done.
        Every rank must queue the same collectives in the same order."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"the shared-memory channel reduces contiguous CPU tensors, got "
                             f"{tensor.device} "
                             f"{'contiguous' if tensor.is_contiguous() else 'strided'}")
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._requests.put((tensor, future))
        return future

    def reduce_scatter_async(self, tensor: torch.Tensor,
                             output: torch.Tensor) -> concurrent.futures.Future[None]:
        """Queues a sum reduce-scatter: ``tensor`` (numel divisible by the world size) is
        summed across ranks and only this rank's contiguous slice lands in ``output``; the
        same rank-order summation as ``all_reduce_async``, so the slice is bit-identical."""
        for t in (tensor, output):
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("the shared-memory channel reduces contiguous CPU tensors")
        if tensor.numel() != output.numel() * self.world_size or tensor.dtype != output.dtype:
            raise ValueError(f"reduce_scatter: input of {tensor.numel()} x {tensor.dtype} does "
                             f"not split into {self.world_size} shards of {output.numel()} x "
                             f"{output.dtype}")
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._requests.put(((tensor, output), future))
        return future

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.all_reduce_async(tensor).result()
        return tensor

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._requests.put(None)
        self._thread.join(5)

    # -- the channel thread ---------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            item = self._requests.get()
            if item is None:
                return
            tensor, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if isinstance(tensor, tuple):
                    self._reduce_scatter(*tensor)
                else:
                    self._reduce(tensor)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(exc)
            else:
                future.set_result(None)

    def _reduce(self, tensor: torch.Tensor) -> None:
        flat = tensor.view(-1)
        per_chunk = self.slot_bytes // tensor.element_size()
        for start in range(0, flat.numel(), per_chunk):
            self._reduce_chunk(flat[start:start + per_chunk])

    def _reduce_scatter(self, tensor: torch.Tensor, output: torch.Tensor) -> None:
        flat, out = tensor.view(-1), output.view(-1)
        lo = self.rank * out.numel()
        hi = lo + out.numel()
        per_chunk = self.slot_bytes // tensor.element_size()
        for start in range(0, flat.numel(), per_chunk):
            chunk = flat[start:start + per_chunk]
            a, b = max(lo, start), min(hi, start + chunk.numel())
            self._reduce_chunk(chunk, (a - start, b - start, out[a - lo:b - lo]) if a < b
                               else (0, 0, None))

    def _reduce_chunk(self, chunk: torch.Tensor,
                      part: tuple[int, int, torch.Tensor | None] | None = None) -> None:
        """Sums ``chunk`` across ranks into itself, or (``part`` = (begin, end, out)) only its
        elements [begin, end) into ``out`` (every rank still writes its whole chunk)."""
        self._seq += 1
        seq = self._seq
        nbytes = chunk.numel() * chunk.element_size()
        # Reuse the slot only after every rank has read what it held last round.
        self._wait(self._read, seq - 1, "finish reading the previous round")
        mine = self._slots[self.rank][:nbytes].view(chunk.dtype)
        mine.copy_(chunk)
        self._written[self.rank] = seq
        self._wait(self._written, seq, "write its contribution")
        views = [slot[:nbytes].view(chunk.dtype) for slot in self._slots]
        target: torch.Tensor | None = chunk
        if part is not None:
            begin, end, target = part
            views = [v[begin:end] for v in views]
        if target is not None:
            torch.add(views[0], views[1], out=target)
            for other in views[2:]:
                target.add_(other)
        self._read[self.rank] = seq

    def _wait(self, flags: np.ndarray, target: int, what: str) -> None:
        if (flags >= target).all():
            return
        deadline = time.monotonic() + self.timeout
        pause = 0.0
        while not (flags >= target).all():
            if time.monotonic() > deadline:
                missing = [r for r in range(self.world_size) if flags[r] < target]
                raise ShmTimeout(f"ranks {missing} did not {what} (shared-memory all-reduce "
                                 f"#{target}) within {self.timeout:g} s")
            # Spin briefly, then back off: a waiting rank must not take the CPU from compute.
            time.sleep(pause)
            pause = min(pause * 2 or 2e-6, 2e-4)


_opened = 0


def open_channel(rank: Any, *, slot_bytes: int, timeout: float) -> ShmChannel:
    """Creates (local rank 0) or attaches (the others) the host's channel, agreeing on the file
    through the control plane, and unlinks it once everyone has it mapped, so nothing is left
    in /dev/shm even if the job crashes."""
    global _opened
    env = rank.env
    # Numbered: an engine rebuilt in the same job opens a new channel under a fresh key (every
    # rank opens its channels in the same order).
    _opened += 1
    key = f"shm-channel-{env.node_rank}-{_opened}"
    if env.local_rank == 0:
        path = _SHM_DIR / f"flowtrain-{os.getpid()}-{os.urandom(6).hex()}"
        channel = ShmChannel(path, rank=env.local_rank, world_size=env.local_world_size,
                             slot_bytes=slot_bytes, create=True, timeout=timeout)
        rank.kv_set(key, str(path))
    else:
        path = Path(rank.kv_get(key, timeout=timeout))
        channel = ShmChannel(path, rank=env.local_rank, world_size=env.local_world_size,
                             slot_bytes=slot_bytes, create=False, timeout=timeout)
    rank.barrier(f"{key}-mapped", timeout=timeout)
    if env.local_rank == 0:
        path.unlink(missing_ok=True)
    return channel


def data_channel(choice: str | None, rank: Any, *, world_size: int, model_parallel: bool,
                 module: torch.nn.Module, largest_bucket_bytes: int) -> ShmChannel | None:
    """The shared-memory channel for a data-parallel engine when every rank is on this host and
    its model on the CPU (``choice`` "shm", or None for automatic); None means torch.distributed
    (gloo/NCCL) carries the reduces. ``rank`` is this process's flowtrain rank."""
    on_cpu = all(p.device.type == "cpu" for p in module.parameters())
    # the shared-memory channel spans every rank of the job: one data-parallel group only
    single_host = rank.env.local_world_size == world_size and not model_parallel
    if choice is None:
        choice = "shm" if on_cpu and single_host and available() else "torch"
    if choice != "shm":
        return None
    if not (on_cpu and single_host):
        raise ValueError("flowtrain.data_channel 'shm' needs every rank on one host and the "
                         f"model on the CPU; world size {world_size}, ranks on this "
                         f"host {rank.env.local_world_size}, model on "
                         f"{next(module.parameters()).device}")
    return open_channel(rank, slot_bytes=min(largest_bucket_bytes, 64 * 2**20) + 64,
                        timeout=comm.DEFAULT_TIMEOUT)
