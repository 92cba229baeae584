"""``--miss-split auto``'s decision (runtime.split.choose_share, job_model)
on given timings, against a direct simulation of the layer; and the CPU
team's job timing (team.job_seconds) that feeds it."""
from __future__ import annotations

import numpy as np
import pytest

from fle_engine.kernels.engine_ops import SHARE_ONE, cpu_count
from fle_engine.runtime.split import choose_share, job_model

K = 8


def simulated(share, cpu_job, base, miss, p, n_tokens=200_000, seed=0):
    """Mean layer time over random tokens: each routed expert missed with
    probability p, the slower side deciding."""
    n = np.random.default_rng(seed).binomial(K, p, n_tokens)
    c = cpu_count(n, share)
    cpu = np.where(c > 0, np.vectorize(cpu_job)(c), 0.0)
    return float(np.maximum(cpu, base + (n - c) * miss).mean())


@pytest.mark.parametrize("cpu_us,base_us,miss_us,p", [(39, 21, 87, 0.66), (55, 0, 87, 0.66), (20, 30, 90, 0.1),
                                                      (120, 10, 40, 0.5)])
def test_choice_is_the_best_share_of_the_simulation(cpu_us, base_us, miss_us, p):
    job = lambda m: cpu_us * 1e-6 * m
    s = choose_share(job, base_us * 1e-6, miss_us * 1e-6, K, p)
    t = simulated(s, job, base_us * 1e-6, miss_us * 1e-6, p)
    others = [simulated(o, job, base_us * 1e-6, miss_us * 1e-6, p) for o in range(0, SHARE_ONE + 1, 8)]
    assert t <= min(others) * 1.005


def test_no_base_balances_the_two_rates():
    # the CPU twice as fast per expert as the GPU's reads, nothing else on the GPU: about 2/3 to the CPU
    s = choose_share(lambda m: 40e-6 * m, 0.0, 80e-6, K, 0.66)
    assert abs(s / SHARE_ONE - 2 / 3) < 0.08


def test_gpu_work_of_its_own_moves_misses_to_the_cpu():
    job = lambda m: 40e-6 * m
    shares = [choose_share(job, base, 80e-6, K, 0.66) for base in (0.0, 40e-6, 120e-6, 400e-6)]
    assert shares == sorted(shares) and shares[-1] > shares[0]
    assert all(cpu_count(n, shares[-1]) == n for n in range(K + 1))      # the GPU busy enough: every miss to the CPU


def test_slow_cpu_gets_nothing():
    assert choose_share(lambda m: 2e-3 + 1e-3 * m, 0.0, 50e-6, K, 0.5) == 0


def test_job_model():
    f = job_model(3, 3e-6 * 40 + 10e-6, 6, 6e-6 * 40 + 10e-6)
    assert f(1) == pytest.approx(50e-6) and f(8) == pytest.approx(330e-6)
    g = job_model(3, 200e-6, 6, 190e-6)           # noise: no positive slope -> per expert only, from the larger job
    assert g(6) == pytest.approx(190e-6) and g(0) == 0.0


def test_job_seconds_times_the_team():
    from fle_engine.kernels.cpu_experts import Geometry
    from fle_engine.kernels.cpu_experts.team import job_seconds, measure
    from fle_quant.ggml_types import GGMLType
    from test_cpu_experts import experts_buffer

    lay = Geometry.of(256, 512, GGMLType.Q8_0, GGMLType.Q8_0)
    buf = experts_buffer(lay, 16, np.random.default_rng(0)).reshape(-1)
    # timings only (a loaded machine makes any order between them flaky): positive, finite, answered
    for n in (1, 4):
        t = job_seconds(buf, 0, lay, "numba", 1, K, 16, n, seconds=0.02)
        assert 0 < t < 5.0
    assert measure(buf, 0, lay, "numba", 1, K, 16, 4, seconds=0.02) > 0


def test_fast_cpu_gets_every_miss():
    assert choose_share(lambda m: 1e-6 * m, 50e-6, 80e-6, K, 0.5) == SHARE_ONE
