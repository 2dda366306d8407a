"""torchrun's elastic shrink through a hostfile (issue 18): 4 ranks on 2 "hosts" (the ssh
stand-in), one host lost at step 12 of 20 -> `--nnodes 1:2 --max-restarts 1` goes on with the
2 ranks of the other host from the last checkpoint (step 10), resharded, with the same global
batch (each rank accumulates 2 micro-batches instead of 1): the losses of both attempts equal
an uninterrupted run's, trained in this process on the same global batches."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from helpers import DATA, LAUNCH, launcher_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
WORKER = DATA / "elastic_worker.py"
FAKE_SSH = f"bash {DATA / 'fake_ssh.sh'}"
STEPS, KILL_AT = 20, 12


def _launch(tmp_path: Path, name: str, args: list[str], kill_at: int) -> tuple[Path, Path]:
    out = tmp_path / name
    out.mkdir()
    proc = subprocess.run([*LAUNCH, "--run-dir", str(out / "run"), *args, str(WORKER),
                           str(out), str(out / "ckpt"), str(kill_at), str(STEPS)],
                          cwd=tmp_path, env=launcher_env(), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return out, out / "run"


def _reference_losses() -> dict[int, float]:
    """Each step's global mean loss, in one process: the global batch as the workers'
    micro-batches, their gradients averaged, clipped at the engine's default norm of 1.0."""
    import torch
    from torch import nn

    from elastic_worker import GLOBAL, MICRO, samples
    from engine_common import make_model
    from flowtrain.optimizers import build_optimizer

    model = make_model(0)
    optimizer = build_optimizer("AdamW", model.parameters(), {"lr": 0.01})
    parts, losses = GLOBAL // MICRO, {}
    for step in range(STEPS):
        model.zero_grad()
        total = 0.0
        for index in range(parts):
            x, y = samples(step, index)
            loss = nn.functional.mse_loss(model(x), y)
            (loss / parts).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses[step] = total / parts
    return losses


def _losses(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]


def test_lost_host_shrinks_the_job_and_the_losses_continue(tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n127.0.0.1 slots=2\n")
    out, run_dir = _launch(tmp_path, "elastic", ["-H", str(hostfile), "--ssh-command", FAKE_SSH,
                                                 "--nnodes", "1:2", "--max-restarts", "1"],
                           KILL_AT)
    reference = _reference_losses()
    seen = _losses(out)
    first = [r for r in seen if r["attempt"] == 0]
    second = [r for r in seen if r["attempt"] == 1]
    assert {r["world"] for r in first} == {4} and {r["gas"] for r in first} == {1}
    # resumed from the step-10 checkpoint on the surviving host's 2 ranks
    assert [r["step"] for r in second] == list(range(10, STEPS))
    assert {r["world"] for r in second} == {2} and {r["gas"] for r in second} == {2}
    for r in first + second:
        assert r["loss"] == pytest.approx(reference[r["step"]], rel=1e-5, abs=1e-7), r
    restarts = json.loads((run_dir / "restarts.json").read_text())
    assert [a["world_size"] for a in restarts] == [4, 2]
    assert restarts[1]["hosts"] == ["localhost"] and restarts[1]["exit_code"] == 0
    job = json.loads((run_dir / "attempt0" / "job.json").read_text())
    assert job["lost_hosts"] == ["127.0.0.1"]


def test_elastic_flags_are_checked(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    for args, text in ((["--nnodes", "1:2", "--max-restarts", "1"], "needs --hostfile"),
                       (["--nnodes", "1:2"], "needs --hostfile")):
        proc = subprocess.run([*LAUNCH, *args, str(script)], cwd=tmp_path, env=launcher_env(),
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and text in proc.stderr, proc.stderr
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    for args, text in ((["--nnodes", "1:2"], "add --max-restarts"),
                       (["--nnodes", "3:4", "--max-restarts", "1"], "does not admit")):
        proc = subprocess.run([*LAUNCH, "-H", str(hostfile), "--ssh-command", FAKE_SSH, *args,
                               str(script)], cwd=tmp_path, env=launcher_env(),
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and text in proc.stderr, proc.stderr
