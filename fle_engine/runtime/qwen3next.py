"""qwen3next on the engine: the qwen3moe step's attention (gated: the
query rows of ``attn_q`` reordered into a q block and a gate block, the
output times sigmoid(gate)), routed experts plus the gated shared expert,
and gated delta net layers.

A GDN layer's projections are products of the quantized kernels on the
GGUF bytes (``ssm_ba`` and a legacy ``ssm_in`` are split by moving whole
rows); the short convolution and the recurrent delta rule for one token
are the reference pass's own static-shape torch blocks
(:func:`fle_engine.layers.causal_conv1d`, :func:`~fle_engine.layers.gdn_recurrent`),
run on state tensors the step owns, so they replay inside the graph.
Semantics as :mod:`fle_engine.models.qwen3next`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fle_quant.errors import FleError

from .. import layers as Lr
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
    conv: Tensor              # [C, K]
    dt_bias: Tensor
    ssm_a: Tensor
    norm: Tensor
    out: W.DenseMatrix


class Net(qwen3moe.Net):
    Args = ModelArgs
    # GDN variants: the output gate's activation, and which K head a V head
    # reads (grouped: j // (Hv / Hk); tiled: j mod Hk)
    gdn_gate = staticmethod(F.silu)
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
        return GDN(qkv=qkv, z=z, b=beta, a=alpha, conv=conv.contiguous(), dt_bias=self.vec(p + "ssm_dt.bias", nv), ssm_a=self.vec(p + "ssm_a", nv),
                   norm=self.vec(p + "ssm_norm.weight", dk),
                   out=self.dense(p + "ssm_out.weight", a.n_embd, value_dim))

    def new_caches(self, ctx: int, k_dtype, v_dtype) -> list:
        a, dev = self.args, self.device
        out = []
        for rec in a.recurrent[:a.n_layer]:
            if rec:
                out.append((torch.zeros(a.conv_kernel - 1, a.conv_dim, dtype=torch.float32, device=dev),
                            torch.zeros(a.n_v_heads, a.d_state, a.d_state, dtype=torch.float32, device=dev)))
            else:
                out.append((torch.zeros(a.n_head_kv, ctx, a.head_dim, dtype=k_dtype, device=dev),
                            torch.zeros(a.n_head_kv, ctx, a.head_dim, dtype=v_dtype, device=dev)))
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
        b.gqkv = torch.zeros(1, a.conv_dim, **f32)
        b.gz = torch.zeros(1, a.n_v_heads * a.d_state, **f32)
        b.gb = torch.zeros(1, a.n_v_heads, **f32)
        b.ga = torch.zeros(1, a.n_v_heads, **f32)
        b.go = torch.zeros(1, a.n_v_heads * a.d_state, **f32)

    def gdn(self, m: GDN, il: int, state) -> None:
        """b.xn -> b.attn_out for one token of a GDN layer."""
        a, b = self.args, state.bufs
        impl = self.impl(state)
        dk, nk, nv = a.d_state, a.n_k_heads, a.n_v_heads
        m.qkv.matvec(b.xn, b.gqkv, impl)
        m.z.matvec(b.xn, b.gz, impl)
        m.b.matvec(b.xn, b.gb, impl)
        m.a.matvec(b.xn, b.ga, impl)
        beta = torch.sigmoid(b.gb)
        g = F.softplus(b.ga + m.dt_bias) * m.ssm_a
        conv_state, ssm = state.kv[il]
        conv, new_conv = Lr.causal_conv1d(b.gqkv, conv_state, m.conv)
        conv_state.copy_(new_conv)
        conv = F.silu(conv)
        q = conv[:, :dk * nk].view(1, nk, dk)
        k = conv[:, dk * nk:2 * dk * nk].view(1, nk, dk)
        v = conv[:, 2 * dk * nk:].view(1, nv, dk)
        if self.gdn_tiled:
            q = Lr.l2_norm(q, a.eps).repeat(1, nv // nk, 1)
            k = Lr.l2_norm(k, a.eps).repeat(1, nv // nk, 1)
        else:
            q = Lr.l2_norm(q, a.eps)[:, :, None].expand(1, nk, nv // nk, dk).reshape(1, nv, dk)
            k = Lr.l2_norm(k, a.eps)[:, :, None].expand(1, nk, nv // nk, dk).reshape(1, nv, dk)
        o, s = Lr.gdn_recurrent(q, k, v, g, beta, ssm)
        ssm.copy_(s)
        o = Lr.rms_norm(o, m.norm, a.eps) * self.gdn_gate(b.gz.view(1, nv, dk))
        b.go.copy_(o.reshape(1, -1))
        m.out.matvec(b.go, b.attn_out.view(1, -1), impl)

    def mix(self, L: qwen3moe.Layer, il: int, state, ops) -> None:
        if isinstance(L.mixer, GDN):
            self.gdn(L.mixer, il, state)
        else:
            self.attention(L.mixer, il, state, ops)
