"""Hit rate of FLE's cache policy on a factory model's routing at the
report's three cache sizes (bracket V6b: 173, 146 and 120 slots of 512
experts, top-10, hit rates 0.912, 0.888, 0.848): how close a factory
model's routing comes to the real model's regime.

The model (qwen3moe layout, 512 experts, top-10, small widths so that it
runs on a laptop) reads a text with a real vocabulary; its MoE capture is
the trace. The first half warms the caches, the second half is measured.

Usage: python bench/cache_curve.py --vocab ggml-vocab-qwen2.gguf --text FILE [--skew 0 1 2] [--tokens 8192]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

SEED_CURVE = {173: 0.912, 146: 0.888, 120: 0.848}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", default=None, help="a vocab-only GGUF (llama.cpp's models/ggml-vocab-qwen2.gguf)")
    ap.add_argument("--text", required=True)
    ap.add_argument("--skew", type=float, nargs="+", default=[0.0, 1.0, 2.0])
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()

    import fle_engine
    from fle_engine.expert_cache import CachePolicy, simulate, trace_from_capture, warm_caches
    from fle_quant.sensitivity import read_tokens, run_windows
    from fle_quant.synth import make_model

    print(f"report (V6b): " + "  ".join(f"{s} slots {h:.3f}" for s, h in SEED_CURVE.items()))
    with tempfile.TemporaryDirectory() as d:
        for skew in args.skew:
            t0 = time.perf_counter()
            path = make_model(Path(d) / "m.gguf", "qwen3moe", seed=0, expert_count=512, expert_used_count=10,
                              embedding_length=128, expert_feed_forward_length=32, block_count=2,
                              routing_skew=skew, vocab=args.vocab)
            model = fle_engine.load(path)
            toks = read_tokens(path, args.text, args.tokens)
            with model.capturing() as cap:
                run_windows(model, toks, 512)
            trace = trace_from_capture(cap)
            half = len(toks) // 2
            rates = []
            for slots in SEED_CURVE:
                caches = warm_caches({l: slots for l in trace}, 512, CachePolicy())
                simulate({l: t[:half] for l, t in trace.items()}, caches)
                rates.append(simulate({l: t[half:] for l, t in trace.items()}, caches).hit_rate)
            print(f"factory, routing skew {skew}: " + "  ".join(f"{s} slots {r:.3f}" for s, r in zip(SEED_CURVE, rates))
                  + f"   ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
