"""Which experts of one MoE layer sit in the GPU cache: the decisions only
(no weights), step by step, so that the same code drives the engine and the
trace simulator.

Per layer the cache has ``n_slots`` slots. Each step (one forward call: a
decode token, or the few tokens of an MTP verification) brings the experts
its tokens were routed to:

1. Observe. Every request (token x chosen expert) adds 1 to that expert's
   aged request count; each time the layer has seen ``halve_every`` more
   requests, all its counts are halved, so the counts follow the recent
   mix of the text.
2. Look up. A requested expert in a slot is a hit; the others are misses,
   computed outside the cache this step.
3. Admit. The step's missed experts are ranked by aged count (ties: lower
   expert id first); at most ``admit_per_step`` of them enter. A free slot
   is taken first; otherwise the victim is the least frequent of the
   ``evict_oldest`` entries that entered the cache earliest (ties: the
   oldest), and with ``gate`` on the candidate enters only when its count
   exceeds the victim's, so that a burst of rare experts cannot flush
   experts that are used steadily.

Admitted experts serve from the next step on (their weights are copied while
this step computes the misses).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fle_quant.errors import FleError

__all__ = ["CachePolicy", "LayerCache", "Admission"]


@dataclass(frozen=True)
class CachePolicy:
    halve_every: int = 2000      # requests per layer between halvings of the counts
    evict_oldest: int = 32       # the victim is the least frequent of this many oldest entries
    admit_per_step: int = 1      # admissions per layer and step
    gate: bool = True            # admit only an expert more frequent than its victim

    def __post_init__(self) -> None:
        for name in ("halve_every", "evict_oldest", "admit_per_step"):
            if int(getattr(self, name)) < 1:
                raise FleError(f"cache policy: {name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Admission:
    """``expert`` entered ``slot``, replacing ``evicted`` (-1: the slot was free)."""
    expert: int
    slot: int
    evicted: int


class LayerCache:
    """The cache state of one layer: ``slot_of[e]`` (-1 when expert ``e``
    is not cached), ``expert_in[s]`` (-1 when slot ``s`` is free), each
    slot's entry stamp (order of entry), and the aged request counts."""

    def __init__(self, n_expert: int, n_slots: int, policy: CachePolicy = CachePolicy(),
                 counts: "np.ndarray | None" = None):
        if n_expert < 1 or not 0 <= n_slots <= n_expert:
            raise FleError(f"expert cache: {n_slots} slots for {n_expert} experts; need 0 <= slots <= experts")
        self.n_expert, self.n_slots, self.policy = int(n_expert), int(n_slots), policy
        self.counts = np.zeros(n_expert, np.float64) if counts is None else np.array(counts, np.float64)
        if self.counts.shape != (n_expert,):
            raise FleError(f"expert cache: {self.counts.shape[0]} counts for {n_expert} experts")
        self.slot_of = np.full(n_expert, -1, np.int64)
        self.expert_in = np.full(n_slots, -1, np.int64)
        self.stamp = np.zeros(n_slots, np.int64)
        self._clock = 0
        self._seen = 0            # requests since the last halving

    # state ---------------------------------------------------------------------
    def fill(self, experts) -> list[Admission]:
        """Put ``experts`` (in order, the first ones first) into free slots,
        as many as fit: a warm start from a profile's ranking."""
        out = []
        for e in experts:
            e = int(e)
            if self.slot_of[e] >= 0:
                continue
            free = np.flatnonzero(self.expert_in < 0)
            if not len(free):
                break
            out.append(self._put(e, int(free[0])))
        return out

    def cached(self) -> np.ndarray:
        return self.expert_in[self.expert_in >= 0]

    def _put(self, e: int, slot: int) -> Admission:
        old = int(self.expert_in[slot])
        if old >= 0:
            self.slot_of[old] = -1
        self.expert_in[slot] = e
        self.slot_of[e] = slot
        self._clock += 1
        self.stamp[slot] = self._clock
        return Admission(e, slot, old)

    # one step ------------------------------------------------------------------
    def observe(self, experts: np.ndarray) -> None:
        """Count the step's requests (``experts``: ids, any shape, repeats
        counted), halving the counts whenever ``halve_every`` more have come."""
        flat = np.asarray(experts, np.int64).reshape(-1)
        if len(flat) and (flat.min() < 0 or flat.max() >= self.n_expert):
            raise FleError(f"expert cache: expert id outside 0..{self.n_expert - 1}")
        np.add.at(self.counts, flat, 1.0)
        self._seen += len(flat)
        while self._seen >= self.policy.halve_every:
            self.counts *= 0.5
            self._seen -= self.policy.halve_every

    def lookup(self, experts: np.ndarray) -> np.ndarray:
        """Hit mask of ``experts`` (same shape)."""
        return self.slot_of[np.asarray(experts, np.int64)] >= 0

    def admit(self, missed: np.ndarray) -> list[Admission]:
        """Admit from the step's missed experts by the policy; returns what changed."""
        if self.n_slots == 0:
            return []
        cand = np.unique(np.asarray(missed, np.int64).reshape(-1))
        cand = cand[self.slot_of[cand] < 0]
        if not len(cand):
            return []
        # by count, descending; ties by expert id (np.unique sorted them ascending, the sort is stable)
        cand = cand[np.argsort(-self.counts[cand], kind="stable")]
        out = []
        for e in cand[: self.policy.admit_per_step]:
            e = int(e)
            free = np.flatnonzero(self.expert_in < 0)
            if len(free):
                out.append(self._put(e, int(free[0])))
                continue
            oldest = np.argsort(self.stamp, kind="stable")[: self.policy.evict_oldest]
            victim_slot = int(oldest[np.argmin(self.counts[self.expert_in[oldest]])])
            if self.policy.gate and not self.counts[e] > self.counts[self.expert_in[victim_slot]]:
                continue
            out.append(self._put(e, victim_slot))
        return out

    def step(self, experts: np.ndarray) -> tuple[np.ndarray, list[Admission]]:
        """Observe, look up and admit for one step: (hit mask, admissions)."""
        experts = np.asarray(experts, np.int64)
        self.observe(experts)
        hits = self.lookup(experts)
        return hits, self.admit(experts[~hits])
