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
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fle_quant.errors import FleError

from .. import layers as L
from ..loader import Weights
from ..mtp import MTPState, draft, open_head_file
from .qwen3moe import param
from .qwen4exp import HCMixer, ModelArgs, QSACache, QSAttention, grouped_rms, hc_write, load_moe

__all__ = ["MTPHead", "MTPState", "load_mtp", "draft", "same_hparams", "head_args"]


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
                rope_cos: Tensor, rope_sin: Tensor, return_hidden: bool = False):
        """Logits [T, V] of the token after ``next_tokens`` [T], from the
        trunk residuals ``hidden`` [T, S, D] at ``positions`` [T]; with
        ``return_hidden`` also the head's own wide residual [T, S, D], what
        a further drafting step reads in place of the trunk's."""
        x = self.body(F.embedding(next_tokens, self.embed), hidden, cache, positions, rope_cos, rope_sin)
        logits = F.linear(self.readout(x), self.output)
        return (logits, x) if return_hidden else logits

    def body(self, embedded: Tensor, hidden: Tensor, cache: QSACache, positions: Tensor, rope_cos: Tensor,
             rope_sin: Tensor) -> Tensor:
        """The head between its embedding and its head mixer: the embedding
        rows of the next tokens ``embedded`` [T, D] and the trunk residuals
        [T, S, D] -> the head's own wide residual [T, S, D] (what the
        engine's drafting, :mod:`fle_engine.runtime.mtp`, runs with its own
        embedding and output products; :meth:`readout` then gives the
        output product's input)."""
        a = self.a
        e = L.rms_norm(embedded, self.enorm, a.eps)                                       # [T, D]
        h = grouped_rms(hidden, self.hnorm, a.eps)                                         # [T, S, D]
        x = F.linear(torch.cat([e[:, None, :].expand_as(h), h], -1), self.eh_proj)        # [T, S, D]
        cos, sin = rope_cos[positions], rope_sin[positions]
        xin, inject = self.hc_attn(x)
        x = hc_write(x, self.attn(xin, cache, positions, cos, sin, rope_cos, rope_sin), inject, False)
        xin, inject = self.hc_ffn(x)
        return hc_write(x, self.moe(xin), inject, False)

    def readout(self, x: Tensor) -> Tensor:
        """The head mixer: the head's wide residual [T, S, D] -> the output product's input [T, D]."""
        y, _ = self.head_hc(x)
        return y


def _trunk(model):
    net = getattr(model, "net", model)
    if getattr(getattr(net, "args", None), "arch", None) != "qwen4exp":
        raise FleError("this MTP head is for qwen4exp models")
    return net


def same_hparams(a: ModelArgs) -> dict[str, int]:
    """The hyperparameters that a head file must share with the trunk ``a``."""
    return {"embedding_length": a.n_embd, "hyper_connection.count": a.hc, "expert_count": a.n_expert,
            "attention.head_count": a.n_head}


def head_args(w: Weights, a: ModelArgs) -> ModelArgs:
    """The trunk's ``a`` with the head's compress ratio (of the head file
    ``w``; 0, dense, when it gives none) after the trunk's."""
    compress = [int(c) for c in w.hp("attention.compress_ratios", [])]
    head_ratio = compress[a.n_layer] if len(compress) > a.n_layer else 0
    return replace(a, compress=a.compress[:a.n_layer] + (head_ratio,))


def load_mtp(model, path: "str | os.PathLike[str]") -> MTPHead:
    """Attach the MTP head in ``path`` (a separate head file, or a trunk
    file that holds block N) to ``model`` (a loaded qwen4exp
    :class:`~fle_engine.loader.Model` or its ``net``). States made after
    this carry the head's cache."""
    net = _trunk(model)
    a = net.args
    gguf, w = open_head_file(path, net, same_hparams(a))
    try:
        head = MTPHead(w, head_args(w, a), net.tok_embd, net.output)
    finally:
        gguf.close()
    head.eval()
    net.mtp = head
    return head
