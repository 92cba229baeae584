"""Integer dot products of byte lanes, written as portable LLVM vector IR
through numba intrinsics.

numba widens ``int32 * int32`` to int64, so a plain loop over int8 codes
vectorises in 64-bit lanes. These intrinsics load 16 or 32 bytes as one
vector, widen them to i32 (sign- or zero-extended, or split into nibbles),
multiply and reduce with ``llvm.vector.reduce.add``: no target-specific
intrinsic, so the same code compiles on any CPU that LLVM targets, and
LLVM's x86 back end lowers it to pmaddwd (vpdpwssd where AVX-512 VNNI is
present), ARM's to smull / sadalp.

``dot(a, ao, b, bo)``: sum over i < n of A(a[ao + i]) * b[bo + i] with b
int8 and A by kind: ``s8`` (a's bytes as int8), ``lo4`` / ``hi4`` (a's low /
high nibbles, 0..15). Arrays are 1-D uint8 or int8; offsets are in bytes;
the result is an int64.

On x86 CPUs with AVX2 the same functions (and the scaled block sums
``dot8_scaled``, ``dot_iq4_xs``, ``dot_q4_k``) use the byte multiply-add
that ggml's kernels use: ``pmaddubsw`` of an unsigned and a signed byte
vector into int16 pairs (signed weights through ``|w|`` and ``sign(w) * x``),
then ``pmaddwd`` with ones or with the sub-block's scale into int32 lanes,
which are summed across sub-blocks and reduced once per block. The sums are
exact integers either way (the activation codes lie in -127..127, so a
pair never saturates int16: 2 * 128 * 127 < 32768), so both paths give the
same numbers bit for bit.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["dot32_s8", "dot16_s8", "dot32_lo4", "dot32_hi4", "dot_iq4", "dot8_scaled", "dot_halves", "dot_iq4_xs",
           "dot_q4_k", "dot_iq3_s", "dot_iq3_xxs", "dot_iq2_xs", "q8_0_x8", "dot_q6_k", "blk_q4_k", "blk_q5_k",
           "dot_iq4_xs_r", "AVX2", "f16_at"]


def _make(n: int, kind: str):
    i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
    vb, vw = ir.VectorType(i8, n), ir.VectorType(i32, n)

    def typer(typingctx, a, ao, b, bo):
        if not (isinstance(a, types.Array) and isinstance(b, types.Array)):
            return None
        return types.int64(a, types.int64, b, types.int64), codegen

    def load(context, builder, ty, arr, off):
        data = context.make_array(ty)(context, builder, arr).data
        p = builder.gep(builder.bitcast(data, i8.as_pointer()), [off])
        return builder.load(builder.bitcast(p, vb.as_pointer()), align=1)

    def codegen(context, builder, sig, args):
        va = load(context, builder, sig.args[0], args[0], args[1])
        vx = load(context, builder, sig.args[2], args[2], args[3])
        if kind == "s8":
            wa = builder.sext(va, vw)
        elif kind == "lo4":
            wa = builder.zext(builder.and_(va, ir.Constant(vb, [15] * n)), vw)
        else:
            wa = builder.zext(builder.lshr(va, ir.Constant(vb, [4] * n)), vw)
        prod = builder.mul(wa, builder.sext(vx, vw))
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [vw]),
                                            f"llvm.vector.reduce.add.v{n}i32")
        return builder.sext(builder.call(fn, [prod]), i64)

    def impl(typingctx, a, ao, b, bo):
        return typer(typingctx, a, ao, b, bo)

    impl.__name__ = f"dot{n}_{kind}"
    return intrinsic(impl)


dot32_s8 = _make(32, "s8")
dot16_s8 = _make(16, "s8")
dot32_lo4 = _make(32, "lo4")
dot32_hi4 = _make(32, "hi4")


def _lut16(builder, idx, table):
    """Lanes of ``idx`` (<16 x i8>, values 0..15) looked up in ``table`` (16
    ints): pshufb on x86, else a tree of selects on the index bits."""
    i8 = ir.IntType(8)
    v16 = ir.VectorType(i8, 16)
    if _PSHUFB:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16, v16]),
                                            "llvm.x86.ssse3.pshuf.b.128")
        return builder.call(fn, [ir.Constant(v16, [t & 0xFF for t in table]), idx])
    level = [ir.Constant(v16, [t & 0xFF] * 16) for t in table]
    for bit in range(4):
        m = builder.icmp_unsigned("!=", builder.and_(idx, ir.Constant(v16, [1 << bit] * 16)), ir.Constant(v16, [0] * 16))
        level = [builder.select(m, level[2 * i + 1], level[2 * i]) for i in range(len(level) // 2)]
    return level[0]


@intrinsic
def dot_iq4(typingctx, w, wo, x, xo):
    """One IQ4 sub-block: 16 bytes of nibbles at w[wo:] (table: IQ4_NL's
    code book), low nibbles against x[xo:xo + 16], high ones against
    x[xo + 16:xo + 32]; the int64 sum of the 32 products."""
    from fle_quant.quants.tables import KVALUES_IQ4NL

    table = [int(v) for v in KVALUES_IQ4NL]
    if not (isinstance(w, types.Array) and isinstance(x, types.Array)):
        return None
    sig = types.int64(w, types.int64, x, types.int64)

    def codegen(context, builder, signature, args):
        i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        v16, w32 = ir.VectorType(i8, 16), ir.VectorType(i32, 32)

        def ptr(ty, arr, off, n):
            data = context.make_array(ty)(context, builder, arr).data
            p = builder.gep(builder.bitcast(data, i8.as_pointer()), [off])
            return builder.load(builder.bitcast(p, ir.VectorType(i8, n).as_pointer()), align=1)

        q = ptr(signature.args[0], args[0], args[1], 16)
        lo = _lut16(builder, builder.and_(q, ir.Constant(v16, [15] * 16)), table)
        hi = _lut16(builder, builder.lshr(q, ir.Constant(v16, [4] * 16)), table)
        vals = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(i32, 32), list(range(32))))
        xv = ptr(signature.args[2], args[2], args[3], 32)
        prod = builder.mul(builder.sext(vals, w32), builder.sext(xv, w32))
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [w32]), "llvm.vector.reduce.add.v32i32")
        return builder.sext(builder.call(fn, [prod]), i64)

    return sig, codegen


# ---------------------------------------------------------------------------
# AVX2: pmaddubsw / pmaddwd (module docstring)


def isa_cap() -> str:
    """The widest instruction set the kernels may use, from the environment:
    ``FLE_CPU_ISA`` = ``avx512`` (the default: whatever the host has),
    ``avx2`` (no AVX-512 kernels) or ``portable`` (no x86 intrinsics);
    ``FLE_CPU_PORTABLE=1`` is ``portable``. Read once, at import."""
    import os

    if os.environ.get("FLE_CPU_PORTABLE"):
        return "portable"
    cap = os.environ.get("FLE_CPU_ISA", "avx512").strip().lower() or "avx512"
    if cap not in ("avx512", "avx2", "portable"):
        raise ValueError(f"FLE_CPU_ISA must be avx512, avx2 or portable, not {cap!r}")
    return cap


def _host_feature(name: str) -> bool:
    """The host CPU has feature ``name`` (llvmlite's names) and isa_cap()
    allows its use."""
    import platform

    cap = isa_cap()
    if cap == "portable":
        return False
    if cap == "avx2" and (name.startswith("avx512") or name in ("gfni", "vpclmulqdq", "vaes")):
        return False
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        from llvmlite import binding
        return bool(binding.get_host_cpu_features().get(name, False))
    except Exception:  # noqa: BLE001 - feature query unavailable: take the portable path
        return False


AVX2 = _host_feature("avx2")
_PSHUFB = _host_feature("ssse3")     # read by _lut16 when it compiles

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _madds(builder):
    """pmaddubsw (u8 x i8 pairs -> i16) and pmaddwd (i16 pairs -> i32), AVX2."""
    v16 = ir.VectorType(_I16, 16)
    return (_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", v16, [ir.VectorType(_I8, 32)] * 2),
            _fn(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(_I32, 8), [v16, v16]))


def _vload(context, builder, ty, arr, off, n):
    data = context.make_array(ty)(context, builder, arr).data
    p = builder.gep(builder.bitcast(data, _I8.as_pointer()), [off])
    return builder.load(builder.bitcast(p, ir.VectorType(_I8, n).as_pointer()), align=1)


def _madd(builder, u, s, scale=None):
    """u (unsigned bytes) . s (signed bytes), <32 x i8> or <16 x i8> -> int32
    lanes (<8 x i32> / <4 x i32>) of pair sums, times ``scale`` (an i16
    value) when given."""
    n = u.type.count
    v8, v16, v32 = ir.VectorType(_I8, n), ir.VectorType(_I16, n // 2), ir.VectorType(_I32, n // 4)
    if n == 32:
        p16 = builder.call(_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", v16, [v8, v8]), [u, s])
        mw = _fn(builder, "llvm.x86.avx2.pmadd.wd", v32, [v16, v16])
    else:
        p16 = builder.call(_fn(builder, "llvm.x86.ssse3.pmadd.ub.sw.128", v16, [v8, v8]), [u, s])
        mw = _fn(builder, "llvm.x86.sse2.pmadd.wd", v32, [v16, v16])
    if scale is None:
        m = ir.Constant(v16, [1] * (n // 2))
    else:
        m = builder.shuffle_vector(builder.insert_element(ir.Constant(v16, ir.Undefined), scale, _I32(0)),
                                   ir.Constant(v16, ir.Undefined), ir.Constant(ir.VectorType(_I32, n // 2),
                                                                               [0] * (n // 2)))
    return builder.call(mw, [p16, m])


def _signed(builder, w, x):
    """|w| and sign(w) * x for signed bytes w (pmaddubsw takes one unsigned side)."""
    n = w.type.count
    v8 = ir.VectorType(_I8, n)
    zero = ir.Constant(v8, [0] * n)
    aw = builder.select(builder.icmp_signed("<", w, zero), builder.sub(zero, w), w)
    name = "llvm.x86.avx2.psign.b" if n == 32 else "llvm.x86.ssse3.psign.b.128"
    return aw, builder.call(_fn(builder, name, v8, [v8, v8]), [x, w])


def _reduce(builder, v):
    return builder.sext(builder.call(_fn(builder, f"llvm.vector.reduce.add.v{v.type.count}i32", _I32, [v.type]),
                                     [v]), _I64)


def _nibbles(builder, q, hi):
    n = q.type.count
    v8 = ir.VectorType(_I8, n)
    if hi:
        return builder.lshr(q, ir.Constant(v8, [4] * n))
    return builder.and_(q, ir.Constant(v8, [15] * n))


def _iq4_values(builder, q16, table):
    """16 bytes of IQ4 nibbles -> <32 x i8>: the code book's values of the
    low nibbles, then of the high ones."""
    v32 = ir.VectorType(_I8, 32)
    both = builder.shuffle_vector(_nibbles(builder, q16, False), _nibbles(builder, q16, True),
                                  ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    lut = ir.Constant(v32, [t & 0xFF for t in table] * 2)
    return builder.call(_fn(builder, "llvm.x86.avx2.pshuf.b", v32, [v32, v32]), [lut, both])


def _x86_dot(n: int, kind: str):
    def codegen(context, builder, sig, args):
        va = _vload(context, builder, sig.args[0], args[0], args[1], n)
        vx = _vload(context, builder, sig.args[2], args[2], args[3], n)
        if kind == "s8":
            u, s = _signed(builder, va, vx)
        else:
            u, s = _nibbles(builder, va, kind == "hi4"), vx
        return _reduce(builder, _madd(builder, u, s))

    def impl(typingctx, a, ao, b, bo):
        if not (isinstance(a, types.Array) and isinstance(b, types.Array)):
            return None
        return types.int64(a, types.int64, b, types.int64), codegen

    impl.__name__ = f"dot{n}_{kind}_avx2"
    return intrinsic(impl)


def _scale_i16(context, builder, ty, arr, j):
    """arr[j] (an int32 array's element) as i16."""
    data = context.make_array(ty)(context, builder, arr).data
    v = builder.load(builder.gep(data, [_I32(j)]))
    return builder.trunc(v, _I16)


def _kvalues():
    from fle_quant.quants.tables import KVALUES_IQ4NL
    return [int(v) for v in KVALUES_IQ4NL]


@intrinsic
def _dot_iq4_avx2(typingctx, w, wo, x, xo):
    if not (isinstance(w, types.Array) and isinstance(x, types.Array)):
        return None
    table = _kvalues()

    def codegen(context, builder, sig, args):
        vals = _iq4_values(builder, _vload(context, builder, sig.args[0], args[0], args[1], 16), table)
        u, s = _signed(builder, vals, _vload(context, builder, sig.args[2], args[2], args[3], 32))
        return _reduce(builder, _madd(builder, u, s))

    return types.int64(w, types.int64, x, types.int64), codegen


@intrinsic
def _dot8_scaled_avx2(typingctx, w8, sc, x, xo):
    """sum over j < 8 of sc[j] * (w8[32 j: 32 j + 32] . x[xo + 32 j: ...]), w8 signed."""
    if not all(isinstance(a, types.Array) for a in (w8, sc, x)):
        return None

    def codegen(context, builder, sig, args):
        acc = ir.Constant(ir.VectorType(_I32, 8), [0] * 8)
        for j in range(8):
            wv = _vload(context, builder, sig.args[0], args[0], _I64(32 * j), 32)
            xv = _vload(context, builder, sig.args[2], args[2], builder.add(args[3], _I64(32 * j)), 32)
            u, s = _signed(builder, wv, xv)
            acc = builder.add(acc, _madd(builder, u, s, _scale_i16(context, builder, sig.args[1], args[1], j)))
        return _reduce(builder, acc)

    return types.int64(w8, sc, x, types.int64), codegen


@intrinsic
def _dot_halves_avx2(typingctx, w8, sc, x, xo):
    """sum over j < 8 of sc[j] * (w8[32 j: 32 j + 16] . x[xo + 32 j: ...]) +
    sc[j + 8] * (w8[32 j + 16: 32 j + 32] . x[xo + 32 j + 16: ...]), w8 signed:
    the pair sums of the low 16 bytes take sc[j], those of the high 16 sc[j + 8]."""
    if not all(isinstance(a, types.Array) for a in (w8, sc, x)):
        return None

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(_I16, 16)
        acc = ir.Constant(ir.VectorType(_I32, 8), [0] * 8)
        mub, mw = _madds(builder)
        for j in range(8):
            wv = _vload(context, builder, sig.args[0], args[0], _I64(32 * j), 32)
            xv = _vload(context, builder, sig.args[2], args[2], builder.add(args[3], _I64(32 * j)), 32)
            u, sx = _signed(builder, wv, xv)
            p16 = builder.call(mub, [u, sx])
            lo = _scale_i16(context, builder, sig.args[1], args[1], j)
            hi = _scale_i16(context, builder, sig.args[1], args[1], j + 8)
            m = ir.Constant(v16, ir.Undefined)
            for i in range(16):
                m = builder.insert_element(m, lo if i < 8 else hi, _I32(i))
            acc = builder.add(acc, builder.call(mw, [p16, m]))
        return _reduce(builder, acc)

    return types.int64(w8, sc, x, types.int64), codegen


@njit(cache=True, inline="always")
def _dot_halves_portable(w8, sc, x, xo):
    s = np.int64(0)
    for j in range(8):
        s += (np.int64(sc[j]) * _dot16_s8_portable(w8, 32 * j, x, xo + 32 * j)
              + np.int64(sc[j + 8]) * _dot16_s8_portable(w8, 32 * j + 16, x, xo + 32 * j + 16))
    return s


def _escape(builder, ptr):
    """An empty asm statement that takes ``ptr`` and clobbers memory: what
    was stored through it must be in memory and is read back from there
    (LLVM would otherwise forward the stored vector as lane extracts)."""
    asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ptr.type]), "", "r,~{memory}", side_effect=True)
    builder.call(asm, [ptr])


def _scale_splats(builder, v):
    """<8 x i32> of eight sub-block scales (each fits int16) -> eight <16 x
    i16> vectors, the j-th holding scale j in every lane: pmaddwd's
    multipliers. The scales go through a stack slot as pairs (s, s) so that
    each splat is one broadcast load (vpbroadcastd m32: a load, no shuffle
    port), not a lane shuffle per sub-block."""
    v8 = v.type
    wv = builder.or_(builder.and_(v, ir.Constant(v8, [0xFFFF] * 8)), builder.shl(v, ir.Constant(v8, [16] * 8)))
    slot = cgutils.alloca_once(builder, v8)
    builder.store(wv, slot, align=32)
    p = builder.bitcast(slot, _I32.as_pointer())
    _escape(builder, p)

    class Splats:
        """splats[j]: the broadcast load, emitted where it is used."""
        def __getitem__(self, j):
            e = builder.load(builder.gep(p, [_I32(j)]), align=4)
            sv = builder.shuffle_vector(builder.insert_element(ir.Constant(v8, ir.Undefined), e, _I32(0)),
                                        ir.Constant(v8, ir.Undefined), ir.Constant(v8, [0] * 8))
            return builder.bitcast(sv, ir.VectorType(_I16, 16))

    return Splats()


@intrinsic
def _dot_iq3_s_avx2(typingctx, w, o, grid, x, xo):
    """One IQ3_S block at w[o:] (d | qs[64] | qh[8] | signs[32] | scales[4])
    against x[xo:xo + 256]: sum over its 8 sub-blocks of (1 + 2 * scale_j) *
    sum of sign * grid value * x. ``grid``: uint32 [512], each entry the 4
    byte values of IQ3_S's grid. The grid bytes (1..15) are the unsigned side
    of pmaddubsw; the signs go onto x."""
    if not all(isinstance(a, types.Array) for a in (w, grid, x)):
        return None

    def codegen(context, builder, sig, args):
        v8, v32i, v4i64 = ir.VectorType(_I8, 32), ir.VectorType(_I32, 8), ir.VectorType(_I64, 4)
        wdata = builder.bitcast(context.make_array(sig.args[0])(context, builder, args[0]).data, _I8.as_pointer())
        gdata = builder.bitcast(context.make_array(sig.args[2])(context, builder, args[2]).data, _I32.as_pointer())
        base = builder.gep(wdata, [args[1]])

        def byte(off):
            return builder.zext(builder.load(builder.gep(base, [_I64(off)])), _I32)

        signs = _ld(builder, base, 74, 32)
        # the 64 9-bit grid indices (qs[k] | bit k % 8 of qh[k // 8] << 8) computed in vector lanes, 16 at a
        # time, and stored to a stack buffer that the scalar look-ups read back (as ggml does): a load each
        # instead of a byte load and three bit operations
        v16, v16b = ir.VectorType(_I16, 16), ir.VectorType(_I8, 16)
        buf = cgutils.alloca_once(builder, ir.ArrayType(_I16, 64))
        bp = builder.bitcast(buf, _I16.as_pointer())
        for g in range(4):
            q = builder.zext(_ld(builder, base, 2 + 16 * g, 16), v16)
            qh2 = _ld(builder, base, 66 + 2 * g, 2)
            qh = builder.zext(builder.shuffle_vector(qh2, ir.Constant(qh2.type, ir.Undefined),
                                                     ir.Constant(ir.VectorType(_I32, 16), [0] * 8 + [1] * 8)), v16)
            hb = builder.shl(builder.and_(builder.lshr(qh, ir.Constant(v16, list(range(8)) * 2)),
                                          ir.Constant(v16, [1] * 16)), ir.Constant(v16, [8] * 16))
            builder.store(builder.or_(q, hb), builder.bitcast(builder.gep(bp, [_I32(16 * g)]), v16.as_pointer()),
                          align=2)
        _escape(builder, bp)    # the loads below read the buffer (not 64 lane extracts)
        # the scales 1 + 2 * nibble j of the 4 bytes at 106
        s4 = _ld(builder, base, 106, 4)
        s8 = builder.zext(builder.shuffle_vector(s4, ir.Constant(s4.type, ir.Undefined),
                                                 ir.Constant(v32i, [0, 0, 1, 1, 2, 2, 3, 3])), v32i)
        s8 = builder.and_(builder.lshr(s8, ir.Constant(v32i, [0, 4] * 4)), ir.Constant(v32i, [15] * 8))
        splats = _scale_splats(builder, builder.or_(builder.shl(s8, ir.Constant(v32i, [1] * 8)),
                                                    ir.Constant(v32i, [1] * 8)))
        v16 = ir.VectorType(_I16, 16)
        mub, mw = _madds(builder)
        acc = ir.Constant(v32i, [0] * 8)
        for j in range(8):
            vals = ir.Constant(ir.VectorType(_I32, 8), ir.Undefined)
            for k in range(8):
                ix = builder.zext(builder.load(builder.gep(bp, [_I32(8 * j + k)]), align=2), _I32)
                vals = builder.insert_element(vals, builder.load(builder.gep(gdata, [ix])), _I32(k))
            u = builder.bitcast(vals, v8)
            # the 32 sign bits of the sub-block: byte 4 j + l's 8 bits for values 8 l .. 8 l + 7
            xv = _vload(context, builder, sig.args[3], args[3], builder.add(args[4], _I64(32 * j)), 32)
            sx = _psign_bytes(builder, signs, j, xv)
            acc = builder.add(acc, builder.call(mw, [builder.call(mub, [u, sx]), splats[j]]))
        return _reduce(builder, acc)

    return types.int64(w, types.int64, grid, x, types.int64), codegen


@intrinsic
def _dot_iq4_xs_avx2(typingctx, w, o, sc, x, xo):
    """One IQ4_XS block at w[o:]: sum over its 8 sub-blocks of sc[j] * the
    code book's values . x[xo + 32 j: ...]."""
    if not all(isinstance(a, types.Array) for a in (w, sc, x)):
        return None
    table = _kvalues()

    def codegen(context, builder, sig, args):
        acc = ir.Constant(ir.VectorType(_I32, 8), [0] * 8)
        for j in range(8):
            q = _vload(context, builder, sig.args[0], args[0], builder.add(args[1], _I64(8 + 16 * j)), 16)
            xv = _vload(context, builder, sig.args[3], args[3], builder.add(args[4], _I64(32 * j)), 32)
            u, s = _signed(builder, _iq4_values(builder, q, table), xv)
            acc = builder.add(acc, _madd(builder, u, s, _scale_i16(context, builder, sig.args[2], args[2], j)))
        return _reduce(builder, acc)

    return types.int64(w, types.int64, sc, x, types.int64), codegen


@intrinsic
def _dot_iq4_xs_avx2r(typingctx, w, o, x, xo):
    """One IQ4_XS block at w[o:] (d | scales_h u16 | scales_l[4] | qs[128])
    against x[xo:xo + 256], its 6-bit scales (minus 32) unpacked in vector
    lanes: sum over sub-blocks j of scale_j * the code book's values . x."""
    if not all(isinstance(a, types.Array) for a in (w, x)):
        return None
    table = _kvalues()

    def codegen(context, builder, sig, args):
        v8h, v16 = ir.VectorType(_I16, 8), ir.VectorType(_I16, 16)
        wb = _base(context, builder, sig.args[0], args[0], args[1])
        xb = _base(context, builder, sig.args[2], args[2], args[3])
        lo4 = _ld(builder, wb, 4, 4)
        lo = builder.zext(builder.shuffle_vector(lo4, ir.Constant(lo4.type, ir.Undefined),
                                                 ir.Constant(ir.VectorType(_I32, 8), [0, 0, 1, 1, 2, 2, 3, 3])), v8h)
        lo = builder.and_(builder.lshr(lo, ir.Constant(v8h, [0, 4] * 4)), ir.Constant(v8h, [15] * 8))
        sh = builder.load(builder.bitcast(builder.gep(wb, [_I64(2)]), _I16.as_pointer()), align=1)
        shv = builder.shuffle_vector(builder.insert_element(ir.Constant(v8h, ir.Undefined), sh, _I32(0)),
                                     ir.Constant(v8h, ir.Undefined), ir.Constant(ir.VectorType(_I32, 8), [0] * 8))
        hi = builder.and_(builder.lshr(shv, ir.Constant(v8h, [2 * j for j in range(8)])), ir.Constant(v8h, [3] * 8))
        sc8 = builder.sub(builder.or_(lo, builder.shl(hi, ir.Constant(v8h, [4] * 8))), ir.Constant(v8h, [32] * 8))
        splats = _scale_splats(builder, builder.sext(sc8, ir.VectorType(_I32, 8)))
        acc = ir.Constant(ir.VectorType(_I32, 8), [0] * 8)
        mw = _fn(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(_I32, 8), [v16, v16])
        for j in range(8):
            u, s = _signed(builder, _iq4_values(builder, _ld(builder, wb, 8 + 16 * j, 16), table),
                           _ld(builder, xb, 32 * j, 32))
            p16 = builder.call(_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", v16, [ir.VectorType(_I8, 32)] * 2), [u, s])
            acc = builder.add(acc, builder.call(mw, [p16, splats[j]]))
        return _reduce(builder, acc)

    return types.int64(w, types.int64, x, types.int64), codegen


@intrinsic
def _dot_q4_k_avx2(typingctx, w, o, sc, x, xo):
    """One Q4_K block at w[o:]: sum over c < 4 of sc[2c] * lo nibbles of
    w[o + 16 + 32 c:] . x[xo + 64 c:] + sc[2c + 1] * hi nibbles . x[xo + 64 c + 32:]."""
    if not all(isinstance(a, types.Array) for a in (w, sc, x)):
        return None

    def codegen(context, builder, sig, args):
        acc = ir.Constant(ir.VectorType(_I32, 8), [0] * 8)
        for c in range(4):
            q = _vload(context, builder, sig.args[0], args[0], builder.add(args[1], _I64(16 + 32 * c)), 32)
            for h in range(2):
                xv = _vload(context, builder, sig.args[3], args[3], builder.add(args[4], _I64(64 * c + 32 * h)), 32)
                acc = builder.add(acc, _madd(builder, _nibbles(builder, q, h == 1), xv,
                                             _scale_i16(context, builder, sig.args[2], args[2], 2 * c + h)))
        return _reduce(builder, acc)

    return types.int64(w, types.int64, sc, x, types.int64), codegen


# ---------------------------------------------------------------------------
# AVX2 block kernels that read the block's bytes in vector registers: Q8_0 in
# groups of 8 blocks, Q6_K, and Q4_K / Q5_K with their 6-bit scales and mins
# unpacked in registers (no scratch) and the block's float step fused in.


def _base(context, builder, ty, arr, off=None):
    """i8* to arr's data (+ ``off`` bytes)."""
    p = builder.bitcast(context.make_array(ty)(context, builder, arr).data, _I8.as_pointer())
    return p if off is None else builder.gep(p, [off])


def _ld(builder, base, off, n):
    """<n x i8> at base + off (off: a Python int or an i64 value)."""
    o = _I64(off) if isinstance(off, int) else off
    return builder.load(builder.bitcast(builder.gep(base, [o]), ir.VectorType(_I8, n).as_pointer()), align=1)


def _ld_f16(builder, base, off):
    h = builder.load(builder.bitcast(builder.gep(base, [_I64(off)]), ir.HalfType().as_pointer()), align=1)
    return builder.fpext(h, ir.FloatType())


def _splat16(builder, v16, lanes):
    """<16 x i16> whose lane i is lane ``lanes[i]`` of ``v16`` (<16 x i16>)."""
    return builder.shuffle_vector(v16, ir.Constant(v16.type, ir.Undefined), ir.Constant(ir.VectorType(_I32, 16),
                                                                                        list(lanes)))


def _phadd(builder, a, b):
    v8 = ir.VectorType(_I32, 8)
    return builder.call(_fn(builder, "llvm.x86.avx2.phadd.d", v8, [v8, v8]), [a, b])


def _sums8(builder, vs):
    """8 vectors <8 x i32> -> <8 x i32> of their lane sums (lane b: sum of vs[b])."""
    h = [_phadd(builder, vs[2 * i], vs[2 * i + 1]) for i in range(4)]
    a, b = _phadd(builder, h[0], h[1]), _phadd(builder, h[2], h[3])
    idx = ir.VectorType(_I32, 8)
    lo = builder.shuffle_vector(a, b, ir.Constant(idx, [0, 1, 2, 3, 8, 9, 10, 11]))
    hi = builder.shuffle_vector(a, b, ir.Constant(idx, [4, 5, 6, 7, 12, 13, 14, 15]))
    return builder.add(lo, hi)


@intrinsic
def _q8_0_x8_avx2(typingctx, w, o, x, xo, xd, xdo, a):
    """Eight Q8_0 blocks at w[o:] (34 bytes each: fp16 d, 32 int8 codes)
    against x[xo:xo + 256] (int8) with activation scales xd[xdo:xdo + 8]
    (offsets into the arrays' data, in bytes for w and x, elements for xd):
    ``a`` plus, block by block in order, (d_b * xd_b) * float(s_b), the
    reference's float steps (8 integer sums reduced together, the float
    products in one vector, the additions in block order)."""
    if not all(isinstance(t, types.Array) for t in (w, x, xd)):
        return None

    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        wb = _base(context, builder, sig.args[0], args[0], args[1])
        xb = _base(context, builder, sig.args[2], args[2], args[3])
        sums = []
        dv = ir.Constant(ir.VectorType(_I16, 8), ir.Undefined)
        for b in range(8):
            u, s = _signed(builder, _ld(builder, wb, 34 * b + 2, 32), _ld(builder, xb, 32 * b, 32))
            sums.append(_madd(builder, u, s))
            h = builder.load(builder.bitcast(builder.gep(wb, [_I64(34 * b)]), _I16.as_pointer()), align=1)
            dv = builder.insert_element(dv, h, _I32(b))
        s8 = builder.sitofp(_sums8(builder, sums), ir.VectorType(f32, 8))
        dw = builder.fpext(builder.bitcast(dv, ir.VectorType(ir.HalfType(), 8)), ir.VectorType(f32, 8))
        xdp = builder.gep(builder.bitcast(context.make_array(sig.args[4])(context, builder, args[4]).data,
                                          f32.as_pointer()), [args[5]])
        xv = builder.load(builder.bitcast(xdp, ir.VectorType(f32, 8).as_pointer()), align=4)
        c = builder.fmul(builder.fmul(dw, xv), s8)
        acc = args[6]
        for b in range(8):
            acc = builder.fadd(acc, builder.extract_element(c, _I32(b)))
        return acc

    return types.float32(w, types.int64, x, types.int64, xd, types.int64, types.float32), codegen


@intrinsic
def _dot_q6_k_avx2(typingctx, w, o, x, xo):
    """One Q6_K block at w[o:] (ql[128] | qh[64] | int8 scales[16] | fp16 d)
    against x[xo:xo + 256]: sum over its 16-value groups g of scale_g * sum
    of (q - 32) * x, q = 4 low bits from ql, 2 high from qh (0..63). As
    ggml: pmaddubsw of q and of 32 with x, their difference times the
    scales (pmaddwd) into int32 lanes, one reduction."""
    if not all(isinstance(t, types.Array) for t in (w, x)):
        return None

    def codegen(context, builder, sig, args):
        v8 = ir.VectorType(_I8, 32)
        v16 = ir.VectorType(_I16, 16)
        mub, mw = _madds(builder)
        wb = _base(context, builder, sig.args[0], args[0], args[1])
        xb = _base(context, builder, sig.args[2], args[2], args[3])
        sc = builder.sext(_ld(builder, wb, 192, 16), v16)
        m15, m3 = ir.Constant(v8, [15] * 32), ir.Constant(v8, [3] * 32)
        c32 = ir.Constant(v8, [32] * 32)
        acc = ir.Constant(ir.VectorType(_I32, 8), [0] * 8)
        for h in range(2):
            ql = [_ld(builder, wb, 64 * h, 32), _ld(builder, wb, 64 * h + 32, 32)]
            qh = _ld(builder, wb, 128 + 32 * h, 32)
            for k in range(4):
                lo = ql[k & 1]
                lo = builder.and_(lo, m15) if k < 2 else builder.lshr(lo, ir.Constant(v8, [4] * 32))
                hb = qh if k == 0 else builder.lshr(qh, ir.Constant(v8, [2 * k] * 32))
                q = builder.or_(lo, builder.shl(builder.and_(hb, m3), ir.Constant(v8, [4] * 32)))
                xv = _ld(builder, xb, 128 * h + 32 * k, 32)
                p16 = builder.sub(builder.call(mub, [q, xv]), builder.call(mub, [c32, xv]))
                g = 8 * h + 2 * k
                acc = builder.add(acc, builder.call(mw, [p16, _splat16(builder, sc, [g] * 8 + [g + 1] * 8)]))
        return _reduce(builder, acc)

    return types.int64(w, types.int64, x, types.int64), codegen


def _scales_mins_k4(builder, wb):
    """The 8 6-bit scales and 8 mins of a Q4_K / Q5_K block (12 bytes at
    w + 4, as _scale_min_k4) -> <16 x i16>: scales in lanes 0..7, mins in
    8..15 (ggml's utmp shuffle of three 32-bit words)."""
    def word(off):
        return builder.load(builder.bitcast(builder.gep(wb, [_I64(off)]), _I32.as_pointer()), align=1)

    u0, u1, u2 = word(4), word(8), word(12)
    k1, k2, k3 = _I32(0x3F3F3F3F), _I32(0x0F0F0F0F), _I32(0x03030303)
    t3 = builder.or_(builder.and_(builder.lshr(u2, _I32(4)), k2),
                     builder.shl(builder.and_(builder.lshr(u1, _I32(6)), k3), _I32(4)))
    t2 = builder.and_(u1, k1)
    t1 = builder.or_(builder.and_(u2, k2), builder.shl(builder.and_(builder.lshr(u0, _I32(6)), k3), _I32(4)))
    t0 = builder.and_(u0, k1)
    v = ir.Constant(ir.VectorType(_I32, 4), ir.Undefined)
    for i, t in enumerate((t0, t1, t2, t3)):
        v = builder.insert_element(v, t, _I32(i))
    return builder.zext(builder.bitcast(v, ir.VectorType(_I8, 16)), ir.VectorType(_I16, 16))


def _blk_k4(hbits: bool):
    """One Q4_K (hbits False: 144 bytes, nibbles at 16) or Q5_K (True: 176
    bytes, high bits qh[32] at 16, nibbles at 48) block at w[o:] against
    x[xo:xo + 256] with its 32-value sums xs[xso:xso + 8] and scale ``xd``:
    the block's float contribution (d * xd) * float(S) - (dmin * xd) *
    float(M) as the reference computes it (S: scales . codes . x, M: mins . xs)."""
    def impl(typingctx, w, o, x, xo, xs, xso, xd):
        if not all(isinstance(t, types.Array) for t in (w, x, xs)):
            return None

        def codegen(context, builder, sig, args):
            v8 = ir.VectorType(_I8, 32)
            v16 = ir.VectorType(_I16, 16)
            mub, mw = _madds(builder)
            wb = _base(context, builder, sig.args[0], args[0], args[1])
            xb = _base(context, builder, sig.args[2], args[2], args[3])
            sm = _scales_mins_k4(builder, wb)
            qo = 48 if hbits else 16
            qh = _ld(builder, wb, 16, 32) if hbits else None
            v8i = ir.VectorType(_I32, 8)
            splats = _scale_splats(builder, builder.zext(builder.shuffle_vector(
                sm, ir.Constant(v16, ir.Undefined), ir.Constant(v8i, list(range(8)))), v8i))
            acc = ir.Constant(ir.VectorType(_I32, 8), [0] * 8)
            for c in range(4):
                q = _ld(builder, wb, qo + 32 * c, 32)
                for h in range(2):
                    n = _nibbles(builder, q, h == 1)
                    j = 2 * c + h
                    if hbits:
                        hb = qh if j == 0 else builder.lshr(qh, ir.Constant(v8, [j] * 32))
                        n = builder.or_(n, builder.shl(builder.and_(hb, ir.Constant(v8, [1] * 32)),
                                                       ir.Constant(v8, [4] * 32)))
                    p16 = builder.call(mub, [n, _ld(builder, xb, 64 * c + 32 * h, 32)])
                    acc = builder.add(acc, builder.call(mw, [p16, splats[j]]))
            s = builder.call(_fn(builder, "llvm.vector.reduce.add.v8i32", _I32, [acc.type]), [acc])
            # M = sum over the 8 32-value groups of min_j * xs[j]
            v8i = ir.VectorType(_I32, 8)
            mins = builder.zext(builder.shuffle_vector(sm, ir.Constant(v16, ir.Undefined),
                                                       ir.Constant(ir.VectorType(_I32, 8), list(range(8, 16)))), v8i)
            xsp = builder.gep(builder.bitcast(context.make_array(sig.args[4])(context, builder, args[4]).data,
                                              _I32.as_pointer()), [args[5]])
            xsv = builder.load(builder.bitcast(xsp, v8i.as_pointer()), align=4)
            m = builder.call(_fn(builder, "llvm.vector.reduce.add.v8i32", _I32, [v8i]), [builder.mul(mins, xsv)])
            f32 = ir.FloatType()
            xdv = args[6]
            v = builder.fmul(builder.fmul(_ld_f16(builder, wb, 0), xdv), builder.sitofp(s, f32))
            return builder.fsub(v, builder.fmul(builder.fmul(_ld_f16(builder, wb, 2), xdv), builder.sitofp(m, f32)))

        return types.float32(w, types.int64, x, types.int64, xs, types.int64, types.float32), codegen

    impl.__name__ = "_blk_q5_k_avx2" if hbits else "_blk_q4_k_avx2"
    return intrinsic(impl)


_blk_q4_k_avx2, _blk_q5_k_avx2 = _blk_k4(False), _blk_k4(True)


_PARITY = [(bin(i).count("1") & 1) << 7 for i in range(16)] * 2    # 4 bits -> 0x80 where their parity is odd


def _parity7(builder, s, width):
    """Lanes of ``s`` (<n x i{width}>, values 0..127) with bit 7 set where
    they hold an odd number of set bits: KSIGNS[s], computed (the 7 bits
    folded to 4, then pshufb of a 16-entry table)."""
    n = s.type.count
    vt = s.type
    f = builder.and_(builder.xor(s, builder.lshr(s, ir.Constant(vt, [4] * n))), ir.Constant(vt, [15] * n))
    v8 = ir.VectorType(_I8, 32)
    par = builder.call(_fn(builder, "llvm.x86.avx2.pshuf.b", v8, [v8, v8]),
                       [ir.Constant(v8, _PARITY), builder.bitcast(f, v8)])
    return builder.or_(s, builder.bitcast(par, vt))


def _psign_bytes(builder, words, j, xv):
    """x with its 32 lanes' signs flipped where bit i % 8 of byte 4 j + i // 8
    of ``words`` (<32 x i8>) is set (psign by -1 / +1)."""
    v8 = ir.VectorType(_I8, 32)
    spread = builder.shuffle_vector(words, ir.Constant(v8, ir.Undefined),
                                    ir.Constant(ir.VectorType(_I32, 32), [4 * j + i // 8 for i in range(32)]))
    bits = ir.Constant(v8, [1 << (i % 8) for i in range(32)])
    # (spread & bit) + 127: 127 where the bit is clear, 128..255 (negative) where it is set: psign's operand,
    # in two ALU operations (no compare into a mask register)
    t = builder.add(builder.and_(spread, bits), ir.Constant(v8, [127] * 32))
    return builder.call(_fn(builder, "llvm.x86.avx2.psign.b", v8, [v8, v8]), [xv, t])


def _odd_scales(builder, sb8):
    """<8 x i8> scale bytes -> <16 x i16>: 2 * low nibble + 1 in lanes 0..7,
    2 * high nibble + 1 in 8..15."""
    v16 = ir.VectorType(_I16, 16)
    s = builder.zext(builder.shuffle_vector(sb8, ir.Constant(sb8.type, ir.Undefined),
                                            ir.Constant(ir.VectorType(_I32, 16), list(range(8)) * 2)), v16)
    sh = builder.lshr(s, ir.Constant(v16, [0] * 8 + [4] * 8))
    return builder.add(builder.shl(builder.and_(sh, ir.Constant(v16, [15] * 16)), ir.Constant(v16, [1] * 16)),
                       ir.Constant(v16, [1] * 16))


@intrinsic
def _dot_iq2_xs_avx2(typingctx, w, o, grid, x, xo):
    """One IQ2_XS block at w[o:] (d | 32 x u16: 9-bit grid index, 7-bit
    sign index | scales[8]): sum over sub-blocks of the two halves' scales
    (1 + 2 * nibble) times sum of sign * grid value * x. ``grid``: uint64
    [512] (8 values each). The sign bytes (KSIGNS of the 7-bit indices) are
    computed for the whole block in vector lanes, as ggml does."""
    if not all(isinstance(a, types.Array) for a in (w, grid, x)):
        return None

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(_I16, 16)
        v8 = ir.VectorType(_I8, 32)
        v32i, v4 = ir.VectorType(_I32, 8), ir.VectorType(_I64, 4)
        base = _base(context, builder, sig.args[0], args[0], args[1])
        xb = _base(context, builder, sig.args[3], args[3], args[4])
        gdata = builder.bitcast(context.make_array(sig.args[2])(context, builder, args[2]).data, _I64.as_pointer())
        mub, mw = _madds(builder)
        # the 32 sign bytes: low byte of each 16-bit lane of KSIGNS[q >> 9]
        halves = []
        for i in range(2):
            q = builder.bitcast(_ld(builder, base, 2 + 32 * i, 32), v16)
            halves.append(_parity7(builder, builder.lshr(q, ir.Constant(v16, [9] * 16)), 16))
        cat = builder.shuffle_vector(builder.bitcast(halves[0], v8), builder.bitcast(halves[1], v8),
                                     ir.Constant(ir.VectorType(_I32, 32), list(range(0, 64, 2))))
        sc = _odd_scales(builder, _ld(builder, base, 66, 8))
        acc = ir.Constant(v32i, [0] * 8)
        for j in range(8):
            vals = ir.Constant(v4, ir.Undefined)
            for l in range(4):
                q = builder.zext(builder.load(builder.bitcast(builder.gep(base, [_I64(2 + 8 * j + 2 * l)]),
                                                              _I16.as_pointer()), align=1), _I32)
                vals = builder.insert_element(vals, builder.load(builder.gep(gdata, [builder.and_(q, _I32(511))])),
                                              _I32(l))
            sx = _psign_bytes(builder, cat, j, _ld(builder, xb, 32 * j, 32))
            p16 = builder.call(mub, [builder.bitcast(vals, v8), sx])
            acc = builder.add(acc, builder.call(mw, [p16, _splat16(builder, sc, [j] * 8 + [8 + j] * 8)]))
        return _reduce(builder, acc)

    return types.int64(w, types.int64, grid, x, types.int64), codegen


@intrinsic
def _dot_iq3_xxs_avx2(typingctx, w, o, grid, x, xo):
    """One IQ3_XXS block at w[o:] (d | qs[64] | 8 x u32: four 7-bit sign
    indices and a 4-bit scale): sum over sub-blocks of (1 + 2 * (aux >> 28))
    * sum of sign * grid value * x. ``grid``: uint32 [256]. The sign words
    of all 8 sub-blocks are computed in vector lanes."""
    if not all(isinstance(a, types.Array) for a in (w, grid, x)):
        return None

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(_I16, 16)
        v8 = ir.VectorType(_I8, 32)
        v32i = ir.VectorType(_I32, 8)
        base = _base(context, builder, sig.args[0], args[0], args[1])
        xb = _base(context, builder, sig.args[3], args[3], args[4])
        gdata = builder.bitcast(context.make_array(sig.args[2])(context, builder, args[2]).data, _I32.as_pointer())
        mub, mw = _madds(builder)
        aux = builder.bitcast(_ld(builder, base, 66, 32), v32i)
        words = ir.Constant(v32i, [0] * 8)
        for l in range(4):
            s = builder.and_(builder.lshr(aux, ir.Constant(v32i, [7 * l] * 8)), ir.Constant(v32i, [127] * 8))
            words = builder.or_(words, builder.shl(_parity7(builder, s, 32), ir.Constant(v32i, [8 * l] * 8)))
        words = builder.bitcast(words, v8)
        # scales 1 + 2 * (aux >> 28), as i16 pairs: lane 2 j holds sub-block j's
        splats = _scale_splats(builder, builder.or_(builder.shl(builder.lshr(aux, ir.Constant(v32i, [28] * 8)),
                                                                ir.Constant(v32i, [1] * 8)), ir.Constant(v32i, [1] * 8)))

        def byte(off):
            return builder.zext(builder.load(builder.gep(base, [_I64(off)])), _I32)

        acc = ir.Constant(v32i, [0] * 8)
        for j in range(8):
            vals = ir.Constant(v32i, ir.Undefined)
            for i in range(8):
                vals = builder.insert_element(vals, builder.load(builder.gep(gdata, [byte(2 + 8 * j + i)])), _I32(i))
            sx = _psign_bytes(builder, words, j, _ld(builder, xb, 32 * j, 32))
            p16 = builder.call(mub, [builder.bitcast(vals, v8), sx])
            acc = builder.add(acc, builder.call(mw, [p16, splats[j]]))
        return _reduce(builder, acc)

    return types.int64(w, types.int64, grid, x, types.int64), codegen


@njit(cache=True, inline="always")
def _dot8_scaled_portable(w8, sc, x, xo):
    s = np.int64(0)
    for j in range(8):
        s += np.int64(sc[j]) * _dot32_s8_portable(w8, 32 * j, x, xo + 32 * j)
    return s


@njit(cache=True, inline="always")
def _dot_iq4_xs_portable(w, o, sc, x, xo):
    s = np.int64(0)
    for j in range(8):
        s += np.int64(sc[j]) * _dot_iq4_portable(w, o + 8 + 16 * j, x, xo + 32 * j)
    return s


@njit(cache=True, inline="always")
def _dot_q4_k_portable(w, o, sc, x, xo):
    s = np.int64(0)
    for c in range(4):
        q = o + 16 + 32 * c
        s += (np.int64(sc[2 * c]) * _dot32_lo4_portable(w, q, x, xo + 64 * c)
              + np.int64(sc[2 * c + 1]) * _dot32_hi4_portable(w, q, x, xo + 64 * c + 32))
    return s


_dot32_s8_portable, _dot16_s8_portable = dot32_s8, dot16_s8
_dot32_lo4_portable, _dot32_hi4_portable, _dot_iq4_portable = dot32_lo4, dot32_hi4, dot_iq4
if AVX2:
    dot32_s8, dot16_s8 = _x86_dot(32, "s8"), _x86_dot(16, "s8")
    dot32_lo4, dot32_hi4 = _x86_dot(32, "lo4"), _x86_dot(32, "hi4")
    dot_iq4 = _dot_iq4_avx2
    dot8_scaled, dot_iq4_xs, dot_q4_k = _dot8_scaled_avx2, _dot_iq4_xs_avx2, _dot_q4_k_avx2
    dot_halves = _dot_halves_avx2
    dot_iq3_s, dot_iq3_xxs, dot_iq2_xs = _dot_iq3_s_avx2, _dot_iq3_xxs_avx2, _dot_iq2_xs_avx2
    q8_0_x8, dot_q6_k, blk_q4_k, blk_q5_k = _q8_0_x8_avx2, _dot_q6_k_avx2, _blk_q4_k_avx2, _blk_q5_k_avx2
    dot_iq4_xs_r = _dot_iq4_xs_avx2r
else:
    dot_iq3_s = dot_iq3_xxs = dot_iq2_xs = None     # the callers decode in numba instead (fle_numba)
    q8_0_x8 = dot_q6_k = blk_q4_k = blk_q5_k = dot_iq4_xs_r = None
    dot8_scaled, dot_iq4_xs, dot_q4_k = _dot8_scaled_portable, _dot_iq4_xs_portable, _dot_q4_k_portable
    dot_halves = _dot_halves_portable


# ---------------------------------------------------------------------------
# fp16 scales: one conversion instruction where the CPU has F16C


@intrinsic
def _f16_at_f16c(typingctx, b, k):
    """The fp16 stored little-endian at byte ``k`` of ``b`` as float32
    (``fpext``, vcvtph2ps: exact for every finite and infinite pattern)."""
    if not isinstance(b, types.Array):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        p = builder.gep(builder.bitcast(data, _I8.as_pointer()), [args[1]])
        h = builder.load(builder.bitcast(p, ir.HalfType().as_pointer()), align=1)
        return builder.fpext(h, ir.FloatType())

    return types.float32(b, types.int64), codegen


if _host_feature("f16c"):
    f16_at = _f16_at_f16c
else:
    from fle_quant.quants.blocks_common import fp16_at as f16_at  # noqa: E402


# ---------------------------------------------------------------------------
# borrowed arrays: no reference counting in the loops over rows


@intrinsic
def borrow(typingctx, a):
    """``a`` with a null meminfo: the same data, shape and strides, but
    numba's reference counting skips it (NRT_incref / NRT_decref return at
    once on null, with no atomic operation). For arrays that outlive the
    loop they are used in (the caller holds them): every array that an
    inlined per-row function takes is otherwise counted up and down once per
    row, each time a locked instruction that serialises the row's memory
    operations."""
    if not isinstance(a, types.Array):
        return None

    def codegen(context, builder, sig, args):
        src = context.make_array(sig.args[0])(context, builder, args[0])
        dst = context.make_array(sig.return_type)(context, builder)
        for name in ("parent", "nitems", "itemsize", "data", "shape", "strides"):
            setattr(dst, name, getattr(src, name))
        dst.meminfo = ir.Constant(src.meminfo.type, None)
        return dst._getvalue()

    return a(a), codegen
