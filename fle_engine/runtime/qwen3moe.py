"""qwen3moe on the engine: one decode token per step, the same arithmetic as
the reference pass (:mod:`fle_engine.models.qwen3moe`) in fused kernels.

Per layer, 11 launches: RMSNorm is folded into the residual add that
precedes it; q, k and v are one product (their rows concatenated when
they share a quant type); q/k norms, rotary and the KV write are one
kernel; attention is a split pass and a reduction over the used length;
the router is one float32 product, softmax/top-K one kernel, and the
routed experts two (gate+up with SwiGLU, down with the routing weights).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.qwen3moe import ModelArgs
from . import weights as W

ARCH = "qwen3moe"


@dataclass
class Layer:
    attn_norm: Tensor
    qkv: "W.DenseMatrix | None"
    q: W.DenseMatrix
    k: W.DenseMatrix
    v: W.DenseMatrix
    wo: W.DenseMatrix
    q_norm: Tensor
    k_norm: Tensor
    ffn_norm: Tensor
    router: Tensor          # float32 [E, D]
    layout: W.ExpertLayout


class Net:
    """The engine's weights and step for one qwen3moe file."""

    Args = ModelArgs

    def __init__(self, gguf, weights_view, device: torch.device, fast: bool):
        a = self.args = ModelArgs.from_weights(weights_view)
        self.device = device
        hd = a.head_dim
        self.layers: list[Layer] = []
        self.expert_sources: dict[int, list] = {}
        for il in range(a.n_layer):
            p = f"blk.{il}."
            if p + "attn_qkv.weight" in gguf.tensors:
                qkv = W.dense(gguf, p + "attn_qkv.weight", device, (a.n_head + 2 * a.n_head_kv) * hd, a.n_embd,
                              fast_needed=fast)
                q = k = v = qkv
            else:
                q = W.dense(gguf, p + "attn_q.weight", device, a.n_head * hd, a.n_embd, fast_needed=fast)
                k = W.dense(gguf, p + "attn_k.weight", device, a.n_head_kv * hd, a.n_embd, fast_needed=fast)
                v = W.dense(gguf, p + "attn_v.weight", device, a.n_head_kv * hd, a.n_embd, fast_needed=fast)
                qkv = W.concat([q, k, v], p + "attn_qkv")
                if qkv is not None:
                    q = k = v = None
            lay, src = W.expert_layout(gguf, il, a.n_ff_exp, a.n_embd, fast_needed=fast)
            self.expert_sources[il] = src
            router = W.vector(gguf, p + "ffn_gate_inp.weight", device, a.n_expert * a.n_embd).view(a.n_expert, a.n_embd)
            self.layers.append(Layer(
                attn_norm=W.vector(gguf, p + "attn_norm.weight", device, a.n_embd),
                qkv=qkv, q=q, k=k, v=v,
                wo=W.dense(gguf, p + "attn_output.weight", device, a.n_embd, a.n_head * hd, fast_needed=fast),
                q_norm=W.vector(gguf, p + "attn_q_norm.weight", device, hd),
                k_norm=W.vector(gguf, p + "attn_k_norm.weight", device, hd),
                ffn_norm=W.vector(gguf, p + "ffn_norm.weight", device, a.n_embd),
                router=router.contiguous(), layout=lay))
        self.output_norm = W.vector(gguf, "output_norm.weight", device, a.n_embd)
        head = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
        self.output = W.dense(gguf, head, device, a.n_vocab, a.n_embd, fast_needed=fast)
        self.tok_embd = W.dense(gguf, "token_embd.weight", device, a.n_vocab, a.n_embd, fast_needed=fast)
        self.layouts = {il: self.layers[il].layout for il in range(a.n_layer)}

    @property
    def dense_bytes(self) -> int:
        n = self.output.nbytes + (self.tok_embd.nbytes if self.tok_embd is not self.output else 0)
        for L in self.layers:
            mats = [L.qkv] if L.qkv is not None else [L.q, L.k, L.v]
            n += sum(m.nbytes for m in mats) + L.wo.nbytes + L.router.numel() * 4
        return n

    # buffers -----------------------------------------------------------------------
    def alloc(self, state) -> None:
        """The step's device buffers (static addresses for graph capture)."""
        a, dev = self.args, self.device
        hd = a.head_dim
        f32 = dict(dtype=torch.float32, device=dev)
        b = state.bufs
        b.x = torch.zeros(1, a.n_embd, **f32)
        b.xn = torch.zeros(1, a.n_embd, **f32)
        b.qkv = torch.zeros(1, (a.n_head + 2 * a.n_head_kv) * hd, **f32)
        b.q = torch.zeros(a.n_head * hd, **f32)
        b.o = torch.zeros(1, a.n_head * hd, **f32)
        b.attn_out = torch.zeros(1, 1, a.n_embd, **f32)
        b.router = torch.zeros(1, a.n_expert, **f32)
        b.ids = torch.zeros(1, a.n_expert_used, dtype=torch.int64, device=dev)
        b.wts = torch.zeros(1, a.n_expert_used, **f32)
        b.h = torch.zeros(a.n_expert_used, a.n_ff_exp, **f32)
        b.y = torch.zeros(1, a.n_expert_used, a.n_embd, **f32)
        b.logits = torch.zeros(1, a.n_vocab, **f32)
        if state.fast:
            from ..kernels.triton_engine import attn_scratch

            b.partial, b.ml = attn_scratch(a.n_head_kv, a.n_head, hd, dev)
        else:
            b.partial = b.ml = None

    def step(self, state, ops, cache) -> None:
        """One decode token: reads ``state.tok`` and ``state.pos`` on the
        device, writes the logits and the next greedy token, advances pos."""
        a, b = self.args, state.bufs
        impl = "triton" if state.fast else "reference"
        hd = a.head_dim
        if self.tok_embd.qtype in W.FLOAT_TYPES:
            b.x.copy_(self.tok_embd.data[state.tok])
        else:
            ops.embed_row(self.tok_embd.data, self.tok_embd.qtype, state.tok, b.x.view(-1))
        ops.add_rmsnorm(b.x, None, self.layers[0].attn_norm, a.eps, b.xn)
        nq, nkv = a.n_head * hd, a.n_head_kv * hd
        for il, L in enumerate(self.layers):
            if L.qkv is not None:
                L.qkv.matvec(b.xn, b.qkv, impl)
            else:
                L.q.matvec(b.xn, b.qkv[:, :nq], impl)
                L.k.matvec(b.xn, b.qkv[:, nq:nq + nkv], impl)
                L.v.matvec(b.xn, b.qkv[:, nq + nkv:], impl)
            kc, vc = state.kv[il]
            ops.qk_rope_kv(b.qkv.view(-1), L.q_norm, L.k_norm, a.eps, state.rope_cos, state.rope_sin, state.pos,
                           a.n_head, a.n_head_kv, hd, a.n_rot, b.q, kc, vc)
            ops.attention(b.q, kc, vc, state.pos, hd ** -0.5, b.o.view(-1), b.partial, b.ml)
            L.wo.matvec(b.o, b.attn_out.view(1, -1), impl)
            ops.add_rmsnorm(b.x, b.attn_out, L.ffn_norm, a.eps, b.xn)
            torch.matmul(b.xn, L.router.T, out=b.router)
            smap = cache.layer_map(il)
            ops.route_topk(b.router, a.n_expert_used, a.expert_weights_scale, smap, b.ids, b.wts,
                           state.ids_log[il:il + 1], state.hit_log[il:il + 1])
            ids = b.ids.view(-1)
            lay = L.layout
            if state.fast:
                words, delta = cache.words(il, lay.gu_type)
                ops.experts(words, lay.gu_type, delta, 0, lay.expert_bytes // words.element_size(), lay.n_ff,
                            lay.gu_row_bytes, smap, ids, b.xn, b.h, True, a.n_expert_used, mode=cache.mode)
                words, delta = cache.words(il, lay.down_type)
                wsz = words.element_size()
                ops.experts(words, lay.down_type, delta, lay.down_offset // wsz, lay.expert_bytes // wsz, a.n_embd,
                            lay.down_row_bytes, smap, ids, b.h, b.y.view(a.n_expert_used, -1), False,
                            a.n_expert_used, b.wts.view(-1), mode=cache.mode)
            else:
                st = cache.reference_store(il, lay.gu_type)
                ops.experts(st, lay.gu_type, 0, 0, 0, lay.n_ff, lay.gu_row_bytes, smap, ids, b.xn, b.h, True,
                            a.n_expert_used)
                st = cache.reference_store(il, lay.down_type)
                ops.experts(st, lay.down_type, 0, lay.down_offset // st.word, 0, a.n_embd, lay.down_row_bytes, smap,
                            ids, b.h, b.y.view(a.n_expert_used, -1), False, a.n_expert_used, b.wts.view(-1))
            nxt = self.layers[il + 1].attn_norm if il + 1 < len(self.layers) else self.output_norm
            ops.add_rmsnorm(b.x, b.y, nxt, a.eps, b.xn)
        self.output.matvec(b.xn, b.logits, impl)
        torch.argmax(b.logits, dim=-1, out=state.tok)
        state.pos.add_(1)

