"""Data channels: torch.distributed set up for the rank (NCCL with CUDA, gloo otherwise) and
collectives launched with ``async_op=True`` that the event loop awaits without blocking."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from flowtrain import env as envnames
from flowtrain.log import get_logger
from flowtrain.netaddr import is_loopback

log = get_logger("flowtrain.comm")

DEFAULT_TIMEOUT = 600.0  # seconds; DeepSpeed's default process-group timeout is 10 minutes

# set in a replacement rank of `flowtrain launch --peer-recovery` (by its bootstrap):
# init_distributed joins the survivors' process group through it instead of forming the launch's
join_hook: Callable[[], None] | None = None


class CollectiveTimeout(TimeoutError):
    """A collective did not finish in time; names the operation, its size and its group."""


def default_backend() -> str:
    """``nccl`` when this process can use CUDA and NCCL, ``gloo`` otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0 and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def init_distributed(backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int | None = None, verbose: bool = True,
                     timeout: float | timedelta = DEFAULT_TIMEOUT,
                     init_method: str | None = "env://", dist_init_required: bool | None = None,
                     config: object = None, rank: int = -1, world_size: int = -1) -> str:
    """Initialises the default process group from the launcher's environment (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT); idempotent. Returns the backend in use. Takes
    deepspeed.comm.init_distributed's arguments (a timedelta timeout, distributed_port, rank,
    world_size; the MPI discovery flags mean nothing here)."""
    if dist.is_initialized():
        return str(dist.get_backend())
    if join_hook is not None:
        # a replacement for a lost rank (launch --peer-recovery): the survivors' group
        join_hook()
        return str(dist.get_backend())
    from flowtrain.slurm import apply as slurm_environment

    slurm_environment()  # a task of `srun python train.py`: its rank from SLURM, not rank 0 of 1
    if distributed_port is not None:
        os.environ.setdefault(envnames.MASTER_PORT, str(distributed_port))
    if rank >= 0:
        os.environ.setdefault(envnames.RANK, str(rank))
    if world_size > 0:
        os.environ.setdefault(envnames.WORLD_SIZE, str(world_size))
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    init_method = init_method or "env://"
    backend = backend or default_backend()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'nccl' needs CUDA, and torch.cuda.is_available() is False")
        torch.cuda.set_device(int(os.environ.get(envnames.LOCAL_RANK, "0")))
    if init_method == "env://":
        os.environ.setdefault(envnames.MASTER_ADDR, "127.0.0.1")
        os.environ.setdefault(envnames.RANK, "0")
        os.environ.setdefault(envnames.WORLD_SIZE, "1")
        if envnames.MASTER_PORT not in os.environ:
            if os.environ[envnames.WORLD_SIZE] != "1":
                raise RuntimeError("MASTER_PORT is not set; start the job with `flowtrain launch` "
                                   "or torchrun, or set MASTER_ADDR and MASTER_PORT")
            os.environ[envnames.MASTER_PORT] = str(_free_port())
    store = _loopback_store(timeout) if init_method == "env://" else None
    if store is not None:
        dist.init_process_group(backend=backend, store=store,
                                rank=int(os.environ[envnames.RANK]),
                                world_size=int(os.environ[envnames.WORLD_SIZE]),
                                timeout=timedelta(seconds=timeout))
    else:
        dist.init_process_group(backend=backend, init_method=init_method,
                                timeout=timedelta(seconds=timeout))
    log.debug("process group ready", backend=backend, world_size=dist.get_world_size())
    return backend


def _loopback_store(timeout: float) -> Any:
    """The process group's TCPStore when MASTER_ADDR is a loopback address (a single-node job),
    rank 0's server listening on that address only: torch's env:// store listens on every
    interface, which lets anyone on the network reach the job's rendezvous. Every rank makes
    its store here (rank 0 the server, the others clients), so all see the same keys. None for
    multi-node jobs, where env:// does what is needed."""
    import socket

    host = os.environ[envnames.MASTER_ADDR]
    if not is_loopback(host):
        return None
    port = int(os.environ[envnames.MASTER_PORT])
    world = int(os.environ[envnames.WORLD_SIZE])
    if os.environ[envnames.RANK] != "0":
        return dist.TCPStore(host, port, world, False, timedelta(seconds=timeout))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("localhost" if host == "localhost" else host.strip("[]"), port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"rank 0 cannot listen on MASTER_ADDR:MASTER_PORT {host}:{port} for "
                           f"the process group's store: {exc.strerror or exc}") from None
    # The store owns the descriptor from here on (detach: Python must not close it).
    return dist.TCPStore(host, port, world, True, timedelta(seconds=timeout),
                         master_listen_fd=sock.detach(), use_libuv=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- awaiting collectives from the loop ----------------------------------------------------------

_ids = itertools.count(1)
_pending: dict[int, str] = {}
_pending_since: dict[int, float] = {}  # time.monotonic() each pending wait began
_pending_lock = threading.Lock()


def pending() -> list[str]:
    """Collectives launched and not finished yet, oldest first (for heartbeats and reports)."""
    with _pending_lock:
        return [desc for _, desc in sorted(_pending.items())]


@contextlib.contextmanager
def waiting(description: str) -> Iterator[None]:
    """Lists ``description`` in ``pending()`` while the block waits on a transfer that does not
    go through ``wait`` (the shared-memory channel's reduces)."""
    key = next(_ids)
    with _pending_lock:
        _pending[key] = f"#{key} {description}"
        _pending_since[key] = time.monotonic()
    try:
        yield
    finally:
        with _pending_lock:
            _pending.pop(key, None)
            _pending_since.pop(key, None)


def waiting_s() -> float:
    """Seconds the oldest pending collective has been waited on (0 when none is)."""
    with _pending_lock:
        oldest = min(_pending_since.values(), default=None)
    return 0.0 if oldest is None else time.monotonic() - oldest


def _describe(op: str, tensors: Sequence[torch.Tensor], group: Any) -> str:
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    return f"{op} of {_human_bytes(nbytes)} over {size} ranks"


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


async def wait(work: dist.Work, description: str, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Awaits an ``async_op=True`` work handle without blocking the loop. The completion
    callback runs on the backend's thread and only hands the result over to the loop."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    with waiting(description):
        try:
            work.get_future().add_done_callback(lambda fut: _hand_over(fut.wait, loop, done))
        except RuntimeError:
            # Some backend/op pairs (gloo's reduce-scatter) have no future: a helper thread
            # waits on the work handle instead, so the loop still does not block.
            threading.Thread(target=_hand_over, args=(work.wait, loop, done), daemon=True,
                             name="flowtrain-collective-wait").start()
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout)
        except TimeoutError:
            raise CollectiveTimeout(f"{description} did not finish within {timeout:g} s; "
                                    f"a peer rank may be stuck or dead") from None


def wait_blocking(work: dist.Work, description: str, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Waits on a work handle on the calling thread, never the event loop's: for a long-lived
    helper thread that owns a stream of point-to-point operations (a pipeline stage's
    receiver), where ``wait`` would start a thread per call (gloo's send and receive have no
    future). Listed in ``pending()`` while it waits; raises ``CollectiveTimeout`` naming
    ``description`` after ``timeout`` seconds (gloo closes the connection to the peer then), and
    lets the backend's own error through otherwise (a peer that died: the connection closed)."""
    with waiting(description):
        try:
            finished = work.wait(timedelta(seconds=max(timeout, 0.001)))
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower():
                raise
            finished = False
        if finished is False:
            raise CollectiveTimeout(f"{description} did not finish within {timeout:g} s; a peer "
                                    f"rank may be stuck or dead")


def _hand_over(wait: Callable[[], Any], loop: asyncio.AbstractEventLoop,
               done: asyncio.Future[None]) -> None:
    """Runs on the backend's (or a helper) thread: waits, then passes the outcome to the loop."""
    error: BaseException | None = None
    try:
        wait()
    except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
        error = exc
    try:
        loop.call_soon_threadsafe(_finish, done, error)
    except RuntimeError:
        pass  # the loop has closed: nobody is waiting any more


def _finish(done: asyncio.Future[None], error: BaseException | None) -> None:
    if done.done():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)


# -- DeepSpeed's deepspeed.comm surface ----------------------------------------------------------
#
# The collectives under DeepSpeed's names run as deepspeed.comm's do, from the training
# thread: they block until done (waiting at most ``timeout`` seconds, then raising with what was
# pending) and return None, or the torch work handle with ``async_op=True``. They never guess
# from a running event loop that the caller meant to await them (a notebook runs one on the
# caller's thread): an actor's handler awaits the ``*_async`` forms below instead, which wait
# without blocking its loop.

ReduceOp = dist.ReduceOp


def _collective(op: str, launch: Callable[[], Any], tensors: Sequence[torch.Tensor],
                group: Any, async_op: bool, timeout: float, result: Any) -> Any:
    work = launch()
    if async_op:
        return work
    wait_blocking(work, _describe(op, tensors, group), timeout)
    return None


async def _awaited(op: str, launch: Callable[[], Any], tensors: Sequence[torch.Tensor],
                   group: Any, timeout: float, result: Any) -> Any:
    await wait(launch(), _describe(op, tensors, group), timeout)
    return result


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
               group: Any = None, async_op: bool = False, timeout: float = DEFAULT_TIMEOUT,
               **_: Any) -> Any:
    """In-place all-reduce of ``tensor`` across the group."""
    return _collective("all_reduce", lambda: dist.all_reduce(tensor, op=op, group=group,
                                                             async_op=True),
                       [tensor], group, async_op, timeout, tensor)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False,
              timeout: float = DEFAULT_TIMEOUT, **_: Any) -> Any:
    """In-place broadcast of ``tensor`` from global rank ``src``."""
    return _collective("broadcast", lambda: dist.broadcast(tensor, src=src, group=group,
                                                           async_op=True),
                       [tensor], group, async_op, timeout, tensor)


def reduce(tensor: torch.Tensor, dst: int, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
           group: Any = None, async_op: bool = False, timeout: float = DEFAULT_TIMEOUT,
           **_: Any) -> Any:
    """Reduces ``tensor`` into global rank ``dst``'s copy."""
    return _collective("reduce", lambda: dist.reduce(tensor, dst=dst, op=op, group=group,
                                                     async_op=True),
                       [tensor], group, async_op, timeout, tensor)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False, timeout: float = DEFAULT_TIMEOUT, **_: Any) -> Any:
    """Every rank's ``tensor`` into ``tensor_list`` (rank order)."""
    return _collective("all_gather", lambda: dist.all_gather(tensor_list, tensor, group=group,
                                                             async_op=True),
                       tensor_list, group, async_op, timeout, tensor_list)


# torch >= 2.13 names these all_gather_single / reduce_scatter_single and warns on the old
# names (FutureWarning); older releases only have the old ones.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into_tensor(output: torch.Tensor, shard: torch.Tensor, group: Any = None,
                           async_op: bool = False, timeout: float = DEFAULT_TIMEOUT,
                           **_: Any) -> Any:
    """Gathers every rank's equal-sized ``shard`` into ``output`` (rank order)."""
    return _collective("all_gather", lambda: all_gather_single(output, shard, group=group,
                                                               async_op=True),
                       [output], group, async_op, timeout, output)


def reduce_scatter_tensor(output: torch.Tensor, tensor: torch.Tensor,
                          op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, group: Any = None,
                          async_op: bool = False, timeout: float = DEFAULT_TIMEOUT,
                          **_: Any) -> Any:
    """Reduces ``tensor`` across the group and leaves this rank's slice in ``output``."""
    return _collective("reduce_scatter",
                       lambda: reduce_scatter_single(output, tensor, op=op, group=group,
                                                     async_op=True),
                       [tensor], group, async_op, timeout, output)


def barrier(group: Any = None, async_op: bool = False, timeout: float = DEFAULT_TIMEOUT,
            **_: Any) -> Any:
    """A data-channel barrier."""
    return _collective("barrier", lambda: dist.barrier(group=group, async_op=True), [],
                       group, async_op, timeout, None)


async def all_reduce_async(tensor: torch.Tensor,
                           op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, group: Any = None,
                           timeout: float = DEFAULT_TIMEOUT) -> torch.Tensor:
    """``all_reduce`` awaited on an event loop; returns the tensor."""
    return await _awaited("all_reduce", lambda: dist.all_reduce(tensor, op=op, group=group,
                                                                async_op=True),
                          [tensor], group, timeout, tensor)


async def broadcast_async(tensor: torch.Tensor, src: int, group: Any = None,
                          timeout: float = DEFAULT_TIMEOUT) -> torch.Tensor:
    """``broadcast`` awaited on an event loop; returns the tensor."""
    return await _awaited("broadcast", lambda: dist.broadcast(tensor, src=src, group=group,
                                                              async_op=True),
                          [tensor], group, timeout, tensor)


async def all_gather_into_tensor_async(output: torch.Tensor, shard: torch.Tensor,
                                       group: Any = None, timeout: float = DEFAULT_TIMEOUT
                                       ) -> torch.Tensor:
    """``all_gather_into_tensor`` awaited on an event loop; returns ``output``."""
    return await _awaited("all_gather", lambda: all_gather_single(output, shard, group=group,
                                                                  async_op=True),
                          [output], group, timeout, output)


async def reduce_scatter_tensor_async(output: torch.Tensor, tensor: torch.Tensor,
                                      op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                                      group: Any = None, timeout: float = DEFAULT_TIMEOUT
                                      ) -> torch.Tensor:
    """``reduce_scatter_tensor`` awaited on an event loop; returns ``output``."""
    return await _awaited("reduce_scatter",
                          lambda: reduce_scatter_single(output, tensor, op=op, group=group,
                                                        async_op=True),
                          [tensor], group, timeout, output)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (the whole job by default); 0 before initialisation,
    as deepspeed.comm answers on one process."""
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its node, from the launcher's LOCAL_RANK."""
    return int(os.environ.get(envnames.LOCAL_RANK, "0"))


def get_global_rank(group: Any, group_rank: int) -> int:
    return int(dist.get_global_rank(group, group_rank)) if group is not None else group_rank


def get_backend(group: Any = None) -> str:
    return str(dist.get_backend(group))


def new_group(ranks: Sequence[int] | None = None, **kwargs: Any) -> Any:
    return dist.new_group(ranks=list(ranks) if ranks is not None else None, **kwargs)


def destroy_process_group(group: Any = None) -> None:
    dist.destroy_process_group(group)
