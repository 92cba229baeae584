"""Throughput and peak memory of ``fle-splice`` on a multi-GB factory model.

The factory quantizes at some tens of MB/s, too slow to make 4 GB models in
a benchmark, so the base and the donor are built in two steps:

1. ``make_model`` writes two *template* models of the same seed and shapes
   (``--template-layers`` layers, wide experts): the base's experts Q8_0,
   the donor's Q4_0, every other tensor Q8_0 (routers F32);
2. each template is expanded to ``--layers`` layers with ``write_gguf``:
   layer ``i`` is a byte-range copy of template layer ``i % T`` renamed to
   ``blk.i``, and ``block_count`` says so. The results are ordinary GGUF
   models (llama.cpp loads them) of the requested size.

Then, in this one process, with the digest cache in the work directory:

- a first splice (every other layer from the donor) with a cold digest
  cache: planning, hashing the inputs and writing, timed separately;
- alternating rounds of a plain copy of the base (``shutil.copyfile`` +
  fsync, same disk) and a splice with a warm digest cache (plan + cached
  digests + write, which fsyncs); the ratio is the median splice throughput
  (bytes of output per second) over the median copy throughput (bytes of the
  base per second);
- peak anonymous memory of the splice: ``RssAnon`` from /proc/self/status,
  sampled every 5 ms in a thread, minus its value just before the splice.

Usage: python bench/splice.py [--work-dir DIR] [--keep] [--layers 40] [--rounds 3]
With --keep the models stay in DIR and a later run with the same DIR reuses
them (and their cached digests, unless the cache file is removed).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from fle_quant.gguf_format import GGUFValueType
from fle_quant.gguf_reader import GGUFModel
from fle_quant.gguf_writer import ByteSource, WritePlan, write_gguf
from fle_quant.select import Selection
from fle_quant.splice import execute, fill_provenance, plan_splice
from fle_quant.synth import make_model

from memwatch import PeakSampler, rss_anon_kb  # this folder's helper

SHAPE = dict(embedding_length=1024, expert_feed_forward_length=512, expert_count=64, expert_used_count=8,
             attention_head_count=8, attention_head_count_kv=2, attention_key_length=128)


def expand(template: Path, out: Path, n_layers: int) -> Path:
    """``template`` with its layers repeated to ``n_layers`` (byte ranges, no decoding)."""
    with GGUFModel.open(template) as m:
        arch = m.arch
        t_layers = m.metadata[f"{arch}.block_count"]
        plan = WritePlan()
        plan.copy_metadata(m)
        plan.add(f"{arch}.block_count", n_layers, GGUFValueType.UINT32)
        per_layer = [[t for t in m.tensors.values() if t.name.startswith(f"blk.{il}.")] for il in range(t_layers)]
        glob = [t for t in m.tensors.values() if not t.name.startswith("blk.")]
        for t in glob[:1]:
            plan.add_tensor(t.name, t.shape, t.qtype, ByteSource(t.path, t.offset, t.n_bytes))
        for il in range(n_layers):
            src = per_layer[il % t_layers]
            for t in src:
                name = f"blk.{il}." + t.name.split(".", 2)[2]
                plan.add_tensor(name, t.shape, t.qtype, ByteSource(t.path, t.offset, t.n_bytes))
        for t in glob[1:]:
            plan.add_tensor(t.name, t.shape, t.qtype, ByteSource(t.path, t.offset, t.n_bytes))
    return write_gguf(plan, out, force=True, progress=False).paths[0]


def write_selection(path: Path, n_layers: int) -> Path:
    sources = {i: ("donor" if i % 2 else "base") for i in range(n_layers)}
    sel = Selection(mode="target", base="base", sources=sources, layer_errors={k: 0.0 for k in sources},
                    layer_bytes={k: 0 for k in sources}, predicted_error=0.0, size_bytes=0, fixed_bytes=0,
                    step_bytes=1, table_sha256="0" * 64, base_size_bytes=0, base_error=0.0, target_bytes=1)
    path.write_text(json.dumps(sel.to_json()))
    return path


def copy_with_fsync(src: Path, dst: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of copying ``src`` to ``dst``."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())
    return time.perf_counter() - t0, time.process_time() - c0


def settle(*paths: Path) -> None:
    for p in paths:
        p.unlink(missing_ok=True)
    os.sync()
    time.sleep(2)


def release_free_heap() -> None:
    """Give glibc's free heap back to the OS, so that the baseline is what is
    in use: a splice reusing freed but resident memory would look free."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def timed_splice(base: Path, donor: Path, sel: Path, out: Path) -> dict:
    """One splice through the library, phases timed, anonymous memory sampled."""
    gc.collect()
    release_free_heap()
    before = rss_anon_kb()
    with PeakSampler() as peak:
        c0 = time.process_time()
        t0 = time.perf_counter()
        plan = plan_splice(base, {"donor": donor}, sel, out, force=True)
        t1 = time.perf_counter()
        fill_provenance(plan, progress=False)
        t2 = time.perf_counter()
        result = execute(plan, force=True, progress=False)
        t3 = time.perf_counter()
        c3 = time.process_time()
    return {"plan_s": t1 - t0, "digest_s": t2 - t1, "write_s": t3 - t2, "total_s": t3 - t0, "cpu_s": c3 - c0,
            "bytes": result.bytes_written, "peak_anon_mb": (peak.peak_kb - before) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="where to put the models (default: a new temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the models (and reuse them when present)")
    ap.add_argument("--layers", type=int, default=40, help="layers of the base (default 40: about 4.3 GB)")
    ap.add_argument("--template-layers", type=int, default=2, help="distinct layers generated (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="copy/splice rounds (default 3)")
    args = ap.parse_args()

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="fle-bench-splice-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ["FLE_CACHE_DIR"] = str(work / "cache")
    base, donor = work / "base.gguf", work / "donor.gguf"
    out, copy = work / "out.gguf", work / "copy.gguf"
    try:
        if not (args.keep and base.exists() and donor.exists()):
            t0 = time.perf_counter()
            for path, exp_type in ((base, "Q8_0"), (donor, "Q4_0")):
                mix = [(r"\.ffn_gate_inp\.weight$", "F32"), (r"_exps\.weight$", exp_type), (r".", "Q8_0")]
                tpl = make_model(work / f"template-{path.name}", "qwen3moe", seed=0, mix=mix,
                                 block_count=args.template_layers, **SHAPE)
                expand(tpl, path, args.layers)
                tpl.unlink()
            print(f"built base {base.stat().st_size / 1e9:.2f} GB and donor {donor.stat().st_size / 1e9:.2f} GB "
                  f"in {time.perf_counter() - t0:.1f} s", flush=True)
        else:
            print(f"reusing {base} and {donor}", flush=True)
        sel = write_selection(work / "sel.json", args.layers)
        base_size = base.stat().st_size

        settle(out, copy)
        (work / "cache" / "digests.json").unlink(missing_ok=True)
        cold = timed_splice(base, donor, sel, out)
        print(f"first splice: plan {cold['plan_s']:.2f} s, digests {cold['digest_s']:.2f} s, "
              f"write {cold['write_s']:.2f} s, {cold['bytes'] / 1e9:.2f} GB out, {cold['cpu_s']:.1f} s CPU, "
              f"peak anon +{cold['peak_anon_mb']:.1f} MB", flush=True)

        copies, splices = [], []
        for r in range(args.rounds):
            settle(out, copy)
            wall, cpu = copy_with_fsync(base, copy)
            copies.append(wall)
            settle(out, copy)
            splices.append(timed_splice(base, donor, sel, out))
            s = splices[-1]
            print(f"round {r + 1}: copy {base_size / wall / 1e9:.2f} GB/s ({cpu:.1f} s CPU); splice (warm "
                  f"digests) {s['bytes'] / s['total_s'] / 1e9:.2f} GB/s (plan {s['plan_s']:.2f} s, digests "
                  f"{s['digest_s']:.2f} s, write {s['write_s']:.2f} s; {s['cpu_s']:.1f} s CPU), "
                  f"peak anon +{s['peak_anon_mb']:.1f} MB", flush=True)
        copy_rate = base_size / statistics.median(copies)
        warm_rate = statistics.median(s["bytes"] / s["total_s"] for s in splices)
        cold_rate = cold["bytes"] / cold["total_s"]
        peak = max([cold["peak_anon_mb"]] + [s["peak_anon_mb"] for s in splices])
        print()
        print(f"base {base_size:,} bytes, output {cold['bytes']:,} bytes")
        print(f"copy (copyfile + fsync), median:  {copy_rate / 1e9:.3f} GB/s")
        print(f"splice, warm digest cache, median: {warm_rate / 1e9:.3f} GB/s  ratio {warm_rate / copy_rate:.2f}"
              f"  (goal >= 0.8)")
        print(f"splice, cold digest cache (first): {cold_rate / 1e9:.3f} GB/s  ratio {cold_rate / copy_rate:.2f}"
              f"  (hashing {base_size + donor.stat().st_size:,} input bytes: {cold['digest_s']:.1f} s)")
        print(f"peak anonymous memory of a splice: +{peak:.1f} MB  (goal < 256 MB)")
    finally:
        for p in (out, copy):
            p.unlink(missing_ok=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
