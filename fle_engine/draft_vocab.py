"""A draft vocabulary: the MTP head's output restricted to a list of tokens
(the most frequent ones of a corpus), so that drafting computes only those
rows of the output projection.

A draft can then only be a token of the list; the trunk still checks every
draft against its full distribution, so the tokens generated are the same as
without the list (greedy output identical to plain decoding), only the
share of accepted drafts can fall.

The list file, made once and reused: UTF-8 text, one token id per line,
most frequent first; ``#`` starts a comment (the file written here records
the corpus and the model in its first lines). A JSON file is read too: a
list of ids, or an object whose ``"tokens"`` is that list.

Make one from a text of the kind you will generate::

    python -m fle_engine.draft_vocab MODEL.gguf CORPUS.txt -n 32768 -o vocab.txt

then ``fle-engine generate MODEL.gguf --mtp --draft-vocab vocab.txt ...``;
or build it on the fly with ``--draft-vocab 32768 --draft-vocab-corpus
CORPUS.txt``.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from typing import Sequence

import numpy as np

from fle_quant.errors import FleError

__all__ = ["DraftVocab", "most_frequent", "from_corpus", "read_list", "write_list", "resolve", "main"]

_CHUNK = 1 << 20          # characters tokenised at a time (cut at a line end)


class DraftVocab:
    """Token ids ``ids`` (int64, no repeats) the MTP head may draft;
    ``source`` names where they came from (for messages)."""

    def __init__(self, ids: Sequence[int], source: str = "<list>"):
        arr = np.asarray(list(ids), dtype=np.int64)
        if arr.ndim != 1 or arr.size == 0:
            raise FleError(f"{source}: an empty draft vocabulary; give at least one token id")
        if np.unique(arr).size != arr.size:
            raise FleError(f"{source}: a token id appears twice in the draft vocabulary")
        self.ids = arr
        self.source = source
        self.total = self.coverage = None     # from_corpus: the corpus's tokens, the share the list covers
        self._view: tuple = (None, None)     # (head, the head with the restricted output)
        self._dev: dict = {}

    def __len__(self) -> int:
        return int(self.ids.size)

    def __repr__(self) -> str:
        return f"DraftVocab({len(self)} tokens from {self.source})"

    def check(self, n_vocab: int, label: str = "the model") -> None:
        """FleError when an id is beyond a vocabulary of ``n_vocab`` tokens."""
        bad = self.ids[(self.ids < 0) | (self.ids >= n_vocab)]
        if bad.size:
            raise FleError(f"{self.source}: token id {int(bad[0])} is beyond the vocabulary of {label} "
                           f"({n_vocab} tokens, ids 0..{n_vocab - 1}); make the list with this model's tokenizer "
                           f"(python -m fle_engine.draft_vocab)")

    def tensor(self, device):
        """The ids as a torch int64 tensor on ``device`` (kept)."""
        import torch

        key = str(device)
        if key not in self._dev:
            self._dev[key] = torch.as_tensor(self.ids, device=device)
        return self._dev[key]

    def head(self, head):
        """``head`` (an MTP head module, whose logits are
        ``F.linear(..., head.output)``) with ``output`` restricted to the
        list's rows: a shallow copy sharing every other weight, made once
        per head. Its logits' column j is token ``ids[j]``."""
        import copy

        import torch
        from torch import nn

        if self._view[0] is head:
            return self._view[1]
        out = head.output
        if len(self) > out.shape[0]:
            raise FleError(f"{self.source}: {len(self)} tokens, more than the MTP head outputs ({out.shape[0]})")
        self.check(out.shape[0], "the MTP head")
        with torch.no_grad():
            rows = out.detach().index_select(0, self.tensor(out.device)).contiguous()
        view = copy.copy(head)
        if "output" in head._parameters:
            view._parameters = dict(head._parameters)
            view._parameters["output"] = nn.Parameter(rows, requires_grad=False)
        elif "output" in head._buffers:
            view._buffers = dict(head._buffers)
            view._buffers["output"] = rows
        else:
            object.__setattr__(view, "output", rows)
        self._view = (head, view)
        return view


def _encode_all(tok, text: str):
    """Token ids of ``text``, tokenised a chunk (cut at a line end) at a time."""
    i = 0
    while i < len(text):
        j = min(len(text), i + _CHUNK)
        if j < len(text):
            cut = text.rfind("\n", i, j)
            j = cut + 1 if cut > i else j
        yield tok.encode(text[i:j], add_special=False, parse_special=True)
        i = j


def most_frequent(tok, text: str, n: int) -> tuple[list[int], int, int]:
    """(the ``n`` most frequent token ids of ``text`` tokenised with
    ``tok``, most frequent first, ties by id -- fewer when the text has
    fewer distinct tokens; the number of tokens counted; how many of them
    are in the list)."""
    counts: Counter = Counter()
    total = 0
    for ids in _encode_all(tok, text):
        counts.update(ids)
        total += len(ids)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return [t for t, _ in ranked[:n]], total, sum(c for _, c in ranked[:n])


def _check_n(n: int, n_vocab: int, what: str) -> None:
    if n < 1:
        raise FleError(f"{what} {n}: the draft vocabulary needs at least one token; give a positive number")
    if n > n_vocab:
        raise FleError(f"{what} {n} is more than the model's vocabulary ({n_vocab} tokens); give at most {n_vocab}")


def from_corpus(tok, corpus: "str | os.PathLike[str]", n: int, log=sys.stderr,
                prog: str = "fle-engine") -> DraftVocab:
    """The ``n`` most frequent tokens of the UTF-8 text file ``corpus``
    (a note on ``log`` when it has fewer distinct ones)."""
    from fle_quant.textio import read_text_file

    label = os.fspath(corpus)
    _check_n(n, tok.n_vocab, "--draft-vocab")
    text = read_text_file(corpus, "draft-vocabulary corpus (UTF-8 text)")
    ids, total, covered = most_frequent(tok, text, n)
    if not ids:
        raise FleError(f"{label}: no tokens in it; give a text of the kind you will generate")
    if len(ids) < n and log is not None:
        print(f"{prog}: note: {label} has only {len(ids)} distinct tokens ({total} in all); the draft "
              f"vocabulary holds those {len(ids)}, not {n}", file=log)
    vocab = DraftVocab(ids, label)
    vocab.total, vocab.coverage = total, covered / total
    return vocab


def _parse_text(raw: str, label: str) -> list[int]:
    ids = []
    for no, line in enumerate(raw.splitlines(), 1):
        s = line.split("#", 1)[0].strip()
        if not s:
            continue
        try:
            ids.append(int(s))
        except ValueError:
            raise FleError(f"{label}: line {no} is {line.strip()[:40]!r}, not a token id; a draft-vocabulary "
                           "file holds one token id per line (or JSON)") from None
    return ids


def read_list(path: "str | os.PathLike[str]", n_vocab: "int | None" = None) -> DraftVocab:
    """A draft-vocabulary file (one id per line, or JSON), its ids checked
    against a vocabulary of ``n_vocab`` tokens when given."""
    from fle_quant.textio import parse_json, read_bytes_file

    label = os.fspath(path)
    if not os.path.lexists(label):
        raise FleError(f"{label}: no such file; give a draft-vocabulary file (make one with python -m "
                       "fle_engine.draft_vocab MODEL CORPUS -n N -o FILE) or a number of tokens with "
                       "--draft-vocab-corpus")
    raw = read_bytes_file(path, "draft-vocabulary file")
    if raw.lstrip()[:1] in (b"[", b"{"):
        obj = parse_json(raw, label, "draft-vocabulary file")
        ids = obj.get("tokens") if isinstance(obj, dict) else obj
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise FleError(f"{label}: a JSON draft vocabulary is a list of token ids, or an object whose "
                           "\"tokens\" is one")
    else:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise FleError(f"{label}: not UTF-8 text (byte {e.start}); a draft-vocabulary file holds one token "
                           "id per line") from None
        ids = _parse_text(text, label)
    if not ids:
        raise FleError(f"{label}: no token ids in it; give a draft-vocabulary file with one id per line")
    seen: dict[int, int] = {}
    for i, t in enumerate(ids):
        if t in seen:
            raise FleError(f"{label}: token id {t} appears twice (entries {seen[t] + 1} and {i + 1}); "
                           "give each token once")
        seen[t] = i
    vocab = DraftVocab(ids, label)
    if n_vocab is not None:
        vocab.check(n_vocab)
    return vocab


def write_list(path: "str | os.PathLike[str]", vocab: DraftVocab, header: Sequence[str] = (),
               force: bool = False) -> None:
    """``vocab`` as a list file: ``header`` lines as comments, then one id a line."""
    from fle_quant.textio import write_text_atomic

    lines = [f"# {h}" for h in header] + [str(int(t)) for t in vocab.ids]
    write_text_atomic(path, "\n".join(lines) + "\n", force)


def resolve(spec: "str | None", corpus: "str | None", tok, log=sys.stderr) -> "DraftVocab | None":
    """What ``--draft-vocab SPEC [--draft-vocab-corpus CORPUS]`` asks for:
    SPEC a number N -> the N most frequent tokens of CORPUS; SPEC a file ->
    the list in it. None when neither is given."""
    if spec is None:
        if corpus is not None:
            raise FleError("--draft-vocab-corpus needs --draft-vocab N (the number of tokens to keep)")
        return None
    s = spec.strip()
    if s.lstrip("+-").isdigit():
        n = int(s)
        if corpus is None:
            _check_n(n, tok.n_vocab, "--draft-vocab")
            raise FleError(f"--draft-vocab {n} needs --draft-vocab-corpus FILE, a text whose most frequent "
                           f"{n} tokens make the list (or give --draft-vocab a list file)")
        return from_corpus(tok, corpus, n, log=log)
    if corpus is not None:
        raise FleError(f"--draft-vocab {spec} is a list file; --draft-vocab-corpus goes with a number of tokens "
                       "(--draft-vocab N) instead")
    return read_list(spec, tok.n_vocab)


def main(argv: "list[str] | None" = None) -> int:
    from fle_quant.cli.common import cli_entry
    from fle_quant.files import check_outputs, declare_inputs

    @cli_entry("fle_engine.draft_vocab")
    def run(argv):
        p = argparse.ArgumentParser(
            prog="python -m fle_engine.draft_vocab",
            description="Write the N most frequent tokens of a text, tokenised with a model's tokenizer, as a "
                        "draft-vocabulary file for fle-engine generate --mtp --draft-vocab FILE.")
        p.add_argument("model", help="GGUF model whose tokenizer counts the tokens (any shard)")
        p.add_argument("corpus", help="UTF-8 text of the kind the model will generate")
        p.add_argument("-n", "--tokens", type=int, default=32768, help="tokens to keep (default: 32768)")
        p.add_argument("-o", "--output", required=True, help="the list file to write")
        p.add_argument("-f", "--force", action="store_true", help="replace the output if it exists")
        args = p.parse_args(argv)
        from .tokenizer import Tokenizer

        declare_inputs(args.model, args.corpus)
        check_outputs([args.output], args.force)
        tok = Tokenizer.from_gguf(args.model)
        vocab = from_corpus(tok, args.corpus, args.tokens, prog="fle_engine.draft_vocab")
        write_list(args.output, vocab, [
            f"fle draft vocabulary: the {len(vocab)} most frequent tokens, most frequent first",
            f"corpus {os.path.basename(args.corpus)} ({vocab.total} tokens), tokenizer of "
            f"{os.path.basename(args.model)} ({tok.n_vocab} tokens)"], force=args.force)
        print(f"{args.output}: {len(vocab)} token ids, covering "
              f"{100 * vocab.coverage:.1f} % of the corpus's tokens", file=sys.stderr)
        return 0

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
