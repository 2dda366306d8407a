"""A published run (``published_runs.json``) entered as a user enters a run into `flowtrain
simulate`: an architecture file, a ds_config.json and the command's flags, then the command
itself, whose JSON output is the prediction."""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# the builtin node profile of each GPU name the runs use
GPU_PROFILES = {"a100-40g": "a100-40g-x8", "a100-80g": "a100-80g-x8", "h100-sxm": "h100-x8",
                "h100-sxm-hbm2e-capped": "h100-hbm2e-x8", "h200": "h200-x8"}
# each network's line rate per NIC, Gb/s one direction
NETWORKS = {"ib-hdr-200": 200, "roce-200": 200, "ib-ndr-400": 400, "roce-400": 400,
            "rdma-400": 400, "omnipath-100": 100}
# fp8 runs train in bf16 with fp8 GEMMs (--fp8)
PRECISION = {"fp16": "fp16", "bf16": "bf16", "fp8": "bf16"}
# the framework each source trained with (sims.frameworks; a run's own "framework" wins)
SOURCE_FRAMEWORKS = {
    "megatron-2021": "megatron-lm", "korthikanti-2022": "megatron-lm",
    "megatron-lm-readme": "megatron-lm",
    "megatron-lm-readme-2024": "megatron-core", "nemo-24.07-perf": "megatron-core",
    "megatron-bridge-25.11-perf": "megatron-core",
    # NeMo 1.x: Megatron-LM's layers with Apex's DistributedFusedAdam, which reduce-scatters
    # gradient buckets during backward and gathers the parameters under the next forward
    "nemo-megatron-launcher-2022": "megatron-core",
    "bloom-2022": "megatron-deepspeed", "mtnlg-2022": "megatron-deepspeed",
    "opt-2022": "fsdp1",  # metaseq: FairScale's fully sharded data parallel
    "torchtitan-bench": "fsdp", "nemo-automodel-perf": "fsdp",  # FSDP2
    "llmfoundry-bench": "llm-foundry", "llama3-2024": "llama3",
}
# what a run's model record may say beyond its family (sims.model_files.ArchitectureFile)
FEATURES = ("norm", "activation", "position", "biases", "parallel_block", "head_dim")


def framework(run: Mapping[str, Any]) -> str:
    """The framework ``run`` trained with."""
    name = run.get("framework") or SOURCE_FRAMEWORKS.get(run["source"])
    if name is None:
        raise KeyError(f"source {run['source']!r} of {run['id']} has no framework in "
                       f"SOURCE_FRAMEWORKS; add the one it trained with (or a 'framework' "
                       f"field to the run)")
    return str(name)


def architecture_file(run: Mapping[str, Any]) -> dict[str, Any]:
    """The run's model as an architecture file (``sims.model_files``)."""
    m = run["model"]
    seq = int(m["seq_len"])
    out: dict[str, Any] = {
        "name": run["id"], "family": "llama" if m["family"] == "llama" else "gpt2",
        "layers": int(m["layers"]), "hidden": int(m["hidden"]), "heads": int(m["heads"]),
        "kv_heads": int(m.get("kv_heads") or m["heads"]), "ffn": int(m["ffn"]),
        "vocab": int(m["vocab"]), "context": seq, "seq_len": seq,
        "dropout": bool(m.get("dropout", False)), "source": run["citation"]}
    if m.get("tied_embeddings") is not None:
        out["tied_embeddings"] = bool(m["tied_embeddings"])
    out.update({k: m[k] for k in FEATURES if m.get(k) is not None})
    return out


def ds_config(run: Mapping[str, Any]) -> dict[str, Any]:
    """The run's batch, ZeRO stage, precision and reduce dtype as a ds_config: gradient
    accumulation fills the global batch over the data-parallel ranks (context-parallel ranks
    among them, each holding 1/cp of a sequence)."""
    par, batch, train = run["parallel"], run["batch"], run["training"]
    gpus = int(run["hardware"]["gpus"])
    cp, tp, pp = int(par.get("cp") or 1), int(par["tp"]), int(par["pp"])
    dp = gpus // (tp * pp)
    micro = int(batch["micro_batch"])
    precision = PRECISION[train["precision"]]
    virtual = int(par.get("virtual_stages") or 1)
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": max(1, int(batch["global_batch"]) * cp // (micro * dp)),
        "gradient_clipping": 1.0,
        precision: {"enabled": True},
        "zero_optimization": {"stage": int(par.get("zero_stage") or 0)},
        "communication_data_type": train.get("grad_reduce_dtype") or
        ("fp32" if precision == "bf16" else "fp16"),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        **({"pipeline": {"schedule": "interleaved", "virtual_stages": virtual}}
           if virtual > 1 and pp > 1 else {}),
    }


def command(run: Mapping[str, Any], directory: Path) -> list[str]:
    """``flowtrain simulate``'s arguments for ``run``, its architecture file and ds_config
    written into ``directory``."""
    rid = run["id"]
    model = directory / f"{rid}.model.json"
    config = directory / f"{rid}.ds_config.json"
    model.write_text(json.dumps(architecture_file(run), indent=1) + "\n")
    config.write_text(json.dumps(ds_config(run), indent=1) + "\n")
    hw, par, train = run["hardware"], run["parallel"], run["training"]
    gpus, per_node = int(hw["gpus"]), int(hw.get("gpus_per_node") or 8)
    argv = ["simulate", "--model", str(model), "--config", str(config),
            "--cluster", GPU_PROFILES[hw["gpu"]], "--nodes", str(gpus // per_node),
            "--devices-per-node", str(per_node), "--tp", str(par["tp"]), "--pp", str(par["pp"]),
            "--seq-len", str(run["model"]["seq_len"]), "--framework", framework(run),
            "--recompute", str(train.get("recompute") or "none")]
    if int(par.get("cp") or 1) > 1:
        argv += ["--cp", str(par["cp"])]
    rate = NETWORKS.get(str(hw.get("inter_node")))
    if rate is not None:
        argv += ["--nic-gbps", str(rate), "--nics-per-node",
                 str(hw.get("nics_per_node") or per_node)]
    attention = train.get("attention") or (None if train.get("flash_attention") else "unfused")
    if attention:
        argv += ["--attention", attention]
    if par.get("sequence_parallel") and int(par["tp"]) > 1:
        argv.append("--sequence-parallel")
    if par.get("tp_overlap"):
        argv.append("--tp-overlap")
    if par.get("fsdp"):
        argv.append("--fsdp")
    if train["precision"] == "fp8":
        argv.append("--fp8")
    if train.get("elementwise"):
        argv += ["--elementwise", str(train["elementwise"])]
    if run.get("assumed_inputs"):
        # what the source does not state: the range covers its alternatives
        argv += ["--assumed", ",".join(run["assumed_inputs"])]
    return argv


def shell_line(argv: list[str]) -> str:
    return "flowtrain " + " ".join(shlex.quote(a) for a in argv)


def simulate(run: Mapping[str, Any], directory: Path | None = None, *,
             subprocess_cli: bool = False) -> SimpleNamespace:
    """The prediction `flowtrain simulate --json` prints for ``run`` (its fields as
    attributes); the command runs in this process (``flowtrain.cli.main``, what the console
    script calls) or, with ``subprocess_cli``, as the installed command."""
    with _directory(directory) as where:
        argv = command(run, where) + ["--json"]
        if subprocess_cli:
            done = subprocess.run([sys.executable, "-m", "flowtrain.cli", *argv],
                                  capture_output=True, text=True, timeout=600, check=False)
            out, code, err = done.stdout, done.returncode, done.stderr
        else:
            from flowtrain.cli import main

            buffer, errors = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(errors):
                code = main(argv)
            out, err = buffer.getvalue(), errors.getvalue()
    if code != 0:
        raise RuntimeError(f"{run['id']}: {shell_line(argv)} exited {code}: {err.strip()}")
    return SimpleNamespace(**json.loads(out))


def prepare(run: Mapping[str, Any], directory: Path | None = None) -> tuple[Any, ...]:
    """(model, config, layout, hardware, options): what the command resolves ``run``'s flags
    and files to before predicting (``sims.prediction.resolve_inputs``), for tests that look
    inside the step."""
    from flowtrain.cli import build_parser
    from sims.prediction import load_profile, read_config, resolve_inputs, with_network

    with _directory(directory) as where:
        argv = command(run, where)
        ns = build_parser("simulate").parse_args(argv)
        hw = with_network(load_profile(ns.cluster), ns.nic_gbps, ns.nics_per_node)
        got = resolve_inputs(ns, read_config(ns.config), hw, {}, "config", {})
    return got.model, got.cfg, got.layout, got.hw, got.options


@contextlib.contextmanager
def _directory(directory: Path | None) -> Any:
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        yield directory
        return
    with tempfile.TemporaryDirectory(prefix="published-") as temp:
        yield Path(temp)
