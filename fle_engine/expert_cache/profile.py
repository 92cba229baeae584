"""Usage profiles of the expert cache: aged request counts per layer and
expert, saved by a running engine and loaded at the next start (warm
start), or made from a ``fle-reap score --method frequency`` table.

A profile names the model it was measured on by a fingerprint of the
model's expert layout (architecture, expert tensor names, shapes and types,
shard sizes): loading it for another model is refused, since its counts
would rank the wrong experts.

Format (JSON): ``{"format": "fle.cache-profile/1", "fingerprint": HEX,
"layers": {"0": [counts...], ...}}``.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fle_quant.digest import model_fingerprint  # noqa: F401 - part of this module's API
from fle_quant.errors import FleError
from fle_quant.gguf_reader import GGUFModel
from fle_quant.textio import read_json_file, write_json_atomic

__all__ = ["Profile", "model_fingerprint", "save_profile", "load_profile", "profile_from_scores"]

FORMAT = "fle.cache-profile/1"


@dataclass
class Profile:
    fingerprint: str
    counts: dict[int, np.ndarray]


def save_profile(path: "str | os.PathLike[str]", profile: Profile) -> None:
    write_json_atomic(path, {"format": FORMAT, "fingerprint": profile.fingerprint,
                             "layers": {str(l): [float(x) for x in c] for l, c in sorted(profile.counts.items())}},
                      force=True)


def load_profile(path: "str | os.PathLike[str]", fingerprint: "str | None" = None) -> Profile:
    """Read a profile; with ``fingerprint``, refuse one made for another model."""
    data, _ = read_json_file(path, "expert cache profile", record=False)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise FleError(f"{path}: not an expert cache profile (format {FORMAT!r} expected)")
    fp = data.get("fingerprint")
    if fingerprint is not None and fp != fingerprint:
        raise FleError(f"{path}: the profile was written for another model (fingerprint {str(fp)[:12]}..., "
                       f"this model {fingerprint[:12]}...); start without it or remove it")
    layers = data.get("layers")
    if not isinstance(layers, dict):
        raise FleError(f"{path}: 'layers' must map layer numbers to lists of counts")
    counts = {}
    for k, v in layers.items():
        try:
            arr = np.asarray(v, np.float64)
            layer = int(k)
        except (TypeError, ValueError):
            raise FleError(f"{path}: layer {k!r} must be a number with a list of counts") from None
        if arr.ndim != 1 or not np.isfinite(arr).all() or (arr < 0).any():
            raise FleError(f"{path}: layer {k}: counts must be a list of finite numbers >= 0")
        counts[layer] = arr
    return Profile(str(fp), counts)


def profile_from_scores(table: dict, fingerprint: str) -> Profile:
    """A profile from a ``fle-reap score --method frequency`` table (routing
    frequencies per layer and expert; only their ranking matters)."""
    from fle_quant.prune import parse_scores

    scores = parse_scores(table)
    if scores.method != "frequency":
        raise FleError(f"a cache profile needs routing frequencies (--method frequency), not {scores.method!r} scores")
    return Profile(fingerprint, {l: np.asarray(v, np.float64) for l, v in scores.layers.items()})
