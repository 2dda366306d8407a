"""Strict value checks for config fields, the base section model, and the config's error types.
Each check's error says what was expected and what was seen, so messages need no pydantic jargon."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Annotated, Any, NoReturn

from pydantic import BaseModel, BeforeValidator, ConfigDict
from pydantic_core import PydanticCustomError

from flowtrain.errors import FlowtrainError

AUTO = "auto"


class ConfigError(FlowtrainError, ValueError):
    """A DeepSpeed/flowtrain config that cannot be used; ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = list(problems)
        self.source = source
        count = len(self.problems)
        head = f"{source}: {count} problem{'s' if count != 1 else ''}"
        super().__init__(head + "".join(f"\n  - {p}" for p in self.problems))


class ConfigWarning(FutureWarning):
    """A config that works but uses a deprecated spelling. A FutureWarning subclass so that it is
    shown by default (DeprecationWarning is hidden outside ``__main__``)."""


def show(value: Any) -> str:
    """Writes a value as it appears in JSON, so messages quote what the user typed."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _fail(expected: str, value: Any) -> NoReturn:
    got = show(value)
    if value == AUTO:
        # "auto" left over after resolution: this key has no rule that could fill it in.
        got += " (flowtrain has no rule to resolve 'auto' here; set a value)"
    raise PydanticCustomError("flowtrain", "expected {expected}, got {got}",
                              {"expected": expected, "got": got})


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"  # integers exactly, not as 2.14748e+09


def _bounds(kind: str, ge: float | None, le: float | None, gt: float | None) -> str:
    if ge is not None and le is not None:
        return f"{kind} from {_num(ge)} to {_num(le)}"
    if gt is not None:
        return f"{kind} > {gt:g}"
    if ge == 1 and kind == "an integer":
        return "an integer > 0"
    if ge is not None:
        return f"{kind} >= {ge:g}"
    if le is not None:
        return f"{kind} <= {le:g}"
    return kind


def _validator(desc: str, check: Callable[[Any], Any], optional: bool) -> BeforeValidator:
    def run(value: Any) -> Any:
        if value is None and optional:
            return None
        return check(value)
    return BeforeValidator(run)


# Int, Float, Str and Choice build the validator that goes into a field's annotation next to the
# type it checks, ``Annotated[int, Int(ge=1)]``, so that a type checker reads a plain ``int``.
# ``optional=True`` goes with a ``X | None`` type: null passes, and without it null is an error in
# flowtrain's words rather than pydantic's.


def Int(*, ge: int | None = None, le: int | None = None,
        optional: bool = False) -> BeforeValidator:
    """An integer; integral floats such as 5e8 are accepted because DeepSpeed configs use them."""
    desc = _bounds("an integer", ge, le, None)

    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(desc, value)
        given = value  # shown as written: int(1e308) has 309 digits
        if isinstance(value, float):
            if not value.is_integer():
                _fail(desc, value)
            value = int(value)
        if (ge is not None and value < ge) or (le is not None and value > le):
            _fail(desc, given)
        return int(value)

    return _validator(desc, check, optional)


def Float(*, ge: float | None = None, le: float | None = None, gt: float | None = None,
          optional: bool = False) -> BeforeValidator:
    """A finite number (integers are accepted and converted)."""
    desc = _bounds("a number", ge, le, gt)

    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(desc, value)
        value = float(value)
        if not math.isfinite(value):
            _fail(desc, value)
        if ((ge is not None and value < ge) or (le is not None and value > le)
                or (gt is not None and value <= gt)):
            _fail(desc, value)
        return value

    return _validator(desc, check, optional)


def _bool_check(value: Any) -> bool:
    # Only JSON true/false: "false" as a string is truthy in Python and a classic config bug.
    if not isinstance(value, bool):
        _fail("true or false", value)
    return value


Bool = Annotated[bool, BeforeValidator(_bool_check)]


def Str(*, optional: bool = False) -> BeforeValidator:
    desc = "a string"

    def check(value: Any) -> str:
        if not isinstance(value, str):
            _fail(desc, value)
        return value

    return _validator(desc, check, optional)


def Choice(*options: str, aliases: dict[str, str] | None = None,
           optional: bool = False) -> BeforeValidator:
    """One of ``options`` (case-insensitive); returns the canonical spelling."""
    canon = {o.lower(): o for o in options}
    canon.update({k.lower(): v for k, v in (aliases or {}).items()})
    desc = "one of " + ", ".join(show(o) for o in options) + (" or null" if optional else "")

    def check(value: Any) -> str:
        if not isinstance(value, str) or value.lower() not in canon:
            _fail(desc, value)
        return canon[value.lower()]

    return _validator(desc, check, optional)


def _dict_check(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        _fail("an object ({...})", value)
    return value


Params = Annotated[dict[str, Any], BeforeValidator(_dict_check)]


def _none_as_empty(value: Any) -> Any:
    # DeepSpeed allows `"offload_optimizer": null` to mean "not set".
    return {} if value is None else value


NoneIsDefault = BeforeValidator(_none_as_empty)


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are read-only."""

    model_config = ConfigDict(extra="forbid", frozen=True)
