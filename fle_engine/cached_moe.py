"""The expert cache applied to a loaded model: per MoE layer a store of
expert slots on the compute device, filled and emptied by the cache policy
(:mod:`fle_engine.expert_cache`), with the experts that miss computed on the
CPU from the host copy while the device computes the hits.

Per MoE call of a layer (one step):

1. the routed expert ids come to the host (the one sync of the step);
2. the policy counts them and looks them up: hits are read from their slots
   as the slots were at the start of the step;
3. the hits are launched on the device (asynchronous on CUDA), then the
   misses are computed on the CPU from the host weights (dequantized from
   the mapped file for a streamed model), and their outputs copied over;
4. the policy's admissions of this step are copied into their slots after
   the hit kernels in stream order, so they serve from the next step on.

This is the engine's structure on the reference arithmetic: slots hold
dequantized weights in the model's dtype (quantized slots and kernels are
the engine's later work), and the outputs equal the model's without a cache
(the tests hold them to float rounding). Attach with
:func:`attach_expert_cache`; the model must stream its experts
(``fle_engine.load(..., experts="stream")``) or keep them on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
from torch import Tensor

from fle_quant.errors import FleError

from . import layers as L
from .expert_cache import CachePolicy, LayerCache, plan_slots

__all__ = ["CacheStats", "ExpertStore", "attach_expert_cache", "detach_expert_cache"]

_CPU = torch.device("cpu")


@dataclass
class CacheStats:
    steps: int = 0
    tokens: int = 0             # the rows of those steps (a prompt's forward pass is one step of many)
    requests: int = 0
    hits: int = 0
    admissions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0


class ExpertStore:
    """The slots of one MoE layer on ``device`` and the policy that fills them."""

    def __init__(self, moe: L.MoE, n_slots: int, policy: CachePolicy, device, counts=None):
        self.moe = moe
        self.device = torch.device(device)
        self.cache = LayerCache(moe.n_expert, n_slots, policy, counts)
        g0 = self._host(0)
        self.dtype = g0[0].dtype
        self.gate = torch.zeros((n_slots,) + tuple(g0[0].shape), dtype=self.dtype, device=self.device)
        self.up = torch.zeros((n_slots,) + tuple(g0[1].shape), dtype=self.dtype, device=self.device)
        self.down = torch.zeros((n_slots,) + tuple(g0[2].shape), dtype=self.dtype, device=self.device)
        self.stats = CacheStats()

    @property
    def expert_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (self.gate, self.up, self.down)) if len(self.gate) else 0

    def _host(self, e: int) -> tuple[Tensor, Tensor, Tensor]:
        m = self.moe
        if m.streamed:
            return m.gate_exps.get(e, _CPU), m.up_exps.get(e, _CPU), m.down_exps.get(e, _CPU)
        return m.gate_exps[e], m.up_exps[e], m.down_exps[e]

    def _load(self, e: int, slot: int) -> None:
        for dst, src in zip((self.gate, self.up, self.down), self._host(e)):
            dst[slot].copy_(src, non_blocking=False)

    def warm(self, ranking) -> None:
        """Fill free slots with ``ranking``'s experts, first ones first."""
        for a in self.cache.fill(ranking):
            self._load(a.expert, a.slot)

    def experts(self, x: Tensor, experts: Tensor) -> Tensor:
        """Outputs of the chosen experts, [T, K, D] (as :meth:`MoE.experts_stream`)."""
        n_tok, k = experts.shape
        ids = experts.cpu().numpy().reshape(-1)                         # the step's sync
        c = self.cache
        c.observe(ids)
        slots = c.slot_of[ids].copy()                                   # as at the start of the step
        hit = slots >= 0
        y = x.new_zeros(n_tok * k, x.shape[1])
        # hits on the device, one slot at a time (asynchronous on CUDA)
        for s in np.unique(slots[hit]).tolist():
            pairs = torch.from_numpy(np.flatnonzero(slots == s)).to(x.device)
            y[pairs] = L.swiglu(x[pairs // k], self.gate[s], self.up[s], self.down[s])
        # misses on the CPU, meanwhile
        if not hit.all():
            x_cpu = x.to(_CPU)
            miss = np.flatnonzero(~hit)
            for e in np.unique(ids[miss]).tolist():
                pairs = miss[ids[miss] == e]
                g, u, d = self._host(e)
                out = L.swiglu(x_cpu[torch.from_numpy(pairs // k)], g, u, d)
                y[torch.from_numpy(pairs).to(x.device)] = out.to(x.device, x.dtype)
        # admissions: after the hit kernels in stream order
        admitted = c.admit(ids[~hit])
        for a in admitted:
            self._load(a.expert, a.slot)
        st = self.stats
        st.steps += 1
        st.tokens += n_tok
        st.requests += len(ids)
        st.hits += int(hit.sum())
        st.admissions += len(admitted)
        return y.view(n_tok, k, x.shape[1])


def moe_layers(model) -> list[L.MoE]:
    net = getattr(model, "net", model)
    return [m for m in net.modules() if isinstance(m, L.MoE)]


def attach_expert_cache(model, *, budget_bytes: "int | None" = None, slots: "int | None" = None,
                        policy: CachePolicy = CachePolicy(), profile: "Mapping[int, np.ndarray] | None" = None,
                        device=None) -> dict[int, ExpertStore]:
    """Give every MoE layer of ``model`` an expert store on ``device``
    (default: the model's): ``slots`` per layer, or as many as
    ``budget_bytes`` allows, planned by :func:`plan_slots` (by ``profile``
    when given, which also seeds the counts and fills the slots)."""
    moes = moe_layers(model)
    if not moes:
        raise FleError("the model has no MoE layers")
    for m in moes:
        if not m.streamed and m.gate_exps.device.type != "cpu":
            raise FleError("an expert cache needs the experts on the host: load the model with experts='stream'")
    if (budget_bytes is None) == (slots is None):
        raise FleError("give the expert cache either slots per layer or a byte budget")
    device = torch.device(device) if device is not None else getattr(model, "device", _CPU)
    n_expert = moes[0].n_expert
    if slots is not None:
        plan = {m.layer: min(int(slots), m.n_expert) for m in moes}
    else:
        sizes = {}
        for m in moes:
            g = m.gate_exps
            shape_f, shape_d = (g.shape[1], g.shape[2]) if m.streamed else tuple(g.shape[1:])
            size = torch.empty((), dtype=m.router.dtype).element_size()
            sizes[m.layer] = 3 * shape_f * shape_d * size
        plan = plan_slots(int(budget_bytes), sizes, n_expert, profile)
    return install_stores(moes, lambda m, counts: ExpertStore(m, plan[m.layer], policy, device, counts), profile)


def install_stores(moes: list[L.MoE], make, profile: "Mapping[int, np.ndarray] | None") -> dict:
    """``make(moe, counts)`` -> a store for each MoE layer, warmed with the
    profile's ranking when there is one, and attached (``moe.store``)."""
    stores = {}
    for m in moes:
        counts = None if profile is None else np.asarray(profile[m.layer], np.float64)
        st = make(m, counts)
        if counts is not None:
            st.warm(np.argsort(-counts, kind="stable"))
        m.store = st
        stores[m.layer] = st
    return stores


def detach_expert_cache(model) -> None:
    for m in moe_layers(model):
        m.store = None
