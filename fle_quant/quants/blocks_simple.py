"""Block decoders of the formats with one scale per small block: Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, Q1_0, Q2_0, IQ4_NL, MXFP4, NVFP4, the ternary TQ1_0
and TQ2_0, and the plain float types.

Each ``decode_<type>(b, y)`` reads one block's bytes ``b`` (uint8, 1-D) and
writes its values to ``y`` (float32, 1-D, exactly one block long) in ggml's
order. Layouts and arithmetic follow ``ggml-common.h`` /
``dequantize_row_*`` in ggml-quants.c.

Loop bounds are derived from ``y.shape[0]`` rather than written as
literals on purpose: numba runs LLVM's loop vectorizer but not its SLP
vectorizer, and a short loop with a literal trip count is fully unrolled
into scalar code before the loop vectorizer sees it. Decoders are inlined
(``inline="always"``) so that a driver's loop over blocks carries no call
or array-view overhead.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .blocks_common import f32_from_bits, fp16_at, fp16_to_f32, u16, u32
from .tables import E8M0_HALF, KVALUES_FP4, KVALUES_IQ4NL, UE4M3_HALF

_F32 = np.float32


@njit(cache=True, inline="always")
def decode_f32(b, y):
    y[0] = f32_from_bits(u32(b, 0))


@njit(cache=True, inline="always")
def decode_f16(b, y):
    y[0] = fp16_at(b, 0)


@njit(cache=True, inline="always")
def decode_bf16(b, y):
    y[0] = f32_from_bits(u16(b, 0) << 16)


@njit(cache=True, inline="always")
def decode_q4_0(b, y):  # d f16 | qs[16]
    d = fp16_at(b, 0)
    h = y.shape[0] >> 1  # 16
    for j in range(h):
        q = b[2 + j]
        y[j] = _F32(np.int32(q & 0xF) - 8) * d
        y[j + h] = _F32(np.int32(q >> 4) - 8) * d


@njit(cache=True, inline="always")
def decode_q4_1(b, y):  # d f16 | m f16 | qs[16]
    d = fp16_at(b, 0)
    m = fp16_at(b, 2)
    h = y.shape[0] >> 1  # 16
    for j in range(h):
        q = b[4 + j]
        y[j] = _F32(q & 0xF) * d + m
        y[j + h] = _F32(q >> 4) * d + m


@njit(cache=True, inline="always")
def decode_q5_0(b, y):  # d f16 | qh u32 | qs[16]
    d = fp16_at(b, 0)
    qh = u32(b, 2)
    h = y.shape[0] >> 1  # 16
    for j in range(h):
        q = np.int64(b[6 + j])
        x0 = ((q & 0xF) | (((qh >> j) << 4) & 0x10)) - 16
        x1 = ((q >> 4) | ((qh >> (j + 12)) & 0x10)) - 16
        y[j] = _F32(x0) * d
        y[j + h] = _F32(x1) * d


@njit(cache=True, inline="always")
def decode_q5_1(b, y):  # d f16 | m f16 | qh u32 | qs[16]
    d = fp16_at(b, 0)
    m = fp16_at(b, 2)
    qh = u32(b, 4)
    h = y.shape[0] >> 1  # 16
    for j in range(h):
        q = np.int64(b[8 + j])
        x0 = (q & 0xF) | (((qh >> j) << 4) & 0x10)
        x1 = (q >> 4) | ((qh >> (j + 12)) & 0x10)
        y[j] = _F32(x0) * d + m
        y[j + h] = _F32(x1) * d + m


@njit(cache=True, inline="always")
def decode_q8_0(b, y):  # d f16 | qs int8[32]
    d = fp16_at(b, 0)
    for j in range(y.shape[0]):
        y[j] = _F32(np.int8(b[2 + j])) * d


@njit(cache=True, inline="always")
def decode_q1_0(b, y):  # d f16 | qs[16], one bit per value: 1 -> +d, 0 -> -d
    d = fp16_at(b, 0)
    nd = -d
    for k in range(16):
        q = b[2 + k]
        for j in range(8):
            y[8 * k + j] = d if (q >> j) & 1 else nd


@njit(cache=True, inline="always")
def decode_q2_0(b, y):  # d f16 | qs[16], two bits per value: q -> (q - 1) * d
    d = fp16_at(b, 0)
    for k in range(16):
        q = np.int32(b[2 + k])
        for j in range(4):
            y[4 * k + j] = _F32(((q >> (2 * j)) & 3) - 1) * d


@njit(cache=True, inline="always")
def decode_iq4_nl(b, y):  # d f16 | qs[16] indices into kvalues_iq4nl
    d = fp16_at(b, 0)
    h = y.shape[0] >> 1  # 16
    for j in range(h):
        q = b[2 + j]
        y[j] = d * KVALUES_IQ4NL[q & 0xF]
        y[j + h] = d * KVALUES_IQ4NL[q >> 4]


@njit(cache=True, inline="always")
def decode_mxfp4(b, y):  # e E8M0 | qs[16] E2M1 indices
    d = E8M0_HALF[b[0]]
    h = y.shape[0] >> 1  # 16
    for j in range(h):
        q = b[1 + j]
        y[j] = KVALUES_FP4[q & 0xF] * d
        y[j + h] = KVALUES_FP4[q >> 4] * d


@njit(cache=True, inline="always")
def decode_nvfp4(b, y):  # d[4] UE4M3, one per 16 values | qs[32] E2M1 indices
    for s in range(4):
        d = UE4M3_HALF[b[s]]
        for j in range(8):
            q = b[4 + 8 * s + j]
            y[16 * s + j] = KVALUES_FP4[q & 0xF] * d
            y[16 * s + j + 8] = KVALUES_FP4[q >> 4] * d


@njit(cache=True, inline="always")
def decode_tq1_0(b, y):  # qs[48] five trits per byte | qh[4] four trits per byte | d f16
    d = fp16_at(b, 52)
    # A byte q holds trits t0..t4 as ceil(q * 3**-5 ...) fixed point; the
    # n-th trit is the top base-3 digit of (q * 3**n mod 256).
    pow3 = (1, 3, 9, 27, 81)
    n32 = y.shape[0] >> 3  # 32
    for n in range(5):
        p = pow3[n]
        for m in range(n32):
            q = (np.int32(b[m]) * p) & 0xFF
            y[32 * n + m] = _F32(((q * 3) >> 8) - 1) * d
    for n in range(5):
        p = pow3[n]
        for m in range(n32 >> 1):
            q = (np.int32(b[32 + m]) * p) & 0xFF
            y[160 + 16 * n + m] = _F32(((q * 3) >> 8) - 1) * d
    for n in range(4):
        p = pow3[n]
        for j in range(4):
            q = (np.int32(b[48 + j]) * p) & 0xFF
            y[240 + 4 * n + j] = _F32(((q * 3) >> 8) - 1) * d


@njit(cache=True, inline="always")
def decode_tq2_0(b, y):  # qs[64] four 2-bit values per byte | d f16
    d = fp16_at(b, 64)
    n32 = y.shape[0] >> 3  # 32
    for h in range(2):
        for sh in range(4):
            for m in range(n32):
                q = (np.int32(b[32 * h + m]) >> (2 * sh)) & 3
                y[128 * h + 32 * sh + m] = _F32(q - 1) * d


# Drivers: one thread-parallel loop over blocks per type. They live next to
# their decoders because numba's on-disk cache only notices edits to the
# file of the cached function itself.


# The plain float types have one value per "block": their drivers work on
# the whole arrays as bit patterns, which vectorizes. (The bit views are
# taken outside the parallel loops: numba 0.68 mis-compiles ``.view`` of a
# reshaped array inside a function that has a prange loop.)
@njit(parallel=True, cache=True)
def _f32_bits(src, dst):  # uint32 -> uint32
    for i in prange(src.shape[0]):
        dst[i] = src[i]


@njit(parallel=True, cache=True)
def _f16_bits(src, dst):  # uint16 -> float32
    for i in prange(src.shape[0]):
        dst[i] = fp16_to_f32(np.int64(src[i]))


@njit(parallel=True, cache=True)
def _bf16_bits(src, dst):  # uint16 -> uint32
    for i in prange(src.shape[0]):
        dst[i] = np.uint32(src[i]) << 16


@njit(cache=True)
def run_f32(blocks, out):
    _f32_bits(blocks.reshape(-1).view(np.uint32), out.reshape(-1).view(np.uint32))


@njit(cache=True)
def run_f16(blocks, out):
    _f16_bits(blocks.reshape(-1).view(np.uint16), out.reshape(-1))


@njit(cache=True)
def run_bf16(blocks, out):
    _bf16_bits(blocks.reshape(-1).view(np.uint16), out.reshape(-1).view(np.uint32))


@njit(parallel=True, cache=True)
def run_q4_0(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_q4_0(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_q4_1(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_q4_1(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_q5_0(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_q5_0(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_q5_1(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_q5_1(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_q8_0(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_q8_0(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_q1_0(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_q1_0(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_q2_0(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_q2_0(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_iq4_nl(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_iq4_nl(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_mxfp4(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_mxfp4(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_nvfp4(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_nvfp4(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_tq1_0(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_tq1_0(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_tq2_0(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_tq2_0(blocks[i], out[i])
