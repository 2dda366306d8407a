"""flowtrain's Hugging Face Trainer (``flowtrain.integrations.transformers``) on 2 real CPU
ranks with a tiny GPT2LMHeadModel (tests/data/hf_trainer_worker.py), each against a
reference: ``flowtrain.initialize`` given HF's raw config with the "auto" values HF's Trainer
would fill written out by hand, the uninterrupted run for a resumed one, the engine's own
logits for the model ``from_pretrained`` reloads; and, where DeepSpeed is installed,
transformers' own Trainer with DeepSpeed. Without ranks: what the arguments fill and refuse."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from helpers import DATA, REPO, check_cases, child_env, free_port, launch, rank_results

WORKER = DATA / "hf_trainer_worker.py"
CONFIGS = REPO.parent / "shared" / "data" / "ds_configs"
# as the worker names them: HF's file (accumulation 2), its ZeRO-3 bf16 file, the ZeRO-2 file
# at stage 1 with fp16, and no config at all (stage 0, HF's own optimizer and schedule)
CASES = ["zero2", "zero3_bf16", "zero1_fp16", "no_config"]
CONFIGURED = CASES[:3]  # the cases whose config has optimizer and scheduler sections
STEPS, SAVE_AT = 4, 2  # as the worker runs them


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers' Trainer runs on accelerate")
    if not CONFIGS.is_dir():
        pytest.skip(f"real DeepSpeed configs not found at {CONFIGS}")
    out = tmp_path_factory.mktemp("hf_trainer") / "out"
    launch(2, WORKER, str(out), run_dir=out.parent / "run", timeout=280)
    return check_cases(rank_results(out, 2))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_trainer_losses_equal_initialize_with_hf_filled_values(ranks: Any, case: str) -> None:
    for data in ranks:
        run = data[case]
        assert len(run["trainer"]) == STEPS
        # the same micro-batches, the same arithmetic: identical, step for step
        assert run["trainer"] == run["reference"]
        # Adam and clipping hide a wrongly scaled loss from the losses; not from the norm
        assert run["trainer_norms"] == run["reference_norms"] and None not in run["trainer_norms"]
        resolved = run["resolved"]
        # taken from the TrainingArguments, none of them flowtrain's or HF's defaults
        assert resolved["gradient_clipping"] == 0.5
        assert resolved["train_micro_batch_size_per_gpu"] == 4
        if case in CONFIGURED:
            assert resolved["optimizer.params.lr"] == \
                resolved["scheduler.params.warmup_max_lr"] == 3e-3
            assert resolved["optimizer.params.betas"] == [0.85, 0.999]
            assert resolved["optimizer.params.weight_decay"] == 0.01
            assert resolved["scheduler.params.warmup_num_steps"] == 2
    run = ranks[0][case]
    # the precision the TrainingArguments ask for, at the config's stage
    assert (run["stage"], run["fp16"], run["bf16"]) == {
        "zero2": (2, False, False), "zero3_bf16": (3, False, True),
        "zero1_fp16": (1, True, False), "no_config": (0, False, False)}[case]
    if case == "zero2":
        assert run["resolved"]["gradient_accumulation_steps"] == 2
        assert run["resolved"]["train_batch_size"] == 4 * 2 * 2
    if case == "zero3_bf16":
        assert run["resolved"]["zero_optimization.reduce_bucket_size"] == 64 * 64
    if case == "no_config":
        assert not any(key.startswith("optimizer") for key in run["resolved"])
        assert run["optimizer"] == "AdamW"  # HF's own (torch's), not built from a config


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_resume_from_checkpoint_gives_the_uninterrupted_losses(ranks: Any, case: str) -> None:
    for data in ranks:
        run = data[case]
        assert {"model.safetensors", "config.json", "trainer_state.json", "latest",
                f"global_step{SAVE_AT}"} <= set(run["checkpoint_files"])
        assert run["resumed_global_step"] == STEPS
        assert run["resumed"] == run["trainer"][SAVE_AT:]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_save_model_reloads_with_from_pretrained_and_evaluate(ranks: Any, case: str) -> None:
    for data in ranks:
        run = data[case]
        # under ZeRO-3 too: the whole model, gathered, in its training dtype
        assert run["logits_max_diff"] == 0.0
        assert run["reloaded_dtype"] == {"zero3_bf16": "torch.bfloat16",
                                         "zero1_fp16": "torch.float16"}.get(case,
                                                                            "torch.float32")
        # evaluate() through the engine (ZeRO-3 gathers) against the reloaded model's loss
        assert run["eval_loss"] == pytest.approx(run["eval_reference"], rel=1e-6)
        if case == "zero3_bf16":  # load_best_model_at_end: the engine holds the best weights
            assert run["best"] == f"checkpoint-{SAVE_AT}"
            assert run[f"checkpoint-{SAVE_AT}_logits_max_diff"] == 0.0
            assert run[f"checkpoint-{STEPS}_logits_max_diff"] > 1e-3


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_training_arguments_keep_the_config_and_skip_deepspeed(ranks: Any) -> None:
    for data in ranks:
        got = data["arguments"]
        assert got["deepspeed"] == '{"zero_optimization": {"stage": 1}}'  # as given
        assert got["plugin_is_none"] and got["world_size"] == 2  # devices set up without it
        # an inline JSON config is read; a copy of the arguments carries it too
        assert got["config"] == got["copy_config"] == {"zero_optimization": {"stage": 1}}
        assert got["copy_lr"] == 1e-3


# -- without ranks ---------------------------------------------------------------------------


def hf_args(**overrides: Any) -> SimpleNamespace:
    """What the filling reads of a TrainingArguments, at HF's defaults."""
    values = dict(per_device_train_batch_size=8, gradient_accumulation_steps=1,
                  max_grad_norm=1.0, learning_rate=5e-5, adam_beta1=0.9, adam_beta2=0.999,
                  adam_epsilon=1e-8, weight_decay=0.0, warmup_steps=0, max_steps=-1,
                  fp16=False, fp16_full_eval=False, bf16=False, bf16_full_eval=False)
    values.update(overrides)
    args = SimpleNamespace(**values)
    # HF's rule: a count of steps from 1 up, a fraction of the run below 1
    args.get_warmup_steps = lambda total: int(args.warmup_steps) if args.warmup_steps >= 1 \
        else -(-total * args.warmup_steps // 1)
    return args


def test_trainer_auto_values_follow_the_arguments() -> None:
    from flowtrain.config.hf import trainer_auto_values

    values = trainer_auto_values(hf_args(per_device_train_batch_size=4,
                                         gradient_accumulation_steps=3, warmup_steps=0.1,
                                         adam_beta2=0.95, fp16=True), max_steps=50,
                                 world_size=2)
    assert values["train_batch_size"] == 4 * 3 * 2
    assert values["scheduler.params.total_num_steps"] == 50
    assert values["scheduler.params.warmup_num_steps"] == 5  # 10 % of 50 steps
    assert values["optimizer.params.betas"] == [0.9, 0.95]
    assert (values["fp16.enabled"], values["bf16.enabled"]) == (True, False)
    # no warmup is filled as 1 step, as HF does (WarmupLR refuses 0)
    assert trainer_auto_values(hf_args(), 10, 1)["scheduler.params.warmup_num_steps"] == 1


def test_written_values_that_contradict_the_arguments_are_refused() -> None:
    from flowtrain.config import ConfigError
    from flowtrain.config.hf import check_against_arguments, trainer_auto_values

    values = trainer_auto_values(hf_args(learning_rate=3e-3), 10, 2)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": "auto",
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999]}},
              "bfloat16": {"enabled": True}}
    with pytest.raises(ConfigError) as err:
        check_against_arguments(config, values)
    assert err.value.problems == [
        "optimizer.params.lr is 0.0001 in the config but the TrainingArguments (learning_rate) "
        "give 0.003: write \"auto\" there, or make the two agree",
        "bf16.enabled is True in the config but the TrainingArguments (bf16 or bf16_full_eval) "
        "give False: write \"auto\" there, or make the two agree"]
    config["optimizer"]["params"]["lr"] = 3e-3
    config["bfloat16"]["enabled"] = "auto"
    check_against_arguments(config, values)  # agrees, or "auto": accepted


def test_arguments_meant_for_deepspeed_are_refused_with_the_fix() -> None:
    from flowtrain.config import ConfigError
    from flowtrain.config.hf import config_of

    with pytest.raises(ValueError, match=r"flowtrain\.integrations\.transformers\."
                                         r"TrainingArguments\(deepspeed=\.\.\.\)"):
        config_of(SimpleNamespace(deepspeed="ds_config.json"))
    assert config_of(SimpleNamespace(flowtrain_config={"a": 1})) == {"a": 1}
    assert config_of(SimpleNamespace(flowtrain_config=' {"a": 1}')) == {"a": 1}  # inline JSON
    assert config_of(SimpleNamespace(flowtrain_config="ds.json")) == "ds.json"  # a path
    with pytest.raises(ConfigError, match=r"(?s)inline JSON config.*invalid JSON at column 7"):
        config_of(SimpleNamespace(flowtrain_config='{"a": }'))
    default = config_of(SimpleNamespace(deepspeed=None))
    assert default["zero_optimization"] == {"stage": 0} and "optimizer" not in default


# -- against transformers' Trainer with DeepSpeed, where DeepSpeed is installed ---------------


def deepspeed_python() -> str | None:
    """A Python that has deepspeed and accelerate: FLOWTRAIN_DEEPSPEED_PYTHON (e.g. a venv made
    for it with scripts/install_deepspeed.sh), else this one if it has them."""
    given = os.environ.get("FLOWTRAIN_DEEPSPEED_PYTHON")
    if given:
        return given
    found = all(importlib.util.find_spec(m) for m in ("deepspeed", "accelerate"))
    return sys.executable if found else None


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_losses_equal_hf_trainer_with_deepspeed(tmp_path: Path, stage: int) -> None:
    pytest.importorskip("accelerate", reason="transformers' Trainer runs on accelerate")
    python = deepspeed_python()
    if python is None:
        pytest.skip("deepspeed is not installed (FLOWTRAIN_DEEPSPEED_PYTHON names a Python "
                    "that has it)")
    worker = REPO / "benchmarks" / "hf_trainer_worker.py"
    out = tmp_path / "out.jsonl"
    shape = ["--stage", str(stage), "--steps", "3", "--warmup", "1", "--n-layer", "2",
             "--n-embd", "64", "--n-head", "2", "--seq", "16", "--vocab", "256",
             "--out", str(out)]
    launch(2, worker, "--engine", "flowtrain", *shape, run_dir=tmp_path / "run", timeout=200)
    env = dict(child_env(), DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = f"{REPO}:{env['PYTHONPATH']}"
    proc = subprocess.run([python, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(worker), "--engine",
                           "deepspeed", *shape], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ours, theirs = (json.loads(line) for line in out.read_text().splitlines())
    assert (ours["wrapped"], theirs["wrapped"]) == ("FlowtrainEngine", "DeepSpeedEngine")
    assert len(ours["losses"]) == 4
    # two engines, two reduction orders: equal to float rounding, step for step
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5)
