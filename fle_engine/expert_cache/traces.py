"""Synthetic routing traces with two knobs, for cache benchmarks where a
real model's routing is not at hand (factory models route far more
concentrated than real ones; see ``bench/cache_curve.py``):

- popularity: expert e of a layer is chosen with weight ``rank(e) ** -zipf``
  (ranks in a random order per layer);
- locality: each of the previous step's experts is kept for the next step
  with probability ``keep``; the other slots are drawn by popularity,
  without repeats within a step.

:func:`fit_trace` picks the two knobs so that FLE's cache policy reaches
given hit rates at given slot counts (by default the report's bracket V6b:
512 experts, top-10, 173 / 146 / 120 slots -> 0.912 / 0.888 / 0.848).
"""
from __future__ import annotations

import itertools
from typing import Mapping

import numpy as np

from .policy import CachePolicy
from .simulate import simulate, warm_caches

__all__ = ["synthetic_trace", "fit_trace", "REPORT_CURVE"]

REPORT_CURVE = {173: 0.912, 146: 0.888, 120: 0.848}   # slots of 512 -> hit rate (report, bracket V6b)


def synthetic_trace(n_expert: int, k: int, steps: int, zipf: float, keep: float, *, layers: int = 1,
                    seed: int = 0) -> dict[int, np.ndarray]:
    """``{layer: experts [steps, k]}``."""
    rng = np.random.default_rng(seed)
    out = {}
    for layer in range(layers):
        weight = np.arange(1, n_expert + 1, dtype=np.float64) ** -zipf
        p = weight[rng.permutation(n_expert)]
        p /= p.sum()
        trace = np.empty((steps, k), np.int64)
        prev = rng.choice(n_expert, k, replace=False, p=p)
        for s in range(steps):
            kept = prev[rng.random(k) < keep]
            fresh_p = p.copy()
            fresh_p[kept] = 0.0
            fresh_p /= fresh_p.sum()
            fresh = rng.choice(n_expert, k - len(kept), replace=False, p=fresh_p)
            prev = np.concatenate([kept, fresh])
            trace[s] = prev
        out[layer] = trace
    return out


def hit_curve(trace: Mapping[int, np.ndarray], n_expert: int, slots: list[int],
              policy: CachePolicy = CachePolicy(), warmup: float = 0.5) -> list[float]:
    """FLE's hit rate at each slot count, after warming on the first part."""
    rates = []
    for n in slots:
        caches = warm_caches({l: n for l in trace}, n_expert, policy)
        cut = int(len(next(iter(trace.values()))) * warmup)
        simulate({l: t[:cut] for l, t in trace.items()}, caches)
        rates.append(simulate({l: t[cut:] for l, t in trace.items()}, caches).hit_rate)
    return rates


def fit_trace(curve: Mapping[int, float] = REPORT_CURVE, n_expert: int = 512, k: int = 10, steps: int = 3000,
              zipfs=(0.6, 0.8, 1.0, 1.2, 1.4), keeps=(0.0, 0.2, 0.4, 0.6), seed: int = 0) -> tuple[float, float, list[float]]:
    """(zipf, keep, hit rates) of the grid point closest to ``curve`` (least
    squares over its slot counts)."""
    slots = sorted(curve)
    want = np.array([curve[s] for s in slots])
    best = None
    for z, r in itertools.product(zipfs, keeps):
        got = hit_curve(synthetic_trace(n_expert, k, steps, z, r, seed=seed), n_expert, slots)
        err = float(((np.array(got) - want) ** 2).sum())
        if best is None or err < best[0]:
            best = (err, z, r, got)
    return best[1], best[2], best[3]
