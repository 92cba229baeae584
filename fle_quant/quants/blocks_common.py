"""Scalar helpers shared by the numba block decoders: little-endian reads
from a block's bytes, float bit casts and the exact fp16 -> fp32 conversion.

Arithmetic inside the decoders is float32 throughout and follows ggml's
order of operations, so that results are bit-identical to ggml and gguf-py.
numba never contracts a multiply and an add into an FMA unless fastmath is
on, which it must stay off for that reason.

numba's on-disk cache keys each cached function on its own file only: the
kernels that inline these helpers (and the block decoders) are not
recompiled when this file changes. After editing it, delete the ``*.nbi`` /
``*.nbc`` files in ``fle_quant/quants/__pycache__``.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def f32_from_bits(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as a float32."""
    if not isinstance(bits, types.Integer):
        return None
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        (v,) = args
        if v.type.width != 32:
            v = builder.trunc(v, ir.IntType(32)) if v.type.width > 32 else builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return sig, codegen


@intrinsic
def f32_to_bits(typingctx, value):
    """The bit pattern of a float32, as uint32."""
    if value != types.float32:
        return None
    sig = types.uint32(value)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@njit(cache=True, inline="always")
def u16(b, k):
    """Little-endian uint16 at byte ``k`` of ``b``, as int64."""
    return np.int64(b[k]) | (np.int64(b[k + 1]) << 8)


@njit(cache=True, inline="always")
def u32(b, k):
    """Little-endian uint32 at byte ``k`` of ``b``, as int64."""
    return (np.int64(b[k]) | (np.int64(b[k + 1]) << 8)
            | (np.int64(b[k + 2]) << 16) | (np.int64(b[k + 3]) << 24))


@njit(cache=True)
def fp16_to_f32(h):
    """IEEE half (bits in an int) to float32, exact for every pattern.

    Subnormals, signed zeros and infinities convert exactly; NaNs keep
    their payload as numpy's float16 cast does (ggml's conversion quiets a
    signalling NaN instead, which no decoder output can show because every
    scale is multiplied before it is stored)."""
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        # m * 2**-24 is exact in float32 (m < 2**10).
        return f32_from_bits(sign | np.int64(f32_to_bits(np.float32(m) * np.float32(5.9604644775390625e-08))))
    if e == 31:
        return f32_from_bits(sign | 0x7F800000 | (m << 13))
    return f32_from_bits(sign | ((e + 112) << 23) | (m << 13))


@njit(cache=True, inline="always")
def fp16_at(b, k):
    """The fp16 stored little-endian at byte ``k`` of ``b``, as float32."""
    return fp16_to_f32(u16(b, k))
