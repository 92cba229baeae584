"""Products of many activation rows with weights in their GGUF block bytes,
on tensor cores: the prefill side of the engine (the decode step's kernels
in :mod:`.triton_engine` serve one row at a time).

One kernel serves a dense matrix and the routed experts of a layer. A
program owns ``BLOCK_M`` activation rows and ``BLOCK_N`` output rows and
walks the input dimension one 256-value chunk at a time: the chunk of its
weight rows is decoded in registers by the decode step's decoders
(:func:`~fle_engine.kernels.triton_quant._decode`, bit-exact against ggml's
``to_float``), laid out as a ``[BLOCK_N, 256]`` tile in the chunk's value
order, and multiplied with the activation tile gathered in the same order
by ``tl.dot`` (bfloat16 inputs, float32 accumulation; float32 inputs for
checks and Triton's interpreter).

Experts: the caller sorts the (token, expert) rows by expert and pads each
expert's rows to a multiple of ``BLOCK_M`` (:func:`pad_by_expert`), so a
program's rows share one expert, whose matrix starts at the word offset
``blk_base[pid_m]`` from the word buffer (the offset may be negative; a
block whose first place is padding has no rows): a cache slot,
or a staging buffer that the prefill streams missed experts into. The
gate+up pass gathers its input rows by token and applies SwiGLU; the down
pass reads the padded rows in order, scales them by the routing weights and
scatters them to their (token, expert) place.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from fle_quant.ggml_types import BLOCK_GEOMETRY, GGMLType

from .triton_quant import _FORMATS, _decode, _lut, _value_index

__all__ = ["gemm", "MODES", "CHUNK"]

CHUNK = 256                        # values per decoded chunk, every format
MODES = {"dense": 0, "gate_up": 1, "down": 2}
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _tile(QTYPE: tl.constexpr, wv, lut_ptr, row_w, kc, n_blocks, A: tl.constexpr, B: tl.constexpr,
          C: tl.constexpr, BLOCK_N: tl.constexpr):
    return tl.reshape(_decode(QTYPE, wv, lut_ptr, row_w, kc, n_blocks, A, B, C), (BLOCK_N, A * B * C))


@triton.jit
def _dot(acc, xa, w, BF16: tl.constexpr):
    if BF16:
        return tl.dot(xa.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
    return tl.dot(xa, tl.trans(w), acc, input_precision="ieee")


@triton.jit
def _gemm_kernel(wv, lut_ptr, blk_base_ptr, rows_ptr, x_ptr, y_ptr, wts_ptr,
                 n_rows, n_out, n_in, n_blocks, row_words, up_words, n_used, stride_x, stride_y,
                 QTYPE: tl.constexpr, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, N_CHUNKS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, BF16: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    base = tl.load(blk_base_ptr + pid_m)
    if MODE == 0:
        used = pid_m * BLOCK_M < n_rows
    else:                                              # a block holds rows of one expert from its first place
        used = tl.load(rows_ptr + pid_m * BLOCK_M) >= 0
    if used:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        if MODE == 0:                                  # dense: rows 0 .. n_rows - 1 in order
            valid = offs_m < n_rows
            src = offs_m
            dst = offs_m
        else:
            flat = tl.load(rows_ptr + offs_m)          # the (token, expert) row of each padded place, -1: none
            valid = flat >= 0
            if MODE == 1:
                src = flat // n_used                   # gate+up reads the token's row
                dst = offs_m                           # ... and writes the padded place
            else:
                src = offs_m                           # down reads the padded place
                dst = flat                             # ... and writes the (token, expert) row
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_out
        row_w = base + tl.where(mask_n, offs_n, 0).to(tl.int64) * row_words
        k_in = tl.reshape(_value_index(QTYPE, A, B, C), (A * B * C,))
        x_rows = x_ptr + tl.where(valid, src, 0).to(tl.int64)[:, None] * stride_x
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if MODE == 1:
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kc in range(0, N_CHUNKS):
            k = kc * (A * B * C) + k_in
            xa = tl.load(x_rows + k[None, :], mask=valid[:, None] & (k < n_in)[None, :], other=0.0)
            acc = _dot(acc, xa, _tile(QTYPE, wv, lut_ptr, row_w, kc, n_blocks, A, B, C, BLOCK_N), BF16)
            if MODE == 1:                              # the up rows follow the gate rows
                acc_u = _dot(acc_u, xa, _tile(QTYPE, wv, lut_ptr, row_w + up_words, kc, n_blocks, A, B, C,
                                              BLOCK_N), BF16)
        if MODE == 1:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_u
        if MODE == 2:
            acc = acc * tl.load(wts_ptr + tl.where(valid, dst, 0), mask=valid, other=0.0)[:, None]
        y = y_ptr + tl.where(valid, dst, 0).to(tl.int64)[:, None] * stride_y + offs_n[None, :]
        tl.store(y, acc, mask=valid[:, None] & mask_n[None, :])


# (BLOCK_N, warps) per mode; BLOCK_M is the caller's (the experts' padding)
CONFIG = {"dense": (64, 4), "gate_up": (32, 4), "down": (64, 4)}


def gemm(words: Tensor, qtype: GGMLType, blk_base: Tensor, rows: "Tensor | None", x: Tensor, y: Tensor,
         n_out: int, row_bytes: int, mode: str, *, up_words: int = 0, n_used: int = 1,
         weights: "Tensor | None" = None, block_m: int = 64, bf16: "bool | None" = None,
         config: "tuple[int, int] | None" = None) -> Tensor:
    """``y`` rows from ``x`` rows (float32) and the matrices at word offsets
    ``blk_base`` [programs along M] int64 of ``words`` (any value for a block
    without rows) (the module docstring
    says how the modes read and write rows). ``rows`` int32/int64 [padded]:
    the (token, expert) row of each padded place (-1: padding; None for
    ``dense``); ``up_words``: the up rows' distance from the gate rows;
    ``weights`` float32 [T * n_used]: the down pass's routing weights;
    ``config``: (BLOCK_N, warps) instead of :data:`CONFIG` (tuning)."""
    fmt = _FORMATS[qtype]
    values, size = BLOCK_GEOMETRY[qtype]
    n_blocks = row_bytes // size
    a, b, c = fmt.tile
    block_n, warps = config or CONFIG[mode]
    if bf16 is None:
        bf16 = not _INTERPRET
    n_rows = x.shape[0] if mode == "dense" else 0
    grid = (blk_base.numel(), triton.cdiv(n_out, block_n))
    _gemm_kernel[grid](
        words, _lut(qtype, fmt, words), blk_base, blk_base if rows is None else rows, x, y,
        y if weights is None else weights, n_rows, n_out, n_blocks * values, n_blocks,
        row_bytes // words.element_size(), int(up_words), int(n_used), x.stride(0), y.stride(0),
        QTYPE=int(qtype), A=a, B=b, C=c, N_CHUNKS=triton.cdiv(n_blocks, fmt.blocks_per_chunk),
        BLOCK_M=block_m, BLOCK_N=block_n, MODE=MODES[mode], BF16=bool(bf16), num_warps=warps)
    return y
