"""Quant mixes: which ggml type each synthetic tensor is stored as.

A mix is an ordered list of ``(regex, type)`` rules matched (``re.search``)
against the full tensor name; the first match wins and an unmatched tensor
stays F32. Whatever the rules say, 1-D tensors stay F32, and a tensor whose
row length is not a whole number of the type's blocks takes the type
llama.cpp's quantizer falls back to (``tensor_type_fallback`` in
src/llama-quant.cpp: 256-blocks IQ types -> IQ4_NL, Q2_K/Q3_K -> Q4_0,
Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), or F32 when that does not fit
either. Presets:

- ``"f32"``: everything F32.
- ``"q8_0"``: every matrix Q8_0 except the router (llama.cpp never
  quantizes ``ffn_gate_inp``).
- ``"release"``: shaped like the public releases: routed experts IQ4_XS with
  gate/up in IQ3_S on odd layers, ``output`` Q6_K, the n-gram table IQ4_NL,
  every other matrix (attention, GDN, shared expert, MTP) Q8_0, routers, HC
  inject rows and every norm F32. The releases keep their dense weights
  above Q6_K: the report measured Q6_K dense weights only as a variant (no
  speed gain) and Q5_0 as one that failed its quality bound.
"""
from __future__ import annotations

import re
from typing import Sequence

from ..errors import FleError
from ..ggml_types import GGMLType, parse_type
from .common import fits

Rules = list[tuple["re.Pattern[str]", GGMLType]]

PRESETS: dict[str, list[tuple[str, str]]] = {
    "f32": [],
    "q8_0": [
        (r"\.ffn_gate_inp\.weight$", "F32"),
        (r".", "Q8_0"),
    ],
    "release": [
        (r"\.ffn_gate_inp\.weight$", "F32"),
        (r"\.hc_(attn|ffn)_inject\.weight$", "F32"),
        (r"^blk\.\d*[13579]\.ffn_(gate|up)_exps\.weight$", "IQ3_S"),
        (r"\.ffn_(gate|up|down)_exps\.weight$", "IQ4_XS"),
        (r"^per_layer_token_embd\.weight$", "IQ4_NL"),
        (r"^output\.weight$", "Q6_K"),
        (r".", "Q8_0"),
    ],
}

_FALLBACK = {
    GGMLType.IQ1_S: GGMLType.IQ4_NL, GGMLType.IQ1_M: GGMLType.IQ4_NL, GGMLType.IQ2_XXS: GGMLType.IQ4_NL,
    GGMLType.IQ2_XS: GGMLType.IQ4_NL, GGMLType.IQ2_S: GGMLType.IQ4_NL, GGMLType.IQ3_XXS: GGMLType.IQ4_NL,
    GGMLType.IQ3_S: GGMLType.IQ4_NL, GGMLType.IQ4_XS: GGMLType.IQ4_NL,
    GGMLType.Q2_0: GGMLType.Q4_0, GGMLType.Q2_K: GGMLType.Q4_0, GGMLType.Q3_K: GGMLType.Q4_0,
    GGMLType.TQ1_0: GGMLType.Q4_0, GGMLType.TQ2_0: GGMLType.Q4_0,
    GGMLType.Q4_K: GGMLType.Q5_0, GGMLType.Q5_K: GGMLType.Q5_1, GGMLType.Q6_K: GGMLType.Q8_0,
}

# llama_ftype for general.file_type, by the type that holds most weights
_FTYPE = {
    GGMLType.F32: 0, GGMLType.F16: 1, GGMLType.Q4_0: 2, GGMLType.Q4_1: 3, GGMLType.Q8_0: 7,
    GGMLType.Q5_0: 8, GGMLType.Q5_1: 9, GGMLType.Q2_K: 10, GGMLType.Q3_K: 12, GGMLType.Q4_K: 15,
    GGMLType.Q5_K: 17, GGMLType.Q6_K: 18, GGMLType.IQ2_XXS: 19, GGMLType.IQ2_XS: 20,
    GGMLType.IQ3_XXS: 23, GGMLType.IQ1_S: 24, GGMLType.IQ4_NL: 25, GGMLType.IQ3_S: 26,
    GGMLType.IQ2_S: 28, GGMLType.IQ4_XS: 30, GGMLType.IQ1_M: 31, GGMLType.BF16: 32,
    GGMLType.TQ1_0: 36, GGMLType.TQ2_0: 37, GGMLType.MXFP4: 38,
}


def parse_mix(mix: "str | Sequence[tuple[str, object]]") -> Rules:
    """A preset name or a list of (regex, type) rules -> compiled rules."""
    if isinstance(mix, str):
        key = mix.strip().lower()
        if key not in PRESETS:
            raise FleError(f"unknown mix {mix!r}; presets: {', '.join(PRESETS)} (or a list of (regex, type) rules)")
        mix = PRESETS[key]
    rules: Rules = []
    for item in mix:
        try:
            pattern, qtype = item
        except (TypeError, ValueError):
            raise FleError(f"mix rule {item!r} is not a (regex, type) pair") from None
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise FleError(f"mix rule {pattern!r}: bad regular expression ({e})") from None
        rules.append((rx, parse_type(qtype)))
    return rules


def choose_type(name: str, shape: Sequence[int], rules: Rules) -> GGMLType:
    """The ggml type tensor ``name`` (ggml shape ``shape``) is stored as."""
    if len(shape) < 2:
        return GGMLType.F32
    for rx, qtype in rules:
        if rx.search(name):
            break
    else:
        return GGMLType.F32
    ne0 = int(shape[0])
    if fits(ne0, qtype):
        return qtype
    alt = _FALLBACK.get(qtype)
    if alt is not None and fits(ne0, alt):
        return alt
    return GGMLType.F32


def file_type(counts: dict[GGMLType, int]) -> int | None:
    """general.file_type for a model whose weights (element counts by type)
    are ``counts``: the llama_ftype of the type holding most elements among
    the matrices."""
    if not counts:
        return 0
    top = max(counts.items(), key=lambda kv: (kv[1], -int(kv[0])))[0]
    return _FTYPE.get(top)
