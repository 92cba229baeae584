"""How many cache slots each MoE layer gets under one byte budget.

A slot of layer l holds one expert of that layer: ``expert_bytes[l]`` bytes
(its gate, up and down matrices as stored). Without a usage profile every
layer gets the same number of slots (the remainder of the budget goes one
slot at a time to the layers in index order). With a profile (aged request
counts per layer and expert), slots go where they catch most requests: the
s-th slot of layer l is worth the share of that layer's requests that its
s-th most requested expert receives, and slots are handed out greedily by
worth per byte until the budget is spent. The worths of a layer fall with s,
so this greedy choice maximizes the expected hits for equal slot sizes and
is within one slot of it otherwise.
"""
from __future__ import annotations

import heapq
from typing import Mapping

import numpy as np

from fle_quant.errors import FleError

__all__ = ["plan_slots"]


def plan_slots(budget_bytes: int, expert_bytes: Mapping[int, int], n_expert: int,
               profile: "Mapping[int, np.ndarray] | None" = None) -> dict[int, int]:
    """Slots per layer (``{layer: slots}``, at most ``n_expert`` each) with
    ``sum(slots[l] * expert_bytes[l]) <= budget_bytes``."""
    if budget_bytes < 0:
        raise FleError(f"expert cache budget must be >= 0 bytes, got {budget_bytes}")
    layers = sorted(expert_bytes)
    for l in layers:
        if int(expert_bytes[l]) <= 0:
            raise FleError(f"expert cache: layer {l} has expert size {expert_bytes[l]} bytes")
    slots = {l: 0 for l in layers}
    left = int(budget_bytes)
    if profile is None:
        per_round = sum(int(expert_bytes[l]) for l in layers)
        even = min(n_expert, left // per_round) if per_round else 0
        for l in layers:
            slots[l] = even
        left -= even * per_round
        for l in layers:
            if slots[l] < n_expert and expert_bytes[l] <= left:
                slots[l] += 1
                left -= int(expert_bytes[l])
        return slots
    missing = [l for l in layers if l not in profile]
    if missing:
        raise FleError(f"expert cache profile has no counts for layer(s) {missing[:5]}; "
                       "it was written for another model or layer set")
    shares = {}
    for l in layers:
        c = np.sort(np.asarray(profile[l], np.float64))[::-1]
        if c.shape != (n_expert,):
            raise FleError(f"expert cache profile: layer {l} has {c.shape[0]} counts, the model {n_expert} experts")
        total = c.sum()
        shares[l] = c / total if total > 0 else np.full(n_expert, 1.0 / n_expert)
    # max-heap on worth per byte; ties: lower layer first
    heap = [(-shares[l][0] / expert_bytes[l], l) for l in layers]
    heapq.heapify(heap)
    while heap:
        _, l = heapq.heappop(heap)
        b = int(expert_bytes[l])
        if b > left:
            continue        # this layer's slots no longer fit; smaller ones may
        slots[l] += 1
        left -= b
        if slots[l] < n_expert:
            heapq.heappush(heap, (-shares[l][slots[l]] / b, l))
    return slots
