"""Tensor parallelism on 2 real ranks: the example GPT split Megatron-style by
``tensor_parallel.tp_size: 2`` gives the unsplit model's forward outputs, per-step losses and
clipping norm (tied and untied head); the vocab-parallel cross-entropy equals torch's."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent / "data"))
import engine_common as ec  # noqa: E402

WORKER = ec.DATA / "tp_worker.py"


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("tp") / "out"
    ec.launch(2, WORKER, str(out), "2", run_dir=out.parent / "run")
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    for r, data in enumerate(ranks):
        for name, result in data.items():
            assert "error" not in result, f"rank {r} {name}:\n{result['error']}"
    return ranks


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["tied", "untied"])
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


def test_indivisible_sizes_are_refused() -> None:
    from flowtrain.tp.auto import _qkv_rows
    from flowtrain.tp.layers import _divide

    with pytest.raises(ValueError, match="out_features 10 is not divisible by "
                                         "tensor_parallel.tp_size 4"):
        _divide(10, 4, "out_features")
    with pytest.raises(ValueError, match="fused qkv projection with 12 outputs"):
        _qkv_rows(nn.Linear(4, 12), 8, 0)
    rows = _qkv_rows(nn.Linear(4, 12), 2, 1)
    assert rows.tolist() == [2, 3, 6, 7, 10, 11]  # the second half of each of q, k, v
