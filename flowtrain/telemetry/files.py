"""Telemetry on disk: ``runs/<id>/telemetry.msgpack`` (records concatenated), its writer with a
flush thread, readers that stop at damage and say where, and finding a run directory."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import msgpack

from flowtrain.telemetry.schema import Record, TelemetryError, encode, validate

TELEMETRY_FILE = "telemetry.msgpack"
LIVE_FILE = "telemetry.live.json"  # the running job's PUB endpoint and secret (mode 0600)
FLUSH_INTERVAL = 0.5  # seconds; the contract promises at least one flush a second
READ_CHUNK = 1 << 16
# One record is small; a length header announcing more than this is damage, not data.
MAX_RECORD_BYTES = 16 * 1024 * 1024


class TelemetryDamage(Exception):
    """Raised by ``read_records`` after the last good record when the rest of the file is not
    records: ``offset`` is the byte where the bad part starts, ``records_read`` how many good
    records came before it, ``reason`` what was found there."""

    def __init__(self, offset: int, records_read: int, reason: str) -> None:
        super().__init__(f"telemetry damaged at byte {offset} after {records_read} good "
                         f"records: {reason}")
        self.offset = offset
        self.records_read = records_read
        self.reason = reason


class TelemetryRecorder:
    """Appends records to a telemetry file. ``append`` only queues bytes (it is called on the
    coordinator's event loop, which must not wait on a disk); a thread writes them out every
    ``flush_interval`` seconds and ``close`` writes the rest."""

    def __init__(self, path: str | os.PathLike[str],
                 flush_interval: float = FLUSH_INTERVAL) -> None:
        if not flush_interval > 0:
            raise ValueError(f"flush_interval must be > 0 seconds, got {flush_interval!r}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.flush_interval = flush_interval
        self.records = 0
        self.write_errors = 0
        self._pending: list[bytes] = []
        self._lock = threading.Lock()
        self._file = open(self.path, "ab")  # noqa: SIM115 - closed in close()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._flush_loop, daemon=True,
                                        name="flowtrain-telemetry-recorder")
        self._thread.start()

    def append(self, record: Mapping[str, Any]) -> None:
        """Queues one record (validated: a bad one raises TelemetryError here)."""
        data = encode(record)
        with self._lock:
            self._pending.append(data)
            self.records += 1

    def flush(self) -> None:
        with self._lock:
            chunk, self._pending = b"".join(self._pending), []
        if not chunk or self._file.closed:
            return
        try:
            # Whole records per write: a reader tailing the file sees at most one partial
            # record at its end, which it waits out.
            self._file.write(chunk)
            self._file.flush()
        except OSError:
            self.write_errors += 1  # disk full: telemetry is lost, training goes on

    def _flush_loop(self) -> None:
        while not self._stop.wait(self.flush_interval):
            self.flush()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        self.flush()
        self._file.close()


def read_records(path: str | os.PathLike[str], start: int = 0) -> Iterator[Record]:
    """Yields the records of a telemetry file in order, from byte ``start``. When the file ends
    in the middle of a record, or holds bytes that are not a valid record, it raises
    TelemetryDamage (offset, good records before it, reason) after yielding every good one."""
    path = Path(path)
    size = path.stat().st_size
    unpacker = _unpacker()
    count = 0
    with open(path, "rb") as f:
        f.seek(start)
        offset = start
        while True:
            chunk = f.read(READ_CHUNK)
            if not chunk:
                break
            unpacker.feed(chunk)
            for record, end in _drain(unpacker, start, count):
                yield record
                count += 1
                offset = end
    if offset < size:
        raise TelemetryDamage(offset, count, f"the file ends inside a record ({size - offset} "
                                             f"bytes after the last whole record)")


def load_records(path: str | os.PathLike[str]) -> tuple[list[Record], TelemetryDamage | None]:
    """Every good record of a file, and the damage that ended the read (None for a clean file)."""
    records: list[Record] = []
    try:
        for record in read_records(path):
            records.append(record)
    except TelemetryDamage as damage:
        return records, damage
    return records, None


class TelemetryTail:
    """Reads a telemetry file that is still being written: each ``poll`` returns the whole
    records appended since the last one; a record cut by the writer's flush waits for the next."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.offset = 0  # byte after the last whole record returned
        self.count = 0
        self._unpacker = _unpacker()
        self._read_to = 0

    def poll(self) -> list[Record]:
        """New records; TelemetryDamage if the new bytes are not records."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._read_to)
                data = f.read()
        except FileNotFoundError:
            return []
        self._read_to += len(data)
        self._unpacker.feed(data)
        out = []
        for record, end in _drain(self._unpacker, 0, self.count):
            out.append(record)
            self.count += 1
            self.offset = end
        return out


def _unpacker() -> msgpack.Unpacker:
    return msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=MAX_RECORD_BYTES * 2,
                            max_str_len=MAX_RECORD_BYTES, max_bin_len=MAX_RECORD_BYTES,
                            max_array_len=1_000_000, max_map_len=1_000_000)


def _drain(unpacker: msgpack.Unpacker, origin: int, count: int) -> Iterator[tuple[Record, int]]:
    """(record, file offset after it) for each whole object buffered in ``unpacker``, whose
    first byte was the file's byte ``origin``; ``count`` good records came before."""
    while True:
        before = origin + unpacker.tell()  # tell() counts every byte consumed since creation
        try:
            obj = unpacker.unpack()
        except msgpack.OutOfData:
            return  # an incomplete object stays buffered for the next feed
        except Exception as exc:  # msgpack raises several types for bytes that are not msgpack
            detail = f": {exc}" if str(exc) else ""
            raise TelemetryDamage(before, count, f"bytes that are not msgpack "
                                                 f"({type(exc).__name__}{detail})") from None
        try:
            record = validate(obj)
        except TelemetryError as exc:
            raise TelemetryDamage(before, count, f"not a telemetry record: {exc}") from None
        yield record, origin + unpacker.tell()
        count += 1


def find_run(path: str | os.PathLike[str] | None = None) -> Path:
    """The run directory to read. None: the newest run under ./runs. A run directory (it holds
    job.json or telemetry.msgpack) is returned as it is; a telemetry file gives its directory;
    a directory of runs gives its newest. FileNotFoundError says what was looked for."""
    if path is None:
        base = Path.cwd() / "runs"
        if not base.is_dir():
            raise FileNotFoundError(f"no run directory given and {base} does not exist; pass "
                                    "a run directory such as runs/<job id>")
        return _newest_run(base)
    p = Path(path)
    if p.is_file():
        if p.name.startswith("telemetry") or p.name in ("job.json", "launcher.jsonl"):
            return p.parent
        raise FileNotFoundError(f"{p} is a file but not a run's telemetry.msgpack or job.json; "
                                "pass the run directory (runs/<job id>)")
    if not p.is_dir():
        raise FileNotFoundError(f"run directory {p} does not exist")
    if _is_run(p):
        return p
    return _newest_run(p)


def _is_run(p: Path) -> bool:
    return (p / "job.json").is_file() or (p / TELEMETRY_FILE).is_file()


def _newest_run(base: Path) -> Path:
    runs = [d for d in base.iterdir() if d.is_dir() and _is_run(d)]
    if not runs:
        raise FileNotFoundError(f"{base} holds no run directory (a directory with job.json or "
                                f"{TELEMETRY_FILE})")
    return max(runs, key=_started)


def _started(run: Path) -> tuple[float, str]:
    try:
        started = float(json.loads((run / "job.json").read_text())["start_time"])
    except (OSError, ValueError, KeyError, TypeError):
        started = max((run / name).stat().st_mtime for name in ("job.json", TELEMETRY_FILE)
                      if (run / name).exists())
    return started, run.name


def write_live_endpoint(run_dir: str | os.PathLike[str], endpoint: str, secret: bytes) -> Path:
    """Tells local subscribers (``flowtrain monitor``) where the running job publishes. The
    secret signs control frames, so the file is readable by its owner only."""
    path = Path(run_dir) / LIVE_FILE
    tmp = path.with_name(f".{LIVE_FILE}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"endpoint": endpoint, "secret": secret.hex(), "pid": os.getpid()}, f)
    os.replace(tmp, path)
    return path


def live_endpoint(run_dir: str | os.PathLike[str]) -> tuple[str, bytes] | None:
    """(PUB endpoint, job secret) of a job that is running now; None when it has ended (the
    launcher removes the file) or never published one."""
    path = Path(run_dir) / LIVE_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return str(data["endpoint"]), bytes.fromhex(data["secret"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
