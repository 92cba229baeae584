"""The row code of FLE's CPU kernels for AVX2 and the portable IR: the
types' block decoders and :func:`row_at`, one (type, row) against the int8
activation codes of the tokens routed to it, with the float steps of
:mod:`.reference` (bit-identical to it).

Each weight block is decoded into int8 lanes (a scratch of 256 bytes that
stays in L1) and then multiplied as integers with the int8 activation
codes of every token that routed to the expert, so a block is decoded once
per call however many tokens use it. The decoders avoid per-value table
look-ups: a grid entry of 4 or 8 values is one 32/64-bit load, and its
signs are applied to all eight bytes at once (``(g ^ m) + (m & 0x01..01)``
negates the bytes where the mask ``m`` is 0xFF; no byte carries into the
next because grid values are 1..127). Q4_K and IQ4_XS / IQ4_NL are not
decoded at all: their nibbles are split in vector registers (IQ4's code book
looked up 16 lanes at a time, :func:`.simd.dot_iq4`) and multiplied at
once. The integer dots are LLVM vector IR (:mod:`.simd`).

:mod:`.rows` compiles one row kernel per (instruction set, type) from
:func:`row_at` (the AVX-512 types from :mod:`.simd512` instead), and the
drivers of :mod:`.fle_numba` call those kernels by address.
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from fle_quant.ggml_types import GGMLType
from fle_quant.quants.blocks_common import u16, u32
from fle_quant.quants.tables import IQ2S_GRID, IQ2XS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS

from .simd import (AVX2, blk_q4_k, blk_q5_k, dot8_scaled, dot32_s8, dot_halves, dot_iq2_xs, dot_iq3_s, dot_iq3_xxs,
                   dot_iq4, dot_iq4_xs, dot_iq4_xs_r, dot_q4_k, dot_q6_k, q8_0_x8)
from .simd import f16_at as fp16_at

__all__ = ["CODES", "BLOCK_BYTES", "row_at", "scratch_of", "dot_k"]

_F32 = np.float32

# type codes understood by the kernels
CODES = {GGMLType.IQ2_XS: 0, GGMLType.IQ2_S: 1, GGMLType.IQ3_XXS: 2, GGMLType.IQ3_S: 3, GGMLType.IQ4_XS: 4,
         GGMLType.IQ4_NL: 5, GGMLType.Q2_0: 6, GGMLType.Q4_K: 7, GGMLType.Q5_K: 8, GGMLType.Q6_K: 9,
         GGMLType.Q8_0: 10}
_IQ2_XS, _IQ2_S, _IQ3_XXS, _IQ3_S, _IQ4_XS, _IQ4_NL, _Q2_0, _Q4_K, _Q5_K, _Q6_K, _Q8_0 = range(11)
_FRACTION = np.array([0.125, 0.125, 0.25, 1, 1, 1, 1, 1, 1, 1, 1], np.float32)
_BLOCK_BYTES = np.array([74, 82, 98, 110, 136, 18, 18, 144, 176, 210, 34], np.int64)
_BLOCK_VALUES = np.array([256, 256, 256, 256, 256, 32, 64, 256, 256, 256, 32], np.int64)


def _pack(grid: np.ndarray, dtype) -> np.ndarray:
    """Grid rows of small integers -> one little-endian word of bytes each."""
    g = grid.astype(np.uint8)
    return np.ascontiguousarray(g).view(dtype).reshape(-1).copy()


_G3XXS = _pack(IQ3XXS_GRID, np.uint32)  # 256 x 4 values
_G3S = _pack(IQ3S_GRID, np.uint32)  # 512 x 4
_G2XS = _pack(IQ2XS_GRID, np.uint64)  # 512 x 8
_G2S = _pack(IQ2S_GRID, np.uint64)  # 1024 x 8
# sign byte -> 8 byte masks (0xFF where the bit is set)
_SMASK = np.array([sum(0xFF << (8 * k) for k in range(8) if (s >> k) & 1) for s in range(256)], np.uint64)
_KSIGNS = KSIGNS.astype(np.int64)
_ONES = np.uint64(0x0101010101010101)


@njit(cache=True, inline="always")
def _neg(g, m):
    return (g ^ m) + (m & _ONES)


@njit(cache=True, inline="always")
def _dot8(w8, sc, x, xo):
    # sum over the 8 sub-blocks of a 256-value block: scale * integer dot
    return dot8_scaled(w8, sc, x, xo)


@njit(cache=True, inline="always")
def _dec_iq2_xs(b, o, w64, sc):
    for j in range(8):
        s = np.int32(b[o + 66 + j])
        sc[j] = 2 * (s & 15) + 1
        sc[j + 8] = 2 * (s >> 4) + 1
        for l in range(4):
            q = u16(b, o + 2 + 8 * j + 2 * l)
            w64[4 * j + l] = _neg(_G2XS[q & 511], _SMASK[_KSIGNS[q >> 9]])


@njit(cache=True, inline="always")
def _dec_iq2_s(b, o, w64, sc):
    for j in range(8):
        s = np.int32(b[o + 74 + j])
        sc[j] = 2 * (s & 15) + 1
        sc[j + 8] = 2 * (s >> 4) + 1
        qh = np.int64(b[o + 66 + j])
        for l in range(4):
            g = np.int64(b[o + 2 + 4 * j + l]) | ((qh << (8 - 2 * l)) & 0x300)
            w64[4 * j + l] = _neg(_G2S[g], _SMASK[b[o + 34 + 4 * j + l]])


@njit(cache=True, inline="always")
def _dot_halves(w8, sc, x, xo):
    # IQ2 and Q6_K: the two 16-value halves of each sub-block have their own scale
    return dot_halves(w8, sc, x, xo)


@njit(cache=True, inline="always")
def _dec_iq3_xxs(b, o, w64, sc):
    for j in range(8):
        aux = u32(b, o + 66 + 4 * j)
        sc[j] = 2 * np.int32(aux >> 28) + 1
        for l in range(4):
            m = _SMASK[_KSIGNS[(aux >> (7 * l)) & 127]]
            g = np.uint64(_G3XXS[b[o + 2 + 8 * j + 2 * l]]) | (np.uint64(_G3XXS[b[o + 3 + 8 * j + 2 * l]]) << np.uint64(32))
            w64[4 * j + l] = _neg(g, m)


@njit(cache=True, inline="always")
def _dec_iq3_s(b, o, w64, sc):
    for j in range(8):
        sc[j] = 1 + 2 * ((np.int32(b[o + 106 + j // 2]) >> (4 * (j & 1))) & 15)
        qh = np.int64(b[o + 66 + j])
        for l in range(4):
            g1 = np.int64(b[o + 2 + 8 * j + 2 * l]) | ((qh << (8 - 2 * l)) & 256)
            g2 = np.int64(b[o + 3 + 8 * j + 2 * l]) | ((qh << (7 - 2 * l)) & 256)
            g = np.uint64(_G3S[g1]) | (np.uint64(_G3S[g2]) << np.uint64(32))
            w64[4 * j + l] = _neg(g, _SMASK[b[o + 74 + 4 * j + l]])


@njit(cache=True, inline="always")
def _scales_iq4_xs(b, o, sc):
    sh = u16(b, o + 2)
    for j in range(8):
        sc[j] = np.int32(((np.int64(b[o + 4 + j // 2]) >> (4 * (j & 1))) & 15) | (((sh >> (2 * j)) & 3) << 4)) - 32


@njit(cache=True, inline="always")
def _scales_q4_k(b, o, sc, mn):
    # the 8 (scale, min) pairs of 6 bits in the 12 bytes at o + 4 (as _scale_min_k4, read in place)
    for j in range(4):
        sc[j] = np.int32(b[o + 4 + j] & 63)
        mn[j] = np.int32(b[o + 8 + j] & 63)
        sc[j + 4] = np.int32((b[o + 12 + j] & 0xF) | ((b[o + 4 + j] >> 6) << 4))
        mn[j + 4] = np.int32((b[o + 12 + j] >> 4) | ((b[o + 8 + j] >> 6) << 4))


@njit(cache=True, inline="always")
def _dec_q5_k(b, o, w8, sc, mn):
    _scales_q4_k(b, o, sc, mn)      # the same 6-bit packing
    for c in range(4):
        for l in range(32):
            q = b[o + 48 + 32 * c + l]
            h = b[o + 16 + l] >> np.uint8(2 * c)
            w8[64 * c + l] = np.int8((q & 15) | ((h & 1) << 4))
            w8[64 * c + 32 + l] = np.int8((q >> 4) | ((h & 2) << 3))


@njit(cache=True, inline="always")
def _dec_q6_k(b, o, w8, sc16):
    for h in range(2):
        for k in range(4):
            lo = o + 64 * h + 32 * (k & 1)
            nib = np.uint8(4 * (k >> 1))
            hb = o + 128 + 32 * h
            sh = np.uint8(2 * k)
            for l in range(32):
                q = ((b[lo + l] >> nib) & 15) | (((b[hb + l] >> sh) & 3) << 4)
                w8[128 * h + 32 * k + l] = np.int8(np.int32(q) - 32)
            # 16 values per scale: sub-block 4h + k's halves, in _dot_halves' order
            sc16[4 * h + k] = np.int32(np.int8(b[o + 192 + 8 * h + 2 * k]))
            sc16[4 * h + k + 8] = np.int32(np.int8(b[o + 192 + 8 * h + 2 * k + 1]))


def _decode_block(code, w, o, w64, w8, sc, mn):
    """A 256-value block at w[o:] into the int8 lanes (w64 / w8) and its
    scales (sc) and mins (mn); IQ4_XS and Q4_K: the scales only (their
    nibbles are multiplied in place). ``code`` a constant: only its type's
    decoder is compiled in."""


def _decoder(c):
    if c == _IQ2_XS:
        def dec(code, w, o, w64, w8, sc, mn):
            _dec_iq2_xs(w, o, w64, sc)
    elif c == _IQ2_S:
        def dec(code, w, o, w64, w8, sc, mn):
            _dec_iq2_s(w, o, w64, sc)
    elif c == _IQ3_XXS:
        def dec(code, w, o, w64, w8, sc, mn):
            _dec_iq3_xxs(w, o, w64, sc)
    elif c == _IQ3_S:
        def dec(code, w, o, w64, w8, sc, mn):
            _dec_iq3_s(w, o, w64, sc)
    elif c == _IQ4_XS:
        def dec(code, w, o, w64, w8, sc, mn):
            _scales_iq4_xs(w, o, sc)
    elif c == _Q4_K:
        def dec(code, w, o, w64, w8, sc, mn):
            _scales_q4_k(w, o, sc, mn)
    elif c == _Q5_K:
        def dec(code, w, o, w64, w8, sc, mn):
            _dec_q5_k(w, o, w8, sc, mn)
    else:
        def dec(code, w, o, w64, w8, sc, mn):
            _dec_q6_k(w, o, w8, sc)
    return dec


@overload(_decode_block, inline="always")
def _ov_decode_block(code, w, o, w64, w8, sc, mn):
    if isinstance(code, types.IntegerLiteral):
        return _decoder(code.literal_value)
    return None


@njit(cache=True)
def _blocks_iq3_s(w, base, nb, xq, xd, r):
    xo = r * xq.shape[1]
    a = _F32(0.0)
    for bi in range(nb):
        o = base + 110 * bi
        a = a + (fp16_at(w, o) * xd[r, bi]) * _F32(dot_iq3_s(w, o, _G3S, xq, xo + 256 * bi))
    return a


@njit(cache=True)
def _blocks_iq3_xxs(w, base, nb, xq, xd, r):
    xo = r * xq.shape[1]
    a = _F32(0.0)
    for bi in range(nb):
        o = base + 98 * bi
        a = a + (fp16_at(w, o) * xd[r, bi]) * (_F32(dot_iq3_xxs(w, o, _G3XXS, xq, xo + 256 * bi)) * _F32(0.25))
    return a


@njit(cache=True)
def _blocks_iq2_xs(w, base, nb, xq, xd, r):
    xo = r * xq.shape[1]
    a = _F32(0.0)
    for bi in range(nb):
        o = base + 74 * bi
        a = a + (fp16_at(w, o) * xd[r, bi]) * (_F32(dot_iq2_xs(w, o, _G2XS, xq, xo + 256 * bi)) * _F32(0.125))
    return a


def _row_at_for(code_value):
    """The row function of type code ``code_value`` (a constant in its body, so
    numba drops the other types' branches before it types the code)."""
    def row_at(code_, w, base, nb, xq, xd, xs, arow, nt, acc, w64, w8, sc, mn):
        """acc[k] = the row at byte ``base`` of ``w`` (uint8, nb blocks) times
        activation row arow[k]. The activations are indexed in place (xq, xd, xs
        2-D, offsets into their data) and ``w8`` is w64's bytes: no array view is
        made per row, so no reference count is touched in the loop over rows."""
        code = code_value
        frac = _FRACTION[code]
        nx = xq.shape[1]
        if AVX2 and (code == _Q8_0 or code == _Q4_K or code == _Q5_K or code == _Q6_K):
            # blocks read in vector registers, no scratch: token by token (the row stays in L1), each block's
            # float step in the reference's order onto a register accumulator
            for k in range(nt):
                r = arow[k]
                xo = r * nx
                a = _F32(0.0)
                if code == _Q8_0:
                    bi = 0
                    while bi + 8 <= nb:
                        a = q8_0_x8(w, base + 34 * bi, xq, xo + 32 * bi, xd, r * xd.shape[1] + bi, a)
                        bi += 8
                    for b in range(bi, nb):
                        o = base + 34 * b
                        a = a + (fp16_at(w, o) * xd[r, b]) * _F32(dot32_s8(w, o + 2, xq, xo + 32 * b))
                elif code == _Q4_K:
                    for bi in range(nb):
                        a = a + blk_q4_k(w, base + 144 * bi, xq, xo + 256 * bi, xs, r * xs.shape[1] + 8 * bi, xd[r, bi])
                elif code == _Q5_K:
                    for bi in range(nb):
                        a = a + blk_q5_k(w, base + 176 * bi, xq, xo + 256 * bi, xs, r * xs.shape[1] + 8 * bi, xd[r, bi])
                else:
                    for bi in range(nb):
                        o = base + 210 * bi
                        a = a + (fp16_at(w, o + 208) * xd[r, bi]) * _F32(dot_q6_k(w, o, xq, xo + 256 * bi))
                acc[k] = a
            return
        for k in range(nt):
            acc[k] = _F32(0.0)
        if code == _Q8_0 or code == _IQ4_NL or code == _Q2_0:
            for bi in range(nb):
                if code == _Q8_0:
                    o = base + 34 * bi
                    dw = fp16_at(w, o)
                    nh = 1
                elif code == _IQ4_NL:
                    o = base + 18 * bi
                    dw = fp16_at(w, o)
                    nh = 1
                else:
                    o = base + 18 * bi
                    dw = fp16_at(w, o)
                    for l in range(16):
                        q = w[o + 2 + l]
                        for jj in range(4):
                            w8[4 * l + jj] = np.int8(np.int32((q >> np.uint8(2 * jj)) & 3) - 1)
                    nh = 2
                for k in range(nt):
                    r = arow[k]
                    a = acc[k]
                    for hh in range(nh):
                        ab = nh * bi + hh
                        if code == _IQ4_NL:
                            s = dot_iq4(w, o + 2, xq, r * nx + 32 * ab)
                        elif code == _Q8_0:
                            s = dot32_s8(w, o + 2, xq, r * nx + 32 * ab)      # the codes read in place as int8
                        else:
                            s = dot32_s8(w8, 32 * hh, xq, r * nx + 32 * ab)
                        a = a + (dw * xd[r, ab]) * (_F32(s) * frac)
                    acc[k] = a
            return
        if code == _IQ4_XS and nt == 1:
            # the common case (one token) as one tight loop per type with a register accumulator: the dispatch
            # out of the block loop keeps each loop small enough for LLVM to optimise (2x on this loop; one
            # shared loop with the dispatch inside measured 0.57 of ggml against 0.82 for IQ4_XS)
            r = arow[0]
            xo = r * nx
            a = acc[0]
            if AVX2:
                for bi in range(nb):
                    o = base + 136 * bi
                    s = dot_iq4_xs_r(w, o, xq, xo + 256 * bi)      # the scales unpacked in vector lanes
                    a = a + (fp16_at(w, o) * xd[r, bi]) * (_F32(s) * frac)
            else:
                for bi in range(nb):
                    o = base + 136 * bi
                    _scales_iq4_xs(w, o, sc)
                    s = dot_iq4_xs(w, o, sc, xq, xo + 256 * bi)
                    a = a + (fp16_at(w, o) * xd[r, bi]) * (_F32(s) * frac)
            acc[0] = a
            return
        if code == _Q4_K and nt == 1:
            r = arow[0]
            xo = r * nx
            a = acc[0]
            for bi in range(nb):
                o = base + 144 * bi
                _scales_q4_k(w, o, sc, mn)
                s = dot_q4_k(w, o, sc, xq, xo + 256 * bi)
                v = (fp16_at(w, o) * xd[r, bi]) * (_F32(s) * frac)
                m = np.int32(0)
                for j in range(8):
                    m += mn[j] * xs[r, 8 * bi + j]
                a = a + (v - (fp16_at(w, o + 2) * xd[r, bi]) * _F32(m))
            acc[0] = a
            return
        size = _BLOCK_BYTES[code]
        if AVX2:
            # the grid types, decoded in vector registers by the block sums themselves: one function per type
            # (compiled on its own, not inlined): inside the one large function that holds every type's loop
            # LLVM compiled these loops to 0.7 of their speed alone
            if nt == 1 and code == _IQ3_S:
                acc[0] = _blocks_iq3_s(w, base, nb, xq, xd, arow[0])
                return
            if nt == 1 and code == _IQ3_XXS:
                acc[0] = _blocks_iq3_xxs(w, base, nb, xq, xd, arow[0])
                return
            if nt == 1 and code == _IQ2_XS:
                acc[0] = _blocks_iq2_xs(w, base, nb, xq, xd, arow[0])
                return
        if nt == 1 and not (code == _IQ4_XS or code == _Q4_K):
            # the decoded types with one token: the activation row and the accumulator hoisted out of the loop
            r = arow[0]
            xo = r * nx
            a = acc[0]
            for bi in range(nb):
                o = base + size * bi
                _decode_block(code, w, o, w64, w8, sc, mn)
                if code == _IQ2_XS or code == _IQ2_S or code == _Q6_K:
                    s = _dot_halves(w8, sc, xq, xo + 256 * bi)
                else:
                    s = _dot8(w8, sc, xq, xo + 256 * bi)
                dw = fp16_at(w, o + 208) if code == _Q6_K else fp16_at(w, o)
                v = (dw * xd[r, bi]) * (_F32(s) * frac)
                if code == _Q5_K:
                    m = np.int32(0)
                    for j in range(8):
                        m += mn[j] * xs[r, 8 * bi + j]
                    v = v - (fp16_at(w, o + 2) * xd[r, bi]) * _F32(m)
                a = a + v
            acc[0] = a
            return
        for bi in range(nb):
            o = base + size * bi
            _decode_block(code, w, o, w64, w8, sc, mn)
            if code == _Q6_K:
                dw = fp16_at(w, o + 208)
            else:
                dw = fp16_at(w, o)
            for k in range(nt):
                r = arow[k]
                xo = r * nx + 256 * bi
                if code == _IQ2_XS or code == _IQ2_S or code == _Q6_K:
                    s = _dot_halves(w8, sc, xq, xo)
                elif code == _IQ4_XS:
                    s = dot_iq4_xs(w, o, sc, xq, xo)
                elif code == _Q4_K:
                    s = dot_q4_k(w, o, sc, xq, xo)
                else:
                    s = _dot8(w8, sc, xq, xo)
                dd = dw * xd[r, bi]
                v = dd * (_F32(s) * frac)
                if code == _Q4_K or code == _Q5_K:
                    m = np.int32(0)
                    for j in range(8):
                        m += mn[j] * xs[r, 8 * bi + j]
                    v = v - (fp16_at(w, o + 2) * xd[r, bi]) * _F32(m)
                acc[k] = acc[k] + v
    return row_at


def row_at(code_, w, base, nb, xq, xd, xs, arow, nt, acc, w64, w8, sc, mn):
    """acc[k] = the row at byte ``base`` of ``w`` times activation row
    arow[k], for a constant type ``code_`` (the row kernels of :mod:`.rows`
    call it with their closure's type code; inlined)."""


@overload(row_at, inline="always")
def _ov_row_at(code_, w, base, nb, xq, xd, xs, arow, nt, acc, w64, w8, sc, mn):
    if isinstance(code_, types.IntegerLiteral):
        return _row_at_for(code_.literal_value)
    return None


@njit(cache=True, inline="always")
def scratch_of(nt):
    """One work item's scratch in one allocation: the decoded block (as
    uint64 and as int8), scales, mins, nt accumulators and nt row indices."""
    raw = np.empty(352 + 12 * max(nt, 1), np.uint8)
    w64 = raw[:256].view(np.uint64)
    return (w64, raw[:256].view(np.int8), raw[256:320].view(np.int32), raw[320:352].view(np.int32),
            raw[352 + 8 * nt:352 + 12 * nt].view(np.float32), raw[352:352 + 8 * nt].view(np.int64))


BLOCK_BYTES = _BLOCK_BYTES


@njit(cache=True, inline="always")
def dot_k(code):
    """True when type ``code``'s activations are Q8_K (False: Q8_0)."""
    return not (code == _Q8_0 or code == _IQ4_NL or code == _Q2_0)




@njit(cache=True, inline="always")
def dot_k(code):
    """True when type ``code``'s activations are Q8_K (False: Q8_0)."""
    return not (code == _Q8_0 or code == _IQ4_NL or code == _Q2_0)
