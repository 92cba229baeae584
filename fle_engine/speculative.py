"""Speculative decoding with the model's own MTP head: the head drafts the
token after the next one, and one trunk call over [next, draft] checks it.

Every emitted token is sampled from the trunk's distribution, in the same
order and with the same random draws as plain decoding; the draft only
decides how many positions one trunk call settles. A draft is kept when the
token sampled at its position equals it; then the trunk's logits after it
are valid too and give one more token. Otherwise the state is rolled back
to before the check (:func:`snapshot` / :func:`restore`) and the next token
alone is run again. Greedy output is therefore identical to plain decoding,
and sampled output too up to the rounding of a two-token against a
one-token trunk call.

Rollback: attention caches (keys, values, indexer keys, the MTP head's
cache) are addressed by position and are simply overwritten later; what a
forward call changes in place otherwise -- the position counter, the gated
delta net's conv and recurrent state, the PLE token and conv history, the
MTP head's queue -- is copied before the check and written back on a
rejection.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
from torch import Tensor

from fle_quant.errors import FleError

from . import layers as L
from .mtp import draft

__all__ = ["SpecStats", "snapshot", "restore", "generate_speculative"]


def _tensor_fields(obj) -> dict[str, Tensor]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
            if isinstance(getattr(obj, f.name), Tensor)}


def snapshot(state: L.State) -> dict:
    """What a forward call changes in ``state`` in place, copied."""
    snap = {"pos": state.pos.clone(), "length": state.length,
            "hidden": state.hidden, "last_tokens": state.last_tokens, "last_logits": state.last_logits,
            "layers": [{k: v.clone() for k, v in _tensor_fields(c).items()} if isinstance(c, L.GDNState) else None
                       for c in state.layers]}
    ple = getattr(state, "ple", None)
    if ple is not None:
        snap["ple"] = {k: v.clone() for k, v in _tensor_fields(ple).items()}
    if state.mtp is not None:
        snap["mtp"] = (state.mtp.pos, list(state.mtp.queue_h), list(state.mtp.queue_tok))
    return snap


def restore(state: L.State, snap: dict) -> None:
    """Write ``snap`` back into ``state``, in place (the tensors keep their
    storage, so a captured CUDA graph still reads them)."""
    state.pos.copy_(snap["pos"])
    state.length = snap["length"]
    state.hidden, state.last_tokens, state.last_logits = snap["hidden"], snap["last_tokens"], snap["last_logits"]
    for cache, saved in zip(state.layers, snap["layers"]):
        if saved is not None:
            for k, v in saved.items():
                getattr(cache, k).copy_(v)
    if "ple" in snap:
        for k, v in snap["ple"].items():
            getattr(state.ple, k).copy_(v)
    if "mtp" in snap:
        state.mtp.pos, state.mtp.queue_h, state.mtp.queue_tok = snap["mtp"][0], list(snap["mtp"][1]), list(snap["mtp"][2])


@dataclass
class SpecStats:
    drafted: int = 0
    accepted: int = 0
    trunk_calls: int = 0     # after the prompt
    # per draft position: the checks that reached it (every draft before it right) and the right ones
    reached: list = field(default_factory=list)
    right: list = field(default_factory=list)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def by_position(self) -> list[float]:
        """Conditional acceptance of draft 1, 2, ...: right / reached (the
        report's 0.86 / 0.78 / 0.78 form)."""
        return [r / n if n else 0.0 for r, n in zip(self.right, self.reached)]

    def line(self) -> str:
        per = ", ".join(f"{i + 1}: {100 * a:.1f} % of {n}" for i, (a, n) in enumerate(zip(self.by_position(),
                                                                                         self.reached)))
        return f"acceptance by draft position (given the drafts before it were right): {per}" if per else ""

    def _check(self, i: int, ok: bool) -> None:
        while len(self.reached) <= i:
            self.reached.append(0)
            self.right.append(0)
        self.reached[i] += 1
        self.right[i] += int(ok)


def generate_speculative(model, prompt: Sequence[int], n_predict: int, sampler: Callable[[np.ndarray], int],
                         stop: Iterable[int] = (), n_batch: int = 512, n_draft: int = 1,
                         stats: "SpecStats | None" = None) -> Iterator[int]:
    """Like :func:`fle_engine.sampling.generate_tokens`, drafting up to
    ``n_draft`` tokens ahead with the model's MTP head (loaded inside the
    model file or with ``load_mtp``) and checking them in one trunk call.
    ``stats`` (optional) counts drafts and acceptances."""
    net = model.net
    if getattr(net, "mtp", None) is None:
        raise FleError(f"{model.path}: no MTP head loaded; speculative decoding needs one "
                       "(a file with the MTP block inside, or a separate head file)")
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise FleError("the prompt is empty; generation needs at least one token to start from")
    if n_predict < 1:
        raise FleError(f"the number of tokens to generate must be at least 1, got {n_predict}")
    if n_draft < 1:
        raise FleError(f"the number of drafted tokens must be at least 1, got {n_draft}")
    stop = frozenset(int(t) for t in stop)
    stats = stats if stats is not None else SpecStats()
    state = model.new_state(len(prompt) + n_predict + n_draft)
    for s in range(0, len(prompt), n_batch):
        out = model.forward(prompt[s:s + n_batch], state)
    tok = sampler(out[-1].float().cpu().numpy())
    n = 1
    yield tok
    while tok not in stop and n < n_predict:
        # a check of k drafts emits up to k + 1 tokens: draft no more than are still wanted
        k = min(n_draft, n_predict - n - 1)
        drafts = draft(model, state, next_token=tok, n_draft=k)[0].tolist() if k else []
        stats.drafted += len(drafts)
        snap = snapshot(state) if drafts else None
        logits = model.forward([tok] + drafts, state)
        stats.trunk_calls += 1
        accepted = 0
        for i in range(len(drafts) + 1):
            u = sampler(logits[i].float().cpu().numpy())
            n += 1
            if i < len(drafts):
                stats._check(i, u == drafts[i])
            yield u
            if i < len(drafts) and u == drafts[i] and u not in stop and n < n_predict:
                accepted += 1
                continue
            break
        stats.accepted += accepted
        if accepted < len(drafts):
            restore(state, snap)
            model.forward([tok] + drafts[:accepted], state)     # settle what was kept
            stats.trunk_calls += 1
        tok = u
