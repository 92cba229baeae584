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

The engine's own head step (:class:`StepDrafter`, the default where the
net has ``engine_mtp``: qwen3next and qwen4exp) drafts the same tokens
from the same queue: the head's block in the trunk's kernels on its GGUF
bytes (``Net.load_mtp_block`` / ``alloc_mtp`` / ``mtp_step``), its routed
experts resident in a :class:`~fle_engine.runtime.cache.ResidentExperts`,
one CUDA graph per call size.

Architectures: a head builder per architecture in :data:`HEADS`
(qwen3next, qwen4exp) for the eager head. Missing: the head's experts in
the engine's expert cache (the step drafter holds all of them on the
device; the eager head holds them dequantized or streams them per call).
"""
from __future__ import annotations

import copy
import dataclasses
import os
import time
from types import SimpleNamespace
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from fle_quant.errors import FleError
from fle_quant.ggml_types import GGMLType

from ..kernels import engine_ops
from ..mtp import MTPState, draft, open_head_file
from . import weights as W
from .cudacalls import capture_graph

VERIFY_MAX = 4          # tokens of the largest verify step (1 + 3 drafts)

__all__ = ["Head", "Drafter", "StepDrafter", "load_head", "load_step_head", "generate", "HEADS"]

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

    kind = "eager"

    def __init__(self, head: Head, rope_cos: Tensor, rope_sin: Tensor, max_tokens: int):
        self.mtp = head
        self.state = SimpleNamespace(mtp=head.new_state(max_tokens), rope_cos=rope_cos, rope_sin=rope_sin,
                                     max_tokens=int(max_tokens), last_logits=None, length=0)

    @property
    def nbytes(self) -> int:
        """Bytes on the device: the head's own tensors and its KV cache."""
        c = self.state.mtp.cache
        return self.mtp.nbytes + sum(t.numel() * t.element_size() for t in (c.k, c.v))

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


class StepDrafter:
    """Drafting on the engine's own head step: the net's ``mtp_step`` (the
    head's block in the trunk's kernels on its GGUF bytes, its routed
    experts resident on the device in a
    :class:`~fle_engine.runtime.cache.ResidentExperts`), with the interface
    of :class:`Drafter` and the same pairs at the same positions as
    :func:`fle_engine.mtp.draft` gives the reference head, so the same
    drafts (to rounding). A call of T rows (1 .. ``ROWS``; a longer queue,
    the prompt's, in pieces of ``ROWS``) is one CUDA graph per T and output
    table, captured on first use, with CUDA and graphs; eager otherwise.
    Between the calls of one draft only device copies run (the head's
    hidden row and draft fed to the next call); the drafts are read once,
    at the end: one host synchronisation per draft."""

    kind = "engine step"
    ROWS = 5                # the queue at a draft after a verify step: the row kept + up to VERIFY_MAX settled

    def __init__(self, net, blk, store, ops, rope_cos: Tensor, rope_sin: Tensor, max_tokens: int, k_dtype,
                 v_dtype, graphs: bool):

        self.net, self.blk, self.store, self.ops = net, blk, store, ops
        self.device = rope_cos.device
        self.cuda = self.device.type == "cuda"
        self.graphs = bool(graphs and self.cuda)
        hs = self.hs = SimpleNamespace(fast=net.fast, bufs=SimpleNamespace(), rope_cos=rope_cos, rope_sin=rope_sin)
        hs.kv = [(net.kv_cache(max_tokens, k_dtype), net.kv_cache(max_tokens, v_dtype))]
        hs.pos = torch.zeros(1, dtype=torch.int64, device=self.device)
        net.alloc_mtp(hs, self.ROWS)
        self.max_tokens = int(max_tokens)
        self._drafts = torch.zeros(VERIFY_MAX, dtype=torch.int64, device=self.device)
        self._host_pos = torch.zeros(1, dtype=torch.int64)
        self._host_toks = torch.zeros(self.ROWS, dtype=torch.int64)
        if self.cuda:
            self._host_pos, self._host_toks = self._host_pos.pin_memory(), self._host_toks.pin_memory()
        self._outputs: dict = {}          # id(vocab) -> (vocab, output matrix, its ids on the device, logits buffer)
        self._graph_of: dict = {}
        self._pool = None
        self.reset()

    @property
    def nbytes(self) -> int:
        """Bytes on the device: the block's weights and experts, its KV cache (the trunk's tables not counted)."""
        kv = sum(engine_ops.kv_nbytes(t) for t in self.hs.kv[0])
        return _block_bytes(self.blk, self.net) + self.store.nbytes + kv

    def reset(self) -> None:
        """A new sequence: nothing settled, nothing queued (the cache is overwritten by position)."""
        self.pos, self.queue_h, self.queue_tok = 0, [], []
        self.length = 0

    def push(self, hidden: Tensor, tokens: Sequence[int]) -> None:
        """The trunk's hidden rows [T, ...] of T settled positions (what the
        head reads: [T, D] on qwen3next, the wide residual [T, S, D] on
        qwen4exp) and their tokens."""
        toks = [int(t) for t in tokens]
        if hidden.shape[0] != len(toks):
            raise FleError(f"internal: {hidden.shape[0]} hidden states for {len(toks)} tokens")
        self.queue_h.append(hidden)
        self.queue_tok.extend(toks)
        self.length += len(toks)

    def _output(self, vocab):
        """(output matrix, its draft ids on the device or None, logits buffer [ROWS, rows]) for ``vocab``."""
        from . import weights as W

        key = None if vocab is None else id(vocab)
        got = self._outputs.get(key)
        if got is not None and got[0] is vocab:
            return got[1:]
        out = self.blk.output
        if vocab is None:
            got = (None, out, None, self.hs.multi.logits)
        else:
            if len(vocab) > out.n_out:
                raise FleError(f"{vocab.source}: {len(vocab)} tokens, more than the MTP head outputs ({out.n_out})")
            vocab.check(out.n_out, "the MTP head")
            ids = vocab.tensor(self.device)
            cut = W.DenseMatrix(out.name, out.qtype, out.data.index_select(0, ids).contiguous(), len(vocab), out.n_in)
            got = (vocab, cut, ids, torch.zeros(self.ROWS, len(vocab), dtype=torch.float32, device=self.device))
        self._outputs[key] = got
        return got[1:]

    def _step(self, n: int, out, ids, logits) -> None:
        with torch.inference_mode():
            self.net.mtp_step(self.blk, self.hs, self.ops, self.store, n, out, logits, ids)

    def _run(self, n: int, vocab, out, ids, logits) -> None:
        """One call of n rows: its graph replayed (captured on first use), or eagerly."""
        if not self.graphs:
            self._step(n, out, ids, logits)
            return
        key = (n, None if vocab is None else id(vocab))
        g = self._graph_of.get(key)
        if g is None:

            # the eager runs write the K/V the call itself writes; the position is put back after each
            g = capture_graph(self.device, self._pool, lambda: self._step(n, out, ids, logits),
                              lambda: self.hs.pos.sub_(n))
            self._pool = g.pool()
            self._graph_of[key] = g
        g.replay()

    def draft(self, next_token: int, n_draft: int, vocab=None) -> list[int]:
        """Up to ``n_draft`` tokens after ``next_token`` (the trunk's next
        token, not yet run), as :func:`fle_engine.mtp.draft` makes them."""
        if not self.queue_h:
            raise FleError("draft needs the trunk to have processed at least one token of this state")
        if n_draft < 1:
            raise FleError(f"n_draft must be at least 1, got {n_draft}")
        out, ids, logits = self._output(vocab)
        hs = self.hs
        hidden = torch.cat(self.queue_h) if len(self.queue_h) > 1 else self.queue_h[0]
        tokens = self.queue_tok
        nxt = tokens[1:] + [int(next_token)]
        n = len(nxt)
        self._host_pos[0] = self.pos
        hs.pos.copy_(self._host_pos, non_blocking=self.cuda)
        c = 0
        for start in range(0, n, self.ROWS):
            c = min(self.ROWS, n - start)
            if self.cuda and start:
                torch.cuda.current_stream(self.device).synchronize()      # the pinned staging is free again
            self._host_toks[:c] = torch.tensor(nxt[start:start + c], dtype=torch.int64)
            hs.toks[:c].copy_(self._host_toks[:c], non_blocking=self.cuda)
            hs.hid[:c].copy_(hidden[start:start + c])
            self._run(c, vocab, out, ids, logits)
        self._drafts[:1].copy_(hs.next_toks[c - 1:c])
        got, j = 1, c - 1
        last = self.pos + n - 1
        for i in range(1, n_draft):
            # provisional cells past the settled ones: rewritten by later drafts
            if last + i >= self.max_tokens:
                break
            hs.hid[:1].copy_(hs.head_hidden[j:j + 1])     # the head's own hidden row and draft, one position on
            hs.toks[:1].copy_(hs.next_toks[j:j + 1])
            self._run(1, vocab, out, ids, logits)
            self._drafts[i:i + 1].copy_(hs.next_toks[:1])
            got, j = got + 1, 0
        drafts = self._drafts[:got].tolist()
        # the last pair used a guessed token: keep it queued, to redo once the real one is known
        self.queue_h, self.queue_tok = [hidden[-1:]], tokens[-1:]
        self.pos += n - 1
        return drafts


def _block_bytes(blk, net) -> int:
    """Bytes of the head block's matrices and vectors on the device (shared
    storage once; the trunk's tables and final norm, which it may use, not
    counted; its experts are the store's)."""
    own = f"blk.{net.args.n_layer}."
    trunk = {id(t) for t in (getattr(net, "output_norm", None),) if t is not None}
    found: list = []

    def walk(o) -> None:
        if isinstance(o, W.DenseMatrix):
            if o.name.startswith(own):
                found.append(o)
        elif isinstance(o, Tensor):
            if id(o) not in trunk:
                found.append(W.DenseMatrix("", GGMLType.F32, o, 0, 0))
        elif isinstance(o, (list, tuple)):
            for x in o:
                walk(x)
        elif dataclasses.is_dataclass(o):
            for f in dataclasses.fields(o):
                if f.name != "layout":
                    walk(getattr(o, f.name))
        elif isinstance(o, SimpleNamespace):
            for k, v in vars(o).items():
                if k != "sources":
                    walk(v)

    walk(blk)
    return W.unique_bytes(found)


def _same_hparams(a) -> dict:
    """The hyperparameters that a head file must share with the trunk ``a`` (per architecture)."""
    if a.arch == "qwen4exp":
        from ..models.qwen4exp_mtp import same_hparams
    else:
        from ..models.qwen3next_mtp import same_hparams
    return same_hparams(a)


def load_step_head(net, path, device):
    """(the MTP block of ``path`` in the engine's form (``net.load_mtp_block``),
    its routed experts resident on ``device``) for a :class:`StepDrafter`."""
    from .cache import ResidentExperts

    gguf, _ = _open(path, net, torch.device(device), _same_hparams(net.args))
    try:
        blk = net.load_mtp_block(gguf)
        store = ResidentExperts({0: blk.layer.moe.layout}, {0: blk.sources}, net.args.n_expert, torch.device(device))
        blk.sources = None
    finally:
        gguf.close()
    return blk, store


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
    the engine's steps (``prompt_rows`` tokens per T-row step, the last
    token alone) -> (the greedy next token, the hidden rows the head reads
    [P, ...] (:func:`_hidden`), the last position's logits on the host when
    ``want_logits``)."""
    eng.reset()
    eng.cached_tokens = 0
    first = hidden = None
    if eng._use_prefill(prompt):
        first = eng._prefill_prompt(prompt, keep_hidden=True)
        if first is not None:
            hidden, eng.prefill.hidden = eng.prefill.hidden, None
    if first is None:
        rows = []
        eng._prompt_in_rows(prompt, lambda n: rows.append(_hidden(eng, n)))
        for t in prompt[eng.launched:]:
            eng._launch(t)
            rows.append(_hidden(eng, 1))               # ordered after the step on the device
            first = eng._consume()
        hidden = torch.cat(rows)
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
            if k > 0:
                dt = clock() - t0
                stats.draft_calls += 1
                stats.draft_seconds += dt
                if policy is not None:
                    policy.time_draft(len(drafts), dt)
            stats.drafted += len(drafts)
            stats._step(len(drafts))
            feed = [tok] + drafts
            size = len(feed)
            t0 = clock()
            greedy = eng.verify_step(feed)
            rows = None
            if sampler is not None:
                rows = (st.bufs.logits[:1] if size == 1 else st.multi.logits[:size]).float().cpu().numpy()
            dt = clock() - t0
            stats.verify_seconds += dt
            if policy is not None:
                policy.time_trunk(size, dt)
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
