"""Worker for tests/engine/test_peer_recovery.py (``flowtrain launch --peer-recovery``): ZeRO-0 data
parallelism on data keyed by (step, launch rank), looping on ``engine.global_steps`` so a step
the engine drops is redone. Each process appends one JSON line per committed step to
OUT.rank<R>.pid<PID>.jsonl (loss, members, a hash of the weights and optimizer state); a
replacement rank first writes a "joined" line with the state it took from its peer. The first
process of KILL_RANK SIGKILLs itself after step KILL_AT. From step WAIT_FROM on, ranks of a
group short of a member wait, before their next step, until a replacement has asked to join
(it touches OUT.asked<R> then; at most 60 s), so it joins at the next committed step however
long it took to start, and no later than that once a replacement has entered a group.

With SIGNAL JOINER the rank is SIGKILLed as with KILL, and its replacement SIGKILLs itself
while it takes its state from its peers (after the weights, before the optimizer state). With
SIGNAL REFORM:<R> the rank is SIGKILLed as with KILL, and the first process of rank R
SIGKILLs itself as it starts to re-form the group after that loss.

With ZERO (1 or 2, or 1:bf16 / 2:bf16 for a bf16 model) the engine runs that ZeRO stage; each
step line then also carries the digests of the rank's own optimizer shard and of the mirror it
keeps of the next rank's shard, and ``optim`` is its own shard's.

argv: OUT STEPS KILL_AT KILL_RANK SLEEP_S [SIGNAL: KILL, STOP (a frozen rank), JOINER or
      REFORM:<R>] [WAIT_FROM] [ZERO]
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import signal
import sys
import time

import torch
from torch import nn

import flowtrain


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous()
        h.update((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes())
    return h.hexdigest()


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key in sorted(optimizer.state.get(p, {})):
                value = optimizer.state[p][key]
                out.append(value if torch.is_tensor(value) else torch.tensor(float(value)))
    return out


def shard_digest(masters: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> str:
    """The digest of a ZeRO shard: its master weights and its optimizer state."""
    from flowtrain.zero.mirror import shard_state

    tensors = []
    for entries in shard_state(masters, optimizer):
        for key in sorted(entries):
            value = entries[key]
            tensors.append(value if torch.is_tensor(value) else torch.tensor(float(value)))
    return digest(tensors)


def main() -> None:
    out, steps, kill_at, kill_rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        int(sys.argv[4])
    sleep_s = float(sys.argv[5])
    sig = signal.SIGSTOP if sys.argv[6:7] == ["STOP"] else signal.SIGKILL
    wait_from = int(sys.argv[7]) if len(sys.argv) > 7 else 0
    zero_arg = sys.argv[8].split(":") if len(sys.argv) > 8 else ["0"]
    zero = int(zero_arg[0])
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    replacement = os.environ.get("FLOWTRAIN_PEER_JOIN") == "1"
    # the generation a replacement enters with: after one loss, or two with REFORM
    join_generation = 3 if sys.argv[6:7] and sys.argv[6].startswith("REFORM:") else 2
    if replacement:
        from flowtrain.peer_recovery import PeerGroup

        wait_to_join = PeerGroup.wait_to_join

        def asked(self: PeerGroup) -> dict:
            open(f"{out}.asked{rank}", "w").close()
            return wait_to_join(self)

        PeerGroup.wait_to_join = asked  # type: ignore[method-assign]
    if replacement and sys.argv[6:7] == ["JOINER"]:
        from flowtrain.engine.engine import FlowtrainEngine

        def die(self: FlowtrainEngine) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        FlowtrainEngine.peer_join = die  # type: ignore[method-assign]
    if not replacement and sys.argv[6:7] == [f"REFORM:{rank}"]:
        from flowtrain.peer_recovery import PeerGroup

        def die_reforming(self: PeerGroup, *args: object, **kwargs: object) -> list[int]:
            os.kill(os.getpid(), signal.SIGKILL)
            return []

        PeerGroup.reform = die_reforming  # type: ignore[method-assign]
    model = make_model()
    # no clipping (flowtrain's default clips at 1.0): the reference steps the plain gradients,
    # and a lone survivor's own gradient is larger than the group's mean
    cfg = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9,
           "gradient_clipping": 0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    if zero:
        cfg["zero_optimization"] = {"stage": zero}
    dtype = torch.float32
    if zero_arg[1:] == ["bf16"]:
        cfg["bf16"] = {"enabled": True}
        dtype = torch.bfloat16
    engine, optimizer, *_ = flowtrain.initialize(model=model,
                                                 model_parameters=model.parameters(), config=cfg)
    log = open(f"{out}.rank{rank}.pid{os.getpid()}.jsonl", "a")

    def record(**fields: object) -> None:
        log.write(json.dumps({"t": time.time(), "pid": os.getpid(), **fields}) + "\n")
        log.flush()

    params = list(model.parameters())

    def optim() -> dict[str, object]:
        if not zero:
            return {"optim": digest(optimizer_tensors(optimizer))}
        mirror = engine.zero.mirror
        return {"layout": list(engine._layout),
                "optim": shard_digest(engine.zero.master, optimizer),
                "mirror": shard_digest(mirror.master, mirror.optimizer)
                if mirror is not None else None}

    if replacement:
        record(event="joined", step=engine.global_steps, weights=digest(params),
               members=engine.peer.members, **optim())
    while engine.global_steps < steps:
        step = engine.global_steps
        members = list(engine.peer.members)
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        engine.step()
        if engine.global_steps == step:  # dropped: a rank was lost; redo it
            record(event="dropped", step=step + 1)
            continue
        record(event="step", step=engine.global_steps, loss=float(loss.detach()), members=members,
               weights=digest(params), **optim())
        if not replacement and rank == kill_rank and engine.global_steps == kill_at:
            os.kill(os.getpid(), sig)
        time.sleep(sleep_s)
        if wait_from and engine.global_steps >= wait_from and len(engine.peer.members) < world \
                and engine.peer.generation < join_generation:
            waited = time.monotonic()
            while not glob.glob(f"{glob.escape(out)}.asked*") and \
                    time.monotonic() - waited < 60:
                time.sleep(0.05)
    record(event="done", step=engine.global_steps, weights=digest(params))
    log.close()


if __name__ == "__main__":
    main()
