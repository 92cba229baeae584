"""qwen4exp on the engine: one decode token per step with the arithmetic of
the reference pass (:mod:`fle_engine.models.qwen4exp`).

What it reuses: qwen3next's GDN layers (projections on the GGUF bytes as
one product, then ``gdn_step``; here with separate ``ssm_beta`` /
``ssm_alpha``, the sigmoid output gate and tiled V->K heads), its gated attention, and qwen3moe's routed experts with
the expert cache plus the gated shared expert on the GPU.

What it adds:

- hyper-connections: the residual is ``S`` streams [S, D] on the device. A
  read is the low-rank gate product pair and the inject product on the
  normed streams plus one kernel for the gated mean (``hc_mix``); a write
  and the next read's per-stream norm are one kernel (``hc_write_norm``),
  the sigmoid write weights computed inside it.
- QSA: the indexer's raw key of every position is cached, and so is the
  pooled, normed, rotated key of every block of ``ratio`` positions; the
  step refreshes only the block that holds the current position (a block
  counts once it is complete, so it is final when it first counts). Block
  scores over every block of the allocated context (static shapes), a
  stable descending sort (ties go to the earlier block, as the reference),
  the kept blocks plus the incomplete tail as an int32 block mask, and the
  length-aware attention kernel skipping positions of blocks not kept: its
  cost follows the used length. The scoring and the sort cover the blocks
  of a length bucket (powers of two from 1,024 positions up to the
  allocated context): the step has one variant per bucket, each captured
  as its own graph and replayed while the position lies in its bucket, so
  they too follow the used length (within 2x). Blocks past the position
  are incomplete and never chosen, so a bucket gives the same choice as
  the whole context.
- PLE: the n-gram rows of the current token are hashed on the device from
  the token history kept there, and read by the GPU straight from the table
  in page-locked host memory (``gather_rows``, zero-copy; only the
  ``heads`` rows of the token cross PCIe). The dilated conv's history and
  the token history are device state, reset per sequence.

The step has no host synchronisation and is captured as one CUDA graph by
:class:`~fle_engine.runtime.Engine`.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, is_dataclass
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fle_quant.errors import FleError
from fle_quant.ggml_types import GGMLType

from .. import layers as Lr
from ..kernels import engine_ops
from ..models.qwen4exp import ModelArgs
from . import qwen3moe, qwen3next
from . import weights as W

ARCH = "qwen4exp"


@dataclass
class HC:
    """One hyper-connection read: gamma [S, D], low-rank gate (down, up) and
    the inject rows (None for the head's mixer)."""
    norm: Tensor
    down: W.DenseMatrix
    up: W.DenseMatrix
    inject: "W.DenseMatrix | None"


@dataclass
class QSA:
    attn: qwen3moe.Attn
    iqk: W.DenseMatrix            # rows: indexer q (Hi * Di) | indexer k (Di), or None (types differ)
    parts: "list[W.DenseMatrix] | None"
    q_norm: Tensor
    k_norm: Tensor
    ratio: int
    n_kept: int


@dataclass
class PLE:
    kv: "W.DenseMatrix | None"    # rows: key (S * D) | value (D), or None (types differ)
    parts: "list[W.DenseMatrix] | None"
    norm_key: Tensor              # [S, D]
    norm_query: Tensor
    norm_conv: Tensor
    conv: Tensor                  # [S * D, K]
    mult: Tensor                  # int64 [ngram]
    sizes: Tensor                 # int64 [heads]
    offsets: Tensor


@dataclass
class Layer:
    hc_attn: HC
    mixer: object                 # qwen3next.GDN | QSA | qwen3moe.Attn (dense attention)
    hc_ffn: HC
    moe: qwen3moe.Moe
    ple: "PLE | None" = None


class HostTable(W.PageLocked):
    """A quantized table's raw rows in one host buffer (page-locked on
    CUDA), read once from the file; ``anchor`` is a one-row device tensor
    from which the fast kernel addresses the buffer (``delta`` words)."""

    def __init__(self, gguf, name: str, device: torch.device, pin: bool):
        info = gguf.info(name)
        self.qtype = GGMLType(info.qtype)
        raw = gguf.tensor_bytes(name).reshape(info.shape[-1], -1)
        self.buf = np.empty(raw.shape, np.uint8)
        self.buf[:] = raw
        self.host = torch.from_numpy(self.buf)
        if pin:
            self.lock(f"the PLE table ({name})", "the GPU reads the rows of each token from page-locked memory")
        self.anchor = torch.zeros(1, self.buf.shape[1], dtype=torch.uint8, device=device)
        self.delta = 0
        if self.qtype in engine_ops.WORDS:
            word = engine_ops.WORDS[self.qtype].itemsize
            d = self.buf.ctypes.data - self.anchor.data_ptr()
            if d % word:
                raise FleError("internal: the PLE table is not word-aligned")
            self.delta = d // word

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes



class Net(qwen3next.Net):
    Args = ModelArgs
    engine_mtp = True           # the MTP head runs as the engine's own step (mtp_step, runtime.mtp.StepDrafter)
    supports_prefill = True     # runtime.prefill through prefill_trunk (the S streams, PLE, the QSA indexer)
    gdn_sigmoid = True
    gdn_tiled = True            # V head j reads K head j mod Hk (the converter's order)

    def __init__(self, gguf, weights_view, device: torch.device, fast: bool):
        self.ple_table = None
        super().__init__(gguf, weights_view, device, fast)

    # loading -----------------------------------------------------------------------
    def load_head(self) -> None:
        a, g = self.args, self.gguf
        for il in range(a.n_layer):
            if a.compress[il] and a.recurrent[il]:
                raise FleError(f"{g.paths[0]}: layer {il} is a GDN layer with a QSA compress ratio; the engine "
                               f"runs QSA on attention layers only")
        self.output_hc = self.load_hc("output_hc_", inject=False)
        head = "output.weight" if "output.weight" in g.tensors else "token_embd.weight"
        self.output = self.dense(head, a.n_vocab, a.n_embd)
        if a.ple_layer >= 0:
            name = "per_layer_token_embd.weight"
            info = g.info(name)
            rows = max(o + s for o, s in zip(a.ple_offsets, a.ple_vocab_sizes))
            if info.shape[0] != a.ple_head_dim or info.shape[1] < rows:
                raise FleError(f"{g.paths[0]}: {name} is {list(info.shape)} (ggml order); the PLE keys need "
                               f"[{a.ple_head_dim}, >= {rows}]")
            if self.fast and GGMLType(info.qtype) not in engine_ops.WORDS:
                raise FleError(f"{g.paths[0]}: tensor {name!r} is {GGMLType(info.qtype).name}, which the engine "
                               f"has no fast GPU row reader for (fast: "
                               f"{', '.join(t.name for t in engine_ops.WORDS)}); run it with --device cpu (the "
                               f"reference path) or requantize the table (fle-requant)")
            self.ple_table = HostTable(g, name, self.device, pin=self.device.type == "cuda")

    def load_hc(self, prefix: str, inject: bool) -> HC:
        a = self.args
        s, d, r = a.hc, a.n_embd, a.hc_rank
        return HC(self.vec(prefix + "norm.weight", s * d).view(s, d).contiguous(),
                  self.dense(prefix + "down.weight", r, s * d), self.dense(prefix + "up.weight", s * d, r),
                  self.dense(prefix + "inject.weight", s, s * d) if inject else None)

    def load_layer(self, il: int) -> Layer:
        p, a = f"blk.{il}.", self.args
        if a.recurrent[il]:
            mixer = self.load_gdn(il)
        else:
            attn = self.load_attention(il, gated=True)
            mixer = self.load_qsa(il, attn) if a.compress[il] else attn
        return Layer(self.load_hc(p + "hc_attn_", True), mixer, self.load_hc(p + "hc_ffn_", True),
                     self.load_moe(il, shared=True), self.load_ple(il) if il == a.ple_layer else None)

    def load_qsa(self, il: int, attn: qwen3moe.Attn) -> QSA:
        p, a = f"blk.{il}.", self.args
        hi, di = a.idx_heads, a.idx_dim
        parts = [self.dense(p + "indexer.q_proj.weight", hi * di, a.n_embd),
                 self.dense(p + "indexer.k_proj.weight", di, a.n_embd)]
        iqk = W.concat(parts, p + "indexer.qk")
        return QSA(attn, iqk, None if iqk is not None else parts, self.vec(p + "indexer.q_norm.weight", di),
                   self.vec(p + "indexer.k_norm.weight", di), a.compress[il], max(1, a.idx_top_k // a.compress[il]))

    def load_ple(self, il: int) -> PLE:
        p, a = f"blk.{il}.", self.args
        s, d = a.hc, a.n_embd
        parts = [self.dense(p + "ple_key.weight", s * d, d), self.dense(p + "ple_value.weight", d, d)]
        kv = W.concat(parts, p + "ple_kv")
        conv = self.vec(p + "ple_conv1d.weight", s * d * a.ple_conv_kernel).view(s * d, a.ple_conv_kernel)
        i64 = dict(dtype=torch.int64, device=self.device)
        return PLE(kv, None if kv is not None else parts,
                   *(self.vec(p + f"ple_norm_{n}.weight", s * d).view(s, d).contiguous()
                     for n in ("key", "query", "conv")),
                   conv.contiguous(), torch.tensor(a.ple_multipliers, **i64),
                   torch.tensor(a.ple_vocab_sizes, **i64), torch.tensor(a.ple_offsets, **i64))

    @property
    def dense_bytes(self) -> int:
        """Bytes of every matrix and vector on the device (shared storage once)."""
        found: list = []

        def walk(o) -> None:
            if isinstance(o, (W.DenseMatrix, Tensor)):
                found.append(o if isinstance(o, W.DenseMatrix) else W.DenseMatrix("", GGMLType.F32, o, 0, 0))
            elif isinstance(o, (list, tuple)):
                for x in o:
                    walk(x)
            elif is_dataclass(o):
                for f in fields(o):
                    if f.name != "layout":
                        walk(getattr(o, f.name))

        walk([self.layers, self.output, self.tok_embd, self.output_hc])
        return W.unique_bytes(found)

    # state and buffers ---------------------------------------------------------------
    def new_caches(self, ctx: int, k_dtype, v_dtype, n_seq: int = 1) -> list:
        a, dev = self.args, self.device
        out = super().new_caches(ctx, k_dtype, v_dtype, n_seq)
        lead = (n_seq,) if n_seq > 1 else ()
        for il in range(a.n_layer):
            r = a.compress[il]
            if r and not a.recurrent[il]:
                n_blk = -(-ctx // r)
                # raw indexer keys per position, and the pooled block keys
                raw_dt = torch.float16 if k_dtype == "q8_0" else k_dtype     # indexer keys stay float
                out[il] = out[il] + (torch.zeros(*lead, n_blk * r, a.idx_dim, dtype=raw_dt, device=dev),
                                     torch.zeros(*lead, n_blk, a.idx_dim, dtype=torch.float32, device=dev))
        return out

    # length buckets of the indexer (module docstring) ------------------------------------
    MIN_BUCKET = 1024

    @functools.cached_property
    def _indexed(self) -> bool:
        """Whether a layer has the indexer (once: variant_for runs every step)."""
        a = self.args
        return any(a.compress[il] and not a.recurrent[il] for il in range(a.n_layer))

    def variants(self, ctx: int) -> list:
        if not self._indexed:
            return [None]
        out, n = [], self.MIN_BUCKET
        while n < ctx:
            out.append(n)
            n *= 2
        return out + [ctx]

    def variant_for(self, pos: int, ctx: int):
        if not self._indexed:
            return None
        n = self.MIN_BUCKET
        while n <= pos and n < ctx:
            n *= 2
        return min(n, ctx)

    def set_variant(self, state, variant) -> None:
        state.qsa_positions = variant

    def reset(self, state) -> None:
        """A new sequence: recurrent states from zero; the PLE history reads
        EOS before the start. (Raw indexer keys and block keys are
        addressed by position and count only once written.)"""
        super().reset(state)
        b = state.bufs
        if getattr(b, "ple_tok", None) is not None:
            b.ple_tok.fill_(self.args.ple_eos)
            b.ple_hist.zero_()

    def alloc(self, state) -> None:
        super().alloc(state)
        a, b = self.args, state.bufs
        f32 = dict(dtype=torch.float32, device=self.device)
        s, d = a.hc, a.n_embd
        b.res = torch.zeros(s, d, **f32)            # the S streams
        b.hxn = torch.zeros(s, d, **f32)            # the streams normed for the next read
        b.hlo = torch.zeros(1, a.hc_rank, **f32)
        b.hact = torch.zeros(1, a.hc_rank, **f32)
        b.hg = torch.zeros(1, s * d, **f32)
        b.hinj = torch.zeros(1, s, **f32)
        if any(a.compress[il] and not a.recurrent[il] for il in range(a.n_layer)):
            b.iqk = torch.zeros(1, (a.idx_heads + 1) * a.idx_dim, **f32)
            n_blk = max(c[3].shape[0] for c in state.kv if len(c) == 4)
            b.blocks = torch.arange(n_blk, device=self.device)
            b.keep = torch.zeros(n_blk, dtype=torch.int32, device=self.device)
        b.ple_tok = None
        if a.ple_layer >= 0:
            b.ple_tok = torch.full((a.ple_ngram - 1,), a.ple_eos, dtype=torch.int64, device=self.device)
            b.ple_hist = torch.zeros(a.ple_hist, s * d, **f32)
            b.ple_rows = torch.zeros(a.ple_heads, dtype=torch.int64, device=self.device)
            b.ple_emb = torch.zeros(1, d, **f32)
            b.ple_kv = torch.zeros(1, s * d + d, **f32)

    def lane_bufs(self, state, n_seq: int) -> "tuple[list, object]":
        """The PLE token and conv histories are per sequence: lane-stacked
        ([N, ngram - 1], [N, hist, S D]), each lane's buffers holding its
        row, the batched step's the whole stacks; the rest is shared."""
        b = state.bufs
        if b.ple_tok is None:
            return super().lane_bufs(state, n_seq)
        tok = b.ple_tok[None].repeat(n_seq, 1)                   # EOS before every lane's start
        hist = torch.zeros(n_seq, *b.ple_hist.shape, dtype=b.ple_hist.dtype, device=b.ple_hist.device)
        lanes = [SimpleNamespace(**{**vars(b), "ple_tok": tok[i], "ple_hist": hist[i]}) for i in range(n_seq)]
        return lanes, SimpleNamespace(**{**vars(b), "ple_tok": tok, "ple_hist": hist})

    # hyper-connections -----------------------------------------------------------------
    def hc_read(self, hc: HC, state, ops) -> None:
        """b.hxn (the normed streams) -> b.xn (block input) and b.hinj (raw
        inject logits; the write takes 2 sigmoid(. / S))."""
        b, impl, s = state.bufs, self.impl(state), self.args.hc
        flat = b.hxn.view(1, -1)
        hc.down.matvec(flat, b.hlo, impl)
        if hc.inject is not None:
            hc.inject.matvec(flat, b.hinj, impl)
        torch.mul(b.hlo, 1.0 / s, out=b.hact)
        F.silu(b.hact, inplace=True)
        hc.up.matvec(b.hact, b.hg, impl)
        ops.hc_mix(b.hxn, b.hg, b.xn.view(-1))

    # QSA -------------------------------------------------------------------------------
    def attend(self, at, il: int, state, ops) -> None:
        m = self.layers[il].mixer
        if not isinstance(m, QSA):
            return super().attend(at, il, state, ops)
        a, b = self.args, state.bufs
        impl = self.impl(state)
        hi, di, r = a.idx_heads, a.idx_dim, m.ratio
        if m.iqk is not None:
            m.iqk.matvec(b.xn, b.iqk, impl)
        else:
            m.parts[0].matvec(b.xn, b.iqk[:, :hi * di], impl)
            m.parts[1].matvec(b.xn, b.iqk[:, hi * di:], impl)
        kc, vc, raw, kb = state.kv[il]
        pos = state.pos
        raw.index_copy_(0, pos, b.iqk[:, hi * di:].to(raw.dtype))
        # the block holding pos: pooled (mean), normed, rotated at its first position
        blk = torch.div(pos, r, rounding_mode="floor")
        pooled = Lr.rms_norm(raw.view(-1, r, di).index_select(0, blk).float().mean(1), m.k_norm, a.eps)
        start = blk * r
        kb.index_copy_(0, blk, Lr.apply_rope_neox(pooled[:, None], state.rope_cos.index_select(0, start),
                                                  state.rope_sin.index_select(0, start))[:, 0])
        q = Lr.rms_norm(b.iqk[:, :hi * di].view(1, hi, di), m.q_norm, a.eps)
        q = Lr.apply_rope_neox(q, state.rope_cos.index_select(0, pos), state.rope_sin.index_select(0, pos))[0]
        # the blocks of the length bucket (set_variant; all of them when none is set)
        span = getattr(state, "qsa_positions", None)
        nb = kb.shape[0] if span is None else min(kb.shape[0], -(-span // r))
        kb_used = kb[:nb]
        score = torch.relu(kb_used @ q.T).sum(-1)                      # [nb]
        tail = b.blocks[:nb] >= torch.div(pos + 1, r, rounding_mode="floor")   # not complete at pos
        score = score.masked_fill(tail, float("-inf"))
        top, which = torch.sort(score, descending=True, stable=True)
        k = min(m.n_kept, score.shape[0])
        chosen = torch.zeros_like(tail).scatter(0, which[:k], top[:k] > float("-inf"))
        torch.bitwise_or(chosen, tail, out=b.keep[:nb])          # blocks past nb lie past pos: never read
        ops.attention(b.q, kc, vc, pos, a.attn_scale, b.o.view(-1), b.partial, b.ml, keep=b.keep, ratio=r)

    def mix(self, L: Layer, il: int, state, ops) -> None:
        if isinstance(L.mixer, qwen3next.GDN):
            self.gdn(L.mixer, il, state, ops)
        else:
            self.attention(L.mixer.attn if isinstance(L.mixer, QSA) else L.mixer, il, state, ops)

    # PLE -------------------------------------------------------------------------------
    def ple_rows(self, p: PLE, state) -> None:
        """The table rows of the current token's n-grams -> b.ple_rows;
        advances the token history."""
        a, b = self.args, state.bufs
        n, eos = a.ple_ngram, a.ple_eos
        seq = torch.cat([b.ple_tok, state.tok.view(1)])               # oldest first, current last
        prev = seq[:n - 1].flip(0)                                    # predecessors, nearest first
        cut = torch.cummax((prev == eos).to(torch.int64), 0).values.bool()   # an EOS at or after it cuts
        ctx = torch.cat([seq[n - 1:], torch.where(cut, torch.full_like(prev, eos), prev)]) * p.mult
        mixed = [ctx[0]]
        for j in range(1, n):
            mixed.append(torch.bitwise_xor(mixed[-1], ctx[j]))
        per = a.ple_heads_per_ngram
        hashes = torch.stack(mixed[1:])[:, None].expand(n - 1, per).reshape(-1)   # [heads], bigram heads first
        torch.add(torch.remainder(hashes, p.sizes), p.offsets, out=b.ple_rows)
        b.ple_tok.copy_(seq[1:])

    def ple(self, p: PLE, state, ops) -> None:
        """res += gated + silu(dilated conv of the normed gated values)."""
        a, b = self.args, state.bufs
        impl, s, d = self.impl(state), a.hc, a.n_embd
        self.ple_rows(p, state)
        t = self.ple_table
        if state.fast:
            ops.gather_rows(t.anchor, t.qtype, t.delta, b.ple_rows, b.ple_emb.view(-1))
        else:
            ops.gather_rows(t.host, t.qtype, 0, b.ple_rows, b.ple_emb.view(-1))
        if p.kv is not None:
            p.kv.matvec(b.ple_emb, b.ple_kv, impl)
        else:
            p.parts[0].matvec(b.ple_emb, b.ple_kv[:, :s * d], impl)
            p.parts[1].matvec(b.ple_emb, b.ple_kv[:, s * d:], impl)
        key = Lr.rms_norm(b.ple_kv[0, :s * d].view(s, d), p.norm_key, a.eps)
        query = Lr.rms_norm(b.res, p.norm_query, a.eps)
        score = (key * query).sum(-1, keepdim=True) / math.sqrt(d)    # [S, 1]
        gate = torch.sigmoid(torch.sign(score) * score.abs().clamp(min=1e-6).sqrt())
        gated = b.ple_kv[:, s * d:] * gate                            # [S, D]
        normed = Lr.rms_norm(gated, p.norm_conv, a.eps).view(1, s * d)
        hist, k_taps, dil = b.ple_hist, a.ple_conv_kernel, a.ple_ngram
        full = torch.cat([hist, normed], 0)                           # [(K-1) dil + 1, S D]
        n_hist = hist.shape[0]
        y = full[n_hist] * p.conv[:, k_taps - 1]
        for k in range(k_taps - 1):
            y = y + full[n_hist - (k_taps - 1 - k) * dil] * p.conv[:, k]
        hist.copy_(full[1:])
        b.res.add_(gated + F.silu(y).view(s, d))

    # the step --------------------------------------------------------------------------
    def embed(self, state, ops) -> None:
        super().embed(state, ops)
        b = state.bufs
        b.res.copy_(b.x.expand_as(b.res))                              # S copies of the embedding

    def head(self, state, ops) -> None:
        self.hc_read(self.output_hc, state, ops)
        super().head(state, ops)

    def step(self, state, ops, cache) -> None:
        a, b = self.args, state.bufs
        s = a.hc
        self.embed(state, ops)
        ops.hc_write_norm(b.res, None, None, s, self.layers[0].hc_attn.norm, a.eps, b.hxn)
        for il, L in enumerate(self.layers):
            if L.ple is not None:
                self.ple(L.ple, state, ops)
                ops.hc_write_norm(b.res, None, None, s, L.hc_attn.norm, a.eps, b.hxn)
            self.hc_read(L.hc_attn, state, ops)
            self.mix(L, il, state, ops)
            ops.hc_write_norm(b.res, b.attn_out, b.hinj, s, L.hc_ffn.norm, a.eps, b.hxn)
            self.hc_read(L.hc_ffn, state, ops)
            self.moe(L.moe, il, state, ops, cache)
            nxt = self.layers[il + 1].hc_attn.norm if il + 1 < len(self.layers) else self.output_hc.norm
            ops.hc_write_norm(b.res, self.moe_parts(L.moe, state), b.hinj, s, nxt, a.eps, b.hxn)
        self.head(state, ops)

    # the verify step: T tokens in one pass ---------------------------------------------
    # The decode step's arithmetic on T rows: the S streams of every token, the HC reads and
    # writes of all T in one launch each; PLE rows hashed for every token from the token
    # history advanced inside the step; GDN layers token by token with per-token snapshots
    # (qwen3next); QSA with each query position's own block set (the blocks complete at that
    # position, so a block that completes inside the step counts for the tokens from its last
    # position on, as in the reference's pass over a prompt); the MoE over T x K (qwen3moe).
    # The indexer scores every block of the allocated context here (no length buckets: the step
    # does not know the position on the host): the same choice, at a cost that follows the
    # allocated context rather than the used length.
    def alloc_multi(self, state, t_max: int, snapshots: bool = True) -> None:
        """qwen3next's buffers plus the T rows of the streams and the HC
        reads, the indexer's rows and block masks, and the PLE rows; the PLE
        token history and conv history followed by the step's T tokens and
        values (``ple_seq``, ``ple_full``: what a rewind restores from)."""
        super().alloc_multi(state, t_max, snapshots)
        a, m, b = self.args, state.multi, state.bufs
        f32 = dict(dtype=torch.float32, device=self.device)
        s, d = a.hc, a.n_embd
        self.alloc_hc_multi(m, t_max)
        if self._indexed:
            m.iqk = torch.zeros(t_max, (a.idx_heads + 1) * a.idx_dim, **f32)
            m.keep = torch.zeros(t_max, b.keep.shape[0], dtype=torch.int32, device=self.device)
        if b.ple_tok is not None:
            m.ple_seq = torch.zeros(a.ple_ngram - 1 + t_max, dtype=torch.int64, device=self.device)
            m.ple_full = torch.zeros(a.ple_hist + t_max, s * d, **f32)
            m.ple_rows = torch.zeros(t_max * a.ple_heads, dtype=torch.int64, device=self.device)
            m.ple_emb = torch.zeros(t_max, d, **f32)
            m.ple_kv = torch.zeros(t_max, s * d + d, **f32)

    def alloc_hc_multi(self, m, t_max: int) -> None:
        """The T rows of the streams and of the HC reads in ``m`` (a state's ``multi``)."""
        a = self.args
        f32 = dict(dtype=torch.float32, device=self.device)
        s, d = a.hc, a.n_embd
        m.res = torch.zeros(t_max, s, d, **f32)
        m.hxn = torch.zeros(t_max, s, d, **f32)
        m.hlo = torch.zeros(t_max, a.hc_rank, **f32)
        m.hact = torch.zeros(t_max, a.hc_rank, **f32)
        m.hg = torch.zeros(t_max, s * d, **f32)
        m.hinj = torch.zeros(t_max, s, **f32)
        m.steps = torch.arange(t_max, device=self.device)          # the tokens' offsets from pos

    def hc_read_multi(self, hc: HC, state, ops, n: int) -> None:
        """:meth:`hc_read` of T tokens: m.hxn[:T] -> m.xn[:T] and m.hinj[:T]."""
        m, impl, s = state.multi, self.impl(state), self.args.hc
        flat = m.hxn[:n].view(n, -1)
        hc.down.matvec(flat, m.hlo[:n], impl)
        if hc.inject is not None:
            hc.inject.matvec(flat, m.hinj[:n], impl)
        torch.mul(m.hlo[:n], 1.0 / s, out=m.hact[:n])
        F.silu(m.hact[:n], inplace=True)
        hc.up.matvec(m.hact[:n], m.hg[:n], impl)
        ops.hc_mix(m.hxn[:n], m.hg[:n], m.xn[:n])

    def attend_multi(self, at, il: int, state, ops, n: int) -> None:
        """m.q[:T] -> m.o[:T]; on a QSA layer the indexer's raw keys of the T
        positions written, the blocks holding them refreshed, and each query
        position's block set chosen among the blocks complete at it."""
        mx = self.layers[il].mixer
        if not isinstance(mx, QSA) or mx.attn is not at:        # dense (the MTP head's attention: not layer il's)
            return super().attend_multi(at, il, state, ops, n)
        a, m = self.args, state.multi
        impl = self.impl(state)
        hi, di, r = a.idx_heads, a.idx_dim, mx.ratio
        xn, iqk = m.xn[:n], m.iqk[:n]
        if mx.iqk is not None:
            mx.iqk.matvec(xn, iqk, impl)
        else:
            mx.parts[0].matvec(xn, iqk[:, :hi * di], impl)
            mx.parts[1].matvec(xn, iqk[:, hi * di:], impl)
        kc, vc, raw, kb = state.kv[il]
        pos, lanes = self.rows_at(state, n)
        positions = pos + m.steps[:n] if lanes is None else pos                     # [T]
        # a batched step of several sequences: row t's keys in its own lane's rows of the stacked caches
        nb = kb.shape[-2]
        at_pos = positions if lanes is None else lanes * raw.shape[-2] + positions
        raw.view(-1, di).index_copy_(0, at_pos, iqk[:, hi * di:].to(raw.dtype))
        # the blocks holding the T positions (a repeated block gets the same key twice)
        blk = torch.div(positions, r, rounding_mode="floor")
        at_blk = blk if lanes is None else lanes * nb + blk
        pooled = Lr.rms_norm(raw.view(-1, r, di).index_select(0, at_blk).float().mean(1), mx.k_norm, a.eps)
        start = blk * r
        kb.view(-1, di).index_copy_(0, at_blk, Lr.apply_rope_neox(pooled[:, None],
                                                                 state.rope_cos.index_select(0, start),
                                                                 state.rope_sin.index_select(0, start))[:, 0])
        q = Lr.rms_norm(iqk[:, :hi * di].view(n, hi, di), mx.q_norm, a.eps)
        q = Lr.apply_rope_neox(q, state.rope_cos.index_select(0, positions), state.rope_sin.index_select(0, positions))
        if lanes is None:
            # the decode step's product per query ([NB, Hi] summed over heads), for T queries at once
            score = torch.relu(kb @ q.reshape(n * hi, di).T).view(nb, n, hi).sum(-1).T        # [T, NB]
        else:       # each row against its own lane's block keys
            score = torch.relu(torch.bmm(kb.index_select(0, lanes), q.transpose(1, 2))).sum(-1)   # [T, NB]
        complete = torch.div(positions + 1, r, rounding_mode="floor")                     # blocks complete at each
        tail = state.bufs.blocks[None, :nb] >= complete[:, None]
        score = score.masked_fill(tail, float("-inf"))
        top, which = torch.sort(score, dim=-1, descending=True, stable=True)
        k = min(mx.n_kept, nb)
        chosen = torch.zeros_like(tail).scatter(1, which[:, :k], top[:, :k] > float("-inf"))
        keep = m.keep[:n]
        torch.bitwise_or(chosen, tail, out=keep)
        ops.attention_multi(m.q[:n], kc, vc, pos, a.attn_scale, m.o[:n], m.partial, m.ml, keep=keep, ratio=r,
                            **({} if lanes is None else {"lanes": lanes}))

    def mix_multi(self, L: Layer, il: int, state, ops, n: int) -> None:
        if isinstance(L.mixer, qwen3next.GDN):
            self.gdn_multi(L.mixer, il, state, ops, n)
        else:
            self.attention_multi(L.mixer.attn if isinstance(L.mixer, QSA) else L.mixer, il, state, ops, n)

    def ple_rows_tokens(self, p: PLE, state, toks: Tensor, seq: Tensor, rows: Tensor) -> None:
        """The table rows of the T tokens ``toks``' n-grams -> ``rows``
        [T * heads] (token after token); the token history advanced by the
        T tokens, the history before them followed by them left in ``seq``
        [ngram - 1 + T]."""
        b, n = state.bufs, toks.shape[0]
        torch.cat([b.ple_tok, toks], out=seq)                               # oldest first
        self.ple_hash(p, seq[None], n, rows)
        b.ple_tok.copy_(seq[n:])

    def ple_hash(self, p: PLE, seq: Tensor, n: int, rows: Tensor) -> None:
        """The table rows of the n-grams of the last ``n`` tokens of each row
        of ``seq`` [R, ngram - 1 + n] (a token history, oldest first) ->
        ``rows`` [R * n * heads] (row after row, token after token)."""
        a = self.args
        g, eos, R = a.ple_ngram, a.ple_eos, seq.shape[0]
        ctx = [seq[:, g - 1:] * p.mult[0]]
        cut = torch.zeros(R, n, dtype=torch.bool, device=seq.device)
        for j in range(1, g):                                               # predecessor j positions back
            prev = seq[:, g - 1 - j:g - 1 - j + n]
            cut = cut | (prev == eos)                                       # an EOS at or after it cuts
            ctx.append(torch.where(cut, torch.full_like(prev, eos), prev) * p.mult[j])
        mixed = [ctx[0]]
        for j in range(1, g):
            mixed.append(torch.bitwise_xor(mixed[-1], ctx[j]))
        per = a.ple_heads_per_ngram
        hashes = torch.stack(mixed[1:], -1)[..., None].expand(R, n, g - 1, per).reshape(R, n, -1)  # bigram heads first
        torch.add(torch.remainder(hashes, p.sizes), p.offsets, out=rows.view(R, n, -1))

    def ple_rows_multi(self, p: PLE, state, n: int) -> None:
        """:meth:`ple_rows_tokens` of the verify step's T tokens, into m.ple_rows and m.ple_seq; in a
        batched step of several sequences each row's token after its own lane's history."""
        m = state.multi
        lanes = self.rows_at(state, n)[1]
        if lanes is not None:
            b = state.bufs                                                  # the lanes' stacked histories
            seq = torch.cat([b.ple_tok.index_select(0, lanes), state.toks[:n, None]], 1)     # [T, ngram]
            self.ple_hash(p, seq, 1, m.ple_rows[:n * self.args.ple_heads])
            b.ple_tok.index_copy_(0, lanes, seq[:, 1:])
            return
        self.ple_rows_tokens(p, state, state.toks[:n], m.ple_seq[:self.args.ple_ngram - 1 + n],
                             m.ple_rows[:n * self.args.ple_heads])

    def ple_tokens(self, p: PLE, state, ops, res: Tensor, bufs, product) -> None:
        """:meth:`ple` of T tokens: ``res`` [T, S, D] += gated + silu(conv),
        the conv's history advanced by T values. ``bufs``: ``rows`` (filled,
        int64 [T * heads]), ``emb`` [T, D], ``kv`` [T, S D + D] scratch, and
        ``full`` [hist + T, S D], left holding the history before the T
        values followed by them; ``product(matrix, x, out)``. In a batched
        step of several sequences (``state.rows``) row t's value follows its
        own lane's history instead (``full`` unused)."""
        a, b = self.args, state.bufs
        s, d, n = a.hc, a.n_embd, res.shape[0]
        rows, emb, kv = bufs.rows, bufs.emb, bufs.kv
        t = self.ple_table
        if state.fast:
            ops.gather_rows(t.anchor, t.qtype, t.delta, rows, emb.view(-1))
        else:
            ops.gather_rows(t.host, t.qtype, 0, rows, emb.view(-1))
        if p.kv is not None:
            product(p.kv, emb, kv)
        else:
            product(p.parts[0], emb, kv[:, :s * d])
            product(p.parts[1], emb, kv[:, s * d:])
        key = Lr.rms_norm(kv[:, :s * d].view(n, s, d), p.norm_key, a.eps)
        query = Lr.rms_norm(res, p.norm_query, a.eps)
        score = (key * query).sum(-1, keepdim=True) / math.sqrt(d)          # [T, S, 1]
        gate = torch.sigmoid(torch.sign(score) * score.abs().clamp(min=1e-6).sqrt())
        gated = kv[:, None, s * d:] * gate                                  # [T, S, D]
        normed = Lr.rms_norm(gated, p.norm_conv, a.eps).view(n, s * d)
        n_hist, k_taps, dil = a.ple_hist, a.ple_conv_kernel, a.ple_ngram
        lanes = self.rows_at(state, n)[1]
        if lanes is not None:
            # a batched step of several sequences: row t's value after its own lane's history
            full = torch.cat([b.ple_hist.index_select(0, lanes), normed[:, None]], 1)     # [T, hist + 1, S D]
            y = full[:, n_hist] * p.conv[:, k_taps - 1]
            for k in range(k_taps - 1):
                y = y + full[:, n_hist - (k_taps - 1 - k) * dil] * p.conv[:, k]
            b.ple_hist.index_copy_(0, lanes, full[:, 1:])
        else:
            full = bufs.full
            torch.cat([b.ple_hist, normed], 0, out=full)
            y = full[n_hist:n_hist + n] * p.conv[:, k_taps - 1]
            for k in range(k_taps - 1):
                at = n_hist - (k_taps - 1 - k) * dil
                y = y + full[at:at + n] * p.conv[:, k]
            b.ple_hist.copy_(full[n:n + n_hist])
        res.add_(gated + F.silu(y).view(n, s, d))

    def ple_multi(self, p: PLE, state, ops, n: int) -> None:
        """:meth:`ple_tokens` of the verify step's T tokens on m.res[:T] (the
        conv history before them followed by them kept in m.ple_full)."""
        a, m, impl = self.args, state.multi, self.impl(state)
        self.ple_rows_multi(p, state, n)
        bufs = SimpleNamespace(rows=m.ple_rows[:n * a.ple_heads], emb=m.ple_emb[:n], kv=m.ple_kv[:n],
                               full=m.ple_full[:a.ple_hist + n])
        self.ple_tokens(p, state, ops, m.res[:n], bufs, lambda mat, x, out: mat.matvec(x, out, impl))

    def step_multi(self, state, ops, cache, n: int) -> None:
        """T = ``n`` tokens in one pass (see :meth:`qwen3moe.Net.step_multi`):
        token t's logits equal those of a one-token step at position
        pos + t fed the same tokens; the wide residual of every token after
        the last layer is left in ``state.multi.res[:T]``."""
        a, m = self.args, state.multi
        s = a.hc
        self.begin_rows(state, n)
        self.embed_multi(state, ops, n)
        res, hxn, hinj = m.res[:n], m.hxn[:n], m.hinj[:n]
        res.copy_(m.x[:n, None].expand_as(res))                               # S copies of each embedding
        ops.hc_write_norm(res, None, None, s, self.layers[0].hc_attn.norm, a.eps, hxn)
        for il, L in enumerate(self.layers):
            if L.ple is not None:
                self.ple_multi(L.ple, state, ops, n)
                ops.hc_write_norm(res, None, None, s, L.hc_attn.norm, a.eps, hxn)
            self.hc_read_multi(L.hc_attn, state, ops, n)
            self.mix_multi(L, il, state, ops, n)
            ops.hc_write_norm(res, m.attn_out[:n], hinj, s, L.hc_ffn.norm, a.eps, hxn)
            self.hc_read_multi(L.hc_ffn, state, ops, n)
            self.moe_multi(L.moe, il, state, ops, cache, n)
            nxt = self.layers[il + 1].hc_attn.norm if il + 1 < len(self.layers) else self.output_hc.norm
            ops.hc_write_norm(res, self.multi_parts(L.moe, state, n), hinj, s, nxt, a.eps, hxn)
        self.hc_read_multi(self.output_hc, state, ops, n)
        self.output.matvec(m.xn[:n], m.logits[:n], self.impl(state))
        torch.argmax(m.logits[:n], dim=-1, out=state.next_toks[:n])
        self.advance(state, n)

    # the MTP head on the engine (runtime.mtp.StepDrafter) ---------------------------------
    def load_mtp_block(self, gguf) -> SimpleNamespace:
        """Block N of ``gguf`` (the model file holding the MTP head, or a
        head file; checked by the caller) in the engine's form, as
        :mod:`fle_engine.models.qwen4exp_mtp` reads it: the block as a
        trunk layer (its ``hc_attn_*`` / ``hc_ffn_*`` reads, the gated
        attention run densely -- an indexer in the file is not read, as the
        reference head attends densely -- and the routed experts with the
        gated shared expert; the experts' file views in ``sources``, for a
        store to copy before the file closes), ``eh_proj`` [2 D -> D],
        ``enorm`` [D], the per-stream ``hnorm`` [S, D], the head mixer
        ``head_hc`` (``nextn.hc_head_*``) and the trunk's tables."""
        a = self.args
        il, s, d = a.n_layer, a.hc, a.n_embd
        p = f"blk.{il}."
        with self.reading(gguf):
            layer = Layer(self.load_hc(p + "hc_attn_", True), self.load_attention(il, gated=True),
                          self.load_hc(p + "hc_ffn_", True), self.load_moe(il, shared=True))
            sources = self.expert_sources.pop(il)
            blk = SimpleNamespace(
                layer=layer, sources=sources,
                eh_proj=self.dense(p + "nextn.eh_proj.weight", d, 2 * d),
                enorm=self.vec(p + "nextn.enorm.weight", d),
                hnorm=self.vec(p + "nextn.hnorm.weight", s * d).view(s, d).contiguous(),
                head_hc=self.load_hc(p + "nextn.hc_head_", inject=False),
                embed=self.tok_embd, output=self.output)
        return blk

    def alloc_mtp(self, hs, t_max: int) -> None:
        """The buffers of :meth:`mtp_step` for up to ``t_max`` rows on the
        head's own state ``hs``: the verify step's rows (no GDN snapshots,
        no indexer or PLE rows: the head has none), ``hs.hid`` [t_max, S, D]
        (the trunk's wide residual rows it reads) and ``hs.head_hidden``,
        where a call leaves the head's own wide residual (``multi.res``,
        what a further drafting step reads in place of the trunk's)."""
        qwen3next.Net.alloc_multi(self, hs, t_max, snapshots=False)
        self.alloc_hc_multi(hs.multi, t_max)
        a = self.args
        f32 = dict(dtype=torch.float32, device=self.device)
        s, d = a.hc, a.n_embd
        hs.hid = torch.zeros(t_max, s, d, **f32)
        hs.en = torch.zeros(t_max, d, **f32)
        hs.hn = torch.zeros(t_max, s, d, **f32)
        hs.eh = torch.zeros(t_max, s, 2 * d, **f32)
        hs.picks = torch.zeros(t_max, dtype=torch.int64, device=self.device)
        hs.head_hidden = hs.multi.res

    def mtp_step(self, blk: SimpleNamespace, hs, ops, store, n: int, output: W.DenseMatrix, logits: Tensor,
                 vocab_ids: "Tensor | None" = None) -> None:
        """n rows of the MTP head at positions ``hs.pos`` .. ``hs.pos`` + n - 1
        (:meth:`fle_engine.models.qwen4exp_mtp.MTPHead.body`, then its
        ``readout``), row t the pair (the trunk's wide residual ``hs.hid[t]``
        [S, D], the token ``hs.toks[t]`` that followed it): stream s of
        x = eh_proj [RMS(embed) * enorm ; RMS(hidden_s) * hnorm_s], then the
        trunk layer's HC read -> dense gated attention (its K/V written at
        those positions of ``hs.kv[0]``) -> HC write -> HC read -> MoE (its
        experts read from ``store``'s layer 0) -> HC write, leaving the
        head's wide residual in ``hs.multi.res[:n]`` (what a further
        drafting step reads); the head mixer's read of it -> ``output``'s
        logits in ``logits[:n]`` and each row's draft in
        ``hs.next_toks[:n]`` (``vocab_ids[argmax]`` when ``output`` is cut
        to a draft vocabulary); the position advances by n. Static shapes,
        no host synchronisation: one CUDA graph per n."""
        a, m = self.args, hs.multi
        s, d = a.hc, a.n_embd
        impl = self.impl(hs)
        L = blk.layer
        res, hxn, hinj, eh = m.res[:n], m.hxn[:n], m.hinj[:n], hs.eh[:n]
        self.embed_multi(hs, ops, n, blk.embed)
        ops.add_rmsnorm(m.x[:n], None, blk.enorm, a.eps, hs.en[:n])
        ops.hc_write_norm(hs.hid[:n], None, None, s, blk.hnorm, a.eps, hs.hn[:n])      # per stream
        eh[:, :, :d].copy_(hs.en[:n, None].expand(n, s, d))                            # the embedding half first
        eh[:, :, d:].copy_(hs.hn[:n])
        blk.eh_proj.matvec(eh.view(n * s, 2 * d), res.view(n * s, d), impl)
        ops.hc_write_norm(res, None, None, s, L.hc_attn.norm, a.eps, hxn)
        self.hc_read_multi(L.hc_attn, hs, ops, n)
        self.attention_multi(L.mixer, 0, hs, ops, n)
        ops.hc_write_norm(res, m.attn_out[:n], hinj, s, L.hc_ffn.norm, a.eps, hxn)
        self.hc_read_multi(L.hc_ffn, hs, ops, n)
        self.moe_multi(L.moe, 0, hs, ops, store, n)
        ops.hc_write_norm(res, self.multi_parts(L.moe, hs, n), hinj, s, blk.head_hc.norm, a.eps, hxn)
        self.hc_read_multi(blk.head_hc, hs, ops, n)
        output.matvec(m.xn[:n], logits[:n], impl)
        self.mtp_pick(hs, n, logits, vocab_ids)
        self.advance(hs, n)

    def mtp_hidden(self, state, n: int) -> Tensor:
        """What the MTP head reads of the step that just ran (T = ``n``):
        the wide residual after the last layer [T, S, D] (before the output
        mixer; the reference's ``state.hidden``)."""
        return state.bufs.res[None] if n == 1 else state.multi.res[:n]

    # recurrent state: GDN (qwen3next) and the PLE token and conv histories -----------------
    def restore_multi(self, state, t: int) -> None:
        """GDN states from their snapshots; the PLE histories as they were
        after token ``t`` of the last verify step: windows of the history
        before the step followed by its tokens (values)."""
        super().restore_multi(state, t)
        b, m, a = state.bufs, state.multi, self.args
        if b.ple_tok is not None:
            b.ple_tok.copy_(m.ple_seq[t + 1:t + a.ple_ngram])
            b.ple_hist.copy_(m.ple_full[t + 1:t + 1 + a.ple_hist])

    def recurrent_backup(self, state) -> list:
        out = super().recurrent_backup(state)
        b = state.bufs
        if b.ple_tok is not None:
            out.append((None, b.ple_tok.clone(), b.ple_hist.clone()))
        return out

    def recurrent_restore(self, state, backup: list) -> None:
        super().recurrent_restore(state, [e for e in backup if e[0] is not None])
        b = state.bufs
        for il, tok, hist in backup:
            if il is None:
                b.ple_tok.copy_(tok)
                b.ple_hist.copy_(hist)

    def held_state(self, state, n: int) -> list:
        """The layers' part (:meth:`held_layer`), then the PLE token and conv
        histories whole (per sequence: the lane's rows)."""
        out = super().held_state(state, n)
        b = state.bufs
        if b.ple_tok is not None:
            out += [b.ple_tok, b.ple_hist]
        return out

    def held_layer(self, il: int, c, n: int) -> list:
        """A QSA layer also holds the indexer's raw keys of positions
        0..n-1 and the block keys of the blocks they touch (an incomplete
        block's key is refreshed by the next step and counts only once
        complete)."""
        out = super().held_layer(il, c, n)
        if len(c) == 4:
            r = self.args.compress[il]
            out += [c[2][:n], c[3][:-(-n // r)]]
        return out

    # prefill (runtime.prefill): a micro-batch of many tokens --------------------------------
    def prefill_hc_read(self, hc: HC, hxn: Tensor, state, ops) -> "tuple[Tensor, Tensor | None]":
        """:meth:`hc_read` of T tokens' normed streams ``hxn`` [T, S, D] ->
        (block input [T, D], raw inject logits [T, S] or None)."""
        from .prefill import dense_rows

        a, dt = self.args, state.prefill_dtype
        n, s = hxn.shape[0], a.hc
        f32 = dict(dtype=torch.float32, device=hxn.device)
        flat = hxn.view(n, -1)
        lo = dense_rows(hc.down, flat, torch.empty(n, a.hc_rank, **f32), ops, dt)
        inj = None if hc.inject is None else dense_rows(hc.inject, flat, torch.empty(n, s, **f32), ops, dt)
        act = F.silu(torch.mul(lo, 1.0 / s))
        gate = dense_rows(hc.up, act, torch.empty(n, s * a.n_embd, **f32), ops, dt)
        xn = torch.empty(n, a.n_embd, **f32)
        ops.hc_mix(hxn, gate, xn)
        return xn, inj

    def prefill_trunk(self, tok: Tensor, pos0: int, state, ops, buf, moe, keep=None) -> Tensor:
        """The layers over a micro-batch of T tokens at pos0 .. pos0 + T - 1
        (the decode step's order on T rows: PLE, HC reads and writes, the
        mixer, ``moe(layer, il, xn, buf)`` for the routed and shared
        experts); returns the head's input of the last token [1, D].
        ``keep``: called with the wide residual after the last layer
        [T, S, D] (what the MTP head reads, :meth:`mtp_hidden`)."""
        from .prefill import dense_rows

        a, dt = self.args, state.prefill_dtype
        n, s, d = tok.numel(), a.hc, a.n_embd
        f32 = dict(dtype=torch.float32, device=tok.device)
        x = self.prefill_embed(tok, ops)
        res = x[:, None, :].expand(n, s, d).contiguous()                   # S copies of each embedding
        hxn = torch.empty_like(res)
        ops.hc_write_norm(res, None, None, s, self.layers[0].hc_attn.norm, a.eps, hxn)
        for il, L in enumerate(self.layers):
            if L.ple is not None:
                g = a.ple_ngram
                bufs = SimpleNamespace(rows=torch.empty(n * a.ple_heads, dtype=torch.int64, device=tok.device),
                                       emb=torch.empty(n, d, **f32), kv=torch.empty(n, s * d + d, **f32),
                                       full=torch.empty(a.ple_hist + n, s * d, **f32))
                self.ple_rows_tokens(L.ple, state, tok,
                                     torch.empty(g - 1 + n, dtype=torch.int64, device=tok.device), bufs.rows)
                self.ple_tokens(L.ple, state, ops, res, bufs, lambda mat, xx, out: dense_rows(mat, xx, out, ops, dt))
                ops.hc_write_norm(res, None, None, s, L.hc_attn.norm, a.eps, hxn)
            xn, inj = self.prefill_hc_read(L.hc_attn, hxn, state, ops)
            self.prefill_mixer(L, il, xn, buf.attn_out, pos0, state, ops)
            ops.hc_write_norm(res, buf.attn_out.view(n, 1, d), inj, s, L.hc_ffn.norm, a.eps, hxn)
            xn, inj = self.prefill_hc_read(L.hc_ffn, hxn, state, ops)
            moe(L, il, xn, buf)
            nxt = self.layers[il + 1].hc_attn.norm if il + 1 < len(self.layers) else self.output_hc.norm
            ops.hc_write_norm(res, self.prefill_parts(L.moe, buf), inj, s, nxt, a.eps, hxn)
        if keep is not None:
            keep(res)
        last, _ = self.prefill_hc_read(self.output_hc, hxn[-1:].contiguous(), state, ops)
        return last

    def prefill_mixer(self, L: Layer, il: int, xn: Tensor, out: Tensor, pos0: int, state, ops) -> None:
        if isinstance(L.mixer, qwen3next.GDN):
            self.prefill_gdn(L.mixer, il, xn, out, state, ops)
        else:
            self.prefill_attention(L.mixer.attn if isinstance(L.mixer, QSA) else L.mixer, il, xn, out, pos0, state,
                                   ops)

    def prefill_keep(self, il: int, xn: Tensor, pos0: int, state, ops) -> "Tensor | None":
        """On a QSA layer: the indexer's raw keys of the T positions written,
        the blocks holding them re-pooled, and each query's kept blocks (the
        best complete ones at its position, plus its tail) as cells
        [T, pos0 + T] within the causal mask; the decode step's arithmetic
        per query."""
        from .prefill import dense_rows

        mx = self.layers[il].mixer
        if not isinstance(mx, QSA):
            return None
        a, dt = self.args, state.prefill_dtype
        hi, di, r = a.idx_heads, a.idx_dim, mx.ratio
        n, dev = xn.shape[0], xn.device
        end = pos0 + n
        iqk = torch.empty(n, (hi + 1) * di, dtype=torch.float32, device=dev)
        if mx.iqk is not None:
            dense_rows(mx.iqk, xn, iqk, ops, dt)
        else:
            dense_rows(mx.parts[0], xn, iqk[:, :hi * di], ops, dt)
            dense_rows(mx.parts[1], xn, iqk[:, hi * di:], ops, dt)
        _, _, raw, kb = state.kv[il]
        raw[pos0:end] = iqk[:, hi * di:].to(raw.dtype)
        b0, b1 = pos0 // r, (end - 1) // r + 1                              # the blocks the T positions touch
        pooled = Lr.rms_norm(raw.view(-1, r, di)[b0:b1].float().mean(1), mx.k_norm, a.eps)
        starts = torch.arange(b0, b1, device=dev) * r
        kb[b0:b1] = Lr.apply_rope_neox(pooled[:, None], state.rope_cos[starts], state.rope_sin[starts])[:, 0]
        positions = torch.arange(pos0, end, device=dev)
        q = Lr.rms_norm(iqk[:, :hi * di].view(n, hi, di), mx.q_norm, a.eps)
        q = Lr.apply_rope_neox(q, state.rope_cos[pos0:end], state.rope_sin[pos0:end])
        nb = b1                                                              # blocks past the last position: never
        score = torch.relu(kb[:nb] @ q.reshape(n * hi, di).T).view(nb, n, hi).sum(-1).T       # [T, NB]
        complete = torch.div(positions + 1, r, rounding_mode="floor")
        tail = torch.arange(nb, device=dev)[None, :] >= complete[:, None]
        score = score.masked_fill(tail, float("-inf"))
        top, which = torch.sort(score, dim=-1, descending=True, stable=True)
        k = min(mx.n_kept, nb)
        chosen = torch.zeros_like(tail).scatter(1, which[:, :k], top[:, :k] > float("-inf"))
        kept = chosen | tail
        slots = torch.arange(end, device=dev)
        return kept[:, slots // r] & (slots[None, :] <= positions[:, None])
