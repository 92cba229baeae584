"""``fle-probe``: alias matching and the statistics on fixed data against an
independent computation; a run against a scripted server."""
from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from fle_quant.cli.probe_cli import main
from fle_quant.measure import probe
from fle_quant.measure.stats import mcnemar_exact, paired_bootstrap_diff


@pytest.mark.parametrize("reply, aliases, grade", [
    ("Reykjavík", ["Reykjavik"], "correct"),
    ("reykjavik.", ["Reykjavík"], "correct"),
    ("The answer is Miguel de Cervantes!", ["Miguel de Cervantes"], "correct"),
    ("CERVANTES", ["Cervantes"], "correct"),
    ("Marseille", ["Mars"], "wrong"),              # whole words only
    ("Sagrada Família, Barcelona", ["Barcelona"], "correct"),
    ("I don't know", ["Paris"], "abstain"),
    ("I don’t know.", ["Paris"], "abstain"),
    ("I do not know", ["Paris"], "abstain"),
    ("<think>maybe Lyon</think>Paris", ["Paris"], "correct"),
    ("Lyon", ["Paris"], "wrong"),
    ("100 °C", ["100"], "correct"),
])
def test_grading(reply, aliases, grade):
    assert probe.grade(reply, aliases) == grade


def test_normalize():
    assert probe.normalize("  Ça  va, Müller-Lüdenscheidt?! ") == "ca va muller ludenscheidt"
    assert probe.normalize("don't") == "dont"


def test_standard_questions_and_seeds():
    en, de = probe.standard_questions("en"), probe.standard_questions("de")
    assert len(en) == len(de) >= 20 and [q.id for q in en] == [q.id for q in de]
    assert probe.question_seed("q01") == probe.question_seed("q01") != probe.question_seed("q02")
    assert all(0 <= probe.question_seed(q.id) < 2 ** 31 for q in en)


def independent_mcnemar(x, y):
    b = sum(1 for u, v in zip(x, y) if u and not v)
    c = sum(1 for u, v in zip(x, y) if v and not u)
    n, k = b + c, min(b, c)
    p = 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return b, c, min(1.0, p)


def test_statistics_on_fixed_data():
    x = [1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1]
    y = [1, 0, 0, 1, 1, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 0, 1, 0, 1, 1]
    n10, n01, p = mcnemar_exact(x, y)
    b, c, p2 = independent_mcnemar(x, y)
    assert (n10, n01) == (b, c) == (4, 1) and p == pytest.approx(p2)
    iv = paired_bootstrap_diff(x, y, n_boot=3000, seed=4)
    rng = np.random.default_rng(4)
    idx = rng.integers(0, 20, (3000, 20))
    diffs = sorted(sum(y[i] - x[i] for i in row) / 20 for row in idx)
    assert iv.change == pytest.approx((sum(y) - sum(x)) / 20)
    assert iv.low == pytest.approx(np.quantile(diffs, 0.025)) and iv.high == pytest.approx(np.quantile(diffs, 0.975))
    recs = [{"id": f"q{i}", "grade": g} for i, g in enumerate(["correct"] * 3 + ["wrong"] * 2 + ["abstain"] * 4
                                                              + ["failed"])]
    s = probe.score(recs)
    assert (s["correct"], s["wrong"], s["abstain"], s["failed"]) == (3, 2, 4, 1)
    assert s["accuracy"] == 0.3 and s["abstention_rate"] == 0.4 and s["precision"] == 0.6


class Scripted(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        q = body["messages"][1]["content"]
        text = self.server.replies.get(q, "I don't know")
        data = json.dumps({"choices": [{"message": {"content": text}, "finish_reason": "stop"}],
                           "usage": {"completion_tokens": 2}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_probe_two_servers(tmp_path, capsys):
    qs = probe.standard_questions("en")[:6]
    servers = []
    for replies in ({qs[0].query: qs[0].aliases[0], qs[1].query: "wrong", qs[2].query: qs[2].aliases[-1]},
                    {qs[0].query: qs[0].aliases[0], qs[3].query: qs[3].aliases[0].upper()}):
        srv = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
        srv.replies, srv.bodies = replies, []
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    try:
        urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
        rc = main(["--arm", "a", urls[0], "--arm", "b", urls[1], "--limit", "6", "--n-boot", "500",
                   "--json", str(tmp_path / "p")])
        out = capsys.readouterr().out
        assert rc == 0, out
        a = json.loads((tmp_path / "p.a.json").read_text())
        assert [r["grade"] for r in a["records"]] == ["correct", "wrong", "correct"] + ["abstain"] * 3
        assert "a: 2/6 correct" in out and "b: 2/6 correct" in out and "difference +0.0 points" in out
        body = servers[0].bodies[0]
        assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"], body["max_tokens"]) == \
            (1.0, 0.95, 20, 0.0, 256)
        assert body["chat_template_kwargs"] == {"enable_thinking": False}
        assert body["seed"] == probe.question_seed(qs[0].id) == servers[1].bodies[0]["seed"]
        assert "I don't know" in body["messages"][0]["content"]
        assert main(["compare", str(tmp_path / "p.a.json"), str(tmp_path / "p.b.json"), "--n-boot", "500"]) == 0
        assert "right only in a: 1, only in b: 1" in capsys.readouterr().out
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


def test_bad_input(tmp_path, capsys):
    p = tmp_path / "q.jsonl"
    p.write_text('{"example_id": "x", "queries": {"en": "?"}, "answers": {"en": "Paris"}}\n')
    assert main(["--arm", "a", "http://127.0.0.1:9", "--questions", str(p)]) == 2
    err = capsys.readouterr().err
    assert "q.jsonl line 1" in err and "answers['en']" in err and err.count("\n") == 1
    assert main(["--arm", "a", "http://127.0.0.1:9", "--questions", str(p), "--lang", "fr"]) == 2
    assert "no question in language 'fr'" in capsys.readouterr().err
    j = tmp_path / "r.json"
    j.write_text("[]")
    assert main(["compare", str(j), str(j)]) == 2
    assert "not an fle-probe result" in capsys.readouterr().err


def test_probe_against_fle_engine_serve(tmp_path, capsys):
    """The probe's requests (system prompt, thinking off, its sampling) are
    accepted by fle-engine serve; a factory model's answers are graded."""
    pytest.importorskip("torch")
    pytest.importorskip("aiohttp")
    import os
    import signal
    import subprocess
    import sys
    import time

    from fle_quant.synth import make_model

    path = make_model(tmp_path / "m.gguf", "qwen3moe", mix="f32")
    proc = subprocess.Popen([sys.executable, "-m", "fle_engine.cli", "serve", str(path), "--port", "0", "-c", "1024",
                             "-t", "1"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline, line = time.monotonic() + 180, ""
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line or "listening on http://" in line:
                break
        assert "listening on http://" in line, line
        url = line.split("listening on ")[1].split()[0]
        assert main(["--arm", "tiny", url, "--limit", "2", "--json", str(tmp_path / "p")]) == 0
        r = json.loads((tmp_path / "p.tiny.json").read_text())
        assert [x["grade"] for x in r["records"]] != ["failed", "failed"], r["records"]
        assert all(x["grade"] in ("correct", "wrong", "abstain") for x in r["records"]), r["records"]
        assert r["score"]["n"] == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def test_questions_from_the_hub(tmp_path, capsys, monkeypatch):
    """MKQA-layout questions (gzip, as MKQA ships them) from a dataset on a
    loopback stand-in for the Hub, through huggingface_hub's own download;
    then from its cache with the Hub offline; bad names and missing files
    one line each."""
    import gzip

    import huggingface_hub.constants as c
    from hubstandin import COMMIT, Hub  # this folder's stand-in for the Hugging Face Hub

    qs = probe.standard_questions("de")[:4]
    raw = (probe.resources.files(probe.__package__).joinpath("data/questions.jsonl").read_bytes())
    gz = tmp_path / "mkqa.jsonl.gz"
    gz.write_bytes(gzip.compress(raw))
    assert [q.id for q in probe.load_questions(str(gz), "de")[:4]] == [q.id for q in qs]
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    srv.replies, srv.bodies = {qs[0].query: qs[0].aliases[0]}, []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        with Hub() as hub:
            monkeypatch.setattr(c, "ENDPOINT", hub.url)
            monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
            hub.files["datasets/standin/mkqa"] = {"data/mkqa.jsonl.gz": gz}
            spec = "hf://datasets/standin/mkqa@main/data/mkqa.jsonl.gz"
            argv = ["--arm", "a", url, "--questions", spec, "--lang", "de", "--limit", "4", "--json",
                    str(tmp_path / "p")]
            assert main(argv) == 0
            out = capsys.readouterr().out
            assert f"questions: hf://datasets/standin/mkqa@{COMMIT}/data/mkqa.jsonl.gz" in out
            r = json.loads((tmp_path / "p.a.json").read_text())
            assert r["questions"] == f"hf://datasets/standin/mkqa@{COMMIT}/data/mkqa.jsonl.gz"
            assert [x["id"] for x in r["records"]] == [q.id for q in qs] and r["score"]["correct"] == 1
            assert "data/mkqa.jsonl.gz" in hub.gets
            for bad, word in ((spec.replace("data/", "nope/"), "has no file 'nope/mkqa.jsonl.gz'"),
                              ("hf://datasets/standin/none/x.jsonl", "no dataset 'standin/none'"),
                              ("hf://models/standin/mkqa/x.jsonl", "hf://datasets/OWNER/NAME"),
                              ("hf://datasets/standin/mkqa/../x.jsonl", "hf://datasets/OWNER/NAME")):
                assert main(["--arm", "a", url, "--questions", bad]) == 2, bad
                err = capsys.readouterr().err
                assert err.count("\n") == 1 and word in err, err
        # the Hub is gone: the cached copy is used offline
        monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
        assert main(argv + ["--force"]) == 0
        capsys.readouterr()
        assert main(["--arm", "a", url, "--questions", "hf://datasets/standin/other/q.jsonl"]) == 2
        assert "not in the local Hub cache" in capsys.readouterr().err
    finally:
        srv.shutdown()
        srv.server_close()
