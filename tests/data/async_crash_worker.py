"""Worker for tests/checkpoint/test_async_checkpoint.py: one process with checkpoint.async_save. It
publishes a checkpoint at step 10 and writes its parameters to OUT; at step 20 it saves again,
and then, by MODE:
- crash: it is SIGKILLed inside the background write, after the tensor files are written and
  before the checkpoint is published. The write waits until save_checkpoint has returned, so a
  save that did not return before its write would end this worker with exit code 3, not
  SIGKILL.
- exit: the write is slow (1 s) and the script ends at once, without destroy or a wait; it
  writes the step-20 parameters to OUT first. The interpreter must wait for the write.

argv: OUT CKPT_DIR MODE
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import flowtrain
import flowtrain.checkpoint.save as dcp_save


def main() -> None:
    out, ckpt, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    cfg = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "checkpoint": {"save_dir": ckpt, "async_save": True}}
    engine, *_ = flowtrain.initialize(model=model, config=cfg)

    def train(steps: int) -> None:
        for _ in range(steps):
            g = torch.Generator().manual_seed(engine.global_steps)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()

    train(10)
    engine.save_checkpoint()
    engine.wait_for_checkpoint()
    Path(out).write_text(json.dumps({k: v.tolist() for k, v in model.state_dict().items()}))
    train(10)
    returned = threading.Event()
    real_write = dcp_save.write
    if mode == "exit":
        def slow_write(*args: Any) -> None:
            time.sleep(1.0)
            real_write(*args)

        dcp_save.write = slow_write
        engine.save_checkpoint()
        Path(out).write_text(json.dumps({k: v.tolist() for k, v in model.state_dict().items()}))
        return  # no destroy, no wait: the interpreter's exit waits for the writer

    def write_then_die(*args: Any) -> None:
        if not returned.wait(30):
            os._exit(3)
        real_write(*args)
        os.kill(os.getpid(), signal.SIGKILL)

    dcp_save.write = write_then_die
    engine.save_checkpoint()
    returned.set()
    time.sleep(60)  # the kill comes first
    os._exit(4)


if __name__ == "__main__":
    main()
