"""qwen3next's MTP head in FLE's forward pass (unit tier): the head inside
the trunk file and the separate head file give the same logits, drafting
during decode equals the head run over the same pairs after a prefill, the
head's attention really uses its own KV cache, and it is scored and pruned
like a trunk layer. Its agreement with llama.cpp's own MTP graph is in
test_qwen3next_mtp_llama.py (reference tier)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fle_engine  # noqa: E402
from fle_engine.mtp import draft, head_logits  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.synth import make_model, mtp_path  # noqa: E402

N = 40


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("q3n_mtp")
    inside = make_model(d / "inside.gguf", "qwen3next", seed=5, mtp="inside")
    separate = make_model(d / "sep.gguf", "qwen3next", seed=5, mtp="separate")
    return inside, separate


@pytest.fixture(scope="module")
def tokens(files):
    m = fle_engine.load(files[0])
    return np.random.default_rng(1).integers(0, m.n_vocab, N).tolist()


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_inside_and_separate_heads_agree(files, tokens):
    a = fle_engine.load(files[0])
    assert a.args.n_layer == 4 and a.net.mtp is not None and a.net.mtp.moe.layer == 4
    b = fle_engine.load(files[1])
    assert b.net.mtp is None
    with pytest.raises(FleError, match="no MTP head"):
        draft(b, b.new_state(8))
    b.net.load_mtp(mtp_path(files[1]))
    out = []
    for m in (a, b):
        st = m.new_state(N)
        m.forward(tokens, st)
        out.append(head_logits(m, st, st.hidden[:-1], tokens[1:]))
    assert torch.equal(out[0], out[1])


def test_draft_during_decode_equals_head_over_prefill(files, tokens):
    m = fle_engine.load(files[0])
    full = m.new_state(N)
    logits = m.forward(tokens, full)
    hidden = full.hidden
    st = m.new_state(N)
    n = 20
    m.forward(tokens[:n], st)
    for j in range(n, N - 1):
        tok, got = draft(m, st)
        want = head_logits(m, full, hidden[:j], tokens[1:j] + [int(st.last_logits[-1].argmax())])[-1]
        assert rel(got, want) < 1e-4, j
        assert int(tok) == int(got.argmax())
        again, got2 = draft(m, st)             # nothing new: the provisional pair is redone
        assert int(again) == int(tok) and rel(got2, got) < 1e-5
        m.forward([tokens[j]], st)
    # the head's queue holds only the newest pair between steps: its KV cache
    # carries the rest, one new position per decode step
    assert len(st.mtp.queue_h) == 2 and st.mtp.pos == N - 3
    assert torch.allclose(st.last_logits[-1], logits[N - 2], rtol=0, atol=1e-4 * float(logits.abs().max()))


def test_head_attends_over_its_cache(files, tokens):
    """Changing an early pair changes a later row's logits: the head's
    attention reads the cached positions, not only the current one."""
    m = fle_engine.load(files[0])
    st = m.new_state(N)
    m.forward(tokens, st)
    h = st.hidden[:-1]
    base = head_logits(m, st, h, tokens[1:])
    other = list(tokens[1:])
    other[0] = (other[0] + 1) % m.n_vocab
    moved = head_logits(m, st, h, other)
    assert rel(moved[0], base[0]) > 1e-3
    assert rel(moved[-1], base[-1]) > 1e-6


def test_foreign_head_refused(tmp_path, files):
    other = make_model(tmp_path / "o.gguf", "qwen3next", seed=0, mtp="separate", embedding_length=128)
    m = fle_engine.load(files[1])
    with pytest.raises(FleError, match="embedding_length"):
        m.net.load_mtp(mtp_path(other))
    with pytest.raises(FleError, match="MTP block"):
        m.net.load_mtp(files[1])     # a trunk without the block
