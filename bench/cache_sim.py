"""Hit rate of the expert cache policy against LRU at equal slot counts, on
a routing trace of FLE's reference forward pass (measure before building).

A factory model with routing skew (some experts popular, as in real MoE
models) runs over a text; its MoE capture gives per layer the experts each
token chose. The first half of the trace is the calibration part: it makes
the usage profile (the aged counts at its end). The second half is replayed,
one token per step, through caches of the same size in every layer:

- ``lru`` (baseline): admit every miss, evict the least recently used;
- ``fle-cold``: FLE's policy from an empty cache;
- ``fle-warm``: FLE's policy started from the profile (counts and contents);
- ``static``: the profile's most requested experts, never changed.

Printed: hit rate and misses per step per arm, and each arm's misses as a
ratio to LRU's (lower is better).

Usage: python bench/cache_sim.py [--arch qwen3moe] [--experts 64] [--slots 16] [--tokens 2048] [--skew 1.5]
"""
from __future__ import annotations

import argparse
import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np


class LRU:
    def __init__(self, n_slots: int):
        self.n, self.d = n_slots, OrderedDict()

    def step(self, req) -> int:
        hits = 0
        for e in req.tolist():
            if e in self.d:
                hits += 1
                self.d.move_to_end(e)
        for e in req.tolist():
            if e not in self.d and self.n:
                if len(self.d) >= self.n:
                    self.d.popitem(last=False)
                self.d[e] = True
            elif e in self.d:
                self.d.move_to_end(e)
        return hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="qwen3moe")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--used", type=int, default=4)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--skew", type=float, default=1.5)
    ap.add_argument("--text", default=str(Path(__file__).resolve().parents[1] / "README.md"))
    args = ap.parse_args()

    import fle_engine
    from fle_engine.expert_cache import CachePolicy, LayerCache, simulate, trace_from_capture, warm_caches
    from fle_quant.sensitivity import read_tokens, run_windows
    from fle_quant.synth import make_model

    with tempfile.TemporaryDirectory() as d:
        path = make_model(Path(d) / "m.gguf", args.arch, seed=0, expert_count=args.experts,
                          expert_used_count=args.used, routing_skew=args.skew)
        model = fle_engine.load(path)
        text = Path(args.text).read_text(encoding="utf-8")
        (Path(d) / "t.txt").write_text(text * (1 + 4 * args.tokens // max(len(text), 1)), encoding="utf-8")
        toks = read_tokens(path, Path(d) / "t.txt", args.tokens)
        with model.capturing() as cap:
            run_windows(model, toks, 512)
    trace = trace_from_capture(cap)
    half = args.tokens // 2
    calib = {l: t[:half] for l, t in trace.items()}
    evalt = {l: t[half:] for l, t in trace.items()}
    n_layers, steps = len(trace), args.tokens - half
    policy = CachePolicy(halve_every=2000)
    # the profile: FLE's aged counts at the end of the calibration part
    counting = {l: LayerCache(args.experts, 0, policy) for l in trace}
    for l, t in calib.items():
        for s in t:
            counting[l].observe(s)
    profile = {l: c.counts.copy() for l, c in counting.items()}
    slots = {l: args.slots for l in trace}
    print(f"{args.arch} factory model, {n_layers} MoE layers x {args.experts} experts, top-{args.used}, "
          f"routing skew {args.skew}; {args.slots} slots per layer; calibration {half} tokens, replay {steps} tokens")
    arms = {}
    lru_hits = 0
    for l, t in evalt.items():
        c = LRU(args.slots)
        lru_hits += sum(c.step(s) for s in t)
    total = sum(t.size for t in evalt.values())
    arms["lru (baseline)"] = lru_hits
    arms["fle-cold"] = simulate(evalt, warm_caches(slots, args.experts, policy)).hit_rate * total
    arms["fle-warm"] = simulate(evalt, warm_caches(slots, args.experts, policy, profile)).hit_rate * total
    static_hits = 0
    for l, t in evalt.items():
        top = set(np.argsort(-profile[l], kind="stable")[: args.slots].tolist())
        static_hits += int(np.isin(t, list(top)).sum())
    arms["static"] = static_hits
    base_miss = total - lru_hits
    for name, hits in arms.items():
        miss = total - hits
        print(f"{name:16s} hit rate {hits / total:6.3f}   misses/step {miss / steps:6.2f}   "
              f"misses vs lru {miss / base_miss:5.3f}")


if __name__ == "__main__":
    main()
