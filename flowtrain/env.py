"""Names of the environment variables a launcher hands to each rank, and typed readers for them."""

from __future__ import annotations

import os
from dataclasses import dataclass

# torchrun's variables, which flowtrain sets the same way.
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"  # the node's index, as torchrun names it
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"

# flowtrain's own.
CONTROL_ENDPOINT = "FLOWTRAIN_CONTROL_ENDPOINT"  # tcp://host:port of the coordinator's ROUTER
JOB_SECRET = "FLOWTRAIN_JOB_SECRET"  # hex; signs every control frame
JOB_ID = "FLOWTRAIN_JOB_ID"
RUN_DIR = "FLOWTRAIN_RUN_DIR"
ERROR_FILE = "FLOWTRAIN_ERROR_FILE"  # where this rank writes its failure as JSON
HEARTBEAT_INTERVAL = "FLOWTRAIN_HEARTBEAT_INTERVAL"  # seconds between beats, both ways
HEARTBEAT_MISSES = "FLOWTRAIN_HEARTBEAT_MISSES"  # beats missed before a peer is declared lost
CONSOLE = "FLOWTRAIN_CONSOLE"  # "human" on a terminal, "plain" otherwise, "off" for none
LOG_LEVEL = "FLOWTRAIN_LOG_LEVEL"  # the lowest level logged: debug, info, warning, error
LAUNCHED = "FLOWTRAIN_LAUNCHED"  # "1" when flowtrain launch started this process
CONTROL_CURVE = "FLOWTRAIN_CONTROL_CURVE"  # "1": the control plane is CurveZMQ-encrypted
# set: the shared-memory channel polls its flags instead of sleeping on them (futex)
SHM_POLL = "FLOWTRAIN_SHM_POLL"

# the world size of a restarted job's first attempt (flowtrain launch --max-restarts): after an
# elastic shrink the config loader keeps that attempt's global batch
FIRST_WORLD_SIZE = "FLOWTRAIN_FIRST_WORLD_SIZE"
# flowtrain launch --peer-recovery: "1" in every rank (survivors of a lost rank re-form the
# process group and go on without a restart); PEER_JOIN "1" in a replacement rank the launcher
# started for a lost one (it joins the survivors' group and takes a healthy peer's state)
PEER_RECOVERY = "FLOWTRAIN_PEER_RECOVERY"
PEER_JOIN = "FLOWTRAIN_PEER_JOIN"
DEFAULT_HEARTBEAT_INTERVAL = 1.0
DEFAULT_HEARTBEAT_MISSES = 5


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be greater than 0")
    return value


def _int(name: str, default: int, minimum: int = 0) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r} must be at least {minimum}")
    return value


@dataclass(frozen=True)
class RankEnv:
    """What a rank process knows about its place in the job, read from its environment."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    control_endpoint: str | None
    job_secret: bytes | None
    job_id: str | None
    run_dir: str | None
    error_file: str | None
    heartbeat_interval: float
    heartbeat_misses: int
    console: str
    control_curve: bool = False  # the control plane's sockets encrypt (CurveZMQ)

    @property
    def launched(self) -> bool:
        """True when flowtrain launch (not torchrun or SLURM) started this rank."""
        return self.control_endpoint is not None


def read_rank_env() -> RankEnv:
    """Reads the rank's environment; a job of one process when nothing is set."""
    secret_hex = os.environ.get(JOB_SECRET)
    try:
        secret = bytes.fromhex(secret_hex) if secret_hex else None
    except ValueError:
        raise ValueError(f"{JOB_SECRET} must be hex digits, got {len(secret_hex or '')} "
                         "characters that are not") from None
    world_size = _int(WORLD_SIZE, 1, minimum=1)
    rank = _int(RANK, 0)
    if rank >= world_size:
        raise ValueError(f"{RANK}={rank} must be below {WORLD_SIZE}={world_size}")
    return RankEnv(
        rank=rank,
        local_rank=_int(LOCAL_RANK, 0),
        world_size=world_size,
        local_world_size=_int(LOCAL_WORLD_SIZE, 1, minimum=1),
        node_rank=_int(GROUP_RANK, 0),
        master_addr=os.environ.get(MASTER_ADDR, "127.0.0.1"),
        master_port=_int(MASTER_PORT, 29500, minimum=1),
        control_endpoint=os.environ.get(CONTROL_ENDPOINT) or None,
        job_secret=secret,
        job_id=os.environ.get(JOB_ID) or None,
        run_dir=os.environ.get(RUN_DIR) or None,
        error_file=os.environ.get(ERROR_FILE) or None,
        heartbeat_interval=_float(HEARTBEAT_INTERVAL, DEFAULT_HEARTBEAT_INTERVAL),
        heartbeat_misses=_int(HEARTBEAT_MISSES, DEFAULT_HEARTBEAT_MISSES, minimum=1),
        console=os.environ.get(CONSOLE, "plain"),
        control_curve=os.environ.get(CONTROL_CURVE) == "1",
    )
