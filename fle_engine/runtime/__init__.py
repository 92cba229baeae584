"""The engine runtime: what `fle-engine generate/serve --cache-budget` run
on a GPU.

- :mod:`.weights`: dense weights in GGUF bytes on the device; the routed
  experts in one page-locked host buffer;
- :mod:`.cache`: slots under one byte budget, the device expert->slot map,
  the policy applied between steps with a step of lag;
- one module per architecture (:mod:`.qwen3moe`): the decode step from the
  fused kernels of :mod:`fle_engine.kernels.engine_ops`;
- :mod:`.engine`: loading, the KV cache, CUDA-graph capture, the decode loop
  with one step of look-ahead, statistics.

The reference forward pass (:mod:`fle_engine.models`) stays the slow,
obviously right twin that the engine is checked against.
"""
from .engine import ARCHS, Engine, RunStats, parse_budget

__all__ = ["Engine", "RunStats", "ARCHS", "parse_budget"]
