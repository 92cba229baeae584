"""Products with weights kept in their raw GGUF bytes on the device.

``mul_mat(w, qtype, x)`` is ``x @ dequantize(w).T`` and
``mul_mat_experts(w, qtype, x, expert_ids)`` its MoE form, in which row ``t``
uses expert ``expert_ids[t]`` of a stacked tensor. Results are float32.

Every quant type has an entry in one table, :data:`KERNELS`: a reference
implementation (:mod:`.reference`: fle_quant's dequantizer, then a torch
matmul; slow, obviously right, synchronises with the device) and, for the
types the releases use, a fast one (:mod:`.triton_quant`: Triton kernels
that decode the blocks in registers). ``impl="auto"`` takes the fast one for
CUDA tensors when the type has one and triton is importable, else the
reference; ``"triton"`` and ``"reference"`` insist on one of them.
Triton runs on CPU tensors only in its interpreter (``TRITON_INTERPRET=1``
set before triton is first imported), which is how the tests check the
kernels without a GPU.

The fast expert form has static shapes and no host synchronisation, so it
can be captured in a CUDA graph once an eager call has compiled it.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from fle_quant.errors import FleError
from fle_quant.ggml_types import BLOCK_GEOMETRY, GGMLType, parse_type
from fle_quant.quants import DEQUANTIZERS

from . import reference

__all__ = ["KERNELS", "Impl", "mul_mat", "mul_mat_experts", "fast_types"]


class Impl(NamedTuple):
    """One implementation of both product forms for one quant type."""
    mul_mat: Callable[[Tensor, GGMLType, Tensor], Tensor]
    mul_mat_experts: Callable[[Tensor, GGMLType, Tensor, Tensor], Tensor]


class _Triton:
    """The Triton implementation, importing triton on first use so that
    this package loads without it."""

    @staticmethod
    def mul_mat(w, qtype, x):
        from . import triton_quant
        return triton_quant.mul_mat(w, qtype, x)

    @staticmethod
    def mul_mat_experts(w, qtype, x, expert_ids, out=None):
        from . import triton_quant
        return triton_quant.mul_mat_experts(w, qtype, x, expert_ids, out=out)


_REFERENCE = Impl(reference.mul_mat, reference.mul_mat_experts)
_TRITON = Impl(_Triton.mul_mat, _Triton.mul_mat_experts)

# The types with a Triton kernel (kept in step with triton_quant._FORMATS,
# which tests/test_kernels.py checks, so that this table needs no triton).
_FAST_TYPES = (GGMLType.Q8_0, GGMLType.IQ4_XS, GGMLType.IQ3_S, GGMLType.IQ4_NL, GGMLType.Q6_K, GGMLType.Q4_K,
               GGMLType.Q5_K, GGMLType.IQ3_XXS, GGMLType.IQ2_XS, GGMLType.IQ2_S, GGMLType.Q2_0)

# type -> (reference, fast or None)
KERNELS: dict[GGMLType, tuple[Impl, "Impl | None"]] = {
    t: (_REFERENCE, _TRITON if t in _FAST_TYPES else None)
    for t in DEQUANTIZERS if BLOCK_GEOMETRY[t][0] > 1  # block-quantized types; plain floats need no kernel
}


def fast_types() -> tuple[GGMLType, ...]:
    """The types with a fast implementation."""
    return tuple(t for t, (_, fast) in KERNELS.items() if fast is not None)


def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _pick(qtype: GGMLType, impl: str, device: torch.device) -> Impl:
    entry = KERNELS.get(qtype)
    if entry is None:
        raise FleError(f"no matrix product for {qtype.name}; known types: {', '.join(t.name for t in KERNELS)}")
    ref, fast = entry
    if impl == "reference":
        return ref
    if impl == "triton":
        if fast is None:
            raise FleError(f"no Triton kernel for {qtype.name}; types with one: "
                           f"{', '.join(t.name for t in fast_types())} (use impl='reference')")
        if not _triton_ok():
            raise FleError("impl='triton' needs the triton package (pip install triton)")
        return fast
    if impl == "auto":
        return fast if fast is not None and device.type == "cuda" and _triton_ok() else ref
    raise FleError(f"impl must be 'auto', 'reference' or 'triton', not {impl!r}")


def _check_rows(w: Tensor, qtype: GGMLType, x: Tensor, lead: int) -> None:
    what = "[n_out, row_bytes]" if lead == 1 else "[E, n_out, row_bytes]"
    if w.dtype != torch.uint8 or w.dim() != lead + 1:
        raise FleError(f"weights must be uint8 {what} raw GGUF rows, got {w.dtype} {tuple(w.shape)}")
    values, size = BLOCK_GEOMETRY[qtype]
    row_bytes = w.shape[-1]
    if row_bytes % size:
        raise FleError(f"{qtype.name}: rows of {row_bytes} bytes are not a whole number of {size}-byte blocks")
    n_in = row_bytes // size * values
    if x.dim() != 2 or x.shape[1] != n_in:
        raise FleError(f"activations must be [T, {n_in}] for {qtype.name} rows of {row_bytes} bytes, "
                       f"got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise FleError(f"activations must be floating point, got {x.dtype}")
    if x.device != w.device:
        raise FleError(f"weights are on {w.device} but activations on {x.device}; put both on one device")


def _prepared(w: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    # the kernels address whole rows (and copy weights whose start is not word-aligned)
    return w.contiguous(), x.to(torch.float32).contiguous()


def mul_mat(w: Tensor, qtype, x: Tensor, impl: str = "auto") -> Tensor:
    """``x @ dequantize(w).T`` in float32.

    ``w``: uint8 ``[n_out, row_bytes]``, the tensor's raw GGUF rows; ``x``:
    float ``[T, n_in]`` on the same device. Returns float32 ``[T, n_out]``."""
    qtype = parse_type(qtype)
    _check_rows(w, qtype, x, 1)
    fn = _pick(qtype, impl, x.device).mul_mat
    w, x = _prepared(w, x)
    return fn(w, qtype, x)


def mul_mat_experts(w: Tensor, qtype, x: Tensor, expert_ids: Tensor, impl: str = "auto",
                    out: "Tensor | None" = None) -> Tensor:
    """Row ``t`` of the result is ``x[t] @ dequantize(w[expert_ids[t]]).T``.

    ``w``: uint8 ``[E, n_out, row_bytes]`` (a stacked expert tensor's raw
    bytes); ``x``: float ``[T, n_in]``; ``expert_ids``: int64 ``[T]`` on the
    same device. Returns float32 ``[T, n_out]``. The fast form neither reads
    the ids on the host nor changes shape with them; an id outside ``[0, E)``
    gives a NaN row there (the reference raises). With ``out`` (float32
    ``[T, n_out]``, written in place and returned), rows with a negative id
    are skipped: two calls over two weight stores (device slots, host
    memory) fill one output without a host sync."""
    qtype = parse_type(qtype)
    _check_rows(w, qtype, x, 2)
    if expert_ids.dim() != 1 or expert_ids.shape[0] != x.shape[0] or expert_ids.dtype != torch.int64:
        raise FleError(f"expert_ids must be int64 [{x.shape[0]}] (one per activation row), "
                       f"got {expert_ids.dtype} {tuple(expert_ids.shape)}")
    if expert_ids.device != x.device:
        raise FleError(f"expert_ids are on {expert_ids.device} but activations on {x.device}")
    fn = _pick(qtype, impl, x.device).mul_mat_experts
    w, x = _prepared(w, x)
    if out is not None:
        if out.dtype != torch.float32 or tuple(out.shape) != (x.shape[0], w.shape[1]) or not out.is_contiguous():
            raise FleError(f"out must be contiguous float32 [{x.shape[0]}, {w.shape[1]}], "
                           f"got {out.dtype} {tuple(out.shape)}")
        return fn(w, qtype, x, expert_ids.contiguous(), out=out)
    return fn(w, qtype, x, expert_ids.contiguous())
