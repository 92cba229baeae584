"""Text <-> token ids for the models FLE runs, built from a GGUF's
``tokenizer.ggml.*`` metadata alone, tokenizing exactly as llama.cpp does.

Supported: byte-level BPE vocabularies (``tokenizer.ggml.model = "gpt2"``)
with the pre-tokenizers of the Qwen families (``tokenizer.ggml.pre`` =
``qwen2`` and its aliases, ``qwen35``). The BPE merges run in HF's
``tokenizers`` library; this module adds what llama.cpp does around them:

* special tokens are cut out of the text before BPE, longest text first, each
  one everywhere it occurs. User-defined tokens (token type 4) are always cut
  out; control and unknown tokens (types 3 and 2) only with
  ``parse_special=True``, otherwise their text is tokenized as plain text;
* tokens whose text llama.cpp recognises as end-of-turn or fill-in-the-middle
  markers (``<|im_end|>``, ``<|fim_pad|>``, ...) count as control tokens
  whatever their stored type, and make up :attr:`Tokenizer.eog_ids` with the
  end-of-sequence token;
* decoding maps byte-level token text back to bytes; control tokens decode to
  nothing unless ``special=True``, user-defined tokens to their raw text.

There is no Unicode normalization (llama.cpp applies none to these
vocabularies, although Qwen's ``tokenizer.json`` asks for NFC).

This module knows nothing about models, chat templates or torch.
"""
from __future__ import annotations

import codecs
import functools
import os
from itertools import accumulate
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models as _hf_models
from tokenizers import pre_tokenizers as _hf_pre

from fle_quant.errors import FleError
from fle_quant.files import check_input
from fle_quant.gguf_reader import GGUFModel

__all__ = ["Tokenizer", "StreamDecoder", "TokenType"]


class TokenType:
    """Values of ``tokenizer.ggml.token_type`` (llama.cpp's ``llama_token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Qwen2's split regex with the case-insensitive contractions written out, as
# llama.cpp writes it: a Unicode case-insensitive ``(?i:'s)`` would also match
# "'ſ" (long s), which llama.cpp does not.
_QWEN2_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5: letter runs also take combining marks (\p{M})
_QWEN35_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regex; only names for which llama.cpp also turns
# off its clean-up of spaces before punctuation when decoding
PRE_TOKENIZERS = {
    "qwen2": _QWEN2_REGEX,
    "deepseek-r1-qwen": _QWEN2_REGEX,
    "kormo": _QWEN2_REGEX,
    "f2llmv2": _QWEN2_REGEX,
    "qwen35": _QWEN35_REGEX,
}

# token texts llama.cpp treats as control tokens ending a turn (llama-vocab.cpp,
# the end-of-generation list), and the fill-in-the-middle markers it detects by
# text and also counts as end of generation
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
)
# end-of-turn candidates in llama.cpp's order, used when tokenizer.ggml.eot_token_id is absent
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {  # metadata key suffix -> texts
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# llama.cpp's default bos/eos for gpt2-model vocabularies without those keys
_GPT2_DEFAULT_BOS_EOS = 11


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte value's printable stand-in."""
    keep = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


_B2U = _byte_to_unicode()
# stand-in code point -> byte; also a str.translate table mapping each stand-in
# to the code point equal to its byte, so that .encode("latin-1") yields the bytes
_U2B = {ord(u): b for b, u in _B2U.items()}


def _byte_decode(text: str) -> bytes:
    """One normal token's text -> its bytes. A character outside the byte
    alphabet becomes ``[UNK_BYTE_0x..<text>]`` as llama.cpp renders it."""
    out = bytearray()
    for ch in text:
        b = _U2B.get(ord(ch))
        if b is not None:
            out.append(b)
        else:
            out += ("[UNK_BYTE_0x" + ch.encode("utf-8").hex() + text + "]").encode("utf-8")
    return bytes(out)


class Tokenizer:
    """A GGUF vocabulary, tokenizing and detokenizing as llama.cpp does.

    Build it with :meth:`from_gguf`. Attributes: ``n_vocab``, ``bos_id``,
    ``eos_id``, ``eot_id``, ``pad_id`` (None where the vocabulary has none),
    ``eog_ids`` (every id that ends generation), ``add_bos`` / ``add_eos``
    (what ``encode(add_special=True)`` adds), ``tokens`` (token texts as
    stored), ``token_types`` (effective :class:`TokenType` per id, after
    llama.cpp's promotion of control-looking tokens), ``chat_template``
    (``tokenizer.chat_template`` or None), ``pre`` (pre-tokenizer name).
    """

    def __init__(self, metadata: dict, source: str = "<metadata>"):
        self.source = source
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise FleError(
                f"{source}: tokenizer.ggml.model is {model!r}; only byte-level BPE vocabularies ('gpt2') are "
                "supported, use a model converted from a Qwen-family checkpoint"
            )
        pre = metadata.get("tokenizer.ggml.pre")
        if pre not in PRE_TOKENIZERS:
            raise FleError(
                f"{source}: tokenizer.ggml.pre is {pre!r}; supported pre-tokenizers: "
                f"{', '.join(sorted(PRE_TOKENIZERS))}"
            )
        self.pre: str = pre
        tokens = metadata.get("tokenizer.ggml.tokens")
        merges = metadata.get("tokenizer.ggml.merges")
        if not isinstance(tokens, list) or not tokens:
            raise FleError(f"{source}: tokenizer.ggml.tokens is missing or empty; the file carries no vocabulary")
        if not isinstance(merges, list):
            raise FleError(f"{source}: tokenizer.ggml.merges is missing; a BPE vocabulary needs its merges")
        n = len(tokens)
        types = metadata.get("tokenizer.ggml.token_type")
        if types is None:
            types = [TokenType.NORMAL] * n
        elif len(types) < n:
            raise FleError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        else:
            types = list(types[:n])
        # llama.cpp renames empty token texts so that every text is unique
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != n:
            raise FleError(f"{source}: tokenizer.ggml.tokens holds duplicate texts; the vocabulary is corrupt")
        self.tokens: list[str] = tokens
        self.n_vocab: int = n

        def token_id(key: str, default: int | None) -> int | None:
            v = metadata.get(f"tokenizer.ggml.{key}_token_id")
            if v is None or not 0 <= int(v) < n:
                return default if default is not None and 0 <= default < n else None
            return int(v)

        self.bos_id = token_id("bos", _GPT2_DEFAULT_BOS_EOS)
        self.eos_id = token_id("eos", _GPT2_DEFAULT_BOS_EOS)
        self.pad_id = token_id("padding", None)
        self.add_bos: bool = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        self.add_eos: bool = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        if self.add_bos and self.bos_id is None:
            raise FleError(f"{source}: tokenizer.ggml.add_bos_token is true but there is no valid bos_token_id")
        if self.add_eos and self.eos_id is None:
            raise FleError(f"{source}: tokenizer.ggml.add_eos_token is true but there is no valid eos_token_id")
        template = metadata.get("tokenizer.chat_template")
        self.chat_template: str | None = template if isinstance(template, str) else None

        # control-looking tokens become control tokens whatever their stored type
        control = {i for i, t in enumerate(types) if t == TokenType.CONTROL}

        def detect(key: str, texts: Sequence[str]) -> int | None:
            tid = token_id(key, None)
            if tid is None:
                tid = next((vocab[t] for t in texts if t in vocab), None)
                if tid is not None:
                    control.add(tid)
            return tid

        self.eot_id = detect("eot", _EOT_TEXTS)
        eom_id = detect("eom", _EOM_TEXTS)
        fim = {k: detect(k, texts) for k, texts in _FIM_TEXTS.items()}
        eog = {fim[k] for k in ("fim_pad", "fim_rep", "fim_sep")}
        for t in _EOG_TEXTS:
            if t in vocab:
                eog.add(vocab[t])
                control.add(vocab[t])
        eog |= {self.eos_id, self.eot_id, eom_id}
        eog.discard(None)
        self.eog_ids: frozenset[int] = frozenset(eog)
        for i in control:
            # llama.cpp ORs a control bit into the stored attributes; that bit
            # alone decides matching (only with parse_special) and rendering
            # (only with special), so CONTROL describes the token fully
            types[i] = TokenType.CONTROL
        self.token_types: list[int] = types

        # special tokens cut out of the text before BPE, longest first (llama.cpp's order)
        specials = [i for i, t in enumerate(types) if t in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)]
        specials.sort(key=lambda i: (-len(tokens[i].encode("utf-8")), i))
        self._specials_all = [(tokens[i], i) for i in specials]
        self._specials_user = [(tokens[i], i) for i in specials if types[i] == TokenType.USER_DEFINED]

        self._hf = self._build_bpe(vocab, merges, PRE_TOKENIZERS[pre])

    # construction ----------------------------------------------------------
    @classmethod
    def from_gguf(cls, model_or_path: "GGUFModel | str | os.PathLike[str]") -> "Tokenizer":
        """The tokenizer of a GGUF model (an open :class:`GGUFModel`, or the
        path of any of its shards)."""
        if isinstance(model_or_path, GGUFModel):
            return cls(model_or_path.metadata, str(model_or_path.paths[0]))
        path = Path(model_or_path)
        check_input(path, "GGUF model or llama.cpp vocab-only GGUF")
        with GGUFModel.open(path) as model:
            return cls(model.metadata, str(path))

    def _build_bpe(self, vocab: dict[str, int], merges: list[str], regex: str) -> _HFTokenizer:
        # llama.cpp splits each merge at the first space after its first character
        cuts = [m.find(" ", 1) for m in merges]
        if cuts and min(cuts) < 0:
            bad = merges[cuts.index(min(cuts))]
            raise FleError(f"{self.source}: tokenizer.ggml.merges entry {bad!r} is not two tokens separated by a space")
        pairs = [(m[:c], m[c + 1:]) for m, c in zip(merges, cuts)]
        try:
            bpe = _hf_models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False, ignore_merges=False)
        except Exception as e:  # the library reports merges of unknown tokens as plain Exceptions
            raise FleError(f"{self.source}: tokenizer.ggml.merges does not fit tokenizer.ggml.tokens ({e})") from None
        hf = _HFTokenizer(bpe)
        hf.pre_tokenizer = _hf_pre.Sequence([
            _hf_pre.Split(Regex(regex), behavior="isolated", invert=False),
            _hf_pre.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        return hf

    @functools.cached_property
    def _piece_tables(self) -> tuple[list[bytes], list[bytes]]:
        """Each token's bytes as llama.cpp's ``token_to_piece`` renders it, with
        control tokens shown (first list) and hidden (second list). Built on
        first use: a fifth of the loading time, and not needed to encode."""
        tokens, types = self.tokens, self.token_types
        normal = [i for i, t in enumerate(types) if t in (TokenType.NORMAL, TokenType.BYTE)]
        texts = [tokens[i] for i in normal]
        joined = "".join(texts)
        pieces: list[bytes] = [b""] * self.n_vocab
        if all(ord(c) in _U2B for c in set(joined)):
            # every character stands for one byte: translate all texts at once and slice
            raw = joined.translate(_U2B).encode("latin-1")
            ends = list(accumulate(map(len, texts)))
            sliced = [raw[s:e] for s, e in zip([0] + ends[:-1], ends)]
            if normal and normal[-1] == len(normal) - 1:  # the usual layout: normal tokens first
                pieces[:len(sliced)] = sliced
            else:
                for i, p in zip(normal, sliced):
                    pieces[i] = p
        else:
            for i, t in zip(normal, texts):
                pieces[i] = _byte_decode(t)
        plain = list(pieces)
        for i, t in enumerate(types):
            if t in (TokenType.CONTROL, TokenType.UNKNOWN):
                pieces[i] = tokens[i].encode("utf-8")
            elif t == TokenType.USER_DEFINED:
                pieces[i] = plain[i] = tokens[i].encode("utf-8")
            # UNUSED and UNDEFINED tokens render as nothing
        return pieces, plain

    # encoding --------------------------------------------------------------
    def split_special(self, text: str, parse_special: bool = False) -> list["str | int"]:
        """``text`` cut into plain-text pieces (str) and special token ids (int),
        the way llama.cpp partitions it before BPE."""
        frags: list[str | int] = [text]
        specials = self._specials_all if parse_special else self._specials_user
        for special, tid in specials:
            if special not in text:  # cheap pre-check on the whole text
                continue
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or special not in f:
                    out.append(f)
                    continue
                for j, part in enumerate(f.split(special)):
                    if j:
                        out.append(tid)
                    if part:
                        out.append(part)
            frags = out
        return frags

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``. ``add_special``: add BOS/EOS where the
        vocabulary asks for them (``add_bos`` / ``add_eos``). ``parse_special``:
        turn control-token texts such as ``<|im_start|>`` into their ids
        (user-defined tokens are always matched)."""
        if not isinstance(text, str):
            raise FleError(f"Tokenizer.encode takes a str, got {type(text).__name__}")
        ids: list[int] = []
        if add_special and self.add_bos:
            ids.append(self.bos_id)
        hf = self._hf
        for frag in self.split_special(text, parse_special) if text else ():
            if isinstance(frag, int):
                ids.append(frag)
                continue
            try:
                ids.extend(hf.encode(frag, add_special_tokens=False).ids)
            except Exception as e:  # e.g. a lone surrogate, which is not UTF-8
                raise FleError(f"cannot tokenize text: {e}; pass valid Unicode text") from None
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    # decoding --------------------------------------------------------------
    def _pieces(self, special: bool) -> list[bytes]:
        return self._piece_tables[0 if special else 1]

    def _check_ids(self, ids: Iterable[int]) -> None:
        """Raise FleError for the first id in ``ids`` that is not a valid token id."""
        n = self.n_vocab
        for i in ids:
            if not isinstance(i, int) and not hasattr(i, "__index__"):
                raise FleError(f"token ids must be integers, got {i!r}")
            if not 0 <= i < n:
                raise FleError(f"token id {i} is out of range for a vocabulary of {n} tokens")

    def decode_token(self, token_id: int, special: bool = False) -> bytes:
        """One token's bytes; may be part of a UTF-8 character (use
        :class:`StreamDecoder` to turn a token stream into text)."""
        if not 0 <= token_id < self.n_vocab:
            self._check_ids([token_id])
        return self._pieces(special)[token_id]

    def decode_bytes(self, ids: Sequence[int], special: bool = False) -> bytes:
        """The bytes of ``ids`` joined (llama.cpp's ``detokenize``)."""
        pieces = self._pieces(special)
        try:
            if any(i < 0 for i in ids):
                raise IndexError
            return b"".join([pieces[i] for i in ids])
        except (IndexError, TypeError):
            self._check_ids(ids)
            raise  # not reached for bad ids; anything else is a bug worth a traceback

    def decode(self, ids: Sequence[int], special: bool = False) -> str:
        """Text of ``ids``. Control tokens render only with ``special=True``;
        bytes that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids, special).decode("utf-8", errors="replace")

    def stream(self, special: bool = False) -> "StreamDecoder":
        """An incremental detokenizer for generated tokens."""
        return StreamDecoder(self, special)

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    def token_text(self, token_id: int) -> str:
        """A token's text as stored in the vocabulary (byte-level for normal tokens)."""
        if not 0 <= token_id < self.n_vocab:
            self._check_ids([token_id])
        return self.tokens[token_id]

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, n_vocab={self.n_vocab}, pre={self.pre!r})"


class StreamDecoder:
    """Turns a stream of token ids into text, holding back the bytes of a
    UTF-8 character split across tokens until its last byte arrives.

    ``add(id)`` returns the text completed by that token (possibly ""),
    ``flush()`` what is left at the end (an incomplete character becomes
    U+FFFD). The concatenated results equal ``Tokenizer.decode`` of all ids.
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False):
        self._tokenizer = tokenizer
        self._pieces = tokenizer._pieces(special)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        if not 0 <= token_id < len(self._pieces):
            self._tokenizer._check_ids([token_id])
        return self._utf8.decode(self._pieces[token_id])

    def flush(self) -> str:
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out
