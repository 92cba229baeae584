"""IQ3_XXS and IQ3_S quantizers following ggml's ``quantize_row_iq3_xxs_impl``
and ``quantize_row_iq3_s_impl``.

Each 32-value sub-block is coded as 8 groups of 4 magnitudes on a grid of
256 (IQ3_XXS) or 512 (IQ3_S) points with levels 2l+1, l in 0..7, plus sign
bits (IQ3_XXS stores 7 per 8 values and keeps the parity even by flipping
the least important one). A scale search rounds every group to the nearest
lattice point; a point not on the grid is replaced by the best of its grid
neighbours (the points in the 2 (IQ3_XXS) or 3 (IQ3_S) nearest distance
shells, exactly as ggml's ``iq3xs_init_impl`` lists them), judged by the
weighted error at the trial scale. Sub-block scales are then coded in 4 bits
against an fp16 super-block scale. The float32 arithmetic keeps ggml's
order, so the bytes equal ggml's, with one deliberate difference: ggml's
IQ3_S forgets to advance its output pointers past an all-zero sub-block,
which shifts the codes of the following sub-blocks; here every sub-block's
codes stay in place. (Where ggml aborts, on values whose cubed magnitude
overflows float32, a valid grid point is kept instead.)
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .quant_util import CHUNK, chunk_bounds, fp16_bits_ggml, nearest_int, no_imatrix
from .tables import IQ3S_GRID, IQ3XXS_GRID

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_FLT_MAX = np.float32(3.4028234663852886e38)
_EPS_XXS = np.float32(1e-8)  # GROUP_MAX_EPS_IQ3_XXS


def _grid_tables(grid: np.ndarray, nwant: int):
    """From a dequantization grid (n, 4) with 8 distinct levels: the level
    index of each coordinate, the lattice -> grid map and the neighbour
    lists of every lattice point that is not on the grid."""
    levels = np.unique(grid)
    assert levels.size == 8
    lv = np.searchsorted(levels, grid).astype(np.int64)  # (n, 4), 0..7
    n = lv.shape[0]
    shifts = 3 * np.arange(4, dtype=np.int64)
    kmap = np.full(4096, -1, dtype=np.int32)
    kmap[(lv << shifts).sum(axis=1)] = np.arange(n, dtype=np.int32)
    lattice = (np.arange(4096, dtype=np.int64)[:, None] >> shifts) & 7
    pos = 2 * lv + 1
    d2 = ((2 * lattice[:, None, :] + 1 - pos[None, :, :]) ** 2).sum(axis=2)  # (4096, n)
    # Neighbours of a lattice point: every grid point in its `nwant` nearest
    # distance shells, ordered by distance and then grid index.
    order = np.argsort(d2 * n + np.arange(n), axis=1)
    sd2 = np.take_along_axis(d2, order, axis=1)
    new_shell = np.ones_like(sd2, dtype=bool)
    new_shell[:, 1:] = sd2[:, 1:] != sd2[:, :-1]
    sel = np.cumsum(new_shell, axis=1) <= nwant
    cnt = sel.sum(axis=1).astype(np.int32)
    off = (np.cumsum(cnt) - cnt).astype(np.int32)
    idx = order[sel].astype(np.int32)
    posf = pos.astype(np.float32)
    for a in (lv, kmap, off, cnt, idx, posf):
        a.setflags(write=False)
    return lv, posf, kmap, off, cnt, idx


_XXS = _grid_tables(IQ3XXS_GRID, 2)
_S = _grid_tables(IQ3S_GRID, 3)


@njit(cache=True, error_model="numpy")
def _best_neighbour(tabs, u, xval, waux, scale, L, k):
    """iq3_find_best_neighbour: the grid neighbour of lattice point u with
    the least weighted error at ``scale``; writes its levels to L[4k:4k+4]."""
    lv, posf, kmap, off, cnt, idx = tabs
    best_d2 = _FLT_MAX
    gi = idx[off[u]]  # ggml aborts when no error is below FLT_MAX (overflow); keep a valid point
    for t in range(cnt[u]):
        j = idx[off[u] + t]
        d2 = _F0
        for i in range(4):
            diff = scale * posf[j, i] - xval[4 * k + i]
            d2 += waux[4 * k + i] * diff * diff
        if d2 < best_d2:
            best_d2 = d2
            gi = j
    for i in range(4):
        L[4 * k + i] = lv[gi, i]
    return gi


@njit(cache=True, error_model="numpy")
def _lattice(idv, xval, k, L):
    # Round the 4 values of group k to lattice levels; returns the key u.
    u = 0
    for i in range(4):
        l = nearest_int(np.float32(0.5) * (idv * xval[4 * k + i] - _F1))
        l = max(0, min(7, l))
        L[4 * k + i] = l
        u |= l << (3 * i)
    return u


@njit(cache=True, error_model="numpy")
def _sums(weight, xval, L):
    sumqx = _F0
    sumq2 = _F0
    for i in range(32):
        w = weight[i]
        q = np.float32(2 * L[i] + 1)
        sumqx += w * xval[i] * q
        sumq2 += w * q * q
    return sumqx, sumq2


@njit(cache=True, error_model="numpy")
def _blk_iq3(x, qw, use_qw, out, is_s, tabs, sc):
    """One super-block of 256 values; sc is scratch (see _scratch)."""
    lv, posf, kmap, off, cnt, idx = tabs
    weight, waux, xval, scales = sc[0], sc[1], sc[2], sc[3]
    L = np.empty(32, dtype=np.int64)
    Laux = np.empty(32, dtype=np.int64)
    on_grid = np.empty(8, dtype=np.bool_)
    on_grid_aux = np.empty(8, dtype=np.bool_)
    block_signs = np.empty(4, dtype=np.int64)
    out[:] = 0
    sumx2 = _F0
    for i in range(256):
        sumx2 += x[i] * x[i]
    sigma2 = np.float32(2.0) * sumx2 / np.float32(256.0)
    ntry = 9 if is_s else 15
    max_scale = _F0
    for ib in range(8):
        xb = x[32 * ib:32 * ib + 32]
        if not use_qw:
            for i in range(32):
                weight[i] = xb[i] * xb[i]
        else:
            for i in range(32):
                weight[i] = qw[32 * ib + i] * np.sqrt(sigma2 + xb[i] * xb[i])
        for i in range(32):
            waux[i] = np.sqrt(weight[i])
        for k in range(4):
            s = 0
            nflip = 0
            for i in range(8):
                v = xb[8 * k + i]
                if v >= _F0:
                    xval[8 * k + i] = v
                else:
                    xval[8 * k + i] = -v
                    nflip += 1
                    s |= 1 << i
            if not is_s and nflip % 2 == 1:
                # 7 stored sign bits: flip the value that matters least
                imin = 0
                mn = weight[8 * k] * xb[8 * k] * xb[8 * k]
                for i in range(1, 8):
                    a = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i]
                    if a < mn:
                        mn = a
                        imin = i
                xval[8 * k + imin] = -xval[8 * k + imin]
                s ^= 1 << imin
            block_signs[k] = s & 127 if not is_s else s
        mx = xval[0]
        for i in range(1, 32):
            mx = max(mx, xval[i])
        for i in range(32):
            L[i] = 0
        if (is_s and mx == _F0) or (not is_s and mx < _EPS_XXS):
            scales[ib] = _F0
            continue
        best = _F0
        scale = mx / np.float32(15.0)
        for k in range(8):
            on_grid[k] = not is_s
        for its in range(-ntry, ntry + 1):
            idv = (np.float32(15.0) + np.float32(its) * np.float32(0.2)) / mx
            this_scale = _F1 / idv
            for k in range(8):
                u = _lattice(idv, xval, k, Laux)
                on_grid_aux[k] = True
                if kmap[u] < 0:
                    on_grid_aux[k] = False
                    _best_neighbour(tabs, u, xval, waux, this_scale, Laux, k)
            sumqx, sumq2 = _sums(weight, xval, Laux)
            if sumq2 > _F0 and sumqx * sumqx > best * sumq2:
                scale = sumqx / sumq2
                best = scale * sumqx
                for i in range(32):
                    L[i] = Laux[i]
                for k in range(8):
                    on_grid[k] = on_grid_aux[k]
        n_off = 0
        for k in range(8):
            if not on_grid[k]:
                n_off += 1
        if n_off > 0 and scale > _F0:
            idv = _F1 / scale
            for k in range(8):
                if on_grid[k] and not is_s:
                    continue
                u = _lattice(idv, xval, k, Laux)
                if kmap[u] < 0:
                    _best_neighbour(tabs, u, xval, waux, scale, Laux, k)
                for i in range(4):
                    L[4 * k + i] = Laux[4 * k + i]
            sumqx, sumq2 = _sums(weight, xval, L)
            if sumq2 > _F0:
                scale = sumqx / sumq2
        if scale < _F0:
            scale = -scale
            for k in range(4):
                block_signs[k] = (~block_signs[k]) & (255 if is_s else 127)
        for k in range(8):
            u = L[4 * k] | (L[4 * k + 1] << 3) | (L[4 * k + 2] << 6) | (L[4 * k + 3] << 9)
            gi = kmap[u]
            if is_s:
                out[2 + 8 * ib + k] = gi & 255
                out[66 + ib] |= (gi >> 8) << k
            else:
                out[2 + 8 * ib + k] = gi
        if is_s:
            for k in range(4):
                out[74 + 4 * ib + k] = block_signs[k]
        else:
            ss = block_signs[0] | (block_signs[1] << 7) | (block_signs[2] << 14) | (block_signs[3] << 21)
            for b in range(4):
                out[66 + 4 * ib + b] = (ss >> (8 * b)) & 0xFF
        scales[ib] = scale
        max_scale = max(max_scale, scale)
    if max_scale == _F0:
        # d = 0 decodes every value to 0; ggml clears the codes of IQ3_XXS
        # but leaves those of IQ3_S in place.
        if not is_s:
            out[:] = 0
        return
    d = max_scale / np.float32(31.0)
    h = fp16_bits_ggml(d * (np.float32(1.033) if is_s else np.float32(1.0125)))
    out[0] = h & 0xFF
    out[1] = (h >> 8) & 0xFF
    idv = _F1 / d
    for ib in range(8):
        l = nearest_int(np.float32(0.5) * (idv * scales[ib] - _F1))
        l = max(0, min(15, l))
        if is_s:
            out[106 + ib // 2] |= l << (4 * (ib % 2))
        else:
            out[66 + 4 * ib + 3] |= l << 4


@njit(cache=True, parallel=True, error_model="numpy")
def _quantize(rows, imatrix, use_imatrix, is_s, tabs):
    n_rows, n = rows.shape
    bpr = n // 256
    nb = n_rows * bpr
    size = 110 if is_s else 98
    out = np.empty((n_rows, bpr * size), dtype=np.uint8)
    x = rows.reshape(nb, 256)
    y = out.reshape(nb, size)
    for c in prange((nb + CHUNK - 1) // CHUNK):
        lo, hi = chunk_bounds(c, nb)
        sc = np.empty((4, 32), dtype=np.float32)
        qw = np.zeros(256, dtype=np.float32)
        for i in range(lo, hi):
            if use_imatrix:
                c0 = (i % bpr) * 256
                qw = imatrix[c0:c0 + 256]
            _blk_iq3(x[i], qw, use_imatrix, y[i], is_s, tabs, sc)
    return out


# The public quantizers are plain Python so that both of them, with and
# without an importance matrix, share one compiled kernel.


def quantize_iq3_xxs(rows, imatrix=None):
    if imatrix is None:
        return _quantize(rows, no_imatrix(), False, False, _XXS)
    return _quantize(rows, imatrix, True, False, _XXS)


def quantize_iq3_s(rows, imatrix=None):
    if imatrix is None:
        return _quantize(rows, no_imatrix(), False, True, _S)
    return _quantize(rows, imatrix, True, True, _S)
