"""llama.cpp's KL-divergence base files and statistics, in NumPy.

``llama-perplexity --kl-divergence-base FILE`` (without ``--kl-divergence``)
cuts a text into chunks of ``n_ctx`` tokens, runs the base model on each
chunk and saves its log-probabilities over the whole vocabulary at every
scored position; ``llama-perplexity --kl-divergence --kl-divergence-base
FILE`` runs a candidate model on the same tokens and compares. This module
reads and writes that file byte for byte and computes the comparison with
llama.cpp's arithmetic (float32 wherever llama.cpp uses ``float``), so that
files from either tool work in the other and the printed numbers agree.

File layout, little-endian::

    char[8]  "_logits_"
    int32    n_ctx
    int32    n_vocab
    int32    n_chunk
    int32    tokens[n_chunk * n_ctx]   the text's tokens as tokenized (with the
                                       vocabulary's BOS first when it adds one)
    then, chunk after chunk, one record per scored position:
    float32  scale
    float32  min_log_prob
    uint16   q[n_vocab]                log p_i = scale * q_i + min_log_prob
    uint16   0                         only when n_vocab is odd

Only the second half of a chunk is scored: positions ``n_ctx // 2`` to
``n_ctx - 2``, each predicting the next token, ``n_ctx - 1 - n_ctx // 2``
records per chunk. Logits more than 16 below the top one are stored as
``q = 0`` and left out of the KL divergence. When the model's vocabulary adds
a BOS token, each chunk is evaluated with its first token replaced by BOS;
the file keeps the original tokens.

This module knows nothing about models; it takes logits as arrays
``[n_positions, n_vocab]`` and streams one chunk at a time.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np

from .errors import FleError
from .files import OutputSet, check_input, write_error

__all__ = [
    "MAGIC", "KldHeader", "BaseWriter", "KldStats", "KldSummary",
    "n_scored", "record_words", "encode_records", "decode_records",
    "read_header", "iter_chunks", "percentile", "format_summary",
    "CHUNK_TABLE_HEADER", "KLD_PERCENTILES", "DP_PERCENTILES",
]

MAGIC = b"_logits_"
_HEADER_BYTES = len(MAGIC) + 3 * 4
# rows of logits handled at once: bounds the float32 temporaries to a few
# rows times the vocabulary, whatever the chunk size
_ROW_BLOCK = 32
_F32 = np.float32

# (label, fraction) of llama.cpp's KLD and Δp percentile lines, in its order;
# fraction None is the median, 1 the maximum, 0 the minimum
KLD_PERCENTILES = (
    ("Maximum", 1.0), ("99.9%", 0.999), ("99.0%", 0.990), ("95.0%", 0.950), ("90.0%", 0.900),
    ("Median", None), ("10.0%", 0.100), (" 5.0%", 0.050), (" 1.0%", 0.010), (" 0.1%", 0.001), ("Minimum", 0.0),
)
DP_PERCENTILES = (
    ("Maximum", 1.0), ("99.9%", 0.999), ("99.0%", 0.990), ("95.0%", 0.950), ("90.0%", 0.900), ("75.0%", 0.750),
    ("Median", None), ("25.0%", 0.250), ("10.0%", 0.100), (" 5.0%", 0.050), (" 1.0%", 0.010), (" 0.1%", 0.001),
    ("Minimum", 0.0),
)
CHUNK_TABLE_HEADER = ("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
                      "              Δp RMS            Same top p")


def n_scored(n_ctx: int) -> int:
    """Scored positions per chunk: the second half, less the last token."""
    return n_ctx - 1 - n_ctx // 2


def record_words(n_vocab: int) -> int:
    """uint16 words per record: two float32 plus the vocabulary, padded to even."""
    return 2 * ((n_vocab + 1) // 2) + 4


# --- records ----------------------------------------------------------------

def _lse(x: np.ndarray, top: np.ndarray) -> np.ndarray:
    """log(sum(expf(x - top))) per row: the sum in double of float32
    exponentials, the log rounded to float32, as llama.cpp computes it."""
    e = np.exp(x - top[:, None])
    return np.log(e.sum(axis=1, dtype=np.float64)).astype(_F32)


def _nearest_int(v: np.ndarray) -> np.ndarray:
    # llama.cpp's rounding trick: adding 1.5 * 2^23 in float32 rounds to the
    # nearest integer (ties to even), read back from the mantissa bits
    bits = (v + _F32(12582912.0)).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def encode_records(logits: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One base-file record per row of ``logits`` ``[n, n_vocab]`` (float32),
    and each row's negative log-likelihood of its ``targets`` token, the
    way llama-perplexity computes both.

    Returns ``(records uint16 [n, record_words(n_vocab)], nll float64 [n])``."""
    x = np.ascontiguousarray(logits, dtype=_F32)
    if x.ndim != 2:
        raise FleError(f"logits must be [positions, n_vocab], got shape {list(x.shape)}")
    n, n_vocab = x.shape
    targets = np.asarray(targets, dtype=np.int64).reshape(-1)
    if targets.shape[0] != n:
        raise FleError(f"{n} rows of logits but {targets.shape[0]} target tokens")
    _check_finite(x)
    rec = np.zeros((n, record_words(n_vocab)), dtype=np.uint16)
    nll = np.empty(n, dtype=np.float64)
    for s in range(0, n, _ROW_BLOCK):
        xb = x[s:s + _ROW_BLOCK]
        rows = np.arange(xb.shape[0])
        top = xb.max(axis=1)
        low = np.maximum(xb.min(axis=1), top - _F32(16))
        lse = _lse(xb, top)
        min_log_prob = (low - top) - lse
        scale = (top - low) / _F32(65535)
        with np.errstate(divide="ignore"):
            inv = np.where(scale != 0, _F32(1) / scale, _F32(0)).astype(_F32)
        q = _nearest_int(inv[:, None] * (xb - low[:, None]))
        q = np.where((xb > low[:, None]) & (scale[:, None] != 0), q, 0)
        rec[s:s + len(xb), 4:4 + n_vocab] = q.astype(np.uint16)  # wraps like the C cast
        head = np.stack([scale, min_log_prob], axis=1).astype(_F32)
        rec[s:s + len(xb), :4] = head.view(np.uint16)
        nll[s:s + len(xb)] = (top + lse) - xb[rows, targets[s:s + len(xb)]]
    return rec, nll


def _check_finite(x: np.ndarray) -> None:
    if not np.isfinite(x).all():
        bad = int(np.argwhere(~np.isfinite(x))[0][0])
        raise FleError(f"the model's logits at scored position {bad} are not finite (NaN or inf); "
                       "the model or its weights are broken")


def decode_records(records: np.ndarray, n_vocab: int) -> np.ndarray:
    """Log-probabilities float32 ``[n, n_vocab]`` stored in ``records``
    (``scale * q + min_log_prob``, in float32 as llama.cpp evaluates it)."""
    scale, min_log_prob = _record_head(records)
    q = records[:, 4:4 + n_vocab].astype(_F32)
    return scale[:, None] * q + min_log_prob[:, None]


def _record_head(records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    head = np.ascontiguousarray(records[:, :4]).view(_F32)
    return head[:, 0], head[:, 1]


# --- files ------------------------------------------------------------------

@dataclass
class KldHeader:
    """What precedes the records: context, vocabulary, chunks and tokens
    (int32 ``[n_chunk, n_ctx]``)."""

    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray
    path: Path | None = None

    @property
    def first(self) -> int:
        """Position of the first scored logit in a chunk."""
        return self.n_ctx // 2

    @property
    def n_scored(self) -> int:
        return n_scored(self.n_ctx)

    @property
    def nv(self) -> int:
        return record_words(self.n_vocab)

    @property
    def chunk_bytes(self) -> int:
        return self.n_scored * self.nv * 2

    @property
    def data_offset(self) -> int:
        return _HEADER_BYTES + self.n_ctx * self.n_chunk * 4

    def targets(self, chunk: int) -> np.ndarray:
        """The tokens the scored positions of ``chunk`` predict."""
        return self.tokens[chunk, self.first + 1:].astype(np.int64)


def _check_geometry(n_ctx: int, n_vocab: int, n_chunk: int, where: str) -> None:
    if n_ctx < 3 or n_vocab < 1 or n_chunk < 1:
        raise FleError(f"{where}: n_ctx={n_ctx}, n_vocab={n_vocab}, n_chunk={n_chunk}; a KL-divergence file "
                       "needs n_ctx >= 3 and at least one chunk and one token")


def read_header(path: "str | os.PathLike[str]") -> KldHeader:
    """The header and tokens of a base file, checked against the file's size."""
    path = Path(path)
    size = check_input(path, "base file (from fle-kld base or llama-perplexity --kl-divergence-base)").st_size
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER_BYTES)
            if len(head) < len(MAGIC) or head[:len(MAGIC)] != MAGIC:
                raise FleError(f"{path}: does not start with {MAGIC.decode()!r}; not a llama-perplexity "
                               "--kl-divergence-base file")
            if len(head) < _HEADER_BYTES:
                raise FleError(f"{path}: the header is cut short; the file is truncated")
            n_ctx, n_vocab, n_chunk = (int(v) for v in np.frombuffer(head, dtype="<i4", offset=len(MAGIC)))
            _check_geometry(n_ctx, n_vocab, n_chunk, str(path))
            # the sizes first: a header claiming more than the file holds allocates nothing
            probe = KldHeader(n_ctx, n_vocab, n_chunk, np.zeros((0, n_ctx), np.int32), path)
            want = probe.data_offset + n_chunk * probe.chunk_bytes
            if size != want:
                raise FleError(f"{path}: {size} bytes, but n_ctx={n_ctx}, n_vocab={n_vocab} and n_chunk={n_chunk} "
                               f"make {want}; the file is truncated or not a base file")
            tokens = np.fromfile(f, dtype="<i4", count=n_ctx * n_chunk)
    except OSError as e:
        raise FleError(f"{path}: cannot read ({e.strerror}); pass an existing base file") from None
    hdr = KldHeader(n_ctx, n_vocab, n_chunk, tokens.astype(np.int32).reshape(-1, n_ctx), path)
    if tokens.size != n_ctx * n_chunk:
        raise FleError(f"{path}: {size} bytes, but n_ctx={n_ctx}, n_vocab={n_vocab} and n_chunk={n_chunk} "
                       f"make {want}; the file is truncated or not a base file")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= n_vocab):
        raise FleError(f"{path}: holds token ids outside 0..{n_vocab - 1}; the file is corrupt")
    return hdr


def iter_chunks(header: KldHeader) -> Iterator[np.ndarray]:
    """The records of each chunk in turn, uint16 ``[n_scored, nv]``; one
    chunk in memory at a time."""
    with open(header.path, "rb") as f:
        f.seek(header.data_offset)
        for c in range(header.n_chunk):
            data = np.fromfile(f, dtype="<u2", count=header.n_scored * header.nv)
            if data.size != header.n_scored * header.nv:
                raise FleError(f"{header.path}: chunk {c + 1} is cut short; the file is truncated")
            records = data.reshape(header.n_scored, header.nv)
            scale, min_log_prob = _record_head(records)
            if not (np.isfinite(scale).all() and np.isfinite(min_log_prob).all()):
                raise FleError(f"{header.path}: chunk {c + 1} holds log-probabilities that are not finite numbers "
                               "(NaN or infinity); the base file is corrupt, make it again")
            yield records


class BaseWriter:
    """Write a base file chunk by chunk: ``add_chunk(logits)`` with the
    base model's logits at each chunk's scored positions, then ``close()``.
    The file appears under its name only when every chunk is written; it
    also accumulates the base model's perplexity as llama-perplexity does.

    ``tokens``: int ``[n_chunk, n_ctx]`` (or flat), the text's tokens."""

    def __init__(self, path: "str | os.PathLike[str]", n_ctx: int, n_vocab: int, tokens: np.ndarray,
                 force: bool = False):
        self.path = Path(path)
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if n_ctx < 1 or toks.size % n_ctx:
            raise FleError(f"{toks.size} tokens do not make whole chunks of n_ctx={n_ctx}")
        n_chunk = toks.size // n_ctx
        _check_geometry(n_ctx, n_vocab, n_chunk, str(self.path))
        if toks.min() < 0 or toks.max() >= n_vocab:
            raise FleError(f"token ids must lie in 0..{n_vocab - 1}")
        self.header = KldHeader(n_ctx, n_vocab, n_chunk, toks.astype(np.int32).reshape(n_chunk, n_ctx), self.path)
        self.chunks_written = 0
        self.sum_nll = 0.0
        self.sum_nll2 = 0.0
        self.count = 0
        # the one output mechanism: checked, locked, written under a temporary name
        self._outs: OutputSet | None = OutputSet([[self.path]], force=force)
        self._outs.__enter__()
        self._f: BinaryIO | None = None
        try:
            self._f = self._outs.open(self.path, "wb")
            self._write(MAGIC)
            self._write(np.array([n_ctx, n_vocab, n_chunk], dtype="<i4").tobytes())
            self._write(self.header.tokens.astype("<i4").tobytes())
        except BaseException:
            self.abort()
            raise

    def _write(self, data: bytes) -> None:
        try:
            self._f.write(data)
        except OSError as e:
            raise write_error(self.path, e) from None

    def add_chunk(self, logits: np.ndarray) -> None:
        """Records for the next chunk from its logits ``[n_scored, n_vocab]``."""
        h = self.header
        if self._f is None:
            raise FleError(f"{self.path}: the writer is closed")
        if self.chunks_written >= h.n_chunk:
            raise FleError(f"{self.path}: all {h.n_chunk} chunks are written already")
        if tuple(np.shape(logits)) != (h.n_scored, h.n_vocab):
            raise FleError(f"chunk logits have shape {list(np.shape(logits))}; a chunk of n_ctx={h.n_ctx} "
                           f"needs [{h.n_scored}, {h.n_vocab}]")
        rec, nll = encode_records(logits, h.targets(self.chunks_written))
        if not np.isfinite(nll).all():
            raise FleError(f"{self.path}: chunk {self.chunks_written + 1}: the model's logits are not finite "
                           "(NaN or infinity); the model file is broken")
        self._write(rec.astype("<u2").tobytes())
        self.sum_nll += float(nll.sum())
        self.sum_nll2 += float((nll * nll).sum())
        self.count += nll.size
        self.chunks_written += 1

    @property
    def ppl(self) -> float:
        """Perplexity so far, exp(mean NLL)."""
        return math.exp(self.sum_nll / self.count) if self.count else float("nan")

    def ppl_estimate(self) -> tuple[float, float]:
        """llama-perplexity's final estimate: (PPL, its uncertainty)."""
        mean = self.sum_nll / self.count
        var = self.sum_nll2 / self.count - mean * mean
        ppl = math.exp(mean)
        return ppl, (math.sqrt(var / (self.count - 1)) * ppl if var > 0 and self.count > 1 else float("nan"))

    def close(self) -> Path:
        """Finish the file; FleError (and no file) unless every chunk was written."""
        if self._outs is None:
            return self.path
        if self.chunks_written != self.header.n_chunk:
            self.abort()
            raise FleError(f"{self.path}: {self.chunks_written} of {self.header.n_chunk} chunks were written; "
                           "no file was left behind")
        try:
            try:
                self._f.close()
            except OSError as e:
                raise write_error(self.path, e) from None
            self._f = None
            self._outs.commit()
        except BaseException:
            self.abort()
            raise
        outs, self._outs = self._outs, None
        outs.__exit__(None, None, None)
        return self.path

    def abort(self) -> None:
        """Drop the partial file."""
        if self._f is not None:
            try:
                self._f.close()
            except OSError:
                pass
            self._f = None
        if self._outs is not None:
            outs, self._outs = self._outs, None
            outs.__exit__(None, None, None)

    def __enter__(self) -> "BaseWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


# --- statistics -------------------------------------------------------------

def _mean_and_uncertainty(s: float, s2: float, count: int) -> tuple[float, float]:
    if count < 1:
        return 0.0, 0.0
    f = s / count
    df = s2 / count - f * f
    df = math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0
    return f, df


def _covariance(sa: float, sb: float, sab: float, count: int) -> float:
    if count < 10:
        return 0.0
    return (sab / count - (sa / count) * (sb / count)) / (count - 1)


def _div(a: float, b: float) -> float:
    with np.errstate(all="ignore"):
        return float(np.float64(a) / np.float64(b))


def _sqrt(x: float) -> float:
    with np.errstate(all="ignore"):
        return float(np.sqrt(np.float64(x)))


def percentile(sorted_values: np.ndarray, fraction: float | None) -> float:
    """llama.cpp's percentile of ascending float32 values: linear
    interpolation at ``fraction * (n - 1)``, computed in float32; None is its
    median (mean of the two middle values for even n)."""
    v = sorted_values
    n = v.size
    if fraction is None:
        return float(_F32(0.5) * (v[n // 2] + v[n // 2 - 1])) if n % 2 == 0 else float(v[n // 2])
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    p = _F32(fraction) * _F32(n - 1)
    ip = int(p)
    p = _F32(p - _F32(ip))
    return float((_F32(1) - p) * v[ip] + p * v[min(ip + 1, n - 1)])


@dataclass
class KldSummary:
    """The numbers ``llama-perplexity --kl-divergence`` prints at the end.
    ``kld_percentiles`` / ``dp_percentiles``: label -> value, in the order
    and with the labels of :data:`KLD_PERCENTILES` / :data:`DP_PERCENTILES`;
    Δp values are fractions (llama.cpp prints them in percent)."""

    count: int
    ppl: float
    ppl_unc: float
    ppl_base: float
    ppl_base_unc: float
    log_ppl_cor: float
    log_ppl_ratio: float
    log_ppl_ratio_unc: float
    ppl_ratio: float
    ppl_ratio_unc: float
    ppl_diff: float
    ppl_diff_unc: float
    kld_mean: float
    kld_unc: float
    kld_percentiles: dict[str, float]
    dp_mean: float
    dp_unc: float
    dp_percentiles: dict[str, float]
    rms_dp: float
    rms_dp_unc: float
    same_top: float
    same_top_unc: float
    max_abs_dp: float = field(default=0.0)


class KldStats:
    """Running comparison of a candidate model with a base file.

    ``add(logits, records, targets)`` takes one chunk: the candidate's
    logits at the scored positions ``[n_scored, n_vocab]``, the base file's
    records for the chunk and the tokens predicted. ``summary()`` gives the
    final numbers, ``chunk_line(i)`` llama.cpp's running line after chunk i.
    Memory: the running sums plus one float32 KLD and Δp per scored token."""

    def __init__(self, n_vocab: int):
        self.n_vocab = n_vocab
        self.sum_nll = self.sum_nll2 = 0.0
        self.sum_nll_base = self.sum_nll_base2 = self.sum_nll_nll_base = 0.0
        self.sum_kld = self.sum_kld2 = 0.0
        self.sum_p_diff = self.sum_p_diff2 = self.sum_p_diff4 = 0.0
        self.max_p_diff = 0.0
        self.n_same_top = 0
        self.count = 0
        self._kld: list[np.ndarray] = []
        self._p_diff: list[np.ndarray] = []

    def add(self, logits: np.ndarray, records: np.ndarray, targets: np.ndarray) -> None:
        x = np.ascontiguousarray(logits, dtype=_F32)
        n = x.shape[0]
        if x.ndim != 2 or x.shape[1] != self.n_vocab:
            raise FleError(f"candidate logits have shape {list(x.shape)}; the base file's vocabulary has "
                           f"{self.n_vocab} tokens")
        if records.shape != (n, record_words(self.n_vocab)):
            raise FleError(f"{n} rows of logits for {records.shape[0]} base records")
        _check_finite(x)
        targets = np.asarray(targets, dtype=np.int64).reshape(-1)
        for s in range(0, n, _ROW_BLOCK):
            self._add_block(x[s:s + _ROW_BLOCK], records[s:s + _ROW_BLOCK], targets[s:s + _ROW_BLOCK])

    def _add_block(self, x: np.ndarray, rec: np.ndarray, tok: np.ndarray) -> None:
        rows = np.arange(x.shape[0])
        top = x.max(axis=1)
        imax = x.argmax(axis=1)  # first maximum, as llama.cpp's strict '>' scan
        lse = _lse(x, top)
        nll = (top + lse) - x[rows, tok]
        scale, min_log_prob = _record_head(rec)
        log_p_base = scale[:, None] * rec[:, 4:4 + self.n_vocab].astype(_F32) + min_log_prob[:, None]
        nll_base = -log_p_base[rows, tok]
        norm = top + lse
        with np.errstate(over="ignore", invalid="ignore"):
            terms = np.exp(log_p_base) * ((log_p_base - x) + norm[:, None])
        kld = np.where(log_p_base > _F32(-16), terms, _F32(0)).sum(axis=1, dtype=np.float64)
        imax_base = log_p_base.argmax(axis=1)
        p_diff = np.exp(-nll) - np.exp(-nll_base)

        # llama.cpp squares in float (the operands are float) and sums in double
        self.sum_nll += float(nll.sum(dtype=np.float64))
        self.sum_nll2 += float((nll * nll).sum(dtype=np.float64))
        self.sum_nll_base += float(nll_base.sum(dtype=np.float64))
        self.sum_nll_base2 += float((nll_base * nll_base).sum(dtype=np.float64))
        self.sum_nll_nll_base += float((nll * nll_base).sum(dtype=np.float64))
        self.sum_kld += float(kld.sum())
        self.sum_kld2 += float((kld * kld).sum())
        p_diff2 = (p_diff * p_diff).astype(np.float64)
        self.sum_p_diff += float(p_diff.sum(dtype=np.float64))
        self.sum_p_diff2 += float(p_diff2.sum())
        self.sum_p_diff4 += float((p_diff2 * p_diff2).sum())
        self.max_p_diff = max(self.max_p_diff, float(np.abs(p_diff).max(initial=0)))
        self.n_same_top += int((imax == imax_base).sum())
        self.count += x.shape[0]
        self._kld.append(kld.astype(_F32))
        self._p_diff.append(p_diff.astype(_F32))

    # running numbers (the per-chunk table)
    def _ppl_parts(self):
        log_ppl = _mean_and_uncertainty(self.sum_nll, self.sum_nll2, self.count)
        log_ppl_base = _mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, self.count)
        cov = _covariance(self.sum_nll, self.sum_nll_base, self.sum_nll_nll_base, self.count)
        ratio = log_ppl[0] - log_ppl_base[0]
        ratio_unc = _sqrt(log_ppl[1] ** 2 + log_ppl_base[1] ** 2 - 2.0 * cov)
        return log_ppl, log_ppl_base, cov, ratio, ratio_unc

    def _rms_dp(self) -> tuple[float, float]:
        mse = _mean_and_uncertainty(self.sum_p_diff2, self.sum_p_diff4, self.count)
        rms = _sqrt(mse[0])
        return rms, _div(0.5, rms) * mse[1]

    def _same_top(self) -> tuple[float, float]:
        p = self.n_same_top / self.count
        return p, _sqrt(_div(p * (1 - p), self.count - 1))

    def chunk_line(self, chunk: int) -> str:
        """llama.cpp's running line after ``chunk`` (1-based)."""
        log_ppl, _, _, ratio, ratio_unc = self._ppl_parts()
        ppl = math.exp(log_ppl[0])
        kld = _mean_and_uncertainty(self.sum_kld, self.sum_kld2, self.count)
        rms, rms_unc = self._rms_dp()
        top, top_unc = self._same_top()
        return (f"{chunk:4d}    {ppl:9.4f} ± {ppl * log_ppl[1]:9.4f}    {ratio:10.5f} ± {ratio_unc:10.5f}"
                f"    {kld[0]:10.5f} ± {kld[1]:10.5f}    {100 * rms:6.3f} ± {100 * rms_unc:6.3f} %"
                f"    {100 * top:6.3f} ± {100 * top_unc:6.3f} %")

    def summary(self) -> KldSummary:
        if self.count == 0:
            raise FleError("no tokens were compared; the base file holds no scored positions")
        log_ppl, log_ppl_base, cov, ratio, ratio_unc = self._ppl_parts()
        ppl = math.exp(log_ppl[0])
        ppl_unc = ppl * log_ppl[1]
        ppl_base = math.exp(log_ppl_base[0])
        ppl_base_unc = ppl_base * log_ppl_base[1]
        ppl_ratio = math.exp(ratio)
        ppl_cov = ppl * ppl_base * cov
        kld = _mean_and_uncertainty(self.sum_kld, self.sum_kld2, self.count)
        dp = _mean_and_uncertainty(self.sum_p_diff, self.sum_p_diff2, self.count)
        klds = np.sort(np.concatenate(self._kld))
        dps = np.sort(np.concatenate(self._p_diff))
        rms, rms_unc = self._rms_dp()
        top, top_unc = self._same_top()
        return KldSummary(
            count=self.count,
            ppl=ppl, ppl_unc=ppl_unc, ppl_base=ppl_base, ppl_base_unc=ppl_base_unc,
            log_ppl_cor=_div(cov, log_ppl[1] * log_ppl_base[1]),
            log_ppl_ratio=ratio, log_ppl_ratio_unc=ratio_unc,
            ppl_ratio=ppl_ratio, ppl_ratio_unc=ppl_ratio * ratio_unc,
            ppl_diff=ppl - ppl_base, ppl_diff_unc=_sqrt(ppl_unc ** 2 + ppl_base_unc ** 2 - 2.0 * ppl_cov),
            kld_mean=kld[0], kld_unc=kld[1],
            kld_percentiles={label: percentile(klds, f) for label, f in KLD_PERCENTILES},
            dp_mean=dp[0], dp_unc=dp[1],
            dp_percentiles={label: percentile(dps, f) for label, f in DP_PERCENTILES},
            rms_dp=rms, rms_dp_unc=rms_unc, same_top=top, same_top_unc=top_unc,
            max_abs_dp=self.max_p_diff,
        )


def format_summary(s: KldSummary) -> str:
    """``s`` in the layout of llama-perplexity's closing statistics."""
    out = [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {s.ppl:10.6f} ± {s.ppl_unc:10.6f}",
        f"Mean PPL(base)                : {s.ppl_base:10.6f} ± {s.ppl_base_unc:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s.log_ppl_cor:6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {s.log_ppl_ratio:10.6f} ± {s.log_ppl_ratio_unc:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {s.ppl_ratio:10.6f} ± {s.ppl_ratio_unc:10.6f}",
        f"Mean PPL(Q)-PPL(base)         : {s.ppl_diff:10.6f} ± {s.ppl_diff_unc:10.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {s.kld_mean:10.6f} ± {s.kld_unc:10.6f}",
    ]
    for label, _ in KLD_PERCENTILES:
        out.append(f"{label:<7s} KLD: {s.kld_percentiles[label]:10.6f}")
    out += ["", "====== Token probability statistics ======",
            f"Mean    Δp: {100 * s.dp_mean:6.3f} ± {100 * s.dp_unc:5.3f} %"]
    for label, _ in DP_PERCENTILES:
        out.append(f"{label:<7s} Δp: {100 * s.dp_percentiles[label]:6.3f}%")
    out += [f"RMS Δp    : {100 * s.rms_dp:6.3f} ± {100 * s.rms_dp_unc:5.3f} %",
            f"Same top p: {100 * s.same_top:6.3f} ± {100 * s.same_top_unc:5.3f} %"]
    return "\n".join(out)
