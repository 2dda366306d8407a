"""LR schedule tests: each schedule's per-step lr equals DeepSpeed's published closed form."""

from __future__ import annotations

import math

import pytest
import torch

from flowtrain.schedulers import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

STEPS = 50


def make_opt(lr=0.1, kind="sgd", groups=1):
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr)


def lr_sequence(opt, sched, steps=STEPS):
    """What a training loop sees: lr in the optimizer after each ``scheduler.step()``."""
    out = []
    for _ in range(steps):
        opt.step()
        sched.step()
        out.append([g["lr"] for g in opt.param_groups])
        assert sched.get_last_lr() == out[-1]
    return out


# --- closed forms, one function per schedule; i is the batch index (0 after the first step) ---


def warmup_frac(i, w, kind):
    w = max(2, w)
    if i >= w:
        return 1.0
    return math.log(i + 1) / math.log(w) if kind == "log" else i / w


def f_warmup(i, lo, hi, w, kind):
    return lo + (hi - lo) * warmup_frac(i, w, kind)


def f_warmup_decay(i, lo, hi, w, total, kind):
    w2 = max(2, w)
    if i < w2:
        return f_warmup(i, lo, hi, w, kind)
    return lo + (hi - lo) * max(0.0, (total - i) / max(1, total - w2))


def f_cosine(i, base, w, total, min_ratio, cos_min, kind):
    w2 = max(2, w)
    if i < w2:
        return base * (min_ratio + (1 - min_ratio) * warmup_frac(i, w, kind))
    p = min(1.0, (i - w2 + 1) / max(1, total - w2))
    return base * (cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * p)))


def f_onecycle_scale(i, up, down, stairs_up=0, stairs_down=0):
    total = up + down
    pos = (i + 1) % total
    if pos <= up:
        s = pos / up
        if stairs_up:
            s = math.floor(pos * stairs_up / up) / stairs_up
    else:
        s = (total - pos) / down
        if stairs_down:
            s = math.floor((total - pos) * stairs_down / down) / stairs_down
    return s


def f_onecycle(i, lo, hi, up, down, decay_rate=0.0, decay_size=0, stairs_up=0, stairs_down=0):
    total = up + down
    if i < total:
        return lo + (hi - lo) * f_onecycle_scale(i, up, down, stairs_up, stairs_down)
    if decay_size == 0 or decay_rate == 0:
        return lo
    return lo / (1 + decay_rate * (i - total + 1) / decay_size)


def f_range(i, lo, size, rate, staircase):
    interval = (i + 1) / size
    if staircase:
        interval = math.floor(interval)
    return lo * (1 + rate * interval)


def assert_seq(got, want):
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert g == pytest.approx(w, rel=1e-12, abs=1e-15), f"step {step}: {g} != {w}"


# --- sequences ---


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize(
    "lo,hi,w", [(0.0, 0.01, 10), (1e-4, 3e-3, 1), (0.001, 0.1, 40), (0.0, 1.0, 2)]
)
def test_warmup_lr(kind, lo, hi, w):
    opt = make_opt()
    sched = WarmupLR(opt, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=w, warmup_type=kind)
    assert opt.param_groups[0]["lr"] == lo  # construction writes the starting lr
    got = [x[0] for x in lr_sequence(opt, sched)]
    assert_seq(got, [f_warmup(i, lo, hi, w, kind) for i in range(STEPS)])


def test_warmup_lr_defaults_take_optimizer_lr_as_max():
    opt = make_opt(lr=0.05)
    sched = WarmupLR(opt)
    assert sched.max_lrs == [0.05] and sched.warmup_num_steps == 1000 and sched.warmup_type == "log"
    got = [x[0] for x in lr_sequence(opt, sched)]
    assert_seq(got, [f_warmup(i, 0.0, 0.05, 1000, "log") for i in range(STEPS)])


def test_warmup_lr_per_group_lists():
    opt = make_opt(groups=2)
    sched = WarmupLR(
        opt,
        warmup_min_lr=[0.0, 0.1],
        warmup_max_lr=[1.0, 0.2],
        warmup_num_steps=5,
        warmup_type="linear",
    )
    got = lr_sequence(opt, sched, 8)
    for i, (a, b) in enumerate(got):
        assert a == pytest.approx(f_warmup(i, 0.0, 1.0, 5, "linear"))
        assert b == pytest.approx(f_warmup(i, 0.1, 0.2, 5, "linear"))
    with pytest.raises(ValueError, match="warmup_min_lr"):
        WarmupLR(opt, warmup_min_lr=[0.0, 0.1, 0.2])


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize(
    "lo,hi,w,total", [(0.0, 0.01, 10, 40), (1e-4, 1e-3, 5, 60), (0.0, 0.1, 20, 20)]
)
def test_warmup_decay_lr(kind, lo, hi, w, total):
    opt = make_opt()
    sched = WarmupDecayLR(
        opt,
        total_num_steps=total,
        warmup_min_lr=lo,
        warmup_max_lr=hi,
        warmup_num_steps=w,
        warmup_type=kind,
    )
    got = [x[0] for x in lr_sequence(opt, sched)]
    assert_seq(got, [f_warmup_decay(i, lo, hi, w, total, kind) for i in range(STEPS)])
    if total < STEPS:
        assert got[-1] == pytest.approx(lo)  # past total_num_steps the lr sits at the floor


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize(
    "base,w,total,min_ratio,cos_min",
    [
        (0.1, 10, 40, 0.0, 0.0001),
        (3e-4, 5, 45, 0.1, 0.01),
        (1.0, 1, 30, 0.5, 0.2),
        (0.01, 30, 20, 0.0, 0.0),
    ],
)
def test_warmup_cosine_lr(kind, base, w, total, min_ratio, cos_min):
    opt = make_opt(lr=base)
    sched = WarmupCosineLR(
        opt,
        total_num_steps=total,
        warmup_min_ratio=min_ratio,
        warmup_num_steps=w,
        cos_min_ratio=cos_min,
        warmup_type=kind,
    )
    assert opt.param_groups[0]["lr"] == 0.0  # DeepSpeed starts at ratio 0 before the first step
    got = [x[0] for x in lr_sequence(opt, sched)]
    assert_seq(got, [f_cosine(i, base, w, total, min_ratio, cos_min, kind) for i in range(STEPS)])


@pytest.mark.parametrize(
    "kw,args",
    [
        (dict(cycle_first_step_size=10), (10, 10)),
        (
            dict(
                cycle_first_step_size=8,
                cycle_second_step_size=12,
                decay_lr_rate=0.5,
                decay_step_size=4,
            ),
            (8, 12),
        ),
        (
            dict(
                cycle_first_step_size=6,
                cycle_second_step_size=9,
                decay_lr_rate=0.1,
                decay_step_size=0,
            ),
            (6, 9),
        ),
        (
            dict(
                cycle_first_step_size=10,
                cycle_first_stair_count=5,
                cycle_second_stair_count=2,
                decay_lr_rate=1.0,
                decay_step_size=5,
            ),
            (10, 10),
        ),
        (
            dict(cycle_first_step_size=7, cycle_second_step_size=13, cycle_first_stair_count=3),
            (7, 13),
        ),
    ],
)
def test_one_cycle_lr(kw, args):
    lo, hi = 0.001, 0.01
    opt = make_opt()
    sched = OneCycle(opt, cycle_min_lr=lo, cycle_max_lr=hi, **kw)
    assert opt.param_groups[0]["lr"] == lo
    up, down = args
    stairs_up = kw.get("cycle_first_stair_count", 0)
    stairs_down = kw.get("cycle_second_stair_count", stairs_up)
    want = [
        f_onecycle(
            i,
            lo,
            hi,
            up,
            down,
            kw.get("decay_lr_rate", 0.0),
            kw.get("decay_step_size", 0),
            stairs_up,
            stairs_down,
        )
        for i in range(STEPS)
    ]
    assert_seq([x[0] for x in lr_sequence(opt, sched)], want)


def test_one_cycle_momentum_on_adam_betas():
    opt = make_opt(kind="adam")
    sched = OneCycle(
        opt,
        0.001,
        0.01,
        cycle_first_step_size=5,
        cycle_second_step_size=5,
        cycle_min_mom=0.85,
        cycle_max_mom=0.95,
        decay_mom_rate=0.01,
        decay_step_size=2,
    )
    assert opt.param_groups[0]["betas"] == (0.85, 0.99)
    for i in range(30):
        opt.step()
        sched.step()
        beta1, beta2 = opt.param_groups[0]["betas"]
        if i < 10:
            want = 0.95 - 0.1 * f_onecycle_scale(i, 5, 5)
        else:
            want = 0.95 * (1 + 0.01 * (i - 10 + 1) / 2)
        assert beta1 == pytest.approx(want) and beta2 == 0.99


def test_one_cycle_momentum_skipped_for_sgd():
    opt = make_opt()
    sched = OneCycle(opt, 0.001, 0.01, cycle_first_step_size=5)
    assert sched.cycle_momentum is False and sched.get_mom() is None
    sched.step()
    assert "betas" not in opt.param_groups[0]


@pytest.mark.parametrize(
    "lo,size,rate,staircase", [(1e-3, 10, 1.0, False), (1e-4, 7, 5.0, True), (0.01, 1, 0.5, False)]
)
def test_lr_range_test(lo, size, rate, staircase):
    opt = make_opt()
    sched = LRRangeTest(
        opt,
        lr_range_test_min_lr=lo,
        lr_range_test_step_size=size,
        lr_range_test_step_rate=rate,
        lr_range_test_staircase=staircase,
    )
    assert opt.param_groups[0]["lr"] == lo
    assert_seq(
        [x[0] for x in lr_sequence(opt, sched)],
        [f_range(i, lo, size, rate, staircase) for i in range(STEPS)],
    )


# --- resume ---

FACTORIES = {
    "WarmupLR": lambda o: WarmupLR(o, 0.0, 0.1, 10, "linear"),
    "WarmupDecayLR": lambda o: WarmupDecayLR(o, 40, 0.0, 0.1, 10),
    "WarmupCosineLR": lambda o: WarmupCosineLR(o, 40, 0.1, 10, 0.01),
    "OneCycle": lambda o: OneCycle(
        o,
        0.001,
        0.01,
        decay_lr_rate=0.2,
        cycle_first_step_size=8,
        decay_step_size=3,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
    ),
    "LRRangeTest": lambda o: LRRangeTest(o, 0.001, 5, 2.0, True),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("cut", [1, 13, 30])
def test_state_dict_round_trip_resumes_exactly(name, cut):
    make = FACTORIES[name]
    opt = make_opt(lr=0.1, kind="adam")
    full = lr_sequence(opt, make(opt))

    opt1 = make_opt(lr=0.1, kind="adam")
    s1 = make(opt1)
    lr_sequence(opt1, s1, cut)
    saved_sched, saved_opt = s1.state_dict(), opt1.state_dict()

    # A fresh process: optimizer rebuilt at the config lr, its state (with scheduled lr) loaded,
    # then the scheduler rebuilt and its state loaded.
    opt2 = make_opt(lr=0.1, kind="adam")
    opt2.load_state_dict(saved_opt)
    s2 = make(opt2)
    s2.load_state_dict(saved_sched)
    assert lr_sequence(opt2, s2, STEPS - cut) == full[cut:]


def test_deepspeed_shaped_state_dict_loads():
    opt = make_opt()
    sched = WarmupCosineLR(opt, 40, warmup_num_steps=10)
    sched.load_state_dict({"last_batch_iteration": 12})
    sched.step()
    assert sched.last_batch_iteration == 13
    with pytest.raises(ValueError, match="last_batch_iteration"):
        sched.load_state_dict({})


def test_get_last_lr_before_step_when_resuming():
    opt = make_opt()
    sched = WarmupLR(opt, 0.0, 0.1, 10, last_batch_iteration=5)
    with pytest.raises(RuntimeError, match="step"):
        sched.get_last_lr()


# --- factory and validation ---


def test_build_scheduler_matches_direct_construction():
    opt = make_opt()
    sched = build_scheduler(
        "WarmupDecayLR",
        opt,
        {
            "total_num_steps": 30,
            "warmup_max_lr": 0.02,
            "warmup_num_steps": 5,
            "warmup_type": "linear",
        },
    )
    assert isinstance(sched, WarmupDecayLR)
    got = [x[0] for x in lr_sequence(opt, sched, 30)]
    assert_seq(got, [f_warmup_decay(i, 0.0, 0.02, 5, 30, "linear") for i in range(30)])


def test_build_scheduler_errors():
    opt = make_opt()
    with pytest.raises(ValueError, match="WarmupCosineLR") as info:
        build_scheduler("warmuplr", opt, {})
    assert "'warmuplr'" in str(info.value)
    with pytest.raises(ValueError, match="warmup_steps") as info:
        build_scheduler("WarmupLR", opt, {"warmup_steps": 10})
    assert "warmup_num_steps" in str(info.value)
    with pytest.raises(ValueError, match="total_num_steps"):
        build_scheduler("WarmupCosineLR", opt, {})
    with pytest.raises(ValueError, match="cycle_max_lr"):
        build_scheduler("OneCycle", opt, {"cycle_min_lr": 0.1})


@pytest.mark.parametrize(
    "bad", [dict(warmup_num_steps=-1), dict(warmup_num_steps=2.5), dict(warmup_type="cosine")]
)
def test_warmup_validation(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        WarmupLR(make_opt(), **bad)


@pytest.mark.parametrize("steps", [0, 1])
def test_no_warmup_is_deepspeeds_two_steps(steps):
    """warmup_num_steps 0 (what a config's "auto" can resolve to) is accepted and, like 1, runs
    as DeepSpeed's shortest warmup of 2 steps: lr goes min, then log(2)/log(2) of the way."""
    ref, opt = make_opt(), make_opt()
    expected, got = WarmupLR(ref, 0.0, 0.1, warmup_num_steps=2), WarmupLR(opt, 0.0, 0.1, steps)
    for _ in range(4):
        assert got.get_lr() == expected.get_lr()
        got.step()
        expected.step()


def test_wrapped_optimizer_and_tensor_lr():
    class Wrapper:
        def __init__(self, inner):
            self.optimizer = inner

    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.1))
    lr_tensor = opt.param_groups[0]["lr"]
    sched = WarmupLR(Wrapper(opt), 0.0, 0.1, 4, "linear")
    sched.step()
    sched.step()
    assert opt.param_groups[0]["lr"] is lr_tensor  # updated in place
    assert lr_tensor.item() == pytest.approx(0.025)
    with pytest.raises(TypeError, match="Optimizer"):
        WarmupLR(object())
