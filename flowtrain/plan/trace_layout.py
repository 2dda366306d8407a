"""One layout for every Chrome/Perfetto trace of a step, measured (``flowtrain trace``) or
predicted (``flowtrain simulate --trace``): a process per rank named ``rank R``, a track per
kind of work named after the task's class, and flow arrows from each pipeline send to its
receive and between a collective's ranks. Sharing it is what lets the two traces be laid over
each other task by task."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flowtrain.plan import names

# task class -> track; the order is the order of the tracks under each rank
TRACKS = {"step": "steps", "forward": "compute", "backward": "compute", "optimizer": "compute",
          "tp": "tensor parallel", "reduce": "reduce", "gather": "gather",
          "allgather": "gather", "offload": "offload", "copy": "offload",
          "send_act": "pipeline", "recv_act": "pipeline", "send_grad": "pipeline",
          "recv_grad": "pipeline", "comm": "comm wait", "overhead": "host", "handoff": "host",
          "interference": "host"}
TRACK_ORDER = ("steps", "compute", "tensor parallel", "reduce", "gather", "offload",
               "pipeline", "comm wait", "host")
# collectives every rank of a data-parallel group runs under the same name in the same step
COLLECTIVES = ("reduce", "gather", "allgather")
# a send's class -> (the receive's class, the direction it goes along the stages)
SENDS = {"send_act": ("recv_act", +1), "send_grad": ("recv_grad", -1)}
FLOW_CATEGORY = "flow"


def track_of(name: str) -> str:
    head = names.task_class(name)
    return TRACKS.get(head, head)


def process_name(rank: int) -> str:
    return f"rank {rank}"


def process_events(rank: int, label: str | None = None) -> list[dict[str, Any]]:
    """The metadata that names rank ``rank``'s process and keeps the ranks in order."""
    return [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
             "args": {"name": label or process_name(rank)}},
            {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
             "args": {"sort_index": rank}}]


class TrackLanes:
    """Thread ids of one rank's tracks. Trace viewers need the slices of one thread to nest, but
    collectives overlap (several buckets reduce at once): an overlapping span goes to the next
    lane of its track ("reduce", "reduce 2", ...), and the lanes are reused as spans end."""

    def __init__(self, rank: int, events: list[dict[str, Any]]) -> None:
        self.rank = rank
        self.events = events
        self.lanes: dict[str, list[tuple[int, float]]] = {}  # track -> [(tid, last end)]
        self.next_extra = len(TRACK_ORDER)

    def tid(self, track: str, start: float, end: float) -> int:
        lanes = self.lanes.setdefault(track, [])
        for i, (tid, busy_until) in enumerate(lanes):
            if busy_until <= start + 1e-9:
                lanes[i] = (tid, end)
                return tid
        if not lanes and track in TRACK_ORDER:
            tid = TRACK_ORDER.index(track)
        else:
            tid = self.next_extra
            self.next_extra += 1
        name = track if not lanes else f"{track} {len(lanes) + 1}"
        # sort index: a track's lanes stay together, in the order of TRACK_ORDER
        order = (TRACK_ORDER.index(track) if track in TRACK_ORDER else len(TRACK_ORDER)) * 100 \
            + len(lanes)
        lanes.append((tid, end))
        self.events.append({"ph": "M", "name": "thread_name", "pid": self.rank, "tid": tid,
                            "args": {"name": name}})
        self.events.append({"ph": "M", "name": "thread_sort_index", "pid": self.rank,
                            "tid": tid, "args": {"sort_index": order}})
        return tid


def slice_event(name: str, rank: int, tid: int, start_s: float, end_s: float,
                step: int | None, track: str | None = None) -> dict[str, Any]:
    """A complete ("X") event in microseconds, its category the track (the name's unless
    given)."""
    return {"ph": "X", "name": name, "cat": track or track_of(name), "pid": rank, "tid": tid,
            "ts": round(start_s * 1e6, 3), "dur": round(max(0.0, end_s - start_s) * 1e6, 3),
            "args": {} if step is None else {"step": step}}


def receive_of(send: str, stage: int, stages: int) -> tuple[str, int] | None:
    """(name of the receive, its stage) that a pipeline send feeds. With model chunks
    (interleaved schedule) the last stage's chunk c feeds chunk c+1 on stage 0, and a gradient
    from stage 0's chunk c goes back to chunk c-1 on the last stage."""
    head = names.task_class(send)
    if head not in SENDS:
        return None
    receive, direction = SENDS[head]
    mb, chunk = names.micro_batch_of(send), names.chunk_of(send)
    if mb is None:
        return None
    peer = stage + direction
    if chunk is not None and not 0 <= peer < stages:
        chunk += direction
        peer %= stages
    if not 0 <= peer < stages:
        return None
    return names.pipe_op(receive, mb, chunk), peer


def flow_events(slices: Iterable[dict[str, Any]], stages: int, ranks_per_stage: int
                ) -> list[dict[str, Any]]:
    """Flow arrows ("s" at the start of one slice, "f" bound to the enclosing slice at the
    other end) from every pipeline send to the receive it feeds, matched by step, peer rank and
    name, and from the first rank to start each collective to every other rank of its group
    running it in that step. Ranks are laid out as ``flowtrain.parallel`` does: rank =
    stage x ranks_per_stage + its place inside the stage."""
    by_key: dict[tuple[Any, int, str], dict[str, Any]] = {}
    collectives: dict[tuple[Any, int, str], list[dict[str, Any]]] = {}
    sends: list[dict[str, Any]] = []
    for event in slices:
        if event.get("ph") != "X":
            continue
        step, rank, name = event["args"].get("step"), int(event["pid"]), str(event["name"])
        by_key[(step, rank, name)] = event
        head = names.task_class(name)
        if head in SENDS:
            sends.append(event)
        elif head in COLLECTIVES:
            collectives.setdefault((step, rank // ranks_per_stage, name), []).append(event)
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for send in sends:
        rank = int(send["pid"])
        stage, within = divmod(rank, ranks_per_stage)
        found = receive_of(str(send["name"]), stage, stages)
        if found is None:
            continue
        receive, peer = found
        target = by_key.get((send["args"].get("step"), peer * ranks_per_stage + within, receive))
        if target is not None:
            pairs.append((send, target))
    for group in collectives.values():
        if len(group) > 1:
            first = min(group, key=lambda e: (e["ts"], e["pid"]))
            pairs += [(first, other) for other in group if other is not first]
    return pair_flows(pairs)


def pair_flows(pairs: Iterable[tuple[dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    """A flow arrow from the first slice of each pair to the second, numbered from 1."""
    out: list[dict[str, Any]] = []
    # each end sits in the middle of its slice: a viewer binds it to the slice around that
    # moment, and an end on a slice's edge could land on the slice before it
    for number, (source, target) in enumerate(pairs, start=1):
        name = f"{source['name']} -> {target['name']}" if source["name"] != target["name"] \
            else str(source["name"])
        out.append({"ph": "s", "id": number, "name": name, "cat": FLOW_CATEGORY,
                    "pid": source["pid"], "tid": source["tid"], "ts": _middle(source)})
        out.append({"ph": "f", "bp": "e", "id": number, "name": name, "cat": FLOW_CATEGORY,
                    "pid": target["pid"], "tid": target["tid"], "ts": _middle(target)})
    return out


def _middle(event: dict[str, Any]) -> float:
    return round(float(event["ts"]) + float(event["dur"]) / 2, 3)
