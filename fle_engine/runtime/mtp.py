"""MTP speculative decoding on the engine: the model's MTP head drafts up
to three tokens, one verify step of the trunk checks them, the longest
agreeing prefix is kept and the rest rewound.

The head (:class:`Head`) is the reference head's block on the engine's
device in float32, run eagerly with torch operations:
:meth:`fle_engine.models.qwen3next_mtp.MTPHead.body` (its norms,
``eh_proj``, one gated-attention layer with its MoE) or
:meth:`fle_engine.models.qwen4exp_mtp.MTPHead.body` (its norms, ``eh_proj``
on the S streams, its hyper-connections around a dense QSA-shaped
attention layer and its MoE; then ``readout``, the head mixer, before the
output product, while further drafting steps read the wide residual
``body`` returns). Its embedding and
output products are the engine's matrices (the trunk's ``token_embd`` and
``output`` in their GGUF bytes, when the head file has none of its own),
so the head adds no copy of the vocabulary tables. Its routed experts are
resident (dequantized) when they take at most an eighth of the device's
memory, else streamed from the file per call (``experts``). The head has
its own KV cache of the engine's context.

Drafting is :func:`fle_engine.mtp.draft` itself, on a :class:`Drafter`
that queues what the trunk produced: the hidden rows of the positions the
trunk settled (prefill's or the decode steps' for the prompt; a verify
step's rows for its kept tokens) with their tokens -- qwen3next's post-norm
hidden state, qwen4exp's wide residual after the last layer (the net's
``mtp_hidden``; prefill's ``prefill_trunk`` keeps it) -- so
that the head is called exactly as the reference path
(:func:`fle_engine.speculative.generate_speculative`) calls it. The head's
cache needs no rollback: its cells are addressed by position and the
provisional ones of a draft are rewritten by later calls, as on the
reference path.

:func:`generate` is the loop: the trunk's token g (greedy, or sampled from
the verify step's logits with the same draws as plain decoding), drafts
d1 .. dn, ``verify_step([g, d1 .. dn])``, the drafts kept up to the first
disagreement, :meth:`~fle_engine.runtime.engine.Engine.rewind` of the rest
(the GDN states restored from the step's per-token snapshots: no trunk
call re-runs the kept tokens), then the kept rows queued for the head.
Statistics in :class:`~fle_engine.speculative.SpecStats` (a trunk call is
one verify step); ``adaptive`` picks each step's draft count with
:class:`~fle_engine.speculative.AdaptiveDraft` from measured verify-step
and drafting times (a rejection costing no settling call here).

Architectures: a head builder per architecture in :data:`HEADS`
(qwen3next, qwen4exp). Missing: the head in a CUDA graph (it runs eagerly,
with host synchronisations in its MoE) and its experts in the engine's
expert cache.
"""
from __future__ import annotations

import copy
import os
import time
from types import SimpleNamespace
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from fle_quant.errors import FleError
from fle_quant.ggml_types import GGMLType

from ..mtp import MTPState, draft, open_head_file
from . import weights as W

__all__ = ["Head", "Drafter", "load_head", "generate", "HEADS"]

RESIDENT_SHARE = 8      # head experts stay resident (dequantized) when they take at most 1/8 of the device's memory


def embed_rows(mat: W.DenseMatrix, tok: Tensor, ops) -> Tensor:
    """Rows ``tok`` (int64 [T], device) of an embedding matrix -> float32 [T, D]."""
    if mat.qtype in W.FLOAT_TYPES:
        return mat.data[tok].float()
    out = torch.empty(tok.numel() * mat.n_in, dtype=torch.float32, device=tok.device)
    ops.gather_rows(mat.data, mat.qtype, 0, tok, out)
    return out.view(tok.numel(), mat.n_in)


class _GroupedMoE(nn.Module):
    """The head's MoE with each routed expert run once for the tokens routed
    to it (:meth:`fle_engine.layers.MoE.forward_batch`), so that the head's
    first call, over the whole prompt, neither runs every expert on every
    token nor gathers a weight copy per token."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.inner = moe

    def forward(self, x: Tensor) -> Tensor:
        return self.inner.forward_batch(x)


class Head(nn.Module):
    """The engine's MTP head (see the module docstring). ``forward`` has
    the reference heads' signature (:mod:`fle_engine.mtp`) but returns the
    logits of the last pair only [1, V], the one row drafting reads: the
    head's first call covers the whole prompt, whose [P, V] product would
    be of no use."""

    def __init__(self, ref: nn.Module, embed: W.DenseMatrix, output: W.DenseMatrix, ops, impl: str):
        super().__init__()
        self.ref = ref
        owner = getattr(ref, "block", ref)          # qwen3next's MoE sits in its block, qwen4exp's in the head
        owner.moe = _GroupedMoE(owner.moe)
        self._readout = getattr(ref, "readout", None)
        self.embed, self.output_mat, self.ops, self.impl = embed, output, ops, impl
        self.n_vocab = output.n_out
        self._views: dict = {}

    @property
    def device(self) -> torch.device:
        return self.ref.eh_proj.device

    @property
    def nbytes(self) -> int:
        """Bytes on the device: the head's own tensors (the trunk's matrices it shares not counted)."""
        n = sum(p.numel() * p.element_size() for p in self.ref.parameters())
        for m in (self.embed, self.output_mat):
            if m.name.startswith("mtp."):
                n += m.nbytes
        return n

    def new_state(self, max_tokens: int) -> MTPState:
        return self.ref.new_state(max_tokens)

    def forward(self, hidden: Tensor, next_tokens: Tensor, cache, positions: Tensor, rope_cos: Tensor,
                rope_sin: Tensor, return_hidden: bool = False):
        h_out = self.ref.body(embed_rows(self.embed, next_tokens.reshape(-1), self.ops), hidden, cache, positions,
                              rope_cos, rope_sin)
        m = self.output_mat
        y = h_out[-1:] if self._readout is None else self._readout(h_out[-1:])
        logits = torch.empty(1, m.n_out, dtype=torch.float32, device=h_out.device)
        m.matvec(y.float().contiguous(), logits, self.impl)
        return (logits, h_out) if return_hidden else logits

    def with_vocab(self, vocab) -> "Head":
        """This head with its output product cut to the rows of ``vocab``'s
        tokens (a :class:`~fle_engine.draft_vocab.DraftVocab`; kept per list)."""
        view = self._views.get(id(vocab))
        if view is not None and view[0] is vocab:
            return view[1]
        if len(vocab) > self.n_vocab:
            raise FleError(f"{vocab.source}: {len(vocab)} tokens, more than the MTP head outputs ({self.n_vocab})")
        vocab.check(self.n_vocab, "the MTP head")
        m = self.output_mat
        rows = m.data.index_select(0, vocab.tensor(m.data.device)).contiguous()
        cut = copy.copy(self)
        cut.output_mat = W.DenseMatrix(m.name, m.qtype, rows, len(vocab), m.n_in)
        self._views[id(vocab)] = (vocab, cut)
        return cut


def _head_expert_bytes(gguf, il: int) -> int:
    """Bytes of layer ``il``'s routed experts dequantized to float32."""
    p = f"blk.{il}."
    return sum(int(np.prod(t.shape)) * 4 for name, t in gguf.tensors.items()
               if name.startswith(p) and name.endswith("_exps.weight"))


def _open(path, net, device, same: dict):
    """:func:`~fle_engine.mtp.open_head_file` for the engine net ``net``: the head read on ``device`` in float32."""
    probe = SimpleNamespace(args=net.args, device=device, tok_embd=SimpleNamespace(dtype=torch.float32),
                            streamed=False)
    return open_head_file(path, probe, same)


def _stream(gguf, a, device, experts: str) -> bool:
    """Whether the head's routed experts are streamed from the file (``experts``: auto, resident or stream)."""
    if experts == "auto":
        total = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
                 else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        experts = "resident" if _head_expert_bytes(gguf, a.n_layer) <= total // RESIDENT_SHARE else "stream"
    return experts == "stream"


def _qwen3next_head(path, net, device, experts: str):
    """The reference qwen3next head of ``path`` on ``device`` in float32,
    with the trunk's tables left out (the engine's are used)."""
    from ..models.qwen3next_mtp import MTPHead, same_hparams

    a = net.args
    gguf, w = _open(path, net, device, same_hparams(a))
    try:
        w.stream = _stream(gguf, a, device, experts)
        trunk = SimpleNamespace(tok_embd=None, output=None, output_norm=net.output_norm)
        ref = MTPHead(w, a, trunk)
    finally:
        gguf.close()
    ref.eval()
    return ref


def _qwen4exp_head(path, net, device, experts: str):
    """The reference qwen4exp head of ``path`` on ``device`` in float32,
    its embedding and output products left to the engine's matrices."""
    from ..models.qwen4exp_mtp import MTPHead, head_args, same_hparams

    a = net.args
    gguf, w = _open(path, net, device, same_hparams(a))
    try:
        w.stream = _stream(gguf, a, device, experts)
        ref = MTPHead(w, head_args(w, a), None, None)
    finally:
        gguf.close()
    ref.eval()
    return ref


# architecture -> builder of the reference head (path, engine net, device, experts) -> module with ``body``
# (the head between its embedding and output products; with ``readout`` when its output product reads
# another state than the one ``body`` returns and further drafting steps read), ``embed`` and ``output``
# (its own tables, or None for the engine's)
HEADS = {"qwen3next": _qwen3next_head, "qwen4exp": _qwen4exp_head}


def load_head(net, path, device, ops, fast: bool, experts: str = "auto") -> Head:
    """The MTP head in ``path`` (the trunk file holding block N, or a
    separate head file) for the engine net ``net``. ``experts``: auto,
    resident or stream."""
    arch = net.args.arch
    build = HEADS.get(arch)
    if build is None:
        raise FleError(f"MTP drafting on the engine runs {', '.join(HEADS)} files; {arch} drafts on the reference "
                       f"path (--device cpu)")
    if experts not in ("auto", "resident", "stream"):
        raise FleError(f"MTP head experts: auto, resident or stream, not {experts!r}")
    ref = build(path, net, torch.device(device), experts)
    a = net.args
    embed, output = net.tok_embd, net.output
    if ref.embed is not None:        # the head's own tables
        embed = W.DenseMatrix("mtp.embed", GGMLType.F32, ref.embed.detach().float(), a.n_vocab, a.n_embd)
    if ref.output is not None:
        output = W.DenseMatrix("mtp.output", GGMLType.F32, ref.output.detach().float(), a.n_vocab, a.n_embd)
    return Head(ref, embed, output, ops, "triton" if fast else "reference")


class Drafter:
    """The head and its sequence state, in the shape that
    :func:`fle_engine.mtp.draft` takes (``mtp`` the head; ``state`` with the
    head's :class:`~fle_engine.mtp.MTPState`, the rotary tables and the
    context size)."""

    def __init__(self, head: Head, rope_cos: Tensor, rope_sin: Tensor, max_tokens: int):
        self.mtp = head
        self.state = SimpleNamespace(mtp=head.new_state(max_tokens), rope_cos=rope_cos, rope_sin=rope_sin,
                                     max_tokens=int(max_tokens), last_logits=None, length=0)

    def reset(self) -> None:
        """A new sequence: nothing settled, nothing queued (the cache is overwritten by position)."""
        m = self.state.mtp
        m.pos, m.queue_h, m.queue_tok = 0, [], []
        self.state.length = 0

    def push(self, hidden: Tensor, tokens: Sequence[int]) -> None:
        """The trunk's hidden rows [T, ...] of T settled positions (what the head reads) and their tokens."""
        tok = torch.as_tensor([int(t) for t in tokens], dtype=torch.long, device=hidden.device)
        if hidden.shape[0] != tok.shape[0]:
            raise FleError(f"internal: {hidden.shape[0]} hidden states for {tok.shape[0]} tokens")
        self.state.mtp.push(hidden, tok)
        self.state.length += tok.shape[0]

    def draft(self, next_token: int, n_draft: int, vocab=None) -> list[int]:
        """Up to ``n_draft`` tokens after ``next_token`` (the trunk's next
        token, not yet run), as :func:`fle_engine.mtp.draft` makes them."""
        return [int(t) for t in draft(self, self.state, next_token=next_token, n_draft=n_draft, vocab=vocab)[0]]


def _hidden(eng, n: int) -> Tensor:
    """The hidden rows that the head reads of the step that just ran (T =
    ``n``), copied: the net's ``mtp_hidden(state, n)`` when it defines one
    (qwen4exp: the wide residual [T, S, D]), else the post-norm rows
    (qwen3next)."""
    st = eng.state
    hook = getattr(eng.net, "mtp_hidden", None)
    if hook is not None:
        return hook(st, n).float().clone()
    return (st.bufs.xn[:1] if n == 1 else st.multi.xn[:n]).float().clone()


def _prompt(eng, prompt: list, want_logits: bool) -> tuple[int, Tensor, "np.ndarray | None"]:
    """The prompt from position 0: prefill (when the engine would use it) or
    decode steps one at a time -> (the greedy next token, the hidden rows
    the head reads [P, ...] (:func:`_hidden`), the last position's logits on
    the host when ``want_logits``)."""
    eng.reset()
    eng.cached_tokens = 0
    first = hidden = None
    if eng._use_prefill(prompt):
        first = eng._prefill_prompt(prompt, keep_hidden=True)
        if first is not None:
            hidden, eng.prefill.hidden = eng.prefill.hidden, None
    if first is None:
        for i, t in enumerate(prompt):
            eng._launch(t)
            row = _hidden(eng, 1)[0]                   # ordered after the step on the device
            if hidden is None:
                hidden = torch.empty(len(prompt), *row.shape, dtype=torch.float32, device=eng.device)
            hidden[i].copy_(row)
            first = eng._consume()
    logits = eng.state.bufs.logits[0].float().cpu().numpy() if want_logits else None
    return first, hidden, logits


def generate(eng, prompt: Sequence[int], n_predict: int, stop: Iterable[int] = (), n_draft: int = 2,
             sampler=None, stats=None, vocab=None, adaptive=None) -> Iterator[int]:
    """Up to ``n_predict`` tokens after ``prompt`` from the engine ``eng``
    (made with ``mtp``), drafting up to ``n_draft`` (at most
    ``VERIFY_MAX - 1``) tokens ahead with its MTP head and checking them in
    one verify step; the same tokens as plain decoding (greedy; with
    ``sampler``, the same draws in the same order). ``stats``: a
    :class:`~fle_engine.speculative.SpecStats`; ``vocab``: a draft
    vocabulary; ``adaptive``: True or an
    :class:`~fle_engine.speculative.AdaptiveDraft` (its ``n_max``).

    Each step's tokens are yielded after the step is settled (rewound and
    queued for the head), so between two steps the engine holds exactly
    the tokens yielded so far, the last one not yet run."""
    from ..speculative import AdaptiveDraft, SpecStats
    from .engine import VERIFY_MAX

    drafter = getattr(eng, "drafter", None)
    if drafter is None:
        raise FleError("the engine has no MTP head: make it with mtp=True (the head inside the model file) or "
                       "mtp=HEAD_FILE")
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise FleError("the prompt is empty; generation needs at least one token to start from")
    if len(prompt) >= eng.ctx_size:
        raise FleError(f"the prompt has {len(prompt)} tokens; the context holds {eng.ctx_size}")
    if n_predict < 1:
        raise FleError(f"the number of tokens to generate must be at least 1, got {n_predict}")
    policy = AdaptiveDraft(n_draft, resettle=False) if adaptive is True else (adaptive or None)
    n_max = policy.n_max if policy is not None else int(n_draft)
    if not 1 <= n_max <= VERIFY_MAX - 1:
        raise FleError(f"the engine drafts 1 to {VERIFY_MAX - 1} tokens ahead (its verify step takes up to "
                       f"{VERIFY_MAX} tokens), not {n_max}; lower --draft-max")
    n_predict = min(int(n_predict), eng.ctx_size - len(prompt))
    stop = frozenset(int(t) for t in stop)
    stats = stats if stats is not None else SpecStats()
    clock = time.perf_counter
    st = eng.state
    t_start = clock()
    t_first = None
    n = 0
    try:
        first, hidden, logits = _prompt(eng, prompt, sampler is not None)
        drafter.reset()
        drafter.push(hidden, prompt)
        tok = first if sampler is None else int(sampler(logits))
        t_first = clock()
        n = 1
        eng.length = len(prompt) + 1
        yield tok
        while tok not in stop and n < n_predict:
            # a check of k drafts emits up to k + 1 tokens: draft no more than are still wanted
            k = min(policy.choose() if policy is not None else n_max, n_predict - n - 1)
            t0 = clock()
            drafts = drafter.draft(tok, k, vocab) if k > 0 else []
            if policy is not None:
                policy.time_draft(len(drafts), clock() - t0)
            stats.drafted += len(drafts)
            stats._step(len(drafts))
            feed = [tok] + drafts
            size = len(feed)
            t0 = clock()
            greedy = eng.verify_step(feed)
            rows = None
            if sampler is not None:
                rows = (st.bufs.logits[:1] if size == 1 else st.multi.logits[:size]).float().cpu().numpy()
            if policy is not None:
                policy.time_trunk(size, clock() - t0)
            stats.trunk_calls += 1
            hid = _hidden(eng, size)
            out, checks = [], []
            for i in range(size):
                u = greedy[i] if rows is None else int(sampler(rows[i]))
                out.append(u)
                if i < len(drafts):
                    checks.append(u == drafts[i])
                    stats._check(i, checks[-1])
                    if checks[-1] and u not in stop and n + len(out) < n_predict:
                        continue
                break
            accepted = len(out) - 1
            stats.accepted += accepted
            if policy is not None:
                policy.observe(checks)
            kept = accepted + 1
            if kept < size:
                eng.rewind(size - kept)
            if size > 1:                   # a one-token step kept its token in the history itself
                eng.history.extend(feed[:kept])
            drafter.push(hid[:kept], feed[:kept])
            for u in out:
                n += 1
                eng.length = len(prompt) + n
                yield u
            tok = out[-1]
    finally:
        t_end = clock()
        t_first = t_first or t_end
        eng.stats.prompt_tokens += len(prompt)
        eng.stats.prompt_seconds += t_first - t_start
        eng.stats.gen_tokens += max(0, n - 1)
        eng.stats.gen_seconds += t_end - t_first
