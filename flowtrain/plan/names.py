"""Every task name of a step, made in one place: the engine's span recorder, reducer, ZeRO-3
fetcher and pipeline stage record under these names, and the simulator names its tasks with
them, so a measured trace and a predicted one line up task by task.

A name is a path. Its first part is the task's class (``forward``, ``reduce``, ...). The engine
records plan tasks (``forward/mb0``, ``reduce/bucket3``); the simulator may cut a plan task into
pieces named below it (``forward/mb0/layer2``) or add work that runs inside one
(``allgather/bucket1`` inside ``optimizer/step``): ``plan_task_of`` maps such a name back to the
plan task it belongs to.

With the interleaved pipeline schedule a stage runs several model chunks (virtual stages), and a
pass or pipeline instruction names its chunk with the micro-batch: ``forward/mb0.chunk1``,
``send_act/mb2.chunk0`` (the sender's chunk; a receive names the receiver's). Without
interleaving there is no chunk part, so those names are unchanged.
"""

from __future__ import annotations

# the pipeline's point-to-point instructions, as ``flowtrain.plan.schedule`` orders them
PIPE_OPS = ("recv_act", "send_act", "recv_grad", "send_grad")
PASSES = ("forward", "backward")
DIRECTIONS = ("fwd", "bwd")
COMM_WAIT = "comm/wait"
# data parallel without ZeRO: a tied embedding's lookup rows, exchanged after the buckets'
# reduces (flowtrain.engine.embedding_rows), inside the step's wait for them
ROWS = "reduce/rows"
OPTIMIZER_STEP = "optimizer/step"


def _check(kind: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{kind} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def micro_batch(mb: int, chunk: int | None = None) -> str:
    """``mb{k}``; with a model chunk (interleaved schedule), ``mb{k}.chunk{c}``."""
    return f"mb{mb}" if chunk is None else f"mb{mb}.chunk{chunk}"


def bucket(index: int) -> str:
    return f"bucket{index}"


def layer(index: int) -> str:
    return f"layer{index}"


# A step of a big pipeline has hundreds of thousands of tasks: the name makers below spell a
# name in one f-string (the simulator lays every task out by name).

def pass_task(kind: str, mb: int, *piece: str, chunk: int | None = None) -> str:
    """``forward/mb{k}`` or ``backward/mb{k}`` (of model chunk ``chunk``); with ``piece``, a
    part of that pass."""
    if kind not in PASSES:
        _check("pass", kind, PASSES)
    head = f"{kind}/mb{mb}" if chunk is None else f"{kind}/mb{mb}.chunk{chunk}"
    return "/".join((head, *piece)) if piece else head


def forward(mb: int, *piece: str, chunk: int | None = None) -> str:
    return pass_task("forward", mb, *piece, chunk=chunk)


def backward(mb: int, *piece: str, chunk: int | None = None) -> str:
    return pass_task("backward", mb, *piece, chunk=chunk)


def pipe_op(kind: str, mb: int, chunk: int | None = None) -> str:
    """A pipeline instruction: a pass, or a send/receive of activations or gradients."""
    if kind in PASSES:
        return pass_task(kind, mb, chunk=chunk)
    if kind not in PIPE_OPS:
        _check("pipeline instruction", kind, PIPE_OPS)
    return f"{kind}/mb{mb}" if chunk is None else f"{kind}/mb{mb}.chunk{chunk}"


def reduce(index: int, mb: int | None = None) -> str:
    """A gradient bucket's all-reduce (once a step) or reduce-scatter (``mb``: every
    micro-batch, ZeRO 2-3 accumulating several)."""
    return f"reduce/{bucket(index)}" + (f"/{micro_batch(mb)}" if mb is not None else "")


def gather(index: int, direction: str, mb: int) -> str:
    """ZeRO-3's all-gather of a partitioned bucket for its use in micro-batch ``mb``'s forward
    (``fwd``) or backward (``bwd``)."""
    return f"gather/{bucket(index)}/{_check('direction', direction, DIRECTIONS)}/{micro_batch(mb)}"


def optimizer_step(index: int | None = None) -> str:
    """The optimizer step; with ``index``, one offloaded shard's step inside it."""
    return OPTIMIZER_STEP + (f"/{bucket(index)}" if index is not None else "")


def allgather(index: int) -> str:
    """After the step, a whole bucket's updated shards to every rank (inside the step)."""
    return f"allgather/{bucket(index)}"


def copy(direction: str, index: int, *use: str) -> str:
    """An offload copy: ``d2h`` a gradient shard down, ``h2d`` a parameter shard up (``use``:
    the gather it feeds, e.g. ``("fwd", "mb0")``)."""
    return "/".join(("copy", _check("copy direction", direction, ("d2h", "h2d")), bucket(index),
                     *use))


def tp(direction: str, mb: int, layer_index: int | None = None,
       chunk: int | None = None) -> str:
    """A layer's tensor-parallel all-reduces of one pass (every layer's: ``layer_index``
    None)."""
    if direction not in DIRECTIONS:
        _check("direction", direction, DIRECTIONS)
    base = f"tp/{direction}/mb{mb}" if chunk is None else f"tp/{direction}/mb{mb}.chunk{chunk}"
    return base if layer_index is None else f"{base}/layer{layer_index}"


def handoff(kind: str, mb: int, chunk: int | None = None) -> str:
    """A pipeline stage getting a pass going once its input is there."""
    return f"handoff/{_check('pass', kind, PASSES)}/{micro_batch(mb, chunk)}"


def fetch(kind: str, mb: int, segment: str) -> str:
    """ZeRO-3's hook handing a module's use to the parameter fetcher, inside a pass."""
    return pass_task(kind, mb, segment, "fetch")


def release(mb: int, segment: str) -> str:
    """ZeRO-3's bookkeeping after a partitioned module's backward."""
    return pass_task("backward", mb, segment, "release")


def hand_off(mb: int, index: int) -> str:
    """The backward handing a full bucket to the reducer."""
    return pass_task("backward", mb, bucket(index), "hand_off")


def overhead(what: str, mb: int | None = None, chunk: int | None = None) -> str:
    """Engine time between tasks that the simulator prices on a calibrated host (the loss
    between a micro-batch's passes, the step's bookkeeping), belonging to no plan task."""
    return f"overhead/{what}" + (f"/{micro_batch(mb, chunk)}" if mb is not None else "")


def task_class(name: str) -> str:
    """The class of a task: the first part of its name (``reduce/bucket3`` -> ``reduce``)."""
    return name.split("/", 1)[0]


def span_key(name: str) -> str:
    """The first two parts of a name: a pass or a bucket's collective, without its pieces."""
    return "/".join(name.split("/")[:2])


def _parse_micro_batch(part: str) -> tuple[int, int | None] | None:
    """(micro-batch, chunk) of a name part ``mb{k}`` or ``mb{k}.chunk{c}``; None otherwise."""
    if not part.startswith("mb"):
        return None
    mb, _, chunk = part[2:].partition(".chunk")
    if not mb.isdigit() or (chunk and not chunk.isdigit()):
        return None
    return int(mb), int(chunk) if chunk else None


def micro_batch_of(name: str) -> int | None:
    """The micro-batch a task belongs to, when its name has one."""
    for part in name.split("/"):
        if (found := _parse_micro_batch(part)) is not None:
            return found[0]
    return None


def chunk_of(name: str) -> int | None:
    """The model chunk (interleaved schedule) a task belongs to, when its name has one."""
    for part in name.split("/"):
        if (found := _parse_micro_batch(part)) is not None:
            return found[1]
    return None


def plan_task_of(name: str) -> str | None:
    """The plan task (a name the engine records) that the simulator's task ``name`` is part of:
    a pass's pieces belong to the pass, the post-step all-gathers and offload copies to the
    optimizer step, a parameter shard's copy up to the gather it feeds. None for the engine's
    time between tasks (``overhead/...``, a pipeline stage's ``handoff/...``)."""
    parts = name.split("/")
    head = parts[0]
    if head in PASSES:
        return "/".join(parts[:2])
    if head == "tp":
        return "/".join(("forward" if parts[1] == "fwd" else "backward", parts[2]))
    if head in ("overhead", "handoff"):
        return None
    if head == "optimizer" or head == "allgather":
        return OPTIMIZER_STEP
    if head == "copy":
        return "/".join(["gather", *parts[2:]]) if len(parts) > 3 else OPTIMIZER_STEP
    return name
