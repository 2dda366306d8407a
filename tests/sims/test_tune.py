"""`flowtrain tune`: the search against the simulator it rests on (every fitting configuration
ranked by predicted throughput, the dropped ones with their reasons, a true memory/throughput
frontier, a chosen ds_config that keeps the global batch), real trials on 2 CPU ranks (picked
by measurement; out of memory reported, not crashed), the largest micro-batch backing off while
trials run out of memory, and bad input as one line with exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flowtrain.config import load_config
from helpers import EXAMPLES
from sim_helpers import cpu_profile
from sims import tune, tune_trials
from sims.tune import Candidate, Space, TuneError

DEMO = "gpt:build_demo_model"


@pytest.fixture()
def demo_config(tmp_path: Path) -> dict[str, Any]:
    raw: dict[str, Any] = json.loads((EXAMPLES / "ds_config_gpt.json").read_text())
    return raw


@pytest.fixture()
def cpu_cluster(tmp_path: Path) -> str:
    path = tmp_path / "cpu.json"
    cpu_profile().save(path)
    return str(path)


@pytest.fixture()
def examples_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setenv("PYTHONPATH", str(EXAMPLES))


def test_search_ranks_what_fits_and_drops_the_rest_with_why() -> None:
    config = {"train_batch_size": 64, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    result = tune.search("llama2-7b", config, cluster="h100-x8", nodes=1,
                         space=Space(zero_stages=(1, 3), micro_batches=(1, 4),
                                     virtual_stages=(1,), buckets=(500_000_000,),
                                     prefetch=(50_000_000,)))
    assert len(result.ranked) + len(result.dropped) >= 20
    rates = [p.prediction.samples_per_s for p in result.ranked if p.prediction]
    assert rates == sorted(rates, reverse=True)
    assert all((p.memory_bytes or 0) <= result.memory_limit_bytes for p in result.ranked)
    oom = [p for p in result.dropped if (p.dropped or "").startswith("needs ")]
    assert oom and all((p.memory_bytes or 0) > result.memory_limit_bytes for p in oom)
    # the frontier: nothing else has both less (or equal) memory and more throughput
    for p in result.frontier:
        assert not any((q.memory_bytes or 0) <= (p.memory_bytes or 0) and
                       q.prediction.samples_per_s > p.prediction.samples_per_s  # type: ignore
                       for q in result.ranked if q is not p)
    # the chosen config keeps the global batch on its layout
    chosen = result.best.candidate
    cfg = load_config(result.chosen_config(), world_size=8 // (chosen.tp * chosen.pp),
                      check_supported=False)
    assert cfg.global_batch == 64 and cfg.zero_optimization.stage == chosen.zero_stage


def test_a_candidate_writes_a_ds_config_deepspeed_reads() -> None:
    base = {"train_batch_size": 64, "zero_optimization": {"stage": 3,
                                                          "stage3_max_live_parameters": 1e9,
                                                          "offload_param": {"device": "cpu"}}}
    z1 = Candidate(1, 2, 4, tp=2, pp=2, virtual_stages=2, offload=True, recompute="full",
                   bucket=25_000_000).ds_config(base)
    assert "train_batch_size" not in z1  # the batch rule derives it
    assert z1["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 25_000_000,
                                       "offload_optimizer": {"device": "cpu",
                                                             "pin_memory": True}}
    assert z1["tensor_parallel"] == {"tp_size": 2}
    assert z1["pipeline"] == {"stages": 2, "schedule": "interleaved", "virtual_stages": 2}
    assert "activation_checkpointing" in z1
    z3 = Candidate(3, 4, 2, prefetch=50_000_000).ds_config(base)
    assert z3["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000
    assert z3["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert "pipeline" not in z3 and "tensor_parallel" not in z3
    assert load_config(z3, world_size=8).global_batch == 64


def test_search_on_a_cpu_host_covers_fifty_configurations(
        demo_config: dict[str, Any], cpu_cluster: str, examples_on_path: None) -> None:
    result = tune.search(DEMO, demo_config, cluster=cpu_cluster, seq_len=64)
    assert len(result.ranked) + len(result.dropped) >= 50
    # on a CPU host: no offload (its memory is the host's), no tp/pp for a plain module
    assert not any(p.candidate.offload or p.candidate.tp > 1 or p.candidate.pp > 1
                   for p in result.ranked)
    assert {p.candidate.micro_batch * p.candidate.accumulation * 2 for p in result.ranked} \
        == {32}


def test_verify_measures_real_trials_and_picks_by_measurement(
        demo_config: dict[str, Any], cpu_cluster: str, examples_on_path: None) -> None:
    result = tune.search(DEMO, demo_config, cluster=cpu_cluster, seq_len=64,
                         space=Space(zero_stages=(0, 3), micro_batches=(4, 16),
                                     buckets=(25_000_000,), prefetch=(50_000_000,)))
    tune_trials.verify(result, 2, seq_len=64, steps=2, warmup=1, timeout_s=240)
    tried = tune_trials.distinct(result.ranked, 2)
    assert len(tried) == 2
    assert all(p.measured_step_s and p.measured_step_s > 0 for p in tried), \
        [p.trial_error for p in tried]
    assert result.chosen is min(tried, key=lambda p: tune_trials.estimate(p, result.scale))
    assert result.scale == pytest.approx(sorted(
        (p.measured_step_s or 0) / (p.predicted_step_s or 1) for p in tried)[0] / 2 + sorted(
        (p.measured_step_s or 0) / (p.predicted_step_s or 1) for p in tried)[1] / 2)


def test_a_trial_over_its_memory_reports_it_instead_of_crashing(
        demo_config: dict[str, Any], cpu_cluster: str, examples_on_path: None) -> None:
    result = tune.search(DEMO, demo_config, cluster=cpu_cluster, seq_len=32,
                         space=Space(zero_stages=(0,), micro_batches=(16,),
                                     buckets=(25_000_000,)))
    limit = 0.4 * 2**30
    # ~1 MiB of activations a sample at 32 tokens: 1024 samples are far over 0.4 GiB, 32 far
    # under
    big = tune_trials.run_trial(result, Candidate(0, 1024, 1), seq_len=32, steps=1, warmup=0,
                                memory_limit=limit, timeout_s=240)
    small = tune_trials.run_trial(result, Candidate(0, 32, 1), seq_len=32, steps=1, warmup=0,
                                  memory_limit=limit, timeout_s=240)
    assert big["oom"] and not big.get("error")
    assert not small["oom"] and small["step_s"] > 0 and small["used_bytes"] < limit


def test_largest_micro_batch_backs_off_while_trials_run_out_of_memory(
        demo_config: dict[str, Any], cpu_cluster: str, monkeypatch: pytest.MonkeyPatch,
        examples_on_path: None) -> None:
    result = tune.search(DEMO, demo_config, cluster=cpu_cluster, seq_len=64,
                         space=Space(zero_stages=(0,), micro_batches=(16,),
                                     buckets=(25_000_000,)))
    # an optimistic prediction, and a device that holds up to 100 samples
    monkeypatch.setattr(tune_trials, "largest_micro_batch", lambda *a, **k: 512)
    seen: list[int] = []

    def trial(result: Any, candidate: Candidate, **_: Any) -> dict[str, Any]:
        seen.append(candidate.micro_batch)
        return {"oom": candidate.micro_batch > 100, "step_s": 0.1}

    monkeypatch.setattr(tune_trials, "run_trial", trial)
    found = tune_trials.confirm_largest_micro_batch(result, seq_len=64)
    assert seen == [512, 256, 128, 64]
    assert found == {"predicted": 512, "confirmed": 64,
                     "trials": [[512, "out of memory"], [256, "out of memory"],
                                [128, "out of memory"], [64, "fits"]]}


def test_the_pick_weighs_a_trial_against_the_refitted_prediction() -> None:
    from sims.tune import Point

    class Predicted:
        def __init__(self, step: float) -> None:
            self.step_time_s, self.peak_memory_bytes = step, 1.0

    a, b = (Point(Candidate(0, 16, 1)), Point(Candidate(1, 16, 1)))
    a.prediction, b.prediction = Predicted(1.0), Predicted(1.2)  # type: ignore[assignment]
    # a's trial strayed 4 % slow; b's prediction says it is 20 % slower: a stays the pick
    a.measured_step_s, b.measured_step_s = 1.04, 1.0
    assert tune_trials.estimate(a, 1.0) < tune_trials.estimate(b, 1.0)
    # a measured difference larger than the model's keeps the measurement's order
    b.measured_step_s = 0.8
    assert tune_trials.estimate(b, 1.0) < tune_trials.estimate(a, 1.0)
    # without a refit, the measurement alone
    assert tune_trials.estimate(a, None) == 1.04


def test_trials_go_to_configurations_the_simulator_tells_apart(
        demo_config: dict[str, Any], cpu_cluster: str, examples_on_path: None) -> None:
    # the demo GPT has 0.6 M parameters: a 25M and a 500M bucket both hold all of it, so
    # the two configurations predict alike and one trial stands for both
    result = tune.search(DEMO, demo_config, cluster=cpu_cluster, seq_len=64,
                         space=Space(zero_stages=(0,), micro_batches=(8, 16)))
    assert len(result.ranked) == 4
    picked = tune_trials.distinct(result.ranked, 3)
    assert len(picked) == 2
    assert {p.candidate.micro_batch for p in picked} == {8, 16}


def test_the_api_door_is_flowtrain_tune(demo_config: dict[str, Any], cpu_cluster: str,
                                        examples_on_path: None) -> None:
    from flowtrain import tune as api

    result = api.search(DEMO, demo_config, cluster=cpu_cluster, seq_len=64,
                        space=Space(zero_stages=(0,), micro_batches=(16,)))
    assert result.ranked and result.best.candidate.micro_batch == 16


@pytest.mark.parametrize(("args", "expected"), [
    (["--model", "gpt9"], "gpt9"),
    (["--model", "gpt2", "--global-batch", "7", "--devices-per-node", "2",
      "--zero-stages", "1"], "no configuration keeps the global batch 7"),
    (["--model", "gpt2", "--nodes", "0"], "--nodes must be at least 1"),
    (["--model", "gpt2", "--memory-limit", "0.001"], "none of the"),
    (["--model", "gpt2", "--zero-stages", "1,5"], "ZeRO stages are 0 to 3"),
])
def test_bad_input_is_one_line_and_exit_two(args: list[str], expected: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from flowtrain.cli import main

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 16, "optimizer": {"type": "AdamW",
                                                                     "params": {"lr": 1e-4}}}))
    code = main(["tune", "--config", str(cfg), "--cluster", "h100-x8",
                 "--output", str(tmp_path / "out.json"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "out.json").exists()


def test_tune_writes_the_chosen_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    from flowtrain.cli import main

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 32, "bf16": {"enabled": True},
                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}))
    out = tmp_path / "tuned.json"
    code = main(["tune", "--model", "gpt2", "--config", str(cfg), "--cluster", "h100-x8",
                 "--zero-stages", "0,1", "--micro-batches", "1,2,4", "--output", str(out),
                 "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert json.loads(out.read_text()) == report["chosen_config"]
    assert report["chosen"]["label"] == report["ranked"][0]["label"]
    assert report["searched"] == len(report["ranked"]) + len(report["dropped"])


def test_tune_error_is_a_usage_error() -> None:
    assert issubclass(TuneError, ValueError)
