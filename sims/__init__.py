"""Cost model and discrete-event simulator of a training step: ``predict`` a model + config +
cluster, or build the pieces (``build_plan``, ``execute``, ``step_figures``) yourself.

Names load on first use, so importing one submodule (say ``sims.executor``) does not pull in
torch through the model tracer.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "HardwareProfile": "sims.hardware", "Link": "sims.hardware", "get_profile": "sims.hardware",
    "BUILTIN_PROFILES": "sims.hardware",
    "ModelSpec": "sims.models", "get_model": "sims.models", "trace_module": "sims.models",
    "memory_per_rank": "sims.memory", "model_state_bytes": "sims.memory",
    "SimTask": "sims.executor", "Timeline": "sims.executor", "StepFigures": "sims.executor",
    "execute": "sims.executor", "step_figures": "sims.executor",
    "Layout": "sims.planner", "Workload": "sims.planner", "SimPlan": "sims.planner",
    "build_plan": "sims.planner", "pipeline_tasks": "sims.pricing",
    "trace_events": "sims.trace", "write_trace": "sims.trace",
    "Prediction": "sims.prediction", "predict": "sims.prediction",
}

__all__ = ["BUILTIN_PROFILES", "HardwareProfile", "Layout", "Link", "ModelSpec", "Prediction",
           "SimPlan", "SimTask", "StepFigures", "Timeline", "Workload", "build_plan", "execute",
           "get_model", "get_profile", "memory_per_rank", "model_state_bytes", "pipeline_tasks",
           "predict", "step_figures", "trace_events", "trace_module", "write_trace"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sims' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
