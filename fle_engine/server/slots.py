"""The engine side of the server: one loaded model, its slots and the
scheduler that decodes them.

``Engine`` owns ``n_parallel`` slots, each a sequence with its own state
and the tokens that state holds. The context (``n_ctx``) is shared as
llama-server shares it with ``--parallel N``: each slot gets
``n_ctx / N`` positions. A request (a :class:`Job`) goes to the slot it
names (``id_slot``) or to the idle slot whose held tokens (or the RAM
prompt cache's) serve most of its prompt, the least recently used one on a
tie; a request naming a busy slot waits until that slot is free, and
nothing touches a busy slot's state.

One worker thread runs rounds: each active slot advances by one prompt
chunk or one token per round, and on the reference path all of a round's
sequences go through the model in one batched forward
(``Model.forward_batch``). With several slots, the slots' attention caches
and recurrent states (GDN, qwen4exp's indexer keys and PLE history) are
rows of one buffer per layer, so that a round of one token per slot
attends (and runs the delta rule) for all slots at once instead of once
per slot. On the GPU engine holding one lane per slot
(``runtime.Engine(n_seq=N)``) a slot's prompt runs on its lane and each
round is one batched decode step of every slot with a token to feed
(``launch_lanes``), read back at the start of the next round
(``finish_lanes``), so that the decode loop's own work between rounds and
the engine's cache policy overlap the step on the device; the rows are
sampled per slot on the host with the reference path's
chain (logit bias, penalties, ignore_eos, grammar mask, probabilities);
the RAM prompt cache and slot files hold lane snapshots there
(``lane_snapshot`` / ``lane_restore``). With MTP drafts, or an engine of
one sequence, each slot runs its own token generator, one slot at a time
on the engine.

A protected slot (``--cache-protect-slot``) keeps the conversation of the
requests naming it in the RAM prompt cache: its entries are evicted only by
its own (:meth:`.cache.PromptCache.put`), and requests naming no slot take
it only when no other slot is idle.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import threading
import time
import traceback
import sys
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, TextIO

import numpy as np
import torch

from fle_quant.errors import FleError

from ..sampling import Sampler, SamplerParams, generate_tokens, sample_rows
from ..speculative import AdaptiveDraft, SpecStats, generate_speculative
from .. import layers as L
from . import cache as C
from .text import StopScanner

CTX_CAP = 8192          # default context: the model's own, at most this many tokens
N_BATCH = 512           # prompt tokens per slot per round


@dataclass
class Penalties:
    """llama.cpp's repetition penalties over the last ``last_n`` tokens
    (prompt and answer; -1 = the whole context, 0 = off)."""
    repeat: float = 1.0
    last_n: int = 64
    presence: float = 0.0
    frequency: float = 0.0

    @property
    def active(self) -> bool:
        return self.last_n != 0 and (self.repeat != 1.0 or self.presence != 0.0 or self.frequency != 0.0)


@dataclass
class Job:
    prompt: list[int]
    n_predict: int
    params: SamplerParams
    stop: list[str] = field(default_factory=list)
    id_slot: int = -1
    cache_prompt: bool = True
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    penalties: Penalties = field(default_factory=Penalties)
    probs: bool = False                 # record each sampled token's log-probability
    n_probs: int = 0                    # and this many top alternatives
    constraint: object = None           # a grammar matcher (see .grammar): masks logits, takes tokens


@dataclass
class TokenProb:
    id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Result:
    text: str
    finish_reason: str          # "stop" (end of generation or a stop string), "length", or "abort" (shutdown)
    n_prompt: int
    n_generated: int            # sampled tokens, the end-of-generation token included
    cancelled: bool = False
    stop_word: str | None = None
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0
    drafted: int = 0
    accepted: int = 0
    n_cached: int = 0           # prompt tokens served from a slot or the prompt cache, not recomputed
    id_slot: int = -1
    probs: list[TokenProb] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def timings(self) -> dict:
        n_new = self.n_prompt - self.n_cached
        t = {
            "cache_n": self.n_cached,
            "prompt_n": n_new,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / n_new if n_new else 0.0,
            "prompt_per_second": 1e3 * n_new / self.prompt_ms if self.prompt_ms > 0 else 0.0,
            "predicted_n": self.n_generated,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": self.predicted_ms / self.n_generated if self.n_generated else 0.0,
            "predicted_per_second": 1e3 * self.n_generated / self.predicted_ms if self.predicted_ms > 0 else 0.0,
        }
        if self.drafted:
            t["draft_n"], t["draft_n_accepted"] = self.drafted, self.accepted
        return t

    def usage(self) -> dict:
        return {"completion_tokens": self.n_generated, "prompt_tokens": self.n_prompt,
                "total_tokens": self.n_prompt + self.n_generated,
                "prompt_tokens_details": {"cached_tokens": self.n_cached}}


class Emit:
    """What the scheduler hands to a request as text is released: the text
    and the token probabilities recorded since the last piece."""

    def __init__(self, fn: Callable[[str, list[TokenProb]], None]):
        self.fn = fn


@dataclass
class _Task:
    job: Job | None
    cancel: threading.Event
    emit: Callable[[str, list], None] | None      # None: nothing streamed, the text comes in the Result
    future: Future
    action: tuple | None = None          # (name, arg) for slot save / restore / erase
    slot: "Slot | None" = None
    # decoding
    sampler: Sampler | None = None
    decoder: object = None
    scan: StopScanner | None = None
    pieces: list[str] = field(default_factory=list)
    probs: list[TokenProb] = field(default_factory=list)
    unsent: list[TokenProb] = field(default_factory=list)
    out_tokens: list[int] = field(default_factory=list)
    pos: int = 0                          # prompt tokens consumed
    n_cached: int = 0
    next_token: int | None = None
    gen: object = None                    # a token generator (MTP / GPU engine)
    spec: SpecStats | None = None
    history: list[int] = field(default_factory=list)
    # n > 1: the first task of a group computes the prompt; the others start from a copy of its state
    children: list["_Task"] = field(default_factory=list)
    parent: "_Task | None" = None
    waiting: bool = False                 # a child whose parent's prompt is not done yet
    t0: float = 0.0
    t_first: float | None = None
    done: bool = False
    routed0: np.ndarray | None = None     # the engine's (lookups, hits) on the slot's lane when the task took it


class Slot:
    def __init__(self, sid: int, n_ctx: int):
        self.id, self.n_ctx = sid, n_ctx
        self.state = None
        self.tokens: list[int] = []      # what ``state`` holds
        self.logits = None               # the logits after the last of ``tokens``
        self.task: _Task | None = None
        self.t_last = 0.0
        self.n_decoded = 0
        self.cacheable = True            # the held tokens came from a request that allows caching
        self.protected = False           # the held tokens are the conversation of a protected slot

    @property
    def busy(self) -> bool:
        return self.task is not None


class Engine:
    """A loaded model and its tokenizer, serving ``n_parallel`` slots.

    ``submit(job, cancel, emit)`` queues a request and returns a Future of
    its :class:`Result`; ``run`` is the blocking form. ``emit(text, probs)``
    (None for a request that is not streamed)
    is called from the worker thread as text is released."""

    def __init__(self, model, tokenizer, *, n_ctx: int, name: str, n_ctx_train: int | None = None,
                 mtp: bool = False, n_draft: int = 2, log: TextIO | None = None, n_parallel: int = 1,
                 cache_ram_mib: float = 0, slot_save_path: str | None = None, draft_vocab=None,
                 draft_adaptive: bool = False, cache_protect_slots=()):
        if n_parallel < 1:
            raise FleError(f"--parallel must be at least 1, got {n_parallel}")
        if n_ctx < 2 * n_parallel:
            raise FleError(f"the context size must be at least 2 tokens per slot, got {n_ctx} for {n_parallel} "
                           "slots")
        self.runtime = bool(getattr(model, "runtime", False))
        if mtp and (getattr(model, "drafter", None) if self.runtime else getattr(model.net, "mtp", None)) is None:
            raise FleError(f"{model.path}: no MTP head loaded; --mtp needs a model file with the MTP block "
                           "inside, or --mtp-head FILE")
        if n_draft < 1:
            raise FleError(f"--draft-max must be at least 1, got {n_draft}")
        if cache_ram_mib < 0:
            raise FleError(f"--cache-ram must be 0 (off) or a size in MiB, got {cache_ram_mib}")
        self.model, self.tok = model, tokenizer
        self.n_ctx, self.name, self.n_ctx_train, self.mtp, self.log = n_ctx, name, n_ctx_train, mtp, log
        self.n_draft = n_draft
        # MTP drafting from a token list (draft_vocab.DraftVocab), and one adaptive draft count for all requests
        # (acceptance and verify costs learnt across them; every request's steps run on the worker thread)
        self.draft_vocab = draft_vocab
        self.draft_policy = (AdaptiveDraft(n_draft, resettle=not self.runtime)    # the engine restores, no re-run
                             if draft_adaptive and mtp else None)
        self.n_parallel = n_parallel
        self.created = int(time.time())
        # the GPU engine with a lane per slot (runtime.Engine(n_seq=N)): the slots run at once, one batched
        # decode step per round
        self.lanes = self.runtime and not mtp and int(getattr(model, "n_seq", 1)) > 1
        if self.lanes and model.n_seq != n_parallel:
            raise FleError(f"the engine holds {model.n_seq} sequences for {n_parallel} slots")
        # an engine of one sequence holds the whole context; the reference path and the lanes split it
        self.n_ctx_slot = n_ctx if self.runtime and not self.lanes else n_ctx // n_parallel
        if self.lanes:
            self.n_ctx_slot = int(model.ctx_size)
        # the reference path steps the slots itself; MTP and an engine of one sequence run token generators
        self.stepped = not (mtp or self.runtime)
        self._host_rounds = self.stepped or self.lanes      # rounds of the scheduler's own, sampled on the host
        # the RAM prompt cache holds state snapshots: the reference path's (cache.snapshot), the lanes'
        # (runtime.Engine.lane_snapshot)
        self.cache = C.PromptCache(int(cache_ram_mib * 2**20) if self._host_rounds else 0)
        # slots whose conversations (the requests naming them) the other slots' traffic cannot push out of the
        # prompt cache; unnamed requests take them only when no other slot is idle
        self.protect = frozenset(int(i) for i in cache_protect_slots)
        for i in sorted(self.protect):
            if not 0 <= i < n_parallel:
                raise FleError(f"--cache-protect-slot {i}: the server has slots 0..{n_parallel - 1}")
        if self.protect and not self.cache.enabled:
            raise FleError("--cache-protect-slot needs the RAM prompt cache (--cache-ram MiB) on the reference "
                           "path or the engine's lanes, without --mtp")
        self.slot_save_path = slot_save_path
        self.slots = [Slot(i, self.n_ctx_slot) for i in range(n_parallel)]
        self._cv = threading.Condition()
        self._pending: list[_Task] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._batched = hasattr(model, "forward_batch")
        # a lane's sequence can be cut back to a shorter prefix when the net's state is positional (KV only)
        self._truncatable: bool | None = bool(getattr(model.net, "positional_state", False)) if self.lanes else None
        self._pools: dict[object, tuple[torch.Tensor, ...]] = {}   # per layer (and carried state), see _new_state
        self._eog_cache: tuple[int, np.ndarray] | None = None       # see _eog_cols
        self._inflight: tuple[list, list] | None = None     # the batched step on the lanes launched, not read
        self._deferred: list[tuple[Slot, _Task, int]] = []  # tokens whose text waits until the next step is launched
        # counters for /metrics
        self.n_prompt_total = self.n_predicted_total = self.n_requests = self.n_cached_total = 0
        self.t_prompt_total = self.t_predicted_total = 0.0
        self.n_rounds = 0
        self.n_drafted_total = self.n_accepted_total = 0
        tokenizer.stream()              # builds the detokenizer tables now, not in the first request

    # ---------------------------------------------------------------- public

    def start(self) -> None:
        with self._cv:
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                self._thread = threading.Thread(target=self._loop, name="fle-decode", daemon=True)
                self._thread.start()

    def stop(self, wait: bool = True) -> None:
        """End every running and waiting request (finish reason ``abort``)
        and the worker thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            th = self._thread
        if wait and th is not None and th is not threading.current_thread():
            th.join()
        self._thread = None

    def submit(self, job: Job, cancel: threading.Event, emit: Callable[[str, list], None] | None) -> Future:
        if job.id_slot >= self.n_parallel:
            raise FleError(f"id_slot {job.id_slot} does not exist; the server has {self.n_parallel} slots")
        return self._enqueue(_Task(job, cancel, emit, Future()))

    def slot_action(self, id_slot: int, action: str, arg: str | None = None) -> Future:
        """Save, restore or erase a slot once it is idle (waits while it is busy)."""
        if not 0 <= id_slot < self.n_parallel:
            raise FleError(f"id_slot {id_slot} does not exist; the server has {self.n_parallel} slots")
        return self._enqueue(_Task(None, threading.Event(), lambda *_: None, Future(), action=(action, id_slot, arg)))

    def submit_group(self, jobs: list[Job], cancel: threading.Event,
                     emits: list[Callable[[str, list], None] | None]) -> list[Future]:
        """``n`` completions of one prompt (llama-server's ``n`` / ``n_cmpl``):
        on the reference path they start together on ``n`` slots, the first
        computes the prompt and the others begin from a copy of its state;
        elsewhere they run as separate requests."""
        if not jobs or len(jobs) != len(emits):
            raise FleError("a group needs one emit per job")
        if len(jobs) > self.n_parallel:
            raise FleError(f"{len(jobs)} completions need as many slots; the server has {self.n_parallel}")
        if len(jobs) == 1 or not self.stepped:
            return [self.submit(j, cancel, e) for j, e in zip(jobs, emits)]
        if jobs[0].id_slot >= self.n_parallel:
            raise FleError(f"id_slot {jobs[0].id_slot} does not exist; the server has {self.n_parallel} slots")
        parent = _Task(jobs[0], cancel, emits[0], Future())
        parent.children = [_Task(j, cancel, e, Future(), parent=parent) for j, e in zip(jobs[1:], emits[1:])]
        self._enqueue(parent)
        return [parent.future] + [c.future for c in parent.children]

    def run(self, job: Job, cancel: threading.Event, emit: Callable[[str, list], None]) -> Result:
        return self.submit(job, cancel, emit).result()

    def _enqueue(self, task: _Task) -> Future:
        self.start()
        with self._cv:
            if self._stopping:
                raise FleError("the server is shutting down")
            self._pending.append(task)
            self._cv.notify_all()
        return task.future

    def slots_info(self) -> list[dict]:
        out = []
        for s in self.slots:
            t = s.task
            out.append({"id": s.id, "n_ctx": s.n_ctx, "is_processing": t is not None,
                        "n_cached_tokens": len(s.tokens), "n_decoded": s.n_decoded,
                        "cache_protected": s.id in self.protect,
                        "id_task": id(t) if t is not None else -1,
                        "next_token": {"has_next_token": t is not None and not t.done,
                                       "n_decoded": len(t.out_tokens) if t is not None else 0}})
        return out

    @property
    def n_waiting(self) -> int:
        return len(self._pending)

    @property
    def n_busy(self) -> int:
        return sum(s.busy for s in self.slots)

    # ---------------------------------------------------------------- the worker

    def _loop(self) -> None:
        while True:
            with self._cv:
                if self._inflight is not None and (self._stopping or (
                        self._pending and not all(s.busy for s in self.slots))):
                    self._land_safely()     # a request is about to take a slot (lane calls), or the server stops
                while not self._stopping and not self._assignable() and not any(s.busy for s in self.slots):
                    self._cv.wait()
                if self._stopping:
                    self._abort_all()
                    return
                self._assign()
                active = [s for s in self.slots if s.busy]
            if active:
                self._guarded(active, lambda: self._round(active))

    def _guarded(self, slots: list[Slot], work) -> None:
        """``work()``; a failure fails the requests of ``slots`` still running, and serving goes on."""
        try:
            work()
        except Exception as e:  # noqa: BLE001 - fail those requests, keep serving
            traceback.print_exc(file=sys.stderr)
            for s in slots:
                if s.task is not None:
                    self._fail(s, e)

    def _assignable(self) -> bool:
        return any(self._free_slot_for(t) is not None for t in self._pending)

    def _free_slot_for(self, task: _Task) -> Slot | None:
        if task.children:
            free = [s for s in self.slots if not s.busy]
            if len(free) < 1 + len(task.children):
                return None             # llama-server: a group waits until all its slots are free
            if task.job.id_slot >= 0:
                s = self.slots[task.job.id_slot]
                return None if s.busy else s
            return self._choose(free, task.job)
        if task.action is not None:
            s = self.slots[task.action[1]]
            return None if s.busy else s
        if self.runtime and not self.lanes and any(s.busy for s in self.slots):
            return None             # the GPU engine holds one sequence
        if task.job.id_slot >= 0:
            s = self.slots[task.job.id_slot]
            return None if s.busy else s
        free = [s for s in self.slots if not s.busy]
        if not free:
            return None
        return self._choose(free, task.job)

    def _can_truncate(self) -> bool:
        if self._truncatable is None:
            st = self.model.new_state(2) if self.stepped else None
            self._truncatable = hasattr(st, "layers") and hasattr(st, "pos") and C.truncatable(st)
            if not (hasattr(st, "layers") and hasattr(st, "pos")):
                self.cache.limit = 0    # a model without FLE's state layout: no snapshots
        return self._truncatable

    def _choose(self, free: list[Slot], job: Job) -> Slot:
        """The idle slot serving most of the prompt; on a tie one that is not
        protected, then the least recently used."""
        if self.lanes and job.cache_prompt:     # the lane keeping most of the prompt
            return max(free, key=lambda s: (self.model.lane_reuse(s.id, job.prompt), s.id not in self.protect,
                                            -s.t_last))
        if not job.cache_prompt or not self.stepped:
            return min(free, key=lambda s: (s.id in self.protect, s.t_last))
        ct = self._can_truncate()
        return max(free, key=lambda s: (C.usable_prefix(s.tokens, s.logits is not None, job.prompt, ct),
                                        s.id not in self.protect, -s.t_last))

    def _assign(self) -> None:
        """Start each waiting request whose slot is free, in arrival order."""
        for task in list(self._pending):
            if task.cancel.is_set() and task.job is not None:
                self._pending.remove(task)
                for t in [task, *task.children]:
                    t.future.set_result(Result("", "stop", len(t.job.prompt), 0, cancelled=True))
                continue
            slot = self._free_slot_for(task)
            if slot is None:
                continue
            self._pending.remove(task)
            try:
                if task.action is not None:
                    task.future.set_result(self._do_action(slot, *task.action))
                else:
                    self._begin(slot, task)
                    others = sorted((s for s in self.slots if not s.busy), key=lambda s: s.t_last)
                    for child, cs in zip(task.children, others):
                        self._begin_child(cs, child)
            except Exception as e:  # noqa: BLE001 - the request's own failure
                for t in [task, *task.children]:
                    if not t.future.done():
                        t.future.set_exception(e)
                    if t.slot is not None and t.slot.task is t:
                        t.slot.task = None

    # ---------------------------------------------------------------- starting a request

    def _keep_in_cache(self, slot: Slot) -> None:
        if self.lanes:
            self._keep_lane(slot)
            return
        if self.cache.enabled and slot.tokens and slot.cacheable and slot.state is not None:
            self.cache.put(list(slot.tokens), C.snapshot(slot.state, len(slot.tokens)), slot.logits,
                           owner=slot.id if slot.protected else None)

    def _new_state(self, slot: Slot):
        """A new state for ``slot``. With several slots, its attention caches
        and recurrent states (a GDN layer's, qwen4exp's indexer keys and PLE
        history) are the slot's rows of buffers shared by all slots (set to
        the new state's values here), so that a batched decode step reads
        and updates every slot's keys and values, or recurrent state, as one
        tensor (:func:`fle_engine.layers.stacked`)."""
        st = self.model.new_state(slot.n_ctx)
        layers = getattr(st, "layers", None)
        if self.n_parallel < 2 or not isinstance(layers, list):
            return st
        for il, c in enumerate(layers):
            layers[il] = self._pooled(il, c, slot)
        for name, obj in C.carried_parts(st).items():
            setattr(st, name, self._pooled(name, obj, slot))
        return st

    def _pooled(self, key, obj, slot: Slot):
        """``obj`` (a dataclass of tensors: one layer's cache, or carried
        state) with each tensor replaced by the slot's row of the pool kept
        under ``key``, holding the tensor's values."""
        if not dataclasses.is_dataclass(obj):
            return obj
        parts = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
                 if isinstance(getattr(obj, f.name), torch.Tensor)}
        if not parts:
            return obj
        pool = self._pools.get(key)
        if pool is None or len(pool) != len(parts) or any(
                p.shape[1:] != t.shape or p.dtype != t.dtype or p.device != t.device
                for p, t in zip(pool, parts.values())):
            pool = tuple(t.new_zeros((self.n_parallel, *t.shape)) for t in parts.values())
            self._pools[key] = pool
        rows = {}
        for p, (name, t) in zip(pool, parts.items()):
            rows[name] = p[slot.id]
            rows[name].copy_(t)
        return dataclasses.replace(obj, **rows)

    def _fresh_state(self, slot: Slot) -> None:
        if slot.state is not None and self._can_truncate():
            slot.state.pos.fill_(0)
            slot.state.length = 0
        else:
            slot.state = self._new_state(slot)
        slot.tokens, slot.logits = [], None

    def _prepare(self, slot: Slot, job: Job) -> int:
        """Make the slot's state hold the longest usable prefix of the prompt
        (its own tokens, or a prompt-cache entry); returns its length."""
        ct = self._can_truncate()
        prompt = job.prompt
        if not job.cache_prompt:
            self._keep_in_cache(slot)
            self._fresh_state(slot)
            return 0
        have = C.usable_prefix(slot.tokens, slot.logits is not None, prompt, ct) if slot.state is not None else 0
        entry, from_cache = (self.cache.best(prompt, ct) if self.cache.enabled else (None, 0))
        if entry is not None and from_cache > have:
            if slot.tokens != entry.tokens:
                self._keep_in_cache(slot)
            if slot.state is None:
                slot.state = self._new_state(slot)
            C.restore(entry.snap, slot.state)
            slot.tokens, slot.logits = list(entry.tokens), entry.logits
            have = from_cache
        elif have < len(slot.tokens):
            # what the slot holds goes (all of it, or past the shared prefix)
            if have == 0 or not ct:
                self._keep_in_cache(slot)
                self._fresh_state(slot)
                have = 0
        if slot.state is None:
            self._fresh_state(slot)
        if have < len(slot.tokens):   # an attention state cut back to the shared prefix
            self._keep_in_cache(slot)
            slot.state.pos.fill_(have)
            slot.state.length = have
            slot.tokens = slot.tokens[:have]
            slot.logits = None
        return have

    def _keep_lane(self, slot: Slot) -> None:
        """The slot's lane's sequence into the RAM prompt cache (a host
        snapshot, with the logits after its last token)."""
        if not (self.cache.enabled and slot.tokens and slot.cacheable):
            return
        if self.model.lane_tokens(slot.id) != slot.tokens:
            return                      # the lane does not hold what the slot says (a failed round)
        logits = slot.logits.clone() if slot.logits is not None else None
        self.cache.put(list(slot.tokens), self.model.lane_snapshot(slot.id), logits,
                       owner=slot.id if slot.protected else None)

    def _prepare_lane(self, slot: Slot, job: Job) -> None:
        """Before a prompt runs on the slot's lane: a prompt-cache entry
        serving more of it than the lane keeps is restored into the lane;
        what the lane holds and is about to lose goes to the cache first.
        (The lane's prompt then keeps what it shares with the prompt, as
        :meth:`runtime.Engine.lane_prompt` keeps it.)"""
        held = self.model.lane_tokens(slot.id)
        if held != slot.tokens:
            slot.tokens, slot.logits = held, None
        if not job.cache_prompt:
            self._keep_lane(slot)
            return
        ct = self._can_truncate()
        have = C.usable_prefix(slot.tokens, slot.logits is not None, job.prompt, ct) if slot.tokens else 0
        entry, from_cache = self.cache.best(job.prompt, ct) if self.cache.enabled else (None, 0)
        if entry is not None and from_cache > have:
            if slot.tokens != entry.tokens:
                self._keep_lane(slot)
            self.model.lane_restore(slot.id, entry.snap)
            slot.tokens, slot.logits = list(entry.tokens), entry.logits
        elif have < len(slot.tokens):
            self._keep_lane(slot)       # what the lane holds goes (all of it, or past the shared prefix)

    def _attach(self, slot: Slot, task: _Task):
        """What every task gets when it takes a slot; returns its job."""
        job = task.job
        task.slot, slot.task = slot, task
        slot.t_last = time.monotonic()
        slot.n_decoded = 0
        task.t0 = time.perf_counter()
        task.routed0 = self._lane_routed(slot)
        task.sampler = Sampler(job.params)
        task.decoder = self.tok.stream()
        task.scan = StopScanner(job.stop)
        return job

    def _lane_routed(self, slot: Slot) -> np.ndarray | None:
        """The GPU engine's routed-expert (lookups, hits) on the slot's lane
        (its only sequence without lanes), or None off the engine."""
        routed = getattr(self.model, "lane_routed", None) if self.runtime else None
        return None if routed is None else routed[slot.id if self.lanes else self.model.lane].copy()

    def _begin(self, slot: Slot, task: _Task) -> None:
        job = self._attach(slot, task)
        eog = self.tok.eog_ids
        if self.lanes:                   # the prompt runs on the slot's lane in the next round
            task.pos = 0
            self._prepare_lane(slot, job)
            slot.cacheable = job.cache_prompt
            slot.protected = slot.id in self.protect and job.id_slot == slot.id
            task.history = list(job.prompt)
            return
        if not self.stepped:
            stop = () if job.ignore_eos else eog
            if self.mtp:
                task.spec = SpecStats()
                spec = dict(n_draft=self.n_draft, stats=task.spec, vocab=self.draft_vocab, adaptive=self.draft_policy)
                if self.runtime:            # the engine's loop: drafts checked in its verify steps
                    task.gen = self.model.speculative(job.prompt, job.n_predict, stop,
                                                      sampler=None if job.params.temp <= 0 else task.sampler, **spec)
                else:
                    task.gen = generate_speculative(self.model, job.prompt, job.n_predict, task.sampler, stop=stop,
                                                    **spec)
            else:
                # the GPU engine keeps what its sequence shares with the last one
                keep = {"cache_prompt": job.cache_prompt} if self.runtime else {}
                task.gen = self.model.tokens(job.prompt, job.n_predict, stop=stop,
                                             sampler=None if job.params.temp <= 0 else task.sampler, **keep)
            return
        task.n_cached = task.pos = self._prepare(slot, job)
        slot.cacheable = job.cache_prompt
        slot.protected = slot.id in self.protect and job.id_slot == slot.id
        task.history = list(job.prompt)

    def _begin_child(self, slot: Slot, task: _Task) -> None:
        """A completion of a group other than the first: it waits for the
        first one's prompt and starts from a copy of that state."""
        job = self._attach(slot, task)
        task.waiting = True
        slot.cacheable = False           # the parent's slot keeps the prompt for the cache
        slot.protected = False
        task.history = list(job.prompt)

    def _share_prompt(self, s: Slot) -> None:
        """The first task of a group has its prompt's state and logits:
        copy them into the waiting children's slots."""
        t = s.task
        if not t.children:
            return
        snap = C.snapshot(s.state, len(s.tokens))
        for c in t.children:
            cs = c.slot
            if not c.waiting or cs is None or cs.task is not c:
                continue
            self._keep_in_cache(cs)
            if cs.state is None:
                cs.state = self._new_state(cs)
            C.restore(snap, cs.state)
            cs.tokens, cs.logits = list(s.tokens), s.logits
            c.pos = c.n_cached = len(c.job.prompt)
            c.waiting = False
            self._sample(cs, cs.logits)
        t.children = []

    # ---------------------------------------------------------------- a round

    def _round(self, active: list[Slot]) -> None:
        self.n_rounds += 1
        if self._inflight is not None:
            self._land()
            active = [s for s in active if s.task is not None]
        for s in active:
            if s.task.cancel.is_set() or self._stopping:
                self._finish(s, "abort" if self._stopping else "stop", cancelled=True)
        active = [s for s in active if s.task is not None]
        if self.lanes:
            self._round_lanes(active)
            return
        if not self.stepped:
            for s in active:
                self._step_generator(s)
            return
        feed: list[tuple[Slot, list[int], bool]] = []     # (slot, tokens, whether the last one is sampled from)
        for s in active:
            t = s.task
            if t.waiting:
                if t.parent.done:      # the first one ended before its prompt did (cancelled, failed)
                    self._finish(s, "abort" if self._stopping else "stop", cancelled=True)
                continue
            if t.next_token is not None:
                feed.append((s, [t.next_token], True))
            elif t.pos < len(t.job.prompt):
                chunk = t.job.prompt[t.pos:t.pos + N_BATCH]
                feed.append((s, chunk, t.pos + len(chunk) == len(t.job.prompt)))
            else:                      # the whole prompt came from a cache, with its logits
                self._share_prompt(s)
                self._sample(s, s.logits)
        if not feed:
            return
        states = [s.state for s, _, _ in feed]
        toks = [tk for _, tk, _ in feed]
        if self._batched:
            outs = self.model.forward_batch(toks, states)
        else:
            outs = [self.model.forward(tk, st) for tk, st in zip(toks, states)]
        for (s, tk, last), out in zip(feed, outs):
            t = s.task
            s.tokens.extend(tk)
            s.logits = out[-1].detach()
            if t.next_token is not None:
                t.next_token = None
            else:
                t.pos += len(tk)
            if last:
                self._share_prompt(s)
                self._sample(s, s.logits)

    def _round_lanes(self, active: list[Slot]) -> None:
        """A round on the engine's lanes (slot i = lane i): a slot's new
        prompt runs on its lane (prefill, or one-token steps; what the lane
        already holds of it is kept), then one batched step of one token
        for every slot that has one to feed, launched: the next round reads
        and samples it (:meth:`_land`), or the loop does before a request
        takes a slot."""
        for s in active:
            t = s.task
            if t.pos < len(t.job.prompt):
                prompt = t.job.prompt
                if t.job.cache_prompt and s.logits is not None and s.tokens == prompt:
                    logits, t.n_cached = s.logits, len(prompt)      # the lane holds the prompt and its logits
                else:
                    logits, t.n_cached = self.model.lane_prompt(s.id, prompt, cache_prompt=t.job.cache_prompt)
                t.pos = len(prompt)
                s.tokens, s.logits = list(prompt), logits
                self._sample(s, logits)
        feed = [s for s in active if s.task is not None and s.task.next_token is not None]
        if feed:
            toks = [s.task.next_token for s in feed]
            self.model.launch_lanes([s.id for s in feed], toks)
            self._inflight = (feed, toks)       # read by the next round (_land), or before a lane call
        self._text()                            # while the step runs

    def _text(self) -> None:
        """The text of the tokens that :meth:`_land` took for slots going on
        (decoded, scanned for stop strings, sent), once their next step is
        launched: a stop string found here ends the request, and the row of
        the step in flight for it then only extends the lane's tokens (its
        state stays that of the tokens it holds)."""
        todo, self._deferred = self._deferred, []
        for s, t, tok in todo:
            if s.task is not t or t.done:
                continue                        # ended meanwhile (cancelled, server stopping)
            self._release(t, t.scan.add(t.decoder.add(tok)))
            if t.scan.stopped:
                self._finish(s, "stop")

    def _land_safely(self) -> None:
        """:meth:`_land` and :meth:`_text` outside a round: a failure fails the step's requests."""
        self._guarded(self._inflight[0], lambda: (self._land(), self._text()))

    def _land(self) -> None:
        """Read the batched step in flight: each row's token and logits go
        to its slot (the lane holds them now), then the rows of the slots
        still running are sampled; a cancelled one is left to the round's
        check."""
        feed, toks = self._inflight
        self._inflight = None
        outs = self.model.finish_lanes()
        rows = outs.unbind(0) if isinstance(outs, torch.Tensor) else list(outs)
        for s, tok, out in zip(feed, toks, rows):
            s.tokens.append(tok)
            s.logits = out
            if s.task is not None:
                s.task.next_token = None
        keep = [j for j, s in enumerate(feed)
                if s.task is not None and not s.task.cancel.is_set() and not self._stopping]
        if len(keep) < len(feed):
            feed, rows = [feed[j] for j in keep], [rows[j] for j in keep]
            outs = torch.stack(rows) if rows and isinstance(outs, torch.Tensor) else rows
        if not feed:
            return
        # the slots whose requests sample from the logits as they are (or with end-of-generation masked) are
        # sampled together, from one host array of the round's rows (sample_rows); the others one by one
        fast = [j for j, s in enumerate(feed) if self._plain(s.task.job)]
        got = [False] * len(feed)           # per row: False (sampled by _sample), None (nothing may follow), a token
        if fast:
            x = outs.detach().float().cpu().numpy() if isinstance(outs, torch.Tensor) else \
                np.array([np.asarray(r, dtype=np.float32).reshape(-1) for r in rows], dtype=np.float32)
            every = len(fast) == len(feed)
            if not every:
                x = x[fast]                       # a copy of those rows
            cols = None
            for i, j in enumerate(fast):
                t = feed[j].task
                if t.t_first is None:
                    t.t_first = time.perf_counter()
                if t.job.ignore_eos:
                    if cols is None:
                        cols = self._eog_cols(x.shape[1])
                        if every and len(cols):
                            x = x.copy()          # the slots keep the logits as they came
                    x[i, cols] = -np.inf
            live = np.isfinite(x).any(axis=1)
            if live.all():
                picked = sample_rows([feed[j].task.sampler for j in fast], x)
                for j, tk in zip(fast, picked):
                    got[j] = tk
            else:
                keep = [i for i in range(len(fast)) if live[i]]
                picked = sample_rows([feed[fast[i]].task.sampler for i in keep], x[keep])
                for j in fast:
                    got[j] = None
                for i, tk in zip(keep, picked):
                    got[fast[i]] = tk
        for s, out, tk in zip(feed, rows, got):
            if tk is False:
                self._sample(s, out)
            elif tk is None:
                self._finish(s, "stop")           # nothing may follow
            else:
                self._accept(s, tk, defer=True)

    @staticmethod
    def _plain(job: Job) -> bool:
        """Whether a request samples from the model's logits with at most
        its end-of-generation tokens masked (no bias, penalties, grammar or
        probabilities)."""
        return not (job.logit_bias or job.probs or job.constraint is not None or job.penalties.active)

    def _eog_cols(self, n: int) -> np.ndarray:
        """The end-of-generation ids below ``n``, as ``_adjusted`` masks them."""
        cols = self._eog_cache
        if cols is None or cols[0] != n:
            cols = self._eog_cache = (n, np.array(sorted(e for e in self.tok.eog_ids if 0 <= e < n), dtype=np.int64))
        return cols[1]

    def _adjusted(self, t: _Task, logits) -> np.ndarray:
        x = logits.detach().float().cpu().numpy().reshape(-1).copy() if isinstance(logits, torch.Tensor) \
            else np.array(logits, dtype=np.float32).reshape(-1)
        job = t.job
        n = x.size
        for tid, b in job.logit_bias.items():
            if 0 <= tid < n:
                x[tid] = -np.inf if b == -math.inf else x[tid] + b
        if job.ignore_eos:
            for e in self.tok.eog_ids:
                if e < n:
                    x[e] = -np.inf
        p = job.penalties
        if p.active:
            hist = t.history if p.last_n < 0 else t.history[-p.last_n:]
            if hist:
                ids, counts = np.unique(np.asarray(hist, dtype=np.int64), return_counts=True)
                keep = ids < n
                ids, counts = ids[keep], counts[keep].astype(np.float32)
                v = x[ids]
                v = np.where(v <= 0, v * p.repeat, v / p.repeat)
                v = v - counts * np.float32(p.frequency) - np.float32(p.presence)
                x[ids] = v
        if job.constraint is not None:
            x = job.constraint.mask(x)
        return x

    def _sample(self, s: Slot, logits) -> None:
        t = s.task
        if t.t_first is None:
            t.t_first = time.perf_counter()
        x = self._adjusted(t, logits)
        if not np.isfinite(x).any():
            self._finish(s, "stop")       # nothing may follow (a finished grammar)
            return
        tok = t.sampler(x)
        if t.job.probs:
            raw = logits.detach().float().cpu() if isinstance(logits, torch.Tensor) else torch.tensor(logits)
            lp = torch.log_softmax(raw.reshape(-1), -1)
            k = t.job.n_probs
            top = []
            if k:
                vals, ids = torch.topk(lp, min(k, lp.numel()))
                top = [(int(i), float(v)) for i, v in zip(ids, vals)]
            t.unsent.append(TokenProb(tok, float(lp[tok]), top))
        self._accept(s, tok)

    def _accept(self, s: Slot, tok: int, defer: bool = False) -> None:
        """Take a sampled token: end of generation, text, stop strings, limits.
        ``defer`` (a lane's plain request, so no grammar): when it goes on, its
        token is fed at once and its text waits for :meth:`_text`."""
        t = s.task
        job = t.job
        t.out_tokens.append(tok)
        t.history.append(tok)
        s.n_decoded += 1
        if job.constraint is not None:
            job.constraint.accept(tok)
        if tok in self.tok.eog_ids and not job.ignore_eos:
            self._finish(s, "stop")
            return
        if defer and len(t.out_tokens) < job.n_predict and len(s.tokens) + 1 <= s.n_ctx:     # goes on
            t.next_token = tok
            self._deferred.append((s, t, tok))
            return
        self._release(t, t.scan.add(t.decoder.add(tok)))
        if t.scan.stopped:
            self._finish(s, "stop")
        elif job.constraint is not None and job.constraint.finished():
            self._finish(s, "stop")
        elif len(t.out_tokens) >= job.n_predict:
            self._finish(s, "length")
        elif self._host_rounds and len(s.tokens) + 1 > s.n_ctx:
            self._finish(s, "length")
        elif self._host_rounds:
            t.next_token = tok

    def _release(self, t: _Task, text: str) -> None:
        if text or (t.unsent and t.done):
            t.pieces.append(text)
            probs, t.unsent = t.unsent, []
            t.probs.extend(probs)
            if t.emit is not None:
                t.emit(text, probs)

    def _step_generator(self, s: Slot) -> None:
        t = s.task
        try:
            tok = next(t.gen)
        except StopIteration:
            self._finish(s, "length")
            return
        if t.t_first is None:
            t.t_first = time.perf_counter()
        t.out_tokens.append(tok)
        s.n_decoded += 1
        if tok in self.tok.eog_ids and not t.job.ignore_eos:
            self._finish(s, "stop")
            return
        self._release(t, t.scan.add(t.decoder.add(tok)))
        if t.scan.stopped:
            self._finish(s, "stop")
        elif len(t.out_tokens) >= t.job.n_predict:
            self._finish(s, "length")

    # ---------------------------------------------------------------- ending a request

    def _finish(self, s: Slot, reason: str, cancelled: bool = False) -> None:
        t = s.task
        t.done = True
        if t.gen is not None:
            t.gen.close()
        if not t.scan.stopped and not cancelled:
            self._release(t, t.scan.add(t.decoder.flush()))
            if t.scan.stopped:
                reason = "stop"
            else:
                self._release(t, t.scan.finish())
        if t.unsent:
            self._release(t, "")
        t_end = time.perf_counter()
        t_first = t_end if t.t_first is None else t.t_first
        job = t.job
        if self.runtime and not self.lanes:
            t.n_cached = int(getattr(self.model, "cached_tokens", 0))
        res = Result("".join(t.pieces), reason, len(job.prompt), len(t.out_tokens), cancelled, t.scan.stop_word,
                     prompt_ms=1e3 * (t_first - t.t0), predicted_ms=1e3 * (t_end - t_first),
                     drafted=t.spec.drafted if t.spec else 0, accepted=t.spec.accepted if t.spec else 0,
                     n_cached=t.n_cached, id_slot=s.id, probs=t.probs, tokens=list(t.out_tokens))
        if not self._host_rounds:
            s.tokens, s.logits = [], None
        s.task = None
        s.t_last = time.monotonic()
        self.n_requests += 1
        self.n_prompt_total += res.n_prompt - res.n_cached
        self.n_cached_total += res.n_cached
        self.n_predicted_total += res.n_generated
        self.t_prompt_total += res.prompt_ms
        self.t_predicted_total += res.predicted_ms
        self.n_drafted_total += res.drafted
        self.n_accepted_total += res.accepted
        if self.log is not None:
            tm = res.timings()
            why = {"abort": "server shutting down"}.get(reason) if cancelled else None
            why = why or ("client gone" if cancelled else "stop string" if t.scan.stopped else
                          "end of generation" if reason == "stop" else "length")
            drafts = f", MTP drafts {res.accepted}/{res.drafted}" if res.drafted else ""
            hits = ""
            if t.routed0 is not None:
                n, h = (self._lane_routed(s) - t.routed0).tolist()
                hits = f", expert cache hit rate {100 * h / n:.1f} %" if n else ""
            print(f"fle-engine: slot {s.id}: prompt {res.n_prompt} tokens ({res.n_cached} cached, "
                  f"{tm['prompt_per_second']:.1f} t/s), generated {res.n_generated} tokens "
                  f"({tm['predicted_per_second']:.1f} t/s), {why}, seed {t.sampler.seed}{drafts}{hits}",
                  file=self.log, flush=True)
        t.future.set_result(res)

    def _fail(self, s: Slot, e: BaseException) -> None:
        t = s.task
        s.task = None
        s.state, s.tokens, s.logits = None, [], None    # its state is not trustworthy now
        if self.lanes:
            try:
                self.model.lane_reset(s.id)
            except Exception:  # noqa: BLE001 - the lane starts afresh at its next prompt anyway
                pass
        if t is not None and not t.future.done():
            t.future.set_exception(e)

    def _abort_all(self) -> None:
        for s in self.slots:
            if s.task is not None:
                try:
                    self._finish(s, "abort", cancelled=True)
                except Exception as e:  # noqa: BLE001
                    self._fail(s, e)
        for task in [t for p in self._pending for t in (p, *p.children)]:
            if not task.future.done():
                if task.job is None:
                    task.future.set_exception(FleError("the server is shutting down"))
                else:
                    task.future.set_result(Result("", "abort", len(task.job.prompt), 0, cancelled=True))
        self._pending.clear()

    # ---------------------------------------------------------------- slot files

    def _slot_file(self, name: str | None) -> str:
        if not self.slot_save_path:
            raise FleError("slot save and restore need --slot-save-path")
        if not name or not isinstance(name, str) or os.path.basename(name) != name or name in (".", ".."):
            raise FleError(f"invalid slot file name {name!r}: a plain file name is needed")
        return os.path.join(self.slot_save_path, name)

    def _do_action(self, s: Slot, action: str, sid: int, arg: str | None) -> dict:
        t0 = time.perf_counter()
        if action == "erase":
            n = len(s.tokens)
            s.state, s.tokens, s.logits, s.protected = None, [], None, False
            if self.lanes:
                self.model.lane_reset(sid)
            return {"id_slot": sid, "n_erased": n}
        if not self._host_rounds:
            raise FleError("slot save and restore run on the reference path or the engine's lanes, without MTP")
        if self.lanes and action in ("save", "restore"):
            return self._lane_action(s, action, sid, arg, t0)
        if action == "save":
            path = self._slot_file(arg)
            if s.state is None or not s.tokens:
                raise FleError(f"slot {sid} holds nothing to save")
            nbytes = C.save_file(path, s.tokens, C.snapshot(s.state, len(s.tokens)), s.logits, self.model.arch)
            return {"id_slot": sid, "filename": arg, "n_saved": len(s.tokens), "n_written": nbytes,
                    "timings": {"save_ms": 1e3 * (time.perf_counter() - t0)}}
        if action == "restore":
            path = self._slot_file(arg)
            tokens, snap, logits, nbytes = C.load_file(path, self.model.arch)
            if snap.n > s.n_ctx:
                raise FleError(f"the saved slot holds {snap.n} tokens; a slot here holds {s.n_ctx}")
            if s.state is None:
                s.state = self._new_state(s)
            C.restore(snap, s.state)
            s.tokens, s.logits, s.cacheable = tokens, logits, True
            s.protected = sid in self.protect              # restored by name: the slot's own conversation
            return {"id_slot": sid, "filename": arg, "n_restored": len(tokens), "n_read": nbytes,
                    "timings": {"restore_ms": 1e3 * (time.perf_counter() - t0)}}
        raise FleError(f"unknown slot action {action!r}: expected save, restore or erase")

    def _lane_action(self, s: Slot, action: str, sid: int, arg: str | None, t0: float) -> dict:
        """Save or restore a slot on the engine's lanes: the lane's snapshot
        (:meth:`runtime.Engine.lane_snapshot`) in the slot file."""
        path = self._slot_file(arg)
        arch = self.model.arch
        if action == "save":
            held = self.model.lane_tokens(sid)
            if not s.tokens or held != s.tokens:
                raise FleError(f"slot {sid} holds nothing to save")
            logits = s.logits.clone() if s.logits is not None else None
            nbytes = C.save_file(path, s.tokens, self.model.lane_snapshot(sid), logits, arch)
            return {"id_slot": sid, "filename": arg, "n_saved": len(s.tokens), "n_written": nbytes,
                    "timings": {"save_ms": 1e3 * (time.perf_counter() - t0)}}
        tokens, snap, logits, nbytes = C.load_file(path, arch, lanes=True)
        if snap.n > s.n_ctx:
            raise FleError(f"the saved slot holds {snap.n} tokens; a slot here holds {s.n_ctx}")
        try:
            self.model.lane_restore(sid, snap)
        except FleError:
            self.model.lane_reset(sid)
            s.tokens, s.logits = [], None
            raise
        s.tokens, s.logits, s.cacheable = list(tokens), logits, True
        s.protected = sid in self.protect
        return {"id_slot": sid, "filename": arg, "n_restored": len(tokens), "n_read": nbytes,
                "timings": {"restore_ms": 1e3 * (time.perf_counter() - t0)}}


def default_ctx_size(n_ctx_train: int | None, requested: int | None) -> int:
    """``--ctx-size``: None -> the model's context length capped at
    :data:`CTX_CAP`; 0 -> the model's own; N -> N."""
    if requested is None:
        return min(n_ctx_train, CTX_CAP) if n_ctx_train else CTX_CAP
    if requested == 0:
        return n_ctx_train if n_ctx_train else CTX_CAP
    return requested
