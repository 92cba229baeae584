"""Scalar helpers shared by the numba quantizers: the exact float32 -> fp16
and -> bf16 conversions, ggml's ``nearest_int`` and numpy's float -> small
integer casts and ``np_roundf``.

Each helper reproduces one upstream operation bit for bit, including its
behaviour at the edges (ties, subnormals, overflow), because the quantizers
built on them must produce the same bytes as gguf-py and ggml.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .blocks_common import f32_from_bits, f32_to_bits

__all__ = [
    "fp16_bits", "fp16_bits_ggml", "bf16_bits", "nearest_int", "np_cast_i32",
    "np_roundf", "chunk_bounds", "CHUNK", "no_imatrix",
]

# Blocks per parallel work item: large enough that scratch buffers are
# allocated rarely, small enough to balance the threads on a few rows.
CHUNK = 256

_F2_24 = np.float32(16777216.0)  # 2**24: fp16 subnormal unit is 2**-24


@njit(cache=True, error_model="numpy")
def fp16_bits(f):
    """float32 -> IEEE half bits, round to nearest even, as numpy's
    ``astype(np.float16)``: overflow to inf, exact subnormals, and a NaN keeps
    the top ten bits of its payload (0x7C01 if those are all zero)."""
    b = np.int64(f32_to_bits(f))
    sign = (b >> 16) & 0x8000
    a = b & 0x7FFFFFFF
    if a >= 0x7F800000:
        if a == 0x7F800000:
            return sign | 0x7C00
        h = 0x7C00 + ((a & 0x7FFFFF) >> 13)
        if h == 0x7C00:
            h += 1
        return sign | h
    if a >= 0x477FF000:  # >= 65520 rounds to inf
        return sign | 0x7C00
    if a < 0x38800000:  # below 2**-14: half subnormal (or zero)
        # |f| * 2**24 is exact; rint rounds half to even like the hardware.
        v = f32_from_bits(np.int64(a)) * _F2_24
        return sign | np.int64(np.rint(v))
    e = (a >> 23) - 112
    m = a & 0x7FFFFF
    h = (e << 10) | (m >> 13)
    rem = m & 0x1FFF
    if rem > 0x1000 or (rem == 0x1000 and (h & 1) == 1):
        h += 1  # a carry out of the mantissa correctly bumps the exponent
    return sign | h


@njit(cache=True, error_model="numpy")
def fp16_bits_ggml(f):
    """float32 -> half bits as ggml's GGML_FP32_TO_FP16: like numpy's except
    that every NaN becomes the quiet NaN 0x7E00 (with its sign)."""
    b = np.int64(f32_to_bits(f))
    if (b & 0x7FFFFFFF) > 0x7F800000:
        return ((b >> 16) & 0x8000) | 0x7E00
    return fp16_bits(f)


@njit(cache=True, error_model="numpy")
def bf16_bits(f):
    """float32 -> bf16 bits as ggml_compute_fp32_to_bf16 (and gguf-py): NaN
    forced quiet, otherwise round to nearest even."""
    n = np.int64(f32_to_bits(f))
    if (n & 0x7FFFFFFF) > 0x7F800000:
        n = (n & 0xFFFF0000) | 0x400000
    return ((n + (0x7FFF + ((n >> 16) & 1))) >> 16) & 0xFFFF


@njit(cache=True, error_model="numpy")
def nearest_int(v):
    """ggml's nearest_int: round half to even through the 1.5*2**23 trick
    (float32 add, then the mantissa bits)."""
    s = v + np.float32(12582912.0)
    i = np.int64(f32_to_bits(s))
    return (i & 0x007FFFFF) - 0x00400000


@njit(cache=True, error_model="numpy")
def np_cast_i32(v):
    """numpy's float -> integer cast on x86-64 (cvttss2si): truncation, and
    INT32_MIN for NaN and out-of-range values. Callers keep the low byte,
    as numpy's cast to (u)int8 does."""
    if v != v or v >= np.float32(2147483648.0) or v < np.float32(-2147483648.0):
        return np.int64(-2147483648)
    return np.int64(v)


@njit(cache=True, error_model="numpy")
def np_roundf(n):
    """gguf-py's np_roundf (round half away from zero) in float32 steps."""
    a = abs(n)
    floored = np.floor(a)
    b = floored + np.floor(np.float32(2.0) * (a - floored))
    s = np.float32(0.0)
    if n > 0:
        s = np.float32(1.0)
    elif n < 0:
        s = np.float32(-1.0)
    elif n != n:
        s = n
    return s * b


@njit(cache=True, error_model="numpy")
def chunk_bounds(c, n_blocks):
    """Block range [lo, hi) of work item ``c``."""
    lo = c * CHUNK
    hi = min(lo + CHUNK, n_blocks)
    return lo, hi


def no_imatrix() -> np.ndarray:
    """Stand-in importance matrix for kernels that take one always (with a
    flag), so that calls with and without one share a compiled kernel."""
    return np.empty(0, dtype=np.float32)
