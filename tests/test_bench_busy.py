"""bench/engine_kernels.py's "busy" time: the union of the kernels'
intervals on the device (overlapping kernels counted once), read from
torch's profiler records."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_engine_kernels", ROOT / "bench" / "engine_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("spans, total", [
    ([], 0.0),
    ([(0, 2), (5, 6)], 3.0),                  # apart: summed
    ([(0, 4), (3, 6)], 6.0),                  # overlapping (a dependent launch started early): once
    ([(0, 10), (2, 3), (4, 5)], 10.0),        # inside another
    ([(5, 6), (0, 2), (1, 3)], 4.0),          # in any order
    ([(0, 1), (1, 2)], 2.0),                  # touching
])
def test_busy_intervals(bench, spans, total):
    assert bench.busy_intervals(spans) == total


def test_profiler_records_have_what_busy_time_reads():
    """The fields the busy time reads (device type, start and end) exist on this torch's records;
    on the CPU the records are CPU ops, so a CUDA filter would find none here."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(64).add_(1.0)
    evs = list(prof.events())
    assert evs and all(e.device_type == DeviceType.CPU for e in evs)
    assert all(e.time_range.end >= e.time_range.start for e in evs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_busy_time_of_kernels_is_below_the_replayed_time(bench):
    x = torch.randn(4096, 4096, device="cuda")
    y = torch.empty_like(x)

    def fn():
        for _ in range(8):
            y.copy_(x)
    busy = bench._busy_time(fn)
    assert busy is not None and 0 < busy <= bench._time_graph(fn) * 1.05
