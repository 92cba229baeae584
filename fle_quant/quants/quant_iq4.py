"""IQ4_NL and IQ4_XS quantizers, byte-identical to ggml's
``quantize_iq4_nl`` / ``quantize_iq4_xs`` (``quantize_row_iq4_nl_impl`` with
``ntry = 7``), with or without an importance matrix.

Matching ggml byte for byte needs its exact float32 arithmetic: every sum is
accumulated sequentially in ggml's order, products are evaluated left to
right, scales are rounded to fp16 as GGML_FP32_TO_FP16 does and the final
indices are chosen with 1/d from the float32 (not the fp16) scale.

ggml picks the nearest code of the non-linear table with a binary search and
``x - v[k] < v[k+1] - x ? k : k+1``. For the IQ4 table (integers, |x| <= 127
where it matters) those float32 differences are exact near every midpoint,
so the choice equals "x >= (v[k] + v[k+1]) / 2 picks k+1", and with halves
of integers as midpoints that is a table lookup on floor(2 x).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .quant_util import CHUNK, chunk_bounds, fp16_bits_ggml, nearest_int, no_imatrix
from .tables import KVALUES_IQ4NL

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_EPS = np.float32(1e-15)  # GROUP_MAX_EPS
_NTRY = 7

_KV = KVALUES_IQ4NL  # float32 (16,), exact small integers
_KV0 = np.float32(_KV[0])


def _nearest_lut(values: np.ndarray) -> np.ndarray:
    # LUT[t + 256] for t = floor(2 x) in [-256, 255]: number of midpoints
    # m = (v[k] + v[k+1]) / 2 with x >= m, i.e. with t >= v[k] + v[k+1].
    v = values.astype(np.int64)
    twice_mid = v[:-1] + v[1:]
    t = np.arange(-256, 256, dtype=np.int64)
    lut = (t[:, None] >= twice_mid[None, :]).sum(axis=1).astype(np.uint8)
    lut.setflags(write=False)
    return lut


_LUT = _nearest_lut(_KV)


@njit(cache=True, error_model="numpy")
def best_index(x):
    """ggml's best_index_int8(16, kvalues_iq4nl, x), NaN included (-> 15)."""
    t = x * np.float32(2.0)  # exact
    if not (t < np.float32(255.0)):
        t = np.float32(255.0)
    elif t < np.float32(-256.0):
        t = np.float32(-256.0)
    return _LUT[np.int64(np.floor(t)) + 256]


@njit(cache=True, error_model="numpy")
def _sub_block(xb, w, L):
    """Scale search of one 32-value sub-block (the per-block loop body of
    quantize_row_iq4_nl_impl, ntry = 7). Writes L, returns the float32 d;
    returns 0 for an all-(near-)zero block, leaving L alone."""
    amax = _F0
    mx = _F0
    for j in range(32):
        ax = abs(xb[j])
        if ax > amax:
            amax = ax
            mx = xb[j]
    if amax < _EPS:
        return _F0
    d = -mx / _KV0
    idv = _F1 / d
    sumqx = _F0
    sumq2 = _F0
    for j in range(32):
        l = best_index(idv * xb[j])
        L[j] = l
        q = _KV[l]
        wj = w[j]
        sumqx += wj * q * xb[j]
        sumq2 += wj * q * q
    d = sumqx / sumq2 if sumq2 > _F0 else _F0
    best = d * sumqx
    for itry in range(-_NTRY, _NTRY + 1):
        idv = np.float32(itry + np.int64(_KV0)) / mx
        sumqx = _F0
        sumq2 = _F0
        for j in range(32):
            q = _KV[best_index(idv * xb[j])]
            wj = w[j]
            sumqx += wj * q * xb[j]
            sumq2 += wj * q * q
        if sumq2 > _F0 and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    return d


@njit(cache=True, error_model="numpy")
def _weights(xb, qw, use_qw, sigma2, w):
    if not use_qw:
        for j in range(32):
            w[j] = xb[j] * xb[j]
    else:
        for j in range(32):
            w[j] = qw[j] * np.sqrt(sigma2 + xb[j] * xb[j])


@njit(cache=True, error_model="numpy")
def _pack_nibbles(L, out, off, n):
    for i in range(n // 32):
        for j in range(16):
            out[off + 16 * i + j] = L[32 * i + j] | (L[32 * i + 16 + j] << 4)


@njit(cache=True, error_model="numpy")
def _blk_iq4_nl(x, qw, use_qw, out, w, L):
    sigma2 = _F0
    for j in range(32):
        sigma2 += x[j] * x[j]
    sigma2 *= np.float32(2.0 / 32.0)
    _weights(x, qw, use_qw, sigma2, w)
    d = _sub_block(x, w, L)
    h = fp16_bits_ggml(d)
    out[0] = h & 0xFF
    out[1] = (h >> 8) & 0xFF
    idv = _F1 / d if d != _F0 else _F0
    for j in range(32):
        L[j] = best_index(idv * x[j])
    _pack_nibbles(L, out, 2, 32)


@njit(cache=True, error_model="numpy")
def _blk_iq4_xs(x, qw, use_qw, out, w, L, scales):
    sigma2 = _F0
    for j in range(256):
        sigma2 += x[j] * x[j]
    sigma2 *= np.float32(2.0 / 256.0)
    max_scale = _F0
    amax_scale = _F0
    for ib in range(8):
        xb = x[32 * ib:32 * ib + 32]
        _weights(xb, qw[32 * ib:32 * ib + 32], use_qw, sigma2, w)
        d = _sub_block(xb, w, L[32 * ib:32 * ib + 32])
        scales[ib] = d
        ad = abs(d)
        if ad > amax_scale:
            amax_scale = ad
            max_scale = d
    d = -max_scale / np.float32(32.0)
    h = fp16_bits_ggml(d)
    out[0] = h & 0xFF
    out[1] = (h >> 8) & 0xFF
    idv = _F1 / d if d != _F0 else _F0
    scales_h = 0
    for ib in range(8):
        l = nearest_int(idv * scales[ib])
        l = max(-32, min(31, l))
        dl = d * np.float32(l)
        idl = _F1 / dl if dl != _F0 else _F0
        for j in range(32):
            L[32 * ib + j] = best_index(idl * x[32 * ib + j])
        l += 32
        if ib % 2 == 0:
            out[4 + ib // 2] = l & 0xF
        else:
            out[4 + ib // 2] |= (l & 0xF) << 4
        scales_h |= (l >> 4) << (2 * ib)
    out[2] = scales_h & 0xFF
    out[3] = (scales_h >> 8) & 0xFF
    _pack_nibbles(L, out, 8, 256)


@njit(cache=True, parallel=True, error_model="numpy")
def _quantize(rows, imatrix, use_imatrix, xs):
    n_rows, n = rows.shape
    bs = 256 if xs else 32
    size = 136 if xs else 18
    bpr = n // bs
    nb = n_rows * bpr
    out = np.empty((n_rows, bpr * size), dtype=np.uint8)
    x = rows.reshape(nb, bs)
    y = out.reshape(nb, size)
    for c in prange((nb + CHUNK - 1) // CHUNK):
        lo, hi = chunk_bounds(c, nb)
        w = np.empty(32, dtype=np.float32)
        L = np.empty(256, dtype=np.uint8)
        scales = np.empty(8, dtype=np.float32)
        qw = np.zeros(bs, dtype=np.float32)
        for i in range(lo, hi):
            if use_imatrix:
                c0 = (i % bpr) * bs
                qw = imatrix[c0:c0 + bs]
            if xs:
                _blk_iq4_xs(x[i], qw, use_imatrix, y[i], w, L, scales)
            else:
                _blk_iq4_nl(x[i], qw, use_imatrix, y[i], w, L)
    return out


# The public quantizers are plain Python so that both of them, with and
# without an importance matrix, share one compiled kernel.


def quantize_iq4_nl(rows, imatrix=None):
    if imatrix is None:
        return _quantize(rows, no_imatrix(), False, False)
    return _quantize(rows, imatrix, True, False)


def quantize_iq4_xs(rows, imatrix=None):
    if imatrix is None:
        return _quantize(rows, no_imatrix(), False, True)
    return _quantize(rows, imatrix, True, True)
