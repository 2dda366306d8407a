"""flowtrain.zero.mirror, the pieces ZeRO-1/2 peer recovery is built from: a cloned optimizer
steps a copy of the parameters to the same bits as the original (the mirror's promise), its
hyper-parameters follow an LR scheduler's, the holders of each shard after losses, and the
state cut for one layout and taken for another."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cuda_numba.optim import FusedAdam, FusedLion, FusedSGD
from flowtrain.optimizers import Lion
from flowtrain.zero.mirror import (
    MASTER,
    ShardMirror,
    clone_optimizer,
    describe,
    holders,
    load_state,
    shard_state,
    take,
)
from flowtrain.zero.partition import shard_of

MAKERS = {
    "torch AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "torch SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    "flowtrain Lion": lambda ps: Lion(ps, lr=1e-3),
    "fused Adam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1),
    "fused Lion": lambda ps: FusedLion(ps, lr=1e-3),
    "fused SGD": lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9),
}


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (37, 64)]


@pytest.mark.parametrize("name", list(MAKERS))
def test_a_cloned_optimizer_steps_to_the_same_bits_and_follows_the_schedule(name: str) -> None:
    params = _params(0)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    original = MAKERS[name](params)
    clone = clone_optimizer(original, [copies])
    assert type(clone) is type(original) and clone.param_groups[0]["params"] == copies
    scheduler = torch.optim.lr_scheduler.StepLR(original, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        for p, c in zip(params, copies):
            p.grad = torch.randn(p.shape, generator=g)
            c.grad = p.grad.clone()
        original.step()
        ShardMirror.follow(SimpleNamespace(optimizer=clone), original)  # type: ignore[arg-type]
        clone.step()
        scheduler.step()
    assert clone.param_groups[0]["lr"] == original.param_groups[0]["lr"] != 1e-2
    for p, c in zip(params, copies):
        assert torch.equal(p, c)
        for key, value in original.state[p].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(clone.state[c][key]))


def test_a_stepped_optimizer_is_not_cloned() -> None:
    params = _params(0)
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    with pytest.raises(ValueError, match="stepped already"):
        clone_optimizer(opt, [params])


def test_each_shard_is_held_by_its_owner_or_the_rank_before_it() -> None:
    # layout [0, 1, 2, 3]; rank 2 lost: its shard is on rank 1 (its mirror)
    assert holders([0, 1, 2, 3], [0, 1, 3]) == [(0, False), (1, False), (1, True), (2, False)]
    # rank 0 lost: the last rank mirrors the first
    assert holders([0, 1, 2], [1, 2]) == [(1, True), (0, False), (1, False)]
    # a replacement (launch rank 2) entering: every shard from its owner
    assert holders([0, 1], [0, 1, 2]) == [(0, False), (1, False)]
    # ranks 1 and 2 lost together: shard 2's owner and mirror are both gone
    with pytest.raises(ValueError, match=r"shard 2 of 4 is lost: rank 2.*rank 1.*\[1, 2\]"):
        holders([0, 1, 2, 3], [0, 3])


def test_the_state_cut_for_three_ranks_is_taken_whole_for_two() -> None:
    """shard_state/describe/take/load_state round trip: a bucket of 10 elements cut for 3
    ranks (padded to 12), put back together, taken for 2 ranks, loaded into fresh optimizers:
    each new shard holds the old state's elements at the same offsets."""
    numel = 10
    torch.manual_seed(0)
    values = torch.randn(numel)
    old = []
    for k in range(3):
        s = shard_of(numel, 3, k)
        master = torch.nn.Parameter(torch.zeros(s.numel))
        hi = min(s.start + s.numel, numel)
        master.data[:hi - s.start] = values[s.start:hi]
        opt = torch.optim.AdamW([master], lr=0.1)
        master.grad = torch.ones(s.numel)
        opt.step()
        old.append((master, opt))
    described = describe(shard_state([old[0][0]], old[0][1]))[0]
    assert described[MASTER] == ("tensor", "float32")
    assert described["step"][0] == "value"
    whole: dict = {}
    for key, (kind, what) in described.items():
        if kind == "value":
            whole[key] = what
            continue
        full = torch.zeros(12)
        for k, (master, opt) in enumerate(old):
            s = shard_of(numel, 3, k)
            full[s.start:s.start + s.numel] = shard_state([master], opt)[0][key]
        whole[key] = full
    for k in range(2):
        s = shard_of(numel, 2, k)
        master = torch.nn.Parameter(torch.empty(s.numel))
        opt = torch.optim.AdamW([master], lr=0.1)
        load_state([master], opt, [take(whole, s, numel)], copy_masters=True)
        assert torch.equal(master.detach(), whole[MASTER][s.start:s.start + s.numel])
        state = opt.state[master]
        assert float(state["step"]) == 1.0
        assert torch.equal(state["exp_avg"], whole["exp_avg"][s.start:s.start + s.numel])
