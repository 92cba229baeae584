"""The persistent CPU team (fle_engine.kernels.cpu_experts.team) driven
through its mailbox by a test thread standing in for the GPU: posted
layers, skipped layers (no CPU work), serials that jump ahead (the GPU
passed a step with no CPU work), several layers of different types, and
stop. Every result must equal the one-call fused kernel of the same backend
on the same experts bit for bit (the team sums in the same order)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from fle_engine.kernels import cpu_experts as ce
from fle_engine.kernels.cpu_experts import ggml_cpu
from fle_engine.kernels.cpu_experts.team import Team
from fle_quant.ggml_types import GGMLType

from test_cpu_experts import experts_buffer

IMPLS = ["numba"] + (["ggml"] if ggml_cpu.available() else [])
K, E = 6, 7


def make(rng, types):
    lays = [ce.Geometry.of(256, 512, gu, dn) for gu, dn in types]
    parts = [experts_buffer(lay, E, rng).reshape(-1) for lay in lays]
    offsets = np.cumsum([0] + [p.size for p in parts])[:-1]
    buf = np.concatenate(parts)
    return lays, buf, [int(o) for o in offsets]


class Mailbox:
    def __init__(self, n_layers, d):
        self.flags = np.zeros(n_layers, np.int64)
        self.done = np.zeros(n_layers, np.int64)
        self.boxes = np.zeros((n_layers, 3 * K + d), np.float32)
        self.results = np.zeros((n_layers, d), np.float32)
        self.stop = np.zeros(1, np.int64)

    def post(self, li, serial, ids, wts, miss, x, n_cpu):
        b = self.boxes[li]
        b[:K], b[K:2 * K], b[2 * K:3 * K], b[3 * K:] = ids, wts, miss, x
        self.flags[li] = serial * 256 + n_cpu

    def wait(self, li, serial, timeout=30.0):
        t0 = time.monotonic()
        while self.done[li] != serial:
            assert time.monotonic() - t0 < timeout, f"layer {li} of step {serial} not done"
            time.sleep(1e-5)


def want(buf, off, lay, ids, wts, miss, x, n_cpu, impl):
    mine = np.flatnonzero(miss)[-n_cpu:]
    view = buf[off:off + E * lay.expert_bytes].reshape(E, lay.expert_bytes)
    return ce.expert_forward(view, lay, x[None], ids[mine][None].astype(np.int64), wts[mine][None], impl=impl)[0]


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("threads", [1, 3])
def test_team_equals_the_fused_kernel(impl, threads):
    rng = np.random.default_rng(7 + threads)
    types = [(GGMLType.IQ4_XS, GGMLType.IQ4_XS), (GGMLType.Q4_K, GGMLType.Q6_K), (GGMLType.IQ3_S, GGMLType.Q8_0)]
    lays, buf, offs = make(rng, types)
    mb = Mailbox(len(lays), 512)
    team = Team(buf, offs, lays, impl, threads, mb.flags, mb.done, mb.boxes, mb.results, mb.stop, K)
    team.start()
    try:
        checked = 0
        serial = 1
        for step in range(6):
            if step == 3:
                serial += 2     # steps the CPU never saw (no CPU work in them)
            for li, lay in enumerate(lays):
                ids = rng.choice(E, K, replace=False).astype(np.float32)
                wts = rng.random(K).astype(np.float32)
                miss = (rng.random(K) < 0.6).astype(np.float32)
                n_miss = int(miss.sum())
                n_cpu = 0 if (step + li) % 4 == 0 else int(rng.integers(0, n_miss + 1))
                x = rng.standard_normal(512).astype(np.float32)
                mb.post(li, serial, ids, wts, miss, x, n_cpu)
                if n_cpu:
                    mb.wait(li, serial)
                    np.testing.assert_array_equal(mb.results[li], want(buf, offs[li], lay, ids, wts, miss, x,
                                                                       n_cpu, impl),
                                                  err_msg=f"step {step} layer {li} n_cpu {n_cpu}")
                    checked += n_cpu
                else:
                    time.sleep(1e-3)
                    assert mb.done[li] != serial, "a layer without CPU work was answered"
            serial += 1
        assert checked > 0 and team.experts == checked
        assert team.busy_seconds > 0
        assert team.alive()
    finally:
        mb.stop[0] = 1
        team.join()
    assert not team._threads


def test_team_refuses_the_reference_kernels():
    rng = np.random.default_rng(0)
    lays, buf, offs = make(rng, [(GGMLType.Q8_0, GGMLType.Q8_0)])
    mb = Mailbox(1, 512)
    with pytest.raises(ValueError, match="ggml or numba"):
        Team(buf, offs, lays, "reference", 1, mb.flags, mb.done, mb.boxes, mb.results, mb.stop, K)
