"""Reference products with quantized weights: the slow, obviously right form.

The weights' raw GGUF bytes are decoded on the CPU with fle_quant's
bit-exact dequantizers (the same values as ggml's ``to_float``), moved to the
activations' device, and multiplied with torch in float32. Every fast kernel
in :mod:`fle_engine.kernels` is tested against these two functions.

They copy the weights to the host and (for experts) read the expert ids
there, so they synchronise with the device: test and debugging use only.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from fle_quant.errors import FleError
from fle_quant.ggml_types import GGMLType
from fle_quant.quants import dequantize

__all__ = ["dequantize_weights", "mul_mat", "mul_mat_experts"]


def dequantize_weights(w: Tensor, qtype: GGMLType) -> Tensor:
    """Raw rows (uint8 ``[..., row_bytes]``, any device) -> float32
    ``[..., n_in]`` on the same device."""
    raw = np.ascontiguousarray(w.detach().cpu().numpy())
    return torch.from_numpy(dequantize(raw, qtype)).to(w.device)


def mul_mat(w: Tensor, qtype: GGMLType, x: Tensor) -> Tensor:
    """``x @ dequantize(w).T``: w uint8 ``[n_out, row_bytes]``, x ``[T, n_in]``
    -> float32 ``[T, n_out]``."""
    return x.float() @ dequantize_weights(w, qtype).T


def mul_mat_experts(w: Tensor, qtype: GGMLType, x: Tensor, expert_ids: Tensor,
                    out: "Tensor | None" = None) -> Tensor:
    """Row ``t`` of the result is ``x[t] @ dequantize(w[expert_ids[t]]).T``:
    w uint8 ``[E, n_out, row_bytes]``, x ``[T, n_in]``, expert_ids ``[T]``.
    With ``out`` (written in place), rows with a negative id are skipped."""
    ids = expert_ids.detach().cpu().numpy()
    n_exp = w.shape[0]
    check = ids[ids >= 0] if out is not None else ids
    if check.size and (check.min() < 0 or check.max() >= n_exp):
        raise FleError(f"expert ids must lie in [0, {n_exp}); got values from {check.min()} to {check.max()}")
    xf = x.float()
    y = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device) if out is None else out
    for e in np.unique(check):
        rows = torch.from_numpy(np.flatnonzero(ids == e)).to(x.device)
        y[rows] = xf[rows] @ dequantize_weights(w[int(e)], qtype).T
    return y
