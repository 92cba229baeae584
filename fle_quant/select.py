"""Choose, per MoE layer, which file the expert tensors come from.

This is the "decide" step between measuring and splicing: a sensitivity table
(written by the sensitivity tool) says, for every expert layer and every
candidate source, the predicted error and the bytes of that layer's expert
tensors; this module picks one source per layer so that the whole output file
fits a size target with the smallest summed predicted error, or, inversely,
is as small as possible with the summed error under a bound. It reads JSON and
writes JSON and knows nothing about GGUF files or tensors.

Sensitivity table, format ``fle.sensitivity/1`` (one JSON object)::

    {
      "format": "fle.sensitivity/1",
      "reference": {...},          # free-form: what the errors are measured
                                   #   against (file, sha256, tokens, ...)
      "base": "Q4_K_M",            # the candidate everything else comes from
      "fixed_bytes": 4123456789,   # bytes of the output that do not depend on
                                   #   the selection: header, metadata, all
                                   #   non-expert tensors, padding (measured on
                                   #   the base) plus a reserve for provenance
      "alignment": 32,             # the base's general.alignment
      "layers": [
        {"layer": 0,
         "candidates": {
           "Q4_K_M": {"error": 0.0,    "expert_bytes": 1946157056},
           "IQ3_S":  {"error": 0.0123, "expert_bytes": 1387266048}}},
        ...
      ]
    }

``error`` is the predicted relative error |y_Q - y_ref|^2 / |y_ref|^2 of the
layer's output with that source (finite, >= 0; the base's own error, or 0 when
the base is the reference); errors of different layers add up. ``expert_bytes``
is the sum of the layer's expert tensors' sizes, each padded to ``alignment``
(so a multiple of it). Every layer lists the base; a donor may be missing from
a layer, which then cannot take it. Unknown keys are rejected so that a typo
never passes silently; only ``reference`` is free-form. Layer indices need not
be contiguous (models whose first layers are dense have no entry for them).

Selection, format ``fle.selection/1`` (what ``fle-splice`` reads)::

    {
      "format": "fle.selection/1",
      "mode": "target",            # or "max_error"
      "base": "Q4_K_M",
      "layers": {"0": "Q4_K_M", "1": "IQ3_S", ...},   # source per layer
      "predicted_error": 0.0123,   # sum over layers
      "size_bytes": 88870000000,   # fixed_bytes + chosen expert bytes (exact)
      "target_bytes": 88900000000, # mode "target" only
      "max_error": 0.05,           # mode "max_error" only
      "step_bytes": 16000000,
      "table_sha256": "...",       # of the sensitivity table it was made from
      "fixed_bytes": ..., "base_size_bytes": ..., "base_error": ...,
      "layer_errors": {"0": 0.0, ...}, "layer_bytes": {"0": 1946157056, ...}
    }

Every layer of the table appears in ``layers``, by the candidate's name (the
base's own name where the base is kept).

How the choice is made. Each candidate's bytes are rounded up to whole
``step_bytes`` and an exact dynamic programme over the rounded budget finds
the minimum summed error, so the exact size of the chosen mix never exceeds
the target (rounding only ever over-counts). The result is exact over rounded
sizes; a smaller step gets closer to the exact optimum and costs time and
memory in proportion. Ties are broken deterministically: smaller summed error,
then smaller exact size; what still ties is decided per layer from the last
layer backwards, base before donors and donors in name order. In
``max_error`` mode the result is the smallest rounded size whose best error is
within the bound, and within that size the smallest error (then the same
ties).

A target the base alone already meets is refused when no donor predicts a
lower error than the base in any layer: the answer would be the base file
itself, and a user asking for a smaller file most likely mistyped the target.
When some donor is more accurate than the base (a larger quant as donor), a
target above the base size is a real request and is served.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import FleError
from .textio import read_json_file
from .units import format_size

TABLE_FORMAT = "fle.sensitivity/1"
SELECTION_FORMAT = "fle.selection/1"
DEFAULT_STEP_BYTES = 16 * 10**6

# Cells of the dynamic programme (layers x budget steps) allowed before asking
# for a coarser step: the choice matrix is one byte per cell.
_MAX_DP_CELLS = 200_000_000
# Exact sizes of infeasible budget cells: large enough never to win, small
# enough that adding real byte counts cannot overflow int64.
_NO_SIZE = np.int64(2**62)

_TABLE_KEYS = {"format", "reference", "base", "fixed_bytes", "alignment", "layers"}
_LAYER_KEYS = {"layer", "candidates"}
_CANDIDATE_KEYS = {"error", "expert_bytes"}


# --------------------------------------------------------------------------
# The sensitivity table
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class SensitivityTable:
    """A validated sensitivity table as arrays.

    ``names`` lists every candidate, the base first and the donors in name
    order; ``errors[i, j]`` and ``expert_bytes[i, j]`` belong to
    ``layers[i]`` and ``names[j]``, with ``available[i, j]`` False (error inf,
    bytes 0) where layer i does not offer candidate j.
    """

    label: str
    sha256: str
    reference: dict
    base: str
    fixed_bytes: int
    alignment: int
    layers: tuple[int, ...]
    names: tuple[str, ...]
    errors: np.ndarray        # [L, C] float64
    expert_bytes: np.ndarray  # [L, C] int64
    available: np.ndarray     # [L, C] bool

    @property
    def base_size_bytes(self) -> int:
        """Size of the output when every layer keeps the base."""
        return self.fixed_bytes + int(self.expert_bytes[:, 0].sum())

    @property
    def base_error(self) -> float:
        return float(_layer_sum(self.errors[:, 0]))


def _layer_sum(values) -> float:
    """Sum in layer order, the same order the dynamic programme adds in, so
    equal selections give bit-identical totals."""
    total = 0.0
    for v in values:
        total += float(v)
    return total


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_keys(obj: dict, allowed: set, required: set, where: str) -> None:
    for k in obj:
        if k not in allowed:
            raise FleError(f"{where} has an unknown key {k!r}; allowed: {', '.join(sorted(allowed))}")
    for k in sorted(required):
        if k not in obj:
            raise FleError(f"{where} has no {k!r}")


def _check_format(obj, label: str, expected: str, what: str) -> None:
    if not isinstance(obj, dict) or "format" not in obj:
        raise FleError(f"{label}: not a {what} (no \"format\": {json.dumps(expected)} at the top)")
    fmt = obj["format"]
    family = expected.split("/")[0] + "/"
    if isinstance(fmt, str) and fmt.startswith(family) and fmt != expected:
        raise FleError(f"{label}: format {fmt!r} is not known to this FLE, which reads {expected}; "
                       "update FLE or rewrite the file with this version's tools")
    if fmt != expected:
        raise FleError(f"{label}: format is {fmt!r}, not a {what} ({expected})")


def parse_table(obj: Any, label: str = "sensitivity table", sha256: str | None = None) -> SensitivityTable:
    """Validate a decoded sensitivity table (see the module docstring).

    ``label`` starts every error message (the file name, normally);
    ``sha256`` identifies the table in selections and defaults to the hash of
    the object's canonical JSON (sorted keys, no spaces).
    """
    _check_format(obj, label, TABLE_FORMAT, "sensitivity table")
    _check_keys(obj, _TABLE_KEYS, _TABLE_KEYS, label)

    reference = obj["reference"]
    if not isinstance(reference, dict):
        raise FleError(f"{label}: reference must be an object (file, sha256, tokens, ...)")
    base = obj["base"]
    if not isinstance(base, str) or not base:
        raise FleError(f"{label}: base must be the non-empty name of one candidate")
    fixed = obj["fixed_bytes"]
    if not _is_int(fixed) or fixed < 0:
        raise FleError(f"{label}: fixed_bytes must be a whole number of bytes >= 0, got {fixed!r}")
    alignment = obj["alignment"]
    if not _is_int(alignment) or alignment < 1:
        raise FleError(f"{label}: alignment must be a whole number >= 1, got {alignment!r}")
    layers = obj["layers"]
    if not isinstance(layers, list) or not layers:
        raise FleError(f"{label}: layers must be a non-empty list, one entry per expert layer")

    rows: dict[int, dict[str, tuple[float, int]]] = {}
    for i, entry in enumerate(layers):
        where = f"{label}: layers[{i}]"
        if not isinstance(entry, dict):
            raise FleError(f"{where} must be an object with \"layer\" and \"candidates\"")
        _check_keys(entry, _LAYER_KEYS, _LAYER_KEYS, where)
        idx = entry["layer"]
        if not _is_int(idx) or idx < 0:
            raise FleError(f"{where}.layer must be a layer index >= 0, got {idx!r}")
        if idx in rows:
            raise FleError(f"{where}.layer: layer {idx} appears twice")
        cands = entry["candidates"]
        if not isinstance(cands, dict) or not cands:
            raise FleError(f"{where}.candidates must be a non-empty object NAME -> {{error, expert_bytes}}")
        row = {}
        for name, c in cands.items():
            cw = f"{where}.candidates.{name}"
            if not name:
                raise FleError(f"{where}.candidates has an empty name")
            if not isinstance(c, dict):
                raise FleError(f"{cw} must be an object with \"error\" and \"expert_bytes\"")
            _check_keys(c, _CANDIDATE_KEYS, _CANDIDATE_KEYS, cw)
            err, nb = c["error"], c["expert_bytes"]
            if not _is_number(err):
                raise FleError(f"{cw}.error must be a number, got {err!r}")
            err = float(err)
            if math.isnan(err):
                raise FleError(f"{cw}.error is NaN; the measurement failed, measure this layer again")
            if math.isinf(err):
                raise FleError(f"{cw}.error is infinite; the measurement failed, measure this layer again")
            if err < 0:
                raise FleError(f"{cw}.error is negative ({err!r}); an error is a squared norm ratio, >= 0")
            if not _is_int(nb) or nb < 0:
                raise FleError(f"{cw}.expert_bytes must be a whole number of bytes >= 0, got {nb!r}")
            if nb % alignment:
                raise FleError(f"{cw}.expert_bytes {nb} is not a multiple of the alignment {alignment}; "
                               "each expert tensor is padded to it")
            row[name] = (err, nb)
        if base not in row:
            raise FleError(f"{where}.candidates has no entry for the base {base!r}; every layer must list the base")
        rows[idx] = row

    if sha256 is None:
        canon = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
        sha256 = hashlib.sha256(canon.encode("utf-8")).hexdigest()
    donors = sorted({n for row in rows.values() for n in row} - {base})
    names = (base, *donors)
    col = {n: j for j, n in enumerate(names)}
    order = sorted(rows)
    errors = np.full((len(order), len(names)), np.inf)
    nbytes = np.zeros((len(order), len(names)), dtype=np.int64)
    avail = np.zeros((len(order), len(names)), dtype=bool)
    for i, idx in enumerate(order):
        for name, (err, nb) in rows[idx].items():
            errors[i, col[name]] = err
            nbytes[i, col[name]] = nb
            avail[i, col[name]] = True
    return SensitivityTable(label=label, sha256=sha256, reference=reference, base=base,
                            fixed_bytes=fixed, alignment=alignment, layers=tuple(order),
                            names=names, errors=errors, expert_bytes=nbytes, available=avail)


def load_table(path) -> SensitivityTable:
    """Read and validate a sensitivity table file; its sha256 is the file's."""
    obj, raw = read_json_file(path, "sensitivity table")
    return parse_table(obj, os.fspath(path), hashlib.sha256(raw).hexdigest())


# --------------------------------------------------------------------------
# The selection
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Selection:
    """One source per expert layer, with what the table predicts for it."""

    mode: str                       # "target" or "max_error"
    base: str
    sources: dict[int, str]         # layer -> candidate name
    layer_errors: dict[int, float]
    layer_bytes: dict[int, int]
    predicted_error: float          # sum over layers
    size_bytes: int                 # fixed_bytes + sum(layer_bytes), exact
    fixed_bytes: int
    step_bytes: int
    table_sha256: str
    base_size_bytes: int            # the output with the base in every layer
    base_error: float
    target_bytes: int | None = None
    max_error: float | None = None

    @property
    def donor_layer_counts(self) -> dict[str, int]:
        """Layers taken from each donor, donors in name order."""
        counts: dict[str, int] = {}
        for s in self.sources.values():
            if s != self.base:
                counts[s] = counts.get(s, 0) + 1
        return dict(sorted(counts.items()))

    @property
    def n_donor_layers(self) -> int:
        return sum(self.donor_layer_counts.values())

    def to_json(self) -> dict:
        out: dict[str, Any] = {
            "format": SELECTION_FORMAT,
            "mode": self.mode,
            "base": self.base,
            "layers": {str(k): v for k, v in self.sources.items()},
            "predicted_error": self.predicted_error,
            "size_bytes": self.size_bytes,
        }
        if self.mode == "target":
            out["target_bytes"] = self.target_bytes
        else:
            out["max_error"] = self.max_error
        out.update({
            "step_bytes": self.step_bytes,
            "table_sha256": self.table_sha256,
            "fixed_bytes": self.fixed_bytes,
            "base_size_bytes": self.base_size_bytes,
            "base_error": self.base_error,
            "layer_errors": {str(k): v for k, v in self.layer_errors.items()},
            "layer_bytes": {str(k): v for k, v in self.layer_bytes.items()},
        })
        return out


_SEL_REQUIRED = {"format", "mode", "base", "layers", "predicted_error", "size_bytes", "step_bytes",
                 "table_sha256", "fixed_bytes", "base_size_bytes", "base_error", "layer_errors",
                 "layer_bytes"}
_SEL_KEYS = _SEL_REQUIRED | {"target_bytes", "max_error"}
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_LAYER_KEY_RE = re.compile(r"^(0|[1-9][0-9]*)$")


def parse_selection(obj: Any, label: str = "selection") -> Selection:
    """Validate a decoded selection (see the module docstring)."""
    _check_format(obj, label, SELECTION_FORMAT, "selection")
    _check_keys(obj, _SEL_KEYS, _SEL_REQUIRED, label)
    mode = obj["mode"]
    if mode not in ("target", "max_error"):
        raise FleError(f"{label}: mode must be \"target\" or \"max_error\", got {mode!r}")
    other = "max_error" if mode == "target" else "target_bytes"
    mine = "target_bytes" if mode == "target" else "max_error"
    if mine not in obj:
        raise FleError(f"{label}: mode {mode!r} needs {mine!r}")
    if other in obj:
        raise FleError(f"{label}: mode {mode!r} does not take {other!r}")
    base = obj["base"]
    if not isinstance(base, str) or not base:
        raise FleError(f"{label}: base must be a non-empty candidate name")
    if not isinstance(obj["table_sha256"], str) or not _SHA_RE.match(obj["table_sha256"]):
        raise FleError(f"{label}: table_sha256 must be 64 lower-case hex digits")
    for k in ("size_bytes", "fixed_bytes", "base_size_bytes"):
        if not _is_int(obj[k]) or obj[k] < 0:
            raise FleError(f"{label}: {k} must be a whole number of bytes >= 0, got {obj[k]!r}")
    if not _is_int(obj["step_bytes"]) or obj["step_bytes"] < 1:
        raise FleError(f"{label}: step_bytes must be a whole number >= 1, got {obj['step_bytes']!r}")
    for k in ("predicted_error", "base_error") + (("max_error",) if mode == "max_error" else ()):
        v = obj[k]
        if not _is_number(v) or not math.isfinite(v) or v < 0:
            raise FleError(f"{label}: {k} must be a finite number >= 0, got {v!r}")
    if mode == "target" and (not _is_int(obj["target_bytes"]) or obj["target_bytes"] < 1):
        raise FleError(f"{label}: target_bytes must be a whole number of bytes >= 1, got {obj['target_bytes']!r}")

    def per_layer(key, check, what):
        d = obj[key]
        if not isinstance(d, dict) or not d:
            raise FleError(f"{label}: {key} must be a non-empty object LAYER -> {what}")
        out = {}
        for k, v in d.items():
            if not _LAYER_KEY_RE.match(k):
                raise FleError(f"{label}: {key} has key {k!r}, not a layer index")
            if not check(v):
                raise FleError(f"{label}: {key}.{k} must be {what}, got {v!r}")
            out[int(k)] = v
        return dict(sorted(out.items()))

    sources = per_layer("layers", lambda v: isinstance(v, str) and bool(v), "a candidate name")
    errors = per_layer("layer_errors", lambda v: _is_number(v) and math.isfinite(v) and v >= 0,
                       "a finite error >= 0")
    nbytes = per_layer("layer_bytes", lambda v: _is_int(v) and v >= 0, "a whole number of bytes >= 0")
    if not (sources.keys() == errors.keys() == nbytes.keys()):
        raise FleError(f"{label}: layers, layer_errors and layer_bytes must name the same layers")
    total = obj["fixed_bytes"] + sum(nbytes.values())
    if total != obj["size_bytes"]:
        raise FleError(f"{label}: size_bytes {obj['size_bytes']} is not fixed_bytes plus the layer bytes "
                       f"({total}); the file was edited, make it again with fle-select")
    summed = _layer_sum(errors.values())
    if not math.isclose(summed, obj["predicted_error"], rel_tol=1e-9, abs_tol=1e-12):
        raise FleError(f"{label}: predicted_error {obj['predicted_error']!r} is not the sum of layer_errors "
                       f"({summed!r}); the file was edited, make it again with fle-select")
    return Selection(mode=mode, base=base, sources=sources, layer_errors={k: float(v) for k, v in errors.items()},
                     layer_bytes=nbytes, predicted_error=float(obj["predicted_error"]),
                     size_bytes=obj["size_bytes"], fixed_bytes=obj["fixed_bytes"],
                     step_bytes=obj["step_bytes"], table_sha256=obj["table_sha256"],
                     base_size_bytes=obj["base_size_bytes"], base_error=float(obj["base_error"]),
                     target_bytes=obj.get("target_bytes"),
                     max_error=float(obj["max_error"]) if mode == "max_error" else None)


def load_selection(path) -> Selection:
    """Read and validate a selection file written by ``fle-select``."""
    obj, _ = read_json_file(path, "selection")
    return parse_selection(obj, os.fspath(path))


# --------------------------------------------------------------------------
# The dynamic programme
# --------------------------------------------------------------------------

def _rounded_steps(table: SensitivityTable, step_bytes: int) -> np.ndarray:
    """Candidate bytes rounded up to whole steps; -1 where not offered."""
    if not _is_int(step_bytes) or step_bytes < 1:
        raise FleError(f"step must be a whole number of bytes >= 1, got {step_bytes!r}")
    w = -(-table.expert_bytes // step_bytes)
    return np.where(table.available, w, -1)


def _solve(table: SensitivityTable, w: np.ndarray, n_budget: int):
    """Minimum (summed error, exact bytes) over selections whose rounded steps,
    less each layer's smallest, add up to at most b, for b in [0, n_budget).

    w: [L, C] rounded steps with each layer's minimum already subtracted, -1
    where unavailable. Returns E [n], S [n] and the choice matrix [L, n].
    """
    L, C = w.shape
    if L * n_budget > _MAX_DP_CELLS:
        raise FleError(f"step too small for this table: {L} layers x {n_budget} budget steps; "
                       "use a larger step (16MB is plenty for models over 10 GB)")
    E = np.zeros(n_budget)
    S = np.zeros(n_budget, dtype=np.int64)
    choice = np.empty((L, n_budget), dtype=np.int8 if C < 128 else np.int16)
    for i in range(L):
        newE = np.full(n_budget, np.inf)
        newS = np.full(n_budget, _NO_SIZE, dtype=np.int64)
        ch = choice[i]
        ch.fill(-1)
        # base first, then donors in name order: a later candidate replaces an
        # earlier one only when strictly better, which is the tie rule
        for j in range(C):
            k = int(w[i, j])
            if k < 0 or k >= n_budget:
                continue
            cE = E[: n_budget - k] + table.errors[i, j]
            cS = S[: n_budget - k] + table.expert_bytes[i, j]
            tE, tS = newE[k:], newS[k:]
            better = (cE < tE) | ((cE == tE) & (cS < tS))
            tE[better] = cE[better]
            tS[better] = cS[better]
            ch[k:][better] = j
        E, S = newE, newS
    return E, S, choice


def _backtrack(table, w, choice, b: int) -> list[int]:
    picks = [0] * len(table.layers)
    for i in range(len(table.layers) - 1, -1, -1):
        j = int(choice[i, b])
        assert j >= 0, "budget cell without a choice"
        picks[i] = j
        b -= int(w[i, j])
    return picks


def _make_selection(table, picks, mode, step_bytes, target_bytes=None, max_error=None) -> Selection:
    rows = range(len(table.layers))
    errs = [float(table.errors[i, j]) for i, j in zip(rows, picks)]
    nb = [int(table.expert_bytes[i, j]) for i, j in zip(rows, picks)]
    return Selection(
        mode=mode, base=table.base,
        sources={table.layers[i]: table.names[j] for i, j in zip(rows, picks)},
        layer_errors=dict(zip(table.layers, errs)),
        layer_bytes=dict(zip(table.layers, nb)),
        predicted_error=_layer_sum(errs),
        size_bytes=table.fixed_bytes + sum(nb),
        fixed_bytes=table.fixed_bytes, step_bytes=step_bytes, table_sha256=table.sha256,
        base_size_bytes=table.base_size_bytes, base_error=table.base_error,
        target_bytes=target_bytes, max_error=max_error)


def select_for_target(table: SensitivityTable, target_bytes: int,
                      step_bytes: int = DEFAULT_STEP_BYTES) -> Selection:
    """The smallest summed predicted error whose whole output file is at most
    ``target_bytes`` (decimal bytes, the file as written, fixed part included).

    Raises FleError when no selection fits, or when the base alone fits and no
    donor is more accurate than the base anywhere (nothing to select).
    """
    if not _is_int(target_bytes) or target_bytes < 1:
        raise FleError(f"target must be a whole number of bytes >= 1, got {target_bytes!r}")
    w = _rounded_steps(table, step_bytes)
    wmin = np.where(table.available, w, np.iinfo(np.int64).max).min(axis=1)
    wrel = np.where(table.available, w - wmin[:, None], -1)

    smallest_exact = table.fixed_bytes + int(np.where(table.available, table.expert_bytes,
                                                      np.iinfo(np.int64).max).min(axis=1).sum())
    smallest_rounded = table.fixed_bytes + int(wmin.sum()) * step_bytes
    if target_bytes < smallest_rounded:
        if target_bytes < smallest_exact:
            raise FleError(f"target {format_size(target_bytes)} is below the smallest file these donors allow, "
                           f"{format_size(smallest_exact)}; set a larger target or offer smaller donors")
        raise FleError(f"target {format_size(target_bytes)} is below the smallest file these donors allow "
                       f"with sizes rounded up to {format_size(step_bytes)} steps, "
                       f"{format_size(smallest_rounded)}; use a smaller step or a larger target")
    base_better_everywhere = bool(np.all(table.errors[:, 1:] >= table.errors[:, :1]))
    if target_bytes >= table.base_size_bytes and base_better_everywhere:
        raise FleError(f"the base alone is {format_size(table.base_size_bytes)}, within the target "
                       f"{format_size(target_bytes)}, and no donor is more accurate than the base: nothing to "
                       "select; use the base file as it is, or set a target below its size")

    budget = (target_bytes - table.fixed_bytes) // step_bytes - int(wmin.sum())
    n = min(budget, int(np.where(table.available, wrel, 0).max(axis=1).sum())) + 1
    E, S, choice = _solve(table, wrel, n)
    picks = _backtrack(table, wrel, choice, n - 1)
    return _make_selection(table, picks, "target", step_bytes, target_bytes=target_bytes)


def select_for_error(table: SensitivityTable, max_error: float,
                     step_bytes: int = DEFAULT_STEP_BYTES) -> Selection:
    """The smallest output (in rounded sizes) whose summed predicted error is
    at most ``max_error``; among equally small ones, the smallest error.

    Raises FleError for a negative or non-finite bound and for a bound below
    the smallest error any selection reaches.
    """
    if not _is_number(max_error) or math.isnan(max_error):
        raise FleError(f"max error must be a number, got {max_error!r}")
    max_error = float(max_error)
    if max_error < 0:
        raise FleError(f"max error {max_error!r} is negative; the summed predicted error is >= 0")
    w = _rounded_steps(table, step_bytes)
    wmin = np.where(table.available, w, np.iinfo(np.int64).max).min(axis=1)
    wrel = np.where(table.available, w - wmin[:, None], -1)
    n = int(np.where(table.available, wrel, 0).max(axis=1).sum()) + 1
    E, S, choice = _solve(table, wrel, n)
    ok = np.flatnonzero(E <= max_error)
    if ok.size == 0:
        raise FleError(f"no selection reaches a predicted error of {max_error:.6g}; the smallest possible "
                       f"is {E[-1]:.6g}; set a larger max error")
    picks = _backtrack(table, wrel, choice, int(ok[0]))
    return _make_selection(table, picks, "max_error", step_bytes, max_error=max_error)


# --------------------------------------------------------------------------
# Presentation
# --------------------------------------------------------------------------

def format_selection(sel: Selection) -> str:
    """A per-layer table, the totals and the donor-layer counts."""
    name_w = max(len("source"), *(len(s) for s in sel.sources.values()))
    lines = [f"{'layer':>5}  {'source':<{name_w}}  {'error':>10}  {'expert bytes':>12}"]
    for layer, src in sel.sources.items():
        mark = "" if src == sel.base else "  *"
        lines.append(f"{layer:>5}  {src:<{name_w}}  {sel.layer_errors[layer]:>10.4g}  "
                     f"{format_size(sel.layer_bytes[layer]):>12}{mark}")
    lines.append("")
    if sel.mode == "target":
        goal = f"target {format_size(sel.target_bytes)}"
    else:
        goal = f"max error {sel.max_error:.6g}"
    saved = sel.base_size_bytes - sel.size_bytes
    lines.append(f"size:            {format_size(sel.size_bytes)} ({sel.size_bytes} bytes; {goal}, "
                 f"step {format_size(sel.step_bytes)})")
    lines.append(f"base alone:      {format_size(sel.base_size_bytes)} "
                 f"({'saves' if saved >= 0 else 'adds'} {format_size(abs(saved))})")
    lines.append(f"predicted error: {sel.predicted_error:.6g} (base alone {sel.base_error:.6g})")
    counts = sel.donor_layer_counts
    detail = ", ".join(f"{n} {c}" for n, c in counts.items())
    lines.append(f"donor layers:    {sel.n_donor_layers} of {len(sel.sources)}"
                 + (f" ({detail})" if detail else "") + f"; the rest from the base {sel.base}")
    return "\n".join(lines)
