"""Requantize chosen tensors of a GGUF file to another quant type.

Every tensor whose name matches a regular expression is decoded from its
stored type to float32 and encoded again in the target type, a chunk of rows
at a time, while the file is written: memory stays bounded by one chunk
whatever the tensor's size (a 29 GB n-gram table included). Every other
tensor and all metadata are copied byte for byte.

For each requantized tensor the relative error of the new encoding against
the source, ``||x_new - x_src||^2 / ||x_src||^2`` (float64 sums), is measured
on its first 8,192 rows (rows in ggml order: for stacked experts, the first
experts' rows), as FLE's reports quote it: "relative error against the source
on the first 8,192 rows". ``x_src`` is the decoded source, not the original
full-precision weights, so the number is the cost of this step alone.

Any target that FLE can encode (``fle_quant.quants.QUANTIZERS``) works; a
target whose block does not divide a matched tensor's row length is refused
before anything is written.

With an importance matrix (``imatrix=``, a llama.cpp imatrix file, see
:mod:`fle_quant.imatrix`) each tensor is encoded with its importance vector
as ``llama-quantize --imatrix`` encodes it: a stacked expert tensor's rows
use their own expert's vector, a tensor without an entry is encoded without
one, and an entry of the wrong size is refused. As in llama-quantize, types
that need an importance matrix (IQ3_XXS among FLE's) are refused for a
tensor without one, with or without a file, and the output records the
file in llama-quantize's ``quantize.imatrix.*`` keys plus its SHA-256.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import FleError
from .ggml_types import BLOCK_GEOMETRY, GGMLType, parse_type, row_nbytes
from .gguf_reader import GGUFModel, TensorInfo
from .gguf_writer import ByteSource, WritePlan, WriteResult, write_gguf
from .imatrix import IMATRIX_KEY_PREFIX, KEY_IMATRIX_SHA256, Imatrix, load_imatrix, requires_imatrix
from .quants import DEQUANTIZERS, QUANTIZERS, dequantize, quantize

__all__ = ["MEASURE_ROWS", "TensorReport", "RequantSource", "plan_requant", "requant", "format_report"]

MEASURE_ROWS = 8192
# float32 values decoded per chunk (16 MiB) and values measured at a time in
# float64 (2 x 4 MiB): the working set is a few tens of MiB for any tensor
_CHUNK_VALUES = 4 << 20
_MEASURE_VALUES = 1 << 19

# Targets whose ggml quantizer weights its error by the importance matrix
# while FLE's encoder of that type does not (it reproduces the unweighted
# reference): with an imatrix FLE's bytes would differ from llama-quantize's,
# so the combination is refused rather than silently ignored.
_IMATRIX_UNSUPPORTED = frozenset({GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1})


@dataclass
class TensorReport:
    """One requantized tensor: sizes and the measured relative error."""

    name: str
    shape: tuple[int, ...]
    src_type: GGMLType
    dst_type: GGMLType
    bytes_before: int
    bytes_after: int
    rows_measured: int = 0
    err_sum: float = 0.0  # sum (x_new - x_src)^2 over the measured rows
    ref_sum: float = 0.0  # sum x_src^2 over the measured rows
    # None: run without an importance matrix; else whether this tensor had an entry
    imatrix: bool | None = None

    @property
    def rel_error(self) -> float:
        if self.ref_sum > 0:
            return self.err_sum / self.ref_sum
        return 0.0 if self.err_sum == 0 else float("inf")


class RequantSource:
    """A :class:`~fle_quant.gguf_writer.ChunkSource` that yields the target
    encoding of a stored tensor's rows, a chunk of rows at a time, and
    accumulates the relative error on the first ``MEASURE_ROWS`` rows into
    ``report`` as it goes.

    ``imatrix``: float32 ``[n_mat, ne0]`` importance rows (from
    :meth:`fle_quant.imatrix.Imatrix.for_tensor`) or None; row ``r`` of the
    tensor is encoded with importance row ``r // ne1``, so the rows of each
    expert of a stacked tensor use that expert's vector."""

    def __init__(self, model: GGUFModel, t: TensorInfo, dst: GGMLType, report: TensorReport,
                 measure_rows: int = MEASURE_ROWS, imatrix: np.ndarray | None = None):
        self.model = model
        self.t = t
        self.dst = dst
        self.report = report
        self.measure_rows = measure_rows
        self.ne0 = t.shape[0] if t.shape else 1
        self.dst_row_bytes = row_nbytes(self.ne0, dst)
        self.n_bytes = t.n_rows * self.dst_row_bytes
        self.imatrix = imatrix
        self.rows_per_mat = t.shape[1] if len(t.shape) > 1 else 1
        if imatrix is not None and (imatrix.ndim != 2 or imatrix.shape[1] != self.ne0
                                    or imatrix.shape[0] * self.rows_per_mat != t.n_rows):
            raise ValueError(f"importance rows of shape {imatrix.shape} do not fit tensor {t.name!r} {t.shape}")

    def _encode(self, x: np.ndarray, start: int) -> np.ndarray:
        """Rows ``start .. start + len(x)`` of the tensor in the target type;
        with an importance matrix, one call per expert the rows span, since
        each expert has its own vector."""
        if self.imatrix is None:
            return quantize(x, self.dst)
        q = np.empty((len(x), self.dst_row_bytes), dtype=np.uint8)
        i = 0
        while i < len(x):
            mat = (start + i) // self.rows_per_mat
            j = min(len(x), (mat + 1) * self.rows_per_mat - start)
            q[i:j] = quantize(x[i:j], self.dst, imatrix=self.imatrix[mat])
            i = j
        return q

    def chunks(self, chunk_size: int) -> Iterator[np.ndarray]:
        rows = self.model.tensor_bytes(self.t.name).reshape(self.t.n_rows, self.t.row_bytes)
        step = max(1, min(chunk_size // self.dst_row_bytes, _CHUNK_VALUES // self.ne0))
        rep = self.report
        rep.rows_measured, rep.err_sum, rep.ref_sum = 0, 0.0, 0.0
        for start in range(0, self.t.n_rows, step):
            stop = min(start + step, self.t.n_rows)
            x = dequantize(rows[start:stop], self.t.qtype)
            q = self._encode(x, start)
            m = min(stop, self.measure_rows) - start
            if m > 0:
                self._measure(x[:m], q[:m])
            # a fresh array per chunk: the writer may still be hashing the last one
            yield np.ascontiguousarray(q).reshape(-1)

    def _measure(self, x: np.ndarray, q: np.ndarray) -> None:
        """Add rows' squared error and squared norm, in float64, a few rows at
        a time so the float64 temporaries stay small."""
        rep = self.report
        step = max(1, _MEASURE_VALUES // self.ne0)
        for i in range(0, len(x), step):
            xs = x[i : i + step].astype(np.float64)
            y = dequantize(q[i : i + step], self.dst).astype(np.float64)
            y -= xs
            rep.err_sum += float(np.einsum("ij,ij->", y, y))
            rep.ref_sum += float(np.einsum("ij,ij->", xs, xs))
        rep.rows_measured += len(x)


def _compile(pattern: str) -> "re.Pattern[str]":
    try:
        return re.compile(pattern)
    except re.error as e:
        raise FleError(f"--tensors {pattern!r} is not a valid regular expression ({e})") from None


def plan_requant(model: GGUFModel, pattern: str, qtype: "GGMLType | str | int",
                 measure_rows: int = MEASURE_ROWS,
                 imatrix: "Imatrix | None" = None) -> tuple[WritePlan, list[TensorReport]]:
    """The write plan of ``model`` with every tensor whose name matches
    ``pattern`` (``re.search``) requantized to ``qtype``, and the reports the
    plan fills in while it is written. With ``imatrix`` each tensor that has
    an entry is encoded with it (see the module's docstring), and the
    metadata records the file."""
    where = model.paths[0]
    dst = parse_type(qtype)
    if dst not in QUANTIZERS:
        known = ", ".join(t.name for t in QUANTIZERS)
        raise FleError(f"FLE cannot quantize to {dst.name}; choose one of {known}")
    if imatrix is not None and dst in _IMATRIX_UNSUPPORTED:
        raise FleError(f"FLE's {dst.name} encoder does not use an importance matrix (llama-quantize's does), so "
                       f"--imatrix would not give llama-quantize's bytes; drop --imatrix or choose IQ4_NL, IQ4_XS, "
                       "Q6_K, IQ3_S or IQ3_XXS")
    rx = _compile(pattern)
    matched = [t for t in model if rx.search(t.name)]
    if not matched:
        raise FleError(f"{where}: no tensor name matches --tensors {pattern!r}; list the names with fle-inspect")
    block = BLOCK_GEOMETRY[dst][0]
    for t in matched:
        ne0 = t.shape[0] if t.shape else 1
        if ne0 % block:
            raise FleError(f"{where}: tensor {t.name!r} has rows of {ne0} values, not a multiple of the "
                           f"{dst.name} block of {block}; choose another type or narrow --tensors")
        if t.qtype not in DEQUANTIZERS:
            raise FleError(f"{where}: tensor {t.name!r} is {t.qtype.name}, which FLE cannot decode; "
                           "narrow --tensors")
    importance: dict[str, np.ndarray | None] = {}
    for t in matched:
        importance[t.name] = imatrix.for_tensor(t.name, t.shape) if imatrix is not None else None
        if importance[t.name] is None and requires_imatrix(t.name, dst):
            if imatrix is None:
                raise FleError(f"{where}: {dst.name} needs an importance matrix for tensor {t.name!r} "
                               "(llama-quantize refuses it without one too); pass --imatrix FILE, or choose "
                               "another type")
            raise FleError(f"{imatrix.source}: has no entry for tensor {t.name!r}, and {dst.name} needs an "
                           "importance matrix (llama-quantize refuses it too); narrow --tensors or choose "
                           "another type")
    plan = WritePlan()
    plan.copy_metadata(model)
    if imatrix is not None:
        # the keys describe this run's imatrix: none may survive from an
        # earlier quantization of the input
        for key in list(plan.metadata):
            if key.startswith(IMATRIX_KEY_PREFIX) or key == KEY_IMATRIX_SHA256:
                plan.remove(key)
        for key, value, vtype in imatrix.metadata():
            plan.add(key, value, vtype)
    reports: list[TensorReport] = []
    for t in model:
        if t.name not in importance:
            plan.add_tensor(t.name, t.shape, t.qtype, ByteSource(t.path, t.offset, t.n_bytes))
            continue
        rep = TensorReport(t.name, t.shape, t.qtype, dst, t.n_bytes, t.n_rows * row_nbytes(t.shape[0], dst))
        if imatrix is not None:
            rep.imatrix = importance[t.name] is not None
        plan.add_tensor(t.name, t.shape, dst, RequantSource(model, t, dst, rep, measure_rows, importance[t.name]))
        reports.append(rep)
    return plan, reports


def requant(path: "str | os.PathLike[str]", pattern: str, qtype: "GGMLType | str | int",
            out: "str | os.PathLike[str]", *, force: bool = False, split_max_size: int | None = None,
            split_max_tensors: int | None = None, progress: bool = True,
            measure_rows: int = MEASURE_ROWS,
            imatrix: "Imatrix | str | os.PathLike[str] | None" = None) -> tuple[list[TensorReport], WriteResult]:
    """Requantize the tensors of ``path`` matching ``pattern`` to ``qtype``
    and write ``out`` (atomically: nothing under ``out`` on any error).
    ``imatrix``: an importance matrix file (or one loaded with
    :func:`fle_quant.imatrix.load_imatrix`) to encode with, as
    ``llama-quantize --imatrix`` does."""
    out = Path(out)
    if imatrix is not None and not isinstance(imatrix, Imatrix):
        imatrix = load_imatrix(imatrix)
    with GGUFModel.open(path) as model:
        for p in model.paths:
            try:
                if p.resolve() == out.resolve() or (out.exists() and os.path.samefile(p, out)):
                    raise FleError(f"{out}: is the input file; write the result under another name")
            except OSError:
                pass
        plan, reports = plan_requant(model, pattern, qtype, measure_rows=measure_rows, imatrix=imatrix)
        written = write_gguf(plan, out, split_max_size=split_max_size, split_max_tensors=split_max_tensors,
                             force=force, progress=progress)
    return reports, written


def format_report(reports: list[TensorReport], measure_rows: int = MEASURE_ROWS) -> str:
    """A table: tensor, types, bytes before and after, relative error against
    the source on the first ``measure_rows`` rows, and, when an importance
    matrix was given, whether each tensor had an entry in it."""
    name_w = max([len("tensor")] + [len(r.name) for r in reports])
    err_head = f"rel. error (first {measure_rows:,} rows)"
    with_im = any(r.imatrix is not None for r in reports)
    head = f"{'tensor':<{name_w}}  {'from':>7} -> {'to':<7}  {'bytes before':>14}  {'bytes after':>14}  {err_head}"
    lines = [head + "  imatrix" if with_im else head]
    for r in reports:
        line = (f"{r.name:<{name_w}}  {r.src_type.name:>7} -> {r.dst_type.name:<7}  {r.bytes_before:>14,}  "
                f"{r.bytes_after:>14,}  ")
        if with_im:
            line += f"{r.rel_error:<{len(err_head)}.9e}  {'yes' if r.imatrix else 'none'}"
        else:
            line += f"{r.rel_error:.9e}"
        lines.append(line)
    before = sum(r.bytes_before for r in reports)
    after = sum(r.bytes_after for r in reports)
    lines.append(f"{len(reports)} tensors: {before:,} -> {after:,} bytes ({after - before:+,})")
    if with_im:
        missing = sum(1 for r in reports if not r.imatrix)
        if missing:
            lines.append(f"{missing} of {len(reports)} tensors had no usable entry in the importance matrix and were "
                         "quantized without one, as llama-quantize does")
    return "\n".join(lines)
