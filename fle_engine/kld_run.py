"""FLE's forward pass driven the way llama-perplexity drives a model for
its KL-divergence runs, feeding :mod:`fle_quant.kld` (file format and
statistics).

llama-perplexity reads the text (``-f``) with one trailing newline dropped,
tokenizes it as a whole with the vocabulary's special tokens added (BOS
where the vocabulary asks for it) but special-token texts not parsed, needs
at least ``2 * n_ctx`` tokens, and cuts ``n_chunk = n_tokens // n_ctx``
chunks (fewer with ``--chunks``). Each chunk is evaluated from an empty
cache, with its first token replaced by BOS when the vocabulary adds one,
and the logits at positions ``n_ctx // 2 .. n_ctx - 2`` are scored.
"""
from __future__ import annotations

import os
from typing import Callable, Sequence

import numpy as np
import torch

from fle_quant import kld
from fle_quant.errors import FleError
from fle_quant.textio import read_text_file

from .loader import Model, load
from .tokenizer import Tokenizer

__all__ = ["read_text", "perplexity_tokens", "chunk_tokens", "scored_logits", "write_base", "compare_to_base"]

Log = Callable[[str], None]


def read_text(path: "str | os.PathLike[str]") -> str:
    """A text file as llama.cpp's ``-f`` reads it: raw bytes as UTF-8, one
    trailing newline removed."""
    text = read_text_file(path, "text file")
    return text[:-1] if text.endswith("\n") else text


def perplexity_tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    """``text`` tokenized as llama-perplexity tokenizes it."""
    if tokenizer.add_eos:
        raise FleError(f"{tokenizer.source}: the vocabulary appends EOS to every text "
                       "(tokenizer.ggml.add_eos_token); llama-perplexity refuses such models too")
    return tokenizer.encode(text, add_special=True, parse_special=False)


def chunk_tokens(tokens: Sequence[int], n_ctx: int, n_chunks: int | None = None) -> np.ndarray:
    """The chunks int32 ``[n_chunk, n_ctx]`` llama-perplexity evaluates."""
    if n_ctx < 4:
        raise FleError(f"context size {n_ctx} is too small; use -c 4 or more (llama.cpp uses 512 by default)")
    n = len(tokens)
    if n < 2 * n_ctx:
        raise FleError(f"the text tokenizes to {n} tokens; a context of {n_ctx} needs at least {2 * n_ctx} "
                       "(give a longer text or a smaller -c)")
    n_chunk = n // n_ctx
    if n_chunks is not None:
        if n_chunks < 1:
            raise FleError(f"--chunks must be at least 1, got {n_chunks}")
        n_chunk = min(n_chunk, n_chunks)
    return np.asarray(tokens[:n_chunk * n_ctx], dtype=np.int32).reshape(n_chunk, n_ctx)


def scored_logits(model: Model, chunk: np.ndarray, bos_id: int | None, n_batch: int = 512) -> np.ndarray:
    """Logits float32 ``[n_ctx - 1 - n_ctx // 2, n_vocab]`` at a chunk's
    scored positions, the chunk fed from an empty state in batches of
    ``n_batch`` tokens; ``bos_id``: replaces the first token when given."""
    n_ctx = int(chunk.shape[0])
    first = n_ctx // 2
    toks = [int(t) for t in chunk]
    if bos_id is not None:
        toks[0] = int(bos_id)
    state = model.new_state(n_ctx)
    kept = []
    for start in range(0, n_ctx, n_batch):
        out = model.forward(toks[start:start + n_batch], state)
        lo = max(first - start, 0)
        hi = min(n_ctx - 1 - start, out.shape[0])
        if hi > lo:
            kept.append(out[lo:hi].float().cpu().numpy())
        del out
    return np.concatenate(kept, axis=0)


def _open(model: "Model | str | os.PathLike[str]", device: str) -> tuple[Model, Tokenizer]:
    if not isinstance(model, Model):
        model = load(model, device=device)
    tok = Tokenizer.from_gguf(model.path)
    return model, tok


def write_base(model: "Model | str | os.PathLike[str]", text: str, out: "str | os.PathLike[str]", n_ctx: int,
               n_chunks: int | None = None, *, device: str = "cpu", n_batch: int = 512,
               log: Log | None = None, force: bool = False) -> kld.BaseWriter:
    """Run the base ``model`` over ``text`` and write a llama.cpp
    ``--kl-divergence-base`` file to ``out``; returns the (closed) writer,
    which holds the base perplexity."""
    model, tok = _open(model, device)
    if tok.n_vocab != model.n_vocab:
        raise FleError(f"{model.path}: the vocabulary has {tok.n_vocab} tokens but the output layer "
                       f"{model.n_vocab}; llama.cpp needs them equal")
    chunks = chunk_tokens(perplexity_tokens(tok, text), n_ctx, n_chunks)
    bos = tok.bos_id if tok.add_bos else None
    if log:
        log(f"computing base log-probabilities over {chunks.shape[0]} chunks, n_ctx={n_ctx}")
    with kld.BaseWriter(out, n_ctx, model.n_vocab, chunks, force=force) as w:
        for i, chunk in enumerate(chunks):
            w.add_chunk(scored_logits(model, chunk, bos, n_batch))
            if log:
                log(f"[{i + 1}]{w.ppl:.4f},")
    return w


def compare_to_base(model: "Model | str | os.PathLike[str]", base: "str | os.PathLike[str]", *,
                    device: str = "cpu", n_batch: int = 512, log: Log | None = None) -> kld.KldSummary:
    """Run the candidate ``model`` on a base file's tokens and compare, as
    ``llama-perplexity --kl-divergence`` does; ``log`` gets llama.cpp's
    per-chunk table."""
    header = kld.read_header(base)
    model, tok = _open(model, device)
    if header.n_vocab != model.n_vocab:
        raise FleError(f"{base}: the base model's vocabulary has {header.n_vocab} tokens, {model.path} has "
                       f"{model.n_vocab}; compare models that share a vocabulary")
    if tok.add_eos:
        raise FleError(f"{tok.source}: the vocabulary appends EOS to every text; llama-perplexity refuses such models")
    bos = tok.bos_id if tok.add_bos else None
    stats = kld.KldStats(header.n_vocab)
    if log:
        log(f"computing over {header.n_chunk} chunks, n_ctx={header.n_ctx}")
        log(kld.CHUNK_TABLE_HEADER)
    for i, records in enumerate(kld.iter_chunks(header)):
        logits = scored_logits(model, header.tokens[i], bos, n_batch)
        stats.add(logits, records, header.targets(i))
        if log:
            log(stats.chunk_line(i + 1))
    return stats.summary()


def set_threads(n: int | None) -> None:
    """Limit torch's CPU threads (None: leave torch's default)."""
    if n is not None:
        if n < 1:
            raise FleError(f"--threads must be at least 1, got {n}")
        torch.set_num_threads(n)
