"""`flowtrain launch --peer-recovery` with real processes: ZeRO-0 on 3 ranks, one rank SIGKILLed
(or frozen) after step 10. The survivors (same processes) drop the step in flight, re-form the
group and go on within seconds; the launcher's replacement joins some steps later with the
survivors' weights and optimizer state bit for bit; every rank ends with the same weights;
every survivor records steps 1..N once each; and each committed step's losses match a
single-process reference that averages the gradients of the same members on the same data."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from helpers import DATA, launch, rank_results

WORKER = DATA / "peer_recovery_worker.py"
# from step WAIT_FROM on, survivors short of a member wait for the replacement (started 1 s
# after the loss; a new Python importing torch takes some seconds more) to ask to join
STEPS, KILL_AT, WAIT_FROM = 24, 10, 12
SLEEP_S = "0.05"  # per step


def _records(out: Path) -> dict[int, list[tuple[int, list[dict[str, Any]]]]]:
    """Per launch rank: (pid, records) for each process, in start order."""
    found: dict[int, list[tuple[int, list[dict[str, Any]]]]] = defaultdict(list)
    for path in out.parent.glob(f"{out.name}.rank*.pid*.jsonl"):
        rank = int(path.name.split(".rank")[1].split(".")[0])
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        found[rank].append((int(lines[0]["pid"]), lines))
    for procs in found.values():
        procs.sort(key=lambda p: p[1][0]["t"])
    return found


def _reference_losses(members_by_step: dict[int, list[int]]) -> dict[tuple[int, int], float]:
    """(step, launch rank) -> loss, training in one process: each step averages the
    gradients of that step's members on their batches, as the group's all-reduce does."""
    sys.path.insert(0, str(DATA))
    try:
        from peer_recovery_worker import batch, make_model
    finally:
        sys.path.remove(str(DATA))
    from flowtrain.optimizers import build_optimizer

    model = make_model()
    optimizer = build_optimizer("AdamW", model.parameters(), {"lr": 1e-2})
    losses: dict[tuple[int, int], float] = {}
    for step in range(1, STEPS + 1):
        members = members_by_step[step]
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for rank in members:
            model.zero_grad()
            x, y = batch(step - 1, rank)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            losses[(step, rank)] = float(loss.detach())
            for g, p in zip(grads, model.parameters()):
                g += p.grad
        for g, p in zip(grads, model.parameters()):
            p.grad = g / len(members)
        optimizer.step()
    return losses


def _assert_losses_match(procs: dict[int, list[tuple[int, list[dict[str, Any]]]]],
                         members: dict[int, list[int]], rel: float = 1e-5) -> None:
    """Every committed step's loss of every process equals the single-process reference's."""
    reference = _reference_losses(members)
    for rank, runs in procs.items():
        for _, records in runs:
            for r in records:
                if r["event"] == "step":
                    assert r["loss"] == pytest.approx(reference[(r["step"], rank)], rel=rel,
                                                      abs=1e-6), (rank, r["step"])


def _launch_with_a_loss(tmp_path: Path, killed: int, how: str, *more: str,
                        ) -> dict[int, list[tuple[int, list[dict[str, Any]]]]]:
    """Three ranks under --peer-recovery (one replacement, started 1 s after the loss), rank
    ``killed`` lost after step KILL_AT; checks that each survivor is the process it started
    as and recorded steps 1..N once each; returns the records."""
    out = tmp_path / "out"
    launch(3, WORKER, str(out), str(STEPS), str(KILL_AT), str(killed), SLEEP_S, how,
           str(WAIT_FROM), *more, run_dir=tmp_path / "run", timeout=110,
           extra=["--peer-recovery", "--max-restarts", "1", "--peer-respawn-delay", "1"])
    procs = _records(out)
    for rank in (r for r in range(3) if r != killed):
        assert len(procs[rank]) == 1, f"rank {rank} was restarted: {[p for p, _ in procs[rank]]}"
        steps = [r["step"] for r in procs[rank][0][1] if r["event"] == "step"]
        assert steps == list(range(1, STEPS + 1))
    return procs


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
# rank 0 also hosts the first group's TCPStore; a replacement rank 0 is the lowest member of
# the new group yet must take the state from a survivor; a frozen rank (SIGSTOP) is found by
# its missing heartbeats (5 s here) and killed by the launcher
@pytest.mark.parametrize(("killed", "how"), [(2, "KILL"), (0, "KILL"), (1, "STOP")])
def test_survivors_go_on_and_a_replacement_joins_from_a_peer(tmp_path: Path, killed: int,
                                                             how: str) -> None:
    survivors = [r for r in range(3) if r != killed]
    # the survivors are the processes they started as, with steps 1..N once each
    procs = _launch_with_a_loss(tmp_path, killed, how)
    for rank in survivors:
        dropped = [r["step"] for r in procs[rank][0][1] if r["event"] == "dropped"]
        assert dropped and all(s == KILL_AT + 1 for s in dropped)

    # the first process of the killed rank died after step 10; its replacement joined later
    (first_pid, first), (second_pid, second) = procs[killed]
    assert first_pid != second_pid
    assert [r["step"] for r in first if r["event"] == "step"] == list(range(1, KILL_AT + 1))
    joined = second[0]
    assert joined["event"] == "joined"
    join_step = joined["step"]
    assert KILL_AT < join_step < STEPS
    assert [r["step"] for r in second if r["event"] == "step"] == \
        list(range(join_step + 1, STEPS + 1))

    survivor = {r["step"]: r for r in procs[survivors[0]][0][1] if r["event"] == "step"}
    # the survivors went on within 10 s of the kill (the killed rank's last step record)
    killed_at = first[-1]["t"]
    recovered_in = survivor[KILL_AT + 1]["t"] - killed_at
    assert recovered_in < 10.0, recovered_in
    # the replacement took the survivors' weights and optimizer state bit for bit
    assert joined["weights"] == survivor[join_step]["weights"]
    assert joined["optim"] == survivor[join_step]["optim"]
    # final weights identical everywhere
    finals = {procs[r][-1][1][-1]["weights"] for r in (0, 1, 2)}
    assert all(procs[r][-1][1][-1]["event"] == "done" for r in (0, 1, 2))
    assert len(finals) == 1
    # the group of each step: 3 ranks, 2 from step 31, 3 again after the join
    members = {s: r["members"] for s, r in survivor.items()}
    assert members[KILL_AT] == [0, 1, 2]
    assert members[KILL_AT + 1] == survivors
    assert members[join_step + 1] == [0, 1, 2]

    _assert_losses_match(procs, members)

    job = json.loads((tmp_path / "run" / "job.json").read_text())
    assert job["status"] == "succeeded" and job["exit_code"] == 0
    events = [e["event"] for e in job["peer_recovery"]]
    assert events == ["rank_lost", "replacement_started"]
    print(f"recovered in {recovered_in:.2f} s; replacement joined after step {join_step}")


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_replacement_lost_during_its_state_transfer_leaves_the_survivors_going(
        tmp_path: Path) -> None:
    """The replacement dies after the weights and before the optimizer state: the survivors
    give the transfer up, re-form without it and finish; nothing is counted twice."""
    out = tmp_path / "out"
    proc = launch(3, WORKER, str(out), str(STEPS), str(KILL_AT), "2", SLEEP_S, "JOINER",
                  str(WAIT_FROM), run_dir=tmp_path / "run", timeout=140,
                  extra=["--peer-recovery", "--max-restarts", "1"])
    assert "a replacement was lost while it joined" in proc.stdout + proc.stderr
    procs = _records(out)
    assert len(procs[2]) == 1  # the replacement wrote nothing: it died inside initialize
    finals = set()
    for rank in (0, 1):
        assert len(procs[rank]) == 1
        records = procs[rank][0][1]
        assert [r["step"] for r in records if r["event"] == "step"] == list(range(1, STEPS + 1))
        assert records[-1]["event"] == "done"
        finals.add(records[-1]["weights"])
    assert len(finals) == 1
    survivor = {r["step"]: r for r in procs[0][0][1] if r["event"] == "step"}
    members = {s: r["members"] for s, r in survivor.items()}
    assert all(members[s] == [0, 1] for s in range(KILL_AT + 1, STEPS + 1))
    reference = _reference_losses(members)
    for rank in (0, 1):
        for r in procs[rank][0][1]:
            if r["event"] == "step":
                assert r["loss"] == pytest.approx(reference[(r["step"], rank)], rel=1e-5,
                                                  abs=1e-6)
    job = json.loads((tmp_path / "run" / "job.json").read_text())
    assert job["status"] == "succeeded"
    assert [e["event"] for e in job["peer_recovery"]] == \
        ["rank_lost", "replacement_started", "rank_lost"]


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
# rank 0 hosts the survivors' new store: rank 1 waits for its address; rank 1 lost instead:
# rank 0 hosts it and waits for rank 1 to arrive
@pytest.mark.parametrize("second", [0, 1])
def test_a_second_rank_lost_during_the_reform_leaves_one_survivor_going(
        tmp_path: Path, second: int) -> None:
    """Rank 2 dies after step 10 and rank ``second`` as it starts re-forming the group: the
    last survivor gives the half-formed group up at once, forms the next generation alone and
    goes on (each step its own gradient); rank 2's replacement joins it from its state."""
    survivor = 1 - second
    out = tmp_path / "out"
    launch(3, WORKER, str(out), str(STEPS), str(KILL_AT), "2", SLEEP_S, f"REFORM:{second}",
           str(WAIT_FROM), run_dir=tmp_path / "run", timeout=80,
           extra=["--peer-recovery", "--max-restarts", "1", "--peer-respawn-delay", "0"])
    procs = _records(out)
    assert len(procs[second]) == 1 and len(procs[survivor]) == 1
    lost = [r["step"] for r in procs[second][0][1] if r["event"] == "step"]
    assert lost == list(range(1, KILL_AT + 1))
    records = procs[survivor][0][1]
    assert [r["step"] for r in records if r["event"] == "step"] == list(range(1, STEPS + 1))
    by_step = {r["step"]: r for r in records if r["event"] == "step"}
    # the group lost ranks 2 and `second` within seconds, not the group's timeout (120 s)
    recovered_in = by_step[KILL_AT + 1]["t"] - procs[2][0][1][-1]["t"]
    assert recovered_in < 10.0, recovered_in
    assert len(procs[2]) == 2  # rank 2's first process and its replacement
    joined = procs[2][1][1][0]
    assert joined["event"] == "joined" and KILL_AT < joined["step"] < STEPS
    assert joined["weights"] == by_step[joined["step"]]["weights"]
    assert joined["optim"] == by_step[joined["step"]]["optim"]
    members = {s: r["members"] for s, r in by_step.items()}
    assert members[KILL_AT] == [0, 1, 2]
    assert members[KILL_AT + 1] == [survivor]
    assert members[joined["step"] + 1] == sorted([survivor, 2])
    _assert_losses_match(procs, members)
    finals = {procs[r][-1][1][-1]["weights"] for r in (survivor, 2)}
    assert len(finals) == 1
    job = json.loads((tmp_path / "run" / "job.json").read_text())
    assert job["status"] == "succeeded"
    events = [(e["event"], e["rank"]) for e in job["peer_recovery"]]
    # the replacement's start and the second loss come in either order
    assert events[0] == ("rank_lost", 2)
    assert sorted(events[1:]) == [("rank_lost", second), ("replacement_started", 2)]
    print(f"recovered from two losses in {recovered_in:.2f} s")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
# stage 1, rank 2 lost: its shard comes from rank 1's mirror; stage 2, rank 0 lost: from rank 2's
# (the last rank mirrors the first); a bf16 model: fp32 master shards apart from the weights
@pytest.mark.parametrize(("zero", "killed"), [("1", 2), ("2", 0), ("2:bf16", 1)])
def test_zero_survivors_recut_the_shards_and_a_replacement_takes_its_own(
        tmp_path: Path, zero: str, killed: int) -> None:
    """ZeRO-1/2 under --peer-recovery: every rank keeps a mirror of the next rank's optimizer
    shard, equal to it bit for bit after every step; after a loss the survivors rebuild the
    lost shard from its mirror and re-cut the state for two ranks, after the join for three;
    every committed step's losses match the unsharded single-process reference."""
    survivors = [r for r in range(3) if r != killed]
    procs = _launch_with_a_loss(tmp_path, killed, "KILL", zero)
    (_, first), (_, second) = procs[killed]
    joined = second[0]
    assert joined["event"] == "joined" and KILL_AT < joined["step"] < STEPS
    survivor = {r["step"]: r for r in procs[survivors[0]][0][1] if r["event"] == "step"}
    assert joined["weights"] == survivor[joined["step"]]["weights"]

    # the state after each step, per launch rank (a replacement's first line is its join)
    after: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
    for rank, runs in procs.items():
        for _, records in runs:
            for r in records:
                if r["event"] in ("step", "joined"):
                    after[r["step"]][rank] = r
    layouts = set()
    for step, by_rank in after.items():
        layout = next(iter(by_rank.values()))["layout"]
        layouts.add(tuple(layout))
        if set(layout) != set(by_rank):
            continue  # the killed rank's last step: its line is there, its peers' may be too
        assert all(r["layout"] == layout for r in by_rank.values()), step
        for i, rank in enumerate(layout):
            following = layout[(i + 1) % len(layout)]
            assert by_rank[rank]["mirror"] == by_rank[following]["optim"], (step, rank)
    assert layouts == {(0, 1, 2), tuple(survivors)}

    members = {s: r["members"] for s, r in survivor.items()}
    assert members[KILL_AT + 1] == survivors and members[joined["step"] + 1] == [0, 1, 2]
    # the fp32 cases hold the recovery to the reference's rounding; the bf16 model (its mirrors'
    # fp32 masters and the fused copy to the model) only to bf16's
    _assert_losses_match(procs, members, rel=2e-2 if zero.endswith("bf16") else 1e-5)
    finals = {procs[r][-1][1][-1]["weights"] for r in (0, 1, 2)}
    assert len(finals) == 1


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_zero_mirrors_take_what_a_checkpoint_load_brought(tmp_path: Path) -> None:
    """A checkpoint holds no mirror: after a load each rank's mirror of the next rank's shard
    equals what that rank loaded, not what the mirror held before the load."""
    out = tmp_path / "out"
    launch(2, DATA / "peer_zero_load_worker.py", str(out), str(tmp_path / "ckpt"),
           run_dir=tmp_path / "run", timeout=80, extra=["--peer-recovery"])
    results = rank_results(out, 2)
    for rank, r in enumerate(results):
        assert r["steps"] == 3 and r["layout"] == [0, 1]
        assert r["own"] == r["saved"]
        assert r["mirror"] == results[(rank + 1) % 2]["own"], rank


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_zero_stage_3_is_refused_with_the_way_out(tmp_path: Path) -> None:
    """Stage 3 keeps no whole parameters to mirror from: refused at initialize, naming the
    stage and --max-restarts."""
    with pytest.raises(AssertionError) as failed:
        launch(2, WORKER, str(tmp_path / "out"), "2", "0", "9", "0", "KILL", "0", "3",
               run_dir=tmp_path / "run", timeout=50, extra=["--peer-recovery"])
    assert "recovers data-parallel replicas with ZeRO stages 0-2 without offload; this " \
           "engine has ZeRO stage 3" in str(failed.value)
    assert "--max-restarts" in str(failed.value)
