"""Pipeline schedules as per-stage instruction lists, the one place their order is decided: the
PipeStage actor executes them, and the StepPlan turns them into the tasks both executors run.

1F1B (PipeDream-Flush): stage s of p runs min(p - s - 1, m) warm-up forwards, then alternates
one forward and one backward, then drains the remaining backwards; at most p - s micro-batches'
activations are alive on stage s. GPipe: every forward, then every backward (m alive).
Both idle for the same bubble, (p - 1) / (m + p - 1) of the step with equal stage times.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowtrain.plan import names

SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class Op:
    """One instruction: ``kind`` is forward | backward | recv_act | send_act | recv_grad |
    send_grad, for micro-batch ``mb``."""

    kind: str
    mb: int

    @property
    def task_name(self) -> str:
        return names.pipe_op(self.kind, self.mb)


def stage_ops(schedule: str, stage: int, stages: int, micro_batches: int) -> list[Op]:
    """The instructions stage ``stage`` runs for one optimizer step."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of "
                         f"{', '.join(SCHEDULES)}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is outside 0..{stages - 1}")
    if micro_batches < 1:
        raise ValueError(f"a pipeline step needs at least 1 micro-batch, got {micro_batches}")
    first, last = stage == 0, stage == stages - 1

    def fwd(mb: int) -> list[Op]:
        ops = [] if first else [Op("recv_act", mb)]
        ops.append(Op("forward", mb))
        if not last:
            ops.append(Op("send_act", mb))
        return ops

    def bwd(mb: int) -> list[Op]:
        ops = [] if last else [Op("recv_grad", mb)]
        ops.append(Op("backward", mb))
        if not first:
            ops.append(Op("send_grad", mb))
        return ops

    ops: list[Op] = []
    if schedule == "gpipe":
        for mb in range(micro_batches):
            ops += fwd(mb)
        for mb in range(micro_batches):
            ops += bwd(mb)
        return ops
    warmup = min(stages - stage - 1, micro_batches)
    for mb in range(warmup):
        ops += fwd(mb)
    for i in range(micro_batches - warmup):
        ops += fwd(warmup + i)
        ops += bwd(i)
    for mb in range(micro_batches - warmup, micro_batches):
        ops += bwd(mb)
    return ops


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle share of a step with equal stage times and free communication."""
    return (stages - 1) / (micro_batches + stages - 1)


def max_in_flight(ops: list[Op]) -> int:
    """Most micro-batches whose activations are held at once (forward done, backward not)."""
    alive = peak = 0
    for op in ops:
        if op.kind == "forward":
            alive += 1
            peak = max(peak, alive)
        elif op.kind == "backward":
            alive -= 1
    return peak


def one_f_one_b(stages: int, stage: int, micro_batches: int) -> list[tuple[str, int]]:
    """Stage ``stage``'s passes in 1F1B order, ("F", k) / ("B", k), as ``stage_ops`` has the
    PipeStage run them: warm-up forwards fill the pipeline, then one forward and one backward
    alternate, then the backwards drain."""
    passes = {"forward": "F", "backward": "B"}
    return [(passes[op.kind], op.mb) for op in stage_ops("1f1b", stage, stages, micro_batches)
            if op.kind in passes]
