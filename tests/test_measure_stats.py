"""fle_quant.measure.stats: the paired bootstrap against a plain NumPy
computation on the same data and seed, and the reference drift limit."""
from __future__ import annotations

import numpy as np
import pytest

from fle_quant.errors import FleError
from fle_quant.measure.stats import combined_se, drift, paired_bootstrap


def plain_bootstrap(ref, cand, n_boot, seed, conf):
    """The definition, written out loop by loop."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(ref), (n_boot, len(ref)))
    changes = []
    for row in idx:
        r = sum(ref[i] for i in row) / len(row)
        c = sum(cand[i] for i in row) / len(row)
        changes.append(c / r - 1)
    changes.sort()
    a = (1 - conf) / 2
    return (sum(cand) / len(cand)) / (sum(ref) / len(ref)) - 1, np.quantile(changes, a), np.quantile(changes, 1 - a)


@pytest.mark.parametrize("seed", [0, 7])
def test_bootstrap_equals_plain_numpy(seed):
    rng = np.random.default_rng(123)
    ref = list(rng.uniform(40, 60, 24))
    cand = [r * 1.1 + e for r, e in zip(ref, rng.normal(0, 2, 24))]
    iv = paired_bootstrap(ref, cand, n_boot=2000, seed=seed)
    change, low, high = plain_bootstrap(ref, cand, 2000, seed, 0.95)
    assert iv.change == pytest.approx(change, rel=1e-12)
    assert iv.low == pytest.approx(low, rel=1e-12) and iv.high == pytest.approx(high, rel=1e-12)
    assert iv.low < iv.change < iv.high and iv.excludes_zero()
    assert paired_bootstrap(ref, cand, n_boot=2000, seed=seed) == iv  # reproducible


def test_no_change_interval_covers_zero():
    x = np.linspace(10, 20, 30)
    iv = paired_bootstrap(x, x[::-1].copy(), n_boot=1000, seed=1)
    assert iv.change == pytest.approx(0, abs=1e-12) and iv.low < 0 < iv.high and not iv.excludes_zero()


def test_drift_limit():
    assert drift([100, 100], [104, 105]).valid
    d = drift([100, 100], [94, 95])
    assert not d.valid and d.change == pytest.approx(-0.055)
    assert "OUTSIDE the 5 % limit" in d.format()
    assert combined_se(3, 4) == 5


def test_bad_data():
    with pytest.raises(FleError, match="same length"):
        paired_bootstrap([1, 2, 3], [1, 2])
    with pytest.raises(FleError, match="at least 2"):
        paired_bootstrap([1], [1])


def test_bootstrap_agrees_with_scipy():
    """scipy's paired percentile bootstrap draws other resamples; with many
    of them both intervals agree to well within their width."""
    from scipy.stats import bootstrap

    rng = np.random.default_rng(11)
    ref = rng.uniform(40, 60, 40)
    cand = ref * 0.95 + rng.normal(0, 1.5, 40)
    iv = paired_bootstrap(ref, cand, n_boot=20000, seed=3)
    sp = bootstrap((ref, cand), lambda r, c, axis=-1: c.mean(axis=axis) / r.mean(axis=axis) - 1, paired=True,
                   vectorized=True, n_resamples=20000, method="percentile", random_state=np.random.default_rng(3))
    width = iv.high - iv.low
    assert abs(sp.confidence_interval.low - iv.low) < 0.05 * width
    assert abs(sp.confidence_interval.high - iv.high) < 0.05 * width
