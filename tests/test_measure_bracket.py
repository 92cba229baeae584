"""``fle-bracket`` against ``fle-engine serve`` on a factory model (two arms,
the same server twice), and against a scripted stand-in server whose
speeds, failures and length-limit hits are chosen, so that the intervals,
the drift and the flags can be checked against an independent computation."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from fle_quant.cli.bracket_cli import main
from fle_quant.measure.bracket import CATEGORIES, standard_prompts


def test_standard_prompt_set():
    ps = standard_prompts()
    assert len(ps) == 24 and len({p.id for p in ps}) == 24
    counts = {c: sum(p.category == c for p in ps) for c in CATEGORIES}
    assert counts == {"code": 9, "math": 6, "physics": 3, "prose": 6}


class Scripted(BaseHTTPRequestHandler):
    """Replies with predicted_per_second = speeds[arm][prompt index]; the
    arm is the server's, the prompt found by its text."""

    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        srv.bodies.append(body)
        i = srv.index[body["messages"][0]["content"]]
        k = srv.calls.get(i, 0)
        srv.calls[i] = k + 1
        if i in srv.fail:
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"boom")
            return
        speed = srv.speeds[k][i]
        out = {"choices": [{"message": {"role": "assistant", "content": "x"},
                            "finish_reason": "length" if i in srv.length else "stop"}],
               "usage": {"completion_tokens": 8}}
        if speed is not None:
            out["timings"] = {"predicted_n": 8, "predicted_per_second": speed}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def scripted():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    ps = standard_prompts()[:6]
    srv.index = {p.prompt: i for i, p in enumerate(ps)}
    srv.calls, srv.bodies, srv.fail, srv.length = {}, [], set(), set()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}", ps
    srv.shutdown()
    srv.server_close()


def test_scripted_bracket_numbers(scripted, tmp_path, capsys):
    srv, url, ps = scripted
    rng = np.random.default_rng(5)
    ref1 = rng.uniform(40, 50, 6)
    cand = ref1 * 1.2
    ref2 = ref1 * 1.02
    srv.speeds = [list(ref1), list(cand), list(ref2)]
    out = tmp_path / "b.json"
    rc = main(["--arm", "ref", url, "--arm", "fast", url + "/v1", "--limit", "6", "--max-tokens", "8",
               "--n-boot", "1000", "--json", str(out), "--markdown", str(tmp_path / "b.md")])
    text = capsys.readouterr().out
    assert rc == 0, text
    r = json.loads(out.read_text())
    an = r["analysis"]
    # the pass order: reference, candidate, reference again
    assert [p["name"] for p in r["passes"]] == ["ref", "fast", "ref"]
    ref = (ref1 + ref2) / 2
    assert an["drift"]["change"] == pytest.approx(ref2.mean() / ref1.mean() - 1)
    assert an["drift"]["valid"]
    c = an["candidates"][0]
    assert c["interval"]["change"] == pytest.approx(cand.mean() / ref.mean() - 1)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 6, (1000, 6))
    boot = cand[idx].mean(1) / ref[idx].mean(1) - 1
    assert c["interval"]["low"] == pytest.approx(np.quantile(boot, 0.025))
    assert c["interval"]["high"] == pytest.approx(np.quantile(boot, 0.975))
    code = [i for i, p in enumerate(ps) if p.category == "code"]
    assert c["categories"]["code"]["change"] == pytest.approx(cand[code].mean() / ref[code].mean() - 1)
    assert "Reference drift +2.00 %" in text and "| fast |" in text
    assert all(b["max_tokens"] == 8 and b["seed"] == 1 and b["temperature"] == 1.0 for b in srv.bodies)
    assert (tmp_path / "b.md").read_text().startswith("| arm |")
    # the table over many brackets
    assert main(["table", str(out), str(out), "-o", str(tmp_path / "t.md")]) == 0
    t = capsys.readouterr().out
    assert t.count("| b | fast | ref |") == 2 and (tmp_path / "t.md").exists()


def test_scripted_flags_and_fallback(scripted, tmp_path, capsys):
    srv, url, ps = scripted
    srv.speeds = [[50.0] * 6, [None] * 6, [40.0] * 6]  # drift -20 %; candidate without timings
    srv.fail = {5}
    srv.length = {0}
    out = tmp_path / "b.json"
    rc = main(["--arm", "ref", url, "--arm", "c", url, "--limit", "6", "--json", str(out), "--n-boot", "200"])
    text = capsys.readouterr().out
    assert rc == 1
    r = json.loads(out.read_text())
    an = r["analysis"]
    assert not an["drift"]["valid"] and "OUTSIDE the 5 % limit" in text
    assert len(an["paired_prompts"]) == 5 and ps[5].id not in an["paired_prompts"]
    assert {q["speed_source"] for q in r["passes"][1]["requests"] if q["ok"]} == {"wall"}
    inv = r["passes"][0]["invalid"]
    assert any("failed request" in s for s in inv) and any("length-limit hit" in s for s in inv)
    assert "Invalid: ref (pass 1)" in text and not an["candidates"][0]["valid"]


def test_failed_arm_keeps_the_requests(scripted, tmp_path, capsys):
    srv, url, ps = scripted
    srv.speeds = [[50.0] * 6] * 3
    srv.fail = {0, 1, 2, 3, 4}
    out = tmp_path / "b.json"
    assert main(["--arm", "ref", url, "--arm", "c", url, "--limit", "6", "--json", str(out)]) == 1
    cap = capsys.readouterr()
    assert "no analysis: only 1 prompt(s) were answered by every arm" in cap.err
    r = json.loads(out.read_text())
    assert r["analysis"] is None and len(r["passes"]) == 3 and len(r["passes"][0]["requests"]) == 6
    assert main(["table", str(out)]) == 2
    assert "without an analysis" in capsys.readouterr().err


def test_memory_pressure_flags_an_arm():
    from fle_quant.measure.bracket import MEMORY_PRESSURE_LIMIT, _invalid

    p = {"requests": [], "memory_pressure_avg10": MEMORY_PRESSURE_LIMIT + 1}
    assert _invalid(p, False) and "memory pressure" in _invalid(p, False)[0]
    assert _invalid({**p, "memory_pressure_avg10": 0.5}, False) == []
    assert _invalid({**p, "memory_pressure_avg10": None}, False) == []


def test_bad_input(tmp_path, capsys):
    assert main(["--arm", "a", "localhost:1", "--arm", "b", "http://x"]) == 2
    assert "--arm a" in capsys.readouterr().err
    assert main(["--arm", "a", "http://127.0.0.1:9", "--arm", "a", "http://127.0.0.1:9"]) == 2
    assert "must differ" in capsys.readouterr().err
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "x", "category": "code"}\n')
    assert main(["--arm", "a", "http://127.0.0.1:9", "--arm", "b", "http://127.0.0.1:9", "--prompts", str(p)]) == 2
    err = capsys.readouterr().err
    assert "p.jsonl line 1" in err and "'prompt'" in err and err.count("\n") == 1
    assert main(["--arm", "a", "http://127.0.0.1:9", "--arm", "b", "http://127.0.0.1:9", "--limit", "2"]) == 2
    assert "nothing answers at http://127.0.0.1:9" in capsys.readouterr().err
    j = tmp_path / "j.json"
    j.write_text("{}")
    assert main(["table", str(j)]) == 2
    assert "not an fle-bracket result" in capsys.readouterr().err


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("aiohttp")
    from fle_quant.synth import make_model

    path = make_model(tmp_path_factory.mktemp("bracket") / "m.gguf", "qwen3moe", mix="f32")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "fle_engine.cli", "serve", str(path), "--port", "0",
                             "-c", "1024", "-t", "1"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env=env)
    try:
        deadline = time.monotonic() + 180
        line = ""
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line or "listening on http://" in line:
                break
        assert "listening on http://" in line, line
        yield line.split("listening on ")[1].split()[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def test_against_fle_engine_serve(served, tmp_path, capsys):
    out = tmp_path / "e.json"
    rc = main(["--arm", "ref", served, "--arm", "same", served, "--only", "math", "--limit", "3",
               "--max-tokens", "4", "--allow-length", "--n-boot", "500", "--json", str(out)])
    cap = capsys.readouterr()
    text = cap.out
    assert out.exists(), (rc, cap.out, cap.err)
    r = json.loads(out.read_text())
    an = r["analysis"]
    assert [p["name"] for p in r["passes"]] == ["ref", "same", "ref"]
    for p in r["passes"]:
        assert len(p["requests"]) == 3 and all(q["ok"] for q in p["requests"])
        # the engine reports llama-server's timings
        assert {q["speed_source"] for q in p["requests"]} == {"timings"}
        assert all(0 < q["completion_tokens"] <= 4 for q in p["requests"])
    iv = an["candidates"][0]["interval"]
    assert iv["low"] <= iv["change"] <= iv["high"] and iv["n"] == 3
    s = [[q["speed"] for q in p["requests"]] for p in r["passes"]]
    ref = (np.array(s[0]) + np.array(s[2])) / 2
    assert iv["change"] == pytest.approx(np.mean(s[1]) / ref.mean() - 1)
    assert an["drift"]["change"] == pytest.approx(np.mean(s[2]) / np.mean(s[0]) - 1)
    assert "95 % interval" in text and "Reference drift" in text
    assert rc == (0 if an["valid"] else 1)


def test_start_and_stop_commands(tmp_path, capsys):
    """An arm started and stopped by the bracket for each of its passes."""
    pytest.importorskip("torch")
    pytest.importorskip("aiohttp")
    import shlex
    import socket

    from fle_quant.synth import make_model

    path = make_model(tmp_path / "m.gguf", "qwen3moe", mix="f32")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "starts.log"
    cmd = (f"echo start >> {shlex.quote(str(log))}; exec {shlex.quote(sys.executable)} -m fle_engine.cli serve "
           f"{shlex.quote(str(path))} --port {port} -c 1024 -t 1")
    url = f"http://127.0.0.1:{port}"
    out = tmp_path / "s.json"
    rc = main(["--arm", "ref", url, "--arm", "cand", url, "--start", "ref", cmd, "--start", "cand", cmd,
               "--stop", "cand", f"echo stop >> {shlex.quote(str(log))}", "--only", "math", "--limit", "2",
               "--max-tokens", "3", "--allow-length", "--n-boot", "200", "--json", str(out),
               "--start-timeout", "120"])
    cap = capsys.readouterr()
    assert out.exists(), (rc, cap.out, cap.err)
    # three passes, three starts; the candidate's stop command ran; every server is gone afterwards
    assert log.read_text().split() == ["start", "start", "stop", "start"]
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0
