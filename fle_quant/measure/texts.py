"""The evaluation texts of the acceptance rule and the comparison, rebuilt
by a command from a manifest.

A manifest (JSON, ``fle.texts/1``) lists texts, each either

* ``builtin: "python-reference"``: the Python language reference's topics
  as the running Python ships them (``pydoc_data.topics``), in key order,
  one topic after another under its name. Offline; its bytes depend on the
  Python version, so its SHA-256 is kept per version
  (``sha256_by_python``); or
* ``url``: fetched when online and checked against ``sha256`` before
  anything is written; a mismatch writes nothing. An entry whose hash is
  not known (``sha256: null``, unpinned) is fetched only with ``--record``,
  which writes a copy of the manifest with the hashes it saw; rebuilding
  from that copy checks them.

Texts with the same ``part_of`` are also written joined, in manifest
order with one blank line between them, as ``PART.txt`` (the report's W is
four articles, its K seven files). The project's manifest of the report's
public texts is ``data/report-texts.json``: what the report states
(sources, revisions, sizes) and, honestly marked, what it does not.
"""
from __future__ import annotations

import copy
import hashlib
import platform
import re
import time
import urllib.error
import urllib.request
from importlib import resources
from pathlib import Path

from ..errors import FleError

__all__ = ["python_reference", "read_manifest", "report_manifest", "fetch", "build", "MAX_TEXT_BYTES",
           "FORMAT", "REPORT_MANIFEST"]

FORMAT = "fle.texts/1"
REPORT_MANIFEST = "report"
MAX_TEXT_BYTES = 256 << 20
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_SHA = re.compile(r"^[0-9a-f]{64}$")
_BUILTINS = ("python-reference",)
_TOP = {"format", "note", "recorded", "texts"}
_FIELDS = {"name", "url", "builtin", "sha256", "sha256_by_python", "part_of", "pinned", "license", "source",
           "note", "report_size"}


def python_reference() -> bytes:
    from pydoc_data.topics import topics

    parts = [f"{key}\n{'=' * len(key)}\n\n{topics[key].strip()}\n" for key in sorted(topics)]
    return "\n".join(parts).encode("utf-8")


def _check_manifest(obj, label: str) -> list[dict]:
    if not isinstance(obj, dict):
        raise FleError(f"{label}: not a JSON object with a 'texts' list")
    extra = sorted(set(obj) - _TOP)
    if extra:
        raise FleError(f"{label}: unknown field {extra[0]!r}; a manifest has {', '.join(sorted(_TOP))}")
    if obj.get("format", FORMAT) != FORMAT:
        raise FleError(f"{label}: field 'format' is {obj['format']!r}; this FLE reads {FORMAT!r}")
    texts = obj.get("texts")
    if not isinstance(texts, list) or not texts:
        raise FleError(f"{label}: field 'texts' must be a non-empty list of {{name, url, sha256}}")
    seen: set[str] = set()
    for k, t in enumerate(texts):
        where = f"{label}: texts[{k}]"
        if not isinstance(t, dict):
            raise FleError(f"{where} is not an object with name, url and sha256")
        extra = sorted(set(t) - _FIELDS)
        if extra:
            raise FleError(f"{where}: unknown field {extra[0]!r}; a text has {', '.join(sorted(_FIELDS))}")
        name, url, builtin = t.get("name"), t.get("url"), t.get("builtin")
        if not isinstance(name, str) or not _NAME.match(name) or (name in _BUILTINS and not builtin):
            raise FleError(f"{where}.name {name!r}: give a file name of letters, digits, '.', '_' or '-'")
        if name in seen:
            raise FleError(f"{where}.name {name!r} appears twice")
        seen.add(name)
        if (url is None) == (builtin is None):
            raise FleError(f"{where} ({name}): give either 'url' or 'builtin' (\"python-reference\")")
        if builtin is not None and builtin not in _BUILTINS:
            raise FleError(f"{where}.builtin {builtin!r}: the built-in text is \"python-reference\"")
        if url is not None and (not isinstance(url, str) or not url.startswith(("https://", "http://"))):
            raise FleError(f"{where}.url {url!r}: give an http(s) URL")
        sha = t.get("sha256")
        if sha is not None and (not isinstance(sha, str) or not _SHA.match(sha)):
            raise FleError(f"{where}.sha256: give the text's SHA-256 as 64 lower-case hex digits, or null when "
                           "it is not known yet (then --record fetches it once and records it)")
        by_py = t.get("sha256_by_python", {})
        if not isinstance(by_py, dict) or not all(isinstance(v, str) and _SHA.match(v) for v in by_py.values()):
            raise FleError(f"{where}.sha256_by_python: give {{\"PYTHON VERSION\": \"SHA-256\"}}")
        part = t.get("part_of")
        if part is not None and (not isinstance(part, str) or not _NAME.match(part)):
            raise FleError(f"{where}.part_of {part!r}: give the joined text's file name")
    parts = {t["part_of"] for t in texts if t.get("part_of")}
    clash = sorted(parts & seen)
    if clash:
        raise FleError(f"{label}: {clash[0]!r} is both a text and a part_of name; give the joined text its own name")
    return texts


def read_manifest(path: str) -> tuple[dict, list[dict]]:
    """A manifest file, checked: (the object, its texts)."""
    from ..textio import read_json_file

    obj, _ = read_json_file(path, "text manifest")
    return obj, _check_manifest(obj, path)


def report_manifest() -> tuple[dict, list[dict]]:
    """The project's manifest of the report's public texts (E, W, K)."""
    from ..textio import parse_json

    raw = resources.files(__package__).joinpath("data/report-texts.json").read_bytes()
    obj = parse_json(raw, "report-texts.json", "text manifest")
    return obj, _check_manifest(obj, "the report's text manifest")


def fetch(url: str, name: str, timeout: float = 120.0) -> bytes:
    req = urllib.request.Request(url, headers={"User-Agent": "fle-accept texts"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = r.read(MAX_TEXT_BYTES + 1)
    except urllib.error.HTTPError as e:
        raise FleError(f"text {name}: {url} answered HTTP {e.code}; check the manifest's url") from None
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise FleError(f"text {name}: cannot fetch {url} ({getattr(e, 'reason', e)}); this needs a network "
                       "connection (--offline writes the built-in texts only)") from None
    if len(data) > MAX_TEXT_BYTES:
        raise FleError(f"text {name}: {url} is larger than {MAX_TEXT_BYTES:,} bytes; check the url")
    return data


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build(out_dir: str, manifest: str | None, force: bool, log=print, *, offline: bool = False,
          record: str | None = None) -> list[tuple[str, str]]:
    """Write the texts into ``out_dir``; (file, sha256) each. ``manifest``:
    a path, :data:`REPORT_MANIFEST` for the project's, or None (the Python
    reference only); ``record``: also write the manifest with the hashes
    of the texts it did not pin."""
    from ..files import check_outputs, write_bytes_atomic
    from ..textio import write_json_atomic

    d = Path(out_dir)
    if d.exists() and not d.is_dir():
        raise FleError(f"{out_dir}: exists and is not a folder; give a folder for the texts")
    if manifest is None:
        obj, entries = {"texts": []}, []
    elif manifest == REPORT_MANIFEST:
        obj, entries = report_manifest()
    else:
        obj, entries = read_manifest(manifest)
    obj = copy.deepcopy(obj)
    entries = obj.get("texts", [])
    if not any(t.get("builtin") for t in entries):
        entries = [{"name": "python-reference", "builtin": "python-reference"}] + entries
    online = [t for t in entries if t.get("url")]
    if offline and record:
        raise FleError("--record fetches the texts; it cannot run with --offline")
    unpinned = [t["name"] for t in online if t.get("sha256") is None]
    if unpinned and not offline and not record:
        more = f" (and {len(unpinned) - 1} more)" if len(unpinned) > 1 else ""
        raise FleError(f"text {unpinned[0]}{more}: the manifest has no SHA-256 for it (unpinned); fetch once with "
                       "--record FILE, which writes the manifest with the hashes it saw, then rebuild from FILE "
                       "(or --offline for the built-in texts only)")
    py = platform.python_version()
    got: list[tuple[dict, bytes]] = []
    for t in entries:
        if t.get("builtin"):
            data = python_reference()
            want = (t.get("sha256_by_python") or {}).get(py)
            if want is not None and want != _sha(data):
                raise FleError(f"text {t['name']}: Python {py}'s pydoc_data gives SHA-256 {_sha(data)}, the manifest "
                               f"recorded {want} for this version; nothing was written")
            if record:
                t.setdefault("sha256_by_python", {})[py] = _sha(data)
        elif offline:
            log(f"skipped {t['name']}: --offline ({t['url']})")
            continue
        else:
            data = fetch(t["url"], t["name"])
            if t.get("sha256") is None:
                t["sha256"] = _sha(data)
                log(f"recorded {t['name']}: sha256 {t['sha256']} (the manifest did not pin it)")
            elif _sha(data) != t["sha256"]:
                raise FleError(f"text {t['name']}: {t['url']} has SHA-256 {_sha(data)}, the manifest says "
                               f"{t['sha256']}; the source changed or the manifest is wrong; nothing was written")
        got.append((t, data))
    joined: dict[str, list[bytes]] = {}
    for t, data in got:
        if t.get("part_of"):
            joined.setdefault(t["part_of"], []).append(data)
    n_parts = {}
    for t in entries:
        if t.get("part_of"):
            n_parts[t["part_of"]] = n_parts.get(t["part_of"], 0) + 1
    files = [(t["name"] + ".txt", data) for t, data in got]
    files += [(p + ".txt", b"\n\n".join(v)) for p, v in joined.items() if len(v) == n_parts[p]]
    d.mkdir(parents=True, exist_ok=True)
    check_outputs([d / n for n, _ in files] + ([record] if record else []), force)
    out = []
    for name, data in files:
        write_bytes_atomic(d / name, data, force)
        sha = _sha(data)
        out.append((str(d / name), sha))
        extra = f" (Python {py})" if any(t.get("builtin") and t["name"] + ".txt" == name for t in entries) else ""
        log(f"wrote {d / name}: {len(data):,} bytes, sha256 {sha}{extra}")
    if record:
        obj["texts"] = entries
        obj["recorded"] = f"{time.strftime('%Y-%m-%d', time.gmtime())} by fle-accept texts --record (Python {py})"
        write_json_atomic(record, obj, force)
        log(f"wrote {record}: the manifest with the SHA-256 of every text fetched")
    return out
