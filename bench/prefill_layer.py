"""One MoE layer of prefill on the 30B-A3B shape (128 experts of 768 x
2048, 8 used, IQ4_XS), every expert in GPU memory: the time of decoding the
layer's experts into bfloat16 and of the two grouped products (gate+up,
down) for T tokens with random routing, against the time that copying the
layer's uncached 2/3 over PCIe takes at the measured pinned-copy speed
(prefill streams it per micro-batch; the computation should take less).

    python3 bench/prefill_layer.py [--tokens 4096,8192]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))          # bench/engine.py's helpers


def main(argv=None) -> int:
    import torch

    from engine import pinned_copy_bps
    from fle_engine.kernels import engine_ops, triton_dequant
    from fle_engine.runtime.prefill import grouped_mm, sort_by_expert
    from fle_quant.ggml_types import GGMLType
    from fle_quant.quants import quantize

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="4096,8192")
    p.add_argument("--type", default="IQ4_XS")
    args = p.parse_args(argv)
    qt = GGMLType[args.type]
    E, K, F, D = 128, 8, 768, 2048
    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    gu1 = quantize(rng.standard_normal((2 * F, D)).astype(np.float32) * 0.05, qt)
    dn1 = quantize(rng.standard_normal((D, F)).astype(np.float32) * 0.05, qt)
    eb = (gu1.size + dn1.size + 255) // 256 * 256
    buf = torch.zeros(E * eb, dtype=torch.uint8, device=dev)
    view = buf.view(E, eb)
    view[:, :gu1.size] = torch.from_numpy(gu1.reshape(-1)).to(dev)
    view[:, gu1.size:gu1.size + dn1.size] = torch.from_numpy(dn1.reshape(-1)).to(dev)
    w = engine_ops.WORDS[qt].itemsize
    words = buf.view(engine_ops.WORDS[qt])
    base_gu = torch.arange(E, device=dev, dtype=torch.int64) * (eb // w)
    base_dn = base_gu + gu1.size // w
    w_gu = torch.empty(E, 2 * F, D, dtype=torch.bfloat16, device=dev)
    w_dn = torch.empty(E, D, F, dtype=torch.bfloat16, device=dev)
    pinned = pinned_copy_bps(256)
    copy_ms = E * eb * 2 / 3 / pinned * 1e3
    print(f"{E} experts x {eb / 1e6:.2f} MB {args.type}; pinned copy {pinned / 1e9:.1f} GB/s: the layer's uncached "
          f"2/3 take {copy_ms:.2f} ms to copy")

    def timed(fn, n=5):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e3

    best = None
    for bn, wp in ((4, 1), (8, 2), (8, 4), (16, 4), (32, 8)):
        ms = timed(lambda: (triton_dequant.dequant(words, qt, base_gu, 2 * F, gu1.shape[-1], w_gu, tile_order=True,
                                                   block_n=bn, warps=wp),
                            triton_dequant.dequant(words, qt, base_dn, D, dn1.shape[-1], w_dn, tile_order=True,
                                                   block_n=bn, warps=wp)))
        gbs = (w_gu.numel() + w_dn.numel()) * 2 / ms / 1e6
        print(f"  decode the layer to bfloat16, BLOCK_N {bn}, {wp} warps: {ms:.2f} ms ({gbs:.0f} GB/s written)",
              flush=True)
        if best is None or ms < best[0]:
            best = (ms, bn, wp)
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, D, device=dev) * 0.5
        ids = torch.topk(torch.randn(T, E, device=dev), K, dim=-1).indices
        order, ends = sort_by_expert(ids, E)
        flops = 2.0 * T * K * (2 * F * D + D * F)

        def products():
            h = grouped_mm(x[order // K].to(torch.bfloat16), w_gu, ends).float()
            act = (torch.nn.functional.silu(h[:, :F]) * h[:, F:]).to(torch.bfloat16)
            return grouped_mm(act, w_dn, ends)
        ms = timed(products)
        print(f"  T {T}: sort + grouped products {ms:.2f} ms ({flops / ms / 1e9:.0f} TFLOP/s); with the decode: "
              f"{ms + timed(lambda: triton_dequant.dequant(words, qt, base_gu, 2 * F, gu1.shape[-1], w_gu, tile_order=True)) + timed(lambda: triton_dequant.dequant(words, qt, base_dn, D, dn1.shape[-1], w_dn, tile_order=True)):.2f} ms "
              f"against the copy's {copy_ms:.2f} ms", flush=True)
    print(f"best decode configuration: {best[1]},{best[2]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
