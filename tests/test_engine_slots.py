"""Several sequences on the engine: ``Engine(..., n_seq=N)`` lanes decoded in
batched steps, and the server's slots on them.

On the CPU (reference operations) and with CUDA (compiled kernels, one
graph per batch size), lanes with different prompts, joining and leaving at
different times, give per lane the greedy tokens of that prompt decoded
alone by the one-sequence engine and its logits within ``TOL`` of the
largest logit; a step reads each distinct routed expert of its rows once;
a step whose rows all attend to lane 0's cache is caught. The rows-mode
kernels (each row at its own position of its own lane's cache) are held to
their references in Triton's interpreter without CUDA.
"""
from __future__ import annotations

import asyncio
import os

import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fle_engine.kernels import engine_ops  # noqa: E402
from fle_engine.runtime import Engine  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
from lanes_helpers import ARCHS, TOL, arch_files  # noqa: E402
from lanes_helpers import alone as _alone, close_rel as _close, lane_engine as _engine  # noqa: E402

pytestmark = pytest.mark.usefixtures("exact_float32", "one_torch_thread")
DEVICE = torch.device("cuda" if CUDA else "cpu")
# prompts of unequal lengths: the third is long enough for prefill (prefill_min 8), the others run as steps
PROMPTS = [[1, 17, 42, 99, 5, 7], [3, 4, 8], [10 + (i * 37) % 300 for i in range(21)]]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return arch_files(tmp_path_factory, "lanes")


def _run_lanes(eng, schedule, n_steps):
    """Greedy decoding on the lanes: ``schedule`` lane -> (prompt, the
    batched step before which it joins, its token count). Returns per lane
    (tokens, logits [n, V])."""
    toks, logits = {}, {}
    for step in range(n_steps):
        for lane, (prompt, join, _) in schedule.items():
            if join == step:
                lg, _ = eng.lane_prompt(lane, prompt)
                toks[lane], logits[lane] = [int(lg.argmax())], [lg]
        rows = [lane for lane in toks if len(toks[lane]) < schedule[lane][2]]
        if not rows:
            continue
        out = eng.step_lanes(rows, [toks[lane][-1] for lane in rows])
        for j, lane in enumerate(rows):
            toks[lane].append(int(out[j].argmax()))
            logits[lane].append(out[j])
    return {lane: (toks[lane], torch.stack(logits[lane])) for lane in toks}


# lane 0 and 1 from the start, lane 1 done early, lane 2 (a prefilled prompt) joining at step 2, lane 0 alone
# at the end: batched steps of 2, 3, 2 and 1 rows
SCHEDULE = {0: (PROMPTS[0], 0, 10), 1: (PROMPTS[1], 0, 4), 2: (PROMPTS[2], 2, 6)}


def _check_lanes(path):
    eng = _engine(path, ctx=3 * 64, n_seq=3)
    assert eng.ctx_size == 64
    got = _run_lanes(eng, SCHEDULE, 12)
    eng.close()
    for lane, (prompt, _, n) in SCHEDULE.items():
        want, want_logits = _alone(path, prompt, n)
        assert got[lane][0] == want, lane
        _close(got[lane][1], want_logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_lanes_equal_each_prompt_alone(files, arch):
    """Three lanes at different lengths, one finishing early and one joining
    later (its prompt prefilled while the others hold their state): each
    lane's greedy tokens and logits are those of its prompt alone."""
    _check_lanes(files[arch])


def test_rows_attending_to_lane_0_are_caught(files, monkeypatch):
    """A batched step whose rows all read lane 0's cache fails the check above."""
    if CUDA:        # the engines made after the patch pick the patched kernel
        from fle_engine.kernels import triton_engine as ops
    else:
        ops = engine_ops.REFERENCE
    real = ops.attention_multi

    def lane_0(*a, lanes=None, **kw):
        if lanes is not None:
            lanes = torch.zeros_like(lanes)
        return real(*a, lanes=lanes, **kw)

    monkeypatch.setattr(ops, "attention_multi", lane_0)
    with pytest.raises(AssertionError):
        _check_lanes(files["qwen3moe"])


def test_q4_lanes_select_their_own_blocks_and_ple_history(files, monkeypatch):
    """qwen4exp: in the batched steps of the lanes check, a QSA layer's
    selection leaves complete blocks out of some row (its own lane's block
    keys scored); and a step whose rows all hash their PLE n-grams from lane
    0's token history is caught."""
    if CUDA:
        pytest.skip("the eager reference step is inspected (the CUDA step is a graph)")
    from fle_engine.runtime import qwen4exp as q4rt

    real_attn = engine_ops.REFERENCE.attention_multi
    left_out = []

    def spy(q, kc, vc, pos, *a, keep=None, ratio=0, lanes=None, **kw):
        if lanes is not None and keep is not None:
            complete = (pos + 1) // ratio
            left_out.append(int(((keep[:, :int(complete.max())] == 0).sum(1) > 0).sum()))
        return real_attn(q, kc, vc, pos, *a, keep=keep, ratio=ratio, lanes=lanes, **kw)

    monkeypatch.setattr(engine_ops.REFERENCE, "attention_multi", spy)
    _check_lanes(files["qwen4exp"])
    assert sum(left_out) > 0
    monkeypatch.undo()

    real = q4rt.Net.ple_rows_multi

    def lane_0_history(self, p, state, n):
        lanes = self.rows_at(state, n)[1]
        if lanes is None:
            return real(self, p, state, n)
        b = state.bufs
        seq = torch.cat([b.ple_tok.index_select(0, torch.zeros_like(lanes)), state.toks[:n, None]], 1)
        self.ple_hash(p, seq, 1, state.multi.ple_rows[:n * self.args.ple_heads])
        b.ple_tok.index_copy_(0, lanes, seq[:, 1:])

    monkeypatch.setattr(q4rt.Net, "ple_rows_multi", lane_0_history)
    with pytest.raises(AssertionError):
        _check_lanes(files["qwen4exp"])


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_step_reads_each_expert_once(files, arch, monkeypatch):
    """The step's routed experts are one union over all its rows: per layer
    and product, the ids of B x K rows, each distinct expert read by one row
    (the union's ``reads`` flags); rows share experts here, so fewer reads
    than rows; the cache policy sees all B x K ids of every layer as one step."""
    if CUDA:
        pytest.skip("the eager reference step is inspected (the CUDA step is a graph)")
    calls = []
    real = engine_ops.REFERENCE.experts_union

    def record(*a, **kw):
        ids = a[8]
        reads = torch.zeros(ids.numel(), dtype=torch.int32)
        real(*a, **{**kw, "reads": reads})
        calls.append((ids.clone(), reads))

    eng = _engine(files[arch], ctx=3 * 64, n_seq=3)
    for lane, p in enumerate(PROMPTS):
        eng.lane_prompt(lane, p)
    a = eng.args
    req0, steps0 = eng.cache.stats.requests, eng.cache.stats.steps
    monkeypatch.setattr(engine_ops.REFERENCE, "experts_union", record)
    eng.step_lanes([2, 0, 1], [5, 6, 7])
    monkeypatch.undo()
    assert len(calls) == 2 * a.n_layer                    # gate+up and down of every layer
    shared = 0
    for ids, reads in calls:
        assert ids.numel() == 3 * a.n_expert_used
        assert int(reads.sum()) == len(set(ids.tolist()))
        shared += ids.numel() - int(reads.sum())
    assert shared > 0
    assert eng.cache.stats.steps == steps0          # the policy sees a batched step one step late ...
    eng.flush()                                     # ... or when asked
    assert eng.cache.stats.steps == steps0 + 1
    assert eng.cache.stats.requests == req0 + a.n_layer * 3 * a.n_expert_used
    eng.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_lane_keeps_its_sequence_between_prompts(files, arch):
    """A follow-up prompt on a lane (its last prompt, the answer, new tokens)
    computes only the new tokens and continues as a fresh run of the whole
    prompt; another lane's sequence is untouched by it."""
    path = files[arch]
    eng = _engine(path, ctx=2 * 64, n_seq=2)
    got = _run_lanes(eng, {0: (PROMPTS[0], 0, 4), 1: (PROMPTS[1], 0, 4)}, 4)
    follow = PROMPTS[0] + got[0][0][:-1] + [11, 12, 13]
    lg, kept = eng.lane_prompt(0, follow)
    assert kept == len(PROMPTS[0]) + 3
    # the lane ran the follow-up's tokens as steps: so does the run it is held to (a prefill of the whole
    # prompt would multiply in bfloat16 on CUDA)
    want, want_logits = _alone(path, follow, 1, prefill_min=len(follow) + 1)
    assert int(lg.argmax()) == want[0]
    _close(lg[None], want_logits)
    # lane 1 continues its own sequence
    out = eng.step_lanes([1], [got[1][0][-1]])
    more, _ = _alone(path, PROMPTS[1], 5)
    assert int(out[0].argmax()) == more[4]
    eng.close()


def test_launch_and_finish_lanes_overlap_the_policy(files):
    """``launch_lanes`` / ``finish_lanes`` (the halves of ``step_lanes``): the
    same logits as ``step_lanes``; while a step is in flight every lane call
    and a second launch are refused; the routing of step t reaches the
    policy at step t + 1's launch (one step late), ``flush`` at once, and
    every step's routing is counted once."""
    path = files["qwen3moe"]
    a_eng, b_eng = _engine(path, ctx=2 * 64, n_seq=2), _engine(path, ctx=2 * 64, n_seq=2)
    for e in (a_eng, b_eng):
        for lane, p in enumerate(PROMPTS[:2]):
            e.lane_prompt(lane, p)
    s0 = b_eng.cache.stats.steps
    toks = [5, 6]
    for step in range(4):
        want = a_eng.step_lanes([0, 1], toks)
        b_eng.launch_lanes([0, 1], toks)
        # step t - 1's routing went to the policy at this launch; this step's is not read yet
        assert b_eng.cache.stats.steps == s0 + step
        with pytest.raises(FleError, match="in flight"):
            b_eng.launch_lanes([0, 1], toks)
        with pytest.raises(FleError, match="in flight"):
            b_eng.lane_prompt(0, [1, 2])
        with pytest.raises(FleError, match="in flight"):
            b_eng.flush()
        got = b_eng.finish_lanes()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert b_eng.next_tokens == a_eng.next_tokens
        toks = list(b_eng.next_tokens)
    assert b_eng.cache.stats.steps == s0 + 3
    b_eng.flush()
    b_eng.flush()                                   # nothing left: counted once
    assert b_eng.cache.stats.steps == s0 + 4 and b_eng.stats.multi_steps == 4
    a_eng.flush()
    assert a_eng.cache.stats.requests == b_eng.cache.stats.requests
    assert list(a_eng.step_hits) == list(b_eng.step_hits)
    with pytest.raises(FleError, match="no batched step"):
        b_eng.finish_lanes()
    b_eng.launch_lanes([1], [7])
    b_eng.close()                                   # a step in flight is read before closing
    a_eng.close()


def test_lane_options_and_refusals(files):
    path = files["qwen3moe"]
    eng = _engine(path, ctx=100, n_seq=3)
    assert eng.n_seq == 3 and eng.ctx_size == 33
    eng.lane_prompt(1, [1, 2, 3])
    with pytest.raises(FleError, match="distinct lanes"):
        eng.step_lanes([1, 1], [4, 5])
    with pytest.raises(FleError, match="distinct lanes"):
        eng.step_lanes([3], [4])
    with pytest.raises(FleError, match="one sequence"):
        eng.verify_step([4, 5])
    with pytest.raises(FleError, match="one sequence"):
        eng.rewind(1)
    eng.lane_reset(1)
    assert eng.lane_reuse(1, [1, 2, 3]) == 0
    eng.close()
    with pytest.raises(FleError, match="MTP"):
        _engine(path, n_seq=2, mtp=True)
    one = _engine(path)
    with pytest.raises(FleError, match="several sequences"):
        one.step_lanes([0], [1])
    one.close()


# ---------------------------------------------------------------------------
# the rows-mode kernels against their references (Triton's interpreter without CUDA)


@pytest.fixture(scope="module")
def fast():
    pytest.importorskip("triton")
    return engine_ops.pick("triton", DEVICE)


@pytest.mark.parametrize("kv", ["f32", "q8_0"])
def test_rows_kernels_write_and_read_their_own_lane(fast, kv):
    """Rows of a batched step: row t's k and v written at its own position
    of its own lane's cache, and its attention over that lane's positions
    0 .. pos[t] only; the fast kernels equal the references (one-token
    calls on each lane's cache)."""
    from fle_engine.kernels.triton_engine import attn_scratch
    from fle_engine.layers import rope_table

    n_lanes, n_head, n_kv, dh, n_pos, n_rot = 3, 8, 2, 64, 40, 32
    cos, sin = (torch.from_numpy(t) for t in rope_table(n_rot, 10000.0, n_pos))
    gen = torch.Generator().manual_seed(5)
    qn, kn = torch.rand(dh, generator=gen) + 0.5, torch.rand(dh, generator=gen) + 0.5
    k0, v0 = (torch.randn(n_lanes, n_kv, n_pos, dh, generator=gen) for _ in range(2))
    width = (n_head + 2 * n_kv) * dh
    for lanes, pos in (([2, 0], [5, 17]), ([1, 2, 0], [0, 39, 3])):
        n = len(lanes)
        qkv = torch.randn(n, width + 32, generator=gen)
        res = []
        for ops, dev in ((engine_ops.REFERENCE, torch.device("cpu")), (fast, DEVICE)):
            if kv == "q8_0":
                kc, vc = (engine_ops.Q8Cache(n_kv, n_pos, dh, dev, lanes=n_lanes) for _ in range(2))
            else:
                kc, vc = k0.clone().to(dev), v0.clone().to(dev)
            q = torch.zeros(n, n_head * dh, device=dev)
            o = torch.zeros(n, n_head * dh, device=dev)
            partial, ml = attn_scratch(n_kv, n_head, dh, dev, n_tok=n)
            p, ln = torch.tensor(pos, device=dev), torch.tensor(lanes, device=dev)
            ops.qk_rope_kv_multi(qkv.to(dev), qn.to(dev), kn.to(dev), 1e-6, cos.to(dev), sin.to(dev), p, n_head,
                                 n_kv, dh, n_rot, q, kc, vc, lanes=ln)
            ops.attention_multi(q, kc, vc, p, dh ** -0.5, o, partial, ml, lanes=ln)
            cached = [(c.q.cpu(), c.d.cpu()) if kv == "q8_0" else (c.cpu(),) for c in (kc, vc)]
            res.append((q.cpu(), o.cpu(), cached))
        (q0, o0, c0), (q1, o1, c1) = res
        _close(q1, q0, 1e-5)
        _close(o1, o0, 1e-5)
        for a, b in zip(c0, c1):
            for ta, tb in zip(a, b):
                assert torch.equal(ta, tb) if kv == "q8_0" else float((ta - tb).abs().max()) < 1e-5
        # a row reads its own lane: the same query over lane 0 gives another answer
        if kv == "f32":
            o_wrong = torch.zeros_like(o0)
            engine_ops.REFERENCE.attention_multi(q0, c0[0][0], c1[1][0], torch.tensor(pos), dh ** -0.5, o_wrong,
                                                 lanes=torch.zeros(n, dtype=torch.int64))
            assert not torch.allclose(o_wrong, o0)


# ---------------------------------------------------------------------------
# the captured graphs


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("arch", ARCHS)
def test_lane_graphs_captured_and_equal_to_eager(files, arch):
    """With CUDA every batch size gets its own graph (captured on first use),
    whose tokens and logits equal the eager step's; each lane's one-token
    steps replay that lane's own graph."""
    path = files[arch]
    eng, eager = _engine(path, ctx=3 * 64, n_seq=3), _engine(path, ctx=3 * 64, n_seq=3, graphs=False)
    assert eng._graph is not None and eager._graph is None
    got = [_run_lanes(e, SCHEDULE, 12) for e in (eng, eager)]
    for lane in SCHEDULE:
        assert got[0][lane][0] == got[1][lane][0]
        _close(got[0][lane][1], got[1][lane][1], 1e-4)
    assert sorted(eng._lane_graphs) == [1, 2, 3]
    eng.close()
    eager.close()


# ---------------------------------------------------------------------------
# the server's slots on the lanes


def _serve(path, n_par, ctx_slot=96, f32_prefill=False):
    """A server on ``n_par`` lanes (``f32_prefill``: prompts prefill with
    float32 products also on CUDA, where they would in bfloat16)."""
    from fle_engine.server import Engine as Server
    from fle_engine.tokenizer import Tokenizer

    rt = Engine(path, device=DEVICE, cache_budget="auto", ctx_size=ctx_slot * n_par, cache_type_k="f32",
                cache_type_v="f32", profile_path="none", progress=False, log=lambda m: None, prefill_min=8,
                n_seq=n_par)
    if f32_prefill and rt.prefill is not None:
        rt.prefill.bf16 = False
    srv = Server(rt, Tokenizer.from_gguf(path), n_ctx=ctx_slot * n_par, name="t", n_parallel=n_par)
    return srv, rt


def _call(srv, fn):
    from aiohttp.test_utils import TestClient, TestServer

    from fle_engine.server import create_app

    async def main():
        async with TestClient(TestServer(create_app(srv))) as client:
            return await fn(client)
    try:
        return asyncio.run(main())
    finally:
        srv.stop()


# no ignore_eos: host-sampled rounds ban the end-of-generation tokens then (llama-server's rule), where the
# one-sequence engine's token generator only does not stop at them
BODIES = [{"prompt": "the river and the mountain", "max_tokens": 16, "temperature": 0},
          {"prompt": "a quiet town by the sea and the long road home, far away", "max_tokens": 12,
           "temperature": 0.8, "seed": 7},
          {"prompt": "stone lamp cloud", "max_tokens": 14, "temperature": 0.7, "seed": 3, "top_k": 20}]


@pytest.mark.parametrize("arch", ARCHS)
def test_server_slots_at_once_answer_as_one_at_a_time(files, arch):
    """At --parallel 2 on the engine, requests sent together (greedy and
    seeded sampling, prompts of unequal lengths) run on both slots at once,
    in batched rounds, and answer as the same requests one at a time, and as
    an engine of one sequence serving them."""
    pytest.importorskip("aiohttp")
    path = files[arch]
    srv, rt = _serve(path, 2)
    assert srv.lanes and srv.n_ctx_slot == 96

    async def together(client):
        tasks = [asyncio.create_task(client.post("/v1/completions", json=b)) for b in BODIES]
        busy = 0
        while not all(t.done() for t in tasks):
            s = await (await client.get("/slots")).json()
            busy = max(busy, sum(x["is_processing"] for x in s))
            await asyncio.sleep(0.005)
        out = [await (await t).json() for t in tasks]
        return busy, [o["choices"][0]["text"] for o in out], sum(o["usage"]["completion_tokens"] for o in out)

    async def one_by_one(client):
        return [(await (await client.post("/v1/completions", json=b)).json())["choices"][0]["text"] for b in BODIES]

    rounds = srv.n_rounds
    busy, at_once, n_tokens = _call(srv, together)
    assert busy == 2
    assert srv.n_rounds - rounds < n_tokens              # rounds of two tokens
    assert _call(srv, one_by_one) == at_once
    rt.close()
    single, rt1 = _serve(path, 1)
    assert not single.lanes
    assert _call(single, one_by_one) == at_once
    rt1.close()


def test_server_busy_slot_waits_and_is_not_disturbed(files):
    """A long answer runs on slot 0; a request naming slot 0 waits until it
    ends and leaves it alone (the long answer as when it runs alone), while
    a request naming no slot runs beside it on slot 1."""
    pytest.importorskip("aiohttp")
    path = files["qwen3moe"]
    long_body = {"prompt": "the red fox jumps over the lazy dog", "n_predict": 30, "temperature": 0,
                 "ignore_eos": True, "id_slot": 0}
    named = {"prompt": "seven blue whales sing in the deep cold sea", "n_predict": 5, "temperature": 0,
             "ignore_eos": True, "id_slot": 0}
    free = {"prompt": "one two three", "n_predict": 5, "temperature": 0, "ignore_eos": True}
    srv, rt = _serve(path, 2)

    async def fn(client):
        alone = [await (await client.post("/completion", json=b)).json() for b in (long_body, named, free)]
        done = []

        async def req(body, tag):
            j = await (await client.post("/completion", json=body)).json()
            done.append(tag)
            return j

        a = asyncio.create_task(req(long_body, "long"))
        while not srv.slots[0].busy:
            await asyncio.sleep(0.002)
        b = asyncio.create_task(req(named, "named"))
        c = asyncio.create_task(req(free, "free"))
        return alone, [await a, await b, await c], done

    alone, got, done = _call(srv, fn)
    assert [g["content"] for g in got] == [a["content"] for a in alone]
    assert got[0]["tokens_predicted"] == 30 and [g["id_slot"] for g in got] == [0, 0, 1]
    assert done.index("long") < done.index("named")
    assert done.index("free") < done.index("long")          # slot 1 ran beside the long answer
    rt.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_server_follow_up_turn_reuses_its_slot(files, arch):
    """A follow-up turn on a slot (its prompt, the answer but its last
    token, a new message) computes only the new tokens, named by id_slot or
    not (the slot holding the prefix is chosen), while another slot's turn
    ran in between; it answers as a fresh run (cache_prompt false)."""
    pytest.importorskip("aiohttp")
    path = files[arch]
    # the cold run prefills all of its prompt, the cached turn two tokens: both in float32 products, so that
    # CUDA's bfloat16 prefill does not enter the comparison of their greedy tokens
    srv, rt = _serve(path, 2, f32_prefill=True)
    first = [10 + (i * 7919) % 400 for i in range(30)]
    other = [20 + (i * 131) % 300 for i in range(25)]

    async def fn(client):
        opts = {"n_predict": 5, "temperature": 0, "ignore_eos": True, "return_tokens": True}
        r1 = await (await client.post("/completion", json={"prompt": first, "id_slot": 1, **opts})).json()
        await client.post("/completion", json={"prompt": other, "id_slot": 0, **opts})
        follow = first + r1["tokens"][:-1] + [11, 12, 13, 14]
        r2 = await (await client.post("/completion", json={"prompt": follow, **opts})).json()
        follow2 = follow + r2["tokens"][:-1] + [15, 16]
        probs = {"n_probs": 2}
        r3 = await (await client.post("/completion", json={"prompt": follow2, "id_slot": 1, **opts, **probs})).json()
        r4 = await (await client.post("/completion", json={"prompt": follow2, "cache_prompt": False, **opts,
                                                           **probs})).json()
        return follow, r2, follow2, r3, r4

    follow, r2, follow2, r3, r4 = _call(srv, fn)
    assert r2["id_slot"] == 1 and r2["timings"]["cache_n"] == len(first) + 4 and r2["timings"]["prompt_n"] == 4
    assert r3["timings"]["cache_n"] == len(follow) + 4 and r3["timings"]["prompt_n"] == 2
    assert r4["timings"]["cache_n"] == 0
    _same_greedy(r3, r4)
    rt.close()


def _same_greedy(a: dict, b: dict, tie: float = 1e-3) -> None:
    """Two greedy answers with ``n_probs`` 2 (llama-server's
    ``completion_probabilities``) agree: the same tokens, or the same up to
    a step where the runs' two best tokens are the same pair and within
    ``tie`` of each other in log-probability in both (a near-tie on a random
    model, which the last bits of a sum decide: on CUDA a cached turn and a
    cold run differ in which experts are still read over PCIe, and those go
    through another kernel), after which they are not compared. Every
    log-probability before that step agrees within ``tie``."""
    pa, pb = a["completion_probabilities"], b["completion_probabilities"]
    assert len(pa) == len(pb) == len(a["tokens"]) == len(b["tokens"])
    for i, (x, y) in enumerate(zip(pa, pb)):
        tx, ty = x["top_logprobs"], y["top_logprobs"]
        if x["id"] != y["id"]:
            pair = {t["id"] for t in tx}
            assert pair == {t["id"] for t in ty} == {x["id"], y["id"]}, (i, tx, ty)
            assert abs(tx[0]["logprob"] - tx[1]["logprob"]) < tie and \
                abs(ty[0]["logprob"] - ty[1]["logprob"]) < tie, (i, tx, ty)
            return
        assert abs(x["logprob"] - y["logprob"]) < tie, (i, x, y)
    assert a["content"] == b["content"]


@pytest.mark.parametrize("arch", ARCHS)
def test_server_stop_string_then_follow_up_on_lanes(files, arch):
    """A lane's answer ended by a stop string while the other slot decodes
    (its text is scanned once its next step is launched, so the lane has run
    one token more than it answered): a follow-up on that slot reuses what the
    lane holds and answers as a cold run, for the recurrent states too."""
    import threading

    from fle_engine.sampling import SamplerParams
    from fle_engine.server.slots import Job

    srv, rt = _serve(files[arch], 2, f32_prefill=True)
    greedy = SamplerParams(temp=0.0, seed=0)
    a = [10 + (i * 7919) % 400 for i in range(20)]
    b = [20 + (i * 131) % 300 for i in range(18)]
    want = srv.run(Job(a, 24, greedy, ignore_eos=True, id_slot=0), threading.Event(), None)
    stop = want.text[len(want.text) // 2:][:2]
    fb = srv.submit(Job(b, 40, greedy, ignore_eos=True, id_slot=1), threading.Event(), None)
    ra = srv.run(Job(a, 24, greedy, ignore_eos=True, id_slot=0, stop=[stop]), threading.Event(), None)
    rb = fb.result(timeout=600)
    assert ra.finish_reason == "stop" and ra.stop_word == stop and want.text.startswith(ra.text)
    assert ra.tokens == want.tokens[:len(ra.tokens)] and rb.n_generated == 40
    follow = a + ra.tokens + [11, 12, 13]
    warm = srv.run(Job(follow, 6, greedy, ignore_eos=True, id_slot=0), threading.Event(), None)
    cold = srv.run(Job(follow, 6, greedy, ignore_eos=True, id_slot=0, cache_prompt=False), threading.Event(), None)
    assert warm.n_cached >= len(a) + len(ra.tokens) - 1     # the lane kept its answer (and the token after it)
    assert cold.n_cached == 0 and warm.tokens == cold.tokens
    srv.stop()
    rt.close()


def test_server_cancel_and_stop_strings_on_lanes(files):
    """A cancelled request ends (cancelled) without disturbing the other
    slot's answer; a stop string ends an answer there."""
    import threading

    from fle_engine.sampling import SamplerParams
    from fle_engine.server.slots import Job

    path = files["qwen3moe"]
    srv, rt = _serve(path, 2)
    tok = srv.tok
    ids_a = tok.encode("canary alpha: the red fox", add_special=True, parse_special=True)
    ids_b = tok.encode("canary bravo: seven whales", add_special=True, parse_special=True)
    greedy = SamplerParams(temp=0.0, seed=0)
    want_b = srv.run(Job(ids_b, 20, greedy), threading.Event(), None)
    cancel = threading.Event()
    seen = []

    def emit(text, probs):
        seen.append(text)
        if len(seen) == 3:
            cancel.set()

    fa = srv.submit(Job(ids_a, 60, greedy), cancel, emit)
    fb = srv.submit(Job(ids_b, 20, greedy), threading.Event(), None)
    ra, rb = fa.result(timeout=600), fb.result(timeout=600)
    assert ra.cancelled and ra.n_generated < 60
    assert rb.text == want_b.text and not rb.cancelled
    stop = want_b.text[len(want_b.text) // 2:][:3]
    rs = srv.run(Job(ids_b, 20, greedy, stop=[stop]), threading.Event(), None)
    assert rs.finish_reason == "stop" and rs.stop_word == stop and want_b.text.startswith(rs.text)
    srv.stop()
    rt.close()
