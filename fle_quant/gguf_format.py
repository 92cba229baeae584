"""GGUF container facts shared by the reader and the writer.

Constants (magic, versions, alignment, reserved keys), llama.cpp's shard file
naming, and the encoding of metadata values. The layout follows
``ggml/src/gguf.cpp`` and gguf-py's ``GGUFWriter``: little-endian, a header
``magic u32 | version u32 | n_tensors u64 | n_kv u64``, then the key/value
pairs, then the tensor infos, then zero padding to the alignment, then the
tensor data, each tensor padded to the alignment.

This module knows nothing about files; it only turns values into bytes.
"""
from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any, Sequence

from gguf import GGUFValueType

from .errors import FleError

__all__ = [
    "GGUFValueType",
    "GGUF_MAGIC",
    "READ_VERSIONS",
    "WRITE_VERSION",
    "DEFAULT_ALIGNMENT",
    "MAX_DIMS",
    "MAX_NAME_BYTES",
    "KEY_ALIGNMENT",
    "KEY_ARCHITECTURE",
    "KEY_SPLIT_NO",
    "KEY_SPLIT_COUNT",
    "KEY_SPLIT_TENSORS_COUNT",
    "SPLIT_KEYS",
    "SCALAR_FORMATS",
    "shard_path",
    "parse_shard_path",
    "pad",
    "check_alignment",
    "encode_string",
    "encode_value",
    "encode_kv",
]

GGUF_MAGIC = 0x46554747  # b"GGUF" read as little-endian u32
READ_VERSIONS = (2, 3)  # v2 and v3 share the layout; v1 had 32-bit counts
WRITE_VERSION = 3
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME is 64 including the terminating NUL

KEY_ALIGNMENT = "general.alignment"
KEY_ARCHITECTURE = "general.architecture"
KEY_SPLIT_NO = "split.no"
KEY_SPLIT_COUNT = "split.count"
KEY_SPLIT_TENSORS_COUNT = "split.tensors.count"
SPLIT_KEYS = (KEY_SPLIT_NO, KEY_SPLIT_COUNT, KEY_SPLIT_TENSORS_COUNT)

# value type -> struct format of one little-endian item
SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}

_SHARD_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shard_path(out_path: Path, index: int, count: int) -> Path:
    """llama.cpp's name of shard ``index`` (from 0): ``x.gguf`` -> ``x-00001-of-00003.gguf``."""
    out_path = Path(out_path)
    stem = out_path.name[: -len(".gguf")] if out_path.name.endswith(".gguf") else out_path.name
    return out_path.with_name(f"{stem}-{index + 1:05d}-of-{count:05d}.gguf")


def parse_shard_path(path: Path) -> tuple[str, int, int] | None:
    """``(prefix, index from 0, count)`` for a name in llama.cpp's shard form, else None."""
    m = _SHARD_RE.match(Path(path).name)
    if m is None:
        return None
    no, count = int(m["no"]), int(m["count"])
    if count < 1 or not 1 <= no <= count:
        return None
    return m["prefix"], no - 1, count


def pad(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def check_alignment(value: Any, where: str) -> int:
    """Validate a ``general.alignment`` value (a power of two, as gguf.cpp requires)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise FleError(f"{where}: {KEY_ALIGNMENT} = {value!r} is not a positive power of two; fix or drop the key")
    return int(value)


def encode_string(s: "str | bytes") -> bytes:
    raw = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(raw)) + raw


def _encode_items(values: Sequence[Any], vtype: GGUFValueType, key: str) -> bytes:
    if vtype == GGUFValueType.STRING:
        return b"".join(encode_string(v) for v in values)
    fmt = SCALAR_FORMATS.get(vtype)
    if fmt is None:
        raise FleError(f"metadata key {key!r}: arrays of {vtype.name} are not supported by llama.cpp")
    try:
        return struct.pack("<" + fmt[1] * len(values), *values)
    except struct.error as e:
        raise FleError(f"metadata key {key!r}: a value does not fit {vtype.name} ({e})") from None


def encode_value(value: Any, vtype: GGUFValueType, item_type: GGUFValueType | None, key: str = "?") -> bytes:
    """Bytes of a value as written after its key: ``type u32`` then the payload."""
    vtype = GGUFValueType(vtype)
    if vtype == GGUFValueType.ARRAY:
        if item_type is None:
            raise FleError(f"metadata key {key!r}: an array needs an item type")
        item_type = GGUFValueType(item_type)
        values = list(value)
        return struct.pack("<IIQ", vtype, item_type, len(values)) + _encode_items(values, item_type, key)
    if vtype == GGUFValueType.STRING:
        if not isinstance(value, (str, bytes, bytearray)):
            raise FleError(f"metadata key {key!r}: expected a string, got {type(value).__name__}")
        return struct.pack("<I", vtype) + encode_string(value)
    return struct.pack("<I", vtype) + _encode_items([value], vtype, key)


def encode_kv(key: str, value: Any, vtype: GGUFValueType, item_type: GGUFValueType | None) -> bytes:
    return encode_string(key) + encode_value(value, vtype, item_type, key)
