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

Adaptive draft count (:class:`AdaptiveDraft`): each step drafts the n in
0 .. n_max that maximises the expected tokens per second E(n) / T(n), from
the measured acceptance per draft position and the measured times of trunk
calls and drafting by size (:func:`best_draft_count`, a pure function).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
from torch import Tensor

from fle_quant.errors import FleError

from . import layers as L
from .mtp import draft

__all__ = ["SpecStats", "snapshot", "restore", "generate_speculative", "AdaptiveDraft", "best_draft_count",
           "expected_tokens", "expected_step_time"]


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
    steps: list = field(default_factory=list)     # steps[n]: decode steps that drafted n tokens
    # wall time of the drafting calls and of the trunk's verify steps (the engine's loop fills them)
    draft_calls: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def _step(self, n: int) -> None:
        while len(self.steps) <= n:
            self.steps.append(0)
        self.steps[n] += 1

    def steps_line(self) -> str:
        """``drafts per step: 0 x 3, 1 x 5, 2 x 40`` (counts that occurred)."""
        per = ", ".join(f"{n} x {c}" for n, c in enumerate(self.steps) if c)
        return f"drafts per step: {per}" if per else ""

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

    def time_line(self) -> str:
        """``drafting 0.41 ms per call (212 calls), verify steps 6.10 ms each``
        (empty when the loop timed nothing)."""
        if not self.draft_calls:
            return ""
        per_verify = self.verify_seconds / self.trunk_calls * 1e3 if self.trunk_calls else 0.0
        return (f"drafting {self.draft_seconds / self.draft_calls * 1e3:.2f} ms per call ({self.draft_calls} calls, "
                f"{1e3 * self.draft_seconds:.0f} ms), verify steps {per_verify:.2f} ms each")

    def _check(self, i: int, ok: bool) -> None:
        while len(self.reached) <= i:
            self.reached.append(0)
            self.right.append(0)
        self.reached[i] += 1
        self.right[i] += int(ok)


def expected_tokens(accept: Sequence[float], n: int) -> float:
    """E(n) = 1 + sum over k <= n of accept[0] * ... * accept[k-1]: the
    tokens a step drafting ``n`` emits on average (the drafts kept, then the
    trunk's own token after them), ``accept[k]`` being the acceptance of
    draft k + 1 given the drafts before it were right (0 past the list)."""
    e = p = 1.0
    for k in range(n):
        p *= accept[k] if k < len(accept) else 0.0
        e += p
    return e


def expected_step_time(accept: Sequence[float], n: int, trunk_cost, draft_cost=None,
                       resettle: bool = True) -> float:
    """T(n): the expected seconds of a step drafting ``n``: drafting
    (``draft_cost[n]``, none for n = 0), the trunk call over the next token
    and the n drafts (``trunk_cost[n + 1]``) and, when draft m + 1 is
    rejected (m < n kept), the call over the m + 1 kept tokens that settles
    the rolled-back state (``trunk_cost[m + 1]``; none with ``resettle``
    False: the engine puts the state back from per-token snapshots,
    :meth:`~fle_engine.runtime.engine.Engine.rewind`). ``trunk_cost[s]``:
    the seconds of a trunk call over s tokens (a mapping or a sequence)."""
    t = float(trunk_cost[n + 1]) + (float(draft_cost[n]) if n and draft_cost is not None else 0.0)
    if not resettle:
        return t
    p = 1.0
    for m in range(n):
        a = accept[m] if m < len(accept) else 0.0
        t += p * (1.0 - a) * float(trunk_cost[m + 1])
        p *= a
    return t


def best_draft_count(accept: Sequence[float], trunk_cost, n_max: int, draft_cost=None,
                     resettle: bool = True) -> int:
    """The n in 0 .. ``n_max`` with the most expected tokens per second,
    E(n) / T(n) (:func:`expected_tokens`, :func:`expected_step_time`); a
    tie goes to the smaller n."""
    best, best_rate = 0, -1.0
    for n in range(n_max + 1):
        t = expected_step_time(accept, n, trunk_cost, draft_cost, resettle)
        rate = expected_tokens(accept, n) / t if t > 0 else float("inf")
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = n, rate
    return best


class _Costs:
    """Smoothed seconds by size (exponential average), and an estimate for
    sizes not measured yet: the line through the measured ones (at least
    the cost of a smaller measured size), or the one measured cost."""

    def __init__(self, alpha: float, per_unit: bool = False):
        self.alpha, self.per_unit, self.t = alpha, per_unit, {}

    def add(self, size: int, seconds: float) -> None:
        old = self.t.get(size)
        self.t[size] = seconds if old is None else old + self.alpha * (seconds - old)

    def __bool__(self) -> bool:
        return bool(self.t)

    def __getitem__(self, size: int) -> float:
        if size in self.t:
            return self.t[size]
        if not self.t:
            return 0.0
        if self.per_unit:                      # drafting: each draft one head call
            return size * sum(v / k for k, v in self.t.items()) / len(self.t)
        xs = np.array(sorted(self.t), dtype=float)
        ys = np.array([self.t[int(x)] for x in xs])
        below = ys[xs < size]
        floor = float(below.max()) if below.size else 0.0
        if xs.size == 1:
            return max(float(ys[0]), floor)
        slope, icept = np.polyfit(xs, ys, 1)
        return max(float(icept + slope * size), floor, 0.0)


class AdaptiveDraft:
    """Picks each step's draft count in 0 .. ``n_max`` with
    :func:`best_draft_count`, from what the run measures: the acceptance per
    draft position (counts decayed over about ``window`` steps; a position
    with few checks leans on the one before it, the first on ``prior``) and
    the seconds of trunk calls by size and of drafting by count, smoothed
    (``alpha``). Every ``probe_every``-th step drafts one more than the best
    (at most ``n_max``), so that a position or size judged poor once is
    measured again. The first step drafts ``n_max``. ``resettle``: a
    rejection costs a trunk call over the kept tokens (the reference path);
    False on the engine, which restores the state without one."""

    def __init__(self, n_max: int, window: float = 64.0, alpha: float = 0.25, probe_every: int = 8,
                 prior: float = 0.5, prior_weight: float = 2.0, resettle: bool = True):
        if n_max < 1:
            raise FleError(f"the most drafted tokens must be at least 1, got {n_max}")
        self.n_max, self.decay, self.probe_every = n_max, 1.0 - 1.0 / window, probe_every
        self.prior, self.prior_weight = prior, prior_weight
        self.resettle = resettle
        self.right = [0.0] * n_max
        self.reached = [0.0] * n_max
        self.trunk = _Costs(alpha)
        self.drafting = _Costs(alpha, per_unit=True)
        self.step = 0

    def acceptance(self) -> list[float]:
        out, prev = [], self.prior
        for r, n in zip(self.right, self.reached):
            prev = (r + self.prior_weight * prev) / (n + self.prior_weight)
            out.append(prev)
        return out

    def choose(self) -> int:
        self.step += 1
        if not self.trunk:
            return self.n_max
        n = best_draft_count(self.acceptance(), self.trunk, self.n_max, self.drafting, self.resettle)
        if self.probe_every and self.step % self.probe_every == 0:
            n = min(n + 1, self.n_max)
        return n

    def observe(self, checks: Sequence[bool]) -> None:
        """A step's checks, draft by draft: right, right, ..., then wrong or
        the end of the drafts."""
        if not checks:
            return
        self.right = [r * self.decay for r in self.right]
        self.reached = [n * self.decay for n in self.reached]
        for i, ok in enumerate(checks[:self.n_max]):
            self.reached[i] += 1.0
            self.right[i] += float(ok)

    def time_trunk(self, size: int, seconds: float) -> None:
        self.trunk.add(size, seconds)

    def time_draft(self, n: int, seconds: float) -> None:
        if n:
            self.drafting.add(n, seconds)

    def line(self) -> str:
        acc = " / ".join(f"{100 * a:.0f}" for a in self.acceptance())
        trunk = " / ".join(f"{1e3 * self.trunk[s]:.1f}" for s in range(1, self.n_max + 2))
        dr = " / ".join(f"{1e3 * self.drafting[n]:.1f}" for n in range(1, self.n_max + 1))
        return (f"adaptive drafting: acceptance by position {acc} %, trunk call of 1..{self.n_max + 1} tokens "
                f"{trunk} ms, drafting 1..{self.n_max} {dr} ms, best now {self._best()}")

    def _best(self) -> int:
        return (best_draft_count(self.acceptance(), self.trunk, self.n_max, self.drafting, self.resettle)
                if self.trunk else self.n_max)


def generate_speculative(model, prompt: Sequence[int], n_predict: int, sampler: Callable[[np.ndarray], int],
                         stop: Iterable[int] = (), n_batch: int = 512, n_draft: int = 1,
                         stats: "SpecStats | None" = None, vocab=None,
                         adaptive: "bool | AdaptiveDraft | None" = None) -> Iterator[int]:
    """Like :func:`fle_engine.sampling.generate_tokens`, drafting up to
    ``n_draft`` tokens ahead with the model's MTP head (loaded inside the
    model file or with ``load_mtp``) and checking them in one trunk call.
    ``stats`` (optional) counts drafts and acceptances. ``vocab`` (a
    :class:`~fle_engine.draft_vocab.DraftVocab`): drafts only from its
    tokens. ``adaptive``: True, or an :class:`AdaptiveDraft`, picks each
    step's count up to ``n_draft`` (an AdaptiveDraft's own ``n_max``)."""
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
    policy = AdaptiveDraft(n_draft) if adaptive is True else (adaptive or None)
    n_max = policy.n_max if policy is not None else n_draft
    stop = frozenset(int(t) for t in stop)
    stats = stats if stats is not None else SpecStats()
    state = model.new_state(len(prompt) + n_predict + n_max)
    clock = time.perf_counter

    def trunk(tokens: list, rows: bool = True):
        """The trunk over ``tokens``: its logits as host float32 rows (with
        ``rows``), timed for the policy."""
        t0 = clock()
        logits = model.forward(tokens, state)
        out = logits.float().cpu().numpy() if rows else logits[-1:, :1].cpu()     # on the host: synchronised
        if policy is not None:
            policy.time_trunk(len(tokens), clock() - t0)
        stats.trunk_calls += 1
        return out

    for s in range(0, len(prompt), n_batch):
        out = model.forward(prompt[s:s + n_batch], state)
    tok = sampler(out[-1].float().cpu().numpy())
    n = 1
    yield tok
    while tok not in stop and n < n_predict:
        # a check of k drafts emits up to k + 1 tokens: draft no more than are still wanted
        k = min(policy.choose() if policy is not None else n_draft, n_predict - n - 1)
        t0 = clock()
        drafts = draft(model, state, next_token=tok, n_draft=k, vocab=vocab)[0].tolist() if k else []
        snap = snapshot(state) if drafts else None
        if policy is not None:
            policy.time_draft(len(drafts), clock() - t0)
        stats.drafted += len(drafts)
        stats._step(len(drafts))
        logits = trunk([tok] + drafts)
        accepted, checks = 0, []
        for i in range(len(drafts) + 1):
            u = sampler(logits[i])
            n += 1
            if i < len(drafts):
                checks.append(u == drafts[i])
                stats._check(i, checks[-1])
            yield u
            if i < len(drafts) and u == drafts[i] and u not in stop and n < n_predict:
                accepted += 1
                continue
            break
        stats.accepted += accepted
        if policy is not None:
            policy.observe(checks)
        if accepted < len(drafts):
            restore(state, snap)
            trunk([tok] + drafts[:accepted], rows=False)     # settle what was kept
        tok = u
