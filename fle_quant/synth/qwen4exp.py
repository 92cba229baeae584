"""Synthetic ``qwen4exp`` (Qwen3.8-Flash-Next): qwen3next's gated delta net
with a sigmoid output gate and separate ``ssm_beta`` / ``ssm_alpha``,
hyper-connections (``hc_count`` residual streams) in place of every layer
norm, QSA sparse attention (a lightning indexer picks the blocks each query
attends to) on every ``full_attention_interval``-th layer, a PLE n-gram hash
table feeding one GDN layer, and a routed MoE plus a shared expert in every
layer.

Where the names and shapes come from (llama-cpp-python 0.3.36's llama.cpp):

- tensor names: ``src/llama-arch.cpp`` (``hc_attn_*``, ``hc_ffn_*``,
  ``output_hc_*``, ``indexer.*``, ``ple_*``, ``per_layer_token_embd``);
- which tensors and shapes: ``llama_model_qwen4exp::load_arch_tensors`` in
  ``src/models/qwen4exp.cpp``. The HC, PLE and output-mixer gammas load as
  [n_embd, hc] with TENSOR_ALLOW_RESHAPE; they are written 1-D [hc * n_embd]
  as the checkpoint holds them;
- keys: ``load_arch_hparams`` there, written as the converter
  (``conversion/qwen4exp.py`` on top of ``Qwen3NextModel`` and the Qwen3.5
  M-RoPE mixin) writes them: ``attention.recurrent_layers`` (from the
  checkpoint's layer_types) next to ``full_attention_interval``,
  ``rope.dimension_sections``, ``attention.compress_ratios`` (the ratio on
  full-attention layers, 0 elsewhere), ``ple.layers`` (0-based),
  ``ple.layer_multipliers`` / ``head_offsets`` / ``head_vocab_sizes`` as
  uint64 arrays;
- stored forms: ``ssm_a`` = -exp(A_log); HC, PLE and indexer gammas are
  stored as 1 + w (drawn around 1 here); the PLE conv is [kernel, hc * n_embd].

The PLE hash (llama.cpp ``build_inp_ple``): for n = 2 .. ngram_size, mixed =
t0*m0 XOR t1*m1 [XOR t2*m2] (uint64), row = mixed % vocab_h + offset_h. The
head vocabularies here are consecutive primes and the multipliers odd
numbers below 2^63 / n_vocab / 2 (so token * multiplier stays non-negative
in int64), drawn from splitmix64 as public reimplementations do; llama.cpp
takes whatever the file says.

The MTP head (llama.cpp 0.3.36 has none for qwen4exp; the converter drops
``mtp.*``): block N = ``block_count``, laid out as the engines that run the
released head expect it (public loaders and fixture writers): a full
attention block shaped like a QSA layer (``attn_q`` with gate, ``attn_k``,
``attn_v``, ``attn_output``, q/k norms, ``indexer.*``), its own ``hc_attn_*``
and ``hc_ffn_*``, its own MoE and shared expert, plus ``nextn.eh_proj``
[2 n_embd -> n_embd] (embedding half first), ``nextn.enorm`` [n_embd],
``nextn.hnorm`` [hc * n_embd] and its own head mixer
``nextn.hc_head_{norm,down,up}``; ``token_embd`` and ``output`` are shared
with the trunk. A file with the block counts it (``block_count`` = N + 1,
``nextn_predict_layers`` = 1, a trailing 0 in ``compress_ratios``: the head
attends densely, and False in ``recurrent_layers``), as qwen3next's converter
does. The separate head file holds only block N's tensors.
"""
from __future__ import annotations

import numpy as np

from ..errors import FleError
from .common import (ARR, BOOL, F32, KV, U32, U64, TensorDef, check_positive, embedding_init, gamma,
                     gdn_core_tensors, linear, moe_tensors, normal, output_init, parse_dead_experts, prime_at_least,
                     router_init, shared_direction, shexp_tensors)
from .qwen3moe import head_scale
from .qwen3next import attention_tensors, configure_gdn

ARCH = "qwen4exp"
HAS_MTP = True
MTP_FILE_HAS_VOCAB = False  # the separate head file carries no tokenizer
DEFAULT_MTP = "separate"

KEYS = [
    ("block_count", U32, 4),
    ("context_length", U32, 4096),
    ("embedding_length", U32, 256),
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
    ("attention.recurrent_layers", ARR, None),  # from full_attention_interval
    ("full_attention_interval", U32, 4),
    ("rope.dimension_count", U32, None),  # = key_length / 4
    ("rope.dimension_sections", ARR, None),  # rope.dimension_count / 2 split 11:11:10, as [11, 11, 10, 0]
    ("hyper_connection.count", U32, 4),
    ("hyper_connection.low_rank", U32, 32),
    ("attention.indexer.head_count", U32, 2),
    ("attention.indexer.key_length", U32, 64),
    ("attention.indexer.top_k", U32, 16),
    ("attention.compress_ratios", ARR, None),  # 4 on full-attention layers, 0 elsewhere
    ("ple.layers", ARR, [1]),
    ("ple.ngram_size", U32, 3),
    ("ple.heads_per_ngram", U32, 4),
    ("ple.conv_kernel", U32, 4),
    ("ple.eos_token_id", U32, None),  # the vocabulary's EOS
    ("embedding_length_per_layer_input", U32, None),  # embedding_length / PLE heads
    ("ple.layer_multipliers", ARR, None),
    ("ple.head_offsets", ARR, None),
    ("ple.head_vocab_sizes", ARR, None),
]
ARRAY_TYPES = {
    "attention.recurrent_layers": BOOL,
    "ple.layer_multipliers": U64,
    "ple.head_offsets": U64,
    "ple.head_vocab_sizes": U64,
}

COMPRESS_RATIO = 4
PLE_ROWS_PER_HEAD = 127   # smallest head vocabulary; later heads take the next primes
# Gains tuned against llama.cpp so that next-token distributions stay peaked
# (mean top-1 ~0.55) while removing any one component (PLE, HC inject, QSA
# selection, shared expert, attention, routed experts) moves them clearly
# (mean KLD 0.25-0.8 nats over 128 tokens).
SHARED = 0.5
HEAD_COS = 0.27
MIX_RMS = 0.5             # rms of an HC mixer's output: normalised streams times sigmoid gates
ATTN_GAIN = 9.0           # attention averages values over many tokens, so its projection is large
QK_GAMMA = 2.5            # sharper attention: which cells QSA keeps matters
GDN_GAIN = 2.5
MOE_GAIN = 4.0
SHEXP_GAIN = 4.0
PLE_VALUE_GAIN = 1.0
INJECT_GAIN = 8.0


def configure(cfg: dict, voc) -> dict:
    cfg = configure_gdn(cfg)
    check_positive(cfg, "hyper_connection_count", "hyper_connection_low_rank", "attention_indexer_head_count",
                   "attention_indexer_key_length", "attention_indexer_top_k", "ple_conv_kernel")
    n_layer = cfg["block_count"]
    if cfg["hyper_connection_count"] < 2:
        raise FleError("hyper_connection_count must be at least 2 (llama.cpp rejects 1)")
    if cfg["attention_indexer_key_length"] < cfg["rope_dimension_count"]:
        raise FleError("attention_indexer_key_length must be at least rope_dimension_count (the indexer is rotated)")
    rec = [(il + 1) % cfg["full_attention_interval"] != 0 for il in range(n_layer)]
    if cfg["attention_recurrent_layers"] is None:
        cfg["attention_recurrent_layers"] = rec
    else:
        rec = [bool(v) for v in cfg["attention_recurrent_layers"]]
        if len(rec) != n_layer:
            raise FleError(f"attention_recurrent_layers has {len(rec)} entries, expected block_count = {n_layer}")
        cfg["attention_recurrent_layers"] = rec
    if all(rec):
        raise FleError("qwen4exp needs at least one full-attention layer (lower full_attention_interval)")
    if not any(rec):
        raise FleError("qwen4exp needs at least one GDN layer (llama.cpp aborts without one)")
    if cfg["attention_compress_ratios"] is None:
        cfg["attention_compress_ratios"] = [0 if r else COMPRESS_RATIO for r in rec]
    elif len(cfg["attention_compress_ratios"]) != n_layer:
        raise FleError(f"attention_compress_ratios needs block_count = {n_layer} entries")
    n_rot = cfg["rope_dimension_count"]
    if cfg["rope_dimension_sections"] is None:
        half = n_rot // 2
        a = int(round(half * 11 / 32))
        cfg["rope_dimension_sections"] = [a, a, half - 2 * a, 0]
    elif len(cfg["rope_dimension_sections"]) != 4:
        raise FleError("rope_dimension_sections needs 4 entries")

    ple = list(cfg["ple_layers"])
    if len(ple) > 1:
        raise FleError("llama.cpp supports one PLE layer; give ple_layers one index (or none)")
    if not ple:
        for k in ("ple_ngram_size", "ple_heads_per_ngram", "ple_conv_kernel", "ple_eos_token_id",
                  "embedding_length_per_layer_input", "ple_layer_multipliers", "ple_head_offsets",
                  "ple_head_vocab_sizes"):
            cfg[k] = None
        cfg["ple_layers"] = None
        return cfg
    il = ple[0]
    if not 0 <= il < n_layer or not rec[il]:
        raise FleError(f"ple_layers = {ple}: the PLE layer must be a GDN layer (llama.cpp keeps its conv state there)")
    check_positive(cfg, "ple_ngram_size", "ple_heads_per_ngram")
    if cfg["ple_ngram_size"] < 2:
        raise FleError("ple_ngram_size must be at least 2")
    n_heads = (cfg["ple_ngram_size"] - 1) * cfg["ple_heads_per_ngram"]
    n_embd = cfg["embedding_length"]
    if cfg["embedding_length_per_layer_input"] is None:
        if n_embd % n_heads:
            raise FleError(f"embedding_length {n_embd} is not a multiple of the {n_heads} PLE heads")
        cfg["embedding_length_per_layer_input"] = n_embd // n_heads
    if cfg["embedding_length_per_layer_input"] * n_heads != n_embd:
        raise FleError("embedding_length_per_layer_input * PLE heads must equal embedding_length "
                       "(llama.cpp feeds the gathered rows to ple_key as one embedding)")
    if cfg["ple_eos_token_id"] is None:
        cfg["ple_eos_token_id"] = voc.eos_id
    if cfg["ple_head_vocab_sizes"] is None:
        sizes, v = [], PLE_ROWS_PER_HEAD
        while len(sizes) < n_heads:
            v = prime_at_least(v)
            sizes.append(v)
            v += 1
        cfg["ple_head_vocab_sizes"] = sizes
    if len(cfg["ple_head_vocab_sizes"]) < n_heads:
        raise FleError(f"ple_head_vocab_sizes needs {n_heads} entries")
    if cfg["ple_head_offsets"] is None:
        cfg["ple_head_offsets"] = list(np.cumsum([0] + cfg["ple_head_vocab_sizes"][:-1]).tolist())
    if cfg["ple_layer_multipliers"] is None:
        cfg["ple_layer_multipliers"] = ple_multipliers(cfg["ple_ngram_size"], voc.n_vocab, 0)
    cfg["ple_layers"] = ple
    return cfg


def _splitmix64(v: int) -> int:
    m = (1 << 64) - 1
    v = (v + 0x9E3779B97F4A7C15) & m
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & m
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & m
    return v ^ (v >> 31)


def ple_multipliers(ngram: int, n_vocab: int, ordinal: int, seed: int = 1234) -> list[int]:
    """Odd multipliers m_i < 2^63 / n_vocab (so t * m_i fits in int64)."""
    half = max(1, ((1 << 63) - 1) // max(1, n_vocab) // 2)
    base = (seed + 10007 * ordinal) & ((1 << 64) - 1)
    return [2 * (_splitmix64((base + 0x9E3779B97F4A7C15 * (i + 1)) & ((1 << 64) - 1)) % half) + 1
            for i in range(ngram)]


def with_mtp_keys(keys: list[KV], cfg: dict) -> list[KV]:
    out = []
    for kv in keys:
        if kv.key == f"{ARCH}.block_count":
            kv = KV(kv.key, kv.vtype, cfg["block_count"] + 1)
        elif kv.key == f"{ARCH}.attention.compress_ratios":
            kv = KV(kv.key, kv.vtype, list(kv.value) + [0], kv.item_type)
        elif kv.key == f"{ARCH}.attention.recurrent_layers":
            kv = KV(kv.key, kv.vtype, list(kv.value) + [False], kv.item_type)
        out.append(kv)
    return out + [KV(f"{ARCH}.nextn_predict_layers", U32, 1)]


def tensors(cfg: dict, seed: int, voc, knobs: dict) -> list[TensorDef]:
    n_embd, n_vocab = cfg["embedding_length"], voc.n_vocab
    hc = cfg["hyper_connection_count"]
    out = [TensorDef("token_embd.weight", (n_embd, n_vocab), embedding_init(seed, n_embd, SHARED))]
    out += hc_mixer("output_hc_", n_embd, hc, cfg["hyper_connection_low_rank"], inject=False)
    out.append(TensorDef("output.weight", (n_embd, n_vocab),
                         output_init(seed, n_vocab, n_embd, head_scale(n_vocab, n_embd, MIX_RMS, HEAD_COS), SHARED)))
    if cfg["ple_layers"]:
        rows = int(max(o + v for o, v in zip(cfg["ple_head_offsets"], cfg["ple_head_vocab_sizes"])))
        out.append(TensorDef("per_layer_token_embd.weight", (cfg["embedding_length_per_layer_input"], rows),
                             normal(1.0)))
    dead = parse_dead_experts(knobs.get("dead_experts"), cfg["block_count"] + 1, cfg["expert_count"],
                              cfg["expert_used_count"], seed)
    rec = cfg["attention_recurrent_layers"]
    for il in range(cfg["block_count"]):
        p = f"blk.{il}."
        out += _hc_pair(p, cfg)
        if rec[il]:
            n_v = cfg["ssm_time_step_rank"]
            out += gdn_core_tensors(p, n_embd, cfg["ssm_state_size"], cfg["ssm_group_count"], n_v,
                                    cfg["ssm_conv_kernel"], GDN_GAIN)
            out += [TensorDef(p + "ssm_beta.weight", (n_embd, n_v), linear(2.0)),
                    TensorDef(p + "ssm_alpha.weight", (n_embd, n_v), linear(2.0))]
        else:
            out += _qsa(p, cfg)
        if cfg["ple_layers"] and il in cfg["ple_layers"]:
            out += _ple(p, cfg)
        out += _ffn(p, cfg, seed, knobs, dead[il])
    return out


def mtp_tensors(cfg: dict, seed: int, voc, knobs: dict) -> list[TensorDef]:
    n_embd, il = cfg["embedding_length"], cfg["block_count"]
    hc, lr = cfg["hyper_connection_count"], cfg["hyper_connection_low_rank"]
    dead = parse_dead_experts(knobs.get("dead_experts"), il + 1, cfg["expert_count"], cfg["expert_used_count"], seed)
    p = f"blk.{il}."
    return (_hc_pair(p, cfg) + _qsa(p, cfg) + _ffn(p, cfg, seed, knobs, dead[il]) + [
        TensorDef(p + "nextn.eh_proj.weight", (2 * n_embd, n_embd), linear(1.0)),
        TensorDef(p + "nextn.enorm.weight", (n_embd,), gamma(0.1)),
        TensorDef(p + "nextn.hnorm.weight", (hc * n_embd,), gamma(0.1)),
    ] + hc_mixer(p + "nextn.hc_head_", n_embd, hc, lr, inject=False))


def mtp_head_file_tensors(trunk: list[TensorDef]) -> list[TensorDef]:
    """The released head file shares token_embd and output with the trunk."""
    return []


def hc_mixer(prefix: str, n_embd: int, hc: int, low_rank: int, inject: bool) -> list[TensorDef]:
    """One hyper-connection read: grouped-norm gamma, low-rank gate (down,
    up) and, for the layer mixers, the [hc * n_embd -> hc] inject rows.
    Gains: the down projection is divided by hc in the graph, so gain hc
    gives the silu an input of rms ~1; the up gain spreads the sigmoid gates;
    inject of rms ``INJECT_GAIN`` = 2 hc spreads the write weights
    2 sigmoid(inject / hc) over most of (0, 2)."""
    hc_dim = hc * n_embd
    out = [
        TensorDef(prefix + "norm.weight", (hc_dim,), gamma(0.1)),
        TensorDef(prefix + "down.weight", (hc_dim, low_rank), linear(float(hc))),
        TensorDef(prefix + "up.weight", (low_rank, hc_dim), linear(2.0)),
    ]
    if inject:
        out.append(TensorDef(prefix + "inject.weight", (hc_dim, hc), linear(INJECT_GAIN)))
    return out


def _hc_pair(p: str, cfg: dict) -> list[TensorDef]:
    args = (cfg["embedding_length"], cfg["hyper_connection_count"], cfg["hyper_connection_low_rank"])
    return hc_mixer(p + "hc_attn_", *args, inject=True) + hc_mixer(p + "hc_ffn_", *args, inject=True)


def _qsa(p: str, cfg: dict) -> list[TensorDef]:
    n_embd = cfg["embedding_length"]
    idx_dim, idx_h = cfg["attention_indexer_key_length"], cfg["attention_indexer_head_count"]
    return attention_tensors(p, cfg, ATTN_GAIN, QK_GAMMA) + [
        # large indexer projections make the block scores differ clearly, so
        # the top-k choice is far from arbitrary
        TensorDef(p + "indexer.q_proj.weight", (n_embd, idx_h * idx_dim), linear(2.0)),
        TensorDef(p + "indexer.k_proj.weight", (n_embd, idx_dim), linear(2.0)),
        TensorDef(p + "indexer.q_norm.weight", (idx_dim,), gamma(0.1)),
        TensorDef(p + "indexer.k_norm.weight", (idx_dim,), gamma(0.1)),
    ]


def _ple(p: str, cfg: dict) -> list[TensorDef]:
    n_embd, hc = cfg["embedding_length"], cfg["hyper_connection_count"]
    hc_dim = hc * n_embd
    return [
        TensorDef(p + "ple_key.weight", (n_embd, hc_dim), linear(1.0)),
        TensorDef(p + "ple_value.weight", (n_embd, n_embd), linear(PLE_VALUE_GAIN)),
        TensorDef(p + "ple_norm_key.weight", (hc_dim,), gamma(0.1)),
        TensorDef(p + "ple_norm_query.weight", (hc_dim,), gamma(0.1)),
        TensorDef(p + "ple_norm_conv.weight", (hc_dim,), gamma(0.1)),
        TensorDef(p + "ple_conv1d.weight", (cfg["ple_conv_kernel"], hc_dim), normal(0.5)),
    ]


def _ffn(p: str, cfg: dict, seed: int, knobs: dict, dead: list[int]) -> list[TensorDef]:
    n_embd, n_expert = cfg["embedding_length"], cfg["expert_count"]
    direction = shared_direction(seed, n_embd)
    router = router_init(n_expert, 2.0, knobs.get("routing_skew", 0.0), dead, direction,
                         SHARED * np.sqrt(n_embd) * MIX_RMS)
    return (moe_tensors(p, n_embd, cfg["expert_feed_forward_length"], n_expert, router, down_gain=MOE_GAIN)
            + shexp_tensors(p, n_embd, cfg["expert_shared_feed_forward_length"], down_gain=SHEXP_GAIN,
                            gate_gain=2.0))
