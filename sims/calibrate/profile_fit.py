"""The measured host's profile from ``flowtrain calibrate``'s measurements: their checks (every
error names the field), the fits put together, and the engine factors fitted from the launched
jobs. Pure: ``fit_profile`` reads plain JSON and touches no machine."""

from __future__ import annotations

import dataclasses
from typing import Any

from sims.calibrate.factors import fit_factors
from sims.calibrate.fits import (
    fit_collectives,
    fit_efficiency,
    fit_engine,
    fit_ring_link,
    slowdown_during,
)
from sims.calibrate.settings import DTYPES, MEASURED_OPS, MEASUREMENTS_VERSION, CalibrationError
from sims.hardware import HardwareProfile, Link


def _need(d: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in d:
        raise CalibrationError(f"measurements: missing field '{where}{key}'")
    if not isinstance(d[key], kind):
        raise CalibrationError(f"measurements: field '{where}{key}' has the wrong type, got "
                               f"{d[key]!r}")
    return d[key]


def check_measurements(m: Any) -> dict[str, Any]:
    """Enough structure for fit_profile; errors name the field."""
    if not isinstance(m, dict):
        raise CalibrationError(f"measurements must be a JSON object, got {type(m).__name__}")
    if m.get("v") != MEASUREMENTS_VERSION:
        raise CalibrationError(f"measurements: field 'v' must be {MEASUREMENTS_VERSION}, got "
                               f"{m.get('v')!r}")
    host = _need(m, "host", dict, "")
    _need(host, "cores", int, "host.")
    _need(host, "memory_bytes", int, "host.")
    fields: tuple[str, ...]
    for key, fields in (("matmul", ("dtype", "flops", "seconds")),
                        ("memory", ("kind", "bytes_moved", "seconds")),
                        ("collectives", ("op", "ranks", "bytes", "seconds"))):
        for i, record in enumerate(_need(m, key, list, "")):
            for f in fields:
                _need(record, f, (str,) if f in ("dtype", "kind", "op") else (int, float),
                      f"{key}[{i}].")
            if key == "collectives" and record["op"] not in MEASURED_OPS:
                raise CalibrationError(f"measurements: field 'collectives[{i}].op' must be one "
                                       f"of {', '.join(MEASURED_OPS)}, got {record['op']!r}")
    _need(_need(m, "interference", dict, ""), "fraction", (int, float), "interference.")
    if "engine" in m:
        engine = _need(m, "engine", dict, "")
        for key, fields in (("passes", ("threads", "flops", "forward_s", "backward_s")),
                            ("optimizer", ("numel", "seconds"))):
            records = _need(engine, key, list, "engine.")
            if not records:
                raise CalibrationError(f"measurements: field 'engine.{key}' is empty")
            for i, record in enumerate(records):
                for f in fields:
                    _need(record, f, (int, float), f"engine.{key}[{i}].")
    return m


def fit_profile(measurements: dict[str, Any], name: str = "this-host") -> HardwareProfile:
    """The CPU profile of the measured host. One device is one core (the measurements are
    single-threaded, and ``flowtrain launch`` gives each rank cores // ranks threads); there is
    no second node, so the inter-node link repeats the loopback ring link per rank."""
    m = check_measurements(measurements)
    host = m["host"]
    cores = host["cores"]
    peaks: dict[str, float] = {}
    curve: tuple[tuple[float, float], ...] = ()
    for dtype in DTYPES:
        records = [r for r in m["matmul"] if r["dtype"] == dtype]
        if records:
            peaks[dtype], dtype_curve = fit_efficiency(records)
            if dtype == "float32":
                curve = dtype_curve
    if not curve:
        raise CalibrationError("measurements: no float32 matmul records, which the efficiency "
                               "curve is fitted from")
    by_kind = {r["kind"]: r for r in m["memory"]}
    for kind in ("copy", "small_copy"):
        if kind not in by_kind:
            raise CalibrationError(f"measurements: no memory record of kind {kind!r}")
    streaming = max(r["bytes_moved"] / r["seconds"] for r in m["memory"]
                    if r["kind"] in ("copy", "add"))
    copy = by_kind["copy"]
    ring = fit_ring_link(m)
    skipped: list[str] = []
    collectives = fit_collectives(m, skipped)
    engine = None
    if "engine" in m:
        engine, engine_skipped = fit_engine(m["engine"])
        skipped += engine_skipped
    when = f"measured on {host.get('hostname', '?')} ({host.get('cpu', '?')}, {cores} cores) " \
           f"{host.get('recorded', '')} by flowtrain calibrate"
    ranks_seen = sorted({r["ranks"] for r in m["collectives"]})
    profile = HardwareProfile(
        name=name, kind="cpu", devices_per_node=cores,
        device_memory_bytes=host["memory_bytes"] // cores,
        peak_flops=peaks, memory_bandwidth=streaming,
        intra_node=ring,
        inter_node=Link(ring.latency_s, ring.bandwidth * cores),
        host_to_device=Link(by_kind["small_copy"]["seconds"],
                            copy["bytes_moved"] / 2 / copy["seconds"]),
        efficiency=curve, collectives=collectives,
        comm_compute_interference=float(m["interference"]["fraction"]),
        compute_comm_slowdown=slowdown_during(m["interference"], "all_reduce_seconds_during",
                                              collectives.get("all_reduce", {})),
        host_memory_bandwidth=streaming,
        engine=engine,
        sources={
            "peak_flops": f"{when}: best single-thread torch.mm rate per dtype",
            "efficiency": f"{when}: float32 torch.mm rate / peak at each size",
            "memory_bandwidth": f"{when}: single-thread copy/add, bytes read + written per s",
            "devices_per_node": "one device = one core (flowtrain launch gives each rank "
                                "cores // ranks threads)",
            "device_memory_bytes": "host memory / cores",
            "intra_node": f"{when}: gloo over loopback, {ranks_seen} ranks, all ops fitted "
                          "together through the ring formulas",
            "inter_node": "not measured (one host): the loopback link, per rank",
            "host_to_device": f"{when}: memcpy in host memory (offload on a CPU host); "
                              "latency = a 4 KiB copy",
            "collectives": f"{when}: least squares of seconds = latency + bytes / bandwidth per "
                           "op and rank count, relative error"
                           + "".join(f"; left out: {reason}" for reason in skipped),
            "comm_compute_interference": f"{when}: 1 - matmul rate during back-to-back "
                                         f"all-reduces / alone, {m['interference'].get('ranks', 2)}"
                                         " ranks",
            "compute_comm_slowdown": f"{when}: those all-reduces' time while the rank computed "
                                     "over the fitted all-reduce's",
            **({"engine": f"{when}: the engine's pieces (sims.calibrate.engine_pieces): "
                          "nn.Linear forward/backward with its gradient-bucket hooks per thread "
                          "count, its fused Adam kernel, its shared-memory channel, a pipeline "
                          "send, ranks computing at once"} if engine is not None else {}),
        })
    return _with_engine_factors(profile, m)


def _with_engine_factors(profile: HardwareProfile, m: dict[str, Any]) -> HardwareProfile:
    """The profile with its engine factors, fitted by predicting the launched calibration jobs
    with the profile itself (``sims.calibrate.factors.fit_factors``)."""
    jobs = m.get("engine", {}).get("jobs")
    if profile.engine is None or not jobs:
        return profile
    return dataclasses.replace(profile, engine=fit_factors(profile, jobs))
