"""Checkpoints that reshard: saved on 1, 2 or 4 ranks with ZeRO stage 0-3 and loaded into another
world size and stage, they continue the loss curve of one uninterrupted single-process run, and
``flowtrain checkpoint consolidate`` gives the saving engine's fp32 parameters bit for bit.

Four phases (1, 4, 2, 1 ranks, tests/data/reshard_worker.py; the 4- and 2-rank ones launched,
the 1-rank ones in this process) share one checkpoint directory; each checks many cases, one
engine after another."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import reshard_worker as rw
from flowtrain.checkpoint import consolidate
from flowtrain.checkpoint.checkpointer import map_loader_state
from flowtrain.cli import main as cli_main
from flowtrain.config.support import SUPPORTED_FEATURES
from helpers import DATA, launch, rank_results, world1

WORKER = DATA / "reshard_worker.py"
FP32, BF16 = 1e-5, 2e-2
STAGE3 = "zero_stage_3" in SUPPORTED_FEATURES
needs_stage3 = pytest.mark.skipif(
    not STAGE3, reason="ZeRO stage 3 has not landed: flowtrain.config.support."
    "SUPPORTED_FEATURES lacks 'zero_stage_3'")
PHASES = (("one_a", 1), ("four", 4), ("two", 2), ("one_b", 1))

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The phases in order; the 1-rank ones in this process (world size 1, no launch)."""
    root = tmp_path_factory.mktemp("reshard")
    out: dict[str, Any] = {"ckpt": root / "ckpt"}
    for phase, world in PHASES:
        if world == 1:
            with world1():
                results, tensors = rw.run_phase(phase, str(root / "ckpt"))
            out[phase] = {"ranks": [results], "tensors": tensors}
            continue
        launch(world, WORKER, phase, str(root / phase), str(root / "ckpt"),
               run_dir=root / f"run-{phase}", timeout=180)
        out[phase] = {"ranks": rank_results(root / phase, world),
                      "tensors": torch.load(f"{root / phase}.pt")}
    return out


def case(runs: dict[str, Any], phase: str, name: str) -> dict[str, Any]:
    """Rank 0's result of one case (with its tensors), after checking no rank failed it."""
    for r, ranks in enumerate(runs[phase]["ranks"]):
        assert name in ranks, f"{phase}: no case {name!r} on rank {r}"
        assert "error" not in ranks[name], f"{phase} rank {r} {name}:\n{ranks[name]['error']}"
    return {**runs[phase]["ranks"][0][name], "tensors": runs[phase]["tensors"].get(name, {})}


def close_curve(got: dict[str, float], ref: dict[str, float], steps: range, tol: float,
                what: str) -> None:
    assert sorted(got, key=int) == [str(s) for s in steps], what
    for s in steps:
        assert got[str(s)] == pytest.approx(ref[str(s)], rel=tol, abs=tol / 10), \
            f"{what}: step {s}: {got[str(s)]} vs the single run's {ref[str(s)]}"


RESUMES = [
    pytest.param("four", "w1_s0->s1", id="1->4_ranks_stage0->1"),
    pytest.param("two", "w4_s2->s0", id="4->2_ranks_stage2->0"),
    pytest.param("two", "w1_s0->s1", id="1->2_ranks_stage0->1"),
    pytest.param("one_b", "w2_s1->s2", id="2->1_ranks_stage1->2"),
    pytest.param("one_b", "w4_s2->s0", id="4->1_ranks_stage2->0"),
    pytest.param("two", "w4_s2->s1_gas2", id="4->2_ranks_stage2->1_micro2x2"),
    pytest.param("two", "w4_s3->s1", id="4->2_ranks_stage3->1", marks=needs_stage3),
    pytest.param("one_b", "w4_s3->s0", id="4->1_ranks_stage3->0", marks=needs_stage3),
    pytest.param("four", "w1_s0->s3", id="1->4_ranks_stage0->3", marks=needs_stage3),
    pytest.param("two", "w4_s2->s3", id="4->2_ranks_stage2->3", marks=needs_stage3),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("phase,name", RESUMES)
def test_resume_continues_the_single_run_loss_curve(runs: dict[str, Any], phase: str,
                                                    name: str) -> None:
    ref = case(runs, "one_a", "reference")
    got = case(runs, phase, name)
    # counters, Adam's step and the dataloader position come back; steps 5-8 see the same
    # samples and the same lr as the single run, and Adam's moments make the curve agree
    assert got["start"] == rw.HALF and got["global_samples"] == rw.HALF * rw.GLOBAL_BATCH
    assert got["optimizer_steps"] == [float(rw.HALF)]
    # the epoch's first 32 samples read, counted in this run's batches (gas per step on each
    # rank: the saving run read 4 batches per rank, the micro2x2 one counts 8), and the
    # accumulation window starts afresh
    gas = 2 if name.endswith("gas2") else 1
    assert got["batches_taken"] == rw.HALF * gas
    assert got["micro_steps"] == rw.HALF * gas
    close_curve(got["losses"], ref["losses"], range(rw.HALF + 1, rw.STEPS + 1), FP32, name)
    assert {s: got["lrs"][s] for s in got["lrs"]} == \
        {s: ref["lrs"][s] for s in got["lrs"]}


@pytest.mark.multiprocess
@pytest.mark.parametrize("phase,name", [
    pytest.param("four", "save_s2", id="4_ranks_stage2"),
    pytest.param("two", "save_s1", id="2_ranks_stage1"),
    pytest.param("four", "save_s3", id="4_ranks_stage3", marks=needs_stage3)])
def test_saving_runs_follow_the_single_run(runs: dict[str, Any], phase: str, name: str) -> None:
    """The runs that saved continue uninterrupted on the same curve: the tolerance above is
    the one world sizes and stages differ by anyway."""
    ref = case(runs, "one_a", "reference")
    close_curve(case(runs, phase, name)["losses"], ref["losses"], range(1, rw.STEPS + 1), FP32,
                name)


@pytest.mark.multiprocess
def test_precision_changes_keep_the_fp32_masters(runs: dict[str, Any]) -> None:
    ref = case(runs, "one_a", "reference")
    # fp32 (4 ranks, stage 2) into bf16 (2 ranks, stage 2): the masters are the fp32 values
    saved = case(runs, "four", "save_s2")["tensors"]["at_save"]
    into_bf16 = case(runs, "two", "w4_s2->s2_bf16")
    for name, value in saved.items():
        assert torch.equal(into_bf16["tensors"]["loaded"][name], value), name
        model = into_bf16["tensors"]["module_loaded"][name]
        assert torch.equal(model, value.bfloat16().float()), name
    close_curve(into_bf16["losses"], ref["losses"], range(rw.HALF + 1, rw.STEPS + 1), BF16,
                "fp32 -> bf16")
    # bf16 (2 ranks, stage 1) into fp32 (1 rank, stage 0): the fp32 masters, not the bf16 model
    saver = case(runs, "two", "save_s1_bf16")
    into_fp32 = case(runs, "one_b", "w2_s1_bf16->s0")
    rounded = 0
    for name, value in saver["tensors"]["at_save"].items():
        assert torch.equal(into_fp32["tensors"]["loaded"][name], value), name
        rounded += int((value.bfloat16().float() != value).sum())
    assert rounded > 100  # the masters hold more than the bf16 model did
    close_curve(into_fp32["losses"], saver["losses"], range(rw.HALF + 1, rw.STEPS + 1), BF16,
                "bf16 -> fp32")
    # fp32 into fp16: the masters as saved; the fp32 run had no loss scale to give, so the
    # fp16 engine keeps its own dynamic one (2**8 here), and the curve goes on
    into_fp16 = case(runs, "one_b", "w4_s2->s0_fp16")
    assert into_fp16["loss_scale"] == 2.0 ** 8
    for name, value in saved.items():
        assert torch.equal(into_fp16["tensors"]["loaded"][name], value), name
    close_curve(into_fp16["losses"], ref["losses"], range(rw.HALF + 1, rw.STEPS + 1), BF16,
                "fp32 -> fp16")


CONSOLIDATED = [
    pytest.param("w1_s0", "one_a", "reference", id="1_rank_stage0"),
    pytest.param("w4_s2", "four", "save_s2", id="4_ranks_stage2"),
    pytest.param("w2_s1", "two", "save_s1", id="2_ranks_stage1"),
    pytest.param("w2_s1_bf16", "two", "save_s1_bf16", id="2_ranks_stage1_bf16"),
    pytest.param("w4_s3", "four", "save_s3", id="4_ranks_stage3", marks=needs_stage3),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("ckpt,phase,name", CONSOLIDATED)
def test_consolidate_is_the_saving_engines_parameters(runs: dict[str, Any], tmp_path: Path,
                                                      ckpt: str, phase: str, name: str) -> None:
    saver = case(runs, phase, name)["tensors"]
    out = tmp_path / "full.pt"
    assert cli_main(["checkpoint", "consolidate", str(runs["ckpt"] / ckpt), str(out)]) == 0
    state = torch.load(out)
    assert all(v.dtype == torch.float32 for v in state.values())
    params = saver["at_save"]
    for key, value in state.items():
        # trainable: the fp32 master, bit for bit; buffers and frozen: the saving module's
        expected = params[key] if key in params else saver["module_at_save"][key]
        assert torch.equal(value, expected), key
    model = rw.make_model(0)
    model.load_state_dict(torch.load(out))  # strict: every key, every shape
    assert list(state) == list(model.state_dict())
    # the same through the Python function, with the tag named
    again = consolidate(runs["ckpt"] / ckpt, tag=f"global_step{rw.HALF}")
    assert all(torch.equal(again[k], v) for k, v in state.items())


@pytest.mark.multiprocess
@pytest.mark.parametrize("ckpt,loaded_by", [
    pytest.param("w4_s2", "w4_s2->s0", id="stage2"),
    pytest.param("w2_s1_bf16", "w2_s1_bf16->s0", id="stage1_bf16"),
    pytest.param("w4_s3", "w4_s3->s0", id="stage3", marks=needs_stage3)])
def test_single_process_load_equals_consolidated(runs: dict[str, Any], ckpt: str,
                                                 loaded_by: str) -> None:
    state = consolidate(runs["ckpt"] / ckpt)
    got = case(runs, "one_b", loaded_by)["tensors"]
    for key, value in got["loaded"].items():
        assert torch.equal(value, state[key]), key
    for key in ("shift", "frozen.weight", "frozen.bias"):
        assert torch.equal(got["module_loaded"][key], state[key]), key


@pytest.mark.multiprocess
def test_every_rank_writes_its_own_pieces(runs: dict[str, Any]) -> None:
    tensors = runs["ckpt"] / "w4_s2" / f"global_step{rw.HALF}" / "tensors"
    metadata = dcp.FileSystemReader(str(tensors)).read_metadata()
    files = {info.relative_path for index, info in metadata.storage_data.items()
             if index.fqn.startswith(("param/", "optim/"))}
    assert files == {f"__{r}_0.distcp" for r in range(4)}
    # buffers and frozen parameters come from rank 0 alone
    assert {info.relative_path for index, info in metadata.storage_data.items()
            if index.fqn.startswith("module/")} == {"__0_0.distcp"}
    assert sorted(metadata.state_dict_metadata) == sorted(
        [f"param/{n}" for n in rw.TRAINABLE] + [f"module/{n}" for n in rw.WHOLE] +
        [f"optim/{n}/{k}" for n in rw.TRAINABLE for k in ("exp_avg", "exp_avg_sq")])
    ckpt = tensors.parent
    assert sorted(p.name for p in ckpt.iterdir()) == \
        ["engine_state.pt", "manifest.json"] + [f"rank{r:05d}_states.pt" for r in range(4)] + \
        ["tensors"]


@pytest.mark.multiprocess
def test_load_module_only(runs: dict[str, Any]) -> None:
    state = consolidate(runs["ckpt"] / "w4_s2")
    only = case(runs, "one_b", "module_only")
    assert only["global_steps"] == 0 and only["optimizer_state"] == 0
    for key, value in only["tensors"]["loaded"].items():
        assert torch.equal(value, state[key]), key


@pytest.mark.multiprocess
@pytest.mark.parametrize("phase,name", [
    pytest.param("one_b", "custom_load_fn", id="1_rank_stage1"),
    pytest.param("two", "custom_load_fn_s3", id="2_ranks_stage3", marks=needs_stage3)])
def test_custom_load_fn(runs: dict[str, Any], phase: str, name: str) -> None:
    state = consolidate(runs["ckpt"] / "w4_s2")
    custom = case(runs, phase, name)
    assert custom["keys"] == list(state)  # the whole state dict, in the model's order
    assert custom["global_steps"] == rw.HALF and custom["optimizer_steps"] == [float(rw.HALF)]
    for key, value in custom["tensors"]["loaded"].items():
        assert torch.equal(value, state[key]), key


@pytest.mark.multiprocess
def test_entries_that_do_not_match(runs: dict[str, Any]) -> None:
    got = case(runs, "one_b", "mismatches")
    assert "size mismatch for head.weight" in got["size"] and "(1, 7)" in got["size"] and \
        "(2, 7)" in got["size"]
    assert "missing from the checkpoint: extra" in got["strict"] and \
        "load_module_strict=False" in got["strict"]
    assert got["lenient"] is None and got["extra"] == [3.0, 3.0]  # left as the model had it
    state = consolidate(runs["ckpt"] / "w4_s2")
    for key, value in got["tensors"]["loaded"].items():
        assert torch.equal(value, state[key]), key


def test_consolidate_bad_input_is_one_line(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    for args, fragment in (
            ([str(tmp_path / "nope")], "does not exist"),
            ([str(tmp_path / "empty")], "no 'latest' file"),
            ([str(tmp_path / "empty"), "--tag", "global_step3"], "global_step3"),
    ):
        assert cli_main(["checkpoint", "consolidate", args[0], str(tmp_path / "out.pt"),
                         *args[1:]]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith("flowtrain checkpoint consolidate: error: "), lines[0]
        assert fragment in lines[0] and args[0] in lines[0], lines[0]
    assert not (tmp_path / "out.pt").exists()


def test_dataloader_position_maps_by_global_samples() -> None:
    from torch.utils.data import DistributedSampler

    saved = {"epoch": 1, "batches_taken": 3, "exhausted": False, "world_size": 4,
             "batch_size": 2}
    assert map_loader_state(saved, 4, 2) == ({"epoch": 1, "batches_taken": 3,
                                              "exhausted": False}, None)
    assert map_loader_state(saved, 2, 4)[0]["batches_taken"] == 3
    assert map_loader_state(saved, 3, 2)[0]["batches_taken"] == 4  # 24 samples either way
    state, why = map_loader_state(saved, 1, 5)  # 24 is not a multiple of 5
    assert state["batches_taken"] == 4 and why is not None
    assert "24 samples" in why and "sample 20" in why and "4 samples again" in why
    assert map_loader_state({**saved, "exhausted": True}, 1, 5) == \
        ({"epoch": 1, "batches_taken": 3, "exhausted": True}, None)
    # why it holds: what N ranks took together is the start of the epoch's permutation
    data = list(range(40))

    def order(world: int, rank: int) -> list[int]:
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=3)
        sampler.set_epoch(1)
        return list(sampler)

    taken = sorted(i for r in range(4) for i in order(4, r)[:3 * 2])
    assert taken == sorted(order(1, 0)[:24])
    rest = sorted(i for r in range(2) for i in order(2, r)[3 * 4:])
    assert sorted(taken + rest) == data
