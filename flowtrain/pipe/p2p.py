"""Point-to-point streams between pipeline stages: activations forward, gradients back, each a
header and its tensors on torch.distributed isend/irecv, received and sent by long-lived threads.

gloo's send and receive have no future to await, and a thread started per wait costs about a
millisecond a message; a hop to the event loop and back between instructions costs a few
hundred microseconds on a busy host. So each incoming stream (activations from the previous
stage, gradients from the next) has one long-lived receiver thread that waits blocking, with a
timeout on every wait, and hands each message over through a future the compute thread takes it
from; sends are posted by the compute thread and a long-lived sender thread waits on them (and
keeps their tensors alive). At the start of a schedule every receive it holds is queued, so a
message's receive is posted as soon as the one before it is in. A message is a header
(micro-batch, model chunk, then each tensor's dtype and shape) on one tag and its tensors on
another. A stream is one (peer, direction): with the interleaved schedule the last stage also
sends activations to the first and the first gradients to the last (a ring), so two stages
can hold two streams each way (p = 2), told apart by their tags; sends never wait for the
peer's compute and each stream's receives are queued in the order its sender sends, so the
ring cannot deadlock on the streams. Both
ends remember the stream's last shapes: the receiver posts the payload's receives with them at
once, next to the header's, so the payload does not wait for the header to arrive. When the
shapes change (a smaller last micro-batch, eval after train) the sender first sends
placeholders of the old shapes to fill those receives, then the tensors; the receiver reads the
new shapes from the header and receives them. A failure leaves the streams out of step, so the
stage refuses further schedules.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from flowtrain import comm

TAG_ACT, TAG_GRAD = 11, 12  # the headers of activations and of gradients
TAG_ACT_DATA, TAG_GRAD_DATA = 13, 14  # their tensors
HEADER = 64  # int64 slots: micro-batch, chunk (-1: none), count, then per tensor dtype
# code, ndim, dims
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]


Shapes = tuple[tuple[torch.dtype, tuple[int, ...]], ...]


class PipelineChannelError(RuntimeError):
    """A pipeline message could not be sent or received: the peer stage died, or the stages'
    schedules disagree. Names the message, its micro-batch and the peer stage."""



def _shapes(tensors: list[torch.Tensor]) -> Shapes:
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


def _encode(mb: int, shapes: Shapes, chunk: int | None = None) -> torch.Tensor:
    slots = [mb, -1 if chunk is None else chunk, len(shapes)]
    for dtype, dims in shapes:
        if dtype not in _DTYPES:
            raise ValueError(f"a pipeline stage cannot send a tensor of {dtype}; use one of "
                             f"{', '.join(str(d).removeprefix('torch.') for d in _DTYPES)}")
        slots += [_DTYPES.index(dtype), len(dims), *dims]
    if len(slots) > HEADER:
        raise ValueError(f"pipeline stage output too complex to send: {len(shapes)} tensors of "
                         f"up to {max(len(d) for _, d in shapes)} dimensions")
    return torch.tensor(slots + [0] * (HEADER - len(slots)), dtype=torch.int64)


def _decode(header: torch.Tensor) -> tuple[int, int | None, Shapes]:
    slots = header.tolist()
    mb, chunk, count, i = int(slots[0]), int(slots[1]), int(slots[2]), 3
    shapes = []
    for _ in range(count):
        code, ndim = int(slots[i]), int(slots[i + 1])
        shapes.append((_DTYPES[code], tuple(int(d) for d in slots[i + 2:i + 2 + ndim])))
        i += 2 + ndim
    return mb, None if chunk < 0 else chunk, tuple(shapes)


Future = concurrent.futures.Future


def _settle(future: Future[Any], value: Any, error: BaseException | None) -> None:
    if not future.set_running_or_notify_cancel():
        return  # the schedule failed and gave up on it
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class Receiver:
    """One incoming stream of a stage (activations from the previous stage, or gradients from
    the next) and its long-lived thread: it receives the stream's messages in order, each
    wait blocking with a timeout, and hands each message over through a future."""

    def __init__(self, group: Any, src: int, tags: tuple[int, int], device: torch.device,
                 timeout: float, name: str) -> None:
        self.group, self.src, self.tags = group, src, tags
        self.device, self.timeout = device, timeout
        self.shapes: Shapes | None = None  # of the stream's last message (its sender's too)
        self.failure: BaseException | None = None
        self.cancelled = 0  # queued receives of schedules up to this number are dropped
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def expect(self, run: int, mb: int, what: str,
               chunk: int | None = None) -> Future[list[torch.Tensor]]:
        """Queues the receive of micro-batch ``mb``'s message (for model chunk ``chunk``);
        the future gets its tensors."""
        future: Future[list[torch.Tensor]] = Future()
        self._jobs.put((run, (mb, chunk), what, future))
        return future

    def close(self) -> None:
        self._jobs.put(None)

    def join(self, timeout: float) -> bool:
        """Waits up to ``timeout`` s for the thread to end after ``close``; whether it did.
        A thread still inside a torch wait when the interpreter finalizes is ended mid C++
        frame, which aborts the process (``terminate called without an active exception``)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            run, key, what, future = job
            if run <= self.cancelled:
                continue
            value: list[torch.Tensor] | None = None
            error: BaseException | None = None
            if self.failure is not None:
                error = PipelineChannelError(f"{what}: not received, the stream failed before "
                                             f"({self.failure})")
            else:
                try:
                    value = self._receive(key, what)
                except BaseException as exc:  # noqa: BLE001 - handed to the schedule
                    self.failure = error = exc
            _settle(future, value, error)

    def _post(self, shapes: Shapes, tag: int, what: str) -> list[tuple[Any, torch.Tensor]]:
        out = []
        for dtype, dims in shapes:
            t = torch.empty(dims, dtype=dtype, device=self.device)
            try:
                out.append((dist.irecv(t, self.src, group=self.group, tag=tag), t))
            except RuntimeError as exc:
                raise PipelineChannelError(f"{what} could not be received: that stage may "
                                           f"have died ({exc})") from None
        return out

    def _wait(self, posted: list[tuple[Any, torch.Tensor]], what: str, deadline: float) -> None:
        for work, _ in posted:
            try:
                comm.wait_blocking(work, f"receive of {what}", deadline - time.monotonic())
            except comm.CollectiveTimeout:
                raise comm.CollectiveTimeout(f"{what} did not arrive within {self.timeout:g} s; "
                                             f"that stage may be stuck or dead") from None
            except RuntimeError as exc:
                raise PipelineChannelError(f"{what} could not be received: that stage may "
                                           f"have died ({exc})") from None

    def _receive(self, key: tuple[int, int | None], what: str) -> list[torch.Tensor]:
        deadline = time.monotonic() + self.timeout
        header_tag, data_tag = self.tags
        header = self._post(((torch.int64, (HEADER,)),), header_tag, what)
        # the tensors' receives go out with the header's, in the stream's last shapes
        posted = self._post(self.shapes or (), data_tag, what)
        self._wait(header, what, deadline)
        sent_mb, sent_chunk, shapes = _decode(header[0][1])
        if (sent_mb, sent_chunk) != key:
            came = f"micro-batch {sent_mb}" + \
                (f" (chunk {sent_chunk})" if sent_chunk is not None else "")
            raise PipelineChannelError(f"{what}: {came}'s message came instead; the stages' "
                                       f"schedules disagree")
        self._wait(posted, what, deadline)  # the tensors, or placeholders before new shapes
        if shapes != self.shapes:
            posted = self._post(shapes, data_tag, what)
            self._wait(posted, what, deadline)
            self.shapes = shapes
        return [t for _, t in posted]


class Sender:
    """A stage's outgoing messages. ``send`` (on the compute thread) only checks and queues
    them: gloo writes a send's bytes into the socket inside isend when the peer's receive is
    already posted (as the receiver threads see to), a few hundred microseconds for a few
    hundred KiB, so a long-lived thread posts them, in order, and another waits on them, each
    with a timeout, holding their tensors until they are out."""

    def __init__(self, group: Any, device: torch.device, timeout: float, name: str) -> None:
        self.group, self.device, self.timeout = group, device, timeout
        self.shapes: dict[tuple[int, int], Shapes] = {}  # (peer, header tag): last message's
        self.failure: BaseException | None = None
        self._posts: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._waits: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._post, name=name, daemon=True),
                         threading.Thread(target=self._wait, name=f"{name}-wait", daemon=True)]
        for thread in self._threads:
            thread.start()

    def send(self, tensors: tuple[torch.Tensor, ...], dst: int, tags: tuple[int, int], mb: int,
             what: str, chunk: int | None = None) -> None:
        if self.failure is not None:
            raise PipelineChannelError(f"{what}: not sent, an earlier send failed "
                                       f"({self.failure})")
        header_tag, data_tag = tags
        out = [t.contiguous() for t in tensors]
        shapes = _shapes(out)
        # on the stage's device, like every tensor it sends (NCCL moves device memory only)
        messages = [(_encode(mb, shapes, chunk).to(self.device), header_tag)]
        last = self.shapes.get((dst, header_tag))
        if last is not None and last != shapes:
            # fill the receives the peer posted in the old shapes, then the new tensors
            messages += [(torch.empty(dims, dtype=dtype, device=self.device), data_tag)
                         for dtype, dims in last]
        messages += [(t, data_tag) for t in out]
        self.shapes[(dst, header_tag)] = shapes
        self._posts.put((messages, dst, what, time.monotonic() + self.timeout))

    def drain(self) -> Future[None]:
        """A future done once every send queued so far is out (the first failure if not)."""
        future: Future[None] = Future()
        self._posts.put(future)
        return future

    def close(self) -> None:
        self._posts.put(None)

    def join(self, timeout: float) -> bool:
        """As ``Receiver.join``, for the posting and the waiting thread."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def _post(self) -> None:
        while (job := self._posts.get()) is not None:
            if isinstance(job, Future):
                self._waits.put(job)
                continue
            if self.failure is not None:
                continue
            messages, dst, what, deadline = job
            works = []
            try:
                for t, tag in messages:
                    works.append((dist.isend(t, dst, group=self.group, tag=tag), t))
            except RuntimeError as exc:
                self.failure = PipelineChannelError(f"{what} could not be sent: that stage "
                                                    f"may have died ({exc})")
            self._waits.put((works, what, deadline))
        self._waits.put(None)

    def _wait(self) -> None:
        while (job := self._waits.get()) is not None:
            if isinstance(job, Future):
                _settle(job, None, self.failure)
                continue
            if self.failure is not None:
                continue
            works, what, deadline = job
            try:
                for work, _ in works:
                    comm.wait_blocking(work, f"send of {what}", deadline - time.monotonic())
            except comm.CollectiveTimeout:
                self.failure = comm.CollectiveTimeout(
                    f"{what} was not taken within {self.timeout:g} s; that stage may be stuck "
                    f"or dead")
            except RuntimeError as exc:
                self.failure = PipelineChannelError(f"{what} could not be sent: that stage "
                                                    f"may have died ({exc})")
