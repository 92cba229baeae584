"""Small JSON and text files that users hand to FLE and get back from it
(sensitivity tables, selections, scores, model cards): strict reading with
one-line errors, and atomic writing that never leaves a partial file."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from typing import Any

from .errors import FleError


def _no_duplicate_keys(label: str):
    def hook(pairs):
        out = {}
        for k, v in pairs:
            if k in out:
                raise FleError(f"{label}: key {k!r} appears twice in one object")
            out[k] = v
        return out

    return hook


def read_bytes_file(path: "str | os.PathLike[str]", what: str) -> bytes:
    """The bytes of a user's input file, or one line saying why not."""
    label = os.fspath(path)
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise FleError(f"{label}: no such file; give the {what}") from None
    except IsADirectoryError:
        raise FleError(f"{label}: is a directory; give the {what}") from None
    except OSError as e:
        raise FleError(f"{label}: cannot read it ({e.strerror})") from None


def read_text_file(path: "str | os.PathLike[str]", what: str = "UTF-8 text") -> str:
    """A UTF-8 text file (a calibration or evaluation text), decoded."""
    raw = read_bytes_file(path, what)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FleError(f"{os.fspath(path)}: not UTF-8 text (byte {e.start}); convert it to UTF-8") from None


def read_json_file(path: "str | os.PathLike[str]", what: str, missing_hint: str | None = None) -> tuple[Any, bytes]:
    """Decode a UTF-8 JSON file whose objects have no repeated keys; returns
    the object and the raw bytes (for hashing). ``what`` names the file's
    role in messages ("sensitivity table"); ``missing_hint`` replaces the
    default advice when the file does not exist."""
    label = os.fspath(path)
    if missing_hint and not os.path.lexists(path):
        raise FleError(f"{label}: no such file; {missing_hint}")
    raw = read_bytes_file(path, f"{what} JSON file")
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys(label))
    except UnicodeDecodeError:
        raise FleError(f"{label}: not a {what} (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise FleError(f"{label}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    return obj, raw


def write_text_atomic(path: "str | os.PathLike[str]", text: str, force: bool = False) -> None:
    """Write ``text`` under a temporary name next to ``path``, fsync, and put
    it in place. Without ``force`` an existing ``path`` is never replaced,
    not even one that appears while writing."""
    path = os.fspath(path)
    exists = f"{path}: exists; choose another name or pass --force to replace it"
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FleError(f"{path}: the folder {directory} does not exist")
    if os.path.isdir(path):
        raise FleError(f"{path}: is a directory; give a file name")
    if not force and os.path.exists(path):
        raise FleError(exists)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if force:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)  # fails if the name appeared meanwhile
        except FileExistsError:
            raise FleError(exists) from None
        except OSError:
            # file systems without hard links: check, then rename
            if os.path.exists(path):
                raise FleError(exists) from None
            os.replace(tmp, path)
        else:
            os.unlink(tmp)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise FleError(f"{path}: disk full while writing it; free space and run again") from None
        raise FleError(f"{path}: cannot write it ({e.strerror})") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def write_json_atomic(path: "str | os.PathLike[str]", obj: Any, force: bool = False) -> None:
    """``obj`` as indented JSON, written with :func:`write_text_atomic`."""
    write_text_atomic(path, json.dumps(obj, indent=1) + "\n", force)
