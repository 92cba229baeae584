"""FLE's qwen4exp forward pass on factory models: prefill equals
token-by-token decode, a decode step touches exactly one position, every
component (PLE, HC inject, QSA selection, shared expert) moves the logits,
QSA keeps the blocks it should, and an independent NumPy implementation
(tests/qwen4exp_numpy.py) agrees on the trunk and the MTP draft head."""
from __future__ import annotations

import numpy as np
import pytest


pytestmark = pytest.mark.usefixtures("one_torch_thread")

torch = pytest.importorskip("torch")

import fle_engine  # noqa: E402
from fle_engine.models.qwen4exp import Ablation, QSACache  # noqa: E402
from fle_engine.models.qwen4exp_mtp import draft, load_mtp  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.synth import make_model, mtp_path  # noqa: E402

from qwen4exp_numpy import NumpyQwen4Exp  # noqa: E402  (tests/ is on sys.path under pytest)

N_TOKENS = 48          # > indexer budget 16 + a few blocks: sparse selection happens
EOS_AT = (5, 12, 13, 30)
SMALL = dict(expert_feed_forward_length=64, expert_shared_feed_forward_length=64)



@pytest.fixture(scope="module")
def files(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("q4") / "q4.gguf", "qwen4exp", seed=3, mix="f32",
                      mtp="separate", **SMALL)
    return path, mtp_path(path)


@pytest.fixture(scope="module")
def model(files):
    return fle_engine.load(files[0])


@pytest.fixture(scope="module")
def tokens(model):
    toks = np.random.default_rng(7).integers(0, model.n_vocab, N_TOKENS)
    toks[toks == model.args.ple_eos] = 0
    toks[list(EOS_AT)] = model.args.ple_eos
    return toks.tolist()


@pytest.fixture(scope="module")
def prefill(model, tokens):
    return model.logits(tokens)


def kld(p_logits, q_logits) -> float:
    lp = torch.log_softmax(torch.as_tensor(p_logits, dtype=torch.float64), -1)
    lq = torch.log_softmax(torch.as_tensor(q_logits, dtype=torch.float64), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def test_outputs_are_peaked(prefill):
    probs = torch.softmax(torch.as_tensor(prefill, dtype=torch.float64), -1)
    assert float(probs.max(-1).values.mean()) >= 0.3


def test_prefill_equals_decode(model, tokens, prefill):
    state = model.new_state(N_TOKENS)
    steps = np.concatenate([model.forward([t], state).numpy() for t in tokens])
    rel = np.abs(steps - prefill).max() / np.abs(prefill).max()
    assert rel < 1e-4, f"prefill vs decode: max relative error {rel:.3g}"
    # and split prefills: chunks across a QSA block boundary and a PLE EOS
    state = model.new_state(N_TOKENS)
    parts = [model.forward(tokens[a:b], state).numpy() for a, b in ((0, 13), (13, 14), (14, 35), (35, N_TOKENS))]
    rel = np.abs(np.concatenate(parts) - prefill).max() / np.abs(prefill).max()
    assert rel < 1e-4, f"chunked prefill: max relative error {rel:.3g}"


def test_decode_step_touches_one_position(model, tokens):
    n_ctx = 40
    state = model.new_state(n_ctx)
    model.forward(tokens[:20], state)
    before = [(c.k.clone(), c.v.clone(), c.idx.clone() if c.idx is not None else None)
              if isinstance(c, QSACache) else (c.conv.clone(), c.ssm.clone()) for c in state.layers]
    ple_tokens = state.ple.tokens.clone()
    with model.capturing() as cap:
        model.forward([tokens[20]], state)
    assert int(state.pos) == 21 and state.length == 21
    # every layer's MoE ran once, on one token
    assert sorted(cap.layers) == list(range(model.args.n_layer))
    assert all(len(recs) == 1 and recs[0].hidden.shape[0] == 1 for recs in cap.layers.values())
    for cache, old in zip(state.layers, before):
        if isinstance(cache, QSACache):
            for new, prev in ((cache.k, old[0]), (cache.v, old[1])):
                changed = (new != prev).any(-1).any(0).nonzero().flatten().tolist()
                assert changed == [20], f"KV cells written: {changed}"
            changed = (cache.idx != old[2]).any(-1).nonzero().flatten().tolist()
            assert changed == [20], f"indexer cells written: {changed}"
        else:
            assert (cache.ssm != old[1]).any()
    assert state.ple.tokens.tolist() == ple_tokens.tolist()[1:] + [tokens[20]]


def test_ablations_change_logits(model, tokens, prefill):
    try:
        for name in ("ple", "inject", "qsa", "shared_expert"):
            model.net.set_ablation(Ablation(**{name: True}))
            moved = kld(prefill, model.logits(tokens))
            assert moved >= 1e-2, f"switching off {name} moved the logits by only {moved:.3g}"
    finally:
        model.net.set_ablation(Ablation())
    assert np.array_equal(model.logits(tokens), prefill)


def test_qsa_keeps_budget_blocks_and_tail(model, tokens):
    """The selection mask of the QSA layer: with more complete blocks than
    the budget, exactly top_k / ratio complete blocks plus the tail."""
    a = model.args
    il = a.compress.index(max(a.compress))
    r, budget = a.compress[il], a.idx_top_k
    seen = {}
    mixer = model.net.layers[il].mixer
    original = mixer.select

    def spy(*args, **kw):
        keep = original(*args, **kw)
        seen["keep"], seen["pos"] = keep.clone(), args[2].clone()
        return keep

    mixer.select = spy
    try:
        model.logits(tokens)
    finally:
        del mixer.select
    keep, pos = seen["keep"], seen["pos"]
    for i, p in enumerate(pos.tolist()):
        cells = keep[i].nonzero().flatten().tolist()
        n_complete = (p + 1) // r
        tail = list(range(n_complete * r, p + 1))
        assert cells[len(cells) - len(tail):] == tail and max(cells) <= p
        blocks = {c // r for c in cells[:len(cells) - len(tail)]}
        assert len(blocks) == min(n_complete, budget // r)
        assert all(c // r in blocks for c in cells[:len(cells) - len(tail)])
        assert len(cells) == r * len(blocks) + len(tail)
    assert keep.sum(-1).max() < N_TOKENS - r   # sparse: some visible cells were dropped


def test_numpy_trunk_agrees(files, model, tokens, prefill):
    ref, _ = NumpyQwen4Exp(files[0]).run(tokens[:32])
    rel = np.abs(prefill[:32] - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, f"torch vs NumPy trunk: max relative error {rel:.3g}"


def test_mtp_draft_agrees_with_numpy(files, tokens):
    model = fle_engine.load(files[0])
    load_mtp(model, files[1])
    npm = NumpyQwen4Exp(files[0], files[1])
    n = 30
    logits, hidden = npm.run(tokens[:n + 1])
    state = model.new_state(40)
    model.forward(tokens[:n], state)
    tok, got = draft(model, state)
    want = npm.mtp_logits(hidden[:n], tokens[1:n] + [int(logits[n - 1].argmax())])[-1]
    assert int(tok) == int(want.argmax())
    assert np.abs(got.numpy() - want).max() / np.abs(want).max() < 1e-4
    # one decode step later the provisional pair is redone with the real token
    model.forward([tokens[n]], state)
    tok, got = draft(model, state)
    want = npm.mtp_logits(hidden[:n + 1], tokens[1:n + 1] + [int(logits[n].argmax())])[-1]
    assert int(tok) == int(want.argmax())
    assert np.abs(got.numpy() - want).max() / np.abs(want).max() < 1e-4
    again, got2 = draft(model, state)    # nothing new: the provisional pair is redone, same draft
    assert int(again) == int(tok) and torch.allclose(got, got2, rtol=0, atol=1e-5 * float(got.abs().max()))
    with pytest.raises(FleError):
        draft(model, model.new_state(8))  # nothing to draft from


def test_mtp_inside_the_trunk_file(tmp_path, files, tokens):
    """A file that holds the head as block N loads it with the trunk, and
    drafts as the separate head of the same weights does."""
    inside = make_model(tmp_path / "inside.gguf", "qwen4exp", seed=3, mix="f32", mtp="inside", **SMALL)
    a = fle_engine.load(inside)
    assert a.args.n_layer == 4 and a.args.n_mtp == 1 and a.net.mtp is not None
    b = fle_engine.load(files[0])
    load_mtp(b, files[1])
    drafts = []
    for m in (a, b):
        st = m.new_state(24)
        m.forward(tokens[:20], st)
        drafts.append(draft(m, st)[1].numpy())
    assert np.allclose(drafts[0], drafts[1], rtol=0, atol=1e-5 * np.abs(drafts[1]).max())


def test_load_mtp_rejects_a_foreign_file(tmp_path, model):
    other = make_model(tmp_path / "other.gguf", "qwen4exp", seed=0, mix="f32", mtp="separate",
                       embedding_length=128, **SMALL)
    with pytest.raises(FleError):
        load_mtp(fle_engine.load(model.path), mtp_path(other))
