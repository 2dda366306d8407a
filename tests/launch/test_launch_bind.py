"""`flowtrain launch --bind-cores-to-rank` / `--bind-core-list` (DeepSpeed's
--bind_cores_to_rank / --bind_core_list): each local rank runs on its own share of the cores,
with OMP_NUM_THREADS and torch's threads set to its size; bad input is one error line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from flowtrain.launch.affinity import available_cores, format_cores, parse_core_list, split
from flowtrain.launch.hostfile import LaunchInputError
from helpers import DATA, LAUNCH, launcher_env, one_error_line

pytestmark = pytest.mark.multiprocess

# Writes what the rank sees: its affinity, that of every thread it has (the runtime's, torch's
# pool after a parallel op), OMP_NUM_THREADS and torch's thread count.
RANK_SCRIPT = r'''
import json, os, sys
import torch
torch.ones(256, 256) @ torch.ones(256, 256)  # starts torch's intra-op threads
threads = {}
for tid in os.listdir("/proc/self/task"):
    try:
        threads[tid] = sorted(os.sched_getaffinity(int(tid)))
    except OSError:
        pass
out = os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json")
with open(out, "w") as f:
    json.dump({"cores": sorted(os.sched_getaffinity(0)), "threads": threads,
               "omp": os.environ.get("OMP_NUM_THREADS"), "torch": torch.get_num_threads()}, f)
'''

SHELL_RANK = """#!/usr/bin/env bash
grep Cpus_allowed_list /proc/self/status > "$1/shell$RANK.txt"
echo "omp=$OMP_NUM_THREADS" >> "$1/shell$RANK.txt"
"""


def _launch(tmp_path: Path, args: list[str],
            timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LAUNCH, "--run-dir", str(tmp_path / "run"), *args], cwd=tmp_path,
                          env=launcher_env(FLOWTRAIN_CONSOLE_LEVEL="ERROR"), capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "where.py"
    path.write_text(RANK_SCRIPT)
    (tmp_path / "out").mkdir()
    return path


def _seen(tmp_path: Path, ranks: int) -> list[dict]:
    return [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(ranks)]


def _check_shares(seen: list[dict], cores: list[int]) -> None:
    """Each rank's threads all run on its share; the shares are disjoint, cover ``cores`` in
    order, and differ in size by at most one (the larger ones first)."""
    shares = [s["cores"] for s in seen]
    assert shares == [sorted(p) for p in split(len(seen), cores, available=sorted(cores))]
    assert sorted(c for share in shares for c in share) == sorted(cores), shares
    sizes = [len(share) for share in shares]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    for s in seen:
        assert s["omp"] == str(len(s["cores"])) and s["torch"] == len(s["cores"]), s
        assert s["threads"] and all(t == s["cores"] for t in s["threads"].values()), s


@pytest.mark.timeout(120)
def test_two_ranks_share_the_cores(tmp_path: Path, script: Path) -> None:
    cores = available_cores()
    if len(cores) < 2:
        pytest.skip("needs 2 usable cores")
    proc = _launch(tmp_path, ["--nproc-per-node", "2", "--bind-cores-to-rank", str(script),
                              str(tmp_path / "out")])
    assert proc.returncode == 0, proc.stderr
    seen = _seen(tmp_path, 2)
    _check_shares(seen, cores)
    job = json.loads((tmp_path / "run" / "job.json").read_text())
    assert job["cores"] == {"0": seen[0]["cores"], "1": seen[1]["cores"]}


@pytest.mark.timeout(120)
def test_deepspeed_spelling_and_core_list(tmp_path: Path, script: Path) -> None:
    cores = available_cores()
    if len(cores) < 2:
        pytest.skip("needs 2 usable cores")
    listed = list(reversed(cores[:3]))  # the list's order decides who gets which core
    proc = _launch(tmp_path, ["--nproc_per_node", "2", "--bind_cores_to_rank",
                              "--bind_core_list", ",".join(map(str, listed)), str(script),
                              str(tmp_path / "out")])
    assert proc.returncode == 0, proc.stderr
    seen = _seen(tmp_path, 2)
    _check_shares(seen, listed)


@pytest.mark.timeout(120)
def test_one_rank_gets_every_core_and_no_flag_binds_nothing(tmp_path: Path, script: Path) -> None:
    cores = available_cores()
    proc = _launch(tmp_path, ["--nproc-per-node", "1", "--bind-cores-to-rank", str(script),
                              str(tmp_path / "out")])
    assert proc.returncode == 0, proc.stderr
    (seen,) = _seen(tmp_path, 1)
    assert seen["cores"] == cores and seen["omp"] == str(len(cores)) and seen["torch"] == len(cores)
    # without the flag, a rank keeps the launcher's mask
    proc = _launch(tmp_path, ["--nproc-per-node", "1", str(script), str(tmp_path / "out")])
    assert proc.returncode == 0, proc.stderr
    (seen,) = _seen(tmp_path, 1)
    assert seen["cores"] == cores
    assert "cores" not in json.loads((tmp_path / "run" / "job.json").read_text())


@pytest.mark.timeout(120)
def test_no_python_ranks_are_bound_too(tmp_path: Path) -> None:
    cores = available_cores()
    if len(cores) < 2:
        pytest.skip("needs 2 usable cores")
    rank = tmp_path / "rank.sh"
    rank.write_text(SHELL_RANK)
    rank.chmod(0o755)
    (tmp_path / "out").mkdir()
    proc = _launch(tmp_path, ["--nproc-per-node", "2", "--bind-cores-to-rank", "--no-python",
                              str(rank), str(tmp_path / "out")])
    assert proc.returncode == 0, proc.stderr
    for r, share in enumerate(split(2, None, available=cores)):
        text = (tmp_path / "out" / f"shell{r}.txt").read_text()
        assert f"Cpus_allowed_list:\t{format_cores(share)}" in text, text
        assert f"omp={len(share)}" in text


@pytest.mark.timeout(60)
def test_core_list_naming_a_core_this_host_lacks(tmp_path: Path, script: Path) -> None:
    line = one_error_line(_launch(tmp_path, ["--nproc-per-node", "2", "--bind-core-list", "0,4096",
                                          str(script), "x"]))
    assert "'0,4096'" in line and "core(s) 4096" in line and "does not have" in line
    assert f"available here are {format_cores(available_cores())}" in line


@pytest.mark.timeout(60)
def test_fewer_cores_than_ranks(tmp_path: Path, script: Path) -> None:
    first = available_cores()[0]
    line = one_error_line(_launch(tmp_path, ["--nproc-per-node", "2", "--bind-core-list",
                                          str(first), str(script), "x"]))
    assert "2 ranks but only the 1 listed core(s)" in line and "--nproc-per-node 1" in line
    n = len(available_cores()) + 1
    line = one_error_line(_launch(tmp_path, ["--nproc-per-node", str(n), "--bind-cores-to-rank",
                                          str(script), "x"]))
    assert f"{n} ranks but only this host's {n - 1} usable core(s)" in line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text, part", [("0-x", "'0-x'"), ("3-1", "'3-1'"), ("", "''"),
                                        ("0,0", "more than once"), ("-1", "'-1'")])
def test_bad_core_list_syntax(tmp_path: Path, script: Path, text: str, part: str) -> None:
    line = one_error_line(_launch(tmp_path, ["--bind-core-list", text, str(script), "x"]))
    assert "--bind-core-list" in line and part in line


def test_split_uneven_gives_the_first_ranks_one_more() -> None:
    assert split(3, None, available=list(range(8))) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert split(2, [7, 1, 2], available=list(range(8))) == [[7, 1], [2]]
    assert split(4, None, available=[0, 1, 2, 3]) == [[0], [1], [2], [3]]
    with pytest.raises(LaunchInputError, match="5 ranks but only this host's 4"):
        split(5, None, available=[0, 1, 2, 3])
    with pytest.raises(LaunchInputError, match="core\\(s\\) 9-10"):
        split(1, [0, 9, 10], available=[0, 1])


def test_parse_and_format() -> None:
    assert parse_core_list("0,2-4, 7") == [0, 2, 3, 4, 7]
    assert format_cores([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


@pytest.mark.timeout(120)
def test_hostfile_nodes_bind_their_own_ranks(tmp_path: Path, script: Path) -> None:
    """Over ssh (a local stand-in), each node launcher gets the flags and binds its ranks."""
    last = available_cores()[-1]
    hosts = tmp_path / "hostfile"
    hosts.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    ssh = f"bash {DATA / 'fake_ssh.sh'}"
    proc = _launch(tmp_path, ["-H", str(hosts), "--ssh-command", ssh, "--bind_core_list",
                              str(last), str(script), str(tmp_path / "out")])
    assert proc.returncode == 0, proc.stderr
    for seen in _seen(tmp_path, 2):
        assert seen["cores"] == [last] and seen["omp"] == "1" and seen["torch"] == 1, seen
