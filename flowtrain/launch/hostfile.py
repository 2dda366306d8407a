"""DeepSpeed-style hostfiles (``host slots=N``) and the ``--include``/``--exclude`` filters."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from flowtrain.netaddr import is_loopback


class LaunchInputError(ValueError):
    """Bad user input to ``flowtrain launch``; the CLI prints it as one line and exits 2."""


def parse_hostfile(text: str, source: str = "<hostfile>") -> dict[str, int]:
    """Parses ``host slots=N`` lines (``#`` comments and blank lines allowed), in file order."""
    hosts: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots="):
            raise LaunchInputError(
                f"hostfile {source} line {lineno}: expected 'HOST slots=N', got {raw.strip()!r}"
            )
        host, slots_text = parts[0], parts[1][len("slots="):]
        try:
            slots = int(slots_text)
        except ValueError:
            slots = -1
        if slots < 1:
            raise LaunchInputError(
                f"hostfile {source} line {lineno}: slots must be a positive integer, "
                f"got {slots_text!r}"
            )
        if host in hosts:
            raise LaunchInputError(
                f"hostfile {source} line {lineno}: host {host!r} is listed twice "
                f"(first on line {first_line[host]}); list each host once"
            )
        hosts[host] = slots
        first_line[host] = lineno
    if not hosts:
        raise LaunchInputError(f"hostfile {source} lists no hosts; expected lines like "
                               f"'node1 slots=8'")
    return hosts


def read_hostfile(path: str | os.PathLike[str]) -> dict[str, int]:
    """Reads and parses a hostfile; a missing or unreadable file is a LaunchInputError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise LaunchInputError(f"cannot read hostfile {str(path)!r}: "
                               f"{exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise LaunchInputError(f"hostfile {str(path)!r} is not UTF-8 text") from None
    return parse_hostfile(text, str(path))


def parse_filter(spec: str, flag: str) -> dict[str, list[int] | None]:
    """Parses ``NODE[:slot,slot]@NODE...``; None as a value means the whole node."""
    result: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        part = part.strip()
        if not part:
            raise LaunchInputError(f"{flag} {spec!r} has an empty node; expected "
                                   f"NODE[:slot,slot]@NODE")
        host, _, slots_text = part.partition(":")
        if not slots_text:
            result[host] = None
            continue
        slots: list[int] = []
        for item in slots_text.split(","):
            try:
                slot = int(item)
            except ValueError:
                slot = -1
            if slot < 0:
                raise LaunchInputError(
                    f"{flag} {spec!r}: slot {item!r} of {host!r} is not a non-negative integer"
                )
            slots.append(slot)
        result[host] = sorted(set(slots))
    return result


def apply_filters(hosts: dict[str, int], include: str | None,
                  exclude: str | None) -> dict[str, list[int]]:
    """The slots of each host that the job uses, after --include or --exclude (not both)."""
    if include and exclude:
        raise LaunchInputError("--include and --exclude cannot be used together; pick one")
    active = {host: list(range(slots)) for host, slots in hosts.items()}
    spec, flag = (include, "--include") if include else (exclude, "--exclude")
    if not spec:
        return active
    wanted = parse_filter(spec, flag)
    for host, slots in wanted.items():
        if host not in hosts:
            raise LaunchInputError(
                f"{flag} names host {host!r}, which is not in the hostfile "
                f"(hosts: {', '.join(hosts)})"
            )
        for slot in slots or []:
            if slot >= hosts[host]:
                raise LaunchInputError(
                    f"{flag} names slot {slot} of {host!r}, which has only {hosts[host]} slots "
                    f"(0..{hosts[host] - 1})"
                )
    if include:
        chosen = {h: (s if s is not None else active[h]) for h, s in wanted.items()}
        # Keep the hostfile's order so node ranks follow the file.
        return {h: chosen[h] for h in hosts if h in chosen}
    result: dict[str, list[int]] = {}
    for host, slots in active.items():
        if host in wanted:
            removed = wanted[host]
            if removed is None:
                continue
            slots = [s for s in slots if s not in removed]
            if not slots:
                continue
        result[host] = slots
    if not result:
        raise LaunchInputError(f"--exclude {spec!r} leaves no hosts to run on")
    return result


def is_local_host(host: str) -> bool:
    """True for names that mean this machine: localhost, loopback addresses, our hostname."""
    return is_loopback(host) or host in (socket.gethostname(), socket.getfqdn())


