"""Prefill on the engine (fle_engine.runtime.prefill): prompts processed in
micro-batches, the routed experts streamed into staging memory lent from
the expert cache, products of many rows by the tensor-core GEMM kernel.

Without CUDA the same prefill runs with the reference operations (and the
GEMM kernel in Triton's interpreter against its reference); with CUDA the
compiled kernels and the copy stream.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fle_engine import load  # noqa: E402
from fle_engine.kernels import engine_ops  # noqa: E402
from fle_engine.runtime import Engine  # noqa: E402
from fle_engine.runtime.prefill import PrefillStats, grouped_mm, sort_by_expert  # noqa: E402
from fle_quant.ggml_types import GGMLType  # noqa: E402
from fle_quant.quants import quantize  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("exact_float32")
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _close(a, b, tol):
    scale = float(b.abs().max()) or 1.0
    err = float((a - b).abs().max()) / scale
    assert err <= tol, err


@pytest.fixture(scope="module")
def fast():
    pytest.importorskip("triton")
    return engine_ops.pick("triton", DEVICE)


try:
    import triton
    import triton.language as tl

    from fle_engine.kernels.triton_quant import _value_index

    @triton.jit
    def _idx(out_ptr, QTYPE: tl.constexpr, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
        a = tl.arange(0, A)[:, None, None]
        b = tl.arange(0, B)[None, :, None]
        c = tl.arange(0, C)[None, None, :]
        tl.store(out_ptr + (a * B + b) * C + c, _value_index(QTYPE, A, B, C))
except ImportError:     # the fast fixture skips these tests
    _idx = None


def test_chunk_order_is_the_decoders_value_index(fast):
    """engine_ops.chunk_order (numpy) against triton_quant._value_index for
    every fast type."""
    from fle_engine.kernels.triton_quant import _FORMATS

    for qt, fmt in _FORMATS.items():
        out = torch.zeros(256, dtype=torch.int32, device=DEVICE)
        _idx[(1,)](out, QTYPE=int(qt), A=fmt.tile[0], B=fmt.tile[1], C=fmt.tile[2])
        assert out.cpu().tolist() == engine_ops.chunk_order(qt).tolist(), qt


def test_sort_by_expert_and_grouped_mm():
    ids = torch.tensor([[3, 1], [1, 0], [3, 2], [1, 3]], dtype=torch.int64)
    order, ends = sort_by_expert(ids, n_expert=5)
    assert order.tolist() == [3, 1, 2, 6, 5, 0, 4, 7] and ends.tolist() == [1, 4, 5, 8, 8]
    x = torch.randn(8, 16)
    w = torch.randn(5, 4, 16)
    y = grouped_mm(x, w, ends)
    e_of = ids.reshape(-1)[order]
    for r in range(8):
        _close(y[r], x[r] @ w[int(e_of[r])].T, 1e-5)


@pytest.mark.parametrize("qtype", [GGMLType.IQ4_XS, GGMLType.Q8_0, GGMLType.Q6_K, GGMLType.IQ3_S, GGMLType.IQ4_NL])
def test_dequant_kernel(fast, qtype):
    """Matrices at word offsets of two buffers (one below the other's address
    or above it) decoded as the reference decodes them."""
    rng = np.random.default_rng(int(qtype))
    n_rows, n_in = 40, 512
    a = quantize(rng.standard_normal((3 * n_rows, n_in)).astype(np.float32), qtype)
    b = quantize(rng.standard_normal((n_rows, n_in)).astype(np.float32), qtype)
    rb = a.shape[-1]
    w = engine_ops.WORDS[qtype].itemsize
    ta = torch.from_numpy(a.reshape(-1).copy()).to(DEVICE)
    tb = torch.from_numpy(b.reshape(-1).copy()).to(DEVICE)
    space = engine_ops.WordSpace(ta, tb)
    base = torch.tensor([2 * n_rows * rb // w, space.offset(tb) // w, 0], dtype=torch.int64, device=DEVICE)
    out = torch.zeros(3, n_rows, n_in, device=DEVICE)
    fast.dequant(space, qtype, base, n_rows, rb, out)
    ref = torch.zeros(3, n_rows, n_in)
    engine_ops.REFERENCE.dequant(space, qtype, base.cpu(),
                                 n_rows, rb, ref)
    assert torch.equal(out.cpu(), ref)
    from fle_engine.kernels.reference import dequantize_weights

    assert torch.equal(ref[1], dequantize_weights(torch.from_numpy(b), qtype))
    assert torch.equal(ref[0], dequantize_weights(torch.from_numpy(a[2 * n_rows:]), qtype))
    if CUDA:
        half = torch.zeros(3, n_rows, n_in, dtype=torch.bfloat16, device=DEVICE)
        fast.dequant(space, qtype, base, n_rows, rb, half)
        assert torch.equal(half.cpu(), ref.to(torch.bfloat16))
    # tile order: the columns permuted within each chunk, as tile_columns says, on both sides
    tiled = torch.zeros(3, n_rows, n_in, device=DEVICE)
    fast.dequant(space, qtype, base, n_rows, rb, tiled, tile_order=True)
    cols = engine_ops.tile_columns(qtype, n_in, "cpu")
    assert sorted(cols.tolist()) == list(range(n_in))
    assert torch.equal(tiled.cpu(), ref[:, :, cols])
    ref_t = torch.zeros(3, n_rows, n_in)
    engine_ops.REFERENCE.dequant(space, qtype, base.cpu(), n_rows, rb, ref_t, tile_order=True)
    assert torch.equal(ref_t, tiled.cpu())


def test_prefill_stats_line():
    """The one line the CLI prints after a prefill: tokens, micro-batches,
    time, speed, bytes streamed (decimal GB) and the compute stream's wait
    for copies; no division by zero before a run."""
    st = PrefillStats(tokens=8192, seconds=4.0, ubatches=2, bytes_copied=11_020_000_000, copy_wait_seconds=0.125,
                      lent_layers=[46, 47])
    assert st.line() == ("prefill: 8192 tokens in 2 micro-batches, 4000.0 ms (2048.0 tok/s); experts streamed "
                         "11.02 GB, compute waiting for copies 125.0 ms")
    assert PrefillStats().line() == ("prefill: 0 tokens in 0 micro-batches, 0.0 ms (0.0 tok/s); experts streamed "
                                     "0.00 GB, compute waiting for copies 0.0 ms")


# ---------------------------------------------------------------------------
# prefill on the engine against decode steps


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("prefill") / "m.gguf", "qwen3moe", seed=3, mix="release",
                      routing_skew=1.0)


def _engine(path, slots, ubatch=16, bf16=False, **kw):
    probe = Engine(path, device=DEVICE, cache_budget=0, ctx_size=64, profile_path="none", progress=False,
                   log=lambda m: None, graphs=False)
    per_layer = sum(l.expert_bytes for l in probe.net.layouts.values()) // probe.args.n_layer
    n_layer = probe.args.n_layer
    probe.close()
    kw.setdefault("cache_type_k", "f32")
    kw.setdefault("cache_type_v", "f32")
    eng = Engine(path, device=DEVICE, cache_budget=slots * per_layer * n_layer, ctx_size=160, profile_path="none",
                 progress=False, log=lambda m: None, ubatch=ubatch, prefill_min=1, **kw)
    if eng.prefill is not None:
        eng.prefill.bf16 = bf16              # float32 products: the comparison with decode steps is exact
    return eng


def _logits_kld(p_logits, q_logits):
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


@pytest.mark.parametrize("slots", [2, 8])
def test_prefill_equals_decode_steps(model_file, slots):
    """A 40-token prompt in micro-batches of 16 (three: the later ones attend
    to the cache before them) gives the logits and greedy tokens of the same
    prompt fed as decode steps; the expert cache is as before it."""
    prompt = [int(t) for t in np.random.default_rng(5).integers(1, 200, 40)]
    steps = _engine(model_file, slots, ubatch=0)
    assert steps.prefill is None
    steps.generate(prompt, 1)
    want_logits = steps.state.bufs.logits[0].cpu().clone()
    want = steps.generate(prompt, 24)
    steps.close()

    eng = _engine(model_file, slots)
    got_first = eng.generate(prompt, 1)
    got_logits = eng.state.bufs.logits[0].cpu().clone()
    st = eng.prefill.stats
    assert st.tokens == 40 and st.ubatches == 3
    uncached = sum(int((eng.cache.mirror[i] < 0).sum()) if l not in st.lent_layers else eng.args.n_expert
                   for i, l in enumerate(eng.cache.layers))
    per_expert = [eng.cache.layouts[l].expert_bytes for l in eng.cache.layers]
    assert st.bytes_copied == 3 * sum(
        (eng.args.n_expert if l in st.lent_layers else int((eng.cache.mirror[i] < 0).sum())) * per_expert[i]
        for i, l in enumerate(eng.cache.layers))
    assert uncached > 0 or slots == eng.args.n_expert
    assert _logits_kld(want_logits, got_logits) < 1e-9
    got = eng.generate(prompt, 24)
    assert got_first == want[:1] and got == want
    assert eng.stats.prompt_tokens == 41 and eng.cached_tokens == 39      # the second call kept the prompt
    # the slots that hold experts are as before a prefill (the lent ones copied back)
    before = eng.cache.slots.cpu().clone()
    eng.prefill.run(prompt[:20], 0)
    after = eng.cache.slots.cpu()
    held = 0
    for i, l in enumerate(eng.cache.layers):
        for s, e in enumerate(eng.cache.expert_in[i].tolist()):
            if e >= 0:
                eb = eng.cache.layouts[l].expert_bytes
                o = eng.cache.region[l] + s * eb
                assert after[o:o + eb].equal(before[o:o + eb])
                held += 1
    assert held
    eng.close()


def test_prefill_lends_from_the_cache(model_file):
    """With room in the slot buffer the staging ring is the back of it (those
    layers count as uncached for the prefill); with little room, its own."""
    eng = _engine(model_file, 8)
    from fle_engine.runtime.prefill import Staging

    stg = Staging(eng.cache)
    assert stg.own is None and stg.lent_layers and stg.nbytes_lent() == 2 * stg.size
    assert stg.lent_layers == sorted(stg.lent_layers) and stg.lent_layers[-1] == eng.cache.layers[-1]
    eng.close()
    small = _engine(model_file, 1)
    stg = Staging(small.cache)
    if small.cache.nbytes < 2 * stg.size:
        assert stg.own is not None and not stg.lent_layers
    small.close()


def test_qwen3next_prefill_equals_decode_steps(tmp_path):
    """GDN layers (the recurrence token by token inside the prefill, the
    projections batched), gated attention with partial rotary, the gated
    shared expert: a 24-token prompt in micro-batches of 10 gives the
    logits and greedy tokens of decode steps, and a second prompt starts
    from a clean recurrent state."""
    path = make_model(tmp_path / "n.gguf", "qwen3next", seed=4, mix="release", routing_skew=1.0)
    prompt = [int(t) for t in np.random.default_rng(7).integers(1, 200, 24)]
    steps = _engine(path, 2, ubatch=0)
    steps.generate(prompt, 1)
    want_logits = steps.state.bufs.logits[0].cpu().clone()
    want = steps.generate(prompt, 12)
    want2 = steps.generate(prompt[::-1], 6)
    steps.close()
    eng = _engine(path, 2, ubatch=10)
    assert eng.prefill is not None
    eng.generate(prompt, 1)
    assert eng.prefill.stats.ubatches == 3
    assert _logits_kld(want_logits, eng.state.bufs.logits[0].cpu()) < 1e-9
    assert eng.generate(prompt, 12) == want
    assert eng.generate(prompt[::-1], 6) == want2
    eng.close()


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory):
    """qwen4exp: 3 GDN layers (one with PLE), a QSA layer keeping 4 blocks of
    4 positions (from position 16 on blocks are dropped), 4 HC streams."""
    return make_model(tmp_path_factory.mktemp("prefill_q4") / "q.gguf", "qwen4exp", seed=4, mix="release",
                      routing_skew=1.0)


def test_qwen4exp_prefill_equals_decode_steps(q4_file):
    """The hyper-connection streams on every row, the PLE rows of every
    token (its history carried across micro-batches), GDN token by token,
    QSA with each query's own block set (blocks completing inside and
    across micro-batches, past the indexer's start): a 40-token prompt in
    micro-batches of 16 gives the logits and greedy tokens of decode steps;
    a second prompt starts from a clean state; a prompt extending the last
    sequence prefills only its new tokens, from that position."""
    rng = np.random.default_rng(7)
    prompt = [int(t) for t in rng.integers(1, 200, 40)]
    new = [int(t) for t in rng.integers(1, 200, 20)]
    steps = _engine(q4_file, 2, ubatch=0)
    assert steps.prefill is None
    steps.generate(prompt, 1)
    want_logits = steps.state.bufs.logits[0].cpu().clone()
    want = steps.generate(prompt, 12)
    rev = prompt[::-1]
    want2 = steps.generate(rev, 6)
    ext = rev + want2[:-1] + new
    want3 = steps.generate(ext, 6)
    steps.close()
    eng = _engine(q4_file, 2, ubatch=16)
    assert eng.prefill is not None
    eng.generate(prompt, 1)
    assert eng.prefill.stats.ubatches == 3
    assert _logits_kld(want_logits, eng.state.bufs.logits[0].cpu()) < 1e-9
    assert eng.generate(prompt, 12) == want
    assert eng.generate(rev, 6) == want2
    assert eng.generate(ext, 6) == want3
    assert eng.cached_tokens == len(rev) + len(want2) - 1 and eng.prefill.stats.tokens == len(new)
    eng.close()


def test_qwen4exp_prefill_comparison_sees_the_block_mask(q4_file, monkeypatch):
    """The comparison above fails when the prefill's QSA attends causally
    without the indexer's block mask."""
    from fle_engine.runtime import qwen4exp as q4rt

    prompt = [int(t) for t in np.random.default_rng(7).integers(1, 200, 40)]
    steps = _engine(q4_file, 2, ubatch=0)
    steps.generate(prompt, 1)
    want_logits = steps.state.bufs.logits[0].cpu().clone()
    steps.close()
    real = q4rt.Net.prefill_keep

    def causal(self, il, xn, pos0, state, ops):
        real(self, il, xn, pos0, state, ops)           # the indexer keys written, the mask dropped
        return None

    monkeypatch.setattr(q4rt.Net, "prefill_keep", causal)
    eng = _engine(q4_file, 2, ubatch=16)
    eng.generate(prompt, 1)
    assert _logits_kld(want_logits, eng.state.bufs.logits[0].cpu()) > 1e-4
    eng.close()


@pytest.mark.skipif(not CUDA, reason="bfloat16 tensor-core products need CUDA")
def test_prefill_bf16_close_to_float32(model_file):
    """The product path (bfloat16 inputs on tensor cores): the logits after a
    prompt stay within mean KLD 1e-3 of the float32 products'."""
    prompt = [int(t) for t in np.random.default_rng(6).integers(1, 200, 64)]
    eng = _engine(model_file, 2, ubatch=32)
    eng.generate(prompt, 1)
    f32 = eng.state.bufs.logits[0].cpu().clone()
    eng.prefill.bf16 = None
    eng.generate(prompt, 1)
    bf = eng.state.bufs.logits[0].cpu().clone()
    eng.close()
    assert _logits_kld(f32, bf) < 1e-3


# ---------------------------------------------------------------------------
# prefill against the reference forward pass (fle_engine.load), every architecture


@pytest.fixture(scope="module")
def next_file(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("prefill_next") / "n.gguf", "qwen3next", seed=4, mix="release",
                      routing_skew=1.0)


ARCH_FILES = {"qwen3moe": "model_file", "qwen3next": "next_file", "qwen4exp": "q4_file"}
REF_PROMPT = [int(t) for t in np.random.default_rng(11).integers(1, 200, 40)]


@pytest.fixture(scope="module")
def reference_logits():
    """Every position's logits [T, V] of the reference pass (float32), per
    file and prompt, computed once."""
    memo = {}

    def get(path, prompt):
        key = (str(path), tuple(prompt))
        if key not in memo:
            memo[key] = torch.from_numpy(load(path, device=DEVICE, experts="resident").logits(prompt)).float()
        return memo[key]
    return get


def _prefill_logits(eng, prompt):
    """Every position's logits [T, V] of a prefill of ``prompt`` from
    position 0: the rows the prefill keeps (``keep_hidden``) through the
    head the way the prefill takes its last row through it (qwen4exp: the
    wide residual normed and read by the output hyper-connection first)."""
    eng.reset()
    eng.prefill.run(prompt, 0, keep_hidden=True)
    net, st, ops, a = eng.net, eng.state, eng.ops, eng.args
    h = eng.prefill.hidden                        # [T, D] after the output norm; qwen4exp [T, S, D]
    if h.dim() == 3:
        hxn = torch.empty_like(h)
        ops.hc_write_norm(h, None, None, a.hc, net.output_hc.norm, a.eps, hxn)
        h, _ = net.prefill_hc_read(net.output_hc, hxn, st, ops)
    out = torch.empty(h.shape[0], a.n_vocab, dtype=torch.float32, device=h.device)
    net.output.matvec(h.contiguous(), out, net.impl(st))
    _close(out[-1].cpu(), st.bufs.logits[0].float().cpu(), 1e-5)     # the row the prefill took through the head
    return out.cpu()


def _kld_rows(ref, got):
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def _cache_contents(cache):
    """The expert->slot maps (host mirror and device map), the slot->expert
    lists and the bytes of every slot that holds an expert."""
    if CUDA:
        torch.cuda.synchronize()                  # admissions copied on the side stream have landed
    slots = cache.slots.cpu()
    held = {}
    for i, l in enumerate(cache.layers):
        eb = cache.layouts[l].expert_bytes
        for s, e in enumerate(cache.expert_in[i].tolist()):
            if e >= 0:
                o = cache.region[l] + s * eb
                held[(l, s)] = slots[o:o + eb].clone()
    return (cache.mirror.copy(), cache.map.cpu().clone(), [x.copy() for x in cache.expert_in], held)


@pytest.mark.parametrize("lend", [True, False], ids=["lent", "own"])
@pytest.mark.parametrize("arch", sorted(ARCH_FILES))
def test_prefill_equals_reference(request, reference_logits, arch, lend):
    """A 40-token prompt in micro-batches of 16 with float32 products gives
    the reference pass's logits at every position (mean KLD <= 1e-4, the
    same greedy tokens), with the staging ring lent from the back of the
    cache's slot buffer (6 slots per layer: room for the ring) and with a
    ring of its own (2 slots per layer). The cache holds what it held
    before: its maps, and the bytes of every slot holding an expert (the
    lent layers' slots copied back)."""
    path = request.getfixturevalue(ARCH_FILES[arch])
    ref = reference_logits(path, REF_PROMPT)
    eng = _engine(path, 6 if lend else 2, ubatch=16)
    eng.prefill_min = len(REF_PROMPT) + 1
    eng.generate(REF_PROMPT[:12], 12)             # decode steps: experts admitted into their slots
    before = _cache_contents(eng.cache)
    got = _prefill_logits(eng, REF_PROMPT)
    st = eng.prefill.stats
    assert st.tokens == len(REF_PROMPT) and st.ubatches == 3
    mirror, dmap, expert_in, held = before
    if lend:
        assert st.lent_layers and st.lent_layers[-1] == eng.cache.layers[-1]
        assert any(l in st.lent_layers for l, _ in held)          # a lent slot held an expert: given back
        assert any(l not in st.lent_layers for l, _ in held)      # and a layer read from its slots
    else:
        assert st.lent_layers == []
    kld = _kld_rows(ref, got)
    assert float(kld.mean()) <= 1e-4, float(kld.mean())
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    after = _cache_contents(eng.cache)
    assert np.array_equal(after[0], mirror) and torch.equal(after[1], dmap)
    assert all(np.array_equal(a, b) for a, b in zip(after[2], expert_in))
    assert after[3].keys() == held.keys() and all(after[3][k].equal(v) for k, v in held.items())
    eng.close()


def test_routed_only_rule():
    """A one-micro-batch prompt copies only its routed experts while its
    tokens are expected to route to under ROUTED_ONLY_BELOW of a layer's
    experts: never at 32 tokens of a 128-expert, 8-used file, up to ~80
    tokens of a 512-expert, 10-used one; a prompt of several micro-batches
    never."""
    from types import SimpleNamespace

    from fle_engine.runtime.prefill import ROUTED_ONLY_BELOW, Prefill, routed_share

    assert routed_share(1, 8, 128) == pytest.approx(8 / 128)
    assert routed_share(32, 8, 128) > ROUTED_ONLY_BELOW > routed_share(32, 10, 512)
    assert routed_share(81, 10, 512) < ROUTED_ONLY_BELOW < routed_share(83, 10, 512)

    def rule(n, n_used, n_expert, ubatch=8192):
        eng = SimpleNamespace(net=SimpleNamespace(args=SimpleNamespace(n_expert_used=n_used, n_expert=n_expert)))
        return Prefill(eng, ubatch).routed_only(list(range(n)))

    assert not rule(32, 8, 128) and rule(32, 10, 512) and rule(80, 10, 512) and not rule(90, 10, 512)
    assert not rule(40, 10, 512, ubatch=16)


@pytest.mark.parametrize("arch", sorted(ARCH_FILES))
def test_routed_only_prefill_equals_reference(request, reference_logits, arch):
    """Routed-only copying (forced on a factory model): each layer's router
    first, then only its routed uncached experts copied. Every position's
    logits equal the reference pass's, fewer bytes move than with whole
    layers, and the cache holds what it held before."""
    path = request.getfixturevalue(ARCH_FILES[arch])
    prompt = REF_PROMPT[:3]
    ref = reference_logits(path, prompt)
    eng = _engine(path, 2, ubatch=16)
    eng.generate(REF_PROMPT[:12], 6)
    before = _cache_contents(eng.cache)
    moved = {}
    for forced in (False, True):
        eng.prefill.force_routed = forced
        got = _prefill_logits(eng, prompt)
        st = eng.prefill.stats
        assert st.routed_only == forced
        moved[forced] = st.bytes_copied
        kld = _kld_rows(ref, got)
        assert float(kld.mean()) <= 1e-4, float(kld.mean())
        assert (got.argmax(-1) == ref.argmax(-1)).all()
    from fle_engine.runtime.prefill import routed_share

    a = eng.args
    assert routed_share(len(prompt), a.n_expert_used, a.n_expert) < 1
    assert 0 < moved[True] < moved[False]
    after = _cache_contents(eng.cache)
    assert np.array_equal(after[0], before[0]) and torch.equal(after[1], before[1])
    eng.close()


@pytest.mark.parametrize("arch", sorted(ARCH_FILES))
def test_prefill_bf16_against_float32(request, arch, capsys):
    """The bfloat16 products (the default on CUDA) against float32 on the
    same engine: mean KLD over every position of four 40-token prompts at
    micro-batches of 16, printed (``pytest -s``; docs/engine.md quotes it).
    Bounded loosely: on these small random models a token whose top-K expert
    set is a near tie can pick another expert and move its logits far."""
    path = request.getfixturevalue(ARCH_FILES[arch])
    eng = _engine(path, 2, ubatch=16)
    per_prompt = []
    for seed in (5, 6, 7, 11):
        prompt = [int(t) for t in np.random.default_rng(seed).integers(1, 200, 40)]
        eng.prefill.bf16 = False
        f32 = _prefill_logits(eng, prompt)
        eng.prefill.bf16 = True
        bf = _prefill_logits(eng, prompt)
        k = _kld_rows(f32, bf)
        per_prompt.append((float(k.mean()), float(k[-1])))
    eng.close()
    with capsys.disabled():
        print(f"\nprefill bf16 against float32, {arch}, -ub 16, 40 tokens: mean KLD per prompt "
              + ", ".join(f"{m:.1e}" for m, _ in per_prompt) + "; last token's "
              + ", ".join(f"{x:.1e}" for _, x in per_prompt))
    assert all(0 < m < 5e-2 for m, _ in per_prompt)


def test_iq4_words_are_the_code_book():
    from fle_engine.kernels.triton_quant import IQ4_WORDS
    from fle_quant.quants import tables

    vals = [(((w & 0xFFFFFFFF) >> (8 * j)) & 0xFF) for w in IQ4_WORDS for j in range(4)]
    assert [v - 256 if v >= 128 else v for v in vals] == [int(v) for v in tables.KVALUES_IQ4NL]


def test_prefill_failure_falls_back_to_decode_steps(model_file, monkeypatch):
    """A prefill that fails on the GPU (out of memory) gives the slots back,
    says so in one line and runs the prompt as decode steps; on the CPU the
    error is raised."""
    prompt = [int(t) for t in np.random.default_rng(5).integers(1, 200, 40)]
    eng = _engine(model_file, 8)
    eng.generate(prompt, 4)                       # experts in their slots

    def boom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")
    monkeypatch.setattr(eng.prefill, "_moe", boom)
    logs = []
    eng.log = logs.append
    if not CUDA:
        with pytest.raises(torch.OutOfMemoryError):
            eng.generate(prompt, 4)
        assert not logs
    else:
        want = _engine(model_file, 8, ubatch=0).generate(prompt, 4)
        assert eng.generate(prompt, 4) == want
        assert eng.prefill is None and any("prefill failed" in m for m in logs)
    if CUDA:
        torch.cuda.synchronize()                      # admissions copied on the side stream have landed
    slots = eng.cache.slots.cpu()
    for i, l in enumerate(eng.cache.layers):
        for s, e in enumerate(eng.cache.expert_in[i].tolist()):
            if e >= 0:                                # every slot holds the bytes of the expert it says it holds
                eb = eng.cache.layouts[l].expert_bytes
                o = eng.cache.region[l] + s * eb
                assert slots[o:o + eb].equal(eng.cache.host.view(l)[e].cpu())
    eng.close()


# ---------------------------------------------------------------------------
# the sequence kept between prompts (llama-server's cache_prompt)


def test_prompt_prefix_kept_qwen3moe(model_file):
    """A prompt that shares a prefix with the last sequence computes only the
    rest (positional state: any prefix), with the tokens and logits of a
    fresh start; cache_prompt=False starts fresh."""
    rng = np.random.default_rng(8)
    a = [int(t) for t in rng.integers(1, 200, 40)]
    b = a[:25] + [int(t) for t in rng.integers(1, 200, 20)]
    eng = _engine(model_file, 2)
    eng.generate(a, 6)
    got = eng.generate(b, 10)
    assert eng.cached_tokens == 25
    logits = eng.state.bufs.logits[0].cpu().clone()
    fresh = eng.generate(b, 10, cache_prompt=False)
    assert eng.cached_tokens == 0 and got == fresh
    # the same prompt again: all but its last token kept
    again = eng.generate(b, 10)
    assert eng.cached_tokens == len(b) - 1 and again == fresh
    ref = _engine(model_file, 2)
    assert ref.generate(b, 10) == fresh
    eng.close()
    ref.close()
    assert logits.shape[0] == eng.args.n_vocab


def test_prompt_extension_kept_qwen3next(tmp_path):
    """Recurrent state: a prompt that extends the last sequence (its prompt
    and all but the last generated token, as a chat's next turn) computes
    only the new tokens and answers as a fresh start; a prompt that
    departs from it starts fresh."""
    path = make_model(tmp_path / "n.gguf", "qwen3next", seed=4, mix="release", routing_skew=1.0)
    rng = np.random.default_rng(9)
    a = [int(t) for t in rng.integers(1, 200, 36)]
    eng = _engine(path, 2, ubatch=16)
    out = eng.generate(a, 8)
    assert eng.history == a + out[:-1]
    b = a + out[:-1] + [int(t) for t in rng.integers(1, 200, 40)]
    got = eng.generate(b, 8)
    assert eng.cached_tokens == len(a) + len(out) - 1
    ref = _engine(path, 2, ubatch=16)
    assert got == ref.generate(b, 8)
    c = b[:30] + [5, 6, 7]
    eng.generate(c, 4)
    assert eng.cached_tokens == 0
    assert eng.generate(c, 4) == ref.generate(c, 4)
    eng.close()
    ref.close()


@pytest.mark.parametrize("kv", ["q8_0", "f16"])
def test_prefill_with_quantized_and_half_kv(model_file, kv):
    """With a q8_0 or f16 KV cache the prefill writes what the decode steps
    write (ggml's q8_0 blocks; f16 values) and ends at their logits."""
    prompt = [int(t) for t in np.random.default_rng(10).integers(1, 200, 40)]
    kw = dict(cache_type_k=kv, cache_type_v=kv)
    steps = _engine(model_file, 2, ubatch=0, **kw)
    steps.generate(prompt, 1)
    want = steps.state.bufs.logits[0].cpu().clone()
    kv_want = [t.clone() for t in (steps.state.kv[0][0].q if kv == "q8_0" else steps.state.kv[0][0],)]
    steps.close()
    eng = _engine(model_file, 2, ubatch=16, **kw)
    eng.generate(prompt, 1)
    got = eng.state.bufs.logits[0].cpu()
    kv_got = eng.state.kv[0][0].q if kv == "q8_0" else eng.state.kv[0][0]
    a, b = kv_got[:, :40].cpu(), kv_want[0][:, :40].cpu()
    if kv == "q8_0":
        assert (a.int() - b.int()).abs().max() <= 1          # a float32 ulp may round one value the other way
    else:
        assert torch.allclose(a.float(), b.float(), rtol=2e-3, atol=1e-3)      # within an f16 rounding
    assert _logits_kld(want, got) < 1e-6
    eng.close()


@pytest.mark.parametrize("tiled,sigmoid,T", [(True, True, 5), (False, False, 5), (False, True, 2)])
def test_gdn_tokens_kernel(fast, tiled, sigmoid, T):
    """T tokens of the GDN layer in two launches against T single steps of
    the reference (rows of one projection buffer; T below the conv's taps
    too)."""
    torch.manual_seed(T + int(tiled))
    nk, nv, d, k_taps = 2, 4, 64, 4
    c, nz = 2 * nk * d + nv * d, nv * d
    proj = torch.randn(T, c + nz + 2 * nv)
    proj[:, c + nz + nv:] *= 3
    init = dict(conv_state=torch.randn(k_taps - 1, c), conv_w=torch.randn(c, k_taps), dt_bias=torch.randn(nv),
                ssm_a=-torch.rand(nv) * 2, ssm=torch.randn(nv, d, d) * 0.1, norm=torch.rand(d) + 0.5)
    res = []
    for side, (ops, dev) in enumerate(((engine_ops.REFERENCE, torch.device("cpu")), (fast, DEVICE))):
        t = {n: v.clone().to(dev) for n, v in init.items()}
        p = proj.to(dev)
        conv_out, out = torch.zeros(T, c, device=dev), torch.zeros(T, nz, device=dev)
        if side == 0:           # the reference: T single steps
            for i in range(T):
                ops.gdn_step(p[i, :c], p[i, c:c + nz], p[i, c + nz:c + nz + nv], p[i, c + nz + nv:], t["conv_state"],
                             t["conv_w"], t["dt_bias"], t["ssm_a"], t["ssm"], t["norm"], 1e-6, nk, tiled, sigmoid,
                             conv_out[i], out[i])
        else:
            ops.gdn_tokens(p[:, :c], p[:, c:c + nz], p[:, c + nz:c + nz + nv], p[:, c + nz + nv:], t["conv_state"],
                           t["conv_w"], t["dt_bias"], t["ssm_a"], t["ssm"], t["norm"], 1e-6, nk, tiled, sigmoid,
                           conv_out, out)
        res.append([out.cpu(), t["ssm"].cpu(), t["conv_state"].cpu(), conv_out.cpu()])
    for got, ref in zip(res[1], res[0]):
        _close(got, ref, 1e-5)


@pytest.mark.skipif(CUDA, reason="the GPU engine refuses experts without fast kernels at start")
def test_prefill_off_for_experts_without_prefill_kernels(tmp_path):
    """Experts of a type with no prefill kernels (F32 here; the GPU engine
    refuses them at start) turn prefill off with one line, and prompts run
    as decode steps with the reference's tokens."""
    path = make_model(tmp_path / "f.gguf", "qwen3moe", seed=3,
                      mix=[(r"\.ffn_gate_inp\.weight$", "F32"), (r"_exps\.weight$", "F32")])
    said = []
    eng = Engine(path, device=DEVICE, cache_budget="auto", ctx_size=64, profile_path="none", progress=False,
                 log=said.append, ubatch=16, prefill_min=1, cache_type_k="f32", cache_type_v="f32")
    assert eng.prefill is None
    assert [m for m in said if "prefill off" in m] == [
        "fle-engine: prefill off: experts of type F32 have no prefill kernels; prompts run as decode steps"]
    prompt = [int(t) for t in np.random.default_rng(2).integers(1, 200, 12)]
    got = eng.generate(prompt, 4)
    eng.close()
    model = load(path, device=DEVICE, experts="resident")
    state = model.new_state(len(prompt) + 8)
    out = model.forward(prompt, state)
    want = []
    while len(want) < 4:
        want.append(int(torch.argmax(out[-1])))
        out = model.forward([want[-1]], state)
    assert got == want
