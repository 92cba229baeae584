"""lm-evaluation-harness against ``fle-engine serve``: its
``local-completions`` and ``local-chat-completions`` models run FLE's tiny
generate_until task (tests/lm_eval_task) end to end, through lm-eval's own
command line, as docs/server.md shows it.

A factory model answers nonsense, so the check is not the score: every
document comes back as a sample, each answer is what the server gives for
the same request sent directly, and the reported exact match is the one the
answers earn. Reference tier: lm-eval is installed by ``tools/setup.sh
--reference``; skipped without it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import string
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.reference

if importlib.util.find_spec("lm_eval") is None or importlib.util.find_spec("tenacity") is None:
    pytest.skip("lm-eval[api] is not installed (tools/setup.sh --reference installs it)", allow_module_level=True)

from fle_quant.synth import make_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASK_DIR = ROOT / "tests" / "lm_eval_task"
DOCS = [json.loads(line) for line in (TASK_DIR / "fle_tiny.jsonl").read_text().splitlines() if line.strip()]
STOP = ["\n", "Question:"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("lm_eval") / "m.gguf", "qwen3moe", mix="f32")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "fle_engine.cli", "serve", str(path), "--port", "0",
                             "-c", "1024", "--alias", "fle", "-t", "1"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        line, deadline = "", time.monotonic() + 120
        while time.monotonic() < deadline and "listening on http://" not in line:
            line = proc.stderr.readline()
            if not line:
                break
        assert "listening on http://" in line, line
        yield line.split("listening on ")[1].split()[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def norm(s: str) -> str:
    return s.lower().translate(str.maketrans("", "", string.punctuation))


def run_lm_eval(tmp_path: Path, model: str, url: str, *extra: str) -> tuple[dict, list[dict]]:
    out = tmp_path / model
    env = dict(os.environ, HF_DATASETS_CACHE=str(tmp_path / "hf"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "lm_eval", "--model", model,
           "--model_args", f"base_url={url},model=fle,tokenizer_backend=none,tokenized_requests=False",
           "--tasks", "fle_tiny", "--include_path", str(TASK_DIR), "--output_path", str(out), "--log_samples",
           *extra]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    results = [json.loads(p.read_text()) for p in out.rglob("results_*.json")]
    samples = [json.loads(line) for p in out.rglob("samples_fle_tiny_*.jsonl")
               for line in p.read_text().splitlines() if line.strip()]
    assert len(results) == 1, list(out.rglob("*"))
    return results[0], sorted(samples, key=lambda s: s["doc_id"])


def check(results: dict, samples: list[dict], direct) -> None:
    assert [s["doc_id"] for s in samples] == list(range(len(DOCS)))
    answers = []
    for s, doc in zip(samples, DOCS):
        assert s["target"] == doc["answer"]
        got = s["resps"][0][0]
        assert got == direct(doc), (doc, got)     # the server's own answer to the same request
        answers.append(got)
    score = sum(norm(a.strip()) == norm(d["answer"]) for a, d in zip(answers, DOCS)) / len(DOCS)
    r = results["results"]["fle_tiny"]
    assert r["exact_match,none"] == pytest.approx(score)
    assert results["n-samples"]["fle_tiny"]["effective"] == len(DOCS)


def test_local_completions_runs_the_tiny_task(server, tmp_path):
    url = server + "/v1/completions"
    results, samples = run_lm_eval(tmp_path, "local-completions", url)

    def direct(doc):
        body = {"prompt": f"Question: {doc['question']}\nAnswer:", "max_tokens": MAX_TOKENS, "temperature": 0,
                "stop": STOP, "seed": 1234}
        return post(url, body)["choices"][0]["text"]

    check(results, samples, direct)


def test_local_chat_completions_runs_the_tiny_task(server, tmp_path):
    url = server + "/v1/chat/completions"
    results, samples = run_lm_eval(tmp_path, "local-chat-completions", url, "--apply_chat_template")

    def direct(doc):
        body = {"messages": [{"role": "user", "content": f"Question: {doc['question']}\nAnswer:"}],
                "max_tokens": MAX_TOKENS, "temperature": 0, "stop": STOP, "seed": 1234}
        text = post(url, body)["choices"][0]["message"]["content"]
        return re.sub(r"^\s*<think>.*?</think>\s*", "", text, flags=re.S)

    check(results, samples, direct)
