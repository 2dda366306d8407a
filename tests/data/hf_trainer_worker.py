"""Worker for tests/integrations/test_hf_trainer.py: flowtrain's Hugging Face Trainer
(``flowtrain.integrations.transformers``) on a tiny GPT2LMHeadModel, against
``flowtrain.initialize`` given the same HF config with its "auto" values written out by hand
as HF's Trainer fills them from the TrainingArguments below. Every rank writes
``<out>.rank<R>.json``, one result per config.

Per config: the reference's per-step losses (the same batches the Trainer's sequential,
rank-sharded loader gives); the Trainer's per-step losses over STEPS steps with a checkpoint
at SAVE_AT; the losses of a fresh Trainer resumed from that checkpoint; the logits of the
model ``save_model`` wrote, reloaded with ``from_pretrained``, against the engine's; and
``evaluate()``'s loss against the reloaded model's.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import flowtrain
from engine_common import start_watchdog, write

CONFIGS = Path(__file__).resolve().parents[3] / "shared" / "data" / "ds_configs"
SEQ, VOCAB, MICRO, STEPS, SAVE_AT = 16, 256, 4, 4, 2
# TrainingArguments unlike flowtrain's own defaults, so a value not taken from them shows
LR, BETA1, WEIGHT_DECAY, WARMUP, MAX_GRAD_NORM = 3e-3, 0.85, 0.01, 2, 0.5


class Case(NamedTuple):
    config: str | None  # a file of CONFIGS; None: TrainingArguments without deepspeed=
    gas: int
    precision: str  # fp32, fp16 or bf16: the TrainingArguments' flag
    stage: int | None = None  # in place of the file's ZeRO stage
    best: bool = False  # evaluate at each checkpoint and load the best at the end


CASES = {"zero2": Case("hf_zero2.json", 2, "fp32"),
         "zero3_bf16": Case("hf_zero3_bf16.json", 1, "bf16", best=True),
         "zero1_fp16": Case("hf_zero2.json", 1, "fp16", stage=1),
         # the default config: stage 0 with HF's own AdamW and linear schedule
         "no_config": Case(None, 1, "fp32")}


def gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(11)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    # HF's Trainer counts a causal LM's loss tokens as the shifted labels (15 a sequence) only
    # when the model's loss_type names it, which GPT2LMHeadModel's class name does not: left
    # unset, it counts 16 and every loss it reports is 15/16 of the model's.
    model.loss_type = "ForCausalLM"
    return model


class Tokens(torch.utils.data.Dataset):
    """``count`` sequences of token ids (labels = inputs), the same on every rank."""

    def __init__(self, count: int = 64, seed: int = 3) -> None:
        self.ids = torch.randint(0, VOCAB, (count, SEQ),
                                 generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def written(case: Case) -> dict[str, Any] | None:
    """The config file as the Trainer is given it (a dict where the stage is replaced)."""
    if case.config is None:
        return None
    cfg: dict[str, Any] = json.loads((CONFIGS / case.config).read_text())
    if case.stage is not None:
        cfg["zero_optimization"]["stage"] = case.stage
    return cfg


def by_hand(case: Case) -> dict[str, Any]:
    """The config with each "auto" replaced by what HF's Trainer puts there for the
    arguments of ``arguments`` (hidden size 64)."""
    cfg = written(case) or {"zero_optimization": {"stage": 0}, "fp16": {}, "bf16": {}}
    world = dist.get_world_size()
    cfg.update(train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=case.gas,
               train_batch_size=MICRO * case.gas * world, gradient_clipping=MAX_GRAD_NORM)
    if "optimizer" in cfg:
        cfg["optimizer"]["params"] = {"lr": LR, "betas": [BETA1, 0.999], "eps": 1e-8,
                                      "weight_decay": WEIGHT_DECAY}
        cfg["scheduler"]["params"] = {"warmup_min_lr": 0, "warmup_max_lr": LR,
                                      "warmup_num_steps": WARMUP}
    for section in ("fp16", "bf16", "bfloat16"):
        if section in cfg:
            cfg[section]["enabled"] = case.precision == section.replace("bfloat16", "bf16")
    zero = cfg["zero_optimization"]
    for key, value in (("reduce_bucket_size", 64 * 64),
                       ("stage3_prefetch_bucket_size", int(0.9 * 64 * 64)),
                       ("stage3_param_persistence_threshold", 640)):
        if zero.get(key) == "auto":
            zero[key] = value
    return cfg


def rank_mean(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def reference(case: Case, args: Any) -> tuple[list[float], list[float]]:
    """``flowtrain.initialize`` fed the batches HF's loader gives this rank (sequential
    batches of MICRO, batch j to rank j % world): the per-step losses and gradient norms.
    Without a config, with the optimizer and schedule HF's Trainer makes from ``args``."""
    from transformers import Trainer, get_scheduler

    world, rank, gas = dist.get_world_size(), dist.get_rank(), case.gas
    ids = Tokens().ids
    model = gpt2()
    optimizer = scheduler = None
    if case.config is None:
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        # HF's two groups (with and without weight decay), in its order: the gradient norm
        # adds the parameters up in that order (get_decay_parameter_names does not use self)
        decay = set(Trainer.get_decay_parameter_names(None, model))
        named = list(model.named_parameters())
        optimizer = cls([{"params": [p for n, p in named if n in decay],
                          "weight_decay": args.weight_decay},
                         {"params": [p for n, p in named if n not in decay],
                          "weight_decay": 0.0}], **kwargs)

        def scheduler(opt: Any) -> Any:
            return get_scheduler(args.lr_scheduler_type, opt, num_warmup_steps=WARMUP,
                                 num_training_steps=STEPS)
    engine, *_ = flowtrain.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                      config=by_hand(case))
    losses, norms = [], []
    for step in range(STEPS):
        micro = []
        for m in range(gas):
            j = (step * gas + m) * world + rank
            batch = ids[j * MICRO:(j + 1) * MICRO]
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            micro.append(float(loss))
        losses.append(sum(micro) / gas)
        norms.append(engine.get_global_grad_norm())
    engine.destroy()
    return rank_mean(losses), norms


def arguments(out: Path, case: Case) -> Any:
    from flowtrain.integrations.transformers import TrainingArguments

    cfg = written(case)
    if case.stage is None and case.config is not None:
        cfg = str(CONFIGS / case.config)  # the file itself, as a user passes it
    # the best (lowest) eval loss is the earlier checkpoint's here (training on random tokens
    # raises the loss on other random tokens), so loading it changes the weights the run ends
    # with
    best: dict[str, Any] = dict(eval_strategy="steps", eval_steps=SAVE_AT,
                                load_best_model_at_end=True, metric_for_best_model="loss",
                                greater_is_better=False) if case.best else {}
    return TrainingArguments(
        output_dir=str(out), deepspeed=cfg, per_device_train_batch_size=MICRO,
        per_device_eval_batch_size=MICRO, gradient_accumulation_steps=case.gas,
        max_steps=STEPS, learning_rate=LR, adam_beta1=BETA1,
        weight_decay=WEIGHT_DECAY if case.config else 0.0, warmup_steps=WARMUP,
        max_grad_norm=MAX_GRAD_NORM, bf16=case.precision == "bf16",
        fp16=case.precision == "fp16", save_steps=SAVE_AT, logging_steps=1,
        train_sampling_strategy="sequential", report_to=[], disable_tqdm=True, use_cpu=True,
        **best)


def recording_trainer(args: Any) -> Any:
    """A Trainer that keeps each micro-batch's loss as HF's loop adds it up for its logs, and
    the gradient norm of each step (the engine's, before clipping)."""
    from flowtrain.integrations.transformers import Trainer

    class Recording(Trainer):
        micro: list[float]
        norms: list[float]

        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.micro.append(float(loss))
            if len(self.micro) % self.args.gradient_accumulation_steps == 0:
                self.norms.append(self.engine.get_global_grad_norm())
            return loss

    trainer = Recording(model=gpt2(), args=args, train_dataset=Tokens(),
                        eval_dataset=Tokens(16, seed=5))
    trainer.micro, trainer.norms = [], []
    return trainer


def step_losses(trainer: Any, gas: int) -> list[float]:
    micro = trainer.micro
    return rank_mean([sum(micro[i:i + gas]) for i in range(0, len(micro), gas)])


def run_case(tmp: Path, case: Case) -> dict[str, Any]:
    from transformers import GPT2LMHeadModel

    out: dict[str, Any] = {}
    args = arguments(tmp / "a", case)
    out["reference"], out["reference_norms"] = reference(case, args)
    trainer = recording_trainer(args)
    trainer.train()
    out["trainer"], out["trainer_norms"] = step_losses(trainer, case.gas), trainer.norms
    engine = trainer.engine
    out["stage"], out["bf16"] = engine.zero_optimization_stage(), engine.bfloat16_enabled()
    out["fp16"], out["optimizer"] = engine.fp16_enabled(), type(engine.optimizer).__name__
    out["resolved"] = {k: v for k, (v, _) in engine.config.auto_resolved.items()}
    checkpoint = tmp / "a" / f"checkpoint-{SAVE_AT}"
    out["checkpoint_files"] = sorted(p.name for p in checkpoint.iterdir())
    final = tmp / "final"
    trainer.save_model(str(final))
    eval_loss = trainer.evaluate()["eval_loss"]
    probe = Tokens(2, seed=7).ids
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=probe).logits.float()
    dtype = next(engine.module.parameters()).dtype
    trainer.engine.destroy()
    dist.barrier()  # rank 0 has written the files
    reloaded = GPT2LMHeadModel.from_pretrained(str(final), dtype=dtype).eval()
    with torch.no_grad():
        out["logits_max_diff"] = float((reloaded(input_ids=probe).logits.float() - logits)
                                       .abs().max())
        if case.best:  # the engine ended on the best checkpoint's weights, not the last's
            out["best"] = Path(trainer.state.best_model_checkpoint).name
            for name in (out["best"], f"checkpoint-{STEPS}"):
                saved = GPT2LMHeadModel.from_pretrained(str(tmp / "a" / name), dtype=dtype)
                out[f"{name}_logits_max_diff"] = float(
                    (saved.eval()(input_ids=probe).logits.float() - logits).abs().max())
        evals = Tokens(16, seed=5).ids
        batch_losses = [float(reloaded(input_ids=b, labels=b).loss) for b in evals.split(MICRO)]
    out["eval_loss"], out["eval_reference"] = eval_loss, sum(batch_losses) / len(batch_losses)
    out["reloaded_dtype"] = str(next(reloaded.parameters()).dtype)

    resumed = recording_trainer(arguments(tmp / "b", case))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    out["resumed"] = step_losses(resumed, case.gas)
    out["resumed_global_step"] = resumed.state.global_step
    resumed.engine.destroy()
    return out


def case_arguments() -> dict[str, Any]:
    """flowtrain's TrainingArguments: the config as given, also in a copy, and no DeepSpeed."""
    import dataclasses

    from flowtrain.config.hf import config_of
    from flowtrain.integrations.transformers import TrainingArguments

    inline = '{"zero_optimization": {"stage": 1}}'
    args = TrainingArguments(output_dir="unused", deepspeed=inline, report_to=[], use_cpu=True)
    copy = dataclasses.replace(args, learning_rate=1e-3)
    return {"deepspeed": args.deepspeed, "plugin_is_none": args.deepspeed_plugin is None,
            "config": config_of(args), "copy_config": config_of(copy),
            "copy_lr": copy.learning_rate, "world_size": args.world_size}


def main() -> None:
    start_watchdog(280)
    torch.set_num_threads(1)
    out = sys.argv[1]
    flowtrain.init_distributed()
    result: dict[str, Any] = {}
    try:
        result["arguments"] = case_arguments()
    except Exception:
        result["arguments"] = {"error": traceback.format_exc()}
    for label, case in CASES.items():
        tmp = Path(out).parent / label
        try:
            result[label] = run_case(tmp, case)
        except Exception:
            result[label] = {"error": traceback.format_exc()}
        dist.barrier()
    write(out, result)


if __name__ == "__main__":
    main()
