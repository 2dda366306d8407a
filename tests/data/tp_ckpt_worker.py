"""Worker for tests/tp/test_tensor_parallel.py: tensor parallel x data parallel (ZeRO 0 and 1)
against the unsplit model, and checkpoints that change the tensor-parallel layout.

Every case trains the example GPT (tied head) on the same global batch per step (DP_REF
data-parallel halves) and compares with ``reference()``: the unsplit model trained by plain
torch in this process. Three phases share one checkpoint directory:
- ``one_save`` (1 process, tp 1): saves ``tp1`` at step HALF;
- ``four`` (tp 2 x dp 2): stage 0 and stage 1 runs save ``tp2_s0`` and ``tp2_s1``; resumes from
  ``tp2_s0`` (same tp, stage 0 -> 1) and from ``tp1`` (tp 1 -> 2); a model of other shapes
  refuses the checkpoint; a model with a frozen split weight saves ``tp2_frozen`` and loads it
  back through custom_load_fn;
- ``one_load`` (1 process, tp 1): resumes from ``tp2_s1``; a model of other shapes refuses it.
The one-process phases run inside the test process (no launch). Launched ranks write
``<out>.rank<R>.json``, and rank 0 ``<out>.pt`` (the whole parameters each saving run held).

argv: PHASE OUT CKPT
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist

import flowtrain
from engine_common import start_watchdog, write
from gpt import GPT, GPTConfig

STEPS, HALF, BATCH, SEQ, LR, DP_REF = 6, 3, 2, 8, 3e-3, 2
VOCAB = 96


def make_model(vocab: int = VOCAB) -> GPT:
    torch.manual_seed(5)
    return GPT(GPTConfig(vocab_size=vocab, n_layer=1, n_head=4, n_embd=16, block_size=SEQ))


def batch(step: int, part: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel part ``part`` of step ``step``'s global batch."""
    g = torch.Generator().manual_seed(1000 * step + part)
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def reference() -> list[list[float]]:
    """Per step (1..STEPS), the unsplit model's loss on each data-parallel part, trained by
    torch's AdamW on the whole global batch with the same clipping."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    out = []
    for step in range(STEPS):
        opt.zero_grad()
        losses = []
        for d in range(DP_REF):
            _, loss = model(*batch(step, d))
            (loss / DP_REF).backward()
            losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        out.append(losses)
    return out


def config(tp: int, stage: int) -> dict[str, Any]:
    # one process reads the whole global batch; tp 2 x dp 2 (DP_REF) a part per rank
    return {"train_micro_batch_size_per_gpu": BATCH if tp > 1 else BATCH * DP_REF,
            "gradient_clipping": 1.0, "steps_per_print": 1000,
            "tensor_parallel": {"tp_size": tp}, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}}


def my_batch(engine: Any, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    if engine.world_size == DP_REF:
        return batch(step, engine.dp_rank)
    parts = [batch(step, d) for d in range(DP_REF)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def whole_params(engine: Any) -> dict[str, torch.Tensor]:
    """The model's whole parameters (state-dict keys), tensor-parallel slices put together
    from every rank of the tensor-parallel group. Every rank calls it."""
    grid = engine.grid
    out = {}
    for key, param in engine.module.state_dict(keep_vars=True).items():
        local = param.detach().clone()
        if not getattr(param, "tensor_parallel", False) or grid is None or grid.shape.tp == 1:
            out[key] = local
            continue
        parts = [torch.empty_like(local) for _ in range(grid.shape.tp)]
        dist.all_gather(parts, local, group=grid.tp_group)
        ranges: list[Any] = [None] * grid.shape.tp
        dist.all_gather_object(ranges, param.tp_ranges, group=grid.tp_group)
        d = param.tp_split_dim
        shape = list(local.shape)
        shape[d] = param.tp_full_size
        whole = torch.full(shape, float("nan"))
        for part, rank_ranges in zip(parts, ranges):
            at = 0
            for start, length in rank_ranges:
                whole.narrow(d, start, length).copy_(part.narrow(d, at, length))
                at += length
        out[key] = whole
    return out


FROZEN = "blocks.0.mlp.up.weight"  # a column-parallel weight: split over the tp group


def custom_load(src: dict[str, torch.Tensor], dst: torch.nn.Module) -> None:
    dst.load_state_dict(src)  # strict: src holds this rank's slices


def train(tp: int, stage: int, ckpt: str, *, save: str | None = None, load: str | None = None,
          frozen: bool = False, custom: bool = False, stop: int = STEPS) -> dict[str, Any]:
    """Steps 1..stop, or HALF+1..stop after loading ``load``; ``save`` at step HALF.
    ``frozen``: FROZEN does not train (the saving run moves it first, so a load that skips it
    shows); ``custom``: the load goes through custom_load_fn."""
    model = make_model()
    if frozen:
        model.get_parameter(FROZEN).requires_grad_(False)
    engine, _, _, _ = flowtrain.initialize(model=model, config=config(tp, stage))
    if frozen and save is not None:
        with torch.no_grad():
            engine.module.get_parameter(FROZEN).add_(1.0)
    result: dict[str, Any] = {"dp_rank": engine.dp_rank, "dp": engine.world_size,
                              "tp": tp, "losses": {}, "tensors": {}}
    first = 0
    if load is not None:
        path, _ = engine.load_checkpoint(ckpt, tag=load,
                                         custom_load_fn=custom_load if custom else None)
        assert path is not None
        first = engine.global_steps
        result["loaded_step"] = first
        result["tensors"]["loaded"] = whole_params(engine)
    for step in range(first, stop):
        x, y = my_batch(engine, step)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        result["losses"][str(step + 1)] = float(loss.detach())
        if save is not None and step + 1 == HALF:
            engine.save_checkpoint(ckpt, tag=save)
            result["tensors"]["at_save"] = whole_params(engine)
    engine.destroy()
    return result


def refused(tp: int, ckpt: str, tag: str) -> dict[str, Any]:
    """A model with another vocabulary loads the checkpoint: the error."""
    engine, _, _, _ = flowtrain.initialize(model=make_model(vocab=VOCAB + 32),
                                           config=config(tp, 0))
    try:
        engine.load_checkpoint(ckpt, tag=tag)
        message = None
    except RuntimeError as exc:
        message = str(exc)
    engine.destroy()
    return {"message": message, "tensors": {}}


PHASES: dict[str, dict[str, Any]] = {
    "one_save": {"save_tp1": lambda c: train(1, 0, c, save="tp1")},
    "four": {
        "save_s0": lambda c: train(2, 0, c, save="tp2_s0"),
        "save_s1": lambda c: train(2, 1, c, save="tp2_s1"),
        "tp2_s0->s1": lambda c: train(2, 1, c, load="tp2_s0"),
        "tp1->tp2_s0": lambda c: train(2, 0, c, load="tp1"),
        "refused": lambda c: refused(2, c, "tp2_s0"),
        "save_frozen": lambda c: train(2, 0, c, save="tp2_frozen", frozen=True, stop=HALF),
        "frozen_custom_load": lambda c: train(2, 1, c, load="tp2_frozen", frozen=True,
                                              custom=True, stop=HALF),
    },
    "one_load": {
        "tp2_s1->tp1": lambda c: train(1, 0, c, load="tp2_s1"),
        "refused": lambda c: refused(1, c, "tp2_s1"),
    },
}


def run_phase(phase: str, ckpt: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(this rank's results by case, in JSON's types, with the reference; tensors by case)."""
    flowtrain.init_distributed()
    results: dict[str, Any] = {"reference": reference()}
    tensors: dict[str, Any] = {}
    for case, run in PHASES[phase].items():
        try:
            result = run(ckpt)
            tensors[case] = result.pop("tensors")
            results[case] = result
        except Exception:  # recorded so the other cases still report
            results[case] = {"error": traceback.format_exc()}
        if dist.get_world_size() > 1:
            dist.barrier()
    return json.loads(json.dumps(results)), tensors


def main() -> None:
    start_watchdog(150)
    torch.set_num_threads(1)
    phase, out, ckpt = sys.argv[1:4]
    results, tensors = run_phase(phase, ckpt)
    write(out, results)
    if dist.get_rank() == 0:
        torch.save(tensors, f"{out}.pt")


if __name__ == "__main__":
    main()
