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
from fle_engine.runtime import qwen4exp as q4rt  # noqa: E402
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


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory):
    """qwen4exp: 3 GDN layers (one with PLE) and a QSA layer (blocks of 4
    positions, 4 kept), 4 hyper-connection streams, a shared expert."""
    return make_model(tmp_path_factory.mktemp("verify_q4") / "q.gguf", "qwen4exp", seed=5, mix="release",
                      routing_skew=1.0)


@pytest.fixture(scope="module")
def q4r2_file(tmp_path_factory):
    """qwen4exp with blocks of 2 positions (4 kept): a 4-token step spans 3
    blocks and can complete a block that is not its first."""
    return make_model(tmp_path_factory.mktemp("verify_q4r2") / "q.gguf", "qwen4exp", seed=5, mix="release",
                      routing_skew=1.0, attention_compress_ratios=[0, 0, 0, 2], attention_indexer_top_k=8)


@pytest.fixture(params=["qwen3moe", "qwen3next", "qwen4exp"])
def arch_file(request, model_file, next_file, q4_file):
    return {"qwen3moe": model_file, "qwen3next": next_file, "qwen4exp": q4_file}[request.param]


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
    qwen3next and qwen4exp the verify step has advanced the GDN states, and
    on qwen4exp the PLE histories, past the prompt)."""
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
    positions (on qwen3next and qwen4exp it puts the GDN states back to the
    verify step's snapshot after its kept tokens, on qwen4exp the PLE token
    and conv histories too), and the next verify step equals the same step
    in a fresh run that never saw the rejected drafts."""
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

@pytest.mark.parametrize("arch", ["qwen3next", "qwen4exp"])
def test_rewind_on_recurrent_state_is_bounded(next_file, q4_file, arch):
    """GDN states (and qwen4exp's PLE histories) can only be put back within
    the verify step that just ran: not after a one-token step, not by T or
    more, not twice."""
    eng = _engine(next_file if arch == "qwen3next" else q4_file)
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


# ---------------------------------------------------------------------------
# qwen4exp: the QSA indexer inside the step, the PLE history, the reference pass
# (the factory model's QSA layer keeps 4 blocks of 4 positions: from position 16 on a
# query has more complete blocks than it keeps, and the block mask matters)

def _long(n: int) -> list[int]:
    """A prompt of ``n`` tokens (no EOS: the PLE n-grams run across all of them)."""
    return [1 + (37 * i + 11) % 290 for i in range(n)]


def _qsa(eng):
    il = next(il for il, L in enumerate(eng.net.layers) if isinstance(L.mixer, q4rt.QSA))
    return il, eng.net.layers[il].mixer


_SINGLES: dict = {}


def _q4_singles(path, pos: int, feed: list[int]):
    """One-token steps after a prompt of ``pos`` tokens, fed ``feed``: the
    greedy tokens, logits, the QSA layer's block mask at each step and its
    block keys after the last."""
    key = (str(path), pos, tuple(feed))
    if key not in _SINGLES:
        eng = _engine(path, graphs=False, prompt_rows=1)   # eager steps: the recorder below sees every step
        eng.generate(_long(pos), 1)
        il, mx = _qsa(eng)
        masks = []
        attend = eng.net.attend

        def recording(at, i, state, ops):
            attend(at, i, state, ops)
            if i == il:
                masks.append(state.bufs.keep.clone())

        eng.net.attend = recording
        toks, logits = _single_steps(eng, feed)
        kb = eng.state.kv[il][3].cpu().clone()
        eng.close()
        _SINGLES[key] = (toks, logits, torch.stack(masks).cpu(), kb)
    return _SINGLES[key]


def _q4_verify(path, pos: int, n_tok: int, ops_wrap=None):
    """A verify step of ``n_tok`` tokens at position ``pos``: (fed tokens,
    greedy tokens, logits, the QSA layer's block masks [T, NB], its block
    keys). The prompt runs one token per step (``prompt_rows=1``): on CUDA a
    T-row graph captured at load would keep the ops from before ``ops_wrap``,
    and the 4-token step would replay it unwrapped."""
    eng = _engine(path, prompt_rows=1)
    g = eng.generate(_long(pos), 1)
    if ops_wrap is not None:
        eng.ops = ops_wrap(eng.ops)
    feed = g + DRAFTS[:n_tok - 1]
    got = eng.verify_step(feed)
    m = eng.state.multi
    res = (feed, got, m.logits[:n_tok].float().cpu().clone(), m.keep[:n_tok].cpu().clone(),
           eng.state.kv[_qsa(eng)[0]][3].cpu().clone())
    eng.close()
    return res


@pytest.mark.parametrize("ratio,n_tok,pos", [(4, 2, 23), (4, 3, 22), (4, 4, 21), (4, 4, 24),
                                             (2, 4, 21), (2, 4, 23), (2, 4, 25), (2, 3, 20)])
def test_q4_verify_step_past_the_indexer_start_and_across_block_boundaries(q4_file, q4r2_file, ratio, n_tok, pos):
    """qwen4exp's T-token step where the indexer drops blocks, the T
    positions straddling a block boundary (23 | 24 with blocks of 4) or, at
    24 .. 27, completing a block with their last token; with blocks of 2 a
    step over 3 blocks completes the second: each query position keeps its
    own block set, chosen among the blocks complete at it (the block that
    completes inside the step counts from its last position on), and the
    tokens, logits and block masks equal T one-token steps' (the first-token
    mask given to every token is caught by the test below)."""
    path = q4_file if ratio == 4 else q4r2_file
    feed, got, logits, keep, kb = _q4_verify(path, pos, n_tok)
    want, want_logits, want_keep, want_kb = _q4_singles(path, pos, feed)
    assert got == want
    _close(logits, want_logits)
    assert torch.equal(keep.to(torch.int32), want_keep.to(torch.int32))
    probe = _engine(path)
    _, mx = _qsa(probe)
    probe.close()
    assert mx.ratio == ratio
    complete = [(pos + t + 1) // mx.ratio for t in range(n_tok)]
    blocks = {(pos + t) // mx.ratio for t in range(n_tok)}
    assert len(blocks) == 2 or len(set(complete)) == 2              # a boundary inside, or a block completed
    for t in range(n_tok):
        assert complete[t] > mx.n_kept                              # some complete block is not kept
        assert int(keep[t, :complete[t]].sum()) == mx.n_kept
        assert bool(keep[t, complete[t]:].all())                    # the tail (and beyond: past the position)
    _close(kb[:complete[-1]], want_kb[:complete[-1]])               # every block completed so far, final


def _wrap_attention(mode):
    """The fast or reference ops with the T-token attention given a wrong
    block mask: ``first`` every token gets token 0's set, ``dense`` none."""
    from types import SimpleNamespace

    def wrap(ops):
        real = ops.attention_multi

        def attention_multi(q, kc, vc, pos, scale, out, partial, ml, keep=None, ratio=0):
            if keep is not None and mode == "first":
                keep = keep[:1].expand_as(keep).contiguous()
            elif mode == "dense":
                keep, ratio = None, 0
            real(q, kc, vc, pos, scale, out, partial, ml, keep=keep, ratio=ratio)

        return SimpleNamespace(**{**vars(ops), "attention_multi": attention_multi})

    return wrap


@pytest.mark.parametrize("broken", ["first_token_block_set", "dense", "one_ple_row_set"])
def test_q4_comparison_sees_a_wrong_step(q4_file, monkeypatch, broken):
    """The comparison above fails for a T-token step computed wrongly: all
    queries with the first one's block set, the block mask left out, or
    every token with the PLE rows of the first."""
    wrap = None
    if broken == "first_token_block_set":
        wrap = _wrap_attention("first")
    elif broken == "dense":
        wrap = _wrap_attention("dense")
    else:
        real = q4rt.Net.ple_rows_multi

        def one_set(self, p, state, n):
            real(self, p, state, n)
            h = self.args.ple_heads
            rows = state.multi.ple_rows
            rows[h:n * h].copy_(rows[:h].repeat(n - 1))

        monkeypatch.setattr(q4rt.Net, "ple_rows_multi", one_set)
    feed, got, logits, _, _ = _q4_verify(q4_file, 21, 4, wrap)
    want, want_logits, _, _ = _q4_singles(q4_file, 21, feed)
    err = float((logits - want_logits).abs().max()) / float(want_logits.abs().max())
    assert got != want or err > 1e-3, err


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_q4_rewind_inside_a_block_then_continue_equals_a_fresh_run(q4_file, keep):
    """A T = 4 step at positions 21 .. 24 (block 5 completes at 23), drafts
    rejected after the first ``keep - 1``: after the rewind the GDN states
    and the PLE token and conv histories equal those of a fresh run fed only
    the kept tokens, and so do the next step's tokens and logits (the
    indexer keys of the rejected positions are written again, the key of
    their block refreshed)."""
    prompt = _long(21)
    eng = _engine(q4_file)
    g = eng.generate(prompt, 1)
    out = eng.verify_step(g + DRAFTS)
    eng.rewind(4 - keep)
    fresh = _engine(q4_file)
    kept = (g + DRAFTS)[:keep]
    assert fresh.generate(prompt + kept, 1) == [out[keep - 1]]
    b, fb = eng.state.bufs, fresh.state.bufs
    assert torch.equal(b.ple_tok, fb.ple_tok)
    _close(b.ple_hist, fb.ple_hist)
    for il, rec in enumerate(eng.args.recurrent[:eng.args.n_layer]):
        if rec:
            for x, y in zip(eng.state.kv[il], fresh.state.kv[il]):
                _close(x, y)
    nxt = [out[keep - 1], 5, 6]
    got = eng.verify_step(nxt)
    assert fresh.verify_step(nxt) == got
    _close(eng.state.multi.logits[:3].float().cpu(), fresh.state.multi.logits[:3].float().cpu())
    eng.close()
    fresh.close()


def test_q4_verify_step_equals_the_reference_pass(q4_file):
    """The T-token step against the reference forward pass fed the same T
    tokens in one call (its chunked GDN rule, its block selection for a
    prompt of several tokens): the same greedy tokens, logits within the
    KLD the one-token engine step is held to (tests/test_engine_qwen4exp.py)."""
    from fle_engine import load

    prompt = _long(21)
    model = load(q4_file, device=DEVICE, experts="resident")
    st = model.new_state(64)
    first = int(torch.argmax(model.forward(prompt, st)[-1]))
    feed = [first] + DRAFTS
    ref = model.forward(feed, st).float().cpu()
    eng = _engine(q4_file)
    assert eng.generate(prompt, 1) == [first]
    got = eng.verify_step(feed)
    logits = eng.state.multi.logits[:4].float().cpu()
    eng.close()
    assert got == ref.argmax(-1).tolist()
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(logits.double(), -1)
    assert float((lp.exp() * (lp - lq)).sum(-1).mean()) < 1e-4


def _one_expert_per_layer(path) -> int:
    probe = _engine(path)
    n = max(lay.expert_bytes for lay in probe.net.layouts.values())
    probe.close()
    return n * probe.args.n_layer


LONG = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]


@pytest.mark.parametrize("rows,n_steps,n_turn", [(2, 5, 2), (3, 3, 1), (4, 2, 1)])
def test_short_prompt_in_row_steps_equals_one_token_steps(arch_file, rows, n_steps, n_turn):
    """A prompt that is not prefilled runs its tokens but the last ``rows``
    at a time in the verify step's pass, the fewer left one per step (11
    tokens: the first 10 in steps of 2+2+2+2+2, 3+3+3 then 1, 4+4 then 1+1):
    the same greedy tokens and logits after the prompt as one token per
    step, the history that a follow-up turn reuses, and that turn's answer
    (its 5 new tokens: the first 4 in steps of 2+2, 3 then 1, 4)."""
    budget = 2 * _one_expert_per_layer(arch_file)
    got = _engine(arch_file, budget, prompt_rows=rows)
    one = _engine(arch_file, budget, prompt_rows=1)
    if CUDA:            # the prompts' one T-row graph is captured at load, beside the decode step's
        assert list(got._multi_graphs) == [rows] and getattr(one.state, "multi", None) is None
    out, graphs = {}, {}
    for name, eng in (("rows", got), ("one", one)):
        first = eng.generate(LONG, 1)
        logits = eng.state.bufs.logits[0].float().cpu().clone()
        steps = eng.stats.multi_steps
        rest = eng.generate(LONG + first, 6)
        assert eng.cached_tokens == len(LONG)             # the prompt's tokens kept for the turn after
        follow = LONG + first + rest[:-1] + [7, 8, 9, 10, 11]
        turn = eng.generate(follow, 4)
        out[name] = first + rest, logits, steps, turn, eng.stats.multi_steps - steps, eng.history[:len(follow)]
        graphs[name] = list(getattr(eng, "_multi_graphs", {}))     # before close, which drops them
        eng.close()
    assert out["rows"][0] == out["one"][0]
    _close(out["rows"][1], out["one"][1])
    assert (out["rows"][2], out["one"][2]) == (n_steps, 0)
    assert out["rows"][3] == out["one"][3]
    assert (out["rows"][4], out["one"][4]) == (n_turn, 0)
    if CUDA:                                              # no other T captured on the way
        assert graphs["rows"] == [rows]
    assert out["rows"][5] == out["one"][5]


def test_short_prompt_rows_with_a_sampler(model_file):
    """Sampling reads the logits of the prompt's last token, run as a one-token step after the T-row
    steps: the same draws as one token per step."""
    from fle_engine.sampling import Sampler, SamplerParams

    draws = []
    for rows in (4, 1):
        eng = _engine(model_file, prompt_rows=rows)
        draws.append(eng.generate(LONG, 8, sampler=Sampler(SamplerParams(temp=1.0, seed=11))))
        assert (eng.stats.multi_steps > 0) == (rows > 1)
        eng.close()
    assert draws[0] == draws[1]


@pytest.mark.parametrize("rows", [0, 5])
def test_prompt_rows_is_checked(model_file, rows):
    with pytest.raises(FleError, match="prompt_rows"):
        _engine(model_file, prompt_rows=rows)


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


@pytest.mark.parametrize("qtype,mode", [(GGMLType.IQ4_XS, "miss"), (GGMLType.IQ4_XS, "hit"), (GGMLType.Q8_0, "hit")])
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


@pytest.mark.parametrize("n_parts", [0, 1, 3])
def test_hc_write_norm_and_mix_of_t_tokens(fast, n_parts):
    """qwen4exp's hyper-connection write (+ norm) and read mix for T tokens
    in one call: the reference equals T one-token calls, the fast kernels
    (one launch each) equal the reference."""
    gen = torch.Generator().manual_seed(n_parts)
    n_tok, s, d = 3, 4, 200
    res = torch.randn(n_tok, s, d, generator=gen)
    parts = torch.randn(n_tok, n_parts, d, generator=gen) if n_parts else None
    inj = torch.randn(n_tok, s, generator=gen) * 3
    w = torch.rand(s, d, generator=gen) + 0.5
    gate = torch.randn(n_tok, s * d, generator=gen) * 2
    one_res, one_out, one_mix = res.clone(), torch.zeros(n_tok, s, d), torch.zeros(n_tok, d)
    for t in range(n_tok):
        engine_ops.REFERENCE.hc_write_norm(one_res[t], None if parts is None else parts[t:t + 1], inj[t:t + 1], s, w,
                                           1e-6, one_out[t])
        engine_ops.REFERENCE.hc_mix(one_out[t], gate[t:t + 1], one_mix[t])
    for ops, dev in ((engine_ops.REFERENCE, torch.device("cpu")), (fast, DEVICE)):
        r = res.clone().to(dev)
        out = torch.zeros(n_tok, s, d, device=dev)
        mix = torch.zeros(n_tok, d, device=dev)
        ops.hc_write_norm(r, None if parts is None else parts.to(dev), inj.to(dev), s, w.to(dev), 1e-6, out)
        ops.hc_mix(out, gate.to(dev), mix)
        _close(r.cpu(), one_res)
        _close(out.cpu(), one_out)
        _close(mix.cpu(), one_mix)
    if n_parts:
        assert not torch.equal(one_res, res)


def test_attention_of_t_tokens_with_their_own_block_masks(fast):
    """QSA in the T-token step: token t attends to positions 0 .. pos + t
    of the blocks its own row of ``keep`` [T, NB] sets; the reference equals
    T one-token calls with the rows, the fast kernel the reference, and the
    rows matter (token 0's row for all changes the others' outputs)."""
    from fle_engine.kernels.triton_engine import attn_scratch

    gen = torch.Generator().manual_seed(5)
    n_head, n_kv, dh, n_pos, ratio = 8, 2, 64, 80, 4
    n_blk = n_pos // ratio
    kc, vc = torch.randn(n_kv, n_pos, dh, generator=gen), torch.randn(n_kv, n_pos, dh, generator=gen)
    for n_tok, pos in ((4, 37), (3, 62), (2, 0)):
        keep = torch.zeros(4, n_blk, dtype=torch.int32)
        for t in range(n_tok):
            keep[t, torch.randperm(n_blk, generator=gen)[:3]] = 1
            keep[t, (pos + t + 1) // ratio:] = 1                  # each token's tail
        keep = keep[:n_tok]
        q = torch.randn(n_tok, n_head * dh, generator=gen)
        p = torch.tensor([pos])
        one = torch.zeros(n_tok, n_head * dh)
        for t in range(n_tok):
            engine_ops.REFERENCE.attention(q[t], kc, vc, p + t, dh ** -0.5, one[t], keep=keep[t], ratio=ratio)
        ref = torch.zeros(n_tok, n_head * dh)
        engine_ops.REFERENCE.attention_multi(q, kc, vc, p, dh ** -0.5, ref, keep=keep, ratio=ratio)
        assert torch.equal(ref, one)
        partial, ml = attn_scratch(n_kv, n_head, dh, DEVICE, n_tok=4)
        got = torch.zeros(n_tok, n_head * dh, device=DEVICE)
        fast.attention_multi(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), p.to(DEVICE), dh ** -0.5, got, partial, ml,
                             keep=keep.to(DEVICE), ratio=ratio)
        _close(got.cpu(), ref)
        if pos > 8:
            same = torch.zeros(n_tok, n_head * dh, device=DEVICE)
            fast.attention_multi(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), p.to(DEVICE), dh ** -0.5, same, partial,
                                 ml, keep=keep[:1].expand_as(keep).contiguous().to(DEVICE), ratio=ratio)
            assert torch.equal(same[0].cpu(), got[0].cpu()) and not torch.allclose(same[1:].cpu(), got[1:].cpu())


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


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_q4_verify_graphs_captured_and_equal_to_eager(q4_file):
    """qwen4exp with CUDA: every T in 2..4 captured as its own graph past the
    indexer's start (the capture's eager runs put the GDN states and PLE
    histories back), tokens and logits equal to the eager step's and, after
    rewinds, to one-token steps; step_cost leaves the sequence as it was."""
    eng, eager = _engine(q4_file), _engine(q4_file, graphs=False)
    assert eng._graph is not None and eager._graph is None
    prompt = _long(21)
    for e in (eng, eager):
        e.generate(prompt, 1)
    for n_tok in (2, 3, 4):
        feed = [3] + DRAFTS[:n_tok - 1]
        assert eng.verify_step(feed) == eager.verify_step(feed)
        _close(eng.state.multi.logits[:n_tok].cpu(), eager.state.multi.logits[:n_tok].cpu(), 1e-4)
        eng.rewind(n_tok - 1)
        eager.rewind(n_tok - 1)
    assert sorted(eng._multi_graphs) == [2, 3, 4]
    cost = eng.step_cost(4, reps=3)
    assert cost["seconds"] > 0 and eng.launched == len(prompt) + 3
    ones = _engine(q4_file)
    ones.generate(prompt + [3, 3, 3], 1)
    feed = [7] + DRAFTS
    want, want_logits = _single_steps(ones, feed)
    assert eng.verify_step(feed) == want
    _close(eng.state.multi.logits[:4].cpu(), want_logits, 1e-4)
    for e in (eng, eager, ones):
        e.close()


@pytest.fixture(scope="module")
def bench():
    """bench/verify_step.py as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "bench" / "verify_step.py"
    spec = importlib.util.spec_from_file_location("bench_verify", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_script_smoke(bench, model_file, tmp_path):
    """bench/verify_step.py on the factory model with the reference side
    (the times mean nothing here): one row per n = 0..3, the modelled rate
    from E(n) = 1 + a1 + a1 a2 + ..."""
    import json

    assert bench.expected_tokens((0.86, 0.78, 0.78), 2) == pytest.approx(1 + 0.86 + 0.86 * 0.78)
    out = tmp_path / "r.json"
    assert bench.main(["--model", str(model_file), "--device", "cpu", "--warmup", "4", "--reps", "1",
                       "--draft-ms", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["pcie_bytes_union"] <= r["pcie_bytes_sum"]
        assert r["modelled_tok_s"] == pytest.approx(r["expected_tokens"] / (r["seconds"] + r["drafts"] * 1e-3))


def test_bench_all_experts_cached(bench, model_file, tmp_path):
    """bench/verify_step.py --cache-budget all (every routed expert in a slot,
    the step's growth with T without misses) on the factory model, on the
    CPU (the times mean nothing): the budget holds the file's experts, every
    step hits and reads nothing over PCIe; 'third' holds a third of them."""
    import json

    n_layer, exp_bytes = bench.expert_bytes(model_file)
    assert bench.budget_of(model_file, "all") >= exp_bytes
    assert bench.budget_of(model_file, "third") == exp_bytes * (n_layer // 3) // n_layer
    out = tmp_path / "r.json"
    assert bench.main(["--model", str(model_file), "--device", "cpu", "--cache-budget", "all", "--warmup", "4",
                       "--reps", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["drafts"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert r["hit_rate"] == 1.0 and r["pcie_bytes"] == 0 and r["pcie_bytes_sum"] == 0, r


def test_bench_with_prefetch(bench, model_file, tmp_path):
    """bench/verify_step.py --miss-prefetch 2 on the factory model, on the
    CPU (the times mean nothing): every step size copies experts ahead, and
    the share of them its layers used is reported."""
    import json

    n_layer, exp_bytes = bench.expert_bytes(model_file)
    out = tmp_path / "r.json"
    budget = str(6 * exp_bytes // (8 * n_layer) * n_layer)          # 6 of the factory's 8 experts a layer
    assert bench.main(["--model", str(model_file), "--device", "cpu", "--cache-budget", budget, "--warmup", "4",
                       "--reps", "2", "--miss-prefetch", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["miss_prefetch"] == 2
    for r in res["rows"]:
        assert r["prefetch_copied"] >= 0 and 0 <= r["prefetch_used"] <= 1
    assert any(r["prefetch_copied"] > 0 for r in res["rows"][1:])
