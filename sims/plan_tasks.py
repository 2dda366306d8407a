"""The pieces the planner builds a simulated step from: the task list (dependencies on tasks of
later stages resolved once all exist), the 1F1B order of a pipeline stage's passes and a bare
pipeline built from it, and a stage's forward cut into segments."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from flowtrain.plan import names
from flowtrain.plan.schedule import stage_ops
from flowtrain.plan.workload import ParamSpec, layer_of, module_units
from sims.executor import SimTask


@dataclass
class Segment:
    label: str
    params: list[int]  # stage-local parameter indices
    layer: int | None
    forward_s: float = 0.0
    backward_s: float = 0.0


class Tasks:
    """Collects tasks; dependencies on tasks of later stages are given by (stage, name) and
    resolved once every task exists."""

    def __init__(self) -> None:
        self.tasks: list[SimTask] = []
        self.index: dict[tuple[int, str], int] = {}
        self.forward_refs: list[tuple[int, tuple[int, str]]] = []

    def add(self, stage: int, name: str, kind: str, resource: str, duration: float,
            deps: Sequence[int | None] = (), refs: Sequence[tuple[int, str]] = (),
            flops: float = 0.0, nbytes: float = 0.0, interference: float | None = None,
            slowdown: float | None = None) -> int:
        i = len(self.tasks)
        self.tasks.append(SimTask(name, kind, resource, duration,
                                  tuple(dict.fromkeys(d for d in deps if d is not None)),
                                  stage, flops, nbytes, resource.startswith("comm:"),
                                  interference, slowdown))
        self.index[(stage, name)] = i
        self.forward_refs += [(i, ref) for ref in refs]
        return i

    def resolve(self) -> tuple[SimTask, ...]:
        for i, ref in self.forward_refs:
            if ref not in self.index:
                raise KeyError(f"the plan refers to task {ref[1]!r} of stage {ref[0]}, which "
                               f"was never built")
            t = self.tasks[i]
            self.tasks[i] = dataclasses.replace(t, deps=t.deps + (self.index[ref],))
        return tuple(self.tasks)


def one_f_one_b(stages: int, stage: int, micro_batches: int) -> list[tuple[str, int]]:
    """The 1F1B order of stage ``stage``'s passes, ("F", k) / ("B", k), as the engine's
    PipeStage runs them (``flowtrain.plan.schedule.stage_ops``): warm-up forwards fill the
    pipeline, then one forward and one backward alternate, then the backwards drain."""
    passes = {"forward": "F", "backward": "B"}
    return [(passes[op.kind], op.mb) for op in stage_ops("1f1b", stage, stages, micro_batches)
            if op.kind in passes]


def pipeline_tasks(stages: int, micro_batches: int, forward_s: float, backward_s: float,
                   send_s: float = 0.0) -> tuple[SimTask, ...]:
    """A bare 1F1B pipeline (equal stages, no data parallelism): the textbook schedule whose
    bubble is (p-1)/(m+p-1) when sends are free."""
    out = Tasks()
    for s in range(stages):
        last: int | None = None
        for op, k in one_f_one_b(stages, s, micro_batches):
            if op == "F":
                refs = [(s - 1, names.pipe_op("send_act", k))] if s > 0 else []
                last = out.add(s, names.forward(k), "forward", "compute", forward_s, [last],
                               refs)
                if s < stages - 1:
                    out.add(s, names.pipe_op("send_act", k), "send", "comm:pp", send_s, [last])
            else:
                refs = [(s + 1, names.pipe_op("send_grad", k))] if s < stages - 1 else []
                last = out.add(s, names.backward(k), "backward", "compute", backward_s, [last],
                               refs)
                if s > 0:
                    out.add(s, names.pipe_op("send_grad", k), "send", "comm:pp", send_s, [last])
    return out.resolve()


def segments(params: Sequence[ParamSpec], stage3: bool) -> list[Segment]:
    """A stage's forward order cut into pieces: one per module for ZeRO-3 (each is gathered
    before it runs), otherwise one per layer plus the parts before and after the layers."""
    if stage3:
        return [Segment(params[u[0]][0].rpartition(".")[0] or params[u[0]][0], u,
                         layer_of(params[u[0]][0])) for u in module_units(params)]
    segments: list[Segment] = []
    seen_layer = False
    for i, p in enumerate(params):
        n = layer_of(p[0])
        seen_layer = seen_layer or n is not None
        label = names.layer(n) if n is not None else ("head" if seen_layer else "embed")
        if segments and segments[-1].label == label:
            segments[-1].params.append(i)
        else:
            segments.append(Segment(label, [i], n))
    return segments
