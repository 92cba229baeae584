"""Weights left quantized in the (memory-mapped) GGUF file and dequantized
when used, so that the reference forward pass runs models much larger than
RAM as float32: the routed experts (the bulk of an MoE model) and the PLE
n-gram table (51 B weights in qwen4exp).

- :class:`QuantExperts`: one stacked expert tensor; ``get(e)`` dequantizes
  expert ``e``'s matrix (optionally a range of its rows, for a fused
  ``ffn_gate_up_exps``).
- :class:`QuantRows`: a table of rows; ``lookup(idx)`` dequantizes the rows
  asked for.

Both hold a zero-copy view of the file mapping (which keeps the mapping
alive after the :class:`~fle_quant.gguf_reader.GGUFModel` is closed), so the
memory they use is page cache the OS can drop, not process memory. Reading
is by rows of whole quant blocks, so nothing but the requested values is
decoded.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from fle_quant.errors import FleError
from fle_quant.ggml_types import GGMLType

__all__ = ["QuantExperts", "QuantRows", "dequantize_rows"]


def dequantize_rows(raw: np.ndarray, qtype: GGMLType, n_in: int) -> np.ndarray:
    """Rows of raw bytes [R, row_bytes] -> float32 [R, n_in]."""
    if qtype == GGMLType.F32:
        return np.array(raw.view(np.float32)).reshape(-1, n_in)
    if qtype == GGMLType.F16:
        return raw.view(np.float16).astype(np.float32).reshape(-1, n_in)
    from fle_quant.quants import dequantize

    return dequantize(np.ascontiguousarray(raw), qtype).reshape(-1, n_in)


class QuantExperts:
    """Expert matrices ``[n_out, n_in]`` (torch order) of a stacked tensor
    stored as ggml ``[n_in, n_rows, E]``; ``rows`` picks a range of each
    expert's rows (the gate or the up half of a fused gate_up tensor)."""

    def __init__(self, gguf, name: str, shape: Sequence[int], device, dtype: torch.dtype,
                 rows: "tuple[int, int] | None" = None):
        info = gguf.info(name)
        if len(info.shape) != 3:
            raise FleError(f"{gguf.paths[0]}: {name!r} has {len(info.shape)} dimensions; stacked experts have 3")
        n_in, n_rows, n_exp = (int(d) for d in info.shape)
        r0, r1 = rows if rows is not None else (0, n_rows)
        want = (n_exp, r1 - r0, n_in)
        if tuple(shape) != want or not 0 <= r0 < r1 <= n_rows:
            raise FleError(f"{gguf.paths[0]}: tensor {name!r} has shape {[n_exp, n_rows, n_in]} (torch order); "
                           f"the hyperparameters need {list(shape)}; the file is inconsistent")
        self.name = name
        self.qtype = info.qtype
        self.raw = gguf.tensor_bytes(name)          # zero-copy [E, n_rows, row_bytes]
        self.rows = (r0, r1)
        self.shape = want
        self.device = torch.device(device)
        self.dtype = dtype

    @property
    def n_expert(self) -> int:
        return self.shape[0]

    def get(self, e: int, device=None) -> Tensor:
        """Expert ``e``'s matrix [n_out, n_in], dequantized on ``device``
        (default: the model's)."""
        r0, r1 = self.rows
        vals = dequantize_rows(self.raw[e, r0:r1], self.qtype, self.shape[2])
        return torch.from_numpy(vals).to(device=self.device if device is None else device, dtype=self.dtype)

    def dense(self) -> Tensor:
        """All experts [E, n_out, n_in] (tests; as large as the resident form)."""
        return torch.stack([self.get(e) for e in range(self.n_expert)])


class QuantRows:
    """A 2-D tensor stored as ggml ``[n_in, n_rows]`` kept quantized;
    ``lookup(idx)`` gives the rows ``idx`` (any shape) as ``idx.shape +
    (n_in,)``, like ``F.embedding(idx, table)``."""

    def __init__(self, gguf, name: str, device, dtype: torch.dtype):
        info = gguf.info(name)
        if len(info.shape) != 2:
            raise FleError(f"{gguf.paths[0]}: {name!r} has {len(info.shape)} dimensions; a table has 2")
        self.name = name
        self.qtype = info.qtype
        self.raw = gguf.tensor_bytes(name)          # zero-copy [n_rows, row_bytes]
        self.shape = (int(info.shape[1]), int(info.shape[0]))
        self.device = torch.device(device)
        self.dtype = dtype

    def lookup(self, idx: Tensor) -> Tensor:
        flat = idx.reshape(-1).cpu().numpy()
        uniq, inverse = np.unique(flat, return_inverse=True)
        vals = torch.from_numpy(dequantize_rows(self.raw[uniq], self.qtype, self.shape[1]))
        out = vals[torch.from_numpy(inverse.reshape(-1))]
        return out.reshape(tuple(idx.shape) + (self.shape[1],)).to(device=self.device, dtype=self.dtype)
