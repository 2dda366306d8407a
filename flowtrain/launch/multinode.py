"""Multi-host launches from a hostfile: one node launcher per host, started over ssh (or any
command given as ``--ssh-command``), each joining the coordinator this launcher hosts."""

from __future__ import annotations

import os
import select
import shlex
import sys
from pathlib import Path

from flowtrain.launch.args import LaunchConfig
from flowtrain.launch.hostfile import LaunchInputError

SECRET_READ_TIMEOUT = 60.0  # seconds a node launcher waits for the secret on its stdin


def node_command(cfg: LaunchConfig, *, node: int, host: str, slots: list[int], rank_offset: int,
                 endpoint: str, exports: dict[str, str]) -> str:
    """The shell command that runs one node's launcher on ``host``."""
    env = dict(exports)
    if len(slots) and slots != list(range(len(slots))):
        # --include host:1,3 picks devices: show each node launcher only those, as DeepSpeed does.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in slots)
    launch = [
        sys.executable, "-m", "flowtrain.cli", "launch",
        "--nnodes", str(cfg.nnodes), "--node-rank", str(node),
        "--nproc-per-node", str(len(slots)),
        "--master-addr", cfg.master_addr, "--master-port", str(cfg.master_port),
        "--control-endpoint", endpoint, "--from-parent",
        "--world-size", str(cfg.world_size), "--rank-offset", str(rank_offset),
        "--run-dir", str(Path(cfg.run_dir).absolute()), "--job-id", cfg.job_id,
        "--heartbeat-interval", str(cfg.heartbeat_interval),
        "--heartbeat-misses", str(cfg.heartbeat_misses),
        "--join-timeout", str(cfg.join_timeout), "--grace-period", str(cfg.grace_period),
    ]
    if cfg.bind_cores:  # each host checks the list against its own cores and splits them
        launch.append("--bind-cores-to-rank")
        if cfg.bind_core_list is not None:
            launch += ["--bind-core-list", cfg.bind_core_list]
    if cfg.no_python:
        launch.append("--no-python")
    if cfg.is_module:
        launch.append("-m")
    launch += [cfg.target, *cfg.target_args]
    env_part = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items()))
    # `exec` so that signals and the end of the ssh session reach the node launcher itself.
    return (f"cd {shlex.quote(os.getcwd())} && exec env {env_part} "
            f"{' '.join(shlex.quote(a) for a in launch)}")


def read_secret_from_stdin(timeout: float = SECRET_READ_TIMEOUT) -> bytes:
    """A node launcher's job secret: the first line its parent writes to stdin (never argv, where
    other users of the host could read it)."""
    fd = sys.stdin.fileno()
    line = b""
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            raise LaunchInputError(f"--from-parent: no job secret on stdin within {timeout:.0f} s")
        chunk = os.read(fd, 1)
        if not chunk:
            raise LaunchInputError("--from-parent: stdin closed before the job secret arrived")
        line += chunk
    try:
        return bytes.fromhex(line.decode().strip())
    except ValueError:
        raise LaunchInputError("--from-parent: the first stdin line is not a hex job "
                               "secret") from None
