"""FLE's reference forward pass on its own: prefill equals token-by-token
decode, a decode step reads the cache and recurrent state instead of the
prefix, the chunked gated delta rule equals the recurrent one, the two MoE
formulations agree, the capture hooks record what the layers computed,
alternative tensor layouts load to the same model, and bad input gives
FleError. The comparison with llama.cpp is in test_forward_llama.py."""
from __future__ import annotations

import copy

import numpy as np
import pytest


pytestmark = pytest.mark.usefixtures("one_torch_thread")

torch = pytest.importorskip("torch")

import fle_engine  # noqa: E402
from fle_engine import layers  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.ggml_types import GGMLType  # noqa: E402
from fle_quant.gguf_reader import GGUFModel  # noqa: E402
from fle_quant.gguf_writer import WritePlan, write_gguf  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402

ARCHS = ("qwen3moe", "qwen3next")
N_TOKENS = 100  # crosses a 64-token GDN chunk boundary



@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("fwd")
    return {arch: make_model(d / f"{arch}.gguf", arch, mix="f32", context_length=640) for arch in ARCHS}


@pytest.fixture(scope="module")
def models(model_paths):
    return {arch: fle_engine.load(p) for arch, p in model_paths.items()}


def tokens(n, n_vocab, seed=0):
    return np.random.default_rng(seed).integers(0, n_vocab, n).tolist()


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def decode_all(model, toks, state=None):
    state = model.new_state(len(toks)) if state is None else state
    return np.concatenate([model.forward([t], state).numpy() for t in toks])


# ---------------------------------------------------------------------------
# prefill == decode


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_equals_token_by_token_decode(models, arch):
    m = models[arch]
    toks = tokens(N_TOKENS, m.n_vocab)
    full = m.logits(toks)
    assert full.shape == (N_TOKENS, m.n_vocab) and full.dtype == np.float32
    assert np.isfinite(full).all()
    dec = decode_all(m, toks)
    assert rel_err(dec, full) < 1e-4
    # a prefill that continues a state (chunked GDN from a non-zero state, cache offset)
    state = m.new_state(N_TOKENS)
    first = m.forward(toks[:37], state).numpy()
    rest = m.forward(toks[37:], state).numpy()
    assert rel_err(np.concatenate([first, rest]), full) < 1e-4
    # and the logits depend on the context, not only on the token
    assert np.abs(full[10] - m.logits(toks[5:11])[-1]).max() > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_step_reads_state_not_prefix(models, arch, monkeypatch):
    m = models[arch]
    toks = tokens(40, m.n_vocab, seed=1)
    state = m.new_state(41)
    m.forward(toks, state)
    saved = copy.deepcopy(state)

    rows = []

    def counting(fn, kind):
        def wrapped(q, *args, **kwargs):
            rows.append((kind, q.shape[0]))
            return fn(q, *args, **kwargs)
        return wrapped

    monkeypatch.setattr(layers, "attention", counting(layers.attention, "attn"))
    monkeypatch.setattr(layers, "gdn_recurrent", counting(layers.gdn_recurrent, "gdn"))
    monkeypatch.setattr(layers, "gdn_chunked", counting(layers.gdn_chunked, "gdn-chunked"))
    nxt = 7
    out = m.forward([nxt], state)
    n_layer = m.args.n_layer
    assert len(rows) == n_layer and all(n == 1 for _, n in rows), rows
    assert all(kind != "gdn-chunked" for kind, _ in rows)
    assert int(state.pos.item()) == 41 and state.length == 41
    if arch == "qwen3next":
        assert {k for k, _ in rows} == {"attn", "gdn"}

    # the decode step's result is carried by the state: change the state of
    # the prefix and the same step gives another answer; restore it and the
    # answer comes back
    ref = out.numpy()
    for il, cache in enumerate(saved.layers):
        probe = copy.deepcopy(saved)
        c = probe.layers[il]
        if isinstance(c, layers.AttnCache):
            c.v[:, :40] = torch.randn_like(c.v[:, :40])
        else:
            c.ssm.mul_(-1.0)
        changed = m.forward([nxt], probe).numpy()
        assert np.abs(changed - ref).max() > 1e-3, f"layer {il}: decode output ignores the cached state"
    again = m.forward([nxt], copy.deepcopy(saved)).numpy()
    np.testing.assert_array_equal(again, ref)


def test_state_overflow_and_bad_tokens(models):
    m = models["qwen3moe"]
    state = m.new_state(4)
    m.forward([1, 2, 3], state)
    with pytest.raises(FleError, match="max_tokens"):
        m.forward([4, 5], state)
    with pytest.raises(FleError, match="vocabulary"):
        m.logits([1, m.n_vocab])
    with pytest.raises(FleError, match="vocabulary"):
        m.forward([-1], m.new_state(2))
    with pytest.raises(FleError):
        m.logits([])
    with pytest.raises(FleError):
        m.new_state(0)


# ---------------------------------------------------------------------------
# building blocks


@pytest.mark.parametrize("n_tok", [1, 63, 64, 150])
def test_chunked_gdn_equals_recurrent(n_tok):
    g = torch.Generator().manual_seed(n_tok)
    h, dk, dv = 3, 16, 24
    q = layers.l2_norm(torch.randn(n_tok, h, dk, generator=g), 1e-6)
    k = layers.l2_norm(torch.randn(n_tok, h, dk, generator=g), 1e-6)
    v = torch.randn(n_tok, h, dv, generator=g)
    # strong and weak decays, including steps that wipe the state
    gate = -torch.rand(n_tok, h, generator=g) * torch.tensor([0.05, 1.0, 30.0])
    beta = torch.rand(n_tok, h, generator=g)
    s0 = torch.randn(h, dv, dk, generator=g)
    o_r, s_r = layers.gdn_recurrent(q, k, v, gate, beta, s0)
    o_c, s_c = layers.gdn_chunked(q, k, v, gate, beta, s0)
    assert o_c.shape == o_r.shape == (n_tok, h, dv) and s_c.shape == s_r.shape == (h, dv, dk)
    assert rel_err(o_c, o_r) < 1e-4
    assert rel_err(s_c, s_r) < 1e-4
    # the rule itself, spelled out for one head and two tokens
    s = s0[0].double()
    for t in range(min(n_tok, 2)):
        s = s * np.exp(float(gate[t, 0]))
        s = s + float(beta[t, 0]) * torch.outer(v[t, 0].double() - s @ k[t, 0].double(), k[t, 0].double())
        np.testing.assert_allclose(o_r[t, 0].numpy(), (s @ q[t, 0].double() / dk ** 0.5).numpy(), rtol=1e-4, atol=1e-5)


def test_causal_conv_matches_direct_sum():
    g = torch.Generator().manual_seed(0)
    x, st, w = torch.randn(9, 5, generator=g), torch.randn(3, 5, generator=g), torch.randn(5, 4, generator=g)
    y, new = layers.causal_conv1d(x, st, w)
    full = torch.cat([st, x])
    want = torch.stack([(full[t:t + 4] * w.T).sum(0) for t in range(9)])
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(new, x[-3:])
    # one token at a time with the carried state gives the same
    s = st.clone()
    ys = []
    for t in range(9):
        yt, s = layers.causal_conv1d(x[t:t + 1], s, w)
        ys.append(yt)
    torch.testing.assert_close(torch.cat(ys), y)


@pytest.mark.parametrize("rows", [[0, 1], [1, 2], [0, 2], [0, 1, 2]])
def test_gdn_and_conv_step_rows_equal_one_sequence_each(rows):
    """A batched decode step's conv and delta rule on states that are rows
    of one pool (adjacent or not) update each row as the sequence's own
    step would, to float32 rounding."""
    g = torch.Generator().manual_seed(1)
    h, d, c = 4, 16, 24
    ssm = torch.randn(3, h, d, d, generator=g) * 0.1
    conv = torch.randn(3, 3, c, generator=g)
    ssm_ref, conv_ref = ssm.clone(), conv.clone()
    n = len(rows)
    q, k = (layers.l2_norm(torch.randn(n, h, d, generator=g), 1e-6) for _ in range(2))
    v, x, w = torch.randn(n, h, d, generator=g), torch.randn(n, c, generator=g), torch.randn(c, 4, generator=g)
    gate, beta = -torch.rand(n, h, generator=g) * torch.tensor([0.05, 1.0, 3.0, 30.0]), torch.rand(n, h, generator=g)
    o = layers.gdn_step_rows(q, k, v, gate, beta, layers.stacked([ssm[r] for r in rows]))
    y = layers.conv_step_rows(x, layers.stacked([conv[r] for r in rows]), w)
    for i, r in enumerate(rows):
        o1, s1 = layers.gdn_recurrent(q[i:i + 1], k[i:i + 1], v[i:i + 1], gate[i:i + 1], beta[i:i + 1], ssm_ref[r])
        torch.testing.assert_close(o[i], o1[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ssm[r], s1, rtol=1e-5, atol=1e-6)
        y1, c1 = layers.causal_conv1d(x[i:i + 1], conv_ref[r], w)
        torch.testing.assert_close(y[i], y1[0], rtol=0, atol=0)
        torch.testing.assert_close(conv[r], c1, rtol=0, atol=0)
    untouched = [r for r in range(3) if r not in rows]
    for r in untouched:
        torch.testing.assert_close(ssm[r], ssm_ref[r], rtol=0, atol=0)


def test_rope_table_and_neox_pairs():
    cos, sin = layers.rope_table(8, 10000.0, 5)
    want = np.arange(5)[:, None] * 10000.0 ** (-np.arange(0, 8, 2) / 8)
    np.testing.assert_allclose(cos, np.cos(want), atol=1e-5)
    x = torch.randn(5, 2, 12)
    y = layers.apply_rope_neox(x, torch.from_numpy(cos), torch.from_numpy(sin))
    # dims beyond n_rot pass through; each (i, i + 4) pair keeps its norm
    torch.testing.assert_close(y[..., 8:], x[..., 8:])
    torch.testing.assert_close(y[..., :4] ** 2 + y[..., 4:8] ** 2, x[..., :4] ** 2 + x[..., 4:8] ** 2)
    torch.testing.assert_close(y[0], x[0])


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_gather_equals_dense(models, arch):
    moe = models[arch].moe_layers()[1]
    x = torch.randn(6, moe.router.shape[1], generator=torch.Generator().manual_seed(3))
    try:
        moe.mode = "gather"
        a = moe(x)
        moe.mode = "dense"
        b = moe(x)
    finally:
        moe.mode = "auto"
    assert rel_err(a, b) < 1e-5


# ---------------------------------------------------------------------------
# capture hooks


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_records_and_recomputes(models, model_paths, arch):
    m = models[arch]
    toks = tokens(24, m.n_vocab, seed=2)
    plain = m.logits(toks)
    with m.capturing() as cap:
        captured = m.logits(toks)
        state = m.new_state(2)
        m.forward([3], state)                                  # a decode step (gather path) too
    assert m.capture is None and all(x.capture is None for x in m.moe_layers())
    np.testing.assert_array_equal(plain, captured)
    a = m.args
    assert sorted(cap.layers) == list(range(a.n_layer))

    gguf = GGUFModel.open(model_paths[arch])
    w = fle_engine.Weights(gguf)
    try:
        for il, recs in cap.layers.items():
            assert [r.hidden.shape[0] for r in recs] == [len(toks), 1]
            for r in recs:
                n = r.hidden.shape[0]
                assert r.layer == il
                assert r.hidden.shape == (n, a.n_embd) and r.output.shape == (n, a.n_embd)
                assert r.probs.shape == (n, a.n_expert)
                assert r.experts.shape == r.weights.shape == (n, a.n_expert_used)
                assert r.expert_out.shape == (n, a.n_expert_used, a.n_embd)
                torch.testing.assert_close(r.probs.sum(-1), torch.ones(n))
                torch.testing.assert_close(r.weights.sum(-1), torch.ones(n))
                # the chosen experts are the most probable ones
                chosen = r.probs.gather(1, r.experts)
                others = r.probs.scatter(1, r.experts, -1.0).max(-1).values
                assert (chosen.min(-1).values >= others).all()
                # each chosen expert's output, recomputed from the file's tensors
                p = f"blk.{il}."
                gate, up = w.get(p + "ffn_gate_exps.weight"), w.get(p + "ffn_up_exps.weight")
                down = w.get(p + "ffn_down_exps.weight")
                for t in range(n):
                    for j, e in enumerate(r.experts[t].tolist()):
                        want = layers.swiglu(r.hidden[t], gate[e], up[e], down[e])
                        torch.testing.assert_close(r.expert_out[t, j], want, rtol=1e-4, atol=1e-5)
                total = (r.weights[..., None] * r.expert_out).sum(1)
                if arch == "qwen3next":
                    assert r.shared_out is not None
                    sg = torch.sigmoid(r.hidden @ w.get(p + "ffn_gate_inp_shexp.weight"))[:, None]
                    shared = layers.swiglu(r.hidden, w.get(p + "ffn_gate_shexp.weight"),
                                           w.get(p + "ffn_up_shexp.weight"), w.get(p + "ffn_down_shexp.weight"))
                    torch.testing.assert_close(r.shared_out, sg * shared, rtol=1e-4, atol=1e-5)
                    total = total + r.shared_out
                else:
                    assert r.shared_out is None
                torch.testing.assert_close(total, r.output, rtol=1e-4, atol=1e-5)
    finally:
        gguf.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_output_is_the_layer_delta(models, arch):
    """The recorded MoE output is what the block adds to the residual: the
    MoE input of layer l+1 is recomputable from layer l's record."""
    m = models[arch]
    toks = tokens(12, m.n_vocab, seed=4)
    res_in = {}
    hooks = [blk.register_forward_hook(lambda mod, args, out, il=il: res_in.__setitem__(il, (args[0], out)))
             for il, blk in enumerate(m.net.layers)]
    try:
        with m.capturing() as cap:
            m.logits(toks)
    finally:
        for h in hooks:
            h.remove()
    for il, blk in enumerate(m.net.layers):
        x_in, x_out = res_in[il]
        r = cap.layers[il][0]
        # x_out = (x_in + mixer) + moe: the MoE output and its input norm match the block
        mid = x_out - r.output
        norm_w = blk.ffn_norm if arch == "qwen3moe" else blk.post_norm
        torch.testing.assert_close(layers.rms_norm(mid, norm_w, m.args.eps), r.hidden, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(mid, x_in)


# ---------------------------------------------------------------------------
# alternative layouts


def rewrite(src, dst, edit):
    """Copy GGUF ``src`` to ``dst`` as F32 with ``edit(name, array) ->
    [(name, array)]`` applied to every tensor (arrays in numpy order)."""
    g = GGUFModel.open(src)
    plan = WritePlan()
    keep = []
    try:
        for k, v in g.metadata.items():
            vt, it = g.metadata_types[k]
            plan.add(k, v, vt, it)
        for name, t in g.tensors.items():
            assert t.qtype == GGMLType.F32
            arr = np.array(g.tensor_bytes(name).view(np.float32)).reshape(tuple(reversed(t.shape)))
            for new_name, new in edit(name, arr):
                new = np.ascontiguousarray(new, dtype=np.float32)
                keep.append(new)
                plan.add_tensor(new_name, tuple(reversed(new.shape)), GGMLType.F32, new)
        write_gguf(plan, dst, force=True)
    finally:
        g.close()
    return dst


def legacy_qwen3next(args):
    """Tensor edits that turn a qwen3next file into the legacy layout:
    ``ssm_in`` per K head [q, k, v (r heads), z (r heads)] instead of
    attn_qkv + attn_gate, and fused ``ffn_gate_up_exps`` (gate rows first)."""
    dk, nk, nv = args.d_state, args.n_k_heads, args.n_v_heads
    r = nv // nk
    pending = {}

    def edit(name, arr):
        blk, _, tail = name.partition(".")[2].partition(".")
        if tail in ("attn_qkv.weight", "attn_gate.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight"):
            pending.setdefault(blk, {})[tail] = arr
            have = pending[blk]
            if {"attn_qkv.weight", "attn_gate.weight"} <= have.keys():
                qkv, z = have.pop("attn_qkv.weight"), have.pop("attn_gate.weight")
                n_embd = qkv.shape[1]
                q = qkv[:dk * nk].reshape(nk, dk, n_embd)
                k = qkv[dk * nk:2 * dk * nk].reshape(nk, dk, n_embd)
                v = qkv[2 * dk * nk:].reshape(nk, r * dk, n_embd)
                zz = z.reshape(nk, r * dk, n_embd)
                fused = np.concatenate([q, k, v, zz], axis=1).reshape(-1, n_embd)
                return [(f"blk.{blk}.ssm_in.weight", fused)]
            if {"ffn_gate_exps.weight", "ffn_up_exps.weight"} <= have.keys():
                gate, up = have.pop("ffn_gate_exps.weight"), have.pop("ffn_up_exps.weight")
                return [(f"blk.{blk}.ffn_gate_up_exps.weight", np.concatenate([gate, up], axis=1))]
            return []
        return [(name, arr)]
    return edit


def test_legacy_layout_loads_to_the_same_model(models, model_paths, tmp_path):
    m = models["qwen3next"]
    path = rewrite(model_paths["qwen3next"], tmp_path / "legacy.gguf", legacy_qwen3next(m.args))
    names = GGUFModel.open(path).tensors
    assert "blk.0.ssm_in.weight" in names and "blk.0.attn_qkv.weight" not in names
    assert "blk.0.ffn_gate_up_exps.weight" in names
    toks = tokens(70, m.n_vocab, seed=5)
    assert rel_err(fle_engine.load(path).logits(toks), m.logits(toks)) < 1e-5
    # the fused expert tensor streamed from the file: gate and up halves
    assert rel_err(fle_engine.load(path, experts="stream").logits(toks), m.logits(toks)) < 1e-5


def test_tied_output_and_unknown_arch(models, model_paths, tmp_path):
    # without output.weight the head is the token embedding, as in llama.cpp
    path = rewrite(model_paths["qwen3moe"], tmp_path / "tied.gguf",
                   lambda n, a: [] if n == "output.weight" else [(n, a)])
    tied = fle_engine.load(path)
    torch.testing.assert_close(tied.net.output, tied.net.tok_embd)
    assert np.isfinite(tied.logits([1, 2, 3])).all()
    # an architecture FLE does not implement
    g = GGUFModel.open(model_paths["qwen3moe"])
    plan = WritePlan()
    for k, v in g.metadata.items():
        vt, it = g.metadata_types[k]
        plan.add(k, "nosucharch" if k == "general.architecture" else v, vt, it)
    g.close()
    bad = write_gguf(plan, tmp_path / "bad.gguf", force=True).paths[0]
    with pytest.raises(FleError, match="not supported"):
        fle_engine.load(bad)
