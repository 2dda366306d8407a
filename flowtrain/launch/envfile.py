"""``.flowtrain_env`` files (like DeepSpeed's ``.deepspeed_env``) and the variables sent to
remote nodes."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from flowtrain import env as fenv
from flowtrain.launch.hostfile import LaunchInputError

ENV_FILE_NAME = ".flowtrain_env"
# Prefixes of the launcher's variables that a multi-host job carries to every host, as DeepSpeed
# does.
EXPORT_PREFIXES = ("NCCL_", "FLOWTRAIN_", "PYTHON")
# Never put the secret on a command line (it travels on the node launcher's stdin instead), and
# never override what each node launcher sets for its own ranks.
_NEVER_EXPORT = {fenv.JOB_SECRET, fenv.CONTROL_ENDPOINT, fenv.ERROR_FILE, fenv.RUN_DIR, fenv.JOB_ID,
                 fenv.LAUNCHED}
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_env_file(text: str, source: str = ENV_FILE_NAME) -> dict[str, str]:
    """Parses ``KEY=VALUE`` lines; ``#`` comments, blank lines and an ``export`` prefix are
    allowed."""
    result: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not _KEY.match(key):
            raise LaunchInputError(
                f"env file {source} line {lineno}: expected KEY=VALUE, got {raw.strip()!r}"
            )
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        result[key] = value
    return result


def load_env_files(cwd: str | os.PathLike[str],
                   home: str | os.PathLike[str] | None) -> dict[str, str]:
    """Variables from ``$HOME/.flowtrain_env`` then ``./.flowtrain_env``; the cwd's file wins."""
    merged: dict[str, str] = {}
    paths = []
    if home:
        paths.append(Path(home) / ENV_FILE_NAME)
    paths.append(Path(cwd) / ENV_FILE_NAME)
    seen: set[Path] = set()
    for path in paths:
        resolved = path.resolve()
        if resolved in seen or not path.is_file():
            continue
        seen.add(resolved)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise LaunchInputError(f"cannot read env file {str(path)!r}: {exc}") from None
        merged.update(parse_env_file(text, str(path)))
    return merged


def remote_exports(environ: Mapping[str, str], file_vars: Mapping[str, str]) -> dict[str, str]:
    """What a multi-host launch sets on every host: NCCL_*/FLOWTRAIN_*/PYTHON* plus the env
    files."""
    out = {k: v for k, v in environ.items()
           if k.startswith(EXPORT_PREFIXES) and k not in _NEVER_EXPORT}
    out.update(file_vars)
    for key in _NEVER_EXPORT:
        out.pop(key, None)
    return out
