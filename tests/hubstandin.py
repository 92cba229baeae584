"""A stand-in for the Hugging Face Hub on loopback: the API paths and
headers that ``huggingface_hub`` uses to list a repository and download
files, for model and dataset repositories, serving local files. Tests point
``huggingface_hub.constants.ENDPOINT`` (or ``HF_ENDPOINT``) at ``Hub.url``,
so the real client code runs."""
from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub:
    """Serves ``files[repo][path] = local file`` at revision COMMIT (any
    prefix of it resolves; ``repo`` is ``datasets/OWNER/NAME`` for a
    dataset). ``stall[path] = n``: the first download of
    ``path`` sends ``n`` bytes, then stalls until the test ends, so that a
    test can kill the client midway."""

    def __init__(self):
        self.files: dict[str, dict[str, Path]] = {}
        self.stall: dict[str, int] = {}
        self.stop = threading.Event()
        self.ranges: list[tuple[str, str]] = []   # (path, Range header) of every GET with one
        self.gets: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _json(self, obj, code=200):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _rev_ok(self, rev):
                return len(rev) >= 7 and COMMIT.startswith(rev) or rev == "main"

            def _route(self):
                # a dataset repository is keyed "datasets/OWNER/NAME" in ``files``
                path = unquote(urlparse(self.path).path)
                m = re.match(r"^/api/(models|datasets)/([^/]+/[^/]+)/(revision|tree)/([^/]+)/?(.*)$", path)
                if m:
                    repo = m.group(2) if m.group(1) == "models" else f"datasets/{m.group(2)}"
                    if m.group(3) == "revision" and not m.group(5):
                        return "info", repo, m.group(4), ""
                    if m.group(3) == "tree":
                        return "tree", repo, m.group(4), m.group(5)
                m = re.match(r"^/((?:datasets/)?[^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
                if m:
                    return "file", m.group(1), m.group(2), m.group(3)
                return None, None, None, None

            def _not_found(self, what, code="EntryNotFound"):
                self.send_response(404)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", what)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_HEAD(self):
                self._serve(head=True)

            def do_GET(self):
                self._serve(head=False)

            def _serve(self, head):
                kind, repo, rev, sub = self._route()
                if kind is not None and repo not in hub.files:
                    return self._not_found(f"Repository {repo} not found", "RepoNotFound")
                if kind is None or not self._rev_ok(rev):
                    return self._not_found(f"{self.path} not found")
                files = hub.files[repo]
                if kind == "info":
                    return self._json({"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                                       "siblings": [{"rfilename": p} for p in sorted(files)]})
                if kind == "tree":
                    sub = sub.strip("/")
                    prefix = f"{sub}/" if sub else ""
                    out, dirs = [], set()
                    for p, f in sorted(files.items()):
                        if not p.startswith(prefix):
                            continue
                        rest = p[len(prefix):]
                        if "/" in rest:
                            dirs.add(prefix + rest.split("/")[0])
                            continue
                        sha = hashlib.sha256(f.read_bytes()).hexdigest()
                        size = f.stat().st_size
                        out.append({"type": "file", "oid": hashlib.sha1(sha.encode()).hexdigest(), "size": size,
                                    "path": p, "lfs": {"oid": sha, "size": size, "pointerSize": 134}})
                    out += [{"type": "directory", "oid": "0" * 40, "size": 0, "path": d} for d in sorted(dirs)]
                    if not out and sub:
                        return self._not_found(f"{sub} not found")
                    return self._json(out)
                if sub not in files:
                    return self._not_found(f"{sub} not found")
                data = files[sub].read_bytes()
                sha = hashlib.sha256(data).hexdigest()
                start = 0
                rng = self.headers.get("Range")
                if not head:
                    hub.gets.append(sub)
                    if rng:
                        hub.ranges.append((sub, rng))
                        m = re.match(r"bytes=(\d+)-", rng)
                        start = int(m.group(1)) if m else 0
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{sha}"')
                self.send_header("X-Linked-Etag", f'"{sha}"')
                self.send_header("X-Linked-Size", str(len(data)))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(data) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if head:
                    return
                body = data[start:]
                try:
                    if sub in hub.stall:
                        self.wfile.write(body[:hub.stall.pop(sub)])
                        self.wfile.flush()
                        hub.stop.wait(120)
                    else:
                        self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *a):
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()
