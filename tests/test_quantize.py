"""Quantizers: bit-identical to gguf-py for every format it quantizes, and to
ggml (through llama-cpp-python) for IQ4_NL, IQ4_XS, Q6_K, IQ3_XXS and IQ3_S.

The unit tier needs only the ``gguf`` package. The reference tier
(``-m reference``) compares against ggml's ``ggml_quantize_chunk`` and
``to_float`` and skips without llama-cpp-python.

Test data mixes the cases where quantizers differ in practice: normal and
heavy-tailed (Student-t, Cauchy) values, constant blocks, all-zero blocks,
tiny magnitudes (1e-30, and 1e-20 whose squares are float32 subnormals),
values near and beyond the fp16 range, and rows with one large spike.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from fle_quant.errors import FleError
from fle_quant.ggml_types import BLOCK_GEOMETRY, GGMLType
from fle_quant.quants import dequantize, quantize
from fle_quant.quants.quantize import QUANTIZERS

N_BLOCKS = 100_000
ROW = 1024

GGUF_TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0,
              GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.TQ1_0, GGMLType.TQ2_0, GGMLType.MXFP4]
GGML_TYPES = [GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.Q6_K, GGMLType.IQ3_XXS, GGMLType.IQ3_S]


def _kinds(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """n values (a multiple of ROW) of each kind of data."""
    spikes = rng.standard_normal(n) * 0.02
    spikes[np.arange(0, n, ROW) + rng.integers(0, ROW, n // ROW)] = 1e3  # one per row
    return {
        "normal": rng.standard_normal(n),
        "student_t2": rng.standard_t(2, n),
        "cauchy": rng.standard_cauchy(n),
        "constant": np.repeat(rng.standard_normal(n // 32), 32),
        "zero": np.zeros(n),
        "tiny_1e-30": rng.standard_normal(n) * 1e-30,
        "tiny_1e-20": rng.standard_normal(n) * 1e-20,
        "fp16_edge_6e4": rng.standard_normal(n) * 6e4,
        "beyond_fp16_1e6": rng.standard_normal(n) * 1e6,
        # up to 1e11: beyond ~1e12, x^3 overflows in ggml's IQ3 error sums and ggml aborts
        "mixed_scales": rng.standard_normal(n) * np.repeat(10.0 ** rng.uniform(-20, 11, n // 32), 32),
        "spike_rows": spikes,
    }


def varied(n_values: int, seed: int, kinds: tuple[str, ...] | None = None) -> np.ndarray:
    """(n_rows, ROW) float32: equal shares of the chosen kinds of data."""
    rng = np.random.default_rng(seed)
    names = kinds or tuple(_kinds(rng, ROW))
    per = -(-n_values // (len(names) * ROW)) * ROW
    parts = _kinds(rng, per)
    x = np.concatenate([parts[k] for k in names]).astype(np.float32)
    return x.reshape(-1, ROW)


@pytest.fixture(scope="module")
def data_small_blocks() -> np.ndarray:
    return varied(N_BLOCKS * 32, seed=1)  # >= 100,000 blocks of 32


@pytest.fixture(scope="module")
def data_large_blocks(data_small_blocks) -> np.ndarray:
    # >= 100,000 blocks of 256: eight copies of the small-block data, rows
    # shuffled and each row scaled by its own power of ten (cheaper than
    # drawing 26 M new values, and the blocks still differ).
    rng = np.random.default_rng(2)
    n = data_small_blocks.shape[0]
    parts = [data_small_blocks[rng.permutation(n)] * (10.0 ** rng.integers(-3, 3, (n, 1))).astype(np.float32)
             for _ in range(8)]
    return np.concatenate(parts)


def _gguf_quantize(x: np.ndarray, qtype: GGMLType) -> np.ndarray:
    with np.errstate(all="ignore"):
        ref = gguf.quants.quantize(x, gguf.GGMLQuantizationType(int(qtype)))
    return np.ascontiguousarray(ref).view(np.uint8).reshape(x.shape[0], -1)


def _assert_same_blocks(ours: np.ndarray, ref: np.ndarray, qtype: GGMLType, what: str) -> None:
    size = BLOCK_GEOMETRY[qtype][1]
    assert ours.shape == ref.shape, what
    bad = np.nonzero((ours.reshape(-1, size) != ref.reshape(-1, size)).any(axis=1))[0]
    assert bad.size == 0, f"{qtype.name} {what}: {bad.size} of {ours.size // size} blocks differ, first {bad[:5]}"


# ---------------------------------------------------------------- unit tier

@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: t.name)
def test_matches_gguf_py(qtype, data_small_blocks, data_large_blocks):
    block = BLOCK_GEOMETRY[qtype][0]
    x = data_large_blocks if block == 256 else data_small_blocks
    assert x.size // block >= N_BLOCKS
    with np.errstate(all="ignore"):
        ours = QUANTIZERS[qtype](x, None)
    _assert_same_blocks(ours, _gguf_quantize(x, qtype), qtype, "vs gguf-py")


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: t.name)
def test_matches_gguf_py_on_non_finite_input(qtype):
    # Quiet NaNs and infinities inside otherwise normal blocks (signalling
    # NaNs are left out: numpy's own reductions quiet them or not depending
    # on the code path).
    rng = np.random.default_rng(3)
    x = rng.standard_normal((512, 256)).astype(np.float32)
    u = rng.random(x.shape)
    x[u < 0.002] = np.nan
    x[(u > 0.5) & (u < 0.501)] = np.inf
    x[(u > 0.7) & (u < 0.701)] = -np.inf
    with np.errstate(all="ignore"):
        ours = QUANTIZERS[qtype](x, None)
    _assert_same_blocks(ours, _gguf_quantize(x, qtype), qtype, "vs gguf-py, non-finite input")


def test_mxfp4_exponent_at_powers_of_two():
    # gguf-py takes floor(log2(amax)) of a float32 log2, which rounds up for
    # the largest floats below a power of two; every exponent is tried.
    rng = np.random.default_rng(4)
    p2 = (np.arange(-126, 128, dtype=np.int64) + 127) << 23  # bit patterns of 2**k
    bits = (p2[:, None] + np.arange(-24, 3)[None, :]).reshape(-1).astype(np.uint32)
    amax = bits.view(np.float32)
    amax = amax[np.isfinite(amax) & (amax > 0)]
    x = (rng.uniform(-1, 1, (amax.size, 32)) * amax[:, None]).astype(np.float32)
    x[np.arange(amax.size), rng.integers(0, 32, amax.size)] = amax
    _assert_same_blocks(QUANTIZERS[GGMLType.MXFP4](x, None), _gguf_quantize(x, GGMLType.MXFP4), GGMLType.MXFP4,
                        "near powers of two")


# Bounds on the relative RMS error of dequantize(quantize(x)) on standard
# normal data: 10-20 % above what each format achieves here.
ROUND_TRIP_BOUND = {
    GGMLType.F32: 0.0, GGMLType.F16: 3e-4, GGMLType.BF16: 2e-3, GGMLType.Q8_0: 0.007,
    GGMLType.Q5_0: 0.05, GGMLType.Q5_1: 0.045, GGMLType.Q4_0: 0.1, GGMLType.Q4_1: 0.09,
    GGMLType.MXFP4: 0.13, GGMLType.TQ1_0: 0.85, GGMLType.TQ2_0: 0.85,  # ternary: most values round to 0
    GGMLType.IQ4_NL: 0.085, GGMLType.IQ4_XS: 0.085, GGMLType.Q6_K: 0.02,
    GGMLType.IQ3_S: 0.19, GGMLType.IQ3_XXS: 0.24,
}


def test_every_quantizer_has_a_bound():
    assert set(ROUND_TRIP_BOUND) == set(QUANTIZERS)


@pytest.mark.parametrize("qtype", list(QUANTIZERS), ids=lambda t: t.name)
def test_round_trip(qtype):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, ROW)).astype(np.float32)
    imatrix = rng.random(ROW).astype(np.float32) + 0.1
    if qtype in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1):
        # ggml would use the importance here and FLE's encoders cannot: refused, not ignored
        with pytest.raises(FleError, match="importance matrix"):
            quantize(x, qtype, imatrix)
        imatrix = None
    for im in (None, imatrix):
        q = quantize(x, qtype, im)
        assert q.dtype == np.uint8 and q.shape == (64, ROW // BLOCK_GEOMETRY[qtype][0] * BLOCK_GEOMETRY[qtype][1])
        y = dequantize(q, qtype)
        rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2))
        assert rel <= ROUND_TRIP_BOUND[qtype], f"{qtype.name}: relative RMS error {rel:.4f}"
    # All-zero input comes back as zeros.
    z = np.zeros((2, ROW), dtype=np.float32)
    assert not dequantize(quantize(z, qtype), qtype).any()


@pytest.mark.parametrize("qtype", [GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.Q6_K, GGMLType.IQ3_S],
                         ids=lambda t: t.name)
def test_imatrix_steers_the_error(qtype):
    # Columns with a large importance must come out more accurately when
    # the importance matrix says so than without it.
    rng = np.random.default_rng(6)
    x = rng.standard_normal((64, ROW)).astype(np.float32)
    imatrix = np.full(ROW, 0.01, dtype=np.float32)
    imatrix[::8] = 100.0
    err = {}
    for name, im in (("plain", None), ("imatrix", imatrix)):
        y = dequantize(quantize(x, qtype, im), qtype)
        err[name] = np.mean((y - x)[:, ::8] ** 2)
    assert err["imatrix"] < 0.9 * err["plain"], err


def test_public_api_checks_shapes():
    x = np.zeros((3, 64), dtype=np.float32)
    assert quantize(x, "iq4_nl").shape == (3, 36)
    assert quantize(x.reshape(3, 2, 32), GGMLType.Q8_0).shape == (3, 2, 34)
    with pytest.raises(FleError, match="multiple of the block size"):
        quantize(x, "q6_k")
    with pytest.raises(FleError, match="importance matrix"):
        quantize(x, "iq4_nl", np.ones(32, dtype=np.float32))


def test_parallel_split_does_not_change_bytes():
    # One long row and many short rows of the same values give the same
    # blocks (the importance matrix follows the column within the row).
    rng = np.random.default_rng(7)
    x = rng.standard_t(3, (96, 512)).astype(np.float32)
    im = rng.random(512).astype(np.float32)
    for qtype in (GGMLType.IQ4_NL, GGMLType.Q8_0):
        a = QUANTIZERS[qtype](x, None)
        b = QUANTIZERS[qtype](np.ascontiguousarray(x.reshape(1, -1)), None)
        assert np.array_equal(a.reshape(-1), b.reshape(-1))
    tiled = np.ascontiguousarray(x.reshape(1, -1))
    a = QUANTIZERS[GGMLType.IQ4_XS](x, im)
    b = QUANTIZERS[GGMLType.IQ4_XS](tiled, np.tile(im, 96))
    assert np.array_equal(a.reshape(-1), b.reshape(-1))


# ----------------------------------------------------------- reference tier

@pytest.fixture(scope="module")
def ggml():
    pytest.importorskip("llama_cpp")
    from fle_quant import ggml_ref

    if not ggml_ref.available():
        pytest.skip("llama-cpp-python is installed but its ggml library was not found")
    return ggml_ref


def _imatrices(n: int) -> dict[str, np.ndarray | None]:
    rng = np.random.default_rng(8)
    with_zeros = rng.random(n).astype(np.float32)
    with_zeros[rng.random(n) < 0.25] = 0.0
    return {
        "none": None,
        "positive": (rng.random(n) * 10 + 1e-3).astype(np.float32),
        "with_zeros": with_zeros,
    }


IQ4_KINDS = ("normal", "student_t2", "cauchy", "constant", "zero", "tiny_1e-30", "tiny_1e-20",
             "fp16_edge_6e4", "beyond_fp16_1e6", "mixed_scales", "spike_rows")


@pytest.fixture(scope="module")
def iq4_data() -> np.ndarray:
    return varied(N_BLOCKS * 32, seed=9, kinds=IQ4_KINDS)


@pytest.mark.reference
@pytest.mark.parametrize("qtype", [GGMLType.IQ4_NL, GGMLType.IQ4_XS], ids=lambda t: t.name)
@pytest.mark.parametrize("im_name", ["none", "positive", "with_zeros"])
def test_iq4_matches_ggml(ggml, iq4_data, qtype, im_name):
    im = _imatrices(ROW)[im_name]
    # IQ4_NL on >= 100,000 blocks; IQ4_XS (same code path, 256-value blocks)
    # on every second row of the same data, to keep ggml's time down.
    x = iq4_data if qtype == GGMLType.IQ4_NL else np.ascontiguousarray(iq4_data[::2])
    assert qtype != GGMLType.IQ4_NL or x.size // 32 >= N_BLOCKS
    _assert_same_blocks(QUANTIZERS[qtype](x, im), ggml.quantize(x, qtype, im), qtype, f"vs ggml, imatrix {im_name}")


# Data for the search-based formats. No sub-block of 32 is all zero here:
# for those ggml's IQ3_S misplaces codes (see test_iq3_s_zero_sub_block).
SEARCH_KINDS = ("normal", "student_t2", "cauchy", "constant", "tiny_1e-20", "fp16_edge_6e4", "mixed_scales",
                "spike_rows")


@pytest.fixture(scope="module")
def search_data() -> np.ndarray:
    return varied(len(SEARCH_KINDS) * 32 * ROW, seed=10, kinds=SEARCH_KINDS)


def _mse(x: np.ndarray, y: np.ndarray, w: np.ndarray | None = None) -> float:
    e = (y.astype(np.float64) - x) ** 2
    return float(np.mean(e if w is None else e * w))


@pytest.mark.reference
@pytest.mark.parametrize("qtype", [GGMLType.Q6_K, GGMLType.IQ3_XXS, GGMLType.IQ3_S], ids=lambda t: t.name)
@pytest.mark.parametrize("im_name", ["none", "positive", "with_zeros"])
def test_search_formats_error_vs_ggml(ggml, search_data, qtype, im_name):
    im = _imatrices(ROW)[im_name]
    w = np.ones(ROW) if im is None else im.astype(np.float64)
    n_per_kind = search_data.shape[0] // len(SEARCH_KINDS)
    for k, kind in enumerate(SEARCH_KINDS):
        x = search_data[k * n_per_kind:(k + 1) * n_per_kind]
        ours = QUANTIZERS[qtype](x, im)
        ref = ggml.quantize(x, qtype, im)
        y_ours, y_ref = dequantize(ours, qtype), ggml.dequantize(ref, qtype)
        # Scales beyond the fp16 range decode to inf/NaN in both; compare the
        # super-blocks that ggml reconstructs, and ours must reconstruct them too.
        x, y_ours, y_ref = (a.reshape(-1, 256) for a in (x, y_ours, y_ref))
        wb = np.broadcast_to(w.reshape(-1, 256), (x.shape[0] // (ROW // 256), ROW // 256, 256)).reshape(-1, 256)
        ok = np.isfinite(y_ref).all(axis=1)
        assert ok.mean() > 0.25 and np.isfinite(y_ours[ok]).all(), kind
        for label, wt in (("unweighted", None), ("importance-weighted", wb[ok])):
            e_ours, e_ref = _mse(x[ok], y_ours[ok], wt), _mse(x[ok], y_ref[ok], wt)
            assert e_ours <= 1.5 * e_ref, f"{qtype.name} {kind} {label}: MSE {e_ours:.4g} vs ggml {e_ref:.4g}"
        # Same algorithm and arithmetic as ggml: the bytes agree as well.
        _assert_same_blocks(ours, ref, qtype, f"{kind}, imatrix {im_name}")


@pytest.mark.reference
def test_iq3_s_zero_sub_block(ggml):
    # ggml's IQ3_S does not advance its code pointers past an all-zero
    # sub-block of 32, so the codes of the following sub-blocks land in the
    # wrong place; FLE keeps them in place and decodes the rest correctly.
    rng = np.random.default_rng(11)
    x = rng.standard_normal((16, 256)).astype(np.float32)
    x[:, 64:96] = 0.0
    ours = QUANTIZERS[GGMLType.IQ3_S](x, None)
    ref = ggml.quantize(x, GGMLType.IQ3_S)
    y_ours, y_ref = ggml.dequantize(ours, GGMLType.IQ3_S), ggml.dequantize(ref, GGMLType.IQ3_S)
    keep = np.r_[0:64, 96:256]
    assert _mse(x[:, keep], y_ours[:, keep]) < 0.05
    assert _mse(x[:, keep], y_ours[:, keep]) < 0.5 * _mse(x[:, keep], y_ref[:, keep])


@pytest.mark.reference
@pytest.mark.parametrize("qtype", [t for t in QUANTIZERS if t != GGMLType.F32], ids=lambda t: t.name)
def test_ggml_decodes_our_blocks_like_fle(ggml, qtype):
    # (ggml has no to_float for F32: there is nothing to decode.)
    x = varied(64 * ROW, seed=12)
    im = _imatrices(ROW)["positive"]
    with np.errstate(all="ignore"):
        q = QUANTIZERS[qtype](x, im)
    ours, theirs = dequantize(q, qtype), ggml.dequantize(q, qtype)
    assert np.array_equal(ours, theirs, equal_nan=True)
