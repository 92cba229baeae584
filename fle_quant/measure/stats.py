"""The statistics the measurement tools share.

* :func:`paired_bootstrap` -- percentile bootstrap interval of the relative
  change ``mean(candidate) / mean(reference) - 1`` over paired observations
  (the same prompt or question in both arms), resampling the pairs.
* :func:`drift` -- the relative change of the reference between its first
  and its second pass in a bracket, and whether it is inside the validity
  limit (5 % by default): a bracket whose reference moved more than that
  measured the machine, not the candidates.
* :func:`combined_se` -- two independent standard errors combined.

The bootstrap draws its resamples with NumPy's ``default_rng(seed)``, one
``integers(0, n, (n_boot, n))`` matrix of pair indices, so that a result is
reproducible from the data and the seed alone.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import FleError

__all__ = ["Interval", "paired_bootstrap", "paired_bootstrap_diff", "mcnemar_exact", "drift", "combined_se", "DRIFT_LIMIT", "N_BOOT"]

DRIFT_LIMIT = 0.05
N_BOOT = 10000


@dataclass
class Interval:
    """A relative change and its bootstrap interval (fractions: 0.05 is +5 %)."""

    change: float
    low: float
    high: float
    confidence: float
    n: int
    n_boot: int
    seed: int

    def as_dict(self) -> dict:
        return asdict(self)

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def format(self) -> str:
        return (f"{100 * self.change:+.2f} % [{100 * self.low:+.2f}, {100 * self.high:+.2f}] "
                f"({100 * self.confidence:g} %, n={self.n})")


def _paired_arrays(reference, candidate) -> tuple[np.ndarray, np.ndarray]:
    ref = np.asarray(reference, dtype=np.float64)
    cand = np.asarray(candidate, dtype=np.float64)
    if ref.ndim != 1 or ref.shape != cand.shape:
        raise FleError(f"paired data need two lists of the same length, got {ref.shape} and {cand.shape}")
    if ref.size < 2:
        raise FleError(f"a paired interval needs at least 2 pairs, got {ref.size}")
    if not (np.isfinite(ref).all() and np.isfinite(cand).all()):
        raise FleError("paired data hold a NaN or infinite value")
    return ref, cand


def paired_bootstrap(reference, candidate, *, n_boot: int = N_BOOT, seed: int = 0,
                     confidence: float = 0.95) -> Interval:
    """Relative change of the candidate's mean against the reference's, with
    the percentile bootstrap interval over resampled pairs."""
    ref, cand = _paired_arrays(reference, candidate)
    if not 0 < confidence < 1:
        raise FleError(f"confidence must be between 0 and 1, got {confidence}")
    if n_boot < 100:
        raise FleError(f"a bootstrap needs at least 100 resamples, got {n_boot}")
    if ref.mean() == 0:
        raise FleError("the reference's mean is 0; a relative change is not defined")
    change = float(cand.mean() / ref.mean() - 1)
    n = ref.size
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, (n_boot, n))
    ref_means = ref[idx].mean(axis=1)
    ratios = np.where(ref_means != 0, cand[idx].mean(axis=1) / np.where(ref_means != 0, ref_means, 1) - 1, np.nan)
    ratios = ratios[np.isfinite(ratios)]
    alpha = (1 - confidence) / 2
    low, high = np.quantile(ratios, [alpha, 1 - alpha])
    return Interval(change, float(low), float(high), confidence, int(n), int(n_boot), int(seed))


@dataclass
class Drift:
    """The reference's second pass against its first."""

    change: float
    limit: float

    @property
    def valid(self) -> bool:
        return abs(self.change) <= self.limit

    def as_dict(self) -> dict:
        return {"change": self.change, "limit": self.limit, "valid": self.valid}

    def format(self) -> str:
        return (f"reference drift {100 * self.change:+.2f} % "
                f"({'within' if self.valid else 'OUTSIDE'} the {100 * self.limit:g} % limit)")


def drift(first, second, limit: float = DRIFT_LIMIT) -> Drift:
    """Relative change of the mean from the reference's first pass to its second."""
    a = np.asarray(first, dtype=np.float64)
    b = np.asarray(second, dtype=np.float64)
    if a.size == 0 or b.size == 0 or a.mean() == 0:
        raise FleError("reference drift needs speeds from both reference passes")
    return Drift(float(b.mean() / a.mean() - 1), float(limit))


def combined_se(a: float, b: float) -> float:
    """Standard error of a difference of two independent estimates."""
    return math.sqrt(a * a + b * b)


def paired_bootstrap_diff(a, b, *, n_boot: int = N_BOOT, seed: int = 0, confidence: float = 0.95) -> Interval:
    """Difference of means ``mean(b) - mean(a)`` over paired observations
    (e.g. 0/1 correctness of the same questions on two servers), with the
    percentile bootstrap interval; the same resampling as
    :func:`paired_bootstrap`."""
    x, y = _paired_arrays(a, b)
    if n_boot < 100:
        raise FleError(f"a bootstrap needs at least 100 resamples, got {n_boot}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, (n_boot, x.size))
    diffs = y[idx].mean(axis=1) - x[idx].mean(axis=1)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(diffs, [alpha, 1 - alpha])
    return Interval(float(y.mean() - x.mean()), float(low), float(high), confidence, int(x.size), int(n_boot),
                    int(seed))


def mcnemar_exact(a, b) -> tuple[int, int, float]:
    """Exact McNemar test of paired 0/1 outcomes: the discordant counts
    (a right and b wrong, a wrong and b right) and the two-sided p-value of
    the binomial test on them (scipy)."""
    from scipy.stats import binomtest

    x = np.asarray(a, dtype=bool)
    y = np.asarray(b, dtype=bool)
    n10 = int((x & ~y).sum())
    n01 = int((~x & y).sum())
    if n10 + n01 == 0:
        return n10, n01, 1.0
    return n10, n01, float(binomtest(n10, n10 + n01, 0.5).pvalue)
