"""Blocks shared by FLE's reference forward passes: RMSNorm, NEOX rotary,
attention over a preallocated KV cache, SwiGLU, the routed MoE (with
capture hooks), the causal depthwise conv with its carried state and the
gated delta rule (chunked for prefill, recurrent for decode).

Everything here follows llama.cpp's graphs (``src/llama-graph.cpp``,
``src/models/delta-net-base.cpp``) and is written so that a decode step can
be captured as a CUDA graph: no host synchronisation, no Python branch on a
tensor's value, only shapes decide which code runs. Positions and cache
indices are device tensors.

Shape legend: T tokens of this call, P cache capacity (max_tokens), D model
width, H query heads, Hkv KV heads, Dh head width, E experts, K experts used
per token, F expert hidden width, C conv channels, Hk/Hv GDN key/value heads,
Dk/Dv their widths.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "rms_norm", "rope_table", "apply_rope_neox", "AttnCache", "attention", "attention_batch", "stacked",
    "stacked_fields", "one_token_each", "Rots", "rot_cat", "swiglu", "MoE", "MoECapture", "MoERecord", "GDNState",
    "causal_conv1d", "conv_step_rows", "l2_norm", "gdn_recurrent", "gdn_step_rows", "gdn_chunked", "State",
]


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """ggml_rms_norm (mean of squares over the last axis) times ``weight``."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * weight if weight is not None else y


# ---------------------------------------------------------------------------
# rotary


def rope_table(n_rot: int, freq_base: float, n_pos: int, freq_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, float32 ``[n_pos, n_rot / 2]``, computed the way ggml's CPU
    rope does: the angle of pair i is built by repeated float32
    multiplication ``theta_i = theta_{i-1} * base^(-2/n_rot)`` from the
    position, so long contexts round exactly as llama.cpp's do."""
    theta_scale = np.float32(np.power(np.float32(freq_base), np.float32(-2.0 / n_rot), dtype=np.float32))
    theta = np.arange(n_pos, dtype=np.float32)
    cos = np.empty((n_pos, n_rot // 2), np.float32)
    sin = np.empty((n_pos, n_rot // 2), np.float32)
    for i in range(n_rot // 2):
        t = theta.astype(np.float64) * float(np.float32(freq_scale))
        cos[:, i] = np.cos(t)
        sin[:, i] = np.sin(t)
        theta = (theta * theta_scale).astype(np.float32)
    return cos, sin


def apply_rope_neox(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """NEOX rotary on the first ``2 * cos.shape[-1]`` dims of ``x`` [T, H, Dh]:
    dim i pairs with dim i + n_rot/2; the rest pass through (partial rotary).
    ``cos``/``sin``: [T, n_rot/2], already gathered at the tokens' positions."""
    half = cos.shape[-1]
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)


# ---------------------------------------------------------------------------
# attention


@dataclass
class AttnCache:
    """Keys and values of one attention layer, preallocated for P positions:
    ``k``, ``v`` [Hkv, P, Dh]."""
    k: Tensor
    v: Tensor


def live_view(cache, n: int):
    """``cache`` cut to its first ``n`` positions (views: writes land in the
    cache), for a host-driven step that knows the sequence's length: the
    attention then reads ``n`` positions instead of all ``P``. Other layer
    states come back as they are."""
    if type(cache) is AttnCache and n < cache.k.shape[1]:
        return AttnCache(cache.k[:, :n], cache.v[:, :n])
    return cache


def attention(q: Tensor, k: Tensor, v: Tensor, cache: AttnCache, positions: Tensor, scale: float,
              ends_here: bool = False) -> Tensor:
    """Causal GQA attention of T new tokens against the cache.

    ``q`` [T, H, Dh]; ``k``, ``v`` [T, Hkv, Dh] are written into ``cache`` at
    ``positions`` [T] (device, int64) first. Scores cover all P cache slots
    (static shapes) and a slot counts only if it is at or before the
    query's position; query head h reads KV head h // (H / Hkv) as ggml's
    broadcast does. ``ends_here``: the cache is a :func:`live_view` ending at
    the last new token, so one new token sees every slot and needs no mask
    (a batched decode step). Returns [T, H * Dh]."""
    cache.k.index_copy_(1, positions, k.transpose(0, 1).to(cache.k.dtype))
    cache.v.index_copy_(1, positions, v.transpose(0, 1).to(cache.v.dtype))
    n_tok, n_head, dh = q.shape
    n_kv, n_pos = cache.k.shape[0], cache.k.shape[1]
    group = n_head // n_kv
    qh = q.reshape(n_tok, n_kv, group, dh).permute(1, 2, 0, 3).to(cache.k.dtype)  # [Hkv, G, T, Dh]
    scores = torch.matmul(qh, cache.k[:, None].transpose(-1, -2)) * scale      # [Hkv, G, T, P]
    if not (ends_here and n_tok == 1):
        slots = torch.arange(n_pos, device=positions.device)
        visible = slots[None, :] <= positions[:, None]                        # [T, P]
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(cache.v.dtype)
    out = torch.matmul(probs, cache.v[:, None])                                # [Hkv, G, T, Dh]
    return out.permute(2, 0, 1, 3).reshape(n_tok, n_head * dh).to(q.dtype)


def stacked(ts: list[Tensor]) -> Tensor | None:
    """``[S, *shape]``: one view of ``ts`` when they are views of rows
    ``r0, r0 + d, r0 + 2d, ...`` of one buffer ``[N, *shape]`` (slot states
    made as rows of one pool, see ``fle_engine.server``), each a whole row
    or a row cut on axis 1 (an attention cache's :func:`live_view`): the
    rows, with the longest's length on axis 1. None otherwise (separate
    tensors). Reads nothing, copies nothing."""
    t0 = ts[0]
    pool = t0._base
    if pool is None or len(ts) < 2 or pool.dim() != t0.dim() + 1:
        return None
    ps, full, base = pool.stride(), pool.shape[1:], pool.storage_offset()
    st, rest, cut = ps[1:], full[2:], t0.dim() > 1
    rows, n = [], 0
    for t in ts:
        row, off = divmod(t.storage_offset() - base, ps[0])
        shape = t.shape
        if t._base is not pool or off or t.stride() != st or shape[0] != full[0] or shape[2:] != rest:
            return None
        if cut:
            n = max(n, shape[1])
        rows.append(row)
    step = rows[1] - rows[0]
    if step <= 0 or (len(rows) > 2 and any(b - a != step for a, b in zip(rows, rows[1:]))) or (cut and n > full[1]):
        return None
    return pool[rows[0]:rows[-1] + 1:step, :, :n] if cut else pool[rows[0]:rows[-1] + 1:step]


def one_token_each(sizes: list[int]) -> bool:
    """Whether a batched call brings several sequences one new token each
    (a batched decode step)."""
    return len(sizes) > 1 and all(n == 1 for n in sizes)


_ROWS: dict = {}     # stacked_fields' views, by the ids of the tensors they stack (dropped with them)


def stacked_fields(objs: list, names: tuple[str, ...]) -> tuple | None:
    """The fields ``names`` of ``objs`` (one layer's cache or carried state
    per sequence) as :func:`stacked` views ``[S, *shape]``, when every
    field's tensors are rows of one pool; None otherwise. The slots' rows
    are the same tensors from step to step, so each view is made once and
    kept (a view reads nothing and copies nothing) until the first of its
    rows is gone."""
    out = []
    for name in names:
        ts = [getattr(o, name) for o in objs]
        key = tuple(map(id, ts))
        hit = _ROWS.get(key)
        if hit is not None and all(r() is t for r, t in zip(hit[0], ts)):
            out.append(hit[1])
            continue
        t = stacked(ts)
        if t is None:
            return None
        _ROWS[key] = (tuple(weakref.ref(x) for x in ts), t)
        for x in ts:
            weakref.finalize(x, _ROWS.pop, key, None)
        out.append(t)
    return tuple(out)


class Rots(list):
    """A batched step's rotary inputs, one ``(positions, cos, sin)`` per
    sequence, which every attention layer of the step reads alike: their
    concatenations (:func:`rot_cat`) and what :func:`attention_batch`
    derives from the positions are made once per step, not per layer.
    ``ends``: each sequence's length after the step, when the attention
    layers get whole caches (:func:`attention_batch`)."""

    def __init__(self, items=(), ends: list[int] | None = None):
        super().__init__(items)
        self.memo: dict = {}
        self.ends = ends


def rot_cat(rots: list, i: int) -> Tensor:
    """Part ``i`` (0 positions, 1 cos, 2 sin) of every sequence's rotary
    inputs, concatenated (once per step for :class:`Rots`)."""
    memo = getattr(rots, "memo", None)
    if memo is not None and i in memo:
        return memo[i]
    out = rots[0][i] if len(rots) == 1 else torch.cat([r[i] for r in rots])
    if memo is not None:
        memo[i] = out
    return out


def attention_batch(q: Tensor, k: Tensor, v: Tensor, caches: list, rots: list, sizes: list[int],
                    scale: float) -> Tensor:
    """:func:`attention` of several sequences' new tokens (``q``, ``k``, ``v``
    concatenated, ``sizes`` each), each against its cache up to its last
    new token: a whole cache cut there (a :func:`live_view`) with
    ``rots.ends`` (:class:`Rots`), else a cache given as such a view;
    ``rots``: each one's ``(positions, cos, sin)``. One new token per
    sequence and caches that are rows of one pool (:func:`stacked`): one
    write, one score product and one softmax for all of them, a sequence
    shorter than the longest masked past its end; otherwise one
    :func:`attention` per sequence. Returns [T, H * Dh]."""
    ends = getattr(rots, "ends", None)
    if one_token_each(sizes):
        if ends is not None:
            pooled = stacked_fields(caches, ("k", "v"))
            n_pos = max(ends)
            kp, vp = (None, None) if pooled is None else (p[:, :, :n_pos] for p in pooled)
            short = any(e < n_pos for e in ends)
        else:
            kp, vp = stacked([c.k for c in caches]), stacked([c.v for c in caches])
            short = kp is not None and any(c.k.shape[1] < kp.shape[2] for c in caches)
        if kp is not None and vp is not None:
            n_seq, n_head, dh = q.shape
            n_kv, n_pos = kp.shape[1], kp.shape[2]
            memo = getattr(rots, "memo", {})
            key = ("decode", n_pos, q.device)
            if key not in memo:
                pos = rot_cat(rots, 0)                                             # [S], each one's last position
                past = None
                if short:
                    past = (torch.arange(n_pos, device=q.device) > pos[:, None])[:, None, None, :]
                memo[key] = (torch.arange(n_seq, device=q.device), pos, past)
            rows, pos, past = memo[key]
            kp.transpose(1, 2).index_put_((rows, pos), k.to(kp.dtype))              # [S, P, Hkv, Dh] view
            vp.transpose(1, 2).index_put_((rows, pos), v.to(vp.dtype))
            qh = q.reshape(n_seq, n_kv, n_head // n_kv, dh).to(kp.dtype)            # [S, Hkv, G, Dh]
            scores = torch.matmul(qh, kp.transpose(-1, -2)) * scale                # [S, Hkv, G, P]
            if past is not None:
                scores = scores.masked_fill(past, float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(vp.dtype)
            out = torch.matmul(probs, vp)                                          # [S, Hkv, G, Dh]
            return out.reshape(n_seq, n_head * dh).to(q.dtype)
    if ends is not None:
        caches = [live_view(c, e) for c, e in zip(caches, ends)]
    return torch.cat([attention(qi, ki, vi, c, r[0], scale, ends_here=True) for qi, ki, vi, c, r in
                      zip(q.split(sizes), k.split(sizes), v.split(sizes), caches, rots)])


# ---------------------------------------------------------------------------
# feed-forward and MoE


def embedding(idx: Tensor, table) -> Tensor:
    """``F.embedding`` for a resident table, or the looked-up rows of a
    :class:`~fle_engine.quantized.QuantRows` left in the file."""
    return F.embedding(idx, table) if isinstance(table, Tensor) else table.lookup(idx)


def swiglu(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """down(silu(gate x) * up x); weights in [out, in] (nn.Linear) layout."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


@dataclass
class MoERecord:
    """One MoE call of one layer: ``hidden`` [T, D] (the MoE input, after
    the norm), ``probs`` [T, E] (router softmax), ``experts`` [T, K] (int64),
    ``weights`` [T, K] (after renormalisation and scaling), ``expert_out``
    [T, K, D] (each chosen expert's unweighted output), ``shared_out`` [T, D]
    (the gated shared expert, None without one) and ``output`` [T, D]
    (the block's result: sum_k weights * expert_out + shared_out)."""
    layer: int
    hidden: Tensor
    probs: Tensor
    experts: Tensor
    weights: Tensor
    expert_out: Tensor
    shared_out: Tensor | None
    output: Tensor


@dataclass
class MoECapture:
    """Collects :class:`MoERecord` per layer: ``layers[il]`` lists the calls
    of layer ``il`` in order (one per ``forward``). Tensors are detached
    clones on the model's device; recording costs nothing when no capture is
    attached."""
    layers: dict[int, list[MoERecord]] = field(default_factory=dict)

    def record(self, rec: MoERecord) -> None:
        self.layers.setdefault(rec.layer, []).append(rec)

    def clear(self) -> None:
        self.layers.clear()


class MoE(nn.Module):
    """Routed experts (softmax gating, top-K, weights renormalised to sum 1,
    optionally scaled) plus an optional shared expert behind a one-scalar
    sigmoid gate, as llama.cpp's ``build_moe_ffn`` with ``norm_w = true``.

    Experts are stacked ``[E, F, D]`` (gate, up) and ``[E, D, F]`` (down).
    Two static-shape formulations, chosen by shapes only:

    - ``"gather"``: index the K chosen experts' weights per token
      ([T, K, F, D] gathered) — for decode (few tokens);
    - ``"dense"``: run every expert on every token and weight the outputs with
      a [T, E] matrix that is zero off the chosen experts — for prefill of the
      small reference models.

    ``mode = "auto"`` gathers when T * K <= E (no more expert matrices read
    than the dense form reads), else runs dense.

    Experts may instead be :class:`~fle_engine.quantized.QuantExperts`
    (left quantized in the file, for models larger than memory): then every
    call runs ``"stream"``, which dequantizes only the experts the call
    routes to, one at a time, and syncs with the host to list them (so it is
    not for CUDA graphs)."""

    def __init__(self, layer: int, router: Tensor, gate_exps: Tensor, up_exps: Tensor, down_exps: Tensor,
                 n_used: int, weights_scale: float = 0.0, shared: tuple[Tensor, Tensor, Tensor] | None = None,
                 shared_gate: Tensor | None = None):
        super().__init__()
        self.layer = layer
        self.router = nn.Parameter(router, requires_grad=False)          # [E, D]
        self.streamed = not isinstance(gate_exps, Tensor)
        if self.streamed:                                                # QuantExperts, dequantized per call
            self.gate_exps, self.up_exps, self.down_exps = gate_exps, up_exps, down_exps
        else:
            self.gate_exps = nn.Parameter(gate_exps, requires_grad=False)    # [E, F, D]
            self.up_exps = nn.Parameter(up_exps, requires_grad=False)        # [E, F, D]
            self.down_exps = nn.Parameter(down_exps, requires_grad=False)    # [E, D, F]
        self.n_used = int(n_used)
        self.weights_scale = float(weights_scale)
        if shared is not None:
            self.shexp_gate = nn.Parameter(shared[0], requires_grad=False)   # [Fs, D]
            self.shexp_up = nn.Parameter(shared[1], requires_grad=False)     # [Fs, D]
            self.shexp_down = nn.Parameter(shared[2], requires_grad=False)   # [D, Fs]
            self.shexp_router = nn.Parameter(shared_gate, requires_grad=False) if shared_gate is not None else None
        self.has_shared = shared is not None
        self.mode = "auto"
        self.store = None          # an expert cache (fle_engine.cached_moe.ExpertStore) serving the routed experts
        self.capture: MoECapture | None = None

    @property
    def n_expert(self) -> int:
        return self.router.shape[0]

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(probs [T, E], experts [T, K], weights [T, K]) for input [T, D]."""
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)
        top, experts = torch.topk(probs, self.n_used, dim=-1)
        # llama.cpp clamps the sum to the smallest normal f16 to avoid a division by zero
        weights = top / top.sum(-1, keepdim=True).clamp(min=6.103515625e-5)
        if self.weights_scale not in (0.0, 1.0):
            weights = weights * self.weights_scale
        return probs, experts, weights

    def experts_gather(self, x: Tensor, experts: Tensor) -> Tensor:
        """Outputs of the chosen experts, [T, K, D], from gathered weights."""
        g = self.gate_exps[experts]                                     # [T, K, F, D]
        u = self.up_exps[experts]
        d = self.down_exps[experts]                                     # [T, K, D, F]
        xe = x[:, None, :, None]                                        # [T, 1, D, 1]
        h = F.silu(torch.matmul(g, xe)) * torch.matmul(u, xe)           # [T, K, F, 1]
        return torch.matmul(d, h).squeeze(-1)                           # [T, K, D]

    def experts_dense(self, x: Tensor) -> Tensor:
        """Every expert's output on every token, [E, T, D]."""
        h = F.silu(torch.matmul(x, self.gate_exps.transpose(1, 2))) * torch.matmul(x, self.up_exps.transpose(1, 2))
        return torch.matmul(h, self.down_exps.transpose(1, 2))          # [E, T, D]

    def experts_stream(self, x: Tensor, experts: Tensor) -> Tensor:
        """Outputs of the chosen experts, [T, K, D], visiting each routed
        expert once (in index order) with the tokens routed to it."""
        n_tok, k = experts.shape
        y = x.new_zeros(n_tok * k, x.shape[1])
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)                        # (token, slot) pairs grouped by expert
        uniq, counts = torch.unique_consecutive(flat[order], return_counts=True)
        for e, pairs in zip(uniq.tolist(), torch.split(order, counts.tolist())):
            y[pairs] = swiglu(x[pairs // k], self.gate_exps.get(e), self.up_exps.get(e), self.down_exps.get(e))
        return y.view(n_tok, k, x.shape[1])

    def forward_batch(self, x: Tensor) -> Tensor:
        """The MoE of several sequences' tokens together (a batched decode
        step, or a prefill chunk): each routed expert is visited once, with
        the tokens routed to it, instead of a weight copy per token. A
        streamed or cached expert store, a mode other than auto, or a capture
        take :meth:`forward`."""
        if self.streamed or self.store is not None or self.mode != "auto" or self.capture is not None:
            return self.forward(x)
        _, experts, weights = self.route(x)
        n_tok, k = experts.shape
        if n_tok * k <= self.HOST_GROUPS:
            y = self._experts_few(x, experts)
        else:
            y = x.new_empty(n_tok * k, x.shape[1])
            flat = experts.reshape(-1)
            order = torch.argsort(flat, stable=True)                    # (token, slot) pairs grouped by expert
            uniq, counts = torch.unique_consecutive(flat[order], return_counts=True)
            for e, pairs in zip(uniq.tolist(), torch.split(order, counts.tolist())):
                y[pairs] = swiglu(x[pairs // k], self.gate_exps[e], self.up_exps[e], self.down_exps[e])
        out = (weights.to(x.dtype)[:, :, None] * y.view(n_tok, k, x.shape[1])).sum(1)
        if self.has_shared:
            out = out + self.shared_expert(x)
        return out

    HOST_GROUPS = 64        # forward_batch groups at most this many (token, slot) pairs on the host

    def _experts_few(self, x: Tensor, experts: Tensor) -> Tensor:
        """:meth:`forward_batch`'s expert outputs [T * K, D] in (token, slot)
        order for a few tokens (a decode step): the pairs are grouped by
        expert on the host (the routing is read once, as the tensor
        grouping reads its expert list), each expert runs on a slice of
        ``x`` where its tokens are consecutive, and the outputs are put in
        order by one gather instead of a scatter per expert."""
        k = experts.shape[1]
        groups: dict[int, list[int]] = {}
        for p, e in enumerate(experts.reshape(-1).tolist()):
            groups.setdefault(e, []).append(p)
        outs, order = [], []
        for e in sorted(groups):
            pairs = groups[e]
            toks = [p // k for p in pairs]
            if toks[-1] - toks[0] == len(toks) - 1:                     # consecutive tokens (distinct: one slot each)
                xe = x[toks[0]:toks[-1] + 1]
            else:
                xe = x[torch.tensor(toks, device=x.device)]
            outs.append(swiglu(xe, self.gate_exps[e], self.up_exps[e], self.down_exps[e]))
            order += pairs
        y = outs[0] if len(outs) == 1 else torch.cat(outs)
        if order != sorted(order):
            where = [0] * len(order)
            for i, p in enumerate(order):
                where[p] = i
            y = y[torch.tensor(where, device=x.device)]
        return y

    def shared_expert(self, x: Tensor) -> Tensor:
        out = swiglu(x, self.shexp_gate, self.shexp_up, self.shexp_down)
        if self.shexp_router is not None:
            out = out * torch.sigmoid(F.linear(x, self.shexp_router[None, :]))
        return out

    def forward(self, x: Tensor) -> Tensor:
        n_tok = x.shape[0]
        probs, experts, weights = self.route(x)
        w = weights.to(x.dtype)
        mode = "store" if self.store is not None else "stream" if self.streamed else self.mode
        if mode == "auto":
            mode = "gather" if n_tok * self.n_used <= self.n_expert else "dense"
        if mode in ("gather", "stream", "store"):
            if mode == "gather":
                y = self.experts_gather(x, experts)                     # [T, K, D]
            else:
                y = self.experts_stream(x, experts) if mode == "stream" else self.store.experts(x, experts)
            out = (w[:, :, None] * y).sum(1)
        elif mode == "dense":
            dense = self.experts_dense(x)                               # [E, T, D]
            mix = torch.zeros(n_tok, self.n_expert, dtype=x.dtype, device=x.device).scatter(1, experts, w)
            out = torch.einsum("te,etd->td", mix, dense)
            y = None
        else:
            raise ValueError(f"MoE mode must be 'auto', 'gather' or 'dense', not {self.mode!r}")
        shared = self.shared_expert(x) if self.has_shared else None
        if shared is not None:
            out = out + shared
        if self.capture is not None:
            if y is None:
                y = dense.permute(1, 0, 2).gather(1, experts[:, :, None].expand(-1, -1, x.shape[1]))
            self.capture.record(MoERecord(
                self.layer, x.detach().clone(), probs.detach().clone(), experts.detach().clone(),
                weights.detach().clone(), y.detach().clone(),
                None if shared is None else shared.detach().clone(), out.detach().clone()))
        return out


# ---------------------------------------------------------------------------
# gated delta net


@dataclass
class GDNState:
    """Carried state of one GDN layer: ``conv`` [K_conv - 1, C] (the last
    inputs of the causal conv, oldest first) and ``ssm`` [Hv, Dv, Dk] float32
    (the delta-rule memory, mapping keys to values)."""
    conv: Tensor
    ssm: Tensor


def causal_conv1d(x: Tensor, conv_state: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv as ggml_ssm_conv: ``x`` [T, C], ``conv_state``
    [K-1, C], ``weight`` [C, K] with tap K-1 on the current token.
    Returns (y [T, C], new conv state [K-1, C])."""
    n_tok = x.shape[0]
    n_keep = conv_state.shape[0]
    full = torch.cat([conv_state.to(x.dtype), x], dim=0)                # [K-1+T, C]
    y = torch.zeros_like(x)
    for i in range(weight.shape[1]):                                    # K taps, a static loop
        y = y + full[i:i + n_tok] * weight[:, i]
    return y, full[full.shape[0] - n_keep:]


def conv_step_rows(x: Tensor, conv: Tensor, weight: Tensor) -> Tensor:
    """:func:`causal_conv1d` of S sequences' one new token each: ``x``
    [S, C], ``conv`` [S, K-1, C] their histories (rows of one pool, see
    :func:`stacked`; updated in place). Each row's arithmetic is the
    sequence's own. Returns y [S, C]."""
    full = torch.cat([conv.to(x.dtype), x[:, None]], dim=1)            # [S, K, C]
    y = torch.zeros_like(x)
    for i in range(weight.shape[1]):                                    # K taps, a static loop
        y = y + full[:, i] * weight[:, i]
    conv.copy_(full[:, 1:])
    return y


def l2_norm(x: Tensor, eps: float) -> Tensor:
    """llama.cpp's GDN L2 norm: x / sqrt(sum x^2 + eps) over the last axis
    (``build_gdn_l2_norm``: rms_norm with eps/n, scaled by 1/sqrt(n))."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def gdn_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """The gated delta rule one token at a time. ``q``, ``k`` [T, H, Dk]
    (already L2-normalised and repeated to the V heads), ``v`` [T, H, Dv],
    ``g`` [T, H] (log decay), ``beta`` [T, H], ``state`` [H, Dv, Dk].
    Per token: S <- e^g S; S <- S + beta (v - S k) k^T; o = S q / sqrt(Dk).
    Returns (o [T, H, Dv], new state); all float32."""
    scale = q.shape[-1] ** -0.5
    s = state.float()
    outs = []
    for t in range(q.shape[0]):                                        # T is static: 1 in decode
        s = s * torch.exp(g[t].float())[:, None, None]
        kt, qt = k[t].float(), q[t].float() * scale
        sk = torch.matmul(s, kt[:, :, None]).squeeze(-1)                # [H, Dv]
        d = (v[t].float() - sk) * beta[t].float()[:, None]
        s = s + d[:, :, None] * kt[:, None, :]
        outs.append(torch.matmul(s, qt[:, :, None]).squeeze(-1))
    return torch.stack(outs, 0), s


def gdn_step_rows(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
    """:func:`gdn_recurrent` of one token for each of S sequences, on their
    states ``state`` [S, H, Dv, Dk] float32 (rows of one pool, see
    :func:`stacked`), updated in place: ``q``, ``k`` [S, H, Dk], ``v``
    [S, H, Dv], ``g``, ``beta`` [S, H]. The same rule with the sequences'
    heads side by side; the products are taken as row vector times the
    transposed state and the update as one batched outer product added in
    place (fewer passes over the states than :func:`gdn_recurrent`'s, equal
    to it to float32 rounding). Returns o [S, H, Dv] float32."""
    n_seq, n_head, dv, dk = state.shape
    state.mul_(torch.exp(g.float())[..., None, None])
    kt = k.float()[..., None, :]                                        # [S, H, 1, Dk]
    sk = torch.matmul(kt, state.transpose(-1, -2))[..., 0, :]           # [S, H, Dv]
    d = (v.float() - sk) * beta.float()[..., None]
    heads = state.view(n_seq * n_head, dv, dk) if state[0].is_contiguous() and (
        n_seq == 1 or state.stride(0) == n_head * dv * dk) else None
    if heads is not None:
        heads.baddbmm_(d.reshape(-1, dv, 1), kt.reshape(-1, 1, dk))
    else:                                                               # rows of the pool not adjacent
        state.add_(d[..., None] * kt)
    qt = (q.float() * dk ** -0.5)[..., None, :]
    return torch.matmul(qt, state.transpose(-1, -2))[..., 0, :]


def gdn_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                chunk: int = 64) -> tuple[Tensor, Tensor]:
    """The same rule as :func:`gdn_recurrent`, computed chunk by chunk (64
    tokens, as llama.cpp's ``build_delta_net_chunking``): within a chunk the
    delta updates are resolved by one unit-lower-triangular solve (the WY
    form), and the state is carried across chunks. The tail is padded with
    g = 0, beta = 0, k = 0, which leaves the state unchanged."""
    n_tok, n_head, dk = q.shape
    dv = v.shape[-1]
    pad = (-n_tok) % chunk
    n_chunk = (n_tok + pad) // chunk

    def prep(x, width):  # [T, H, *] -> [H, N, chunk, *] float32, zero padded
        x = x.float().reshape(n_tok, n_head, width)
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        return x.permute(1, 0, 2).reshape(n_head, n_chunk, chunk, width)

    qc = prep(q, dk) * dk ** -0.5
    kc = prep(k, dk)
    vc = prep(v, dv)
    gc = prep(g[..., None], 1).squeeze(-1)                            # [H, N, L]
    bc = prep(beta[..., None], 1)                                     # [H, N, L, 1]

    gcum = gc.cumsum(-1)                                              # [H, N, L]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(G_i - G_j) for j <= i; the exponent is masked before exp
    # because G_i - G_j for j > i is positive and may overflow
    diff = gcum[..., :, None] - gcum[..., None, :]
    decay = torch.exp(diff.masked_fill(~lower, float("-inf")))       # [H, N, L, L]

    kb = kc * bc
    vb = vc * bc
    strict = torch.matmul(kb, kc.transpose(-1, -2)) * decay
    strict = strict.masked_fill(lower.logical_not() | torch.eye(chunk, dtype=torch.bool, device=q.device), 0.0)
    eye = torch.eye(chunk, dtype=torch.float32, device=q.device)
    # (I + strict)^-1 resolves the sequential delta updates inside the chunk
    inv = torch.linalg.solve_triangular(eye + strict, eye.expand_as(strict), upper=False, unitriangular=True)
    u = torch.matmul(inv, vb)                                         # [H, N, L, Dv]
    w = torch.matmul(inv, kb * torch.exp(gcum)[..., None])            # [H, N, L, Dk]
    qk = torch.matmul(qc, kc.transpose(-1, -2)) * decay               # [H, N, L, L], lower incl. diagonal

    s = state.float()                                                 # [H, Dv, Dk]
    outs = []
    for n in range(n_chunk):
        g_n = gcum[:, n]                                              # [H, L]
        v_new = u[:, n] - torch.matmul(w[:, n], s.transpose(-1, -2))  # [H, L, Dv]
        o_inter = torch.matmul(qc[:, n] * torch.exp(g_n)[..., None], s.transpose(-1, -2))
        outs.append(o_inter + torch.matmul(qk[:, n], v_new))
        g_last = g_n[:, -1]
        k_decay = kc[:, n] * torch.exp(g_last[:, None] - g_n)[..., None]  # [H, L, Dk]
        s = s * torch.exp(g_last)[:, None, None] + torch.matmul(v_new.transpose(-1, -2), k_decay)
    o = torch.stack(outs, 1).reshape(n_head, n_chunk * chunk, dv)[:, :n_tok]
    return o.permute(1, 0, 2), s


# ---------------------------------------------------------------------------
# decoding state


@dataclass
class State:
    """Everything a sequence carries between ``forward`` calls.

    ``pos`` [1] int64 on the device: tokens consumed so far, advanced in place
    by each forward (so a captured decode step reads it without a host
    sync). ``length`` is the same count kept on the host for bounds checks.
    ``layers[il]`` is an :class:`AttnCache` or a :class:`GDNState`.
    ``rope_cos``/``rope_sin`` [P, n_rot/2]: the rotary table for every slot.
    After each forward: ``hidden`` (the hidden states an MTP head reads),
    ``last_tokens`` and ``last_logits`` of that call's tokens; ``mtp``: the
    MTP head's own state when the model has one loaded
    (:class:`fle_engine.mtp.MTPState`)."""
    max_tokens: int
    pos: Tensor
    layers: list
    rope_cos: Tensor
    rope_sin: Tensor
    length: int = 0
    hidden: Tensor | None = None
    last_tokens: Tensor | None = None
    last_logits: Tensor | None = None
    mtp: object = None
