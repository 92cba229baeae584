"""AVX-512 block sums for the CPU expert kernels: IQ3_XXS, IQ3_S, IQ2_XS,
IQ4_XS and Q4_K, up to 8 blocks per call.

Used where the host has AVX-512 BW / VL / VNNI / VBMI, GFNI and BITALG
(Ice Lake and later Intel server cores, Zen 4 and later), as
:data:`AVX512`; ``FLE_CPU_ISA=avx2`` or ``portable`` turns it off (see
:func:`.simd.isa_cap`). Every intrinsic here computes, for ``n`` consecutive blocks
of one type at ``w[o:]`` against activation codes at ``x[xo:]``, the exact
integer block sums ``S_b`` of :mod:`.reference` (codes times sub-block
scales times activation codes; Q4_K also its minimums' sums ``M_b``) and
from them each block's float contribution, in the reference's float
steps, stored to ``out[0:n]``; the row kernels (:mod:`.rows`) add those to
their accumulator in block order.

What the 512-bit registers change, against the AVX2 kernels of :mod:`.simd`:

- grid look-ups from registers: IQ3_XXS's 256 and IQ3_S's 512 grid entries
  are split into byte tables of 128 entries, two zmm registers each, read
  64 indices at a time by ``vpermi2b`` (VBMI) and merged on the index's
  high bits with mask blends; IQ3_S packs two grid values (4 bits each)
  per table byte. IQ2_XS's 512 entries of 8 bytes are too large for that
  and are gathered (``vpgatherdq``, 8 entries per instruction), as are no
  others. IQ4_XS's code book is one ``vpermb`` of a 64-byte table (the
  nibble's upper bits ignored by the table's period of 16).
- signs as mask registers: IQ3_S's sign bits are its own mask words; the
  KSIGNS bytes of IQ2_XS and IQ3_XXS come from the 7-bit indices by
  ``vpmultishiftqb`` (the fields cut out into bytes) and one
  ``gf2p8affineqb`` (GFNI: bit 7 = the parity of bits 0..6, which is
  KSIGNS), then ``vpshufbitqmb`` (BITALG) or a stack slot turns them into
  masks; the activations are negated under the mask (one masked subtract).
- products: ``vpmaddubsw`` (unsigned grid or nibble value times signed
  activation into int16 pairs, never saturating: every unsigned side here
  is at most 62 or 15, or |code| <= 127 against |x| <= 127) and
  ``vpdpwssd`` (VNNI) with the sub-block scales; IQ4_XS instead shifts its
  code book by 128 into unsigned bytes, multiplies with ``vpdpbusd`` (4
  products per 32-bit lane) and subtracts 128 times the scaled activation
  sums of each sub-block (the Q8_K sums of 32 codes) once per block.
- one horizontal reduction for up to 8 blocks: the blocks' 16-lane
  accumulators are summed in a tree of lane shuffles into one vector of 8
  sums, instead of a full reduction per block.
- activation layouts: a kernel reads the activation codes of a 256-value
  block in the order its weights come out of the registers, so that every
  vector of a block shares one vector of scales: :data:`LAYOUTS` (per type
  code of :mod:`.fle_numba`) and :data:`PERM` (``x'[i] = x[PERM[layout,
  i]]`` within each 256-value block); :func:`.rows.arrange` applies
  it to each activation row once per call. IQ3_XXS and IQ3_S read value k
  of grid entry e at 64 k + e (four vectors, one per position in the
  entries), IQ4_XS the low and the high nibbles of four sub-blocks as one
  vector each, Q4_K the low (and high) nibbles of two 32-byte chunks as one
  vector. IQ2_XS reads them in place.

The sums are exact integers, so the results equal the reference's bit for
bit (``tests/test_cpu_experts.py``, which also runs the AVX2 and portable
paths in processes of their own).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from fle_quant.quants.tables import IQ2XS_GRID, IQ3S_GRID, IQ3XXS_GRID, KVALUES_IQ4NL

from .simd import AVX2, _base, _escape, _fn, _host_feature, _ld, _scales_mins_k4

__all__ = ["AVX512", "ISA", "LAYOUTS", "PERM", "GROUPS", "group_sums", "GF_KSIGNS",
           "stack_f32x16"]

AVX512 = all(_host_feature(f) for f in ("avx512f", "avx512bw", "avx512vl", "avx512vnni", "avx512vbmi", "gfni",
                                        "avx512bitalg"))
ISA = "avx512" if AVX512 else "avx2" if AVX2 else "portable"     # the kernels this process runs

_I1, _I8, _I16, _I32, _I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_B64 = ir.VectorType(_I8, 64)      # a zmm register as 64 bytes
_W32 = ir.VectorType(_I16, 32)     # ... as 32 words
_D16 = ir.VectorType(_I32, 16)     # ... as 16 dwords
_Q8 = ir.VectorType(_I64, 8)
_K64 = ir.VectorType(_I1, 64)      # a 64-bit mask register
_D8 = ir.VectorType(_I32, 8)


def _c(ty, vals):
    return ir.Constant(ty, [int(v) for v in vals])


def _splat(ty, v):
    return ir.Constant(ty, [v] * ty.count)


def _shuf(b, v, idx, w=None):
    """Lanes ``idx`` of ``v`` (and of ``w``: indices from len(v) on)."""
    return b.shuffle_vector(v, w if w is not None else ir.Constant(v.type, ir.Undefined),
                            ir.Constant(ir.VectorType(_I32, len(idx)), list(idx)))


# ---------------------------------------------------------------------------
# instructions


def _maddubs(b, u, s):
    """vpmaddubsw: unsigned bytes u times signed bytes s, adjacent pairs summed into int16."""
    return b.call(_fn(b, "llvm.x86.avx512.pmaddubs.w.512", _W32, [_B64, _B64]), [u, s])


def _dpwssd(b, acc, p16, sc16):
    """vpdpwssd: acc + the int16 pairs of p16 times those of sc16, summed per 32-bit lane."""
    return b.call(_fn(b, "llvm.x86.avx512.vpdpwssd.512", _D16, [_D16, _D16, _D16]),
                  [acc, b.bitcast(p16, _D16), b.bitcast(sc16, _D16)])


def _dpbusd(b, acc, u, s):
    """vpdpbusd: acc + 4 products of unsigned bytes u and signed bytes s per 32-bit lane."""
    return b.call(_fn(b, "llvm.x86.avx512.vpdpbusd.512", _D16, [_D16, _D16, _D16]),
                  [acc, b.bitcast(u, _D16), b.bitcast(s, _D16)])


def _permi2b(b, t0, idx, t1):
    """vpermi2b: byte (idx & 127) of the 128-byte table t0 | t1, per lane."""
    return b.call(_fn(b, "llvm.x86.avx512.vpermi2var.qi.512", _B64, [_B64, _B64, _B64]), [t0, idx, t1])


def _permb(b, table, idx):
    """vpermb: byte (idx & 63) of the 64-byte table, per lane."""
    return b.call(_fn(b, "llvm.x86.avx512.permvar.qi.512", _B64, [_B64, _B64]), [table, idx])


def _bitshuffle(b, src, idx):
    """vpshufbitqmb: mask bit j = bit (idx[j] & 63) of 64-bit word j // 8 of src."""
    return b.call(_fn(b, "llvm.x86.avx512.vpshufbitqmb.512", _K64, [_B64, _B64]), [src, idx])


def _multishift(b, ctrl, data):
    """vpmultishiftqb: byte j = the 8 bits of data's 64-bit word j // 8 from bit ctrl[j] on."""
    n = data.type.count
    vt = ir.VectorType(_I8, n)
    return b.call(_fn(b, f"llvm.x86.avx512.pmultishift.qb.{8 * n}", vt, [vt, vt]), [_c(vt, ctrl), data])


# gf2p8affineqb's matrix that keeps bits 0..6 of a byte and sets bit 7 to their parity: KSIGNS of a 7-bit
# sign index (bit 7 of the input is ignored). Row of output bit i: byte 7 - i of the 64-bit word.
GF_KSIGNS = 0x7F | sum((1 << (7 - k)) << (8 * k) for k in range(1, 8))


def _ksigns(b, v):
    n = v.type.count
    vt = ir.VectorType(_I8, n)
    mat = _c(vt, [(GF_KSIGNS >> (8 * (i % 8))) & 0xFF for i in range(n)])
    return b.call(_fn(b, f"llvm.x86.vgf2p8affineqb.{8 * n}", vt, [vt, vt, _I8]), [v, mat, _I8(0)])


def _gather_q(b, table, idx8):
    """vpgatherdq: 8 64-bit words of ``table`` (an i64 array global) at the 32-bit indices idx8."""
    f = _fn(b, "llvm.x86.avx512.mask.gather.dpq.512", _Q8,
            [_Q8, _I8.as_pointer(), _D8, ir.VectorType(_I1, 8), _I32])
    return b.call(f, [ir.Constant(_Q8, ir.Undefined), b.bitcast(table, _I8.as_pointer()), idx8,
                      _splat(ir.VectorType(_I1, 8), 1), _I32(8)])


def _negate_where(b, m, x):
    """x with the lanes under mask m negated (one masked subtract)."""
    return b.select(m, b.sub(_splat(_B64, 0), x), x)


def _mask_at(b, p, off):
    """The 64-bit mask stored at byte ``off`` of p."""
    return b.bitcast(b.load(b.bitcast(b.gep(p, [_I64(off)]), _I64.as_pointer()), align=1), _K64)


def _masks_of(b, v32):
    """<32 x i8> -> its four 64-bit words as masks, through a stack slot
    (four mask loads rather than lane moves)."""
    slot = cgutils.alloca_once(b, v32.type)
    b.store(v32, slot, align=32)
    p = b.bitcast(slot, _I8.as_pointer())
    _escape(b, p)
    return [_mask_at(b, p, 8 * i) for i in range(4)]


def _odd(b, v):
    """2 v + 1 (the grid types' sub-block scales from their 4-bit fields)."""
    return b.or_(b.shl(v, _splat(v.type, 1)), _splat(v.type, 1))


# ---------------------------------------------------------------------------
# tables

_KIND_NATURAL, _KIND_T4, _KIND_IQ4, _KIND_Q4K = range(4)


def _perm_table() -> np.ndarray:
    """PERM[kind, i]: the natural index of position i of a 256-value block."""
    p = np.zeros((4, 256), np.int64)
    p[_KIND_NATURAL] = np.arange(256)
    e, k = np.meshgrid(np.arange(64), np.arange(4))        # position 64 k + e <- value 4 e + k
    p[_KIND_T4, (64 * k + e).ravel()] = (4 * e + k).ravel()
    for c in range(2):
        for h in range(2):
            for L in range(4):
                i = np.arange(16)
                p[_KIND_IQ4, 128 * c + 64 * h + 16 * L + i] = 128 * c + 32 * L + 16 * h + i
            for t in range(2):
                i = np.arange(32)
                p[_KIND_Q4K, 128 * c + 64 * h + 32 * t + i] = 128 * c + 64 * t + 32 * h + i
    assert all(sorted(row) == list(range(256)) for row in p)
    return p


PERM = _perm_table()
# the layout of each type code of .fle_numba (IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_XS, IQ4_NL, Q2_0, Q4_K, Q5_K,
# Q6_K, Q8_0): -1 where the type has no kernel here
LAYOUTS = np.array([_KIND_NATURAL, -1, _KIND_T4, _KIND_T4, _KIND_IQ4, -1, -1, _KIND_Q4K, -1, -1, -1], np.int64)


def _pack(grid, dtype):
    return np.ascontiguousarray(grid.astype(np.uint8)).view(dtype).reshape(-1)


_G3XXS_BYTES = IQ3XXS_GRID.astype(np.uint8)          # (256, 4)
_G3S_BYTES = IQ3S_GRID.astype(np.int64)              # (512, 4), values 1..15
_G2XS = _pack(IQ2XS_GRID, np.uint64)                 # (512,)


def _tables(rows):
    """A byte table as its 64-byte zmm constants."""
    rows = np.asarray(rows, np.int64)
    return [_c(_B64, rows[64 * q:64 * q + 64]) for q in range(len(rows) // 64)]


# ---------------------------------------------------------------------------
# one block's accumulators: (b, w: i8* at the block, x: i8* at its activation codes, xs: i32* at its 8 sums of
# 32 codes, consts) -> [<16 x i32> whose lane sum is S] (+ [the same for M], Q4_K)


def _acc_iq3_xxs(b, w, x, xs, t):
    """IQ3_XXS (98 bytes: d | 64 grid indices | 8 x u32: four 7-bit sign
    indices and a 4-bit scale), layout T4. Zmm k holds value k of all 64
    grid entries: byte table k (256 entries) read by two vpermi2b, merged on
    bit 7 of the index."""
    idx = _ld(b, w, 2, 64)
    k7 = b.icmp_signed("<", idx, _splat(_B64, 0))
    auxb = _ld(b, w, 66, 32)
    aux = b.bitcast(auxb, _D8)
    # sign bytes: the four 7-bit fields of each aux word cut out into bytes, KSIGNS by GFNI; aux word j's 32 sign
    # bits (value i of sub-block j at bit i) as 64-bit word j, for vpshufbitqmb
    sb = _ksigns(b, _multishift(b, [0, 7, 14, 21, 32, 39, 46, 53] * 4, auxb))
    src = b.bitcast(b.zext(b.bitcast(sb, _D8), _Q8), _B64)
    # word w of a product covers entries 2w, 2w + 1: sub-block w // 4
    sc = b.bitcast(_odd(b, b.lshr(aux, _splat(_D8, 28))), ir.VectorType(_I16, 16))      # word 2 j: scale j
    sw = _shuf(b, sc, [2 * (i // 4) for i in range(32)])
    acc = _splat(_D16, 0)
    for k in range(4):
        tab = t[k]
        g = b.select(k7, _permi2b(b, tab[2], idx, tab[3]), _permi2b(b, tab[0], idx, tab[1]))
        m = _bitshuffle(b, src, _c(_B64, [4 * (e % 8) + k for e in range(64)]))
        xv = _negate_where(b, m, _ld(b, x, 64 * k, 64))
        acc = _dpwssd(b, acc, _maddubs(b, g, xv), sw)
    return [acc]


def _consts_iq3_xxs(b):
    return [_tables(_G3XXS_BYTES[:, k]) for k in range(4)]


def _acc_iq3_s(b, w, x, xs, t):
    """IQ3_S (110 bytes: d | qs[64] | qh[8] | signs[32] | scales[4]), layout
    T4. Grid index e = qs[e] | bit e of qh << 8; two tables of 512 bytes
    hold values 0, 1 and 2, 3 of each entry as nibbles, read by four
    vpermi2b each, merged on bit 7 of qs and on the qh bit."""
    idx = _ld(b, w, 2, 64)
    k7 = b.icmp_signed("<", idx, _splat(_B64, 0))
    k8 = _mask_at(b, w, 66)
    m15 = _splat(_B64, 15)
    vals = []
    for p in range(2):
        tab = t[p]
        r = [_permi2b(b, tab[2 * q], idx, tab[2 * q + 1]) for q in range(4)]
        pk = b.select(k8, b.select(k7, r[3], r[2]), b.select(k7, r[1], r[0]))
        vals.append(b.and_(pk, m15))
        vals.append(b.and_(b.bitcast(b.lshr(b.bitcast(pk, _W32), _splat(_W32, 4)), _B64), m15))
    # sign bit i of the block is value i's: entries 8 q .. 8 q + 7 (values 32 q ..) from 32-bit word q
    src = b.bitcast(b.zext(b.bitcast(_ld(b, w, 74, 32), _D8), _Q8), _B64)
    s4 = _ld(b, w, 106, 4)
    v16 = ir.VectorType(_I16, 16)
    s8 = b.zext(_shuf(b, s4, [j // 2 for j in range(8)] + [0] * 8), v16)
    s8 = _odd(b, b.and_(b.lshr(s8, _c(v16, [0, 4] * 4 + [0] * 8)), _splat(v16, 15)))
    sw = _shuf(b, s8, [i // 4 for i in range(32)])
    acc = _splat(_D16, 0)
    for k in range(4):
        m = _bitshuffle(b, src, _c(_B64, [4 * (e % 8) + k for e in range(64)]))
        xv = _negate_where(b, m, _ld(b, x, 64 * k, 64))
        acc = _dpwssd(b, acc, _maddubs(b, vals[k], xv), sw)
    return [acc]


def _consts_iq3_s(b):
    g = _G3S_BYTES
    return [_tables(g[:, 0] | (g[:, 1] << 4)), _tables(g[:, 2] | (g[:, 3] << 4))]


def _acc_iq2_xs(b, w, x, xs, grid):
    """IQ2_XS (74 bytes: d | 32 x u16: 9-bit grid index, 7-bit sign index |
    scales[8]: a 4-bit scale per 16 values), natural layout. The 8-byte grid
    entries are gathered, 8 per vpgatherdq."""
    raw = _ld(b, w, 2, 64)
    q = b.bitcast(raw, _W32)
    # KSIGNS of the 7-bit fields (bits 9..15 of each u16), one sign byte per entry, in entry order
    sb = _ksigns(b, _multishift(b, [9, 25, 41, 57] * 16, raw))
    masks = _masks_of(b, _shuf(b, sb, [8 * (e // 4) + e % 4 for e in range(32)]))
    sc8 = _ld(b, w, 66, 8)
    v16 = ir.VectorType(_I16, 16)
    s = b.zext(_shuf(b, sc8, [j // 2 for j in range(16)]), v16)
    s = _odd(b, b.and_(b.lshr(s, _c(v16, [0, 4] * 8)), _splat(v16, 15)))     # word 2 j + h: half h of sub-block j
    idx = b.and_(b.zext(q, ir.VectorType(_I32, 32)), _splat(ir.VectorType(_I32, 32), 511))
    acc = _splat(_D16, 0)
    for i in range(4):
        g = b.bitcast(_gather_q(b, grid, _shuf(b, idx, range(8 * i, 8 * i + 8))), _B64)
        xv = _negate_where(b, masks[i], _ld(b, x, 64 * i, 64))
        sw = _shuf(b, s, [4 * i + L for L in range(4) for _ in range(8)])
        acc = _dpwssd(b, acc, _maddubs(b, g, xv), sw)
    return [acc]


def _consts_iq2_xs(b):
    arr = ir.ArrayType(_I64, 512)
    g = cgutils.global_constant(b.module, "fle_iq2xs_grid", ir.Constant(arr, [int(v) for v in _G2XS]))
    return b.gep(g, [_I32(0), _I32(0)])


def _scales_iq4_xs(b, w):
    """The 8 scales (6 bits minus 32) of an IQ4_XS block as <8 x i32>."""
    lo4 = _ld(b, w, 4, 4)
    lo = b.zext(_shuf(b, lo4, [j // 2 for j in range(8)]), _D8)
    lo = b.and_(b.lshr(lo, _c(_D8, [0, 4] * 4)), _splat(_D8, 15))
    sh = b.zext(b.load(b.bitcast(b.gep(w, [_I64(2)]), _I16.as_pointer()), align=1), _I32)
    shv = _shuf(b, b.insert_element(ir.Constant(_D8, ir.Undefined), sh, _I32(0)), [0] * 8)
    hi = b.and_(b.lshr(shv, _c(_D8, [2 * j for j in range(8)])), _splat(_D8, 3))
    return b.sub(b.or_(lo, b.shl(hi, _splat(_D8, 4))), _splat(_D8, 32))


def _acc_iq4_xs(b, w, x, xs, t):
    """IQ4_XS (136 bytes: d | scales_h u16 | scales_l[4] | qs[128]), layout
    IQ4: a 64-byte load holds four sub-blocks' nibbles; its low nibbles
    (then its high ones) against the activations of the four sub-blocks'
    first (second) 16 values. The code book plus 128 (unsigned bytes) by
    one vpermb, vpdpbusd, then each sub-block's scale times its sum, less
    128 times the scale times the sub-block's activation sum."""
    sc = _scales_iq4_xs(b, w)
    acc = _splat(_D16, 0)
    for c in range(2):
        q = _ld(b, w, 8 + 64 * c, 64)
        hi = b.bitcast(b.lshr(b.bitcast(q, _W32), _splat(_W32, 4)), _B64)
        p = _dpbusd(b, _splat(_D16, 0), _permb(b, t, q), _ld(b, x, 128 * c, 64))
        p = _dpbusd(b, p, _permb(b, t, hi), _ld(b, x, 128 * c + 64, 64))
        # lane l: sub-block 4 c + l // 4
        acc = b.add(acc, b.mul(p, _shuf(b, sc, [4 * c + ln // 4 for ln in range(16)])))
    xsv = b.load(b.bitcast(xs, _D8.as_pointer()), align=4)
    corr = b.shl(b.mul(sc, xsv), _splat(_D8, 7))
    return [b.sub(acc, _shuf(b, corr, list(range(8)) + [8] * 8, _splat(_D8, 0)))]


def _consts_iq4_xs(b):
    return _c(_B64, [(int(KVALUES_IQ4NL[i % 16]) + 128) for i in range(64)])


def _acc_q4_k(b, w, x, xs, t):
    """Q4_K (144 bytes: d | dmin | 12 bytes of 6-bit scales and mins |
    qs[128]), layout Q4K: a 64-byte load holds chunks 2 m and 2 m + 1; its
    low nibbles (sub-blocks 4 m and 4 m + 2) and its high ones (4 m + 1 and
    4 m + 3) against the matching activations; M = mins . sums of 32 codes."""
    sm = _scales_mins_k4(b, w)          # <16 x i16>: scales 0..7, mins 8..15
    m15 = _splat(_B64, 15)
    acc = _splat(_D16, 0)
    for m in range(2):
        q = _ld(b, w, 16 + 64 * m, 64)
        for h in range(2):
            n = b.and_(q, m15) if h == 0 else b.and_(b.bitcast(b.lshr(b.bitcast(q, _W32), _splat(_W32, 4)), _B64), m15)
            sw = _shuf(b, sm, [4 * m + h] * 16 + [4 * m + 2 + h] * 16)
            acc = _dpwssd(b, acc, _maddubs(b, n, _ld(b, x, 128 * m + 64 * h, 64)), sw)
    mins = b.zext(_shuf(b, sm, range(8, 16)), _D8)
    xsv = b.load(b.bitcast(xs, _D8.as_pointer()), align=4)
    mv = _shuf(b, b.mul(mins, xsv), list(range(8)) + [8] * 8, _splat(_D8, 0))
    return [acc, mv]


# ---------------------------------------------------------------------------
# up to 8 blocks: accumulators, one tree of lane shuffles, 8 sums


def _sums8(b, accs):
    """Up to 8 <16 x i32> -> <8 x i32> of their lane sums (missing: 0)."""
    z = _splat(_D16, 0)
    a = list(accs) + [z] * (8 - len(accs))
    # 16 -> 8 lanes per block: lanes 0..7 of pair[0], 8..15 of pair[1]
    p = [b.add(_shuf(b, a[i], list(range(8)) + list(range(16, 24)), a[i + 1]),
               _shuf(b, a[i], list(range(8, 16)) + list(range(24, 32)), a[i + 1])) for i in range(0, 8, 2)]

    def lanes128(v, w, sel):
        return _shuf(b, v, [4 * L + i for L in sel for i in range(4)], w)

    # 8 -> 4: 128-bit lane L holds block [0, 1, 2, 3][L] (then 4..7)
    q = [b.add(lanes128(p[i], p[i + 1], [0, 2, 4, 6]), lanes128(p[i], p[i + 1], [1, 3, 5, 7])) for i in (0, 2)]
    # 4 -> 2: lane L: dwords 4 L, 4 L + 1 of block L, 4 L + 2, 4 L + 3 of block L + 4
    lo = [i for L in range(4) for i in (4 * L, 4 * L + 1, 16 + 4 * L, 16 + 4 * L + 1)]
    hi = [i + 2 for i in lo]
    r = b.add(_shuf(b, q[0], lo, q[1]), _shuf(b, q[0], hi, q[1]))
    r = b.add(r, _shuf(b, r, [i ^ 1 for i in range(16)]))
    return _shuf(b, r, [0, 4, 8, 12, 2, 6, 10, 14])


def _reduce16(b, v):
    return b.call(_fn(b, "llvm.vector.reduce.add.v16i32", _I32, [_D16]), [v])


def _emit_sums(b, name, n, wb, xb, xsb, xdb, outp, t):
    """Emit type ``name``'s sums of ``n`` blocks (:func:`group_sums`) from
    the byte pointers ``wb`` (weights), ``xb`` (activation codes), the
    int32 pointer ``xsb`` (sums of 32), the float pointer ``xdb`` (scales)
    into the float pointer ``outp``; ``t``: the type's constants."""
    accfn, _, size, frac = _KERNELS[name]
    f32, f16 = ir.FloatType(), ir.HalfType()
    ob = b.bitcast(outp, ir.VectorType(f32, n).as_pointer())
    per = [accfn(b, b.gep(wb, [_I64(size * j)]), b.gep(xb, [_I64(256 * j)]), b.gep(xsb, [_I64(8 * j)]), t)
           for j in range(n)]
    vn, fn_ = ir.VectorType(_I32, n), ir.VectorType(f32, n)

    def sums(part):
        accs = [p[part] for p in per]
        if n == 1:
            return b.insert_element(ir.Constant(vn, ir.Undefined), _reduce16(b, accs[0]), _I32(0))
        return _shuf(b, _sums8(b, accs), range(n))

    def fp16s(off):
        h = ir.Constant(ir.VectorType(_I16, n), ir.Undefined)
        for j in range(n):
            v = b.load(b.bitcast(b.gep(wb, [_I64(size * j + off)]), _I16.as_pointer()), align=1)
            h = b.insert_element(h, v, _I32(j))
        return b.fpext(b.bitcast(h, ir.VectorType(f16, n)), fn_)

    dx = b.load(b.bitcast(xdb, fn_.as_pointer()), align=4)
    s = b.sitofp(sums(0), fn_)
    if frac != 1.0:
        s = b.fmul(s, ir.Constant(fn_, [frac] * n))
    c = b.fmul(b.fmul(fp16s(0), dx), s)
    if len(per[0]) > 1:
        c = b.fsub(c, b.fmul(b.fmul(fp16s(2), dx), b.sitofp(sums(1), fn_)))
    b.store(c, ob, align=4)


GROUPS = (8, 4, 3, 2, 1)        # the block counts of one call (a row's tail: 4, then what is left)


@intrinsic
def group_sums(typingctx, name, n, w, o, x, xo, xs, xso, xd, xdo, out):
    """``group_sums(name, n, w, o, x, xo, xs, xso, xd, xdo, out)``: ``n``
    (one of :data:`GROUPS`, at run time) blocks of type ``name`` (a
    compile-time string: "iq3_xxs", "iq3_s", "iq2_xs", "iq4_xs", "q4_k")
    at w[o:] against the activation codes at x[xo:] (bytes), their sums of
    32 at xs[xso:] (elements, 8 per block) and their scales xd[xdo:]
    (elements): each block's float contribution to out[b], as the reference
    computes it: (d_w * d_x) * (float(S) * frac), less (dmin_w * d_x) *
    float(M) for Q4_K (d_w, dmin_w the block's fp16 at 0 and 2). The caller
    adds them to its accumulator in block order. One branch per block count
    in the emitted code (the call's switch), each the straight-line code of
    that many blocks."""
    if not isinstance(name, types.StringLiteral) or name.literal_value not in _KERNELS:
        return None
    if not all(isinstance(a, types.Array) for a in (w, x, xs, xd, out)):
        return None
    kind = name.literal_value

    def codegen(context, builder, sig, args):
        b = builder
        f32 = ir.FloatType()
        wb = _base(context, b, sig.args[2], args[2], args[3])
        xb = _base(context, b, sig.args[4], args[4], args[5])
        xsb = b.gep(b.bitcast(_base(context, b, sig.args[6], args[6]), _I32.as_pointer()), [args[7]])
        xdb = b.gep(b.bitcast(_base(context, b, sig.args[8], args[8]), f32.as_pointer()), [args[9]])
        outp = b.bitcast(_base(context, b, sig.args[10], args[10]), f32.as_pointer())
        t = _KERNELS[kind][1](b)
        end = b.append_basic_block(f"{kind}.sums.end")
        cases = {m: b.append_basic_block(f"{kind}.sums.{m}") for m in GROUPS}
        sw = b.switch(args[1], cases[1])            # anything else: one block (never: the caller's _group)
        for m in GROUPS[:-1]:
            sw.add_case(_I64(m), cases[m])
        for m, bb in cases.items():
            b.position_at_end(bb)
            _emit_sums(b, kind, m, wb, xb, xsb, xdb, outp, t)
            b.branch(end)
        b.position_at_end(end)
        return context.get_dummy_value()

    return types.void(name, types.int64, w, types.int64, x, types.int64, xs, types.int64, xd, types.int64,
                      out), codegen


# name: (block accumulators, constants, block bytes, the sums' factor)
_KERNELS = {"iq3_xxs": (_acc_iq3_xxs, _consts_iq3_xxs, 98, 0.25), "iq3_s": (_acc_iq3_s, _consts_iq3_s, 110, 1.0),
            "iq2_xs": (_acc_iq2_xs, _consts_iq2_xs, 74, 0.125), "iq4_xs": (_acc_iq4_xs, _consts_iq4_xs, 136, 1.0),
            "q4_k": (_acc_q4_k, lambda b: None, 144, 1.0)}


@intrinsic
def stack_f32x16(typingctx):
    """A float32 [16] array on the calling function's stack (its entry
    block's alloca: once per call of a parallel loop's body, not per
    iteration), with a null meminfo: no heap allocation and no reference
    count (.simd.borrow). For scratch that does not outlive the function."""
    from numba.np.arrayobj import populate_array

    arr_t = types.Array(types.float32, 1, "C")

    def codegen(context, builder, sig, args):
        slot = cgutils.alloca_once(builder, ir.ArrayType(ir.FloatType(), 16))
        ary = context.make_array(arr_t)(context, builder)
        shape = [context.get_constant(types.intp, 16)]
        strides = [context.get_constant(types.intp, 4)]
        populate_array(ary, data=builder.bitcast(slot, ir.FloatType().as_pointer()), shape=shape, strides=strides,
                       itemsize=context.get_constant(types.intp, 4), meminfo=None)
        return ary._getvalue()

    return arr_t(), codegen
