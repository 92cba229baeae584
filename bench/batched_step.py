"""The batched decode step alone: ``Model.forward_batch`` of one sequence
and of two (slot states pooled as ``fle-engine serve`` makes them), on a
factory model, torch on ``--threads`` threads. Blocks of ``--steps`` steps
alternate between one and two sequences; printed: the median step times
and the median of the blocks' tokens/s ratios (2 sequences / 1), what the
server's 1- vs 2-slot throughput is made of before sampling, HTTP and
prefill rounds (``bench/serve_slots.py``).

The two sequences are fed different tokens, so their tokens route to
different experts, as two conversations' do. ``--same-experts`` routes
every token of a step to the first token's experts (a diagnostic, not the
model): the ratio then shows what the step would give if the second
sequence read no experts of its own.

    PYTHONPATH=. python bench/batched_step.py [--arch qwen3next] [--blocks 30] [--steps 10] [--same-experts]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import fle_engine
from fle_engine import layers as L
from fle_engine.server import Engine
from fle_engine.tokenizer import Tokenizer
from fle_quant.synth import make_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen3next")
    ap.add_argument("--blocks", type=int, default=30, help="blocks per sequence count, alternating")
    ap.add_argument("--steps", type=int, default=10, help="decode steps per block")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--same-experts", action="store_true",
                    help="route every token of a step to the first token's experts (diagnostic)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.same_experts:
        route = L.MoE.route

        def same(self, x):
            probs, experts, weights = route(self, x)
            return probs, experts[:1].expand_as(experts).contiguous(), weights

        L.MoE.route = same
    with tempfile.TemporaryDirectory() as d:
        path = make_model(Path(d) / "m.gguf", args.arch, mix="f32")
        model, tok = fle_engine.load(path), Tokenizer.from_gguf(path)
        engines = {n: Engine(model, tok, n_ctx=512 * n, name="bench", n_parallel=n) for n in (1, 2)}
        states = {}

        def fresh(n):
            states[n] = [engines[n]._new_state(s) for s in engines[n].slots[:n]]
            model.forward_batch([[1, 5, 9, 200, 7, 3][:4 + i] for i in range(n)], states[n])

        def block(n):
            if states[n][0].length + args.steps > 480:
                fresh(n)
            t = time.thread_time()
            for i in range(args.steps):
                model.forward_batch([[(31 + 97 * i + 211 * j) % 509] for j in range(n)], states[n])
            return (time.thread_time() - t) / args.steps

        for n in (1, 2):
            fresh(n)
        t1s, t2s, ratios = [], [], []
        for b in range(args.blocks):
            got = {n: block(n) for n in ((1, 2) if b % 2 == 0 else (2, 1))}
            t1s.append(got[1])
            t2s.append(got[2])
            ratios.append(2 * got[1] / got[2])
        q = statistics.quantiles(ratios, n=4)
        print(f"{args.arch}{' (same experts)' if args.same_experts else ''}: 1 sequence "
              f"{1e3 * statistics.median(t1s):.2f} ms, 2 sequences {1e3 * statistics.median(t2s):.2f} ms a step; "
              f"tokens/s 2 / 1, median of {args.blocks} blocks = {statistics.median(ratios):.2f}x "
              f"(quartiles {q[0]:.2f}-{q[2]:.2f})")
        for eng in engines.values():
            eng.stop()


if __name__ == "__main__":
    main()
