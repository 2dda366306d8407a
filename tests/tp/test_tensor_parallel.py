"""Tensor parallelism on 2 real ranks: the example GPT split Megatron-style by
``tensor_parallel.tp_size: 2`` gives the unsplit model's forward outputs, per-step losses and
clipping norm (tied and untied head); the vocab-parallel cross-entropy equals torch's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import tp_ckpt_worker as tw
from flowtrain.checkpoint import consolidate
from helpers import DATA, check_cases, launch, rank_results, world1

WORKER = DATA / "tp_worker.py"


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("tp") / "out"
    launch(2, WORKER, str(out), "2", run_dir=out.parent / "run")
    return check_cases(rank_results(out, 2))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["tied", "untied", "client"])
def test_split_gpt_matches_the_unsplit_model(tp_run: list[dict[str, Any]], case: str) -> None:
    for data in tp_run:
        got = data[case]
        assert got["forward_max_diff"] < 1e-5
        assert got["losses"] == pytest.approx(got["ref_losses"], rel=1e-5, abs=1e-6)
        assert got["grad_norm"] == pytest.approx(got["ref_grad_norm"], rel=1e-4)
        assert got["parallel_layers"] == ["ColumnParallelLinear", "RowParallelLinear",
                                          "VocabParallelEmbedding"]
        assert got["n_head"] == 2  # 4 heads, 2 per rank
        # each rank holds about half: split matrices halve, norms and biases stay whole
        assert got["local_params"] < 0.6 * got["full_params"]
    assert tp_run[0][case]["losses"] == tp_run[1][case]["losses"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_vocab_parallel_cross_entropy(tp_run: list[dict[str, Any]]) -> None:
    for data in tp_run:
        assert data["xent"]["loss"] == pytest.approx(data["xent"]["ref"], rel=1e-6)
        assert data["xent"]["grad_diff"] < 1e-6


def test_layers_in_one_process_equal_torch_linear() -> None:
    """With a group of one the parallel layers are ordinary layers (same math)."""
    from flowtrain.tp import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    lin = nn.Linear(6, 4)
    x = torch.randn(3, 6)
    for layer in (ColumnParallelLinear.from_linear(lin, None),
                  RowParallelLinear.from_linear(lin, None)):
        assert torch.allclose(layer(x), lin(x), atol=1e-6)


def test_a_pipeline_section_on_a_plain_model_asks_for_a_pipeline_module() -> None:
    from flowtrain.api import check_plain_module_config
    from flowtrain.config import load_config

    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "pipeline": {"stages": 2}},
                      world_size=1)
    with pytest.raises(ValueError, match=r"pipeline.stages is 2, but the model is a plain "
                                         r"nn.Module.*PipelineModule\(layers, num_stages=2\)"):
        check_plain_module_config(cfg)
    check_plain_module_config(load_config({"train_micro_batch_size_per_gpu": 1,
                                            "pipeline": {"activation_checkpoint_interval": 1}},
                                           world_size=1))


def test_indivisible_sizes_are_refused() -> None:
    from flowtrain.tp.auto import _qkv_rows
    from flowtrain.tp.layers import divide_evenly

    with pytest.raises(ValueError, match="out_features 10 is not divisible by "
                                         "tensor_parallel.tp_size 4"):
        divide_evenly(10, 4, "out_features")
    with pytest.raises(ValueError, match="fused qkv projection with 12 outputs"):
        _qkv_rows(nn.Linear(4, 12), 8, 0)
    rows = _qkv_rows(nn.Linear(4, 12), 2, 1)
    assert rows.tolist() == [2, 3, 6, 7, 10, 11]  # the second half of each of q, k, v


# -- tensor parallel x data parallel, and checkpoints across tensor-parallel layouts -------------

CKPT_WORKER = DATA / "tp_ckpt_worker.py"
FP32 = 1e-5


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """tests/data/tp_ckpt_worker.py's phases in order: tp 1 (this process) saves, tp 2 x dp 2
    (4 ranks) saves and loads, tp 1 (this process) loads."""
    root = tmp_path_factory.mktemp("tp_ckpt")
    ckpt = root / "ckpt"
    out: dict[str, Any] = {"ckpt": ckpt}
    for phase in ("one_save", "four", "one_load"):
        if phase != "four":
            with world1():
                results, tensors = tw.run_phase(phase, str(ckpt))
            out[phase] = {"ranks": [results], "tensors": tensors}
            continue
        launch(4, CKPT_WORKER, phase, str(root / phase), str(ckpt),
               run_dir=root / f"run-{phase}", timeout=240)
        out[phase] = {"ranks": rank_results(root / phase, 4),
                      "tensors": torch.load(f"{root / phase}.pt")}
    return out


def _case(layouts: dict[str, Any], phase: str, name: str) -> list[dict[str, Any]]:
    """Every rank's result of one case (rank 0's tensors on the first), none failed."""
    ranks = layouts[phase]["ranks"]
    for r, data in enumerate(ranks):
        assert name in data, f"{phase}: no case {name!r} on rank {r}"
        assert "error" not in data[name], f"{phase} rank {r} {name}:\n{data[name]['error']}"
    return [{**data[name], "tensors": layouts[phase]["tensors"].get(name, {}) if r == 0 else {}}
            for r, data in enumerate(ranks)]


def _follows_reference(got: dict[str, Any], ref: list[list[float]], first: int) -> None:
    """Steps first..STEPS: each rank's loss is the unsplit model's on its data-parallel part
    (one process: the mean over the parts, its whole batch)."""
    assert sorted(got["losses"], key=int) == [str(s) for s in range(first, tw.STEPS + 1)]
    for s in range(first, tw.STEPS + 1):
        parts = ref[s - 1]
        want = parts[got["dp_rank"]] if got["dp"] == tw.DP_REF else sum(parts) / len(parts)
        assert got["losses"][str(s)] == pytest.approx(want, rel=FP32, abs=FP32 / 10), \
            f"step {s} (dp rank {got['dp_rank']} of {got['dp']}, tp {got['tp']})"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["save_s0", "save_s1"], ids=["zero0", "zero1"])
def test_tp2_x_dp2_follows_the_unsplit_model(layouts: dict[str, Any], name: str) -> None:
    ranks = _case(layouts, "four", name)
    ref = layouts["four"]["ranks"][0]["reference"]
    assert [(r["dp"], r["dp_rank"]) for r in ranks] == [(2, 0), (2, 0), (2, 1), (2, 1)]
    for got in ranks:
        _follows_reference(got, ref, 1)
    # the two data-parallel halves see different data; the tensor-parallel pair the same
    assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[2]["losses"] == ranks[3]["losses"]
    assert ranks[0]["losses"] != ranks[2]["losses"]


RESUMES = [
    pytest.param("four", "tp2_s0->s1", "four", "save_s0", id="tp2_zero0->tp2_zero1"),
    pytest.param("four", "tp1->tp2_s0", "one_save", "save_tp1", id="tp1->tp2xdp2"),
    pytest.param("one_load", "tp2_s1->tp1", "four", "save_s1", id="tp2xdp2_zero1->tp1"),
]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("phase,name,saver_phase,saver", RESUMES)
def test_resume_across_tp_layouts(layouts: dict[str, Any], phase: str, name: str,
                                  saver_phase: str, saver: str) -> None:
    """The loading engine holds the saving engine's parameters bit for bit (put together
    from the tensor-parallel slices) and continues the unsplit model's loss curve."""
    ranks = _case(layouts, phase, name)
    saved = _case(layouts, saver_phase, saver)[0]["tensors"]["at_save"]
    ref = layouts[phase]["ranks"][0]["reference"]
    for got in ranks:
        assert got["loaded_step"] == tw.HALF
        _follows_reference(got, ref, tw.HALF + 1)
    loaded = ranks[0]["tensors"]["loaded"]
    assert list(loaded) == list(saved)
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_consolidate_tp2_checkpoint_loads_into_the_unsplit_model(
        layouts: dict[str, Any]) -> None:
    saved = _case(layouts, "four", "save_s1")[0]["tensors"]["at_save"]
    state = consolidate(layouts["ckpt"], tag="tp2_s1")
    model = tw.make_model()
    assert list(state) == list(model.state_dict())
    for key, value in saved.items():
        assert state[key].shape == model.state_dict()[key].shape, key
        assert torch.equal(state[key], value), key
    model.load_state_dict(state)  # strict: every key, every (unsplit) shape
    # tied head: one tensor under both names
    assert state["head.weight"] is state["token_embedding.weight"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_checkpoint_describes_whole_parameters(layouts: dict[str, Any]) -> None:
    """Each tensor under its plain name in its unsplit shape; each tp rank's slice a block at
    its offset along the split dimension (rows for column-parallel, columns for row-parallel)."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(layouts["ckpt"] / "tp2_s0" / "tensors")).read_metadata()
    md = meta.state_dict_metadata
    n, vocab = 16, tw.VOCAB
    assert tuple(md["param/token_embedding.weight"].size) == (vocab, n)
    assert "param/head.weight" not in md  # tied: saved once
    assert tuple(md["param/blocks.0.attn.qkv.weight"].size) == (3 * n, n)
    assert tuple(md["optim/blocks.0.mlp.down.weight/exp_avg"].size) == (n, 4 * n)

    def chunks(key: str) -> list[tuple[list[int], list[int]]]:
        return sorted((list(c.offsets), list(c.sizes)) for c in md[key].chunks)

    # row-parallel: each tp rank's columns, each split in two rows ranges by its dp rank
    assert chunks("param/blocks.0.mlp.down.weight") == [
        ([0, 0], [8, 32]), ([0, 32], [8, 32]), ([8, 0], [8, 32]), ([8, 32], [8, 32])]
    # fused qkv, column-parallel: tp rank 0 holds rows 0-7 of each of q, k and v (rows 0-7,
    # 16-23, 32-39), rank 1 rows 8-15 of each; each dp rank writes 12 of its 24 rows
    qkv = chunks("param/blocks.0.attn.qkv.weight")
    assert qkv == [([0, 0], [8, n]), ([8, 0], [8, n]), ([16, 0], [4, n]), ([20, 0], [4, n]),
                   ([24, 0], [4, n]), ([28, 0], [4, n]), ([32, 0], [8, n]), ([40, 0], [8, n])]
    files = {info.relative_path for index, info in meta.storage_data.items()
             if index.fqn.startswith(("param/", "optim/"))}
    assert files == {f"__{r}_0.distcp" for r in range(4)}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_frozen_split_weight_and_custom_load_fn(layouts: dict[str, Any]) -> None:
    """A frozen tensor-parallel weight is saved whole (each tp rank its slice) and comes
    back; custom_load_fn gets this rank's slices of the whole state dict."""
    saved = _case(layouts, "four", "save_frozen")[0]["tensors"]["at_save"]
    loaded = _case(layouts, "four", "frozen_custom_load")[0]["tensors"]["loaded"]
    fresh = tw.make_model().state_dict()[tw.FROZEN]
    assert not torch.equal(saved[tw.FROZEN], fresh)  # the saver moved it
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key
    state = consolidate(layouts["ckpt"], tag="tp2_frozen")
    assert torch.equal(state[tw.FROZEN], saved[tw.FROZEN])
    tw.make_model().load_state_dict(state)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("phase", ["four", "one_load"])
def test_other_shapes_are_refused_by_name(layouts: dict[str, Any], phase: str) -> None:
    for got in _case(layouts, phase, "refused"):
        message = got["message"]
        assert message is not None, "the load went through"
        assert "size mismatch for token_embedding.weight: the checkpoint has shape (96, 16), " \
               "the model (128, 16)" in message, message
        if phase == "four":
            assert "this tensor-parallel rank holds (64, 16)" in message, message


def test_blocks_put_any_range_of_any_slice_in_place() -> None:
    """``placed``: a range of a tensor-parallel slice's flattening lands where the slice lies
    in the whole tensor, stored whole (format 2) or flattened (format 1)."""
    import random

    from flowtrain.checkpoint.geometry import Split, placed
    from flowtrain.tp.layers import index_runs

    rng = random.Random(0)
    for _ in range(60):
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        d = rng.randrange(len(shape))
        whole_shape = tuple(3 * s if i == d else s for i, s in enumerate(shape))
        rows = rng.sample(range(whole_shape[d]), shape[d])
        whole = torch.randn(whole_shape)
        local = whole.index_select(d, torch.tensor(rows)).contiguous().reshape(-1)
        lo = rng.randint(0, local.numel())
        hi = rng.randint(lo, local.numel())
        held = torch.zeros(local.numel(), dtype=torch.bool)
        held[lo:hi] = True
        mask = torch.zeros(whole_shape, dtype=torch.bool)
        mask.index_copy_(d, torch.tensor(rows), held.view(shape))
        split = Split(d, whole_shape[d], index_runs(torch.tensor(rows)))
        for stored in (whole_shape, (whole.numel(),)):
            out = torch.full(stored, float("nan"))
            for offsets, t in placed(local[lo:hi], shape, split, lo, hi, stored):
                out[tuple(slice(o, o + z) for o, z in zip(offsets, t.shape))] = t
            out = out.view(whole_shape)
            assert torch.equal(out[mask], whole[mask])
            assert out[~mask].isnan().all()
