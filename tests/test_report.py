"""flowtrain report: the JSON agrees with the libraries actually imported; the table is aligned."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import zmq

from flowtrain.report import format_report, report


@pytest.mark.timeout(150)
def test_report_json_matches_installed_versions() -> None:
    # Generous: with a cold numba cache the kernel rows compile every CPU kernel first.
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "report", "--json"],
                          capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["torch"]["version"] == torch.__version__
    assert data["torch"]["cuda_available"] == torch.cuda.is_available()
    assert data["torch"]["gloo_available"] is True
    assert data["pyzmq"]["libzmq_version"] == zmq.zmq_version()
    assert data["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert data["system"]["cpu_count"] >= 1
    assert data["system"]["memory_total_bytes"] >= data["system"]["memory_available_bytes"] > 0
    import numba

    assert data["numba"]["version"] == numba.__version__
    kernels = {row["kernel"]: row for row in data["kernels"]["rows"]}
    assert set(kernels) == {"adam", "lion", "sgd", "unscale_check", "sum_squares", "cast"}
    assert all(row["cpu"].startswith("ok") for row in kernels.values()), kernels
    from numba import cuda

    cuda_word = "available" if cuda.is_available() else "no device"
    assert all(row["cuda"].startswith(cuda_word) for row in kernels.values()), kernels


@pytest.mark.timeout(60)
def test_report_table_is_aligned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    data = report()
    assert data["numba"]["cuda_simulator"] is True
    text = format_report(data)
    rows = [line for line in text.splitlines() if not line.startswith("-")]
    columns = {line.index(" ", line.index("..")) for line in rows}
    assert len(columns) == 1, text
    assert "gloo available" in text and "pydantic" in text
