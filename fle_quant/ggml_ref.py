"""ggml's own quantizers and dequantizers, reached through the shared
libraries that llama-cpp-python installs (``llama_cpp/lib/libggml-base.so``).

This is the neutral reference that tests and benchmarks compare FLE against;
FLE itself never needs it. ``available()`` says whether it can be used.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from pathlib import Path

import numpy as np

from .ggml_types import BLOCK_GEOMETRY, GGMLType


class _TypeTraits(ctypes.Structure):
    # struct ggml_type_traits in ggml.h
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


def _lib_dir() -> Path | None:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        d = Path(loc) / "lib"
        if d.is_dir():
            return d
    return None


@functools.lru_cache(maxsize=None)
def _lib():
    d = _lib_dir()
    if d is None:
        raise RuntimeError("llama-cpp-python is not installed; ggml reference unavailable")
    for name in ("libggml-base.so", "libggml.so", "libllama.so"):
        p = d / name
        if p.exists():
            lib = ctypes.CDLL(str(p), mode=os.RTLD_GLOBAL if hasattr(os, "RTLD_GLOBAL") else 0)
            if hasattr(lib, "ggml_get_type_traits"):
                break
    else:
        raise RuntimeError(f"no ggml library with ggml_get_type_traits under {d}")
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
    ]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    return lib


def available() -> bool:
    try:
        _lib()
        return True
    except (RuntimeError, OSError):
        return False


def dequantize(data: np.ndarray, qtype: "GGMLType | int") -> np.ndarray:
    """ggml's ``to_float`` over rows of raw bytes; same conventions as
    ``fle_quant.quants.dequantize``."""
    qtype = GGMLType(qtype)
    block, size = BLOCK_GEOMETRY[qtype]
    data = np.ascontiguousarray(data, dtype=np.uint8)
    if data.shape[-1] % size:
        raise ValueError(f"last dimension {data.shape[-1]} is not a multiple of {size}")
    n_values = data.size // size * block
    out = np.empty(n_values, dtype=np.float32)
    traits = _lib().ggml_get_type_traits(int(qtype)).contents
    if not traits.to_float:
        raise RuntimeError(f"ggml has no to_float for {qtype.name}")
    fn = _TO_FLOAT(traits.to_float)
    fn(data.ctypes.data, out.ctypes.data, n_values)
    return out.reshape(*data.shape[:-1], data.shape[-1] // size * block)


def quantize(x: np.ndarray, qtype: "GGMLType | int", imatrix: np.ndarray | None = None) -> np.ndarray:
    """ggml's ``ggml_quantize_chunk`` over rows of ``x`` (last axis = row)."""
    qtype = GGMLType(qtype)
    block, size = BLOCK_GEOMETRY[qtype]
    x = np.ascontiguousarray(x, dtype=np.float32)
    n_per_row = x.shape[-1]
    if n_per_row % block:
        raise ValueError(f"row length {n_per_row} is not a multiple of {block}")
    nrows = x.size // n_per_row
    out = np.empty(nrows * (n_per_row // block) * size, dtype=np.uint8)
    lib = _lib()
    lib.ggml_quantize_init(int(qtype))
    imp = None
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
        if imatrix.shape != (n_per_row,):
            raise ValueError(f"imatrix must have shape ({n_per_row},)")
        imp = imatrix.ctypes.data
    lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, nrows, n_per_row, imp)
    return out.reshape(*x.shape[:-1], n_per_row // block * size)


def requires_imatrix(qtype: "GGMLType | int") -> bool:
    return bool(_lib().ggml_quantize_requires_imatrix(int(GGMLType(qtype))))
