"""The ``flops_profiler`` config section at work in a training run: rank 0 profiles one forward
of global step ``profile_step`` and prints the profile when that step ends.

As in DeepSpeed, ``profile_step`` counts finished optimizer steps from 0 (profile_step 1 is the
second step, leaving one warm-up step), only the forward is measured, and the backward is
estimated as (2 + recompute_fwd_factor) x the forward's FLOPs. With gradient accumulation the
first micro-batch of the step is the one profiled; the step's FLOPs are that times the number of
micro-batches. The backward, communication and optimizer timings come from the engine's own
step timer.

The engine is not modified: profiling starts and stops in forward pre/post hooks on the engine
module (so the FLOP counter is entered and left on the training thread, around the model's own
hooks), and the print happens on the training thread right after the engine's ``step()``
returns, through a wrapper set on this engine instance that removes itself once the profile is
printed. (An ``after_step`` stage actor would run on another thread, after the engine may have
started the next step and overwritten the timings.)"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowtrain.config.sections import FlopsProfilerConfig
from flowtrain.profiling.profiler import FlopsProfiler, check_output_file

if TYPE_CHECKING:
    from flowtrain.engine.engine import FlowtrainEngine


class EngineProfile:
    """Profiles one forward of ``engine`` and prints it after its step; ``totals`` keeps the
    printed figures (flops, macs, params, fwd latency) once printed."""

    def __init__(self, engine: FlowtrainEngine, cfg: FlopsProfilerConfig) -> None:
        self.engine = engine
        self.cfg = cfg
        self.profiler = FlopsProfiler(engine.module, ds_engine=engine,
                                      recompute_fwd_factor=cfg.recompute_fwd_factor)
        self.totals: dict[str, float] | None = None
        self._active = False
        self._profiled = False
        self._handles = [engine.register_forward_pre_hook(self._before_forward),
                         engine.register_forward_hook(self._after_forward, always_call=True)]
        self._engine_step = engine.step
        engine.step = self._step  # type: ignore[method-assign]  # shadows the class's step()

    @property
    def printed(self) -> bool:
        return self.totals is not None

    def _before_forward(self, module: Any, args: Any) -> None:
        if self._active or self._profiled:
            return
        step = self.engine.global_steps
        if step == self.cfg.profile_step:
            self.profiler.start_profile()
            self._active = True
        elif step > self.cfg.profile_step:  # e.g. resumed from a later checkpoint
            self.close()

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        if not self._active:
            return
        self.profiler.stop_profile()
        self._active = False
        self._profiled = True
        self._remove_hooks()

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        result = self._engine_step(*args, **kwargs)
        if self._profiled and self.engine.global_steps > self.cfg.profile_step:
            prof = self.profiler
            try:
                prof.print_model_profile(profile_step=self.cfg.profile_step,
                                         module_depth=self.cfg.module_depth,
                                         top_modules=self.cfg.top_modules,
                                         detailed=self.cfg.detailed,
                                         output_file=self.cfg.output_file)
                self.totals = {"flops": prof.get_total_flops(), "macs": prof.get_total_macs(),
                               "params": prof.get_total_params(),
                               "duration": prof.get_total_duration()}
            finally:
                self.close()
        return result

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def close(self) -> None:
        """Removes every hook and the step wrapper (nothing of the profiler stays behind)."""
        self._remove_hooks()
        self.profiler.end_profile()
        self._active = False
        if self.engine.__dict__.get("step") == self._step:
            del self.engine.step


def engine_hook(engine: FlowtrainEngine, cfg: FlopsProfilerConfig) -> EngineProfile | None:
    """Wires the FLOPs profiler into ``engine`` when the config's ``flops_profiler`` section
    ``cfg`` enables it; on rank 0 only, as DeepSpeed profiles and prints there alone. Returns
    the hook, or None when nothing was wired. Called by ``flowtrain.initialize`` once the
    engine is built."""
    if not cfg.enabled or getattr(engine, "global_rank", 0) != 0:
        return None
    if hasattr(engine, "train_batch"):
        # A pipeline engine runs its forwards on a stage actor's thread, not in engine(...).
        from flowtrain.log import get_logger

        get_logger("flowtrain.profiling").warning(
            "flops_profiler is not supported with a pipeline engine yet; not profiling "
            "(set flops_profiler.enabled false to silence this)")
        return None
    try:
        check_output_file(cfg.output_file)
    except ValueError as exc:
        raise ValueError(f"flops_profiler.{exc}") from None
    return EngineProfile(engine, cfg)
