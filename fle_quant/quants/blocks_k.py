"""Block decoders of the K-quant super-blocks (256 values): Q2_K, Q3_K,
Q4_K, Q5_K, Q6_K.

Same contract as :mod:`.blocks_simple` (including why loop bounds come
from ``y.shape[0]``): ``decode_<type>(b, y)`` reads one block's bytes ``b``
and writes 256 float32 values to ``y``, with ggml's layout
(``ggml-common.h``) and order of float operations.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .blocks_common import fp16_at

_F32 = np.float32


@njit(cache=True, inline="always")
def decode_q2_k(b, y):  # scales[16] | qs[64] | d f16 | dmin f16
    d = fp16_at(b, 80)
    dmin = fp16_at(b, 82)
    n16 = y.shape[0] >> 4  # 16
    for half in range(2):
        for shift4 in range(4):
            for g in range(2):
                sc = b[8 * half + 2 * shift4 + g]
                dl = d * _F32(sc & 0xF)
                ml = dmin * _F32(sc >> 4)
                base = 16 + 32 * half + 16 * g
                out = 128 * half + 32 * shift4 + 16 * g
                for l in range(n16):
                    q = (b[base + l] >> (2 * shift4)) & 3
                    y[out + l] = dl * _F32(q) - ml


@njit(cache=True, inline="always")
def decode_q3_k(b, y):  # hmask[32] | qs[64] | scales[12] (16 x 6 bit) | d f16
    d_all = fp16_at(b, 108)
    n16 = y.shape[0] >> 4  # 16
    for half in range(2):
        for shift4 in range(4):
            for g in range(2):
                isc = 8 * half + 2 * shift4 + g
                lo = (np.int64(b[96 + (isc & 7)]) >> (4 * (isc >> 3))) & 0xF
                hi = (np.int64(b[104 + (isc & 3)]) >> (2 * (isc >> 2))) & 3
                dl = d_all * _F32(np.int32(lo | (hi << 4)) - 32)
                m = 1 << (4 * half + shift4)
                base = 32 + 32 * half + 16 * g
                out = 128 * half + 32 * shift4 + 16 * g
                for l in range(n16):
                    q = np.int32((b[base + l] >> (2 * shift4)) & 3) - np.int32(0 if b[16 * g + l] & m else 4)
                    y[out + l] = dl * _F32(q)


@njit(cache=True, inline="always")
def _scale_min_k4(j, b):
    # 8 pairs of 6-bit (scale, min) packed in the 12 bytes at b[4:16].
    if j < 4:
        return b[4 + j] & 63, b[8 + j] & 63
    sc = (b[8 + j] & 0xF) | ((b[j] >> 6) << 4)
    mn = (b[8 + j] >> 4) | ((b[4 + j] >> 6) << 4)
    return sc, mn


@njit(cache=True, inline="always")
def decode_q4_k(b, y):  # d f16 | dmin f16 | scales[12] | qs[128]
    d = fp16_at(b, 0)
    dmin = fp16_at(b, 2)
    n32 = y.shape[0] >> 3  # 32
    for c in range(4):
        sc, mn = _scale_min_k4(2 * c, b)
        d1 = d * _F32(sc)
        m1 = dmin * _F32(mn)
        sc, mn = _scale_min_k4(2 * c + 1, b)
        d2 = d * _F32(sc)
        m2 = dmin * _F32(mn)
        for l in range(n32):
            q = b[16 + 32 * c + l]
            y[64 * c + l] = d1 * _F32(q & 0xF) - m1
            y[64 * c + 32 + l] = d2 * _F32(q >> 4) - m2


@njit(cache=True, inline="always")
def decode_q5_k(b, y):  # d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
    d = fp16_at(b, 0)
    dmin = fp16_at(b, 2)
    n32 = y.shape[0] >> 3  # 32
    for c in range(4):
        sc, mn = _scale_min_k4(2 * c, b)
        d1 = d * _F32(sc)
        m1 = dmin * _F32(mn)
        sc, mn = _scale_min_k4(2 * c + 1, b)
        d2 = d * _F32(sc)
        m2 = dmin * _F32(mn)
        for l in range(n32):
            ql = np.int32(b[48 + 32 * c + l])
            qh = np.int32(b[16 + l]) >> (2 * c)
            y[64 * c + l] = d1 * _F32((ql & 0xF) | ((qh & 1) << 4)) - m1
            y[64 * c + 32 + l] = d2 * _F32((ql >> 4) | ((qh & 2) << 3)) - m2


@njit(cache=True, inline="always")
def decode_q6_k(b, y):  # ql[128] | qh[64] | scales int8[16] | d f16
    d = fp16_at(b, 208)
    n16 = y.shape[0] >> 4  # 16
    for h in range(2):
        for k in range(4):
            # values 32k .. 32k+31 of this half: low nibbles of ql[0:32] / ql[32:64]
            # for k = 0, 1, high nibbles for k = 2, 3; bits 2k, 2k+1 of qh.
            # Each 16 values have their own int8 scale, used as d * scale.
            lo = 64 * h + 32 * (k & 1)
            nib = 4 * (k >> 1)
            for g in range(2):
                ds = d * _F32(np.int8(b[192 + 8 * h + 2 * k + g]))
                o = 16 * g
                out = 128 * h + 32 * k + o
                for l in range(n16):
                    q = (np.int32((b[lo + o + l] >> nib) & 0xF)
                         | (np.int32((b[128 + 32 * h + o + l] >> (2 * k)) & 3) << 4))
                    y[out + l] = ds * _F32(q - 32)


# Drivers: one thread-parallel loop over blocks per type. They live next to
# their decoders because numba's on-disk cache only notices edits to the
# file of the cached function itself.


@njit(parallel=True, cache=True)
def run_q2_k(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_q2_k(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_q3_k(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_q3_k(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_q4_k(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_q4_k(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_q5_k(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_q5_k(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_q6_k(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_q6_k(blocks[i], out[i])
