"""build_optimizer tests: DeepSpeed's config mapping onto torch optimizers; Lion's update."""

from __future__ import annotations

import copy

import pytest
import torch

from cuda_numba.optim import FusedAdam
from flowtrain.optimizers import Lion, build_optimizer


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def train(model, opt, steps):
    torch.manual_seed(123)
    for _ in range(steps):
        x = torch.randn(16, 4)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def assert_same_training(type_name, cfg, reference_cls, reference_kwargs, steps):
    m1, m2 = make_model(), make_model()
    got_opt = build_optimizer(type_name, m1.parameters(), cfg)
    # Adam/AdamW without torch_adam (or amsgrad) run flowtrain's fused kernel, as DeepSpeed runs
    # its FusedAdam; the reference is still torch, so the numbers must agree.
    fused = type_name.lower() in ("adam", "adamw") and not cfg.get("torch_adam") \
        and not cfg.get("amsgrad")
    if fused:
        assert type(got_opt) is FusedAdam
        assert got_opt.defaults["adamw"] == (reference_cls is torch.optim.AdamW)
    else:
        assert type(got_opt) is reference_cls
    got = train(m1, got_opt, steps)
    want = train(m2, reference_cls(m2.parameters(), **reference_kwargs), steps)
    for g, w in zip(got, want):
        if fused:  # one fused pass rounds differently from torch's op-by-op float32 math
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(g, w)
    return got_opt


CASES = [
    # DeepSpeed "Adam": adam_w_mode defaults to True -> decoupled decay, FusedAdam's wd default 0.
    ("Adam", {"lr": 1e-3}, torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.0}),
    (
        "adam",
        {"lr": 2e-3, "weight_decay": 0.1, "betas": [0.8, 0.95], "eps": 1e-6},
        torch.optim.AdamW,
        {"lr": 2e-3, "weight_decay": 0.1, "betas": (0.8, 0.95), "eps": 1e-6},
    ),
    (
        "Adam",
        {"lr": 1e-3, "weight_decay": 0.1, "adam_w_mode": False},
        torch.optim.Adam,
        {"lr": 1e-3, "weight_decay": 0.1},
    ),
    (
        "ADAMW",
        {"lr": 1e-3, "weight_decay": 0.05, "adam_w_mode": False},
        torch.optim.AdamW,
        {"lr": 1e-3, "weight_decay": 0.05},
    ),
    ("AdamW", {"lr": 1e-3}, torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.0}),
    # torch_adam hands the params straight to torch, so torch's AdamW default decay (0.01) applies.
    ("Adam", {"lr": 1e-3, "torch_adam": True}, torch.optim.AdamW, {"lr": 1e-3}),
    (
        "Adam",
        {"lr": 1e-3, "torch_adam": True, "adam_w_mode": False, "amsgrad": True},
        torch.optim.Adam,
        {"lr": 1e-3, "amsgrad": True},
    ),
    (
        "Adam",
        {"lr": 1e-3, "bias_correction": True},
        torch.optim.AdamW,
        {"lr": 1e-3, "weight_decay": 0.0},
    ),
    (
        "SGD",
        {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4},
        torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4},
    ),
    ("sgd", {"lr": 0.1}, torch.optim.SGD, {"lr": 0.1}),
]


@pytest.mark.parametrize("steps", [1, 7])
@pytest.mark.parametrize("type_name,cfg,cls,kwargs", CASES)
def test_mapping_matches_torch(type_name, cfg, cls, kwargs, steps):
    assert_same_training(type_name, cfg, cls, kwargs, steps)


def test_adam_default_is_decoupled_weight_decay():
    opt = build_optimizer("Adam", make_model().parameters(), {"weight_decay": 0.1})
    assert isinstance(opt, FusedAdam) and opt.defaults["adamw"] is True
    assert opt.defaults["weight_decay"] == 0.1 and opt.defaults["betas"] == (0.9, 0.999)


def test_config_dict_not_mutated():
    cfg = {"lr": 1e-3, "torch_adam": True, "adam_w_mode": False}
    before = copy.deepcopy(cfg)
    build_optimizer("Adam", make_model().parameters(), cfg)
    assert cfg == before


def test_unknown_type():
    with pytest.raises(ValueError, match="'Adagradx'") as info:
        build_optimizer("Adagradx", make_model().parameters(), {})
    assert "Lion" in str(info.value)


@pytest.mark.parametrize("type_name", ["Adam", "SGD", "Lion"])
def test_unknown_param_names_it_and_valid_ones(type_name):
    with pytest.raises(ValueError, match="learning_rate") as info:
        build_optimizer(type_name, make_model().parameters(), {"learning_rate": 0.1})
    assert "'lr'" in str(info.value)


def test_max_grad_norm_points_to_gradient_clipping():
    with pytest.raises(ValueError, match="gradient_clipping") as info:
        build_optimizer("Adam", make_model().parameters(), {"lr": 1e-4, "max_grad_norm": 1.0})
    assert "max_grad_norm" in str(info.value)


def test_bias_correction_false_needs_the_fused_kernel():
    opt = build_optimizer("Adam", make_model().parameters(), {"bias_correction": False})
    assert isinstance(opt, FusedAdam) and opt.defaults["bias_correction"] is False
    with pytest.raises(ValueError, match="bias_correction"):
        build_optimizer("Adam", make_model().parameters(),
                        {"bias_correction": False, "torch_adam": True})


def reference_lion(params, grads_per_step, lr, betas, wd):
    """Lion written out per tensor, per element-wise formula, no foreach."""
    b1, b2 = betas
    params = [p.clone() for p in params]
    moms = [torch.zeros_like(p) for p in params]
    for grads in grads_per_step:
        for i, (p, g) in enumerate(zip(params, grads)):
            c = b1 * moms[i] + (1 - b1) * g
            params[i] = p * (1 - lr * wd) - lr * torch.sign(c)
            moms[i] = b2 * moms[i] + (1 - b2) * g
    return params


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("betas", [(0.9, 0.99), (0.95, 0.98)])
def test_lion_matches_reference_loop(wd, betas):
    torch.manual_seed(0)
    shapes = [(3, 4), (5,), (2, 2, 2)]
    init = [torch.randn(s) for s in shapes]
    grads_per_step = [[torch.randn(s) for s in shapes] for _ in range(10)]
    params = [torch.nn.Parameter(t.clone()) for t in init]
    opt = build_optimizer("lion", params, {"lr": 1e-2, "betas": list(betas), "weight_decay": wd})
    assert isinstance(opt, Lion)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    want = reference_lion(init, grads_per_step, 1e-2, betas, wd)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-6)


def test_lion_mixed_dtypes_skips_params_without_grad_and_round_trips_state():
    a = torch.nn.Parameter(torch.ones(4))
    b = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    c = torch.nn.Parameter(torch.ones(2))
    opt = Lion([a, b, c], lr=0.1)
    a.grad = torch.ones(4)
    b.grad = -torch.ones(4, dtype=torch.bfloat16)
    opt.step()
    assert torch.allclose(a, torch.full((4,), 0.9))
    assert torch.allclose(b.float(), torch.full((4,), 1.1), atol=1e-2)
    assert torch.equal(c, torch.ones(2)) and c not in opt.state
    opt2 = Lion([a, b, c], lr=0.1)
    opt2.load_state_dict(opt.state_dict())
    assert torch.equal(opt2.state[a]["exp_avg"], opt.state[a]["exp_avg"])


def test_lion_validation():
    with pytest.raises(ValueError, match="betas"):
        Lion([torch.nn.Parameter(torch.ones(1))], betas=(0.9, 1.0))
