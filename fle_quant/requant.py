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
from .quants import DEQUANTIZERS, QUANTIZERS, dequantize, quantize

__all__ = ["MEASURE_ROWS", "TensorReport", "RequantSource", "plan_requant", "requant", "format_report"]

MEASURE_ROWS = 8192
# float32 values decoded per chunk (16 MiB) and values measured at a time in
# float64 (2 x 4 MiB): the working set is a few tens of MiB for any tensor
_CHUNK_VALUES = 4 << 20
_MEASURE_VALUES = 1 << 19


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

    @property
    def rel_error(self) -> float:
        if self.ref_sum > 0:
            return self.err_sum / self.ref_sum
        return 0.0 if self.err_sum == 0 else float("inf")


class RequantSource:
    """A :class:`~fle_quant.gguf_writer.ChunkSource` that yields the target
    encoding of a stored tensor's rows, a chunk of rows at a time, and
    accumulates the relative error on the first ``MEASURE_ROWS`` rows into
    ``report`` as it goes."""

    def __init__(self, model: GGUFModel, t: TensorInfo, dst: GGMLType, report: TensorReport,
                 measure_rows: int = MEASURE_ROWS):
        self.model = model
        self.t = t
        self.dst = dst
        self.report = report
        self.measure_rows = measure_rows
        self.ne0 = t.shape[0] if t.shape else 1
        self.dst_row_bytes = row_nbytes(self.ne0, dst)
        self.n_bytes = t.n_rows * self.dst_row_bytes

    def chunks(self, chunk_size: int) -> Iterator[np.ndarray]:
        rows = self.model.tensor_bytes(self.t.name).reshape(self.t.n_rows, self.t.row_bytes)
        step = max(1, min(chunk_size // self.dst_row_bytes, _CHUNK_VALUES // self.ne0))
        rep = self.report
        rep.rows_measured, rep.err_sum, rep.ref_sum = 0, 0.0, 0.0
        for start in range(0, self.t.n_rows, step):
            stop = min(start + step, self.t.n_rows)
            x = dequantize(rows[start:stop], self.t.qtype)
            q = quantize(x, self.dst)
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
                 measure_rows: int = MEASURE_ROWS) -> tuple[WritePlan, list[TensorReport]]:
    """The write plan of ``model`` with every tensor whose name matches
    ``pattern`` (``re.search``) requantized to ``qtype``, and the reports the
    plan fills in while it is written. The quantizers run without an
    importance matrix."""
    where = model.paths[0]
    dst = parse_type(qtype)
    if dst not in QUANTIZERS:
        known = ", ".join(t.name for t in QUANTIZERS)
        raise FleError(f"FLE cannot quantize to {dst.name}; choose one of {known}")
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
    plan = WritePlan()
    plan.copy_metadata(model)
    reports: list[TensorReport] = []
    names = {t.name for t in matched}
    for t in model:
        if t.name not in names:
            plan.add_tensor(t.name, t.shape, t.qtype, ByteSource(t.path, t.offset, t.n_bytes))
            continue
        rep = TensorReport(t.name, t.shape, t.qtype, dst, t.n_bytes, t.n_rows * row_nbytes(t.shape[0], dst))
        plan.add_tensor(t.name, t.shape, dst, RequantSource(model, t, dst, rep, measure_rows))
        reports.append(rep)
    return plan, reports


def requant(path: "str | os.PathLike[str]", pattern: str, qtype: "GGMLType | str | int",
            out: "str | os.PathLike[str]", *, force: bool = False, split_max_size: int | None = None,
            split_max_tensors: int | None = None, progress: bool = True,
            measure_rows: int = MEASURE_ROWS) -> tuple[list[TensorReport], WriteResult]:
    """Requantize the tensors of ``path`` matching ``pattern`` to ``qtype``
    and write ``out`` (atomically: nothing under ``out`` on any error)."""
    out = Path(out)
    with GGUFModel.open(path) as model:
        for p in model.paths:
            try:
                if p.resolve() == out.resolve() or (out.exists() and os.path.samefile(p, out)):
                    raise FleError(f"{out}: is the input file; write the result under another name")
            except OSError:
                pass
        plan, reports = plan_requant(model, pattern, qtype, measure_rows=measure_rows)
        written = write_gguf(plan, out, split_max_size=split_max_size, split_max_tensors=split_max_tensors,
                             force=force, progress=progress)
    return reports, written


def format_report(reports: list[TensorReport], measure_rows: int = MEASURE_ROWS) -> str:
    """A table: tensor, types, bytes before and after, relative error against
    the source on the first ``measure_rows`` rows."""
    name_w = max([len("tensor")] + [len(r.name) for r in reports])
    lines = [f"{'tensor':<{name_w}}  {'from':>7} -> {'to':<7}  {'bytes before':>14}  {'bytes after':>14}  "
             f"rel. error (first {measure_rows:,} rows)"]
    for r in reports:
        lines.append(f"{r.name:<{name_w}}  {r.src_type.name:>7} -> {r.dst_type.name:<7}  {r.bytes_before:>14,}  "
                     f"{r.bytes_after:>14,}  {r.rel_error:.9e}")
    before = sum(r.bytes_before for r in reports)
    after = sum(r.bytes_after for r in reports)
    lines.append(f"{len(reports)} tensors: {before:,} -> {after:,} bytes ({after - before:+,})")
    return "\n".join(lines)
