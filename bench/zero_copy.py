"""Can a Triton kernel read pinned host memory directly (zero-copy over
PCIe), without CuPy, and how fast? Baseline in the same process: copying
the same bytes host -> device with ``Tensor.copy_`` (pinned).

With unified addressing (every 64-bit CUDA platform), page-locked memory
from ``torch.empty(..., pin_memory=True)`` is mapped into the device's
address space at the same address; a thin wrapper that reports that address
as a CUDA pointer lets Triton load from it.

Usage: python bench/zero_copy.py [--mib 1024]
"""
from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl


class HostView:
    """A pinned host tensor presented to Triton as device memory."""

    def __init__(self, t: torch.Tensor):
        assert t.is_pinned()
        self.t = t
        self.dtype = t.dtype
        self.device = torch.device("cuda", torch.cuda.current_device())

    def data_ptr(self) -> int:
        return self.t.data_ptr()


@triton.jit
def _sum_kernel(src, out, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    base = pid * BLOCK * ITERS
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src + offs, mask=offs < n, other=0.0)
    tl.store(out + pid, tl.sum(acc))


def read_all(src, n: int, out: torch.Tensor, block: int, iters: int) -> None:
    grid = (triton.cdiv(n, block * iters),)
    _sum_kernel[grid](src, out, n, BLOCK=block, ITERS=iters)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    args = ap.parse_args()
    n = args.mib * 2**20 // 4
    host = torch.empty(n, dtype=torch.float32, pin_memory=True)
    host.uniform_()
    dev = torch.empty(n, dtype=torch.float32, device="cuda")
    block, iters = 1024, 16
    out = torch.zeros(triton.cdiv(n, block * iters), device="cuda")
    view = HostView(host)
    read_all(view, n, out, block, iters)
    torch.cuda.synchronize()
    ok = torch.allclose(out.sum().cpu(), host.sum(), rtol=1e-3)

    def timed(fn, reps=5):
        best = float("inf")
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    gb = n * 4 / 1e9
    t_zero = timed(lambda: read_all(view, n, out, block, iters))
    t_copy = timed(lambda: dev.copy_(host, non_blocking=True))
    t_dev = timed(lambda: read_all(dev, n, out, block, iters))
    print(f"{args.mib} MiB, pinned host memory; sums agree: {ok}")
    print(f"zero-copy kernel read   {gb / t_zero:7.1f} GB/s")
    print(f"host->device copy       {gb / t_copy:7.1f} GB/s   (baseline)")
    print(f"kernel read, on device  {gb / t_dev:7.1f} GB/s")
    print(f"ratio zero-copy / copy  {t_copy / t_zero:7.2f}")
    # one expert-sized read (2.5 MB), the latency that matters for a miss
    small = 2_500_000 // 4
    t_small = timed(lambda: read_all(view, small, out, block, iters), reps=20)
    print(f"one 2.5 MB zero-copy read: {t_small * 1e6:.0f} us ({small * 4 / 1e9 / t_small:.1f} GB/s)")


if __name__ == "__main__":
    main()
