"""FLE's reference forward pass on CUDA: prefill equals token-by-token
decode, CUDA logits equal CPU logits, and a decode step can be captured as
a CUDA graph (no host sync, static shapes) and replayed token after token
with the results of eager decoding. Skipped without CUDA."""
from __future__ import annotations

import copy

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_float32")]

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

import fle_engine  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402

ARCHS = ("qwen3moe", "qwen3next", "qwen4exp")
N_TOKENS = 160



@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("cuda")
    return {a: make_model(d / f"{a}.gguf", a, mix="f32", context_length=1024) for a in ARCHS}


def tokens(n, n_vocab, seed=0):
    return np.random.default_rng(seed).integers(0, n_vocab, n).tolist()


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_prefill_decode_and_cpu(paths, arch):
    gpu = fle_engine.load(paths[arch], device="cuda")
    cpu = fle_engine.load(paths[arch], device="cpu")
    toks = tokens(N_TOKENS, gpu.n_vocab)
    full = gpu.logits(toks)
    state = gpu.new_state(N_TOKENS)
    dec = torch.cat([gpu.forward([t], state) for t in toks]).cpu().numpy()
    assert rel_err(dec, full) < 1e-4
    assert rel_err(full, cpu.logits(toks)) < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_step_replays_as_cuda_graph(paths, arch):
    m = fle_engine.load(paths[arch], device="cuda")
    toks = tokens(80, m.n_vocab, seed=1)
    n_prefix = 50
    state = m.new_state(len(toks))
    m.forward(toks[:n_prefix], state)
    eager_state = copy.deepcopy(state)
    want = torch.cat([m.forward([t], eager_state) for t in toks[n_prefix:]]).cpu().numpy()

    static_tok = torch.zeros(1, dtype=torch.long, device="cuda")
    scratch = copy.deepcopy(state)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(2):  # warm-up outside the graph, on a scratch copy of the state
            m.net(static_tok, scratch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode():
        with torch.cuda.graph(graph):
            static_out = m.net(static_tok, state)   # capturing runs nothing: state is untouched
        got = []
        for t in toks[n_prefix:]:
            static_tok.fill_(t)
            graph.replay()
            got.append(static_out.clone())
    got = torch.cat(got).cpu().numpy()
    assert int(state.pos.item()) == len(toks)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_streamed_experts_equal_resident(tmp_path, arch):
    """Experts left in the file and dequantized per call onto the GPU."""
    path = make_model(tmp_path / "r.gguf", arch, mix="release", mtp="none" if arch == "qwen3moe" else "inside")
    resident = fle_engine.load(path, device="cuda", experts="resident")
    streamed = fle_engine.load(path, device="cuda", experts="stream")
    toks = tokens(96, resident.n_vocab, seed=2)
    assert rel_err(streamed.logits(toks), resident.logits(toks)) < 1e-4


@pytest.mark.parametrize("arch", ("qwen3next", "qwen4exp"))
def test_cuda_mtp_head_equals_cpu(tmp_path, arch):
    from fle_engine.mtp import head_logits

    path = make_model(tmp_path / "m.gguf", arch, mix="f32", mtp="inside")
    out = []
    for dev in ("cuda", "cpu"):
        m = fle_engine.load(path, device=dev)
        toks = tokens(64, m.n_vocab, seed=3)
        st = m.new_state(64)
        m.forward(toks, st)
        out.append(head_logits(m, st, st.hidden[:-1], toks[1:]).cpu().numpy())
        d_tok, _ = m.net.draft(st)
        assert 0 <= int(d_tok) < m.n_vocab
    assert rel_err(out[0], out[1]) < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_expert_cache_equals_resident(tmp_path, arch):
    """Expert slots on the GPU, misses on the CPU from the mapped file."""
    from fle_engine.cached_moe import attach_expert_cache

    path = make_model(tmp_path / "c.gguf", arch, mix="release", routing_skew=1.0)
    resident = fle_engine.load(path, device="cuda", experts="resident")
    cached = fle_engine.load(path, device="cuda", experts="stream")
    stores = attach_expert_cache(cached, slots=3)
    toks = tokens(64, resident.n_vocab, seed=4)
    st_a, st_b = resident.new_state(64), cached.new_state(64)
    want = torch.cat([resident.forward([t], st_a) for t in toks]).cpu().numpy()
    got = torch.cat([cached.forward([t], st_b) for t in toks]).cpu().numpy()
    assert rel_err(got, want) < 1e-4
    assert all(0 < s.stats.hits < s.stats.requests for s in stores.values() if s.stats.requests)


def test_cuda_quant_cache_equals_resident(tmp_path):
    """Quantized slots on the GPU, misses read by the kernels from pinned host memory."""
    pytest.importorskip("triton")
    from fle_engine.quant_cache import attach_quant_cache

    path = make_model(tmp_path / "q.gguf", "qwen3moe", mix=[(r"_exps\.weight$", "IQ4_XS"), (r"ffn_gate_inp", "F32"),
                                                            (r".", "Q8_0")], routing_skew=1.0)
    resident = fle_engine.load(path, device="cuda", experts="resident")
    cached = fle_engine.load(path, device="cuda", experts="stream")
    stores = attach_quant_cache(cached, slots=3)
    toks = tokens(48, resident.n_vocab, seed=5)
    st_a, st_b = resident.new_state(48), cached.new_state(48)
    want = torch.cat([resident.forward([t], st_a) for t in toks]).cpu().numpy()
    got = torch.cat([cached.forward([t], st_b) for t in toks]).cpu().numpy()
    for s in stores.values():
        s.update()
    assert rel_err(got, want) < 1e-4
    assert 0 < sum(s.hits for s in stores.values()) < sum(s.requests for s in stores.values())
