"""Cache misses shared between the CPU and the GPU's zero-copy reads.

Per decode step and MoE layer, the misses of a token are split by one
rule that the GPU kernels and the CPU worker apply to the same data: with
``n_miss`` of the K routed experts missing from the cache and a share
``s`` in 0..256, the CPU computes the last ``n_cpu = (n_miss * s + 128) //
256`` misses (in routing order) and the GPU everything else.

The hand-over needs no host synchronisation inside the step:

1. after routing, one GPU kernel (``post_misses``) writes the token's ids,
   weights, miss flags and normed activation into a page-locked mailbox of
   the layer and then, behind a system-scope fence, the layer's flag
   ``serial * 256 + n_cpu`` (``serial``: a step counter on the device);
2. a CPU worker thread waits for the flags layer by layer, computes its
   experts with the CPU kernels straight from the host expert buffer, writes
   the weighted sum and then the layer's ``done`` word (= serial);
3. the GPU computes the hits and its misses meanwhile; a last kernel
   (``wait_misses``) waits for ``done`` (or skips when the layer gave the CPU
   nothing) and adds the CPU's sum as one more residual part.

The GPU waits in step 3 only when the CPU is slower than the GPU's own
work in the layer; that wait is the cost of the split, and the share is
chosen so the two finish together: ``auto`` measures both sides at start
for this machine and file and takes the share of the shortest expected
layer (:func:`choose_share`). A wait that never ends (a dead worker) times out in the
kernel, raises an error flag and is reported as an error, not a hang.

A step of T rows (the verify step of drafted decoding, the batched step
of several sequences: ``Net.step_multi``) reads each distinct routed expert
of the step once for all rows routed to it, and splits by the same rule
over those distinct experts (:func:`union_cpu`): the layer's distinct
missed experts, ordered by the first row (row-major [T, K]) that routes to
each, give the CPU the last ``cpu_count(n_distinct, share)`` of them; the
CPU computes each of its experts once for every row routed to it (one read
of its weights, T activations) and hands back one weighted sum per row
(that row's CPU experts in routing order from zero), which the GPU adds to
the row as its last residual part. With T = 1 this is the one-token rule.
The mailbox has room for ``t_max`` rows: the post writes T into the layer's
``rows`` word and the box holds ids, weights and miss flags of the T x K
rows, then the T activations; the result holds T rows.

Without CUDA (the reference side, tests) the same rule runs synchronously:
the post computes the CPU share at once.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import torch
from numba import njit

from fle_quant.errors import FleError

from ..kernels.cpu_experts.team import Team, load_acquire as _load_acquire, store_release as _store_release
# the rule of the CPU's share lives with the kernels that follow it (engine_ops; the Triton kernels' _union_n_cpu)
from ..kernels.engine_ops import SHARE_ONE, cpu_count, union_cpu
from .weights import PageLocked

__all__ = ["SHARE_ONE", "cpu_count", "union_cpu", "split_bytes", "parse_split", "choose_share", "job_model",
           "MissSplit", "CpuExperts", "cpu_experts"]

def split_bytes(ids, hits, expert_bytes, n_used: int, share: int) -> dict:
    """Bytes of missed experts that a T-row step reads, from its routing log
    (``ids``, ``hits`` [L, T K] per layer, ``expert_bytes`` [L]), against
    the sum over its T tokens (what T one-token steps read): ``pcie`` and
    ``cpu`` (the step: each distinct missed expert once, split by
    :func:`union_cpu`'s count), ``pcie_sum`` and ``cpu_sum`` (each token
    alone, split by the one-token rule). One pass of array operations over
    all layers (it runs on every batched step): only the counts of
    :func:`union_cpu` matter here, not which experts the CPU takes."""
    ids, hits = np.asarray(ids), np.asarray(hits)
    miss = hits == 0
    if not miss.any():                  # every routed expert in its slot
        return dict(pcie=0, cpu=0, pcie_sum=0, cpu_sum=0)
    eb = np.asarray(expert_bytes, dtype=np.int64).reshape(-1)[:ids.shape[0]]
    # distinct missed experts per layer: the sorted ids of the missed rows (others -1), changes counted
    m = np.sort(np.where(miss, ids.astype(np.int64), -1), axis=1)
    distinct = ((m[:, 1:] != m[:, :-1]) & (m[:, 1:] >= 0)).sum(axis=1) + (m[:, 0] >= 0)
    per_tok = miss.reshape(ids.shape[0], -1, n_used).sum(axis=2)          # [L, T] each token's misses
    if share:
        n_cpu = cpu_count(distinct, share)
        c_tok = cpu_count(per_tok, share).sum(axis=1)
    else:
        n_cpu = c_tok = np.zeros_like(distinct)
    n_tok = per_tok.sum(axis=1)
    return dict(pcie=int(((distinct - n_cpu) * eb).sum()), cpu=int((n_cpu * eb).sum()),
                pcie_sum=int(((n_tok - c_tok) * eb).sum()), cpu_sum=int((c_tok * eb).sum()))


def cpu_threads() -> int:
    """Threads of the CPU's expert kernels in the engine: FLE_CPU_THREADS, or
    about 3/4 of the cores this process may use."""
    import os

    env = os.environ.get("FLE_CPU_THREADS")
    if env:
        return max(1, int(env))
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    import numba

    # leave cores to the spinning worker, the engine's loop and the CUDA driver's threads: on the 16-core
    # GPU machine 11 threads gave the CPU 21.5 GB/s inside the engine, all 16 under 5 GB/s
    return max(1, min(numba.config.NUMBA_NUM_THREADS, n - max(2, n // 4 + 1)))


def parse_split(text) -> "str | int":
    """``--miss-split``: "auto", "gpu" (0), "cpu" (all) or a fraction in
    [0, 1] -> "auto" or a share in 0..256."""
    if text is None or text == "gpu":
        return 0
    if text == "auto":
        return "auto"
    if text == "cpu":
        return SHARE_ONE
    try:
        f = float(text)
    except (TypeError, ValueError):
        f = float("nan")
    if not 0.0 <= f <= 1.0:
        raise FleError(f"--miss-split {text!r}: give auto, cpu, gpu or the CPU's fraction of the misses "
                       f"(0 to 1)")
    return int(round(f * SHARE_ONE))


def choose_share(cpu_job, gpu_base: float, gpu_miss: float, n_used: int, p_miss: float) -> int:
    """``--miss-split auto``'s decision from its measurements: the CPU's
    share (0..256) that minimises a layer's expected time when each of its
    ``n_used`` routed experts misses independently with probability
    ``p_miss``. With n misses the CPU computes ``cpu_count(n, share)`` of
    them (``cpu_job(m)``: seconds for a job of m experts, posted to the
    answer) while the GPU runs the layer's expert launch (``gpu_base``
    seconds with every expert in a slot) and reads the other misses over
    PCIe (``gpu_miss`` seconds each); the layer goes on when the slower side
    ends. Shares with equal expected times (the rule rounds to whole
    experts) are a range; its middle is taken, or 0 (no CPU work) or
    SHARE_ONE (every miss) when the range reaches them."""
    from scipy.stats import binom

    n = np.arange(n_used + 1)
    pn = binom.pmf(n, n_used, min(max(p_miss, 0.0), 1.0))
    job = np.array([cpu_job(m) if m else 0.0 for m in n])
    shares = np.arange(SHARE_ONE + 1)
    c = cpu_count(n[None, :], shares[:, None])                        # [shares, n]
    t = np.maximum(job[c], gpu_base + (n[None, :] - c) * gpu_miss)
    e = t @ pn
    best = np.flatnonzero(e <= e.min() * (1 + 1e-9))
    if best[0] == 0 or best[-1] == SHARE_ONE:
        return int(best[0] if best[0] == 0 else SHARE_ONE)
    return int(best[len(best) // 2])


def job_model(n1: int, t1: float, n2: int, t2: float):
    """Seconds of a CPU job of m experts, ``a + b m``, from jobs of ``n1``
    and ``n2`` experts timed at ``t1`` and ``t2`` seconds (a per-expert cost
    alone when the two do not give a positive one)."""
    b = (t2 - t1) / (n2 - n1) if n2 != n1 else 0.0
    if b <= 0:
        b, a = t2 / n2, 0.0
    else:
        a = max(0.0, t1 - b * n1)
    return lambda m: a + b * m


# ---------------------------------------------------------------------------
# the reference kernels' worker: one Python thread (the vectorised kernels run in a team of their own,
# kernels.cpu_experts.team)


@njit(nogil=True, cache=True)
def _wait_flag(flags, il, serial, stop):
    """Spin until layer ``il``'s flag carries ``serial`` or later; -1 when
    ``stop`` is set."""
    n = 0
    while True:
        f = _load_acquire(flags, il)
        if (f >> 8) >= serial:
            return f
        n += 1
        if (n & 1023) == 0 and _load_acquire(stop, 0) != 0:
            return -1


@njit(nogil=True, cache=True)
def _signal(done, il, serial):
    _store_release(done, il, serial)


# ---------------------------------------------------------------------------
# the CPU's experts


class CpuExperts:
    """The CPU side's expert forward with the vectorised CPU kernels
    (:mod:`fle_engine.kernels.cpu_experts`: "auto" is
    :func:`~fle_engine.kernels.cpu_experts.preferred`: FLE's numba kernels
    where their AVX-512 row kernels cover the file's expert types, else
    ggml's dot products where llama-cpp-python's library is present; or the
    table's plain reference), reading the host expert buffer in place; with
    the experts memory-mapped in the file (``host.mapped``) each call first
    gathers its distinct experts into a scratch buffer (:meth:`_experts`)."""

    def __init__(self, host, layouts, impl: str = "auto"):
        from ..kernels import cpu_experts as ce

        self.host, self.layouts, self._ce = host, layouts, ce
        if impl == "auto":
            impl = ce.preferred({t for lay in layouts.values() for t in (lay.gu_type, lay.down_type)})
        for lay in layouts.values():
            ce.pick(lay.gu_type, impl)
            ce.pick(lay.down_type, impl)
        self.impl = self.name = impl
        self.mapped = bool(host.mapped)
        self._views = {} if self.mapped else {il: host.view(il).numpy() for il in layouts}
        self._scratch: dict[int, np.ndarray] = {}       # expert bytes -> packed rows (mapped experts)
        # the backend's forward called directly: the worker's arguments are the engine's own buffers, checked
        # once here rather than on every call
        self._forward = {il: ce.pick(lay.gu_type, impl).forward for il, lay in layouts.items()}
        for il, lay in layouts.items():
            if ce.pick(lay.down_type, impl) is not ce.pick(lay.gu_type, impl):
                raise FleError(f"layer {il}: --cpu-kernels {impl} has no single backend for {lay.gu_type.name} "
                               f"and {lay.down_type.name}")
        n = max(lay.n_embd for lay in layouts.values())
        self._tmp = np.zeros((1, n), np.float32)

    def ffn(self, il: int, experts, weights, x: np.ndarray, out: np.ndarray) -> None:
        lay = self.layouts[il]
        tmp = self._tmp[:, :lay.n_embd]
        ids = np.ascontiguousarray(experts, np.int64).reshape(1, -1)
        if ids.size == 0:
            return
        rows, ids = self._experts(il, ids)
        self._forward[il](rows, lay, np.ascontiguousarray(x, np.float32).reshape(1, -1), ids,
                          np.ascontiguousarray(weights, np.float32).reshape(1, -1), tmp, self._ce.CHUNK)
        out += tmp[0]

    def ffn_rows(self, il: int, ids: np.ndarray, weights: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
        """The experts of T rows at once: ``ids`` int64 [T, K] (negative: not
        here), ``weights`` [T, K], ``x`` [T, D] -> ``out`` [T, D] (written):
        each distinct expert read once for all its rows, row t the sum over
        its experts in routing order from zero."""
        lay = self.layouts[il]
        out[:] = 0.0
        if not (ids >= 0).any():
            return
        rows, ids = self._experts(il, np.ascontiguousarray(ids, np.int64))
        self._forward[il](rows, lay, np.ascontiguousarray(x, np.float32), ids,
                          np.ascontiguousarray(weights, np.float32), out, self._ce.CHUNK)

    def _experts(self, il: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(packed experts, ``ids`` into them): layer ``il``'s host buffer
        and the ids as they are; or, memory-mapped, the distinct ids
        gathered into scratch rows in increasing order and the ids remapped
        to those rows (the order of the ids is kept, so the sums are the
        same)."""
        if not self.mapped:
            return self._views[il], ids
        here = ids >= 0
        uniq, inv = np.unique(ids[here], return_inverse=True)
        eb = self.layouts[il].expert_bytes
        buf = self._scratch.get(eb)
        if buf is None or buf.shape[0] < len(uniq):
            buf = self._scratch[eb] = np.empty((max(len(uniq), 8), eb), np.uint8)
        local = np.full(ids.shape, -1, np.int64)
        local[here] = inv.reshape(-1)
        return self.host.gather(il, uniq, buf), local


def cpu_experts(host, layouts, impl: str = "auto"):
    """The CPU expert forward for ``impl`` (a backend of the CPU kernels'
    dispatch table: "auto", "ggml", "numba" or "reference")."""
    return CpuExperts(host, layouts, impl)


# ---------------------------------------------------------------------------


class _Mapped:
    """A host address that the GPU reads and writes directly (a registered,
    mapped buffer), as Triton takes pointers."""

    def __init__(self, addr: int, dtype: torch.dtype):
        self._addr, self.dtype = int(addr), dtype

    def data_ptr(self) -> int:
        return self._addr


class MissSplit(PageLocked):
    """The mailbox, the worker and the share of one engine.

    ``layers``: the layers whose misses are split (those that can miss);
    ``share``: the CPU's share of the misses, 0..256; ``t_max``: the most
    rows of one step (the one-token step: 1; the verify step and the
    batched step of several sequences: more)."""

    def __init__(self, cpu, layers, n_embd: int, n_used: int, share: int, cuda: bool, log=print, t_max: int = 1):
        self.cpu, self.layers = cpu, sorted(layers)
        self.index = {il: i for i, il in enumerate(self.layers)}
        self.n_embd, self.n_used, self.share = int(n_embd), int(n_used), int(share)
        self.t_max = max(1, int(t_max))
        self.cuda, self.log = cuda, log
        L, K, D, TM = len(self.layers), self.n_used, self.n_embd, self.t_max
        self.box_words = TM * (3 * K + D)
        # stop/err, flags/done/rows (int64), results, boxes
        words = 2 * 8 + 3 * L * 2 + L * TM * D + L * self.box_words
        self.buf = np.zeros(words + 64, np.float32)
        if cuda:
            self.lock("the CPU-miss mailbox", "run with --miss-split gpu")
        i64 = self.buf[:16 + 6 * L].view(np.int64)
        self.stop, self.err = i64[0:1], i64[1:2]
        self.flags, self.done = i64[8:8 + L], i64[8 + L:8 + 2 * L]
        self.rows = i64[8 + 2 * L:8 + 3 * L]        # the rows T of the layer's last post
        self.rows[:] = 1
        o = 16 + 6 * L
        self.results = self.buf[o:o + L * TM * D].reshape(L, TM * D)
        o += L * TM * D
        self.boxes = self.buf[o:o + L * self.box_words].reshape(L, self.box_words)
        self._expect = 1
        self.threads = cpu_threads()
        self._busy, self._experts = 0.0, 0
        self.trace = None       # a list: (layer, rows, the CPU's experts) of every process() (tests)
        self._thread = self.team = None
        if cuda:
            # the team reads the host buffer by its address: memory-mapped experts go through the worker thread
            if cpu.impl in ("ggml", "numba") and not cpu.mapped:
                host = cpu.host
                self.team = Team(host.buf, [host.offsets[il] for il in self.layers],
                                 [cpu.layouts[il] for il in self.layers], cpu.impl, self.threads, self.flags,
                                 self.done, self.boxes, self.results, self.stop, self.n_used, rows=self.rows,
                                 t_max=TM)
                self.team.start()
            else:
                _wait_flag(self.flags, 0, 0, self.stop)      # compile before the first step
                _signal(self.done, 0, 0)
                self._thread = threading.Thread(target=self._run, name="fle-cpu-misses", daemon=True)
                self._thread.start()

    def rows_fit(self, n_rows: int) -> bool:
        """Whether a step of ``n_rows`` rows fits the mailbox (its CPU count in the flag's low byte)."""
        return n_rows <= self.t_max and n_rows * self.n_used <= 255

    def box(self, il: int, n_rows: int):
        """Layer ``il``'s mailbox as (ids, weights, miss flags) [T K] and x [T, D] views."""
        R, D = n_rows * self.n_used, self.n_embd
        b = self.boxes[self.index[il]]
        return b[:R], b[R:2 * R], b[2 * R:3 * R], b[3 * R:3 * R + n_rows * D].reshape(n_rows, D)

    def result(self, il: int, n_rows: int) -> np.ndarray:
        """Layer ``il``'s CPU sums of ``n_rows`` rows, [T, D] (a view)."""
        return self.results[self.index[il], :n_rows * self.n_embd].reshape(n_rows, self.n_embd)

    @property
    def busy_seconds(self) -> float:
        """Seconds the CPU spent on its experts (from a layer's post to its done)."""
        return self._busy + (self.team.busy_seconds if self.team is not None else 0.0)

    @property
    def cpu_experts(self) -> int:
        """Experts the CPU computed."""
        return self._experts + (self.team.experts if self.team is not None else 0)

    # device-side addresses -----------------------------------------------------------
    def flag_ptr(self, il):
        return _Mapped(self.flags[self.index[il]:].ctypes.data, torch.int64)

    def done_ptr(self, il):
        return _Mapped(self.done[self.index[il]:].ctypes.data, torch.int64)

    def rows_ptr(self, il):
        return _Mapped(self.rows[self.index[il]:].ctypes.data, torch.int64)

    def err_ptr(self):
        return _Mapped(self.err.ctypes.data, torch.int64)

    def result_ptr(self, il):
        return _Mapped(self.results[self.index[il]].ctypes.data, torch.float32)

    def box_ptr(self, il):
        return _Mapped(self.boxes[self.index[il]].ctypes.data, torch.float32)

    # the CPU's work ------------------------------------------------------------------
    def process(self, il: int, n_cpu: int) -> None:
        """Compute layer ``il``'s CPU share from its mailbox into its result:
        the last ``n_cpu`` of the distinct missed experts of its T rows
        (:func:`union_cpu`), each once for all its rows."""
        t0 = time.perf_counter()
        i = self.index[il]
        T = min(max(int(self.rows[i]), 1), self.t_max)
        ids_f, wts, miss_f, x = self.box(il, T)
        ids = ids_f.astype(np.int64)
        order, _ = union_cpu(ids, miss_f > 0.5, 0)
        mine = order[len(order) - n_cpu:] if n_cpu > 0 else []
        sel = np.where(np.isin(ids, np.asarray(mine, np.int64)), ids, -1).reshape(T, self.n_used)
        out = self.result(il, T)
        self.cpu.ffn_rows(il, sel, wts.reshape(T, self.n_used), x, out)
        self._experts += len(mine)
        if self.trace is not None:
            self.trace.append((il, T, tuple(mine)))
        self._busy += time.perf_counter() - t0

    def _run(self) -> None:
        try:
            # not every core: a parallel region on every core waits for whichever thread the OS has just
            # descheduled (see cpu_threads)
            import numba

            numba.set_num_threads(self.threads)
            while True:
                for il in self.layers:
                    f = _wait_flag(self.flags, self.index[il], self._expect, self.stop)
                    if f < 0:
                        return
                    serial, n_cpu = int(f) >> 8, int(f) & 255
                    # a later serial: the GPU passed the rest of the earlier step without CPU work
                    self._expect = serial
                    if n_cpu:
                        self.process(il, n_cpu)
                        _signal(self.done, self.index[il], serial)
                self._expect += 1
        except BaseException as e:  # noqa: BLE001 - reported by check(); the GPU's wait times out
            self.failure = e
            self.err[0] = 2

    def check(self) -> None:
        """Raise when the worker failed or a GPU wait timed out."""
        if self.team is not None and not self.team.alive() and int(self.stop[0]) == 0:
            self.err[0] = 2
        if int(self.err[0]) != 0:
            why = getattr(self, "failure", None)
            raise FleError("the CPU-miss worker " + (f"failed: {why}" if why is not None else
                                                     "did not answer in time") + "; run with --miss-split gpu")

    def close(self) -> None:
        if getattr(self, "stop", None) is not None:
            self.stop[0] = 1
        if getattr(self, "_thread", None) is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if getattr(self, "team", None) is not None:
            self.team.join()
            self.team = None
        super().close()
