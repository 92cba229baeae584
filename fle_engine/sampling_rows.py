"""The sampler chain of :mod:`fle_engine.sampling` for several rows of
logits at once, in compiled loops: what a server round of several slots
samples in a handful of calls instead of a few dozen array operations per
slot.

The loops only compare, add, divide and subtract in float32 (and add in
float64 for the final draw) in the order the one-row chain does; the
exponentials are numpy's own (``np.exp`` on the rows), so every token and
random state equals the one-row chain's (:meth:`Sampler.__call__`). A row
the loops do not take (a NaN, no finite largest logit) is left to the
one-row path.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

_F32 = np.float32


@njit(cache=True, nogil=True)
def _top_rows(x, k, ids, c, flag):
    """Per row of ``x`` [R, V]: the k largest logits, descending, ties by
    index (the one-row path's top-k order) into ``ids`` / ``c`` [R, k];
    ``flag[r]`` = 1 where the row is left to the one-row path (a NaN, fewer
    than k values, a largest value that is not finite)."""
    r_n, v_n = x.shape
    for r in range(r_n):
        n = 0
        bad = False
        for i in range(v_n):
            v = x[r, i]
            if v != v:
                bad = True
                break
            if n < k:
                j = n
                n += 1
            elif v > c[r, k - 1]:
                j = k - 1
            else:
                continue
            while j > 0 and c[r, j - 1] < v:        # after the equal ones: ties stay in index order
                c[r, j] = c[r, j - 1]
                ids[r, j] = ids[r, j - 1]
                j -= 1
            c[r, j] = v
            ids[r, j] = i
        flag[r] = 1 if bad or n < k or not np.isfinite(c[r, 0]) else 0


@njit(cache=True, nogil=True)
def _cut_rows(c, e, flag, use_top_p, top_p, use_min_p, log_p, temp, n_keep, d):
    """How many of each row's sorted candidates top-p and min-p keep
    (``e``: exp(c - c[0]) when ``use_top_p``), and the tempered differences
    ``d`` = c / temp - c[0] / temp of those kept (temp > 0)."""
    r_n, k = c.shape
    for r in range(r_n):
        if flag[r]:
            continue
        last = k
        if use_top_p:
            tot = _F32(0.0)
            for j in range(k):
                tot = _F32(tot + e[r, j])
            cum = _F32(0.0)
            for j in range(k):
                cum = _F32(cum + _F32(e[r, j] / tot))
                if cum >= top_p:
                    last = j + 1
                    break
        if use_min_p:
            lim = _F32(c[r, 0] + log_p)
            for j in range(1, last):
                if c[r, j] < lim:
                    last = j
                    break
        n_keep[r] = last
        if temp > 0:
            t0 = _F32(c[r, 0] / temp)
            for j in range(last):
                d[r, j] = _F32(_F32(c[r, j] / temp) - t0)


@njit(cache=True, nogil=True)
def _draw_rows(w, n_keep, rnd, flag, ids, out):
    """The dist step per row: the first kept candidate whose running sum of
    weights ``w`` (float32, summed in float64) reaches ``rnd`` times their
    total."""
    r_n = w.shape[0]
    for r in range(r_n):
        if flag[r]:
            continue
        n = n_keep[r]
        if n == 1:
            out[r] = ids[r, 0]
            continue
        total = 0.0
        for j in range(n):
            total += np.float64(w[r, j])
        lim = total * rnd[r]
        hit = n - 1
        run = 0.0
        for j in range(n):
            run += np.float64(w[r, j])
            if run >= lim:
                hit = j
                break
        out[r] = ids[r, hit]


def sample_group(samplers, x: np.ndarray) -> list:
    """Tokens for rows ``x`` [R, V] (float32) whose samplers share their
    parameters, with top-k (``0 < top_k``): the one-row chain's tokens,
    each sampler's random state advanced as that chain advances it. None
    for a row left to the one-row path (its sampler untouched)."""
    p = samplers[0].params
    r_n, v_n = x.shape
    greedy = p.temp <= 0.0
    k = 1 if greedy else min(p.top_k, v_n)       # greedy takes the first largest, whatever the filters keep
    if not x.flags.c_contiguous:
        x = np.ascontiguousarray(x)
    ids = np.empty((r_n, k), dtype=np.int64)
    c = np.empty((r_n, k), dtype=_F32)
    flag = np.empty(r_n, dtype=np.uint8)
    _top_rows(x, k, ids, c, flag)
    rnd = [0.0 if flag[r] else samplers[r].rng.uniform() for r in range(r_n)]   # one draw per token
    if greedy:
        return [None if flag[r] else int(ids[r, 0]) for r in range(r_n)]
    use_top_p, use_min_p = p.top_p < 1.0, p.min_p > 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(c - c[:, :1]) if use_top_p else c
        log_p = _F32(math.log(p.min_p)) if use_min_p else _F32(0.0)
        n_keep = np.empty(r_n, dtype=np.int64)
        d = np.full((r_n, k), -np.inf, dtype=_F32)
        _cut_rows(c, e, flag, use_top_p, _F32(p.top_p), use_min_p, log_p, _F32(p.temp), n_keep, d)
        w = np.exp(d)
    out = np.empty(r_n, dtype=np.int64)
    _draw_rows(w, n_keep, np.array(rnd), flag, ids, out)
    return [None if flag[r] else int(out[r]) for r in range(r_n)]
