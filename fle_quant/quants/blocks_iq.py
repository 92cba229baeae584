"""Block decoders of the grid-based i-quants (256 values per block):
IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, and IQ4_XS.

Same contract as :mod:`.blocks_simple`. Grid rows and sign rows are float32
tables (:mod:`.tables`), so each group of 8 (or 4) values is one row load,
one multiply by the scale and one multiply by +-1: the same float
operations, in the same order, as ggml's ``db * grid[j] * (sign ? -1 : 1)``.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .blocks_common import fp16_at, fp16_to_f32, u16, u32
from .tables import (IQ1_DELTA, IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID,
                     KSIGNS_ROWS, KVALUES_IQ4NL, SIGN_ROWS)

_F32 = np.float32


@njit(cache=True, inline="always")
def decode_iq2_xxs(b, y):  # d f16 | 8 x (4 grid bytes, u32 of 4x7 sign bits + 4-bit scale)
    d = fp16_at(b, 0)
    for ib in range(8):
        o = 2 + 8 * ib
        aux = u32(b, o + 4)
        db = d * (_F32(0.5) + _F32(aux >> 28)) * _F32(0.25)
        for l in range(4):
            g = b[o + l]
            s = (aux >> (7 * l)) & 127
            for j in range(8):
                y[32 * ib + 8 * l + j] = db * IQ2XXS_GRID[g, j] * KSIGNS_ROWS[s, j]


@njit(cache=True, inline="always")
def decode_iq2_xs(b, y):  # d f16 | qs u16[32] (9-bit grid, 7-bit signs) | scales[8]
    d = fp16_at(b, 0)
    for ib in range(8):
        sc = b[66 + ib]
        db0 = d * (_F32(0.5) + _F32(sc & 0xF)) * _F32(0.25)
        db1 = d * (_F32(0.5) + _F32(sc >> 4)) * _F32(0.25)
        for l in range(4):
            q = u16(b, 2 + 8 * ib + 2 * l)
            g = q & 511
            s = q >> 9
            db = db0 if l < 2 else db1
            for j in range(8):
                y[32 * ib + 8 * l + j] = db * IQ2XS_GRID[g, j] * KSIGNS_ROWS[s, j]


@njit(cache=True, inline="always")
def decode_iq2_s(b, y):  # d f16 | qs[32] | signs[32] | qh[8] | scales[8]
    d = fp16_at(b, 0)
    for ib in range(8):
        sc = b[74 + ib]
        db0 = d * (_F32(0.5) + _F32(sc & 0xF)) * _F32(0.25)
        db1 = d * (_F32(0.5) + _F32(sc >> 4)) * _F32(0.25)
        qh = np.int64(b[66 + ib])
        for l in range(4):
            g = np.int64(b[2 + 4 * ib + l]) | ((qh << (8 - 2 * l)) & 0x300)
            s = b[34 + 4 * ib + l]
            db = db0 if l < 2 else db1
            for j in range(8):
                y[32 * ib + 8 * l + j] = db * IQ2S_GRID[g, j] * SIGN_ROWS[s, j]


@njit(cache=True, inline="always")
def decode_iq3_xxs(b, y):  # d f16 | qs[64] grid bytes | 8 x u32 (4x7 sign bits + 4-bit scale)
    d = fp16_at(b, 0)
    for ib in range(8):
        aux = u32(b, 66 + 4 * ib)
        db = d * (_F32(0.5) + _F32(aux >> 28)) * _F32(0.5)
        for l in range(4):
            s = (aux >> (7 * l)) & 127
            g1 = b[2 + 8 * ib + 2 * l]
            g2 = b[2 + 8 * ib + 2 * l + 1]
            o = 32 * ib + 8 * l
            for j in range(4):
                y[o + j] = db * IQ3XXS_GRID[g1, j] * KSIGNS_ROWS[s, j]
            for j in range(4):
                y[o + 4 + j] = db * IQ3XXS_GRID[g2, j] * KSIGNS_ROWS[s, 4 + j]


@njit(cache=True, inline="always")
def decode_iq3_s(b, y):  # d f16 | qs[64] | qh[8] | signs[32] | scales[4]
    d = fp16_at(b, 0)
    for ib in range(8):
        sc = b[106 + ib // 2]
        db = d * _F32(1 + 2 * np.int32((sc >> (4 * (ib & 1))) & 0xF))
        qh = np.int64(b[66 + ib])
        for l in range(4):
            g1 = np.int64(b[2 + 8 * ib + 2 * l]) | ((qh << (8 - 2 * l)) & 256)
            g2 = np.int64(b[2 + 8 * ib + 2 * l + 1]) | ((qh << (7 - 2 * l)) & 256)
            s = b[74 + 4 * ib + l]
            o = 32 * ib + 8 * l
            for j in range(4):
                y[o + j] = db * IQ3S_GRID[g1, j] * SIGN_ROWS[s, j]
            for j in range(4):
                y[o + 4 + j] = db * IQ3S_GRID[g2, j] * SIGN_ROWS[s, 4 + j]


@njit(cache=True, inline="always")
def decode_iq1_s(b, y):  # d f16 | qs[32] | qh u16[8] (3x3 grid bits, 3-bit scale, delta sign)
    d = fp16_at(b, 0)
    for ib in range(8):
        qh = u16(b, 34 + 2 * ib)
        dl = d * _F32(2 * ((qh >> 12) & 7) + 1)
        delta = -IQ1_DELTA if qh & 0x8000 else IQ1_DELTA
        for l in range(4):
            g = np.int64(b[2 + 4 * ib + l]) | (((qh >> (3 * l)) & 7) << 8)
            for j in range(8):
                y[32 * ib + 8 * l + j] = dl * (IQ1S_GRID[g, j] + delta)


@njit(cache=True, inline="always")
def decode_iq1_m(b, y):  # qs[32] | qh[16] | scales u16[4] (3-bit scales; fp16 d in the top nibbles)
    sc0 = u16(b, 48)
    sc1 = u16(b, 50)
    sc2 = u16(b, 52)
    sc3 = u16(b, 54)
    d = fp16_to_f32((sc0 >> 12) | ((sc1 >> 8) & 0x00F0) | ((sc2 >> 4) & 0x0F00) | (sc3 & 0xF000))
    for ib in range(8):
        sc = u16(b, 48 + 2 * (ib // 2))
        sh = 6 * (ib & 1)
        dl1 = d * _F32(2 * ((sc >> sh) & 7) + 1)
        dl2 = d * _F32(2 * ((sc >> (sh + 3)) & 7) + 1)
        for l in range(4):
            qh = np.int64(b[32 + 2 * ib + l // 2])
            hsh = 4 * (l & 1)  # low nibble of qh for even l, high nibble for odd l
            g = np.int64(b[4 * ib + l]) | (((qh >> hsh) & 7) << 8)
            delta = -IQ1_DELTA if (qh >> hsh) & 8 else IQ1_DELTA
            dl = dl1 if l < 2 else dl2
            for j in range(8):
                y[32 * ib + 8 * l + j] = dl * (IQ1S_GRID[g, j] + delta)


@njit(cache=True, inline="always")
def decode_iq4_xs(b, y):  # d f16 | scales_h u16 | scales_l[4] | qs[128]
    d = fp16_at(b, 0)
    sh = u16(b, 2)
    for ib in range(8):
        ls = ((np.int64(b[4 + ib // 2]) >> (4 * (ib & 1))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4)
        dl = d * _F32(ls - 32)
        for j in range(16):
            q = b[8 + 16 * ib + j]
            y[32 * ib + j] = dl * KVALUES_IQ4NL[q & 0xF]
            y[32 * ib + 16 + j] = dl * KVALUES_IQ4NL[q >> 4]


# Drivers: one thread-parallel loop over blocks per type. They live next to
# their decoders because numba's on-disk cache only notices edits to the
# file of the cached function itself.


@njit(parallel=True, cache=True)
def run_iq2_xxs(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_iq2_xxs(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_iq2_xs(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_iq2_xs(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_iq2_s(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_iq2_s(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_iq3_xxs(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_iq3_xxs(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_iq3_s(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_iq3_s(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_iq1_s(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_iq1_s(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_iq1_m(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_iq1_m(blocks[i], out[i])


@njit(parallel=True, cache=True)
def run_iq4_xs(blocks, out):
    for i in prange(blocks.shape[0]):
        decode_iq4_xs(blocks[i], out[i])
