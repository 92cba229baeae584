"""Importance matrices (``fle_quant.imatrix``, ``fle-requant --imatrix``).

The files here are written by writers of this module that follow the two
formats as llama-imatrix writes them (the GGUF one through gguf-py's own
writer), independently of FLE's reader. Checked: the averaged importance of
both formats (per expert, zero counts, llama.cpp's rounding of counts), the
refusal of truncated or malformed files and of entries of the wrong size,
the per-expert use in fle-requant (each expert's rows encoded with its own
vector, whatever the chunking), the refusals llama-quantize makes, and the
recorded metadata. The reference tests compare with ggml's quantizer and,
end to end, with llama.cpp's own llama-imatrix and llama-quantize.
"""
from __future__ import annotations

import hashlib
import re
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

import fle_quant.gguf_writer as gguf_writer
from fle_quant.cli.requant_cli import main as requant_main
from fle_quant.errors import FleError
from fle_quant.ggml_types import GGMLType
from fle_quant.gguf_format import GGUFValueType
from fle_quant.gguf_reader import GGUFModel
from fle_quant.imatrix import load_imatrix
from fle_quant.quants import quantize
from fle_quant.requant import requant
from fle_quant.synth import make_model

EXPERTS = r"ffn_(gate|up|down)_exps"
N_EXPERTS, NE0, NE1 = 8, 256, 256  # the factory qwen3moe's expert tensors


# ---------------------------------------------------------------------------
# writers, following llama-imatrix's save_imatrix / save_imatrix_legacy


def write_legacy(path: Path, entries, trailer=(0, "")) -> Path:
    """``entries``: (name, ncall, float32 values); ``trailer``: (chunk count,
    dataset) or None for files written before the trailer existed."""
    with open(path, "wb") as f:
        f.write(struct.pack("<i", len(entries)))
        for name, ncall, values in entries:
            raw = name.encode()
            f.write(struct.pack("<i", len(raw)) + raw)
            values = np.asarray(values, dtype="<f4").reshape(-1)
            f.write(struct.pack("<ii", ncall, values.size))
            f.write(values.tobytes())
        if trailer is not None:
            chunks, dataset = trailer
            raw = dataset.encode()
            f.write(struct.pack("<ii", chunks, len(raw)) + raw)
    return path


def _gguf_string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def write_gguf_imatrix(path: Path, entries, datasets=("text.txt",), chunk_count=3, chunk_size=512,
                       skip_keys=(), sums_type=np.float32) -> Path:
    """A GGUF v3 file as llama-imatrix's save_imatrix lays it out: keys
    general.type, imatrix.datasets (array of strings), imatrix.chunk_count
    and imatrix.chunk_size (u32); per entry, in name order, tensors
    ``NAME.in_sum2`` (ggml shape [n, n_mat]) and ``NAME.counts`` ([1, n_mat]),
    F32, each at an offset aligned to 32 bytes. ``entries``: name ->
    (sums [n_mat, n] or None, counts [n_mat] or None)."""
    U32, STRING, ARRAY = 4, 8, 9
    ggml_type = {np.float32: 0, np.float16: 1}
    kvs = [_gguf_string("general.type") + struct.pack("<I", STRING) + _gguf_string("imatrix")]
    if "imatrix.datasets" not in skip_keys:
        kvs.append(_gguf_string("imatrix.datasets") + struct.pack("<IIQ", ARRAY, STRING, len(datasets))
                   + b"".join(_gguf_string(d) for d in datasets))
    for key, value in (("imatrix.chunk_count", chunk_count), ("imatrix.chunk_size", chunk_size)):
        if key not in skip_keys:
            kvs.append(_gguf_string(key) + struct.pack("<II", U32, value))
    tensors = []  # (name, ggml shape, type, bytes)
    for name, (sums, counts) in sorted(entries.items()):
        if sums is not None:
            sums = np.asarray(sums, dtype=sums_type)
            tensors.append((f"{name}.in_sum2", sums.shape[::-1], ggml_type[sums_type], sums.tobytes()))
        if counts is not None:
            counts = np.asarray(counts, dtype=np.float32).reshape(-1, 1)
            tensors.append((f"{name}.counts", counts.shape[::-1], 0, counts.tobytes()))
    infos, data = [], b""
    for name, shape, t, raw in tensors:
        infos.append(_gguf_string(name) + struct.pack(f"<I{len(shape)}QIQ", len(shape), *shape, t, len(data)))
        data += raw + b"\0" * (-len(raw) % 32)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(infos)
    path.write_bytes(head + b"\0" * (-len(head) % 32) + data)
    return path


def run(capsys, *args):
    rc = requant_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------------------
# the two formats


def test_gguf_format_averages_per_expert(tmp_path):
    rng = np.random.default_rng(0)
    sums = rng.random((4, 32), dtype=np.float32) * 100
    counts = np.array([4.0, 0.0, 2.5, 7.0], dtype=np.float32)
    dense = rng.random((1, 64), dtype=np.float32)
    path = write_gguf_imatrix(tmp_path / "im.gguf", {"blk.0.ffn_up_exps.weight": (sums, counts),
                                                     "blk.0.attn_q.weight": (dense, [3.0])},
                              datasets=("a.txt", "b.txt"), chunk_count=5, chunk_size=128)
    im = load_imatrix(path)
    assert im.format == "gguf" and len(im) == 2 and "blk.0.attn_q.weight" in im
    assert im.datasets == ("a.txt", "b.txt") and im.chunk_count == 5 and im.chunk_size == 128
    assert im.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    e = im.entries["blk.0.ffn_up_exps.weight"]
    assert e.dtype == np.float32 and e.shape == (4, 32)
    # count 0: an expert never routed to gets 1 everywhere; 2.5 rounds to 3
    # (std::lround: halves away from zero, where numpy's rint gives 2)
    for j, divisor in enumerate([4, None, 3, 7]):
        want = np.ones(32, np.float32) if divisor is None else sums[j] / np.float32(divisor)
        assert np.array_equal(e[j], want), j
    assert np.array_equal(im.entries["blk.0.attn_q.weight"], dense / np.float32(3))


def test_legacy_format_divides_by_ncall(tmp_path):
    rng = np.random.default_rng(1)
    a = rng.random(8 * 32, dtype=np.float32) * 50
    b = rng.random(64, dtype=np.float32)
    path = write_legacy(tmp_path / "im.dat", [("blk.0.ffn_up_exps.weight", 6, a), ("blk.0.attn_q.weight", 0, b)],
                        trailer=(11, "calibration.txt"))
    im = load_imatrix(path)
    assert im.format == "legacy" and sorted(im.entries) == ["blk.0.attn_q.weight", "blk.0.ffn_up_exps.weight"]
    assert im.chunk_count == 11 and im.datasets == ("calibration.txt",)
    assert im.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert np.array_equal(im.entries["blk.0.ffn_up_exps.weight"].reshape(-1), a / np.float32(6))
    assert np.array_equal(im.entries["blk.0.attn_q.weight"].reshape(-1), b)  # ncall 0: as stored
    # a legacy entry is matched against the tensor: row e is expert e's
    rows = im.for_tensor("blk.0.ffn_up_exps.weight", (32, 16, 8))
    assert rows.shape == (8, 32) and np.array_equal(rows[5], a[5 * 32:6 * 32] / np.float32(6))


def test_legacy_without_trailer(tmp_path):
    path = write_legacy(tmp_path / "old.dat", [("w.weight", 2, np.arange(1, 33, dtype=np.float32))], trailer=None)
    im = load_imatrix(path)
    assert im.chunk_count == 0 and im.datasets == ()
    assert np.array_equal(im.entries["w.weight"], (np.arange(1, 33, dtype=np.float32) / 2)[None])
    keys = {k: v for k, v, _ in im.metadata()}
    assert "quantize.imatrix.dataset" not in keys and "quantize.imatrix.chunks_count" not in keys


def test_metadata_keys(tmp_path):
    long_name = tmp_path / ("d" * 40) / ("x" * 100 + ".gguf")
    long_name.parent.mkdir()
    write_gguf_imatrix(long_name, {"w.weight": (np.ones((1, 32)), [1.0])}, datasets=("first.txt", "second.txt"),
                       chunk_count=9)
    im = load_imatrix(str(long_name))
    kvs = {k: (v, t) for k, v, t in im.metadata()}
    V = GGUFValueType
    # llama-quantize keeps 127 bytes of each string
    assert kvs["quantize.imatrix.file"] == (str(long_name)[:127], V.STRING)
    assert kvs["quantize.imatrix.dataset"] == ("first.txt", V.STRING)
    assert kvs["quantize.imatrix.entries_count"] == (1, V.UINT32)
    assert kvs["quantize.imatrix.chunks_count"] == (9, V.UINT32)
    assert kvs["fle.requant.imatrix_sha256"] == (hashlib.sha256(long_name.read_bytes()).hexdigest(), V.STRING)


def test_for_tensor_sizes(tmp_path):
    path = write_legacy(tmp_path / "im.dat", [("a.weight", 1, np.ones(64)), ("token_embd.weight", 1, np.ones(32))])
    im = load_imatrix(path)
    assert im.for_tensor("missing.weight", (64, 10)) is None
    assert im.for_tensor("a.weight", (64, 10)).shape == (1, 64)
    assert im.for_tensor("a.weight", (32, 10, 2)).shape == (2, 32)
    with pytest.raises(FleError, match=r"im\.dat: the entry for tensor 'a\.weight' has 64 values.*32 x 4 experts"):
        im.for_tensor("a.weight", (32, 10, 4))
    # llama-quantize quantizes the token embeddings without it instead
    assert im.for_tensor("token_embd.weight", (64, 10)) is None


# ---------------------------------------------------------------------------
# bad files: one-line FleError naming the file


def _legacy_bytes(tmp_path):
    return write_legacy(tmp_path / "ok.dat", [("a.weight", 3, np.ones(32)), ("b.weight", 1, np.ones(64))],
                        trailer=(2, "t.txt")).read_bytes()


def test_legacy_every_truncation_is_refused(tmp_path):
    data = _legacy_bytes(tmp_path)
    # where the entries end: a file cut exactly there is a valid file without trailer
    entries_end = 4 + (4 + 8 + 8 + 32 * 4) + (4 + 8 + 8 + 64 * 4)
    p = tmp_path / "cut.dat"
    for n in range(len(data)):
        p.write_bytes(data[:n])
        if n == entries_end:
            assert load_imatrix(p).chunk_count == 0
            continue
        with pytest.raises(FleError, match=r"cut\.dat: "):
            load_imatrix(p)
    p.write_bytes(data + b"\0")
    with pytest.raises(FleError, match="unexpected bytes"):
        load_imatrix(p)


@pytest.mark.parametrize("mutate, words", [
    (lambda d: struct.pack("<i", 0) + d[4:], "not an imatrix file"),
    (lambda d: struct.pack("<i", 1 << 30) + d[4:], "cannot fit"),
    (lambda d: d[:4] + struct.pack("<i", -1) + d[8:], "name length of -1"),
    (lambda d: d[:4 + 4 + 8 + 4] + struct.pack("<i", 0) + d[4 + 4 + 8 + 8:], "has 0 values"),
    (lambda d: d[:4 + 4 + 8 + 8] + struct.pack("<f", float("nan")) + d[4 + 4 + 8 + 12:], "non-finite"),
])
def test_legacy_bad_fields(tmp_path, mutate, words):
    p = tmp_path / "bad.dat"
    p.write_bytes(mutate(_legacy_bytes(tmp_path)))
    with pytest.raises(FleError, match=re.escape(words)) as e:
        load_imatrix(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_gguf_bad_files(tmp_path):
    good = {"w.weight": (np.ones((2, 32)), [1.0, 2.0])}
    p = write_gguf_imatrix(tmp_path / "ok.gguf", good)
    data = p.read_bytes()
    cases = []
    for n in (3, 20, len(data) // 2, len(data) - 30):  # the last: inside the last tensor's 8 bytes
        q = tmp_path / f"cut{n}.gguf"
        q.write_bytes(data[:n])
        cases.append((q, r"truncated|too short|past the end"))
    cases += [
        (write_gguf_imatrix(tmp_path / "nometa.gguf", good, skip_keys=("imatrix.chunk_size",)),
         "without the imatrix metadata"),
        (write_gguf_imatrix(tmp_path / "nocounts.gguf", {"w.weight": (np.ones((1, 32)), None)}),
         "has no 'w.weight.counts'"),
        (write_gguf_imatrix(tmp_path / "f16.gguf", good, sums_type=np.float16), "llama.cpp requires F32"),
        (write_gguf_imatrix(tmp_path / "inf.gguf", {"w.weight": (np.full((1, 32), np.inf), [1.0])}), "non-finite"),
        (make_model(tmp_path / "model.gguf", "qwen3moe", block_count=1), "without the imatrix metadata"),
        (tmp_path / "absent.gguf", "no such file; give the imatrix file"),
        (tmp_path, "is a directory"),
    ]
    for q, words in cases:
        with pytest.raises(FleError, match=words) as e:
            load_imatrix(q)
        assert str(q) in str(e.value), e.value


# ---------------------------------------------------------------------------
# fle-requant --imatrix


@pytest.fixture(scope="module")
def qmoe(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("imq") / "qmoe.gguf", "qwen3moe", block_count=2)


def expert_imatrix(path: Path, names, seed=0, fmt="gguf"):
    """Distinct positive importance per expert, in either format; returns
    the path and name -> [n_experts, ne0] of the values a reader must get."""
    rng = np.random.default_rng(seed)
    want = {}
    if fmt == "gguf":
        entries = {}
        for n in names:
            sums = (rng.random((N_EXPERTS, NE0), dtype=np.float32) ** 4 * 1000).astype(np.float32)
            counts = rng.integers(1, 50, N_EXPERTS).astype(np.float32)
            entries[n] = (sums, counts)
            want[n] = sums / counts[:, None]
        return write_gguf_imatrix(path, entries), want
    entries = []
    for n in names:
        vals = (rng.random(N_EXPERTS * NE0, dtype=np.float32) ** 4 * 100).astype(np.float32)
        entries.append((n, 7, vals))
        want[n] = (vals / np.float32(7)).reshape(N_EXPERTS, NE0)
    return write_legacy(path, entries, trailer=(7, "text.txt")), want


def expert_rows(model_path, name):
    with GGUFModel.open(model_path) as m:
        t = m.tensors[name]
        return np.frombuffer(m.tensor_bytes(name), np.float32).reshape(t.shape[2], t.shape[1], t.shape[0]).copy()


@pytest.mark.parametrize("fmt", ["gguf", "legacy"])
def test_requant_uses_each_experts_vector(tmp_path, capsys, qmoe, fmt):
    names = [f"blk.0.ffn_{k}_exps.weight" for k in ("gate", "up", "down")]
    im_path, want = expert_imatrix(tmp_path / f"im.{fmt}", names[:2], fmt=fmt)  # no entry for ffn_down
    out = tmp_path / "out.gguf"
    rc, stdout, err = run(capsys, qmoe, "--tensors", r"blk\.0\." + EXPERTS, "--type", "IQ4_NL",
                          "--imatrix", im_path, "-o", out)
    assert rc == 0, err
    rows = {line.split()[0]: line.split()[-1] for line in stdout.splitlines() if line.startswith("blk.")}
    assert rows == {names[0]: "yes", names[1]: "yes", names[2]: "none"}
    assert "1 of 3 tensors had no usable entry" in stdout
    with GGUFModel.open(out) as m:
        for name in names:
            got = m.tensor_bytes(name).reshape(N_EXPERTS, NE1, -1)
            x = expert_rows(qmoe, name)
            for e in range(N_EXPERTS):
                imp = want[name][e] if name in want else None
                assert np.array_equal(got[e], quantize(x[e], GGMLType.IQ4_NL, imatrix=imp)), (name, e)
            if name in want:
                # the vector matters: another expert's, or none, gives other bytes
                assert not np.array_equal(got[3], quantize(x[3], GGMLType.IQ4_NL, imatrix=want[name][4]))
                assert not np.array_equal(got[3], quantize(x[3], GGMLType.IQ4_NL))
        md = m.metadata
        assert md["quantize.imatrix.file"] == str(im_path)
        assert md["quantize.imatrix.entries_count"] == 2
        assert md["quantize.imatrix.chunks_count"] == (3 if fmt == "gguf" else 7)
        assert md["quantize.imatrix.dataset"] == "text.txt"
        assert md["fle.requant.imatrix_sha256"] == hashlib.sha256(im_path.read_bytes()).hexdigest()
        with GGUFModel.open(qmoe) as src:
            assert {k: v for k, v in md.items() if not k.startswith(("quantize.imatrix.", "fle.requant."))} \
                == src.metadata


def test_chunks_across_experts_give_the_same_file(tmp_path, monkeypatch, qmoe):
    name = "blk.1.ffn_up_exps.weight"
    im_path, _ = expert_imatrix(tmp_path / "im.gguf", [name], seed=3)
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    requant(qmoe, f"^{re.escape(name)}$", "IQ4_NL", a, progress=False, imatrix=im_path)
    # 256 values -> 136 bytes of IQ4_NL; chunks of 100 rows end inside experts
    # (of 256 rows) and span two of them
    monkeypatch.setattr(gguf_writer, "CHUNK_BYTES", 136 * 100)
    requant(qmoe, f"^{re.escape(name)}$", "IQ4_NL", b, progress=False, imatrix=im_path)
    assert a.read_bytes() == b.read_bytes()


def test_stale_imatrix_keys_are_replaced(tmp_path, qmoe):
    name = "blk.1.ffn_up_exps.weight"
    first, _ = expert_imatrix(tmp_path / "first.dat", [name], fmt="legacy")
    second = write_gguf_imatrix(tmp_path / "second.gguf", {"unrelated.weight": (np.ones((1, 32)), [1.0])},
                                datasets=(), chunk_count=0)
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    requant(qmoe, f"^{re.escape(name)}$", "IQ4_NL", a, progress=False, imatrix=first)
    reports, _ = requant(a, f"^{re.escape(name)}$", "IQ4_NL", b, progress=False, imatrix=second)
    assert reports[0].imatrix is False
    with GGUFModel.open(b) as m:
        keys = {k: v for k, v in m.metadata.items() if k.startswith(("quantize.imatrix", "fle.requant"))}
    # no dataset and no chunk count in the second file: none left from the first
    assert keys == {"quantize.imatrix.file": str(second), "quantize.imatrix.entries_count": 1,
                    "fle.requant.imatrix_sha256": hashlib.sha256(second.read_bytes()).hexdigest()}


def test_iq3_xxs_needs_an_imatrix(tmp_path, capsys, qmoe):
    name = "blk.0.ffn_up_exps.weight"
    im_path, want = expert_imatrix(tmp_path / "im.gguf", [name])
    out = tmp_path / "out.gguf"
    rc, _, err = run(capsys, qmoe, "--tensors", name, "--type", "IQ3_XXS", "-o", out)
    assert rc == 2 and f"IQ3_XXS needs an importance matrix for tensor '{name}'" in err and not out.exists()
    rc, _, err = run(capsys, qmoe, "--tensors", r"blk\.0\.ffn_(up|down)_exps", "--type", "IQ3_XXS",
                     "--imatrix", im_path, "-o", out)
    assert rc == 2 and "no entry for tensor 'blk.0.ffn_down_exps.weight'" in err and not out.exists()
    # the token embeddings and the output are exempt, as in llama-quantize
    rc, _, err = run(capsys, qmoe, "--tensors", "^output.weight$", "--type", "IQ3_XXS", "--imatrix", im_path,
                     "-o", out)
    assert rc == 0, err
    rc, _, err = run(capsys, qmoe, "--tensors", name, "--type", "IQ3_XXS", "--imatrix", im_path, "-o", out,
                     "--force")
    assert rc == 0, err
    with GGUFModel.open(out) as m:
        got = m.tensor_bytes(name).reshape(N_EXPERTS, NE1, -1)
    x = expert_rows(qmoe, name)
    assert np.array_equal(got[6], quantize(x[6], GGMLType.IQ3_XXS, imatrix=want[name][6]))


@pytest.mark.parametrize("kind", ["size", "q4_0", "bad_file"])
def test_requant_refusals(tmp_path, capsys, qmoe, kind):
    name = "blk.0.ffn_up_exps.weight"
    if kind == "size":
        im_path = write_legacy(tmp_path / "im.dat", [(name, 1, np.ones(NE0 * 4))])
        args, words = ["--type", "IQ4_NL"], f"im.dat: the entry for tensor '{name}' has 1024 values"
    elif kind == "q4_0":
        im_path, _ = expert_imatrix(tmp_path / "im.gguf", [name])
        args, words = ["--type", "Q4_0"], "Q4_0 encoder does not use an importance matrix"
    else:
        im_path = tmp_path / "im.dat"
        im_path.write_bytes(b"\x01\x00")
        args, words = ["--type", "IQ4_NL"], "too short for an imatrix file"
    out = tmp_path / "out.gguf"
    rc, _, err = run(capsys, qmoe, "--tensors", name, *args, "--imatrix", im_path, "-o", out)
    assert rc == 2 and words in err and err.startswith("fle-requant: error:") and err.count("\n") == 1, err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".fle-tmp-" in p.name]


# ---------------------------------------------------------------------------
# references


@pytest.mark.reference
def test_expert_slices_match_ggml(tmp_path, qmoe):
    """ggml's own quantize_iq4_nl / quantize_iq4_xs, one expert at a time
    with that expert's vector, give the bytes fle-requant writes."""
    pytest.importorskip("llama_cpp")
    from fle_quant import ggml_ref

    if not ggml_ref.available():
        pytest.skip("ggml's shared library from llama-cpp-python is not available")
    name = "blk.1.ffn_down_exps.weight"
    im_path, want = expert_imatrix(tmp_path / "im.gguf", [name], seed=5)
    x = expert_rows(qmoe, name)
    for qtype in ("IQ4_NL", "IQ4_XS"):
        out = tmp_path / f"{qtype}.gguf"
        requant(qmoe, f"^{re.escape(name)}$", qtype, out, progress=False, imatrix=im_path)
        with GGUFModel.open(out) as m:
            got = m.tensor_bytes(name).reshape(N_EXPERTS, NE1, -1)
            for e in range(N_EXPERTS):
                ref = ggml_ref.quantize(x[e], GGMLType[qtype], imatrix=want[name][e])
                assert np.array_equal(got[e], ref.reshape(got[e].shape)), (qtype, e)


def _text_file(path: Path, n_lines: int = 60) -> Path:
    rng = np.random.default_rng(0)
    words = ("the of and to in is was for on as with by at from his her that it an are were which this be "
             "river mountain city language music science history village station church engine garden").split()
    path.write_text("\n".join(" ".join(rng.choice(words, 12)) + "." for _ in range(n_lines)) + "\n")
    return path


def _run_tool(cmd, cwd):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, cwd=cwd)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout + r.stderr


@pytest.mark.reference
def test_matches_llama_quantize(tmp_path, capsys, monkeypatch, llama_build):
    """llama-imatrix computes an importance matrix on a factory model; the
    expert tensors that llama-quantize --imatrix encodes to IQ4_NL and those
    fle-requant --imatrix encodes are byte-identical, with the GGUF file and
    with the same data in the legacy format, and so are the
    quantize.imatrix.* keys."""
    bins = llama_build("llama-quantize", "llama-imatrix") / "bin"
    imatrix_exe, quantize_exe = bins / "llama-imatrix", bins / "llama-quantize"
    for exe in (imatrix_exe, quantize_exe):
        if not exe.is_file():
            pytest.skip(f"the build did not produce {exe}")
    monkeypatch.chdir(tmp_path)  # relative names: both tools record the same string
    # expert 5 is never routed to: its count is 0 and its importance 1 (GGUF)
    # or 1 * ncall / ncall (legacy)
    model = make_model(tmp_path / "model.gguf", "qwen3moe", mix="f32", dead_experts=[5])
    _text_file(tmp_path / "text.txt")
    _run_tool([imatrix_exe, "-m", "model.gguf", "-f", "text.txt", "-o", "im.gguf", "-c", "64", "-b", "64",
               "--chunks", "4", "-t", "2", "--no-ppl"], tmp_path)
    # the conversion reads no model, but the tool insists on the option
    _run_tool([imatrix_exe, "-m", "model.gguf", "--in-file", "im.gguf", "-o", "im.dat", "--output-format", "dat"],
              tmp_path)
    im = load_imatrix(tmp_path / "im.gguf")
    assert im.chunk_count == 4 and im.datasets == ("text.txt",)
    with GGUFModel.open(tmp_path / "im.gguf") as raw:
        counts = np.frombuffer(raw.tensor_bytes("blk.0.ffn_up_exps.weight.counts"), np.float32)
    assert counts.shape == (N_EXPERTS,) and counts[5] == 0 and (np.delete(counts, 5) > 0).all()
    assert np.array_equal(im.entries["blk.0.ffn_up_exps.weight"][5], np.ones(NE0, np.float32))

    with GGUFModel.open(model) as src:
        names = [n for n in src.tensors if re.search(EXPERTS, n)]
    assert len(names) == 12
    for imfile in ("im.gguf", "im.dat"):
        ref = tmp_path / f"llama-{imfile}.gguf"
        _run_tool([quantize_exe, "--pure", "--imatrix", imfile, "--tensor-type", f"{EXPERTS}=iq4_nl",
                   "model.gguf", ref.name, "Q8_0", "2"], tmp_path)
        out = tmp_path / f"fle-{imfile}.gguf"
        rc, stdout, err = run(capsys, "model.gguf", "--tensors", EXPERTS, "--type", "IQ4_NL",
                              "--imatrix", imfile, "-o", out.name)
        assert rc == 0, err
        assert "had no usable entry" not in stdout
        plain = tmp_path / "plain.gguf"
        requant(model, "^blk\\.0\\.ffn_up_exps", "IQ4_NL", plain, progress=False, force=True)
        with GGUFModel.open(ref) as a, GGUFModel.open(out) as b, GGUFModel.open(plain) as c:
            for name in names:
                assert a.tensors[name].qtype == b.tensors[name].qtype == GGMLType.IQ4_NL, name
                assert np.array_equal(a.tensor_bytes(name), b.tensor_bytes(name)), (imfile, name)
            # the importance matters: without it the bytes differ
            name = "blk.0.ffn_up_exps.weight"
            assert not np.array_equal(c.tensor_bytes(name), b.tensor_bytes(name))
            for key in ("quantize.imatrix.file", "quantize.imatrix.dataset", "quantize.imatrix.entries_count",
                        "quantize.imatrix.chunks_count"):
                assert (a.metadata.get(key), a.metadata_types.get(key)) == \
                    (b.metadata.get(key), b.metadata_types.get(key)), (imfile, key)
            assert b.metadata["quantize.imatrix.file"] == imfile
