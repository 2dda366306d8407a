"""A tied embedding's gradient reduced in two parts, so its bucket does not wait for the end of
backward.

A weight shared by the input embedding and the output head (GPT-2, OPT, BLOOM, T5, Gemma) gets
its head part first in backward and its embedding part last. Reduced as one gradient, its
bucket (often the largest: vocabulary x width) can only start once backward has ended, and
nothing is left to hide it behind. Here the embedding lookup's gradient is kept out of the
weight's autograd accumulation: the lookup is a ``RowsToSink`` node whose backward hands the
rows it would have scattered (token ids and their gradient rows) to a sink. The head part then
completes the weight's gradient early in backward and its bucket is all-reduced while the rest of
backward runs. After the reduces, the ranks exchange only the rows their tokens touched (at most
one per distinct token) and add their average into the reduced gradient, which gives the
gradient dense all-reduction gives, up to the order of the additions.

The row exchange moves ranks x distinct tokens x width numbers where the dense reduce moves
about 2 x vocabulary x width; when the first is larger (many ranks, long sequences, a small
vocabulary) the rows are all-reduced densely in chunks for that step and the split is switched
off from the next step on. Every rank decides from the same gathered counts, so all agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from flowtrain import comm
from flowtrain.log import get_logger

log = get_logger(__name__)

# the dense fallback's chunk of vocabulary rows: at most this many bytes of fp32 at once
_CHUNK_BYTES = 64 * 2**20


class RowsToSink(torch.autograd.Function):
    """An embedding lookup whose weight gradient goes to a sink instead of the weight."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, weight: torch.Tensor, indices: torch.Tensor,
                padding_idx: int | None, sink: Callable[[torch.Tensor, torch.Tensor], None]
                ) -> torch.Tensor:
        del anchor  # only there so that the output requires grad and backward runs
        ctx.indices, ctx.sink = indices, sink
        # weight arrives detached: no autograd edge to it, so its accumulation does not wait
        # for this node
        return F.embedding(indices, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        ctx.sink(ctx.indices, grad)
        return None, None, None, None, None


def tied_embeddings(model: torch.nn.Module) -> list[torch.nn.Embedding]:
    """The plain ``nn.Embedding`` modules of ``model`` whose weight is trainable and also a
    parameter of another module (a tied head). Subclasses are left alone (their forward may do
    more than the lookup), and so are lookups whose gradient is not a plain scatter (max_norm
    renormalises the weight, scale_grad_by_freq rescales rows, sparse gives a sparse grad)."""
    owners: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        owners[id(param)] = owners.get(id(param), 0) + 1
    found = []
    for module in model.modules():
        if type(module) is not torch.nn.Embedding:
            continue
        weight = module.weight
        if not weight.requires_grad or owners.get(id(weight), 0) < 2:
            continue
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            continue
        found.append(module)
    return found


@contextlib.contextmanager
def count_lookups(model: torch.nn.Module | None, params: dict[str, torch.nn.Parameter]
                  ) -> Iterator[dict[str, int]]:
    """Counts, while the block runs, the ids each of ``model``'s tied embeddings looks up, by
    the name ``params`` gives its weight (no model: counts nothing)."""
    names = {id(p): n for n, p in params.items()}
    counts: dict[str, int] = {}

    def count(module: torch.nn.Module, inputs: tuple[Any, ...], _: Any) -> None:
        name = names[id(module.weight)]
        counts[name] = counts.get(name, 0) + inputs[0].numel()

    hooks = [m.register_forward_hook(count) for m in
             (tied_embeddings(model) if model is not None else []) if id(m.weight) in names]
    try:
        yield counts
    finally:
        for hook in hooks:
            hook.remove()


class EmbeddingRows:
    """Splits the gradients of ``modules``' (tied) weights, see the module docstring.

    ``active`` is set by the engine around its own forward, so the model called outside the
    engine (evaluation, another loss) computes its lookups as usual. ``after_backward`` takes the
    rows one backward produced: added locally at once unless that backward reduces; those of a
    reducing backward wait for ``reduce`` (after the dense reduces have finished)."""

    def __init__(self, modules: list[torch.nn.Embedding], *, world_size: int, group: Any,
                 device: torch.device, channel: Any = None,
                 timeout: float = comm.DEFAULT_TIMEOUT) -> None:
        """``channel``: the engine's shared-memory data channel, which then carries the rows
        of CPU weights (else ``group``, over torch.distributed)."""
        self.modules = modules
        self.world_size = world_size
        self.group = group
        self.channel = channel
        self.timeout = timeout
        self.enabled = True
        self.active = False
        self._anchor = torch.zeros((), device=device, requires_grad=True)
        self._fresh: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._pending: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for index, module in enumerate(modules):
            module.forward = self._forward_for(index, module)  # type: ignore[method-assign, assignment]

    def _forward_for(self, index: int, module: torch.nn.Embedding
                     ) -> Callable[[torch.Tensor], torch.Tensor]:
        plain = module.forward

        def sink(indices: torch.Tensor, grad: torch.Tensor) -> None:
            self._fresh.setdefault(index, []).append((indices, grad))

        def forward(indices: torch.Tensor) -> torch.Tensor:
            if not (self.active and self.enabled and torch.is_grad_enabled()):
                return plain(indices)
            return RowsToSink.apply(self._anchor, module.weight.detach(), indices,
                                    module.padding_idx, sink)

        return forward

    def _rows(self, index: int, parts: list[tuple[torch.Tensor, torch.Tensor]]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's distinct token ids of one weight and the fp32 sum of their rows."""
        module = self.modules[index]
        width = module.weight.shape[1]
        ids = torch.cat([i.reshape(-1) for i, _ in parts])
        rows = torch.cat([g.reshape(-1, width) for _, g in parts])
        if module.padding_idx is not None:
            # the lookup's own backward gives the padding row no gradient
            keep = ids != module.padding_idx
            ids, rows = ids[keep], rows[keep]
        unique, where = torch.unique(ids, return_inverse=True)
        summed = torch.zeros(unique.numel(), width, dtype=torch.float32, device=rows.device)
        summed.index_add_(0, where, rows.float())
        return unique, summed

    def after_backward(self, reduces: bool) -> None:
        fresh, self._fresh = self._fresh, {}
        if reduces:
            for index, parts in fresh.items():
                self._pending.setdefault(index, []).extend(parts)
            return
        for index, parts in fresh.items():
            ids, rows = self._rows(index, parts)
            grad = self._grad(index)
            grad.index_add_(0, ids, rows.to(grad.dtype))

    def _grad(self, index: int) -> torch.Tensor:
        weight = self.modules[index].weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        return weight.grad

    def reduce(self) -> bool:
        """Adds the average over ranks of the rows kept since the last reduce into the (already
        all-reduced) gradients. Every rank calls it at the same point of the step. Returns
        whether the ranks exchanged anything (not once the split is off)."""
        pending, self._pending = self._pending, {}
        if not self.enabled and not pending:
            # switched off on every rank at the same step, so no rank has rows left: skip the
            # counts' all-gather, a synchronisation every later step would otherwise pay
            return False
        for index in range(len(self.modules)):
            # every rank takes part for every weight, with no rows if its tokens missed it
            self._reduce_one(index, pending.get(index, []))
        return True

    def _reduce_one(self, index: int, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        weight = self.modules[index].weight
        vocab, width = weight.shape
        device = weight.device
        if parts:
            ids, rows = self._rows(index, parts)
        else:
            ids = torch.zeros(0, dtype=torch.int64, device=device)
            rows = torch.zeros(0, width, dtype=torch.float32, device=device)
        count = torch.tensor([ids.numel()], dtype=torch.int64, device=device)
        counts = torch.zeros(self.world_size, dtype=torch.int64, device=device)
        self._all_gather(counts, count)
        sizes = counts.tolist()
        grad = self._grad(index)
        if sum(sizes) > vocab:
            # more rows than the weight has: a dense reduce moves fewer bytes
            self._reduce_dense(ids, rows, grad)
            if self.enabled:
                self.enabled = False
                log.info("tied embedding rows: the ranks' rows outnumber the vocabulary; "
                         "reducing the embedding gradient densely from now on",
                         rows=sum(sizes), vocab=vocab)
            return
        most = max(sizes)
        if most == 0:
            return
        # one message of int32: each row's token id, then the bits of its fp32 sum (copied as
        # integers, so no float path can touch them)
        payload = torch.zeros(most, width + 1, dtype=torch.int32, device=device)
        payload[:ids.numel(), 0] = ids.to(torch.int32)
        payload[:ids.numel(), 1:] = rows.view(torch.int32)
        gathered = torch.empty(self.world_size * most, width + 1, dtype=torch.int32,
                               device=device)
        self._all_gather(gathered, payload)
        per_rank = [gathered[r * most:r * most + n] for r, n in enumerate(sizes)]
        all_ids = torch.cat([p[:, 0] for p in per_rank]).long()
        union, where = torch.unique(all_ids, return_inverse=True)
        total = torch.zeros(union.numel(), width, dtype=torch.float32, device=device)
        start = 0
        # rank by rank, each rank's ids distinct: the same additions in the same order on every
        # rank, so the ranks' gradients stay bit-identical
        for part in per_rank:
            total.index_add_(0, where[start:start + part.shape[0]],
                             part[:, 1:].view(torch.float32))
            start += part.shape[0]
        total.mul_(1.0 / self.world_size)
        grad.index_add_(0, union, total.to(grad.dtype))

    def _reduce_dense(self, ids: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> None:
        vocab, width = grad.shape
        step = max(1, _CHUNK_BYTES // (4 * width))
        for lo in range(0, vocab, step):
            hi = min(vocab, lo + step)
            chunk = torch.zeros(hi - lo, width, dtype=torch.float32, device=grad.device)
            inside = (ids >= lo) & (ids < hi)
            chunk.index_add_(0, ids[inside] - lo, rows[inside])
            self._all_reduce(chunk)
            grad[lo:hi].add_(chunk.mul_(1.0 / self.world_size).to(grad.dtype))

    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        if self.channel is not None and out.device.type == "cpu":
            self.channel.all_gather_async(out, shard).result(timeout=self.timeout)
        else:
            comm.all_gather_into_tensor(out, shard, group=self.group, timeout=self.timeout)

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        if self.channel is not None and tensor.device.type == "cpu":
            self.channel.all_reduce_async(tensor).result(timeout=self.timeout)
        else:
            comm.all_reduce(tensor, group=self.group, timeout=self.timeout)

    def restore(self) -> None:
        """Gives the modules back their own forward."""
        for module in self.modules:
            module.__dict__.pop("forward", None)
