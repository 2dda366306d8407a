"""Who is in the job, for the coordinator (a mixin of ``Coordinator``): ranks declared stuck
by their silence, and under ``flowtrain launch --peer-recovery`` the lost members, the
generations of the group and each step's commit vote."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from flowtrain.control.events import (
    CoordinatorEvent,
    RankFailed,
    RankState,
    format_status,
)
from flowtrain.control.events import coordinator_log as _log
from flowtrain.control.protocol import Kind
from flowtrain.errors import RankFailure
from flowtrain.telemetry.schema import event_record


class Membership:
    # Set by Coordinator.__init__; declared for the checks of the methods below.
    members: Any
    generation: int
    peer_recovery: bool
    heartbeat_interval: float
    _joining: Any
    _votes: Any
    _states: dict[int, RankState]
    _send: Callable[[int, str, dict], bool]
    _emit: Callable[[CoordinatorEvent], None]
    _rank_telemetry: Callable[..., None]

    def _check_stalls(self, limit: float) -> None:
        """Names a rank whose main thread has stood still in its own code for longer than
        ``limit`` while a peer has waited that long in a collective: the rank that has not
        reached it (its heartbeats, sent from another thread, still arrive). A barrier is not
        such a wait: scripts park the other ranks in one while a rank works alone."""
        live = [s for s in self._states.values()
                if s.joined and not s.finished and not s.failed and not s.lost]
        waiters = [s for s in live if float(s.status.get("waiting_s") or 0) > limit and
                   "barrier" not in str((s.status.get("pending") or [""])[0])]
        if not waiters:
            return
        waiter = max(waiters, key=lambda s: float(s.status.get("waiting_s") or 0))
        waited = float(waiter.status.get("waiting_s") or 0)
        what = (waiter.status.get("pending") or ["a collective"])[0]
        for state in live:
            st = state.status
            if state is waiter or st.get("pending") or st.get("main_code") != "user" or \
                    float(st.get("main_still_s") or 0) <= limit:
                continue
            message = (f"has not reached the collective rank {waiter.rank} has waited in for "
                       f"{waited:.1f} s ({what}): its main thread has not moved from "
                       f"{st.get('main_where')} for {float(st['main_still_s']):.1f} s")
            self._declare_stuck(state, 0.0, message)

    # ------------------------------------------------------------------ peer recovery

    def member_lost(self, rank: int, reason: str) -> None:
        """--peer-recovery: ``rank`` is gone (its process died, or the launcher killed it as
        stuck). The step in flight is dropped: every pending commit vote is answered "drop",
        and the survivors are told the next generation (RECONFIGURE), which also wakes those
        waiting on a collective with the lost rank."""
        state = self._states[rank]
        state.lost = True
        state.status = {}
        self._joining.discard(rank)
        if rank not in self.members:
            return
        self.members.discard(rank)
        _log().warning("rank lost; the survivors re-form the group", rank=rank, reason=reason,
                       members=sorted(self.members), generation=self.generation + 1)
        self._rank_telemetry(event_record(
            "rank_lost", f"rank {rank} lost ({reason}); {len(self.members)} ranks go on",
            rank=rank, data={"members": sorted(self.members), "generation": self.generation + 1}))
        self._new_generation(f"rank {rank} lost: {reason}", verdicts=True)

    def _release_joiners(self) -> None:
        """Once every member has finished, a replacement still waiting to join has nothing
        to do: it is told so (and exits)."""
        if not self.peer_recovery or not self._joining or \
                not all(self._states[m].finished for m in self.members):
            return
        for waiting in sorted(self._joining):
            if self._states[waiting].joined:
                self._send(waiting, Kind.RECONFIGURE, {
                    "generation": self.generation + 1, "members": [], "join": True,
                    "finished": True, "reason": "the job finished before this rank could join"})
        self._joining.clear()

    def _new_generation(self, reason: str, *, verdicts: bool) -> None:
        """Opens the next generation with the current members: pending votes (if
        ``verdicts``) are answered "drop", and every member gets RECONFIGURE."""
        self.generation += 1
        members = sorted(self.members)
        if verdicts:
            for votes in self._votes.values():
                for voter in votes:
                    if voter in self.members:
                        self._send(voter, Kind.COMMIT_RESULT, {
                            "commit": False, "generation": self.generation, "members": members})
        self._votes.clear()
        for member in members:
            self._send(member, Kind.RECONFIGURE, {"generation": self.generation,
                                                  "members": members, "reason": reason,
                                                  "join": False})

    def _on_commit(self, rank: int, generation: int, step: int, ok: bool) -> None:
        members = sorted(self.members)
        if generation != self.generation or rank not in self.members:
            # a vote of an older generation: its step was dropped when the generation moved on
            self._send(rank, Kind.COMMIT_RESULT, {"commit": False, "generation": self.generation,
                                                  "members": members})
            return
        others = {other: sorted(v) for other, v in self._votes.items() if other != step}
        if others:
            # members of one generation always vote on the same step; this one would wait
            # until the vote times out on the rank
            _log().error("ranks of one generation vote on different steps", rank=rank,
                         step=step, others=others, generation=self.generation)
        votes = self._votes.setdefault(step, {})
        votes[rank] = ok
        if not self.members <= set(votes):
            return
        del self._votes[step]
        if not all(votes[m] for m in self.members):
            # a collective failed without a lost rank: drop the step and re-form the group
            failed = sorted(m for m in self.members if not votes[m])
            self._new_generation(f"step {step} failed on ranks {failed}", verdicts=False)
            for member in self.members:
                self._send(member, Kind.COMMIT_RESULT, {
                    "commit": False, "generation": self.generation, "members": members})
            return
        body: dict[str, Any] = {"commit": True, "generation": self.generation, "members": members}
        joining = sorted(r for r in self._joining if self._states[r].joined)
        if joining:
            # the step is committed on every member; the replacements join after it
            self._joining.clear()
            self.generation += 1
            self.members |= set(joining)
            members = sorted(self.members)
            body.update(generation=self.generation, members=members, joined=joining,
                        step=step + 1)
            _log().warning("replacement ranks enter the group", ranks=joining, members=members,
                           generation=self.generation, after_step=step + 1)
            self._rank_telemetry(event_record(
                "rank_rejoined", f"ranks {joining} joined the group after step {step + 1}",
                data={"members": members, "generation": self.generation}))
            for rank_ in joining:
                self._send(rank_, Kind.RECONFIGURE, {
                    "generation": self.generation, "members": members, "join": True,
                    "joined": joining,
                    "reason": f"replacement joining after step {step + 1}"})
        for member in sorted(self.members - set(joining)):
            self._send(member, Kind.COMMIT_RESULT, body)

    def _declare_stuck(self, state: RankState, silence: float, message: str | None = None
                       ) -> None:
        state.failed = state.stuck = True
        missed = int(silence / self.heartbeat_interval)
        if message is None:
            message = (
                f"no heartbeat for {silence:.1f} s ({missed} missed beats); "
                f"last status: {format_status(state.status)}"
            )
        _log().error("rank is stuck", rank=state.rank, message=message)
        self._rank_telemetry(event_record(
            "rank_stuck", f"rank {state.rank}: {message}", rank=state.rank,
            data={"silence_s": round(silence, 3), "missed_beats": missed,
                  "last_status": dict(state.status), "host": state.host, "pid": state.pid}))
        failure = RankFailure(
            rank=state.rank,
            kind="stuck",
            message=message,
            timestamp=time.time(),
            host=state.host,
            pid=state.pid,
        )
        self._emit(RankFailed(rank=state.rank, failure=failure))
