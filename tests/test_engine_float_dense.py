"""Float dense matrices on the engine: F16 and BF16 weights kept in their
GGUF bytes (float16/bfloat16 tensors, not float32 copies) and multiplied by
the float GEMV (``float_mv``), which widens them in registers; the kernel
against its reference in Triton's interpreter without CUDA, the loaded
matrices against the file, and the engine's greedy tokens against the
reference forward pass.
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
from fle_engine.runtime.weights import DenseMatrix  # noqa: E402
from fle_quant.ggml_types import GGMLType  # noqa: E402
from fle_quant.gguf_reader import open_model  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("exact_float32")
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}
PROMPT, N_TOKENS = [1, 17, 42, 99], 12


@pytest.fixture(scope="module")
def fast():
    pytest.importorskip("triton")
    return engine_ops.pick("triton", DEVICE)


@pytest.mark.parametrize("wdt", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_tok,n_out,n_in", [(1, 515, 200), (2, 515, 200), (3, 1025, 72), (4, 37, 600),
                                              (1, 9, 1000)])
def test_float_mv_kernel_any_float_weights(fast, wdt, n_tok, n_out, n_in, monkeypatch):
    """The fast float product (the weights read in their own type) against
    the reference ``x.float() @ w.float().T``: odd row counts (a last,
    partial block of outputs), row lengths that are no multiple of the
    block, rows of strided buffers and output columns of a wider one."""
    monkeypatch.delenv("FLE_FLOAT_MV", raising=False)
    torch.manual_seed(3)
    x = torch.randn(n_tok + 2, n_in)[1:n_tok + 1]
    w = torch.randn(n_out, n_in).to(wdt)
    want = x @ w.float().T
    outs = []
    for ops, dev in ((engine_ops.REFERENCE, torch.device("cpu")), (fast, DEVICE)):
        wide = torch.full((n_tok + 1, n_out + 5), 7.0, device=dev)
        out = wide[:n_tok, 2:2 + n_out]                       # columns of a wider buffer, as qkv's parts
        ops.float_mv(x.to(dev), w.to(dev), out)
        rest = wide.cpu().clone()
        rest[:n_tok, 2:2 + n_out] = 7.0
        assert rest.eq(7.0).all()                             # nothing written outside the rows and columns
        outs.append(out.cpu())
    ref, got = outs
    scale = float(want.abs().max())
    assert float((ref - want).abs().max()) <= 1e-5 * scale
    assert float((got - ref).abs().max()) <= 1e-5 * scale


def test_float_mv_kernel_many_rows_of_16_bit_weights(fast, monkeypatch):
    """More rows than a program takes (groups of rows, the last one
    partial): a 16-bit matrix stays in the kernel, where torch's matmul
    would need a float32 copy of it."""
    monkeypatch.delenv("FLE_FLOAT_MV", raising=False)
    torch.manual_seed(4)
    n_tok, n_out, n_in = 11, 70, 130
    x = torch.randn(n_tok, n_in)
    w = torch.randn(n_out, n_in).to(torch.float16)
    out = torch.zeros(n_tok, n_out, device=DEVICE)
    fast.float_mv(x.to(DEVICE), w.to(DEVICE), out)
    want = x @ w.float().T
    assert float((out.cpu() - want).abs().max()) <= 1e-5 * float(want.abs().max())


@pytest.fixture(scope="module", params=[GGMLType.F16, GGMLType.BF16], ids=["f16", "bf16"])
def half_file(request, tmp_path_factory):
    """A qwen3moe model whose embedding table, attention and output matrices
    are F16 or BF16 (experts Q8_0, routers F32)."""
    qt = request.param
    path = make_model(tmp_path_factory.mktemp(f"dense_{qt.name}") / "m.gguf", "qwen3moe", seed=3,
                      mix=[(r"\.ffn_gate_inp\.weight$", "F32"), (r"_exps\.weight$", "Q8_0"),
                           (r"attn_(q|k|v|output)\.weight$|^(output|token_embd)\.weight$", qt.name)])
    return path, qt


def _engine(path, **kw):
    return Engine(path, device=DEVICE, cache_budget="auto", ctx_size=64, cache_type_k="f32", cache_type_v="f32",
                  profile_path="none", progress=False, log=lambda m: None, **kw)


def _dense_matrices(net) -> list[DenseMatrix]:
    mats = [net.output]
    for L in net.layers:
        at = L.mixer
        mats += [at.wo] + ([at.qkv] if at.qkv is not None else list(at.parts))
    return mats


def test_dense_matrices_keep_their_16_bit_bytes(half_file):
    """Loaded, every F16/BF16 matrix is a float16/bfloat16 tensor of the
    file's size (no float32 copy) holding the file's bytes."""
    path, qt = half_file
    g = open_model(path)
    names = [n for n, t in g.tensors.items() if t.qtype == qt and n != "token_embd.weight"]
    assert any(n.endswith("attn_q.weight") for n in names) and "output.weight" in names
    eng = _engine(path)
    mats = _dense_matrices(eng.net)
    assert {m.qtype for m in mats} == {qt}
    assert all(m.data.dtype == DTYPES[qt] and m.data.shape == (m.n_out, m.n_in) for m in mats)
    assert sum(m.nbytes for m in mats) == sum(g.info(n).n_bytes for n in names)
    for m in (eng.net.output, eng.net.layers[0].mixer.wo):
        raw = g.tensor_bytes(m.name).reshape(m.n_out, -1)
        assert np.array_equal(m.data.cpu().view(torch.uint8).numpy(), raw)
    eng.close()


def test_greedy_tokens_equal_reference_with_16_bit_dense(half_file):
    """The engine's greedy tokens on the 16-bit model are the reference
    forward pass's (one token per call)."""
    path, _ = half_file
    model = load(path, device=DEVICE, experts="resident")
    state = model.new_state(len(PROMPT) + N_TOKENS + 8)
    out = model.forward(PROMPT, state)
    want = []
    while len(want) < N_TOKENS:
        want.append(int(torch.argmax(out[-1])))
        out = model.forward([want[-1]], state)
    eng = _engine(path)
    assert eng.generate(PROMPT, N_TOKENS) == want
    eng.close()


def test_prefill_with_16_bit_dense_equals_decode_steps(half_file):
    """A prompt through the prefill (the 16-bit matrices converted for each
    many-row product only) gives the greedy tokens of the same prompt fed
    as decode steps."""
    path, _ = half_file
    prompt = [int(t) for t in np.random.default_rng(5).integers(1, 200, 20)]
    steps = _engine(path, ubatch=0)
    assert steps.prefill is None
    want = steps.generate(prompt, 6)
    steps.close()
    eng = _engine(path, ubatch=8, prefill_min=1)
    eng.prefill.bf16 = False                 # float32 products: the comparison with decode steps is exact
    assert eng.generate(prompt, 6) == want
    assert eng.prefill.stats.tokens == 20
    eng.close()


def test_verify_step_with_a_16_bit_embedding_table(half_file):
    """A step of several rows takes its embedding rows from the 16-bit
    table (widened to float32) and gives the tokens of one-token steps."""
    path, qt = half_file
    eng = _engine(path)
    assert eng.net.tok_embd.data.dtype == DTYPES[qt]
    g = eng.generate(PROMPT, 1)
    feed = g + [5, 6]
    got = eng.verify_step(feed)
    eng.close()
    ref = _engine(path)
    assert ref.generate(PROMPT, 1) == g
    want = [ref.verify_step([t])[0] for t in feed]
    ref.close()
    assert got == want
