"""A checkpoint's manifest: the size and SHA-256 of every file in it, written inside the staging
directory before it is published, and checked before anything is read back. A flipped bit, a
truncated or deleted file (a rank's random generator state, a tensor shard) is then an error that
names the file instead of a silent change of the loaded values.

The manifest guards against damage, not against someone who can write the checkpoint (who can
rewrite the manifest too); untrusted code is kept out by reading every ``.pt`` file with
``torch.load(weights_only=True)`` (see ``atomic.read_file``)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or read as it is; the message names the file."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def listed_files(directory: Path) -> list[str]:
    """Every file under ``directory`` (the manifest itself excepted), as sorted relative paths."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: Path, known: dict[str, tuple[int, str]] | None = None) -> None:
    """Hashes every file of the (staging) directory into its manifest, fsynced. ``known``:
    (size, SHA-256) of files hashed from the bytes their writer wrote (name relative to
    ``directory``), taken as they are where the file still has that size; every other file is
    read and hashed here."""
    known = known or {}
    files = {}
    for name in listed_files(directory):
        size = (directory / name).stat().st_size
        digest = known.get(name)
        files[name] = {"size": size, "sha256": digest[1] if digest is not None and
                       digest[0] == size else sha256_of(directory / name)}
    path = directory / MANIFEST
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: Path) -> dict[str, dict[str, Any]] | None:
    """The manifest's files (name -> size, sha256), or None for a checkpoint written before
    manifests existed."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        files = data["files"]
        if not isinstance(files, dict) or not all(
                isinstance(v, dict) and isinstance(v.get("size"), int)
                and isinstance(v.get("sha256"), str) for v in files.values()):
            raise TypeError("'files' is not a map of name -> {size, sha256}")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint manifest {path} is damaged ({exc}); the checkpoint "
                              f"cannot be verified") from None
    return files


def check_files(directory: Path, files: dict[str, dict[str, Any]], names: list[str]) -> list[str]:
    """A problem line for each of ``names`` (from ``files``) that is missing, or whose size or
    checksum differs from the manifest's."""
    problems = []
    for name in names:
        path = directory / name
        want = files[name]
        if not path.is_file():
            problems.append(f"{path} is missing (the manifest lists it)")
            continue
        size = path.stat().st_size
        if size != want["size"]:
            problems.append(f"{path} is {size} bytes, the manifest says {want['size']} "
                            f"(truncated or overwritten)")
        elif sha256_of(path) != want["sha256"]:
            problems.append(f"{path} does not match its SHA-256 checksum in the manifest "
                            f"(the file is damaged)")
    return problems


def verify_part(directory: Path, rank: int, world: int) -> list[str] | None:
    """Checks this rank's share (every ``world``-th file from ``rank``) of the manifest's files;
    returns the problems found, or None when the checkpoint has no manifest."""
    files = read_manifest(directory)
    if files is None:
        return None
    names = sorted(files)
    return check_files(directory, files, names[rank::world])


def raise_problems(directory: Path, problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"checkpoint {directory} is damaged: {problems[0]}{more}")
