"""A decoder-only transformer described by its shape and features (``Architecture``): the
presets, the parameters it lists, the matmul FLOPs of its forward and the activation bytes it
keeps for backward. Architecture files and Hugging Face configs read into one
(``sims.model_files``)."""

from __future__ import annotations

from dataclasses import dataclass

ParamShapes = tuple[tuple[str, tuple[int, ...]], ...]

FAMILIES = ("gpt2", "llama", "custom")
NORMS = ("layernorm", "rmsnorm")
# gated activations multiply the activated gate by a second projection (three MLP matrices)
ACTIVATIONS = ("gelu", "relu", "squared-relu", "silu", "swiglu", "geglu")
GATED = ("swiglu", "geglu")
POSITIONS = ("learned", "rotary", "alibi", "none")

# each family's features where the architecture does not name its own: GPT-2 (LayerNorm, GeLU,
# learned positions, biases, a tied head, dropout 0.1) and Llama (RMSNorm, SwiGLU, rotary
# positions, no biases, an untied head, no dropout); "custom" starts from Llama's
_FAMILY_DEFAULTS = {
    "gpt2": {"norm": "layernorm", "activation": "gelu", "position": "learned", "biases": True,
             "tied": True, "dropout": True},
    "llama": {"norm": "rmsnorm", "activation": "swiglu", "position": "rotary", "biases": False,
              "tied": False, "dropout": False},
}
_FAMILY_DEFAULTS["custom"] = _FAMILY_DEFAULTS["llama"]


class AttentionWidths:
    """The attention widths both shape records derive the same way (``Architecture``, the
    user's description, and ``sims.workload.TransformerShape``, the priced shape): declared
    here, set as fields by each."""

    hidden: int
    heads: int
    kv_heads: int
    head_size: int | None

    @property
    def head_dim(self) -> int:
        """Each head's width: ``head_size``, else hidden / heads."""
        return self.head_size if self.head_size is not None else self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """The width of the queries (and of the attention's output): heads x head_dim."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class Architecture(AttentionWidths):
    """The shape of a decoder-only transformer, enough to list its parameters and count its work.

    ``family`` sets the defaults of the features left None ("gpt2": LayerNorm, GeLU MLP of
    ``ffn``, learned positions, linear biases, the LM head tied to the token embedding,
    dropout; "llama" and "custom": RMSNorm, SwiGLU MLP of ``ffn``, rotary positions, no
    biases, an untied head, no dropout) and the parameters' names (GPT-2's fused QKV
    ``c_attn`` or Llama's separate projections). ``head_size`` None: ``hidden / heads``.
    ``parallel_block``: attention and MLP read the same input and add into one residual
    (GPT-J, GPT-NeoX, Falcon). ``dropout`` changes only the activation bytes.
    """

    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    context: int
    source: str = ""
    dropout: bool | None = None
    tied: bool | None = None
    norm: str | None = None
    activation: str | None = None
    position: str | None = None
    biases: bool | None = None
    head_size: int | None = None
    parallel_block: bool = False
    # rows a learned position table has beyond ``context`` (OPT's offset of 2)
    extra_positions: int = 0
    # Q, K and V as one linear (GPT-2's c_attn, Falcon's query_key_value), and a gated MLP's
    # gate and up as one (Phi-3's gate_up_proj); None: the family's (fused in gpt2)
    fused_qkv: bool | None = None
    fused_gate_up: bool = False

    @property
    def tied_embeddings(self) -> bool:
        return bool(self.tied)

    @property
    def gated_mlp(self) -> bool:
        return self.activation in GATED

    @property
    def rotary(self) -> bool:
        return self.position == "rotary"

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"architecture family {self.family!r} is not known; choose one of "
                             f"{', '.join(FAMILIES)}")
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"architecture {name} must be an integer > 0, got {value!r}")
        for name, value in _FAMILY_DEFAULTS[self.family].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.fused_qkv is None:
            object.__setattr__(self, "fused_qkv", self.family == "gpt2")
        for name, choices in (("norm", NORMS), ("activation", ACTIVATIONS),
                              ("position", POSITIONS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"architecture {name} must be one of {', '.join(choices)}, "
                                 f"got {getattr(self, name)!r}")
        if self.head_size is not None:
            if isinstance(self.head_size, bool) or not isinstance(self.head_size, int) or \
                    self.head_size < 1:
                raise ValueError(f"architecture head_dim must be an integer > 0, got "
                                 f"{self.head_size!r}")
        elif self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} must divide into heads {self.heads} (or "
                             f"give head_dim)")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} must divide into kv_heads {self.kv_heads}")


_GPT2_SOURCE = ("Radford et al. 2019 (GPT-2) Table 2 layers/width; Hugging Face "
                "openai-community/gpt2* config.json for heads, vocab 50257, n_positions 1024")
_LLAMA2_SOURCE = ("Touvron et al. 2023 (arXiv:2307.09288) Table 1; Hugging Face "
                  "meta-llama/Llama-2-*-hf config.json (intermediate_size, 32000 vocab)")
_LLAMA3_SOURCE = ("Meta Llama 3 model card; Hugging Face meta-llama/Meta-Llama-3-*/config.json "
                  "(intermediate_size, num_key_value_heads 8, vocab 128256, 8192 positions)")

_OPT_SOURCE = ("Zhang et al. 2022 (arXiv:2205.01068) Table 1; Hugging Face facebook/opt-1.3b "
               "config.json (ffn_dim 8192, vocab 50272, 2048 positions and OPT's offset of 2, "
               "relu, dropout 0.1)")
_FALCON_SOURCE = ("Almazrouei et al. 2023 (arXiv:2311.16867); Hugging Face tiiuae/falcon-7b "
                  "config.json (hidden 4544, 71 heads, multi_query, parallel_attn, bias false, "
                  "vocab 65024)")

PRESETS: dict[str, Architecture] = {
    "gpt2": Architecture("gpt2", 12, 768, 12, 12, 3072, 50257, 1024, _GPT2_SOURCE),
    "gpt2-medium": Architecture("gpt2", 24, 1024, 16, 16, 4096, 50257, 1024, _GPT2_SOURCE),
    "gpt2-large": Architecture("gpt2", 36, 1280, 20, 20, 5120, 50257, 1024, _GPT2_SOURCE),
    "gpt2-xl": Architecture("gpt2", 48, 1600, 25, 25, 6400, 50257, 1024, _GPT2_SOURCE),
    "llama2-7b": Architecture("llama", 32, 4096, 32, 32, 11008, 32000, 4096, _LLAMA2_SOURCE),
    "llama2-13b": Architecture("llama", 40, 5120, 40, 40, 13824, 32000, 4096, _LLAMA2_SOURCE),
    "llama2-70b": Architecture("llama", 80, 8192, 64, 8, 28672, 32000, 4096, _LLAMA2_SOURCE),
    "llama3-8b": Architecture("llama", 32, 4096, 32, 8, 14336, 128256, 8192, _LLAMA3_SOURCE),
    "llama3-70b": Architecture("llama", 80, 8192, 64, 8, 28672, 128256, 8192, _LLAMA3_SOURCE),
    # a single ReLU MLP, learned positions, biases, dropout 0.1
    "opt-1.3b": Architecture("custom", 24, 2048, 32, 32, 8192, 50272, 2048, _OPT_SOURCE,
                             dropout=True, tied=True, norm="layernorm", activation="relu",
                             position="learned", biases=True, extra_positions=2),
    # multi-query attention, attention and MLP in parallel, GeLU, no biases
    "falcon-7b": Architecture("custom", 32, 4544, 71, 1, 18176, 65024, 2048, _FALCON_SOURCE,
                              tied=True, norm="layernorm", activation="gelu",
                              position="rotary", biases=False, parallel_block=True,
                              fused_qkv=True),
}


def architecture_params(arch: Architecture) -> ParamShapes:
    """Every trainable parameter in ``model.parameters()`` order, named and shaped as Hugging
    Face's GPT2LMHeadModel (family gpt2: Conv1D weights stored (in, out); the tied LM head is not
    listed again) or LlamaForCausalLM (the others: Linear weights (out, in)), with the biases,
    norm weights and position table the architecture's features give it."""
    h, f, v = arch.hidden, arch.ffn, arch.vocab
    q, kv = arch.q_dim, arch.kv_dim
    biased, layernorm = bool(arch.biases), arch.norm == "layernorm"
    conv1d = arch.family == "gpt2"  # GPT-2's Conv1D stores a weight (in, out)
    up = 2 * f if arch.gated_mlp else f
    out: list[tuple[str, tuple[int, ...]]] = []

    def norm(name: str) -> None:
        out.append((name + ".weight", (h,)))
        if layernorm:
            out.append((name + ".bias", (h,)))

    def linear(name: str, n_in: int, n_out: int) -> None:
        out.append((name + ".weight", (n_in, n_out) if conv1d else (n_out, n_in)))
        if biased:
            out.append((name + ".bias", (n_out,)))

    if conv1d:
        out.append(("transformer.wte.weight", (v, h)))
        if arch.position == "learned":
            out.append(("transformer.wpe.weight", (arch.context + arch.extra_positions, h)))
        for i in range(arch.layers):
            p = f"transformer.h.{i}."
            norm(p + "ln_1")
            linear(p + "attn.c_attn", h, q + 2 * kv)
            linear(p + "attn.c_proj", q, h)
            if not arch.parallel_block:
                norm(p + "ln_2")
            linear(p + "mlp.c_fc", h, up)
            linear(p + "mlp.c_proj", f, h)
        norm("transformer.ln_f")
    else:
        out.append(("model.embed_tokens.weight", (v, h)))
        if arch.position == "learned":
            out.append(("model.embed_positions.weight",
                        (arch.context + arch.extra_positions, h)))
        for i in range(arch.layers):
            p = f"model.layers.{i}."
            projections = [("qkv_proj", h, q + 2 * kv)] if arch.fused_qkv else \
                [("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv)]
            for name, n_in, n_out in (*projections, ("o_proj", q, h)):
                linear(p + "self_attn." + name, n_in, n_out)
            if arch.gated_mlp and arch.fused_gate_up:
                linear(p + "mlp.gate_up_proj", h, 2 * f)
            else:
                if arch.gated_mlp:
                    linear(p + "mlp.gate_proj", h, f)
                linear(p + "mlp.up_proj", h, f)
            linear(p + "mlp.down_proj", f, h)
            norm(p + "input_layernorm")
            if not arch.parallel_block:
                norm(p + "post_attention_layernorm")
        norm("model.norm")
    if not arch.tied_embeddings:
        out.append(("lm_head.weight", (v, h)))
    return tuple(out)


def forward_flops(arch: Architecture, seq_len: int) -> int:
    """Matmul FLOPs of one sample's forward pass, counting 2·m·n·k per (m×k)·(k×n) product.

    With s = seq_len, h = hidden, q = heads x head_dim (h unless head_dim says otherwise),
    g·d = kv_dim, f = ffn, V = vocab, per layer:
      Q and output projections    2·(2·s·h·q)
      K and V projections         2·(2·s·h·g·d)
      scores Q·Kᵀ, per head       2·s·s·d, times heads -> 2·s²·q (each query head scores
                                  against its group's K; GQA shares K, not the work)
      context softmax·V           2·s²·q likewise
      MLP                         2·(2·s·h·f) for one activation (up, down); 3·(2·s·h·f) gated
    plus the LM head 2·s·h·V. The causal mask does not shrink a dense matmul, so the full s²
    is counted. For GPT-2 (f = 4h, g·d = h) a layer is 24·s·h² + 4·s²·h, the usual figure.
    Elementwise work (norms, softmax, activations, rotary) is not counted, as
    ``torch.utils.flop_counter`` does not count it either.
    """
    s, h, f, q = seq_len, arch.hidden, arch.ffn, arch.q_dim
    attention = 2 * s * h * q * 2 + 2 * s * h * arch.kv_dim * 2 + 2 * s * s * q * 2
    mlp = (3 if arch.gated_mlp else 2) * 2 * s * h * f
    return arch.layers * (attention + mlp) + 2 * s * h * arch.vocab


def layer_activation_bytes(arch: Architecture, seq_len: int, *, tp: int = 1,
                           mask_bytes: int = 1, maps: bool = True,
                           sequence_parallel: bool = False) -> float:
    """Bytes one layer saves for backward, per sample, 16-bit activations, no recompute.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
    (arXiv:2205.05198, Sec. 4): a GPT layer keeps s·b·h·(34 + 5·a·s/h) bytes, and with
    t-way tensor parallelism (no sequence parallelism) s·b·h·(10 + 24/t + 5·a·s/(h·t)). The
    same accounting, per token, written out so that it also covers Llama's layer:
      kept whole on every tensor rank: each norm's input 2h (one norm in a parallel block),
      the attention and MLP inputs 2h each (one shared input in a parallel block), the two
      dropout masks 2h (1 byte each, with dropout);
      split by t: Q 2q, K and V 2·g·d each, the output projection's input 2q, and the MLP:
      a single activation's input and output 2f each (16h at f = 4h), or a gated one's gate
      output, activated gate, up output and their product 2f each;
      attention maps, per head and split by t: softmax output 2s, plus (with dropout) its
      dropout mask s and dropout output 2s: 5·a·s, or 2·a·s without dropout.
    Grouped-query attention keeps one K/V per group; with more tensor ranks than KV heads each
    rank keeps at least one head. Flash attention keeps no maps at all, nor does selective
    recompute (it recomputes them): ``maps`` False. With ``sequence_parallel`` the part kept
    whole is split over the tensor ranks too (34/t of the paper's Sec. 4.2.2).
    """
    s, h, f, t = seq_len, arch.hidden, arch.ffn, tp
    inputs = 2 if arch.parallel_block else 4  # norm inputs and the attention/MLP inputs
    whole = (inputs * 2 * h + (2 * h * mask_bytes if arch.dropout else 0)) / \
        (t if sequence_parallel else 1)
    kv_per_rank = max(arch.kv_heads / t, 1.0) * arch.head_dim
    split = 4 * arch.q_dim / t + 4 * kv_per_rank + (8 if arch.gated_mlp else 4) * f / t
    kept_maps = arch.heads * s * ((4 + mask_bytes) if arch.dropout else 2) / t if maps else 0.0
    return s * (whole + split + kept_maps)


def outside_activation_bytes(arch: Architecture, seq_len: int, *, tp: int = 1) -> float:
    """Saved bytes outside the layers, per sample: the embedding dropout mask (with dropout),
    the final norm's input 2sh, the LM head's input 2sh and the logits the loss keeps in fp32,
    4·s·V/t (vocab-parallel with t tensor ranks)."""
    s, h = seq_len, arch.hidden
    return s * (h if arch.dropout else 0) + 4 * s * h + 4 * s * arch.vocab / tp
