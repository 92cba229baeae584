"""Sequence state snapshots and the RAM prompt cache.

A snapshot holds everything a sequence carries at its first ``n``
positions: each attention layer's keys and values (and an indexer key, as
qwen4exp's QSA layers keep) up to ``n``, and whole the state that does not
grow with the sequence -- a GDN layer's conv history and recurrent matrix,
qwen4exp's PLE token and conv history. (The hyper-connection streams are
per-token activations, not carried state.) Restoring it into a state made
for the same model gives the sequence back exactly; positions past ``n``
may hold stale keys, which attention masks by position.

A state whose every layer is attention can also be cut back to any shorter
prefix in place (:func:`truncatable`); a recurrent one only to a snapshot.

On the engine's lanes the cache and the slot files hold a lane's snapshot
instead (:class:`~fle_engine.runtime.engine.LaneSnapshot`, from
``runtime.Engine.lane_snapshot``: the same parts, copied from the lane's
rows to host memory), with the same byte count (``nbytes``) and rules.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fle_quant.errors import FleError

from .. import layers as L

__all__ = ["Snapshot", "snapshot", "restore", "truncatable", "carried_parts", "PromptCache", "common_prefix",
           "usable_prefix"]

_STATE_SKIP = {"max_tokens", "pos", "layers", "rope_cos", "rope_sin", "length", "hidden", "last_tokens",
               "last_logits", "mtp"}


def _tensors(obj) -> dict[str, Tensor]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
            if isinstance(getattr(obj, f.name), Tensor)}


def carried_parts(state) -> dict[str, Any]:
    """Carried state other than the layers: dataclass fields of the state
    (qwen4exp's ``ple``) that hold tensors."""
    out = {}
    if not dataclasses.is_dataclass(state):
        return out
    for f in dataclasses.fields(state):
        v = getattr(state, f.name)
        if f.name not in _STATE_SKIP and dataclasses.is_dataclass(v) and not isinstance(v, type):
            out[f.name] = v
    return out


def truncatable(state) -> bool:
    """Whether ``state`` can be cut back to a shorter prefix in place: every
    layer attention, nothing carried beside."""
    return all(isinstance(c, L.AttnCache) for c in state.layers) and not carried_parts(state)


@dataclass
class Snapshot:
    """A sequence's state at its first ``n`` positions (see the module)."""
    n: int
    layers: list[dict[str, Tensor]]
    extra: dict[str, dict[str, Tensor]]

    @property
    def nbytes(self) -> int:
        parts = list(self.layers) + list(self.extra.values())
        return sum(t.numel() * t.element_size() for p in parts for t in p.values())

    def to_dict(self) -> dict:
        return {"n": self.n, "layers": self.layers, "extra": self.extra}

    @classmethod
    def from_dict(cls, d: dict) -> "Snapshot":
        return cls(int(d["n"]), list(d["layers"]), dict(d["extra"]))


def snapshot(state, n: int) -> Snapshot:
    """A copy of ``state``'s first ``n`` positions (``n`` = its length for
    a recurrent state; a recurrent state cannot be cut back)."""
    if n > state.length:
        raise FleError(f"snapshot of {n} positions from a state holding {state.length}")
    if n != state.length and not truncatable(state):
        raise FleError("a recurrent state can only be kept at its full length")
    layers = []
    for c in state.layers:
        parts = {}
        for name, t in _tensors(c).items():
            if isinstance(c, L.AttnCache):
                t = t[:, :n] if name in ("k", "v") else t[:n]
            parts[name] = t.detach().clone()
        layers.append(parts)
    extra = {name: {k: t.detach().clone() for k, t in _tensors(v).items()} for name, v in carried_parts(state).items()}
    return Snapshot(n, layers, extra)


def restore(snap: Snapshot, state) -> None:
    """Put ``snap`` into ``state`` (made for the same model, at least
    ``snap.n`` positions long): afterwards it holds exactly that sequence."""
    if snap.n > state.max_tokens:
        raise FleError(f"a snapshot of {snap.n} positions does not fit a state of {state.max_tokens}")
    if len(snap.layers) != len(state.layers):
        raise FleError("the snapshot is of another model (layer count differs)")
    with torch.inference_mode():
        for c, parts in zip(state.layers, snap.layers):
            have = _tensors(c)
            if have.keys() != parts.keys():
                raise FleError("the snapshot is of another model (layer kinds differ)")
            for name, src in parts.items():
                dst = have[name]
                if isinstance(c, L.AttnCache):
                    dst = dst[:, :snap.n] if name in ("k", "v") else dst[:snap.n]
                if dst.shape != src.shape:
                    raise FleError(f"the snapshot is of another model ({name}: {list(src.shape)} vs "
                                   f"{list(dst.shape)})")
                dst.copy_(src)
        extra = carried_parts(state)
        if extra.keys() != snap.extra.keys():
            raise FleError("the snapshot is of another model (carried state differs)")
        for name, obj in extra.items():
            for k, t in _tensors(obj).items():
                t.copy_(snap.extra[name][k])
        state.pos.fill_(snap.n)
    state.length = snap.n


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def usable_prefix(have: list[int], has_logits: bool, prompt: list[int], can_truncate: bool) -> int:
    """How many of ``prompt``'s tokens a state holding ``have`` serves
    without recomputing them. All of them when ``have`` is the prompt and
    its last logits are kept; a recurrent state serves only when ``have``
    is a prefix of the prompt; an attention state any common prefix (less
    one token when nothing would be left to compute)."""
    c = common_prefix(have, prompt)
    if c == len(prompt):
        if c == len(have) and has_logits:
            return c
        return c - 1 if can_truncate else 0
    if can_truncate:
        return c
    return c if c == len(have) else 0


@dataclass
class Entry:
    tokens: list[int]
    snap: Snapshot
    logits: Tensor | None
    nbytes: int
    t_used: float
    owner: int | None = None      # the protected slot whose conversation this is (see PromptCache.put)


class PromptCache:
    """Snapshots of finished sequences in RAM, at most ``limit`` bytes,
    least recently used out first. Thread-safe.

    An entry put with an ``owner`` (a protected slot's conversation, see
    the server's ``--cache-protect-slot``) is evicted only to make room for
    an entry of the same owner; other entries never push it out, and one
    that would fit only by doing so is not kept."""

    def __init__(self, limit_bytes: int):
        self.limit = int(limit_bytes)
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self._next = 0
        self._lock = threading.Lock()
        self.n_saved = self.n_evicted = self.n_hits = self.n_refused = 0

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    @property
    def size(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def put(self, tokens: list[int], snap: Snapshot, logits: Tensor | None, owner: int | None = None) -> bool:
        """Keep a sequence, pushing out the least recently used entries it may
        evict (those without an owner, and ``owner``'s own); False when it
        does not fit even so, or alone is larger than the limit. The same
        tokens kept again replace the entry, keeping its owner."""
        nbytes = snap.nbytes + (logits.numel() * logits.element_size() if logits is not None else 0)
        if not self.enabled or nbytes > self.limit or not tokens:
            return False
        with self._lock:
            same = [key for key, e in self.entries.items() if e.tokens == tokens]
            for key in same:
                if owner is None:
                    owner = self.entries[key].owner
            others = [(key, e) for key, e in self.entries.items() if key not in same]
            room = self.limit - sum(e.nbytes for _, e in others)
            evictable = [key for key, e in others if e.owner is None or e.owner == owner]   # oldest first
            freed, out = 0, []
            for key in evictable:
                if room + freed >= nbytes:
                    break
                freed += self.entries[key].nbytes
                out.append(key)
            if room + freed < nbytes:
                self.n_refused += 1
                return False
            for key in same + out:
                del self.entries[key]
            self.n_evicted += len(out)
            self.entries[self._next] = Entry(list(tokens), snap, logits, nbytes, time.monotonic(), owner)
            self._next += 1
            self.n_saved += 1
        return True

    def best(self, prompt: list[int], can_truncate: bool) -> tuple[Entry | None, int]:
        """The entry serving most of ``prompt`` and how many tokens it serves."""
        best, best_n = None, 0
        with self._lock:
            for key, e in self.entries.items():
                n = usable_prefix(e.tokens, e.logits is not None, prompt, can_truncate)
                if n > best_n:
                    best, best_n = (key, e), n
            if best is None:
                return None, 0
            self.entries.move_to_end(best[0])       # most recently used
            best[1].t_used = time.monotonic()
            self.n_hits += 1
            return best[1], best_n

    def info(self) -> dict:
        with self._lock:
            return {"n_entries": len(self.entries), "size_bytes": self.size, "limit_bytes": self.limit,
                    "n_saved": self.n_saved, "n_evicted": self.n_evicted, "n_hits": self.n_hits,
                    "n_refused": self.n_refused,
                    "n_protected": sum(e.owner is not None for e in self.entries.values())}


def save_file(path: str, tokens: list[int], snap: Snapshot, logits: Tensor | None, arch: str) -> int:
    tmp = path + ".tmp"
    torch.save({"format": "fle-slot-1", "arch": arch, "tokens": list(tokens), "snap": snap.to_dict(),
                "logits": logits}, tmp)
    os.replace(tmp, path)
    return os.path.getsize(path)


def load_file(path: str, arch: str, lanes: bool = False) -> tuple[list[int], Any, Tensor | None, int]:
    """(tokens, snapshot, logits, file size) of a slot file: a :class:`Snapshot`
    of the reference path, or with ``lanes`` a lane's
    (:class:`~fle_engine.runtime.engine.LaneSnapshot`); a file of the other
    kind is refused."""
    try:
        d = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FleError(f"no saved slot file {os.path.basename(path)!r}") from None
    except Exception as e:  # noqa: BLE001 - a file that is not a slot file
        raise FleError(f"{os.path.basename(path)}: not a saved slot ({type(e).__name__})") from None
    if not isinstance(d, dict) or d.get("format") != "fle-slot-1":
        raise FleError(f"{os.path.basename(path)}: not a saved slot")
    if d.get("arch") != arch:
        raise FleError(f"{os.path.basename(path)}: saved from a {d.get('arch')} model, this one is {arch}")
    is_lane = isinstance(d.get("snap"), dict) and d["snap"].get("kind") == "lane"
    if is_lane != lanes:
        where = ("the engine's lanes", "the reference path")
        raise FleError(f"{os.path.basename(path)}: saved on {where[not is_lane]}; this server runs on "
                       f"{where[not lanes]}")
    if lanes:
        from ..runtime.engine import LaneSnapshot

        snap = LaneSnapshot.from_dict(d["snap"])
        if snap.tokens != [int(t) for t in d["tokens"]]:
            raise FleError(f"{os.path.basename(path)}: not a saved slot (its tokens disagree)")
    else:
        snap = Snapshot.from_dict(d["snap"])
    return list(d["tokens"]), snap, d.get("logits"), os.path.getsize(path)
