"""Byte sizes as users write them: ``48G``, ``88.9GB``, ``16MB``, ``512MiB``.

Decimal units (K, M, G, T with or without a trailing B) follow llama.cpp's
``gguf-split --split-max-size`` and Hugging Face's file sizes (1 G = 10^9);
binary units need the ``i`` (1 GiB = 2^30).
"""
from __future__ import annotations

import re

from .errors import FleError

_UNITS = {
    "": 1, "B": 1,
    "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6,
    "G": 10**9, "GB": 10**9, "T": 10**12, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_size(text: "str | int", what: str = "size") -> int:
    """Parse a size into bytes; a clear FleError for anything else."""
    if isinstance(text, int):
        if text < 0:
            raise FleError(f"{what} must not be negative, got {text}")
        return text
    m = _RE.match(str(text))
    unit = m.group(2).upper() if m else None
    if not m or unit not in _UNITS:
        raise FleError(f"{what} {text!r} is not a size; write e.g. 48G, 88.9GB, 16MB or 512MiB")
    return int(round(float(m.group(1)) * _UNITS[unit]))


def format_size(n_bytes: int) -> str:
    """Decimal, three significant figures past the unit: ``88.87 GB``."""
    n = float(n_bytes)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")
