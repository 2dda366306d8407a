"""Peer recovery (``flowtrain launch --peer-recovery``): data-parallel replicas that survive a
lost rank go on without a restart, as torchft's do.

Every optimizer step ends with a commit vote on the control plane (``ControlClient.vote``): the
coordinator answers once every member of the current *generation* voted, and answers "drop" at
once when a member is lost (the launcher saw its process die, or killed it as stuck). A dropped
step is dropped on every survivor (gradients zeroed, the step counter not moved, the optimizer
not stepped), so the script redoes it; the survivors then leave the broken process group and
form a fresh default group among themselves (a new TCPStore hosted by the lowest surviving
rank, its address passed through the coordinator's key/value store). A replacement rank
started later by the launcher does the slow part of its start first (imports, kernel warm-up),
says it is ready (JOIN), and enters the group after the next committed step: the survivors and
it form the next generation's group, and the lowest surviving member broadcasts the weights,
the optimizer's and scheduler's state and the step counters to it (no disk).

Ranks keep their launch rank as their control-plane identity (``RANK``); their rank in the
process group is their index among the sorted members. With fewer replicas each step averages
fewer micro-batches (the global batch shrinks with the group, as torchft's does).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import anyio
import torch.distributed as dist

from flowtrain import env as fenv
from flowtrain.log import get_logger

log = get_logger("flowtrain.peer_recovery")

VOTE_TIMEOUT = 600.0  # seconds a commit vote may wait for the other members (a slow step)
JOIN_TIMEOUT = 600.0  # seconds a replacement waits to be let into the group
GROUP_TIMEOUT = 120.0  # seconds the members of a new group have to meet in its store


def enabled() -> bool:
    """This rank was started with ``flowtrain launch --peer-recovery``."""
    return os.environ.get(fenv.PEER_RECOVERY) == "1"


def joining() -> bool:
    """This rank is a replacement for a lost one."""
    return enabled() and os.environ.get(fenv.PEER_JOIN) == "1"


class PeerGroup:
    """This rank's membership of the data-parallel group, one generation after another."""

    def __init__(self, rank: Any) -> None:
        self.rank = rank  # flowtrain.runtime.rank.Rank
        self.generation = 0
        self.members = list(range(rank.env.world_size))
        # set (on the rank's loop) when a newer generation is announced: a reduce waiting on a
        # collective with a lost member gives up instead of waiting for the backend's timeout
        self.interrupt = asyncio.Event()
        self._announced: dict[str, Any] | None = None
        self._join = threading.Event()
        self.dropped_steps = 0
        # the group rank that holds the training state a replacement takes: the lowest
        # member that is not itself a replacement
        self.source = 0
        control = rank.control
        control.on_reconfigure = self._on_reconfigure
        # a RECONFIGURE that came before this object existed
        early = getattr(control, "last_reconfigure", None)
        if early is not None:
            self._on_reconfigure(early)

    # -- on the rank's loop ------------------------------------------------------------------

    def _on_reconfigure(self, body: dict[str, Any]) -> None:
        generation = int(body.get("generation", 0))
        if generation <= self.generation:
            return
        self._announced = dict(body)
        log.warning("new generation of the group announced", generation=generation,
                    members=body.get("members"), reason=body.get("reason"))
        if body.get("join"):
            self._join.set()
        else:
            self.interrupt.set()

    # -- on the training thread --------------------------------------------------------------

    def should_commit(self, step: int, ok: bool) -> dict[str, Any]:
        """Votes on committing ``step`` (the engine's step counter before it); the verdict."""
        control = self.rank.control
        return dict(self.rank.runtime.call(control.vote, self.generation, step, ok,
                                           VOTE_TIMEOUT, timeout=VOTE_TIMEOUT + 5))

    def wait_to_join(self) -> dict[str, Any]:
        """A replacement: waits until the coordinator lets it into the group; the generation."""
        started = time.monotonic()
        if not self._join.wait(JOIN_TIMEOUT):
            raise TimeoutError(f"rank {self.rank.env.rank} waited {JOIN_TIMEOUT:g} s to join the "
                               f"survivors' group and was not let in")
        body = self._announced or {}
        log.info("let into the group", generation=body.get("generation"),
                 members=body.get("members"), waited_s=round(time.monotonic() - started, 3))
        return body

    def next_generation(self, timeout: float = GROUP_TIMEOUT) -> dict[str, Any]:
        """Waits until the coordinator announces a generation after this one (a member was
        lost); its RECONFIGURE body. TimeoutError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            body = self._announced
            if body is not None and int(body.get("generation", 0)) > self.generation \
                    and not body.get("join"):
                return body
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank.env.rank}: no new generation of the group "
                                   f"announced within {timeout:g} s")
            time.sleep(0.02)

    def superseded(self, generation: int | None = None) -> bool:
        """A generation after this one (or after ``generation``) was announced: a member was
        lost meanwhile."""
        body = self._announced
        after = self.generation if generation is None else generation
        return body is not None and int(body.get("generation", 0)) > after \
            and not body.get("join")

    def broadcast(self, tensor: Any, src: int, what: str) -> None:
        """``dist.broadcast`` on the training thread that gives up (GroupChanged) when a newer
        generation is announced: a member lost during a replacement's state transfer would
        otherwise hold the others in it until the group's timeout."""
        work = dist.broadcast(tensor, src=src, async_op=True)
        deadline = time.monotonic() + GROUP_TIMEOUT
        while not work.is_completed():
            if self.superseded():
                raise GroupChanged(f"{what}: a member of the group was lost")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not finish within {GROUP_TIMEOUT:g} s")
            time.sleep(0.0005)
        work.wait()

    def reform(self, generation: int, members: list[int], joined: list[int] | None = None,
               abandon: bool = False) -> list[int]:
        """Leaves the current default process group (a member may be dead) and forms the
        generation's group of ``members`` (launch ranks) as the new default group;
        ``joined``: the replacements among them, which take the state of ``source``. When
        another member is lost before the group is formed, the coordinator's next generation
        is formed instead, without it (the replacements that are still in it keep joining);
        returns the replacements of the group formed."""
        started = time.monotonic()
        if dist.is_initialized():
            _leave_group(abandon)
        joined = list(joined or ())
        lost: list[int] = []
        while True:
            members = sorted(int(m) for m in members)
            healthy = [m for m in members if m not in set(joined)]
            if joined and not healthy:
                raise RuntimeError(
                    f"generation {generation} of the group has only the replacements {joined}: "
                    f"every member holding the training state was lost (ranks {lost} during "
                    f"the re-form); restart the job from a checkpoint (--max-restarts)")
            try:
                self._form(generation, members)
                break
            except GroupChanged as changed:
                body = self._announced or {}
                gone = sorted(set(members) - {int(m) for m in body.get("members", [])})
                lost += gone
                log.warning("another member was lost while the group re-formed; forming the "
                            "next generation without it", generation=body.get("generation"),
                            lost=gone, members=body.get("members"), waited_on=str(changed))
                generation = int(body["generation"])
                members = [int(m) for m in body["members"]]
                joined = [m for m in joined if m in members]
        self.generation = generation
        self.members = members
        self.source = members.index(healthy[0]) if healthy else 0
        fresh = asyncio.Event()
        if self.superseded():
            fresh.set()  # a newer generation was announced meanwhile: this one is already over
        self.interrupt = fresh
        log.warning("process group re-formed", generation=generation, members=members,
                    group_rank=members.index(self.rank.env.rank), lost_meanwhile=lost,
                    seconds=round(time.monotonic() - started, 3))
        return joined

    def _form(self, generation: int, members: list[int]) -> None:
        """Meets ``members`` in the generation's TCPStore (hosted by the lowest) and builds the
        default process group on it. GroupChanged as soon as a newer generation is announced
        while a member is awaited: a member lost now would never come."""
        me = self.rank.env.rank
        index = members.index(me)
        key = f"flowtrain/peer/{generation}/store"
        deadline = time.monotonic() + GROUP_TIMEOUT
        if index == 0:
            host = self._host()
            store = dist.TCPStore(host, 0, len(members), True, timedelta(seconds=GROUP_TIMEOUT),
                                  wait_for_workers=False)
            self.rank.kv_set(key, f"{host}|{store.port}")
        else:
            address = self.rank.runtime.call(self._address_of_store, key, generation,
                                             timeout=GROUP_TIMEOUT + 5)
            if address is None:
                raise GroupChanged(f"waiting for generation {generation}'s store address")
            host, port = str(address).rsplit("|", 1)
            store = self._connect(host, int(port), len(members), generation, deadline)
        # Every member arrives before the group is built: building it waits for the others
        # holding the GIL (this rank's heartbeats would stop)
        store.add("arrived", 1)
        while store.add("arrived", 0) < len(members):
            if self.superseded(generation):
                raise GroupChanged(f"waiting for every member of {members} to arrive")
            if time.monotonic() > deadline:
                raise TimeoutError(f"generation {generation} of the group: not every member of "
                                   f"{members} arrived within {GROUP_TIMEOUT:g} s")
            time.sleep(0.002)
        dist.init_process_group("gloo", store=store, rank=index, world_size=len(members),
                                timeout=timedelta(seconds=float(
                                    os.environ.get("FLOWTRAIN_COLLECTIVE_TIMEOUT", 600))))

    async def _address_of_store(self, key: str, generation: int) -> Any:
        """On the loop: the value of ``key`` once the lowest member set it, or None when a
        newer generation is announced first."""
        found: dict[str, Any] = {}

        async def get(scope: anyio.CancelScope) -> None:
            try:
                found["value"] = await self.rank.control.kv_get(key, GROUP_TIMEOUT)
            except TimeoutError as exc:
                found["error"] = exc
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(get, tg.cancel_scope)
            while not self.superseded(generation):
                await anyio.sleep(0.02)
            tg.cancel_scope.cancel()
        if "error" in found:
            raise found["error"]
        return found.get("value")

    def _connect(self, host: str, port: int, size: int, generation: int,
                 deadline: float) -> Any:
        """A client of the generation's TCPStore, trying again (a second at a time) until the
        deadline; GroupChanged when a newer generation is announced meanwhile (the store's
        host may have been lost after it published the address)."""
        while True:
            try:
                store = dist.TCPStore(host, port, size, False, timedelta(seconds=1))
            except (RuntimeError, TimeoutError, OSError) as exc:
                if self.superseded(generation):
                    raise GroupChanged(f"connecting to generation {generation}'s store") from exc
                if time.monotonic() > deadline:
                    raise TimeoutError(f"generation {generation} of the group: could not reach "
                                       f"its store at {host}:{port} within {GROUP_TIMEOUT:g} s"
                                       ) from exc
                continue
            store.set_timeout(timedelta(seconds=GROUP_TIMEOUT))
            return store

    def _host(self) -> str:
        addr = self.rank.env.master_addr
        from flowtrain.netaddr import is_loopback

        return addr if is_loopback(addr) else socket.getfqdn()


def _leave_group(abandon: bool = False) -> None:
    """Destroys the default process group; or, with ``abandon``, drops it without shutting it
    down (kept referenced, never destroyed): a collective of it may be stuck on a member that
    gave up on it, and destroying (or torch's _abort_process_group) would wait for that work
    holding the GIL."""
    if not abandon:
        dist.destroy_process_group()
        return
    from torch.distributed import distributed_c10d as c10d

    _abandoned.append(c10d._get_default_group())
    world = c10d._world
    c10d._update_default_pg(None)
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config,
                  world.pg_to_tag, world.tags_to_pg, world.pg_coalesce_state):
        table.clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0


_abandoned: list[Any] = []  # process groups left behind with work stuck in them


class GroupChanged(RuntimeError):
    """A newer generation of the group was announced while this rank waited on the current
    one."""


_group: PeerGroup | None = None
_lock = threading.Lock()


def group() -> PeerGroup:
    """The process's PeerGroup (made on first use; starts the rank)."""
    global _group
    from flowtrain.runtime.rank import current_rank

    with _lock:
        if _group is None:
            _group = PeerGroup(current_rank())
        return _group


def join_distributed(prepare: Callable[[], None] | None = None) -> None:
    """A replacement rank's ``init_distributed``: joins the survivors' group when the
    coordinator lets it in (after their next committed step). Exits the process (code 0) when
    the job finished before that. ``prepare`` runs first: the slow part of a rank's start that
    needs no group (``flowtrain.launch.warmup.prepare``), since the survivors wait for the
    replacement from the moment it asks to join."""
    if prepare is not None:
        prepare()
    peers = group()
    peers.rank.runtime.call(peers.rank.control.request_join)
    body = peers.wait_to_join()
    if body.get("finished"):
        log.warning("the job finished before this replacement could join; nothing to do")
        raise SystemExit(0)
    peers.reform(int(body["generation"]), [int(m) for m in body["members"]],
                 [int(m) for m in body.get("joined", [])])


def current() -> PeerGroup | None:
    """The process's PeerGroup, if one was made (never makes one)."""
    return _group


def state_source() -> int:
    """The group rank a model broadcast comes from: 0, or under --peer-recovery the lowest
    member that is not a replacement."""
    return _group.source if _group is not None else 0
