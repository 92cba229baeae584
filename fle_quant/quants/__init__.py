"""Quant formats: ``dequantize`` and ``quantize`` with gguf-py's conventions.

Rows of raw bytes in, rows of float32 out (and back). Each format has a
block decoder in :mod:`.dequant` (numba, reusable inside fused dot-product
kernels) and, where FLE can produce it, a quantizer in :mod:`.quantize`.
Both are reached through one dispatch table per direction.
"""
from __future__ import annotations

import numpy as np

from ..errors import FleError
from ..ggml_types import BLOCK_GEOMETRY, GGMLType, parse_type
from .dequant import DEQUANTIZERS
from .quantize import QUANTIZERS

__all__ = ["dequantize", "quantize", "DEQUANTIZERS", "QUANTIZERS", "can_quantize"]


def dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """Decode raw bytes (uint8, last axis a whole number of blocks) to float32.

    The output has the input's leading axes and a last axis of
    ``row_bytes // block_bytes * block_values`` values, as gguf-py returns."""
    qtype = parse_type(qtype)
    fn = DEQUANTIZERS.get(qtype)
    if fn is None:
        raise FleError(f"FLE cannot dequantize {qtype.name}")
    block, size = BLOCK_GEOMETRY[qtype]
    data = np.asarray(data)
    if data.dtype != np.uint8:
        data = data.view(np.uint8)
    if data.ndim == 0 or data.shape[-1] % size:
        raise FleError(f"{qtype.name}: row of {data.shape[-1] if data.ndim else 0} bytes is not a whole number of {size}-byte blocks")
    lead = data.shape[:-1]
    n_blocks = data.size // size
    blocks = np.ascontiguousarray(data).reshape(n_blocks, size)
    out = fn(blocks)  # (n_blocks, block) float32
    return out.reshape(*lead, data.shape[-1] // size * block)


def can_quantize(qtype) -> bool:
    return parse_type(qtype) in QUANTIZERS


_IMATRIX_NOT_SUPPORTED = frozenset({GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1})


def quantize(x: np.ndarray, qtype, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Encode float32 rows (last axis = row) to raw bytes of ``qtype``.

    ``imatrix`` (one importance per column, length = row length) is used by
    IQ4_NL, IQ4_XS, Q6_K, IQ3_XXS and IQ3_S as ggml uses it, and ignored by
    the types ggml also quantizes without one. For Q4_0, Q4_1, Q5_0 and Q5_1
    ggml uses it but FLE's encoders (gguf-py's) cannot: an importance matrix
    there is an error rather than bytes that silently differ from ggml's."""
    qtype = parse_type(qtype)
    fn = QUANTIZERS.get(qtype)
    if fn is None:
        known = ", ".join(t.name for t in QUANTIZERS)
        raise FleError(f"FLE cannot quantize to {qtype.name}; it can quantize to {known}")
    block, size = BLOCK_GEOMETRY[qtype]
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % block:
        raise FleError(f"{qtype.name}: row length {x.shape[-1] if x.ndim else 0} is not a multiple of the block size {block}")
    n_per_row = x.shape[-1]
    rows = np.ascontiguousarray(x).reshape(-1, n_per_row)
    if imatrix is not None:
        if qtype in _IMATRIX_NOT_SUPPORTED:
            raise FleError(f"{qtype.name}: FLE quantizes it without an importance matrix, where ggml would use "
                           "one; quantize without the imatrix or to an IQ / K type")
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
        if imatrix.shape != (n_per_row,):
            raise FleError(f"importance matrix has shape {imatrix.shape}, expected ({n_per_row},)")
    out = fn(rows, imatrix)  # (n_rows, row_bytes) uint8
    return out.reshape(*x.shape[:-1], n_per_row // block * size)
