"""GGUF writing: layout parity with gguf-py (plain and split), llama.cpp's
split rules, sources, plan validation, and atomic output under errors,
interrupts, SIGKILL and a full disk."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest

import fle_quant
from fle_quant.errors import FleError
from fle_quant.ggml_types import GGMLType, tensor_nbytes
from fle_quant.gguf_format import GGUFValueType, shard_path
from fle_quant.gguf_reader import GGUFModel
from fle_quant.gguf_writer import ByteSource, WritePlan, write_gguf

V = GGUFValueType
REPO = Path(fle_quant.__file__).resolve().parent.parent


def _rng_bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _gguf_py_model(path: Path, tensors: dict[str, tuple[list[int], GGMLType, np.ndarray]], **split) -> list[Path]:
    """Write with gguf-py (optionally split); return the files it wrote."""
    w = gguf.GGUFWriter(str(path), "llama", **split)
    w.add_uint32("llama.block_count", 1)
    w.add_key_value("tokenizer.ggml.tokens", ["a", "b"], V.ARRAY, V.STRING)
    w.add_float32("llama.rope.freq_base", 1e4)
    for name, (shape, qtype, raw) in tensors.items():
        row = tensor_nbytes(shape[:1], qtype)
        w.add_tensor(name, raw.reshape(tuple(reversed(shape[1:])) + (row,)),
                     raw_dtype=gguf.GGMLQuantizationType(int(qtype)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return w.format_shard_names(path)


def _plan_like_gguf_py(tensors) -> WritePlan:
    plan = WritePlan()
    plan.add_string("general.architecture", "llama")
    plan.add_uint32("llama.block_count", 1)
    plan.add_array("tokenizer.ggml.tokens", ["a", "b"], V.STRING)
    plan.add_float32("llama.rope.freq_base", 1e4)
    for name, (shape, qtype, raw) in tensors.items():
        plan.add_tensor(name, shape, qtype, raw)
    return plan


def _tensors(sizes_rows: list[int], seed: int = 0) -> dict:
    """Q8_0 tensors of 64 values per row (68 bytes) and the given row counts."""
    out = {}
    for i, rows in enumerate(sizes_rows):
        shape = [64, rows]
        out[f"blk.{i}.w"] = (shape, GGMLType.Q8_0, _rng_bytes(tensor_nbytes(shape, GGMLType.Q8_0), seed + i))
    return out


# ---------------------------------------------------------------------------
# layout parity


def test_plain_output_matches_gguf_py(tmp_path):
    ts = _tensors([1, 3, 2, 5])
    (ref,) = _gguf_py_model(tmp_path / "ref.gguf", ts)
    res = write_gguf(_plan_like_gguf_py(ts), tmp_path / "fle.gguf", progress=False)
    assert res.paths == [tmp_path / "fle.gguf"]
    assert (tmp_path / "fle.gguf").read_bytes() == ref.read_bytes()
    for name, (_, _, raw) in ts.items():
        assert res.sha256[name] == hashlib.sha256(raw.tobytes()).hexdigest()


@pytest.mark.parametrize("split", [{"split_max_tensors": 2}, {"split_max_tensors": 1}, {"split_max_size": 68 * 8 * 2}])
def test_split_output_matches_gguf_py(tmp_path, split):
    # rows of 8: 544-byte tensors, a multiple of the alignment, where gguf-py's
    # unpadded size rule and gguf-split's padded one agree
    ts = _tensors([8, 8, 8, 8, 8])
    refs = _gguf_py_model(tmp_path / "ref.gguf", ts, **split)
    assert len(refs) > 1
    res = write_gguf(_plan_like_gguf_py(ts), tmp_path / "fle.gguf", progress=False, **split)
    assert [p.name for p in res.paths] == [p.name.replace("ref", "fle") for p in refs]
    for ours, ref in zip(res.paths, refs):
        assert ours.read_bytes() == ref.read_bytes(), ours.name
    assert res.bytes_written == sum(p.stat().st_size for p in res.paths)


def test_split_keys_and_read_back(tmp_path):
    ts = _tensors([1, 2, 3, 4, 5, 6, 7])
    plain = write_gguf(_plan_like_gguf_py(ts), tmp_path / "plain.gguf", progress=False).paths[0]
    res = write_gguf(_plan_like_gguf_py(ts), tmp_path / "m.gguf", split_max_tensors=3, progress=False)
    assert [p.name for p in res.paths] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for i, p in enumerate(res.paths):
        r = gguf.GGUFReader(p)
        keys = [k for k in r.fields if not k.startswith("GGUF.")]
        split_keys = ["split.no", "split.count", "split.tensors.count"]
        assert keys[-3:] == split_keys
        if i:
            assert keys == split_keys  # other metadata only in the first shard
        assert r.fields["split.no"].contents() == i and r.fields["split.no"].types == [V.UINT16]
        assert r.fields["split.count"].contents() == 3 and r.fields["split.count"].types == [V.UINT16]
        assert r.fields["split.tensors.count"].contents() == 7 and r.fields["split.tensors.count"].types == [V.INT32]
    with GGUFModel.open(plain) as ref:
        for p in res.paths:
            with GGUFModel.open(p) as m:
                assert m.metadata == ref.metadata
                assert [t.shard for t in m.tensors.values()] == [0, 0, 0, 1, 1, 1, 2]
                for name in ref.tensors:
                    np.testing.assert_array_equal(m.tensor_bytes(name), ref.tensor_bytes(name))


def test_split_by_size_follows_gguf_split(tmp_path):
    # one row of 64 Q8_0 values is 68 bytes, padded to 96: gguf-split counts
    # padded sizes, gguf-py unpadded ones; a limit of 180 tells them apart
    ts = _tensors([1] * 5)
    res = write_gguf(_plan_like_gguf_py(ts), tmp_path / "m.gguf", split_max_size=180, progress=False)
    with GGUFModel.open(res.paths[0]) as m:
        counts = [sum(1 for t in m.tensors.values() if t.shard == i) for i in range(len(m.paths))]
    assert counts == [1, 1, 1, 1, 1]  # 96 + 96 = 192 > 180, though 68 + 68 = 136 is not
    # a tensor larger than the limit gets a shard of its own
    ts = _tensors([1, 20, 1, 1])
    res = write_gguf(_plan_like_gguf_py(ts), tmp_path / "n.gguf", split_max_size=200, progress=False)
    with GGUFModel.open(res.paths[-1]) as m:
        counts = [sum(1 for t in m.tensors.values() if t.shard == i) for i in range(len(m.paths))]
    assert counts == [1, 1, 2]
    # both limits: whichever comes first
    ts = _tensors([1] * 7)
    res = write_gguf(_plan_like_gguf_py(ts), tmp_path / "o.gguf", split_max_size=300, split_max_tensors=2,
                     progress=False)
    with GGUFModel.open(res.paths[0]) as m:
        counts = [sum(1 for t in m.tensors.values() if t.shard == i) for i in range(len(m.paths))]
    assert counts == [2, 2, 2, 1]


def test_no_split_when_everything_fits(tmp_path):
    ts = _tensors([1, 2])
    res = write_gguf(_plan_like_gguf_py(ts), tmp_path / "m.gguf", split_max_size=1 << 30, progress=False)
    assert res.paths == [tmp_path / "m.gguf"]
    with GGUFModel.open(res.paths[0]) as m:
        assert m.split_metadata == {}


def test_split_with_custom_alignment(tmp_path):
    ts = _tensors([1, 3, 2])
    plan = _plan_like_gguf_py(ts)
    plan.set_alignment(128)
    res = write_gguf(plan, tmp_path / "m.gguf", split_max_tensors=1, progress=False)
    for p in res.paths:
        with GGUFModel.open(p) as m:
            assert m.alignment == 128
            for name, (_, _, raw) in ts.items():
                t = m.tensors[name]
                assert t.offset % 128 == 0
                np.testing.assert_array_equal(m.tensor_bytes(name).reshape(-1), raw)
        # every shard states its own alignment, as gguf.cpp reads each with its own
        assert gguf.GGUFReader(p).alignment == 128


def test_metadata_helpers_types(tmp_path):
    plan = WritePlan()
    plan.add_string("general.architecture", "llama")
    adders = [
        ("u8", plan.add_uint8, 255, V.UINT8), ("i8", plan.add_int8, -128, V.INT8),
        ("u16", plan.add_uint16, 65535, V.UINT16), ("i16", plan.add_int16, -32768, V.INT16),
        ("u32", plan.add_uint32, 2**32 - 1, V.UINT32), ("i32", plan.add_int32, -(2**31), V.INT32),
        ("u64", plan.add_uint64, 2**64 - 1, V.UINT64), ("i64", plan.add_int64, -(2**63), V.INT64),
        ("f32", plan.add_float32, 0.25, V.FLOAT32), ("f64", plan.add_float64, 0.1, V.FLOAT64),
        ("b", plan.add_bool, False, V.BOOL), ("s", plan.add_string, "", V.STRING),
    ]
    for key, fn, val, _ in adders:
        fn(f"t.{key}", val)
    plan.add_array("t.arr_i16", [-1, 2], V.INT16)
    plan.add_array("t.arr_empty", [], V.INT32)
    plan.add_array("t.arr_s", ["x", "ÿ"], V.STRING)
    plan.add_tensor("w", [4], GGMLType.F32, np.arange(4, dtype=np.float32))
    out = write_gguf(plan, tmp_path / "m.gguf", progress=False).paths[0]
    with GGUFModel.open(out) as m:
        for key, _, val, vt in adders:
            assert m.metadata[f"t.{key}"] == val and m.metadata_types[f"t.{key}"] == (vt, None)
        assert m.metadata["t.arr_i16"] == [-1, 2] and m.metadata_types["t.arr_i16"] == (V.ARRAY, V.INT16)
        assert m.metadata["t.arr_empty"] == []
        assert m.metadata["t.arr_s"] == ["x", "ÿ"]
        np.testing.assert_array_equal(m.tensor_bytes("w").view(np.float32), np.arange(4, dtype=np.float32))
    r = gguf.GGUFReader(out)
    assert r.fields["t.u64"].contents() == 2**64 - 1
    assert r.fields["t.arr_s"].contents() == ["x", "ÿ"]
    with pytest.raises(FleError, match="does not fit UINT8"):
        plan.add_uint8("t.bad", 256)
        write_gguf(plan, tmp_path / "bad.gguf", progress=False)
    assert not (tmp_path / "bad.gguf").exists()


# ---------------------------------------------------------------------------
# sources


def test_sources_arrays_ranges_and_slices(tmp_path):
    a = _rng_bytes(10_000, 1)
    b = _rng_bytes(10_000, 2)
    (tmp_path / "a.bin").write_bytes(a.tobytes())
    (tmp_path / "b.bin").write_bytes(b.tobytes())
    ex = tensor_nbytes([256, 2], GGMLType.IQ4_XS)  # one expert: 2 rows of 136 bytes
    plan = WritePlan()
    f32 = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
    f16 = np.linspace(-1, 1, 32, dtype=np.float16)
    plan.add_tensor("f32", [32, 2], GGMLType.F32, f32)
    plan.add_tensor("f16_strided", [16], GGMLType.F16, f16[::2])
    plan.add_tensor("f32_be", [4], GGMLType.F32, np.arange(4, dtype=">f4"))
    plan.add_tensor("raw", [64, 3], "Q8_0", ByteSource(tmp_path / "a.bin", 100, 3 * 68))
    slices = [ByteSource(tmp_path / "b.bin", 7 * ex, ex), ByteSource(tmp_path / "a.bin", 0, ex),
              ByteSource(tmp_path / "b.bin", 0, ex)]
    plan.add_tensor("blk.0.ffn_up_exps.weight", [256, 2, 3], GGMLType.IQ4_XS, slices)
    res = write_gguf(plan, tmp_path / "m.gguf", progress=False)
    with GGUFModel.open(res.paths[0]) as m:
        np.testing.assert_array_equal(m.tensor_bytes("f32").view(np.float32), f32)
        np.testing.assert_array_equal(m.tensor_bytes("f16_strided").view(np.float16), f16[::2])
        np.testing.assert_array_equal(m.tensor_bytes("f32_be").view(np.float32), np.arange(4, dtype=np.float32))
        assert m.tensor_bytes("raw").tobytes() == a[100 : 100 + 3 * 68].tobytes()
        name = "blk.0.ffn_up_exps.weight"
        expect = [b[7 * ex : 8 * ex], a[:ex], b[:ex]]
        for e in range(3):
            assert m.expert_bytes(name, e).tobytes() == expect[e].tobytes()
        assert res.sha256[name] == hashlib.sha256(np.concatenate(expect).tobytes()).hexdigest()
        assert res.sha256["f16_strided"] == hashlib.sha256(np.ascontiguousarray(f16[::2]).tobytes()).hexdigest()


def test_chunked_copy_of_large_tensor(tmp_path, monkeypatch):
    # many chunks per tensor, and chunks that straddle range boundaries
    import fle_quant.gguf_writer as gw

    monkeypatch.setattr(gw, "CHUNK_BYTES", 1000)
    src = _rng_bytes(50_000, 5)
    (tmp_path / "s.bin").write_bytes(src.tobytes())
    plan = WritePlan()
    n = tensor_nbytes([64, 300], GGMLType.Q8_0)
    plan.add_tensor("w", [64, 300], GGMLType.Q8_0, [ByteSource(tmp_path / "s.bin", 3, n - 2500),
                                                    ByteSource(tmp_path / "s.bin", 40_000, 2500)])
    plan.add_tensor("x", [64, 100], GGMLType.Q8_0, src[: 6800])
    res = write_gguf(plan, tmp_path / "m.gguf", progress=True)
    with GGUFModel.open(res.paths[0]) as m:
        assert m.tensor_bytes("w").tobytes() == src[3 : 3 + n - 2500].tobytes() + src[40_000:42_500].tobytes()
        assert m.tensor_bytes("x").tobytes() == src[:6800].tobytes()


# ---------------------------------------------------------------------------
# plan validation: FleError, nothing written


def _bad_plan(tmp_path: Path, add, match: str) -> None:
    (tmp_path / "src.bin").write_bytes(bytes(1000))
    plan = WritePlan()
    plan.add_string("general.architecture", "llama")
    plan.add_tensor("ok", [32], GGMLType.F32, np.zeros(32, np.float32))
    add(plan, tmp_path / "src.bin")
    before = sorted(tmp_path.iterdir())
    with pytest.raises(FleError, match=match):
        write_gguf(plan, tmp_path / "out.gguf", progress=False)
    assert sorted(tmp_path.iterdir()) == before


@pytest.mark.parametrize(
    "add, match",
    [
        (lambda p, s: p.add_tensor("ok", [32], "F32", np.zeros(32, np.float32)), "duplicate tensor name 'ok'"),
        (lambda p, s: p.add_tensor("q", [48, 2], "Q4_0", np.zeros(54, np.uint8)), "not a multiple of the Q4_0 block"),
        (lambda p, s: p.add_tensor("q", [32, 2], "Q4_0", np.zeros(35, np.uint8)), "has 35 bytes but .* needs 36"),
        (lambda p, s: p.add_tensor("q", [32, 0], "Q4_0", np.zeros(0, np.uint8)), "invalid shape"),
        (lambda p, s: p.add_tensor("q", [32, 1, 1, 1, 1], "F32", np.zeros(32, np.float32)), "invalid shape"),
        (lambda p, s: p.add_tensor("q", [32], "F16", np.zeros(32, np.float32)), "float32 array cannot hold F16"),
        (lambda p, s: p.add_tensor("q", [32], "Q8_0", ByteSource(s, 980, 34)), "past the end of"),
        (lambda p, s: p.add_tensor("q", [32], "Q8_0", ByteSource(s.with_name("nope"), 0, 34)), "cannot read source"),
        (lambda p, s: p.add_tensor("q", [32], "Q8_0", [ByteSource(s, 0, 30)]), "has 30 bytes but"),
        (lambda p, s: p.add_tensor("x" * 64, [32], "F32", np.zeros(32, np.float32)), "1 to 63 UTF-8 bytes"),
        (lambda p, s: p.add_tensor("q", [32], "F32", "not a source"), "unsupported source"),
    ],
)
def test_plan_validation(tmp_path, add, match):
    _bad_plan(tmp_path, add, match)


def test_plan_refuses_reserved_and_bad_keys():
    plan = WritePlan()
    with pytest.raises(FleError, match="split.count"):
        plan.add_uint16("split.count", 2)
    with pytest.raises(FleError, match="power of two"):
        plan.set_alignment(48)
    with pytest.raises(FleError, match="UINT32"):
        plan.add_uint64("general.alignment", 64)
    with pytest.raises(FleError, match="item type"):
        plan.add("t.a", [1], V.ARRAY, None)


def test_missing_output_directory(tmp_path):
    with pytest.raises(FleError, match="does not exist"):
        write_gguf(WritePlan(), tmp_path / "no" / "m.gguf", progress=False)


# ---------------------------------------------------------------------------
# atomic output


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if ".fle-tmp-" in p.name)


def test_existing_output_without_force(tmp_path):
    ts = _tensors([1, 2, 3])
    out = tmp_path / "m.gguf"
    res = write_gguf(_plan_like_gguf_py(ts), out, split_max_tensors=1, progress=False)
    stats = [(p.stat().st_mtime_ns, p.read_bytes()) for p in res.paths]
    ts2 = _tensors([1, 2, 3], seed=9)
    with pytest.raises(FleError, match=f"{res.paths[0]}: output exists"):
        write_gguf(_plan_like_gguf_py(ts2), out, split_max_tensors=1, progress=False)
    assert [(p.stat().st_mtime_ns, p.read_bytes()) for p in res.paths] == stats
    assert _leftovers(tmp_path) == []
    res2 = write_gguf(_plan_like_gguf_py(ts2), out, split_max_tensors=1, force=True, progress=False)
    with GGUFModel.open(res2.paths[1]) as m:
        assert m.tensor_bytes("blk.1.w").tobytes() == ts2["blk.1.w"][2].tobytes()


class _InterruptingSource:
    """Yields a few chunks, then raises KeyboardInterrupt as Ctrl-C would."""

    def __init__(self, n_bytes: int):
        self.n_bytes = n_bytes

    def chunks(self, chunk_size: int):
        yield bytes(min(chunk_size, 10))
        raise KeyboardInterrupt


def test_keyboard_interrupt_leaves_nothing(tmp_path):
    ts = _tensors([1, 2, 3])
    plan = _plan_like_gguf_py(ts)
    plan.add_tensor("late", [64, 1], GGMLType.Q8_0, _InterruptingSource(68))
    with pytest.raises(KeyboardInterrupt):
        write_gguf(plan, tmp_path / "m.gguf", split_max_tensors=2, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_short_chunk_source(tmp_path):
    class Short:
        n_bytes = 68

        def chunks(self, chunk_size):
            yield bytes(60)

    plan = WritePlan()
    plan.add_tensor("w", [64], GGMLType.Q8_0, Short())
    with pytest.raises(FleError, match="produced 60 bytes, expected 68"):
        write_gguf(plan, tmp_path / "m.gguf", progress=False)
    assert list(tmp_path.iterdir()) == []


_SLOW_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import numpy as np
    from fle_quant.gguf_writer import WritePlan, write_gguf

    class Slow:
        n_bytes = 68 * 64
        def chunks(self, chunk_size):
            for _ in range(64):
                yield bytes(68)
                print("chunk", flush=True)
                time.sleep(0.05)

    plan = WritePlan()
    plan.add_string("general.architecture", "llama")
    for i in range(4):
        plan.add_tensor(f"t{i}", [64, 64], "Q8_0", Slow())
    write_gguf(plan, Path(sys.argv[1]), split_max_tensors=1, progress=False)
    print("done", flush=True)
    """
)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_sigkill_mid_write_then_rerun(tmp_path):
    out = tmp_path / "m.gguf"
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(out)], stdout=subprocess.PIPE, env=_env())
    try:
        # wait until the second shard is being written (64 chunks per shard)
        for _ in range(64 + 5):
            line = proc.stdout.readline()
            assert line == b"chunk\n", line
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    finals = [shard_path(out, i, 4) for i in range(4)]
    assert not any(p.exists() for p in finals)
    left = _leftovers(tmp_path)
    # the killed run's two temporaries and its lock file, which holds no lock any more
    assert left + [".m.fle-lock"] == sorted(p.name for p in tmp_path.iterdir())
    assert f".{finals[0].name}.fle-tmp-{proc.pid}" in left and len(left) == 2
    # a new run to the same target removes the dead run's files and succeeds
    ts = _tensors([1, 1, 1])
    res = write_gguf(_plan_like_gguf_py(ts), out, split_max_tensors=2, progress=False)
    assert _leftovers(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in res.paths)


def test_live_writer_to_same_target_is_refused(tmp_path):
    """The lock is an flock held by the writing process: while it lives a
    second writer is refused, and once it is gone its leftovers (lock file and
    a temporary named with any pid, even a live process's) keep nothing out."""
    out = tmp_path / "m.gguf"
    lock = tmp_path / ".m.fle-lock"
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], "
                               "os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); "
                               "time.sleep(60)", str(lock)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"locked\n"
        fake = out.with_name(f".{out.name}.fle-tmp-{holder.pid}")
        fake.write_bytes(b"partial")
        with pytest.raises(FleError, match="another FLE process is writing this output"):
            write_gguf(_plan_like_gguf_py(_tensors([1])), out, progress=False)
        assert fake.exists() and not out.exists()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    # the holder is dead, its lock file and a temporary named after a live pid (ours) remain
    fake.rename(out.with_name(f".{out.name}.fle-tmp-{os.getppid()}"))
    write_gguf(_plan_like_gguf_py(_tensors([1])), out, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


_FSIZE_WRITER = textwrap.dedent(
    """
    import resource, signal, sys
    from pathlib import Path
    import numpy as np
    from fle_quant.errors import FleError
    from fle_quant.gguf_writer import WritePlan, write_gguf

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    plan = WritePlan()
    plan.add_string("general.architecture", "llama")
    for i in range(3):
        plan.add_tensor(f"t{i}", [1 << 18], "F32", np.full(1 << 18, i, np.float32))
    try:
        write_gguf(plan, Path(sys.argv[1]), split_max_tensors=2, progress=False)
    except FleError as e:
        print("FleError:", e)
        sys.exit(2)
    """
)


def test_disk_full_is_fle_error_and_cleans_up(tmp_path):
    out = tmp_path / "m.gguf"
    r = subprocess.run([sys.executable, "-c", _FSIZE_WRITER, str(out)], capture_output=True, env=_env(), timeout=120)
    assert r.returncode == 2, r.stderr.decode()
    msg = r.stdout.decode()
    assert msg.startswith(f"FleError: {tmp_path / 'm-00001-of-00002.gguf'}: disk full"), msg
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------
# llama.cpp loads what we write


def _tiny_llama_plan(seed: int = 0) -> WritePlan:
    """A 2-layer llama with a 262-token SPM vocabulary (3 specials, 256 byte
    tokens, 3 words), small enough to run in llama.cpp in milliseconds."""
    rng = np.random.default_rng(seed)
    n_embd, n_ff, n_head, n_layer = 32, 64, 2, 2
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + ["▁a", "▁b", "▁ab"]
    types = [2, 3, 3] + [6] * 256 + [1, 1, 1]
    plan = WritePlan()
    plan.add_string("general.architecture", "llama")
    plan.add_string("general.name", "tiny")
    plan.add_uint32("llama.context_length", 64)
    plan.add_uint32("llama.embedding_length", n_embd)
    plan.add_uint32("llama.block_count", n_layer)
    plan.add_uint32("llama.feed_forward_length", n_ff)
    plan.add_uint32("llama.attention.head_count", n_head)
    plan.add_uint32("llama.attention.head_count_kv", n_head)
    plan.add_uint32("llama.rope.dimension_count", n_embd // n_head)
    plan.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    plan.add_string("tokenizer.ggml.model", "llama")
    plan.add_array("tokenizer.ggml.tokens", tokens, V.STRING)
    plan.add_array("tokenizer.ggml.scores", [0.0] * 259 + [-1.0, -2.0, -0.5], V.FLOAT32)
    plan.add_array("tokenizer.ggml.token_type", types, V.INT32)
    plan.add_uint32("tokenizer.ggml.bos_token_id", 1)
    plan.add_uint32("tokenizer.ggml.eos_token_id", 2)
    plan.add_uint32("tokenizer.ggml.unknown_token_id", 0)

    def w(name: str, *shape: int, dtype=np.float32) -> None:
        # shape in ggml order; numpy order is reversed
        arr = (rng.standard_normal(tuple(reversed(shape))) * 0.2).astype(dtype)
        plan.add_tensor(name, shape, GGMLType.F32 if dtype == np.float32 else GGMLType.F16, arr)

    w("token_embd.weight", n_embd, len(tokens), dtype=np.float16)
    for i in range(n_layer):
        plan.add_tensor(f"blk.{i}.attn_norm.weight", [n_embd], GGMLType.F32, np.ones(n_embd, np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w(f"blk.{i}.{name}.weight", n_embd, n_embd)
        plan.add_tensor(f"blk.{i}.ffn_norm.weight", [n_embd], GGMLType.F32, np.ones(n_embd, np.float32))
        w(f"blk.{i}.ffn_gate.weight", n_embd, n_ff)
        w(f"blk.{i}.ffn_up.weight", n_embd, n_ff)
        w(f"blk.{i}.ffn_down.weight", n_ff, n_embd)
    plan.add_tensor("output_norm.weight", [n_embd], GGMLType.F32, np.ones(n_embd, np.float32))
    w("output.weight", n_embd, len(tokens))
    return plan


def _llama_logits(path: Path, tokens: list[int]) -> np.ndarray:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=32, n_batch=32, n_threads=1, logits_all=True, verbose=False)
    try:
        assert llm.n_vocab() == 262
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()


@pytest.mark.reference
def test_llama_cpp_loads_split_output(tmp_path):
    pytest.importorskip("llama_cpp")
    plain = write_gguf(_tiny_llama_plan(), tmp_path / "plain.gguf", progress=False).paths[0]
    with GGUFModel.open(plain) as m:
        res = write_gguf(WritePlan.from_model(m), tmp_path / "split.gguf", split_max_tensors=5, progress=False)
    assert len(res.paths) == 5  # 21 tensors
    tokens = [1, 259, 260, 261, 100, 50]
    ref = _llama_logits(plain, tokens)
    assert np.isfinite(ref).all() and ref.std() > 0
    np.testing.assert_array_equal(_llama_logits(res.paths[0], tokens), ref)
    # and FLE reads back from a middle shard what llama.cpp read
    with GGUFModel.open(res.paths[2]) as m, GGUFModel.open(plain) as p:
        for name in p.tensors:
            np.testing.assert_array_equal(m.tensor_bytes(name), p.tensor_bytes(name))
