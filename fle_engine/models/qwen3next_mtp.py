"""The qwen3next MTP draft head: one full-attention block after the trunk
that predicts the token after next from the trunk's post-norm hidden state
and the embedding of the next token.

Tensors of block N (N = the trunk's layer count), as llama.cpp's
``graph_mtp`` in ``src/models/qwen3next.cpp`` reads them: the block's own
``attn_norm``, gated attention (``attn_q`` with per-head gate rows, q/k
norms, ``attn_output``), ``post_attention_norm``, MoE and shared expert,
plus ``nextn.eh_proj`` [2 D -> D] (embedding half first), ``nextn.enorm``,
``nextn.hnorm`` and optionally ``nextn.shared_head_norm`` (else the trunk's
``output_norm``), ``nextn.embed_tokens`` and ``nextn.shared_head_head``
(else the trunk's ``token_embd`` / ``output``). The block sits in the trunk
file (``block_count`` = N + 1, ``nextn_predict_layers`` = 1) or in a
separate head file (the converter's ``--mtp`` export), whose
``token_embd`` / ``output`` copies are not loaded again: the trunk's are
used.

Per pair (h_j, t_{j+1}) at position j, h_j the trunk's hidden state after
``output_norm`` (what its head reads too):
x = eh_proj [RMS(embed(t_{j+1})) * enorm ; RMS(h_j) * hnorm], then the
block exactly as a trunk attention layer, RMS norm and the head.
Drafting and queueing are :mod:`fle_engine.mtp`'s.
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
from ..mtp import MTPState, open_head_file
from .qwen3moe import param
from .qwen3next import Block, ModelArgs

__all__ = ["MTPHead", "load_mtp", "same_hparams"]


class MTPHead(nn.Module):
    def __init__(self, w: Weights, a: ModelArgs, trunk: nn.Module):
        super().__init__()
        il = a.n_layer
        p = f"blk.{il}."
        d, v = a.n_embd, a.n_vocab

        def own_or(name: str, shape: tuple[int, ...], shared: Tensor) -> Tensor:
            return param(w.get(p + name, shape)) if w.has(p + name) else shared

        self.embed = own_or("nextn.embed_tokens.weight", (v, d), trunk.tok_embd)
        self.output = own_or("nextn.shared_head_head.weight", (v, d), trunk.output)
        self.head_norm = own_or("nextn.shared_head_norm.weight", (d,), trunk.output_norm)
        self.eh_proj = param(w.get(p + "nextn.eh_proj.weight", (d, 2 * d)))
        self.enorm = param(w.get(p + "nextn.enorm.weight", (d,)))
        self.hnorm = param(w.get(p + "nextn.hnorm.weight", (d,)))
        self.block = Block(w, il, replace(a, recurrent=a.recurrent[:il] + (False,)))
        self.a = a

    @property
    def moe(self) -> L.MoE:
        return self.block.moe

    def new_state(self, max_tokens: int) -> MTPState:
        a, dev, dt = self.a, self.eh_proj.device, self.eh_proj.dtype
        kv = (a.n_head_kv, max_tokens, a.head_dim)
        return MTPState(L.AttnCache(torch.zeros(kv, dtype=dt, device=dev), torch.zeros(kv, dtype=dt, device=dev)))

    def forward(self, hidden: Tensor, next_tokens: Tensor, cache: L.AttnCache, positions: Tensor,
                rope_cos: Tensor, rope_sin: Tensor, return_hidden: bool = False):
        """Logits [T, V] of the token after ``next_tokens`` [T], from the
        trunk's post-norm hidden states ``hidden`` [T, D] at ``positions``;
        with ``return_hidden`` also the head's own post-norm hidden state,
        what a further drafting step reads in place of the trunk's (as
        llama.cpp's MTP drafting feeds ``h_nextn`` back)."""
        h_out = self.body(F.embedding(next_tokens, self.embed), hidden, cache, positions, rope_cos, rope_sin)
        logits = F.linear(h_out, self.output)
        return (logits, h_out) if return_hidden else logits

    def body(self, embedded: Tensor, hidden: Tensor, cache: L.AttnCache, positions: Tensor, rope_cos: Tensor,
             rope_sin: Tensor) -> Tensor:
        """The head between its embedding and its output product: the
        embedding rows of the next tokens ``embedded`` [T, D] and the trunk's
        hidden states [T, D] -> the head's post-norm hidden state [T, D]
        (what the engine's drafting, :mod:`fle_engine.runtime.mtp`, runs
        with its own embedding and output products)."""
        eps = self.a.eps
        e = L.rms_norm(embedded, self.enorm, eps)
        h = L.rms_norm(hidden, self.hnorm, eps)
        x = F.linear(torch.cat([e, h], -1), self.eh_proj)
        x = self.block(x, cache, positions, rope_cos[positions], rope_sin[positions])
        return L.rms_norm(x, self.head_norm, eps)


def same_hparams(a: ModelArgs) -> dict[str, int]:
    """The hyperparameters that a head file must share with the trunk ``a``."""
    return {"embedding_length": a.n_embd, "expert_count": a.n_expert, "attention.head_count": a.n_head,
            "attention.head_count_kv": a.n_head_kv}


def load_mtp(model, path: "str | os.PathLike[str]") -> MTPHead:
    """Attach the MTP head in ``path`` (a separate head file, or a trunk
    file that holds block N) to ``model`` (a loaded qwen3next
    :class:`~fle_engine.loader.Model` or its ``net``). States made after
    this carry the head's cache."""
    net = getattr(model, "net", model)
    a = getattr(net, "args", None)
    if getattr(a, "arch", None) != "qwen3next":
        raise FleError("this MTP head is for qwen3next models")
    gguf, w = open_head_file(path, net, same_hparams(a))
    try:
        head = MTPHead(w, a, net)
    finally:
        gguf.close()
    head.eval()
    net.mtp = head
    return head
