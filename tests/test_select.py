"""The layer-selection knapsack: optimality against brute force on small
instances, speed on a realistic one, and the errors users meet."""
from __future__ import annotations

import copy
import hashlib
import itertools
import json
import os
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fle_quant.cli.select_cli import main as select_main
from fle_quant.errors import FleError
from fle_quant.select import (format_selection, load_selection, load_table, parse_selection, parse_table,
                              select_for_error, select_for_target)
from fle_quant.units import format_size

BASE = "Q4_K_M"


def table_obj(rows, base=BASE, fixed=1000, alignment=32):
    """rows: one dict NAME -> (error, expert_bytes) per layer, layers 0..n-1."""
    return {
        "format": "fle.sensitivity/1",
        "reference": {"file": "ref.gguf", "tokens": 4096},
        "base": base,
        "fixed_bytes": fixed,
        "alignment": alignment,
        "layers": [{"layer": i, "candidates": {n: {"error": e, "expert_bytes": b} for n, (e, b) in row.items()}}
                   for i, row in enumerate(rows)],
    }


def brute_force(table):
    """Every selection as (picks, summed error in layer order, exact bytes, per-layer bytes)."""
    per_layer = [np.flatnonzero(table.available[i]) for i in range(len(table.layers))]
    for picks in itertools.product(*per_layer):
        err = 0.0
        for i, j in enumerate(picks):
            err += float(table.errors[i, j])
        nb = [int(table.expert_bytes[i, j]) for i, j in enumerate(picks)]
        yield picks, err, table.fixed_bytes + sum(nb), nb


def rounded_steps(nb, step):
    return sum(-(-b // step) for b in nb)


def check_consistent(sel, table):
    assert list(sel.sources) == list(table.layers)
    assert sel.size_bytes == table.fixed_bytes + sum(sel.layer_bytes.values())
    for i, layer in enumerate(table.layers):
        j = table.names.index(sel.sources[layer])
        assert table.available[i, j]
        assert sel.layer_errors[layer] == table.errors[i, j]
        assert sel.layer_bytes[layer] == table.expert_bytes[i, j]
    assert parse_selection(json.loads(json.dumps(sel.to_json()))) == sel


# errors from a small dyadic set make exact ties common (sums stay exact), so
# the tie rule is exercised; arbitrary floats cover the rest
# Errors on a dyadic grid: sums of a few of them are exact in float64, so two
# selections tie exactly when their errors do (with arbitrary floats, 0.125 +
# 1e-154 == 0.125 and the brute force would see ties the exact answer has not).
_errors = st.one_of(st.sampled_from([0.0, 0.125, 0.25, 0.5, 1.0]),
                    st.integers(0, 2**30).map(lambda k: k / 2**30))


@st.composite
def instances(draw):
    n_layers = draw(st.integers(1, 5))
    n_donors = draw(st.integers(0, 2))
    alignment = draw(st.sampled_from([1, 8, 32]))
    donors = ["IQ2_XXS", "IQ3_S"][:n_donors]
    rows = []
    for _ in range(n_layers):
        row = {BASE: (draw(_errors), alignment * draw(st.integers(0, 60)))}
        for d in donors:
            if draw(st.integers(0, 5)) > 0:  # sometimes a donor lacks a layer
                row[d] = (draw(_errors), alignment * draw(st.integers(0, 60)))
        rows.append(row)
    obj = table_obj(rows, fixed=draw(st.integers(0, 500)), alignment=alignment)
    table = parse_table(obj)
    step = draw(st.sampled_from([1, 7, 32, 100]) | st.integers(1, 400))
    return obj, table, step


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inst=instances(), data=st.data())
def test_target_mode_is_optimal_over_rounded_sizes(inst, data):
    obj, table, step = inst
    everything = list(brute_force(table))
    largest = max(s for _, _, s, _ in everything)
    target = data.draw(st.integers(1, largest + 3 * step))
    budget = (target - table.fixed_bytes) // step
    fitting = [(e, s) for _, e, s, nb in everything if target >= table.fixed_bytes and rounded_steps(nb, step) <= budget]
    if not fitting:
        with pytest.raises(FleError, match="below the smallest file these donors allow"):
            select_for_target(table, target, step)
        return
    base_best = all(table.errors[i, j] >= table.errors[i, 0]
                    for i in range(len(table.layers)) for j in range(len(table.names)))
    if target >= table.base_size_bytes and base_best:
        with pytest.raises(FleError, match="nothing to select"):
            select_for_target(table, target, step)
        return
    sel = select_for_target(table, target, step)
    check_consistent(sel, table)
    assert sel.size_bytes <= target
    assert rounded_steps(sel.layer_bytes.values(), step) <= budget
    best = min(e for e, _ in fitting)
    # exact over rounded sizes: no rounded-fitting selection has a lower error
    assert sel.predicted_error <= best
    assert sel.predicted_error == best
    # ties on error go to the smaller exact size
    assert sel.size_bytes == min(s for e, s in fitting if e == best)
    # deterministic: the same answer however the JSON is ordered
    shuffled = copy.deepcopy(obj)
    shuffled["layers"].reverse()
    for entry in shuffled["layers"]:
        entry["candidates"] = dict(reversed(list(entry["candidates"].items())))
    assert select_for_target(parse_table(shuffled), target, step).sources == sel.sources


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inst=instances(), data=st.data())
def test_error_mode_is_smallest_within_the_bound(inst, data):
    obj, table, step = inst
    everything = list(brute_force(table))
    errors = sorted({e for _, e, _, _ in everything})
    max_error = data.draw(st.sampled_from(errors) | st.floats(0.0, 6.0, allow_nan=False))
    meeting = [(rounded_steps(nb, step), e, s) for _, e, s, nb in everything if e <= max_error]
    if not meeting:
        with pytest.raises(FleError, match="no selection reaches"):
            select_for_error(table, max_error, step)
        return
    sel = select_for_error(table, max_error, step)
    check_consistent(sel, table)
    assert sel.predicted_error <= max_error
    smallest = min(r for r, _, _ in meeting)
    assert rounded_steps(sel.layer_bytes.values(), step) == smallest
    at_smallest = [(e, s) for _, e, s, nb in everything if rounded_steps(nb, step) <= smallest]
    best = min(e for e, _ in at_smallest)
    assert sel.predicted_error == best
    assert sel.size_bytes == min(s for e, s in at_smallest if e == best)
    if step == 1:  # no rounding: the truly smallest file within the bound
        assert sel.size_bytes - table.fixed_bytes == smallest


def realistic_table(seed=0, n_layers=48):
    """48 layers, the base and six donors, bytes and errors shaped like a
    ~94 GB MoE release."""
    rng = np.random.default_rng(seed)
    bpw = {BASE: 4.85, "IQ2_XXS": 2.06, "IQ2_S": 2.5, "IQ3_XXS": 3.06, "IQ3_S": 3.44, "Q3_K": 3.9, "IQ4_XS": 4.25}
    rows = []
    for _ in range(n_layers):
        sens = rng.uniform(0.3, 3.0)
        row = {}
        for name, b in bpw.items():
            nb = int(1.9e9 * b / 4.85 * rng.uniform(0.98, 1.02)) // 32 * 32
            err = 0.0 if name == BASE else float(sens * 0.01 * 2 ** (-(b - 2) * 1.5))
            row[name] = (err, nb)
        rows.append(row)
    return table_obj(rows, fixed=3_000_000_000)


def test_realistic_instance_is_fast():
    table = parse_table(realistic_table())
    assert len(table.layers) == 48 and len(table.names) == 7
    target = 90 * 10**9
    assert table.base_size_bytes > target
    t0 = time.perf_counter()
    sel = select_for_target(table, target, 16 * 10**6)
    dt = time.perf_counter() - t0
    print(f"\n48 layers x 7 candidates, 16 MB steps, 90 GB target: {dt * 1000:.1f} ms, "
          f"{sel.n_donor_layers} donor layers, {format_size(sel.size_bytes)}")
    assert sel.size_bytes <= target
    assert 0 < sel.n_donor_layers < 48
    assert sel.predicted_error > 0
    assert dt < 5.0  # sanity bound only; expect a few milliseconds

    t0 = time.perf_counter()
    inv = select_for_error(table, sel.predicted_error, 16 * 10**6)
    print(f"max-error mode on the same table: {(time.perf_counter() - t0) * 1000:.1f} ms")
    assert inv.predicted_error <= sel.predicted_error
    assert rounded_steps(inv.layer_bytes.values(), 16 * 10**6) <= rounded_steps(sel.layer_bytes.values(), 16 * 10**6)


def test_error_mode_inverts_target_mode():
    """The smallest file within the error the target mode reached is no larger
    (in rounded sizes) than that target's selection."""
    table = parse_table(realistic_table(seed=1))
    step = 16 * 10**6
    for target in (70 * 10**9, 80 * 10**9, 90 * 10**9):
        sel = select_for_target(table, target, step)
        inv = select_for_error(table, sel.predicted_error, step)
        assert inv.predicted_error <= sel.predicted_error
        assert (rounded_steps(inv.layer_bytes.values(), step)
                <= rounded_steps(sel.layer_bytes.values(), step))


# --- targets users get wrong ----------------------------------------------

def small_rows():
    return [{BASE: (0.0, 3200), "IQ3_S": (0.5, 1600), "IQ2_XXS": (2.0, 960)} for _ in range(4)]


def test_target_below_smallest_file_names_both_sizes():
    table = parse_table(table_obj(small_rows(), fixed=10**9))
    smallest = 10**9 + 4 * 960
    with pytest.raises(FleError) as e:
        select_for_target(table, smallest - 1, 1)
    assert "below the smallest file these donors allow" in str(e.value)
    assert format_size(smallest) in str(e.value)
    assert select_for_target(table, smallest, 1).sources == dict.fromkeys(range(4), "IQ2_XXS")


def test_target_below_smallest_rounded_file_suggests_a_smaller_step():
    table = parse_table(table_obj(small_rows(), fixed=0))
    # 960 bytes round up to 1000 at a 1000-byte step: 4 * 960 fits exactly, 4 * 1000 does not
    with pytest.raises(FleError, match="smaller step"):
        select_for_target(table, 4 * 960, 1000)


def test_target_at_or_above_the_base_is_refused():
    table = parse_table(table_obj(small_rows(), fixed=5000))
    base_size = 5000 + 4 * 3200
    for target in (base_size, base_size + 10**6):
        with pytest.raises(FleError) as e:
            select_for_target(table, target, 1)
        assert "nothing to select" in str(e.value) and format_size(base_size) in str(e.value)
    sel = select_for_target(table, base_size - 1, 1)
    assert sel.n_donor_layers == 1 and sel.donor_layer_counts == {"IQ3_S": 1}


def test_target_above_the_base_is_served_when_a_donor_is_more_accurate():
    rows = small_rows()
    rows[2] = {BASE: (0.25, 3200), "Q8_0": (0.0, 6400)}
    table = parse_table(table_obj(rows, fixed=0))
    sel = select_for_target(table, 4 * 3200 + 3200, 1)
    assert sel.sources[2] == "Q8_0" and sel.predicted_error == 0.0
    assert sel.size_bytes == 3 * 3200 + 6400


def test_error_mode_rejects_bad_bounds():
    table = parse_table(table_obj(small_rows()))
    with pytest.raises(FleError, match="negative"):
        select_for_error(table, -0.1)
    with pytest.raises(FleError, match="must be a number"):
        select_for_error(table, float("nan"))
    rows = small_rows()
    rows[0] = {BASE: (0.5, 3200)}
    with pytest.raises(FleError, match="smallest possible is 0.5"):
        select_for_error(parse_table(table_obj(rows)), 0.4, 1)
    # zero error: the base everywhere (donors cost error), the smallest such file
    assert select_for_error(table, 0.0, 1).n_donor_layers == 0


def test_bad_step_and_target():
    table = parse_table(table_obj(small_rows()))
    with pytest.raises(FleError, match="step"):
        select_for_target(table, 10**4, 0)
    with pytest.raises(FleError, match="target"):
        select_for_target(table, 10.5, 1)


# --- malformed tables -----------------------------------------------------

def _set(path, value):
    def mutate(obj):
        *head, last = path
        for k in head:
            obj = obj[k]
        obj[last] = value
    return mutate


def _delete(path):
    def mutate(obj):
        *head, last = path
        for k in head:
            obj = obj[k]
        del obj[last]
    return mutate


def _duplicate_layer(obj):
    obj["layers"].append(copy.deepcopy(obj["layers"][3]))


CAND = ["layers", 3, "candidates", "IQ3_S"]
MALFORMED = [
    (_set(CAND + ["error"], -0.5), "T.json: layers[3].candidates.IQ3_S.error is negative"),
    (_set(CAND + ["error"], float("nan")), "T.json: layers[3].candidates.IQ3_S.error is NaN"),
    (_set(CAND + ["error"], float("inf")), "layers[3].candidates.IQ3_S.error is infinite"),
    (_set(CAND + ["error"], True), "layers[3].candidates.IQ3_S.error must be a number"),
    (_set(CAND + ["error"], "0.1"), "layers[3].candidates.IQ3_S.error must be a number"),
    (_delete(CAND + ["error"]), "layers[3].candidates.IQ3_S has no 'error'"),
    (_set(CAND + ["bytes"], 5), "layers[3].candidates.IQ3_S has an unknown key 'bytes'"),
    (_set(CAND + ["expert_bytes"], -32), "layers[3].candidates.IQ3_S.expert_bytes must be a whole number"),
    (_set(CAND + ["expert_bytes"], 1.5), "layers[3].candidates.IQ3_S.expert_bytes must be a whole number"),
    (_set(CAND + ["expert_bytes"], 1601), "not a multiple of the alignment 32"),
    (_delete(["layers", 1, "candidates", BASE]), "layers[1].candidates has no entry for the base 'Q4_K_M'"),
    (_set(["layers", 2, "layer"], -1), "layers[2].layer must be a layer index"),
    (_set(["layers", 2, "layer"], "2"), "layers[2].layer must be a layer index"),
    (_duplicate_layer, "layers[4].layer: layer 3 appears twice"),
    (_set(["layers"], []), "layers must be a non-empty list"),
    (_set(["layers", 0, "candidates"], {}), "layers[0].candidates must be a non-empty object"),
    (_set(["format"], "fle.sensitivity/2"), "'fle.sensitivity/2' is not known to this FLE"),
    (_set(["format"], "fle.selection/1"), "not a sensitivity table"),
    (_delete(["format"]), "not a sensitivity table"),
    (_delete(["base"]), "T.json has no 'base'"),
    (_set(["base"], ""), "base must be the non-empty name"),
    (_set(["fixed_bytes"], -1), "fixed_bytes must be a whole number"),
    (_set(["alignment"], 0), "alignment must be a whole number >= 1"),
    (_set(["reference"], "ref.gguf"), "reference must be an object"),
    (_set(["extra"], 1), "T.json has an unknown key 'extra'"),
]


@pytest.mark.parametrize("mutate,message", MALFORMED, ids=[m for _, m in MALFORMED])
def test_malformed_table(mutate, message):
    obj = table_obj(small_rows())
    mutate(obj)
    with pytest.raises(FleError) as e:
        parse_table(obj, "T.json")
    assert message in str(e.value)


def test_load_table_file_errors(tmp_path):
    with pytest.raises(FleError, match="no such file"):
        load_table(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "fle.sensitivity/1",')
    with pytest.raises(FleError, match="not valid JSON"):
        load_table(bad)
    dup = tmp_path / "dup.json"
    dup.write_text('{"format": "fle.sensitivity/1", "base": "a", "base": "b"}')
    with pytest.raises(FleError, match="'base' appears twice"):
        load_table(dup)
    good = tmp_path / "good.json"
    raw = json.dumps(table_obj(small_rows())).encode()
    good.write_bytes(raw)
    assert load_table(good).sha256 == hashlib.sha256(raw).hexdigest()


# --- selections -----------------------------------------------------------

def test_selection_json_and_summary():
    table = parse_table(realistic_table(seed=2, n_layers=8))
    sel = select_for_target(table, table.base_size_bytes - 2 * 10**9, 16 * 10**6)
    doc = sel.to_json()
    assert doc["format"] == "fle.selection/1" and doc["mode"] == "target"
    assert doc["layers"] == {str(k): v for k, v in sel.sources.items()}
    assert doc["target_bytes"] == table.base_size_bytes - 2 * 10**9 and "max_error" not in doc
    assert doc["table_sha256"] == table.sha256 and doc["step_bytes"] == 16 * 10**6
    text = format_selection(sel)
    assert f"{sel.n_donor_layers} of 8" in text
    for name, count in sel.donor_layer_counts.items():
        assert f"{name} {count}" in text
    assert format_size(sel.size_bytes) in text


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.update(size_bytes=d["size_bytes"] + 1), "size_bytes"),
    (lambda d: d.update(predicted_error=d["predicted_error"] + 1), "predicted_error"),
    (lambda d: d.update(format="fle.selection/9"), "not known"),
    (lambda d: d.update(mode="size"), "mode must be"),
    (lambda d: d.update(max_error=0.1), "does not take 'max_error'"),
    (lambda d: d.pop("target_bytes"), "needs 'target_bytes'"),
    (lambda d: d["layers"].update({"x": BASE}), "not a layer index"),
    (lambda d: d["layers"].pop("0"), "must name the same layers"),
    (lambda d: d.update(table_sha256="abc"), "table_sha256"),
])
def test_malformed_selection(tmp_path, edit, message):
    table = parse_table(table_obj(small_rows()))
    doc = select_for_target(table, 1000 + 4 * 3200 - 1, 1).to_json()
    edit(doc)
    path = tmp_path / "sel.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(FleError) as e:
        load_selection(path)
    assert str(path) in str(e.value) and message in str(e.value)


# --- the console script ---------------------------------------------------

@pytest.fixture
def table_file(tmp_path):
    path = tmp_path / "sens.json"
    path.write_text(json.dumps(realistic_table(seed=3, n_layers=12)))
    return path


def test_cli_writes_a_selection(tmp_path, table_file, capsys):
    out = tmp_path / "sel.json"
    assert select_main(["--sensitivity", str(table_file), "--target", "20GB", "-o", str(out)]) == 0
    sel = load_selection(out)
    assert sel == select_for_target(load_table(table_file), 20 * 10**9, 16 * 10**6)
    assert sel.size_bytes <= 20 * 10**9
    printed = capsys.readouterr().out
    assert "donor layers:" in printed and str(out) in printed
    assert set(os.listdir(tmp_path)) == {"sens.json", "sel.json"}

    # an existing output is kept without --force, replaced with it
    before = out.read_bytes()
    assert select_main(["--sensitivity", str(table_file), "--target", "19GB", "-o", str(out)]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert out.read_bytes() == before
    assert select_main(["--sensitivity", str(table_file), "--max-error", "0.02", "--step", "8MB",
                        "-o", str(out), "--force"]) == 0
    sel = load_selection(out)
    assert sel.mode == "max_error" and sel.max_error == 0.02 and sel.step_bytes == 8 * 10**6
    assert sel.predicted_error <= 0.02
    assert set(os.listdir(tmp_path)) == {"sens.json", "sel.json"}


@pytest.mark.parametrize("args,message", [
    (["--target", "1GB"], "below the smallest file"),
    (["--target", "1000GB"], "nothing to select"),
    (["--target", "lots"], "--target 'lots' is not a size"),
    (["--target", "20GB", "--step", "0"], "--step must be at least 1 byte"),
    (["--max-error", "-1"], "negative"),
    (["--max-error", "nan"], "finite"),
])
def test_cli_bad_input_exits_2_without_output(tmp_path, table_file, capsys, args, message):
    out = tmp_path / "sel.json"
    assert select_main(["--sensitivity", str(table_file), *args, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fle-select: error: ") and message in err and err.count("\n") == 1
    assert not out.exists()
    assert set(os.listdir(tmp_path)) == {"sens.json"}


def test_cli_bad_table_exits_2_without_output(tmp_path, capsys):
    obj = table_obj(small_rows())
    obj["layers"][1]["candidates"]["IQ3_S"]["error"] = -1.0
    table = tmp_path / "sens.json"
    table.write_text(json.dumps(obj))
    out = tmp_path / "sel.json"
    assert select_main(["--sensitivity", str(table), "--target", "10kB", "-o", str(out)]) == 2
    assert "layers[1].candidates.IQ3_S.error is negative" in capsys.readouterr().err
    assert not out.exists()
    assert select_main(["--sensitivity", str(tmp_path / "nope.json"), "--target", "10kB", "-o", str(out)]) == 2
    assert "no such file" in capsys.readouterr().err
    assert not out.exists()


def test_cli_needs_exactly_one_goal(tmp_path, table_file):
    out = str(tmp_path / "sel.json")
    for args in ([], ["--target", "20GB", "--max-error", "0.1"]):
        with pytest.raises(SystemExit) as e:
            select_main(["--sensitivity", str(table_file), *args, "-o", out])
        assert e.value.code == 2
    assert not os.path.exists(out)
