"""BatchedCache against one LayerCache per layer: the same hits, the same
admissions in the same order, the same slot_of and counts after every step,
over random routing (repeats inside a step, halvings, full and empty layers,
gate on and off, several admissions per step)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from fle_engine.expert_cache import BatchedCache, CachePolicy, LayerCache  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402

E_VALUES = (8, 16, 128, 512)


def _slot_counts(rng, n_expert, evict_oldest):
    """Per-layer slot counts: 0, 1, a few below evict_oldest, all experts, and random ones."""
    small = int(rng.integers(2, max(3, min(evict_oldest, n_expert))))
    fixed = [0, 1, min(small, n_expert), n_expert]
    rand = rng.integers(0, n_expert + 1, size=2).tolist()
    out = fixed + rand
    rng.shuffle(out)
    return out


def _routing(rng, n_step, n_layer, n_expert, n_ids):
    """Skewed ids with repeats: each layer draws from its own Zipf-like popularity."""
    out = np.empty((n_step, n_layer, n_ids), np.int64)
    for l in range(n_layer):
        p = 1.0 / np.arange(1, n_expert + 1) ** rng.uniform(0.5, 1.5)
        p = p[rng.permutation(n_expert)]
        out[:, l, :] = rng.choice(n_expert, size=(n_step, n_ids), p=p / p.sum())
    return out


def _compare_state(layers, batched):
    for l, lc in enumerate(layers):
        np.testing.assert_array_equal(batched.slot_of[l], lc.slot_of)
        np.testing.assert_array_equal(batched.counts[l], lc.counts)   # exact: same float operations
        np.testing.assert_array_equal(batched.expert_in[l, : lc.n_slots], lc.expert_in)
        assert batched.seen[l] == lc._seen and batched.clock[l] == lc._clock


def _flat(per_layer):
    rows = [(l, a.expert, a.slot, a.evicted) for l, adm in enumerate(per_layer) for a in adm]
    return tuple(np.array([r[i] for r in rows], np.int64) for i in range(4))


def _check_admissions(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)


CASES = [(seed, n_expert, n_ids) for seed in range(3) for n_expert in E_VALUES for n_ids in (1, 8, 24)]


@pytest.mark.parametrize("seed,n_expert,n_ids", CASES)
def test_batched_matches_layer_caches(seed, n_expert, n_ids):
    rng = np.random.default_rng(1000 * seed + 10 * n_expert + n_ids)
    policy = CachePolicy(halve_every=int(rng.integers(max(1, n_ids // 2), 6 * n_ids + 2)),
                         evict_oldest=int(rng.choice([1, 4, 32])),
                         admit_per_step=int(rng.choice([1, 3])), gate=bool(rng.integers(2)))
    n_slots = _slot_counts(rng, n_expert, policy.evict_oldest)
    n_layer = len(n_slots)
    counts = None
    if seed % 3 == 1:      # a starting profile, with ties
        counts = rng.integers(0, 5, size=(n_layer, n_expert)).astype(np.float64) * 0.5
    layers = [LayerCache(n_expert, s, policy, None if counts is None else counts[l]) for l, s in enumerate(n_slots)]
    batched = BatchedCache(n_expert, n_slots, policy,
                           counts if seed != 2 else None)
    if seed == 2:          # a warm start from per-layer rankings (with repeats), given as a mapping
        rankings = {l: rng.integers(0, n_expert, size=int(rng.integers(0, n_expert + 3))) for l in range(n_layer)}
        want = _flat([layers[l].fill(rankings[l]) for l in range(n_layer)])
        _check_admissions(batched.fill(rankings), want)
        _compare_state(layers, batched)

    n_step = 120 if n_expert >= 128 else 60
    routing = _routing(rng, n_step, n_layer, n_expert, n_ids)
    dtype = np.int32 if seed % 2 else np.int64
    for t in range(n_step):
        ids = routing[t].astype(dtype)
        per_layer = [lc.step(ids[l]) for l, lc in enumerate(layers)]
        hits, adm = batched.step(ids)
        np.testing.assert_array_equal(hits, np.stack([h for h, _ in per_layer]))
        _check_admissions(adm, _flat([a for _, a in per_layer]))
        _compare_state(layers, batched)
    for l, lc in enumerate(layers):
        np.testing.assert_array_equal(np.sort(batched.cached(l)), np.sort(lc.cached()))


def test_fill_sequence_then_full_eviction_order():
    """A full layer of few slots (below evict_oldest): every slot is a victim candidate."""
    policy = CachePolicy(halve_every=7, evict_oldest=32, admit_per_step=3, gate=False)
    layers = [LayerCache(16, 3, policy), LayerCache(16, 0, policy), LayerCache(16, 16, policy)]
    batched = BatchedCache(16, [3, 0, 16], policy)
    rankings = [[5, 5, 2, 9, 1], None, list(range(15, -1, -1))]
    want = _flat([lc.fill(r if r is not None else []) for lc, r in zip(layers, rankings)])
    _check_admissions(batched.fill(rankings), want)
    rng = np.random.default_rng(7)
    for _ in range(200):
        ids = rng.integers(0, 16, size=(3, 5))
        per_layer = [lc.step(ids[l]) for l, lc in enumerate(layers)]
        hits, adm = batched.step(ids)
        np.testing.assert_array_equal(hits, np.stack([h for h, _ in per_layer]))
        _check_admissions(adm, _flat([a for _, a in per_layer]))
        _compare_state(layers, batched)


def test_refusals_leave_state_alone():
    batched = BatchedCache(8, [2, 3], CachePolicy(halve_every=4))
    batched.step(np.array([[1, 2], [3, 4]]))
    before = (batched.counts.copy(), batched.slot_of.copy(), batched.seen.copy())
    with pytest.raises(FleError):
        batched.step(np.array([[1, 2], [3, 8]]))
    with pytest.raises(FleError):
        batched.step(np.array([[1, -1], [3, 4]]))
    with pytest.raises(FleError):
        batched.step(np.array([[1, 2, 3]]))
    with pytest.raises(FleError):
        batched.fill([[9], [0]])
    for a, b in zip(before, (batched.counts, batched.slot_of, batched.seen)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(FleError):
        BatchedCache(8, [2, 9])
    with pytest.raises(FleError):
        BatchedCache(8, [2, 3], counts=np.zeros((2, 7)))
    with pytest.raises(FleError):
        BatchedCache(8, [2, 3], counts={2: np.zeros(8)})
    with pytest.raises(FleError):
        BatchedCache(8, [2, 3], counts=np.array([[np.nan] * 8, [0.0] * 8]))


def test_id_forms():
    """Lists, narrow or unsigned dtypes and [L, tokens, k] arrays give the same steps as int64 [L, N]."""
    policy = CachePolicy(halve_every=9, evict_oldest=2)
    rng = np.random.default_rng(3)
    routing = rng.integers(0, 16, size=(40, 3, 2, 3))
    want = BatchedCache(16, [4, 1, 16], policy)
    forms = [lambda x: x.reshape(3, -1).tolist(), lambda x: x.astype(np.uint8), lambda x: x.astype(np.int16),
             lambda x: x, lambda x: x.astype(np.int32).transpose(0, 2, 1).copy().transpose(0, 2, 1)]
    got = [BatchedCache(16, [4, 1, 16], policy) for _ in forms]
    for ids in routing:
        hits, adm = want.step(ids.reshape(3, -1))
        hits, adm = hits.copy(), [a.copy() for a in adm]
        for form, cache in zip(forms, got):
            h, a = cache.step(form(ids))
            np.testing.assert_array_equal(h, hits)
            _check_admissions(a, adm)
    for cache in got:
        np.testing.assert_array_equal(cache.slot_of, want.slot_of)
        np.testing.assert_array_equal(cache.counts, want.counts)
