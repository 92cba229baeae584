"""Read GGUF models, single-file or split into llama.cpp shards, without
copying tensor data.

``GGUFModel.open(path)`` takes any shard of a model (``x-00002-of-00005.gguf``)
or a plain file, parses every shard's header with ``struct`` over a read-only
memory map, and validates it against the file size before trusting any count
or length it contains: a corrupt or hostile file ends in a :class:`FleError`
naming the file and the field, never in a huge allocation or a traceback.

Tensor data is never read at open time. ``tensor_bytes`` and ``expert_bytes``
return uint8 views into the shard's memory map; ``byte_range`` and
``expert_range`` return ``(path, offset, n_bytes)`` for streaming copies
(see :mod:`fle_quant.gguf_writer`).

This module knows nothing about quant formats beyond their block geometry.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .errors import FleError
from .files import check_input
from .ggml_types import BLOCK_GEOMETRY, GGMLType
from .gguf_format import (
    GGUF_MAGIC,
    KEY_ALIGNMENT,
    KEY_ARCHITECTURE,
    KEY_SPLIT_COUNT,
    KEY_SPLIT_NO,
    KEY_SPLIT_TENSORS_COUNT,
    MAX_DIMS,
    READ_VERSIONS,
    SCALAR_FORMATS,
    SPLIT_KEYS,
    DEFAULT_ALIGNMENT,
    GGUFValueType,
    check_alignment,
    pad,
    parse_shard_path,
    shard_path,
)

__all__ = ["TensorInfo", "GGUFModel", "open_model"]

_INT64_MAX = (1 << 63) - 1
_MISSING = object()

# smallest possible encodings, used to bound counts by the bytes left
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, type, one-byte value
_MIN_TI_BYTES = 8 + 4 + 4 + 8  # empty name, n_dims = 0, type, offset
_ITEM_SIZES = {t: struct.calcsize(f) for t, f in SCALAR_FORMATS.items()}
_ITEM_SIZES[GGUFValueType.STRING] = 8
_NUMPY_DTYPES = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live. ``shape`` is in ggml order (ne0, the row
    length, first); ``offset`` is absolute within the shard file ``path``."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLType
    n_bytes: int
    path: Path
    offset: int
    shard: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def row_bytes(self) -> int:
        block, size = BLOCK_GEOMETRY[self.qtype]
        ne0 = self.shape[0] if self.shape else 1
        return ne0 // block * size

    @property
    def n_rows(self) -> int:
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n

    @property
    def is_expert(self) -> bool:
        """A stacked expert tensor: 3-D, ``*_exps*`` name, experts along ne2."""
        return len(self.shape) == 3 and "_exps" in self.name

    @property
    def n_experts(self) -> int:
        if not self.is_expert:
            raise FleError(f"tensor {self.name!r} of shape {list(self.shape)} is not a 3-D *_exps expert tensor")
        return self.shape[2]

    @property
    def expert_bytes(self) -> int:
        return self.n_bytes // self.n_experts


class _Cursor:
    """Bounds-checked little-endian reads over one shard's header bytes.

    Every read checks the bytes left first, so a length or count read from the
    file is compared with the file size before anything is allocated for it.
    """

    __slots__ = ("buf", "pos", "size", "path")

    def __init__(self, buf: "mmap.mmap | bytes", path: Path):
        self.buf = buf
        self.pos = 0
        self.size = len(buf)
        self.path = path

    def left(self) -> int:
        return self.size - self.pos

    def fail(self, what: str) -> FleError:
        return FleError(f"{self.path}: {what}; the file is corrupt or not a GGUF model, re-download or re-convert it")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"truncated header: end of file at byte {self.size} inside {what}")

    def unpack(self, fmt: str, n: int, what: str) -> tuple:
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)[0]

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)[0]

    def string(self, what: str) -> str:
        n = self.u64(what)
        if n > self.size - self.pos:
            raise self.fail(f"{what} claims a length of {n} bytes but only {self.size - self.pos} bytes are left")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None


def _value_type(cur: _Cursor, raw: int, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise cur.fail(f"{what} has unknown value type {raw}") from None


def _read_array(cur: _Cursor, key: str) -> tuple[list, GGUFValueType]:
    item_type = _value_type(cur, cur.u32(f"item type of key {key!r}"), f"array item of key {key!r}")
    n = cur.u64(f"array length of key {key!r}")
    if item_type == GGUFValueType.ARRAY:
        raise cur.fail(f"key {key!r} is an array of arrays, which llama.cpp does not support")
    item_size = _ITEM_SIZES[item_type]
    if n * item_size > cur.left():
        raise cur.fail(
            f"key {key!r} claims an array of {n} {item_type.name} items but only {cur.left()} bytes are left"
        )
    if item_type != GGUFValueType.STRING:
        nbytes = n * item_size
        values = np.frombuffer(cur.buf, dtype=_NUMPY_DTYPES[item_type], count=n, offset=cur.pos).tolist()
        cur.pos += nbytes
        return values, item_type
    # strings: the dominant cost of opening a model (vocabularies), so inline the cursor
    buf, pos, size = cur.buf, cur.pos, cur.size
    unpack_from = struct.unpack_from
    out = []
    append = out.append
    try:
        for i in range(n):
            if pos + 8 > size:
                cur.pos = pos
                cur.need(8, f"string {i} of key {key!r}")
            (ln,) = unpack_from("<Q", buf, pos)
            pos += 8
            end = pos + ln
            if end > size:
                raise cur.fail(f"string {i} of key {key!r} claims {ln} bytes but only {size - pos} bytes are left")
            append(buf[pos:end].decode("utf-8"))
            pos = end
    except UnicodeDecodeError:
        raise cur.fail(f"string {len(out)} of key {key!r} is not valid UTF-8") from None
    cur.pos = pos
    return out, item_type


def _read_value(cur: _Cursor, key: str) -> tuple[Any, GGUFValueType, GGUFValueType | None]:
    vtype = _value_type(cur, cur.u32(f"value type of key {key!r}"), f"key {key!r}")
    if vtype == GGUFValueType.ARRAY:
        values, item_type = _read_array(cur, key)
        return values, vtype, item_type
    if vtype == GGUFValueType.STRING:
        return cur.string(f"string value of key {key!r}"), vtype, None
    fmt = SCALAR_FORMATS[vtype]
    return cur.unpack(fmt, _ITEM_SIZES[vtype], f"value of key {key!r}")[0], vtype, None


@dataclass
class _Shard:
    path: Path
    size: int
    version: int
    metadata: dict[str, Any]
    metadata_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]]
    alignment: int
    data_offset: int
    tensors: list[TensorInfo]


def _parse_shard(path: Path, buf: "mmap.mmap | bytes", shard: int) -> _Shard:
    cur = _Cursor(buf, path)
    size = cur.size
    if size < 4:
        raise cur.fail(f"truncated header: {size} bytes, not even the GGUF magic")
    (magic,) = cur.unpack("<I", 4, "magic")
    if magic != GGUF_MAGIC:
        raise FleError(f"{path}: bad magic {bytes(buf[:4])!r}, expected b'GGUF'; this is not a GGUF file")
    version = cur.u32("version")
    if version not in READ_VERSIONS:
        if version & 0xFFFF == 0 and version >> 16:
            raise FleError(f"{path}: big-endian GGUF is not supported; convert it to little-endian")
        raise FleError(
            f"{path}: unsupported GGUF version {version} (supported: {', '.join(map(str, READ_VERSIONS))}); "
            "re-convert the model with a current llama.cpp"
        )
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("key/value count")
    if n_kv * _MIN_KV_BYTES > cur.left():
        raise cur.fail(f"absurd key/value count {n_kv} for a file of {size} bytes")
    if n_tensors * _MIN_TI_BYTES > cur.left():
        raise cur.fail(f"absurd tensor count {n_tensors} for a file of {size} bytes")

    metadata: dict[str, Any] = {}
    types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
    for i in range(n_kv):
        key = cur.string(f"key {i}")
        if key in metadata:
            raise cur.fail(f"duplicate metadata key {key!r}")
        value, vtype, item_type = _read_value(cur, key)
        metadata[key] = value
        types[key] = (vtype, item_type)

    alignment = DEFAULT_ALIGNMENT
    if KEY_ALIGNMENT in metadata:
        if types[KEY_ALIGNMENT][0] != GGUFValueType.UINT32:
            raise FleError(
                f"{path}: {KEY_ALIGNMENT} has type {types[KEY_ALIGNMENT][0].name}, "
                "llama.cpp requires UINT32; fix the key"
            )
        alignment = check_alignment(metadata[KEY_ALIGNMENT], str(path))

    raw_infos = []
    for i in range(n_tensors):
        name = cur.string(f"name of tensor {i}")
        n_dims = cur.u32(f"dimension count of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions, at most {MAX_DIMS} are allowed")
        dims = cur.unpack(f"<{n_dims}Q", 8 * n_dims, f"shape of tensor {name!r}")
        n_elements = 1
        for d in dims:
            if d == 0 or d > _INT64_MAX:
                raise cur.fail(f"tensor {name!r} has invalid dimension {d} in shape {list(dims)}")
            n_elements *= d
        if n_elements > _INT64_MAX:
            raise cur.fail(f"tensor {name!r} shape {list(dims)} overflows the element count")
        raw_type = cur.u32(f"type of tensor {name!r}")
        try:
            qtype = GGMLType(raw_type)
        except ValueError:
            raise cur.fail(f"tensor {name!r} has unknown ggml type value {raw_type}") from None
        block, type_size = BLOCK_GEOMETRY[qtype]
        ne0 = dims[0] if dims else 1
        if ne0 % block:
            raise cur.fail(
                f"tensor {name!r} of type {qtype.name} has rows of {ne0} values, not a multiple of its block of {block}"
            )
        offset = cur.u64(f"data offset of tensor {name!r}")
        raw_infos.append((name, tuple(dims), qtype, n_elements // block * type_size, offset))

    data_offset = pad(cur.pos, alignment)
    tensors: list[TensorInfo] = []
    seen: set[str] = set()
    for name, dims, qtype, n_bytes, rel in raw_infos:
        if name in seen:
            raise FleError(f"{path}: duplicate tensor name {name!r}; the file is corrupt, re-convert it")
        seen.add(name)
        if rel % alignment:
            raise cur.fail(f"tensor {name!r} data offset {rel} is not a multiple of the alignment {alignment}")
        start = data_offset + rel
        if start + n_bytes > size:
            raise FleError(
                f"{path}: tensor {name!r} data ends at byte {start + n_bytes} past the end of the file "
                f"({size} bytes); the file is truncated, re-download it"
            )
        tensors.append(TensorInfo(name, dims, qtype, n_bytes, path, start, shard))
    by_offset = sorted(tensors, key=lambda t: t.offset)
    for a, b in zip(by_offset, by_offset[1:]):
        if b.offset < a.offset + a.n_bytes:
            raise cur.fail(f"tensors {a.name!r} and {b.name!r} overlap in the data section")
    return _Shard(path, size, version, metadata, types, alignment, data_offset, tensors)


def _map(path: Path) -> "tuple[mmap.mmap | bytes, int]":
    check_input(path, "GGUF file")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return b"", 0
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), size
    except FileNotFoundError:
        raise FleError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise FleError(f"{path}: is a directory, expected a .gguf file") from None
    except PermissionError:
        raise FleError(f"{path}: permission denied") from None


def _shard_list(path: Path) -> list[Path]:
    parsed = parse_shard_path(path)
    if parsed is None:
        return [path]
    prefix, index, count = parsed
    paths = [shard_path(path.with_name(prefix + ".gguf"), i, count) for i in range(count)]
    for i, p in enumerate(paths):
        if not p.is_file():
            raise FleError(f"shard {i + 1} of {count} missing: expected {p.name} next to {path}")
    return paths


class GGUFModel:
    """A GGUF model opened from any of its shards.

    ``metadata`` is the first shard's key/value data without ``split.*`` keys
    (those are in ``split_metadata``); ``metadata_types`` maps each key to
    ``(value type, array item type or None)``; ``tensors`` maps names to
    :class:`TensorInfo` in file order across shards.
    """

    def __init__(self, path: "str | os.PathLike[str]"):
        path = Path(path)
        self.paths: list[Path] = _shard_list(path)
        self._maps: list["mmap.mmap | bytes"] = []
        self._views: dict[int, np.ndarray] = {}
        try:
            shards = []
            for i, p in enumerate(self.paths):
                buf, _ = _map(p)
                self._maps.append(buf)
                shards.append(_parse_shard(p, buf, i))
            self._check_split(shards)
        except BaseException:
            self.close()
            raise
        first = shards[0]
        self.version: int = first.version
        self.alignment: int = first.alignment
        self.metadata: dict[str, Any] = {k: v for k, v in first.metadata.items() if k not in SPLIT_KEYS}
        self.metadata_types = {k: t for k, t in first.metadata_types.items() if k not in SPLIT_KEYS}
        self.split_metadata: dict[str, Any] = {k: first.metadata[k] for k in SPLIT_KEYS if k in first.metadata}
        self.file_size: int = sum(s.size for s in shards)
        self.data_offsets: list[int] = [s.data_offset for s in shards]
        self.tensors: dict[str, TensorInfo] = {}
        for s in shards:
            for t in s.tensors:
                if t.name in self.tensors:
                    other = self.tensors[t.name].path
                    raise FleError(
                        f"{s.path}: duplicate tensor name {t.name!r}, also in {other}; "
                        "the shards belong to different models"
                    )
                self.tensors[t.name] = t
        arch = self.metadata.get(KEY_ARCHITECTURE)
        self.arch: str | None = arch if isinstance(arch, str) else None

    @classmethod
    def open(cls, path: "str | os.PathLike[str]") -> "GGUFModel":
        return cls(path)

    def _check_split(self, shards: list[_Shard]) -> None:
        count = len(shards)
        if count == 1:
            n = shards[0].metadata.get(KEY_SPLIT_COUNT, 1)
            if n != 1:
                raise FleError(
                    f"{shards[0].path}: has {KEY_SPLIT_COUNT} = {n} but its name is not of the form "
                    "PREFIX-0000k-of-0000N.gguf; rename the shards to llama.cpp's naming"
                )
            return
        for i, s in enumerate(shards):
            md = s.metadata
            if KEY_SPLIT_COUNT not in md or KEY_SPLIT_NO not in md:
                raise FleError(
                    f"{s.path}: shard {i + 1} of {count} has no {KEY_SPLIT_COUNT}/{KEY_SPLIT_NO} keys; "
                    "the shards belong to different models"
                )
            if md[KEY_SPLIT_COUNT] != count:
                raise FleError(
                    f"{s.path}: {KEY_SPLIT_COUNT} = {md[KEY_SPLIT_COUNT]} but the file name says {count} shards; "
                    "the shards belong to different models"
                )
            if md[KEY_SPLIT_NO] != i:
                raise FleError(
                    f"{s.path}: {KEY_SPLIT_NO} = {md[KEY_SPLIT_NO]} but the file name says shard {i + 1} "
                    f"({KEY_SPLIT_NO} = {i}); the shards belong to different models"
                )
        total = sum(len(s.tensors) for s in shards)
        for s in shards:
            n = s.metadata.get(KEY_SPLIT_TENSORS_COUNT, total)
            if n != total:
                raise FleError(
                    f"{s.path}: {KEY_SPLIT_TENSORS_COUNT} = {n} but the {count} shards "
                    f"hold {total} tensors; the shards belong to different models"
                )

    # context manager -------------------------------------------------------
    def __enter__(self) -> "GGUFModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the memory maps. Views handed out earlier keep their map alive
        until they are garbage collected (an mmap with exported views cannot be
        closed explicitly)."""
        self._views.clear()
        for m in self._maps:
            if isinstance(m, mmap.mmap):
                try:
                    m.close()
                except BufferError:
                    pass
        self._maps = []

    # metadata --------------------------------------------------------------
    def hparam(self, name: str, default: Any = _MISSING) -> Any:
        """The value of ``{arch}.{name}``, or ``default`` when absent."""
        key = f"{self.arch}.{name}"
        if key in self.metadata:
            return self.metadata[key]
        if default is _MISSING:
            raise FleError(
                f"{self.paths[0]}: metadata key {key!r} is missing; "
                "the model is incomplete or of another architecture"
            )
        return default

    def __repr__(self) -> str:
        return (
            f"GGUFModel({str(self.paths[0])!r}, arch={self.arch!r}, "
            f"shards={len(self.paths)}, tensors={len(self.tensors)})"
        )

    # tensor data -----------------------------------------------------------
    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise FleError(f"{self.paths[0]}: no tensor named {name!r}") from None

    def _shard_view(self, shard: int) -> np.ndarray:
        view = self._views.get(shard)
        if view is None:
            if not self._maps:
                raise FleError(f"{self.paths[shard]}: the model was closed; open it again")
            buf = self._maps[shard]
            view = np.frombuffer(buf, dtype=np.uint8) if len(buf) else np.zeros(0, np.uint8)
            self._views[shard] = view
        return view

    def tensor_bytes(self, name: str) -> np.ndarray:
        """Zero-copy uint8 view shaped ``(ne[n-1], ..., ne1, row_bytes)``."""
        t = self.info(name)
        flat = self._shard_view(t.shard)[t.offset : t.offset + t.n_bytes]
        return flat.reshape(tuple(reversed(t.shape[1:])) + (t.row_bytes,))

    def expert_bytes(self, name: str, expert: int) -> np.ndarray:
        """Zero-copy uint8 view ``(ne1, row_bytes)`` of expert ``expert``'s slice."""
        t = self.info(name)
        self._check_expert(t, expert)
        return self.tensor_bytes(name)[expert]

    def byte_range(self, name: str) -> tuple[Path, int, int]:
        t = self.info(name)
        return t.path, t.offset, t.n_bytes

    def expert_range(self, name: str, expert: int) -> tuple[Path, int, int]:
        t = self.info(name)
        self._check_expert(t, expert)
        return t.path, t.offset + expert * t.expert_bytes, t.expert_bytes

    def _check_expert(self, t: TensorInfo, expert: int) -> None:
        if not 0 <= expert < t.n_experts:
            raise FleError(f"{t.path}: tensor {t.name!r} has {t.n_experts} experts, no expert {expert}")

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())


def open_model(path: "str | os.PathLike[str]") -> GGUFModel:
    return GGUFModel(path)
