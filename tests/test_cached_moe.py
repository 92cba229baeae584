"""The expert cache applied to a model (fle_engine.cached_moe): outputs
equal the model's without a cache for any slot count, hits and admissions
equal the policy simulated on the same routing trace, the byte budget is
kept, and a profile warms the slots."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fle_engine  # noqa: E402
from fle_engine.cached_moe import attach_expert_cache, detach_expert_cache  # noqa: E402
from fle_engine.expert_cache import CachePolicy, simulate, trace_from_capture, warm_caches  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402

N = 48


@pytest.fixture(scope="module", params=["qwen3moe", "qwen3next", "qwen4exp"])
def setup(request, tmp_path_factory):
    arch = request.param
    path = make_model(tmp_path_factory.mktemp(arch) / "m.gguf", arch, seed=1, mix="release", routing_skew=1.0)
    ref = fle_engine.load(path, experts="resident")
    toks = np.random.default_rng(2).integers(0, ref.n_vocab, N).tolist()
    st = ref.new_state(N)
    want = np.concatenate([ref.forward([t], st).numpy() for t in toks])
    with ref.capturing() as cap:
        ref.logits(toks)
    return path, toks, want, trace_from_capture(cap)


def decode(model, toks):
    st = model.new_state(len(toks))
    return np.concatenate([model.forward([t], st).numpy() for t in toks])


@pytest.mark.parametrize("slots", [0, 3, 8])
def test_outputs_and_hits(setup, slots):
    path, toks, want, trace = setup
    m = fle_engine.load(path, experts="stream")
    stores = attach_expert_cache(m, slots=slots, policy=CachePolicy(halve_every=50, evict_oldest=2))
    got = decode(m, toks)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    sim = simulate(trace, warm_caches({l: slots for l in trace}, 8, CachePolicy(halve_every=50, evict_oldest=2)))
    for l in trace:
        assert stores[l].stats.hits == sim.hits[l] and stores[l].stats.admissions == sim.admissions[l], l
        assert stores[l].stats.requests == sim.requests[l]
    if slots == 8:
        assert all(stores[l].stats.admissions <= 8 for l in trace)
    assert all(stores[l].stats.tokens == stores[l].stats.steps == len(toks) for l in trace)
    # a prefill call goes through the stores too: one step of 20 tokens
    assert np.abs(m.logits(toks[:20]) - want[:20]).max() <= 1e-4 * np.abs(want).max()
    assert all(stores[l].stats.tokens == stores[l].stats.steps + 19 for l in trace)
    detach_expert_cache(m)
    assert all(mo.store is None for mo in m.net.modules() if hasattr(mo, "store"))


def test_budget_and_warm_start(setup):
    path, toks, want, trace = setup
    m = fle_engine.load(path, experts="stream")
    profile = {l: np.bincount(t.reshape(-1), minlength=8).astype(float) for l, t in trace.items()}
    for l in {mo.layer for mo in m.net.modules() if hasattr(mo, "store")} - profile.keys():
        profile[l] = np.ones(8)          # a layer the trace does not reach (an MTP block)
    one = attach_expert_cache(m, slots=1)[0].expert_bytes
    detach_expert_cache(m)
    budget = 10 * one + one // 2
    stores = attach_expert_cache(m, budget_bytes=budget, profile=profile)
    assert sum(s.cache.n_slots * one for s in stores.values()) <= budget
    assert sum(s.cache.n_slots for s in stores.values()) == 10
    for l, s in stores.items():
        top = np.argsort(-profile[l], kind="stable")[: s.cache.n_slots]
        assert sorted(s.cache.cached().tolist()) == sorted(top.tolist())
    got = decode(m, toks)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    with pytest.raises(FleError, match="either"):
        attach_expert_cache(m, slots=2, budget_bytes=100)
    resident_gpu_like = fle_engine.load(path, experts="resident")
    attach_expert_cache(resident_gpu_like, slots=2)     # experts on the CPU: allowed
