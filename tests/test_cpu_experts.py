"""CPU expert kernels (fle_engine.kernels.cpu_experts) against their
references.

- FLE's numba kernels equal the numpy reference bit for bit, for single
  products and for the fused expert FFN (gate/up and down of different
  types, repeated and skipped experts, T = 1..8).
- ggml's vec_dot (where llama-cpp-python is installed) equals the reference
  to float32 summation order: its SIMD sums run in another order.
- The reference itself, independently: the integer dot equals the float64
  product of the dequantized weights (fle_quant's dequantizers) and the
  dequantized activation codes within 1e-5 of sum |w| |x|, and the fused
  forward the dequantized float pipeline within 1e-3 of its scale.
- The activation quantizers equal ggml's (Q8_K: quantize_row_q8_K_ref).

Blocks: ggml's quantizer output where FLE can quantize to the type, else
random bytes with sane fp16 scales (test_kernels.quantized). Shapes are
small so that the module runs in seconds once numba's cache is warm.
"""
from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from fle_engine.kernels import cpu_experts as ce
from fle_engine.kernels.cpu_experts import fle_numba, ggml_cpu, reference, rows
from fle_engine.kernels.cpu_experts.acts import DOT_TYPE, pack_q8_k, quantize_acts, unpack_q8_0, unpack_q8_k
from fle_quant.errors import FleError
from fle_quant.ggml_types import BLOCK_GEOMETRY, GGMLType
from fle_quant.quants import dequantize

TYPES = (GGMLType.IQ2_XS, GGMLType.IQ2_S, GGMLType.IQ3_XXS, GGMLType.IQ3_S, GGMLType.IQ4_XS, GGMLType.IQ4_NL,
         GGMLType.Q2_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.Q8_0)
GGML = ggml_cpu.available()
needs_ggml = pytest.mark.skipif(not GGML, reason=f"ggml CPU library unavailable: {ggml_cpu.unavailable_reason()}")


def quantized(qtype, shape, rng) -> np.ndarray:
    from test_kernels import quantized as q  # torch-free use: returns a tensor, so convert
    return q(qtype, shape, rng).cpu().numpy()


try:
    import torch  # noqa: F401  (test_kernels' helper builds torch tensors)
except ImportError:  # pragma: no cover
    from fle_quant.quants import quantize
    from fle_quant.quants.dequant import FP16_SCALE_OFFSETS

    def quantized(qtype, shape, rng) -> np.ndarray:  # noqa: F811 - the same data as test_kernels.quantized
        x = rng.standard_normal(shape).astype(np.float32)
        x[rng.random(shape) < 0.01] *= 20
        try:
            return quantize(x, qtype)
        except FleError:
            pass
        values, size = BLOCK_GEOMETRY[qtype]
        n = int(np.prod(shape)) // values
        blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
        for off in FP16_SCALE_OFFSETS[qtype]:
            scale = (rng.uniform(0.005, 0.05, n) * rng.choice([-1, 1], n)).astype(np.float16)
            blocks[:, off:off + 2] = scale.view(np.uint8).reshape(n, 2)
        return blocks.reshape(shape[:-1] + (-1,))


def n_in(qtype) -> int:
    return 512  # two super-blocks; 16 blocks of 32, 8 of 64


def unpack(qtype, raw):
    return unpack_q8_k(raw) if DOT_TYPE[qtype] == GGMLType.Q8_K else unpack_q8_0(raw)


def dequantized_acts(a) -> np.ndarray:
    block = a.qs.shape[1] // a.d.shape[1]
    return (a.qs.astype(np.float64).reshape(a.qs.shape[0], -1, block) * a.d[:, :, None]).reshape(a.qs.shape)


def test_table():
    assert set(ce.TYPES) == set(TYPES) == set(ce.KERNELS) == set(DOT_TYPE)
    assert {DOT_TYPE[t] for t in (GGMLType.Q8_0, GGMLType.IQ4_NL, GGMLType.Q2_0)} == {GGMLType.Q8_0}
    assert all(DOT_TYPE[t] == GGMLType.Q8_K for t in TYPES
               if t not in (GGMLType.Q8_0, GGMLType.IQ4_NL, GGMLType.Q2_0))
    assert ce.pick("IQ4_XS", "reference") is ce.REFERENCE and ce.pick("IQ4_XS", "numba") is ce.NUMBA
    assert "numba" in ce.backends() and ("ggml" in ce.backends()) == GGML


def test_preferred_backend_follows_the_measured_kernels(monkeypatch):
    """The engine's CPU misses take FLE's kernels where the AVX-512 row
    kernels cover every type of the file, ggml's (when present) otherwise."""
    ggml = "ggml" if "ggml" in ce.backends() else "numba"
    monkeypatch.setattr(rows, "ISA", "avx512")
    assert ce.preferred([GGMLType.IQ3_XXS, GGMLType.IQ4_XS]) == "numba"
    assert ce.preferred(["Q4_K", "IQ2_XS", "IQ3_S"]) == "numba"
    assert ce.preferred([GGMLType.IQ3_XXS, GGMLType.Q8_0]) == ggml
    assert ce.preferred([GGMLType.Q6_K]) == ggml
    monkeypatch.setattr(rows, "ISA", "avx2")
    assert ce.preferred([GGMLType.IQ4_XS]) == ggml


@needs_ggml
def test_dot_types_are_ggml_s():
    for t in TYPES:
        assert ggml_cpu.traits(t).dot == DOT_TYPE[t], t.name


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matvec_numba_equals_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    w = quantized(qtype, (37, n_in(qtype)), rng)
    for t in (1, 3, 8):
        x = rng.standard_normal((t, n_in(qtype))).astype(np.float32)
        a = quantize_acts(x, DOT_TYPE[qtype])
        want = reference.matvec_ref(w, qtype, a)
        got = fle_numba.matvec(w, qtype, a)
        np.testing.assert_array_equal(got, want, err_msg=f"{qtype.name} T={t}")
        # the reference's integers against fle_quant's dequantizer, in float64
        wf = dequantize(w, qtype).astype(np.float64)
        xf = dequantized_acts(a)
        bound = np.abs(xf) @ np.abs(wf).T
        err = np.abs(want - xf @ wf.T)
        assert (err <= 1e-5 * bound + 1e-30).all(), f"{qtype.name}: {(err / bound).max():.3g}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matvec_row_lengths(qtype):
    # rows of one block, of an odd number of blocks (the down rows of a 768-wide FFN hold 3 of 256) and, for
    # the 32-value types, of a block count that is not a multiple of 8 (Q8_0's groups of 8 blocks and their
    # remainder); 13 rows (not a multiple of the 16-row work items), 1, 2 and 5 tokens
    values = BLOCK_GEOMETRY[qtype][0]
    lengths = (256, 768) if values == 256 else (64, 576, 768)
    rng = np.random.default_rng(200 + int(qtype))
    for n in lengths:
        w = quantized(qtype, (13, n), rng)
        for t in (1, 2, 5):
            a = quantize_acts(rng.standard_normal((t, n)).astype(np.float32), DOT_TYPE[qtype])
            np.testing.assert_array_equal(fle_numba.matvec(w, qtype, a), reference.matvec_ref(w, qtype, a),
                                          err_msg=f"{qtype.name} n={n} T={t}")


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matvec_catches_a_wrong_block(qtype):
    # the comparison can fail: one flipped code bit in one block changes the product
    rng = np.random.default_rng(50 + int(qtype))
    w = quantized(qtype, (4, n_in(qtype)), rng)
    a = quantize_acts(rng.standard_normal((1, n_in(qtype))).astype(np.float32), DOT_TYPE[qtype])
    bad = w.copy()
    bad[2, BLOCK_GEOMETRY[qtype][1] - 3] ^= 0x10  # a code byte (every type keeps codes at its block's end)
    if qtype == GGMLType.Q6_K:
        bad[2, 5] ^= 0x10
    got = fle_numba.matvec(bad, qtype, a)
    assert not np.array_equal(got[0, 2], reference.matvec_ref(w, qtype, a)[0, 2])
    np.testing.assert_array_equal(got, reference.matvec_ref(bad, qtype, a))


@needs_ggml
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matvec_ggml_equals_reference(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    w = quantized(qtype, (37, n_in(qtype)), rng)
    x = rng.standard_normal((3, n_in(qtype))).astype(np.float32)
    xq = ggml_cpu.quantize(x, qtype)
    want = reference.matvec_ref(w, qtype, unpack(qtype, xq))
    got = ggml_cpu.matvec(w, qtype, xq)
    wf = np.abs(dequantize(w, qtype).astype(np.float64))
    bound = np.abs(dequantized_acts(unpack(qtype, xq))) @ wf.T
    assert (np.abs(got - want) <= 1e-6 * bound).all(), qtype.name


@needs_ggml
def test_activation_quantizers_equal_ggml():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 1024)).astype(np.float32)
    x[0, :256] = 0  # an all-zero block
    x[1, 7] = 40.0  # a positive largest value (ggml's scale is then negative)
    for qt in (GGMLType.IQ4_XS, GGMLType.Q8_0):
        mine = quantize_acts(x, DOT_TYPE[qt])
        theirs = unpack(qt, ggml_cpu.quantize(x, qt))
        np.testing.assert_array_equal(mine.qs, theirs.qs)
        np.testing.assert_array_equal(mine.d, theirs.d)
    # Q8_K's packed bytes, bsums included, as ggml's from_float writes them
    np.testing.assert_array_equal(pack_q8_k(quantize_acts(x, GGMLType.Q8_K)), ggml_cpu.quantize(x, GGMLType.IQ4_XS))


def experts_buffer(lay, n_exp, rng) -> np.ndarray:
    buf = np.zeros((n_exp, lay.expert_bytes), np.uint8)
    gu = 2 * lay.n_ff * lay.gu_row_bytes
    for e in range(n_exp):
        buf[e, :gu] = quantized(lay.gu_type, (2 * lay.n_ff, lay.n_embd), rng).reshape(-1)
        buf[e, lay.down_offset:lay.down_offset + lay.n_embd * lay.down_row_bytes] = \
            quantized(lay.down_type, (lay.n_embd, lay.n_ff), rng).reshape(-1)
    return buf


# every type appears as gate/up and as down; mixed pairs as the releases mix them
PAIRS = [(t, t) for t in TYPES] + [(GGMLType.Q4_K, GGMLType.Q6_K), (GGMLType.IQ3_XXS, GGMLType.Q8_0),
                                   (GGMLType.IQ2_S, GGMLType.Q2_0), (GGMLType.IQ4_NL, GGMLType.IQ3_S)]
IDS = np.array([[0, 2, 4, -1], [2, 1, 0, 3], [4, 4, -1, 1], [3, 3, 3, 3], [-1, -1, -1, -1],
                [1, 0, 2, 4], [0, 0, 1, 1], [2, 3, 4, 0]])


def scaled_error(got, fl_out, bound):
    return (np.abs(got - fl_out) / np.maximum(bound, 1e-30)).max()


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("gu,down", PAIRS, ids=lambda t: t.name)
def test_expert_forward(gu, down):
    rng = np.random.default_rng(1000 + 64 * int(gu) + int(down))
    lay = ce.Geometry.of(256, 512, gu, down)
    buf = experts_buffer(lay, 5, rng)
    for n_t in (1, 8):
        x = rng.standard_normal((n_t, lay.n_embd)).astype(np.float32)
        ids = IDS[:n_t] if n_t > 1 else IDS[1:2]
        w = rng.random(ids.shape).astype(np.float32)
        want = ce.expert_forward(buf, lay, x, ids, w, impl="reference")
        got = ce.expert_forward(buf, lay, x, ids, w, impl="numba")
        np.testing.assert_array_equal(got, want, err_msg=f"{gu.name}/{down.name} T={n_t}")
        if n_t == 8:
            assert not want[4].any()  # a token with no expert here gets zeros
        fl_out, bound = float_pipeline(buf, lay, x, ids, w)
        assert scaled_error(want, fl_out, bound) <= 1e-3, f"{gu.name}/{down.name} T={n_t}"
        if GGML:
            gg = ce.expert_forward(buf, lay, x, ids, w, impl="ggml")
            fl_out, bound = float_pipeline(buf, lay, x, ids, w, ggml_acts)
            # ggml's gate/up sums differ from these by float32 rounding, which can move a value of
            # silu * up across a rounding boundary of its 8-bit code: one code step moves an output by
            # up to 1/127 of its block's share of the scale, hence the wider bound
            assert scaled_error(gg, fl_out, bound) <= 1e-2, f"ggml {gu.name}/{down.name} T={n_t}"


def fle_acts(x, qtype):
    return quantize_acts(x, DOT_TYPE[qtype])


def ggml_acts(x, qtype):
    return unpack(qtype, ggml_cpu.quantize(x, qtype))


def float_pipeline(buf, lay, x, ids, w, acts=fle_acts):
    """The forward in float64 from dequantized weights and the dequantized
    activation codes at each stage (quantized by ``acts``, the backend's
    quantizer); and its scale sum_k |w_k| |D| |h|."""
    out = np.zeros((ids.shape[0], lay.n_embd))
    bound = np.zeros_like(out)
    gu_bytes = 2 * lay.n_ff * lay.gu_row_bytes
    xa = dequantized_acts(acts(x, lay.gu_type))
    gus = dequantize(buf[:, :gu_bytes].reshape(buf.shape[0], 2 * lay.n_ff, -1), lay.gu_type).astype(np.float64)
    downs = dequantize(buf[:, lay.down_offset:lay.down_offset + lay.n_embd * lay.down_row_bytes]
                       .reshape(buf.shape[0], lay.n_embd, -1), lay.down_type).astype(np.float64)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if e < 0:
                continue
            gu = gus[e]
            v = gu @ xa[t]
            with np.errstate(over="ignore"):
                h = v[:lay.n_ff] / (1 + np.exp(-v[:lay.n_ff])) * v[lay.n_ff:]
            ha = dequantized_acts(acts(h[None].astype(np.float32), lay.down_type))[0]
            d = downs[e]
            out[t] += w[t, j] * (d @ ha)
            bound[t] += abs(w[t, j]) * (np.abs(d) @ np.abs(ha))
    return out, bound


def test_forward_catches_a_wrong_weight():
    rng = np.random.default_rng(3)
    lay = ce.Geometry.of(256, 256, GGMLType.IQ4_XS, GGMLType.IQ4_XS)
    buf = experts_buffer(lay, 2, rng)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    ids, w = np.array([[1, 0]]), np.array([[0.5, 0.25]], np.float32)
    want = ce.expert_forward(buf, lay, x, ids, w, impl="reference")
    swapped = ce.expert_forward(buf, lay, x, ids, w[:, ::-1], impl="numba")
    assert not np.array_equal(swapped, want)


def test_layout_matches_the_engine():
    weights = pytest.importorskip("fle_engine.runtime.weights")
    for gu, down in PAIRS:
        g = ce.Geometry.of(768, 2048, gu, down)
        lay = weights.ExpertLayout(768, 2048, gu, g.gu_row_bytes, down, g.down_row_bytes)
        assert (lay.down_offset, lay.expert_bytes) == (g.down_offset, g.expert_bytes)
    # an ExpertLayout is accepted as it is
    rng = np.random.default_rng(4)
    g = ce.Geometry.of(256, 256, GGMLType.Q4_K, GGMLType.Q6_K)
    lay = weights.ExpertLayout(*g)
    buf = experts_buffer(g, 2, rng)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    ids, w = np.array([[0, 1], [1, -1]]), np.ones((2, 2), np.float32)
    np.testing.assert_array_equal(ce.expert_forward(buf, lay, x, ids, w, impl="numba"),
                                  ce.expert_forward(buf, g, x, ids, w, impl="reference"))


def test_bad_input():
    g = ce.Geometry.of(256, 256, GGMLType.IQ4_XS, GGMLType.IQ4_XS)
    buf = np.zeros((3, g.expert_bytes), np.uint8)
    x = np.zeros((1, 256), np.float32)
    ids, w = np.zeros((1, 2), np.int64), np.ones((1, 2), np.float32)
    with pytest.raises(FleError, match="impl must be"):
        ce.expert_forward(buf, g, x, ids, w, impl="cuda")
    with pytest.raises(FleError, match="below 3"):
        ce.expert_forward(buf, g, x, ids + 3, w)
    with pytest.raises(FleError, match=r"uint8 \[E, "):
        ce.expert_forward(buf[:, :-16], g, x, ids, w)
    with pytest.raises(FleError, match="C-contiguous"):
        ce.expert_forward(np.zeros((3, 2 * g.expert_bytes), np.uint8)[:, ::2], g, x, ids, w)
    with pytest.raises(FleError, match=r"x must be \[T, 256\]"):
        ce.expert_forward(buf, g, np.zeros((1, 128), np.float32), ids, w)
    with pytest.raises(FleError, match="no CPU expert kernel for Q3_K"):
        ce.pick("Q3_K")
    assert ce.expert_forward(buf, g, x[:0], ids[:0], w[:0]).shape == (0, 256)


def test_no_torch():
    # the package's parent (fle_engine) imports torch on purpose; the kernels' own modules must not
    for mod in ("acts", "reference", "fle_numba", "ggml_cpu", "simd", "simd512", "rows", "plan", "team",
                "__init__"):
        src = open(f"{ce.__path__[0]}/{mod}.py").read()
        assert not re.search(r"^\s*(import|from) torch", src, re.M), mod
    out = subprocess.run([sys.executable, "-c", "import sys, fle_quant; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


_ISA_CHECK = """
import sys
import numpy as np
from fle_engine.kernels import cpu_experts as ce
from fle_engine.kernels.cpu_experts import fle_numba, reference, rows, quantize_acts, DOT_TYPE
from fle_quant.ggml_types import GGMLType
from test_cpu_experts import quantized, experts_buffer
assert rows.ISA == sys.argv[1], rows.ISA
rng = np.random.default_rng(5)
for qt in fle_numba.CODES:
    for n, t in ((512, 2), (768, 1)):
        w = quantized(qt, (24, n), rng)
        acts = quantize_acts(rng.standard_normal((t, n)).astype(np.float32), DOT_TYPE[qt])
        np.testing.assert_array_equal(fle_numba.matvec(w, qt, acts), reference.matvec_ref(w, qt, acts),
                                      err_msg=f"{qt.name} n={n} T={t}")
for gu, dn in ((GGMLType.IQ4_XS, GGMLType.Q4_K), (GGMLType.IQ3_XXS, GGMLType.IQ2_XS), (GGMLType.IQ3_S, GGMLType.Q6_K)):
    lay = ce.Geometry.of(256, 512, gu, dn)
    buf = experts_buffer(lay, 3, rng)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    ids, w = np.array([[0, 2], [2, 1]]), rng.random((2, 2)).astype(np.float32)
    np.testing.assert_array_equal(ce.expert_forward(buf, lay, x, ids, w, impl="numba"),
                                  ce.expert_forward(buf, lay, x, ids, w, impl="reference"), err_msg=f"{gu.name}/{dn.name}")
print("ok")
"""


def _run_isa(isa, **env_extra):
    """_ISA_CHECK in a process of its own that forces ``isa``, on the same
    numba cache as this process (the ISA is in the kernels' cache keys)."""
    import os
    from pathlib import Path

    env = dict(os.environ, **env_extra,
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1]),
                                           os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _ISA_CHECK, isa], capture_output=True, text=True, env=env,
                         timeout=900)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.skipif(rows.ISA == "portable", reason="this CPU runs the portable path in every test already")
def test_portable_path_equals_reference():
    """The portable LLVM vector IR (FLE_CPU_PORTABLE=1: what CPUs without
    AVX2 run) is bit-identical to the reference too, every type."""
    _run_isa("portable", FLE_CPU_PORTABLE="1")


@pytest.mark.skipif(rows.ISA != "avx512", reason="this CPU runs the AVX2 (or portable) path in every test already")
def test_avx2_path_equals_reference():
    """On an AVX-512 host, the AVX2 kernels (FLE_CPU_ISA=avx2: what CPUs
    without AVX-512 run) are bit-identical to the reference too."""
    _run_isa("avx2", FLE_CPU_ISA="avx2")


def test_isa_follows_the_host():
    from llvmlite import binding

    from fle_engine.kernels.cpu_experts import simd, simd512

    feats = binding.get_host_cpu_features()
    want = all(feats.get(f, False) for f in ("avx512f", "avx512bw", "avx512vl", "avx512vnni", "avx512vbmi", "gfni",
                                             "avx512bitalg"))
    cap = simd.isa_cap()
    assert simd512.AVX512 == (want and cap == "avx512")
    assert rows.ISA == ("avx512" if simd512.AVX512 else "avx2" if simd.AVX2 else "portable")


def test_isa_is_in_the_cache_key():
    """The AVX2 and portable row kernels of one type are closures over the
    ISA, which numba's cache hashes into their index keys; the AVX-512 ones
    closures over their type's name: one key per type, and the same key in
    every process (the name pickles alike)."""
    from numba.core.caching import FunctionCache
    from numba.core.registry import cpu_target

    codegen = cpu_target.target_context.codegen()
    for code in range(11):
        keys = {FunctionCache(rows._generic(i, code))._index_key(rows.SIG.args, codegen) for i in (0, 1)}
        assert len(keys) == 2
    keys = [FunctionCache(rows._avx512(n))._index_key(rows.SIG.args, codegen) for n in rows.AVX512_KERNELS.values()]
    assert len(set(keys)) == len(keys)
    assert FunctionCache(rows._avx512("iq4_xs"))._index_key(rows.SIG.args, codegen) in keys


def test_layouts():
    from fle_engine.kernels.cpu_experts import simd512

    for row in simd512.PERM:
        assert sorted(row) == list(range(256))
    kernels = {GGMLType.IQ3_XXS, GGMLType.IQ3_S, GGMLType.IQ2_XS, GGMLType.IQ4_XS, GGMLType.Q4_K}
    assert {t for t, c in fle_numba.CODES.items() if simd512.LAYOUTS[c] >= 0} == kernels
    assert {t for t, c in fle_numba.CODES.items() if c in rows.AVX512_KERNELS} == kernels
    rng = np.random.default_rng(9)
    for t in kernels:
        q = rng.integers(-127, 128, 768, dtype=np.int8)
        got = q.copy()
        kind = rows.layout(fle_numba.CODES[t])
        rows.arrange(kind, got)
        want = q.reshape(3, 256)[:, simd512.PERM[kind]].reshape(-1) if kind > 0 else q
        np.testing.assert_array_equal(got, want, err_msg=t.name)
