"""qwen3next on the engine: the qwen3moe step's attention (gated: the
query rows of ``attn_q`` reordered into a q block and a gate block, the
output times sigmoid(gate)), routed experts plus the gated shared expert,
and gated delta net layers.

A GDN layer's projections are products of the quantized kernels on the
GGUF bytes (``ssm_ba`` and a legacy ``ssm_in`` are split by moving whole
rows; q|k|v, z, beta and alpha are one product when their types agree);
the short convolution, the one-token delta rule, the norm and the output
gate are one op (``gdn_step``: the reference pass's static torch blocks on
the reference side, two Triton kernels on the fast side), run on state
tensors the step owns, so they replay inside the graph.
Semantics as :mod:`fle_engine.models.qwen3next`.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
from torch import Tensor

from fle_quant.errors import FleError

from ..models.qwen3next import ModelArgs
from . import qwen3moe
from . import weights as W

ARCH = "qwen3next"


@dataclass
class GDN:
    qkv: W.DenseMatrix        # rows q | k | v (the conv channels)
    z: W.DenseMatrix
    b: W.DenseMatrix          # beta rows, V-head order
    a: W.DenseMatrix          # alpha rows, V-head order
    proj: "W.DenseMatrix | None"   # rows qkv | z | b | a as one matrix (the four are views of it), or None
    conv: Tensor              # [C, K]
    dt_bias: Tensor
    ssm_a: Tensor
    norm: Tensor
    out: W.DenseMatrix


class Net(qwen3moe.Net):
    Args = ModelArgs
    supports_prefill = True
    positional_state = False    # GDN state: a sequence can only be extended
    engine_mtp = True           # the MTP head runs as the engine's own step (mtp_step, runtime.mtp.StepDrafter)
    # GDN variants: the output gate's activation, and which K head a V head
    # reads (grouped: j // (Hv / Hk); tiled: j mod Hk)
    gdn_sigmoid = False       # output gate silu(z) (sigmoid(z): qwen4exp)
    gdn_tiled = False

    def load_layer(self, il: int) -> qwen3moe.Layer:
        p, a = f"blk.{il}.", self.args
        mixer = self.load_gdn(il) if a.recurrent[il] else self.load_attention(il, gated=True)
        return qwen3moe.Layer(self.vec(p + "attn_norm.weight", a.n_embd), mixer,
                              self.vec(p + "post_attention_norm.weight", a.n_embd), self.load_moe(il, shared=True))

    def load_gdn(self, il: int) -> GDN:
        p, a, g = f"blk.{il}.", self.args, self.gguf
        dk, nk, nv = a.d_state, a.n_k_heads, a.n_v_heads
        key_dim, value_dim, r = dk * nk, dk * nv, nv // nk
        if p + "attn_qkv.weight" in g.tensors:
            qkv = self.dense(p + "attn_qkv.weight", a.conv_dim, a.n_embd)
            z = self.dense(p + "attn_gate.weight", value_dim, a.n_embd)
        elif p + "ssm_in.weight" in g.tensors:
            # legacy layout: per K head [q (dk), k (dk), v (r dk), z (r dk)]
            per = np.arange(2 * key_dim + 2 * value_dim).reshape(nk, 2 * dk + 2 * r * dk)
            rows = np.concatenate([per[:, :dk].reshape(-1), per[:, dk:2 * dk].reshape(-1),
                                   per[:, 2 * dk:2 * dk + r * dk].reshape(-1)])
            qkv = self.dense(p + "ssm_in.weight", a.conv_dim, a.n_embd, rows=rows)
            z = self.dense(p + "ssm_in.weight", value_dim, a.n_embd, rows=per[:, 2 * dk + r * dk:].reshape(-1))
        else:
            raise FleError(f"{g.paths[0]}: GDN layer {il} has neither attn_qkv.weight nor ssm_in.weight")
        if p + "ssm_ba.weight" in g.tensors:
            # per K head [beta (r), alpha (r)] -> all betas, then all alphas, in V-head order
            ba = np.arange(2 * nv).reshape(nk, 2 * r)
            beta = self.dense(p + "ssm_ba.weight", nv, a.n_embd, rows=ba[:, :r].reshape(-1))
            alpha = self.dense(p + "ssm_ba.weight", nv, a.n_embd, rows=ba[:, r:].reshape(-1))
        else:   # separate projections (qwen4exp)
            beta = self.dense(p + "ssm_beta.weight", nv, a.n_embd)
            alpha = self.dense(p + "ssm_alpha.weight", nv, a.n_embd)
        conv = self.vec(p + "ssm_conv1d.weight", a.conv_dim * a.conv_kernel).view(a.conv_dim, a.conv_kernel)
        proj = W.concat([qkv, z, beta, alpha], p + "ssm_proj")
        if proj is not None:    # the four as row views of one product
            off = 0
            views = []
            for mat in (qkv, z, beta, alpha):
                views.append(W.DenseMatrix(mat.name, mat.qtype, proj.data[off:off + mat.n_out], mat.n_out, mat.n_in))
                off += mat.n_out
            qkv, z, beta, alpha = views
        return GDN(qkv=qkv, z=z, b=beta, a=alpha, proj=proj, conv=conv.contiguous(), dt_bias=self.vec(p + "ssm_dt.bias", nv), ssm_a=self.vec(p + "ssm_a", nv),
                   norm=self.vec(p + "ssm_norm.weight", dk),
                   out=self.dense(p + "ssm_out.weight", a.n_embd, value_dim))

    def new_caches(self, ctx: int, k_dtype, v_dtype, n_seq: int = 1) -> list:
        a, dev = self.args, self.device
        lead = (n_seq,) if n_seq > 1 else ()
        out = []
        for rec in a.recurrent[:a.n_layer]:
            if rec:
                out.append((torch.zeros(*lead, a.conv_kernel - 1, a.conv_dim, dtype=torch.float32, device=dev),
                            torch.zeros(*lead, a.n_v_heads, a.d_state, a.d_state, dtype=torch.float32, device=dev)))
            else:
                out.append((self.kv_cache(ctx, k_dtype, n_seq), self.kv_cache(ctx, v_dtype, n_seq)))
        return out

    def reset(self, state) -> None:
        """A new sequence: the recurrent states start from zero."""
        for rec, c in zip(self.args.recurrent, state.kv):
            if rec:
                c[0].zero_()
                c[1].zero_()

    def alloc(self, state) -> None:
        super().alloc(state)
        a, b = self.args, state.bufs
        f32 = dict(dtype=torch.float32, device=self.device)
        c, nz, nv = a.conv_dim, a.n_v_heads * a.d_state, a.n_v_heads
        b.gproj = torch.zeros(1, c + nz + 2 * nv, **f32)          # qkv | z | beta | alpha
        b.gqkv, b.gz = b.gproj[:, :c], b.gproj[:, c:c + nz]
        b.gb, b.ga = b.gproj[:, c + nz:c + nz + nv], b.gproj[:, c + nz + nv:]
        b.gconv = torch.zeros(1, c, **f32)
        b.go = torch.zeros(1, nz, **f32)

    def gdn(self, m: GDN, il: int, state, ops) -> None:
        """b.xn -> b.attn_out for one token of a GDN layer: the projections
        (one product when q|k|v, z, beta and alpha share a type), then the
        conv, delta rule, norm and gate in one op (``gdn_step``)."""
        a, b = self.args, state.bufs
        impl = self.impl(state)
        self.gdn_project(m, b.xn, b.gproj, impl)
        conv_state, ssm = state.kv[il]
        ops.gdn_step(b.gqkv.view(-1), b.gz.view(-1), b.gb.view(-1), b.ga.view(-1), conv_state, m.conv, m.dt_bias,
                     m.ssm_a, ssm, m.norm, a.eps, a.n_k_heads, self.gdn_tiled, self.gdn_sigmoid, b.gconv.view(-1),
                     b.go.view(-1))
        m.out.matvec(b.go, b.attn_out.view(1, -1), impl)

    @staticmethod
    def gdn_project(m: GDN, xn: Tensor, proj: Tensor, impl: str) -> None:
        """The rows ``xn`` [T, D] -> ``proj`` [T, qkv | z | beta | alpha]: one
        product when the four share a type, else four."""
        if m.proj is not None:
            m.proj.matvec(xn, proj, impl)
        else:
            off = 0
            for mat in (m.qkv, m.z, m.b, m.a):
                mat.matvec(xn, proj[:, off:off + mat.n_out], impl)
                off += mat.n_out

    def mix(self, L: qwen3moe.Layer, il: int, state, ops) -> None:
        if isinstance(L.mixer, GDN):
            self.gdn(L.mixer, il, state, ops)
        else:
            self.attention(L.mixer, il, state, ops)

    # the verify step: T tokens in one pass, the GDN state snapshotted after each ---------------
    def alloc_multi(self, state, t_max: int, snapshots: bool = True) -> None:
        """:meth:`qwen3moe.Net.alloc_multi`, plus the GDN projections of T
        tokens and, per GDN layer, the conv and delta-rule states after each
        of the first T - 1 tokens (what a rewind restores); without
        ``snapshots`` (a batched step of several sequences) instead the
        states of the T rows' lanes, gathered for the step."""
        super().alloc_multi(state, t_max, snapshots)
        a, m = self.args, state.multi
        f32 = dict(dtype=torch.float32, device=self.device)
        c, nz, nv = a.conv_dim, a.n_v_heads * a.d_state, a.n_v_heads
        m.gproj = torch.zeros(t_max, c + nz + 2 * nv, **f32)
        m.gconv = torch.zeros(t_max, c, **f32)
        m.go = torch.zeros(t_max, nz, **f32)
        conv_shape = (a.conv_kernel - 1, a.conv_dim)
        ssm_shape = (a.n_v_heads, a.d_state, a.d_state)
        m.snaps = {}
        if snapshots:
            m.snaps = {il: (torch.zeros(t_max - 1, *conv_shape, **f32), torch.zeros(t_max - 1, *ssm_shape, **f32))
                       for il, rec in enumerate(a.recurrent[:a.n_layer]) if rec}
        else:
            m.row_conv = torch.zeros(t_max, *conv_shape, **f32)
            m.row_ssm = torch.zeros(t_max, *ssm_shape, **f32)

    def mix_multi(self, L: qwen3moe.Layer, il: int, state, ops, n: int) -> None:
        if isinstance(L.mixer, GDN):
            self.gdn_multi(L.mixer, il, state, ops, n)
        else:
            self.attention_multi(L.mixer, il, state, ops, n)

    def gdn_multi(self, g: GDN, il: int, state, ops, n: int) -> None:
        """T tokens of a GDN layer: the projections of all of them at once,
        then the decode step's op (``gdn_step``) token by token, the states
        after each of the first T - 1 copied into the layer's snapshots. In a
        batched step of several sequences (``state.rows``) row t runs on its
        own lane's states instead (gathered from the lane-stacked states
        before, written back after; no snapshots)."""
        a, m = self.args, state.multi
        impl = self.impl(state)
        c, nz, nv = a.conv_dim, a.n_v_heads * a.d_state, a.n_v_heads
        self.gdn_project(g, m.xn[:n], m.gproj[:n], impl)
        conv_state, ssm = state.kv[il]
        lanes = self.rows_at(state, n)[1]
        if lanes is not None:
            torch.index_select(conv_state, 0, lanes, out=m.row_conv[:n])
            torch.index_select(ssm, 0, lanes, out=m.row_ssm[:n])
        else:
            snap_conv, snap_ssm = m.snaps[il]
        for t in range(n):
            row = m.gproj[t]
            cs, ss = (conv_state, ssm) if lanes is None else (m.row_conv[t], m.row_ssm[t])
            ops.gdn_step(row[:c], row[c:c + nz], row[c + nz:c + nz + nv], row[c + nz + nv:], cs, g.conv,
                         g.dt_bias, g.ssm_a, ss, g.norm, a.eps, a.n_k_heads, self.gdn_tiled, self.gdn_sigmoid,
                         m.gconv[t], m.go[t])
            if lanes is None and t < n - 1:
                snap_conv[t].copy_(conv_state)
                snap_ssm[t].copy_(ssm)
        if lanes is not None:
            conv_state.index_copy_(0, lanes, m.row_conv[:n])
            ssm.index_copy_(0, lanes, m.row_ssm[:n])
        g.out.matvec(m.go[:n], m.attn_out[:n].view(n, -1), impl)

    def restore_multi(self, state, t: int) -> None:
        """Every GDN layer's state as it was after token ``t`` (< T - 1) of
        the last verify step."""
        for il, (snap_conv, snap_ssm) in state.multi.snaps.items():
            conv_state, ssm = state.kv[il]
            conv_state.copy_(snap_conv[t])
            ssm.copy_(snap_ssm[t])

    def recurrent_backup(self, state) -> list:
        return [(il, c[0].clone(), c[1].clone()) for il, (rec, c) in enumerate(zip(self.args.recurrent, state.kv))
                if rec]

    def recurrent_restore(self, state, backup: list) -> None:
        for il, conv, ssm in backup:
            state.kv[il][0].copy_(conv)
            state.kv[il][1].copy_(ssm)

    def held_layer(self, il: int, c, n: int) -> list:
        """A GDN layer's conv history and delta-rule state whole (they do not
        grow with the sequence); an attention layer's rows up to ``n``."""
        if self.args.recurrent[il]:
            return [c[0], c[1]]
        return super().held_layer(il, c, n)

    # the MTP head on the engine (runtime.mtp.StepDrafter) ---------------------------------
    def load_mtp_block(self, gguf) -> SimpleNamespace:
        """Block N of ``gguf`` (the model file holding the MTP head, or a
        head file; checked by the caller) in the engine's form, as
        :mod:`fle_engine.models.qwen3next_mtp` reads it: the block as a
        trunk attention layer (gated attention, routed experts with the
        gated shared expert; the experts' file views in ``sources``, for a
        store to copy before the file closes), ``eh_proj`` [2 D -> D],
        ``enorm``, ``hnorm``, the head's norm and its tables (its own
        ``nextn.*`` when the file has them, else the trunk's)."""
        a = self.args
        il, d = a.n_layer, a.n_embd
        p = f"blk.{il}."
        with self.reading(gguf):
            layer = qwen3moe.Layer(self.vec(p + "attn_norm.weight", d), self.load_attention(il, gated=True),
                                   self.vec(p + "post_attention_norm.weight", d), self.load_moe(il, shared=True))
            sources = self.expert_sources.pop(il)
            have = gguf.tensors
            own = lambda name: p + name in have          # noqa: E731
            blk = SimpleNamespace(
                layer=layer, sources=sources,
                eh_proj=self.dense(p + "nextn.eh_proj.weight", d, 2 * d),
                enorm=self.vec(p + "nextn.enorm.weight", d), hnorm=self.vec(p + "nextn.hnorm.weight", d),
                norm=self.vec(p + "nextn.shared_head_norm.weight", d) if own("nextn.shared_head_norm.weight")
                else self.output_norm,
                embed=self.dense(p + "nextn.embed_tokens.weight", a.n_vocab, d) if own("nextn.embed_tokens.weight")
                else self.tok_embd,
                output=self.dense(p + "nextn.shared_head_head.weight", a.n_vocab, d)
                if own("nextn.shared_head_head.weight") else self.output)
        return blk

    def alloc_mtp(self, hs, t_max: int) -> None:
        """The buffers of :meth:`mtp_step` for up to ``t_max`` rows on the
        head's own state ``hs`` (its ``multi``, no GDN snapshots: the head
        has none), ``hs.hid`` [t_max, D], the trunk rows it reads, and
        ``hs.head_hidden``, where a call leaves the head's own hidden rows
        (what a further drafting step reads in their place: here the
        post-norm rows ``multi.xn``)."""
        self.alloc_multi(hs, t_max, snapshots=False)
        f32 = dict(dtype=torch.float32, device=self.device)
        d = self.args.n_embd
        hs.hid = torch.zeros(t_max, d, **f32)
        hs.en = torch.zeros(t_max, d, **f32)
        hs.hn = torch.zeros(t_max, d, **f32)
        hs.eh = torch.zeros(t_max, 2 * d, **f32)
        hs.picks = torch.zeros(t_max, dtype=torch.int64, device=self.device)
        hs.head_hidden = hs.multi.xn

    def mtp_step(self, blk: SimpleNamespace, hs, ops, store, n: int, output: W.DenseMatrix, logits: Tensor,
                 vocab_ids: "Tensor | None" = None) -> None:
        """n rows of the MTP head at positions ``hs.pos`` .. ``hs.pos`` + n - 1,
        row t the pair (the trunk's post-norm hidden row ``hs.hid[t]``, the
        token ``hs.toks[t]`` that followed it): x = eh_proj [RMS(embed) *
        enorm ; RMS(hidden) * hnorm], the block as a trunk attention layer
        (its K/V written at those positions of ``hs.kv[0]``, its experts
        read from ``store``'s layer 0), RMS with the head's norm -> the
        head's hidden rows in ``hs.multi.xn[:n]`` (what a further drafting
        step reads), ``output``'s logits in ``logits[:n]`` and each row's
        draft in ``hs.next_toks[:n]`` (``vocab_ids[argmax]`` when ``output``
        is cut to a draft vocabulary); the position advances by n. Static
        shapes, no host synchronisation: one CUDA graph per n."""
        a, m = self.args, hs.multi
        impl = self.impl(hs)
        x, xn = m.x[:n], m.xn[:n]
        L = blk.layer
        self.embed_multi(hs, ops, n, blk.embed)
        ops.add_rmsnorm(x, None, blk.enorm, a.eps, hs.en[:n])
        ops.add_rmsnorm(hs.hid[:n], None, blk.hnorm, a.eps, hs.hn[:n])
        torch.cat([hs.en[:n], hs.hn[:n]], 1, out=hs.eh[:n])
        blk.eh_proj.matvec(hs.eh[:n], x, impl)
        ops.add_rmsnorm(x, None, L.attn_norm, a.eps, xn)
        self.attention_multi(L.mixer, 0, hs, ops, n)
        ops.add_rmsnorm(x, m.attn_out[:n], L.ffn_norm, a.eps, xn)
        self.moe_multi(L.moe, 0, hs, ops, store, n)
        ops.add_rmsnorm(x, self.multi_parts(L.moe, hs, n), blk.norm, a.eps, xn)
        output.matvec(xn, logits[:n], impl)
        self.mtp_pick(hs, n, logits, vocab_ids)
        self.advance(hs, n)

    @staticmethod
    def mtp_pick(hs, n: int, logits: Tensor, vocab_ids: "Tensor | None") -> None:
        """Each row's draft -> ``hs.next_toks[:n]``: the argmax of ``logits[:n]``,
        through ``vocab_ids`` when the output is cut to a draft vocabulary."""
        if vocab_ids is None:
            torch.argmax(logits[:n], dim=-1, out=hs.next_toks[:n])
        else:
            torch.argmax(logits[:n], dim=-1, out=hs.picks[:n])
            torch.index_select(vocab_ids, 0, hs.picks[:n], out=hs.next_toks[:n])

    # prefill (runtime.prefill) ----------------------------------------------------------
    def prefill_mixer(self, L: qwen3moe.Layer, il: int, xn: Tensor, out: Tensor, pos0: int, state, ops) -> None:
        if isinstance(L.mixer, GDN):
            self.prefill_gdn(L.mixer, il, xn, out, state, ops)
        else:
            self.prefill_attention(L.mixer, il, xn, out, pos0, state, ops)

    def prefill_gdn(self, m: GDN, il: int, xn: Tensor, out: Tensor, state, ops) -> None:
        """T tokens of a GDN layer: the projections for all of them at once,
        then the conv and the recurrence over the tokens in two launches
        (``gdn_tokens``: the decode step's arithmetic per token, the state
        advancing as T decode steps advance it), then the output projection
        for all."""
        from .prefill import dense_rows

        a, dt = self.args, state.prefill_dtype
        T = xn.shape[0]
        c, nz, nv = a.conv_dim, a.n_v_heads * a.d_state, a.n_v_heads
        proj = torch.empty(T, c + nz + 2 * nv, dtype=torch.float32, device=xn.device)
        if m.proj is not None:
            dense_rows(m.proj, xn, proj, ops, dt)
        else:
            off = 0
            for mat in (m.qkv, m.z, m.b, m.a):
                dense_rows(mat, xn, proj[:, off:off + mat.n_out], ops, dt)
                off += mat.n_out
        conv_state, ssm = state.kv[il]
        go = torch.empty(T, nz, dtype=torch.float32, device=xn.device)
        conv_out = torch.empty(T, c, dtype=torch.float32, device=xn.device)
        ops.gdn_tokens(proj[:, :c], proj[:, c:c + nz], proj[:, c + nz:c + nz + nv], proj[:, c + nz + nv:], conv_state,
                       m.conv, m.dt_bias, m.ssm_a, ssm, m.norm, a.eps, a.n_k_heads, self.gdn_tiled, self.gdn_sigmoid,
                       conv_out, go)
        dense_rows(m.out, go, out, ops, dt)
