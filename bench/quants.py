"""Throughput of FLE's dequantizers (and quantizers) against gguf-py and
ggml, printed as a markdown table for docs/benchmarks.md.

Every row decodes the same blocks with each implementation: FLE on one
numba thread and on all of them, gguf-py (numpy), and ggml's ``to_float``
(single-threaded C, through llama-cpp-python). Speeds are millions of
output values per second, best of ``--repeat`` runs taken round-robin so
that all implementations see the same machine load. The first columns
include allocating the output, as a caller sees it; for outputs this large
the kernel's page faulting of fresh memory is a large, equal share of
every implementation's time. The "into buffer" columns decode into an
already-touched buffer and so time the decoding alone. Blocks are random
bytes with typical fp16 scales (random normal values times 0.02), so no
implementation meets NaN or subnormal arithmetic.

    python bench/quants.py [--types Q8_0,IQ4_XS] [--mvalues 16] [--repeat 3]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from importlib import metadata

import numpy as np


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _best_interleaved(fns: dict, repeat: int) -> dict:
    """Best time of each callable, running them round-robin so that all
    of them see the same machine load."""
    best = {k: float("inf") for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def _ggml_to_float_into(qtype):
    """ggml's to_float writing into a caller's buffer (``ggml_ref.dequantize``
    always allocates), to time the decoding without the page faults of a
    fresh 64 MiB output."""
    import ctypes

    from fle_quant import ggml_ref

    traits = ggml_ref._lib().ggml_get_type_traits(int(qtype)).contents
    if not traits.to_float:
        return None
    fn = ggml_ref._TO_FLOAT(traits.to_float)

    def run(blocks: np.ndarray, out: np.ndarray) -> None:
        fn(blocks.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), out.size)

    return run


def bench_blocks(qtype, n_values: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of ``qtype`` holding about ``n_values`` values, with
    typical (finite, normal) fp16 scales."""
    from fle_quant.ggml_types import BLOCK_GEOMETRY, GGMLType
    from fle_quant.quants.dequant import FP16_SCALE_OFFSETS

    values, size = BLOCK_GEOMETRY[qtype]
    n = max(1, n_values // values)

    def scales() -> np.ndarray:
        return (rng.standard_normal(n) * 0.02).astype(np.float16).view(np.uint16)

    if qtype == GGMLType.F32:
        return rng.standard_normal(n).astype(np.float32).view(np.uint8).reshape(n, 4)
    if qtype == GGMLType.F16:
        return rng.standard_normal(n).astype(np.float16).view(np.uint8).reshape(n, 2)
    if qtype == GGMLType.BF16:
        return (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(
            np.uint8).reshape(n, 2)
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for off in FP16_SCALE_OFFSETS.get(qtype, ()):
        blocks[:, off:off + 2] = scales().view(np.uint8).reshape(n, 2)
    if qtype == GGMLType.IQ1_M:
        h = scales()
        for k in range(4):
            blocks[:, 49 + 2 * k] = (blocks[:, 49 + 2 * k] & 0x0F) | (((h >> (4 * k)) & 0xF).astype(np.uint8) << 4)
    if qtype == GGMLType.MXFP4:
        blocks[:, 0] = rng.integers(110, 130, n, dtype=np.uint8)  # E8M0 exponents near 1
    if qtype == GGMLType.NVFP4:
        blocks[:, :4] = rng.integers(0x08, 0x7F, (n, 4), dtype=np.uint8)  # normal UE4M3 scales
    return blocks


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    b = b.reshape(a.shape)
    return bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))))


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", help="comma-separated ggml type names (default: every type FLE decodes)")
    ap.add_argument("--mvalues", type=float, default=16.0,
                    help="millions of values (2**20) decoded per type (default 16, i.e. 64 MiB of float32)")
    ap.add_argument("--quant-mvalues", type=float, default=4.0,
                    help="millions of values quantized per type (default 4)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; the best counts (default 3)")
    ap.add_argument("--no-gguf", action="store_true", help="skip gguf-py (the slowest column)")
    args = ap.parse_args(argv)

    import gguf
    import gguf.quants as gq
    import numba

    from fle_quant import ggml_ref
    from fle_quant.errors import FleError
    from fle_quant.ggml_types import BLOCK_GEOMETRY, GGMLType, parse_type
    from fle_quant.quants.dequant import DEQUANTIZERS

    try:
        types = [parse_type(t) for t in args.types.split(",")] if args.types else list(DEQUANTIZERS)
    except FleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    unknown = [t.name for t in types if t not in DEQUANTIZERS]
    if unknown:
        print(f"error: FLE cannot dequantize {', '.join(unknown)}", file=sys.stderr)
        return 2

    have_ggml = ggml_ref.available()
    n_threads = numba.config.NUMBA_NUM_THREADS
    n_values = int(args.mvalues * 2**20)
    rng = np.random.default_rng(0)

    print(f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. "
          f"Machine: {_cpu_model()}, {os.cpu_count()} logical cores. "
          f"Python {platform.python_version()}, numpy {np.__version__}, numba {numba.__version__}, "
          f"gguf {_version('gguf')}, llama-cpp-python {_version('llama_cpp_python')}"
          f"{'' if have_ggml else ' (ggml columns empty)'}.")
    print(f"Dequantize: {args.mvalues:g} Mi values per type, best of {args.repeat}; Mvalues/s.")
    print()
    print(f"| type | FLE 1 thread | FLE {n_threads} threads | gguf-py | ggml 1 thread | FLE-1 / ggml "
          "| FLE 1 thread, into buffer | ggml, into buffer | FLE-1 / ggml, into buffer | bit-exact vs ggml |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for qtype in types:
        fn = DEQUANTIZERS[qtype]
        blocks = bench_blocks(qtype, n_values, rng)
        nv = blocks.shape[0] * BLOCK_GEOMETRY[qtype][0]
        buf = np.zeros((blocks.shape[0], BLOCK_GEOMETRY[qtype][0]), np.float32)
        fn(blocks[:4])  # compile (or load from cache) outside the timing

        # The one-thread columns are timed together, round-robin; the
        # all-threads column after them: switching numba's thread count
        # between calls slows the next one-thread call.
        numba.set_num_threads(1)
        fns = {"fle1": lambda: fn(blocks), "fle1_buf": lambda: fn(blocks, buf)}
        ggml_into = _ggml_to_float_into(qtype) if have_ggml else None
        if ggml_into is not None:
            fns["ggml"] = lambda: ggml_ref.dequantize(blocks, qtype)
            fns["ggml_buf"] = lambda: ggml_into(blocks, buf)
        best = _best_interleaved(fns, args.repeat)
        numba.set_num_threads(n_threads)
        best["flen"] = _best(lambda: fn(blocks), args.repeat)
        speed = {k: nv / t / 1e6 for k, t in best.items()}
        gpy = None
        gtype = getattr(gguf.GGMLQuantizationType, qtype.name, None)
        if qtype == GGMLType.F32:
            gtype = None  # gguf-py returns a view of the bytes: nothing to time
        if not args.no_gguf and gtype is not None:
            try:
                # gguf-py works in groups of 16 rows: give it tensor-like rows
                # of 4096 values, not one block per row.
                rows = blocks.reshape(-1, blocks.shape[1] * max(1, 4096 // BLOCK_GEOMETRY[qtype][0])) \
                    if blocks.shape[0] % max(1, 4096 // BLOCK_GEOMETRY[qtype][0]) == 0 else blocks.reshape(1, -1)
                with np.errstate(all="ignore"):
                    gpy = nv / _best(lambda: gq.dequantize(rows, gtype), min(args.repeat, 2)) / 1e6
            except NotImplementedError:
                gpy = None
        same = _same(fn(blocks), ggml_ref.dequantize(blocks, qtype)) if ggml_into is not None else None
        ggml, ggml_buf = speed.get("ggml"), speed.get("ggml_buf")
        ratio = f"{speed['fle1'] / ggml:.2f}" if ggml else "-"
        ratio_buf = f"{speed['fle1_buf'] / ggml_buf:.2f}" if ggml_buf else "-"
        exact = "-" if same is None else ("yes" if same else "NO")
        print(f"| {qtype.name} | {_fmt(speed['fle1'])} | {_fmt(speed['flen'])} | {_fmt(gpy)} | {_fmt(ggml)} | {ratio} "
              f"| {_fmt(speed['fle1_buf'])} | {_fmt(ggml_buf)} | {ratio_buf} | {exact} |", flush=True)
        del blocks, buf

    try:
        from fle_quant.quants.quantize import QUANTIZERS
    except ImportError:
        QUANTIZERS = {}
    qtypes = [t for t in types if t in QUANTIZERS] if args.types else list(QUANTIZERS)
    if not qtypes:
        return 0
    print()
    print(f"Quantize: {args.quant_mvalues:g} Mi values per type in rows of 4096, best of {args.repeat}; "
          "Mvalues/s; importance matrix given where ggml requires one.")
    print()
    print("| type | FLE 1 thread | ggml 1 thread | FLE-1 / ggml | bytes equal to ggml |")
    print("|---|---:|---:|---:|---|")
    n_per_row = 4096
    n_rows = max(1, int(args.quant_mvalues * 2**20) // n_per_row)
    x = rng.standard_normal((n_rows, n_per_row)).astype(np.float32)
    for qtype in qtypes:
        fn = QUANTIZERS[qtype]
        need_im = have_ggml and ggml_ref.requires_imatrix(qtype)
        imatrix = (rng.random(n_per_row).astype(np.float32) + 0.1) if need_im else None
        fn(x[:1], imatrix)

        numba.set_num_threads(1)
        fns = {"fle1": lambda: fn(x, imatrix)}
        if have_ggml:
            fns["ggml"] = lambda: ggml_ref.quantize(x, qtype, imatrix)
        best = _best_interleaved(fns, args.repeat)
        numba.set_num_threads(n_threads)
        fle = x.size / best["fle1"] / 1e6
        ggml = x.size / best["ggml"] / 1e6 if have_ggml else None
        same = bool(np.array_equal(fn(x, imatrix), ggml_ref.quantize(x, qtype, imatrix))) if have_ggml else None
        ratio = f"{fle / ggml:.2f}" if ggml else "-"
        print(f"| {qtype.name} | {_fmt(fle)} | {_fmt(ggml)} | {ratio} | "
              f"{'-' if same is None else ('yes' if same else 'NO')} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
