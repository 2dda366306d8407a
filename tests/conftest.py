"""Fixtures the test modules share; the plain helpers are in helpers.py. pyproject's pytest
``pythonpath`` makes tests/, tests/data and examples importable, so test modules import
``helpers``, the workers' shared ``engine_common`` and the example ``gpt`` by name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import helpers


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # Textual and the control plane run on asyncio


@pytest.fixture
def world1() -> Iterator[None]:
    """This test runs flowtrain.initialize in this process at world size 1."""
    with helpers.world1():
        yield


@pytest.fixture(scope="module")
def module_world1() -> Iterator[None]:
    """One world of size 1 in this process for all of a module's tests."""
    with helpers.world1():
        yield


@pytest.fixture
def recording(tmp_path: Path) -> Path:
    """The monitor tests' synthetic 2-rank recording, written as a run's telemetry.msgpack."""
    from tui_helpers import synthetic_records, write_recording

    path = tmp_path / "run" / "telemetry.msgpack"
    path.parent.mkdir()
    write_recording(path, synthetic_records())
    return path
