"""A tied embedding's gradient reduced in two parts (flowtrain/engine/embedding_rows.py): on 2
real ranks against torch DDP, with the shared-memory and the gloo channel, with gradient
accumulation, and the dense fallback when the ranks' rows outnumber the vocabulary (which a
resumed run keeps); in this process, which modules qualify."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from flowtrain.engine.embedding_rows import tied_embeddings
from helpers import DATA, check_cases, launch, rank_results

WORKER = DATA / "tied_worker.py"
TOL = 1e-5

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("tied") / "out"
    launch(2, WORKER, str(out), "rows_shm,rows_torch_gas2,whole,ddp,ddp_gas2,dense_fallback,"
           "ddp_small,dense_resume", run_dir=out.parent / "run", timeout=240)
    return check_cases(rank_results(out, 2))


def close(a: list[float], b: list[float], what: str) -> None:
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert x == pytest.approx(y, rel=TOL, abs=TOL), f"{what}: step {i + 1}: {x} != {y}"


def params_close(a: dict[str, list[float]], b: dict[str, list[float]], what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        x, y = torch.tensor(a[name]), torch.tensor(b[name])
        assert torch.allclose(x, y, rtol=TOL, atol=TOL), \
            f"{what}: {name}: max diff {float((x - y).abs().max())}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("case,ddp", [("rows_shm", "ddp"), ("rows_torch_gas2", "ddp_gas2"),
                                      ("whole", "ddp"), ("dense_fallback", "ddp_small")])
def test_split_tied_gradient_trains_as_ddp(ranks: list[dict[str, Any]], case: str,
                                           ddp: str) -> None:
    for r in range(2):
        close(ranks[r][case]["losses"], ranks[r][ddp]["losses"], f"rank {r} {case} vs {ddp}")
    params_close(ranks[0][case]["params"], ranks[0][ddp]["params"], f"{case} vs {ddp}")
    # the ranks' weights stay bit-identical: every rank adds the rows in the same order
    assert ranks[0][case]["params"] == ranks[1][case]["params"]


@pytest.mark.multiprocess
def test_a_resumed_run_keeps_the_split_off_and_continues_exactly(
        ranks: list[dict[str, Any]]) -> None:
    for r in range(2):
        run = ranks[r]["dense_resume"]
        # switched off in the saved run's first step; off in the resumed engine before its
        # first, with the buckets as the saved run had re-observed them
        assert not run["saved"]["split_enabled"] and not run["loaded"]["split_enabled"]
        assert run["loaded"]["layout"] == run["saved"]["layout"]
        # bit for bit: the resumed steps reduce the tied gradient as the uninterrupted run did
        assert run["resumed"]["losses"] == run["full"]["losses"][-len(run["resumed"]["losses"]):]
        assert run["resumed"]["params"] == run["full"]["params"]


@pytest.mark.multiprocess
def test_split_moves_the_tied_bucket_to_the_front(ranks: list[dict[str, Any]]) -> None:
    for r in range(2):
        split, whole = ranks[r]["rows_shm"], ranks[r]["whole"]
        assert split["split"] and split["split_enabled"]
        # with the split the tied weight's gradient is complete once the head's backward is
        # done, the first thing backward does; whole, it waits for the embedding, the last
        assert split["first_bucket"] == "emb.weight"
        assert whole["first_bucket"] != "emb.weight" and not whole["split"]
        assert split["outside_grad"] and whole["outside_grad"]


@pytest.mark.multiprocess
def test_the_run_records_the_rows_for_the_simulator(ranks: list[dict[str, Any]]) -> None:
    """plan.json names the tied weight and its lookups per micro-batch (3 sequences of 5
    tokens), from which the simulator prices the split; the rows' exchange is a span of its own
    (``reduce/rows``) while the split is on, and none once it is off or never was."""
    for case in ("rows_shm", "whole", "dense_fallback"):
        assert ranks[0][case]["plan_tied"] == [{"param": "emb.weight",
                                                "lookups_per_micro_batch": 15}], case
    for r in range(2):
        assert ranks[r]["rows_shm"]["rows_span"] and ranks[r]["rows_torch_gas2"]["rows_span"]
        assert not ranks[r]["whole"]["rows_span"]
        assert not ranks[r]["dense_fallback"]["rows_span"]


@pytest.mark.multiprocess
def test_rows_outnumbering_the_vocabulary_switch_the_split_off(
        ranks: list[dict[str, Any]]) -> None:
    for r in range(2):
        assert ranks[r]["dense_fallback"]["split"]
        assert not ranks[r]["dense_fallback"]["split_enabled"]
        # the order observed with the split put the tied bucket first; once the split is off
        # its gradient is complete only at the end of backward, so the buckets are rebuilt
        # from a fresh observation, as without the split
        assert ranks[r]["dense_fallback"]["first_bucket"] == ranks[r]["whole"]["first_bucket"]
        assert ranks[r]["dense_fallback"]["first_bucket"] != "emb.weight"


def test_only_plain_tied_embeddings_qualify() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tied = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.tied.weight
            self.untied = nn.Embedding(10, 4)
            self.renorm = nn.Embedding(10, 4, max_norm=1.0)
            self.renorm_head = nn.Linear(4, 10, bias=False)
            self.renorm_head.weight = self.renorm.weight

    class Scaled(nn.Embedding):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) * 2.0

    model = Model()
    assert tied_embeddings(model) == [model.tied]
    # a subclass's forward may do more than the lookup: left alone even when tied
    sub = nn.Module()
    sub.emb = Scaled(10, 4)
    sub.head = nn.Linear(4, 10, bias=False)
    sub.head.weight = sub.emb.weight
    assert tied_embeddings(sub) == []
    model.tied.weight.requires_grad_(False)
    assert tied_embeddings(model) == []
