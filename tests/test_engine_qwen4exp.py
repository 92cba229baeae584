"""qwen4exp on the engine (fle_engine.runtime.qwen4exp) against the reference
forward pass (fle_engine.models.qwen4exp) on a small factory model.

The model has 4 layers (3 GDN + 1 QSA), 4 hyper-connection streams, a PLE
layer, 8 experts (2 used) with a shared expert, and an MTP block in the
trunk file (the engine skips it). Its indexer keeps 4 blocks of 4
positions, so past ~20 tokens QSA drops blocks and the selection matters.
Without CUDA the engine runs its step with the reference operations (the
fused Triton kernels are checked against those in Triton's interpreter);
with CUDA the same tests run the compiled kernels and the captured graph,
and a longer run (256 tokens) is added.
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
from fle_engine.runtime import qwen4exp as rt  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.ggml_types import GGMLType  # noqa: E402
from fle_quant.quants import quantize  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402
from engine_helpers import count_launches, hits_per_step, reference_greedy  # noqa: E402

pytestmark = pytest.mark.usefixtures("exact_float32")
DEVICE = torch.device("cuda" if CUDA else "cpu")
N_TOKENS = 256
PROMPT = [1, 17, 42, 99]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("engine_q4") / "q.gguf", "qwen4exp", seed=5, mix="release",
                      routing_skew=1.0, mtp="inside")


@pytest.fixture(scope="module")
def reference(model_file):
    """Greedy tokens of the reference pass and its logits at every step."""
    return reference_greedy(model_file, PROMPT, N_TOKENS, DEVICE)


def _engine(path, budget, profile="none", kv="f32", **kw):
    kw.setdefault("ctx_size", len(PROMPT) + N_TOKENS + 8)
    kw.setdefault("log", lambda m: None)
    # one token per step for the prompt too: these tests hold the decode step (its policy lag, per-step logits,
    # hooks and counts) to the reference; prompts in T-row steps are tests/test_verify_step.py's (-k short_prompt)
    kw.setdefault("prompt_rows", 1)
    return Engine(path, device=DEVICE, cache_budget=budget, cache_type_k=kv, cache_type_v=kv, profile_path=profile,
                  progress=False, **kw)


def _expert_bytes(path) -> tuple[int, int]:
    """(bytes of one expert of every layer, experts per layer)."""
    eng = _engine(path, 0)
    n = sum(lay.expert_bytes for lay in eng.net.layouts.values())
    e = eng.args.n_expert
    eng.close()
    return n, e


def _logits_run(eng, prompt, feed):
    """Every step's logits (eager runs only: the steps are synchronous)."""
    got = []
    head = eng.net.head

    def recording(state, ops):
        head(state, ops)
        got.append(state.bufs.logits[0].float().cpu().clone())

    eng.net.head = recording
    try:
        eng.generate(prompt, len(feed) + 1, feed=feed)
    finally:
        eng.net.head = head
    return torch.stack(got[len(prompt) - 1:])


def _kld(ref, got) -> float:
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def test_model_exercises_every_component(model_file):
    eng = _engine(model_file, 0)
    net, a = eng.net, eng.args
    assert a.n_layer == 4 and a.n_mtp == 1 and a.hc == 4
    assert [type(L.mixer).__name__ for L in net.layers] == ["GDN", "GDN", "GDN", "QSA"]
    assert net.layers[a.ple_layer].ple is not None and net.ple_table is not None
    assert all(L.moe.shared is not None and L.moe.shared_gate is not None for L in net.layers)
    qsa = net.layers[3].mixer
    assert qsa.n_kept * qsa.ratio < len(PROMPT) + N_TOKENS - qsa.ratio   # blocks get dropped
    eng.close()


@pytest.mark.parametrize("cache", ["small", "all", "warm"])
def test_greedy_tokens_equal_reference(model_file, reference, tmp_path, cache):
    ref, _ = reference
    per, n_exp = _expert_bytes(model_file)
    prof = tmp_path / "p.json"
    if cache == "warm":
        first = _engine(model_file, 2 * per, profile=str(prof))
        first.generate(PROMPT, 16)
        first.close()
        assert prof.exists()
    logs = []
    eng = _engine(model_file, (n_exp if cache == "all" else 2) * per, profile=str(prof) if cache == "warm" else "none",
                  log=logs.append)
    slots = sum(eng.cache.slots_per_layer.values())
    assert slots == (n_exp if cache == "all" else 2) * eng.args.n_layer
    # before any step: a warm start (or a budget for every expert) fills every slot, a cold one none
    assert int((eng.cache.map >= 0).sum()) == (0 if cache == "small" else slots)
    hits = hits_per_step(eng.cache)
    assert eng.generate(PROMPT, N_TOKENS) == ref
    st = eng.cache.stats
    if cache == "all":
        assert st.hit_rate > 0.85         # cold start: only the first steps miss
    else:
        assert 0 < st.hit_rate < 1
    if cache == "warm":
        assert any("warm start from" in m for m in logs)
        assert hits[0] > 0                # the profile's experts serve the first step
    if cache == "small":
        assert hits[:3] == [0, 0, 0]      # cold: decisions serve from step t + 3
    # a second sequence starts from a clean recurrent, PLE and indexer state
    assert eng.generate(PROMPT, 12) == ref[:12]
    eng.close()


def _kv_dtypes(eng) -> set:
    """The dtypes of the QSA layers' K and V caches."""
    return {t.dtype for L, c in zip(eng.net.layers, eng.state.kv) if isinstance(L.mixer, rt.QSA) for t in c[:2]}


@pytest.mark.parametrize("kv", ["f16", "bf16"])
def test_half_kv_cache_greedy_tokens_equal_reference(model_file, reference, kv):
    """-ctk/-ctv f16 (the default) and bf16: the QSA layer's K and V caches
    hold that type, and the greedy tokens equal the reference's (float32
    throughout)."""
    per, _ = _expert_bytes(model_file)
    eng = _engine(model_file, 2 * per, kv=kv)
    assert _kv_dtypes(eng) == {{"f16": torch.float16, "bf16": torch.bfloat16}[kv]}
    assert eng.generate(PROMPT, N_TOKENS) == reference[0]
    eng.close()


def test_262144_positions(model_file, reference):
    """An engine allocated for 262,144 positions (f16 cache, the default)
    decodes the reference's greedy tokens. On this factory model the QSA
    layer's K and V (2 KV heads of 64) take 128 MiB, 176 MiB with the
    indexer's keys and the GDN state."""
    ctx = 262_144
    per, _ = _expert_bytes(model_file)
    eng = _engine(model_file, 2 * per, kv="f16", ctx_size=ctx)
    a = eng.args
    attn = [c for L, c in zip(eng.net.layers, eng.state.kv) if isinstance(L.mixer, rt.QSA)]
    assert len(attn) == 1
    assert sum(t.nbytes for c in attn for t in c[:2]) == 2 * a.n_head_kv * ctx * a.head_dim * 2 == 128 * 2 ** 20
    assert eng.kv_bytes < 180 * 2 ** 20
    assert eng.generate(PROMPT, 8) == reference[0][:8]
    eng.close()


@pytest.mark.parametrize("split", ["cpu", "0.5"])
def test_misses_on_the_cpu_equal_misses_on_the_gpu(model_file, reference, split):
    """runtime.split on qwen4exp: the CPU computes all or half of each
    layer's misses (the CPU team on CUDA, the same rule synchronously
    without), and its greedy tokens equal those of the GPU computing every
    miss, over all the tokens.

    The CPU kernels quantize their activations (Q8_K / Q8_0, as llama.cpp's
    CPU path does); with float activations on the GPU side the two agree
    only to that rounding, which on this model changes a routing or block
    choice within 256 tokens (logits up to ~2.8 std apart under teacher
    forcing, 2026-12-02) and flips a near-tie at token 228. So both runs
    give the GPU's misses the CPU's rounding (``miss_activations="q8"``):
    the two sides then differ only in the order of float sums."""
    ref, _ = reference
    per, _ = _expert_bytes(model_file)
    n = N_TOKENS if CUDA else 48
    gpu = _engine(model_file, 2 * per, miss_split="gpu", miss_activations="q8")
    want = gpu.generate(PROMPT, n)
    assert gpu.cache.stats.misses_per_step() > 0
    gpu.close()
    assert want[:16] == ref[:16]             # the rounding moves the numbers a little, not the first tokens
    eng = _engine(model_file, 2 * per, miss_split=split, miss_activations="q8")
    assert eng.split is not None and eng.split.share == {"cpu": 256, "0.5": 128}[split]
    got = eng.generate(PROMPT, n)
    assert eng.split.cpu_experts > 0
    assert eng.split.cpu.name in ("ggml", "numba")
    if CUDA:
        assert eng.split.team is not None and eng.split.team.experts == eng.split.cpu_experts
    eng.close()
    assert got == want
    if CUDA:
        # FLE's numba kernels in the team and the plain reference kernels in one Python worker give the same
        # tokens to the end
        team = _engine(model_file, 2 * per, miss_split=split, cpu_impl="numba", miss_activations="q8")
        assert team.split.team is not None
        assert team.generate(PROMPT, n) == want
        team.close()
        plain = _engine(model_file, 2 * per, miss_split=split, cpu_impl="reference", miss_activations="q8")
        assert plain.split.team is None
        assert plain.generate(PROMPT, n) == want
        plain.close()


def test_rounded_miss_activations_are_the_cpu_kernels(model_file):
    """round_acts (both sides) gives the values that the CPU kernels'
    quantizer encodes (cpu_experts.acts, ggml's quantize_row_q8_K / _q8_0),
    bit for bit, also for rows picked by their expert's miss."""
    from fle_engine.kernels.cpu_experts.acts import quantize_acts

    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 512, generator=g) * torch.tensor([1e-3, 1.0, 40.0, 3.0]).view(4, 1)
    x[1, 256:] = 0.0                                       # an all-zero block
    x[2, 5], x[2, 9] = -x[2].abs().max(), x[2].abs().max()  # equal |x|: the first one sets the sign
    ops = [engine_ops.REFERENCE]
    if CUDA:
        ops.append(engine_ops.pick("triton", DEVICE))
    for dot in (GGMLType.Q8_K, GGMLType.Q8_0):
        a = quantize_acts(x.numpy(), dot)
        want = torch.from_numpy(a.d).repeat_interleave(256 if dot == GGMLType.Q8_K else 32, 1) * \
            torch.from_numpy(a.qs.astype(np.float32))
        assert not torch.equal(want, x)
        ids, slot_of = torch.tensor([0, 1, 2, 3]), torch.tensor([-1, 4, -1, 0])
        for side in ops:
            dev = DEVICE if side is not engine_ops.REFERENCE else torch.device("cpu")
            out = torch.zeros_like(x, device=dev)
            side.round_acts(x.to(dev), dot == GGMLType.Q8_K, out)
            assert torch.equal(out.cpu(), want)
            out = x.clone().to(dev)
            side.round_acts(out, dot == GGMLType.Q8_K, out, ids.to(dev), slot_of.to(dev))
            assert torch.equal(out.cpu()[[0, 2]], want[[0, 2]]) and torch.equal(out.cpu()[[1, 3]], x[[1, 3]])


def _logits_teacher_forced(eng, prompt, feed):
    """Every position's logits through the product path, CUDA graphs included:
    the sequence grown by one token per call (the kept prompt reused, one
    decode step each), the logits read after each."""
    seq = list(prompt) + list(feed)
    got = []
    for n in range(len(prompt), len(seq) + 1):
        eng.generate(seq[:n], 1)
        got.append(eng.state.bufs.logits[0].float().cpu().clone())
    return torch.stack(got)


def test_logits_within_kld_of_reference(model_file, reference):
    """Logits within mean KLD 1e-4 of the reference pass at every step: in eager
    runs on the CPU, through the captured steps on CUDA."""
    ref, ref_logits = reference
    per, _ = _expert_bytes(model_file)
    eng = _engine(model_file, 3 * per, ubatch=0)
    got = _logits_teacher_forced(eng, PROMPT, ref[:-1]) if CUDA else _logits_run(eng, PROMPT, ref[:-1])
    eng.close()
    assert got.shape == ref_logits.shape
    assert _kld(ref_logits, got) < 1e-4
    assert (got.argmax(-1) == ref_logits.argmax(-1)).all()


@pytest.mark.parametrize("broken", ["qsa_dense", "ple_off", "inject_plain"])
def test_the_comparison_sees_each_component(model_file, reference, broken, monkeypatch):
    """The same comparison fails when one component is computed wrongly:
    QSA attending densely, PLE skipped, or the HC write weights set to 1."""
    if CUDA:
        pytest.skip("eager CPU check")
    ref, ref_logits = reference
    if broken == "qsa_dense":
        real = rt.Net.attend

        def dense(self, at, il, state, ops):
            m = self.layers[il].mixer
            if isinstance(m, rt.QSA):
                m.n_kept = 1 << 20
            return real(self, at, il, state, ops)

        monkeypatch.setattr(rt.Net, "attend", dense)
    elif broken == "ple_off":
        monkeypatch.setattr(rt.Net, "ple", lambda self, p, state, ops: None)
    else:
        real_write = engine_ops.REFERENCE.hc_write_norm

        def plain(res, parts, inject, n_streams, weight, eps, out):
            big = None if inject is None else torch.full_like(inject, 1e4)   # 2 sigmoid(big) = 2
            real_write(res, None if parts is None else parts / 2, big, n_streams, weight, eps, out)

        monkeypatch.setattr(engine_ops.REFERENCE, "hc_write_norm", plain)
    per, _ = _expert_bytes(model_file)
    eng = _engine(model_file, 3 * per)
    got = _logits_run(eng, PROMPT, ref[:-1])
    eng.close()
    assert _kld(ref_logits, got) > 1e-2


def test_indexer_follows_the_used_length(model_file, reference, monkeypatch):
    """QSA's block scores and sort cover the blocks of a length bucket, not
    the allocated context: one variant of the step per bucket (each its own
    CUDA graph), the bucket following the position, and the same tokens as
    the reference. Buckets from 16 positions here so that the factory
    model's short context has several."""
    ref, _ = reference
    monkeypatch.setattr(rt.Net, "MIN_BUCKET", 16)
    per, _ = _expert_bytes(model_file)
    eng = _engine(model_file, 2 * per)
    ctx = eng.ctx_size
    assert eng.net.variants(ctx) == [16, 32, 64, 128, 256, ctx]
    assert [eng.net.variant_for(p, ctx) for p in (0, 15, 16, 31, 32, 255, 256, ctx - 1)] == \
        [16, 16, 32, 32, 64, 256, ctx, ctx]
    if CUDA:
        assert sorted(eng._graphs, key=lambda v: v) == [16, 32, 64, 128, 256, ctx]
    seen = []
    attend = eng.net.attend

    def recording(at, il, state, ops):
        if isinstance(eng.net.layers[il].mixer, rt.QSA):
            seen.append(state.qsa_positions)
        return attend(at, il, state, ops)

    n = N_TOKENS if CUDA else 64
    if not CUDA:                     # eager steps: the scored span of every QSA step is visible
        eng.net.attend = recording
    assert eng.generate(PROMPT, n) == ref[:n]
    if not CUDA:
        n_qsa = sum(isinstance(L.mixer, rt.QSA) for L in eng.net.layers)
        steps = len(PROMPT) + n - 1
        assert seen == [eng.net.variant_for(p, ctx) for p in range(steps) for _ in range(n_qsa)]
        assert seen[0] == 16 and seen[-1] == 128        # positions 0 .. 66
    eng.close()


def test_policy_lag_one_step(model_file):
    """A decision taken from step t's routing (while step t + 1 runs) is
    copied while step t + 2 runs and reaches the device map at the boundary
    before step t + 3, never before."""
    per, _ = _expert_bytes(model_file)
    eng = _engine(model_file, 2 * per)
    cache = eng.cache
    events = []
    obs, bnd = cache.observe, cache.boundary

    def observe(ids, hits):
        before = len(cache._pending)
        obs(ids, hits)
        events.append(("decided", eng.consumed, [tuple(x) for x in cache._pending[before:]]))

    def boundary():
        bnd()
        events.append(("map", eng.launched, cache.map.cpu().numpy().copy()))

    cache.observe, cache.boundary = observe, boundary
    eng.generate(PROMPT, 28)
    maps = {step: m for kind, step, m in events if kind == "map"}
    targets = {}
    for kind, step, adm in events:
        if kind == "decided":
            targets[step] = {(li, s) for layer, _, slot, _ in adm for li, s in zip(layer.tolist(), slot.tolist())}
    checked = 0
    for kind, step, adm in events:
        if kind != "decided" or not adm:
            continue
        for layer, expert, slot, _ in adm:
            for li, e, s in zip(layer.tolist(), expert.tolist(), slot.tolist()):
                if step + 3 not in maps or (li, s) in targets.get(step + 1, ()):
                    continue
                assert maps[step + 1][li, e] != s
                assert maps[step + 2][li, e] != s
                assert maps[step + 3][li, e] == s
                checked += 1
    assert checked > 0
    eng.close()


def test_ple_table_type_without_a_fast_reader_is_refused(tmp_path):
    pytest.importorskip("triton")
    path = make_model(tmp_path / "t.gguf", "qwen4exp", seed=1, mtp="none",
                      mix=[(r"^per_layer_token_embd\.weight$", "Q4_0"), (r"\.ffn_gate_inp\.weight$", "F32"),
                           (r"\.hc_(attn|ffn)_inject\.weight$", "F32"), (r".", "Q8_0")])
    with pytest.raises(FleError, match=r"per_layer_token_embd\.weight.*Q4_0.*row reader"):
        Engine(path, device=DEVICE, impl="triton", cache_budget=0, ctx_size=64, profile_path="none",
               progress=False, log=lambda m: None, graphs=False)


def test_fast_model_of_the_bench_shape_runs(tmp_path):
    """The benchmark's qwen4exp-scaled widths (fewer layers, experts and
    table rows): the fast factory writes random valid blocks the engine
    runs, with the reference's greedy tokens and finite, non-flat logits."""
    import importlib.util
    from pathlib import Path

    from fle_quant.synth.fast import make_fast_model

    spec = importlib.util.spec_from_file_location("bench_engine", Path(__file__).parents[1] / "bench" / "engine.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shape = bench.SHAPES["qwen4exp-scaled"]
    o = dict(shape["overrides"], block_count=4, expert_count=16, vocab_size=2048, context_length=4096,
             ple_head_vocab_sizes="primes:16:1000")
    o = bench.shape_overrides(o)
    path = make_fast_model(tmp_path / "s.gguf", shape["arch"], seed=2, mix=shape["mix"], rules=shape["rules"],
                           mtp=shape["mtp"], routing_skew=1.0, progress=False, **o)
    model = load(path, device=DEVICE, experts="resident")
    state = model.new_state(64)
    out = model.forward(PROMPT, state)
    ref = []
    for _ in range(12):
        ref.append(int(torch.argmax(out[-1])))
        out = model.forward([ref[-1]], state)
    assert torch.isfinite(out).all() and float(out[-1].std()) > 0
    eng = Engine(path, device=DEVICE, cache_budget=0, ctx_size=64, cache_type_k="f32", cache_type_v="f32",
                 profile_path="none", progress=False, log=lambda m: None)
    assert eng.args.hc == 4 and eng.args.n_expert_used == 10 and eng.args.ple_layer == 1
    assert eng.generate(PROMPT, 12) == ref
    eng.close()


# ---------------------------------------------------------------------------
# launches per layer


def test_launch_count(model_file, capsys):
    """The step's launches per layer stay few, the numbers docs/engine.md
    states: HC reads are 5 launches (down, inject, scale + silu, up, mix),
    HC writes fused with the next norm 1; 31 for a GDN layer, 89 for a QSA
    layer, 58 more on the PLE layer (torch blocks)."""
    # counted on the reference side's structure (eager, reference ops) on any device
    eng = _engine(model_file, 0, impl="reference", graphs=False, miss_split="gpu")
    eng.reset()
    c = count_launches(eng)
    eng.close()
    with capsys.disabled():
        print(f"\nqwen4exp launches per step: {c}")
    assert c["per_layer"] == [("GDN", 31), ("ple", 31 + 58), ("GDN", 31), ("QSA", 89)], c


# ---------------------------------------------------------------------------
# the new kernels against their references (Triton's interpreter without CUDA)


@pytest.fixture(scope="module")
def fast():
    pytest.importorskip("triton")
    return engine_ops.pick("triton", DEVICE)


def _close(a, b, tol=1e-5):
    scale = float(b.abs().max()) or 1.0
    assert float((a - b).abs().max()) <= tol * scale, float((a - b).abs().max()) / scale


@pytest.mark.parametrize("n_parts", [0, 1, 3])
def test_hc_write_norm_kernel(fast, n_parts):
    torch.manual_seed(n_parts)
    s, d = 4, 200
    res = torch.randn(s, d)
    parts = torch.randn(1, n_parts, d) if n_parts else None
    inj = torch.randn(1, s) * 3 if n_parts else None
    w = torch.rand(s, d) + 0.5
    outs = []
    for ops, dev in ((engine_ops.REFERENCE, torch.device("cpu")), (fast, DEVICE)):
        r = res.clone().to(dev)
        out = torch.zeros(s, d, device=dev)
        ops.hc_write_norm(r, None if parts is None else parts.to(dev), None if inj is None else inj.to(dev), s,
                          w.to(dev), 1e-6, out)
        outs.append((r.cpu(), out.cpu()))
    _close(outs[1][0], outs[0][0])
    _close(outs[1][1], outs[0][1])
    if n_parts:
        assert not torch.equal(outs[0][0], res)


def test_hc_mix_kernel(fast):
    torch.manual_seed(3)
    s, d = 4, 1500
    xn, g = torch.randn(s, d), torch.randn(1, s * d) * 2
    ref = torch.zeros(d)
    engine_ops.REFERENCE.hc_mix(xn, g, ref)
    got = torch.zeros(d, device=DEVICE)
    fast.hc_mix(xn.to(DEVICE), g.to(DEVICE), got)
    _close(got.cpu(), ref)


@pytest.mark.parametrize("qtype", [GGMLType.IQ4_NL, GGMLType.Q8_0])
def test_gather_rows_kernel_reads_host_rows(fast, qtype):
    rng = np.random.default_rng(int(qtype))
    n_rows, width = 50, 64
    host = torch.from_numpy(quantize(rng.standard_normal((n_rows, width)).astype(np.float32), qtype))
    rows = torch.tensor([3, 49, 0, 17, 17], dtype=torch.int64)
    ref = torch.zeros(rows.numel() * width)
    engine_ops.REFERENCE.gather_rows(host, qtype, 0, rows, ref)
    # the fast form: the rows addressed from another buffer's pointer (as the page-locked table on CUDA)
    anchor = torch.zeros(1, host.shape[1], dtype=torch.uint8, device=DEVICE)
    src = host.to(DEVICE) if CUDA else host
    word = engine_ops.WORDS[qtype].itemsize
    delta = (src.data_ptr() - anchor.data_ptr()) // word
    assert (src.data_ptr() - anchor.data_ptr()) % word == 0
    got = torch.zeros(rows.numel() * width, device=DEVICE)
    fast.gather_rows(anchor, qtype, delta, rows.to(DEVICE), got)
    assert torch.equal(got.cpu(), ref)


def test_attention_with_block_mask_kernel(fast):
    from fle_engine.kernels.triton_engine import attn_scratch

    torch.manual_seed(4)
    n_head, n_kv, dh, n_pos, ratio = 8, 2, 64, 300, 4
    kc, vc = torch.randn(n_kv, n_pos, dh), torch.randn(n_kv, n_pos, dh)
    n_blk = -(-n_pos // ratio)
    for pos, kept in ((0, [0]), (37, [1, 5, 9]), (250, [0, 7, 62]), (299, list(range(0, n_blk, 3)))):
        keep = torch.zeros(n_blk, dtype=torch.int32)
        keep[kept] = 1
        keep[(pos + 1) // ratio:] = 1              # the tail
        q = torch.randn(n_head * dh)
        p = torch.tensor([pos])
        ref = torch.zeros(n_head * dh)
        engine_ops.REFERENCE.attention(q, kc, vc, p, dh ** -0.5, ref, keep=keep, ratio=ratio)
        dense = torch.zeros(n_head * dh)
        engine_ops.REFERENCE.attention(q, kc, vc, p, dh ** -0.5, dense)
        if pos > 8:
            assert not torch.allclose(ref, dense)
        partial, ml = attn_scratch(n_kv, n_head, dh, DEVICE)
        got = torch.zeros(n_head * dh, device=DEVICE)
        fast.attention(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), p.to(DEVICE), dh ** -0.5, got, partial, ml,
                       keep=keep.to(DEVICE), ratio=ratio)
        _close(got.cpu(), ref)


# ---------------------------------------------------------------------------
# CUDA: the captured graph


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_graph_256_tokens_and_no_host_sync(model_file, reference):
    """256 greedy tokens of the captured step equal the reference's (the
    parametrized test above runs them too on CUDA); a host sync put into
    the step makes capture fail."""
    ref, _ = reference
    per, n_exp = _expert_bytes(model_file)
    eng = _engine(model_file, 2 * per)
    assert eng._graph is not None
    assert eng.generate(PROMPT, 256) == ref[:256]
    step = eng.net.step

    def with_sync(*a):
        step(*a)
        eng.state.pos.item()

    eng.net.step = with_sync
    with pytest.raises(Exception):
        eng._capture()
    eng.close()


@pytest.mark.parametrize("tiled,sigmoid", [(True, True), (False, False)])
def test_gdn_step_kernel(fast, tiled, sigmoid):
    """The fused GDN step (conv + silu, L2 norms, delta rule, norm, gate)
    against the reference over three tokens, both head orders and gates."""
    torch.manual_seed(int(tiled))
    nk, nv, d, k_taps = 2, 4, 64, 4
    c = 2 * nk * d + nv * d
    init = dict(qkv=torch.randn(c), z=torch.randn(nv * d), b=torch.randn(nv), a=torch.randn(nv) * 3,
                conv_state=torch.randn(k_taps - 1, c), conv_w=torch.randn(c, k_taps), dt_bias=torch.randn(nv),
                ssm_a=-torch.rand(nv) * 2, ssm=torch.randn(nv, d, d) * 0.1, norm=torch.rand(d) + 0.5)
    res = []
    for ops, dev in ((engine_ops.REFERENCE, torch.device("cpu")), (fast, DEVICE)):
        t = {n: v.clone().to(dev) for n, v in init.items()}
        conv_out, out = torch.zeros(c, device=dev), torch.zeros(nv * d, device=dev)
        outs = []
        for step in range(3):
            t["qkv"] = (init["qkv"] * (step + 1)).to(dev)
            ops.gdn_step(t["qkv"], t["z"], t["b"], t["a"], t["conv_state"], t["conv_w"], t["dt_bias"], t["ssm_a"],
                         t["ssm"], t["norm"], 1e-6, nk, tiled, sigmoid, conv_out, out)
            outs.append(out.cpu().clone())
        res.append(outs + [t["ssm"].cpu(), t["conv_state"].cpu(), conv_out.cpu()])
    for got, ref in zip(res[1], res[0]):
        _close(got, ref)
