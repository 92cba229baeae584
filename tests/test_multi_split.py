"""The CPU's share of the misses in T-row steps (runtime.split's union rule):
the verify step of drafted decoding and the batched step of several
sequences, with ``miss_split`` cpu or a fraction, against the same steps
with every miss on the GPU side.

Without CUDA the reference side runs the rule synchronously (the post
computes the CPU's share at once with the CPU expert kernels); the
persistent CPU team that the GPU feeds is driven here through its mailbox
by a test thread with T-row posts, and the union kernel's skipping of the
CPU's experts runs in Triton's interpreter. The tests marked ``gpu`` run the
compiled kernels and captured graphs on a CUDA machine.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fle_engine.kernels import cpu_experts as ce  # noqa: E402
from fle_engine.kernels import engine_ops  # noqa: E402
from fle_engine.runtime import Engine  # noqa: E402
from fle_engine.runtime.split import cpu_count, split_bytes, union_cpu  # noqa: E402
from fle_quant.ggml_types import GGMLType  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("exact_float32")
DEVICE = torch.device("cuda" if CUDA else "cpu")
PROMPT = [1, 17, 42, 99, 5, 7]
DRAFTS = [[300, 12, 77], [5, 9, 210], [44, 3, 150], [61, 8, 99]]
SPLITS = {"cpu": 256, "0.5": 128}
# logits of the CPU's misses against the GPU's, both multiplying the CPU kernels' rounding of the activations:
# only the order of float sums differs (the CPU's sum is one residual part; qwen4exp: ~2e-4 of the largest logit)
TOL = 1e-3


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("multi_split")
    return {"qwen3moe": make_model(d / "m.gguf", "qwen3moe", seed=3, mix="release", routing_skew=1.0),
            "qwen3next": make_model(d / "n.gguf", "qwen3next", seed=4, mix="release", routing_skew=1.0),
            "qwen4exp": make_model(d / "q.gguf", "qwen4exp", seed=5, mix="release", routing_skew=1.0)}


def _engine(path, per_layer=2, ctx=64, **kw):
    probe = Engine(path, device=DEVICE, cache_budget=0, ctx_size=16, profile_path="none", progress=False,
                   log=lambda m: None)
    eb = sum(lay.expert_bytes for lay in probe.net.layouts.values())
    probe.close()
    return Engine(path, device=DEVICE, cache_budget=per_layer * eb, ctx_size=ctx, cache_type_k="f32",
                  cache_type_v="f32", profile_path="none", progress=False, log=lambda m: None, **kw)


def _close(a, b, tol):
    scale = float(b.abs().max()) or 1.0
    err = float((a - b).abs().max()) / scale
    assert err <= tol, err


def _verify_run(eng, steps=len(DRAFTS), n_tok=4):
    """A prompt, then verify steps of ``n_tok`` tokens (the last step's
    greedy token and fixed drafts), each followed by a rewind of the drafts
    after the first mismatch: (tokens, the logits of every step's rows)."""
    toks = eng.generate(PROMPT, 1)
    logits = []
    for d in DRAFTS[:steps]:
        feed = [toks[-1]] + d[:n_tok - 1]
        got = eng.verify_step(feed)
        logits.append(eng.state.multi.logits[:n_tok].float().cpu().clone())
        j = 0
        while j < n_tok - 1 and got[j] == feed[j + 1]:
            j += 1
        eng.rewind(n_tok - 1 - j)
        toks += got[:j + 1]
    return toks, torch.cat(logits)


# ---------------------------------------------------------------------------
# the rule


def test_union_rule():
    """Distinct missed experts in order of their first row; the CPU takes the
    last cpu_count of them; T = 1 is the one-token rule (the last misses in
    routing order)."""
    ids = [3, 1, 4, 1, 3, 5, 9, 4, 6]          # T = 3, K = 3
    miss = [True, True, False, True, True, True, True, False, False]
    order, mine = union_cpu(ids, miss, 128)
    assert order == [3, 1, 5, 9] and mine == [5, 9]
    assert union_cpu(ids, miss, 256)[1] == order and union_cpu(ids, miss, 0)[1] == []
    rng = np.random.default_rng(0)
    for _ in range(50):
        tok = rng.choice(32, 8, replace=False)
        m = rng.random(8) < 0.5
        want = [int(e) for e in tok[m]][len(tok[m]) - cpu_count(int(m.sum()), 100):] if cpu_count(
            int(m.sum()), 100) else []
        assert union_cpu(tok, m, 100)[1] == want


def test_split_bytes_counts_each_distinct_expert_once():
    ids = np.array([[3, 1, 4, 1, 3, 5]])        # one layer, T = 3, K = 2
    hits = np.array([[0, 0, 1, 0, 0, 0]])
    b = split_bytes(ids, hits, [10], 2, 256)
    assert b == dict(pcie=0, cpu=30, pcie_sum=0, cpu_sum=50)
    b = split_bytes(ids, hits, [10], 2, 0)
    assert b == dict(pcie=30, cpu=0, pcie_sum=50, cpu_sum=0)
    b = split_bytes(ids, hits, [10], 2, 128)     # 3 distinct: the CPU's 2 (1 and 5); per token 1 + 1 + 1
    assert b == dict(pcie=10, cpu=20, pcie_sum=20, cpu_sum=30)



def _split_bytes_by_layer(ids, hits, expert_bytes, n_used, share):
    """split_bytes spelled out: per layer union_cpu's split of the distinct
    misses, per token the one-token rule."""
    out = dict(pcie=0, cpu=0, pcie_sum=0, cpu_sum=0)
    for li in range(ids.shape[0]):
        eb, miss = int(expert_bytes[li]), hits[li] == 0
        order, mine = union_cpu(ids[li], miss, share)
        out["cpu"] += len(mine) * eb
        out["pcie"] += (len(order) - len(mine)) * eb
        for t in range(ids.shape[1] // n_used):
            n_miss = int(miss[t * n_used:(t + 1) * n_used].sum())
            c = cpu_count(n_miss, share) if share else 0
            out["cpu_sum"] += c * eb
            out["pcie_sum"] += (n_miss - c) * eb
    return out


def test_split_bytes_equals_the_rule_layer_by_layer():
    rng = np.random.default_rng(5)
    for _ in range(400):
        n_layer, k, t = (int(x) for x in (rng.integers(1, 7), rng.integers(1, 9), rng.integers(1, 5)))
        n_exp = int(rng.integers(k, 24))
        ids = np.stack([np.concatenate([rng.choice(n_exp, k, replace=False) for _ in range(t)])
                        for _ in range(n_layer)]).astype(np.int32)
        cached = rng.random((n_layer, n_exp)) < rng.random()
        hits = np.take_along_axis(cached, ids, 1).astype(np.int32)
        eb = rng.integers(0, 100, n_layer)
        share = int(rng.choice([0, 1, 77, 128, 200, 256]))
        assert split_bytes(ids, hits, eb, k, share) == _split_bytes_by_layer(ids, hits, eb, k, share)


# ---------------------------------------------------------------------------
# the verify step


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next", "qwen4exp"])
@pytest.mark.parametrize("split", ["cpu", "0.5"])
def test_verify_step_misses_on_the_cpu_equal_misses_on_the_gpu(files, arch, split):
    """Verify steps of 4 tokens (with rewinds) with the CPU's share of the
    distinct misses: the greedy tokens and the logits of every row equal
    those with every miss on the GPU side; with the GPU's misses rounded as
    the CPU kernels round (``miss_activations="q8"``) only the order of float
    sums differs."""
    path = files[arch]
    base = _engine(path, miss_split="gpu", miss_activations="q8")
    want, want_logits = _verify_run(base)
    base.close()
    eng = _engine(path, miss_split=split, miss_activations="q8")
    assert eng.split is not None and eng.split.share == SPLITS[split] and eng.split.t_max >= 4
    got, got_logits = _verify_run(eng)
    assert got == want
    _close(got_logits, want_logits, TOL)
    assert eng.split.cpu_experts > 0
    st = eng.stats
    # the verify steps, and before them the prompt's tokens but its last in T-row steps of prompt_rows
    assert st.multi_steps == len(DRAFTS) + (len(PROMPT) - 1) // eng.prompt_rows and st.multi_cpu_bytes > 0
    assert st.multi_cpu_bytes + st.multi_pcie_bytes < st.multi_cpu_bytes_sum + st.multi_pcie_bytes_sum
    eng.close()


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
def test_verify_step_float_misses_on_the_cpu_close_to_the_gpu(files, arch):
    """Float activations on the GPU side (the default): the CPU's Q8
    rounding of its activations is the only difference, so the greedy
    tokens agree and the logits are close."""
    path = files[arch]
    base = _engine(path, miss_split="gpu")
    want, want_logits = _verify_run(base, steps=2)
    base.close()
    eng = _engine(path, miss_split="0.5")
    got, got_logits = _verify_run(eng, steps=2)
    eng.close()
    assert got == want
    _close(got_logits, want_logits, 3e-2)


def _traced(eng, monkeypatch):
    """Record every CPU forward call of the split's CPU kernels: (layer, the ids it got)."""
    calls = []
    cpu = eng.split.cpu
    for il, fwd in list(cpu._forward.items()):
        def rec(view, lay, x, ids, wts, out, chunk, _il=il, _f=fwd):
            calls.append((_il, ids.copy()))
            return _f(view, lay, x, ids, wts, out, chunk)
        monkeypatch.setitem(cpu._forward, il, rec)
    eng.split.trace = []
    return calls


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
def test_each_distinct_missed_expert_is_computed_once_on_the_cpu(files, arch, monkeypatch):
    """One verify step of 4 tokens with all misses on the CPU: per layer one
    CPU call that holds each of the step's distinct missed experts (the
    union rule on the step's routing log) for all the rows routed to it;
    the GPU side computes none of them."""
    if CUDA:
        pytest.skip("the eager reference step is inspected (the CUDA step is a graph)")
    eng = _engine(files[arch], miss_split="cpu")
    g = eng.generate(PROMPT, 1)
    calls = _traced(eng, monkeypatch)
    gpu_rows = []
    real = engine_ops.experts_ref

    def gpu_side(*a, _on_cpu=None, **kw):
        ids, slot_of = a[8], a[7]
        skip = _on_cpu or set()
        gpu_rows.append({e for r, e in enumerate(ids.view(-1).tolist()) if r not in skip and int(slot_of[e]) < 0})
        return real(*a, _on_cpu=_on_cpu, **kw)

    monkeypatch.setattr(engine_ops, "experts_ref", gpu_side)
    eng.verify_step(g + DRAFTS[0])
    m, k = eng.state.multi, eng.args.n_expert_used
    ids_log, hit_log = m.ids_log[:, :4 * k].cpu().numpy(), m.hit_log[:, :4 * k].cpu().numpy()
    seen = {}
    for il, T, mine in eng.split.trace:
        assert T == 4 and il not in seen
        seen[il] = mine
        order, want = union_cpu(ids_log[il], hit_log[il] == 0, 256)
        assert list(mine) == want == order and len(set(mine)) == len(mine)
    assert seen and all(not rows for rows in gpu_rows)         # every miss went to the CPU
    for il, ids in calls:
        assert ids.shape == (4, k)
        sel = ids[ids >= 0]
        # a row routed to a CPU expert is in the call once per routing; each expert is one distinct expert
        assert set(sel.tolist()) == set(seen[il])
        rows = ids_log[il].reshape(4, k)
        assert ((ids >= 0) == np.isin(rows, list(seen[il]))).all()
    assert len(calls) == len(seen)
    # with repeats across the rows the step computes fewer experts than its misses
    n_rows = int((hit_log[list(seen)] == 0).sum())
    assert sum(len(v) for v in seen.values()) <= n_rows
    eng.close()


def test_forward_reads_each_expert_once_for_its_rows():
    """The CPU kernels' T-row forward: one distinct expert's rows read once
    for all its tokens (plan), so a step's CPU share costs one read per
    expert; the sums equal per-token calls bit for bit."""
    from test_cpu_experts import experts_buffer

    rng = np.random.default_rng(1)
    lay = ce.Geometry.of(256, 512, GGMLType.Q4_K, GGMLType.Q6_K)
    buf = experts_buffer(lay, 6, rng)
    ids = np.array([[1, 4, -1], [4, -1, 2], [-1, 1, 4]], np.int64)
    wts = rng.random((3, 3)).astype(np.float32)
    x = rng.standard_normal((3, 512)).astype(np.float32) * 0.3
    _, _, uexp, ustart, _ = ce.plan.plan(ids) if hasattr(ce, "plan") else __import__(
        "fle_engine.kernels.cpu_experts.plan", fromlist=["plan"]).plan(ids)
    assert sorted(uexp.tolist()) == [1, 2, 4]
    for impl in ["numba"]:
        out = ce.expert_forward(buf, lay, x, ids, wts, impl=impl)
        for t in range(3):
            one = ce.expert_forward(buf, lay, x[t:t + 1], ids[t:t + 1], wts[t:t + 1], impl=impl)
            assert np.array_equal(one[0], out[t])


@pytest.mark.parametrize("broken", ["wrong_row", "twice"])
def test_a_wrong_hand_over_is_caught(files, monkeypatch, broken):
    """The comparison sees a broken hand-over: the CPU's sums added to the
    next row, or the CPU's experts computed on the GPU side too."""
    if CUDA:
        pytest.skip("the eager reference step is inspected (the CUDA step is a graph)")
    path = files["qwen3moe"]
    base = _engine(path, miss_split="gpu", miss_activations="q8")
    want, want_logits = _verify_run(base, steps=1)
    base.close()
    if broken == "wrong_row":
        real = engine_ops.wait_misses_ref

        def wait(split, il, ids, slot_of, serial, out):
            real(split, il, ids, slot_of, serial, out)
            if out.dim() == 2 and out.shape[0] > 1:
                out.copy_(torch.roll(out.clone(), 1, 0))
        monkeypatch.setattr(engine_ops.REFERENCE, "wait_misses", wait)
    else:
        real = engine_ops.experts_ref

        def both(*a, _on_cpu=None, **kw):
            return real(*a, **kw)
        monkeypatch.setattr(engine_ops, "experts_ref", both)
    eng = _engine(path, miss_split="cpu", miss_activations="q8")
    got, got_logits = _verify_run(eng, steps=1)
    eng.close()
    with pytest.raises(AssertionError):
        assert got == want
        _close(got_logits, want_logits, TOL)


# ---------------------------------------------------------------------------
# the batched step of several sequences


def _lanes_run(eng, n_steps=4):
    """Three lanes given their prompts, then batched steps of all three
    (greedy): each lane's tokens and the rows' logits."""
    prompts = [PROMPT, [3, 8, 21, 40], [9, 2, 77, 13, 6]]
    last = []
    for i, p in enumerate(prompts):
        lg, _ = eng.lane_prompt(i, p, cache_prompt=False)
        last.append(int(torch.argmax(lg)))
    toks, logits = [[t] for t in last], []
    for _ in range(n_steps):
        out = eng.step_lanes([0, 1, 2], [t[-1] for t in toks])
        logits.append(out.float().clone())
        for i, t in enumerate(eng.next_tokens):
            toks[i].append(t)
    return toks, torch.cat(logits)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
@pytest.mark.parametrize("split", ["cpu", "0.5"])
def test_lanes_misses_on_the_cpu_equal_misses_on_the_gpu(files, arch, split):
    """Batched steps of three lanes with the CPU's share of each layer's
    distinct misses: tokens and logits as with every miss on the GPU side."""
    path = files[arch]
    base = _engine(path, ctx=3 * 64, n_seq=3, miss_split="gpu", miss_activations="q8")
    want, want_logits = _lanes_run(base)
    base.close()
    eng = _engine(path, ctx=3 * 64, n_seq=3, miss_split=split, miss_activations="q8")
    assert eng._bst.split is eng.split and eng.split.t_max >= 4
    n0 = eng.split.cpu_experts
    got, got_logits = _lanes_run(eng)
    assert got == want
    _close(got_logits, want_logits, TOL)
    eng.flush()                          # the last step's routing is counted at the next use, or now
    assert eng.split.cpu_experts > n0 and eng.stats.multi_steps == 4
    eng.close()


# ---------------------------------------------------------------------------
# the CPU team fed T-row posts (the worker of the fast side)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("impl", ["numba"] + (["ggml"] if ce.ggml_cpu.available() else []))
def test_team_computes_t_row_posts(impl):
    """The persistent team on T-row posts (T = 1..4, the union rule, several
    layers and types, repeats across rows), read through its mailbox: every
    row's sum equals the one-call kernel on that row's CPU experts bit for
    bit, rows without CPU experts get zeros, and the team counts each
    distinct expert once."""
    from fle_engine.kernels.cpu_experts.team import Team
    from test_cpu_experts import experts_buffer

    K, E, D, TM = 4, 7, 512, 4
    rng = np.random.default_rng(2)
    lays = [ce.Geometry.of(256, D, gu, dn) for gu, dn in
            [(GGMLType.Q4_K, GGMLType.Q6_K), (GGMLType.IQ4_XS, GGMLType.IQ4_XS)]]
    parts = [experts_buffer(lay, E, rng).reshape(-1) for lay in lays]
    offsets = [int(o) for o in np.cumsum([0] + [p.size for p in parts])[:-1]]
    buf = np.concatenate(parts)
    L = len(lays)
    flags, done, rows = np.zeros(L, np.int64), np.zeros(L, np.int64), np.ones(L, np.int64)
    boxes = np.zeros((L, TM * (3 * K + D)), np.float32)
    results = np.zeros((L, TM * D), np.float32)
    stop = np.zeros(1, np.int64)
    team = Team(buf, offsets, lays, impl, 2, flags, done, boxes, results, stop, K, rows=rows, t_max=TM)
    team.start()
    try:
        serial, experts = 0, 0
        for T, share in [(1, 256), (3, 128), (4, 256), (2, 200), (4, 64)]:
            serial += 1
            for li, lay in enumerate(lays):
                ids = np.stack([rng.choice(5, K, replace=False) for _ in range(T)]).reshape(-1)   # repeats
                miss = rng.random(T * K) < 0.6
                miss = np.array([miss[list(ids).index(e)] for e in ids])       # an expert misses in every row
                wts = rng.random(T * K).astype(np.float32)
                x = (rng.standard_normal((T, D)) * 0.3).astype(np.float32)
                _, mine = union_cpu(ids, miss, share)
                R = T * K
                b = boxes[li]
                b[:R], b[R:2 * R], b[2 * R:3 * R], b[3 * R:3 * R + T * D] = ids, wts, miss, x.reshape(-1)
                rows[li] = T
                results[li] = 7.0
                flags[li] = serial * 256 + len(mine)
                t0 = time.monotonic()
                if mine:
                    while done[li] != serial:
                        assert time.monotonic() - t0 < 60 and team.alive()
                        time.sleep(1e-5)
                experts += len(mine)
                if not mine:
                    continue
                sel = np.where(np.isin(ids, mine), ids, -1).reshape(T, K)
                view = buf[offsets[li]:offsets[li] + E * lay.expert_bytes].reshape(E, lay.expert_bytes)
                want = ce.expert_forward(view, lay, x, sel, wts.reshape(T, K), impl=impl)
                got = results[li, :T * D].reshape(T, D)
                assert np.array_equal(got, want), (T, share, li)
        assert team.experts == experts
    finally:
        stop[0] = 1
        team.join()


# ---------------------------------------------------------------------------
# the union kernel's skipping of the CPU's experts (Triton's interpreter without CUDA)


@pytest.fixture(scope="module")
def fast():
    pytest.importorskip("triton")
    return engine_ops.pick("triton", DEVICE)


@pytest.mark.parametrize("share", [256, 128, 64])
def test_experts_union_kernel_skips_the_cpu_share(fast, share):
    """The fast union kernel with ``cpu_share`` skips the rows of the CPU's
    distinct missed experts (down rows zero) as the reference does, and
    computes every other row as without it."""
    from test_verify_step import _expert_store

    qtype = GGMLType.IQ4_XS
    n_exp, n_ff, n_embd, n_used = 7, 32, 256, 3
    host, slots, slot_of, g = _expert_store(qtype, n_exp, n_ff, n_embd, (4, 1), 9)
    ids = torch.tensor([1, 2, 4, 0, 2, 1, 2, 5, 3, 6, 0, 5], dtype=torch.int64)      # T = 4
    on_cpu = engine_ops.union_rows_on_cpu(ids, slot_of, share)
    x = torch.randn(4, n_embd, generator=torch.Generator().manual_seed(0)) * 0.5
    wts = torch.rand(ids.numel(), generator=torch.Generator().manual_seed(1))
    wsz = engine_ops.WORDS[qtype].itemsize
    R = ids.numel()
    st = engine_ops.ExpertWords(slots, host, wsz)
    ref_h = torch.zeros(R, n_ff)
    engine_ops.REFERENCE.experts_union(st, qtype, 0, 0, 0, n_ff, g["rb_gu"], slot_of, ids, x, ref_h, True, n_used)
    h_in = torch.nn.functional.pad(ref_h, (0, g["n_in_d"] - n_ff)).contiguous()
    ref_y = torch.zeros(R, n_embd)
    engine_ops.REFERENCE.experts_union(st, qtype, 0, g["d_off"] // wsz, 0, n_embd, g["rb_d"], slot_of, ids, h_in,
                                       ref_y, False, n_used, wts, cpu_share=share)
    keep = [r for r in range(R) if r not in on_cpu]
    full_y = torch.zeros(R, n_embd)
    engine_ops.REFERENCE.experts_union(st, qtype, 0, g["d_off"] // wsz, 0, n_embd, g["rb_d"], slot_of, ids, h_in,
                                       full_y, False, n_used, wts)
    assert on_cpu and torch.equal(ref_y[keep], full_y[keep]) and not ref_y[sorted(on_cpu)].any()

    dev_slots, dev_host = slots.to(DEVICE), host.to(DEVICE)
    words = dev_slots.view(-1).view(engine_ops.WORDS[qtype])
    delta = (dev_host.data_ptr() - words.data_ptr()) // wsz
    y = torch.full((R, n_embd), 7.0, device=DEVICE)
    fast.experts_union(words, qtype, delta, g["d_off"] // wsz, g["eb"] // wsz, n_embd, g["rb_d"], slot_of.to(DEVICE),
                       ids.to(DEVICE), h_in.to(DEVICE), y, False, n_used, wts.to(DEVICE), cpu_share=share)
    y = y.cpu()
    assert not y[sorted(on_cpu)].any()
    _close(y[keep], ref_y[keep], 1e-5)


# ---------------------------------------------------------------------------
# CUDA: the fast side (compiled kernels, the team fed by the GPU, captured graphs)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next", "qwen4exp"])
@pytest.mark.parametrize("split", ["cpu", "0.5"])
def test_fast_verify_and_lanes_split_equal_gpu(files, arch, split):
    """On CUDA: the captured verify step and batched step with the CPU team
    fed through the mailbox give the tokens and logits of GPU-only misses;
    the team computed every CPU expert."""
    path = files[arch]
    base = _engine(path, miss_split="gpu", miss_activations="q8")
    want, want_logits = _verify_run(base)
    base.close()
    eng = _engine(path, miss_split=split, miss_activations="q8")
    assert eng._graph is not None and eng.split.team is not None
    got, got_logits = _verify_run(eng)
    assert got == want
    _close(got_logits, want_logits, TOL)
    assert eng.split.team.experts == eng.split.cpu_experts > 0
    c = eng.step_cost(3, reps=3)
    assert c["cpu_bytes"] > 0 and c["pcie_bytes"] + c["cpu_bytes"] <= c["pcie_bytes_union"] + 1
    eng.close()
    if arch == "qwen4exp":
        return
    base = _engine(path, ctx=3 * 64, n_seq=3, miss_split="gpu", miss_activations="q8")
    want, want_logits = _lanes_run(base)
    base.close()
    eng = _engine(path, ctx=3 * 64, n_seq=3, miss_split=split, miss_activations="q8")
    got, got_logits = _lanes_run(eng)
    assert got == want
    _close(got_logits, want_logits, TOL)
    assert eng.split.team.experts == eng.split.cpu_experts > 0
    eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_fast_t_row_post_and_wait_kernels(files):
    """On CUDA: the T-row post kernel fills the mailbox (ids, weights, miss
    flags, T activations, the rows word, the flag), the team computes the
    CPU's experts, and the wait kernel copies its T sums into a strided
    output: equal to the CPU kernels' T-row forward on the same inputs."""
    from fle_engine.kernels import triton_engine as te

    eng = _engine(files["qwen3moe"], miss_split="cpu")
    sp, k, D = eng.split, eng.args.n_expert_used, eng.args.n_embd
    il, T = sp.layers[0], 3
    smap = eng.cache.layer_map(il)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(eng.args.n_expert, generator=g)[:k] for _ in range(T)]).view(-1).to(DEVICE)
    wts = torch.rand(T * k, generator=g).to(DEVICE)
    xn = torch.randn(T, D, generator=g).to(DEVICE)
    serial = torch.full((1,), 10 ** 6, dtype=torch.int64, device=DEVICE)      # past every step's serial
    try:
        for il2 in sp.layers:                 # the team waits for the layers in order: earlier ones pass
            if il2 == il:
                break
            sp.flags[sp.index[il2]] = 10 ** 6 * 256
        out = torch.full((T, 2, D), 5.0, device=DEVICE)
        te.post_misses(sp, il, xn, ids, wts, smap, serial)
        te.wait_misses(sp, il, ids, smap, serial, out[:, 1])
        torch.cuda.synchronize()
        miss = (smap[ids] < 0).cpu()
        _, mine = union_cpu(ids.cpu().tolist(), miss.tolist(), 256)
        assert mine and int(sp.flags[sp.index[il]]) == 10 ** 6 * 256 + len(mine)
        assert int(sp.rows[sp.index[il]]) == T
        ids_h = ids.cpu().numpy()
        sel = np.where(np.isin(ids_h, mine), ids_h, -1).reshape(T, k)
        want = np.zeros((T, D), np.float32)
        sp.cpu.ffn_rows(il, sel, wts.cpu().numpy().reshape(T, k), xn.cpu().numpy(), want)
        assert torch.equal(out[:, 1].cpu(), torch.from_numpy(want))
        assert torch.equal(out[:, 0].cpu(), torch.full((T, D), 5.0))
    finally:
        eng.close()


def test_bench_verify_cost_with_the_split(files, tmp_path, capsys):
    """bench/verify_step.py with ``--miss-split 0.5`` on the reference side
    (times mean nothing here): per step the bytes of its distinct misses
    split between PCIe and the CPU, printed against the per-token sums."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).parents[1] / "bench" / "verify_step.py"
    spec = importlib.util.spec_from_file_location("bench_verify_split", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    assert bench.main(["--model", str(files["qwen3moe"]), "--device", "cpu", "--warmup", "4", "--reps", "1",
                       "--cache-budget", "third", "--miss-split", "0.5", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["miss_split"] == "0.5" and res["cpu_share"] == 0.5
    for r in res["rows"]:
        assert r["pcie_bytes"] + r["cpu_bytes"] == pytest.approx(r["pcie_bytes_union"])
        assert r["pcie_bytes_tokens"] + r["cpu_bytes_tokens"] == pytest.approx(r["pcie_bytes_sum"])
    assert any(r["cpu_bytes"] > 0 for r in res["rows"])
    assert "PCIe sum" in capsys.readouterr().out
