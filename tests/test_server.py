"""``fle-engine serve`` (fle_engine.server): the OpenAI-compatible HTTP
server, driven through aiohttp's test server and client on a factory model.

Answers are checked against the engine's own decode loop
(``generate_tokens`` + detokenization), computed here independently of the
server's text handling; the stop-string scanner and the reasoning splitter
are also checked on their own, against plain reference definitions. A
scripted model (logits that force a chosen token sequence) drives the
reasoning split through the whole server, and, slowed down, the lock, the
responsiveness of the event loop and the stop on a client's disconnect.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st


pytestmark = pytest.mark.usefixtures("one_torch_thread")

torch = pytest.importorskip("torch")
pytest.importorskip("aiohttp")

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

import fle_engine  # noqa: E402
from fle_engine.chat import render_prompt  # noqa: E402
from fle_engine.cli import main as engine_main  # noqa: E402
from fle_engine.sampling import Sampler, SamplerParams, generate_tokens  # noqa: E402
from fle_engine.server import (Engine, ReasoningStream, StopScanner, create_app, default_ctx_size,  # noqa: E402
                               split_reasoning)
from fle_engine.tokenizer import Tokenizer  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402

GREEDY = SamplerParams(temp=0.0, seed=0)
N_CTX = 128



@pytest.fixture(scope="module")
def engine(model, tok):
    return Engine(model, tok, n_ctx=N_CTX, name="tiny")


def call(engine, fn):
    """Run ``await fn(client)`` against a fresh server for ``engine``."""
    async def main():
        async with TestClient(TestServer(create_app(engine))) as client:
            return await fn(client)
    return asyncio.run(main())


def post(engine, path, body):
    async def fn(client):
        r = await client.post(path, json=body)
        return r.status, r.headers.get("Content-Type", ""), await r.read()
    status, ctype, raw = call(engine, fn)
    return status, ctype, raw


def post_json(engine, path, body):
    status, ctype, raw = post(engine, path, body)
    assert ctype.startswith("application/json"), (status, raw[:200])
    return status, json.loads(raw)


def events(ctype: str, raw: bytes) -> list[dict]:
    """The JSON events of a server-sent-event body, checking its framing."""
    assert ctype.startswith("text/event-stream")
    parts = raw.decode().split("\n\n")
    assert parts[-1] == "" and parts[-2] == "data: [DONE]", raw[-200:]
    assert all(p.startswith("data: ") for p in parts[:-1])
    return [json.loads(p[len("data: "):]) for p in parts[:-2]]


def core(usage: dict) -> dict:
    """The usage counts, without the cache details."""
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def expected(model, tok, prompt, n, params):
    """(text, tokens sampled, finish reason) from the engine's decode loop."""
    toks = list(generate_tokens(model, prompt, n, Sampler(params), stop=tok.eog_ids))
    ended = bool(toks) and toks[-1] in tok.eog_ids
    text = tok.decode([t for t in toks if t not in tok.eog_ids])
    return text, toks, ("stop" if ended else "length")


# ---------------------------------------------------------------- stop strings on their own


def cut_at_stop(text, stops):
    hits = [(text.find(s), s) for s in stops if s and s in text]
    return text[:min(hits)[0]] if hits else text


def test_stop_scanner_cases():
    s = StopScanner(["</s>", "xyz"])
    assert s.add("abc<") == "abc"          # "<" may begin "</s>": held
    assert s.add("/") == ""
    assert s.add("t") == "</t"             # it did not
    assert s.add("xy") == ""
    assert s.add("z and more") == "" and s.stopped and s.stop_word == "xyz"
    assert s.add("after") == "" and s.finish() == ""
    s = StopScanner(["cd", "abcd"])          # the earliest occurrence in the text wins
    assert s.add("xabcd") == "x" and s.stop_word == "abcd"
    s = StopScanner(["end"])
    assert s.add("the en") == "the " and s.finish() == "en" and not s.stopped
    assert StopScanner([]).add("<anything>") == "<anything>"
    assert StopScanner([""]).add("x") == "x"  # empty stop strings are ignored


@given(st.text(alphabet="ab<>/ ", max_size=40),
       st.lists(st.text(alphabet="ab<>/", min_size=1, max_size=4), max_size=3),
       st.lists(st.integers(0, 40), max_size=10))
def test_stop_scanner_streams_the_cut_text(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    s = StopScanner(stops)
    out = ""
    for a, b in zip(bounds, bounds[1:]):
        piece = s.add(text[a:b])
        out += piece
        # released text never reaches into a stop string
        assert cut_at_stop(text, stops).startswith(out)
    if not s.stopped:
        out += s.finish()
    assert out == cut_at_stop(text, stops)
    assert s.stopped == any(x in text for x in stops)


# ---------------------------------------------------------------- the reasoning split on its own


def test_split_reasoning_cases():
    assert split_reasoning("<think>\nplan it\n</think>\n\nThe answer.") == ("plan it", "The answer.")
    assert split_reasoning("\n<think>a</think>b") == ("a", "b")
    assert split_reasoning("Just an answer. ") == ("", "Just an answer. ")
    assert split_reasoning("  spaced") == ("", "  spaced")
    # a think block not at the start is content
    assert split_reasoning("hi <think>x</think> there") == ("", "hi <think>x</think> there")
    # the prompt ended inside <think>: reasoning from the first character
    assert split_reasoning("plan\n</think>\n\nanswer", thinking_open=True) == ("plan", "answer")
    assert split_reasoning("no close yet", thinking_open=True) == ("no close yet", "")
    assert split_reasoning("<think>unfinished ") == ("unfinished", "")
    # an empty think block (thinking switched off) leaves no reasoning
    assert split_reasoning("<think>\n\n</think>\n\nhello") == ("", "hello")
    # only the first </think> closes
    assert split_reasoning("<think>a</think>b</think>c") == ("a", "b</think>c")
    # while generating: hold what may still become a tag
    assert split_reasoning("<thi", partial=True) == ("", "")
    assert split_reasoning("<thi") == ("", "<thi")
    assert split_reasoning("  ", partial=True) == ("", "")
    assert split_reasoning("<think>abc </th", partial=True) == ("abc", "")
    assert split_reasoning("abc </th", thinking_open=True, partial=True) == ("abc", "")
    assert split_reasoning("<think>abc</think>  ", partial=True) == ("abc", "")


FRAGMENTS = ["<think>", "</think>", "<", "</", "th", "ink>", " ", "\n", "a", "b", "</think"]


@given(st.lists(st.sampled_from(FRAGMENTS), max_size=14), st.lists(st.integers(0, 60), max_size=8),
       st.booleans())
def test_reasoning_stream_deltas_add_up(frags, cuts, thinking_open):
    text = "".join(frags)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    rs = ReasoningStream(thinking_open)
    r = c = ""
    for a, b in zip(bounds, bounds[1:]):
        dr, dc = rs.add(text[a:b])
        r, c = r + dr, c + dc
    dr, dc = rs.finish()
    assert (r + dr, c + dc) == split_reasoning(text, thinking_open)
    off = ReasoningStream(thinking_open, enabled=False)
    assert off.add(text) == ("", text) and off.finish() == ("", "")


# ---------------------------------------------------------------- completions


def test_greedy_completion_equals_decode_loop(engine, model, tok):
    text_prompt = "the river and the mountain"
    ids = tok.encode(text_prompt, add_special=True, parse_special=True)
    want, toks, finish = expected(model, tok, ids, 16, GREEDY)
    for prompt in (text_prompt, ids, [text_prompt]):
        status, r = post_json(engine, "/v1/completions", {"prompt": prompt, "max_tokens": 16, "temperature": 0})
        assert status == 200, r
        assert r["object"] == "text_completion" and r["id"].startswith("cmpl-") and r["model"] == "tiny"
        assert isinstance(r["created"], int)
        (choice,) = r["choices"]
        assert choice["text"] == want and choice["index"] == 0 and choice["finish_reason"] == finish
        assert core(r["usage"]) == {"prompt_tokens": len(ids), "completion_tokens": len(toks),
                              "total_tokens": len(ids) + len(toks)}
        assert r["timings"]["predicted_n"] == len(toks)
    # the same without the /v1 prefix, as llama-server also answers
    status, r = post_json(engine, "/completions", {"prompt": ids, "max_tokens": 16, "temperature": 0})
    assert r["choices"][0]["text"] == want


def test_stream_equals_non_stream(engine, model, tok):
    body = {"prompt": "the city of", "max_tokens": 20, "temperature": 0}
    _, whole = post_json(engine, "/v1/completions", body)
    status, ctype, raw = post(engine, "/v1/completions", {**body, "stream": True})
    assert status == 200
    evs = events(ctype, raw)
    assert len(evs) > 2  # text arrives in pieces
    assert all(e["object"] == "text_completion" and e["id"] == evs[0]["id"] for e in evs)
    assert all(e["choices"][0]["finish_reason"] is None for e in evs[:-1])
    assert "".join(e["choices"][0]["text"] for e in evs) == whole["choices"][0]["text"]
    assert evs[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert core(evs[-1]["usage"]) == core(whole["usage"])


def test_sampling_defaults_and_seed(engine, model, tok):
    ids = tok.encode("the model reads", add_special=True, parse_special=True)
    for body, params in (
        ({"seed": 11}, SamplerParams(seed=11)),    # llama-server's defaults: 0.8, 40, 0.95, 0.05
        ({"seed": 12, "temperature": 3.0}, SamplerParams(temp=3.0, seed=12)),
        ({"temperature": -1.0}, GREEDY),         # clamped into range, as llama-server does
        ({"temperature": 2.0, "top_k": 5, "top_p": 7.0, "min_p": -3, "seed": 14}, SamplerParams(2.0, 5, 1.0, 0.0, 14)),
    ):
        want, toks, _ = expected(model, tok, ids, 8, params)
        _, r = post_json(engine, "/v1/completions", {"prompt": ids, "max_tokens": 8, **body})
        assert r["choices"][0]["text"] == want, body
    # the sampled continuations do differ between seeds (the seed reaches the sampler)
    outs = {post_json(engine, "/v1/completions", {"prompt": ids, "max_tokens": 8, "temperature": 3.0,
                                                  "seed": s})[1]["choices"][0]["text"] for s in range(2)}
    assert len(outs) > 1


def test_stop_strings(engine, model, tok):
    ids = tok.encode("the river and the mountain", add_special=True, parse_special=True)
    full, toks, _ = expected(model, tok, ids, 24, GREEDY)
    plain = [t for t in toks if t not in tok.eog_ids]
    # a stop string from the middle of the greedy text: the first ASCII letter run of 3 after a few characters
    start = next(i for i in range(4, len(full) - 3) if full[i:i + 3].isascii() and full[i:i + 3].isalpha())
    stop = full[start:start + 3]
    at = full.find(stop)
    n_until = next(k for k in range(1, len(plain) + 1) if stop in tok.decode(plain[:k]))
    base = {"prompt": ids, "max_tokens": 24, "temperature": 0}
    for stops in (stop, [stop], ["\x00never", stop]):
        _, r = post_json(engine, "/v1/completions", {**base, "stop": stops})
        assert r["choices"][0]["text"] == full[:at] and r["choices"][0]["finish_reason"] == "stop"
        assert r["usage"]["completion_tokens"] == n_until
        status, ctype, raw = post(engine, "/v1/completions", {**base, "stop": stops, "stream": True})
        evs = events(ctype, raw)
        assert "".join(e["choices"][0]["text"] for e in evs) == full[:at]
        assert evs[-1]["choices"][0]["finish_reason"] == "stop"
    # a stop string that never comes changes nothing
    _, r = post_json(engine, "/v1/completions", {**base, "stop": ["\x00never"]})
    assert r["choices"][0]["text"] == full and r["usage"]["completion_tokens"] == len(toks)


def test_max_tokens_defaults_to_the_context_end(model, tok):
    eng = Engine(model, tok, n_ctx=20, name="tiny")
    ids = tok.encode("the river", add_special=True, parse_special=True)
    want, toks, finish = expected(model, tok, ids, 20 - len(ids), GREEDY)
    _, r = post_json(eng, "/v1/completions", {"prompt": ids, "temperature": 0})
    assert r["choices"][0]["text"] == want and r["choices"][0]["finish_reason"] == finish
    assert r["usage"]["completion_tokens"] == len(toks) <= 20 - len(ids)
    assert r["usage"]["total_tokens"] <= 20
    # max_tokens 0: nothing generated
    _, r = post_json(eng, "/v1/completions", {"prompt": ids, "max_tokens": 0})
    assert r["choices"][0]["text"] == "" and r["usage"]["completion_tokens"] == 0
    assert default_ctx_size(40960, None) == 8192 and default_ctx_size(4096, None) == 4096
    assert default_ctx_size(40960, 0) == 40960 and default_ctx_size(40960, 100) == 100


# ---------------------------------------------------------------- chat


def test_chat_completion(engine, model, tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the river"}]
    text = render_prompt(tok, messages, add_generation_prompt=True)
    ids = tok.encode(text, add_special=True, parse_special=True)
    raw, toks, finish = expected(model, tok, ids, 14, GREEDY)
    reasoning, content = split_reasoning(raw)
    for limit in ("max_tokens", "max_completion_tokens"):
        status, r = post_json(engine, "/v1/chat/completions", {"messages": messages, limit: 14, "temperature": 0})
        assert status == 200, r
        assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
        (choice,) = r["choices"]
        assert choice["message"]["role"] == "assistant" and choice["message"]["content"] == content
        assert choice["message"].get("reasoning_content", "") == reasoning
        assert choice["finish_reason"] == finish
        assert core(r["usage"]) == {"prompt_tokens": len(ids), "completion_tokens": len(toks),
                              "total_tokens": len(ids) + len(toks)}
    # text parts are joined with newlines, as llama.cpp joins them
    parts = [{"role": "system", "content": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]},
             messages[1]]
    _, r = post_json(engine, "/v1/chat/completions", {"messages": parts, "max_tokens": 2, "temperature": 0})
    joined = render_prompt(tok, [{"role": "system", "content": "be\nbrief"}, messages[1]])
    assert r["usage"]["prompt_tokens"] == len(tok.encode(joined, add_special=True, parse_special=True))
    # streaming: the role first, then content deltas that add up to the answer
    status, ctype, body = post(engine, "/v1/chat/completions",
                               {"messages": messages, "max_tokens": 14, "temperature": 0, "stream": True,
                                "stream_options": {"include_usage": True}})
    evs = events(ctype, body)
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert all(e["object"] == "chat.completion.chunk" for e in evs)
    deltas = [e["choices"][0]["delta"] for e in evs[1:] if e["choices"]]
    assert "".join(d.get("content", "") for d in deltas) == content
    assert evs[-2]["choices"][0]["finish_reason"] == finish and evs[-2]["choices"][0]["delta"] == {}
    assert evs[-1]["choices"] == [] and evs[-1]["usage"]["completion_tokens"] == len(toks)


class Scripted:
    """A model whose logits force a script: after the prompt it 'predicts'
    ``script[0]``, then ``script[1]``, ..., then ``end`` forever. ``delay``
    seconds per forward call; ``calls`` counts them; ``overlap`` records
    whether two calls ever ran at once."""

    def __init__(self, base, script, end, delay=0.0):
        self.base, self.script, self.end, self.delay = base, list(script), end, delay
        self.n_vocab, self.arch, self.args = base.n_vocab, base.arch, base.args
        self.net, self.path = base.net, base.path
        self.calls, self.overlap, self._busy = 0, False, threading.Lock()

    def new_state(self, max_tokens):
        return SimpleNamespace(i=0, length=0, max_tokens=max_tokens)

    def forward(self, tokens, state):
        if not self._busy.acquire(blocking=False):
            self.overlap = True
            self._busy.acquire()
        try:
            self.calls += 1
            time.sleep(self.delay)
            nxt = self.script[state.i] if state.i < len(self.script) else self.end
            state.i += 1
            state.length += len(tokens)
            out = torch.full((len(tokens), self.n_vocab), -10.0)
            out[-1, nxt] = 10.0
            return out
        finally:
            self._busy.release()


THINKING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}{%- endif -%}"
)


def chat_engine(model, model_path, answer, template=None, **kw):
    tok = Tokenizer.from_gguf(model_path)
    if template is not None:
        tok.chat_template = template
    end = tok.encode("<|im_end|>", add_special=False, parse_special=True)
    assert len(end) == 1 and end[0] in tok.eog_ids
    script = tok.encode(answer, add_special=False, parse_special=False)
    return Engine(Scripted(model, script, end[0], **kw), tok, n_ctx=256, name="tiny"), len(script) + 1


def test_chat_reasoning_split(model, model_path):
    msgs = [{"role": "user", "content": "2+2?"}]
    # the template opens <think> at the end of the prompt: the answer starts inside it
    eng, n = chat_engine(model, model_path, "Let me add.\n</think>\n\nIt is 4.", THINKING_TEMPLATE)
    _, r = post_json(eng, "/v1/chat/completions", {"messages": msgs})
    msg = r["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "It is 4.", "reasoning_content": "Let me add."}
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == n
    _, ctype, raw = post(eng, "/v1/chat/completions", {"messages": msgs, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events(ctype, raw)]
    assert deltas[0] == {"role": "assistant", "content": None}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me add."
    assert "".join(d.get("content") or "" for d in deltas) == "It is 4."
    assert all(len(d) == 1 for d in deltas[1:-1])   # each delta carries one kind of text
    # a stop string applies to the raw answer, thinking included
    _, r = post_json(eng, "/v1/chat/completions", {"messages": msgs, "stop": "add"})
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "", "reasoning_content": "Let me"}
    # reasoning_format none: everything stays content
    _, r = post_json(eng, "/v1/chat/completions", {"messages": msgs, "reasoning_format": "none"})
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "Let me add.\n</think>\n\nIt is 4."}
    # thinking switched off through chat_template_kwargs: the template closes the block in the prompt
    eng, _ = chat_engine(model, model_path, "It is 4.", THINKING_TEMPLATE)
    _, on = post_json(eng, "/v1/chat/completions", {"messages": msgs})
    _, off = post_json(eng, "/v1/chat/completions",
                       {"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}})
    assert on["choices"][0]["message"] == {"role": "assistant", "content": "", "reasoning_content": "It is 4."}
    assert off["choices"][0]["message"] == {"role": "assistant", "content": "It is 4."}
    assert off["usage"]["prompt_tokens"] > on["usage"]["prompt_tokens"]
    _, none = post_json(eng, "/v1/chat/completions", {"messages": msgs, "reasoning_effort": "none"})
    assert none["choices"] == off["choices"] and core(none["usage"]) == core(off["usage"])
    # with the factory's plain template, an answer that opens its own think block
    eng, _ = chat_engine(model, model_path, "<think>\nhmm\n</think>\nok then")
    _, r = post_json(eng, "/v1/chat/completions", {"messages": msgs})
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "ok then", "reasoning_content": "hmm"}
    _, ctype, raw = post(eng, "/v1/chat/completions", {"messages": msgs, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events(ctype, raw)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "hmm"
    assert "".join(d.get("content") or "" for d in deltas) == "ok then"


def test_chat_tools_reach_the_template(model, model_path):
    template = ("{%- if tools -%}{{- 'TOOLS:' + tools | map(attribute='function') | map(attribute='name') | join(',') "
                "+ '\\n' -}}{%- endif -%}" + THINKING_TEMPLATE)
    eng, _ = chat_engine(model, model_path, "ok", template)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "weather?"}]
    _, with_tools = post_json(eng, "/v1/chat/completions", {"messages": msgs, "tools": tools})
    _, without = post_json(eng, "/v1/chat/completions", {"messages": msgs})
    want = render_prompt(eng.tok, msgs, tools=tools)
    assert want.startswith("TOOLS:get_weather\n")
    assert with_tools["usage"]["prompt_tokens"] == len(eng.tok.encode(want, add_special=True, parse_special=True))
    assert with_tools["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"]


# ---------------------------------------------------------------- one sequence at a time


def test_queueing_and_a_responsive_event_loop(model, model_path):
    eng, n = chat_engine(model, model_path, "a b c d e f g h i j k l m n o p", delay=0.05)

    async def fn(client):
        body = {"prompt": "x", "temperature": 0}
        first = asyncio.create_task(client.post("/v1/completions", json=body))
        await asyncio.sleep(0.3)
        second = asyncio.create_task(client.post("/v1/completions", json=body))
        t0 = time.perf_counter()
        health = await client.get("/health")
        waited = time.perf_counter() - t0
        assert health.status == 200 and await health.json() == {"status": "ok"}
        busy = not first.done()     # the answer came while the decode was still running
        r1, r2 = await first, await second
        return busy, waited, await r1.json(), await r2.json()

    busy, waited, r1, r2 = call(eng, fn)
    assert busy, f"/health took {waited:.2f} s"
    assert r1["choices"][0]["text"] == r2["choices"][0]["text"] == "a b c d e f g h i j k l m n o p"
    assert not eng.model.overlap   # the second request waited for the first


def test_disconnect_stops_the_generation(model, model_path):
    eng, n = chat_engine(model, model_path, "x " * 400, delay=0.02)

    async def fn(client):
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 200, "stream": True})
        got = b""
        while got.count(b"\n\n") < 3:
            got += await r.content.readany()
        r.close()     # the client goes away
        calls_at_close = eng.model.calls
        # the next request waits for the lock, so the first decode has ended when it is answered
        r2 = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0})
        return calls_at_close, (await r2.json())["choices"][0]["text"]

    at_close, text = call(eng, fn)
    assert text == eng.tok.decode(eng.model.script[:2])
    first_run = eng.model.calls - 2
    assert first_run < at_close + 20 < 200, (at_close, first_run)


# ---------------------------------------------------------------- other endpoints and errors


def test_models_and_health(engine, tok):
    async def fn(client):
        out = []
        for path in ("/health", "/v1/health", "/v1/models", "/models"):
            r = await client.get(path)
            out.append((r.status, await r.json()))
        return out

    (s1, h1), (s2, h2), (s3, m1), (s4, m2) = call(engine, fn)
    assert s1 == s2 == s3 == s4 == 200 and h1 == h2 == {"status": "ok"}
    assert m1 == m2 and m1["object"] == "list"
    (entry,) = m1["data"]
    assert entry["id"] == "tiny" and entry["object"] == "model" and entry["owned_by"]
    assert entry["meta"]["n_ctx"] == N_CTX and entry["meta"]["n_vocab"] == tok.n_vocab


def test_bad_requests(engine, tok):
    long_prompt = list(range(10, 10 + N_CTX))
    cases = [
        ("/v1/completions", b"{not json", "not valid JSON"),
        ("/v1/completions", b"[1, 2]", "JSON object"),
        ("/v1/completions", {"max_tokens": 3}, '"prompt" is required'),
        ("/v1/completions", {"prompt": ""}, "must not be empty"),
        ("/v1/completions", {"prompt": [tok.n_vocab + 5]}, "out of range"),
        ("/v1/completions", {"prompt": ["one", "two"]}, "one prompt"),
        ("/v1/completions", {"prompt": {"text": "x"}}, '"prompt" must be'),
        ("/v1/completions", {"prompt": "x", "n": 2}, "'n'"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "'temperature'"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -5}, "'max_tokens'"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, "'max_tokens'"),
        ("/v1/completions", {"prompt": "x", "seed": True}, "'seed'"),
        ("/v1/completions", {"prompt": "x", "stop": 5}, "'stop'"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, "'stream'"),
        ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "x", "logprobs": 300}, "'logprobs'"),
        ("/v1/completions", {"prompt": "x", "typical_p": 0.5}, "'typical_p'"),
        ("/v1/completions", {"prompt": "x", "samplers": ["top_k"]}, "samplers"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "'logit_bias'"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": "high"}}, "'logit_bias'"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, "out of range"),
        ("/v1/completions", {"prompt": "x", "id_slot": 7}, "'id_slot'"),
        ("/v1/completions", {"prompt": "x", "cache_prompt": "yes"}, "'cache_prompt'"),
        ("/v1/completions", {"prompt": "x", "repeat_penalty": 0}, "'repeat_penalty'"),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "xml"}}, "'response_format'"),
        ("/v1/completions", {"prompt": "x", "json_schema": "obj"}, "'json_schema'"),
        ("/v1/completions", {"prompt": "x", "grammar": "root ::= ( \"a\""}, "'grammar'"),
        ("/v1/chat/completions", {"messages": []}, "must not be empty"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "unknown role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         "tools[0]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
         "tools[0]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
         "'tool_choice'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"},
         "'tool_choice'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
         "'top_logprobs'"),
        ("/v1/chat/completions", {"prompt": "x"}, "'messages' is required"),
        ("/v1/chat/completions", {"messages": "hi"}, "array"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "must contain 'content'"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "'role'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "string or an array"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text only"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3}, "'n'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "chat_template_kwargs": {"enable_thinking": "false"}}, "enable_thinking"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": "all"}, "'tools'"),
    ]
    too_long = [
        ("/v1/completions", {"prompt": long_prompt}, "exceeds the available context size"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 4 * N_CTX}]},
         "exceeds the available context size"),
    ]

    async def fn(client):
        out = []
        for path, body, _ in cases + too_long:
            if isinstance(body, bytes):
                r = await client.post(path, data=body, headers={"Content-Type": "application/json"})
                out.append((r.status, r.headers["Content-Type"], await r.json()))
                continue
            # streaming requests get the same plain error answer, before any event
            for b in (body, {**body, "stream": True}) if "stream" not in body else (body,):
                r = await client.post(path, json=b)
                out.append((r.status, r.headers["Content-Type"], await r.json()))
        r = await client.get("/v1/nothing")
        out.append((r.status, r.headers["Content-Type"], await r.json()))
        return out

    results = call(engine, fn)
    expect = [(c, s) for c in cases + too_long for s in (False, True)
              if not (s and (isinstance(c[1], bytes) or "stream" in c[1]))]
    assert len(results) == len(expect) + 1
    for ((path, body, needle), stream), (status, ctype, r) in zip(expect, results[:-1]):
        kind = "exceed_context_size_error" if (path, body, needle) in too_long else "invalid_request_error"
        assert status == 400 and ctype.startswith("application/json"), (body, stream, r)
        assert r["error"]["type"] == kind and r["error"]["code"] == 400, r
        assert needle in r["error"]["message"], (needle, r)
        assert len(r["error"]["message"].splitlines()) == 1
        if kind == "exceed_context_size_error":
            assert r["error"]["n_ctx"] == N_CTX and r["error"]["n_prompt_tokens"] > 0
    status, _, r = results[-1]
    assert status == 404 and r["error"]["type"] == "not_found_error"
    # right at the limit is fine
    _, r = post_json(engine, "/v1/completions", {"prompt": long_prompt[:-2], "max_tokens": 2, "temperature": 0})
    assert r["usage"]["total_tokens"] <= N_CTX


def test_prompt_and_max_tokens_beyond_the_context_stop_at_its_end(engine, tok):
    """As llama-server: accepted, and generation stops where the context ends."""
    long_prompt = list(range(10, 10 + N_CTX - 5))
    for path, body in [("/v1/completions", {"prompt": long_prompt, "max_tokens": 50}),
                       ("/v1/completions", {"prompt": "x", "max_tokens": 10 * N_CTX, "ignore_eos": True}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                 "max_tokens": 10 * N_CTX, "ignore_eos": True})]:
        status, r = post_json(engine, path, {**body, "temperature": 0})
        assert status == 200, r
        assert r["choices"][0]["finish_reason"] == "length"
        assert r["usage"]["total_tokens"] == N_CTX, r["usage"]


# ---------------------------------------------------------------- MTP


def test_mtp_engine_gives_the_same_answer(tmp_path):
    path = make_model(tmp_path / "n.gguf", "qwen3next", seed=4, mtp="inside")
    m, tok = fle_engine.load(path), Tokenizer.from_gguf(path)
    body = {"prompt": "the river", "max_tokens": 12, "temperature": 0}
    _, plain = post_json(Engine(m, tok, n_ctx=64, name="n"), "/v1/completions", body)
    _, spec = post_json(Engine(m, tok, n_ctx=64, name="n", mtp=True), "/v1/completions", body)
    assert spec["choices"] == plain["choices"] and core(spec["usage"]) == core(plain["usage"])
    assert spec["timings"]["draft_n"] > 0 and "draft_n" not in plain["timings"]


def test_mtp_draft_options_keep_the_answer(tmp_path, monkeypatch):
    """--draft-vocab and --draft-adaptive in the server: drafts only from the
    list, the count chosen per step by one policy for all requests, the
    answers those of plain decoding."""
    from fle_engine import speculative
    from fle_engine.draft_vocab import DraftVocab
    from fle_engine.speculative import AdaptiveDraft

    drafted = []
    real = speculative.draft

    def recording(*a, **kw):
        out = real(*a, **kw)
        drafted.extend(out[0].tolist())
        return out

    monkeypatch.setattr(speculative, "draft", recording)
    path = make_model(tmp_path / "n.gguf", "qwen3next", seed=4, mtp="inside")
    m, tok = fle_engine.load(path), Tokenizer.from_gguf(path)
    body = {"prompt": "the river", "max_tokens": 12, "temperature": 0}
    _, plain = post_json(Engine(m, tok, n_ctx=64, name="n"), "/v1/completions", body)
    vocab = DraftVocab(list(range(0, tok.n_vocab, 3)))
    eng = Engine(m, tok, n_ctx=64, name="n", mtp=True, n_draft=3, draft_vocab=vocab, draft_adaptive=True)
    assert isinstance(eng.draft_policy, AdaptiveDraft) and eng.draft_policy.n_max == 3
    for _ in range(2):
        _, spec = post_json(eng, "/v1/completions", body)
        assert spec["choices"] == plain["choices"] and core(spec["usage"]) == core(plain["usage"])
    assert drafted and all(t % 3 == 0 for t in drafted)
    assert eng.draft_policy.step > 0 and eng.draft_policy.reached[0] > 0


# ---------------------------------------------------------------- the command line


def test_cli_serve_help_and_errors(model_path, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        engine_main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--host", "--port", "--ctx-size", "--device", "--threads", "--mtp", "--mtp-head", "--alias",
                "--parallel", "--cache-ram", "--cache-protect-slot", "--slot-save-path", "--api-key"):
        assert opt in out
    bad = [
        ["serve", str(tmp_path / "missing.gguf")],
        ["serve", str(model_path), "--port", "70000"],
        ["serve", str(model_path), "--ctx-size", "-1"],
        ["serve", str(model_path), "--threads", "0"],
        ["serve", str(model_path), "--mtp"],            # the factory qwen3moe has no MTP head
        ["serve", str(model_path), "-np", "0"],
        ["serve", str(model_path), "--cache-ram", "-5"],
        ["serve", str(model_path), "--cache-protect-slot", "0"],            # no --cache-ram
        ["serve", str(model_path), "--cache-ram", "64", "--cache-protect-slot", "2"],   # slots 0..1
    ]
    for argv in bad:
        assert engine_main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("fle-engine: error: ") and all(ln.startswith("fle-engine: ") for ln in err), err
    with pytest.raises(SystemExit) as e:
        engine_main(["serve"])
    assert e.value.code == 2
    # a port that is taken
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert engine_main(["serve", str(model_path), "--port", str(taken.getsockname()[1])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("fle-engine: error: cannot listen on 127.0.0.1:"), err


def test_cli_serve_end_to_end(model_path, model, tok):
    """The real program: listens, prints its address, answers, stops on SIGTERM."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "fle_engine.cli", "serve", str(model_path), "--port", "0",
                             "-c", "64", "--alias", "tiny-moe", "-t", "1"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "listening on http://" in line:
                break
        assert lines and "listening on http://127.0.0.1:" in lines[-1], lines
        base = lines[-1].split("listening on ")[1].split()[0]
        with urllib.request.urlopen(base + "/health", timeout=30) as r:
            assert json.load(r) == {"status": "ok"}
        req = urllib.request.Request(base + "/v1/completions", method="POST",
                                     data=json.dumps({"prompt": "the river", "max_tokens": 6,
                                                      "temperature": 0}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            got = json.load(r)
        ids = tok.encode("the river", add_special=True, parse_special=True)
        assert got["model"] == "tiny-moe"
        assert got["choices"][0]["text"] == expected(model, tok, ids, 6, GREEDY)[0]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
