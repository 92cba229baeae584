"""The engine's routed-expert kernels on every expert type it runs, and its
refusal of a dense tensor whose type has no fast kernel.

For each of the 11 expert types, the per-row kernel (``experts``, the
one-token step's launch, as the engine configures it for misses) and the
union kernel (``experts_union``, the T-token step's launch, as it is
configured for hits) equal the reference (``engine_ops.experts_ref``) on
the same experts: some in slots, some read from host memory, gate+up
with SwiGLU then down with the routing weights. Types FLE quantizes to
hold ggml's blocks of normal data; the others random valid blocks with
finite scales (``tests/test_kernels.quantized``). Without CUDA the
kernels run in Triton's interpreter, so the shapes are the smallest the
formats allow (one 256-value super-block per gate/up row).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fle_engine.kernels import engine_ops  # noqa: E402
from fle_engine.runtime import Engine  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.ggml_types import BLOCK_GEOMETRY, GGMLType  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402
from test_kernels import quantized  # noqa: E402  (ggml's blocks, or random valid ones FLE cannot make)

pytestmark = pytest.mark.usefixtures("exact_float32")
DEVICE = torch.device("cuda" if CUDA else "cpu")
EXPERT_TYPES = (GGMLType.IQ2_XS, GGMLType.IQ2_S, GGMLType.IQ3_XXS, GGMLType.IQ3_S, GGMLType.IQ4_XS, GGMLType.IQ4_NL,
                GGMLType.Q2_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.Q8_0)


@pytest.fixture(scope="module")
def fast():
    pytest.importorskip("triton")
    return engine_ops.pick("triton", DEVICE)


def _close(a, b, tol=1e-5):
    scale = float(b.abs().max()) or 1.0
    assert float((a - b).abs().max()) <= tol * scale, float((a - b).abs().max()) / scale


def expert_store(qtype: GGMLType, n_exp: int, n_ff: int, n_embd: int, cached, seed: int):
    """Host experts in the engine's layout (gate|up rows, then down rows,
    each part 16-byte aligned), slots holding the experts ``cached`` (one
    slot more, empty), and the layout's numbers. Down rows hold ``n_ff``
    values padded to whole blocks of the type."""
    rng = np.random.default_rng(seed)
    n_in_d = -(-n_ff // BLOCK_GEOMETRY[qtype][0]) * BLOCK_GEOMETRY[qtype][0]
    gu = quantized(qtype, (n_exp * 2 * n_ff, n_embd), rng).cpu()          # [rows, row bytes]
    dn = quantized(qtype, (n_exp * n_embd, n_in_d), rng).cpu()
    rb_gu, rb_d = gu.shape[-1], dn.shape[-1]
    d_off = (2 * n_ff * rb_gu + 15) // 16 * 16
    eb = (d_off + n_embd * rb_d + 15) // 16 * 16
    host = torch.zeros(n_exp, eb, dtype=torch.uint8)
    host[:, :2 * n_ff * rb_gu] = gu.reshape(n_exp, -1)
    host[:, d_off:d_off + n_embd * rb_d] = dn.reshape(n_exp, -1)
    slots = torch.zeros(len(cached) + 1, eb, dtype=torch.uint8)
    slot_of = torch.full((n_exp,), -1, dtype=torch.int32)
    for s, e in enumerate(cached):
        slots[s] = host[e]
        slot_of[e] = s
    return host, slots, slot_of, dict(n_in_d=n_in_d, rb_gu=rb_gu, rb_d=rb_d, d_off=d_off, eb=eb)


def test_expert_types_are_the_engines():
    assert set(EXPERT_TYPES) == set(engine_ops.WORDS)


# random K-quant blocks give large gate values: the interpreter's exp(-gate) in SwiGLU overflows to inf (silu 0)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("qtype", EXPERT_TYPES, ids=lambda t: t.name)
def test_expert_kernels_of_each_type(fast, qtype, monkeypatch):
    """Two tokens of three experts each, experts 4 and 1 in slots and 2, 0
    and 3 read from host memory (2 by both tokens). The per-row kernel and
    the union kernel (each distinct expert read once) equal the reference's
    gate+up and down products."""
    # wide programs (16 gate+up rows, two super-blocks per iteration, the last one partial; 64 down rows):
    # the interpreter's time goes with the number of programs, ~20 times fewer than the engine's launch
    # configurations, which tests/test_engine.py::test_experts_kernel covers
    monkeypatch.setenv("FLE_EXPERT_CONFIG", "16,4,0,2,64,4,0,1")
    n_exp, n_ff, n_embd, n_used = 6, 32, 256, 3
    host, slots, slot_of, g = expert_store(qtype, n_exp, n_ff, n_embd, (4, 1), int(qtype))
    ids = torch.tensor([1, 2, 4, 0, 2, 3], dtype=torch.int64)
    gen = torch.Generator().manual_seed(int(qtype))
    x = torch.randn(2, n_embd, generator=gen) * 0.5
    wts = torch.rand(ids.numel(), generator=gen)
    wsz = engine_ops.WORDS[qtype].itemsize
    R = ids.numel()
    st = engine_ops.ExpertWords(slots, host, wsz)
    ref_h, ref_y = torch.zeros(R, n_ff), torch.zeros(R, n_embd)
    engine_ops.experts_ref(st, qtype, 0, 0, 0, n_ff, g["rb_gu"], slot_of, ids, x, ref_h, True, n_used)
    assert ref_h.abs().max() > 0
    h_in = torch.nn.functional.pad(ref_h, (0, g["n_in_d"] - n_ff)).contiguous()
    engine_ops.experts_ref(st, qtype, 0, g["d_off"] // wsz, 0, n_embd, g["rb_d"], slot_of, ids, h_in, ref_y, False,
                           n_used, wts)

    words = slots.to(DEVICE).view(-1).view(engine_ops.WORDS[qtype])
    dev_host = host.to(DEVICE)
    delta = (dev_host.data_ptr() - words.data_ptr()) // wsz
    sm, ids_d, x_d, h_d, w_d = (t.to(DEVICE) for t in (slot_of, ids, x, h_in, wts))
    for launch, mode in ((fast.experts, "miss"), (fast.experts_union, "hit")):
        h = torch.full((R, n_ff), 7.0, device=DEVICE)
        launch(words, qtype, delta, 0, g["eb"] // wsz, n_ff, g["rb_gu"], sm, ids_d, x_d, h, True, n_used, mode=mode)
        _close(h.cpu(), ref_h)
        y = torch.full((R, n_embd), 7.0, device=DEVICE)
        launch(words, qtype, delta, g["d_off"] // wsz, g["eb"] // wsz, n_embd, g["rb_d"], sm, ids_d, h_d, y, False,
               n_used, w_d, mode=mode)
        _close(y.cpu(), ref_y)


def test_dense_type_without_a_fast_kernel_is_refused(tmp_path):
    """A Q4_0 ``attn_q`` (no fast kernel) with the fast path asked for: one
    FleError line naming the file and the tensor and saying what to do, at
    load, before any step runs."""
    pytest.importorskip("triton")
    path = make_model(tmp_path / "q4.gguf", "qwen3moe", seed=1,
                      mix=[(r"^blk\.0\.attn_q\.weight$", "Q4_0"), (r"\.ffn_gate_inp\.weight$", "F32"),
                           (r".", "Q8_0")])
    with pytest.raises(FleError) as err:
        Engine(path, device=DEVICE, impl="triton", cache_budget=0, ctx_size=64, profile_path="none",
               progress=False, log=lambda m: None, graphs=False)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg
    assert "'blk.0.attn_q.weight' is Q4_0" in msg and "no fast GPU kernel" in msg
    assert "--device cpu" in msg and "fle-requant" in msg
    if not CUDA:        # the reference path runs the same file
        eng = Engine(path, device=DEVICE, impl="reference", cache_budget=0, ctx_size=64, profile_path="none",
                     progress=False, log=lambda m: None)
        assert len(eng.generate([1, 2, 3], 2)) == 2
        eng.close()
