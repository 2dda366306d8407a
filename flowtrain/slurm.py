"""A job started by SLURM's ``srun`` (one task per rank, no launcher): the ranks' torch
environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) from
SLURM's own variables, as torchrun or ``flowtrain launch`` would have set it. Without this every
task of ``srun python train.py`` would be rank 0 of a world of 1, each training alone."""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

# the rendezvous port when the job names none: torchrun's and DeepSpeed's default, offset by the
# job id so that two jobs sharing a node do not meet on one port
BASE_PORT = 29500
PORT_SPREAD = 1000


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: "gpu-a[03-05,07],gpu-b1" -> "gpu-a03" (a range
    keeps its zero padding), "n1,n2" -> "n1"."""
    text = nodelist.strip()
    if not text:
        raise ValueError("SLURM_NODELIST is empty")
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", text)
    if match is None:
        raise ValueError(f"SLURM_NODELIST {nodelist!r} is not a SLURM node list")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def apply(environ: MutableMapping[str, str] | None = None) -> bool:
    """Fills the torch variables from SLURM's when a task runs under ``srun`` and no launcher
    set them (RANK unset, SLURM_PROCID set); what is already set wins. Returns whether it did."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return False
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    if per_node.isdigit():
        env.setdefault("LOCAL_WORLD_SIZE", per_node)
    nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    env.setdefault("MASTER_ADDR", first_host(nodes) if nodes else "127.0.0.1")
    job = env.get("SLURM_JOB_ID", "0")
    env.setdefault("MASTER_PORT", str(BASE_PORT + (int(job) % PORT_SPREAD if job.isdigit()
                                                   else 0)))
    return True
