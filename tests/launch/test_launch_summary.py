"""Root-cause choice: the earliest primary failure, with a peer's broken collective never
outranking the death that broke it."""

from __future__ import annotations

from flowtrain.errors import RankFailure
from flowtrain.launch.summary import Record, choose_root


def _record(rank: int, kind: str, message: str, when: float, traceback: str = "") -> Record:
    return Record(RankFailure(rank=rank, kind=kind, message=message, timestamp=when,
                              traceback=traceback), f"rank {rank}", "test")


def test_peer_connection_error_reported_first_is_not_the_root_cause() -> None:
    peer = _record(0, "exception", "RuntimeError: gloo failed", 10.000,
                   traceback="... pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    death = _record(1, "signal", "killed by SIGKILL", 10.002)
    records = [peer, death]
    assert choose_root(records) is death
    assert peer.secondary


def test_earliest_primary_failure_wins() -> None:
    first = _record(2, "exception", "ValueError: boom", 5.0)
    later = _record(0, "exception", "KeyError: 'x'", 6.0)
    assert choose_root([later, first]) is first


def test_only_peer_losses_still_name_the_earliest() -> None:
    a = _record(1, "exception", "CollectiveTimeout: all_reduce did not finish", 7.0)
    b = _record(0, "exception", "ShmTimeout: ranks [1] did not write", 8.0)
    assert choose_root([b, a]) is a
    assert choose_root([]) is None
