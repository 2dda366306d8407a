"""The ``flowtrain`` command: ``launch`` and ``report`` (later ``simulate``, ``monitor``,
``trace``).

Subcommand modules are imported only when their subcommand runs, so ``flowtrain`` stays quick and
never imports sims/ or tui/ up front.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn


class UsageError(Exception):
    """A one-line usage problem; ``main`` prints it as ``<prog>: error: <message>`` and
    returns 2."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog
        self.message = message


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (argparse prints usage plus error: two)."""

    def error(self, message: str) -> NoReturn:
        if "required: script" in message:
            message = ("missing the script to run; usage: flowtrain launch [options] script.py "
                       "[args...]")
        raise UsageError(self.prog, message)


def _launch_entry() -> tuple[AddArguments, Run]:
    from flowtrain.launch.args import add_launch_arguments

    def run(ns: argparse.Namespace, argv: list[str]) -> int:
        from flowtrain.launch.args import resolve
        from flowtrain.launch.hostfile import LaunchInputError

        try:
            config = resolve(ns, argv)
            from flowtrain.launch.job import run_launch

            return run_launch(config)
        except LaunchInputError as exc:
            raise UsageError("flowtrain launch", str(exc)) from None

    return add_launch_arguments, run


def _report_entry() -> tuple[AddArguments, Run]:
    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true", help="print machine-readable JSON")

    def run(ns: argparse.Namespace, argv: list[str]) -> int:
        from flowtrain.report import main as report_main

        return report_main(as_json=ns.json)

    return add, run


def _checkpoint_entry() -> tuple[AddArguments, Run]:
    from flowtrain.checkpoint.cli import add_arguments

    def run(ns: argparse.Namespace, argv: list[str]) -> int:
        from flowtrain.checkpoint.cli import run as checkpoint_run

        try:
            print(checkpoint_run(ns))
        except (FileNotFoundError, ValueError) as exc:
            raise UsageError(f"flowtrain checkpoint {ns.action}", str(exc)) from None
        return 0

    return add_arguments, run


def _monitor_entry() -> tuple[AddArguments, Run]:
    from tui.cli import add_arguments

    def run(ns: argparse.Namespace, argv: list[str]) -> int:
        from tui.cli import MonitorInputError
        from tui.cli import run as monitor_run

        try:
            return monitor_run(ns)
        except MonitorInputError as exc:
            raise UsageError("flowtrain monitor", str(exc)) from None

    return add_arguments, run


def _trace_entry() -> tuple[AddArguments, Run]:
    from flowtrain.telemetry.trace import add_arguments

    def run(ns: argparse.Namespace, argv: list[str]) -> int:
        from flowtrain.telemetry.trace import run as trace_run

        def predict(run_dir: Path) -> dict[str, Any]:
            from sims.trace import run_prediction_trace

            return run_prediction_trace(run_dir, ns.cluster)

        try:
            print(trace_run(ns, predict))
        except (FileNotFoundError, ValueError) as exc:  # TraceInputError, SimulateError
            raise UsageError("flowtrain trace", str(exc)) from None
        return 0

    return add_arguments, run


def _simulate_entry() -> tuple[AddArguments, Run]:
    from sims.simulate import add_arguments

    def run(ns: argparse.Namespace, argv: list[str]) -> int:
        from sims.simulate import SimulateError
        from sims.simulate import run as simulate_run

        try:
            return simulate_run(ns)
        except SimulateError as exc:
            raise UsageError("flowtrain simulate", str(exc)) from None

    return add_arguments, run


def _tune_entry() -> tuple[AddArguments, Run]:
    from sims.tune_command import add_arguments

    def run(ns: argparse.Namespace, argv: list[str]) -> int:
        from sims.tune import TuneError
        from sims.tune_command import run as tune_run

        try:
            return tune_run(ns)
        except TuneError as exc:
            raise UsageError("flowtrain tune", str(exc)) from None
        except ValueError as exc:  # SimulateError and config errors: one line, as simulate's
            raise UsageError("flowtrain tune", str(exc).splitlines()[0]) from None

    return add_arguments, run


def _calibrate_entry() -> tuple[AddArguments, Run]:
    def add(p: argparse.ArgumentParser) -> None:
        from sims.calibrate.command import build_parser

        # calibrate's own parser defines its flags; they are copied here (all but -h) so that
        # `flowtrain calibrate --help` lists them and bad flags fail like every subcommand's
        for action in build_parser()._actions:
            if not isinstance(action, argparse._HelpAction):
                p._add_action(action)

    def run(ns: argparse.Namespace, argv: list[str]) -> int:
        from sims.calibrate.command import main as calibrate_main

        return calibrate_main(argv[argv.index("calibrate") + 1:])

    return add, run


AddArguments = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace, list[str]], int]

# name -> (one-line help, loader). A loader imports its module only when its subcommand runs and
# returns (add_arguments, run). New subcommands (simulate, monitor, trace) add an entry here.
SUBCOMMANDS: dict[str, tuple[str, Callable[[], tuple[AddArguments, Run]]]] = {
    "launch": ("start and supervise the ranks of a training job (torchrun-style)", _launch_entry),
    "report": ("versions and availability of what flowtrain uses (like ds_report)", _report_entry),
    "checkpoint": ("work with saved checkpoints: consolidate one into a plain fp32 state dict",
                   _checkpoint_entry),
    "trace": ("one Chrome/Perfetto trace of a run's measured task spans, a process per rank",
              _trace_entry),
    "monitor": ("watch a running job live, or replay a finished run, in a terminal UI",
                _monitor_entry),
    "simulate": ("predict a step's time, overlap, bubble and memory for a model, config and "
                 "cluster", _simulate_entry),
    "calibrate": ("measure this host and write the simulator's this-host hardware profile",
                  _calibrate_entry),
    "tune": ("search ZeRO stage, micro-batch, parallelism and buckets with the simulator, then "
             "confirm the best with a few real trials", _tune_entry),
}


def build_parser(chosen: str | None = None) -> OneLineParser:
    """The parser; only the chosen subcommand's module is imported to add its arguments."""
    from flowtrain import __version__

    parser = OneLineParser(
        prog="flowtrain",
        description="Train PyTorch models across processes as an actor/event pipeline.",
    )
    parser.add_argument("--version", action="version", version=f"flowtrain {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name, (help_text, loader) in SUBCOMMANDS.items():
        child = sub.add_parser(name, help=help_text,
                               description=help_text[0].upper() + help_text[1:] + ".")
        if name == chosen:
            add_arguments, run = loader()
            add_arguments(child)
            child.set_defaults(handler=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in args if not a.startswith("-")), None)
    parser = build_parser(chosen)
    try:
        ns = parser.parse_args(args)
        handler: Callable[[argparse.Namespace, list[str]], int] | None = \
            getattr(ns, "handler", None)
        if handler is None:
            parser.print_help(sys.stderr)
            return 2
        return handler(ns, args)
    except UsageError as exc:
        print(f"{exc.prog}: error: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
