"""Core binding for ``flowtrain launch --bind-cores-to-rank`` (DeepSpeed's
``--bind_cores_to_rank`` and ``--bind_core_list``): each local rank gets its own share of the
host's cores, or of the listed ones, and OMP_NUM_THREADS is the size of its share.

The launcher splits the cores (``split``) and hands each rank its share in ``CORES_ENV``; the
rank pins itself (``pin_from_env``) before it starts any thread of its own or imports torch, so
every thread it starts later (torch's OpenMP pool, the runtime's loop) inherits the mask.
``--no-python`` ranks start through this module (``python -m flowtrain.launch.affinity
TARGET ARGS...``), which pins and then execs the target: no ``preexec_fn`` in the launcher,
whose other threads make a fork-time callback unsafe.
"""

from __future__ import annotations

import os
import sys

from flowtrain.launch.hostfile import LaunchInputError

CORES_ENV = "FLOWTRAIN_BIND_CORES"  # this rank's cores, "0,1,2"; set only when binding


def parse_core_list(text: str, flag: str = "--bind-core-list") -> list[int]:
    """``"0,2-4,7"`` -> [0, 2, 3, 4, 7], in the order given; duplicates and bad syntax refused."""
    cores: list[int] = []
    for part in text.split(","):
        item = part.strip()
        try:
            if "-" in item:
                low_text, high_text = item.split("-", 1)
                low, high = int(low_text), int(high_text)
                if low > high:
                    raise ValueError
                cores += range(low, high + 1)
            else:
                cores.append(int(item))
        except ValueError:
            raise LaunchInputError(
                f"{flag} {text!r}: {item!r} is not a core number or a range like 2-5; expected "
                f"e.g. '0,2-5,8'") from None
    if any(c < 0 for c in cores):
        raise LaunchInputError(f"{flag} {text!r}: core numbers cannot be negative")
    repeated = sorted({c for c in cores if cores.count(c) > 1})
    if repeated:
        raise LaunchInputError(f"{flag} {text!r} names core(s) {format_cores(repeated)} more "
                               f"than once; list each core once")
    return cores


def format_cores(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (in the order given; runs of consecutive numbers folded)."""
    parts: list[str] = []
    i = 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        parts.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(parts)


def available_cores() -> list[int]:
    """The cores this process may run on (its affinity mask: cgroups, taskset), sorted."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API on this platform
        return list(range(os.cpu_count() or 1))


def split(nproc: int, core_list: list[int] | None, available: list[int] | None = None,
          text: str | None = None) -> list[list[int]]:
    """Each local rank's cores: the listed cores (or every core this launcher may use), in
    order, cut into ``nproc`` contiguous shares. When they do not divide evenly the first
    ``len(cores) % nproc`` ranks get one core more, so every core is used. Refuses a list
    naming cores this host does not have (or this process may not use) and fewer cores than
    ranks, naming what was seen (``text``: the list as typed) and what would do."""
    allowed = available_cores() if available is None else available
    if core_list is None:
        cores, source = list(allowed), f"this host's {len(allowed)} usable core(s) " \
            f"({format_cores(allowed)})"
    else:
        missing = [c for c in core_list if c not in set(allowed)]
        if missing:
            total = os.cpu_count() or len(allowed)
            absent = [c for c in missing if c >= total]
            what = (f"core(s) {format_cores(missing)}, which this host does not have"
                    if len(absent) == len(missing) else
                    f"core(s) {format_cores(missing)}, which this launcher may not run on")
            raise LaunchInputError(
                f"--bind-core-list {text or format_cores(core_list)!r} names {what}; the cores "
                f"available here are {format_cores(allowed)} ({len(allowed)} in all)")
        cores, source = list(core_list), f"the {len(core_list)} listed core(s) " \
            f"({format_cores(core_list)})"
    if len(cores) < nproc:
        fix = f"use --nproc-per-node {len(cores)} or fewer"
        if core_list is not None:
            fix += f", or list at least {nproc} of the cores available here " \
                f"({format_cores(allowed)})"
        raise LaunchInputError(
            f"--bind-cores-to-rank needs at least one core per local rank: {nproc} ranks but "
            f"only {source}; {fix}")
    base, extra = divmod(len(cores), nproc)
    shares, start = [], 0
    for rank in range(nproc):
        size = base + (1 if rank < extra else 0)
        shares.append(cores[start:start + size])
        start += size
    return shares


def _all_threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def pin_from_env(environ: dict[str, str] | None = None) -> list[int] | None:
    """Pins this process to the cores in ``CORES_ENV`` (every thread it has so far; threads
    started later inherit the mask); returns them, or None when the variable is not set.
    A failure is an error: a rank asked to be bound must not silently run anywhere."""
    env = os.environ if environ is None else environ
    text = env.get(CORES_ENV, "").strip()
    if not text:
        return None
    cores = parse_core_list(text, CORES_ENV)
    # sched_setaffinity(0) sets the calling thread only: set each one started so far too
    for tid in _all_threads():
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:
            continue  # that thread has ended
        except OSError as exc:
            raise OSError(exc.errno, f"cannot bind this rank to cores {text} ({CORES_ENV}): "
                                     f"{exc.strerror}") from None
    return cores


def main(argv: list[str] | None = None) -> None:
    """``python -m flowtrain.launch.affinity TARGET [ARGS...]``: pin, then exec TARGET."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m flowtrain.launch.affinity TARGET [ARGS...]")
    try:
        pin_from_env()
        os.execvp(args[0], args)
    except (OSError, LaunchInputError) as exc:
        print(f"flowtrain: {args[0]}: {exc}", file=sys.stderr)
        raise SystemExit(127) from None


if __name__ == "__main__":
    main()
