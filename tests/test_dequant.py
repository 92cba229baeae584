"""Dequantizers: bit-identical to gguf-py and to ggml's own ``to_float``.

Blocks are random bytes (every byte pattern is a valid block of these
formats) whose fp16 scale fields hold a mix of typical scales, raw random
bits and an explicit list of special values: signed zeros, subnormals,
the largest finite values, infinities, quiet and signalling NaNs.

NaN results are compared by ``np.isnan`` for the quantized types: when a
scale is NaN the payload of the product depends on operand order, which no
reference defines. The plain float types (F32, F16, BF16) are compared bit
for bit, NaN payloads included, against gguf-py.

Known difference between the references: for F16, ggml's
``GGML_FP16_TO_FP32`` quiets a signalling NaN (its conversion ends in a
float multiply), while numpy's float16 cast, and so gguf-py and FLE, keep
the payload as it is. ``test_matches_ggml`` checks that this is the only
difference for F16.
"""
from __future__ import annotations

import gguf
import gguf.quants as gq
import numpy as np
import pytest

from fle_quant.errors import FleError
from fle_quant.ggml_types import BLOCK_GEOMETRY, GGMLType
from fle_quant.quants import dequantize
from fle_quant.quants.dequant import DEQUANTIZERS, FP16_SCALE_OFFSETS

N_BLOCKS = 100_000

# fp16 bit patterns that every scale field must see.
SPECIAL_F16 = np.array([
    0x0000, 0x8000,  # +0, -0
    0x0001, 0x8001, 0x03FF, 0x83FF, 0x0200,  # subnormals
    0x0400, 0x8400, 0x7BFF, 0xFBFF,  # smallest normal, largest finite
    0x3C00, 0xBC00,  # +1, -1
    0x7C00, 0xFC00,  # +inf, -inf
    0x7E00, 0xFE00, 0x7FFF,  # quiet NaNs
    0x7C01, 0x7D55, 0xFC01,  # signalling NaNs
], dtype=np.uint16)

SPECIAL_BF16 = np.array([0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF],
                        dtype=np.uint16)
SPECIAL_F32 = np.array([0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0x7F800000, 0xFF800000,
                        0x7FC00000, 0x7F800001, 0xFFFFFFFF], dtype=np.uint32)


def _mix(n: int, rng: np.random.Generator, typical: np.ndarray, specials: np.ndarray) -> np.ndarray:
    """``typical`` bit patterns, with 20% replaced by raw random bits and
    20% by ``specials`` (each special value in about 1% of the entries)."""
    out = typical.copy()
    which = rng.random(n)
    raw = which < 0.2
    out[raw] = rng.integers(0, np.iinfo(out.dtype).max, raw.sum(), dtype=out.dtype, endpoint=True)
    spec = which >= 0.8
    out[spec] = specials[rng.integers(0, len(specials), spec.sum())]
    return out


def f16_scales(n: int, rng: np.random.Generator) -> np.ndarray:
    typical = (rng.standard_normal(n) * 0.02).astype(np.float16).view(np.uint16)
    return _mix(n, rng, typical, SPECIAL_F16)


def random_blocks(qtype: GGMLType, n: int, rng: np.random.Generator) -> np.ndarray:
    values, size = BLOCK_GEOMETRY[qtype]
    if qtype == GGMLType.F32:
        typical = rng.standard_normal(n).astype(np.float32).view(np.uint32)
        return _mix(n, rng, typical, SPECIAL_F32).view(np.uint8).reshape(n, 4)
    if qtype == GGMLType.BF16:
        typical = (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return _mix(n, rng, typical, SPECIAL_BF16).view(np.uint8).reshape(n, 2)
    if qtype == GGMLType.F16:
        return f16_scales(n, rng).view(np.uint8).reshape(n, 2)
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for off in FP16_SCALE_OFFSETS.get(qtype, ()):
        blocks[:, off:off + 2] = f16_scales(n, rng).view(np.uint8).reshape(n, 2)
    if qtype == GGMLType.IQ1_M:
        # the fp16 scale lives in the top nibbles of bytes 49, 51, 53, 55
        h = f16_scales(n, rng)
        for k in range(4):
            nib = ((h >> (4 * k)) & 0xF).astype(np.uint8)
            blocks[:, 49 + 2 * k] = (blocks[:, 49 + 2 * k] & 0x0F) | (nib << 4)
    return blocks


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str, nan_payload: bool = False) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    want = np.ascontiguousarray(want, dtype=np.float32)
    same = got.view(np.uint32) == want.view(np.uint32)
    if not nan_payload:
        same |= np.isnan(got) & np.isnan(want)
    if not same.all():
        i = np.argwhere(~same)[0]
        bad = int((~same).sum())
        raise AssertionError(f"{what}: {bad} values differ; first at {tuple(i)}: "
                             f"got {got[tuple(i)]!r} ({got.view(np.uint32)[tuple(i)]:#010x}), "
                             f"want {want[tuple(i)]!r} ({want.view(np.uint32)[tuple(i)]:#010x})")


def _gguf_can_dequantize(t: GGMLType) -> bool:
    gt = getattr(gguf.GGMLQuantizationType, t.name, None)
    return gt is not None and (t in (GGMLType.F32, GGMLType.F16) or gt in gq._type_traits)


GGUF_TYPES = [t for t in DEQUANTIZERS if _gguf_can_dequantize(t)]
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)


def test_coverage():
    # Every type FLE decodes is checked against gguf-py, except the ones
    # gguf 0.19.0 lacks, which the reference tier checks against ggml.
    assert set(DEQUANTIZERS) - set(GGUF_TYPES) == {GGMLType.Q1_0, GGMLType.Q2_0}
    assert len(GGUF_TYPES) == 26


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: t.name)
def test_matches_gguf_py(qtype):
    rng = np.random.default_rng(1000 + int(qtype))
    blocks = random_blocks(qtype, N_BLOCKS, rng)
    got = DEQUANTIZERS[qtype](blocks)
    with np.errstate(all="ignore"):
        # rows of 100 blocks: gguf-py loops in Python over groups of 16 rows
        want = gq.dequantize(blocks.reshape(N_BLOCKS // 100, -1), gguf.GGMLQuantizationType(int(qtype)))
    assert_same_bits(got, want.reshape(got.shape), qtype.name, nan_payload=qtype in FLOAT_TYPES)


@pytest.mark.reference
@pytest.mark.parametrize("qtype", [t for t in DEQUANTIZERS if t != GGMLType.F32], ids=lambda t: t.name)
def test_matches_ggml(qtype):
    pytest.importorskip("llama_cpp")
    from fle_quant import ggml_ref
    if not ggml_ref.available():
        pytest.skip("ggml library of llama-cpp-python not loadable")
    rng = np.random.default_rng(2000 + int(qtype))
    blocks = random_blocks(qtype, N_BLOCKS, rng)
    got = DEQUANTIZERS[qtype](blocks)
    want = ggml_ref.dequantize(blocks, qtype).reshape(got.shape)
    if qtype == GGMLType.F16:
        # ggml quiets signalling NaNs (see module docstring); all else bit-exact.
        h = blocks.view(np.uint16).reshape(-1)
        snan = ((h & 0x7C00) == 0x7C00) & ((h & 0x03FF) != 0) & ((h & 0x0200) == 0)
        assert snan.any()
        np.testing.assert_array_equal(want.view(np.uint32)[snan, 0], got.view(np.uint32)[snan, 0] | 0x00400000)
        keep = ~snan
        assert_same_bits(got[keep], want[keep], qtype.name, nan_payload=True)
    else:
        assert_same_bits(got, want, qtype.name, nan_payload=qtype == GGMLType.BF16)


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.IQ4_NL, GGMLType.F16],
                         ids=lambda t: t.name)
def test_public_shapes_follow_gguf_py(qtype):
    values, size = BLOCK_GEOMETRY[qtype]
    rng = np.random.default_rng(7)
    gtype = gguf.GGMLQuantizationType(int(qtype))
    for lead in [(), (3,), (4, 5)]:  # 1-D row, 2-D matrix, 3-D stacked experts
        raw = random_blocks(qtype, int(np.prod(lead, dtype=np.int64)) * 2, rng).reshape(*lead, 2 * size)
        got = dequantize(raw, qtype)
        with np.errstate(all="ignore"):
            want = gq.dequantize(raw, gtype)
        assert got.shape == want.shape == (*lead, 2 * values)
        assert_same_bits(got, want, f"{qtype.name} {lead}", nan_payload=qtype in FLOAT_TYPES)
    # a non-contiguous view and a name instead of the enum give the same values
    raw = random_blocks(qtype, 12, rng).reshape(3, 4 * size)
    np.testing.assert_array_equal(dequantize(raw[::2], qtype.name.lower()).view(np.uint32),
                                  dequantize(raw[::2].copy(), qtype).view(np.uint32))


def test_bad_input_is_a_fle_error():
    with pytest.raises(FleError):
        dequantize(np.zeros(35, np.uint8), GGMLType.Q8_0)
    with pytest.raises(FleError):
        DEQUANTIZERS[GGMLType.Q8_0](np.zeros((2, 35), np.uint8))


def test_decode_into_caller_buffer():
    rng = np.random.default_rng(3)
    blocks = random_blocks(GGMLType.IQ4_XS, 50, rng)
    buf = np.full((50, 256), np.nan, np.float32)
    assert DEQUANTIZERS[GGMLType.IQ4_XS](blocks, buf) is buf
    assert_same_bits(buf, DEQUANTIZERS[GGMLType.IQ4_XS](blocks), "IQ4_XS into buffer")
    with pytest.raises(FleError):
        DEQUANTIZERS[GGMLType.IQ4_XS](blocks, np.empty((50, 255), np.float32))


def test_empty_input():
    out = DEQUANTIZERS[GGMLType.Q4_K](np.zeros((0, 144), np.uint8))
    assert out.shape == (0, 256) and out.dtype == np.float32
