"""GGUF reading: parity with gguf-py's GGUFReader, byte-identical rewrites,
expert slices, and one crafted file per validation error."""
from __future__ import annotations

import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from fle_quant.errors import FleError
from fle_quant.ggml_types import GGMLType, tensor_nbytes
from fle_quant.gguf_format import GGUFValueType, encode_kv, encode_string, pad
from fle_quant.gguf_reader import GGUFModel, open_model
from fle_quant.gguf_writer import WritePlan, write_gguf

V = GGUFValueType

# name -> (ggml shape, type); raw bytes are random, the reader does not care
QUANT_TENSORS = {
    "blk.0.ffn_gate_exps.weight": ([256, 8, 4], GGMLType.IQ4_XS),
    "blk.0.ffn_down_exps.weight": ([64, 16, 4], GGMLType.Q8_0),
    "blk.0.attn_q.weight": ([256, 3], GGMLType.Q4_K),
    "blk.0.attn_k.weight": ([64, 5], GGMLType.Q5_0),
    "blk.0.ffn_up.weight": ([256, 2], GGMLType.IQ2_XS),
}


def build_reference_model(path: Path, seed: int = 0, alignment: int | None = None) -> dict[str, np.ndarray]:
    """A small model written by gguf-py: every scalar value type, arrays,
    strings, float and quantized (raw byte) tensors, 3-D expert tensors.
    Returns the tensors' bytes as uint8 arrays, by name."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo wörld ✓")
    w.add_uint32("llama.context_length", 4096)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_key_value("t.arr_i32", [1, -2, 3], V.ARRAY, V.INT32)
    w.add_key_value("t.arr_u8", [0, 255, 7], V.ARRAY, V.UINT8)
    w.add_key_value("t.arr_u64", [2**64 - 1, 0], V.ARRAY, V.UINT64)
    w.add_key_value("t.arr_f32", [0.5, -1.25, 3.0], V.ARRAY, V.FLOAT32)
    w.add_key_value("t.arr_bool", [True, False, True], V.ARRAY, V.BOOL)
    w.add_key_value("tokenizer.ggml.tokens", ["<s>", "a", "ü", "日本", ""], V.ARRAY, V.STRING)
    out: dict[str, np.ndarray] = {}
    f32 = rng.standard_normal(32).astype(np.float32)
    w.add_tensor("token_norm.weight", f32)
    out["token_norm.weight"] = f32.view(np.uint8)
    f16 = rng.standard_normal((4, 32)).astype(np.float16)
    w.add_tensor("output.weight", f16)
    out["output.weight"] = f16.reshape(-1).view(np.uint8)
    for name, (shape, qtype) in QUANT_TENSORS.items():
        nb = tensor_nbytes(shape, qtype)
        row = nb // int(np.prod(shape[1:]))
        raw = rng.integers(0, 256, nb, dtype=np.uint8).reshape(tuple(reversed(shape[1:])) + (row,))
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType(int(qtype)))
        out[name] = raw.reshape(-1)
    i32 = rng.integers(-1000, 1000, (2, 8), dtype=np.int32)
    w.add_tensor("blk.0.idx", i32)
    out["blk.0.idx"] = i32.reshape(-1).view(np.uint8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return out


@pytest.fixture(scope="module")
def ref_model(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("ref") / "ref.gguf"
    data = build_reference_model(path)
    return path, data


def _gguf_py_metadata(path: Path) -> dict:
    r = gguf.GGUFReader(path)
    out = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        v = f.contents()
        out[k] = (v, V(f.types[0]), V(f.types[-1]) if f.types[0] == V.ARRAY else None)
    return out


# ---------------------------------------------------------------------------
# parity with gguf-py


def test_metadata_matches_gguf_py(ref_model):
    path, _ = ref_model
    ref = _gguf_py_metadata(path)
    with GGUFModel.open(path) as m:
        assert list(m.metadata) == list(ref)
        for k, (v, vt, it) in ref.items():
            assert m.metadata_types[k] == (vt, it), k
            if vt in (V.FLOAT32,) or it == V.FLOAT32:
                np.testing.assert_array_equal(np.float32(m.metadata[k]), np.float32(v))
            else:
                assert m.metadata[k] == v, k
        assert m.arch == "llama"
        assert m.alignment == 32
        assert m.hparam("context_length") == 4096
        assert m.hparam("missing", default=7) == 7
        with pytest.raises(FleError, match="llama.block_count"):
            m.hparam("block_count")
        assert m.metadata["t.str"] == "héllo wörld ✓"
        assert m.metadata["tokenizer.ggml.tokens"] == ["<s>", "a", "ü", "日本", ""]
        assert m.split_metadata == {}
        assert m.paths == [path]
        assert m.file_size == path.stat().st_size


def test_tensors_match_gguf_py(ref_model):
    path, data = ref_model
    r = gguf.GGUFReader(path)
    with open_model(path) as m:
        assert list(m.tensors) == [t.name for t in r.tensors] == list(data)
        for rt in r.tensors:
            t = m.tensors[rt.name]
            assert list(t.shape) == [int(d) for d in rt.shape]
            assert int(t.qtype) == int(rt.tensor_type)
            assert t.n_bytes == rt.n_bytes
            assert t.offset == rt.data_offset
            assert t.n_elements == rt.n_elements
            assert t.shard == 0 and t.path == path
            view = m.tensor_bytes(rt.name)
            assert view.dtype == np.uint8
            assert view.shape == tuple(reversed(t.shape[1:])) + (t.row_bytes,)
            assert t.n_rows * t.row_bytes == t.n_bytes
            np.testing.assert_array_equal(view.reshape(-1), data[rt.name])
            if rt.data.dtype == np.uint8:
                assert view.shape == rt.data.shape
            # zero-copy: a view of the shard map, not a copy
            assert not view.flags.owndata and not view.flags.writeable
            p, off, n = m.byte_range(rt.name)
            assert (p, off, n) == (path, t.offset, t.n_bytes)
            assert path.read_bytes()[off : off + n] == data[rt.name].tobytes()


def test_expert_slices(ref_model):
    path, data = ref_model
    raw = path.read_bytes()
    with GGUFModel.open(path) as m:
        t = m.tensors["blk.0.ffn_gate_exps.weight"]
        assert t.is_expert and t.n_experts == 4
        assert t.expert_bytes == t.n_bytes // 4 == 8 * 136
        assert m.tensor_bytes(t.name).shape == (4, 8, 136)
        for e in range(4):
            v = m.expert_bytes(t.name, e)
            assert v.shape == (8, 136)
            lo = e * t.expert_bytes
            np.testing.assert_array_equal(v.reshape(-1), data[t.name][lo : lo + t.expert_bytes])
            p, off, n = m.expert_range(t.name, e)
            assert raw[off : off + n] == v.tobytes()
        with pytest.raises(FleError, match="no expert 4"):
            m.expert_bytes(t.name, 4)
        with pytest.raises(FleError, match="not a 3-D"):
            m.expert_range("blk.0.attn_q.weight", 0)
        with pytest.raises(FleError, match="no tensor named"):
            m.tensor_bytes("nope")


def test_rewrite_is_byte_identical(ref_model, tmp_path):
    path, _ = ref_model
    with GGUFModel.open(path) as m:
        res = write_gguf(WritePlan.from_model(m), tmp_path / "copy.gguf", progress=False)
    assert res.paths == [tmp_path / "copy.gguf"]
    assert (tmp_path / "copy.gguf").read_bytes() == path.read_bytes()
    assert res.bytes_written == path.stat().st_size
    import hashlib

    with GGUFModel.open(path) as m:
        for name in m.tensors:
            assert res.sha256[name] == hashlib.sha256(m.tensor_bytes(name).tobytes()).hexdigest()


def test_rewrite_custom_alignment_is_byte_identical(tmp_path):
    src = tmp_path / "a64.gguf"
    build_reference_model(src, seed=3, alignment=64)
    with GGUFModel.open(src) as m:
        assert m.alignment == 64
        assert all(t.offset % 64 == 0 for t in m.tensors.values())
        write_gguf(WritePlan.from_model(m), tmp_path / "b.gguf", progress=False)
    assert (tmp_path / "b.gguf").read_bytes() == src.read_bytes()


def test_version_2_is_read(ref_model, tmp_path):
    path, data = ref_model
    raw = bytearray(path.read_bytes())
    raw[4:8] = struct.pack("<I", 2)
    p = tmp_path / "v2.gguf"
    p.write_bytes(raw)
    with GGUFModel.open(p) as m:
        assert m.version == 2
        np.testing.assert_array_equal(m.tensor_bytes("output.weight").reshape(-1), data["output.weight"])


# ---------------------------------------------------------------------------
# crafted files: one per validation error


def raw_gguf(
    kvs: list[bytes] = (),
    tis: list[tuple[str, list[int], int, int]] = (),
    data: bytes = b"",
    *,
    version: int = 3,
    n_tensors: int | None = None,
    n_kv: int | None = None,
    alignment: int = 32,
    magic: bytes = b"GGUF",
) -> bytes:
    """Hand-built GGUF bytes: header, kv blobs, tensor infos (name, ggml
    shape, type value, relative offset), padding, data."""
    out = bytearray(magic + struct.pack("<IQQ", version, len(tis) if n_tensors is None else n_tensors,
                                        len(kvs) if n_kv is None else n_kv))
    for kv in kvs:
        out += kv
    for name, dims, tval, off in tis:
        out += encode_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, tval, off)
    out += bytes(pad(len(out), alignment) - len(out))
    return bytes(out + data)


ARCH = encode_kv("general.architecture", "llama", V.STRING, None)


def _expect(tmp_path: Path, blob: bytes, match: str, name: str = "bad.gguf") -> str:
    p = tmp_path / name
    p.write_bytes(blob)
    with pytest.raises(FleError, match=match) as ei:
        GGUFModel.open(p)
    assert str(p) in str(ei.value)
    return str(ei.value)


def _one_f32(n: int = 8) -> tuple[list, bytes]:
    return [("a", [n], 0, 0)], bytes(4 * n)


def test_valid_crafted_file_opens(tmp_path):
    tis, data = _one_f32()
    p = tmp_path / "ok.gguf"
    p.write_bytes(raw_gguf([ARCH], tis, data))
    with GGUFModel.open(p) as m:
        assert m.tensors["a"].shape == (8,)


def test_bad_magic(tmp_path):
    _expect(tmp_path, raw_gguf([ARCH], magic=b"GGML"), "bad magic")


def test_empty_file(tmp_path):
    _expect(tmp_path, b"", "truncated header")


@pytest.mark.parametrize("version", [1, 4, 0xFFFFFFFF])
def test_unsupported_version(tmp_path, version):
    _expect(tmp_path, raw_gguf([ARCH], version=version), "unsupported GGUF version")


def test_big_endian(tmp_path):
    _expect(tmp_path, raw_gguf([ARCH], version=3 << 24), "big-endian")


def test_truncated_everywhere(tmp_path):
    tis, data = _one_f32()
    kvs = [ARCH, encode_kv("t.arr", ["x", "yy"], V.ARRAY, V.STRING), encode_kv("t.u", 5, V.UINT32, None)]
    blob = raw_gguf(kvs, tis, data)
    header_end = len(raw_gguf(kvs, tis, b""))
    # every cut inside the header (magic, counts, kv, tensor infos)
    n_info = len(encode_string("a")) + 4 + 8 + 4 + 8
    unpadded = 24 + sum(map(len, kvs)) + n_info
    for cut in list(range(0, unpadded, 3)) + [unpadded - 1]:
        _expect(tmp_path, blob[:cut], "truncated header|absurd|claims")
    # a cut in the data section
    _expect(tmp_path, blob[: header_end + 10], "past the end of the file")


def test_tensor_data_past_eof(tmp_path):
    tis, data = _one_f32()
    _expect(tmp_path, raw_gguf([ARCH], tis, data[:-1]), "past the end of the file")
    _expect(tmp_path, raw_gguf([ARCH], [("a", [8], 0, 1 << 40)], data), "past the end")


def test_duplicate_tensor_names(tmp_path):
    tis = [("a", [8], 0, 0), ("a", [8], 0, 32)]
    _expect(tmp_path, raw_gguf([ARCH], tis, bytes(64)), "duplicate tensor name 'a'")


def test_duplicate_key(tmp_path):
    _expect(tmp_path, raw_gguf([ARCH, ARCH]), "duplicate metadata key")


@pytest.mark.parametrize("tval", [4, 5, 31, 99, 2**31])
def test_unknown_ggml_type(tmp_path, tval):
    _expect(tmp_path, raw_gguf([ARCH], [("a", [32], tval, 0)], bytes(64)), f"unknown ggml type value {tval}")


def test_unknown_value_type(tmp_path):
    kv = encode_string("t.x") + struct.pack("<II", 13, 0)
    _expect(tmp_path, raw_gguf([kv]), "unknown value type 13")


def test_absurd_counts(tmp_path):
    _expect(tmp_path, raw_gguf([ARCH], n_tensors=2**62), "absurd tensor count")
    _expect(tmp_path, raw_gguf([ARCH], n_kv=2**40), "absurd key/value count")
    huge_arr = encode_string("t.arr") + struct.pack("<IIQ", V.ARRAY, V.UINT32, 2**61)
    _expect(tmp_path, raw_gguf([huge_arr]), "claims an array of")
    huge_str_arr = encode_string("t.arr") + struct.pack("<IIQ", V.ARRAY, V.STRING, 2**40)
    _expect(tmp_path, raw_gguf([huge_str_arr]), "claims an array of")
    huge_str = encode_string("t.s") + struct.pack("<IQ", V.STRING, 2**63) + b"abc"
    _expect(tmp_path, raw_gguf([huge_str]), "claims a length")
    huge_key = struct.pack("<Q", 2**50) + b"k"
    _expect(tmp_path, raw_gguf([huge_key]), "claims a length")
    inner = encode_string("t.arr") + struct.pack("<IIQ", V.ARRAY, V.STRING, 2) + struct.pack("<Q", 2**45) + bytes(16)
    _expect(tmp_path, raw_gguf([inner]), "string 0 of key 't.arr' claims")


def test_bad_dims(tmp_path):
    _expect(tmp_path, raw_gguf([ARCH], [("a", [8, 1, 1, 1, 1], 0, 0)], bytes(32)), "5 dimensions")
    _expect(tmp_path, raw_gguf([ARCH], [("a", [8, 0], 0, 0)], bytes(32)), "invalid dimension 0")
    _expect(tmp_path, raw_gguf([ARCH], [("a", [2**63 + 1], 0, 0)], bytes(32)), "invalid dimension")
    _expect(tmp_path, raw_gguf([ARCH], [("a", [2**32, 2**32], 0, 0)], bytes(32)), "overflows")


def test_non_utf8(tmp_path):
    bad_key = struct.pack("<Q", 2) + b"\xff\xfe" + struct.pack("<IB", V.UINT8, 1)
    _expect(tmp_path, raw_gguf([bad_key]), "key 0 is not valid UTF-8")
    bad_val = encode_string("t.s") + struct.pack("<IQ", V.STRING, 1) + b"\x80"
    _expect(tmp_path, raw_gguf([bad_val]), "'t.s' is not valid UTF-8")
    bad_arr = (encode_string("t.a") + struct.pack("<IIQ", V.ARRAY, V.STRING, 2)
               + encode_string("ok") + encode_string(b"\xc3"))
    _expect(tmp_path, raw_gguf([bad_arr]), "string 1 of key 't.a' is not valid UTF-8")
    _expect(tmp_path, raw_gguf([ARCH], [(b"\xff", [8], 0, 0)], bytes(32)), "name of tensor 0 is not valid UTF-8")


def test_nested_array(tmp_path):
    kv = encode_string("t.a") + struct.pack("<IIQ", V.ARRAY, V.ARRAY, 1)
    _expect(tmp_path, raw_gguf([kv]), "array of arrays")


def test_unaligned_and_overlapping_offsets(tmp_path):
    tis = [("a", [8], 0, 0), ("b", [8], 0, 16)]
    _expect(tmp_path, raw_gguf([ARCH], tis, bytes(96)), "not a multiple of the alignment")
    _expect(tmp_path, raw_gguf([ARCH], [("a", [16], 0, 0), ("b", [8], 0, 32)], bytes(96)), "overlap")


def test_row_not_multiple_of_block(tmp_path):
    tis = [("a", [48, 2], int(GGMLType.Q4_K), 0)]
    _expect(tmp_path, raw_gguf([ARCH], tis, bytes(4096)), "not a multiple of its block of 256")


def test_bad_alignment_key(tmp_path):
    kv = encode_kv("general.alignment", 48, V.UINT32, None)
    _expect(tmp_path, raw_gguf([kv]), "power of two")
    kv = encode_kv("general.alignment", 64, V.UINT64, None)
    _expect(tmp_path, raw_gguf([kv]), "UINT32")


def test_split_count_in_plain_named_file(tmp_path):
    kvs = [ARCH, encode_kv("split.count", 3, V.UINT16, None)]
    _expect(tmp_path, raw_gguf(kvs), "split.count = 3")


def test_missing_path(tmp_path):
    with pytest.raises(FleError, match="no such file"):
        GGUFModel.open(tmp_path / "nope.gguf")
    with pytest.raises(FleError, match="directory"):
        GGUFModel.open(tmp_path)


# ---------------------------------------------------------------------------
# shards


def _split_copy(src: Path, out: Path, max_tensors: int) -> list[Path]:
    with GGUFModel.open(src) as m:
        return write_gguf(WritePlan.from_model(m), out, split_max_tensors=max_tensors, progress=False).paths


def test_shards_read_from_any_shard(ref_model, tmp_path):
    path, data = ref_model
    paths = _split_copy(path, tmp_path / "m.gguf", 3)
    assert [p.name for p in paths] == ["m-00001-of-00003.gguf", "m-00002-of-00003.gguf", "m-00003-of-00003.gguf"]
    with GGUFModel.open(path) as ref:
        for p in paths:
            with GGUFModel.open(p) as m:
                assert m.paths == paths
                assert m.metadata == ref.metadata
                assert m.metadata_types == ref.metadata_types
                assert m.split_metadata == {"split.no": 0, "split.count": 3, "split.tensors.count": len(data)}
                assert list(m.tensors) == list(ref.tensors)
                assert m.file_size == sum(q.stat().st_size for q in paths)
                for i, (name, t) in enumerate(m.tensors.items()):
                    assert t.shard == i // 3 and t.path == paths[i // 3]
                    np.testing.assert_array_equal(m.tensor_bytes(name), ref.tensor_bytes(name))
                    p2, off, n = m.byte_range(name)
                    with open(p2, "rb") as f:
                        f.seek(off)
                        assert f.read(n) == data[name].tobytes()
                t = m.tensors["blk.0.ffn_down_exps.weight"]
                for e in range(t.n_experts):
                    p2, off, n = m.expert_range(t.name, e)
                    assert p2 == t.path and n == t.expert_bytes
                    with open(p2, "rb") as f:
                        f.seek(off)
                        assert f.read(n) == ref.expert_bytes(t.name, e).tobytes()


def test_missing_shard(ref_model, tmp_path):
    path, _ = ref_model
    paths = _split_copy(path, tmp_path / "m.gguf", 2)
    paths[2].unlink()
    for p in (paths[0], paths[1]):
        with pytest.raises(FleError, match=f"shard 3 of {len(paths)} missing: expected {paths[2].name} next to {p}"):
            GGUFModel.open(p)


def _patch_int(path: Path, key: str, fmt: str, value: int) -> None:
    """Overwrite the scalar value of ``key`` in place."""
    raw = bytearray(path.read_bytes())
    at = raw.find(encode_string(key)) + len(encode_string(key)) + 4
    raw[at : at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    path.write_bytes(raw)


def test_shards_of_different_models(ref_model, tmp_path):
    path, data = ref_model
    assert len(data) == 8
    a = _split_copy(path, tmp_path / "a.gguf", 3)  # 3 shards: 3, 3, 2 tensors
    c = _split_copy(path, tmp_path / "c.gguf", 2)  # 4 shards

    # split.count mismatch: a shard of a 4-way split under a 3-way name
    shutil.copy(c[1], a[1])
    with pytest.raises(FleError, match=rf"{a[1]}: split.count = 4 but the file name says 3"):
        GGUFModel.open(a[0])

    # split.no mismatch: two shards swapped
    a = _split_copy(path, tmp_path / "d.gguf", 3)
    tmp = a[1].with_suffix(".x")
    a[1].rename(tmp)
    a[2].rename(a[1])
    tmp.rename(a[2])
    with pytest.raises(FleError, match=rf"{a[1]}: split.no = 2 but the file name says shard 2"):
        GGUFModel.open(a[2])

    # split.tensors.count total mismatch
    a = _split_copy(path, tmp_path / "e.gguf", 3)
    _patch_int(a[2], "split.tensors.count", "<i", 9)
    with pytest.raises(FleError, match=rf"{a[2]}: split.tensors.count = 9 but the 3 shards hold 8 tensors"):
        GGUFModel.open(a[1])

    # duplicate tensor names across shards
    a = _split_copy(path, tmp_path / "f.gguf", 3)
    shutil.copy(a[1], a[2])
    _patch_int(a[2], "split.no", "<H", 2)
    _patch_int(a[2], "split.tensors.count", "<i", 9)
    for p in a:
        _patch_int(p, "split.tensors.count", "<i", 9)
    with pytest.raises(FleError, match=rf"{a[2]}: duplicate tensor name .* also in {a[1]}"):
        GGUFModel.open(a[0])
