"""fle-card on spliced factory models: front matter that parses, a per-layer
table that matches the provenance, sizes equal to fle-inspect's, quality
numbers only when given, and bad input answered with exit status 2."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fle_quant.cli.card_cli import main as card_main
from fle_quant.cli.inspect_cli import main as inspect_main
from fle_quant.gguf_reader import GGUFModel
from fle_quant.gguf_writer import WritePlan, write_gguf
from fle_quant.select import Selection
from fle_quant.splice import splice
from fle_quant.synth import make_model

SOURCES = {0: "Q8", 1: "F16", 2: "Q8", 3: "F16"}


def write_selection(path: Path, sources: dict[int, str], base: str) -> Path:
    sel = Selection(mode="target", base=base, sources=dict(sources), layer_errors={k: 0.0 for k in sources},
                    layer_bytes={k: 0 for k in sources}, predicted_error=0.0, size_bytes=0, fixed_bytes=0,
                    step_bytes=1, table_sha256="0" * 64, base_size_bytes=0, base_error=0.0, target_bytes=1)
    path.write_text(json.dumps(sel.to_json()))
    return path


@pytest.fixture(scope="module")
def spliced(tmp_path_factory):
    d = tmp_path_factory.mktemp("card")
    mp = pytest.MonkeyPatch()
    mp.setenv("FLE_CACHE_DIR", str(d / "cache"))
    try:
        kw = dict(seed=5, block_count=4, expert_count=4, expert_used_count=2)
        base = make_model(d / "base.gguf", "qwen3moe", mix="q8_0", **kw)
        donor = make_model(d / "donor.gguf", "qwen3moe", mix=[(r"_exps\.weight$", "F16")], **kw)
        # a base as converted from Hugging Face: license and source repository in its metadata
        with GGUFModel.open(base) as m:
            plan = WritePlan.from_model(m)
        plan.add_string("general.license", "apache-2.0")
        plan.add_string("general.source.repo_url", "https://huggingface.co/Example/Model-30B-A3B")
        licensed = write_gguf(plan, d / "licensed.gguf", progress=False).paths[0]
        out = d / "spliced.gguf"
        splice(base, {"F16": donor}, write_selection(d / "sel.json", SOURCES, "Q8"), out)
        out2 = d / "spliced-hf.gguf"
        splice(licensed, {"F16": donor}, write_selection(d / "sel2.json", SOURCES, "Q8"), out2,
               split_max_tensors=20)
    finally:
        mp.undo()
    return {"plain": out, "hf": sorted(d.glob("spliced-hf-*-of-*.gguf"))}


def run(argv, capsys):
    rc = card_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def front_matter(text: str) -> dict:
    """A parser for the YAML subset the cards use (``key: scalar``, ``key:``
    followed by ``- item`` lines, double-quoted or plain scalars); refuses
    anything else, so the test fails on output outside that subset."""
    lines = text.split("\n")
    assert lines[0] == "---", lines[0]
    end = lines.index("---", 1)
    out: dict = {}
    key = None

    def scalar(s: str):
        s = s.strip()
        return json.loads(s) if s.startswith('"') else s

    for line in lines[1:end]:
        m = re.fullmatch(r"([A-Za-z_][\w-]*):(?: (.+))?", line)
        if m:
            key = m.group(1)
            assert key not in out, f"duplicate key {key}"
            out[key] = scalar(m.group(2)) if m.group(2) is not None else []
            continue
        m = re.fullmatch(r"- (.+)", line)
        assert m and key is not None and isinstance(out[key], list), f"not in the YAML subset: {line!r}"
        out[key].append(scalar(m.group(1)))
    return out


def table(text: str, heading: str) -> list[list[str]]:
    """Rows of the first Markdown table after ``## heading``."""
    part = text.split(f"## {heading}\n", 1)[1]
    rows = [l for l in part.split("\n## ", 1)[0].splitlines() if l.startswith("|")]
    return [[c.strip() for c in r.strip("|").split(" | ")] for r in rows[2:]]


def inspect_json(path, capsys) -> dict:
    assert inspect_main([str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_card_of_spliced_file(spliced, tmp_path, capsys):
    out = tmp_path / "cards" / "Model-FLE-Test.md"
    rc, _, err = run([spliced["plain"], "-o", out], capsys)
    assert rc == 0, err
    text = out.read_text()
    fm = front_matter(text)
    assert fm["license"] == "other" and "base_model" not in fm
    assert fm["tags"] == ["gguf", "moe", "fle", "qwen3moe"]
    assert "# Model-FLE-Test\n" in text and "general.license" in text
    try:
        import yaml
    except ImportError:
        pass
    else:
        assert yaml.safe_load(text.split("---\n")[1]) == fm

    with GGUFModel.open(spliced["plain"]) as m:
        md = m.metadata
    sources = md["fle.provenance.layer_sources"]
    info = inspect_json(spliced["plain"], capsys)
    rows = table(text, "Expert layers")
    assert [int(r[0]) for r in rows] == [l["index"] for l in info["layers"]] == list(range(4))
    for r, layer in zip(rows, info["layers"]):
        assert r[1] == sources[layer["index"]] == SOURCES[layer["index"]]
        assert r[2:5] == [layer["expert_types"][p] for p in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]
        assert r[2] == ("Q8_0" if r[1] == "Q8" else "F16")
        assert int(r[5].replace(",", "")) == layer["expert_bytes"]

    size = dict((r[0], r[1]) for r in table(text, "Size"))
    assert size["file size"].startswith(f"{info['file_size']:,} bytes")
    assert size["bits per weight"] == f"{info['bits_per_weight']:.3f}"
    assert size["weights"] == f"{info['n_params']:,}"
    assert size["routed experts"].startswith(f"{info['expert_bytes']:,} bytes")

    prov = table(text, "Provenance")
    assert prov[0] == ["Q8", "base", "`base.gguf`", "1", f"`{md['fle.provenance.base_sha256']}`"]
    assert prov[1] == ["F16", "donor", "`donor.gguf`", "1", f"`{md['fle.provenance.donor_sha256'][0]}`"]
    assert md["fle.provenance.selection_sha256"] in text
    assert "## Quality" not in text

    # regenerated from the same inputs, the card is the same file
    again = tmp_path / "again.md"
    assert run([spliced["plain"], "-o", again, "--name", "Model-FLE-Test"], capsys)[0] == 0
    assert again.read_text() == text


def test_card_with_license_source_shards_and_quality(spliced, tmp_path, capsys):
    q = tmp_path / "kld.json"
    q.write_text(json.dumps({"format": "fle.quality/1", "reference": "the BF16 model",
                             "texts": {"E": {"mean_kld": 0.0123, "kld_se": 0.0004, "top1": 0.953, "n_tokens": 4096},
                                       "code": {"mean_kld": 0.02}}}))
    out = tmp_path / "c.md"
    rc, _, err = run([spliced["hf"][-1], "-o", out, "--quality", q, "--name", "Example"], capsys)
    assert rc == 0, err
    text = out.read_text()
    fm = front_matter(text)
    assert fm["license"] == "apache-2.0"
    assert fm["base_model"] == "Example/Model-30B-A3B" and fm["base_model_relation"] == "quantized"
    files = table(text, "Files")
    assert [r[0] for r in files] == [f"`{p.name}`" for p in spliced["hf"]]
    assert [int(r[1].replace(",", "")) for r in files] == [p.stat().st_size for p in spliced["hf"]]
    size = dict((r[0], r[1]) for r in table(text, "Size"))
    assert size["file size"].startswith(f"{sum(p.stat().st_size for p in spliced['hf']):,} bytes")
    quality = table(text, "Quality")
    assert quality == [["E", "0.012300 ± 0.000400", "95.30 %", "4,096"], ["code", "0.020000", "-", "-"]]
    assert "the BF16 model" in text


@pytest.mark.parametrize("quality, pattern", [
    ({"texts": {"E": {"mean_kld": 0.1, "topl": 0.9}}}, "unknown key 'topl'"),
    ({"texts": {"E": {"kld_se": 0.1}}}, "no \"mean_kld\""),
    ({"texts": {"E": {"mean_kld": 0.1, "top1": 95.3}}}, "top1"),
    ({"texts": {}}, "non-empty"),
    ("[1, 2", "not valid JSON"),
])
def test_bad_quality(spliced, tmp_path, capsys, quality, pattern):
    q = tmp_path / "q.json"
    q.write_text(quality if isinstance(quality, str) else json.dumps(quality))
    out = tmp_path / "card.md"
    rc, _, err = run([spliced["plain"], "-o", out, "--quality", q], capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fle-card: error: ") and pattern in lines[0], err
    assert not out.exists()


def test_bad_inputs(spliced, tmp_path, capsys):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    out = tmp_path / "card.md"
    for argv, pattern in (([junk, "-o", out], "junk.gguf"),
                          ([tmp_path / "none.gguf", "-o", out], "no such file")):
        rc, _, err = run(argv, capsys)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and pattern in err, err
        assert not out.exists()
    out.write_text("keep")
    rc, _, err = run([spliced["plain"], "-o", out], capsys)
    assert rc == 2 and "exists" in err and "--force" in err
    assert out.read_text() == "keep"
    rc, _, err = run([spliced["plain"], "-o", out, "--force"], capsys)
    assert rc == 0, err
    assert out.read_text().startswith("---\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["card.md", "junk.gguf"]


# ---------------------------------------------------------------------------
# cards from the release recipes (model-cards/ is generated, never edited)

REPO = Path(__file__).resolve().parent.parent
RELEASES = ["FLE-IQ3_M", "FLE-IQ3_XXS", "FLE-IQ2_M", "FLE-IQ3_M-REAP448"]
# a figure: a number standing on its own, not part of a name such as IQ3_S or Qwen3.8
_NUMBER = re.compile(r"(?<![\w.\-])[+\-−]?\d[\d,.]*(?![\w])")


def _recipe_card(name, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / f"{name}.md"
    assert card_main(["--recipe", f"selections/{name}.recipe.json", "-o", str(out)]) == 0
    return out.read_text()


@pytest.mark.parametrize("name", RELEASES)
def test_release_cards_are_generated(name, tmp_path, monkeypatch, capsys):
    text = _recipe_card(name, tmp_path, monkeypatch)
    shipped = (REPO / "model-cards" / f"{name}.md").read_text()
    assert shipped == text, (f"model-cards/{name}.md differs from what fle-card makes now; regenerate it: "
                             f"fle-card --recipe selections/{name}.recipe.json -o model-cards/{name}.md --force")


@pytest.mark.parametrize("name", RELEASES)
def test_release_card_front_matter_and_sources(name, tmp_path, monkeypatch):
    yaml = pytest.importorskip("yaml")
    text = (REPO / "model-cards" / f"{name}.md").read_text()
    assert text.startswith("---\n")
    head, body = text[4:].split("\n---\n", 1)
    fm = yaml.safe_load(head)
    assert set(fm) >= {"base_model", "license", "tags", "quantized_by"}
    assert fm["license"] == "other" and fm["license_name"] == "qwen-community-license-1-0"
    assert {"gguf", "moe", "fle"} <= set(fm["tags"])
    assert all(isinstance(b, str) and "/" in b for b in fm["base_model"])
    assert f"fle-build selections/{name}.recipe.json" in body
    assert "not re-measured" in body
    # every figure names its source: a table row has a source cell, other text a [source] marker
    in_code = False
    for line in body.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        plain = re.sub(r"`[^`]*`", "", re.sub(r"^\d+\. ", "", line))  # step numbers are no figures
        if in_code or not _NUMBER.search(plain) or line.startswith("|---"):
            continue
        if line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            if cells[0] == "layer" or cells[0].isdigit():  # per-layer table: source given below it
                continue
            assert cells[-1] not in ("", "-", "not stated"), f"{name}: figure without a source: {line}"
        else:
            assert re.search(r"\[[^\]]*(report|listing|recipe)[^\]]*\]\s*$", line), \
                f"{name}: figure without a source: {line}"


def test_recipe_card_bad_input(tmp_path, capsys):
    rc, _, err = run(["--recipe", tmp_path / "missing.recipe.json", "-o", tmp_path / "c.md"], capsys)
    assert rc == 2 and "missing.recipe.json" in err and err.count("\n") == 1
    rc, _, err = run(["-o", tmp_path / "c.md"], capsys)
    assert rc == 2 and "--recipe" in err
    rc, _, err = run(["--recipe", REPO / "selections/FLE-IQ3_M.recipe.json", "--quality", "q.json",
                      "-o", tmp_path / "c.md"], capsys)
    assert rc == 2 and "--quality" in err
