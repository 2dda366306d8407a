"""Data channels: collectives awaited from a rank's event loop equal torch's results, keep the
loop free while they wait, and time out with a message instead of hanging."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flowtrain import comm
from helpers import DATA, free_port, rank_env

WORKER = DATA / "comm_worker.py"


@pytest.mark.timeout(90)
def test_collectives_from_the_loop_on_two_gloo_ranks(tmp_path: Path) -> None:
    port = free_port()
    procs = []
    for rank in range(2):
        env = rank_env(rank, 2, port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(tmp_path / f"{rank}.json")],
                                      env=env))
    try:
        for p in procs:
            assert p.wait(timeout=75) == 0
    finally:
        for p in procs:
            p.kill()
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2))
    for r in (r0, r1):
        assert r["all_reduce"] == [3.0, 3.0, 3.0]
        assert r["broadcast"] == [17.0]
        assert r["all_gather"] == [0.0, 0.5, 1.0, 1.5]
        assert r["late"] == [2.0] * 4
    # reduce-scatter of arange(4)*(rank+1) summed over ranks = arange(4)*3, split in halves.
    assert r0["reduce_scatter"] == [0.0, 3.0]
    assert r1["reduce_scatter"] == [6.0, 9.0]
    # Rank 0 waited ~0.5 s for rank 1; its loop kept running and listed the pending collective.
    assert r0["ticks_while_waiting"] >= 10
    assert any("all_reduce of 16 B over 2 ranks" in p for p in r0["pending_seen"])
    assert "all_reduce of 4 B over 2 ranks did not finish within 0.5 s" in r0["timeout"]


def test_default_backend_without_cuda_is_gloo() -> None:
    import torch

    expected = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() else "gloo"
    assert comm.default_backend() == expected


def test_bad_backend_is_named() -> None:
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl', got 'mpi'"):
        comm.init_distributed("mpi")


# Rank 0 lists the addresses its process listens on at MASTER_PORT (from /proc/net/tcp{,6}),
# after a collective proves the store served both ranks.
STORE_PROBE = r'''
import json, os, sys
import torch, torch.distributed as dist
from flowtrain import comm
comm.init_distributed("gloo")
t = torch.ones(1)
dist.all_reduce(t)
port = int(os.environ["MASTER_PORT"])
found = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        fields = line.split()
        address, hex_port = fields[1].rsplit(":", 1)
        if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
            found.append(address)
json.dump({"sum": t.item(), "listening": found}, open(sys.argv[1], "w"))
dist.destroy_process_group()
'''


@pytest.mark.timeout(90)
def test_single_node_store_listens_on_loopback_only(tmp_path: Path) -> None:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", STORE_PROBE, str(tmp_path / f"{r}.json")],
                              env=rank_env(r, 2, port, OMP_NUM_THREADS="1")) for r in range(2)]
    try:
        for p in procs:
            assert p.wait(timeout=75) == 0
    finally:
        for p in procs:
            p.kill()
    r0 = json.loads((tmp_path / "0.json").read_text())
    assert r0["sum"] == 2.0
    # 0100007F is 127.0.0.1 as /proc/net/tcp writes it; torch's own store gives 0.0.0.0 or ::
    assert r0["listening"] == ["0100007F"], r0["listening"]
