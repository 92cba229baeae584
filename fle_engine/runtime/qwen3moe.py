"""qwen3moe on the engine: one decode token per step, the same arithmetic as
the reference pass (:mod:`fle_engine.models.qwen3moe`) in fused kernels.

Per layer, 11 launches: RMSNorm is folded into the residual add that
precedes it; q, k and v are one product (their rows concatenated when
they share a quant type); q/k norms, rotary and the KV write are one
kernel; attention is a split pass and a reduction over the used length;
the router is one float32 product, softmax/top-K one kernel, and the
routed experts two (gate+up with SwiGLU, down with the routing weights).

The pieces (attention, routed MoE with an optional shared expert, the
buffers) are methods that :mod:`.qwen3next` reuses.

:meth:`Net.step_multi` is the verify step of drafted decoding: T tokens at
positions pos .. pos + T - 1 in one pass (the same launches per layer with
T rows; attention causal within the step; each distinct routed expert of
the step read once for all its tokens, the CPU's share of the distinct
misses computed on the CPU when they are split), qwen3moe's layers only.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

from fle_quant.ggml_types import GGMLType

from ..kernels.cpu_experts.acts import DOT_TYPE
from ..models.qwen3moe import ModelArgs
from . import weights as W
from .cache import expert_products

ARCH = "qwen3moe"


@dataclass
class Attn:
    qkv: "W.DenseMatrix | None"          # rows q | k | v (| gate), or None: separate products
    parts: "list[W.DenseMatrix] | None"
    wo: W.DenseMatrix
    q_norm: Tensor
    k_norm: Tensor
    gated: bool = False


@dataclass
class Moe:
    router: Tensor                       # float32 [E, D]
    layout: W.ExpertLayout
    shared: "tuple[W.DenseMatrix, W.DenseMatrix, W.DenseMatrix] | None" = None
    shared_gate: "Tensor | None" = None  # float32 [1, D]


@dataclass
class Layer:
    attn_norm: Tensor
    mixer: object
    ffn_norm: Tensor
    moe: Moe


class Net:
    """The engine's weights and step for one qwen3moe file."""

    Args = ModelArgs
    supports_prefill = True     # runtime.prefill can process prompts many tokens at once
    positional_state = True     # the KV cache alone, by position: a sequence can be cut back to any prefix

    def __init__(self, gguf, weights_view, device: torch.device, fast: bool):
        self.args = self.Args.from_weights(weights_view)
        self.gguf, self.device, self.fast = gguf, device, fast
        self.expert_sources: dict[int, list] = {}
        self.layers = [self.load_layer(il) for il in range(self.args.n_layer)]
        a = self.args
        self.load_head()
        self.tok_embd = self.dense("token_embd.weight", a.n_vocab, a.n_embd)
        self.layouts = {il: L.moe.layout for il, L in enumerate(self.layers)}
        self.gguf = None

    # loading -----------------------------------------------------------------------
    @contextmanager
    def reading(self, gguf):
        """The loaders (:meth:`dense`, :meth:`vec`, the layers') read ``gguf``
        inside the block, e.g. an MTP head's file after the trunk's closed."""
        saved, self.gguf = self.gguf, gguf
        try:
            yield
        finally:
            self.gguf = saved

    def dense(self, name: str, n_out: int, n_in: int, rows=None) -> W.DenseMatrix:
        return W.dense(self.gguf, name, self.device, n_out, n_in, fast_needed=self.fast, rows=rows)

    def vec(self, name: str, n: int) -> Tensor:
        return W.vector(self.gguf, name, self.device, n)

    def load_head(self) -> None:
        """The final norm and the output matrix (the embedding when tied)."""
        a = self.args
        self.output_norm = self.vec("output_norm.weight", a.n_embd)
        head = "output.weight" if "output.weight" in self.gguf.tensors else "token_embd.weight"
        self.output = self.dense(head, a.n_vocab, a.n_embd)

    def load_layer(self, il: int) -> Layer:
        p, a = f"blk.{il}.", self.args
        return Layer(self.vec(p + "attn_norm.weight", a.n_embd), self.load_attention(il),
                     self.vec(p + "ffn_norm.weight", a.n_embd), self.load_moe(il))

    def load_attention(self, il: int, gated: bool = False) -> Attn:
        """q, k, v (one product when the types allow), output, q/k norms;
        ``gated``: attn_q holds per head Dh query rows then Dh gate rows
        (qwen3next), which are reordered into a q block and a gate block."""
        p, a = f"blk.{il}.", self.args
        hd, nq, nkv = a.head_dim, a.n_head * a.head_dim, a.n_head_kv * a.head_dim
        g = self.gguf
        if p + "attn_qkv.weight" in g.tensors and not gated:
            parts = [self.dense(p + "attn_qkv.weight", nq + 2 * nkv, a.n_embd)]
        else:
            if gated:
                idx = torch.arange(2 * nq).view(a.n_head, 2, hd)
                q = self.dense(p + "attn_q.weight", nq, a.n_embd, rows=idx[:, 0].reshape(-1).numpy())
                gate = self.dense(p + "attn_q.weight", nq, a.n_embd, rows=idx[:, 1].reshape(-1).numpy())
            else:
                q = self.dense(p + "attn_q.weight", nq, a.n_embd)
            parts = [q, self.dense(p + "attn_k.weight", nkv, a.n_embd), self.dense(p + "attn_v.weight", nkv, a.n_embd)]
            if gated:
                parts.append(gate)
        qkv = parts[0] if len(parts) == 1 else W.concat(parts, p + "attn_qkv")
        return Attn(qkv=qkv, parts=None if qkv is not None else parts,
                    wo=self.dense(p + "attn_output.weight", a.n_embd, nq),
                    q_norm=self.vec(p + "attn_q_norm.weight", hd), k_norm=self.vec(p + "attn_k_norm.weight", hd),
                    gated=gated)

    def load_moe(self, il: int, shared: bool = False) -> Moe:
        p, a = f"blk.{il}.", self.args
        lay, src = W.expert_layout(self.gguf, il, a.n_ff_exp, a.n_embd, fast_needed=self.fast)
        self.expert_sources[il] = src
        router = self.vec(p + "ffn_gate_inp.weight", a.n_expert * a.n_embd).view(a.n_expert, a.n_embd).contiguous()
        sh = sg = None
        if shared and p + "ffn_up_shexp.weight" in self.gguf.tensors:
            f = a.n_ff_shexp
            sh = (self.dense(p + "ffn_gate_shexp.weight", f, a.n_embd), self.dense(p + "ffn_up_shexp.weight", f, a.n_embd),
                  self.dense(p + "ffn_down_shexp.weight", a.n_embd, f))
            if p + "ffn_gate_inp_shexp.weight" in self.gguf.tensors:
                sg = self.vec(p + "ffn_gate_inp_shexp.weight", a.n_embd).view(1, a.n_embd)
        return Moe(router, lay, sh, sg)

    @property
    def dense_bytes(self) -> int:
        mats = [self.output] + ([self.tok_embd] if self.tok_embd is not self.output else [])
        n = 0
        for L in self.layers:
            mats += [m for m in vars(L.mixer).values() if isinstance(m, W.DenseMatrix)]
            mats += [m for ms in vars(L.mixer).values() if isinstance(ms, list) for m in ms]
            n += L.moe.router.numel() * 4
            mats += list(L.moe.shared or ())
        return n + W.unique_bytes(mats)

    # state and buffers ---------------------------------------------------------------
    def kv_cache(self, ctx: int, dtype, n_seq: int = 1):
        """One layer's K or V cache [Hkv, ctx, Dh]: a float tensor, or q8_0;
        for ``n_seq`` > 1 sequences (lanes) [n_seq, Hkv, ctx, Dh]."""
        a = self.args
        if dtype == "q8_0":
            from ..kernels.engine_ops import Q8Cache

            return Q8Cache(a.n_head_kv, ctx, a.head_dim, self.device, lanes=n_seq if n_seq > 1 else 0)
        lead = (n_seq,) if n_seq > 1 else ()
        return torch.zeros(*lead, a.n_head_kv, ctx, a.head_dim, dtype=dtype, device=self.device)

    def new_caches(self, ctx: int, k_dtype, v_dtype, n_seq: int = 1) -> list:
        """Per layer the state of ``n_seq`` sequences of ``ctx`` positions:
        with n_seq > 1 every tensor has a leading lane dimension (lane i's
        state is element i of each, :func:`~fle_engine.kernels.engine_ops.lane_of`)."""
        return [(self.kv_cache(ctx, k_dtype, n_seq), self.kv_cache(ctx, v_dtype, n_seq))
                for _ in range(self.args.n_layer)]

    def reset(self, state) -> None:
        """A new sequence: attention caches are addressed by position, nothing to clear."""

    # variants of the step: a step whose shapes depend on how far the sequence has come (qwen4exp's
    # indexer) has one variant per length bucket, each captured as its own graph; the others have one
    def variants(self, ctx: int) -> list:
        """The step's variants for ``ctx`` allocated positions."""
        return [None]

    def variant_for(self, pos: int, ctx: int):
        """The variant that a step at position ``pos`` runs."""
        return None

    def set_variant(self, state, variant) -> None:
        """Make the next steps (eager or captured) run ``variant``."""

    def alloc(self, state) -> None:
        """The step's device buffers (static addresses for graph capture)."""
        a, dev = self.args, self.device
        hd = a.head_dim
        f32 = dict(dtype=torch.float32, device=dev)
        b = state.bufs
        b.x = torch.zeros(1, a.n_embd, **f32)
        b.xn = torch.zeros(1, a.n_embd, **f32)
        b.xq = torch.zeros(1, a.n_embd, **f32)       # b.xn rounded for the misses (--miss-activations q8)
        b.qkv = torch.zeros(1, (2 * a.n_head + 2 * a.n_head_kv) * hd, **f32)     # room for a gate block
        b.q = torch.zeros(a.n_head * hd, **f32)
        b.o = torch.zeros(1, a.n_head * hd, **f32)
        b.attn_out = torch.zeros(1, 1, a.n_embd, **f32)
        b.router = torch.zeros(1, a.n_expert, **f32)
        b.ids = torch.zeros(1, a.n_expert_used, dtype=torch.int64, device=dev)
        b.wts = torch.zeros(1, a.n_expert_used, **f32)
        b.h = torch.zeros(a.n_expert_used, a.n_ff_exp, **f32)
        n_sh = int(any(L.moe.shared is not None for L in self.layers))
        self._n_sh = n_sh
        # routed outputs (+ shared) (+ the CPU's share of the misses when they are split, runtime.split)
        b.y = torch.zeros(1, a.n_expert_used + n_sh + 1, a.n_embd, **f32)
        if n_sh:
            f = a.n_ff_shexp
            b.sg, b.su = torch.zeros(1, f, **f32), torch.zeros(1, f, **f32)
            b.sgate = torch.zeros(1, 1, **f32)
        b.logits = torch.zeros(1, a.n_vocab, **f32)
        if state.fast:
            from ..kernels.triton_engine import attn_scratch

            b.partial, b.ml = attn_scratch(a.n_head_kv, a.n_head, hd, dev)
        else:
            b.partial = b.ml = None

    # the step ------------------------------------------------------------------------
    def impl(self, state) -> str:
        return "triton" if state.fast else "reference"

    def mix(self, L: Layer, il: int, state, ops) -> None:
        """The layer's token mixer: b.xn -> b.attn_out."""
        self.attention(L.mixer, il, state, ops)

    def attention(self, at: Attn, il: int, state, ops) -> None:
        """b.xn -> b.attn_out (attention of the current token)."""
        a, b, hd = self.args, state.bufs, self.args.head_dim
        impl = self.impl(state)
        nq, nkv = a.n_head * hd, a.n_head_kv * hd
        if at.qkv is not None:
            at.qkv.matvec(b.xn, b.qkv[:, :at.qkv.n_out], impl)
        else:
            off = 0
            for m in at.parts:
                m.matvec(b.xn, b.qkv[:, off:off + m.n_out], impl)
                off += m.n_out
        kc, vc = state.kv[il][:2]
        ops.qk_rope_kv(b.qkv[0, :nq + 2 * nkv], at.q_norm, at.k_norm, a.eps, state.rope_cos, state.rope_sin, state.pos,
                       a.n_head, a.n_head_kv, hd, a.n_rot, b.q, kc, vc)
        self.attend(at, il, state, ops)
        if at.gated:
            b.o.mul_(torch.sigmoid(b.qkv[:, nq + 2 * nkv:2 * nq + 2 * nkv]))
        at.wo.matvec(b.o, b.attn_out.view(1, -1), impl)

    def attend(self, at: Attn, il: int, state, ops) -> None:
        """b.q (normed, rotated) over the layer's KV cache -> b.o."""
        a, b = self.args, state.bufs
        kc, vc = state.kv[il][:2]
        ops.attention(b.q, kc, vc, state.pos, getattr(a, "attn_scale", a.head_dim ** -0.5), b.o.view(-1), b.partial,
                      b.ml)

    def moe(self, m: Moe, il: int, state, ops, cache) -> None:
        """b.xn -> b.y [1, K (+1), D]: the weighted routed experts (and the
        gated shared expert)."""
        a, b = self.args, state.bufs
        impl = self.impl(state)
        k = a.n_expert_used
        stage = getattr(state, "stage", None)
        if stage is not None:
            stage.fork(il, b.xn, ops)           # the next layer's predicted misses, on a copy stream
        ops.float_mv(b.xn, m.router, b.router)
        smap = cache.layer_map(il)
        ops.route_topk(b.router, k, a.expert_weights_scale, smap, b.ids, b.wts, state.ids_log[il:il + 1],
                       state.hit_log[il:il + 1])
        if stage is not None:
            stage.apply(il, b.ids.view(-1), ops)
        ids, lay = b.ids.view(-1), m.layout
        y = b.y[0, :k]
        split = getattr(state, "split", None)
        share = split.share if split is not None and il in split.index else 0
        if share:
            ops.post_misses(split, il, b.xn.view(-1), ids, b.wts.view(-1), smap, state.serial)
        q8 = getattr(state, "miss_q8", False)
        xq = b.xq if q8 else None
        if q8:
            ops.round_acts(b.xn, DOT_TYPE[lay.gu_type] == GGMLType.Q8_K, b.xq)
        gate_up, down = expert_products(cache, il, lay, a.n_embd, state.fast)
        mode = cache.mode if state.fast else "miss"
        if q8:                                  # the missed rows' activations rounded between the products
            ops.experts(*gate_up, smap, ids, b.xn, b.h, True, k, mode=mode, cpu_share=share, x_miss=xq)
            ops.round_acts(b.h, DOT_TYPE[lay.down_type] == GGMLType.Q8_K, b.h, ids, smap)
            ops.experts(*down, smap, ids, b.h, y, False, k, b.wts.view(-1), mode=mode, cpu_share=share)
        else:
            ops.experts_ffn(gate_up, down, smap, ids, b.xn, b.h, y, k, b.wts.view(-1), mode=mode, cpu_share=share)
        if m.shared is not None:
            self.shared_expert(m, b.xn, b.sg, b.su, b.sgate, b.y[:, k], impl)
        elif self._n_sh and split is not None:
            b.y[:, k].zero_()                 # the parts are summed as one range
        if split is not None:
            row = b.y[0, k + self._n_sh]
            if share:
                ops.wait_misses(split, il, ids, smap, state.serial, row)
            else:
                row.zero_()
        if stage is not None:
            stage.finish(il, ops)               # after the wait: it reads the map as the post did

    @staticmethod
    def shared_expert(m: Moe, xn: Tensor, sg: Tensor, su: Tensor, sgate: Tensor, out: Tensor, impl: str) -> None:
        """The (gated) shared expert of the rows ``xn`` [T, D] -> ``out`` [T, D];
        ``sg``, ``su`` [T, F] and ``sgate`` [T, 1] are its scratch."""
        g, u, d = m.shared
        g.matvec(xn, sg, impl)
        u.matvec(xn, su, impl)
        sg.copy_(F.silu(sg) * su)
        d.matvec(sg, out, impl)
        if m.shared_gate is not None:
            torch.matmul(xn, m.shared_gate.T, out=sgate)
            out.mul_(torch.sigmoid(sgate))

    def moe_parts(self, m: Moe, state) -> Tensor:
        """The parts of b.y that layer's MoE wrote: K routed (+ the shared
        expert) (+ the CPU's share of the misses)."""
        if getattr(state, "split", None) is not None:
            return state.bufs.y
        return state.bufs.y[:, :self.args.n_expert_used + (m.shared is not None)]

    def embed(self, state, ops) -> None:
        b = state.bufs
        if self.tok_embd.qtype in W.FLOAT_TYPES:
            b.x.copy_(self.tok_embd.data[state.tok])
        else:
            ops.embed_row(self.tok_embd.data, self.tok_embd.qtype, state.tok, b.x.view(-1))

    def head(self, state, ops) -> None:
        b = state.bufs
        self.output.matvec(b.xn, b.logits, self.impl(state))
        torch.argmax(b.logits, dim=-1, out=state.tok)
        state.pos.add_(1)

    def step(self, state, ops, cache) -> None:
        """One decode token: reads ``state.tok`` and ``state.pos`` on the
        device, writes the logits and the next greedy token, advances pos."""
        a, b = self.args, state.bufs
        self.embed(state, ops)
        ops.add_rmsnorm(b.x, None, self.layers[0].attn_norm, a.eps, b.xn)
        for il, L in enumerate(self.layers):
            self.mix(L, il, state, ops)
            ops.add_rmsnorm(b.x, b.attn_out, L.ffn_norm, a.eps, b.xn)
            self.moe(L.moe, il, state, ops, cache)
            nxt = self.layers[il + 1].attn_norm if il + 1 < len(self.layers) else self.output_norm
            ops.add_rmsnorm(b.x, self.moe_parts(L.moe, state), nxt, a.eps, b.xn)
        self.head(state, ops)

    # prefill (runtime.prefill): many tokens at once ---------------------------------------
    def prefill_embed(self, tok: Tensor, ops) -> Tensor:
        """Embedding rows of the tokens ``tok`` (int64 [T], device) -> float32 [T, D]."""
        a = self.args
        if self.tok_embd.qtype in W.FLOAT_TYPES:
            return self.tok_embd.data[tok].float().contiguous()
        out = torch.empty(tok.numel() * a.n_embd, dtype=torch.float32, device=tok.device)
        ops.gather_rows(self.tok_embd.data, self.tok_embd.qtype, 0, tok, out)
        return out.view(tok.numel(), a.n_embd)

    def prefill_mixer(self, L: Layer, il: int, xn: Tensor, out: Tensor, pos0: int, state, ops) -> None:
        """The token mixer of T tokens at positions pos0 .. pos0 + T - 1:
        ``xn`` [T, D] -> ``out`` [T, D]."""
        self.prefill_attention(L.mixer, il, xn, out, pos0, state, ops)

    def prefill_attention(self, at: Attn, il: int, xn: Tensor, out: Tensor, pos0: int, state, ops) -> None:
        """Attention of T tokens (the decode step's arithmetic for many rows):
        q/k norms and rotary at their positions, K and V written into the
        cache, each token attending to the cache up to its own position."""
        from ..kernels.engine_ops import Q8Cache
        from ..layers import apply_rope_neox, rms_norm
        from .prefill import dense_rows

        a, hd = self.args, self.args.head_dim
        T = xn.shape[0]
        nq, nkv = a.n_head * hd, a.n_head_kv * hd
        width = nq + 2 * nkv + (nq if at.gated else 0)
        qkv = torch.empty(T, width, dtype=torch.float32, device=xn.device)
        off = 0
        for m in ([at.qkv] if at.qkv is not None else at.parts):
            dense_rows(m, xn, qkv[:, off:off + m.n_out], ops, state.prefill_dtype)
            off += m.n_out
        q = rms_norm(qkv[:, :nq].reshape(T, a.n_head, hd), at.q_norm, a.eps)
        k = rms_norm(qkv[:, nq:nq + nkv].reshape(T, a.n_head_kv, hd), at.k_norm, a.eps)
        v = qkv[:, nq + nkv:nq + 2 * nkv].reshape(T, a.n_head_kv, hd)
        c, s = state.rope_cos[pos0:pos0 + T], state.rope_sin[pos0:pos0 + T]
        q, k = apply_rope_neox(q, c, s), apply_rope_neox(k, c, s)          # partial rotary: the rest passes through
        kc, vc = state.kv[il][:2]
        end = pos0 + T
        for cache, val in ((kc, k), (vc, v)):
            val = val.transpose(0, 1)                                       # [Hkv, T, Dh]
            if isinstance(cache, Q8Cache):
                cache.store(slice(pos0, end), val)
            else:
                cache[:, pos0:end] = val.to(cache.dtype)
        kk, vv = (cc.values(end) if isinstance(cc, Q8Cache) else cc[:, :end] for cc in (kc, vc))
        dt = kk.dtype if kk.dtype in (torch.float16, torch.bfloat16) else torch.float32
        group = a.n_head // a.n_head_kv
        kk = kk.to(dt).repeat_interleave(group, dim=0)[None]
        vv = vv.to(dt).repeat_interleave(group, dim=0)[None]
        qh = q.transpose(0, 1).to(dt)[None]                                  # [1, H, T, Dh]
        scale = getattr(a, "attn_scale", hd ** -0.5)
        keep = self.prefill_keep(il, xn, pos0, state, ops)
        if keep is not None:
            o = F.scaled_dot_product_attention(qh, kk, vv, attn_mask=keep, scale=scale)
        elif pos0 == 0:
            o = F.scaled_dot_product_attention(qh, kk, vv, is_causal=True, scale=scale)
        else:
            mask = torch.arange(end, device=xn.device)[None, :] <= (pos0 + torch.arange(T, device=xn.device))[:, None]
            o = F.scaled_dot_product_attention(qh, kk, vv, attn_mask=mask, scale=scale)
        o = o[0].transpose(0, 1).reshape(T, nq).float()
        if at.gated:
            o = o * torch.sigmoid(qkv[:, nq + 2 * nkv:2 * nq + 2 * nkv])
        dense_rows(at.wo, o.contiguous(), out, ops, state.prefill_dtype)

    def prefill_keep(self, il: int, xn: Tensor, pos0: int, state, ops) -> "Tensor | None":
        """The cells each of T tokens at pos0 .. may attend to, bool [T, pos0 + T]
        (causal included), for sparse attention; None: causal (here)."""
        return None

    def prefill_shared(self, m: Moe, xn: Tensor, buf, ops, dtype) -> None:
        """The shared expert of T tokens (gated when the layer has a gate) -> buf.shared [T, D]."""
        from .prefill import dense_rows

        g, u, d = m.shared
        T = xn.shape[0]
        f32 = dict(dtype=torch.float32, device=xn.device)
        sg, su = torch.empty(T, g.n_out, **f32), torch.empty(T, u.n_out, **f32)
        dense_rows(g, xn, sg, ops, dtype)
        dense_rows(u, xn, su, ops, dtype)
        ys = torch.empty(T, self.args.n_embd, **f32)
        dense_rows(d, (F.silu(sg) * su).contiguous(), ys, ops, dtype)
        if m.shared_gate is not None:
            ys.mul_(torch.sigmoid(xn @ m.shared_gate.T))
        buf.shared = ys

    def prefill_parts(self, m: Moe, buf) -> Tensor:
        """The parts that the layer's MoE wrote for T tokens: [T, K (+1), D],
        the routed experts (then the shared one), in the decode step's order."""
        y = buf.y.view(buf.T, self.args.n_expert_used, self.args.n_embd)
        if m.shared is None:
            return y
        return torch.cat([y, buf.shared[:, None]], 1)

    # several sequences (lanes, runtime.Engine(n_seq=N)) ------------------------------------
    def lanes_unsupported(self) -> "str | None":
        """Why this net cannot hold several sequences at once, or None."""
        return None

    def lane_bufs(self, state, n_seq: int) -> "tuple[list, object]":
        """(each lane's ``bufs``, the batched step's): the step's scratch is
        shared by all; a net that keeps per-sequence state among its buffers
        gives each lane its own."""
        return [state.bufs] * n_seq, state.bufs

    def held_state(self, state, n: int) -> list:
        """Views of everything ``state`` (one sequence: a lane's, or the
        engine's) carries for its first ``n`` positions, in a fixed order:
        per layer :meth:`held_layer`. Copying them out and back in gives the
        sequence back (runtime.Engine.lane_snapshot / lane_restore)."""
        return [v for il, c in enumerate(state.kv) for v in self.held_layer(il, c, n)]

    def held_layer(self, il: int, c, n: int) -> list:
        """Layer ``il``'s part of :meth:`held_state`: the K and V rows of
        positions 0..n-1 (a q8_0 cache's values and scales)."""
        from ..kernels.engine_ops import Q8Cache

        out = []
        for t in c[:2]:
            out += [t.q[:, :n], t.d[:, :n]] if isinstance(t, Q8Cache) else [t[:, :n]]
        return out

    # the verify step: T tokens in one pass -------------------------------------------
    def multi_unsupported(self) -> "str | None":
        """Why :meth:`step_multi` cannot run on this net, or None."""
        return None

    # recurrent state (none here: the KV cache is addressed by position) ---------------------
    def recurrent_backup(self, state) -> list:
        """Copies of the state that a step changes other than by position (none for qwen3moe)."""
        return []

    def recurrent_restore(self, state, backup: list) -> None:
        """Put back what :meth:`recurrent_backup` copied."""

    def restore_multi(self, state, t: int) -> None:
        """The recurrent state as it was after token ``t`` of the last
        :meth:`step_multi` (nothing to do here: a rewind moves the position)."""

    def alloc_multi(self, state, t_max: int, snapshots: bool = True) -> None:
        """Buffers of :meth:`step_multi` for up to ``t_max`` tokens (static
        addresses: a step of T tokens uses the first T rows), in
        ``state.multi``; ``state.toks`` int64 [t_max] the input tokens and
        ``state.next_toks`` int64 [t_max] the greedy token after each.
        ``snapshots``: room for the recurrent states after each token (what
        a rewind of the verify step restores; a batched step of several
        sequences needs none)."""
        a, dev = self.args, self.device
        hd, k = a.head_dim, a.n_expert_used
        f32 = dict(dtype=torch.float32, device=dev)
        m = state.multi = SimpleNamespace(t_max=t_max)
        m.x = torch.zeros(t_max, a.n_embd, **f32)
        m.xn = torch.zeros(t_max, a.n_embd, **f32)
        m.qkv = torch.zeros(t_max, (2 * a.n_head + 2 * a.n_head_kv) * hd, **f32)     # room for a gate block
        m.q = torch.zeros(t_max, a.n_head * hd, **f32)
        m.o = torch.zeros(t_max, a.n_head * hd, **f32)
        m.attn_out = torch.zeros(t_max, 1, a.n_embd, **f32)
        m.router = torch.zeros(t_max, a.n_expert, **f32)
        m.ids = torch.zeros(t_max, k, dtype=torch.int64, device=dev)
        m.wts = torch.zeros(t_max, k, **f32)
        m.h = torch.zeros(t_max * k, a.n_ff_exp, **f32)
        m.y = torch.zeros(t_max, k, a.n_embd, **f32)                         # [T, K, D]: the routed parts of each token
        if self._n_sh:
            # with a shared expert the parts of a token are [K routed, shared], summed in the decode step's order
            m.parts = torch.zeros(t_max, k + 1, a.n_embd, **f32)
            m.sg = torch.zeros(t_max, a.n_ff_shexp, **f32)
            m.su = torch.zeros(t_max, a.n_ff_shexp, **f32)
            m.sgate = torch.zeros(t_max, 1, **f32)
        # with the misses split (runtime.split): [K routed (the CPU's rows zero) (+ shared), the CPU's sum] per
        # row, summed in the decode step's order; and the rows rounded for the misses (--miss-activations q8)
        m.xparts = torch.zeros(t_max, k + self._n_sh + 1, a.n_embd, **f32)
        m.xq = torch.zeros(t_max, a.n_embd, **f32)
        m.logits = torch.zeros(t_max, a.n_vocab, **f32)
        # per layer the routed ids of all T tokens (row-major [T, K]) and whether the map had them
        m.ids_log = torch.zeros(a.n_layer, t_max * k, dtype=torch.int32, device=dev)
        m.hit_log = torch.zeros(a.n_layer, t_max * k, dtype=torch.int32, device=dev)
        state.toks = torch.zeros(t_max, dtype=torch.int64, device=dev)
        state.next_toks = torch.zeros(t_max, dtype=torch.int64, device=dev)
        if state.fast:
            from ..kernels.triton_engine import attn_scratch

            m.partial, m.ml = attn_scratch(a.n_head_kv, a.n_head, hd, dev, n_tok=t_max)
        else:
            m.partial = m.ml = None

    def attention_multi(self, at: Attn, il: int, state, ops, n: int) -> None:
        """m.xn [T, D] -> m.attn_out [T, 1, D]: k, v of the T tokens written
        at pos .. pos + T - 1, token t attending to positions <= pos + t."""
        a, m, hd = self.args, state.multi, self.args.head_dim
        impl = self.impl(state)
        nq, nkv = a.n_head * hd, a.n_head_kv * hd
        xn, qkv = m.xn[:n], m.qkv[:n]
        if at.qkv is not None:
            at.qkv.matvec(xn, qkv[:, :at.qkv.n_out], impl)
        else:
            off = 0
            for w in at.parts:
                w.matvec(xn, qkv[:, off:off + w.n_out], impl)
                off += w.n_out
        kc, vc = state.kv[il][:2]
        pos, lanes = self.rows_at(state, n)
        ops.qk_rope_kv_multi(qkv[:, :nq + 2 * nkv], at.q_norm, at.k_norm, a.eps, state.rope_cos, state.rope_sin,
                             pos, a.n_head, a.n_head_kv, hd, a.n_rot, m.q[:n], kc, vc,
                             **({} if lanes is None else {"lanes": lanes}))
        self.attend_multi(at, il, state, ops, n)
        if at.gated:
            m.o[:n].mul_(torch.sigmoid(qkv[:, nq + 2 * nkv:2 * nq + 2 * nkv]))
        at.wo.matvec(m.o[:n], m.attn_out[:n].view(n, -1), impl)

    def attend_multi(self, at: Attn, il: int, state, ops, n: int) -> None:
        """m.q[:T] (normed, rotated) over the layer's KV cache -> m.o[:T],
        token t seeing positions <= pos + t."""
        a, m = self.args, state.multi
        kc, vc = state.kv[il][:2]
        pos, lanes = self.rows_at(state, n)
        ops.attention_multi(m.q[:n], kc, vc, pos, getattr(a, "attn_scale", a.head_dim ** -0.5), m.o[:n],
                            m.partial, m.ml, **({} if lanes is None else {"lanes": lanes}))

    def mix_multi(self, L: Layer, il: int, state, ops, n: int) -> None:
        """The layer's token mixer for T tokens: m.xn [T, D] -> m.attn_out."""
        self.attention_multi(L.mixer, il, state, ops, n)

    @staticmethod
    def multi_share(state, il: int, n: int) -> int:
        """The CPU's share of layer ``il``'s misses in a T-row step (0: none)."""
        split = getattr(state, "split", None)
        if split is None or il not in split.index or not split.rows_fit(n):
            return 0
        return split.share

    def moe_multi(self, mo: Moe, il: int, state, ops, cache, n: int) -> None:
        """m.xn [T, D] -> m.y [T, K, D]: the weighted routed experts of the T
        tokens, each distinct expert read once (from its slot, or from host
        memory when missed) for every token routed to it. With the misses
        split (runtime.split) the CPU computes the last of the step's
        distinct missed experts (the union rule) for all their rows while
        the GPU computes the rest; the parts go to m.xparts [T, K (+1) + 1, D]
        with the CPU's per-row sums last."""
        a, m = self.args, state.multi
        k, lay = a.n_expert_used, mo.layout
        xn = m.xn[:n]
        stage = getattr(state, "stage", None)
        if stage is not None:
            stage.fork(il, xn, ops)             # the next layer's predicted misses of the T rows, on a copy stream
        ops.float_mv(xn, mo.router, m.router[:n])
        smap = cache.layer_map(il)
        ops.route_topk(m.router[:n], k, a.expert_weights_scale, smap, m.ids[:n], m.wts[:n],
                       m.ids_log[il, :n * k].view(n, k), m.hit_log[il, :n * k].view(n, k))
        ids, wts, h, y = m.ids[:n].view(-1), m.wts[:n].view(-1), m.h[:n * k], m.y[:n].view(n * k, -1)
        if stage is not None:
            stage.apply(il, ids, ops)
        split = getattr(state, "split", None)
        share = self.multi_share(state, il, n)
        if share:
            ops.post_misses(split, il, xn, ids, wts, smap, state.serial)
        q8 = getattr(state, "miss_q8", False)
        xq = m.xq[:n] if q8 else None
        if q8:
            ops.round_acts(xn, DOT_TYPE[lay.gu_type] == GGMLType.Q8_K, xq)
        kw = dict(cpu_share=share) if share else {}
        if state.fast:
            words, delta = cache.words(il, lay.gu_type)
            ops.experts_union(words, lay.gu_type, delta, 0, lay.expert_bytes // words.element_size(), lay.n_ff,
                              lay.gu_row_bytes, smap, ids, xn, h, True, k, mode=cache.mode, x_miss=xq, **kw)
            if q8:
                ops.round_acts(h, DOT_TYPE[lay.down_type] == GGMLType.Q8_K, h, ids, smap)
            words, delta = cache.words(il, lay.down_type)
            wsz = words.element_size()
            ops.experts_union(words, lay.down_type, delta, lay.down_offset // wsz, lay.expert_bytes // wsz, a.n_embd,
                              lay.down_row_bytes, smap, ids, h, y, False, k, wts, mode=cache.mode, **kw)
        else:
            st = cache.reference_store(il, lay.gu_type)
            ops.experts_union(st, lay.gu_type, 0, 0, 0, lay.n_ff, lay.gu_row_bytes, smap, ids, xn, h, True, k,
                              x_miss=xq, **kw)
            if q8:
                ops.round_acts(h, DOT_TYPE[lay.down_type] == GGMLType.Q8_K, h, ids, smap)
            st = cache.reference_store(il, lay.down_type)
            ops.experts_union(st, lay.down_type, 0, lay.down_offset // st.word, 0, a.n_embd, lay.down_row_bytes,
                              smap, ids, h, y, False, k, wts, **kw)
        if split is not None:
            parts = m.xparts[:n]
            parts[:, :k].copy_(m.y[:n])
            if mo.shared is not None:
                self.shared_expert(mo, xn, m.sg[:n], m.su[:n], m.sgate[:n], parts[:, k], self.impl(state))
            elif self._n_sh:
                parts[:, k].zero_()           # the parts are summed as one range
            row = parts[:, k + self._n_sh]
            if share:
                ops.wait_misses(split, il, ids, smap, state.serial, row)
            else:
                row.zero_()
        elif mo.shared is not None:
            m.parts[:n, :k].copy_(m.y[:n])
            self.shared_expert(mo, xn, m.sg[:n], m.su[:n], m.sgate[:n], m.parts[:n, k], self.impl(state))
        if stage is not None:
            stage.finish(il, ops)               # after the wait: it reads the map as the post did

    def multi_parts(self, mo: Moe, state, n: int) -> Tensor:
        """The parts that :meth:`moe_multi` wrote for T tokens: [T, K (+1) (+1), D]."""
        m = state.multi
        if getattr(state, "split", None) is not None:
            return m.xparts[:n]
        return m.parts[:n] if mo.shared is not None else m.y[:n]

    def embed_multi(self, state, ops, n: int, table: "W.DenseMatrix | None" = None) -> None:
        """The embedding rows of ``state.toks[:T]`` -> m.x[:T] (from ``table``,
        by default the model's ``token_embd``)."""
        x = state.multi.x[:n]
        e = table or self.tok_embd
        if e.qtype in W.FLOAT_TYPES and e.data.dtype == x.dtype:
            torch.index_select(e.data, 0, state.toks[:n], out=x)
        elif e.qtype in W.FLOAT_TYPES:               # a 16-bit table: its rows, widened
            x.copy_(e.data.index_select(0, state.toks[:n]))
        else:
            for t in range(n):
                ops.embed_row(e.data, e.qtype, state.toks[t:t + 1], x[t])

    # the batched step of several sequences: step_multi on a state with ``rows`` ---------------
    @staticmethod
    def rows_at(state, n: int) -> "tuple[Tensor, Tensor | None]":
        """(positions, lanes) of a T-row step: the verify step's (``state.pos``
        [1], the first of T consecutive positions; None), or in a batched
        step of several sequences (``state.rows``: the lane of each row) each
        row's own position and lane, int64 [T] each."""
        rows = getattr(state, "rows", None)
        if rows is None:
            return state.pos, None
        return state.row_pos[:n], rows[:n]

    @staticmethod
    def begin_rows(state, n: int) -> None:
        """The start of a T-row step: in a batched step each row's position
        read from its lane's (``state.lane_pos`` [N]); with the misses split
        the step counter advanced."""
        rows = getattr(state, "rows", None)
        if rows is not None:
            torch.index_select(state.lane_pos, 0, rows[:n], out=state.row_pos[:n])
        if getattr(state, "split", None) is not None:
            state.serial.add_(1)          # a step of its own for the CPU worker (runtime.split)

    @staticmethod
    def advance(state, n: int) -> None:
        """The position after a T-row step: pos + T (verify step), or every
        row's lane one further (batched step; the lanes of a step are distinct)."""
        rows = getattr(state, "rows", None)
        if rows is None:
            state.pos.add_(n)
        else:
            state.lane_pos.index_copy_(0, rows[:n], state.row_pos[:n] + 1)

    def step_multi(self, state, ops, cache, n: int) -> None:
        """T = ``n`` tokens in one pass (:meth:`alloc_multi` first): reads
        ``state.toks[:n]`` and ``state.pos`` on the device, writes the K/V of
        positions pos .. pos + n - 1, the logits of every token into
        ``state.multi.logits[:n]`` and the greedy token after each into
        ``state.next_toks[:n]``, and advances pos by n. Token t's logits
        equal those of a one-token step at position pos + t fed the same
        tokens (up to the order of float sums). With the misses split
        (runtime.split) the CPU computes its share of each layer's distinct
        missed experts (the union rule, :meth:`moe_multi`), else every
        missed expert is read by the GPU.

        The batched step of several sequences (lanes) is this step on a
        state whose ``rows`` [T] names each row's lane: ``state.kv`` holds
        the lanes' stacked caches, ``state.lane_pos`` [N] their positions;
        row t is lane ``rows[t]``'s next token, at that lane's position, its
        attention over that lane's cache only; the routed experts of all
        rows as one union (each distinct expert read once); every row's lane
        advances by one."""
        a, m = self.args, state.multi
        x, xn = m.x[:n], m.xn[:n]
        self.begin_rows(state, n)
        self.embed_multi(state, ops, n)
        ops.add_rmsnorm(x, None, self.layers[0].attn_norm, a.eps, xn)
        for il, L in enumerate(self.layers):
            self.mix_multi(L, il, state, ops, n)
            ops.add_rmsnorm(x, m.attn_out[:n], L.ffn_norm, a.eps, xn)
            self.moe_multi(L.moe, il, state, ops, cache, n)
            nxt = self.layers[il + 1].attn_norm if il + 1 < len(self.layers) else self.output_norm
            ops.add_rmsnorm(x, self.multi_parts(L.moe, state, n), nxt, a.eps, xn)
        self.output.matvec(xn, m.logits[:n], self.impl(state))
        torch.argmax(m.logits[:n], dim=-1, out=state.next_toks[:n])
        self.advance(state, n)
