"""What one more row costs in torch's CPU matrix product: ``F.linear`` of
1, 2 and 4 rows against weights of the factory models' shapes and of a
real layer's, on ``--threads`` threads. The reference path's batched step
gains only what a 2-row product saves over two 1-row ones; the ratio
printed (time of 2 rows / time of 1 row, median of alternating runs)
bounds the 2-slot speed-up of a step made of such products at
2 / ratio.

    PYTHONPATH=. python bench/gemm_rows.py [--threads 1] [--repeat 7]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [(256, 256), (1024, 256), (512, 2048), (2048, 2048), (4096, 4096)]


def timed(x: torch.Tensor, w: torch.Tensor, n: int) -> float:
    F.linear(x, w)
    t = time.perf_counter()
    for _ in range(n):
        F.linear(x, w)
    return (time.perf_counter() - t) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for out_f, in_f in SHAPES:
        w = torch.randn(out_f, in_f)
        n = max(5, int(2e8 / (out_f * in_f * 4)))        # about 0.2 s of 1-row products per run
        xs = {m: torch.randn(m, in_f) for m in (1, 2, 4)}
        runs: dict[int, list[float]] = {1: [], 2: [], 4: []}
        for _ in range(args.repeat):
            for m in (1, 2, 4):
                runs[m].append(timed(xs[m], w, n))
        t = {m: statistics.median(v) for m, v in runs.items()}
        print(f"[{out_f} x {in_f}]: 1 row {1e6 * t[1]:.1f} us, 2 rows {1e6 * t[2]:.1f} us "
              f"({t[2] / t[1]:.2f}x, 2-slot bound {2 * t[1] / t[2]:.2f}x), 4 rows {1e6 * t[4]:.1f} us "
              f"({t[4] / t[1]:.2f}x)")


if __name__ == "__main__":
    main()
