"""The task graph of one optimizer step on one rank: its passes in schedule order, pipeline
sends and receives, ZeRO-3's parameter gathers, the gradient reduces and the optimizer step,
each a named ``Task`` with its resource, size and dependencies.

The engine builds it to lay out its buckets and records its spans under its task names; the
simulator builds the same plan for each pipeline stage and prices it (``sims.planner``), cutting
a task into pieces named below it where it needs finer grain (``flowtrain.plan.names``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from flowtrain.plan import names
from flowtrain.plan.buckets import BucketPlan, ParamSpec, plan_buckets
from flowtrain.plan.schedule import Op, stage_ops
from flowtrain.plan.stage3 import Stage3Uses

# a pipeline instruction's task kind and resource
_PIPE_KINDS = {"recv_act": ("recv", "comm:pp"), "recv_grad": ("recv", "comm:pp"),
               "send_act": ("send", "comm:pp"), "send_grad": ("send", "comm:pp")}


@dataclass(frozen=True)
class Task:
    """A unit of work of the step, as both executors name it."""

    name: str
    kind: str  # forward | backward | recv | send | gather | reduce | wait | optimizer
    resource: str  # compute | comm:dp | comm:pp | host
    deps: tuple[str, ...] = ()
    flops: float = 0.0
    bytes: int = 0
    micro_batch: int | None = None
    bucket: int | None = None  # the gradient or parameter bucket a collective moves
    chunk: int | None = None  # the stage's model chunk of a pass or pipeline instruction
    # (interleaved schedule; None otherwise)


@dataclass(frozen=True)
class StepPlan:
    """Everything one optimizer step does on a rank of pipeline stage ``stage``, in order, with
    its dependencies. ``world_size`` is the data-parallel group's."""

    world_size: int
    gradient_accumulation_steps: int
    micro_batch_size: int
    comm_dtype: str
    buckets: tuple[BucketPlan, ...]
    tasks: tuple[Task, ...] = field(default=())
    stage: int = 0
    stages: int = 1
    schedule: str = "1f1b"
    reduce_every_micro_batch: bool = False
    virtual_stages: int = 1

    def bucket_of(self) -> dict[int, int]:
        """Parameter index -> bucket index."""
        return {s.index: b.index for b in self.buckets for s in b.slots}

    @cached_property
    def _by_name(self) -> dict[str, Task]:
        return {t.name: t for t in self.tasks}

    def task(self, name: str) -> Task:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no task named {name!r} in the step plan") from None

    def task_names(self) -> list[str]:
        return [t.name for t in self.tasks]

    def instructions(self) -> list[Op]:
        """The pipeline stage's instructions in the order it runs them: its passes and its
        sends and receives (what the engine's PipeStage executes)."""
        kinds = (*names.PASSES, *names.PIPE_OPS)
        return [Op(names.task_class(t.name), t.micro_batch, t.chunk) for t in self.tasks
                if t.micro_batch is not None and names.task_class(t.name) in kinds]

    def pass_order(self) -> list[tuple[str, int]]:
        """The stage's passes in the order they run: (``forward`` | ``backward``, micro-batch);
        with interleaving, ``chunk_pass_order`` also says which chunk each runs."""
        return [(t.kind, t.micro_batch) for t in self.tasks
                if t.kind in names.PASSES and t.micro_batch is not None]

    def chunk_pass_order(self) -> list[tuple[str, int, int | None]]:
        """The stage's passes in the order they run: (kind, micro-batch, model chunk or None)."""
        return [(t.kind, t.micro_batch, t.chunk) for t in self.tasks
                if t.kind in names.PASSES and t.micro_batch is not None]


def gather_uses(uses: Stage3Uses, trace: Sequence[int]) -> list[list[tuple[int, str]]]:
    """ZeRO-3: at each use position of one micro-batch, the (bucket, direction) of each
    all-gather launched there, the direction being that of the use the gather serves (its
    bucket's next use from there on: a forward use in the trace's first half)."""
    out = []
    for pos, launched in enumerate(uses.launched):
        here = []
        for b in launched:
            use = next(p for p in range(pos, len(trace)) if trace[p] == b)
            here.append((b, "fwd" if use < len(trace) // 2 else "bwd"))
        out.append(here)
    return out


def pass_flops(kind: str, forward_flops: float) -> float:
    """A ``kind`` pass's FLOPs over what one forward of it computes (a backward: twice)."""
    return forward_flops if kind == "forward" else 2 * forward_flops


def build_step_plan(
    params: Sequence[ParamSpec],
    *,
    world_size: int,
    gradient_accumulation_steps: int,
    micro_batch_size: int,
    bucket_numel: int,
    comm_dtype: str,
    comm_elem_size: int,
    order: Sequence[int] | None = None,
    forward_flops: float = 0.0,
    groups: Sequence[int] | None = None,
    buckets: Sequence[BucketPlan] | None = None,
    reduce_every_micro_batch: bool = False,
    stage: int = 0,
    stages: int = 1,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    chunk_flops: Sequence[float] | None = None,
    stage3: tuple[Stage3Uses, Sequence[int]] | None = None,
    rows_bytes: int | None = None,
) -> StepPlan:
    """The plan of one step of a rank of pipeline stage ``stage`` of ``stages`` (its
    instructions in ``schedule`` order) in a data-parallel group of ``world_size``.

    Gradients are reduced after the last micro-batch's backward (none inside the accumulation
    window) or, with ``reduce_every_micro_batch`` (ZeRO 2-3), after each backward; then the step
    waits for the reduces (``comm/wait``) and the optimizer steps. ``buckets`` overrides the
    bucketing (ZeRO stage 3 passes ``plan_units``'s); ``stage3`` is ZeRO-3's gathers of one
    micro-batch (``stage3_uses`` over the bucket use order, and that order), each named for the
    use it serves. With the interleaved schedule the stage runs ``virtual_stages`` model chunks,
    a pass over chunk c costing ``chunk_flops[c]`` forward FLOPs (``forward_flops`` shared
    evenly when not given). ``rows_bytes``: a tied embedding's gradient is split
    (``flowtrain.engine.embedding_rows``) and its lookup rows, that many bytes gathered from all
    ranks, are exchanged after the last reduce (``reduce/rows``)."""
    buckets = tuple(buckets) if buckets is not None else \
        plan_buckets(params, bucket_numel, order, groups=groups)
    gas = gradient_accumulation_steps
    every = reduce_every_micro_batch and world_size > 1
    tasks: list[Task] = []
    previous: tuple[str, ...] = ()
    reduces: list[str] = []
    gathers = gather_uses(*stage3) if stage3 is not None else None
    half = len(gathers) // 2 if gathers is not None else 0

    def add(task: Task) -> str:
        tasks.append(task)
        return task.name

    def add_gathers(mb: int, positions: range, before: tuple[str, ...]) -> tuple[str, ...]:
        out: list[str] = []
        for pos in positions:
            for b, direction in (gathers or [])[pos]:
                chain = before + ((out[-1],) if out else ())
                out.append(add(Task(names.gather(b, direction, mb), "gather", "comm:dp", chain,
                                    bytes=buckets[b].numel * params[0][3] if params else 0,
                                    micro_batch=mb, bucket=b)))
        return tuple(out)

    def add_reduces(mb: int | None, after: tuple[str, ...]) -> None:
        for bucket in buckets:
            deps = after + ((reduces[-1],) if reduces else ())  # launched in bucket order
            reduces.append(add(Task(names.reduce(bucket.index, mb), "reduce", "comm:dp", deps,
                                    bytes=bucket.numel * comm_elem_size, micro_batch=mb,
                                    bucket=bucket.index)))

    v = virtual_stages
    per_chunk = list(chunk_flops) if chunk_flops is not None else [forward_flops / v] * v
    if len(per_chunk) != v:
        raise ValueError(f"chunk_flops has {len(per_chunk)} entries for {v} virtual stages")
    ops = stage_ops(schedule, stage, stages, gas, v)
    # gradients are complete after the step's last backward (of every chunk)
    last_backward = max((i for i, op in enumerate(ops) if op.kind == "backward"), default=-1)
    for i, op in enumerate(ops):
        mb = op.mb
        if op.kind in _PIPE_KINDS:
            kind, resource = _PIPE_KINDS[op.kind]
            name = add(Task(op.task_name, kind, resource, previous, micro_batch=mb,
                            chunk=op.chunk))
            if kind == "recv":
                previous = (name,)
            continue
        forward = op.kind == "forward"
        positions = range(0, half) if forward else range(half, 2 * half)
        waits = add_gathers(mb, positions, previous) if gathers is not None else ()
        flops = pass_flops(op.kind, forward_flops if op.chunk is None else per_chunk[op.chunk])
        previous = (add(Task(op.task_name, op.kind, "compute", previous + waits, flops,
                             micro_batch=mb, chunk=op.chunk)),)
        if not forward and world_size > 1 and (every or i == last_backward):
            # buckets launch as the backward produces them
            add_reduces(mb if every and gas > 1 else None, previous)
    if world_size > 1 and rows_bytes is not None:
        reduces.append(add(Task(names.ROWS, "reduce", "comm:dp", previous + tuple(reduces[-1:]),
                                bytes=rows_bytes)))
    if world_size > 1:
        previous = (add(Task(names.COMM_WAIT, "wait", "compute", previous + tuple(reduces[-1:]))),)
    total = sum(b.numel for b in buckets)
    add(Task(names.OPTIMIZER_STEP, "optimizer", "compute", previous, bytes=total * 16))
    return StepPlan(world_size, gas, micro_batch_size, comm_dtype, buckets, tuple(tasks), stage,
                    stages, schedule, every, v)
