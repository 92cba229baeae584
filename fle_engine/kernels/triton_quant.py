"""Triton kernels for products with weights kept in their GGUF block bytes.

One kernel serves every format. A program owns ``BLOCK_N`` output rows and
walks the input dimension one chunk at a time (one 256-value super-block,
or eight 32-value blocks): it loads the chunk's bytes as 16- or 32-bit
words, decodes them in registers into a float32 tile ``[BLOCK_N, A, B, C]``
(one word's values along the last axes; :func:`_value_index` gives each
value's place in the chunk, so the activations are gathered in the same
order) and multiplies the tile with its activation rows. The decoded
values never touch memory; accumulation is float32.

Activation rows per program (``T_PAD``): with one, the products are summed
elementwise across chunks and reduced once; with up to eight, each tile is
decoded once and multiplied with every row, so the weights are read once
for the group. The defaults come from measurements (see
``_ROWS_PER_PROGRAM``); ``Config`` overrides them for tuning
(``bench/kernels.py --tune``).

Each format's decoder follows fle_quant's block decoders
(``fle_quant/quants/blocks_*.py``) operation for operation, so decoded
values are the same floats as ggml's ``to_float``. Lookup tables (the IQ4
code book; the IQ3_S grid, four entries packed per int32) are small device
tensors passed by pointer.

Expert form: the program of row ``r`` loads all expert ids of the call
(up to ``MAX_SCAN``), does nothing if an earlier row has the same expert,
and otherwise computes every row of that expert, ``T_PAD`` at a time. Each
distinct expert's weights are thus read once per group of rows, with
static shapes, no host synchronisation and no extra launches, so a call
can sit inside a CUDA graph (after one eager call has compiled the kernel
and placed the lookup tables on the device).

Importing this module imports triton; set ``TRITON_INTERPRET=1`` before
that import to run the kernels with numpy on CPU tensors.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from fle_quant.ggml_types import BLOCK_GEOMETRY, GGMLType
from fle_quant.quants import tables

from .ptx_decode import IQ4_PROGRAM, Q8_PROGRAM, program_ptx

__all__ = ["SUPPORTED", "Config", "mul_mat", "mul_mat_experts"]

# Rows of activations one program multiplies with a decoded weight tile.
MAX_T_PAD = 8


@triton.jit
def _half(v):
    """The low 16 bits of ``v`` (int32) read as an fp16, as float32."""
    return (v & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _u16(v):
    """An int16 load widened to its unsigned value."""
    return v.to(tl.int32) & 0xFFFF


# The byte-permute decoders (ptx_decode) and whether the kernels use them: on a GPU unless
# FLE_FAST_DECODE=0 (read at each launch; Triton's interpreter cannot run inline assembly).
FAST_DECODE = os.environ.get("TRITON_INTERPRET") != "1" and os.environ.get("FLE_FAST_DECODE", "1") != "0"
_IQ4_ASM = tl.constexpr(program_ptx(IQ4_PROGRAM))
_Q8_ASM = tl.constexpr(program_ptx(Q8_PROGRAM))


@triton.jit
def _iq4_vals(q):
    """Eight float32 code-book values of the nibbles of int32 words ``q``: byte j's low nibble is
    output j, its high nibble output 4 + j."""
    return tl.inline_asm_elementwise(_IQ4_ASM, "=f,=f,=f,=f,=f,=f,=f,=f,r", [q],
                                     dtype=(tl.float32, tl.float32, tl.float32, tl.float32, tl.float32,
                                            tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _q8_vals(h):
    """The two int8 values (low byte first) of 16-bit words ``h`` (in int32), as float32."""
    return tl.inline_asm_elementwise(_Q8_ASM, "=f,=f,r", [h], dtype=(tl.float32, tl.float32), is_pure=True,
                                     pack=1)


@functools.lru_cache(maxsize=None)
def pdl_supported() -> bool:
    """Programmatic dependent launch needs a GPU of compute capability 9.0 or later (never
    Triton's interpreter)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability()[0] >= 9


@triton.jit
def _gdc_wait(ON: tl.constexpr):
    """With ``ON``: wait until the kernel before this one in the stream has finished and its
    writes are visible (programmatic dependent launch: a kernel launched with ``launch_pdl``
    may start while the one before it ends, and must call this before reading what that one
    writes). A no-op otherwise."""
    if ON:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _q8_0_rows_fast(wv, row_w, x_row, n_blocks, N_CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr,
                    U: tl.constexpr = 1, WAIT: tl.constexpr = False):
    """[BLOCK_N] products of Q8_0 rows (halfword offsets ``row_w``) with the activations at
    ``x_row``, through the byte-permute decoder; per block the quants times the activations are
    summed, then scaled once. ``U`` chunks (of eight blocks) per iteration, their loads in flight
    together; ``WAIT``: the first iteration's weights are loaded before :func:`_gdc_wait`, the
    activations after it."""
    a = tl.arange(0, 8)
    b = tl.arange(0, 16)
    u = tl.arange(0, U)
    acc = tl.zeros([BLOCK_N, U, 8, 16], dtype=tl.float32)
    for k0 in range(0, N_CHUNKS, U):
        blk = (k0 + u)[:, None] * 8 + a[None, :]                                         # [U, 8]
        in_row = blk < n_blocks
        bw = row_w[:, None, None] + tl.where(in_row, blk, 0).to(tl.int64)[None, :, :] * 17  # [BN, U, 8]
        d = _half(tl.load(wv + bw).to(tl.int32))
        d = tl.where(in_row[None, :, :], d, 0.0)      # blocks past the row's end count nothing
        h = _u16(tl.load(wv + bw[:, :, :, None] + 1 + b[None, None, None, :]))         # [BN, U, 8, 16]
        if WAIT:
            if k0 == 0:
                _gdc_wait(True)
        v0, v1 = _q8_vals(h)
        k = tl.where(in_row[:, :, None], blk[:, :, None] * 32 + 2 * b[None, None, :], 0)  # [U, 8, 16]
        s = v0 * tl.load(x_row + k)[None, :, :, :] + v1 * tl.load(x_row + k + 1)[None, :, :, :]
        acc += d[:, :, :, None] * s
    return tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)


@triton.jit
def _iq4_xs_rows_fast(wv, row_w, x_base, N_CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr, U: tl.constexpr = 1,
                      WAIT: tl.constexpr = False):
    """[BLOCK_N] products of IQ4_XS rows (word offsets ``row_w``) with the activations at ``x_base``,
     through the byte-permute decoder: per 32-value sub-block
    the code-book values times the activations are summed, then scaled once. ``U`` super-blocks per
    iteration, their loads in flight together (a clamped super-block past the row's end counts
    nothing); ``WAIT``: the first iteration's weights are loaded before :func:`_gdc_wait`, the
    activations after it."""
    a = tl.arange(0, 8)
    b = tl.arange(0, 4)
    u = tl.arange(0, U)
    xo = 32 * a[:, None] + 4 * b[None, :]                      # [8, 4]: value 4 b of sub-block a
    acc = tl.zeros([BLOCK_N, U, 8, 4], dtype=tl.float32)
    for k0 in range(0, N_CHUNKS, U):
        kc = k0 + u
        inb = kc < N_CHUNKS
        kc = tl.where(inb, kc, 0)
        bw = row_w[:, None] + kc[None, :] * 34                  # [BN, U]
        h0 = tl.load(wv + bw)
        h1 = tl.load(wv + bw + 1)
        q = tl.load(wv + bw[:, :, None, None] + 2 + (4 * a)[None, None, :, None] + b[None, None, None, :])
        if WAIT:
            if k0 == 0:
                _gdc_wait(True)
        d = tl.where(inb[None, :], _half(h0), 0.0)
        ls = ((h1[:, :, None] >> (4 * a)[None, None, :]) & 0xF) | (((h0[:, :, None] >> (16 + 2 * a)[None, None, :]) & 3) << 4)
        dl = d[:, :, None] * (ls - 32).to(tl.float32)          # [BN, U, 8]
        v0, v1, v2, v3, v4, v5, v6, v7 = _iq4_vals(q)           # [BN, U, 8, 4]
        xb = x_base + kc[:, None, None] * 256 + xo[None, :, :]  # [U, 8, 4]
        s = v0 * tl.load(xb)[None, :, :, :]
        s += v1 * tl.load(xb + 1)[None, :, :, :]
        s += v2 * tl.load(xb + 2)[None, :, :, :]
        s += v3 * tl.load(xb + 3)[None, :, :, :]
        s += v4 * tl.load(xb + 16)[None, :, :, :]
        s += v5 * tl.load(xb + 17)[None, :, :, :]
        s += v6 * tl.load(xb + 18)[None, :, :, :]
        s += v7 * tl.load(xb + 19)[None, :, :, :]
        acc += dl[:, :, :, None] * s
    return tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)


@triton.jit
def _iq4_xs_rows_fast_multi(wv, row_w, x_ptr, x_rows, cnt, stride_x, N_CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr,
                            TP: tl.constexpr):
    """[TP, BLOCK_N] products of IQ4_XS rows (word offsets ``row_w``) with the first ``cnt`` of the
    activation rows ``x_rows`` [TP] (row indices into ``x_ptr``, ``stride_x`` apart; the other slots
    give zeros), through the byte-permute decoder: each chunk of weights is decoded once for all
    the rows, per 32-value sub-block the code-book values times the activations are summed, then
    scaled once (as :func:`_iq4_xs_rows_fast` row by row)."""
    a = tl.arange(0, 8)
    b = tl.arange(0, 4)
    t = tl.arange(0, TP)
    xo = 32 * a[:, None] + 4 * b[None, :]                      # [8, 4]: value 4 b of sub-block a
    xr = x_ptr + tl.where(t < cnt, x_rows, 0).to(tl.int64)[:, None, None] * stride_x + xo[None, :, :]  # [TP, 8, 4]
    xm = (t < cnt)[:, None, None] & (xo >= 0)[None, :, :]
    acc = tl.zeros([TP, BLOCK_N, 8, 4], dtype=tl.float32)
    for kc in range(0, N_CHUNKS):
        bw = row_w + kc * 34
        h0 = tl.load(wv + bw)
        h1 = tl.load(wv + bw + 1)
        d = _half(h0)
        ls = ((h1[:, None] >> (4 * a)[None, :]) & 0xF) | (((h0[:, None] >> (16 + 2 * a)[None, :]) & 3) << 4)
        dl = d[:, None] * (ls - 32).to(tl.float32)            # [BN, 8]
        q = tl.load(wv + bw[:, None, None] + 2 + (4 * a)[None, :, None] + b[None, None, :])   # [BN, 8, 4]
        v0, v1, v2, v3, v4, v5, v6, v7 = _iq4_vals(q)
        xb = xr + kc * 256
        s = v0[None] * tl.load(xb, mask=xm, other=0.0)[:, None]
        s += v1[None] * tl.load(xb + 1, mask=xm, other=0.0)[:, None]
        s += v2[None] * tl.load(xb + 2, mask=xm, other=0.0)[:, None]
        s += v3[None] * tl.load(xb + 3, mask=xm, other=0.0)[:, None]
        s += v4[None] * tl.load(xb + 16, mask=xm, other=0.0)[:, None]
        s += v5[None] * tl.load(xb + 17, mask=xm, other=0.0)[:, None]
        s += v6[None] * tl.load(xb + 18, mask=xm, other=0.0)[:, None]
        s += v7[None] * tl.load(xb + 19, mask=xm, other=0.0)[:, None]
        acc += dl[None, :, :, None] * s
    return tl.sum(tl.sum(acc, axis=3), axis=2)


@triton.jit
def _decode_q8_0(wv, row_w, kc, n_blocks, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    # block, 17 halfwords: d f16 | qs int8[32]. Tile [BN, A blocks, B = 16 halfwords, C = 2 bytes]:
    # value 32 a + 2 b + c of the chunk
    a = tl.arange(0, A)
    b = tl.arange(0, B)
    c = tl.arange(0, C)
    blk = kc * A + a
    in_row = blk < n_blocks
    bw = row_w[:, None] + tl.where(in_row, blk, 0).to(tl.int64)[None, :] * 17  # [BN, A]
    d = _half(tl.load(wv + bw).to(tl.int32))
    q = _u16(tl.load(wv + bw[:, :, None] + 1 + b[None, None, :]))  # [BN, A, B]
    v = (q[:, :, :, None] >> (8 * c)[None, None, None, :]).to(tl.int8).to(tl.float32)
    w = v * d[:, :, None, None]
    # a block past the row's end must give 0, even where the clamped block holds inf or NaN scales
    return tl.where(in_row[None, :, None, None], w, 0.0)


# the IQ4 code book (tables.KVALUES_IQ4NL) as int8 bytes, four per int32: value i is byte i % 4 of word i // 4.
# Selecting the word and shifting is a few ALU operations per value where a load from a lookup table is a
# gather from memory per value (tests hold these words to the table).
IQ4_WORDS = (-1079142271, -152379953, 639175937, 1901675829)


@triton.jit
def _iq4_value(nib):
    """The IQ4 code book's value for 4-bit indices ``nib`` (int32), as float32."""
    hi = nib >> 2
    w = tl.where(hi >= 2, tl.where(hi == 3, 1901675829, 639175937), tl.where(hi == 1, -152379953, -1079142271))
    return ((w << ((3 - (nib & 3)) * 8)) >> 24).to(tl.float32)       # byte nib % 4, sign-extended


@triton.jit
def _decode_iq4_nl(wv, lut_ptr, row_w, kc, n_blocks, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    # block, 9 halfwords: d f16 | qs[16]; value j = kvalues[qs[j] & 15], 16 + j = kvalues[qs[j] >> 4].
    # Tile [BN, A blocks, B = 8 halfwords, C = 4]: c = 2 * nibble + byte, value 32 a + 16 (c >> 1) + 2 b + (c & 1)
    a = tl.arange(0, A)
    b = tl.arange(0, B)
    c = tl.arange(0, C)
    blk = kc * A + a
    in_row = blk < n_blocks
    bw = row_w[:, None] + tl.where(in_row, blk, 0).to(tl.int64)[None, :] * 9  # [BN, A]
    d = _half(tl.load(wv + bw).to(tl.int32))
    q = _u16(tl.load(wv + bw[:, :, None] + 1 + b[None, None, :]))  # [BN, A, B]
    nib = (q[:, :, :, None] >> (8 * (c & 1) + 4 * (c >> 1))[None, None, None, :]) & 0xF
    w = d[:, :, None, None] * _iq4_value(nib)
    return tl.where(in_row[None, :, None, None], w, 0.0)


@triton.jit
def _decode_iq4_xs(wv, lut_ptr, row_w, kc, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr,
                   LUT: tl.constexpr = False):
    # block, 34 words: d f16 + scales_h u16 | scales_l[4] | qs[128]. 32-value sub-block a has the 6-bit
    # scale (nibble a of scales_l) | (bits 2a, 2a+1 of scales_h) << 4 and the bytes of qs words
    # 4a .. 4a + 3. Tile [BN, A = 8, B = 4 words, C = 8]: byte c & 3 of word b, nibble c >> 2:
    # value 32 a + 16 (c >> 2) + 4 b + (c & 3)
    a = tl.arange(0, A)
    b = tl.arange(0, B)
    c = tl.arange(0, C)
    bw = row_w + kc * 34  # [BN]
    h0 = tl.load(wv + bw)
    h1 = tl.load(wv + bw + 1)
    d = _half(h0)
    ls = ((h1[:, None] >> (4 * a)[None, :]) & 0xF) | (((h0[:, None] >> (16 + 2 * a)[None, :]) & 3) << 4)
    dl = d[:, None] * (ls - 32).to(tl.float32)  # [BN, A]
    q = tl.load(wv + bw[:, None, None] + 2 + (4 * a)[None, :, None] + b[None, None, :])  # [BN, A, B]
    nib = (q[:, :, :, None] >> (8 * (c & 3) + 4 * (c >> 2))[None, None, None, :]) & 0xF
    if LUT:     # the code book read from its table (a load per value; measured for reads over PCIe)
        vals = tl.load(lut_ptr + nib)
    else:
        vals = _iq4_value(nib)
    return dl[:, :, None, None] * vals


@triton.jit
def _grid_signed(db, words, signs, B: tl.constexpr, C: tl.constexpr):
    """The grid types' tile [BN, A, B, C]: byte c of each grid word ``words``
    [BN, A, B] (four grid values per int32), negated where bit 4 b + c of
    ``signs`` [BN, A] is set, times the scales ``db`` [BN, A]."""
    b = tl.arange(0, B)
    c = tl.arange(0, C)
    grid = (words[:, :, :, None] >> (8 * c)[None, None, None, :]) & 0xFF
    neg = (signs[:, :, None, None] >> (4 * b[:, None] + c[None, :])[None, None, :, :]) & 1
    return db[:, :, None, None] * grid.to(tl.float32) * (1 - 2 * neg).to(tl.float32)


@triton.jit
def _decode_iq3_s(wv, lut_ptr, row_w, kc, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    # block, 55 halfwords: d f16 | qs[64] | qh[8] | signs[32] | scales[4]. Value v uses grid row
    # qs[v / 4] | (bit (v / 4) % 8 of qh[v / 32]) << 8, entry v % 4; sign bit v % 8 of signs[v / 8];
    # 4-bit scale (v / 32) % 2 of scales[v / 64]. Tile [BN, A = 32 qs halfwords, B = 2 grid rows,
    # C = 4]: value 8 a + 4 b + c. The lookup table packs each grid row's four values in one int32.
    a = tl.arange(0, A)
    b = tl.arange(0, B)
    bw = row_w + kc * 55  # [BN]
    d = _half(tl.load(wv + bw).to(tl.int32))
    base = bw[:, None]
    qs = _u16(tl.load(wv + base + 1 + a[None, :]))  # [BN, A]
    qh = (_u16(tl.load(wv + base + 33 + (a // 8)[None, :])) >> (8 * ((a // 4) % 2))[None, :]) & 0xFF
    sg = (_u16(tl.load(wv + base + 37 + (a // 2)[None, :])) >> (8 * (a % 2))[None, :]) & 0xFF
    sc = _u16(tl.load(wv + base + 53 + (a // 16)[None, :]))
    scn = (sc >> (8 * ((a // 8) % 2) + 4 * ((a // 4) % 2))[None, :]) & 0xF
    db = d[:, None] * (1 + 2 * scn).to(tl.float32)  # [BN, A]
    quad = (2 * a)[:, None] + b[None, :]  # [A, B]
    row = ((qs[:, :, None] >> (8 * b)[None, None, :]) & 0xFF) | (((qh[:, :, None] >> (quad % 8)[None, :, :]) & 1) << 8)
    return _grid_signed(db, tl.load(lut_ptr + row), sg, B, C)


@triton.jit
def _decode_q6_k(wv, row_w, kc, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    # block, 105 halfwords: ql[128] | qh[64] | scales int8[16] | d f16. With h = v / 128,
    # k = (v / 32) % 4, m = v % 32, value v is nibble k >> 1 of ql[64 h + 32 (k & 1) + m], plus
    # bits 2k, 2k+1 of qh[32 h + m] as bits 4, 5, minus 32, times d * scales[v / 16].
    # Tile [BN, A = 32 (16 h + m / 2), B = 2 (m % 2), C = 4 (k)]: value 128 h + 32 k + m.
    a = tl.arange(0, A)
    b = tl.arange(0, B)
    c = tl.arange(0, C)
    h = a // 16
    mp = a % 16
    bw = row_w + kc * 105  # [BN]
    d = _half(tl.load(wv + bw + 104).to(tl.int32))
    base = bw[:, None, None, None]
    qh = _u16(tl.load(wv + bw[:, None] + 64 + a[None, :]))  # [BN, A]: qh halfword 16 h + m / 2
    qhv = (qh[:, :, None, None] >> (8 * b[:, None] + 2 * c[None, :])[None, None, :, :]) & 3
    ql = _u16(tl.load(wv + base + (32 * h + mp)[None, :, None, None] + (16 * (c & 1))[None, None, None, :]))
    qlv = (ql >> (8 * b[:, None] + 4 * (c >> 1)[None, :])[None, None, :, :]) & 0xF  # [BN, A, B, C]
    sc = _u16(tl.load(wv + base + 96 + (4 * h)[None, :, None, None] + c[None, None, None, :]))  # [BN, A, 1, C]
    scv = (sc >> (8 * (mp // 8))[None, :, None, None]) & 0xFF
    ds = d[:, None, None, None] * scv.to(tl.int8).to(tl.float32)
    return ds * (((qhv << 4) | qlv) - 32).to(tl.float32)


@triton.jit
def _k4_scales(wv, bw, a):
    # (d * scale, dmin * min) [BN, A] of sub-blocks a of the Q4_K / Q5_K blocks at word offsets bw:
    # word 0 holds d and dmin, bytes 4..15 (words 1..3) the 8 pairs of 6 bits, as ggml's
    # get_scale_min_k4
    h0 = tl.load(wv + bw)
    am4 = tl.where(a < 4, 0, a - 4)     # byte a - 4, read for a >= 4 only
    b_a = (tl.load(wv + bw[:, None] + 1 + a[None, :] // 4) >> (8 * (a % 4))[None, :]) & 0xFF          # byte a
    j4 = a + 4
    b_a4 = (tl.load(wv + bw[:, None] + 1 + j4[None, :] // 4) >> (8 * (j4 % 4))[None, :]) & 0xFF       # byte a + 4
    b_am4 = (tl.load(wv + bw[:, None] + 1 + am4[None, :] // 4) >> (8 * (am4 % 4))[None, :]) & 0xFF   # byte a - 4
    lo = (a < 4)[None, :]
    sc = tl.where(lo, b_a & 63, (b_a4 & 0xF) | ((b_am4 >> 6) << 4))
    mn = tl.where(lo, b_a4 & 63, (b_a4 >> 4) | ((b_a >> 6) << 4))
    return _half(h0)[:, None] * sc.to(tl.float32), _half(h0 >> 16)[:, None] * mn.to(tl.float32)


@triton.jit
def _decode_q4_k(wv, row_w, kc, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    # block, 36 words: d f16 + dmin f16 | scales[12] | qs[128]. Sub-block a (32 values) is nibble
    # a % 2 of qs bytes 32 (a // 2) .. + 31. Tile [BN, A = 8, B = 8 words, C = 4 bytes]: value 32 a + 4 b + c
    a = tl.arange(0, A)
    b = tl.arange(0, B)
    c = tl.arange(0, C)
    bw = row_w + kc * 36
    d1, m1 = _k4_scales(wv, bw, a)
    q = tl.load(wv + bw[:, None, None] + 4 + (8 * (a // 2))[None, :, None] + b[None, None, :])  # [BN, A, B]
    nib = (q[:, :, :, None] >> (8 * c[None, None, None, :] + (4 * (a % 2))[None, :, None, None])) & 0xF
    return d1[:, :, None, None] * nib.to(tl.float32) - m1[:, :, None, None]


@triton.jit
def _decode_q5_k(wv, row_w, kc, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    # block, 44 words: d + dmin | scales[12] | qh[32] | qs[128]; value 32 a + l (l = 4 b + c) adds bit a of
    # qh[l] as bit 4. Tile as Q4_K
    a = tl.arange(0, A)
    b = tl.arange(0, B)
    c = tl.arange(0, C)
    bw = row_w + kc * 44
    d1, m1 = _k4_scales(wv, bw, a)
    q = tl.load(wv + bw[:, None, None] + 12 + (8 * (a // 2))[None, :, None] + b[None, None, :])  # [BN, A, B]
    ql = (q[:, :, :, None] >> (8 * c[None, None, None, :] + (4 * (a % 2))[None, :, None, None])) & 0xF
    qh = tl.load(wv + bw[:, None] + 4 + b[None, :])                                            # [BN, B]: qh bytes 4b..4b+3
    hb = (qh[:, None, :, None] >> (8 * c[None, None, None, :] + a[None, :, None, None])) & 1
    return d1[:, :, None, None] * (ql | (hb << 4)).to(tl.float32) - m1[:, :, None, None]


@triton.jit
def _decode_iq3_xxs(wv, lut_ptr, row_w, kc, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    # block, 49 halfwords: d f16 | qs[64] grid indices | 8 x u32 (4 x 7 sign bits + 4-bit scale).
    # Tile [BN, A = 32 (4 ib + l), B = 2 grid rows, C = 4]: value 8 a + 4 b + c. lut: the grid packed
    # four entries per int32 (256), then ksigns (128)
    a = tl.arange(0, A)
    b = tl.arange(0, B)
    bw = row_w + kc * 49
    d = _half(tl.load(wv + bw).to(tl.int32))
    base = bw[:, None]
    qs = _u16(tl.load(wv + base + 1 + a[None, :]))                                   # [BN, A]
    ib = a // 4
    aux = _u16(tl.load(wv + base + 33 + 2 * ib[None, :])).to(tl.int64) | \
        (_u16(tl.load(wv + base + 34 + 2 * ib[None, :])).to(tl.int64) << 16)          # [BN, A]
    db = d[:, None] * (0.5 + (aux >> 28).to(tl.float32)) * 0.5
    s = ((aux >> (7 * (a % 4))[None, :]) & 127).to(tl.int32)
    signs = tl.load(lut_ptr + 256 + s)                                               # [BN, A]
    g = (qs[:, :, None] >> (8 * b)[None, None, :]) & 0xFF                             # [BN, A, B]
    return _grid_signed(db, tl.load(lut_ptr + g), signs, B, C)


@triton.jit
def _decode_iq2_xs(wv, lut_ptr, row_w, kc, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    # block, 37 halfwords: d f16 | qs u16[32] (9-bit grid row, 7-bit ksigns index) | scales[8].
    # Tile [BN, A = 32 (4 ib + l), B = 2, C = 4]: value 8 a + 4 b + c. lut: the grid's 8 entries per row
    # packed in two int32 (1024), then ksigns (128)
    a = tl.arange(0, A)
    b = tl.arange(0, B)
    bw = row_w + kc * 37
    d = _half(tl.load(wv + bw).to(tl.int32))
    base = bw[:, None]
    q = _u16(tl.load(wv + base + 1 + a[None, :]))                                    # [BN, A]
    ib = a // 4
    sc = (_u16(tl.load(wv + base + 33 + (ib // 2)[None, :])) >> (8 * (ib % 2))[None, :]) & 0xFF
    nib = tl.where((a % 4 < 2)[None, :], sc & 0xF, sc >> 4)
    db = d[:, None] * (0.5 + nib.to(tl.float32)) * 0.25
    signs = tl.load(lut_ptr + 1024 + (q >> 9))
    row = 2 * (q & 511)
    return _grid_signed(db, tl.load(lut_ptr + row[:, :, None] + b[None, None, :]), signs, B, C)


@triton.jit
def _decode_iq2_s(wv, lut_ptr, row_w, kc, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    # block, 41 halfwords: d f16 | qs[32] | signs[32] | qh[8] | scales[8]. Grid row of (ib, l) =
    # qs[4 ib + l] | ((qh[ib] << (8 - 2 l)) & 0x300), signs byte signs[4 ib + l].
    # Tile [BN, A = 32 (i = 4 ib + l), B = 2, C = 4]: value 8 a + 4 b + c. lut: 1024 grid rows, two int32 each
    a = tl.arange(0, A)
    b = tl.arange(0, B)
    bw = row_w + kc * 41
    d = _half(tl.load(wv + bw).to(tl.int32))
    base = bw[:, None]
    ib = a // 4
    l = a % 4
    qs = (_u16(tl.load(wv + base + 1 + (a // 2)[None, :])) >> (8 * (a % 2))[None, :]) & 0xFF
    sg = (_u16(tl.load(wv + base + 17 + (a // 2)[None, :])) >> (8 * (a % 2))[None, :]) & 0xFF
    qh = (_u16(tl.load(wv + base + 33 + (ib // 2)[None, :])) >> (8 * (ib % 2))[None, :]) & 0xFF
    sc = (_u16(tl.load(wv + base + 37 + (ib // 2)[None, :])) >> (8 * (ib % 2))[None, :]) & 0xFF
    nib = tl.where((l < 2)[None, :], sc & 0xF, sc >> 4)
    db = d[:, None] * (0.5 + nib.to(tl.float32)) * 0.25
    g = qs | ((qh << (8 - 2 * l)[None, :]) & 0x300)
    return _grid_signed(db, tl.load(lut_ptr + 2 * g[:, :, None] + b[None, None, :]), sg, B, C)


@triton.jit
def _decode_q2_0(wv, row_w, kc, n_blocks, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    # block, 9 halfwords: d f16 | qs[16], two bits per value: q -> (q - 1) d. Tile [BN, A blocks,
    # B = 8 halfwords, C = 8 (2 bytes x 4 values)]: value 64 a + 8 b + c
    a = tl.arange(0, A)
    b = tl.arange(0, B)
    c = tl.arange(0, C)
    blk = kc * A + a
    in_row = blk < n_blocks
    bw = row_w[:, None] + tl.where(in_row, blk, 0).to(tl.int64)[None, :] * 9            # [BN, A]
    d = _half(tl.load(wv + bw).to(tl.int32))
    q = _u16(tl.load(wv + bw[:, :, None] + 1 + b[None, None, :]))                       # [BN, A, B]
    v = ((q[:, :, :, None] >> (2 * c)[None, None, None, :]) & 3) - 1
    w = v.to(tl.float32) * d[:, :, None, None]
    return tl.where(in_row[None, :, None, None], w, 0.0)


@triton.jit
def _value_index(QTYPE: tl.constexpr, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    """[A, B, C]: the position in the chunk of each value of a decoded tile."""
    a = tl.arange(0, A)[:, None, None]
    b = tl.arange(0, B)[None, :, None]
    c = tl.arange(0, C)[None, None, :]
    if QTYPE == 8:
        k = 32 * a + 2 * b + c
    elif QTYPE == 12 or QTYPE == 13:
        k = 32 * a + 4 * b + c
    elif QTYPE == 17 or QTYPE == 18 or QTYPE == 22:
        k = 8 * a + 4 * b + c
    elif QTYPE == 42:
        k = 64 * a + 8 * b + c
    elif QTYPE == 14:
        k = 128 * (a // 16) + 32 * c + 2 * (a % 16) + b
    elif QTYPE == 20:
        k = 32 * a + 16 * (c >> 1) + 2 * b + (c & 1)
    elif QTYPE == 21:
        k = 8 * a + 4 * b + c
    else:
        k = 32 * a + 16 * (c >> 2) + 4 * b + (c & 3)
    return k


@triton.jit
def _decode(QTYPE: tl.constexpr, wv, lut_ptr, row_w, kc, n_blocks, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr,
            LUT: tl.constexpr = False):
    """Chunk ``kc`` of the rows at word offsets ``row_w`` [BN] -> float32 [BN, A, B, C]; ``LUT``: IQ4_XS
    values loaded from the code-book table instead of selected from packed words."""
    if QTYPE == 8:
        w = _decode_q8_0(wv, row_w, kc, n_blocks, A, B, C)
    elif QTYPE == 14:
        w = _decode_q6_k(wv, row_w, kc, A, B, C)
    elif QTYPE == 20:
        w = _decode_iq4_nl(wv, lut_ptr, row_w, kc, n_blocks, A, B, C)
    elif QTYPE == 21:
        w = _decode_iq3_s(wv, lut_ptr, row_w, kc, A, B, C)
    elif QTYPE == 12:
        w = _decode_q4_k(wv, row_w, kc, A, B, C)
    elif QTYPE == 13:
        w = _decode_q5_k(wv, row_w, kc, A, B, C)
    elif QTYPE == 17:
        w = _decode_iq2_xs(wv, lut_ptr, row_w, kc, A, B, C)
    elif QTYPE == 18:
        w = _decode_iq3_xxs(wv, lut_ptr, row_w, kc, A, B, C)
    elif QTYPE == 22:
        w = _decode_iq2_s(wv, lut_ptr, row_w, kc, A, B, C)
    elif QTYPE == 42:
        w = _decode_q2_0(wv, row_w, kc, n_blocks, A, B, C)
    else:
        tl.static_assert(QTYPE == 23)
        w = _decode_iq4_xs(wv, lut_ptr, row_w, kc, A, B, C, LUT)
    return w


@triton.jit
def _chunk_products(acc, QTYPE: tl.constexpr, wv, lut_ptr, row_w, kc, n_blocks, x_ptr, rows, c, last,
                    n_in, stride_x, k_in, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr,
                    T_PAD: tl.constexpr):
    """``acc`` [T_PAD, BN] plus the products of chunk ``kc`` with the activation rows ``rows``
    [T_PAD] (slots c .. last - 1 of the group are real)."""
    w = _decode(QTYPE, wv, lut_ptr, row_w, kc, n_blocks, A, B, C)  # [BN, A, B, C]
    k = kc * (A * B * C) + k_in
    k_mask = k < n_in
    t_idx = tl.arange(0, T_PAD)
    for t in tl.static_range(T_PAD):
        if c + t < last:
            tok = tl.sum(tl.where(t_idx == t, rows, 0), axis=0)
            xt = tl.load(x_ptr + tok.to(tl.int64) * stride_x + k, mask=k_mask, other=0.0)
            yt = tl.sum(tl.sum(tl.sum(w * xt[None, :, :, :], axis=3), axis=2), axis=1)  # [BN]
            acc += tl.where(t_idx[:, None] == t, yt[None, :], 0.0)
    return acc


@triton.jit
def _qmm_kernel(wv, lut_ptr, x_ptr, y_ptr, ids_ptr,
                n_rows, n_out, n_in, n_blocks, row_words, expert_words, n_experts, stride_x, stride_y,
                QTYPE: tl.constexpr, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, N_CHUNKS: tl.constexpr,
                BLOCK_N: tl.constexpr, T_PAD: tl.constexpr, EXPERTS: tl.constexpr, SCAN: tl.constexpr,
                REDUCE_ONCE: tl.constexpr, SKIP_NEGATIVE: tl.constexpr = False, FAST: tl.constexpr = False,
                U: tl.constexpr = 1, GDC: tl.constexpr = False):
    # Program (pid_n, pid_r) computes output rows [pid_n * BLOCK_N, +BLOCK_N) for a set of
    # activation rows, T_PAD at a time: plain, the pid_r-th group of T_PAD rows; experts with
    # SCAN > 0 (a power of two >= n_rows), every row whose expert is that of row pid_r, if pid_r is
    # the first row with that expert (other programs have nothing to do); experts with SCAN == 0,
    # row pid_r alone. GDC (launched with programmatic dependent launch): the one-row fast paths of
    # plain products load their first weights before waiting for the kernel before them, every
    # other path waits first.
    early_wait: tl.constexpr = GDC and not (REDUCE_ONCE and FAST and (QTYPE == 8 or QTYPE == 23) and not EXPERTS)
    _gdc_wait(early_wait)
    pid_n = tl.program_id(0)
    pid_r = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_out
    # rows past n_out read row 0 (always in bounds); their results are not stored
    row_w = tl.where(mask_n, offs_n, 0).to(tl.int64) * row_words
    t_idx = tl.arange(0, T_PAD)
    if EXPERTS:
        e = tl.load(ids_ptr + pid_r)
        # an id out of range reads expert 0 (in bounds) and yields NaN rows
        in_range = (e >= 0) & (e < n_experts)
        row_w += tl.where(in_range, e, 0).to(tl.int64) * expert_words
        if SCAN > 0:
            idx = tl.arange(0, SCAN)
            same = (tl.load(ids_ptr + idx, mask=idx < n_rows, other=0) == e) & (idx < n_rows)
            owner = tl.sum((same & (idx < pid_r)).to(tl.int32), axis=0) == 0
            last = tl.where(owner, tl.sum(same.to(tl.int32), axis=0), 0)
            rank = tl.cumsum(same.to(tl.int32), axis=0) - 1  # [SCAN]: place of each matching row
        else:
            last = 1
        if SKIP_NEGATIVE:
            # a negative id names no expert: the row is left as the caller's output holds it
            last = tl.where(e >= 0, last, 0)
    else:
        last = tl.minimum(T_PAD, n_rows - pid_r * T_PAD)
    k_in = _value_index(QTYPE, A, B, C)
    # A while loop with a data-dependent bound: triton 3.6's interpreter cannot take a tensor
    # as a range() bound under numpy >= 2.4 (triton-lang/triton#9171); while loops it can.
    c = 0
    while c < last:
        if EXPERTS:
            if SCAN > 0:
                pick = same[None, :] & (rank[None, :] == (c + t_idx)[:, None])  # [T_PAD, SCAN]
                rows = tl.sum(tl.where(pick, idx[None, :], 0), axis=1)
            else:
                rows = pid_r + t_idx
        else:
            rows = pid_r * T_PAD + t_idx
        acc = tl.zeros([T_PAD, BLOCK_N], dtype=tl.float32)
        if REDUCE_ONCE:
            # one activation row: sum the products elementwise over the chunks, reduce once
            tl.static_assert(T_PAD == 1)
            tok = tl.sum(rows, axis=0)
            if FAST and QTYPE == 8:
                acc += _q8_0_rows_fast(wv, row_w, x_ptr + tok.to(tl.int64) * stride_x, n_blocks, N_CHUNKS,
                                       BLOCK_N, U, GDC and not early_wait)[None, :]
            elif FAST and QTYPE == 23:
                acc += _iq4_xs_rows_fast(wv, row_w, x_ptr + tok.to(tl.int64) * stride_x, N_CHUNKS, BLOCK_N, U,
                                         GDC and not early_wait)[None, :]
            else:
                acc4 = tl.zeros([BLOCK_N, A, B, C], dtype=tl.float32)
                for kc in range(0, N_CHUNKS):
                    w = _decode(QTYPE, wv, lut_ptr, row_w, kc, n_blocks, A, B, C)
                    k = kc * (A * B * C) + k_in
                    xt = tl.load(x_ptr + tok.to(tl.int64) * stride_x + k, mask=k < n_in, other=0.0)
                    acc4 += w * xt[None, :, :, :]
                acc += tl.sum(tl.sum(tl.sum(acc4, axis=3), axis=2), axis=1)[None, :]
        else:
            for kc in range(0, N_CHUNKS):
                acc = _chunk_products(acc, QTYPE, wv, lut_ptr, row_w, kc, n_blocks, x_ptr, rows, c, last,
                                      n_in, stride_x, k_in, A, B, C, T_PAD)
        if EXPERTS:
            acc = tl.where(in_range, acc, float("nan"))
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_y + offs_n[None, :], acc,
                 mask=((c + t_idx) < last)[:, None] & mask_n[None, :])
        c += T_PAD


def _packed_grid(grid: np.ndarray) -> np.ndarray:
    # each row's four small integers as the bytes of one int32 (entry j in bits 8j .. 8j + 7)
    g = grid.astype(np.uint32)
    return (g[:, 0] | g[:, 1] << 8 | g[:, 2] << 16 | g[:, 3] << 24).view(np.int32)


def _packed_rows(grid: np.ndarray) -> np.ndarray:
    # each 8-entry grid row as two int32 (entries 0..3, then 4..7)
    return _packed_grid(np.asarray(grid).reshape(-1, 4))


@dataclass(frozen=True)
class _Format:
    word: torch.dtype  # the unit the kernel loads: int32 where every field is 4-byte aligned
    tile: tuple[int, int, int]  # decoded tile [BLOCK_N, *tile] per chunk
    blocks_per_chunk: int
    lut: "np.ndarray | None"


_FORMATS: dict[GGMLType, _Format] = {
    GGMLType.Q8_0: _Format(torch.int16, (8, 16, 2), 8, None),
    GGMLType.IQ4_XS: _Format(torch.int32, (8, 4, 8), 1, tables.KVALUES_IQ4NL),
    GGMLType.IQ3_S: _Format(torch.int16, (32, 2, 4), 1, _packed_grid(tables.IQ3S_GRID)),
    GGMLType.IQ4_NL: _Format(torch.int16, (8, 8, 4), 8, tables.KVALUES_IQ4NL),
    GGMLType.Q6_K: _Format(torch.int16, (32, 2, 4), 1, None),
    GGMLType.Q4_K: _Format(torch.int32, (8, 8, 4), 1, None),
    GGMLType.Q5_K: _Format(torch.int32, (8, 8, 4), 1, None),
    GGMLType.IQ3_XXS: _Format(torch.int16, (32, 2, 4), 1,
                              np.concatenate([_packed_grid(tables.IQ3XXS_GRID), tables.KSIGNS.astype(np.int32)])),
    GGMLType.IQ2_XS: _Format(torch.int16, (32, 2, 4), 1,
                             np.concatenate([_packed_rows(tables.IQ2XS_GRID), tables.KSIGNS.astype(np.int32)])),
    GGMLType.IQ2_S: _Format(torch.int16, (32, 2, 4), 1, _packed_rows(tables.IQ2S_GRID)),
    GGMLType.Q2_0: _Format(torch.int16, (4, 8, 8), 4, None),
}
SUPPORTED = frozenset(_FORMATS)


@dataclass(frozen=True)
class Config:
    """Launch parameters: output rows per program, warps per program, and
    activation rows per program (``t_pad``; None: as many as the call has,
    up to eight). With one activation row per program, the products are
    summed elementwise and reduced once at the end (cheaper than reducing
    every chunk); with more, each weight tile is decoded once for all."""
    block_n: int = 16
    num_warps: int = 4
    t_pad: "int | None" = None
    chunks: int = 1         # chunks per loop iteration of the one-row fast paths (Q8_0, IQ4_XS)
    pdl: bool = False       # programmatic dependent launch (sm_90+): may start before the kernel before it ends


# Measured on an H200 (bench/kernels.py --tune): Q8_0's decoded tile is cheap but its
# per-chunk reductions are not, so one activation row per program (the weights read again
# for each row, mostly from L2) beat groups of rows by 1.3-1.5x at T = 4; IQ4_XS gained from
# groups (56 against 75 us for 10 experts of 512 x 2560 at T = 4).
_ROWS_PER_PROGRAM: dict[GGMLType, "int | None"] = {GGMLType.Q8_0: 1}

# Expert rows that one program scans for those sharing its expert; calls with more rows give
# each row its own program (the weights of an expert are then read once per row).
MAX_SCAN = 1024

_luts: dict[tuple[GGMLType, torch.device], Tensor] = {}


def _lut(qtype: GGMLType, fmt: _Format, like: Tensor) -> Tensor:
    if fmt.lut is None:
        return like  # never read
    key = (qtype, like.device)
    t = _luts.get(key)
    if t is None:
        t = torch.tensor(np.asarray(fmt.lut).reshape(-1), device=like.device)
        _luts[key] = t
    return t


def _words(w: Tensor, word: torch.dtype) -> Tensor:
    size = torch.empty(0, dtype=word).element_size()
    if w.data_ptr() % size:
        w = w.clone()  # torch allocations are aligned; a view into a mapped file may not be
    return w.view(word)


def _launch(w: Tensor, qtype: GGMLType, x: Tensor, y: Tensor, ids: "Tensor | None", config: "Config | None",
            skip_negative: bool = False) -> None:
    fmt = _FORMATS[qtype]
    values, size = BLOCK_GEOMETRY[qtype]
    n_out, row_bytes = w.shape[-2], w.shape[-1]
    n_rows = x.shape[0]
    n_blocks = row_bytes // size
    cfg = config or Config(t_pad=_ROWS_PER_PROGRAM.get(qtype))
    t_pad = cfg.t_pad or min(MAX_T_PAD, triton.next_power_of_2(n_rows))
    if ids is None:
        grid_r, scan = triton.cdiv(n_rows, t_pad), 0
    else:
        scan = triton.next_power_of_2(n_rows) if n_rows <= MAX_SCAN else 0
        grid_r = n_rows
        if scan == 0:
            t_pad = 1
    wv = _words(w, fmt.word)
    word = wv.element_size()
    a, b, c = fmt.tile
    pdl = cfg.pdl and x.is_cuda and pdl_supported()
    _qmm_kernel[(triton.cdiv(n_out, cfg.block_n), grid_r)](
        wv, _lut(qtype, fmt, w), x, y, y if ids is None else ids,
        n_rows, n_out, row_bytes // size * values, n_blocks, row_bytes // word, n_out * row_bytes // word,
        w.shape[0] if ids is not None else 1, x.stride(0), y.stride(0),
        QTYPE=int(qtype), A=a, B=b, C=c, N_CHUNKS=triton.cdiv(n_blocks, fmt.blocks_per_chunk),
        BLOCK_N=cfg.block_n, T_PAD=t_pad, EXPERTS=ids is not None, SCAN=scan, REDUCE_ONCE=t_pad == 1,
        SKIP_NEGATIVE=skip_negative, FAST=FAST_DECODE, U=cfg.chunks, GDC=pdl, num_warps=cfg.num_warps,
        **({"launch_pdl": True} if pdl else {}))


def mul_mat(w: Tensor, qtype: GGMLType, x: Tensor, config: "Config | None" = None,
            out: "Tensor | None" = None) -> Tensor:
    """``x @ dequantize(w).T`` for checked inputs (see :func:`fle_engine.kernels.mul_mat`):
    w uint8 ``[n_out, row_bytes]`` contiguous, x float32 ``[T, n_in]`` contiguous; ``out``
    (float32 ``[T, n_out]`` with unit column stride) is written in place when given."""
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device) if out is None else out
    if y.numel():
        _launch(w, qtype, x, y, None, config)
    return y


def mul_mat_experts(w: Tensor, qtype: GGMLType, x: Tensor, expert_ids: Tensor,
                    config: "Config | None" = None, out: "Tensor | None" = None) -> Tensor:
    """Row ``t`` is ``x[t] @ dequantize(w[expert_ids[t]]).T`` for checked inputs: w uint8
    ``[E, n_out, row_bytes]`` contiguous, x float32 ``[T, n_in]`` contiguous, expert_ids int64
    ``[T]``. Rows whose id is outside ``[0, E)`` come out NaN; with ``out`` (float32
    ``[T, n_out]``, written in place), rows with a negative id are skipped instead."""
    y = torch.empty(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device) if out is None else out
    if y.numel():
        _launch(w, qtype, x, y, expert_ids, config, skip_negative=out is not None)
    return y
