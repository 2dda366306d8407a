"""Checkpoints written atomically: every rank writes into a temporary directory, rank 0 renames
it into place once all are done, and the ``latest`` pointer moves last. A crash at any point
leaves the previous checkpoint, and ``latest`` pointing at it.

A checkpoint directory holds ``engine_state.pt`` (rank 0: everything that is not a big tensor),
``rank<R>_states.pt`` per rank (random generators), ``tensors/``, the parameters and
optimizer state as torch.distributed.checkpoint files (see ``save``), and ``manifest.json``,
every other file's size and checksum (see ``manifest``)."""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import socket
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from flowtrain.checkpoint.manifest import CheckpointError, write_manifest
from flowtrain.log import get_logger

log = get_logger("flowtrain.checkpoint")
T = TypeVar("T")

ENGINE_FILE = "engine_state.pt"
TENSOR_DIR = "tensors"
LATEST = "latest"
# What checkpoints before the DCP layout held instead of ENGINE_FILE and TENSOR_DIR.
LEGACY_MODEL_FILE = "mp_rank_00_model_states.pt"
# In a staging directory while it is written: "<host> <pid>" of the saving rank 0, so a later
# save can tell a partial directory left by a dead process from one being written now.
OWNER_FILE = ".owner"


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}_states.pt"


def save_file(obj: Any, path: Path) -> None:
    """torch.save then fsync, so a later rename publishes complete bytes."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _save_unsynced(obj: Any, path: Path) -> None:
    """torch.save without the fsync, which the caller does later (``fsync_file``)."""
    with open(path, "wb") as f:
        torch.save(obj, f)


def fsync_file(path: Path) -> None:
    """Flushes a file's (or a directory's entries') bytes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _numpy_globals() -> list[Any]:
    """What a pickled numpy random generator state (``rank<R>_states.pt``) is made of."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct  # numpy 2
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def read_file(path: Path) -> Any:
    """A checkpoint's ``.pt`` file, loaded without running code from it (weights_only, with the
    numpy types a saved random generator state needs). A damaged or unreadable file is a
    one-line CheckpointError naming it."""
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "weights_only" in str(exc).lower() or "unsupported global" in str(exc).lower():
            raise CheckpointError(f"checkpoint file {path} holds objects that a weights-only "
                                  f"load refuses (only tensors, numbers, strings and "
                                  f"containers of them load): {first}") from None
        raise CheckpointError(f"checkpoint file {path} is damaged or truncated: {first}") \
            from None
    except (OSError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint file {path} is damaged or truncated "
                              f"({type(exc).__name__}: {first})") from None


def _failure(exc: BaseException, root: Path, tag: str) -> CheckpointError:
    """A failed save as one line: what went wrong, where, and that the last good checkpoint is
    kept. DCP wraps a rank's error (the disk-full OSError becomes a torch writer's "unexpected
    pos"), so a full disk is also recognised by the free space left."""
    seen: list[BaseException] = []
    todo: list[Any] = [exc]
    while todo and len(seen) < 50:
        e = todo.pop()
        if isinstance(e, BaseException) and e not in seen:
            seen.append(e)
            todo += [e.__cause__, e.__context__]
            todo += [getattr(f, "exc", f) for f in getattr(e, "failures", {}).values()]
    full = any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in seen)
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    full = full or (free is not None and free < 1 << 20)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    latest = root / LATEST
    try:
        kept = f"{latest.read_text(encoding='utf-8').strip()!r} is still the latest checkpoint"
    except (OSError, UnicodeDecodeError):
        kept = "no earlier checkpoint was touched"
    cause = (f"no space left on device ({free} bytes free)" if full
             else f"{type(exc).__name__}: {first}")
    return CheckpointError(f"saving checkpoint {tag!r} into {root} failed: {cause}; {kept} "
                           f"and the partial directory was removed")


def _remove_stale_partials(root: Path) -> None:
    """Removes the staging directories of saves whose rank 0 died on this host (a crash or a
    kill mid-save); leaves those of live processes, other hosts, and ones without an owner."""
    host = socket.gethostname()
    for staging in root.glob(".*.partial"):
        try:
            owner_host, pid = (staging / OWNER_FILE).read_text(encoding="utf-8").split()
            if owner_host != host:
                continue
            os.kill(int(pid), 0)
            continue  # still running: another job saving into the same directory
        except ProcessLookupError:
            pass
        except (OSError, ValueError):  # no owner file, someone else's process, garbage
            continue
        shutil.rmtree(staging, ignore_errors=True)
        log.info("removed a partial checkpoint left by a save that did not finish",
                 path=str(staging))


def write_latest(save_dir: Path, tag: str) -> None:
    tmp = save_dir / f".{LATEST}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, save_dir / LATEST)
    fsync_file(save_dir)


def validate_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or "/" in tag or tag.startswith(".") or tag == LATEST:
        raise ValueError(f"checkpoint tag must be a plain directory name, got {tag!r}")
    return tag


def save(save_dir: str | os.PathLike[str], tag: str, *, rank: int, shared: dict[str, Any] | None,
         per_rank: dict[str, Any], barrier: Callable[[str], None], save_latest: bool = True,
         write_tensors: Callable[[Path], dict[str, tuple[int, str]] | None] | None = None,
         run_later: Callable[[Callable[[], None]], None] | None = None) -> Path:
    """Writes one checkpoint. ``write_tensors`` (every rank, collectively) writes the tensor
    files into the directory it is given and may return the size and SHA-256 of files it wrote
    (by name in that directory), which the manifest then takes instead of reading them back;
    ``shared`` (rank 0 only) is the engine state;
    ``per_rank`` what differs between ranks (random generators). Every rank calls this.

    With ``run_later`` (an asynchronous save) the small files are written here and
    ``run_later`` is handed the rest: the tensor files, the manifest and the publication
    (rename, then ``latest``), which it runs on another thread."""
    root = Path(save_dir)
    tag = validate_tag(tag)
    staging = root / f".{tag}.partial"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if staging.exists():  # left by a run that crashed mid-save
            shutil.rmtree(staging)
        _remove_stale_partials(root)
        staging.mkdir()
        (staging / OWNER_FILE).write_text(f"{socket.gethostname()} {os.getpid()}",
                                          encoding="utf-8")
    barrier(f"ckpt-{tag}-staged")
    # Written now even when the rest is not: they hold live objects (the scheduler's state,
    # the generators) that training changes from the next step on. Made durable with the rest.
    small = _guarded(root, tag, rank,
                     lambda: _write_small(staging, rank, shared, per_rank, run_later is None))

    def rest() -> None:
        if run_later is not None:
            for path in small:
                _guarded(root, tag, rank, lambda: fsync_file(path))  # noqa: B023 (called now)
        known: dict[str, tuple[int, str]] = {}
        if write_tensors is not None:
            written = _guarded(root, tag, rank, lambda: write_tensors(staging / TENSOR_DIR))
            known = {f"{TENSOR_DIR}/{name}": d for name, d in (written or {}).items()}
        _publish(root, tag, rank, barrier, save_latest, known)

    if run_later is None:
        rest()
    else:
        run_later(rest)
    return root / tag


def _write_small(staging: Path, rank: int, shared: dict[str, Any] | None,
                 per_rank: dict[str, Any], durable: bool) -> list[Path]:
    """This rank's files besides the tensors; returns their paths."""
    write = save_file if durable else _save_unsynced
    paths = [staging / rank_file(rank)]
    write(per_rank, paths[0])
    if rank == 0:
        assert shared is not None
        paths.append(staging / ENGINE_FILE)
        write(shared, paths[1])
    return paths


def _guarded(root: Path, tag: str, rank: int, work: Callable[[], T]) -> T:
    """Runs one part of a save; on failure removes the staging directory (a failed save must
    not leave a half-written directory on a possibly full disk) and raises one clear line."""
    try:
        return work()
    except Exception as exc:
        if rank == 0:
            shutil.rmtree(root / f".{tag}.partial", ignore_errors=True)
        raise _failure(exc, root, tag) from exc


def _publish(root: Path, tag: str, rank: int, barrier: Callable[[str], None],
             save_latest: bool, known: dict[str, tuple[int, str]] | None = None) -> None:
    """Once every rank has written its files: rank 0 writes the manifest (with the ``known``
    digests of files hashed as they were written), renames the staging directory into place,
    then moves ``latest``."""
    staging = root / f".{tag}.partial"
    final = root / tag

    def manifest() -> None:
        barrier(f"ckpt-{tag}-written")
        if rank == 0:
            (staging / OWNER_FILE).unlink()
            write_manifest(staging, known)
            fsync_file(staging)

    _guarded(root, tag, rank, manifest)
    if rank == 0:
        old = root / f".{tag}.replaced"
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(staging, final)
        fsync_file(root)
        if save_latest:
            write_latest(root, tag)
        if old.exists():
            shutil.rmtree(old)
        log.info("checkpoint saved", path=str(final))
    barrier(f"ckpt-{tag}-published")


def resolve(load_dir: str | os.PathLike[str], tag: str | None) -> Path | None:
    """The checkpoint directory to load: ``tag`` or what ``latest`` names; None if there is none."""
    root = Path(load_dir)
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            return None
        try:
            tag = latest.read_text(encoding="utf-8").strip()
            tag = validate_tag(tag)
        except (UnicodeDecodeError, ValueError):
            raise CheckpointError(f"{latest} is damaged: it should hold one checkpoint "
                                  f"directory name as text; pass the tag to load "
                                  f"explicitly") from None
    path = root / validate_tag(tag)
    replaced = root / f".{tag}.replaced"
    if not path.exists() and (replaced / ENGINE_FILE).is_file():
        # A crash while re-saving the same tag, between moving the old copy aside and
        # publishing the new one: the old copy is still whole.
        path = replaced
    if not (path / ENGINE_FILE).is_file():
        if (path / LEGACY_MODEL_FILE).is_file():
            raise ValueError(f"checkpoint {path} was written by an older flowtrain (one "
                             f"{LEGACY_MODEL_FILE}, no {ENGINE_FILE} and {TENSOR_DIR}/); "
                             f"this version reads only the torch.distributed.checkpoint layout")
        raise FileNotFoundError(f"checkpoint {path} is incomplete or missing: no {ENGINE_FILE}")
    return path


def load(path: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The shared state and this rank's state (None when the checkpoint was written by fewer
    ranks than are loading it)."""
    shared = read_file(path / ENGINE_FILE)
    if not isinstance(shared, dict):
        raise CheckpointError(f"checkpoint file {path / ENGINE_FILE} is not an engine state "
                              f"(got {type(shared).__name__})")
    mine = path / rank_file(rank)
    if mine.is_file():
        return shared, read_file(mine)
    if rank < int(shared.get("world_size", 0)):  # this rank wrote one when it was saved
        raise CheckpointError(f"checkpoint file {mine} is missing: the checkpoint was saved "
                              f"by {shared['world_size']} ranks, each writing its own")
    return shared, None
