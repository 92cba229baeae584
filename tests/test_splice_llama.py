"""Spliced models as llama.cpp (llama-cpp-python 0.3.36) sees them: a mixed
splice loads and gives exactly the logits of the factory's model written
directly in that per-layer mix; a splice that keeps every layer (provenance
with an empty donor list) gives exactly the base's."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fle_quant.select import Selection
from fle_quant.splice import splice
from fle_quant.synth import make_model

pytestmark = pytest.mark.reference

llama_cpp = pytest.importorskip("llama_cpp")

N_LAYERS = 4
SIZE = dict(expert_count=4, expert_used_count=2)
BASE_MIX = [(r"\.ffn_gate_inp\.weight$", "F32"), (r"_exps\.weight$", "IQ4_XS"), (r".", "Q8_0")]
A_MIX = [(r"\.ffn_gate_inp\.weight$", "F16"), (r"_exps\.weight$", "IQ3_S"), (r".", "F16")]
B_MIX = [(r"_exps\.weight$", "Q8_0")]
DIRECT_MIX = [(r"\.ffn_gate_inp\.weight$", "F32"), (r"^blk\.1\.ffn_\w+_exps\.weight$", "IQ3_S"),
              (r"^blk\.2\.ffn_\w+_exps\.weight$", "Q8_0"), (r"_exps\.weight$", "IQ4_XS"), (r".", "Q8_0")]
TEXT = (b"The model reads a file of tensors and writes another one. Each layer has a router and a set of "
        b"experts; the numbers 2048, 512 and 10 are sizes.")


def write_selection(path, sources, base="base"):
    sel = Selection(mode="target", base=base, sources=dict(sources), layer_errors={k: 0.0 for k in sources},
                    layer_bytes={k: 0 for k in sources}, predicted_error=0.0, size_bytes=0, fixed_bytes=0,
                    step_bytes=1, table_sha256="0" * 64, base_size_bytes=0, base_error=0.0, target_bytes=1)
    path.write_text(json.dumps(sel.to_json()))
    return path


def logits_of(path, toks=None):
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, logits_all=True, verbose=False,
                          type_k=0, type_v=0, flash_attn=False)
    try:
        if toks is None:
            toks = llm.tokenize(TEXT, add_bos=False, special=False)[:64]
        llm.reset()
        llm.eval(toks)
        return np.array(llm.scores[: len(toks)], dtype=np.float32), toks
    finally:
        llm.close()


def test_mixed_splice_runs_like_the_direct_model(tmp_path, monkeypatch):
    monkeypatch.setenv("FLE_CACHE_DIR", str(tmp_path / "cache"))
    m = {name: make_model(tmp_path / f"{name}.gguf", "qwen3moe", seed=3, mix=mix, block_count=N_LAYERS, **SIZE)
         for name, mix in (("base", BASE_MIX), ("A", A_MIX), ("B", B_MIX), ("direct", DIRECT_MIX))}
    mixed = tmp_path / "mixed.gguf"
    splice(m["base"], {"A": m["A"], "B": m["B"]},
           write_selection(tmp_path / "sel.json", {0: "base", 1: "A", 2: "B", 3: "base"}), mixed)
    same = tmp_path / "same.gguf"
    splice(m["base"], {}, write_selection(tmp_path / "all.json", {i: "base" for i in range(N_LAYERS)}), same)

    want, toks = logits_of(m["direct"])
    got, _ = logits_of(mixed, toks)
    assert len(toks) >= 16 and np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)

    base, _ = logits_of(m["base"], toks)
    np.testing.assert_array_equal(logits_of(same, toks)[0], base)
    # the donors' layers change the output: the comparison above can fail
    assert np.abs(got - base).max() > 1e-3
