"""Worker for tests/pipe/test_pipeline.py's checkpoint test: a PipelineModule saved on one number
of pipeline stages resumes on another. Rank 0 writes ``<out>.json``.

argv: save|load CKPT OUT PP
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

import flowtrain
import pipe_worker as pw
from engine_common import micro_batch
from flowtrain.pipe import PipelineModule


def main() -> None:
    mode, ckpt, out, pp = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    torch.set_num_threads(1)
    flowtrain.init_distributed()
    module = PipelineModule(pw.layers(), num_stages=pp, loss_fn=nn.functional.mse_loss)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
           "train_batch_size": 16, "gradient_clipping": 0.5, "steps_per_print": 1000,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    engine, *_ = flowtrain.initialize(model=module, config=cfg)

    def train(a: int, b: int) -> list[float]:
        return [float(engine.train_batch(iter([micro_batch(s, 0, m, 4) for m in range(4)])))
                for s in range(a, b)]

    if mode == "save":
        train(0, 5)
        engine.save_checkpoint(ckpt)
        result = {"straight": train(5, 10)}
    else:
        path, _ = engine.load_checkpoint(ckpt)
        result = {"resumed": train(5, 10), "global_steps": engine.global_steps}
    if engine.global_rank == 0:
        Path(out).write_text(json.dumps(result))
    engine.destroy()


if __name__ == "__main__":
    main()
