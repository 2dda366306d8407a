"""fp16 and bf16 through the engine, in this process at world size 1: an overflowing step is
skipped exactly as DeepSpeed skips it, the dynamic loss scale follows DeepSpeed's rules step by
step (an oracle below), and half-precision training tracks fp32."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import engine_common as ec

MICRO, LR, SEED, STEPS = 4, 0.01, 1234, 20

pytestmark = pytest.mark.timeout(120)


def _engine(precision: dict[str, Any], scheduler: dict[str, Any] | None = None,
            **extra: Any) -> tuple[Any, nn.Module]:
    from flowtrain import initialize

    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": MICRO,
                           "optimizer": {"type": "Adam", "params": {"lr": LR}},
                           "gradient_clipping": 0.0, "steps_per_print": 1000, **precision,
                           **extra}
    if scheduler is not None:
        cfg["scheduler"] = scheduler
    model = ec.make_model(SEED)
    engine, _, _, _ = initialize(model=model, config=cfg)
    return engine, model


def _train_step(engine: Any, step: int, overflow: bool = False) -> float:
    dtype = next(engine.module.parameters()).dtype
    x, y = ec.micro_batch(step, 0, 0, MICRO)
    loss = nn.functional.mse_loss(engine(x.to(dtype)), y.to(dtype))
    value = float(loss.detach())
    if overflow:  # every gradient becomes inf/NaN
        loss = loss * float("inf")
    engine.backward(loss)
    engine.step()
    return value


def _snapshot(engine: Any) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in engine.module.parameters()]
    if engine.master is not None:
        tensors += [m.detach().clone() for m in engine.master.master]
    return tensors


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def ds_loss_scale_oracle(pattern: list[bool], *, initial_scale_power: int, window: int,
                         hysteresis: int, consecutive: bool = False,
                         min_scale: float = 1.0) -> list[float]:
    """DeepSpeed DynamicLossScaler.update_scale, applied once per optimizer step; the scale
    after each step."""
    scale, cur_h, last_overflow, it = 2.0 ** initial_scale_power, hysteresis, -1, 0
    out = []
    for overflow in pattern:
        if overflow:
            if hysteresis == 1 or cur_h == 1:
                assert scale != min_scale
                scale = max(scale / 2, min_scale)
            else:
                cur_h -= 1
            last_overflow = it
        else:
            if consecutive:
                cur_h = hysteresis
            stable = it - last_overflow - 1
            if stable > 0 and stable % window == 0:
                if not consecutive:
                    cur_h = hysteresis
                scale *= 2
        it += 1
        out.append(scale)
    return out


def test_oracle_itself() -> None:
    # window 2, hysteresis 2: first overflow only spends hysteresis, the second halves
    assert ds_loss_scale_oracle([False, False, False, True, True, False, False, False],
                                initial_scale_power=4, window=2, hysteresis=2) == \
        [16, 16, 32, 32, 16, 16, 16, 32]


def test_fp16_overflow_skips_the_step(module_world1: Any) -> None:
    fp16 = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8,
                     "hysteresis": 1, "loss_scale_window": 1000, "min_loss_scale": 1}}
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": LR,
                                            "warmup_num_steps": 10, "warmup_type": "linear"}}
    engine, model = _engine(fp16, sched)
    assert next(model.parameters()).dtype == torch.float16
    assert engine.loss_scale == 256.0
    for step in range(3):
        _train_step(engine, step)
    assert (engine.global_steps, engine.skipped_steps, engine.loss_scale) == (3, 0, 256.0)

    before = _snapshot(engine)
    lr_before = engine.get_lr()[0]
    sched_iter = engine.lr_scheduler.last_batch_iteration
    _train_step(engine, 3, overflow=True)
    assert engine.loss_scale == 128.0  # hysteresis 1: halved at once
    assert engine.skipped_steps == 1
    assert engine.global_steps == 4
    assert _same(_snapshot(engine), before), "weights changed on a skipped step"
    assert engine.get_lr()[0] == lr_before
    assert engine.lr_scheduler.last_batch_iteration == sched_iter, "scheduler stepped on a skip"
    assert engine.get_global_grad_norm() is None

    # the next step trains again from clean gradients; the scheduler resumes where it stopped
    _train_step(engine, 4)
    assert engine.skipped_steps == 1 and engine.global_steps == 5
    assert not _same(_snapshot(engine), before)
    assert all(torch.isfinite(t).all() for t in _snapshot(engine))
    assert engine.lr_scheduler.last_batch_iteration == sched_iter + 1
    assert engine.get_lr()[0] == pytest.approx(0.001 + (LR - 0.001) * (sched_iter + 1) / 10)
    assert engine.loss_scale == 128.0


PATTERN = [False, True, False, False, False, False, True, True, False, False, False, False,
           False, False, False, True, True, True, False, False, False, True, False, False]


@pytest.mark.parametrize("hysteresis,consecutive", [(1, False), (2, False), (3, True)])
def test_fp16_loss_scale_sequence_follows_deepspeed(module_world1: Any, hysteresis: int,
                                                    consecutive: bool) -> None:
    fp16 = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 6,
                     "hysteresis": hysteresis, "consecutive_hysteresis": consecutive,
                     "loss_scale_window": 3, "min_loss_scale": 1}}
    engine, _ = _engine(fp16)
    expected = ds_loss_scale_oracle(PATTERN, initial_scale_power=6, window=3,
                                    hysteresis=hysteresis, consecutive=consecutive)
    scales = []
    for step, overflow in enumerate(PATTERN):
        before = _snapshot(engine)
        _train_step(engine, step, overflow=overflow)
        scales.append(engine.loss_scale)
        if overflow:
            assert _same(_snapshot(engine), before), f"step {step + 1}: weights changed"
    assert scales == expected
    assert engine.skipped_steps == sum(PATTERN)
    assert engine.global_steps == len(PATTERN)


def _losses(engine: Any) -> list[float]:
    return [_train_step(engine, step) for step in range(STEPS)]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_tracks_fp32(module_world1: Any, precision: str) -> None:
    section = {precision: {"enabled": True}}
    if precision == "fp16":
        section["fp16"].update(loss_scale=0, initial_scale_power=10)
    engine, model = _engine(section)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    assert next(model.parameters()).dtype == dtype
    assert all(m.dtype == torch.float32 for m in engine.master.master)
    losses = _losses(engine)
    assert engine.skipped_steps == 0
    ref = ec.plain_reference(steps=STEPS, world=1, gas=1, micro=MICRO, lr=LR, clip=0.0,
                             seed=SEED)["losses"]
    tol = 0.02 if precision == "fp16" else 0.06
    for i, (a, e) in enumerate(zip(losses, ref)):
        assert a == pytest.approx(e, rel=0.1, abs=tol), f"step {i + 1}: {a} vs fp32 {e}"
    assert sum(losses[-5:]) < sum(losses[:5])
    if precision == "bf16":
        assert engine.loss_scale == 1.0


@pytest.mark.parametrize("precision", [{"bf16": {"enabled": True}},
                                       {"fp16": {"enabled": True}}])
def test_fused_adam_writes_the_half_model_copy_in_its_pass(module_world1: Any,
                                                           precision: dict[str, Any]) -> None:
    from cuda_numba.optim import FusedAdam

    engine, model = _engine(precision)
    assert isinstance(engine.optimizer, FusedAdam) and engine.master.fused_copy
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(3):
        _train_step(engine, step)
    names = [n for n, _ in model.named_parameters()]
    for name, p, m, b in zip(names, model.parameters(), engine.master.master, before):
        assert torch.equal(p.detach(), m.detach().to(p.dtype))  # the model is the rounded master
        # ... and it moved, except the layer the model never uses
        assert torch.equal(p.detach(), b) == name.startswith("unused."), name


@pytest.mark.parametrize("precision", [{}, {"bf16": {"enabled": True}},
                                       {"fp16": {"enabled": True, "initial_scale_power": 10}}])
def test_the_optimizer_steps_each_bucket_in_one_kernel_call(
        module_world1: Any, precision: dict[str, Any], monkeypatch: Any) -> None:
    """The engine lays parameters (and fp32 master weights) out flat in the buckets' layout, so
    FusedAdam finds one run per bucket: one kernel call each, model copy included."""
    from cuda_numba import optim

    engine, model = _engine(precision)
    calls: list[int] = []
    real = optim.ops.adam_step

    def spy(param: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        calls.append(param.numel())
        real(param, *args, **kwargs)

    monkeypatch.setattr(optim.ops, "adam_step", spy)
    for step in range(2):
        _train_step(engine, step)
    sizes = [b.numel for b in engine.plan.buckets]
    assert calls == sizes * 2
    stepped = engine.master.master if engine.master is not None else list(model.parameters())
    for bucket in engine.plan.buckets:  # every parameter of a bucket in one storage
        ptrs = {stepped[s.index].untyped_storage().data_ptr() for s in bucket.slots}
        ptrs |= {engine.trainable[s.index].untyped_storage().data_ptr() + 1 for s in bucket.slots}
        assert len(ptrs) == 2


def _clipped_run(monkeypatch: Any, folded: bool, precision: dict[str, Any],
                 **extra: Any) -> tuple[list[float], list[float], Any]:
    """STEPS clipped steps: (losses, grad norms, engine), through the fused optimizers'
    read_grads_from (``folded``) or, with it removed, the explicit path (unscale pass, norm,
    clip pass, step)."""
    from cuda_numba import optim

    with monkeypatch.context() as m:
        if not folded:
            m.delattr(optim._Fused, "read_grads_from")
        engine, _ = _engine(precision, gradient_clipping=0.05, steps_per_print=1, **extra)
        losses, norms = [], []
        for step in range(STEPS):
            losses.append(_train_step(engine, step))
            norms.append(engine.get_global_grad_norm())
        return losses, norms, engine


@pytest.mark.parametrize("precision", [{"bf16": {"enabled": True}},
                                       {"fp16": {"enabled": True, "initial_scale_power": 10}}])
def test_the_folded_step_equals_unscaling_then_clipping_then_stepping(
        module_world1: Any, precision: dict[str, Any], monkeypatch: Any) -> None:
    """With a fused optimizer the engine hands it the reduced half-precision buckets and one
    factor (1/loss scale x the clipping coefficient) instead of writing, then scaling, fp32
    gradients: the same training to rounding, and the fp32 gradient buffers never written."""
    folded, folded_norms, engine = _clipped_run(monkeypatch, True, precision)
    plain, plain_norms, reference = _clipped_run(monkeypatch, False, precision)
    assert engine.skipped_steps == reference.skipped_steps == 0
    assert folded == pytest.approx(plain, rel=1e-4, abs=1e-6)
    assert folded_norms == pytest.approx(plain_norms, rel=1e-5)
    assert max(plain_norms) > 0.05  # the clipping acted
    for m, r in zip(engine.master.master, reference.master.master):
        torch.testing.assert_close(m, r, rtol=1e-4, atol=1e-6)
    assert all(not f.any() for f in engine.master.flat)  # never written
    assert any(f.any() for f in reference.master.flat)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", [{}, {"bf16": {"enabled": True}},
                                       {"fp16": {"enabled": True, "initial_scale_power": 10}}])
def test_zero_folds_the_unscale_and_clipping_into_the_fused_step(
        module_world1: Any, precision: dict[str, Any], stage: int, monkeypatch: Any) -> None:
    """ZeRO's step hands a fused optimizer its reduced shards and the unscale x clip factor
    (fp32 stage 1 included, whose gradients are the buckets themselves) instead of scaling
    fp32 gradients first: the same training as the explicit path, to rounding."""
    zero = {"zero_optimization": {"stage": stage}}
    folded, folded_norms, engine = _clipped_run(monkeypatch, True, precision, **zero)
    plain, plain_norms, reference = _clipped_run(monkeypatch, False, precision, **zero)
    assert engine.zero is not None and engine.skipped_steps == reference.skipped_steps == 0
    assert folded == pytest.approx(plain, rel=1e-4, abs=1e-6)
    assert folded_norms == pytest.approx(plain_norms, rel=1e-5)
    assert max(plain_norms) > 0.05  # the clipping acted
    for a, b in zip(engine.module.parameters(), reference.module.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
