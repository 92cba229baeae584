"""The prefill GEMM kernel on one MoE layer of the 30B-A3B shape (128
experts of 768 x 2048, 8 used, IQ4_XS), every expert in GPU memory: time of
the gate+up and down passes for T tokens with random routing, per launch
configuration, against the time that copying the layer's uncached 2/3 over
PCIe takes at the measured pinned-copy speed (prefill streams it per
micro-batch: the kernel should take less).

    python3 bench/prefill_gemm.py [--tokens 4096] [--sweep]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    import torch

    from fle_engine.kernels import engine_ops, triton_gemm
    from fle_engine.runtime.prefill import pad_by_expert
    from fle_quant.ggml_types import BLOCK_GEOMETRY, GGMLType
    from fle_quant.quants import quantize

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--type", default="IQ4_XS")
    p.add_argument("--sweep", action="store_true", help="try several (BLOCK_M, BLOCK_N, warps)")
    args = p.parse_args(argv)
    qt = GGMLType[args.type]
    E, K, F, D, T = 128, 8, 768, 2048, args.tokens
    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    # one expert's rows quantized, tiled over the layer (the kernel's time does not depend on the values)
    gu1 = quantize(rng.standard_normal((2 * F, D)).astype(np.float32) * 0.05, qt)
    dn1 = quantize(rng.standard_normal((D, F)).astype(np.float32) * 0.05, qt)
    eb_gu, eb_dn = gu1.size, dn1.size
    eb = (eb_gu + eb_dn + 255) // 256 * 256
    buf = torch.zeros(E * eb, dtype=torch.uint8, device=dev)
    view = buf.view(E, eb)
    view[:, :eb_gu] = torch.from_numpy(gu1.reshape(-1)).to(dev)
    view[:, eb_gu:eb_gu + eb_dn] = torch.from_numpy(dn1.reshape(-1)).to(dev)
    space = engine_ops.WordSpace(buf)
    w = engine_ops.WORDS[qt].itemsize
    x = torch.randn(T, D, device=dev) * 0.5
    logits = torch.randn(T, E, device=dev)
    ids = torch.topk(logits, K, dim=-1).indices
    wts = torch.full((T * K,), 1.0 / K, device=dev)
    y = torch.zeros(T * K, D, device=dev)
    src = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device=dev)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    pinned = 5 * src.numel() / (time.perf_counter() - t0)
    copy_ms = E * eb * 2 / 3 / pinned * 1e3
    flops = 2.0 * T * K * (2 * F * D + D * F)
    print(f"T {T}, {E} experts x {eb / 1e6:.2f} MB {args.type}; pinned copy {pinned / 1e9:.1f} GB/s: the layer's "
          f"uncached 2/3 take {copy_ms:.2f} ms to copy")
    configs = [(64, (32, 4), (64, 4))]
    if args.sweep:
        configs = [(bm, gu, dn) for bm in (64, 128) for gu in ((32, 4), (64, 8)) for dn in ((64, 4), (128, 8))]
    for bm, cgu, cdn in configs:
        rows, blk_e = pad_by_expert(ids, E, bm)
        base_gu = blk_e.clamp(min=0) * (eb // w)
        base_dn = blk_e.clamp(min=0) * (eb // w) + eb_gu // w
        h = torch.zeros(rows.numel(), F, device=dev)
        rb_gu = gu1.shape[-1]
        rb_dn = dn1.shape[-1]

        def once():
            triton_gemm.gemm(space.words(qt), qt, base_gu, rows, x, h, F, rb_gu, "gate_up",
                             up_words=F * rb_gu // w, n_used=K, block_m=bm, config=cgu)
            triton_gemm.gemm(space.words(qt), qt, base_dn, rows, h, y, D, rb_dn, "down", n_used=K, weights=wts,
                             block_m=bm, config=cdn)
        try:
            once()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a configuration the compiler refuses
            print(f"  BLOCK_M {bm}, gate+up {cgu}, down {cdn}: failed ({type(e).__name__}: {str(e)[:80]})")
            continue
        t0 = time.perf_counter()
        n = 5
        for _ in range(n):
            once()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / n * 1e3
        print(f"  BLOCK_M {bm}, gate+up {cgu}, down {cdn}: {ms:.2f} ms, {flops / ms / 1e9:.0f} TFLOP/s, "
              f"{ms / copy_ms:.2f} of the copy", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
