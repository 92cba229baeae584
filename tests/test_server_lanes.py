"""The server's fields, RAM prompt cache and slot files on the engine's
lanes (``runtime.Engine(n_seq=N)``), on CPU engines of factory models.

- Sampling fields: ``logit_bias``, ``logprobs`` / ``top_logprobs``,
  ``n_probs``, the repeat / presence / frequency penalties, ``ignore_eos``
  and structured output act on the lanes' host-sampled rounds as on the
  reference path: the same tokens as the reference path's server on the same file,
  log-probabilities those of the one-sequence engine's logits; refused
  naming the field on an engine of one sequence.
- ``lane_snapshot`` / ``lane_restore``: a lane restored from a snapshot
  continues as a fresh run of its tokens (logits within ``TOL`` of the
  largest, greedy tokens equal) while another lane goes on with its own
  sequence; a restore that leaves out part of the state is caught.
- The RAM prompt cache and slot save / restore on lanes: a follow-up turn
  on another slot computes only its new tokens and answers as a cold run.
"""
from __future__ import annotations

import asyncio
import json
import math
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("aiohttp")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

import fle_engine  # noqa: E402
from fle_engine.runtime import qwen3moe, qwen3next, qwen4exp  # noqa: E402
from fle_engine.server import Engine as Server  # noqa: E402
from fle_engine.server import create_app  # noqa: E402
from fle_engine.tokenizer import Tokenizer  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
from lanes_helpers import ARCHS, TOL, arch_files  # noqa: E402
from lanes_helpers import alone as _alone, close_rel as _close, lane_engine as _engine  # noqa: E402

pytestmark = pytest.mark.usefixtures("exact_float32", "one_torch_thread")
PROMPT = [10 + (i * 37) % 300 for i in range(21)]       # prefilled (prefill_min 8)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return arch_files(tmp_path_factory, "lanesrv")


def _greedy_lanes(eng, lanes, first, n):
    """``n`` batched greedy steps of ``lanes`` fed ``first`` (one token
    each) -> per lane (the tokens after each step, their logits [n, V])."""
    feed = list(first)
    toks, logits = [[] for _ in lanes], [[] for _ in lanes]
    for _ in range(n):
        out = eng.step_lanes(lanes, feed)
        feed = [int(o.argmax()) for o in out]
        for j in range(len(lanes)):
            toks[j].append(feed[j])
            logits[j].append(out[j])
    return [(t, torch.stack(lg)) for t, lg in zip(toks, logits)]


# ---------------------------------------------------------------------------
# lane snapshots


def _check_restore(path):
    """Lane 0 holds PROMPT and three greedy steps; its snapshot is restored
    into lane 1 (which held another sequence). Then in the same batched
    steps lane 1 continues the snapshot's sequence and lane 0 its own with
    another token: each as a fresh run of its tokens. A follow-up prompt on
    the restored lane computes only its new tokens."""
    eng = _engine(path, ctx=2 * 64, n_seq=2)
    # the prompts' prefills multiply in float32 here and in the runs it is held to (on CUDA they would in
    # bfloat16, and the fresh runs prefill more of the tokens than the lanes do)
    if eng.prefill is not None:
        eng.prefill.bf16 = False
    lg, _ = eng.lane_prompt(0, PROMPT)
    (a, _), = _greedy_lanes(eng, [0], [int(lg.argmax())], 3)
    held = PROMPT + [int(lg.argmax())] + a[:2]
    assert eng.lane_tokens(0) == held
    snap = eng.lane_snapshot(0)
    assert snap.tokens == held and snap.last_tok == a[2]
    lg1, _ = eng.lane_prompt(1, [3, 4, 8, 9, 250])
    _greedy_lanes(eng, [1], [int(lg1.argmax())], 2)
    eng.lane_restore(1, snap)
    assert eng.lane_tokens(1) == held and eng.lane_reuse(1, held + [a[2], 5]) == len(held)
    (t1, l1), (t0, l0) = _greedy_lanes(eng, [1, 0], [a[2], 5], 16)
    # the restored lane: a fresh run of its tokens, whose first greedy token is the one the snapshot names
    want, want_logits = _alone(path, held, 17, f32_prefill=True)
    assert want[0] == a[2]
    assert t1 == want[1:]
    _close(l1, want_logits[1:])
    # the lane it was copied from goes on with its own sequence
    want0, want0_logits = _alone(path, held + [5], 16, f32_prefill=True)
    assert t0 == want0
    _close(l0, want0_logits)
    # restored again: a prompt extending the snapshot computes only its new tokens (as steps: so does the run
    # it is held to)
    eng.lane_restore(1, snap)
    follow = held + [a[2], 11, 12]
    lg2, kept = eng.lane_prompt(1, follow)
    assert kept == len(held)
    w, wl = _alone(path, follow, 1, prefill_min=len(follow) + 1)
    assert int(lg2.argmax()) == w[0]
    _close(lg2[None], wl)
    eng.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_lane_restore_continues_as_a_fresh_run(files, arch):
    _check_restore(files[arch])


def _skip_gdn(real):
    def held_layer(self, il, c, n):
        return [] if self.args.recurrent[il] else real(self, il, c, n)
    return held_layer


def _skip_ple(real):
    def held_state(self, state, n):
        out = real(self, state, n)
        return out[:-2] if state.bufs.ple_tok is not None else out
    return held_state


def _skip_last_row(real):
    def held_layer(self, il, c, n):
        return real(self, il, c, n - 1)
    return held_layer


@pytest.mark.parametrize("arch,cls,name,broken", [
    ("qwen3moe", qwen3moe.Net, "held_layer", _skip_last_row),     # the K/V row of the last held position
    ("qwen3next", qwen3next.Net, "held_layer", _skip_gdn),        # the GDN conv and delta-rule states
    ("qwen4exp", qwen4exp.Net, "held_state", _skip_ple),          # the PLE token and conv histories
])
def test_a_restore_missing_part_of_the_state_is_caught(files, arch, cls, name, broken, monkeypatch):
    monkeypatch.setattr(cls, name, broken(getattr(cls, name)))
    with pytest.raises(AssertionError):
        _check_restore(files[arch])


def test_lane_snapshot_refusals(files):
    eng = _engine(files["qwen3next"], ctx=2 * 32, n_seq=2)
    with pytest.raises(FleError, match="holds no finished sequence"):
        eng.lane_snapshot(0)
    eng.lane_prompt(0, PROMPT)
    snap = eng.lane_snapshot(0)
    other = _engine(files["qwen4exp"], ctx=2 * 32, n_seq=2)
    with pytest.raises(FleError, match="another model"):
        other.lane_restore(0, snap)
    small = _engine(files["qwen3next"], ctx=2 * 16, n_seq=2)
    with pytest.raises(FleError, match="does not fit"):
        small.lane_restore(1, snap)
    for e in (eng, other, small):
        e.close()


# ---------------------------------------------------------------------------
# the server on lanes


def _serve(path, n_par=2, ctx_slot=64, **kw):
    rt = _engine(path, ctx=ctx_slot * n_par, n_seq=n_par)
    srv = Server(rt, Tokenizer.from_gguf(path), n_ctx=ctx_slot * n_par, name="t", n_parallel=n_par, **kw)
    return srv, rt


def _call(srv, fn):
    async def main():
        async with TestClient(TestServer(create_app(srv))) as client:
            return await fn(client)
    try:
        return asyncio.run(main())
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def pair(files):
    """A lanes server and a reference-path server (fle_engine.load) on the same qwen3moe file."""
    path = files["qwen3moe"]
    srv, rt = _serve(path)
    tok = Tokenizer.from_gguf(path)
    ref = Server(fle_engine.load(path), tok, n_ctx=128, name="t", n_parallel=2)
    assert srv.lanes and not srv.stepped and ref.stepped
    yield path, srv, ref, tok
    srv.stop()
    ref.stop()
    rt.close()


def _both(pair, requests):
    """Each (path, body) request on the lanes server, then on the reference path's."""
    _, srv, ref, _ = pair

    async def fn(client):
        out = []
        for path, body in requests:
            r = await client.post(path, json=body)
            out.append((r.status, await r.json()))
        return out
    return _call(srv, fn), _call(ref, fn)


def test_n_probs_and_logprobs_on_lanes(pair):
    """Native ``n_probs``: each greedy token's log-probability and the top
    alternatives are those of log_softmax of the one-sequence engine's
    logits; chat ``logprobs`` / ``top_logprobs`` and completions
    ``logprobs`` N as on the reference path."""
    path, srv, ref, tok = pair
    ids = tok.encode("the river", add_special=True, parse_special=True)
    body = {"prompt": "the river", "n_predict": 6, "temperature": 0, "n_probs": 3, "ignore_eos": True,
            "return_tokens": True}
    msgs = [{"role": "user", "content": "hello"}]
    reqs = [("/completion", body),
            ("/v1/chat/completions", {"messages": msgs, "max_tokens": 4, "temperature": 0, "logprobs": True,
                                      "top_logprobs": 2}),
            ("/v1/completions", {"prompt": "the river", "max_tokens": 4, "temperature": 0, "logprobs": 2}),
            ("/v1/completions", {"prompt": "the river", "max_tokens": 4, "temperature": 0})]
    lanes, refs = _both(pair, reqs)
    assert all(s == 200 for s, _ in lanes + refs)
    (_, r), (_, chat), (_, comp), (_, plain) = lanes
    want, want_logits = _alone(path, ids, 6)
    assert r["tokens"] == want == refs[0][1]["tokens"]
    probs = r["completion_probabilities"]
    assert [p["id"] for p in probs] == want
    lp = torch.log_softmax(want_logits, -1)
    for i, p in enumerate(probs):
        assert math.isclose(p["logprob"], float(lp[i, want[i]]), abs_tol=1e-4)
        top = [q["id"] for q in p["top_logprobs"]]
        assert top == torch.topk(lp[i], 3).indices.tolist() and top[0] == want[i]
        assert all(math.isclose(q["logprob"], float(lp[i, q["id"]]), abs_tol=1e-4) for q in p["top_logprobs"])
    # the reference path's probabilities: its own forward pass, close to the engine's
    for p, q in zip(probs, refs[0][1]["completion_probabilities"]):
        assert p["id"] == q["id"] and abs(p["logprob"] - q["logprob"]) < 1e-2
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"]
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)
    assert all(c["top_logprobs"][0]["logprob"] == c["logprob"] for c in content)
    assert [c["token"] for c in content] == [c["token"] for c in refs[1][1]["choices"][0]["logprobs"]["content"]]
    lp2 = comp["choices"][0]["logprobs"]
    assert len(lp2["tokens"]) == len(lp2["token_logprobs"]) == len(lp2["top_logprobs"]) == 4
    assert "".join(lp2["tokens"]) == comp["choices"][0]["text"]
    assert lp2["tokens"] == refs[2][1]["choices"][0]["logprobs"]["tokens"]
    assert plain["choices"][0]["logprobs"] is None


def test_logit_bias_on_lanes(pair):
    """``false`` and -100 ban the greedy first token (the first token after
    the lane's prompt: the next best one is taken), +100 forces a token; as
    on the reference path."""
    path, srv, ref, tok = pair
    ids = tok.encode("the river", add_special=True, parse_special=True)
    want, want_logits = _alone(path, ids, 1)
    first = want[0]
    second = int(want_logits[0].clone().index_fill_(0, torch.tensor([first]), -math.inf).argmax())
    body = {"prompt": "the river", "max_tokens": 3, "temperature": 0, "return_tokens": True, "ignore_eos": True}
    reqs = [("/completion", {**body, "logit_bias": [[first, False]]}),
            ("/completion", {**body, "logit_bias": {str(first): -100}}),
            ("/completion", {**body, "logit_bias": {"77": 100}}),
            ("/completion", body)]
    lanes, refs = _both(pair, reqs)
    (_, banned), (_, lowered), (_, forced), (_, plain) = lanes
    assert plain["tokens"][0] == first
    assert banned["tokens"][0] == lowered["tokens"][0] == second
    assert first not in banned["tokens"] and first not in lowered["tokens"]
    assert forced["tokens"] == [77, 77, 77]
    assert [r["tokens"] for _, r in lanes] == [r["tokens"] for _, r in refs]


def test_penalties_and_ignore_eos_on_lanes(pair):
    """Presence and frequency penalties over the whole context leave no
    token twice, a repeat penalty changes the answer, repeat_last_n 0 turns
    it off: the reference path's tokens for each. With the end-of-generation
    token forced by a bias the answer stops at once; with ignore_eos it is
    banned instead and the answer runs to max_tokens (llama-server's rule
    for host-sampled rounds), on both paths."""
    _, srv, ref, tok = pair
    # a bias making greedy repeat one token (the factory model does not repeat itself in a few dozen tokens)
    body = {"prompt": "the river", "max_tokens": 40, "temperature": 0, "return_tokens": True, "ignore_eos": True,
            "logit_bias": {"77": 30}}
    eos = sorted(tok.eog_ids)[0]
    reqs = [("/completion", body),
            ("/completion", {**body, "presence_penalty": 1000.0, "repeat_last_n": -1}),
            ("/completion", {**body, "frequency_penalty": 1000.0, "repeat_last_n": -1}),
            ("/completion", {**body, "repeat_penalty": 1e6, "repeat_last_n": -1}),
            ("/completion", {**body, "repeat_penalty": 1e6, "repeat_last_n": 0}),
            ("/completion", {**body, "max_tokens": 5, "ignore_eos": False, "logit_bias": {str(eos): 100}}),
            ("/completion", {**body, "max_tokens": 5, "logit_bias": {str(eos): 100}})]
    lanes, refs = _both(pair, reqs)
    (_, plain), (_, pres), (_, freq), (_, rep), (_, off), (_, ends), (_, goes_on) = lanes
    assert plain["tokens"] == [77] * 40
    assert len(set(pres["tokens"])) == len(pres["tokens"]) == 40
    assert len(set(freq["tokens"])) == len(freq["tokens"]) == 40
    assert rep["tokens"] != plain["tokens"] and len(set(rep["tokens"])) > len(set(plain["tokens"]))
    assert off["tokens"] == plain["tokens"]
    assert ends["tokens"] == [eos] and ends["stop_type"] == "eos" and ends["tokens_predicted"] == 1
    assert len(goes_on["tokens"]) == 5 and not set(goes_on["tokens"]) & set(tok.eog_ids)
    assert goes_on["stop_type"] == "limit"
    assert [r["tokens"] for _, r in lanes] == [r["tokens"] for _, r in refs]
    assert [r["stop_type"] for _, r in lanes] == [r["stop_type"] for _, r in refs]


def test_structured_output_on_lanes(pair):
    """A grammar and a JSON schema mask the lanes' host logits as on the
    reference path: the same answers, complete and valid."""
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reqs = [("/completion", {"prompt": "x", "grammar": 'root ::= ("yes" | "no") "!"', "n_predict": 20,
                             "temperature": 0}),
            ("/completion", {"prompt": "x", "json_schema": schema, "n_predict": 40, "temperature": 0}),
            ("/completion", {"prompt": "x", "json_schema": schema, "n_predict": 40, "seed": 3})]
    lanes, refs = _both(pair, reqs)
    assert all(s == 200 for s, _ in lanes)
    (_, g), (_, j), (_, js) = lanes
    assert g["content"] in ("yes!", "no!") and g["stop_type"] == "eos"
    assert isinstance(json.loads(j["content"])["ok"], bool) and isinstance(json.loads(js["content"])["ok"], bool)
    assert [r["content"] for _, r in lanes] == [r["content"] for _, r in refs]


def test_one_sequence_engine_refuses_the_host_fields(files):
    """An engine of one sequence runs token generators: the fields are
    refused with 400 naming each."""
    path = files["qwen3moe"]
    rt = _engine(path, ctx=128)
    srv = Server(rt, Tokenizer.from_gguf(path), n_ctx=128, name="t", n_parallel=1)
    assert not srv.lanes and not srv.stepped
    body = {"prompt": "the river", "max_tokens": 2}
    fields = [({"logit_bias": {"5": 1}}, "logit_bias"), ({"n_probs": 2}, "n_probs"),
              ({"logprobs": 2}, "logprobs"), ({"repeat_penalty": 1.5}, "repeat_penalty"),
              ({"presence_penalty": 0.5}, "presence_penalty"), ({"frequency_penalty": 0.5}, "frequency_penalty"),
              ({"grammar": 'root ::= "a"'}, "grammar")]

    async def fn(client):
        out = []
        for extra, _ in fields:
            path_ = "/completion" if "n_probs" in extra else "/v1/completions"
            r = await client.post(path_, json={**body, **extra})
            out.append((r.status, (await r.json())["error"]["message"]))
        return out

    got = _call(srv, fn)
    for (status, msg), (_, name) in zip(got, fields):
        assert status == 400 and f"'{name}'" in msg, msg
    rt.close()


# ---------------------------------------------------------------------------
# the RAM prompt cache and slot files on lanes


@pytest.mark.parametrize("arch", ARCHS)
def test_follow_up_turn_from_the_ram_cache_and_slot_files(files, arch, tmp_path):
    """Slot 0's conversation goes to the RAM cache when another prompt takes
    slot 0; its follow-up turn sent to slot 1 restores it and computes only
    the new tokens (the response's counts and the engine's), answering as a
    cold run (cache_prompt false, which bypasses the cache). Then slot 1 is
    saved to a file, erased, and restored into slot 0: the next turn there
    computes only its new tokens and answers as a cold run."""
    srv, rt = _serve(files[arch], cache_ram_mib=16, slot_save_path=str(tmp_path))
    first = [10 + (i * 7919) % 400 for i in range(30)]
    other = [20 + (i * 131) % 300 for i in range(25)]
    opts = {"n_predict": 5, "temperature": 0, "ignore_eos": True, "return_tokens": True}

    async def fn(client):
        async def comp(prompt, **kw):
            return await (await client.post("/completion", json={"prompt": prompt, **opts, **kw})).json()

        r1 = await comp(first, id_slot=0)
        await comp(other, id_slot=0)                 # slot 0's conversation goes to the RAM cache
        info = srv.cache.info()
        follow = first + r1["tokens"][:-1] + [11, 12, 13, 14]
        n0 = rt.stats.prompt_tokens
        r2 = await comp(follow, id_slot=1)
        n_computed = rt.stats.prompt_tokens - n0
        cold = await comp(follow, id_slot=1, cache_prompt=False)
        saved = await (await client.post("/slots/1?action=save", json={"filename": "s1.bin"})).json()
        erased = await (await client.post("/slots/1?action=erase")).json()
        restored = await (await client.post("/slots/0?action=restore", json={"filename": "s1.bin"})).json()
        follow2 = follow + cold["tokens"][:-1] + [15, 16]
        r3 = await comp(follow2, id_slot=0)
        cold3 = await comp(follow2, id_slot=1, cache_prompt=False)
        return info, follow, r2, n_computed, cold, saved, erased, restored, follow2, r3, cold3

    info, follow, r2, n_computed, cold, saved, erased, restored, follow2, r3, cold3 = _call(srv, fn)
    n_held = len(first) + 4
    assert info["n_entries"] == 1
    entry = next(iter(srv.cache.entries.values()))
    assert entry.tokens[:n_held] == follow[:n_held]
    # the entry's bytes: the snapshot's tensors at its length, its tokens and the logits
    assert info["size_bytes"] == entry.nbytes == entry.snap.nbytes + entry.logits.numel() * 4
    if arch == "qwen3moe":
        a = rt.args
        assert entry.snap.nbytes == a.n_layer * 2 * a.n_head_kv * n_held * a.head_dim * 4 + 8 * n_held
    assert r2["id_slot"] == 1 and r2["tokens_cached"] == n_held + len(r2["tokens"])
    assert r2["timings"]["cache_n"] == n_held and r2["timings"]["prompt_n"] == 4 and n_computed == 4
    assert cold["timings"]["cache_n"] == 0 and cold["tokens"] == r2["tokens"]
    n_held2 = len(follow) + 4
    assert saved["n_saved"] == n_held2 and saved["n_written"] > 0
    assert erased == {"id_slot": 1, "n_erased": n_held2}
    assert restored["n_restored"] == n_held2 and restored["id_slot"] == 0
    assert r3["id_slot"] == 0 and r3["timings"]["cache_n"] == n_held2 and r3["timings"]["prompt_n"] == 2
    assert cold3["timings"]["cache_n"] == 0 and cold3["tokens"] == r3["tokens"]
    rt.close()


def test_exact_prompt_from_the_cache_and_files_of_the_other_path(files, tmp_path):
    """A prompt equal to a cached conversation is served whole from the
    cache (its logits kept), answering as a cold run; a slot file saved on
    the reference path is refused on lanes, and a lanes file there."""
    path = files["qwen3next"]
    srv, rt = _serve(path, cache_ram_mib=16, slot_save_path=str(tmp_path))
    ref = Server(fle_engine.load(path), Tokenizer.from_gguf(path), n_ctx=128, name="t", n_parallel=2,
                 slot_save_path=str(tmp_path))
    first = [10 + (i * 7919) % 400 for i in range(30)]
    opts = {"n_predict": 4, "temperature": 0, "ignore_eos": True, "return_tokens": True}

    async def on_lanes(client):
        async def comp(prompt, **kw):
            return await (await client.post("/completion", json={"prompt": prompt, **opts, **kw})).json()

        r1 = await comp(first, id_slot=0)
        held = first + r1["tokens"][:-1]
        await comp([5, 6, 7], id_slot=0)
        r2 = await comp(held, id_slot=1)
        cold = await comp(held, id_slot=1, cache_prompt=False)
        await client.post("/slots/1?action=save", json={"filename": "lanes.bin"})
        bad = await client.post("/slots/0?action=restore", json={"filename": "ref.bin"})
        return held, r2, cold, bad.status, (await bad.json())["error"]["message"]

    async def save_on_ref(client):
        await client.post("/completion", json={"prompt": first, "id_slot": 0, **opts})
        return (await client.post("/slots/0?action=save", json={"filename": "ref.bin"})).status

    async def restore_on_ref(client):
        bad = await client.post("/slots/1?action=restore", json={"filename": "lanes.bin"})
        return bad.status, (await bad.json())["error"]["message"]

    assert _call(ref, save_on_ref) == 200
    held, r2, cold, bad_status, bad_msg = _call(srv, on_lanes)
    assert r2["timings"]["cache_n"] == len(held) and r2["timings"]["prompt_n"] == 0
    assert cold["timings"]["cache_n"] == 0 and cold["tokens"] == r2["tokens"]
    assert bad_status == 400 and "reference path" in bad_msg
    status, msg = _call(ref, restore_on_ref)
    assert status == 400 and "lanes" in msg
    rt.close()


@pytest.mark.parametrize("protect", [(0,), ()])
def test_protected_slot_conversation_survives_other_traffic_on_lanes(files, protect):
    """``--cache-protect-slot 0`` on lanes: slot 0's conversation, pushed
    out of its lane by other traffic, stays in a RAM cache of about two
    sequences while more traffic passes; its next turn is restored from
    there and computes only the new tokens. Without protection it is
    evicted."""
    path = files["qwen3moe"]
    conv = [10 + (i * 37) % 300 for i in range(30)]
    others = [[320 + (7 * j + i) % 150 for i in range(30)] for j in range(6)]
    probe = _engine(path, ctx=64)
    a, n = probe.args, len(conv) + 3
    entry = a.n_layer * 2 * a.n_head_kv * n * a.head_dim * 4 + 8 * n + 4 * a.n_vocab
    probe.close()
    srv, rt = _serve(path, cache_ram_mib=2.5 * entry / 2**20, cache_protect_slots=protect)
    greedy = {"temperature": 0, "ignore_eos": True, "return_tokens": True}

    async def fn(client):
        r1 = await (await client.post("/completion", json={"prompt": conv, "n_predict": 4, "id_slot": 0,
                                                           **greedy})).json()
        # two other requests at once: the second can only take slot 0, whose conversation goes to the cache
        long = asyncio.create_task(client.post("/completion", json={"prompt": others[0], "n_predict": 30,
                                                                     **greedy}))
        while not (await (await client.get("/slots")).json())[1]["is_processing"]:
            await asyncio.sleep(0.002)
        await client.post("/completion", json={"prompt": others[1], "n_predict": 4, **greedy})
        await long
        for p in others[2:]:                       # more traffic than the cache holds
            await client.post("/completion", json={"prompt": p, "n_predict": 4, **greedy})
        follow = conv + r1["tokens"] + [5, 6, 7]
        r2 = await (await client.post("/completion", json={"prompt": follow, "n_predict": 4, "id_slot": 0,
                                                           **greedy})).json()
        cold = await (await client.post("/completion", json={"prompt": follow, "n_predict": 4, "id_slot": 1,
                                                             "cache_prompt": False, **greedy})).json()
        return r1, follow, r2, cold

    r1, follow, r2, cold = _call(srv, fn)
    info = srv.cache.info()
    held = len(conv) + len(r1["tokens"]) - 1
    assert info["n_evicted"] >= 2
    if protect:
        assert info["n_protected"] >= 1
        assert r2["timings"]["cache_n"] == held and r2["timings"]["prompt_n"] == len(follow) - held
        assert r2["tokens"] == cold["tokens"]
    else:
        assert r2["timings"]["cache_n"] == 0
    rt.close()
