"""Activations quantized to a kernel's dot type, as ggml's ``vec_dot_type``:
Q8_K (256 values: float32 scale, int8 codes, sums of 16) for the K-quants
and the grid i-quants, Q8_0 (32 values: fp16 scale, int8 codes) for Q8_0,
IQ4_NL and Q2_0.

Held unpacked, one array per field, so that a kernel reads the codes as
plain int8 lanes: :class:`Acts` ``d`` float32 ``[R, n // block]``, ``qs``
int8 ``[R, n]``, ``sums`` int32 ``[R, n // 32]`` (the sum of each 32 codes,
for the K-quants' minimums). The block quantizers are njit functions that
the fused kernels call between their gate/up and down products.

Q8_K follows ggml's ``quantize_row_q8_K_ref`` (scale ``-127 / x`` of the
largest |x|, codes rounded half to even, capped at 127); Q8_0 is
fle_quant's quantizer (ggml's ``quantize_row_q8_0_ref``: ``d = amax / 127``
stored as fp16, codes rounded half away from zero).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, prange

from fle_quant.ggml_types import GGMLType
from fle_quant.quants.blocks_common import fp16_at
from fle_quant.quants.quant_simple import _blk_q8_0

__all__ = ["Acts", "DOT_TYPE", "quantize_acts", "pack_q8_k", "unpack_q8_k", "unpack_q8_0"]

_F32 = np.float32

# weight type -> the type its activations are quantized to (ggml's type_traits_cpu[...].vec_dot_type)
DOT_TYPE = {
    GGMLType.IQ2_XS: GGMLType.Q8_K, GGMLType.IQ2_S: GGMLType.Q8_K, GGMLType.IQ3_XXS: GGMLType.Q8_K,
    GGMLType.IQ3_S: GGMLType.Q8_K, GGMLType.IQ4_XS: GGMLType.Q8_K, GGMLType.Q4_K: GGMLType.Q8_K,
    GGMLType.Q5_K: GGMLType.Q8_K, GGMLType.Q6_K: GGMLType.Q8_K,
    GGMLType.IQ4_NL: GGMLType.Q8_0, GGMLType.Q8_0: GGMLType.Q8_0, GGMLType.Q2_0: GGMLType.Q8_0,
}


class Acts(NamedTuple):
    """Quantized activation rows (see the module docstring)."""
    dot: GGMLType
    d: np.ndarray     # float32 [R, n // block]
    qs: np.ndarray    # int8 [R, n]
    sums: np.ndarray  # int32 [R, n // 32]


@njit(cache=True, inline="always")
def q8_k_block(x, qs, sums32):
    """One 256-value Q8_K block: codes into ``qs`` (int8 [256]), the sums of
    each 32 codes into ``sums32`` (int32 [8]); returns the scale."""
    amax = _F32(0.0)
    mx = _F32(0.0)
    for j in range(256):
        ax = abs(x[j])
        if ax > amax:
            amax = ax
            mx = x[j]
    if amax == _F32(0.0):
        for j in range(256):
            qs[j] = 0
        for j in range(8):
            sums32[j] = 0
        return _F32(0.0)
    iscale = _F32(-127.0) / mx
    for j in range(256):
        v = np.rint(iscale * x[j])  # half to even, as ggml's nearest_int
        qs[j] = np.int8(min(v, _F32(127.0)))
    for j in range(8):
        s = np.int32(0)
        for i in range(32):
            s += np.int32(qs[32 * j + i])
        sums32[j] = s
    return _F32(1.0) / iscale


@njit(cache=True, inline="always")
def q8_0_block(x, qs, tmp):
    """One 32-value Q8_0 block (fle_quant's encoder; ``tmp``: uint8 [34]
    scratch): codes into ``qs``; returns the scale (fp16 value) and the sum."""
    _blk_q8_0(x, tmp)
    s = np.int32(0)
    for j in range(32):
        q = np.int8(tmp[2 + j])
        qs[j] = q
        s += np.int32(q)
    return fp16_at(tmp, 0), s


@njit(cache=True, inline="always")
def quantize_row(x, dot_k, d, qs, sums, tmp):
    """One row of ``n`` floats; ``dot_k``: True for Q8_K, False for Q8_0."""
    n = x.shape[0]
    if dot_k:
        for b in range(n // 256):
            d[b] = q8_k_block(x[256 * b:256 * b + 256], qs[256 * b:256 * b + 256], sums[8 * b:8 * b + 8])
    else:
        for b in range(n // 32):
            dd, s = q8_0_block(x[32 * b:32 * b + 32], qs[32 * b:32 * b + 32], tmp)
            d[b] = dd
            sums[b] = s


@njit(cache=True, parallel=True)
def _quantize_rows(x, dot_k, d, qs, sums):
    for r in prange(x.shape[0]):
        tmp = np.empty(34, np.uint8)
        quantize_row(x[r], dot_k, d[r], qs[r], sums[r], tmp)


def quantize_acts(x: np.ndarray, dot: GGMLType) -> Acts:
    """Quantize float32 rows ``x`` [R, n] to ``dot`` (Q8_K or Q8_0)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    r, n = x.shape
    block = 256 if dot == GGMLType.Q8_K else 32
    if dot not in (GGMLType.Q8_K, GGMLType.Q8_0) or n % block:
        raise ValueError(f"cannot quantize rows of {n} values to {dot.name}")
    d = np.empty((r, n // block), np.float32)
    qs = np.empty((r, n), np.int8)
    sums = np.empty((r, n // 32), np.int32)
    if r:
        _quantize_rows(x, dot == GGMLType.Q8_K, d, qs, sums)
    return Acts(dot, d, qs, sums)


# ggml's packed blocks, for comparing with its quantizers and feeding its vec_dot

def pack_q8_k(a: Acts) -> np.ndarray:
    """Acts (Q8_K) -> ggml's block_q8_K bytes [R, n // 256 * 292]."""
    r, n = a.qs.shape
    nb = n // 256
    out = np.zeros((r, nb, 292), np.uint8)
    out[:, :, 0:4] = a.d.astype(np.float32).reshape(r, nb, 1).view(np.uint8)
    out[:, :, 4:260] = a.qs.reshape(r, nb, 256).view(np.uint8)
    bs = a.qs.reshape(r, nb, 16, 16).astype(np.int32).sum(-1).astype(np.int16)
    out[:, :, 260:292] = bs.view(np.uint8).reshape(r, nb, 32)
    return out.reshape(r, nb * 292)


def unpack_q8_k(raw: np.ndarray) -> Acts:
    """ggml's block_q8_K bytes [R, nb * 292] -> Acts."""
    r = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(r, -1, 292)
    nb = blocks.shape[1]
    d = np.ascontiguousarray(blocks[:, :, 0:4]).view(np.float32).reshape(r, nb)
    qs = np.ascontiguousarray(blocks[:, :, 4:260]).view(np.int8).reshape(r, nb * 256)
    sums = qs.reshape(r, nb * 8, 32).astype(np.int32).sum(-1).astype(np.int32)
    return Acts(GGMLType.Q8_K, d, qs, sums)


def unpack_q8_0(raw: np.ndarray) -> Acts:
    """Q8_0 bytes [R, nb * 34] -> Acts."""
    r = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(r, -1, 34)
    nb = blocks.shape[1]
    d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16).astype(np.float32).reshape(r, nb)
    qs = np.ascontiguousarray(blocks[:, :, 2:34]).view(np.int8).reshape(r, nb * 32)
    sums = qs.reshape(r, nb, 32).astype(np.int32).sum(-1).astype(np.int32)
    return Acts(GGMLType.Q8_0, d, qs, sums)
