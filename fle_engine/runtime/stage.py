"""Predicted misses copied into slots on a copy stream, one layer ahead
(``--miss-prefetch R``).

Misses are otherwise read by the expert kernels straight from page-locked
host memory when their layer runs, so the PCIe link is busy only during the
MoE parts of a step. With prefetch, when MoE layer l starts, a copy stream
multiplies layer l's normed activations by the next MoE layer's router
(pre-gating: the next layer's router applied to this layer's input), takes
the first R of the predicted top-K experts that the cache does not hold
(highest logit first) and copies their bytes from host memory into R
prefetch slots of the next layer, while the main stream computes layer l and
the next layer's token mixer. At the next layer, after its routing (which
logs hits against the cache as it is, so the policy sees the true misses),
the main stream waits for that copy and points the map entries of the
copied experts at the prefetch slots: its expert kernels then read them
from GPU memory. The entries are switched back at the layer after (and
after the last layer), so no step leaves them behind.

The prefetch slots come out of the cache budget: two buffers of R experts
shared by the layers of the most common expert size (alternate layers use
alternate buffers, so a copy never writes the rows that the layer being
computed reads), R rows of their own for layers of other sizes
(:class:`~fle_engine.runtime.cache.ExpertCache` lays them out).

Ordering, all on the device (events, captured into the step's graph): the
copy stream starts after the main stream has written layer l's
activations; the main stream waits for the copy stream's router product
before anything overwrites those activations (at the end of layer l), and
for the copy before switching the next layer's map. The bytes and kernels
are the same as without prefetch, so the step's results are bit-equal; a
wrong prediction costs only link time.

A step of T rows (the verify step, a prompt's T-row steps: ``Net.moe_multi``)
prefetches the same way for all its rows at once: the next layer's router
applied to each row, each expert scored by its highest logit over the rows,
and the first R missing among the top T x K of those scores copied (the
rows' top-K sets fall within them but for near-ties across rows), so that
the step's larger union of misses is read over the link while the main
stream computes the layer before.

What prefetch achieved is counted on the device (experts copied, and of
them the ones the layer used) and read at the end of a run.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

__all__ = ["MissPrefetch"]


class MissPrefetch:
    """The prefetch of one engine's steps (see the module docstring);
    ``rows``: experts prefetched per layer at most; ``t_max``: the most
    token rows of one step (the verify step's)."""

    def __init__(self, net, cache, rows: int, device: torch.device, fast: bool, t_max: int = 1):
        a = net.args
        self.rows, self.n_used, self.fast = int(rows), a.n_expert_used, fast
        self.n_expert = a.n_expert
        self.cuda = device.type == "cuda"
        self.cache = cache
        moe = sorted(net.layouts)
        self.counts = torch.zeros(2, dtype=torch.int64, device=device)     # copied, used
        self.plan: dict[int, SimpleNamespace] = {}       # source layer -> what it prefetches for its next layer
        self.target_of: dict[int, SimpleNamespace] = {}  # target layer -> the same record
        rank = 0
        for src, dst in zip(moe, moe[1:]):
            if cache.slots_per_layer[dst] >= a.n_expert:
                continue                                   # every expert of that layer is cached
            lay = net.layouts[dst]
            words, delta = cache.words(dst, lay.gu_type)
            rec = SimpleNamespace(
                src=src, dst=dst, router=net.layers[dst].moe.router,
                logits=torch.zeros(1, a.n_expert, dtype=torch.float32, device=device),
                row_logits=torch.zeros(max(1, int(t_max)), a.n_expert, dtype=torch.float32, device=device),
                stage=torch.full((self.rows,), -1, dtype=torch.int32, device=device),
                first=cache.stage_first[dst][rank % 2],
                words=words, delta=delta, expert_words=lay.expert_bytes // words.element_size(),
                store=cache.reference_store(dst, lay.gu_type),
                read=torch.cuda.Event() if self.cuda else None,
                done=torch.cuda.Event() if self.cuda else None)
            rank += 1
            self.plan[src] = rec
            self.target_of[dst] = rec
        self.last = max(self.target_of) if self.target_of else None
        self._prev: "SimpleNamespace | None" = None
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    # the step's hooks (runtime.qwen3moe.Net.moe) ----------------------------------
    def fork(self, il: int, xn: torch.Tensor, ops) -> None:
        """At the start of MoE layer ``il`` (``xn`` [T, D]: its normed input,
        one row or a T-row step's): predict and copy the next layer's missing
        experts."""
        rec = self.plan.get(il)
        if rec is None:
            return
        if not self.cuda:
            self._predict(rec, xn)
            self._pick_copy(rec, xn.shape[0], ops)
            return
        main, side = torch.cuda.current_stream(), self.stream
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self._predict(rec, xn)
            rec.read.record(side)
            self._pick_copy(rec, xn.shape[0], ops)
            rec.done.record(side)

    @staticmethod
    def _predict(rec, xn: torch.Tensor) -> None:
        """The next layer's router logits of the rows -> ``rec.logits``: one
        row's own, or each expert's highest over the T rows."""
        n = xn.shape[0]
        if n == 1:
            torch.matmul(xn, rec.router.T, out=rec.logits)
        else:
            torch.matmul(xn, rec.router.T, out=rec.row_logits[:n])
            torch.amax(rec.row_logits[:n], dim=0, keepdim=True, out=rec.logits)

    def _pick_copy(self, rec, n: int, ops) -> None:
        ops.stage_pick(rec.logits[0], self.cache.layer_map(rec.dst), min(n * self.n_used, self.n_expert), rec.stage)
        self._copy(rec, ops)

    def _copy(self, rec, ops) -> None:
        if self.fast:
            ops.stage_copy(rec.words, rec.delta, rec.expert_words, rec.stage, rec.first)
        else:
            ops.stage_copy(rec.store, 0, 0, rec.stage, rec.first)

    def apply(self, il: int, ids: torch.Tensor, ops) -> None:
        """After layer ``il``'s routing (``ids``: its routed ids, [T K] of a
        T-row step flat): switch the previous layer's prefetched experts out
        of its map and this layer's in."""
        rec = self.target_of.get(il)
        prev = self._prev
        if rec is None and prev is None:
            return
        if rec is not None and self.cuda:
            torch.cuda.current_stream().wait_event(rec.done)
        ops.stage_apply(None if prev is None else self.cache.layer_map(prev.dst), None if prev is None else prev.stage,
                        None if rec is None else self.cache.layer_map(il), None if rec is None else rec.stage,
                        ids, self.counts, 0 if rec is None else rec.first)
        self._prev = rec

    def finish(self, il: int, ops) -> None:
        """At the end of MoE layer ``il``: the activations may be overwritten
        once the copy stream has read them; after the last prefetched layer,
        its map entries go back."""
        rec = self.plan.get(il)
        if rec is not None and self.cuda:
            torch.cuda.current_stream().wait_event(rec.read)
        if il == self.last and self._prev is not None:
            prev = self._prev
            ops.stage_apply(self.cache.layer_map(prev.dst), prev.stage, None, None, None, self.counts, 0)
            self._prev = None

    # results ------------------------------------------------------------------------
    def reset_counts(self) -> None:
        self.counts.zero_()

    def summary(self, steps: int) -> dict:
        """Experts copied and used (per step), read from the device (a sync)."""
        copied, used = (int(v) for v in self.counts.tolist())
        return {"rows": self.rows, "copied": copied, "used": used,
                "copied_per_step": copied / steps if steps else 0.0,
                "used_fraction": used / copied if copied else 0.0}

    def line(self, steps: int) -> str:
        d = self.summary(steps)
        return (f"miss prefetch: {d['copied_per_step']:.1f} experts/token copied ahead ({self.rows} per layer at "
                f"most), {100 * d['used_fraction']:.1f} % of them used")
