"""FLE's own CPU expert kernels: numba, no C compiler needed on the user's
machine. This module holds the drivers; the types' row code is in
:mod:`.rowcode` (AVX2 and the portable IR) and :mod:`.simd512` (AVX-512),
compiled into one row kernel per (instruction set, type) by :mod:`.rows`.

A block is decoded once per call however many tokens use it, and the float
arithmetic per block and per output follows :mod:`.reference` exactly, so
the results are bit-identical to it.

``expert_forward`` runs the whole expert FFN of a few tokens in one call:
gate+up rows, then silu * up quantized once per (token, expert), then the
down rows, then the weighted sum, each product parallel over row chunks on
numba's thread pool (started once, reused by every call). Each chunk of
rows is one call of the type's row kernel by address (:mod:`.rows`), so the
drivers here hold no type's code.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from fle_quant.ggml_types import GGMLType

from .acts import quantize_row
from .plan import plan, silu_mul_row, weighted_sum
from .rowcode import BLOCK_BYTES, CODES, dot_k
from .rows import arrange, call_rows, layout, rows_address

__all__ = ["CODES", "forward", "matvec", "dot_k", "BLOCK_BYTES"]

@njit(cache=True, inline="always")
def _rows(fn, w, stride, r0, r1, nb, xq, xd, xs, arow, aoff, orow, ooff, nt, out):
    """Row kernel ``fn`` (.rows) on rows r0..r1 at address w: activation rows
    arow[aoff:aoff + nt] of (xq, xd, xs), output rows orow[ooff:...] of out."""
    call_rows(fn, w, stride, r0, r1, nb, np.int64(xq.ctypes.data), np.int64(xd.ctypes.data),
              np.int64(xs.ctypes.data), xq.shape[0], xq.shape[1], xd.shape[1], xs.shape[1],
              np.int64(arow.ctypes.data) + 8 * aoff, np.int64(orow.ctypes.data) + 8 * ooff, nt,
              np.int64(out.ctypes.data), out.shape[1])


@njit(cache=True, parallel=True)
def _matvec(fn, rows, nb, xq, xd, xs, out):
    n_rows = rows.shape[0]
    rb = rows.shape[1]
    nt = xq.shape[0]
    arow = np.arange(nt)
    w = np.int64(rows.ctypes.data)
    chunk = 16      # rows per work item
    for c in prange((n_rows + chunk - 1) // chunk):
        _rows(fn, w, rb, c * chunk, min(n_rows, (c + 1) * chunk), nb, xq, xd, xs, arow, 0, arow, 0, nt, out)


def matvec(rows: np.ndarray, qtype: GGMLType, acts) -> np.ndarray:
    """Same contract as :func:`.reference.matvec_ref`."""
    code = CODES[qtype]
    xq = acts.qs
    kind = layout(code)
    if kind > 0:
        xq = xq.copy()
        for r in range(xq.shape[0]):
            arrange(kind, xq[r])
    out = np.empty((acts.qs.shape[0], rows.shape[0]), np.float32)
    nb = rows.shape[1] // BLOCK_BYTES[code]
    rows = np.ascontiguousarray(rows)
    if rows.shape[0] and xq.shape[0]:
        _matvec(rows_address(code), rows, nb, np.ascontiguousarray(xq), acts.d, acts.sums, out)
    return out


def forward(buf, gu_code, gu_rb, n_ff, down_code, down_off, down_rb, n_embd, x, ids, wts, out, chunk):
    """The fused expert FFN (see the module docstring); arguments as
    :func:`fle_engine.kernels.cpu_experts.expert_forward` unpacks them."""
    _forward(buf, gu_code, gu_rb, n_ff, down_code, down_off, down_rb, n_embd, x, ids, wts, out, chunk,
             rows_address(gu_code), rows_address(down_code), layout(gu_code), layout(down_code))


@njit(cache=True, parallel=True)
def _forward(buf, gu_code, gu_rb, n_ff, down_code, down_off, down_rb, n_embd, x, ids, wts, out, chunk, gu_fn, d_fn,
             gu_kind, d_kind):
    n_t = x.shape[0]
    pid, ptok, uexp, ustart, upairs = plan(ids)
    n_p = ptok.shape[0]
    n_u = uexp.shape[0]
    # activations, once
    gu_k = dot_k(gu_code)
    xd = np.empty((n_t, n_embd // (256 if gu_k else 32)), np.float32)
    xq = np.empty((n_t, n_embd), np.int8)
    xs = np.empty((n_t, n_embd // 32), np.int32)
    tmp = np.empty(34, np.uint8)
    for t in range(n_t):
        quantize_row(x[t], gu_k, xd[t], xq[t], xs[t], tmp)
        arrange(gu_kind, xq[t])
    utok = np.empty(n_p, np.int64)      # the token of each pair, in the experts' order
    for i in range(n_p):
        utok[i] = ptok[upairs[i]]
    # gate and up rows of each distinct expert, for all its tokens
    g = np.empty((n_p, n_ff), np.float32)
    up = np.empty((n_p, n_ff), np.float32)
    nbg = gu_rb // BLOCK_BYTES[gu_code]
    nch = (n_ff + chunk - 1) // chunk
    base = np.int64(buf.ctypes.data)
    eb = buf.shape[1]
    for it in prange(n_u * nch):
        ui = it // nch
        c = it - ui * nch
        w = base + uexp[ui] * eb
        p0 = ustart[ui]
        nt = ustart[ui + 1] - p0
        r0, r1 = c * chunk, min(n_ff, (c + 1) * chunk)
        _rows(gu_fn, w, gu_rb, r0, r1, nbg, xq, xd, xs, utok, p0, upairs, p0, nt, g)
        _rows(gu_fn, w + n_ff * gu_rb, gu_rb, r0, r1, nbg, xq, xd, xs, utok, p0, upairs, p0, nt, up)
    # silu(gate) * up, quantized once per pair
    down_k = dot_k(down_code)
    hd = np.empty((n_p, n_ff // (256 if down_k else 32)), np.float32)
    hq = np.empty((n_p, n_ff), np.int8)
    hs = np.empty((n_p, n_ff // 32), np.int32)
    for p in range(n_p):      # serial: cheaper than another parallel region for a few rows
        h = np.empty(n_ff, np.float32)
        silu_mul_row(g[p], up[p], h)
        quantize_row(h, down_k, hd[p], hq[p], hs[p], np.empty(34, np.uint8))
        arrange(d_kind, hq[p])
    # down rows
    y = np.empty((n_p, n_embd), np.float32)
    nbd = down_rb // BLOCK_BYTES[down_code]
    nch = (n_embd + chunk - 1) // chunk
    for it in prange(n_u * nch):
        ui = it // nch
        c = it - ui * nch
        p0 = ustart[ui]
        nt = ustart[ui + 1] - p0
        _rows(d_fn, base + uexp[ui] * eb + down_off, down_rb, c * chunk, min(n_embd, (c + 1) * chunk), nbd, hq, hd,
              hs, upairs, p0, upairs, p0, nt, y)
    for t in range(n_t):
        weighted_sum(pid, wts, y, out, t)
