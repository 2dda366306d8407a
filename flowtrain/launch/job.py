"""One ``flowtrain launch``: run directory, secret, per-rank environment, children, supervision,
and the root-cause report at the end."""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowtrain import env as fenv
from flowtrain.control.coordinator import tcp_endpoint
from flowtrain.launch.affinity import CORES_ENV, format_cores
from flowtrain.launch.args import LaunchConfig, free_port
from flowtrain.launch.envfile import load_env_files, remote_exports
from flowtrain.launch.hostfile import LaunchInputError
from flowtrain.launch.multinode import derived_secret, node_command, read_secret_from_stdin
from flowtrain.launch.rundir import RunDir, mark_stale_jobs
from flowtrain.launch.summary import Outcome, collect_outcome, format_report
from flowtrain.launch.supervisor import NODE_RESULT_MARKER, Child, Supervisor, describe_exit
from flowtrain.log import configure_logging, get_logger, log_level
from flowtrain.netaddr import all_loopback, is_loopback

if TYPE_CHECKING:
    from flowtrain.telemetry.launcher import JobTelemetry

log = get_logger("flowtrain.launch")


def _job_secret(cfg: LaunchConfig, hosting_alone: bool) -> bytes:
    if hosting_alone:
        return secrets.token_bytes(32)
    if cfg.from_parent:
        return read_secret_from_stdin()
    raw = os.environ.get(fenv.JOB_SECRET, "")
    hint = ("export FLOWTRAIN_JOB_SECRET=$(python -c 'import secrets; "
            "print(secrets.token_hex(32))') once and pass the same value to every node")
    if not raw:
        return derived_secret(cfg.master_addr, cfg.master_port)
    try:
        return bytes.fromhex(raw)
    except ValueError:
        raise LaunchInputError(f"{fenv.JOB_SECRET} must be hex digits, got {len(raw)} characters "
                               f"that are not: {hint}") from None


def _rank_env(cfg: LaunchConfig, base: dict[str, str], rd: RunDir, local_rank: int,
              endpoint: str | None, secret: bytes, console: str) -> dict[str, str]:
    rank = cfg.rank_offset + local_rank
    env = dict(base)
    env.update({
        fenv.RANK: str(rank), fenv.LOCAL_RANK: str(local_rank),
        fenv.WORLD_SIZE: str(cfg.world_size), fenv.LOCAL_WORLD_SIZE: str(cfg.nproc_per_node),
        fenv.GROUP_RANK: str(cfg.node_rank), fenv.MASTER_ADDR: cfg.master_addr,
        fenv.MASTER_PORT: str(cfg.master_port), fenv.JOB_ID: cfg.job_id,
        fenv.RUN_DIR: str(rd.path), fenv.ERROR_FILE: str(rd.rank_error(rank)),
        fenv.HEARTBEAT_INTERVAL: str(cfg.heartbeat_interval),
        fenv.HEARTBEAT_MISSES: str(cfg.heartbeat_misses), fenv.CONSOLE: console,
        **({fenv.LOG_LEVEL: cfg.log_level} if cfg.log_level else {}),
        # torchrun's: torch.distributed.is_torchelastic_launched() reads the run id
        "TORCHELASTIC_RUN_ID": cfg.job_id, "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
        "TORCHELASTIC_RESTART_COUNT": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
        fenv.LAUNCHED: "1", "PYTHONUNBUFFERED": "1",
    })
    if cfg.core_shares is not None:
        cores = cfg.core_shares[local_rank]
        env[CORES_ENV] = ",".join(str(c) for c in cores)
        env["OMP_NUM_THREADS"] = str(len(cores))  # torch sizes its thread pool by it
    else:
        env.pop(CORES_ENV, None)
    if cfg.encrypt_control:
        env[fenv.CONTROL_CURVE] = "1"
    if cfg.peer_recovery:
        env[fenv.PEER_RECOVERY] = "1"
    env.pop(fenv.PEER_JOIN, None)
    if endpoint:
        env[fenv.CONTROL_ENDPOINT] = endpoint
        env[fenv.JOB_SECRET] = secret.hex()
    else:
        env.pop(fenv.CONTROL_ENDPOINT, None)
        env.pop(fenv.JOB_SECRET, None)
    return env


def _task_child(cfg: LaunchConfig, env: dict[str, str], rd: RunDir, umask: int) -> Child:
    """--launcher slurm|openmpi|...: one child, the command whose tasks are the ranks; each
    task takes its rank from that launcher's variables (launch/tasks.py)."""
    from flowtrain.launch.tasks import TASK_LAUNCHER, find_command, task_command

    name = cfg.task_launcher
    assert name is not None
    for key in (fenv.RANK, fenv.LOCAL_RANK, fenv.GROUP_RANK, fenv.ERROR_FILE):
        env.pop(key, None)
    env[TASK_LAUNCHER] = name
    hosts = list(cfg.hosts)
    if hosts:
        env[fenv.MASTER_ADDR] = hosts[0]  # rank 0's host, where torch's store listens
    elif name == "slurm":
        env.pop(fenv.MASTER_ADDR, None)  # the allocation's first node (flowtrain.slurm)
    argv = task_command(name, find_command(name), nnodes=cfg.nnodes,
                        nproc_per_node=cfg.nproc_per_node, hosts=hosts,
                        launcher_args=cfg.task_launcher_args, env=env,
                        rank_argv=_rank_argv(cfg))
    return Child(label=f"{name} ({cfg.world_size} tasks)", argv=argv, env=env,
                 out_path=rd.path / "tasks.out", host=socket.gethostname(), umask=umask)


def _rank_argv(cfg: LaunchConfig, local_rank: int = 0) -> list[str]:
    if cfg.no_python:
        target = str(Path(cfg.target).absolute()) if Path(cfg.target).is_file() else cfg.target
        if cfg.core_shares is not None:  # pins itself, then execs the target
            return [sys.executable, "-m", "flowtrain.launch.affinity", target, *cfg.target_args]
        return [target, *cfg.target_args]
    head = [sys.executable, "-m", "flowtrain.launch.bootstrap"]
    # a DeepSpeed script declares --local_rank for its launcher to fill (after the script's
    # own arguments, where DeepSpeed's launcher puts it)
    extra = [f"--local_rank={local_rank}"] if cfg.local_rank_arg else []
    return head + (["-m"] if cfg.is_module else []) + [cfg.target, *cfg.target_args, *extra]


def run_launch(cfg: LaunchConfig) -> int:
    """Runs the job described by ``cfg`` (again after a failure, up to ``cfg.max_restarts``
    times); returns the launcher's exit code."""
    # What the launcher writes (logs, job.json, telemetry) is its owner's only; the ranks get
    # the user's own umask back (Child.umask), for their checkpoints and outputs.
    user_umask = os.umask(0o077)
    try:
        if cfg.max_restarts == 0 or cfg.peer_recovery:
            # --peer-recovery: --max-restarts counts replacement ranks, not job restarts
            return _run_launch(cfg, user_umask)
        return _with_restarts(cfg, user_umask)
    finally:
        os.umask(user_umask)


RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # waits before restart 1, 2, ...
RESTART_COUNT_ENVS = ("FLOWTRAIN_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")


def _with_restarts(cfg: LaunchConfig, user_umask: int) -> int:
    """torchrun's --max-restarts, on one node or a hostfile's: after a failed attempt the
    whole job starts again (a fresh rendezvous port and control plane; the script's own
    load_checkpoint, or its config's checkpoint, resumes it from the last complete
    checkpoint), after a backoff; each attempt's logs move to <run dir>/attempt<k>/ and
    restarts.json records them all. With --nnodes MIN:MAX, hosts whose node launcher died
    are left out of the next attempt while MIN remain (torchrun's elastic shrink); the ranks
    learn the first attempt's world size (FLOWTRAIN_FIRST_WORLD_SIZE) so the config loader
    keeps its global batch. A launcher stopped by a signal (Ctrl-C) ends at once."""
    from dataclasses import replace

    rd = RunDir(cfg.run_dir)
    attempts: list[dict[str, Any]] = []
    code = 1
    this = cfg
    os.environ[fenv.FIRST_WORLD_SIZE] = str(cfg.world_size)
    for attempt in range(cfg.max_restarts + 1):
        for name in RESTART_COUNT_ENVS:
            os.environ[name] = str(attempt)
        if attempt:
            this = replace(this, master_port=free_port())
        started = time.time()
        code = _run_launch(this, user_umask)
        job = _read_job(rd)
        attempts.append({"attempt": attempt, "start_time": started, "end_time": time.time(),
                         "exit_code": code, "status": job.get("status"),
                         "root_cause": job.get("root_cause"), "hosts": list(this.hosts),
                         "world_size": this.world_size})
        rd.create()
        (rd.path / "restarts.json").write_text(json.dumps(attempts, indent=2, default=str))
        if code == 0 or code in (130, 143) or attempt == cfg.max_restarts:
            break
        if this.min_nodes is not None and job.get("lost_hosts"):
            survivors = {h: s for h, s in this.hosts.items() if h not in job["lost_hosts"]}
            if len(survivors) < this.min_nodes:
                log.error(f"lost hosts {', '.join(job['lost_hosts'])}: {len(survivors)} left, "
                          f"fewer than --nnodes' minimum {this.min_nodes}; the job ends",
                          console=True)
                break
            this = replace(this, hosts=survivors, nnodes=len(survivors),
                           world_size=sum(len(s) for s in survivors.values()))
            log.warning(f"lost hosts {', '.join(job['lost_hosts'])}; going on with "
                        f"{len(survivors)} hosts, {this.world_size} ranks (the global batch "
                        f"kept: each rank accumulates more micro-batches)", console=True)
        _keep_attempt_files(rd, attempt)
        wait = RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)]
        cause = (job.get("root_cause") or {}).get("message") or f"exit {code}"
        log.warning(f"attempt {attempt} failed; restarting the job in {wait:g} s "
                    f"(restart {attempt + 1} of {cfg.max_restarts})", console=True,
                    cause=str(cause)[:200])
        time.sleep(wait)
    return code


def _read_job(rd: RunDir) -> dict[str, Any]:
    try:
        found = json.loads(rd.job_json.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _keep_attempt_files(rd: RunDir, attempt: int) -> None:
    """A failed attempt's rank output, logs and error files, moved out of the way of the next
    attempt's (which would overwrite them, or be mistaken for its own root cause)."""
    keep = rd.path / f"attempt{attempt}"
    keep.mkdir(mode=0o700, exist_ok=True)
    for pattern in ("rank*.out", "rank*.error.json", "rank*.jsonl", "job.json", "node*.out",
                    "job.node*.json"):
        for path in rd.path.glob(pattern):
            path.replace(keep / path.name)


def _run_launch(cfg: LaunchConfig, user_umask: int) -> int:
    mode = cfg.mode
    joins_remote = mode == "node" or (mode == "multi" and cfg.node_rank > 0)
    if cfg.no_python and mode != "local":
        raise LaunchInputError("--no-python works on one node only (its ranks cannot join the "
                               "control plane); drop --nnodes/--hostfile or run python scripts")
    secret = _job_secret(cfg, hosting_alone=mode in ("local", "hostfile", "tasks"))
    rd = RunDir(cfg.run_dir, f".node{cfg.node_rank}" if joins_remote else "")
    try:
        rd.create()
    except OSError as exc:
        raise LaunchInputError(str(exc)) from None
    if cfg.save_pid:  # DeepSpeed's --save_pid, in the run directory rather than /tmp
        (rd.path / "launcher.pid").write_text(f"{os.getpid()}\n")
    console = "human" if sys.stderr.isatty() else "plain"
    level = log_level(cfg.log_level, logging.WARNING if cfg.quiet else logging.INFO)
    configure_logging(json_path=rd.launcher_log, console=console, role="launcher",
                      node_rank=cfg.node_rank, job_id=cfg.job_id, level=level)
    # the ranks' own console: as the user set FLOWTRAIN_CONSOLE, off when quiet, else ours
    rank_console = os.environ.get(fenv.CONSOLE) or ("off" if cfg.quiet else console)
    for stale in mark_stale_jobs(rd.path.parent, socket.gethostname()):
        log.warning("a job whose launcher was killed still said 'running'; marked it killed "
                    "and removed its live endpoint file", run_dir=str(stale))
    file_vars = load_env_files(Path.cwd(), os.environ.get("HOME"))
    base_env = dict(os.environ)
    base_env.update(file_vars)
    if cfg.core_shares is not None:
        shares = {f"rank {cfg.rank_offset + lr}": format_cores(cores)
                  for lr, cores in enumerate(cfg.core_shares)}
        log.info("binding each rank to its own cores; OMP_NUM_THREADS is each share's size",
                 console=True, cores=shares)
        given = base_env.get("OMP_NUM_THREADS")
        if given is not None and any(str(len(c)) != given for c in cfg.core_shares):
            log.warning("OMP_NUM_THREADS is set; --bind-cores-to-rank replaces it for each rank "
                        "with the size of its share of the cores", OMP_NUM_THREADS=given)
    elif "OMP_NUM_THREADS" not in base_env and mode != "hostfile":
        threads = max(1, (os.cpu_count() or 1) // cfg.nproc_per_node)
        base_env["OMP_NUM_THREADS"] = str(threads)
        log.info("OMP_NUM_THREADS was not set; setting it for every rank to avoid "
                    "oversubscribing the CPUs; set it yourself to tune", OMP_NUM_THREADS=threads)
    for local_rank in range(cfg.nproc_per_node):
        # A stale error file from an earlier run in the same directory would win as root cause.
        rd.rank_error(cfg.rank_offset + local_rank).unlink(missing_ok=True)

    # Where the coordinator lives and where ranks find it.
    hosts = list(cfg.hosts)
    if mode == "hostfile":
        loop = all_loopback(hosts)
        bind, advertise, port = ("127.0.0.1" if loop else "0.0.0.0"), \
            ("127.0.0.1" if loop else socket.gethostname()), 0
    elif mode == "tasks":
        # the tasks may run on other hosts than this launcher's, unless nothing says so
        loop = not hosts and cfg.nnodes == 1 and "SLURM_JOB_ID" not in os.environ
        bind, advertise, port = ("127.0.0.1" if loop else "0.0.0.0"), \
            ("127.0.0.1" if loop else socket.getfqdn()), 0
    elif mode == "multi":
        loop = is_loopback(cfg.master_addr)
        bind, advertise, port = ("127.0.0.1" if loop else "0.0.0.0"), cfg.master_addr, \
            cfg.master_port + 1
    else:
        bind, advertise, port = "127.0.0.1", "127.0.0.1", 0
    hosting = not joins_remote and not cfg.no_python
    fixed_endpoint = cfg.control_endpoint
    if mode == "multi" and cfg.node_rank > 0:
        fixed_endpoint = tcp_endpoint(cfg.master_addr, cfg.master_port + 1)

    def make_coordinator(on_event: Any) -> Any:
        from flowtrain.control.coordinator import Coordinator

        if telemetry is None:
            raise RuntimeError("only a launch that hosts the coordinator makes one, and such a "
                               "launch has its telemetry")
        return Coordinator(world_size=cfg.world_size, secret=secret, host=bind, port=port,
                           heartbeat_interval=cfg.heartbeat_interval,
                           heartbeat_misses=cfg.heartbeat_misses, join_timeout=cfg.join_timeout,
                           on_event=on_event, on_telemetry=telemetry.on_record,
                           job_record=telemetry.job_record, encrypt=cfg.encrypt_control,
                           peer_recovery=cfg.peer_recovery)

    def endpoint_for(coordinator: Any) -> str | None:
        if coordinator is None:
            return fixed_endpoint
        if telemetry is None:
            raise RuntimeError("a coordinator runs only in a launch that hosts it, and such a "
                               "launch has its telemetry")
        telemetry.advertise(coordinator, secret)
        return tcp_endpoint(advertise, coordinator.endpoint.rsplit(":", 1)[1])

    def build_children(endpoint: str | None) -> list[Child]:
        if mode == "tasks":
            return [_task_child(cfg, _rank_env(cfg, base_env, rd, 0, endpoint, secret,
                                               rank_console), rd, user_umask)]
        if mode == "hostfile":
            assert endpoint is not None
            exports = remote_exports(os.environ, file_vars)
            children, offset = [], 0
            for node, (host, slots) in enumerate(cfg.hosts.items()):
                command = node_command(cfg, node=node, host=host, slots=slots, rank_offset=offset,
                                       endpoint=endpoint, exports=exports)
                children.append(Child(label=f"node {node} ({host})",
                                      argv=[*cfg.ssh_command, host, command],
                                      env=dict(os.environ), out_path=rd.node_out(node), node=node,
                                      host=host, stdin_data=(secret.hex() + "\n").encode(),
                                      umask=user_umask))
                offset += len(slots)
            return children
        prefix = cfg.world_size > 1
        return [
            Child(label=f"rank {cfg.rank_offset + lr}", argv=_rank_argv(cfg, lr),
                  env=_rank_env(cfg, base_env, rd, lr, endpoint, secret, rank_console),
                  out_path=rd.rank_out(cfg.rank_offset + lr), rank=cfg.rank_offset + lr,
                  host=socket.gethostname(), umask=user_umask,
                  prefix=f"[rank{cfg.rank_offset + lr}]: ".encode() if prefix else b"",
                  echo=cfg.echo_ranks is None or lr in cfg.echo_ranks)
            for lr in range(cfg.nproc_per_node)
        ]

    started = time.time()
    record: dict[str, Any] = {
        "job_id": cfg.job_id, "command": ["flowtrain", *cfg.argv], "cwd": os.getcwd(),
        "mode": mode, "world_size": cfg.world_size, "nnodes": cfg.nnodes,
        "nproc_per_node": cfg.nproc_per_node, "node_rank": cfg.node_rank,
        "hosts": {h: s for h, s in cfg.hosts.items()}, "master_addr": cfg.master_addr,
        "master_port": cfg.master_port, "run_dir": str(rd.path), "start_time": started,
        "end_time": None, "status": "running", "exit_code": None, "root_cause": None, "ranks": [],
        # a later launch marks the job killed when this process is gone and the status stays
        "launcher_pid": os.getpid(), "launcher_host": socket.gethostname(),
    }
    if cfg.core_shares is not None:
        record["cores"] = {str(cfg.rank_offset + lr): cores
                           for lr, cores in enumerate(cfg.core_shares)}
    rd.write_job(record)
    telemetry = _job_telemetry(cfg, rd, started) if hosting else None
    log.info("job starting", console=True, job_id=cfg.job_id, mode=mode, world_size=cfg.world_size,
             nproc_per_node=cfg.nproc_per_node, run_dir=str(rd.path))
    ended: list[Outcome] = []

    def end_telemetry() -> None:
        # On the launcher's loop while the coordinator still serves: job_ended goes out live.
        assert telemetry is not None
        ended.append(collect_outcome(supervisor, rd, started=started,
                                     join_timeout=cfg.join_timeout))
        _close_telemetry(telemetry, ended[0])

    supervisor = Supervisor(grace_period=cfg.grace_period,
                            make_coordinator=make_coordinator if hosting else None,
                            build_children=build_children, endpoint_for=endpoint_for,
                            watch_stdin=cfg.from_parent,
                            progress=telemetry.progress if telemetry else None,
                            on_exit=_exit_reporter(telemetry) if telemetry else None,
                            on_end=end_telemetry if telemetry else None,
                            replacements=cfg.max_restarts if cfg.peer_recovery else None,
                            respawn_delay=cfg.peer_respawn_delay,
                            error_file_of=rd.rank_error)
    supervisor.run()
    if supervisor.start_error:
        record.update(end_time=time.time(), status="failed", exit_code=2, root_cause=None)
        rd.write_job(record)
        if telemetry is not None:
            telemetry.close(status="failed", exit_code=2, message=supervisor.start_error)
        raise LaunchInputError(supervisor.start_error + "; is another job using that port? "
                               "pick another --master-port")
    outcome = ended[0] if ended else collect_outcome(supervisor, rd, started=started,
                                                     join_timeout=cfg.join_timeout)
    # hosts whose node launcher died without reporting back: the host, not a rank, was lost
    lost = [c.host for c in supervisor.children
            if c.node is not None and supervisor.is_failure(c) and not c.node_result]
    record.update(end_time=time.time(), status=outcome.status, exit_code=outcome.exit_code,
                  root_cause=asdict(outcome.root_cause.failure) if outcome.root_cause else None,
                  ranks=outcome.ranks, failures=[asdict(r.failure) for r in outcome.records],
                  lost_hosts=lost)
    if cfg.peer_recovery:
        record["peer_recovery"] = supervisor.peer_events
    rd.write_job(record)
    if telemetry is not None:
        _close_telemetry(telemetry, outcome)  # unless end_telemetry did
    log.info("job ended", console=True, status=outcome.status, exit_code=outcome.exit_code,
             root_cause=record["root_cause"])
    if cfg.trace and not joins_remote:
        _write_trace(rd.path)
    if cfg.from_parent:
        _report_to_parent(outcome)
    else:
        report = format_report(outcome, job_id=cfg.job_id, run_dir=rd.path)
        if report:
            print(report, file=sys.stderr, flush=True)
    return outcome.exit_code


def _job_telemetry(cfg: LaunchConfig, rd: RunDir, started: float) -> JobTelemetry:
    """The recorder and progress line of a launch that hosts the coordinator."""
    from flowtrain.telemetry.launcher import JobTelemetry, ProgressLine

    summary = {"mode": cfg.mode, "script": cfg.target, "args": list(cfg.target_args),
               "nnodes": cfg.nnodes, "nproc_per_node": cfg.nproc_per_node,
               "hosts": list(cfg.hosts), "heartbeat_interval": cfg.heartbeat_interval,
               "heartbeat_misses": cfg.heartbeat_misses}
    progress = None if cfg.from_parent or cfg.quiet else ProgressLine(sys.stdout,
                                                                      cfg.total_steps)
    return JobTelemetry(rd.path, job_id=cfg.job_id, world_size=cfg.world_size,
                        total_steps=cfg.total_steps, config_summary=summary, started=started,
                        progress=progress)


def _close_telemetry(telemetry: Any, outcome: Outcome) -> None:
    telemetry.close(status=outcome.status, exit_code=outcome.exit_code,
                    message=outcome.root_cause.failure.message if outcome.root_cause else None)


def _exit_reporter(telemetry: Any) -> Any:
    def report(child: Child, failure: bool) -> None:
        telemetry.child_exited(child.rank, child.label, child.exit_code, describe_exit(child),
                               failure)

    return report


def _write_trace(run_dir: Path) -> None:
    from flowtrain.telemetry.trace import TraceInputError, write_trace

    try:
        path, summary = write_trace(run_dir)
    except (TraceInputError, OSError) as exc:
        log.warning("no trace written", console=True, reason=str(exc))
        return
    log.info("trace written", console=True, path=str(path), **summary)


def _report_to_parent(outcome: Outcome) -> None:
    """One marker line on stdout that the launcher on the other end of ssh parses."""
    payload = {"failures": [dict(asdict(r.failure), secondary=r.secondary)
                            for r in outcome.records],
               "ranks": outcome.ranks}
    out = sys.stdout.buffer
    out.write(NODE_RESULT_MARKER + json.dumps(payload).encode() + b"\n")
    out.flush()
