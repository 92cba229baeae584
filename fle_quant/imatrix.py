"""Importance matrices (imatrix files) as llama.cpp writes and reads them.

``llama-imatrix`` records, for each weight matrix a model multiplies, the
sum of squared input activations per input column (per expert for stacked
``*_exps`` tensors, which ``MUL_MAT_ID`` multiplies). ``llama-quantize
--imatrix FILE`` divides those sums by their counts and hands each tensor's
vector to ggml's quantizers as per-column weights. This module reads such a
file the way ``common/imatrix-loader.cpp`` and ``tools/quantize`` do, so that
``fle-requant --imatrix FILE`` quantizes each tensor exactly as
``llama-quantize`` would.

Two formats exist, told apart by their first four bytes:

- GGUF (``b"GGUF"``, the default of ``llama-imatrix`` today): per matrix
  ``NAME.in_sum2`` (F32, shape ``[n_per_row, n_mat]``: raw sums) and
  ``NAME.counts`` (F32, shape ``[1, n_mat]``: activation rows seen), where
  ``n_mat`` is the number of experts of a stacked expert tensor, else 1;
  metadata ``imatrix.datasets`` (array of strings), ``imatrix.chunk_count``
  and ``imatrix.chunk_size`` (u32), all three required by llama-quantize.
  Importance = sums / count of its expert; an expert never routed to
  (count 0) gets 1 everywhere.
- legacy ``.dat`` (``--output-format dat``): int32 entry count; per entry an
  int32 name length, the name, int32 ``ncall``, int32 value count and that
  many float32 values, already normalised to ``mean * ncall``; then,
  optionally, int32 chunk count, int32 length and the dataset name.
  Importance = values / ncall (the values as stored when ``ncall <= 0``).

Every value is float32 and every division is a float32 division, as in
llama.cpp, so the vectors are bit-identical to the ones llama-quantize
passes to ggml.

How llama-quantize applies them (``src/llama-quant.cpp``): a tensor of
shape ``[ne0, ne1, ne2]`` needs an entry of exactly ``ne0 * ne2`` values;
row ``r`` (counted over all experts) uses the ``ne0`` values of expert
``r // ne1``. A tensor without an entry is quantized without an importance
matrix unless its target type needs one; an entry of another size is an
error, except for the token embeddings (quantized without one). Any
non-finite importance aborts the run.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Sequence

import numpy as np

from .errors import FleError
from .files import check_input
from .ggml_types import GGMLType
from .gguf_format import GGUF_MAGIC, GGUFValueType

__all__ = [
    "Imatrix",
    "load_imatrix",
    "requires_imatrix",
    "TYPES_REQUIRING_IMATRIX",
    "KEY_IMATRIX_FILE",
    "KEY_IMATRIX_DATASET",
    "KEY_IMATRIX_N_ENTRIES",
    "KEY_IMATRIX_N_CHUNKS",
    "KEY_IMATRIX_SHA256",
    "IMATRIX_KEY_PREFIX",
]

# what llama-imatrix writes into a GGUF imatrix (common/imatrix-loader.h)
KEY_DATASETS = "imatrix.datasets"
KEY_CHUNK_COUNT = "imatrix.chunk_count"
KEY_CHUNK_SIZE = "imatrix.chunk_size"
SUFFIX_SUMS = ".in_sum2"
SUFFIX_COUNTS = ".counts"

# what llama-quantize records in the quantized model (tools/quantize/quantize.cpp)
IMATRIX_KEY_PREFIX = "quantize.imatrix."
KEY_IMATRIX_FILE = "quantize.imatrix.file"
KEY_IMATRIX_DATASET = "quantize.imatrix.dataset"
KEY_IMATRIX_N_ENTRIES = "quantize.imatrix.entries_count"
KEY_IMATRIX_N_CHUNKS = "quantize.imatrix.chunks_count"
# FLE's addition: which bytes the importance came from, whatever the file is called
KEY_IMATRIX_SHA256 = "fle.requant.imatrix_sha256"
# llama-quantize copies the strings into 128-byte buffers (127 bytes and a NUL)
_KV_STRING_BYTES = 127

# target types llama-quantize refuses to produce without an importance matrix
# (tensor_requires_imatrix; Q2_K only inside a Q2_K_S mixture, which a
# single-type requantization never is)
TYPES_REQUIRING_IMATRIX = frozenset({
    GGMLType.IQ3_XXS, GGMLType.IQ2_XXS, GGMLType.IQ2_XS, GGMLType.IQ2_S, GGMLType.IQ1_M, GGMLType.IQ1_S,
})
# tensors exempt from that rule, and whose entry may have another size
_TOKEN_EMBD = ("token_embd.weight", "per_layer_token_embd.weight")
_OUTPUT = "output.weight"


def requires_imatrix(tensor_name: str, qtype: GGMLType) -> bool:
    """Whether llama-quantize refuses to quantize ``tensor_name`` to ``qtype``
    without an importance vector for it."""
    if tensor_name in _TOKEN_EMBD or tensor_name == _OUTPUT:
        return False
    return qtype in TYPES_REQUIRING_IMATRIX


@dataclass
class Imatrix:
    """An importance matrix file, loaded.

    ``entries`` maps a weight's name to its importance, float32
    ``[n_mat, n]``: for GGUF files one row per count (per expert of a stacked
    expert tensor, else one row); legacy files do not record the split, so
    their entries are one row of all values until :meth:`for_tensor` reshapes
    them against a tensor."""

    source: str  # the path as given (llama-quantize records it so)
    format: str  # "gguf" or "legacy"
    entries: dict[str, np.ndarray]
    datasets: tuple[str, ...] = ()
    chunk_count: int = 0
    chunk_size: int = 0
    sha256: str = ""

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def for_tensor(self, name: str, shape: Sequence[int]) -> np.ndarray | None:
        """The importance rows llama-quantize uses for tensor ``name`` of ggml
        shape ``shape``: float32 ``[ne2, ne0]`` (row ``r`` of the tensor uses
        row ``r // ne1``), or None when the file has no entry for it (and for
        the token embeddings when their entry has another size, which
        llama-quantize skips). Any other size mismatch is a FleError naming
        the file and the tensor."""
        e = self.entries.get(name)
        if e is None:
            return None
        shape = tuple(int(d) for d in shape) or (1,)
        ne0 = shape[0]
        ne2 = shape[2] if len(shape) > 2 else 1
        if len(shape) > 3 and any(d != 1 for d in shape[3:]):
            # llama-quantize indexes the importance by ne2 only; a fourth
            # dimension would read past the entry
            raise FleError(f"{self.source}: tensor {name!r} has shape {list(shape)}; an importance matrix applies "
                           "to tensors of at most 3 dimensions")
        if e.size != ne0 * ne2:
            if name in _TOKEN_EMBD:
                return None
            need = f"{ne0}" if ne2 == 1 else f"{ne0} x {ne2} experts = {ne0 * ne2}"
            raise FleError(f"{self.source}: the entry for tensor {name!r} has {e.size} values, but the tensor "
                           f"(shape {list(shape)}) needs {need}; the importance matrix was computed on another model")
        return e.reshape(ne2, ne0)

    def metadata(self) -> list[tuple[str, Any, GGUFValueType]]:
        """The keys llama-quantize writes into a model quantized with this
        file (``quantize.imatrix.*``, same names, types and 127-byte string
        limit), and the file's SHA-256 under :data:`KEY_IMATRIX_SHA256`."""
        kvs: list[tuple[str, Any, GGUFValueType]] = [
            (KEY_IMATRIX_FILE, _kv_string(self.source), GGUFValueType.STRING)]
        if self.datasets:
            kvs.append((KEY_IMATRIX_DATASET, _kv_string(self.datasets[0]), GGUFValueType.STRING))
        kvs.append((KEY_IMATRIX_N_ENTRIES, len(self.entries), GGUFValueType.UINT32))
        if self.chunk_count > 0:
            kvs.append((KEY_IMATRIX_N_CHUNKS, self.chunk_count, GGUFValueType.UINT32))
        kvs.append((KEY_IMATRIX_SHA256, self.sha256, GGUFValueType.STRING))
        return kvs


def _kv_string(s: str) -> str:
    b = s.encode("utf-8")
    if len(b) <= _KV_STRING_BYTES:
        return s
    # llama-quantize cuts at 127 bytes; a character cut in two is dropped so
    # that the value stays valid UTF-8
    return b[:_KV_STRING_BYTES].decode("utf-8", errors="ignore")


def load_imatrix(path: "str | os.PathLike[str]") -> Imatrix:
    """Read an importance matrix file in either format (told by its magic)
    and return the averaged importance of every entry; a FleError naming the
    file for anything llama-quantize would refuse or a truncated or
    malformed file."""
    source = os.fspath(path)
    p = Path(path)
    check_input(p, "imatrix file")
    try:
        f = open(p, "rb")
    except FileNotFoundError:
        raise FleError(f"{source}: no such imatrix file") from None
    except IsADirectoryError:
        raise FleError(f"{source}: is a directory, expected an imatrix file") from None
    except PermissionError:
        raise FleError(f"{source}: permission denied") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(4)
        if len(head) < 4:
            raise FleError(f"{source}: {size} bytes, too short for an imatrix file")
        f.seek(0)
        if struct.unpack("<I", head)[0] == GGUF_MAGIC:
            im = _load_gguf(source, p, f, size)
        else:
            im = _load_legacy(source, f, size)
    for name, e in im.entries.items():
        bad = ~np.isfinite(e)
        if bad.any():
            # llama-quantize checks the same thing and aborts
            raise FleError(f"{source}: the entry for tensor {name!r} has a non-finite importance "
                           f"({e.reshape(-1)[np.argmax(bad.reshape(-1))]}); recompute the imatrix")
    return im


# ---------------------------------------------------------------------------
# legacy .dat


class _HashingReader:
    """Sequential reads that feed a SHA-256 as they go, so the file is read
    once; every read is checked against the bytes left."""

    def __init__(self, f: BinaryIO, size: int, source: str):
        self.f = f
        self.size = size
        self.pos = 0
        self.source = source
        self.sha = hashlib.sha256()

    def left(self) -> int:
        return self.size - self.pos

    def read(self, n: int, what: str) -> bytes:
        if n > self.left():
            raise FleError(f"{self.source}: truncated imatrix file: {what} needs {n} bytes at offset {self.pos}, "
                           f"only {self.left()} left")
        b = self.f.read(n)
        if len(b) != n:
            raise FleError(f"{self.source}: could not read {what} ({len(b)} of {n} bytes); the file changed while "
                           "it was read")
        self.sha.update(b)
        self.pos += n
        return b

    def i32(self, what: str) -> int:
        return struct.unpack("<i", self.read(4, what))[0]


def _c_string(raw: bytes, source: str, what: str) -> str:
    # llama.cpp builds the string from a NUL-terminated buffer
    raw = raw.split(b"\0", 1)[0]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FleError(f"{source}: {what} is not valid UTF-8; the file is corrupt") from None


def _load_legacy(source: str, f: BinaryIO, size: int) -> Imatrix:
    r = _HashingReader(f, size, source)
    n_entries = r.i32("the entry count")
    if n_entries < 1:
        raise FleError(f"{source}: not an imatrix file (neither GGUF nor a legacy imatrix with at least one entry; "
                       f"entry count {n_entries})")
    # each entry takes at least 16 bytes: name length, ncall, value count, one value
    if n_entries * 16 > r.left():
        raise FleError(f"{source}: not an imatrix file or truncated: {n_entries} entries cannot fit in {size} bytes")
    entries: dict[str, np.ndarray] = {}
    for i in range(n_entries):
        where = f"entry {i + 1} of {n_entries}"
        n = r.i32(f"the name length of {where}")
        if n < 0 or n > r.left():
            raise FleError(f"{source}: {where} has a name length of {n} bytes with {r.left()} left; "
                           "the file is truncated or not an imatrix file")
        name = _c_string(r.read(n, f"the name of {where}"), source, f"the name of {where}")
        ncall = r.i32(f"the call count of {name!r}")
        nval = r.i32(f"the value count of {name!r}")
        if nval < 1:
            raise FleError(f"{source}: the entry for {name!r} has {nval} values; the file is corrupt")
        raw = r.read(4 * nval, f"the {nval} values of {name!r}")
        if name in entries:
            raise FleError(f"{source}: tensor {name!r} has two entries; the file is corrupt")
        sums = np.frombuffer(raw, dtype="<f4")
        if ncall > 0:
            vals = (sums / np.float32(ncall)).astype(np.float32)
        else:
            vals = sums.astype(np.float32)  # a copy: ``raw`` is released
        entries[name] = vals.reshape(1, nval)
    chunk_count = 0
    datasets: tuple[str, ...] = ()
    if r.left():
        # the optional trailer: chunk count, then the dataset's name
        chunk_count = r.i32("the chunk count after the last entry")
        n = r.i32("the dataset name length after the chunk count")
        if n < 0:
            raise FleError(f"{source}: dataset name length {n} after the last entry; the file is corrupt")
        if n > 0:
            ds = _c_string(r.read(n, "the dataset name"), source, "the dataset name")
            datasets = (ds,)
        if r.left():
            raise FleError(f"{source}: {r.left()} unexpected bytes after the dataset name at offset {r.pos}; "
                           "the file is corrupt or not a legacy imatrix")
    return Imatrix(source, "legacy", entries, datasets, chunk_count, 0, r.sha.hexdigest())


# ---------------------------------------------------------------------------
# GGUF


def _load_gguf(source: str, p: Path, f: BinaryIO, size: int) -> Imatrix:
    from .gguf_reader import _parse_shard  # the GGUF header parser, bounds-checked

    buf: "mmap.mmap | bytes" = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        sha = hashlib.sha256(buf).hexdigest()
        shard = _parse_shard(p, buf, 0)
        md, types = shard.metadata, shard.metadata_types
        missing = [k for k in (KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE) if k not in md]
        if missing:
            raise FleError(f"{source}: a GGUF file without the imatrix metadata ({', '.join(missing)}); "
                           "llama-quantize refuses it too: pass a file written by llama-imatrix")
        for k in (KEY_CHUNK_COUNT, KEY_CHUNK_SIZE):
            if types[k][0] != GGUFValueType.UINT32:
                raise FleError(f"{source}: {k} has type {types[k][0].name}, llama.cpp requires UINT32")
        datasets: tuple[str, ...] = ()
        if types[KEY_DATASETS] == (GGUFValueType.ARRAY, GGUFValueType.STRING):
            datasets = tuple(md[KEY_DATASETS])
        pairs: dict[str, list] = {}
        for t in shard.tensors:
            for suffix, slot in ((SUFFIX_SUMS, 0), (SUFFIX_COUNTS, 1)):
                if t.name.endswith(suffix):
                    pairs.setdefault(t.name[: -len(suffix)], [None, None])[slot] = t
        entries: dict[str, np.ndarray] = {}
        for name in sorted(pairs):
            sums_t, counts_t = pairs[name]
            if sums_t is None or counts_t is None:
                have, lack = (SUFFIX_SUMS, SUFFIX_COUNTS) if counts_t is None else (SUFFIX_COUNTS, SUFFIX_SUMS)
                raise FleError(f"{source}: tensor {name + have!r} has no {name + lack!r}; the file is corrupt")
            for t in (sums_t, counts_t):
                if t.qtype != GGMLType.F32:
                    raise FleError(f"{source}: tensor {t.name!r} is {t.qtype.name}; llama.cpp requires F32")
            nval, ncounts = sums_t.n_elements, counts_t.n_elements
            if nval % ncounts:
                raise FleError(f"{source}: {name!r} has {nval} sums for {ncounts} counts, not a whole number per "
                               "count; the file is corrupt")
            sums = np.frombuffer(buf, dtype="<f4", count=nval, offset=sums_t.offset).reshape(ncounts, nval // ncounts)
            raw_counts = np.frombuffer(buf, dtype="<f4", count=ncounts, offset=counts_t.offset)
            entries[name] = _average(sums, raw_counts, source, name)
            del sums, raw_counts  # views into the map, which closes below
        if not entries:
            raise FleError(f"{source}: a GGUF file without any {SUFFIX_SUMS}/{SUFFIX_COUNTS} tensors; "
                           "it holds no importance data")
        chunk_count = int(md[KEY_CHUNK_COUNT])
        # llama-quantize reads the u32 into an int
        if chunk_count >= 1 << 31:
            chunk_count -= 1 << 32
        return Imatrix(source, "gguf", entries, datasets, chunk_count, int(md[KEY_CHUNK_SIZE]), sha)
    finally:
        try:
            buf.close()
        except BufferError:
            pass


def _average(sums: np.ndarray, raw_counts: np.ndarray, source: str, name: str) -> np.ndarray:
    """sums / count per row, float32, with llama.cpp's rounding of the
    stored float counts to integers (``std::lround``: halves away from
    zero) and 1 for rows never counted."""
    c = raw_counts.astype(np.float64)
    if not np.isfinite(c).all():
        raise FleError(f"{source}: {name + SUFFIX_COUNTS!r} holds a non-finite count; the file is corrupt")
    rounded = np.where(c >= 0, np.floor(c + 0.5), np.ceil(c - 0.5))
    count = rounded.astype(np.float32)[:, None]
    out = np.ones(sums.shape, dtype=np.float32)
    seen = (count > 0)[:, 0]
    out[seen] = sums[seen] / count[seen]
    return out
