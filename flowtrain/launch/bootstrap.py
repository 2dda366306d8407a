"""What each launched rank runs: start the rank runtime, run the script as ``python script.py``
would, and turn its end (success, exception, exit code, abort) into an error file and exit code.

Usage (by the launcher): ``python -m flowtrain.launch.bootstrap [-m] TARGET [ARGS...]``.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import traceback
from types import FrameType
from typing import Any

from flowtrain import env as fenv
from flowtrain.errors import RankAborted, RankFailure, write_error_file
from flowtrain.launch.affinity import pin_from_env
from flowtrain.launch.tasks import apply_task_env

ABORTED_EXIT = 143  # 128 + SIGTERM, what a process killed by SIGTERM would report to a shell


_handled = threading.Event()
POKE_INTERVAL = 0.2  # seconds between nudges of a main thread that has not run its handler
POKES = 50


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Only the first SIGTERM becomes an exception; a second one during cleanup must not interrupt
    # the error-file write or the goodbye to the coordinator (SIGKILL follows if cleanup hangs).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _handled.set()
    raise RankAborted("the job is being torn down (SIGTERM)")


def _forward_sigterm(read_fd: int) -> None:
    """The kernel hands a process-wide SIGTERM to any thread that does not block it; when that is
    a torch or event-loop thread, Python only flags it and a main thread asleep in time.sleep()
    or a blocking read never runs the handler. Python's wakeup fd tells us the signal came in,
    and a thread-directed SIGTERM wakes the main thread so the handler runs."""
    main_id = threading.main_thread().ident
    assert main_id is not None
    while not _handled.is_set():
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGTERM not in data:
            continue
        for _ in range(POKES):
            if _handled.is_set():
                return
            try:
                signal.pthread_kill(main_id, signal.SIGTERM)
            except (ProcessLookupError, OSError):
                return
            if _handled.wait(POKE_INTERVAL):
                return


def _install_sigterm_handler() -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_forward_sigterm, args=(read_fd,), daemon=True,
                     name="flowtrain-sigterm-forward").start()


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
        # `python -m` puts the cwd first on sys.path; `python -m flowtrain.launch.bootstrap`
        # did too.
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


def _trim(exc: BaseException) -> BaseException:
    """Drops this module's and runpy's frames so the traceback starts in the user's script."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and (
            tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
            or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    return exc.with_traceback(tb)


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


def _install_join_hook() -> None:
    """A replacement rank (launch --peer-recovery) joins the survivors' group when the script
    initialises torch.distributed, after the slow part of its start."""
    from flowtrain import comm, peer_recovery

    if peer_recovery.joining():
        from flowtrain.launch.warmup import prepare

        comm.join_hook = lambda: peer_recovery.join_distributed(prepare)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m flowtrain.launch.bootstrap [-m] TARGET [ARGS...]", file=sys.stderr)
        return 2
    # the tasks of --launcher slurm|openmpi|...: the rank from that launcher's variables
    apply_task_env()
    rank = int(os.environ.get(fenv.RANK, "0") or 0)
    pin_error = None
    try:
        # first, before this process starts threads: those started later inherit the mask
        pin_from_env()
    except (OSError, ValueError) as exc:
        pin_error = exc
    _install_sigterm_handler()
    shutdown = None
    try:
        try:
            if pin_error is not None:
                raise pin_error
            start_rank, shutdown = _runtime()
            start_rank()
            _install_join_hook()
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
        failure = RankFailure.from_exception(rank, _trim(exc), kind="exit")
        failure.message = message
        _fail(rank, failure, shutdown)
        return status
    except BaseException as exc:  # noqa: BLE001 - every failure of the script must be reported
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        failure = RankFailure.from_exception(rank, _trim(exc))
        _fail(rank, failure, shutdown)
        traceback.print_exception(exc, file=sys.stderr)
        sys.stderr.flush()
        return 1
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if shutdown is not None:
        shutdown()
    return 0


# Threads of this module's and the rank's that never run inside torch: harmless at finalization.
SAFE_THREADS = frozenset({"flowtrain-sigterm-forward", "flowtrain-abort-watchdog"})


def lingering_threads() -> list[str]:
    """What could still return from torch while the interpreter finalizes: live threads other
    than the main one and SAFE_THREADS, and the collectives flowtrain still waits on (their
    completion callbacks run on the backend's threads)."""
    names = [t.name for t in threading.enumerate()
             if t is not threading.main_thread() and t.is_alive() and t.name not in SAFE_THREADS]
    comm = sys.modules.get("flowtrain.comm")
    return names + (list(comm.pending()) if comm is not None else [])


def end_process(code: int) -> None:
    """Ends the rank with ``code``. A thread still inside a torch wait (a pipeline stage's
    receive, a user's ``work.wait()``) that returns while the interpreter finalizes aborts the
    process: torch takes the GIL back in a C++ destructor, and the thread exit Python forces
    on it there becomes std::terminate ("terminate called without an active exception",
    SIGABRT: reliability finding 5), so a finished run is reported failed. When such a thread
    may be left, the exit handlers run and the output is flushed as at a normal exit, and the
    process ends without finalizing the interpreter; otherwise it exits normally."""
    left = lingering_threads()
    if not left:
        sys.exit(code)
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    end_process(main())
