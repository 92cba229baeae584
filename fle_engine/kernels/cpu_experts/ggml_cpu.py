"""ggml's own CPU dot products as an expert kernel: the ``vec_dot`` of
``ggml_get_type_traits_cpu(type)`` with activations quantized by the
``from_float`` of its ``vec_dot_type``, from the ``libggml-cpu`` that
llama-cpp-python ships (``llama_cpp/lib``), called row by row from numba's
thread pool. These are the kernels llama.cpp's CPU backend multiplies with
(its mul_mat calls the same function for each row and activation column),
so this is also the yardstick FLE's own kernels are measured against.

The function addresses are passed to the compiled code as integers and
called through a small LLVM intrinsic, so the numba functions hold no
address of this process and stay in numba's on-disk cache.

ggml's vec_dot sums in its own order (SIMD lanes, fused multiply-adds), so
its results equal the reference only to float32 rounding; the activation
quantizers are its own too (Q8_0's SIMD rounding differs from the
reference quantizer's at ties).
"""
from __future__ import annotations

import ctypes
import functools
import os

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from fle_quant.ggml_types import BLOCK_GEOMETRY, GGMLType

from .plan import plan, silu_mul_row, weighted_sum

__all__ = ["available", "unavailable_reason", "Traits", "traits", "forward", "matvec", "quantize"]


class _TraitsCpu(ctypes.Structure):
    # struct ggml_type_traits_cpu in ggml-cpu.h
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]


class Traits:
    """One weight type's ggml functions: ``vec_dot`` and the ``from_float``
    of its activation type ``dot`` (addresses), and that type's row bytes."""

    def __init__(self, vec_dot: int, from_float: int, dot: GGMLType):
        self.vec_dot, self.from_float, self.dot = vec_dot, from_float, dot

    def act_row_bytes(self, n: int) -> int:
        values, size = BLOCK_GEOMETRY[self.dot]
        return n // values * size


@functools.lru_cache(maxsize=None)
def _lib():
    import importlib.util
    from pathlib import Path

    lib_dir = None
    if os.environ.get("FLE_GGML_LIB_DIR"):
        # a ggml build of one's own (e.g. -DGGML_NATIVE=ON for this CPU): libggml-base and libggml-cpu
        lib_dir = Path(os.environ["FLE_GGML_LIB_DIR"])
        if not lib_dir.is_dir():
            raise OSError(f"FLE_GGML_LIB_DIR={lib_dir} is not a directory")
    else:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or not spec.submodule_search_locations:
            raise OSError("llama-cpp-python is not installed (pip install llama-cpp-python)")
        for loc in spec.submodule_search_locations:
            if (Path(loc) / "lib").is_dir():
                lib_dir = Path(loc) / "lib"
        if lib_dir is None:
            raise OSError("llama-cpp-python has no lib/ folder with ggml's libraries")
    import sys

    ext = ".dylib" if sys.platform == "darwin" else ".dll" if os.name == "nt" else ".so"
    pre = "" if os.name == "nt" else "lib"
    names = (f"{pre}ggml-base{ext}", f"{pre}ggml-cpu{ext}")
    if not (lib_dir / names[1]).exists():
        found = sorted(p.name for p in lib_dir.iterdir() if "ggml-cpu" in p.name)
        raise OSError(f"no {names[1]} under {lib_dir} (found: {', '.join(found) or 'none'}); this "
                      f"llama-cpp-python build has no single CPU backend library")
    mode = getattr(os, "RTLD_GLOBAL", 0)
    ctypes.CDLL(str(lib_dir / names[0]), mode=mode)
    cpu = ctypes.CDLL(str(lib_dir / names[1]), mode=mode)
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TraitsCpu)
    cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    cpu.ggml_cpu_init()  # fp16 tables and CPU feature detection, once
    return cpu


def unavailable_reason() -> "str | None":
    """None when ggml's CPU library can be used, else why not."""
    try:
        _lib()
    except (OSError, AttributeError) as e:
        return str(e)
    return None


def available() -> bool:
    return unavailable_reason() is None


@functools.lru_cache(maxsize=None)
def traits(qtype: GGMLType) -> Traits:
    cpu = _lib()
    t = cpu.ggml_get_type_traits_cpu(int(qtype)).contents
    if not t.vec_dot:
        raise ValueError(f"ggml has no CPU vec_dot for {qtype.name}")
    dot = GGMLType(t.vec_dot_type)
    ff = cpu.ggml_get_type_traits_cpu(int(dot)).contents.from_float
    if not ff:
        raise ValueError(f"ggml has no from_float for {dot.name}, the activation type of {qtype.name}")
    if t.nrows != 1:
        raise ValueError(f"ggml's {qtype.name} vec_dot works on {t.nrows} rows at a time; only 1 is supported")
    return Traits(t.vec_dot, ff, dot)


@intrinsic
def _call_vec_dot(typingctx, fn, n, s, x, y):
    """ggml_vec_dot_t fn(n, s, 0, x, 0, y, 0, 1); pointers as integers."""
    sig = types.void(types.int64, types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        fn_, n_, s_, x_, y_ = args
        i32, i64, vp = ir.IntType(32), ir.IntType(64), ir.IntType(8).as_pointer()
        fp = ir.FloatType().as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i32, fp, i64, vp, i64, vp, i64, i32])
        f = builder.inttoptr(fn_, fnty.as_pointer())
        builder.call(f, [builder.trunc(n_, i32), builder.inttoptr(s_, fp), i64(0), builder.inttoptr(x_, vp), i64(0),
                         builder.inttoptr(y_, vp), i64(0), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _call_from_float(typingctx, fn, x, y, k):
    """ggml_from_float_t fn(x, y, k)."""
    sig = types.void(types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        fn_, x_, y_, k_ = args
        i64, vp = ir.IntType(64), ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [ir.FloatType().as_pointer(), vp, i64])
        f = builder.inttoptr(fn_, fnty.as_pointer())
        builder.call(f, [builder.inttoptr(x_, ir.FloatType().as_pointer()), builder.inttoptr(y_, vp), k_])
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, parallel=True)
def _quantize(ff, x, out):
    for r in prange(x.shape[0]):
        _call_from_float(ff, np.int64(x[r:].ctypes.data), np.int64(out[r:].ctypes.data), np.int64(x.shape[1]))


def quantize(x: np.ndarray, qtype: GGMLType) -> np.ndarray:
    """Rows of ``x`` quantized by ggml's from_float for ``qtype``'s vec_dot:
    uint8 [R, act_row_bytes]."""
    tr = traits(qtype)
    x = np.ascontiguousarray(x, np.float32)
    # zeros: ggml's Q8_K leaves the sums of an all-zero block unwritten (its scale is 0)
    out = np.zeros((x.shape[0], tr.act_row_bytes(x.shape[1])), np.uint8)
    _quantize(np.int64(tr.from_float), x, out)
    return out


@njit(cache=True, parallel=True)
def _matvec(vd, n, rows, xq, out):
    nt = xq.shape[0]
    for r in prange(rows.shape[0]):
        w = np.int64(rows[r:].ctypes.data)
        for k in range(nt):
            _call_vec_dot(vd, n, np.int64(out[k, r:].ctypes.data), w, np.int64(xq[k:].ctypes.data))


def matvec(rows: np.ndarray, qtype: GGMLType, xq: np.ndarray) -> np.ndarray:
    """rows uint8 [N, row_bytes] times ggml-quantized activations ``xq``
    (:func:`quantize`'s bytes) [R, ...] -> float32 [R, N]."""
    tr = traits(qtype)
    values, size = BLOCK_GEOMETRY[qtype]
    rows = np.ascontiguousarray(rows)
    out = np.empty((xq.shape[0], rows.shape[0]), np.float32)
    _matvec(np.int64(tr.vec_dot), np.int64(rows.shape[1] // size * values), rows, np.ascontiguousarray(xq), out)
    return out


@njit(cache=True, parallel=True)
def _forward(buf, gu_vd, gu_ff, gu_qb, gu_rb, n_ff, d_vd, d_ff, d_qb, down_off, down_rb, n_embd,
             x, ids, wts, out, chunk):
    n_t = x.shape[0]
    pid, ptok, uexp, ustart, upairs = plan(ids)
    n_p = ptok.shape[0]
    n_u = uexp.shape[0]
    xq = np.empty((n_t, gu_qb), np.uint8)
    for t in range(n_t):
        _call_from_float(gu_ff, np.int64(x[t:].ctypes.data), np.int64(xq[t:].ctypes.data), np.int64(n_embd))
    g = np.empty((n_p, n_ff), np.float32)
    up = np.empty((n_p, n_ff), np.float32)
    base = np.int64(buf.ctypes.data)
    eb = np.int64(buf.shape[1])
    nch = (n_ff + chunk - 1) // chunk
    for it in prange(n_u * nch):
        ui = it // nch
        c = it - ui * nch
        e = uexp[ui]
        p0 = ustart[ui]
        nt = ustart[ui + 1] - p0
        for r in range(c * chunk, min(n_ff, (c + 1) * chunk)):
            wg = base + e * eb + r * gu_rb
            wu = base + e * eb + (n_ff + r) * gu_rb
            for k in range(nt):
                p = upairs[p0 + k]
                xa = np.int64(xq[ptok[p]:].ctypes.data)
                _call_vec_dot(gu_vd, n_embd, np.int64(g[p, r:].ctypes.data), wg, xa)
                _call_vec_dot(gu_vd, n_embd, np.int64(up[p, r:].ctypes.data), wu, xa)
    hq = np.empty((n_p, d_qb), np.uint8)
    # serial: a few rows of work, cheaper than waking the pool for another parallel region
    for p in range(n_p):
        h = np.empty(n_ff, np.float32)
        silu_mul_row(g[p], up[p], h)
        _call_from_float(d_ff, np.int64(h.ctypes.data), np.int64(hq[p:].ctypes.data), np.int64(n_ff))
    y = np.empty((n_p, n_embd), np.float32)
    nch = (n_embd + chunk - 1) // chunk
    for it in prange(n_u * nch):
        ui = it // nch
        c = it - ui * nch
        e = uexp[ui]
        p0 = ustart[ui]
        nt = ustart[ui + 1] - p0
        for r in range(c * chunk, min(n_embd, (c + 1) * chunk)):
            w = base + e * eb + down_off + r * down_rb
            for k in range(nt):
                p = upairs[p0 + k]
                _call_vec_dot(d_vd, n_ff, np.int64(y[p, r:].ctypes.data), w, np.int64(hq[p:].ctypes.data))
    for t in range(n_t):
        weighted_sum(pid, wts, y, out, t)


def forward(buf, lay, x, ids, wts, out, chunk: int) -> None:
    """The fused expert FFN with ggml's dot products (arguments as
    :func:`fle_engine.kernels.cpu_experts.expert_forward` checks them)."""
    gt, dt = traits(lay.gu_type), traits(lay.down_type)
    _forward(buf, np.int64(gt.vec_dot), np.int64(gt.from_float), gt.act_row_bytes(lay.n_embd),
             np.int64(lay.gu_row_bytes), np.int64(lay.n_ff), np.int64(dt.vec_dot), np.int64(dt.from_float),
             dt.act_row_bytes(lay.n_ff), np.int64(lay.down_offset), np.int64(lay.down_row_bytes),
             np.int64(lay.n_embd), x, ids, wts, out, np.int64(chunk))
