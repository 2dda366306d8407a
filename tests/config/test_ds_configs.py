"""Every real DeepSpeed config in shared/data/ds_configs is handled as its README's "what flowtrain
should do" column says: accepted (naming the features not supported yet) or a ConfigError."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from flowtrain.config import (
    SUPPORTED_FEATURES,
    ConfigError,
    ConfigWarning,
    load_config,
    unsupported_features,
)
from helpers import REPO

DS_CONFIGS = REPO.parent / "shared" / "data" / "ds_configs"
pytestmark = pytest.mark.skipif(not DS_CONFIGS.is_dir(),
                                reason=f"real DeepSpeed configs not found at {DS_CONFIGS} "
                                       f"(shared/ sits beside the repo checkout in CI)")



def gate(feature: str, line: str) -> list[str]:
    """The support gate's line for ``feature``: none once the feature is supported (stage 3 and
    CPU offload are being switched on while these tests stand)."""
    return [] if feature in SUPPORTED_FEATURES else [line]


STAGE3 = gate("zero_stage_3",
              "zero_optimization.stage 3: ZeRO stage 3 is not supported yet; use stage 0")
CPU_OPT = gate("cpu_offload_optimizer", 'zero_optimization.offload_optimizer.device cpu: CPU '
               'offload is not supported yet; use "none"')
CPU_PARAM = gate("cpu_offload_param", 'zero_optimization.offload_param.device cpu: CPU offload '
                 'is not supported yet; use "none"')


class HFLikeModel(torch.nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)
        self.config = type("Cfg", (), {"hidden_size": hidden})()


def path(name: str) -> Path:
    return DS_CONFIGS / name


def load(name: str, **kwargs):
    return load_config(path(name), **kwargs)


def problems(name: str, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load(name, **kwargs)
    assert str(info.value).startswith(f"config file {path(name)}: ")
    return info.value.problems


def test_every_file_has_a_test():
    names = {p.name for p in DS_CONFIGS.glob("*.json")}
    assert names == set(EXPECTED), "a config was added or removed; add a case below"


def case_hf_zero2():
    cfg = load("hf_zero2.json", world_size=2, model=HFLikeModel(), micro_batch_size=4,
               check_supported=False)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (8, 4, 1)
    assert cfg.precision == "fp32" and cfg.gradient_clipping == 1.0
    assert cfg.optimizer.type == "AdamW"
    # HF TrainingArguments' defaults
    assert cfg.optimizer.params == {"lr": 5e-05, "betas": [0.9, 0.999], "eps": 1e-08,
                                    "weight_decay": 0.0}
    assert cfg.scheduler.params["warmup_max_lr"] == 5e-05
    assert cfg.scheduler.params["warmup_num_steps"] == 1
    assert cfg.zero_optimization.reduce_bucket_size == 200_000_000
    assert unsupported_features(cfg) == CPU_OPT
    # As the HF Trainer uses it: it passes its optimizer/scheduler and says fp16.
    cfg = load("hf_zero2.json", micro_batch_size=4, optimizer_given=True, scheduler_given=True,
               auto_values={"fp16.enabled": True, "gradient_accumulation_steps": 2},
               check_supported=False)
    assert cfg.precision == "fp16" and cfg.train_batch_size == 8
    assert cfg.optimizer.params == {} and cfg.scheduler.params == {}
    # nothing passed: HF's per_device_train_batch_size default, 8
    cfg = load("hf_zero2.json", world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (16, 8)


def case_hf_zero3():
    with pytest.warns(ConfigWarning, match="stage3_gather_fp16_weights_on_model_save is "
                                           "deprecated"):
        found = problems("hf_zero3.json", micro_batch_size=2, check_supported=False)
    assert found == ["zero_optimization.reduce_bucket_size: expected an integer > 0, got 0"]
    with pytest.warns(ConfigWarning):
        found = problems("hf_zero3.json", micro_batch_size=2)
    assert found == ["zero_optimization.reduce_bucket_size: expected an integer > 0, got 0",
                     *STAGE3, *CPU_OPT, *CPU_PARAM]


def case_hf_zero3_bf16():
    with pytest.warns(ConfigWarning, match="stage3_gather_fp16_weights_on_model_save"):
        cfg = load("hf_zero3_bf16.json", model=HFLikeModel(64), micro_batch_size=2,
                   total_num_steps=10, check_supported=False,
                   auto_values={"bf16.enabled": True})
    assert cfg.precision == "bf16" and cfg.communication_dtype == torch.bfloat16
    # without being told: the alias's section is the config's only half-precision one
    with pytest.warns(ConfigWarning):
        assert load("hf_zero3_bf16.json", model=HFLikeModel(64)).precision == "bf16"
    z = cfg.zero_optimization
    assert z.stage3_gather_16bit_weights_on_model_save is True
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size,
            z.stage3_param_persistence_threshold) == (4096, 3686, 640)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (2, 1)
    assert unsupported_features(cfg) == [*STAGE3, *CPU_OPT, *CPU_PARAM]


def case_dse_megatron_zero2():
    cfg = load("dse_megatron_zero2.json", check_supported=False)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (16, 16, 1)
    assert cfg.precision == "fp16" and cfg.dynamic_loss_scale
    assert cfg.activation_checkpointing.partition_activations is True
    assert unsupported_features(cfg) == []
    load("dse_megatron_zero2.json")  # ZeRO stage 2 runs: the config is accepted


def case_dse_megatron_zero2_cpu_offload():
    with pytest.warns(ConfigWarning, match="zero_optimization.cpu_offload is deprecated"):
        cfg = load("dse_megatron_zero2_cpu_offload.json", check_supported=False)
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert unsupported_features(cfg) == CPU_OPT


def case_dse_megatron_zero_offload_10B():
    with pytest.warns(ConfigWarning):
        found = problems("dse_megatron_zero_offload_10B.json", check_supported=False)
    assert found == ["zero_optimization.comm_overlap: unknown key; did you mean overlap_comm?"]


def case_dse_megatron_v115_zero3():
    assert problems("dse_megatron_v115_zero3.json", check_supported=False) == [
        "zero_optimization.stage3_param_persitence_threshold: unknown key; did you mean "
        "stage3_param_persistence_threshold?"]


def case_dse_megatron_v115_infinity():
    found = problems("dse_megatron_v115_infinity.json")
    assert found == [
        "zero_optimization.stage3_param_persitance_threshold: unknown key; did you mean "
        "stage3_param_persistence_threshold?",
        *STAGE3,
        'zero_optimization.offload_optimizer.device nvme: offloading to NVMe is not supported '
        'by flowtrain; use "cpu" or "none"',
        'zero_optimization.offload_param.device nvme: offloading to NVMe is not supported by '
        'flowtrain; use "cpu" or "none"',
    ]


def case_dse_cifar():
    with pytest.warns(ConfigWarning, match="cpu_offload"):
        cfg = load("dse_cifar.json", check_supported=False)
    assert cfg.fp16.fp16_master_weights_and_grads is True
    assert cfg.fp16.initial_scale_power == 15 and cfg.fp16.loss_scale_window == 500
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (4, 4, 1)
    assert cfg.scheduler.params["warmup_num_steps"] == 1000
    assert unsupported_features(cfg) == CPU_OPT


def case_dse_bing_bert_adam4096():
    # DeepSpeed's engine also refuses max_grad_norm as an optimizer param at initialize().
    assert problems("dse_bing_bert_adam4096.json") == [
        "optimizer.params.max_grad_norm: unknown key; did you mean gradient_clipping "
        "(a top-level key)?"]


def case_dse_qanet_onecycle():
    cfg = load("dse_qanet_onecycle.json")
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (512, 32, 16)
    assert cfg.scheduler.type == "OneCycle"
    p = cfg.scheduler.params
    assert (p["cycle_first_stair_count"], p["cycle_second_stair_count"]) == (100, 100)
    assert (p["cycle_min_lr"], p["cycle_max_lr"], p["decay_lr_rate"]) == (0.004, 0.015, 0.01)
    assert p["cycle_momentum"] is True  # DeepSpeed's default, filled in
    assert unsupported_features(cfg) == []


def case_dse_cifar_onebitlamb():
    assert problems("dse_cifar_onebitlamb.json") == [
        "optimizer OneBitLamb is not available; flowtrain has: Adam, AdamW, SGD, Lion"]
    cfg = load("dse_cifar_onebitlamb.json", check_supported=False)
    assert cfg.optimizer.type == "OneBitLamb" and cfg.gradient_accumulation_steps == 64


def case_dse_autotuning_fp16_z2():
    # no dataloader: HF's per_device_train_batch_size default, 8
    cfg = load("dse_autotuning_fp16_z2.json", world_size=2, check_supported=False)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (16, 8)
    cfg = load("dse_autotuning_fp16_z2.json", micro_batch_size=8, world_size=4,
               check_supported=False)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (32, 8, 1)
    assert unsupported_features(cfg) == []


EXPECTED = {
    "hf_zero2.json": case_hf_zero2,
    "hf_zero3.json": case_hf_zero3,
    "hf_zero3_bf16.json": case_hf_zero3_bf16,
    "dse_megatron_zero2.json": case_dse_megatron_zero2,
    "dse_megatron_zero2_cpu_offload.json": case_dse_megatron_zero2_cpu_offload,
    "dse_megatron_zero_offload_10B.json": case_dse_megatron_zero_offload_10B,
    "dse_megatron_v115_zero3.json": case_dse_megatron_v115_zero3,
    "dse_megatron_v115_infinity.json": case_dse_megatron_v115_infinity,
    "dse_cifar.json": case_dse_cifar,
    "dse_bing_bert_adam4096.json": case_dse_bing_bert_adam4096,
    "dse_qanet_onecycle.json": case_dse_qanet_onecycle,
    "dse_cifar_onebitlamb.json": case_dse_cifar_onebitlamb,
    "dse_autotuning_fp16_z2.json": case_dse_autotuning_fp16_z2,
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_config(name):
    EXPECTED[name]()


# The README says these are refused whatever the caller passes (test_real_config checks how).
REFUSED = {"hf_zero3.json", "dse_megatron_zero_offload_10B.json", "dse_megatron_v115_zero3.json",
           "dse_megatron_v115_infinity.json", "dse_bing_bert_adam4096.json"}


@pytest.mark.parametrize("name", sorted(set(EXPECTED) - REFUSED))
def test_accepted_configs_round_trip(name):
    """A config that loads (with what its case passes) reloads from its own to_dict()."""
    kwargs: dict = dict(model=HFLikeModel(), total_num_steps=10, check_supported=False)
    raw = path(name).read_text()
    if '"auto"' in raw and "train_micro_batch_size_per_gpu" in raw:
        kwargs["micro_batch_size"] = 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        cfg = load(name, **kwargs)
    assert load_config(cfg.to_dict(), check_supported=False) == cfg


# DeepSpeed 0.19.8's outcome for each file, from the README's table: "accepted"; "auto" (it
# crashes only because the HF Trainer is meant to fill in the "auto" values first); "rejected".
DEEPSPEED_OUTCOME = {
    "hf_zero2.json": "auto", "hf_zero3.json": "rejected", "hf_zero3_bf16.json": "auto",
    "dse_megatron_zero2.json": "accepted", "dse_megatron_zero2_cpu_offload.json": "accepted",
    "dse_megatron_zero_offload_10B.json": "rejected", "dse_megatron_v115_zero3.json": "rejected",
    "dse_megatron_v115_infinity.json": "rejected", "dse_cifar.json": "accepted",
    "dse_bing_bert_adam4096.json": "accepted", "dse_qanet_onecycle.json": "accepted",
    "dse_cifar_onebitlamb.json": "accepted", "dse_autotuning_fp16_z2.json": "auto",
}
# Accepted by DeepSpeedConfig but refused by flowtrain on purpose (see its case above).
STRICTER = {"dse_bing_bert_adam4096.json"}
# Words only the ZeRO contradiction rules and stage-3-key warnings use.
ZERO_RULE_WORDS = (" with zero_optimization.stage ", "contradict each other", "nvme_path",
                   "offload_optimizer.ratio", " with pipeline.stages ", "only to ZeRO stage 3")


def test_outcomes_cover_every_file():
    assert set(DEEPSPEED_OUTCOME) == set(EXPECTED)
    assert {n for n, o in DEEPSPEED_OUTCOME.items() if o == "rejected"} | STRICTER == REFUSED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_zero_rules_refuse_nothing_deepspeed_accepts(name):
    """No config DeepSpeed takes gets a ZeRO contradiction or a stage-3-key warning, and each
    one it takes (once "auto" is filled in) loads, apart from the cases flowtrain refuses on
    purpose."""
    kwargs: dict = dict(model=HFLikeModel(), total_num_steps=10, check_supported=False)
    if '"auto"' in path(name).read_text():
        kwargs["micro_batch_size"] = 2
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            load(name, **kwargs)
        except ConfigError as exc:
            found = exc.problems
    notes = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert [line for line in found + notes if any(w in line for w in ZERO_RULE_WORDS)] == []
    if DEEPSPEED_OUTCOME[name] != "rejected" and name not in STRICTER:
        assert found == []
