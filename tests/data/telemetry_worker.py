"""Rank script for the telemetry tests: trains the tiny test Net through flowtrain.initialize and
writes ``OUT/rank<R>.json`` with the loss, skip flag and loss scale each step reported.

``--stop-after N`` makes rank 1 freeze itself (SIGSTOP) after step N, so the coordinator
declares it stuck (used to record tests/data/telemetry_run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

from torch import nn

import flowtrain
from engine_common import make_model, micro_batch

MICRO = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", help="directory for rank<R>.json")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps to run")
    parser.add_argument("--sleep", type=float, default=0.0,
                        help="seconds each step sleeps after training (a slower job)")
    parser.add_argument("--fp16-power", type=int, default=None,
                        help="train in fp16 with this initial_scale_power (large: overflows)")
    parser.add_argument("--hz", type=float, default=None, help="flowtrain.telemetry_hz")
    parser.add_argument("--spans-every", type=int, default=None,
                        help="flowtrain.telemetry_spans_every")
    parser.add_argument("--no-telemetry", action="store_true", help="flowtrain.telemetry false")
    parser.add_argument("--stop-after", type=int, default=None,
                        help="rank 1 stops itself with SIGSTOP after this step")
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    section: dict[str, object] = {}
    if args.hz is not None:
        section["telemetry_hz"] = args.hz
    if args.no_telemetry:
        section["telemetry"] = False
    if args.spans_every is not None:
        section["telemetry_spans_every"] = args.spans_every
    config: dict[str, object] = {
        "train_batch_size": MICRO * world, "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "gradient_clipping": 1.0,
        "steps_per_print": 1000, "flowtrain": section,
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 64},
    }
    if args.fp16_power is not None:
        config["fp16"] = {"enabled": True, "loss_scale": 0, "hysteresis": 1,
                          "initial_scale_power": args.fp16_power, "min_loss_scale": 1}
    model = make_model(1234)
    engine, _, _, _ = flowtrain.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    dtype = next(model.parameters()).dtype
    steps: list[dict[str, object]] = []
    for step in range(args.steps):
        x, y = micro_batch(step, rank, 0, MICRO)
        loss = nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        skipped_before = engine.skipped_steps
        engine.step()
        steps.append({"step": engine.global_steps, "loss": loss.item(),
                      "skipped": engine.skipped_steps > skipped_before,
                      "loss_scale": float(engine.loss_scale)})
        if args.sleep:
            time.sleep(args.sleep)
        if args.stop_after is not None and rank == 1 and engine.global_steps == args.stop_after:
            os.kill(os.getpid(), signal.SIGSTOP)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({"steps": steps}))
    print(f"rank {rank} done training at {time.time():.3f}", flush=True)


if __name__ == "__main__":
    main()
