"""The expert cache with quantized slots and no host sync inside a step:
the engine's form of :mod:`fle_engine.cached_moe`.

Per MoE layer:

- host: every expert's gate, up and down matrices in their GGUF bytes
  (``[E, n_out, row_bytes]``); on CUDA copied once into page-locked memory,
  which kernels read directly over PCIe (zero-copy, see
  ``bench/zero_copy.py``);
- slots: ``n_slots`` experts' bytes on the device, and ``slot_of`` [E]
  (int64, -1 when not cached) on the device.

A step computes, for every (token, chosen expert) row, the expert from its
slot when ``slot_of`` has one and from host memory otherwise: two calls of
:func:`fle_engine.kernels.mul_mat_experts` per matrix, over the same rows,
each skipping the rows of the other (negative ids), into one output. The
step keeps its expert ids on the device (``last_ids``); nothing reads them
on the host, so the step can be captured in a CUDA graph. Between steps
:meth:`QuantExpertStore.update` reads them, runs the cache policy and copies
the admitted experts into their slots (a host sync, outside the step).
``auto_update`` (default) does that at the start of each call, for plain
eager use.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fle_quant.errors import FleError
from fle_quant.ggml_types import GGMLType

from . import kernels
from . import layers as L
from .cached_moe import install_stores, moe_layers
from .expert_cache import CachePolicy, LayerCache

__all__ = ["QuantExpertStore", "attach_quant_cache", "PinnedView"]


class PinnedView:
    """A page-locked host tensor presented to Triton as device memory (with
    unified addressing it is mapped into the device at the same address)."""

    def __init__(self, t: Tensor, device: torch.device):
        self.t, self.device = t, device
        self.dtype, self.shape = t.dtype, t.shape

    def data_ptr(self) -> int:
        return self.t.data_ptr()

    def element_size(self) -> int:
        return self.t.element_size()

    def view(self, dtype) -> "PinnedView":
        return PinnedView(self.t.view(dtype), self.device)

    def contiguous(self) -> "PinnedView":
        return self


class QuantExpertStore:
    """The quantized slots of one MoE layer and the policy that fills them."""

    def __init__(self, moe: L.MoE, n_slots: int, policy: CachePolicy, device, counts=None,
                 impl: str = "auto"):
        if not moe.streamed:
            raise FleError("a quantized expert cache reads the experts' GGUF bytes: load the model with "
                           "experts='stream'")
        self.moe, self.device, self.impl = moe, torch.device(device), impl
        self.mats = [moe.gate_exps, moe.up_exps, moe.down_exps]
        for q in self.mats:
            if q.rows != (0, q.raw.shape[1]):
                raise FleError(f"{q.name}: fused gate_up expert tensors are not supported by the quantized cache")
        self.qtypes = [GGMLType(q.qtype) for q in self.mats]
        self.cache = LayerCache(moe.n_expert, n_slots, policy, counts)
        cuda = self.device.type == "cuda"
        self.host = []
        for q in self.mats:
            raw = torch.from_numpy(np.array(q.raw))          # the layer's experts, copied into process memory
            self.host.append(PinnedView(raw.pin_memory(), self.device) if cuda else raw)
        self.slots = [torch.zeros((n_slots,) + tuple(q.raw.shape[1:]), dtype=torch.uint8, device=self.device)
                      for q in self.mats]
        self.slot_of = torch.full((moe.n_expert,), -1, dtype=torch.int64, device=self.device)
        self.last_ids: Tensor | None = None
        self.auto_update = True
        self.hits = self.requests = self.admissions = 0

    def _host_bytes(self, i: int, e: int) -> Tensor:
        h = self.host[i]
        return (h.t if isinstance(h, PinnedView) else h)[e]

    def _load(self, e: int, slot: int) -> None:
        for i in range(3):
            self.slots[i][slot].copy_(self._host_bytes(i, e))

    def warm(self, ranking) -> None:
        for a in self.cache.fill(ranking):
            self._load(a.expert, a.slot)
        self._sync_map()

    def _sync_map(self) -> None:
        self.slot_of.copy_(torch.from_numpy(self.cache.slot_of.copy()))

    def update(self) -> None:
        """The policy's step for the last call's experts (reads them on the
        host), its admissions copied into their slots."""
        if self.last_ids is None:
            return
        ids = self.last_ids.cpu().numpy()
        self.last_ids = None
        c = self.cache
        c.observe(ids)
        hit = c.lookup(ids)
        self.hits += int(hit.sum())
        self.requests += len(ids)
        admitted = c.admit(ids[~hit])
        for a in admitted:
            self._load(a.expert, a.slot)
        self.admissions += len(admitted)
        if admitted:
            self._sync_map()

    def _mul(self, i: int, x: Tensor, slot_ids: Tensor, host_ids: Tensor) -> Tensor:
        out = torch.zeros(x.shape[0], self.slots[i].shape[1], dtype=torch.float32, device=x.device)
        qt = self.qtypes[i]
        if self.slots[i].shape[0]:
            kernels.mul_mat_experts(self.slots[i], qt, x, slot_ids, impl=self.impl, out=out)
        host = self.host[i]
        if isinstance(host, PinnedView):
            from .kernels import triton_quant

            triton_quant.mul_mat_experts(host, qt, x, host_ids, out=out)
        else:
            kernels.mul_mat_experts(host, qt, x, host_ids, impl=self.impl, out=out)
        return out

    def experts(self, x: Tensor, experts: Tensor) -> Tensor:
        """Outputs of the chosen experts, [T, K, D], with no host sync."""
        if self.auto_update:
            self.update()
        n_tok, k = experts.shape
        ids = experts.reshape(-1)
        rows = x.float().repeat_interleave(k, dim=0).contiguous()      # one activation row per (token, expert)
        slot_ids = self.slot_of[ids]                                   # -1 where not cached: the slot pass skips it
        host_ids = torch.where(slot_ids >= 0, -1, ids)                 # and the host pass takes it
        g = self._mul(0, rows, slot_ids, host_ids)
        u = self._mul(1, rows, slot_ids, host_ids)
        h = (F.silu(g) * u).contiguous()
        y = self._mul(2, h, slot_ids, host_ids)
        self.last_ids = ids
        return y.to(x.dtype).view(n_tok, k, -1)


def attach_quant_cache(model, *, slots: int, policy: CachePolicy = CachePolicy(), profile=None,
                       device=None, impl: str = "auto") -> dict[int, QuantExpertStore]:
    """Give every MoE layer of a streamed ``model`` a quantized expert store
    of ``slots`` slots on ``device`` (default: the model's)."""
    moes = moe_layers(model)
    if not moes:
        raise FleError("the model has no MoE layers")
    device = torch.device(device) if device is not None else getattr(model, "device", torch.device("cpu"))
    return install_stores(
        moes, lambda m, counts: QuantExpertStore(m, min(int(slots), m.n_expert), policy, device, counts, impl), profile)
