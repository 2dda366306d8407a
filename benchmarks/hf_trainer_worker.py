"""Worker for benchmarks/hf_trainer.py: one Hugging Face Trainer run on a GPT-2 shaped model as
flowtrain's Trainer (--engine flowtrain, under `flowtrain launch`), or as transformers' own
Trainer with DeepSpeed (--engine deepspeed) or with plain DDP (--engine ddp), both under
torchrun. The same model, seed, data, config and HF optimizer (AdamW, linear schedule) in each.
Rank 0 appends one JSON line to --out: the step times after the warm-up, the logged losses."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import torch


def config(stage: int) -> dict[str, Any]:
    """HF style: every batch and precision value "auto"; no optimizer or scheduler section, so
    both Trainers build HF's own AdamW and schedule (DeepSpeed's fused CPU ops need a
    compiler, and the comparison is of the engines, not of two Adam kernels)."""
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                            "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto")
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "fp16": {"enabled": "auto"},
            "bf16": {"enabled": "auto"}, "zero_optimization": zero, "steps_per_print": 10**6}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (count, seq),
                                 generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["flowtrain", "deepspeed", "ddp"], required=True)
    parser.add_argument("--stage", type=int, default=2, help="ZeRO stage (not used by ddp)")
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    parser.add_argument("--micro-batch", type=int, default=4, help="per_device_train_batch_size")
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--n-layer", type=int, default=4, help="GPT-2 layers")
    parser.add_argument("--n-embd", type=int, default=256, help="GPT-2 hidden size")
    parser.add_argument("--n-head", type=int, default=4, help="GPT-2 attention heads")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    parser.add_argument("--out", required=True, help="JSON lines file rank 0 appends to")
    args = parser.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback

    if args.engine == "flowtrain":
        from flowtrain.integrations.transformers import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, n_positions=args.seq,
        vocab_size=args.vocab, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0))
    model.loss_type = "ForCausalLM"  # so HF counts the shifted labels (as tests/ explain)
    params = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them
    world = int(os.environ.get("WORLD_SIZE", "1"))
    total = args.warmup + args.steps
    data = Tokens(total * args.micro_batch * args.grad_accum * world, args.seq, args.vocab)
    times: list[float] = []
    losses: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            times.append(time.perf_counter())

        def on_log(self, *a: Any, logs: dict[str, Any] | None = None, **k: Any) -> None:
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    with tempfile.TemporaryDirectory() as tmp:
        extra = {} if args.engine == "ddp" else {"deepspeed": config(args.stage)}
        targs = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=args.grad_accum, max_steps=total, learning_rate=1e-4,
            logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
            train_sampling_strategy="sequential", use_cpu=not torch.cuda.is_available(), **extra)
        trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[Clock()])
        trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        timed = times[args.warmup - 1:] if args.warmup > 0 else times
        row = {"engine": args.engine, "stage": args.stage, "world": world,
               "step_times": [b - a for a, b in zip(timed, timed[1:])],
               "samples_per_step": args.micro_batch * args.grad_accum * world,
               "params": params, "losses": losses,
               # what actually trained: DeepSpeedEngine, FlowtrainEngine, DistributedDataParallel
               "wrapped": type(trainer.model_wrapped).__name__}
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
    if args.engine == "flowtrain" and getattr(trainer, "engine", None) is not None:
        trainer.engine.destroy()


if __name__ == "__main__":
    main()
