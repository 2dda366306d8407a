"""End-to-end data parallel: the engine on 2 real ranks against single-process torch and torch DDP
(fp32, gradient accumulation, several gradient buckets, a parameter unused in forward, clipping),
custom stages; and, in this process at world size 1, clipping, schedulers and bad configs."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import engine_common as ec
from helpers import DATA, launch, rank_results

WORKER = DATA / "engine_worker.py"
STEPS, MICRO, LR, SEED, WORLD = 20, 4, 0.01, 1234, 2
TOL = 1e-5

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Runs ``engine_worker.py dp`` once per scenario list (cached); returns [rank0, rank1]."""
    cache: dict[str, list[dict[str, Any]]] = {}

    def run(names: str) -> list[dict[str, Any]]:
        if names not in cache:
            out = tmp_path_factory.mktemp("dp") / "out"
            launch(WORLD, WORKER, "dp", str(out), names, run_dir=out.parent / "run")
            cache[names] = rank_results(out, WORLD)
        return cache[names]

    return run


def scenario(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    for r, data in enumerate(ranks):
        assert "error" not in data[name], f"rank {r} {name}:\n{data[name]['error']}"
    return [data[name] for data in ranks]


def global_losses(per_rank: list[dict[str, Any]]) -> list[float]:
    return [sum(r["losses"][i] for r in per_rank) / len(per_rank) for i in range(STEPS)]


def assert_close(actual: list[float], expected: list[float], what: str, tol: float = TOL) -> None:
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a == pytest.approx(e, rel=tol, abs=tol), f"{what}: step {i + 1}: {a} != {e}"


def assert_params_close(actual: dict[str, list[float]], expected: dict[str, list[float]],
                        tol: float = TOL) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        a, e = torch.tensor(actual[name]), torch.tensor(expected[name])
        assert torch.allclose(a, e, rtol=tol, atol=tol), \
            f"{name}: max diff {float((a - e).abs().max())}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("gas", [1, 4])
def test_fp32_two_ranks_match_single_process_and_ddp(dp_run: Any, gas: int) -> None:
    ranks = dp_run("gas1,gas1_ddp" if gas == 1 else "gas4,gas4_ddp,second_engine")
    engine, ddp = scenario(ranks, f"gas{gas}"), scenario(ranks, f"gas{gas}_ddp")
    ref = ec.plain_reference(steps=STEPS, world=WORLD, gas=gas, micro=MICRO, lr=LR, clip=0.0,
                             seed=SEED)
    assert engine[0]["buckets"] >= 3, "reduce_bucket_size 64 should give several buckets"
    assert engine[0]["global_steps"] == STEPS
    assert_close(global_losses(engine), ref["losses"], "engine vs single process")
    assert_close(global_losses(ddp), ref["losses"], "DDP vs single process")
    assert_close(global_losses(engine), global_losses(ddp), "engine vs DDP")
    for r in range(WORLD):
        assert_close(engine[r]["losses"], ddp[r]["losses"], f"rank {r} local loss vs DDP")
        assert_close(engine[r]["grad_norms"], ref["grad_norms"], f"rank {r} global grad norm")
    # every rank ends with the same weights (bit for bit), the reference's weights
    assert engine[0]["params"] == engine[1]["params"]
    assert_params_close(engine[0]["params"], ref["params"])
    assert_params_close(engine[0]["params"], ddp[0]["params"])
    # the parameter never used in forward has no gradient and stays at rank 0's init
    init = ec.flat_params(ec.make_model(SEED))
    for key in ("unused.weight", "unused.bias"):
        assert engine[0]["params"][key] == init[key]


@pytest.mark.multiprocess
def test_clipping_two_ranks_matches_clip_grad_norm(dp_run: Any) -> None:
    ranks = dp_run("clip,clip_ddp")
    engine, ddp = scenario(ranks, "clip"), scenario(ranks, "clip_ddp")
    ref = ec.plain_reference(steps=STEPS, world=WORLD, gas=1, micro=MICRO, lr=LR, clip=0.5,
                             seed=SEED)
    assert max(ref["grad_norms"]) > 0.5, "the clip threshold must bite on some steps"
    assert_close(global_losses(engine), ref["losses"], "engine vs single process")
    assert_close(global_losses(engine), global_losses(ddp), "engine vs DDP")
    assert_close(engine[0]["grad_norms"], ref["grad_norms"], "pre-clip global grad norm")
    assert_params_close(engine[0]["params"], ref["params"])
    unclipped = ec.plain_reference(steps=STEPS, world=WORLD, gas=1, micro=MICRO, lr=LR, clip=0.0,
                                   seed=SEED)
    assert global_losses(engine)[-1] != pytest.approx(unclipped["losses"][-1], rel=1e-4)


@pytest.mark.multiprocess
def test_custom_stages_bucket_full_halves_update_and_after_step_counts(dp_run: Any) -> None:
    off = scenario(dp_run("stage_off"), "stage_off")
    half = scenario(dp_run("stage_half"), "stage_half")
    for r in range(WORLD):
        moved = 0
        for name, full_delta in off[r]["delta"].items():
            a = torch.tensor(half[r]["delta"][name])
            e = 0.5 * torch.tensor(full_delta)
            assert torch.allclose(a, e, rtol=1e-6, atol=2e-7), \
                f"rank {r} {name}: update with the halving stage is not half the update"
            moved += int((e != 0).sum())
        assert moved > 400  # every used parameter moved
        # gradient_accumulation_steps 2, 3 optimizer steps: one StepDone per optimizer step
        assert half[r]["step_done"] == [1, 2, 3]
        assert off[r]["step_done"] == [1, 2, 3]
        assert half[r]["global_steps"] == 3
        assert half[r]["bucket_full_calls"] >= 3 * 3


@pytest.mark.multiprocess
def test_second_engine_on_the_same_ranks(dp_run: Any) -> None:
    ranks = dp_run("gas4,gas4_ddp,second_engine")
    second = scenario(ranks, "second_engine")
    assert second[0]["global_steps"] == STEPS


# -- world size 1, in this process ----------------------------------------------------------------


def _initialize(**kwargs: Any) -> Any:
    from flowtrain import initialize

    return initialize(**kwargs)


def _config(**extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": MICRO,
                           "optimizer": {"type": "Adam", "params": {"lr": LR}},
                           "gradient_clipping": 0.0, "steps_per_print": 1000}
    cfg.update(extra)
    return cfg


def test_clipping_world1_matches_clip_grad_norm(module_world1: Any) -> None:
    model = ec.make_model(SEED)
    engine, _, _, _ = _initialize(model=model, config=_config(gradient_clipping=0.5))
    losses, norms = [], []
    for step in range(STEPS):
        x, y = ec.micro_batch(step, 0, 0, MICRO)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        norms.append(engine.get_global_grad_norm())
    ref = ec.plain_reference(steps=STEPS, world=1, gas=1, micro=MICRO, lr=LR, clip=0.5, seed=SEED)
    assert max(ref["grad_norms"]) > 0.5
    assert_close(losses, ref["losses"], "engine vs torch clip_grad_norm_ loop")
    assert_close(norms, ref["grad_norms"], "grad norm")
    assert_params_close(ec.flat_params(model), ref["params"])


def _warmup_decay(i: int, lo: float, hi: float, warm: int, total: int | None) -> float:
    """DeepSpeed WarmupLR / WarmupDecayLR (linear warmup) lr at last_batch_iteration i."""
    if i < warm:
        gamma = i / warm
    elif total is None:
        gamma = 1.0
    else:
        gamma = max(0.0, (total - i) / max(1.0, total - warm))
    return lo + (hi - lo) * gamma


def _warmup_cosine(i: int, base: float, warm: int, total: int, min_ratio: float,
                   cos_min: float) -> float:
    """DeepSpeed WarmupCosineLR (linear warmup) lr at last_batch_iteration i."""
    if i < warm:
        ratio = min_ratio + (1 - min_ratio) * i / warm
    else:
        progress = (i - warm + 1) / (total - warm)
        ratio = max(0.0, cos_min + (1 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)
    return base * ratio


SCHEDULES = {
    "WarmupLR": ({"warmup_min_lr": 0.001, "warmup_max_lr": 0.02, "warmup_num_steps": 8,
                  "warmup_type": "linear"},
                 lambda i: _warmup_decay(i, 0.001, 0.02, 8, None)),
    "WarmupDecayLR": ({"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 5,
                       "total_num_steps": 16, "warmup_type": "linear"},
                      lambda i: _warmup_decay(i, 0.0, 0.02, 5, 16)),
    "WarmupCosineLR": ({"total_num_steps": 24, "warmup_min_ratio": 0.1, "warmup_num_steps": 4,
                        "cos_min_ratio": 0.01, "warmup_type": "linear"},
                       lambda i: _warmup_cosine(i, LR, 4, 24, 0.1, 0.01)),
}


@pytest.mark.parametrize("kind", sorted(SCHEDULES))
def test_scheduler_lr_through_engine(module_world1: Any, kind: str) -> None:
    params, formula = SCHEDULES[kind]
    gas = 2
    model = ec.make_model(SEED)
    engine, _, _, sched = _initialize(model=model, config=_config(
        gradient_accumulation_steps=gas, scheduler={"type": kind, "params": params}))
    assert sched is not None and engine.lr_scheduler is sched
    if kind != "WarmupCosineLR":  # before the first step: warmup_min_lr
        assert engine.get_lr()[0] == params["warmup_min_lr"]
    seen, expected = [], []
    for step in range(STEPS):
        for m in range(gas):
            x, y = ec.micro_batch(step, 0, m, MICRO)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
        # the scheduler stepped once per optimizer step (not per micro-batch)
        seen.append(engine.get_lr()[0])
        expected.append(formula(step))
        assert engine.optimizer.param_groups[0]["lr"] == seen[-1]
    assert seen == pytest.approx(expected, rel=1e-9, abs=1e-12)


BAD_CONFIGS = {
    "batch rule": ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                    "gradient_accumulation_steps": 2},
                   "train_batch_size 16 != train_micro_batch_size_per_gpu 4"),
    "unknown key": ({"train_batch_size": 4, "gradient_clippin": 1.0},
                    "gradient_clippin: unknown key"),
    "wrong type": ({"train_batch_size": 4, "gradient_accumulation_steps": "two"},
                   "gradient_accumulation_steps: expected an integer"),
    "nvme offload": ({"train_batch_size": 4, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}},
                     "offloading to NVMe is not supported"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_raises_config_error_before_training(module_world1: Any, case: str) -> None:
    from flowtrain.config import ConfigError

    raw, fragment = BAD_CONFIGS[case]
    raw = {**raw, "optimizer": {"type": "Adam", "params": {"lr": LR}}}
    model = ec.make_model(SEED)
    before = ec.flat_params(model)
    with pytest.raises(ConfigError) as info:
        _initialize(model=model, config=raw)
    assert fragment in str(info.value)
    assert ec.flat_params(model) == before
    assert all(p.grad is None for p in model.parameters())


def test_bucket_full_stage_runs_at_world_size_1(module_world1: Any) -> None:
    from engine_worker import Halve, HowMany

    model = ec.make_model(SEED)
    engine, _, _, _ = _initialize(model=model, config=_config(
        optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    halver = engine.add_stage(Halve(), at="bucket_full")
    x, y = ec.micro_batch(0, 0, 0, MICRO)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.step()
    assert halver.ask_from_thread(HowMany()) == len(engine.buckets.flat)
