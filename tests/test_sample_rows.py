"""``sampling.sample_rows``: the sampler chain for several rows at once
gives the tokens and random states of one-row calls, for shared and mixed
parameters, ties, -inf, NaN and rows with no finite logit."""
from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest

from fle_engine.sampling import Sampler, SamplerParams, sample_rows


def _rows(rng, kind, r, v):
    x = rng.standard_normal((r, v)).astype(np.float32) * np.float32(rng.choice([1, 5, 30]))
    if kind == "ties":
        x = np.round(x)
    elif kind == "masked":
        x[rng.random((r, v)) < 0.5] = -np.inf
    elif kind == "nan":
        x[0, int(rng.integers(v))] = np.nan
    elif kind == "dead":
        x[0] = -np.inf
    return x


def _same(a, b):
    return all(sa.rng._mt == sb.rng._mt and sa.rng._i == sb.rng._i for sa, sb in zip(a, b))


@pytest.mark.parametrize("kind", ["plain", "ties", "masked", "nan", "dead"])
def test_sample_rows_equals_one_row_calls(kind):
    rng = np.random.default_rng(7)
    warnings.simplefilter("ignore", RuntimeWarning)
    for trial in range(150):
        r, v = int(rng.integers(1, 5)), int(rng.choice([17, 512, 3000]))
        x = _rows(rng, kind, r, v)
        shared = SamplerParams(temp=float(rng.choice([0.0, 0.7, 1.5, 0.01])),
                               top_k=int(rng.choice([0, 1, 5, 40, 200, 4000])),
                               top_p=float(rng.choice([1.0, 0.95, 0.5, 0.0])),
                               min_p=float(rng.choice([0.0, 0.05, 0.5, 1.0])))
        params = [SamplerParams(shared.temp, shared.top_k, shared.top_p, shared.min_p, seed=int(rng.integers(2**32)))
                  if trial % 3 else SamplerParams(temp=float(rng.choice([0.0, 0.8])), seed=i) for i in range(r)]
        a = [Sampler(p) for p in params]
        b = copy.deepcopy(a)
        for _ in range(3):
            assert sample_rows(a, x) == [s(row) for s, row in zip(b, x)], (trial, params)
            assert _same(a, b)
