"""The ``flowtrain`` command: ``launch`` and ``report`` (later ``simulate``, ``monitor``, ``trace``).

Subcommand modules are imported only when their subcommand runs, so ``flowtrain`` stays quick and
never imports sims/ or tui/ up front.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn


class UsageError(Exception):
    """A one-line usage problem; ``main`` prints it as ``<prog>: error: <message>`` and returns 2."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog
        self.message = message


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (argparse prints usage plus error: two)."""

    def error(self, message: str) -> NoReturn:
        if "required: script" in message:
            message = "missing the script to run; usage: flowtrain launch [options] script.py [args...]"
        raise UsageError(self.prog, message)


def _run_launch(ns: argparse.Namespace, argv: list[str]) -> int:
    from flowtrain.launch.args import resolve
    from flowtrain.launch.hostfile import LaunchInputError

    try:
        config = resolve(ns, argv)
    except LaunchInputError as exc:
        raise UsageError("flowtrain launch", str(exc)) from None
    from flowtrain.launch.job import run_launch

    try:
        return run_launch(config)
    except LaunchInputError as exc:
        raise UsageError("flowtrain launch", str(exc)) from None


def _run_report(ns: argparse.Namespace, argv: list[str]) -> int:
    from flowtrain.report import main as report_main

    return report_main(as_json=ns.json)


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="flowtrain",
        description="Train PyTorch models across processes as an actor/event pipeline.",
    )
    from flowtrain import __version__

    parser.add_argument("--version", action="version", version=f"flowtrain {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)

    launch = sub.add_parser(
        "launch", help="start and supervise the ranks of a training job (torchrun-style)",
        description="Start the ranks of a training script, supervise them, and name the root "
        "cause when one fails.",
    )
    from flowtrain.launch.args import add_launch_arguments

    add_launch_arguments(launch)
    launch.set_defaults(handler=_run_launch)

    report = sub.add_parser("report", help="versions and availability of what flowtrain uses "
                            "(like ds_report)", description="Report the environment: python, torch, "
                            "CUDA/NCCL/gloo, numba, ZeroMQ, libraries, CPU and memory.")
    report.add_argument("--json", action="store_true", help="print machine-readable JSON")
    report.set_defaults(handler=_run_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        ns = parser.parse_args(args)
        handler: Callable[[argparse.Namespace, list[str]], int] | None = getattr(ns, "handler", None)
        if handler is None:
            parser.print_help(sys.stderr)
            return 2
        return handler(ns, args)
    except UsageError as exc:
        print(f"{exc.prog}: error: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
