"""Next-token sampling as llama.cpp's default sampler chain does it, and the
decode loop that feeds it.

For the parameters FLE exposes the chain is (common/sampling.cpp, with
repetition penalties, DRY, typical-p, XTC and top-n-sigma at their
neutral defaults): top-k -> top-p -> min-p -> temperature -> dist.

* top-k (``k > 0``): keep the ``k`` highest logits, sorted descending.
* top-p (``p < 1``): softmax of the survivors, sorted descending, keep the
  shortest prefix whose cumulative probability (float32) reaches ``p``.
* min-p (``p > 0``): keep logits ``>= max + log(p)``.
* temperature: ``t <= 0`` keeps only the first highest logit (greedy),
  otherwise logits are divided by ``t``.
* dist: softmax of what is left, one uniform draw in [0, 1) from a
  ``std::mt19937`` seeded with ``seed`` (53-bit ``generate_canonical``), and
  the first candidate, in the chain's current order, whose running sum of
  probabilities reaches ``draw * total``. One draw per sampled token, even
  when a single candidate is left, as llama.cpp does.

Filters keep llama.cpp's candidate order (vocabulary order until a filter
sorts), so with the same logits and seed the same token comes out, up to
ties between equal logits. Temperature is applied after the filters, so
top-p and min-p see the untempered distribution.

This module knows nothing about tokenization; the decode loop takes and
yields token ids.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from fle_quant.errors import FleError

__all__ = ["SamplerParams", "Sampler", "MT19937", "filter_candidates", "sample_rows", "generate_tokens"]

_F32 = np.float32


class MT19937:
    """C++'s ``std::mt19937`` (32-bit Mersenne Twister, ``init_genrand``
    seeding) and ``std::uniform_real_distribution<double>(0, 1)`` on it."""

    _N, _M = 624, 397

    def __init__(self, seed: int):
        mt = [int(seed) & 0xFFFFFFFF]
        for i in range(1, self._N):
            prev = mt[-1]
            mt.append((1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
        self._mt = mt
        self._i = self._N

    def _twist(self) -> None:
        mt, n, m = self._mt, self._N, self._M
        for i in range(n):
            y = (mt[i] & 0x80000000) | (mt[(i + 1) % n] & 0x7FFFFFFF)
            mt[i] = mt[(i + m) % n] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
        self._i = 0

    def next_u32(self) -> int:
        if self._i >= self._N:
            self._twist()
        y = self._mt[self._i]
        self._i += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        return y ^ (y >> 18)

    def uniform(self) -> float:
        """A double in [0, 1): two 32-bit draws, low word first, as
        libstdc++'s ``generate_canonical<double, 53>`` combines them."""
        lo = float(self.next_u32())
        total = lo + float(self.next_u32()) * 4294967296.0
        r = total / 18446744073709551616.0
        return r if r < 1.0 else math.nextafter(1.0, 0.0)


@dataclass(frozen=True)
class SamplerParams:
    """llama.cpp's defaults: ``--temp 0.8 --top-k 40 --top-p 0.95
    --min-p 0.05``; ``seed`` None draws a random one."""

    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None

    def check(self) -> "SamplerParams":
        for name in ("temp", "top_p", "min_p"):
            v = getattr(self, name)
            if not math.isfinite(v):
                raise FleError(f"--{name.replace('_', '-')} must be a finite number, got {v}")
        if not 0.0 <= self.top_p <= 1.0:
            raise FleError(f"--top-p must lie in [0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise FleError(f"--min-p must lie in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed <= 0xFFFFFFFF:
            raise FleError(f"--seed must lie in 0..4294967295, got {self.seed}")
        return self


def _desc(x: np.ndarray) -> np.ndarray:
    return np.argsort(-x, kind="stable")


def _top_desc(x: np.ndarray, k: int) -> np.ndarray:
    """``_desc(x)[:k]`` (descending, ties by index) without sorting the
    whole row: the k largest by a partition, then only those sorted. A
    full stable sort of a 150k vocabulary costs ~20 ms a token; this ~1 ms."""
    n = x.size
    if k >= n or k <= 0 or 4 * k > n or np.isnan(x).any():
        return _desc(x)[:k]
    v = x[np.argpartition(-x, k - 1)[k - 1]]                # the k-th largest value
    above = np.flatnonzero(x > v)
    ties = np.flatnonzero(x == v)[:k - above.size]          # the lowest indices among the ties
    cand = np.concatenate([above, ties])
    return cand[np.argsort(-x[cand], kind="stable")]


def _softmax_f32(x: np.ndarray, is_sorted: bool) -> np.ndarray:
    top = x[0] if is_sorted else x.max()
    p = np.exp(x - top)
    return p / np.add.accumulate(p)[-1]  # float32 running sum, in order


def filter_candidates(logits: np.ndarray, params: SamplerParams) -> tuple[np.ndarray, np.ndarray, bool]:
    """The candidates (token ids, float32 logits, whether sorted) the dist
    step sees: after top-k, top-p, min-p and temperature, in llama.cpp's
    order. Greedy (``temp <= 0``) leaves the others at -inf."""
    x = np.array(logits, dtype=_F32).reshape(-1)
    ids = np.arange(x.size)
    is_sorted = False
    if params.top_k > 0:
        k = min(params.top_k, x.size)
        order = _top_desc(x, k)
        ids, x, is_sorted = ids[order], x[order], True
    if params.top_p < 1.0:
        p = _softmax_f32(x, is_sorted)
        if not is_sorted:
            order = _desc(x)
            ids, x, p, is_sorted = ids[order], x[order], p[order], True
        reached = np.nonzero(np.add.accumulate(p) >= _F32(params.top_p))[0]
        last = int(reached[0]) + 1 if reached.size else x.size
        ids, x = ids[:last], x[:last]
    if params.min_p > 0.0:
        with np.errstate(divide="ignore"):
            log_p = _F32(math.log(params.min_p))
        if not is_sorted:
            keep = x >= x.max() + log_p
            if not keep.any():  # min_p > 1: llama.cpp falls back to its sorted path
                order = _desc(x)
                ids, x, is_sorted = ids[order], x[order], True
                keep = np.zeros(x.size, dtype=bool)
                keep[0] = True
        else:
            below = np.nonzero(x[1:] < x[0] + log_p)[0]
            keep = np.zeros(x.size, dtype=bool)
            keep[: int(below[0]) + 1 if below.size else x.size] = True
        ids, x = ids[keep], x[keep]
    if params.temp <= 0.0:
        best = int(np.argmax(x))
        greedy = np.full(x.size, -np.inf, dtype=_F32)
        greedy[best] = x[best]
        x = greedy
    else:
        x = x / _F32(params.temp)
    return ids, x, is_sorted


class Sampler:
    """Picks the next token from a row of logits; holds the random state."""

    def __init__(self, params: SamplerParams = SamplerParams()):
        self.params = params.check()
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.seed = seed
        self.rng = MT19937(seed)

    def __call__(self, logits: "np.ndarray | torch.Tensor") -> int:
        if isinstance(logits, torch.Tensor):
            logits = logits.detach().float().cpu().numpy()
        ids, x, is_sorted = filter_candidates(logits, self.params)
        rnd = self.rng.uniform()
        if ids.size == 1:
            return int(ids[0])
        top = x[0] if is_sorted else x.max()
        p = np.exp(x - top).astype(np.float64)
        running = np.add.accumulate(p)
        hit = np.nonzero(running >= running[-1] * rnd)[0]
        return int(ids[hit[0] if hit.size else ids.size - 1])


def sample_rows(samplers: Sequence[Sampler], logits: np.ndarray) -> list[int]:
    """``[s(row) for s, row in zip(samplers, logits)]`` for rows of logits
    [R, V] (float32) and a sampler per row: the same tokens and random
    states as those one-row calls. The rows whose samplers share their
    parameters (the seed aside) and keep at most 256 candidates by top-k
    (any top-k when greedy) run the chain together in compiled loops
    (:mod:`fle_engine.sampling_rows`); the others, and rows those loops
    leave (a NaN, no finite largest logit), take the one-row path."""
    x = np.asarray(logits)
    if x.ndim != 2 or x.shape[0] != len(samplers):
        raise FleError(f"sample_rows: {len(samplers)} samplers for logits of shape {tuple(x.shape)}")
    if x.dtype != _F32:
        x = x.astype(_F32)
    n = x.shape[1]
    out: list = [None] * len(samplers)
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(samplers):
        p = s.params
        if p.top_k > 0 and (p.temp <= 0.0 or (p.top_k < n and p.top_k <= _ROWS_TOP_K)):
            groups.setdefault((p.top_k, p.top_p, p.min_p, p.temp), []).append(i)
    if groups:
        from .sampling_rows import sample_group

        for rows in groups.values():
            sub = x if len(rows) == x.shape[0] else x[rows]
            for i, tok in zip(rows, sample_group([samplers[i] for i in rows], sub)):
                out[i] = tok
    for i, s in enumerate(samplers):
        if out[i] is None:
            out[i] = s(x[i])
    return out


_ROWS_TOP_K = 256       # sample_rows' loops keep the top-k in an insertion-sorted list: for small k


def generate_tokens(model, prompt: Sequence[int], n_predict: int, sampler: Callable[[np.ndarray], int],
                    stop: Iterable[int] = (), n_batch: int = 512) -> Iterator[int]:
    """Sample up to ``n_predict`` tokens after ``prompt``: the prompt is
    prefilled in batches of ``n_batch``, then each sampled token is fed back
    alone through the model's KV-cache state. Yields each token as it is
    sampled; a token in ``stop`` (e.g. end-of-generation) is yielded and
    ends the run."""
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise FleError("the prompt is empty; generation needs at least one token to start from")
    if n_predict < 1:
        raise FleError(f"the number of tokens to generate must be at least 1, got {n_predict}")
    stop = frozenset(int(t) for t in stop)
    state = model.new_state(len(prompt) + n_predict)
    for s in range(0, len(prompt), n_batch):
        out = model.forward(prompt[s:s + n_batch], state)
    for i in range(n_predict):
        tok = sampler(out[-1].float().cpu().numpy())
        yield tok
        if tok in stop or i == n_predict - 1:
            return
        out = model.forward([tok], state)
