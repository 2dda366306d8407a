"""The pure fits of ``flowtrain calibrate``: from measurement records to the profile's links,
curves and engine section, without touching the machine (so they are tested on recorded and
synthetic measurements). Each fit minimises relative error: a 4 KiB call counts as much as a
32 MiB one."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from sims.calibrate.settings import CalibrationError
from sims.costs import ADAM_BYTES_PER_PARAM, ring_factor, ring_steps
from sims.hardware import PASS_KINDS, EngineCosts, Link


def slowdown_during(record: dict[str, Any], key: str, links: dict[int, Link]) -> float:
    """How much longer the all-reduce of an interference measurement took while its rank
    computed than ``links`` (the fitted all-reduce by rank count) say it takes alone: at least
    1, and 1 where the record lacks its size (measurements written before it was kept)."""
    ranks = int(record.get("ranks", 2))
    if "bytes" not in record or key not in record or ranks not in links:
        return 1.0
    alone = links[ranks].seconds(float(record["bytes"]))
    return max(1.0, float(record[key]) / alone) if alone > 0 else 1.0


def solve_relative(rows: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares of ``seconds = u * x0 + v * x1`` over rows (u, v, seconds), each row divided
    by its seconds so the error minimised is relative: a 4 KiB call counts as much as a
    32 MiB one. A negative x0 (latency) is refitted as 0, since it cannot be."""
    a = [(u / t, v / t) for u, v, t in rows]
    saa = sum(p * p for p, _ in a)
    sab = sum(p * q for p, q in a)
    sbb = sum(q * q for _, q in a)
    sa = sum(p for p, _ in a)
    sb = sum(q for _, q in a)
    det = saa * sbb - sab * sab
    if det <= 1e-12 * saa * sbb:
        raise CalibrationError("cannot fit latency and bandwidth: the points need at least two "
                               "different sizes")
    x0 = (sa * sbb - sb * sab) / det
    x1 = (saa * sb - sab * sa) / det
    if x0 < 0:
        x0, x1 = 0.0, sb / sbb
    return x0, x1


def _seconds_per_byte_to_link(latency: float, per_byte: float, what: str) -> Link:
    if per_byte <= 0:
        raise CalibrationError(f"{what}: the measured times do not grow with the buffer size, so "
                               "no bandwidth can be fitted; rerun on a less busy host")
    return Link(latency, 1.0 / per_byte)


def fit_link(points: Sequence[tuple[float, float]], what: str = "collective") -> Link:
    """The Link whose ``latency + bytes / bandwidth`` best fits (bytes, seconds) points."""
    latency, per_byte = solve_relative([(1.0, nbytes, t) for nbytes, t in points])
    return _seconds_per_byte_to_link(latency, per_byte, what)


def fit_collectives(measurements: dict[str, Any], skipped: list[str] | None = None
                    ) -> dict[str, dict[int, Link]]:
    """One fitted Link per measured (op, rank count): ``collective_seconds`` then uses it for
    exactly that op and rank count, with ``nbytes`` the full buffer as measured. An entry that
    cannot be fitted raises CalibrationError, or, when ``skipped`` is given, is left out (the
    ring formula covers it) and named there."""
    grouped: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in measurements["collectives"]:
        grouped.setdefault((r["op"], int(r["ranks"])), []).append((r["bytes"], r["seconds"]))
    fitted: dict[str, dict[int, Link]] = {}
    for (op, ranks), points in sorted(grouped.items()):
        try:
            fitted.setdefault(op, {})[ranks] = fit_link(points, f"{op} over {ranks} ranks")
        except CalibrationError as exc:
            if skipped is None:
                raise
            skipped.append(str(exc))
    return {op: by_ranks for op, by_ranks in fitted.items() if by_ranks}


def fit_ring_link(measurements: dict[str, Any]) -> Link:
    """The per-rank link (latency per ring step, bandwidth) that explains the measured
    all-reduces of every rank count through the ring formula: what the simulator uses for rank
    counts, and ops, that were not measured. All-reduce only, because gloo's reduce-scatter is
    not a ring (it is several times slower than the formula over the same link)."""
    records = [r for r in measurements["collectives"] if r["op"] == "all_reduce"] \
        or measurements["collectives"]
    rows = [(float(ring_steps(r["op"], r["ranks"])), ring_factor(r["op"], r["ranks"]) * r["bytes"],
             r["seconds"]) for r in records]
    latency, per_byte = solve_relative(rows)
    if per_byte <= 0 and len({v for _, v, _ in rows}) > 1:
        # A disturbed small size can leave no slope to fit (as --quick's few trials on a
        # busy host can); the link every profile needs then comes from the largest transfer
        # (bandwidth) and the smallest (latency per step).
        steps, moved, seconds = max(rows, key=lambda row: row[1])
        small = min(rows, key=lambda row: row[1])
        latency = small[2] / small[0]
        per_byte = max(seconds - steps * latency, 0.5 * seconds) / moved
    return _seconds_per_byte_to_link(latency, per_byte, "ring link")


def fit_efficiency(records: Sequence[dict[str, Any]]) -> tuple[float, tuple[tuple[float, float],
                                                                               ...]]:
    """Peak FLOP/s (the best rate seen) and the fraction of it reached at each measured op size,
    so the roofline reproduces every measured matmul."""
    best: dict[float, float] = {}
    for r in records:
        best[r["flops"]] = max(best.get(r["flops"], 0.0), r["flops"] / r["seconds"])
    if not best:
        raise CalibrationError("no matmul measurements to fit an efficiency curve from")
    peak = max(best.values())
    return peak, tuple((flops, rate / peak) for flops, rate in sorted(best.items()))


def fit_pass_rates(records: Sequence[dict[str, Any]]
                   ) -> dict[int, dict[str, tuple[tuple[float, float], ...]]]:
    """Per thread count and pass kind, the measured FLOP/s by op FLOPs (backward does twice
    the forward's FLOPs: grad input and grad weight), keeping the best rate per size."""
    out: dict[int, dict[str, dict[float, float]]] = {}
    for r in records:
        kinds = out.setdefault(int(r["threads"]), {k: {} for k in PASS_KINDS})
        for kind, flops in (("forward", r["flops"]), ("backward", 2 * r["flops"])):
            rate = flops / r[f"{kind}_s"]
            kinds[kind][flops] = max(kinds[kind].get(flops, 0.0), rate)
    return {t: {k: tuple(sorted(points.items())) for k, points in kinds.items()}
            for t, kinds in out.items()}


def fit_engine(m: dict[str, Any]) -> tuple[EngineCosts, list[str]]:
    """The ``engine`` section from the measurements' ``engine`` record; also returns what
    could not be fitted (left out, so the simulator falls back to its generic figures)."""
    skipped: list[str] = []
    rates = fit_pass_rates(m["passes"])
    optimizer = fit_calls_and_bytes(m["optimizer"])
    channel: dict[str, dict[int, Link]] = {}
    grouped: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in m.get("channel", []):
        grouped.setdefault((r["op"], int(r["ranks"])), []).append((r["bytes"], r["seconds"]))
    for (op, ranks), points in sorted(grouped.items()):
        try:
            channel.setdefault(op, {})[ranks] = fit_link(
                points, f"shared-memory {op} over {ranks} ranks")
        except CalibrationError as exc:
            skipped.append(str(exc))
    p2p = None
    if m.get("p2p"):
        try:
            p2p = fit_link([(r["bytes"], r["seconds"]) for r in m["p2p"]], "pipeline send")
        except CalibrationError as exc:
            skipped.append(str(exc))
    slowdown: dict[int, float] = {}
    memory_slowdown: dict[int, float] = {}
    for r in m.get("concurrency", []):
        slowdown[int(r["ranks"])] = max(1.0, float(r["compute_slowdown"]))
        memory_slowdown[int(r["ranks"])] = max(1.0, float(r["memory_slowdown"]))
    interference = m.get("channel_interference", {}).get("fraction", 1.0)
    channel_slowdown = slowdown_during(m.get("channel_interference", {}),
                                        "collective_seconds_during",
                                        channel.get("all_reduce", {}))
    op_costs = fit_op_costs(m["ops"]) if m.get("ops") else {}
    weight_cost = fit_weight_cost(m.get("weight_passes", []))
    threads = min(int(r["threads"]) for r in m["passes"])
    pass_weights = tuple(sorted({(float(r["flops"]), 4.0 * r["in"] * r["out"])
                                 for r in m["passes"]
                                 if int(r["threads"]) == threads and "in" in r and "out" in r}))
    if not weight_cost or len(pass_weights) < 2:
        weight_cost, pass_weights = {}, ()
    return EngineCosts(pass_rates=rates, optimizer=optimizer, slowdown=slowdown,
                       memory_slowdown=memory_slowdown, channel=channel,
                       channel_interference=float(interference),
                       channel_slowdown=channel_slowdown, p2p=p2p,
                       op_costs=op_costs, weight_cost=weight_cost,
                       pass_weights=pass_weights), skipped


def fit_weight_cost(records: Sequence[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per thread count and pass kind, the seconds per byte of weights that equal-FLOP layers
    (WEIGHT_SHAPES) add: the least-squares slope of time over weight bytes, at least 0."""
    grouped: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        grouped.setdefault(int(r["threads"]), []).append(r)
    out: dict[int, dict[str, float]] = {}
    for threads, rows in sorted(grouped.items()):
        if len({r["in"] * r["out"] for r in rows}) < 2:
            continue
        x = [4.0 * r["in"] * r["out"] for r in rows]
        mean_x = statistics.fmean(x)
        var = sum((v - mean_x) ** 2 for v in x)
        out[threads] = {}
        for kind in PASS_KINDS:
            y = [r[f"{kind}_s"] for r in rows]
            mean_y = statistics.fmean(y)
            slope = sum((a - mean_x) * (b - mean_y) for a, b in zip(x, y)) / var
            out[threads][kind] = max(0.0, slope)
    return out


def fit_calls_and_bytes(records: Sequence[dict[str, Any]]) -> Link:
    """The optimizer kernel as ``latency_s`` per call plus its 28-byte-per-parameter pass at
    ``bandwidth``: least squares of seconds = tensors x latency + bytes / bandwidth over the
    measured sets, relative error."""
    rows = [(float(r.get("tensors", 1)), ADAM_BYTES_PER_PARAM * r["numel"], r["seconds"])
            for r in records]
    try:
        latency, per_byte = solve_relative(rows)
    except CalibrationError:
        # one set size only: no split between calls and bytes, all of it is bandwidth
        latency, per_byte = 0.0, sum(t for _, _, t in rows) / sum(b for _, b, _ in rows)
    return _seconds_per_byte_to_link(latency, per_byte, "the Adam kernel")


def fit_op_costs(records: Sequence[dict[str, Any]]
                 ) -> dict[int, dict[str, dict[str, Link]]]:
    """Per thread count, class and pass: the line through the class's two sizes, seconds =
    calls x latency + size / bandwidth. A view costs its calls only (size 0): its latency is
    the time per call and its bandwidth unbounded in effect. A line that does not rise with
    size (a disturbed point) keeps the larger size's time per element with no latency."""
    grouped: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in records:
        grouped.setdefault((int(r["threads"]), str(r["class"])), []).append(r)
    out: dict[int, dict[str, dict[str, Link]]] = {}
    for (threads, cls), rows in sorted(grouped.items()):
        rows = sorted(rows, key=lambda r: r["size"])
        kinds: dict[str, Link] = {}
        for kind in ("forward", "backward"):
            key = f"{kind}_s"
            if cls == "view" or rows[0]["size"] <= 0:
                per_call = statistics.median(r[key] / r["calls"] for r in rows)
                kinds[kind] = Link(per_call, 1e18)
                continue
            small, large = rows[0], rows[-1]
            per_element = (large[key] - small[key]) / (large["size"] - small["size"])
            if per_element <= 0:
                kinds[kind] = Link(0.0, large["size"] / large[key])
                continue
            latency = max(0.0, small[key] - per_element * small["size"]) / small["calls"]
            # calls scale the latency; the elements of every call add up in size
            kinds[kind] = Link(latency, 1.0 / per_element)
        out.setdefault(threads, {})[cls] = kinds
    return out
