"""Tests of the ds_config.json loader: DeepSpeed's defaults, the batch rule, unknown keys,
types, "auto" resolution and aliases. Deprecation warnings are checked with pytest.warns."""

from __future__ import annotations

import copy
import json
import warnings

import pydantic
import pytest
import torch

from flowtrain.config import (
    ConfigError,
    ConfigWarning,
    load_config,
    unsupported_features,
)


def problems_of(config, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(config, **kwargs)
    return info.value.problems


class TinyModel(torch.nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(hidden, hidden)
        self.config = type("Cfg", (), {"hidden_size": hidden})()


# -- defaults ----------------------------------------------------------------------------------

def test_defaults_match_deepspeed():
    cfg = load_config({"train_micro_batch_size_per_gpu": 1})
    assert cfg.gradient_clipping == 1.0
    assert cfg.steps_per_print == 10
    assert cfg.wall_clock_breakdown is False and cfg.memory_breakdown is False
    assert cfg.communication_data_type is None
    assert cfg.prescale_gradients is False and cfg.gradient_predivide_factor == 1.0
    assert cfg.zero_force_ds_cpu_optimizer is True
    f = cfg.fp16
    assert (f.enabled, f.auto_cast, f.loss_scale, f.initial_scale_power, f.loss_scale_window,
            f.hysteresis, f.consecutive_hysteresis, f.min_loss_scale) == (
        False, False, 0.0, 16, 1000, 2, False, 1.0)
    b = cfg.bf16
    assert (b.enabled, b.immediate_grad_update, b.check_overflow) == (False, True, False)
    z = cfg.zero_optimization
    assert z.stage == 0
    assert (z.allgather_partitions, z.reduce_scatter, z.contiguous_gradients) == (True,) * 3
    assert z.allgather_bucket_size == 500_000_000 and z.reduce_bucket_size == 500_000_000
    assert z.overlap_comm is False
    assert z.sub_group_size == 1_000_000_000
    assert z.stage3_prefetch_bucket_size == 50_000_000
    assert z.stage3_param_persistence_threshold == 100_000
    assert z.stage3_max_live_parameters == 1_000_000_000
    assert z.stage3_max_reuse_distance == 1_000_000_000
    assert z.stage3_gather_16bit_weights_on_model_save is False
    o = z.offload_optimizer
    assert (o.device, o.buffer_count, o.pin_memory, o.ratio) == ("none", 4, True, 1.0)
    p = z.offload_param
    assert (p.device, p.buffer_count, p.buffer_size, p.max_in_cpu, p.pin_memory) == (
        "none", 5, 100_000_000, 1_000_000_000, True)
    pipe = cfg.pipeline
    assert (pipe.stages, pipe.partition, pipe.seed_layers, pipe.activation_checkpoint_interval,
            pipe.pipe_partitioned, pipe.grad_partitioned) == ("auto", "best", False, 0, True, True)
    a = cfg.activation_checkpointing
    assert (a.partition_activations, a.number_checkpoints, a.contiguous_memory_optimization,
            a.cpu_checkpointing, a.synchronize_checkpoint_boundary, a.profile) == (
        False, None, False, False, False, False)
    fp = cfg.flops_profiler
    assert (fp.enabled, fp.recompute_fwd_factor, fp.profile_step, fp.module_depth,
            fp.top_modules, fp.detailed, fp.output_file) == (False, 0.0, 1, -1, 1, True, None)
    assert cfg.precision == "fp32" and cfg.dynamic_loss_scale is False
    assert cfg.communication_dtype == torch.float32
    assert cfg.flowtrain.bucket_order == "observed"
    assert unsupported_features(cfg) == []


def test_overlap_comm_defaults_to_stage_3_only():
    on = load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3}},
                     check_supported=False)
    assert on.zero_optimization.overlap_comm is True
    off = load_config({"train_batch_size": 2, "zero_optimization": {"stage": 2,
                                                                     "overlap_comm": None}},
                      check_supported=False)
    assert off.zero_optimization.overlap_comm is False


def test_gradient_clipping_is_configurable():
    assert load_config({"train_batch_size": 1, "gradient_clipping": 0.0}).gradient_clipping == 0.0


def test_precision_properties():
    fp16 = load_config({"train_batch_size": 1, "fp16": {"enabled": True}})
    assert fp16.precision == "fp16" and fp16.dynamic_loss_scale is True
    assert fp16.communication_dtype == torch.float16
    static = load_config({"train_batch_size": 1, "fp16": {"enabled": True, "loss_scale": 128}})
    assert static.dynamic_loss_scale is False
    bf16 = load_config({"train_batch_size": 1, "bf16": {"enabled": True},
                        "communication_data_type": "float32"})
    assert bf16.precision == "bf16" and bf16.dtype == torch.bfloat16
    assert bf16.communication_data_type == "fp32"
    assert bf16.communication_dtype == torch.float32


def test_fp16_and_bf16_both_enabled_is_an_error():
    assert problems_of({"train_batch_size": 1, "fp16": {"enabled": True},
                        "bf16": {"enabled": True}}) == [
        "fp16.enabled and bf16.enabled are both true; enable at most one of them"]


# -- batch rule --------------------------------------------------------------------------------

@pytest.mark.parametrize("given, world, expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2, (32, 8, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
    ({"train_batch_size": 32}, 4, (32, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 4}, 3, (12, 4, 1)),
])
def test_batch_rule_derivations(given, world, expected):
    cfg = load_config(given, world_size=world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == expected
    assert cfg.dp_world_size == world


def test_batch_rule_mismatch_shows_the_numbers():
    [msg] = problems_of({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1,
                         "gradient_accumulation_steps": 8})
    assert msg.startswith("train_batch_size 16 != train_micro_batch_size_per_gpu 1 * "
                          "gradient_accumulation_steps 8 * data-parallel world size 1 (= 8); ")
    assert "leave one of them out" in msg


def test_batch_rule_not_divisible():
    [msg] = problems_of({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4})
    assert msg.startswith("train_batch_size 30 is not divisible by "
                          "train_micro_batch_size_per_gpu 4 * data-parallel world size 1 = 4")
    [msg] = problems_of({"train_batch_size": 10}, world_size=4)
    assert "not divisible by data-parallel world size 4 = 4" in msg


def test_batch_rule_neither_given():
    assert problems_of({}) == [
        "either train_batch_size or train_micro_batch_size_per_gpu must be set (or pass "
        "a training_data DataLoader with a batch size to flowtrain.initialize, "
        "micro_batch_size=... to load_config)"]


@pytest.mark.parametrize("key", ["train_batch_size", "train_micro_batch_size_per_gpu",
                                 "gradient_accumulation_steps"])
def test_batch_values_must_be_positive(key):
    assert problems_of({"train_batch_size": 4, key: 0}) == [
        f"{key}: expected an integer from 1 to 2147483647, got 0"]


def test_caller_micro_batch_fills_and_conflicts():
    cfg = load_config({"gradient_accumulation_steps": 2}, micro_batch_size=3, world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (12, 3)
    [msg] = problems_of({"train_micro_batch_size_per_gpu": 8}, micro_batch_size=4)
    assert "train_micro_batch_size_per_gpu 8 in the config != micro_batch_size 4" in msg


# -- unknown keys and types --------------------------------------------------------------------

def test_unknown_top_level_key_suggests():
    assert problems_of({"train_batch_size": 4, "gradient_acumulation_steps": 2}) == [
        "gradient_acumulation_steps: unknown key; did you mean gradient_accumulation_steps?"]


def test_unknown_nested_key_suggests():
    assert problems_of({"train_batch_size": 4, "zero_optimization": {
        "stage3_param_persitence_threshold": 10}}) == [
        "zero_optimization.stage3_param_persitence_threshold: unknown key; did you mean "
        "stage3_param_persistence_threshold?"]


def test_misnaming_table():
    assert problems_of({"train_batch_size": 4, "zero_optimization": {"comm_overlap": True}}) == [
        "zero_optimization.comm_overlap: unknown key; did you mean overlap_comm?"]
    assert problems_of({"train_batch_size": 4, "seed": 3}) == [
        "seed: unknown key; did you mean flowtrain.seed?"]


def test_unknown_key_deep_in_offload():
    assert problems_of({"train_batch_size": 4, "zero_optimization": {
        "offload_optimizer": {"device": "cpu", "pin_memroy": True}}}, check_supported=False) == [
        "zero_optimization.offload_optimizer.pin_memroy: unknown key; did you mean pin_memory?"]


def test_wrong_types_name_path_and_expected_type():
    assert problems_of({"train_batch_size": 4, "fp16": {"loss_scale_window": "abc"}}) == [
        'fp16.loss_scale_window: expected an integer > 0, got "abc"']
    assert problems_of({"train_batch_size": 4, "fp16": {"enabled": "true"}}) == [
        'fp16.enabled: expected true or false, got "true"']
    assert problems_of({"train_batch_size": 4, "zero_optimization": {"stage": 4}}) == [
        "zero_optimization.stage: expected an integer from 0 to 3, got 4"]
    assert problems_of({"train_batch_size": 4, "zero_optimization": {"offload_optimizer": {
        "device": "gpu"}}}) == [
        'zero_optimization.offload_optimizer.device: expected one of "none", "cpu", "nvme", '
        'got "gpu"']
    assert problems_of({"train_batch_size": 4, "communication_data_type": "int8"}) == [
        'communication_data_type: expected one of "fp32", "fp16", "bf16" or null, got "int8"']
    assert problems_of({"train_batch_size": 4, "fp16": 1}) == [
        "fp16: expected an object ({...}), got 1"]


def test_integral_floats_accepted_fractional_rejected():
    cfg = load_config({"train_batch_size": 4, "zero_optimization": {"reduce_bucket_size": 5e8}})
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert isinstance(cfg.zero_optimization.reduce_bucket_size, int)
    assert problems_of({"train_batch_size": 4.5}) == [
        "train_batch_size: expected an integer from 1 to 2147483647, got 4.5"]


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1,
                     "gradient_accumulation_steps": 8, "gradient_acumulation_steps": 2,
                     "fp16": {"loss_scale_window": "abc", "enabled": True},
                     "bf16": {"enabled": True},
                     "zero_optimization": {"stage": 1, "comm_overlap": True}})
    err = info.value
    assert err.problems == [
        'fp16.loss_scale_window: expected an integer > 0, got "abc"',
        "zero_optimization.comm_overlap: unknown key; did you mean overlap_comm?",
        "gradient_acumulation_steps: unknown key; did you mean gradient_accumulation_steps?",
        "fp16.enabled and bf16.enabled are both true; enable at most one of them",
        err.problems[4],
    ]
    assert err.problems[4].startswith("train_batch_size 16 != ")
    assert isinstance(err, ValueError)
    assert str(err).splitlines()[0] == "config dict: 5 problems"
    assert str(err).splitlines()[1:] == [f"  - {p}" for p in err.problems]


def test_optimizer_and_scheduler_params_checked():
    assert problems_of({"train_batch_size": 4, "optimizer": {"type": "adam", "params": {
        "lr": 1e-3, "betas": [0.9]}}}) == [
        "optimizer.params.betas: expected a list of two numbers in [0, 1), got [0.9]"]
    assert problems_of({"train_batch_size": 4, "optimizer": {"type": "Adamm"}}) == [
        'optimizer.type: unknown optimizer "Adamm"; did you mean Adam? (DeepSpeed names: Adam, '
        'AdamW, SGD, Lion, Lamb, Adagrad, OneBitAdam, OneBitLamb, ZeroOneAdam, Muon, or a '
        'torch.optim class name)']
    assert problems_of({"train_batch_size": 4, "scheduler": {"type": "WarmupDecayLR",
                                                             "params": {}}}) == [
        "scheduler.params.total_num_steps: required key is missing"]
    cfg = load_config({"train_batch_size": 4, "optimizer": {"type": "adamw"},
                       "scheduler": {"type": "warmuplr", "params": {"warmup_num_steps": 5}}})
    assert cfg.optimizer.type == "AdamW"
    assert cfg.scheduler.type == "WarmupLR"
    assert cfg.scheduler.params == {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                                    "warmup_num_steps": 5, "warmup_type": "log",
                                    "last_batch_iteration": -1}


# -- auto --------------------------------------------------------------------------------------

HF_AUTO = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
}


def test_auto_resolution_from_model_and_arguments():
    cfg = load_config(HF_AUTO, world_size=2, model=TinyModel(hidden=16), micro_batch_size=4,
                      total_num_steps=100, check_supported=False)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (8, 4, 1)
    assert cfg.gradient_clipping == 1.0
    # both half-precision sections "auto": TrainingArguments' fp16/bf16 defaults, off
    assert cfg.precision == "fp32"
    # HF TrainingArguments' defaults (learning_rate, adam_beta1/2, adam_epsilon, weight_decay)
    assert cfg.optimizer.params == {"lr": 5e-05, "betas": [0.9, 0.999], "eps": 1e-08,
                                    "weight_decay": 0.0}
    assert cfg.scheduler.params["warmup_min_lr"] == 0.0
    assert cfg.scheduler.params["warmup_max_lr"] == 5e-05
    assert cfg.scheduler.params["warmup_num_steps"] == 1  # HF's max(1, warmup_steps 0)
    assert cfg.scheduler.params["total_num_steps"] == 100
    z = cfg.zero_optimization
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size,
            z.stage3_param_persistence_threshold) == (256, 230, 160)
    resolved = cfg.auto_resolved
    assert resolved["optimizer.params.lr"] == (5e-05, "Hugging Face TrainingArguments default")
    assert resolved["train_micro_batch_size_per_gpu"] == (
        4, "the training_data DataLoader's batch_size")
    assert resolved["train_batch_size"][0] == 8
    assert resolved["zero_optimization.reduce_bucket_size"] == (
        256, "h*h with the model's hidden size h=16")
    assert set(resolved) == {
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "gradient_clipping", "fp16.enabled", "bf16.enabled", "optimizer.params.lr",
        "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
        "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr",
        "scheduler.params.warmup_num_steps", "scheduler.params.total_num_steps",
        "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold"}


def test_auto_without_a_dataloader_takes_hf_batch_defaults():
    cfg = load_config({**HF_AUTO, "zero_optimization": {"stage": 0}}, world_size=2,
                      total_num_steps=10)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (16, 8, 1)  # per_device_train_batch_size 8
    # a numeric train_batch_size: the "auto" rest is derived by DeepSpeed's batch rule
    cfg = load_config({**HF_AUTO, "train_batch_size": 12, "zero_optimization": {"stage": 0}},
                      world_size=2, total_num_steps=10)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (6, 1)


@pytest.mark.parametrize("sections, model_dtype, expected", [
    ({"bf16": {"enabled": "auto"}}, torch.float32, "bf16"),  # the only half section: on
    ({"fp16": {"enabled": "auto"}}, torch.float32, "fp16"),
    ({"fp16": {"enabled": False}, "bf16": {"enabled": "auto"}}, torch.float32, "bf16"),
    ({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}, torch.float32, "fp32"),
    ({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}, torch.bfloat16, "bf16"),
    ({"fp16": {"enabled": "auto"}}, torch.bfloat16, "fp32"),
])
def test_auto_precision(sections, model_dtype, expected):
    model = TinyModel(8).to(model_dtype)
    cfg = load_config({"train_batch_size": 2, **sections}, model=model)
    assert cfg.precision == expected
    # a TrainingArguments-like object's flags win, as they do in HF's Trainer
    args = type("Args", (), {"bf16": False, "fp16": False, "learning_rate": 1e-4})()
    from flowtrain.config.hf import auto_values_of

    cfg = load_config({"train_batch_size": 2, **sections}, model=model,
                      auto_values=auto_values_of(args))
    assert cfg.precision == "fp32"


def test_auto_with_optimizer_and_scheduler_given_and_overrides():
    cfg = load_config(HF_AUTO, model=TinyModel(8), micro_batch_size=2, optimizer_given=True,
                      scheduler_given=True, check_supported=False,
                      auto_values={"bf16.enabled": True, "gradient_accumulation_steps": 4})
    assert cfg.optimizer.params == {} and cfg.scheduler is not None
    assert cfg.precision == "bf16"
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (8, 4)


def test_unresolvable_auto_says_what_is_needed():
    problems = problems_of(HF_AUTO, check_supported=False)
    assert problems == [
        "scheduler.params.total_num_steps is 'auto': pass auto_values="
        "{'scheduler.params.total_num_steps': <number of optimizer steps>} (or a "
        "TrainingArguments-like object with max_steps), or training_data= a Dataset with a "
        "length and auto_values={'num_train_epochs': <epochs>}, to flowtrain.initialize; or "
        "total_num_steps= to load_config; or set it in the config",
        "zero_optimization.reduce_bucket_size is 'auto', which is computed from the model's "
        "hidden size: pass a model whose .config has hidden_size, or set it in the config, or "
        "pass auto_values={'zero_optimization.reduce_bucket_size': ...} to "
        "flowtrain.initialize (or load_config)",
        problems[2], problems[3],
    ]
    assert problems[2].startswith("zero_optimization.stage3_prefetch_bucket_size is 'auto'")
    assert "auto" not in load_config({"train_batch_size": 2, "fp16": {"enabled": "auto"}}
                                     ).to_dict()["fp16"].values()


def test_auto_where_no_rule_exists():
    assert problems_of({"train_batch_size": 2, "steps_per_print": "auto"}) == [
        "steps_per_print is 'auto' and flowtrain has no rule to work it out: set it in the "
        "config, or pass auto_values={'steps_per_print': ...} to flowtrain.initialize (or "
        "load_config)"]


# -- input handling ----------------------------------------------------------------------------

def test_dict_is_not_mutated():
    config = copy.deepcopy(HF_AUTO)
    config["zero_optimization"]["cpu_offload"] = True
    before = copy.deepcopy(config)
    with pytest.warns(ConfigWarning):
        load_config(config, model=TinyModel(), micro_batch_size=1, total_num_steps=5,
                    check_supported=False)
    assert config == before


def test_json_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,}\n}\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"config file {path}: 1 problem")
    assert info.value.problems == [
        "invalid JSON at line 3 column 28: Expecting property name enclosed in double quotes"]


def test_missing_file_and_duplicate_keys(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the file: No such file or directory"):
        load_config(tmp_path / "nope.json")
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 4}')
    assert problems_of(path) == ["train_batch_size: the key appears twice in the same object; "
                                 "keep one"]


def test_file_and_round_trip(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "gradient_accumulation_steps": 2,
                                "bf16": {"enabled": True}, "optimizer": {"type": "Adam"}}))
    cfg = load_config(path, world_size=2)
    assert cfg.train_micro_batch_size_per_gpu == 2
    again = load_config(cfg.to_dict(), world_size=2)
    assert again == cfg
    assert json.loads(json.dumps(cfg.to_dict())) == cfg.to_dict()


def test_config_is_frozen():
    cfg = load_config({"train_batch_size": 1})
    with pytest.raises(pydantic.ValidationError, match="Instance is frozen"):
        cfg.fp16.enabled = True  # type: ignore[misc]


# -- aliases -----------------------------------------------------------------------------------

def test_deprecated_gather_fp16_alias_warns_and_maps():
    with pytest.warns(ConfigWarning, match="stage3_gather_fp16_weights_on_model_save is "
                                           "deprecated"):
        cfg = load_config({"train_batch_size": 1, "zero_optimization": {
            "stage": 3, "stage3_gather_fp16_weights_on_model_save": True}},
            check_supported=False)
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save is True


def test_deprecated_cpu_offload_warns_and_maps():
    with pytest.warns(ConfigWarning, match="cpu_offload is deprecated"):
        cfg = load_config({"train_batch_size": 1, "zero_optimization": {
            "stage": 2, "cpu_offload": True}}, check_supported=False)
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    problems = problems_of({"train_batch_size": 1, "zero_optimization": {
        "stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
        check_supported=False)
    assert problems == ["zero_optimization.cpu_offload (deprecated) and "
                        "zero_optimization.offload_optimizer are both set; keep only "
                        "offload_optimizer"]


def test_bfloat16_alias_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config({"train_batch_size": 1, "bfloat16": {"enabled": True}})
    assert cfg.precision == "bf16"
    assert problems_of({"train_batch_size": 1, "bfloat16": {}, "bf16": {}}) == [
        "bfloat16 and bf16 are both set; bfloat16 is an old name of bf16: keep only bf16"]


# -- support gate ------------------------------------------------------------------------------

def test_unsupported_features_and_switching_them_on(monkeypatch):
    # With nothing switched on, every feature the config uses gets its sentence; switching a
    # feature on (adding it to SUPPORTED_FEATURES) removes exactly that sentence. ZeRO 3 and
    # pipeline stages > 1 contradict each other (tests/config/test_zero_config.py), so the pipeline
    # is asked for with stage 1 at the end.
    monkeypatch.setattr("flowtrain.config.support.SUPPORTED_FEATURES", set())
    config = {"train_batch_size": 4, "zero_optimization": {"stage": 3},
              "tensor_parallel": {"autotp_size": 2},
              "amp": {"enabled": True, "opt_level": "O1"}, "flops_profiler": {"enabled": True},
              "wandb": {"enabled": True}, "tensorboard": {"enabled": False},
              "optimizer": {"type": "lamb"}}
    cfg = load_config(config, check_supported=False)
    assert unsupported_features(cfg) == [
        "zero_optimization.stage 3: ZeRO stage 3 is not supported yet; use stage 0",
        "tensor_parallel size 2: tensor parallelism is not supported yet; use 1",
        "optimizer Lamb is not available; flowtrain has: Adam, AdamW, SGD, Lion",
        "amp: NVIDIA apex AMP is not supported; use fp16 or bf16 instead",
        "flops_profiler: the FLOPs profiler is not supported yet; set flops_profiler.enabled "
        "false",
        "wandb: the wandb monitor is not supported yet; set wandb.enabled false",
    ]
    assert problems_of(config) == unsupported_features(cfg)
    monkeypatch.setattr("flowtrain.config.support.SUPPORTED_FEATURES",
                        {"zero_stage_1", "zero_stage_3", "wandb", "tensor_parallel",
                         "flops_profiler"})
    assert unsupported_features(cfg) == [
        "optimizer Lamb is not available; flowtrain has: Adam, AdamW, SGD, Lion",
        "amp: NVIDIA apex AMP is not supported; use fp16 or bf16 instead"]
    pipe = {"train_batch_size": 4, "zero_optimization": {"stage": 1}, "pipeline": {"stages": 2}}
    assert problems_of(pipe) == [
        "pipeline.stages 2: pipeline parallelism is not supported yet; use 1 stage"]
    monkeypatch.setattr("flowtrain.config.support.SUPPORTED_FEATURES",
                        {"zero_stage_1", "pipeline"})
    assert load_config(pipe).pipeline.stages == 2


def test_what_flowtrain_runs_today():
    from flowtrain.config.support import SUPPORTED_FEATURES as today

    assert {"zero_stage_1", "zero_stage_2", "zero_stage_3", "cpu_offload_optimizer",
            "cpu_offload_param", "pipeline", "tensor_parallel", "flops_profiler"} <= today


@pytest.mark.parametrize("content,fragment", [
    (b'{"train_batch_size": 4, "x": "\xff\xfe"}', "not UTF-8 text: byte 0xff at offset"),
    (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
    (b'{"train_batch_size": ' + b"9" * 5000 + b"}", "digits"),
])
def test_unreadable_config_files_are_config_errors(tmp_path, content, fragment):
    path = tmp_path / "ds.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert fragment in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("config,fragment", [
    ({"train_batch_size": 4, "fp16": {"enabled": True, "initial_scale_power": 1e9}},
     "fp16.initial_scale_power: expected an integer from 0 to 127, got 1000000000"),
    ({"train_micro_batch_size_per_gpu": 1e308},
     "train_micro_batch_size_per_gpu: expected an integer from 1 to 2147483647, got 1e+308"),
])
def test_out_of_range_numbers_are_refused_at_load(config, fragment):
    assert any(fragment in p for p in problems_of(config)), problems_of(config)


DECAY = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
         "scheduler": {"type": "WarmupDecayLR",
                       "params": {"warmup_num_steps": 1, "total_num_steps": "auto"}}}


@pytest.mark.parametrize("length,epochs,drop_last", [(70, 2.5, False), (70, 1, True),
                                                     (64, 3, False)])
def test_auto_total_num_steps_counts_the_loaders_steps(length, epochs, drop_last):
    from flowtrain.engine.dataloader import DistributedLoader

    config = dict(DECAY, dataloader_drop_last=drop_last)
    cfg = load_config(config, world_size=2, dataset_length=length, epochs=epochs)
    # the reference: what the engine's loader gives each rank, accumulation 2 to a step
    data = torch.utils.data.TensorDataset(torch.arange(length))
    loaders = [DistributedLoader(data, batch_size=4, rank=r, world_size=2, drop_last=drop_last)
               for r in range(2)]
    per_epoch = len(list(loaders[0])) // 2
    assert len(list(loaders[1])) // 2 == per_epoch
    assert cfg.scheduler.params["total_num_steps"] == -(-epochs * per_epoch // 1)
    value, source = cfg.auto_resolved["scheduler.params.total_num_steps"]
    assert value == cfg.scheduler.params["total_num_steps"]
    assert source.startswith(f"{epochs:g} epochs of {per_epoch} optimizer steps")


def test_auto_total_num_steps_without_epochs_says_what_to_pass():
    with pytest.raises(ConfigError) as err:
        load_config(DECAY, world_size=2, dataset_length=64)
    assert err.value.problems == [
        "scheduler.params.total_num_steps is 'auto': the training Dataset (64 samples) gives "
        "the optimizer steps of one epoch, but not how many epochs: pass auto_values="
        "{'num_train_epochs': <epochs>} or {'scheduler.params.total_num_steps': <number of "
        "optimizer steps>} (or a TrainingArguments-like object with num_train_epochs or "
        "max_steps) to flowtrain.initialize, or set it in the config"]


def test_initialize_counts_total_num_steps_from_its_dataset(world1):
    import flowtrain

    data = torch.utils.data.TensorDataset(torch.randn(40, 3))
    engine, _, loader, scheduler = flowtrain.initialize(
        model=torch.nn.Linear(3, 1), training_data=data, config=DECAY,
        auto_values={"num_train_epochs": 3})
    # one rank, 40 samples: 10 micro-batches of 4, 5 steps an epoch, 3 epochs
    assert len(loader) == 10 and scheduler.total_num_steps == 15
    engine.destroy()
    args = type("Args", (), {"num_train_epochs": 2.0, "max_steps": -1,
                             "per_device_train_batch_size": 4})()
    engine, *_ = flowtrain.initialize(model=torch.nn.Linear(3, 1), training_data=data,
                                      config=DECAY, auto_values=args)
    assert engine.lr_scheduler.total_num_steps == 10
    engine.destroy()


@pytest.mark.parametrize("key,on,off", [
    ("sparse_gradients", True, False), ("dump_state", True, False),
    ("disable_allgather", True, False), ("seq_parallel_communication_data_type", "bf16", "fp32")])
def test_inert_deepspeed_keys_warn_when_on_and_stay_quiet_when_off(key, on, off):
    # flowtrain accepts these DeepSpeed keys but does nothing different for them; turned on,
    # the user hears so instead of believing they took effect
    with pytest.warns(ConfigWarning, match=f"{key} {str(on).lower()} has no effect in flowtrain"):
        cfg = load_config({"train_batch_size": 1, key: on})
    assert getattr(cfg, key) == on
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config({"train_batch_size": 1, key: off})

