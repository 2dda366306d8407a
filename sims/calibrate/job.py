"""The training job ``flowtrain calibrate`` launches to see the engine at work on this host.

Timing an op in a quiet process undershoots what the same op takes inside a launched rank: the
engine's helper threads (its actor event loop, the shared-memory channel's polling, telemetry)
share the cores with the compute thread, the launcher and its other ranks run beside it, and a
rank given several OpenMP threads rarely gets them all, so a forward runs slower in the engine
than alone. So calibration launches this job (``flowtrain launch -m sims.calibrate.job``, by
``sims.calibrate.jobs``) at each rank count and holds its recorded spans against the
simulator's prediction of the same job from the isolated measurements: the ratio, per rank
count, is the profile's engine factor. A 2-stage pipeline run of the same model shows what each
pipeline instruction costs beyond its compute and its send (handing it between the stage's
actor, its compute thread and gloo's threads).

The model is a calibration model of its own (widths, rows and depth that none of the
benchmarks use), trained data parallel with the engine's defaults.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

# The calibration model: residual MLP blocks, the structure of a transformer's MLP (the matmul
# work of most models), at widths and rows no benchmark uses: an input layer IN_WIDTH -> WIDTH,
# BLOCKS blocks x + proj(relu(fc(x))) of WIDTH -> HIDDEN -> WIDTH, a head WIDTH -> OUT_WIDTH.
# (A plain chain of Linear+ReLU layers runs slower per FLOP than its layers timed alone;
# residual blocks run as fast as theirs, as the benchmark models and the demo's GPT do.)
ROWS = 48
# the data-parallel job's sizes (rows per micro-batch): a line through three points, so that
# one size measured in a slow spell of the host tilts it less than one of two did
ROWS_BY_SIZE = (ROWS, 2 * ROWS, 4 * ROWS)
IN_WIDTH = 32
WIDTH = 192
HIDDEN = 768
BLOCKS = 3
OUT_WIDTH = 16


def config(micro_batch: int = ROWS, micro_batches: int = 1, zero3: bool = False,
           bucket: int | None = None) -> dict[str, Any]:
    """The job's ds_config: data parallel (ZeRO stage 0), AdamW, the engine's default buckets
    (``bucket``: this many elements per bucket instead); ``micro_batches`` per step (a
    pipeline's micro-batches). ``zero3``: ZeRO stage 3 without prefetch, so each module's
    gather, its hand-off to the parameter fetcher and its compute follow one another and the
    hand-offs can be read off the forward."""
    zero: dict[str, Any] = {"stage": 0}
    if zero3:
        zero = {"stage": 3, "stage3_prefetch_bucket_size": 0}
    if bucket is not None:
        zero["reduce_bucket_size"] = bucket
    return {"train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": micro_batches, "steps_per_print": 10**9,
            "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


ZERO3_DIR = "zero3"  # the ZeRO-3 run's directory (jobs of 2 ranks or more)
# the small-bucket run's directory (jobs of 2 ranks or more), and its bucket size in elements:
# about a dozen buckets of the model's 0.9 M parameters, each handed to the reducer on its own
BUCKETS_DIR = "buckets"
SMALL_BUCKET = 50_000


PIPELINE_MICRO_BATCHES = 4


def main(argv: list[str] | None = None) -> int:
    """One rank of the job: trains ``--steps`` steps as a ``--pp``-stage 1F1B pipeline of
    PIPELINE_MICRO_BATCHES micro-batches (pp > 1; the engine records in the launcher's run
    directory), or data parallel at each of ROWS_BY_SIZE rows per micro-batch, each recorded
    in ``rows{n}/`` of the run directory, then (2 ranks or more) at ROWS rows with ZeRO stage
    3, recorded in ``zero3/``, and with SMALL_BUCKET-element buckets, in ``buckets/``."""
    parser = argparse.ArgumentParser(prog="python -m sims.calibrate.job")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--pp", type=int, default=1)
    args = parser.parse_args(argv)

    import torch
    from torch import nn

    import flowtrain

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(WIDTH, HIDDEN)
            self.proj = nn.Linear(HIDDEN, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.proj(torch.relu(self.fc(x)))

    torch.manual_seed(0)
    flowtrain.init_distributed()
    layers: list[nn.Module] = [nn.Linear(IN_WIDTH, WIDTH), *(Block() for _ in range(BLOCKS)),
                               nn.Linear(WIDTH, OUT_WIDTH)]
    generator = torch.Generator().manual_seed(1)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(ROWS, IN_WIDTH, generator=generator),
                torch.randn(ROWS, OUT_WIDTH, generator=generator))

    if args.pp > 1:
        from flowtrain.pipe import PipelineModule

        module = PipelineModule(layers, num_stages=args.pp, loss_fn=nn.functional.mse_loss,
                                partition_method="parameters")
        engine, _, _, _ = flowtrain.initialize(
            model=module, config=config(micro_batches=PIPELINE_MICRO_BATCHES))
        for _ in range(args.steps):
            engine.train_batch(iter([batch() for _ in range(PIPELINE_MICRO_BATCHES)]))
        engine.destroy()
        return 0
    import copy
    import os
    from pathlib import Path

    import torch.distributed as dist

    from flowtrain.env import RUN_DIR

    # Sizes of the same model, each recorded in a run directory of its own: what the engine
    # adds to a pass that grows with its work and what it adds per step can then be told apart.
    # Where there are ranks to reduce over, ZeRO-3 shows what each module's parameter fetch
    # costs the engine besides its gather, and small buckets what each bucket's hand-off to
    # the reducer costs besides its reduce.
    base = os.environ.get(RUN_DIR)
    world = dist.get_world_size() if dist.is_initialized() else 1
    runs = [(f"rows{rows}", config(micro_batch=rows)) for rows in ROWS_BY_SIZE]
    if world > 1:
        runs += [(ZERO3_DIR, config(zero3=True)), (BUCKETS_DIR, config(bucket=SMALL_BUCKET))]
    for name, ds_config in runs:
        rows = ds_config["train_micro_batch_size_per_gpu"]
        if base:
            os.environ[RUN_DIR] = str(Path(base) / name)
        model = nn.Sequential(*copy.deepcopy(layers))
        engine, _, _, _ = flowtrain.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds_config)
        for _ in range(args.steps):
            x = torch.randn(rows, IN_WIDTH, generator=generator)
            target = torch.randn(rows, OUT_WIDTH, generator=generator)
            engine.backward(nn.functional.mse_loss(engine(x), target))
            engine.step()
        if name == f"rows{ROWS_BY_SIZE[-1]}" and base:
            _time_gloo(Path(base) / GLOO_FILE)
        engine.destroy()
    return 0


GLOO_FILE = "gloo.json"
GLOO_BYTES = (64 << 10, 4 << 20)


def _time_gloo(out: Any) -> None:
    """Gloo's collectives among the job's ranks, timed as calibration times them, but inside a
    launched rank beside a live engine (its runtime's threads, the launcher): rank 0 writes
    the records to ``out``. ZeRO's all-gathers and global norm, and the pipeline's data
    parallel reduces, are such calls."""
    import dataclasses
    import json

    import torch.distributed as dist

    from sims.calibrate.collectives import time_collectives
    from sims.calibrate.settings import QUICK

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world < 2:
        return
    settings = dataclasses.replace(QUICK, collective_bytes=GLOO_BYTES, collective_trials=5)
    records = time_collectives(None, world, settings)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(records))


if __name__ == "__main__":
    sys.exit(main())
