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


# ---------------------------------------------------------------- flat layout

def _flat_params(seed=0):
    """Parameters and gradients laid out as the engine lays out a bucket: views of one flat
    buffer each, in order."""
    values = _params(seed)  # the same numbers as _params(seed), laid out flat
    total = sum(torch.Size(s).numel() for s in SHAPES)
    weights, grads = torch.empty(total), torch.zeros(total)
    params, off = [], 0
    for s, v in zip(SHAPES, values):
        n = torch.Size(s).numel()
        p = torch.nn.Parameter(weights.narrow(0, off, n).view(s))
        p.data.copy_(v.data)
        p.grad = grads.narrow(0, off, n).view(s)
        params.append(p)
        off += n
    return params


def _run_in_place(opt, params, steps, seed=1):
    # writes the new gradients into the existing (flat) grad tensors, as the engine's buckets
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad.copy_(torch.randn(p.shape, generator=gen))
        opt.step()


def _count_calls(monkeypatch, name):
    from cuda_numba import optim

    calls = []
    real = getattr(optim.ops, name)

    def spy(param, *args, **kwargs):
        calls.append(param.numel())
        return real(param, *args, **kwargs)

    monkeypatch.setattr(optim.ops, name, spy)
    return calls


@pytest.mark.parametrize("adamw", [True, False])
def test_flat_params_step_in_one_call_and_match_torch(adamw, monkeypatch):
    calls = _count_calls(monkeypatch, "adam_step")
    ours, ref = _flat_params(), _params()
    hp = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05)
    opt = FusedAdam(ours, adamw=adamw, **hp)
    _run_in_place(opt, ours, 6)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    _run(cls(ref, foreach=False, **hp), ref, 6)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    total = sum(p.numel() for p in ours)
    assert calls == [total] * 6  # one kernel call per step for the whole run
    # the state is one flat buffer per key, each parameter's a view; steps counted per param
    m = [opt.state[p]["exp_avg"] for p in ours]
    assert all(t.untyped_storage().data_ptr() == m[0].untyped_storage().data_ptr() for t in m)
    assert [opt.state[p]["step"].item() for p in ours] == [6.0] * len(ours)


def test_flat_sgd_and_lion_match_references(monkeypatch):
    calls = _count_calls(monkeypatch, "sgd_step")
    ours, ref = _flat_params(), _params()
    hp = dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)
    _run_in_place(FusedSGD(ours, **hp), ours, 5)
    _run(torch.optim.SGD(ref, foreach=False, **hp), ref, 5)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert len(calls) == 5
    # Lion: flat against the per-parameter path (checked against its formula above)
    flat, loose = _flat_params(), _params()
    _run_in_place(FusedLion(flat, lr=1e-3, weight_decay=0.1), flat, 4)
    _run(FusedLion(loose, lr=1e-3, weight_decay=0.1), loose, 4)
    for a, b in zip(flat, loose):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_runs_break_where_memory_does_not_follow(monkeypatch):
    """One gradient outside the flat buffer and a parameter without a gradient: still
    torch's numbers, in one call per run of parameters that do follow each other."""
    calls = _count_calls(monkeypatch, "adam_step")
    ours, ref = _flat_params(), _params()
    ours[1].grad = torch.zeros(SHAPES[1])  # its own memory: breaks the run
    ours.append(torch.nn.Parameter(torch.ones(4)))  # never gets a gradient
    ref.append(torch.nn.Parameter(torch.ones(4)))
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.1)
    _run_in_place(opt, ours[:-1], 4)
    _run(torch.optim.AdamW(ref[:-1], lr=1e-2, weight_decay=0.1, foreach=False), ref[:-1], 4)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ours[-1] not in opt.state
    # (7,) | (33, 5) | (1,) with the empty (0,) and then (64, 3, 2), which follow each other
    assert calls == [7, 165, 1 + 384] * 4


def test_fresh_gradients_every_step(monkeypatch):
    """A plain torch loop frees and re-allocates gradients every step: the plan follows them."""
    ours, ref = _flat_params(), _params()
    opt = FusedAdam(ours, lr=1e-2)
    tref = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.0, foreach=False)
    _run(opt, ours, 3)  # assigns new gradient tensors each step
    _run(tref, ref, 3)
    _run_in_place(opt, ours, 2, seed=7)
    _run(tref, ref, 2, seed=7)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flat_model_copies_written_in_the_same_call(dtype, monkeypatch):
    calls = _count_calls(monkeypatch, "adam_step")
    ours = _flat_params()
    total = sum(p.numel() for p in ours)
    model_flat = torch.zeros(total, dtype=dtype)
    copies, off = [], 0
    for p in ours:
        copies.append(model_flat.narrow(0, off, p.numel()).view(p.shape))
        off += p.numel()
    opt = FusedAdam(ours, lr=1e-2)
    opt.write_model_copies(zip(ours, copies))
    _run_in_place(opt, ours, 2)
    assert calls == [total, total]
    for p, c in zip(ours, copies):
        torch.testing.assert_close(c, p.detach().to(dtype), rtol=0, atol=0)


def test_flat_state_dict_both_ways_with_torch():
    """A flat-laid-out FusedAdam loads torch's AdamW state (per-parameter tensors) and torch
    loads ours; training goes on with the same numbers."""
    ref = _params()
    topt = torch.optim.AdamW(ref, lr=2e-3, weight_decay=0.1, foreach=False)
    _run(topt, ref, 3)
    ours = _flat_params()
    for a, b in zip(ours, ref):
        a.data.copy_(b.data)
    opt = FusedAdam(ours, lr=2e-3, weight_decay=0.1)
    opt.load_state_dict(copy.deepcopy(topt.state_dict()))
    _run(topt, ref, 3, seed=3)
    _run_in_place(opt, ours, 3, seed=3)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    sd = opt.state_dict()
    assert sorted(sd["state"][0]) == ["exp_avg", "exp_avg_sq", "step"]
    assert sd["state"][1]["exp_avg"].shape == SHAPES[1]
    assert sd["state"][1]["step"].item() == 6 and sd["state"][1]["step"].dim() == 0
    topt.load_state_dict(copy.deepcopy(sd))
    _run(topt, ref, 2, seed=4)
    _run_in_place(opt, ours, 2, seed=4)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [FusedAdam, FusedLion, FusedSGD])
def test_read_grads_from_steps_on_the_scaled_source(cls):
    """read_grads_from: for one step the optimizer reads each gradient from the same elements
    of a half-precision source times a factor, as if the fp32 gradients held
    source.float() * factor (what a mixed-precision engine's unscale pass wrote); including a
    run that crosses from one gradient buffer into the next. The next step reads .grad."""
    kwargs = {"momentum": 0.9} if cls is FusedSGD else {}
    ours, ref = _flat_params(), _flat_params()
    grads = ours[0].grad.untyped_storage()
    total = sum(p.numel() for p in ours)
    flat = torch.empty(0).set_(grads, 0, (total,))  # every parameter's grad: one run
    cut = SHAPES[0][0] + 33 * 5  # two "buffers" that lie end to end, the run crossing them
    buffers = [flat.narrow(0, 0, cut), flat.narrow(0, cut, total - cut)]
    opt, reference = cls(ours, lr=1e-2, **kwargs), cls(ref, lr=1e-2, **kwargs)
    gen = torch.Generator().manual_seed(5)
    factor = 1.0 / 512
    for _ in range(3):
        sources = [(torch.randn(b.numel(), generator=gen) * 512).half() for b in buffers]
        opt.read_grads_from(zip(buffers, sources), factor)
        opt.step()
        whole = torch.cat(sources).float() * factor
        off = 0
        for p in ref:
            p.grad.copy_(whole.narrow(0, off, p.numel()).view(p.shape))
            off += p.numel()
        reference.step()
        for a, b in zip(ours, ref):
            assert torch.equal(a, b)
    assert not flat.any()  # the optimizer never wrote the fp32 gradients
    flat.normal_(generator=gen)  # without read_grads_from the next step reads .grad again
    for a, b in zip(ours, ref):
        b.grad.copy_(a.grad)
    opt.step()
    reference.step()
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
