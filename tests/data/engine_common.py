"""Shared by the engine tests and tests/data/engine_worker.py: the tiny models, the deterministic
data, plain-torch reference loops (no flowtrain), and an in-process world-1 context."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

IN_DIM = 8
REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def world1() -> Iterator[None]:
    """``flowtrain.initialize`` in this process as world size 1; afterwards the process group
    and the rank runtime are torn down and the environment and SIGTERM handler restored."""
    import torch.distributed as dist

    saved_env = {k: os.environ.get(k) for k in
                 ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    saved_term = signal.getsignal(signal.SIGTERM)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    try:
        yield
    finally:
        from flowtrain.runtime.rank import shutdown_rank

        shutdown_rank()
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        signal.signal(signal.SIGTERM, saved_term)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(DATA), env.get("PYTHONPATH", "")])
    return env


def launch(nproc: int, script: Path, *args: str, run_dir: Path | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``flowtrain launch`` on this machine; fails the test with the output when it fails."""
    cmd = [sys.executable, "-m", "flowtrain.cli", "launch", "--nproc-per-node", str(nproc)]
    if run_dir is not None:
        cmd += ["--run-dir", str(run_dir)]
    cmd += [str(script), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"launch failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def run_single(script: Path, *args: str, timeout: float = 120,
               check: bool = True) -> subprocess.CompletedProcess[str]:
    """One plain process (no launcher, world size 1)."""
    proc = subprocess.run([sys.executable, str(script), *args], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script.name} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return proc
