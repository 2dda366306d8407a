"""What each launched rank runs: start the rank runtime, run the script as ``python script.py``
would, and turn its end (success, exception, exit code, abort) into an error file and exit code.

Usage (by the launcher): ``python -m flowtrain.launch.bootstrap [-m] TARGET [ARGS...]``.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import traceback
from types import FrameType
from typing import Any

from flowtrain import env as fenv
from flowtrain.errors import RankAborted, RankFailure, write_error_file

ABORTED_EXIT = 143  # 128 + SIGTERM, what a process killed by SIGTERM would report to a shell


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Only the first SIGTERM becomes an exception; a second one during cleanup must not interrupt
    # the error-file write or the goodbye to the coordinator (SIGKILL follows if cleanup hangs).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise RankAborted("the job is being torn down (SIGTERM)")


def _runtime() -> tuple[Any, Any]:
    """start_rank and shutdown_rank of the rank runtime."""
    from flowtrain.runtime.rank import shutdown_rank, start_rank

    return start_rank, shutdown_rank


def _run_target(argv: list[str]) -> None:
    if argv and argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("flowtrain bootstrap: -m needs a module name")
        module = argv[1]
        sys.argv = [module, *argv[2:]]  # run_module(alter_sys=True) replaces argv[0] with the file
        # `python -m` puts the cwd first on sys.path; `python -m flowtrain.launch.bootstrap` did too.
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


def _fail(rank: int, failure: RankFailure, shutdown: Any) -> None:
    error_file = os.environ.get(fenv.ERROR_FILE)
    if error_file:
        try:
            write_error_file(error_file, failure)
        except OSError as exc:
            print(f"flowtrain: could not write error file {error_file}: {exc}", file=sys.stderr)
    if shutdown is not None:
        try:
            shutdown(failure)
        except Exception as exc:  # the failure itself matters more than a failed goodbye
            print(f"flowtrain: rank {rank} could not report its failure: {exc!r}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m flowtrain.launch.bootstrap [-m] TARGET [ARGS...]", file=sys.stderr)
        return 2
    rank = int(os.environ.get(fenv.RANK, "0") or 0)
    signal.signal(signal.SIGTERM, _on_sigterm)
    shutdown = None
    try:
        try:
            start_rank, shutdown = _runtime()
            start_rank()
            _run_target(args)
        finally:
            sys.stdout.flush()
    except RankAborted:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:
                pass
        return ABORTED_EXIT
    except SystemExit as exc:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        code = exc.code
        if code is None or code == 0:
            if shutdown is not None:
                shutdown()
            return 0
        if not isinstance(code, int):
            print(code, file=sys.stderr)  # what Python does with sys.exit("message")
            message, status = f"SystemExit: {code}", 1
        else:
            message, status = f"exited with code {code} (sys.exit)", code
        failure = RankFailure.from_exception(rank, exc, kind="exit")
        failure.message = message
        _fail(rank, failure, shutdown)
        return status
    except BaseException as exc:  # noqa: BLE001 - every failure of the script must be reported
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        failure = RankFailure.from_exception(rank, exc)
        _fail(rank, failure, shutdown)
        traceback.print_exception(exc, file=sys.stderr)
        sys.stderr.flush()
        return 1
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if shutdown is not None:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
