"""Flags of ``flowtrain launch`` (torchrun- and DeepSpeed-compatible) and their validation."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

from flowtrain import env as fenv
from flowtrain.launch.affinity import parse_core_list, split
from flowtrain.launch.hostfile import LaunchInputError, apply_filters, read_hostfile
from flowtrain.launch.peer_flags import add_peer_arguments, apply_peer_flags, declares_local_rank
from flowtrain.launch.rundir import new_job_id
from flowtrain.netaddr import all_loopback

DEFAULT_MASTER_PORT = 29500
DEFAULT_SSH = "ssh -o BatchMode=yes"
SSH_ENV = "FLOWTRAIN_SSH"


@dataclass
class LaunchConfig:
    """Everything a launch needs, validated."""

    target: str  # script path, module name (is_module) or executable (no_python)
    target_args: list[str]
    is_module: bool
    no_python: bool
    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    run_dir: Path
    job_id: str
    heartbeat_interval: float
    heartbeat_misses: int
    join_timeout: float
    grace_period: float
    ssh_command: list[str]
    hosts: dict[str, list[int]] = field(default_factory=dict)  # hostfile mode: host -> slots
    control_endpoint: str | None = None  # node mode: join this coordinator instead of hosting one
    world_size: int = 0
    rank_offset: int = 0
    from_parent: bool = False  # node launcher started by a hostfile launch over ssh
    argv: list[str] = field(default_factory=list)
    total_steps: int | None = None  # for the progress line's ETA and the telemetry job record
    trace: bool = False  # write runs/<id>/trace.json (flowtrain trace) when the job ends
    bind_cores: bool = False  # --bind-cores-to-rank (or --bind-core-list)
    bind_core_list: str | None = None  # as typed; checked on the node whose ranks it binds
    core_shares: list[list[int]] | None = None  # each local rank's cores, when bound here
    local_rank_arg: bool = False  # append --local_rank=N (a DeepSpeed script declares it)
    save_pid: bool = False  # DeepSpeed's --save_pid: <run dir>/launcher.pid
    max_restarts: int = 0  # torchrun's --max-restarts (one node)
    log_level: str | None = None  # --log-level: the launcher's and the ranks' lowest level
    quiet: bool = False  # -q: the launcher's warnings and errors only, no progress line
    echo_ranks: frozenset[int] | None = None  # local ranks shown on the console (None: all)
    # --nnodes MIN:MAX with a hostfile: a restart goes on without lost hosts while MIN remain
    min_nodes: int | None = None
    # --launcher slurm|openmpi|...: the ranks are the tasks of one command (launch/tasks.py)
    encrypt_control: bool = False  # --encrypt-control: CurveZMQ on the control plane
    task_launcher: str | None = None
    task_launcher_args: list[str] = field(default_factory=list)
    # --peer-recovery: a lost rank does not end the job; the survivors re-form the group and go
    # on, and the launcher starts a replacement (up to max_restarts of them) that takes a
    # healthy peer's state
    peer_recovery: bool = False
    peer_respawn_delay: float = 0.0  # seconds between a rank's loss and its replacement's start

    @property
    def mode(self) -> str:
        """"local" (one node), "hostfile" (ssh fan-out), "node" (joins a coordinator elsewhere),
        or "multi" (torchrun-style node 0, which hosts the coordinator)."""
        if self.task_launcher:
            return "tasks"
        if self.control_endpoint:
            return "node"
        if self.hosts:
            return "hostfile"
        return "multi" if self.nnodes > 1 else "local"


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", default="1",
                   metavar="N", help="ranks on this node: an integer, or 'auto' for one per GPU "
                   "(one per CPU without GPUs) (default: 1)")
    p.add_argument("--nnodes", type=str, default="1", metavar="N",
                   help="number of nodes, each running its own 'flowtrain launch' (default: 1)")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=str, default="0",
                   metavar="I", help="index of this node, 0..nnodes-1 (default: 0)")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None,
                   metavar="HOST", help="address of rank 0's node for torch.distributed "
                   "(default: 127.0.0.1, or the first hostfile host)")
    p.add_argument("--master-port", "--master_port", dest="master_port", default=None,
                   metavar="PORT", help="port of rank 0's TCP store (default: a free port on one "
                   f"node, {DEFAULT_MASTER_PORT} across nodes)")
    p.add_argument("-H", "--hostfile", default=None, metavar="FILE",
                   help="DeepSpeed-style hostfile ('host slots=N' lines); starts one node launcher "
                   "per host over ssh")
    p.add_argument("-i", "--include", default=None, metavar="SPEC",
                   help="with --hostfile: use only these hosts/slots, e.g. 'node1:0,1@node2'")
    p.add_argument("-e", "--exclude", default=None, metavar="SPEC",
                   help="with --hostfile: leave out these hosts/slots, e.g. 'node1:3@node4'")
    p.add_argument("--ssh-command", default=None, metavar="CMD",
                   help=f"command that runs a shell command on a host, given HOST CMD "
                   f"(default: ${SSH_ENV} or '{DEFAULT_SSH}')")
    p.add_argument("--run-dir", default=None, metavar="DIR",
                   help="where logs, error files and job.json go (default: runs/<job id>)")
    p.add_argument("--heartbeat-interval", default=None, metavar="SECONDS",
                   help=f"seconds between control-plane heartbeats (default: "
                   f"{fenv.DEFAULT_HEARTBEAT_INTERVAL})")
    p.add_argument("--heartbeat-misses", default=None, metavar="N",
                   help="missed heartbeats before a rank is declared stuck (default: "
                   f"{fenv.DEFAULT_HEARTBEAT_MISSES})")
    p.add_argument("--join-timeout", default="300", metavar="SECONDS",
                   help="seconds for every rank to join the coordinator (default: 300)")
    p.add_argument("--grace-period", default="3", metavar="SECONDS",
                   help="seconds between SIGTERM and SIGKILL when tearing down (default: 3)")
    p.add_argument("--total-steps", default=None, metavar="N",
                   help="optimizer steps the job will run, for the progress line's ETA "
                   "(default: $FLOWTRAIN_TOTAL_STEPS, else no ETA)")
    p.add_argument("--encrypt-control", action="store_true",
                   help="encrypt the control plane (CurveZMQ, keys derived from the job "
                   "secret) for jobs whose hosts talk over untrusted networks; frames are "
                   "signed either way")
    p.add_argument("--peer-recovery", action="store_true",
                   help="data-parallel (ZeRO 0-2, no offload) jobs on one node: when a rank "
                   "dies the others "
                   "drop the step in flight, re-form the process group among themselves and go "
                   "on without a restart; with --max-restarts N the launcher starts up to N "
                   "replacement ranks, which take the weights and optimizer state from a "
                   "healthy peer (torchft-style fault tolerance)")
    p.add_argument("--peer-respawn-delay", default="0", metavar="SECONDS",
                   help="with --peer-recovery: seconds between a rank's loss and the start of "
                   "its replacement (default: 0)")
    p.add_argument("--trace", action="store_true",
                   help="write a Chrome/Perfetto trace of the measured task spans to "
                   "<run dir>/trace.json when the job ends (as 'flowtrain trace' does)")
    p.add_argument("--bind-cores-to-rank", "--bind_cores_to_rank", dest="bind_cores_to_rank",
                   action="store_true",
                   help="pin each local rank to its own share of the cores this launcher may "
                   "use (or of --bind-core-list) and set its OMP_NUM_THREADS (torch's threads) "
                   "to that share's size; when the cores do not divide evenly the first ranks "
                   "get one core more")
    p.add_argument("--bind-core-list", "--bind_core_list", dest="bind_core_list", default=None,
                   metavar="CORES", help="the cores to share out, e.g. '0,2-5,8' (implies "
                   "--bind-cores-to-rank; default: every core this launcher may use)")
    p.add_argument("--no-python", "--no_python", dest="no_python", action="store_true",
                   help="run the target as an executable instead of with python (no heartbeats)")
    p.add_argument("-m", "--module", action="store_true",
                   help="the target is a module name, run like 'python -m'")
    # Internal: a node launcher started by a hostfile launch.
    p.add_argument("--control-endpoint", default=None, help=argparse.SUPPRESS)
    p.add_argument("--world-size", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rank-offset", default=None, help=argparse.SUPPRESS)
    p.add_argument("--job-id", default=None, help=argparse.SUPPRESS)
    p.add_argument("--from-parent", action="store_true", help=argparse.SUPPRESS)
    add_peer_arguments(p)
    p.add_argument("target", metavar="script", help="training script (or module with -m) to run")
    p.add_argument("target_args", nargs=argparse.REMAINDER, metavar="args",
                   help="arguments passed to the script untouched")


# a job id names a directory under runs/: no separators, no "..", nothing hidden
_JOB_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


def _int(value: str, flag: str, minimum: int) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise LaunchInputError(f"{flag} must be an integer, got {value!r}") from None
    if number < minimum:
        raise LaunchInputError(f"{flag} must be at least {minimum}, got {number}")
    return number


def _seconds(value: str, flag: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise LaunchInputError(f"{flag} must be a number of seconds, got {value!r}") from None
    if not number > 0 or number == float("inf"):
        raise LaunchInputError(f"{flag} must be a positive number of seconds, got {value!r}")
    return number


def _port(value: str, flag: str) -> int:
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise LaunchInputError(f"{flag} must be a port number 1..65535, got {value!r}") from None
    if not 1 <= port <= 65535:
        raise LaunchInputError(f"{flag} must be a port number 1..65535, got {port}")
    return port


LISTEN_PORTS = (10000, 65000)  # where free_port looks, less the ephemeral range (port+1 valid)
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux's default where
    it cannot be read)."""
    try:
        low, high = (int(v) for v in Path(EPHEMERAL_RANGE_FILE).read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A port that was free a moment ago, outside the kernel's ephemeral range.

    Rank 0 binds the rendezvous port seconds after the launcher chose it (starting Python and
    torch). A port the kernel handed out (bind to 0) lies in the ephemeral range, from which
    every outgoing connection in the meantime also takes its local port: the job's own
    control-plane and gloo connections, anyone's. One did take it (sim_accuracy, 2 ranks:
    EADDRINUSE on 41381, the job failed). A port below or above that range is only taken by a
    process that binds it on purpose. Falls back to the kernel's choice when no port outside
    the range is free after ``tries`` random picks."""
    import random

    low, high = ephemeral_ports()
    outside = [r for r in ((LISTEN_PORTS[0], low - 1), (high + 1, LISTEN_PORTS[1]))
               if r[1] >= r[0]]
    pick = random.SystemRandom()
    for _ in range(tries if outside else 0):
        first, last = pick.choices(outside, weights=[b - a + 1 for a, b in outside])[0]
        port = pick.randint(first, last)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _auto_nproc() -> int:
    try:
        import torch  # only for "auto": importing torch costs a second

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return int(torch.cuda.device_count())
    except ImportError:
        pass
    return os.cpu_count() or 1


def resolve(ns: argparse.Namespace, argv: list[str]) -> LaunchConfig:
    """Checks the flags and fills in defaults; raises LaunchInputError naming the bad value."""
    apply_peer_flags(ns)
    target = ns.target
    if ns.module and ns.no_python:
        raise LaunchInputError("-m/--module and --no-python cannot be used together")
    if ns.no_python:
        if not (Path(target).is_file() or shutil.which(target)):
            raise LaunchInputError(f"executable {target!r} not found (as a file or on PATH)")
    elif not ns.module:
        path = Path(target)
        if not path.exists():
            raise LaunchInputError(f"script {target!r} does not exist (cwd: {os.getcwd()})")
        if not path.is_file():
            raise LaunchInputError(f"script {target!r} is not a file")

    if ns.nproc_per_node == "auto":
        nproc = _auto_nproc()
    else:
        nproc = _int(ns.nproc_per_node, "--nproc-per-node", 1)
    nnodes = _int(ns.nnodes, "--nnodes", 1)
    node_rank = _int(ns.node_rank, "--node-rank", 0)
    if node_rank >= nnodes:
        raise LaunchInputError(f"--node-rank must be below --nnodes={nnodes}, got {node_rank}")
    interval = _seconds(ns.heartbeat_interval or os.environ.get(fenv.HEARTBEAT_INTERVAL)
                        or str(fenv.DEFAULT_HEARTBEAT_INTERVAL), "--heartbeat-interval")
    misses = _int(ns.heartbeat_misses or os.environ.get(fenv.HEARTBEAT_MISSES)
                  or str(fenv.DEFAULT_HEARTBEAT_MISSES), "--heartbeat-misses", 1)
    join_timeout = _seconds(ns.join_timeout, "--join-timeout")
    grace = _seconds(ns.grace_period, "--grace-period")
    ssh_text = ns.ssh_command or os.environ.get(SSH_ENV) or DEFAULT_SSH
    try:
        ssh_command = shlex.split(ssh_text)
    except ValueError as exc:
        raise LaunchInputError(f"--ssh-command {ssh_text!r} is not a valid command line: "
                               f"{exc}") from None
    if not ssh_command:
        raise LaunchInputError("--ssh-command is empty; expected e.g. 'ssh -o BatchMode=yes'")

    hosts: dict[str, list[int]] = {}
    min_nodes = None if getattr(ns, "min_nodes", None) is None else \
        _int(ns.min_nodes, "--nnodes MIN:MAX's MIN", 1)
    if ns.hostfile and not ns.control_endpoint:
        hosts = apply_filters(read_hostfile(ns.hostfile), ns.include, ns.exclude)
        if min_nodes is not None and not min_nodes <= len(hosts) <= nnodes:
            raise LaunchInputError(
                f"--nnodes {min_nodes}:{nnodes} does not admit the {len(hosts)} hosts chosen "
                f"from {ns.hostfile}; MIN must be at most and MAX at least that many")
        if min_nodes is None and nnodes != 1 and nnodes != len(hosts):
            raise LaunchInputError(
                f"--nnodes={nnodes} does not match the {len(hosts)} hosts chosen from {ns.hostfile}"
            )
    elif min_nodes is not None:
        raise LaunchInputError(
            f"--nnodes {min_nodes}:{nnodes} (elastic) needs --hostfile: the launcher restarts "
            f"the job on the hosts that survive; give one number of nodes otherwise")
    elif ns.include or ns.exclude:
        raise LaunchInputError("--include/--exclude need --hostfile")

    master_addr = ns.master_addr
    if master_addr is None:
        if hosts and not all_loopback(list(hosts)):
            master_addr = next(iter(hosts))
        else:
            master_addr = "127.0.0.1"
    spans_hosts = (len(hosts) > 1 and not all_loopback(list(hosts))) or (not hosts and nnodes > 1)
    if ns.master_port is not None:
        master_port = _port(ns.master_port, "--master-port")
    elif spans_hosts:
        master_port = DEFAULT_MASTER_PORT
    else:
        master_port = free_port()
    if not hosts and nnodes > 1 and not ns.control_endpoint and master_port + 1 > 65535:
        raise LaunchInputError(
            f"--master-port must leave room for the coordinator on port+1, got {master_port}"
        )

    if hosts and len(hosts) == 1 and all_loopback(list(hosts)):
        # One local host: no ssh, like DeepSpeed's single-node path.
        nproc = len(next(iter(hosts.values())))
        hosts = {}

    job_id = ns.job_id or os.environ.get(fenv.JOB_ID) or new_job_id()
    if not _JOB_ID.fullmatch(job_id):
        source = "--job-id" if ns.job_id else fenv.JOB_ID
        raise LaunchInputError(f"{source} must be a plain name (letters, digits, '.', '_', "
                               f"'-'; not starting with '.'), got {job_id!r}; it names the "
                               f"run directory runs/<job id>")
    run_dir = Path(ns.run_dir) if ns.run_dir else Path.cwd() / "runs" / job_id
    world = nproc * nnodes
    if ns.world_size is not None:
        world = _int(ns.world_size, "--world-size", 1)
    offset = node_rank * nproc
    if ns.rank_offset is not None:
        offset = _int(ns.rank_offset, "--rank-offset", 0)
    if hosts:
        world = sum(len(s) for s in hosts.values())
    from flowtrain.telemetry.launcher import TOTAL_STEPS_ENV, parse_total_steps

    try:
        total_steps = parse_total_steps(ns.total_steps, "--total-steps") if ns.total_steps \
            is not None else parse_total_steps(os.environ.get(TOTAL_STEPS_ENV), TOTAL_STEPS_ENV)
    except ValueError as exc:
        raise LaunchInputError(str(exc)) from None
    bind = bool(ns.bind_cores_to_rank or ns.bind_core_list is not None)
    core_list = None if ns.bind_core_list is None else parse_core_list(ns.bind_core_list)
    # a hostfile launch binds on each host, where its node launcher checks the list
    shares = split(nproc, core_list, text=ns.bind_core_list) if bind and not hosts else None
    if offset + nproc > world:
        raise LaunchInputError(f"ranks {offset}..{offset + nproc - 1} do not fit in a world of "
                               f"{world}")
    restarts = 0 if ns.max_restarts is None else _int(ns.max_restarts, "--max-restarts", 0)
    if restarts and not hosts and (nnodes > 1 or ns.control_endpoint or ns.no_python):
        raise LaunchInputError(f"--max-restarts {restarts} restarts jobs this launcher starts "
                               f"whole (one node, or --hostfile); a job of launchers started "
                               f"by hand on each node (--nnodes/--node-rank) ends, naming the "
                               f"rank, with the last complete checkpoint intact; relaunch it "
                               f"and the script's load_checkpoint resumes from it")
    peer = bool(ns.peer_recovery)
    if peer and (hosts or nnodes > 1 or ns.control_endpoint or ns.no_python or
                 getattr(ns, "task_launcher", None) or min_nodes is not None):
        raise LaunchInputError("--peer-recovery works on one node (--nproc-per-node N) for now: "
                               "it does not combine with --hostfile, --nnodes, --launcher or "
                               "--no-python; use --max-restarts for those")
    try:
        respawn_delay = float(ns.peer_respawn_delay)
    except (TypeError, ValueError):
        raise LaunchInputError(f"--peer-respawn-delay must be a number of seconds, got "
                               f"{ns.peer_respawn_delay!r}") from None
    if not 0 <= respawn_delay < float("inf"):
        raise LaunchInputError(f"--peer-respawn-delay must be 0 or more seconds, got "
                               f"{ns.peer_respawn_delay!r}")
    if min_nodes is not None and not restarts:
        raise LaunchInputError("--nnodes MIN:MAX shrinks the job only when it restarts: add "
                               "--max-restarts N (each shrink is a restart)")
    task_launcher = getattr(ns, "task_launcher", None)
    task_args: list[str] = []
    if task_launcher is not None:
        from flowtrain.launch.tasks import find_command

        find_command(task_launcher)
        if ns.no_python or ns.control_endpoint or node_rank or restarts or min_nodes:
            raise LaunchInputError(f"--launcher {task_launcher} starts every rank as a task of "
                                   f"one command: it does not combine with --no-python, "
                                   f"--node-rank, --max-restarts or --nnodes MIN:MAX")
        try:
            task_args = shlex.split(ns.launcher_args or "")
        except ValueError as exc:
            raise LaunchInputError(f"--launcher_args {ns.launcher_args!r} is not a valid "
                                   f"command line: {exc}") from None
        if hosts:
            counts = {len(slots) for slots in hosts.values()}
            if len(counts) != 1:
                raise LaunchInputError(f"--launcher {task_launcher} starts the same number of "
                                       f"tasks on every host; the hostfile's slots differ "
                                       f"({sorted(counts)})")
            nproc = counts.pop()
            nnodes, world = len(hosts), len(hosts) * nproc
    return LaunchConfig(
        target=target, target_args=list(ns.target_args), is_module=ns.module,
        no_python=ns.no_python, nproc_per_node=nproc, nnodes=len(hosts) if hosts else nnodes,
        node_rank=node_rank, master_addr=master_addr, master_port=master_port,
        run_dir=run_dir, job_id=job_id, heartbeat_interval=interval, heartbeat_misses=misses,
        join_timeout=join_timeout, grace_period=grace, ssh_command=ssh_command, hosts=hosts,
        control_endpoint=ns.control_endpoint, world_size=world, rank_offset=offset,
        from_parent=ns.from_parent, argv=list(argv), total_steps=total_steps, trace=ns.trace,
        encrypt_control=bool(ns.encrypt_control or os.environ.get(fenv.CONTROL_CURVE) == "1"),
        bind_cores=bind, bind_core_list=ns.bind_core_list, core_shares=shares,
        local_rank_arg=not ns.no_local_rank and not ns.no_python and
        declares_local_rank(target, ns.module), save_pid=ns.save_pid, max_restarts=restarts,
        log_level=ns.log_level, quiet=ns.quiet, echo_ranks=ns.echo_ranks,
        min_nodes=min_nodes if hosts else None, task_launcher=task_launcher,
        task_launcher_args=task_args, peer_recovery=peer, peer_respawn_delay=respawn_delay,
    )
