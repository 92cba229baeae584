"""Tokenizer metadata for synthetic models.

Either a small byte-level BPE vocabulary built here (GPT-2 byte alphabet,
merges learned from a short built-in text, the three ChatML specials at the
end, as Qwen's vocabularies have them), or the ``tokenizer.*`` entries of an
existing GGUF (for example a vocab-only file from llama.cpp's ``models/``),
copied with their types. Either way ``n_vocab`` is the number of tokens, and
every model built on it has that many embedding and output rows.
"""
from __future__ import annotations

import functools
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..errors import FleError
from .common import ARR, BOOL, I32, KV, STR, U32

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_CORPUS = """
The model reads a file of tensors and writes another one. Each layer has a router,
a set of experts and a shared expert; the router picks the experts for every token.
Quantization stores the weights in small blocks with one scale per block, and the
engine reads only the experts it needs. Numbers such as 2048, 512, 10 and 4 are the
sizes of the layers, the experts and the heads. The attention keeps a cache of keys
and values; the linear attention keeps a state instead, which it updates with every
token. When the tokens repeat, the state remembers what came before, and the next
token becomes easier to predict. A good test checks the same thing in two different
ways and compares the results: the first way is simple and slow, the second is fast.
If they agree on many inputs, the fast one is probably right. This is the way we
build small models that behave like large ones: the same names, the same shapes,
the same metadata, only fewer layers, fewer experts and a smaller vocabulary.
"""

_PRETOKENIZE = re.compile(r"'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]


@dataclass(frozen=True)
class Vocab:
    kvs: tuple[KV, ...]
    n_vocab: int
    eos_id: int
    bos_id: int


@functools.lru_cache(maxsize=8)
def builtin_vocab(n_vocab: int = 512) -> Vocab:
    """A byte-level BPE vocabulary of exactly ``n_vocab`` tokens."""
    n_min = 256 + len(SPECIALS)
    if n_vocab < n_min:
        raise FleError(f"vocab_size must be at least {n_min} (256 byte tokens + {len(SPECIALS)} specials), got {n_vocab}")
    alphabet = _byte_alphabet()
    tokens = list(alphabet)
    known = set(tokens)
    words = Counter(
        tuple(alphabet[b] for b in w.encode("utf-8")) for w in _PRETOKENIZE.findall(_CORPUS)
    )
    merges: list[str] = []
    n_merges = n_vocab - n_min
    while len(merges) < n_merges:
        pairs: Counter = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        pairs = {pr: c for pr, c in pairs.items() if pr[0] + pr[1] not in known}
        if not pairs:
            break
        top = max(pairs.values())
        best = min(pr for pr, c in pairs.items() if c == top)  # ties: the smallest pair, for determinism
        a, b = best
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        known.add(a + b)
        merged: Counter = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += c
        words = merged
    # the corpus ran out of pairs: join further pairs of existing tokens in a
    # fixed order, so any size works and every merge stays valid
    i = 0
    while len(merges) < n_merges:
        a, b = tokens[256 + i % max(1, len(tokens) - 256)], alphabet[33 + (i * 7) % 94]
        i += 1
        if a + b in known:
            continue
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        known.add(a + b)
    token_type = [1] * len(tokens) + [3] * len(SPECIALS)  # 1 normal, 3 control
    tokens += list(SPECIALS)
    eos = tokens.index("<|endoftext|>")
    kvs = (
        KV("tokenizer.ggml.model", STR, "gpt2"),
        KV("tokenizer.ggml.pre", STR, "qwen2"),
        KV("tokenizer.ggml.tokens", ARR, tokens, STR),
        KV("tokenizer.ggml.token_type", ARR, token_type, I32),
        KV("tokenizer.ggml.merges", ARR, merges, STR),
        KV("tokenizer.ggml.eos_token_id", U32, eos),
        KV("tokenizer.ggml.padding_token_id", U32, eos),
        KV("tokenizer.ggml.bos_token_id", U32, eos),
        KV("tokenizer.ggml.add_bos_token", BOOL, False),
        KV("tokenizer.chat_template", STR, CHAT_TEMPLATE),
    )
    return Vocab(kvs, len(tokens), eos, eos)


def vocab_from_gguf(path) -> Vocab:
    """The ``tokenizer.*`` entries of GGUF file ``path``, types preserved."""
    from ..files import check_input
    from ..gguf_reader import GGUFModel

    path = Path(path)
    check_input(path, "vocabulary GGUF (with tokenizer.* metadata)")
    with GGUFModel.open(path) as model:
        kvs = []
        for key, value in model.metadata.items():
            if not key.startswith("tokenizer."):
                continue
            vtype, item_type = model.metadata_types[key]
            kvs.append(KV(key, vtype.name.lower(), value, item_type.name.lower() if item_type is not None else None))
    ids = {kv.key: kv.value for kv in kvs}
    tokens = ids.get("tokenizer.ggml.tokens")
    if not tokens:
        raise FleError(f"{path} has no tokenizer.ggml.tokens; pass a GGUF that carries a vocabulary")
    eos = int(ids.get("tokenizer.ggml.eos_token_id", len(tokens) - 1))
    bos = int(ids.get("tokenizer.ggml.bos_token_id", eos))
    return Vocab(tuple(kvs), len(tokens), eos, bos)
