"""The engine's expert and dense kernels at T = 1 against the machine's
ceilings: HBM bandwidth (a device-to-device copy) for experts in cache slots
and dense matrices, and the pinned host -> device copy bandwidth for missed
experts read over PCIe. Sweeps the expert kernels' launch configurations.

    python3 bench/engine_kernels.py [--sweep]

Shapes: the Qwen3-30B-A3B layer (IQ4_XS experts 768 x 2048 gate/up and
2048 x 768 down, 8 per token; Q8_0 qkv 5120 x 2048, wo 2048 x 4096,
output 151936 x 2048). Each timed graph runs 16 layers' worth of calls on
distinct experts so that nothing is served from L2.

Two times per launch: the replayed graph's time per layer (the kernels
and the gaps between them, as in the decode step), and, with --cuda, the
kernels' own time on the device ("busy": CUPTI's kernel records through
torch's profiler, the union of their intervals, as a profiler's achieved
bandwidth counts it), so that a kernel's bandwidth and the cost of
launching it are told apart.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _time_graph(fn, reps: int = 20) -> float:
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return best


def busy_intervals(spans) -> float:
    """Length of the union of (start, end) intervals: the time the device runs at least one of
    them (kernels that overlap, as with programmatic dependent launch, are counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _busy_time(fn, reps: int = 10) -> float | None:
    """Seconds per call of ``fn`` that the device spends inside the kernels it launches (eager
    calls, CUPTI's records through torch's profiler), without the gaps between launches that
    :func:`_time_graph` includes. None where the profiler gives no device records."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    us = busy_intervals(spans)
    return us / reps / 1e6 if us > 0 else None


def ceilings() -> dict:
    import torch

    n = 1 << 30
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = _time_graph(lambda: y.copy_(x))
    h = torch.empty(n, dtype=torch.uint8).pin_memory()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        a.record()
        x.copy_(h, non_blocking=True)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return {"hbm_copy_GBps": 2 * n / t / 1e9, "pinned_h2d_GBps": n / best / 1e9}


def expert_bench(configs, n_expert=128, n_ff=768, n_embd=2048, k=8, groups=16) -> list[dict]:
    import torch

    from fle_engine.kernels import triton_engine as te
    from fle_engine.kernels import triton_quant as _tq
    from fle_engine.runtime.weights import ExpertLayout
    from fle_quant.ggml_types import GGMLType

    qt = GGMLType.IQ4_XS
    fast_default, paired_default, decode_default = _tq.FAST_DECODE, dict(te.PAIRED), dict(te.IQ4_DECODE)
    lay = ExpertLayout(n_ff, n_embd, qt, n_embd // 256 * 136, qt, n_ff // 256 * 136)
    eb = lay.expert_bytes
    rng = np.random.default_rng(0)
    host_np = rng.integers(0, 256, size=(n_expert, eb), dtype=np.uint8)
    host = torch.from_numpy(host_np)        # random bytes: timing does not depend on the values
    err = torch.cuda.cudart().cudaHostRegister(host_np.ctypes.data, host_np.nbytes, 3)
    assert int(getattr(err, "value", err)) == 0, err
    slots = host.cuda()
    words = slots.view(-1).view(torch.int32)
    delta = (host_np.ctypes.data - words.data_ptr()) // 4
    ids = [torch.tensor(rng.permutation(n_expert)[:k], dtype=torch.int64, device="cuda") for _ in range(groups)]
    x = torch.randn(1, n_embd, device="cuda") * 0.1
    h = torch.zeros(k, n_ff, device="cuda")
    y = torch.zeros(k, n_embd, device="cuda")
    w = torch.full((k,), 0.125, device="cuda")
    hit_map = torch.arange(n_expert, dtype=torch.int32, device="cuda")
    miss_map = torch.full((n_expert,), -1, dtype=torch.int32, device="cuda")
    out = []
    bytes_layer = k * eb
    for item in configs:
        cfg, fast = item[0], item[1]
        pdl = len(item) > 2 and item[2]
        os.environ["FLE_EXPERT_CONFIG"] = ",".join(str(c) for c in cfg)
        os.environ["FLE_PDL"] = "1" if pdl else "0"
        _tq.FAST_DECODE = fast in ("fast", "paired", "table")
        te.PAIRED = {"hit": fast == "paired", "miss": fast == "paired"}
        dec = "table" if fast == "table" else "permute"
        te.IQ4_DECODE = {"hit": dec, "miss": dec}
        row = {"config": cfg, "decode": fast, "pdl": bool(pdl)}
        for name, smap in (("hit", hit_map), ("miss", miss_map)):
            def fn(smap=smap):
                for g in range(groups):
                    te.experts(words, qt, delta, 0, eb // 4, n_ff, lay.gu_row_bytes, smap, ids[g], x, h, True, k)
                    te.experts(words, qt, delta, lay.down_offset // 4, eb // 4, n_embd, lay.down_row_bytes, smap,
                               ids[g], h, y, False, k, w)
            t = _time_graph(fn) / groups
            row[name + "_us"] = t * 1e6
            row[name + "_GBps"] = bytes_layer / t / 1e9
            if name == "hit":                    # the kernels' own time, without the gaps between launches
                busy = _busy_time(lambda: [layer(impl, smap, g, mode) for g in range(groups)])
                if busy is not None:
                    row["hit_busy_us"] = busy / groups * 1e6
                    row["hit_busy_GBps"] = bytes_layer * groups / busy / 1e9
        out.append(row)
        print(row, flush=True)
    os.environ.pop("FLE_EXPERT_CONFIG", None)
    os.environ.pop("FLE_PDL", None)
    _tq.FAST_DECODE, te.PAIRED, te.IQ4_DECODE = fast_default, paired_default, decode_default
    torch.cuda.cudart().cudaHostUnregister(host_np.ctypes.data)
    return out


_READ = []


def _read_kernel():
    """A kernel that only reads: program (i, e) sums words [i * BLOCK * STEPS, +BLOCK * STEPS) of the
    ``n_words`` from ``base_ptr[e]`` into ``out_ptr[e]`` (built on first use)."""
    if not _READ:
        import triton
        import triton.language as tl

        @triton.jit
        def _read(w_ptr, base_ptr, out_ptr, n_words, BLOCK: tl.constexpr, STEPS: tl.constexpr):
            e = tl.program_id(1)
            base = tl.load(base_ptr + e)
            offs = tl.program_id(0) * (BLOCK * STEPS) + tl.arange(0, BLOCK)
            acc = tl.zeros([BLOCK], dtype=tl.int32)
            for i in range(STEPS):
                o = offs + i * BLOCK
                acc += tl.load(w_ptr + base + o, mask=o < n_words, other=0)
            tl.atomic_add(out_ptr + e, tl.sum(acc, axis=0))

        _READ.append(_read)
    return _READ[0]


def read_ceiling(n_expert=128, expert_bytes=2_506_752, k=8, groups=16) -> dict:
    """What a kernel that only reads the bytes reaches at this size: per layer, the gate+up
    part (2/3) and then the down part (1/3) of 8 experts, summed by 1024-word programs, in
    two launches, 16 layers per timed graph."""
    import torch
    import triton

    _read = _read_kernel()
    words = torch.randint(0, 1 << 30, (n_expert * expert_bytes // 4,), dtype=torch.int32, device="cuda")
    ew = expert_bytes // 4
    gu_words, dn_words = ew * 2 // 3, ew - ew * 2 // 3
    rng = np.random.default_rng(1)
    bases = [torch.tensor(rng.permutation(n_expert)[:k] * ew, dtype=torch.int64, device="cuda") for _ in range(groups)]
    out = torch.zeros(k, dtype=torch.int32, device="cuda")
    block, steps = 1024, 4

    def fn():
        for g in range(groups):
            _read[(triton.cdiv(gu_words, block * steps), k)](words, bases[g], out, gu_words, BLOCK=block, STEPS=steps,
                                                              num_warps=4)
            _read[(triton.cdiv(dn_words, block * steps), k)](words, bases[g] + gu_words, out, dn_words, BLOCK=block,
                                                              STEPS=steps, num_warps=4)
    t = _time_graph(fn) / groups
    res = {"us": t * 1e6, "GBps": k * expert_bytes / t / 1e9}
    busy = _busy_time(fn)
    if busy is not None:
        res.update(busy_us=busy / groups * 1e6, busy_GBps=k * expert_bytes * groups / busy / 1e9)
    return res


def miss_count_bench(n_expert=128, n_ff=768, n_embd=2048, k=8, groups=16, counts=(0, 1, 2, 3, 4, 8),
                     tokens=(1, 3)) -> list[dict]:
    """A layer's expert launches (gate+up, then down) with m of each token's k experts missed,
    at the engine's default configuration: the T = 1 launch (``experts``) and the T-token union
    launch (``experts_union``, T tokens routed to distinct experts), 16 layers per timed graph.
    Beside each, a kernel that only reads the same missed bytes over PCIe (1024-word programs):
    the cost a missed expert adds to a layer, against what reading it alone costs."""
    import torch
    import triton

    from fle_engine.kernels import triton_engine as te
    from fle_engine.runtime.weights import ExpertLayout
    from fle_quant.ggml_types import GGMLType

    _read = _read_kernel()
    qt = GGMLType.IQ4_XS
    lay = ExpertLayout(n_ff, n_embd, qt, n_embd // 256 * 136, qt, n_ff // 256 * 136)
    eb = lay.expert_bytes
    from fle_engine.runtime.weights import host_buffer, huge_pages

    rng = np.random.default_rng(0)
    host_np = host_buffer(n_expert * eb, huge=huge_pages()).reshape(n_expert, eb)    # as the engine's buffer
    host_np[:] = rng.integers(0, 256, size=(n_expert, eb), dtype=np.uint8)
    host_np.view(np.uint16)[:, ::68] = 0x1400            # small scales: finite sums
    err = torch.cuda.cudart().cudaHostRegister(host_np.ctypes.data, host_np.nbytes, 3)
    assert int(getattr(err, "value", err)) == 0, err
    slots = torch.from_numpy(host_np).cuda()
    words = slots.view(-1).view(torch.int32)
    delta = (host_np.ctypes.data - words.data_ptr()) // 4

    class _Host:
        dtype = torch.int32

        def data_ptr(self):
            return host_np.ctypes.data

    out = []
    for T in tokens:
        ids = [torch.tensor(rng.permutation(n_expert)[:T * k], dtype=torch.int64, device="cuda")
               for _ in range(groups)]
        x = torch.randn(T, n_embd, device="cuda") * 0.1
        h = torch.zeros(T * k, n_ff, device="cuda")
        y = torch.zeros(T * k, n_embd, device="cuda")
        w = torch.full((T * k,), 0.125, device="cuda")
        for m in counts:
            if m > k:
                continue
            maps = []
            for g in range(groups):           # the first m experts of each token missed, the rest in slots
                smap = torch.arange(n_expert, dtype=torch.int32, device="cuda")
                gi = ids[g].view(T, k)
                smap[gi[:, :m].reshape(-1)] = -1
                maps.append(smap)

            def fn():
                for g in range(groups):
                    if T == 1:
                        te.experts(words, qt, delta, 0, eb // 4, n_ff, lay.gu_row_bytes, maps[g], ids[g], x, h, True,
                                   k)
                        te.experts(words, qt, delta, lay.down_offset // 4, eb // 4, n_embd, lay.down_row_bytes,
                                   maps[g], ids[g], h, y, False, k, w)
                    else:
                        te.experts_union(words, qt, delta, 0, eb // 4, n_ff, lay.gu_row_bytes, maps[g], ids[g], x,
                                         h, True, k)
                        te.experts_union(words, qt, delta, lay.down_offset // 4, eb // 4, n_embd,
                                         lay.down_row_bytes, maps[g], ids[g], h, y, False, k, w)
            t = _time_graph(fn) / groups
            row = {"T": T, "missed_per_token": m, "missed": T * m, "us": t * 1e6}
            if m:
                bases = [ids[g].view(T, k)[:, :m].reshape(-1) * (eb // 4) for g in range(groups)]
                acc = torch.zeros(T * m, dtype=torch.int32, device="cuda")
                ew = eb // 4
                gu_words = lay.down_offset // 4

                def rd():
                    for g in range(groups):
                        _read[(triton.cdiv(gu_words, 4096), T * m)](_Host(), bases[g], acc, gu_words, BLOCK=1024,
                                                                     STEPS=4, num_warps=4)
                        _read[(triton.cdiv(ew - gu_words, 4096), T * m)](_Host(), bases[g] + gu_words, acc,
                                                                          ew - gu_words, BLOCK=1024, STEPS=4,
                                                                          num_warps=4)
                tr = _time_graph(rd) / groups
                row["read_only_us"] = tr * 1e6
                row["read_only_GBps"] = T * m * eb / tr / 1e9
            out.append(row)
            print(row, flush=True)
    # one missed expert read alone by program shapes: (words per load, loads per program, warps), in one launch
    # for the whole expert or in two (gate+up, then down) as the expert launches read it
    ew = eb // 4
    gu_words = lay.down_offset // 4
    acc = torch.zeros(1, dtype=torch.int32, device="cuda")
    for block, steps, warps in ((1024, 4, 4), (1024, 1, 4), (256, 1, 1), (256, 4, 1), (4096, 1, 8), (512, 2, 2),
                                (2048, 2, 4)):
        for parts in (1, 2):
            bases = [torch.tensor([int(rng.integers(n_expert)) * ew], device="cuda") for _ in range(groups)]

            def rd():
                for g in range(groups):
                    if parts == 1:
                        _read[(triton.cdiv(ew, block * steps), 1)](_Host(), bases[g], acc, ew, BLOCK=block,
                                                                     STEPS=steps, num_warps=warps)
                    else:
                        _read[(triton.cdiv(gu_words, block * steps), 1)](_Host(), bases[g], acc, gu_words,
                                                                           BLOCK=block, STEPS=steps, num_warps=warps)
                        _read[(triton.cdiv(ew - gu_words, block * steps), 1)](_Host(), bases[g] + gu_words, acc,
                                                                                ew - gu_words, BLOCK=block,
                                                                                STEPS=steps, num_warps=warps)
            tr = _time_graph(rd) / groups
            row = {"read_one_expert": [block, steps, warps], "launches": parts, "us": tr * 1e6,
                   "GBps": eb / tr / 1e9}
            out.append(row)
            print(row, flush=True)
    torch.cuda.cudart().cudaHostUnregister(host_np.ctypes.data)
    return out


def _q8_0_matrices(n_out: int, n_in: int, count: int) -> list:
    """``count`` Q8_0 matrices on the GPU: random quants, every block's scale ~0.001."""
    import torch

    mats = [torch.randint(0, 256, (n_out, n_in // 32 * 34), dtype=torch.uint8, device="cuda") for _ in range(count)]
    for m in mats:
        m.view(-1, 34)[:, :2] = torch.tensor([0x00, 0x14], dtype=torch.uint8, device="cuda")   # d = ~0.001
    return mats


def dense_bench(explore: bool = False) -> list[dict]:
    import torch

    from fle_engine.kernels import triton_quant
    from fle_engine.runtime.weights import _dense_config
    from fle_quant.ggml_types import GGMLType

    rows = []
    for name, n_out, n_in, reps in (("qkv", 5120, 2048, 16), ("wo", 2048, 4096, 16), ("output", 151936, 2048, 1)):
        mats = _q8_0_matrices(n_out, n_in, reps)
        x = torch.randn(1, n_in, device="cuda")
        y = torch.zeros(1, n_out, device="cuda")
        fast_default = triton_quant.FAST_DECODE
        for fast in [fast_default] + ([False] if fast_default else []):
            triton_quant.FAST_DECODE = fast
            eng = _dense_config(n_out, 1)
            launches = [("engine", eng), ("16-row", None)]
            if explore and fast:
                for bn, warps in sorted({(eng.block_n, eng.num_warps), (4, 2), (8, 4), (16, 4)}):
                    for chunks in (1, 2, 4, 8):
                        for pdl in (False, True):
                            launches.append((f"{bn},{warps},chunks {chunks}{', pdl' if pdl else ''}",
                                             triton_quant.Config(bn, warps, 1, chunks=chunks, pdl=pdl)))
            for launch, cfg in launches:
                t = _time_graph(lambda: [triton_quant.mul_mat(m, GGMLType.Q8_0, x, out=y, config=cfg)
                                         for m in mats]) / reps
                rows.append({"matrix": name, "launch": launch, "decode": "fast" if fast else "plain",
                             "us": t * 1e6, "GBps": mats[0].numel() / t / 1e9})
                print(rows[-1], flush=True)
        triton_quant.FAST_DECODE = fast_default
    return rows


def cuda_bench(n_expert=128, n_ff=768, n_embd=2048, k=8, groups=16) -> dict:
    """The CUDA C kernels (fle_engine.kernels.cuda_mv) against Triton's in one process: one
    30B-A3B layer's expert launches (gate+up, then down, or both in one launch: "fused") with
    every expert in a slot ("hit"),
    one of the 8 read over PCIe ("one miss", about the calibrated skew's 0.74 per layer), and
    all 8 ("miss"), per launch shape; then the Q8_0 dense products. Outputs are compared with
    Triton's on the same sane random blocks (scales ~0.001) before timing."""
    import torch

    from fle_engine.kernels import cuda_mv
    from fle_engine.kernels import triton_engine as te
    from fle_engine.kernels import triton_quant
    from fle_engine.runtime.weights import ExpertLayout, _dense_config
    from fle_quant.ggml_types import GGMLType

    os.environ["FLE_CUDA_MV"] = "1"               # on, whatever the default
    qt = GGMLType.IQ4_XS
    lay = ExpertLayout(n_ff, n_embd, qt, n_embd // 256 * 136, qt, n_ff // 256 * 136)
    eb = lay.expert_bytes
    rng = np.random.default_rng(0)
    host = torch.from_numpy(rng.integers(0, 256, size=(n_expert, eb), dtype=np.uint8))
    host.view(n_expert, eb // 136, 136)[:, :, :2] = torch.tensor([0x00, 0x14], dtype=torch.uint8)   # d ~0.001
    host = host.pin_memory()
    slots = host.cuda()
    words = slots.view(-1).view(torch.int32)
    delta = (host.data_ptr() - words.data_ptr()) // 4
    ids = [torch.tensor(rng.permutation(n_expert)[:k], dtype=torch.int64, device="cuda") for _ in range(groups)]
    x = torch.randn(1, n_embd, device="cuda") * 0.1
    h = torch.zeros(k, n_ff, device="cuda")
    y = torch.zeros(k, n_embd, device="cuda")
    w = torch.full((k,), 0.125, device="cuda")
    maps = {"hit": torch.arange(n_expert, dtype=torch.int32, device="cuda"),
            "miss": torch.full((n_expert,), -1, dtype=torch.int32, device="cuda")}
    one = maps["hit"].clone()
    for g in range(groups):
        one[ids[g][0]] = -1                      # the first expert of each layer's 8 is missed
    maps["one miss"] = one

    def gate_up(impl, smap, g, mode):
        impl.experts(words, qt, delta, 0, eb // 4, n_ff, lay.gu_row_bytes, smap, ids[g], x, h, True, k, mode=mode)

    def down(impl, smap, g, mode):
        impl.experts(words, qt, delta, lay.down_offset // 4, eb // 4, n_embd, lay.down_row_bytes, smap, ids[g], h, y,
                     False, k, w, mode=mode)

    def layer(impl, smap, g, mode):
        if impl == "fused":                      # gate+up and down in one launch (FLE_CUDA_MV_FFN's shape)
            cuda_mv.experts_ffn(words, qt, delta, lay.down_offset // 4, eb // 4, n_ff, n_embd, lay.gu_row_bytes,
                                lay.down_row_bytes, smap, ids[g], x, h, y, k, w, mode=mode)
            return
        gate_up(impl, smap, g, mode)
        down(impl, smap, g, mode)

    res = {"experts": [], "dense": []}
    # agreement with Triton's kernels, per map
    os.environ["FLE_CUDA_MV_FFN"] = "2,4,4,1"
    for name, smap in maps.items():
        layer(te, smap, 0, "miss")
        ref = y.clone()
        for impl, label in ((cuda_mv, "CUDA C"), ("fused", "CUDA C, one launch")):
            y.zero_()
            layer(impl, smap, 0, "miss")
            err = float((y - ref).abs().max() / ref.abs().max())
            res.setdefault("max_rel_diff", {})[f"{name}, {label}"] = err
            print(f"experts, {name}: {label} against Triton, max difference {err:.2e} of the largest output",
                  flush=True)
    bytes_layer = k * eb
    # (shape, row iterations loaded first "gu,down,dense", programmatic dependent launch); the shapes
    # and loads-first variants of two launches measured on 2026-12-06/07 (docs/benchmarks.md) are
    # kept to the best few
    configs = [("triton", None, None, "0")] + [("cuda", c, "0,0,0", "0") for c in (
        "1,4,2,4", "2,4,4,4", "4,4,8,4", "2,2,4,2")]
    configs += [("cuda", "2,4,4,4", "2,1,0", "1")]
    # one launch: gu rows, down rows, warps, down loads-first
    configs += [("fused", c, None, "0") for c in ("2,4,4,0", "2,4,4,1", "2,4,4,2", "2,8,4,1", "2,8,4,2",
                                                  "4,8,4,1", "2,4,8,1", "2,4,2,1", "4,8,2,1")]
    configs += [("fused", c, None, "1") for c in ("2,4,4,1", "2,8,4,1")]
    for impl_name, cfg, pre, pdl in configs:
        if impl_name == "fused":
            os.environ["FLE_CUDA_MV_FFN"] = cfg
        elif cfg:
            os.environ["FLE_CUDA_MV_CONFIG"] = cfg
            os.environ["FLE_CUDA_MV_PRE"] = pre
        os.environ["FLE_PDL"] = pdl
        impl = "fused" if impl_name == "fused" else cuda_mv if cfg else te
        row = {"impl": impl_name, "config": cfg or "defaults", "pre": pre, "pdl": pdl == "1"}
        for name, smap in maps.items():
            mode = "hit" if name == "hit" else "miss"
            t = _time_graph(lambda: [layer(impl, smap, g, mode) for g in range(groups)]) / groups
            row[name + "_us"] = t * 1e6
            row[name + "_GBps"] = bytes_layer / t / 1e9
            if name == "hit":                    # the kernels' own time, without the gaps between launches
                busy = _busy_time(lambda: [layer(impl, smap, g, mode) for g in range(groups)])
                if busy is not None:
                    row["hit_busy_us"] = busy / groups * 1e6
                    row["hit_busy_GBps"] = bytes_layer * groups / busy / 1e9
        # where a hit layer's time goes: each launch alone, 16 layers' worth back to back (two launches only)
        smap = maps["hit"]
        for part, half in ((("gu", gate_up), ("dn", down)) if impl_name != "fused" else ()):
            t = _time_graph(lambda: [half(impl, smap, g, "hit") for g in range(groups)]) / groups
            row[f"hit_{part}_us"] = t * 1e6
        res["experts"].append(row)
        print(row, flush=True)
    for name in ("FLE_CUDA_MV_CONFIG", "FLE_CUDA_MV_PRE", "FLE_PDL", "FLE_CUDA_MV_FFN"):
        os.environ.pop(name, None)
    # a small elementwise kernel in front of every dense product, as in the decode step (a norm, the
    # attention): a kernel launched with programmatic dependent launch overlaps only the end of it;
    # its own time, measured alone, is taken off
    pad = torch.zeros(4096, device="cuda")
    t_pad = _time_graph(lambda: [pad.add_(1.0) for _ in range(16)]) / 16
    res["dense_pad_us"] = t_pad * 1e6
    for name, n_out, n_in, reps in (("qkv", 5120, 2048, 16), ("wo", 2048, 4096, 16), ("output", 151936, 2048, 1)):
        mats = _q8_0_matrices(n_out, n_in, reps)
        xd = torch.randn(1, n_in, device="cuda")
        yd = torch.zeros(1, n_out, device="cuda")
        ref = triton_quant.mul_mat(mats[0], GGMLType.Q8_0, xd, config=_dense_config(n_out, 1)).clone()
        cuda_mv.dense(mats[0], GGMLType.Q8_0, xd, yd)
        err = float((yd - ref).abs().max() / ref.abs().max())
        print(f"dense {name}: CUDA C against Triton, max difference {err:.2e}", flush=True)
        # the shapes, loads-first and PDL variants swept on 2026-12-06/07 (docs/benchmarks.md), kept to the best
        launches = [("triton engine launch", None, None, "0", "word")] + [
            (f"cuda {r},{wp}", f"1,4,1,4,{r},{wp}", "0,0,0", "0", "word") for r, wp in ((2, 2), (4, 2), (2, 4))]
        launches += [("cuda 2,2 pre 2 pdl", "1,4,1,4,2,2", "0,0,2", "1", "word")]
        # rows staged through shared memory (FLE_CUDA_MV_DENSE=stage), per shape
        launches += [(f"cuda stage {r},{wp}", f"1,4,1,4,{r},{wp}", "0,0,0", "0", "stage")
                     for r, wp in ((1, 4), (2, 2), (2, 4), (4, 2), (1, 8), (2, 8))]
        for launch, cfg, pre, pdl, kind in launches:
            os.environ["FLE_PDL"] = pdl
            os.environ["FLE_CUDA_MV_DENSE"] = kind
            if cfg:
                os.environ["FLE_CUDA_MV_CONFIG"] = cfg
                os.environ["FLE_CUDA_MV_PRE"] = pre
                one = lambda m: cuda_mv.dense(m, GGMLType.Q8_0, xd, yd)
            else:
                one = lambda m: triton_quant.mul_mat(m, GGMLType.Q8_0, xd, out=yd, config=_dense_config(n_out, 1))
            t = _time_graph(lambda: [one(m) for m in mats]) / reps
            t_after = _time_graph(lambda: [(pad.add_(1.0), one(m)) for m in mats]) / reps - t_pad
            busy = _busy_time(lambda: [one(m) for m in mats])
            res["dense"].append({"matrix": name, "launch": launch, "us": t * 1e6, "GBps": mats[0].numel() / t / 1e9,
                                 "after_pad_us": t_after * 1e6, "after_pad_GBps": mats[0].numel() / t_after / 1e9,
                                 "max_rel_diff": err})
            if busy is not None:
                res["dense"][-1].update(busy_us=busy / reps * 1e6, busy_GBps=mats[0].numel() * reps / busy / 1e9)
            print(res["dense"][-1], flush=True)
        for name_ in ("FLE_CUDA_MV_CONFIG", "FLE_CUDA_MV_PRE", "FLE_PDL", "FLE_CUDA_MV_DENSE"):
            os.environ.pop(name_, None)
    return res


def dense_rows_bench(reps: int = 16, output: bool = False) -> list[dict]:
    """Q8_0 dense products of T = 1..4 activation rows (the verify step's tokens, batched lanes):
    Triton's launch against the CUDA C kernel that reads each weight block once for all rows
    (cuda_mv's T-row kernels, FLE_CUDA_MV_DENSE_T=4 here), per per-layer matrix; outputs compared
    with the reference first."""
    import torch

    from fle_engine.kernels import cuda_mv, reference, triton_quant
    from fle_engine.runtime.weights import _dense_config
    from fle_quant.ggml_types import GGMLType

    os.environ["FLE_CUDA_MV"] = "1"
    os.environ["FLE_CUDA_MV_DENSE_T"] = "4"
    os.environ["FLE_CUDA_MV_DENSE"] = "word"
    rows = []
    try:
        shapes = [("qkv", 5120, 2048, reps, 4), ("wo", 2048, 4096, reps, 4)]
        if output:                      # the 151936 x 2048 output matrix (330 MB), at T = 1
            shapes.append(("output", 151936, 2048, 1, 1))
        for name, n_out, n_in, reps, t_max in shapes:
            mats = _q8_0_matrices(n_out, n_in, reps)
            for t in range(1, t_max + 1):
                x = torch.randn(t, n_in, device="cuda")
                y = torch.zeros(t, n_out, device="cuda")
                cuda_mv.dense(mats[0], GGMLType.Q8_0, x, y)
                ref = reference.mul_mat(mats[0].cpu(), GGMLType.Q8_0, x.cpu())
                err = float((y.cpu() - ref).abs().max() / ref.abs().max())
                t_cuda = _time_graph(lambda: [cuda_mv.dense(m, GGMLType.Q8_0, x, y) for m in mats]) / reps
                t_tri = _time_graph(lambda: [triton_quant.mul_mat(m, GGMLType.Q8_0, x, out=y,
                                                                  config=_dense_config(n_out, t)) for m in mats]) / reps
                os.environ["FLE_CUDA_MV_DENSE"] = "stage"       # rows staged through shared memory
                y.zero_()
                cuda_mv.dense(mats[0], GGMLType.Q8_0, x, y)
                err_s = float((y.cpu() - ref).abs().max() / ref.abs().max())
                t_stage = _time_graph(lambda: [cuda_mv.dense(m, GGMLType.Q8_0, x, y) for m in mats]) / reps
                os.environ["FLE_CUDA_MV_DENSE"] = "word"
                rows.append({"matrix": name, "T": t, "cuda_us": t_cuda * 1e6, "triton_us": t_tri * 1e6,
                             "stage_us": t_stage * 1e6, "cuda_GBps": mats[0].numel() / t_cuda / 1e9,
                             "stage_GBps": mats[0].numel() / t_stage / 1e9, "max_rel_diff": err,
                             "stage_max_rel_diff": err_s})
                print(rows[-1], flush=True)
    finally:
        os.environ.pop("FLE_CUDA_MV_DENSE_T", None)
        os.environ.pop("FLE_CUDA_MV_DENSE", None)
    return rows


def explore_configs(hit: tuple, miss: tuple) -> list:
    """Launches around the defaults: the gate+up kernel's rows, warps and super-blocks per
    iteration with the default down kernel, then the down kernel's with the default gate+up,
    each with and without programmatic dependent launch; the hit launch with its paired
    decoder, the miss launch with the unpaired one."""
    out = []
    for base, dec, shapes, down in ((hit, "paired", [(8, 4), (16, 4), (4, 2)], [(16, 4), (8, 2), (32, 4)]),
                                    (miss, "fast", [(2, 1), (1, 1), (4, 1)], [(4, 1), (8, 1), (8, 2)])):
        for bn, w in shapes:
            for u in (1, 2, 4, 8):
                out.append(((bn, w, 0, u) + tuple(base[4:]), dec))
        for bn, w in down:
            for u in (1, 2, 4):
                out.append((tuple(base[:4]) + (bn, w, 0, u), dec))
    return [(c, d, p) for c, d in dict.fromkeys(out) for p in (False, True)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", action="store_true", help="try launch configurations of the expert kernels")
    p.add_argument("--explore", action="store_true",
                   help="also try super-blocks per loop iteration and programmatic dependent launch (sm_90+)")
    p.add_argument("--misses", action="store_true",
                   help="only the cost of m missed experts per token in a layer's launches, T = 1 and 3")
    p.add_argument("--cuda", action="store_true",
                   help="only the CUDA C kernels (cuda_mv) against Triton's: experts and Q8_0 dense, per launch shape")
    p.add_argument("--dense", action="store_true",
                   help="only the Q8_0 dense products of 1..4 activation rows: Triton's, CUDA C's one block per "
                        "lane and CUDA C's rows staged through shared memory (and the output matrix at T = 1)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    import json

    from fle_engine.kernels import triton_engine as te
    from fle_engine.kernels import triton_quant as _tq

    res = {"ceilings": ceilings()}
    print(res["ceilings"], flush=True)
    if args.dense:
        res["dense_rows"] = dense_rows_bench(output=True)
        for r in res["dense_rows"]:
            one = next(q for q in res["dense_rows"] if q["matrix"] == r["matrix"] and q["T"] == 1)
            print(f"dense {r['matrix']}, T = {r['T']}: CUDA C one block per lane {r['cuda_us']:.1f} us "
                  f"({r['cuda_us'] / one['cuda_us']:.2f}x its T = 1, {r['cuda_GBps']:.0f} GB/s), staged "
                  f"{r['stage_us']:.1f} us ({r['stage_us'] / one['stage_us']:.2f}x, {r['stage_GBps']:.0f} GB/s), "
                  f"Triton {r['triton_us']:.1f} us; max difference {r['max_rel_diff']:.1e} / staged "
                  f"{r['stage_max_rel_diff']:.1e}")
        if args.json:
            args.json.write_text(json.dumps(res, indent=1))
        return 0
    if args.cuda:
        res["read_ceiling"] = read_ceiling()
        print(res["read_ceiling"], flush=True)
        res.update(cuda_bench())
        rc, hbm = res["read_ceiling"], res["ceilings"]["hbm_copy_GBps"]
        print(f"read-only kernel over one layer's expert bytes: {rc['us']:.1f} us = {rc['GBps'] / hbm:.2f} of the "
              f"device copy" + (f"; its own time {rc['busy_us']:.1f} us = {rc['busy_GBps'] / hbm:.2f}"
                                if "busy_us" in rc else ""))
        res["dense_rows"] = dense_rows_bench()
        hbm, pin = res["ceilings"]["hbm_copy_GBps"], res["ceilings"]["pinned_h2d_GBps"]
        for name, ceil, unit in (("hit", hbm, "of the device copy"), ("one miss", hbm, "of the device copy"),
                                 ("miss", pin, "of the pinned copy")):
            for impl, pdl in (("triton", False), ("cuda", False), ("cuda", True), ("fused", False), ("fused", True)):
                rs = [r for r in res["experts"] if r["impl"] == impl and r["pdl"] == pdl]
                b = min(rs, key=lambda r: r[name + "_us"])
                print(f"experts, {name}: {impl}{' pdl' if pdl else ''} best {b['config']} pre {b['pre']} "
                      f"{b[name + '_us']:.1f} us, {b[name + '_GBps']:.0f} GB/s = {b[name + '_GBps'] / ceil:.2f} {unit}"
                      + (f" (gate+up alone {b['hit_gu_us']:.1f} us, down alone {b['hit_dn_us']:.1f} us)"
                         if name == "hit" and "hit_gu_us" in b else ""))
                if name == "hit" and "hit_busy_us" in b:
                    print(f"  the same launches' own time on the device (no gaps between them): "
                          f"{b['hit_busy_us']:.1f} us, {b['hit_busy_GBps']:.0f} GB/s = {b['hit_busy_GBps'] / hbm:.2f} {unit}")
        for name in ("qkv", "wo", "output"):
            for impl in ("triton", "cuda", "cuda stage"):
                rs = [r for r in res["dense"] if r["matrix"] == name and r["launch"].startswith(impl)
                      and (impl != "cuda" or "stage" not in r["launch"])]
                b = min(rs, key=lambda r: r["us"])
                print(f"dense {name}: {impl} best {b['launch']} {b['us']:.1f} us, {b['GBps']:.0f} GB/s = "
                      f"{b['GBps'] / hbm:.2f} of the device copy")
                b = min(rs, key=lambda r: r["after_pad_us"])
                print(f"dense {name} after a small kernel: {impl} best {b['launch']} {b['after_pad_us']:.1f} us, "
                      f"{b['after_pad_GBps']:.0f} GB/s = {b['after_pad_GBps'] / hbm:.2f} of the device copy")
                rs = [r for r in rs if "busy_us" in r]
                if rs:
                    b = min(rs, key=lambda r: r["busy_us"])
                    print(f"dense {name}, the kernel's own time: {impl} best {b['launch']} {b['busy_us']:.1f} us, "
                          f"{b['busy_GBps']:.0f} GB/s = {b['busy_GBps'] / hbm:.2f} of the device copy")
        for r in res["dense_rows"]:
            one = next(q for q in res["dense_rows"] if q["matrix"] == r["matrix"] and q["T"] == 1)
            rel = r["cuda_us"] / one["cuda_us"]
            rel_s = r["stage_us"] / one["stage_us"]
            print(f"dense {r['matrix']}, T = {r['T']}: CUDA C {r['cuda_us']:.1f} us ({rel:.2f}x its T = 1), "
                  f"staged {r['stage_us']:.1f} us ({rel_s:.2f}x), Triton {r['triton_us']:.1f} us, max difference "
                  f"{r['max_rel_diff']:.1e} / staged {r['stage_max_rel_diff']:.1e}")
        if args.json:
            args.json.write_text(json.dumps(res, indent=1))
        return 0
    if args.misses:
        res["misses"] = miss_count_bench()
        base = {r["T"]: r["us"] for r in res["misses"] if r.get("missed_per_token") == 0}
        for r in res["misses"]:
            if "read_one_expert" in r:
                print(f"one missed expert read alone, {r['read_one_expert']} (words per load, loads, warps), "
                      f"{r['launches']} launch(es): {r['us']:.1f} us ({r['GBps']:.1f} GB/s)")
            elif r["missed"]:
                extra = r["us"] - base[r["T"]]
                print(f"T = {r['T']}, {r['missed']} missed experts in the layer: {r['us']:.1f} us, "
                      f"{extra / r['missed']:.1f} us more per missed expert than none missed; reading them alone "
                      f"{r['read_only_us']:.1f} us ({r['read_only_GBps']:.1f} GB/s)")
        if args.json:
            args.json.write_text(json.dumps(res, indent=1))
        return 0
    def full(c):          # (rows, warps, unrolled, super-blocks per iteration)
        return tuple(c) + (1,) * (4 - len(c))

    miss = full(te.EXPERT_CONFIG["miss"][0]) + full(te.EXPERT_CONFIG["miss"][1])
    base = full(te.EXPERT_CONFIG["hit"][0]) + full(te.EXPERT_CONFIG["hit"][1])
    configs = sorted({base, miss} | {full(c[:3]) + full(c[3:]) for c in (
        (4, 2, 0, 8, 2, 0), (8, 4, 0, 16, 4, 0), (2, 1, 0, 8, 2, 0), (4, 1, 0, 4, 1, 0), (1, 1, 0, 4, 1, 0),
        (8, 4, 0, 8, 2, 0))})
    if args.sweep:
        gu = [(2, 1, 0), (4, 1, 0), (4, 2, 0), (8, 2, 0), (8, 4, 0), (16, 4, 0), (32, 4, 0), (32, 8, 0)]
        dn = [(4, 1, 0), (8, 1, 0), (8, 2, 0), (16, 2, 0), (16, 4, 0), (32, 4, 0), (32, 8, 0), (64, 8, 0)]
        configs = sorted(set(configs + [full(g) + full(d) for g, d in zip(gu, dn)] + [full(g) + base[4:] for g in gu]
                             + [base[:4] + full(d) for d in dn]))
    # the byte-permute IQ4 decoder with gate and up rows in one loop, in two, the code-book table, and the
    # value-by-value decoder from packed words
    decodes = ["paired", "fast", "table", "plain"] if _tq.FAST_DECODE else ["table", "plain"]
    res["read_ceiling"] = read_ceiling()
    items = [(c, f) for f in decodes for c in configs]
    if args.explore:
        items = explore_configs(base, miss) if _tq.FAST_DECODE else items
    res["experts"] = expert_bench(items)
    res["dense"] = dense_bench(args.explore)
    hbm, pin = res["ceilings"]["hbm_copy_GBps"], res["ceilings"]["pinned_h2d_GBps"]
    best_hit = min(res["experts"], key=lambda r: r["hit_us"])
    best_miss = min(res["experts"], key=lambda r: r["miss_us"])
    print(f"experts, slots: best {best_hit['config']} {best_hit['hit_GBps']:.0f} GB/s = {best_hit['hit_GBps'] / hbm:.2f} "
          f"of HBM; misses: best {best_miss['config']} {best_miss['miss_GBps']:.1f} GB/s = "
          f"{best_miss['miss_GBps'] / pin:.2f} of the pinned copy")
    rc = res["read_ceiling"]
    print(f"read-only kernel over the same bytes (two launches per layer, as the experts): {rc['us']:.1f} us, "
          f"{rc['GBps']:.0f} GB/s = {rc['GBps'] / hbm:.2f} of HBM")
    for dec in decodes:
        rs = [r for r in res["experts"] if r["decode"] == dec]
        if rs:
            h = min(rs, key=lambda r: r["hit_us"])
            m = min(rs, key=lambda r: r["miss_us"])
            print(f"  {dec} decode: slots {h['config']} {h['hit_GBps']:.0f} GB/s = {h['hit_GBps'] / hbm:.2f}; "
                  f"misses {m['config']} {m['miss_GBps']:.1f} GB/s = {m['miss_GBps'] / pin:.2f}")
    for r in res["dense"]:
        print(f"dense {r['matrix']} ({r['launch']} launch, {r['decode']} decode): {r['GBps']:.0f} GB/s = "
              f"{r['GBps'] / hbm:.2f} of HBM")
    for name in ("qkv", "wo", "output"):
        rs = [r for r in res["dense"] if r["matrix"] == name]
        if rs:
            b = max(rs, key=lambda r: r["GBps"])
            print(f"dense {name}: best {b['launch']} ({b['decode']}) {b['GBps']:.0f} GB/s = {b['GBps'] / hbm:.2f} of HBM")
    for pdl in (False, True):
        rs = [r for r in res["experts"] if r.get("pdl", False) == pdl]
        if rs:
            h = min(rs, key=lambda r: r["hit_us"])
            m = min(rs, key=lambda r: r["miss_us"])
            print(f"experts, pdl {'on' if pdl else 'off'}: slots best {h['config']} {h['decode']} {h['hit_us']:.1f} us "
                  f"{h['hit_GBps']:.0f} GB/s = {h['hit_GBps'] / hbm:.2f}; misses best {m['config']} {m['decode']} "
                  f"{m['miss_GBps']:.1f} GB/s = {m['miss_GBps'] / pin:.2f}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
