"""Hugging Face's raw DeepSpeed configs and DeepSpeed's names (``import flowtrain as
deepspeed``) on 2 real CPU ranks with a tiny transformers GPT2LMHeadModel
(tests/data/hf_worker.py), and the names that need no ranks, each against a reference: the
same run with HF's "auto"s written out by hand, stage 0, an unsharded model given the same
change, the engine's own consolidated weights, torch.optim.Adam/AdamW."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import DATA, REPO, check_cases, launch, rank_results

pytest.importorskip("transformers")
WORKER = DATA / "hf_worker.py"
CONFIGS = REPO.parent / "shared" / "data" / "ds_configs"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    if not CONFIGS.is_dir():
        pytest.skip(f"real DeepSpeed configs not found at {CONFIGS}")
    out = tmp_path_factory.mktemp("hf") / "out"
    run_dir = out.parent / "run"
    launch(2, WORKER, str(out), run_dir=run_dir, timeout=280)
    return check_cases(rank_results(out, 2)), run_dir


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["hf_zero2.json", "hf_zero3_bf16.json"])
def test_raw_hf_config_trains_as_hf_fills_it(ranks: Any, name: str) -> None:
    for data in ranks[0]:
        run = data["hf_configs"][name]
        auto, by_hand = run["auto"], run["by_hand"]
        assert auto["losses"] == by_hand["losses"]  # identical, step for step
        assert auto["micro_batch"] == 8  # a Dataset: HF's per_device_train_batch_size
        assert auto["resolved"]["optimizer.params.lr"] == 5e-5
        assert auto["resolved"]["optimizer.params.weight_decay"] == 0.0
        assert auto["lr"] == [5e-5]  # WarmupLR's warmup (auto: 1 step) is over
    bf16 = ranks[0][0]["hf_configs"]["hf_zero3_bf16.json"]["auto"]
    zero2 = ranks[0][0]["hf_configs"]["hf_zero2.json"]["auto"]
    if name == "hf_zero3_bf16.json":
        assert bf16["param_dtypes"] == ["torch.bfloat16"] and bf16["bf16"] and bf16["stage"] == 3
        assert (bf16["resolved"]["zero_optimization.reduce_bucket_size"],
                bf16["resolved"]["zero_optimization.stage3_prefetch_bucket_size"],
                bf16["resolved"]["zero_optimization.stage3_param_persistence_threshold"]) == \
            (64 * 64, int(0.9 * 64 * 64), 640)
    else:
        assert zero2["param_dtypes"] == ["torch.float32"] and not zero2["bf16"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_hf_zero3_as_written_is_refused_and_trains_once_fixed(ranks: Any) -> None:
    data = ranks[0][0]["hf_configs"]
    assert data["hf_zero3_raw_error"][0] == \
        "zero_optimization.reduce_bucket_size: expected an integer > 0, got 0"
    run = data["hf_zero3.json"]
    assert run["zero3"]["param_dtypes"] == ["torch.float16"] and run["zero3"]["fp16"]
    assert run["zero3"]["losses"] == pytest.approx(run["stage0"]["losses"], rel=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_training_arguments_object_and_run_directory_record(ranks: Any) -> None:
    data, run_dir = ranks
    args_run = data[0]["hf_configs"]["training_args"]
    assert args_run["micro_batch"] == 4 and args_run["param_dtypes"] == ["torch.bfloat16"]
    assert args_run["resolved"]["optimizer.params.lr"] == 1e-4
    assert args_run["resolved"]["scheduler.params.warmup_max_lr"] == 1e-4
    record = json.loads((run_dir / "auto_values.json").read_text())  # the last initialize's
    assert record["optimizer.params.lr"] == {"value": 1e-4, "from": "auto_values"}
    log = (run_dir / "rank0.jsonl").read_text()
    # once per initialize that had an "auto" (the two raw files, the TrainingArguments run)
    assert log.count("config 'auto' values resolved") == 3
    assert "config 'auto' values resolved" not in (run_dir / "rank1.jsonl").read_text()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_gathered_parameters_modifier_rank_reaches_every_rank(ranks: Any) -> None:
    for data in ranks[0]:
        g = data["gathered"]
        assert g["partitioned_before"] == 0 and g["partitioned_after"] == 0
        assert g["inside_shape"] == [64, 256]  # GPT-2's Conv1D c_fc: (n_embd, 4 n_embd)
        assert g["logits_max_diff"] == 0.0 and g["state_max_diff"] == 0.0
        # the next step moved the changed weights by one Adam step (lr 1e-3), not the old ones
        assert g["step_moved_from_changed"] <= 1.1e-3 < g["step_diff_from_unchanged"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_to_fp32_equals_consolidated_weights(ranks: Any, stage: int) -> None:
    r0 = ranks[0][0]["zero_to_fp32"][f"stage{stage}"]
    assert r0["keys_equal"] and r0["dtypes"] == ["torch.float32"]
    assert r0["get_diff"] == r0["convert_diff"] == r0["load_diff"] == 0.0
    assert r0["file"] == "pytorch_model.bin"
    assert r0["sixteen_diff"] == 0.0 and not r0["sixteen_is_none"]
    assert ranks[0][1]["zero_to_fp32"][f"stage{stage}"]["sixteen_is_none"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_deepspeed_comm_collectives(ranks: Any) -> None:
    for r, data in enumerate(ranks[0]):
        c = data["comm"]
        assert (c["rank"], c["world"], c["local_rank"], c["initialized"]) == (r, 2, r, True)
        assert c["sum"] == 1.0 + 2.0 and c["bcast"] == 17.0  # rank 1's 1 * 10 + 7
        assert c["gathered"] == [0.0, 1.0] and c["backend"] == "gloo"


# -- names that need no ranks --------------------------------------------------------------------

def test_deepspeed_names_exist() -> None:
    import flowtrain as deepspeed
    from flowtrain.engine.engine import FlowtrainEngine

    assert deepspeed.DeepSpeedEngine is FlowtrainEngine
    assert deepspeed.pipe.PipelineModule.__name__ == "PipelineModule"
    for name in ("Init", "GatheredParameters"):
        assert hasattr(deepspeed.zero, name)
    for name in ("get_rank", "get_world_size", "get_local_rank", "barrier", "all_reduce",
                 "broadcast", "is_initialized", "init_distributed", "all_gather"):
        assert callable(getattr(deepspeed.comm, name))
    for name in ("zero_optimization_stage", "fp16_enabled", "bfloat16_enabled",
                 "set_gradient_accumulation_boundary", "zero_gather_16bit_weights_on_model_save",
                 "_zero3_consolidated_16bit_state_dict"):
        assert callable(getattr(FlowtrainEngine, name))
    # before any process group, as deepspeed.comm answers on one process
    assert deepspeed.comm.get_world_size() == 1 and deepspeed.comm.get_rank() == 0


def test_zero_init_records_and_gathered_parameters_leaves_plain_params() -> None:
    import flowtrain as deepspeed

    with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
        model = torch.nn.Linear(4, 4)
    deepspeed.zero.Init(module=model)
    assert deepspeed.zero.Init.recorded[-1] is model
    before = model.weight.detach().clone()
    # not under an engine's stage 3: left alone (DeepSpeed skips parameters without ds_id)
    with deepspeed.zero.GatheredParameters(model.weight, modifier_rank=0):
        assert model.weight.shape == (4, 4)
    assert torch.equal(model.weight, before)


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("cls", ["DeepSpeedCPUAdam", "FusedAdam"])
def test_ops_adam_matches_torch(cls: str, adamw: bool) -> None:
    from flowtrain.ops import adam

    torch.manual_seed(0)
    ref_p = torch.nn.Parameter(torch.randn(50))
    p = torch.nn.Parameter(ref_p.detach().clone())
    mode = {"adamw_mode": adamw} if cls == "DeepSpeedCPUAdam" else {"adam_w_mode": adamw}
    opt = getattr(adam, cls)([p], lr=0.01, weight_decay=0.1, **mode)
    ref = (torch.optim.AdamW if adamw else torch.optim.Adam)([ref_p], lr=0.01, weight_decay=0.1)
    for step in range(5):
        grad = torch.randn(50, generator=torch.Generator().manual_seed(step))
        p.grad, ref_p.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(p.detach(), ref_p.detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="amsgrad"):
        getattr(adam, cls)([p], amsgrad=True)


def test_gradient_accumulation_boundary_override(world1: None) -> None:
    import flowtrain

    model = torch.nn.Linear(3, 1)
    engine, *_ = flowtrain.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert not engine.is_gradient_accumulation_boundary()  # 1 of 4
    engine.set_gradient_accumulation_boundary(True)
    before = model.weight.detach().clone()
    loss = engine(torch.ones(2, 3)).sum()
    engine.backward(loss)
    engine.step()  # told it is the boundary: the optimizer steps after one micro-batch
    assert engine.global_steps == 1 and not torch.equal(model.weight, before)
    assert (engine.zero_optimization_stage(), engine.fp16_enabled(),
            engine.bfloat16_enabled()) == (0, False, False)
    engine.destroy()
