"""FLOPs profiler with DeepSpeed's API (``FlopsProfiler``, ``get_model_profile``), counting with
torch's ``FlopCounterMode``; ``engine_hook`` runs it from the ``flops_profiler`` config section."""

from flowtrain.profiling.engine_hook import EngineProfile, engine_hook
from flowtrain.profiling.profiler import FlopsProfiler, get_model_profile
from flowtrain.profiling.rows import ModuleRow
from flowtrain.profiling.units import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "EngineProfile",
    "FlopsProfiler",
    "ModuleRow",
    "duration_to_string",
    "engine_hook",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]
