"""Helpers shared by the tests of the engine's lanes (several sequences in
one batched step: tests/test_engine_slots.py, tests/test_server_lanes.py):
factory files of the three architectures, the engine as those tests open
it, and a lane's logits held to the one-sequence engine's."""
from __future__ import annotations

import numpy as np
import torch

from fle_engine.runtime import Engine
from fle_quant.synth import make_model

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
ARCHS = ["qwen3moe", "qwen3next", "qwen4exp"]
# a lane's logits against the one-sequence engine, relative to the largest |logit|: the batched products sum
# in another order than one-row ones
TOL = 1e-3 if CUDA else 1e-4


def arch_files(tmp_path_factory, name: str) -> dict:
    """A factory model of each architecture in ``ARCHS`` (release quant mix, skewed routing)."""
    d = tmp_path_factory.mktemp(name)
    return {arch: make_model(d / f"{arch}.gguf", arch, seed=3 + i, mix="release", routing_skew=1.0)
            for i, arch in enumerate(ARCHS)}


def lane_engine(path, ctx=64, **kw):
    """The engine of these tests: float32 KV, no profile, prompts of 8 tokens and more prefilled."""
    return Engine(path, device=DEVICE, cache_budget=kw.pop("budget", 0), ctx_size=ctx, cache_type_k="f32",
                  cache_type_v="f32", profile_path="none", progress=False, log=lambda m: None,
                  prefill_min=kw.pop("prefill_min", 8), **kw)


def close_rel(a, b, tol=TOL):
    """``a`` within ``tol`` of ``b`` relative to the largest |b|."""
    scale = float(b.abs().max()) or 1.0
    assert float((a - b).abs().max()) <= tol * scale, float((a - b).abs().max()) / scale


def alone(path, prompt, n, f32_prefill=False, **kw):
    """Greedy tokens of ``prompt`` on the one-sequence engine and the logits
    that chose each [n, V] (``f32_prefill``: its prefill multiplies in
    float32 also on CUDA)."""
    eng = lane_engine(path, **kw)
    if f32_prefill and eng.prefill is not None:
        eng.prefill.bf16 = False
    logits = []

    def greedy(x):
        logits.append(torch.from_numpy(np.array(x, np.float32, copy=True)))
        return int(np.argmax(x))

    toks = list(eng.tokens(prompt, n, sampler=greedy))
    eng.close()
    return toks, torch.stack(logits)
