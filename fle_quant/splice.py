"""Splice whole expert layers from donor files into a base GGUF model.

The "apply" step after measuring (sensitivity) and deciding (``fle-select``):
a selection names, per MoE layer, the candidate its expert tensors come from.
The output has the base's metadata and the base's tensors in the base's
order, except that for every layer the selection gives to a donor, that
layer's *expert group* is the donor's:

- ``blk.N.ffn_gate_exps.*``, ``blk.N.ffn_up_exps.*``, ``blk.N.ffn_down_exps.*``
  and the fused ``blk.N.ffn_gate_up_exps.*``: the stacked weights and what
  belongs to them (``.bias``, and the per-expert ``.scale`` /
  ``.input_scale`` some quant formats carry);
- never the router (``ffn_gate_inp``, ``exp_probs_b``), the shared expert
  (``*_shexp``) or anything else of the layer.

Each group tensor is taken at the position of the base's tensor of the same
name. ``.weight`` and ``.bias`` tensors must exist in both files with the
same shape; the other members describe the donor's encoding, so a donor's
extra ``.scale`` is taken (after the layer's last group tensor) and a base's
``.scale`` the donor lacks is dropped.

Everything is checked before anything is written or hashed: architectures,
the hyperparameters that shape the experts, every spliced tensor's shape,
that every donor the selection names is given, that every selected layer is
an MoE layer of the base, and that no output file exists (without
``force``). Tensor bytes are never read into memory: the output is a
:class:`~fle_quant.gguf_writer.WritePlan` of byte ranges that
:func:`~fle_quant.gguf_writer.write_gguf` streams (atomic, split in and out).

Provenance (``fle.provenance.*`` metadata, replacing any from an earlier
splice; every other key of the base is kept as it is):

==================================  ========  ==========================================
key                                 type      value
==================================  ========  ==========================================
fle.provenance.format               string    ``fle.provenance/1``
fle.provenance.tool                 string    ``fle-splice``
fle.provenance.fle_version          string    ``fle_quant.__version__``
fle.provenance.base                 string    the selection's base name
fle.provenance.base_file            string    file name of the base (its first shard)
fle.provenance.base_shards          uint32    number of files of the base
fle.provenance.base_sha256          string    logical SHA-256 of the base
fle.provenance.donors               [string]  donor names used, in name order
fle.provenance.donor_files          [string]  file name (first shard) per donor
fle.provenance.donor_shards         [uint32]  number of files per donor
fle.provenance.donor_sha256         [string]  logical SHA-256 per donor
fle.provenance.selection_file       string    file name of the selection
fle.provenance.selection_sha256     string    SHA-256 of the selection file's bytes
fle.provenance.layer_sources        [string]  per block index 0..N-1: the name of the
                                              source of its experts, "" for a block
                                              without expert tensors
==================================  ========  ==========================================

The logical SHA-256 of a model is the plain SHA-256 of a single file, or
for a split model the SHA-256 of its shards' 32-byte digests concatenated in
order (see :mod:`fle_quant.digest`). Per-tensor SHA-256s are computed while
copying (:class:`~fle_quant.gguf_writer.WriteResult`); they are not stored in
the file, whose header is written before the tensors.
"""
from __future__ import annotations

import contextlib
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from . import __version__
from .digest import sha256_file, sha256_model
from .errors import FleError
from .gguf_format import GGUFValueType
from .gguf_reader import GGUFModel, TensorInfo
from .files import check_output_path, refuse_inputs
from .gguf_writer import ByteSource, WritePlan, WriteResult, planned_layout, write_gguf
from .select import Selection, load_selection

__all__ = [
    "PROVENANCE_PREFIX",
    "EXPERT_HPARAMS",
    "LayerChoice",
    "SplicePlan",
    "expert_groups",
    "plan_splice",
    "fill_provenance",
    "execute",
    "splice",
    "format_plan",
]

PROVENANCE_PREFIX = "fle.provenance."
PROVENANCE_FORMAT = "fle.provenance/1"

# blk.N.<part>.<member>; part is one of the stacked expert tensors
_EXPERT_RE = re.compile(r"^blk\.(\d+)\.(ffn_(?:gate|up|down|gate_up)_exps)\.([A-Za-z0-9_]+)$")
_BLK_RE = re.compile(r"^blk\.(\d+)\.")
# members that are part of the model itself (must match); the others describe an encoding
_ESSENTIAL = ("weight", "bias")
_PART_ORDER = ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps", "ffn_down_exps")

# Hyperparameters (without the "{arch}." prefix) that decide the shape or the
# meaning of a layer's experts; donor and base must agree on each one either has.
EXPERT_HPARAMS = (
    "block_count", "embedding_length", "expert_count", "expert_used_count", "expert_feed_forward_length",
    "expert_shared_count", "expert_group_count", "expert_group_used_count", "expert_gating_func",
    "expert_weights_norm", "expert_weights_scale", "leading_dense_block_count", "interleave_moe_layer_step",
    "moe_every_n_layers", "nextn_predict_layers",
)

_ZERO_SHA = "0" * 64  # placeholder of a digest's exact length, so sizes are exact before hashing


@dataclass(frozen=True)
class Input:
    """One input model: ``name`` as in the selection, ``paths`` its shards."""

    name: str
    paths: tuple[Path, ...]

    @property
    def label(self) -> str:
        return f"{self.paths[0]}" + (f" (+{len(self.paths) - 1} shards)" if len(self.paths) > 1 else "")


@dataclass(frozen=True)
class LayerChoice:
    """Where one MoE layer's expert group comes from and what it is."""

    layer: int
    source: str
    types: dict[str, str]   # part ("ffn_gate_exps", ...) -> ggml type name of its .weight
    n_bytes: int            # bytes of the group's tensors (without padding)
    n_tensors: int


@dataclass
class SplicePlan:
    """Everything checked and decided; ``execute`` only copies bytes."""

    base: Input
    donors: dict[str, Input]            # the donors the selection uses, by name
    unused_donors: list[str]
    selection_path: Path
    selection: Selection
    layers: list[LayerChoice]           # every MoE layer of the base, in order
    layer_sources: list[str]
    write_plan: WritePlan
    out: Path
    out_paths: list[Path]
    shard_sizes: list[int]
    split_max_size: int | None = None
    split_max_tensors: int | None = None
    digests: dict[str, str] = field(default_factory=dict)   # input name -> logical SHA-256
    selection_sha256: str | None = None

    @property
    def out_size(self) -> int:
        return sum(self.shard_sizes)


def expert_groups(model: GGUFModel) -> dict[int, list[TensorInfo]]:
    """Layer -> the tensors of its expert group, in file order."""
    groups: dict[int, list[TensorInfo]] = defaultdict(list)
    for t in model.tensors.values():
        m = _EXPERT_RE.match(t.name)
        if m:
            groups[int(m.group(1))].append(t)
    return dict(sorted(groups.items()))


def _member(name: str) -> tuple[str, str]:
    m = _EXPERT_RE.match(name)
    assert m is not None
    return m.group(2), m.group(3)


def _is_essential(name: str) -> bool:
    return _member(name)[1] in _ESSENTIAL


def _check_compatible(base: GGUFModel, bname: Input, donor: GGUFModel, dname: Input) -> None:
    who = f"donor {dname.name!r} ({dname.paths[0]})"
    if donor.arch != base.arch:
        raise FleError(f"{who} is architecture {donor.arch!r} but the base ({bname.paths[0]}) is {base.arch!r}; "
                       "experts can only be spliced between files of the same model")
    for key in EXPERT_HPARAMS:
        full = f"{base.arch}.{key}"
        bv, dv = base.metadata.get(full), donor.metadata.get(full)
        if bv != dv:
            show = lambda v: "absent" if v is None else repr(v)  # noqa: E731
            raise FleError(f"{who} has {full} = {show(dv)} but the base ({bname.paths[0]}) has {show(bv)}; "
                           "its experts do not fit the base, use a donor quantized from the same model")


def _check_group(layer: int, bgroup: list[TensorInfo], dgroup: list[TensorInfo], bname: Input,
                 dname: Input) -> None:
    who = f"donor {dname.name!r} ({dname.paths[0]})"
    dmap = {t.name: t for t in dgroup}
    bmap = {t.name: t for t in bgroup}
    for bt in bgroup:
        if not _is_essential(bt.name):
            continue
        dt = dmap.get(bt.name)
        if dt is None:
            raise FleError(f"{who} has no tensor {bt.name!r}, which the base ({bname.paths[0]}) has; "
                           f"layer {layer} cannot take its experts from this donor")
        if dt.shape != bt.shape:
            raise FleError(f"{who}: tensor {bt.name!r} has shape {list(dt.shape)} but the base "
                           f"({bname.paths[0]}) has {list(bt.shape)}; use a donor quantized from the same model")
    for dt in dgroup:
        if _is_essential(dt.name) and dt.name not in bmap:
            raise FleError(f"{who} has tensor {dt.name!r}, which the base ({bname.paths[0]}) does not have "
                           f"(fused or separate gate/up?); layer {layer} cannot take its experts from this donor")


def _layer_choice(layer: int, source: str, group: list[TensorInfo]) -> LayerChoice:
    types = {}
    for t in group:
        part, member = _member(t.name)
        if member == "weight":
            types[part] = t.qtype.name
    types = {p: types[p] for p in _PART_ORDER if p in types}
    return LayerChoice(layer, source, types, sum(t.n_bytes for t in group), len(group))


def _provenance(plan: WritePlan, base: Input, donors: dict[str, Input], selection_path: Path,
                layer_sources: list[str], digests: Mapping[str, str], selection_sha256: str) -> None:
    """(Re)write the fle.provenance.* entries, after every other key.
    ``digests``: logical SHA-256 per input name (placeholders where absent)."""
    for key in [k for k in plan.metadata if k.startswith(PROVENANCE_PREFIX)]:
        plan.remove(key)
    S, A, U = GGUFValueType.STRING, GGUFValueType.ARRAY, GGUFValueType.UINT32
    names = sorted(donors)
    p = PROVENANCE_PREFIX
    plan.add(p + "format", PROVENANCE_FORMAT, S)
    plan.add(p + "tool", "fle-splice", S)
    plan.add(p + "fle_version", __version__, S)
    plan.add(p + "base", base.name, S)
    plan.add(p + "base_file", base.paths[0].name, S)
    plan.add(p + "base_shards", len(base.paths), U)
    plan.add(p + "base_sha256", digests.get(base.name, _ZERO_SHA), S)
    plan.add(p + "donors", names, A, S)
    plan.add(p + "donor_files", [donors[n].paths[0].name for n in names], A, S)
    plan.add(p + "donor_shards", [len(donors[n].paths) for n in names], A, U)
    plan.add(p + "donor_sha256", [digests.get(n, _ZERO_SHA) for n in names], A, S)
    plan.add(p + "selection_file", selection_path.name, S)
    plan.add(p + "selection_sha256", selection_sha256, S)
    plan.add(p + "layer_sources", layer_sources, A, S)


def plan_splice(base: "str | os.PathLike[str]", donors: Mapping[str, "str | os.PathLike[str]"],
                selection: "str | os.PathLike[str]", out: "str | os.PathLike[str]", *,
                split_max_size: int | None = None, split_max_tensors: int | None = None,
                force: bool = False) -> SplicePlan:
    """Check every input and decide every output tensor; reads headers only.

    ``donors`` maps candidate names (as in the selection) to files (any
    shard). Raises FleError for anything that does not fit. The returned
    plan's provenance digests are placeholders until :func:`fill_provenance`.
    """
    selection_path = Path(selection)
    sel = load_selection(selection_path)
    out = Path(out)
    for name in donors:
        if not name or "=" in name:
            raise FleError(f"donor name {name!r} is not a candidate name; write --donor NAME=FILE")
        if name == sel.base:
            raise FleError(f"donor {name!r} is the selection's base ({selection_path}); give that file as --base")
    needed = sorted({s for s in sel.sources.values() if s != sel.base})
    missing = [n for n in needed if n not in donors]
    if missing:
        layers = [str(k) for k, v in sel.sources.items() if v == missing[0]]
        raise FleError(f"{selection_path} takes layer(s) {', '.join(layers)} from {missing[0]!r}, which was not "
                       f"given; add --donor {missing[0]}=FILE (given: {', '.join(sorted(donors)) or 'none'})")
    unused = sorted(n for n in donors if n not in needed)

    with contextlib.ExitStack() as stack:
        bmodel = stack.enter_context(GGUFModel.open(base))
        binput = Input(sel.base, tuple(bmodel.paths))
        bgroups = expert_groups(bmodel)
        for layer in sel.sources:
            if layer not in bgroups:
                have = _ranges(list(bgroups)) or "none"
                raise FleError(f"{selection_path} names layer {layer}, but the base ({binput.paths[0]}) has no "
                               f"expert tensors in layer {layer} (its MoE layers: {have}); the selection was "
                               "made for another model")
        dmodels: dict[str, GGUFModel] = {}
        dinputs: dict[str, Input] = {}
        for name in needed:
            dm = stack.enter_context(GGUFModel.open(donors[name]))
            dinputs[name] = Input(name, tuple(dm.paths))
            _check_compatible(bmodel, binput, dm, dinputs[name])
            dmodels[name] = dm
        dgroups = {name: expert_groups(dm) for name, dm in dmodels.items()}

        # layer -> (name of the source, its group) for donor layers
        taken: dict[int, tuple[str, list[TensorInfo]]] = {}
        for layer, src in sel.sources.items():
            if src == sel.base:
                continue
            group = dgroups[src].get(layer)
            if group is None:
                raise FleError(f"donor {src!r} ({dinputs[src].paths[0]}) has no expert tensors in layer {layer}, "
                               "which the selection takes from it")
            _check_group(layer, bgroups[layer], group, binput, dinputs[src])
            taken[layer] = (src, group)

        wp = WritePlan()
        wp.copy_metadata(bmodel)
        last_of_layer = {layer: group[-1].name for layer, group in bgroups.items()}
        for t in bmodel.tensors.values():
            m = _EXPERT_RE.match(t.name)
            layer = int(m.group(1)) if m else None
            if layer in taken:
                _, dgroup = taken[layer]
                dmap = {d.name: d for d in dgroup}
                if t.name in dmap:
                    _add(wp, dmap[t.name])
                if t.name == last_of_layer[layer]:
                    bnames = {b.name for b in bgroups[layer]}
                    for d in dgroup:
                        if d.name not in bnames:
                            _add(wp, d)
            else:
                _add(wp, t)

        layers = []
        for layer, group in bgroups.items():
            src, g = taken.get(layer, (sel.base, group))
            layers.append(_layer_choice(layer, src, g))
        n_blocks = 1 + max((int(m.group(1)) for m in map(_BLK_RE.match, bmodel.tensors) if m), default=-1)
        layer_sources = [""] * n_blocks
        for choice in layers:
            layer_sources[choice.layer] = choice.source

    _provenance(wp, binput, dinputs, selection_path, layer_sources, {}, _ZERO_SHA)
    out_paths, sizes = planned_layout(wp, out, split_max_size, split_max_tensors)
    refuse_inputs(out_paths, [p for i in [binput, *dinputs.values()] for p in i.paths] + [selection_path])
    if not out.parent.is_dir():
        raise FleError(f"{out}: directory {out.parent} does not exist")
    for p in out_paths:
        check_output_path(p, force)
    return SplicePlan(base=binput, donors=dinputs, unused_donors=unused, selection_path=selection_path,
                      selection=sel, layers=layers, layer_sources=layer_sources, write_plan=wp,
                      out=out, out_paths=out_paths, shard_sizes=sizes, split_max_size=split_max_size,
                      split_max_tensors=split_max_tensors)


def _add(plan: WritePlan, t: TensorInfo) -> None:
    plan.add_tensor(t.name, t.shape, t.qtype, ByteSource(t.path, t.offset, t.n_bytes))


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


def fill_provenance(plan: SplicePlan, *, use_cache: bool = True, progress: bool = True) -> None:
    """Hash the inputs (cached, see :mod:`fle_quant.digest`) and write the
    digests into the plan's provenance."""
    digests = {plan.base.name: sha256_model(plan.base.paths, use_cache=use_cache, progress=progress)}
    for name, d in plan.donors.items():
        digests[name] = sha256_model(d.paths, use_cache=use_cache, progress=progress)
    # the selection is small and may be rewritten within one mtime tick: never cached
    sel_sha = sha256_file(plan.selection_path, use_cache=False, progress=False)
    _provenance(plan.write_plan, plan.base, plan.donors, plan.selection_path, plan.layer_sources, digests, sel_sha)
    plan.digests = digests
    plan.selection_sha256 = sel_sha
    # digests have a fixed length, so the layout printed before hashing still holds
    _, sizes = planned_layout(plan.write_plan, plan.out, plan.split_max_size, plan.split_max_tensors)
    assert sizes == plan.shard_sizes


def execute(plan: SplicePlan, *, force: bool = False, progress: bool = True) -> WriteResult:
    """Write the planned output (atomically; see :func:`write_gguf`)."""
    if not plan.digests:
        raise FleError("the splice plan has no input digests yet; call fill_provenance first")
    return write_gguf(plan.write_plan, plan.out, split_max_size=plan.split_max_size,
                      split_max_tensors=plan.split_max_tensors, force=force, progress=progress)


def splice(base, donors, selection, out, *, split_max_size=None, split_max_tensors=None, force=False,
           use_cache: bool = True, progress: bool = False) -> tuple[SplicePlan, WriteResult]:
    """Plan, hash and write in one call; see :func:`plan_splice`."""
    plan = plan_splice(base, donors, selection, out, split_max_size=split_max_size,
                       split_max_tensors=split_max_tensors, force=force)
    fill_provenance(plan, use_cache=use_cache, progress=progress)
    return plan, execute(plan, force=force, progress=progress)


def format_plan(plan: SplicePlan) -> str:
    """The per-layer table and the output size, as fle-splice prints them."""
    lines = [f"base:      {plan.base.name} = {plan.base.label}"]
    for name, d in plan.donors.items():
        n = sum(1 for c in plan.layers if c.source == name)
        lines.append(f"donor:     {name} = {d.label} ({n} layer{'s' if n != 1 else ''})")
    lines.append(f"selection: {plan.selection_path}")
    lines.append("")
    head = f"{'layer':>5}  {'source':16} {'gate':8} {'up':8} {'down':8} {'bytes':>15}"
    lines += [head, "-" * len(head)]
    for c in plan.layers:
        t = c.types
        gate = t.get("ffn_gate_exps", t.get("ffn_gate_up_exps", "-"))
        up = t.get("ffn_up_exps", "(fused)" if "ffn_gate_up_exps" in t else "-")
        lines.append(f"{c.layer:>5}  {c.source:16} {gate:8} {up:8} {t.get('ffn_down_exps', '-'):8} {c.n_bytes:>15,}")
    lines.append("")
    total = plan.out_size
    shards = f" in {len(plan.out_paths)} shards" if len(plan.out_paths) > 1 else ""
    lines.append(f"output:    {plan.out_paths[0]}{shards}, {total:,} bytes ({total / 1e9:.2f} GB)")
    if plan.selection.size_bytes != total:
        lines.append(f"           (the selection predicted {plan.selection.size_bytes:,} bytes)")
    return "\n".join(lines)
