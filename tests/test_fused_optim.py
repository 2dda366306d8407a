"""cuda_numba.optim optimizers against torch.optim over several params and steps, and their
state_dicts (own round trip, and loading a torch AdamW state)."""

import copy

import pytest
import torch

import cuda_numba as cn
from cuda_numba.optim import FusedAdam, FusedLion, FusedSGD

SHAPES = [(7,), (33, 5), (1,), (0,), (64, 3, 2)]


@pytest.fixture(scope="module", autouse=True)
def _warm():
    cn.warm_up()


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _run(opt, params, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize("adamw", [True, False])
def test_fused_adam_matches_torch(adamw):
    ours, ref = _params(), _params()
    hp = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05)
    _run(FusedAdam(ours, adamw=adamw, **hp), ours, 15)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    _run(cls(ref, foreach=False, **hp), ref, 15)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fused_adam_differs_from_wrong_variant():
    # The comparison above must be able to fail: Adam's L2 penalty is not AdamW's decay.
    ours, ref = _params(), _params()
    _run(FusedAdam(ours, lr=1e-2, weight_decay=0.5, adamw=False), ours, 5)
    _run(torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.5, foreach=False), ref, 5)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ours[1], ref[1], rtol=1e-5, atol=1e-6)


def test_fused_sgd_and_lion():
    ours, ref = _params(), _params()
    hp = dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True)
    _run(FusedSGD(ours, **hp), ours, 8)
    _run(torch.optim.SGD(ref, foreach=False, **hp), ref, 8)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    lion = _params()
    before = [p.detach().clone() for p in lion]
    _run(FusedLion(lion, lr=1e-3, weight_decay=0.0), lion, 1)
    for a, b in zip(lion, before):  # first Lion step moves every element by exactly +-lr
        if a.numel():
            torch.testing.assert_close((a - b).abs(), torch.full_like(a, 1e-3), rtol=1e-3,
                                       atol=0)


def test_state_dict_round_trip():
    params = _params()
    opt = FusedAdam(params, lr=1e-3, weight_decay=0.01)
    _run(opt, params, 3)
    sd = opt.state_dict()
    twin = _params()
    for a, b in zip(twin, params):
        a.data.copy_(b.data)
    opt2 = FusedAdam(twin, lr=1e-3, weight_decay=0.01)
    opt2.load_state_dict(copy.deepcopy(sd))  # load shares tensors otherwise
    _run(opt, params, 4, seed=9)
    _run(opt2, twin, 4, seed=9)
    for a, b in zip(params, twin):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert opt2.state[twin[0]]["step"].item() == 7


def test_loads_torch_adamw_state():
    ref = _params()
    topt = torch.optim.AdamW(ref, lr=2e-3, weight_decay=0.1, foreach=False)
    _run(topt, ref, 3)
    ours = _params()
    for a, b in zip(ours, ref):
        a.data.copy_(b.data)
    opt = FusedAdam(ours, lr=2e-3, weight_decay=0.1)
    opt.load_state_dict(copy.deepcopy(topt.state_dict()))
    assert opt.param_groups[0]["adamw"] is True
    _run(topt, ref, 5, seed=3)
    _run(opt, ours, 5, seed=3)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # and back: torch continues from our state
    topt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _run(topt, ref, 1, seed=4)
    _run(opt, ours, 1, seed=4)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
