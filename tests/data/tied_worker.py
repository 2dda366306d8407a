"""Worker for tests/engine/test_tied_embedding.py: a small language model whose head is tied to its
embedding, trained by the engine with the tied weight's gradient in two parts (or whole), and by
torch DDP, on the same data. Every rank writes ``<out>.rank<R>.json``.

    flowtrain launch --nproc-per-node 2 tests/data/tied_worker.py OUT CASE[,CASE...]
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import flowtrain
from engine_common import flat_params, start_watchdog, write
from flowtrain.env import RUN_DIR
from flowtrain.plan.names import ROWS

STEPS, MICRO, SEQ, LR = 6, 3, 5, 0.01
HALF = 3  # where the resumed case saves


class TiedLM(nn.Module):
    def __init__(self, vocab: int, width: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width, padding_idx=0)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        x *= 1.5  # an in-place change to the lookup's output, as some models make
        return self.head(torch.tanh(self.mix(x)))


def make_model(vocab: int) -> TiedLM:
    # ranks start apart: the engine and DDP both broadcast rank 0's weights
    torch.manual_seed(7 + 100 * dist.get_rank())
    return TiedLM(vocab)


def batch(step: int, micro: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    ids = torch.randint(0, vocab, (MICRO, SEQ + 1), generator=gen)  # 0, the padding id, too
    return ids[:, :-1], ids[:, 1:]


def loss_of(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def make_engine(vocab: int, gas: int, rows: bool, channel: str) -> tuple[TiedLM, Any]:
    model = make_model(vocab)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "Adam", "params": {"lr": LR}}, "gradient_clipping": 1.0,
           "steps_per_print": 1000, "zero_optimization": {"stage": 0, "reduce_bucket_size": 64},
           "flowtrain": {"data_channel": channel, "tied_embedding_rows": rows}}
    engine, *_ = flowtrain.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    return model, engine


def train(engine: Any, vocab: int, gas: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        local = []
        for m in range(gas):
            x, y = batch(step, m, vocab)
            loss = loss_of(engine(x), y)
            engine.backward(loss)
            engine.step()
            local.append(float(loss))
        losses.append(sum(local) / gas)
    return losses


def run_engine(vocab: int, gas: int, rows: bool, channel: str) -> dict[str, Any]:
    model, engine = make_engine(vocab, gas, rows, channel)
    losses = train(engine, vocab, gas, range(STEPS))
    split = engine._rows
    # the last step's spans: the rows' exchange has one of its own while the split is on
    rows_span = any(name == ROWS for name, _, _ in engine.timer.last_step[1])
    # what this engine's first forward wrote to the run's plan.json (rank 0)
    plan_file = Path(os.environ[RUN_DIR]) / "plan.json"
    recorded = json.loads(plan_file.read_text()).get("tied_embeddings") \
        if dist.get_rank() == 0 else None
    # the first bucket of the settled plan holds the gradient that arrived first in backward
    first = engine._names[engine.plan.buckets[0].slots[0].index]
    # the model called outside the engine looks up as usual: its gradient reaches the weight
    model.zero_grad(set_to_none=True)
    loss_of(model(batch(99, 0, vocab)[0]), batch(99, 0, vocab)[1]).backward()
    outside = model.emb.weight.grad is not None and bool(model.emb.weight.grad[1:].abs().sum() > 0)
    out = {"losses": losses, "params": flat_params(model), "split": split is not None,
           "split_enabled": split is not None and split.enabled, "first_bucket": first,
           "outside_grad": outside, "rows_span": rows_span, "plan_tied": recorded}
    engine.destroy()
    return out


def run_resume(vocab: int, ckpt: Path) -> dict[str, Any]:
    """The dense fallback's run saved at step HALF, and a fresh engine resumed from that
    checkpoint: its first step must reduce the tied gradient as the saved run had come to."""
    model, engine = make_engine(vocab, 1, True, "torch")
    losses = train(engine, vocab, 1, range(HALF))
    engine.save_checkpoint(str(ckpt))
    saved = {"split_enabled": engine._rows.enabled, "layout": engine.bucket_layout()}
    losses += train(engine, vocab, 1, range(HALF, STEPS))
    full = {"losses": losses, "params": flat_params(model)}
    engine.destroy()
    model, engine = make_engine(vocab, 1, True, "torch")
    engine.load_checkpoint(str(ckpt))
    loaded = {"split_enabled": engine._rows.enabled, "layout": engine.bucket_layout()}
    resumed = {"losses": train(engine, vocab, 1, range(HALF, STEPS)),
               "params": flat_params(model)}
    engine.destroy()
    return {"full": full, "resumed": resumed, "saved": saved, "loaded": loaded}


def run_ddp(vocab: int, gas: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model(vocab)
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        local = []
        for m in range(gas):
            x, y = batch(step, m, vocab)
            with ddp.no_sync() if m < gas - 1 else contextlib.nullcontext():
                loss = loss_of(ddp(x), y)
                (loss / gas).backward()
            local.append(float(loss))
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        losses.append(sum(local) / gas)
    return {"losses": losses, "params": flat_params(model)}


# name: (vocab, gas, engine settings or None for DDP). Vocabulary 41 holds more distinct ids
# than two ranks' 15 tokens, so the rows are exchanged; vocabulary 7 holds fewer, so the first
# step reduces them densely and switches the split off.
CASES: dict[str, tuple[int, int, dict[str, Any] | None]] = {
    "rows_shm": (41, 1, {"rows": True, "channel": "shm"}),
    "rows_torch_gas2": (41, 2, {"rows": True, "channel": "torch"}),
    "whole": (41, 1, {"rows": False, "channel": "shm"}),
    "ddp": (41, 1, None), "ddp_gas2": (41, 2, None),
    "dense_fallback": (7, 1, {"rows": True, "channel": "torch"}), "ddp_small": (7, 1, None),
}
RESUME = "dense_resume"  # the dense fallback saved at HALF and resumed (run_resume)


def main() -> None:
    start_watchdog(240)
    out, names = sys.argv[1], sys.argv[2]
    flowtrain.init_distributed()
    result: dict[str, Any] = {}
    for name in names.split(","):
        try:
            if name == RESUME:
                result[name] = run_resume(7, Path(out).parent / "resume_ckpt")
            else:
                vocab, gas, settings = CASES[name]
                result[name] = run_ddp(vocab, gas) if settings is None else \
                    run_engine(vocab, gas, **settings)
        except Exception:  # recorded so the other cases still report
            result[name] = {"error": traceback.format_exc()}
        dist.barrier()
    write(out, result)


if __name__ == "__main__":
    main()
