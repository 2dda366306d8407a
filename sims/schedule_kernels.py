"""The executor's inner loops over flat arrays, compiled with numba (``nopython``; the machine
code is cached beside this file): the list scheduler for steps whose collectives run at their
own speed, and the interval sums of the step's figures. ``sims.executor`` prepares the arrays
and holds the rules; these loops follow them step for step, in the same floating-point order,
so their results equal those of its Python reference loop."""

from __future__ import annotations

import numpy as np
from numba import njit

_opts = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")


@njit(**_opts)
def _ready_push(store, base, size, rid, key):
    """Pushes the task of priority ``key`` on resource ``rid``'s ready heap (lowest on top);
    the heap holds the priorities themselves, so that sifting reads only the heap."""
    b = base[rid]
    k = size[rid]
    size[rid] = k + 1
    while k > 0:
        parent = (k - 1) >> 1
        above = store[b + parent]
        if above <= key:
            break
        store[b + k] = above
        k = parent
    store[b + k] = key


@njit(**_opts)
def _ready_pop(store, base, size, rid):
    b = base[rid]
    n = size[rid] - 1
    size[rid] = n
    top = store[b]
    if n > 0:
        last = store[b + n]
        k = 0
        while True:
            c = 2 * k + 1
            if c >= n:
                break
            if c + 1 < n and store[b + c + 1] < store[b + c]:
                c += 1
            if store[b + c] >= last:
                break
            store[b + k] = store[b + c]
            k = c
        store[b + k] = last
    return top


@njit(**_opts)
def _event_push(times, tasks, n, t, i):
    k = n
    while k > 0:
        parent = (k - 1) >> 1
        if times[parent] < t or (times[parent] == t and tasks[parent] < i):
            break
        times[k] = times[parent]
        tasks[k] = tasks[parent]
        k = parent
    times[k] = t
    tasks[k] = i
    return n + 1


@njit(**_opts)
def _event_pop(times, tasks, n):
    """Removes the earliest event (the heap's top, read before the call); returns the size."""
    n -= 1
    if n > 0:
        t, i = times[n], tasks[n]
        k = 0
        while True:
            c = 2 * k + 1
            if c >= n:
                break
            if c + 1 < n and (times[c + 1] < times[c] or
                              (times[c + 1] == times[c] and tasks[c + 1] < tasks[c])):
                c += 1
            if t < times[c] or (t == times[c] and i < tasks[c]):
                break
            times[k] = times[c]
            tasks[k] = tasks[c]
            k = c
        times[k] = t
        tasks[k] = i
    return n


def list_schedule(durations: np.ndarray, resource: np.ndarray, priority: np.ndarray,
                  child_start: np.ndarray, children: np.ndarray, waiting: np.ndarray,
                  companion: np.ndarray, is_compute: np.ndarray, n_resources: int,
                  planned: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Runs the tasks in virtual time. ``resource``: each task's resource id; ``priority``: its
    rank in plan order (lower first: 2 i for task i, 2 i + 1 for its companion);
    ``children[child_start[i]:child_start[i + 1]]``: the tasks waiting for task ``i``;
    ``waiting``: each task's unfinished dependencies (updated in place); ``companion``: the
    task made ready when task ``i`` starts (-1: none); ``is_compute``: the resources that
    choose last at each instant; tasks from ``planned`` on are companions, ready only once
    their collective starts. Returns (start, end, finished, tasks finished)."""
    total = len(durations)
    # the loop's arrays, made here (the compiled loop then types fewer library calls)
    times = np.zeros((3, total))  # start, end, event times
    tasks = np.zeros((2, total), dtype=np.int64)  # ready heaps, event tasks
    finished = np.zeros(total, dtype=np.bool_)
    flags = np.zeros((2, n_resources), dtype=np.bool_)  # busy, marked this instant
    per_resource = np.zeros((4, n_resources + 1), dtype=np.int64)
    done = _list_schedule(durations, resource, priority, child_start, children, waiting,
                          companion, is_compute, planned, times[0], times[1], times[2],
                          tasks[0], tasks[1], finished, flags[0], flags[1], per_resource[0],
                          per_resource[1], per_resource[2], per_resource[3])
    return times[0], times[1], finished, int(done)


@njit(**_opts)
def _list_schedule(durations, resource, priority, child_start, children, waiting, companion,
                   is_compute, planned, start, end, event_time, store, event_task, finished,
                   busy, flagged, base, size, dirty, chosen):
    total = len(durations)
    n_resources = len(busy)
    # each resource's heap in ``store``
    for i in range(total):
        base[resource[i] + 1] += 1
    for r in range(n_resources):
        base[r + 1] += base[r]
    n_events = 0
    done = 0
    for i in range(planned):
        if waiting[i] == 0:
            _ready_push(store, base, size, resource[i], priority[i])
            flagged[resource[i]] = True
    n_dirty = 0
    for r in range(n_resources):
        if flagged[r]:
            dirty[n_dirty] = r
            n_dirty += 1
    now = 0.0
    while True:
        for phase in range(2):
            # this phase's resources, lowest id first, as they were marked when it began
            n_chosen = 0
            for k in range(n_dirty):
                rid = dirty[k]
                if is_compute[rid] == (phase == 1):
                    # insertion sort: a handful of resources change at an instant
                    m = n_chosen
                    while m > 0 and chosen[m - 1] > rid:
                        chosen[m] = chosen[m - 1]
                        m -= 1
                    chosen[m] = rid
                    n_chosen += 1
            for k in range(n_chosen):
                rid = chosen[k]
                if busy[rid] or size[rid] == 0:
                    continue
                key = _ready_pop(store, base, size, rid)
                # priorities: 2 i for task i, 2 i + 1 for its companion
                i = key >> 1 if key % 2 == 0 else companion[key >> 1]
                busy[rid] = True
                start[i] = now
                end[i] = now + durations[i]
                n_events = _event_push(event_time, event_task, n_events, end[i], i)
                partner = companion[i]
                if partner >= 0:
                    r = resource[partner]
                    _ready_push(store, base, size, r, priority[partner])
                    if not flagged[r]:
                        flagged[r] = True
                        dirty[n_dirty] = r
                        n_dirty += 1
        for k in range(n_dirty):
            flagged[dirty[k]] = False
        n_dirty = 0
        if n_events == 0:
            break
        # every task that ends at this instant finishes before anything new is chosen
        now = event_time[0]
        while n_events > 0 and event_time[0] == now:
            i = event_task[0]
            n_events = _event_pop(event_time, event_task, n_events)
            if finished[i]:
                continue
            finished[i] = True
            done += 1
            end[i] = now
            rid = resource[i]
            busy[rid] = False
            if not flagged[rid]:
                flagged[rid] = True
                dirty[n_dirty] = rid
                n_dirty += 1
            for k in range(child_start[i], child_start[i + 1]):
                child = children[k]
                waiting[child] -= 1
                if waiting[child] == 0:
                    r = resource[child]
                    _ready_push(store, base, size, r, priority[child])
                    if not flagged[r]:
                        flagged[r] = True
                        dirty[n_dirty] = r
                        n_dirty += 1
    return done


@njit(**_opts)
def _merged(start, end, order, stage_start, selected, n_stages):
    """The union of the intervals of the ``selected`` tasks, per stage: (starts, ends, offset
    of each stage's first). ``order`` lists the tasks by stage, then start (then index), and
    ``order[stage_start[s]:stage_start[s + 1]]`` are stage ``s``'s."""
    out_a = np.zeros(len(order))
    out_b = np.zeros(len(order))
    out_offset = np.zeros(n_stages + 1, dtype=np.int64)
    n = 0
    for s in range(n_stages):
        first = n
        for k in range(stage_start[s], stage_start[s + 1]):
            i = order[k]
            if not selected[i]:
                continue
            a, b = start[i], end[i]
            if b <= a:
                continue
            if n > first and a <= out_b[n - 1]:
                if b > out_b[n - 1]:
                    out_b[n - 1] = b
            else:
                out_a[n] = a
                out_b[n] = b
                n += 1
        out_offset[s + 1] = n
    return out_a, out_b, out_offset


@njit(**_opts)
def _length(a, b, lo, hi):
    total = 0.0
    for k in range(lo, hi):
        total += b[k] - a[k]
    return total


@njit(**_opts)
def interval_figures(start, end, stage, resource, category, is_pass, order, n_stages,
                     n_resources):
    """The sums behind the step's figures: busy seconds per resource id (in task order), and
    per stage the length of the union of its communication (tasks whose resource's
    ``category`` is 1), the part of it no work (category 2) runs beside, and the union of its
    passes (``is_pass``); and the end of the last pass. ``order``: the tasks by stage, then
    start, then index."""
    n = len(start)
    busy = np.zeros(n_resources)
    window = 0.0
    comm = np.zeros(n, dtype=np.bool_)
    work = np.zeros(n, dtype=np.bool_)
    stage_start = np.zeros(n_stages + 1, dtype=np.int64)
    for i in range(n):
        busy[resource[i]] += end[i] - start[i]
        c = category[resource[i]]
        comm[i] = c == 1
        work[i] = c == 2
        if is_pass[i]:
            window = max(window, end[i])
        stage_start[stage[i] + 1] += 1
    for s in range(n_stages):
        stage_start[s + 1] += stage_start[s]
    ca, cb, co = _merged(start, end, order, stage_start, comm, n_stages)
    wa, wb, wo = _merged(start, end, order, stage_start, work, n_stages)
    pa, pb, po = _merged(start, end, order, stage_start, is_pass, n_stages)
    comm_s = np.zeros(n_stages)
    exposed_s = np.zeros(n_stages)
    passes_s = np.zeros(n_stages)
    for s in range(n_stages):
        length = _length(ca, cb, co[s], co[s + 1])
        i, j = co[s], wo[s]
        overlap = 0.0
        while i < co[s + 1] and j < wo[s + 1]:
            lo = max(ca[i], wa[j])
            hi = min(cb[i], wb[j])
            if hi > lo:
                overlap += hi - lo
            if cb[i] < wb[j]:
                i += 1
            else:
                j += 1
        comm_s[s] = length
        exposed_s[s] = length - overlap
        passes_s[s] = _length(pa, pb, po[s], po[s + 1])
    return busy, comm_s, exposed_s, passes_s, window
