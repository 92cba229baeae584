"""bench/engine.py's FLE side on the CPU (``--device cpu --skip-upstream
--shape tiny``): the script runs end to end on a small file, decode and the
verify step, so that it does not first break in front of a GPU."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_engine_cpu", ROOT / "bench" / "engine.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_smoke_decode_and_verify(bench, tmp_path, capsys):
    out = tmp_path / "res.json"
    rc = bench.main(["--shape", "tiny", "--skip-upstream", "--device", "cpu", "-n", "4", "-r", "1",
                     "--routing", "uniform", "--no-all-gpu", "--fle-warmup", "4", "--verify", "uniform", "--verify-warmup", "4",
                     "--verify-reps", "1", "--verify-split", "gpu", "--work", str(tmp_path), "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    (row,) = res["runs"]
    f = row["fle"]
    assert f["warmup_tokens"] == 4 and f["tok_s"] > 0 and 0.0 <= f["hit_rate"] <= 1.0 and f["gpu_allocated"] == 0
    v = row["verify"]
    assert [r["drafts"] for r in v["rows"]] == [0, 1, 2, 3]
    assert all(r["seconds"] > 0 and r["tokens"] == r["drafts"] + 1 for r in v["rows"])
    # each distinct missed expert once per step: never more than the sum over the step's tokens
    assert all(r["pcie_bytes_union"] <= r["pcie_bytes_sum"] for r in v["rows"])
    text = capsys.readouterr().out
    assert "MODELLED" in text and "measured acceptance: none here" in text


def test_cpu_smoke_positions(bench, tmp_path, capsys):
    """--positions: the decode step after prompts of each length (decode and prefill left out)."""
    out = tmp_path / "res.json"
    rc = bench.main(["--shape", "tiny", "--skip-upstream", "--device", "cpu", "--routing", "uniform", "--no-decode",
                     "--positions", "8,40", "--work", str(tmp_path), "--json", str(out)])
    assert rc == 0
    pos = json.loads(out.read_text())["positions"]
    assert set(pos) == {"8", "40"} and all(v > 0 for v in pos.values())
    assert "position 40:" in capsys.readouterr().out


def test_cpu_needs_skip_upstream(bench, tmp_path):
    with pytest.raises(SystemExit, match="--skip-upstream"):
        bench.main(["--shape", "tiny", "--device", "cpu", "--work", str(tmp_path)])
