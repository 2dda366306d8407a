"""Worker for tests/plan/test_spec_grid.py: trains ``spec_grid_model.TokenNet`` a few steps at
each grid point named on the command line, one engine after another in this process, each
recording its spans and plan into a run directory of its own (``$FLOWTRAIN_RUN_DIR/<key>``).

argv: KEY ... (``spec_grid_model.key`` of each point)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn

import flowtrain
from flowtrain.env import RUN_DIR
from spec_grid_model import VOCAB, batch, config, factory, point_of

STEPS = 3


def main() -> None:
    base = Path(os.environ[RUN_DIR])
    flowtrain.init_distributed()
    for name in sys.argv[1:]:
        os.environ[RUN_DIR] = str(base / name)
        torch.manual_seed(0)
        model = factory()
        engine, *_ = flowtrain.initialize(model=model, model_parameters=model.parameters(),
                                          config=config(point_of(name)))
        for step in range(STEPS):
            for m in range(engine.gradient_accumulation_steps()):
                ids, targets = batch(step, m)
                loss = nn.functional.cross_entropy(engine(ids).reshape(-1, VOCAB),
                                                   targets.reshape(-1))
                engine.backward(loss)
                engine.step()
        engine.destroy()
    os.environ[RUN_DIR] = str(base)


if __name__ == "__main__":
    main()
