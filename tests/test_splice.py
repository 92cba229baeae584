"""fle-splice on factory models: identity and whole-donor splices, a mixed
splice equal to the factory's own model in that per-layer mix, split input
and output, provenance, the digest cache, and bad input (each exit status 2,
one line on stderr, nothing left behind)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fle_quant import __version__
from fle_quant import digest
from fle_quant.cli.splice_cli import main as splice_main
from fle_quant.gguf_reader import GGUFModel
from fle_quant.gguf_writer import WritePlan, write_gguf
from fle_quant.select import Selection
from fle_quant.splice import PROVENANCE_PREFIX, plan_splice, splice
from fle_quant.synth import make_model

REPO = Path(__file__).resolve().parents[1]
N_LAYERS = 4
SIZE = dict(expert_count=4, expert_used_count=2)   # small and fast; IQ types need rows of 256
EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.")

# base and donors: the same seed, so the float weights are identical; donors
# store the non-expert tensors (router included) differently from the base,
# so taking any of them from a donor would show.
BASE_MIX = [(r"\.ffn_gate_inp\.weight$", "F32"), (r"_exps\.weight$", "IQ4_XS"), (r".", "Q8_0")]
A_MIX = [(r"\.ffn_gate_inp\.weight$", "F16"), (r"_exps\.weight$", "IQ3_S"), (r".", "F16")]
B_MIX = [(r"_exps\.weight$", "Q8_0")]
MIXED_SOURCES = {0: "base", 1: "A", 2: "B", 3: "base"}
# the factory writing the mixed model directly: per-layer rules, first match wins
DIRECT_MIX = [(r"\.ffn_gate_inp\.weight$", "F32"), (r"^blk\.1\.ffn_\w+_exps\.weight$", "IQ3_S"),
              (r"^blk\.2\.ffn_\w+_exps\.weight$", "Q8_0"), (r"_exps\.weight$", "IQ4_XS"), (r".", "Q8_0")]


def write_selection(path: Path, sources: dict[int, str], base: str = "base") -> Path:
    sel = Selection(mode="target", base=base, sources=dict(sources), layer_errors={k: 0.0 for k in sources},
                    layer_bytes={k: 0 for k in sources}, predicted_error=0.0, size_bytes=0, fixed_bytes=0,
                    step_bytes=1, table_sha256="0" * 64, base_size_bytes=0, base_error=0.0, target_bytes=1)
    path.write_text(json.dumps(sel.to_json()))
    return path


def read(path):
    """(tensors [(name, shape, type, bytes)] in file order, metadata, metadata types)."""
    with GGUFModel.open(path) as m:
        tensors = [(t.name, t.shape, t.qtype, bytes(m.tensor_bytes(t.name))) for t in m.tensors.values()]
        return tensors, dict(m.metadata), dict(m.metadata_types)


def without_provenance(d: dict) -> dict:
    return {k: v for k, v in d.items() if not k.startswith(PROVENANCE_PREFIX)}


def sha_file(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if ".fle-tmp-" in p.name)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Never touch the user's digest cache."""
    d = tmp_path / "fle-cache"
    monkeypatch.setenv("FLE_CACHE_DIR", str(d))
    return d


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    out = {}
    for name, mix in (("base", BASE_MIX), ("A", A_MIX), ("B", B_MIX), ("direct", DIRECT_MIX)):
        out[name] = make_model(d / f"{name}.gguf", "qwen3moe", seed=3, mix=mix, block_count=N_LAYERS, **SIZE)
    return out


def run_cli(argv, capsys):
    rc = splice_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------------------
# what the output holds


def test_every_layer_from_base_is_the_base(models, tmp_path, capsys):
    sel = write_selection(tmp_path / "sel.json", {i: "base" for i in range(N_LAYERS)})
    out = tmp_path / "out.gguf"
    rc, stdout, err = run_cli(["--base", models["base"], "--selection", sel, "-o", out], capsys)
    assert rc == 0, err
    assert err == ""
    bt, bmd, btypes = read(models["base"])
    ot, omd, otypes = read(out)
    assert ot == bt
    assert without_provenance(omd) == bmd and list(without_provenance(omd)) == list(bmd)
    assert without_provenance(otypes) == btypes
    assert omd[PROVENANCE_PREFIX + "layer_sources"] == ["base"] * N_LAYERS
    assert omd[PROVENANCE_PREFIX + "donors"] == []
    # the printed size is the file's
    assert f"{out.stat().st_size:,} bytes" in stdout


def test_every_layer_from_donor_takes_only_its_experts(models, tmp_path, capsys):
    sel = write_selection(tmp_path / "sel.json", {i: "A" for i in range(N_LAYERS)})
    out = tmp_path / "out.gguf"
    rc, _, err = run_cli(["--base", models["base"], "--donor", f"A={models['A']}", "--selection", sel, "-o", out],
                         capsys)
    assert rc == 0, err
    bt, bmd, _ = read(models["base"])
    at, _, _ = read(models["A"])
    ot, omd, _ = read(out)
    donor = {t[0]: t for t in at}
    assert [t[0] for t in ot] == [t[0] for t in bt]          # the base's order
    n_expert = 0
    for got, base in zip(ot, bt):
        if EXPERT_RE.match(got[0]):
            assert got == donor[got[0]]
            assert got[2].name == "IQ3_S"
            n_expert += 1
        else:
            assert got == base                                # router included: F32 in the base, F16 in A
    assert n_expert == 3 * N_LAYERS
    assert without_provenance(omd) == bmd
    assert omd[PROVENANCE_PREFIX + "layer_sources"] == ["A"] * N_LAYERS


def test_mixed_splice_equals_factory_mixed_model(models, tmp_path, capsys):
    sel = write_selection(tmp_path / "sel.json", MIXED_SOURCES)
    out = tmp_path / "out.gguf"
    rc, stdout, err = run_cli(["--base", models["base"], "--donor", f"A={models['A']}",
                               "--donor", f"B={models['B']}", "--selection", sel, "-o", out], capsys)
    assert rc == 0, err
    ot, _, _ = read(out)
    dt, _, _ = read(models["direct"])
    assert [t[:3] for t in ot] == [t[:3] for t in dt]
    for got, want in zip(ot, dt):
        assert got[3] == want[3], got[0]
    # the printed table names each layer's source and types
    rows = {int(l.split()[0]): l.split() for l in stdout.splitlines() if re.match(r"^\s+\d+\s", l)}
    assert {k: v[1] for k, v in rows.items()} == {k: v for k, v in MIXED_SOURCES.items()}
    assert rows[1][2:5] == ["IQ3_S"] * 3 and rows[2][2:5] == ["Q8_0"] * 3 and rows[0][2:5] == ["IQ4_XS"] * 3


def test_provenance_round_trips(models, tmp_path):
    sel = write_selection(tmp_path / "sel.json", MIXED_SOURCES)
    out = tmp_path / "out.gguf"
    plan, result = splice(models["base"], {"A": models["A"], "B": models["B"]}, sel, out)
    with GGUFModel.open(out) as m:
        md, types = m.metadata, m.metadata_types
        p = PROVENANCE_PREFIX
        assert md[p + "format"] == "fle.provenance/1"
        assert md[p + "fle_version"] == __version__
        assert md[p + "layer_sources"] == [MIXED_SOURCES[i] for i in range(N_LAYERS)]
        assert md[p + "base"] == "base" and md[p + "base_file"] == "base.gguf" and md[p + "base_shards"] == 1
        assert md[p + "base_sha256"] == sha_file(models["base"])
        assert md[p + "donors"] == ["A", "B"]
        assert md[p + "donor_files"] == ["A.gguf", "B.gguf"]
        assert md[p + "donor_sha256"] == [sha_file(models["A"]), sha_file(models["B"])]
        assert md[p + "selection_file"] == "sel.json"
        assert md[p + "selection_sha256"] == sha_file(sel)
        assert types[p + "layer_sources"][1].name == "STRING"
        # per-tensor digests of the write are those of the bytes in the file
        for name in ("blk.1.ffn_up_exps.weight", "output.weight"):
            assert result.sha256[name] == hashlib.sha256(bytes(m.tensor_bytes(name))).hexdigest()
    assert result.paths == [out] and out.stat().st_size == plan.out_size


def test_resplice_replaces_provenance(models, tmp_path):
    first = tmp_path / "first.gguf"
    splice(models["base"], {"A": models["A"]}, write_selection(tmp_path / "s1.json", {1: "A"}), first)
    sel2 = write_selection(tmp_path / "s2.json", {2: "B"}, base="spliced")
    second = tmp_path / "second.gguf"
    splice(first, {"B": models["B"]}, sel2, second)
    t1, md1, _ = read(first)
    t2, md2, _ = read(second)
    p = PROVENANCE_PREFIX
    assert md2[p + "layer_sources"] == ["spliced", "spliced", "B", "spliced"]
    assert md2[p + "base_file"] == "first.gguf" and md2[p + "base_sha256"] == sha_file(first)
    assert len([k for k in md2 if k.startswith(p)]) == len([k for k in md1 if k.startswith(p)])
    assert without_provenance(md2) == without_provenance(md1)
    # layer 1 still holds A's experts, layer 2 now B's
    names = [t[0] for t in t2]
    assert names == [t[0] for t in t1]
    types = {t[0]: t[2].name for t in t2}
    assert types["blk.1.ffn_gate_exps.weight"] == "IQ3_S" and types["blk.2.ffn_down_exps.weight"] == "Q8_0"


def test_split_input_and_output(models, tmp_path, capsys):
    # split copies of the base and of a donor, written from the single files
    src = tmp_path / "src"
    src.mkdir()
    shards = {}
    for name, n in (("base", 9), ("A", 14)):
        with GGUFModel.open(models[name]) as m:
            res = write_gguf(WritePlan.from_model(m), src / f"{name}.gguf", split_max_tensors=n, progress=False)
        assert len(res.paths) > 2
        shards[name] = res.paths
    sel = write_selection(tmp_path / "sel.json", {1: "A", 3: "A"})
    single = tmp_path / "single.gguf"
    rc, _, err = run_cli(["--base", models["base"], "--donor", f"A={models['A']}", "--selection", sel,
                          "-o", single], capsys)
    assert rc == 0, err
    out = tmp_path / "out.gguf"
    # any shard names the model; the output is split by size
    rc, stdout, err = run_cli(["--base", shards["base"][1], "--donor", f"A={shards['A'][-1]}", "--selection", sel,
                               "-o", out, "--split-max-size", "1.5MB"], capsys)
    assert rc == 0, err
    outs = sorted(tmp_path.glob("out-*-of-*.gguf"))
    assert len(outs) > 1 and not out.exists()
    assert f"in {len(outs)} shards, {sum(p.stat().st_size for p in outs):,} bytes" in stdout
    ts, smd, _ = read(single)
    to, omd, _ = read(outs[0])
    assert to == ts
    p = PROVENANCE_PREFIX
    assert omd[p + "base_shards"] == len(shards["base"]) and omd[p + "base_file"] == shards["base"][0].name
    # the logical digest of a split file: SHA-256 over the shards' raw digests in order
    want = hashlib.sha256(b"".join(hashlib.sha256(s.read_bytes()).digest() for s in shards["base"])).hexdigest()
    assert omd[p + "base_sha256"] == want
    assert omd[p + "donor_shards"] == [len(shards["A"])]
    assert without_provenance(omd) == without_provenance(smd)
    # split by tensor count as well
    out2 = tmp_path / "cnt.gguf"
    rc, _, err = run_cli(["--base", models["base"], "--donor", f"A={models['A']}", "--selection", sel,
                          "-o", out2, "--split-max-tensors", "20"], capsys)
    assert rc == 0, err
    assert read(sorted(tmp_path.glob("cnt-*-of-*.gguf"))[0])[0] == ts


def test_fused_gate_up_and_member_tensors(tmp_path):
    """Fused gate_up experts, a bias and a donor-only scale: the donor's
    group is taken whole, the router and shared expert stay the base's."""
    import numpy as np

    from fle_quant.gguf_format import GGUFValueType

    def model(path, exp_type, scale: bool):
        rng = np.random.default_rng(0)
        plan = WritePlan()
        plan.add_string("general.architecture", "qwen3moe")
        for k, v in (("block_count", 2), ("embedding_length", 32), ("expert_count", 2),
                     ("expert_feed_forward_length", 32)):
            plan.add(f"qwen3moe.{k}", v, GGUFValueType.UINT32)
        for il in range(2):
            p = f"blk.{il}."
            plan.add_tensor(p + "ffn_gate_inp.weight", [32, 2], "F32", rng.standard_normal((2, 32), np.float32))
            w = rng.standard_normal((2, 64, 32), np.float32)
            plan.add_tensor(p + "ffn_gate_up_exps.weight", [32, 64, 2], exp_type,
                            w if exp_type == "F32" else w.astype(np.float16))
            plan.add_tensor(p + "ffn_gate_up_exps.bias", [64, 2], "F32", rng.standard_normal((2, 64), np.float32))
            if scale:
                plan.add_tensor(p + "ffn_gate_up_exps.scale", [2], "F32", np.ones(2, np.float32))
            plan.add_tensor(p + "ffn_down_exps.weight", [32, 32, 2], "F32", rng.standard_normal((2, 32, 32), np.float32))
            plan.add_tensor(p + "ffn_down_shexp.weight", [32, 32], "F32", rng.standard_normal((32, 32), np.float32))
        return write_gguf(plan, path, progress=False).paths[0]

    base = model(tmp_path / "b.gguf", "F32", scale=False)
    donor = model(tmp_path / "d.gguf", "F16", scale=True)
    out = tmp_path / "o.gguf"
    plan, _ = splice(base, {"D": donor}, write_selection(tmp_path / "s.json", {0: "D", 1: "base"}), out)
    assert plan.layers[0].types == {"ffn_gate_up_exps": "F16", "ffn_down_exps": "F32"}
    ot, _, _ = read(out)
    bt = {t[0]: t for t in read(base)[0]}
    dt = {t[0]: t for t in read(donor)[0]}
    assert [t[0] for t in ot] == [
        "blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_up_exps.weight", "blk.0.ffn_gate_up_exps.bias",
        "blk.0.ffn_down_exps.weight", "blk.0.ffn_gate_up_exps.scale", "blk.0.ffn_down_shexp.weight",
        "blk.1.ffn_gate_inp.weight", "blk.1.ffn_gate_up_exps.weight", "blk.1.ffn_gate_up_exps.bias",
        "blk.1.ffn_down_exps.weight", "blk.1.ffn_down_shexp.weight"]
    for t in ot:
        from_donor = t[0].startswith("blk.0.") and "_exps." in t[0]
        assert t == (dt if from_donor else bt)[t[0]]
    # the other way round the base's scale is dropped with its group
    out2 = tmp_path / "o2.gguf"
    splice(donor, {"P": base}, write_selection(tmp_path / "s2.json", {1: "P"}), out2)
    names = [t[0] for t in read(out2)[0]]
    assert "blk.0.ffn_gate_up_exps.scale" in names and "blk.1.ffn_gate_up_exps.scale" not in names


def test_dry_run_writes_and_hashes_nothing(models, tmp_path, capsys, monkeypatch, cache_dir):
    calls = []
    real = digest._hash_file
    monkeypatch.setattr(digest, "_hash_file", lambda *a: calls.append(a[0]) or real(*a))
    sel = write_selection(tmp_path / "sel.json", MIXED_SOURCES)
    out = tmp_path / "out.gguf"
    argv = ["--base", models["base"], "--donor", f"A={models['A']}", "--donor", f"B={models['B']}",
            "--selection", sel, "-o", out]
    rc, dry, err = run_cli(argv + ["--dry-run"], capsys)
    assert rc == 0, err
    assert not out.exists() and calls == [] and not cache_dir.exists()
    rc, real_out, err = run_cli(argv, capsys)
    assert rc == 0, err
    assert f"{out.stat().st_size:,} bytes" in dry
    assert dry.strip() in real_out


# ---------------------------------------------------------------------------
# the digest cache


def test_digest_cache_hashes_each_file_once(models, tmp_path, capsys, monkeypatch, cache_dir):
    calls = []
    real = digest._hash_file
    monkeypatch.setattr(digest, "_hash_file", lambda *a: calls.append(Path(a[0]).name) or real(*a))
    sel = write_selection(tmp_path / "sel.json", MIXED_SOURCES)
    argv = ["--base", models["base"], "--donor", f"A={models['A']}", "--donor", f"B={models['B']}",
            "--selection", sel]
    rc, _, err = run_cli(argv + ["-o", tmp_path / "o1.gguf"], capsys)
    assert rc == 0, err
    assert sorted(calls) == ["A.gguf", "B.gguf", "base.gguf", "sel.json"]
    assert (cache_dir / "digests.json").is_file()
    calls.clear()
    rc, _, err = run_cli(argv + ["-o", tmp_path / "o2.gguf"], capsys)
    assert rc == 0, err
    assert calls == ["sel.json"]     # the selection is never cached; the models are
    assert read(tmp_path / "o1.gguf")[1] == read(tmp_path / "o2.gguf")[1]
    # a file whose modification time changed is hashed again
    copy = tmp_path / "base-copy.gguf"
    copy.write_bytes(models["base"].read_bytes())
    calls.clear()
    assert digest.sha256_file(copy) == sha_file(copy) and calls == ["base-copy.gguf"]
    assert digest.sha256_file(copy) == sha_file(copy) and calls == ["base-copy.gguf"]
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert digest.sha256_file(copy) == sha_file(copy) and calls == ["base-copy.gguf"] * 2
    # a corrupt cache is ignored and rewritten
    (cache_dir / "digests.json").write_text("{not json")
    calls.clear()
    assert digest.sha256_file(copy) == sha_file(copy) and calls == ["base-copy.gguf"]
    cached = json.loads((cache_dir / "digests.json").read_text())
    assert cached["format"] == "fle.digests/1"
    assert cached["files"][str(copy.resolve())]["sha256"] == sha_file(copy)
    assert not [p for p in cache_dir.iterdir() if p.name != "digests.json"]


def test_logical_digest_of_shards(tmp_path):
    parts = [tmp_path / f"p{i}" for i in range(3)]
    for i, p in enumerate(parts):
        p.write_bytes(bytes([i]) * (1000 + i))
    want = hashlib.sha256(b"".join(hashlib.sha256(p.read_bytes()).digest() for p in parts)).hexdigest()
    assert digest.sha256_model(parts, progress=False) == want
    assert digest.sha256_model(parts[:1], progress=False) == sha_file(parts[0])


# ---------------------------------------------------------------------------
# bad input: exit 2, one line on stderr, nothing written


def expect_error(capsys, argv, out_dir: Path, *patterns):
    before = sorted(p.name for p in out_dir.iterdir())
    rc, _, err = run_cli(argv, capsys)
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fle-splice: error: "), err
    for pat in patterns:
        assert re.search(pat, lines[0]), lines[0]
    assert sorted(p.name for p in out_dir.iterdir()) == before
    assert leftovers(out_dir) == []
    return lines[0]


def test_architecture_mismatch(models, tmp_path, capsys):
    other = make_model(tmp_path / "next.gguf", "qwen3next", mix="q8_0", block_count=N_LAYERS, **SIZE)
    sel = write_selection(tmp_path / "sel.json", {1: "N"})
    expect_error(capsys, ["--base", models["base"], "--donor", f"N={other}", "--selection", sel,
                          "-o", tmp_path / "out.gguf"], tmp_path, "next.gguf", "qwen3next", "qwen3moe")


def test_expert_hparam_mismatch(models, tmp_path, capsys):
    other = make_model(tmp_path / "ff.gguf", "qwen3moe", seed=3, mix="q8_0", block_count=N_LAYERS,
                       expert_feed_forward_length=512, **SIZE)
    sel = write_selection(tmp_path / "sel.json", {2: "F"})
    expect_error(capsys, ["--base", models["base"], "--donor", f"F={other}", "--selection", sel,
                          "-o", tmp_path / "out.gguf"], tmp_path, "expert_feed_forward_length", "512", "256",
                 "ff.gguf")


def test_tensor_shape_mismatch(models, tmp_path, capsys):
    # a donor whose metadata agrees with the base but whose experts do not
    narrow = make_model(tmp_path / "narrow.gguf", "qwen3moe", seed=3, mix="q8_0", block_count=N_LAYERS,
                        expert_feed_forward_length=512, **SIZE)
    with GGUFModel.open(narrow) as m:
        plan = WritePlan.from_model(m)
        plan.add_uint32("qwen3moe.expert_feed_forward_length", 256)
        liar = write_gguf(plan, tmp_path / "liar.gguf", progress=False).paths[0]
    sel = write_selection(tmp_path / "sel.json", {0: "base", 3: "L"})
    expect_error(capsys, ["--base", models["base"], "--donor", f"L={liar}", "--selection", sel,
                          "-o", tmp_path / "out.gguf"], tmp_path, r"blk\.3\.ffn_gate_exps\.weight",
                 r"\[256, 512, 4\]", r"\[256, 256, 4\]", "liar.gguf")


def test_donor_missing_from_command_line(models, tmp_path, capsys):
    sel = write_selection(tmp_path / "sel.json", {0: "base", 1: "A", 2: "C"})
    expect_error(capsys, ["--base", models["base"], "--donor", f"A={models['A']}", "--selection", sel,
                          "-o", tmp_path / "out.gguf"], tmp_path, "'C'", "--donor C=FILE", "layer")


def test_layer_not_in_base(models, tmp_path, capsys):
    sel = write_selection(tmp_path / "sel.json", {0: "A", N_LAYERS + 3: "A"})
    expect_error(capsys, ["--base", models["base"], "--donor", f"A={models['A']}", "--selection", sel,
                          "-o", tmp_path / "out.gguf"], tmp_path, f"layer {N_LAYERS + 3}", "base.gguf", "0-3")


def test_output_exists_without_force(models, tmp_path, capsys):
    sel = write_selection(tmp_path / "sel.json", {1: "A"})
    out = tmp_path / "out.gguf"
    out.write_bytes(b"keep me")
    argv = ["--base", models["base"], "--donor", f"A={models['A']}", "--selection", sel, "-o", out]
    expect_error(capsys, argv, tmp_path, "out.gguf", "exists", "--force")
    assert out.read_bytes() == b"keep me"
    rc, _, err = run_cli(argv + ["--force"], capsys)
    assert rc == 0, err
    assert read(out)[1][PROVENANCE_PREFIX + "layer_sources"][1] == "A"


@pytest.mark.parametrize("argv, pattern", [
    (["--donor", "A"], "NAME=FILE"),
    (["--donor", "base=x.gguf"], "is the selection's base"),
    (["--split-max-size", "lots"], "--split-max-size"),
    (["--split-max-tensors", "0"], "positive"),
])
def test_bad_arguments(models, tmp_path, capsys, argv, pattern):
    sel = write_selection(tmp_path / "sel.json", {1: "base"})
    expect_error(capsys, ["--base", models["base"], "--selection", sel, "-o", tmp_path / "out.gguf"] + argv,
                 tmp_path, pattern)


def test_output_would_overwrite_input(models, tmp_path, capsys):
    base = tmp_path / "b.gguf"
    base.write_bytes(models["base"].read_bytes())
    sel = write_selection(tmp_path / "sel.json", {1: "base"})
    expect_error(capsys, ["--base", base, "--selection", sel, "-o", base, "--force"], tmp_path, "overwrite an input")


def test_unused_donor_is_a_warning(models, tmp_path, capsys):
    sel = write_selection(tmp_path / "sel.json", {1: "A"})
    rc, _, err = run_cli(["--base", models["base"], "--donor", f"A={models['A']}", "--donor", f"B={models['B']}",
                          "--selection", sel, "-o", tmp_path / "out.gguf"], capsys)
    assert rc == 0
    assert err.strip() == "fle-splice: warning: donor 'B' is not used by the selection; ignored"
    assert read(tmp_path / "out.gguf")[1][PROVENANCE_PREFIX + "donors"] == ["A"]


def test_plan_api_raises_fle_error(models, tmp_path):
    from fle_quant.errors import FleError

    sel = write_selection(tmp_path / "sel.json", {1: "A"})
    with pytest.raises(FleError, match="not given"):
        plan_splice(models["base"], {}, sel, tmp_path / "o.gguf")


# ---------------------------------------------------------------------------
# disk full and interrupts, in a subprocess


def _env(cache: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["FLE_CACHE_DIR"] = str(cache)
    return env


_FSIZE = textwrap.dedent("""
    import resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    from fle_quant.cli.splice_cli import main
    sys.exit(main(sys.argv[1:]))
""")

# a real SIGINT, delivered while the third tensor is being copied
_SIGINT = textwrap.dedent("""
    import os, signal, sys
    # Python's own handler, also when this process inherited SIGINT ignored (a job started in the
    # background by a non-interactive shell)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from fle_quant import gguf_writer
    real = gguf_writer._Copier.copy_tensor
    n = [0]
    def copy_tensor(self, t, out):
        n[0] += 1
        if n[0] == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, t, out)
    gguf_writer._Copier.copy_tensor = copy_tensor
    from fle_quant.cli.splice_cli import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.parametrize("script, rc, pattern", [(_FSIZE, 2, "fle-splice: error: "),
                                                  (_SIGINT, 130, "fle-splice: interrupted")])
def test_disk_full_and_interrupt_leave_nothing(models, tmp_path, script, rc, pattern):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    sel = write_selection(tmp_path / "sel.json", MIXED_SOURCES)
    argv = ["--base", models["base"], "--donor", f"A={models['A']}", "--donor", f"B={models['B']}",
            "--selection", sel, "-o", out_dir / "out.gguf", "--split-max-size", "3MB"]
    r = subprocess.run([sys.executable, "-c", script] + [str(a) for a in argv], capture_output=True,
                       env=_env(tmp_path / "cache"), timeout=300)
    err = r.stderr.decode()
    assert r.returncode == rc, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(pattern), err
    assert rc != 2 or ": disk full" in lines[0], err
    assert list(out_dir.iterdir()) == []
