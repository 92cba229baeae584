"""The engine's decode-step operations, each as a slow obviously-right
torch reference beside its fast Triton kernel (:mod:`.triton_engine`), in
one dispatch table, :data:`OPS`.

The references compute the same quantities with plain torch (quantized
weights decoded by fle_quant's bit-exact dequantizers, see
:mod:`.reference`); they read positions and ids on the host where that is
simplest, so they synchronise and serve CPU runs and tests. The engine
picks one side for a whole step (:func:`pick`): Triton on CUDA, the
reference elsewhere, or Triton's interpreter on CPU tensors in tests.

Signatures (both sides; outputs written in place):

- ``experts(store, qtype, host_delta, part_words, expert_words, n_out,
  row_bytes, slot_of, ids, x, out, gate_up, n_used, weights=None,
  mode="miss")`` (mode: the fast kernel's launch configuration)
- ``route_topk(logits, n_used, scale, slot_of, ids, weights, log, hits)``
- ``add_rmsnorm(x, parts, weight, eps, out)``
- ``qk_rope_kv(qkv, q_norm, k_norm, eps, cos, sin, pos, n_head, n_kv,
  head_dim, n_rot, q_out, k_cache, v_cache)``
- ``attention(q, k_cache, v_cache, pos, scale, out, partial, ml)``
- ``experts_union(...)``: ``experts`` for the T x n_used rows of a
  T-token step with each distinct expert read once; ``reads`` (int32 [R],
  optional) marks the rows whose program read the expert (the first row
  of each expert); ``cpu_share`` skips the rows of the CPU's distinct
  missed experts (runtime.split's union rule; their down rows written as
  zeros), ``x_miss`` as for ``experts``
- ``qk_rope_kv_multi(...)``, ``attention_multi(q, k_cache, v_cache, pos,
  scale, out, partial, ml)``: T tokens at positions pos .. pos + T - 1
  (``qkv`` [T, W], ``q``/``out`` [T, H Dh]); token t attends to positions
  0 .. pos + t. The references are T calls of the one-token references
- ``qk_rope_kv_multi(..., lanes=lanes)``, ``attention_multi(..., lanes=lanes)``:
  the rows of a batched step of several sequences ("lanes"): row t is at
  position ``pos[t]`` (int64 [T]) of lane ``lanes[t]`` (int64 [T]), whose
  cache is ``k_cache[lanes[t]]`` of lane-stacked caches [N, Hkv, P, Dh]
  (:meth:`Q8Cache.lane` for q8_0); row t attends to positions
  0 .. pos[t] of its own lane
- ``embed_row(table, qtype, tok, out)``
- ``float_mv(x, w, out)``: ``out`` [T, n_out] = x [T, n_in] @ w.T in
  float32, ``w`` a float32, float16 or bfloat16 matrix as it is stored
  (the fast kernel widens 16-bit weights in registers: no float32 copy)
- ``attention(..., keep, ratio)``: only the positions p whose block
  ``keep[p // ratio]`` is set count (sparse attention);
  ``attention_multi(..., keep, ratio)`` with ``keep`` [T, NB]: token t's
  own block mask, row t
- ``hc_write_norm(res, parts, inject, n_streams, weight, eps, out)``: the
  hyper-connection write ``res[s] += 2 sigmoid(inject[s] / S) * sum(parts)``
  (skipped when ``parts`` is None) and the per-stream RMSNorm times the
  [S, D] gamma into ``out``; for T tokens ``res``/``out`` [T, S, D],
  ``parts`` [T, P, D], ``inject`` [T, S]
- ``gdn_step(qkv, z, b, a, conv_state, conv_w, dt_bias, ssm_a, ssm, norm,
  eps, n_k, tiled, sigmoid_gate, conv_out, out)``: one token of a gated
  delta net layer after its projections: causal conv + silu (state
  shifted in place), L2-normed q/k (V head j reads K head j mod Hk when
  ``tiled``, else j // (Hv / Hk)), the delta rule on ``ssm`` [Hv, Dv, Dk]
  in place, RMSNorm times ``norm`` and the output gate (sigmoid or silu of
  ``z``) into ``out``
- ``hc_mix(xn, gate, out)``: ``out = mean_s(xn[s] * sigmoid(gate[s]))``
  (T tokens: ``xn`` [T, S, D], ``gate`` [T, S D], ``out`` [T, D])
- ``gather_rows(table, qtype, host_delta, rows, out)``: rows ``rows`` of a
  quantized table, concatenated; the fast side reads them from host memory
  at ``host_delta`` words from ``table`` (zero-copy)
- ``post_misses(split, il, xn, ids, wts, slot_of, serial)`` and
  ``wait_misses(split, il, ids, slot_of, serial, out)``: the CPU's share of
  a layer's misses (:mod:`fle_engine.runtime.split`); the reference computes
  it at once in the post, the fast side hands it to the worker thread.
  One token: ``xn`` [D], ``ids``/``wts`` [K], ``out`` [D]; a T-row step:
  ``xn`` [T, D], ``ids``/``wts`` [T K], ``out`` [T, D] (any row stride),
  split by the union rule
- ``experts(..., cpu_share=s)`` skips the rows that the CPU computes;
  ``experts(..., x_miss=xq)``: rows of missed experts read ``xq``
- ``round_acts(x, dot_k, out, ids=None, slot_of=None)``: rows quantized to
  Q8_K (``dot_k``) or Q8_0 as the CPU kernels quantize their activations,
  and decoded again (only the rows of missed experts with ``ids``)
- ``dequant(space, qtype, base, n_rows, row_bytes, out)``: the matrices
  at word offsets ``base`` [G] of a :class:`WordSpace` decoded into ``out``
  [G, n_rows, n_in] (bfloat16 or float32), for prefill's products;
  ``tile_order=True``: each chunk's columns in the decoders' tile order
  (:func:`tile_columns` gives the permutation of the other operand)
- ``gdn_tokens(...)``: ``gdn_step`` for T tokens at once (rows [T, ...] of
  the same arguments; prefill), the states advanced as T steps advance them
- ``stage_pick(logits, slot_of, n_used, stage)``, ``stage_copy(store,
  host_delta, expert_words, stage, first_slot)``, ``stage_apply(prev_map,
  prev_stage, slot_of, stage, ids, counts, first_slot)``: the prefetch of
  predicted misses (:mod:`fle_engine.runtime.stage`): the first R missing
  experts of the top ``n_used`` logits, their bytes copied from host memory
  into R slots, and the map entries switched to those slots (the previous
  layer's switched back)
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fle_quant.errors import FleError
from fle_quant.ggml_types import GGMLType

from .reference import dequantize_weights

__all__ = ["OPS", "pick", "ExpertWords", "WordSpace", "tile_columns", "WORDS", "Q8Cache", "q8_0_quantize", "kv_nbytes",
           "lane_of"]


class ExpertWords:
    """The slot buffer and the host buffer of the routed experts as the
    reference sees them: ``slots`` and ``host`` uint8 [rows, expert_bytes]
    tensors (``host`` may be any object whose ``[e]`` is expert e's packed
    bytes: memory-mapped experts), and the word size (bytes) that the part
    offsets count in (the fast kernels address both buffers from one
    pointer instead)."""

    def __init__(self, slots: Tensor, host: Tensor, word: int):
        self.slots, self.host, self.word = slots, host, int(word)


class WordSpace:
    """Byte buffers addressed by offsets from the first one's address, as
    the fast kernels address them (one base pointer): ``base`` and any
    ``others`` (uint8 tensors on one device). The reference resolves an
    offset to the buffer that holds it."""

    def __init__(self, base: Tensor, *others: Tensor):
        self.base = base.reshape(-1)
        self._parts = [(0, self.base)] + [(t.data_ptr() - self.base.data_ptr(), t.reshape(-1)) for t in others]

    def offset(self, t: Tensor) -> int:
        """Byte offset of ``t``'s first byte from the base."""
        return t.data_ptr() - self.base.data_ptr()

    def words(self, qtype: GGMLType) -> Tensor:
        return self.base.view(WORDS[qtype])

    def matrix(self, byte_off: int, n_rows: int, row_bytes: int) -> Tensor:
        """uint8 [n_rows, row_bytes] starting ``byte_off`` bytes from the base."""
        n = n_rows * row_bytes
        for start, t in self._parts:
            if start <= byte_off and byte_off + n <= start + t.numel():
                return t[byte_off - start:byte_off - start + n].view(n_rows, row_bytes)
        raise FleError(f"internal: no buffer holds bytes {byte_off}..{byte_off + n} of the word space")


class Q8Cache:
    """A K or V cache in ggml's q8_0: per block of 32 values along the head
    dimension, int8 values and one float16 scale (``d = amax / 127``, values
    ``round(x / d)``), as llama.cpp's ``-ctk q8_0`` keeps it; stored as two
    arrays, ``q`` int8 [Hkv, P, Dh] and ``d`` float16 [Hkv, P, Dh / 32]."""

    BLOCK = 32

    def __init__(self, n_kv: int, n_pos: int, head_dim: int, device, lanes: int = 0):
        if head_dim % self.BLOCK:
            raise FleError(f"a q8_0 KV cache needs a head size that is a multiple of 32, not {head_dim}; "
                           f"use --cache-type-k/-v f16")
        lead = (lanes,) if lanes else ()          # lanes: the caches of that many sequences, [N, Hkv, P, Dh]
        self.q = torch.zeros(*lead, n_kv, n_pos, head_dim, dtype=torch.int8, device=device)
        self.d = torch.zeros(*lead, n_kv, n_pos, head_dim // self.BLOCK, dtype=torch.float16, device=device)
        self.shape = self.q.shape

    def lane(self, i: int) -> "Q8Cache":
        """Lane ``i`` of lane-stacked caches: a [Hkv, P, Dh] cache sharing the storage."""
        out = Q8Cache.__new__(Q8Cache)
        out.q, out.d = self.q[i], self.d[i]
        out.shape = out.q.shape
        return out

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 2 * self.d.numel()

    def store(self, p: "int | slice", x: Tensor) -> None:
        """Quantize ``x`` [Hkv, Dh] (float32) into position ``p``, or
        [Hkv, T, Dh] into the positions of the slice ``p``."""
        q, d = q8_0_quantize(x)
        self.q[:, p], self.d[:, p] = q, d

    def values(self, length: int) -> Tensor:
        """Positions 0..length-1 as float32 [Hkv, length, Dh]."""
        q, d = self.q[:, :length].float(), self.d[:, :length].float()
        return q * d.repeat_interleave(self.BLOCK, dim=-1)


def q8_0_quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """ggml's ``quantize_row_q8_0`` on the last dimension of float32 ``x``:
    (int8 values, float16 scales). The scale is computed and applied in
    float32 and stored as float16; values round half away from zero."""
    xb = x.float().reshape(*x.shape[:-1], -1, Q8Cache.BLOCK)
    amax = xb.abs().amax(-1)
    d = amax / 127.0
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    v = xb * inv[..., None]
    q = torch.where(v >= 0, torch.floor(v + 0.5), torch.ceil(v - 0.5)).to(torch.int8)
    return q.reshape(x.shape), d.to(torch.float16)


def kv_nbytes(c) -> int:
    return c.nbytes if isinstance(c, Q8Cache) else c.numel() * c.element_size()


def lane_of(cache, i: int):
    """Lane ``i`` of a lane-stacked cache (a tensor [N, ...] or a Q8Cache)."""
    return cache.lane(i) if isinstance(cache, Q8Cache) else cache[i]


# ---------------------------------------------------------------------------
# the CPU's share of the misses (runtime.split runs it; the Triton kernels' _union_n_cpu follows the same rule)

SHARE_ONE = 256         # a share of 256 is every miss


def cpu_count(n_miss, share):
    """The rule: how many of a token's ``n_miss`` misses the CPU computes."""
    return (n_miss * share + 128) // SHARE_ONE


def union_cpu(ids, miss, share):
    """The rule for the R = T x K rows of a step (row-major ``ids`` [R],
    ``miss`` bool [R]): (the distinct missed experts in order of the first
    row routed to each, the CPU's experts: the last ``cpu_count(n, share)``
    of them). T = 1: a token's misses, the CPU's the last in routing order."""
    seen, order = set(), []
    for e, m in zip((int(v) for v in ids), (bool(v) for v in miss)):
        if e not in seen:
            seen.add(e)
            if m:
                order.append(e)
    n_cpu = cpu_count(len(order), share) if share else 0
    return order, order[len(order) - n_cpu:] if n_cpu else []


# ---------------------------------------------------------------------------
# references


def experts_ref(store: ExpertWords, qtype: GGMLType, host_delta: int, part_words: int, expert_words: int,
                n_out: int, row_bytes: int, slot_of: Tensor, ids: Tensor, x: Tensor, out: Tensor,
                gate_up: bool, n_used: int, weights: "Tensor | None" = None, mode: str = "miss",
                cpu_share: int = 0, x_miss: "Tensor | None" = None, _on_cpu: "set | None" = None) -> Tensor:
    word = store.word
    start = part_words * word
    n_rows = 2 * n_out if gate_up else n_out
    size = n_rows * row_bytes
    slot_of_h = slot_of.cpu()
    ids_h = ids.cpu().tolist()
    on_cpu = set() if _on_cpu is None else _on_cpu       # _on_cpu: the rows that experts_union gives the CPU
    if cpu_share and _on_cpu is None:
        for t in range(len(ids_h) // n_used):
            rows = [t * n_used + k for k in range(n_used) if int(slot_of_h[ids_h[t * n_used + k]]) < 0]
            n_cpu = cpu_count(len(rows), cpu_share)
            on_cpu.update(rows[len(rows) - n_cpu:] if n_cpu else [])
    for r, e in enumerate(ids_h):
        if r in on_cpu:                  # the CPU's share (runtime.split)
            if not gate_up:
                out[r] = 0.0
            continue
        s = int(slot_of_h[e])
        src = store.slots[s] if s >= 0 else store.host[e]
        raw = src[start:start + size].reshape(n_rows, row_bytes)
        w = dequantize_weights(raw.cpu(), qtype).to(x.device)
        xs = x_miss if x_miss is not None and s < 0 else x
        if gate_up:
            v = xs[r // n_used].float() @ w.T
            g, u = v[:n_out], v[n_out:]
            out[r] = F.silu(g) * u
        else:
            out[r] = (xs[r].float() @ w.T) * weights[r]
    return out


def experts_ffn_ref(gate_up: tuple, down: tuple, slot_of: Tensor, ids: Tensor, x: Tensor, h: Tensor, y: Tensor,
                    n_used: int, weights: Tensor, mode: str = "miss", cpu_share: int = 0,
                    x_miss: "Tensor | None" = None) -> Tensor:
    """A layer's routed experts: :func:`experts_ref` of the gate+up product into ``h``, then of the
    down product from ``h`` into ``y``. ``gate_up`` and ``down``: each product's leading arguments
    (store, type, host distance, part offset, expert size, output rows, row bytes;
    ``runtime.cache.expert_products``)."""
    experts_ref(*gate_up, slot_of, ids, x, h, True, n_used, mode=mode, cpu_share=cpu_share, x_miss=x_miss)
    return experts_ref(*down, slot_of, ids, h, y, False, n_used, weights, mode=mode, cpu_share=cpu_share)


def round_acts_ref(x: Tensor, dot_k: bool, out: Tensor, ids: "Tensor | None" = None,
                   slot_of: "Tensor | None" = None) -> Tensor:
    """Rows quantized to Q8_K / Q8_0 by the CPU kernels' own quantizer
    (:func:`fle_engine.kernels.cpu_experts.acts.quantize_acts`) and decoded
    again; with ``ids``/``slot_of`` only the rows of missed experts."""
    from .cpu_experts.acts import quantize_acts

    rows = list(range(x.shape[0]))
    if ids is not None:
        rows = [r for r, e in enumerate(ids.view(-1).cpu().tolist()) if int(slot_of[e]) < 0]
    if not rows:
        return out
    xs = x[rows].detach().float().cpu().numpy()
    a = quantize_acts(xs, GGMLType.Q8_K if dot_k else GGMLType.Q8_0)
    block = 256 if dot_k else 32
    d = torch.from_numpy(a.d).repeat_interleave(block, dim=1)
    vals = d * torch.from_numpy(a.qs.astype(np.float32))
    out[rows] = vals.to(out.device, out.dtype)
    return out


def union_rows_on_cpu(ids: Tensor, slot_of: Tensor, cpu_share: int) -> set:
    """The rows of a T-row step whose expert the CPU computes (runtime.split's
    :func:`union_cpu`): every row routed to one of
    the CPU's distinct missed experts."""
    if not cpu_share:
        return set()
    ids_h = ids.view(-1).cpu().tolist()
    slot_h = slot_of.cpu()
    _, mine = union_cpu(ids_h, [int(slot_h[e]) < 0 for e in ids_h], cpu_share)
    mine = set(mine)
    return {r for r, e in enumerate(ids_h) if e in mine}


def experts_union_ref(store: ExpertWords, qtype: GGMLType, host_delta: int, part_words: int, expert_words: int,
                      n_out: int, row_bytes: int, slot_of: Tensor, ids: Tensor, x: Tensor, out: Tensor,
                      gate_up: bool, n_used: int, weights: "Tensor | None" = None, mode: str = "miss",
                      reads: "Tensor | None" = None, cpu_share: int = 0, x_miss: "Tensor | None" = None) -> Tensor:
    experts_ref(store, qtype, host_delta, part_words, expert_words, n_out, row_bytes, slot_of, ids, x, out, gate_up,
                n_used, weights, mode, x_miss=x_miss, _on_cpu=union_rows_on_cpu(ids, slot_of, cpu_share))
    if reads is not None:
        ids_h = ids.view(-1).cpu().tolist()
        reads.copy_(torch.tensor([int(e not in ids_h[:r]) for r, e in enumerate(ids_h)], dtype=reads.dtype))
    return out


def _cpu_share_of(split, ids: Tensor, slot_of: Tensor):
    """(miss flags of the T x K rows, the CPU's expert count) by the union rule (T = 1: the token's rule)."""
    ids_h = ids.view(-1).cpu()
    miss = slot_of.cpu()[ids_h] < 0
    _, mine = union_cpu(ids_h.tolist(), miss.tolist(), split.share)
    return miss, len(mine)


def post_misses_ref(split, il: int, xn: Tensor, ids: Tensor, wts: Tensor, slot_of: Tensor, serial: Tensor) -> None:
    """The reference hand-over: the CPU's share computed at once (no worker).
    ``xn`` [D] (one token) or [T, D] with ``ids``/``wts`` [T K] (a T-row step)."""
    miss, n_cpu = _cpu_share_of(split, ids, slot_of)
    if n_cpu:
        T = ids.numel() // split.n_used
        b_ids, b_wts, b_miss, b_x = split.box(il, T)
        b_ids[:] = ids.view(-1).cpu().numpy()
        b_wts[:] = wts.view(-1).cpu().numpy()
        b_miss[:] = miss.numpy()
        b_x[:] = xn.reshape(T, -1).float().cpu().numpy()
        split.rows[split.index[il]] = T
        split.process(il, n_cpu)


def wait_misses_ref(split, il: int, ids: Tensor, slot_of: Tensor, serial: Tensor, out: Tensor) -> None:
    """The CPU's sums into ``out`` ([D], or [T, D] for a T-row step; zeros without CPU work)."""
    _, n_cpu = _cpu_share_of(split, ids, slot_of)
    if n_cpu:
        T = ids.numel() // split.n_used
        out.copy_(torch.from_numpy(split.result(il, T).copy()).view(out.shape))
    else:
        out.zero_()


def route_topk_ref(logits: Tensor, n_used: int, scale: float, slot_of: Tensor, ids: Tensor, weights: Tensor,
                   log: Tensor, hits: Tensor) -> None:
    probs = torch.softmax(logits.float(), dim=-1)
    top, exp = torch.topk(probs, n_used, dim=-1)
    w = top / top.sum(-1, keepdim=True).clamp(min=6.103515625e-5)
    if scale not in (0.0, 1.0):
        w = w * scale
    ids.copy_(exp)
    weights.copy_(w)
    log.copy_(exp.to(log.dtype))
    hits.copy_((slot_of[exp] >= 0).to(hits.dtype))


def stage_pick_ref(logits: Tensor, slot_of: Tensor, n_used: int, stage: Tensor) -> None:
    lg = logits.reshape(-1).float().cpu().numpy()
    top = np.argsort(-lg, kind="stable")[:n_used]
    miss = [int(e) for e in top if int(slot_of[int(e)]) < 0][:stage.shape[0]]
    stage.fill_(-1)
    if miss:
        stage[:len(miss)] = torch.tensor(miss, dtype=stage.dtype)


def stage_copy_ref(store: ExpertWords, host_delta: int, expert_words: int, stage: Tensor, first_slot: int) -> None:
    for r, e in enumerate(stage.tolist()):
        if e >= 0:
            store.slots[first_slot + r].copy_(store.host[e])


def stage_apply_ref(prev_map: "Tensor | None", prev_stage: "Tensor | None", slot_of: "Tensor | None",
                    stage: "Tensor | None", ids: "Tensor | None", counts: Tensor, first_slot: int) -> None:
    if prev_map is not None:
        for e in prev_stage.tolist():
            if e >= 0:
                prev_map[e] = -1
    if slot_of is not None:
        routed = set(ids.reshape(-1).tolist())
        put = [(r, e) for r, e in enumerate(stage.tolist()) if e >= 0]
        for r, e in put:
            slot_of[e] = first_slot + r
        counts[0] += len(put)
        counts[1] += sum(e in routed for _, e in put)


def float_mv_ref(x: Tensor, w: Tensor, out: Tensor) -> Tensor:
    """``out`` [T, n_out] = x [T, n_in] @ w.T in float32 for a float matrix
    of any float type (the router, the shared expert's gate, F32/F16/BF16
    dense weights); a 16-bit matrix is widened for this product only."""
    torch.matmul(x.float(), w.float().T, out=out)
    return out


def add_rmsnorm_ref(x: Tensor, parts: "Tensor | None", weight: Tensor, eps: float, out: Tensor) -> None:
    if parts is not None:
        x += parts.sum(1)
    out.copy_(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight)


def qk_rope_kv_ref(qkv: Tensor, q_norm, k_norm, eps: float, cos: Tensor, sin: Tensor, pos: Tensor,
                   n_head: int, n_kv: int, head_dim: int, n_rot: int, q_out: Tensor, k_cache: Tensor,
                   v_cache: Tensor) -> None:
    from ..layers import apply_rope_neox, rms_norm

    p = int(pos.reshape(-1)[0])
    q = qkv[: n_head * head_dim].view(1, n_head, head_dim)
    k = qkv[n_head * head_dim:(n_head + n_kv) * head_dim].view(1, n_kv, head_dim)
    v = qkv[(n_head + n_kv) * head_dim:].view(n_kv, head_dim)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    c, s = cos[p:p + 1], sin[p:p + 1]
    q_out.copy_(apply_rope_neox(q, c, s).reshape(-1))
    k = apply_rope_neox(k, c, s)[0]
    for cache, x in ((k_cache, k), (v_cache, v)):
        if isinstance(cache, Q8Cache):
            cache.store(p, x)
        else:
            cache[:, p] = x.to(cache.dtype)


def qk_rope_kv_multi_ref(qkv: Tensor, q_norm, k_norm, eps: float, cos: Tensor, sin: Tensor, pos: Tensor,
                         n_head: int, n_kv: int, head_dim: int, n_rot: int, q_out: Tensor, k_cache: Tensor,
                         v_cache: Tensor, lanes: "Tensor | None" = None) -> None:
    width = (n_head + 2 * n_kv) * head_dim
    for t in range(qkv.shape[0]):
        kc, vc, p = k_cache, v_cache, pos + t
        if lanes is not None:                    # row t: its own lane and position
            i = int(lanes[t])
            kc, vc, p = lane_of(k_cache, i), lane_of(v_cache, i), pos[t:t + 1]
        qk_rope_kv_ref(qkv[t, :width], q_norm, k_norm, eps, cos, sin, p, n_head, n_kv, head_dim, n_rot, q_out[t],
                       kc, vc)


def attention_multi_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor, scale: float, out: Tensor,
                        partial=None, ml=None, keep: "Tensor | None" = None, ratio: int = 0,
                        lanes: "Tensor | None" = None) -> None:
    for t in range(q.shape[0]):
        kc, vc, p = k_cache, v_cache, pos + t
        if lanes is not None:
            i = int(lanes[t])
            kc, vc, p = lane_of(k_cache, i), lane_of(v_cache, i), pos[t:t + 1]
        attention_ref(q[t], kc, vc, p, scale, out[t], keep=None if keep is None else keep[t], ratio=ratio)


def attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor, scale: float, out: Tensor,
                  partial=None, ml=None, keep: "Tensor | None" = None, ratio: int = 0) -> None:
    n_kv, _, dh = k_cache.shape
    length = int(pos.reshape(-1)[0]) + 1
    qh = q.view(n_kv, -1, dh).float()                                  # [Hkv, G, Dh]
    k, v = (c.values(length) if isinstance(c, Q8Cache) else c[:, :length].float() for c in (k_cache, v_cache))
    scores = torch.matmul(qh, k.transpose(1, 2)) * scale
    if keep is not None:
        kept = keep.to(torch.bool)[torch.arange(length, device=keep.device) // ratio]
        scores = scores.masked_fill(~kept.to(scores.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out.copy_(torch.matmul(probs, v).reshape(-1))


def embed_row_ref(table: Tensor, qtype: GGMLType, tok: Tensor, out: Tensor) -> None:
    t = int(tok.reshape(-1)[0])
    out.copy_(dequantize_weights(table[t:t + 1].cpu(), qtype)[0].to(out.device))


def gdn_step_ref(qkv: Tensor, z: Tensor, b: Tensor, a: Tensor, conv_state: Tensor, conv_w: Tensor, dt_bias: Tensor,
                 ssm_a: Tensor, ssm: Tensor, norm: Tensor, eps: float, n_k: int, tiled: bool, sigmoid_gate: bool,
                 conv_out: Tensor, out: Tensor) -> None:
    from .. import layers as Lr

    nv, dv, dk = ssm.shape
    nk = n_k
    beta = torch.sigmoid(b.view(1, nv))
    g = F.softplus(a.view(1, nv) + dt_bias) * ssm_a
    conv, new_conv = Lr.causal_conv1d(qkv.view(1, -1), conv_state, conv_w)
    conv_state.copy_(new_conv)
    conv = F.silu(conv)
    conv_out.copy_(conv.view(-1))
    q = conv[:, :dk * nk].view(1, nk, dk)
    k = conv[:, dk * nk:2 * dk * nk].view(1, nk, dk)
    v = conv[:, 2 * dk * nk:].view(1, nv, dv)
    if tiled:
        q = Lr.l2_norm(q, eps).repeat(1, nv // nk, 1)
        k = Lr.l2_norm(k, eps).repeat(1, nv // nk, 1)
    else:
        q = Lr.l2_norm(q, eps)[:, :, None].expand(1, nk, nv // nk, dk).reshape(1, nv, dk)
        k = Lr.l2_norm(k, eps)[:, :, None].expand(1, nk, nv // nk, dk).reshape(1, nv, dk)
    o, st = Lr.gdn_recurrent(q, k, v, g, beta, ssm)
    ssm.copy_(st)
    gate = torch.sigmoid if sigmoid_gate else F.silu
    o = Lr.rms_norm(o, norm, eps) * gate(z.view(1, nv, dv))
    out.copy_(o.reshape(-1))


def gdn_tokens_ref(qkv: Tensor, z: Tensor, b: Tensor, a: Tensor, conv_state: Tensor, conv_w: Tensor, dt_bias: Tensor,
                   ssm_a: Tensor, ssm: Tensor, norm: Tensor, eps: float, n_k: int, tiled: bool, sigmoid_gate: bool,
                   conv_out: Tensor, out: Tensor) -> None:
    for t in range(qkv.shape[0]):
        gdn_step_ref(qkv[t], z[t], b[t], a[t], conv_state, conv_w, dt_bias, ssm_a, ssm, norm, eps, n_k, tiled,
                     sigmoid_gate, conv_out[t], out[t])


def hc_write_norm_ref(res: Tensor, parts: "Tensor | None", inject: "Tensor | None", n_streams: int, weight: Tensor,
                      eps: float, out: Tensor) -> None:
    if parts is not None:
        lead = res.shape[:-2]                                         # () for one token, (T,) for T
        w = 2.0 * torch.sigmoid(inject.reshape(*lead, -1, 1) / n_streams)
        res += w * parts.sum(1).reshape(*lead, 1, res.shape[-1])
    out.copy_(res * torch.rsqrt(res.pow(2).mean(-1, keepdim=True) + eps) * weight)


def hc_mix_ref(xn: Tensor, gate: Tensor, out: Tensor) -> None:
    out.copy_((xn * torch.sigmoid(gate.view_as(xn))).mean(-2).view_as(out))


def gather_rows_ref(table: Tensor, qtype: GGMLType, host_delta: int, rows: Tensor, out: Tensor) -> None:
    idx = rows.reshape(-1).cpu()
    vals = dequantize_weights(table[idx], qtype)
    out.copy_(vals.reshape(-1).to(out.device))


def chunk_order(qtype: GGMLType) -> np.ndarray:
    """The value (0..255 within its 256-value chunk) at each place of the fast
    decoders' tile [A, B, C] flattened: triton_quant's ``_value_index``
    written out (tests hold the two equal)."""
    from .triton_quant import _FORMATS

    A, B, C = _FORMATS[qtype].tile
    a, b, c = np.meshgrid(np.arange(A), np.arange(B), np.arange(C), indexing="ij")
    q = int(qtype)
    if q == 8:
        k = 32 * a + 2 * b + c
    elif q in (12, 13):
        k = 32 * a + 4 * b + c
    elif q in (17, 18, 22, 21):
        k = 8 * a + 4 * b + c
    elif q == 42:
        k = 64 * a + 8 * b + c
    elif q == 14:
        k = 128 * (a // 16) + 32 * c + 2 * (a % 16) + b
    elif q == 20:
        k = 32 * a + 16 * (c >> 1) + 2 * b + (c & 1)
    else:
        k = 32 * a + 16 * (c >> 2) + 4 * b + (c & 3)
    return k.reshape(-1).astype(np.int64)


def tile_columns(qtype: GGMLType, n_in: int, device) -> Tensor:
    """int64 [n_in]: the input column that each column of a matrix decoded in
    tile order holds (``n_in`` a multiple of 256): x[:, cols] @ W_tile.T
    equals x @ W.T."""
    perm = chunk_order(qtype)
    j = np.arange(n_in)
    return torch.from_numpy(j // 256 * 256 + perm[j % 256]).to(device)


def dequant_ref(space: WordSpace, qtype: GGMLType, base: Tensor, n_rows: int, row_bytes: int, out: Tensor,
                tile_order: bool = False) -> Tensor:
    word = WORDS[qtype].itemsize
    for g, b in enumerate(base.reshape(-1).cpu().tolist()):
        vals = dequantize_weights(space.matrix(b * word, n_rows, row_bytes), qtype)
        if tile_order:
            vals = vals[:, tile_columns(qtype, vals.shape[1], vals.device)]
        out[g] = vals.to(device=out.device, dtype=out.dtype)
    return out


# ---------------------------------------------------------------------------
# the table


def _fast():
    from . import triton_engine as te

    return SimpleNamespace(experts=_experts_fast, experts_ffn=_experts_ffn_fast, route_topk=te.route_topk,
                           add_rmsnorm=te.add_rmsnorm, qk_rope_kv=te.qk_rope_kv, attention=te.attention,
                           embed_row=te.embed_row, hc_write_norm=te.hc_write_norm, hc_mix=te.hc_mix,
                           gather_rows=te.gather_rows, gdn_step=te.gdn_step, post_misses=te.post_misses,
                           wait_misses=te.wait_misses, experts_union=_experts_union_fast,
                           qk_rope_kv_multi=te.qk_rope_kv_multi, attention_multi=te.attention_multi,
                           dequant=_dequant_fast, gdn_tokens=te.gdn_tokens, round_acts=te.round_acts,
                           stage_pick=te.stage_pick, stage_copy=te.stage_copy, stage_apply=te.stage_apply,
                           float_mv=te.float_mv)


def _experts_fast(words: Tensor, qtype: GGMLType, host_delta: int, part_words: int, expert_words: int, n_out: int,
                  row_bytes: int, slot_of: Tensor, ids: Tensor, x: Tensor, out: Tensor, gate_up: bool, n_used: int,
                  weights: "Tensor | None" = None, mode: str = "miss", cpu_share: int = 0,
                  x_miss: "Tensor | None" = None) -> Tensor:
    """The routed experts' product on the fast side: the CUDA C kernel
    (:mod:`.cuda_mv`) where it takes the call, else Triton's."""
    from . import cuda_mv, triton_engine as te

    word = words.element_size()
    impl = cuda_mv if cuda_mv.experts_supported(words, qtype, x, out, x_miss, expert_words * word,
                                                part_words * word, mode) else te
    return impl.experts(words, qtype, host_delta, part_words, expert_words, n_out, row_bytes, slot_of, ids, x, out,
                        gate_up, n_used, weights, mode=mode, cpu_share=cpu_share, x_miss=x_miss)


def _experts_union_fast(words: Tensor, qtype: GGMLType, host_delta: int, part_words: int, expert_words: int,
                        n_out: int, row_bytes: int, slot_of: Tensor, ids: Tensor, x: Tensor, out: Tensor,
                        gate_up: bool, n_used: int, weights: "Tensor | None" = None, mode: str = "miss",
                        reads: "Tensor | None" = None, cpu_share: int = 0, x_miss: "Tensor | None" = None) -> Tensor:
    """The T-row step's experts on the fast side: the CUDA C union kernel where it is switched on and
    takes the call (:func:`.cuda_mv.union_supported`), else Triton's."""
    from . import cuda_mv, triton_engine as te

    word = words.element_size()
    impl = cuda_mv if cuda_mv.union_supported(words, qtype, x, out, x_miss, expert_words * word, part_words * word,
                                              ids.shape[0], n_used, reads) else te
    return impl.experts_union(words, qtype, host_delta, part_words, expert_words, n_out, row_bytes, slot_of, ids, x,
                              out, gate_up, n_used, weights, mode=mode, reads=reads, cpu_share=cpu_share,
                              x_miss=x_miss)


def _experts_ffn_fast(gate_up: tuple, down: tuple, slot_of: Tensor, ids: Tensor, x: Tensor, h: Tensor, y: Tensor,
                      n_used: int, weights: Tensor, mode: str = "miss", cpu_share: int = 0,
                      x_miss: "Tensor | None" = None) -> Tensor:
    """:func:`experts_ffn_ref` on the fast side: one CUDA C launch for both products where it takes
    the layer (:func:`.cuda_mv.ffn_supported`: both parts in the same words), else two launches."""
    from . import cuda_mv

    words, qtype, delta, gu_part, expert_words, n_ff, gu_row_bytes = gate_up
    d_words, d_qtype, d_delta, d_part, d_expert_words, n_embd, d_row_bytes = down
    word = words.element_size()
    if (gu_part == 0 and d_qtype == qtype and d_words.data_ptr() == words.data_ptr() and d_words.dtype == words.dtype
            and (d_delta, d_expert_words) == (delta, expert_words)
            and cuda_mv.ffn_supported(words, qtype, x, h, y, x_miss, expert_words * word, d_part * word,
                                      ids.shape[0], mode)):
        return cuda_mv.experts_ffn(words, qtype, delta, d_part, expert_words, n_ff, n_embd, gu_row_bytes,
                                   d_row_bytes, slot_of, ids, x, h, y, n_used, weights, mode=mode,
                                   cpu_share=cpu_share, x_miss=x_miss)
    _experts_fast(*gate_up, slot_of, ids, x, h, True, n_used, mode=mode, cpu_share=cpu_share, x_miss=x_miss)
    return _experts_fast(*down, slot_of, ids, h, y, False, n_used, weights, mode=mode, cpu_share=cpu_share)


def _dequant_fast(space: WordSpace, qtype: GGMLType, *args, **kw) -> Tensor:
    from . import triton_dequant

    return triton_dequant.dequant(space.words(qtype), qtype, *args, **kw)


REFERENCE = SimpleNamespace(experts=experts_ref, experts_ffn=experts_ffn_ref, route_topk=route_topk_ref,
                            add_rmsnorm=add_rmsnorm_ref, qk_rope_kv=qk_rope_kv_ref, attention=attention_ref,
                            embed_row=embed_row_ref, hc_write_norm=hc_write_norm_ref, hc_mix=hc_mix_ref,
                            gather_rows=gather_rows_ref, gdn_step=gdn_step_ref, post_misses=post_misses_ref,
                            wait_misses=wait_misses_ref, experts_union=experts_union_ref,
                            qk_rope_kv_multi=qk_rope_kv_multi_ref, attention_multi=attention_multi_ref,
                            dequant=dequant_ref, gdn_tokens=gdn_tokens_ref, round_acts=round_acts_ref,
                            stage_pick=stage_pick_ref, stage_copy=stage_copy_ref, stage_apply=stage_apply_ref,
                            float_mv=float_mv_ref)

# name -> (reference, fast) ; the fast side is filled on first use (it imports triton)
OPS: dict[str, tuple] = {name: (getattr(REFERENCE, name), None) for name in vars(REFERENCE)}


def pick(impl: str, device: torch.device) -> SimpleNamespace:
    """The operations of one side: ``"reference"``, ``"triton"``, or
    ``"auto"`` (Triton on CUDA, else the reference)."""
    if impl == "auto":
        impl = "triton" if device.type == "cuda" else "reference"
    if impl == "reference":
        return REFERENCE
    if impl == "triton":
        try:
            fast = _fast()
        except ImportError:
            raise FleError("the engine's fast kernels need triton (pip install triton)") from None
        for name in OPS:
            OPS[name] = (OPS[name][0], getattr(fast, name))
        return fast
    raise FleError(f"impl must be 'auto', 'reference' or 'triton', not {impl!r}")


WORDS = {GGMLType.Q8_0: torch.int16, GGMLType.IQ4_XS: torch.int32, GGMLType.IQ3_S: torch.int16,
         GGMLType.IQ4_NL: torch.int16, GGMLType.Q6_K: torch.int16, GGMLType.Q4_K: torch.int32,
         GGMLType.Q5_K: torch.int32, GGMLType.IQ3_XXS: torch.int16, GGMLType.IQ2_XS: torch.int16,
         GGMLType.IQ2_S: torch.int16, GGMLType.Q2_0: torch.int16}
"""The word the fast kernels load per type (kept equal to triton_quant's
formats by tests/test_engine.py)."""
