"""Helpers shared by the engine tests (tests/test_engine*.py).

``count_launches``: the kernel launches of one decode step, counted on the
CPU. The step runs eagerly with the reference operations while every
launch the fast side would issue is counted: each ops-table call as its
Triton launches, each quantized product as one launch, each torch
operation that computes (not views).

``hits_per_step``: the expert cache's hits of every step, as the cache
observes them (a warm start hits from the first step, a cold one cannot).

``reference_greedy``: greedy tokens and per-step logits of the reference
forward pass, one token per call, that the engine is held to.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fle_engine.kernels import engine_ops
from fle_engine.runtime import weights as W

# launches of each ops-table call on the fast side
FAST_LAUNCHES = {"experts": 1, "experts_ffn": 2, "route_topk": 1, "add_rmsnorm": 1, "qk_rope_kv": 1, "attention": 2,
                 "embed_row": 1, "hc_write_norm": 1, "hc_mix": 1, "gather_rows": 1, "gdn_step": 2,
                 "post_misses": 1, "wait_misses": 1, "float_mv": 1}
# torch operations that make views or empty tensors: no kernel
_VIEWS = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "t", "transpose", "permute",
          "as_strided", "unsqueeze", "squeeze", "alias", "detach", "_to_copy", "lift_fresh", "empty",
          "empty_like", "split", "unbind", "flip", "numpy_T"}


def count_launches(eng) -> dict:
    """Launches of one decode step of ``eng`` (eager, reference ops, no
    split): ``per_layer`` [(kind, n)], ``layers`` (their sum) and
    ``total`` (with the embedding, the first norm and the head). A layer
    runs from after the norm that precedes it through the residual add and
    norm that follow its MoE; its kind is its mixer's class name, or "ple"
    for the layer that adds the per-layer embedding."""
    net, st = eng.net, eng.state
    counter = {"n": 0, "quiet": 0}
    marks = []              # counter values where a layer starts (the last: where the head starts)
    closing = [False]       # the next ops call is the norm that ends the prologue or a layer

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not counter["quiet"] and func.overloadpacket.__name__.rstrip("_") not in _VIEWS:
                counter["n"] += 1
            return func(*args, **(kwargs or {}))

    def quiet(n, fn, *a, **k):
        counter["n"] += n
        counter["quiet"] += 1
        try:
            return fn(*a, **k)
        finally:
            counter["quiet"] -= 1

    def op(name, fn):
        def call(*a, **k):
            out = quiet(FAST_LAUNCHES[name], fn, *a, **k)
            if closing[0]:
                closing[0] = False
                marks.append(counter["n"])
            return out
        return call

    def then_close(fn):
        def call(*a, **k):
            out = fn(*a, **k)
            closing[0] = True
            return out
        return call

    ops = engine_ops.REFERENCE
    counted = type(ops)(**{n: op(n, getattr(ops, n)) for n in FAST_LAUNCHES})
    real_matvec = W.DenseMatrix.matvec
    W.DenseMatrix.matvec = lambda self, x, out, impl: quiet(1, real_matvec, self, x, out, impl)
    net.embed, net.moe = then_close(net.embed), then_close(net.moe)
    try:
        with torch.inference_mode(), Count():
            net.step(st, counted, eng.cache)
    finally:
        W.DenseMatrix.matvec = real_matvec
        del net.embed, net.moe              # the class's methods again
    assert len(marks) == len(net.layers) + 1, marks
    kinds = ["ple" if getattr(L, "ple", None) is not None else type(L.mixer).__name__ for L in net.layers]
    per_layer = [(k, b - a) for k, a, b in zip(kinds, marks, marks[1:])]
    return {"per_layer": per_layer, "layers": marks[-1] - marks[0], "total": counter["n"]}


def hits_per_step(cache) -> list:
    """A list that fills with the hits of each step ``cache`` observes
    (from now on, for as long as the cache lives)."""
    seen = []
    observe = cache.observe

    def recording(ids, hits, *a, **k):
        seen.append(int(np.count_nonzero(hits)))
        observe(ids, hits, *a, **k)

    cache.observe = recording
    return seen


def reference_greedy(path, prompt, n: int, device) -> "tuple[list[int], torch.Tensor]":
    """The reference pass (``fle_engine.load``, experts resident) on ``path``:
    ``n`` greedy tokens after ``prompt``, one token per call, and the logits
    of every step [n, vocab] (the prompt's last, then each token's but the
    last)."""
    from fle_engine import load

    model = load(path, device=device, experts="resident")
    state = model.new_state(len(prompt) + n + 8)
    out = model.forward(prompt, state)
    toks, logits = [], [out[-1].float().cpu()]
    while True:
        t = int(torch.argmax(out[-1]))
        toks.append(t)
        if len(toks) == n:
            return toks, torch.stack(logits)
        out = model.forward([t], state)
        logits.append(out[-1].float().cpu())
