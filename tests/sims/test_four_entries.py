"""One architecture entered four ways into `flowtrain simulate` (a preset, an architecture file,
a Hugging Face config.json, the transformers module traced on the meta device) predicts the same
step time and peak memory (within 2 %) on A100 and H100 profiles, and a traced module's
attention kernel changes the prediction as it does the preset's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flowtrain.cli import main
from sims.architecture import PRESETS
from sims.model_files import architecture_dict

pytest.importorskip("transformers", reason="the traced entries are transformers' own modules")

import hf_models  # noqa: E402

# preset -> (Hugging Face config, factory, sequence length)
ARCHITECTURES = {
    "gpt2-medium": (hf_models.GPT2_MEDIUM, "gpt2_medium", 1024),  # LayerNorm, GeLU, dropout
    "llama3-8b": (hf_models.LLAMA3_8B, "llama3_8b", 2048),  # GQA, SwiGLU, rotary
    "opt-1.3b": (hf_models.OPT_1B3, "opt_1b3", 2048),  # one ReLU MLP, learned positions
    "falcon-7b": (hf_models.FALCON_7B, "falcon_7b", 2048),  # multi-query, parallel block
}
CLUSTERS = ("a100-80g-x8", "h100-x8")
# ZeRO-3 over the node, two micro-batches of two
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
          "gradient_clipping": 1.0}


def _predict(capsys: pytest.CaptureFixture[str], model: str, cluster: str, seq: int,
             config: Path, *extra: str) -> dict[str, Any]:
    code = main(["simulate", "--model", model, "--config", str(config), "--cluster", cluster,
                 "--seq-len", str(seq), "--json", *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    return dict(json.loads(out))


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "ds_config.json").write_text(json.dumps(CONFIG))
    for preset, (config, _, _) in ARCHITECTURES.items():
        (tmp_path / f"{preset}.arch.json").write_text(
            json.dumps(architecture_dict(PRESETS[preset], name=preset)))
        (tmp_path / f"{preset}.config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("preset", sorted(ARCHITECTURES))
def test_four_entries_predict_the_same_step(capsys: pytest.CaptureFixture[str], files: Path,
                                            preset: str) -> None:
    _, factory, seq = ARCHITECTURES[preset]
    config = files / "ds_config.json"
    for cluster in CLUSTERS:
        entries = {"preset": preset, "file": str(files / f"{preset}.arch.json"),
                   "hf": str(files / f"{preset}.config.json"),
                   "traced": f"hf_models:{factory}"}
        got = {name: _predict(capsys, model, cluster, seq, config)
               for name, model in entries.items()}
        base = got["preset"]
        for name, p in got.items():
            assert p["step_time_s"] == pytest.approx(base["step_time_s"], rel=0.02), \
                (cluster, name, p["step_time_s"], base["step_time_s"])
            assert p["peak_memory_bytes"] == pytest.approx(base["peak_memory_bytes"],
                                                           rel=0.02), (cluster, name)
        # the file and the config are the preset exactly
        for name in ("file", "hf"):
            assert got[name]["step_time_s"] == base["step_time_s"]
            assert got[name]["peak_memory_bytes"] == base["peak_memory_bytes"]


@pytest.mark.parametrize("preset", ["gpt2-medium", "llama3-8b"])
def test_a_traced_module_follows_the_attention_kernel(capsys: pytest.CaptureFixture[str],
                                                      files: Path, preset: str) -> None:
    _, factory, seq = ARCHITECTURES[preset]
    config = files / "ds_config.json"
    for model in (preset, f"hf_models:{factory}"):
        flash = _predict(capsys, model, "h100-x8", seq, config, "--attention", "flash2")
        unfused = _predict(capsys, model, "h100-x8", seq, config, "--attention", "unfused")
        if model == preset:
            ratio = unfused["step_time_s"] / flash["step_time_s"]
            grown = unfused["peak_memory_bytes"] - flash["peak_memory_bytes"]
            # the unfused core is slower and keeps its s x s maps
            assert ratio > 1.05 and grown > 0
        else:
            assert unfused["step_time_s"] / flash["step_time_s"] == \
                pytest.approx(ratio, rel=0.02)
            assert unfused["peak_memory_bytes"] - flash["peak_memory_bytes"] == \
                pytest.approx(grown, rel=0.02)


def test_a_tiny_hugging_face_model_three_ways(capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(CONFIG))
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps(hf_models.TINY_LLAMA))
    from sims.model_files import read_model_file

    arch, _, _, _ = read_model_file(str(hf))
    file = tmp_path / "tiny.json"
    file.write_text(json.dumps(architecture_dict(arch)))
    for cluster in CLUSTERS:
        got = [_predict(capsys, model, cluster, 512, config)
               for model in (str(file), str(hf), "hf_models:tiny_llama")]
        for p in got[1:]:
            assert p["step_time_s"] == pytest.approx(got[0]["step_time_s"], rel=0.02)
            assert p["peak_memory_bytes"] == pytest.approx(got[0]["peak_memory_bytes"],
                                                           rel=0.02)


def test_explain_names_what_the_trace_recognized(capsys: pytest.CaptureFixture[str],
                                                 files: Path) -> None:
    code = main(["simulate", "--model", "hf_models:gpt2_medium", "--config",
                 str(files / "ds_config.json"), "--cluster", "h100-x8", "--seq-len", "1024",
                 "--explain"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "traced module: 24 layers; 97 matmuls, 24 attentions (24 sdpa)" in out
    assert "the cross-entropy a training script computes over them is added" in out
    assert "roofline" not in out
