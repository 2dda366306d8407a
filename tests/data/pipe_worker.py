"""Worker for tests/pipe/test_pipeline.py: a PipelineModule trained with train_batch against
single-process training of the same layers on the same global batch (computed on every rank).
Every rank writes ``<out>.rank<R>.json``.

argv: OUT PP  — runs 1F1B and GPipe (fp32), and 1F1B with ZeRO stage 1, for STEPS steps.
"""

from __future__ import annotations

import sys
import threading
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import flowtrain
from engine_common import IN_DIM, micro_batch, start_watchdog, write
from flowtrain.pipe import PipelineModule

MICRO, GAS, STEPS, SEED, LR, CLIP = 4, 4, 20, 31, 0.01, 0.5


def layers() -> list[Any]:
    torch.manual_seed(SEED)
    return [nn.Linear(IN_DIM, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
            nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)]


def reference(dp: int) -> tuple[list[list[float]], dict[str, list[float]]]:
    """Plain torch: per step, the mean loss over every data-parallel rank's micro-batches;
    returns each dp rank's mean loss per step and the final parameters."""
    model = nn.Sequential(*layers())
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    per_rank: list[list[float]] = [[] for _ in range(dp)]
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for d in range(dp):
            local = []
            for m in range(GAS):
                x, y = micro_batch(step, d, m, MICRO)
                loss = nn.functional.mse_loss(model(x), y)
                (loss / (GAS * dp)).backward()
                local.append(float(loss.detach()))
            per_rank[d].append(sum(local) / GAS)
            total += sum(local)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return per_rank, {k: v.flatten().tolist() for k, v in model.state_dict().items()}


def run(pp: int, schedule: str, zero: int, ckpt: int = 0) -> dict[str, Any]:
    module = PipelineModule(layers(), num_stages=pp, loss_fn=nn.functional.mse_loss,
                            partition_method="parameters")
    dp = module.grid.shape.dp
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
           "train_batch_size": MICRO * GAS * dp, "gradient_clipping": CLIP,
           "steps_per_print": 1000, "optimizer": {"type": "Adam", "params": {"lr": LR}},
           "pipeline": {"schedule": schedule, "activation_checkpoint_interval": ckpt},
           "zero_optimization": {"stage": zero}}
    engine, _, _, _ = flowtrain.initialize(model=module, config=cfg)
    dp_rank = module.grid.dp_rank
    losses = []
    for step in range(STEPS):
        data = iter([micro_batch(step, dp_rank, m, MICRO) for m in range(GAS)])
        losses.append(float(engine.train_batch(data)))
    data = iter([micro_batch(STEPS, dp_rank, m, MICRO) for m in range(GAS)])
    eval_loss = float(engine.eval_batch(data))
    params = {f"{i}.{k.split('.', 2)[2]}": v.flatten().tolist()
              for k, v in module.state_dict().items() for i in [k.split(".")[1]]}
    out = {"losses": losses, "params": params, "parts": module.parts, "stage": module.stage_id,
           "dp_rank": dp_rank, "eval_loss": eval_loss,
           "ckpt_interval": module.activation_checkpoint_interval,
           "span_names": sorted({n for n, _, _ in engine.timer.last_step[1]})}
    engine.destroy()
    # the channels' threads are gone once the engine is (finding 5: a thread inside a torch
    # wait at interpreter exit aborts the process)
    out["threads_left"] = [t.name for t in threading.enumerate()
                           if t.name.startswith("flowtrain-pipe")]
    return out


def main() -> None:
    start_watchdog(150)
    torch.set_num_threads(1)
    out, pp = sys.argv[1], int(sys.argv[2])
    flowtrain.init_distributed()
    dp = dist.get_world_size() // pp
    ref_losses, ref_params = reference(dp)
    result: dict[str, Any] = {"reference": {"losses": ref_losses, "params": ref_params}}
    # the reference's loss for the evaluation batch after training
    model = nn.Sequential(*layers())
    model.load_state_dict({k: torch.tensor(v).view_as(p) for (k, v), p in
                           zip(ref_params.items(), model.state_dict().values())})
    with torch.no_grad():
        result["reference"]["eval"] = [
            sum(float(nn.functional.mse_loss(model(x), y)) for x, y in
                (micro_batch(STEPS, d, m, MICRO) for m in range(GAS))) / GAS for d in range(dp)]
    for name, schedule, zero, ckpt in (("1f1b", "1f1b", 0, 0), ("gpipe", "gpipe", 0, 0),
                                       ("1f1b_zero1", "1f1b", 1, 0), ("1f1b_ckpt", "1f1b", 0, 2)):
        try:
            result[name] = run(pp, schedule, zero, ckpt)
        except Exception:
            result[name] = {"error": traceback.format_exc()}
        dist.barrier()
    write(out, result)


if __name__ == "__main__":
    main()
