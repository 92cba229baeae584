"""Weights in their GGUF block bytes decoded into bfloat16 (or float32)
matrices on the GPU, for prefill: products of thousands of rows run on
tensor cores through torch (cuBLAS, and torch's grouped GEMM for a layer's
experts), on weights decoded once per micro-batch; the decode step's fused
kernels (:mod:`.triton_engine`) read the blocks directly instead.

A program decodes ``BLOCK_N`` rows of one matrix, a 256-value chunk at a time,
with the decode step's decoders (:func:`~fle_engine.kernels.triton_quant._decode`,
bit-exact against ggml's ``to_float``) and stores it in the chunk's value
order. The matrices start at word offsets ``base[g]`` of one word buffer
(a cache slot, or the staging buffer that prefill streams missed experts
into; an offset may be negative). In tile order the decoded tile is stored
as it lies (contiguous, vectorised stores) and the product's other operand
has its columns permuted instead (one gather of the activations).
"""
from __future__ import annotations

import os

import triton
import triton.language as tl
from torch import Tensor

from fle_quant.ggml_types import BLOCK_GEOMETRY, GGMLType

from .triton_quant import _FORMATS, _decode, _lut, _value_index

__all__ = ["dequant"]


@triton.jit
def _dequant_kernel(wv, lut_ptr, base_ptr, out_ptr, n_rows, n_in, n_blocks, row_words,
                    QTYPE: tl.constexpr, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, BLOCK_N: tl.constexpr,
                    N_CHUNKS: tl.constexpr, TILE_ORDER: tl.constexpr, EVEN: tl.constexpr):
    g = tl.program_id(0)
    pid_n = tl.program_id(1)
    base = tl.load(base_ptr + g)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_rows
    row_w = base + tl.where(mask_n, offs_n, 0).to(tl.int64) * row_words
    row = (g.to(tl.int64) * n_rows + tl.where(mask_n, offs_n, 0)).to(tl.int64)
    k_in = _value_index(QTYPE, A, B, C)
    a = tl.arange(0, A)[:, None, None]
    b = tl.arange(0, B)[None, :, None]
    c = tl.arange(0, C)[None, None, :]
    for kc in range(0, N_CHUNKS):
        w = _decode(QTYPE, wv, lut_ptr, row_w, kc, n_blocks, A, B, C)            # [BN, A, B, C]
        k = kc * (A * B * C) + k_in
        if TILE_ORDER:  # the tile as it lies in registers: contiguous stores (the columns permuted in each chunk)
            dst = out_ptr + row[:, None, None, None] * n_in + (kc * (A * B * C) + (a * B + b) * C + c)[None, :, :, :]
        else:
            dst = out_ptr + row[:, None, None, None] * n_in + k[None, :, :, :]
        if EVEN:        # whole chunks and row blocks: no mask, so the stores can be vectorised
            tl.store(dst, w.to(out_ptr.dtype.element_ty))
        else:
            tl.store(dst, w.to(out_ptr.dtype.element_ty),
                     mask=mask_n[:, None, None, None] & (k < n_in)[None, :, :, :])


# (rows per program, warps), measured on an H200 (bench/prefill_layer.py: 4,1 decodes a 30B-A3B layer of IQ4_XS
# experts in 0.63 ms, 8,4 in 0.73, 16,4 in 1.30); FLE_DEQUANT_CONFIG="rows,warps" overrides (tuning)
CONFIG = tuple(int(v) for v in os.environ.get("FLE_DEQUANT_CONFIG", "4,1").split(","))


def dequant(words: Tensor, qtype: GGMLType, base: Tensor, n_rows: int, row_bytes: int, out: Tensor,
            tile_order: bool = False, block_n: "int | None" = None, warps: "int | None" = None) -> Tensor:
    """``out`` [G, n_rows, n_in] (bfloat16 or float32) = the G matrices of
    ``n_rows`` rows of ``row_bytes`` at word offsets ``base`` (int64 [G],
    device) of ``words``, decoded; ``tile_order``: the columns of each
    256-value chunk in the decoder's tile order
    (:func:`fle_engine.kernels.engine_ops.tile_columns`), whole chunks only."""
    fmt = _FORMATS[qtype]
    values, size = BLOCK_GEOMETRY[qtype]
    n_blocks = row_bytes // size
    a, b, c = fmt.tile
    if block_n is None:
        block_n, warps = CONFIG
    grid = (base.numel(), triton.cdiv(n_rows, block_n))
    _dequant_kernel[grid](words, _lut(qtype, fmt, words), base, out, n_rows, n_blocks * values, n_blocks,
                          row_bytes // words.element_size(), QTYPE=int(qtype), A=a, B=b, C=c, BLOCK_N=block_n,
                          N_CHUNKS=triton.cdiv(n_blocks, fmt.blocks_per_chunk), TILE_ORDER=bool(tile_order),
                          EVEN=(n_rows % block_n == 0) and (n_blocks * values) % 256 == 0,
                          num_warps=warps)
    return out
