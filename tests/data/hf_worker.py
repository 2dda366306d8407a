"""Worker for tests/integrations/test_hf_interop.py: Hugging Face's raw DeepSpeed configs through
``initialize`` with a Dataset and a tiny GPT2LMHeadModel, and DeepSpeed's names
(``import flowtrain as deepspeed``) on real ranks. Every rank writes ``<out>.rank<R>.json``,
one result per case.

Cases: each HF config trained as written and with its "auto"s written out by hand as HF's
Trainer fills them (losses, dtypes, the resolved values); GatheredParameters under ZeRO-3 with
modifier_rank 0 against an unsharded copy given the same change; zero_to_fp32 on ZeRO-2 and
ZeRO-3 checkpoints against the engine's own consolidated weights; deepspeed.comm's collectives
against sums worked out by hand; the engine's DeepSpeed accessors.
"""

from __future__ import annotations

import copy
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import flowtrain as deepspeed
from engine_common import start_watchdog, write

CONFIGS = Path(__file__).resolve().parents[3] / "shared" / "data" / "ds_configs"
SEQ, VOCAB, STEPS = 16, 256, 3


def gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(11)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


class Tokens(torch.utils.data.Dataset):
    """64 sequences of token ids, the same on every rank."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, VOCAB, (64, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


def train(config: Any, steps: int = STEPS, **kwargs: Any) -> dict[str, Any]:
    model = gpt2()
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=Tokens(), config=config, **kwargs)
    losses = []
    batches = iter(loader)
    for _ in range(steps):
        ids = next(batches)["input_ids"]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    out = {"losses": losses, "micro_batch": len(ids),
           "param_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
           "bf16": engine.bfloat16_enabled(), "fp16": engine.fp16_enabled(),
           "stage": engine.zero_optimization_stage(),
           "resolved": {k: v for k, (v, _) in engine.config.auto_resolved.items()},
           "lr": engine.get_lr()}
    engine.destroy()
    return out


def raw(name: str) -> dict[str, Any]:
    return json.loads((CONFIGS / name).read_text())


def by_hand(name: str, world: int) -> dict[str, Any]:
    """The config with every "auto" replaced as HF's Trainer does with default
    TrainingArguments on this model (hidden size 64); bf16 as its --bf16 run."""
    cfg = raw(name)
    cfg.update(train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=1,
               train_batch_size=8 * world, gradient_clipping=1.0)
    cfg["optimizer"]["params"] = {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                  "weight_decay": 0.0}
    cfg["scheduler"]["params"] = {"warmup_min_lr": 0, "warmup_max_lr": 5e-5,
                                  "warmup_num_steps": 1}
    if "bfloat16" in cfg:
        cfg["bfloat16"] = {"enabled": True}
    else:
        cfg["fp16"]["enabled"] = False
        cfg["bf16"]["enabled"] = False
    z = cfg["zero_optimization"]
    for key, value in (("reduce_bucket_size", 64 * 64),
                       ("stage3_prefetch_bucket_size", int(0.9 * 64 * 64)),
                       ("stage3_param_persistence_threshold", 640)):
        if z.get(key) == "auto":
            z[key] = value
    return cfg


def case_hf_configs() -> dict[str, Any]:
    world = dist.get_world_size()
    out: dict[str, Any] = {}
    for name in ("hf_zero2.json", "hf_zero3_bf16.json"):
        out[name] = {"auto": train(str(CONFIGS / name)), "by_hand": train(by_hand(name, world))}
    # hf_zero3.json as written has reduce_bucket_size 0, which DeepSpeed refuses too
    try:
        train(str(CONFIGS / "hf_zero3.json"))
        out["hf_zero3_raw_error"] = None
    except deepspeed.config.ConfigError as exc:
        out["hf_zero3_raw_error"] = exc.problems
    fixed = raw("hf_zero3.json")
    fixed["zero_optimization"]["reduce_bucket_size"] = 64 * 64
    fixed["train_micro_batch_size_per_gpu"] = 8  # the file sets no batch size at all
    out["hf_zero3.json"] = {"zero3": train(copy.deepcopy(fixed))}
    fixed["zero_optimization"] = {"stage": 0}
    out["hf_zero3.json"]["stage0"] = train(fixed)
    # a TrainingArguments-like object, as HF's Trainer would pass its own
    args = type("Args", (), {"learning_rate": 1e-4, "per_device_train_batch_size": 4,
                             "gradient_accumulation_steps": 1, "bf16": True})()
    out["training_args"] = train(str(CONFIGS / "hf_zero2.json"), auto_values=args)
    return out


def two_steps(zero: dict[str, Any]) -> tuple[Any, Any, Any]:
    """A fresh model, its engine after two steps at ``zero``'s ZeRO settings, and the rest of
    its batches."""
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}
    model = gpt2()
    engine, *_ = deepspeed.initialize(model=model, config=cfg, training_data=Tokens())
    batches = iter(engine.training_dataloader)
    for _ in range(2):
        ids = next(batches)["input_ids"]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    return model, engine, batches


def case_gathered_parameters() -> dict[str, Any]:
    rank = dist.get_rank()
    model, engine, batches = two_steps({"stage": 3, "stage3_param_persistence_threshold": 0})
    before = engine.module_state_dict()
    weight = model.transformer.h[0].mlp.c_fc.weight
    partitioned_before = weight.numel()
    with deepspeed.zero.GatheredParameters(weight, modifier_rank=0):
        inside_shape = list(weight.shape)
        with torch.no_grad():
            if rank == 0:
                weight.mul_(0.5)
            else:
                weight.add_(100.0)  # not the modifier: overwritten on exit
    partitioned_after = weight.numel()
    probe = Tokens().ids[:2]
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=probe).logits
    after = engine.module_state_dict()
    # the reference: an unsharded model with the same weights and the same change
    ref = gpt2()
    ref.load_state_dict(before)
    with torch.no_grad():
        ref.transformer.h[0].mlp.c_fc.weight.mul_(0.5)
        ref_logits = ref(input_ids=probe).logits
    ref_state = ref.state_dict()
    engine.train()
    ids = next(batches)["input_ids"]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()  # the step starts from the changed master weights
    stepped = engine.module_state_dict()["transformer.h.0.mlp.c_fc.weight"]
    engine.destroy()
    return {"partitioned_before": partitioned_before, "inside_shape": inside_shape,
            "partitioned_after": partitioned_after,
            "logits_max_diff": float((logits - ref_logits).abs().max()),
            "state_max_diff": max(float((after[k] - ref_state[k]).abs().max()) for k in after),
            "step_moved_from_changed": float((stepped - after["transformer.h.0.mlp.c_fc.weight"])
                                             .abs().max()),
            "step_diff_from_unchanged": float((stepped - before["transformer.h.0.mlp.c_fc.weight"])
                                              .abs().max())}


def case_zero_to_fp32(tmp: Path) -> dict[str, Any]:
    from flowtrain.utils import zero_to_fp32

    out: dict[str, Any] = {}
    for stage in (2, 3):
        model, engine, _ = two_steps({"stage": stage})
        whole = engine.module_state_dict()
        sixteen = engine._zero3_consolidated_16bit_state_dict()
        ckpt = tmp / f"ckpt{stage}"
        engine.save_checkpoint(str(ckpt))
        engine.destroy()
        dist.barrier()
        res: dict[str, Any] = {"sixteen_is_none": sixteen is None}
        if dist.get_rank() == 0:
            assert sixteen is not None
            res["sixteen_diff"] = max(float((sixteen[k] - whole[k]).abs().max()) for k in whole)
            state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
            res["keys_equal"] = sorted(state) == sorted(whole)
            res["get_diff"] = max(float((state[k] - whole[k]).abs().max()) for k in whole)
            res["dtypes"] = sorted({str(v.dtype) for v in state.values()})
            path = zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(str(ckpt),
                                                                           str(tmp / f"out{stage}"))
            saved = torch.load(path, weights_only=True)
            res["file"] = Path(path).name
            res["convert_diff"] = max(float((saved[k] - whole[k]).abs().max()) for k in whole)
            fresh = zero_to_fp32.load_state_dict_from_zero_checkpoint(gpt2(), str(ckpt))
            res["load_diff"] = max(float((v - whole[k]).abs().max())
                                   for k, v in fresh.state_dict().items())
        out[f"stage{stage}"] = res
        dist.barrier()
    return out


def case_comm() -> dict[str, Any]:
    comm = deepspeed.comm
    rank, world = comm.get_rank(), comm.get_world_size()
    t = torch.tensor([float(rank + 1)])
    comm.all_reduce(t)
    b = torch.tensor([float(rank * 10 + 7)])
    comm.broadcast(b, src=1)
    parts = [torch.zeros(1) for _ in range(world)]
    comm.all_gather(parts, torch.tensor([float(rank)]))
    work = comm.all_reduce(torch.ones(2), async_op=True)
    work.wait()
    comm.barrier()
    return {"rank": rank, "world": world, "local_rank": comm.get_local_rank(),
            "initialized": comm.is_initialized(), "sum": float(t), "bcast": float(b),
            "gathered": [float(p) for p in parts], "backend": comm.get_backend()}


def main() -> None:
    start_watchdog(280)
    torch.set_num_threads(1)
    out = sys.argv[1]
    deepspeed.init_distributed()
    result: dict[str, Any] = {}
    cases = {"comm": case_comm, "hf_configs": case_hf_configs,
             "gathered": case_gathered_parameters,
             "zero_to_fp32": lambda: case_zero_to_fp32(Path(out).parent)}
    for name, case in cases.items():
        try:
            result[name] = case()
        except Exception:
            result[name] = {"error": traceback.format_exc()}
        dist.barrier()
    write(out, result)


if __name__ == "__main__":
    main()
