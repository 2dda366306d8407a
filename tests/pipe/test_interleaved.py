"""Interleaved 1F1B (Megatron's virtual pipeline): the schedule against Megatron's order worked
out by hand, every rank's instructions run together without deadlock, the simulator's executor
bubble against (p - 1) / (v * m), the config's errors, and real ranks (pp 2; pp 4 and pp 2 x
dp 2 on 4 ranks) against single-process training, with a checkpoint round trip."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flowtrain.config import ConfigError, load_config
from flowtrain.plan import names
from flowtrain.plan.schedule import bubble_fraction, handover, max_in_flight, stage_ops
from helpers import DATA, check_cases, launch, rank_results
from sims.executor import SimTask, execute, step_figures
from sims.graph import bare_pipeline

WORKER = DATA / "pipe_interleaved_worker.py"


def _passes(stage: int, p: int, m: int, v: int) -> list[str]:
    return [f"{op.kind[0].upper()}{op.chunk}.{op.mb}"
            for op in stage_ops("interleaved", stage, p, m, v)
            if op.kind in names.PASSES]


def test_order_is_megatrons_worked_by_hand() -> None:
    # p=2, v=2, m=4. Forward order on every rank (micro-batches in groups of p, each group
    # through chunk 0 then chunk 1): c0m0 c0m1 c1m0 c1m1 c0m2 c0m3 c1m2 c1m3; backward order
    # the same with chunks counted from the end. Warm-up: rank 0 (2-0-1)*2 + (2-1)*2 = 4,
    # rank 1 0 + 2 = 2; then one forward, one backward; then the rest of the backwards.
    assert _passes(0, 2, 4, 2) == ["F0.0", "F0.1", "F1.0", "F1.1",
                                   "F0.2", "B1.0", "F0.3", "B1.1", "F1.2", "B0.0", "F1.3", "B0.1",
                                   "B1.2", "B1.3", "B0.2", "B0.3"]
    assert _passes(1, 2, 4, 2) == ["F0.0", "F0.1",
                                   "F1.0", "B1.0", "F1.1", "B1.1", "F0.2", "B0.0", "F0.3", "B0.1",
                                   "F1.2", "B1.2", "F1.3", "B1.3",
                                   "B0.2", "B0.3"]
    # the model's first chunk (rank 0, chunk 0) receives nothing; its last (rank 1, chunk 1)
    # sends no activations; rank 1's chunk 0 hands over to rank 0's chunk 1 (the wrap)
    ops0 = stage_ops("interleaved", 0, 2, 4, 2)
    assert [op.task_name for op in ops0[:4]] == ["forward/mb0.chunk0", "send_act/mb0.chunk0",
                                                 "forward/mb1.chunk0", "send_act/mb1.chunk0"]
    assert ops0[4].task_name == "recv_act/mb0.chunk1"
    assert handover("send_act", 1, 2, 0) == (0, 1) and handover("recv_act", 0, 2, 1) == (1, 0)
    assert handover("send_grad", 0, 2, 1) == (1, 0) and handover("recv_grad", 1, 2, 0) == (0, 1)


def _run_all(p: int, m: int, v: int, fwd: float = 1.0, bwd: float = 2.0) -> float:
    """Every rank's instructions with instant sends; a receive waits for its send. Returns the
    step time; fails on a deadlock or a forward/backward out of order."""
    ops = {s: stage_ops("interleaved", s, p, m, v) for s in range(p)}
    pos = dict.fromkeys(range(p), 0)
    clock = dict.fromkeys(range(p), 0.0)
    sent: dict[tuple[str, int, int | None, int], float] = {}
    done: set[tuple[int, int | None, int]] = set()
    while any(pos[s] < len(ops[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pos[s] < len(ops[s]):
                op = ops[s][pos[s]]
                if op.kind.startswith("recv"):
                    src, chunk = handover(op.kind, s, p, op.chunk)
                    key = (op.kind[5:], src, chunk, op.mb)
                    if key not in sent:
                        break
                    clock[s] = max(clock[s], sent[key])
                elif op.kind.startswith("send"):
                    sent[(op.kind[5:], s, op.chunk, op.mb)] = clock[s]
                else:
                    if op.kind == "backward":
                        assert (s, op.chunk, op.mb) in done, f"backward before forward: {op}"
                    done.add((s, op.chunk, op.mb))
                    clock[s] += fwd if op.kind == "forward" else bwd
                pos[s] += 1
                progressed = True
        assert progressed, f"interleaved deadlocks at p={p} m={m} v={v}"
    return max(clock.values())


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (3, 6, 3),
                                   (4, 8, 4), (8, 16, 2)])
def test_every_rank_runs_without_deadlock_and_has_the_bubble(p: int, m: int, v: int) -> None:
    for s in range(p):
        ops = stage_ops("interleaved", s, p, m, v)
        for kind in names.PASSES:
            assert sorted((o.chunk, o.mb) for o in ops if o.kind == kind) == \
                [(c, k) for c in range(v) for k in range(m)]
        # Megatron's warm-up bounds the activations held
        assert max_in_flight(ops) <= min((p - s - 1) * 2 + (v - 1) * p + 1, m * v)
    step = _run_all(p, m, v)
    ideal = m * v * 3.0
    assert (step - ideal) / ideal == pytest.approx((p - 1) / (v * m))
    assert (step - ideal) / step == pytest.approx(bubble_fraction(p, m, v))


def _priced(p: int, m: int, v: int, tf: float, tb: float) -> tuple[SimTask, ...]:
    seconds = {"forward": tf, "backward": tb, "send": 0.0}
    return tuple(SimTask(t.name, t.kind, t.resource, seconds[t.cost], t.deps, t.stage,
                         collective=t.resource.startswith("comm:"))
                 for t in bare_pipeline(p, m, v))


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (8, 16, 4)])
def test_executor_bubble_matches_the_formula(p: int, m: int, v: int) -> None:
    tf, tb = 1.0, 2.0  # one chunk's passes, equal on every chunk
    figures = step_figures(execute(_priced(p, m, v, tf, tb)))
    ideal = m * v * (tf + tb)
    assert (figures.step_time - ideal) / ideal == pytest.approx((p - 1) / (v * m))
    assert figures.bubble_pct == pytest.approx(100 * bubble_fraction(p, m, v))
    # one chunk's pass is 1/v of a stage's: the bubble is v times smaller than 1F1B's
    # over passes v times longer
    plain = step_figures(execute(_priced(p, m, 1, v * tf, v * tb)))
    assert (plain.step_time - ideal) / ideal == pytest.approx((p - 1) / m)


def test_the_graph_sends_around_the_ring() -> None:
    graph = bare_pipeline(2, 2, 2)
    by_name = {(t.stage, t.name): i for i, t in enumerate(graph)}
    # rank 0's chunk 1 forward waits for rank 1's chunk 0 send, rank 1's chunk 0 backward
    # for rank 0's chunk 1 send of gradients
    fwd = graph[by_name[(0, "forward/mb0.chunk1")]]
    assert by_name[(1, "send_act/mb0.chunk0")] in fwd.deps and fwd.chunk == 1
    bwd = graph[by_name[(1, "backward/mb0.chunk0")]]
    assert by_name[(0, "send_grad/mb0.chunk1")] in bwd.deps


@pytest.mark.parametrize("pipeline,message", [
    ({"schedule": "interleaved"}, "pipeline.virtual_stages 1: pipeline.schedule 'interleaved' "
                                  "needs at least 2"),
    ({"virtual_stages": 2}, "pipeline.virtual_stages 2 needs pipeline.schedule 'interleaved'"),
    ({"schedule": "interleaved", "virtual_stages": 0}, "pipeline.virtual_stages: expected an "
                                                       "integer > 0, got 0")])
def test_config_errors_name_the_field(pipeline: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
                     "pipeline": pipeline}, world_size=1)


def test_schedule_errors_name_the_setting() -> None:
    with pytest.raises(ValueError, match="gradient_accumulation_steps 6: .* multiple of 4"):
        stage_ops("interleaved", 0, 4, 6, 2)
    with pytest.raises(ValueError, match="needs at least 2 pipeline stages"):
        stage_ops("interleaved", 0, 1, 4, 2)
    with pytest.raises(ValueError, match="virtual_stages 2 needs pipeline.schedule"):
        stage_ops("1f1b", 0, 2, 4, 2)


def test_module_cut_into_chunks_names_the_shortage() -> None:
    from torch import nn

    from flowtrain.parallel import ProcessGrid, check_shape
    from flowtrain.pipe import PipelineModule

    grid = ProcessGrid(check_shape(2, 2, 1), 0)  # stage 0 of 2, no process groups needed
    layers = [nn.Linear(2, 2) for _ in range(5)]
    module = PipelineModule(layers, grid=grid, partition_method="uniform")
    assert module.chunk_ranges == [(0, 3)]
    module.set_virtual_stages(2)
    parts = module.parts
    assert len(parts) == 5 and module.chunk_ranges == [(parts[0], parts[1]), (parts[2], parts[3])]
    # the layers it holds are the list's own (the same objects the single-process model has)
    assert all(module.layers[str(i)] is layers[i] for a, b in module.chunk_ranges
               for i in range(a, b))
    assert sorted(int(k) for k in module.layers) == [i for a, b in module.chunk_ranges
                                                     for i in range(a, b)]
    with pytest.raises(ValueError, match=r"cannot cut 5 layers into 6 model chunks \(2 "
                                         r"pipeline stages x pipeline.virtual_stages 3\)"):
        module.set_virtual_stages(3)


# -- real ranks ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[int, list[dict[str, Any]]] = {}

    def run(world: int) -> list[dict[str, Any]]:
        if world not in cache:
            base = tmp_path_factory.mktemp(f"interleaved{world}")
            launch(world, WORKER, str(base / "out"), str(base / "ckpt"), run_dir=base / "run",
                   timeout=240)
            cache[world] = check_cases(rank_results(base / "out", world))
        return cache[world]

    return run


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,case", [(2, "pp"), (4, "pp"), (4, "pp2_dp2")])
def test_losses_equal_single_process_training(runs: Any, world: int, case: str) -> None:
    ranks = runs(world)
    held = set()
    for r, data in enumerate(ranks):
        got, ref = data[case], data[f"{case}_reference"]
        dp_rank = got["dp_rank"]
        assert got["losses"] == pytest.approx(ref["losses"][dp_rank], abs=1e-5), r
        assert got["eval_loss"] == pytest.approx(ref["eval"][dp_rank], abs=1e-5), r
        for name, values in got["params"].items():
            assert torch.allclose(torch.tensor(values), torch.tensor(ref["params"][name]),
                                  rtol=1e-5, atol=1e-6), (r, name)
        # stage s holds chunks s and s + p of the p * 2
        pp = len(got["parts"]) // 2
        s = got["stage"]
        assert got["chunks"] == [got["parts"][s:s + 2], got["parts"][s + pp:s + pp + 2]]
        held |= set(got["params"])
        names_seen = set(got["span_names"])
        assert {"forward/mb0.chunk0", "forward/mb3.chunk1", "backward/mb3.chunk0",
                "optimizer/step"} <= names_seen
    assert held == set(ranks[0][f"{case}_reference"]["params"])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_checkpoint_of_an_interleaved_run_resumes_exactly(runs: Any, world: int) -> None:
    for data in runs(world):
        got = data["checkpoint"]
        assert got["resumed"] == pytest.approx(got["straight"], rel=1e-6)
        assert got["global_steps"] == 4
