"""Small GPT-2 and Llama models for the simulator's model tests: parameter names, shapes and
order as Hugging Face's GPT2LMHeadModel and LlamaForCausalLM, attention as explicit matmuls
(the "eager" path, which FlopCounterMode counts on every device), and factories for
``sims.models.trace_module`` ("sim_models:gpt2_tiny" with this directory importable)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Conv1D(nn.Module):
    """GPT-2's linear layer: weight stored (in, out), y = x·W + b."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.02)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], -1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            dropout: float, training: bool, sdpa: bool = False) -> torch.Tensor:
    """Causal attention over (batch, heads, seq, head_dim) as two matmuls, or through
    F.scaled_dot_product_attention (whose CPU kernel FlopCounterMode does not count, while on
    the meta device it runs as matmuls that it does count)."""
    if sdpa:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout if training else 0.0,
                                              is_causal=True)
    s = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    scores = torch.where(mask[:s, :s], scores, float("-inf"))  # saves only the mask (a buffer)
    probs = F.dropout(torch.softmax(scores, dim=-1), dropout, training)
    return probs @ v


class GPT2Attention(nn.Module):
    sdpa = False

    def __init__(self, hidden: int, heads: int, context: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.c_attn = Conv1D(hidden, 3 * hidden)
        self.c_proj = Conv1D(hidden, hidden)
        self.register_buffer("bias", torch.ones(context, context, dtype=torch.bool).tril(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2)
                   for t in self.c_attn(x).split(h, dim=-1))
        y = _attend(q, k, v, self.bias, self.dropout, self.training, self.sdpa)
        y = self.c_proj(y.transpose(1, 2).reshape(b, s, h))
        return F.dropout(y, self.dropout, self.training)


class GPT2MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout
        self.c_fc = Conv1D(hidden, ffn)
        self.c_proj = Conv1D(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))
        return F.dropout(y, self.dropout, self.training)


class GPT2Block(nn.Module):
    def __init__(self, hidden: int, heads: int, context: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = GPT2Attention(hidden, heads, context, dropout)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = GPT2MLP(hidden, 4 * hidden, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Body(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, context: int,
                 dropout: float) -> None:
        super().__init__()
        self.dropout = dropout
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(context, hidden)
        self.h = nn.ModuleList(GPT2Block(hidden, heads, context, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)


class GPT2LMHeadModel(nn.Module):
    """GPT-2 with its LM head tied to the token embedding."""

    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, context: int,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.transformer = GPT2Body(layers, hidden, heads, vocab, context, dropout)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = self.transformer
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = F.dropout(t.wte(idx) + t.wpe(pos), t.dropout, self.training)
        for block in t.h:
            x = block(x)
        logits = self.lm_head(t.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm that keeps only its input and per-row 1/rms, as a fused kernel does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x.float() * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        xf, gw = x.float(), (grad * weight).float()
        normed = xf * rstd
        dx = rstd * (gw - normed * (gw * normed).mean(-1, keepdim=True))
        dweight = (grad.float() * normed).flatten(0, -2).sum(0)
        return dx.to(x.dtype), dweight.to(weight.dtype), None


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q = self.q_proj(x).view(b, s, self.heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, -1).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        group = self.heads // self.kv_heads
        if group > 1:  # each query head reads its group's K and V
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = _attend(q, k, v, mask, 0.0, self.training)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, h))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(hidden, heads, kv_heads)
        self.mlp = LlamaMLP(hidden, ffn)
        self.input_layernorm = RMSNorm(hidden)
        self.post_attention_layernorm = RMSNorm(hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int,
                 vocab: int, context: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(LlamaDecoderLayer(hidden, heads, kv_heads, ffn)
                                    for _ in range(layers))
        self.norm = RMSNorm(hidden)
        head_dim = hidden // heads
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(context).float(), inv_freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.register_buffer("mask", torch.ones(context, context, dtype=torch.bool).tril(),
                             persistent=False)


class LlamaForCausalLM(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int,
                 vocab: int, context: int) -> None:
        super().__init__()
        self.model = LlamaModel(layers, hidden, heads, kv_heads, ffn, vocab, context)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        m, s = self.model, idx.shape[1]
        x = m.embed_tokens(idx)
        for layer in m.layers:
            x = layer(x, m.cos[:s], m.sin[:s], m.mask)
        return self.lm_head(m.norm(x))


# -- factories for trace_module -----------------------------------------------------------------

GPT2_TINY = dict(layers=2, hidden=64, heads=4, vocab=97, context=32)
LLAMA_TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=101, context=32)
LLAMA_TINY_MHA = dict(LLAMA_TINY, kv_heads=4)
# Llama 2 7B's published shape (Touvron et al. 2023, Table 1; HF config.json).
LLAMA2_7B = dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000,
                 context=4096)


def gpt2_tiny() -> GPT2LMHeadModel:
    return GPT2LMHeadModel(**GPT2_TINY)


def gpt2_tiny_sdpa() -> GPT2LMHeadModel:
    model = gpt2_tiny()
    for block in model.transformer.h:
        block.attn.sdpa = True
    return model


def gpt2_tiny_dropout() -> GPT2LMHeadModel:
    return GPT2LMHeadModel(**GPT2_TINY, dropout=0.1)


def llama_tiny() -> LlamaForCausalLM:
    return LlamaForCausalLM(**LLAMA_TINY)


def llama_tiny_mha() -> LlamaForCausalLM:
    return LlamaForCausalLM(**LLAMA_TINY_MHA)


def llama2_7b_shaped() -> LlamaForCausalLM:
    return LlamaForCausalLM(**LLAMA2_7B)


def tokens_and_targets(batch: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Inputs for a model whose forward takes the targets and returns the loss."""
    return {"idx": torch.zeros(batch, seq_len, dtype=torch.long),
            "targets": torch.zeros(batch, seq_len, dtype=torch.long)}


def not_a_module() -> int:
    return 42
