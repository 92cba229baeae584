"""The table of FLE's quantizers: ``QUANTIZERS[type](rows, imatrix)``.

Each entry takes float32 rows, C-contiguous ``(n_rows, n_per_row)`` with
``n_per_row`` a multiple of the block size, and an importance matrix
(float32 ``(n_per_row,)``, one weight per column) or ``None``, and returns
uint8 ``(n_rows, row_bytes)``. Each is a thin Python entry point to a numba
kernel (``cache=True``) that runs over the blocks of all rows with
``prange``; one kernel serves each family of formats, so that a process
compiles four kernels rather than one per format and imatrix variant.

What each one promises:

- F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, TQ1_0, TQ2_0, MXFP4: the
  bytes of ``gguf.quants.quantize`` (these ignore the importance matrix).
- IQ4_NL, IQ4_XS, Q6_K, IQ3_XXS, IQ3_S: the bytes of ggml's quantizers
  (``ggml_quantize_chunk``), with or without an importance matrix. One
  deliberate exception: ggml's IQ3_S misplaces the codes that follow an
  all-zero 32-value sub-block; FLE keeps them in place (see ``quant_iq3``).
- Every entry also accepts ``(rows)`` alone.
"""
from __future__ import annotations

from ..ggml_types import GGMLType
from . import quant_iq3, quant_iq4, quant_k, quant_simple

QUANTIZERS = {
    GGMLType.F32: quant_simple.quantize_f32,
    GGMLType.F16: quant_simple.quantize_f16,
    GGMLType.BF16: quant_simple.quantize_bf16,
    GGMLType.Q4_0: quant_simple.quantize_q4_0,
    GGMLType.Q4_1: quant_simple.quantize_q4_1,
    GGMLType.Q5_0: quant_simple.quantize_q5_0,
    GGMLType.Q5_1: quant_simple.quantize_q5_1,
    GGMLType.Q8_0: quant_simple.quantize_q8_0,
    GGMLType.TQ1_0: quant_simple.quantize_tq1_0,
    GGMLType.TQ2_0: quant_simple.quantize_tq2_0,
    GGMLType.MXFP4: quant_simple.quantize_mxfp4,
    GGMLType.IQ4_NL: quant_iq4.quantize_iq4_nl,
    GGMLType.IQ4_XS: quant_iq4.quantize_iq4_xs,
    GGMLType.Q6_K: quant_k.quantize_q6_k,
    GGMLType.IQ3_XXS: quant_iq3.quantize_iq3_xxs,
    GGMLType.IQ3_S: quant_iq3.quantize_iq3_s,
}
