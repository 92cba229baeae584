"""qwen4exp (Qwen3.8-Flash-Next): a wide residual of ``hc`` streams mixed by
hyper-connections (HC) in place of every layer norm; gated delta net (GDN)
layers with a sigmoid output gate; every ``full_attention_interval``-th
layer gated GQA attention restricted by QSA (a block indexer picks the
blocks of keys each query attends to); a hashed n-gram embedding (PLE)
added to the wide residual on one GDN layer; in every layer a routed MoE
plus a shared expert behind a one-scalar sigmoid gate. The MTP draft head
lives in :mod:`fle_engine.models.qwen4exp_mtp`.

The semantics follow transformers 5.23.0 (``models/qwen4_exp``), the model
authors' code, wherever it and llama.cpp's ``src/models/qwen4exp.cpp``
differ; ``docs/qwen4exp.md`` lists the differences and how each was shown.
Tensor names, stored forms and hyperparameter keys are llama.cpp's (what
its converter writes):

- HC read (``hc_{attn,ffn}_*``, and ``output_hc_*`` before the head):
  xn = per-stream RMSNorm times the [hc * n_embd] gamma; g = up(silu(down
  xn / hc)); block input = mean over streams of xn * sigmoid(g); inject =
  W_inject xn. HC write: stream s += 2 sigmoid(inject_s / hc) * block out.
- GDN: as qwen3next but with separate ``ssm_beta`` / ``ssm_alpha``, an
  output gate sigmoid(z), and V head j reading K head j mod n_k (the
  converter reorders the V heads to tiled order).
- QSA: raw indexer keys are cached per token; a block of ``compress_ratio``
  positions is pooled (mean), RMS-normed, rotated at its first position;
  block score = sum over indexer heads of relu(q_h . k_blk); a query keeps
  the ``top_k / ratio`` best complete blocks plus its incomplete tail
  block, intersected with the causal mask.
- PLE (``blk.L.ple_*``, ``per_layer_token_embd``): an n-gram hash of the
  token and its predecessors (an EOS in the window cuts it; missing
  predecessors read as EOS) picks one row per head; gated per stream by a
  key/query dot product; plus a dilated causal conv (dilation
  ``ple.ngram_size``) over the normed gated values.

Shape legend: T tokens of this call, S streams (hc), D model width, P cache
capacity, NB = ceil(P / ratio) index blocks, Hi/Di indexer heads/width.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fle_quant.errors import FleError

from .. import layers as L
from ..loader import Weights
from . import qwen3moe, qwen3next
from .qwen3moe import advance, common_hparams, load_qkv, param
from .qwen3next import hybrid_hparams

ARCH = "qwen4exp"


@dataclass(frozen=True)
class ModelArgs(qwen3next.ModelArgs):
    # n_layer: trunk layers (block_count minus the MTP blocks); recurrent:
    # per block, MTP blocks included
    n_mtp: int             # nextn_predict_layers
    hc: int
    hc_rank: int
    idx_heads: int
    idx_dim: int
    idx_top_k: int
    compress: tuple[int, ...]   # per layer (MTP blocks included); 0 = dense attention
    ple_layer: int              # -1 without PLE
    ple_ngram: int
    ple_heads_per_ngram: int
    ple_conv_kernel: int
    ple_eos: int
    ple_head_dim: int
    ple_multipliers: tuple[int, ...]
    ple_offsets: tuple[int, ...]
    ple_vocab_sizes: tuple[int, ...]

    @property
    def ple_heads(self) -> int:
        return (self.ple_ngram - 1) * self.ple_heads_per_ngram

    @property
    def ple_hist(self) -> int:
        """Rows of the PLE conv history: (kernel - 1) * dilation."""
        return (self.ple_conv_kernel - 1) * self.ple_ngram

    @classmethod
    def from_weights(cls, w: Weights) -> "ModelArgs":
        c = common_hparams(w, ARCH)
        n_embd, head_dim = c["n_embd"], c["head_dim"]
        n_all = int(w.hp("block_count"))
        n_mtp = int(w.hp("nextn_predict_layers", 0))
        n_layer = n_all - n_mtp
        recurrent = w.hp("attention.recurrent_layers", None)
        if recurrent is None:
            interval = int(w.hp("full_attention_interval", 4))
            recurrent = [(il + 1) % interval != 0 for il in range(n_all)]
        recurrent = [bool(r) for r in recurrent]
        if len(recurrent) < n_layer:
            raise FleError(f"{w.path}: attention.recurrent_layers has {len(recurrent)} entries, "
                           f"block_count needs {n_layer}")
        compress = [int(c) for c in w.hp("attention.compress_ratios", [0] * n_all)]
        compress += [0] * (n_all - len(compress))
        n_rot = int(w.hp("rope.dimension_count", head_dim))
        idx_dim = int(w.hp("attention.indexer.key_length"))
        if n_rot % 2 or n_rot > min(head_dim, idx_dim):
            raise FleError(f"{w.path}: rope.dimension_count = {n_rot} must be even and fit the attention "
                           f"({head_dim}) and indexer ({idx_dim}) heads")
        hc = int(w.hp("hyper_connection.count"))
        if hc < 2:
            raise FleError(f"{w.path}: hyper_connection.count must be at least 2, got {hc}")
        ple_layers = list(w.hp("ple.layers", []) or [])
        if len(ple_layers) > 1:
            raise FleError(f"{w.path}: ple.layers lists {len(ple_layers)} layers; {ARCH} supports one")
        ple = dict(ple_layer=-1, ple_ngram=0, ple_heads_per_ngram=0, ple_conv_kernel=0, ple_eos=-1,
                   ple_head_dim=0, ple_multipliers=(), ple_offsets=(), ple_vocab_sizes=())
        if ple_layers:
            il = int(ple_layers[0])
            if not 0 <= il < n_layer or not recurrent[il]:
                raise FleError(f"{w.path}: PLE layer {il} must be a GDN layer of the trunk")
            ngram, per = int(w.hp("ple.ngram_size")), int(w.hp("ple.heads_per_ngram"))
            n_heads = (ngram - 1) * per
            mult = [int(m) for m in w.hp("ple.layer_multipliers")]
            offs = [int(o) for o in w.hp("ple.head_offsets")]
            sizes = [int(s) for s in w.hp("ple.head_vocab_sizes")]
            if ngram < 2 or len(mult) < ngram or len(offs) < n_heads or len(sizes) < n_heads:
                raise FleError(f"{w.path}: the PLE hash keys need ngram_size >= 2, {ngram} multipliers and "
                               f"{n_heads} head offsets and vocabulary sizes")
            head_dim_ple = int(w.hp("embedding_length_per_layer_input"))
            if head_dim_ple * n_heads != n_embd:
                raise FleError(f"{w.path}: embedding_length_per_layer_input * PLE heads must equal "
                               f"embedding_length ({n_embd}); ple_value maps the gathered rows from that width")
            ple = dict(ple_layer=il, ple_ngram=ngram, ple_heads_per_ngram=per,
                       ple_conv_kernel=int(w.hp("ple.conv_kernel")), ple_eos=int(w.hp("ple.eos_token_id")),
                       ple_head_dim=head_dim_ple, ple_multipliers=tuple(mult[:ngram]),
                       ple_offsets=tuple(offs[:n_heads]), ple_vocab_sizes=tuple(sizes[:n_heads]))
        return cls(
            arch=ARCH, n_layer=n_layer, n_mtp=n_mtp, n_rot=n_rot, recurrent=tuple(recurrent), hc=hc,
            hc_rank=int(w.hp("hyper_connection.low_rank")), idx_heads=int(w.hp("attention.indexer.head_count")),
            idx_dim=idx_dim, idx_top_k=int(w.hp("attention.indexer.top_k")), compress=tuple(compress),
            **c, **hybrid_hparams(w, head_dim, c["n_ff_exp"]), **ple)


@dataclass
class Ablation:
    """Components to switch off, for tests that show each one matters:
    ``ple`` (skip the n-gram embedding), ``inject`` (HC write weights 1, a
    plain residual add on every stream), ``qsa`` (dense causal attention on
    QSA layers), ``shared_expert`` (drop the gated shared expert)."""
    ple: bool = False
    inject: bool = False
    qsa: bool = False
    shared_expert: bool = False


# ---------------------------------------------------------------------------
# state


@dataclass
class QSACache(L.AttnCache):
    """An attention layer's keys and values plus the raw (un-normed,
    un-rotated) indexer key of every position, ``idx`` [P, Di]."""
    idx: Tensor | None = None


@dataclass
class PLEState:
    """``tokens`` [ngram - 1] int64: the last tokens of the sequence, oldest
    first (EOS before the start: a missing predecessor reads as EOS);
    ``conv`` [(kernel - 1) * ngram, S * D]: the normed gated values of the
    last positions, the history of the dilated conv."""
    tokens: Tensor
    conv: Tensor


@dataclass
class State(L.State):
    """:class:`fle_engine.layers.State` plus the PLE history; ``hidden`` is
    the wide residual [T, S, D] of the last call's tokens, what the MTP head
    reads."""
    ple: PLEState | None = None


# ---------------------------------------------------------------------------
# building blocks


def grouped_rms(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm of each stream of ``x`` [..., S, D] times the [S, D] gamma."""
    return L.rms_norm(x, weight, eps)


class HCMixer(nn.Module):
    """One hyper-connection read: the block input from the S streams, and
    (with ``inject``) the S write weights 2 sigmoid(W_inject xn / S)."""

    def __init__(self, w: Weights, prefix: str, a: ModelArgs, inject: bool):
        super().__init__()
        s, d, r = a.hc, a.n_embd, a.hc_rank
        self.norm = param(w.get(prefix + "norm.weight", (s * d,)).view(s, d))
        self.down = param(w.get(prefix + "down.weight", (r, s * d)))
        self.up = param(w.get(prefix + "up.weight", (s * d, r)))
        self.inject = param(w.get(prefix + "inject.weight", (s, s * d))) if inject else None
        self.s, self.eps = s, a.eps

    def forward(self, res: Tensor) -> tuple[Tensor, Tensor | None]:
        n_tok = res.shape[0]
        xn = grouped_rms(res, self.norm, self.eps)                       # [T, S, D]
        flat = xn.reshape(n_tok, -1)
        gate = F.linear(F.silu(F.linear(flat, self.down) / self.s), self.up).view_as(xn)
        mixed = (xn * torch.sigmoid(gate)).mean(1)                        # [T, D]
        if self.inject is None:
            return mixed, None
        weights = 2.0 * torch.sigmoid(F.linear(flat, self.inject) / self.s)   # [T, S]
        return mixed, weights


def hc_write(res: Tensor, out: Tensor, weights: Tensor, plain: bool) -> Tensor:
    """Stream s += weights_s * out ([T, S, D] += [T, S, 1] * [T, 1, D]);
    ``plain`` (an ablation) adds ``out`` to every stream unweighted."""
    if plain:
        return res + out[:, None, :]
    return res + weights[..., None] * out[:, None, :]


def load_moe(w: Weights, il: int, a: ModelArgs) -> L.MoE:
    """Router, stacked experts and the sigmoid-gated shared expert of block ``il``."""
    return qwen3moe.load_moe(w, il, a.n_embd, a.n_expert, a.n_expert_used, a.n_ff_exp, a.expert_weights_scale,
                             shared=True, n_ff_shexp=a.n_ff_shexp)


def dilated_causal_conv(x: Tensor, history: Tensor, weight: Tensor, dilation: int) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv with taps ``dilation`` apart: ``x`` [T, C],
    ``history`` [(K-1) * dilation, C] (the inputs before ``x``, oldest
    first), ``weight`` [C, K] with tap K-1 on the current token and tap k on
    the input (K-1-k) * dilation positions back. Returns (y [T, C], new
    history)."""
    n_tok, n_hist = x.shape[0], history.shape[0]
    full = torch.cat([history.to(x.dtype), x], 0)                       # [hist + T, C]
    y = torch.zeros_like(x)
    k_taps = weight.shape[1]
    for k in range(k_taps):                                             # static loop over taps
        start = n_hist - (k_taps - 1 - k) * dilation
        y = y + full[start:start + n_tok] * weight[:, k]
    return y, full[full.shape[0] - n_hist:]


# ---------------------------------------------------------------------------
# mixers


class GatedDeltaNet(nn.Module):
    """GDN with separate beta/alpha projections, tiled V->K heads and a
    sigmoid output gate; chunked rule for several tokens, recurrent for one."""

    def __init__(self, w: Weights, il: int, a: ModelArgs):
        super().__init__()
        p = f"blk.{il}."
        dk, nv = a.d_state, a.n_v_heads
        self.wqkv = param(w.get(p + "attn_qkv.weight", (a.conv_dim, a.n_embd)))
        self.wz = param(w.get(p + "attn_gate.weight", (dk * nv, a.n_embd)))
        self.wb = param(w.get(p + "ssm_beta.weight", (nv, a.n_embd)))
        self.wa = param(w.get(p + "ssm_alpha.weight", (nv, a.n_embd)))
        self.conv = param(w.get(p + "ssm_conv1d.weight", (a.conv_dim, a.conv_kernel)))
        self.dt_bias = param(w.get(p + "ssm_dt.bias", (nv,)))
        self.ssm_a = param(w.get(p + "ssm_a", (nv,)))                  # -exp(A_log)
        self.norm = param(w.get(p + "ssm_norm.weight", (dk,)))
        self.wout = param(w.get(p + "ssm_out.weight", (a.n_embd, dk * nv)))
        self.a = a

    def forward(self, x: Tensor, state: L.GDNState) -> Tensor:
        return self.forward_batch(x, [x.shape[0]], [state])

    def forward_batch(self, x: Tensor, sizes: list[int], states: list[L.GDNState]) -> Tensor:
        """Several sequences' tokens ``x`` (concatenated, ``sizes`` each):
        projections, norms and gates on all of them at once, the causal conv
        and the delta rule per sequence on its own state, or, for one new
        token each with states that are rows of one pool
        (:func:`~fle_engine.layers.stacked`), for all at once."""
        a = self.a
        n_tok, dk, nk, nv = x.shape[0], a.d_state, a.n_k_heads, a.n_v_heads
        z = F.linear(x, self.wz).view(n_tok, nv, dk)
        beta = torch.sigmoid(F.linear(x, self.wb))                      # [T, Hv]
        g = F.softplus(F.linear(x, self.wa) + self.dt_bias) * self.ssm_a
        pooled = L.stacked_fields(states, ("conv", "ssm")) if L.one_token_each(sizes) else None
        if pooled is not None:
            conv = L.conv_step_rows(F.linear(x, self.wqkv), pooled[0], self.conv)
        else:
            convs = []
            for xi, st in zip(F.linear(x, self.wqkv).split(sizes), states):
                c, new_conv = L.causal_conv1d(xi, st.conv, self.conv)
                st.conv.copy_(new_conv)
                convs.append(c)
            conv = convs[0] if len(convs) == 1 else torch.cat(convs)
        conv = F.silu(conv)
        q = conv[:, :dk * nk].view(n_tok, nk, dk)
        k = conv[:, dk * nk:2 * dk * nk].view(n_tok, nk, dk)
        v = conv[:, 2 * dk * nk:].view(n_tok, nv, dk)
        # V head j reads K head j mod n_k: the converter stores V heads in tiled order
        q = L.l2_norm(q, a.eps).repeat(1, nv // nk, 1)
        k = L.l2_norm(k, a.eps).repeat(1, nv // nk, 1)
        if pooled is not None:
            o = L.gdn_step_rows(q, k, v, g, beta, pooled[1])
        else:
            outs = []
            for qi, ki, vi, gi, bi, st in zip(q.split(sizes), k.split(sizes), v.split(sizes), g.split(sizes),
                                              beta.split(sizes), states):
                rule = L.gdn_recurrent if qi.shape[0] == 1 else L.gdn_chunked
                o, s = rule(qi, ki, vi, gi, bi, st.ssm)
                st.ssm.copy_(s)
                outs.append(o)
            o = outs[0] if len(outs) == 1 else torch.cat(outs)
        o = L.rms_norm(o.to(x.dtype), self.norm, a.eps) * torch.sigmoid(z)
        return F.linear(o.reshape(n_tok, nv * dk), self.wout)


class QSAttention(nn.Module):
    """Gated GQA attention (q and gate interleaved per head in ``attn_q``,
    per-head q/k RMSNorm, partial NEOX rotary) over the cells the block
    indexer selects; dense when the layer's compress ratio is 0."""

    def __init__(self, w: Weights, il: int, a: ModelArgs):
        super().__init__()
        p = f"blk.{il}."
        hd = a.head_dim
        wq, wk, wv = load_qkv(w, p, 2 * a.n_head * hd, a.n_head_kv * hd, a.n_embd)
        self.wq, self.wk, self.wv = param(wq), param(wk), param(wv)
        self.wo = param(w.get(p + "attn_output.weight", (a.n_embd, a.n_head * hd)))
        self.q_norm = param(w.get(p + "attn_q_norm.weight", (hd,)))
        self.k_norm = param(w.get(p + "attn_k_norm.weight", (hd,)))
        self.ratio = a.compress[il]
        if self.ratio:
            hi, di = a.idx_heads, a.idx_dim
            self.idx_q = param(w.get(p + "indexer.q_proj.weight", (hi * di, a.n_embd)))
            self.idx_k = param(w.get(p + "indexer.k_proj.weight", (di, a.n_embd)))
            self.idx_q_norm = param(w.get(p + "indexer.q_norm.weight", (di,)))
            self.idx_k_norm = param(w.get(p + "indexer.k_norm.weight", (di,)))
            self.n_blocks_kept = max(1, a.idx_top_k // self.ratio)
        self.a = a
        self.dense = False   # ablation: ignore the indexer

    def block_scores(self, x: Tensor, cache: QSACache, positions: Tensor, cos: Tensor, sin: Tensor,
                     tab_cos: Tensor, tab_sin: Tensor) -> Tensor:
        """Indexer score of every block for every query, [T, NB] float32;
        -inf where the block is not complete at the query (the block
        holding the query is its tail). Writes the raw indexer keys."""
        cache.idx.index_copy_(0, positions, F.linear(x, self.idx_k).to(cache.idx.dtype))
        return self._scores(x, cache.idx, positions, cos, sin, tab_cos, tab_sin)

    def _scores(self, x: Tensor, idx: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, tab_cos: Tensor,
                tab_sin: Tensor) -> Tensor:
        """:meth:`block_scores` from the raw indexer keys ``idx``: [P, Di],
        one sequence's, which all T queries read, or [T, P, Di], each
        query's own sequence's (a batched decode step)."""
        a, r = self.a, self.ratio
        n_tok, n_pos = x.shape[0], idx.shape[-2]
        n_blk = -(-n_pos // r)
        raw = F.pad(idx, (0, 0, 0, n_blk * r - n_pos)).reshape(*idx.shape[:-2], n_blk, r, a.idx_dim)
        pooled = L.rms_norm(raw.float().mean(-2), self.idx_k_norm, a.eps)       # [..., NB, Di]
        starts = torch.arange(n_blk, device=x.device) * r                # < P: every block starts inside the cache
        kb = L.apply_rope_neox(pooled[..., None, :], tab_cos[starts], tab_sin[starts])[..., 0, :]
        q = F.linear(x, self.idx_q).view(n_tok, a.idx_heads, a.idx_dim)
        q = L.apply_rope_neox(L.rms_norm(q, self.idx_q_norm, a.eps), cos, sin)
        rule = "thd,bd->thb" if idx.dim() == 2 else "thd,tbd->thb"
        score = torch.relu(torch.einsum(rule, q.float(), kb.float())).sum(1)            # [T, NB]
        n_complete = torch.div(positions + 1, r, rounding_mode="floor")               # [T]
        complete = torch.arange(n_blk, device=x.device)[None, :] < n_complete[:, None]
        return score.masked_fill(~complete, float("-inf"))

    def select(self, x: Tensor, cache: QSACache, positions: Tensor, cos: Tensor, sin: Tensor,
               tab_cos: Tensor, tab_sin: Tensor) -> Tensor:
        """Cells each query may attend to, [T, P] bool (causal included)."""
        score = self.block_scores(x, cache, positions, cos, sin, tab_cos, tab_sin)
        return self._keep(score, positions, cache.k.shape[1])

    def _keep(self, score: Tensor, positions: Tensor, n_pos: int) -> Tensor:
        """:meth:`select`'s cells [T, P] from the block scores [T, NB]."""
        r = self.ratio
        n_tok, n_blk = score.shape
        slots = torch.arange(n_pos, device=score.device)
        causal = slots[None, :] <= positions[:, None]
        n_complete = torch.div(positions + 1, r, rounding_mode="floor")
        tail = slots[None, :] >= (n_complete * r)[:, None]
        # relu makes exact ties (score 0) common; a stable sort breaks them
        # towards the earlier block, so the choice never depends on the
        # sorting algorithm (transformers leaves it to torch.topk)
        top, which = torch.sort(score, dim=-1, descending=True, stable=True)
        k = min(self.n_blocks_kept, n_blk)
        chosen = torch.zeros(n_tok, n_blk, dtype=torch.bool, device=score.device)
        chosen = chosen.scatter(1, which[:, :k], top[:, :k] > float("-inf"))
        return (chosen[:, slots // r] | tail) & causal

    def forward(self, x: Tensor, cache: QSACache, positions: Tensor, cos: Tensor, sin: Tensor,
                tab_cos: Tensor, tab_sin: Tensor) -> Tensor:
        return self.forward_batch(x, [x.shape[0]], [cache], [(positions, cos, sin)], [(tab_cos, tab_sin)])

    def forward_batch(self, x: Tensor, sizes: list[int], caches: list, rots: list, tabs: list) -> Tensor:
        """Several sequences' tokens ``x`` (concatenated, ``sizes`` each):
        projections, norms, rotary and the output gate on all of them at
        once; the indexer's selection and the attention per sequence
        against its cache, or, for one new token each with caches that are
        rows of one pool (:func:`~fle_engine.layers.stacked`) and one
        rotary table, for all at once (:meth:`_decode_rows`). ``rots[i]`` =
        (positions, cos, sin) of sequence i's new tokens, ``tabs[i]`` = its
        whole rotary table (cos, sin)."""
        a = self.a
        n_tok, hd = x.shape[0], a.head_dim
        cos, sin = L.rot_cat(rots, 1), L.rot_cat(rots, 2)
        qg = F.linear(x, self.wq).view(n_tok, a.n_head, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:]
        k = F.linear(x, self.wk).view(n_tok, a.n_head_kv, hd)
        v = F.linear(x, self.wv).view(n_tok, a.n_head_kv, hd)
        q = L.apply_rope_neox(L.rms_norm(q, self.q_norm, a.eps), cos, sin)
        k = L.apply_rope_neox(L.rms_norm(k, self.k_norm, a.eps), cos, sin)
        pooled = None
        if L.one_token_each(sizes) and all(t[0].shape == tabs[0][0].shape for t in tabs):
            pooled = L.stacked_fields(caches, ("k", "v", "idx") if self.ratio else ("k", "v"))
        if pooled is not None:
            out = self._decode_rows(x, q, k, v, pooled, L.rot_cat(rots, 0), cos, sin, *tabs[0])
        else:
            outs = []
            for xi, qi, ki, vi, cache, (positions, ci, si), (tab_cos, tab_sin) in zip(
                    x.split(sizes), q.split(sizes), k.split(sizes), v.split(sizes), caches, rots, tabs):
                if self.ratio and not self.dense:
                    keep = self.select(xi, cache, positions, ci, si, tab_cos, tab_sin)
                else:
                    if self.ratio:   # keep the indexer cache current so the ablation can be switched per call
                        cache.idx.index_copy_(0, positions, F.linear(xi, self.idx_k).to(cache.idx.dtype))
                    slots = torch.arange(cache.k.shape[1], device=x.device)
                    keep = slots[None, :] <= positions[:, None]
                outs.append(masked_attention(qi, ki, vi, cache, positions, keep, a.attn_scale))
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
        out = out * torch.sigmoid(gate.reshape(n_tok, a.n_head * hd))
        return F.linear(out, self.wo)

    def _decode_rows(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pooled: tuple, positions: Tensor,
                     cos: Tensor, sin: Tensor, tab_cos: Tensor, tab_sin: Tensor) -> Tensor:
        """The selection and attention of S sequences' one new token each
        (``q`` [S, H, Dh], ``k``, ``v`` [S, Hkv, Dh], at ``positions`` [S])
        against their caches, the rows of one pool (``pooled`` = keys and
        values [S, Hkv, P, Dh], and the indexer keys [S, P, Di] on a QSA
        layer): one write, one indexer score, one score product and one
        softmax for all, each row under its own mask. Returns [S, H * Dh]."""
        a = self.a
        kp, vp = pooled[0], pooled[1]
        n_seq, n_head, dh = q.shape
        n_kv, n_pos = kp.shape[1], kp.shape[2]
        rows = torch.arange(n_seq, device=x.device)
        if self.ratio:
            idx = pooled[2]
            idx.index_put_((rows, positions), F.linear(x, self.idx_k).to(idx.dtype))
        if self.ratio and not self.dense:
            keep = self._keep(self._scores(x, idx, positions, cos, sin, tab_cos, tab_sin), positions, n_pos)
        else:
            keep = torch.arange(n_pos, device=x.device)[None, :] <= positions[:, None]
        kp.transpose(1, 2).index_put_((rows, positions), k.to(kp.dtype))        # [S, P, Hkv, Dh] view
        vp.transpose(1, 2).index_put_((rows, positions), v.to(vp.dtype))
        qh = q.reshape(n_seq, n_kv, n_head // n_kv, dh).to(kp.dtype)            # [S, Hkv, G, Dh]
        scores = torch.matmul(qh, kp.transpose(-1, -2)).float() * a.attn_scale  # [S, Hkv, G, P]
        probs = torch.softmax(scores.masked_fill(~keep[:, None, None, :], float("-inf")), dim=-1).to(vp.dtype)
        out = torch.matmul(probs, vp)                                           # [S, Hkv, G, Dh]
        return out.reshape(n_seq, n_head * dh).to(q.dtype)


def masked_attention(q: Tensor, k: Tensor, v: Tensor, cache: L.AttnCache, positions: Tensor, keep: Tensor,
                     scale: float) -> Tensor:
    """GQA attention of T queries over the P cache cells that ``keep``
    [T, P] allows; the new keys/values are written at ``positions`` first.
    Query head h reads KV head h // (H / Hkv). Returns [T, H * Dh]."""
    cache.k.index_copy_(1, positions, k.transpose(0, 1).to(cache.k.dtype))
    cache.v.index_copy_(1, positions, v.transpose(0, 1).to(cache.v.dtype))
    n_tok, n_head, dh = q.shape
    n_kv = cache.k.shape[0]
    qh = q.reshape(n_tok, n_kv, n_head // n_kv, dh).permute(1, 2, 0, 3).to(cache.k.dtype)   # [Hkv, G, T, Dh]
    scores = torch.matmul(qh, cache.k[:, None].transpose(-1, -2)).float() * scale            # [Hkv, G, T, P]
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1).to(cache.v.dtype)
    out = torch.matmul(probs, cache.v[:, None])                                               # [Hkv, G, T, Dh]
    return out.permute(2, 0, 1, 3).reshape(n_tok, n_head * dh).to(q.dtype)


class PLE(nn.Module):
    """The hashed n-gram embedding of one layer, added to the wide residual."""

    def __init__(self, w: Weights, il: int, a: ModelArgs, table: Tensor):
        super().__init__()
        p = f"blk.{il}."
        s, d = a.hc, a.n_embd
        self.table = table                                              # [rows, Dp], shared with the Transformer
        self.key = param(w.get(p + "ple_key.weight", (s * d, d)))
        self.value = param(w.get(p + "ple_value.weight", (d, d)))
        self.norm_key = param(w.get(p + "ple_norm_key.weight", (s * d,)).view(s, d))
        self.norm_query = param(w.get(p + "ple_norm_query.weight", (s * d,)).view(s, d))
        self.norm_conv = param(w.get(p + "ple_norm_conv.weight", (s * d,)).view(s, d))
        self.conv = param(w.get(p + "ple_conv1d.weight", (s * d, a.ple_conv_kernel)))
        dev = self.key.device
        self.register_buffer("mult", torch.tensor(a.ple_multipliers, dtype=torch.long, device=dev), persistent=False)
        self.register_buffer("offsets", torch.tensor(a.ple_offsets, dtype=torch.long, device=dev), persistent=False)
        self.register_buffer("sizes", torch.tensor(a.ple_vocab_sizes, dtype=torch.long, device=dev), persistent=False)
        self.a = a

    def rows(self, tokens: Tensor, state: PLEState) -> Tensor:
        """Table rows [T, heads] of the tokens' n-grams; advances the token
        history in ``state``."""
        n = self.a.ple_ngram
        seq = torch.cat([state.tokens, tokens])                         # [n-1 + T]
        state.tokens.copy_(seq[seq.shape[0] - (n - 1):])
        return self._hash(seq[None], tokens.shape[0])

    def _hash(self, seq: Tensor, n_tok: int) -> Tensor:
        """Table rows [B * T, heads] of the last ``n_tok`` tokens of each of
        the B token histories ``seq`` [B, n-1 + T] (integer arithmetic, exact
        whichever way the rows are laid out)."""
        a = self.a
        n = a.ple_ngram
        is_eos = seq == a.ple_eos
        cur = seq[:, n - 1:]
        ctx = [cur]
        cut = torch.zeros(seq.shape[0], n_tok, dtype=torch.bool, device=seq.device)
        for s in range(1, n):                                           # predecessor s positions back
            prev = seq[:, n - 1 - s:n - 1 - s + n_tok]
            cut = cut | is_eos[:, n - 1 - s:n - 1 - s + n_tok]           # an EOS at or after it cuts
            ctx.append(torch.where(cut, torch.full_like(prev, a.ple_eos), prev))
        out = []
        for g in range(2, n + 1):                                       # bigram heads first
            mixed = ctx[0] * self.mult[0]
            for j in range(1, g):
                mixed = torch.bitwise_xor(mixed, ctx[j] * self.mult[j])
            lo, hi = (g - 2) * a.ple_heads_per_ngram, (g - 1) * a.ple_heads_per_ngram
            out.append(torch.remainder(mixed[..., None], self.sizes[lo:hi]) + self.offsets[lo:hi])
        return torch.cat(out, -1).reshape(-1, a.ple_heads)

    def _gated(self, res: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        """(the gated values [T, S, D], their norm [T, S * D], the conv's
        input) of the tokens whose table rows are ``rows``."""
        a = self.a
        n_tok, s, d = res.shape
        emb = L.embedding(rows, self.table).reshape(n_tok, -1).to(res.dtype)   # [T, D]
        key = grouped_rms(F.linear(emb, self.key).view(n_tok, s, d), self.norm_key, a.eps)
        query = grouped_rms(res, self.norm_query, a.eps)
        score = (key * query).sum(-1, keepdim=True) / math.sqrt(d)      # [T, S, 1]
        gate = torch.sigmoid(torch.sign(score) * score.abs().clamp(min=1e-6).sqrt())
        gated = F.linear(emb, self.value)[:, None, :] * gate            # [T, S, D]
        return gated, grouped_rms(gated, self.norm_conv, a.eps).reshape(n_tok, s * d)

    def forward(self, res: Tensor, tokens: Tensor, state: PLEState) -> Tensor:
        gated, normed = self._gated(res, self.rows(tokens, state))
        conv, hist = dilated_causal_conv(normed, state.conv, self.conv, self.a.ple_ngram)
        state.conv.copy_(hist)
        return res + gated + F.silu(conv).view(res.shape)

    def forward_rows(self, res: Tensor, tokens: Tensor, hist_tokens: Tensor, hist_conv: Tensor) -> Tensor:
        """:meth:`forward` of S sequences' one new token each (``res``
        [S, S_hc, D], ``tokens`` [S]) whose histories are the rows of one
        pool (``hist_tokens`` [S, n-1], ``hist_conv`` [S, (K-1) * n, C],
        updated in place): the same arithmetic on all at once."""
        n = self.a.ple_ngram
        seq = torch.cat([hist_tokens, tokens[:, None]], 1)              # [S, n]
        hist_tokens.copy_(seq[:, 1:])
        gated, normed = self._gated(res, self._hash(seq, 1))
        full = torch.cat([hist_conv.to(normed.dtype), normed[:, None]], 1)   # [S, hist + 1, C]
        conv = torch.zeros_like(normed)
        k_taps, n_hist = self.conv.shape[1], hist_conv.shape[1]
        for k in range(k_taps):                                         # as dilated_causal_conv, per sequence
            conv = conv + full[:, n_hist - (k_taps - 1 - k) * n] * self.conv[:, k]
        hist_conv.copy_(full[:, 1:])
        return res + gated + F.silu(conv).view(res.shape)


# ---------------------------------------------------------------------------
# blocks and the model


class Block(nn.Module):
    """[PLE] -> HC read -> mixer -> HC write -> HC read -> MoE -> HC write."""

    def __init__(self, w: Weights, il: int, a: ModelArgs, ple_table: Tensor | None = None):
        super().__init__()
        p = f"blk.{il}."
        self.recurrent = a.recurrent[il]
        self.hc_attn = HCMixer(w, p + "hc_attn_", a, inject=True)
        self.hc_ffn = HCMixer(w, p + "hc_ffn_", a, inject=True)
        self.mixer = GatedDeltaNet(w, il, a) if self.recurrent else QSAttention(w, il, a)
        self.moe = load_moe(w, il, a)
        self.ple = PLE(w, il, a, ple_table) if ple_table is not None else None
        self.plain_write = False
        self.skip_ple = False

    def forward(self, res: Tensor, tokens: Tensor, cache, state: State, positions: Tensor, cos: Tensor,
                sin: Tensor) -> Tensor:
        if self.ple is not None and not self.skip_ple:
            res = self.ple(res, tokens, state.ple)
        x, inject = self.hc_attn(res)
        if self.recurrent:
            out = self.mixer(x, cache)
        else:
            out = self.mixer(x, cache, positions, cos, sin, state.rope_cos, state.rope_sin)
        res = hc_write(res, out, inject, self.plain_write)
        x, inject = self.hc_ffn(res)
        return hc_write(res, self.moe(x), inject, self.plain_write)

    def forward_batch(self, res: Tensor, sizes: list[int], tokens: list[Tensor], caches: list,
                      states: list[State], rots: list) -> Tensor:
        """Several sequences' tokens at once: PLE per sequence (its token
        history; on all at once for one new token each with pooled
        histories), the mixer's projections on all tokens and its core per
        sequence or on pooled states (see the mixers' ``forward_batch``),
        the hyper-connections and the MoE on all."""
        if self.ple is not None and not self.skip_ple:
            hist = L.stacked_fields([s.ple for s in states], ("tokens", "conv")) if L.one_token_each(sizes) else None
            if hist is not None:
                res = self.ple.forward_rows(res, torch.cat(tokens), *hist)
            else:
                res = torch.cat([self.ple(r, t, s.ple) for r, t, s in zip(res.split(sizes), tokens, states)])
        x, inject = self.hc_attn(res)
        if self.recurrent:
            out = self.mixer.forward_batch(x, sizes, caches)
        else:
            out = self.mixer.forward_batch(x, sizes, caches, rots, [(s.rope_cos, s.rope_sin) for s in states])
        res = hc_write(res, out, inject, self.plain_write)
        x, inject = self.hc_ffn(res)
        return hc_write(res, self.moe.forward_batch(x), inject, self.plain_write)


class Transformer(nn.Module):
    def __init__(self, w: Weights, a: ModelArgs):
        super().__init__()
        self.args = a
        self.tok_embd = param(w.get("token_embd.weight", (a.n_vocab, a.n_embd)))
        ple_table = None
        if a.ple_layer >= 0:
            rows = max(o + s for o, s in zip(a.ple_offsets, a.ple_vocab_sizes))
            info = w.gguf.info("per_layer_token_embd.weight")
            if info.shape[0] != a.ple_head_dim or info.shape[1] < rows:
                raise FleError(f"{w.path}: per_layer_token_embd.weight is {list(info.shape)} (ggml order); "
                               f"the PLE keys need [{a.ple_head_dim}, >= {rows}]")
            ple_table = w.table("per_layer_token_embd.weight")
            self.ple_table = ple_table
        self.layers = nn.ModuleList(Block(w, il, a, ple_table if il == a.ple_layer else None)
                                    for il in range(a.n_layer))
        self.output_hc = HCMixer(w, "output_hc_", a, inject=False)
        head = "output.weight" if w.has("output.weight") else "token_embd.weight"
        self.output = param(w.get(head, (a.n_vocab, a.n_embd)))
        self.mtp = None
        self.ablation = Ablation()
        if a.n_mtp and w.has(f"blk.{a.n_layer}.nextn.eh_proj.weight"):
            from .qwen4exp_mtp import MTPHead   # the head in the trunk file (block_count = N + 1)

            self.mtp = MTPHead(w, a, self.tok_embd, self.output)

    @classmethod
    def from_weights(cls, w: Weights) -> "Transformer":
        return cls(w, ModelArgs.from_weights(w))

    @property
    def device(self) -> torch.device:
        return self.tok_embd.device

    # MTP ---------------------------------------------------------------------
    def load_mtp(self, path):
        """Attach the MTP head of ``path``; see :func:`.qwen4exp_mtp.load_mtp`."""
        from .qwen4exp_mtp import load_mtp

        return load_mtp(self, path)

    def draft(self, state: "State") -> tuple[Tensor, Tensor]:
        """(draft token [1], logits [V]); see :func:`fle_engine.mtp.draft`."""
        from ..mtp import draft

        return draft(self, state)

    # ablations (tests) ---------------------------------------------------------
    def set_ablation(self, ablation: Ablation) -> None:
        """Switch components off (or back on) for the next forward calls."""
        self.ablation = replace(ablation)
        for layer in self.layers:
            layer.skip_ple = ablation.ple
            layer.plain_write = ablation.inject
            layer.moe.has_shared = not ablation.shared_expert
            if isinstance(layer.mixer, QSAttention):
                layer.mixer.dense = ablation.qsa

    # state ---------------------------------------------------------------------
    def new_state(self, max_tokens: int) -> State:
        a, dev, dt = self.args, self.device, self.tok_embd.dtype
        caches = [self._layer_cache(il, max_tokens) for il in range(a.n_layer)]
        cos, sin = L.rope_table(a.n_rot, a.rope_base, max_tokens, a.rope_freq_scale)
        ple = None
        if a.ple_layer >= 0:
            ple = PLEState(torch.full((a.ple_ngram - 1,), a.ple_eos, dtype=torch.long, device=dev),
                           torch.zeros(a.ple_hist, a.hc * a.n_embd, dtype=dt, device=dev))
        state = State(max_tokens, torch.zeros(1, dtype=torch.long, device=dev), caches,
                      torch.from_numpy(cos).to(dev), torch.from_numpy(sin).to(dev), ple=ple)
        if self.mtp is not None:
            state.mtp = self.mtp.new_state(max_tokens)
        return state

    def _layer_cache(self, il: int, max_tokens: int):
        a, dev, dt = self.args, self.device, self.tok_embd.dtype
        if a.recurrent[il]:
            return L.GDNState(torch.zeros(a.conv_kernel - 1, a.conv_dim, dtype=dt, device=dev),
                              torch.zeros(a.n_v_heads, a.d_state, a.d_state, dtype=torch.float32, device=dev))
        kv = (a.n_head_kv, max_tokens, a.head_dim)
        idx = torch.zeros(max_tokens, a.idx_dim, dtype=dt, device=dev) if a.compress[il] else None
        return QSACache(torch.zeros(kv, dtype=dt, device=dev), torch.zeros(kv, dtype=dt, device=dev), idx)

    # forward -------------------------------------------------------------------
    def trunk(self, tokens: Tensor, state: State) -> Tensor:
        """The wide residual after the last layer, [T, S, D]."""
        positions, cos, sin = advance(state, tokens.shape[0])
        x = F.embedding(tokens, self.tok_embd)
        res = x[:, None, :].expand(-1, self.args.hc, -1).contiguous()   # S copies of the embedding
        for layer, cache in zip(self.layers, state.layers):
            res = layer(res, tokens, cache, state, positions, cos, sin)
        return res

    def head(self, res: Tensor) -> Tensor:
        x, _ = self.output_hc(res)
        return F.linear(x, self.output)

    def forward(self, tokens: Tensor, state: State) -> Tensor:
        res = self.trunk(tokens, state)
        logits = self.head(res)
        state.hidden, state.last_tokens, state.last_logits = res, tokens, logits
        if state.mtp is not None:
            state.mtp.push(res, tokens)
        return logits

    def forward_batch(self, tokens: list[Tensor], states: list[State]) -> list[Tensor]:
        """``forward`` of several sequences in one pass (see
        :meth:`.qwen3moe.Transformer.forward_batch`)."""
        sizes = [t.shape[0] for t in tokens]
        rots = L.Rots(advance(s, n) for s, n in zip(states, sizes))
        x = F.embedding(torch.cat(tokens), self.tok_embd)
        res = x[:, None, :].expand(-1, self.args.hc, -1).contiguous()
        for il, layer in enumerate(self.layers):
            res = layer.forward_batch(res, sizes, tokens, [s.layers[il] for s in states], states, rots)
        logits = self.head(res)
        out = []
        for s, t, r, lg in zip(states, tokens, res.split(sizes), logits.split(sizes)):
            s.hidden, s.last_tokens, s.last_logits = r, t, lg
            if s.mtp is not None:
                s.mtp.push(r, t)
            out.append(lg)
        return out
