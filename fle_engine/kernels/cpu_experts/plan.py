"""What the fused expert kernels share: the routing plan of one call and
the silu * up step, in numba."""
from __future__ import annotations

import math

import numpy as np
from numba import njit

__all__ = ["plan", "silu_mul_row", "weighted_sum"]


@njit(cache=True)
def plan(ids):
    """ids int64 [T, K] (negative: not computed here) -> (pid [T, K]: the
    (token, expert) pair's index or -1, ptok [P]: each pair's token,
    uexp [U]: the distinct experts in order of first use, ustart [U + 1]
    and upairs [P]: expert u's pairs are upairs[ustart[u]:ustart[u + 1]])."""
    n_t, k = ids.shape
    pid = np.full((n_t, k), -1, np.int64)
    n_p = 0
    for t in range(n_t):
        for j in range(k):
            if ids[t, j] >= 0:
                pid[t, j] = n_p
                n_p += 1
    ptok = np.empty(n_p, np.int64)
    pexp = np.empty(n_p, np.int64)
    for t in range(n_t):
        for j in range(k):
            if pid[t, j] >= 0:
                ptok[pid[t, j]] = t
                pexp[pid[t, j]] = ids[t, j]
    uexp = np.empty(n_p, np.int64)
    n_u = 0
    for p in range(n_p):
        seen = False
        for u in range(n_u):
            if uexp[u] == pexp[p]:
                seen = True
        if not seen:
            uexp[n_u] = pexp[p]
            n_u += 1
    ustart = np.zeros(n_u + 1, np.int64)
    upairs = np.empty(n_p, np.int64)
    q = 0
    for u in range(n_u):
        ustart[u] = q
        for p in range(n_p):
            if pexp[p] == uexp[u]:
                upairs[q] = p
                q += 1
    ustart[n_u] = q
    return pid, ptok, uexp[:n_u].copy(), ustart, upairs


@njit(cache=True, inline="always")
def silu_mul_row(g, u, h):
    """h = silu(g) * u as :func:`.reference.silu_mul` computes it."""
    for i in range(g.shape[0]):
        g64 = np.float64(g[i])
        h[i] = np.float32(g64 / (1.0 + math.exp(-g64))) * u[i]


@njit(cache=True, inline="always")
def weighted_sum(pid, wts, y, out, t):
    """out[t] = sum_k wts[t, k] * y[pid[t, k]] in k order, from zero."""
    for i in range(out.shape[1]):
        out[t, i] = np.float32(0.0)
    for j in range(pid.shape[1]):
        p = pid[t, j]
        if p >= 0:
            w = wts[t, j]
            for i in range(out.shape[1]):
                out[t, i] = out[t, i] + w * y[p, i]
