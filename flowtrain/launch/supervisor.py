"""Supervises a launch's child processes (ranks, or node launchers over ssh) torchelastic-style:
all succeed, or the first failure tears everything down (SIGTERM, grace period, SIGKILL)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import anyio
import anyio.from_thread
import anyio.lowlevel

from flowtrain.log import get_logger

log = get_logger("flowtrain.launch")

ABORTED_EXIT = 143  # a rank that ended because it was told to (see bootstrap)
NODE_RESULT_MARKER = b"@@flowtrain-node-result@@ "
KILL_WAIT = 5.0  # seconds to wait for exits after SIGKILL before giving up on a process


@dataclass
class Child:
    """One supervised process: a rank, or a node launcher (``node`` set) reached over ssh."""

    label: str  # "rank 1", "node 1 (host-b)"
    argv: list[str]
    env: dict[str, str]
    out_path: Path
    rank: int | None = None
    node: int | None = None
    host: str = ""
    prefix: bytes = b""
    echo: bool = True  # its output on the console too (always in its file)
    stdin_data: bytes | None = None  # written to stdin, which then stays open (node launchers)
    umask: int = -1  # the child's umask; -1: the launcher's
    proc: subprocess.Popen[bytes] | None = None
    pid: int = 0
    exit_code: int | None = None
    exit_time: float = 0.0
    signalled: str | None = None  # name of the last signal the launcher sent
    spawn_error: str | None = None
    node_result: dict[str, Any] | None = None
    threads: list[threading.Thread] = field(default_factory=list)
    out_file: BinaryIO | None = None
    failed: bool = False  # its exit counts as a failure (set when the exit is seen)
    lost: bool = False  # --peer-recovery: the job went on without it

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.exit_code is None


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class Supervisor:
    """Runs children and a coordinator (optional) in one anyio loop until the job ends."""

    def __init__(self, *, grace_period: float,
                 make_coordinator: Callable[[Callable[[Any], None]], Any] | None,
                 build_children: Callable[[str | None], list[Child]],
                 endpoint_for: Callable[[Any], str | None], watch_stdin: bool = False,
                 progress: Any = None,
                 on_exit: Callable[[Child, bool], None] | None = None,
                 on_end: Callable[[], None] | None = None,
                 replacements: int | None = None, respawn_delay: float = 0.0,
                 error_file_of: Callable[[int], Path] | None = None) -> None:
        self.grace_period = grace_period
        # flowtrain.telemetry.launcher.ProgressLine: rank output is written inside its hold()
        self.progress = progress
        self.on_exit = on_exit  # told of every child's exit and whether it is a failure
        # Called on the loop once every child has exited and its output is read, while the
        # coordinator still serves: the job's outcome is known and can still be published.
        self.on_end = on_end
        self.make_coordinator = make_coordinator
        # --peer-recovery (replacements not None): a lost rank does not end the job while a
        # rank remains; the coordinator re-forms the group and up to ``replacements``
        # replacement ranks are started, each ``respawn_delay`` s after a loss
        self.replacements = replacements
        self.respawn_delay = respawn_delay
        self.error_file_of = error_file_of
        self.peer_events: list[dict[str, Any]] = []  # losses and replacements, for job.json
        self.build_children = build_children
        self.endpoint_for = endpoint_for
        self.watch_stdin = watch_stdin
        self.children: list[Child] = []
        self.coordinator: Any = None
        self.coordinator_events: list[tuple[float, Any]] = []
        self.teardown_reason: str | None = None
        self.teardown_time: float | None = None
        self.interrupted: int | None = None  # the signal that stopped the launcher itself
        self.parent_lost = False
        self.start_error: str | None = None  # set when the job could not start at all
        self._out_lock = threading.Lock()
        self._send: Any = None
        self._token: Any = None
        self._all_exited: anyio.Event | None = None

    # ------------------------------------------------------------------ entry point

    def run(self) -> None:
        try:
            anyio.run(self._main, backend="asyncio")
        finally:
            # Whatever happened above, no child outlives the launcher.
            for child in self.children:
                if child.alive:
                    self._signal(child, signal.SIGKILL)
            for child in self.children:
                # Pipes close when the process and anything it started are gone; a grandchild
                # that keeps them open must not hold the launcher.
                for t in child.threads:
                    t.join(timeout=2.0)
                if child.out_file is not None and not any(t.is_alive() for t in child.threads):
                    child.out_file.close()

    async def _main(self) -> None:
        self._token = anyio.lowlevel.current_token()
        self._all_exited = anyio.Event()
        send, receive = anyio.create_memory_object_stream[tuple[str, Any]](max_buffer_size=4096)
        self._send = send
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_signals)
            if self.make_coordinator is not None:
                self.coordinator = self.make_coordinator(self._on_coordinator_event)
                try:
                    with anyio.fail_after(30):
                        await tg.start(self.coordinator.serve)
                except Exception as exc:  # a taken port, an unknown address: say so and stop
                    self.start_error = (f"cannot start the coordinator on {self.coordinator.host}:"
                                        f"{self.coordinator.port or 'any port'}: {exc}")
                    tg.cancel_scope.cancel()
                    return
            self.children = self.build_children(self.endpoint_for(self.coordinator))
            for child in self.children:
                self._spawn(child)
            if self.watch_stdin:
                threading.Thread(target=self._stdin_watch, daemon=True,
                                 name="flowtrain-parent-watch").start()
            for child in self.children:
                if child.spawn_error is not None:
                    self._on_exit(child, 127, time.time())
            async with receive:
                await self._supervise(receive, tg)
            if self.on_end is not None:
                await anyio.to_thread.run_sync(self._join_output)
                try:
                    self.on_end()
                except Exception:  # telemetry must not keep the launcher from ending
                    log.exception("on_end callback raised")
            tg.cancel_scope.cancel()

    def _join_output(self) -> None:
        """Waits (bounded) until the children's output is read to its end, where a node
        launcher's result line comes."""
        for child in self.children:
            for t in child.threads:
                t.join(timeout=2.0)

    # ------------------------------------------------------------------ processes

    def _spawn(self, child: Child) -> None:
        child.out_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            child.proc = subprocess.Popen(
                child.argv, env=child.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                stdin=subprocess.PIPE if child.stdin_data is not None else subprocess.DEVNULL,
                # Own session: Ctrl-C reaches only the launcher, which tears down in order, and
                # killpg also reaches whatever the rank started (data loader workers).
                start_new_session=True, umask=child.umask,
            )
        except OSError as exc:
            child.spawn_error = f"could not start {child.argv[0]!r}: {exc.strerror or exc}"
            log.error("spawn failed", child=child.label, error=child.spawn_error)
            return
        child.pid = child.proc.pid
        log.info("started", child=child.label, pid=child.pid, host=child.host or None)
        if child.stdin_data is not None and child.proc.stdin is not None:
            try:
                child.proc.stdin.write(child.stdin_data)
                child.proc.stdin.flush()
            except OSError:
                pass  # it died already; its exit is reported below
        out_file = child.out_file = open(child.out_path, "ab")
        file_lock = threading.Lock()
        assert child.proc.stdout is not None and child.proc.stderr is not None
        for stream, sink in ((child.proc.stdout, sys.stdout), (child.proc.stderr, sys.stderr)):
            t = threading.Thread(target=self._pump, args=(child, stream, sink, out_file, file_lock),
                                 daemon=True, name=f"flowtrain-pump-{child.label}")
            t.start()
            child.threads.append(t)
        threading.Thread(target=self._wait_exit, args=(child,), daemon=True,
                         name=f"flowtrain-wait-{child.label}").start()

    def _pump(self, child: Child, stream: BinaryIO, sink: Any, out_file: BinaryIO,
              file_lock: threading.Lock) -> None:
        """Copies one pipe line by line, continuously, so a chatty rank never blocks on a full
        pipe, even when the launcher's own stdout or the output file stops accepting data."""
        sink_ok = file_ok = True
        try:
            for line in iter(stream.readline, b""):
                if line.startswith(NODE_RESULT_MARKER):
                    try:
                        child.node_result = json.loads(line[len(NODE_RESULT_MARKER):])
                    except ValueError:
                        pass
                    continue
                if file_ok:
                    try:
                        with file_lock:
                            out_file.write(line)
                            out_file.flush()
                    except (OSError, ValueError):
                        file_ok = False  # disk full or closed: keep draining the pipe
                if sink_ok and child.echo:
                    data = child.prefix + line if child.prefix else line
                    try:
                        with self._out_lock, self._holding_progress():
                            buffer = getattr(sink, "buffer", None)
                            if buffer is not None:
                                buffer.write(data)
                            else:
                                sink.write(data.decode("utf-8", "replace"))
                            sink.flush()
                    except (OSError, ValueError):
                        sink_ok = False  # e.g. `flowtrain launch ... | head`: keep draining
        except (OSError, ValueError):
            pass
        finally:
            stream.close()

    def _holding_progress(self) -> Any:
        return self.progress.hold() if self.progress is not None else contextlib.nullcontext()

    def _wait_exit(self, child: Child) -> None:
        assert child.proc is not None
        code = child.proc.wait()
        when = time.time()  # taken at once: exit times order the root causes
        try:
            anyio.from_thread.run_sync(self._on_exit, child, code, when, token=self._token)
        except Exception:  # the loop has ended; the finally in run() cleans up
            pass

    def _signal(self, child: Child, sig: int) -> None:
        if not child.alive or child.proc is None:
            return
        if sig != signal.SIGCONT:
            child.signalled = signal_name(sig)
        try:
            os.killpg(child.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                child.proc.send_signal(sig)
            except (ProcessLookupError, OSError):
                pass

    # ------------------------------------------------------------------ events

    def _post(self, kind: str, payload: Any) -> None:
        try:
            self._send.send_nowait((kind, payload))
        except anyio.WouldBlock:
            log.warning("event queue full; dropped an event", kind=kind)

    def _on_coordinator_event(self, event: Any) -> None:
        self.coordinator_events.append((time.time(), event))
        self._post("coordinator", event)

    def _on_exit(self, child: Child, code: int, when: float) -> None:
        child.exit_code, child.exit_time = code, when
        child.failed = self._classify(child)
        self._post("exit", child)

    def _stdin_watch(self) -> None:
        try:
            # os.read, not sys.stdin: a daemon thread inside a buffered reader's lock aborts the
            # interpreter at shutdown.
            while os.read(sys.stdin.fileno(), 4096):
                pass
        except (OSError, ValueError):
            pass
        try:
            anyio.from_thread.run_sync(self._post, "parent", None, token=self._token)
        except Exception:
            pass

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
            async for signum in signals:
                self._post("signal", int(signum))

    def is_failure(self, child: Child) -> bool:
        """An exit is a failure unless it succeeded or the launcher caused it (decided at exit)."""
        return child.failed

    def _classify(self, child: Child) -> bool:
        code = child.exit_code
        if code == 0 or code is None:
            return False
        if child.signalled is not None:
            # the launcher signalled it first: teardown, not a new failure; unless it died of
            # a SIGKILL the launcher never sent, which came from outside (the OOM killer, a
            # user) and may only have been reaped after the teardown began, because a peer
            # whose collective broke on its death reported first
            return code == -signal.SIGKILL and child.signalled != "SIGKILL"
        if self.teardown_time is not None and code == ABORTED_EXIT:
            return False  # told to stop through the control plane after the failure
        return True

    async def _supervise(self, receive: Any, tg: Any) -> None:
        from flowtrain.control.coordinator import JoinTimeout, RankFailed

        assert self._all_exited is not None
        while True:
            if self.children and all(c.proc is None or c.exit_code is not None
                                     for c in self.children):
                self._all_exited.set()
                return
            kind, payload = await receive.receive()
            if kind == "exit":
                child: Child = payload
                log.info("exited", child=child.label, pid=child.pid, exit_code=child.exit_code,
                         failure=self.is_failure(child))
                if self.on_exit is not None:
                    try:
                        self.on_exit(child, self.is_failure(child))
                    except Exception:  # telemetry must not break supervision
                        log.exception("on_exit callback raised", child=child.label)
                if self.is_failure(child) or child.lost:
                    reason = f"{child.label} {describe_exit(child)}"
                    if not self._recover(child, reason, tg):
                        tg.start_soon(self._teardown, reason)
            elif kind == "coordinator":
                if isinstance(payload, RankFailed):
                    reason = f"rank {payload.rank} failed: {payload.failure.message}"
                    lost = self._live_rank(payload.rank)
                    if self.replacements is not None and lost is not None and \
                            self.teardown_time is None and self._survivors(lost):
                        # stuck or failing: end it; its exit hands it to _recover
                        lost.lost = True
                        self._signal(lost, signal.SIGKILL)
                        self._forget_failure(payload.rank)
                    else:
                        tg.start_soon(self._teardown, reason)
                elif isinstance(payload, JoinTimeout):
                    tg.start_soon(self._teardown, f"ranks {payload.missing} did not join in time")
            elif kind == "signal":
                if self.interrupted is None:
                    self.interrupted = payload
                    tg.start_soon(self._teardown, f"the launcher received {signal_name(payload)}")
                else:
                    # A second Ctrl-C: the user does not want to wait for the grace period.
                    for c in self.children:
                        self._signal(c, signal.SIGKILL)
            elif kind == "parent":
                self.parent_lost = True
                tg.start_soon(self._teardown, "lost the launcher that started this node")

    # ------------------------------------------------------------------ peer recovery

    def _live_rank(self, rank: int) -> Child | None:
        for child in self.children:
            if child.rank == rank and child.alive:
                return child
        return None

    def _survivors(self, lost: Child) -> list[Child]:
        return [c for c in self.children if c.rank is not None and c is not lost and c.alive
                and not c.lost]

    def _forget_failure(self, rank: int) -> None:
        """A lost rank the job goes on without is not the job's failure: its coordinator
        failure record and error file are set aside (the latter as rank<N>.lost<k>.json)."""
        from flowtrain.control.coordinator import RankFailed

        self.coordinator_events = [(w, e) for w, e in self.coordinator_events
                                   if not (isinstance(e, RankFailed) and e.rank == rank)]
        if self.error_file_of is not None:
            path = self.error_file_of(rank)
            if path.exists():
                with contextlib.suppress(OSError):
                    path.replace(path.with_name(f"{path.stem}.lost{len(self.peer_events)}.json"))

    def _recover(self, child: Child, reason: str, tg: Any) -> bool:
        """--peer-recovery: goes on without ``child`` (a rank that died or was killed as lost)
        when ranks remain; starts its replacement while the budget lasts. False: the job ends."""
        if self.replacements is None or child.rank is None or self.teardown_time is not None \
                or self.coordinator is None:
            return False
        survivors = self._survivors(child)
        if not survivors:
            return False
        child.lost, child.failed = True, False
        self._forget_failure(child.rank)
        self.coordinator.member_lost(child.rank, describe_exit(child))
        replace = self.replacements > 0
        self.peer_events.append({"time": time.time(), "event": "rank_lost", "rank": child.rank,
                                 "pid": child.pid, "reason": reason,
                                 "survivors": sorted(c.rank for c in survivors
                                                     if c.rank is not None),
                                 "replacement": replace})
        log.warning("rank lost; the others go on without a restart" +
                    ("; starting a replacement" if replace else ""), console=True,
                    rank=child.rank, reason=reason)
        if replace:
            self.replacements -= 1
            tg.start_soon(self._replace, child)
        return True

    async def _replace(self, lost: Child) -> None:
        await anyio.sleep(self.respawn_delay)
        if self.teardown_time is not None or not any(
                c.alive for c in self.children if c.rank is not None):
            return
        from flowtrain import env as fenv

        env = dict(lost.env)
        env[fenv.PEER_JOIN] = "1"
        child = Child(label=lost.label, argv=list(lost.argv), env=env, out_path=lost.out_path,
                      rank=lost.rank, host=lost.host, prefix=lost.prefix, echo=lost.echo,
                      umask=lost.umask)
        self.children.append(child)
        self._spawn(child)
        self.peer_events.append({"time": time.time(), "event": "replacement_started",
                                 "rank": lost.rank, "pid": child.pid})
        if child.spawn_error is not None:
            self._on_exit(child, 127, time.time())

    async def _teardown(self, reason: str) -> None:
        if self.teardown_time is not None:
            return
        self.teardown_time = time.time()
        self.teardown_reason = reason
        assert self._all_exited is not None
        log.error("tearing the job down", reason=reason)
        if self.coordinator is not None:
            with anyio.move_on_after(2.0):
                await self.coordinator.abort(reason)
        for child in self.children:
            if child.alive:
                self._signal(child, signal.SIGTERM)
                # A stopped (SIGSTOP) process only acts on SIGTERM once it runs again.
                self._signal(child, signal.SIGCONT)
        # Node launchers run their own teardown with the same grace period: give them longer.
        grace = self.grace_period + (5.0 if any(c.node is not None for c in self.children) else 0.0)
        with anyio.move_on_after(grace):
            await self._all_exited.wait()
        for child in self.children:
            if child.alive:
                log.warning("still running after the grace period; killing", child=child.label,
                            pid=child.pid, grace_s=grace)
                self._signal(child, signal.SIGKILL)
        with anyio.move_on_after(KILL_WAIT):
            await self._all_exited.wait()
        if any(c.alive for c in self.children):
            log.error("processes survived SIGKILL",
                      children=[c.label for c in self.children if c.alive])
            self._send.send_nowait(("gave-up", None))
            for child in self.children:
                if child.exit_code is None:
                    child.exit_code = -signal.SIGKILL


def describe_exit(child: Child) -> str:
    """How a child ended, in words: 'exited with code 1', 'killed by SIGKILL', ..."""
    code = child.exit_code
    if child.spawn_error:
        return child.spawn_error
    if code is None:
        return "is still running"
    if code == 0:
        return "finished (exit code 0)"
    if code < 0:
        name = signal_name(-code)
        if child.signalled == name:
            return f"terminated by the launcher ({name})"
        return f"killed by {name}"
    if code == ABORTED_EXIT:
        return f"aborted (exit code {code})"
    return f"exited with code {code}"
