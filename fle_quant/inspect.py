"""What a user needs to know about a GGUF before splicing it: architecture,
key hyperparameters, total size and bits per weight, and per layer the
types and bytes of the expert tensors.

``summarize`` measures (plain data out); ``format_summary`` renders it. Works
on any shard of a split model and on MTP-head files.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .ggml_types import GGMLType
from .units import format_size

_BLK = re.compile(r"^blk\.(\d+)\.(.+?)(?:\.weight|\.bias)?$")
_EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")
_SHEXP_PARTS = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")


@dataclass
class LayerSummary:
    index: int
    kind: str                                              # "gdn", "attention", "qsa", "mtp", ...
    expert_types: dict[str, str] = field(default_factory=dict)   # part -> type name
    expert_bytes: int = 0
    shared_expert_bytes: int = 0
    other_bytes: int = 0
    n_experts: int | None = None


@dataclass
class ModelSummary:
    paths: list[str]
    arch: str
    hparams: dict[str, object]
    n_tensors: int
    file_size: int
    tensor_bytes: int
    n_params: int
    type_bytes: dict[str, int]
    layers: list[LayerSummary]
    global_bytes: int
    provenance: dict[str, object]

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.tensor_bytes / max(self.n_params, 1)

    @property
    def expert_bytes(self) -> int:
        return sum(layer.expert_bytes for layer in self.layers)


_HPARAMS = (
    "block_count", "nextn_predict_layers", "context_length", "embedding_length",
    "feed_forward_length", "attention.head_count", "attention.head_count_kv",
    "attention.key_length", "attention.value_length", "expert_count", "expert_used_count",
    "expert_feed_forward_length", "expert_shared_feed_forward_length",
    "full_attention_interval", "ssm.inner_size", "ssm.state_size", "ssm.group_count",
    "ssm.time_step_rank", "hyper_connection.count", "attention.indexer.top_k", "ple.layers",
    "rope.freq_base",
)


def _layer_kind(names: set[str], index: int, n_trunk: int | None) -> str:
    if n_trunk is not None and index >= n_trunk:
        return "mtp"
    if any(n.startswith(("ssm_", "attn_qkv")) for n in names):
        return "gdn"
    if any(n.startswith("indexer") for n in names):
        return "qsa"
    if any(n.startswith("attn_") for n in names):
        return "attention"
    return "-"


def summarize(model) -> ModelSummary:
    """Measure a model opened with :class:`fle_quant.gguf_reader.GGUFModel`."""
    arch = model.arch
    hparams = {}
    for key in _HPARAMS:
        value = model.metadata.get(f"{arch}.{key}")
        if value is not None:
            hparams[key] = value
    tokens = model.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None:
        hparams["n_vocab"] = len(tokens)

    per_layer_names: dict[int, set[str]] = defaultdict(set)
    layers: dict[int, LayerSummary] = {}
    type_bytes: dict[str, int] = defaultdict(int)
    n_params = tensor_bytes = global_bytes = 0
    for info in model.tensors.values():
        n_params += info.n_elements
        tensor_bytes += info.n_bytes
        type_bytes[GGMLType(info.qtype).name] += info.n_bytes
        m = _BLK.match(info.name)
        if not m:
            global_bytes += info.n_bytes
            continue
        idx, part = int(m.group(1)), m.group(2)
        per_layer_names[idx].add(part)
        layer = layers.setdefault(idx, LayerSummary(index=idx, kind="-"))
        if part in _EXPERT_PARTS:
            layer.expert_types[part] = GGMLType(info.qtype).name
            layer.expert_bytes += info.n_bytes
            if len(info.shape) == 3:
                layer.n_experts = int(info.shape[2])
        elif part in _SHEXP_PARTS:
            layer.shared_expert_bytes += info.n_bytes
        else:
            layer.other_bytes += info.n_bytes

    n_trunk = model.metadata.get(f"{arch}.block_count")
    n_mtp = model.metadata.get(f"{arch}.nextn_predict_layers") or 0
    if isinstance(n_trunk, int) and n_mtp and max(layers, default=-1) >= n_trunk:
        trunk = n_trunk   # MTP blocks are numbered after the trunk's layers
    elif isinstance(n_trunk, int) and n_mtp:
        trunk = n_trunk - n_mtp
    else:
        trunk = None
    for idx, layer in layers.items():
        layer.kind = _layer_kind(per_layer_names[idx], idx, trunk)

    provenance = {k: v for k, v in model.metadata.items() if k.startswith("fle.")}
    return ModelSummary(
        paths=[str(p) for p in model.paths], arch=arch, hparams=hparams,
        n_tensors=len(model.tensors), file_size=model.file_size, tensor_bytes=tensor_bytes,
        n_params=n_params, type_bytes=dict(type_bytes), layers=[layers[i] for i in sorted(layers)],
        global_bytes=global_bytes, provenance=provenance,
    )


def _short(value: object) -> str:
    if isinstance(value, (list, tuple)):
        if len(value) > 8:
            return "[" + ", ".join(map(str, value[:8])) + f", ... ({len(value)} values)]"
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def format_summary(s: ModelSummary) -> str:
    out: list[str] = []
    shards = f" ({len(s.paths)} shards)" if len(s.paths) > 1 else ""
    out.append(f"file:     {Path(s.paths[0]).name}{shards}")
    out.append(f"arch:     {s.arch}")
    out.append(f"size:     {format_size(s.file_size)} ({s.file_size:,} bytes), "
               f"{s.n_tensors} tensors, {s.n_params:,} weights, {s.bits_per_weight:.3f} bits/weight")
    if s.layers:
        out.append(f"experts:  {format_size(s.expert_bytes)} in {sum(1 for l in s.layers if l.expert_bytes)} layers; "
                   f"non-expert {format_size(s.tensor_bytes - s.expert_bytes)}")
    types = ", ".join(f"{k} {format_size(v)}" for k, v in sorted(s.type_bytes.items(), key=lambda kv: -kv[1]))
    out.append(f"types:    {types}")
    out.append("hyperparameters:")
    for k, v in s.hparams.items():
        out.append(f"  {k:36s} {_short(v)}")
    if s.provenance:
        out.append("provenance:")
        for k, v in s.provenance.items():
            out.append(f"  {k:36s} {_short(v)}")
    if s.layers:
        out.append("")
        head = f"{'layer':>5} {'kind':9} {'gate':8} {'up':8} {'down':8} {'experts':>6} {'expert bytes':>14} {'shexp bytes':>12} {'other bytes':>12}"
        out.append(head)
        out.append("-" * len(head))
        for l in s.layers:
            t = l.expert_types
            gate = t.get("ffn_gate_exps", t.get("ffn_gate_up_exps", "-"))
            up = t.get("ffn_up_exps", "(fused)" if "ffn_gate_up_exps" in t else "-")
            out.append(f"{l.index:>5} {l.kind:9} {gate:8} {up:8} {t.get('ffn_down_exps', '-'):8} "
                       f"{l.n_experts if l.n_experts is not None else '-':>6} {l.expert_bytes:>14,} "
                       f"{l.shared_expert_bytes:>12,} {l.other_bytes:>12,}")
    return "\n".join(out)


def to_json(s: ModelSummary) -> dict:
    d = {k: v for k, v in s.__dict__.items() if k != "layers"}
    d["bits_per_weight"] = s.bits_per_weight
    d["expert_bytes"] = s.expert_bytes
    d["layers"] = [l.__dict__ for l in s.layers]
    return d
