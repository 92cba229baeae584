"""Speed of FLE's quantized matrix products on CUDA (fle_engine.kernels),
printed as a markdown table.

For every type with a Triton kernel, and for T = 1 and 4 activation rows
per expert, three ways to compute the same product are timed:

- triton: ``mul_mat`` / ``mul_mat_experts`` on the raw GGUF bytes;
- reference: fle_quant's CPU dequantizer, then a float32 matmul on the GPU
  (the engine's path before these kernels);
- bf16: a torch bf16 matmul on a copy dequantized ahead of time, the
  ceiling of a cache that holds experts dequantized (it reads 16 bits per
  weight against 4.25 for IQ4_XS).

Shapes: "experts" is one ``mul_mat_experts`` call over 10 experts of an
expert tensor (each token uses all 10, so each expert has T rows), in both
orientations (512 x 2560 gate/up, 2560 x 512 down); its bf16 form is one
``bmm`` over the same 10 experts. "dense" is one 6144 x 2560 matrix.

triton and bf16 are timed as CUDA-graph replays (as the decode step runs
them; eager launches of such small kernels measure Python, not the GPU),
the reference eagerly. ``triton.testing.do_bench`` flushes the L2 cache
before every call, so the weights come from DRAM. GB/s counts the bytes of
weights each form must read (quantized for triton and reference, bf16 for
bf16). Ratios are of times: reference / triton and bf16 / triton (above 1:
triton is faster). "max rel err" checks triton against the reference
(largest error over largest |y|).

``--tune`` instead times a grid of launch configurations
(``triton_quant.Config``: rows per program / warps / activation rows per
program) for the same cases.

Blocks are random bytes with typical fp16 scales (every byte pattern is a
valid block of these formats), which costs the kernels as much as real
weights and avoids quantizing 15 M values per type first.

    python bench/kernels.py [--types Q8_0,IQ4_XS] [--tokens 1 4] [--tune]
"""
from __future__ import annotations

import argparse

import numpy as np


def _random_rows(qtype, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    from fle_quant.ggml_types import BLOCK_GEOMETRY
    from fle_quant.quants.dequant import FP16_SCALE_OFFSETS

    *lead, n_in = shape
    values, size = BLOCK_GEOMETRY[qtype]
    n_blocks = int(np.prod(lead)) * (n_in // values)
    blocks = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for off in FP16_SCALE_OFFSETS[qtype]:
        scale = (rng.standard_normal(n_blocks) * 0.002).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(*lead, n_in // values * size)


def _graphed(fn):
    """``fn`` captured in a CUDA graph (after warm-up calls), as a replay callable."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _cases(n_exp: int):
    return [("experts", (n_exp, 512, 2560)), ("experts", (n_exp, 2560, 512)), ("dense", (6144, 2560))]


def _problem(qtype, kind, shape, t, rng, dev):
    """Weights and the three callables (triton, reference, bf16) of one case."""
    import torch

    from fle_engine import kernels

    w = torch.from_numpy(_random_rows(qtype, shape, rng)).to(dev)
    wb = kernels.reference.dequantize_weights(w, qtype).to(torch.bfloat16)
    n_in = shape[-1]
    if kind == "experts":
        n_exp = shape[0]
        ids = torch.arange(n_exp, device=dev).repeat(t)  # [t * E]: every token uses every expert
        x = torch.randn(t * n_exp, n_in, device=dev)
        xb = x.view(t, n_exp, n_in).transpose(0, 1).to(torch.bfloat16)  # [E, t, n_in]
        return (w, wb, lambda **kw: kernels.triton_quant.mul_mat_experts(w, qtype, x, ids, **kw),
                lambda: kernels.mul_mat_experts(w, qtype, x, ids, impl="reference"),
                lambda: torch.bmm(xb, wb.transpose(1, 2)))
    x = torch.randn(t, n_in, device=dev)
    xb = x.to(torch.bfloat16)
    return (w, wb, lambda **kw: kernels.triton_quant.mul_mat(w, qtype, x, **kw),
            lambda: kernels.mul_mat(w, qtype, x, impl="reference"),
            lambda: xb @ wb.T)


def _label(kind, shape):
    return f"{kind} {'x'.join(map(str, shape))}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default=None, help="comma-separated types (default: every type with a kernel)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--experts", type=int, default=10)
    ap.add_argument("--tune", action="store_true", help="time a grid of launch configurations instead")
    args = ap.parse_args()

    import torch
    import triton
    from triton.testing import do_bench

    from fle_engine import kernels
    from fle_engine.kernels import triton_quant
    from fle_quant.ggml_types import parse_type

    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels.py needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    types = [parse_type(t) for t in args.types.split(",")] if args.types else list(kernels.fast_types())
    rng = np.random.default_rng(0)
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")

    def bench(fn):  # us per call; the L2 cache is flushed before each call
        return do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3

    if args.tune:
        C = triton_quant.Config
        configs = [C(16, 4), C(8, 1), C(4, 1), C(8, 2), C(32, 4), C(16, 4, 1), C(8, 1, 1), C(4, 1, 1), C(16, 2, 1),
                   C(32, 4, 1)]
        print("| type | shape | T | " + " | ".join(
            f"{c.block_n}/{c.num_warps}{'' if c.t_pad is None else '/t' + str(c.t_pad)}" for c in configs) + " |")
        print("|---|---|---|" + "---|" * len(configs))
        for qtype in types:
            for kind, shape in _cases(args.experts):
                for t in args.tokens:
                    w, _, fast, _, _ = _problem(qtype, kind, shape, t, rng, dev)
                    cells = []
                    for cfg in configs:
                        us = bench(_graphed(lambda: fast(config=cfg)))
                        cells.append(f"{us:.1f}")
                    print(f"| {qtype.name} | {_label(kind, shape)} | {t} | " + " | ".join(cells) + " |", flush=True)
        return

    print("| type | shape | T | triton us | GB/s | max rel err | reference us | ref/triton | bf16 us | bf16 GB/s "
          "| bf16/triton |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for qtype in types:
        for kind, shape in _cases(args.experts):
            for t in args.tokens:
                w, wb, fast, ref, bf16 = _problem(qtype, kind, shape, t, rng, dev)
                want = ref()
                err = float((fast() - want).abs().max() / want.abs().max())
                t_fast = bench(_graphed(fast))
                t_ref = do_bench(ref, warmup=2, rep=200, return_mode="median") * 1e3
                t_bf16 = bench(_graphed(bf16))
                q_bytes, b_bytes = w.numel(), wb.numel() * 2
                print(f"| {qtype.name} | {_label(kind, shape)} | {t} | {t_fast:.1f} | {q_bytes / t_fast / 1e3:.0f} "
                      f"| {err:.1e} | {t_ref:.0f} | {t_ref / t_fast:.0f} | {t_bf16:.1f} | {b_bytes / t_bf16 / 1e3:.0f} "
                      f"| {t_bf16 / t_fast:.2f} |", flush=True)


if __name__ == "__main__":
    main()
