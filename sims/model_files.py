"""``--model`` given as a file: an architecture file (flowtrain's JSON of a transformer's shape
and features) or a Hugging Face ``config.json`` (or a directory holding one), each read into the
``Architecture`` that presets are made of, so every way a model arrives is priced alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError

from sims.architecture import GATED, Architecture


class ArchitectureFile(BaseModel):
    """An architecture file: the shape of a decoder-only transformer and its features. Every
    feature left out takes its family's default ("custom": Llama's)."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, description="what reports call the model")
    family: Literal["gpt2", "llama", "custom"] = Field(
        default="custom", description="default features and parameter names")
    layers: PositiveInt
    hidden: PositiveInt
    heads: PositiveInt
    kv_heads: PositiveInt | None = Field(default=None, description="default: heads")
    ffn: PositiveInt | None = Field(default=None, description="MLP width; default 4 x hidden "
                                                              "for a single activation")
    vocab: PositiveInt
    context: PositiveInt | None = Field(default=None, description="positions the model has; "
                                                                  "default: seq_len")
    seq_len: PositiveInt | None = Field(default=None, description="tokens per training sample; "
                                                                  "default: context")
    tied_embeddings: bool | None = None
    activation: Literal["gelu", "relu", "squared-relu", "silu", "swiglu", "geglu"] | None = None
    norm: Literal["layernorm", "rmsnorm"] | None = None
    position: Literal["learned", "rotary", "alibi", "none"] | None = None
    biases: bool | None = None
    dropout: bool | None = None
    head_dim: PositiveInt | None = None
    parallel_block: bool = False
    extra_positions: int = Field(default=0, ge=0, description="position-table rows beyond "
                                                               "context (OPT's offset of 2)")
    fused_qkv: bool | None = Field(default=None, description="Q, K and V as one linear "
                                                             "(default: the family's)")
    fused_gate_up: bool = Field(default=False, description="a gated MLP's gate and up as "
                                                           "one linear")
    source: str = ""


class ModelFileError(ValueError):
    """A model file that cannot be read: names the file, the key and what would be right."""


def is_model_file(name: str) -> bool:
    """Whether ``--model`` names a file or directory rather than a preset or a factory."""
    return name.endswith(".json") or Path(name).is_dir() or Path(name).is_file()


def read_model_file(name: str, seq_len: int | None = None
                    ) -> tuple[Architecture, int, str, list[str]]:
    """(the architecture, the training sequence length, the model's name, notes on what was
    assumed) of an architecture file or a Hugging Face config (a file, or a directory holding
    ``config.json``). The length is ``seq_len`` where given, else the file's ``seq_len``, else
    the positions the model has."""
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ModelFileError(f"--model {name!r} is a directory without a config.json; give "
                                 f"a Hugging Face config.json or an architecture file")
    data = read_json_object(path, "--model", ModelFileError)
    if is_hf_config(data):
        from sims.hf_config import architecture_from_hf

        try:
            arch, notes, positions = architecture_from_hf(data, str(path), seq_len)
        except ValueError as exc:
            raise ModelFileError(f"--model: {exc}") from None
        if seq_len is None:
            notes.append(f"sequence length {positions}: the config's maximum positions "
                         f"(give --seq-len for the length you train at)")
        return arch, seq_len or positions, _hf_name(data, path), notes
    arch, stated = architecture_from_file(data, str(path))
    return arch, seq_len or stated or arch.context, str(data.get("name") or path.stem), []


def read_json_object(path: Path, flag: str, error: type[ValueError]) -> dict[str, Any]:
    """The JSON object in ``path``; an unreadable file, bad JSON or another value raises
    ``error`` naming ``flag``, the file and what is wrong."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise error(f"{flag}: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{flag}: {str(path)!r} is not valid JSON (line {exc.lineno} column "
                    f"{exc.colno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise error(f"{flag}: {str(path)!r} must hold a JSON object, got "
                    f"{type(data).__name__}")
    return data


def is_hf_config(data: dict[str, Any]) -> bool:
    return "model_type" in data or "architectures" in data


def architecture_from_file(data: dict[str, Any], where: str) -> tuple[Architecture, int | None]:
    """An architecture file's Architecture and its stated training sequence length."""
    from flowtrain.config.explain import explain

    try:
        spec = ArchitectureFile.model_validate(data)
    except ValidationError as exc:
        raise ModelFileError(f"architecture file {where!r}: " +
                             "; ".join(explain(exc, ArchitectureFile))) from None
    activation = spec.activation
    gated = activation in GATED or (activation is None and spec.family != "gpt2")
    if spec.ffn is None and gated:
        raise ModelFileError(f"architecture file {where!r}: ffn is required with a gated "
                             f"activation ({activation or 'swiglu, the family default'}): "
                             f"its width is the model's choice, not 4 x hidden")
    context = spec.context or spec.seq_len
    if context is None:
        raise ModelFileError(f"architecture file {where!r}: give context (the positions the "
                             f"model has) or seq_len (the tokens per training sample)")
    try:
        arch = Architecture(
            spec.family, spec.layers, spec.hidden, spec.heads, spec.kv_heads or spec.heads,
            spec.ffn or 4 * spec.hidden, spec.vocab, context, source=spec.source or where,
            dropout=spec.dropout, tied=spec.tied_embeddings, norm=spec.norm,
            activation=activation, position=spec.position, biases=spec.biases,
            head_size=spec.head_dim, parallel_block=spec.parallel_block,
            extra_positions=spec.extra_positions, fused_qkv=spec.fused_qkv,
            fused_gate_up=spec.fused_gate_up)
    except ValueError as exc:
        raise ModelFileError(f"architecture file {where!r}: {exc}") from None
    return arch, spec.seq_len


def architecture_dict(arch: Architecture, *, name: str = "", seq_len: int | None = None
                      ) -> dict[str, Any]:
    """An architecture file's contents for ``arch`` (what ``architecture_from_file`` reads
    back unchanged)."""
    out: dict[str, Any] = {"name": name or None, "family": arch.family, "layers": arch.layers,
                           "hidden": arch.hidden, "heads": arch.heads,
                           "kv_heads": arch.kv_heads, "ffn": arch.ffn, "vocab": arch.vocab,
                           "context": arch.context, "seq_len": seq_len,
                           "tied_embeddings": arch.tied_embeddings,
                           "activation": arch.activation, "norm": arch.norm,
                           "position": arch.position, "biases": arch.biases,
                           "dropout": arch.dropout, "head_dim": arch.head_size,
                           "parallel_block": arch.parallel_block,
                           "extra_positions": arch.extra_positions or None,
                           "fused_qkv": arch.fused_qkv,
                           "fused_gate_up": arch.fused_gate_up or None,
                           "source": arch.source}
    return {k: v for k, v in out.items() if v is not None and v != ""}


def _hf_name(data: dict[str, Any], path: Path) -> str:
    named = data.get("_name_or_path")
    if isinstance(named, str) and named:
        return named
    return path.parent.name if path.name == "config.json" else path.stem

