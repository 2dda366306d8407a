"""``flowtrain.zero.Init`` partitions a model as it is built (DeepSpeed's zero.Init under
stage 3) on 2 real ranks: each parameter keeps a 1/N slice of rank 0's values and no whole
storage, GatheredParameters edits reach every rank's slice, and training from such a model
under stage 3 (fp32, bf16) and stage 1 gives the losses and weights of the same model built
whole."""

from __future__ import annotations

from typing import Any

import pytest

from helpers import DATA, check_cases, launch, rank_results

pytestmark = [pytest.mark.timeout(300), pytest.mark.multiprocess]
WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("zero_init") / "out"
    launch(WORLD, DATA / "zero_init_worker.py", str(out), run_dir=out.parent / "run",
           timeout=240)
    return check_cases(rank_results(out, WORLD))


def test_init_keeps_a_slice_of_rank0_values(ranks: list[dict[str, Any]]) -> None:
    for data in ranks:
        built = data["built"]
        for name, p in built["params"].items():
            assert p["shape"] == p["ds_shape"], name
            assert p["slice"] == p["expected_slice"], name
            # one placeholder element, not the parameter's numel
            assert p["storage_bytes"] <= 4, (name, p["storage_bytes"])
            assert p["whole"] == pytest.approx(built["reference"][name], abs=0), name


def test_gathered_parameters_edit_reaches_every_slice(ranks: list[dict[str, Any]]) -> None:
    slices = []
    for data in ranks:
        g = data["gathered"]
        assert g["seen"] == [0.25] * len(g["seen"])
        assert g["placeholder_after"] <= 4
        slices += g["slice"]
    assert slices[:len(ranks[0]["gathered"]["seen"])] == \
        [0.25] * len(ranks[0]["gathered"]["seen"])


@pytest.mark.parametrize("case,tol", [("s3", 1e-6), ("s3_bf16", 0.0), ("s1", 1e-6)])
def test_training_from_init_model_matches_whole_model(ranks: list[dict[str, Any]], case: str,
                                                      tol: float) -> None:
    for data in ranks:
        got, want = data[case]["init"], data[case]["whole"]
        assert got["losses"] == pytest.approx(want["losses"], rel=tol, abs=tol)
        for name, values in want["params"].items():
            assert got["params"][name] == pytest.approx(values, rel=tol, abs=tol), name


def test_init_with_a_stage2_config_leaves_parameters_whole(
        ranks: list[dict[str, Any]]) -> None:
    for data in ranks:
        assert data["not_stage3"]["partitioned"] == []
