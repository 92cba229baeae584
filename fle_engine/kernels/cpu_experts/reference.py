"""The plain, obviously right form of the CPU expert kernels, in numpy.

Every fast kernel computes each weight block's contribution from integers:
the block's codes times their sub-block scales (``S``, summed against the
int8 activation codes) and, for Q4_K / Q5_K, the minimums against the
activation sums (``M``); then, in float32,

    (d_w * d_x) * (S * c)  [ - (dmin_w * d_x) * M ]

with ``c`` the format's fixed fraction of its scale (1/4 for IQ3_XXS, 1/8
for IQ2_XS and IQ2_S, else 1), added to one float32 accumulator per output
in block order. Q2_0's 64-value blocks meet two Q8_0 activation blocks and
count as two halves, each with its own ``d_x``. Integer sums are exact, so
any kernel that follows this order of float operations is bit-identical to
this one.

The integer codes come from fle_quant's dequantizers: a block whose fp16
super-scale is set to 1 (and ``dmin`` to 0) decodes to exactly
``code * sub_scale * c``; one with ``d = 0, dmin = 1`` to ``-min``.
"""
from __future__ import annotations

import numpy as np

from fle_quant.ggml_types import BLOCK_GEOMETRY, GGMLType
from fle_quant.quants import DEQUANTIZERS, dequantize

from .acts import DOT_TYPE, Acts, quantize_acts

__all__ = ["FRACTION", "block_integers", "matvec_ref", "expert_forward_ref", "silu_mul"]

# the fixed fraction of each format's scale (c above)
FRACTION = {GGMLType.IQ3_XXS: 0.25, GGMLType.IQ2_XS: 0.125, GGMLType.IQ2_S: 0.125}
_D_OFFSET = {GGMLType.Q6_K: 208}  # fp16 super-scale byte offset; 0 for every other type here
_HAS_MIN = (GGMLType.Q4_K, GGMLType.Q5_K)
_ONE, _ZERO = np.float16(1.0).view(np.uint16), np.float16(0.0).view(np.uint16)


def _with_scales(blocks: np.ndarray, qtype: GGMLType, d, dmin) -> np.ndarray:
    b = blocks.copy()
    o = _D_OFFSET.get(qtype, 0)
    b[:, o:o + 2] = np.array([d], np.uint16).view(np.uint8)
    if qtype in _HAS_MIN:
        b[:, 2:4] = np.array([dmin], np.uint16).view(np.uint8)
    return b


def block_integers(blocks: np.ndarray, qtype: GGMLType):
    """Raw blocks [nb, block_bytes] -> (codes int64 [nb, values], d float32
    [nb], mins int64 [nb, values] or None, dmin float32 [nb] or None)."""
    deq = DEQUANTIZERS[qtype]
    c = FRACTION.get(qtype, 1.0)
    vals = deq(_with_scales(blocks, qtype, _ONE, _ZERO)).astype(np.float64) / c
    codes = np.rint(vals).astype(np.int64)
    assert np.array_equal(codes, vals), f"{qtype.name}: unit-scale decode is not integral"
    o = _D_OFFSET.get(qtype, 0)
    d = np.ascontiguousarray(blocks[:, o:o + 2]).view(np.float16).astype(np.float32).reshape(-1)
    if qtype not in _HAS_MIN:
        return codes, d, None, None
    mins = -deq(_with_scales(blocks, qtype, _ZERO, _ONE)).astype(np.int64)
    dmin = np.ascontiguousarray(blocks[:, 2:4]).view(np.float16).astype(np.float32).reshape(-1)
    return codes, d, mins, dmin


def matvec_ref(rows: np.ndarray, qtype: GGMLType, acts: Acts) -> np.ndarray:
    """``rows``: uint8 [N, row_bytes] of ``qtype``; ``acts``: activations
    quantized to its dot type, [R, n]. Returns float32 [R, N]."""
    if acts.dot != DOT_TYPE[qtype]:
        raise ValueError(f"{qtype.name} multiplies {DOT_TYPE[qtype].name} activations, not {acts.dot.name}")
    values, size = BLOCK_GEOMETRY[qtype]
    n_rows = rows.shape[0]
    nb = rows.shape[1] // size
    blocks = np.ascontiguousarray(rows).reshape(n_rows * nb, size)
    codes, d, mins, dmin = block_integers(blocks, qtype)
    n_act = acts.qs.shape[0]
    ab = acts.d.shape[1] // nb  # activation blocks per weight block (1, or 2 for Q2_0)
    half = values // ab
    x = acts.qs.astype(np.int64).reshape(n_act, nb * ab, half)
    w = codes.reshape(n_rows, nb * ab, half)
    s = np.einsum("rbi,tbi->trb", w, x)  # exact integers [R, N, blocks]
    d = np.repeat(d.reshape(n_rows, nb), ab, axis=1)  # one weight scale per activation block
    c = np.float32(FRACTION.get(qtype, 1.0))
    scale = d[None, :, :] * acts.d[:, None, :]  # float32 products
    contrib = scale * (s.astype(np.float32) * c)
    if mins is not None:
        m = np.einsum("rbi,tbi->trb", mins.reshape(n_rows, nb, values), x)
        contrib = contrib - (dmin.reshape(n_rows, nb)[None] * acts.d[:, None, :]) * m.astype(np.float32)
    out = np.zeros((n_act, n_rows), np.float32)
    for b in range(nb * ab):  # block order, one float32 addition each
        out = out + contrib[:, :, b]
    return out


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u: silu in float64 rounded to float32, then the float32 product."""
    g64 = g.astype(np.float64)
    with np.errstate(over="ignore"):  # exp(-g) = inf for g < -709: silu is then -0
        return (g64 / (1.0 + np.exp(-g64))).astype(np.float32) * u


def expert_forward_ref(experts: np.ndarray, layout, x: np.ndarray, ids: np.ndarray,
                       weights: np.ndarray) -> np.ndarray:
    """out[t] = sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)),
    e = ids[t, k] (negative: skipped), over the experts' raw bytes
    ``experts`` uint8 [E, expert_bytes] in ``layout`` (ExpertLayout)."""
    lay = layout
    n_t, k = ids.shape
    out = np.zeros((n_t, lay.n_embd), np.float32)
    xa = quantize_acts(x, DOT_TYPE[lay.gu_type])
    gu_bytes = 2 * lay.n_ff * lay.gu_row_bytes
    for t in range(n_t):
        xt = Acts(xa.dot, xa.d[t:t + 1], xa.qs[t:t + 1], xa.sums[t:t + 1])
        for j in range(k):
            e = int(ids[t, j])
            if e < 0:
                continue
            gu = experts[e, :gu_bytes].reshape(2 * lay.n_ff, lay.gu_row_bytes)
            v = matvec_ref(gu, lay.gu_type, xt)[0]
            h = silu_mul(v[:lay.n_ff], v[lay.n_ff:])
            down = experts[e, lay.down_offset:lay.down_offset + lay.n_embd * lay.down_row_bytes]
            y = matvec_ref(down.reshape(lay.n_embd, lay.down_row_bytes), lay.down_type,
                           quantize_acts(h[None], DOT_TYPE[lay.down_type]))[0]
            out[t] = out[t] + np.float32(weights[t, j]) * y
    return out


def dequantized_forward(experts: np.ndarray, layout, x: np.ndarray, ids: np.ndarray,
                        weights: np.ndarray) -> np.ndarray:
    """The same forward with float32 activations and dequantized weights
    (what the quantized activations approximate), in float64 sums."""
    lay = layout
    out = np.zeros((ids.shape[0], lay.n_embd), np.float64)
    gu_bytes = 2 * lay.n_ff * lay.gu_row_bytes
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            gu = dequantize(experts[e, :gu_bytes].reshape(2 * lay.n_ff, -1), lay.gu_type).astype(np.float64)
            v = gu @ x[t].astype(np.float64)
            g, u = v[:lay.n_ff], v[lay.n_ff:]
            with np.errstate(over="ignore"):
                h = g / (1.0 + np.exp(-g)) * u
            down = experts[e, lay.down_offset:lay.down_offset + lay.n_embd * lay.down_row_bytes]
            out[t] += float(weights[t, j]) * (dequantize(down.reshape(lay.n_embd, -1), lay.down_type) @ h)
    return out
