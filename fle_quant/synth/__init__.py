"""A factory of small models: GGUF files with llama.cpp's exact metadata keys,
tensor names and shapes for ``qwen3moe``, ``qwen3next`` and ``qwen4exp``,
random but deterministic weights, and a quant mix chosen per tensor.

The weights are shaped so that next-token distributions are peaked (the
output head maps a state near a token's embedding to one successor) and so
that every component (attention, experts, shared expert, hyper-connections,
the n-gram table, the sparse attention selection) visibly changes the
output. Float values depend only on ``(seed, tensor name, shape)``: writing
the same model with another mix changes only the encoding.

One module per architecture (:mod:`.qwen3moe`, :mod:`.qwen3next`,
:mod:`.qwen4exp`), each with its keys and defaults (``KEYS``), checks
(``configure``) and tensors (``tensors``, ``mtp_tensors``); shared blocks in
:mod:`.common`, presets in :mod:`.mix`, vocabularies in :mod:`.tokenizer`.

MTP heads (``qwen3next``, ``qwen4exp``) follow the converter's convention for
qwen3next (``conversion/qwen.py``, ``_QwenMtpMixin``): the head is block
``N`` = the trunk's block count, and a file that holds it says
``block_count = N + 1`` and ``nextn_predict_layers = 1``. ``mtp="separate"``
writes it to ``<stem>-mtp.gguf`` next to the trunk (the trunk keeps
``block_count = N`` and no ``nextn_predict_layers``); ``"inside"`` puts it in
the trunk file; ``"none"`` omits it.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import FleError
from ..ggml_types import GGMLType
from ..gguf_writer import WritePlan, write_gguf
from .common import ARR, KV, TensorDef, encode, metadata_entries, resolve_config, tensor_values
from .mix import choose_type, file_type, parse_mix
from .tokenizer import Vocab, builtin_vocab, vocab_from_gguf

__all__ = ["ARCHS", "make_model", "mtp_path", "model_spec"]

ARCHS = ("qwen3moe", "qwen3next", "qwen4exp")
MTP_MODES = ("separate", "inside", "none")


def _module(arch: str):
    if arch not in ARCHS:
        raise FleError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    return importlib.import_module(f"{__name__}.{arch}")


def mtp_path(path: "str | os.PathLike[str]") -> Path:
    """Where ``make_model(path, ..., mtp="separate")`` writes the MTP head."""
    path = Path(path)
    stem = path.name[: -len(".gguf")] if path.name.endswith(".gguf") else path.name
    return path.with_name(f"{stem}-mtp.gguf")


def model_spec(arch: str, seed: int = 0, *, mtp: str | None = None, vocab=None, routing_skew: float = 0.0,
               dead_experts=None, **overrides: Any):
    """Everything ``make_model`` writes, without writing it:
    ``(metadata list[KV] of the trunk, trunk tensors list[TensorDef],
    MTP metadata or None, MTP tensors or None)``. The trunk metadata holds
    no ``general.file_type``; ``make_model`` adds it from the mix."""
    mod = _module(arch)
    voc = _vocab(vocab, overrides)
    mtp = _mtp_mode(mod, mtp)
    cfg = resolve_config(arch, mod.KEYS, overrides)
    cfg = mod.configure(cfg, voc)
    knobs = {"routing_skew": float(routing_skew), "dead_experts": dead_experts}
    trunk = mod.tensors(cfg, seed, voc, knobs)
    head = mod.mtp_tensors(cfg, seed, voc, knobs) if mtp != "none" else None

    general = [
        KV("general.architecture", "string", arch),
        KV("general.type", "string", "model"),
        KV("general.name", "string", f"synthetic {arch} seed {seed}"),
        KV("general.quantization_version", "uint32", 2),
    ]
    keys = metadata_entries(arch, mod.KEYS, cfg, getattr(mod, "ARRAY_TYPES", None))
    n_layer = cfg["block_count"]
    if mtp == "none":
        meta = general + keys + list(voc.kvs)
        return meta, trunk, None, None
    with_head = mod.with_mtp_keys(keys, cfg)
    if mtp == "inside":
        return general + with_head + list(voc.kvs), trunk + head, None, None
    head_meta = [KV("general.architecture", "string", arch), KV("general.type", "string", "model"),
                 KV("general.name", "string", f"synthetic {arch} seed {seed} MTP head (block {n_layer})"),
                 KV("general.quantization_version", "uint32", 2)] + with_head
    if mod.MTP_FILE_HAS_VOCAB:
        head_meta += list(voc.kvs)
    return general + keys + list(voc.kvs), trunk, head_meta, mod.mtp_head_file_tensors(trunk) + head


def make_model(path: "str | os.PathLike[str]", arch: str, seed: int = 0, *, mix="f32",
               split_max_size: int | None = None, split_max_tensors: int | None = None,
               mtp: str | None = None, vocab=None, force: bool = True, routing_skew: float = 0.0,
               dead_experts=None, progress: bool = False, **overrides: Any) -> Path:
    """Write a synthetic ``arch`` model to ``path``; return the path of its
    first shard.

    ``mix``: a preset (``"f32"``, ``"q8_0"``, ``"release"``) or a list of
    ``(regex, type)`` rules, first match wins (see :mod:`.mix`).
    ``split_max_size`` (bytes) / ``split_max_tensors``: write llama.cpp shards.
    ``mtp``: ``"separate"``, ``"inside"`` or ``"none"``; None is the
    architecture's default (``"separate"`` for qwen4exp, ``"none"`` otherwise).
    ``vocab``: a GGUF whose ``tokenizer.*`` metadata to use; default a small
    built-in BPE vocabulary (its size: ``vocab_size=...``).
    ``routing_skew``: router logits offset linearly over [-skew, +skew]
    across experts (0 = uniform routing). ``dead_experts``: a count per layer,
    a list of expert indices, or a dict layer -> indices never routed.
    ``overrides``: GGUF keys without the arch prefix, dots as underscores,
    e.g. ``block_count=6, expert_count=16, attention_indexer_top_k=32``.
    """
    rules = parse_mix(mix)
    meta, trunk, head_meta, head = model_spec(arch, seed, mtp=mtp, vocab=vocab, routing_skew=routing_skew,
                                              dead_experts=dead_experts, **overrides)
    path = Path(path)
    written = _write(path, meta, trunk, rules, seed, split_max_size, split_max_tensors, force, progress)
    if head is not None:
        _write(mtp_path(path), head_meta, head, rules, seed, None, None, force, progress)
    return written


def _vocab(vocab, overrides: dict) -> Vocab:
    size = overrides.pop("vocab_size", None)
    if vocab is not None:
        if size is not None:
            raise FleError("vocab_size sets the built-in vocabulary's size; do not combine it with vocab=FILE")
        return vocab_from_gguf(vocab)
    if size is None:
        return builtin_vocab()
    try:
        return builtin_vocab(int(size))
    except (TypeError, ValueError):
        raise FleError(f"vocab_size: cannot read {size!r} as an integer") from None


def _mtp_mode(mod, mtp: str | None) -> str:
    if mtp is None:
        return mod.DEFAULT_MTP
    if mtp not in MTP_MODES:
        raise FleError(f"mtp must be one of {', '.join(MTP_MODES)}, got {mtp!r}")
    if mtp != "none" and not mod.HAS_MTP:
        raise FleError(f"{mod.ARCH} has no MTP head; use mtp='none'")
    return mtp


def _write(path: Path, meta: Sequence[KV], tensors: Sequence[TensorDef], rules, seed: int,
           split_max_size, split_max_tensors, force: bool, progress: bool) -> Path:
    from gguf import GGUFValueType

    plan = WritePlan()
    for kv in meta:
        item = GGUFValueType[kv.item_type.upper()] if kv.vtype == ARR else None
        plan.add(kv.key, kv.value, GGUFValueType[kv.vtype.upper()], item)
    counts: dict[GGMLType, int] = {}
    for td in tensors:
        qtype = choose_type(td.name, td.shape, rules)
        if len(td.shape) >= 2:
            counts[qtype] = counts.get(qtype, 0) + int(np.prod(td.shape))
        plan.add_tensor(td.name, td.shape, qtype, encode(tensor_values(td, seed), qtype))
    ftype = file_type(counts)
    if ftype is not None:
        plan.add("general.file_type", ftype, GGUFValueType.UINT32)
    result = write_gguf(plan, path, split_max_size=split_max_size, split_max_tensors=split_max_tensors,
                        force=force, progress=progress)
    return result.paths[0]
