"""Streaming weights (``fle_engine.load(path, experts="stream")``): routed
experts and the PLE table stay quantized in the memory-mapped file and are
dequantized per call, so models larger than memory run. The streamed model
must compute what the resident one computes, hold none of those tensors in
process memory, and capture the same MoE records."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fle_engine  # noqa: E402
from fle_engine.layers import MoE  # noqa: E402
from fle_engine.quantized import QuantExperts, QuantRows  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.gguf_reader import GGUFModel  # noqa: E402
from fle_quant.quants import dequantize  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402

ARCHS = ["qwen3moe", "qwen3next", "qwen4exp"]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    arch = request.param
    path = make_model(tmp_path_factory.mktemp(arch) / "m.gguf", arch, seed=2, mix="release",
                      mtp="none" if arch == "qwen3moe" else "inside")
    return path, fle_engine.load(path, experts="resident"), fle_engine.load(path, experts="stream")


def rel(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def param_bytes(model) -> int:
    seen = {}
    for p in model.net.parameters():
        seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def test_streamed_logits_equal_resident(pair):
    path, resident, streamed = pair
    toks = np.random.default_rng(0).integers(0, resident.n_vocab, 80).tolist()
    want = resident.logits(toks)
    assert rel(streamed.logits(toks), want) < 1e-5
    st = streamed.new_state(12)
    dec = np.concatenate([streamed.forward([t], st).numpy() for t in toks[:12]])
    assert rel(dec, want[:12]) < 1e-5


def test_streamed_experts_are_not_in_memory(pair):
    path, resident, streamed = pair
    moes = [m for m in streamed.net.modules() if isinstance(m, MoE)]
    assert moes and all(m.streamed and isinstance(m.gate_exps, QuantExperts) for m in moes)
    with GGUFModel.open(path) as g:
        left = sum(int(np.prod(t.shape)) * 4 for t in g.tensors.values()
                   if t.name.endswith("_exps.weight") or t.name == "per_layer_token_embd.weight")
    # the resident model holds exactly those bytes more, as float32
    assert param_bytes(resident) - param_bytes(streamed) == left
    if streamed.arch == "qwen4exp":
        assert isinstance(streamed.net.ple_table, QuantRows)


def test_capture_records_agree(pair):
    path, resident, streamed = pair
    toks = list(range(3, 40))
    with resident.capturing() as a:
        resident.logits(toks)
    with streamed.capturing() as b:
        streamed.logits(toks)
    assert a.layers.keys() == b.layers.keys()
    for il in a.layers:
        ra, rb = a.layers[il][0], b.layers[il][0]
        assert torch.equal(ra.experts, rb.experts)
        # later layers carry the float rounding of the earlier ones
        assert rel(rb.expert_out, ra.expert_out) < 1e-4
        assert rel(rb.output, ra.output) < 1e-4


def test_quant_tensors_decode_like_the_file(tmp_path):
    path = make_model(tmp_path / "q.gguf", "qwen4exp", seed=1, mix="release", mtp="none")
    with GGUFModel.open(path) as g:
        name = "blk.1.ffn_up_exps.weight"
        t = g.info(name)
        n_in, n_rows, n_exp = t.shape
        qe = QuantExperts(g, name, (n_exp, n_rows, n_in), "cpu", torch.float32)
        full = dequantize(g.tensor_bytes(name), t.qtype).reshape(n_exp, n_rows, n_in)
        assert torch.equal(qe.dense(), torch.from_numpy(full))
        half = QuantExperts(g, name, (n_exp, n_rows // 2, n_in), "cpu", torch.float32, rows=(n_rows // 2, n_rows))
        assert torch.equal(half.get(3), torch.from_numpy(full[3, n_rows // 2:]))
        with pytest.raises(FleError, match="inconsistent"):
            QuantExperts(g, name, (n_exp, n_rows + 1, n_in), "cpu", torch.float32)
        table = g.info("per_layer_token_embd.weight")
        rows = QuantRows(g, "per_layer_token_embd.weight", "cpu", torch.float32)
        dense = dequantize(g.tensor_bytes("per_layer_token_embd.weight"), table.qtype).reshape(table.shape[1], -1)
    idx = torch.tensor([[5, 0, 5], [table.shape[1] - 1, 2, 7]])
    assert torch.equal(rows.lookup(idx), torch.from_numpy(dense)[idx])


def test_expert_mode_checked(tmp_path):
    path = make_model(tmp_path / "m.gguf", "qwen3moe")
    with pytest.raises(FleError, match="experts must be"):
        fle_engine.load(path, experts="lazy")
    assert not fle_engine.load(path).net.streamed          # auto: a small model stays resident
