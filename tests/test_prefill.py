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
from fle_engine.runtime.prefill import pad_by_expert  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
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


def test_pad_by_expert():
    ids = torch.tensor([[3, 1], [1, 0], [3, 2], [1, 3]], dtype=torch.int64)
    rows, blk_expert = pad_by_expert(ids, n_expert=5, block_m=2)
    rows, blk_expert = rows.tolist(), blk_expert.tolist()
    # experts 0 (1 row), 1 (3), 2 (1), 3 (3), padded to 2: 2 + 4 + 2 + 4 = 12 places, 6 blocks
    assert blk_expert[:6] == [0, 1, 1, 2, 3, 3] and all(e < 0 for e in blk_expert[6:])
    assert rows[:12] == [3, -1, 1, 2, 6, -1, 5, -1, 0, 4, 7, -1]
    assert all(r < 0 for r in rows[12:])
    assert len(rows) == len(blk_expert) * 2


@pytest.mark.parametrize("qtype", [GGMLType.IQ4_XS, GGMLType.Q8_0, GGMLType.Q6_K, GGMLType.IQ3_S])
def test_gemm_kernel_modes(fast, qtype):
    """Dense, gate+up (gathered by token, SwiGLU) and down (scaled, scattered)
    against the reference, with float32 inputs (the interpreter's) or
    bfloat16 (CUDA)."""
    rng = np.random.default_rng(int(qtype))
    n_exp, n_ff, n_embd, k, T, bm = 4, 32, 512, 2, 5, 16
    gu = quantize(rng.standard_normal((n_exp * 2 * n_ff, n_embd)).astype(np.float32) * 0.1, qtype)
    dn = quantize(rng.standard_normal((n_exp * n_embd, 256)).astype(np.float32) * 0.1, qtype)
    rb_gu, rb_d = gu.shape[-1], dn.shape[-1]
    eb_gu = 2 * n_ff * rb_gu
    buf = torch.zeros(n_exp * eb_gu + dn.size + 64, dtype=torch.uint8)
    buf[:gu.size] = torch.from_numpy(gu.reshape(-1))
    d0 = (n_exp * eb_gu + 63) // 64 * 64
    buf[d0:d0 + dn.size] = torch.from_numpy(dn.reshape(-1))
    other = torch.from_numpy(gu.reshape(-1)[:eb_gu].copy())      # expert 0's gate/up also in a second buffer
    space_h = engine_ops.WordSpace(buf, other)
    buf_d, other_d = buf.to(DEVICE), other.to(DEVICE)
    space_d = engine_ops.WordSpace(buf_d, other_d)
    w = engine_ops.WORDS[qtype].itemsize
    ids = torch.tensor([[2, 0], [0, 3], [2, 3], [1, 2], [0, 2]], dtype=torch.int64)
    wts = torch.rand(T * k)
    rows, blk_e = pad_by_expert(ids, n_exp, bm)
    x = torch.randn(T, n_embd) * 0.5
    bf16 = None
    tol = 2e-2 if CUDA else 1e-5

    def base(space, e, part):
        if part == "gu":
            return (space.offset(other_d if space is space_d else other) if e == 0 else e * eb_gu) // w
        return (d0 + e * n_embd * rb_d) // w

    for side, (space, ops, dev) in enumerate(((space_h, engine_ops.REFERENCE, "cpu"), (space_d, fast, DEVICE))):
        xs = x.to(dev)
        blk = torch.tensor([base(space, int(e), "gu") if e >= 0 else 0 for e in blk_e], dtype=torch.int64,
                           device=dev)
        h = torch.zeros(rows.numel(), 256, device=dev)
        ops.gemm(space, qtype, blk, rows.to(dev), xs, h, n_ff, rb_gu, "gate_up", up_words=n_ff * rb_gu // w,
                 n_used=k, block_m=bm, bf16=bf16)
        blk_d = torch.tensor([base(space, int(e), "d") if e >= 0 else 0 for e in blk_e], dtype=torch.int64,
                             device=dev)
        y = torch.full((T * k, n_embd), 7.0, device=dev)
        ops.gemm(space, qtype, blk_d, rows.to(dev), h, y, n_embd, rb_d, "down", n_used=k, weights=wts.to(dev),
                 block_m=bm, bf16=bf16)
        nb = (T + bm - 1) // bm
        yd = torch.zeros(T, 2 * n_ff, device=dev)
        ops.gemm(space, qtype, torch.zeros(nb, dtype=torch.int64, device=dev), None, xs, yd, 2 * n_ff, rb_gu,
                 "dense", block_m=bm, bf16=bf16)
        if side == 0:
            ref = (h.clone(), y.clone(), yd.clone())
        else:
            _close(h.cpu(), ref[0], tol)
            _close(y.cpu(), ref[1], tol)
            _close(yd.cpu(), ref[2], tol)
    # the reference against a plain product per (token, expert)
    from fle_engine.kernels.reference import dequantize_weights

    G = dequantize_weights(torch.from_numpy(gu), qtype).view(n_exp, 2 * n_ff, n_embd)
    D = dequantize_weights(torch.from_numpy(dn), qtype).view(n_exp, n_embd, 256)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            g, u = x[t] @ G[e, :n_ff].T, x[t] @ G[e, n_ff:].T
            hh = torch.nn.functional.silu(g) * u
            place = rows.tolist().index(t * k + j)
            _close(ref[0][place, :n_ff], hh, 1e-5)
            _close(ref[1][t * k + j], (ref[0][place] @ D[e].T) * wts[t * k + j], 1e-5)
    _close(ref[2], x @ G[0].T, 1e-5)


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
    eng = Engine(path, device=DEVICE, cache_budget=slots * per_layer * n_layer, ctx_size=160, cache_type_k="f32",
                 cache_type_v="f32", profile_path="none", progress=False, log=lambda m: None, ubatch=ubatch,
                 prefill_min=1, **kw)
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
    assert eng.stats.prompt_tokens == 80
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


def test_prefill_off_for_recurrent_architectures(tmp_path):
    path = make_model(tmp_path / "n.gguf", "qwen3next", seed=4, mix="release", routing_skew=1.0)
    eng = Engine(path, device=DEVICE, cache_budget="auto", ctx_size=64, profile_path="none", progress=False,
                 log=lambda m: None, prefill_min=1)
    assert eng.prefill is None
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
