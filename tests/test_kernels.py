"""Quantized matrix products (fle_engine.kernels): the Triton kernels equal
the reference (fle_quant's dequantizer, then a float32 matmul).

Without CUDA the kernels run in Triton's interpreter (numpy, CPU tensors):
``TRITON_INTERPRET=1`` is set here before triton is first imported, and the
matrices are small so that the module stays fast. With CUDA the same tests
run the compiled kernels on the GPU, and the ``gpu`` tests add
realistic shapes and a CUDA-graph capture of the expert form.

Equality is up to float32 summation order: the largest error at most 1e-5
of the largest |y|, and each output within 1e-5 of sum |w| |x| over its
products (the scale of the rounding error of any summation order).
Non-finite outputs (from inf/NaN scales) must match exactly, since every
weight is decoded to the same float as the reference's.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fle_engine import kernels  # noqa: E402
from fle_engine.kernels import reference  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.ggml_types import BLOCK_GEOMETRY, GGMLType  # noqa: E402
from fle_quant.quants import quantize  # noqa: E402
from fle_quant.quants.dequant import FP16_SCALE_OFFSETS  # noqa: E402
from test_dequant import random_blocks  # noqa: E402  (blocks with adversarial fp16 scales)

pytestmark = pytest.mark.usefixtures("exact_float32")
DEVICE = torch.device("cuda" if CUDA else "cpu")
FAST = (GGMLType.Q8_0, GGMLType.IQ4_XS, GGMLType.IQ3_S, GGMLType.IQ4_NL, GGMLType.Q6_K, GGMLType.Q4_K, GGMLType.Q5_K,
        GGMLType.IQ3_XXS, GGMLType.IQ2_XS, GGMLType.IQ2_S, GGMLType.Q2_0)


@pytest.fixture(scope="module")
def triton_quant():
    pytest.importorskip("triton")
    from fle_engine.kernels import triton_quant
    return triton_quant



def n_in_for(qtype: GGMLType) -> int:
    # super-block types: 2 blocks; smaller blocks: 11 of them, so that the last chunk (8 blocks of 32,
    # 4 of 64 values) is partial
    values = BLOCK_GEOMETRY[qtype][0]
    return 512 if values == 256 else 11 * values


def quantized(qtype: GGMLType, shape: tuple[int, ...], rng: np.random.Generator) -> torch.Tensor:
    """Valid blocks as ggml's quantizer makes them, of normal data with a few large outliers; for
    types FLE cannot quantize to, random bytes with finite fp16 scales of random size and sign."""
    x = rng.standard_normal(shape).astype(np.float32)
    x[rng.random(shape) < 0.01] *= 20
    try:
        return torch.from_numpy(quantize(x, qtype)).to(DEVICE)
    except FleError:
        pass
    values, size = BLOCK_GEOMETRY[qtype]
    n = int(np.prod(shape)) // values
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for off in FP16_SCALE_OFFSETS[qtype]:
        scale = (rng.uniform(0.005, 0.05, n) * rng.choice([-1, 1], n)).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(n, 2)
    return torch.from_numpy(blocks.reshape(shape[:-1] + (-1,))).to(DEVICE)


def assert_close(got: torch.Tensor, want: torch.Tensor, w_abs_x_abs: torch.Tensor, what: str) -> None:
    got, want, bound = (t.detach().cpu().double().numpy() for t in (got, want, w_abs_x_abs))
    assert got.shape == want.shape, (what, got.shape, want.shape)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN pattern")
    inf = np.isinf(want)
    np.testing.assert_array_equal(got[inf], want[inf], err_msg=f"{what}: infinities")
    fin = np.isfinite(want)
    assert np.isfinite(got[fin]).all(), what
    err = np.abs(got[fin] - want[fin])
    if err.size:
        scale = np.abs(want[fin]).max()
        assert err.max() <= 1e-5 * scale, f"{what}: max error {err.max():.3g} vs max |y| {scale:.3g}"
        worst = (err - 1e-5 * bound[fin]).argmax()
        assert err[worst] <= 1e-5 * bound[fin][worst], f"{what}: error {err[worst]:.3g} vs sum|w||x| {bound[fin][worst]:.3g}"


def abs_bound(w: torch.Tensor, qtype: GGMLType, x: torch.Tensor) -> torch.Tensor:
    wf = reference.dequantize_weights(w, qtype).double().abs()
    return x.double().abs() @ torch.nan_to_num(wf, posinf=0.0).T


def test_table(triton_quant):
    assert set(kernels.fast_types()) == set(FAST) == set(triton_quant.SUPPORTED)
    ref, fast = kernels.KERNELS[GGMLType.Q3_K]
    assert fast is None and ref.mul_mat is reference.mul_mat


@pytest.mark.parametrize("qtype", FAST, ids=lambda t: t.name)
def test_mul_mat(triton_quant, qtype):
    rng = np.random.default_rng(int(qtype))
    n_out, n_in = 37, n_in_for(qtype)  # n_out: not a multiple of the row tile
    w = quantized(qtype, (n_out, n_in), rng)
    for t in (1, 3, 11):  # 11: a full group of 8 activation rows and a partial one
        x = torch.from_numpy(rng.standard_normal((t, n_in)).astype(np.float32)).to(DEVICE)
        got = kernels.mul_mat(w, qtype, x, impl="triton")
        assert got.dtype == torch.float32 and got.device.type == DEVICE.type
        assert_close(got, reference.mul_mat(w, qtype, x), abs_bound(w, qtype, x), f"{qtype.name} T={t}")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy meets inf and NaN
@pytest.mark.parametrize("qtype", FAST, ids=lambda t: t.name)
def test_adversarial_scales(triton_quant, qtype):
    # random bytes (valid blocks of these formats) whose fp16 scales include zeros,
    # subnormals, the largest finite values, infinities and NaNs
    rng = np.random.default_rng(100 + int(qtype))
    values, size = BLOCK_GEOMETRY[qtype]
    n_out, n_in = 41, n_in_for(qtype)
    blocks = random_blocks(qtype, n_out * (n_in // values), rng)
    w = torch.from_numpy(blocks.reshape(n_out, -1)).to(DEVICE)
    x = torch.from_numpy(rng.standard_normal((3, n_in)).astype(np.float32)).to(DEVICE)
    want = reference.mul_mat(w, qtype, x)
    assert not torch.isfinite(want).all() and torch.isfinite(want).any()  # both kinds of rows are seen
    assert_close(kernels.mul_mat(w, qtype, x, impl="triton"), want, abs_bound(w, qtype, x), qtype.name)


@pytest.mark.parametrize("qtype", FAST, ids=lambda t: t.name)
def test_mul_mat_experts(triton_quant, qtype):
    rng = np.random.default_rng(200 + int(qtype))
    n_exp, n_out, n_in = 5, 21, n_in_for(qtype)
    w = quantized(qtype, (n_exp, n_out, n_in), rng)
    # unsorted ids, expert 4 unused, expert 2 on 10 rows (more than one group of 8)
    ids = np.array([2, 0, 2, 3, 2, 2, 1, 2, 3, 2, 2, 2, 2, 0])
    for t in (1, 4, len(ids)):
        x = torch.from_numpy(rng.standard_normal((t, n_in)).astype(np.float32)).to(DEVICE)
        e = torch.from_numpy(ids[:t]).to(DEVICE)
        got = kernels.mul_mat_experts(w, qtype, x, e, impl="triton")
        want = reference.mul_mat_experts(w, qtype, x, e)
        bound = torch.stack([abs_bound(w[i], qtype, x[j:j + 1])[0] for j, i in enumerate(ids[:t])])
        assert_close(got, want, bound, f"{qtype.name} T={t}")


@pytest.mark.parametrize("qtype", FAST, ids=lambda t: t.name)
def test_launch_variants(triton_quant, qtype, monkeypatch):
    # every launch path of every format: one activation row per program (products reduced once)
    # and groups of rows (each tile decoded once for the group), several tile sizes; and expert
    # calls with more rows than a program scans (each row then has its own program)
    rng = np.random.default_rng(400 + int(qtype))
    n_out, n_in = 13, n_in_for(qtype)
    w = quantized(qtype, (3, n_out, n_in), rng)
    x = torch.from_numpy(rng.standard_normal((5, n_in)).astype(np.float32)).to(DEVICE)
    ids = torch.tensor([2, 0, 2, 2, 1], device=DEVICE)
    want = reference.mul_mat(w[1], qtype, x)
    want_e = reference.mul_mat_experts(w, qtype, x, ids)
    bound = abs_bound(w[1], qtype, x)
    bound_e = torch.stack([abs_bound(w[int(i)], qtype, x[j:j + 1])[0] for j, i in enumerate(ids)])
    Config = triton_quant.Config
    # and, for the one-row fast paths, several chunks per loop iteration (a clamped chunk past the row's
    # end counts nothing) and programmatic dependent launch (a GPU of sm_90 or later; off elsewhere)
    for cfg in (Config(4, 1, 1), Config(32, 2, None), Config(8, 4, 2), Config(4, 1, 1, chunks=2),
                Config(8, 2, 1, chunks=4, pdl=True)):
        assert_close(triton_quant.mul_mat(w[1], qtype, x, config=cfg), want, bound, f"{qtype.name} {cfg}")
        assert_close(triton_quant.mul_mat_experts(w, qtype, x, ids, config=cfg), want_e, bound_e,
                     f"{qtype.name} experts {cfg}")
    monkeypatch.setattr(triton_quant, "MAX_SCAN", 4)
    assert_close(triton_quant.mul_mat_experts(w, qtype, x, ids), want_e, bound_e, f"{qtype.name} experts, no scan")


def test_experts_bad_ids(triton_quant):
    qtype = GGMLType.IQ4_XS
    rng = np.random.default_rng(7)
    w = quantized(qtype, (3, 16, 256), rng)
    x = torch.randn(4, 256, device=DEVICE)
    ids = torch.tensor([1, 3, -1, 1], device=DEVICE)
    got = kernels.mul_mat_experts(w, qtype, x, ids, impl="triton")
    assert torch.isnan(got[1:3]).all() and torch.isfinite(got[[0, 3]]).all()
    good = reference.mul_mat_experts(w, qtype, x[[0, 3]], ids[[0, 3]])
    assert_close(got[[0, 3]], good, abs_bound(w[1], qtype, x[[0, 3]]), "valid rows")
    with pytest.raises(FleError, match=r"expert ids must lie in \[0, 3\)"):
        reference.mul_mat_experts(w, qtype, x, ids)


def test_half_activations_and_empty(triton_quant):
    qtype = GGMLType.Q8_0
    rng = np.random.default_rng(8)
    w = quantized(qtype, (16, 64), rng)
    x = torch.randn(2, 64, device=DEVICE).to(torch.bfloat16)
    got = kernels.mul_mat(w, qtype, x, impl="triton")
    assert_close(got, reference.mul_mat(w, qtype, x.float()), abs_bound(w, qtype, x.float()), "bf16 x")
    assert kernels.mul_mat(w, qtype, x[:0], impl="triton").shape == (0, 16)
    empty = kernels.mul_mat_experts(w[None], qtype, x[:0], torch.zeros(0, dtype=torch.int64, device=DEVICE),
                                    impl="triton")
    assert empty.shape == (0, 16)


def test_auto_picks_by_device():
    qtype = GGMLType.IQ4_NL
    rng = np.random.default_rng(9)
    w = quantized(qtype, (8, 64), rng).cpu()
    x = torch.randn(2, 64)
    # CPU tensors: the reference, bit for bit (the kernels would sum in another order)
    assert torch.equal(kernels.mul_mat(w, qtype, x), reference.mul_mat(w, qtype, x))
    # a type without a kernel takes the reference on any device
    w4 = torch.from_numpy(quantize(rng.standard_normal((8, 256)).astype(np.float32), GGMLType.Q6_K))
    assert kernels.KERNELS[GGMLType.Q3_K][1] is None
    assert kernels.mul_mat(w4, "Q6_K", torch.randn(1, 256), impl="reference").shape == (1, 8)


def test_bad_input():
    qtype = GGMLType.IQ4_XS
    w = torch.zeros(4, 136, dtype=torch.uint8)
    x = torch.zeros(2, 256)
    with pytest.raises(FleError, match="uint8"):
        kernels.mul_mat(w.float(), qtype, x)
    with pytest.raises(FleError, match=r"\[T, 256\]"):
        kernels.mul_mat(w, qtype, torch.zeros(2, 255))
    with pytest.raises(FleError, match="whole number of 136-byte blocks"):
        kernels.mul_mat(w[:, :100], qtype, x)
    with pytest.raises(FleError, match="impl must be"):
        kernels.mul_mat(w, qtype, x, impl="cuda")
    with pytest.raises(FleError, match="no Triton kernel for Q3_K"):
        kernels.mul_mat(torch.zeros(4, 110, dtype=torch.uint8), "Q3_K", x, impl="triton")
    with pytest.raises(FleError, match="no matrix product for F32"):
        kernels.mul_mat(torch.zeros(4, 4, dtype=torch.uint8), "F32", torch.zeros(2, 1))
    with pytest.raises(FleError, match="expert_ids must be int64"):
        kernels.mul_mat_experts(w[None], qtype, x, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(FleError, match=r"\[E, n_out, row_bytes\]"):
        kernels.mul_mat_experts(w, qtype, x, torch.zeros(2, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA is not available")
@pytest.mark.parametrize("qtype", FAST, ids=lambda t: t.name)
def test_cuda_realistic_shapes_and_graph(triton_quant, qtype):
    rng = np.random.default_rng(300 + int(qtype))
    n_exp, n_out, n_in = 8, 512, 2560
    values, size = BLOCK_GEOMETRY[qtype]
    # random bytes are valid blocks of these formats; typical scales keep every output finite
    blocks = rng.integers(0, 256, (n_exp * n_out * (n_in // values), size), dtype=np.uint8)
    for off in FP16_SCALE_OFFSETS[qtype]:
        blocks[:, off:off + 2] = (rng.standard_normal((len(blocks), 1)) * 0.01).astype(np.float16).view(np.uint8)
    w = torch.from_numpy(blocks.reshape(n_exp, n_out, -1)).to(DEVICE)
    x = torch.randn(6, n_in, device=DEVICE)
    assert_close(kernels.mul_mat(w[3], qtype, x, impl="triton"), reference.mul_mat(w[3], qtype, x),
                 abs_bound(w[3], qtype, x), "dense")
    # the expert form inside a CUDA graph: new ids and activations each replay, same buffers
    ids = torch.tensor([5, 1, 5, 0, 7, 5], device=DEVICE)
    static_x, static_ids = x.clone(), ids.clone()
    kernels.mul_mat_experts(w, qtype, static_x, static_ids, impl="triton")  # compile, place tables
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = kernels.mul_mat_experts(w, qtype, static_x, static_ids, impl="triton")
    for step in range(3):
        new_ids = torch.from_numpy(rng.integers(0, n_exp, 6)).to(DEVICE)
        new_x = torch.randn(6, n_in, device=DEVICE)
        static_ids.copy_(new_ids)
        static_x.copy_(new_x)
        graph.replay()
        want = reference.mul_mat_experts(w, qtype, new_x, new_ids)
        bound = torch.stack([abs_bound(w[int(i)], qtype, new_x[j:j + 1])[0] for j, i in enumerate(new_ids)])
        assert_close(static_y, want, bound, f"{qtype.name} replay {step}")
