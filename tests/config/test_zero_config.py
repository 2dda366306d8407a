"""ZeRO config keys that contradict each other, ask for NVMe, or are ignored at the configured
stage: each case gives its exact message. The DeepSpeed behaviour each rule follows is in the
comments of flowtrain/config/zero.py and support.py; test_deepspeed_agrees checks it against an
installed DeepSpeed when there is one."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

from flowtrain.config import (
    SUPPORTED_FEATURES,
    ConfigError,
    ConfigWarning,
    load_config,
    unsupported_features,
)

Z = "zero_optimization"


def config(zero: dict, **top) -> dict:
    return {"train_batch_size": 4, Z: zero, **top}


def problems_of(cfg: dict, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(cfg, **kwargs)
    return info.value.problems


def loads_quietly(cfg: dict, **kwargs):
    """Loads without any warning at all."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_config(cfg, **kwargs)


# -- NVMe --------------------------------------------------------------------------------------

NVME_OPT = ('zero_optimization.offload_optimizer.device nvme: offloading to NVMe is not '
            'supported by flowtrain; use "cpu" or "none"')
NVME_PARAM = ('zero_optimization.offload_param.device nvme: offloading to NVMe is not supported '
              'by flowtrain; use "cpu" or "none"')


def test_nvme_device_in_either_section():
    assert problems_of(config({"stage": 2, "offload_optimizer": {
        "device": "nvme", "nvme_path": "/local_nvme"}})) == [NVME_OPT]
    # Valid DeepSpeed, so only the support gate refuses it.
    load_config(config({"stage": 3, "offload_param": {"device": "nvme"}}), check_supported=False)
    found = problems_of(config({"stage": 3, "offload_optimizer": {"device": "NVMe"},
                                "offload_param": {"device": "nvme"}}))
    assert NVME_OPT in found and NVME_PARAM in found


@pytest.mark.parametrize("section", ["offload_optimizer", "offload_param"])
@pytest.mark.parametrize("device", ["cpu", "none"])
def test_nvme_path_without_nvme_device(section, device):
    found = problems_of(config({"stage": 3, section: {"device": device,
                                                      "nvme_path": "/local_nvme"}}))
    assert (f'zero_optimization.{section}.nvme_path "/local_nvme" with device "{device}": '
            f'nvme_path is only for offloading to NVMe, which flowtrain does not support; '
            f'remove nvme_path and use device "cpu" to offload') in found


def test_nvme_path_with_nvme_device_is_one_problem():
    found = problems_of(config({"stage": 2, "offload_optimizer": {
        "device": "nvme", "nvme_path": "/local_nvme"}}))
    assert found == [NVME_OPT]  # no second line about the path


# -- offload and stage -------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_param_needs_stage_3(stage, device):
    found = problems_of(config({"stage": stage, "offload_param": {"device": device}}),
                        check_supported=False)
    assert found == [
        f'zero_optimization.offload_param.device "{device}" with zero_optimization.stage '
        f'{stage}: parameter offload works only with ZeRO stage 3 (DeepSpeed ignores it below '
        f'stage 3, so nothing would be offloaded); set stage 3 or offload_param.device "none"']


def test_offload_param_at_stage_3_and_device_none_below():
    load_config(config({"stage": 3, "offload_param": {"device": "cpu"}}), check_supported=False)
    loads_quietly(config({"stage": 1, "offload_param": {"device": "none"}}))


def test_legacy_cpu_offload_param_below_stage_3():
    with pytest.warns(ConfigWarning, match="cpu_offload_param is deprecated"):
        found = problems_of(config({"stage": 2, "cpu_offload_param": True}),
                            check_supported=False)
    assert found == [
        'zero_optimization.offload_param.device "cpu" with zero_optimization.stage 2: parameter '
        'offload works only with ZeRO stage 3 (DeepSpeed ignores it below stage 3, so nothing '
        'would be offloaded); set stage 3 or offload_param.device "none"']


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_optimizer_needs_a_zero_stage(device):
    assert problems_of(config({"stage": 0, "offload_optimizer": {"device": device}}),
                       check_supported=False) == [
        f'zero_optimization.offload_optimizer.device "{device}" with zero_optimization.stage 0: '
        f'optimizer offload is part of the ZeRO optimizer and needs stage 1, 2 or 3; set one of '
        f'those stages or offload_optimizer.device "none"']


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_optimizer_at_stages_1_to_3(stage):
    load_config(config({"stage": stage, "offload_optimizer": {"device": "cpu"}}),
                check_supported=False)


def test_offload_problems_come_with_the_support_gate():
    """Both kinds of line at once: the contradiction and what flowtrain cannot run."""
    gate = ([] if "cpu_offload_optimizer" in SUPPORTED_FEATURES else
            ['zero_optimization.offload_optimizer.device cpu: CPU offload is not supported yet; '
             'use "none"'])
    assert problems_of(config({"stage": 0, "offload_optimizer": {"device": "cpu"}})) == [
        'zero_optimization.offload_optimizer.device "cpu" with zero_optimization.stage 0: '
        'optimizer offload is part of the ZeRO optimizer and needs stage 1, 2 or 3; set one of '
        'those stages or offload_optimizer.device "none"',
        *gate,
    ]


# -- partial offload ---------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2])
def test_partial_offload_below_stage_3(stage):
    found = problems_of(config({"stage": stage, "offload_optimizer": {
        "device": "none", "ratio": 0.3}}), check_supported=False)
    assert found == [
        f"zero_optimization.offload_optimizer.ratio 0.3 with zero_optimization.stage {stage}: "
        f"partial optimizer offload (ratio < 1) exists only for ZeRO stage 3 in DeepSpeed, and "
        f"flowtrain does not support it at any stage; use 1.0"]


def test_partial_offload_at_stage_3_is_not_supported():
    cfg = load_config(config({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}),
                      check_supported=False)
    assert ("zero_optimization.offload_optimizer.ratio 0.5: partial optimizer offload "
            "(ZeRO-Offload++, ratio < 1) is not supported by flowtrain; use 1.0"
            ) in unsupported_features(cfg)
    full = load_config(config({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1}}),
                       check_supported=False)
    assert not any("ratio" in line for line in unsupported_features(full))


def test_ratio_out_of_range_is_a_type_error():
    assert problems_of(config({"stage": 3, "offload_optimizer": {"ratio": 1.5}}),
                       check_supported=False) == [
        "zero_optimization.offload_optimizer.ratio: expected a number from 0 to 1, got 1.5"]


# -- legacy cpu_offload flags ------------------------------------------------------------------

@pytest.mark.parametrize("flag, section", [("cpu_offload", "offload_optimizer"),
                                           ("cpu_offload_param", "offload_param")])
@pytest.mark.parametrize("value, device, shown", [
    (True, {"device": "none"}, '"none"'),
    (True, {"device": "nvme"}, '"nvme"'),
    (True, {"pin_memory": True}, '"none" (the default)'),
    (False, {"device": "cpu"}, '"cpu"'),
])
def test_legacy_flag_contradicting_its_section(flag, section, value, device, shown):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once, as a problem, not also as a warning
        found = problems_of(config({"stage": 3, flag: value, section: device}),
                            check_supported=False)
    assert found == [
        f"zero_optimization.{flag} {json.dumps(value)} (deprecated) and zero_optimization."
        f"{section}.device {shown} contradict each other; remove {flag} and set {section}.device "
        f'to the device you want ("cpu" or "none")']


@pytest.mark.parametrize("flag, section", [("cpu_offload", "offload_optimizer"),
                                           ("cpu_offload_param", "offload_param")])
@pytest.mark.parametrize("value, device", [(True, "cpu"), (False, "none")])
def test_legacy_flag_agreeing_with_its_section(flag, section, value, device):
    # DeepSpeed refuses the pair even when it agrees: "Cannot provide deprecated parameter ...
    # and replacing parameter ... together".
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = problems_of(config({"stage": 3, flag: value, section: {"device": device}}),
                            check_supported=False)
    assert found == [f"zero_optimization.{flag} (deprecated) and zero_optimization.{section} are "
                     f"both set; keep only {section}"]


def test_legacy_flag_with_a_null_section_still_maps():
    with pytest.warns(ConfigWarning, match="cpu_offload is deprecated"):
        cfg = load_config(config({"stage": 2, "cpu_offload": True, "offload_optimizer": None}),
                          check_supported=False)
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"


def test_legacy_flag_with_a_bad_device_is_reported_once_each():
    found = problems_of(config({"stage": 2, "cpu_offload": True,
                                "offload_optimizer": {"device": "gpu"}}), check_supported=False)
    assert found == [
        "zero_optimization.cpu_offload (deprecated) and zero_optimization.offload_optimizer are "
        "both set; keep only offload_optimizer",
        'zero_optimization.offload_optimizer.device: expected one of "none", "cpu", "nvme", '
        'got "gpu"']


# -- stage-3-only keys below stage 3: warnings -------------------------------------------------

def test_stage3_keys_below_stage_3_warn():
    with pytest.warns(ConfigWarning) as record:
        cfg = load_config(config({"stage": 2, "stage3_max_live_parameters": 1e8,
                                  "stage3_prefetch_bucket_size": 5e6, "overlap_comm": True}))
    assert [str(w.message) for w in record] == [
        "zero_optimization.stage3_prefetch_bucket_size and zero_optimization."
        "stage3_max_live_parameters are set but zero_optimization.stage is 2: they apply only "
        "to ZeRO stage 3 and are ignored; remove them or use stage 3"]
    assert record[0].filename == __file__  # points at the caller of load_config
    assert cfg.zero_optimization.stage3_max_live_parameters == 100_000_000


@pytest.mark.parametrize("key, value", [
    ("sub_group_size", 100_000_000), ("stage3_param_persistence_threshold", 1e4),
    ("stage3_model_persistence_threshold", 10), ("stage3_max_reuse_distance", 0),
    ("stage3_gather_16bit_weights_on_model_save", True),
    ("stage3_module_granularity_threshold", 5),
])
def test_each_stage3_key_warns_alone(key, value):
    with pytest.warns(ConfigWarning) as record:
        load_config(config({"stage": 1, key: value}))
    assert [str(w.message) for w in record] == [
        f"zero_optimization.{key} is set but zero_optimization.stage is 1: it applies only to "
        f"ZeRO stage 3 and is ignored; remove it or use stage 3"]


def test_stage3_keys_quiet_at_stage_3_or_at_their_defaults():
    keys = {"stage3_max_live_parameters": 1e8, "stage3_prefetch_bucket_size": 0,
            "sub_group_size": 1e8}
    loads_quietly(config({"stage": 3, **keys}), check_supported=False)
    # Default values change nothing; to_dict() writes every key and must reload quietly.
    loads_quietly(config({"stage": 2, "stage3_max_live_parameters": 1e9,
                          "sub_group_size": 1e9}))
    cfg = load_config(config({"stage": 1}))
    loads_quietly(cfg.to_dict())


def test_warning_and_problems_together():
    """A warning does not hide the problems, and the problems do not stop the warning."""
    with pytest.warns(ConfigWarning, match="stage3_max_reuse_distance is set but"):
        found = problems_of(config({"stage": 2, "stage3_max_reuse_distance": 5,
                                    "offload_param": {"device": "cpu"}}), check_supported=False)
    assert len(found) == 1 and found[0].startswith("zero_optimization.offload_param.device")


# -- pipeline ----------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [2, 3])
def test_zero_2_and_3_refuse_pipeline_parallelism(stage):
    assert problems_of(config({"stage": stage}, pipeline={"stages": 4}),
                       check_supported=False) == [
        f"zero_optimization.stage {stage} with pipeline.stages 4: ZeRO stages 2 and 3 cannot be "
        f"combined with pipeline parallelism (DeepSpeed refuses them); use zero_optimization."
        f"stage 0 or 1, or pipeline.stages 1"]


@pytest.mark.parametrize("zero, pipeline", [
    ({"stage": 1}, {"stages": 4}), ({"stage": 0}, {"stages": 2}), ({"stage": 3}, {"stages": 1}),
    ({"stage": 3}, {"stages": "auto"}),
])
def test_pipeline_with_zero_0_or_1_or_one_stage(zero, pipeline):
    load_config(config(zero, pipeline=pipeline), check_supported=False)


# -- keys that are fine ------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("flag", [True, False])
def test_contiguous_gradients_and_overlap_comm_fine_at_every_stage(stage, flag):
    cfg = loads_quietly(config({"stage": stage, "contiguous_gradients": flag,
                                "overlap_comm": flag}), check_supported=False)
    assert (cfg.zero_optimization.contiguous_gradients, cfg.zero_optimization.overlap_comm) == (
        flag, flag)


def test_reduce_scatter_false_at_stage_3_is_valid():
    # DeepSpeed 0.19.8's stage 3 reads it (all-reduce of the contiguous bucket, then this rank's
    # slice; required with Muon), so it is neither refused nor called ignored.
    cfg = loads_quietly(config({"stage": 3, "reduce_scatter": False}), check_supported=False)
    assert cfg.zero_optimization.reduce_scatter is False


def test_max_live_parameters_zero_is_valid():
    # DeepSpeed's parameter coordinator then prefetches nothing; each module's own parameters
    # are still fetched.
    cfg = loads_quietly(config({"stage": 3, "stage3_max_live_parameters": 0}),
                        check_supported=False)
    assert cfg.zero_optimization.stage3_max_live_parameters == 0


def test_sub_group_size_zero_is_refused_with_the_reason():
    assert problems_of(config({"stage": 3, "sub_group_size": 0}), check_supported=False) == [
        "zero_optimization.sub_group_size: expected an integer > 0, got 0 (0 does not switch "
        "sub-groups off: DeepSpeed would give every parameter a sub-group of its own and step "
        "them one by one; for one big sub-group keep a large size such as the default "
        "1000000000)"]
    assert problems_of(config({"stage": 3, "sub_group_size": -1}), check_supported=False) == [
        "zero_optimization.sub_group_size: expected an integer > 0, got -1"]


def test_fp16_and_bf16_both_enabled():
    assert problems_of({"train_batch_size": 1, "fp16": {"enabled": True},
                        "bf16": {"enabled": True}}) == [
        "fp16.enabled and bf16.enabled are both true; enable at most one of them"]


# -- all at once -------------------------------------------------------------------------------

def test_every_contradiction_reported_at_once_with_the_rest():
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1,
                     "gradient_accumulation_steps": 8,
                     "fp16": {"enabled": True}, "bf16": {"enabled": True},
                     "pipeline": {"stages": 2},
                     Z: {"stage": 2, "cpu_offload": False, "reduce_bucket_size": 0,
                         "offload_optimizer": {"device": "cpu", "ratio": 0.5},
                         "offload_param": {"device": "cpu"}}}, check_supported=False)
    assert info.value.problems == [
        'zero_optimization.cpu_offload false (deprecated) and zero_optimization.offload_optimizer'
        '.device "cpu" contradict each other; remove cpu_offload and set offload_optimizer.device'
        ' to the device you want ("cpu" or "none")',
        "zero_optimization.reduce_bucket_size: expected an integer > 0, got 0",
        "fp16.enabled and bf16.enabled are both true; enable at most one of them",
        'zero_optimization.offload_param.device "cpu" with zero_optimization.stage 2: parameter '
        'offload works only with ZeRO stage 3 (DeepSpeed ignores it below stage 3, so nothing '
        'would be offloaded); set stage 3 or offload_param.device "none"',
        "zero_optimization.offload_optimizer.ratio 0.5 with zero_optimization.stage 2: partial "
        "optimizer offload (ratio < 1) exists only for ZeRO stage 3 in DeepSpeed, and flowtrain "
        "does not support it at any stage; use 1.0",
        "zero_optimization.stage 2 with pipeline.stages 2: ZeRO stages 2 and 3 cannot be "
        "combined with pipeline parallelism (DeepSpeed refuses them); use zero_optimization."
        "stage 0 or 1, or pipeline.stages 1",
        info.value.problems[6],
    ]
    assert info.value.problems[6].startswith("train_batch_size 16 != ")
    assert str(info.value).splitlines()[0] == "config dict: 7 problems"


def test_rules_skip_values_that_failed_validation():
    """A stage that is not valid is not read as the default 0 by the offload rules."""
    assert problems_of(config({"stage": 7, "offload_optimizer": {"device": "cpu"},
                                "stage3_max_live_parameters": 5}), check_supported=False) == [
        "zero_optimization.stage: expected an integer from 0 to 3, got 7"]
    assert problems_of(config({"stage": 1, "offload_param": {"device": "disk"}}),
                       check_supported=False) == [
        'zero_optimization.offload_param.device: expected one of "none", "cpu", "nvme", got '
        '"disk"']
    assert problems_of(config({"stage": 3}, pipeline={"stages": 0}),
                       check_supported=False) == [
        'pipeline.stages: expected an integer > 0 or "auto", got 0']


# -- the DeepSpeed behaviour the rules rest on -------------------------------------------------

_DS_PROBE = r"""
import json, logging, sys
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.utils import logger
logger.setLevel(logging.ERROR)
out = {}
for name, zero in json.loads(sys.argv[1]).items():
    cfg = {"train_batch_size": 1}
    cfg.update(zero)
    try:
        z = DeepSpeedConfig(cfg).zero_config
        out[name] = "accepted"
    except Exception as exc:
        out[name] = "refused: " + " ".join(str(exc).split())
print("RESULT " + json.dumps(out))
"""

# What DeepSpeedConfig (deepspeed 0.19.8) does with each case: "accepted" (which includes keys
# it then ignores) or "refused: " and a part of its message. (ZeRO 2/3 with pipeline parallelism
# is refused later, by PipelineEngine.)
DS_OUTCOMES = {
    "nvme_path_with_cpu": ({Z: {"stage": 2, "offload_optimizer": {
        "device": "cpu", "nvme_path": "/nvme"}}}, "accepted"),
    "offload_param_stage_2": ({Z: {"stage": 2, "offload_param": {"device": "cpu"}}},
                              "accepted"),
    "offload_optimizer_stage_0": ({Z: {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
                                  "accepted"),
    "stage3_keys_stage_2": ({Z: {"stage": 2, "stage3_max_live_parameters": 5}}, "accepted"),
    "reduce_scatter_false_stage_3": ({Z: {"stage": 3, "reduce_scatter": False}}, "accepted"),
    "cpu_offload_true_device_none": ({Z: {"stage": 2, "cpu_offload": True,
                                          "offload_optimizer": {"device": "none"}}},
                                     "refused: Cannot provide deprecated parameter 'cpu_offload' "
                                     "and replacing parameter 'offload_optimizer' together"),
    "cpu_offload_false_device_none": ({Z: {"stage": 2, "cpu_offload": False,
                                           "offload_optimizer": {"device": "none"}}},
                                      "refused: Cannot provide deprecated parameter "
                                      "'cpu_offload' and replacing parameter 'offload_optimizer' "
                                      "together"),
    "fp16_and_bf16": ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
                      "refused: bfloat16 and fp16 modes cannot be simultaneously enabled"),
    "ratio_stage_2": ({Z: {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
                      "refused: Partial offloading only supported for ZeRO Stage 3."),
    "ratio_stage_3": ({Z: {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
                      "accepted"),
    "sub_group_size_0": ({Z: {"stage": 3, "sub_group_size": 0}}, "accepted"),
    "max_live_0": ({Z: {"stage": 3, "stage3_max_live_parameters": 0}}, "accepted"),
}


def test_deepspeed_agrees():
    """Runs DeepSpeedConfig on each case in a child process (importing deepspeed changes torch's
    global state); skipped where DeepSpeed is not installed."""
    cases = {name: zero for name, (zero, _) in DS_OUTCOMES.items()}
    run = subprocess.run([sys.executable, "-c", _DS_PROBE, json.dumps(cases)],
                         capture_output=True, text=True, timeout=120)
    if "ModuleNotFoundError: No module named 'deepspeed'" in run.stderr:
        pytest.skip("deepspeed is not installed here")
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, run.stderr[-2000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert set(got) == set(DS_OUTCOMES)
    for name, (_, outcome) in DS_OUTCOMES.items():
        if outcome == "accepted":
            assert got[name] == outcome, name
        else:
            assert got[name].startswith("refused: ") and outcome[9:] in got[name], name
