"""Synthetic ``qwen3moe`` (Qwen3-30B-A3B, Qwen3-235B-A22B): attention with
per-head q/k RMSNorm and GQA, NEOX rotary over the whole head, and a routed
MoE (softmax, top-k, renormalised) in every layer; no shared expert.

Facts from llama.cpp (llama-cpp-python 0.3.36): tensor names from
``src/llama-arch.cpp``; which tensors and shapes are loaded from
``llama_model_qwen3moe::load_arch_tensors`` (``src/models/qwen3moe.cpp``);
the keys written are those ``convert_hf_to_gguf.py`` writes for
``Qwen3MoeForCausalLM`` (``TextModel.set_gguf_parameters`` plus
``expert_feed_forward_length``). No MTP exists for this architecture.
"""
from __future__ import annotations

import numpy as np

from ..errors import FleError
from .common import (F32, U32, TensorDef, check_positive, embedding_init, gamma, linear, moe_tensors,
                     output_init, parse_dead_experts, router_init, shared_direction)

ARCH = "qwen3moe"

# (GGUF key without the "qwen3moe." prefix, type, default)
KEYS = [
    ("block_count", U32, 4),
    ("context_length", U32, 4096),
    ("embedding_length", U32, 256),
    ("feed_forward_length", U32, 768),
    ("attention.head_count", U32, 4),
    ("attention.head_count_kv", U32, 2),
    ("rope.freq_base", F32, 1_000_000.0),
    ("attention.layer_norm_rms_epsilon", F32, 1e-6),
    ("expert_count", U32, 8),
    ("expert_used_count", U32, 2),
    ("attention.key_length", U32, 64),
    ("attention.value_length", U32, None),  # = key_length
    ("expert_feed_forward_length", U32, 256),
]

HAS_MTP = False
MTP_FILE_HAS_VOCAB = False  # the separate head file carries no tokenizer
DEFAULT_MTP = "none"
SHARED = 0.5          # weight of the shared direction in every embedding
ATTN_GAIN = 0.7       # scales attention's and the experts' contributions to the residual
MOE_GAIN = 0.7
HEAD_COS = 0.35       # alignment of the final state with the current token's embedding the head assumes


def configure(cfg: dict, voc) -> dict:
    if cfg["attention_value_length"] is None:
        cfg["attention_value_length"] = cfg["attention_key_length"]
    check_positive(cfg, "block_count", "embedding_length", "attention_head_count", "attention_head_count_kv",
                   "expert_count", "expert_used_count", "attention_key_length", "expert_feed_forward_length")
    if cfg["attention_value_length"] != cfg["attention_key_length"]:
        raise FleError("qwen3moe needs attention_value_length == attention_key_length (llama.cpp asserts it)")
    if cfg["attention_head_count"] % cfg["attention_head_count_kv"]:
        raise FleError("attention_head_count must be a multiple of attention_head_count_kv")
    if cfg["expert_used_count"] > cfg["expert_count"]:
        raise FleError("expert_used_count must not exceed expert_count")
    return cfg


def tensors(cfg: dict, seed: int, voc, knobs: dict) -> list[TensorDef]:
    n_vocab = voc.n_vocab
    n_embd = cfg["embedding_length"]
    n_head, n_head_kv = cfg["attention_head_count"], cfg["attention_head_count_kv"]
    hd = cfg["attention_key_length"]
    n_expert, n_ff = cfg["expert_count"], cfg["expert_feed_forward_length"]
    dead = parse_dead_experts(knobs.get("dead_experts"), cfg["block_count"], n_expert,
                              cfg["expert_used_count"], seed)
    direction = shared_direction(seed, n_embd)
    out = [
        TensorDef("token_embd.weight", (n_embd, n_vocab), embedding_init(seed, n_embd, SHARED)),
        TensorDef("output_norm.weight", (n_embd,), gamma(0.05)),
        TensorDef("output.weight", (n_embd, n_vocab),
                  output_init(seed, n_vocab, n_embd, head_scale(n_vocab, n_embd, 1.0, HEAD_COS), SHARED)),
    ]
    for il in range(cfg["block_count"]):
        p = f"blk.{il}."
        out += [
            TensorDef(p + "attn_norm.weight", (n_embd,), gamma(0.1)),
            TensorDef(p + "attn_q.weight", (n_embd, hd * n_head), linear(1.0)),
            TensorDef(p + "attn_k.weight", (n_embd, hd * n_head_kv), linear(1.0)),
            TensorDef(p + "attn_v.weight", (n_embd, hd * n_head_kv), linear(1.0)),
            TensorDef(p + "attn_output.weight", (hd * n_head, n_embd), linear(ATTN_GAIN * 2.0)),
            TensorDef(p + "attn_k_norm.weight", (hd,), gamma(0.1)),
            TensorDef(p + "attn_q_norm.weight", (hd,), gamma(0.1)),
            TensorDef(p + "ffn_norm.weight", (n_embd,), gamma(0.1)),
        ]
        out += moe_tensors(p, n_embd, n_ff, n_expert,
                           router_init(n_expert, 1.0, knobs.get("routing_skew", 0.0), dead[il], direction,
                                       SHARED * np.sqrt(n_embd)),
                           down_gain=MOE_GAIN * 1.6)
    return out


def head_scale(n_vocab: int, n_embd: int, state_rms: float, cos: float) -> float:
    """Norm of the output rows: a final state of rms ``state_rms`` whose
    cosine with the current token's embedding is ``cos`` then scores that
    token's successor about log(n_vocab) + 2 above the rest. The layers'
    contributions keep the cosine well below 1, so ``cos`` is tuned per
    architecture against llama.cpp's mean top-1 probability (~0.5-0.8)."""
    return (np.log(n_vocab) + 2.0) / (cos * np.sqrt(n_embd) * state_rms)
