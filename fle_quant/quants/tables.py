"""Lookup tables of the ggml quant formats, as numpy arrays that numba
kernels can read as compile-time constants.

Every table is taken as data from the ``gguf`` package (``gguf.quants``:
the packed ``grid_hex`` strings that its ``init_grid`` unpacks, ``ksigns``,
``kvalues`` and its E8M0 / UE4M3 scale decoders), so that nothing here is
retyped by hand. The grids are stored as float32 rows so that a kernel can
load eight grid values with one contiguous read; they hold small integers
and so are exact.
"""
from __future__ import annotations

import numpy as np
from gguf import quants as _gq


def _grid(cls) -> np.ndarray:
    cls.init_grid()
    g = np.asarray(cls.grid, dtype=np.float32)
    return np.ascontiguousarray(g.reshape(cls.grid_shape))


# Grid rows: (n_grid, 8) or (n_grid, 4) float32.
IQ2XXS_GRID = _grid(_gq.IQ2_XXS)  # (256, 8)   values 8, 25, 43
IQ2XS_GRID = _grid(_gq.IQ2_XS)  # (512, 8)
IQ2S_GRID = _grid(_gq.IQ2_S)  # (1024, 8)
IQ3XXS_GRID = _grid(_gq.IQ3_XXS)  # (256, 4)   values 4 .. 62
IQ3S_GRID = _grid(_gq.IQ3_S)  # (512, 4)   values 1 .. 15
IQ1S_GRID = _grid(_gq.IQ1_S)  # (2048, 8)  values -1, 0, 1 (shared by IQ1_M)

# ksigns_iq2xs: 7 stored sign bits -> 8 sign bits with even parity.
KSIGNS = np.frombuffer(_gq.IQ2_XXS.ksigns, dtype=np.uint8).copy()  # (128,)


def _sign_rows(sign_bytes: np.ndarray) -> np.ndarray:
    # Bit j of a sign byte set means "negate value j": rows of +1/-1 floats
    # let a kernel apply eight signs with one multiply per value.
    bits = (sign_bytes.reshape(-1, 1) >> np.arange(8, dtype=np.uint8)) & 1
    return np.where(bits == 1, np.float32(-1), np.float32(1)).astype(np.float32)


KSIGNS_ROWS = _sign_rows(KSIGNS)  # (128, 8): ksigns index -> signs
SIGN_ROWS = _sign_rows(np.arange(256, dtype=np.uint8))  # (256, 8): raw sign byte -> signs

# IQ1_S / IQ1_M shift of the grid values (IQ1S_DELTA in ggml).
IQ1_DELTA = np.float32(_gq.IQ1_S.delta)

# Non-linear 4-bit code books, as float32 (the int8 values are exact).
KVALUES_IQ4NL = np.array(_gq.IQ4_NL.kvalues, dtype=np.float32)  # (16,)
KVALUES_FP4 = np.array(_gq.MXFP4.kvalues, dtype=np.float32)  # (16,) E2M1 doubled; MXFP4 and NVFP4

# Scale decoders, tabulated over every byte value.
E8M0_HALF = np.ascontiguousarray(_gq.MXFP4.e8m0_to_fp32_half(np.arange(256, dtype=np.uint8)), dtype=np.float32)
UE4M3_HALF = np.ascontiguousarray(_gq.NVFP4.ue4m3_to_fp32(np.arange(256, dtype=np.uint8)), dtype=np.float32)

for _t in (IQ2XXS_GRID, IQ2XS_GRID, IQ2S_GRID, IQ3XXS_GRID, IQ3S_GRID, IQ1S_GRID, KSIGNS_ROWS, SIGN_ROWS,
           KVALUES_IQ4NL, KVALUES_FP4, E8M0_HALF, UE4M3_HALF):
    _t.setflags(write=False)
del _t
