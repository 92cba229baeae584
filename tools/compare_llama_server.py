"""Send one request set to a llama.cpp ``llama-server`` and to ``fle-engine
serve`` on the same factory model and compare the answers field by field:
status codes, the JSON shape (every key path with its value's type), and a
few values that must agree (finish reasons, object kinds, greedy text).

    PYTHONPATH=. python tools/compare_llama_server.py --llama-server PATH/llama-server \\
        [--arch qwen3moe] [--markdown out.md] [--json out.json]

``llama-server`` is built from the llama-cpp-python sdist's vendored
llama.cpp (CPU, ``-DGGML_NATIVE=OFF``, ``-DLLAMA_BUILD_SERVER=ON``, target
``llama-server``); docs/server.md has the table this prints.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from fle_quant.synth import make_model

MSG = [{"role": "user", "content": "tell me of the river"}]

# (name, method, path, body or raw bytes, stream)
REQUESTS = [
    ("health", "GET", "/health", None, False),
    ("models", "GET", "/v1/models", None, False),
    ("props", "GET", "/props", None, False),
    ("slots", "GET", "/slots", None, False),
    ("completions", "POST", "/v1/completions", {"prompt": "the river", "max_tokens": 8, "temperature": 0}, False),
    ("completions stream", "POST", "/v1/completions",
     {"prompt": "the river", "max_tokens": 8, "temperature": 0, "stream": True}, True),
    ("completions logprobs", "POST", "/v1/completions",
     {"prompt": "the river", "max_tokens": 3, "temperature": 0, "logprobs": 2}, False),
    ("completions n=2", "POST", "/v1/completions",
     {"prompt": "the river", "max_tokens": 4, "temperature": 0, "n": 2}, False),
    ("completions stop", "POST", "/v1/completions",
     {"prompt": "the river", "max_tokens": 16, "temperature": 0, "stop": ["e"]}, False),
    ("chat", "POST", "/v1/chat/completions", {"messages": MSG, "max_tokens": 8, "temperature": 0}, False),
    ("chat stream", "POST", "/v1/chat/completions",
     {"messages": MSG, "max_tokens": 8, "temperature": 0, "stream": True,
      "stream_options": {"include_usage": True}}, True),
    ("chat logprobs", "POST", "/v1/chat/completions",
     {"messages": MSG, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2}, False),
    ("chat json_object", "POST", "/v1/chat/completions",
     {"messages": MSG, "max_tokens": 24, "temperature": 0, "response_format": {"type": "json_object"}}, False),
    ("native completion", "POST", "/completion", {"prompt": "the river", "n_predict": 8, "temperature": 0}, False),
    ("native completion stream", "POST", "/completion",
     {"prompt": "the river", "n_predict": 4, "temperature": 0, "stream": True}, True),
    ("tokenize", "POST", "/tokenize", {"content": "the river", "with_pieces": True}, False),
    ("detokenize", "POST", "/detokenize", {"tokens": [1, 2, 3]}, False),
    ("apply-template", "POST", "/apply-template", {"messages": MSG}, False),
    ("beyond the context", "POST", "/v1/completions",
     {"prompt": "the river", "max_tokens": 100000, "temperature": 0}, False),
    ("error: messages []", "POST", "/v1/chat/completions", {"messages": []}, False),
    ("error: unknown role", "POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]},
     False),
    ("error: n too large", "POST", "/v1/completions", {"prompt": "x", "n": 5}, False),
    ("error: prompt too long", "POST", "/v1/completions", {"prompt": [1] * 600}, False),
    ("error: malformed JSON", "POST", "/v1/completions", b"{nope", False),
    ("error: bad temperature", "POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}, False),
    ("error: unknown model", "GET", "/v1/models/nope", None, False),
    ("error: no route", "GET", "/nowhere", None, False),
]

VALUES = ("object", "finish_reason", "stop_type", "status", "role")   # values compared where both have them


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(base: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server at {base} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.3)
    raise SystemExit(f"the server at {base} did not come up")


def send(base: str, method: str, path: str, body, stream: bool):
    data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(base + path, method=method, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            status, ctype, raw = r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        status, ctype, raw = e.code, e.headers.get("Content-Type", ""), e.read()
    if stream and status == 200:
        events = []
        for part in raw.decode().split("\n\n"):
            for line in part.split("\n"):
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: "):]))
        done = b"data: [DONE]" in raw
        return status, ctype.split(";")[0], {"events": events, "[DONE]": done}
    try:
        return status, ctype.split(";")[0], json.loads(raw) if raw.strip() else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return status, ctype.split(";")[0], raw.decode(errors="replace")[:80]


def shape(v, path: str = "", out: dict | None = None) -> dict:
    """Every key path with its value's JSON type; lists by their first element
    (``[]``), a stream's events merged."""
    out = {} if out is None else out
    if isinstance(v, dict):
        out.setdefault(path or ".", "object")
        for k, x in v.items():
            shape(x, f"{path}.{k}" if path else k, out)
    elif isinstance(v, list):
        out.setdefault(path or ".", "array")
        for x in v[:1] if not path.endswith("events") else v:
            shape(x, path + "[]", out)
    else:
        t = {bool: "bool", int: "number", float: "number", str: "string", type(None): "null"}[type(v)]
        prev = out.get(path)
        out[path] = t if prev in (None, t) else f"{prev}|{t}" if t not in prev.split("|") else prev
    return out


def values(v, path: str = "", out: dict | None = None) -> dict:
    out = {} if out is None else out
    if isinstance(v, dict):
        for k, x in v.items():
            p = f"{path}.{k}" if path else k
            if k in VALUES and not isinstance(x, (dict, list)):
                out.setdefault(p, set()).add(json.dumps(x))
            values(x, p, out)
    elif isinstance(v, list):
        for x in v:
            values(x, path + "[]", out)
    return out


def texts(name: str, v) -> str | None:
    """The generated text of a greedy answer, to compare across the servers."""
    if not isinstance(v, dict):
        return None
    if "events" in v:
        acc = ""
        for ev in v["events"]:
            for c in ev.get("choices") or []:
                acc += c.get("text") or (c.get("delta") or {}).get("content") or ""
            acc += ev.get("content", "") if "choices" not in ev else ""
        return acc
    if "choices" in v:
        c = v["choices"][0]
        return c.get("text") if "text" in c else (c.get("message") or {}).get("content")
    if "content" in v and name.startswith("native"):
        return v["content"]
    return None


def compare(a: tuple, b: tuple, name: str) -> dict:
    (sa, ca, ja), (sb, cb, jb) = a, b
    ka, kb = shape(ja), shape(jb)
    va, vb = values(ja), values(jb)
    only_l = sorted(k for k in ka if k not in kb)
    only_f = sorted(k for k in kb if k not in ka)
    types = sorted(f"{k}: {ka[k]} vs {kb[k]}" for k in ka if k in kb and ka[k] != kb[k])
    vals = sorted(f"{k}: {'/'.join(sorted(va[k]))} vs {'/'.join(sorted(vb[k]))}" for k in va
                  if k in vb and va[k] != vb[k])
    ta, tb = texts(name, ja), texts(name, jb)
    return {"request": name, "status": [sa, sb], "content_type": [ca, cb], "only_llama_server": only_l,
            "only_fle": only_f, "type_differs": types, "value_differs": vals,
            "text_equal": None if ta is None or tb is None else ta == tb,
            "error_message": [pick_error(ja), pick_error(jb)] if sa >= 400 or sb >= 400 else None}


def pick_error(j) -> str | None:
    if isinstance(j, dict) and isinstance(j.get("error"), dict):
        return str(j["error"].get("message"))[:120]
    return None


def markdown(rows: list[dict]) -> str:
    def cell(xs, n=8):
        if not xs:
            return ""
        xs = list(xs)
        more = f" (+{len(xs) - n})" if len(xs) > n else ""
        return "<br>".join(f"`{x}`" for x in xs[:n]) + more

    out = ["| request | status (llama-server / FLE) | only in llama-server | only in FLE | types / values differ |"
           " greedy text equal |", "|---|---|---|---|---|---|"]
    for r in rows:
        st = f"{r['status'][0]} / {r['status'][1]}"
        diff = cell(r["type_differs"] + r["value_differs"])
        te = "" if r["text_equal"] is None else ("yes" if r["text_equal"] else "**no**")
        out.append(f"| {r['request']} | {st} | {cell(r['only_llama_server'])} | {cell(r['only_fle'])} | {diff} |"
                   f" {te} |")
    return "\n".join(out) + "\n"


def run(llama_server: str, arch: str = "qwen3moe", ctx: int = 1024) -> list[dict]:
    """Both servers on one factory model, the request set sent to each: the
    comparison rows."""
    with tempfile.TemporaryDirectory() as d:
        model = make_model(Path(d) / "m.gguf", arch, mix="f32")
        pl, pf = free_port(), free_port()
        procs = []
        try:
            procs.append(subprocess.Popen([llama_server, "-m", str(model), "--port", str(pl), "-c", str(ctx),
                                           "-np", "2", "-t", "1", "--host", "127.0.0.1", "--alias", "m"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            procs.append(subprocess.Popen([sys.executable, "-m", "fle_engine.cli", "serve", str(model), "--port",
                                           str(pf), "-c", str(ctx), "-np", "2", "-t", "1", "--alias", "m"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          env=dict(os.environ, PYTHONUNBUFFERED="1")))
            bl, bf = f"http://127.0.0.1:{pl}", f"http://127.0.0.1:{pf}"
            wait_up(bl, procs[0])
            wait_up(bf, procs[1])
            return [compare(send(bl, method, path, body, stream), send(bf, method, path, body, stream), name)
                    for name, method, path, body, stream in REQUESTS]
        finally:
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True, help="path of a llama-server executable")
    ap.add_argument("--arch", default="qwen3moe")
    ap.add_argument("--ctx", type=int, default=1024, help="--ctx-size of both servers (2 slots)")
    ap.add_argument("--markdown", help="write the table here")
    ap.add_argument("--json", help="write the comparison here")
    args = ap.parse_args()
    rows = run(args.llama_server, args.arch, args.ctx)
    table = markdown(rows)
    print(table)
    for r in rows:
        if r["error_message"]:
            print(f"{r['request']}: llama-server {r['error_message'][0]!r}; FLE {r['error_message'][1]!r}")
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
