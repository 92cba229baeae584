"""Fast mode of the model factory: files of real scale (tens of GB) written
in seconds, for speed benchmarks. The weights carry no meaning.

The file has exactly the metadata, tensor names, shapes and types
:func:`fle_quant.synth.make_model` writes for the same arguments
(:func:`~fle_quant.synth.model_spec` and the mix's rules decide them); only
the values differ:

- every block-quantized tensor of at least ``random_min_values`` values
  (experts, attention and GDN projections, the output head, ...) is random
  valid blocks, generated chunk by chunk from a counter-based hash of
  ``(seed, name, shape)``: random bytes for the quant fields, and in every
  block the f16 scale set to one value of random sign, chosen so that the
  dequantized weights have standard deviation ``gain / sqrt(n_in)``
  (``n_in`` = the row length). The factor per type is measured once by
  dequantizing random blocks of scale 1. For the K-quants with a min
  (Q2_K, Q4_K, Q5_K) every sub-block's min index is set equal to its scale
  index and ``dmin`` to the mean quant level times ``d`` (Q4_1 and Q5_1: the
  min is minus that), so that the weights have mean zero instead of being
  all of one sign. Gains: 0.005 for the projections that write into the
  residual stream (``attn_output``, ``ffn_down_exps``, ``ffn_down_shexp``,
  ``ssm_out``, ``ple_value``), 1 for the rest;
- the token embedding is N(0, 1 - s^2) plus ``s`` = 0.9 times the
  factory's shared direction, drawn and quantized in row groups; with the
  small residual gains the hidden state keeps that direction through many
  layers;
- the routers (``ffn_gate_inp``) are the factory's router rows with their
  component along the shared direction replaced by a per-expert logit
  offset ``routing_skew * z`` (``z`` ~ N(0, 1) per layer and expert, seeded)
  and the rest scaled so that the token-dependent part of a logit has a
  std of about 1 (the router gain); ``routing_skew`` 0 gives near-uniform
  expert popularity; dead experts get -30 as in the factory;
- norm weights are ones (so that the direction the routers see is the
  shared direction itself);
- every other tensor (biases, the shared-expert gate, HC mixers,
  anything smaller than ``random_min_values`` or stored as a float type)
  holds the normal factory's values, computed one tensor at a time while
  writing.

Everything is deterministic in ``(seed, name, shape)``: the same arguments
write byte-identical files.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from numba import njit

from ..errors import FleError
from ..ggml_types import BLOCK_GEOMETRY, GGMLType
from ..gguf_writer import WritePlan, write_gguf
from .common import ARR, KV, TensorDef, encode, parse_dead_experts, shared_direction, tensor_rng, tensor_values
from .mix import choose_type, file_type, parse_mix
from .qwen4exp import MIX_RMS as QWEN4EXP_MIX_RMS

__all__ = ["make_fast_model", "fast_plans", "RANDOM_MIN_VALUES", "FAST_SHARED", "SMALL_GAIN", "fast_gain",
           "unit_std", "FAST_TYPES"]

RANDOM_MIN_VALUES = 1 << 20   # tensors with at least this many values get random blocks
FAST_SHARED = 0.9             # weight of the shared direction in the fast token embedding
# gain of the projections that write into the residual stream: small, so that what the layers add (a
# part common to all tokens, from the shared direction) does not build up into fixed router offsets over
# 48 layers; measured on a 48-layer, 128-expert file with random tokens, skew 0: the policy's hit rate at a
# third of the experts cached is 0.85 with 0.1, 0.47 with 0.02, 0.36 with 0.005 (near-uniform)
SMALL_GAIN = 0.005
EMBD_ROW_GROUP = 4096         # token embedding rows drawn from one generator
_UNIT_BYTES = 4 << 20         # random blocks generated per call (at most)
_SAMPLE_BLOCKS = 4096         # blocks dequantized to measure a type's factor

_SMALL_GAIN_RX = re.compile(r"\.(attn_output|ffn_down_exps|ffn_down_shexp|ssm_out|ple_value)\.weight$")
_NORM_RX = re.compile(r"_norm\.weight$")
_ROUTER_RX = re.compile(r"^blk\.(\d+)\.ffn_gate_inp\.weight$")
_FLOAT_TYPES = {GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.F64}
# rms of the state the router reads, relative to the residual's (qwen4exp reads HC mixer outputs)
_ROUTER_INPUT_RMS = {"qwen4exp": QWEN4EXP_MIX_RMS}


@dataclass(frozen=True)
class _Layout:
    """Where a block's f16 fields sit and how the random bytes are fixed up.
    ``min_ratio``: the min field is ``min_ratio * d``; ``fix``: 1 = Q2_K
    scale bytes (min nibble := scale nibble), 2 = the 12 packed 6-bit
    scale/min bytes of Q4_K/Q5_K (every min := its scale)."""
    d_off: int
    min_off: int = -1
    min_ratio: float = 0.0
    fix: int = 0


# types fast mode can write, from the block structs of ggml-common.h
# (offsets as in fle_quant.quants.dequant.FP16_SCALE_OFFSETS)
_LAYOUTS: dict[GGMLType, _Layout] = {
    GGMLType.Q4_0: _Layout(0), GGMLType.Q5_0: _Layout(0), GGMLType.Q8_0: _Layout(0),
    GGMLType.Q4_1: _Layout(0, 2, -7.5), GGMLType.Q5_1: _Layout(0, 2, -15.5),
    GGMLType.IQ4_NL: _Layout(0), GGMLType.IQ4_XS: _Layout(0),
    GGMLType.IQ3_S: _Layout(0), GGMLType.IQ3_XXS: _Layout(0),
    GGMLType.IQ2_S: _Layout(0), GGMLType.IQ2_XS: _Layout(0), GGMLType.IQ2_XXS: _Layout(0),
    GGMLType.IQ1_S: _Layout(0),
    GGMLType.Q2_K: _Layout(80, 82, 1.5, 1), GGMLType.Q3_K: _Layout(108),
    GGMLType.Q4_K: _Layout(0, 2, 7.5, 2), GGMLType.Q5_K: _Layout(0, 2, 15.5, 2),
    GGMLType.Q6_K: _Layout(208),
}
FAST_TYPES = tuple(_LAYOUTS)


# ---------------------------------------------------------------------------
# random blocks


@njit(cache=True, nogil=True)
def _fill_blocks(out8, out64, n_blocks, bsize, key, word0, d_off, d_lo, d_hi, min_off, m_lo, m_hi, fix):
    """Random bytes for ``n_blocks`` blocks (word i of the tensor is
    splitmix64 of ``key + (i + 1) * golden``), then each block's f16 fields
    set: |d| fixed, the sign taken from the random byte it replaces."""
    n_words = (n_blocks * bsize + 7) // 8
    gold = np.uint64(0x9E3779B97F4A7C15)
    m1 = np.uint64(0xBF58476D1CE4E5B9)
    m2 = np.uint64(0x94D049BB133111EB)
    base = np.uint64(key) + np.uint64(word0) * gold
    for i in range(n_words):
        z = base + np.uint64(i + 1) * gold
        z = (z ^ (z >> np.uint64(30))) * m1
        z = (z ^ (z >> np.uint64(27))) * m2
        out64[i] = z ^ (z >> np.uint64(31))
    for b in range(n_blocks):
        o = b * bsize
        sign = out8[o + d_off + 1] & 0x80
        out8[o + d_off] = d_lo
        out8[o + d_off + 1] = d_hi ^ sign
        if min_off >= 0:
            out8[o + min_off] = m_lo
            out8[o + min_off + 1] = m_hi ^ sign
        if fix == 1:  # Q2_K: scales[16] at 0, low nibble scale, high nibble min
            for j in range(16):
                s = out8[o + j] & 15
                out8[o + j] = s | (s << 4)
        elif fix == 2:  # Q4_K / Q5_K: scales[12] at 4 (get_scale_min_k4)
            for j in range(4):
                out8[o + 8 + j] = out8[o + 4 + j]
                s = out8[o + 12 + j] & 15
                out8[o + 12 + j] = s | (s << 4)


def _f16_bits(x: float) -> tuple[int, int]:
    v = int(np.array([x], dtype=np.float16).view(np.uint16)[0])
    return v & 0xFF, v >> 8


def _blocks(qtype: GGMLType, key: int, block0: int, n_blocks: int, d: float) -> np.ndarray:
    """``n_blocks`` random blocks starting at block ``block0`` of a tensor
    (``block0 * block_bytes`` must be a multiple of 8), as uint8 bytes."""
    lay = _LAYOUTS[qtype]
    bsize = BLOCK_GEOMETRY[qtype][1]
    n = n_blocks * bsize
    buf = np.empty((n + 7) // 8 * 8, dtype=np.uint8)
    d_lo, d_hi = _f16_bits(abs(d))
    m_lo, m_hi = _f16_bits(lay.min_ratio * abs(d)) if lay.min_off >= 0 else (0, 0)
    _fill_blocks(buf, buf.view(np.uint64), n_blocks, bsize, np.uint64(key), (block0 * bsize) // 8,
                 lay.d_off, d_lo, d_hi, lay.min_off, m_lo, m_hi, lay.fix)
    return buf[:n]


def _key(seed: int, name: str, shape: Sequence[int]) -> int:
    digest = hashlib.blake2b(f"{int(seed)}|{name}|{tuple(int(s) for s in shape)}|fast".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little")


@functools.lru_cache(maxsize=None)
def unit_std(qtype: GGMLType) -> float:
    """Standard deviation of the dequantized values of fast mode's random
    blocks of ``qtype`` with scale 1 (measured on a fixed sample)."""
    from ..quants import dequantize

    qtype = GGMLType(qtype)
    _check_type(qtype, "(sample)")
    sample = _blocks(qtype, _key(0, "unit_std", (qtype.value,)), 0, _SAMPLE_BLOCKS, 1.0)
    vals = dequantize(sample, qtype).astype(np.float64)
    if not np.isfinite(vals).all():  # a layout bug, not user input
        raise AssertionError(f"{qtype.name}: random blocks of scale 1 dequantize to non-finite values")
    std = float(vals.std())
    if not std > 0:
        raise AssertionError(f"{qtype.name}: random blocks of scale 1 dequantize to a constant")
    return std


def _check_type(qtype: GGMLType, name: str) -> None:
    if qtype not in _LAYOUTS:
        known = ", ".join(t.name for t in _LAYOUTS)
        raise FleError(f"fast mode cannot write tensor {name!r} as {qtype.name} (random blocks need a type "
                       f"whose scales are f16 fields: {known}); choose another type for it with a mix rule")


def fast_gain(name: str) -> float:
    """The gain fast mode gives a random tensor: small for the projections
    that write into the residual stream."""
    return SMALL_GAIN if _SMALL_GAIN_RX.search(name) else 1.0


def _prefetched(make, items):
    """``make(item)`` for each item in order, the next one computed in a
    worker thread while the caller writes the current one (the block
    generator and numpy's normal draws release the GIL)."""
    items = list(items)
    if not items:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fle-synth") as pool:
        fut = pool.submit(make, items[0])
        for item in items[1:]:
            cur = fut.result()
            fut = pool.submit(make, item)
            yield cur
        yield fut.result()


class _RandomSource:
    """A tensor of random valid blocks, generated while it is written."""

    def __init__(self, name: str, shape: tuple[int, ...], qtype: GGMLType, seed: int):
        _check_type(qtype, name)
        block, bsize = BLOCK_GEOMETRY[qtype]
        self.qtype = qtype
        self.n_blocks = int(np.prod(shape)) // block
        self.n_bytes = self.n_blocks * bsize
        self.key = _key(seed, name, shape)
        target = fast_gain(name) / np.sqrt(shape[0])
        self.d = float(np.float16(target / unit_std(qtype)))
        if not (np.isfinite(self.d) and self.d > 0):
            raise FleError(f"fast mode: tensor {name!r} needs a {qtype.name} scale of {target / unit_std(qtype):.3g}, "
                           "which f16 cannot hold")
        # the values of a sample must be finite (they are unless a layout is wrong)
        from ..quants import dequantize

        head = dequantize(_blocks(qtype, self.key, 0, min(64, self.n_blocks), self.d), qtype)
        if not np.isfinite(head).all():
            raise FleError(f"fast mode: tensor {name!r} ({qtype.name}) dequantizes to non-finite values")
        # blocks per generated unit: a multiple of 8 so every unit starts on a whole word
        self.per_unit = max(8, _UNIT_BYTES // bsize // 8 * 8)

    def unit(self, b0: int) -> np.ndarray:
        return _blocks(self.qtype, self.key, b0, min(self.per_unit, self.n_blocks - b0), self.d)

    def chunks(self, chunk_size: int):
        for unit in _prefetched(self.unit, range(0, self.n_blocks, self.per_unit)):
            unit = memoryview(unit)
            for i in range(0, len(unit), chunk_size):
                yield unit[i: i + chunk_size]


# ---------------------------------------------------------------------------
# values as in the normal factory, computed when written


class _ValuesSource:
    """The bytes of ``encode(values(), qtype)``, computed on first use."""

    def __init__(self, n_bytes: int, values, qtype: GGMLType):
        self.n_bytes = n_bytes
        self._values = values
        self.qtype = qtype

    def chunks(self, chunk_size: int):
        data = encode(self._values(), self.qtype)
        raw = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        del data
        for i in range(0, len(raw), chunk_size):
            yield raw[i: i + chunk_size]


class _EmbeddingSource:
    """The fast token embedding: groups of ``EMBD_ROW_GROUP`` rows, each
    drawn from its own generator and encoded on its own."""

    def __init__(self, name: str, shape: tuple[int, ...], qtype: GGMLType, seed: int, n_bytes: int):
        self.name, self.shape, self.qtype, self.seed = name, shape, qtype, seed
        self.n_bytes = n_bytes
        self.direction = shared_direction(seed, shape[0]) * np.float32(FAST_SHARED)

    def rows(self, g: int) -> np.ndarray:
        n_embd, n_vocab = self.shape[0], self.shape[1]
        n = min(EMBD_ROW_GROUP, n_vocab - g * EMBD_ROW_GROUP)
        rng = tensor_rng(self.seed, f"{self.name}|rows{g}", self.shape)
        e = rng.standard_normal((n, n_embd), dtype=np.float32)
        e *= np.float32(np.sqrt(1.0 - FAST_SHARED ** 2))
        e += self.direction[None, :]
        return e

    def group(self, g: int) -> np.ndarray:
        return np.ascontiguousarray(encode(self.rows(g), self.qtype)).reshape(-1).view(np.uint8)

    def chunks(self, chunk_size: int):
        for raw in _prefetched(self.group, range(-(-self.shape[1] // EMBD_ROW_GROUP))):
            raw = memoryview(raw)
            for i in range(0, len(raw), chunk_size):
                yield raw[i: i + chunk_size]


def _fast_router(td: TensorDef, seed: int, skew: float, dead: Sequence[int], along: float):
    """Router rows: the factory's rows (built without skew) with their
    component along the shared direction replaced by offset_e / ``along``,
    offset_e = ``skew`` * z_e (z_e ~ N(0, 1), seeded by name), -30 if dead,
    and the rest scaled by 1 / sqrt(1 - s^2): the token-dependent part of a
    logit then has the normal factory's scale (std ~ the router gain), and
    ``skew`` is the offsets' std in about those units."""
    def values():
        w = tensor_values(td, seed).astype(np.float32)  # (n_expert, n_embd)
        n_expert, n_embd = w.shape
        unit = shared_direction(seed, n_embd)
        unit = unit / np.linalg.norm(unit)
        w -= (w @ unit)[:, None] * unit[None, :]
        # the token-dependent part of the embedding has rms sqrt(1 - s^2): keep its logits at the factory's scale
        w *= np.float32(1.0 / np.sqrt(1.0 - FAST_SHARED ** 2))
        z = tensor_rng(seed, td.name + "|routing_skew", (n_expert,)).standard_normal(n_expert)
        offsets = (float(skew) * z).astype(np.float32)
        offsets[list(dead)] = -30.0
        w += (offsets[:, None] / np.float32(along)) * unit[None, :]
        return w
    return values


# ---------------------------------------------------------------------------
# plans and writing


def _meta_value(meta: Sequence[KV], key: str):
    for kv in meta:
        if kv.key == key:
            return kv.value
    return None


def _plan(arch: str, meta: Sequence[KV], tensors: Sequence[TensorDef], rules, seed: int, routing_skew: float,
          dead_experts, random_min_values: int) -> WritePlan:
    from gguf import GGUFValueType

    plan = WritePlan()
    for kv in meta:
        item = GGUFValueType[kv.item_type.upper()] if kv.vtype == ARR else None
        plan.add(kv.key, kv.value, GGUFValueType[kv.vtype.upper()], item)
    n_expert = _meta_value(meta, f"{arch}.expert_count")
    n_used = _meta_value(meta, f"{arch}.expert_used_count")
    n_embd = _meta_value(meta, f"{arch}.embedding_length")
    along = FAST_SHARED * np.sqrt(n_embd) * _ROUTER_INPUT_RMS.get(arch, 1.0) if n_embd else 1.0
    counts: dict[GGMLType, int] = {}
    for td in tensors:
        qtype = choose_type(td.name, td.shape, rules)
        n_values = int(np.prod(td.shape))
        if len(td.shape) >= 2:
            counts[qtype] = counts.get(qtype, 0) + n_values
        block, bsize = BLOCK_GEOMETRY[qtype]
        n_bytes = n_values // block * bsize
        router = _ROUTER_RX.match(td.name)
        if td.name == "token_embd.weight":
            src: Any = _EmbeddingSource(td.name, td.shape, qtype, seed, n_bytes)
        elif router and len(td.shape) == 2 and n_expert:
            il = int(router.group(1))
            dead = parse_dead_experts(dead_experts, il + 1, int(n_expert), int(n_used), seed)[il]
            src = _ValuesSource(n_bytes, _fast_router(td, seed, routing_skew, dead, along), qtype)
        elif _NORM_RX.search(td.name) and len(td.shape) == 1:
            # unit norm weights: the hidden state's shared direction stays the one the routers are built on
            src = _ValuesSource(n_bytes, functools.partial(np.ones, td.shape, np.float32), qtype)
        elif qtype not in _FLOAT_TYPES and n_values >= random_min_values:
            src = _RandomSource(td.name, td.shape, qtype, seed)
        else:
            src = _ValuesSource(n_bytes, functools.partial(tensor_values, td, seed), qtype)
        plan.add_tensor(td.name, td.shape, qtype, src)
    ftype = file_type(counts)
    if ftype is not None:
        plan.add("general.file_type", ftype, GGUFValueType.UINT32)
    return plan


def fast_plans(path: "str | os.PathLike[str]", arch: str, seed: int = 0, *, mix="release",
               rules: Sequence[tuple[str, object]] = (), routing_skew: float = 0.0, dead_experts=None,
               mtp: str | None = None, vocab=None, random_min_values: int = RANDOM_MIN_VALUES,
               **overrides: Any) -> list[tuple[Path, WritePlan]]:
    """The write plans :func:`make_fast_model` writes, ``[(path, plan)]``
    (a second entry for a separate MTP head), without writing anything:
    give them to :func:`fle_quant.gguf_writer.planned_layout` for the sizes."""
    from . import model_spec, mtp_path

    compiled = parse_mix(list(rules)) + parse_mix(mix)
    meta, trunk, head_meta, head = model_spec(arch, seed, mtp=mtp, vocab=vocab, routing_skew=0.0,
                                              dead_experts=dead_experts, **overrides)
    path = Path(path)
    out = [(path, _plan(arch, meta, trunk, compiled, seed, routing_skew, dead_experts, random_min_values))]
    if head is not None:
        out.append((mtp_path(path), _plan(arch, head_meta, head, compiled, seed, routing_skew, dead_experts,
                                          random_min_values)))
    return out


def make_fast_model(path: "str | os.PathLike[str]", arch: str, seed: int = 0, *, mix="release",
                    rules: Sequence[tuple[str, object]] = (), routing_skew: float = 0.0, dead_experts=None,
                    mtp: str | None = None, vocab=None, split_max_size: int | None = None,
                    split_max_tensors: int | None = None, random_min_values: int = RANDOM_MIN_VALUES,
                    progress: bool = True, force: bool = True, **overrides: Any) -> Path:
    """Write a fast-mode ``arch`` model to ``path`` (see the module
    docstring); return the path of its first shard.

    Arguments as :func:`fle_quant.synth.make_model`, except: ``mix``
    defaults to ``"release"``; ``rules`` are ``(regex, type)`` rules checked
    before the mix's; ``routing_skew`` is the standard deviation of the
    per-expert router logit offsets (Gaussian, not a linear spread);
    ``random_min_values``: tensors with at least this many values are random
    blocks. A random tensor whose type fast mode cannot generate is a
    FleError naming it."""
    plans = fast_plans(path, arch, seed, mix=mix, rules=rules, routing_skew=routing_skew,
                       dead_experts=dead_experts, mtp=mtp, vocab=vocab, random_min_values=random_min_values,
                       **overrides)
    first = None
    for i, (p, plan) in enumerate(plans):
        result = write_gguf(plan, p, split_max_size=split_max_size if i == 0 else None,
                            split_max_tensors=split_max_tensors if i == 0 else None, force=force,
                            progress=progress)
        if first is None:
            first = result.paths[0]
    return first
