"""Small JSON and text files that users hand to FLE and get back from it
(sensitivity tables, selections, scores, model cards): strict reading with
one-line errors, and atomic writing that never leaves a partial file."""
from __future__ import annotations

import json
import math
import os
import re
from typing import Any

from .errors import FleError
from .files import check_input, write_bytes_atomic


def _no_duplicate_keys(label: str):
    def hook(pairs):
        out = {}
        for k, v in pairs:
            if k in out:
                raise FleError(f"{label}: key {k!r} appears twice in one object")
            out[k] = v
        return out

    return hook


def read_bytes_file(path: "str | os.PathLike[str]", what: str, max_bytes: int | None = None,
                    record: bool = True) -> bytes:
    """The bytes of a user's input file, or one line saying why not: a
    regular file only (see :func:`fle_quant.files.check_input`), at most
    ``max_bytes`` long when given. ``record``: count it as an input of the
    running command (a file the command may then not write)."""
    label = os.fspath(path)
    st = check_input(path, what) if record else _check_unrecorded(path, what)
    if max_bytes is not None and st.st_size > max_bytes:
        raise FleError(f"{label}: {st.st_size:,} bytes, more than a {what} can be ({max_bytes:,}); "
                       "give the right file")
    try:
        with open(path, "rb") as f:
            return f.read() if max_bytes is None else f.read(max_bytes + 1)
    except IsADirectoryError:
        raise FleError(f"{label}: is a directory; give the {what}") from None
    except OSError as e:
        raise FleError(f"{label}: cannot read it ({e.strerror}); give the {what}") from None


def _check_unrecorded(path, what):
    from .files import command_scope

    with command_scope():  # a scope of its own: the running command's inputs stay as they are
        return check_input(path, what)


def read_text_file(path: "str | os.PathLike[str]", what: str = "UTF-8 text") -> str:
    """A UTF-8 text file (a calibration or evaluation text), decoded."""
    raw = read_bytes_file(path, what)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FleError(f"{os.fspath(path)}: not UTF-8 text (byte {e.start}); convert it to UTF-8") from None


MAX_JSON_BYTES = 64 << 20
MAX_JSON_DEPTH = 64
MAX_INT_DIGITS = 40

_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')


def _depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text (strings skipped)."""
    import numpy as np

    bare = np.frombuffer(_STRINGS.sub(b'""', raw), dtype=np.uint8)
    step = np.zeros(bare.shape, np.int32)
    step[(bare == ord("[")) | (bare == ord("{"))] = 1
    step[(bare == ord("]")) | (bare == ord("}"))] = -1
    return int(np.cumsum(step).max(initial=0))


def parse_json(raw: bytes, label: str, what: str) -> Any:
    """Strict JSON: UTF-8, no repeated keys, at most ``MAX_JSON_DEPTH``
    levels of nesting, integers of at most ``MAX_INT_DIGITS`` digits, finite
    numbers only (no NaN, Infinity or 1e400)."""
    def bad_int(text: str) -> int:
        if len(text.lstrip("-")) > MAX_INT_DIGITS:
            raise FleError(f"{label}: an integer with {len(text)} digits; a {what} holds no numbers that large")
        return int(text)


    depth = _depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise FleError(f"{label}: nested {depth} levels deep, more than a {what} ever is ({MAX_JSON_DEPTH}); "
                       "give the right file")
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys(label), parse_int=bad_int)
    except UnicodeDecodeError:
        raise FleError(f"{label}: not a {what} (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise FleError(f"{label}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise FleError(f"{label}: nested too deeply; give the right file") from None
    where = _non_finite(obj)
    if where is not None:
        raise FleError(f"{label}: {where[0] or 'the value'} is {where[1]}; a {what} holds finite numbers only")
    return obj


def _non_finite(obj: Any, path: str = "") -> "tuple[str, str] | None":
    """(where, what) of the first NaN or infinite number (NaN, Infinity or
    1e400 in the text), e.g. ``("layers['2'][5]", "NaN")``."""
    stack = [(obj, path)]
    while stack:
        o, p = stack.pop()
        if isinstance(o, float) and not math.isfinite(o):
            return p, "NaN" if o != o else ("infinite" if o > 0 else "minus infinite")
        if isinstance(o, dict):
            stack.extend((v, f"{p}[{k!r}]" if p else str(k)) for k, v in reversed(list(o.items())))
        elif isinstance(o, list):
            stack.extend((v, f"{p}[{i}]") for i, v in reversed(list(enumerate(o))))
    return None


def read_json_file(path: "str | os.PathLike[str]", what: str, missing_hint: str | None = None,
                   max_bytes: int = MAX_JSON_BYTES, record: bool = True) -> tuple[Any, bytes]:
    """Decode a JSON file with :func:`parse_json`; returns the object and the
    raw bytes (for hashing). ``what`` names the file's role in messages
    ("sensitivity table"); ``missing_hint`` replaces the default advice when
    the file does not exist; ``max_bytes`` bounds its size."""
    label = os.fspath(path)
    if missing_hint and not os.path.lexists(path):
        raise FleError(f"{label}: no such file; {missing_hint}")
    raw = read_bytes_file(path, f"{what} JSON file", max_bytes=max_bytes, record=record)
    return parse_json(raw, label, what), raw


def write_text_atomic(path: "str | os.PathLike[str]", text: str, force: bool = False) -> None:
    """Write ``text`` through :class:`fle_quant.files.OutputSet`: under a
    temporary name next to ``path``, fsynced, then renamed. Without ``force``
    an existing ``path`` is never replaced, not even one another FLE run
    writes meanwhile; an output naming an input of the command is refused."""
    write_bytes_atomic(path, text.encode("utf-8"), force)


def write_json_atomic(path: "str | os.PathLike[str]", obj: Any, force: bool = False) -> None:
    """``obj`` as indented JSON, written with :func:`write_text_atomic`."""
    write_text_atomic(path, json.dumps(obj, indent=1) + "\n", force)
