"""`flowtrain simulate`: the report's figures against their formulas, sweeps ranked by
throughput, one-line errors (exit 2) naming the bad value and the choices, and --compare on a
real run directory (tests/data/sim_run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flowtrain.cli import main
from helpers import DATA
from sims.hardware import BUILTIN_PROFILES
from sims.models import get_model

RUN = DATA / "sim_run"


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}))
    return path


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["simulate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _one_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code, out, err = _run(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2, (code, out, err)
    assert len(lines) == 1, err
    assert lines[0].startswith("flowtrain simulate: error: "), lines[0]
    return lines[0]


def test_report_figures_follow_their_formulas(capsys: pytest.CaptureFixture[str], config: Path,
                                              tmp_path: Path) -> None:
    code, out, _ = _run(capsys, "--model", "gpt2", "--config", str(config), "--cluster",
                        "h100-x8", "--nodes", "2", "--json")
    assert code == 0
    p = json.loads(out)
    assert (p["world_size"], p["dp"], p["tp"], p["pp"]) == (16, 16, 1, 1)
    samples = 2 * 2 * 16
    assert p["samples_per_s"] == pytest.approx(samples / p["step_time_s"])
    assert p["tokens_per_s"] == pytest.approx(samples * 1024 / p["step_time_s"])
    flops = 3 * get_model("gpt2").forward_flops_per_sample * samples
    peak = BUILTIN_PROFILES["h100-x8"].peak_flops["bfloat16"]
    assert p["mfu"] == pytest.approx(flops / (p["step_time_s"] * peak * 16))
    assert 0 < p["mfu"] < 1
    assert p["resource_s"]["compute"] < p["step_time_s"]
    assert 0 <= p["exposed_comm_s"] <= p["comm_s"]
    assert p["overlap_pct"] == pytest.approx(100 * (1 - p["exposed_comm_s"] / p["comm_s"]))
    assert p["bubble_pct"] == 0.0
    assert 0 < p["peak_memory_bytes"] < p["device_memory_bytes"] and not p["oom"]
    assert p["memory"]["peak"] == p["peak_memory_bytes"]  # the breakdown comes with it
    assert p["memory"]["peak"] == pytest.approx(p["memory"]["model_states"] +
                                                p["memory"]["activations"] +
                                                p["memory"]["buffers"])

    trace = tmp_path / "trace.json"
    code, out, _ = _run(capsys, "--model", "gpt2", "--config", str(config), "--cluster",
                        "h100-x8", "--nodes", "2", "--trace", str(trace))
    assert code == 0
    for needle in ("gpt2, 2 x 8 ranks on h100-x8: dp 16, tp 1, pp 1", "step time", "samples/s",
                   "tokens/s", "MFU", "exposed comm", "overlap", "pipeline bubble  0.0 %",
                   "peak memory", "    parameters ", "optimizer states", "    activations ",
                   "1 micro-batch in flight", "    buffers ", "compute", "comm:dp",
                   f"trace written to {trace}"):
        assert needle in out, (needle, out)
    # the trace has the measured traces' layout: a track per kind of work, named as there
    from flowtrain.plan.trace_layout import track_of

    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e["name"] == "thread_name"}
    assert {"steps", "compute", "reduce"} <= set(tracks.values())
    for e in events:
        if e["ph"] == "X" and e["cat"] != "steps":
            assert tracks[(e["pid"], e["tid"])].rstrip(" 0123456789") == track_of(e["name"])


def test_pipeline_and_oom_are_reported(capsys: pytest.CaptureFixture[str], config: Path) -> None:
    code, out, _ = _run(capsys, "--model", "llama2-7b", "--config", str(config), "--nodes", "1",
                        "--tp", "2", "--pp", "4", "--seq-len", "2048", "--json")
    assert code == 0
    p = json.loads(out)
    assert (p["dp"], p["tp"], p["pp"]) == (1, 2, 4)
    # two micro-batches over four stages: at least the 1F1B bubble (p-1)/(m+p-1) = 3/5
    assert p["bubble_pct"] >= 60.0
    assert {"compute", "comm:tp", "comm:pp"} <= set(p["resource_s"])
    code, out, _ = _run(capsys, "--model", "llama2-70b", "--config", str(config))
    assert code == 0 and "OOM" in out  # 70B with ZeRO-1 on one node of 80 GB cards


def test_a_callable_that_builds_no_model_is_one_line(capsys: pytest.CaptureFixture[str],
                                                      config: Path) -> None:
    line = _one_error(capsys, "--model", "os:getcwd", "--seq-len", "8", "--config",
                      str(config))
    assert "returned str, not a torch.nn.Module" in line


def test_traced_model_gets_the_configs_batch_and_dtype(
        capsys: pytest.CaptureFixture[str], config: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Tracing itself is sims.models' (tested there, seconds per model); here: what is asked of it
    import sims.models

    calls: list[dict[str, Any]] = []

    def fake_trace(factory: str, **kwargs: Any) -> Any:
        calls.append({"factory": factory, **kwargs})
        return get_model("gpt2", kwargs["seq_len"])

    monkeypatch.setattr(sims.models, "trace_module", fake_trace)
    code, out, _ = _run(capsys, "--model", "pkg.mod:build", "--config", str(config),
                        "--seq-len", "256", "--json")
    assert code == 0, out
    assert calls == [{"factory": "pkg.mod:build", "seq_len": 256, "batch": 2,
                      "dtype": "bfloat16"}]
    assert json.loads(out)["tokens_per_s"] == pytest.approx(
        json.loads(out)["samples_per_s"] * 256)
    line = _one_error(capsys, "--model", "pkg.mod:build", "--config", str(config))
    assert "--seq-len is needed to trace 'pkg.mod:build'" in line


def test_sweep_ranks_by_throughput(capsys: pytest.CaptureFixture[str], config: Path) -> None:
    code, out, _ = _run(capsys, "--model", "gpt2", "--config", str(config), "--nodes", "2",
                        "--sweep", "zero_optimization.stage=0,1,2",
                        "--sweep", "train_micro_batch_size_per_gpu=1,4", "--json")
    assert code == 0
    rows = json.loads(out)["sweep"]
    assert sorted((r["values"]["zero_optimization.stage"],
                   r["values"]["train_micro_batch_size_per_gpu"]) for r in rows) == \
        [(s, m) for s in (0, 1, 2) for m in (1, 4)]
    rates = [r["samples_per_s"] for r in rows]
    assert rates == sorted(rates, reverse=True)
    assert all(r["zero_stage"] == r["values"]["zero_optimization.stage"] for r in rows)

    code, out, _ = _run(capsys, "--model", "gpt2", "--config", str(config),
                        "--sweep", "nodes=1,2", "--sweep", "pp=1,3")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == ("4 configurations of gpt2 on h100-x8, 2 fit the devices' memory; "
                        "those first, best throughput first:")
    assert lines[1].split()[:6] == ["nodes", "pp", "fits", "step", "(s)", "samples/s"]
    # pp 3 does not divide 8 ranks per node: listed last with the reason
    assert "cannot run: tp x pp = 3 must divide the world size 8" in lines[-2]


def test_sweep_lists_what_fits_first_and_marks_what_does_not(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                               "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                               "zero_optimization": {"stage": 0}}))
    # llama2-7b on one 8 x 80 GB node: unsharded Adam states (16 bytes a parameter) do not
    # fit at stages 0-1, and a micro-batch of 16 at 4K does not fit at any stage
    code, out, _ = _run(capsys, "--model", "llama2-7b", "--config", str(cfg),
                        "--sweep", "zero_optimization.stage=0,1,2,3",
                        "--sweep", "train_micro_batch_size_per_gpu=1,16", "--json")
    assert code == 0
    rows = json.loads(out)["sweep"]
    fits = [r["peak_memory_bytes"] <= r["device_memory_bytes"] for r in rows]
    assert any(fits) and not all(fits)
    assert fits == sorted(fits, reverse=True)  # every fitting row above every OOM row
    for group in (True, False):
        rates = [r["samples_per_s"] for r, f in zip(rows, fits) if f is group]
        assert rates == sorted(rates, reverse=True)
    code, out, _ = _run(capsys, "--model", "llama2-7b", "--config", str(cfg),
                        "--sweep", "zero_optimization.stage=0,1,2,3",
                        "--sweep", "train_micro_batch_size_per_gpu=1,16")
    table = out.splitlines()[2:]
    marks = [line.split()[2] for line in table]
    assert marks == ["yes"] * sum(fits) + ["OOM"] * (len(fits) - sum(fits))
    # one unit per column: every step figure is a plain number of seconds
    assert all(float(line.split()[3]) > 0 for line in table)


def test_sweep_progress_on_a_terminal(capsys: pytest.CaptureFixture[str], config: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    code, out, _ = _run(capsys, "--model", "gpt2", "--config", str(config),
                        "--sweep", "gradient_accumulation_steps=1,2,3,4")
    assert code == 0 and len(out.splitlines()) == 6


@pytest.mark.parametrize("args,needles", [
    (["--model", "gpt9"], ["unknown model preset 'gpt9'", "gpt2-xl", "llama2-70b"]),
    (["--model", "gpt2", "--cluster", "b200-x8"],
     ["unknown hardware profile 'b200-x8'", "h100-x8", "a100-80g-x8", "this-host"]),
    (["--model", "gpt2", "--sweep", "zero_optimization.stag=1,2"],
     ["unknown key 'zero_optimization.stag'", "did you mean zero_optimization.stage"]),
    (["--model", "gpt2", "--sweep", "bogus=1"], ["unknown key 'bogus'", "nodes, tp, pp"]),
    (["--model", "gpt2", "--sweep", "zero_optimization.stage"], ["expected KEY=V1,V2"]),
    (["--model", "gpt2", "--sweep", "zero_optimization.stage=[1]"], ["JSON scalars", "[1]"]),
    (["--model", "gpt2", "--tp", "3"], ["tp 3 must divide the 8 devices per node", "1, 2, 4, 8"]),
    (["--model", "gpt2", "--nodes", "0"], ["--nodes must be at least 1, got 0"]),
])
def test_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], config: Path,
                               args: list[str], needles: list[str]) -> None:
    line = _one_error(capsys, "--config", str(config), *args)
    for needle in needles:
        assert needle in line, (needle, line)


def test_bad_config_and_missing_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    line = _one_error(capsys, "--model", "gpt2")
    assert "missing --config" in line and "usage" in line
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 0,
                               "zero_optimization": {"stage": 2}}))
    line = _one_error(capsys, "--model", "gpt2", "--config", str(bad))
    assert "train_micro_batch_size_per_gpu" in line and str(bad) in line
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                               "zero_optimization": {"stage": 2}}))
    line = _one_error(capsys, "--model", "gpt2", "--config", str(bad), "--cp", "3")
    assert "--cp 3 must divide the sequence length 1024" in line
    line = _one_error(capsys, "--model", "gpt2", "--config", str(bad), "--recompute", "half")
    assert "--recompute" in line and "half" in line


def _cpu_profile(tmp_path: Path) -> Path:
    data: dict[str, Any] = BUILTIN_PROFILES["h100-x8"].to_dict()
    data.update(name="test-cpu", kind="cpu", devices_per_node=2, comm_compute_interference=0.5)
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(data))
    return path


def test_compare_on_a_recorded_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    profile = _cpu_profile(tmp_path)
    code, out, _ = _run(capsys, "--compare", str(RUN), "--cluster", str(profile), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["ranks"] == 2 and data["steps_per_rank"] == 5  # 6 recorded, the first skipped
    rows = {r["class"]: r for r in data["classes"]}
    assert set(rows) == {"forward", "backward", "reduce", "optimizer", "step"}
    # forward per step, steps 2-6: rank 0 median 9.6588 ms, rank 1 median 20.0616 ms
    assert rows["forward"]["measured_s"] == pytest.approx((0.0096588 + 0.0200616) / 2)
    # first span start to last span end: medians 74.4626 ms and 74.2682 ms
    assert rows["step"]["measured_s"] == pytest.approx((0.0744626 + 0.0742682) / 2)
    assert rows["step"]["predicted_s"] == pytest.approx(data["prediction"]["step_time_s"])
    for r in rows.values():
        assert r["error_pct"] == pytest.approx(100 * (r["predicted_s"] - r["measured_s"])
                                               / r["measured_s"])
    # the 2 ranks run on one host: ZeRO 1 all-reduces 9 buckets, the CPU profile's interference
    assert data["prediction"]["zero_stage"] == 1
    assert data["prediction"]["resource_s"]["comm:dp"] > 0

    code, out, _ = _run(capsys, "--compare", str(RUN), "--cluster", str(profile))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"{RUN}: 2 ranks, ZeRO stage 1, 2 ranks x 5 steps measured")
    assert [line.split()[0] for line in lines[2:]] == \
        ["forward", "backward", "reduce", "optimizer", "step"]


def test_compare_errors_name_the_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    line = _one_error(capsys, "--compare", str(tmp_path / "nope"), "--cluster", "h100-x8")
    assert "does not exist" in line and "nope" in line
    (tmp_path / "run").mkdir()
    line = _one_error(capsys, "--compare", str(tmp_path / "run"), "--cluster", "h100-x8")
    assert "plan.json" in line and "is missing" in line
    (tmp_path / "run" / "plan.json").write_text((RUN / "plan.json").read_text())
    (tmp_path / "run" / "spans").mkdir()
    (tmp_path / "run" / "spans" / "rank0.jsonl").write_text('{"v": 1, "step": 1}\n')
    line = _one_error(capsys, "--compare", str(tmp_path / "run"), "--cluster", "h100-x8")
    assert "rank0.jsonl" in line and "line 1" in line
    line = _one_error(capsys, "--compare", str(RUN), "--cluster", "h100-x8", "--nodes", "3")
    assert "--nodes 3 does not divide the run's world size 2" in line


def test_compare_notes_placeholder_shapes(capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "spans").mkdir(parents=True)
    plan = json.loads((RUN / "plan.json").read_text())
    plan["param_specs"][2][1] = [0]  # what a ZeRO-3 parameter looks like once partitioned
    (run / "plan.json").write_text(json.dumps(plan))
    (run / "spans" / "rank0.jsonl").write_text((RUN / "spans" / "rank0.jsonl").read_text())
    code, out, _ = _run(capsys, "--compare", str(run), "--cluster", "h100-x8")
    assert code == 0
    assert f"note: plan.json lists 1 of {len(plan['param_specs'])} parameters with no " \
           f"elements (first: {plan['param_specs'][2][0]})" in out


def test_calibrate_is_registered(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "--help"])
    assert exc.value.code == 0
    assert "--quick" in capsys.readouterr().out


def test_host_speed_scales_every_task(capsys: pytest.CaptureFixture[str], config: Path,
                                      tmp_path: Path) -> None:
    """--host-speed F: every predicted task takes F times as long, so the step, the time per
    resource and the exposed communication scale by F and throughput by 1/F; --compare's
    predicted classes too."""
    args = ["--model", "gpt2", "--config", str(config), "--cluster", "h100-x8", "--json"]
    _, out, _ = _run(capsys, *args)
    base = json.loads(out)
    _, out, _ = _run(capsys, *args, "--host-speed", "1.25")
    slow = json.loads(out)
    assert slow["step_time_s"] == pytest.approx(1.25 * base["step_time_s"])
    assert slow["samples_per_s"] == pytest.approx(base["samples_per_s"] / 1.25)
    assert slow["exposed_comm_s"] == pytest.approx(1.25 * base["exposed_comm_s"])
    for resource, seconds in base["resource_s"].items():
        assert slow["resource_s"][resource] == pytest.approx(1.25 * seconds)
    assert any("host speed 1.250" in n and "25.0 % slower" in n for n in slow["notes"])

    profile = _cpu_profile(tmp_path)
    compare = ["--compare", str(RUN), "--cluster", str(profile), "--json"]
    _, out, _ = _run(capsys, *compare)
    rows = {r["class"]: r for r in json.loads(out)["classes"]}
    _, out, _ = _run(capsys, *compare, "--host-speed", "0.8")
    fast = {r["class"]: r for r in json.loads(out)["classes"]}
    for c, row in rows.items():
        assert fast[c]["predicted_s"] == pytest.approx(0.8 * row["predicted_s"]), c
        assert fast[c]["measured_s"] == row["measured_s"]


@pytest.mark.parametrize("value,needle", [
    ("0", "a positive factor"), ("-1", "a positive factor"), ("nan", "a positive factor"),
    ("fast", "auto or a positive factor"), ("auto", "'h100-x8' has no engine costs")])
def test_bad_host_speed_is_one_line(capsys: pytest.CaptureFixture[str], config: Path,
                                    value: str, needle: str) -> None:
    line = _one_error(capsys, "--model", "gpt2", "--config", str(config), "--cluster",
                      "h100-x8", "--host-speed", value)
    assert "--host-speed" in line and needle in line and (value in line or value == "auto"), line
