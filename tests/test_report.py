"""flowtrain report: the JSON agrees with the libraries actually imported; the table is aligned."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import zmq

from flowtrain.report import format_report, report


@pytest.mark.timeout(60)
def test_report_json_matches_installed_versions() -> None:
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "report", "--json"],
                          capture_output=True, text=True, timeout=50)
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
