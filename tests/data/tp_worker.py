"""Worker for tests/tp/test_tensor_parallel.py: the example GPT split with tensor_parallel.tp_size
against the unsplit model trained in-process on every rank (same batches, same weights).
Every rank writes ``<out>.rank<R>.json``.

argv: OUT TP
"""

from __future__ import annotations

import copy
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist

import flowtrain
from engine_common import start_watchdog, write
from flowtrain import tp as ftp
from gpt import GPT, GPTConfig

STEPS, BATCH, SEQ, LR = 12, 4, 16, 3e-3


def batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    x = torch.randint(0, 96, (BATCH, SEQ + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def run(tp: int, tied: bool, client: bool = False) -> dict[str, Any]:
    torch.manual_seed(5)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=SEQ, tie_weights=tied))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 1.0,
                           "steps_per_print": 1000, "tensor_parallel": {"tp_size": tp}}
    if client:
        # a plain model, a client AdamW built before initialize splits it, and a pipeline
        # section that names no stage count (DeepSpeed ignores it on a plain module)
        cfg["pipeline"] = {"activation_checkpoint_interval": 0}
        client_opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        engine, _, _, _ = flowtrain.initialize(model=model, optimizer=client_opt, config=cfg)
    else:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}
        engine, _, _, _ = flowtrain.initialize(model=model, config=cfg)
    kinds = {type(m).__name__ for m in model.modules()}
    x, _ = batch(99, 0)
    with torch.no_grad():
        out_split, out_ref = model(x)[0], ref(x)[0]
    losses, ref_losses = [], []
    dp_rank = engine.dp_rank
    for step in range(STEPS):
        x, y = batch(step, dp_rank)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        # the unsplit model on the same global batch (every data-parallel rank's)
        ref_opt.zero_grad()
        total = 0.0
        for d in range(engine.world_size):
            xd, yd = batch(step, d)
            _, rl = ref(xd, yd)
            (rl / engine.world_size).backward()
            if d == dp_rank:
                ref_losses.append(float(rl.detach()))
            total += float(rl.detach())
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
        ref_opt.step()
    out = {"losses": losses, "ref_losses": ref_losses,
           "forward_max_diff": float((out_split - out_ref).abs().max()),
           "parallel_layers": sorted(k for k in kinds if "Parallel" in k),
           "n_head": model.blocks[0].attn.n_head, "grad_norm": engine.get_global_grad_norm(),
           "ref_grad_norm": ref_norm,
           "local_params": sum(p.numel() for p in model.parameters()),
           "full_params": sum(p.numel() for p in ref.parameters())}
    engine.destroy()
    return out


def main() -> None:
    start_watchdog(150)
    torch.set_num_threads(1)
    out, tp = sys.argv[1], int(sys.argv[2])
    flowtrain.init_distributed()
    result: dict[str, Any] = {}
    for name, tied, client in (("tied", True, False), ("untied", False, False),
                               ("client", True, True)):
        try:
            result[name] = run(tp, tied, client)
        except Exception:
            result[name] = {"error": traceback.format_exc()}
        dist.barrier()
    # the layers on their own: vocab-parallel cross-entropy against torch's
    try:
        group = None
        torch.manual_seed(3)
        logits = torch.randn(6, 8, requires_grad=True)
        target = torch.randint(0, 8, (6,))
        full = torch.nn.functional.cross_entropy(logits, target)
        full.backward()
        rank, world = dist.get_rank(), dist.get_world_size()
        part = logits.detach()[:, rank * 8 // world:(rank + 1) * 8 // world].clone()
        part.requires_grad_(True)
        mine = ftp.vocab_parallel_cross_entropy(part, target, group)
        mine.backward()
        result["xent"] = {"loss": float(mine), "ref": float(full),
                          "grad_diff": float((part.grad - logits.grad[
                              :, rank * 8 // world:(rank + 1) * 8 // world]).abs().max())}
    except Exception:
        result["xent"] = {"error": traceback.format_exc()}
    write(out, result)


if __name__ == "__main__":
    main()
