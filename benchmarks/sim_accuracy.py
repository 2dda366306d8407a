"""How close `flowtrain simulate` comes to real runs on this machine: for each config (ZeRO
stages 0-3, accumulation, bucket sizes, prefetch, CPU offload) launch a small training job with
`flowtrain launch`, then predict it with `simulate --compare` against this host's calibrated
profile, and print predicted vs measured step time per config and the mean absolute
percentage error (MAPE) per task class.

    .venv/bin/flowtrain calibrate            # once: writes the this-host profile
    .venv/bin/python benchmarks/sim_accuracy.py [--ranks 2] [--steps 24] [--only 10,13]

The same file is the training script (``--worker``): a residual MLP whose parameter names carry
layer numbers, as the simulator's planner expects.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SMALL_BUCKET = 200_000
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("dp, 1 micro-batch", {"zero_optimization": {"stage": 0}}),
    ("dp, 2 micro-batches", {"zero_optimization": {"stage": 0}, "gradient_accumulation_steps": 2}),
    ("dp, small buckets", {"zero_optimization": {"stage": 0, "reduce_bucket_size": SMALL_BUCKET}}),
    ("zero1", {"zero_optimization": {"stage": 1}}),
    ("zero1, 2 micro-batches", {"zero_optimization": {"stage": 1},
                                "gradient_accumulation_steps": 2}),
    ("zero1, small buckets", {"zero_optimization": {"stage": 1,
                                                    "reduce_bucket_size": SMALL_BUCKET}}),
    ("zero2", {"zero_optimization": {"stage": 2}}),
    ("zero2, 2 micro-batches", {"zero_optimization": {"stage": 2},
                                "gradient_accumulation_steps": 2}),
    ("zero2, offload", {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}),
    ("zero3", {"zero_optimization": {"stage": 3}}),
    ("zero3, no prefetch", {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0}}),
    ("zero3, 2 micro-batches", {"zero_optimization": {"stage": 3},
                                "gradient_accumulation_steps": 2}),
    ("zero3, offload", {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}),
]
CLASSES = ("forward", "backward", "reduce", "gather", "optimizer", "step")


def worker(config: str, steps: int, width: int, layers: int) -> None:
    """The training job one config runs (every rank)."""
    import torch
    from torch import nn

    import flowtrain

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(width, 4 * width)
            self.proj = nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.proj(torch.relu(self.fc(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(64, width)
            self.layers = nn.ModuleList(Block() for _ in range(layers))
            self.head = nn.Linear(width, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.embed(x)
            for block in self.layers:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    flowtrain.init_distributed()
    net = Net()
    engine, _, _, _ = flowtrain.initialize(model=net, model_parameters=net.parameters(),
                                           config=config)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x = torch.randn(engine.train_micro_batch_size_per_gpu(), 64, generator=generator)
        y = torch.randint(0, 10, (x.shape[0],), generator=generator)
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        engine.step()


def launch(name: str, overrides: dict[str, Any], workdir: Path, args: argparse.Namespace) -> Path:
    config = {"train_micro_batch_size_per_gpu": args.micro_batch,
              "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    config.update(overrides)
    slug = "".join(c if c.isalnum() else "-" for c in name)
    config_path = workdir / f"{slug}.json"
    config_path.write_text(json.dumps(config))
    run_dir = workdir / slug
    cmd = [sys.executable, "-m", "flowtrain.cli", "launch", "--nproc-per-node", str(args.ranks),
           "--run-dir", str(run_dir), __file__, "--worker", "--config", str(config_path),
           "--steps", str(args.steps), "--width", str(args.width), "--layers", str(args.layers)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: launch failed ({proc.returncode}): "
                           f"{proc.stderr.strip().splitlines()[-1:]}")
    return run_dir


def compare(run_dir: Path, cluster: str) -> dict[str, Any]:
    from sims.simulate import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args(["--compare", str(run_dir), "--cluster", cluster, "--json"])
    out = run_json(run, ns)
    return {row["class"]: row for row in out["classes"]}


def run_json(run: Any, ns: argparse.Namespace) -> dict[str, Any]:
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        run(ns)
    return json.loads(buffer.getvalue())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=2, help="ranks per run (default 2)")
    parser.add_argument("--steps", type=int, default=24,
                        help="optimizer steps per run (default 24; spans are flushed every 20)")
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--cluster", default="this-host", help="profile to predict with")
    parser.add_argument("--only", default=None,
                        help="comma-separated config numbers to run (1-based), e.g. 10,13")
    parser.add_argument("--keep", type=Path, default=None, help="keep run directories here")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    args = parser.parse_args()
    if args.worker:
        worker(args.config, args.steps, args.width, args.layers)
        return 0
    configs = CONFIGS
    if args.only:
        try:
            configs = [CONFIGS[int(n) - 1] for n in args.only.split(",")]
        except (ValueError, IndexError):
            parser.error(f"--only: config numbers from 1 to {len(CONFIGS)}, got {args.only!r}")
    errors: dict[str, list[float]] = {c: [] for c in CLASSES}
    with tempfile.TemporaryDirectory(prefix="sim_accuracy_") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        print(f"{len(configs)} configs, {args.ranks} ranks, {args.steps} steps each, predicted "
              f"with {args.cluster} ({os.cpu_count()} CPUs here)")
        print(f"  {'config':<26} {'predicted':>10} {'measured':>10} {'error':>8}")
        for name, overrides in configs:
            try:
                rows = compare(launch(name, overrides, workdir, args), args.cluster)
            except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
                print(f"  {name:<26} failed: {exc}")
                continue
            step = rows["step"]
            print(f"  {name:<26} {step['predicted_s'] * 1e3:8.2f}ms {step['measured_s'] * 1e3:8.2f}"
                  f"ms {step['error_pct']:+7.1f}%", flush=True)
            for c, row in rows.items():
                if row["error_pct"] is not None:
                    errors[c].append(abs(row["error_pct"]))
    print("MAPE per task class:")
    for c in CLASSES:
        if errors[c]:
            print(f"  {c:<10} {sum(errors[c]) / len(errors[c]):6.1f} %  ({len(errors[c])} runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
