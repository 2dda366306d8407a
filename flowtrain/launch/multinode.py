"""Multi-host launches: from a hostfile, one node launcher per host, started over ssh (or any
command given as ``--ssh-command``), each joining the coordinator this launcher hosts and
taking the job secret on its stdin; launched on each node by hand, the job secret every node
derives alike (``derived_secret``)."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import select
import shlex
import sys
from pathlib import Path

from flowtrain import env as fenv
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
    if cfg.encrypt_control:
        launch.append("--encrypt-control")
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


JOB_KEY = Path(".flowtrain") / "job-key"  # under the user's home


def derived_secret(master_addr: str, master_port: int) -> bytes:
    """A multi-node job's secret without an export: an HMAC of what every node's command line
    shares (rank 0's address and port, and the SLURM job id under SLURM) under a key only this
    user can read, ``~/.flowtrain/job-key`` (made on first use, 0600). Nodes that share the
    home directory, as cluster nodes do, derive the same secret; the key's fingerprint is
    logged so nodes that do not can be told apart."""
    path = Path(os.path.expanduser("~")) / JOB_KEY
    key = _job_key(path)
    ident = f"{master_addr}:{master_port}:{os.environ.get('SLURM_JOB_ID', '')}".encode()
    secret = hmac.new(key, b"flowtrain job secret\0" + ident, hashlib.sha256).digest()
    print(f"flowtrain launch: job secret derived from {path} (key fingerprint "
          f"{hashlib.sha256(key).hexdigest()[:12]}; every node must show the same) for "
          f"{master_addr}:{master_port}", file=sys.stderr, flush=True)
    return secret


def _job_key(path: Path) -> bytes:
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not path.exists():
            # written whole under another name, then linked in: a node racing this one
            # reads either nothing yet or the whole key, never part of it
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            finally:
                tmp.unlink(missing_ok=True)
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise LaunchInputError(f"{path} is readable by other users (mode {mode:o}); it "
                                   f"signs this user's jobs: chmod 600 {path}")
        key = path.read_bytes()
    except OSError as exc:
        raise LaunchInputError(f"--nnodes without --hostfile needs the same job secret on "
                               f"every node: {fenv.JOB_SECRET} is not set and {path} cannot "
                               f"be used ({exc}); export {fenv.JOB_SECRET} on every node "
                               f"instead") from None
    if len(key) < 16:
        raise LaunchInputError(f"{path} holds {len(key)} bytes; expected 32 random bytes "
                               f"(delete it and a new one is made)")
    return key
