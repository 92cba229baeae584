"""``fle-engine serve``'s slots, scheduler and prompt cache, on factory models.

Answers are compared with cold runs of the engine's own decode loop; the
prompt cache's follow-up turns must equal a cold run while recomputing only
their new tokens, for all three architectures (recurrent state included).
The busy-slot canary: a request naming a busy slot and carrying another
cached conversation must wait and leave the running answer alone.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

torch = pytest.importorskip("torch")
pytest.importorskip("aiohttp")

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

import fle_engine  # noqa: E402
from fle_engine import layers as L  # noqa: E402
from fle_engine.sampling import Sampler, SamplerParams, generate_tokens  # noqa: E402
from fle_engine.server import Engine, create_app  # noqa: E402
from fle_engine.server import cache as C  # noqa: E402
from fle_engine.tokenizer import Tokenizer  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402

GREEDY = SamplerParams(temp=0.0, seed=0)
ARCHS = ["qwen3moe", "qwen3next", "qwen4exp"]


@pytest.fixture(scope="module")
def factory(tmp_path_factory):
    d = tmp_path_factory.mktemp("slots")
    out = {}
    for arch in ARCHS:
        p = make_model(d / f"{arch}.gguf", arch, mix="f32")
        out[arch] = (fle_engine.load(p), Tokenizer.from_gguf(p))
    return out


def call(engine, fn, **kw):
    async def main():
        async with TestClient(TestServer(create_app(engine, **kw))) as client:
            return await fn(client)
    return asyncio.run(main())


def cold(model, tok, prompt, n, ignore_eos=False):
    """Token ids of a cold greedy run of the decode loop."""
    return list(generate_tokens(model, prompt, n, Sampler(GREEDY), stop=() if ignore_eos else tok.eog_ids))


# ---------------------------------------------------------------- the batched forward


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_batch_equals_one_by_one(factory, arch):
    m, _ = factory[arch]
    pa, pb = [1, 5, 9, 200, 7, 3], [3, 4, 8]
    s1, s2, t1, t2 = (m.new_state(32) for _ in range(4))
    ref = [m.forward(pa, s1), m.forward(pb, s2)]
    got = m.forward_batch([pa, pb], [t1, t2])
    for step in range(4):
        ref += [m.forward([11 + step], s1), m.forward([20 + step], s2)]
        got += m.forward_batch([[11 + step], [20 + step]], [t1, t2])
    for r, g in zip(ref, got):
        assert r.shape == g.shape
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)
    assert t1.length == s1.length and t2.length == s2.length


@pytest.mark.parametrize("arch", ARCHS)
def test_pooled_slot_states_step_as_one_by_one(factory, arch, monkeypatch):
    """With several slots, the slots' attention caches (and GDN states,
    qwen4exp's indexer keys and PLE histories) are rows of one buffer per
    layer, and a decode step of sequences of unequal lengths attends for all
    of them at once (the shorter masked past its end, each under its own
    QSA selection) and runs the delta rule and the PLE for all at once."""
    m, tok = factory[arch]
    eng = Engine(m, tok, n_ctx=128, name="t", n_parallel=2)
    t1, t2 = (eng._new_state(s) for s in eng.slots)
    att = [il for il, c in enumerate(t1.layers) if isinstance(c, L.AttnCache)]
    assert att
    for il in att:
        assert L.stacked([t1.layers[il].k, t2.layers[il].k]) is not None
        if type(t1.layers[il]) is L.AttnCache:       # qwen4exp's attention reads whole caches
            assert L.stacked([L.live_view(t1.layers[il], 5).k, L.live_view(t2.layers[il], 9).k]).shape[2] == 9
        if getattr(t1.layers[il], "idx", None) is not None:
            assert L.stacked([t1.layers[il].idx, t2.layers[il].idx]).shape == (2, *t1.layers[il].idx.shape)
    for c1, c2 in zip(t1.layers, t2.layers):
        if type(c1) is L.GDNState:
            assert L.stacked([c1.conv, c2.conv]).shape == (2, *c1.conv.shape)
            assert L.stacked([c1.ssm, c2.ssm]).shape == (2, *c1.ssm.shape)
    if getattr(t1, "ple", None) is not None:
        assert L.stacked_fields([t1.ple, t2.ple], ("tokens", "conv")) is not None
        torch.testing.assert_close(t1.ple.tokens, m.new_state(8).ple.tokens)    # the new state's values (EOS)
    kept = []                                 # (cells kept, cells before and at the query) of QSA selections
    if arch == "qwen4exp":
        from fle_engine.models import qwen4exp as Q

        keep_cells = Q.QSAttention._keep

        def spy(self, score, positions, n_pos):
            keep = keep_cells(self, score, positions, n_pos)
            kept.append((keep.sum(-1), positions + 1))
            return keep

        monkeypatch.setattr(Q.QSAttention, "_keep", spy)
    s1, s2 = m.new_state(64), m.new_state(64)
    # prompts long enough that a QSA layer's indexer leaves blocks out
    pa = [(7 * i + 3) % 500 for i in range(37)]
    pb = [(11 * i + 5) % 500 for i in range(23)]
    ref = [m.forward(pa, s1), m.forward(pb, s2)]
    got = m.forward_batch([pa, pb], [t1, t2])
    for step in range(6):
        ref += [m.forward([11 + step], s1), m.forward([20 + step], s2)]
        got += m.forward_batch([[11 + step], [20 + step]], [t1, t2])
    ref.append(m.forward([30], s2))           # one sequence alone, then both again
    got += m.forward_batch([[30]], [t2])
    ref += [m.forward([31], s1), m.forward([32], s2)]
    got += m.forward_batch([[31], [32]], [t1, t2])
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)
    if arch == "qwen4exp":                    # a batched step's selection left cells out of both rows
        assert any(n.shape[0] == 2 and bool((n < c).all()) for n, c in kept)
    # separate tensors, and views that overlap or are unequally spaced, are not one pool
    a, b = torch.zeros(2, 8, 4), torch.zeros(2, 8, 4)
    assert L.stacked([a, b]) is None
    buf = torch.zeros(3, 2, 8, 4)
    assert L.stacked([buf[0], buf[1], buf[2]]) is not None and L.stacked([buf[0], buf[2], buf[1]]) is None
    assert L.stacked([buf[0], buf[0]]) is None
    assert L.stacked([buf.view(-1)[:64].view(2, 8, 4), buf.view(-1)[32:96].view(2, 8, 4)]) is None
    # stacked_fields keeps each view while its rows live, and sees rows change
    c0, c1, c2 = (L.GDNState(buf[i], buf[i, :1]) for i in range(3))
    first = L.stacked_fields([c0, c1], ("conv",))[0]
    assert L.stacked_fields([c0, c1], ("conv",))[0] is first
    assert L.stacked_fields([c0, c2], ("conv",))[0].stride(0) == 2 * buf.stride(0)
    assert L.stacked_fields([c0, c1], ("conv", "ssm")) is None          # ssm: not whole rows of a pool
    c1 = L.GDNState(buf[2], buf[2, :1])
    again = L.stacked_fields([c0, c1], ("conv",))[0]
    assert again is not first and again.stride(0) == 2 * buf.stride(0)


# ---------------------------------------------------------------- parallel slots


def test_two_slots_run_at_once_and_answer_as_cold_runs(factory):
    m, tok = factory["qwen3moe"]
    eng = Engine(m, tok, n_ctx=256, name="t", n_parallel=2)
    prompts = ["the river and the mountain", "a quiet town by the sea"]
    rounds_before = []

    async def fn(client):
        tasks = [asyncio.create_task(client.post("/v1/completions", json={
            "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True})) for p in prompts]
        await asyncio.sleep(0.05)
        busy = 0
        while not all(t.done() for t in tasks):
            s = await (await client.get("/slots")).json()
            busy = max(busy, sum(x["is_processing"] for x in s))
            await asyncio.sleep(0.01)
        return busy, [await (await t).json() for t in tasks]

    rounds_before.append(eng.n_rounds)
    busy, answers = call(eng, fn)
    assert busy == 2
    for p, a in zip(prompts, answers):
        ids = tok.encode(p, add_special=True, parse_special=True)
        assert a["choices"][0]["text"] == tok.decode(cold(m, tok, ids, 24, ignore_eos=True))
    # interleaved: both answers' 24 tokens took about 24 rounds, not 48
    assert eng.n_rounds - rounds_before[0] < 24 + 24


@pytest.mark.parametrize("arch", ARCHS)
def test_two_slots_answer_as_one_slot(factory, arch):
    """Greedy answers of 4 requests at once (prompts of unequal lengths, so
    the batched attention masks the shorter sequence) are the same on 2
    slots, whose caches are one pool, as on 1 slot."""
    m, tok = factory[arch]
    prompts = ["the river", "a quiet town by the sea and the long road home", "stone lamp cloud",
               "one two three four five six seven eight nine ten eleven"]

    def answers(n_par):
        eng = Engine(m, tok, n_ctx=256 * n_par, name="t", n_parallel=n_par)

        async def fn(client):
            rs = await asyncio.gather(*(client.post("/v1/completions", json={
                "prompt": p, "max_tokens": 20, "temperature": 0, "ignore_eos": True}) for p in prompts))
            return [(await r.json())["choices"][0]["text"] for r in rs]

        out = call(eng, fn)
        if n_par > 1:
            k0, k1 = (next(c.k for c in s.state.layers if isinstance(c, L.AttnCache)) for s in eng.slots)
            assert k0._base is not None and k0._base is k1._base
        return out

    assert answers(2) == answers(1)


def test_slot_context_is_shared(factory):
    m, tok = factory["qwen3moe"]
    eng = Engine(m, tok, n_ctx=128, name="t", n_parallel=2)
    assert eng.n_ctx_slot == 64

    async def fn(client):
        r = await client.post("/v1/completions", json={"prompt": list(range(10, 80))})
        props = await (await client.get("/props")).json()
        return r.status, await r.json(), props

    status, r, props = call(eng, fn)
    assert status == 400 and r["error"]["n_ctx"] == 64
    assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == 64


def test_id_slot_picks_the_slot_and_the_longest_prefix_is_chosen(factory):
    m, tok = factory["qwen3moe"]
    eng = Engine(m, tok, n_ctx=512, name="t", n_parallel=2)
    a = "one two three four five six seven eight nine ten"
    b = "completely different words about a mountain lake"

    async def fn(client):
        out = []
        for body in ({"prompt": a, "id_slot": 1}, {"prompt": b, "id_slot": 0}, {"prompt": a + " eleven"},
                     {"prompt": b + " again"}):
            r = await client.post("/completion", json={**body, "n_predict": 4, "temperature": 0})
            out.append(await r.json())
        return out

    r = call(eng, fn)
    assert [x["id_slot"] for x in r] == [1, 0, 1, 0]
    n_a = len(tok.encode(a, add_special=True, parse_special=True))
    assert r[2]["timings"]["cache_n"] == n_a and r[3]["timings"]["cache_n"] > 0


# ---------------------------------------------------------------- the busy-slot canary


def test_busy_slot_canary_zero_flips_in_20_rounds(factory):
    """A long answer runs on slot 0; a request naming slot 0 and carrying
    another cached conversation arrives meanwhile. It must wait, and the
    long answer must run to its full length as a cold run gives it."""
    m, tok = factory["qwen3moe"]
    eng = Engine(m, tok, n_ctx=512, name="t", n_parallel=2, cache_ram_mib=64)
    conv_a = "canary alpha: the red fox jumps over the lazy dog"
    conv_b = "canary bravo: seven blue whales sing in the deep cold sea"
    ids_a = tok.encode(conv_a, add_special=True, parse_special=True)
    ids_b = tok.encode(conv_b, add_special=True, parse_special=True)
    n_long, n_short = 48, 6
    want_a = tok.decode(cold(m, tok, ids_a, n_long, ignore_eos=True))
    want_b = tok.decode(cold(m, tok, ids_b, n_short, ignore_eos=True))

    async def fn(client):
        flips, order_ok = 0, 0
        for _ in range(20):
            # conversation B is computed on slot 0 and so becomes cached (slot, then RAM cache)
            await client.post("/completion", json={"prompt": conv_b, "n_predict": 2, "temperature": 0,
                                                   "id_slot": 0})
            done = []

            async def req(body, tag):
                r = await client.post("/completion", json=body)
                j = await r.json()
                done.append(tag)
                return j

            long_ = asyncio.create_task(req({"prompt": conv_a, "n_predict": n_long, "temperature": 0,
                                             "ignore_eos": True, "id_slot": 0}, "a"))
            while not eng.slots[0].busy:
                await asyncio.sleep(0.002)
            short = asyncio.create_task(req({"prompt": conv_b, "n_predict": n_short, "temperature": 0,
                                             "ignore_eos": True, "id_slot": 0}, "b"))
            ra, rb = await long_, await short
            flips += (ra["content"] != want_a) + (rb["content"] != want_b)
            order_ok += done == ["a", "b"] and ra["tokens_predicted"] == n_long
        return flips, order_ok

    flips, order_ok = call(eng, fn)
    assert flips == 0
    assert order_ok == 20


# ---------------------------------------------------------------- the prompt cache


@pytest.mark.parametrize("arch", ARCHS)
def test_follow_up_turn_recomputes_only_new_tokens(factory, arch):
    m, tok = factory[arch]
    n_first = 2000
    eng = Engine(m, tok, n_ctx=4096, name="t", n_parallel=1, cache_ram_mib=256)
    first = [10 + (i * 7919) % 400 for i in range(n_first)]
    turn2_extra = [11, 12, 13, 14, 15, 16, 17, 18]

    async def fn(client):
        r1 = await (await client.post("/completion", json={"prompt": first, "n_predict": 6, "temperature": 0,
                                                           "ignore_eos": True, "return_tokens": True})).json()
        follow = first + r1["tokens"] + turn2_extra
        r2 = await (await client.post("/completion", json={"prompt": follow, "n_predict": 6, "temperature": 0,
                                                           "ignore_eos": True, "return_tokens": True})).json()
        # another conversation takes the only slot; the first comes back from the RAM cache
        await client.post("/completion", json={"prompt": [5, 6, 7, 8], "n_predict": 2, "temperature": 0})
        follow3 = follow + r2["tokens"] + [21, 22]
        r3 = await (await client.post("/completion", json={"prompt": follow3, "n_predict": 6, "temperature": 0,
                                                           "ignore_eos": True})).json()
        r4 = await (await client.post("/completion", json={"prompt": follow3, "n_predict": 6, "temperature": 0,
                                                           "ignore_eos": True, "cache_prompt": False})).json()
        return r1, follow, r2, follow3, r3, r4

    r1, follow, r2, follow3, r3, r4 = call(eng, fn)
    # the slot holds the first prompt and all but the last generated token
    held = n_first + len(r1["tokens"]) - 1
    assert r2["timings"]["cache_n"] == held
    assert r2["timings"]["prompt_n"] == len(follow) - held
    assert r2["content"] == tok.decode(cold(m, tok, follow, 6, ignore_eos=True))
    assert r3["timings"]["cache_n"] == len(follow) + 6 - 1 and r3["timings"]["prompt_n"] == 3
    want3 = tok.decode(cold(m, tok, follow3, 6, ignore_eos=True))
    assert r3["content"] == want3
    assert r4["timings"]["cache_n"] == 0 and r4["content"] == want3
    assert eng.cache.info()["n_hits"] >= 1


@pytest.mark.parametrize("arch", ARCHS)
def test_snapshot_restores_the_state_exactly(factory, arch):
    m, _ = factory[arch]
    s = m.new_state(64)
    m.forward(list(range(20, 40)), s)
    snap = C.snapshot(s, s.length)
    want = m.forward([7], s)
    other = m.new_state(64)
    m.forward(list(range(100, 130)), other)       # longer, other content: all of it must go
    C.restore(snap, other)
    assert other.length == 20
    assert torch.equal(m.forward([7], other), want)
    assert C.truncatable(s) == (arch == "qwen3moe")


def test_prompt_cache_lru_and_limit():
    t = torch.zeros(1024, dtype=torch.float32)   # 4 KiB
    snap = C.Snapshot(1, [{"k": t}], {})
    pc = C.PromptCache(3 * 4096 + 100)
    for i in range(5):
        assert pc.put([i, 1, 2], snap, None)
    assert [e.tokens[0] for e in pc.entries.values()] == [2, 3, 4]
    assert pc.info()["n_evicted"] == 2
    e, n = pc.best([3, 1, 2, 9], can_truncate=False)
    assert e.tokens == [3, 1, 2] and n == 3
    pc.put([7, 1, 2], snap, None)                # 2 is now the least recently used
    assert [e.tokens[0] for e in pc.entries.values()] == [4, 3, 7]
    big = C.Snapshot(1, [{"k": torch.zeros(10**4)}], {})
    assert not pc.put([9], big, None)
    assert not C.PromptCache(0).put([1], snap, None)


def test_prompt_cache_protected_entries():
    """Entries with an owner (a protected slot's conversation) are evicted
    only by entries of the same owner (least recently used first among
    what a new entry may evict); others do not push them out, and one that
    would fit only by doing so is not kept."""
    t = torch.zeros(1024, dtype=torch.float32)   # 4 KiB
    snap = C.Snapshot(1, [{"k": t}], {})
    pc = C.PromptCache(3 * 4096 + 100)
    assert pc.put([0, 1], snap, None, owner=0)
    for i in range(1, 6):
        assert pc.put([i, 1], snap, None)
    assert [(e.tokens[0], e.owner) for e in pc.entries.values()] == [(0, 0), (4, None), (5, None)]
    assert pc.put([6, 1], snap, None, owner=0)    # the owner's entries may push out its own and unowned ones
    assert [(e.tokens[0], e.owner) for e in pc.entries.values()] == [(4, None), (5, None), (6, 0)]
    assert pc.put([5, 1], snap, None, owner=0)    # the same tokens kept again: one entry, now owned
    assert pc.put([7, 1], snap, None)
    assert [(e.tokens[0], e.owner) for e in pc.entries.values()] == [(6, 0), (5, 0), (7, None)]
    assert pc.put([6, 1], snap, None)             # ... and kept again unowned, it keeps its owner
    assert [(e.tokens[0], e.owner) for e in pc.entries.values()] == [(5, 0), (7, None), (6, 0)]
    assert pc.put([8, 1], snap, None, owner=0) and pc.put([10, 1], snap, None, owner=0)
    assert [(e.tokens[0], e.owner) for e in pc.entries.values()] == [(6, 0), (8, 0), (10, 0)]
    assert not pc.put([9, 1], snap, None)        # full of protected entries: not kept, none evicted
    assert not pc.put([9, 1], snap, None, owner=1)   # another owner's entries are not evictable either
    assert [e.tokens[0] for e in pc.entries.values()] == [6, 8, 10]
    info = pc.info()
    assert info["n_refused"] == 2 and info["n_protected"] == 3 and info["n_evicted"] == 7


@pytest.mark.parametrize("protect", [(0,), ()])
def test_protected_slot_conversation_survives_other_traffic(factory, protect):
    """``--cache-protect-slot 0``: a conversation held on slot 0 (its
    requests name slot 0) is pushed out of the slot by other traffic but
    not out of the RAM prompt cache, which holds about two sequences; its
    next turn is served from there and recomputes only the new tokens.
    Without protection the other traffic evicts it."""
    m, tok = factory["qwen3next"]
    conv = [10 + (i * 37) % 300 for i in range(30)]
    others = [[320 + (7 * j + i) % 150 for i in range(30)] for j in range(6)]
    probe = m.new_state(64)
    m.forward(conv + [1, 2, 3], probe)
    entry = C.snapshot(probe, probe.length).nbytes + 4 * m.n_vocab
    eng = Engine(m, tok, n_ctx=256, name="t", n_parallel=2, cache_ram_mib=2.5 * entry / 2**20,
                 cache_protect_slots=protect)
    assert [s["cache_protected"] for s in eng.slots_info()] == [bool(protect), False]
    greedy = {"temperature": 0, "ignore_eos": True, "return_tokens": True}

    async def fn(client):
        r1 = await (await client.post("/completion", json={"prompt": conv, "n_predict": 4, "id_slot": 0,
                                                           **greedy})).json()
        # two other requests at once: the second can only take slot 0, whose conversation goes to the cache
        long = asyncio.create_task(client.post("/completion", json={"prompt": others[0], "n_predict": 40,
                                                                     **greedy}))
        while not (await (await client.get("/slots")).json())[1]["is_processing"]:
            await asyncio.sleep(0.005)
        await client.post("/completion", json={"prompt": others[1], "n_predict": 4, **greedy})
        await long
        for p in others[2:]:                       # more traffic than the cache holds
            await client.post("/completion", json={"prompt": p, "n_predict": 4, **greedy})
        follow = conv + r1["tokens"] + [5, 6, 7]
        r2 = await (await client.post("/completion", json={"prompt": follow, "n_predict": 4, "id_slot": 0,
                                                           **greedy})).json()
        return r1, follow, r2

    r1, follow, r2 = call(eng, fn)
    info = eng.cache.info()
    held = len(conv) + len(r1["tokens"]) - 1
    assert info["n_evicted"] >= 2
    if protect:
        assert info["n_protected"] >= 1
        assert r2["timings"]["cache_n"] == held and r2["timings"]["prompt_n"] == len(follow) - held
        assert r2["content"] == tok.decode(cold(m, tok, follow, 4, ignore_eos=True))
    else:
        assert r2["timings"]["cache_n"] == 0


def test_protected_slot_needs_the_prompt_cache(factory):
    m, tok = factory["qwen3moe"]
    with pytest.raises(FleError, match="cache-ram"):
        Engine(m, tok, n_ctx=128, name="t", n_parallel=2, cache_protect_slots=[0])
    with pytest.raises(FleError, match="slots 0..1"):
        Engine(m, tok, n_ctx=128, name="t", n_parallel=2, cache_ram_mib=8, cache_protect_slots=[2])


def test_usable_prefix_rules():
    u = C.usable_prefix
    assert u([1, 2, 3], True, [1, 2, 3, 4], False) == 3
    assert u([1, 2, 3], True, [1, 2, 4], False) == 0          # recurrent: no cutting back
    assert u([1, 2, 3], True, [1, 2, 4], True) == 2
    assert u([1, 2, 3], True, [1, 2, 3], False) == 3          # all cached, logits kept
    assert u([1, 2, 3, 4], True, [1, 2, 3], True) == 2        # one token left to compute
    assert u([1, 2, 3, 4], True, [1, 2, 3], False) == 0


def test_slot_save_restore_erase(factory, tmp_path):
    m, tok = factory["qwen3next"]
    eng = Engine(m, tok, n_ctx=512, name="t", n_parallel=2, slot_save_path=str(tmp_path))
    prompt = list(range(30, 90))

    async def fn(client):
        r1 = await (await client.post("/completion", json={"prompt": prompt, "n_predict": 3, "temperature": 0,
                                                           "id_slot": 0, "return_tokens": True})).json()
        saved = await (await client.post("/slots/0?action=save", json={"filename": "a.bin"})).json()
        erased = await (await client.post("/slots/0?action=erase")).json()
        restored = await (await client.post("/slots/1?action=restore", json={"filename": "a.bin"})).json()
        follow = prompt + r1["tokens"] + [5, 6]
        r2 = await (await client.post("/completion", json={"prompt": follow, "n_predict": 3, "temperature": 0,
                                                           "id_slot": 1})).json()
        bad = await client.post("/slots/0?action=restore", json={"filename": "../etc"})
        missing = await client.post("/slots/0?action=restore", json={"filename": "none.bin"})
        slots = await (await client.get("/slots")).json()
        return r1, saved, erased, restored, follow, r2, bad.status, missing.status, slots

    r1, saved, erased, restored, follow, r2, bad, missing, slots = call(eng, fn)
    n_held = len(prompt) + len(r1["tokens"]) - 1
    assert saved["n_saved"] == n_held and saved["n_written"] > 0
    assert erased == {"id_slot": 0, "n_erased": n_held}
    assert restored["n_restored"] == n_held and restored["id_slot"] == 1
    assert r2["timings"]["cache_n"] == n_held
    assert r2["content"] == tok.decode(cold(m, tok, follow, 3))
    assert bad == missing == 400
    assert slots[0]["n_cached_tokens"] == 0 and slots[1]["n_cached_tokens"] > n_held


def test_mixed_load_no_leaks_no_errors(factory):
    """16 clients over 2 slots, each with its own canary conversation, with
    disconnects, malformed JSON and oversize prompts mixed in: every proper
    request is answered with its own conversation's cold-run text."""
    m, tok = factory["qwen3moe"]
    eng = Engine(m, tok, n_ctx=512, name="t", n_parallel=2, cache_ram_mib=32)
    convs = [f"canary {i}: " + " ".join(["river", "stone", "cloud", "lamp"][(i + k) % 4] for k in range(6))
             for i in range(16)]
    wants = [tok.decode(cold(m, tok, tok.encode(c, add_special=True, parse_special=True), 8, ignore_eos=True))
             for c in convs]

    async def fn(client):
        bad = {"errors": 0, "leaks": 0, "answered": 0, "refused": 0}

        async def good(i):
            for turn in range(2):
                r = await client.post("/completion", json={"prompt": convs[i], "n_predict": 8, "temperature": 0,
                                                           "ignore_eos": True})
                if r.status != 200:
                    bad["errors"] += 1
                    continue
                j = await r.json()
                bad["answered"] += 1
                bad["leaks"] += j["content"] != wants[i]

        async def gone(i):
            r = await client.post("/v1/completions", json={"prompt": convs[i], "max_tokens": 100, "stream": True,
                                                           "ignore_eos": True})
            await r.content.readany()
            r.close()

        async def malformed():
            for data in (b"{nope", b"[]"):
                r = await client.post("/v1/completions", data=data, headers={"Content-Type": "application/json"})
                bad["refused"] += r.status == 400
            r = await client.post("/v1/completions", json={"prompt": list(range(10, 400))})
            bad["refused"] += r.status == 400

        await asyncio.gather(*[good(i) for i in range(16)], *[gone(i) for i in range(4)], malformed())
        health = await client.get("/health")
        return bad, health.status

    bad, health = call(eng, fn)
    assert bad == {"errors": 0, "leaks": 0, "answered": 32, "refused": 3}
    assert health == 200


# ---------------------------------------------------------------- n > 1 (llama-server's n / n_cmpl)


def sse(raw: bytes) -> list[dict]:
    parts = raw.decode().split("\n\n")
    return [json.loads(p[len("data: "):]) for p in parts if p.startswith("data: ") and p != "data: [DONE]"]


@pytest.mark.parametrize("arch", ARCHS)
def test_n_completions_share_one_prompt_computation(factory, arch):
    """n = 2: two choices (index 0 and 1) decoded at once on two slots, the
    prompt computed once and copied (recurrent state included), each equal to
    a cold run; usage counts the prompt once and both answers."""
    m, tok = factory[arch]
    eng = Engine(m, tok, n_ctx=256, name="t", n_parallel=2)
    prompt = "the lamp and the stone by the river"
    ids = tok.encode(prompt, add_special=True, parse_special=True)
    want = tok.decode(cold(m, tok, ids, 12, ignore_eos=True))

    async def fn(client):
        r = await client.post("/v1/completions", json={"prompt": prompt, "n": 2, "max_tokens": 12,
                                                       "temperature": 0, "ignore_eos": True})
        return r.status, await r.json()

    p0, r0 = eng.n_prompt_total, eng.n_rounds
    status, j = call(eng, fn)
    assert status == 200, j
    assert [c["index"] for c in j["choices"]] == [0, 1]
    assert [c["text"] for c in j["choices"]] == [want, want]
    assert j["usage"]["prompt_tokens"] == len(ids) and j["usage"]["completion_tokens"] == 24
    assert eng.n_prompt_total - p0 == len(ids)          # not 2 x the prompt
    assert eng.n_rounds - r0 < 12 + 12                  # decoded together


def test_n_completions_sample_with_seed_plus_index(factory):
    """With a seed, completion i samples as a single request with seed + i
    would; chat answers are streamed with their index."""
    m, tok = factory["qwen3moe"]
    eng = Engine(m, tok, n_ctx=256, name="t", n_parallel=2)
    msgs = [{"role": "user", "content": "tell me of the river"}]
    base = {"messages": msgs, "max_tokens": 16, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "ignore_eos": True}

    async def fn(client):
        singles = []
        for seed in (7, 8):
            r = await client.post("/v1/chat/completions", json={**base, "seed": seed})
            singles.append((await r.json())["choices"][0]["message"]["content"])
        r = await client.post("/v1/chat/completions", json={**base, "seed": 7, "n": 2})
        both = await r.json()
        r = await client.post("/v1/chat/completions", json={**base, "seed": 7, "n": 2, "stream": True,
                                                            "stream_options": {"include_usage": True}})
        return singles, both, await r.read()

    singles, both, raw = call(eng, fn)
    assert singles[0] != singles[1]                     # the seeds matter, so the check below can fail
    assert [c["message"]["content"] for c in both["choices"]] == singles
    assert [c["index"] for c in both["choices"]] == [0, 1]
    streamed = {0: "", 1: ""}
    finish = {}
    evs = sse(raw)
    for ev in evs:
        for c in ev["choices"]:
            streamed[c["index"]] += c["delta"].get("content") or ""
            if c["finish_reason"]:
                finish[c["index"]] = c["finish_reason"]
    assert [streamed[0], streamed[1]] == singles
    assert finish == {0: "length", 1: "length"}
    assert evs[-1]["choices"] == [] and evs[-1]["usage"]["completion_tokens"] == 32


def test_n_is_bounded_by_the_slots_and_native_answers_an_array(factory):
    m, tok = factory["qwen3moe"]
    eng = Engine(m, tok, n_ctx=256, name="t", n_parallel=2)

    async def fn(client):
        out = []
        for body in ({"prompt": "x", "n": 3}, {"prompt": "x", "n": 0}, {"prompt": "x", "n": 1.5}):
            r = await client.post("/v1/completions", json=body)
            out.append((r.status, (await r.json())["error"]["message"]))
        r = await client.post("/completion", json={"prompt": "the river", "n_cmpl": 2, "n_predict": 5,
                                                   "temperature": 0, "ignore_eos": True})
        out.append((r.status, await r.json()))
        h = await client.get("/health")
        return out, h.status

    out, health = call(eng, fn)
    for status, msg in out[:3]:
        assert status == 400 and "'n'" in msg, msg
    status, arr = out[3]
    assert status == 200 and isinstance(arr, list) and [a["index"] for a in arr] == [0, 1]
    assert arr[0]["content"] == arr[1]["content"] and arr[0]["tokens_predicted"] == 5
    assert {a["id_slot"] for a in arr} == {0, 1}
    assert health == 200


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next", "qwen4exp"])
def test_follow_up_turn_on_the_gpu_engine_path(tmp_path, arch):
    """The server on the engine runtime (its CPU form here): a follow-up
    turn keeps the sequence the engine holds and computes only the new
    tokens (cache_n, prompt_n as llama-server reports them), answering as a
    cold run; cache_prompt false recomputes everything."""
    from fle_engine.runtime import Engine as Runtime

    p = make_model(tmp_path / f"{arch}.gguf", arch, mix="release", seed=5)
    tok = Tokenizer.from_gguf(p)
    rt = Runtime(p, device="cpu", cache_budget="auto", ctx_size=512, cache_type_k="f32", cache_type_v="f32",
                 profile_path="none", progress=False, log=lambda m: None, prefill_min=8)
    eng = Engine(rt, tok, n_ctx=512, name="t", n_parallel=1)
    first = [10 + (i * 7919) % 400 for i in range(60)]

    async def fn(client):
        r1 = await (await client.post("/completion", json={"prompt": first, "n_predict": 5, "temperature": 0,
                                                           "ignore_eos": True, "return_tokens": True})).json()
        follow = first + r1["tokens"][:-1] + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
        r2 = await (await client.post("/completion", json={"prompt": follow, "n_predict": 5, "temperature": 0,
                                                           "ignore_eos": True})).json()
        r3 = await (await client.post("/completion", json={"prompt": follow, "n_predict": 5, "temperature": 0,
                                                           "ignore_eos": True, "cache_prompt": False})).json()
        return r1, follow, r2, r3

    r1, follow, r2, r3 = call(eng, fn)
    assert r1["timings"]["cache_n"] == 0
    assert r2["timings"]["cache_n"] == len(first) + 4 and r2["timings"]["prompt_n"] == 10
    assert r3["timings"]["cache_n"] == 0 and r3["content"] == r2["content"]
    rt.close()
