"""CPU expert kernels: the routed-expert FFN of a few tokens computed on the
CPU straight from the GGUF bytes in the engine's host buffer.

``expert_forward(experts, layout, x, ids, weights)`` returns, for each token
``t``, ``sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with
``e = ids[t, k]`` (a negative id: that pair is not computed here, e.g. a
cache hit the GPU computes). ``experts`` is uint8 ``[E, expert_bytes]`` in
the layout of :class:`fle_engine.runtime.weights.ExpertLayout` (an expert's
gate rows, its up rows, then at ``down_offset`` its down rows), read in
place: ``HostExperts.view(il).numpy()`` is such an array with no copy.

Activations are quantized once per call to each weight type's dot type
(:data:`DOT_TYPE`, ggml's ``vec_dot_type``): x once for gate and up,
silu(gate) * up once per (token, expert) for down. Each distinct expert's
rows are read once for all the tokens that chose it.

Every type has one row in :data:`KERNELS`: the numpy reference
(:mod:`.reference`, the integer dot written out), FLE's numba kernels
(:mod:`.fle_numba`, bit-identical to the reference, need no compiler) and
ggml's CPU dot products through llama-cpp-python's library
(:mod:`.ggml_cpu`, equal to the reference to float32 rounding; None where
that library is missing). ``impl="auto"`` takes :data:`AUTO` (FLE's numba
kernels unless a measurement on the target machine says otherwise, see
``bench/cpu_experts.py``).

This package does not import torch.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from fle_quant.errors import FleError
from fle_quant.ggml_types import BLOCK_GEOMETRY, GGMLType, parse_type

from . import fle_numba, reference
from .acts import DOT_TYPE, Acts, quantize_acts

__all__ = ["KERNELS", "DOT_TYPE", "TYPES", "Backend", "Geometry", "expert_forward", "matvec", "backends",
           "pick", "preferred", "quantize_acts", "Acts", "AUTO"]

TYPES = tuple(fle_numba.CODES)
AUTO = "numba"
CHUNK = 16  # output rows per work item of the thread pool


class Geometry(NamedTuple):
    """Where the parts of one layer's experts sit in an expert's bytes: its
    gate rows, then its up rows (one block), then, at the next 16-byte
    boundary, its down rows (the engine's ``runtime.weights.ExpertLayout``
    is this class)."""
    n_ff: int
    n_embd: int
    gu_type: GGMLType
    gu_row_bytes: int
    down_type: GGMLType
    down_row_bytes: int

    @property
    def down_offset(self) -> int:
        return (2 * self.n_ff * self.gu_row_bytes + 15) // 16 * 16

    @property
    def expert_bytes(self) -> int:
        return (self.down_offset + self.n_embd * self.down_row_bytes + 15) // 16 * 16

    @classmethod
    def of(cls, n_ff: int, n_embd: int, gu_type, down_type) -> "Geometry":
        gu, dn = parse_type(gu_type), parse_type(down_type)
        return cls(n_ff, n_embd, gu, _row_bytes(gu, n_embd), dn, _row_bytes(dn, n_ff))


def _row_bytes(qtype: GGMLType, n: int) -> int:
    values, size = BLOCK_GEOMETRY[qtype]
    if n % values:
        raise FleError(f"{qtype.name} rows hold multiples of {values} values, not {n}")
    return n // values * size


class Backend(NamedTuple):
    """One implementation: the fused forward and the single product."""
    forward: Callable
    matvec: Callable


def _ref_forward(buf, lay, x, ids, wts, out, chunk):
    out[:] = reference.expert_forward_ref(buf, lay, x, ids, wts)


def _numba_forward(buf, lay, x, ids, wts, out, chunk):
    fle_numba.forward(buf, fle_numba.CODES[lay.gu_type], lay.gu_row_bytes, lay.n_ff,
                      fle_numba.CODES[lay.down_type], lay.down_offset, lay.down_row_bytes, lay.n_embd,
                      x, ids, wts, out, chunk)


def _ggml_forward(buf, lay, x, ids, wts, out, chunk):
    from . import ggml_cpu
    ggml_cpu.forward(buf, lay, x, ids, wts, out, chunk)


def _ggml_matvec(rows, qtype, x):
    from . import ggml_cpu
    return ggml_cpu.matvec(rows, qtype, ggml_cpu.quantize(x, qtype))


def _acts_matvec(fn):
    def mv(rows, qtype, x):
        return fn(rows, qtype, quantize_acts(x, DOT_TYPE[qtype]))
    return mv


REFERENCE = Backend(_ref_forward, _acts_matvec(reference.matvec_ref))
NUMBA = Backend(_numba_forward, _acts_matvec(fle_numba.matvec))
GGML = Backend(_ggml_forward, _ggml_matvec)

# type -> {"reference": ..., "numba": ..., "ggml": ... (checked for availability on use)}
KERNELS: dict[GGMLType, dict[str, Backend]] = {
    t: {"reference": REFERENCE, "numba": NUMBA, "ggml": GGML} for t in TYPES}


def backends() -> tuple[str, ...]:
    """The implementations usable in this process."""
    from . import ggml_cpu
    return ("reference", "numba") + (("ggml",) if ggml_cpu.available() else ())


def preferred(qtypes) -> str:
    """The backend the engine's CPU misses take for experts of ``qtypes``
    (gate/up and down), by measurement (``bench/cpu_experts.py`` on the GPU
    machine's 16 cores against a native ggml build, ``docs/benchmarks.md``):
    FLE's AVX-512 row kernels read IQ4_XS and Q4_K at 0.99-1.16x ggml's
    bytes per second and IQ3_S, IQ3_XXS, IQ2_XS at 1.6-2.0x, so ``numba``
    where those kernels run for every type; elsewhere (AVX2 only, or a
    type without an AVX-512 kernel: Q8_0 0.91x) ggml's dot products where
    llama-cpp-python's library is present, else ``numba``."""
    from . import fle_numba, rows

    if rows.ISA == "avx512" and all(fle_numba.CODES[parse_type(t)] in rows.AVX512_KERNELS for t in qtypes):
        return "numba"
    return "ggml" if "ggml" in backends() else "numba"


def pick(qtype, impl: str = "auto") -> Backend:
    """The implementation ``impl`` ("auto", "reference", "numba", "ggml")
    for ``qtype``, or a FleError that says what to do."""
    qtype = parse_type(qtype)
    row = KERNELS.get(qtype)
    if row is None:
        raise FleError(f"no CPU expert kernel for {qtype.name}; types with one: {', '.join(t.name for t in TYPES)}")
    name = AUTO if impl == "auto" else impl
    if name not in row:
        raise FleError(f"impl must be 'auto', 'reference', 'numba' or 'ggml', not {impl!r}")
    if name == "ggml":
        from . import ggml_cpu
        why = ggml_cpu.unavailable_reason()
        if why is not None:
            raise FleError(f"impl='ggml' needs ggml's CPU library from llama-cpp-python: {why}")
    return row[name]


def matvec(rows: np.ndarray, qtype, x: np.ndarray, impl: str = "auto") -> np.ndarray:
    """``x @ W.T`` with activations quantized to the dot type: ``rows`` uint8
    [N, row_bytes] of ``qtype``, ``x`` float32 [R, n] -> float32 [R, N]."""
    qtype = parse_type(qtype)
    fn = pick(qtype, impl).matvec
    rows = np.asarray(rows)
    x = np.ascontiguousarray(x, np.float32)
    if rows.dtype != np.uint8 or rows.ndim != 2 or x.ndim != 2 or rows.shape[1] != _row_bytes(qtype, x.shape[1]):
        raise FleError(f"{qtype.name}: rows must be uint8 [N, row_bytes] and x float [R, n] with matching n; "
                       f"got {rows.dtype} {rows.shape} and {x.shape}")
    return fn(rows, qtype, x)


def expert_forward(experts: np.ndarray, layout, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                   out: "np.ndarray | None" = None, impl: str = "auto") -> np.ndarray:
    """The routed experts' FFN for ``T`` tokens on the CPU (module docstring).

    ``experts``: uint8 [E, expert_bytes] (C-contiguous rows; read in place),
    ``layout``: ``ExpertLayout`` or :class:`Geometry`, ``x``: float32
    [T, n_embd], ``ids``: int [T, K] (negative: skip), ``weights``: float
    [T, K]. Returns float32 [T, n_embd] (``out`` when given, written in
    place). The two types of ``layout`` (gate/up and down) may differ."""
    lay = layout
    be_gu, be_d = pick(lay.gu_type, impl), pick(lay.down_type, impl)
    if be_gu is not be_d:
        raise FleError(f"impl {impl!r} picks different backends for {lay.gu_type.name} and {lay.down_type.name}")
    if experts.dtype != np.uint8 or experts.ndim != 2 or experts.shape[1] != lay.expert_bytes:
        raise FleError(f"experts must be uint8 [E, {lay.expert_bytes}] (the layout's expert bytes), "
                       f"got {experts.dtype} {experts.shape}")
    if not experts.flags.c_contiguous:
        raise FleError("experts must be C-contiguous (a view of the host buffer, not a strided slice)")
    x = np.ascontiguousarray(x, np.float32)
    ids = np.ascontiguousarray(ids, np.int64)
    weights = np.ascontiguousarray(weights, np.float32)
    if x.ndim != 2 or x.shape[1] != lay.n_embd or ids.ndim != 2 or ids.shape[0] != x.shape[0] \
            or weights.shape != ids.shape:
        raise FleError(f"x must be [T, {lay.n_embd}], ids and weights [T, K]; got {x.shape}, {ids.shape}, "
                       f"{weights.shape}")
    if ids.size and ids.max() >= experts.shape[0]:
        raise FleError(f"expert ids must lie below {experts.shape[0]}; got {ids.max()}")
    if out is None:
        out = np.empty((x.shape[0], lay.n_embd), np.float32)
    elif out.dtype != np.float32 or out.shape != (x.shape[0], lay.n_embd) or not out.flags.c_contiguous:
        raise FleError(f"out must be C-contiguous float32 [{x.shape[0]}, {lay.n_embd}], got {out.dtype} {out.shape}")
    if x.shape[0]:
        be_gu.forward(experts, lay, x, ids, weights, out, CHUNK)
    return out
