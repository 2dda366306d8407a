"""ZeRO-Offload: the fp32 master shards and the optimizer state live in (pinned) CPU memory and
the CPU Adam kernel steps them, one bucket shard at a time, while the next shard's gradients
are still being copied down and the previous shard's updated parameters copied back up.

On a host without a GPU the model is already in CPU memory: nothing is copied, and the step
still runs shard by shard, exactly as it would with a GPU."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class OffloadedShards(Protocol):
    """What the offloader reads of a ZeroOptimizer (which imports this module: a Protocol,
    not the class): its optimizer over the fp32 master shards, the model's shards the updated
    values go back to (the same memory where ``aliased``), and whether each master keeps its
    ``.grad`` between steps."""

    optimizer: torch.optim.Optimizer | None
    master: list[torch.nn.Parameter]
    model_shards: list[torch.Tensor]
    aliased: bool
    _persistent_grads: bool


@dataclass(frozen=True)
class OffloadTarget:
    """Where a ZeroOptimizer keeps what it offloads (the spec's offload placement): the host
    ``device``, in pinned buffers when ``pin_memory`` (and the compute device is a GPU)."""

    device: torch.device
    pin_memory: bool


class Offloader:
    """Steps a ZeroOptimizer's master shards on the CPU (``offload_optimizer.device: cpu``)."""

    def __init__(self, target: OffloadTarget, compute_device: torch.device) -> None:
        self.device = target.device
        self.compute_device = compute_device
        self.cuda = compute_device.type == "cuda" and torch.cuda.is_available()
        self.pin = target.pin_memory and self.cuda
        self._grad_buffers: dict[int, torch.Tensor] = {}
        self._param_buffers: dict[int, torch.Tensor] = {}
        self._stream = torch.cuda.Stream(compute_device) if self.cuda else None

    def _buffer(self, cache: dict[int, torch.Tensor], b: int, like: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        buffer = cache.get(b)
        if buffer is None:
            buffer = torch.empty(like.numel(), dtype=dtype, device="cpu", pin_memory=self.pin)
            cache[b] = buffer
        return buffer

    def step(self, zero: OffloadedShards, sources: Sequence[torch.Tensor], coef: float) -> None:
        """Copies each gradient shard down (all launched at once on a side stream), then per
        shard: wait for its copy, unscale/clip, step it, copy the new parameters back."""
        optimizer = zero.optimizer
        assert optimizer is not None, "an offloaded ZeRO step needs the sharded optimizer"
        masters = zero.master
        if self._stream is not None:  # set on a CUDA device
            self._stream.wait_stream(torch.cuda.current_stream(self.compute_device))
        down: list[tuple[torch.Tensor, Any]] = []
        with _on(self._stream):
            for b, src in enumerate(sources):
                if src.device.type == "cpu":
                    down.append((src, None))
                    continue
                buffer = self._buffer(self._grad_buffers, b, src, src.dtype)
                buffer.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
                down.append((buffer, event))
        for b, (grad, event) in enumerate(down):
            if event is not None:
                event.synchronize()
            master = masters[b]
            if grad.dtype != torch.float32:
                grad = grad.float()  # the pinned fp32 copy (or the fp32 shard) is used as is
            if coef != 1.0:
                grad.mul_(coef)
            held = [m.grad for m in masters]
            for m in masters:
                m.grad = None
            master.grad = grad
            try:
                optimizer.step()
            finally:
                for m, g in zip(masters, held):
                    m.grad = g
            if not zero._persistent_grads:
                master.grad = None
            self._write_back(zero, b)
        if self._stream is not None:
            torch.cuda.current_stream(self.compute_device).wait_stream(self._stream)
            self._stream.synchronize()

    def _write_back(self, zero: OffloadedShards, b: int) -> None:
        if zero.aliased:
            return
        master, model = zero.master[b], zero.model_shards[b]
        with torch.no_grad():
            if model.device.type == "cpu":
                model.copy_(master.detach())
                return
            staging = self._buffer(self._param_buffers, b, model, model.dtype)
            staging.copy_(master.detach())
            with _on(self._stream):
                model.copy_(staging, non_blocking=True)

    def bytes(self, zero: OffloadedShards) -> int:
        """Bytes this rank keeps in CPU memory for the optimizer: master shards, their state,
        and the copy buffers."""
        def nbytes(ts: Any) -> int:
            return sum(t.numel() * t.element_size() for t in ts)

        held = zero.optimizer.state if zero.optimizer is not None else {}
        state = sum(int(v.numel() * v.element_size()) for m in zero.master
                    for v in held.get(m, {}).values() if torch.is_tensor(v))
        return nbytes(zero.master) + state + nbytes(self._grad_buffers.values()) + \
            nbytes(self._param_buffers.values())


class _on:
    """``torch.cuda.stream(s)``, or nothing without a stream."""

    def __init__(self, stream: Any) -> None:
        self._ctx = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self) -> None:
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
