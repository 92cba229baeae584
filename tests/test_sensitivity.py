"""fle-sensitivity on factory models: an identical donor measures exactly 0,
errors grow as the donors' bits fall, one layer's error equals a separate
NumPy computation (gguf-py's dequantizers, SwiGLU experts on the captured
inputs and routing), the table feeds fle-select and the spliced file fits
the selection's size, a separate base is measured like a donor, and bad
input exits 2 with one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.usefixtures("two_torch_threads")
torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from fle_quant.cli.select_cli import main as select_main  # noqa: E402
from fle_quant.cli.sensitivity_cli import main as sens_main  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.gguf_reader import GGUFModel  # noqa: E402
from fle_quant.select import load_selection, parse_table, select_for_target  # noqa: E402
from fle_quant.sensitivity import measure, provenance_reserve  # noqa: E402
from fle_quant.splice import splice  # noqa: E402
from textgen import write_text  # noqa: E402  (this folder's helper)
from fle_quant.synth import make_model  # noqa: E402

SEED = 3
N_TOKENS = 256
CTX = 128          # two windows
DONOR_TYPES = ("Q8_0", "IQ4_NL", "IQ3_S")



def expert_mix(qtype: str):
    return [(r"ffn_(gate|up|down)_exps", qtype)]



@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("sens")
    out = {"dir": d, "text": write_text(d / "calib.txt")}
    out["ref"] = make_model(d / "ref.gguf", "qwen3moe", seed=SEED, mix="f32")
    out["copy"] = Path(shutil.copy(out["ref"], d / "copy.gguf"))
    # written again from the same seed and mix, with the non-expert matrices in Q8_0: the
    # expert tensors decode to the reference's values, nothing else matters
    out["same"] = make_model(d / "same.gguf", "qwen3moe", seed=SEED,
                             mix=[(r"\.ffn_gate_inp\.weight$", "F32"), (r"_exps\.weight$", "F32"), (r".", "Q8_0")])
    for q in DONOR_TYPES:
        out[q] = make_model(d / f"{q}.gguf", "qwen3moe", seed=SEED, mix=expert_mix(q))
    return out


@pytest.fixture(scope="module")
def table(files):
    donors = {name: files[name] for name in ("copy", "same", *DONOR_TYPES)}
    return measure(files["ref"], donors, files["text"], n_tokens=N_TOKENS, ctx=CTX)


def test_identical_donor_measures_exactly_zero(table):
    assert len(table["layers"]) == 4
    for row in table["layers"]:
        c = row["candidates"]
        assert c["base"]["error"] == 0.0
        assert c["copy"]["error"] == 0.0
        assert c["same"]["error"] == 0.0
        assert c["copy"]["expert_bytes"] == c["base"]["expert_bytes"]


def test_error_grows_as_bits_fall(table):
    for row in table["layers"]:
        c = row["candidates"]
        errs = [c[q]["error"] for q in DONOR_TYPES]
        assert 0.0 < errs[0] < errs[1] < errs[2], (row["layer"], errs)
        sizes = [c[q]["expert_bytes"] for q in DONOR_TYPES]
        assert sizes[0] > sizes[1] > sizes[2]


LAYER = 2


@pytest.fixture(scope="module")
def captured(files):
    """Layer LAYER's MoE records of the reference forward pass over the same
    windows, captured with fle_engine's own capture."""
    import fle_engine
    from fle_engine.tokenizer import Tokenizer

    ids = Tokenizer.from_gguf(files["ref"]).encode(files["text"].read_text(encoding="utf-8"))[:N_TOKENS]
    model = fle_engine.load(files["ref"])
    with model.capturing() as cap:
        for s in range(0, N_TOKENS, CTX):
            model.logits(ids[s:s + CTX])
    recs = cap.layers[LAYER]
    assert len(recs) == N_TOKENS // CTX
    return recs


def _numpy_layer_error(recs, donor: Path, layer: int) -> float:
    """The error of ``layer`` with ``donor``'s experts, written out in NumPy:
    inputs, chosen experts, weights and the reference output from the
    capture; the donor's experts dequantized by gguf-py; the SwiGLU experts
    in float64."""
    x = np.concatenate([r.hidden.numpy() for r in recs]).astype(np.float64)
    chosen = np.concatenate([r.experts.numpy() for r in recs])
    w = np.concatenate([r.weights.numpy() for r in recs]).astype(np.float64)
    y_ref = np.concatenate([r.output.numpy() for r in recs]).astype(np.float64)
    assert all(r.shared_out is None for r in recs)    # qwen3moe: no shared expert

    reader = gguf.GGUFReader(donor)
    mats = {}
    for t in reader.tensors:
        for part in ("gate", "up", "down"):
            if t.name == f"blk.{layer}.ffn_{part}_exps.weight":
                mats[part] = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
    gate, up, down = mats["gate"], mats["up"], mats["down"]     # [E, F, D], [E, F, D], [E, D, F]

    y = np.zeros_like(y_ref)
    for t in range(x.shape[0]):
        for k in range(chosen.shape[1]):
            e = chosen[t, k]
            g = gate[e] @ x[t]
            h = g / (1.0 + np.exp(-g)) * (up[e] @ x[t])
            y[t] += w[t, k] * (down[e] @ h)
    return float(((y - y_ref) ** 2).sum() / (y_ref ** 2).sum())


@pytest.mark.parametrize("qtype", ["IQ4_NL", "IQ3_S"])
def test_error_matches_numpy(files, table, captured, qtype):
    want = _numpy_layer_error(captured, files[qtype], LAYER)
    got = next(r for r in table["layers"] if r["layer"] == LAYER)["candidates"][qtype]["error"]
    assert got == pytest.approx(want, rel=1e-4)


def test_expert_bytes_are_padded_tensor_sizes(files, table):
    for q in DONOR_TYPES:
        reader = gguf.GGUFReader(files[q])
        align = 32
        for row in table["layers"]:
            names = {f"blk.{row['layer']}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")}
            want = sum(-(-int(t.n_bytes) // align) * align for t in reader.tensors if t.name in names)
            assert row["candidates"][q]["expert_bytes"] == want


def test_table_feeds_select_and_the_splice_fits(files, table, tmp_path):
    tpath = tmp_path / "sens.json"
    tpath.write_text(json.dumps(table))
    parsed = parse_table(table)
    assert parsed.base == "base" and set(parsed.names) == {"base", "copy", "same", *DONOR_TYPES}
    # the all-base output: the base file plus at most the provenance reserve
    with GGUFModel.open(files["ref"]) as m:
        base_size = m.file_size
    assert 0 <= parsed.base_size_bytes - base_size <= table["reference"]["provenance_reserve_bytes"]

    # a target that forces about half the experts into small donors
    small = int(parsed.expert_bytes[:, parsed.names.index("IQ3_S")].sum())
    target = parsed.fixed_bytes + (int(parsed.expert_bytes[:, 0].sum()) + small) // 2
    sel_path = tmp_path / "sel.json"
    rc = select_main(["--sensitivity", str(tpath), "--target", str(target), "--step", "1000", "-o", str(sel_path)])
    assert rc == 0
    sel = load_selection(sel_path)
    assert sel.size_bytes <= target
    assert any(src != "base" for src in sel.sources.values())
    assert sel.sources == select_for_target(parsed, target, step_bytes=1000).sources
    donors = {n: files[n] for n in {*sel.sources.values()} - {"base"}}
    plan, written = splice(files["ref"], donors, sel_path, tmp_path / "out.gguf")
    out_size = sum(p.stat().st_size for p in written.paths)
    assert out_size <= sel.size_bytes
    assert sel.size_bytes - out_size <= table["reference"]["provenance_reserve_bytes"]


def test_separate_base_is_measured_like_a_donor(files, tmp_path, capsys):
    out = tmp_path / "t.json"
    rc = sens_main(["--ref", str(files["ref"]), "--base", str(files["IQ4_NL"]), "--base-name", "IQ4_NL",
                    "--donor", f"IQ3_S={files['IQ3_S']}", "--donor", f"Q8={files['Q8_0']}",
                    "--text", str(files["text"]), "--tokens", "128", "--ctx", "64", "-o", str(out)])
    assert rc == 0
    t = json.loads(out.read_text())
    parsed = parse_table(t, str(out))
    assert parsed.base == "IQ4_NL" and parsed.names == ("IQ4_NL", "IQ3_S", "Q8")
    for row in t["layers"]:
        c = row["candidates"]
        assert 0.0 < c["Q8"]["error"] < c["IQ4_NL"]["error"] < c["IQ3_S"]["error"]
    with GGUFModel.open(files["IQ4_NL"]) as m:
        base_size = m.file_size
    # the factory pads every tensor, so the base splits exactly into fixed and expert bytes
    reserve = provenance_reserve("IQ4_NL", ["IQ3_S", "Q8"], 4, 32)
    assert t["reference"]["provenance_reserve_bytes"] == reserve
    assert parsed.base_size_bytes == base_size + reserve
    assert "wrote" in capsys.readouterr().out


# ---------------------------------------------------------------------------
# bad input


def _run_bad(capsys, argv) -> str:
    rc = sens_main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("fle-sensitivity: error: ") and err.count("\n") == 1, err
    return err


def test_cli_bad_input(files, tmp_path, capsys):
    ref, text, out = str(files["ref"]), str(files["text"]), str(tmp_path / "t.json")
    common = ["--text", text, "-o", out, "--tokens", "64", "--ctx", "32"]
    assert "NAME=FILE" in _run_bad(capsys, ["--ref", ref, "--donor", str(files["Q8_0"]), *common])
    assert "no such file" in _run_bad(capsys, ["--ref", ref, "--donor", f"A={tmp_path / 'nope.gguf'}", *common])
    assert "twice" in _run_bad(capsys, ["--ref", ref, "--donor", f"A={files['Q8_0']}",
                                        "--donor", f"A={files['IQ3_S']}", *common])
    assert "base" in _run_bad(capsys, ["--ref", ref, "--donor", f"base={files['Q8_0']}", *common])
    assert "no candidates" in _run_bad(capsys, ["--ref", ref, *common])
    assert "fewer" in _run_bad(capsys, ["--ref", ref, "--donor", f"A={files['Q8_0']}", "--text", text, "-o", out,
                                        "--tokens", "100000"])
    assert "--ctx" in _run_bad(capsys, ["--ref", ref, "--donor", f"A={files['Q8_0']}", "--text", text, "-o", out,
                                        "--ctx", "0"])
    (tmp_path / "exists.json").write_text("{}")
    assert "--force" in _run_bad(capsys, ["--ref", ref, "--donor", f"A={files['Q8_0']}", "--text", text,
                                          "-o", str(tmp_path / "exists.json")])
    assert not (tmp_path / "t.json").exists()


def test_donor_of_another_shape_refused(files, tmp_path, capsys):
    other = make_model(tmp_path / "other.gguf", "qwen3moe", seed=SEED, mix="f32", expert_feed_forward_length=512)
    err = _run_bad(capsys, ["--ref", str(files["ref"]), "--donor", f"A={other}", "--text", str(files["text"]),
                            "-o", str(tmp_path / "t.json"), "--tokens", "64"])
    assert "expert_feed_forward_length" in err
    fewer = make_model(tmp_path / "fewer.gguf", "qwen3moe", seed=SEED, mix="f32", expert_count=4)
    with pytest.raises(FleError, match="expert_count"):
        measure(files["ref"], {"A": fewer}, files["text"], n_tokens=64)
    bad_text = tmp_path / "bin.txt"
    bad_text.write_bytes(b"\xff\xfe\x00 not text")
    with pytest.raises(FleError, match="UTF-8"):
        measure(files["ref"], {"A": files["Q8_0"]}, bad_text, n_tokens=64)
