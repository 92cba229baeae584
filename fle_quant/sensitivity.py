"""Measure how much each MoE layer's output changes when its experts come
from another quantization: the "measure" step that writes the sensitivity
table ``fle-select`` reads (format ``fle.sensitivity/1``, see
:mod:`fle_quant.select`).

How it measures. A calibration text is tokenized with the reference model's
own tokenizer and its first ``n_tokens`` tokens are cut into windows of
``ctx`` tokens, each run from an empty state (no window sees another). The
reference model runs once over all windows through FLE's reference forward
pass (:mod:`fle_engine`) with an MoE capture attached, which keeps, per MoE
layer and token, the layer's input ``x`` (after the norm), the chosen
experts and their weights (after renormalisation and scaling), and adds up
``|y_ref|^2`` of the layer's output (routed experts plus the shared expert).
Then, layer by layer, each candidate's expert tensors (and nothing else) are
read and dequantized, one layer of one file at a time, and the routed part
of the layer is recomputed on the captured inputs with the *reference's*
routing (same experts, same weights; the router and the shared expert are
the reference's and cancel in the difference)::

    error = sum_t |y_cand(t) - y_ref(t)|^2 / sum_t |y_ref(t)|^2

a ratio of sums over every captured token (not a mean of per-token ratios,
which near-zero outputs would dominate), with
``y_cand(t) - y_ref(t) = sum_k w_tk (f^cand_{e_tk}(x_t) - f^ref_{e_tk}(x_t))``.
Both routed sums are computed by the same code (:func:`routed_output`) from
the same inputs, so a candidate whose expert tensors decode to the
reference's values has an error of exactly 0. The base is a candidate in
every layer: with error 0 when it is the reference itself, else measured
like a donor.

Bounded memory and disk. The capture never holds more than one MoE call's
record in memory: each layer's inputs go straight to a float32 ``.npy``
memory map of ``n_tokens x n_embd`` (4 bytes each) in a scratch folder, with
the chosen experts and weights (``n_tokens x n_used`` each) in memory. So
the scratch folder holds ``4 * n_tokens * n_embd`` bytes per MoE layer plus
one more such array (the reference's routed output of the layer being
measured), e.g. 64 MiB per layer for 4096 tokens of width 4096. Expert
weights are in memory for one layer of one file at a time; the reference
model itself is released before the candidates are read.

Sizes. ``expert_bytes`` of a candidate in a layer is the sum of that layer's
expert tensors (exactly the tensors ``fle-splice`` swaps,
:func:`fle_quant.splice.expert_groups`), each padded to the base's
alignment. ``fixed_bytes`` is what the spliced file holds besides the
measured layers' expert tensors: the base's headers (every shard's, up to
where its tensor data starts) plus every other tensor padded to the
alignment, plus :func:`provenance_reserve`: an upper bound of the
``fle.provenance.*`` metadata ``fle-splice`` adds (all donors used, file
names up to 255 bytes, every layer named by the longest candidate name)
plus one alignment unit for the header's padding. A single-file output
therefore never exceeds the selection's ``size_bytes``; splitting the output
into more shards than the base has adds one header per extra shard (a few
KB each), which the reserve does not cover.

Layers outside the trunk's forward pass (an MTP block) are not measured;
``fle-splice`` keeps them from the base and their bytes count as fixed.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import os
import sys
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from . import __version__
from .errors import FleError
from .files import check_outputs, preallocate, scratch_dir, write_error
from .textio import read_text_file, write_json_atomic
from .gguf_format import pad
from .gguf_reader import GGUFModel, TensorInfo
from .select import TABLE_FORMAT, parse_table

__all__ = [
    "DEFAULT_TOKENS",
    "DEFAULT_CTX",
    "DEFAULT_BASE_NAME",
    "read_tokens",
    "run_windows",
    "InputCapture",
    "LayerInputs",
    "capture_inputs",
    "layer_experts",
    "routed_output",
    "provenance_reserve",
    "fixed_bytes",
    "measure",
    "check_device",
    "check_output",
    "write_json_atomic",
]

DEFAULT_TOKENS = 4096
DEFAULT_CTX = 2048
DEFAULT_BASE_NAME = "base"

# Per-layer expert hyperparameters (without the "{arch}." prefix) a donor must
# share with the reference so that its experts compute the same function shape.
_SHAPE_HPARAMS = ("block_count", "embedding_length", "expert_count", "expert_used_count", "expert_feed_forward_length",
                  "expert_shared_count", "expert_weights_scale", "expert_gating_func", "expert_weights_norm")
_EXPERT_RE = re.compile(r"^blk\.(\d+)\.(ffn_(?:gate|up|down|gate_up)_exps)\.([A-Za-z0-9_]+)$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.+-]+$")
# Longest file name most file systems allow (NAME_MAX); bounds the file-name
# entries of the provenance metadata, whatever the inputs are called at splice time.
_NAME_MAX = 255
# Tokens encoded at a time while looking for the first n tokens of a large text.
_CHARS_PER_TOKEN_GUESS = 8
# Tokens after the cut that must exist before the first n are trusted: a cut in
# the middle of a word changes only the tokens of that word.
_CUT_MARGIN = 64
# Tokens per matmul chunk when recomputing a layer (bounds the [chunk, F] temporaries).
_CHUNK = 4096


# ---------------------------------------------------------------------------
# tokens and windows


def read_tokens(model: "GGUFModel | str | os.PathLike[str]", text_path: "str | os.PathLike[str]",
                n_tokens: int) -> list[int]:
    """The first ``n_tokens`` token ids of the UTF-8 text file ``text_path``,
    tokenized with ``model``'s tokenizer (BOS added when the vocabulary asks
    for it). Only as much of a large text is tokenized as needed."""
    from fle_engine.tokenizer import Tokenizer

    if n_tokens < 1:
        raise FleError(f"--tokens must be at least 1, got {n_tokens}")
    label = os.fspath(text_path)
    text = read_text_file(text_path, "UTF-8 calibration text")
    if not text.strip():
        raise FleError(f"{label}: the text is empty; give a calibration text")
    tok = Tokenizer.from_gguf(model)
    n_chars = max(1024, n_tokens * _CHARS_PER_TOKEN_GUESS)
    while True:
        whole = n_chars >= len(text)
        ids = tok.encode(text if whole else text[:n_chars])
        if whole or len(ids) >= n_tokens + _CUT_MARGIN:
            break
        n_chars *= 2
    if len(ids) < n_tokens:
        raise FleError(f"{label}: the text has only {len(ids)} tokens, fewer than the {n_tokens} asked for; "
                       "give a longer text or fewer --tokens")
    return ids[:n_tokens]


def run_windows(model, tokens: Sequence[int], ctx: int, *, progress: bool = False,
                desc: str = "reference forward", after: Callable[[Any, Any], None] | None = None) -> None:
    """Run ``model`` (an :class:`fle_engine.Model`) over ``tokens`` in windows
    of ``ctx`` tokens, each from an empty state; logits are discarded (the
    caller watches through a capture). ``after(window_ids, state)`` is
    called after each window's forward."""
    import torch
    from tqdm import tqdm

    if ctx < 1:
        raise FleError(f"--ctx must be at least 1, got {ctx}")
    starts = range(0, len(tokens), ctx)
    for s in tqdm(starts, desc=desc, unit="window", disable=not progress or not sys.stderr.isatty(), leave=False):
        window = [int(t) for t in tokens[s:s + ctx]]
        state = model.new_state(len(window))
        with torch.inference_mode():
            model.forward(window, state)
            if after is not None:
                after(window, state)
        del state


# ---------------------------------------------------------------------------
# the capture


@dataclass
class LayerInputs:
    """What the reference pass kept of one MoE layer: ``hidden`` [N, D]
    float32 (a memory map), ``experts`` [N, K] int64, ``weights`` [N, K]
    float32, and ``ref_sq`` = sum_t |y_ref(t)|^2 (float64)."""
    layer: int
    hidden: np.ndarray
    experts: np.ndarray
    weights: np.ndarray
    ref_sq: float = 0.0
    filled: int = 0


@dataclass
class InputCapture:
    """An MoE capture (the ``record`` interface of
    :class:`fle_engine.MoECapture`) that writes each layer's inputs to a
    memory map in ``folder`` as they come and keeps nothing else of the
    record, so memory stays at one record whatever the token count."""
    folder: Path
    n_tokens: int
    layers: dict[int, LayerInputs] = field(default_factory=dict)

    def record(self, rec) -> None:
        x = rec.hidden.float().cpu().numpy()
        n, d = x.shape
        li = self.layers.get(rec.layer)
        if li is None:
            k = rec.experts.shape[1]
            hidden = scratch_array(self.folder / f"hidden.{rec.layer}.npy", (self.n_tokens, d))
            li = LayerInputs(rec.layer, hidden, np.zeros((self.n_tokens, k), np.int64),
                             np.zeros((self.n_tokens, k), np.float32))
            self.layers[rec.layer] = li
        if li.filled + n > self.n_tokens:
            raise FleError(f"layer {rec.layer} was called on more tokens than the {self.n_tokens} measured; "
                           "the forward pass ran a layer twice")
        s = slice(li.filled, li.filled + n)
        li.hidden[s] = x
        li.experts[s] = rec.experts.cpu().numpy()
        li.weights[s] = rec.weights.float().cpu().numpy()
        li.ref_sq += float(rec.output.double().pow(2).sum())
        li.filled += n

    def clear(self) -> None:
        self.layers.clear()


def capture_inputs(ref_path: "str | os.PathLike[str]", tokens: Sequence[int], ctx: int, folder: Path, *,
                   device: str = "cpu", progress: bool = False) -> tuple[dict[int, LayerInputs], dict]:
    """Run the reference model over ``tokens`` and return its MoE layers'
    captured inputs (spilled to ``folder``) and the model's hyperparameters
    that matter here (``n_embd``, ``n_ff_exp``, ``n_expert``)."""
    import fle_engine

    model = fle_engine.load(ref_path, device=device)
    cap = InputCapture(Path(folder), len(tokens))
    model.capture = cap
    try:
        run_windows(model, tokens, ctx, progress=progress)
    finally:
        model.capture = None
    a = model.args
    info = {"n_embd": int(a.n_embd), "n_ff_exp": int(a.n_ff_exp), "n_expert": int(a.n_expert)}
    del model
    if not cap.layers:
        raise FleError(f"{ref_path}: the forward pass called no MoE layer; not an MoE model")
    for li in cap.layers.values():
        if li.filled != len(tokens):
            raise FleError(f"{ref_path}: MoE layer {li.layer} saw {li.filled} of {len(tokens)} tokens")
        li.hidden.flush()
    return dict(sorted(cap.layers.items())), info


# ---------------------------------------------------------------------------
# recomputing a layer


def _expert_group(model: GGUFModel, layer: int) -> list[TensorInfo]:
    return [t for t in model.tensors.values()
            if (m := _EXPERT_RE.match(t.name)) is not None and int(m.group(1)) == layer]


def layer_experts(model: GGUFModel, layer: int, n_embd: int, n_ff: int, n_expert: int, device: str = "cpu"):
    """(gate [E, F, D], up [E, F, D], down [E, D, F]) of ``layer`` in
    ``model``, dequantized to float32 torch tensors; a fused
    ``ffn_gate_up_exps`` (gate rows first) is split. Reads nothing else."""
    import torch

    from fle_engine.loader import Weights

    w = Weights(model, device, torch.float32)
    p = f"blk.{layer}."
    if w.has(p + "ffn_gate_up_exps.weight"):
        gate_up = w.get(p + "ffn_gate_up_exps.weight", (n_expert, 2 * n_ff, n_embd))
        gate, up = gate_up[:, :n_ff].contiguous(), gate_up[:, n_ff:].contiguous()
        del gate_up
    else:
        gate = w.get(p + "ffn_gate_exps.weight", (n_expert, n_ff, n_embd))
        up = w.get(p + "ffn_up_exps.weight", (n_expert, n_ff, n_embd))
    down = w.get(p + "ffn_down_exps.weight", (n_expert, n_embd, n_ff))
    return gate, up, down


def routed_output(x, experts, weights, gate, up, down):
    """sum_k weights[t, k] * f_{experts[t, k]}(x[t]) for every token: ``x``
    [N, D], ``experts`` [N, K] (int64), ``weights`` [N, K]; f_e the SwiGLU
    expert down_e(silu(gate_e x) * up_e x). Torch tensors; [N, D] float32.
    Experts are visited in index order and tokens in order, so equal inputs
    give bit-equal outputs."""
    import torch
    import torch.nn.functional as F

    out = torch.zeros_like(x)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)                    # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=gate.shape[0]).tolist()
    tok_of = order // experts.shape[1]
    w_of = weights.reshape(-1)[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        idx, w = tok_of[start:start + n], w_of[start:start + n]
        start += n
        xe = x[idx]                                             # [n, D]
        h = F.silu(xe @ gate[e].T) * (xe @ up[e].T)             # [n, F]
        out.index_add_(0, idx, (h @ down[e].T) * w[:, None])
    return out


def _layer_output(li: LayerInputs, gate, up, down, device: str):
    """(start, end, routed output [end - start, D]) of one layer over all
    captured tokens, chunk by chunk."""
    import torch

    n = li.hidden.shape[0]
    for s in range(0, n, _CHUNK):
        e = min(n, s + _CHUNK)
        x = torch.from_numpy(np.ascontiguousarray(li.hidden[s:e])).to(device)
        y = routed_output(x, torch.from_numpy(li.experts[s:e]).to(device),
                          torch.from_numpy(li.weights[s:e]).to(device), gate, up, down)
        yield s, e, y


def _layer_error(li: LayerInputs, ref_routed: np.ndarray, gate, up, down, device: str) -> float:
    """sum_t |y_cand - y_ref|^2 / sum_t |y_ref|^2 for one layer."""
    import torch

    num = 0.0
    for s, e, y in _layer_output(li, gate, up, down, device):
        ref = torch.from_numpy(np.ascontiguousarray(ref_routed[s:e])).to(device)
        num += float((y.double() - ref.double()).pow(2).sum())
    if li.ref_sq == 0.0:
        # a layer whose output is exactly zero: any change is infinitely large relative to it
        return 0.0 if num == 0.0 else math.inf
    return num / li.ref_sq


# ---------------------------------------------------------------------------
# sizes


def _kv_string(key: str, n: int) -> int:
    return 8 + len(key.encode()) + 4 + 8 + n


def _kv_array(key: str, items: Sequence[int]) -> int:
    return 8 + len(key.encode()) + 4 + 4 + 8 + sum(items)


def provenance_reserve(base_name: str, donor_names: Sequence[str], n_blocks: int, alignment: int) -> int:
    """An upper bound of the bytes ``fle-splice`` adds to the base's header:
    its ``fle.provenance.*`` entries with every donor used, file names of up
    to 255 bytes, every block named by the longest candidate name, the
    version string of up to 64 bytes; plus one alignment unit for the
    header's padding to the tensor data."""
    p = "fle.provenance."
    n_d = len(donor_names)
    longest = max(len(n.encode()) for n in [base_name, *donor_names])
    total = (_kv_string(p + "format", len("fle.provenance/1"))
             + _kv_string(p + "tool", len("fle-splice"))
             + _kv_string(p + "fle_version", max(64, len(__version__)))
             + _kv_string(p + "base", len(base_name.encode()))
             + _kv_string(p + "base_file", _NAME_MAX)
             + (8 + len(p + "base_shards") + 4 + 4)
             + _kv_string(p + "base_sha256", 64)
             + _kv_array(p + "donors", [8 + len(n.encode()) for n in donor_names])
             + _kv_array(p + "donor_files", [8 + _NAME_MAX] * n_d)
             + _kv_array(p + "donor_shards", [4] * n_d)
             + _kv_array(p + "donor_sha256", [8 + 64] * n_d)
             + _kv_string(p + "selection_file", _NAME_MAX)
             + _kv_string(p + "selection_sha256", 64)
             + _kv_array(p + "layer_sources", [8 + longest] * n_blocks))
    return total + alignment


def _group_bytes(group: Sequence[TensorInfo], alignment: int) -> int:
    return sum(pad(t.n_bytes, alignment) for t in group)


def fixed_bytes(base: GGUFModel, layers: Sequence[int], reserve: int) -> int:
    """Bytes of the spliced file that do not depend on the selection: the
    base's headers, every tensor outside ``layers``' expert groups (padded
    to the alignment), plus ``reserve``."""
    swapped = set()
    for layer in layers:
        swapped.update(t.name for t in _expert_group(base, layer))
    tensors = sum(pad(t.n_bytes, base.alignment) for t in base.tensors.values() if t.name not in swapped)
    return sum(base.data_offsets) + tensors + reserve


# ---------------------------------------------------------------------------
# checks


def check_device(device: str) -> None:
    """FleError for a torch device string that is malformed or not present."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise FleError(f"--device {device!r} is not a torch device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise FleError(f"--device {device!r}: CUDA is not available here; use --device cpu")


def _check_name(name: str, what: str) -> None:
    if not name or not _NAME_RE.match(name):
        raise FleError(f"{what} name {name!r} must be non-empty letters, digits and _ . + - "
                       "(it becomes a candidate name in the table and fle-splice's --donor NAME=FILE)")


def _check_same_model(ref: GGUFModel, other: GGUFModel, who: str, layers: Sequence[int]) -> None:
    """``other``'s experts can stand in for the reference's in ``layers``."""
    if other.arch != ref.arch:
        raise FleError(f"{who} is architecture {other.arch!r} but the reference ({ref.paths[0]}) is {ref.arch!r}; "
                       "use a quantization of the same model")
    for key in _SHAPE_HPARAMS:
        full = f"{ref.arch}.{key}"
        rv, ov = ref.metadata.get(full), other.metadata.get(full)
        if rv != ov:
            show = lambda v: "absent" if v is None else repr(v)  # noqa: E731
            raise FleError(f"{who} has {full} = {show(ov)} but the reference ({ref.paths[0]}) has {show(rv)}; "
                           "use a quantization of the same model")
    for layer in layers:
        rg = {t.name: t for t in _expert_group(ref, layer)}
        og = {t.name: t for t in _expert_group(other, layer)}
        for name, t in og.items():
            if not name.endswith(".weight"):
                raise FleError(f"{who}: tensor {name!r} is an expert {name.rsplit('.', 1)[1]}; FLE measures "
                               "expert groups of weights only")
        if set(og) != set(rg):
            missing = sorted(set(rg) - set(og)) or sorted(set(og) - set(rg))
            raise FleError(f"{who}: the expert tensors of layer {layer} differ from the reference's "
                           f"({missing[0]!r} is in one file only; fused or separate gate/up?)")
        for name, t in og.items():
            if t.shape != rg[name].shape:
                raise FleError(f"{who}: tensor {name!r} has shape {list(t.shape)} but the reference has "
                               f"{list(rg[name].shape)}; use a quantization of the same model")


# ---------------------------------------------------------------------------
# the measurement


def _file_label(model: GGUFModel) -> dict:
    return {"file": str(model.paths[0]), "shards": len(model.paths), "size_bytes": int(model.file_size)}


def measure(ref: "str | os.PathLike[str]", donors: Mapping[str, "str | os.PathLike[str]"],
            text: "str | os.PathLike[str]", *, n_tokens: int = DEFAULT_TOKENS, ctx: int = DEFAULT_CTX,
            base: "str | os.PathLike[str] | None" = None, base_name: str = DEFAULT_BASE_NAME,
            device: str = "cpu", work_dir: "str | os.PathLike[str] | None" = None,
            progress: bool = False) -> dict:
    """The sensitivity table (a ``fle.sensitivity/1`` object, validated) of
    ``donors`` (name -> file, any shard) against the reference ``ref``,
    over the first ``n_tokens`` tokens of ``text``. The base is ``ref``
    itself (error 0) unless ``base`` names another file; it is listed in
    every layer as ``base_name``. See the module docstring."""
    from tqdm import tqdm

    _check_name(base_name, "the base")
    for name in donors:
        _check_name(name, "a donor")
        if name == base_name:
            raise FleError(f"donor name {name!r} is also the base's name; give the donor another name "
                           "(or --base-name)")
    if ctx < 1:
        raise FleError(f"--ctx must be at least 1, got {ctx}")
    check_device(device)
    text_sha = hashlib.sha256(Path(text).read_bytes()).hexdigest() if Path(text).is_file() else None

    with contextlib.ExitStack() as stack:
        rmodel = stack.enter_context(GGUFModel.open(ref))
        if rmodel.arch is None:
            raise FleError(f"{ref}: no general.architecture key; not a model file")
        bmodel = stack.enter_context(GGUFModel.open(base)) if base is not None else rmodel
        dmodels = {name: stack.enter_context(GGUFModel.open(path)) for name, path in sorted(donors.items())}
        ref_layers = sorted({int(m.group(1)) for t in rmodel.tensors if (m := _EXPERT_RE.match(t))})
        if not ref_layers:
            raise FleError(f"{ref}: no expert tensors (blk.N.ffn_*_exps); not an MoE model")
        # shape checks first: they cost no forward pass
        if base is not None:
            _check_same_model(rmodel, bmodel, f"the base ({bmodel.paths[0]})", ref_layers)
        for name, dm in dmodels.items():
            _check_same_model(rmodel, dm, f"donor {name!r} ({dm.paths[0]})", ref_layers)

        tokens = read_tokens(rmodel, text, n_tokens)
        scratch = stack.enter_context(scratch_dir(work_dir, "fle-sensitivity-"))
        captured, hp = capture_inputs(ref, tokens, ctx, Path(scratch), device=device, progress=progress)
        layers = list(captured)
        missing = [il for il in layers if il not in ref_layers]
        if missing:
            raise FleError(f"{ref}: MoE layer {missing[0]} has no ffn_*_exps tensors; FLE cannot measure it")

        candidates = ([base_name] if base is not None else []) + list(dmodels)
        files = {**({base_name: bmodel} if base is not None else {}), **dmodels}
        alignment = bmodel.alignment
        rows = []
        bar = tqdm(total=len(layers) * (1 + len(candidates)), desc="layers x candidates", unit="pass",
                   disable=not progress or not sys.stderr.isatty(), leave=False)
        for layer in layers:
            li = captured[layer]
            ref_path = Path(scratch) / f"ref.{layer}.npy"
            ref_routed = scratch_array(ref_path, li.hidden.shape)
            gate, up, down = layer_experts(rmodel, layer, hp["n_embd"], hp["n_ff_exp"], hp["n_expert"], device)
            for s, e, y in _layer_output(li, gate, up, down, device):
                ref_routed[s:e] = y.cpu().numpy()
            del gate, up, down
            bar.update()
            cells = {}
            if base is None:
                cells[base_name] = {"error": 0.0, "expert_bytes": _group_bytes(_expert_group(bmodel, layer), alignment)}
            for name in candidates:
                fm = files[name]
                gate, up, down = layer_experts(fm, layer, hp["n_embd"], hp["n_ff_exp"], hp["n_expert"], device)
                err = _layer_error(li, ref_routed, gate, up, down, device)
                del gate, up, down
                if not math.isfinite(err):
                    raise FleError(f"layer {layer}: the reference's MoE output is zero on every token, so the "
                                   f"relative error of {name!r} is undefined; use another text")
                cells[name] = {"error": err, "expert_bytes": _group_bytes(_expert_group(fm, layer), alignment)}
                bar.update()
            # this layer is done: release its memory maps and files before the next one
            del ref_routed, li, captured[layer]
            ref_path.unlink()
            (Path(scratch) / f"hidden.{layer}.npy").unlink()
            # the base first, then donors by name: the order fle-select lists them in
            ordered = {base_name: cells[base_name], **{n: cells[n] for n in sorted(cells) if n != base_name}}
            rows.append({"layer": layer, "candidates": ordered})
        bar.close()
        n_blocks = 1 + max((int(t.split(".")[1]) for t in bmodel.tensors if t.startswith("blk.")), default=-1)
        reserve = provenance_reserve(base_name, list(dmodels), n_blocks, alignment)
        table = {
            "format": TABLE_FORMAT,
            "reference": {
                **_file_label(rmodel),
                "text": str(text),
                "text_sha256": text_sha,
                "tokens": len(tokens),
                "ctx": ctx,
                "error": "per layer: sum over tokens of |y_cand - y_ref|^2 / sum over tokens of |y_ref|^2 "
                         "(MoE output, reference routing and shared expert)",
                "base_file": _file_label(bmodel),
                "donors": {n: _file_label(m) for n, m in dmodels.items()},
                "provenance_reserve_bytes": reserve,
                "tool": f"fle-sensitivity {__version__}",
            },
            "base": base_name,
            "fixed_bytes": fixed_bytes(bmodel, layers, reserve),
            "alignment": alignment,
            "layers": rows,
        }
    parse_table(table, "the measured sensitivity table")  # what fle-select will read
    return table


# ---------------------------------------------------------------------------
# writing


def scratch_array(path: Path, shape: tuple[int, ...]) -> np.ndarray:
    """A float32 ``.npy`` memory map in the scratch folder, its blocks
    reserved first: a full disk is one line now, not SIGBUS later."""
    try:
        arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=tuple(shape))
        fd = os.open(path, os.O_RDWR)
        try:
            preallocate(fd, os.fstat(fd).st_size, path)
        finally:
            os.close(fd)
    except OSError as e:
        raise write_error(path, e) from None
    return arr


def check_output(path: "str | os.PathLike[str]", force: bool) -> None:
    """Refuse before any work an output that exists (without ``force``), whose
    folder does not, or that names an input (see :func:`fle_quant.files.check_outputs`)."""
    check_outputs([path], force)
