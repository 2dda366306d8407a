"""The three health figures (flowtrain.engine.health) against their definitions, on a 1-rank
engine with a calibrated host profile made up for the test."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from torch import nn

import engine_common as ec
from flowtrain.engine.health import ADAM_BYTES_PER_ELEMENT, meets

PEAK, BANDWIDTH = 50e9, 10e9


def _host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sims import hardware

    base = hardware.get_profile("a100-80g-x8")
    host = dataclasses.replace(base, name="this-host", kind="cpu",
                               peak_flops={**base.peak_flops, "float32": PEAK},
                               memory_bandwidth=BANDWIDTH)
    path = tmp_path / "host.json"
    host.save(path)
    monkeypatch.setenv("FLOWTRAIN_HOST_PROFILE", str(path))


def test_figures_follow_their_definitions(world1: Any, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from flowtrain import initialize

    _host(tmp_path, monkeypatch)
    model = ec.make_model(3)
    engine, _, _, _ = initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "steps_per_print": 1000, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}})
    try:
        for step in range(2):
            for m in range(2):
                x, y = ec.micro_batch(step, 0, m, 4)
                engine.backward(nn.functional.mse_loss(engine(x), y))
                engine.step()
        # 2·m·n·k per Linear on a micro-batch of 4: fc1 8->16, fc2 16->16, head 16->1
        forward = 2 * 4 * (8 * 16 + 16 * 16 + 16 * 1)
        assert engine.health.forward_flops == forward
        figures = engine.health.figures(0.5, 0.05)
        assert figures["mfu"] == pytest.approx(3 * forward * 2 / (0.5 * PEAK))
        params = sum(p.numel() for p in engine.trainable)
        traffic = 3 * 4 * params * 2 + ADAM_BYTES_PER_ELEMENT * params
        assert figures["mbu"] == pytest.approx(traffic / (0.5 * BANDWIDTH))
        assert figures["comm_share"] == pytest.approx(0.1)
    finally:
        engine.destroy()


def test_without_a_known_peak_the_figures_are_none(world1: Any, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from flowtrain import initialize

    monkeypatch.setenv("FLOWTRAIN_HOST_PROFILE", str(tmp_path / "none.json"))
    model = ec.make_model(3)
    engine, _, _, _ = initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}})
    try:
        x, y = ec.micro_batch(0, 0, 0, 4)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        figures = engine.health.figures(0.5, 0.2)
        assert figures["mfu"] is None and figures["mbu"] is None
        assert figures["comm_share"] == pytest.approx(0.4)
    finally:
        engine.destroy()


def test_targets() -> None:
    assert meets("mfu", 0.61) and not meets("mfu", 0.59)
    assert meets("mbu", 0.8) and not meets("mbu", 0.7)
    assert meets("comm_share", 0.1) and not meets("comm_share", 0.25)
    assert meets("mfu", None) is None
