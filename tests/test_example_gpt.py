"""examples/gpt.py and examples/train_gpt.py: the model's shapes, gradient checkpointing against
the plain forward, and a short two-rank training run whose loss must fall."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from gpt import GPT, GPTConfig
from helpers import EXAMPLES, LAUNCH, REPO, launcher_env

TINY = GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=16)


def _loss_and_grads(config: GPTConfig, idx: torch.Tensor, targets: torch.Tensor
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(config)
    _, loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_forward_shapes_and_initial_loss_near_uniform() -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    idx = torch.randint(0, TINY.vocab_size, (3, 10))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 10, TINY.vocab_size)
    # Small initial weights give nearly uniform predictions: cross-entropy close to ln(vocab).
    assert abs(loss.item() - torch.log(torch.tensor(float(TINY.vocab_size))).item()) < 0.2
    assert model(idx)[1] is None
    assert model.head.weight is model.token_embedding.weight


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    idx = torch.randint(0, TINY.vocab_size, (1, 12))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % TINY.vocab_size
    # A change from position 8 on must leave the logits of positions 0..7 as they were.
    torch.testing.assert_close(model(idx)[0][:, :8], model(changed)[0][:, :8])


def test_gradient_checkpointing_matches_plain_backward() -> None:
    torch.manual_seed(1)
    idx = torch.randint(0, TINY.vocab_size, (4, TINY.block_size))
    targets = torch.randint(0, TINY.vocab_size, (4, TINY.block_size))
    plain_loss, plain_grads = _loss_and_grads(TINY, idx, targets)
    ckpt_config = GPTConfig(**{**TINY.__dict__, "gradient_checkpointing": True})
    ckpt_loss, ckpt_grads = _loss_and_grads(ckpt_config, idx, targets)
    assert abs(plain_loss.item() - ckpt_loss.item()) < 1e-6
    assert plain_grads.keys() == ckpt_grads.keys()
    for name, grad in plain_grads.items():
        assert (grad - ckpt_grads[name]).abs().max().item() < 1e-6, name


def test_generate_appends_greedy_tokens() -> None:
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    idx = torch.randint(0, TINY.vocab_size, (1, 5))
    out = model.generate(idx, 3)
    assert out.shape == (1, 8)
    assert torch.equal(out[:, :5], idx)
    assert out[0, 5].item() == model(idx)[0][0, -1].argmax().item()


def test_the_demo_config_runs_at_any_rank_count() -> None:
    from flowtrain.config import load_config

    raw = json.loads((EXAMPLES / "ds_config_gpt.json").read_text())
    for world in (1, 2, 4, 8):  # the batch rule derives the global batch from the ranks
        assert load_config(raw, world_size=world).global_batch == 16 * world


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_four_ranks_train_the_demo(tmp_path: Path) -> None:
    env = launcher_env(OMP_NUM_THREADS="1")
    command = [*LAUNCH, "--nproc-per-node", "4", "--run-dir", str(tmp_path / "run"),
               str(EXAMPLES / "train_gpt.py"), "--steps", "2", "--seq-len", "16",
               "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--print-every", "1",
               "--sample-chars", "4"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=100)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"first loss ([\d.]+) -> last loss ([\d.]+)", result.stdout +
                     result.stderr)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_rank_training_lowers_the_loss(tmp_path: Path) -> None:
    env = launcher_env(OMP_NUM_THREADS="1")
    command = [*LAUNCH, "--nproc-per-node", "2",
               "--run-dir", str(tmp_path / "run"), str(EXAMPLES / "train_gpt.py"),
               "--steps", "6", "--seq-len", "16", "--n-layer", "1", "--n-head", "2",
               "--n-embd", "32", "--print-every", "2", "--sample-chars", "10",
               "--checkpoint-dir", str(tmp_path / "ckpt")]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    match = re.search(r"first loss ([\d.]+) -> last loss ([\d.]+)", output)
    assert match, output
    first, last = float(match.group(1)), float(match.group(2))
    assert last < first, output
    assert "greedy sample: 'We hold these truths" in output, output
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step6"
