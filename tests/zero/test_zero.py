"""ZeRO stages 1 and 2 in the data-parallel engine, on 2 real ranks, against stage 0 on the same
ranks: per-step losses, clipping norms, fp16 overflow skips, final weights, sharded optimizer
state (memory_breakdown), checkpoints (loaded into the other stage too); and, at world size 1
in this process, what is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import engine_common as ec
from helpers import DATA, check_cases, launch, rank_results

WORKER = DATA / "zero_worker.py"
WORLD = 2
TOL = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-2}
PADDED_BUCKETS = [24, 136, 16, 120]  # 23, 135, 15, 120 elements padded to a multiple of 2

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def zero_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[tuple[str, ...], list[dict[str, Any]]] = {}

    def run(*args: str) -> list[dict[str, Any]]:
        if args not in cache:
            out = tmp_path_factory.mktemp("zero") / "out"
            extra = [str(out.parent / "ckpt")] if args[0] == "resume" else []
            launch(WORLD, WORKER, args[0], str(out), *args[1:], *extra,
                   run_dir=out.parent / "run")
            cache[args] = check_cases(rank_results(out, WORLD))
        return cache[args]

    return run


def close(actual: list[float | None], expected: list[float | None], tol: float, what: str) -> None:
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        if e is None:
            assert a is None, f"{what}: step {i + 1}: {a} where stage 0 has none"
        else:
            assert a == pytest.approx(e, rel=tol, abs=tol), f"{what}: step {i + 1}: {a} != {e}"


CASES = [(c, p, s) for c in ("shm", "torch") for p in ("fp32", "bf16") for s in (1, 2)] + \
    [("shm", "fp16", 2), ("torch", "fp16", 2)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("channel,precision,stage", CASES)
def test_zero_matches_stage0(zero_run: Any, channel: str, precision: str, stage: int) -> None:
    ranks = zero_run("compare", channel)
    tol = TOL[precision]
    for r in range(WORLD):
        ref, got = ranks[r][f"{precision}_s0"], ranks[r][f"{precision}_s{stage}"]
        assert got["buckets"] == PADDED_BUCKETS
        close(got["losses"], ref["losses"], tol, f"rank {r} loss")
        # clipping at 0.3 bites: the pre-clip global norm is stage 0's
        close(got["norms"], ref["norms"], tol, f"rank {r} global grad norm")
        assert got["skipped"] == ref["skipped"] and got["loss_scale"] == ref["loss_scale"]
        for name, values in ref["params"].items():
            a, e = torch.tensor(got["params"][name]), torch.tensor(values)
            assert torch.allclose(a, e, rtol=tol, atol=tol), name
    assert max(ranks[0][f"{precision}_s0"]["norms"] or [0], key=lambda n: n or 0) > 0.3
    # every rank ends with the same weights, bit for bit
    case = f"{precision}_s{stage}"
    assert ranks[0][case]["params"] == ranks[1][case]["params"]
    if precision == "fp16":
        assert 0 < ranks[0]["fp16_s0"]["skipped"] < 10  # some steps overflowed, then trained


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2])
def test_memory_breakdown_shards_optimizer_state(zero_run: Any, precision: str,
                                                 stage: int) -> None:
    ranks = zero_run("compare", "shm")
    shard = sum(PADDED_BUCKETS) // WORLD  # elements per rank
    n_params, n_buckets = 8, len(PADDED_BUCKETS)
    for r in range(WORLD):
        base = ranks[r][f"{precision}_s0"]["memory"]
        mem = ranks[r][f"{precision}_s{stage}"]["memory"]
        # Adam: exp_avg + exp_avg_sq fp32 per element, a 4-byte step per stepped tensor
        assert base["optimizer_state"] == 293 * 8 + n_params * 4
        assert mem["optimizer_state"] == shard * 8 + n_buckets * 4
        assert abs(mem["optimizer_state"] - base["optimizer_state"] / WORLD) < 0.05 * \
            base["optimizer_state"]
        elem = 4 if precision == "fp32" else 2
        assert mem["parameters"] == sum(PADDED_BUCKETS) * elem  # full parameters, padded
        if stage == 1:  # whole gradients, all-reduced
            assert mem["gradient_buckets"] == sum(PADDED_BUCKETS) * elem
        else:  # transient buffers: at most this micro-batch's and the one still reducing
            assert 0 < mem["gradient_buckets"] <= 2 * sum(PADDED_BUCKETS) * elem
        if precision == "fp32":  # the optimizer steps the parameters' own slice
            assert mem["master_weights"] == 0
        else:
            assert mem["master_weights"] == shard * 4 and base["master_weights"] == 293 * 4
        if stage == 2:
            assert mem["gradient_shards"] == shard * (4 if precision == "fp32" else 2)
        else:
            assert mem["gradient_shards"] == 0
        assert mem["gradients"] == mem["gradient_buckets"] + mem["gradient_shards"]
        grads = mem["gradients"] if stage == 1 else mem["gradient_shards"]
        assert mem["model_states"] == mem["parameters"] + grads + mem["optimizer_state"] + \
            mem["master_weights"] + mem["master_gradients"]
        assert mem["process_rss"] > 0


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["s1_fp32", "s2_bf16"])
def test_checkpoint_round_trip_same_world_size(zero_run: Any, case: str) -> None:
    ranks = zero_run("resume")
    for r in range(WORLD):
        got = ranks[r][case]
        assert got["resumed"] == got["straight"]  # the loss curve continues exactly
        assert got["params_equal"] and got["global_steps"] == 10
        # loaded into the other stage (1 <-> 2) it continues the same curve
        close(got["other_stage"], got["straight"], TOL[case.split("_")[1]], f"rank {r} {case}")


# -- world size 1, in this process ----------------------------------------------------------------


def _cfg(stage: int, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
                           "gradient_clipping": 0.5,
                           "zero_optimization": {"stage": stage, "reduce_bucket_size": 100}}
    cfg.update(extra)
    return cfg


def _train(engine: Any, steps: int = 5) -> list[float]:
    losses = []
    for step in range(steps):
        x, y = ec.micro_batch(step, 0, 0, 4)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def test_world1_stage2_matches_stage0(module_world1: Any) -> None:
    from flowtrain import initialize

    runs = {}
    for stage in (0, 2):
        model = ec.make_model(7)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        engine, _, _, _ = initialize(model=model, optimizer=opt, config=_cfg(stage))
        runs[stage] = (_train(engine), engine.get_global_grad_norm(),
                       engine.memory_breakdown()["optimizer_state"])
        engine.destroy()
    assert runs[2][0] == pytest.approx(runs[0][0], rel=1e-6)
    assert runs[2][1] == pytest.approx(runs[0][1], rel=1e-5)


def _two_groups(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([
        {"params": model.fc1.parameters(), "lr": 0.03, "weight_decay": 0.0},
        {"params": [p for n, p in model.named_parameters() if not n.startswith("fc1")],
         "lr": 0.01, "weight_decay": 0.1}])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_param_groups_keep_their_settings_under_zero(module_world1: Any, stage: int) -> None:
    """Groups with different lr and weight decay: buckets never mix groups, so each shard
    steps with its own group's settings, as stage 0 does."""
    from flowtrain import initialize

    runs = {}
    for s in (0, stage):
        model = ec.make_model(7)
        engine, _, _, _ = initialize(model=model, optimizer=_two_groups(model), config=_cfg(s))
        try:
            assert [g["lr"] for g in engine.optimizer.param_groups] == [0.03, 0.01]
            runs[s] = (_train(engine), ec.flat_params(model))
        finally:
            engine.destroy()
    assert runs[stage][0] == pytest.approx(runs[0][0], rel=1e-6)
    for name, values in runs[0][1].items():
        assert torch.allclose(torch.tensor(runs[stage][1][name]), torch.tensor(values),
                              rtol=1e-5, atol=1e-6), name


def test_optimizer_missing_a_parameter_refused(module_world1: Any) -> None:
    from flowtrain import initialize

    model = ec.make_model(7)
    opt = torch.optim.Adam(model.fc1.parameters(), lr=0.01)
    with pytest.raises(ValueError, match="needs the optimizer to hold every trainable"):
        initialize(model=model, optimizer=opt, config=_cfg(1))


def test_stages_1_to_3_and_cpu_offload_accepted() -> None:
    from flowtrain.config import load_config

    cfg = load_config({"train_batch_size": 4, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}})
    assert cfg.zero_optimization.offloads_optimizer and cfg.zero_optimization.offloads_params
    for stage in (1, 2, 3):
        assert load_config({"train_batch_size": 4,
                            "zero_optimization": {"stage": stage}}).zero_optimization.stage == stage


def test_shm_reduce_scatter_is_the_all_reduce_slice(tmp_path: Path) -> None:
    """Chunked (slot smaller than the tensor, chunk edges inside a shard): each rank's slice
    is bit-identical to the same slice of the all-reduce."""
    from flowtrain.shm import ShmChannel

    world, numel = 3, 1001 * 3
    path = tmp_path / "chan"
    chans = [ShmChannel(path, rank=0, world_size=world, slot_bytes=1600, create=True,
                        timeout=30)]
    chans += [ShmChannel(path, rank=r, world_size=world, slot_bytes=1600, create=False,
                         timeout=30) for r in range(1, world)]
    try:
        g = torch.Generator().manual_seed(3)
        inputs = [torch.randn(numel, generator=g) for _ in range(world)]
        reduced = inputs[0].clone()
        futs = [chans[r].all_reduce_async(t) for r, t in enumerate(
            [reduced] + [x.clone() for x in inputs[1:]])]
        for f in futs:
            f.result(30)
        outs = [torch.empty(numel // world) for _ in range(world)]
        futs = [chans[r].reduce_scatter_async(inputs[r].clone(), outs[r]) for r in range(world)]
        for f in futs:
            f.result(30)
        for r in range(world):
            assert torch.equal(outs[r], reduced[r * (numel // world):(r + 1) * (numel // world)])
    finally:
        for c in chans:
            c.close()
