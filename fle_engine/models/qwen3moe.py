"""qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): pre-norm blocks of GQA
attention (per-head q/k RMSNorm, NEOX rotary over the whole head) and a
routed MoE (softmax, top-K, renormalised weights, no shared expert).

Semantics from llama.cpp's ``src/models/qwen3moe.cpp`` and
``build_moe_ffn`` in ``src/llama-graph.cpp``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fle_quant.errors import FleError

from .. import layers as L
from ..loader import Weights

ARCH = "qwen3moe"


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    n_vocab: int
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_base: float
    rope_freq_scale: float
    eps: float
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    expert_weights_scale: float

    @classmethod
    def from_weights(cls, w: Weights) -> "ModelArgs":
        c = common_hparams(w, ARCH)
        n_rot = int(w.hp("rope.dimension_count", c["head_dim"]))
        if n_rot != c["head_dim"]:
            raise FleError(f"{w.path}: {ARCH} rotates the whole head; rope.dimension_count = {n_rot} "
                           f"differs from the head width {c['head_dim']}")
        return cls(arch=ARCH, n_layer=int(w.hp("block_count")), n_rot=n_rot, **c)


def common_hparams(w: Weights, arch: str) -> dict:
    """The hyperparameters every architecture here reads alike (the
    :class:`ModelArgs` fields but ``arch``, ``n_layer`` and ``n_rot``)."""
    n_embd = int(w.hp("embedding_length"))
    n_head = int(w.hp("attention.head_count"))
    head_dim = int(w.hp("attention.key_length", n_embd // n_head))
    if int(w.hp("attention.value_length", head_dim)) != head_dim:
        raise FleError(f"{w.path}: {arch} needs attention.value_length == attention.key_length")
    return dict(
        n_vocab=w.gguf.info("token_embd.weight").shape[1],
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(w.hp("attention.head_count_kv", n_head)),
        head_dim=head_dim,
        rope_base=float(w.hp("rope.freq_base", 10000.0)),
        rope_freq_scale=rope_freq_scale(w),
        eps=float(w.hp("attention.layer_norm_rms_epsilon")),
        n_expert=int(w.hp("expert_count")),
        n_expert_used=int(w.hp("expert_used_count")),
        n_ff_exp=int(w.hp("expert_feed_forward_length")),
        expert_weights_scale=float(w.hp("expert_weights_scale", 0.0)),
    )


def rope_freq_scale(w: Weights) -> float:
    """1 / rope.scaling.factor for linear scaling; FLE's reference pass does
    not implement YaRN or other schemes and says so."""
    kind = w.hp("rope.scaling.type", "none")
    if kind in ("none", None):
        return 1.0
    if kind == "linear":
        return 1.0 / float(w.hp("rope.scaling.factor", 1.0))
    raise FleError(f"{w.path}: rope.scaling.type {kind!r} is not supported by FLE's reference forward pass")


def param(t: Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def load_moe(w: Weights, il: int, n_embd: int, n_expert: int, n_used: int, n_ff: int, scale: float,
             shared: bool = False, n_ff_shexp: int = 0) -> L.MoE:
    """Router and stacked experts of layer ``il`` (a fused
    ``ffn_gate_up_exps``, gate rows first, is split), and the shared expert
    with its sigmoid gate row (when the file has one) when ``shared``."""
    p = f"blk.{il}."
    router = w.get(p + "ffn_gate_inp.weight", (n_expert, n_embd))
    if w.has(p + "ffn_gate_up_exps.weight"):
        gate, up = w.experts_split(p + "ffn_gate_up_exps.weight", (n_expert, n_ff, n_embd))
    else:
        gate = w.experts(p + "ffn_gate_exps.weight", (n_expert, n_ff, n_embd))
        up = w.experts(p + "ffn_up_exps.weight", (n_expert, n_ff, n_embd))
    down = w.experts(p + "ffn_down_exps.weight", (n_expert, n_embd, n_ff))
    shexp = sgate = None
    if shared:
        shexp = (w.get(p + "ffn_gate_shexp.weight", (n_ff_shexp, n_embd)),
                 w.get(p + "ffn_up_shexp.weight", (n_ff_shexp, n_embd)),
                 w.get(p + "ffn_down_shexp.weight", (n_embd, n_ff_shexp)))
        if w.has(p + "ffn_gate_inp_shexp.weight"):
            # one row; converters write it [D] or [D, 1] (ggml order)
            sgate = w.get(p + "ffn_gate_inp_shexp.weight")
            if sgate.numel() != n_embd:
                raise FleError(f"{w.path}: {p}ffn_gate_inp_shexp.weight has {sgate.numel()} values, "
                               f"expected {n_embd}")
            sgate = sgate.reshape(n_embd).contiguous()
    return L.MoE(il, router, gate, up, down, n_used, scale, shexp, sgate)


def load_qkv(w: Weights, p: str, q_rows: int, kv_rows: int, n_embd: int) -> tuple[Tensor, Tensor, Tensor]:
    """Separate ``attn_q``/``attn_k``/``attn_v`` or a fused ``attn_qkv``
    (rows q | k | v, as llama.cpp's ``build_qkv`` splits it)."""
    if w.has(p + "attn_qkv.weight"):
        qkv = w.get(p + "attn_qkv.weight", (q_rows + 2 * kv_rows, n_embd))
        return qkv[:q_rows].contiguous(), qkv[q_rows:q_rows + kv_rows].contiguous(), qkv[q_rows + kv_rows:].contiguous()
    return (w.get(p + "attn_q.weight", (q_rows, n_embd)), w.get(p + "attn_k.weight", (kv_rows, n_embd)),
            w.get(p + "attn_v.weight", (kv_rows, n_embd)))


class Attention(nn.Module):
    def __init__(self, w: Weights, il: int, a: ModelArgs):
        super().__init__()
        p = f"blk.{il}."
        hd = a.head_dim
        wq, wk, wv = load_qkv(w, p, a.n_head * hd, a.n_head_kv * hd, a.n_embd)
        self.wq, self.wk, self.wv = param(wq), param(wk), param(wv)
        self.wo = param(w.get(p + "attn_output.weight", (a.n_embd, a.n_head * hd)))
        self.q_norm = param(w.get(p + "attn_q_norm.weight", (hd,)))
        self.k_norm = param(w.get(p + "attn_k_norm.weight", (hd,)))
        self.a = a

    def forward(self, x: Tensor, cache: L.AttnCache, positions: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        a = self.a
        n_tok = x.shape[0]
        q = F.linear(x, self.wq).view(n_tok, a.n_head, a.head_dim)
        k = F.linear(x, self.wk).view(n_tok, a.n_head_kv, a.head_dim)
        v = F.linear(x, self.wv).view(n_tok, a.n_head_kv, a.head_dim)
        q = L.apply_rope_neox(L.rms_norm(q, self.q_norm, a.eps), cos, sin)
        k = L.apply_rope_neox(L.rms_norm(k, self.k_norm, a.eps), cos, sin)
        out = L.attention(q, k, v, cache, positions, a.head_dim ** -0.5)
        return F.linear(out, self.wo)

    def forward_batch(self, x: Tensor, sizes: list[int], caches: list, rots: list) -> Tensor:
        """Several sequences' tokens: projections, norms and rotary on all of
        them at once, the attention against each one's cache
        (:func:`~fle_engine.layers.attention_batch`)."""
        a = self.a
        n_tok = x.shape[0]
        cos, sin = L.rot_cat(rots, 1), L.rot_cat(rots, 2)
        q = F.linear(x, self.wq).view(n_tok, a.n_head, a.head_dim)
        k = F.linear(x, self.wk).view(n_tok, a.n_head_kv, a.head_dim)
        v = F.linear(x, self.wv).view(n_tok, a.n_head_kv, a.head_dim)
        q = L.apply_rope_neox(L.rms_norm(q, self.q_norm, a.eps), cos, sin)
        k = L.apply_rope_neox(L.rms_norm(k, self.k_norm, a.eps), cos, sin)
        out = L.attention_batch(q, k, v, caches, rots, sizes, a.head_dim ** -0.5)
        return F.linear(out, self.wo)


class Block(nn.Module):
    def __init__(self, w: Weights, il: int, a: ModelArgs):
        super().__init__()
        p = f"blk.{il}."
        self.attn_norm = param(w.get(p + "attn_norm.weight", (a.n_embd,)))
        self.attn = Attention(w, il, a)
        self.ffn_norm = param(w.get(p + "ffn_norm.weight", (a.n_embd,)))
        self.moe = load_moe(w, il, a.n_embd, a.n_expert, a.n_expert_used, a.n_ff_exp, a.expert_weights_scale)
        self.eps = a.eps

    def forward(self, x: Tensor, cache: L.AttnCache, positions: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(L.rms_norm(x, self.attn_norm, self.eps), cache, positions, cos, sin)
        return x + self.moe(L.rms_norm(x, self.ffn_norm, self.eps))

    def forward_batch(self, x: Tensor, sizes: list[int], caches: list, rots: list) -> Tensor:
        """Several sequences' tokens ``x`` (concatenated, ``sizes`` each):
        attention per sequence against its own cache, the MoE on all at once."""
        x = x + self.attn.forward_batch(L.rms_norm(x, self.attn_norm, self.eps), sizes, caches, rots)
        return x + self.moe.forward_batch(L.rms_norm(x, self.ffn_norm, self.eps))


class Transformer(nn.Module):
    """Embedding -> blocks -> RMSNorm -> head. Architectures with the same
    skeleton (qwen3next) subclass it and set ``Args``, ``Block`` and
    ``new_state``; those with an MTP head set ``mtp`` (see
    :mod:`fle_engine.mtp`), which reads the post-norm hidden states."""

    Args = ModelArgs
    Block = Block

    def __init__(self, w: Weights, a: ModelArgs):
        super().__init__()
        self.args = a
        self.tok_embd = param(w.get("token_embd.weight", (a.n_vocab, a.n_embd)))
        self.layers = nn.ModuleList(self.Block(w, il, a) for il in range(a.n_layer))
        self.output_norm = param(w.get("output_norm.weight", (a.n_embd,)))
        # a file without output.weight ties the head to the embedding, as llama.cpp does
        head = "output.weight" if w.has("output.weight") else "token_embd.weight"
        self.output = param(w.get(head, (a.n_vocab, a.n_embd)))
        self.mtp = None

    @classmethod
    def from_weights(cls, w: Weights) -> "Transformer":
        return cls(w, cls.Args.from_weights(w))

    @property
    def device(self) -> torch.device:
        return self.tok_embd.device

    def new_state(self, max_tokens: int) -> L.State:
        a, dev, dt = self.args, self.device, self.tok_embd.dtype
        caches = [L.AttnCache(torch.zeros(a.n_head_kv, max_tokens, a.head_dim, dtype=dt, device=dev),
                              torch.zeros(a.n_head_kv, max_tokens, a.head_dim, dtype=dt, device=dev))
                  for _ in range(a.n_layer)]
        return self.attach_mtp(new_state(max_tokens, caches, a.n_rot, a.rope_base, a.rope_freq_scale, dev))

    def attach_mtp(self, state: L.State) -> L.State:
        """``state`` with the MTP head's own state when a head is loaded."""
        if self.mtp is not None:
            state.mtp = self.mtp.new_state(state.max_tokens)
        return state

    def forward(self, tokens: Tensor, state: L.State) -> Tensor:
        positions, cos, sin = advance(state, tokens.shape[0])
        x = F.embedding(tokens, self.tok_embd)
        for layer, cache in zip(self.layers, state.layers):
            x = layer(x, cache, positions, cos, sin)
        h = L.rms_norm(x, self.output_norm, self.args.eps)
        logits = F.linear(h, self.output)
        state.hidden, state.last_tokens, state.last_logits = h, tokens, logits
        if state.mtp is not None:
            state.mtp.push(h, tokens)
        return logits

    def forward_batch(self, tokens: list[Tensor], states: list[L.State]) -> list[Tensor]:
        """``forward`` of several sequences in one pass: ``tokens[i]`` appended
        to ``states[i]``; the token-wise work (embedding, MoE, head) runs on
        all tokens together. Returns each sequence's logits."""
        sizes = [t.shape[0] for t in tokens]
        ends = [s.length + n for s, n in zip(states, sizes)]      # each sequence's length after this step
        rots = L.Rots((advance(s, n) for s, n in zip(states, sizes)), ends)
        x = F.embedding(torch.cat(tokens), self.tok_embd)
        for il, layer in enumerate(self.layers):       # the attention reads each cache up to its end (rots.ends)
            x = layer.forward_batch(x, sizes, [s.layers[il] for s in states], rots)
        h = L.rms_norm(x, self.output_norm, self.args.eps)
        logits = F.linear(h, self.output)
        out = []
        for s, t, hs, lg in zip(states, tokens, h.split(sizes), logits.split(sizes)):
            s.hidden, s.last_tokens, s.last_logits = hs, t, lg
            if s.mtp is not None:
                s.mtp.push(hs, t)
            out.append(lg)
        return out


def new_state(max_tokens: int, caches: list, n_rot: int, base: float, freq_scale: float,
              device: torch.device) -> L.State:
    cos, sin = L.rope_table(n_rot, base, max_tokens, freq_scale)
    return L.State(max_tokens, torch.zeros(1, dtype=torch.long, device=device), caches,
                   torch.from_numpy(cos).to(device), torch.from_numpy(sin).to(device))


def advance(state: L.State, n_tok: int) -> tuple[Tensor, Tensor, Tensor]:
    """Positions [T] of the new tokens (device), their rotary rows, and the
    state's position counter moved past them (in place, no host sync)."""
    positions = state.pos + torch.arange(n_tok, device=state.pos.device)
    cos, sin = state.rope_cos[positions], state.rope_sin[positions]
    state.pos.add_(n_tok)
    return positions, cos, sin
