"""The qwen4exp MTP draft head: one extra block that predicts the token
after next from the trunk's wide residual and the embedding of the next
token.

Tensors of block N (N = the trunk's layer count), as engines that run the
released head read them (llama.cpp 0.3.36 has no qwen4exp MTP): its own
``hc_attn_*`` / ``hc_ffn_*``, a QSA-shaped attention block run densely
(``attention.compress_ratios`` ends in 0 for it), its own MoE and shared
expert, ``nextn.eh_proj`` [2 D -> D] (embedding half first),
``nextn.enorm`` [D], ``nextn.hnorm`` [S * D] and a head mixer
``nextn.hc_head_{norm,down,up}``; ``token_embd`` and ``output`` are the
trunk's. The head sits in the trunk file (``block_count`` = N + 1,
``nextn_predict_layers`` = 1) or in a separate file holding only block N.

Per pair (h_j, t_{j+1}) at position j, h_j the trunk's wide residual after
its last layer (before the head mixer):
x_s = eh_proj [RMS(embed(t_{j+1})) * enorm ; RMS(h_j,s) * hnorm_s], then
HC read -> attention (own KV cache) -> HC write -> HC read -> MoE -> HC
write -> head mixer -> ``output``: logits for t_{j+2}.

Drafting: the trunk's ``forward`` queues (h, tokens) in the sequence
state; :func:`draft` runs the head over every queued pair whose next token
is known, plus the last one with the trunk's greedy next token, and
returns the draft for the token after it. The last pair is provisional:
its KV cell is rewritten on the next draft, once the real token is known.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fle_quant.errors import FleError
from fle_quant.gguf_reader import GGUFModel

from .. import layers as L
from ..loader import Weights
from .qwen3moe import param
from .qwen4exp import HCMixer, ModelArgs, QSACache, QSAttention, grouped_rms, hc_write, load_moe

__all__ = ["MTPHead", "MTPState", "load_mtp", "draft"]


@dataclass
class MTPState:
    """The head's KV cache (``cache``), how many positions it has settled
    (``pos``, host int) and the trunk residuals and tokens it has not yet
    consumed (positions ``pos`` .. trunk length - 1)."""
    cache: QSACache
    pos: int = 0
    queue_h: list = field(default_factory=list)
    queue_tok: list = field(default_factory=list)

    def push(self, hidden: Tensor, tokens: Tensor) -> None:
        self.queue_h.append(hidden)
        self.queue_tok.append(tokens)


class MTPHead(nn.Module):
    def __init__(self, w: Weights, a: ModelArgs, embed: Tensor, output: Tensor):
        super().__init__()
        il = a.n_layer
        p = f"blk.{il}."
        s, d = a.hc, a.n_embd
        self.embed, self.output = embed, output                          # the trunk's, shared
        self.eh_proj = param(w.get(p + "nextn.eh_proj.weight", (d, 2 * d)))
        self.enorm = param(w.get(p + "nextn.enorm.weight", (d,)))
        self.hnorm = param(w.get(p + "nextn.hnorm.weight", (s * d,)).view(s, d))
        self.hc_attn = HCMixer(w, p + "hc_attn_", a, inject=True)
        self.hc_ffn = HCMixer(w, p + "hc_ffn_", a, inject=True)
        self.attn = QSAttention(w, il, a)
        self.attn.dense = True                                          # the head attends densely
        self.moe = load_moe(w, il, a)
        self.head_hc = HCMixer(w, p + "nextn.hc_head_", a, inject=False)
        self.a = a

    def new_state(self, max_tokens: int) -> MTPState:
        a, dev, dt = self.a, self.eh_proj.device, self.eh_proj.dtype
        kv = (a.n_head_kv, max_tokens, a.head_dim)
        idx = torch.zeros(max_tokens, a.idx_dim, dtype=dt, device=dev) if self.attn.ratio else None
        return MTPState(QSACache(torch.zeros(kv, dtype=dt, device=dev), torch.zeros(kv, dtype=dt, device=dev), idx))

    def forward(self, hidden: Tensor, next_tokens: Tensor, cache: QSACache, positions: Tensor,
                rope_cos: Tensor, rope_sin: Tensor) -> Tensor:
        """Logits [T, V] of the token after ``next_tokens`` [T], from the
        trunk residuals ``hidden`` [T, S, D] at ``positions`` [T]."""
        a = self.a
        e = L.rms_norm(F.embedding(next_tokens, self.embed), self.enorm, a.eps)          # [T, D]
        h = grouped_rms(hidden, self.hnorm, a.eps)                                         # [T, S, D]
        x = F.linear(torch.cat([e[:, None, :].expand_as(h), h], -1), self.eh_proj)        # [T, S, D]
        cos, sin = rope_cos[positions], rope_sin[positions]
        xin, inject = self.hc_attn(x)
        x = hc_write(x, self.attn(xin, cache, positions, cos, sin, rope_cos, rope_sin), inject, False)
        xin, inject = self.hc_ffn(x)
        x = hc_write(x, self.moe(xin), inject, False)
        y, _ = self.head_hc(x)
        return F.linear(y, self.output)


def _trunk(model):
    net = getattr(model, "net", model)
    if getattr(getattr(net, "args", None), "arch", None) != "qwen4exp":
        raise FleError("MTP drafting is implemented for qwen4exp models only")
    return net


def load_mtp(model, path: "str | os.PathLike[str]") -> MTPHead:
    """Attach the MTP head in ``path`` (a separate head file, or a trunk
    file that holds block N) to ``model`` (a loaded qwen4exp
    :class:`~fle_engine.loader.Model` or its ``net``). States made after
    this carry the head's cache."""
    net = _trunk(model)
    a = net.args
    gguf = GGUFModel.open(path)
    try:
        w = Weights(gguf, net.device, net.tok_embd.dtype)
        if gguf.arch != a.arch:
            raise FleError(f"{w.path}: architecture {gguf.arch!r}, the trunk is {a.arch!r}")
        n_all, n_mtp = int(w.hp("block_count")), int(w.hp("nextn_predict_layers", 0))
        if n_mtp < 1 or n_all - n_mtp != a.n_layer:
            raise FleError(f"{w.path}: block_count {n_all} with nextn_predict_layers {n_mtp} does not describe an "
                           f"MTP block after the trunk's {a.n_layer} layers")
        for key, want in (("embedding_length", a.n_embd), ("hyper_connection.count", a.hc),
                          ("expert_count", a.n_expert), ("attention.head_count", a.n_head)):
            if int(w.hp(key)) != want:
                raise FleError(f"{w.path}: {key} = {w.hp(key)}, the trunk has {want}; not this model's head")
        if not w.has(f"blk.{a.n_layer}.nextn.eh_proj.weight"):
            raise FleError(f"{w.path}: no blk.{a.n_layer}.nextn.eh_proj.weight; not an MTP head for this trunk")
        compress = [int(c) for c in w.hp("attention.compress_ratios", [])]
        head_ratio = compress[a.n_layer] if len(compress) > a.n_layer else 0
        head = MTPHead(w, replace(a, compress=a.compress[:a.n_layer] + (head_ratio,)), net.tok_embd, net.output)
    finally:
        gguf.close()
    head.eval()
    net.mtp = head
    return head


def draft(model, state) -> tuple[Tensor, Tensor]:
    """(draft token [1] int64, its logits [V]) for the position after the
    trunk's greedy next token. ``state`` must come from ``new_state`` after
    the head was loaded, and the trunk must have run on it; drafting twice
    without a trunk step in between gives the same draft."""
    net = _trunk(model)
    head, mtp = net.mtp, state.mtp
    if head is None or mtp is None:
        raise FleError("no MTP head: call load_mtp(model, path) before making the state")
    if not mtp.queue_h:
        raise FleError("draft needs the trunk to have processed at least one token of this state")
    with torch.inference_mode():
        hidden = torch.cat(mtp.queue_h)                                  # [n, S, D]
        tokens = torch.cat(mtp.queue_tok)                                # [n]
        n = tokens.shape[0]
        greedy = state.last_logits[-1:].argmax(-1)                       # the trunk's next token, on the device
        nxt = torch.cat([tokens[1:], greedy])
        positions = torch.arange(mtp.pos, mtp.pos + n, device=hidden.device)
        logits = head(hidden, nxt, mtp.cache, positions, state.rope_cos, state.rope_sin)[-1]
    # the last pair used a guessed token: keep it queued, to redo once the real one is known
    mtp.queue_h, mtp.queue_tok = [hidden[-1:]], [tokens[-1:]]
    mtp.pos += n - 1
    return logits.argmax(-1, keepdim=True), logits
