"""Peak memory and throughput of ``write_gguf`` on a multi-GB model.

Generates a source file of random bytes, writes a GGUF model whose tensors are
byte ranges of it (plain ranges and expert tensors assembled from slices in
shuffled order), and reports:

- the peak anonymous memory (``RssAnon`` in /proc/self/status, sampled every
  5 ms in a thread) above the baseline before writing: it must stay bounded
  by the writer's copy buffers, whatever the model size;
- the throughput of ``write_gguf`` (which also hashes every tensor and
  fsyncs) as a ratio to ``shutil.copyfile`` + fsync of the same bytes on the
  same disk, in the same process: medians of alternating runs.

Usage: python bench/writer_memory.py --size-gb 4 [--work-dir DIR] [--keep-dir]
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from fle_quant.ggml_types import GGMLType, tensor_nbytes
from fle_quant.gguf_format import GGUFValueType
from fle_quant.gguf_writer import ByteSource, WritePlan, write_gguf

from memwatch import PeakSampler, rss_anon_kb  # this folder's helper


def make_source(path: Path, n_bytes: int) -> None:
    rng = np.random.default_rng(0)
    chunk = 64 << 20
    with open(path, "wb") as f:
        left = n_bytes
        while left:
            n = min(chunk, left)
            f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            left -= n
        f.flush()
        os.fsync(f.fileno())


def make_plan(source: Path, n_bytes: int) -> WritePlan:
    """Per layer: three Q8_0 tensors [4096, 1024] (4.25 MiB each) and one IQ4_XS
    expert tensor [2048, 512, 64] (68 MiB) assembled from its 64 expert slices
    in shuffled order."""
    plan = WritePlan()
    plan.add_string("general.architecture", "llama")
    plan.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(32000)], GGUFValueType.STRING)
    dense_shape, dense_type = [4096, 1024], GGMLType.Q8_0
    exp_shape, exp_type = [2048, 512, 64], GGMLType.IQ4_XS
    dense = tensor_nbytes(dense_shape, dense_type)
    experts = tensor_nbytes(exp_shape, exp_type)
    one = experts // 64
    rnd = random.Random(0)
    offset, layer = 0, 0
    while True:
        if offset + experts + 3 * dense > n_bytes:
            break
        for kind in ("attn_q", "attn_k", "attn_v"):
            plan.add_tensor(f"blk.{layer}.{kind}.weight", dense_shape, dense_type, ByteSource(source, offset, dense))
            offset += dense
        order = list(range(64))
        rnd.shuffle(order)
        slices = [ByteSource(source, offset + e * one, one) for e in order]
        plan.add_tensor(f"blk.{layer}.ffn_down_exps.weight", exp_shape, exp_type, slices)
        offset += experts
        layer += 1
    return plan


def copy_with_fsync(src: Path, dst: Path) -> float:
    t0 = time.perf_counter()
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def settle(*paths: Path) -> None:
    for p in paths:
        p.unlink(missing_ok=True)
    os.sync()
    time.sleep(3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=4.0, help="model size in GB (10^9 bytes), default 4")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="where to put the files (default: a new temporary directory in the cwd)")
    ap.add_argument("--keep-dir", action="store_true", help="keep the source, copy and output files")
    ap.add_argument("--rounds", type=int, default=2, help="write/copy rounds (default 2)")
    ap.add_argument("--split-gb", type=float, default=None, help="also split the output into shards of this size")
    args = ap.parse_args()

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="fle-bench-", dir=Path.cwd()))
    work.mkdir(parents=True, exist_ok=True)
    n_bytes = int(args.size_gb * 1e9)
    source = work / "source.bin"
    try:
        print(f"generating {n_bytes / 1e9:.2f} GB of random bytes in {source} ...", flush=True)
        make_source(source, n_bytes)
        plan = make_plan(source, n_bytes)
        total = sum(t.n_bytes for t in plan.tensors)
        print(f"plan: {len(plan.tensors)} tensors, {total / 1e9:.2f} GB", flush=True)

        # the disk of a VM is noisy: alternate copies and writes, settle the
        # disk between runs (deletes issue discards), compare medians
        copy_times, write_times = [], []
        copy_times.append(copy_with_fsync(source, work / "copy.bin"))
        settle(work / "copy.bin")
        base_kb = rss_anon_kb()
        split = int(args.split_gb * 1e9) if args.split_gb else None
        with PeakSampler() as peak:
            for r in range(args.rounds):
                t0 = time.perf_counter()
                res = write_gguf(plan, work / "out.gguf", split_max_size=split, force=True, progress=False)
                write_times.append(time.perf_counter() - t0)
                if r < args.rounds - 1 or not args.keep_dir:
                    settle(*res.paths)
                copy_times.append(copy_with_fsync(source, work / "copy.bin"))
                if r < args.rounds - 1 or not args.keep_dir:
                    settle(work / "copy.bin")
        out_bytes = res.bytes_written
        w_rate = out_bytes / statistics.median(write_times) / 1e9
        c_rate = n_bytes / statistics.median(copy_times) / 1e9
        print(f"write_gguf ({len(res.paths)} file(s), SHA-256 of {len(res.sha256)} tensors, fsync): "
              f"{out_bytes / 1e9:.2f} GB in " + ", ".join(f"{t:.1f}" for t in write_times) +
              f" s; median {w_rate:.3f} GB/s")
        print(f"copyfile + fsync: {n_bytes / 1e9:.2f} GB in " + ", ".join(f"{t:.1f}" for t in copy_times) +
              f" s; median {c_rate:.3f} GB/s")
        print(f"throughput ratio write_gguf / copyfile (medians): {w_rate / c_rate:.2f}")
        print(f"RssAnon: baseline {base_kb / 1024:.1f} MiB, peak {peak.peak_kb / 1024:.1f} MiB, "
              f"peak above baseline {(peak.peak_kb - base_kb) / 1024:.1f} MiB")
    finally:
        if not args.keep_dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
