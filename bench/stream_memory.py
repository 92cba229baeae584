"""Process memory of FLE's reference forward pass with experts resident
(dequantized to float32 at load) against experts streamed from the file
(``fle_engine.load(path, experts="stream")``), on one factory model in the
same run.

Each mode runs in a fresh child process (so one cannot inherit the other's
heap): load the model, then prefill ``--tokens`` tokens. Printed per mode:
peak anonymous memory (``RssAnon``, sampled every 5 ms) and the wall time of
the prefill; then the ratios stream / resident. The model's float32 expert
bytes are printed for scale: resident should exceed streamed by about that.

Usage: python bench/stream_memory.py [--experts 64] [--layers 8] [--tokens 256]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memwatch import PeakSampler  # this folder's helper


def child(mode: str, path: str, n_tokens: int) -> None:
    import numpy as np

    import fle_engine

    with PeakSampler() as peak:
        model = fle_engine.load(path, experts=mode)
        toks = np.random.default_rng(0).integers(0, model.n_vocab, n_tokens).tolist()
        t0 = time.perf_counter()
        model.logits(toks)
        dt = time.perf_counter() - t0
    print(json.dumps({"peak_mib": peak.peak_kb / 1024, "prefill_s": dt}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.tokens)
        return
    from fle_quant.gguf_reader import GGUFModel
    from fle_quant.synth import make_model

    with tempfile.TemporaryDirectory() as d:
        path = make_model(Path(d) / "m.gguf", "qwen3moe", seed=0, mix="q8_0", block_count=args.layers,
                          expert_count=args.experts, expert_used_count=8, embedding_length=512,
                          expert_feed_forward_length=512)
        with GGUFModel.open(path) as g:
            exp = sum(4 * int(__import__("numpy").prod(t.shape)) for t in g.tensors.values()
                      if t.name.endswith("_exps.weight"))
        print(f"model: qwen3moe, {args.layers} layers x {args.experts} experts, Q8_0, "
              f"file {Path(path).stat().st_size / 2**20:.0f} MiB, experts as float32 {exp / 2**20:.0f} MiB; "
              f"prefill of {args.tokens} tokens")
        res = {}
        for mode in ("resident", "stream"):
            out = subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens), "--child", mode, str(path)],
                                 check=True, capture_output=True, text=True).stdout
            res[mode] = json.loads(out.strip().splitlines()[-1])
            print(f"{mode:9s} peak anonymous memory {res[mode]['peak_mib']:8.0f} MiB   "
                  f"prefill {res[mode]['prefill_s']:.2f} s")
        print(f"ratio stream / resident: memory {res['stream']['peak_mib'] / res['resident']['peak_mib']:.3f}, "
              f"prefill time {res['stream']['prefill_s'] / res['resident']['prefill_s']:.2f}")


if __name__ == "__main__":
    main()
