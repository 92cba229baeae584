"""The prefetch of predicted misses (``--miss-prefetch``, runtime.stage):
its three operations against their references, the cache's layout of the
prefetch rows, and the engine's greedy tokens and logits with prefetch
against the same engine without it, for the three architectures.

Without CUDA the engine runs the reference operations (the copy in place,
no streams) and the Triton kernels run in Triton's interpreter; with CUDA
the same tests run the compiled kernels inside the captured step, the copy
on its own stream.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fle_engine.kernels import engine_ops  # noqa: E402
from fle_engine.runtime import Engine  # noqa: E402
from fle_engine.runtime.cache import ExpertCache  # noqa: E402
from fle_engine.runtime.weights import ExpertLayout, HostExperts  # noqa: E402
from fle_quant.ggml_types import GGMLType  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("exact_float32")
DEVICE = torch.device("cuda" if CUDA else "cpu")
PROMPT = [1, 17, 42, 99, 5, 7]


def _te():
    from fle_engine.kernels import triton_engine

    return triton_engine


# the operations ------------------------------------------------------------------------
@pytest.mark.parametrize("seed,n_exp,k,r", [(0, 40, 6, 3), (1, 40, 6, 3), (2, 40, 6, 3), (3, 128, 32, 6)])
def test_stage_pick_takes_the_first_missing_experts_of_the_top_k(seed, n_exp, k, r):
    """One row's top K (K: the routed count), or a T-row step's top T x K of the rows' highest logits."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_exp, generator=g)
    logits[5] = logits[9]                             # a tie: the lower id first
    slot_of = torch.where(torch.rand(n_exp, generator=g) < 0.5, 0, -1).to(torch.int32)
    want = torch.empty(r, dtype=torch.int32)
    engine_ops.stage_pick_ref(logits, slot_of, k, want)
    top = np.argsort(-logits.numpy(), kind="stable")[:k]
    miss = [int(e) for e in top if slot_of[e] < 0][:r]
    assert want.tolist() == miss + [-1] * (r - len(miss))
    got = torch.full((r,), 7, dtype=torch.int32, device=DEVICE)
    _te().stage_pick(logits.to(DEVICE), slot_of.to(DEVICE), k, got)
    assert got.cpu().tolist() == want.tolist()


def test_stage_copy_moves_the_experts_bytes_into_the_prefetch_slots():
    g = torch.Generator().manual_seed(3)
    n_exp, ew, slots, r = 6, 5000, 4, 2          # more words than one chunk
    host = torch.randint(-2**31, 2**31 - 1, (n_exp, ew), dtype=torch.int32, generator=g)
    host_dev = host.pin_memory() if CUDA else host
    words = torch.zeros((slots + r) * ew, dtype=torch.int32, device=DEVICE)
    stage = torch.tensor([4, -1], dtype=torch.int32, device=DEVICE)
    delta = (host_dev.data_ptr() - words.data_ptr()) // 4
    _te().stage_copy(words, delta, ew, stage, slots)
    rows = words.view(slots + r, ew).cpu()
    assert torch.equal(rows[slots], host[4])
    assert not rows[slots + 1].any() and not rows[:slots].any()
    # the reference on byte rows
    store = engine_ops.ExpertWords(torch.zeros(slots + r, ew * 4, dtype=torch.uint8), host.view(torch.uint8), 4)
    engine_ops.stage_copy_ref(store, 0, 0, stage.cpu(), slots)
    assert torch.equal(store.slots[slots], host.view(torch.uint8)[4])


def test_stage_apply_switches_this_layers_entries_in_and_the_previous_ones_out():
    n_exp, r = 16, 3
    for side in ("ref", "fast"):
        dev = torch.device("cpu") if side == "ref" else DEVICE
        prev_map = torch.full((n_exp,), -1, dtype=torch.int32, device=dev)
        prev_map[[2, 4]] = torch.tensor([20, 21], dtype=torch.int32, device=dev)   # prefetched last layer
        prev_map[7] = 3                                                               # a cached expert stays
        prev_stage = torch.tensor([2, 4, -1], dtype=torch.int32, device=dev)
        cur_map = torch.full((n_exp,), -1, dtype=torch.int32, device=dev)
        cur_map[1] = 0
        stage = torch.tensor([5, -1, 11], dtype=torch.int32, device=dev)
        ids = torch.tensor([1, 5, 9, 12], dtype=torch.int64, device=dev)
        counts = torch.zeros(2, dtype=torch.int64, device=dev)
        op = engine_ops.stage_apply_ref if side == "ref" else _te().stage_apply
        op(prev_map, prev_stage, cur_map, stage, ids, counts, 30)
        pm, cm = prev_map.cpu().tolist(), cur_map.cpu().tolist()
        assert pm[2] == pm[4] == -1 and pm[7] == 3
        assert cm[5] == 30 and cm[11] == 32 and cm[1] == 0 and sum(v >= 0 for v in cm) == 3
        assert counts.cpu().tolist() == [2, 1]                     # two put in, expert 5 routed
        op(cur_map, stage, None, None, None, counts, 0)            # after the last layer: out only
        assert cur_map.cpu().tolist() == [-1, 0] + [-1] * (n_exp - 2)
        assert counts.cpu().tolist() == [2, 1]


# the cache's layout --------------------------------------------------------------------
@pytest.mark.parametrize("widths", [(256, 256, 256), (256, 512, 256, 256)])
def test_prefetch_rows_take_their_bytes_from_the_budget_and_overlap_nothing(widths):
    n_exp, rows = 8, 2
    lays = {il: ExpertLayout.of(f, 256, GGMLType.IQ4_XS, GGMLType.IQ4_XS) for il, f in enumerate(widths)}
    sizes = [lay.expert_bytes for lay in lays.values()]
    host = HostExperts(lays, n_exp, pin=False)
    budget = 3 * sum(sizes)
    plain = ExpertCache(lays, host, n_exp, budget, torch.device("cpu"))
    c = ExpertCache(lays, host, n_exp, budget, torch.device("cpu"), stage_rows=rows)
    assert c.budget_used + c.stage_nbytes <= budget
    assert c.stage_nbytes > 0 and c.budget_used <= plain.budget_used
    spans = []
    for l in c.layers:
        eb = lays[l].expert_bytes
        spans.append((c.region[l], c.region[l] + c.slots_per_layer[l] * eb, f"slots {l}"))
        for first in set(c.stage_first[l]):
            assert first >= c.slots_per_layer[l]
            lo = c.region[l] + first * eb
            spans.append((lo, lo + rows * eb, f"stage {first} of {l}"))
            assert lo + rows * eb <= c.nbytes
        view = c.stage_view(l)
        assert view.shape[0] >= max(c.stage_first[l]) + rows
    # slots never overlap anything; a shared prefetch buffer is the same bytes for its layers
    uniq = sorted({(lo, hi) for lo, hi, _ in spans})
    for (a0, a1), (b0, b1) in zip(uniq, uniq[1:]):
        assert a1 <= b0, (a0, a1, b0, b1)
    common = [l for l in c.layers if lays[l].expert_bytes == c.stage_size]
    for a, b in zip(common, common[1:]):
        ea = c.region[a] + c.stage_first[a][0] * c.stage_size
        eb_ = c.region[b] + c.stage_first[b][0] * c.stage_size
        assert ea == eb_


# the engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("prefetch")
    return {"qwen3moe": make_model(d / "m.gguf", "qwen3moe", seed=3, mix="release", routing_skew=1.0),
            "qwen3next": make_model(d / "n.gguf", "qwen3next", seed=4, mix="release", routing_skew=1.0),
            "qwen4exp": make_model(d / "q.gguf", "qwen4exp", seed=5, mix="release", routing_skew=1.0)}


def _engine(path, per_layer=2, **kw):
    probe = Engine(path, device=DEVICE, cache_budget=0, ctx_size=16, profile_path="none", progress=False,
                   log=lambda m: None)
    eb = sum(lay.expert_bytes for lay in probe.net.layouts.values())
    probe.close()
    return Engine(path, device=DEVICE, cache_budget=per_layer * eb, ctx_size=64, cache_type_k="f32",
                  cache_type_v="f32", profile_path="none", progress=False, log=lambda m: None, **kw)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next", "qwen4exp"])
def test_prefetch_leaves_tokens_and_logits_bit_equal(files, arch):
    n = 24
    with _engine(files[arch]) as e0:
        want = e0.generate(PROMPT, n)
        want_logits = e0.state.bufs.logits.cpu().clone()
        assert e0.prefetch is None
    # the prefetch rows take two experts' bytes of a layer (two shared buffers of two rows each), so that
    # budget leaves three slots a layer: hits, prefetched misses and plain misses in one run
    with _engine(files[arch], per_layer=4, miss_prefetch=2) as e1:
        assert all(0 < s < e1.args.n_expert for s in e1.cache.slots_per_layer.values())
        got = e1.generate(PROMPT, n)
        got_logits = e1.state.bufs.logits.cpu().clone()
        d = e1.prefetch.summary(e1.cache.stats.steps)
        assert 0 < e1.cache.stats.hit_rate < 1
        # the map holds no prefetch entry between steps
        assert torch.equal(e1.cache.map.cpu(), torch.from_numpy(e1.cache.mirror))
    assert got == want
    assert torch.equal(got_logits, want_logits)
    assert d["copied"] > 0 and 0 <= d["used"] <= d["copied"]


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next", "qwen4exp"])
def test_prefetch_in_t_row_steps_is_bit_equal(files, arch):
    """The verify step (T = 1 + 3 tokens) and a prompt's T-row steps
    prefetch the next layer's predicted misses of all their rows: the same
    tokens and logits, bit for bit, as without prefetch, and the step copies
    experts ahead that its layers use."""
    drafts = [300, 12, 77]

    def run(eng):
        first = eng.generate(PROMPT, 1)                 # the prompt in T-row steps (--prompt-rows 4)
        before = eng.prefetch.summary(1)["copied"] if eng.prefetch is not None else 0
        out = eng.verify_step(first + drafts)
        copied = eng.prefetch.summary(1)["copied"] - before if eng.prefetch is not None else 0
        return first + out, eng.state.multi.logits[:4].float().cpu().clone(), copied

    with _engine(files[arch], per_layer=6) as e0:
        assert e0.prompt_rows > 1
        want, want_logits, _ = run(e0)
    with _engine(files[arch], per_layer=6, miss_prefetch=2) as e1:
        assert all(0 < s < e1.args.n_expert for s in e1.cache.slots_per_layer.values())
        got, got_logits, copied = run(e1)
        d = e1.prefetch.summary(e1.cache.stats.steps)
        assert torch.equal(e1.cache.map.cpu(), torch.from_numpy(e1.cache.mirror))   # no prefetch entry left
    assert got == want
    assert torch.equal(got_logits, want_logits)
    assert copied > 0 and 0 < d["used"] <= d["copied"]


def test_prefetch_with_misses_on_the_cpu_gives_the_same_tokens(files):
    """The CPU's share follows the map after the prefetched experts are put
    in (they are read by the GPU); the wait of the last layer reads the
    same map as its post."""
    n = 24
    kw = dict(miss_split="0.5", miss_activations="q8", cpu_impl="reference")
    with _engine(files["qwen3moe"], per_layer=4, **kw) as e0:
        want = e0.generate(PROMPT, n)
        want_logits = e0.state.bufs.logits.cpu().clone()
    with _engine(files["qwen3moe"], per_layer=4, miss_prefetch=2, **kw) as e1:
        got = e1.generate(PROMPT, n)
        got_logits = e1.state.bufs.logits.cpu().clone()
        assert e1.split is not None and e1.split.cpu_experts > 0
        assert e1.prefetch.summary(e1.cache.stats.steps)["used"] > 0
    assert got == want
    # a prefetched expert multiplies the float activations (as hits do), the CPU its rounding of them
    # (ggml's vec_dot_type): which experts the CPU computes differs, so the logits agree to that rounding
    scale = float(want_logits.abs().max())
    assert float((got_logits - want_logits).abs().max()) <= 1e-2 * scale


def test_prefetch_is_refused_with_several_sequences(files):
    from fle_quant.errors import FleError

    with pytest.raises(FleError, match="--miss-prefetch runs on one sequence"):
        _engine(files["qwen3moe"], miss_prefetch=1, n_seq=2)
