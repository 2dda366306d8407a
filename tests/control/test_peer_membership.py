"""The coordinator's side of --peer-recovery, with clients in this process: a step's commit
vote waits for every member, a lost member drops the pending votes and announces the next
generation to the survivors, a vote of an older generation is dropped at once, and a
replacement's HELLO lets it into the group after the next committed step (or, when every
member has finished, tells it there is nothing left to join)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from test_control_plane import coordinator_running, start_client

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]


async def _clients(tg: Any, coordinator: Any, world: int
                   ) -> tuple[list[Any], list[list[dict]], list[anyio.CancelScope]]:
    clients, announced, scopes = [], [], []
    for rank in range(world):
        client, scope = await start_client(tg, coordinator, rank, world)
        seen: list[dict] = []
        client.on_reconfigure = seen.append
        clients.append(client)
        announced.append(seen)
        scopes.append(scope)
    return clients, announced, scopes


async def test_a_vote_commits_once_every_member_voted() -> None:
    async with coordinator_running(2, peer_recovery=True) as (coordinator, _, tg):
        clients, _, _ = await _clients(tg, coordinator, 2)
        verdicts: dict[int, dict] = {}

        async def vote(rank: int) -> None:
            verdicts[rank] = await clients[rank].vote(0, 0, True, timeout=5)

        async with anyio.create_task_group() as votes:
            votes.start_soon(vote, 0)
            await anyio.sleep(0.2)
            assert verdicts == {}  # rank 1 has not voted
            votes.start_soon(vote, 1)
        assert all(v["commit"] and v["generation"] == 0 for v in verdicts.values())
        assert verdicts[0]["members"] == [0, 1]


async def test_a_lost_member_drops_the_step_and_announces_the_survivors() -> None:
    async with coordinator_running(3, peer_recovery=True) as (coordinator, _, tg):
        clients, announced, _ = await _clients(tg, coordinator, 3)
        verdicts: dict[int, dict] = {}

        async def vote(rank: int) -> None:
            verdicts[rank] = await clients[rank].vote(0, 7, True, timeout=5)

        async with anyio.create_task_group() as votes:
            votes.start_soon(vote, 0)
            await anyio.sleep(0.1)
            coordinator.member_lost(2, "killed by SIGKILL")
        assert verdicts[0] == {"commit": False, "generation": 1, "members": [0, 1]}
        await anyio.sleep(0.1)
        assert [a["members"] for a in announced[0]] == [[0, 1]]
        assert announced[1][0]["generation"] == 1 and not announced[1][0]["join"]
        assert announced[2] == []
        # rank 1 votes on the dropped step under the old generation: dropped at once
        late = await clients[1].vote(0, 7, True, timeout=5)
        assert late["commit"] is False and late["generation"] == 1


async def test_a_replacement_joins_after_the_next_committed_step() -> None:
    async with coordinator_running(2, peer_recovery=True) as (coordinator, _, tg):
        clients, _, scopes = await _clients(tg, coordinator, 2)
        scopes[1].cancel()  # the process of rank 1 dies
        coordinator.member_lost(1, "killed by SIGKILL")
        await anyio.sleep(0.1)
        replacement, _ = await start_client(tg, coordinator, 1, 2)
        # connected but not ready: a step commits without it
        verdict = await clients[0].vote(1, 3, True, timeout=5)
        assert verdict["commit"] is True and "joined" not in verdict
        await replacement.request_join()
        await anyio.sleep(0.1)
        assert replacement.last_reconfigure is None  # let in only at a step boundary
        verdict = await clients[0].vote(1, 4, True, timeout=5)
        assert verdict["commit"] is True
        assert verdict["joined"] == [1] and verdict["members"] == [0, 1]
        assert verdict["generation"] == 2 and verdict["step"] == 5
        await anyio.sleep(0.1)
        assert replacement.last_reconfigure is not None
        assert replacement.last_reconfigure["join"] is True
        assert replacement.last_reconfigure["generation"] == 2


async def test_a_replacement_after_the_end_is_told_to_go() -> None:
    async with coordinator_running(2, peer_recovery=True) as (coordinator, _, tg):
        clients, _, scopes = await _clients(tg, coordinator, 2)
        scopes[1].cancel()
        coordinator.member_lost(1, "killed by SIGKILL")
        await clients[0].close()
        await anyio.sleep(0.1)
        replacement, _ = await start_client(tg, coordinator, 1, 2)
        await replacement.request_join()
        await anyio.sleep(0.2)
        assert replacement.last_reconfigure is not None
        assert replacement.last_reconfigure["finished"] is True


def _launch_config(*flags: str, tmp_path: Any) -> Any:
    import argparse

    from flowtrain.launch.args import add_launch_arguments, resolve

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    argv = [*flags, str(script)]
    return resolve(parser.parse_args(argv), argv)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_launcher_flags(tmp_path: Any, anyio_backend: str) -> None:
    from flowtrain.launch.hostfile import LaunchInputError

    cfg = _launch_config("--nproc-per-node", "3", "--peer-recovery", "--max-restarts", "2",
                         "--peer-respawn-delay", "1.5", tmp_path=tmp_path)
    assert cfg.peer_recovery and cfg.max_restarts == 2 and cfg.peer_respawn_delay == 1.5
    assert not _launch_config(tmp_path=tmp_path).peer_recovery
    with pytest.raises(LaunchInputError, match="one node"):
        _launch_config("--peer-recovery", "--nnodes", "2", "--master-addr", "127.0.0.1",
                       "--master-port", "29911", tmp_path=tmp_path)
    with pytest.raises(LaunchInputError, match="--peer-respawn-delay"):
        _launch_config("--peer-recovery", "--peer-respawn-delay", "-1", tmp_path=tmp_path)
