"""Row kernels: one compiled C-callable function per (instruction set,
weight type), called by address from the drivers (:func:`.fle_numba.forward`,
:func:`.fle_numba.matvec`, :mod:`.team`).

A row kernel computes, for the rows ``r0 <= r < r1`` of one weight matrix
and ``nt`` activation rows, ``out[orow[k], r] = row_r . act[arow[k]]`` with
the float steps of :mod:`.reference` (bit-identical to it). Its arguments
are all int64 (addresses and sizes, :data:`SIG`)::

    rows(w, stride, r0, r1, nb, xq, xd, xs, nxr, nx, ndx, nxs, arow, orow, nt, out, nout)

``w``: the address of row 0 (row r at ``w + r * stride``, ``nb`` blocks);
``xq`` int8 / ``xd`` float32 / ``xs`` int32 the activations
(:class:`.acts.Acts`' fields, ``nxr`` rows of ``nx`` / ``ndx`` / ``nxs``);
``arow``, ``orow`` int64 [nt]; ``out`` float32 rows of ``nout``.

Why by address: each kernel is compiled on its own (a few seconds, cached
on disk) and the drivers hold no type's code, so a cold start compiles what
it runs and no more (every type's code inlined into every driver took LLVM
more than ten minutes with the AVX-512 kernels), and the drivers' compiled
code does not depend on the instruction set.

The instruction set, :data:`ISA`, is chosen once at import
(:func:`.simd.isa_cap` and the host's features): ``avx512`` (the kernels of
:mod:`.simd512` for IQ3_XXS, IQ3_S, IQ2_XS, IQ4_XS and Q4_K, the AVX2 ones
for the other types), ``avx2`` or ``portable``. numba's on-disk cache keys
each entry on the target CPU's name and features (``magic_tuple``), so an
AVX-512 build is never loaded on a CPU without AVX-512; within one CPU, the
ISA is in each kernel's cache key (the AVX-512 kernels are functions of
their own, the others closures over the ISA, whose values numba hashes into
the key), so a process that forces ``FLE_CPU_ISA`` gets the kernels it asked
for from the same cache.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import cfunc, njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array

from . import rowcode, simd
from .simd512 import AVX512, LAYOUTS, PERM, group_sums, stack_f32x16

__all__ = ["ISA", "SIG", "rows_address", "layout", "call_rows", "arrange"]

ISA = "avx512" if AVX512 else "avx2" if simd.AVX2 else "portable"
_ISA_ID = {"portable": 0, "avx2": 1, "avx512": 2}

_I64 = ir.IntType(64)
SIG = types.void(*([types.int64] * 17))

# type codes (as .rowcode.CODES)
_IQ2_XS, _IQ2_S, _IQ3_XXS, _IQ3_S, _IQ4_XS, _IQ4_NL, _Q2_0, _Q4_K, _Q5_K, _Q6_K, _Q8_0 = range(11)
_F32 = np.float32


# ---------------------------------------------------------------------------
# arrays from addresses, and the call by address


def _viewer(dtype, ndim):
    arr_t = types.Array(dtype, ndim, "C")

    def codegen(context, builder, sig, args):
        dt = context.get_data_type(dtype)
        size = context.get_abi_sizeof(dt)
        ary = context.make_array(arr_t)(context, builder)
        dims = list(args[1:])
        strides = [context.get_constant(types.intp, size)]
        for d in reversed(dims[1:]):
            strides.insert(0, builder.mul(strides[0], d))
        populate_array(ary, data=builder.inttoptr(args[0], dt.as_pointer()), shape=dims, strides=strides,
                       itemsize=context.get_constant(types.intp, size), meminfo=None)
        return ary._getvalue()

    if ndim == 1:
        def impl(typingctx, addr, n):
            return arr_t(types.int64, types.int64), codegen
    else:
        def impl(typingctx, addr, n0, n1):
            return arr_t(types.int64, types.int64, types.int64), codegen
    impl.__name__ = f"view{ndim}_{dtype}"
    return intrinsic(impl)


# arrays over memory the caller owns: null meminfo, so no reference counting (as .simd.borrow)
_u8, _i64, _f32 = _viewer(types.uint8, 1), _viewer(types.int64, 1), _viewer(types.float32, 1)
_i8x2, _f32x2, _i32x2 = _viewer(types.int8, 2), _viewer(types.float32, 2), _viewer(types.int32, 2)


@intrinsic
def call_rows(typingctx, fn, w, stride, r0, r1, nb, xq, xd, xs, nxr, nx, ndx, nxs, arow, orow, nt, out, nout):
    """Call the row kernel at address ``fn`` (module docstring) with its 17
    int64 arguments."""
    sig = types.void(*([types.int64] * 18))

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.VoidType(), [_I64] * 17)
        f = builder.inttoptr(args[0], fnty.as_pointer())
        builder.call(f, list(args[1:]))
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, inline="always")
def _addr(a):
    return np.int64(a.ctypes.data)


@njit(cache=True, inline="always")
def _rows_out(orow, nt):
    m = np.int64(0)
    for k in range(nt):
        m = max(m, orow[k] + 1)
    return m


# ---------------------------------------------------------------------------
# activation layouts of the AVX-512 kernels (.simd512.PERM)


@njit(cache=True)
def arrange(kind, qs):
    """One activation row ``qs`` (int8 [n], natural order) put in place into
    layout ``kind`` (:func:`layout`; <= 0: nothing to do)."""
    if kind <= 0:
        return
    tmp = np.empty(256, np.int8)
    for b0 in range(0, qs.shape[0] - 255, 256):
        for i in range(256):
            tmp[i] = qs[b0 + i]
        for i in range(256):
            qs[b0 + i] = tmp[PERM[kind, i]]


def layout(code: int) -> int:
    """The activation layout type ``code``'s kernel reads in this process
    (:data:`.simd512.PERM`'s row; 0: natural order)."""
    return int(LAYOUTS[code]) if ISA == "avx512" and LAYOUTS[code] > 0 else 0


# ---------------------------------------------------------------------------
# AVX-512 (.simd512): up to 8 blocks per call, their float contributions into ``c`` (float32 [16]) in the
# reference's order, added to the accumulator in block order. One closure per type, over the type's name (a
# compile-time string for .simd512.group_sums) and block size: each compiled on its own, and the two values
# are in numba's cache key (as _generic's ISA).


@njit(cache=True, inline="always")
def _group(nb, bi):
    """Blocks in the next call: 8, 4, 3, 2 or 1 (.simd512.GROUPS)."""
    n = nb - bi
    return 8 if n >= 8 else 4 if n >= 4 else n


def _avx512(name: str):
    size = int(rowcode.BLOCK_BYTES[_CODE512[name]])

    def rows(w, stride, r0, r1, nb, xq, xd, xs, nxr, nx, ndx, nxs, arow, orow, nt, out, nout):
        W, XQ, XD, XS = _u8(w, r1 * stride), _i8x2(xq, nxr, nx), _f32x2(xd, nxr, ndx), _i32x2(xs, nxr, nxs)
        A, O = _i64(arow, nt), _i64(orow, nt)
        OUT = _f32(out, _rows_out(O, nt) * nout)
        c = stack_f32x16()
        for r in range(r0, r1):
            base = r * stride
            for k in range(nt):
                t = A[k]
                xo, xdo, xso = t * nx, t * ndx, t * nxs
                a = _F32(0.0)
                bi = 0
                while bi < nb:
                    n = _group(nb, bi)
                    group_sums(name, n, W, base + size * bi, XQ, xo + 256 * bi, XS, xso + 8 * bi, XD, xdo + bi, c)
                    for j in range(n):
                        a = a + c[j]
                    bi += n
                OUT[O[k] * nout + r] = a

    return rows


# the types with AVX-512 kernels: their type codes and .simd512's names
AVX512_KERNELS = {_IQ3_XXS: "iq3_xxs", _IQ3_S: "iq3_s", _IQ2_XS: "iq2_xs", _IQ4_XS: "iq4_xs", _Q4_K: "q4_k"}
_CODE512 = {name: code for code, name in AVX512_KERNELS.items()}


# ---------------------------------------------------------------------------
# AVX2 and portable: .rowcode's row code, one kernel per (ISA, type) as a closure over both


def _generic(isa_id: int, code: int):
    def rows(w, stride, r0, r1, nb, xq, xd, xs, nxr, nx, ndx, nxs, arow, orow, nt, out, nout):
        if isa_id < 0:      # never: isa_id is read so that it is one of this closure's (cache-keyed) values
            return
        W, XQ, XD, XS = _u8(w, r1 * stride), _i8x2(xq, nxr, nx), _f32x2(xd, nxr, ndx), _i32x2(xs, nxr, nxs)
        A, O = _i64(arow, nt), _i64(orow, nt)
        OUT = _f32(out, _rows_out(O, nt) * nout)
        w64, w8, sc, mn, acc, _ = rowcode.scratch_of(nt)
        b64, b8, bsc, bmn, bacc = simd.borrow(w64), simd.borrow(w8), simd.borrow(sc), simd.borrow(mn), simd.borrow(acc)
        for r in range(r0, r1):
            rowcode.row_at(code, W, r * stride, nb, XQ, XD, XS, A, nt, bacc, b64, b8, bsc, bmn)
            for k in range(nt):
                OUT[O[k] * nout + r] = acc[k]

    return rows


_COMPILED: dict = {}


def kernel(code: int, isa: "str | None" = None):
    """The compiled row kernel (a numba ``cfunc``) of type ``code`` for
    ``isa`` (default :data:`ISA`), compiled (or loaded from numba's cache) on
    first use."""
    isa = ISA if isa is None else isa
    if isa == "avx512" and code not in AVX512_KERNELS:
        isa = "avx2"
    key = (isa, code)
    if key not in _COMPILED:
        if isa == "avx512":
            if ISA != "avx512":
                raise ValueError("the AVX-512 kernels need a CPU with AVX-512 (and FLE_CPU_ISA allowing them)")
            _COMPILED[key] = cfunc(SIG, cache=True, nopython=True)(_avx512(AVX512_KERNELS[code]))
        else:
            if isa == "avx2" and not simd.AVX2:
                raise ValueError("the AVX2 kernels need a CPU with AVX2 (and FLE_CPU_ISA allowing them)")
            if isa != ISA and not (ISA == "avx512" and isa == "avx2"):
                raise ValueError(f"this process runs the {ISA} kernels; {isa} ones need FLE_CPU_ISA={isa}")
            _COMPILED[key] = cfunc(SIG, cache=True, nopython=True)(_generic(_ISA_ID[isa], code))
    return _COMPILED[key]


def rows_address(code: int) -> int:
    """The address of type ``code``'s row kernel in this process (ISA)."""
    return int(kernel(code).address)

