"""flowtrain.log: every field in the rank's file, a short rounded line on the console for the
events marked so, JSON lines on the console on request, levels by name."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from flowtrain.log import configure_logging, get_logger, log_level


def test_the_console_gets_a_short_line_and_the_file_everything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "rank0.jsonl"
    configure_logging(json_path=path, console="plain")
    get_logger("t").info("step", console=True, console_fields=("step", "loss"), step=7,
                         loss=1.234567891, grad_norm=0.98765, rss_mib=512.0)
    err = capsys.readouterr().err
    assert "step=7" in err and "loss=1.235" in err
    assert "grad_norm" not in err and "rss_mib" not in err
    line = json.loads(path.read_text().splitlines()[-1])
    assert line["loss"] == 1.234567891 and line["grad_norm"] == 0.98765
    assert "console_fields" not in line


def test_json_lines_on_the_console_on_request(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json_path=None, console="json")
    get_logger("t").info("step", console=True, console_fields=("step",), step=3, loss=2.5)
    record = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert record["event"] == "step" and record["loss"] == 2.5
    configure_logging(json_path=None, console="plain")


def test_levels_by_name() -> None:
    assert log_level("WARNING") == logging.WARNING and log_level(None) == logging.INFO
    with pytest.raises(ValueError, match="one of debug, info"):
        log_level("loud")
