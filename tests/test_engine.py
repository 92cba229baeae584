"""The engine runtime (fle_engine.runtime) against the reference forward pass.

Without CUDA the engine runs the same step with the reference operations
(fle_engine.kernels.engine_ops) and the same ordering of steps and cache
policy (decisions from step t serve from step t + 3); the fused Triton
kernels are checked against those references in Triton's interpreter.
With CUDA the same tests run the compiled kernels and the captured graph.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fle_engine.expert_cache import Profile, save_profile  # noqa: E402
from fle_engine.kernels import engine_ops  # noqa: E402
from fle_engine.runtime import Engine, parse_budget  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.ggml_types import GGMLType  # noqa: E402
from fle_quant.quants import quantize  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402
from engine_helpers import count_launches, hits_per_step, reference_greedy  # noqa: E402

pytestmark = pytest.mark.usefixtures("exact_float32")
DEVICE = torch.device("cuda" if CUDA else "cpu")
N_TOKENS = 256


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("engine") / "m.gguf", "qwen3moe", seed=3, mix="release",
                      routing_skew=1.0)


@pytest.fixture(scope="module")
def reference(model_file):
    """Greedy tokens and logits of the reference pass, one token per call."""
    prompt = [1, 17, 42, 99]
    return (prompt, *reference_greedy(model_file, prompt, N_TOKENS, DEVICE))


@pytest.fixture(scope="module")
def next_file(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("engine_next") / "n.gguf", "qwen3next", seed=4, mix="release",
                      routing_skew=1.0)


@pytest.fixture(scope="module")
def next_reference(next_file):
    """qwen3next: greedy tokens and logits of the reference pass."""
    return _reference_greedy(next_file, [1, 17, 42, 99], N_TOKENS)


def _kv_dtypes(eng) -> set:
    """The dtypes of the attention layers' K and V caches."""
    return {t.dtype for L, c in zip(eng.net.layers, eng.state.kv) if type(L.mixer).__name__ != "GDN" for t in c[:2]}


def _reference_greedy(path, prompt, n):
    return reference_greedy(path, prompt, n, DEVICE)


def _engine(path, budget, tmp_path, profile="none", kv="f32", **kw):
    kw.setdefault("ctx_size", N_TOKENS + 16)
    kw.setdefault("log", lambda m: None)
    # one token per step for the prompt too: these tests hold the decode step (its policy lag, per-step logits,
    # hooks and counts) to the reference; prompts in T-row steps are tests/test_verify_step.py's (-k short_prompt)
    kw.setdefault("prompt_rows", 1)
    return Engine(path, device=DEVICE, cache_budget=budget, cache_type_k=kv, cache_type_v=kv, profile_path=profile,
                  progress=False, **kw)


def _expert_bytes(eng) -> int:
    """Bytes of one expert of every layer (closes ``eng``)."""
    n = sum(l.expert_bytes for l in eng.net.layouts.values())
    eng.close()
    return n


@pytest.mark.parametrize("cache", ["small", "all", "warm"])
def test_greedy_tokens_equal_reference(model_file, reference, tmp_path, cache):
    prompt, ref_toks, _ = reference
    prof = tmp_path / "p.json"
    probe = _engine(model_file, 0, tmp_path)
    n_exp = probe.args.n_expert
    per_layer = _expert_bytes(probe) // probe.args.n_layer
    if cache == "warm":
        # a profile from a first run, then a warm start from it
        first = _engine(model_file, 2 * per_layer * probe.args.n_layer, tmp_path, profile=str(prof))
        first.generate(prompt, 32)
        first.close()
        assert prof.exists()
    budget = {"small": 2 * per_layer * probe.args.n_layer, "all": n_exp * per_layer * probe.args.n_layer,
              "warm": 2 * per_layer * probe.args.n_layer}[cache]
    logs = []
    eng = _engine(model_file, budget, tmp_path, profile=str(prof) if cache == "warm" else "none", log=logs.append)
    slots = sum(eng.cache.slots_per_layer.values())
    assert slots == (n_exp if cache == "all" else 2) * eng.args.n_layer
    # before any step: a warm start (or a budget for every expert) fills every slot, a cold one none
    assert int((eng.cache.map >= 0).sum()) == (0 if cache == "small" else slots)
    hits = hits_per_step(eng.cache)
    toks = eng.generate(prompt, N_TOKENS)
    assert toks == ref_toks
    st = eng.cache.stats
    if cache == "all":
        assert st.hit_rate == 1.0 and st.admissions == 0    # every expert loaded at start: nothing misses
    else:
        assert 0 < st.hit_rate < 1
    if cache == "warm":
        assert any("warm start from" in m for m in logs)
        assert hits[0] > 0                                  # the profile's experts serve the first step
    if cache == "small":
        assert hits[:3] == [0, 0, 0]                        # cold: decisions serve from step t + 3
    eng.close()


@pytest.mark.parametrize("cache", ["small", "all"])
def test_qwen3next_greedy_tokens_equal_reference(next_file, next_reference, tmp_path, cache):
    """GDN layers (recurrent state), gated attention with partial rotary,
    routed experts plus the gated shared expert; the engine restarts the
    recurrent state for a new sequence."""
    prompt = [1, 17, 42, 99]
    ref, ref_logits = next_reference
    probe = _engine(next_file, 0, tmp_path)
    n_exp = probe.args.n_expert
    eb = _expert_bytes(probe)
    eng = _engine(next_file, (2 if cache == "small" else n_exp) * eb, tmp_path)
    assert eng.generate(prompt, N_TOKENS) == ref
    assert eng.generate(prompt, 16) == ref[:16]          # a second sequence starts from a clean state
    got = []
    seq = prompt + ref[:15]
    for n in range(len(prompt), len(seq) + 1):
        eng.generate(seq[:n], 1)
        got.append(eng.state.bufs.logits[0].float().cpu().clone())
    lp, lq = torch.log_softmax(ref_logits[:16].double(), -1), torch.log_softmax(torch.stack(got).double(), -1)
    assert float((lp.exp() * (lp - lq)).sum(-1).mean()) < 1e-4
    eng.close()


def test_qwen3next_warm_start_greedy_tokens_equal_reference(next_file, next_reference, tmp_path):
    """A profile from a first run, then a warm start from it: every slot
    filled before the first step, hits from the first step on (a cold start
    has none in its first three), the reference's greedy tokens."""
    prompt = [1, 17, 42, 99]
    prof = tmp_path / "p.json"
    eb = _expert_bytes(_engine(next_file, 0, tmp_path))
    first = _engine(next_file, 2 * eb, tmp_path, profile=str(prof))
    cold_hits = hits_per_step(first.cache)
    first.generate(prompt, 16)
    first.close()
    assert prof.exists() and cold_hits[:3] == [0, 0, 0]
    logs = []
    eng = _engine(next_file, 2 * eb, tmp_path, profile=str(prof), log=logs.append)
    assert any("warm start from" in m for m in logs)
    slots = sum(eng.cache.slots_per_layer.values())
    assert slots == 2 * eng.args.n_layer and int((eng.cache.map >= 0).sum()) == slots
    hits = hits_per_step(eng.cache)
    assert eng.generate(prompt, N_TOKENS) == next_reference[0]
    assert hits[0] > 0 and 0 < eng.cache.stats.hit_rate < 1
    eng.close()


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
@pytest.mark.parametrize("kv", ["f16", "bf16"])
def test_half_kv_cache_greedy_tokens_equal_reference(model_file, next_file, tmp_path, request, arch, kv):
    """-ctk/-ctv f16 (the default) and bf16: the attention layers' K and V
    caches hold that type, and the greedy tokens equal the reference's
    (float32 throughout)."""
    path, ref = ((model_file, request.getfixturevalue("reference")[1]) if arch == "qwen3moe" else
                 (next_file, request.getfixturevalue("next_reference")[0]))
    eng = _engine(path, 2 * _expert_bytes(_engine(path, 0, tmp_path)), tmp_path, kv=kv)
    assert _kv_dtypes(eng) == {{"f16": torch.float16, "bf16": torch.bfloat16}[kv]}
    assert eng.generate([1, 17, 42, 99], N_TOKENS) == ref
    eng.close()


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
def test_262144_positions(model_file, next_file, tmp_path, request, arch):
    """An engine allocated for 262,144 positions (f16 cache, the default)
    decodes the reference's greedy tokens. K and V on these factory models
    (2 KV heads of 64): qwen3moe 4 attention layers, 512 MiB; qwen3next 1
    attention layer (3 GDN), 128 MiB."""
    ctx = 262_144
    path, ref = ((model_file, request.getfixturevalue("reference")[1]) if arch == "qwen3moe" else
                 (next_file, request.getfixturevalue("next_reference")[0]))
    eng = _engine(path, 2 * _expert_bytes(_engine(path, 0, tmp_path)), tmp_path, kv="f16", ctx_size=ctx)
    a = eng.args
    attn = [c for L, c in zip(eng.net.layers, eng.state.kv) if type(L.mixer).__name__ != "GDN"]
    assert len(attn) == {"qwen3moe": 4, "qwen3next": 1}[arch]
    kv_bytes = sum(t.nbytes for c in attn for t in c[:2])
    assert kv_bytes == len(attn) * 2 * a.n_head_kv * ctx * a.head_dim * 2 == len(attn) * 128 * 2 ** 20
    assert eng.generate([1, 17, 42, 99], 8) == ref[:8]
    eng.close()


@pytest.mark.parametrize("arch,split", [("qwen3moe", "cpu"), ("qwen3moe", "0.5"), ("qwen3next", "0.5")])
def test_misses_on_the_cpu_equal_misses_on_the_gpu(model_file, next_file, reference, tmp_path, arch, split):
    """runtime.split: the CPU computes its share of each layer's misses (all
    of them, or half) while the rest are read as before; the greedy tokens
    equal those with every miss on the GPU side."""
    path = model_file if arch == "qwen3moe" else next_file
    prompt = [1, 17, 42, 99]
    n = N_TOKENS if CUDA else 48            # the reference side on the CPU: fewer tokens, same logic
    eb = _expert_bytes(_engine(path, 0, tmp_path))
    base = _engine(path, 2 * eb, tmp_path, miss_split="gpu")
    want = base.generate(prompt, n)
    base.close()
    if arch == "qwen3moe":
        assert want == reference[1][:n]
    eng = _engine(path, 2 * eb, tmp_path, miss_split=split)
    assert eng.split is not None and eng.split.share == {"cpu": 256, "0.5": 128}[split]
    assert eng.generate(prompt, n) == want
    assert eng.split.cpu_experts > 0                  # the CPU did compute misses
    assert eng.split.cpu.name in ("ggml", "numba")   # with the vectorised kernels
    if CUDA:                                          # in the persistent CPU team, fed by the GPU's posts
        assert eng.split.team is not None and eng.split.team.experts == eng.split.cpu_experts
    st = eng.cache.stats
    assert 0 < st.hit_rate < 1
    eng.close()


def test_miss_split_auto_measures_and_decides(model_file, tmp_path):
    """--miss-split auto: both sides measured on one layer (the GPU's launch
    with every routed expert in a slot and with every one missed, the CPU's
    jobs at two sizes), then the share chosen from them (split.choose_share).
    With CUDA the engine does it at start; on the CPU the same measurement
    runs on the reference kernels."""
    from fle_engine.runtime.split import SHARE_ONE, choose_share, cpu_experts, job_model

    eb = _expert_bytes(_engine(model_file, 0, tmp_path))
    eng = _engine(model_file, 2 * eb, tmp_path, miss_split="auto" if CUDA else "gpu")
    try:
        layers = [l for l in eng.net.layouts if eng.cache.slots_per_layer[l] < eng.args.n_expert]
        assert layers and eng.cache.slots_per_layer[layers[0]] > 0
        if CUDA:
            assert eng.miss_bandwidths is not None
        else:
            share = eng._measure_split(cpu_experts(eng.host, eng.net.layouts, "numba"), layers[0], 0.5)
            assert 0 <= share <= SHARE_ONE
        m = eng.miss_bandwidths
        assert m["gpu"] > 0 and m["cpu"] > 0 and m["gpu_base_s"] > 0
        (n1, t1), (n2, t2) = sorted(m["cpu_job_s"].items())
        assert 1 <= n1 < n2 <= eng.args.n_expert_used and t1 > 0 and t2 > 0
        if not CUDA:        # the decision is the function's on these measurements
            t_miss = eng.args.n_expert_used * eng.net.layouts[layers[0]].expert_bytes / m["gpu"]
            k = eng.args.n_expert_used
            want = choose_share(job_model(n1, t1, n2, t2), m["gpu_base_s"], max(0.0, t_miss - m["gpu_base_s"]) / k,
                                k, 0.5)
            assert share == (want if want >= SHARE_ONE // 32 else 0)
    finally:
        eng.close()


def test_miss_split_option():
    from fle_engine.runtime.split import cpu_count, parse_split

    assert parse_split("gpu") == 0 and parse_split("cpu") == 256 and parse_split("auto") == "auto"
    assert parse_split("0.25") == 64
    for bad in ("1.5", "-0.1", "half", "nan"):
        with pytest.raises(FleError, match="--miss-split"):
            parse_split(bad)
    # the rule: the CPU takes round(n_miss * share) of the misses
    assert [cpu_count(n, 128) for n in range(5)] == [0, 1, 1, 2, 2]
    assert [cpu_count(n, 256) for n in range(5)] == [0, 1, 2, 3, 4]
    assert [cpu_count(n, 0) for n in range(5)] == [0] * 5


def test_logits_within_kld_of_reference(model_file, reference, tmp_path):
    prompt, ref_toks, ref_logits = reference
    eng = _engine(model_file, 3 * _expert_bytes(_engine(model_file, 0, tmp_path)), tmp_path)
    got = []
    seq = prompt + ref_toks[:63]
    # teacher-forced: the engine's logits at every position of the reference's sequence
    for n in range(len(prompt), len(seq) + 1):
        eng.generate(seq[:n], 1)
        got.append(eng.state.bufs.logits[0].float().cpu().clone())
    got = torch.stack(got)
    ref = ref_logits[: got.shape[0]]
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    kld = (lp.exp() * (lp - lq)).sum(-1)
    assert float(kld.mean()) < 1e-4
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    eng.close()


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
def test_policy_lag_one_step(model_file, next_file, tmp_path, arch):
    """A decision taken from step t's routing (on the host, while step t + 1
    runs) is copied while step t + 2 runs and reaches the device map at the
    boundary before step t + 3, never before."""
    path = model_file if arch == "qwen3moe" else next_file
    budget = 2 * _expert_bytes(_engine(path, 0, tmp_path))
    eng = _engine(path, budget, tmp_path)
    cache = eng.cache
    events = []
    obs, bnd = cache.observe, cache.boundary

    def observe(ids, hits):
        before = len(cache._pending)
        obs(ids, hits)
        events.append(("decided", eng.consumed, [tuple(a) for a in cache._pending[before:]]))

    def boundary():
        bnd()
        events.append(("map", eng.launched, cache.map.cpu().numpy().copy()))

    cache.observe, cache.boundary = observe, boundary
    eng.generate([1, 2, 3], 40)
    maps = {step: m for kind, step, m in events if kind == "map"}
    targets = {}      # step -> the (layer, slot) pairs its decisions write
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
                    continue        # (a decision of the next step took the slot again before it served)
                assert maps[step + 1][li, e] != s            # not visible at t + 1
                assert maps[step + 2][li, e] != s            # nor while its copy runs
                assert maps[step + 3][li, e] == s            # visible from t + 3 on
                checked += 1
    assert checked > 0
    eng.close()


@pytest.mark.parametrize("n_seq", [1, 2])
def test_closed_engine_is_freed_without_garbage_collection(model_file, tmp_path, n_seq):
    """A closed engine's memory (KV cache, expert slots, weights: gigabytes on
    a GPU) goes with its last reference, not at some later garbage
    collection: the engine holds no reference cycle after close()."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        eng = _engine(model_file, "1MiB", tmp_path, n_seq=n_seq, prefill_min=8)
        eng.generate(list(range(1, 12)), 4)                 # a prefill, then decode steps
        if n_seq > 1:
            eng.step_lanes([0, 1], [5, 6])
        eng.close()
        refs = [weakref.ref(eng), weakref.ref(eng.cache), weakref.ref(eng.state.kv[0][0])]
        del eng
        assert [r() is None for r in refs] == [True, True, True]
    finally:
        gc.enable()


def test_budget_and_options(model_file, tmp_path):
    assert parse_budget("17GiB") == 17 * 2 ** 30
    assert parse_budget("16G") == 16 * 10 ** 9
    assert parse_budget("auto") is None
    with pytest.raises(FleError, match="cache-budget"):
        parse_budget("lots")
    with pytest.raises(FleError, match="keeps the KV cache as f32, f16, bf16, q8_0"):
        Engine(model_file, device=DEVICE, cache_type_k="q4_0", progress=False, log=lambda m: None)
    if not CUDA:
        with pytest.raises(FleError, match="no CUDA device"):
            Engine(model_file, device="cuda", progress=False, log=lambda m: None)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
def test_launch_count(model_file, next_file, tmp_path, arch, capsys):
    """Launches of one decode step, the numbers docs/engine.md states:
    qwen3moe 11 per layer, plus 5 (embedding, first norm, head, argmax,
    position), so 533 for 48 layers; qwen3next 19 per GDN layer and 22 per
    gated attention layer (the gated shared expert's 3 products and 6 torch
    operations in each)."""
    path = model_file if arch == "qwen3moe" else next_file
    # counted on the reference side's structure (eager, reference ops) on any device
    eng = _engine(path, 0, tmp_path, impl="reference", graphs=False)
    eng.reset()
    c = count_launches(eng)
    eng.close()
    with capsys.disabled():
        print(f"\n{arch} launches per step: {c}")
    want = {"qwen3moe": {"Attn": 11}, "qwen3next": {"GDN": 19, "Attn": 22}}[arch]
    assert {kind for kind, _ in c["per_layer"]} == set(want)
    assert all(n == want[kind] for kind, n in c["per_layer"]), c
    assert c["total"] - c["layers"] == 5


def test_other_profile_refused(model_file, tmp_path):
    prof = tmp_path / "other.json"
    save_profile(prof, Profile("0" * 64, {0: np.ones(8)}))
    logs = []
    eng = Engine(model_file, device=DEVICE, cache_budget=0, ctx_size=64, profile_path=str(prof), progress=False,
                 log=logs.append)
    assert any("another model" in m and "starting cold" in m for m in logs)
    eng.close()


# ---------------------------------------------------------------------------
# the fused kernels against their references (Triton's interpreter without CUDA)


@pytest.fixture(scope="module")
def fast():
    pytest.importorskip("triton")
    return engine_ops.pick("triton", DEVICE)


def test_words_match_triton_formats():
    pytest.importorskip("triton")
    from fle_engine.kernels.triton_quant import _FORMATS

    assert {t: f.word for t, f in _FORMATS.items()} == engine_ops.WORDS


def _close(a, b, tol=1e-5):
    scale = float(b.abs().max()) or 1.0
    assert float((a - b).abs().max()) <= tol * scale, float((a - b).abs().max()) / scale


@pytest.mark.parametrize("qtype,config,share,decode", [
    (GGMLType.IQ4_XS, None, 0, None), (GGMLType.Q8_0, None, 0, None), (GGMLType.IQ3_S, None, 0, None),
    (GGMLType.IQ4_XS, "4,1,1,8,2,1", 0, None), (GGMLType.IQ4_XS, None, 256, None), (GGMLType.Q8_0, None, 128, None),
    (GGMLType.IQ4_XS, None, 0, "table"), (GGMLType.IQ4_XS, "8,4,0,16,4,0", 0, "permute"),
    (GGMLType.IQ4_XS, "8,4,0,2,16,4,0,4", 0, "permute"), (GGMLType.IQ4_XS, "2,1,0,4,4,1,0,2", 0, "pdl"),
    (GGMLType.IQ4_XS, None, 128, "pdl")])
def test_experts_kernel(fast, qtype, config, share, decode, monkeypatch):
    # several super-blocks per loop iteration ("chunks", the 4th number of a kernel's config), and
    # programmatic dependent launch ("pdl": on a GPU of sm_90 or later, the down product loading its
    # first weights before it waits for the gate+up kernel)
    if decode == "pdl":
        monkeypatch.setenv("FLE_PDL", "1")
        decode = "permute"
    if config:
        monkeypatch.setenv("FLE_EXPERT_CONFIG", config)      # the unrolled chunk loop, or the hit launch
    if decode:
        # the IQ4_XS decoders of the miss launch (byte permutes run on a GPU only; the interpreter selects)
        from fle_engine.kernels import triton_engine as te

        monkeypatch.setitem(te.IQ4_DECODE, "miss", decode)
        monkeypatch.setitem(te.PAIRED, "miss", True)
        assert te._decode_code("miss") == {"table": 2, "permute": 1 if CUDA else 0}[decode]
    rng = np.random.default_rng(int(qtype))
    n_exp, n_ff, n_embd, n_used = 6, 32, 256, 3
    rb_gu = quantize(np.zeros((1, n_embd), np.float32), qtype).shape[-1]
    rb_d = quantize(np.zeros((1, n_ff if qtype == GGMLType.Q8_0 else 256), np.float32), qtype).shape[-1]
    n_in_d = n_ff if qtype == GGMLType.Q8_0 else 256
    gu = quantize(rng.standard_normal((n_exp * 2 * n_ff, n_embd)).astype(np.float32) * 0.1, qtype)
    dn = quantize(rng.standard_normal((n_exp * n_embd, n_in_d)).astype(np.float32) * 0.1, qtype)
    d_off = (2 * n_ff * rb_gu + 15) // 16 * 16
    eb = (d_off + n_embd * rb_d + 15) // 16 * 16
    host = torch.zeros(n_exp, eb, dtype=torch.uint8)
    host[:, :2 * n_ff * rb_gu] = torch.from_numpy(gu.reshape(n_exp, -1))
    host[:, d_off:d_off + n_embd * rb_d] = torch.from_numpy(dn.reshape(n_exp, -1))
    slots = torch.zeros(3, eb, dtype=torch.uint8)
    slot_of = torch.full((n_exp,), -1, dtype=torch.int32)
    for s, e in enumerate((4, 1)):
        slots[s] = host[e]
        slot_of[e] = s
    ids = torch.tensor([1, 2, 4, 0, 3, 5], dtype=torch.int64)    # two tokens: misses 2 | 0, 3, 5
    x = torch.randn(2, n_embd) * 0.5
    wts = torch.tensor([0.5, 0.3, 0.2, 0.4, 0.4, 0.2])
    R = ids.numel()
    ref_h = torch.zeros(R, n_ff)
    st = engine_ops.ExpertWords(slots, host, engine_ops.WORDS[qtype].itemsize)
    engine_ops.experts_ref(st, qtype, 0, 0, 0, n_ff, rb_gu, slot_of, ids, x, ref_h, True, n_used)
    h_in = ref_h if n_in_d == n_ff else torch.nn.functional.pad(ref_h, (0, n_in_d - n_ff))
    ref_y = torch.zeros(R, n_embd)
    wsz = engine_ops.WORDS[qtype].itemsize
    engine_ops.experts_ref(st, qtype, 0, d_off // wsz, 0, n_embd, rb_d, slot_of, ids, h_in, ref_y, False, n_used,
                           wts)
    # the CPU's share (runtime.split): the last round(share * n_miss) misses of each token are skipped
    on_cpu = {256: [1, 3, 4, 5], 128: [1, 4, 5]}.get(share, [])
    if share:
        split_y = torch.zeros(R, n_embd)
        engine_ops.experts_ref(st, qtype, 0, d_off // wsz, 0, n_embd, rb_d, slot_of, ids, h_in, split_y, False,
                               n_used, wts, cpu_share=share)
        keep = [r for r in range(R) if r not in on_cpu]
        assert torch.equal(split_y[keep], ref_y[keep]) and not split_y[on_cpu].any()
        ref_y[on_cpu] = 0.0
    # the fast form: host bytes addressed from the slot buffer's pointer
    dev_slots, dev_host = slots.to(DEVICE), host.to(DEVICE)
    words = dev_slots.view(-1).view(engine_ops.WORDS[qtype])
    delta = (dev_host.data_ptr() - words.data_ptr()) // wsz
    h = torch.zeros(R, n_ff, device=DEVICE)
    fast.experts(words, qtype, delta, 0, eb // wsz, n_ff, rb_gu, slot_of.to(DEVICE), ids.to(DEVICE), x.to(DEVICE),
                 h, True, n_used, cpu_share=share)
    keep = [r for r in range(R) if r not in on_cpu]
    _close(h.cpu()[keep], ref_h[keep])
    y = torch.full((R, n_embd), 7.0, device=DEVICE)
    fast.experts(words, qtype, delta, d_off // wsz, eb // wsz, n_embd, rb_d, slot_of.to(DEVICE), ids.to(DEVICE),
                 h_in.to(DEVICE).contiguous(), y, False, n_used, wts.to(DEVICE), cpu_share=share)
    _close(y.cpu(), ref_y)


def test_route_topk_kernel(fast):
    torch.manual_seed(0)
    n_exp, k = 24, 5
    logits = torch.randn(1, n_exp) * 3
    slot_of = torch.full((n_exp,), -1, dtype=torch.int32)
    slot_of[[2, 7, 11]] = torch.tensor([0, 1, 2], dtype=torch.int32)
    outs = []
    for ops, dev in ((engine_ops.REFERENCE, torch.device("cpu")), (fast, DEVICE)):
        ids = torch.zeros(1, k, dtype=torch.int64, device=dev)
        w = torch.zeros(1, k, device=dev)
        log = torch.zeros(1, k, dtype=torch.int32, device=dev)
        hits = torch.zeros(1, k, dtype=torch.int32, device=dev)
        ops.route_topk(logits.to(dev), k, 2.5, slot_of.to(dev), ids, w, log, hits)
        order = torch.argsort(ids.cpu()[0])
        outs.append((ids.cpu()[0][order], w.cpu()[0][order], log.cpu()[0][order], hits.cpu()[0][order]))
    (i0, w0, l0, h0), (i1, w1, l1, h1) = outs
    assert i0.tolist() == i1.tolist() and l0.tolist() == l1.tolist() and h0.tolist() == h1.tolist()
    _close(w1, w0)


@pytest.mark.parametrize("n_tok,n_out,n_in,wdt", [(1, 512, 2048, torch.float32), (3, 128, 96, torch.float32),
                                                   (2, 1, 200, torch.float32), (1, 40, 64, torch.bfloat16),
                                                   (12, 16, 64, torch.float32)])
def test_float_mv_kernel(fast, n_tok, n_out, n_in, wdt, monkeypatch):
    """The router's float product: the Triton launch (up to 8 rows; 12 rows go
    to torch's matmul) against the reference, rows of a strided buffer."""
    monkeypatch.delenv("FLE_FLOAT_MV", raising=False)          # the launch is the default
    torch.manual_seed(2)
    x = torch.randn(n_tok + 2, n_in)[1:n_tok + 1]
    w = torch.randn(n_out, n_in).to(wdt)
    outs = []
    for ops, dev in ((engine_ops.REFERENCE, torch.device("cpu")), (fast, DEVICE)):
        out = torch.full((n_tok + 1, n_out), 7.0, device=dev)
        ops.float_mv(x.to(dev), w.to(dev), out[:n_tok])
        assert out[n_tok].eq(7.0).all()          # nothing written past the rows
        outs.append(out[:n_tok].cpu())
    _close(outs[1], outs[0])


def test_add_rmsnorm_kernel(fast):
    torch.manual_seed(1)
    x = torch.randn(1, 96)
    parts = torch.randn(1, 3, 96)
    w = torch.rand(96) + 0.5
    outs = []
    for ops, dev in ((engine_ops.REFERENCE, torch.device("cpu")), (fast, DEVICE)):
        xx = x.clone().to(dev)
        out = torch.zeros(1, 96, device=dev)
        ops.add_rmsnorm(xx, parts.to(dev), w.to(dev), 1e-6, out)
        outs.append((xx.cpu(), out.cpu()))
    _close(outs[1][0], outs[0][0])
    _close(outs[1][1], outs[0][1])


@pytest.mark.parametrize("n_rot", [64, 32])
def test_qk_rope_kv_and_attention_kernels(fast, n_rot):
    from fle_engine.kernels.triton_engine import attn_scratch
    from fle_engine.layers import rope_table

    torch.manual_seed(2)
    n_head, n_kv, dh, n_pos = 8, 2, 64, 300
    cos, sin = (torch.from_numpy(t) for t in rope_table(n_rot, 10000.0, n_pos))
    qn, kn = torch.rand(dh) + 0.5, torch.rand(dh) + 0.5
    kc0, vc0 = torch.randn(n_kv, n_pos, dh), torch.randn(n_kv, n_pos, dh)
    res = []
    for ops, dev in ((engine_ops.REFERENCE, torch.device("cpu")), (fast, DEVICE)):
        kc, vc = kc0.clone().to(dev), vc0.clone().to(dev)
        q = torch.zeros(n_head * dh, device=dev)
        o = torch.zeros(n_head * dh, device=dev)
        partial, ml = attn_scratch(n_kv, n_head, dh, dev)
        for pos in (0, 5, 211):
            torch.manual_seed(pos)
            qkv = torch.randn((n_head + 2 * n_kv) * dh).to(dev)
            p = torch.tensor([pos], device=dev)
            ops.qk_rope_kv(qkv, qn.to(dev), kn.to(dev), 1e-6, cos.to(dev), sin.to(dev), p, n_head, n_kv, dh, n_rot,
                           q, kc, vc)
            ops.attention(q, kc, vc, p, dh ** -0.5, o, partial, ml)
            res.append((q.cpu().clone(), kc[:, pos].cpu().clone(), vc[:, pos].cpu().clone(), o.cpu().clone()))
    half = len(res) // 2
    for a, b in zip(res[:half], res[half:]):
        for ta, tb in zip(a, b):
            _close(tb, ta)


@pytest.mark.parametrize("splits", [8, 128])
def test_attention_with_other_split_counts(fast, monkeypatch, splits):
    """FLE_ATTN_SPLITS (triton_engine.ATTN_SPLITS) other than the default:
    lengths below the split count (empty splits), around one chunk of 16
    positions per split and above it, against the reference."""
    from fle_engine.kernels import triton_engine
    from fle_engine.kernels.triton_engine import attn_scratch

    monkeypatch.setattr(triton_engine, "ATTN_SPLITS", splits)
    torch.manual_seed(11)
    n_head, n_kv, dh, n_pos = 8, 2, 64, 400
    kc, vc = torch.randn(n_kv, n_pos, dh), torch.randn(n_kv, n_pos, dh)
    partial, ml = attn_scratch(n_kv, n_head, dh, DEVICE)
    assert partial.shape[0] == n_kv * splits * 4
    for pos in (0, 5, 130, 399):
        q = torch.randn(n_head * dh)
        p = torch.tensor([pos])
        want = torch.zeros(n_head * dh)
        engine_ops.REFERENCE.attention(q, kc, vc, p, dh ** -0.5, want, None, None)
        got = torch.zeros(n_head * dh, device=DEVICE)
        fast.attention(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), p.to(DEVICE), dh ** -0.5, got, partial, ml)
        _close(got.cpu(), want)


def test_q8_0_kv_quantizer_is_ggml_q8_0():
    """The q8_0 KV cache holds ggml's q8_0 blocks: the bytes equal
    fle_quant's Q8_0 quantizer (bit-exact with ggml's, tests/test_quantize)."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((6, 128)).astype(np.float32) * rng.uniform(0.01, 10, (6, 1)).astype(np.float32)
    x[1, :32] = 0.0                                    # an all-zero block: scale 0, values 0
    x[2, 5] = 127.5 * 0.01                             # a value at a rounding edge
    q, d = engine_ops.q8_0_quantize(torch.from_numpy(x))
    want = quantize(x, GGMLType.Q8_0).reshape(6, 4, 34)
    assert np.array_equal(d.numpy().view(np.uint8).reshape(6, 4, 2), want[:, :, :2])
    assert np.array_equal(q.numpy().view(np.uint8).reshape(6, 4, 32), want[:, :, 2:])


def test_q8_0_kv_cache_kernels(fast):
    """qk_rope_kv writes q8_0 blocks (the same bits on both sides) and
    attention reads them, K and V each q8_0 or float."""
    from fle_engine.kernels.triton_engine import attn_scratch
    from fle_engine.layers import rope_table

    n_head, n_kv, dh, n_pos, n_rot = 8, 2, 64, 64, 64
    cos, sin = (torch.from_numpy(t) for t in rope_table(n_rot, 10000.0, n_pos))
    qn, kn = torch.rand(dh) + 0.5, torch.rand(dh) + 0.5
    for k8, v8 in ((True, True), (True, False), (False, True)):
        res = []
        for ops, dev in ((engine_ops.REFERENCE, torch.device("cpu")), (fast, DEVICE)):
            kc = engine_ops.Q8Cache(n_kv, n_pos, dh, dev) if k8 else torch.zeros(n_kv, n_pos, dh, device=dev)
            vc = engine_ops.Q8Cache(n_kv, n_pos, dh, dev) if v8 else torch.zeros(n_kv, n_pos, dh, device=dev)
            q = torch.zeros(n_head * dh, device=dev)
            o = torch.zeros(n_head * dh, device=dev)
            partial, ml = attn_scratch(n_kv, n_head, dh, dev)
            outs = []
            for pos in range(12):
                torch.manual_seed(pos)
                qkv = torch.randn((n_head + 2 * n_kv) * dh).to(dev)
                p = torch.tensor([pos], device=dev)
                ops.qk_rope_kv(qkv, qn.to(dev), kn.to(dev), 1e-6, cos.to(dev), sin.to(dev), p, n_head, n_kv, dh,
                               n_rot, q, kc, vc)
                ops.attention(q, kc, vc, p, dh ** -0.5, o, partial, ml)
                outs.append(o.cpu().clone())
            res.append((outs, [(c.q.cpu(), c.d.cpu()) for c in (kc, vc) if isinstance(c, engine_ops.Q8Cache)]))
        (o_ref, c_ref), (o_fast, c_fast) = res
        for (qa, da), (qb, db) in zip(c_ref, c_fast):
            assert torch.equal(qa, qb) and torch.equal(da, db)
            assert qa[:, :12].abs().max() == 127 and not qa[:, 12:].any()
        for a, b in zip(o_ref, o_fast):
            _close(b, a)
    # q8_0 values are close to the floats they stand for
    x = torch.randn(n_kv, dh)
    c = engine_ops.Q8Cache(n_kv, 4, dh, torch.device("cpu"))
    c.store(2, x)
    err = (c.values(3)[:, 2] - x).abs().max() / x.abs().max()
    assert 0 < err < 1 / 127 and c.nbytes == n_kv * 4 * (dh + dh // 32 * 2)


def test_q8_0_kv_engine_close_to_f32(model_file, reference, tmp_path):
    """The engine with -ctk/-ctv q8_0: logits within a small KLD of the f32
    cache's over the same teacher-forced tokens (0.003 on this factory model),
    at ~1/4 of the KV bytes."""
    prompt, ref_toks, _ = reference
    seq = prompt + ref_toks[:15]
    got = {}
    for kv in ("f32", "q8_0"):
        eng = Engine(model_file, device=DEVICE, cache_budget="auto", ctx_size=64, cache_type_k=kv, cache_type_v=kv,
                     profile_path="none", progress=False, log=lambda m: None)
        rows = []
        for n in range(len(prompt), len(seq) + 1):
            eng.generate(seq[:n], 1)
            rows.append(eng.state.bufs.logits[0].float().cpu().clone())
        got[kv] = (torch.stack(rows), eng.kv_bytes)
        eng.close()
    lp, lq = (torch.log_softmax(got[k][0].double(), -1) for k in ("f32", "q8_0"))
    kld = float((lp.exp() * (lp - lq)).sum(-1).mean())
    assert 0 < kld < 1e-2, kld
    assert got["q8_0"][1] * 3.5 < got["f32"][1]


def test_embed_row_kernel(fast):
    rng = np.random.default_rng(5)
    for qtype in (GGMLType.Q8_0, GGMLType.IQ4_XS):
        table = torch.from_numpy(quantize(rng.standard_normal((10, 512)).astype(np.float32), qtype))
        tok = torch.tensor([7])
        ref = torch.zeros(512)
        engine_ops.REFERENCE.embed_row(table, qtype, tok, ref)
        got = torch.zeros(512, device=DEVICE)
        fast.embed_row(table.to(DEVICE), qtype, tok.to(DEVICE), got)
        assert torch.equal(got.cpu(), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_captured_step_has_no_host_sync(model_file, tmp_path):
    """The step is captured as one CUDA graph (capture fails on any host
    synchronisation), and a sync put into the step makes capture fail."""
    eng = _engine(model_file, "auto", tmp_path)
    assert eng._graph is not None
    step = eng.net.step

    def with_sync(*a):
        step(*a)
        eng.state.pos.item()                 # a host sync inside the step

    eng.net.step = with_sync
    with pytest.raises(Exception):
        eng._capture()
    eng.close()


def test_cli_device_options():
    from fle_engine.cli import resolve_device

    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if CUDA else "cpu")
    with pytest.raises(FleError, match="not a device torch knows; use cpu or cuda"):
        resolve_device("foo")
    if not CUDA:
        with pytest.raises(FleError, match="no CUDA device"):
            resolve_device("cuda")


def test_float_experts_run_on_the_reference_side(tmp_path):
    """Experts stored as F32 have no fast kernel: the engine's reference side
    runs them (offsets in bytes) with the reference pass's greedy tokens."""
    if CUDA:
        pytest.skip("the fast side refuses float experts at load, naming the layer (runtime/weights.expert_layout)")
    path = make_model(tmp_path / "f32.gguf", "qwen3moe", seed=3)
    want, _ = _reference_greedy(path, [1, 2, 3], 12)
    eng = _engine(path, "auto", tmp_path)
    assert eng.generate([1, 2, 3], 12) == want
    eng.close()
