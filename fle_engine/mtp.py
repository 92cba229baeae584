"""MTP (multi-token prediction) draft heads, shared by the architectures
that have one (qwen3next, qwen4exp).

A head is one extra block after the trunk. For each position j it reads the
trunk's hidden state there (``h_j``, what each architecture defines: the
post-norm hidden for qwen3next, the wide residual for qwen4exp) and the
embedding of the token at j + 1, and predicts the token at j + 2. Each
architecture's head module has

- ``new_state(max_tokens) -> cache`` (its own KV cache) and
- ``forward(hidden [T, ...], next_tokens [T], cache, positions [T],
  rope_cos, rope_sin) -> logits [T, V]``,
- and, for a draft vocabulary, an ``output`` matrix [V, D] (cut to the
  list's rows by :meth:`~fle_engine.draft_vocab.DraftVocab.head`) or its
  own ``with_vocab(vocab)`` and ``n_vocab`` (the engine's head,
  :mod:`fle_engine.runtime.mtp`),

and its trunk keeps, after every ``forward``, the call's hidden states,
tokens and logits in the sequence state (``hidden``, ``last_tokens``,
``last_logits``) and queues them in ``state.mtp`` (:class:`MTPState`).

:func:`draft` turns that queue into a draft for the token after the trunk's
greedy next token; :func:`head_logits` runs a head over given pairs (scores,
tests); :func:`open_head_file` does the checks every head file needs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fle_quant.errors import FleError
from fle_quant.gguf_reader import GGUFModel

from .loader import Weights

__all__ = ["MTPState", "draft", "head_logits", "open_head_file"]


@dataclass
class MTPState:
    """The head's KV cache (``cache``), how many positions it has settled
    (``pos``, host int) and the trunk hidden states and tokens it has not
    yet consumed (positions ``pos`` .. trunk length - 1)."""
    cache: object
    pos: int = 0
    queue_h: list = field(default_factory=list)
    queue_tok: list = field(default_factory=list)

    def push(self, hidden: Tensor, tokens: Tensor) -> None:
        self.queue_h.append(hidden)
        self.queue_tok.append(tokens)


def _net(model):
    net = getattr(model, "net", model)
    if not hasattr(net, "mtp"):
        arch = getattr(getattr(net, "args", None), "arch", "?")
        raise FleError(f"FLE runs no MTP head for {arch} models")
    return net


def draft(model, state, next_token: "int | None" = None, n_draft: int = 1,
          vocab=None) -> tuple[Tensor, Tensor]:
    """(draft tokens [n_draft] int64, their logits [n_draft, V]) for the
    positions after the next token: ``next_token`` when it is known
    (sampled), else the trunk's greedy choice. The first draft comes from the
    trunk's hidden state; each further one from the head's own hidden state
    and the previous draft, one position on. ``state`` must come from
    ``new_state`` after the head was loaded, and the trunk must have run on
    it; drafting twice without a trunk step in between gives the same
    drafts. ``vocab`` (a :class:`~fle_engine.draft_vocab.DraftVocab`): the
    head computes only the output rows of the list's tokens, so every draft
    is one of them; the logits returned are then -inf outside the list."""
    net = _net(model)
    head, mtp = net.mtp, state.mtp
    if head is None or mtp is None:
        raise FleError("no MTP head: load one (load_mtp) before making the state")
    if not mtp.queue_h:
        raise FleError("draft needs the trunk to have processed at least one token of this state")
    if n_draft < 1:
        raise FleError(f"n_draft must be at least 1, got {n_draft}")
    ids = None
    n_vocab = getattr(head, "n_vocab", None)
    if vocab is not None:
        # the same head, its output projection cut to the list's rows (a head with ``with_vocab`` cuts its own)
        n_vocab = n_vocab or head.output.shape[0]
        head = head.with_vocab(vocab) if hasattr(head, "with_vocab") else vocab.head(head)
        ids = vocab.tensor(mtp.queue_h[0].device)

    def pick(lg: Tensor) -> Tensor:
        best = lg.argmax(-1)
        return best if ids is None else ids[best]

    with torch.inference_mode():
        hidden = torch.cat(mtp.queue_h)
        tokens = torch.cat(mtp.queue_tok)
        n = tokens.shape[0]
        if next_token is None:
            nxt_tok = state.last_logits[-1:].argmax(-1)                   # the trunk's next token, on the device
        else:
            nxt_tok = torch.tensor([int(next_token)], dtype=torch.long, device=tokens.device)
        nxt = torch.cat([tokens[1:], nxt_tok])
        positions = torch.arange(mtp.pos, mtp.pos + n, device=hidden.device)
        logits, h = head(hidden, nxt, mtp.cache, positions, state.rope_cos, state.rope_sin, return_hidden=True)
        out_logits = [logits[-1:]]
        drafts = [pick(logits[-1:])]
        last = mtp.pos + n - 1
        for i in range(1, n_draft):
            # provisional cells past the settled ones: rewritten by later drafts
            if last + i >= state.max_tokens:
                break
            pos = torch.arange(last + i, last + i + 1, device=hidden.device)
            lg, h = head(h[-1:], drafts[-1], mtp.cache, pos, state.rope_cos, state.rope_sin, return_hidden=True)
            out_logits.append(lg)
            drafts.append(pick(lg))
        drafts, out_logits = torch.cat(drafts), torch.cat(out_logits)
        if ids is not None:
            full = out_logits.new_full((out_logits.shape[0], n_vocab), float("-inf"))
            full[:, ids] = out_logits
            out_logits = full
    # the last pair used a guessed token: keep it queued, to redo once the real one is known
    mtp.queue_h, mtp.queue_tok = [hidden[-1:]], [tokens[-1:]]
    mtp.pos += n - 1
    return drafts, out_logits


def head_logits(model, state, hidden: Tensor, next_tokens) -> Tensor:
    """Logits [n, V] of the loaded head over the pairs (``hidden[j]``,
    ``next_tokens[j]``) at positions 0 .. n-1, from a fresh head cache
    (``state`` supplies the rotary tables and must hold n positions)."""
    net = _net(model)
    if net.mtp is None:
        raise FleError("no MTP head: load one (load_mtp) first")
    n = hidden.shape[0]
    nxt = torch.as_tensor(next_tokens, dtype=torch.long, device=hidden.device)
    if nxt.shape != (n,):
        raise FleError(f"head_logits: {n} hidden states but {tuple(nxt.shape)} next tokens")
    cache = net.mtp.new_state(n).cache
    with torch.inference_mode():
        return net.mtp(hidden, nxt, cache, torch.arange(n, device=hidden.device), state.rope_cos, state.rope_sin)


def open_head_file(path: "str | os.PathLike[str]", net, same: dict[str, int]) -> tuple[GGUFModel, Weights]:
    """Open ``path`` as an MTP head for the trunk ``net``: a trunk file
    holding block N or a head-only file, read on the trunk's device and
    dtype, its experts streamed when the trunk's are. ``same``: the
    hyperparameters that must equal the trunk's. The caller closes the file."""
    arch, n_layer = net.args.arch, net.args.n_layer
    gguf = GGUFModel.open(path)
    try:
        w = Weights(gguf, net.device, net.tok_embd.dtype, stream=getattr(net, "streamed", False))
        if gguf.arch != arch:
            raise FleError(f"{w.path}: architecture {gguf.arch!r}, the trunk is {arch!r}")
        n_all, n_mtp = int(w.hp("block_count")), int(w.hp("nextn_predict_layers", 0))
        if n_mtp < 1 or n_all - n_mtp != n_layer:
            raise FleError(f"{w.path}: block_count {n_all} with nextn_predict_layers {n_mtp} does not describe an "
                           f"MTP block after the trunk's {n_layer} layers")
        for key, want in same.items():
            if int(w.hp(key)) != want:
                raise FleError(f"{w.path}: {key} = {w.hp(key)}, the trunk has {want}; not this model's head")
        if not w.has(f"blk.{n_layer}.nextn.eh_proj.weight"):
            raise FleError(f"{w.path}: no blk.{n_layer}.nextn.eh_proj.weight; not an MTP head for this trunk")
    except BaseException:
        gguf.close()
        raise
    return gguf, w
