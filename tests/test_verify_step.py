"""The engine's verify step: T = 1 + n tokens in one pass (drafted decoding).

On the engine level (reference operations without CUDA; compiled kernels
and captured graphs with it) the T-token step is held to T one-token steps
fed the same tokens, and a rewind to a fresh run. The T-token kernels are
checked against their references in Triton's interpreter, among them the
union read of the routed experts: every distinct expert of a step is read
by one program, for all the tokens routed to it.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fle_engine.kernels import engine_ops  # noqa: E402
from fle_engine.runtime import Engine  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.ggml_types import GGMLType  # noqa: E402
from fle_quant.quants import quantize  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("exact_float32")
DEVICE = torch.device("cuda" if CUDA else "cpu")
PROMPT = [1, 17, 42, 99, 5, 7]
DRAFTS = [300, 12, 77]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("verify") / "m.gguf", "qwen3moe", seed=3, mix="release",
                      routing_skew=1.0)


@pytest.fixture(scope="module")
def next_file(tmp_path_factory):
    """qwen3next: GDN layers (recurrent state), gated attention, a shared expert."""
    return make_model(tmp_path_factory.mktemp("verify_next") / "n.gguf", "qwen3next", seed=4, mix="release",
                      routing_skew=1.0)


@pytest.fixture(params=["qwen3moe", "qwen3next"])
def arch_file(request, model_file, next_file):
    return model_file if request.param == "qwen3moe" else next_file


def _engine(path, budget=0, **kw):
    return Engine(path, device=DEVICE, cache_budget=budget, ctx_size=64, cache_type_k="f32", cache_type_v="f32",
                  profile_path="none", progress=False, log=lambda m: None, **kw)


def _close(a, b, tol=1e-5):
    scale = float(b.abs().max()) or 1.0
    assert float((a - b).abs().max()) <= tol * scale, float((a - b).abs().max()) / scale


def _single_steps(eng, tokens):
    """Greedy tokens and logits of one-token steps fed ``tokens`` in turn."""
    toks, logits = [], []
    for t in tokens:
        toks += eng.verify_step([t])
        logits.append(eng.state.bufs.logits[0].float().cpu().clone())
    return toks, torch.stack(logits)


@pytest.mark.parametrize("n_tok", [2, 3, 4])
def test_verify_step_equals_single_steps(arch_file, n_tok):
    """At position 6 (after a prompt), a step of T tokens gives the greedy
    tokens and logits of T one-token steps fed the same tokens (teacher
    forcing); with two slots per layer some experts hit and some miss. The
    one-token steps run in a second engine that saw the same prompt (on
    qwen3next the verify step has advanced the GDN states past the prompt)."""
    eng = _engine(arch_file, 2 * _one_expert_per_layer(arch_file))
    g = eng.generate(PROMPT, 1)
    feed = g + DRAFTS[:n_tok - 1]
    got = eng.verify_step(feed)
    got_logits = eng.state.multi.logits[:n_tok].float().cpu().clone()
    assert eng.launched == len(PROMPT) + n_tok and int(eng.state.pos) == len(PROMPT) + n_tok
    eng.close()
    ref = _engine(arch_file, 2 * _one_expert_per_layer(arch_file))
    assert ref.generate(PROMPT, 1) == g
    want, want_logits = _single_steps(ref, feed)
    assert got == want
    _close(got_logits, want_logits)
    ref.close()


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_rewind_then_continue_equals_a_fresh_run(arch_file, keep):
    """Drafts rejected after the first ``keep - 1``: rewind drops their
    positions (on qwen3next it puts the GDN states back to the verify step's
    snapshot after its kept tokens), and the next verify step equals the
    same step in a fresh run that never saw the rejected drafts."""
    eng = _engine(arch_file)
    g = eng.generate(PROMPT, 1)
    out = eng.verify_step(g + DRAFTS)                # T = 4; drafts keep .. 3 taken as rejected
    eng.rewind(4 - keep)
    assert eng.launched == len(PROMPT) + keep
    nxt = [out[keep - 1], 5, 6]
    got = eng.verify_step(nxt)
    got_logits = eng.state.multi.logits[:3].float().cpu().clone()
    eng.close()

    fresh = _engine(arch_file)
    kept = (g + DRAFTS)[:keep]
    assert fresh.generate(PROMPT + kept, 1) == [out[keep - 1]]
    assert fresh.verify_step(nxt) == got
    _close(fresh.state.multi.logits[:3].float().cpu(), got_logits)
    fresh.close()


def test_verify_step_arguments(model_file, tmp_path):
    eng = _engine(model_file)
    eng.generate(PROMPT, 1)
    for bad in ([], [1, 2, 3, 4, 5]):
        with pytest.raises(FleError, match="1 to 4 tokens"):
            eng.verify_step(bad)
    with pytest.raises(FleError, match="rewind by 99"):
        eng.rewind(99)
    eng.close()

def test_rewind_on_recurrent_state_is_bounded(next_file, tmp_path):
    """GDN states can only be put back within the verify step that just ran:
    not after a one-token step, not by T or more, not twice; qwen4exp has no
    T-token step yet and says so."""
    eng = _engine(next_file)
    eng.generate(PROMPT, 1)
    with pytest.raises(FleError, match="recurrent"):
        eng.rewind(1)                                # after decode steps: no snapshot
    out = eng.verify_step([3, 4, 5])
    with pytest.raises(FleError, match="recurrent"):
        eng.rewind(3)                                # T = 3: at most 2
    eng.rewind(2)
    with pytest.raises(FleError, match="recurrent"):
        eng.rewind(1)                                # the snapshots are spent
    eng.rewind(0)
    assert len(out) == 3 and eng.launched == len(PROMPT) + 1
    eng.close()
    q4 = make_model(tmp_path / "q4.gguf", "qwen4exp", seed=5, mix="release", routing_skew=1.0)
    eng = _engine(q4)
    eng.generate(PROMPT, 1)
    with pytest.raises(FleError, match="hyper-connections"):
        eng.verify_step([1, 2])
    eng.close()


def _one_expert_per_layer(path) -> int:
    probe = _engine(path)
    n = max(lay.expert_bytes for lay in probe.net.layouts.values())
    probe.close()
    return n * probe.args.n_layer


def test_step_cost_counts_each_missed_expert_once(model_file):
    """With no slots every routed expert misses: one token's step reads each
    of its experts once (union = sum), a 4-token step each distinct expert
    of a layer once, less than the sum over its tokens when they share."""
    eng = _engine(model_file)
    eng.generate(PROMPT, 1)
    a = eng.args
    one = eng.step_cost(1, reps=3)
    assert one["pcie_bytes_union"] == one["pcie_bytes_sum"] > 0 and one["hit_rate"] == 0.0
    assert one["miss_rows"] == one["distinct_misses"] == a.n_layer * a.n_expert_used
    four = eng.step_cost(4, reps=3)
    assert four["miss_rows"] == 4 * a.n_layer * a.n_expert_used
    assert a.n_layer * a.n_expert_used <= four["distinct_misses"] < four["miss_rows"]     # 8 experts: tokens share
    assert four["pcie_bytes_sum"] == 4 * one["pcie_bytes_sum"]             # every token reads K per layer
    assert one["pcie_bytes_sum"] <= four["pcie_bytes_union"] < four["pcie_bytes_sum"]
    assert eng.launched == len(PROMPT) and int(eng.state.pos) == len(PROMPT)           # the position is kept
    eng.close()


def test_fast_verify_step_equals_reference(tmp_path):
    """The whole T-token step with the fast kernels (Triton's interpreter
    without CUDA: one layer and one step, to keep it short; the kernel
    tests below cover later positions) against the reference ops, no
    expert cached."""
    pytest.importorskip("triton")
    path = make_model(tmp_path / "one.gguf", "qwen3moe", seed=3, mix="release", routing_skew=1.0, block_count=1)
    res = []
    for impl in ("reference", "triton"):
        eng = _engine(path, impl=impl)
        toks = eng.verify_step([27, 5, 11])
        res.append((toks, eng.state.multi.logits[:3].float().cpu().clone()))
        eng.close()
    assert res[0][0] == res[1][0]
    _close(res[1][1], res[0][1])


# ---------------------------------------------------------------------------
# the T-token kernels against their references (Triton's interpreter without CUDA)


@pytest.fixture(scope="module")
def fast():
    pytest.importorskip("triton")
    return engine_ops.pick("triton", DEVICE)


def _expert_store(qtype, n_exp, n_ff, n_embd, cached, seed):
    """Host experts (gate|up then down, the engine's layout), slots holding
    ``cached``, and the layout's numbers."""
    rng = np.random.default_rng(seed)
    n_in_d = n_ff if qtype == GGMLType.Q8_0 else 256
    rb_gu = quantize(np.zeros((1, n_embd), np.float32), qtype).shape[-1]
    rb_d = quantize(np.zeros((1, n_in_d), np.float32), qtype).shape[-1]
    gu = quantize(rng.standard_normal((n_exp * 2 * n_ff, n_embd)).astype(np.float32) * 0.1, qtype)
    dn = quantize(rng.standard_normal((n_exp * n_embd, n_in_d)).astype(np.float32) * 0.1, qtype)
    d_off = (2 * n_ff * rb_gu + 15) // 16 * 16
    eb = (d_off + n_embd * rb_d + 15) // 16 * 16
    host = torch.zeros(n_exp, eb, dtype=torch.uint8)
    host[:, :2 * n_ff * rb_gu] = torch.from_numpy(gu.reshape(n_exp, -1))
    host[:, d_off:d_off + n_embd * rb_d] = torch.from_numpy(dn.reshape(n_exp, -1))
    slots = torch.zeros(len(cached) + 1, eb, dtype=torch.uint8)
    slot_of = torch.full((n_exp,), -1, dtype=torch.int32)
    for s, e in enumerate(cached):
        slots[s] = host[e]
        slot_of[e] = s
    return host, slots, slot_of, dict(n_in_d=n_in_d, rb_gu=rb_gu, rb_d=rb_d, d_off=d_off, eb=eb)


@pytest.mark.parametrize("qtype,mode", [(GGMLType.IQ4_XS, "miss"), (GGMLType.Q8_0, "hit")])
def test_experts_union_kernel_reads_each_expert_once(fast, qtype, mode):
    """Three tokens of three experts each: expert 2 (missed) is routed by all
    three, expert 1 (cached) by two. The fast kernel's products equal the
    reference's, and exactly one program per distinct expert reads it (the
    first row of each)."""
    n_exp, n_ff, n_embd, n_used = 6, 32, 256, 3
    host, slots, slot_of, g = _expert_store(qtype, n_exp, n_ff, n_embd, (4, 1), int(qtype))
    ids = torch.tensor([1, 2, 4, 0, 2, 1, 2, 5, 3], dtype=torch.int64)
    first = [int(e not in ids[:r].tolist()) for r, e in enumerate(ids.tolist())]
    assert sum(first) == 6                       # distinct experts: 1, 2, 4, 0, 5, 3
    x = torch.randn(3, n_embd, generator=torch.Generator().manual_seed(0)) * 0.5
    wts = torch.rand(ids.numel(), generator=torch.Generator().manual_seed(1))
    wsz = engine_ops.WORDS[qtype].itemsize
    R = ids.numel()
    st = engine_ops.ExpertWords(slots, host, wsz)
    ref_h, ref_y = torch.zeros(R, n_ff), torch.zeros(R, n_embd)
    reads_ref = torch.zeros(R, dtype=torch.int32)
    engine_ops.REFERENCE.experts_union(st, qtype, 0, 0, 0, n_ff, g["rb_gu"], slot_of, ids, x, ref_h, True, n_used,
                                       reads=reads_ref)
    h_in = torch.nn.functional.pad(ref_h, (0, g["n_in_d"] - n_ff)).contiguous()
    engine_ops.REFERENCE.experts_union(st, qtype, 0, g["d_off"] // wsz, 0, n_embd, g["rb_d"], slot_of, ids, h_in,
                                       ref_y, False, n_used, wts)
    # the union of rows equals the per-row kernel's rows
    one_h = torch.zeros(R, n_ff)
    engine_ops.experts_ref(st, qtype, 0, 0, 0, n_ff, g["rb_gu"], slot_of, ids, x, one_h, True, n_used)
    assert torch.equal(one_h, ref_h) and reads_ref.tolist() == first

    dev_slots, dev_host = slots.to(DEVICE), host.to(DEVICE)
    words = dev_slots.view(-1).view(engine_ops.WORDS[qtype])
    delta = (dev_host.data_ptr() - words.data_ptr()) // wsz
    sm, ids_d = slot_of.to(DEVICE), ids.to(DEVICE)
    h = torch.zeros(R, n_ff, device=DEVICE)
    reads = torch.full((R,), 7, dtype=torch.int32, device=DEVICE)
    fast.experts_union(words, qtype, delta, 0, g["eb"] // wsz, n_ff, g["rb_gu"], sm, ids_d, x.to(DEVICE), h, True,
                       n_used, mode=mode, reads=reads)
    _close(h.cpu(), ref_h)
    assert reads.cpu().tolist() == first
    y = torch.full((R, n_embd), 7.0, device=DEVICE)
    fast.experts_union(words, qtype, delta, g["d_off"] // wsz, g["eb"] // wsz, n_embd, g["rb_d"], sm, ids_d,
                       h_in.to(DEVICE), y, False, n_used, wts.to(DEVICE), mode=mode, reads=reads)
    _close(y.cpu(), ref_y)
    assert reads.cpu().tolist() == first


@pytest.mark.parametrize("kv", ["f32", "q8_0"])
def test_qk_rope_kv_and_attention_of_t_tokens(fast, kv):
    """T tokens at positions pos .. pos + T - 1: q normed and rotated at each
    token's position, every token's k and v in the cache, and token t's
    attention over positions 0 .. pos + t only (a later token's key is in
    the cache when the earlier token attends); the fast kernels equal the
    references, which are T one-token calls."""
    from fle_engine.kernels.triton_engine import attn_scratch
    from fle_engine.layers import rope_table

    n_head, n_kv, dh, n_pos, n_rot = 8, 2, 64, 48, 32
    cos, sin = (torch.from_numpy(t) for t in rope_table(n_rot, 10000.0, n_pos))
    gen = torch.Generator().manual_seed(3)
    qn, kn = torch.rand(dh, generator=gen) + 0.5, torch.rand(dh, generator=gen) + 0.5
    kc0, vc0 = torch.randn(n_kv, n_pos, dh, generator=gen), torch.randn(n_kv, n_pos, dh, generator=gen)
    width = (n_head + 2 * n_kv) * dh
    for n_tok, pos in ((2, 0), (4, 13), (3, 40)):
        qkv = torch.randn(4, width + 64, generator=gen)[:n_tok]          # rows wider than q | k | v
        res = []
        for ops, dev in ((engine_ops.REFERENCE, torch.device("cpu")), (fast, DEVICE)):
            if kv == "q8_0":
                kc, vc = engine_ops.Q8Cache(n_kv, n_pos, dh, dev), engine_ops.Q8Cache(n_kv, n_pos, dh, dev)
            else:
                kc, vc = kc0.clone().to(dev), vc0.clone().to(dev)
            q = torch.zeros(4, n_head * dh, device=dev)[:n_tok]
            o = torch.zeros(4, n_head * dh, device=dev)[:n_tok]
            partial, ml = attn_scratch(n_kv, n_head, dh, dev, n_tok=4)
            p = torch.tensor([pos], device=dev)
            ops.qk_rope_kv_multi(qkv.to(dev), qn.to(dev), kn.to(dev), 1e-6, cos.to(dev), sin.to(dev), p, n_head,
                                 n_kv, dh, n_rot, q, kc, vc)
            ops.attention_multi(q, kc, vc, p, dh ** -0.5, o, partial, ml)
            cached = [(c.q.cpu(), c.d.cpu()) if kv == "q8_0" else (c.cpu(),) for c in (kc, vc)]
            res.append((q.cpu(), o.cpu(), cached))
        (q0, o0, c0), (q1, o1, c1) = res
        _close(q1, q0)
        _close(o1, o0)
        for a, b in zip(c0, c1):
            for ta, tb in zip(a, b):
                assert torch.equal(ta, tb) if kv == "q8_0" else float((ta - tb).abs().max()) < 1e-5


def test_attention_of_t_tokens_is_causal(fast):
    """Token 0 of a two-token step does not see position pos + 1 (token 1's
    key, already in the cache); token 1 does."""
    from fle_engine.kernels.triton_engine import attn_scratch

    n_head, n_kv, dh, n_pos = 4, 2, 64, 16
    gen = torch.Generator().manual_seed(4)
    kc = torch.randn(n_kv, n_pos, dh, generator=gen).to(DEVICE)
    vc = torch.randn(n_kv, n_pos, dh, generator=gen).to(DEVICE)
    q = torch.randn(2, n_head * dh, generator=gen).to(DEVICE)
    partial, ml = attn_scratch(n_kv, n_head, dh, DEVICE, n_tok=2)
    outs = []
    for v in (0.0, 5.0):
        kc[:, 11] = v
        o = torch.zeros(2, n_head * dh, device=DEVICE)
        fast.attention_multi(q, kc, vc, torch.tensor([10], device=DEVICE), dh ** -0.5, o, partial, ml)
        outs.append(o.cpu())
    assert torch.equal(outs[0][0], outs[1][0]) and not torch.equal(outs[0][1], outs[1][1])


# ---------------------------------------------------------------------------
# the captured graphs


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_verify_graphs_captured_and_equal_to_eager(model_file):
    """With CUDA every T in 2..4 gets its own graph (captured on first use,
    mid-sequence), whose tokens and logits equal the eager step's; a host
    synchronisation inside the step makes its capture fail."""
    budget = 2 * _one_expert_per_layer(model_file)
    eng, eager = _engine(model_file, budget), _engine(model_file, budget, graphs=False)
    assert eng._graph is not None and eager._graph is None
    for e in (eng, eager):
        e.generate(PROMPT, 1)
    for n_tok in (2, 3, 4):
        feed = [3] + DRAFTS[:n_tok - 1]
        assert eng.verify_step(feed) == eager.verify_step(feed)
        _close(eng.state.multi.logits[:n_tok].cpu(), eager.state.multi.logits[:n_tok].cpu(), 1e-4)
        eng.rewind(n_tok)
        eager.rewind(n_tok)
    assert sorted(eng._multi_graphs) == [2, 3, 4]
    cost = eng.step_cost(3, reps=5)
    assert cost["seconds"] > 0 and cost["pcie_bytes_union"] <= cost["pcie_bytes_sum"]
    step = eng.net.step_multi

    def with_sync(*a):
        step(*a)
        eng.state.pos.item()

    eng.net.step_multi = with_sync
    eng._multi_graphs = {}
    with pytest.raises(Exception):
        eng.verify_step([1, 2])
    eng.close()
    eager.close()


def test_bench_script_smoke(model_file, tmp_path):
    """bench/verify_step.py on the factory model with the reference side
    (the times mean nothing here): one row per n = 0..3, the modelled rate
    from E(n) = 1 + a1 + a1 a2 + ..."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).parents[1] / "bench" / "verify_step.py"
    spec = importlib.util.spec_from_file_location("bench_verify", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.expected_tokens((0.86, 0.78, 0.78), 2) == pytest.approx(1 + 0.86 + 0.86 * 0.78)
    out = tmp_path / "r.json"
    assert bench.main(["--model", str(model_file), "--device", "cpu", "--warmup", "4", "--reps", "1",
                       "--draft-ms", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["pcie_bytes_union"] <= r["pcie_bytes_sum"]
        assert r["modelled_tok_s"] == pytest.approx(r["expected_tokens"] / (r["seconds"] + r["drafts"] * 1e-3))
