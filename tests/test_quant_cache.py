"""The quantized expert cache (fle_engine.quant_cache): slots holding GGUF
bytes on the device, misses read from host memory by the same kernels, no
host sync inside a step. Outputs equal the model without a cache, the hits
equal the policy simulated on the same trace; the Triton kernels run in
Triton's interpreter on the CPU (TRITON_INTERPRET=1 before triton is
imported), the reference kernels everywhere."""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fle_engine  # noqa: E402
from fle_engine.expert_cache import CachePolicy, simulate, trace_from_capture, warm_caches  # noqa: E402
from fle_engine.quant_cache import attach_quant_cache  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402

N = 8
POLICY = CachePolicy(halve_every=50, evict_oldest=2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    # IQ4_XS experts (a type with a fast kernel), small widths: the interpreter is slow
    path = make_model(tmp_path_factory.mktemp("qc") / "m.gguf", "qwen3moe", seed=1,
                      mix=[(r"_exps\.weight$", "IQ4_XS"), (r"ffn_gate_inp", "F32"), (r".", "Q8_0")],
                      routing_skew=1.0, block_count=2)
    ref = fle_engine.load(path, experts="resident")
    toks = np.random.default_rng(2).integers(0, ref.n_vocab, N).tolist()
    st = ref.new_state(N)
    want = np.concatenate([ref.forward([t], st).numpy() for t in toks])
    with ref.capturing() as cap:
        ref.logits(toks)
    return path, toks, want, trace_from_capture(cap)


# the interpreter runs each launch in NumPy: one mixed case for the Triton kernels
@pytest.mark.parametrize("impl,slots", [("reference", 0), ("reference", 3), ("triton", 3)])
def test_quant_cache_outputs_and_hits(setup, impl, slots):
    if impl == "triton":
        pytest.importorskip("triton")
    path, toks, want, trace = setup
    n = 4 if impl == "triton" else N
    toks, want, trace = toks[:n], want[:n], {l: t[:n] for l, t in trace.items()}
    m = fle_engine.load(path, experts="stream")
    stores = attach_quant_cache(m, slots=slots, policy=POLICY, impl=impl)
    st = m.new_state(n)
    got = np.concatenate([m.forward([t], st).numpy() for t in toks])
    for s in stores.values():
        s.update()                      # the last step's policy decision
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    sim = simulate(trace, warm_caches({l: slots for l in trace}, 8, POLICY))
    for l in trace:
        assert (stores[l].hits, stores[l].requests, stores[l].admissions) == \
            (sim.hits[l], sim.requests[l], sim.admissions[l]), l
    if slots:
        # both sources served rows: slots (hits) and host memory (misses)
        assert 0 < sum(s.hits for s in stores.values()) < sum(s.requests for s in stores.values())
        assert all(s.cache.cached().size > 0 for s in stores.values())
        cached = stores[0].cache.cached()
        e = int(cached[0])
        # a slot holds exactly the expert's GGUF bytes
        assert torch.equal(stores[0].slots[0][int(stores[0].cache.slot_of[e])],
                           torch.from_numpy(np.array(stores[0].mats[0].raw[e])))


def test_needs_streamed_experts(setup):
    path = setup[0]
    with pytest.raises(FleError, match="stream"):
        attach_quant_cache(fle_engine.load(path, experts="resident"), slots=2)
