"""``fle-compare`` end to end on factory models: KLD of every file against a
reference on two texts through FLE's forward pass, one bracket with a
``fle-engine serve`` server started per file at the same cache budget,
the table, the JSON (checked against fle-kld and the bracket's own
numbers) and the plot; and its refusals of bad input."""
from __future__ import annotations

import json
import shlex
import sys

import numpy as np
import pytest

from fle_quant.cli.compare_cli import main
from fle_quant.measure import compare

pytestmark = pytest.mark.usefixtures("two_torch_threads")


def test_groups_and_server_command():
    assert compare.groups(5, 3) == [[1, 2, 3], [4, 5]]
    assert compare.groups(1, 3) == [[1]]
    cmd = compare.server_command(compare.DEFAULT_SERVER, "/m dir/a.gguf", 8123, "17GiB")
    assert shlex.split(cmd) == [sys.executable, "-m", "fle_engine.cli", "serve", "/m dir/a.gguf", "--port", "8123",
                                "--cache-budget", "17GiB"]
    assert compare.parse_named("a=x/y.gguf", "file") == ("a", "x/y.gguf")
    assert compare.parse_named("dir=1/y.gguf", "file") == ("dir", "1/y.gguf")
    assert compare.parse_named("x/a=b.gguf", "file") == (None, "x/a=b.gguf")


def test_bad_input(tmp_path, capsys):
    from fle_quant.synth import make_model

    m = make_model(tmp_path / "m.gguf", "qwen3moe", mix="f32")
    t = tmp_path / "t.txt"
    t.write_text("some words\n")
    cases = [
        ([str(m), str(m), "--budget", "1GiB", "--no-kld", "--out", str(tmp_path / "o")], "given twice"),
        ([str(m), "--budget", "1GiB", "--no-kld"], "two or more files"),
        ([str(m), f"b={m}", "--budget", "lots", "--no-kld"], "--budget 'lots' is not a size"),
        ([str(m), f"b={m}", "--budget", "1GiB"], "the KLD needs a base"),
        ([str(m), f"b={m}", "--budget", "1GiB", "--reference", str(m), "--text", str(t), "--base", str(t)],
         "not both"),
        ([str(m), f"b={m}", "--budget", "1GiB", "--no-kld", "--server", "serve {model}"], "no {port}"),
        ([str(m), f"b={m}", "--budget", "1GiB", "--no-kld", "--server", "x {model} {port} {gpu}"], "{gpu}"),
        ([str(m), f"b={tmp_path / 'none.gguf'}", "--budget", "1GiB", "--no-kld"], "none.gguf"),
        ([str(m), f"b={m}", "--budget", "1GiB", "--no-kld", "--out", str(t)], "not a folder"),
    ]
    for argv, word in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("fle-compare: error: ") and err.count("\n") == 1 and word in err, (argv, err)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("aiohttp")
    from textgen import write_text

    from fle_quant.synth import make_model

    d = tmp_path_factory.mktemp("compare")
    kw = dict(seed=4, block_count=2, expert_count=8, expert_used_count=2)
    exp = lambda q: [(r"ffn_(gate|up|down)_exps", q)]  # noqa: E731
    return {"ref": make_model(d / "ref-f32.gguf", "qwen3moe", mix="f32", **kw),
            "q8": make_model(d / "cand-q8.gguf", "qwen3moe", mix=exp("Q8_0"), **kw),
            "q4": make_model(d / "cand-q4.gguf", "qwen3moe", mix=exp("Q4_0"), **kw),
            "E": write_text(d / "E.txt", 600, seed=1), "W": write_text(d / "W.txt", 600, seed=2), "dir": d}


def test_compare_end_to_end(setup, tmp_path, capsys):
    from fle_engine import kld_run

    from fle_quant.measure.plot import file_size

    out = tmp_path / "cmp"
    server = compare.DEFAULT_SERVER + " -c 512 -t 1 --device cpu"
    argv = [f"q8={setup['q8']}", f"q4={setup['q4']}", "--reference", str(setup["ref"]), "--text", str(setup["E"]),
            "--text", f"W={setup['W']}", "-c", "64", "--chunks", "2", "--budget", "64MiB", "--server", server,
            "--only", "math", "--limit", "2", "--max-tokens", "3", "--allow-length", "--n-boot", "200",
            "--start-timeout", "120", "--out", str(out)]
    rc = main(argv)
    cap = capsys.readouterr()
    r = json.loads((out / "compare.json").read_text())
    assert rc == (0 if all(b["analysis"]["valid"] for b in r["brackets"]) else 1), cap.err
    assert r["format"] == "fle-compare/1" and r["texts"] == ["E", "W"]
    assert [x["name"] for x in r["rows"]] == ["q8", "q4"]
    # the KLD: the same numbers as fle-kld's library on the base file the command wrote
    for row in r["rows"]:
        assert row["size_bytes"] == file_size(row["path"])
        for t in ("E", "W"):
            s = kld_run.compare_to_base(row["path"], out / f"base.{t}.kld")
            assert row["kld"][t]["kld_mean"] == pytest.approx(s.kld_mean)
            assert row["kld"][t]["same_top"] == pytest.approx(s.same_top)
            assert "Mean    KLD:" in (out / f"kld.{row['name']}.{t}.txt").read_text()
    q8, q4 = r["rows"]
    assert q8["kld"]["E"]["kld_mean"] < q4["kld"]["E"]["kld_mean"]  # 8-bit experts are closer than 4-bit
    # one bracket: q8 (reference), q4, q8 again, each arm a server started with the budget
    b = json.loads((out / "bracket-B1.json").read_text())
    assert [p["name"] for p in b["passes"]] == ["q8", "q4", "q8"]
    assert all("--cache-budget 64MiB" in a["start"] for a in b["settings"]["arms"])
    s = [np.array([q["speed"] for q in p["requests"]]) for p in b["passes"]]
    sp = q4["speed"][0]
    assert sp["change"] == pytest.approx(s[1].mean() / ((s[0] + s[2]) / 2).mean() - 1)
    assert sp["low"] <= sp["change"] <= sp["high"]
    assert q8["speed"][0]["mean_speed"] == pytest.approx(((s[0] + s[2]) / 2).mean())
    md = (out / "compare.md").read_text()
    assert md.startswith("| file | size | KLD E | KLD W | top-1 % E | top-1 % W | t/s |")
    assert "| q8 |" in md and "reference" in md and "Bracket B1: reference drift" in md
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "decode speed change against q8" in cap.out
    # the KLD results are what fle-accept reads
    from fle_quant.cli.accept_cli import main as accept

    assert accept(["--text", "E", str(out / "kld.q8.E.txt"), str(out / "kld.q8.E.txt"), "--held-out", "W",
                   str(out / "kld.q8.W.txt"), str(out / "kld.q8.W.txt")]) == 0
    # a second run refuses to overwrite without --force
    assert main(argv) == 2
    assert "exists" in capsys.readouterr().err


def test_compare_plot_axes(setup, tmp_path):
    from fle_quant.measure.plot import comparison

    kl = lambda m: {"kld_mean": m, "kld_unc": m / 10, "same_top": 0.9, "same_top_unc": 0.01}  # noqa: E731
    res = {"texts": ["E"], "settings": {"budget": "17GiB"}, "brackets": [],
           "rows": [{"name": "a", "size_bytes": 3_000_000, "kld": {"E": kl(0.01)}, "reference": True,
                     "speed": [{"bracket": 1, "mean_speed": 10.0, "valid": True}]},
                    {"name": "b", "size_bytes": 2_000_000, "kld": {"E": kl(0.05)}, "reference": False,
                     "speed": [{"bracket": 1, "mean_speed": 11.0, "change": 0.1, "low": 0.05, "high": 0.15,
                                "valid": True}]}]}
    what, (ak, asp) = comparison(res, str(tmp_path / "c.png"))
    assert ak.get_xlabel() == "file size (MB)" and ak.get_ylabel() == "mean KLD vs base"
    assert asp.get_ylabel() == "decode speed change vs a (%)" and "17GiB" in asp.get_title()
    assert "2 files by size" in what and (tmp_path / "c.png").exists()


def _passes(names, speeds):
    from fle_quant.measure.bracket import standard_prompts

    ps = standard_prompts()[:4]
    return [{"name": n, "url": "http://127.0.0.1:1", "pass": k + 1, "memory_pressure_avg10": None,
             "requests": [{"id": p.id, "category": p.category, "ok": True, "finish_reason": "stop",
                           "completion_tokens": 10, "wall_s": 1.0, "speed": float(v), "speed_source": "timings"}
                          for p, v in zip(ps, s)]} for k, (n, s) in enumerate(zip(names, speeds))], ps


def test_rows_over_several_brackets():
    """Two brackets against one reference: each candidate's change comes from
    its own bracket, the reference has a speed per bracket."""
    from fle_quant.measure.bracket import analyse, build_result

    results = []
    for names, speeds in ((["ref", "a"], [[10, 11, 12, 13], [12, 13, 14, 15], [10, 11, 12, 13]]),
                          (["ref", "b"], [[20, 20, 20, 20], [18, 18, 18, 18], [20.5, 20.5, 20.5, 20.5]])):
        passes, ps = _passes([names[0], names[1], names[0]], speeds)
        results.append(build_result(passes, {}, ps, analyse(passes, n_boot=200)))
    results.append({"passes": [], "analysis": None, "error": "only 1 prompt(s) were answered by every arm"})
    files = [{"name": n, "path": f"{n}.gguf", "size_bytes": s} for n, s in (("ref", 3e9), ("a", 2e9), ("b", 1e9))]
    kl = {"ref": {"E": {"kld_mean": 0.09, "kld_unc": 0.002, "same_top": 0.91, "same_top_unc": 0.003}}}
    rows = compare.rows(files, kl, results)
    assert [len(r["speed"]) for r in rows] == [2, 1, 1]
    assert rows[1]["speed"][0]["change"] == pytest.approx(54 / 46 - 1) and rows[1]["speed"][0]["bracket"] == 1
    assert rows[2]["speed"][0]["change"] == pytest.approx(18 / 20.25 - 1) and rows[2]["speed"][0]["bracket"] == 2
    md = compare.markdown({"texts": ["E"], "rows": rows, "brackets": results,
                           "settings": {"kld_base": "BF16.gguf", "budget": "17035MiB", "n_prompts": 4}})
    lines = md.splitlines()
    assert lines[2].startswith("| ref | 3.00 GB | 0.0900 ± 0.0020 | 91.00 ± 0.30 | 11.50 | reference |  | B1 | yes |")
    assert sum(ln.startswith("| ref |") for ln in lines) == 2
    assert "| a | 2.00 GB |  |  | 13.50 | +17.39 % |" in md
    assert "Bracket B3: no analysis (only 1 prompt(s)" in md and "Bracket B2: reference drift +2.50 % (within" in md


def test_existing_base_files_and_kld_only(setup, tmp_path, capsys):
    """--base takes fle-kld base files (or llama-perplexity's); --no-speed
    starts no server."""
    from fle_quant.cli.kld_cli import main as kld_main

    base = tmp_path / "E.kld"
    assert kld_main(["base", str(setup["ref"]), "--text", str(setup["E"]), "-c", "64", "--chunks", "2",
                     "-o", str(base)]) == 0
    capsys.readouterr()
    out = tmp_path / "k"
    assert main([str(setup["q8"]), "--base", str(base), "--budget", "1GiB", "--no-speed", "--out", str(out)]) == 0
    r = json.loads((out / "compare.json").read_text())
    assert r["texts"] == ["E"] and r["brackets"] == [] and r["rows"][0]["speed"] == []
    assert r["rows"][0]["kld"]["E"]["kld_mean"] > 0 and not list(out.glob("bracket-*"))
    assert "no speed" in (out / "compare.md").read_text()
