"""The expert cache's decisions: the policy against a plain reference
written from the rules alone, the byte-budget planner against brute force,
profiles (round trip, refusal for another model, from a frequency table)
and the trace simulator."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

pytest.importorskip("torch")

from fle_engine.expert_cache import (CachePolicy, LayerCache, Profile, load_profile, model_fingerprint,  # noqa: E402
                                     plan_slots, profile_from_scores, save_profile, simulate, warm_caches)
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402


class PlainCache:
    """The policy's rules, written out with lists and dicts."""

    def __init__(self, n_expert, n_slots, halve_every, evict_oldest, admit_per_step, gate):
        self.count = [0.0] * n_expert
        self.slots = [None] * n_slots         # (expert, entry number)
        self.entries = 0
        self.seen = 0
        self.cfg = (halve_every, evict_oldest, admit_per_step, gate)

    def step(self, requests):
        halve_every, evict_oldest, admit_per_step, gate = self.cfg
        for e in requests:
            self.count[e] += 1
        self.seen += len(requests)
        while self.seen >= halve_every:
            self.count = [c / 2 for c in self.count]
            self.seen -= halve_every
        cached = {s[0] for s in self.slots if s is not None}
        hits = [e in cached for e in requests]
        missed = sorted({e for e in requests if e not in cached}, key=lambda e: (-self.count[e], e))
        for e in missed[:admit_per_step]:
            if None in self.slots:
                i = self.slots.index(None)
            else:
                order = sorted(range(len(self.slots)), key=lambda i: self.slots[i][1])[:evict_oldest]
                i = min(order, key=lambda i: (self.count[self.slots[i][0]], order.index(i)))
                if gate and not self.count[e] > self.count[self.slots[i][0]]:
                    continue
            self.entries += 1
            self.slots[i] = (e, self.entries)
        return hits


@pytest.mark.parametrize("seed", range(6))
def test_policy_matches_plain_rules(seed):
    rng = np.random.default_rng(seed)
    n_expert, k = 24, 4
    cfg = dict(halve_every=int(rng.integers(5, 60)), evict_oldest=int(rng.integers(1, 8)),
               admit_per_step=int(rng.integers(1, 4)), gate=bool(seed % 2))
    n_slots = int(rng.integers(0, n_expert + 1))
    fast = LayerCache(n_expert, n_slots, CachePolicy(**cfg))
    plain = PlainCache(n_expert, n_slots, **cfg)
    popular = rng.dirichlet(np.full(n_expert, 0.3))
    for t in range(400):
        tokens = int(rng.integers(1, 3))
        req = np.concatenate([rng.choice(n_expert, k, replace=False, p=popular) for _ in range(tokens)])
        hits, _ = fast.step(req)
        assert hits.tolist() == plain.step(req.tolist()), t
        assert np.allclose(fast.counts, plain.count)
        assert sorted(fast.cached().tolist()) == sorted(s[0] for s in plain.slots if s is not None)


def test_policy_details():
    c = LayerCache(8, 2, CachePolicy(halve_every=1000, evict_oldest=2, admit_per_step=1, gate=True))
    assert c.step(np.array([0, 1]))[1][0].expert == 0          # one admission per step, lower id on a tie
    c.step(np.array([1]))
    assert sorted(c.cached().tolist()) == [0, 1]
    for _ in range(3):
        c.step(np.array([1]))                                   # 1 is frequent, 0 was seen once
    h, adm = c.step(np.array([5]))                              # 5 seen once: not more frequent than 0
    assert not h.any() and adm == []
    h, adm = c.step(np.array([5]))                              # now 2 > 1: replaces 0, the least frequent
    assert [(a.expert, a.evicted) for a in adm] == [(5, 0)]
    with pytest.raises(FleError):
        c.step(np.array([8]))
    with pytest.raises(FleError):
        LayerCache(4, 5)
    with pytest.raises(FleError):
        CachePolicy(evict_oldest=0)


def test_halving():
    c = LayerCache(4, 0, CachePolicy(halve_every=4))
    c.observe(np.array([0, 0, 1]))
    assert c.counts.tolist() == [2, 1, 0, 0]
    c.observe(np.array([2, 2]))                                  # 5 seen: one halving, 1 carried over
    assert c.counts.tolist() == [1, 0.5, 1, 0]


def brute_force(budget, sizes, shares, n_expert):
    best = -1.0
    layers = sorted(sizes)
    for combo in itertools.product(range(n_expert + 1), repeat=len(layers)):
        if sum(s * sizes[l] for s, l in zip(combo, layers)) <= budget:
            best = max(best, sum(shares[l][:s].sum() for s, l in zip(combo, layers)))
    return best


@pytest.mark.parametrize("seed", range(8))
def test_plan_is_optimal_for_equal_sizes(seed):
    rng = np.random.default_rng(seed)
    n_expert, layers = 5, [0, 1, 2]
    profile = {l: rng.exponential(1.0, n_expert) ** 3 for l in layers}
    sizes = {l: 100 for l in layers}
    budget = int(rng.integers(0, 1600))
    slots = plan_slots(budget, sizes, n_expert, profile)
    assert sum(slots[l] * sizes[l] for l in layers) <= budget
    shares = {l: np.sort(profile[l])[::-1] / profile[l].sum() for l in layers}
    got = sum(shares[l][:slots[l]].sum() for l in layers)
    assert got == pytest.approx(brute_force(budget, sizes, shares, n_expert))


def test_plan_without_profile_and_mixed_sizes():
    slots = plan_slots(1000, {0: 100, 1: 100, 2: 50}, 8)
    assert slots == {0: 4, 1: 4, 2: 4}
    slots = plan_slots(1099, {0: 100, 1: 100, 2: 50}, 8)        # 99 left: one more slot of the 50-byte layer
    assert slots == {0: 4, 1: 4, 2: 5}
    assert plan_slots(10**9, {0: 10, 1: 20}, 8) == {0: 8, 1: 8}
    rng = np.random.default_rng(1)
    sizes = {0: 70, 1: 100, 2: 130}
    profile = {l: rng.exponential(1.0, 6) for l in sizes}
    slots = plan_slots(700, sizes, 6, profile)
    assert sum(slots[l] * sizes[l] for l in sizes) <= 700 and max(slots.values()) <= 6
    with pytest.raises(FleError, match="layer"):
        plan_slots(700, sizes, 6, {0: profile[0]})
    with pytest.raises(FleError):
        plan_slots(-1, sizes, 6)


def test_profiles(tmp_path):
    a = make_model(tmp_path / "a.gguf", "qwen3moe", seed=0)
    b = make_model(tmp_path / "b.gguf", "qwen3moe", seed=0, expert_count=16)
    fa, fb = model_fingerprint(a), model_fingerprint(b)
    assert fa != fb and fa == model_fingerprint(a)
    p = Profile(fa, {0: np.arange(8.0), 1: np.ones(8)})
    save_profile(tmp_path / "p.json", p)
    q = load_profile(tmp_path / "p.json", fa)
    assert q.fingerprint == fa and np.array_equal(q.counts[0], np.arange(8.0))
    with pytest.raises(FleError, match="another model"):
        load_profile(tmp_path / "p.json", fb)
    (tmp_path / "bad.json").write_text(json.dumps({"format": "fle.cache-profile/1", "layers": {"0": [-1]}}))
    with pytest.raises(FleError, match="counts"):
        load_profile(tmp_path / "bad.json")
    with pytest.raises(FleError, match="no such file"):
        load_profile(tmp_path / "none.json")
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"word{i % 37}" for i in range(400)))
    from fle_quant.scoring import score

    table = score(a, text, method="frequency", n_tokens=64, ctx=32)
    prof = profile_from_scores(table, fa)
    assert sorted(prof.counts) == [0, 1, 2, 3] and prof.fingerprint == fa
    assert np.allclose(prof.counts[0], table["layers"]["0"])
    with pytest.raises(FleError, match="frequency"):
        profile_from_scores(score(a, text, method="man", n_tokens=64, ctx=32), fa)


def test_simulate():
    rng = np.random.default_rng(0)
    n_expert = 16
    p = rng.dirichlet(np.full(n_expert, 0.2))
    trace = {l: np.stack([rng.choice(n_expert, 2, replace=False, p=p) for _ in range(300)]) for l in range(3)}
    full = simulate(trace, warm_caches({l: n_expert for l in range(3)}, n_expert, CachePolicy(), {l: p for l in range(3)}))
    assert full.hit_rate == 1.0 and full.misses_per_step == 0
    none = simulate(trace, warm_caches({l: 0 for l in range(3)}, n_expert, CachePolicy()))
    assert none.hit_rate == 0.0 and none.misses_per_step == 6
    cold = simulate({l: t[:40] for l, t in trace.items()}, warm_caches({l: 4 for l in range(3)}, n_expert, CachePolicy()))
    warm = simulate({l: t[:40] for l, t in trace.items()},
                    warm_caches({l: 4 for l in range(3)}, n_expert, CachePolicy(), {l: p for l in range(3)}))
    assert warm.hit_rate > cold.hit_rate


def test_synthetic_traces():
    from fle_engine.expert_cache.traces import fit_trace, hit_curve, synthetic_trace

    t = synthetic_trace(32, 4, 200, zipf=1.0, keep=0.0, layers=2, seed=1)
    assert set(t) == {0, 1} and t[0].shape == (200, 4)
    assert all(len(set(row)) == 4 for row in t[0])                 # no expert twice in a step
    counts = np.bincount(t[0].reshape(-1), minlength=32)
    assert counts.max() > 4 * np.median(counts)                    # popular experts exist
    still = synthetic_trace(32, 4, 50, zipf=1.0, keep=1.0)[0]
    assert (still == still[0]).all()                                # keep everything: the same experts
    rates = hit_curve(t, 32, [4, 8, 16])
    assert rates[0] < rates[1] < rates[2]
    # the fit returns the grid point nearest the curve
    curve = {8: 0.6, 16: 0.8}
    z, r, got = fit_trace(curve, n_expert=32, k=4, steps=300, zipfs=(0.5, 1.5), keeps=(0.0, 0.5))
    errs = {}
    for zz in (0.5, 1.5):
        for rr in (0.0, 0.5):
            g = hit_curve(synthetic_trace(32, 4, 300, zz, rr), 32, [8, 16])
            errs[(zz, rr)] = (g[0] - 0.6) ** 2 + (g[1] - 0.8) ** 2
    assert (z, r) == min(errs, key=errs.get)
