"""``FlopsProfiler`` and ``get_model_profile`` with DeepSpeed's API, counting with torch's
``FlopCounterMode`` instead of patching ``torch.nn.functional``.

How operations are counted
    ``FlopCounterMode`` sees every aten op that runs on the profiling thread (a dispatch mode), so
    matmuls written as ``x @ w``, ``torch.bmm`` or ``einsum`` inside a custom module count the
    same as ``nn.Linear``. Its formulas cover the contractions: mm, addmm, bmm, baddbmm,
    convolutions and the fused attention kernels; this module adds the few it lacks (matrix-vector,
    dot, and the CPU flash-attention kernel that ``scaled_dot_product_attention`` uses on CPU,
    which torch leaves at 0).

MACs rule
    Every counted op is a multiply-accumulate contraction and torch counts it as 2 FLOPs per MAC
    (2*m*n*k for an m-by-k times k-by-n product), so ``MACs = FLOPs / 2`` exactly. Elementwise
    work (bias adds, activations, softmax, norms) is not counted: it is small next to the
    contractions in the models this is meant for, and MFU is conventionally the matmul FLOPs.
    DeepSpeed adds some of that work to FLOPs, so its totals can be slightly higher.

Per-module attribution
    ``FlopCounterMode.get_flop_counts()`` also attributes FLOPs to modules, but keys them by a
    class-name path ("Net.blk.fc" rather than the state-dict name "blk.fc"), clears them each time
    the mode is entered, and tracks the running modules as a set (a module re-entered inside
    itself is lost); its tracker is replaced by a stub (see ``_GlobalOnly``). So each profiled
    module gets forward pre/post hooks that read the counter's
    running total on entry and exit: the difference is everything the module ran, its children
    included, attributed to the module object itself. A module called twice adds both calls; a
    module re-entered inside itself counts its outermost call only. The same hooks time each
    module with ``time.perf_counter`` (after ``torch.cuda.synchronize()`` when the model is on a
    GPU, so kernel time lands in the module that launched it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, overload

import torch
from torch import nn

from flowtrain.engine.parts import ProfiledEngine
from flowtrain.profiling.peak import check_peak_tflops
from flowtrain.profiling.rows import ModuleRow
from flowtrain.profiling.units import (
    duration_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)


class _Stats:
    __slots__ = ("flops", "duration", "calls", "depth", "t0", "f0")

    def __init__(self) -> None:
        self.flops = 0
        self.duration = 0.0
        self.calls = 0
        self.depth = 0  # > 0 while the module's forward is running
        self.t0 = 0.0
        self.f0 = 0


class _GlobalOnly:
    """Stands in for ``FlopCounterMode``'s module tracker, which this profiler does not read
    (its own hooks attribute FLOPs): the tracker puts a global hook on every module call and a
    gradient hook on every module output, work for names nobody reads. Counting then goes to
    "Global" only."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _GlobalOnly:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _extra_flop_formulas() -> dict[Any, Any]:
    """Formulas for contractions ``FlopCounterMode`` has none for (all 2 FLOPs per MAC).
    Arguments arrive as shapes (torch's shape wrapper replaces tensors by their shapes)."""
    from torch.utils import flop_counter

    aten = torch.ops.aten
    table: dict[Any, Any] = {}

    def mv(mat: Sequence[int], vec: Sequence[int], *args: Any, **kwargs: Any) -> int:
        return 2 * mat[0] * mat[1]

    def addmv(bias: Sequence[int], mat: Sequence[int], vec: Sequence[int], *args: Any,
              **kwargs: Any) -> int:
        return 2 * mat[0] * mat[1]

    def dot(a: Sequence[int], b: Sequence[int], *args: Any, **kwargs: Any) -> int:
        return 2 * a[0]

    for name, fn in (("mv", mv), ("addmv", addmv), ("dot", dot), ("vdot", dot)):
        if hasattr(aten, name):
            table[getattr(aten, name)] = fn
    sdpa = getattr(flop_counter, "sdpa_flop_count", None)
    cpu_flash = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if sdpa is not None and cpu_flash is not None:
        def cpu_flash_attention(q: Sequence[int], k: Sequence[int], v: Sequence[int],
                                *args: Any, **kwargs: Any) -> int:
            return int(sdpa(q, k, v))

        table[cpu_flash] = cpu_flash_attention
    return table


def _check_module(model: Any, what: str) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{what} must be a torch.nn.Module, got {type(model).__name__}")
    return model


def _check_int(name: str, value: Any, minimum: int, form: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be {form}, got {value!r}")
    return value


def check_output_file(output_file: Any) -> str | None:
    """``output_file`` as a path whose directory exists (None: print to stdout); raises
    ValueError naming what is wrong, before any profiling runs."""
    if output_file is None:
        return None
    if not isinstance(output_file, (str, os.PathLike)) or not os.fspath(output_file):
        raise ValueError(f"output_file must be a file path (str) or None for stdout, got "
                         f"{output_file!r}")
    path = os.fspath(output_file)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"output_file {path!r}: its directory {parent!r} does not exist; "
                         f"create it or give a path in an existing directory")
    return path


def _check_print_args(module_depth: Any, top_modules: Any, detailed: Any,
                      output_file: Any) -> str | None:
    """Checks print_model_profile's options (before a profile run, not after it)."""
    _check_int("module_depth", module_depth, -1, "an integer >= -1 (-1: every depth)")
    _check_int("top_modules", top_modules, 1, "an integer >= 1")
    if not isinstance(detailed, bool):
        raise ValueError(f"detailed must be True or False, got {detailed!r}")
    return check_output_file(output_file)


def _check_ignore_list(ignore_list: Any) -> tuple[type, ...]:
    if ignore_list is None:
        return ()
    if isinstance(ignore_list, type) or not isinstance(ignore_list, Iterable):
        raise TypeError(f"ignore_list must be a list of torch.nn.Module classes (e.g. "
                        f"[nn.Dropout]), got {ignore_list!r}")
    out = tuple(ignore_list)
    for t in out:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise TypeError(f"ignore_list must hold torch.nn.Module classes (e.g. "
                            f"[nn.Dropout]), got {t!r} in it")
    return out


class FlopsProfiler:
    """Measures the parameters, forward FLOPs/MACs and forward latency of a model and of each
    of its modules, like DeepSpeed's ``FlopsProfiler``.

    Typical use: ``start_profile()``, one forward, ``stop_profile()``, read the totals or
    ``print_model_profile()``, then ``end_profile()``. ``ds_engine`` (a flowtrain engine) adds
    the world size, batch size and the last step's backward/step timings to the report;
    ``recompute_fwd_factor`` is the share of the forward recomputed in backward (activation
    checkpointing), used for the backward estimate of (2 + factor) x forward FLOPs.
    ``peak_tflops`` (flowtrain's addition) is the device's peak for the MFU line when no
    calibrated profile or known GPU supplies one."""

    def __init__(self, model: nn.Module, ds_engine: ProfiledEngine | None = None,
                 recompute_fwd_factor: float = 0.0, *, peak_tflops: float | None = None,
                 ) -> None:
        self.model = _check_module(model, "model")
        if isinstance(recompute_fwd_factor, bool) or \
                not isinstance(recompute_fwd_factor, (int, float)) or \
                not 0.0 <= recompute_fwd_factor < float("inf"):
            raise ValueError(f"recompute_fwd_factor must be a number >= 0 (the fraction of the "
                             f"forward recomputed in backward, e.g. 1.0 for full activation "
                             f"checkpointing), got {recompute_fwd_factor!r}")
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = float(recompute_fwd_factor)
        self.peak_tflops = check_peak_tflops(peak_tflops)
        self.started = False
        self._counter: Any = None
        self._handles: list[Any] = []
        self._stats: dict[int, _Stats] = {}
        self._params: dict[int, int] = {}
        self._sync: torch.device | None = None  # the CUDA device to synchronize, if any
        self._has_profile = False

    # -- DeepSpeed's API ---------------------------------------------------------------------------

    def start_profile(self, ignore_list: list[type] | None = None) -> None:
        """Starts counting: resets the figures, hooks every module (except instances of the
        classes in ``ignore_list``, whose work still counts toward their parents; the model
        itself is always profiled) and enters the FLOP counter on this thread."""
        ignored = _check_ignore_list(ignore_list)
        if self.started:
            raise RuntimeError("start_profile: the profiler is already running; call "
                               "stop_profile() (or end_profile()) first")
        from torch.utils.flop_counter import FlopCounterMode

        try:
            # torch wraps every dispatch mode's handler so that its first call imports
            # torch._dynamo (seconds): pay that here, not inside the first profiled module.
            import torch._dynamo  # noqa: F401
        except ImportError:
            pass
        self.reset_profile()
        self._sync = next((p.device for p in self.model.parameters() if p.is_cuda), None) \
            if torch.cuda.is_available() else None
        for module in self.model.modules():
            if module is not self.model and isinstance(module, ignored):
                continue
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._exit, always_call=True))
        counter = FlopCounterMode(display=False, custom_mapping=_extra_flop_formulas())
        if hasattr(counter, "mod_tracker"):
            # a stand-in with only what FlopCounterMode reads, not a ModuleTracker
            counter.mod_tracker = _GlobalOnly()  # type: ignore[assignment]
        counter.__enter__()
        # The mode's first counted op sets up its handler (milliseconds): do it outside every
        # module's timing. Its 2 FLOPs go to no module, so no total includes them.
        torch.zeros(1, 1).mm(torch.zeros(1, 1))
        self._counter = counter
        self.started = True
        self._has_profile = True

    def stop_profile(self) -> None:
        """Stops counting and removes the hooks; the figures stay readable until
        ``end_profile``. Must run on the thread that called ``start_profile``."""
        if not self.started:
            return
        counter, self._counter = self._counter, None
        self.started = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for stats in self._stats.values():
            stats.depth = 0  # a forward that raised leaves its modules "running"
        counter.__exit__(None, None, None)

    def reset_profile(self) -> None:
        """Zeroes every module's FLOPs, latency and call count and recounts the parameters."""
        self._stats = {id(m): _Stats() for m in self.model.modules()}
        full = _full_numels(self.ds_engine)
        self._params = {id(m): sum(full.get(id(p), p.numel()) for p in m.parameters())
                        for m in self.model.modules()}

    def end_profile(self) -> None:
        """Stops profiling and drops the figures (call it after reading or printing them)."""
        self.stop_profile()
        self._stats = {}
        self._params = {}
        self._has_profile = False

    @overload
    def get_total_flops(self, as_string: Literal[False] = False) -> int: ...

    @overload
    def get_total_flops(self, as_string: Literal[True]) -> str: ...

    @overload
    def get_total_flops(self, as_string: bool = False) -> int | str: ...

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Forward FLOPs of the model (every profiled call), e.g. ``"1.23 G"`` as a string."""
        flops = self._root().flops
        return number_to_string(flops) if as_string else flops

    @overload
    def get_total_macs(self, as_string: Literal[False] = False) -> int: ...

    @overload
    def get_total_macs(self, as_string: Literal[True]) -> str: ...

    @overload
    def get_total_macs(self, as_string: bool = False) -> int | str: ...

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Forward multiply-accumulates (FLOPs / 2), e.g. ``"1.23 GMACs"`` as a string."""
        macs = self._root().flops // 2
        return macs_to_string(macs) if as_string else macs

    @overload
    def get_total_params(self, as_string: Literal[False] = False) -> int: ...

    @overload
    def get_total_params(self, as_string: Literal[True]) -> str: ...

    @overload
    def get_total_params(self, as_string: bool = False) -> int | str: ...

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters of the model (ZeRO-3 partitioned ones at their full size)."""
        params = self._params.get(id(self.model), 0)
        return params_to_string(params) if as_string else params

    @overload
    def get_total_duration(self, as_string: Literal[False] = False) -> float: ...

    @overload
    def get_total_duration(self, as_string: Literal[True]) -> str: ...

    @overload
    def get_total_duration(self, as_string: bool = False) -> float | str: ...

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Seconds spent in the model's forward while profiling, e.g. ``"76.67 ms"``."""
        seconds = self._root().duration
        return duration_to_string(seconds) if as_string else seconds

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1,
                            top_modules: int = 1, detailed: bool = True,
                            output_file: str | None = None) -> None:
        """Prints the summary (totals, throughput, MFU), the top modules per depth and, with
        ``detailed``, the module tree with each module's figures, to stdout or ``output_file``
        (overwritten). ``module_depth`` -1 means every depth."""
        from flowtrain.profiling.report import render

        _check_int("profile_step", profile_step, 0, "an integer >= 0 (the step profiled)")
        path = _check_print_args(module_depth, top_modules, detailed, output_file)
        if not self._has_profile or not any(st.calls for st in self._stats.values()):
            raise RuntimeError("print_model_profile: nothing was profiled; call start_profile(), "
                               "run the model's forward, then print (before end_profile())")
        text = render(self, profile_step=profile_step, module_depth=module_depth,
                      top_modules=top_modules, detailed=detailed)
        if path is None:
            print(text, flush=True)
        else:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text + "\n")

    # -- flowtrain additions ---------------------------------------------------------------------

    def module_rows(self, depth: int = -1) -> list[ModuleRow]:
        """Every module's figures in model order (depth-first), down to ``depth`` (-1: all)."""
        _check_int("depth", depth, -1, "an integer >= -1 (-1: every depth)")
        nodes = walk(self.model)
        figures = self._inclusive(nodes)
        return [ModuleRow(name=name, type_name=type(module).__name__, depth=d,
                          params=self._params.get(id(module), 0), flops=figures[id(module)][0],
                          macs=figures[id(module)][0] // 2, duration=figures[id(module)][1],
                          calls=figures[id(module)][2])
                for name, module, d in nodes if depth == -1 or d <= depth]

    def _inclusive(self, nodes: list[tuple[str, nn.Module, int]]) -> dict[int, tuple[int, float,
                                                                                     int]]:
        """(flops, seconds, calls) of each module. A module whose forward never ran but whose
        children did (a ModuleList or Sequential iterated by its parent, or an ignored class)
        gets the sum of its children, as DeepSpeed reports containers."""
        out: dict[int, tuple[int, float, int]] = {}
        children: dict[int, list[int]] = {}
        for _name, module, _ in nodes:
            children[id(module)] = [id(c) for c in module.children()]
        for _, module, _ in reversed(nodes):  # children before their parents
            stats = self._stats.get(id(module))
            if stats is not None and stats.calls:
                out[id(module)] = (stats.flops, stats.duration, stats.calls)
                continue
            kids = [out[c] for c in children[id(module)] if c in out]
            out[id(module)] = (sum(k[0] for k in kids), sum(k[1] for k in kids), 0)
        return out

    # -- hooks -----------------------------------------------------------------------------------

    def _root(self) -> _Stats:
        stats = self._stats.get(id(self.model)) or _Stats()
        if stats.calls or not self._stats:
            return stats
        total = _Stats()  # only parts of the model ran: the model is the sum of its children
        total.flops, total.duration, _ = self._inclusive(walk(self.model))[id(self.model)]
        return total

    def _counted(self) -> int:
        counter = self._counter
        return counter.get_total_flops() if counter is not None else 0

    def _enter(self, module: nn.Module, args: Any) -> None:
        stats = self._stats.get(id(module))
        if stats is None:  # a module added to the model after start_profile
            stats = self._stats[id(module)] = _Stats()
        if stats.depth == 0:
            if self._sync is not None:
                torch.cuda.synchronize(self._sync)
            stats.f0 = self._counted()
            stats.t0 = time.perf_counter()
        stats.depth += 1

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        stats = self._stats.get(id(module))
        if stats is None or stats.depth == 0:
            return
        stats.depth -= 1
        if stats.depth == 0:
            if self._sync is not None:
                torch.cuda.synchronize(self._sync)
            stats.duration += time.perf_counter() - stats.t0
            stats.flops += self._counted() - stats.f0
            stats.calls += 1


def walk(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """(state-dict prefix, module, depth) of every module once, depth-first from the model."""
    out: list[tuple[str, nn.Module, int]] = []
    seen: set[int] = set()

    def visit(name: str, module: nn.Module, depth: int) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        out.append((name, module, depth))
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child, depth + 1)

    visit("", model, 0)
    return out


def _full_numels(engine: ProfiledEngine | None) -> dict[int, int]:
    """Under ZeRO stage 3 a partitioned parameter holds an empty placeholder outside its
    module's forward; the engine's step plan still records its full size."""
    if engine is None or getattr(engine, "stage3", None) is None:
        return {}
    try:
        trainable = engine.trainable
        return {id(trainable[s.index]): int(s.numel)
                for b in engine.plan.buckets for s in b.slots}
    except (AttributeError, IndexError, TypeError):
        return {}


def get_model_profile(model: nn.Module, input_shape: tuple[int, ...] | None = None,
                      args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None,
                      print_profile: bool = True, detailed: bool = True, module_depth: int = -1,
                      top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: str | None = None, ignore_modules: list[type] | None = None,
                      ) -> tuple[Any, Any, Any]:
    """Runs ``warm_up`` forwards, then one profiled forward, and returns ``(flops, macs,
    params)`` of the model (strings such as ``"1.23 G"``, ``"615 MMACs"``, ``"1.2 M"`` with
    ``as_string``). The input is a random tensor of ``input_shape`` (the model's dtype and
    device) as the only argument, or else ``args``/``kwargs``. Optionally prints the profile."""
    _check_module(model, "model")
    args = list(args) if args is not None else []
    kwargs = dict(kwargs) if kwargs is not None else {}
    _check_int("warm_up", warm_up, 0, "an integer >= 0 (forwards run before profiling)")
    if print_profile:
        _check_print_args(module_depth, top_modules, detailed, output_file)
    _check_ignore_list(ignore_modules)
    if input_shape is not None:
        if not isinstance(input_shape, (tuple, list)) or not input_shape or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in input_shape):
            raise ValueError(f"input_shape must be a tuple of positive ints, e.g. (8, 3, 224, "
                             f"224), got {input_shape!r}")
        if args:
            raise ValueError("give either input_shape or args, not both: input_shape builds "
                             "the model's only positional argument")
        first = next(model.parameters(), None)
        dtype = first.dtype if first is not None and first.is_floating_point() else None
        device = first.device if first is not None else None
        args = [torch.rand(tuple(input_shape), dtype=dtype, device=device)]
    if not args and not kwargs:
        raise ValueError("get_model_profile needs the model's input: input_shape=(...), "
                         "args=[...] and/or kwargs={...}")
    for _ in range(warm_up):
        model(*args, **kwargs)
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=ignore_modules)
    try:
        model(*args, **kwargs)
    finally:
        prof.stop_profile()
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if print_profile:
        prof.print_model_profile(profile_step=warm_up, module_depth=module_depth,
                                 top_modules=top_modules, detailed=detailed,
                                 output_file=output_file)
    prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
