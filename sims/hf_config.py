"""A Hugging Face ``config.json`` read into an ``Architecture``: the sizes under each model
type's own key names, and the features (norm, activation, positions, biases, parallel block,
tied head) its modeling code fixes without saying so in the config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sims.architecture import Architecture


@dataclass(frozen=True)
class _Type:
    """What a model type's modeling code does: a gated MLP, its norm, its positions, biases
    on its linears, attention and MLP in parallel, whether the head is tied when the config
    does not say, and whose parameter names it has."""

    gated: bool
    norm: str
    position: str
    biases: bool
    parallel: bool = False
    tied: bool = False
    family: str = "custom"
    # rows a learned position table has beyond the maximum positions (OPT's offset of 2)
    extra_positions: int = 0
    # what the modeling code has that an Architecture does not price (a note in the report)
    unpriced: str = ""
    # Q, K and V as one linear; a gated MLP's gate and up as one
    fused_qkv: bool = False
    fused_gate_up: bool = False


_LLAMA = _Type(gated=True, norm="rmsnorm", position="rotary", biases=False)
# the modeling code of each model type in transformers (models/<type>/modeling_<type>.py)
HF_TYPES: dict[str, _Type] = {
    "phi3": _Type(gated=True, norm="rmsnorm", position="rotary", biases=False, fused_qkv=True,
                  fused_gate_up=True),
    **{t: _LLAMA for t in ("llama", "mistral", "granite", "internlm2", "yi",
                           "deepseek", "smollm3", "ministral", "exaone", "hunyuan_v1_dense",
                           "seed_oss", "apertus", "arcee")},
    "qwen2": _Type(gated=True, norm="rmsnorm", position="rotary", biases=False,
                   unpriced="biases on Q, K and V (its other linears have none)"),
    "qwen3": _Type(gated=True, norm="rmsnorm", position="rotary", biases=False,
                   unpriced="RMSNorms over each head's Q and K"),
    "olmo2": _Type(gated=True, norm="rmsnorm", position="rotary", biases=False,
                   unpriced="RMSNorms over Q and K"),
    "olmo": _Type(gated=True, norm="layernorm", position="rotary", biases=False),
    "gemma": _Type(gated=True, norm="rmsnorm", position="rotary", biases=False, tied=True),
    "gemma2": _Type(gated=True, norm="rmsnorm", position="rotary", biases=False, tied=True),
    "gemma3_text": _Type(gated=True, norm="rmsnorm", position="rotary", biases=False,
                         tied=True),
    "cohere": _Type(gated=True, norm="layernorm", position="rotary", biases=False,
                    parallel=True, tied=True),
    "stablelm": _Type(gated=True, norm="layernorm", position="rotary", biases=False),
    "starcoder2": _Type(gated=False, norm="layernorm", position="rotary", biases=True,
                        tied=True),
    "nemotron": _Type(gated=False, norm="layernorm", position="rotary", biases=False),
    "gpt2": _Type(gated=False, norm="layernorm", position="learned", biases=True, tied=True,
                  family="gpt2", fused_qkv=True),
    "gpt_bigcode": _Type(gated=False, norm="layernorm", position="learned", biases=True,
                         tied=True, family="gpt2", fused_qkv=True),
    # GPT-NeoX adds attention and MLP into one residual, each behind a norm of its own: the
    # parameters and the norms of a sequential block
    "gpt_neox": _Type(gated=False, norm="layernorm", position="rotary", biases=True,
                      unpriced="attention and MLP added into one residual", fused_qkv=True),
    "gptj": _Type(gated=False, norm="layernorm", position="rotary", biases=True,
                  parallel=True, unpriced="no biases on Q, K, V and the output projection; "
                                          "a bias on the LM head"),
    "falcon": _Type(gated=False, norm="layernorm", position="rotary", biases=False,
                    parallel=True, tied=True, fused_qkv=True),
    "opt": _Type(gated=False, norm="layernorm", position="learned", biases=True, tied=True,
                 extra_positions=2),
    "bloom": _Type(gated=False, norm="layernorm", position="alibi", biases=True, tied=True,
                   fused_qkv=True),
    "mpt": _Type(gated=False, norm="layernorm", position="learned", biases=True, tied=True,
                 fused_qkv=True),
    "phi": _Type(gated=False, norm="layernorm", position="rotary", biases=True,
                 parallel=True, unpriced="a bias on the LM head"),
}

_KEYS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model", "n_embed"),
    "heads": ("num_attention_heads", "n_head", "n_heads", "num_heads"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "kv_n_heads"),
    "ffn": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
    "vocab": ("vocab_size", "padded_vocab_size"),
    "context": ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx"),
    "activation": ("hidden_act", "activation_function", "ffn_act_fn"),
}
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu",
                "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu", "gelu_python": "gelu",
                "quick_gelu": "gelu", "relu": "relu", "relu2": "squared-relu"}


def _get(data: dict[str, Any], what: str) -> Any:
    for key in _KEYS[what]:
        for section in (data, data.get("attn_config") or {}, data.get("ffn_config") or {}):
            if isinstance(section, dict) and section.get(key) is not None:
                return section[key]
    return None


def architecture_from_hf(data: dict[str, Any], where: str, seq_len: int | None = None
                         ) -> tuple[Architecture, list[str], int]:
    """The Architecture of a Hugging Face config, notes on what was inferred and the
    sequence length the config allows; a mixture of experts, a missing size or an unknown
    activation raises ValueError naming it. ``seq_len`` (the training length) stands in for
    the positions a config does not state."""
    kind = str(data.get("model_type") or "")
    experts = [k for k in _MOE_KEYS if isinstance(data.get(k), int) and data[k] > 1]
    if experts or "moe" in kind:
        raise ValueError(f"{where}: model_type {kind!r} is a mixture of experts "
                         f"({', '.join(f'{k} {data[k]}' for k in experts) or 'by its type'}); "
                         f"experts are not priced yet: give a dense model")
    sizes = {what: _get(data, what) for what in ("layers", "hidden", "heads", "vocab")}
    missing = [what for what, value in sizes.items() if not isinstance(value, int)]
    if missing:
        names = "; ".join(f"{what} ({' or '.join(_KEYS[what])})" for what in missing)
        raise ValueError(f"{where}: the config has no {names}")
    known = HF_TYPES.get(kind)
    notes = []
    if known is None:
        known = _infer_type(data)
        notes.append(f"model_type {kind!r} is not one flowtrain knows; features read from "
                     f"its keys: {'gated' if known.gated else 'single'} MLP, {known.norm}, "
                     f"{known.position} positions, biases {known.biases}")
    hidden, heads = sizes["hidden"], sizes["heads"]
    kv_heads = _get(data, "kv_heads") or (1 if data.get("multi_query") else heads)
    ffn = _get(data, "ffn")
    if ffn is None and isinstance(data.get("expansion_ratio"), (int, float)):
        ffn = int(data["expansion_ratio"] * hidden)
    if ffn is None:
        if known.gated:
            raise ValueError(f"{where}: the config has no intermediate_size for its gated MLP")
        ffn = 4 * hidden
    act_name = str(_get(data, "activation") or ("silu" if known.gated else "gelu"))
    act = _ACTIVATIONS.get(act_name)
    if act is None:
        raise ValueError(f"{where}: activation {act_name!r} is not known; known: "
                         f"{', '.join(sorted(_ACTIVATIONS))}")
    activation = ("swiglu" if act == "silu" else "geglu") if known.gated else act
    position = known.position
    if data.get("alibi") or (data.get("attn_config") or {}).get("alibi"):
        position = "alibi"
    biases = known.biases
    for key in ("bias", "use_bias", "enable_bias", "attention_bias", "add_bias_linear"):
        if isinstance(data.get(key), bool):
            biases = data[key]
            break
    if isinstance(data.get("no_bias"), bool):
        biases = not data["no_bias"]
    parallel = known.parallel
    for key in ("parallel_attn", "parallel_residual"):
        if isinstance(data.get(key), bool):
            parallel = data[key]
            break
    if data.get("new_decoder_architecture"):
        parallel = False  # Falcon 40B/180B: a norm for attention and one for the MLP
    if known.unpriced:
        notes.append(f"{kind}'s {known.unpriced}: not priced")
    tied = data.get("tie_word_embeddings")
    head_dim = data.get("head_dim")
    if not isinstance(head_dim, int) or head_dim * heads == hidden:
        head_dim = None
    dropout = any(isinstance(data.get(k), (int, float)) and data[k] > 0
                  for k in ("resid_pdrop", "hidden_dropout", "hidden_dropout_prob",
                            "attention_dropout", "attn_pdrop", "embd_pdrop", "dropout"))
    positions = _get(data, "context") or seq_len
    if positions is None:
        raise ValueError(f"{where}: the config states no maximum positions "
                         f"({' or '.join(_KEYS['context'])}); give --seq-len")
    extra = known.extra_positions if position == "learned" else 0
    source = f"Hugging Face config {where} (model_type {kind or 'unset'})"
    arch = Architecture(known.family, sizes["layers"], hidden, heads, int(kv_heads), int(ffn),
                        sizes["vocab"], int(positions), source=source, dropout=dropout,
                        tied=known.tied if tied is None else bool(tied),
                        norm=known.norm, activation=activation, position=position,
                        biases=biases, head_size=head_dim, parallel_block=parallel,
                        extra_positions=extra, fused_qkv=known.fused_qkv,
                        fused_gate_up=known.fused_gate_up)
    return arch, notes, int(positions)


def _infer_type(data: dict[str, Any]) -> _Type:
    """An unknown model type's features from its keys: an RMSNorm epsilon, a rope setting, a
    SiLU activation (gated, as the models that use it are)."""
    norm = "rmsnorm" if "rms_norm_eps" in data else "layernorm"
    act = str(_get(data, "activation") or "")
    rotary = any(k in data for k in ("rope_theta", "rotary_emb_base", "rope_scaling",
                                     "rotary_pct", "partial_rotary_factor"))
    return _Type(gated=act in ("silu", "swish"), norm=norm,
                 position="rotary" if rotary else "learned", biases=norm == "layernorm")
