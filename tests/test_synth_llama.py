"""Synthetic models as llama.cpp (llama-cpp-python 0.3.36) sees them: they
load, give finite and peaked next-token distributions, and every qwen4exp
component (PLE, HC inject, QSA selection, shared expert) changes them."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fle_quant.errors import FleError
from fle_quant.synth import ARCHS, make_model

pytestmark = pytest.mark.reference

llama_cpp = pytest.importorskip("llama_cpp")

N_TOKENS = 96
TEXT = (b"The model reads a file of tensors and writes another one. Each layer has a router, a set of experts "
        b"and a shared expert. Numbers such as 2048, 512 and 10 are sizes. When the tokens repeat, the state "
        b"remembers what came before, and the next token becomes easier to predict. A good test checks the "
        b"same thing in two different ways and compares the results.")


def load(path):
    return llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=512, n_threads=2, type_k=0, type_v=0,
                           flash_attn=False, verbose=False)


def tokens_for(llm, n=N_TOKENS):
    toks = llm.tokenize(TEXT, add_bos=False, special=False)
    while len(toks) < n:
        toks = toks + toks
    return toks[:n]


def logits_of(path, toks=None):
    llm = load(path)
    try:
        toks = tokens_for(llm) if toks is None else toks
        llm.reset()
        llm.eval(toks)
        return np.array(llm.scores[: len(toks)], dtype=np.float64), toks
    finally:
        llm.close()


def softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def mean_top1(logits):
    return float(softmax(logits).max(axis=-1).mean())


def mean_kld(base, other):
    p, q = softmax(base), softmax(other)
    return float((p * (np.log(p + 1e-30) - np.log(q + 1e-30))).sum(axis=-1).mean())


@pytest.mark.parametrize("mix", ["f32", "release"])
@pytest.mark.parametrize("arch", ARCHS)
def test_loads_and_is_peaked(tmp_path, arch, mix):
    try:
        path = make_model(tmp_path / f"{arch}.gguf", arch, mix=mix)
    except FleError as e:
        if mix == "release" and "quantize" in str(e):
            pytest.skip(f"quantizers for the release mix unavailable: {e}")
        raise
    logits, toks = logits_of(path)
    assert len(set(toks)) > 20
    assert np.isfinite(logits).all()
    top1 = mean_top1(logits)
    print(f"\n{arch} {mix}: mean top-1 probability {top1:.3f}")
    assert top1 >= 0.3
    # and not a constant prediction: the argmax follows the context
    assert len(set(np.argmax(logits, axis=-1).tolist())) > 10


def test_sharded_model_loads(tmp_path):
    whole = make_model(tmp_path / "w.gguf", "qwen3moe")
    first = make_model(tmp_path / "s.gguf", "qwen3moe", split_max_tensors=16)
    assert first.name.startswith("s-00001-of-")
    a, toks = logits_of(whole)
    b, _ = logits_of(first, toks)
    assert np.array_equal(a, b)


def test_real_vocab_loads(tmp_path, llama_models):
    VOCAB_QWEN2 = llama_models / "ggml-vocab-qwen2.gguf"
    path = make_model(tmp_path / "v.gguf", "qwen3moe", vocab=VOCAB_QWEN2, block_count=2, embedding_length=128)
    llm = load(path)
    try:
        ref = llama_cpp.Llama(model_path=str(VOCAB_QWEN2), vocab_only=True, verbose=False)
        toks = llm.tokenize(TEXT, add_bos=False)
        assert toks == ref.tokenize(TEXT, add_bos=False)  # the same tokenizer
        assert llm.n_vocab() == ref.n_vocab()
        llm.eval(toks[:64])
        logits = np.array(llm.scores[:64])
        assert np.isfinite(logits).all()
        print(f"\nqwen3moe with the qwen2 vocabulary: mean top-1 probability {mean_top1(logits):.3f}")
    finally:
        llm.close()


def test_qwen3next_mtp_inside_is_skipped_by_the_trunk_pass(tmp_path):
    """llama.cpp loads a qwen3next file with the MTP block inside
    (block_count = N + 1, nextn_predict_layers = 1) and its trunk pass is the
    same model as the file without the block."""
    plain = make_model(tmp_path / "p.gguf", "qwen3next", mtp="none")
    inside = make_model(tmp_path / "i.gguf", "qwen3next", mtp="inside")
    a, toks = logits_of(plain)
    b, _ = logits_of(inside, toks)
    assert np.allclose(a, b, atol=1e-4)


def _patch(path, tensors=(), keys=None):
    """Zero some tensors and/or set some uint32 keys in place."""
    import gguf

    r = gguf.GGUFReader(path, "r+")
    for t in r.tensors:
        if any(t.name.endswith(s) for s in tensors):
            t.data[...] = 0
    for key, value in (keys or {}).items():
        f = r.fields[key]
        f.parts[f.data[0]][0] = value
    r.data.flush()


@pytest.mark.parametrize("component,tensors,keys", [
    ("PLE", ("ple_value.weight",), None),
    ("HC inject", ("hc_attn_inject.weight", "hc_ffn_inject.weight"), None),
    ("QSA selection", (), {"qwen4exp.attention.indexer.top_k": 4096}),
    ("shared expert", ("ffn_down_shexp.weight",), None),
])
def test_qwen4exp_components_matter(tmp_path, component, tensors, keys):
    base = make_model(tmp_path / "b.gguf", "qwen4exp", mtp="none")
    variant = make_model(tmp_path / "v.gguf", "qwen4exp", mtp="none")
    _patch(variant, tensors, keys)
    a, toks = logits_of(base)
    b, _ = logits_of(variant, toks)
    kld = mean_kld(a, b)
    agree = float((a.argmax(-1) == b.argmax(-1)).mean())
    print(f"\nqwen4exp without {component}: mean KLD {kld:.4f}, top-1 agreement {agree:.2f}")
    assert kld > 0.01
