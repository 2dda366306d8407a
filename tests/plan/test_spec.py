"""The training spec (flowtrain.plan.spec): a config's decisions made once. The reduction
follows DeepSpeed's keys (stage, reduce_scatter) and flowtrain's mirror; the bucket size is the
config's or 25 MiB of parameters; replacing a field re-derives what depends on it; bad values
are named."""

from __future__ import annotations

from typing import Any

import pytest

from flowtrain.config import load_config
from flowtrain.plan.spec import (
    DEFAULT_BUCKET_BYTES,
    GradientReduction,
    bucket_numel,
    decide_reduction,
    resolve,
)


def cfg(world: int = 2, **sections: Any) -> Any:
    return load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                        **sections}, world_size=world)


@pytest.mark.parametrize("stage,scatter,mirrored,expected", [
    (0, True, False, GradientReduction("all_reduce", False)),
    (1, True, False, GradientReduction("reduce_scatter", False)),
    (1, False, False, GradientReduction("all_reduce", False)),
    (2, True, False, GradientReduction("reduce_scatter", True)),
    (2, False, False, GradientReduction("all_reduce", False)),
    (2, True, True, GradientReduction("all_reduce", False)),
    (3, False, False, GradientReduction("reduce_scatter", True)),
])
def test_the_reduction_of_each_stage(stage: int, scatter: bool, mirrored: bool,
                                     expected: GradientReduction) -> None:
    assert decide_reduction(stage, 4, reduce_scatter=scatter, mirrored=mirrored) == expected
    # one rank reduces nothing; a pipeline stage reduces its accumulated gradients once
    assert decide_reduction(stage, 1, reduce_scatter=scatter) == GradientReduction(None, False)
    piped = decide_reduction(stage, 4, reduce_scatter=scatter, mirrored=mirrored,
                             pipeline_stages=2)
    assert piped == GradientReduction(expected.op, False)


def test_the_spec_reduces_as_its_config_says() -> None:
    spec = resolve(cfg(zero_optimization={"stage": 2, "reduce_scatter": False}), dp=2,
                   elem_size=4)
    assert spec.reduction == GradientReduction("all_reduce", False)
    # a replaced field re-derives the decision
    assert spec.replace(reduce_scatter=True).reduction == \
        GradientReduction("reduce_scatter", True)
    assert spec.replace(dp=1).reduction.op is None
    # a mirror only exists for stages 1-2
    stage3 = resolve(cfg(zero_optimization={"stage": 3}), dp=2, elem_size=4, mirrored=True)
    assert not stage3.mirrored and stage3.reduction.every_micro_batch


def test_bucket_size_is_the_configs_or_25_mib_of_parameters() -> None:
    zero = cfg().zero_optimization
    assert bucket_numel(zero, 4) == DEFAULT_BUCKET_BYTES // 4 == 25 * 2**20 // 4
    assert bucket_numel(zero, 2) == 25 * 2**20 // 2
    assert bucket_numel(cfg(zero_optimization={"reduce_bucket_size": 1000}).zero_optimization,
                        4) == 1000
    # ZeRO gathers parameters bucket by bucket too: the smaller size wins
    both = {"stage": 1, "reduce_bucket_size": 1000, "allgather_bucket_size": 600}
    assert bucket_numel(cfg(zero_optimization=both).zero_optimization, 4) == 600
    # without ZeRO nothing is gathered: allgather_bucket_size has no say
    assert bucket_numel(cfg(zero_optimization={**both, "stage": 0}).zero_optimization,
                        4) == 1000
    assert resolve(cfg(zero_optimization=both), dp=2, elem_size=4).bucket_numel == 600


def test_offload_and_precision_are_decided_with_the_stage() -> None:
    offload = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    stage2 = resolve(cfg(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}},
                         bf16={"enabled": True}), dp=2, elem_size=4)
    assert (stage2.offload_optimizer, stage2.offload_params) == ("cpu", "none")
    assert stage2.precision == "bf16" and not stage2.loss_scaling
    assert stage2.compute_dtype == "bfloat16" and stage2.comm_elem_size == 2
    stage3 = resolve(cfg(zero_optimization={"stage": 3, **offload}, fp16={"enabled": True}),
                     dp=2, elem_size=4)
    assert (stage3.offload_optimizer, stage3.offload_params) == ("cpu", "cpu")
    assert stage3.loss_scaling and stage3.comm_dtype == "float16"


def test_pipeline_decisions() -> None:
    spec = resolve(cfg(4, pipeline={"stages": 2, "schedule": "interleaved",
                                    "virtual_stages": 2}), dp=2, pp=2, elem_size=4)
    assert (spec.schedule, spec.virtual_stages, spec.world_size) == ("interleaved", 2, 4)
    flat = resolve(cfg(pipeline={"schedule": "interleaved", "virtual_stages": 2}), dp=2,
                   elem_size=4)
    assert (flat.schedule, flat.virtual_stages) == ("1f1b", 1)


def test_bad_replacements_are_named() -> None:
    spec = resolve(cfg(), dp=2, elem_size=4)
    with pytest.raises(ValueError, match="TrainingSpec has no field 'zero'; fields: dp, tp"):
        spec.replace(zero=2)
    with pytest.raises(ValueError, match=r"TrainingSpec.zero_stage must be 0, 1, 2 or 3, "
                                         r"got 4"):
        spec.replace(zero_stage=4)
    with pytest.raises(ValueError, match="TrainingSpec.dp must be an integer >= 1, got 0"):
        spec.replace(dp=0)
    with pytest.raises(ValueError, match="TrainingSpec.offload_params must be one of none, "
                                         "cpu, nvme, got 'gpu'"):
        spec.replace(offload_params="gpu")
    with pytest.raises(ValueError, match="element size must be at least 1 byte, got 0"):
        resolve(cfg(), dp=2, elem_size=0)


def test_host_shared_parameters_need_zero_one_host_and_the_shm_channel() -> None:
    zero1 = resolve(cfg(zero_optimization={"stage": 1}), dp=2, elem_size=4)
    assert zero1.shares_host_params(shm_channel=True)
    assert not zero1.shares_host_params(shm_channel=False)
    assert not resolve(cfg(), dp=2, elem_size=4).shares_host_params(shm_channel=True)
    assert not zero1.replace(dp=1).shares_host_params(shm_channel=True)
    assert not zero1.replace(tp=2).shares_host_params(shm_channel=True)
    off = resolve(cfg(zero_optimization={"stage": 3}, flowtrain={"zero_shared_params": False}),
                  dp=2, elem_size=4)
    assert not off.zero_shared_params and not off.shares_host_params(shm_channel=True)
