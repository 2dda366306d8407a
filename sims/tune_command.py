"""``flowtrain tune``: the command (flags, the ranked table, the frontier, the chosen config)."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from sims.tune import Space, TuneError, TuneResult

DEFAULT_OUTPUT = "ds_config.tuned.json"
SHOWN = 15  # rows of the ranked table on a terminal (--json has them all)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's flags (argparse only: nothing heavy is imported here)."""
    p.add_argument("--model", required=True, metavar="NAME|pkg.mod:fn",
                   help="a preset (gpt2, llama2-7b, ...) or a factory returning an nn.Module "
                        "(needed for --verify, whose trials build the model)")
    p.add_argument("--config", required=True, metavar="ds_config.json",
                   help="the config to tune: its optimizer, precision and global batch are kept")
    p.add_argument("--cluster", default="this-host", metavar="PROFILE",
                   help="hardware profile: a builtin name, a profile JSON path or this-host "
                        "(default: this-host, written by flowtrain calibrate)")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default: 1)")
    p.add_argument("--devices-per-node", type=int, default=None, metavar="N",
                   help="ranks per node (default: the profile's)")
    p.add_argument("--seq-len", type=int, default=None, metavar="N",
                   help="tokens per sample (default: the preset's context; needed to trace)")
    p.add_argument("--global-batch", type=int, default=None, metavar="N",
                   help="samples per optimizer step to keep (default: the config's)")
    p.add_argument("--memory-limit", type=float, default=None, metavar="GIB",
                   help="memory per device in GiB (default: the profile's device memory); on a "
                        "CPU host the trials hold each rank to it too")
    p.add_argument("--zero-stages", default="0,1,2,3", metavar="LIST",
                   help="ZeRO stages to try (default: 0,1,2,3)")
    p.add_argument("--micro-batches", default=None, metavar="LIST",
                   help="micro-batch sizes to try (default: powers of two the batch allows)")
    p.add_argument("--recompute", default=None, metavar="LIST",
                   help="activation recompute to try on GPUs: none, full, selective "
                        "(Megatron's, which a ds_config cannot say; default: none,full)")
    p.add_argument("--framework", default="flowtrain",
                   help="the framework the run trains with (sims.frameworks; default flowtrain)")
    p.add_argument("--verify", type=int, nargs="?", const=3, default=0, metavar="K",
                   help="run the top K (default 3) as short real trials on this host's ranks, "
                        "pick by measurement and confirm the largest micro-batch that fits")
    p.add_argument("--trial-steps", type=int, default=4, metavar="N",
                   help="timed steps of each trial (after 2 untimed ones; default 4)")
    p.add_argument("--trial-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="seconds a trial may take before it counts as failed (default 600)")
    p.add_argument("--output", default=DEFAULT_OUTPUT, metavar="PATH",
                   help=f"where to write the chosen ds_config (default: {DEFAULT_OUTPUT})")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _ints(flag: str, text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise TuneError(f"{flag} takes integers separated by commas, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise TuneError(f"{flag} takes integers >= 0 separated by commas, got {text!r}")
    return values


def run(ns: argparse.Namespace) -> int:
    """Runs the subcommand; bad input and nothing that fits raise TuneError (one line, exit
    2)."""
    from sims.prediction import read_config
    from sims.tune import search

    for flag in ("nodes", "devices_per_node", "seq_len", "global_batch", "trial_steps"):
        value = getattr(ns, flag)
        if value is not None and value < 1:
            raise TuneError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if ns.memory_limit is not None and ns.memory_limit <= 0:
        raise TuneError(f"--memory-limit must be a positive number of GiB, got "
                        f"{ns.memory_limit}")
    stages = _ints("--zero-stages", ns.zero_stages) or []
    if any(s > 3 for s in stages):
        raise TuneError(f"--zero-stages: ZeRO stages are 0 to 3, got {ns.zero_stages!r}")
    recompute = None
    if ns.recompute is not None:
        recompute = tuple(v.strip() for v in ns.recompute.split(",") if v.strip())
        bad = [v for v in recompute if v not in ("none", "full", "selective")]
        if bad or not recompute:
            raise TuneError(f"--recompute takes none, full and selective separated by commas, "
                            f"got {ns.recompute!r}")
    space = Space(zero_stages=tuple(stages),
                  micro_batches=_ints("--micro-batches", ns.micro_batches), recompute=recompute)
    limit = ns.memory_limit * 2**30 if ns.memory_limit else None
    result = search(ns.model, read_config(ns.config), cluster=ns.cluster, nodes=ns.nodes,
                    devices_per_node=ns.devices_per_node, seq_len=ns.seq_len,
                    global_batch=ns.global_batch, memory_limit_bytes=limit,
                    framework=ns.framework, space=space)
    if ns.verify:
        from sims.tune_trials import confirm_largest_micro_batch, verify

        seq = _seq_len(ns, result)
        # a CPU rank is held to the limit by the trial itself; a GPU has its own memory
        trial_limit = (limit or 0.0) if _cpu(ns.cluster) else 0.0
        verify(result, ns.verify, seq_len=seq, steps=ns.trial_steps, memory_limit=trial_limit,
               timeout_s=ns.trial_timeout)
        confirm_largest_micro_batch(result, seq_len=seq, memory_limit=trial_limit,
                                    timeout_s=ns.trial_timeout, framework=ns.framework)
    Path(ns.output).write_text(json.dumps(result.chosen_config(), indent=2) + "\n")
    if ns.json:
        print(json.dumps({**result.to_dict(), "output": ns.output}, indent=1))
    else:
        print("\n".join(report_lines(result, ns.output)))
    return 0


def _cpu(cluster: str) -> bool:
    from sims.prediction import load_profile

    return getattr(load_profile(cluster), "kind", "gpu") == "cpu"


def _seq_len(ns: argparse.Namespace, result: TuneResult) -> int:
    if ns.seq_len:
        return int(ns.seq_len)
    p = result.ranked[0].prediction
    tokens = p.tokens_per_s / p.samples_per_s if p is not None and p.tokens_per_s else 0
    if not tokens:
        raise TuneError("--verify needs --seq-len (the tokens of one trial sample)")
    return int(round(tokens))


def report_lines(result: TuneResult, output: str) -> list[str]:
    """The report: what was searched and dropped (with why), the ranked table, the frontier,
    the trials, the pick and where its config went."""
    lines = [f"searched {len(result.ranked) + len(result.dropped)} configurations of "
             f"{result.model} on {result.nodes} x {result.devices_per_node} ranks "
             f"({result.cluster}), global batch {result.global_batch}: {len(result.ranked)} "
             f"fit {result.memory_limit_bytes / 2**30:.2f} GiB per device, "
             f"{len(result.dropped)} dropped"]
    reasons = Counter(_reason(p.dropped or "") for p in result.dropped)
    for why, count in reasons.most_common(5):
        lines.append(f"  dropped {count}: {why}")
    lines += _table(result)
    frontier = result.frontier
    lines.append("memory/throughput frontier (less memory, then more throughput):")
    for p in frontier:
        pred = p.prediction
        assert pred is not None
        lines.append(f"  {(p.memory_bytes or 0) / 2**30:8.2f} GiB  "
                     f"{pred.samples_per_s:10,.1f} samples/s  {p.candidate.label()}")
    if result.scale is not None:
        lines.append(f"trials: measured / predicted step {result.scale:.2f} (median); the pick "
                     f"is the fastest measured")
    mb = result.largest_micro_batch
    if mb is not None:
        tried = ", ".join(f"{m}: {what}" for m, what in mb["trials"])
        lines.append(f"largest micro-batch that fits: predicted {mb['predicted']}, confirmed "
                     f"{mb['confirmed']} by trial ({tried})")
    lines += [f"  note: {n}" for n in result.notes + result.config_notes()]
    lines.append(f"chosen: {result.best.candidate.label()}; its config written to {output}")
    return lines


def _reason(text: str) -> str:
    """A drop reason without its numbers, so that alike reasons count together."""
    if text.startswith("needs "):
        return "does not fit the device's memory"
    return text


def _table(result: TuneResult) -> list[str]:
    """The ranked table (rich on a terminal; plain columns otherwise)."""
    head = ["#", "configuration", "step (s)", "samples/s", "memory (GiB)", "MFU %",
            "frontier", "measured (s)"]
    rows = []
    for i, p in enumerate(result.ranked[:SHOWN], 1):
        pred = p.prediction
        assert pred is not None
        measured = f"{p.measured_step_s:.4g}" if p.measured_step_s is not None else \
            (p.trial_error or "")
        rows.append([str(i), p.candidate.label(), f"{pred.step_time_s:.4g}",
                     f"{pred.samples_per_s:,.1f}", f"{(p.memory_bytes or 0) / 2**30:.2f}",
                     f"{100 * pred.mfu:.1f}", "*" if p.frontier else "", measured])
    if sys.stdout.isatty():
        try:
            from io import StringIO

            from rich.console import Console
            from rich.table import Table

            table = Table(*head)
            for row in rows:
                table.add_row(*row)
            buffer = StringIO()
            Console(file=buffer, force_terminal=True, width=160).print(table)
            return buffer.getvalue().rstrip("\n").splitlines()
        except ImportError:
            pass
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if len(result.ranked) > SHOWN:
        out.append(f"... {len(result.ranked) - SHOWN} more (--json lists them all)")
    return out
