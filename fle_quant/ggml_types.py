"""ggml tensor types: one table of block geometry, including types the
``gguf`` package on PyPI does not know (Q2_0).

Values and geometry follow ggml's ``enum ggml_type`` and ``ggml-common.h``.
"""
from __future__ import annotations

import enum
from typing import Sequence


class GGMLType(enum.IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41
    Q2_0 = 42


# type -> (values per block, bytes per block)
BLOCK_GEOMETRY: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q8_1: (32, 36),
    GGMLType.Q2_K: (256, 84),
    GGMLType.Q3_K: (256, 110),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
    GGMLType.Q8_K: (256, 292),
    GGMLType.IQ2_XXS: (256, 66),
    GGMLType.IQ2_XS: (256, 74),
    GGMLType.IQ3_XXS: (256, 98),
    GGMLType.IQ1_S: (256, 50),
    GGMLType.IQ4_NL: (32, 18),
    GGMLType.IQ3_S: (256, 110),
    GGMLType.IQ2_S: (256, 82),
    GGMLType.IQ4_XS: (256, 136),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8),
    GGMLType.IQ1_M: (256, 56),
    GGMLType.BF16: (1, 2),
    GGMLType.TQ1_0: (256, 54),
    GGMLType.TQ2_0: (256, 66),
    GGMLType.MXFP4: (32, 17),
    GGMLType.NVFP4: (64, 36),
    GGMLType.Q1_0: (128, 18),
    GGMLType.Q2_0: (64, 18),
}


def parse_type(name_or_value: "str | int | GGMLType") -> GGMLType:
    """Accept ``"IQ4_NL"``, ``"iq4_nl"``, ``20`` or a GGMLType."""
    from .errors import FleError

    if isinstance(name_or_value, GGMLType):
        return name_or_value
    if isinstance(name_or_value, int):
        try:
            return GGMLType(name_or_value)
        except ValueError:
            raise FleError(f"unknown ggml type value {name_or_value}") from None
    key = str(name_or_value).strip().upper()
    try:
        return GGMLType[key]
    except KeyError:
        known = ", ".join(t.name for t in GGMLType)
        raise FleError(f"unknown quant type {name_or_value!r}; known types: {known}") from None


def block_geometry(qtype: "GGMLType | int") -> tuple[int, int]:
    return BLOCK_GEOMETRY[GGMLType(qtype)]


def tensor_nbytes(shape: Sequence[int], qtype: "GGMLType | int") -> int:
    """Bytes of a tensor with ggml shape ``shape`` (ne0 first, the row length)."""
    block, size = BLOCK_GEOMETRY[GGMLType(qtype)]
    ne0 = int(shape[0]) if len(shape) else 1
    if ne0 % block:
        raise ValueError(f"row length {ne0} is not a multiple of the {GGMLType(qtype).name} block of {block}")
    n_rows = 1
    for d in shape[1:]:
        n_rows *= int(d)
    return n_rows * (ne0 // block) * size


def row_nbytes(ne0: int, qtype: "GGMLType | int") -> int:
    return tensor_nbytes([ne0], qtype)
