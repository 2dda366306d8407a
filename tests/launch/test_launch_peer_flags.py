"""`flowtrain launch` takes the flags DeepSpeed's launcher and torchrun users type: each one
either means what it means there (checked on the resolved launch) or is refused with one line
naming flowtrain's way; a DeepSpeed script that declares --local_rank gets it, a torchrun
script does not; --save_pid writes the launcher's pid."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from flowtrain.launch.args import LaunchConfig, add_launch_arguments, resolve
from flowtrain.launch.hostfile import LaunchInputError
from helpers import launch


@pytest.fixture()
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return path


def config(*flags: str, script: Path) -> LaunchConfig:
    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    argv = [*flags, str(script)]
    return resolve(parser.parse_args(argv), argv)


@pytest.mark.parametrize(("flags", "field", "value"), [
    (["--num_gpus", "3"], "nproc_per_node", 3),
    (["--num-gpus", "2"], "nproc_per_node", 2),
    (["--nproc-per-node", "cpu"], "nproc_per_node", os.cpu_count() or 1),
    (["--num_nodes", "2", "--master_addr", "127.0.0.1", "--master_port", "29900"], "nnodes", 2),
    (["--nnodes", "1:1"], "nnodes", 1),
    (["--standalone"], "nnodes", 1),
    (["--max-restarts", "0"], "max_restarts", 0),
    (["--max-restarts", "2"], "max_restarts", 2),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "10.1.2.3:29411", "--nnodes", "2"],
     "master_addr", "10.1.2.3"),
    (["--rdzv-backend", "static", "--rdzv-endpoint", "10.1.2.3:29411", "--nnodes", "2"],
     "master_port", 29411),
    (["--rdzv-id", "exp7"], "job_id", "exp7"),
    (["--no_ssh"], "nnodes", 1),
    (["--save_pid"], "save_pid", True),
    (["--launcher", "pdsh"], "nnodes", 1),
    (["--log-level", "warning"], "log_level", "warning"),
    (["-q"], "quiet", True),
    (["--local-ranks-filter", "0,2"], "echo_ranks", frozenset({0, 2})),
    (["--redirects", "3"], "echo_ranks", frozenset()),
    (["--redirects", "3", "--tee", "3"], "echo_ranks", None),
])
def test_peer_flags_mean_what_they_mean_there(flags: list[str], field: str, value: object,
                                              script: Path) -> None:
    assert getattr(config(*flags, script=script), field) == value


def test_log_dir_and_ssh_port(script: Path, tmp_path: Path) -> None:
    got = config("--log-dir", str(tmp_path / "logs"), "--ssh_port", "2222", script=script)
    assert got.run_dir == tmp_path / "logs"
    assert got.ssh_command[-2:] == ["-p", "2222"]


@pytest.mark.parametrize(("flags", "named"), [
    (["--launcher", "openmpi"], "--hostfile"),
    (["--launcher", "mvapich"], "not on PATH"),
    (["--launcher", "slurm"], "srun"),
    (["--launcher", "lsf"], "one of pdsh"),
    (["--launcher_args", "-x FOO"], "--ssh-command"),
    (["--force_multi"], "--hostfile"),
    (["--venv_script", "/x/activate"], "--ssh-command"),
    (["--log_level", "loud"], "one of debug"),
    (["--nnodes", "1:2"], "needs --hostfile"),
    (["--max-restarts", "3", "--nnodes", "2", "--master-port", "29900"], "started by hand"),
    (["--max-restarts", "-1"], "at least 0"),
    (["--rdzv-backend", "etcd"], "static or c10d"),
    (["--rdzv-conf", "timeout=9"], "--join-timeout"),
    (["--redirects", "7"], "0, 1, 2 or 3"),
    (["--local-ranks-filter", "a"], "local ranks"),
])
def test_refused_flags_name_the_flowtrain_way(flags: list[str], named: str,
                                              script: Path) -> None:
    with pytest.raises(LaunchInputError) as err:
        config(*flags, script=script)
    message = str(err.value)
    assert "\n" not in message and named in message, message


DEEPSPEED_SCRIPT = """
import argparse, json, os, sys
p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=-1)
p.add_argument("--out")
a = p.parse_args()
json.dump({"local_rank": a.local_rank, "env": int(os.environ["LOCAL_RANK"])},
          open(a.out + "." + os.environ["RANK"], "w"))
"""

TORCHRUN_SCRIPT = """
import argparse, json, os
p = argparse.ArgumentParser()
p.add_argument("--out")
a = p.parse_args()  # an unexpected --local_rank would stop it here
json.dump({"env": int(os.environ["LOCAL_RANK"])}, open(a.out + "." + os.environ["RANK"], "w"))
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_deepspeed_script_gets_its_local_rank_and_a_torchrun_one_does_not(
        tmp_path: Path) -> None:
    ds, tr = tmp_path / "ds_train.py", tmp_path / "tr_train.py"
    ds.write_text(DEEPSPEED_SCRIPT)
    tr.write_text(TORCHRUN_SCRIPT)
    launch(2, ds, "--out", str(tmp_path / "ds"), run_dir=tmp_path / "run-ds")
    launch(2, tr, "--out", str(tmp_path / "tr"), run_dir=tmp_path / "run-tr")
    for r in range(2):
        assert json.loads((tmp_path / f"ds.{r}").read_text()) == {"local_rank": r, "env": r}
        assert json.loads((tmp_path / f"tr.{r}").read_text()) == {"env": r}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_save_pid_writes_the_launchers_pid(tmp_path: Path) -> None:
    import subprocess

    from helpers import LAUNCH, REPO, child_env

    script = tmp_path / "t.py"
    script.write_text("print('ok')\n")
    proc = subprocess.run([*LAUNCH, "--save_pid", "--run-dir", str(tmp_path / "run"),
                           str(script)], cwd=REPO, env=child_env(), capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    pid = int((tmp_path / "run" / "launcher.pid").read_text())
    assert pid > 0 and pid != os.getpid()


CHATTY = """
import os, sys
import flowtrain, torch.distributed as dist
flowtrain.init_distributed()
print(f"hello from local rank {os.environ['LOCAL_RANK']}", flush=True)
print("launched by torchelastic:", dist.is_torchelastic_launched(), flush=True)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_console_filters_and_quiet(tmp_path: Path) -> None:
    import subprocess

    from helpers import LAUNCH, REPO, child_env

    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)

    def run(*flags: str) -> tuple[str, Path]:
        run_dir = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
        proc = subprocess.run([*LAUNCH, "--nproc-per-node", "2", *flags, "--run-dir",
                               str(run_dir), str(script)], cwd=REPO, env=child_env(),
                              capture_output=True, text=True, timeout=100)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout + proc.stderr, run_dir

    out, run_dir = run("--local-ranks-filter", "1")
    assert "hello from local rank 1" in out and "hello from local rank 0" not in out
    # every rank's output stays in its file
    assert "hello from local rank 0" in (run_dir / "rank0.out").read_text()
    assert "launched by torchelastic: True" in out
    out, _ = run("--redirects", "3")
    assert "hello from local rank" not in out
    out, _ = run("-q")
    assert "job starting" not in out and "hello from local rank 0" in out
    loud, _ = run()
    assert "job starting" in loud
