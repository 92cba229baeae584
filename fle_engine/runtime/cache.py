"""The GPU expert cache as the engine runs it: slots under one byte budget,
the expert->slot map on the device, and the cache policy kept off the
critical path.

Per decode step the graph logs every layer's routed ids (and whether the
map it read had them) into a device buffer; the engine copies that buffer
to pinned host memory once per step, asynchronously. The host then runs
the policy for all layers at once (:class:`~fle_engine.expert_cache.BatchedCache`)
while the GPU runs the next step, and applies the decisions at the next
step boundary (:meth:`ExpertCache.boundary`):

1. the admissions copied at the previous boundary become visible: the main
   stream waits for their copy event, and their map entries are set;
2. the new decisions' victims leave the map (so no later step reads the
   slots about to be overwritten); the map is written to the device from a
   pinned staging buffer on the main stream, and an event marks the point;
3. the new admissions' bytes are copied from the host buffer into their
   slots on a side stream that waits for that event; the next boundary
   makes them visible. With the experts memory-mapped in the file
   (:class:`~fle_engine.runtime.weights.MappedExperts`) they are first
   packed into a page-locked buffer, after the host has waited for the
   previous boundary's copy out of it.

So a decision taken from step t's routing is made while step t + 1 runs,
its copy runs beside step t + 2 and it serves from step t + 3 on; no replay
reads a slot while it is written, and neither the GPU nor the host waits
for a copy. Without CUDA the same sequence runs synchronously (tests check the
lag on the CPU).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fle_quant.errors import FleError

from .. import cached_moe
from ..expert_cache import BatchedCache, CachePolicy, plan_slots
from ..kernels import engine_ops
from . import cudacalls
from .weights import ExpertLayout, HostExperts, MappedExperts, PackBuffer, _align, pack_experts

__all__ = ["ExpertCache", "CacheStats"]


def expert_products(cache: "ExpertCache | ResidentExperts", l: int, lay: ExpertLayout, n_embd: int,
                    fast: bool) -> tuple[tuple, tuple]:
    """Layer ``l``'s two routed-expert products as the leading arguments of ``ops.experts`` (words or
    store, type, host distance, part offset, expert size in words, output rows, row bytes), gate+up
    then down: the fast kernels' words when ``fast``, else the reference store."""
    parts = []
    for qtype, part, n_out, row_bytes in ((lay.gu_type, 0, lay.n_ff, lay.gu_row_bytes),
                                          (lay.down_type, lay.down_offset, n_embd, lay.down_row_bytes)):
        if fast:
            words, delta = cache.words(l, qtype)
            wsz = words.element_size()
            parts.append((words, qtype, delta, part // wsz, lay.expert_bytes // wsz, n_out, row_bytes))
        else:
            st = cache.reference_store(l, qtype)
            parts.append((st, qtype, 0, part // st.word, 0, n_out, row_bytes))
    return parts[0], parts[1]


@dataclass
class CacheStats(cached_moe.CacheStats):
    # the steps' rows: a batched step of the lanes or a verify step carries several tokens, a decode step one
    tokens: int = 0
    host_seconds: float = 0.0          # policy + boundary work on the host
    boundary_seconds: float = 0.0      # of which applying decisions at step boundaries (map, copies, events)

    def misses_per_step(self) -> float:
        return (self.requests - self.hits) / self.steps if self.steps else 0.0

    def misses_per_token(self) -> float:
        return (self.requests - self.hits) / self.tokens if self.tokens else 0.0


class ExpertCache:
    """Slots for the routed experts of every MoE layer under ``budget_bytes``."""

    def __init__(self, layouts: dict[int, ExpertLayout], host: "HostExperts | MappedExperts", n_expert: int,
                 budget_bytes: int,
                 device: torch.device, policy: CachePolicy = CachePolicy(), profile=None, stage_rows: int = 0):
        self.layers = sorted(layouts)
        self.layouts, self.host, self.n_expert, self.device = layouts, host, n_expert, device
        self.cuda = device.type == "cuda"
        counts = None if profile is None else {l: profile.counts[l] for l in self.layers if l in profile.counts}
        if counts is not None and len(counts) != len(self.layers):
            counts = None
        sizes = {l: layouts[l].expert_bytes for l in self.layers}
        self.stage_rows = max(0, int(stage_rows))
        stage_bytes = self._stage_bytes(sizes)
        self.slots_per_layer = plan_slots(max(0, int(budget_bytes) - stage_bytes), sizes, n_expert, counts)
        self._layout(sizes)
        self.slots = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        self.map = torch.full((len(self.layers), n_expert), -1, dtype=torch.int32, device=device)
        self.index = {l: i for i, l in enumerate(self.layers)}
        # the expert kernels' launch configuration: misses possible, or every expert cached
        self.mode = "hit" if all(self.slots_per_layer[l] >= n_expert for l in self.layers) else "miss"
        cnt = None if counts is None else np.stack([np.asarray(counts[l], np.float64) for l in self.layers])
        self.policy = BatchedCache(n_expert, [self.slots_per_layer[l] for l in self.layers], policy, cnt)
        # compile the policy's kernel now (numba, ~0.5 s on first use), not inside the first steps
        BatchedCache(n_expert, [1], policy).step(np.zeros((1, 1), np.int32))
        self.mirror = np.full((len(self.layers), n_expert), -1, np.int32)     # what the device map holds
        self.expert_in = [np.full(max(1, self.slots_per_layer[l]), -1, np.int64) for l in self.layers]
        self._slot2d = {l: self._slot_view(l) for l in self.layers}
        self._host2d = {l: host.rows(l) for l in self.layers}
        self.stats = CacheStats()
        self._pending: list[tuple[np.ndarray, ...]] = []
        self._in_flight: list[tuple[int, int, int]] = []
        self._copy_event = None
        if self.cuda:
            self.calls = cudacalls.pick(device)       # the runtime's own calls between steps (host time)
            # the stream the steps run on: the device's default stream, in any thread (the engine never
            # replays a step under another stream)
            self.main = torch.cuda.current_stream(device)
            self.copy_stream = torch.cuda.Stream(device)
            self._staging = [torch.empty_like(self.map, device="cpu").pin_memory() for _ in range(4)]
            self._staging_events = [self.calls.event() for _ in range(4)]
            self._next_staging = 0
            self._pack = PackBuffer(pin=True) if host.mapped else None
            self._mark = self.calls.event()
            self._copied = self.calls.event()

    # layout ------------------------------------------------------------------------
    def _stage_bytes(self, sizes: dict[int, int]) -> int:
        """Bytes the prefetch rows (``stage_rows`` per layer, runtime.stage)
        take from the budget: two buffers of ``stage_rows`` experts shared by
        the layers of the most common expert size (a layer uses buffer
        ``its rank % 2``), and rows of their own for the other layers."""
        self.stage_size = self._stage_total = 0
        if not self.stage_rows:
            return 0
        r = self.stage_rows
        common = max(set(sizes.values()), key=lambda b: (list(sizes.values()).count(b), b))
        self.stage_size = common if common % 4 == 0 else 0
        own = sum(r * b for b in sizes.values() if b != self.stage_size)
        self._stage_total = 2 * r * self.stage_size + own
        return self._stage_total

    def _layout(self, sizes: dict[int, int]) -> None:
        """One device buffer for every slot. Layer regions on 256-byte
        boundaries; with prefetch rows, the regions of the common expert size
        start at multiples of it and the two shared buffers follow them all,
        so that their rows are slot numbers of each such layer."""
        self.region, off = {}, 0
        r, common = self.stage_rows, self.stage_size
        self.stage_first: dict[int, tuple[int, int]] = {}        # layer -> first stage slot of buffers 0 and 1
        for l in self.layers:
            eb = sizes[l]
            if r and eb == common:
                off = -(-off // eb) * eb
            self.region[l] = off
            rows = max(1, self.slots_per_layer[l])
            if r and eb != common:
                self.stage_first[l] = (rows, rows)
                rows += r
            off = _align(off + rows * eb, 256)
        if r and common:
            off = -(-off // common) * common
            for l in self.layers:
                if sizes[l] == common:
                    s0 = (off - self.region[l]) // common
                    self.stage_first[l] = (s0, s0 + r)
            off += 2 * r * common
        self.nbytes = _align(off, 256)
        self.stage_end = {l: self.region[l] + (max(self.stage_first[l]) + r) * sizes[l] for l in self.stage_first}

    @property
    def stage_nbytes(self) -> int:
        """Bytes of the prefetch rows (taken from the budget)."""
        return self._stage_total

    def stage_view(self, l: int) -> Tensor:
        """uint8 [rows, expert_bytes]: layer ``l``'s slots and, past them, the
        rows its prefetch slot numbers address (``stage_first``)."""
        lay = self.layouts[l]
        o = self.region[l]
        end = self.stage_end.get(l, o + max(1, self.slots_per_layer[l]) * lay.expert_bytes)
        return self.slots[o:end].view(-1, lay.expert_bytes)

    # addresses for the kernels ------------------------------------------------
    def slot_view(self, l: int) -> Tensor:
        """uint8 [slots, expert_bytes] of layer ``l`` (at least one row)."""
        return self._slot2d[l]

    def _slot_view(self, l: int) -> Tensor:
        lay = self.layouts[l]
        n = max(1, self.slots_per_layer[l]) * lay.expert_bytes
        o = self.region[l]
        return self.slots[o:o + n].view(-1, lay.expert_bytes)

    def words(self, l: int, qtype) -> tuple[Tensor, int]:
        """(the layer's slots as the fast kernels' words for ``qtype``, the
        host buffer's distance from them in words)."""
        dt = engine_ops.WORDS[qtype]
        w = self.slot_view(l).reshape(-1).view(dt)
        size = w.element_size()
        if self.host.mapped:
            # no address to give: with the experts memory-mapped the engine gives every miss to the CPU
            # (Engine._setup_split), so the kernels never read at this distance
            return w, 0
        delta = self.host.address(l) - w.data_ptr()
        if delta % size:
            raise FleError("internal: expert buffers are not word-aligned")
        return w, delta // size

    def reference_store(self, l: int, qtype) -> engine_ops.ExpertWords:
        # types without a fast kernel (float experts) run on the reference side only: offsets in bytes
        word = engine_ops.WORDS[qtype].itemsize if qtype in engine_ops.WORDS else 1
        return engine_ops.ExpertWords(self.stage_view(l), self._host2d[l], word)

    def layer_map(self, l: int) -> Tensor:
        return self.map[self.index[l]]

    @property
    def budget_used(self) -> int:
        return sum(self.slots_per_layer[l] * self.layouts[l].expert_bytes for l in self.layers)

    # warm start ------------------------------------------------------------------
    def warm(self, profile) -> int:
        """Fill the slots with each layer's most requested experts of
        ``profile``; returns the experts loaded."""
        rankings = [np.argsort(-np.asarray(profile.counts[l], np.float64), kind="stable") for l in self.layers]
        adm = self.policy.fill(rankings)
        self._copy_now(adm)
        return len(adm[0])

    def fill_whole_layers(self) -> int:
        """Load every expert of each layer whose slots can hold them all (as
        llama.cpp's -ngl 99 loads a layer's experts), so that those layers
        never miss from the first step; other layers start as they were.
        Returns the experts loaded."""
        rankings = [np.arange(self.n_expert) if self.slots_per_layer[l] >= self.n_expert else None
                    for l in self.layers]
        if all(r is None for r in rankings):
            return 0
        adm = self.policy.fill(rankings)
        self._copy_now(adm)
        return len(adm[0])

    def _copy_now(self, adm) -> None:
        layer, expert, slot, _ = adm
        for li, e, s in zip(layer.tolist(), expert.tolist(), slot.tolist()):
            l = self.layers[li]
            self.slot_view(l)[s].copy_(self._host2d[l][e])
            self._set(li, e, s)
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self.map.copy_(torch.from_numpy(self.mirror))

    def _set(self, li: int, e: int, s: int) -> None:
        old = self.expert_in[li][s]
        if old >= 0 and self.mirror[li, old] == s:
            self.mirror[li, old] = -1
        self.expert_in[li][s] = e
        self.mirror[li, e] = s

    # one step ---------------------------------------------------------------------
    def observe(self, ids: np.ndarray, hits: np.ndarray, tokens: int = 1) -> None:
        """The routed ids [L, N] of one finished step of ``tokens`` rows (N =
        rows x K) and the device's hit flags for them: statistics, then the
        policy's decisions (applied at the next boundary)."""
        t0 = time.perf_counter()
        st = self.stats
        st.steps += 1
        st.tokens += tokens
        st.requests += ids.size
        st.hits += int(np.count_nonzero(hits))
        _, adm = self.policy.step(ids)
        if len(adm[0]):
            self._pending.append(tuple(np.array(a) for a in adm))   # the policy reuses its output buffers
        st.host_seconds += time.perf_counter() - t0

    def boundary(self) -> None:
        """Apply what the host decided, between two steps (see the module
        docstring). Issues device work only; never waits for the GPU
        except for a staging buffer four boundaries old."""
        t0 = time.perf_counter()
        changed = False
        main = self.main if self.cuda else None
        if self._in_flight:
            if self.cuda and self._copy_event is not None:
                self.calls.wait(main, self._copy_event)
            for li, e, s in self._in_flight:
                if self.policy.slot_of[li, e] == s and self.expert_in[li][s] == e:
                    self.mirror[li, e] = s
                    changed = True
            self._in_flight = []
        new: list[tuple[int, int, int]] = []
        for layer, expert, slot, _ in self._pending:
            for li, e, s in zip(layer.tolist(), expert.tolist(), slot.tolist()):
                old = self.expert_in[li][s]
                if old >= 0 and self.mirror[li, old] == s:
                    self.mirror[li, old] = -1          # the victim leaves the map before its slot is written
                    changed = True
                self.expert_in[li][s] = e
                new.append((li, e, s))
        self._pending = []
        if changed:
            self._write_map(main)
        if new:
            self.stats.admissions += len(new)
            self._copy(new, main)
            self._in_flight = new
        dt = time.perf_counter() - t0
        self.stats.host_seconds += dt
        self.stats.boundary_seconds += dt

    def _write_map(self, main=None) -> None:
        if not self.cuda:
            self.map.copy_(torch.from_numpy(self.mirror))
            return
        i = self._next_staging
        self._next_staging = (i + 1) % len(self._staging)
        c, ev = self.calls, self._staging_events[i]
        c.synchronize(ev)                       # the copy out of this staging buffer, four writes ago, is done
        self._staging[i].numpy()[...] = self.mirror
        c.copy(self.map, self._staging[i], main)
        c.record(ev, main)

    def _copy(self, new: list[tuple[int, int, int]], main=None) -> None:
        if not self.cuda:
            for li, e, s in new:
                l = self.layers[li]
                self._slot2d[l][s].copy_(self._host2d[l][e])
            return
        c, cs = self.calls, self.copy_stream
        c.record(self._mark, main)              # the map without the victims is written before their slots are
        c.wait(cs, self._mark)
        by_layer: dict[int, tuple[list, list]] = {}
        for li, e, s in new:
            rows = by_layer.setdefault(li, ([], []))
            rows[0].append(s)
            rows[1].append(e)
        packed = self._packed(by_layer) if self.host.mapped else {}
        for li, (slots, experts) in by_layer.items():
            l = self.layers[li]
            src, rows = packed.get(li, (self._host2d[l], experts))
            c.copy_rows(self._slot2d[l], slots, src, rows, cs)
        c.record(self._copied, cs)              # the next boundary's wait is made before this is recorded again
        self._copy_event = self._copied

    def _packed(self, by_layer: dict) -> dict:
        """Memory-mapped experts: each layer's admitted experts packed into
        the page-locked pack buffer -> {layer index: (uint8 [n, expert_bytes]
        rows, their row numbers)}."""
        if self._copy_event is not None:
            self.calls.synchronize(self._copied)       # the previous boundary's copy out of the buffer is done
        sizes = {li: self.layouts[self.layers[li]].expert_bytes for li in by_layer}
        flat = self._pack.take(sum(len(ex) * sizes[li] for li, (_, ex) in by_layer.items()))
        out, off = {}, 0
        for li, (_, experts) in by_layer.items():
            n, eb = len(experts), sizes[li]
            rows = flat[off:off + n * eb].reshape(n, eb)
            self.host.gather(self.layers[li], experts, rows)
            out[li] = (torch.from_numpy(rows), list(range(n)))
            off += n * eb
        return out

    def profile_counts(self) -> dict[int, np.ndarray]:
        c = self.policy.counts
        return {l: np.array(c[i]) for i, l in enumerate(self.layers)}


class ResidentExperts:
    """Every routed expert of a few layers held on the device, each in the
    slot of its own number (the map is the identity): the store that the
    expert kernels read for a block outside the cache's budget, the MTP
    head's (:mod:`.mtp`). It answers what :class:`ExpertCache` answers for
    a layer (``layer_map``, ``words``, ``reference_store``, ``mode``);
    nothing ever misses, so it has no policy and no host buffer to read."""

    mode = "hit"

    def __init__(self, layouts: dict[int, ExpertLayout], sources: dict[int, list], n_expert: int,
                 device: torch.device):
        self.layers = sorted(layouts)
        self.layouts, self.n_expert, self.device = layouts, n_expert, device
        self._slots = {l: torch.from_numpy(pack_experts(layouts[l], sources[l], slice(None),
                                                        np.empty((n_expert, layouts[l].expert_bytes), np.uint8)))
                       .to(device) for l in self.layers}
        self.map = torch.arange(n_expert, dtype=torch.int32, device=device).repeat(len(self.layers), 1)
        self.index = {l: i for i, l in enumerate(self.layers)}
        self.nbytes = sum(t.numel() for t in self._slots.values())

    def layer_map(self, l: int) -> Tensor:
        return self.map[self.index[l]]

    def words(self, l: int, qtype) -> tuple[Tensor, int]:
        """(layer ``l``'s experts as the fast kernels' words for ``qtype``, 0:
        no host buffer, every expert is read from its slot)."""
        return self._slots[l].reshape(-1).view(engine_ops.WORDS[qtype]), 0

    def reference_store(self, l: int, qtype) -> engine_ops.ExpertWords:
        word = engine_ops.WORDS[qtype].itemsize if qtype in engine_ops.WORDS else 1
        return engine_ops.ExpertWords(self._slots[l], self._slots[l], word)
