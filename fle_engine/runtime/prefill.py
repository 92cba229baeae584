"""Prefill on the engine: a prompt processed in micro-batches of up to
``ubatch`` tokens, each layer's routed experts streamed from host memory
into GPU staging memory while the layer before computes.

Per micro-batch and layer:

1. the mixer over the batch's tokens, through the architecture's
   ``prefill_mixer`` (dense matrices decoded once, then one product each;
   attention over the cache and the batch; a GDN layer's recurrence token
   by token with the decode step's kernel); a net whose residual is more
   than one row per token (qwen4exp's hyper-connection streams) runs its
   own layer loop (``prefill_trunk``) around the same MoE;
2. the router and top-K for every token, the (token, expert) rows sorted
   by expert (:func:`sort_by_expert`, on the device, no host
   synchronisation);
3. the layer's experts decoded into bfloat16 (:mod:`fle_engine.kernels.triton_dequant`),
   an expert with a cache slot from it in place, every other one from a
   staging buffer that the copy stream filled with all the layer's uncached
   experts (at a micro-batch this large nearly every expert is routed, so
   whole layers move, in one copy per run of consecutive experts); then
   gate+up, SwiGLU and down for all rows by torch's grouped GEMM (one launch
   per product, tensor cores).

Staging is a ring of ``depth`` (2) layer-sized buffers, so the copy of
layer l + 1 overlaps the computation of layer l and a buffer is refilled
only after the layer that read it has finished (events order both
streams). The memory is lent by the expert cache from the back of its slot
buffer (:meth:`Staging.lend`): the layers whose slots it covers count as
uncached for the prefill and their slots are copied back from host memory
afterwards; when the slot buffer is smaller than the ring, the ring is
allocated instead. The cache policy does not see prefill routing (a prompt
touches every expert once; the policy learns from decode steps).

With the experts memory-mapped in the file (``--host-experts mapped``) a
layer's uncached experts are first packed on the host into one of
``depth`` page-locked pack buffers (plain memory without CUDA), after the
host has waited for the copy out of that buffer ``depth`` layers before.

A prompt of one micro-batch too short to route to most experts (the
expected share of a layer's experts that its T tokens route to,
1 - (1 - K/E)^T, below :data:`ROUTED_ONLY_BELOW`: up to ~80 tokens on
512-expert files, never at or above 32 tokens on 128-expert ones) moves only
the routed uncached experts instead: each layer's router runs first, its
routed experts are read back to the host (one synchronisation per layer),
and only those are copied, with no copy ahead of the layer (``routed``).

Measure (``PrefillStats``): tokens, seconds, bytes copied, and the time the
compute stream stood waiting for a copy (copying without computing).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..kernels import engine_ops
from .weights import FLOAT_TYPES, PackBuffer, _align

__all__ = ["sort_by_expert", "grouped_mm", "Prefill", "PrefillStats", "Staging", "dense_rows", "prefill_bytes",
           "routed_share", "ROUTED_ONLY_BELOW"]

# a one-micro-batch prompt whose expected routed share of a layer's experts is below this copies only its routed
# experts (no copy ahead of the layer: at least a fifth fewer bytes for the lost overlap, which is small when a
# short batch computes little)
ROUTED_ONLY_BELOW = 0.8


def routed_share(n_tok: int, n_used: int, n_expert: int) -> float:
    """The expected share of a layer's experts that ``n_tok`` tokens route
    to, each token to ``n_used`` of ``n_expert`` (routing taken as uniform)."""
    return 1.0 - (1.0 - n_used / n_expert) ** n_tok


def sort_by_expert(ids: Tensor, n_expert: int) -> tuple[Tensor, Tensor]:
    """The (token, expert) rows of ``ids`` [T, K] in expert order: (the flat
    row ``t * K + j`` of each sorted place, int64 [T K]; the end of each
    expert's run of places, int32 [E], as torch's grouped GEMM takes it).
    Device operations only (the sort is stable: within an expert, token
    order)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    cnt = torch.zeros(n_expert, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return order, torch.cumsum(cnt, 0).to(torch.int32)


def grouped_mm(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    """Rows ``ends[g-1] .. ends[g]`` of ``x`` [R, K] times ``w[g]`` [N, K]
    transposed -> [R, N]: torch's grouped GEMM (one launch; bfloat16 on
    CUDA, any float type on the CPU), or one product per group for float32
    on CUDA (checks)."""
    if x.dtype == torch.bfloat16 or x.device.type == "cpu":
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)
    out = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for g, end in enumerate(ends.tolist()):
        if end > start:
            torch.matmul(x[start:end], w[g].T, out=out[start:end])
        start = end
    return out


_COLUMNS: dict = {}


def columns(qtype, n_in: int, device) -> "Tensor | None":
    """The activation columns for a matrix decoded in tile order (whole
    256-value chunks; None: natural order)."""
    if n_in % 256:
        return None
    key = (int(qtype), n_in, str(device))
    c = _COLUMNS.get(key)
    if c is None:
        c = _COLUMNS[key] = engine_ops.tile_columns(qtype, n_in, device)
    return c


def dense_rows(m, x: Tensor, out: Tensor, ops, dtype=torch.float32) -> Tensor:
    """``out`` [T, n_out] = x [T, n_in] @ W.T for a DenseMatrix ``m``: the
    matrix decoded into ``dtype`` once, then one product (a float32 matrix
    as it is; a float16/bfloat16 one converted to ``dtype`` for this
    product only, as a quantized one is decoded)."""
    if m.qtype in FLOAT_TYPES:
        if m.data.dtype == torch.float32:
            out.copy_(torch.matmul(x, m.data.T))
        else:
            out.copy_(torch.matmul(x.to(dtype), m.data.to(dtype).T))
        return out
    w = torch.empty(1, m.n_out, m.n_in, dtype=dtype, device=x.device)
    cols = columns(m.qtype, m.n_in, x.device)
    ops.dequant(engine_ops.WordSpace(m.data), m.qtype, torch.zeros(1, dtype=torch.int64, device=x.device), m.n_out,
                m.data.shape[1], w, tile_order=cols is not None)
    xs = x if cols is None else x[:, cols]
    out.copy_(torch.matmul(xs.to(dtype), w[0].T))
    return out


def prefill_bytes(net, ubatch: int) -> int:
    """GPU bytes that a prefill of ``ubatch``-token micro-batches allocates
    for the time it runs, besides the staging ring it borrows from the
    cache: one layer's experts decoded in bfloat16, and the micro-batch's
    activations (expert rows in and out, the gate+up product, the
    residual stream and its norm)."""
    a = net.args
    lays = list(net.layouts.values())
    if not lays:
        return 0
    f = max(l.n_ff for l in lays)
    d, k, t = a.n_embd, a.n_expert_used, int(ubatch)
    streams = getattr(a, "hc", 1)          # qwen4exp: the residual, its norm and the HC gates per stream
    experts = a.n_expert * 3 * f * d * 2
    rows = t * k * (d * 2 + 2 * f * 4 + f * 2 + d * 4 * 2)
    return experts + rows + t * d * 4 * 4 * streams


@dataclass
class PrefillStats:
    tokens: int = 0
    seconds: float = 0.0
    ubatches: int = 0
    bytes_copied: int = 0
    copy_wait_seconds: float = 0.0        # the compute stream waiting for a layer's copy (CUDA only)
    scratch_bytes: int = 0                # one layer's experts decoded for the products
    lent_layers: list = field(default_factory=list)
    routed_only: bool = False             # only the routed uncached experts copied (a short one-batch prompt)

    def line(self) -> str:
        tps = self.tokens / self.seconds if self.seconds else 0.0
        return (f"prefill: {self.tokens} tokens in {self.ubatches} micro-batches, {self.seconds * 1e3:.1f} ms "
                f"({tps:.1f} tok/s); experts streamed {self.bytes_copied / 1e9:.2f} GB, compute waiting for "
                f"copies {self.copy_wait_seconds * 1e3:.1f} ms")


class Staging:
    """The ring of layer-sized staging buffers, and which experts of each
    layer are read from it.

    The ring is the back of the cache's slot buffer when that is large
    enough (``lent_layers``: the layers whose slots it covers), else a
    buffer of its own (``own``). ``base_words(l, j, qtype,
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

    def runs(self, l: int, routed: "np.ndarray | None" = None) -> list[tuple[int, int]]:
        """``routed`` (expert ids): only those of the uncached experts."""
        uncached = self.slot_of[l] < 0
        if routed is not None:
            keep = np.zeros_like(uncached)
            keep[routed] = True
            uncached &= keep
        miss = np.flatnonzero(uncached)
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
                    # a packed memory-mapped expert is a temporary: copied before the call returns
                    c.slot_view(l)[s].copy_(c.host.rows(l)[e], non_blocking=not c.host.mapped)
        self.lent_layers = []


class Prefill:
    """Prompt processing for an :class:`~fle_engine.runtime.engine.Engine`
    (see the module docstring). ``run(tokens, pos0)`` leaves the greedy
    next token in ``state.tok``, the last token's logits in
    ``state.bufs.logits`` and ``state.pos`` at ``pos0 + len(tokens)``."""

    def __init__(self, engine, ubatch: int = 4096, depth: int = 2, bf16: "bool | None" = None):
        self.eng, self.ubatch, self.depth = engine, int(ubatch), int(depth)
        # the products' inputs: bfloat16 on tensor cores (None: on CUDA), or float32 (checks, the CPU)
        self.bf16 = bf16
        self._scratch: dict = {}
        self.stats = PrefillStats()
        self.hidden = None
        self._packs = None           # memory-mapped experts: their pack buffers, made on first use
        self.force_routed = None     # tests: True / False overrides routed_only's rule

    def close(self) -> None:
        for b in self._packs or ():
            b.close()

    @property
    def dtype(self):
        bf = self.bf16 if self.bf16 is not None else self.eng.cuda
        return torch.bfloat16 if bf else torch.float32

    def scratch(self, key, shape) -> Tensor:
        """A layer's decoded experts (kept for the run; one per shape)."""
        t = self._scratch.get(key)
        if t is None or t.shape != shape or t.dtype != self.dtype:
            t = self._scratch[key] = torch.empty(shape, dtype=self.dtype, device=self.eng.device)
        return t

    def run(self, tokens, pos0: int = 0, keep_history: bool = False, keep_hidden: bool = False) -> PrefillStats:
        """``keep_hidden``: ``self.hidden`` is then what an MTP head reads
        of every token, float32: the post-norm hidden state [T, D], or on a
        net with its own ``prefill_trunk`` what that keeps (qwen4exp: the
        wide residual [T, S, D]); else None."""
        eng = self.eng
        self.hidden = None
        hidden = []
        if not keep_history:      # called directly (benchmarks): the engine's next prompt starts afresh
            eng.history = None
        net, st, ops, cache = eng.net, eng.state, eng.ops, eng.cache
        a, dev, cuda = net.args, eng.device, eng.cuda
        t0 = time.perf_counter()
        stats = PrefillStats()
        main = torch.cuda.current_stream(dev) if cuda else None
        if cuda:
            main.wait_stream(cache.copy_stream)              # admissions in flight land before slots are lent
        stg = Staging(cache, self.depth)
        st.prefill_dtype = self.dtype
        stats.lent_layers = list(stg.lent_layers)
        copy = torch.cuda.Stream(dev) if cuda else None
        if cuda:
            copy.wait_stream(main)
        done_ev: list = []                                   # per global layer: compute finished reading
        copy_ev: list = []
        waits: list = []

        def issue_copy(g: int, routed: "np.ndarray | None" = None) -> None:
            il = g % a.n_layer
            dst = stg.ring(g % self.depth)
            eb = cache.layouts[il].expert_bytes
            runs = stg.runs(il, routed)
            src, starts = self._sources(il, runs, g, copy_ev)
            ev = None
            with torch.cuda.stream(copy) if cuda else contextlib.nullcontext():
                if cuda and g >= self.depth:
                    copy.wait_event(done_ev[g - self.depth])
                for (e0, n), o in zip(runs, starts):
                    dst[e0 * eb:(e0 + n) * eb].copy_(src[o:o + n * eb], non_blocking=cuda)
                if cuda:
                    ev = torch.cuda.Event(enable_timing=True)
                    ev.record(copy)
            copy_ev.append(ev)
            stats.bytes_copied += sum(n for _, n in runs) * eb

        toks = [int(t) for t in tokens]
        chunks = [toks[i:i + self.ubatch] for i in range(0, len(toks), self.ubatch)]
        n_glob = len(chunks) * a.n_layer
        routed_only = self.routed_only(toks)
        stats.routed_only = routed_only
        for g in range(0 if routed_only else min(self.depth, n_glob)):
            issue_copy(g)
        layer_no = [0]                       # layers run so far over all micro-batches (g above)

        def moe(L, il: int, xn: Tensor, buf: "_Buffers") -> None:
            """Layer il's routed (and shared) experts of the micro-batch, once
            the copy of its uncached experts has landed; the next copy issued
            (routed only: the router first, then the copy of the experts it
            routes to that have no slot)."""
            g = layer_no[0]
            if routed_only:
                self._route(L.moe, il, xn, buf)
                issue_copy(g, np.unique(buf.ids.cpu().numpy()))      # waits for the router (the host needs it)
            if cuda:
                wait0 = torch.cuda.Event(enable_timing=True)
                wait0.record(main)
                main.wait_event(copy_ev[g])
                waits.append((wait0, copy_ev[g]))
            self._moe(L.moe, il, g % self.depth, xn, buf, stg, ops, routed=routed_only)
            if cuda:
                ev = torch.cuda.Event()
                ev.record(main)
                done_ev.append(ev)
            else:
                done_ev.append(None)
            if g + self.depth < n_glob and not routed_only:
                issue_copy(g + self.depth)
            layer_no[0] = g + 1

        pos = int(pos0)
        trunk = getattr(net, "prefill_trunk", None)          # a net whose residual is not one row per token
        keep = (lambda rows: hidden.append(rows.float().clone())) if keep_hidden else None
        try:
            with torch.inference_mode():
                for chunk in chunks:
                    T = len(chunk)
                    tok = torch.tensor(chunk, dtype=torch.int64, device=dev)
                    buf = _Buffers(a, T, dev)
                    if trunk is not None:
                        last = trunk(tok, pos, st, ops, buf, moe, keep=keep)
                    else:
                        x = net.prefill_embed(tok, ops)
                        xn = torch.empty_like(x)
                        ops.add_rmsnorm(x, None, net.layers[0].attn_norm, a.eps, xn)
                        for il, L in enumerate(net.layers):
                            net.prefill_mixer(L, il, xn, buf.attn_out, pos, st, ops)
                            ops.add_rmsnorm(x, buf.attn_out.view(T, 1, -1), L.ffn_norm, a.eps, xn)
                            moe(L, il, xn, buf)
                            nxt = net.layers[il + 1].attn_norm if il + 1 < a.n_layer else net.output_norm
                            ops.add_rmsnorm(x, net.prefill_parts(L.moe, buf), nxt, a.eps, xn)
                        last = xn[-1:]
                        if keep is not None:
                            keep(xn)
                    pos += T
                    stats.ubatches += 1
                b = st.bufs
                net.output.matvec(last.contiguous(), b.logits, net.impl(st))
                torch.argmax(b.logits, dim=-1, out=st.tok)
                st.pos.fill_(pos)
        finally:                               # the lent slots come back even when a micro-batch fails
            if cuda:
                main.wait_stream(copy)
            stg.give_back()
            stats.scratch_bytes = sum(t.numel() * t.element_size() for t in self._scratch.values())
            self._scratch = {}
        if cuda:
            torch.cuda.synchronize(dev)
            # compute waiting for copies: from the point the layer could start to the copy's end
            for w0, w1 in waits:
                stats.copy_wait_seconds += max(0.0, w0.elapsed_time(w1)) / 1e3
        stats.tokens = len(toks)
        stats.seconds = time.perf_counter() - t0
        self.stats = stats
        if keep_hidden:
            self.hidden = hidden[0] if len(hidden) == 1 else torch.cat(hidden)
        return stats

    def _sources(self, il: int, runs: list, g: int, copy_ev: list) -> tuple[Tensor, list]:
        """(a uint8 host tensor, the byte offset in it of each run of layer
        ``il``'s uncached experts): the host buffer, or with memory-mapped
        experts the runs packed into pack buffer ``g % depth`` (once the
        copy out of it, ``depth`` layers before, is done)."""
        host, eb = self.eng.cache.host, self.eng.cache.layouts[il].expert_bytes
        if not host.mapped:
            return host.tensor, [host.offsets[il] + e0 * eb for e0, _ in runs]
        if self._packs is None:
            self._packs = [PackBuffer(pin=self.eng.cuda) for _ in range(self.depth)]
        if self.eng.cuda and g >= self.depth:
            copy_ev[g - self.depth].synchronize()
        ids = [e for e0, n in runs for e in range(e0, e0 + n)]
        flat = self._packs[g % self.depth].take(len(ids) * eb)
        host.gather(il, ids, flat.reshape(len(ids), eb))
        starts, o = [], 0
        for _, n in runs:
            starts.append(o)
            o += n * eb
        return torch.from_numpy(flat), starts

    def routed_only(self, toks) -> bool:
        """Whether a prompt of ``toks`` copies only its routed experts: one
        micro-batch whose expected routed share is below
        :data:`ROUTED_ONLY_BELOW` (``force_routed``, when set, decides instead)."""
        if len(toks) > self.ubatch:
            return False
        if self.force_routed is not None:
            return bool(self.force_routed)
        a = self.eng.net.args
        return routed_share(len(toks), a.n_expert_used, a.n_expert) < ROUTED_ONLY_BELOW

    def _route(self, m, il: int, xn: Tensor, buf: "_Buffers") -> None:
        a = self.eng.net.args
        self.eng.ops.route_topk(torch.matmul(xn, m.router.T), a.n_expert_used, a.expert_weights_scale,
                                self.eng.cache.layer_map(il), buf.ids, buf.wts, buf.log, buf.hits)

    def _moe(self, m, il: int, j: int, xn: Tensor, buf: "_Buffers", stg: Staging, ops, routed: bool = False) -> None:
        """``routed``: the router has run (:meth:`_route`)."""
        a = self.eng.net.args
        k, lay, E = a.n_expert_used, m.layout, a.n_expert
        ids, w = buf.ids, buf.wts
        if not routed:
            self._route(m, il, xn, buf)
        order, ends = sort_by_expert(ids, E)
        dt = self.dtype
        dev = xn.device
        c_gu, c_dn = columns(lay.gu_type, a.n_embd, dev), columns(lay.down_type, lay.n_ff, dev)
        w_gu = self.scratch("gu", (E, 2 * lay.n_ff, a.n_embd))
        ops.dequant(stg.space, lay.gu_type, stg.base_words(il, j, lay.gu_type, 0), 2 * lay.n_ff, lay.gu_row_bytes,
                    w_gu, tile_order=c_gu is not None)
        w_dn = self.scratch("down", (E, a.n_embd, lay.n_ff))
        ops.dequant(stg.space, lay.down_type, stg.base_words(il, j, lay.down_type, lay.down_offset), a.n_embd,
                    lay.down_row_bytes, w_dn, tile_order=c_dn is not None)
        xs = (xn if c_gu is None else xn[:, c_gu]).to(dt)
        hgu = grouped_mm(xs[order // k], w_gu, ends).float()
        act = (torch.nn.functional.silu(hgu[:, :lay.n_ff]) * hgu[:, lay.n_ff:]).to(dt)
        yd = grouped_mm(act if c_dn is None else act[:, c_dn], w_dn, ends).float()
        buf.y[order] = yd * w.reshape(-1)[order][:, None]
        if m.shared is not None:
            self.eng.net.prefill_shared(m, xn, buf, ops, dt)


class _Buffers:
    """One micro-batch's activations (allocated per micro-batch; freed after)."""

    def __init__(self, a, T: int, dev):
        self.T = T
        k = a.n_expert_used
        self.attn_out = torch.zeros(T, a.n_embd, dtype=torch.float32, device=dev)
        self.y = torch.zeros(T * k, a.n_embd, dtype=torch.float32, device=dev)
        self.ids = torch.zeros(T, k, dtype=torch.int64, device=dev)
        self.wts = torch.zeros(T, k, dtype=torch.float32, device=dev)
        self.log = torch.zeros(T, k, dtype=torch.int32, device=dev)      # route_topk's logs (the policy skips them)
        self.hits = torch.zeros(T, k, dtype=torch.int32, device=dev)
