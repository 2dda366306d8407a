"""Worker for tests/pipe/test_interleaved.py: a PipelineModule trained with the interleaved 1F1B
schedule (two model chunks per stage) against single-process training of the same layers on the
same global batch (computed on every rank), and a checkpoint of the interleaved run saved and
loaded back. Every rank writes ``<out>.rank<R>.json``.

argv: OUT CKPT — on 2 ranks: pp 2; on 4 ranks: pp 4, and pp 2 x dp 2.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import flowtrain
from engine_common import IN_DIM, micro_batch, start_watchdog, write
from flowtrain.pipe import PipelineModule

MICRO, GAS, STEPS, SEED, LR, CLIP, V = 4, 4, 6, 17, 0.01, 0.5, 2


def layers() -> list[Any]:
    """Ten layers: enough for 4 stages x 2 chunks, every chunk holding a Linear."""
    torch.manual_seed(SEED)
    out: list[Any] = [nn.Linear(IN_DIM, 16), nn.Tanh()]
    for _ in range(3):
        out += [nn.Linear(16, 16), nn.Tanh()]
    return out + [nn.Linear(16, 16), nn.Linear(16, 1)]


def reference(dp: int) -> tuple[list[list[float]], dict[str, list[float]]]:
    """Plain torch: each dp rank's mean loss per step and the final parameters."""
    model = nn.Sequential(*layers())
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    per_rank: list[list[float]] = [[] for _ in range(dp)]
    for step in range(STEPS):
        opt.zero_grad()
        for d in range(dp):
            local = []
            for m in range(GAS):
                x, y = micro_batch(step, d, m, MICRO)
                loss = nn.functional.mse_loss(model(x), y)
                (loss / (GAS * dp)).backward()
                local.append(float(loss.detach()))
            per_rank[d].append(sum(local) / GAS)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return per_rank, {k: v.flatten().tolist() for k, v in model.state_dict().items()}


def config(dp: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "train_batch_size": MICRO * GAS * dp, "gradient_clipping": CLIP,
            "steps_per_print": 1000, "optimizer": {"type": "Adam", "params": {"lr": LR}},
            "pipeline": {"schedule": "interleaved", "virtual_stages": V}}


def train(engine: Any, dp_rank: int, steps: range) -> list[float]:
    return [float(engine.train_batch(iter([micro_batch(step, dp_rank, m, MICRO)
                                           for m in range(GAS)]))) for step in steps]


def run(pp: int) -> dict[str, Any]:
    module = PipelineModule(layers(), num_stages=pp, loss_fn=nn.functional.mse_loss,
                            partition_method="uniform")
    dp = module.grid.shape.dp
    engine, _, _, _ = flowtrain.initialize(model=module, config=config(dp))
    dp_rank = module.grid.dp_rank
    losses = train(engine, dp_rank, range(STEPS))
    data = iter([micro_batch(STEPS, dp_rank, m, MICRO) for m in range(GAS)])
    eval_loss = float(engine.eval_batch(data))
    params = {f"{i}.{k.split('.', 2)[2]}": v.flatten().tolist()
              for k, v in module.state_dict().items() for i in [k.split(".")[1]]}
    out = {"losses": losses, "params": params, "parts": module.parts, "stage": module.stage_id,
           "chunks": module.chunk_ranges, "dp_rank": dp_rank, "eval_loss": eval_loss,
           "span_names": sorted({n for n, _, _ in engine.timer.last_step[1]})}
    engine.destroy()
    return out


def checkpoint_round_trip(pp: int, ckpt: str) -> dict[str, Any]:
    """Two steps, save, two more; a fresh engine loads the checkpoint and runs the same two."""
    def engine_of() -> tuple[Any, int]:
        module = PipelineModule(layers(), num_stages=pp, loss_fn=nn.functional.mse_loss,
                                partition_method="uniform")
        engine, *_ = flowtrain.initialize(model=module, config=config(module.grid.shape.dp))
        return engine, module.grid.dp_rank

    engine, dp_rank = engine_of()
    train(engine, dp_rank, range(2))
    engine.save_checkpoint(ckpt)
    straight = train(engine, dp_rank, range(2, 4))
    engine.destroy()
    engine, dp_rank = engine_of()
    engine.load_checkpoint(ckpt)
    resumed = train(engine, dp_rank, range(2, 4))
    steps = engine.global_steps
    engine.destroy()
    return {"straight": straight, "resumed": resumed, "global_steps": steps}


def main() -> None:
    start_watchdog(200)
    torch.set_num_threads(1)
    out, ckpt = sys.argv[1], sys.argv[2]
    flowtrain.init_distributed()
    world = dist.get_world_size()
    result: dict[str, Any] = {}
    for name, pp in (("pp", world), ("pp2_dp2", 2)) if world == 4 else (("pp", world),):
        dp = world // pp
        ref_losses, ref_params = reference(dp)
        result[f"{name}_reference"] = {"losses": ref_losses, "params": ref_params}
        model = nn.Sequential(*layers())
        model.load_state_dict({k: torch.tensor(v).view_as(p) for (k, v), p in
                               zip(ref_params.items(), model.state_dict().values())})
        with torch.no_grad():
            result[f"{name}_reference"]["eval"] = [
                sum(float(nn.functional.mse_loss(model(x), y)) for x, y in
                    (micro_batch(STEPS, d, m, MICRO) for m in range(GAS))) / GAS
                for d in range(dp)]
        try:
            result[name] = run(pp)
        except Exception:
            result[name] = {"error": traceback.format_exc()}
        dist.barrier()
    try:
        result["checkpoint"] = checkpoint_round_trip(world, ckpt)
    except Exception:
        result["checkpoint"] = {"error": traceback.format_exc()}
    write(out, result)


if __name__ == "__main__":
    main()
