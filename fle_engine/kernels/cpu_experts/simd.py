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
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["dot32_s8", "dot16_s8", "dot32_lo4", "dot32_hi4", "dot_iq4"]


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


def _host_has_ssse3() -> bool:
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        from llvmlite import binding
        return bool(binding.get_host_cpu_features().get("ssse3", False))
    except Exception:  # noqa: BLE001 - feature query unavailable: take the portable path
        return False


_PSHUFB = _host_has_ssse3()


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
