"""Requantization (``fle_quant.requant``, ``fle-requant``): matched tensors
change type, everything else is byte-identical, the printed relative error is
what an independent decoder gives, and bad input ends in exit status 2."""
from __future__ import annotations

import re
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest

import fle_quant.gguf_writer as gguf_writer
from fle_quant.cli.requant_cli import main as requant_main
from fle_quant.ggml_types import GGMLType
from fle_quant.gguf_reader import GGUFModel
from fle_quant.gguf_writer import WritePlan, write_gguf
from fle_quant.requant import MEASURE_ROWS, requant
from fle_quant.synth import make_model, mtp_path

EXPERTS = r"ffn_(gate|up|down)_exps"
# a table row: name, from, ->, to, bytes before, bytes after, relative error
ROW = re.compile(r"^(\S+)\s+(\w+) -> (\w+)\s+([\d,]+)\s+([\d,]+)\s+(\S+)$")


def run(capsys, *args):
    rc = requant_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def table(stdout):
    rows = {}
    for line in stdout.splitlines():
        m = ROW.match(line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3), int(m.group(4).replace(",", "")),
                                int(m.group(5).replace(",", "")), float(m.group(6)))
    return rows


def ref_dequant(raw, qtype):
    """gguf-py's decoder, independent of FLE's."""
    return gguf.quants.dequantize(np.asarray(raw), gguf.GGMLQuantizationType(int(qtype))).astype(np.float64)


def ref_rel_error(src, out, name, n_rows=MEASURE_ROWS):
    a, b = src.tensors[name], out.tensors[name]
    x = ref_dequant(src.tensor_bytes(name).reshape(a.n_rows, a.row_bytes)[:n_rows], a.qtype)
    y = ref_dequant(out.tensor_bytes(name).reshape(b.n_rows, b.row_bytes)[:n_rows], b.qtype)
    return float(np.square(y - x).sum() / np.square(x).sum())


def check_requant(src_path, out_path, pattern, qtype, stdout):
    """Matched tensors in ``qtype`` with their shapes, the rest byte-identical,
    metadata identical, and the printed errors and sizes right."""
    rx = re.compile(pattern)
    rows = table(stdout)
    with GGUFModel.open(src_path) as src, GGUFModel.open(out_path) as out:
        assert list(out.tensors) == list(src.tensors)
        assert out.metadata == src.metadata and out.metadata_types == src.metadata_types
        matched = [n for n in src.tensors if rx.search(n)]
        assert matched and sorted(rows) == sorted(matched)
        for name, t in src.tensors.items():
            o = out.tensors[name]
            assert o.shape == t.shape, name
            if name in rows:
                assert o.qtype.name == qtype
                frm, to, before, after, err = rows[name]
                assert (frm, to, before, after) == (t.qtype.name, qtype, t.n_bytes, o.n_bytes)
                ref = ref_rel_error(src, out, name)
                assert err == pytest.approx(ref, rel=1e-6), name
                assert 0 < err < 0.1
            else:
                assert o.qtype == t.qtype
                assert np.array_equal(out.tensor_bytes(name), src.tensor_bytes(name)), name
    return rows


@pytest.fixture(scope="module")
def qmoe(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("rq") / "qmoe.gguf", "qwen3moe")


@pytest.fixture(scope="module")
def q4exp(tmp_path_factory):
    """qwen4exp trunk and its separate MTP head (block 4)."""
    return make_model(tmp_path_factory.mktemp("rq4") / "q4.gguf", "qwen4exp", mtp="separate")


def test_requant_experts_iq4_nl(tmp_path, capsys, qmoe):
    out = tmp_path / "out.gguf"
    rc, stdout, err = run(capsys, qmoe, "--tensors", EXPERTS, "--type", "IQ4_NL", "-o", out)
    assert rc == 0, err
    rows = check_requant(qmoe, out, EXPERTS, "IQ4_NL", stdout)
    assert len(rows) == 12
    assert f"{sum(r[2] for r in rows.values()):,} -> {sum(r[3] for r in rows.values()):,} bytes" in stdout


def test_requant_mtp_head(tmp_path, capsys, q4exp):
    head = mtp_path(q4exp)
    pattern = r"blk\.4\.ffn_(gate|up|down)_exps"
    out = tmp_path / "head.gguf"
    rc, stdout, err = run(capsys, head, "--tensors", pattern, "--type", "IQ4_NL", "-o", out)
    assert rc == 0, err
    assert len(check_requant(head, out, pattern, "IQ4_NL", stdout)) == 3
    with GGUFModel.open(out) as m:
        assert {m.tensors[f"blk.4.ffn_{k}_exps.weight"].qtype.name for k in ("gate", "up", "down")} == {"IQ4_NL"}


def test_requant_ple_table_mxfp4(tmp_path, capsys, q4exp):
    pattern = r"^per_layer_token_embd\.weight$"
    out = tmp_path / "ple.gguf"
    rc, stdout, err = run(capsys, q4exp, "--tensors", pattern, "--type", "MXFP4", "-o", out)
    assert rc == 0, err
    assert len(check_requant(q4exp, out, pattern, "MXFP4", stdout)) == 1


@pytest.fixture(scope="module")
def tall(tmp_path_factory):
    """A tensor of 3 x 8,192 rows whose later rows quantize much worse than
    the first 8,192 (heavy-tailed values), a quantized tensor and a norm."""
    d = tmp_path_factory.mktemp("tall")
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3 * MEASURE_ROWS, 64)).astype(np.float32)
    x[MEASURE_ROWS:] = rng.standard_normal((2 * MEASURE_ROWS, 64)).astype(np.float32) ** 5
    plan = WritePlan()
    plan.add_string("general.architecture", "test")
    plan.add_tensor("tall.weight", (64, 3 * MEASURE_ROWS), "F32", x)
    q = gguf.quants.quantize(rng.standard_normal((300, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    plan.add_tensor("q8.weight", (64, 300), "Q8_0", q)
    plan.add_tensor("norm.weight", (64,), "F32", rng.random(64, dtype=np.float32))
    path = d / "tall.gguf"
    write_gguf(plan, path, progress=False)
    return path, x


def test_error_is_on_the_first_8192_rows(tmp_path, capsys, tall):
    path, x = tall
    out = tmp_path / "out.gguf"
    rc, stdout, err = run(capsys, path, "--tensors", "^(tall|q8)", "--type", "Q4_0", "-o", out)
    assert rc == 0, err
    rows = check_requant(path, out, "^(tall|q8)", "Q4_0", stdout)
    with GGUFModel.open(out) as m:
        y = ref_dequant(m.tensor_bytes("tall.weight"), GGMLType.Q4_0)
    whole = float(np.square(y - x).sum() / np.square(x.astype(np.float64)).sum())
    assert abs(rows["tall.weight"][4] / whole - 1) > 0.1  # the whole tensor's error is another number


def test_small_chunks_give_the_same_file(tmp_path, monkeypatch, tall):
    path, _ = tall
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    rep_a, _ = requant(path, "^tall", "IQ4_NL", a, progress=False)
    # rows of 64 values -> 36 bytes of IQ4_NL: chunks of 113 rows, not a divisor of 8,192
    monkeypatch.setattr(gguf_writer, "CHUNK_BYTES", 36 * 113)
    rep_b, _ = requant(path, "^tall", "IQ4_NL", b, progress=False)
    assert a.read_bytes() == b.read_bytes()
    assert rep_b[0].rows_measured == rep_a[0].rows_measured == MEASURE_ROWS
    assert rep_b[0].rel_error == pytest.approx(rep_a[0].rel_error, rel=1e-12)


@pytest.mark.reference
def test_requant_matches_ggml_and_loads_in_llama_cpp(tmp_path, capsys, qmoe):
    llama_cpp = pytest.importorskip("llama_cpp")
    from fle_quant import ggml_ref

    out = tmp_path / "out.gguf"
    rc, stdout, err = run(capsys, qmoe, "--tensors", EXPERTS, "--type", "IQ4_NL", "-o", out)
    assert rc == 0, err
    check_requant(qmoe, out, EXPERTS, "IQ4_NL", stdout)
    if ggml_ref.available():  # ggml's own quantize_iq4_nl gives the same bytes
        with GGUFModel.open(qmoe) as src, GGUFModel.open(out) as m:
            name = "blk.2.ffn_down_exps.weight"
            t = src.tensors[name]
            x = np.frombuffer(src.tensor_bytes(name), np.float32).reshape(t.n_rows, t.shape[0])
            assert np.array_equal(ggml_ref.quantize(x, GGMLType.IQ4_NL).reshape(-1), m.tensor_bytes(name).reshape(-1))
    llm = llama_cpp.Llama(model_path=str(out), logits_all=True, n_ctx=256, n_threads=2, type_k=0, type_v=0,
                          flash_attn=False, verbose=False)
    try:
        toks = llm.tokenize(b"Each layer has a router and a set of experts. " * 6, add_bos=False, special=False)[:64]
        llm.eval(toks)
        logits = np.array(llm.scores[: len(toks)])
    finally:
        llm.close()
    assert len(toks) == 64 and np.isfinite(logits).all() and np.abs(logits).max() > 0


# ---------------------------------------------------------------------------
# refusals: exit 2, nothing written


@pytest.mark.parametrize("pattern, qtype, words", [
    (EXPERTS, "Q9_9", "unknown quant type"),
    (EXPERTS, "Q4_K", "cannot quantize to Q4_K"),
    (r"attn_k_norm", "IQ4_XS", "not a multiple of the IQ4_XS block of 256"),
    (r"no_such_tensor", "IQ4_NL", "no tensor name matches"),
    (r"ffn_(gate", "IQ4_NL", "not a valid regular expression"),
])
def test_bad_input(tmp_path, capsys, qmoe, pattern, qtype, words):
    out = tmp_path / "out.gguf"
    rc, _, err = run(capsys, qmoe, "--tensors", pattern, "--type", qtype, "-o", out)
    assert rc == 2 and words in err and err.startswith("fle-requant: error:"), err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".fle-tmp-" in p.name]


def test_existing_output_and_input_as_output(tmp_path, capsys, qmoe):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"keep me")
    rc, _, err = run(capsys, qmoe, "--tensors", EXPERTS, "--type", "Q8_0", "-o", out)
    assert rc == 2 and "force" in err
    assert out.read_bytes() == b"keep me"
    before = Path(qmoe).stat().st_size
    rc, _, err = run(capsys, qmoe, "--tensors", EXPERTS, "--type", "Q8_0", "-o", qmoe, "--force")
    assert rc == 2 and "input" in err
    assert Path(qmoe).stat().st_size == before
    assert run(capsys, "missing.gguf", "--tensors", EXPERTS, "--type", "Q8_0", "-o", tmp_path / "x.gguf")[0] == 2
