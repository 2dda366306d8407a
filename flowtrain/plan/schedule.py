"""Pipeline schedules as per-stage instruction lists, the one place their order is decided: the
PipeStage actor executes them, and the StepPlan turns them into the tasks both executors run.

1F1B (PipeDream-Flush): stage s of p runs min(p - s - 1, m) warm-up forwards, then alternates
one forward and one backward, then drains the remaining backwards; at most p - s micro-batches'
activations are alive on stage s. GPipe: every forward, then every backward (m alive).
Both idle for the same bubble, (p - 1) / (m + p - 1) of the step with equal stage times.

Interleaved 1F1B (Megatron-LM's virtual pipeline): the layers are cut into p * v chunks and
stage s holds chunks s, s + p, s + 2p, ... (its local chunks 0..v-1), so a micro-batch passes
every stage v times, the last stage's chunk handing over to the first stage's next one. Each
stage runs forwards in the same order: micro-batches in groups of p, every local chunk of a
group before the next group (backwards: the same order, chunks counted from the last). Stage s
warms up with (p - s - 1) * 2 + (v - 1) * p forwards (all of them when that is m * v or more),
then alternates one forward and one backward, then drains. Each pass is 1/v of a stage's, so the
fill and drain shrink v times: the bubble is (p - 1) / (v * m) of the ideal step. Megatron needs
the micro-batch count to be a multiple of p (groups of p); so does this order.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowtrain.plan import names

SCHEDULES = ("1f1b", "gpipe", "interleaved")


@dataclass(frozen=True)
class Op:
    """One instruction: ``kind`` is forward | backward | recv_act | send_act | recv_grad |
    send_grad, for micro-batch ``mb`` on the stage's model chunk ``chunk`` (its virtual stage,
    0..v-1; None without interleaving, where a stage is one chunk)."""

    kind: str
    mb: int
    chunk: int | None = None

    @property
    def task_name(self) -> str:
        return names.pipe_op(self.kind, self.mb, chunk=self.chunk)


def check_interleaving(stages: int, micro_batches: int, virtual_stages: int) -> None:
    """Raises what makes an interleaved schedule impossible, naming the setting."""
    if virtual_stages < 2:
        raise ValueError(f"pipeline.virtual_stages {virtual_stages}: the interleaved schedule "
                         f"needs at least 2 model chunks per stage")
    if stages < 2:
        raise ValueError(f"pipeline.schedule 'interleaved' needs at least 2 pipeline stages, "
                         f"got {stages}")
    if micro_batches % stages:
        raise ValueError(f"gradient_accumulation_steps {micro_batches}: the interleaved schedule "
                         f"runs micro-batches in groups of the stage count ({stages}), so it "
                         f"must be a multiple of {stages}")


def handover(kind: str, stage: int, stages: int, chunk: int | None) -> tuple[int, int | None]:
    """The (stage, chunk) at the other end of a point-to-point instruction of ``stage``'s chunk
    ``chunk``: activations go to the next stage, gradients back to the previous one; across the
    ring's wrap (interleaved) the last stage's chunk c hands over to the first stage's c + 1."""
    step = {"recv_act": -1, "send_grad": -1, "send_act": 1, "recv_grad": 1}[kind]
    peer = stage + step
    if 0 <= peer < stages:
        return peer, chunk
    if chunk is None:
        raise ValueError(f"a {kind} instruction on stage {stage}, which has no neighbour on "
                         f"that side")
    return peer % stages, chunk + step


def interleaved_order(stages: int, micro_batches: int, virtual_stages: int
                      ) -> list[tuple[int, int]]:
    """(local chunk, micro-batch) of each forward, in the order every stage runs them:
    micro-batches in groups of ``stages``, each group through chunk 0, then chunk 1, ..."""
    return [(c, mb) for first in range(0, micro_batches, stages) for c in range(virtual_stages)
            for mb in range(first, min(first + stages, micro_batches))]


def stage_ops(schedule: str, stage: int, stages: int, micro_batches: int,
              virtual_stages: int = 1) -> list[Op]:
    """The instructions stage ``stage`` runs for one optimizer step (``virtual_stages``: model
    chunks per stage, more than one only with the interleaved schedule): each pass of
    ``stage_passes``, after the receive of its input and before the send of its output (none
    at the model's ends)."""
    passes = stage_passes(schedule, stage, stages, micro_batches, virtual_stages)
    last_chunk = stages * virtual_stages - 1  # the model's last chunk (c * p + stage)
    ops: list[Op] = []
    for kind, mb, c in passes:
        here = stage if c is None else c * stages + stage
        if kind == "forward":
            if here > 0:
                ops.append(Op("recv_act", mb, c))
            ops.append(Op("forward", mb, c))
            if here < last_chunk:
                ops.append(Op("send_act", mb, c))
        else:
            if here < last_chunk:
                ops.append(Op("recv_grad", mb, c))
            ops.append(Op("backward", mb, c))
            if here > 0:
                ops.append(Op("send_grad", mb, c))
    return ops


def stage_passes(schedule: str, stage: int, stages: int, micro_batches: int,
                 virtual_stages: int = 1) -> list[tuple[str, int, int | None]]:
    """The passes stage ``stage`` runs for one optimizer step, in order: (``forward`` |
    ``backward``, micro-batch, model chunk or None without interleaving)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of "
                         f"{', '.join(SCHEDULES)}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is outside 0..{stages - 1}")
    if micro_batches < 1:
        raise ValueError(f"a pipeline step needs at least 1 micro-batch, got {micro_batches}")
    if schedule == "interleaved":
        return _interleaved(stage, stages, micro_batches, virtual_stages)
    if virtual_stages != 1:
        raise ValueError(f"pipeline.virtual_stages {virtual_stages} needs pipeline.schedule "
                         f"'interleaved', not {schedule!r}")
    forwards: list[tuple[str, int, int | None]] = [("forward", mb, None)
                                                   for mb in range(micro_batches)]
    backwards: list[tuple[str, int, int | None]] = [("backward", mb, None)
                                                    for mb in range(micro_batches)]
    if schedule == "gpipe":
        return forwards + backwards
    warmup = min(stages - stage - 1, micro_batches)
    return _one_f_one_b(forwards, backwards, warmup)


def _one_f_one_b(forwards: list[tuple[str, int, int | None]],
                 backwards: list[tuple[str, int, int | None]],
                 warmup: int) -> list[tuple[str, int, int | None]]:
    """``warmup`` forwards, then one forward and one backward in turn, then the backwards
    left."""
    out = forwards[:warmup]
    for i in range(len(forwards) - warmup):
        out.append(forwards[warmup + i])
        out.append(backwards[i])
    out += backwards[len(forwards) - warmup:]
    return out


def _interleaved(stage: int, stages: int, micro_batches: int, virtual_stages: int
                 ) -> list[tuple[str, int, int | None]]:
    check_interleaving(stages, micro_batches, virtual_stages)
    p, v = stages, virtual_stages
    order = interleaved_order(p, micro_batches, v)
    forwards: list[tuple[str, int, int | None]] = [("forward", mb, c) for c, mb in order]
    # a chunk's backwards go in its forwards' order, the chunks from the model's end
    backwards: list[tuple[str, int, int | None]] = [("backward", mb, v - 1 - c)
                                                    for c, mb in order]
    warmup = min((p - stage - 1) * 2 + (v - 1) * p, len(forwards))
    return _one_f_one_b(forwards, backwards, warmup)


def bubble_fraction(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle share of a step with equal stage times and free communication: (p - 1) / (v * m) of
    the ideal step's time, so (p - 1) / (v * m + p - 1) of the step's."""
    return (stages - 1) / (virtual_stages * micro_batches + stages - 1)


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
