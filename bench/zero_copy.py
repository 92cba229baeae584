"""Can a Triton kernel read pinned host memory directly (zero-copy over
PCIe), without CuPy, and how fast? Baseline in the same process: copying
the same bytes host -> device with ``Tensor.copy_`` (pinned).

With unified addressing (every 64-bit CUDA platform), page-locked memory
from ``torch.empty(..., pin_memory=True)`` is mapped into the device's
address space at the same address; a thin wrapper that reports that address
as a CUDA pointer lets Triton load from it.

``--sweep``: the same reads from host buffers allocated three ways --
torch's pinned allocator, numpy memory registered with cudaHostRegister
(the engine's HostExperts), and an anonymous mapping advised to use
transparent huge pages (2 MiB) before it is registered -- over the whole
buffer and as one layer's expert-sized reads (8 x 2.5 MB at random
places), with several program shapes.

Usage: python bench/zero_copy.py [--mib 1024] [--sweep]
"""
from __future__ import annotations

import argparse
import mmap
import time
from pathlib import Path

import numpy as np

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


@triton.jit
def _sum_at_kernel(src, starts, out, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    # program (i, j): words [i * BLOCK * ITERS, +BLOCK * ITERS) of the j-th read of n words from starts[j]
    pid = tl.program_id(0)
    base = tl.load(starts + tl.program_id(1))
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = pid * BLOCK * ITERS + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src + base + offs, mask=offs < n, other=0.0)
    tl.atomic_add(out + tl.program_id(1), tl.sum(acc))


class _Registered:
    """A host buffer page-locked with cudaHostRegister (portable | mapped), as
    the engine's HostExperts; ``huge``: an anonymous mapping advised to use
    transparent huge pages, touched before it is registered."""

    def __init__(self, nbytes: int, huge: bool):
        if huge:
            self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.map.madvise(mmap.MADV_HUGEPAGE)
            self.np = np.frombuffer(self.map, dtype=np.float32)
        else:
            self.map = None
            self.np = np.empty(nbytes // 4, np.float32)
        self.np[:] = np.random.default_rng(0).random(self.np.size, dtype=np.float32)
        err = torch.cuda.cudart().cudaHostRegister(self.np.ctypes.data, self.np.nbytes, 3)
        assert int(getattr(err, "value", err)) == 0, err
        self.dtype = torch.float32

    def data_ptr(self) -> int:
        return self.np.ctypes.data

    def close(self) -> None:
        torch.cuda.cudart().cudaHostUnregister(self.np.ctypes.data)


def _best(fn, reps=10) -> float:
    """The shortest of ``reps`` timed calls of ``fn``, after one untimed call."""
    best = float("inf")
    fn()
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def sweep(mib: int) -> None:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(f"transparent huge pages: {thp.read_text().strip() if thp.exists() else 'unknown'}")
    n = mib * 2**20 // 4
    bufs = {"torch pinned": None, "registered": _Registered(n * 4, False), "registered, huge pages": _Registered(n * 4, True)}
    host = torch.empty(n, dtype=torch.float32, pin_memory=True)
    host.uniform_()
    bufs["torch pinned"] = HostView(host)
    expert_words = 2_506_752 // 4
    rng = np.random.default_rng(1)
    for name, src in bufs.items():
        for block, iters, warps in ((1024, 16, 4), (1024, 4, 4), (4096, 4, 8), (256, 4, 1), (2048, 8, 8)):
            out = torch.zeros(triton.cdiv(n, block * iters), device="cuda")
            t = _best(lambda: _sum_kernel[(triton.cdiv(n, block * iters),)](src, out, n, BLOCK=block, ITERS=iters,
                                                                             num_warps=warps), reps=3)
            starts = torch.tensor(rng.integers(0, n // expert_words - 1, 8) * expert_words, device="cuda")
            acc = torch.zeros(8, device="cuda")
            ts = _best(lambda: _sum_at_kernel[(triton.cdiv(expert_words, block * iters), 8)](
                src, starts, acc, expert_words, BLOCK=block, ITERS=iters, num_warps=warps), reps=20)
            print(f"{name:24s} block {block:5d} x {iters:2d}, {warps} warps: whole buffer {n * 4 / t / 1e9:6.1f} GB/s; "
                  f"8 experts of 2.5 MB {8 * expert_words * 4 / ts / 1e9:6.1f} GB/s ({ts * 1e6:.0f} us)", flush=True)
    for b in bufs.values():
        if isinstance(b, _Registered):
            b.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--sweep", action="store_true", help="allocations and program shapes (see the docstring)")
    args = ap.parse_args()
    if args.sweep:
        sweep(args.mib)
        return
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

    gb = n * 4 / 1e9
    t_zero = _best(lambda: read_all(view, n, out, block, iters), reps=5)
    t_copy = _best(lambda: dev.copy_(host, non_blocking=True), reps=5)
    t_dev = _best(lambda: read_all(dev, n, out, block, iters), reps=5)
    print(f"{args.mib} MiB, pinned host memory; sums agree: {ok}")
    print(f"zero-copy kernel read   {gb / t_zero:7.1f} GB/s")
    print(f"host->device copy       {gb / t_copy:7.1f} GB/s   (baseline)")
    print(f"kernel read, on device  {gb / t_dev:7.1f} GB/s")
    print(f"ratio zero-copy / copy  {t_copy / t_zero:7.2f}")
    # one expert-sized read (2.5 MB), the latency that matters for a miss
    small = 2_500_000 // 4
    t_small = _best(lambda: read_all(view, small, out, block, iters), reps=20)
    print(f"one 2.5 MB zero-copy read: {t_small * 1e6:.0f} us ({small * 4 / 1e9 / t_small:.1f} GB/s)")


if __name__ == "__main__":
    main()
