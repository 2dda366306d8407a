"""What the Telemetry actor costs a training step: one engine in this process trains in alternating
blocks of steps with the actor wired in at ``after_step`` and without it; prints the median
step time of each, their ratio, and the cost per step in microseconds.

The rank here hosts its own coordinator (no launcher), so the records are validated and
published in this process too: under ``flowtrain launch`` that part runs in the launcher, and
the overhead a rank sees is lower than measured here.

    python benchmarks/telemetry_overhead.py [--width 512] [--batch 64] [--blocks 20]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

import torch
from torch import nn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, width), nn.GELU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def timed_block(engine: Any, data: tuple[torch.Tensor, torch.Tensor], steps: int) -> float:
    """Mean seconds per optimizer step over ``steps`` steps."""
    x, y = data
    start = time.perf_counter()
    for _ in range(steps):
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    return (time.perf_counter() - start) / steps


def run(args: argparse.Namespace) -> dict[str, Any]:
    import flowtrain
    from flowtrain import telemetry

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    torch.set_num_threads(args.threads)
    model = make_model(args.width, args.depth)
    config = {"train_batch_size": args.batch, "train_micro_batch_size_per_gpu": args.batch,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
              "steps_per_print": 10**9, "gradient_clipping": 0.0,
              "flowtrain": {"telemetry_hz": args.hz}}
    engine, _, _, _ = flowtrain.initialize(model=model, config=config)
    ref = telemetry.attach(engine, force=True)
    if ref is None:
        raise SystemExit("telemetry did not attach; is flowtrain.telemetry off in the config?")
    actor = ref._actor
    points = engine.stages.at["after_step"]
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(args.batch, 64, generator=g), torch.randn(args.batch, 1, generator=g))
    timed_block(engine, data, args.warmup)
    on: list[float] = []
    off: list[float] = []
    for block in range(args.blocks):
        # Alternate which mode goes first so drift (thermal, other processes) hits both alike.
        for mode in (("on", "off") if block % 2 == 0 else ("off", "on")):
            points[:] = [ref] if mode == "on" else []
            (on if mode == "on" else off).append(timed_block(engine, data, args.steps))
    points[:] = [ref]
    engine.destroy()
    return {"on": statistics.median(on), "off": statistics.median(off),
            "published": actor.published, "dropped": actor.dropped,
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    parser.add_argument("--depth", type=int, default=4, help="hidden layers of the MLP")
    parser.add_argument("--batch", type=int, default=64, help="samples per step")
    parser.add_argument("--steps", type=int, default=30, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=20, help="blocks per mode")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    parser.add_argument("--hz", type=float, default=10.0, help="flowtrain.telemetry_hz")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    result = run(args)
    on, off = result["on"], result["off"]
    print(f"model: MLP {args.depth}x{args.width} ({result['params']:,} parameters), "
          f"batch {args.batch}, {args.threads} torch thread(s), telemetry_hz {args.hz:g}")
    print(f"median step, telemetry off: {off * 1e3:8.3f} ms")
    print(f"median step, telemetry on:  {on * 1e3:8.3f} ms")
    print(f"ratio on/off: {on / off:.4f}  ({(on - off) * 1e6:+.1f} us per step); "
          f"records published {result['published']}, dropped {result['dropped']}")


if __name__ == "__main__":
    main()
