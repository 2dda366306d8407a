"""``flowtrain report``: what flowtrain runs on (like ``ds_report``): versions, devices, CPU,
memory.

Every probe is guarded, so a broken or missing library shows up as a row instead of a crash.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
from collections.abc import Callable
from typing import Any

LIBRARIES = ("anyio", "msgpack", "structlog", "textual", "pydantic", "numpy", "psutil")


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(module)
        except PackageNotFoundError:
            mod = importlib.import_module(module)
            return str(getattr(mod, "__version__", "unknown"))
    except Exception:
        return None


def _guard(probe: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return probe()
    except Exception as exc:  # one failing probe must not hide the others
        return {"available": False, "error": f"{type(exc).__name__}: {exc}"}


def _torch() -> dict[str, Any]:
    try:
        import torch
    except ImportError as exc:
        return {"available": False, "error": str(exc)}
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {
        "available": True, "version": torch.__version__, "path": os.path.dirname(torch.__file__),
        "cuda_available": cuda, "cuda_version": torch.version.cuda,
        "device_count": torch.cuda.device_count() if cuda else 0,
        "distributed_available": dist.is_available(),
        "gloo_available": bool(dist.is_available() and dist.is_gloo_available()),
        "nccl_available": bool(dist.is_available() and dist.is_nccl_available()),
        "nccl_version": None,
    }
    if info["nccl_available"]:
        try:
            info["nccl_version"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:
            pass
    if cuda:
        info["devices"] = [torch.cuda.get_device_name(i) for i in range(info["device_count"])]
    return info


def _numba() -> dict[str, Any]:
    try:
        import numba
    except ImportError as exc:
        return {"available": False, "error": str(exc)}
    simulator = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
    info: dict[str, Any] = {"available": True, "version": numba.__version__,
                            "cuda_simulator": simulator, "cuda_available": False}
    try:
        from numba import cuda

        info["cuda_available"] = bool(cuda.is_available())
    except Exception as exc:
        info["cuda_error"] = f"{type(exc).__name__}: {exc}"
    return info


def _zmq() -> dict[str, Any]:
    try:
        import zmq
    except ImportError as exc:
        return {"available": False, "error": str(exc)}
    return {"available": True, "version": zmq.pyzmq_version(), "libzmq_version": zmq.zmq_version()}


def _system() -> dict[str, Any]:
    info: dict[str, Any] = {"os": platform.platform(), "machine": platform.machine(),
                            "cpu_count": os.cpu_count(), "hostname": platform.node()}
    try:
        import psutil

        mem = psutil.virtual_memory()
        info["memory_total_bytes"] = int(mem.total)
        info["memory_available_bytes"] = int(mem.available)
    except Exception:
        try:
            pages, free = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_AVPHYS_PAGES")
            size = os.sysconf("SC_PAGE_SIZE")
            info["memory_total_bytes"], info["memory_available_bytes"] = pages * size, free * size
        except (ValueError, OSError):
            pass
    return info


def report() -> dict[str, Any]:
    """Everything ``flowtrain report`` shows, as a JSON-ready dict."""
    from flowtrain import __version__

    return {
        "flowtrain": {"version": __version__, "path": os.path.dirname(os.path.abspath(__file__))},
        "python": {"version": platform.python_version(), "executable": sys.executable,
                   "implementation": platform.python_implementation()},
        "torch": _guard(_torch),
        "numba": _guard(_numba),
        "pyzmq": _guard(_zmq),
        "libraries": {name: _version(name) for name in LIBRARIES},
        "system": _guard(_system),
        "kernels": _guard(_kernels),
    }


def _kernels() -> dict[str, Any]:
    """Each cuda_numba kernel and whether its CPU and CUDA versions compile (or load) here."""
    import cuda_numba

    return {"available": True, "rows": cuda_numba.kernel_status()}


def _yes(value: Any) -> str:
    return "yes" if value else "no"


def _gib(value: Any) -> str:
    return f"{value / 2**30:.1f} GiB" if isinstance(value, (int, float)) else "unknown"


def format_report(data: dict[str, Any]) -> str:
    """Aligned ``name ..... value`` lines, grouped like ds_report."""
    t, n, z, s = data["torch"], data["numba"], data["pyzmq"], data["system"]
    rows: list[tuple[str, str] | str] = ["flowtrain environment report"]
    rows += [("flowtrain", f"{data['flowtrain']['version']} ({data['flowtrain']['path']})"),
             ("python", f"{data['python']['version']} ({data['python']['executable']})")]
    rows.append("torch")
    if t.get("available"):
        rows += [("torch version", f"{t['version']} ({t['path']})"),
                 ("CUDA available", _yes(t["cuda_available"])),
                 ("CUDA version (torch built with)", t["cuda_version"] or "none (CPU build)"),
                 ("CUDA devices", str(t["device_count"]) + (f" ({', '.join(t['devices'])})"
                                                           if t.get("devices") else "")),
                 ("NCCL available", _yes(t["nccl_available"]) + (f" ({t['nccl_version']})"
                                                                if t.get("nccl_version") else "")),
                 ("gloo available", _yes(t["gloo_available"]))]
    else:
        rows.append(("torch", f"not available: {t.get('error')}"))
    rows.append("numba")
    if n.get("available"):
        rows += [("numba version", n["version"]),
                 ("numba CUDA target available", _yes(n["cuda_available"])),
                 ("CUDA simulator (NUMBA_ENABLE_CUDASIM)", _yes(n["cuda_simulator"]))]
    else:
        rows.append(("numba", f"not available: {n.get('error')}"))
    rows.append("libraries")
    rows.append(("pyzmq / libzmq", f"{z['version']} / {z['libzmq_version']}" if z.get("available")
                 else f"not available: {z.get('error')}"))
    for name, version in data["libraries"].items():
        rows.append((name, version or "not installed"))
    rows.append("kernels (cuda_numba): CPU | CUDA")
    k = data["kernels"]
    if k.get("available"):
        rows += [(row["kernel"], f"{row['cpu']} | {row['cuda']}") for row in k["rows"]]
    else:
        rows.append(("cuda_numba", f"not available: {k.get('error')}"))
    rows.append("system")
    rows += [("OS", str(s.get("os"))), ("CPU count", str(s.get("cpu_count"))),
             ("memory total", _gib(s.get("memory_total_bytes"))),
             ("memory available", _gib(s.get("memory_available_bytes")))]
    width = max(len(r[0]) for r in rows if isinstance(r, tuple)) + 3
    out = []
    for row in rows:
        if isinstance(row, str):
            out.append(("-" * 8 + f" {row} ").ljust(width + 20, "-"))
        else:
            out.append(f"{row[0]} ".ljust(width, ".") + f" {row[1]}")
    return "\n".join(out)


def main(*, as_json: bool = False) -> int:
    data = report()
    print(json.dumps(data, indent=2) if as_json else format_report(data))
    return 0
