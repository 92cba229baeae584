"""Speed of the CPU expert kernels (fle_engine.kernels.cpu_experts): GB/s
of expert weights read per second, per quant type, on all cores.

For each type, one buffer of ``--gb`` GB holds experts of a 30B-A3B layer's
shape (hidden 2048, expert FFN 768; gate, up and down all of that type) in
the engine's host layout. Each call computes the expert FFN of ``--tokens``
tokens, each routed to ``--topk`` experts drawn at random from the whole
buffer, so the weights come from DRAM, as a miss does. GB/s counts the bytes
of the distinct experts a call reads.

Backends, timed in the same run on the same buffer:

- numba: FLE's own kernels (``impl="numba"``), no compiler needed;
- ggml: ggml's CPU ``vec_dot`` / ``from_float`` from the libggml-cpu that
  llama-cpp-python ships, driven row by row from the same thread pool
  (``impl="ggml"``). These are the dot products llama.cpp's CPU backend
  multiplies experts with, so this column is llama.cpp's CPU path (without
  its graph scheduling); it is absent when llama-cpp-python is not
  installed.

- team-numba, team-ggml: the same kernels in the engine's persistent CPU
  team (``kernels/cpu_experts/team.py``: spinning threads fed through a
  mailbox, one token's ``--topk`` experts per job, the poster waiting for
  each answer as the GPU does), as the engine runs its CPU misses.

The ratio is numba / ggml (above 1: FLE is faster). Blocks are random bytes
with typical fp16 scales: every byte pattern is a valid block of these
formats and costs the kernels what real weights cost.

    python bench/cpu_experts.py [--types IQ4_XS,Q4_K] [--threads 16] [--gb 4]
                                [--tokens 1] [--topk 8] [--seconds 2] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from fle_quant.ggml_types import BLOCK_GEOMETRY, parse_type
from fle_quant.quants.dequant import FP16_SCALE_OFFSETS


def fill_experts(buf: np.ndarray, lay, rng: np.random.Generator) -> None:
    """Random blocks with fp16 scales of typical size in every part of every expert."""
    buf[:] = np.frombuffer(rng.bytes(buf.size), np.uint8).reshape(buf.shape)
    parts = ((0, 2 * lay.n_ff * lay.gu_row_bytes, lay.gu_type),
             (lay.down_offset, lay.n_embd * lay.down_row_bytes, lay.down_type))
    for start, nbytes, qt in parts:
        size = BLOCK_GEOMETRY[qt][1]
        blocks = buf[:, start:start + nbytes].reshape(buf.shape[0], -1, size)
        for off in FP16_SCALE_OFFSETS[qt]:
            scale = (rng.standard_normal(blocks.shape[:2]) * 0.01).astype(np.float16)
            blocks[:, :, off:off + 2] = scale.view(np.uint8).reshape(blocks.shape[:2] + (2,))


def time_backend(ce, buf, lay, impl: str, n_tok: int, topk: int, seconds: float, rng, threads: int = 1) -> dict:
    n_exp = buf.shape[0]
    if impl.startswith("team-"):
        from fle_engine.kernels.cpu_experts.team import measure

        bw = measure(buf.reshape(-1), 0, lay, impl[5:], threads, topk, n_exp, topk, seconds)
        return {"gbps": bw / 1e9, "us_per_call": topk * lay.expert_bytes / bw * 1e6, "calls": None}
    x = rng.standard_normal((n_tok, lay.n_embd)).astype(np.float32)
    w = np.full((n_tok, topk), 1.0 / topk, np.float32)
    out = np.empty((n_tok, lay.n_embd), np.float32)
    weight_bytes = 2 * lay.n_ff * lay.gu_row_bytes + lay.n_embd * lay.down_row_bytes

    def draw():
        return np.stack([rng.choice(n_exp, topk, replace=False) for _ in range(n_tok)])

    for _ in range(3):  # compile (or load from numba's cache) and warm the thread pool
        ce.expert_forward(buf, lay, x, draw(), w, out=out, impl=impl)
    total_bytes, elapsed, calls = 0, 0.0, 0
    while elapsed < seconds or calls < 5:
        ids = draw()
        t0 = time.perf_counter()
        ce.expert_forward(buf, lay, x, ids, w, out=out, impl=impl)
        elapsed += time.perf_counter() - t0
        total_bytes += len(np.unique(ids)) * weight_bytes
        calls += 1
    return {"gbps": total_bytes / elapsed / 1e9, "us_per_call": elapsed / calls * 1e6, "calls": calls}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="IQ4_XS,Q4_K,IQ3_S,IQ3_XXS,IQ2_XS,IQ2_S,IQ4_NL,Q2_0,Q5_K,Q6_K,Q8_0",
                    help="comma-separated quant types (default: every type with a kernel)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads (default: all cores)")
    ap.add_argument("--gb", type=float, default=4.0, help="size of each type's expert buffer in GB (default 4; "
                    "make it several times the last-level cache)")
    ap.add_argument("--tokens", type=int, default=1, help="tokens per call (default 1, a decode step)")
    ap.add_argument("--topk", type=int, default=8, help="experts per token (default 8)")
    ap.add_argument("--n-embd", type=int, default=2048)
    ap.add_argument("--n-ff", type=int, default=768)
    ap.add_argument("--seconds", type=float, default=2.0, help="timed seconds per type and backend")
    ap.add_argument("--backends", default="numba,ggml,team-numba,team-ggml",
                    help="comma-separated: numba, ggml, team-numba, team-ggml")
    ap.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    args = ap.parse_args(argv)

    import numba

    from fle_engine.kernels import cpu_experts as ce
    from fle_engine.kernels.cpu_experts import ggml_cpu

    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not ggml_cpu.available():
        for b in ("ggml", "team-ggml"):
            if b in wanted:
                print(f"# {b} backend skipped: {ggml_cpu.unavailable_reason()}", file=sys.stderr)
                wanted.remove(b)
    both = "numba" in wanted and "ggml" in wanted
    rng = np.random.default_rng(0)
    rows = []
    print(f"# {numba.get_num_threads()} threads, {args.gb:g} GB of experts per type, {args.tokens} token(s) x "
          f"top-{args.topk}, experts {args.n_ff} x {args.n_embd}")
    print("| type | " + " | ".join(f"{b} GB/s | {b} us/call" for b in wanted)
          + (" | numba / ggml |" if both else " |"))
    print("|---" * (1 + 2 * len(wanted) + both) + "|")
    for name in args.types.split(","):
        qt = parse_type(name.strip())
        lay = ce.Geometry.of(args.n_ff, args.n_embd, qt, qt)
        n_exp = max(2 * args.topk, int(args.gb * 1e9 // lay.expert_bytes))
        buf = np.empty((n_exp, lay.expert_bytes), np.uint8)
        fill_experts(buf, lay, rng)
        res = {"type": qt.name, "experts": n_exp, "buffer_gb": buf.nbytes / 1e9}
        for b in wanted:
            res[b] = time_backend(ce, buf, lay, b, args.tokens, args.topk, args.seconds, rng, args.threads)
        line = f"| {qt.name} | " + " | ".join(f"{res[b]['gbps']:.2f} | {res[b]['us_per_call']:.0f}" for b in wanted)
        if both:
            res["ratio"] = res["numba"]["gbps"] / res["ggml"]["gbps"]
            line += f" | {res['ratio']:.2f} |"
        else:
            line += " |"
        print(line, flush=True)
        rows.append(res)
        del buf
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": numba.get_num_threads(), "gb": args.gb, "tokens": args.tokens,
                       "topk": args.topk, "n_embd": args.n_embd, "n_ff": args.n_ff, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
