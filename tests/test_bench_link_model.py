"""bench/engine.py's model of a slower PCIe link (printed as a model next
to the measured numbers): at this machine's own link speed it gives back
the measured speeds, and its arithmetic matches a hand computation."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_engine", ROOT / "bench" / "engine.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def row(gpu_tok_s=50.0, auto_tok_s=70.0, misses=250.0, eb=2.5e6, b_z=40e9, b_c=25e9):
    return {"upstream_tok_s": 57.0, "fle_split": {
        "gpu": {"tok_s": gpu_tok_s, "misses_per_token": misses, "expert_bytes_mean": eb},
        "auto": {"tok_s": auto_tok_s, "misses_per_token": misses, "expert_bytes_mean": eb,
                 "miss_bandwidths": {"gpu": b_z, "cpu": b_c}},
        "cpu": {"tok_s": 45.0}}}


def test_own_link_gives_the_measured_speeds(bench):
    m = bench.link_model(row(), 55e9, 55e9)
    assert m["gpu_tok_s"] == pytest.approx(50.0)
    assert m["hybrid_tok_s"] == pytest.approx(70.0)
    assert m["cpu_tok_s"] == 45.0 and m["hybrid_ratio"] == pytest.approx(70.0 / 57.0)


def test_slower_link_by_hand(bench):
    m = bench.link_model(row(), 25e9, 50e9)
    bytes_ = 250.0 * 2.5e6
    rest = 1 / 50.0 - bytes_ / 40e9
    over = 1 / 70.0 - (rest + bytes_ / 65e9)
    assert m["rest_ms"] == pytest.approx(rest * 1e3)
    assert m["zero_copy_gbps"] == pytest.approx(20.0)
    assert m["gpu_tok_s"] == pytest.approx(1 / (rest + bytes_ / 20e9))
    assert m["hybrid_tok_s"] == pytest.approx(1 / (rest + bytes_ / 45e9 + over))
    assert m["hybrid_cpu_share"] == pytest.approx(25 / 45)
    assert m["gpu_tok_s"] < 50.0 and m["hybrid_tok_s"] < 70.0


def test_needs_both_runs(bench):
    r = row()
    del r["fle_split"]["auto"]
    assert bench.link_model(r, 25e9, 55e9) is None
