"""Prefill on the engine: a prompt processed in micro-batches of up to
``ubatch`` tokens, each layer's routed experts streamed from host memory
into GPU staging memory while the layer before computes.

Per micro-batch and layer:

1. the mixer (attention) over the batch's tokens, through the
   architecture's ``prefill_mixer`` (dense products by the GEMM kernel,
   attention over the cache and the batch);
2. the router and top-K for every token, the (token, expert) rows sorted
   and padded by expert (:func:`pad_by_expert`, on the device, no host
   synchronisation);
3. the routed experts by the GEMM kernel (:mod:`fle_engine.kernels.triton_gemm`):
   an expert with a cache slot is read from it in place, every other one
   from a staging buffer that the copy stream filled with all the layer's
   uncached experts (at a micro-batch this large nearly every expert is
   routed, so whole layers move, in one copy per run of consecutive
   experts).

Staging is a ring of ``depth`` (2) layer-sized buffers, so the copy of
layer l + 1 overlaps the computation of layer l and a buffer is refilled
only after the layer that read it has finished (events order both
streams). The memory is lent by the expert cache from the back of its slot
buffer (:meth:`Staging.lend`): the layers whose slots it covers count as
uncached for the prefill and their slots are copied back from host memory
afterwards; when the slot buffer is smaller than the ring, the ring is
allocated instead. The cache policy does not see prefill routing (a prompt
touches every expert once; the policy learns from decode steps).

Measure (``PrefillStats``): tokens, seconds, bytes copied, and the time the
compute stream stood waiting for a copy (copying without computing).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..kernels import engine_ops
from .weights import FLOAT_TYPES, _align

__all__ = ["pad_by_expert", "Prefill", "PrefillStats", "Staging", "dense_rows"]


def pad_by_expert(ids: Tensor, n_expert: int, block_m: int) -> tuple[Tensor, Tensor]:
    """The (token, expert) rows of ``ids`` [T, K] sorted by expert, each
    expert's rows padded to a multiple of ``block_m``: (rows int64 [P], the
    flat row ``t * K + j`` of each padded place or -1; the expert of each
    block of ``block_m`` places, int64 [P / block_m], -1 past the last).
    P is the bound ``T * K + n_expert * (block_m - 1)`` rounded up, so the
    shapes depend on T only. Device operations only."""
    flat = ids.reshape(-1)
    dev = flat.device
    r = flat.numel()
    n_blk = (r + n_expert * (block_m - 1) + block_m - 1) // block_m
    order = torch.argsort(flat, stable=True)
    cnt = torch.zeros(n_expert, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    pcnt = (cnt + block_m - 1) // block_m * block_m
    pend = torch.cumsum(pcnt, 0)
    start = torch.cumsum(cnt, 0) - cnt
    e_sorted = flat[order]
    place = (pend - pcnt)[e_sorted] + torch.arange(r, device=dev) - start[e_sorted]
    rows = torch.full((n_blk * block_m,), -1, dtype=torch.int64, device=dev)
    rows[place] = order
    first = torch.arange(n_blk, device=dev) * block_m
    blk = torch.searchsorted(pend, first, right=True)
    blk_expert = torch.where(blk < n_expert, blk, torch.full_like(blk, -1))
    return rows, blk_expert


def dense_rows(m, x: Tensor, out: Tensor, ops, bf16: "bool | None" = None, block_m: int = 64) -> Tensor:
    """``out`` [T, n_out] = x [T, n_in] @ W.T for a DenseMatrix ``m``, every
    row at once (the GEMM kernel, ``bf16`` inputs or float32; a float matrix
    by torch)."""
    if m.qtype in FLOAT_TYPES:
        out.copy_(torch.matmul(x, m.data.T))
        return out
    n_blk = (x.shape[0] + block_m - 1) // block_m
    blk = torch.zeros(n_blk, dtype=torch.int64, device=x.device)
    return ops.gemm(engine_ops.WordSpace(m.data), m.qtype, blk, None, x, out, m.n_out, m.data.shape[1], "dense",
                    block_m=block_m, bf16=bf16)


@dataclass
class PrefillStats:
    tokens: int = 0
    seconds: float = 0.0
    ubatches: int = 0
    bytes_copied: int = 0
    copy_wait_seconds: float = 0.0        # the compute stream waiting for a layer's copy (CUDA only)
    lent_layers: list = field(default_factory=list)

    def line(self) -> str:
        tps = self.tokens / self.seconds if self.seconds else 0.0
        return (f"prefill: {self.tokens} tokens in {self.ubatches} micro-batches, {self.seconds * 1e3:.1f} ms "
                f"({tps:.1f} tok/s); experts streamed {self.bytes_copied / 1e9:.2f} GB, compute waiting for "
                f"copies {self.copy_wait_seconds * 1e3:.1f} ms")


class Staging:
    """The ring of layer-sized staging buffers, and which experts of each
    layer are read from it.

    ``lend``: the memory from the back of the cache's slot buffer when it is
    large enough, else a buffer of its own. ``base_words(l, j, qtype,
    part)``: per expert of layer l, the word offset (from the slot buffer)
    of its matrix when ring buffer j holds the layer. ``runs(l)``: the
    (first expert, count) runs that the copy moves."""

    def __init__(self, cache, depth: int = 2):
        self.cache, self.depth = cache, depth
        lays = cache.layouts
        self.size = _align(max(cache.n_expert * lays[l].expert_bytes for l in cache.layers), 256)
        need = depth * self.size
        self.own = None
        self.lent_layers: list[int] = []
        if cache.nbytes >= need:
            start = cache.nbytes - need
            self.ring_offset = start
            for l in cache.layers:
                lo = cache.region[l]
                hi = lo + max(1, cache.slots_per_layer[l]) * lays[l].expert_bytes
                if hi > start and cache.slots_per_layer[l] > 0:
                    self.lent_layers.append(l)
            self.buffer = cache.slots[start:start + need]
        else:
            self.own = torch.empty(need, dtype=torch.uint8, device=cache.device)
            self.buffer = self.own
            self.ring_offset = self.own.data_ptr() - cache.slots.data_ptr()
        self.space = engine_ops.WordSpace(cache.slots, *([self.own] if self.own is not None else []))
        lent = set(self.lent_layers)
        # which experts are read from their slots (the map as the host mirrors it; lent layers have none)
        self.slot_of = {}
        for i, l in enumerate(cache.layers):
            s = cache.mirror[i].astype(np.int64).copy()
            if l in lent:
                s[:] = -1
            self.slot_of[l] = s
        self._tables: dict = {}

    def nbytes_lent(self) -> int:
        return 0 if self.own is not None else self.depth * self.size

    def runs(self, l: int) -> list[tuple[int, int]]:
        miss = np.flatnonzero(self.slot_of[l] < 0)
        out = []
        for e in miss.tolist():
            if out and out[-1][0] + out[-1][1] == e:
                out[-1] = (out[-1][0], out[-1][1] + 1)
            else:
                out.append((e, 1))
        return out

    def ring(self, j: int) -> Tensor:
        return self.buffer[j * self.size:(j + 1) * self.size]

    def base_words(self, l: int, j: int, qtype, part_bytes: int) -> Tensor:
        """int64 [E] word offsets (device) of layer l's experts' matrix that
        starts ``part_bytes`` into an expert, with ring buffer j holding the
        layer's uncached experts."""
        key = (l, j, int(qtype), part_bytes)
        t = self._tables.get(key)
        if t is None:
            c, lay = self.cache, self.cache.layouts[l]
            eb = lay.expert_bytes
            word = engine_ops.WORDS[qtype].itemsize
            s = self.slot_of[l]
            e = np.arange(c.n_expert, dtype=np.int64)
            off = np.where(s >= 0, c.region[l] + s * eb, self.ring_offset + j * self.size + e * eb) + part_bytes
            if np.any(off % word):
                raise AssertionError("internal: expert matrices are not word-aligned")
            t = torch.from_numpy(off // word).to(c.device)
            self._tables[key] = t
        return t

    def give_back(self) -> None:
        """Copy the lent layers' cached experts back into their slots."""
        c = self.cache
        for l in self.lent_layers:
            li = c.index[l]
            for s, e in enumerate(c.expert_in[li].tolist()):
                if e >= 0:
                    c.slot_view(l)[s].copy_(c.host.view(l)[e], non_blocking=True)
        self.lent_layers = []


class Prefill:
    """Prompt processing for an :class:`~fle_engine.runtime.engine.Engine`
    (see the module docstring). ``run(tokens, pos0)`` leaves the greedy
    next token in ``state.tok``, the last token's logits in
    ``state.bufs.logits`` and ``state.pos`` at ``pos0 + len(tokens)``."""

    def __init__(self, engine, ubatch: int = 4096, block_m: int = 64, depth: int = 2, bf16: "bool | None" = None):
        self.eng, self.ubatch, self.block_m, self.depth = engine, int(ubatch), int(block_m), int(depth)
        # the GEMMs' inputs: bfloat16 on tensor cores (None: on CUDA), or float32 (checks, the interpreter)
        self.bf16 = bf16
        self.stats = PrefillStats()

    def run(self, tokens, pos0: int = 0) -> PrefillStats:
        eng = self.eng
        net, st, ops, cache = eng.net, eng.state, eng.ops, eng.cache
        a, dev, cuda = net.args, eng.device, eng.cuda
        t0 = time.perf_counter()
        stats = PrefillStats()
        main = torch.cuda.current_stream(dev) if cuda else None
        if cuda:
            main.wait_stream(cache.copy_stream)              # admissions in flight land before slots are lent
        stg = Staging(cache, self.depth)
        st.prefill_bf16 = self.bf16
        stats.lent_layers = list(stg.lent_layers)
        copy = torch.cuda.Stream(dev) if cuda else None
        if cuda:
            copy.wait_stream(main)
        layers = [il for il in range(a.n_layer)]
        n_moe = len(layers)
        done_ev: list = []                                   # per global layer: compute finished reading
        copy_ev: list = []
        waits: list = []
        host_t = cache.host.tensor

        def issue_copy(g: int) -> None:
            il = layers[g % n_moe]
            j = g % self.depth
            dst = stg.ring(j)
            eb = cache.layouts[il].expert_bytes
            src_off = cache.host.offsets[il]
            if cuda:
                with torch.cuda.stream(copy):
                    if g >= self.depth:
                        copy.wait_event(done_ev[g - self.depth])
                    for e0, n in stg.runs(il):
                        dst[e0 * eb:(e0 + n) * eb].copy_(host_t[src_off + e0 * eb:src_off + (e0 + n) * eb],
                                                         non_blocking=True)
                    ev = torch.cuda.Event(enable_timing=True)
                    ev.record(copy)
                copy_ev.append(ev)
            else:
                for e0, n in stg.runs(il):
                    dst[e0 * eb:(e0 + n) * eb].copy_(host_t[src_off + e0 * eb:src_off + (e0 + n) * eb])
                copy_ev.append(None)
            stats.bytes_copied += sum(n for _, n in stg.runs(il)) * eb

        toks = [int(t) for t in tokens]
        chunks = [toks[i:i + self.ubatch] for i in range(0, len(toks), self.ubatch)]
        n_glob = len(chunks) * n_moe
        for g in range(min(self.depth, n_glob)):
            issue_copy(g)
        g = 0
        pos = int(pos0)
        with torch.inference_mode():
            for chunk in chunks:
                T = len(chunk)
                tok = torch.tensor(chunk, dtype=torch.int64, device=dev)
                x = net.prefill_embed(tok, ops)
                xn = torch.empty_like(x)
                ops.add_rmsnorm(x, None, net.layers[0].attn_norm, a.eps, xn)
                buf = _Buffers(a, T, self.block_m, dev)
                for il in layers:
                    L = net.layers[il]
                    net.prefill_mixer(L, il, xn, buf.attn_out, pos, st, ops)
                    ops.add_rmsnorm(x, buf.attn_out.view(T, 1, -1), L.ffn_norm, a.eps, xn)
                    j = g % self.depth
                    if cuda:
                        wait0 = torch.cuda.Event(enable_timing=True)
                        wait0.record(main)
                        main.wait_event(copy_ev[g])
                        waits.append((wait0, copy_ev[g]))
                    self._moe(L.moe, il, j, xn, buf, stg, ops)
                    if cuda:
                        ev = torch.cuda.Event()
                        ev.record(main)
                        done_ev.append(ev)
                    else:
                        done_ev.append(None)
                    if g + self.depth < n_glob:
                        issue_copy(g + self.depth)
                    nxt = net.layers[il + 1].attn_norm if il + 1 < a.n_layer else net.output_norm
                    ops.add_rmsnorm(x, net.prefill_parts(L.moe, buf), nxt, a.eps, xn)
                    g += 1
                pos += T
                stats.ubatches += 1
            b = st.bufs
            net.output.matvec(xn[-1:].contiguous(), b.logits, net.impl(st))
            torch.argmax(b.logits, dim=-1, out=st.tok)
            st.pos.fill_(pos)
            stg.give_back()
        if cuda:
            torch.cuda.synchronize(dev)
            # compute waiting for copies: from the point the layer could start to the copy's end
            for w0, w1 in waits:
                stats.copy_wait_seconds += max(0.0, w0.elapsed_time(w1)) / 1e3
        stats.tokens = len(toks)
        stats.seconds = time.perf_counter() - t0
        self.stats = stats
        return stats

    def _moe(self, m, il: int, j: int, xn: Tensor, buf: "_Buffers", stg: Staging, ops) -> None:
        a = self.eng.net.args
        k, lay = a.n_expert_used, m.layout
        logits = torch.matmul(xn, m.router.T)
        probs = torch.softmax(logits, dim=-1)
        top, ids = torch.topk(probs, k, dim=-1)
        w = top / top.sum(-1, keepdim=True).clamp(min=6.103515625e-5)
        if a.expert_weights_scale not in (0.0, 1.0):
            w = w * a.expert_weights_scale
        rows, blk_e = pad_by_expert(ids, a.n_expert, self.block_m)
        e_idx = blk_e.clamp(min=0)                       # blocks past the last have no rows: any offset
        gu_w = engine_ops.WORDS[lay.gu_type].itemsize
        base_gu = stg.base_words(il, j, lay.gu_type, 0)[e_idx]
        base_dn = stg.base_words(il, j, lay.down_type, lay.down_offset)[e_idx]
        h = buf.h(rows.numel(), lay.n_ff)
        ops.gemm(stg.space, lay.gu_type, base_gu, rows, xn, h, lay.n_ff, lay.gu_row_bytes, "gate_up",
                 up_words=lay.n_ff * lay.gu_row_bytes // gu_w, n_used=k, block_m=self.block_m, bf16=self.bf16)
        ops.gemm(stg.space, lay.down_type, base_dn, rows, h, buf.y, a.n_embd, lay.down_row_bytes, "down",
                 n_used=k, weights=w.reshape(-1).contiguous(), block_m=self.block_m, bf16=self.bf16)
        if m.shared is not None:
            self.eng.net.prefill_shared(m, xn, buf, ops)


class _Buffers:
    """One micro-batch's activations (allocated per micro-batch; freed after)."""

    def __init__(self, a, T: int, block_m: int, dev):
        self.T, self.a, self.dev = T, a, dev
        k = a.n_expert_used
        self.attn_out = torch.zeros(T, a.n_embd, dtype=torch.float32, device=dev)
        self.y = torch.zeros(T * k, a.n_embd, dtype=torch.float32, device=dev)
        self._h = None

    def h(self, places: int, n_ff: int) -> Tensor:
        if self._h is None or self._h.shape != (places, n_ff):
            self._h = torch.zeros(places, n_ff, dtype=torch.float32, device=self.dev)
        return self._h
