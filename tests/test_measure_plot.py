"""``fle-plot``: every plot kind drawn from real FLE outputs made here on
factory models (fle-kld results, an fle-sensitivity table and fle-select
selection, an fle-bracket result), the PNG files and the axes checked."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fle_quant.cli.plot_cli import main
from fle_quant.measure import plot
from fle_quant.measure.bracket import analyse, build_result, standard_prompts

matplotlib = pytest.importorskip("matplotlib")
import matplotlib.image  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def png_ok(path):
    assert path.read_bytes()[:8] == PNG
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert img[..., :3].std() > 0.01  # not blank


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pytest.importorskip("torch")
    from fle_quant.synth import make_model
    from textgen import write_text

    d = tmp_path_factory.mktemp("plot")
    out = {"dir": d, "text": write_text(d / "t.txt", n_words=600)}
    out["ref"] = make_model(d / "ref.gguf", "qwen3moe", seed=3, mix="f32")
    for q in ("Q8_0", "IQ4_NL", "IQ3_S"):
        out[q] = make_model(d / f"{q}.gguf", "qwen3moe", seed=3, mix=[(r"ffn_(gate|up|down)_exps", q)])
    return out


@pytest.fixture(scope="module")
def kld_base(models):
    from fle_quant.cli.kld_cli import main as kld_main

    base = models["dir"] / "base.kld"
    assert kld_main(["base", str(models["ref"]), "--text", str(models["text"]), "-c", "64", "--chunks", "2",
                     "-o", str(base)]) == 0
    return base


def test_size_kld_from_fle_kld(models, kld_base, tmp_path, capsys):
    from fle_quant.cli.kld_cli import main as kld_main

    base = kld_base
    capsys.readouterr()
    args = []
    for q, flag in (("Q8_0", "--point"), ("IQ4_NL", "--point"), ("IQ3_S", "--public")):
        assert kld_main([str(models[q]), "--base", str(base)]) == 0
        res = tmp_path / f"{q}.kld.txt"
        res.write_text(capsys.readouterr().out)
        args += [flag, q, str(models[q]), str(res)]
    out = tmp_path / "size.png"
    assert main(["size-kld", *args, "--speed", "Q8_0", "10", "--speed", "IQ4_NL", "12", "--speed", "IQ3_S", "14",
                 "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert "file size (MB) against mean KLD" in said and "3 files" in said and "colour = decode speed" in said
    png_ok(out)
    from fle_quant.measure.accept import read_kld_result

    pts = [plot.SizePoint(q, plot.file_size(str(models[q])), *(lambda r: (r.kld, r.kld_se))(
        read_kld_result(tmp_path / f"{q}.kld.txt")), q == "IQ3_S") for q in ("Q8_0", "IQ4_NL", "IQ3_S")]
    _, ax = plot.size_kld(pts, str(tmp_path / "again.png"))
    assert ax.get_xlabel() == "file size (MB)" and ax.get_ylabel() == "mean KLD vs base"
    offsets = np.concatenate([c.get_offsets() for c in ax.collections if hasattr(c, "get_offsets")
                              and len(c.get_offsets()) and c.get_offsets().shape[1] == 2])
    # Q8_0's experts are the largest and the closest to the reference
    assert pts[0].size_bytes > pts[2].size_bytes and pts[0].kld < pts[2].kld
    assert {round(x, 6) for x in offsets[:, 0]} >= {round(p.size_bytes / 1e6, 6) for p in pts}


def test_heatmap_from_sensitivity_and_selection(models, tmp_path, capsys):
    from fle_quant.cli.select_cli import main as select_main
    from fle_quant.cli.sensitivity_cli import main as sens_main
    from fle_quant.select import load_selection, load_table

    table = tmp_path / "sens.json"
    assert sens_main(["--ref", str(models["ref"]), "--donor", f"IQ4_NL={models['IQ4_NL']}",
                      "--donor", f"IQ3_S={models['IQ3_S']}", "--text", str(models["text"]), "--tokens", "64",
                      "--ctx", "32", "-o", str(table)]) == 0
    t = load_table(table)
    sel = tmp_path / "sel.json"
    target = (t.base_size_bytes + t.fixed_bytes + int(t.expert_bytes[:, -1].sum())) // 2
    assert select_main(["--sensitivity", str(table), "--target", str(target), "--step", "1KB", "-o", str(sel)]) == 0
    capsys.readouterr()
    out = tmp_path / "heat.png"
    assert main(["heatmap", str(table), "--selection", str(sel), "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"{len(t.layers)} layers x {len(t.names)} sources" in said and "marked in" in said
    png_ok(out)
    s = load_selection(sel)
    _, ax = plot.sensitivity_heatmap(t, str(tmp_path / "h2.png"), s)
    assert [x.get_text() for x in ax.get_xticklabels()] == list(t.names)
    assert [y.get_text() for y in ax.get_yticklabels()] == [str(x) for x in t.layers]
    marks = ax.collections[-1].get_offsets()
    assert [t.names[int(x)] for x, _ in marks] == [s.sources[layer] for layer in t.layers]
    # the plot without a selection, and a selection of another table refused
    assert main(["heatmap", str(table), "-o", str(tmp_path / "h3.png")]) == 0
    capsys.readouterr()
    other = json.loads(sel.read_text())
    other["table_sha256"] = "0" * 64
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert main(["heatmap", str(table), "--selection", str(tmp_path / "other.json"), "-o",
                 str(tmp_path / "h4.png")]) == 2
    assert "another sensitivity table" in capsys.readouterr().err and not (tmp_path / "h4.png").exists()


def test_predicted_vs_measured_from_built_files(models, kld_base, tmp_path, capsys):
    """Three files spliced from fle-select selections at three targets, each
    measured with fle-kld: predicted summed error against measured KLD."""
    from fle_quant.cli.kld_cli import main as kld_main
    from fle_quant.cli.select_cli import main as select_main
    from fle_quant.cli.sensitivity_cli import main as sens_main
    from fle_quant.cli.splice_cli import main as splice_main
    from fle_quant.select import load_table

    table = tmp_path / "sens.json"
    donors = ["--donor", f"IQ4_NL={models['IQ4_NL']}", "--donor", f"IQ3_S={models['IQ3_S']}"]
    assert sens_main(["--ref", str(models["ref"]), *donors, "--text", str(models["text"]), "--tokens", "64",
                      "--ctx", "32", "-o", str(table)]) == 0
    t = load_table(table)
    small = t.fixed_bytes + int(np.where(t.available, t.expert_bytes, 1 << 60).min(axis=1).sum())
    args = []
    for k, frac in enumerate((0.2, 0.5, 0.8)):
        target = int(small + frac * (t.base_size_bytes - small))
        sel, out, res = tmp_path / f"s{k}.json", tmp_path / f"f{k}.gguf", tmp_path / f"f{k}.kld.txt"
        assert select_main(["--sensitivity", str(table), "--target", str(target), "--step", "1KB", "-o", str(sel)]) == 0
        assert splice_main(["--base", str(models["ref"]), *donors, "--selection", str(sel), "-o", str(out)]) == 0
        capsys.readouterr()
        assert kld_main([str(out), "--base", str(kld_base)]) == 0
        res.write_text(capsys.readouterr().out)
        args += ["--file", f"f{k}", str(sel), str(res)]
    png = tmp_path / "pred.png"
    assert main(["predicted", *args, "-o", str(png)]) == 0
    said = capsys.readouterr().out
    assert "summed predicted error against measured mean KLD" in said and "3 files" in said
    png_ok(png)
    from fle_quant.measure.accept import read_kld_result
    from fle_quant.select import load_selection

    pred = [load_selection(tmp_path / f"s{k}.json").predicted_error for k in range(3)]
    meas = [read_kld_result(tmp_path / f"f{k}.kld.txt").kld for k in range(3)]
    _, ax, rho = plot.predicted_vs_measured(["a", "b", "c"], pred, meas, [0, 0, 0], str(tmp_path / "p2.png"))
    assert ax.get_xlabel() == "predicted summed error (selection)" and f"{rho:.3f}" in ax.get_title()
    # a smaller target predicts a larger error, and the measured KLD follows
    assert pred[0] > pred[2] and meas[0] > meas[2]


def test_rank_correlation_against_plain_ranks():
    rng = np.random.default_rng(9)
    x, y = rng.normal(size=12), rng.normal(size=12)
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))  # no ties
    assert plot.rank_correlation(x, y) == pytest.approx(np.corrcoef(rx, ry)[0, 1])
    assert plot.rank_correlation([1, 2, 3], [3, 2, 1]) == pytest.approx(-1)
    assert np.isnan(plot.rank_correlation([1, 1, 1], [1, 2, 3]))


def bracket_result():
    ps = standard_prompts()
    rng = np.random.default_rng(2)
    ref = rng.uniform(30, 40, len(ps))

    def passed(name, k, speeds):
        return {"name": name, "url": "http://x", "pass": k, "memory_pressure_avg10": None,
                "requests": [{"id": p.id, "category": p.category, "ok": True, "finish_reason": "stop",
                              "completion_tokens": 100, "wall_s": 1.0, "speed": float(s), "speed_source": "timings"}
                             for p, s in zip(ps, speeds)]}

    passes = [passed("ref", 1, ref), passed("A", 2, ref * 1.1), passed("B", 3, ref * rng.uniform(0.9, 1.0, len(ps))),
              passed("ref", 4, ref * 1.01)]
    return build_result(passes, {}, ps, analyse(passes, n_boot=500))


def test_forest_from_bracket(tmp_path, capsys):
    r = bracket_result()
    p = tmp_path / "b.json"
    p.write_text(json.dumps(r))
    out = tmp_path / "forest.png"
    assert main(["forest", str(p), "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert "2 candidates against ref with 95 % bootstrap intervals, overall and per category" in said
    png_ok(out)
    _, ax = plot.forest(r, str(tmp_path / "f2.png"))
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[0] == "A" and "  code (n=9)" in labels and len(labels) == 2 * (1 + 4)
    assert "reference drift +1.00 %" in ax.get_title()
    assert ax.get_xlabel().startswith("decode speed change vs ref (%)")
    assert main(["forest", str(p), "-o", str(out)]) == 2  # exists, no --force
    assert "exists" in capsys.readouterr().err


def test_bad_input(tmp_path, capsys):
    k = tmp_path / "k.txt"
    k.write_text("Mean    KLD: 0.1 ± 0.01\nSame top p: 90 ± 1 %\n")
    assert main(["size-kld", "--point", "a", "lots", str(k), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "lots" in err and "no such file" in err.lower()
    assert main(["size-kld", "--point", "a", "1GB", str(k), "-o", str(tmp_path / "x.jpg")]) == 2
    assert ".png" in capsys.readouterr().err
    assert main(["size-kld", "--point", "a", "1GB", str(k), "--speed", "b", "3", "-o", str(tmp_path / "x.png")]) == 2
    assert "no point of that name" in capsys.readouterr().err


def test_hit_rate_from_engine_statistics(tmp_path, capsys):
    """The engine's per-step cache hits (Engine.save_stats, as fle-engine
    generate --stats-json writes them) drawn over time."""
    pytest.importorskip("torch")
    from fle_engine.runtime import Engine
    from fle_quant.synth import make_model

    model = make_model(tmp_path / "m.gguf", "qwen3moe", seed=3, mix="release", routing_skew=1.0)
    eng = Engine(model, device="cpu", cache_budget=0, ctx_size=64, profile_path="none", progress=False,
                 log=lambda m: None)
    probe = sum(lay.expert_bytes for lay in eng.net.layouts.values())
    eng.close()
    eng = Engine(model, device="cpu", cache_budget=3 * probe, ctx_size=64, profile_path="none", progress=False,
                 log=lambda m: None)
    eng.generate([1, 2, 3], 40)
    stats = tmp_path / "stats.json"
    eng.save_stats(stats)
    eng.close()
    obj = json.loads(stats.read_text())
    assert obj["format"] == "fle.engine-stats/1" and len(obj["hits"]) == 42
    assert obj["requests_per_step"] == eng.args.n_layer * eng.args.n_expert_used
    assert 0 < sum(obj["hits"]) < len(obj["hits"]) * obj["requests_per_step"]
    out = tmp_path / "hits.png"
    assert main(["hit-rate", str(stats), "--window", "8", "-o", str(out)]) == 0
    assert "hit rate over 42 decode steps" in capsys.readouterr().out
    png_ok(out)
    _, ax = plot.hit_rate(obj, str(tmp_path / "h2.png"), window=8)
    assert ax.get_xlabel() == "decode step" and ax.get_ylabel() == "expert cache hit rate"
    overall = sum(obj["hits"]) / (42 * obj["requests_per_step"])
    assert f"{overall:.3f} overall" in ax.get_title()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**obj, "hits": [obj["requests_per_step"] + 1]}))
    assert main(["hit-rate", str(bad), "-o", str(tmp_path / "b.png")]) == 2
    assert "hits must be" in capsys.readouterr().err
