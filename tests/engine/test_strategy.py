"""The engine's strategies (flowtrain.engine.strategy): what each ZeRO stage's way of holding
the group's model states answers, as DeepSpeed's stages behave; and the spec's refusals of
the layouts the engine does not run."""

from __future__ import annotations

from typing import Any

import pytest

from flowtrain.config import load_config
from flowtrain.engine.strategy import (
    Replicated,
    ShardedOptimizer,
    ShardedParameters,
    strategy_for,
)
from flowtrain.plan.spec import TrainingSpec, engine_problem, resolve
from flowtrain.plan.zero_stage import partitions_parameters


def spec(stage: int, dp: int = 4, **zero: Any) -> TrainingSpec:
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                       "zero_optimization": {"stage": stage, **zero}}, world_size=dp)
    return resolve(cfg, dp=dp, elem_size=4)


def test_each_stage_has_its_strategy() -> None:
    kinds = [type(strategy_for(spec(s))) for s in range(4)]
    assert kinds == [Replicated, ShardedOptimizer, ShardedOptimizer, ShardedParameters]


def test_replicated_keeps_master_weights_and_flat_parameters() -> None:
    s = strategy_for(spec(0))
    assert (s.sharded, s.bucket_pad, s.master_weights, s.flat_model) == (False, 1, True, True)
    assert s.splits_tied_rows and s.observes_bucket_order and s.peer_recoverable
    assert s.no_sync_problem() is None and not s.needs_groups()
    fp32 = load_config({"train_micro_batch_size_per_gpu": 1}, world_size=4)
    assert not strategy_for(resolve(fp32, dp=4, elem_size=4)).master_weights


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_strategies_pad_buckets_to_the_group(stage: int) -> None:
    s = strategy_for(spec(stage, dp=4))
    assert (s.sharded, s.bucket_pad, s.master_weights, s.flat_model) == (True, 4, False, False)
    assert not s.splits_tied_rows and not s.observes_bucket_order and s.needs_groups()


def test_no_sync_is_refused_where_gradients_are_partitioned() -> None:
    assert strategy_for(spec(1)).no_sync_problem() is None
    # DeepSpeed refuses no_sync at stage 2 whatever the reduce, and at stage 3
    for s in (spec(2), spec(2, reduce_scatter=False), spec(3)):
        problem = strategy_for(s).no_sync_problem()
        assert problem is not None and f"ZeRO stage {s.zero_stage}" in problem


def test_peer_recovery_needs_what_a_mirror_can_hold() -> None:
    assert strategy_for(spec(1)).peer_recoverable and strategy_for(spec(2)).peer_recoverable
    assert not strategy_for(spec(2, offload_optimizer={"device": "cpu"})).peer_recoverable
    assert not strategy_for(spec(3)).peer_recoverable


def test_layouts_the_engine_does_not_run_are_named() -> None:
    assert engine_problem(spec(1).replace(pp=2)) is None
    piped = engine_problem(spec(2).replace(pp=2))
    assert piped is not None and "zero_optimization.stage 2 with a 2-stage PipelineModule" \
        in piped
    split = engine_problem(spec(3).replace(tp=2))
    assert split is not None and "zero_optimization.stage 3 with tensor_parallel.tp_size 2" \
        in split
    assert [partitions_parameters(s) for s in (0, 1, 2, 3, "auto")] == \
        [False, False, False, True, True]
