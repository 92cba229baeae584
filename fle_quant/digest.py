"""SHA-256 of input files, streamed, and remembered so that a 90 GB model is
hashed once.

``sha256_file(path)`` hashes one file; ``sha256_model(paths)`` hashes a model
that may be split into llama.cpp shards and returns its *logical* digest:

- a single file: the plain SHA-256 of the file (what ``sha256sum`` prints);
- split into shards: the SHA-256 of the concatenation of the shards' raw
  32-byte SHA-256 digests, in shard order (``sha256(d1 || d2 || ... || dN)``),
  so a reader can check it from the per-shard ``sha256sum`` lines alone.

Digests are cached in a JSON file, ``$FLE_CACHE_DIR/digests.json`` (default
``~/.cache/fle/digests.json``), keyed by the file's absolute resolved path
with its size and modification time in nanoseconds: a file that is
rewritten, even with the same size, is hashed again. The cache is written
atomically (a temporary file in the cache directory, then a rename); a
corrupt or unreadable cache is ignored and rewritten. Inputs and their
directories are only ever read.

Cache format ``fle.digests/1``::

    {"format": "fle.digests/1",
     "files": {"/abs/path/model.gguf": {"size": 123, "mtime_ns": 456, "sha256": "..."}}}
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from .errors import FleError

__all__ = ["cache_file", "combine_shard_digests", "sha256_file", "sha256_model"]

CACHE_FORMAT = "fle.digests/1"
_CHUNK = 16 << 20


def cache_file() -> Path:
    """Where digests are remembered: ``$FLE_CACHE_DIR/digests.json``, else
    ``~/.cache/fle/digests.json``."""
    root = os.environ.get("FLE_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "fle"
    return base / "digests.json"


def _load_cache(path: Path) -> dict[str, dict]:
    """The cached entries; empty for a missing, unreadable or corrupt cache."""
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    if not isinstance(obj, dict) or obj.get("format") != CACHE_FORMAT or not isinstance(obj.get("files"), dict):
        return {}
    return {k: v for k, v in obj["files"].items() if isinstance(v, dict)}


def _store(path: Path, key: str, entry: dict) -> None:
    """Add one entry, re-reading the cache first so that concurrent runs
    lose at most each other's newest entry, never the file's integrity."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        files = _load_cache(path)
        files[key] = entry
        data = json.dumps({"format": CACHE_FORMAT, "files": files}, indent=1, sort_keys=True).encode()
        fd, tmp = tempfile.mkstemp(prefix=".digests-", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        # the cache only saves time; the digest itself is correct either way
        print(f"warning: cannot update the digest cache {path} ({e.strerror or e}); "
              "the file will be hashed again next time", file=sys.stderr)


def _entry_matches(entry: dict, st: os.stat_result) -> bool:
    sha = entry.get("sha256")
    return (entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns
            and isinstance(sha, str) and len(sha) == 64)


def _hash_file(path: Path, size: int, progress: bool) -> str:
    """Stream ``path`` through SHA-256: the hash of one 16 MiB chunk runs in a
    worker thread (hashlib releases the GIL) while the next is read."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=size, unit="B", unit_scale=True, unit_divisor=1024, desc=f"sha256 {path.name}",
                   file=sys.stderr, disable=not sys.stderr.isatty(), leave=False)
    h = hashlib.sha256()
    bufs = [bytearray(_CHUNK), bytearray(_CHUNK)]
    turn = 0
    pending: Future | None = None
    try:
        with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(1, thread_name_prefix="fle-digest") as pool:
            while True:
                view = memoryview(bufs[turn])
                n = f.readinto(view)
                if pending is not None:
                    pending.result()
                if not n:
                    pending = None
                    break
                pending = pool.submit(h.update, view[:n])
                if bar is not None:
                    bar.update(n)
                turn ^= 1
    except OSError as e:
        raise FleError(f"{path}: cannot read it to compute its SHA-256 ({e.strerror})") from None
    finally:
        if bar is not None:
            bar.close()
    return h.hexdigest()


def sha256_file(path: "str | os.PathLike[str]", *, use_cache: bool = True, progress: bool = True) -> str:
    """Hex SHA-256 of the file ``path``, from the cache when its size and
    modification time are unchanged since it was last hashed."""
    path = Path(path)
    try:
        st = path.stat()
        key = str(path.resolve())
    except OSError as e:
        raise FleError(f"{path}: cannot stat it ({e.strerror})") from None
    cache = cache_file()
    if use_cache:
        entry = _load_cache(cache).get(key)
        if entry is not None and _entry_matches(entry, st):
            return entry["sha256"]
    digest = _hash_file(path, st.st_size, progress)
    after = path.stat()
    if (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
        raise FleError(f"{path}: the file changed while it was being hashed; wait until it is complete")
    if use_cache:
        _store(cache, key, {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest})
    return digest


def combine_shard_digests(shard_digests: Sequence[str]) -> str:
    """The logical digest of a model from its shards' hex digests (see the
    module docstring); a single file's digest is returned unchanged."""
    if len(shard_digests) == 1:
        return shard_digests[0]
    return hashlib.sha256(b"".join(bytes.fromhex(d) for d in shard_digests)).hexdigest()


def sha256_model(paths: Sequence["str | os.PathLike[str]"], *, use_cache: bool = True,
                 progress: bool = True) -> str:
    """Logical SHA-256 of a model given as its shard paths in order."""
    if not paths:
        raise FleError("no files to hash")
    return combine_shard_digests([sha256_file(p, use_cache=use_cache, progress=progress) for p in paths])


def model_fingerprint(model) -> str:
    """SHA-256 (hex) of a model's expert layout and shard sizes: what tells
    the files of one model from another's of the same shape (score tables,
    expert cache profiles). ``model``: a path or an open GGUFModel."""
    from .gguf_reader import GGUFModel

    if not isinstance(model, GGUFModel):
        with GGUFModel.open(model) as g:
            return model_fingerprint(g)
    h = hashlib.sha256(str(model.arch).encode())
    for t in sorted(model.tensors.values(), key=lambda t: t.name):
        if "_exps." in t.name or t.name.endswith(".ffn_gate_inp.weight"):
            h.update(f"|{t.name}:{list(t.shape)}:{int(t.qtype)}".encode())
    for p in model.paths:
        h.update(f"|{Path(p).stat().st_size}".encode())
    return h.hexdigest()

