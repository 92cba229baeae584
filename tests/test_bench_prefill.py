"""bench/engine.py's prefill summary (``prefill_ratios``): per prompt
length, FLE's fastest micro-batch against upstream's fastest, as the
benchmark's JSON and docs/benchmarks.md report it."""
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


def run(n, ub, tok_s):
    return {"n_prompt": n, "n_ubatch": ub, "tok_s": tok_s}


def test_best_micro_batch_of_each_side(bench):
    up = [run(4096, 512, 1800.0), run(4096, 4096, 2500.0), run(8192, 512, 1700.0), run(8192, 4096, 2400.0)]
    fle = [run(4096, 4096, 2000.0), run(4096, 8192, 1900.0), run(8192, 4096, 2100.0), run(8192, 8192, 2600.0)]
    res = bench.prefill_ratios(up, fle)
    assert list(res) == ["4096", "8192"]
    assert res["4096"] == {"fle_tok_s": 2000.0, "fle_ubatch": 4096, "upstream_tok_s": 2500.0, "upstream_ubatch": 4096,
                           "ratio": pytest.approx(0.8)}
    assert res["8192"] == {"fle_tok_s": 2600.0, "fle_ubatch": 8192, "upstream_tok_s": 2400.0, "upstream_ubatch": 4096,
                           "ratio": pytest.approx(2600.0 / 2400.0)}


def test_lengths_come_from_fle_runs(bench):
    """A length upstream did not run (--skip-upstream, or its run failed)
    keeps FLE's numbers without a ratio; a length only upstream ran is left
    out; keys are the lengths as strings in numeric order."""
    up = [run(1024, 512, 3000.0), run(16384, 512, 900.0)]
    fle = [run(8192, 8192, 2600.0), run(1024, 4096, 1500.0), run(1024, 8192, 1500.0)]
    res = bench.prefill_ratios(up, fle)
    assert list(res) == ["1024", "8192"]
    assert res["1024"] == {"fle_tok_s": 1500.0, "fle_ubatch": 4096, "upstream_tok_s": 3000.0, "upstream_ubatch": 512,
                           "ratio": 0.5}          # a tie: the first run listed
    assert res["8192"] == {"fle_tok_s": 2600.0, "fle_ubatch": 8192}
    assert bench.prefill_ratios([], []) == {}
