"""CUDA versions of the fused optimizer / gradient kernels (``numba.cuda``).

Array-level contract (shared with ``cuda_numba.cpu``): every array is 1-D contiguous, here a
numba device array (``numba.cuda.as_cuda_array(tensor)`` gives one zero-copy). fp16/bf16 data
travels as uint16 bit arrays; ``kind`` codes are 0 = float32, 1 = float16, 2 = bfloat16.
Rounding to fp16/bf16 is round-to-nearest-even and matches torch's CPU ``.to()`` bit for bit,
NaN included (fp16: sign | 0x7E00 | top payload bits; bf16: 0xFFFF, as torch's vectorised CPU
conversion writes). Every public function takes a keyword ``stream`` (a numba stream, default
0), launches ``THREADS``-thread blocks over a grid-stride loop and launches nothing for size 0.

Bit reinterpretation on the device: numba has no scalar bitcast that works both on a GPU and
in the simulator, so ``_f2u``/``_u2f`` are chosen at import time. On a real GPU they are
libdevice's ``__nv_float_as_int``/``__nv_int_as_float`` (one register move each); under
``NUMBA_ENABLE_CUDASIM=1`` the kernels run as Python, and they are numpy scalar ``.view``\\ s.
Everything else (rounding, decoding, NaN rules) is the same integer code on both, so the
simulator exercises exactly the arithmetic the GPU runs.

All optimizer math is float32: the host wrappers turn every scalar into ``np.float32`` before
launch, so no float64 creeps into the kernels (the sum of squares is the one float64 place).
Kernels are compiled with ``cache=True`` (the simulator accepts and ignores it).

This module imports only numba, numpy (and math); it never imports torch.
"""

import math

import numpy as np
from numba import config, cuda

KIND_F32 = 0
KIND_F16 = 1
KIND_BF16 = 2

THREADS = 256
_MAX_BLOCKS_FALLBACK = 1024
_max_blocks = None

_SIM = bool(config.ENABLE_CUDASIM)

# --------------------------------------------------------------------------- bit helpers

if _SIM:

    @cuda.jit(device=True)
    def _f2u(x):
        # float32 -> its bits as a non-negative int64
        return np.int64(np.float32(x).view(np.uint32))

    @cuda.jit(device=True)
    def _u2f(u):
        # low 32 bits of an integer -> float32
        return np.uint32(np.int64(u) & 0xFFFFFFFF).view(np.float32)

else:  # pragma: no cover - needs a GPU
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def _f2u(x):
        return np.int64(libdevice.float_as_int(np.float32(x))) & 0xFFFFFFFF

    @cuda.jit(device=True, inline=True)
    def _u2f(u):
        return libdevice.int_as_float(np.int32(np.int64(u) & 0xFFFFFFFF))


@cuda.jit(device=True, inline=True)
def _f16_to_f32(h):
    w = np.int64(h) & 0xFFFF
    sign = (w & 0x8000) << 16
    e = (w >> 10) & 0x1F
    m = w & 0x3FF
    if e == 0:
        if m == 0:
            return _u2f(sign)
        # subnormal: m * 2**-24, exact in float32
        f = np.float32(m) * np.float32(5.960464477539063e-08)
        if sign != 0:
            f = -f
        return f
    if e == 31:
        if m != 0:
            m = m | 0x200  # NaN comes out quiet, as the hardware conversions do
        return _u2f(sign | 0x7F800000 | (m << 13))
    return _u2f(sign | ((e + 112) << 23) | (m << 13))


@cuda.jit(device=True, inline=True)
def _bf16_to_f32(h):
    return _u2f((np.int64(h) & 0xFFFF) << 16)


@cuda.jit(device=True, inline=True)
def _f32_to_bf16(x):
    w = _f2u(x)
    if (w & 0x7FFFFFFF) > 0x7F800000:
        return np.int64(0xFFFF)  # torch CPU writes all-ones for every NaN
    w = w + 0x7FFF + ((w >> 16) & 1)
    return (w >> 16) & 0xFFFF


@cuda.jit(device=True, inline=True)
def _f32_to_f16(x):
    w = _f2u(x)
    sign = (w >> 16) & 0x8000
    a = w & 0x7FFFFFFF
    if a > 0x7F800000:  # NaN: quiet, keep sign and the top payload bits
        return sign | 0x7E00 | ((a >> 13) & 0x3FF)
    if a >= 0x477FF000:  # >= 65520 rounds to inf (inf included)
        return sign | 0x7C00
    if a >= 0x38800000:  # normal half: rebias and round to nearest even at bit 13
        return sign | (((a - 0x38000000) + 0xFFF + ((a >> 13) & 1)) >> 13)
    e = a >> 23
    if e < 102:  # below 2**-25: rounds to zero
        return sign
    # subnormal half (may round up into the smallest normal, whose encoding follows on)
    mant = (a & 0x7FFFFF) | 0x800000
    s = 126 - e
    q = mant >> s
    r = mant & ((np.int64(1) << s) - 1)
    half = np.int64(1) << (s - 1)
    if r > half or (r == half and (q & 1) == 1):
        q += 1
    return sign | q


@cuda.jit(device=True, inline=True)
def _load(arr, i, kind):
    """Element i of a float32 array (kind 0) or of a uint16 fp16/bf16 bit array, as float32."""
    if kind == 0:
        return np.float32(arr[i])
    if kind == 1:
        return _f16_to_f32(arr[i])
    return _bf16_to_f32(arr[i])


@cuda.jit(device=True, inline=True)
def _store(arr, i, kind, x):
    """Write float32 x to a float32 array (kind 0) or rounded into a uint16 bit array."""
    if kind == 0:
        arr[i] = x
    elif kind == 1:
        arr[i] = _f32_to_f16(x)
    else:
        arr[i] = _f32_to_bf16(x)


@cuda.jit(device=True, inline=True)
def _nonfinite(arr, i, kind):
    """True when element i is inf or NaN, read straight from the bits for fp16/bf16."""
    if kind == 0:
        x = np.float32(arr[i])
        return not (x - x == np.float32(0.0))
    b = np.int64(arr[i]) & 0xFFFF
    if kind == 1:
        return (b & 0x7C00) == 0x7C00
    return (b & 0x7F80) == 0x7F80


# --------------------------------------------------------------------------- kernels


@cuda.jit(cache=True)
def _adam_kernel(param, grad, grad_kind, exp_avg, exp_avg_sq, model_out, out_kind,
                 lr, beta1, w1, beta2, w2, eps, weight_decay, decay, step_size,
                 bc2_sqrt, inv_scale, decoupled, n):
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    one = np.float32(1.0)
    for i in range(start, n, stride):
        p = param[i]
        g = _load(grad, i, grad_kind) * inv_scale
        if decoupled:
            p = p * decay
        elif weight_decay != np.float32(0.0):
            g = g + p * weight_decay
        m = exp_avg[i]
        # torch's lerp_(grad, 1 - beta1): the small-weight form unless the weight is >= 0.5
        if w1 < np.float32(0.5):
            m = m + w1 * (g - m)
        else:
            m = g - (g - m) * (one - w1)
        v = exp_avg_sq[i] * beta2 + w2 * g * g
        denom = math.sqrt(v) / bc2_sqrt + eps
        p = p - step_size * (m / denom)
        exp_avg[i] = m
        exp_avg_sq[i] = v
        param[i] = p
        if out_kind != 0:
            _store(model_out, i, out_kind, p)


@cuda.jit(cache=True)
def _lion_kernel(param, grad, grad_kind, exp_avg, model_out, out_kind,
                 lr, beta1, w1, beta2, w2, decay, inv_scale, n):
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, n, stride):
        p = param[i]
        g = _load(grad, i, grad_kind) * inv_scale
        m = exp_avg[i]
        c = m * beta1 + g * w1
        if c > np.float32(0.0):
            s = np.float32(1.0)
        elif c < np.float32(0.0):
            s = np.float32(-1.0)
        elif c == np.float32(0.0):
            s = np.float32(0.0)
        else:
            s = c  # NaN stays NaN, as torch.sign
        p = p * decay
        p = p - lr * s
        exp_avg[i] = m * beta2 + g * w2
        param[i] = p
        if out_kind != 0:
            _store(model_out, i, out_kind, p)


@cuda.jit(cache=True)
def _sgd_kernel(param, grad, grad_kind, momentum_buf, model_out, out_kind,
                lr, momentum, w_damp, weight_decay, nesterov, first_step, inv_scale, n):
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, n, stride):
        p = param[i]
        g = _load(grad, i, grad_kind) * inv_scale
        if weight_decay != np.float32(0.0):
            g = g + p * weight_decay
        if momentum != np.float32(0.0):
            if first_step:
                b = g
            else:
                b = momentum_buf[i] * momentum + g * w_damp
            momentum_buf[i] = b
            if nesterov:
                g = g + b * momentum
            else:
                g = b
        p = p - g * lr
        param[i] = p
        if out_kind != 0:
            _store(model_out, i, out_kind, p)


@cuda.jit(cache=True)
def _unscale_kernel(grad, grad_kind, out, inv_scale, flag, n):
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    bad = False
    for i in range(start, n, stride):
        if _nonfinite(grad, i, grad_kind):
            bad = True
        out[i] = _load(grad, i, grad_kind) * inv_scale
    if bad:
        flag[0] = 1  # every writer writes the same value: no atomic needed


@cuda.jit(cache=True)
def _sum_squares_kernel(grad, grad_kind, partial, n):
    buf = cuda.shared.array(256, np.float64)  # == THREADS
    tid = cuda.threadIdx.x
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    acc = np.float64(0.0)
    for i in range(start, n, stride):
        x = np.float64(_load(grad, i, grad_kind))
        acc += x * x
    buf[tid] = acc
    cuda.syncthreads()
    step = cuda.blockDim.x // 2
    while step > 0:
        if tid < step:
            buf[tid] += buf[tid + step]
        cuda.syncthreads()
        step //= 2
    if tid == 0:
        partial[cuda.blockIdx.x] = buf[0]


@cuda.jit(cache=True)
def _cast_kernel(src, src_kind, dst, dst_kind, n):
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, n, stride):
        if src_kind == dst_kind:
            dst[i] = src[i]  # same kind: a bit copy (NaN payloads untouched)
        else:
            _store(dst, i, dst_kind, _load(src, i, src_kind))


# --------------------------------------------------------------------------- host side


def _cap():
    """Most blocks a launch uses: 8 per SM (full occupancy at 256 threads), else 1024."""
    global _max_blocks
    if _max_blocks is None:
        cap = _MAX_BLOCKS_FALLBACK
        if not _SIM:
            try:
                cap = 8 * int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
            except Exception:  # pragma: no cover - no context yet / odd driver
                cap = _MAX_BLOCKS_FALLBACK
        _max_blocks = max(1, cap)
    return _max_blocks


def _blocks(n):
    return 0 if n <= 0 else min((n + THREADS - 1) // THREADS, _cap())


def _check(name, arr, n):
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ValueError(f"{name}: expected a 1-D array of {n} elements, got shape {arr.shape}")


def _check_kind(name, arr, kind):
    want = np.float32 if kind == KIND_F32 else np.uint16
    if kind not in (KIND_F32, KIND_F16, KIND_BF16):
        raise ValueError(f"{name}: unknown kind {kind}")
    if np.dtype(arr.dtype) != np.dtype(want):
        raise TypeError(f"{name}: kind {kind} needs dtype {np.dtype(want)}, got {arr.dtype}")


def _check_out(model_out, out_kind, n):
    if out_kind == KIND_F32:
        return
    if out_kind not in (KIND_F16, KIND_BF16):
        raise ValueError(f"model_out: out_kind must be 0, 1 or 2, got {out_kind}")
    _check("model_out", model_out, n)
    _check_kind("model_out", model_out, out_kind)


f32 = np.float32


def adam(param, grad, grad_kind, exp_avg, exp_avg_sq, model_out, out_kind, lr, beta1, beta2,
         eps, weight_decay, bias_correction1, bias_correction2, inv_scale, decoupled,
         stream=0):
    """One fused Adam/AdamW step in place (torch single-tensor semantics, float32 math)."""
    n = param.shape[0]
    for name, a in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check(name, a, n)
    _check_kind("grad", grad, grad_kind)
    _check_out(model_out, out_kind, n)
    b = _blocks(n)
    if b == 0:
        return
    # Scalars as torch forms them: Python-double arithmetic, then one rounding to float32.
    step_size = lr / bias_correction1
    bc2_sqrt = math.sqrt(bias_correction2)
    decay = 1.0 - lr * weight_decay
    _adam_kernel[b, THREADS, stream](
        param, grad, int(grad_kind), exp_avg, exp_avg_sq, model_out, int(out_kind),
        f32(lr), f32(beta1), f32(1.0 - beta1), f32(beta2), f32(1.0 - beta2), f32(eps),
        f32(weight_decay), f32(decay), f32(step_size), f32(bc2_sqrt), f32(inv_scale),
        bool(decoupled), n)


def lion(param, grad, grad_kind, exp_avg, model_out, out_kind, lr, beta1, beta2,
         weight_decay, inv_scale, stream=0):
    """One fused Lion step in place: c = b1*m + (1-b1)*g; p *= 1-lr*wd; p -= lr*sign(c);
    m = b2*m + (1-b2)*g."""
    n = param.shape[0]
    _check("grad", grad, n)
    _check("exp_avg", exp_avg, n)
    _check_kind("grad", grad, grad_kind)
    _check_out(model_out, out_kind, n)
    b = _blocks(n)
    if b == 0:
        return
    _lion_kernel[b, THREADS, stream](
        param, grad, int(grad_kind), exp_avg, model_out, int(out_kind),
        f32(lr), f32(beta1), f32(1.0 - beta1), f32(beta2), f32(1.0 - beta2),
        f32(1.0 - lr * weight_decay), f32(inv_scale), n)


def sgd(param, grad, grad_kind, momentum_buf, model_out, out_kind, lr, momentum, dampening,
        weight_decay, nesterov, first_step, inv_scale, stream=0):
    """One fused SGD step in place (torch.optim.SGD semantics; first step: buf = g).
    momentum_buf is read/written only when momentum != 0 (may be length 0 otherwise)."""
    n = param.shape[0]
    _check("grad", grad, n)
    _check_kind("grad", grad, grad_kind)
    if momentum != 0:
        _check("momentum_buf", momentum_buf, n)
    _check_out(model_out, out_kind, n)
    b = _blocks(n)
    if b == 0:
        return
    _sgd_kernel[b, THREADS, stream](
        param, grad, int(grad_kind), momentum_buf, model_out, int(out_kind),
        f32(lr), f32(momentum), f32(1.0 - dampening), f32(weight_decay), bool(nesterov),
        bool(first_step), f32(inv_scale), n)


def unscale_check(grad, grad_kind, out, inv_scale, flag, stream=0):
    """out (float32) = grad * inv_scale; flag[0] = 1 if any grad element is inf/NaN
    (the caller zeroes flag first; it is never cleared here)."""
    n = grad.shape[0]
    _check("out", out, n)
    _check_kind("grad", grad, grad_kind)
    b = _blocks(n)
    if b == 0:
        return
    _unscale_kernel[b, THREADS, stream](grad, int(grad_kind), out, f32(inv_scale), flag, n)


def sum_squares_blocks(n):
    """Length of the float64 ``partial`` array that sum_squares(grad of n elements) fills."""
    return _blocks(int(n))


def sum_squares(grad, grad_kind, partial, stream=0):
    """partial[b] (float64) = sum of squares of the elements block b visits; the sum of
    ``partial`` is ||grad||^2 (accumulated in float64)."""
    n = grad.shape[0]
    _check_kind("grad", grad, grad_kind)
    b = _blocks(n)
    if partial.shape[0] != b:
        raise ValueError(f"partial: need sum_squares_blocks({n}) = {b} elements, "
                         f"got {partial.shape[0]}")
    if b == 0:
        return
    _sum_squares_kernel[b, THREADS, stream](grad, int(grad_kind), partial, n)


def cast(src, src_kind, dst, dst_kind, stream=0):
    """dst = src converted between float32 / fp16 bits / bf16 bits (RNE, torch's NaN rules)."""
    n = src.shape[0]
    _check("dst", dst, n)
    _check_kind("src", src, src_kind)
    _check_kind("dst", dst, dst_kind)
    b = _blocks(n)
    if b == 0:
        return
    _cast_kernel[b, THREADS, stream](src, int(src_kind), dst, int(dst_kind), n)


__all__ = ["KIND_F32", "KIND_F16", "KIND_BF16", "THREADS", "adam", "lion", "sgd",
           "unscale_check", "sum_squares", "sum_squares_blocks", "cast"]
