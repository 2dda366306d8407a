"""`flowtrain launch` end to end with real rank processes: success, exceptions, SIGKILL, SIGSTOP,
Ctrl-C, and a two-"host" hostfile job through a local ssh stand-in."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers import DATA, LAUNCH, launcher_env

pytestmark = pytest.mark.multiprocess

JOB = DATA / "rank_job.py"
FAKE_SSH = f"bash {DATA / 'fake_ssh.sh'}"


def _kill_leftovers(run_dir: Path) -> list[int]:
    """Kills any process of this test's job (found by its FLOWTRAIN_RUN_DIR) and returns their
    pids."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("FLOWTRAIN_RUN_DIR") == str(run_dir) or any(
                    str(run_dir) in part for part in proc.cmdline()):
                found.append(proc.pid)
                proc.kill()
        except (psutil.Error, OSError):
            continue
    return found


class Run:
    def __init__(self, proc: subprocess.Popen[str], out: str, err: str, ended: float,
                 run_dir: Path) -> None:
        self.returncode, self.out, self.err, self.ended = proc.returncode, out, err, ended
        self.run_dir = run_dir
        self.job = json.loads((run_dir / "job.json").read_text())

    @property
    def text(self) -> str:
        return self.out + self.err


def launch(tmp_path: Path, args: list[str], *, timeout: float = 40.0,
           env: dict[str, str] | None = None, on_start: object = None,
           check_leftovers: bool = True) -> Run:
    run_dir = tmp_path / "run"
    cmd = [*LAUNCH, "--run-dir", str(run_dir), *args]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env or launcher_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        if callable(on_start):
            on_start(proc)
        out, err = proc.communicate(timeout=timeout)
        ended = time.time()
        if check_leftovers:
            assert not _kill_leftovers(run_dir), "the launcher left rank processes behind"
        return Run(proc, out, err, ended, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
        if check_leftovers:
            _kill_leftovers(run_dir)


def _fault_time(tmp_path: Path) -> float:
    return float((tmp_path / "out" / "fault_time").read_text())


@pytest.fixture
def outdir(tmp_path: Path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


@pytest.mark.timeout(60)
def test_success_env_and_run_dir(tmp_path: Path, outdir: Path) -> None:
    (tmp_path / ".flowtrain_env").write_text("FLOWTRAIN_TEST_FROM_ENV_FILE=from-env-file\n")
    run = launch(tmp_path, ["--nproc-per-node", "2", str(JOB), "ok", str(outdir)])
    assert run.returncode == 0, run.text
    assert run.job["status"] == "succeeded" and run.job["root_cause"] is None
    for rank in (0, 1):
        seen = json.loads((outdir / f"rank{rank}.json").read_text())
        env = seen["env"]
        assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["FLOWTRAIN_RUN_DIR"] == str(run.run_dir)
        assert env["FLOWTRAIN_ERROR_FILE"] == str(run.run_dir / f"rank{rank}.error.json")
        assert env["FLOWTRAIN_CONTROL_ENDPOINT"].startswith("tcp://127.0.0.1:")
        assert env["FLOWTRAIN_LAUNCHED"] == "1" and env["PYTHONUNBUFFERED"] == "1"
        assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
        assert env["FLOWTRAIN_TEST_FROM_ENV_FILE"] == "from-env-file"
        assert seen["sum"] == seen["expected"] == 3.0
        assert seen["argv"] == [str(JOB), "ok", str(outdir)] and seen["name"] == "__main__"
        assert seen["path0"] == str(DATA)
        assert f"rank {rank} all-reduced 3.0" in (run.run_dir / f"rank{rank}.out").read_text()
        assert f"[rank{rank}]: rank {rank} all-reduced 3.0" in run.out
        assert not (run.run_dir / f"rank{rank}.error.json").exists()
    assert (run.run_dir / "launcher.jsonl").stat().st_size > 0


@pytest.mark.timeout(60)
def test_exception_is_the_root_cause(tmp_path: Path, outdir: Path) -> None:
    message = f"boom-{secrets.token_hex(4)}"
    run = launch(tmp_path, ["--nproc-per-node", "2", str(JOB), "raise", str(outdir)],
                 env=launcher_env(BOOM_MESSAGE=message))
    assert run.returncode == 1, run.text
    assert run.ended - _fault_time(tmp_path) < 5.0
    assert "Root cause" in run.err and "rank 1 (host" in run.err
    assert f"ValueError: {message}" in run.err and "Traceback" in run.err
    root = run.job["root_cause"]
    assert root["rank"] == 1 and root["kind"] == "exception" and message in root["message"]
    assert "rank 0 (pid" in run.err  # the other rank's end state
    assert json.loads((run.run_dir / "rank1.error.json").read_text())["rank"] == 1
    assert not (run.run_dir / "rank0.error.json").exists()


@pytest.mark.timeout(60)
def test_sigkill_is_the_root_cause(tmp_path: Path, outdir: Path) -> None:
    run = launch(tmp_path, ["--nproc-per-node", "2", str(JOB), "sigkill", str(outdir)])
    assert run.returncode == 1, run.text
    assert run.ended - _fault_time(tmp_path) < 5.0
    assert "rank 1 (host" in run.err and "killed by SIGKILL" in run.err
    root = run.job["root_cause"]
    assert root["rank"] == 1 and root["kind"] == "signal" and "SIGKILL" in root["message"]


@pytest.mark.timeout(60)
def test_sigkill_during_collectives_outranks_the_peers_connection_error(
        tmp_path: Path, outdir: Path) -> None:
    run = launch(tmp_path, ["--nproc-per-node", "2", str(JOB), "sigkill-busy", str(outdir)])
    assert run.returncode == 1, run.text
    root = run.job["root_cause"]
    assert root["rank"] == 1 and root["kind"] == "signal" and "SIGKILL" in root["message"], run.text


@pytest.mark.timeout(60)
def test_sigstopped_rank_is_declared_stuck(tmp_path: Path, outdir: Path) -> None:
    run = launch(tmp_path, ["--nproc-per-node", "2", "--heartbeat-interval", "0.2",
                            "--heartbeat-misses", "5", str(JOB), "sigstop", str(outdir)])
    assert run.returncode == 1, run.text
    assert run.ended - _fault_time(tmp_path) < 10.0
    assert "rank 1 (host" in run.err and "is stuck" in run.err
    assert run.job["root_cause"]["rank"] == 1 and run.job["root_cause"]["kind"] == "stuck"


@pytest.mark.timeout(60)
def test_ctrl_c_tears_the_job_down(tmp_path: Path, outdir: Path) -> None:
    def interrupt(proc: subprocess.Popen[str]) -> None:
        deadline = time.time() + 30
        while not (outdir / "rank1.json").exists() or not (outdir / "rank0.json").exists():
            assert time.time() < deadline and proc.poll() is None, "ranks never started"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)

    run = launch(tmp_path, ["--nproc-per-node", "2", str(JOB), "hang", str(outdir)],
                 on_start=interrupt)
    assert run.returncode == 130, run.text
    assert run.job["status"] == "interrupted" and "SIGINT" in run.err


def _hostfile(tmp_path: Path) -> Path:
    hosts = tmp_path / "hostfile"
    hosts.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    return hosts


@pytest.mark.timeout(60)
def test_hostfile_two_node_launchers_all_reduce(tmp_path: Path, outdir: Path) -> None:
    run = launch(tmp_path, ["-H", str(_hostfile(tmp_path)), "--ssh-command", FAKE_SSH,
                            str(JOB), "ok", str(outdir)])
    assert run.returncode == 0, run.text
    for rank in (0, 1):
        seen = json.loads((outdir / f"rank{rank}.json").read_text())
        assert seen["sum"] == 3.0
        assert seen["env"]["GROUP_RANK"] == str(rank) and seen["env"]["LOCAL_RANK"] == "0"
        assert seen["env"]["WORLD_SIZE"] == "2" and seen["env"]["LOCAL_WORLD_SIZE"] == "1"
    assert run.job["mode"] == "hostfile" and run.job["status"] == "succeeded"
    assert (run.run_dir / "node0.out").exists() and (run.run_dir / "job.node1.json").exists()


@pytest.mark.timeout(60)
def test_hostfile_failure_ends_the_whole_job(tmp_path: Path, outdir: Path) -> None:
    message = f"boom-{secrets.token_hex(4)}"
    run = launch(tmp_path, ["-H", str(_hostfile(tmp_path)), "--ssh-command", FAKE_SSH,
                            str(JOB), "raise", str(outdir)], env=launcher_env(BOOM_MESSAGE=message))
    assert run.returncode == 1, run.text
    assert run.ended - _fault_time(tmp_path) < 8.0
    assert "rank 1" in run.err and f"ValueError: {message}" in run.err
    assert run.job["root_cause"]["rank"] == 1


@pytest.mark.timeout(60)
def test_large_output_does_not_block(tmp_path: Path) -> None:
    run = launch(tmp_path, ["--nproc-per-node", "2", str(DATA / "chatty.py")])
    assert run.returncode == 0, run.err[-2000:]
    for rank in (0, 1):
        assert f"[rank{rank}]: rank {rank} done" in run.out
        assert (run.run_dir / f"rank{rank}.out").stat().st_size > 8_000_000


@pytest.mark.timeout(60)
def test_module_and_no_python(tmp_path: Path) -> None:
    (tmp_path / "my_entry.py").write_text(
        "import os, sys\nprint('module rank', os.environ['RANK'], sys.argv[1:], __name__)\n")
    run = launch(tmp_path, ["--nproc-per-node", "2", "-m", "my_entry", "--lr", "3"])
    assert run.returncode == 0, run.text
    assert "[rank1]: module rank 1 ['--lr', '3'] __main__" in run.out
    (run.run_dir / "job.json").unlink()
    run = launch(tmp_path, ["--nproc-per-node", "2", "--no-python", str(DATA / "hello.sh"), "a b"])
    assert run.returncode == 0, run.text
    assert "[rank0]: shell rank 0 of 2 args a b" in run.out


def test_the_rendezvous_port_is_outside_the_kernels_ephemeral_range(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from flowtrain.launch import args

    low, high = args.ephemeral_ports()
    for _ in range(20):
        port = args.free_port()
        assert not low <= port <= high and args.LISTEN_PORTS[0] <= port <= args.LISTEN_PORTS[1]
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: another process would get it too
    # a range that leaves only 10000-10001 outside it: a port there, not a taken one
    ranges = tmp_path / "range"
    ranges.write_text("10002\t65000\n")
    monkeypatch.setattr(args, "EPHEMERAL_RANGE_FILE", str(ranges))
    assert args.ephemeral_ports() == (10002, 65000)
    with socket.socket() as taken:
        try:
            taken.bind(("127.0.0.1", 10000))
        except OSError:
            pytest.skip("port 10000 is in use on this host")
        assert args.free_port() == 10001
        # nothing free outside the range: the kernel's choice, not an endless search
        ranges.write_text("10001 65000\n")
        assert args.free_port(tries=8) not in (0, 10000)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("secret", ["exported", "derived"])
def test_torchrun_style_two_nodes(tmp_path: Path, outdir: Path, secret: str) -> None:
    from flowtrain.launch.args import free_port

    if secret == "exported":
        env = launcher_env(FLOWTRAIN_JOB_SECRET=secrets.token_hex(32))
    else:
        # no export: both nodes derive it from the shared home's ~/.flowtrain/job-key
        env = launcher_env(HOME=str(tmp_path / "home"))
        env.pop("FLOWTRAIN_JOB_SECRET", None)
    for attempt in range(3):
        # a free port can be taken again before node 0 binds it (the launcher then says so
        # and exits): try another, as a user would
        port = free_port()
        common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
        node1 = subprocess.Popen(
            [sys.executable, "-m", "flowtrain.cli", "launch", "--run-dir", str(tmp_path / "run"),
             *common, "--node-rank", "1", str(JOB), "ok", str(outdir)],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            run = launch(tmp_path, [*common, "--node-rank", "0", str(JOB), "ok", str(outdir)],
                         env=env, check_leftovers=False)
            if run.returncode != 0 and "pick another --master-port" in run.text and attempt < 2:
                continue
            # node 0 failing leaves node 1 waiting for it: say why now, not after a timeout
            assert run.returncode == 0, run.text
            out1, _ = node1.communicate(timeout=30)
            assert not _kill_leftovers(tmp_path / "run"), "a launcher left rank processes behind"
            assert node1.returncode == 0, run.text + out1
            assert "[rank1]: rank 1 all-reduced 3.0" in out1
            assert json.loads((outdir / "rank1.json").read_text())["env"]["GROUP_RANK"] == "1"
            if secret == "derived":
                key = tmp_path / "home" / ".flowtrain" / "job-key"
                assert key.stat().st_mode & 0o777 == 0o600
                assert "job secret derived from" in run.err and "job secret derived" in out1
            return
        finally:
            if node1.poll() is None:
                node1.kill()
                node1.communicate(timeout=10)
            _kill_leftovers(tmp_path / "run")


@pytest.mark.timeout(90)
def test_run_dir_is_private_and_a_killed_launchers_job_is_marked_by_the_next(
        tmp_path: Path, outdir: Path) -> None:
    """The run directory is 0700 and what the launcher writes 0600 (endpoints, secret, logs,
    telemetry); a SIGKILLed launcher's job.json said "running" and its telemetry.live.json
    (the job secret) stayed: the next launch beside it marks it killed and removes the file."""
    from flowtrain.telemetry.files import LIVE_FILE

    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\ntime.sleep(60)\n")
    killed_dir = tmp_path / "runs" / "killed"
    proc = subprocess.Popen([*LAUNCH, "--run-dir", str(killed_dir), "--nproc-per-node", "1",
                             str(sleeper)], cwd=tmp_path, env=launcher_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (killed_dir / LIVE_FILE).exists():
            assert time.monotonic() < deadline, "the launcher never wrote its live endpoint"
            time.sleep(0.1)
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_leftovers(killed_dir)
    assert json.loads((killed_dir / "job.json").read_text())["status"] == "running"

    run = launch(tmp_path / "runs", ["--nproc-per-node", "2", str(JOB), "ok", str(outdir)])
    assert run.returncode == 0, run.text
    marked = json.loads((killed_dir / "job.json").read_text())
    assert marked["status"] == "killed" and "ended without finishing" in \
        marked["root_cause"]["message"]
    assert not (killed_dir / LIVE_FILE).exists()
    assert (run.run_dir.stat().st_mode & 0o777) == 0o700
    for name in ("job.json", "launcher.jsonl", "telemetry.msgpack"):
        assert (run.run_dir / name).stat().st_mode & 0o077 == 0, name
    mask = os.umask(0)
    os.umask(mask)
    assert (outdir / "rank0.json").stat().st_mode & 0o777 == 0o666 & ~mask  # the user's umask


def test_a_job_key_other_users_can_read_is_refused(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from flowtrain.launch.hostfile import LaunchInputError
    from flowtrain.launch.multinode import derived_secret

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    first = derived_secret("10.0.0.1", 29500)
    assert derived_secret("10.0.0.1", 29500) == first != derived_secret("10.0.0.1", 29501)
    key = home / ".flowtrain" / "job-key"
    key.chmod(0o644)
    with pytest.raises(LaunchInputError, match="readable by other users"):
        derived_secret("10.0.0.1", 29500)


def test_a_sigkill_the_launcher_never_sent_is_a_failure_even_after_teardown_began(
        tmp_path: Path) -> None:
    """The race behind the test above: the peer whose collective broke reports first, the
    teardown signals the killed rank before its death is reaped, and that death must still be
    classed a failure; deaths the launcher caused are not."""
    from flowtrain.launch.supervisor import Child, Supervisor

    sup = Supervisor(grace_period=1.0, make_coordinator=None, build_children=lambda _: [],
                     endpoint_for=lambda _: None)

    def classify(code: int, sent: str | None) -> bool:
        child = Child(label="rank 1", argv=[], env={}, out_path=tmp_path / "out", rank=1)
        child.exit_code, child.signalled = code, sent
        return sup._classify(child)

    assert classify(-signal.SIGKILL, "SIGTERM")
    assert not classify(-signal.SIGKILL, "SIGKILL")
    assert not classify(-signal.SIGTERM, "SIGTERM")
    assert not classify(1, "SIGTERM")
    assert classify(-signal.SIGKILL, None) and classify(1, None)
