"""Bad input to `flowtrain launch` is one line on stderr, naming the problem and the value;
exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flowtrain.cli import main
from helpers import LAUNCH, one_error_line


def _launch(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LAUNCH, *args], cwd=cwd, capture_output=True, text=True, timeout=50)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return path


@pytest.mark.timeout(60)
def test_missing_script(tmp_path: Path) -> None:
    line = one_error_line(_launch(["--nproc-per-node", "2", "nope.py"], tmp_path))
    assert "nope.py" in line and "does not exist" in line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["0", "-3"])
def test_nproc_per_node_must_be_positive(tmp_path: Path, script: Path, value: str) -> None:
    line = one_error_line(_launch([f"--nproc-per-node={value}", str(script)], tmp_path))
    assert "--nproc-per-node" in line and value in line and "at least 1" in line


@pytest.mark.timeout(60)
def test_unreadable_hostfile(tmp_path: Path, script: Path) -> None:
    line = one_error_line(_launch(["--hostfile", str(tmp_path / "hosts"), str(script)], tmp_path))
    assert "hostfile" in line and str(tmp_path / "hosts") in line


@pytest.mark.timeout(60)
def test_malformed_hostfile_names_file_and_line(tmp_path: Path, script: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("# workers\nnode1 slots=2\nnode2 slots=two\n")
    line = one_error_line(_launch(["-H", str(hosts), str(script)], tmp_path))
    assert str(hosts) in line and "line 3" in line and "'two'" in line


def test_in_process_errors(capsys: pytest.CaptureFixture[str], script: Path) -> None:
    cases = [
        (["launch", "--nnodes", "2", "--node-rank", "2", str(script)], "--node-rank", "2"),
        (["launch", "--master-port", "70000", str(script)], "--master-port", "70000"),
        (["launch", "--nproc-per-node", "x", str(script)], "--nproc-per-node", "'x'"),
        (["launch", "--grace-period", "-1", str(script)], "--grace-period", "-1"),
        (["launch"], "missing the script", "usage"),
        (["launch", "--bogus", str(script)], "unrecognized", "--bogus"),
        (["launch", "--include", "a", str(script)], "--include", "--hostfile"),
    ]
    for argv, *needles in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, (argv, err)
        for needle in needles:
            assert needle in err[0], (argv, err)


def test_multinode_without_secret_or_job_key_says_how_to_set_it(
        capsys: pytest.CaptureFixture[str], script: Path, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    monkeypatch.delenv("FLOWTRAIN_JOB_SECRET", raising=False)
    # no ~/.flowtrain/job-key can be made under a home that is a file
    (tmp_path / "home").write_text("")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    code = main(["launch", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                 "--run-dir", str(tmp_path / "run"), str(script)])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "FLOWTRAIN_JOB_SECRET" in err[0] and "export" in err[0], err


def test_importing_cli_does_not_import_sims_or_tui() -> None:
    code = ("import sys, flowtrain.cli; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('sims', 'tui')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("job_id", ["../../escape", "a/b", ".hidden", ""])
def test_job_id_must_be_a_plain_name(tmp_path: Path, script: Path, job_id: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    proc = _launch(["--job-id", job_id, str(script)], work)
    if job_id == "":  # empty: the generated id is used, the job runs
        assert proc.returncode == 0, proc.stderr
        return
    line = one_error_line(proc)
    assert "--job-id must be a plain name" in line and repr(job_id) in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py", "work"]
    assert not (work / "runs").exists()
