"""The flags users of the DeepSpeed launcher and of torchrun type, on ``flowtrain launch``: each
is taken with its peer's meaning, or refused with one line that names what flowtrain does
instead (never a bare "unrecognized arguments").

- Taken: DeepSpeed's ``--num_gpus`` (ranks per node), ``--num_nodes``, ``--no_ssh`` (each node
  started by hand, as ``--nnodes``/``--node_rank`` launches are), ``--ssh_port``,
  ``--save_pid``, ``--no_local_rank``, ``--launcher pdsh`` (flowtrain's own ssh fan-out),
  ``--launcher slurm|openmpi|mpich|impi|mvapich`` with ``--launcher_args`` (the ranks as the
  tasks of one srun/mpirun/mpiexec, ``launch/tasks.py``);
  torchrun's ``--standalone``, ``--nproc-per-node gpu|cpu``, ``--max-restarts`` (one node),
  ``--rdzv-backend static|c10d`` with ``--rdzv-endpoint HOST:PORT`` (the rendezvous address),
  ``--rdzv-id`` (the job id), ``--log-dir`` (the run directory).
  The console: ``--log_level``, ``-q/--quiet``, torchrun's ``--redirects``, ``--tee`` and
  ``--local-ranks-filter``.
- Refused with the flowtrain equivalent: ``--force_multi``, ``--venv_script``,
  ``--nnodes MIN:MAX`` without a hostfile, ``--max-restarts`` of nodes launched by hand,
  ``--rdzv-conf``.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from flowtrain.launch.hostfile import LaunchInputError

LAUNCHERS = ("pdsh", "openmpi", "mvapich", "slurm", "mpich", "impi")


def add_peer_arguments(p: argparse.ArgumentParser) -> None:
    """The peers' flags (hidden from --help's main list: they say which peer they come from)."""
    peers = p.add_argument_group("DeepSpeed launcher and torchrun flags (their meaning, or a "
                                 "one-line refusal naming flowtrain's way)")
    peers.add_argument("--num_gpus", "--num-gpus", dest="num_gpus", default=None, metavar="N",
                       help="DeepSpeed: ranks per node (as --nproc-per-node)")
    peers.add_argument("--num_nodes", "--num-nodes", dest="num_nodes", default=None,
                       metavar="N", help="DeepSpeed: nodes (as --nnodes)")
    peers.add_argument("--launcher", default=None, metavar="NAME",
                       help="DeepSpeed: pdsh (flowtrain's ssh fan-out with --hostfile); "
                            "slurm/openmpi/mpich/impi/mvapich start the ranks as the tasks of "
                            "srun/mpirun/mpiexec")
    peers.add_argument("--launcher_args", "--launcher-args", dest="launcher_args",
                       default=None, metavar="ARGS",
                       help="DeepSpeed: more arguments for the command of --launcher "
                            "slurm|openmpi|mpich|impi|mvapich")
    peers.add_argument("--no_ssh", "--no-ssh", dest="no_ssh", action="store_true",
                       help="DeepSpeed: each node started by hand (with --node_rank)")
    peers.add_argument("--force_multi", "--force-multi", dest="force_multi",
                       action="store_true", help="DeepSpeed: refused")
    peers.add_argument("--ssh_port", "--ssh-port", dest="ssh_port", default=None,
                       metavar="PORT", help="DeepSpeed: the port ssh connects to")
    peers.add_argument("--venv_script", "--venv-script", dest="venv_script", default=None,
                       metavar="PATH", help="DeepSpeed: refused")
    peers.add_argument("--save_pid", "--save-pid", dest="save_pid", action="store_true",
                       help="DeepSpeed: write the launcher's pid to <run dir>/launcher.pid")
    peers.add_argument("--no_local_rank", "--no-local-rank", dest="no_local_rank",
                       action="store_true",
                       help="DeepSpeed: do not pass --local_rank=N to a script that declares it")
    peers.add_argument("--log_level", "--log-level", dest="log_level", default=None,
                       metavar="LEVEL", help="the lowest level the launcher and the ranks log: "
                       "debug, info (default), warning, error")
    peers.add_argument("-q", "--quiet", action="store_true",
                       help="the launcher says only warnings, errors and the final report, and "
                       "the ranks' log lines stay in their files (their prints still show)")
    peers.add_argument("--standalone", action="store_true",
                       help="torchrun: one node, rendezvous on this host (the default)")
    peers.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", default=None,
                       metavar="N", help="torchrun: restart the job after a failure up to N "
                       "times (one node), resuming from the last checkpoint the script loads (or "
                       "the config's checkpoint.auto_resume loads)")
    peers.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", default=None,
                       metavar="NAME", help="torchrun: static or c10d (a TCP store)")
    peers.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint",
                       default=None, metavar="HOST:PORT",
                       help="torchrun: rank 0's address (as --master-addr/--master-port)")
    peers.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", default=None, metavar="ID",
                       help="torchrun: the job id (names the run directory)")
    peers.add_argument("--rdzv-conf", "--rdzv_conf", dest="rdzv_conf", default=None,
                       metavar="K=V", help="torchrun: refused")
    peers.add_argument("--redirects", default=None, metavar="SPEC",
                       help="torchrun: 1, 2 or 3 keeps the ranks' output in <run dir>/rank<N>"
                       ".out only (off the console); 0 the default")
    peers.add_argument("--tee", default=None, metavar="SPEC",
                       help="torchrun: output both to the files and the console (flowtrain's "
                       "default)")
    peers.add_argument("--log-dir", "--log_dir", dest="log_dir", default=None, metavar="DIR",
                       help="torchrun: where the ranks' logs go (as --run-dir)")
    peers.add_argument("--local-ranks-filter", "--local_ranks_filter",
                       dest="local_ranks_filter", default=None, metavar="RANKS",
                       help="torchrun: only these local ranks' output on the console, e.g. 0 "
                       "or 0,2 (every rank's stays in its file)")


def _refuse(flag: str, instead: str) -> LaunchInputError:
    return LaunchInputError(f"{flag} is not supported by flowtrain launch: {instead}")


def apply_peer_flags(ns: argparse.Namespace) -> None:
    """Folds the peers' flags into flowtrain's own (in ``ns``), or raises LaunchInputError with
    one line naming the flowtrain way."""
    ns.task_launcher = None
    if ns.launcher is not None:
        name = str(ns.launcher).lower()
        if name not in LAUNCHERS:
            raise LaunchInputError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got "
                                   f"{ns.launcher!r}")
        if name != "pdsh":
            ns.task_launcher = name  # the ranks are srun's or mpirun's tasks (launch/tasks.py)
    if ns.launcher_args is not None and ns.task_launcher is None:
        raise _refuse("--launcher_args", "they go to --launcher slurm|openmpi|mpich|impi|"
                      "mvapich; flowtrain's own ssh fan-out takes ssh options in "
                      "--ssh-command")
    if ns.force_multi:
        raise _refuse("--force_multi", "a --hostfile of one non-local host already launches "
                      "over ssh")
    if ns.venv_script is not None:
        raise _refuse("--venv_script", "put the activation in --ssh-command, e.g. --ssh-command "
                      "\"ssh -o BatchMode=yes\" with the venv's python first on each host's PATH")
    if ns.log_level is not None:
        from flowtrain.log import log_level

        try:
            log_level(ns.log_level)
        except ValueError as exc:
            raise LaunchInputError(f"--log-level: {exc}") from None
    if ns.rdzv_conf is not None:
        raise _refuse("--rdzv-conf", "the rendezvous is rank 0's TCP store; its timeout is "
                      "--join-timeout")
    for flag, value in (("--redirects", ns.redirects), ("--tee", ns.tee)):
        if value is not None and value not in ("0", "1", "2", "3"):
            raise LaunchInputError(f"{flag} takes 0, 1, 2 or 3 (torchrun's: none, stdout, "
                                   f"stderr, both), got {value!r}")
    ns.echo_ranks = None  # local ranks whose output the console shows (None: all)
    if ns.redirects not in (None, "0") and ns.tee in (None, "0"):
        ns.echo_ranks = frozenset()
    if ns.local_ranks_filter is not None:
        try:
            ranks = frozenset(int(r) for r in str(ns.local_ranks_filter).split(",") if r.strip())
        except ValueError:
            raise LaunchInputError(f"--local-ranks-filter takes local ranks separated by commas, "
                                   f"got {ns.local_ranks_filter!r}") from None
        if not ranks or min(ranks) < 0:
            raise LaunchInputError(f"--local-ranks-filter takes local ranks >= 0, got "
                                   f"{ns.local_ranks_filter!r}")
        ns.echo_ranks = ranks
    if ns.num_gpus is not None:
        ns.nproc_per_node = ns.num_gpus
    if ns.num_nodes is not None:
        ns.nnodes = ns.num_nodes
    if str(ns.nproc_per_node).lower() in ("gpu", "cpu"):
        ns.nproc_per_node = _devices(str(ns.nproc_per_node).lower())
    ns.min_nodes = None
    if ":" in str(ns.nnodes):
        # torchrun's elastic MIN:MAX: with a hostfile, a job that loses hosts goes on with
        # the survivors while MIN still hold (args.py checks the numbers)
        low, _, high = str(ns.nnodes).partition(":")
        if low != high:
            ns.min_nodes = low
        ns.nnodes = high
    if ns.rdzv_backend is not None and ns.rdzv_backend not in ("static", "c10d"):
        raise _refuse(f"--rdzv-backend {ns.rdzv_backend}", "flowtrain meets at rank 0's TCP "
                      "store (static or c10d)")
    if ns.rdzv_endpoint is not None:
        host, sep, port = str(ns.rdzv_endpoint).rpartition(":")
        if not sep:
            host, port = str(ns.rdzv_endpoint), ""
        if ns.master_addr is None and host:
            ns.master_addr = host.strip("[]")
        if ns.master_port is None and port:
            ns.master_port = port
    if ns.rdzv_id is not None and ns.job_id is None:
        ns.job_id = ns.rdzv_id
    if ns.log_dir is not None and ns.run_dir is None:
        ns.run_dir = ns.log_dir
    if ns.ssh_port is not None:
        port = str(ns.ssh_port)
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise LaunchInputError(f"--ssh_port must be a port number 1..65535, got {port!r}")
        base = ns.ssh_command or os.environ.get("FLOWTRAIN_SSH") or "ssh -o BatchMode=yes"
        ns.ssh_command = f"{base} -p {shlex.quote(port)}"


def _devices(kind: str) -> str:
    """torchrun's --nproc-per-node gpu|cpu: the GPUs here (refused without one), or the
    cores."""
    if kind == "cpu":
        return str(os.cpu_count() or 1)
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise LaunchInputError("--nproc-per-node gpu: this host has no CUDA GPU; use cpu, "
                               "auto or a number")
    return str(count)


def declares_local_rank(target: str, is_module: bool) -> bool:
    """Whether a script declares a --local_rank (or --local-rank) argument, as DeepSpeed
    scripts do for the launcher to fill: such a script gets --local_rank=N appended, as
    DeepSpeed's launcher appends it; a torchrun-style script that reads LOCAL_RANK is left
    alone (an unexpected argument would stop its parser)."""
    if is_module:
        return False
    try:
        text = Path(target).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return any(f"{q}--local{sep}rank{q}" in text for q in ('"', "'") for sep in ("_", "-"))
