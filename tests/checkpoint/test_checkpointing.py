"""Activation checkpointing: the same loss and gradients as without it, activations recomputed,
and DeepSpeed's module-level API reachable as ``deepspeed.checkpointing``."""

from __future__ import annotations

import torch

import flowtrain as deepspeed
from flowtrain import activation_checkpointing, checkpointing


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = torch.nn.Linear(16, 32)
        self.lin2 = torch.nn.Linear(32, 16)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.lin2(torch.nn.functional.gelu(self.lin1(x)))


def _run(use_checkpoint: bool) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block() for _ in range(3))
    x = torch.randn(4, 16)
    h = x
    for block in blocks:
        h = deepspeed.checkpointing.checkpoint(block, h) if use_checkpoint else block(h)
    loss = h.pow(2).mean()
    loss.backward()
    grads = [p.grad.clone() for p in blocks.parameters()]
    return loss.detach(), grads, sum(b.calls for b in blocks)


def test_checkpoint_matches_plain_backward_and_recomputes() -> None:
    checkpointing.reset()
    loss_plain, grads_plain, calls_plain = _run(False)
    loss_ckpt, grads_ckpt, calls_ckpt = _run(True)
    assert torch.equal(loss_plain, loss_ckpt)
    for a, b in zip(grads_plain, grads_ckpt):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    assert calls_plain == 3 and calls_ckpt == 6  # each block ran again during backward


def test_configure_reads_the_config_section() -> None:
    checkpointing.reset()
    assert not checkpointing.is_configured()
    checkpointing.configure(deepspeed_config={"train_batch_size": 1, "activation_checkpointing": {
        "cpu_checkpointing": True, "number_checkpoints": 4}})
    assert checkpointing.is_configured()
    assert activation_checkpointing._settings.cpu_checkpointing is True
    assert activation_checkpointing._settings.number_checkpoints == 4
    loss_plain, grads_plain, _ = _run(False)
    loss_ckpt, grads_ckpt, _ = _run(True)  # saved inputs go through save_on_cpu
    assert torch.equal(loss_plain, loss_ckpt)
    checkpointing.reset()


def test_deepspeed_path_is_the_activation_checkpointing_api() -> None:
    for name in ("checkpoint", "configure", "is_configured", "non_reentrant_checkpoint", "reset"):
        assert getattr(deepspeed.checkpointing, name) is getattr(activation_checkpointing, name)
