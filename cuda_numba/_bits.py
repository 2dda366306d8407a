"""fp16/bf16 <-> float32 conversions on raw bits, as plain leaf functions (they call only the
two bit-cast intrinsics) that ``numba.njit`` and ``numba.cuda.jit(device=True)`` both compile.
"""

import numpy as np
from numba import types
from numba.extending import intrinsic

KIND_F32 = 0
KIND_F16 = 1
KIND_BF16 = 2


@intrinsic
def f32_as_u32(typingctx, x):
    """Reinterpret a float32 as its uint32 bits (numba has no scalar view)."""
    if not isinstance(x, types.Float):
        return None
    sig = types.uint32(x)

    def codegen(context, builder, signature, args):
        val = context.cast(builder, args[0], x, types.float32)
        return builder.bitcast(val, context.get_value_type(types.uint32))

    return sig, codegen


@intrinsic
def u32_as_f32(typingctx, x):
    """Reinterpret the low 32 bits of an integer as a float32."""
    if not isinstance(x, types.Integer):
        return None
    sig = types.float32(x)

    def codegen(context, builder, signature, args):
        val = context.cast(builder, args[0], x, types.uint32)
        return builder.bitcast(val, context.get_value_type(types.float32))

    return sig, codegen


def bf16_to_f32(h):
    # bf16 is the top half of a float32, so widening is exact and a shift.
    return u32_as_f32(np.int64(h) << 16)


def f16_to_f32(h):
    w = np.int64(h)
    sign = (w & 0x8000) << 16
    body = (w & 0x7FFF) << 13
    if (body & 0x0F800000) == 0x0F800000:
        # inf/NaN: all-ones exponent; a NaN comes out quiet with its payload (as F16C does)
        if (body & 0x007FE000) != 0:
            body = body | 0x00400000
        return u32_as_f32(sign | body | 0x7F800000)
    # Multiplying by 2**112 rebiases the exponent; exact for normals and subnormals alike.
    mag = u32_as_f32(body) * np.float32(5.192296858534828e33)
    return u32_as_f32(sign | np.int64(f32_as_u32(mag)))


def f32_to_bf16(x):
    w = np.int64(f32_as_u32(x))
    if (w & 0x7FFFFFFF) > 0x7F800000:
        # NaN: all ones, which is what torch's CPU cast writes for every NaN
        return np.uint16(0xFFFF)
    # round to nearest, ties to even
    w = w + 0x7FFF + ((w >> 16) & 1)
    return np.uint16((w >> 16) & 0xFFFF)


def f32_to_f16(x):
    # Round-to-nearest-even by float arithmetic (the FP16 library's method): scaling by
    # 2**112 then 2**-110 lets the FPU do the rounding at the half-precision position.
    w = np.int64(f32_as_u32(x))
    shl1 = (w + w) & 0xFFFFFFFF
    sign = w & 0x80000000
    ax = u32_as_f32(w & 0x7FFFFFFF)
    base = (ax * np.float32(5.192296858534828e33)) * np.float32(7.703719777548943e-34)
    bias = shl1 & 0xFF000000
    if bias < 0x71000000:
        bias = 0x71000000
    base = u32_as_f32((bias >> 1) + 0x07800000) + base
    bits = np.int64(f32_as_u32(base))
    exp_bits = (bits >> 13) & 0x00007C00
    mant_bits = bits & 0x00000FFF
    nonsign = exp_bits + mant_bits
    if shl1 > 0xFF000000:
        # NaN: quiet, payload truncated, as F16C's vcvtps2ph and torch on CPU do
        nonsign = 0x7E00 | ((w >> 13) & 0x03FF)
    return np.uint16(((sign >> 16) | nonsign) & 0xFFFF)
