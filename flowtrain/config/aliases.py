"""Old and alternative spellings DeepSpeed still accepts, rewritten to the current keys before
validation; deprecated ones warn with ``ConfigWarning``."""

from __future__ import annotations

import warnings
from typing import Any

from flowtrain.config.fields import ConfigWarning


def _warn(message: str) -> None:
    # stacklevel 5 reaches the caller of load_config (normalize <- _load <- load_config).
    warnings.warn(message, ConfigWarning, stacklevel=5)


def _rename(section: dict[str, Any], old: str, new: str, where: str, problems: list[str],
            deprecated: bool) -> None:
    if old not in section:
        return
    if new in section:
        problems.append(f"{where}{old} and {where}{new} are both set; {old} is an old name "
                        f"of {new}: keep only {new}")
        del section[old]  # reported once here, not again as an unknown key
        return
    section[new] = section.pop(old)
    if deprecated:
        _warn(f"{where}{old} is deprecated; it was read as {where}{new}. Rename it in the config.")


def _deprecated_offload(zero: dict[str, Any], flag: str, target: str, pin: Any,
                        problems: list[str]) -> None:
    """``cpu_offload: true`` (and ``cpu_offload_param``) predate the offload_* subsections."""
    if flag not in zero:
        return
    value = zero.pop(flag)
    if not isinstance(value, bool):
        problems.append(f"zero_optimization.{flag}: expected true or false, got {value!r}")
        return
    if value and zero.get(target) is not None:
        problems.append(f"zero_optimization.{flag} (deprecated) and zero_optimization.{target} "
                        f"are both set; keep only {target}")
        return
    if value:
        zero[target] = {"device": "cpu"} if pin is None else {"device": "cpu", "pin_memory": pin}
        _warn(f"zero_optimization.{flag} is deprecated; read as "
              f'zero_optimization.{target} {{"device": "cpu"}}. Use {target} instead.')
    else:
        _warn(f"zero_optimization.{flag} is deprecated and false here, so it was ignored; "
              f"remove it (offloading is set with zero_optimization.{target}).")


def normalize(raw: dict[str, Any], problems: list[str]) -> None:
    """Rewrites aliases in ``raw`` (a private copy) in place; conflicts go to ``problems``."""
    # bfloat16 is a plain alias in DeepSpeed, not deprecated, so it does not warn.
    _rename(raw, "bfloat16", "bf16", "", problems, deprecated=False)
    zero = raw.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    _rename(zero, "stage3_gather_fp16_weights_on_model_save",
            "stage3_gather_16bit_weights_on_model_save", "zero_optimization.", problems,
            deprecated=True)
    pin = zero.pop("cpu_offload_use_pin_memory", None)
    if pin is not None:
        _warn("zero_optimization.cpu_offload_use_pin_memory is deprecated; use pin_memory in "
              "offload_optimizer / offload_param.")
    _deprecated_offload(zero, "cpu_offload", "offload_optimizer", pin, problems)
    _deprecated_offload(zero, "cpu_offload_param", "offload_param", pin, problems)
