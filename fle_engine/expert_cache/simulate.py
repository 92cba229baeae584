"""Replay a routing trace through the cache policy: the hit rate a cache
plan would reach, without weights or a GPU (measure before deciding).

A trace maps each MoE layer to the experts its steps requested, an int array
[steps, k] (one decode token per step) or [steps, t, k] (t tokens per step,
e.g. an MTP verification). :func:`trace_from_capture` makes one from the
reference forward pass's MoE capture of a text.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from fle_quant.errors import FleError

from .policy import CachePolicy, LayerCache

__all__ = ["SimResult", "simulate", "trace_from_capture", "warm_caches"]


@dataclass
class SimResult:
    hits: dict[int, int] = field(default_factory=dict)
    requests: dict[int, int] = field(default_factory=dict)
    admissions: dict[int, int] = field(default_factory=dict)
    misses_per_step: float = 0.0   # summed over layers, mean over steps

    @property
    def hit_rate(self) -> float:
        n = sum(self.requests.values())
        return sum(self.hits.values()) / n if n else 0.0


def warm_caches(slots: Mapping[int, int], n_expert: int, policy: CachePolicy,
                profile: "Mapping[int, np.ndarray] | None" = None) -> dict[int, LayerCache]:
    """One :class:`LayerCache` per layer; with a profile, its counts seed the
    aged counts and its most requested experts fill the slots."""
    caches = {}
    for l, n in slots.items():
        counts = None if profile is None else np.asarray(profile[l], np.float64)
        c = LayerCache(n_expert, n, policy, counts)
        if counts is not None:
            c.fill(np.argsort(-counts, kind="stable"))
        caches[l] = c
    return caches


def simulate(trace: Mapping[int, np.ndarray], caches: Mapping[int, LayerCache]) -> SimResult:
    """Run every layer's steps through its cache (in place) and count."""
    res = SimResult()
    n_steps = None
    for l, steps in trace.items():
        if l not in caches:
            raise FleError(f"cache simulation: the trace has layer {l}, the plan does not")
        steps = np.asarray(steps, np.int64)
        n_steps = steps.shape[0] if n_steps is None else n_steps
        c = caches[l]
        hits = adm = 0
        for s in steps:
            h, a = c.step(s)
            hits += int(h.sum())
            adm += len(a)
        res.hits[l], res.requests[l], res.admissions[l] = hits, int(steps.size), adm
    if n_steps:
        res.misses_per_step = (sum(res.requests.values()) - sum(res.hits.values())) / n_steps
    return res


def trace_from_capture(capture) -> dict[int, np.ndarray]:
    """``{layer: experts [tokens, k]}`` from a :class:`~fle_engine.layers.MoECapture`
    (calls of a layer concatenated in order; one token = one step)."""
    return {l: np.concatenate([r.experts.cpu().numpy() for r in recs]).astype(np.int64)
            for l, recs in capture.layers.items()}
