"""Torch-facing fused kernels: validate tensors, then run the CPU (``cpu.py``) or CUDA
(``cuda.py``) kernel on zero-copy views of their storage, chosen by the tensors' device.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numba
import numpy as np
import torch

from . import cpu

_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_LOW = (torch.float16, torch.bfloat16)
_ANY = "float32, float16 or bfloat16"


# ---------------------------------------------------------------- validation

def _check(fn: str, name: str, t: Any, device: torch.device | None, dtypes: Sequence[torch.dtype],
           numel: int | None, ref: str = "param") -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = _ANY if len(dtypes) == 3 else " or ".join(str(d).replace("torch.", "")
                                                         for d in dtypes)
        raise TypeError(f"{fn}: {name} has dtype {t.dtype}; expected {want}")
    if device is None:
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{fn}: {name} is on {t.device}; expected a cpu or cuda tensor")
    elif t.device != device:
        raise ValueError(f"{fn}: {name} is on {t.device} but {ref} is on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous (got strides {tuple(t.stride())} for "
                         f"shape {tuple(t.shape)}); call .contiguous() on it first")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{fn}: {name} has {t.numel()} elements but {ref} has {numel}")
    return t


def _as_float(fn: str, name: str, v: Any) -> float:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise ValueError(f"{fn}: {name} must be a scalar, got a tensor of shape "
                             f"{tuple(v.shape)}")
        v = v.item()
    try:
        return float(v)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: {name} must be a number, got {v!r}") from None


# ---------------------------------------------------------------- array views

_threads_set = False


def sync_threads() -> None:
    # Follow torch's intra-op thread count so the two libraries do not oversubscribe the
    # cores; NUMBA_NUM_THREADS (numba's upper bound) wins where the user set it.
    global _threads_set
    if _threads_set:
        return
    want = torch.get_num_threads()
    if "NUMBA_NUM_THREADS" in os.environ:
        want = numba.config.NUMBA_NUM_THREADS
    with keep_torch_threads():
        numba.set_num_threads(max(1, min(want, numba.config.NUMBA_NUM_THREADS)))
        _start_pool()
    _threads_set = True


@contextlib.contextmanager
def keep_torch_threads() -> Iterator[None]:
    """numba's OpenMP pool shares torch's libgomp, and starting it sets the process-wide
    OpenMP thread count to NUMBA_NUM_THREADS: torch would then run 2 threads per rank where
    OMP_NUM_THREADS said 1, and ranks sharing a host oversubscribe it. Put torch's back."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _start_pool() -> None:
    # One tiny parallel launch starts the pool now, inside keep_torch_threads.
    from . import cpu

    cpu.KERNELS["cast"][0](np.zeros(1, np.float32), 0, np.zeros(1, np.float32), 0)


def _np(t: torch.Tensor) -> np.ndarray:
    """1-D numpy view of a contiguous CPU tensor; fp16/bf16 as uint16 bits."""
    t = t.detach().reshape(-1)
    if t.dtype in _LOW:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _dev(t: torch.Tensor) -> Any:
    """1-D numba device-array view of a contiguous CUDA tensor; fp16/bf16 as uint16 bits."""
    from numba import cuda as ncuda

    t = t.detach().reshape(-1)
    if t.dtype in _LOW:
        # sync=False: the kernel runs on this stream already, so no extra wait is needed
        return ncuda.as_cuda_array(t.view(torch.int16), sync=False).view(np.uint16)
    return ncuda.as_cuda_array(t, sync=False)


_NO_OUT = np.empty(0, np.uint16)


def _cuda_module() -> Any:
    try:
        from . import cuda as kcuda
    except ImportError as e:
        raise RuntimeError("cuda_numba: CUDA tensors need cuda_numba.cuda, which failed to "
                           f"import: {e}") from e
    return kcuda


def _launch(name: str, t: torch.Tensor, args: list) -> Any:
    """Call kernel `name` on t's device with array/scalar args (arrays still as tensors)."""
    if t.device.type == "cpu":
        sync_threads()
        conv = [_np(a) if isinstance(a, torch.Tensor) else a for a in args]
        conv = [_NO_OUT if a is None else a for a in conv]
        return getattr(cpu, name)(*conv)
    from numba import cuda as ncuda

    kcuda = _cuda_module()
    fn = getattr(kcuda, name)
    conv = [_dev(a) if isinstance(a, torch.Tensor) else a for a in args]
    if any(a is None for a in conv):
        empty = ncuda.device_array(0, np.uint16)
        conv = [empty if a is None else a for a in conv]
    with torch.cuda.device(t.device):
        stream = ncuda.external_stream(torch.cuda.current_stream(t.device).cuda_stream)
        kwargs = {"stream": stream} if "stream" in inspect.signature(fn).parameters else {}
        if name == "unscale_check":
            flag = ncuda.to_device(np.zeros(1, np.int32), stream=stream)
            fn(*conv, flag, **kwargs)
            return bool(flag.copy_to_host(stream=stream)[0])
        if name == "sum_squares":
            # one float64 partial per block; summing them here is the only host sync
            partial = ncuda.device_array(kcuda.sum_squares_blocks(conv[0].shape[0]), np.float64,
                                         stream=stream)
            fn(*conv, partial, **kwargs)
            return float(partial.copy_to_host(stream=stream).sum())
        return fn(*conv, **kwargs)


# ---------------------------------------------------------------- optimizers

def _model_out(fn: str, model_out: torch.Tensor | None, param: torch.Tensor) -> int:
    if model_out is None:
        return 0
    _check(fn, "model_out", model_out, param.device, _LOW, param.numel())
    return _KIND[model_out.dtype]


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, *, lr: float, betas: tuple[float, float],
              eps: float, weight_decay: float, step: int, adamw: bool = True,
              bias_correction: bool = True, inv_scale: float = 1.0,
              model_out: torch.Tensor | None = None) -> None:
    """One Adam/AdamW step in place on fp32 `param`; `step` counts from 1 (this step).

    grad may be fp32/fp16/bf16 and is multiplied by inv_scale; model_out (fp16/bf16), if
    given, receives the rounded new parameters in the same pass.
    """
    fn = "adam_step"
    _check(fn, "param", param, None, (torch.float32,), None)
    n, dev = param.numel(), param.device
    _check(fn, "grad", grad, dev, tuple(_KIND), n)
    _check(fn, "exp_avg", exp_avg, dev, (torch.float32,), n)
    _check(fn, "exp_avg_sq", exp_avg_sq, dev, (torch.float32,), n)
    out_kind = _model_out(fn, model_out, param)
    beta1, beta2 = (_as_float(fn, "betas", b) for b in betas)
    step = int(step)
    if step < 1:
        raise ValueError(f"{fn}: step is {step}; expected the 1-based number of this step")
    bc1 = 1.0 - beta1 ** step if bias_correction else 1.0
    bc2 = 1.0 - beta2 ** step if bias_correction else 1.0
    if n == 0:
        return
    _launch("adam", param, [param, grad, _KIND[grad.dtype], exp_avg, exp_avg_sq, model_out,
                            out_kind, _as_float(fn, "lr", lr), beta1, beta2,
                            _as_float(fn, "eps", eps), _as_float(fn, "weight_decay", weight_decay),
                            bc1, bc2, _as_float(fn, "inv_scale", inv_scale), bool(adamw)])


def lion_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float,
              betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
              inv_scale: float = 1.0, model_out: torch.Tensor | None = None) -> None:
    """One Lion step in place on fp32 `param` (decoupled weight decay, sign update)."""
    fn = "lion_step"
    _check(fn, "param", param, None, (torch.float32,), None)
    n, dev = param.numel(), param.device
    _check(fn, "grad", grad, dev, tuple(_KIND), n)
    _check(fn, "exp_avg", exp_avg, dev, (torch.float32,), n)
    out_kind = _model_out(fn, model_out, param)
    beta1, beta2 = (_as_float(fn, "betas", b) for b in betas)
    if n == 0:
        return
    _launch("lion", param, [param, grad, _KIND[grad.dtype], exp_avg, model_out, out_kind,
                            _as_float(fn, "lr", lr), beta1, beta2,
                            _as_float(fn, "weight_decay", weight_decay),
                            _as_float(fn, "inv_scale", inv_scale)])


def sgd_step(param: torch.Tensor, grad: torch.Tensor, momentum_buf: torch.Tensor | None, *,
             lr: float, momentum: float = 0.0, dampening: float = 0.0,
             weight_decay: float = 0.0, nesterov: bool = False, first_step: bool = False,
             inv_scale: float = 1.0, model_out: torch.Tensor | None = None) -> None:
    """One SGD step with torch.optim.SGD semantics; first_step=True seeds momentum_buf with g."""
    fn = "sgd_step"
    _check(fn, "param", param, None, (torch.float32,), None)
    n, dev = param.numel(), param.device
    _check(fn, "grad", grad, dev, tuple(_KIND), n)
    momentum = _as_float(fn, "momentum", momentum)
    if momentum != 0.0:
        if momentum_buf is None:
            raise ValueError(f"{fn}: momentum_buf is None but momentum is {momentum}; pass a "
                             "float32 buffer shaped like param")
        _check(fn, "momentum_buf", momentum_buf, dev, (torch.float32,), n)
    else:
        momentum_buf = None
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ValueError(f"{fn}: nesterov needs momentum > 0 and dampening 0, got momentum="
                         f"{momentum}, dampening={dampening}")
    out_kind = _model_out(fn, model_out, param)
    if n == 0:
        return
    _launch("sgd", param, [param, grad, _KIND[grad.dtype], momentum_buf, model_out, out_kind,
                           _as_float(fn, "lr", lr), momentum,
                           _as_float(fn, "dampening", dampening),
                           _as_float(fn, "weight_decay", weight_decay), bool(nesterov),
                           bool(first_step), _as_float(fn, "inv_scale", inv_scale)])


# ---------------------------------------------------------------- mixed precision helpers

def unscale_and_check(grad: torch.Tensor, out: torch.Tensor, inv_scale: float) -> bool:
    """out (fp32) = grad * inv_scale in one pass; True when grad holds any inf or NaN."""
    fn = "unscale_and_check"
    _check(fn, "grad", grad, None, tuple(_KIND), None)
    _check(fn, "out", out, grad.device, (torch.float32,), grad.numel(), ref="grad")
    if grad.numel() == 0:
        return False
    return bool(_launch("unscale_check", grad, [grad, _KIND[grad.dtype], out,
                                                _as_float(fn, "inv_scale", inv_scale)]))


def l2_norm(tensors: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """sqrt of the sum of squares over all tensors (float64 partial sums; on CPU, fp16 tensors'
    exact float32 squares are summed in float32 over runs of 256 first), a 0-dim float32."""
    fn = "l2_norm"
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    tensors = list(tensors)
    total = 0.0
    device = tensors[0].device if tensors else torch.device("cpu")
    for i, t in enumerate(tensors):
        _check(fn, f"tensors[{i}]", t, None, tuple(_KIND), None)
        if t.device != device:
            raise ValueError(f"{fn}: tensors[{i}] is on {t.device} but tensors[0] is on {device}")
        if t.numel():
            total += _launch("sum_squares", t, [t, _KIND[t.dtype]])
    return torch.tensor(total ** 0.5, dtype=torch.float32, device=device)


def cast_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst = src converted between float32/float16/bfloat16 (round-to-nearest-even); returns dst."""
    fn = "cast_"
    _check(fn, "src", src, None, tuple(_KIND), None)
    _check(fn, "dst", dst, src.device, tuple(_KIND), src.numel(), ref="src")
    if src.numel():
        _launch("cast", src, [src, _KIND[src.dtype], dst, _KIND[dst.dtype]])
    return dst


# ---------------------------------------------------------------- buckets

def flatten(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate tensors in order into one flat buffer (cast to out's dtype if given)."""
    fn = "flatten"
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        _check(fn, f"tensors[{i}]", t, None, tuple(_KIND), None)
    total = sum(t.numel() for t in tensors)
    if out is None:
        if not tensors:
            return torch.empty(0)
        out = torch.empty(total, dtype=tensors[0].dtype, device=tensors[0].device)
    _check(fn, "out", out, None, tuple(_KIND), total, ref="the tensors together")
    off = 0
    for i, t in enumerate(tensors):
        if t.device != out.device:
            raise ValueError(f"{fn}: tensors[{i}] is on {t.device} but out is on {out.device}")
        k = t.numel()
        cast_(out.view(-1).narrow(0, off, k), t)
        off += k
    return out


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views into flat shaped like each tensor of `like`, in order (no copy)."""
    fn = "unflatten"
    like = list(like)
    total = sum(t.numel() for t in like)
    _check(fn, "flat", flat, None, tuple(_KIND), total, ref="like together")
    flat = flat.view(-1)
    views, off = [], 0
    for t in like:
        views.append(flat.narrow(0, off, t.numel()).view(t.shape))
        off += t.numel()
    return views


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy the consecutive pieces of flat back into tensors (casting to each one's dtype)."""
    fn = "unflatten_into"
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        _check(fn, f"tensors[{i}]", t, flat.device if isinstance(flat, torch.Tensor) else None,
               tuple(_KIND), None, ref="flat")
    for view, t in zip(unflatten(flat, tensors), tensors):
        if t.numel():
            cast_(t, view)
