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
