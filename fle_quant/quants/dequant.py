"""Dequantizers: one numba block decoder per ggml type, behind one
dispatch table.

``DEQUANTIZERS[type](blocks, out=None)`` takes raw blocks (uint8,
C-contiguous, ``(n_blocks, block_bytes)``) and returns float32
``(n_blocks, block_values)``, written into ``out`` when one is given,
bit-identical to ggml's ``to_float`` and to gguf-py (both agree on every
finite result; see tests/test_dequant.py for the NaN payload note).

The block decoders (``decode_<type>(block_bytes, out_values)`` in
:mod:`.blocks_simple`, :mod:`.blocks_k`, :mod:`.blocks_iq`) are njit
functions inlined into their callers, so that fused kernels can decode a
block at a time at no call cost. Next to each decoder is its driver
``run_<type>(blocks, out)``, which only spreads the blocks over numba's
threads; each thread writes its output blocks in order.
"""
from __future__ import annotations

import numpy as np

from ..errors import FleError
from ..ggml_types import BLOCK_GEOMETRY, GGMLType
from . import blocks_iq as _iq
from . import blocks_k as _k
from . import blocks_simple as _s

__all__ = ["DEQUANTIZERS", "FP16_SCALE_OFFSETS", "dequantize_blocks"]

# Byte offsets of the fp16 fields (scales, mins) inside one block, from the
# block structs of ggml-common.h. IQ1_M is absent: its fp16 scale is split
# over the top nibbles of bytes 49, 51, 53 and 55. MXFP4 and NVFP4 have
# 8-bit scales. Tests and benchmarks use this to build blocks with chosen
# scale values.
FP16_SCALE_OFFSETS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,), GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,), GGMLType.Q1_0: (0,), GGMLType.Q2_0: (0,), GGMLType.IQ4_NL: (0,),
    GGMLType.TQ1_0: (52,), GGMLType.TQ2_0: (64,),
    GGMLType.Q2_K: (80, 82), GGMLType.Q3_K: (108,), GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
    GGMLType.IQ2_XXS: (0,), GGMLType.IQ2_XS: (0,), GGMLType.IQ2_S: (0,), GGMLType.IQ3_XXS: (0,),
    GGMLType.IQ3_S: (0,), GGMLType.IQ1_S: (0,), GGMLType.IQ4_XS: (0,),
}


def _driver(qtype: GGMLType, run):
    values, size = BLOCK_GEOMETRY[qtype]

    def dequantize(blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if blocks.dtype != np.uint8 or blocks.ndim != 2 or blocks.shape[1] != size or not blocks.flags.c_contiguous:
            raise FleError(f"{qtype.name}: expected C-contiguous uint8 blocks of shape (n, {size}), "
                           f"got {blocks.dtype} {blocks.shape}")
        if out is None:
            out = np.empty((blocks.shape[0], values), dtype=np.float32)
        elif out.dtype != np.float32 or out.shape != (blocks.shape[0], values) or not out.flags.c_contiguous:
            raise FleError(f"{qtype.name}: output must be C-contiguous float32 of shape ({blocks.shape[0]}, {values}), "
                           f"got {out.dtype} {out.shape}")
        if blocks.shape[0]:
            run(blocks, out)
        return out

    dequantize.__name__ = f"dequantize_{qtype.name.lower()}"
    dequantize.__qualname__ = dequantize.__name__
    return dequantize


DEQUANTIZERS = {
    GGMLType.F32: _driver(GGMLType.F32, _s.run_f32),
    GGMLType.F16: _driver(GGMLType.F16, _s.run_f16),
    GGMLType.BF16: _driver(GGMLType.BF16, _s.run_bf16),
    GGMLType.Q4_0: _driver(GGMLType.Q4_0, _s.run_q4_0),
    GGMLType.Q4_1: _driver(GGMLType.Q4_1, _s.run_q4_1),
    GGMLType.Q5_0: _driver(GGMLType.Q5_0, _s.run_q5_0),
    GGMLType.Q5_1: _driver(GGMLType.Q5_1, _s.run_q5_1),
    GGMLType.Q8_0: _driver(GGMLType.Q8_0, _s.run_q8_0),
    GGMLType.Q1_0: _driver(GGMLType.Q1_0, _s.run_q1_0),
    GGMLType.Q2_0: _driver(GGMLType.Q2_0, _s.run_q2_0),
    GGMLType.IQ4_NL: _driver(GGMLType.IQ4_NL, _s.run_iq4_nl),
    GGMLType.MXFP4: _driver(GGMLType.MXFP4, _s.run_mxfp4),
    GGMLType.NVFP4: _driver(GGMLType.NVFP4, _s.run_nvfp4),
    GGMLType.TQ1_0: _driver(GGMLType.TQ1_0, _s.run_tq1_0),
    GGMLType.TQ2_0: _driver(GGMLType.TQ2_0, _s.run_tq2_0),
    GGMLType.Q2_K: _driver(GGMLType.Q2_K, _k.run_q2_k),
    GGMLType.Q3_K: _driver(GGMLType.Q3_K, _k.run_q3_k),
    GGMLType.Q4_K: _driver(GGMLType.Q4_K, _k.run_q4_k),
    GGMLType.Q5_K: _driver(GGMLType.Q5_K, _k.run_q5_k),
    GGMLType.Q6_K: _driver(GGMLType.Q6_K, _k.run_q6_k),
    GGMLType.IQ2_XXS: _driver(GGMLType.IQ2_XXS, _iq.run_iq2_xxs),
    GGMLType.IQ2_XS: _driver(GGMLType.IQ2_XS, _iq.run_iq2_xs),
    GGMLType.IQ2_S: _driver(GGMLType.IQ2_S, _iq.run_iq2_s),
    GGMLType.IQ3_XXS: _driver(GGMLType.IQ3_XXS, _iq.run_iq3_xxs),
    GGMLType.IQ3_S: _driver(GGMLType.IQ3_S, _iq.run_iq3_s),
    GGMLType.IQ1_S: _driver(GGMLType.IQ1_S, _iq.run_iq1_s),
    GGMLType.IQ1_M: _driver(GGMLType.IQ1_M, _iq.run_iq1_m),
    GGMLType.IQ4_XS: _driver(GGMLType.IQ4_XS, _iq.run_iq4_xs),
}


def dequantize_blocks(blocks: np.ndarray, qtype: GGMLType) -> np.ndarray:
    """``DEQUANTIZERS[qtype](blocks)``."""
    return DEQUANTIZERS[GGMLType(qtype)](blocks)
