"""Hugging Face configs of published models (the keys of their config.json that matter) and
factories that build their transformers modules, for the simulator's tests that enter one
architecture four ways ("hf_models:llama3_8b" with this directory importable)."""

from __future__ import annotations

from typing import Any

# meta-llama/Meta-Llama-3-8B
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "attention_bias": False, "attention_dropout": 0.0, "vocab_size": 128256}
# openai-community/gpt2-medium
GPT2_MEDIUM = {
    "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
    "n_ctx": 1024, "n_embd": 1024, "n_head": 16, "n_layer": 24, "n_positions": 1024,
    "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1, "layer_norm_epsilon": 1e-05,
    "vocab_size": 50257}
# facebook/opt-1.3b
OPT_1B3 = {
    "architectures": ["OPTForCausalLM"], "model_type": "opt", "activation_function": "relu",
    "hidden_size": 2048, "ffn_dim": 8192, "num_hidden_layers": 24, "num_attention_heads": 32,
    "vocab_size": 50272, "max_position_embeddings": 2048, "word_embed_proj_dim": 2048,
    "do_layer_norm_before": True, "dropout": 0.1, "attention_dropout": 0.0,
    "enable_bias": True}
# tiiuae/falcon-7b
FALCON_7B = {
    "architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 4544,
    "num_attention_heads": 71, "num_hidden_layers": 32, "vocab_size": 65024,
    "multi_query": True, "parallel_attn": True, "bias": False, "alibi": False,
    "new_decoder_architecture": False, "hidden_dropout": 0.0, "attention_dropout": 0.0}
# a tiny Llama-shaped model with grouped-query attention
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 256, "intermediate_size": 688, "max_position_embeddings": 512,
    "num_attention_heads": 8, "num_hidden_layers": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-05, "tie_word_embeddings": True, "vocab_size": 1000}


def _build(config: dict[str, Any]) -> Any:
    import transformers

    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    made = transformers.AutoConfig.for_model(config["model_type"], **fields)
    return transformers.AutoModelForCausalLM.from_config(made)


def llama3_8b() -> Any:
    return _build(LLAMA3_8B)


def gpt2_medium() -> Any:
    return _build(GPT2_MEDIUM)


def opt_1b3() -> Any:
    return _build(OPT_1B3)


def falcon_7b() -> Any:
    return _build(FALCON_7B)


def tiny_llama() -> Any:
    return _build(TINY_LLAMA)
