"""A small character-level GPT: token and position embeddings, pre-LayerNorm transformer blocks
of causal self-attention and a GELU MLP, a final LayerNorm and a head tied to the embedding."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    vocab_size: int = 96
    block_size: int = 64  # the longest context the model sees
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    tie_weights: bool = True  # the head reuses the token embedding matrix
    gradient_checkpointing: bool = False  # recompute each block in backward to save memory


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(f"n_embd ({config.n_embd}) must be a multiple of n_head "
                             f"({config.n_head})")
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        # Head counts come from self.n_head, not from x's width, so that a tensor-parallel
        # split (flowtrain.tp.parallelize: n_head / tp heads per rank) runs unchanged.
        q, k, v = self.qkv(x).chunk(3, dim=2)
        # (batch, time, heads x head size) -> (batch, heads, time, head size)
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(batch, time, -1)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.down = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.position_embedding = nn.Embedding(config.block_size, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_final = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.head.weight = self.token_embedding.weight
        self.apply(self._init_weights)
        # Scaled residual projections keep the residual stream's variance flat with depth (GPT-2).
        for name, param in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (logits of shape (batch, time, vocab), mean cross-entropy or None)."""
        time = idx.shape[1]
        if time > self.config.block_size:
            raise ValueError(f"sequence of length {time} is longer than block_size "
                             f"{self.config.block_size}; cut it or raise block_size")
        positions = torch.arange(time, device=idx.device)
        x = self.dropout(self.token_embedding(idx) + self.position_embedding(positions))
        for block in self.blocks:
            if self.config.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_final(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Appends ``new_tokens`` tokens to ``idx`` (batch, time), each the most likely next one."""
        for _ in range(new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            next_token = logits[:, -1, :].argmax(dim=-1, keepdim=True)
            idx = torch.cat([idx, next_token], dim=1)
        return idx


def build_demo_model() -> GPT:
    """The model `make demo` trains: examples/train_gpt.py's defaults (3 blocks of width 128, 4
    heads, 64-character context) over the characters of examples/data/input.txt. A factory for
    `flowtrain simulate --model gpt:build_demo_model`, which builds it on the meta device."""
    text = (Path(__file__).parent / "data" / "input.txt").read_text(encoding="utf-8")
    return GPT(GPTConfig(vocab_size=len(set(text)), block_size=64, n_layer=3, n_head=4,
                         n_embd=128))


def build_wider_model() -> GPT:
    """A larger GPT than the demo's (6 blocks of width 256, 8 heads, 128-token context, a
    512-token vocabulary; 4.9 M parameters), for `flowtrain tune` and the benchmarks that want
    a second shape: `--model gpt:build_wider_model --seq-len 128`."""
    return GPT(GPTConfig(vocab_size=512, block_size=128, n_layer=6, n_head=8, n_embd=256))
