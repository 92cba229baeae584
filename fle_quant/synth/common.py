"""Pieces every synthetic architecture shares: metadata entries, tensor
definitions with their deterministic initialisers, the blocks that recur
across architectures (attention, gated delta net, MoE), and the writer.

A tensor is defined by its name, its ggml shape (ne0 first) and an
initialiser. The float values depend only on the seed, the tensor's name
and its shape: each tensor draws from its own generator, seeded from the
model seed and a hash of name and shape. The quant mix therefore never
changes a float weight, so one model can be written as a base and as donors
with different mixes.

This module knows nothing about tokenizers or quant presets.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import FleError
from ..ggml_types import BLOCK_GEOMETRY, GGMLType

# GGUF value types (gguf specification), by the names the writer uses.
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = (
    "uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool", "string", "array",
    "uint64", "int64", "float64")


@dataclass(frozen=True)
class KV:
    """One metadata entry; ``item_type`` is set for arrays only."""
    key: str
    vtype: str
    value: Any
    item_type: str | None = None


Init = Callable[[np.random.Generator, tuple], np.ndarray]


@dataclass(frozen=True)
class TensorDef:
    """A tensor to synthesise: ``shape`` in ggml order, ``init`` draws the
    float32 values in numpy order (the reverse of ``shape``)."""
    name: str
    shape: tuple[int, ...]
    init: Init = field(repr=False, compare=False)


# ---------------------------------------------------------------------------
# deterministic values


def tensor_rng(seed: int, name: str, shape: Sequence[int]) -> np.random.Generator:
    """The generator of one tensor: a function of (seed, name, shape) only."""
    digest = hashlib.blake2b(f"{name}|{tuple(int(d) for d in shape)}".encode(), digest_size=8).digest()
    return np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, int.from_bytes(digest, "little")])


def tensor_values(td: TensorDef, seed: int) -> np.ndarray:
    """Float32 values of ``td`` in numpy order (shape reversed)."""
    np_shape = tuple(reversed(td.shape))
    out = np.ascontiguousarray(td.init(tensor_rng(seed, td.name, td.shape), np_shape), dtype=np.float32)
    if out.shape != np_shape:  # an initialiser bug, not user input
        raise AssertionError(f"{td.name}: initialiser gave {out.shape}, expected {np_shape}")
    return out


def linear(gain: float = 1.0) -> Init:
    """A projection stored as ggml [n_in, n_out]: entries N(0, gain^2 / n_in),
    so an input of rms 1 gives outputs of rms ~gain."""
    def init(rng, s):
        return rng.standard_normal(s, dtype=np.float32) * np.float32(gain / np.sqrt(s[-1]))
    return init


def normal(std: float = 1.0, mean: float = 0.0) -> Init:
    def init(rng, s):
        return rng.standard_normal(s, dtype=np.float32) * np.float32(std) + np.float32(mean)
    return init


def gamma(spread: float = 0.1) -> Init:
    """An RMSNorm weight in its stored form (around 1)."""
    return normal(spread, 1.0)


def uniform(lo: float, hi: float) -> Init:
    def init(rng, s):
        return rng.uniform(lo, hi, size=s).astype(np.float32)
    return init


# ---------------------------------------------------------------------------
# shared blocks (names from llama.cpp src/llama-arch.cpp, shapes from the
# loaders in src/models/*.cpp; ggml order, ne0 = input width)


def moe_tensors(p: str, n_embd: int, n_ff: int, n_expert: int, router: Init,
                down_gain: float = 1.0) -> list[TensorDef]:
    """Router and stacked experts of one layer (prefix ``p`` = 'blk.N.')."""
    return [
        TensorDef(p + "ffn_gate_inp.weight", (n_embd, n_expert), router),
        TensorDef(p + "ffn_gate_exps.weight", (n_embd, n_ff, n_expert), linear(1.0)),
        TensorDef(p + "ffn_up_exps.weight", (n_embd, n_ff, n_expert), linear(1.0)),
        TensorDef(p + "ffn_down_exps.weight", (n_ff, n_embd, n_expert), linear(down_gain)),
    ]


def shexp_tensors(p: str, n_embd: int, n_ff: int, down_gain: float = 1.0,
                  gate_gain: float = 1.0) -> list[TensorDef]:
    """Shared expert with its one-scalar sigmoid gate (qwen3next, qwen4exp)."""
    return [
        TensorDef(p + "ffn_gate_inp_shexp.weight", (n_embd,), linear(gate_gain)),
        TensorDef(p + "ffn_gate_shexp.weight", (n_embd, n_ff), linear(1.0)),
        TensorDef(p + "ffn_up_shexp.weight", (n_embd, n_ff), linear(1.0)),
        TensorDef(p + "ffn_down_shexp.weight", (n_ff, n_embd), linear(down_gain)),
    ]


def gdn_core_tensors(p: str, n_embd: int, head_dim: int, n_k_heads: int, n_v_heads: int,
                     conv_kernel: int, out_gain: float) -> list[TensorDef]:
    """Gated delta net tensors common to qwen3next and qwen4exp: fused q|k|v,
    the z gate, the causal conv, dt bias, A (stored as -exp(A_log)), the
    per-head output norm and the output projection."""
    key_dim = head_dim * n_k_heads
    value_dim = head_dim * n_v_heads
    conv_dim = 2 * key_dim + value_dim
    return [
        TensorDef(p + "attn_qkv.weight", (n_embd, conv_dim), linear(1.0)),
        TensorDef(p + "attn_gate.weight", (n_embd, value_dim), linear(1.0)),
        # depthwise causal conv, [kernel, channels]; a strong last tap keeps the
        # current token's own signal dominant
        TensorDef(p + "ssm_conv1d.weight", (conv_kernel, conv_dim), _conv_init(conv_kernel)),
        TensorDef(p + "ssm_dt.bias", (n_v_heads,), normal(0.5, 0.0)),
        # the converter stores -exp(A_log); A_log ~ U(log 1, log 16) as in HF init
        TensorDef(p + "ssm_a", (n_v_heads,), _neg_exp_uniform(0.0, np.log(16.0))),
        TensorDef(p + "ssm_norm.weight", (head_dim,), gamma(0.1)),
        TensorDef(p + "ssm_out.weight", (value_dim, n_embd), linear(out_gain)),
    ]


def _conv_init(kernel: int) -> Init:
    def init(rng, s):  # s = (channels, kernel)
        w = rng.standard_normal(s, dtype=np.float32) * np.float32(0.3 / np.sqrt(kernel))
        w[:, -1] += np.float32(1.0)
        return w
    return init


def _neg_exp_uniform(lo: float, hi: float) -> Init:
    def init(rng, s):
        return (-np.exp(rng.uniform(lo, hi, size=s))).astype(np.float32)
    return init


def router_init(n_expert: int, gain: float, skew: float, dead: Sequence[int], direction: np.ndarray | None,
                along: float) -> Init:
    """Router rows N(0, gain^2/n_embd) plus, per expert, a multiple of the
    embedding's shared direction: the dot product of a hidden state with that
    direction is about ``along``, so expert e's logit is shifted by about
    ``offset_e``. Offsets spread linearly over [-skew, +skew] in a random
    expert order (skew 0: uniform routing); dead experts get -30, which no
    token overcomes."""
    dead = sorted(set(int(d) for d in dead))

    def init(rng, s):  # s = (n_expert, n_embd)
        w = rng.standard_normal(s, dtype=np.float32) * np.float32(gain / np.sqrt(s[-1]))
        if direction is None:
            return w
        offsets = np.zeros(n_expert, dtype=np.float32)
        if skew:
            offsets = np.linspace(skew, -skew, n_expert, dtype=np.float32)[rng.permutation(n_expert)]
        offsets[dead] = -30.0
        unit = direction / np.linalg.norm(direction)
        w += (offsets[:, None] / np.float32(along)) * unit[None, :].astype(np.float32)
        return w
    return init


def shared_direction(seed: int, n_embd: int) -> np.ndarray:
    """A fixed +-1 direction present in every token embedding; it gives the
    router something common to all tokens to bias experts with."""
    rng = tensor_rng(seed, "shared_direction", (n_embd,))
    return np.where(rng.random(n_embd) < 0.5, -1.0, 1.0).astype(np.float32)


def embedding_init(seed: int, n_embd: int, shared: float) -> Init:
    """Token embeddings of rms ~1: N(0, 1 - shared^2) plus ``shared`` times
    the shared direction."""
    d = shared_direction(seed, n_embd)

    def init(rng, s):  # s = (n_vocab, n_embd)
        e = rng.standard_normal(s, dtype=np.float32) * np.float32(np.sqrt(1.0 - shared * shared))
        e += np.float32(shared) * d[None, :]
        return e
    return init


def output_init(seed: int, n_vocab: int, n_embd: int, scale: float, shared: float) -> Init:
    """The output head: row j is ``scale`` times a (unit-norm) embedding of a
    token pi(j) for a fixed random permutation pi, plus small noise. A hidden
    state close to embed(t) then gives one clearly winning next token pi^-1(t),
    so next-token distributions are peaked; everything the layers add moves
    the hidden state and changes which token wins. The embedding is drawn
    here again from its own generator (same seed, name and shape), so the
    head never depends on the order tensors are built in."""
    emb = embedding_init(seed, n_embd, shared)

    def init(rng, s):  # s = (n_vocab, n_embd)
        e = emb(tensor_rng(seed, "token_embd.weight", (n_embd, n_vocab)), s)
        perm = rng.permutation(n_vocab)
        w = e[perm]
        w /= np.linalg.norm(w, axis=1, keepdims=True)
        w *= np.float32(scale)
        w += rng.standard_normal(s, dtype=np.float32) * np.float32(0.1 * scale / np.sqrt(n_embd))
        return w
    return init


# ---------------------------------------------------------------------------
# configuration helpers


def prime_at_least(n: int) -> int:
    n = max(2, int(n))
    while True:
        if n < 4 or all(n % d for d in range(2, int(n ** 0.5) + 1)):
            return n
        n += 1


def check_positive(cfg: dict, *names: str) -> None:
    for n in names:
        v = cfg[n]
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
            raise FleError(f"{n} must be a positive integer, got {v!r}")


def check_multiple(cfg: dict, name: str, of: int, why: str) -> None:
    if cfg[name] % of:
        raise FleError(f"{name} = {cfg[name]} must be a multiple of {of} ({why})")


def parse_dead_experts(dead, n_layer: int, n_expert: int, n_used: int, seed: int) -> list[list[int]]:
    """``dead`` is None, a count per layer (chosen at random per layer), a list
    of expert indices (the same in every layer) or a dict layer -> indices."""
    if dead is None or dead == 0:
        per = [[] for _ in range(n_layer)]
    elif isinstance(dead, (int, np.integer)) and not isinstance(dead, bool):
        if dead < 0:
            raise FleError(f"dead_experts must be >= 0, got {dead}")
        per = []
        for il in range(n_layer):
            rng = tensor_rng(seed, f"dead_experts.{il}", (n_expert,))
            per.append(sorted(int(e) for e in rng.permutation(n_expert)[:dead]))
    elif isinstance(dead, dict):
        per = [sorted(set(int(e) for e in dead.get(il, ()))) for il in range(n_layer)]
    else:
        idx = sorted(set(int(e) for e in dead))
        per = [idx for _ in range(n_layer)]
    for il, lst in enumerate(per):
        if any(e < 0 or e >= n_expert for e in lst):
            raise FleError(f"dead_experts: layer {il} lists {lst}; expert indices must be in 0..{n_expert - 1}")
        if n_expert - len(lst) < n_used:
            raise FleError(f"dead_experts: layer {il} would keep {n_expert - len(lst)} live experts, "
                           f"fewer than expert_used_count = {n_used}")
    return per


# ---------------------------------------------------------------------------
# encoding and writing


def encode(values: np.ndarray, qtype: GGMLType) -> np.ndarray:
    """Float32 values (numpy order) -> what the writer stores for ``qtype``:
    float32/float16 arrays, or uint8 rows of quant blocks."""
    if qtype == GGMLType.F32:
        return values
    if qtype == GGMLType.F16:
        return values.astype(np.float16)
    rows = values.reshape(-1, values.shape[-1])
    data = _quantize(rows, qtype)
    return data.reshape(*values.shape[:-1], data.shape[-1])


def _quantize(rows: np.ndarray, qtype: GGMLType) -> np.ndarray:
    from ..quants import quantize  # numba kernels: imported only when a mix quantizes

    return quantize(rows, qtype)


def fits(ne0: int, qtype: GGMLType) -> bool:
    return ne0 % BLOCK_GEOMETRY[qtype][0] == 0


def resolve_config(arch: str, keys: Sequence[tuple[str, str, Any]], overrides: dict) -> dict:
    """Defaults of ``keys`` ((GGUF key without the arch prefix, value type,
    default)) with ``overrides`` applied. Override names are the keys with
    dots as underscores (``attention.head_count`` -> ``attention_head_count``);
    a default of None means derived from the others unless overridden."""
    names = {k.replace(".", "_"): (k, t, d) for k, t, d in keys}
    cfg = {n: d for n, (k, t, d) in names.items()}
    for name, value in overrides.items():
        if name not in names:
            known = ", ".join(sorted(names))
            raise FleError(f"{arch} has no setting {name!r}; known settings: {known}")
        cfg[name] = _coerce(name, names[name][1], value)
    return cfg


def _coerce(name: str, vtype: str, value):
    try:
        if vtype == ARR:
            if isinstance(value, str):
                value = [v for v in value.replace(",", " ").split() if v]
            return [int(v) for v in value]
        if vtype in (U32, I32, U64):
            if isinstance(value, str):
                value = value.strip()
            f = float(value)
            if f != int(f):
                raise ValueError
            return int(f)
        if vtype == F32:
            return float(value)
        if vtype == BOOL:
            if isinstance(value, str):
                return value.strip().lower() in ("1", "true", "yes", "on")
            return bool(value)
        return value
    except (TypeError, ValueError):
        raise FleError(f"{name}: cannot read {value!r} as {vtype}") from None


def metadata_entries(arch: str, keys: Sequence[tuple[str, str, Any]], cfg: dict,
                     item_types: dict[str, str] | None = None) -> list[KV]:
    """The arch-prefixed metadata for every key whose value is not None."""
    out = []
    for k, t, _ in keys:
        v = cfg[k.replace(".", "_")]
        if v is None:
            continue
        if t == ARR:
            out.append(KV(f"{arch}.{k}", ARR, list(v), (item_types or {}).get(k, I32)))
        else:
            out.append(KV(f"{arch}.{k}", t, v))
    return out
