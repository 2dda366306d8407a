"""Loss scaler tests: DeepSpeed's dynamic rules against an independent oracle, overflow checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowtrain.config.sections import FP16Config
from flowtrain.plan.spec import LossScalePolicy
from flowtrain.precision import DynamicLossScaler as _Dynamic
from flowtrain.precision import (
    LossScaleAtMinimum,
    StaticLossScaler,
    build_loss_scaler,
    has_inf_or_nan,
    unscale_,
)

# DeepSpeed's fp16 defaults, as the config schema holds them (their one definition)
_FP16 = FP16Config()
DEFAULTS = dict(initial_scale_power=_FP16.initial_scale_power,
                loss_scale_window=_FP16.loss_scale_window, hysteresis=_FP16.hysteresis,
                consecutive_hysteresis=_FP16.consecutive_hysteresis,
                min_loss_scale=_FP16.min_loss_scale)


def dynamic(**kw):
    """The scaler with the config's defaults for what ``kw`` leaves out."""
    return _Dynamic(**{**DEFAULTS, **kw})


def policy(**kw):
    """A LossScalePolicy with the config's defaults for what ``kw`` leaves out."""
    base = dict(static=_FP16.loss_scale, initial_power=_FP16.initial_scale_power,
                window=_FP16.loss_scale_window, hysteresis=_FP16.hysteresis,
                consecutive_hysteresis=_FP16.consecutive_hysteresis,
                min_scale=_FP16.min_loss_scale, auto_cast=False)
    return LossScalePolicy(**{**base, **kw})


def oracle(pattern, power, window, hyst, consecutive, min_scale):
    """The rules of the reference (section 2) restated step by step.

    Returns the scale after each update and the index at which DeepSpeed would raise (or None).
    Kept deliberately different in shape from the implementation: it tracks the length of the
    clean run since the last overflow instead of iteration numbers.
    """
    scale = 2.0**power
    budget = hyst
    clean_run = None  # None: no overflow seen yet, so the run started at iteration -1
    it = 0
    scales = []
    for i, overflow in enumerate(pattern):
        if overflow:
            if hyst == 1 or budget == 1:
                if scale == min_scale:
                    return scales, i
                scale = max(scale / 2, min_scale)
            else:
                budget -= 1
            clean_run = 0
        else:
            if consecutive:
                budget = hyst
            # stable interval = iterations since the last overflow, excluding this one
            stable = it if clean_run is None else clean_run
            if stable > 0 and stable % window == 0:
                if not consecutive:
                    budget = hyst
                scale *= 2
            clean_run = (it + 1) if clean_run is None else clean_run + 1
        it += 1
        scales.append(scale)
    return scales, None


def run_scaler(pattern, **kw):
    s = dynamic(**kw)
    scales = []
    for i, overflow in enumerate(pattern):
        try:
            s.update(bool(overflow))
        except LossScaleAtMinimum:
            return scales, i
        scales.append(s.loss_scale)
    return scales, None


def check(pattern, power=4, window=3, hyst=2, consecutive=False, min_scale=1.0):
    got = run_scaler(
        pattern,
        initial_scale_power=power,
        loss_scale_window=window,
        hysteresis=hyst,
        consecutive_hysteresis=consecutive,
        min_loss_scale=min_scale,
    )
    want = oracle(pattern, power, window, hyst, consecutive, min_scale)
    assert got == want
    return got


def test_hand_checked_power4_window2_hysteresis2():
    # Overflow at steps 3 and 4 (1-based): the first only spends hysteresis, the second halves;
    # two clean steps later (stable interval 2) the scale doubles back.
    pattern = [0, 0, 1, 1, 0, 0, 0, 0, 0, 0]
    scales, err = run_scaler(pattern, initial_scale_power=4, loss_scale_window=2, hysteresis=2)
    assert err is None
    assert scales == [16, 16, 16, 8, 8, 8, 16, 16, 32, 32]


def test_hand_checked_first_growth_after_window():
    # No overflow ever: stable interval at iteration i is i, so growth at i = 3, 6, 9.
    scales, _ = run_scaler([0] * 10, initial_scale_power=0, loss_scale_window=3, hysteresis=2)
    assert scales == [1, 1, 1, 2, 2, 2, 4, 4, 4, 8]


def test_hand_checked_hysteresis1_halves_every_overflow():
    scales, _ = run_scaler([1, 1, 0, 1], initial_scale_power=3, loss_scale_window=5, hysteresis=1)
    assert scales == [4, 2, 2, 1]


def test_hysteresis_not_refilled_between_isolated_overflows_without_consecutive():
    # hysteresis 2, long window: overflow, clean, overflow -> second one halves (budget spent).
    pattern = [1, 0, 1]
    assert run_scaler(pattern, initial_scale_power=4, loss_scale_window=100, hysteresis=2)[0] == [
        16,
        16,
        8,
    ]
    # With consecutive_hysteresis the clean step refills the budget, so no halving.
    assert run_scaler(
        pattern,
        initial_scale_power=4,
        loss_scale_window=100,
        hysteresis=2,
        consecutive_hysteresis=True,
    )[0] == [16, 16, 16]


@pytest.mark.parametrize("hyst", [1, 2])
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize(
    "pattern",
    [
        [0] * 12,
        [1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0],
        [0, 1, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0],
    ],
)
def test_scripted_patterns_match_oracle(pattern, hyst, consecutive):
    check(pattern, power=6, window=3, hyst=hyst, consecutive=consecutive)


def test_min_scale_reached_raises_exactly_when_deepspeed_would():
    # power 2 starts at 4: overflows take it to 2, then 1; the third overflow, at 1 == min, raises.
    scales, err = check([1, 1, 1, 1, 0], power=2, window=3, hyst=1, min_scale=1.0)
    assert scales == [2, 1] and err == 2
    # With hysteresis 2 the first overflow only spends budget, so the raise comes one later.
    scales, err = check([1, 1, 1, 1, 1], power=2, window=3, hyst=2, min_scale=1.0)
    assert scales == [4, 2, 1] and err == 3


def test_min_scale_not_power_of_two_is_clamped_then_raises():
    scales, err = check([1, 1, 1], power=3, window=3, hyst=1, min_scale=3.0)
    assert scales == [4, 3] and err == 2


def test_error_message_and_state_unchanged():
    s = dynamic(initial_scale_power=0, hysteresis=1, min_loss_scale=1.0)
    before = s.state_dict()
    with pytest.raises(LossScaleAtMinimum) as info:
        s.update(True)
    msg = str(info.value)
    assert "min_loss_scale=1" in msg and "bf16" in msg and "min_loss_scale" in msg
    assert isinstance(info.value, RuntimeError)
    assert s.state_dict() == before


@settings(max_examples=300, deadline=None)
@given(
    pattern=st.lists(st.booleans(), max_size=60),
    power=st.integers(0, 6),
    window=st.integers(1, 5),
    hyst=st.integers(1, 3),
    consecutive=st.booleans(),
    min_scale=st.sampled_from([1.0, 0.25, 2.0, 3.0]),
)
def test_random_patterns_match_oracle(pattern, power, window, hyst, consecutive, min_scale):
    if 2.0**power < min_scale:
        power = 2
    check(pattern, power, window, hyst, consecutive, min_scale)


@pytest.mark.parametrize("cut", [0, 3, 7, 11])
def test_state_dict_round_trip_continues_identically(cut):
    pattern = [0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]
    kw = dict(initial_scale_power=5, loss_scale_window=2, hysteresis=2)
    full = run_scaler(pattern, **kw)[0]

    first = dynamic(**kw)
    for o in pattern[:cut]:
        first.update(bool(o))
    # the config's defaults differ from kw on purpose: the state carries the scaler's settings
    resumed = dynamic()
    resumed.load_state_dict(first.state_dict())
    rest = []
    for o in pattern[cut:]:
        resumed.update(bool(o))
        rest.append(resumed.loss_scale)
    assert rest == full[cut:]


def test_static_and_noop_scalers():
    s = StaticLossScaler(128.0)
    s.update(True)
    assert s.loss_scale == 128.0 and not s.dynamic
    assert build_loss_scaler(policy(), enabled=False).loss_scale == 1.0
    assert build_loss_scaler(policy(static=64.0), enabled=True).loss_scale == 64.0
    d = build_loss_scaler(policy(initial_power=8, hysteresis=1), enabled=True)
    assert isinstance(d, _Dynamic) and d.loss_scale == 256.0 and d.hysteresis == 1
    loss = torch.tensor(2.0)
    assert s.scale_loss(loss).item() == 256.0


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(loss_scale_window=0),
        dict(min_loss_scale=0),
        dict(hysteresis=0),
        dict(initial_scale_power=1.5),
    ],
)
def test_invalid_dynamic_settings_name_the_key(kwargs):
    key = next(iter(kwargs))
    with pytest.raises(ValueError, match=key):
        dynamic(**kwargs)


def test_invalid_static_scale():
    with pytest.raises(ValueError, match="loss_scale"):
        build_loss_scaler(policy(static=-1.0), enabled=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_has_inf_or_nan_finds_bad_values(dtype, bad):
    finite = [torch.randn(5, 3).to(dtype), torch.randn(7).to(dtype)]
    assert not has_inf_or_nan(finite)
    poisoned = torch.randn(4, 4).to(dtype)
    poisoned[2, 1] = bad
    assert has_inf_or_nan(finite + [poisoned])
    assert has_inf_or_nan([poisoned] + finite)


def test_has_inf_or_nan_mixed_dtypes_empty_and_none():
    assert not has_inf_or_nan([])
    assert not has_inf_or_nan([None, torch.empty(0), torch.ones(2, dtype=torch.float16)])
    # Large finite fp16 values must not be reported (no overflow inside the check itself).
    assert not has_inf_or_nan([torch.full((1000,), 60000.0, dtype=torch.float16)])
    bad = torch.ones(3, dtype=torch.bfloat16)
    bad[0] = float("nan")
    assert has_inf_or_nan([torch.ones(3), bad, torch.arange(3)])


def test_has_inf_or_nan_syncs_once():
    calls = 0
    original = torch.Tensor.item

    def counting_item(self):
        nonlocal calls
        calls += 1
        return original(self)

    tensors = [
        torch.ones(3, dtype=dt) for dt in (torch.float32, torch.float16, torch.bfloat16)
    ] * 10
    torch.Tensor.item = counting_item
    try:
        has_inf_or_nan(tensors)
    finally:
        torch.Tensor.item = original
    assert calls == 1


def test_unscale_in_place():
    a = torch.full((3,), 8.0)
    b = torch.full((2, 2), 4.0, dtype=torch.float16)
    unscale_([a, None, b], 4.0)
    assert torch.equal(a, torch.full((3,), 2.0))
    assert torch.equal(b, torch.full((2, 2), 1.0, dtype=torch.float16))
    with pytest.raises(ValueError, match="scale"):
        unscale_([a], 0.0)
