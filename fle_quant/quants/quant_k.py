"""Q6_K quantizer following ggml's ``quantize_q6_K``: ``make_qx_quants``
(rmse_type 1: weights x^2, or the importance matrix as given) per 16-value
group, 8-bit group scales relative to an fp16 super-block scale, then the
values re-quantized against the stored scales. The float32 arithmetic keeps
ggml's order, so the bytes equal ggml's.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .blocks_common import fp16_to_f32
from .quant_util import CHUNK, chunk_bounds, fp16_bits_ggml, nearest_int, no_imatrix

_F0 = np.float32(0.0)
_EPS = np.float32(1e-15)  # GROUP_MAX_EPS


@njit(cache=True, error_model="numpy")
def make_qx_quants(x, nmax, L, qw, use_qw):
    """ggml's make_qx_quants(n, nmax, x, L, rmse_type=1, qw): the scale of
    the best symmetric grid among 19 trial scales; L gets l + nmax. The
    weights are qw if use_qw, else x^2."""
    n = x.shape[0]
    mx = _F0
    amax = _F0
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    if amax < _EPS:
        for i in range(n):
            L[i] = 0
        return _F0
    iscale = np.float32(-nmax) / mx
    sumlx = _F0
    suml2 = _F0
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = l + nmax
        w = qw[i] if use_qw else x[i] * x[i]
        fl = np.float32(l)
        sumlx += w * x[i] * fl
        suml2 += w * fl * fl
    scale = sumlx / suml2 if suml2 != _F0 else _F0
    best = scale * sumlx
    for its in range(-9, 10):
        if its == 0:
            continue
        iscale = -(np.float32(nmax) + np.float32(0.1) * np.float32(its)) / mx
        sumlx = _F0
        suml2 = _F0
        for i in range(n):
            fl = np.float32(max(-nmax, min(nmax - 1, nearest_int(iscale * x[i]))))
            w = qw[i] if use_qw else x[i] * x[i]
            sumlx += w * x[i] * fl
            suml2 += w * fl * fl
        if suml2 > _F0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit(cache=True, error_model="numpy")
def _blk_q6_k(x, qw, use_qw, out, L, scales):
    max_scale = _F0
    max_abs_scale = _F0
    for ib in range(16):
        s = make_qx_quants(x[16 * ib:16 * ib + 16], 32, L[16 * ib:16 * ib + 16], qw[16 * ib:16 * ib + 16], use_qw)
        scales[ib] = s
        a = abs(s)
        if a > max_abs_scale:
            max_abs_scale = a
            max_scale = s
    if max_abs_scale < _EPS:
        out[:] = 0
        return
    iscale = np.float32(-128.0) / max_scale
    h = fp16_bits_ggml(np.float32(1.0) / iscale)
    out[208] = h & 0xFF
    out[209] = (h >> 8) & 0xFF
    dh = fp16_to_f32(h)
    for ib in range(16):
        sc = min(127, nearest_int(iscale * scales[ib]))
        out[192 + ib] = sc & 0xFF
        d = dh * np.float32(sc)
        if d == _F0:
            continue
        for ii in range(16):
            l = max(-32, min(31, nearest_int(x[16 * ib + ii] / d)))
            L[16 * ib + ii] = l + 32
    for half in range(2):
        j = 128 * half
        for l in range(32):
            out[64 * half + l] = (L[j + l] & 0xF) | ((L[j + l + 64] & 0xF) << 4)
            out[64 * half + l + 32] = (L[j + l + 32] & 0xF) | ((L[j + l + 96] & 0xF) << 4)
            out[128 + 32 * half + l] = ((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2)
                                        | ((L[j + l + 64] >> 4) << 4) | ((L[j + l + 96] >> 4) << 6))


@njit(cache=True, parallel=True, error_model="numpy")
def _quantize(rows, imatrix, use_imatrix):
    n_rows, n = rows.shape
    bpr = n // 256
    nb = n_rows * bpr
    out = np.empty((n_rows, bpr * 210), dtype=np.uint8)
    x = rows.reshape(nb, 256)
    y = out.reshape(nb, 210)
    for c in prange((nb + CHUNK - 1) // CHUNK):
        lo, hi = chunk_bounds(c, nb)
        L = np.empty(256, dtype=np.int64)
        scales = np.empty(16, dtype=np.float32)
        qw = np.zeros(256, dtype=np.float32)
        for i in range(lo, hi):
            if use_imatrix:
                c0 = (i % bpr) * 256
                qw = imatrix[c0:c0 + 256]
            _blk_q6_k(x[i], qw, use_imatrix, y[i], L, scales)
    return out


# The public quantizers are plain Python so that both of them, with and
# without an importance matrix, share one compiled kernel.


def quantize_q6_k(rows, imatrix=None):
    if imatrix is None:
        return _quantize(rows, no_imatrix(), False)
    return _quantize(rows, imatrix, True)
