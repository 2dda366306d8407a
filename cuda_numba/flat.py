"""Runs of parameters that lie end to end in memory — parameter, gradient, optimizer state and
model copy alike — so that one kernel call steps a whole run (an engine bucket, a ZeRO shard);
and optimizer state laid out that way: one flat buffer per key and device, each parameter's
state a view into it, so a state_dict still holds one tensor per parameter as torch's does.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Run:
    """Parameters that follow each other in memory, with flat 1-D views spanning them all.

    ``tag`` is what every member shares and the kernel needs as one value (Adam's step count,
    SGD's first-momentum-step flag). Gradients are not held: a view of them is made at each
    step (``grad``), so gradients the user frees are not kept alive by the optimizer.
    """

    members: list[torch.Tensor]
    numel: int
    tag: Any
    param: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    model_out: torch.Tensor | None = None

    def grad(self) -> torch.Tensor | None:
        """The members' gradients as one flat view; None when they no longer lie end to end
        (the caller plans again)."""
        first = self.members[0].grad
        if first is None:
            return None
        if len(self.members) == 1:
            return first if first.is_contiguous() else first.contiguous()
        return flat_view(first, self.numel)


@dataclass
class GroupPlan:
    """The runs of one parameter group, valid while ``key`` (``layout_key``) is unchanged."""

    key: Hashable
    runs: list[Run]
    members: tuple[int, ...] = ()  # ids of the stepped parameters, in memory order
    steps: torch.Tensor | None = None  # every stepped parameter's step count, one flat tensor


def layout_key(params: Sequence[torch.Tensor]) -> Hashable:
    """What a plan depends on that can change between steps: which parameter objects, where
    their data and their gradients are (cheap enough to take every step)."""
    return tuple([(id(p), p.data_ptr(), -1 if p.grad is None else p.grad.data_ptr())
                  for p in params])


def flat_view(t: torch.Tensor, numel: int) -> torch.Tensor | None:
    """A 1-D view of ``numel`` elements of t's storage from t's first element on; None when
    the storage ends before that."""
    if numel == t.numel() and t.is_contiguous():
        return t.detach().view(-1)
    storage = t.untyped_storage()
    if (t.storage_offset() + numel) * t.element_size() > storage.nbytes():
        return None
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(),
                                                               (numel,), (1,))


def follows(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """True when b starts where a ends, in the same storage, same dtype and device, both
    contiguous (None follows only None)."""
    if a is None or b is None:
        return a is None and b is None
    return (a.dtype == b.dtype and a.device == b.device and a.is_contiguous()
            and b.is_contiguous()
            and b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def memory_order(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """params sorted by device then address, so parameters laid out flat come out in order."""
    return sorted(params, key=lambda p: (str(p.device), p.data_ptr()))


def flatten_state(state: Mapping[torch.Tensor, dict[str, Any]], params: Sequence[torch.Tensor],
                  keys: Sequence[str]) -> None:
    """Makes ``state[p][key]`` of every p in params (in this order) a view into one zeroed
    flat float32 buffer per key and device, keeping values already there. State that already
    lies that way is left alone, so this costs a copy only when the layout changes (the first
    step, a loaded state_dict, parameters re-homed)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in params:
        by_device.setdefault(p.device, []).append(p)
    for device, members in by_device.items():
        total = sum(p.numel() for p in members)
        for key in keys:
            old = [state[p].get(key) for p in members]
            if all(isinstance(t, torch.Tensor) and t.dtype == torch.float32
                   and t.device == device and t.shape == p.shape
                   for t, p in zip(old, members)) and \
                    all(follows(a, b) for a, b in zip(old, old[1:])) and \
                    (total == 0 or flat_view(_tensor(old[0]), total) is not None):
                continue
            flat = torch.zeros(total, dtype=torch.float32, device=device)
            offset = 0
            for p, t in zip(members, old):
                view = flat.narrow(0, offset, p.numel()).view(p.shape)
                if isinstance(t, torch.Tensor):
                    view.copy_(t)
                state[p][key] = view
                offset += p.numel()


def flatten_steps(state: Mapping[torch.Tensor, dict[str, Any]],
                  params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Makes ``state[p]["step"]`` (a float32 CPU scalar tensor, as torch keeps it) a view into
    one flat tensor, so a step adds 1 to all of them in one op; returns it and the counts."""
    old = [state[p].get("step") for p in params]
    if old and all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 0
                   and t.device.type == "cpu" for t in old) and \
            all(follows(a, b) for a, b in zip(old, old[1:])):
        steps = flat_view(_tensor(old[0]), len(old))
        if steps is not None:
            return steps, [int(c) for c in steps.tolist()]
    counts = [int(t.item() if isinstance(t, torch.Tensor) else (t or 0)) for t in old]
    steps = torch.tensor(counts, dtype=torch.float32)
    for i, p in enumerate(params):
        state[p]["step"] = steps[i]
    return steps, counts


def plan_runs(params: Sequence[torch.Tensor], state: Mapping[torch.Tensor, dict[str, Any]],
              keys: Sequence[str], tags: Sequence[Any],
              copies: Mapping[torch.Tensor, torch.Tensor]) -> list[Run]:
    """Splits params (in memory order, state already flat) into maximal runs whose parameters,
    gradients, state under ``keys`` and model copies all follow each other and whose tags are
    equal. A parameter that follows nothing is a run of its own: the per-parameter loop."""
    runs: list[Run] = []
    current: list[torch.Tensor] = []
    previous: torch.Tensor | None = None
    tag: Any = None

    def close() -> None:
        if current:
            runs.append(_make_run(current, state, keys, tag, copies))

    for p, t in zip(params, tags):
        if p.numel() == 0:
            continue
        joined = previous is not None and t == tag and follows(previous, p) and \
            follows(previous.grad, p.grad) and \
            follows(copies.get(previous), copies.get(p)) and \
            all(follows(state[previous][k], state[p][k]) for k in keys)
        if not joined:
            close()
            current, tag = [], t
        current.append(p)
        previous = p
    close()
    return runs


def _make_run(members: list[torch.Tensor], state: Mapping[torch.Tensor, dict[str, Any]],
              keys: Sequence[str], tag: Any, copies: Mapping[torch.Tensor, torch.Tensor]) -> Run:
    copy = copies.get(members[0])
    if len(members) == 1:  # the tensors themselves: no view to make
        p = members[0]
        return Run(members=[p], numel=p.numel(), tag=tag, param=p,
                   state={k: state[p][k] for k in keys}, model_out=copy)
    numel = sum(p.numel() for p in members)

    def view(t: torch.Tensor) -> torch.Tensor:
        v = flat_view(t, numel)
        if v is None:  # follows() checked the storage: it holds the whole run
            raise RuntimeError(f"a run of {len(members)} parameters ({numel} elements) does "
                               f"not fit the storage of its first tensor")
        return v

    return Run(members=list(members), numel=numel, tag=tag, param=view(members[0]),
               state={k: view(state[members[0]][k]) for k in keys},
               model_out=None if copy is None else view(copy))


def _tensor(t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(t).__name__}")
    return t
