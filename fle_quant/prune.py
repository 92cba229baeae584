"""Expert pruning: remove the lowest-scored routed experts of every MoE layer.

Three separate steps, passing plain data:

1. measure (not here): a scoring tool writes an expert score table;
2. decide: :func:`choose_kept` picks, per layer, the ``keep`` experts with the
   highest scores;
3. apply: :func:`plan_prune` turns a model and the kept indices into a
   :class:`~fle_quant.gguf_writer.WritePlan` whose expert tensors are byte
   copies of the kept experts' slices, and :func:`prune` writes it.

Score table, format ``fle.scores/1`` (one JSON object)::

    {
      "format": "fle.scores/1",
      "method": "reap",            # how the scores were measured: reap, man,
                                   #   frequency, ... (free text, recorded)
      "model": "model.gguf",       # the file the scores were measured on
      "tokens": 131072,            # tokens the scores were measured over
      "layers": {                  # per MoE layer: one score per expert,
        "0": [0.91, 0.02, ...],    #   higher = more important
        ...
        "48": [...]                # an MTP block under its block index
      },
      "info": {...}                # optional, free-form
    }

Every MoE layer of a file being pruned needs an entry of exactly
``expert_count`` finite numbers; unknown keys are rejected so that a typo
never passes silently. The scores of a separate MTP-head file are either in
the trunk's table under the head's block index or in a table of its own.

What pruning changes, per MoE layer (same ``keep`` in every layer, since
``{arch}.expert_count`` is one number per file):

- every per-expert tensor: the stacked ``ffn_{gate,up,down,gate_up}_exps``
  weights and their per-expert biases and scales (expert index = the last
  ggml dimension), the router ``ffn_gate_inp`` (ggml [n_embd, n_expert]: one
  row per expert) with its bias, and ``exp_probs_b``: the kept experts'
  slices, byte for byte, in ascending original index order, whatever the
  quant type (a 1-D per-expert tensor needs a type of one value per block);
- ``{arch}.expert_count`` = ``keep``;
- provenance: ``fle.reap.kept.{layer}`` (int32 array of the kept experts'
  indices in the original model), ``fle.reap.method``,
  ``fle.reap.scores_sha256`` (of the score table file) and
  ``fle.reap.original_expert_count``. Pruning a pruned model composes the
  indices, so they always refer to the original model's experts.

Everything else (metadata, every other tensor, tensor order, alignment) is
copied byte for byte. Ties: experts with equal scores are ranked by index,
the lower index first, so the lower index is kept; the choice never depends
on anything but the scores.

This module reads GGUF headers and scores; tensor bytes are never loaded,
only copied by the writer from their byte ranges.
"""
from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .errors import FleError
from .files import check_output_path
from .textio import read_json_file
from .ggml_types import BLOCK_GEOMETRY
from .gguf_format import GGUFValueType
from .gguf_reader import GGUFModel, TensorInfo
from .gguf_writer import ByteSource, WritePlan, WriteResult, write_gguf

__all__ = [
    "SCORES_FORMAT",
    "Scores",
    "LayerPrune",
    "PrunePlan",
    "PruneResult",
    "load_scores",
    "parse_scores",
    "choose_kept",
    "expert_tensors",
    "plan_prune",
    "prune",
]

SCORES_FORMAT = "fle.scores/1"
KEY_PREFIX = "fle.reap."

# Per-expert tensor kinds, named as in llama.cpp's src/llama-arch.cpp (the part
# between "blk.N." and the ".weight"/".bias"/... suffix). Their last ggml
# dimension is the expert index.
_PER_EXPERT = frozenset({
    "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps",
    "ffn_gate_inp", "exp_probs_b", "exp_probs_b_vl",
})
# Expert-indexed tensors FLE cannot prune by slicing: grouped chunk experts
# index groups, not experts; a token -> expert table holds expert indices.
_UNPRUNABLE = frozenset({"ffn_gate_chexps", "ffn_up_chexps", "ffn_down_chexps", "ffn_gate_tid2eid"})
# "_exps" in the name but one vector per layer, not per expert (arctic)
_NOT_PER_EXPERT = frozenset({"ffn_norm_exps"})
_SUFFIXES = ("weight", "bias", "scale", "input_scale")
_BLK = re.compile(r"^blk\.(0|[1-9][0-9]*)\.(.+)$")
_LAYER_KEY = re.compile(r"^(0|[1-9][0-9]*)$")
_SCORE_KEYS = {"format", "method", "model", "tokens", "layers", "info"}


# ---------------------------------------------------------------------------
# scores


@dataclass(frozen=True)
class Scores:
    """A validated score table: per layer, one float64 score per expert."""

    method: str
    model: str
    tokens: int
    layers: dict[int, np.ndarray]
    sha256: str
    source: str  # where it came from, for messages
    fingerprints: tuple = ()  # (model, MTP head) fingerprints recorded by fle-reap score, when present


def load_scores(path: "str | os.PathLike[str]") -> Scores:
    """Read and validate a score table file; its sha256 is the file's."""
    label = os.fspath(path)
    obj, raw = read_json_file(path, "score table",
                              missing_hint=f"give the expert score table (format {SCORES_FORMAT})")
    return parse_scores(obj, hashlib.sha256(raw).hexdigest(), label)


def parse_scores(obj: Any, sha256: str = "", source: str = "scores") -> Scores:
    """Validate a decoded ``fle.scores/1`` object (see the module docstring)."""
    where = source
    if not isinstance(obj, dict):
        raise FleError(f"{where}: a score table is a JSON object, got {type(obj).__name__}")
    for k in obj:
        if k not in _SCORE_KEYS:
            raise FleError(f"{where}: unknown key {k!r}; allowed: {', '.join(sorted(_SCORE_KEYS))}")
    for k in ("format", "method", "model", "tokens", "layers"):
        if k not in obj:
            raise FleError(f"{where}: missing key {k!r}; a {SCORES_FORMAT} table needs format, method, model, "
                           "tokens and layers")
    if obj["format"] != SCORES_FORMAT:
        raise FleError(f"{where}: format is {obj['format']!r}, expected {SCORES_FORMAT!r}")
    method, model, tokens, layers = obj["method"], obj["model"], obj["tokens"], obj["layers"]
    if not isinstance(method, str) or not method.strip():
        raise FleError(f"{where}: method must be a non-empty string (reap, man, frequency, ...), got {method!r}")
    if not isinstance(model, str):
        raise FleError(f"{where}: model must be a string (the file the scores were measured on), got {model!r}")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise FleError(f"{where}: tokens must be a non-negative integer, got {tokens!r}")
    if "info" in obj and not isinstance(obj["info"], dict):
        raise FleError(f"{where}: info must be a JSON object, got {type(obj['info']).__name__}")
    if not isinstance(layers, dict) or not layers:
        raise FleError(f"{where}: layers must be a non-empty object mapping layer index to a list of scores")
    out: dict[int, np.ndarray] = {}
    for key, values in layers.items():
        if not isinstance(key, str) or not _LAYER_KEY.match(key):
            raise FleError(f"{where}: layers key {key!r} is not a layer index (a decimal integer like \"0\")")
        lw = f"{where}: layers[{key!r}]"
        if not isinstance(values, list) or not values:
            raise FleError(f"{lw} must be a non-empty list of numbers, one per expert")
        for i, v in enumerate(values):
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise FleError(f"{lw}[{i}] is {v!r}, not a number")
            if not math.isfinite(v):
                raise FleError(f"{lw}[{i}] is {v!r}; scores must be finite numbers")
        out[int(key)] = np.asarray(values, dtype=np.float64)
    info = obj.get("info") or {}
    fps = tuple(info.get(k) for k in ("model_fingerprint", "mtp_head_fingerprint"))
    for k, v in zip(("model_fingerprint", "mtp_head_fingerprint"), fps):
        if v is not None and not (isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v)):
            raise FleError(f"{where}: info.{k} must be a SHA-256 in hex (as fle-reap score writes it), got {v!r}")
    return Scores(method=method, model=model, tokens=tokens, layers=dict(sorted(out.items())),
                  sha256=sha256, source=source, fingerprints=fps)


def check_scores_match(scores: Scores, model: GGUFModel, head: "GGUFModel | None" = None) -> None:
    """A table that records the fingerprint of the model it was measured on
    (fle-reap score does) must be that of ``model`` (and of ``head``, the
    separate MTP head it was scored with)."""
    from .digest import model_fingerprint

    fp_model, fp_head = scores.fingerprints or (None, None)
    for fp, m, what in ((fp_model, model, "model"), (fp_head, head, "MTP head")):
        if fp is not None and m is not None and model_fingerprint(m) != fp:
            raise FleError(f"{scores.source}: these scores were measured on another {what} than {m.paths[0]} "
                           f"(its fingerprint differs); score this file with fle-reap score")


_SAME_MODEL_KEYS = ("embedding_length", "expert_count", "expert_feed_forward_length", "vocab_size")


def check_head_matches(model: GGUFModel, head: GGUFModel) -> None:
    """A separate MTP head must belong to ``model``: the same width, experts,
    expert width and vocabulary."""
    for k in _SAME_MODEL_KEYS:
        a, b = model.hparam(k, None), head.hparam(k, None)
        if a is not None and b is not None and a != b:
            raise FleError(f"{head.paths[0]}: {head.arch}.{k} = {b}, but the model {model.paths[0]} has {a}; "
                           f"give the MTP head made for this model")


# ---------------------------------------------------------------------------
# decide


def choose_kept(scores: Sequence[float], keep: int) -> list[int]:
    """Indices of the ``keep`` highest scores, ascending. Equal scores rank by
    index, lower first, so on a tie the lower index is kept."""
    s = np.asarray(scores, dtype=np.float64)
    if not 0 < keep <= len(s):
        raise FleError(f"keep = {keep} must be between 1 and the {len(s)} experts")
    # lexsort: last key primary; -s descending, then index ascending
    order = np.lexsort((np.arange(len(s)), -s))
    return sorted(int(e) for e in order[:keep])


# ---------------------------------------------------------------------------
# apply


def _kind(name: str) -> tuple[int, str] | None:
    """(layer, kind) of ``blk.N.kind[.suffix]``, or None outside blocks."""
    m = _BLK.match(name)
    if m is None:
        return None
    rest = m.group(2)
    head, dot, tail = rest.rpartition(".")
    kind = head if dot and tail in _SUFFIXES else rest
    return int(m.group(1)), kind


def expert_tensors(model: GGUFModel) -> dict[int, list[TensorInfo]]:
    """Per layer, the tensors indexed by expert (see the module docstring),
    in file order. Raises FleError for expert-indexed tensors FLE cannot
    prune and for names that look per-expert but are unknown."""
    out: dict[int, list[TensorInfo]] = {}
    for t in model:
        lk = _kind(t.name)
        if lk is None:
            continue
        layer, kind = lk
        if kind in _UNPRUNABLE:
            raise FleError(f"{model.paths[0]}: tensor {t.name!r} indexes experts in a way FLE cannot prune "
                           "(grouped chunk experts or hash routing)")
        if kind in _PER_EXPERT:
            out.setdefault(layer, []).append(t)
        elif kind.endswith("_exps") and kind not in _NOT_PER_EXPERT:
            raise FleError(f"{model.paths[0]}: tensor {t.name!r} looks like an expert tensor but FLE does not "
                           "know how to prune it; no output was written")
    return out


@dataclass(frozen=True)
class LayerPrune:
    """What pruning does to one layer. Indices here are the file's own
    (``kept``, ``removed``) and the original model's (``kept_original``)."""

    layer: int
    kept: list[int]
    removed: list[int]
    kept_original: list[int]
    scores: np.ndarray = field(repr=False)


@dataclass
class PrunePlan:
    path: Path
    plan: WritePlan
    n_expert: int
    keep: int
    layers: dict[int, LayerPrune]


def _slices(model: GGUFModel, t: TensorInfo, n_expert: int, kept: Sequence[int]) -> list[ByteSource]:
    """One byte range per kept expert: the expert index is the last ggml
    dimension, so each expert's part of the tensor is contiguous."""
    if t.shape[-1] != n_expert:
        raise FleError(f"{model.paths[0]}: tensor {t.name!r} has shape {list(t.shape)}; its last dimension "
                       f"should be the expert count {n_expert}")
    if len(t.shape) == 1 and BLOCK_GEOMETRY[t.qtype][0] != 1:
        raise FleError(f"{model.paths[0]}: tensor {t.name!r} is a {t.qtype.name} vector: one expert's entry is "
                       "not a whole block, so it cannot be cut; requantize it to F32 first")
    size = t.n_bytes // n_expert
    return [ByteSource(t.path, t.offset + e * size, size) for e in kept]


def _previous_kept(model: GGUFModel, layer: int, n_expert: int) -> list[int]:
    """The original indices of this file's experts: identity, or what an
    earlier pruning recorded."""
    prev = model.metadata.get(f"{KEY_PREFIX}kept.{layer}")
    if prev is None:
        return list(range(n_expert))
    if not isinstance(prev, list) or len(prev) != n_expert:
        raise FleError(f"{model.paths[0]}: metadata {KEY_PREFIX}kept.{layer} does not list {n_expert} experts; "
                       "the file's pruning record is inconsistent")
    return [int(v) for v in prev]


def plan_prune(model: GGUFModel, scores: Scores, keep: int) -> PrunePlan:
    """The write plan of ``model`` with ``keep`` experts per MoE layer, chosen
    by ``scores`` (which must hold every MoE layer of the model)."""
    where = model.paths[0]
    n_expert = int(model.hparam("expert_count"))
    n_used = int(model.hparam("expert_used_count"))
    groups = int(model.hparam("expert_group_count", 0) or 0)
    if groups > 1:
        raise FleError(f"{where}: {model.arch}.expert_group_count = {groups}: group-limited routing needs the "
                       "same experts per group; FLE does not prune such models")
    if keep >= n_expert:
        raise FleError(f"{where}: --keep {keep} keeps every one of the {n_expert} experts; nothing to do "
                       f"(choose a keep below {n_expert})")
    if keep < n_used:
        raise FleError(f"{where}: --keep {keep} is below {model.arch}.expert_used_count = {n_used}; every token "
                       f"routes to {n_used} experts, so keep at least {n_used}")
    per_layer = expert_tensors(model)
    if not per_layer:
        raise FleError(f"{where}: no MoE layer (no blk.N.ffn_gate_inp or *_exps tensors); nothing to prune")
    layers: dict[int, LayerPrune] = {}
    for layer in sorted(per_layer):
        s = scores.layers.get(layer)
        if s is None:
            have = ", ".join(map(str, scores.layers)) or "none"
            raise FleError(f"{scores.source}: layers has no entry \"{layer}\" for MoE layer {layer} of {where} "
                           f"(it has layers {have}); score every MoE layer")
        if len(s) != n_expert:
            raise FleError(f"{scores.source}: layers[\"{layer}\"] has {len(s)} scores but {where} has "
                           f"{n_expert} experts per layer")
        kept = choose_kept(s, keep)
        removed = sorted(set(range(n_expert)) - set(kept))
        prev = _previous_kept(model, layer, n_expert)
        layers[layer] = LayerPrune(layer, kept, removed, [prev[e] for e in kept], s)

    plan = WritePlan()
    plan.copy_metadata(model)
    plan.add(f"{model.arch}.expert_count", keep, model.metadata_types[f"{model.arch}.expert_count"][0])
    original = int(model.metadata.get(f"{KEY_PREFIX}original_expert_count", n_expert))
    plan.add_string(f"{KEY_PREFIX}method", scores.method)
    plan.add_string(f"{KEY_PREFIX}scores_sha256", scores.sha256)
    plan.add_uint32(f"{KEY_PREFIX}original_expert_count", original)
    for layer, lp in layers.items():
        plan.add_array(f"{KEY_PREFIX}kept.{layer}", lp.kept_original, GGUFValueType.INT32)
    pruned = {t.name for ts in per_layer.values() for t in ts}
    for t in model:
        if t.name in pruned:
            layer = _kind(t.name)[0]
            plan.add_tensor(t.name, t.shape[:-1] + (keep,), t.qtype,
                            _slices(model, t, n_expert, layers[layer].kept))
        else:
            plan.add_tensor(t.name, t.shape, t.qtype, ByteSource(t.path, t.offset, t.n_bytes))
    return PrunePlan(path=Path(where), plan=plan, n_expert=n_expert, keep=keep, layers=layers)


@dataclass
class PruneResult:
    trunk: PrunePlan
    trunk_written: WriteResult
    head: PrunePlan | None = None
    head_written: WriteResult | None = None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def prune(
    model_path: "str | os.PathLike[str]",
    scores: "Scores | str | os.PathLike[str]",
    keep: int,
    out: "str | os.PathLike[str]",
    *,
    mtp_head: "str | os.PathLike[str] | None" = None,
    mtp_out: "str | os.PathLike[str] | None" = None,
    mtp_scores: "Scores | str | os.PathLike[str] | None" = None,
    split_max_size: int | None = None,
    split_max_tensors: int | None = None,
    force: bool = False,
    progress: bool = True,
) -> PruneResult:
    """Prune ``model_path`` (any shard) to ``keep`` experts per MoE layer and
    write ``out``; with ``mtp_head``, prune that separate MTP-head file the
    same way (by ``mtp_scores``, default the trunk's table) into ``mtp_out``.

    Everything is validated before anything is written; if writing the head
    fails, the trunk just written is removed again.
    """
    if (mtp_head is None) != (mtp_out is None):
        raise FleError("--mtp-head and --mtp-out go together: give the MTP-head file and where to write it pruned")
    if mtp_scores is not None and mtp_head is None:
        raise FleError("--mtp-scores is for a separate MTP-head file; give --mtp-head and --mtp-out too")
    trunk_scores = scores if isinstance(scores, Scores) else load_scores(scores)
    head_scores = trunk_scores
    if mtp_scores is not None:
        head_scores = mtp_scores if isinstance(mtp_scores, Scores) else load_scores(mtp_scores)
    out = Path(out)
    outputs = [out] + ([Path(mtp_out)] if mtp_out is not None else [])
    inputs = [Path(model_path)] + ([Path(mtp_head)] if mtp_head is not None else [])
    if len(outputs) == 2 and _same_file(outputs[0], outputs[1]):
        raise FleError(f"{outputs[1]}: the pruned MTP head and the pruned model need different output names")
    with GGUFModel.open(model_path) as model:
        for o in outputs:
            for p in list(model.paths) + inputs[1:]:
                if _same_file(p, o):
                    raise FleError(f"{o}: is an input file; write the pruned model under another name")
        trunk = plan_prune(model, trunk_scores, keep)
        head_model = GGUFModel.open(mtp_head) if mtp_head is not None else None
        try:
            check_scores_match(trunk_scores, model, head_model if head_scores is trunk_scores else None)
            if head_model is not None:
                check_head_matches(model, head_model)
                if head_scores is not trunk_scores:
                    check_scores_match(head_scores, head_model)
            head = plan_prune(head_model, head_scores, keep) if head_model is not None else None
            _check_all_used(trunk_scores, head_scores, trunk, head)
            for o in outputs:
                check_output_path(o, force)
            written = write_gguf(trunk.plan, out, split_max_size=split_max_size,
                                 split_max_tensors=split_max_tensors, force=force, progress=progress)
            result = PruneResult(trunk, written)
            if head is not None:
                try:
                    result.head = head
                    result.head_written = write_gguf(head.plan, mtp_out, split_max_size=split_max_size,
                                                     split_max_tensors=split_max_tensors, force=force,
                                                     progress=progress)
                except BaseException:
                    for p in written.paths:
                        p.unlink(missing_ok=True)
                    raise
            return result
        finally:
            if head_model is not None:
                head_model.close()


def _check_all_used(trunk_scores: Scores, head_scores: Scores, trunk: PrunePlan, head: PrunePlan | None) -> None:
    """A scored layer that no file being pruned has is a mistake (scores of
    another model, or an MTP head left unpruned): refuse rather than guess."""
    tables = [(trunk_scores, set(trunk.layers))]
    if head is not None:
        if head_scores is trunk_scores:
            tables = [(trunk_scores, set(trunk.layers) | set(head.layers))]
        else:
            tables.append((head_scores, set(head.layers)))
    for sc, used in tables:
        unused = sorted(set(sc.layers) - used)
        if unused:
            hint = ("if it is a separate MTP head's block, pass --mtp-head MTP.gguf --mtp-out OUT-mtp.gguf"
                    if head is None else "the scores may be of another model")
            raise FleError(f"{sc.source}: layers {unused} match no MoE layer of the files being pruned; {hint}")
