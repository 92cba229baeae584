"""``fle-engine serve``'s operational endpoints, sampling fields, tool calls
and structured output, each shown to have its effect, on factory models
(and a scripted model where an answer must take a given form)."""
from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

torch = pytest.importorskip("torch")
pytest.importorskip("aiohttp")

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

import fle_engine  # noqa: E402
from fle_engine.chat import render_prompt  # noqa: E402
from fle_engine.sampling import Sampler, SamplerParams, generate_tokens  # noqa: E402
from fle_engine.server import Engine, create_app  # noqa: E402
from fle_engine.server.tools import ToolCallStream, parse_call  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_server import Scripted, chat_engine, events  # noqa: E402

GREEDY = SamplerParams(temp=0.0, seed=0)


@pytest.fixture(scope="module")
def engine(model, tok):
    return Engine(model, tok, n_ctx=512, name="tiny", n_parallel=2)


def call(engine, fn, **kw):
    async def main():
        async with TestClient(TestServer(create_app(engine, **kw))) as client:
            return await fn(client)
    return asyncio.run(main())


def post(engine, path, body, **kw):
    async def fn(client):
        r = await client.post(path, json=body)
        return r.status, await r.json()
    return call(engine, fn, **kw)


def cold(model, tok, prompt, n):
    return list(generate_tokens(model, prompt, n, Sampler(GREEDY), stop=tok.eog_ids))


# ---------------------------------------------------------------- endpoints


def test_tokenize_detokenize_apply_template_models(engine, tok):
    text = "the river <|im_end|> flows"

    async def fn(client):
        t = await (await client.post("/tokenize", json={"content": text})).json()
        tp = await (await client.post("/tokenize", json={"content": "ab", "with_pieces": True})).json()
        d = await (await client.post("/detokenize", json={"tokens": t["tokens"]})).json()
        msgs = [{"role": "user", "content": "hi"}]
        at = await (await client.post("/apply-template", json={"messages": msgs})).json()
        m = await client.get("/v1/models/tiny")
        m404 = await client.get("/v1/models/other")
        return t, tp, d, at, m.status, await m.json(), m404.status

    t, tp, d, at, ms, m, m404 = call(engine, fn)
    assert t["tokens"] == tok.encode(text, add_special=False, parse_special=True)
    assert d["content"] == text
    assert [p["id"] for p in tp["tokens"]] == tok.encode("ab", add_special=False)
    assert "".join(p["piece"] for p in tp["tokens"]) == "ab"
    assert at["prompt"] == render_prompt(tok, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert ms == 200 and m["id"] == "tiny" and m404 == 404


def test_props_slots_metrics(engine):
    async def fn(client):
        await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "temperature": 0})
        props = await (await client.get("/props")).json()
        slots = await (await client.get("/slots")).json()
        r = await client.get("/metrics")
        return props, slots, r.headers["Content-Type"], await r.text()

    props, slots, ctype, text = call(engine, fn)
    assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == 256
    assert "chat_template" in props and props["model_alias"] == "tiny"
    assert [s["id"] for s in slots] == [0, 1] and all(s["n_ctx"] == 256 for s in slots)
    assert ctype.startswith("text/plain")
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert "llamacpp:tokens_predicted" in fams and "llamacpp:requests_processing" in fams
    predicted = fams["llamacpp:tokens_predicted"].samples[0].value
    assert predicted >= 3


def test_expert_cache_metrics(engine):
    from fle_engine.server.metrics import expert_cache_stats, render

    class Stats:
        requests, hits, steps = 100, 75, 10

    class WithCache:
        cache = type("C", (), {"stats": Stats()})()

    assert expert_cache_stats(WithCache()) == (100, 75, 10)
    orig = engine.model
    try:
        engine.model = type("M", (), {"cache": WithCache.cache, "n_vocab": orig.n_vocab})()
        text = render(engine).decode()
    finally:
        engine.model = orig
    assert "fle:expert_cache_hit_rate 0.75" in text and "fle:expert_cache_misses_per_token 2.5" in text
    assert "fle:expert_cache_hit_rate" not in render(engine).decode()   # the reference model has none


def test_cors_and_api_key(engine):
    async def fn(client):
        pre = await client.options("/v1/chat/completions", headers={"Origin": "http://a.example",
                                                                    "Access-Control-Request-Method": "POST"})
        h = await client.get("/health")
        no = await client.get("/v1/models")
        bad = await client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        ok = await client.get("/v1/models", headers={"Authorization": "Bearer sekrit", "Origin": "http://a.example"})
        return (pre.status, dict(pre.headers), h.status, no.status, await no.json(), bad.status, ok.status,
                dict(ok.headers))

    pre, pre_h, h, no, no_j, bad, ok, ok_h = call(engine, fn, api_key="sekrit")
    assert pre == 204 and pre_h["Access-Control-Allow-Origin"] == "http://a.example"
    assert "POST" in pre_h["Access-Control-Allow-Methods"]
    assert h == 200 and no == 401 and bad == 401 and ok == 200
    assert no_j["error"]["type"] == "authentication_error"
    assert ok_h["Access-Control-Allow-Origin"] == "http://a.example"


def test_native_completion_and_n_probs(engine, model, tok):
    ids = tok.encode("the river", add_special=True, parse_special=True)
    status, r = post(engine, "/completion", {"prompt": "the river", "n_predict": 5, "temperature": 0, "n_probs": 3})
    assert status == 200
    want = cold(model, tok, ids, 5)
    assert r["content"] == tok.decode([t for t in want if t not in tok.eog_ids])
    probs = r["completion_probabilities"]
    assert len(probs) == len(want)
    s = model.new_state(64)
    logits = model.forward(ids, s)[-1]
    lp = torch.log_softmax(logits.float(), -1)
    assert probs[0]["id"] == want[0] and math.isclose(probs[0]["logprob"], float(lp[want[0]]), abs_tol=1e-4)
    top = [p["id"] for p in probs[0]["top_logprobs"]]
    assert top == torch.topk(lp, 3).indices.tolist() and top[0] == want[0]


# ---------------------------------------------------------------- sampling fields


def test_chat_and_completion_logprobs(engine, model, tok):
    msgs = [{"role": "user", "content": "hello"}]
    _, r = post(engine, "/v1/chat/completions", {"messages": msgs, "max_tokens": 4, "temperature": 0,
                                                 "logprobs": True, "top_logprobs": 2})
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)
    assert all(c["top_logprobs"][0]["logprob"] == c["logprob"] for c in content)   # greedy: the top one
    _, r = post(engine, "/v1/completions", {"prompt": "the river", "max_tokens": 4, "temperature": 0, "logprobs": 2})
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    _, r = post(engine, "/v1/completions", {"prompt": "the river", "max_tokens": 4, "temperature": 0})
    assert r["choices"][0]["logprobs"] is None


def test_logit_bias(engine, model, tok):
    ids = tok.encode("the river", add_special=True, parse_special=True)
    first = cold(model, tok, ids, 1)[0]
    body = {"prompt": "the river", "max_tokens": 1, "temperature": 0, "return_tokens": True}
    _, banned = post(engine, "/completion", {**body, "logit_bias": [[first, False]]})
    _, lowered = post(engine, "/completion", {**body, "logit_bias": {str(first): -100}})
    assert banned["tokens"][0] != first and lowered["tokens"][0] != first
    _, forced = post(engine, "/completion", {**body, "logit_bias": {"77": 100}})
    assert forced["tokens"] == [77]


def test_penalties_and_ignore_eos(engine, model, tok, model_path):
    body = {"prompt": "the river", "max_tokens": 200, "temperature": 0, "return_tokens": True, "ignore_eos": True}
    _, plain = post(engine, "/completion", body)
    assert len(set(plain["tokens"])) < len(plain["tokens"])             # greedy repeats itself
    _, pres = post(engine, "/completion", {**body, "presence_penalty": 1000.0, "repeat_last_n": -1})
    assert len(set(pres["tokens"])) == len(pres["tokens"])              # never a token twice
    _, freq = post(engine, "/completion", {**body, "frequency_penalty": 1000.0, "repeat_last_n": -1})
    assert len(set(freq["tokens"])) == len(freq["tokens"])
    _, rep = post(engine, "/completion", {**body, "repeat_penalty": 1e6, "repeat_last_n": -1})
    assert rep["tokens"] != plain["tokens"] and len(set(rep["tokens"])) > len(set(plain["tokens"]))
    _, off = post(engine, "/completion", {**body, "repeat_penalty": 1e6, "repeat_last_n": 0})   # 0: off
    assert off["tokens"] == plain["tokens"]
    # ignore_eos: a model that ends at once goes on to max_tokens
    eng, _ = chat_engine(model, model_path, "")
    _, r = post(eng, "/v1/completions", {"prompt": "x", "max_tokens": 5})
    assert r["usage"]["completion_tokens"] == 1 and r["choices"][0]["finish_reason"] == "stop"
    _, r = post(eng, "/v1/completions", {"prompt": "x", "max_tokens": 5, "ignore_eos": True})
    assert r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------- tool calls


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def test_parse_tool_call_forms():
    c = parse_call('\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n', TOOLS)
    assert c.name == "get_weather" and json.loads(c.arguments) == {"city": "Oslo"}
    x = parse_call("\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n3\n"
                   "</parameter>\n</function>\n", TOOLS)
    assert x.name == "get_weather" and json.loads(x.arguments) == {"city": "42", "days": 3}
    assert parse_call("not a call", TOOLS) is None
    s = ToolCallStream(TOOLS)
    text = 'Let me look.\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n' \
           '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    content, calls = "", []
    for ch in text:
        c, f = s.add(ch)
        content += c
        calls += f
    c, f = s.finish()
    content, calls = content + c, calls + f
    assert content == "Let me look." and [c.name for c in calls] == ["get_time", "get_weather"]
    one = ToolCallStream(TOOLS, parallel=False)
    one.add(text)
    one.finish()
    assert [c.name for c in one.calls] == ["get_time"]


@pytest.mark.parametrize("answer", [
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>',
    "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n"
    "</parameter>\n</function>\n</tool_call>",
])
def test_chat_tool_calls_parsed_and_streamed(model, model_path, answer):
    eng, _ = chat_engine(model, model_path, answer)
    msgs = [{"role": "user", "content": "weather in Oslo?"}]
    _, r = post(eng, "/v1/chat/completions", {"messages": msgs, "tools": TOOLS})
    ch = r["choices"][0]
    assert ch["finish_reason"] == "tool_calls"
    assert ch["message"]["content"] == "Checking."
    (tc,) = ch["message"]["tool_calls"]
    assert tc["type"] == "function" and tc["id"].startswith("call_") and tc["function"]["name"] == "get_weather"
    assert json.loads(tc["function"]["arguments"]) == {"city": "Oslo", "days": 2}

    async def fn(client):
        r = await client.post("/v1/chat/completions", json={"messages": msgs, "tools": TOOLS, "stream": True})
        return r.headers["Content-Type"], await r.read()

    evs = events(*call(eng, fn))
    deltas = [e["choices"][0]["delta"] for e in evs if e["choices"]]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0][0]["index"] == 0 and calls[0][0]["function"]["name"] == "get_weather"
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    assert evs[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # tool_choice none: no parsing, the text stays content
    _, r = post(eng, "/v1/chat/completions", {"messages": msgs, "tools": TOOLS, "tool_choice": "none"})
    assert r["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in r["choices"][0]["message"]
    assert "<tool_call>" in r["choices"][0]["message"]["content"]


TIGHT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]


def test_tool_choice_required_and_named_constrain_the_answer(engine):
    """The factory model knows nothing of tools; the grammar makes it call one."""
    msgs = [{"role": "user", "content": "weather?"}]
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        for seed in range(3):
            _, r = post(engine, "/v1/chat/completions", {"messages": msgs, "tools": TIGHT_TOOLS,
                                                          "tool_choice": choice,
                                                          "seed": seed, "temperature": 1.0, "max_tokens": 200,
                                                          "parallel_tool_calls": False})
            ch = r["choices"][0]
            assert ch["finish_reason"] == "tool_calls", r
            (tc,) = ch["message"]["tool_calls"]
            assert tc["function"]["name"] in names
            assert isinstance(json.loads(tc["function"]["arguments"]), dict)


# ---------------------------------------------------------------- structured output


SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "kind": {"enum": ["cat", "dog", "bird"]},
    "ok": {"type": "boolean"}},
    "required": ["n", "kind", "ok"], "additionalProperties": False}


def _valid(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"n", "kind", "ok"} and isinstance(obj["n"], int)
            and not isinstance(obj["n"], bool) and 0 <= obj["n"] <= 99 and obj["kind"] in ("cat", "dog", "bird")
            and isinstance(obj["ok"], bool))


def test_json_schema_output_validates_on_20_requests(engine):
    msgs = [{"role": "user", "content": "give me json"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
    for seed in range(20):
        _, r = post(engine, "/v1/chat/completions", {"messages": msgs, "response_format": fmt, "seed": seed,
                                                      "temperature": 1.0, "max_tokens": 120})
        text = r["choices"][0]["message"]["content"]
        assert _valid(json.loads(text)), text
        assert r["choices"][0]["finish_reason"] == "stop"
    # without the constraint the factory model writes no JSON
    _, r = post(engine, "/v1/chat/completions", {"messages": msgs, "seed": 0, "temperature": 1.0, "max_tokens": 30})
    with pytest.raises(ValueError):
        json.loads(r["choices"][0]["message"]["content"])


def test_json_object_grammar_and_json_schema_fields(engine):
    _, r = post(engine, "/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"},
                                            "max_tokens": 150, "temperature": 0.5, "seed": 1})
    if r["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(r["choices"][0]["text"]), dict)
    else:                            # a long object cut by max_tokens still starts as one
        assert r["choices"][0]["text"].startswith("{")
    _, r = post(engine, "/completion", {"prompt": "x", "json_schema": SCHEMA, "n_predict": 120, "seed": 3})
    assert _valid(json.loads(r["content"]))
    _, r = post(engine, "/completion", {"prompt": "x", "grammar": 'root ::= ("yes" | "no") "!"', "n_predict": 20,
                                        "seed": 4})
    assert r["content"] in ("yes!", "no!")


# ---------------------------------------------------------------- the openai SDK


def _serve(model_path, *extra):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "fle_engine.cli", "serve", str(model_path), "--port", "0",
                             "-c", "512", "-t", "1", "--alias", "tiny", *extra],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        if "listening on http://" in line:
            return proc, line.split("listening on ")[1].split()[0]
    proc.kill()
    raise AssertionError("the server did not start")


def test_openai_sdk_and_graceful_sigterm(model_path, model, tok):
    openai = pytest.importorskip("openai")
    proc, base = _serve(model_path, "--api-key", "k1")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="k1")
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
        assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens <= 5
        assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
        parts = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=5, temperature=0, stream=True))
        assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == \
            r.choices[0].message.content
        c = client.completions.create(model="tiny", prompt="the river", max_tokens=6, temperature=0)
        ids = tok.encode("the river", add_special=True, parse_special=True)
        assert c.choices[0].text == tok.decode([t for t in cold(model, tok, ids, 6) if t not in tok.eog_ids])
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong").models.list()
        # SIGTERM during a long stream: the stream ends honestly, the program exits 0
        req = urllib.request.Request(base + "/v1/completions", method="POST", data=json.dumps(
            {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}).encode(),
            headers={"Content-Type": "application/json", "Authorization": "Bearer k1"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            got = resp.read(200)
            proc.send_signal(signal.SIGTERM)
            got += resp.read()
        evs = [json.loads(p[6:]) for p in got.decode().split("\n\n") if p.startswith("data: {")]
        finals = [e["choices"][0]["finish_reason"] for e in evs if e["choices"][0]["finish_reason"]]
        assert finals == ["abort"], finals
        assert evs[-1]["usage"]["completion_tokens"] < 400
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
