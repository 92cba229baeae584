"""Pruned models as llama.cpp (llama-cpp-python 0.3.36) runs them: removing
experts that the router never selects leaves every logit in place; removing a
live expert still gives a model that loads and runs."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fle_quant.gguf_reader import GGUFModel
from fle_quant.prune import prune
from fle_quant.synth import make_model

pytestmark = pytest.mark.reference

llama_cpp = pytest.importorskip("llama_cpp")

N_EXPERT = 8
N_DEAD = 2
TEXT = (b"The model reads a file of tensors and writes another one. Each layer has a router, a set of experts "
        b"and a shared expert. Numbers such as 2048, 512 and 10 are sizes. When the tokens repeat, the state "
        b"remembers what came before, and the next token becomes easier to predict.")


def logits_of(path, n_tokens=96):
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=256, n_threads=2, type_k=0, type_v=0,
                          flash_attn=False, verbose=False)
    try:
        toks = llm.tokenize(TEXT, add_bos=False, special=False)
        while len(toks) < n_tokens:
            toks = toks + toks
        toks = toks[:n_tokens]
        llm.reset()
        llm.eval(toks)
        return np.array(llm.scores[:n_tokens], dtype=np.float64)
    finally:
        llm.close()


def write_scores(path, layers):
    path.write_text(json.dumps({"format": "fle.scores/1", "method": "test", "model": "m.gguf", "tokens": 0,
                                "layers": {str(l): [float(v) for v in s] for l, s in layers.items()}}))
    return path


def n_moe_layers(path):
    with GGUFModel.open(path) as m:
        return sum(1 for n in m.tensors if n.endswith(".ffn_gate_inp.weight"))


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next", "qwen4exp"])
def test_pruning_dead_experts_keeps_logits(tmp_path, arch):
    rng = np.random.default_rng(5)
    n_layer = 4
    # different dead experts in every layer (and in qwen4exp's MTP block, which is not written here)
    dead = {l: sorted(int(e) for e in rng.choice(N_EXPERT, N_DEAD, replace=False)) for l in range(n_layer + 1)}
    src = make_model(tmp_path / f"{arch}.gguf", arch, dead_experts=dead, mtp="none")
    assert n_moe_layers(src) == n_layer
    # live experts score in [1, 2), dead ones in [0, 1): the scores alone decide, the dead go
    layers = {l: rng.random(N_EXPERT) + 1.0 for l in range(n_layer)}
    for l in range(n_layer):
        layers[l][dead[l]] -= 1.0
    sc = write_scores(tmp_path / "s.json", layers)
    out = tmp_path / "pruned.gguf"
    result = prune(src, sc, N_EXPERT - N_DEAD, out, progress=False)
    for l, lp in result.trunk.layers.items():
        assert lp.removed == dead[l]

    base = logits_of(src)
    got = logits_of(out)
    assert np.isfinite(base).all() and np.isfinite(got).all()
    scale = np.abs(base).max()
    diff = np.abs(got - base).max()
    print(f"\n{arch}: max |logit diff| {diff:.3g} of max |logit| {scale:.3g}")
    assert np.array_equal(np.argmax(got, axis=-1), np.argmax(base, axis=-1))
    assert diff <= 1e-4 * scale


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
def test_pruning_a_live_expert_runs(tmp_path, arch):
    src = make_model(tmp_path / f"{arch}.gguf", arch, mtp="none")
    rng = np.random.default_rng(6)
    sc = write_scores(tmp_path / "s.json", {l: rng.random(N_EXPERT) for l in range(4)})
    out = tmp_path / "pruned.gguf"
    prune(src, sc, N_EXPERT - 1, out, progress=False)
    base, got = logits_of(src), logits_of(out)
    assert np.isfinite(got).all()
    # the removed experts were routed to: the output moved
    assert np.abs(got - base).max() > 1e-3 * np.abs(base).max()
