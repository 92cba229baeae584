"""MTP speculative decoding on the engine (fle_engine.runtime.mtp), qwen3next
and qwen4exp.

The engine's loop -- trunk token, head drafts, one verify step, the longest
agreeing prefix kept, the rest rewound from the GDN snapshots -- gives the
tokens of plain engine decoding, greedy and sampled; a head that agrees
with the trunk has every draft accepted, one verify step settling 1 + n
tokens; after a rejection the engine's state is that of a fresh run fed
the kept tokens; and the head is called as the reference path calls it,
so its drafts are the reference path's (qwen3next's head reading the
trunk's post-norm hidden states, qwen4exp's its wide hyper-connection
residual, kept by prefill and by the verify steps). Without CUDA the engine
runs its reference operations (as tests/test_engine.py and
test_verify_step.py).
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fle_engine  # noqa: E402
from fle_engine import speculative  # noqa: E402
from fle_engine.draft_vocab import DraftVocab  # noqa: E402
from fle_engine.mtp import draft  # noqa: E402
from fle_engine.runtime import Engine  # noqa: E402
from fle_engine.runtime import mtp as rmtp  # noqa: E402
from fle_engine.sampling import Sampler, SamplerParams  # noqa: E402
from fle_engine.speculative import (AdaptiveDraft, SpecStats, expected_step_time,  # noqa: E402
                                    generate_speculative)
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.synth import make_model, mtp_path  # noqa: E402

pytestmark = pytest.mark.usefixtures("exact_float32")
DEVICE = torch.device("cuda" if CUDA else "cpu")
N = 256
SHORT = [1, 17, 42, 99, 5, 7]                       # decode steps for the prompt
LONG = list(np.random.default_rng(2).integers(0, 500, 40))   # prefill (at least 32 tokens)


@pytest.fixture(scope="module")
def next_file(tmp_path_factory):
    """qwen3next with its MTP block inside the file (block_count = N + 1)."""
    return make_model(tmp_path_factory.mktemp("engine_mtp") / "n.gguf", "qwen3next", seed=4, mix="release",
                      routing_skew=1.0, mtp="inside")


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory):
    """qwen4exp with its MTP block inside the file: 3 GDN layers (one with
    PLE), a QSA layer (blocks of 4 positions), 4 hyper-connection streams;
    its head attends densely."""
    return make_model(tmp_path_factory.mktemp("engine_mtp_q4") / "q.gguf", "qwen4exp", seed=5, mix="release",
                      routing_skew=1.0, mtp="inside")


def _budget(path):
    """Two slots per layer of eight experts: a cache smaller than the experts."""
    probe = _engine(path)
    n = max(lay.expert_bytes for lay in probe.net.layouts.values())
    probe.close()
    return 2 * n * probe.args.n_layer


@pytest.fixture(scope="module")
def budget(next_file):
    return _budget(next_file)


@pytest.fixture(scope="module")
def q4_budget(q4_file):
    return _budget(q4_file)


def _engine(path, budget=0, ctx=N + 48, mtp=None, **kw):
    return Engine(path, device=DEVICE, cache_budget=budget, ctx_size=ctx, cache_type_k="f32", cache_type_v="f32",
                  profile_path="none", progress=False, log=lambda m: None, mtp=mtp, **kw)


def _plain(path, budget):
    """Plain greedy engine decoding of N tokens after each prompt."""
    out = {}
    for name, prompt in (("short", SHORT), ("long", LONG)):
        eng = _engine(path, budget)
        out[name] = eng.generate(prompt, N)
        eng.close()
    return out


@pytest.fixture(scope="module")
def plain(next_file, budget):
    return _plain(next_file, budget)


@pytest.fixture(scope="module")
def q4_plain(q4_file, q4_budget):
    return _plain(q4_file, q4_budget)


@pytest.fixture(scope="module", params=["qwen3next", "qwen4exp"])
def arch(request):
    """The file, cache budget and plain tokens of one architecture (its fixtures made on first use)."""
    names = ("next_file", "budget", "plain") if request.param == "qwen3next" else ("q4_file", "q4_budget", "q4_plain")
    path, budget, plain = (request.getfixturevalue(n) for n in names)
    return SimpleNamespace(name=request.param, path=path, budget=budget, plain=plain)


def _prompt(name):
    return SHORT if name == "short" else [int(t) for t in LONG]


@pytest.mark.parametrize("n_draft,name", [(1, "short"), (3, "long")])
def test_greedy_equals_plain_engine(arch, n_draft, name):
    """(a) 256 greedy tokens with the real head's drafts, checked in verify
    steps with a cache smaller than the experts: the plain tokens (the long
    prompt through prefill, whose hidden rows the head reads)."""
    eng = _engine(arch.path, arch.budget, mtp=True)
    stats = SpecStats()
    got = list(eng.speculative(_prompt(name), N, n_draft=n_draft, stats=stats))
    assert got == arch.plain[name]
    assert stats.drafted > 0 and stats.reached and stats.reached[0] == sum(stats.steps[1:])
    assert stats.trunk_calls == sum(stats.steps)            # one verify step per step, no settling call
    assert eng.cache.stats.hit_rate < 1.0                   # the cache really misses
    eng.close()


def _oracle_head(monkeypatch, head, seq, wrong_after=None, n_vocab=None):
    """Make ``head`` predict the trunk's known continuation ``seq``: the pair
    at position p gives the token at p + 2 as one-hot logits. With
    ``wrong_after`` k, only the first k drafts of each call series are
    right (a draft at a provisional position past the settled ones is
    counted by its distance from the first)."""
    real = head.forward
    state = {"first": None}

    def fake(hidden, next_tokens, cache, positions, rope_cos, rope_sin, return_hidden=False):
        logits, h = real(hidden, next_tokens, cache, positions, rope_cos, rope_sin, return_hidden=True)
        pos = positions.tolist()
        if len(pos) > 1 or state["first"] is None or pos[0] <= state["first"]:
            state["first"] = pos[-1]                        # the call that makes draft 1
        fake_logits = torch.full_like(logits, -1.0)     # the last pair's row: the one drafting reads
        p = pos[-1]
        want = seq[p + 2] if p + 2 < len(seq) else 0
        if wrong_after is not None and p - state["first"] >= wrong_after:
            want = (want + 1) % logits.shape[1]
        fake_logits[-1, want] = 1.0
        return (fake_logits, h) if return_hidden else fake_logits

    monkeypatch.setattr(head, "forward", fake)


@pytest.mark.parametrize("n_draft", [1, 3])
def test_agreeing_head_has_every_draft_accepted(arch, monkeypatch, n_draft):
    """(b) A head whose logits are the trunk's own continuation: every draft
    is accepted and one verify step settles 1 + n tokens, so n_tok tokens
    take ceil((n_tok - 1) / (1 + n)) verify steps after the prompt (N on
    qwen3next; 128 on qwen4exp, whose 256-token runs (a) covers)."""
    prompt = SHORT
    n_tok = N if arch.name == "qwen3next" else 128
    seq = prompt + arch.plain["short"]
    eng = _engine(arch.path, arch.budget, mtp=True, mtp_drafter="eager")      # the head patched: the eager one
    _oracle_head(monkeypatch, eng.drafter.mtp, seq)
    stats = SpecStats()
    got = list(eng.speculative(prompt, n_tok, n_draft=n_draft, stats=stats))
    assert got == arch.plain["short"][:n_tok]
    assert stats.accepted == stats.drafted > 0
    assert stats.trunk_calls == -(-(n_tok - 1) // (n_draft + 1))
    assert stats.by_position() == [1.0] * n_draft
    eng.close()


@pytest.mark.parametrize("keep", [1, 2])
def test_state_after_rejection_equals_a_fresh_run(arch, monkeypatch, keep):
    """(c) Drafts right for ``keep - 1`` places, then wrong: after each step
    the rejected drafts are rewound (GDN states from the step's snapshots;
    on qwen4exp the PLE token and conv histories too) and the engine equals
    a fresh engine fed the prompt and the kept tokens -- its recurrent
    states, its position, and the logits of the next step."""
    prompt = SHORT
    plain, budget = arch.plain, arch.budget
    seq = prompt + plain["short"]
    eng = _engine(arch.path, budget, mtp=True, mtp_drafter="eager")           # the head patched: the eager one
    _oracle_head(monkeypatch, eng.drafter.mtp, seq, wrong_after=keep - 1)
    stats = SpecStats()
    gen = eng.speculative(prompt, 60, n_draft=3, stats=stats)
    per_step = keep                                  # kept drafts + the trunk's own token
    taken = [next(gen) for _ in range(1 + 5 * per_step)]  # the first token, then five settled steps
    assert taken == plain["short"][:len(taken)]
    assert stats.trunk_calls == 5 and stats.accepted == 5 * (keep - 1) and stats.drafted == 15
    assert eng.launched == len(prompt) + len(taken) - 1
    fresh = _engine(arch.path, budget)
    assert fresh.generate(prompt + taken[:-1], 1) == [taken[-1]]
    assert fresh.launched == eng.launched
    mine, theirs = eng.net.recurrent_backup(eng.state), fresh.net.recurrent_backup(fresh.state)
    assert len(mine) == len(theirs) == sum(eng.args.recurrent) + (arch.name == "qwen4exp")
    for x, y in zip(mine, theirs):
        assert x[0] == y[0]
        for a, b in zip(x[1:], y[1:]):
            assert float((a - b).abs().max()) <= 1e-4 * (float(b.abs().max()) or 1.0)
    for e in (eng, fresh):
        e.verify_step([taken[-1]])
    a, b = eng.state.bufs.logits[0], fresh.state.bufs.logits[0]
    assert float((a - b).abs().max()) <= 1e-4 * float(b.abs().max())
    fresh.close()
    gen.close()
    eng.close()


def _recorder(calls, seq, right):
    """A wrapper of :func:`fle_engine.mtp.draft` that records the real
    head's drafts and logits, then hands the loop the known continuation
    where ``right(step)`` says so (so that steps accept drafts and the
    head's queue is exercised after acceptances too)."""
    real = draft

    def wrapped(m, state, next_token=None, n_draft=1, vocab=None):
        d, lg = real(m, state, next_token=next_token, n_draft=n_draft, vocab=vocab)
        calls.append((int(next_token), d.tolist(), lg.float().cpu()))
        ok = right(len(calls) - 1)
        if ok:
            cont = seq[state.length + 1:state.length + 1 + len(d)]
            d = torch.tensor(cont[:ok] + [(t + 1) % lg.shape[1] for t in cont[ok:]], dtype=torch.long)
        return d, lg

    return wrapped


@pytest.mark.parametrize("name,with_vocab", [("short", False), ("long", True)])
def test_drafts_equal_the_reference_paths(arch, monkeypatch, name, with_vocab):
    """(d) The same prompt on the reference path (generate_speculative) and
    on the engine: the head is called with the same pairs at the same
    positions, so every call drafts the same tokens with the same logits
    (to float rounding) -- with acceptances (the loop told the right
    continuation on two steps of three: one draft, then all) and
    rejections; and with a draft vocabulary, drafts only from its list."""
    prompt = _prompt(name)
    n_tok = 48
    next_file, plain = arch.path, arch.plain
    seq = prompt + plain[name]
    vocab = DraftVocab(list(range(0, 512, 3))) if with_vocab else None
    right = lambda s: (0, 1, 3)[s % 3]        # noqa: E731 - step s: that many of its drafts right
    ref_calls: list = []
    monkeypatch.setattr(speculative, "draft", _recorder(ref_calls, seq, right))
    model = fle_engine.load(next_file, device=DEVICE, experts="resident")
    want = list(generate_speculative(model, prompt, n_tok, Sampler(SamplerParams(temp=0.0)), n_draft=3,
                                     vocab=vocab))
    eng_calls: list = []
    monkeypatch.setattr(rmtp, "draft", _recorder(eng_calls, seq, right))
    eng = _engine(next_file, mtp=True, mtp_drafter="eager")     # the reference head (the step drafter: test (e))
    if eng.prefill is not None:
        eng.prefill.bf16 = False         # the long prompt's prefill in float32 products, as the reference pass's
    stats = SpecStats()
    got = list(eng.speculative(prompt, n_tok, n_draft=3, stats=stats, vocab=vocab))
    eng.close()
    assert got == want == plain[name][:n_tok]
    assert 0 < stats.accepted < stats.drafted
    assert len(eng_calls) == len(ref_calls) > 10
    for (t_e, d_e, lg_e), (t_r, d_r, lg_r) in zip(eng_calls, ref_calls):
        assert t_e == t_r and d_e == d_r
        fin = torch.isfinite(lg_r)
        assert torch.equal(fin, torch.isfinite(lg_e))
        # the same operations on the CPU; on CUDA the trunk's Triton kernels round otherwise than the reference
        # pass (held within KLD 1e-4 by the engine's tests), and the head reads the trunk's rows
        tol = 2e-2 if DEVICE.type == "cuda" else 1e-4
        assert float((lg_e[fin] - lg_r[fin]).abs().max()) <= tol * float(lg_r[fin].abs().max())
        if vocab is not None:
            assert set(d_e) <= set(vocab.ids.tolist())


def _draft_log(eng, seq, right):
    """Wrap ``eng.drafter.draft``: record (next token, the head's drafts),
    then hand the loop the known continuation where ``right(call)`` says so
    (as :func:`_recorder`)."""
    calls = []
    real = eng.drafter.draft

    def wrapped(tok, n, vocab=None):
        d = real(tok, n, vocab)
        calls.append((int(tok), list(d)))
        ok = right(len(calls) - 1)
        if ok:
            cont = seq[eng.launched + 1:eng.launched + 1 + len(d)]
            d = cont[:ok] + [(t + 1) % 512 for t in cont[ok:]]
        return d

    eng.drafter.draft = wrapped
    return calls


@pytest.mark.parametrize("name,with_vocab", [("short", False), ("long", True), ("long", False)])
def test_step_drafter_drafts_as_the_eager_one(next_file, budget, plain, name, with_vocab):
    """(e) qwen3next's head on the engine's own step (its block in the
    trunk's kernels on the GGUF bytes, its experts resident; one CUDA graph
    per call size with CUDA) against the reference head in float32 (the
    eager drafter), on the same run -- with acceptances and rejections, the
    long prompt's 40 queued rows in calls of at most ROWS, a draft
    vocabulary: every call drafts the same tokens, and the tokens are the
    plain ones."""
    _step_against_eager(next_file, budget, plain, name, with_vocab)


@pytest.mark.parametrize("name,with_vocab", [("short", False), ("long", True)])
def test_step_drafter_drafts_as_the_eager_one_qwen4exp(q4_file, q4_budget, q4_plain, name, with_vocab):
    """(e) on qwen4exp: the head's step (enorm, the per-stream hnorm,
    eh_proj on each of the S streams of the trunk's wide residual, its own
    hyper-connection reads and writes around the dense attention and the
    MoE, the head mixer before the output product; a further drafting step
    reading the head's own wide residual) drafts as the eager head, call
    for call."""
    _step_against_eager(q4_file, q4_budget, q4_plain, name, with_vocab)


def _step_against_eager(path, budget, plain, name, with_vocab):
    """The step drafter against the eager one on the same run (test (e))."""
    prompt = _prompt(name)
    n_tok = 64
    seq = prompt + plain[name]
    vocab = DraftVocab(list(range(0, 512, 3))) if with_vocab else None
    right = lambda s: (0, 1, 3)[s % 3]        # noqa: E731 - call s: that many of its drafts right
    logs, engines = {}, {}
    for kind in ("eager", "step"):
        eng = engines[kind] = _engine(path, budget, mtp=True, mtp_drafter=kind)
        if eng.prefill is not None:
            eng.prefill.bf16 = False
        logs[kind] = _draft_log(eng, seq, right)
        stats = SpecStats()
        assert list(eng.speculative(prompt, n_tok, n_draft=3, stats=stats, vocab=vocab)) == plain[name][:n_tok]
        assert 0 < stats.accepted < stats.drafted
    step = engines["step"].drafter
    assert type(step) is rmtp.StepDrafter and type(engines["eager"].drafter) is rmtp.Drafter
    assert len(logs["step"]) == len(logs["eager"]) > 10
    assert logs["step"] == logs["eager"]
    if vocab is not None:
        assert all(set(d) <= set(vocab.ids.tolist()) for _, d in logs["step"])
    # with CUDA every call replayed a graph: sizes 1 (further drafts) and the queue's (1 + the kept tokens)
    assert bool(step._graph_of) == CUDA
    if CUDA:
        assert {n for n, _ in step._graph_of} >= {1, 2}
    assert engines["step"].memory_report()["mtp_head"] < engines["eager"].memory_report()["mtp_head"]
    for eng in engines.values():
        eng.close()


@pytest.mark.parametrize("name", ["qwen3next", "qwen4exp"])
def test_separate_head_file(tmp_path, name):
    """The head in a separate file (--mtp-head) drafts as the one inside the
    model file does."""
    inside = make_model(tmp_path / "in.gguf", name, seed=5, mix="release", mtp="inside")
    sep = make_model(tmp_path / "sep.gguf", name, seed=5, mix="release", mtp="separate")
    drafts = []
    for path, spec in ((inside, True), (sep, str(mtp_path(sep)))):
        eng = _engine(path, ctx=64, mtp=spec)
        got = []
        real = eng.drafter.draft
        eng.drafter.draft = lambda tok, n, vocab=None, real=real, got=got: got.append(real(tok, n, vocab)) or got[-1]
        list(eng.speculative(SHORT, 16, n_draft=2))
        drafts.append(got)
        eng.close()
    assert drafts[0] == drafts[1] and len(drafts[0]) == 14     # the last step, one token short of 16, drafts none


def test_sampled_equals_plain_sampled(next_file, budget, monkeypatch):
    """Sampled MTP on the engine: each token sampled from the verify step's
    row, in order, with the plain run's draws -- the plain sampled tokens
    (the drafts told the plain sampled continuation, so that rows past the
    first are sampled too)."""
    params = SamplerParams(temp=1.0, top_k=20, top_p=0.95, min_p=0.0, seed=7)
    eng = _engine(next_file, budget, mtp=True)
    want = eng.generate(SHORT, 64, sampler=Sampler(params))
    seq = SHORT + want
    real = eng.drafter.draft
    right = {"n": 0}

    def half_oracle(tok, n, vocab=None):
        real(tok, n, vocab)
        right["n"] += 1
        pos = eng.launched
        return seq[pos + 1:pos + 1 + n] if right["n"] % 2 else [(t + 1) % 512 for t in seq[pos + 1:pos + 1 + n]]

    eng.drafter.draft = half_oracle
    stats = SpecStats()
    got = list(eng.speculative(SHORT, 64, n_draft=3, sampler=Sampler(params), stats=stats))
    assert got == want
    assert stats.accepted > 0 and stats.accepted < stats.drafted
    eng.close()


def test_adaptive_drafting(next_file, plain):
    """--draft-adaptive on the engine: the counts vary within 0 .. n_max,
    the tokens stay the plain ones, the policy sees verify-step times and no
    settling call; a rejection costs nothing more in its step-time model."""
    eng = _engine(next_file, mtp=True)
    policy = AdaptiveDraft(3, resettle=False)
    stats = SpecStats()
    got = list(eng.speculative(SHORT, 64, n_draft=3, stats=stats, adaptive=policy))
    assert got == plain["short"][:64]
    assert policy.trunk.t and set(policy.trunk.t) <= {1, 2, 3, 4}
    # the first step drafts n_max; the real head's drafts fail, so later steps draft fewer
    assert sum(stats.steps) == stats.trunk_calls and stats.steps[3] >= 1 and sum(1 for c in stats.steps if c) >= 2
    eng.close()
    cost = {1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6}
    assert expected_step_time([0.5, 0.5], 2, cost, resettle=False) == 1.4
    assert expected_step_time([0.5, 0.5], 2, cost) == pytest.approx(1.4 + 0.5 * 1.0 + 0.25 * 1.2)


def test_refusals(next_file, tmp_path):
    """No head in the file; more drafts than a verify step takes; an
    architecture without a head builder."""
    bare = make_model(tmp_path / "bare.gguf", "qwen3next", seed=4, mix="release")
    with pytest.raises(FleError, match="no MTP head inside"):
        _engine(bare, ctx=32, mtp=True)
    eng = _engine(bare, ctx=32)
    with pytest.raises(FleError, match="no MTP head"):
        next(eng.speculative(SHORT, 4))
    eng.close()
    eng = _engine(next_file, ctx=32, mtp=True)
    with pytest.raises(FleError, match="1 to 3 tokens ahead"):
        next(eng.speculative(SHORT, 4, n_draft=4))
    eng.close()
    with pytest.raises(FleError, match="runs qwen3next, qwen4exp files"):
        rmtp.load_head(SimpleNamespace(args=SimpleNamespace(arch="qwen3moe")), next_file, DEVICE, None, False)


def test_cli_generate_mtp_runs_on_the_engine(next_file, monkeypatch, capsys, tmp_path):
    """fle-engine generate --mtp with a CUDA device runs the engine's loop
    (here the CPU engine stands in for the GPU one): the text of plain
    engine decoding, the acceptance lines; serve --mtp takes the engine too
    (a caller that does not draft on it refuses --mtp)."""
    from fle_engine import cli
    import fle_engine.runtime as runtime

    made = []

    class CpuEngine(Engine):
        def __init__(self, path, **kw):
            kw.update(device=DEVICE, profile_path="none", progress=False, log=lambda m: None)
            super().__init__(path, **kw)
            made.append(self)

    monkeypatch.setattr(cli, "resolve_device", lambda d: "cuda")
    monkeypatch.setattr(runtime, "Engine", CpuEngine)
    base = ["generate", str(next_file), "-p", "hello world", "-n", "24", "--temp", "0", "--miss-split", "gpu"]
    assert cli.main(base) == 0
    plain_out = capsys.readouterr().out
    assert cli.main(base + ["--mtp", "--draft-max", "3"]) == 0
    out, err = capsys.readouterr()
    assert out == plain_out
    assert "MTP drafts accepted" in err and "verify steps" in err and "acceptance by draft position" in err
    assert made[-1].drafter is not None and made[0].drafter is None
    assert cli.main(base + ["--mtp", "--draft-max", "4"]) != 0
    assert "1 to 3 tokens ahead" in capsys.readouterr().err
    args = cli._parser().parse_args(["serve", str(next_file), "--mtp"])
    assert cli.use_engine(str(next_file), args, mtp_on_engine=True)
    with pytest.raises(FleError, match="--mtp does not run on the engine here"):
        cli.use_engine(str(next_file), args)


@pytest.mark.parametrize("adaptive", [False, True])
def test_server_mtp_on_the_engine(next_file, budget, plain, monkeypatch, adaptive):
    """fle-engine serve --mtp on the engine (the CPU engine standing in for
    the GPU one): the runtime gets the head (serve's runtime options), the
    server drafts in the engine's verify steps, and a greedy request answers
    the tokens of plain engine decoding with drafts counted; sampled
    requests run through the same loop."""
    import threading

    from fle_engine import cli, server
    from fle_engine.sampling import SamplerParams
    from fle_engine.server import main as server_main
    from fle_engine.server.slots import Job
    import fle_engine.runtime as runtime

    made, served = [], []

    class CpuEngine(Engine):
        def __init__(self, path, **kw):
            kw.update(device=DEVICE, profile_path="none", progress=False, log=lambda m: None, cache_budget=budget,
                      cache_type_k="f32", cache_type_v="f32")
            super().__init__(path, **kw)
            made.append(self)

    async def no_listen(engine, *a, **k):       # the server as serve builds it, without the HTTP listener
        served.append(engine)

    monkeypatch.setattr(cli, "resolve_device", lambda d: "cuda")
    monkeypatch.setattr(runtime, "Engine", CpuEngine)
    monkeypatch.setattr(server_main, "_listen", no_listen)
    monkeypatch.setattr(server_main, "_print_summary", lambda model, log: None)
    argv = ["serve", str(next_file), "--mtp", "--draft-max", "3", "-c", str(N + 48), "--port", "0"]
    assert cli.main(argv + (["--draft-adaptive"] if adaptive else [])) == 0
    srv, rt = served[0], made[0]
    srv.stop()
    assert srv.mtp and srv.runtime and not srv.lanes and rt.drafter is not None and rt.n_seq == 1
    assert (srv.draft_policy is not None) == adaptive and (not adaptive or not srv.draft_policy.resettle)
    # the engine was closed when serve returned; a server on a fresh one answers requests
    rt = CpuEngine(next_file, ctx_size=N + 48, mtp=True)
    srv = server.Engine(rt, srv.tok, n_ctx=N + 48, name="t", mtp=True, n_draft=3, draft_adaptive=adaptive)
    try:
        greedy = SamplerParams(temp=0.0, seed=0)
        res = srv.run(Job(list(SHORT), 40, greedy, ignore_eos=True), threading.Event(), None)
        assert res.tokens == plain["short"][:40]
        assert res.drafted > 0 and rt.stats.multi_steps > 0          # drafts checked in verify steps
        hot = srv.run(Job(list(SHORT), 16, SamplerParams(temp=0.8, seed=3), ignore_eos=True), threading.Event(),
                      None)
        assert hot.n_generated == 16
    finally:
        srv.stop()
        rt.close()


def test_bench_drafters_smoke(next_file, tmp_path):
    """bench/verify_step.py --drafters eager,step on the factory model (the
    times mean nothing on the CPU): each drafter timed at n = 1..3, every
    draft call counted, the modelled rate from the measured draft call."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).parents[1] / "bench" / "verify_step.py"
    spec = importlib.util.spec_from_file_location("bench_verify_mtp", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    assert bench.main(["--model", str(next_file), "--device", "cpu", "--warmup", "4",
                       "--reps", "1", "--drafters", "eager,step", "--draft-tokens", "12", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [d["kind"] for d in res["drafting"]] == ["eager", "engine step"]
    for d in res["drafting"]:
        assert [r["drafts"] for r in d["rows"]] == [1, 2, 3]
        for r in d["rows"]:
            t = res["rows"][r["drafts"]]
            assert r["draft_calls"] >= 3 and r["draft_ms"] > 0 and r["verify_ms"] > 0
            assert r["modelled_tok_s"] == pytest.approx(t["expected_tokens"] / (t["seconds"] + r["draft_ms"] * 1e-3))


def test_spec_stats_time_the_loop(next_file, budget):
    """The engine's loop times its draft calls and verify steps (the CLI's
    'drafting ... ms per call' line): one draft call per verify step that
    drafted, the verify time counted for every trunk call."""
    eng = _engine(next_file, budget, mtp=True)
    st = SpecStats()
    list(eng.speculative(SHORT, 20, n_draft=2, stats=st))
    eng.close()
    assert st.draft_calls == sum(c for n, c in enumerate(st.steps) if n) > 0
    assert st.draft_seconds > 0 and st.verify_seconds > 0
    assert "ms per call" in st.time_line()


def test_auto_drafter_per_architecture(next_file, q4_file):
    """--mtp-drafter auto: the engine's step for qwen3next and qwen4exp
    (both run on a GPU), the eager head when asked for."""
    kinds = {}
    for name, path in (("qwen3next", next_file), ("qwen4exp", q4_file)):
        for drafter in ("auto", "step", "eager"):
            eng = _engine(path, mtp=True, mtp_drafter=drafter)
            kinds[name, drafter] = type(eng.drafter)
            eng.close()
    for name in ("qwen3next", "qwen4exp"):
        assert kinds[name, "auto"] is kinds[name, "step"] is rmtp.StepDrafter
        assert kinds[name, "eager"] is rmtp.Drafter
