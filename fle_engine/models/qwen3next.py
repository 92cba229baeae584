"""qwen3next (Qwen3-Next-80B-A3B): gated delta net (GDN) layers with a gated
full-attention layer every ``full_attention_interval``-th layer, RMSNorm
before the mixer and after the first residual (``post_attention_norm``),
and in every layer a routed MoE plus a shared expert behind a one-scalar
sigmoid gate.

Semantics from llama.cpp's ``src/models/qwen3next.cpp`` and
``src/models/delta-net-base.cpp``:

- GDN input: fused ``attn_qkv`` (q | k | v) and ``attn_gate`` (z), or the
  legacy ``ssm_in`` laid out per K head as [q, k, v (r heads), z (r heads)]
  with r = V heads / K heads; ``ssm_ba`` per K head as [beta (r), alpha (r)].
- beta = sigmoid(b); g = softplus(alpha + dt_bias) * ssm_a, where the
  converter stores ssm_a = -exp(A_log).
- depthwise causal conv (``ssm_conv1d`` ggml [K, C], tap K-1 on the current
  token) then silu; q, k L2-normalised with eps = the RMS eps; V head j
  reads K head j // r (grouped, not tiled).
- output RMSNorm(o) * ssm_norm * silu(z), then ``ssm_out``.
- attention: ``attn_q`` gives per head Dh query then Dh gate values; q/k
  RMSNorm; NEOX rotary on the first ``rope.dimension_count`` dims; output
  times sigmoid(gate) before ``attn_output``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fle_quant.errors import FleError

from .. import layers as L
from ..loader import Weights
from . import qwen3moe
from .qwen3moe import common_hparams, load_moe, load_qkv, new_state, param

ARCH = "qwen3next"


@dataclass(frozen=True)
class ModelArgs(qwen3moe.ModelArgs):
    attn_scale: float
    n_ff_shexp: int
    conv_kernel: int
    d_state: int       # GDN head width (keys and values)
    n_k_heads: int
    n_v_heads: int
    recurrent: tuple[bool, ...]

    @property
    def conv_dim(self) -> int:
        return 2 * self.d_state * self.n_k_heads + self.d_state * self.n_v_heads

    @classmethod
    def from_weights(cls, w: Weights) -> "ModelArgs":
        c = common_hparams(w, ARCH)
        # a file carrying the MTP block counts it in block_count; the trunk stops before it
        n_layer = int(w.hp("block_count")) - int(w.hp("nextn_predict_layers", 0))
        interval = int(w.hp("full_attention_interval", 4))
        recurrent = w.hp("attention.recurrent_layers", None)
        if recurrent is None:
            recurrent = [(il + 1) % interval != 0 for il in range(n_layer)]
        head_dim = c["head_dim"]
        n_rot = int(w.hp("rope.dimension_count", head_dim))
        if n_rot % 2 or n_rot > head_dim:
            raise FleError(f"{w.path}: rope.dimension_count = {n_rot} must be even and at most {head_dim}")
        return cls(arch=ARCH, n_layer=n_layer, n_rot=n_rot, recurrent=tuple(bool(r) for r in recurrent[:n_layer]),
                   **c, **hybrid_hparams(w, head_dim, c["n_ff_exp"]))


def hybrid_hparams(w: Weights, head_dim: int, n_ff_exp: int) -> dict:
    """The attention scale, shared-expert width and gated-delta-net shape
    that qwen3next and qwen4exp read alike."""
    d_state = int(w.hp("ssm.state_size"))
    n_v = int(w.hp("ssm.time_step_rank"))
    n_k = int(w.hp("ssm.group_count"))
    if int(w.hp("ssm.inner_size")) != d_state * n_v:
        raise FleError(f"{w.path}: ssm.inner_size must be ssm.state_size * ssm.time_step_rank")
    if n_v % n_k:
        raise FleError(f"{w.path}: ssm.time_step_rank ({n_v} V heads) must be a multiple of "
                       f"ssm.group_count ({n_k} K heads)")
    scale = float(w.hp("attention.scale", 0.0))
    return dict(attn_scale=scale if scale != 0.0 else head_dim ** -0.5,
                n_ff_shexp=int(w.hp("expert_shared_feed_forward_length", 0)) or n_ff_exp,
                conv_kernel=int(w.hp("ssm.conv_kernel")), d_state=d_state, n_k_heads=n_k, n_v_heads=n_v)


class GatedAttention(nn.Module):
    def __init__(self, w: Weights, il: int, a: ModelArgs):
        super().__init__()
        p = f"blk.{il}."
        hd = a.head_dim
        wq, wk, wv = load_qkv(w, p, 2 * a.n_head * hd, a.n_head_kv * hd, a.n_embd)
        self.wq, self.wk, self.wv = param(wq), param(wk), param(wv)
        self.wo = param(w.get(p + "attn_output.weight", (a.n_embd, a.n_head * hd)))
        self.q_norm = param(w.get(p + "attn_q_norm.weight", (hd,)))
        self.k_norm = param(w.get(p + "attn_k_norm.weight", (hd,)))
        self.a = a

    def forward(self, x: Tensor, cache: L.AttnCache, positions: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        a = self.a
        n_tok, hd = x.shape[0], a.head_dim
        qg = F.linear(x, self.wq).view(n_tok, a.n_head, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:]
        k = F.linear(x, self.wk).view(n_tok, a.n_head_kv, hd)
        v = F.linear(x, self.wv).view(n_tok, a.n_head_kv, hd)
        q = L.apply_rope_neox(L.rms_norm(q, self.q_norm, a.eps), cos, sin)
        k = L.apply_rope_neox(L.rms_norm(k, self.k_norm, a.eps), cos, sin)
        out = L.attention(q, k, v, cache, positions, a.attn_scale)
        out = out * torch.sigmoid(gate.reshape(n_tok, a.n_head * hd))
        return F.linear(out, self.wo)

    def forward_batch(self, x: Tensor, sizes: list[int], caches: list, rots: list) -> Tensor:
        """Several sequences: projections and rotary on all tokens, attention by
        :func:`~fle_engine.layers.attention_batch`."""
        a = self.a
        n_tok, hd = x.shape[0], a.head_dim
        cos, sin = L.rot_cat(rots, 1), L.rot_cat(rots, 2)
        qg = F.linear(x, self.wq).view(n_tok, a.n_head, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:]
        k = F.linear(x, self.wk).view(n_tok, a.n_head_kv, hd)
        v = F.linear(x, self.wv).view(n_tok, a.n_head_kv, hd)
        q = L.apply_rope_neox(L.rms_norm(q, self.q_norm, a.eps), cos, sin)
        k = L.apply_rope_neox(L.rms_norm(k, self.k_norm, a.eps), cos, sin)
        out = L.attention_batch(q, k, v, caches, rots, sizes, a.attn_scale)
        out = out * torch.sigmoid(gate.reshape(n_tok, a.n_head * hd))
        return F.linear(out, self.wo)


class GatedDeltaNet(nn.Module):
    """One GDN mixer. Chunked delta rule when a call brings more than one
    token, the recurrent form for a single token (decode)."""

    def __init__(self, w: Weights, il: int, a: ModelArgs):
        super().__init__()
        p = f"blk.{il}."
        dk, nk, nv = a.d_state, a.n_k_heads, a.n_v_heads
        key_dim, value_dim, r = dk * nk, dk * nv, nv // nk
        if w.has(p + "attn_qkv.weight"):
            wqkv = w.get(p + "attn_qkv.weight", (a.conv_dim, a.n_embd))
            wz = w.get(p + "attn_gate.weight", (value_dim, a.n_embd))
        elif w.has(p + "ssm_in.weight"):
            # legacy layout: per K head [q (dk), k (dk), v (r dk), z (r dk)]
            fused = w.get(p + "ssm_in.weight", (2 * key_dim + 2 * value_dim, a.n_embd))
            per = fused.view(nk, 2 * dk + 2 * r * dk, a.n_embd)
            q, k = per[:, :dk], per[:, dk:2 * dk]
            v, z = per[:, 2 * dk:2 * dk + r * dk], per[:, 2 * dk + r * dk:]
            wqkv = torch.cat([q.reshape(key_dim, -1), k.reshape(key_dim, -1), v.reshape(value_dim, -1)], 0)
            wz = z.reshape(value_dim, -1).contiguous()
            del fused, per
        else:
            raise FleError(f"{w.path}: GDN layer {il} has neither attn_qkv.weight nor ssm_in.weight")
        self.wqkv, self.wz = param(wqkv), param(wz)
        # per K head [beta (r), alpha (r)] -> all betas, then all alphas, in V-head order
        ba = w.get(p + "ssm_ba.weight", (2 * nv, a.n_embd)).view(nk, 2 * r, a.n_embd)
        self.wb = param(ba[:, :r].reshape(nv, a.n_embd).contiguous())
        self.wa = param(ba[:, r:].reshape(nv, a.n_embd).contiguous())
        self.conv = param(w.get(p + "ssm_conv1d.weight", (a.conv_dim, a.conv_kernel)))
        self.dt_bias = param(w.get(p + "ssm_dt.bias", (nv,)))
        self.ssm_a = param(w.get(p + "ssm_a", (nv,)))
        self.norm = param(w.get(p + "ssm_norm.weight", (dk,)))
        self.wout = param(w.get(p + "ssm_out.weight", (a.n_embd, value_dim)))
        self.a = a

    def forward(self, x: Tensor, state: L.GDNState) -> Tensor:
        return self.forward_batch(x, [x.shape[0]], [state])

    def _delta(self, qkv: Tensor, beta: Tensor, g: Tensor, state: L.GDNState) -> Tensor:
        """One sequence's conv and delta rule from its carried state (updated
        in place) -> the heads' outputs [T, Hv, Dv] before the norm."""
        a = self.a
        n, dk, nk, nv = qkv.shape[0], a.d_state, a.n_k_heads, a.n_v_heads
        conv, new_conv = L.causal_conv1d(qkv, state.conv, self.conv)
        state.conv.copy_(new_conv)
        conv = F.silu(conv)
        q = conv[:, :dk * nk].view(n, nk, dk)
        k = conv[:, dk * nk:2 * dk * nk].view(n, nk, dk)
        v = conv[:, 2 * dk * nk:].view(n, nv, dk)
        # V head j reads K head j // r (expand, not repeat_interleave, which may sync on CUDA)
        q = L.l2_norm(q, a.eps)[:, :, None].expand(n, nk, nv // nk, dk).reshape(n, nv, dk)
        k = L.l2_norm(k, a.eps)[:, :, None].expand(n, nk, nv // nk, dk).reshape(n, nv, dk)
        rule = L.gdn_recurrent if n == 1 else L.gdn_chunked
        o, s = rule(q, k, v, g, beta, state.ssm)
        state.ssm.copy_(s)
        return o

    def _delta_step(self, qkv: Tensor, beta: Tensor, g: Tensor, pool: L.GDNState) -> Tensor:
        """:meth:`_delta` of S sequences' one new token each (``qkv`` [S, C],
        ``beta``, ``g`` [S, Hv]) whose states are the rows of ``pool``
        (``conv`` [S, K-1, C], ``ssm`` [S, Hv, Dv, Dk], updated in place):
        the same conv and rule on all of them at once
        (:func:`~fle_engine.layers.conv_step_rows`,
        :func:`~fle_engine.layers.gdn_step_rows`). Returns [S, Hv, Dv]."""
        a = self.a
        n, dk, nk, nv = qkv.shape[0], a.d_state, a.n_k_heads, a.n_v_heads
        conv = F.silu(L.conv_step_rows(qkv, pool.conv, self.conv))
        q = conv[:, :dk * nk].view(n, nk, dk)
        k = conv[:, dk * nk:2 * dk * nk].view(n, nk, dk)
        v = conv[:, 2 * dk * nk:].view(n, nv, dk)
        q = L.l2_norm(q, a.eps)[:, :, None].expand(n, nk, nv // nk, dk).reshape(n, nv, dk)
        k = L.l2_norm(k, a.eps)[:, :, None].expand(n, nk, nv // nk, dk).reshape(n, nv, dk)
        return L.gdn_step_rows(q, k, v, g, beta, pool.ssm)

    def forward_batch(self, x: Tensor, sizes: list[int], states: list) -> Tensor:
        """Several sequences: the projections, norm and output on all tokens
        at once, the conv and the delta rule per sequence (its carried
        state), or, for one new token each with states that are rows of one
        pool (:func:`~fle_engine.layers.stacked`), for all at once."""
        a = self.a
        n_tok, dk, nv = x.shape[0], a.d_state, a.n_v_heads
        qkv_all = F.linear(x, self.wqkv)
        z = F.linear(x, self.wz).view(n_tok, nv, dk)
        beta_all = torch.sigmoid(F.linear(x, self.wb))                  # [T, Hv]
        g_all = F.softplus(F.linear(x, self.wa) + self.dt_bias) * self.ssm_a
        pooled = L.stacked_fields(states, ("conv", "ssm")) if L.one_token_each(sizes) else None
        if pooled is not None:
            o = self._delta_step(qkv_all, beta_all, g_all, L.GDNState(*pooled)).to(x.dtype)
        else:
            outs = [self._delta(qkv, beta, g, state).to(x.dtype) for qkv, beta, g, state in
                    zip(qkv_all.split(sizes), beta_all.split(sizes), g_all.split(sizes), states)]
            o = outs[0] if len(outs) == 1 else torch.cat(outs)
        o = L.rms_norm(o, self.norm, a.eps) * F.silu(z)
        return F.linear(o.reshape(n_tok, nv * dk), self.wout)


class Block(nn.Module):
    def __init__(self, w: Weights, il: int, a: ModelArgs):
        super().__init__()
        p = f"blk.{il}."
        self.recurrent = a.recurrent[il]
        self.attn_norm = param(w.get(p + "attn_norm.weight", (a.n_embd,)))
        self.post_norm = param(w.get(p + "post_attention_norm.weight", (a.n_embd,)))
        self.mixer = GatedDeltaNet(w, il, a) if self.recurrent else GatedAttention(w, il, a)
        self.moe = load_moe(w, il, a.n_embd, a.n_expert, a.n_expert_used, a.n_ff_exp, a.expert_weights_scale,
                            shared=w.has(p + "ffn_up_shexp.weight"), n_ff_shexp=a.n_ff_shexp)
        self.eps = a.eps

    def forward(self, x: Tensor, cache, positions: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = L.rms_norm(x, self.attn_norm, self.eps)
        if self.recurrent:
            x = x + self.mixer(h, cache)
        else:
            x = x + self.mixer(h, cache, positions, cos, sin)
        return x + self.moe(L.rms_norm(x, self.post_norm, self.eps))

    def forward_batch(self, x: Tensor, sizes: list[int], caches: list, rots: list) -> Tensor:
        """See :meth:`.qwen3moe.Block.forward_batch`: the mixer per sequence."""
        h = L.rms_norm(x, self.attn_norm, self.eps)
        if self.recurrent:
            x = x + self.mixer.forward_batch(h, sizes, caches)
        else:
            x = x + self.mixer.forward_batch(h, sizes, caches, rots)
        return x + self.moe.forward_batch(L.rms_norm(x, self.post_norm, self.eps))


class Transformer(qwen3moe.Transformer):
    Args = ModelArgs
    Block = Block

    def __init__(self, w: Weights, a: ModelArgs):
        super().__init__(w, a)
        if int(w.hp("nextn_predict_layers", 0)) and w.has(f"blk.{a.n_layer}.nextn.eh_proj.weight"):
            from .qwen3next_mtp import MTPHead   # the head in the trunk file (block_count = N + 1)

            self.mtp = MTPHead(w, a, self)

    def load_mtp(self, path):
        """Attach the MTP head of ``path``; see :func:`.qwen3next_mtp.load_mtp`."""
        from .qwen3next_mtp import load_mtp

        return load_mtp(self, path)

    def draft(self, state: L.State) -> tuple[Tensor, Tensor]:
        """(draft token [1], logits [V]); see :func:`fle_engine.mtp.draft`."""
        from ..mtp import draft

        return draft(self, state)

    def new_state(self, max_tokens: int) -> L.State:
        a, dev, dt = self.args, self.device, self.tok_embd.dtype
        caches = []
        for rec in a.recurrent:
            if rec:
                caches.append(L.GDNState(
                    torch.zeros(a.conv_kernel - 1, a.conv_dim, dtype=dt, device=dev),
                    torch.zeros(a.n_v_heads, a.d_state, a.d_state, dtype=torch.float32, device=dev)))
            else:
                caches.append(L.AttnCache(torch.zeros(a.n_head_kv, max_tokens, a.head_dim, dtype=dt, device=dev),
                                          torch.zeros(a.n_head_kv, max_tokens, a.head_dim, dtype=dt, device=dev)))
        return self.attach_mtp(new_state(max_tokens, caches, a.n_rot, a.rope_base, a.rope_freq_scale, dev))

