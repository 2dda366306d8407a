"""``flowtrain checkpoint``: its arguments and its one action, ``consolidate`` (one fp32 state dict
from a checkpoint of any world size and ZeRO stage)."""

from __future__ import annotations

import argparse

from flowtrain.checkpoint.consolidate import consolidate_to_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True,
                                    parser_class=type(parser))
    p = actions.add_parser(
        "consolidate", help="write one fp32 state dict from a checkpoint of any world size "
        "and ZeRO stage", description="Write one plain fp32 state dict (parameters in their "
        "shapes, buffers) from a checkpoint saved on any number of ranks with any ZeRO stage; "
        "model.load_state_dict(torch.load(OUT)) loads it.")
    p.add_argument("checkpoint_dir", metavar="DIR",
                   help="the save_dir given to save_checkpoint, or one checkpoint's directory")
    p.add_argument("output", metavar="OUT", help="the file to write (torch.save format, .pt)")
    p.add_argument("--tag", default=None,
                   help="which checkpoint of DIR (default: the one DIR/latest names)")


def run(ns: argparse.Namespace) -> str:
    """Runs the chosen action; returns the line to print. Raises FileNotFoundError or
    ValueError for input the user must fix."""
    state = consolidate_to_file(ns.checkpoint_dir, ns.output, tag=ns.tag)
    count = sum(t.numel() for t in {id(t): t for t in state.values()}.values())
    return f"wrote {len(state)} tensors ({count} elements, fp32) to {ns.output}"
