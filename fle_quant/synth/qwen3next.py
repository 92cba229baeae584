"""Synthetic ``qwen3next`` (Qwen3-Next-80B-A3B): gated delta net layers with
a gated full-attention layer every ``full_attention_interval``-th layer,
RMSNorm before the mixer and after it (``post_attention_norm``), and in
every layer a routed MoE plus a shared expert behind a one-scalar sigmoid
gate.

Facts from llama.cpp (llama-cpp-python 0.3.36): names from
``src/llama-arch.cpp``; tensors and shapes from
``llama_model_qwen3next::load_arch_tensors`` (``src/models/qwen3next.cpp``):
GDN layers carry the fused ``attn_qkv`` / ``attn_gate`` pair the converter
writes (``Qwen3NextModel.modify_tensors`` in ``conversion/qwen.py``), the
fused ``ssm_ba`` (beta | alpha), ``ssm_a`` (no ``.weight``; holds
-exp(A_log)) and ``ssm_dt.bias``; attention layers have ``attn_q`` twice as
wide (query and gate per head). Norm gammas are stored as 1 + w as the
converter does (``ssm_norm`` excepted); here they are simply drawn around 1.

MTP (``_QwenMtpMixin``): the head is block N = ``block_count`` of the trunk,
an attention-layer-shaped block (its own norms, attention, MoE and shared
expert) plus ``nextn.eh_proj`` [2 n_embd -> n_embd] (embedding half first),
``nextn.enorm``, ``nextn.hnorm`` and ``nextn.shared_head_norm`` (from the
checkpoint's ``mtp.norm``). A file holding it has ``block_count`` = N + 1
and ``nextn_predict_layers`` = 1; llama.cpp loads it inside the trunk and
skips it unless MTP is requested. The separate head file is what the
converter's ``--mtp`` export writes: the head block plus the trunk's
``token_embd``, ``output_norm`` and ``output``.
"""
from __future__ import annotations

import numpy as np

from ..errors import FleError
from .common import (F32, KV, U32, TensorDef, check_positive, embedding_init, gamma, gdn_core_tensors,
                     linear, moe_tensors, normal, output_init, parse_dead_experts, router_init, shared_direction,
                     shexp_tensors)
from .qwen3moe import head_scale

ARCH = "qwen3next"
HAS_MTP = True
MTP_FILE_HAS_VOCAB = True  # the separate head file carries the tokenizer
DEFAULT_MTP = "none"

KEYS = [
    ("block_count", U32, 4),
    ("context_length", U32, 4096),
    ("embedding_length", U32, 256),
    ("feed_forward_length", U32, 768),
    ("attention.head_count", U32, 4),
    ("attention.head_count_kv", U32, 2),
    ("rope.freq_base", F32, 10_000_000.0),
    ("attention.layer_norm_rms_epsilon", F32, 1e-6),
    ("expert_count", U32, 8),
    ("expert_used_count", U32, 2),
    ("attention.key_length", U32, 64),
    ("attention.value_length", U32, None),  # = key_length
    ("expert_feed_forward_length", U32, 256),
    ("expert_shared_feed_forward_length", U32, 256),
    ("ssm.conv_kernel", U32, 4),
    ("ssm.state_size", U32, 64),
    ("ssm.group_count", U32, 2),
    ("ssm.time_step_rank", U32, 4),
    ("ssm.inner_size", U32, None),  # = state_size * time_step_rank
    ("full_attention_interval", U32, 4),
    ("rope.dimension_count", U32, None),  # = key_length / 4 (partial rotary 0.25)
]

SHARED = 0.5
HEAD_COS = 0.35
ATTN_GAIN = 2.0
GDN_GAIN = 0.8
MOE_GAIN = 1.6
SHEXP_GAIN = 1.6


def configure(cfg: dict, voc) -> dict:
    return configure_gdn(cfg)


def configure_gdn(cfg: dict) -> dict:
    """Derived sizes and checks shared with qwen4exp."""
    if cfg["attention_value_length"] is None:
        cfg["attention_value_length"] = cfg["attention_key_length"]
    if cfg["ssm_inner_size"] is None:
        cfg["ssm_inner_size"] = cfg["ssm_state_size"] * cfg["ssm_time_step_rank"]
    if cfg["rope_dimension_count"] is None:
        cfg["rope_dimension_count"] = cfg["attention_key_length"] // 4
    check_positive(cfg, "block_count", "embedding_length", "attention_head_count", "attention_head_count_kv",
                   "expert_count", "expert_used_count", "attention_key_length", "expert_feed_forward_length",
                   "expert_shared_feed_forward_length", "ssm_conv_kernel", "ssm_state_size", "ssm_group_count",
                   "ssm_time_step_rank", "full_attention_interval", "rope_dimension_count")
    if cfg["attention_value_length"] != cfg["attention_key_length"]:
        raise FleError("attention_value_length must equal attention_key_length (llama.cpp asserts it)")
    if cfg["ssm_inner_size"] != cfg["ssm_state_size"] * cfg["ssm_time_step_rank"]:
        raise FleError(f"ssm_inner_size = {cfg['ssm_inner_size']} must be ssm_state_size * ssm_time_step_rank "
                       f"= {cfg['ssm_state_size'] * cfg['ssm_time_step_rank']}")
    if cfg["ssm_time_step_rank"] % cfg["ssm_group_count"]:
        raise FleError("ssm_time_step_rank (V heads) must be a multiple of ssm_group_count (K heads)")
    if cfg["attention_head_count"] % cfg["attention_head_count_kv"]:
        raise FleError("attention_head_count must be a multiple of attention_head_count_kv")
    if cfg["expert_used_count"] > cfg["expert_count"]:
        raise FleError("expert_used_count must not exceed expert_count")
    if cfg["rope_dimension_count"] % 2 or cfg["rope_dimension_count"] > cfg["attention_key_length"]:
        raise FleError("rope_dimension_count must be even and at most attention_key_length")
    return cfg


def is_recurrent(cfg: dict, il: int) -> bool:
    """llama.cpp's rule: layer il is GDN unless (il + 1) % interval == 0."""
    return (il + 1) % cfg["full_attention_interval"] != 0


def with_mtp_keys(keys: list[KV], cfg: dict) -> list[KV]:
    """Metadata of a file holding the MTP block: block_count counts it."""
    out = []
    for kv in keys:
        if kv.key == f"{ARCH}.block_count":
            kv = KV(kv.key, kv.vtype, cfg["block_count"] + 1)
        out.append(kv)
    return out + [KV(f"{ARCH}.nextn_predict_layers", U32, 1)]


def tensors(cfg: dict, seed: int, voc, knobs: dict) -> list[TensorDef]:
    n_embd, n_vocab = cfg["embedding_length"], voc.n_vocab
    out = [
        TensorDef("token_embd.weight", (n_embd, n_vocab), embedding_init(seed, n_embd, SHARED)),
        TensorDef("output_norm.weight", (n_embd,), gamma(0.05)),
        TensorDef("output.weight", (n_embd, n_vocab),
                  output_init(seed, n_vocab, n_embd, head_scale(n_vocab, n_embd, 1.0, HEAD_COS), SHARED)),
    ]
    dead = parse_dead_experts(knobs.get("dead_experts"), cfg["block_count"] + 1, cfg["expert_count"],
                              cfg["expert_used_count"], seed)
    for il in range(cfg["block_count"]):
        out += _block(cfg, seed, il, is_recurrent(cfg, il), knobs, dead[il])
    return out


def mtp_tensors(cfg: dict, seed: int, voc, knobs: dict) -> list[TensorDef]:
    n_embd, il = cfg["embedding_length"], cfg["block_count"]
    dead = parse_dead_experts(knobs.get("dead_experts"), il + 1, cfg["expert_count"], cfg["expert_used_count"], seed)
    p = f"blk.{il}."
    return _block(cfg, seed, il, False, knobs, dead[il]) + [
        TensorDef(p + "nextn.eh_proj.weight", (2 * n_embd, n_embd), linear(1.0)),
        TensorDef(p + "nextn.enorm.weight", (n_embd,), gamma(0.1)),
        TensorDef(p + "nextn.hnorm.weight", (n_embd,), gamma(0.1)),
        TensorDef(p + "nextn.shared_head_norm.weight", (n_embd,), gamma(0.05)),
    ]


def mtp_head_file_tensors(trunk: list[TensorDef]) -> list[TensorDef]:
    """Trunk tensors the converter's MTP-only export keeps next to the head."""
    keep = ("token_embd.weight", "output_norm.weight", "output.weight")
    return [t for t in trunk if t.name in keep]


def _block(cfg: dict, seed: int, il: int, recurrent: bool, knobs: dict, dead: list[int]) -> list[TensorDef]:
    n_embd = cfg["embedding_length"]
    p = f"blk.{il}."
    out = [
        TensorDef(p + "attn_norm.weight", (n_embd,), gamma(0.1)),
        TensorDef(p + "post_attention_norm.weight", (n_embd,), gamma(0.1)),
    ]
    if recurrent:
        n_v = cfg["ssm_time_step_rank"]
        core = gdn_core_tensors(p, n_embd, cfg["ssm_state_size"], cfg["ssm_group_count"], n_v,
                                cfg["ssm_conv_kernel"], GDN_GAIN)
        # ssm_ba sits between ssm_a and ssm_norm in the loader's order
        out += core[:5] + [TensorDef(p + "ssm_ba.weight", (n_embd, 2 * n_v), linear(1.0))] + core[5:]
    else:
        out += attention_tensors(p, cfg, ATTN_GAIN)
    direction = shared_direction(seed, n_embd)
    n_expert = cfg["expert_count"]
    out += moe_tensors(p, n_embd, cfg["expert_feed_forward_length"], n_expert,
                       router_init(n_expert, 1.0, knobs.get("routing_skew", 0.0), dead, direction,
                                   SHARED * np.sqrt(n_embd)),
                       down_gain=MOE_GAIN)
    out += shexp_tensors(p, n_embd, cfg["expert_shared_feed_forward_length"], down_gain=SHEXP_GAIN)
    return out


def attention_tensors(p: str, cfg: dict, out_gain: float, qk_gamma: float = 1.0) -> list[TensorDef]:
    """Gated attention: ``attn_q`` holds query and gate per head. q/k norm
    gammas around ``qk_gamma``: above 1 they sharpen the attention."""
    n_embd, hd = cfg["embedding_length"], cfg["attention_key_length"]
    n_head, n_head_kv = cfg["attention_head_count"], cfg["attention_head_count_kv"]
    return [
        TensorDef(p + "attn_q.weight", (n_embd, 2 * hd * n_head), linear(1.0)),
        TensorDef(p + "attn_k.weight", (n_embd, hd * n_head_kv), linear(1.0)),
        TensorDef(p + "attn_v.weight", (n_embd, hd * n_head_kv), linear(1.0)),
        TensorDef(p + "attn_output.weight", (hd * n_head, n_embd), linear(out_gain)),
        TensorDef(p + "attn_q_norm.weight", (hd,), normal(0.1 * qk_gamma, qk_gamma)),
        TensorDef(p + "attn_k_norm.weight", (hd,), normal(0.1 * qk_gamma, qk_gamma)),
    ]
