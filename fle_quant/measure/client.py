"""A small OpenAI-compatible HTTP client (standard library only) and the
server start/stop handling the measurement commands share."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from ..errors import FleError

__all__ = ["chat", "ChatReply", "ServerArm", "normalize_url"]


def normalize_url(url: str, where: str) -> str:
    if not (url.startswith("http://") or url.startswith("https://")):
        raise FleError(f"{where}: {url!r} is not an http:// or https:// base URL (e.g. http://127.0.0.1:8080)")
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    return url


@dataclass
class ChatReply:
    """One chat completion as the bracket and the probe need it."""

    ok: bool
    text: str = ""
    finish_reason: str = ""
    completion_tokens: int = 0
    wall_s: float = 0.0
    timings: dict = field(default_factory=dict)
    error: str = ""


def chat(base: str, body: dict, timeout: float) -> ChatReply:
    """POST ``body`` to ``base/v1/chat/completions`` (not streamed)."""
    data = json.dumps({**body, "stream": False}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        try:
            detail = e.read()[:300].decode("utf-8", "replace")
        except OSError:
            detail = ""
        return ChatReply(False, wall_s=time.perf_counter() - t0, error=f"HTTP {e.code}: {detail}".strip())
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        return ChatReply(False, wall_s=time.perf_counter() - t0, error=f"request failed: {getattr(e, 'reason', e)}")
    wall = time.perf_counter() - t0
    try:
        obj = json.loads(raw)
        choice = obj["choices"][0]
        msg = choice.get("message") or {}
        usage = obj.get("usage") or {}
        timings = obj.get("timings") if isinstance(obj.get("timings"), dict) else {}
        return ChatReply(True, msg.get("content") or "", choice.get("finish_reason") or "",
                         int(usage.get("completion_tokens") or 0), wall, timings)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return ChatReply(False, wall_s=wall, error="the reply is not an OpenAI chat completion")


def _ready(base: str) -> bool:
    for path in ("/health", "/v1/models"):
        try:
            with urllib.request.urlopen(base + path, timeout=5) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError, TimeoutError):
            continue
    return False


@dataclass
class ServerArm:
    """A server under test: its base URL and, optionally, the shell commands
    that start and stop it. A started server is waited for (``/health`` or
    ``/v1/models`` answering); without a stop command the started process
    group is sent SIGTERM."""

    name: str
    url: str
    start: str | None = None
    stop: str | None = None
    start_timeout: float = 600.0
    _proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerArm":
        if self.start:
            self._proc = subprocess.Popen(self.start, shell=True, start_new_session=True,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + self.start_timeout
            while time.monotonic() < deadline:
                if _ready(self.url):
                    return self
                if self._proc.poll() is not None:
                    rc = self._proc.returncode
                    self._proc = None
                    raise FleError(f"arm {self.name}: its start command exited with status {rc} before "
                                   f"{self.url} answered; check the command")
                time.sleep(0.5)
            self._halt()
            raise FleError(f"arm {self.name}: {self.url} did not answer within {self.start_timeout:g} s of "
                           "its start command; raise --start-timeout or check the command")
        if not _ready(self.url):
            raise FleError(f"arm {self.name}: nothing answers at {self.url} (/health, /v1/models); "
                           "start the server or give --start for the arm")
        return self

    def _halt(self) -> None:
        if self.stop:
            subprocess.run(self.stop, shell=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=120, check=False)
        if self._proc is not None:
            if self._proc.poll() is None:
                try:
                    os.killpg(self._proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    self._proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(self._proc.pid, signal.SIGKILL)
                    self._proc.wait()
            self._proc = None

    def __exit__(self, *exc) -> None:
        if self.start or self.stop:
            self._halt()
