"""Quantizers of the formats gguf-py quantizes (F32, F16, BF16, Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, TQ1_0, TQ2_0, MXFP4), bit-identical to
``gguf.quants.quantize`` but compiled and parallel.

gguf-py's numpy code defines the answer here: float32 arithmetic in its
order of operations, ``np_roundf`` (half away from zero), numpy's fp16 cast
for scales and numpy's float -> uint8 cast (on x86-64) for the codes. None of
these formats uses an importance matrix; the quantizers accept and ignore one.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .blocks_common import f32_from_bits, f32_to_bits
from .quant_util import CHUNK, bf16_bits, chunk_bounds, fp16_bits, np_cast_i32, np_roundf
from .tables import KVALUES_FP4

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)


@njit(cache=True, error_model="numpy")
def _put16(out, k, h):
    out[k] = h & 0xFF
    out[k + 1] = (h >> 8) & 0xFF


@njit(cache=True, error_model="numpy")
def _inv(d):
    # gguf-py: id = np.where(d == 0, 0, 1 / d)
    if d == _F0:
        return _F0
    return _F1 / d


@njit(cache=True, error_model="numpy")
def _signed_absmax(x):
    # abs(blocks).argmax(): the first element of largest magnitude, signed.
    imax = 0
    amax = abs(x[0])
    for j in range(1, x.shape[0]):
        a = abs(x[j])
        if a > amax or (a != a and amax == amax):
            amax = a
            imax = j
            if a != a:
                break
    return x[imax]


@njit(cache=True, error_model="numpy")
def _absmax(x):
    # abs(blocks).max(): NaN propagates.
    m = abs(x[0])
    for j in range(1, x.shape[0]):
        a = abs(x[j])
        if a > m or a != a:
            m = a
            if a != a:
                break
    return m


@njit(cache=True, error_model="numpy")
def _min_max(x):
    lo = x[0]
    hi = x[0]
    for j in range(1, x.shape[0]):
        v = x[j]
        if v < lo or v != v:
            lo = v
        if v > hi or v != v:
            hi = v
    return lo, hi


@njit(cache=True, error_model="numpy")
def _blk_q4_0(x, out):
    d = _signed_absmax(x) / np.float32(-8.0)
    idv = _inv(d)
    _put16(out, 0, fp16_bits(d))
    for j in range(16):
        q0 = min(max(np_cast_i32(np.trunc(x[j] * idv + np.float32(8.5))) & 0xFF, 0), 15)
        q1 = min(max(np_cast_i32(np.trunc(x[j + 16] * idv + np.float32(8.5))) & 0xFF, 0), 15)
        out[2 + j] = q0 | (q1 << 4)


@njit(cache=True, error_model="numpy")
def _blk_q4_1(x, out):
    lo, hi = _min_max(x)
    d = (hi - lo) / np.float32(15.0)
    idv = _inv(d)
    _put16(out, 0, fp16_bits(d))
    _put16(out, 2, fp16_bits(lo))
    for j in range(16):
        q0 = min(np_cast_i32(np.trunc((x[j] - lo) * idv + np.float32(0.5))) & 0xFF, 15)
        q1 = min(np_cast_i32(np.trunc((x[j + 16] - lo) * idv + np.float32(0.5))) & 0xFF, 15)
        out[4 + j] = q0 | (q1 << 4)


@njit(cache=True, error_model="numpy")
def _blk_q5_0(x, out):
    d = _signed_absmax(x) / np.float32(-16.0)
    idv = _inv(d)
    _put16(out, 0, fp16_bits(d))
    qh = np.int64(0)
    for j in range(16):
        q0 = min(np_cast_i32(np.trunc(x[j] * idv + np.float32(16.5))) & 0xFF, 31)
        q1 = min(np_cast_i32(np.trunc(x[j + 16] * idv + np.float32(16.5))) & 0xFF, 31)
        out[6 + j] = (q0 & 0x0F) | ((q1 << 4) & 0xFF)
        qh |= ((q0 >> 4) & 1) << j
        qh |= ((q1 >> 4) & 1) << (j + 16)
    for k in range(4):
        out[2 + k] = (qh >> (8 * k)) & 0xFF


@njit(cache=True, error_model="numpy")
def _blk_q5_1(x, out):
    lo, hi = _min_max(x)
    d = (hi - lo) / np.float32(31.0)
    idv = _inv(d)
    _put16(out, 0, fp16_bits(d))
    _put16(out, 2, fp16_bits(lo))
    qh = np.int64(0)
    for j in range(16):
        q0 = min(np_cast_i32(np.trunc((x[j] - lo) * idv + np.float32(0.5))) & 0xFF, 31)
        q1 = min(np_cast_i32(np.trunc((x[j + 16] - lo) * idv + np.float32(0.5))) & 0xFF, 31)
        out[8 + j] = (q0 & 0x0F) | ((q1 << 4) & 0xFF)
        qh |= ((q0 >> 4) & 1) << j
        qh |= ((q1 >> 4) & 1) << (j + 16)
    for k in range(4):
        out[4 + k] = (qh >> (8 * k)) & 0xFF


@njit(cache=True, error_model="numpy")
def _blk_q8_0(x, out):
    d = _absmax(x) / np.float32(127.0)
    idv = _inv(d)
    _put16(out, 0, fp16_bits(d))
    for j in range(32):
        out[2 + j] = np_cast_i32(np_roundf(x[j] * idv)) & 0xFF


@njit(cache=True, error_model="numpy")
def _ternary(x, idv, j):
    # np_roundf(x * id) as int8, plus one: 0, 1 or 2 for sane input
    return ((np_cast_i32(np_roundf(x[j] * idv)) + 1) & 0xFF)


@njit(cache=True, error_model="numpy")
def _blk_tq1_0(x, out):
    d = _absmax(x)
    idv = _inv(d)
    # 5 trits per byte, most significant first: bytes 0..31 from values
    # 0..159, bytes 32..47 from 160..239, bytes 48..51 (4 trits) from 240..255.
    for j in range(32):
        s = 0
        for k in range(5):
            s = s * 3 + _ternary(x, idv, 32 * k + j)
        out[j] = ((s * 256 + 242) // 243) & 0xFF
    for j in range(16):
        s = 0
        for k in range(5):
            s = s * 3 + _ternary(x, idv, 160 + 16 * k + j)
        out[32 + j] = ((s * 256 + 242) // 243) & 0xFF
    for j in range(4):
        s = 0
        for k in range(4):
            s = s * 3 + _ternary(x, idv, 240 + 4 * k + j)
        s *= 3
        out[48 + j] = ((s * 256 + 242) // 243) & 0xFF
    _put16(out, 52, fp16_bits(d))


@njit(cache=True, error_model="numpy")
def _blk_tq2_0(x, out):
    d = _absmax(x)
    idv = _inv(d)
    for i in range(2):
        for j in range(32):
            b = 0
            for k in range(4):
                b |= _ternary(x, idv, 128 * i + 32 * k + j) << (2 * k)
            out[32 * i + j] = b & 0xFF
    _put16(out, 64, fp16_bits(d))


@njit(cache=True, error_model="numpy")
def _blk_mxfp4(x, out, kv):  # kv: the E2M1 code book (doubled)
    dmax = _absmax(x)
    e = 0
    if dmax > _F0:
        # gguf-py takes floor(np.log2(d)) of the float32 log2 (rounded to
        # float32 first), so a d just below a power of two may round up.
        lg = np.float32(np.log2(np.float64(dmax)))
        e = np_cast_i32(np.floor(lg) - np.float32(2.0) + np.float32(127.0)) & 0xFF
    if e < 2:
        d = f32_from_bits(np.int64(0x00200000) << e)
    else:
        d = f32_from_bits(np.int64(e - 1) << 23)
    out[0] = e
    for j in range(16):
        b = 0
        for half in range(2):
            v = x[j + 16 * half]
            best = 0
            berr = abs(d * kv[0] - v)
            for k in range(1, 16):
                err = abs(d * kv[k] - v)
                if err < berr or (err != err and berr == berr):
                    berr = err
                    best = k
                    if err != err:
                        break
            b |= best << (4 * half)
        out[1 + j] = b


# ---- one parallel driver for all these formats (one compilation, not eleven)

_F32, _F16, _BF16, _Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0, _TQ1_0, _TQ2_0, _MXFP4 = range(11)
# code -> (values per block, bytes per block)
_GEOMETRY = np.array([(1, 4), (1, 2), (1, 2), (32, 18), (32, 20), (32, 22), (32, 24), (32, 34),
                      (256, 54), (256, 66), (32, 17)], dtype=np.int64)


@njit(cache=True, parallel=True, error_model="numpy")
def _quantize(rows, code):
    n_rows, n = rows.shape
    bs = _GEOMETRY[code, 0]
    size = _GEOMETRY[code, 1]
    bpr = n // bs
    nb = n_rows * bpr
    out = np.empty((n_rows, bpr * size), dtype=np.uint8)
    x = rows.reshape(nb, bs)
    y = out.reshape(nb, size)
    for c in prange((nb + CHUNK - 1) // CHUNK):
        lo, hi = chunk_bounds(c, nb)
        for i in range(lo, hi):
            if code == _F32:
                b = f32_to_bits(x[i, 0])
                for k in range(4):
                    y[i, k] = (b >> (8 * k)) & 0xFF
            elif code == _F16:
                _put16(y[i], 0, fp16_bits(x[i, 0]))
            elif code == _BF16:
                _put16(y[i], 0, bf16_bits(x[i, 0]))
            elif code == _Q4_0:
                _blk_q4_0(x[i], y[i])
            elif code == _Q4_1:
                _blk_q4_1(x[i], y[i])
            elif code == _Q5_0:
                _blk_q5_0(x[i], y[i])
            elif code == _Q5_1:
                _blk_q5_1(x[i], y[i])
            elif code == _Q8_0:
                _blk_q8_0(x[i], y[i])
            elif code == _TQ1_0:
                _blk_tq1_0(x[i], y[i])
            elif code == _TQ2_0:
                _blk_tq2_0(x[i], y[i])
            else:
                _blk_mxfp4(x[i], y[i], KVALUES_FP4)
    return out


# The public quantizers: (rows, imatrix) -> bytes; the importance matrix is
# not used by these formats. They are plain Python so that every format
# shares the one compiled driver (a jitted wrapper per format would link and
# re-optimise a copy of it, seconds of compilation each).

def quantize_f32(rows, imatrix=None):
    return _quantize(rows, _F32)


def quantize_f16(rows, imatrix=None):
    return _quantize(rows, _F16)


def quantize_bf16(rows, imatrix=None):
    return _quantize(rows, _BF16)


def quantize_q4_0(rows, imatrix=None):
    return _quantize(rows, _Q4_0)


def quantize_q4_1(rows, imatrix=None):
    return _quantize(rows, _Q4_1)


def quantize_q5_0(rows, imatrix=None):
    return _quantize(rows, _Q5_0)


def quantize_q5_1(rows, imatrix=None):
    return _quantize(rows, _Q5_1)


def quantize_q8_0(rows, imatrix=None):
    return _quantize(rows, _Q8_0)


def quantize_tq1_0(rows, imatrix=None):
    return _quantize(rows, _TQ1_0)


def quantize_tq2_0(rows, imatrix=None):
    return _quantize(rows, _TQ2_0)


def quantize_mxfp4(rows, imatrix=None):
    return _quantize(rows, _MXFP4)
