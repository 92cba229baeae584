"""The engine's run statistics per token, not per step, on CPU engines of a
factory model.

A batched step of the lanes carries one token per lane and a verify step
1 + drafts tokens: ``cache.stats.tokens`` counts those rows, and misses per
token, host time per token (``RunStats.summary``) and ``/metrics`` divide by
them; every count is held to the routing and hit logs the cache policy was
given. One-token steps count one token each, as before. Each lane's lookups
and hits (``lane_routed``) add up to the cache's; the server logs a
request's hit rate from them, and ``serve`` prints the run's summary at
exit.
"""
from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import threading
import time
import urllib.request

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("aiohttp")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

from fle_engine.runtime import Engine  # noqa: E402
from fle_engine.server import Engine as Server  # noqa: E402
from fle_engine.server import create_app  # noqa: E402
from fle_engine.server.main import serve  # noqa: E402
from fle_engine.server.metrics import render  # noqa: E402
from fle_engine.tokenizer import Tokenizer  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("exact_float32", "one_torch_thread")
DEVICE = torch.device("cuda" if CUDA else "cpu")
PROMPTS = [[1, 17, 42, 99, 5], [3, 4, 8]]       # shorter than prefill_min: they run as one-token steps


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("stats") / "m.gguf", "qwen3moe", seed=3, mix="release",
                      routing_skew=1.0)


def _engine(path, **kw):
    probe = Engine(path, device=DEVICE, cache_budget=0, ctx_size=64, profile_path="none", progress=False,
                   log=lambda m: None)
    two = 2 * sum(l.expert_bytes for l in probe.net.layouts.values())       # two slots per layer: some misses
    probe.close()
    return Engine(path, device=DEVICE, cache_budget=two, ctx_size=kw.pop("ctx", 64), cache_type_k="f32",
                  cache_type_v="f32", profile_path="none", progress=False, log=lambda m: None, prefill_min=8,
                  prompt_rows=kw.pop("prompt_rows", 1), **kw)      # short prompts one token per step: counted so


class _Log:
    """The routing and hit logs given to the cache policy, copied: rows, lookups, hits per step."""

    def __init__(self, eng, monkeypatch):
        self.k = eng.args.n_expert_used
        self.steps: list[tuple[int, int, int]] = []
        real = eng.cache.observe

        def spy(ids, hits, *a, **kw):
            assert ids.shape == hits.shape and ids.shape[1] % self.k == 0
            self.steps.append((ids.shape[1] // self.k, hits.size, int(np.count_nonzero(hits))))
            self.last = hits.copy()
            return real(ids, hits, *a, **kw)

        monkeypatch.setattr(eng.cache, "observe", spy)

    def totals(self, since: int = 0) -> tuple[int, int, int]:
        """(tokens, lookups, misses) of the steps logged from step ``since`` on."""
        s = self.steps[since:]
        return sum(r for r, _, _ in s), sum(n for _, n, _ in s), sum(n - h for _, n, h in s)


def _check(eng, log):
    """The cache's counts and the summary's per-token figures against the logs."""
    st = eng.cache.stats
    tokens, lookups, misses = log.totals()
    assert (st.steps, st.tokens, st.requests, st.requests - st.hits) == (len(log.steps), tokens, lookups, misses)
    assert st.misses_per_token() == pytest.approx(misses / tokens)
    line = eng.stats.summary(eng.cache)
    assert f"{misses / tokens:.1f} misses/token" in line
    assert f"host time {st.host_seconds / tokens * 1e3:.3f} ms/token policy" in line
    assert f"{eng.stats.launch_seconds / tokens * 1e3:.3f} ms/token launches" in line
    assert f"hit rate {(lookups - misses) / lookups:.3f}" in line
    assert eng.lane_routed.sum(axis=0).tolist() == [st.requests, st.hits]
    # the hits over time (save_stats): one entry per token, each out of one token's lookups
    per_token = eng.args.n_layer * eng.args.n_expert_used
    assert len(eng.step_hits) == tokens and sum(eng.step_hits) == lookups - misses
    assert max(eng.step_hits) <= per_token


def test_two_lane_steps_count_two_tokens_each(model_file, monkeypatch):
    eng = _engine(model_file, ctx=2 * 64, n_seq=2)
    log = _Log(eng, monkeypatch)
    for lane, p in enumerate(PROMPTS):
        eng.lane_prompt(lane, p)
    routed0, s0 = eng.lane_routed.copy(), len(log.steps)
    toks, n_steps = [5, 6], 10
    for _ in range(n_steps):
        eng.step_lanes([0, 1], toks)
        toks = list(eng.next_tokens)
    eng.flush()
    tokens, lookups, misses = log.totals(s0)
    assert len(log.steps) - s0 == n_steps and tokens == 2 * n_steps
    assert misses > 0 and misses < lookups
    _check(eng, log)
    # each lane has its rows' share: the step's lookups split in half, their hits adding up to the step's
    per_lane = eng.lane_routed - routed0
    assert per_lane[:, 0].tolist() == [lookups // 2] * 2
    assert int(per_lane[:, 1].sum()) == lookups - misses
    # rows in another order than the lanes: row j's hits (columns j*K..(j+1)*K of the log) go to lane lanes[j]
    before = eng.lane_routed.copy()
    eng.step_lanes([1, 0], toks[::-1])
    toks = list(eng.next_tokens)[::-1]
    eng.flush()
    rows = log.last.reshape(log.last.shape[0], 2, log.k)
    got = eng.lane_routed - before
    assert got[:, 1].tolist() == [int(np.count_nonzero(rows[:, 1])), int(np.count_nonzero(rows[:, 0]))]
    assert got[:, 0].tolist() == [rows[:, 0].size] * 2
    # a one-row step of lane 1 counts one token, for lane 1 only
    before = eng.lane_routed.copy()
    eng.step_lanes([1], [toks[1]])
    eng.flush()
    assert log.steps[-1][0] == 1 and eng.cache.stats.tokens == log.totals()[0]
    assert (eng.lane_routed - before)[0].tolist() == [0, 0]
    _check(eng, log)
    eng.close()


def test_verify_steps_count_their_tokens(model_file, monkeypatch):
    eng = _engine(model_file)
    log = _Log(eng, monkeypatch)
    g = eng.generate(PROMPTS[0], 1)[0]
    s0 = len(log.steps)
    sizes = [3, 4, 2, 1, 4]
    for t in sizes:
        out = eng.verify_step([g] + [300 + i for i in range(t - 1)])
        g = out[-1]
    tokens, _, _ = log.totals(s0)
    assert [r for r, _, _ in log.steps[s0:]] == sizes and tokens == sum(sizes)
    assert eng.cache.stats.tokens - eng.cache.stats.steps == sum(sizes) - len(sizes)
    _check(eng, log)
    eng.close()


def test_one_token_steps_count_one_token_each(model_file, monkeypatch):
    eng = _engine(model_file)
    log = _Log(eng, monkeypatch)
    eng.generate(PROMPTS[0], 12)
    st = eng.cache.stats
    assert st.tokens == st.steps == len(log.steps) and all(r == 1 for r, _, _ in log.steps)
    assert st.misses_per_token() == st.misses_per_step() > 0
    _check(eng, log)
    eng.close()


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


def test_server_request_hit_rate_and_metrics(model_file):
    """A request alone on a two-lane server: its log line's hit rate is that
    of every routed lookup it made; ``/metrics`` gives misses and host time
    per token (the rows the steps ran)."""
    rt = _engine(model_file, ctx=2 * 64, n_seq=2)
    out = io.StringIO()
    srv = Server(rt, Tokenizer.from_gguf(model_file), n_ctx=2 * 64, name="t", n_parallel=2, log=out)

    async def main():
        async with TestClient(TestServer(create_app(srv))) as client:
            r = await client.post("/completion", json={"prompt": PROMPTS[0], "n_predict": 6, "temperature": 0,
                                                       "ignore_eos": True})
            return r.status

    try:
        assert asyncio.run(main()) == 200
    finally:
        srv.stop()
    rt.flush()
    st = rt.cache.stats
    line = [ln for ln in out.getvalue().splitlines() if "generated 6 tokens" in ln]
    assert len(line) == 1, out.getvalue()
    assert f"expert cache hit rate {100 * st.hits / st.requests:.1f} %" in line[0]
    text = render(srv).decode()
    assert _metric(text, "fle:expert_cache_misses_per_token") == pytest.approx((st.requests - st.hits) / st.tokens)
    assert _metric(text, "fle:expert_cache_host_seconds_per_token") == pytest.approx(st.host_seconds / st.tokens)
    rt.close()


def test_serve_prints_the_run_summary_at_exit(model_file):
    """``serve`` on the engine: a request, then SIGTERM; the summary line
    (throughput, hit rate, misses and host time per token) ends the log."""
    log = io.StringIO()
    got = {}

    def client():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and "listening on http://" not in log.getvalue():
            time.sleep(0.1)
        m = re.search(r"listening on (http://\S+)", log.getvalue())
        if m is None:
            return                                  # serve failed before listening: nothing to stop
        try:
            req = urllib.request.Request(m.group(1) + "/completion", method="POST",
                                         data=json.dumps({"prompt": PROMPTS[1], "n_predict": 4, "temperature": 0,
                                                          "ignore_eos": True}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                got["status"] = r.status
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    th = threading.Thread(target=client, daemon=True)
    th.start()
    rc = serve(str(model_file), port=0, ctx_size=128, device=str(DEVICE), log=log,
               runtime=dict(cache_budget="auto", cache_type_k="f32", cache_type_v="f32", profile_path="none",
                            progress=False))
    th.join(timeout=30)
    text = log.getvalue()
    assert rc == 0 and got.get("status") == 200, text
    assert re.search(r"slot \d: .*generated 4 tokens .*expert cache hit rate [\d.]+ %", text), text
    last = text.strip().splitlines()[-1]
    assert last.startswith("fle-engine: prompt: ") and "| eval: " in last, text
    assert re.search(r"hit rate [\d.]+, [\d.]+ misses/token, .*ms/token policy, .*ms/token launches", last), last
