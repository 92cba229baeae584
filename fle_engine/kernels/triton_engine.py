"""Triton kernels of the engine's decode step (the fast side of
:mod:`fle_engine.kernels.engine_ops`; each has a torch reference there).

All of them read positions and expert ids from device memory and have
static launch grids, so a decode step built from them has no host
synchronisation and replays as a CUDA graph.

- :func:`experts`: the routed experts of one MoE layer for one decode step,
  each (token, expert) row read from its cache slot when the layer's
  expert->slot map has one and otherwise straight from page-locked host
  memory (zero-copy over PCIe), in the same launch: the slot and host
  buffers are addressed from one base pointer, the host buffer by its
  (constant) distance from the slot buffer. The gate and up matrices of an
  expert are one block of rows (gate first), multiplied and combined as
  ``silu(gate x) * up x`` in one kernel; the down matrix is multiplied and
  scaled by the routing weight in a second.
- :func:`experts_union`: the same for the T tokens of a verify step, each
  distinct expert of the step read once for all the tokens routed to it.
- :func:`route_topk`: softmax over the router logits, top-K, renormalised
  weights; also logs the chosen ids and whether each was a cache hit (the
  map as this step read it) for the cache policy on the host.
- :func:`add_rmsnorm`: the residual add of one or more parts and the next
  RMSNorm in one kernel.
- :func:`qk_rope_kv`: per-head RMSNorm of q and k, NEOX rotary at the
  position read from the device, k and v written into the KV cache;
  :func:`qk_rope_kv_multi` for T tokens at positions pos .. pos + T - 1.
- :func:`attention`: decode attention over the used length only (read
  from the device): a fixed number of splits per KV head, each looping over
  its share of the positions, then one reduction; the cost follows the
  length, not the allocated context; with a block mask (QSA) only the
  kept blocks' positions count. :func:`attention_multi`: T tokens, token t
  seeing positions 0 .. pos + t (causal).
- :func:`hc_write_norm`, :func:`hc_mix`: the hyper-connection arithmetic
  (write with its sigmoid weights plus the next per-stream norm; the
  gated mean of the streams).
- :func:`gdn_step`: one token of a gated delta net layer after its
  projections, in two launches: the causal conv with silu (its state
  shifted in place), then per V head the L2 norms, the delta rule on the
  head's [Dv, Dk] state, the RMSNorm and the output gate.
- :func:`gather_rows`: rows of a quantized table read from page-locked
  host memory (the PLE table), decoded into float32.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from fle_quant.ggml_types import BLOCK_GEOMETRY, GGMLType

from . import triton_quant as _tq
from .engine_ops import float_mv_ref
from .triton_quant import _FORMATS, _decode, _iq4_xs_rows_fast, _iq4_xs_rows_fast_multi, _lut, _value_index

__all__ = ["gdn_tokens", "stage_pick", "stage_copy", "stage_apply", "experts", "round_acts", "experts_union", "post_misses", "wait_misses", "route_topk", "add_rmsnorm", "qk_rope_kv",
           "qk_rope_kv_multi", "attention", "attention_multi", "embed_row", "hc_write_norm", "hc_mix", "gather_rows",
           "gdn_step", "ATTN_SPLITS"]

def _attn_splits() -> int:
    """FLE_ATTN_SPLITS, or 32: the programs per KV head that a decode step's
    attention splits the sequence into (each a chunk of the used length,
    then one reduction). More splits read a long sequence with more loads in
    flight and cost a short one scratch rows that hold nothing: 32 until a
    GPU run of ``bench/engine.py --positions`` (bench/gpu_suite.sh long) has
    timed others."""
    env = os.environ.get("FLE_ATTN_SPLITS", "32")
    try:
        n = int(env)
    except ValueError:
        n = 0
    if n < 8 or n > 512 or n & (n - 1):
        from fle_quant.errors import FleError

        raise FleError(f"FLE_ATTN_SPLITS={env!r}: give a power of two from 8 to 512 (default 32)")
    return n


ATTN_SPLITS = _attn_splits()


# ---------------------------------------------------------------------------
# routed experts


@triton.jit
def _expert_rows(wv, lut_ptr, row_w, x_base, n_in, n_blocks, QTYPE: tl.constexpr, A: tl.constexpr,
                 B: tl.constexpr, C: tl.constexpr, N_CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr,
                 UNROLL: tl.constexpr, FAST: tl.constexpr = False, U: tl.constexpr = 1, WAIT: tl.constexpr = False):
    """[BLOCK_N] products of the rows at word offsets ``row_w`` with the
    activation row at ``x_base``; ``UNROLL`` unrolls the chunk loop, so that
    every chunk's loads can be in flight at once (for reads over PCIe);
    ``FAST``: IQ4_XS through the byte-permute decoder (1: ``U`` super-blocks
    per iteration; ``WAIT``: the first weights loaded before the wait for the
    kernel before, see ``triton_quant._iq4_xs_rows_fast``) or its code-book
    table (2), else value by value from packed words (0)."""
    if FAST == 1 and QTYPE == 23 and not UNROLL:
        y = _iq4_xs_rows_fast(wv, row_w, x_base, N_CHUNKS, BLOCK_N, U, WAIT)
    else:
        k_in = _value_index(QTYPE, A, B, C)
        acc4 = tl.zeros([BLOCK_N, A, B, C], dtype=tl.float32)
        if UNROLL:
            for kc in tl.static_range(N_CHUNKS):
                w = _decode(QTYPE, wv, lut_ptr, row_w, kc, n_blocks, A, B, C)
                k = kc * (A * B * C) + k_in
                acc4 += w * tl.load(x_base + k, mask=k < n_in, other=0.0)[None, :, :, :]
        else:
            for kc in range(0, N_CHUNKS):
                w = _decode(QTYPE, wv, lut_ptr, row_w, kc, n_blocks, A, B, C, FAST == 2)
                k = kc * (A * B * C) + k_in
                acc4 += w * tl.load(x_base + k, mask=k < n_in, other=0.0)[None, :, :, :]
        y = tl.sum(tl.sum(tl.sum(acc4, axis=3), axis=2), axis=1)
    return y


@triton.jit
def _expert_kernel(wv, lut_ptr, slot_of_ptr, ids_ptr, wts_ptr, x_ptr, y_ptr,
                   host_delta, part_words, n_out, n_in, n_blocks, row_words, expert_words, n_used,
                   stride_x, stride_y, cpu_share, x_miss_delta,
                   QTYPE: tl.constexpr, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr,
                   N_CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr, GATE_UP: tl.constexpr, UNROLL: tl.constexpr,
                   SPLIT: tl.constexpr, KP: tl.constexpr, FAST: tl.constexpr, PAIRED: tl.constexpr,
                   U: tl.constexpr = 1, GDC: tl.constexpr = False):
    # GDC (launched with programmatic dependent launch): the down product, which reads only its
    # activations from the gate+up kernel before it, loads its first weights before waiting for
    # that kernel; every other form waits first (its expert ids come from the kernel before it).
    late_wait: tl.constexpr = GDC and not GATE_UP and not SPLIT and FAST == 1 and QTYPE == 23 and not UNROLL
    _tq._gdc_wait(GDC and not late_wait)
    pid_n = tl.program_id(0)
    r = tl.program_id(1)                      # (token, chosen expert) row
    e = tl.load(ids_ptr + r).to(tl.int64)
    s = tl.load(slot_of_ptr + e).to(tl.int64)
    if SPLIT:
        # the CPU computes the last n_cpu misses of the token (runtime.split's rule)
        t = r // n_used
        kk = tl.arange(0, KP)
        km = kk < n_used
        e_all = tl.load(ids_ptr + t * n_used + kk, mask=km, other=0)
        miss = (tl.load(slot_of_ptr + e_all, mask=km, other=0) < 0) & km
        n_miss = tl.sum(miss.to(tl.int32), axis=0)
        rank = tl.sum((miss & (kk < r - t * n_used)).to(tl.int32), axis=0)
        n_cpu = (n_miss * cpu_share + 128) // 256
        on_cpu = (s < 0) & (rank >= n_miss - n_cpu)
    else:
        on_cpu = False
    if on_cpu:
        if not GATE_UP:
            offs_z = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(y_ptr + r.to(tl.int64) * stride_y + offs_z, tl.zeros([BLOCK_N], tl.float32), mask=offs_z < n_out)
    else:
        # a cached expert is read from its slot, a missed one from host memory (host_delta words away)
        base = tl.where(s >= 0, s * expert_words, host_delta + e * expert_words) + part_words
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_out
        row_w = base + tl.where(mask_n, offs_n, 0).to(tl.int64) * row_words
        if GATE_UP:
            x_row = r // n_used
        else:
            x_row = r
        # a missed expert reads its activations x_miss_delta elements away (their rounded copy) when one is given
        x_base = x_ptr + x_row.to(tl.int64) * stride_x + tl.where(s < 0, x_miss_delta, 0)
        if GATE_UP:
            row_u = row_w + n_out.to(tl.int64) * row_words      # the up rows follow the gate rows
            if PAIRED and FAST == 1 and QTYPE == 23 and not UNROLL:
                # gate and up rows in one loop: twice the loads in flight per program
                gu = _iq4_xs_rows_fast(wv, tl.reshape(tl.join(row_w, row_u), [2 * BLOCK_N]), x_base, N_CHUNKS,
                                       2 * BLOCK_N, U)
                g, u = tl.split(tl.reshape(gu, [BLOCK_N, 2]))
            else:
                g = _expert_rows(wv, lut_ptr, row_w, x_base, n_in, n_blocks, QTYPE, A, B, C, N_CHUNKS, BLOCK_N,
                                 UNROLL, FAST, U)
                u = _expert_rows(wv, lut_ptr, row_u, x_base, n_in, n_blocks, QTYPE, A, B, C, N_CHUNKS, BLOCK_N,
                                 UNROLL, FAST, U)
            out = g / (1.0 + tl.exp(-g)) * u
        else:
            g = _expert_rows(wv, lut_ptr, row_w, x_base, n_in, n_blocks, QTYPE, A, B, C, N_CHUNKS, BLOCK_N, UNROLL,
                             FAST, U, late_wait)
            out = g * tl.load(wts_ptr + r)
        tl.store(y_ptr + r.to(tl.int64) * stride_y + offs_n, out, mask=mask_n)


# (output rows per program, warps, unrolled chunk loop) of the two expert kernels, measured on an
# H200 with bench/engine_kernels.py (8 IQ4_XS experts of 768 x 2048, 16 layers per graph; docs/benchmarks.md,
# "Engine kernels at T = 1"). Reads over PCIe want many small programs (2,1 / 4,1: ~38 GB/s against ~26 for
# 8,4 / 16,4), reads from the slots larger ones (8,4 / 16,4 with the gate and up rows in one loop: 22.5 us
# against 32.5 us for 2,1 / 4,1). "miss" is used when a layer can miss, "hit" when every expert of every layer
# is cached. A fourth number, when given, is the IQ4_XS super-blocks per loop iteration of the byte-permute
# path (1 when left out). FLE_EXPERT_CONFIG="bn,warps,unroll[,chunks],bn,warps,unroll[,chunks]" (gate+up,
# down) overrides both (tuning).
EXPERT_CONFIG = {"miss": ((2, 1, 0), (4, 1, 0)), "hit": ((8, 4, 0, 2), (16, 4, 0))}
# Whether the expert kernels of each mode are launched with programmatic dependent launch (sm_90+; the
# down product then loads its first weights while the gate+up kernel ends). FLE_PDL=0 / 1 overrides both.
EXPERT_PDL = {"miss": False, "hit": False}
# With the byte-permute decoder, whether a program reads its gate and up rows in one loop, per mode:
# measured faster from the slots, slower over PCIe (36.4 against 37.9 GB/s at the miss launch).
PAIRED = {"miss": False, "hit": True}
# The IQ4_XS decoder of each mode: "permute" (byte permutes), "table" (a code-book load per value) or "select"
# (packed words; what Triton's interpreter and FLE_FAST_DECODE=0 run). Measured in one process on the H200
# (bench/engine_kernels.py, docs/benchmarks.md): over PCIe "table" reads 43.2 GB/s against 41.0 for "permute"
# (the link, not the decoder, sets the pace, and the table's loads hit L1); from slots "permute" is faster.
IQ4_DECODE = {"miss": "table", "hit": "permute"}
_DECODE_CODE = {"select": 0, "permute": 1, "table": 2}


def _mode_overrides() -> None:
    """Tuning: FLE_IQ4_DECODE="miss=permute,hit=permute" and FLE_PAIRED="miss=1" set
    ``IQ4_DECODE`` / ``PAIRED`` per mode for this process (as FLE_EXPERT_CONFIG sets the launch).
    Measured at the calibrated skew (docs/benchmarks.md, 2026-12-06): byte permutes in the miss
    launch, paired or not, with 4 or 8 super-blocks per iteration, made the decode step 60-72 %
    slower than the code-book table."""
    for var, table, conv in (("FLE_IQ4_DECODE", IQ4_DECODE, str), ("FLE_PAIRED", PAIRED, lambda v: v == "1")):
        for item in filter(None, os.environ.get(var, "").split(",")):
            mode, _, value = item.partition("=")
            if mode not in table or (table is IQ4_DECODE and value not in _DECODE_CODE):
                raise ValueError(f"{var}: {item!r} is not MODE=VALUE (modes {', '.join(table)})")
            table[mode] = conv(value)


_mode_overrides()


def _decode_code(mode: str) -> int:
    code = _DECODE_CODE[IQ4_DECODE[mode]]
    return 0 if code == 1 and not _tq.FAST_DECODE else code       # byte permutes need a GPU


def _expert_config(gate_up: bool, mode: str) -> tuple[int, int, int, int]:
    """(output rows per program, warps, unrolled, super-blocks per iteration) of one expert kernel."""
    env = os.environ.get("FLE_EXPERT_CONFIG")
    if env:
        v = [int(x) for x in env.split(",")]
        if len(v) not in (6, 8):
            raise ValueError("FLE_EXPERT_CONFIG takes 6 or 8 integers: bn,warps,unroll[,chunks] for gate+up, then down")
        w = len(v) // 2
        cfg = v[:w] if gate_up else v[w:]
    else:
        cfg = list(EXPERT_CONFIG[mode][0 if gate_up else 1])
    return tuple(cfg) + (1,) * (4 - len(cfg))


def pdl_enabled(mode: str) -> bool:
    """Whether the expert kernels of ``mode`` use programmatic dependent launch: FLE_PDL, else
    ``EXPERT_PDL``; never on the CPU (Triton's interpreter) or before sm_90."""
    env = os.environ.get("FLE_PDL")
    on = EXPERT_PDL[mode] if env is None else env == "1"
    return bool(on) and _tq.pdl_supported()


def experts(words: Tensor, qtype: GGMLType, host_delta: int, part_words: int, expert_words: int,
            n_out: int, row_bytes: int, slot_of: Tensor, ids: Tensor, x: Tensor, out: Tensor,
            gate_up: bool, n_used: int, weights: "Tensor | None" = None, mode: str = "miss",
            cpu_share: int = 0, x_miss: "Tensor | None" = None) -> Tensor:
    """One matrix product of the routed experts (see the module docstring).

    ``words``: the slot buffer viewed as the format's words; slot ``s`` of
    the layer starts ``s * expert_words`` words in, expert ``e``'s host copy
    ``host_delta + e * expert_words``; the matrix starts ``part_words`` into
    an expert. ``ids`` int64 ``[R]`` (R = tokens x n_used), ``x`` float32
    ``[T, n_in]`` (gate_up: token r // n_used) or ``[R, n_in]`` (down),
    ``out`` float32 ``[R, n_out]``; ``weights`` float32 ``[R]`` scale the
    down rows. ``mode``: the launch configuration, "miss" when rows may be
    read from host memory, "hit" when all are cached. ``cpu_share``
    (0..256): the rows that :mod:`fle_engine.runtime.split` gives the CPU
    are skipped (their down rows written as zeros). ``x_miss`` (like ``x``,
    optional): the activations that rows of missed experts read instead
    (:func:`round_acts`' copy, so that the GPU's misses multiply what the
    CPU kernels would)."""
    fmt = _FORMATS[qtype]
    values, size = BLOCK_GEOMETRY[qtype]
    n_blocks = row_bytes // size
    word = words.element_size()
    a, b, c = fmt.tile
    block_n, warps, unroll, chunks = _expert_config(gate_up, mode)
    pdl = pdl_enabled(mode) and x.is_cuda
    grid = (triton.cdiv(n_out, block_n), ids.shape[0])
    _expert_kernel[grid](
        words, _lut(qtype, fmt, words), slot_of, ids, out if weights is None else weights, x, out,
        host_delta, part_words, n_out, n_blocks * values, n_blocks, row_bytes // word, expert_words, n_used,
        x.stride(0), out.stride(0), int(cpu_share), _delta(x, x_miss),
        QTYPE=int(qtype), A=a, B=b, C=c, N_CHUNKS=triton.cdiv(n_blocks, fmt.blocks_per_chunk),
        BLOCK_N=block_n, GATE_UP=gate_up, UNROLL=bool(unroll), SPLIT=cpu_share > 0,
        KP=triton.next_power_of_2(n_used), FAST=_decode_code(mode), PAIRED=PAIRED[mode], U=chunks, GDC=pdl,
        num_warps=warps, **({"launch_pdl": True} if pdl else {}))
    return out


def _delta(x: Tensor, other: "Tensor | None") -> int:
    """Elements from ``x`` to ``other`` (same dtype and strides), 0 without one."""
    if other is None:
        return 0
    if other.dtype != x.dtype or other.stride() != x.stride() or other.shape != x.shape:
        raise ValueError("x_miss must have the shape, strides and dtype of x")
    diff = other.data_ptr() - x.data_ptr()
    assert diff % x.element_size() == 0
    return diff // x.element_size()


# ---------------------------------------------------------------------------
# activations rounded as the CPU kernels quantize them (ggml's vec_dot_type)


@triton.jit
def _rint(v):
    # round half to even for |v| < 2^22 (the codes here are at most ~128): the add rounds at the units place
    return (v + 12582912.0) - 12582912.0


@triton.jit
def _roundf(v):
    # round half away from zero, in float32 steps (fle_quant.quants.quant_util.np_roundf)
    a = tl.abs(v)
    fl = tl.floor(a)
    b = fl + tl.floor(2.0 * (a - fl))
    return tl.where(v > 0, b, tl.where(v < 0, -b, 0.0))


@triton.jit
def _round_acts_kernel(x_ptr, y_ptr, ids_ptr, slot_of_ptr, n, stride_x, stride_y, DOT_K: tl.constexpr,
                       BLOCK: tl.constexpr, ONLY_MISSES: tl.constexpr):
    r = tl.program_id(0)
    blk = tl.program_id(1)
    if ONLY_MISSES:
        go = tl.load(slot_of_ptr + tl.load(ids_ptr + r)) < 0
    else:
        go = r >= 0
    if go:
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + r.to(tl.int64) * stride_x + offs)
        ax = tl.abs(x)
        amax = tl.max(ax, axis=0)
        if DOT_K:
            # Q8_K: the scale -127 / (the value of largest |x|, its first occurrence), codes half to even, <= 127
            first = tl.min(tl.where(ax == amax, tl.arange(0, BLOCK), BLOCK), axis=0)
            mx = tl.sum(tl.where(tl.arange(0, BLOCK) == first, x, 0.0), axis=0)
            safe = tl.where(amax == 0.0, 1.0, mx)
            iscale = tl.math.div_rn(tl.full([], -127.0, tl.float32), safe)
            q = tl.minimum(_rint(iscale * x), 127.0)
            d = tl.math.div_rn(tl.full([], 1.0, tl.float32), iscale)
            y = tl.where(amax == 0.0, 0.0, d * q)
        else:
            # Q8_0: d = amax / 127 stored as fp16, codes x / d rounded half away from zero
            d = tl.math.div_rn(amax, tl.full([], 127.0, tl.float32))
            idv = tl.where(d == 0.0, 0.0, tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.where(d == 0.0, 1.0, d)))
            q = _roundf(x * idv)
            y = d.to(tl.float16).to(tl.float32) * q
        tl.store(y_ptr + r.to(tl.int64) * stride_y + offs, y)


def round_acts(x: Tensor, dot_k: bool, out: Tensor, ids: "Tensor | None" = None,
               slot_of: "Tensor | None" = None) -> Tensor:
    """Rows of ``x`` (float32 [R, n]) quantized to Q8_K (``dot_k``) or Q8_0
    and decoded again into ``out`` (may be ``x``): the values the CPU expert
    kernels multiply (:mod:`fle_engine.kernels.cpu_experts.acts`, ggml's
    quantizers). With ``ids`` [R] and ``slot_of``, only the rows whose
    expert is missed are written."""
    block = 256 if dot_k else 32
    n = x.shape[1]
    if n % block:
        raise ValueError(f"rows of {n} values do not split into blocks of {block}")
    only = ids is not None
    _round_acts_kernel[(x.shape[0], n // block)](
        x, out, ids if only else x, slot_of if only else x, n, x.stride(0), out.stride(0), DOT_K=dot_k,
        BLOCK=block, ONLY_MISSES=only, num_warps=1 if block == 32 else 2, enable_fp_fusion=False)
    return out


@triton.jit
def _union_n_cpu(ids_ptr, slot_of_ptr, n_rows, cpu_share, RP: tl.constexpr):
    """runtime.split's union rule on the n_rows (T x K) rows of a step: (the
    rows [RP], in range, their experts, missed, first row of a distinct
    missed expert, that count, the CPU's count of them)."""
    idx = tl.arange(0, RP)
    inr = idx < n_rows
    e = tl.load(ids_ptr + idx, mask=inr, other=-1)
    miss = (tl.load(slot_of_ptr + tl.where(inr, e, 0), mask=inr, other=0) < 0) & inr
    earlier = (e[:, None] == e[None, :]) & (idx[None, :] < idx[:, None])
    first = (tl.sum(earlier.to(tl.int32), axis=1) == 0) & inr
    dm = first & miss
    n_d = tl.sum(dm.to(tl.int32), axis=0)
    return idx, inr, e, miss, dm, n_d, (n_d * cpu_share + 128) // 256


@triton.jit
def _expert_union_kernel(wv, lut_ptr, slot_of_ptr, ids_ptr, wts_ptr, x_ptr, y_ptr, reads_ptr,
                         host_delta, part_words, n_out, n_in, n_blocks, row_words, expert_words, n_used, n_rows,
                         stride_x, stride_y, cpu_share, x_miss_delta,
                         QTYPE: tl.constexpr, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr,
                         N_CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr, GATE_UP: tl.constexpr, RP: tl.constexpr,
                         TP: tl.constexpr, LOG_READS: tl.constexpr, FAST: tl.constexpr = 0,
                         PAIRED: tl.constexpr = False, SPLIT: tl.constexpr = False):
    # Program (pid_n, r): if row r is the first row of its expert among the n_rows rows of the step, output
    # rows [pid_n * BLOCK_N, +BLOCK_N) of every row (at most TP) routed to that expert, each chunk of the
    # weights decoded once for all of them; otherwise nothing. Each distinct expert is read once. SPLIT: an
    # expert that runtime.split's union rule gives the CPU is not read (its down rows are written as zeros).
    pid_n = tl.program_id(0)
    r = tl.program_id(1)
    e = tl.load(ids_ptr + r)
    idx = tl.arange(0, RP)
    in_rows = idx < n_rows
    same = (tl.load(ids_ptr + idx, mask=in_rows, other=-1) == e) & in_rows
    owner = tl.sum((same & (idx < r)).to(tl.int32), axis=0) == 0
    if LOG_READS:
        if pid_n == 0:
            tl.store(reads_ptr + r, owner.to(tl.int32))
    if owner:
        s = tl.load(slot_of_ptr + e).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_out
        # the rows of this expert, in order: slot j of [TP] holds the j-th of them
        t_idx = tl.arange(0, TP)
        rank = tl.cumsum(same.to(tl.int32), axis=0) - 1
        pick = same[None, :] & (rank[None, :] == t_idx[:, None])              # [TP, RP]
        rows = tl.sum(tl.where(pick, idx[None, :], 0), axis=1)               # [TP]
        cnt = tl.sum(same.to(tl.int32), axis=0)          # <= TP: a token routes to an expert at most once
        valid = t_idx < cnt
        if SPLIT:
            u_idx, u_inr, u_e, u_miss, dm, n_d, n_cpu = _union_n_cpu(ids_ptr, slot_of_ptr, n_rows, cpu_share, RP)
            # this expert's place among the distinct misses: those first routed before row r
            before = tl.sum((dm & (idx < r)).to(tl.int32), axis=0)
            on_cpu = (s < 0) & (before >= n_d - n_cpu)
        else:
            on_cpu = False
        if on_cpu:
            if not GATE_UP:
                tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_y + offs_n[None, :],
                         tl.zeros([TP, BLOCK_N], tl.float32), mask=valid[:, None] & mask_n[None, :])
        else:
            # a cached expert is read from its slot, a missed one from host memory (host_delta words away)
            base = tl.where(s >= 0, s * expert_words, host_delta + e.to(tl.int64) * expert_words) + part_words
            row_w = base + tl.where(mask_n, offs_n, 0).to(tl.int64) * row_words
            # a missed expert reads its activations x_miss_delta elements away (their rounded copy) when given
            xb = x_ptr + tl.where(s < 0, x_miss_delta, 0)
            if GATE_UP:
                x_rows = rows // n_used
            else:
                x_rows = rows
            if GATE_UP:
                row_u = row_w + n_out.to(tl.int64) * row_words      # the up rows follow the gate rows
                if FAST == 1 and QTYPE == 23 and PAIRED:
                    # gate and up rows in one loop, each chunk decoded once for every row of the expert
                    gu = _iq4_union_rows(wv, tl.reshape(tl.join(row_w, row_u), [2 * BLOCK_N]), xb, x_rows, cnt,
                                         stride_x, N_CHUNKS, 2 * BLOCK_N, TP)
                    g, u = tl.split(tl.reshape(gu, [TP, BLOCK_N, 2]))
                elif FAST == 1 and QTYPE == 23:
                    g = _iq4_union_rows(wv, row_w, xb, x_rows, cnt, stride_x, N_CHUNKS, BLOCK_N, TP)
                    u = _iq4_union_rows(wv, row_u, xb, x_rows, cnt, stride_x, N_CHUNKS, BLOCK_N, TP)
                else:
                    g = _expert_rows_union(wv, lut_ptr, row_w, xb, x_rows, cnt, stride_x, n_in, n_blocks, QTYPE,
                                           A, B, C, N_CHUNKS, BLOCK_N, TP)
                    u = _expert_rows_union(wv, lut_ptr, row_u, xb, x_rows, cnt, stride_x, n_in, n_blocks, QTYPE,
                                           A, B, C, N_CHUNKS, BLOCK_N, TP)
                out = g / (1.0 + tl.exp(-g)) * u
            elif FAST == 1 and QTYPE == 23:
                g = _iq4_union_rows(wv, row_w, xb, x_rows, cnt, stride_x, N_CHUNKS, BLOCK_N, TP)
            else:
                g = _expert_rows_union(wv, lut_ptr, row_w, xb, x_rows, cnt, stride_x, n_in, n_blocks, QTYPE, A, B,
                                       C, N_CHUNKS, BLOCK_N, TP)
            if not GATE_UP:
                out = g * tl.load(wts_ptr + rows, mask=valid, other=0.0)[:, None]
            tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_y + offs_n[None, :], out,
                     mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _iq4_union_rows(wv, row_w, x_ptr, x_rows, cnt, stride_x, N_CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr,
                    TP: tl.constexpr):
    """[TP, BLOCK_N]: IQ4_XS rows times the first ``cnt`` activation rows of ``x_rows`` through the
    byte-permute decoder; an expert that one row alone routes to (the common case) takes the
    one-row loop, so that no products are computed for the empty slots."""
    t_idx = tl.arange(0, TP)
    if cnt == 1:
        x0 = tl.sum(tl.where(t_idx == 0, x_rows, 0), axis=0).to(tl.int64)
        y1 = _iq4_xs_rows_fast(wv, row_w, x_ptr + x0 * stride_x, N_CHUNKS, BLOCK_N)
        y = tl.where((t_idx == 0)[:, None], y1[None, :], 0.0)
    else:
        y = _iq4_xs_rows_fast_multi(wv, row_w, x_ptr, x_rows, cnt, stride_x, N_CHUNKS, BLOCK_N, TP)
    return y


@triton.jit
def _expert_rows_union(wv, lut_ptr, row_w, x_ptr, x_rows, cnt, stride_x, n_in, n_blocks, QTYPE: tl.constexpr,
                       A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, N_CHUNKS: tl.constexpr,
                       BLOCK_N: tl.constexpr, TP: tl.constexpr):
    """[TP, BLOCK_N] products of the rows at word offsets ``row_w`` with the
    first ``cnt`` activation rows of ``x_rows`` [TP] (the other slots are
    zeros): each chunk of weights decoded once, multiplied by every row."""
    k_in = _value_index(QTYPE, A, B, C)
    t_idx = tl.arange(0, TP)
    acc = tl.zeros([TP, BLOCK_N], dtype=tl.float32)
    for kc in range(0, N_CHUNKS):
        w = _decode(QTYPE, wv, lut_ptr, row_w, kc, n_blocks, A, B, C)
        k = kc * (A * B * C) + k_in
        for t in tl.static_range(TP):
            if t < cnt:
                sel = t_idx == t
                xr = tl.sum(tl.where(sel, x_rows, 0), axis=0).to(tl.int64)
                xt = tl.load(x_ptr + xr * stride_x + k, mask=k < n_in, other=0.0)
                yt = tl.sum(tl.sum(tl.sum(w * xt[None, :, :, :], axis=3), axis=2), axis=1)        # [BLOCK_N]
                acc += tl.where(sel[:, None], yt[None, :], 0.0)
    return acc


def experts_union(words: Tensor, qtype: GGMLType, host_delta: int, part_words: int, expert_words: int,
                  n_out: int, row_bytes: int, slot_of: Tensor, ids: Tensor, x: Tensor, out: Tensor,
                  gate_up: bool, n_used: int, weights: "Tensor | None" = None, mode: str = "miss",
                  reads: "Tensor | None" = None, cpu_share: int = 0, x_miss: "Tensor | None" = None) -> Tensor:
    """:func:`experts` for the R = T x n_used rows of a T-token step, each
    distinct expert read once (from its slot or from host memory) for all
    the rows routed to it: the program of the first row of an expert
    computes every row of that expert, the others do nothing. ``reads``
    (int32 [R], optional): 1 where a row's program read its expert, else 0
    (their sum is the number of distinct experts read). ``cpu_share``
    (0..256): the experts that runtime.split's union rule gives the CPU (the
    last of the step's distinct missed experts, in order of their first
    row) are skipped, their down rows written as zeros; ``x_miss`` as for
    :func:`experts`."""
    fmt = _FORMATS[qtype]
    values, size = BLOCK_GEOMETRY[qtype]
    n_blocks = row_bytes // size
    word = words.element_size()
    a, b, c = fmt.tile
    block_n, warps, _unroll, _chunks = _expert_config(gate_up, mode)
    n_rows = ids.shape[0]
    grid = (triton.cdiv(n_out, block_n), n_rows)
    _expert_union_kernel[grid](
        words, _lut(qtype, fmt, words), slot_of, ids, out if weights is None else weights, x, out,
        ids if reads is None else reads,
        host_delta, part_words, n_out, n_blocks * values, n_blocks, row_bytes // word, expert_words, n_used, n_rows,
        x.stride(0), out.stride(0), int(cpu_share), _delta(x, x_miss),
        QTYPE=int(qtype), A=a, B=b, C=c, N_CHUNKS=triton.cdiv(n_blocks, fmt.blocks_per_chunk),
        BLOCK_N=block_n, GATE_UP=gate_up, RP=triton.next_power_of_2(n_rows),
        TP=triton.next_power_of_2(max(1, n_rows // n_used)), LOG_READS=reads is not None, FAST=_decode_code(mode),
        PAIRED=PAIRED[mode], SPLIT=cpu_share > 0, num_warps=warps)
    return out


# ---------------------------------------------------------------------------
# misses handed to the CPU (fle_engine.runtime.split): post and wait

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _fence_sys(x):
    # orders this thread's earlier writes (to host memory) before its later ones, system-wide
    return tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _n_cpu(ids_ptr, slot_of_ptr, n_used, cpu_share, KP: tl.constexpr):
    kk = tl.arange(0, KP)
    km = kk < n_used
    e = tl.load(ids_ptr + kk, mask=km, other=0)
    miss = (tl.load(slot_of_ptr + e, mask=km, other=0) < 0) & km
    n_miss = tl.sum(miss.to(tl.int32), axis=0)
    return e, miss, (n_miss * cpu_share + 128) // 256


@triton.jit
def _post_kernel(xn_ptr, ids_ptr, wts_ptr, slot_of_ptr, serial_ptr, box_ptr, flag_ptr, rows_ptr, n, n_used,
                 cpu_share, KP: tl.constexpr, BLOCK: tl.constexpr):
    kk = tl.arange(0, KP)
    km = kk < n_used
    e, miss, n_cpu = _n_cpu(ids_ptr, slot_of_ptr, n_used, cpu_share, KP)
    serial = tl.load(serial_ptr)
    if n_cpu > 0:
        tl.store(rows_ptr, tl.full([], 1, tl.int64))           # one row (a T-row step may have posted more)
        tl.store(box_ptr + kk, e.to(tl.float32), mask=km)
        tl.store(box_ptr + n_used + kk, tl.load(wts_ptr + kk, mask=km, other=0.0), mask=km)
        tl.store(box_ptr + 2 * n_used + kk, miss.to(tl.float32), mask=km)
        for c in range(0, n, BLOCK):
            o = c + tl.arange(0, BLOCK)
            tl.store(box_ptr + 3 * n_used + o, tl.load(xn_ptr + o, mask=o < n, other=0.0), mask=o < n)
    n_cpu = _fence_sys(n_cpu)
    tl.debug_barrier()
    tl.store(flag_ptr, serial * 256 + n_cpu.to(tl.int64))


@triton.jit
def _await_done(done_ptr, serial, err_ptr, max_spin):
    # spin until the CPU's done word reads serial (at most max_spin looks); 1 when it did, else 0 and the error flag
    d = tl.load(done_ptr, volatile=True)
    i = 0
    while (d != serial) & (i < max_spin):
        d = tl.load(done_ptr, volatile=True)
        i += 1
    ok = _fence_sys((d == serial).to(tl.int32))
    if ok == 0:
        tl.store(err_ptr, 1)
    return ok


@triton.jit
def _wait_kernel(ids_ptr, slot_of_ptr, serial_ptr, done_ptr, res_ptr, out_ptr, err_ptr, n, n_used, cpu_share,
                 max_spin, KP: tl.constexpr, BLOCK: tl.constexpr):
    e, miss, n_cpu = _n_cpu(ids_ptr, slot_of_ptr, n_used, cpu_share, KP)
    serial = tl.load(serial_ptr)
    if n_cpu > 0:
        ok = _await_done(done_ptr, serial, err_ptr, max_spin)
        for c in range(0, n, BLOCK):
            o = c + tl.arange(0, BLOCK)
            v = tl.load(res_ptr + o, mask=o < n, other=0.0, volatile=True)
            tl.store(out_ptr + o, tl.where(ok != 0, v, 0.0), mask=o < n)
    else:
        for c in range(0, n, BLOCK):
            o = c + tl.arange(0, BLOCK)
            tl.store(out_ptr + o, tl.zeros([BLOCK], tl.float32), mask=o < n)


@triton.jit
def _post_rows_kernel(xn_ptr, ids_ptr, wts_ptr, slot_of_ptr, serial_ptr, box_ptr, flag_ptr, rows_ptr, n, n_rows,
                      n_tok, stride_x, cpu_share, RP: tl.constexpr, BLOCK: tl.constexpr):
    # a T-row step: the n_rows = T x K rows' ids, weights and miss flags, the T activations, T, then the flag
    idx, inr, e, miss, dm, n_d, n_cpu = _union_n_cpu(ids_ptr, slot_of_ptr, n_rows, cpu_share, RP)
    serial = tl.load(serial_ptr)
    if n_cpu > 0:
        tl.store(box_ptr + idx, e.to(tl.float32), mask=inr)
        tl.store(box_ptr + n_rows + idx, tl.load(wts_ptr + idx, mask=inr, other=0.0), mask=inr)
        tl.store(box_ptr + 2 * n_rows + idx, miss.to(tl.float32), mask=inr)
        for t in range(0, n_tok):
            for c in range(0, n, BLOCK):
                o = c + tl.arange(0, BLOCK)
                tl.store(box_ptr + 3 * n_rows + t * n + o, tl.load(xn_ptr + t * stride_x + o, mask=o < n, other=0.0),
                         mask=o < n)
        tl.store(rows_ptr, n_tok.to(tl.int64))
    n_cpu = _fence_sys(n_cpu)
    tl.debug_barrier()
    tl.store(flag_ptr, serial * 256 + n_cpu.to(tl.int64))


@triton.jit
def _wait_rows_kernel(ids_ptr, slot_of_ptr, serial_ptr, done_ptr, res_ptr, out_ptr, err_ptr, n, n_rows, n_tok,
                      stride_out, cpu_share, max_spin, RP: tl.constexpr, BLOCK: tl.constexpr):
    idx, inr, e, miss, dm, n_d, n_cpu = _union_n_cpu(ids_ptr, slot_of_ptr, n_rows, cpu_share, RP)
    serial = tl.load(serial_ptr)
    if n_cpu > 0:
        ok = _await_done(done_ptr, serial, err_ptr, max_spin)
        for t in range(0, n_tok):
            for c in range(0, n, BLOCK):
                o = c + tl.arange(0, BLOCK)
                v = tl.load(res_ptr + t * n + o, mask=o < n, other=0.0, volatile=True)
                tl.store(out_ptr + t * stride_out + o, tl.where(ok != 0, v, 0.0), mask=o < n)
    else:
        for t in range(0, n_tok):
            for c in range(0, n, BLOCK):
                o = c + tl.arange(0, BLOCK)
                tl.store(out_ptr + t * stride_out + o, tl.zeros([BLOCK], tl.float32), mask=o < n)


# the GPU gives up waiting for the CPU after this many reads of the done word (~1 us each over PCIe)
MAX_SPIN = 20_000_000


def post_misses(split, il: int, xn: Tensor, ids: Tensor, wts: Tensor, slot_of: Tensor, serial: Tensor) -> None:
    """Hand layer ``il``'s CPU share of the misses to the CPU worker (one
    token: ``xn`` [D], ``ids``/``wts`` [K]; a T-row step: ``xn`` [T, D],
    ``ids``/``wts`` [T K], split by the union rule)."""
    if _INTERPRET:
        from .engine_ops import post_misses_ref

        return post_misses_ref(split, il, xn, ids, wts, slot_of, serial)
    if xn.dim() == 2 and ids.numel() > split.n_used:
        n_tok, n = xn.shape
        _post_rows_kernel[(1,)](xn, ids, wts, slot_of, serial, split.box_ptr(il), split.flag_ptr(il),
                                split.rows_ptr(il), n, ids.numel(), n_tok, xn.stride(0), split.share,
                                RP=triton.next_power_of_2(ids.numel()), BLOCK=1024, num_warps=4)
        return
    n = xn.numel()
    _post_kernel[(1,)](xn, ids, wts, slot_of, serial, split.box_ptr(il), split.flag_ptr(il), split.rows_ptr(il), n,
                       ids.numel(), split.share, KP=triton.next_power_of_2(ids.numel()), BLOCK=1024, num_warps=4)


def wait_misses(split, il: int, ids: Tensor, slot_of: Tensor, serial: Tensor, out: Tensor) -> None:
    """Layer ``il``'s CPU result into ``out`` ([D], or [T, D] with any row
    stride for a T-row step; zeros when the CPU had nothing to do), waiting
    for the worker's done word."""
    if _INTERPRET:
        from .engine_ops import wait_misses_ref

        return wait_misses_ref(split, il, ids, slot_of, serial, out)
    if out.dim() == 2 and ids.numel() > split.n_used:
        n_tok, n = out.shape
        _wait_rows_kernel[(1,)](ids, slot_of, serial, split.done_ptr(il), split.result_ptr(il), out, split.err_ptr(),
                                n, ids.numel(), n_tok, out.stride(0), split.share, MAX_SPIN,
                                RP=triton.next_power_of_2(ids.numel()), BLOCK=1024, num_warps=4)
        return
    _wait_kernel[(1,)](ids, slot_of, serial, split.done_ptr(il), split.result_ptr(il), out, split.err_ptr(),
                       out.numel(), ids.numel(), split.share, MAX_SPIN, KP=triton.next_power_of_2(ids.numel()),
                       BLOCK=1024, num_warps=4)


# ---------------------------------------------------------------------------
# routing


@triton.jit
def _topk_kernel(logits_ptr, slot_of_ptr, ids_ptr, w_ptr, log_ptr, hit_ptr, n_expert, scale,
                 K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, SCALE: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    m = offs < n_expert
    lg = tl.load(logits_ptr + t * n_expert + offs, mask=m, other=float("-inf"))
    p = tl.exp(lg - tl.max(lg, axis=0))
    p = tl.where(m, p, 0.0)
    p = p / tl.sum(p, axis=0)
    work = tl.where(m, p, -1.0)
    kk = tl.arange(0, KP)
    vals = tl.zeros([KP], dtype=tl.float32)
    idx = tl.zeros([KP], dtype=tl.int32)
    for i in tl.static_range(K):
        v = tl.max(work, axis=0)
        j = tl.argmax(work, axis=0)
        vals = tl.where(kk == i, v, vals)
        idx = tl.where(kk == i, j, idx)
        work = tl.where(offs == j, -1.0, work)
    km = kk < K
    wts = vals / tl.maximum(tl.sum(tl.where(km, vals, 0.0), axis=0), 6.103515625e-5)
    if SCALE:
        wts = wts * scale
    o = t * K + kk
    tl.store(ids_ptr + o, idx.to(tl.int64), mask=km)
    tl.store(w_ptr + o, wts, mask=km)
    tl.store(log_ptr + o, idx, mask=km)
    hit = tl.load(slot_of_ptr + idx, mask=km, other=-1) >= 0
    tl.store(hit_ptr + o, hit.to(tl.int32), mask=km)


def route_topk(logits: Tensor, n_used: int, scale: float, slot_of: Tensor, ids: Tensor, weights: Tensor,
               log: Tensor, hits: Tensor) -> None:
    """``logits`` float32 [T, E] -> ``ids`` int64 [T, K], ``weights`` float32
    [T, K]; ``log`` int32 and ``hits`` int32 [T, K] record the ids and
    whether ``slot_of`` (int32 [E]) had them."""
    n_tok, n_exp = logits.shape
    _topk_kernel[(n_tok,)](logits, slot_of, ids, weights, log, hits, n_exp, float(scale),
                           K=n_used, KP=triton.next_power_of_2(n_used), BLOCK_E=triton.next_power_of_2(n_exp),
                           SCALE=scale not in (0.0, 1.0), num_warps=4)


# ---------------------------------------------------------------------------
# prefetch of predicted misses (runtime.stage)


@triton.jit
def _stage_pick_kernel(logits_ptr, slot_of_ptr, stage_ptr, n_expert, K: tl.constexpr, R: tl.constexpr,
                       RP: tl.constexpr, BLOCK_E: tl.constexpr):
    offs = tl.arange(0, BLOCK_E)
    work = tl.load(logits_ptr + offs, mask=offs < n_expert, other=float("-inf"))
    rr = tl.arange(0, RP)
    out = tl.full([RP], -1, tl.int32)
    cnt = 0
    for i in tl.static_range(K):
        j = tl.argmax(work, axis=0)
        work = tl.where(offs == j, float("-inf"), work)
        take = (tl.load(slot_of_ptr + j) < 0) & (cnt < R)
        out = tl.where((rr == cnt) & take, j, out)
        cnt += take.to(tl.int32)
    tl.store(stage_ptr + rr, out, mask=rr < R)


def stage_pick(logits: Tensor, slot_of: Tensor, n_used: int, stage: Tensor) -> None:
    """The first ``len(stage)`` experts missing from ``slot_of`` among the
    top ``n_used`` of ``logits`` (float32 [E], highest first, ties to the
    lower id) into ``stage`` (int32 [R], -1 where fewer)."""
    n_exp = logits.shape[-1]
    r = stage.shape[0]
    _stage_pick_kernel[(1,)](logits, slot_of, stage, n_exp, K=n_used, R=r, RP=triton.next_power_of_2(r),
                             BLOCK_E=triton.next_power_of_2(n_exp), num_warps=4)


@triton.jit
def _stage_copy_kernel(words_ptr, stage_ptr, host_delta, expert_words, first_slot, CHUNK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    e = tl.load(stage_ptr + r)
    if e >= 0:
        offs = c * CHUNK + tl.arange(0, CHUNK)
        m = offs < expert_words
        v = tl.load(words_ptr + host_delta + e.to(tl.int64) * expert_words + offs, mask=m)
        tl.store(words_ptr + (first_slot + r).to(tl.int64) * expert_words + offs, v, mask=m)


STAGE_CHUNK = 4096


def stage_copy(words: Tensor, host_delta: int, expert_words: int, stage: Tensor, first_slot: int) -> None:
    """Experts ``stage`` (int32 [R], -1: none) from host memory (``host_delta``
    words from ``words``, as :func:`experts` reads misses) into slots
    ``first_slot .. first_slot + R - 1`` of ``words``."""
    grid = (stage.shape[0], triton.cdiv(expert_words, STAGE_CHUNK))
    _stage_copy_kernel[grid](words, stage, host_delta, expert_words, first_slot, CHUNK=STAGE_CHUNK, num_warps=4)


@triton.jit
def _stage_apply_kernel(prev_map_ptr, prev_stage_ptr, map_ptr, stage_ptr, ids_ptr, count_ptr, first_slot,
                        K: tl.constexpr, KP: tl.constexpr, R: tl.constexpr, RP: tl.constexpr,
                        PREV: tl.constexpr, CUR: tl.constexpr):
    rr = tl.arange(0, RP)
    mr = rr < R
    if PREV:
        pe = tl.load(prev_stage_ptr + rr, mask=mr, other=-1)
        tl.store(prev_map_ptr + pe, tl.full([RP], -1, tl.int32), mask=mr & (pe >= 0))
    if CUR:
        e = tl.load(stage_ptr + rr, mask=mr, other=-1)
        ok = mr & (e >= 0)
        tl.store(map_ptr + e, first_slot + rr, mask=ok)
        kk = tl.arange(0, KP)
        ids = tl.load(ids_ptr + kk, mask=kk < K, other=-2).to(tl.int32)
        used = tl.sum(tl.where(e[:, None] == ids[None, :], 1, 0), axis=1) > 0
        tl.atomic_add(count_ptr, tl.sum(ok.to(tl.int64), axis=0))
        tl.atomic_add(count_ptr + 1, tl.sum((ok & used).to(tl.int64), axis=0))


def stage_apply(prev_map: "Tensor | None", prev_stage: "Tensor | None", slot_of: "Tensor | None",
                stage: "Tensor | None", ids: "Tensor | None", counts: Tensor, first_slot: int) -> None:
    """Take the previous layer's prefetched experts out of its map
    (``prev_map``, ``prev_stage``) and put this layer's in (``slot_of``
    [E]: ``stage[r]`` -> slot ``first_slot + r``); ``counts`` (int64 [2])
    gains the experts put in and those of them that ``ids`` (int64 [K],
    this layer's routed ids) use."""
    ref = stage if stage is not None else prev_stage
    r = ref.shape[0]
    k = ids.shape[-1] if ids is not None else 1
    _stage_apply_kernel[(1,)](prev_map if prev_map is not None else counts, ref if prev_stage is None else prev_stage,
                              slot_of if slot_of is not None else counts, ref, ids if ids is not None else counts,
                              counts, first_slot, K=k, KP=triton.next_power_of_2(k), R=r,
                              RP=triton.next_power_of_2(r), PREV=prev_map is not None, CUR=slot_of is not None,
                              num_warps=1)


# ---------------------------------------------------------------------------
# residual + norm


@triton.jit
def _add_rmsnorm_kernel(x_ptr, parts_ptr, w_ptr, xn_ptr, n, eps, N_PARTS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + t * n + offs, mask=m, other=0.0)
    for i in tl.static_range(N_PARTS):
        x += tl.load(parts_ptr + (t * N_PARTS + i) * n + offs, mask=m, other=0.0)
    if N_PARTS > 0:
        tl.store(x_ptr + t * n + offs, x, mask=m)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    tl.store(xn_ptr + t * n + offs, x * r * w, mask=m)


def add_rmsnorm(x: Tensor, parts: "Tensor | None", weight: Tensor, eps: float, out: Tensor) -> None:
    """``x`` [T, D] += the sum of ``parts`` [T, P, D] (in place), then
    ``out`` = rms_norm(x) * weight."""
    n_tok, n = x.shape
    n_parts = 0 if parts is None else parts.shape[1]
    _add_rmsnorm_kernel[(n_tok,)](x, x if parts is None else parts, weight, out, n, float(eps),
                                  N_PARTS=n_parts, BLOCK=triton.next_power_of_2(n), num_warps=8)


# ---------------------------------------------------------------------------
# float products of a few rows (the router, the shared expert's gate, float dense matrices)

FLOAT_MV_MAX_ROWS = 8       # more rows (prefill) of a float32 matrix: torch's matmul
FLOAT_MV_GROUP = 4          # rows per program that read one weight tile, for 16-bit matrices


@triton.jit
def _float_mv_kernel(x_ptr, w_ptr, y_ptr, n_tok, n_out, n_in, stride_x, stride_y, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    # program (pid_n, pid_t): outputs [pid_n * BLOCK_N, +BLOCK_N) of rows [pid_t * ROWS, +ROWS), each a dot
    # product over n_in; the weights (any float type) widened to float32 in registers, loaded once for the
    # ROWS rows
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * n_in
    if ROWS == 1:
        t = tl.program_id(1).to(tl.int64)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, n_in, BLOCK_K):
            k = k0 + offs_k
            mask_k = k < n_in
            w = tl.load(w_rows + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            xv = tl.load(x_ptr + t * stride_x + k, mask=mask_k, other=0.0)
            acc += w * xv[None, :]
        tl.store(y_ptr + t * stride_y + offs_n, tl.sum(acc, axis=1), mask=mask_n)
    else:
        offs_t = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        mask_t = offs_t < n_tok
        x_rows = x_ptr + offs_t.to(tl.int64)[:, None] * stride_x
        acc3 = tl.zeros([ROWS, BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, n_in, BLOCK_K):
            k = k0 + offs_k
            mask_k = k < n_in
            w = tl.load(w_rows + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            xv = tl.load(x_rows + k[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0)
            acc3 += w[None, :, :] * xv[:, None, :]
        y_rows = y_ptr + offs_t.to(tl.int64)[:, None] * stride_y
        tl.store(y_rows + offs_n[None, :], tl.sum(acc3, axis=2), mask=mask_t[:, None] & mask_n[None, :])


def float_mv(x: Tensor, w: Tensor, out: Tensor) -> Tensor:
    """``out`` [T, n_out] = x [T, n_in] @ w.T (float32) for a contiguous
    float matrix ``w`` [n_out, n_in] (float32, float16 or bfloat16, read as
    it is stored and widened to float32 in registers; the products and
    sums in float32).

    A float32 matrix (the router): one launch of ~256 programs, one row
    each, for up to FLOAT_MV_MAX_ROWS rows, where cuBLAS picked a split-K
    product and a reduction kernel for the router (~15-20 us per layer on
    the H100 for a 4 MiB matrix); torch's matmul for more rows. On the
    H100 the 30B-A3B step's router takes 129 us in this launch against
    212 us in cuBLAS's two kernels (docs/benchmarks.md, 2026-12-06).

    A 16-bit matrix (F16/BF16 dense weights, kept in their GGUF bytes):
    this launch for any T, each program multiplying its weight tile with
    up to FLOAT_MV_GROUP rows, so that T rows read the matrix ceil(T /
    FLOAT_MV_GROUP) times rather than T times (torch would need a float32
    copy of the matrix).

    FLE_FLOAT_MV=0 selects the reference (torch's matmul, a 16-bit matrix
    widened for each call)."""
    n_tok, n_in = x.shape
    n_out = w.shape[0]
    wide = w.dtype == torch.float32
    if (wide and n_tok > FLOAT_MV_MAX_ROWS) or os.environ.get("FLE_FLOAT_MV", "1") == "0" or not w.is_contiguous() \
            or x.stride(1) != 1 or out.stride(1) != 1 or w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return float_mv_ref(x, w, out)
    block_n = 1
    while block_n < 8 and n_out // (2 * block_n) >= 256:
        block_n *= 2
    rows = 1 if wide or n_tok == 1 else min(FLOAT_MV_GROUP, triton.next_power_of_2(n_tok))
    block_k = min(1024 // rows, 512, triton.next_power_of_2(n_in))     # <= 64 float32 accumulators a thread
    _float_mv_kernel[(triton.cdiv(n_out, block_n), triton.cdiv(n_tok, rows))](
        x, w, out, n_tok, n_out, n_in, x.stride(0), out.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, ROWS=rows,
        num_warps=4)
    return out


# ---------------------------------------------------------------------------
# q/k norm, rotary, KV write


@triton.jit
def _store_q8(q_ptr, d_ptr, row, y, DH: tl.constexpr):
    """ggml's q8_0 of one head row ``y`` [DH]: per 32 values d = amax / 127,
    values round(y / d) half away from zero, d stored as float16."""
    yb = tl.reshape(y, (DH // 32, 32))
    d = tl.max(tl.abs(yb), axis=1) / 127.0
    inv = tl.where(d > 0, 1.0 / tl.where(d > 0, d, 1.0), 0.0)
    v = yb * inv[:, None]
    q = tl.where(v >= 0, tl.floor(v + 0.5), tl.ceil(v - 0.5))
    tl.store(q_ptr + row * DH + tl.arange(0, DH), tl.reshape(q, (DH,)).to(tl.int8))
    tl.store(d_ptr + row * (DH // 32) + tl.arange(0, DH // 32), d.to(tl.float16))


@triton.jit
def _qk_rope_kv_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_cache, v_cache, kd_ptr, vd_ptr,
                       lane_ptr, n_head, n_kv, n_pos, eps, stride_qkv, stride_q, DH: tl.constexpr, NROT: tl.constexpr,
                       HAS_NORM: tl.constexpr, K_Q8: tl.constexpr, V_Q8: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.program_id(1)
    if ROWS:                                 # row t of a batched step: its own position, in its lane's cache
        pos = tl.load(pos_ptr + t).to(tl.int64)
        head0 = tl.load(lane_ptr + t).to(tl.int64) * n_kv
    else:                                    # token t of the step sits at position pos + t
        pos = tl.load(pos_ptr).to(tl.int64) + t
        head0 = 0
    qkv_ptr += t.to(tl.int64) * stride_qkv
    q_ptr += t.to(tl.int64) * stride_q
    d = tl.arange(0, DH)
    half: tl.constexpr = NROT // 2
    if pid < n_head + n_kv:
        is_q = pid < n_head
        base = pid * DH
        x = tl.load(qkv_ptr + base + d)
        partner = tl.where(d < half, d + half, tl.where(d < NROT, d - half, d))
        xp = tl.load(qkv_ptr + base + partner)
        if HAS_NORM:
            r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / DH + eps)
            wn = tl.where(is_q, tl.load(qn_ptr + d), tl.load(kn_ptr + d))
            wp = tl.where(is_q, tl.load(qn_ptr + partner), tl.load(kn_ptr + partner))
            x = x * r * wn
            xp = xp * r * wp
        i = tl.where(d < half, d, d - half)
        c = tl.load(cos_ptr + pos * half + i, mask=d < NROT, other=1.0)
        s = tl.load(sin_ptr + pos * half + i, mask=d < NROT, other=0.0)
        y = tl.where(d < half, x * c - xp * s, tl.where(d < NROT, x * c + xp * s, x))
        if is_q:
            tl.store(q_ptr + base + d, y)
        else:
            j = head0 + (pid - n_head).to(tl.int64)
            if K_Q8:
                _store_q8(k_cache, kd_ptr, j * n_pos + pos, y, DH)
            else:
                tl.store(k_cache + (j * n_pos + pos) * DH + d, y.to(k_cache.dtype.element_ty))
    else:
        jv = (pid - n_head - n_kv).to(tl.int64)
        j = head0 + jv
        v = tl.load(qkv_ptr + (n_head + n_kv) * DH + jv * DH + d)
        if V_Q8:
            _store_q8(v_cache, vd_ptr, j * n_pos + pos, v, DH)
        else:
            tl.store(v_cache + (j * n_pos + pos) * DH + d, v.to(v_cache.dtype.element_ty))


def qk_rope_kv(qkv: Tensor, q_norm: "Tensor | None", k_norm: "Tensor | None", eps: float, cos: Tensor, sin: Tensor,
               pos: Tensor, n_head: int, n_kv: int, head_dim: int, n_rot: int, q_out: Tensor,
               k_cache: Tensor, v_cache: Tensor) -> None:
    """One decode token: ``qkv`` float32 [(H + 2 Hkv) Dh] -> ``q_out`` [H Dh]
    normed and rotated; k (normed, rotated) and v written at ``pos`` into
    ``k_cache``/``v_cache`` [Hkv, P, Dh]."""
    _qk_rope_kv_launch(qkv, q_norm, k_norm, eps, cos, sin, pos, n_head, n_kv, head_dim, n_rot, q_out, k_cache,
                       v_cache, 1, 0, 0)


def qk_rope_kv_multi(qkv: Tensor, q_norm: "Tensor | None", k_norm: "Tensor | None", eps: float, cos: Tensor,
                     sin: Tensor, pos: Tensor, n_head: int, n_kv: int, head_dim: int, n_rot: int, q_out: Tensor,
                     k_cache: Tensor, v_cache: Tensor, lanes: "Tensor | None" = None) -> None:
    """:func:`qk_rope_kv` for T tokens at positions pos .. pos + T - 1:
    ``qkv`` float32 [T, >= (H + 2 Hkv) Dh] (rows may be wider), ``q_out``
    [T, H Dh]; every token's k and v written at its position. ``lanes``
    (int64 [T]): row t is at position ``pos[t]`` of lane ``lanes[t]`` of
    lane-stacked caches [N, Hkv, P, Dh]."""
    _qk_rope_kv_launch(qkv, q_norm, k_norm, eps, cos, sin, pos, n_head, n_kv, head_dim, n_rot, q_out, k_cache,
                       v_cache, qkv.shape[0], qkv.stride(0), q_out.stride(0), lanes)


def _qk_rope_kv_launch(qkv, q_norm, k_norm, eps, cos, sin, pos, n_head, n_kv, head_dim, n_rot, q_out, k_cache,
                       v_cache, n_tok, stride_qkv, stride_q, lanes=None) -> None:
    has_norm = q_norm is not None
    (kq, kd, k8), (vq, vd, v8) = _kv_parts(k_cache), _kv_parts(v_cache)
    _qk_rope_kv_kernel[(n_head + 2 * n_kv, n_tok)](
        qkv, q_norm if has_norm else qkv, k_norm if has_norm else qkv, cos, sin, pos, q_out, kq, vq, kd, vd,
        pos if lanes is None else lanes, n_head, n_kv, k_cache.shape[-2], float(eps), stride_qkv, stride_q,
        DH=head_dim, NROT=n_rot, HAS_NORM=has_norm, K_Q8=k8, V_Q8=v8, ROWS=lanes is not None, num_warps=1)


def _kv_parts(cache):
    """(values, scales, is q8_0) of a KV cache: a tensor, or a Q8Cache."""
    from .engine_ops import Q8Cache

    if isinstance(cache, Q8Cache):
        return cache.q, cache.d, True
    return cache, cache, False


# ---------------------------------------------------------------------------
# decode attention over the used length


@triton.jit
def _attn_split_kernel(q_ptr, k_ptr, v_ptr, kd_ptr, vd_ptr, pos_ptr, o_ptr, ml_ptr, keep_ptr, lane_ptr, ratio,
                       stride_keep, n_pos, scale, group, stride_q, GP: tl.constexpr, DH: tl.constexpr,
                       BLOCK_P: tl.constexpr, N_SPLIT: tl.constexpr, HAS_KEEP: tl.constexpr, K_Q8: tl.constexpr,
                       V_Q8: tl.constexpr, ROWS: tl.constexpr):
    kvh = tl.program_id(0)
    sp = tl.program_id(1)
    t = tl.program_id(2)
    if ROWS:                                 # row t of a batched step: positions 0 .. pos[t] of its lane
        length = tl.load(pos_ptr + t).to(tl.int32) + 1
        head = tl.load(lane_ptr + t).to(tl.int64) * tl.num_programs(0) + kvh
    else:                                    # token t of the step sees positions 0 .. pos + t
        length = tl.load(pos_ptr).to(tl.int32) + 1 + t
        head = kvh.to(tl.int64)
    q_ptr += t.to(tl.int64) * stride_q
    keep_ptr += t.to(tl.int64) * stride_keep          # token t's own block mask (0: one mask for all)
    rows_t = tl.num_programs(0) * N_SPLIT * GP           # scratch rows per token
    o_ptr += t.to(tl.int64) * rows_t * DH
    ml_ptr += t.to(tl.int64) * rows_t * 2
    chunk = (length + N_SPLIT - 1) // N_SPLIT
    start = sp * chunk
    end = tl.minimum(start + chunk, length)
    g = tl.arange(0, GP)
    gm = g < group
    d = tl.arange(0, DH)
    q = tl.load(q_ptr + (kvh * group + g)[:, None] * DH + d[None, :], mask=gm[:, None], other=0.0)
    m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, DH], dtype=tl.float32)
    kbase = k_ptr + head * n_pos * DH
    vbase = v_ptr + head * n_pos * DH
    p0 = start
    while p0 < end:
        p = p0 + tl.arange(0, BLOCK_P)
        pm = p < end
        off = p.to(tl.int64)[:, None] * DH + d[None, :]
        kt = tl.load(kbase + off, mask=pm[:, None], other=0.0).to(tl.float32)
        if K_Q8 or V_Q8:
            doff = (head * n_pos + p.to(tl.int64))[:, None] * (DH // 32) + (d // 32)[None, :]
        if K_Q8:
            kt = kt * tl.load(kd_ptr + doff, mask=pm[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * kt[None, :, :], axis=2) * scale
        if HAS_KEEP:
            pm = pm & (tl.load(keep_ptr + p // ratio, mask=pm, other=0) != 0)
        s = tl.where(pm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if HAS_KEEP:    # a chunk with no kept position leaves m at -inf
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_new)
        pr = tl.exp(s - m_new[:, None])
        vt = tl.load(vbase + off, mask=pm[:, None], other=0.0).to(tl.float32)
        if V_Q8:
            vt = vt * tl.load(vd_ptr + doff, mask=pm[:, None], other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + tl.sum(pr[:, :, None] * vt[None, :, :], axis=1)
        m_i = m_new
        p0 += BLOCK_P
    row = (kvh * N_SPLIT + sp) * GP + g
    tl.store(o_ptr + row[:, None] * DH + d[None, :], acc)
    tl.store(ml_ptr + row * 2, m_i)
    tl.store(ml_ptr + row * 2 + 1, l_i)


@triton.jit
def _attn_reduce_kernel(o_ptr, ml_ptr, out_ptr, group, stride_out, GP: tl.constexpr, DH: tl.constexpr,
                        N_SPLIT: tl.constexpr):
    h = tl.program_id(0)
    t = tl.program_id(1)
    rows_t = tl.num_programs(0) // group * N_SPLIT * GP
    o_ptr += t.to(tl.int64) * rows_t * DH
    ml_ptr += t.to(tl.int64) * rows_t * 2
    out_ptr += t.to(tl.int64) * stride_out
    kvh = h // group
    g = h % group
    sp = tl.arange(0, N_SPLIT)
    d = tl.arange(0, DH)
    row = (kvh * N_SPLIT + sp) * GP + g
    m = tl.load(ml_ptr + row * 2)
    l = tl.load(ml_ptr + row * 2 + 1)
    mx = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - mx))
    acc = tl.load(o_ptr + row[:, None] * DH + d[None, :])
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
    tl.store(out_ptr + h * DH + d, out)


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor, scale: float, out: Tensor,
              partial: Tensor, ml: Tensor, keep: "Tensor | None" = None, ratio: int = 0) -> None:
    """Decode attention of one token: ``q`` float32 [H Dh] against positions
    0..pos of ``k_cache``/``v_cache`` [Hkv, P, Dh] -> ``out`` [H Dh].
    ``partial`` float32 [Hkv * ATTN_SPLITS * GP, Dh] and ``ml`` float32
    [Hkv * ATTN_SPLITS * GP, 2] are scratch (GP: query heads per KV head,
    rounded up to a power of two). ``keep`` (int32 [ceil(P / ratio)], on the
    device): only positions whose block of ``ratio`` is kept count."""
    _attn_launch(q, k_cache, v_cache, pos, scale, out, partial, ml, keep, ratio, 1, 0, 0)


def attention_multi(q: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor, scale: float, out: Tensor,
                    partial: Tensor, ml: Tensor, keep: "Tensor | None" = None, ratio: int = 0,
                    lanes: "Tensor | None" = None) -> None:
    """Causal attention of T tokens at positions pos .. pos + T - 1 (their
    keys and values already in the cache): token t of ``q`` float32
    [T, H Dh] sees positions 0 .. pos + t -> ``out`` [T, H Dh]; the scratch
    from :func:`attn_scratch` with ``n_tok`` >= T. Each token is one
    decode attention (the same splits over its own length); the keys of the
    shared prefix are read once per token, mostly from L2. ``keep`` (int32
    [T, NB], rows of one stride): token t's block mask, as
    :func:`attention`'s. ``lanes`` (int64 [T]): row t sees positions
    0 .. ``pos[t]`` of lane ``lanes[t]`` of lane-stacked caches
    [N, Hkv, P, Dh] (a batched step of several sequences)."""
    _attn_launch(q[0], k_cache, v_cache, pos, scale, out[0], partial, ml, keep, ratio, q.shape[0], q.stride(0),
                 out.stride(0), lanes)


def _attn_launch(q, k_cache, v_cache, pos, scale, out, partial, ml, keep, ratio, n_tok, stride_q,
                 stride_out, lanes=None) -> None:
    n_kv, n_pos, dh = k_cache.shape[-3:]
    group = q.numel() // dh // n_kv
    gp = triton.next_power_of_2(group)
    (kq, kd, k8), (vq, vd, v8) = _kv_parts(k_cache), _kv_parts(v_cache)
    stride_keep = keep.stride(0) if keep is not None and keep.dim() == 2 else 0
    _attn_split_kernel[(n_kv, ATTN_SPLITS, n_tok)](q, kq, vq, kd, vd, pos, partial, ml,
                                                   pos if keep is None else keep, pos if lanes is None else lanes,
                                                   max(1, int(ratio)), stride_keep, n_pos,
                                                   float(scale), group, stride_q, GP=gp, DH=dh, BLOCK_P=16,
                                                   N_SPLIT=ATTN_SPLITS, HAS_KEEP=keep is not None, K_Q8=k8,
                                                   V_Q8=v8, ROWS=lanes is not None, num_warps=4)
    _attn_reduce_kernel[(n_kv * group, n_tok)](partial, ml, out, group, stride_out, GP=gp, DH=dh,
                                               N_SPLIT=ATTN_SPLITS, num_warps=2)


def attn_scratch(n_kv: int, n_head: int, head_dim: int, device, n_tok: int = 1) -> tuple[Tensor, Tensor]:
    """Scratch of :func:`attention` (``n_tok`` 1) or :func:`attention_multi`
    (up to ``n_tok`` tokens)."""
    gp = triton.next_power_of_2(n_head // n_kv)
    rows = n_tok * n_kv * ATTN_SPLITS * gp
    return (torch.zeros(rows, head_dim, dtype=torch.float32, device=device),
            torch.zeros(rows, 2, dtype=torch.float32, device=device))


# ---------------------------------------------------------------------------
# embedding row of a quantized table


@triton.jit
def _embed_kernel(wv, lut_ptr, tok_ptr, x_ptr, n_in, n_blocks, row_words,
                  QTYPE: tl.constexpr, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    kc = tl.program_id(0)
    tok = tl.load(tok_ptr).to(tl.int64)
    row_w = tok * row_words + tl.zeros([1], dtype=tl.int64)
    w = _decode(QTYPE, wv, lut_ptr, row_w, kc, n_blocks, A, B, C)   # [1, A, B, C]
    k = kc * (A * B * C) + _value_index(QTYPE, A, B, C)
    tl.store(x_ptr + k[None, :, :, :], w, mask=(k < n_in)[None, :, :, :])


def embed_row(table: Tensor, qtype: GGMLType, tok: Tensor, out: Tensor) -> None:
    """``out`` float32 [D] = row ``tok`` (int64 [1] on the device) of a
    quantized table's raw rows ``table`` uint8 [V, row_bytes]."""
    fmt = _FORMATS[qtype]
    values, size = BLOCK_GEOMETRY[qtype]
    n_blocks = table.shape[1] // size
    words = table.view(fmt.word)
    a, b, c = fmt.tile
    _embed_kernel[(triton.cdiv(n_blocks, fmt.blocks_per_chunk),)](
        words, _lut(qtype, fmt, table), tok, out, n_blocks * values, n_blocks, table.shape[1] // words.element_size(),
        QTYPE=int(qtype), A=a, B=b, C=c, num_warps=1)


# ---------------------------------------------------------------------------
# hyper-connections


@triton.jit
def _hc_write_norm_kernel(res_ptr, parts_ptr, inj_ptr, w_ptr, out_ptr, n, n_streams, eps, inv_streams,
                          N_PARTS: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.program_id(0)                   # stream s of token t: row t * S + s of res, inject and out
    t = tl.program_id(1)
    row = (t * n_streams + s).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(res_ptr + row * n + offs, mask=m, other=0.0)
    if N_PARTS > 0:
        y = tl.zeros([BLOCK], dtype=tl.float32)
        base = parts_ptr + t.to(tl.int64) * N_PARTS * n
        for i in tl.static_range(N_PARTS):
            y += tl.load(base + i * n + offs, mask=m, other=0.0)
        inj = tl.load(inj_ptr + row)
        x += 2.0 / (1.0 + tl.exp(-inj * inv_streams)) * y
        tl.store(res_ptr + row * n + offs, x, mask=m)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + s * n + offs, mask=m, other=0.0)
    tl.store(out_ptr + row * n + offs, x * r * w, mask=m)


def hc_write_norm(res: Tensor, parts: "Tensor | None", inject: "Tensor | None", n_streams: int, weight: Tensor,
                  eps: float, out: Tensor) -> None:
    """The hyper-connection write and the next read's norm in one kernel:
    ``res`` [S, D] (in place) += 2 sigmoid(``inject`` [S] / S) * the sum of
    ``parts`` [1, P, D]; ``out`` [S, D] = per-stream RMSNorm(res) * ``weight``
    [S, D]. T tokens in one launch: ``res``/``out`` [T, S, D], ``parts``
    [T, P, D], ``inject`` [T, S] (all contiguous)."""
    s, n = res.shape[-2:]
    n_tok = res.numel() // (s * n)
    n_parts = 0 if parts is None else parts.shape[1]
    _hc_write_norm_kernel[(s, n_tok)](res, res if parts is None else parts, res if inject is None else inject, weight,
                                      out, n, s, float(eps), 1.0 / n_streams, N_PARTS=n_parts,
                                      BLOCK=triton.next_power_of_2(n), num_warps=8)


@triton.jit
def _hc_mix_kernel(xn_ptr, g_ptr, out_ptr, n, S: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    t = tl.program_id(1).to(tl.int64)      # token t: its S streams, its output row
    xn_ptr += t * S * n
    g_ptr += t * S * n
    out_ptr += t * n
    m = offs < n
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(S):
        x = tl.load(xn_ptr + s * n + offs, mask=m, other=0.0)
        g = tl.load(g_ptr + s * n + offs, mask=m, other=0.0)
        acc += x / (1.0 + tl.exp(-g))
    tl.store(out_ptr + offs, acc / S, mask=m)


def hc_mix(xn: Tensor, gate: Tensor, out: Tensor) -> None:
    """The block input of a hyper-connection read: ``out`` [D] = mean over
    the S streams of ``xn`` [S, D] * sigmoid(``gate``, S * D values); T
    tokens in one launch: ``xn`` [T, S, D], ``gate`` [T, S D], ``out`` [T, D]."""
    s, n = xn.shape[-2:]
    n_tok = xn.numel() // (s * n)
    block = 1024
    _hc_mix_kernel[(triton.cdiv(n, block), n_tok)](xn, gate, out, n, S=s, BLOCK=block, num_warps=4)


# ---------------------------------------------------------------------------
# rows of a quantized table in host memory


@triton.jit
def _gather_rows_kernel(wv, lut_ptr, rows_ptr, x_ptr, host_delta, n_in, n_blocks, row_words,
                        QTYPE: tl.constexpr, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    h = tl.program_id(0)
    kc = tl.program_id(1)
    row = tl.load(rows_ptr + h).to(tl.int64)
    row_w = host_delta + row * row_words + tl.zeros([1], dtype=tl.int64)
    w = _decode(QTYPE, wv, lut_ptr, row_w, kc, n_blocks, A, B, C)   # [1, A, B, C]
    k = kc * (A * B * C) + _value_index(QTYPE, A, B, C)
    tl.store(x_ptr + h * n_in + k[None, :, :, :], w, mask=(k < n_in)[None, :, :, :])


def gather_rows(table: Tensor, qtype: GGMLType, host_delta: int, rows: Tensor, out: Tensor) -> None:
    """``out`` float32 [R * D] = rows ``rows`` (int64 [R] on the device) of a
    quantized table whose raw rows ``table`` uint8 [V, row_bytes] sit
    ``host_delta`` words (the format's word) from ``table``'s address: a
    page-locked host copy read by the GPU directly (0: ``table`` itself)."""
    fmt = _FORMATS[qtype]
    values, size = BLOCK_GEOMETRY[qtype]
    n_blocks = table.shape[1] // size
    words = table.view(fmt.word)
    a, b, c = fmt.tile
    _gather_rows_kernel[(rows.numel(), triton.cdiv(n_blocks, fmt.blocks_per_chunk))](
        words, _lut(qtype, fmt, table), rows, out, int(host_delta), n_blocks * values, n_blocks,
        table.shape[1] // words.element_size(), QTYPE=int(qtype), A=a, B=b, C=c, num_warps=1)


# ---------------------------------------------------------------------------
# gated delta net, one token


@triton.jit
def _gdn_conv_kernel(x_ptr, state_ptr, w_ptr, y_ptr, n_ch, K: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = c < n_ch
    x = tl.load(x_ptr + c, mask=m, other=0.0)
    acc = x * tl.load(w_ptr + c * K + (K - 1), mask=m, other=0.0)
    for i in tl.static_range(K - 1):
        si = tl.load(state_ptr + i * n_ch + c, mask=m, other=0.0)
        acc += si * tl.load(w_ptr + c * K + i, mask=m, other=0.0)
        if i > 0:
            tl.store(state_ptr + (i - 1) * n_ch + c, si, mask=m)
    tl.store(state_ptr + (K - 2) * n_ch + c, x, mask=m)
    tl.store(y_ptr + c, acc / (1.0 + tl.exp(-acc)), mask=m)


@triton.jit
def _gdn_token(st, conv_ptr, z_ptr, b_ptr, a_ptr, dtb_ptr, ssma_ptr, norm_ptr, out_ptr, j, kh, n_k, eps,
               DK: tl.constexpr, DV: tl.constexpr, SIGMOID: tl.constexpr):
    """One token of V head j: the state ``st`` [DV, DK] advanced by the delta
    rule (q, k of K head kh, v of head j from the conv output), the head's
    output normed, gated and stored; returns the new state."""
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    q = tl.load(conv_ptr + kh * DK + dk)
    k = tl.load(conv_ptr + n_k * DK + kh * DK + dk)
    v = tl.load(conv_ptr + 2 * n_k * DK + j * DV + dv)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps) * (1.0 / tl.sqrt(DK * 1.0))
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
    beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + j)))
    ga = tl.load(a_ptr + j) + tl.load(dtb_ptr + j)
    sp = tl.where(ga > 20.0, ga, tl.log(1.0 + tl.exp(tl.minimum(ga, 20.0))))     # softplus (threshold 20)
    decay = tl.exp(sp * tl.load(ssma_ptr + j))
    st = st * decay                                                      # [DV, DK]
    sk = tl.sum(st * k[None, :], axis=1)
    d = (v - sk) * beta
    st = st + d[:, None] * k[None, :]
    o = tl.sum(st * q[None, :], axis=1)                                  # [DV]
    o = o / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps) * tl.load(norm_ptr + dv)
    z = tl.load(z_ptr + j * DV + dv)
    if SIGMOID:
        gz = 1.0 / (1.0 + tl.exp(-z))
    else:
        gz = z / (1.0 + tl.exp(-z))
    tl.store(out_ptr + j * DV + dv, o * gz)
    return st


@triton.jit
def _gdn_rule_kernel(conv_ptr, z_ptr, b_ptr, a_ptr, dtb_ptr, ssma_ptr, s_ptr, norm_ptr, out_ptr, eps, n_k, ratio,
                     DK: tl.constexpr, DV: tl.constexpr, TILED: tl.constexpr, SIGMOID: tl.constexpr):
    j = tl.program_id(0)
    kh = j % n_k if TILED else j // ratio
    offs = j.to(tl.int64) * DV * DK + tl.arange(0, DV)[:, None] * DK + tl.arange(0, DK)[None, :]
    st = _gdn_token(tl.load(s_ptr + offs), conv_ptr, z_ptr, b_ptr, a_ptr, dtb_ptr, ssma_ptr, norm_ptr, out_ptr, j, kh,
                    n_k, eps, DK, DV, SIGMOID)
    tl.store(s_ptr + offs, st)


@triton.jit
def _gdn_conv_tokens_kernel(x_ptr, stride_x, state_ptr, w_ptr, y_ptr, n_ch, n_tok, K: tl.constexpr,
                            BLOCK: tl.constexpr):
    # T tokens of the causal conv: token t's window is the last K - 1 of (state, x[0 .. t - 1]), then x[t]
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = c < n_ch
    t = 0
    while t < n_tok:
        acc = tl.load(x_ptr + t * stride_x + c, mask=m, other=0.0) * tl.load(w_ptr + c * K + (K - 1), mask=m,
                                                                              other=0.0)
        for i in tl.static_range(K - 1):
            src = t - (K - 1) + i
            if src >= 0:
                xi = tl.load(x_ptr + src * stride_x + c, mask=m, other=0.0)
            else:
                xi = tl.load(state_ptr + (K - 1 + src) * n_ch + c, mask=m, other=0.0)
            acc += xi * tl.load(w_ptr + c * K + i, mask=m, other=0.0)
        tl.store(y_ptr + t * n_ch + c, acc / (1.0 + tl.exp(-acc)), mask=m)
        t += 1
    # the new state: the last K - 1 inputs (ascending, so an old row is read before it is written)
    for i in tl.static_range(K - 1):
        src = n_tok - (K - 1) + i
        if src >= 0:
            xi = tl.load(x_ptr + src * stride_x + c, mask=m, other=0.0)
        else:
            xi = tl.load(state_ptr + (K - 1 + src) * n_ch + c, mask=m, other=0.0)
        tl.store(state_ptr + i * n_ch + c, xi, mask=m)


@triton.jit
def _gdn_rule_tokens_kernel(conv_ptr, z_ptr, b_ptr, a_ptr, dtb_ptr, ssma_ptr, s_ptr, norm_ptr, out_ptr, eps, n_k,
                            ratio, n_tok, n_conv, stride_in, stride_out, DK: tl.constexpr, DV: tl.constexpr,
                            TILED: tl.constexpr, SIGMOID: tl.constexpr):
    # V head j over T tokens, its state kept in registers between them
    j = tl.program_id(0)
    kh = j % n_k if TILED else j // ratio
    offs = j.to(tl.int64) * DV * DK + tl.arange(0, DV)[:, None] * DK + tl.arange(0, DK)[None, :]
    st = tl.load(s_ptr + offs)
    t = 0
    while t < n_tok:
        st = _gdn_token(st, conv_ptr + t * n_conv, z_ptr + t * stride_in, b_ptr + t * stride_in, a_ptr + t * stride_in,
                        dtb_ptr, ssma_ptr, norm_ptr, out_ptr + t * stride_out, j, kh, n_k, eps, DK, DV, SIGMOID)
        t += 1
    tl.store(s_ptr + offs, st)


def gdn_step(qkv: Tensor, z: Tensor, b: Tensor, a: Tensor, conv_state: Tensor, conv_w: Tensor, dt_bias: Tensor,
             ssm_a: Tensor, ssm: Tensor, norm: Tensor, eps: float, n_k: int, tiled: bool, sigmoid_gate: bool,
             conv_out: Tensor, out: Tensor) -> None:
    """One token of a gated delta net layer after its projections (see
    :mod:`.engine_ops`): ``qkv`` [C], ``z`` [Hv Dv], ``b``/``a`` [Hv] the raw
    beta/alpha projections, ``conv_state`` float32 [K-1, C] and ``ssm``
    float32 [Hv, Dv, Dk] updated in place, ``conv_out`` [C] scratch, ``out``
    [Hv Dv]."""
    n_ch = qkv.numel()
    k_taps = conv_w.shape[1]
    nv, dv, dk = ssm.shape
    block = 1024
    _gdn_conv_kernel[(triton.cdiv(n_ch, block),)](qkv, conv_state, conv_w, conv_out, n_ch, K=k_taps, BLOCK=block,
                                                  num_warps=4)
    _gdn_rule_kernel[(nv,)](conv_out, z, b, a, dt_bias, ssm_a, ssm, norm, out, float(eps), n_k, nv // n_k,
                            DK=dk, DV=dv, TILED=bool(tiled), SIGMOID=bool(sigmoid_gate), num_warps=8)


def gdn_tokens(qkv: Tensor, z: Tensor, b: Tensor, a: Tensor, conv_state: Tensor, conv_w: Tensor, dt_bias: Tensor,
               ssm_a: Tensor, ssm: Tensor, norm: Tensor, eps: float, n_k: int, tiled: bool, sigmoid_gate: bool,
               conv_out: Tensor, out: Tensor) -> None:
    """T tokens of :func:`gdn_step` in two launches (prefill): ``qkv`` [T, C],
    ``z`` [T, Hv Dv], ``b``/``a`` [T, Hv] (rows of one buffer: the same row
    stride), ``conv_out`` [T, C] scratch, ``out`` [T, Hv Dv]; the states
    advance as T single steps advance them."""
    n_tok, n_ch = qkv.shape
    k_taps = conv_w.shape[1]
    nv, dv, dk = ssm.shape
    block = 1024
    if n_tok == 0:
        return
    _gdn_conv_tokens_kernel[(triton.cdiv(n_ch, block),)](qkv, qkv.stride(0), conv_state, conv_w, conv_out, n_ch, n_tok,
                                                         K=k_taps, BLOCK=block, num_warps=4)
    _gdn_rule_tokens_kernel[(nv,)](conv_out, z, b, a, dt_bias, ssm_a, ssm, norm, out, float(eps), n_k, nv // n_k, n_tok,
                                   conv_out.stride(0), z.stride(0), out.stride(0), DK=dk, DV=dv, TILED=bool(tiled),
                                   SIGMOID=bool(sigmoid_gate), num_warps=8)
