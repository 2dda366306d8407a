"""CPU kernels (``@njit(parallel=True)``) over flat 1-D arrays; same names and arguments as
``cuda_numba.cuda``. fp16/bf16 data arrives as uint16 bits with a kind code (0 f32, 1 f16, 2 bf16).
"""

import math
import platform
import types

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, prange
from numba import types as nbtypes
from numba.extending import intrinsic, overload

from . import _bits

# Below this many elements a parallel region costs more than it saves (thread wake-up is a
# few microseconds), so each kernel also has a serial build from the same source.
PARALLEL_MIN = 1024  # measured: below this a parallel launch costs more than the loop
# Reductions work in fixed blocks so each block's partial sum is independent of thread count.
BLOCK = 1 << 14

# numba's disk cache keys a kernel by the content of its own file only, so kernels here would
# keep stale machine code after an edit of _bits.py. Recording _bits.py's hash in this file
# makes such an edit change this file too (tests/cuda_numba/test_kernels_cpu.py checks it is
# current).
BITS_SHA256 = "160a0c364fa0bbc2"

_opts = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")

f32_as_u32 = _bits.f32_as_u32
u32_as_f32 = _bits.u32_as_f32
_f16_to_f32 = njit(**_opts)(_bits.f16_to_f32)
_bf16_to_f32 = njit(**_opts)(_bits.bf16_to_f32)
_f32_to_bf16 = njit(**_opts)(_bits.f32_to_bf16)

_U32 = np.uint32


@njit(inline="always", **_opts)
def _f16_to_f32_select(h):
    """_bits.f16_to_f32 with the inf/NaN case as a select instead of a branch, so loops over
    fp16 data vectorize; bit-identical results (NaN quieted, payload kept)."""
    w = _U32(h)
    sign = (w & _U32(0x8000)) << _U32(16)
    body = (w & _U32(0x7FFF)) << _U32(13)
    mag = f32_as_u32(u32_as_f32(body) * np.float32(5.192296858534828e33))
    special = body | _U32(0x7F800000)
    special = special | (_U32(0x00400000) if (body & _U32(0x007FE000)) != _U32(0) else _U32(0))
    is_special = (body & _U32(0x0F800000)) == _U32(0x0F800000)
    return u32_as_f32(sign | (special if is_special else mag))


@intrinsic
def _f16_to_f32_fpext(typingctx, bits):  # noqa: ARG001 - numba's intrinsic signature
    """fp16 bits widened by LLVM's fpext: exact, NaN quieted with its payload kept, so the same
    bits as _f16_to_f32_select; a vector instruction (x86 F16C's vcvtph2ps, aarch64's fcvtl)
    where the host has one."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return nbtypes.float32(nbtypes.uint16), codegen


def _host_widens_f16() -> bool:
    """Whether LLVM emits the fp16 <-> fp32 conversions as instructions here rather than calls
    into a runtime library numba may not link."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return True
    try:
        return bool(llvm.get_host_cpu_features().get("f16c", False))
    except RuntimeError:  # features unknown to LLVM on this host
        return False


@intrinsic
def _f32_to_f16_fptrunc(typingctx, x):  # noqa: ARG001 - numba's intrinsic signature
    """float32 narrowed to fp16 bits by LLVM's fptrunc: round to nearest even, NaN quieted
    with its payload truncated, so the same bits as _bits.f32_to_f16; a vector instruction
    (x86 F16C's vcvtps2ph, aarch64's fcvtn) where the host has one."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return nbtypes.uint16(nbtypes.float32), codegen


_f32_to_f16_soft = njit(**_opts)(_bits.f32_to_f16)
# chosen once per process: the software conversions are several times slower in a loop
_f16_widen = _f16_to_f32_fpext if _host_widens_f16() else _f16_to_f32_select
_f32_to_f16 = _f32_to_f16_fptrunc if _host_widens_f16() else _f32_to_f16_soft


def _load(arr, i, kind):
    """Element i as float32; arr is float32 or uint16 bits of kind 1 (f16) / 2 (bf16)."""


@overload(_load, jit_options=_opts)
def _load_impl(arr, i, kind):
    # Chosen by the array's dtype at compile time: a float32 array needs no per-element kind
    # test, which keeps the fp32 loops branch-free so LLVM vectorizes them. Kernels that care
    # call it with a constant kind inside a loop per kind, so the test folds away there too.
    if arr.dtype == nbtypes.float32:
        return lambda arr, i, kind: arr[i]

    def bits(arr, i, kind):
        if kind == 1:
            return _f16_widen(arr[i])
        return _bf16_to_f32(arr[i])

    return bits


@njit(**_opts)
def _store(x, kind):
    if kind == 1:
        return _f32_to_f16(x)
    return _f32_to_bf16(x)


@njit(inline="always", **_opts)
def _adam_elem(i, param, grad, grad_kind, exp_avg, exp_avg_sq, b1, omb1, b2, omb2, wd, l2, decay,
               step_size, bc2_sqrt, epsf, inv):
    g = _load(grad, i, grad_kind) * inv
    p = param[i]
    if l2:
        g = g + wd * p
    p = p * decay
    m = b1 * exp_avg[i] + omb1 * g
    v = b2 * exp_avg_sq[i] + omb2 * (g * g)
    exp_avg[i] = m
    exp_avg_sq[i] = v
    p = p - step_size * (m / (np.sqrt(v) / bc2_sqrt + epsf))
    param[i] = p
    return p


def _adam(param, grad, grad_kind, exp_avg, exp_avg_sq, model_out, out_kind, lr, beta1, beta2,
          eps, weight_decay, bias_correction1, bias_correction2, inv_scale, decoupled):
    f32 = np.float32
    # Scalars are rounded to float32 once, as torch does when a Python float meets a float32
    # tensor; the loop body is then pure float32.
    b1 = f32(beta1)
    omb1 = f32(1.0 - beta1)
    b2 = f32(beta2)
    omb2 = f32(1.0 - beta2)
    wd = f32(weight_decay)
    l2 = (not decoupled) and weight_decay != 0.0
    decay = f32(1.0 - lr * weight_decay) if decoupled else f32(1.0)
    step_size = f32(lr / bias_correction1)
    bc2_sqrt = f32(math.sqrt(bias_correction2))
    epsf = f32(eps)
    inv = f32(inv_scale)
    n = param.shape[0]
    # The two loop-invariant switches get a loop each: a branch left inside the loop stops
    # LLVM from vectorizing it.
    if out_kind == 0:
        if l2:
            for i in prange(n):
                _adam_elem(i, param, grad, grad_kind, exp_avg, exp_avg_sq, b1, omb1, b2, omb2,
                           wd, True, decay, step_size, bc2_sqrt, epsf, inv)
        else:
            for i in prange(n):
                _adam_elem(i, param, grad, grad_kind, exp_avg, exp_avg_sq, b1, omb1, b2, omb2,
                           wd, False, decay, step_size, bc2_sqrt, epsf, inv)
    # The mixed-precision case writes the half model copy in the same pass, and may read the
    # engine's reduced half gradients: each (gradient kind, copy kind) pair gets its own loop
    # with both as constants, so neither the widening nor the rounding tests a kind per element.
    elif out_kind == 1:
        if grad_kind == 1:
            for i in prange(n):
                model_out[i] = _f32_to_f16(_adam_elem(
                    i, param, grad, 1, exp_avg, exp_avg_sq, b1, omb1, b2, omb2, wd, l2, decay,
                    step_size, bc2_sqrt, epsf, inv))
        elif grad_kind == 2:
            for i in prange(n):
                model_out[i] = _f32_to_f16(_adam_elem(
                    i, param, grad, 2, exp_avg, exp_avg_sq, b1, omb1, b2, omb2, wd, l2, decay,
                    step_size, bc2_sqrt, epsf, inv))
        else:
            for i in prange(n):
                model_out[i] = _f32_to_f16(_adam_elem(
                    i, param, grad, 0, exp_avg, exp_avg_sq, b1, omb1, b2, omb2, wd, l2, decay,
                    step_size, bc2_sqrt, epsf, inv))
    elif grad_kind == 1:
        for i in prange(n):
            model_out[i] = _f32_to_bf16(_adam_elem(
                i, param, grad, 1, exp_avg, exp_avg_sq, b1, omb1, b2, omb2, wd, l2, decay,
                step_size, bc2_sqrt, epsf, inv))
    elif grad_kind == 2:
        for i in prange(n):
            model_out[i] = _f32_to_bf16(_adam_elem(
                i, param, grad, 2, exp_avg, exp_avg_sq, b1, omb1, b2, omb2, wd, l2, decay,
                step_size, bc2_sqrt, epsf, inv))
    else:
        for i in prange(n):
            model_out[i] = _f32_to_bf16(_adam_elem(
                i, param, grad, 0, exp_avg, exp_avg_sq, b1, omb1, b2, omb2, wd, l2, decay,
                step_size, bc2_sqrt, epsf, inv))


@njit(inline="always", **_opts)
def _lion_elem(i, param, grad, grad_kind, exp_avg, b1, omb1, b2, omb2, decay, lrf, inv):
    one = np.float32(1.0)
    g = _load(grad, i, grad_kind) * inv
    m = exp_avg[i]
    c = b1 * m + omb1 * g
    # torch.sign: +-1, and 0 / NaN pass through (selects, not branches)
    s = one if c > 0 else c
    s = -one if c < 0 else s
    p = param[i] * decay - lrf * s
    param[i] = p
    exp_avg[i] = b2 * m + omb2 * g
    return p


def _lion(param, grad, grad_kind, exp_avg, model_out, out_kind, lr, beta1, beta2, weight_decay,
          inv_scale):
    f32 = np.float32
    b1 = f32(beta1)
    omb1 = f32(1.0 - beta1)
    b2 = f32(beta2)
    omb2 = f32(1.0 - beta2)
    decay = f32(1.0 - lr * weight_decay)
    lrf = f32(lr)
    inv = f32(inv_scale)
    n = param.shape[0]
    # out_kind is loop-invariant: one loop per case keeps the fp32 loop branch-free.
    if out_kind == 0:
        for i in prange(n):
            _lion_elem(i, param, grad, grad_kind, exp_avg, b1, omb1, b2, omb2, decay, lrf, inv)
    else:
        for i in prange(n):
            p = _lion_elem(i, param, grad, grad_kind, exp_avg, b1, omb1, b2, omb2, decay, lrf,
                           inv)
            model_out[i] = _store(p, out_kind)


@njit(inline="always", **_opts)
def _sgd_elem(i, param, grad, grad_kind, momentum_buf, lrf, mom, omd, wd, use_wd, use_mom,
              first_step, nesterov, inv):
    g = _load(grad, i, grad_kind) * inv
    p = param[i]
    if use_wd:
        g = g + wd * p
    if use_mom:
        if first_step:
            buf = g
        else:
            buf = mom * momentum_buf[i] + omd * g
        momentum_buf[i] = buf
        if nesterov:
            g = g + mom * buf
        else:
            g = buf
    p = p - lrf * g
    param[i] = p
    return p


def _sgd(param, grad, grad_kind, momentum_buf, model_out, out_kind, lr, momentum, dampening,
         weight_decay, nesterov, first_step, inv_scale):
    f32 = np.float32
    lrf = f32(lr)
    mom = f32(momentum)
    omd = f32(1.0 - dampening)
    wd = f32(weight_decay)
    use_wd = weight_decay != 0.0
    use_mom = momentum != 0.0
    inv = f32(inv_scale)
    n = param.shape[0]
    # The steady-state cases (no model copy, not the first momentum step) get a loop each with
    # constant switches, as in _adam; the rest share one loop that tests them per element.
    if out_kind == 0 and not (use_mom and first_step):
        if not use_mom:
            if use_wd:
                for i in prange(n):
                    _sgd_elem(i, param, grad, grad_kind, momentum_buf, lrf, mom, omd, wd, True,
                              False, False, False, inv)
            else:
                for i in prange(n):
                    _sgd_elem(i, param, grad, grad_kind, momentum_buf, lrf, mom, omd, wd, False,
                              False, False, False, inv)
        elif nesterov:
            if use_wd:
                for i in prange(n):
                    _sgd_elem(i, param, grad, grad_kind, momentum_buf, lrf, mom, omd, wd, True,
                              True, False, True, inv)
            else:
                for i in prange(n):
                    _sgd_elem(i, param, grad, grad_kind, momentum_buf, lrf, mom, omd, wd, False,
                              True, False, True, inv)
        else:
            if use_wd:
                for i in prange(n):
                    _sgd_elem(i, param, grad, grad_kind, momentum_buf, lrf, mom, omd, wd, True,
                              True, False, False, inv)
            else:
                for i in prange(n):
                    _sgd_elem(i, param, grad, grad_kind, momentum_buf, lrf, mom, omd, wd, False,
                              True, False, False, inv)
    else:
        for i in prange(n):
            p = _sgd_elem(i, param, grad, grad_kind, momentum_buf, lrf, mom, omd, wd, use_wd,
                          use_mom, first_step, nesterov, inv)
            if out_kind != 0:
                model_out[i] = _store(p, out_kind)


@njit(inline="always", **_opts)
def _unscale_block(g, o, inv, kind):
    # Branch-free so it vectorizes: the store is unconditional and the check is an unsigned
    # max of the exponent fields, which reaches 0x7F800000 exactly when some element is inf
    # or NaN (an integer max reduction needs no fastmath to be reordered). g and o are
    # slices: a zero-based index needs no negative-index fix-up, which otherwise turns the
    # loads into gathers.
    acc = _U32(0)
    for j in range(g.shape[0]):
        x = _load(g, j, kind)
        o[j] = x * inv
        acc = max(acc, f32_as_u32(x) & _U32(0x7F800000))
    return acc


@njit(inline="always", **_opts)
def _unscale_block_in_place(g, inv):
    # _unscale_block on one array: with two that are the same memory LLVM's run-time overlap
    # test picks its scalar loop, several times slower.
    # (compiled for the uint16 signature too, where unscale_check never calls it)
    acc = _U32(0)
    for j in range(g.shape[0]):
        x = _load(g, j, 2)
        g[j] = x * inv
        acc = max(acc, f32_as_u32(x) & _U32(0x7F800000))
    return acc


def _unscale_check(grad, grad_kind, out, inv_scale):
    n = grad.shape[0]
    inv = np.float32(inv_scale)
    nb = (n + BLOCK - 1) // BLOCK
    bad = np.zeros(nb, np.uint32)
    # one loop per kind so the fp16/bf16 widening has no per-element kind test; an empty
    # out means "in place" (float32 grads only: see unscale_check)
    if out.shape[0] == 0 and n > 0:
        for b in prange(nb):
            lo = b * BLOCK
            bad[b] = _unscale_block_in_place(grad[lo:min(lo + BLOCK, n)], inv)
    elif grad_kind == 1:
        for b in prange(nb):
            lo = b * BLOCK
            hi = min(lo + BLOCK, n)
            bad[b] = _unscale_block(grad[lo:hi], out[lo:hi], inv, 1)
    else:
        for b in prange(nb):
            lo = b * BLOCK
            hi = min(lo + BLOCK, n)
            bad[b] = _unscale_block(grad[lo:hi], out[lo:hi], inv, 2)
    acc = _U32(0)
    for b in range(nb):
        acc = max(acc, bad[b])
    return acc == _U32(0x7F800000)


# Not inline="always": numba-level inlining would compile it under the caller's (ieee) flags;
# as a callee its float ops keep their own fast-math flags when LLVM inlines it.
@njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "contract"})
def _sumsq_block(g, kind):
    # float32 squares are exact in float64, so only the additions round; reassoc (this
    # function only) lets LLVM keep several vector accumulators. Zero-based slice index: no
    # negative-index fix-up, no gathers.
    a = 0.0
    for j in range(g.shape[0]):
        x = np.float64(_load(g, j, kind))
        a += x * x
    return a


# fp16 elements per float32 partial sum in _sumsq_block_f16: a float32 sum of k non-negative
# terms is within about k * 2**-24 of exact, so the longest partial (k = 256 / the loop's 32
# lanes and accumulators, plus the tree that joins them) stays near 1e-6 relative; longer
# chunks are no faster.
_F16_CHUNK = 256


@njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "contract"})
def _sumsq_chunk_f16(g):
    # An fp16 value has an 11-bit significand and |x| <= 65504, so its float32 square is
    # exact and finite (a subnormal's too): the sum is the only rounding, and float32
    # arithmetic runs twice as many lanes as float64 with no widening to double per element.
    s = np.float32(0.0)
    for j in range(g.shape[0]):
        x = _load(g, j, 1)
        s += x * x
    return s


@njit(cache=True, nogil=True, error_model="numpy")
def _sumsq_block_f16(g):
    a = 0.0
    n = g.shape[0]
    for lo in range(0, n, _F16_CHUNK):
        a += np.float64(_sumsq_chunk_f16(g[lo:min(lo + _F16_CHUNK, n)]))
    return a


def _sum_squares(grad, grad_kind):
    n = grad.shape[0]
    nb = (n + BLOCK - 1) // BLOCK
    partial = np.zeros(nb, np.float64)
    if grad_kind == 1:
        for b in prange(nb):
            lo = b * BLOCK
            partial[b] = _sumsq_block_f16(grad[lo:min(lo + BLOCK, n)])
    else:
        for b in prange(nb):
            lo = b * BLOCK
            partial[b] = _sumsq_block(grad[lo:min(lo + BLOCK, n)], 2)
    total = 0.0
    for b in range(nb):
        total += partial[b]
    return total


def _cast(src, src_kind, dst, dst_kind):
    for i in prange(src.shape[0]):
        if src_kind == dst_kind:
            dst[i] = src[i]  # same kind: a bit copy, NaN payloads included
        elif dst_kind == 0:
            dst[i] = _load(src, i, src_kind)
        else:
            dst[i] = _store(_load(src, i, src_kind), dst_kind)


def _build(fn):
    # numba's on-disk cache is keyed by qualified name and line, not by the parallel flag, so
    # the serial build gets its own name or the two would load each other's machine code.
    serial = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial",
                                fn.__defaults__, fn.__closure__)
    serial.__qualname__ = fn.__qualname__ + "_serial"
    serial.__module__ = fn.__module__
    return njit(parallel=True, **_opts)(fn), njit(parallel=False, **_opts)(serial)


_adam_par, _adam_ser = _build(_adam)
_lion_par, _lion_ser = _build(_lion)
_sgd_par, _sgd_ser = _build(_sgd)
_unscale_par, _unscale_ser = _build(_unscale_check)
_sumsq_par, _sumsq_ser = _build(_sum_squares)
_cast_par, _cast_ser = _build(_cast)

# name -> (parallel dispatcher, serial dispatcher); warm_up and kernel_status walk this.
KERNELS = {
    "adam": (_adam_par, _adam_ser),
    "lion": (_lion_par, _lion_ser),
    "sgd": (_sgd_par, _sgd_ser),
    "unscale_check": (_unscale_par, _unscale_ser),
    "sum_squares": (_sumsq_par, _sumsq_ser),
    "cast": (_cast_par, _cast_ser),
}


def _parallel(n):
    # The serial build does not vectorize (much slower per element than the parallel build
    # run on one thread), so it only wins where launching costs more than the work.
    return n >= PARALLEL_MIN


def adam(param, grad, grad_kind, exp_avg, exp_avg_sq, model_out, out_kind, lr, beta1, beta2,
         eps, weight_decay, bias_correction1, bias_correction2, inv_scale, decoupled):
    k = _adam_par if _parallel(param.shape[0]) else _adam_ser
    k(param, grad, grad_kind, exp_avg, exp_avg_sq, model_out, out_kind, lr, beta1, beta2, eps,
      weight_decay, bias_correction1, bias_correction2, inv_scale, decoupled)


def lion(param, grad, grad_kind, exp_avg, model_out, out_kind, lr, beta1, beta2, weight_decay,
         inv_scale):
    k = _lion_par if _parallel(param.shape[0]) else _lion_ser
    k(param, grad, grad_kind, exp_avg, model_out, out_kind, lr, beta1, beta2, weight_decay,
      inv_scale)


def sgd(param, grad, grad_kind, momentum_buf, model_out, out_kind, lr, momentum, dampening,
        weight_decay, nesterov, first_step, inv_scale):
    k = _sgd_par if _parallel(param.shape[0]) else _sgd_ser
    k(param, grad, grad_kind, momentum_buf, model_out, out_kind, lr, momentum, dampening,
      weight_decay, nesterov, first_step, inv_scale)


_IN_PLACE = np.empty(0, np.float32)


def unscale_check(grad, grad_kind, out, inv_scale):
    if grad_kind == 0 and grad.shape[0] and out.ctypes.data == grad.ctypes.data:
        out = _IN_PLACE
    k = _unscale_par if _parallel(grad.shape[0]) else _unscale_ser
    return bool(k(grad, grad_kind, out, inv_scale))


def sum_squares(grad, grad_kind):
    k = _sumsq_par if _parallel(grad.shape[0]) else _sumsq_ser
    return float(k(grad, grad_kind))


def cast(src, src_kind, dst, dst_kind):
    k = _cast_par if _parallel(src.shape[0]) else _cast_ser
    k(src, src_kind, dst, dst_kind)
