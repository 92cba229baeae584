"""Write GGUF files from a plan, streaming tensor bytes from their sources.

A :class:`WritePlan` lists typed metadata entries and tensors; each tensor's
bytes come from a :class:`ByteSource` (a byte range of some file, e.g. a shard
of another model), a list of them concatenated (a tensor assembled from
expert slices), a numpy array, or any object with ``n_bytes`` and
``chunks(chunk_size)`` (see :class:`ChunkSource`). :func:`write_gguf` writes
the plan as one file or as llama.cpp shards, byte-identical to what gguf-py's
``GGUFWriter`` writes for the same metadata and tensors, and returns the
SHA-256 of every tensor's bytes, computed while copying.

Memory bound: two copy buffers of ``CHUNK_BYTES`` (16 MiB each; SHA-256 of
one chunk runs in a worker thread while the next is read and copied) plus
the encoded headers of all shards (metadata and tensor infos: a few MB for a
150k-token vocabulary) plus constant state, whatever the size of the output.
Tensors given as numpy arrays are written from the caller's memory without
copying (unless not C-contiguous or not little-endian). A
:class:`ChunkSource` must not modify a chunk after yielding it: its hash may
still be running while the next chunk is produced.

Output is atomic (see :mod:`fle_quant.files`): every shard is written to
``.NAME.fle-tmp-<pid>`` next to its final name, fsynced, and renamed only when
all shards are complete, the first shard last, so no complete-looking set
exists before the whole model does. A lock file held with ``flock`` keeps a
second writer out; on any error (including KeyboardInterrupt) the temporary
files are removed; a later run removes the leftovers of a killed run for the
same target, including shards of a set whose renaming was cut short.
"""
from __future__ import annotations

import errno
import hashlib
import os
import struct
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Protocol, Sequence, Union, runtime_checkable

import numpy as np

from .errors import FleError
from .files import OutputSet, _Group, write_error
from .ggml_types import BLOCK_GEOMETRY, GGMLType, parse_type
from .gguf_format import (
    DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    KEY_ALIGNMENT,
    KEY_SPLIT_COUNT,
    KEY_SPLIT_NO,
    KEY_SPLIT_TENSORS_COUNT,
    MAX_DIMS,
    MAX_NAME_BYTES,
    SPLIT_KEYS,
    WRITE_VERSION,
    GGUFValueType,
    check_alignment,
    encode_kv,
    encode_string,
    pad,
    shard_path,
)

if TYPE_CHECKING:
    from .gguf_reader import GGUFModel

__all__ = [
    "CHUNK_BYTES",
    "ByteSource",
    "ChunkSource",
    "MetaEntry",
    "PlanTensor",
    "WritePlan",
    "WriteResult",
    "write_gguf",
    "planned_layout",
    "temp_path",
]

CHUNK_BYTES = 16 << 20
_TMP_TAG = ".fle-tmp-"


@dataclass(frozen=True)
class ByteSource:
    """``n_bytes`` bytes of the file ``path`` starting at ``offset``."""

    path: Path
    offset: int
    n_bytes: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if self.offset < 0 or self.n_bytes < 0:
            raise FleError(f"{self.path}: invalid byte range offset={self.offset} n_bytes={self.n_bytes}")


@runtime_checkable
class ChunkSource(Protocol):
    """Any producer of a tensor's bytes: ``chunks`` yields bytes-like objects
    of at most ``chunk_size`` bytes, ``n_bytes`` in total."""

    n_bytes: int

    def chunks(self, chunk_size: int) -> Iterable[Any]: ...


Source = Union[ByteSource, Sequence[ByteSource], np.ndarray, ChunkSource]

# ggml type -> the numpy dtypes whose raw bytes are that type's bytes (besides uint8)
_ARRAY_DTYPES = {
    GGMLType.F32: np.dtype("<f4"),
    GGMLType.F16: np.dtype("<f2"),
    GGMLType.F64: np.dtype("<f8"),
    GGMLType.I8: np.dtype("i1"),
    GGMLType.I16: np.dtype("<i2"),
    GGMLType.I32: np.dtype("<i4"),
    GGMLType.I64: np.dtype("<i8"),
    GGMLType.BF16: np.dtype("<u2"),
}


@dataclass
class PlanTensor:
    """One output tensor: ``shape`` in ggml order (ne0 first)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLType
    source: Source

    def __post_init__(self) -> None:
        self.shape = tuple(int(d) for d in self.shape)
        self.qtype = parse_type(self.qtype)

    @property
    def n_bytes(self) -> int:
        block, size = BLOCK_GEOMETRY[self.qtype]
        ne0 = self.shape[0] if self.shape else 1
        n_rows = 1
        for d in self.shape[1:]:
            n_rows *= d
        return n_rows * (ne0 // block) * size


@dataclass
class MetaEntry:
    key: str
    value: Any
    vtype: GGUFValueType
    item_type: GGUFValueType | None = None


@dataclass
class WriteResult:
    paths: list[Path]
    sha256: dict[str, str]
    bytes_written: int


class WritePlan:
    """Ordered, typed metadata and ordered tensors of a GGUF file to write.

    The data alignment is the ``general.alignment`` entry when present (set it
    with :meth:`set_alignment`), else 32, as in gguf.cpp.
    """

    def __init__(self) -> None:
        self.metadata: dict[str, MetaEntry] = {}
        self.tensors: list[PlanTensor] = []

    # metadata --------------------------------------------------------------
    def add(self, key: str, value: Any, vtype: GGUFValueType, item_type: GGUFValueType | None = None) -> None:
        """Add or replace (keeping its position) a typed metadata entry."""
        vtype = GGUFValueType(vtype)
        if key in SPLIT_KEYS:
            raise FleError(f"metadata key {key!r} is written by write_gguf itself when splitting; do not add it")
        if vtype == GGUFValueType.ARRAY:
            if item_type is None or GGUFValueType(item_type) == GGUFValueType.ARRAY:
                raise FleError(f"metadata key {key!r}: an array needs a scalar or string item type")
            item_type = GGUFValueType(item_type)
            value = list(value)
        else:
            item_type = None
        if key == KEY_ALIGNMENT:
            if vtype != GGUFValueType.UINT32:
                raise FleError(f"metadata key {key!r} must be UINT32, as llama.cpp requires")
            check_alignment(value, "write plan")
        self.metadata[key] = MetaEntry(key, value, vtype, item_type)

    def remove(self, key: str) -> None:
        self.metadata.pop(key, None)

    def add_string(self, key: str, value: str) -> None:
        self.add(key, value, GGUFValueType.STRING)

    def add_uint8(self, key: str, value: int) -> None:
        self.add(key, value, GGUFValueType.UINT8)

    def add_int8(self, key: str, value: int) -> None:
        self.add(key, value, GGUFValueType.INT8)

    def add_uint16(self, key: str, value: int) -> None:
        self.add(key, value, GGUFValueType.UINT16)

    def add_int16(self, key: str, value: int) -> None:
        self.add(key, value, GGUFValueType.INT16)

    def add_uint32(self, key: str, value: int) -> None:
        self.add(key, value, GGUFValueType.UINT32)

    def add_int32(self, key: str, value: int) -> None:
        self.add(key, value, GGUFValueType.INT32)

    def add_uint64(self, key: str, value: int) -> None:
        self.add(key, value, GGUFValueType.UINT64)

    def add_int64(self, key: str, value: int) -> None:
        self.add(key, value, GGUFValueType.INT64)

    def add_float32(self, key: str, value: float) -> None:
        self.add(key, value, GGUFValueType.FLOAT32)

    def add_float64(self, key: str, value: float) -> None:
        self.add(key, value, GGUFValueType.FLOAT64)

    def add_bool(self, key: str, value: bool) -> None:
        self.add(key, value, GGUFValueType.BOOL)

    def add_array(self, key: str, values: Sequence[Any], item_type: GGUFValueType) -> None:
        self.add(key, values, GGUFValueType.ARRAY, item_type)

    def set_alignment(self, alignment: int) -> None:
        self.add_uint32(KEY_ALIGNMENT, alignment)

    @property
    def alignment(self) -> int:
        entry = self.metadata.get(KEY_ALIGNMENT)
        return DEFAULT_ALIGNMENT if entry is None else int(entry.value)

    def copy_metadata(self, model: "GGUFModel") -> None:
        """Copy every metadata entry of ``model`` (except ``split.*``) with its exact type, in file order."""
        for key, value in model.metadata.items():
            vtype, item_type = model.metadata_types[key]
            self.add(key, value, vtype, item_type)

    # tensors ---------------------------------------------------------------
    def add_tensor(self, name: str, shape: Sequence[int], qtype: "GGMLType | str | int", source: Source) -> PlanTensor:
        t = PlanTensor(name, tuple(shape), qtype, source)
        self.tensors.append(t)
        return t

    @classmethod
    def from_model(cls, model: "GGUFModel") -> "WritePlan":
        """A plan that rewrites ``model``: all its metadata and all its tensors as byte ranges."""
        plan = cls()
        plan.copy_metadata(model)
        for t in model.tensors.values():
            plan.add_tensor(t.name, t.shape, t.qtype, ByteSource(t.path, t.offset, t.n_bytes))
        return plan


# ---------------------------------------------------------------------------
# validation


def _check_tensor(t: PlanTensor, sizes: dict[Path, int]) -> None:
    where = f"tensor {t.name!r}"
    if not t.name or len(t.name.encode("utf-8")) > MAX_NAME_BYTES:
        raise FleError(f"{where}: names must have 1 to {MAX_NAME_BYTES} UTF-8 bytes (llama.cpp's limit)")
    if not 1 <= len(t.shape) <= MAX_DIMS or any(d <= 0 for d in t.shape):
        raise FleError(f"{where}: invalid shape {list(t.shape)}; 1 to {MAX_DIMS} positive dimensions, ggml order")
    block = BLOCK_GEOMETRY[t.qtype][0]
    if t.shape[0] % block:
        raise FleError(
            f"{where}: row length {t.shape[0]} (shape {list(t.shape)}) is not a multiple of the "
            f"{t.qtype.name} block of {block}"
        )
    src = t.source
    if isinstance(src, np.ndarray):
        if src.dtype != np.uint8 and src.dtype.newbyteorder("<") != _ARRAY_DTYPES.get(t.qtype):
            raise FleError(f"{where}: a {src.dtype} array cannot hold {t.qtype.name} data; pass raw uint8 bytes")
        have = src.nbytes
    elif isinstance(src, ByteSource) or (
        isinstance(src, (list, tuple)) and all(isinstance(s, ByteSource) for s in src)
    ):
        ranges = [src] if isinstance(src, ByteSource) else list(src)
        for r in ranges:
            if r.path not in sizes:
                try:
                    sizes[r.path] = r.path.stat().st_size
                except OSError as e:
                    raise FleError(f"{where}: cannot read source file {r.path}: {e.strerror}") from None
            if r.offset + r.n_bytes > sizes[r.path]:
                raise FleError(
                    f"{where}: source range {r.offset}+{r.n_bytes} ends past the end of {r.path} "
                    f"({sizes[r.path]} bytes); the source file is truncated or the range is wrong"
                )
        have = sum(r.n_bytes for r in ranges)
    elif isinstance(src, ChunkSource):
        have = int(src.n_bytes)
    else:
        raise FleError(f"{where}: unsupported source {type(src).__name__}; use ByteSource, a list of them or an array")
    if have != t.n_bytes:
        raise FleError(
            f"{where}: source has {have} bytes but shape {list(t.shape)} in {t.qtype.name} needs {t.n_bytes}"
        )


def _check_plan(plan: WritePlan) -> None:
    seen: set[str] = set()
    sizes: dict[Path, int] = {}
    for t in plan.tensors:
        if t.name in seen:
            raise FleError(f"duplicate tensor name {t.name!r} in the write plan")
        seen.add(t.name)
        _check_tensor(t, sizes)


def _split(
    tensors: list[PlanTensor], alignment: int, max_bytes: int | None, max_tensors: int | None
) -> list[list[PlanTensor]]:
    """Group tensors into shards as llama.cpp's gguf-split does: a new shard
    starts when the padded tensor bytes would exceed ``max_bytes`` or every
    ``max_tensors`` tensors. Unlike gguf-split, a tensor larger than
    ``max_bytes`` gets a shard of its own instead of an error."""
    shards: list[list[PlanTensor]] = [[]]
    size = 0
    for t in tensors:
        n = pad(t.n_bytes, alignment)
        cur = shards[-1]
        if cur and (
            (max_bytes is not None and size + n > max_bytes) or (max_tensors is not None and len(cur) >= max_tensors)
        ):
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    return shards


# ---------------------------------------------------------------------------
# encoding


def _encode_header(kvs: list[bytes], tensors: list[PlanTensor], alignment: int) -> bytes:
    out = bytearray(struct.pack("<IIQQ", GGUF_MAGIC, WRITE_VERSION, len(tensors), len(kvs)))
    for kv in kvs:
        out += kv
    offset = 0
    for t in tensors:
        out += encode_string(t.name)
        out += struct.pack(f"<I{len(t.shape)}QIQ", len(t.shape), *t.shape, int(t.qtype), offset)
        offset += pad(t.n_bytes, alignment)
    out += bytes(pad(len(out), alignment) - len(out))
    return bytes(out)


def _shard_kvs(plan: WritePlan, shard: int, count: int, n_total: int) -> list[bytes]:
    kvs: list[bytes] = []
    if shard == 0:
        kvs = [encode_kv(e.key, e.value, e.vtype, e.item_type) for e in plan.metadata.values()]
    elif KEY_ALIGNMENT in plan.metadata:
        # gguf.cpp reads every shard with its own alignment (32 unless the key is there)
        e = plan.metadata[KEY_ALIGNMENT]
        kvs = [encode_kv(e.key, e.value, e.vtype, e.item_type)]
    if count > 1:
        # gguf-py's key order; llama.cpp looks keys up by name
        kvs.append(encode_kv(KEY_SPLIT_NO, shard, GGUFValueType.UINT16, None))
        kvs.append(encode_kv(KEY_SPLIT_COUNT, count, GGUFValueType.UINT16, None))
        kvs.append(encode_kv(KEY_SPLIT_TENSORS_COUNT, n_total, GGUFValueType.INT32, None))
    return kvs


def _layout(plan: WritePlan, out_path: Path, split_max_size: int | None,
            split_max_tensors: int | None) -> tuple[list[Path], list[list[PlanTensor]], list[bytes]]:
    groups = _split(plan.tensors, plan.alignment, split_max_size, split_max_tensors)
    count = len(groups)
    finals = [out_path] if count == 1 else [shard_path(out_path, i, count) for i in range(count)]
    headers = [_encode_header(_shard_kvs(plan, i, count, len(plan.tensors)), group, plan.alignment)
               for i, group in enumerate(groups)]
    return finals, groups, headers


def planned_layout(plan: WritePlan, out_path: "str | os.PathLike[str]", split_max_size: int | None = None,
                   split_max_tensors: int | None = None) -> tuple[list[Path], list[int]]:
    """The file names and exact byte sizes :func:`write_gguf` will write for
    ``plan`` (headers only are encoded; nothing is read or written)."""
    finals, groups, headers = _layout(plan, Path(out_path), split_max_size, split_max_tensors)
    return finals, [len(h) + sum(pad(t.n_bytes, plan.alignment) for t in g) for h, g in zip(headers, groups)]


# ---------------------------------------------------------------------------
# streaming


_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF, errno.EPERM}


class _Copier:
    """Streams tensor bytes from their sources into an output file.

    Byte ranges are read into one of two buffers (for the hash) and written
    with ``os.copy_file_range`` from the source file, an in-kernel copy that
    measured about twice as fast as ``write`` on a virtualised ext4 disk; when
    the kernel or file system refuses it, the buffer is written instead. The hash
    of chunk i runs in a worker thread (hashlib releases the GIL) while chunk
    i is written and chunk i+1 read; chunk i-1's hash is awaited before its
    buffer is reused, so two buffers suffice.
    """

    def __init__(self, chunk_bytes: int, bar: Any):
        self.views = [memoryview(bytearray(chunk_bytes)), memoryview(bytearray(chunk_bytes))]
        self.turn = 0
        self.chunk = chunk_bytes
        self.files: dict[Path, int] = {}
        self.hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fle-sha256")
        self.bar = bar
        self.kernel_copy = hasattr(os, "copy_file_range")

    def close(self) -> None:
        self.hasher.shutdown(wait=True)
        for fd in self.files.values():
            os.close(fd)
        self.files.clear()

    def _fd(self, path: Path) -> int:
        fd = self.files.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise FleError(f"cannot open source file {path}: {e.strerror}") from None
            self.files[path] = fd
        return fd

    def _range_chunks(self, r: ByteSource) -> Iterator[tuple[memoryview, int, int]]:
        fd = self._fd(r.path)
        pos, left = r.offset, r.n_bytes
        while left:
            self.turn ^= 1
            view = self.views[self.turn][: min(left, self.chunk)]
            n = os.preadv(fd, [view], pos)
            if n <= 0:
                raise FleError(f"{r.path}: unexpected end of file at byte {pos}; the source changed while writing")
            yield view[:n], fd, pos
            pos += n
            left -= n

    def _chunks(self, t: PlanTensor) -> Iterator[tuple[Any, int, int]]:
        """(bytes-like, source fd or -1, source offset) per chunk."""
        src = t.source
        if isinstance(src, np.ndarray):
            arr = src
            if arr.dtype.byteorder == ">" or not arr.flags.c_contiguous:
                arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
            raw = memoryview(arr.reshape(-1).view(np.uint8))
            for i in range(0, len(raw), self.chunk):
                yield raw[i : i + self.chunk], -1, 0
        elif isinstance(src, ByteSource):
            yield from self._range_chunks(src)
        elif isinstance(src, (list, tuple)):
            for r in src:
                yield from self._range_chunks(r)
        else:
            for c in src.chunks(self.chunk):
                yield c, -1, 0

    def _write(self, out: int, mv: memoryview, src_fd: int, src_off: int) -> None:
        done = 0
        if src_fd >= 0 and self.kernel_copy:
            try:
                while done < len(mv):
                    k = os.copy_file_range(src_fd, out, len(mv) - done, src_off + done)
                    if k == 0:
                        break  # source shrank: write what was read, the hash matches it
                    done += k
            except OSError as e:
                if e.errno not in _NO_KERNEL_COPY:
                    raise
                self.kernel_copy = False
        while done < len(mv):
            done += os.write(out, mv[done:])

    def copy_tensor(self, t: PlanTensor, out: int) -> str:
        """Append ``t``'s bytes to the file descriptor ``out``; return their SHA-256."""
        h = hashlib.sha256()
        n = 0
        pending: Future | None = None
        try:
            for chunk, src_fd, src_off in self._chunks(t):
                mv = memoryview(chunk)
                if mv.format != "B" or mv.ndim != 1:
                    mv = mv.cast("B")
                hashed = self.hasher.submit(h.update, mv)
                self._write(out, mv, src_fd, src_off)
                if pending is not None:
                    pending.result()
                pending = hashed
                n += len(mv)
                if self.bar is not None:
                    self.bar.update(len(mv))
        finally:
            if pending is not None:
                pending.result()
        if n != t.n_bytes:
            raise FleError(f"tensor {t.name!r}: its source produced {n} bytes, expected {t.n_bytes}")
        return h.hexdigest()


def _write_all(fd: int, data: bytes) -> None:
    mv = memoryview(data)
    while mv:
        mv = mv[os.write(fd, mv):]


def temp_path(final: Path) -> Path:
    """The temporary name a shard is written under before it is renamed."""
    return _Group([final]).temp(final)


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="writing", file=sys.stderr,
                disable=not sys.stderr.isatty(), leave=False)


def write_gguf(
    plan: WritePlan,
    out_path: "str | os.PathLike[str]",
    *,
    split_max_size: int | None = None,
    split_max_tensors: int | None = None,
    force: bool = False,
    progress: bool = True,
    inputs: Iterable["str | os.PathLike[str]"] = (),
) -> WriteResult:
    """Write ``plan`` to ``out_path`` (``x.gguf``), or to ``x-0000k-of-0000N.gguf``
    shards when ``split_max_size`` (bytes of tensor data per shard) or
    ``split_max_tensors`` makes more than one shard.

    Output goes through :class:`fle_quant.files.OutputSet`: an output that
    names an input (any file a tensor is copied from, ``inputs``, or an input
    of the running command) is refused, as is a second writer to the same
    output. Raises FleError before writing anything if an output exists and
    not ``force``, or if the plan is invalid (duplicate names, shapes that do not
    fit the type's block, sources of the wrong size or past the end of their
    file).
    """
    out_path = Path(out_path)
    if split_max_size is not None and split_max_size <= 0:
        raise FleError(f"split_max_size must be positive, got {split_max_size}")
    if split_max_tensors is not None and split_max_tensors <= 0:
        raise FleError(f"split_max_tensors must be positive, got {split_max_tensors}")
    if not out_path.parent.is_dir():
        raise FleError(f"{out_path}: directory {out_path.parent} does not exist")
    _check_plan(plan)
    finals, groups, headers = _layout(plan, out_path, split_max_size, split_max_tensors)
    sources = {r.path for t in plan.tensors for r in _byte_sources(t.source)}
    alignment = plan.alignment
    sha: dict[str, str] = {}
    written = 0
    with OutputSet([finals], force=force, inputs=[*sources, *inputs]) as outs:
        bar = _progress_bar(sum(t.n_bytes for t in plan.tensors), progress)
        copier = _Copier(CHUNK_BYTES, bar)
        try:
            for final, header, group in zip(finals, headers, groups):
                out = outs.create(final)
                try:
                    _write_all(out, header)
                    pos = len(header)
                    for t in group:
                        sha[t.name] = copier.copy_tensor(t, out)
                        padding = pad(t.n_bytes, alignment) - t.n_bytes
                        _write_all(out, bytes(padding))
                        pos += t.n_bytes + padding
                finally:
                    os.close(out)
                written += pos
            # every shard is complete: publish them, the first shard (the one loaders are given) last
            outs.commit()
        except OSError as e:
            raise write_error(final, e) from None
        finally:
            copier.close()
            if bar is not None:
                bar.close()
    return WriteResult(paths=finals, sha256=sha, bytes_written=written)


def _byte_sources(src: Any) -> list[ByteSource]:
    if isinstance(src, ByteSource):
        return [src]
    if isinstance(src, (list, tuple)) and all(isinstance(s, ByteSource) for s in src):
        return list(src)
    return []
