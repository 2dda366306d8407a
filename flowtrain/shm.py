"""A shared-memory data channel for CPU ranks on one host: all-reduce through a mapped file in
/dev/shm instead of gloo's loopback sockets, so a reduce costs a few passes over memory and no
kernel copies. Collectives run one at a time on the channel's own thread."""

from __future__ import annotations

import concurrent.futures
import errno
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
import torch

from flowtrain import comm
from flowtrain.env import SHM_POLL
from flowtrain.futex import futex
from flowtrain.log import get_logger

log = get_logger("flowtrain.shm")

_FLAG_STRIDE = 8  # int64 slots per flag (64 bytes) so ranks do not share cache lines
_HEADER_BYTES = 8192
_FLAG_SETS = 3  # written, reduced, read
_ALIGN = 64  # bytes: arena buffers and reduce portions start on their own cache line
_SHM_DIR = Path("/dev/shm")
# longest single sleep on a flag: a missed wake-up (a peer that died between its write and its
# wake) costs at most this before the flag is read again
_FUTEX_NAP = 0.05


class ShmTimeout(TimeoutError):
    """A peer did not reach the collective in time; names the ranks that were missing."""


class ShmSpaceError(OSError):
    """/dev/shm has too little room for a shared-memory channel."""


def _size(nbytes: int, digits: int) -> str:
    """``nbytes`` for a message: MiB from 1 MiB up, so that a small slot does not read "0.0 MiB"
    below that."""
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.{digits}f} MiB"
    if nbytes >= 2**10:
        return f"{nbytes / 2**10:.1f} KiB"
    return f"{nbytes} bytes"


def available() -> bool:
    return _SHM_DIR.is_dir() and os.access(_SHM_DIR, os.W_OK)


class ShmChannel:
    """All-reduce (sum) of CPU tensors among the ``world_size`` ranks of one host.

    Each rank owns one slot of ``slot_bytes``: it copies its tensor in, raises its ``written``
    flag, waits for every rank's flag, sums all slots in rank order into its tensor (the same
    order everywhere, so every rank gets bit-identical results), then raises its ``read`` flag.
    A slot is reused only after every rank has read the previous round. Tensors larger than a
    slot go through in slot-sized chunks.

    With ``arena_bytes`` each rank also owns an arena of that size which its peers can read: a
    tensor allocated there (``arena_allocator``) is all-reduced without the copy into a slot,
    and each rank sums only its 1/world share of it (from every rank's arena, in rank order,
    into its own), then copies the others' finished shares (a reduce-scatter and an all-gather
    in shared memory). Peers read a rank's arena tensor until they are done, so its owner
    calls ``quiesce`` before it next writes the tensor (zeroing the gradients).

    With ``shared_bytes`` the file also holds one region of that size for the whole host
    (``shared_region``), which every rank maps at the same place: ZeRO keeps the model's
    parameters there, each rank writing only its own shard, so a parameter all-gather on this
    host is a ``barrier`` where the shards change and a stage-3 gather is a view.
    """

    def __init__(self, path: str | os.PathLike[str], *, rank: int, world_size: int,
                 slot_bytes: int, create: bool, timeout: float = 600.0,
                 arena_bytes: int = 0, shared_bytes: int = 0) -> None:
        most = _HEADER_BYTES // (_FLAG_SETS * _FLAG_STRIDE * 8)
        if world_size < 2 or world_size > most:
            raise ValueError(f"shared-memory channel needs 2..{most} ranks, got {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.slot_bytes = slot_bytes - slot_bytes % 64
        self.timeout = timeout
        self.arena_bytes = -(-arena_bytes // _ALIGN) * _ALIGN
        self.shared_bytes = -(-shared_bytes // _ALIGN) * _ALIGN
        self.path = Path(path)
        size = _HEADER_BYTES + world_size * (self.slot_bytes + self.arena_bytes) + \
            self.shared_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
                self._reserve(fd, size)
            elif os.fstat(fd).st_size != size:
                raise ValueError(f"shared-memory file {self.path} has {os.fstat(fd).st_size} "
                                 f"bytes, expected {size}: ranks disagree on the channel size")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        header = np.frombuffer(self._map, dtype=np.int64, count=_HEADER_BYTES // 8)
        self._written = header[0: world_size * _FLAG_STRIDE: _FLAG_STRIDE]
        self._read = header[world_size * _FLAG_STRIDE: 2 * world_size * _FLAG_STRIDE: _FLAG_STRIDE]
        self._reduced = header[2 * world_size * _FLAG_STRIDE: 3 * world_size * _FLAG_STRIDE:
                               _FLAG_STRIDE]
        self._seq = 0
        self._slots = [torch.frombuffer(self._map, dtype=torch.uint8, count=self.slot_bytes,
                                        offset=_HEADER_BYTES + r * self.slot_bytes)
                       for r in range(world_size)]
        arenas_at = _HEADER_BYTES + world_size * self.slot_bytes
        self._arenas = [torch.frombuffer(self._map, dtype=torch.uint8, count=self.arena_bytes,
                                         offset=arenas_at + r * self.arena_bytes)
                        for r in range(world_size)] if self.arena_bytes else []
        self._arena_ptr = self._arenas[rank].data_ptr() if self._arenas else 0
        self._shared = torch.frombuffer(self._map, dtype=torch.uint8, count=self.shared_bytes,
                                        offset=arenas_at + world_size * self.arena_bytes) \
            if self.shared_bytes else None
        # peers sleep on the flags and are woken by the rank raising one (polling without it)
        self._futex = futex() if os.environ.get(SHM_POLL) is None else None
        self._requests: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="flowtrain-shm", daemon=True)
        self._thread.start()
        self._closed = False

    def _reserve(self, fd: int, size: int) -> None:
        """Claims the file's pages now. A tmpfs file is sparse: without this, a /dev/shm too
        small for it (Docker's default is 64 MiB) is found only when a rank first writes past
        the room left, and the kernel kills that rank with SIGBUS instead of an error."""
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate: stays sparse
                return
            self.path.unlink(missing_ok=True)
            if exc.errno != errno.ENOSPC:
                raise
            stat = os.statvfs(self.path.parent)
            free = stat.f_bavail * stat.f_frsize
            parts = [f"{self.world_size} slots of {_size(self.slot_bytes, 1)}"]
            if self.arena_bytes:
                parts.append(f"{self.world_size} gradient arenas of "
                             f"{_size(self.arena_bytes, 1)}")
            if self.shared_bytes:
                parts.append(f"the host's parameters, {_size(self.shared_bytes, 1)}")
            raise ShmSpaceError(
                f"{self.path.parent} has {_size(free, 0)} free, but the shared-memory "
                f"channel needs {_size(size, 0)} ({', '.join(parts)}). Give it more room "
                "(docker run --shm-size=...; a Kubernetes emptyDir with medium Memory), or "
                "leave shared memory: \"flowtrain\": {\"data_channel\": \"torch\"} reduces "
                "over gloo, {\"zero_shared_params\": false} keeps a private copy of the "
                "parameters per rank") from exc

    # -- public --------------------------------------------------------------------------------

    def all_reduce_async(self, tensor: torch.Tensor,
                         scale: float = 1.0) -> concurrent.futures.Future[None]:
        """Queues a sum all-reduce of ``tensor`` in place, the sum then multiplied by ``scale``;
        the future completes when it is done. Every rank must queue the same collectives in the
        same order (an arena tensor at the same arena offset on every rank)."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"the shared-memory channel reduces contiguous CPU tensors, got "
                             f"{tensor.device} "
                             f"{'contiguous' if tensor.is_contiguous() else 'strided'}")
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        offset = self.arena_offset(tensor)
        request = ("arena", offset, tensor, scale) if offset is not None else \
            ("reduce", tensor, scale)
        self._requests.put((request, future))
        return future

    def arena_offset(self, tensor: torch.Tensor) -> int | None:
        """Where ``tensor`` starts in this rank's arena, in bytes; None if it lies outside."""
        if not self._arenas:
            return None
        start = tensor.data_ptr() - self._arena_ptr
        end = start + tensor.numel() * tensor.element_size()
        return start if 0 <= start and end <= self.arena_bytes else None

    def arena_allocator(self) -> Callable[[int, torch.dtype], torch.Tensor | None]:
        """A function handing out zeroed tensors laid end to end (cache-line aligned) from the
        start of this rank's arena, or None once it is full. Each allocator starts afresh at
        the arena's start (a new gradient layout replaces the old one); ranks must allocate the
        same sizes in the same order, so a tensor sits at the same offset in every arena."""
        used = 0

        def allocate(numel: int, dtype: torch.dtype) -> torch.Tensor | None:
            nonlocal used
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            if not self._arenas or used + nbytes > self.arena_bytes:
                return None
            view = self._arenas[self.rank][used:used + nbytes].view(dtype)
            used += -(-nbytes // _ALIGN) * _ALIGN
            return view.zero_()

        return allocate

    def shared_region(self) -> torch.Tensor:
        """The host's shared region (``shared_bytes`` bytes, the same memory on every rank)."""
        if self._shared is None:
            raise ValueError("this shared-memory channel was opened without a shared region "
                             "(shared_bytes=0)")
        return self._shared

    def barrier_async(self) -> concurrent.futures.Future[None]:
        """Queues a barrier: it completes once every rank has queued it (after everything each
        queued before it). Writes a rank made to the shared region before queueing it are
        visible to every rank once it completes."""
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._requests.put((("barrier",), future))
        return future

    def quiesce(self) -> None:
        """Waits until every peer has finished reading this rank's arena (all collectives
        queued so far must be complete): after it, the arena tensors may be written again."""
        self._wait(self._read, self._seq, "finish reading this rank's arena")

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
        self._requests.put((("scatter", tensor, output), future))
        return future

    def all_gather_async(self, flat: torch.Tensor,
                         shard: torch.Tensor) -> concurrent.futures.Future[None]:
        """Queues an all-gather in place: every rank's ``shard`` (``flat``'s rank-th equal
        slice, or a tensor copied there first) lands in every rank's ``flat``, each rank's
        shard passing through its slot once."""
        for t in (flat, shard):
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("the shared-memory channel gathers contiguous CPU tensors")
        if flat.numel() != shard.numel() * self.world_size or flat.dtype != shard.dtype:
            raise ValueError(f"all_gather: {flat.numel()} x {flat.dtype} is not {self.world_size}"
                             f" shards of {shard.numel()} x {shard.dtype}")
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._requests.put((("gather", flat, shard), future))
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
            request, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                kind, *args = request
                if kind == "gather":
                    self._all_gather(*args)
                elif kind == "barrier":
                    self._barrier()
                elif kind == "arena":
                    self._reduce_arena(*args)
                elif kind == "reduce":
                    self._reduce(*args)
                else:
                    self._reduce_scatter(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(exc)
            else:
                future.set_result(None)

    def _reduce(self, tensor: torch.Tensor, scale: float = 1.0) -> None:
        flat = tensor.view(-1)
        per_chunk = self.slot_bytes // tensor.element_size()
        for start in range(0, flat.numel(), per_chunk):
            self._reduce_chunk(flat[start:start + per_chunk])
        if scale != 1.0:
            flat.mul_(scale)

    def _all_gather(self, flat: torch.Tensor, shard: torch.Tensor) -> None:
        flat, k = flat.view(-1), shard.numel()
        mine = flat[self.rank * k:(self.rank + 1) * k]
        if shard.data_ptr() != mine.data_ptr():
            mine.copy_(shard.view(-1))
        per_chunk = self.slot_bytes // flat.element_size()
        for start in range(0, k, per_chunk):
            n = min(per_chunk, k - start)
            self._seq += 1
            seq = self._seq
            self._wait(self._read, seq - 1, "finish reading the previous round")
            nbytes = n * flat.element_size()
            self._slots[self.rank][:nbytes].view(flat.dtype).copy_(mine[start:start + n])
            self._raise(self._written, seq)
            self._wait(self._written, seq, "write its shard")
            for r in range(self.world_size):
                if r != self.rank:
                    at = r * k + start
                    flat[at:at + n].copy_(self._slots[r][:nbytes].view(flat.dtype))
            self._raise(self._read, seq)

    def _barrier(self) -> None:
        self._seq += 1
        seq = self._seq
        self._raise(self._written, seq)
        self._wait(self._written, seq, "reach the barrier")
        # a round of its own: the next one waits for every rank's read flag to pass it
        self._raise(self._read, seq)

    def _reduce_arena(self, offset: int, tensor: torch.Tensor, scale: float) -> None:
        """All-reduce of a tensor in the arenas, without a copy into a slot: every rank sums its
        share from all arenas into its own (the same rank-order sum as ``_reduce_chunk``, so
        every rank gets bit-identical results), then copies the other shares from their
        owners' arenas. Peers read this rank's tensor until their ``read`` flag passes it."""
        self._seq += 1
        seq = self._seq
        numel, dtype = tensor.numel(), tensor.dtype
        nbytes = numel * tensor.element_size()
        views = [arena[offset:offset + nbytes].view(dtype) for arena in self._arenas]
        per = -(-numel // self.world_size)
        step = max(1, _ALIGN // tensor.element_size())
        per = -(-per // step) * step
        bounds = [(min(r * per, numel), min((r + 1) * per, numel))
                  for r in range(self.world_size)]
        self._raise(self._written, seq)
        self._wait(self._written, seq, "write its contribution")
        lo, hi = bounds[self.rank]
        if lo < hi:
            parts = [v[lo:hi] for v in views]
            mine = parts[self.rank]
            # in place where this rank's part is one of the first two summands; otherwise into
            # a scratch buffer, since the running sum would overwrite it before it is added
            target = mine if self.rank < 2 else torch.empty_like(mine)
            torch.add(parts[0], parts[1], out=target)
            for other in parts[2:]:
                target.add_(other)
            if scale != 1.0:
                target.mul_(scale)
            if target is not mine:
                mine.copy_(target)
        self._raise(self._reduced, seq)
        self._wait(self._reduced, seq, "sum its share")
        for r, (a, b) in enumerate(bounds):
            if r != self.rank and a < b:
                views[self.rank][a:b].copy_(views[r][a:b])
        self._raise(self._read, seq)

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
        self._raise(self._written, seq)
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
        self._raise(self._read, seq)

    def _raise(self, flags: np.ndarray, seq: int) -> None:
        """Sets this rank's flag of ``flags`` to ``seq`` and wakes the peers sleeping on it."""
        flags[self.rank] = seq
        if self._futex is not None:
            self._futex.wake(flags.ctypes.data + self.rank * flags.strides[0])

    def _wait(self, flags: np.ndarray, target: int, what: str) -> None:
        if (flags >= target).all():
            return
        deadline = time.monotonic() + self.timeout
        pause = 0.0
        while not (flags >= target).all():
            left = deadline - time.monotonic()
            if left < 0:
                missing = [r for r in range(self.world_size) if flags[r] < target]
                raise ShmTimeout(f"ranks {missing} did not {what} (shared-memory all-reduce "
                                 f"#{target}) within {self.timeout:g} s")
            if self._futex is not None:
                # asleep in the kernel until the first rank still behind raises its flag
                behind = int(np.argmin(flags >= target))
                seen = int(flags[behind])
                if seen < target:
                    self._futex.wait(flags.ctypes.data + behind * flags.strides[0], seen,
                                     min(left, _FUTEX_NAP))
                continue
            # Spin briefly, then back off: a waiting rank must not take the CPU from compute.
            time.sleep(pause)
            pause = min(pause * 2 or 2e-6, 2e-4)


_opened = 0


@overload
def open_channel(rank: Any, *, slot_bytes: int, timeout: float, arena_bytes: int = 0,
                 shared_bytes: int = 0, fallback: Literal[False] = False) -> ShmChannel: ...


@overload
def open_channel(rank: Any, *, slot_bytes: int, timeout: float, arena_bytes: int = 0,
                 shared_bytes: int = 0, fallback: bool) -> ShmChannel | None: ...


def open_channel(rank: Any, *, slot_bytes: int, timeout: float, arena_bytes: int = 0,
                 shared_bytes: int = 0, fallback: bool = False) -> ShmChannel | None:
    """Creates (local rank 0) or attaches (the others) the host's channel, agreeing on the file
    through the control plane, and unlinks it once everyone has it mapped, so nothing is left
    in /dev/shm even if the job crashes. With ``fallback``, a /dev/shm too small for it gives
    None on every rank of the host (local rank 0 finds out and tells the others through the
    same key), and the caller goes on without shared memory; otherwise ShmSpaceError."""
    global _opened
    env = rank.env
    # Numbered: an engine rebuilt in the same job opens a new channel under a fresh key (every
    # rank opens its channels in the same order).
    _opened += 1
    key = f"shm-channel-{env.node_rank}-{_opened}"
    if env.local_rank == 0:
        path = _SHM_DIR / f"flowtrain-{os.getpid()}-{os.urandom(6).hex()}"
        try:
            channel = ShmChannel(path, rank=env.local_rank, world_size=env.local_world_size,
                                 slot_bytes=slot_bytes, create=True, timeout=timeout,
                                 arena_bytes=arena_bytes, shared_bytes=shared_bytes)
        except ShmSpaceError as exc:
            if not fallback:
                raise
            log.warning("no room in shared memory; going on without it", reason=str(exc))
            rank.kv_set(key, "")  # "" tells the other ranks of the host
            return None
        rank.kv_set(key, str(path))
    else:
        told = rank.kv_get(key, timeout=timeout)
        if not told:
            return None
        path = Path(told)
        channel = ShmChannel(path, rank=env.local_rank, world_size=env.local_world_size,
                             slot_bytes=slot_bytes, create=False, timeout=timeout,
                             arena_bytes=arena_bytes, shared_bytes=shared_bytes)
    rank.barrier(f"{key}-mapped", timeout=timeout)
    if env.local_rank == 0:
        path.unlink(missing_ok=True)
    return channel


def data_channel(choice: str | None, rank: Any, *, world_size: int, model_parallel: bool,
                 module: torch.nn.Module, largest_bucket_bytes: int,
                 arena_bytes: int = 0) -> ShmChannel | None:
    """The shared-memory channel for a data-parallel engine when every rank is on this host and
    its model on the CPU (``choice`` "shm", or None for automatic); None means torch.distributed
    (gloo/NCCL) carries the reduces. ``rank`` is this process's flowtrain rank; ``arena_bytes``
    sizes each rank's arena (the gradient buckets' memory, reduced without a copy)."""
    on_cpu = all(p.device.type == "cpu" for p in module.parameters())
    # the shared-memory channel spans every rank of the job: one data-parallel group only
    single_host = rank.env.local_world_size == world_size and not model_parallel
    # automatic: a /dev/shm too small for the channel sends the reduces to torch.distributed
    automatic = choice is None
    if automatic:
        choice = "shm" if on_cpu and single_host and available() else "torch"
    if choice != "shm":
        return None
    if not (on_cpu and single_host):
        raise ValueError("flowtrain.data_channel 'shm' needs every rank on one host and the "
                         f"model on the CPU; world size {world_size}, ranks on this "
                         f"host {rank.env.local_world_size}, model on "
                         f"{next(module.parameters()).device}")
    return open_channel(rank, slot_bytes=min(largest_bucket_bytes, 64 * 2**20) + 64,
                        timeout=comm.DEFAULT_TIMEOUT, arena_bytes=arena_bytes,
                        fallback=automatic)
