"""One real trial of ``flowtrain tune --verify``: launched on every rank by ``flowtrain launch -m
sims.tune_job``, it builds the model from its factory, trains it with the trial's ds_config on
random tokens for a few steps, and writes what it measured (each step's seconds, its memory)
to ``--out`` as ``rank<r>.json``.

Running out of memory is a result, not a failure: the rank writes ``"oom": true`` so that the
tuner backs off instead of reporting a crash. On a GPU that is CUDA's out-of-memory error (the
rank writes its record and fails, and the launcher ends the job: the other ranks may be inside
a collective it will never join); on a CPU host, where no device memory exists to run out of,
``--memory-limit`` stands for the device's capacity: a rank whose parameters plus what its
resident memory grows by while training (gradients, optimizer states, activations,
temporaries) exceed it has run out. The baseline is taken once the engine is built, so that
the interpreter, torch, the process group and the data channel's shared buffers, none of which
a device holds, stay below it. The ranks agree on that after every step (one
all-reduce of a flag), so they all stop together and exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

# a trial of short steps runs until it has timed --min-seconds, but no longer than this
MAX_STEPS = 200


def _peak_rss_bytes() -> int:
    """This process's peak resident memory since ``_reset_peak`` (Linux's VmHWM; ru_maxrss,
    the peak since the process started, where /proc does not say)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _reset_peak() -> None:
    """Starts the peak over from the memory resident now (Linux: "5" to clear_refs), so that a
    spike while the engine was built does not count as training's."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _rss_bytes() -> int:
    """This process's resident memory now."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def _vocab(module: torch.nn.Module) -> int:
    for m in module.modules():
        if isinstance(m, torch.nn.Embedding):
            return int(m.num_embeddings)
    raise ValueError("the trial feeds token ids, but the model has no nn.Embedding to say how "
                     "many; give a factory whose model takes token ids")


def _loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits a language model returns (a tensor, or the first element
    of a tuple or a model output with ``logits``) against the next tokens."""
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


def _any_rank(flag: bool, device: Any) -> bool:
    """Whether ``flag`` holds on any rank (every rank calls this at the same point)."""
    import torch.distributed as dist

    t = torch.tensor([1.0 if flag else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def _all_ranks(flag: bool, device: Any) -> bool:
    """Whether ``flag`` holds on every rank (so that all stop after the same step)."""
    return not _any_rank(not flag, device)


def _write(out: str, record: dict[str, Any]) -> None:
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"rank{record['rank']}.json").write_text(json.dumps(record))


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(exc, oom)) or "out of memory" in str(exc).lower()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import flowtrain
    from sims.models import resolve

    rank = int(os.environ.get("RANK", 0))
    torch.manual_seed(1234 + rank)
    record: dict[str, Any] = {"rank": rank, "oom": False, "step_s": []}
    config = json.loads(Path(args.config).read_text())
    try:
        model = resolve(args.model, "factory")()
        vocab = _vocab(model)
        engine, *_ = flowtrain.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
        params = sum(p.numel() * p.element_size() for p in engine.module.parameters())
        baseline = _rss_bytes()
        record["baseline_rss_bytes"] = baseline
        _reset_peak()
        micro = engine.train_micro_batch_size_per_gpu()
        accumulation = engine.gradient_accumulation_steps()
        device = engine.device
        limit = args.memory_limit
        timed = 0.0
        for step in range(args.warmup + MAX_STEPS):
            if step >= args.warmup + args.steps and _all_ranks(timed >= args.min_seconds,
                                                               device):
                break
            started = time.perf_counter()
            for _ in range(accumulation):
                tokens = torch.randint(0, vocab, (micro, args.seq_len + 1), device=device)
                loss = _loss(engine(tokens[:, :-1]), tokens[:, 1:])
                engine.backward(loss)
                engine.step()
            record["step_s"].append(time.perf_counter() - started)
            if step >= args.warmup:
                timed += record["step_s"][-1]
            used = params + max(0, _peak_rss_bytes() - baseline)
            record["used_bytes"] = used
            if limit and _any_rank(used > limit, device):
                record["oom"] = True
                break
        record["step_s"] = record["step_s"][args.warmup:]
    except Exception as exc:  # a trial that runs out of memory reports it before it fails
        if _is_oom(exc):
            record["oom"] = True
            record["error"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            _write(args.out, record)
        raise
    if torch.cuda.is_available():
        record["device_peak_bytes"] = int(torch.cuda.max_memory_allocated())
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="pkg.mod:fn building the model")
    p.add_argument("--config", required=True, help="the trial's ds_config.json")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sample")
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps, at least")
    p.add_argument("--min-seconds", type=float, default=0.0,
                   help="time steps until their sum reaches this (short steps are noisy)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--memory-limit", type=int, default=0,
                   help="bytes a CPU rank may grow by while training (0: no limit)")
    p.add_argument("--out", required=True, help="directory for rank<r>.json")
    args = p.parse_args(argv)
    _write(args.out, run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
