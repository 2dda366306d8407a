"""Ranks started by SLURM's srun without a launcher: SLURM's variables give the torch
environment (against what torchrun would set), and two emulated srun tasks form a world of 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flowtrain import slurm
from helpers import REPO, child_env, free_port


def test_first_host_of_a_node_list() -> None:
    assert slurm.first_host("gpu-a[03-05,07],gpu-b1") == "gpu-a03"
    assert slurm.first_host("n1,n2") == "n1"
    assert slurm.first_host("node[1-4]") == "node1"
    with pytest.raises(ValueError, match="empty"):
        slurm.first_host(" ")


def test_srun_variables_become_torch_ones_and_a_launcher_wins() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "node[07-08]",
           "SLURM_JOB_ID": "123456"}
    assert slurm.apply(env)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "node07", "MASTER_PORT": str(29500 + 456)}
    launched = {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "3", "SLURM_NTASKS": "4"}
    assert not slurm.apply(launched) and launched["RANK"] == "0"
    assert not slurm.apply({"PATH": "/bin"})


WORKER = """
import json, sys
import torch, torch.distributed as dist
import flowtrain
flowtrain.init_distributed()
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
json.dump({"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": float(t)},
          open(sys.argv[1], "w"))
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_srun_tasks_form_a_world_of_two(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    procs = []
    for task in range(2):
        env = {k: v for k, v in child_env().items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        env.update(SLURM_PROCID=str(task), SLURM_NTASKS="2", SLURM_LOCALID=str(task),
                   SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NODELIST="localhost",
                   SLURM_JOB_ID="7", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path / f"{task}")],
                                      cwd=REPO, env=env, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=100)
        assert p.returncode == 0, err
    got = [json.loads((tmp_path / f"{t}").read_text()) for t in range(2)]
    assert got == [{"rank": 0, "world": 2, "sum": 3.0}, {"rank": 1, "world": 2, "sum": 3.0}]
