"""The evaluation texts of the acceptance rule, rebuilt by a command.

* ``python-reference``: the Python language reference's topics as the
  running Python ships them (``pydoc_data.topics``), in key order, one
  topic after another under its name. Offline; its bytes depend on the
  Python version, which is recorded next to its SHA-256.
* Texts named in a manifest (JSON ``{"texts": [{"name", "url", "sha256"}]}``,
  e.g. Wikipedia revisions by ``oldid`` and files of a tagged Kubernetes
  release), fetched by URL when online and each checked against its
  SHA-256 before it is written; a mismatch writes nothing.
"""
from __future__ import annotations

import hashlib
import os
import platform
import re
import urllib.error
import urllib.request
from pathlib import Path

from ..errors import FleError
from ..files import write_bytes_atomic

__all__ = ["python_reference", "read_manifest", "fetch", "MAX_TEXT_BYTES"]

MAX_TEXT_BYTES = 256 << 20
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_SHA = re.compile(r"^[0-9a-f]{64}$")


def python_reference() -> bytes:
    from pydoc_data.topics import topics

    parts = [f"{key}\n{'=' * len(key)}\n\n{topics[key].strip()}\n" for key in sorted(topics)]
    return "\n".join(parts).encode("utf-8")


def read_manifest(path: str) -> list[dict]:
    from ..textio import read_json_file

    obj, _ = read_json_file(path, "text manifest")
    texts = obj.get("texts") if isinstance(obj, dict) else None
    if not isinstance(texts, list) or not texts:
        raise FleError(f"{path}: field 'texts' must be a non-empty list of {{name, url, sha256}}")
    seen = set()
    for k, t in enumerate(texts):
        where = f"{path}: texts[{k}]"
        if not isinstance(t, dict):
            raise FleError(f"{where} is not an object with name, url and sha256")
        name, url, sha = t.get("name"), t.get("url"), t.get("sha256")
        if not isinstance(name, str) or not _NAME.match(name) or name == "python-reference":
            raise FleError(f"{where}.name {name!r}: give a file name of letters, digits, '.', '_' or '-'")
        if name in seen:
            raise FleError(f"{where}.name {name!r} appears twice")
        seen.add(name)
        if not isinstance(url, str) or not url.startswith(("https://", "http://")):
            raise FleError(f"{where}.url {url!r}: give an http(s) URL")
        if not isinstance(sha, str) or not _SHA.match(sha):
            raise FleError(f"{where}.sha256: give the text's SHA-256 as 64 lower-case hex digits")
    return texts


def fetch(url: str, name: str, timeout: float = 120.0) -> bytes:
    req = urllib.request.Request(url, headers={"User-Agent": "fle-accept texts"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = r.read(MAX_TEXT_BYTES + 1)
    except urllib.error.HTTPError as e:
        raise FleError(f"text {name}: {url} answered HTTP {e.code}; check the manifest's url") from None
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise FleError(f"text {name}: cannot fetch {url} ({getattr(e, 'reason', e)}); this needs a network "
                       "connection") from None
    if len(data) > MAX_TEXT_BYTES:
        raise FleError(f"text {name}: {url} is larger than {MAX_TEXT_BYTES:,} bytes; check the url")
    return data


def build(out_dir: str, manifest: str | None, force: bool, log=print) -> list[tuple[str, str]]:
    """Write the texts into ``out_dir``; (file, sha256) each."""
    d = Path(out_dir)
    if d.exists() and not d.is_dir():
        raise FleError(f"{out_dir}: exists and is not a folder; give a folder for the texts")
    entries = read_manifest(manifest) if manifest else []
    fetched = []
    for t in entries:
        data = fetch(t["url"], t["name"])
        got = hashlib.sha256(data).hexdigest()
        if got != t["sha256"]:
            raise FleError(f"text {t['name']}: {t['url']} has SHA-256 {got}, the manifest says {t['sha256']}; "
                           "the source changed or the manifest is wrong; nothing was written")
        fetched.append((t["name"] + ".txt", data))
    d.mkdir(parents=True, exist_ok=True)
    out = []
    py = python_reference()
    for name, data in [("python-reference.txt", py)] + fetched:
        write_bytes_atomic(d / name, data, force)
        sha = hashlib.sha256(data).hexdigest()
        out.append((str(d / name), sha))
        extra = f" (Python {platform.python_version()})" if name == "python-reference.txt" else ""
        log(f"wrote {d / name}: {len(data):,} bytes, sha256 {sha}{extra}")
    return out
