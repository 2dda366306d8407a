"""Megatron-style tensor-parallel layers (Shoeybi et al. 2019, arXiv:1909.08053).

A column-parallel linear holds a slice of the output features; a row-parallel linear a slice of
the input features, and sums the partial products over the tensor-parallel group. An attention
block (qkv column-parallel, output projection row-parallel) or an MLP (up column, down row)
then needs one all-reduce in forward and one in backward. Parameters split across the group
carry ``param.tensor_parallel = True``; the rest are replicated.

A split parameter also says where its slice lies in the whole (unsplit) parameter, which
checkpoints need: ``param.tp_split_dim`` (the dimension split: 0 for a column-parallel weight
and bias and a vocab-parallel embedding, 1 for a row-parallel weight), ``param.tp_full_size``
(the whole parameter's size along it) and ``param.tp_ranges`` (``((start, length), ...)``: the
whole parameter's indices along that dimension this rank holds, in the order it holds them;
one range, except for a fused qkv projection, whose slice is a block of each of q, k and v)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def group_size(group: Any) -> int:
    """How many ranks the tensor-parallel ``group`` has (1 without a process group)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group: Any) -> int:
    """This rank's index in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


class _CopyToTP(torch.autograd.Function):
    """Identity forward; the gradient is summed over the group in backward (the input feeds
    every rank's slice)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        if group_size(ctx.group) > 1:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Sum over the group in forward (partial products); identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous()
        if group_size(group) > 1:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """Concatenate every rank's slice along the last dimension; backward keeps this rank's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        world = group_size(group)
        if world == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        world = group_size(ctx.group)
        if world == 1:
            return grad, None
        return grad.chunk(world, dim=-1)[group_rank(ctx.group)].contiguous(), None


class _ScatterToTP(torch.autograd.Function):
    """Keep this rank's slice of the last dimension; backward gathers the slices."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        world = group_size(group)
        if world == 1:
            return x
        return x.chunk(world, dim=-1)[group_rank(group)].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _GatherFromTP.apply(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _GatherFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _ScatterToTP.apply(x, group)


def divide_evenly(n: int, world: int, what: str) -> int:
    if n % world:
        raise ValueError(f"{what} {n} is not divisible by tensor_parallel.tp_size {world}")
    return n // world


def _mark(param: nn.Parameter, dim: int, full: int,
          ranges: tuple[tuple[int, int], ...]) -> nn.Parameter:
    """Marks ``param`` as this rank's slice of a whole parameter of size ``full`` along
    ``dim``: the whole's indices ``ranges`` ((start, length), ...) along it, in order."""
    if sum(length for _, length in ranges) != param.shape[dim]:
        raise ValueError(f"tensor-parallel ranges {ranges} do not add up to the slice's size "
                         f"{param.shape[dim]} along dimension {dim}")
    param.tensor_parallel = True  # type: ignore[attr-defined]
    param.tp_split_dim = dim  # type: ignore[attr-defined]
    param.tp_full_size = full  # type: ignore[attr-defined]
    param.tp_ranges = tuple((int(a), int(n)) for a, n in ranges)  # type: ignore[attr-defined]
    return param


def index_runs(indices: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """Whole-parameter indices, in the slice's order, as runs of consecutive ones:
    ((start, length), ...)."""
    out: list[list[int]] = []
    for i in indices.tolist():
        if out and out[-1][0] + out[-1][1] == i:
            out[-1][1] += 1
        else:
            out.append([i, 1])
    return tuple((a, n) for a, n in out)


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's output rows split over the group: this rank computes
    ``out_features / tp`` outputs (all of them with ``gather_output``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: Any = None, gather_output: bool = False, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__()
        self.group = group
        self.tp = group_size(group)
        self.in_features, self.out_features = in_features, out_features
        self.local_out = divide_evenly(out_features, self.tp, "out_features")
        self.gather_output = gather_output
        kw = {"device": device, "dtype": dtype}
        rows = ((group_rank(group) * self.local_out, self.local_out),)
        self.weight = _mark(nn.Parameter(torch.empty(self.local_out, in_features, **kw)), 0,
                            out_features, rows)
        self.bias = _mark(nn.Parameter(torch.zeros(self.local_out, **kw)), 0, out_features,
                          rows) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Any, *, gather_output: bool = False,
                    rows: torch.Tensor | None = None) -> ColumnParallelLinear:
        """This rank's slice of an existing (whole) linear layer; ``rows`` picks the output
        rows (e.g. whole heads of a fused qkv) instead of a contiguous block."""
        tp, rank = group_size(group), group_rank(group)
        out = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  group=group, gather_output=gather_output, device=linear.weight.device,
                  dtype=linear.weight.dtype)
        if rows is None:
            size = out.local_out
            rows = torch.arange(rank * size, (rank + 1) * size)
        with torch.no_grad():
            out.weight.copy_(linear.weight[rows])
            if linear.bias is not None and out.bias is not None:  # out has one when linear has
                out.bias.copy_(linear.bias[rows])
        for param, like in ((out.weight, linear.weight), (out.bias, linear.bias)):
            if param is not None:
                _mark(param, 0, linear.out_features, index_runs(rows))
                param.requires_grad_(like.requires_grad)  # a frozen layer stays frozen
        del tp
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tp(x, self.group), self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's input columns split over the group: each rank multiplies its
    slice of x (``input_is_parallel``, the output of a column-parallel layer) and the partial
    products are summed; the bias (replicated) is added once after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: Any = None, input_is_parallel: bool = True, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__()
        self.group = group
        self.tp = group_size(group)
        self.in_features, self.out_features = in_features, out_features
        self.local_in = divide_evenly(in_features, self.tp, "in_features")
        self.input_is_parallel = input_is_parallel
        kw = {"device": device, "dtype": dtype}
        self.weight = _mark(nn.Parameter(torch.empty(out_features, self.local_in, **kw)), 1,
                            in_features, ((group_rank(group) * self.local_in, self.local_in),))
        self.bias = nn.Parameter(torch.zeros(out_features, **kw)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Any) -> RowParallelLinear:
        rank = group_rank(group)
        out = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  group=group, device=linear.weight.device, dtype=linear.weight.dtype)
        size = out.local_in
        with torch.no_grad():
            out.weight.copy_(linear.weight[:, rank * size:(rank + 1) * size])
            if linear.bias is not None and out.bias is not None:  # out has one when linear has
                out.bias.copy_(linear.bias)
        out.weight.requires_grad_(linear.weight.requires_grad)
        if linear.bias is not None and out.bias is not None:
            out.bias.requires_grad_(linear.bias.requires_grad)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split over the group: each rank looks up
    the ids in its range, zeros the rest, and the group sums."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: Any = None,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.group = group
        self.tp = group_size(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.local = divide_evenly(num_embeddings, self.tp, "num_embeddings (vocabulary size)")
        self.start = group_rank(group) * self.local
        self.weight = _mark(nn.Parameter(torch.empty(self.local, embedding_dim, device=device,
                                                     dtype=dtype)), 0, num_embeddings,
                            ((self.start, self.local),))
        nn.init.normal_(self.weight)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group: Any) -> VocabParallelEmbedding:
        out = cls(emb.num_embeddings, emb.embedding_dim, group=group,
                  device=emb.weight.device, dtype=emb.weight.dtype)
        with torch.no_grad():
            out.weight.copy_(emb.weight[out.start:out.start + out.local])
        out.weight.requires_grad_(emb.weight.requires_grad)
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Any,
                start: int) -> torch.Tensor:
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        if group_size(group) > 1:
            dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        local = target - start
        inside = (local >= 0) & (local < logits.shape[-1])
        picked = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1))
        picked = picked.squeeze(-1).masked_fill(~inside, 0.0)
        if group_size(group) > 1:
            dist.all_reduce(total, group=group)
            dist.all_reduce(picked, group=group)
        loss = total.log() - picked
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, inside)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        softmax, local, inside = ctx.saved_tensors
        g = softmax.clone()
        rows = inside.nonzero(as_tuple=True)
        g[rows + (local[rows],)] -= 1.0
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Any,
                                 vocab_start: int | None = None,
                                 reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits whose last dimension is this rank's slice of the vocabulary
    (a column-parallel head without gather_output): no rank ever holds the whole logits."""
    if vocab_start is None:
        vocab_start = group_rank(group) * logits.shape[-1]
    loss = _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start)
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
