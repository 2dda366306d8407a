"""Pipeline parallelism: the 1F1B and GPipe schedules and partitioning as pure functions, and
real ranks (pp=2; pp=2 x dp=2 on 4 ranks; with ZeRO stage 1) against single-process training
of the same layers on the same global batch."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import engine_common as ec
from flowtrain.parallel import check_shape
from flowtrain.pipe import bubble_fraction, partition_balanced, stage_ops
from flowtrain.pipe.schedule import max_in_flight
from helpers import DATA, REPO, check_cases, child_env, free_port, launch, rank_results

WORKER = DATA / "pipe_worker.py"


# -- schedules -------------------------------------------------------------------------------


def _simulate(schedule: str, p: int, m: int, fwd: float = 1.0, bwd: float = 2.0) -> float:
    """Runs every stage's op list with unit-cost compute and free, instant communication;
    returns the step time (a receive waits for the matching send)."""
    ops = {s: stage_ops(schedule, s, p, m) for s in range(p)}
    pos = dict.fromkeys(range(p), 0)
    clock = dict.fromkeys(range(p), 0.0)
    sent: dict[tuple[str, int, int], float] = {}
    while any(pos[s] < len(ops[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pos[s] < len(ops[s]):
                op = ops[s][pos[s]]
                if op.kind in ("recv_act", "recv_grad"):
                    src = s - 1 if op.kind == "recv_act" else s + 1
                    key = ("act" if op.kind == "recv_act" else "grad", src, op.mb)
                    if key not in sent:
                        break
                    clock[s] = max(clock[s], sent[key])
                elif op.kind == "send_act":
                    sent[("act", s, op.mb)] = clock[s]
                elif op.kind == "send_grad":
                    sent[("grad", s, op.mb)] = clock[s]
                else:
                    clock[s] += fwd if op.kind == "forward" else bwd
                pos[s] += 1
                progressed = True
        assert progressed, f"{schedule} deadlocks at p={p} m={m}"
    return max(clock.values())


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 4), (4, 8), (8, 32), (3, 5)])
def test_schedule_step_time_has_the_published_bubble(schedule: str, p: int, m: int) -> None:
    ideal = m * 3.0  # every micro-batch's forward (1) and backward (2) on one stage
    step = _simulate(schedule, p, m)
    assert (step - ideal) / step == pytest.approx(bubble_fraction(p, m))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 2)])
def test_1f1b_holds_fewer_activations_than_gpipe(p: int, m: int) -> None:
    for s in range(p):
        assert max_in_flight(stage_ops("1f1b", s, p, m)) == min(p - s, m)
        assert max_in_flight(stage_ops("gpipe", s, p, m)) == m


def test_every_micro_batch_runs_once_per_stage() -> None:
    for schedule in ("1f1b", "gpipe"):
        for s in range(3):
            ops = stage_ops(schedule, s, 3, 5)
            for kind in ("forward", "backward"):
                assert sorted(o.mb for o in ops if o.kind == kind) == list(range(5))


def test_bad_schedule_arguments() -> None:
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zigzag'"):
        stage_ops("zigzag", 0, 2, 4)
    with pytest.raises(ValueError, match="at least 1 micro-batch"):
        stage_ops("1f1b", 0, 2, 0)


# -- partitioning and the grid --------------------------------------------------------------------


def test_partition_minimises_the_largest_stage() -> None:
    costs = [5, 1, 1, 1, 1, 1, 5, 1]
    bounds = partition_balanced(costs, 2)
    parts = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert max(parts) == 8  # the best split of 16 with these layers: 8 + 8
    assert bounds[0] == 0 and bounds[-1] == len(costs)
    brute = min(max(sum(costs[:i]), sum(costs[i:])) for i in range(1, len(costs)))
    assert max(parts) == brute
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3 pipeline stages"):
        partition_balanced([1, 1], 3)


def test_balanced_partition_uses_flops_not_counts() -> None:
    from flowtrain.pipe.module import layer_flops

    layers = [nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 512), nn.ReLU(),
              nn.Linear(512, 8)]
    flops = layer_flops(layers, torch.zeros(4, 64))
    assert flops[:3] == [2 * 4 * 64 * 64, 2 * 4 * 64 * 64, 2 * 4 * 64 * 512]
    assert flops[3] == 4 * 512  # no matmul: one per output element
    # FLOPs: the big layer goes with the cheap tail (max stage 296,960 FLOPs); counting
    # layers would cut after three (max stage 327,680)
    assert partition_balanced(flops, 2) == [0, 2, 5]
    assert partition_balanced([1.0] * 5, 2) == [0, 3, 5]


def test_a_grid_built_before_init_distributed_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from flowtrain.parallel.grid import build_grid

    if dist.is_initialized():
        pytest.skip("a process group is already up in this test process")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"not initialised.*1 rank of the 2 launched.*"
                                         r"flowtrain.init_distributed\(\)"):
        build_grid(pp=2)


def test_impossible_grid_names_the_sizes() -> None:
    with pytest.raises(ValueError, match=r"cannot lay out 6 ranks as 4 pipeline stages x 1 "
                                         r"tensor-parallel.*one of \[1, 2, 3, 6\]"):
        check_shape(6, 4, 1)
    shape = check_shape(8, 2, 2)
    assert shape.dp == 2
    assert [shape.coords(r) for r in (0, 1, 2, 5, 7)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0),
                                                          (1, 0, 1), (1, 1, 1)]
    assert all(shape.rank_of(*shape.coords(r)) == r for r in range(8))


# -- real ranks ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipe_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[int, list[dict[str, Any]]] = {}

    def run(world: int) -> list[dict[str, Any]]:
        if world not in cache:
            out = tmp_path_factory.mktemp(f"pipe{world}") / "out"
            run.run_dirs[world] = out.parent / "run"  # type: ignore[attr-defined]
            launch(world, WORKER, str(out), "2", run_dir=out.parent / "run")
            cache[world] = check_cases(rank_results(out, world))
        return cache[world]

    run.run_dirs = {}  # type: ignore[attr-defined]
    return run


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["1f1b", "gpipe", "1f1b_zero1", "1f1b_ckpt"])
def test_pipeline_matches_single_process(pipe_run: Any, world: int, case: str) -> None:
    ranks = pipe_run(world)
    for r, data in enumerate(ranks):
        got, ref = data[case], data["reference"]
        dp_rank = got["dp_rank"]
        assert got["losses"] == pytest.approx(ref["losses"][dp_rank], rel=1e-5, abs=1e-6), r
        assert got["eval_loss"] == pytest.approx(ref["eval"][dp_rank], rel=1e-5, abs=1e-6)
        # this stage's layers hold the single-process model's weights
        for name, values in got["params"].items():
            assert torch.allclose(torch.tensor(values), torch.tensor(ref["params"][name]),
                                  rtol=1e-5, atol=1e-6), (r, name)
        assert got["parts"] == [0, 4, 7]
        assert got["threads_left"] == [], r
        assert got["ckpt_interval"] == (2 if case == "1f1b_ckpt" else 0)
    stages = sorted({d[case]["stage"] for d in ranks})
    assert stages == [0, 1]
    names = set(ranks[0][case]["span_names"])
    assert {"forward/mb0", "backward/mb3", "send_act/mb3", "recv_grad/mb0",
            "optimizer/step"} <= names


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_each_stage_records_its_flops_and_census_as_plain_torch_counts_them(
        pipe_run: Any) -> None:
    """The stage records ``flowtrain simulate --compare`` rebuilds a pipeline's plan from: each
    stage's first forward, counted as the same layers (and the last stage's loss) count in
    this process."""
    from flowtrain.profiling.census import OpCensus

    pipe_run(2)
    stages_dir = pipe_run.run_dirs[2] / "stages"
    from pipe_worker import MICRO, layers

    built = layers()
    x, y = ec.micro_batch(0, 0, 0, MICRO)
    for stage, (first, last) in enumerate([(0, 4), (4, 7)]):
        record = json.loads((stages_dir / f"stage{stage}.json").read_text())
        with OpCensus() as census:
            out = nn.Sequential(*built[first:last])(x)
            if stage == 1:
                nn.functional.mse_loss(out, y)
        expected = json.loads(json.dumps(census.summary()))
        got = record["forward_ops_per_micro_batch"]
        # views are free metadata ops whose count follows autograd: the worker's last case
        # (whose engine wrote the records last) checkpoints activations, and a checkpointed
        # forward runs without autograd, which skips Linear's weight-transpose views
        views, expected_views = got["ops"].pop("view"), expected["ops"].pop("view")
        assert got == expected
        assert 0 < views[0] <= expected_views[0] and views[1] == expected_views[1] == 0
        assert record["forward_flops_per_micro_batch"] == expected["matmul_flops"] > 0
        assert record["output_bytes_per_micro_batch"] == out.numel() * 4
        x = out.detach()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_pipeline_checkpoint_resumes_on_another_stage_count(tmp_path: Path) -> None:
    """Saved on 2 stages (each stage writes its own layers' pieces), resumed on 1 stage: the
    loss curve goes on exactly; consolidated, it loads into the plain layers."""
    worker = DATA / "pipe_ckpt_worker.py"
    ckpt = tmp_path / "ckpt"
    launch(2, worker, "save", str(ckpt), str(tmp_path / "saved.json"), "2",
           run_dir=tmp_path / "run2")
    launch(1, worker, "load", str(ckpt), str(tmp_path / "loaded.json"), "1",
           run_dir=tmp_path / "run1")
    saved = json.loads((tmp_path / "saved.json").read_text())
    loaded = json.loads((tmp_path / "loaded.json").read_text())
    assert loaded["resumed"] == pytest.approx(saved["straight"], rel=1e-6)
    assert loaded["global_steps"] == 10

    from flowtrain.checkpoint import consolidate

    state = consolidate(str(ckpt))
    import pipe_worker as pw

    plain = nn.Sequential(*pw.layers())
    plain.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()})
    assert sorted(state) == sorted(f"layers.{k}" for k in plain.state_dict())


# -- point-to-point streams: changing shapes, timeouts, a dead peer --------------------------


def _p2p(case: str, tmp_path: Path) -> list[dict[str, Any]]:
    """Runs tests/data/pipe_p2p_worker.py as two plain processes; each rank's JSON (or {})."""
    import subprocess

    worker = DATA / "pipe_p2p_worker.py"
    port = free_port()
    outs = [tmp_path / f"{case}.rank{r}.json" for r in (0, 1)]
    procs = [subprocess.Popen([sys.executable, str(worker), case, str(r), str(port),
                               str(outs[r])], cwd=REPO, env=child_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=90)[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            logs.append(proc.communicate()[0])
    results = [json.loads(o.read_text()) if o.exists() else {} for o in outs]
    for r, result in enumerate(results):
        assert "crash" not in result, f"rank {r}:\n{result['crash']}\n{logs[r][-3000:]}"
    return results


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_p2p_streams_follow_changing_shapes(tmp_path: Path) -> None:
    """Both directions at once; shapes repeat (the payload's receives are posted before the
    header arrives), shrink, grow, change dtype and tensor count (placeholders fill the
    receives posted in the old shapes)."""
    for r, result in enumerate(_p2p("shapes", tmp_path)):
        assert result == {"received": 10, "mismatches": []}, r


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_p2p_receive_times_out_naming_the_message(tmp_path: Path) -> None:
    result = _p2p("timeout", tmp_path)[1]
    assert result["error_type"] == "CollectiveTimeout"
    assert result["error"].startswith("activations of micro-batch 3 from stage 0 (rank 0) did "
                                      "not arrive within 1 s")
    assert result["seconds"] < 10


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case,rank,message", [
    ("dead_sender", 1, ("activations of micro-batch 1 from stage 0 (rank 0) could not be "
                        "received")),
    ("dead_receiver", 0, "activations of micro-batch 0 to stage 1 (rank 1) could not be sent")])
def test_p2p_dead_peer_is_named_at_once(tmp_path: Path, case: str, rank: int,
                                        message: str) -> None:
    result = _p2p(case, tmp_path)[rank]
    assert result["error_type"] == "PipelineChannelError", result
    assert result["error"].startswith(message)
    assert "may have died" in result["error"]
    assert result["seconds"] < 20  # the peer's connection closed: no waiting for the timeout


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_pipeline_follows_micro_batches_that_change_size(tmp_path: Path) -> None:
    """Micro-batches of different sizes within a step and between steps, and evaluation
    between training steps with other sizes: every stage-to-stage message after a change has
    new shapes. Losses equal single-process training on the same micro-batches."""
    out = tmp_path / "out"
    launch(2, DATA / "pipe_shapes_worker.py", str(out), run_dir=tmp_path / "run")
    for r in (0, 1):
        data = json.loads(Path(f"{out}.rank{r}.json").read_text())
        for schedule in ("1f1b", "gpipe"):
            assert "error" not in data[schedule], f"rank {r} {schedule}:\n" \
                                                  f"{data[schedule]['error']}"
            assert data[schedule] == pytest.approx(data["reference"], rel=1e-5, abs=1e-6), \
                (r, schedule)


def test_partition_costs_weigh_the_embedding_and_head_with_the_end_layers() -> None:
    from flowtrain.plan.partition import partition_costs
    from sims.workload import layer_of, split_stages

    params = [("embed.weight", (100, 4), "float32", 4)]
    params += [(f"layers.{i}.w", (4, 4), "float32", 4) for i in range(6)]
    params += [("norm.weight", (4,), "float32", 4), ("head.weight", (100, 4), "float32", 4)]
    assert partition_costs(params, "layers", layer_of=layer_of) is None
    by_params = partition_costs(params, "parameters", layer_of=layer_of)
    assert by_params == {0: 416.0, 1: 16.0, 2: 16.0, 3: 16.0, 4: 16.0, 5: 420.0}
    by_flops = partition_costs(params, "balanced", layer_of=layer_of, head_flops_per_token=800.0,
                               attention_flops_per_token=10.0)
    assert by_flops == {0: 42.0, 1: 42.0, 2: 42.0, 3: 42.0, 4: 42.0, 5: 842.0}
    # even: three layers each; by FLOPs the head's stage keeps its last layer alone
    even = split_stages(params, 2)
    assert [sorted({layer_of(params[i][0]) for i in s} - {None}) for s in even] == \
        [[0, 1, 2], [3, 4, 5]]
    heavy = split_stages(params, 2, by_flops)
    assert [sorted({layer_of(params[i][0]) for i in s} - {None}) for s in heavy] == \
        [[0, 1, 2, 3, 4], [5]]
    assert heavy[0][0] == 0 and heavy[-1][-1] == len(params) - 1
    with pytest.raises(ValueError, match="partition must be one of.*'random'"):
        partition_costs(params, "random", layer_of=layer_of)


def test_ends_partition_gives_the_first_and_last_stage_one_layer_fewer() -> None:
    from flowtrain.plan.partition import partition_costs
    from sims.workload import layer_of, split_stages

    # Llama 3 405B's cut (arXiv:2407.21783 Sec. 3.3.2): 126 layers on 16 stages x 2 chunks,
    # the embedding and the loss counted as a layer each: 3 + 30 x 4 + 3
    params = [("embed.weight", (10, 4), "float32", 4)]
    params += [(f"layers.{i}.w", (4, 4), "float32", 4) for i in range(126)]
    params += [("head.weight", (10, 4), "float32", 4)]
    ends = partition_costs(params, "ends", layer_of=layer_of)
    # the embedding and the loss are items of the cut, keyed next to the end layers
    assert ends == {n: 1.0 for n in range(-1, 127)}
    chunks = split_stages(params, 32, ends)
    counts = [len({layer_of(params[i][0]) for i in c} - {None}) for c in chunks]
    assert counts == [3] + [4] * 30 + [3]
    assert chunks[0][0] == 0 and chunks[-1][-1] == len(params) - 1
    # the plain even cut gives the first chunk four
    assert len({layer_of(params[i][0]) for i in split_stages(params, 32)[0]} - {None}) == 4
    # chunks of one layer (16 stages x 8): "the first model chunk on the first stage has only
    # the embedding, and the last model chunk on the last stage has only output projection and
    # loss calculation"
    single = split_stages(params, 128, ends)
    assert single[0] == [0] and single[-1] == [len(params) - 1]
    assert all(len(c) == 1 and layer_of(params[c[0]][0]) == k for k, c in
               enumerate(single[1:-1]))
    with pytest.raises(ValueError, match="pp 129 needs at least 129"):
        split_stages(params, 129, ends)
