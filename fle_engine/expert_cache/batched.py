"""The cache policy of :mod:`.policy` for all MoE layers of a model at once.

:class:`BatchedCache` holds the state of ``L`` layers in flat arrays and runs
one step of every layer (observe, look up, admit) in one compiled call, with
the same decisions as ``L`` separate :class:`~.policy.LayerCache` objects:
same hits, same admissions in the same order, same ``slot_of`` and the same
aged counts, bit for bit. A decode step of a 48-layer model costs a few
microseconds of host time this way instead of a millisecond or two.

How the rules map onto the flat state:

- Slots are never freed (an admission into a full layer replaces its
  victim), and every admission into a non-full layer takes the lowest free
  slot, so a layer's used slots are always ``0 .. n_used - 1``: the lowest
  free slot is ``n_used``.
- Entry stamps only grow, and an entry always gets the newest stamp, so the
  slots in stamp order form a queue: each layer keeps its used slots in a
  doubly linked list from the oldest entry (``head``) to the newest
  (``tail``). The ``evict_oldest`` oldest entries are the first nodes of the
  list, and a slot that takes a new expert moves to the tail.
- A full layer remembers its last victim (the slot the policy would
  evict): counts only grow between halvings, so the least frequent of the
  oldest entries stays the same until the victim itself is requested, the
  counts are halved, or an expert enters. A step whose candidates the gate
  turns away therefore costs no search of the oldest entries.
- A step's missed experts are deduplicated by marking them ``-2`` in
  ``slot_of`` while they are collected (the marks are cleared before the
  call returns), and the ``admit_per_step`` best of them (count descending,
  ties by lower expert id) are picked by insertion into a short sorted list.

The arrays :meth:`BatchedCache.step` returns are views of buffers that the
next call overwrites; copy what must outlive it.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np
from numba import njit

from fle_quant.errors import FleError

from .policy import CachePolicy

__all__ = ["BatchedCache", "bench_step"]

_ID_DTYPES = (np.dtype(np.int64), np.dtype(np.int32))    # ids the kernel takes as they are

# rows of the per-slot state [4, L, S_max]
_EXPERT, _STAMP, _PREV, _NEXT = 0, 1, 2, 3
# columns of the per-layer state [L, 7]; VICTIM: the remembered victim's slot, -1: to be searched
_NSLOTS, _NUSED, _CLOCK, _SEEN, _HEAD, _TAIL, _VICTIM = 0, 1, 2, 3, 4, 5, 6


@njit(cache=True)
def _put(l, e, slot, slot_of, slots, lay):
    """``e`` enters ``slot`` of layer ``l`` as its newest entry; returns the
    expert it replaced (-1: the slot was free)."""
    lay[l, _VICTIM] = -1
    old = slots[_EXPERT, l, slot]
    if old >= 0:
        slot_of[l, old] = -1
        # unlink the slot; it is appended at the tail below
        p = slots[_PREV, l, slot]
        n = slots[_NEXT, l, slot]
        if p >= 0:
            slots[_NEXT, l, p] = n
        else:
            lay[l, _HEAD] = n
        if n >= 0:
            slots[_PREV, l, n] = p
        else:
            lay[l, _TAIL] = p
    t = lay[l, _TAIL]
    slots[_PREV, l, slot] = t
    slots[_NEXT, l, slot] = -1
    if t >= 0:
        slots[_NEXT, l, t] = slot
    else:
        lay[l, _HEAD] = slot
    lay[l, _TAIL] = slot
    slots[_EXPERT, l, slot] = e
    slot_of[l, e] = slot
    lay[l, _CLOCK] += 1
    slots[_STAMP, l, slot] = lay[l, _CLOCK]
    return old


@njit(cache=True, inline="always")
def _record(adm, n, l, e, slot, evicted):
    """Admission ``n``: expert ``e`` of layer ``l`` into ``slot``, replacing ``evicted``."""
    adm[0, n] = l
    adm[1, n] = e
    adm[2, n] = slot
    adm[3, n] = evicted


@njit(cache=True)
def _step_kernel(ids, counts, slot_of, slots, lay, halve_every, evict_oldest, admit_per_step, gate,
                 hits, adm, scratch):
    """One step of every layer. Returns the number of admissions written to
    ``adm`` (rows: layer, expert, slot, evicted), or -1 when an id is out of
    range (then nothing has changed). ``scratch``: int64, at least
    ``N + admit_per_step`` long."""
    n_layer, n_ids = ids.shape
    n_expert = counts.shape[1]
    for l in range(n_layer):
        for i in range(n_ids):
            e = ids[l, i]
            if e < 0 or e >= n_expert:
                return -1
    cand = scratch[:n_ids]
    top = scratch[n_ids:n_ids + admit_per_step]
    n_adm = 0
    for l in range(n_layer):
        # observe
        for i in range(n_ids):
            counts[l, ids[l, i]] += 1.0
        seen = lay[l, _SEEN] + n_ids
        while seen >= halve_every:
            for e in range(n_expert):
                counts[l, e] *= 0.5
            seen -= halve_every
            lay[l, _VICTIM] = -1
        lay[l, _SEEN] = seen
        # look up; collect the distinct misses
        n_cand = 0
        for i in range(n_ids):
            e = ids[l, i]
            s = slot_of[l, e]
            hits[l, i] = s >= 0
            if s >= 0:
                if s == lay[l, _VICTIM]:
                    lay[l, _VICTIM] = -1
            elif s == -1:
                slot_of[l, e] = -2
                cand[n_cand] = e
                n_cand += 1
        for j in range(n_cand):
            slot_of[l, cand[j]] = -1
        n_slots = lay[l, _NSLOTS]
        if n_slots == 0 or n_cand == 0:
            continue
        # rank: the best admit_per_step by count descending, ties by lower id
        n_top = 0
        for j in range(n_cand):
            e = cand[j]
            c = counts[l, e]
            pos = n_top
            while pos > 0:
                f = top[pos - 1]
                cf = counts[l, f]
                if c > cf or (c == cf and e < f):
                    pos -= 1
                else:
                    break
            if pos >= admit_per_step:
                continue
            last = n_top if n_top < admit_per_step else admit_per_step - 1
            for q in range(last, pos, -1):
                top[q] = top[q - 1]
            top[pos] = e
            if n_top < admit_per_step:
                n_top += 1
        # admit
        for j in range(n_top):
            e = top[j]
            if lay[l, _NUSED] < n_slots:
                slot = lay[l, _NUSED]
                lay[l, _NUSED] += 1
            else:
                slot = lay[l, _VICTIM]
                if slot < 0:
                    slot = lay[l, _HEAD]
                    best = counts[l, slots[_EXPERT, l, slot]]
                    node = slots[_NEXT, l, slot]
                    k = 1
                    while k < evict_oldest and node >= 0:
                        c = counts[l, slots[_EXPERT, l, node]]
                        if c < best:
                            best = c
                            slot = node
                        node = slots[_NEXT, l, node]
                        k += 1
                    lay[l, _VICTIM] = slot
                if gate and not counts[l, e] > counts[l, slots[_EXPERT, l, slot]]:
                    continue
            _record(adm, n_adm, l, e, slot, _put(l, e, slot, slot_of, slots, lay))
            n_adm += 1
    return n_adm


@njit(cache=True)
def _fill_kernel(flat, offsets, slot_of, slots, lay, adm):
    """Warm start: layer ``l`` takes ``flat[offsets[l]:offsets[l + 1]]`` in
    order into free slots, skipping cached experts, while slots are free."""
    n_adm = 0
    for l in range(offsets.shape[0] - 1):
        for i in range(offsets[l], offsets[l + 1]):
            e = flat[i]
            if slot_of[l, e] >= 0:
                continue
            if lay[l, _NUSED] >= lay[l, _NSLOTS]:
                break
            slot = lay[l, _NUSED]
            lay[l, _NUSED] += 1
            _record(adm, n_adm, l, e, slot, _put(l, e, slot, slot_of, slots, lay))
            n_adm += 1
    return n_adm


class BatchedCache:
    """The cache state of ``L`` layers of ``n_expert`` experts each, layer
    ``l`` with ``n_slots[l]`` slots, under one :class:`CachePolicy`.

    ``counts`` (optional) are the starting aged counts: an ``[L, n_expert]``
    array, or a mapping from layer to an ``[n_expert]`` array (layers it
    leaves out start at zero).

    Live state (arrays, updated in place by :meth:`step` and :meth:`fill`):
    ``counts`` float64 ``[L, E]``, ``slot_of`` int32 ``[L, E]`` (-1: not
    cached), ``expert_in`` and ``stamp`` int64 ``[L, S_max]`` (slots from
    ``n_slots[l]`` on are unused), ``n_slots``, ``clock`` and ``seen`` (requests
    since the last halving) per layer.
    """

    def __init__(self, n_expert: int, n_slots: Sequence[int], policy: CachePolicy = CachePolicy(),
                 counts: "np.ndarray | Mapping[int, np.ndarray] | None" = None):
        n_slots = np.asarray(n_slots, np.int64).reshape(-1)
        n_expert = int(n_expert)
        if n_expert < 1 or len(n_slots) < 1 or n_slots.min() < 0 or n_slots.max() > n_expert:
            raise FleError(f"expert cache: slots {n_slots.tolist()} for {n_expert} experts; "
                           "need at least one layer and 0 <= slots <= experts")
        n_layer = len(n_slots)
        self.n_layer, self.n_expert, self.policy = n_layer, n_expert, policy
        self._counts = np.zeros((n_layer, n_expert), np.float64)
        if isinstance(counts, Mapping):
            for l, c in counts.items():
                l = int(l)
                if not 0 <= l < n_layer:
                    raise FleError(f"expert cache: counts for layer {l} of {n_layer}")
                c = np.asarray(c, np.float64)
                if c.shape != (n_expert,):
                    raise FleError(f"expert cache: {c.shape} counts for {n_expert} experts in layer {l}")
                self._counts[l] = c
        elif counts is not None:
            c = np.asarray(counts, np.float64)
            if c.shape != (n_layer, n_expert):
                raise FleError(f"expert cache: counts of shape {c.shape} for {n_layer} layers "
                               f"of {n_expert} experts")
            self._counts[:] = c
        if not np.isfinite(self._counts).all():
            raise FleError("expert cache: counts must be finite")
        s_max = max(int(n_slots.max()), 1)
        self._slot_of = np.full((n_layer, n_expert), -1, np.int32)
        self._slots = np.full((4, n_layer, s_max), -1, np.int64)
        self._slots[_STAMP] = 0
        self._lay = np.zeros((n_layer, 7), np.int64)
        self._lay[:, _NSLOTS] = n_slots
        self._lay[:, _HEAD:] = -1
        self._params = (int(policy.halve_every), int(policy.evict_oldest), int(policy.admit_per_step),
                        bool(policy.gate))
        # at most admit_per_step admissions per layer and step
        self._adm = np.empty((4, n_layer * self._params[2]), np.int64)
        self._adm_views = [tuple(self._adm[r, :n] for r in range(4)) for n in range(self._adm.shape[1] + 1)]
        self._hits: dict[int, np.ndarray] = {}
        self._scratch = np.empty(8 + self._params[2], np.int64)

    # state ---------------------------------------------------------------------
    @property
    def counts(self) -> np.ndarray:
        """The aged request counts, float64 ``[L, E]`` (live)."""
        return self._counts

    @property
    def slot_of(self) -> np.ndarray:
        """Each expert's slot, int32 ``[L, E]``, -1 when not cached (live)."""
        return self._slot_of

    @property
    def expert_in(self) -> np.ndarray:
        """Each slot's expert, int64 ``[L, S_max]``, -1 when free or unused (live)."""
        return self._slots[_EXPERT]

    @property
    def stamp(self) -> np.ndarray:
        """Each slot's entry stamp, int64 ``[L, S_max]``, 0 when free (live)."""
        return self._slots[_STAMP]

    @property
    def n_slots(self) -> np.ndarray:
        return self._lay[:, _NSLOTS]

    @property
    def clock(self) -> np.ndarray:
        """Entries so far, per layer."""
        return self._lay[:, _CLOCK]

    @property
    def seen(self) -> np.ndarray:
        """Requests since the last halving, per layer."""
        return self._lay[:, _SEEN]

    def cached(self, layer: int) -> np.ndarray:
        """The experts in layer ``layer``'s slots, in slot order."""
        return self._slots[_EXPERT, layer, : self._lay[layer, _NUSED]].copy()

    # warm start ----------------------------------------------------------------
    def fill(self, rankings) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Put each layer's ranked experts (first ones first) into its free
        slots, as many as fit, as :meth:`LayerCache.fill`. ``rankings``: a
        sequence of ``L`` id sequences (``None``: leave the layer), or a
        mapping from layer to ids. Returns the admissions (layer, expert,
        slot, evicted), as fresh arrays."""
        per_layer: list = [None] * self.n_layer
        if isinstance(rankings, Mapping):
            for l, r in rankings.items():
                if not 0 <= int(l) < self.n_layer:
                    raise FleError(f"expert cache: ranking for layer {l} of {self.n_layer}")
                per_layer[int(l)] = r
        else:
            rankings = list(rankings)
            if len(rankings) != self.n_layer:
                raise FleError(f"expert cache: {len(rankings)} rankings for {self.n_layer} layers")
            per_layer = rankings
        parts = [np.zeros(0, np.int64) if r is None else np.asarray(r, np.int64).reshape(-1) for r in per_layer]
        flat = np.concatenate(parts)
        if len(flat) and (flat.min() < 0 or flat.max() >= self.n_expert):
            raise FleError(f"expert cache: expert id outside 0..{self.n_expert - 1}")
        offsets = np.zeros(self.n_layer + 1, np.int64)
        np.cumsum([len(p) for p in parts], out=offsets[1:])
        adm = np.empty((4, int(self._lay[:, _NSLOTS].sum())), np.int64)
        n = _fill_kernel(flat, offsets, self._slot_of, self._slots, self._lay, adm)
        return adm[0, :n].copy(), adm[1, :n].copy(), adm[2, :n].copy(), adm[3, :n].copy()

    # one step ------------------------------------------------------------------
    def step(self, ids: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Observe, look up and admit for one step of every layer, as
        :meth:`LayerCache.step` per layer. ``ids``: integer ``[L, N]`` (layer
        ``l``'s routed expert ids this step, repeats counted; more dimensions
        are flattened into ``N``). Returns ``(hits, (layer, expert, slot,
        evicted))``: the hit mask bool ``[L, N]`` and the admissions in layer
        order, then admission order (evicted -1: the slot was free). Both are
        views of buffers the next call overwrites."""
        if type(ids) is not np.ndarray or ids.dtype not in _ID_DTYPES:
            ids = np.asarray(ids, np.int64)
        if ids.ndim != 2 or ids.shape[0] != self.n_layer:
            if ids.ndim < 2 or ids.shape[0] != self.n_layer:
                raise FleError(f"expert cache: ids of shape {ids.shape}; need [{self.n_layer}, N]")
            ids = ids.reshape(self.n_layer, -1)
        n_ids = ids.shape[1]
        hits = self._hits.get(n_ids)
        if hits is None:
            hits = self._hits[n_ids] = np.empty((self.n_layer, n_ids), np.bool_)
            if len(self._scratch) < n_ids + self._params[2]:
                self._scratch = np.empty(n_ids + self._params[2], np.int64)
        halve_every, evict_oldest, admit_per_step, gate = self._params
        n = _step_kernel(ids, self._counts, self._slot_of, self._slots, self._lay,
                         halve_every, evict_oldest, admit_per_step, gate, hits, self._adm, self._scratch)
        if n < 0:
            raise FleError(f"expert cache: expert id outside 0..{self.n_expert - 1}")
        return hits, self._adm_views[n]


def _skewed_ids(rng: np.random.Generator, n_step: int, n_layer: int, n_expert: int, n_ids: int,
                skew: float = 1.0) -> np.ndarray:
    """``[n_step, L, n_ids]`` routed ids: per step and layer, ``n_ids``
    distinct experts (``n_ids`` <= ``n_expert``) drawn from a Zipf-like
    popularity (exponent ``skew``) over a random order of each layer's
    experts, by Gumbel top-k."""
    weight = np.log(1.0 / np.arange(1, n_expert + 1) ** skew)
    logits = np.stack([weight[rng.permutation(n_expert)] for _ in range(n_layer)]).astype(np.float32)
    out = np.empty((n_step, n_layer, n_ids), np.int64)
    chunk = max(1, (1 << 24) // (n_layer * n_expert))
    for a in range(0, n_step, chunk):
        b = min(n_step, a + chunk)
        g = logits - np.log(-np.log(rng.random((b - a, n_layer, n_expert), np.float32) + 1e-20) + 1e-20)
        out[a:b] = np.argpartition(-g, n_ids - 1, axis=-1)[..., :n_ids]
    return out


def bench_step(n_layer: int = 48, n_expert: int = 128, n_ids: int = 8, slot_fraction: float = 1 / 3,
               policy: CachePolicy = CachePolicy(), n_step: int = 4000, warmup: int = 500,
               seed: int = 0) -> dict:
    """Host time of :meth:`BatchedCache.step` on skewed random routing:
    returns the median, 10th and 90th percentile in microseconds per step,
    and the hit rate over the timed steps. ``python -m
    fle_engine.expert_cache.batched`` prints the two standard cases (48
    layers; 128 experts and 8 ids, 512 experts and 10 ids; a third of the
    experts in slots)."""
    rng = np.random.default_rng(seed)
    n_slots = [max(1, round(n_expert * slot_fraction))] * n_layer
    ids = _skewed_ids(rng, warmup + n_step, n_layer, n_expert, n_ids)
    cache = BatchedCache(n_expert, n_slots, policy)
    for t in range(warmup):
        cache.step(ids[t])
    times = np.empty(n_step)
    n_hit = 0
    clock = time.perf_counter_ns
    for t in range(n_step):
        x = ids[warmup + t]
        t0 = clock()
        hits, _ = cache.step(x)
        times[t] = clock() - t0
        n_hit += int(hits.sum())
    us = times / 1e3
    return {"median_us": float(np.median(us)), "p10_us": float(np.percentile(us, 10)),
            "p90_us": float(np.percentile(us, 90)), "hit_rate": n_hit / (n_step * n_layer * n_ids)}


if __name__ == "__main__":
    for n_expert, n_ids in ((128, 8), (512, 10)):
        r = bench_step(48, n_expert, n_ids)
        print(f"L=48 E={n_expert} N={n_ids} slots={max(1, round(n_expert / 3))}: "
              f"median {r['median_us']:.1f} us/step (p10 {r['p10_us']:.1f}, p90 {r['p90_us']:.1f}), "
              f"hit rate {r['hit_rate']:.3f}")
