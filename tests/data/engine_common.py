"""Shared by the launched workers in tests/data and the tests that check them: the tiny model,
the deterministic data, a plain-torch reference loop (no flowtrain), and how a rank writes its
results."""

from __future__ import annotations

import faulthandler
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

IN_DIM = 8


class Net(nn.Module):
    """~450 parameters; ``unused`` never takes part in forward (its gradient is never produced)."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN_DIM, 16)
        self.fc2 = nn.Linear(16, 16)
        self.unused = nn.Linear(4, 3)
        self.head = nn.Linear(16, 1)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        h = self.drop(torch.tanh(self.fc2(h)))
        return self.head(h)


def make_model(seed: int, dropout: float = 0.0) -> Net:
    torch.manual_seed(seed)
    return Net(dropout)


def micro_batch(step: int, rank: int, micro: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch rank ``rank`` trains on at optimizer step ``step``, accumulation index
    ``micro``; the same on every process."""
    g = torch.Generator().manual_seed(100_003 * step + 1_009 * rank + micro + 7)
    x = torch.randn(size, IN_DIM, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(size, 1, generator=g)
    return x, y


def global_batch(step: int, world: int, gas: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [micro_batch(step, r, m, size) for r in range(world) for m in range(gas)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def dataset(n: int = 56, seed: int = 5) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN_DIM, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    return torch.utils.data.TensorDataset(x, y)


def flat_params(model: nn.Module) -> dict[str, list[float]]:
    return {n: p.detach().float().flatten().tolist() for n, p in model.named_parameters()}


def plain_reference(*, steps: int, world: int, gas: int, micro: int, lr: float, clip: float,
                    seed: int) -> dict[str, Any]:
    """Single-process torch: the same init as rank 0, Adam, the global batch in one forward."""
    model = make_model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses, norms = [], []
    for step in range(steps):
        x, y = global_batch(step, world, gas, micro)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(
            model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "grad_norms": norms, "params": flat_params(model)}


def write(out: str, data: dict[str, Any]) -> None:
    """This rank's results to ``<out>.rank<R>.json``, whole or not at all (written aside, then
    renamed)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = Path(f"{out}.rank{rank}.json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def start_watchdog(default_s: float) -> None:
    """A hung rank prints every thread's stack and exits instead of stalling the test: after
    ENGINE_WORKER_WATCHDOG seconds (``default_s`` when unset)."""
    faulthandler.dump_traceback_later(float(os.environ.get("ENGINE_WORKER_WATCHDOG", default_s)),
                                      exit=True)
