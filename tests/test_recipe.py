"""Release recipes: the shipped ones validate and agree with each other,
broken ones fail with the field named, and ``fle-recipe`` answers with the
right exit status. Set FLE_REPORT to the report's text file to also check
that every number a recipe attributes to the report appears in it."""
from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import pytest

from fle_quant.cli.recipe_cli import main as recipe_main
from fle_quant.errors import FleError
from fle_quant.recipe import (FORMAT, UNKNOWN, PruneStep, RequantStep, SelectStep, is_known, load_recipe,
                              parse_recipe)

SELECTIONS = Path(__file__).resolve().parent.parent / "selections"
SHIPPED = sorted(SELECTIONS.glob("*.recipe.json"))
RELEASES = {"FLE-IQ3_M", "FLE-IQ3_XXS", "FLE-IQ2_M", "FLE-IQ3_M-REAP448"}


def raw(name: str) -> dict:
    return json.loads((SELECTIONS / f"{name}.recipe.json").read_text(encoding="utf-8"))


def recipes() -> dict:
    return {r.name: r for r in (load_recipe(str(p)) for p in SHIPPED)}


# --- the shipped recipes ----------------------------------------------------

def test_every_release_has_a_recipe():
    assert {p.name.removesuffix(".recipe.json") for p in SHIPPED} == RELEASES


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_recipe_validates(path):
    r = load_recipe(str(path))
    assert path.name == f"{r.name}.recipe.json"
    kinds = [s.kind for s in r.steps]
    assert kinds == sorted(kinds, key=["select", "splice", "prune", "requant"].index)
    # unknown_paths lists exactly the fields that hold "unknown", none of them with a source
    obj = json.loads(path.read_text(encoding="utf-8"))
    assert set(r.unknown_paths) == {p for p, v in _leaves(obj) if v == UNKNOWN}
    assert not set(r.unknown_paths) & set(r.sources)


def test_fle_iq3_m_facts():
    r = recipes()["FLE-IQ3_M"]
    assert r.expected.file_size == "88.87 GB" and r.expected.donor_layers == 34
    assert r.expected.moe_layers == 48 and r.expected.per_layer == UNKNOWN
    assert r.base.size == "93.68 GB" and r.base.size_bytes == 93_680_000_000
    sel = r.step("select")
    assert sel.mode == "max_error" and sel.max_error == UNKNOWN and sel.step == "16 MB"
    assert sel.sensitivity.tokens == 4096
    assert set(sel.candidates) == {"IQ3_S", "IQ3_XXS"}


def test_recipes_agree_with_each_other():
    rs = recipes()
    base, reap = rs["FLE-IQ3_M"], rs["FLE-IQ3_M-REAP448"]
    # REAP448 is FLE-IQ3_M with pruned experts: same files, same selection and splice
    assert reap.base == base.base and reap.donors == base.donors
    assert reap.steps[:2] == base.steps[:2]
    prune = reap.step("prune")
    assert isinstance(prune, PruneStep) and prune.method == "REAP"
    assert prune.experts == base.expected.experts_per_layer == 512
    assert prune.keep == reap.expected.experts_per_layer == 448
    assert reap.expected.parameters_billions < base.expected.parameters_billions
    assert reap.expected.donor_layers == base.expected.donor_layers
    # the three files of the main release ship one MTP head, built the same way
    heads = [rs[n].step("requant") for n in ("FLE-IQ3_M", "FLE-IQ3_XXS", "FLE-IQ2_M")]
    assert all(isinstance(h, RequantStep) for h in heads)
    assert heads[0] == heads[1] == heads[2]
    assert heads[0].input.revision == "eb2a07ecb33b" and heads[0].to_type == "IQ4_NL"
    pattern = re.compile(heads[0].tensors)
    names = [f"blk.48.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
    assert all(pattern.search(n) for n in names)
    assert not pattern.search("blk.48.ffn_gate_inp.weight")
    assert not pattern.search("blk.47.ffn_up_exps.weight")
    assert heads[0].tensors_changed == len(names)
    assert reap.step("requant") is None
    # every MoE-layer model: same layer count and parameter count before pruning
    assert {r.expected.moe_layers for r in rs.values()} == {48}
    assert len({rs[n].expected.parameters_billions for n in ("FLE-IQ3_M", "FLE-IQ3_XXS", "FLE-IQ2_M")}) == 1
    # stages: smaller base, larger predicted error for the smaller one
    assert rs["FLE-IQ3_XXS"].expected.predicted_error < rs["FLE-IQ2_M"].expected.predicted_error
    for n in ("FLE-IQ3_XXS", "FLE-IQ2_M"):
        sel = rs[n].step("select")
        assert isinstance(sel, SelectStep) and sel.mode == "target"
        assert rs[n].base.repo == "ISTA-DASLab/Qwen3.8-Flash-Next-GSQ-RCO-GGUF"


def test_splice_regex_selects_exactly_the_expert_tensors():
    r = recipes()["FLE-IQ3_M"]
    pattern = re.compile(r.step("splice").tensors)
    for name in ("blk.7.ffn_gate_exps.weight", "blk.7.ffn_up_exps.weight", "blk.7.ffn_down_exps.weight"):
        assert pattern.search(name)
    for name in ("blk.7.ffn_gate_inp.weight", "blk.7.ffn_up_shexp.weight", "blk.7.attn_q.weight",
                 "per_layer_token_embd.weight", "blk.7.exp_probs_b.bias"):
        assert not pattern.search(name)


_NUM = re.compile(r"(?<![A-Za-z_\d.])\d[\d,]*(?:\.\d+)?")


def _numbers(text: str) -> set[float]:
    out = set()
    for m in _NUM.finditer(text):
        s = m.group(0).rstrip(",")
        if re.fullmatch(r"\d{1,3}(,\d{3})+(\.\d+)?", s):
            s = s.replace(",", "")
        elif "," in s:
            s = s.split(",")[0]
        out.add(round(float(s), 6))
    return out


def _leaves(node, path=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{path}.{k}" if path else k)
    elif isinstance(node, list) and not all(isinstance(x, str) for x in node):
        for i, v in enumerate(node):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, node


def test_numbers_parser():
    assert _numbers("1,528,277,056 bytes, 256 × 2,048 tokens, 88.87 GB, Q8_0, 32k, −0.0035") == \
        {1528277056.0, 256.0, 2048.0, 88.87, 32.0, 0.0035}


def test_report_numbers_appear_in_report():
    report_path = os.environ.get("FLE_REPORT")
    if not report_path or not os.path.isfile(report_path):
        pytest.skip("set FLE_REPORT to the report's text file to cross-check the recipes against it")
    text = Path(report_path).read_text(encoding="utf-8")
    in_report = _numbers(text)
    checked = 0
    for path in SHIPPED:
        r = load_recipe(str(path))
        obj = json.loads(path.read_text(encoding="utf-8"))
        claims = []
        for leaf, value in _leaves({k: obj[k] for k in obj if k not in ("sources", "notes", "description")}):
            src = r.source_of(leaf)
            if not (src and src.startswith("report") and is_known(value)):
                continue
            if leaf.endswith((".revision", ".file_pattern")):
                assert value in text, f"{path.name}: {leaf} = {value!r} is not in the report"
            claims.append((leaf, str(value)))
        claims += [(f"notes[{i}]", n["text"]) for i, n in enumerate(obj["notes"])
                   if n["source"].startswith("report")]
        for leaf, value in claims:
            for number in _numbers(value):
                checked += 1
                assert number in in_report, f"{path.name}: {leaf}: {number} is not in the report"
    assert checked > 50


# --- broken recipes ---------------------------------------------------------

def _mutate(name, fn):
    obj = copy.deepcopy(raw(name))
    fn(obj)
    return obj


def _fails(obj, *fragments):
    with pytest.raises(FleError) as e:
        parse_recipe(obj, "x.recipe.json")
    msg = str(e.value)
    assert msg.startswith("x.recipe.json: ")
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, msg
    return msg


def _del(path_keys):
    def fn(o):
        node = o
        for k in path_keys[:-1]:
            node = node[k]
        del node[path_keys[-1]]
    return fn


def _set(path_keys, value):
    def fn(o):
        node = o
        for k in path_keys[:-1]:
            node = node[k]
        node[path_keys[-1]] = value
    return fn


MUTATIONS = [
    # (id, recipe, mutation, fragments the message must contain)
    ("missing-key", "FLE-IQ3_M", _del(["expected", "donor_layers"]), ["expected.donor_layers", "missing"]),
    ("missing-top", "FLE-IQ3_M", _del(["steps"]), ["steps", "missing"]),
    ("missing-step-key", "FLE-IQ3_M", _del(["steps", 0, "step"]), ["steps[0].step", "missing"]),
    ("unknown-key", "FLE-IQ3_M", _set(["base", "revison"], "unknown"), ["base.revison", "unknown key"]),
    ("unknown-step-key", "FLE-IQ3_M-REAP448", _set(["steps", 2, "kep"], 448), ["steps[2].kep", "unknown key"]),
    ("bad-type-name", "FLE-IQ3_M", _set(["steps", 2, "to_type"], "IQ4_NLX"), ["steps[2].to_type", "IQ4_NLX"]),
    ("type-as-number", "FLE-IQ3_M", _set(["steps", 2, "to_type"], 20), ["steps[2].to_type"]),
    ("bad-regex", "FLE-IQ3_M", _set(["steps", 2, "tensors"], "blk\\.48\\.ffn_(gate|up"),
     ["steps[2].tensors", "regular expression"]),
    ("bad-splice-regex", "FLE-IQ3_M", _set(["steps", 1, "tensors"], "ffn_[exps"), ["steps[1].tensors"]),
    ("bad-size", "FLE-IQ3_M", _set(["expected", "file_size"], "88.87 GiBB"), ["expected.file_size", "88.87 GiBB"]),
    ("size-as-number", "FLE-IQ3_M", _set(["base", "size"], 93.68), ["base.size", "size string"]),
    ("bad-step-size", "FLE-IQ2_M", _set(["steps", 0, "step"], "sixteen MB"), ["steps[0].step"]),
    ("wrong-order", "FLE-IQ3_M-REAP448", lambda o: o["steps"].insert(0, o["steps"].pop(2)),
     ["steps[1]", "out of order", "select -> splice -> prune -> requant"]),
    ("twice", "FLE-IQ3_M", lambda o: o["steps"].insert(2, copy.deepcopy(o["steps"][1])),
     ["steps[2]", "out of order"]),
    ("keep-zero", "FLE-IQ3_M-REAP448", _set(["steps", 2, "keep"], 0), ["steps[2].keep", "positive integer"]),
    ("keep-float", "FLE-IQ3_M-REAP448", _set(["steps", 2, "keep"], 448.0), ["steps[2].keep", "positive integer"]),
    ("keep-bool", "FLE-IQ3_M-REAP448", _set(["steps", 2, "keep"], True), ["steps[2].keep"]),
    ("keep-unknown", "FLE-IQ3_M-REAP448", _set(["steps", 2, "keep"], "unknown"), ["steps[2].keep", "must be known"]),
    ("keep-all", "FLE-IQ3_M-REAP448", _set(["steps", 2, "keep"], 512), ["steps[2].keep", "fewer"]),
    ("keep-vs-expected", "FLE-IQ3_M-REAP448", _set(["steps", 2, "keep"], 384), ["expected.experts_per_layer"]),
    ("bad-kind", "FLE-IQ3_M", _set(["steps", 1, "kind"], "merge"), ["steps[1].kind", "merge"]),
    ("bad-mode", "FLE-IQ3_M", _set(["steps", 0, "mode"], "size"), ["steps[0].mode"]),
    ("target-in-error-mode", "FLE-IQ3_M", _set(["steps", 0, "target"], "88.87 GB"), ["steps[0].target"]),
    ("select-without-splice", "FLE-IQ3_M", lambda o: o["steps"].pop(1), ["steps[0]", "splice"]),
    ("candidate-not-donor", "FLE-IQ3_M", _set(["steps", 0, "candidates"], ["IQ3_S", "IQ2_XS"]),
     ["steps[0].candidates[1]", "IQ2_XS"]),
    ("donor-unused", "FLE-IQ3_M", _set(["steps", 0, "candidates"], ["IQ3_S"]), ["donors.IQ3_XXS"]),
    ("donor-name-mismatch", "FLE-IQ3_M", _set(["donors", "IQ3_S", "name"], "IQ3_M"), ["donors.IQ3_S.name"]),
    ("bad-repo", "FLE-IQ3_M", _set(["base", "repo"], "unsloth"), ["base.repo", "owner/name"]),
    ("bad-revision", "FLE-IQ3_M", _set(["steps", 2, "input", "revision"], "main"),
     ["steps[2].input.revision"]),
    ("bad-pattern", "FLE-IQ3_M", _set(["base", "file_pattern"], "UD-IQ4_XS/x.gguf"), ["base.file_pattern"]),
    ("negative-error", "FLE-IQ2_M", _set(["expected", "predicted_error"], -1.0), ["expected.predicted_error"]),
    ("tokens-string", "FLE-IQ3_M", _set(["steps", 0, "sensitivity", "tokens"], "4096"),
     ["steps[0].sensitivity.tokens"]),
    ("donors-over-layers", "FLE-IQ3_M", _set(["expected", "donor_layers"], 49), ["expected.donor_layers"]),
    ("per-layer-incomplete", "FLE-IQ3_M", _set(["expected", "per_layer"], {"0": "IQ3_S"}),
     ["expected.per_layer"]),
    ("per-layer-bad-source", "FLE-IQ3_M", _set(["expected", "per_layer"], {"0": "Q2_0"}),
     ["expected.per_layer.0", "Q2_0"]),
    ("known-without-source", "FLE-IQ3_M", _del(["sources", "expected.file_size"]),
     ["expected.file_size", "no source"]),
    ("source-for-unknown", "FLE-IQ3_M", _set(["sources", "expected.per_layer"], "report §3"),
     ["sources.expected.per_layer", "unknown"]),
    ("source-for-nothing", "FLE-IQ3_M", _set(["sources", "expected.size"], "report §3"),
     ["sources.expected.size", "names no field"]),
    ("bad-format", "FLE-IQ3_M", _set(["format"], "fle.recipe/2"), ["format", FORMAT]),
    ("note-without-source", "FLE-IQ3_M", lambda o: o["notes"][0].pop("source"), ["notes[0].source", "missing"]),
]


@pytest.mark.parametrize("name,mutation,fragments", [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS])
def test_broken_recipe_names_the_field(name, mutation, fragments):
    _fails(_mutate(name, mutation), *fragments)


def test_per_layer_list_is_checked_against_donor_count():
    def fill(o):
        o["expected"]["per_layer"] = {str(i): ("IQ3_S" if i < 34 else "UD-IQ4_XS") for i in range(48)}
        o["sources"]["expected.per_layer"] = "model card"
    parse_recipe(_mutate("FLE-IQ3_M", fill), "x.recipe.json")  # consistent: accepted

    def off_by_one(o):
        fill(o)
        o["expected"]["per_layer"]["40"] = "IQ3_XXS"
    _fails(_mutate("FLE-IQ3_M", off_by_one), "expected.per_layer", "35", "34")


def test_enclosing_source_covers_its_fields():
    def fn(o):
        for k in list(o["sources"]):
            if k.startswith("steps[2]."):
                del o["sources"][k]
        o["sources"]["steps[2]"] = "report §4.3"
    r = parse_recipe(_mutate("FLE-IQ3_M", fn), "x.recipe.json")
    assert r.source_of("steps[2].input.revision") == "report §4.3"


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(FleError, match="missing.recipe.json: no such file"):
        load_recipe(str(tmp_path / "missing.recipe.json"))
    bad = tmp_path / "bad.recipe.json"
    bad.write_text('{"format": "fle.recipe/1",\n  "name": }', encoding="utf-8")
    with pytest.raises(FleError, match=r"bad.recipe.json: line 2 column \d+: not valid JSON"):
        load_recipe(str(bad))
    bad.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(FleError, match="bad.recipe.json: must hold one JSON object"):
        load_recipe(str(bad))


# --- fle-recipe -------------------------------------------------------------

def test_cli_validate_shipped(capsys):
    assert recipe_main(["validate", *map(str, SHIPPED)]) == 0
    out = capsys.readouterr().out
    assert out.count("OK ") == len(SHIPPED)
    assert recipe_main(["validate", str(SELECTIONS)]) == 0
    assert capsys.readouterr().out.count("OK ") == len(SHIPPED)


def test_cli_validate_reports_every_file_and_fails(tmp_path, capsys):
    bad = tmp_path / "FLE-bad.recipe.json"
    bad.write_text(json.dumps(_mutate("FLE-IQ3_M-REAP448", _set(["steps", 2, "keep"], 0))), encoding="utf-8")
    good = str(SHIPPED[0])
    assert recipe_main(["validate", str(bad), good]) == 2
    cap = capsys.readouterr()
    assert f"OK {good}" in cap.out
    assert cap.err.count("\n") == 1
    assert cap.err.startswith(f"fle-recipe: error: {bad}: steps[2].keep")
    assert recipe_main(["validate", str(tmp_path / "nope.recipe.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert recipe_main(["validate", str(empty)]) == 2
    assert "no *.recipe.json" in capsys.readouterr().err


def test_cli_show_plan(capsys):
    assert recipe_main(["show", str(SELECTIONS / "FLE-IQ3_M-REAP448.recipe.json")]) == 0
    out = capsys.readouterr().out
    assert "hf download unsloth/Qwen3.8-Flash-Next-GGUF --include 'UD-IQ4_XS/" in out
    assert out.count("hf download ISTA-DASLab/Qwen3.8-Flash-Next-GSQ-RCO-GGUF") == 2
    # commands in the order of the steps, unknowns flagged
    order = [out.index(c) for c in ("fle-sensitivity --ref ", "fle-select ", "fle-splice ", "fle-reap score ",
                                    "fle-reap prune ")]
    assert order == sorted(order)
    assert "--max-error <UNKNOWN>" in out and "--keep 448" in out and "--step 16MB" in out
    assert "--method reap" in out and "--tokens 524288 --ctx 2048" in out
    assert "not part of this FLE version" not in out  # every step's tool exists
    r = load_recipe(str(SELECTIONS / "FLE-IQ3_M-REAP448.recipe.json"))
    tail = out[out.index("Unknown ("):]
    assert all(p in tail for p in r.unknown_paths)
    assert "161.84" in out and "[report §3]" in out


def test_cli_show_pinned_revision_and_requant(capsys):
    assert recipe_main(["show", str(SELECTIONS / "FLE-IQ3_M.recipe.json"), "--models-dir", "m"]) == 0
    out = capsys.readouterr().out
    assert "--revision eb2a07ecb33b" in out
    assert "--local-dir m/unsloth__Qwen3.8-Flash-Next-GGUF" in out
    assert "fle-requant m/unsloth__Qwen3.8-Flash-Next-GGUF/MTP/mtp-Qwen3.8-Flash-Next-shared-Q8_0.gguf" in out
    assert "--type IQ4_NL" in out
    assert "88.87 GB" in out


def test_cli_show_bad_input(tmp_path, capsys):
    assert recipe_main(["show", str(tmp_path / "nope.json")]) == 2
    assert capsys.readouterr().err.startswith("fle-recipe: error: ")


def test_cli_help_and_usage(capsys):
    for argv in (["--help"], ["validate", "--help"], ["show", "--help"]):
        with pytest.raises(SystemExit) as e:
            recipe_main(argv)
        assert e.value.code == 0
    assert "select -> splice -> prune -> requant" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit) as e:
        recipe_main([])
    assert e.value.code == 2
