"""A persistent team of CPU threads that computes one token's missed
experts layer by layer, fed through a mailbox in shared memory.

The engine's CPU share of the misses is small work at a high rate: one or a
few experts (a few MB of weights) per layer, 48 layers per token, each on
the critical path of the GPU's step. A call into a thread pool per layer
pays the pool's wake-up and the interpreter's overhead each time (about
100 us measured in the engine, more than the experts' own reading time), so
the team never leaves compiled code: ``threads`` OS threads each run one
nogil numba loop for the team's whole life.

The protocol (the mailbox's words are numpy arrays; the GPU writes them in
the engine, a test's thread in the tests):

- ``flags[i]`` = ``serial * 256 + n_cpu``: layer ``i`` of step ``serial``
  is posted; its ``box[i]`` holds the token's ``ids``, ``weights``, ``miss``
  flags (K each, float32) and the normed activation ``x``. The CPU computes
  the last ``n_cpu`` misses in routing order.
- member 0 (the leader) waits for the flags in layer order, as the worker
  of :mod:`fle_engine.runtime.split` did, and publishes each layer with CPU
  work as a job (a generation counter); the other members wait for the
  generation only, so that all members always work on the same job.
- a job: every member quantizes ``x`` for itself, computes its contiguous
  share of the gate and up rows of all the job's experts, meets the others
  at a barrier, makes ``silu(gate) * up`` of every expert (quantized for
  the down rows) for itself, and computes its share of the output rows:
  ``out[r] = sum_p w_p * down_p[r] . h_p`` in routing order from zero (the
  order of :func:`.plan.weighted_sum`, so the result equals the one-call
  kernels' bit for bit). The leader waits for all members, then stores
  ``done[i] = serial`` (release).
- ``stop[0] != 0`` ends every member; idle members sleep 0.1 ms between
  looks after 50 ms without work, so an idle engine does not hold the cores.

Two kernels: ggml's ``vec_dot`` / ``from_float`` by address (as
:mod:`.ggml_cpu`) or FLE's row kernels by address (:mod:`.rows`, the ones
:func:`.fle_numba.forward` runs), so the members' loop holds no type's code. This module does
not import torch.
"""
from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import fle_numba
from .acts import quantize_row
from .ggml_cpu import _call_from_float, _call_vec_dot
from .plan import silu_mul_row
from .rows import arrange, call_rows, layout, rows_address

__all__ = ["Team", "measure", "load_acquire", "store_release", "fetch_add"]

# job words
_J_LAYER, _J_NCPU, _J_SERIAL = 0, 1, 2
# sync words (each on its own cache line: 8 int64 apart)
_S_GEN, _S_MID, _S_END = 0, 8, 16
# statistics
_T_BUSY_NS, _T_EXPERTS, _T_JOBS = 0, 1, 2
# per-layer parameters
(_P_OFF, _P_EB, _P_GU_RB, _P_NFF, _P_DOFF, _P_D_RB, _P_NEMBD, _P_GU_VD, _P_GU_FF, _P_GU_QB, _P_D_VD, _P_D_FF,
 _P_D_QB, _P_GU_CODE, _P_D_CODE, _P_GU_ROWS, _P_D_ROWS, _P_GU_LAY, _P_D_LAY) = range(19)
_NP = 20
KIND_GGML, KIND_NUMBA = 0, 1

_IDLE_NS = 50_000_000
_NAP_US = 100


# ---------------------------------------------------------------------------
# ordered and atomic accesses to int64 words, and two libc calls


def _item_ptr(context, builder, sig, args):
    """The address of arr[idx] for an intrinsic's (arr, idx, ...) arguments."""
    aryty = sig.args[0]
    ary = context.make_array(aryty)(context, builder, args[0])
    return cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]])


@intrinsic
def load_acquire(typingctx, arr, idx):
    def codegen(context, builder, sig, args):
        ptr = _item_ptr(context, builder, sig, args)
        return builder.load_atomic(ptr, "acquire", 8)
    return arr.dtype(arr, idx), codegen


@intrinsic
def store_release(typingctx, arr, idx, val):
    def codegen(context, builder, sig, args):
        ptr = _item_ptr(context, builder, sig, args)
        builder.store_atomic(args[2], ptr, "release", 8)
        return context.get_dummy_value()
    return types.void(arr, idx, val), codegen


@intrinsic
def fetch_add(typingctx, arr, idx, val):
    """arr[idx] += val atomically; returns the old value."""
    def codegen(context, builder, sig, args):
        ptr = _item_ptr(context, builder, sig, args)
        return builder.atomic_rmw("add", ptr, args[2], "seq_cst")
    return arr.dtype(arr, idx, val), codegen


@intrinsic
def _call_clock(typingctx, fn, ts):
    """clock_gettime(CLOCK_MONOTONIC, ts) with ``ts`` int64 [2]."""
    sig = types.void(types.int64, ts)

    def codegen(context, builder, signature, args):
        fn_, ts_ = args
        i32, i64 = ir.IntType(32), ir.IntType(64)
        ary = context.make_array(signature.args[1])(context, builder, ts_)
        fnty = ir.FunctionType(i32, [i32, i64.as_pointer()])
        f = builder.inttoptr(fn_, fnty.as_pointer())
        builder.call(f, [i32(1), ary.data])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _call_usleep(typingctx, fn, us):
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        fn_, us_ = args
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(i32, [i32])
        f = builder.inttoptr(fn_, fnty.as_pointer())
        builder.call(f, [builder.trunc(us_, i32)])
        return context.get_dummy_value()

    return sig, codegen


def _libc_addresses() -> tuple[int, int]:
    libc = ctypes.CDLL(None)
    return (ctypes.cast(libc.clock_gettime, ctypes.c_void_p).value, ctypes.cast(libc.usleep, ctypes.c_void_p).value)


@njit(nogil=True, cache=True, inline="always")
def _now(clk, ts):
    _call_clock(clk, ts)
    return ts[0] * 1_000_000_000 + ts[1]


@njit(nogil=True, cache=True)
def _wait_at_least(words, i, target, shift, stop, clk, nap, ts):
    """Spin until ``words[i] >> shift >= target`` (returns words[i]) or stop
    (returns -1); naps after a long idle time. shift 0: a counter; shift 8:
    a layer's flag (serial * 256 + n)."""
    n = 0
    t0 = np.int64(0)
    while True:
        v = load_acquire(words, i)
        if (v >> shift) >= target:
            return v
        n += 1
        if (n & 1023) == 0:
            if load_acquire(stop, 0) != 0:
                return np.int64(-1)
            t = _now(clk, ts)
            if t0 == 0:
                t0 = t
            elif t - t0 > _IDLE_NS:
                _call_usleep(nap, _NAP_US)


# ---------------------------------------------------------------------------
# one job


@njit(nogil=True, cache=True, inline="always")
def _rows(fn, w, stride, r0, r1, nb, xq, xd, xs, arow, orow, out):
    """Row kernel ``fn`` (.rows) on rows r0..r1 at address w: activation row
    arow[0] of (xq, xd, xs) into out[orow[0], r0:r1]."""
    call_rows(fn, w, stride, r0, r1, nb, np.int64(xq.ctypes.data), np.int64(xd.ctypes.data),
              np.int64(xs.ctypes.data), xq.shape[0], xq.shape[1], xd.shape[1], xs.shape[1],
              np.int64(arow.ctypes.data), np.int64(orow.ctypes.data), 1, np.int64(out.ctypes.data), out.shape[1])


@njit(nogil=True, cache=True)
def _job(tid, nthr, kind, p, buf, li, n_cpu, box, K, res, sync, gen, g, u, sel, xq, xq8, xd, xs, hq, hq8, hd, hs,
         acc, arow, sel2, dn, tmp, h):
    """One member's part of layer ``li``'s job (module docstring); ``p``:
    the layer's parameters."""
    base_off, eb, gu_rb, n_ff = p[_P_OFF], p[_P_EB], p[_P_GU_RB], p[_P_NFF]
    d_off, d_rb, n_embd = p[_P_DOFF], p[_P_D_RB], p[_P_NEMBD]
    gu_code, d_code = p[_P_GU_CODE], p[_P_D_CODE]
    # the last n_cpu misses in routing order, in routing order
    n_miss = 0
    for j in range(K):
        if box[2 * K + j] > 0.5:
            n_miss += 1
    c = 0
    m = 0
    for j in range(K):
        if box[2 * K + j] > 0.5:
            if m >= n_miss - n_cpu:
                sel[c] = j
                c += 1
            m += 1
    x = box[3 * K:3 * K + n_embd]
    addr = np.int64(buf.ctypes.data) + base_off
    if kind == KIND_GGML:
        _call_from_float(p[_P_GU_FF], np.int64(x.ctypes.data), np.int64(xq.ctypes.data), n_embd)
    else:
        quantize_row(x, fle_numba.dot_k(gu_code), xd[0], xq8[0, :n_embd], xs[0], tmp)
        arrange(p[_P_GU_LAY], xq8[0, :n_embd])
    # gate and up rows: this member's contiguous share of the n_cpu * n_ff
    rows = n_cpu * n_ff
    r0 = tid * rows // nthr
    r1 = (tid + 1) * rows // nthr
    nbg = gu_rb // fle_numba.BLOCK_BYTES[gu_code]
    if kind == KIND_GGML:
        for q in range(r0, r1):
            pp = q // n_ff
            r = q - pp * n_ff
            e = np.int64(box[sel[pp]])
            wg = e * eb + r * gu_rb
            wu = e * eb + (n_ff + r) * gu_rb
            _call_vec_dot(p[_P_GU_VD], n_embd, np.int64(g[pp, r:].ctypes.data), addr + wg, np.int64(xq.ctypes.data))
            _call_vec_dot(p[_P_GU_VD], n_embd, np.int64(u[pp, r:].ctypes.data), addr + wu, np.int64(xq.ctypes.data))
    else:
        # the row kernel (.rows) on each expert's part of the share: output row pp of g and u
        for pp in range(r0 // n_ff, min(n_cpu, (r1 + n_ff - 1) // n_ff)):
            a = max(r0 - pp * n_ff, 0)
            b = min(r1 - pp * n_ff, n_ff)
            if a >= b:
                continue
            w = addr + np.int64(box[sel[pp]]) * eb
            sel2[0] = pp
            _rows(p[_P_GU_ROWS], w, gu_rb, a, b, nbg, xq8, xd, xs, arow, sel2, g)
            _rows(p[_P_GU_ROWS], w + n_ff * gu_rb, gu_rb, a, b, nbg, xq8, xd, xs, arow, sel2, u)
    # every member's gate and up rows are in
    fetch_add(sync, _S_MID, np.int64(1))
    while load_acquire(sync, _S_MID) < gen * nthr:
        pass
    # silu(gate) * up of every expert, quantized, for this member
    for pp in range(n_cpu):
        silu_mul_row(g[pp, :n_ff], u[pp, :n_ff], h[:n_ff])
        if kind == KIND_GGML:
            _call_from_float(p[_P_D_FF], np.int64(h.ctypes.data), np.int64(hq[pp].ctypes.data), n_ff)
        else:
            quantize_row(h[:n_ff], fle_numba.dot_k(d_code), hd[pp], hq8[pp, :n_ff], hs[pp], tmp)
            arrange(p[_P_D_LAY], hq8[pp, :n_ff])
    # output rows: this member's share, each the sum over the experts in routing order from zero
    r0 = tid * n_embd // nthr
    r1 = (tid + 1) * n_embd // nthr
    nbd = d_rb // fle_numba.BLOCK_BYTES[d_code]
    if kind != KIND_GGML and r1 > r0:
        # each expert's rows of the share into dn[pp] (the row kernel, activation row pp), then the sums
        for pp in range(n_cpu):
            sel2[0] = pp
            _rows(p[_P_D_ROWS], addr + np.int64(box[sel[pp]]) * eb + d_off, d_rb, r0, r1, nbd, hq8, hd, hs, sel2,
                  sel2, dn)
    for r in range(r0, r1):
        tot = np.float32(0.0)
        for pp in range(n_cpu):
            if kind == KIND_GGML:
                e = np.int64(box[sel[pp]])
                wo = e * eb + d_off + r * d_rb
                _call_vec_dot(p[_P_D_VD], n_ff, np.int64(acc.ctypes.data), addr + wo, np.int64(hq[pp].ctypes.data))
                v = acc[0]
            else:
                v = dn[pp, r]
            tot = tot + box[K + sel[pp]] * v
        res[li, r] = tot


@njit(nogil=True, cache=True)
def _member(tid, nthr, kind, P, buf, flags, done, boxes, res, stop, job, sync, stats, g, u, max_qb, clk, nap):
    """One member's life (module docstring)."""
    ts = np.zeros(2, np.int64)
    n_l = flags.shape[0]
    K = g.shape[0]
    max_ff = g.shape[1]
    max_embd = res.shape[1]
    sel = np.empty(K, np.int64)
    xq = np.zeros(max_qb + 64, np.uint8)
    xq8 = np.zeros((1, max_embd), np.int8)
    xd = np.zeros((1, max_embd // 32 + 1), np.float32)
    xs = np.zeros((1, max_embd // 32 + 1), np.int32)
    hq = np.zeros((K, max_qb + 64), np.uint8)
    hq8 = np.zeros((K, max_ff), np.int8)
    hd = np.zeros((K, max_ff // 32 + 1), np.float32)
    hs = np.zeros((K, max_ff // 32 + 1), np.int32)
    acc = np.zeros(1, np.float32)
    arow = np.zeros(1, np.int64)       # activation row 0 (x)
    sel2 = np.zeros(1, np.int64)       # an expert's row of g, u, dn and of its activations
    dn = np.zeros((K, max_embd), np.float32)
    tmp = np.zeros(34, np.uint8)
    h = np.zeros(max_ff, np.float32)
    gen = np.int64(0)
    if tid != 0:
        while True:
            v = _wait_at_least(sync, _S_GEN, gen + 1, 0, stop, clk, nap, ts)
            if v < 0:
                return
            gen += 1
            li = job[_J_LAYER]
            if li < 0:
                return
            _job(tid, nthr, kind, P[li], buf, li, job[_J_NCPU], boxes[li], K, res, sync, gen, g, u, sel, xq, xq8, xd,
                 xs, hq, hq8, hd, hs, acc, arow, sel2, dn, tmp, h)
            fetch_add(sync, _S_END, np.int64(1))
    expect = np.int64(1)
    while True:
        for li in range(n_l):
            f = _wait_at_least(flags, li, expect, 8, stop, clk, nap, ts)
            if f < 0:
                job[_J_LAYER] = -1
                store_release(sync, _S_GEN, gen + 1)
                return
            serial = f >> 8
            n_cpu = f & 255
            # a later serial: the GPU passed the rest of the earlier step without CPU work
            expect = serial
            if n_cpu == 0:
                continue
            t0 = _now(clk, ts)
            job[_J_LAYER] = li
            job[_J_NCPU] = n_cpu
            job[_J_SERIAL] = serial
            gen += 1
            store_release(sync, _S_GEN, gen)
            _job(0, nthr, kind, P[li], buf, li, n_cpu, boxes[li], K, res, sync, gen, g, u, sel, xq, xq8, xd, xs, hq,
                 hq8, hd, hs, acc, arow, sel2, dn, tmp, h)
            fetch_add(sync, _S_END, np.int64(1))
            while load_acquire(sync, _S_END) < gen * nthr:
                pass
            store_release(done, li, serial)
            stats[_T_BUSY_NS] += _now(clk, ts) - t0
            stats[_T_EXPERTS] += n_cpu
            stats[_T_JOBS] += 1
        expect += 1


# ---------------------------------------------------------------------------


class Team:
    """``threads`` members computing the CPU's share of the misses of the
    layers behind ``flags`` (one per layer, in the order of ``layouts``).

    ``buf``: the host expert buffer (uint8, 1-D) with layer ``i``'s experts
    at ``offsets[i]`` in the layout ``layouts[i]``
    (:class:`fle_engine.runtime.weights.ExpertLayout`); ``impl``: "ggml" or
    "numba"; the mailbox's words as the module docstring says:
    ``flags``, ``done`` int64 [L], ``boxes`` float32 [L, 3 K + D],
    ``results`` float32 [L, D], ``stop`` int64 [1]."""

    def __init__(self, buf, offsets, layouts, impl: str, threads: int, flags, done, boxes, results, stop,
                 n_used: int):
        if impl not in ("ggml", "numba"):
            raise ValueError(f"the CPU team runs the ggml or numba kernels, not {impl!r}")
        self.kind = KIND_GGML if impl == "ggml" else KIND_NUMBA
        self.impl, self.n = impl, max(1, int(threads))
        L, K = len(layouts), int(n_used)
        P = np.zeros((L, _NP), np.int64)
        max_qb = 0
        for i, (off, lay) in enumerate(zip(offsets, layouts)):
            P[i, _P_OFF], P[i, _P_EB], P[i, _P_GU_RB], P[i, _P_NFF] = off, lay.expert_bytes, lay.gu_row_bytes, lay.n_ff
            P[i, _P_DOFF], P[i, _P_D_RB], P[i, _P_NEMBD] = lay.down_offset, lay.down_row_bytes, lay.n_embd
            P[i, _P_GU_CODE], P[i, _P_D_CODE] = fle_numba.CODES[lay.gu_type], fle_numba.CODES[lay.down_type]
            if self.kind == KIND_NUMBA:
                gc, dc = int(P[i, _P_GU_CODE]), int(P[i, _P_D_CODE])
                P[i, _P_GU_ROWS], P[i, _P_D_ROWS] = rows_address(gc), rows_address(dc)
                P[i, _P_GU_LAY], P[i, _P_D_LAY] = layout(gc), layout(dc)
            if self.kind == KIND_GGML:
                from .ggml_cpu import traits

                gt, dt = traits(lay.gu_type), traits(lay.down_type)
                P[i, _P_GU_VD], P[i, _P_GU_FF], P[i, _P_GU_QB] = gt.vec_dot, gt.from_float, gt.act_row_bytes(lay.n_embd)
                P[i, _P_D_VD], P[i, _P_D_FF], P[i, _P_D_QB] = dt.vec_dot, dt.from_float, dt.act_row_bytes(lay.n_ff)
                max_qb = max(max_qb, int(P[i, _P_GU_QB]), int(P[i, _P_D_QB]))
        max_ff = max(lay.n_ff for lay in layouts)
        self._P, self._buf = P, buf
        self._words = (flags, done, boxes, results, stop)
        self._g = np.zeros((K, max_ff), np.float32)
        self._u = np.zeros((K, max_ff), np.float32)
        self._job = np.zeros(8, np.int64)
        self._sync = np.zeros(24, np.int64)
        self.stats = np.zeros(8, np.int64)
        self._max_qb = max_qb
        self._clk, self._nap = _libc_addresses()
        self._threads: list[threading.Thread] = []

    def _args(self, tid, stop, job, sync, stats):
        flags, done, boxes, results, _ = self._words
        return (tid, self.n, self.kind, self._P, self._buf, flags, done, boxes, results, stop, job, sync, stats,
                self._g, self._u, self._max_qb, self._clk, self._nap)

    def start(self) -> None:
        # compiled once before the members start (a run that stops at once, on words of its own)
        one = np.ones(1, np.int64)
        _member(*self._args(0, one, np.zeros(8, np.int64), np.zeros(24, np.int64), np.zeros(8, np.int64)))
        _member(*self._args(1, one, np.zeros(8, np.int64), np.zeros(24, np.int64), np.zeros(8, np.int64)))
        stop = self._words[4]
        self._threads = [threading.Thread(target=_member, args=self._args(t, stop, self._job, self._sync, self.stats),
                                          name=f"fle-cpu-misses-{t}", daemon=True) for t in range(self.n)]
        for th in self._threads:
            th.start()

    @property
    def busy_seconds(self) -> float:
        return float(self.stats[_T_BUSY_NS]) / 1e9

    @property
    def experts(self) -> int:
        return int(self.stats[_T_EXPERTS])

    def alive(self) -> bool:
        return all(th.is_alive() for th in self._threads)

    def join(self, timeout: float = 5.0) -> None:
        """Wait for the members after ``stop`` was set."""
        for th in self._threads:
            th.join(timeout=timeout)
        self._threads = []


def measure(buf, offset: int, layout, impl: str, threads: int, n_used: int, n_expert: int, n_cpu: int,
            seconds: float = 0.2, seed: int = 0) -> float:
    """Bytes per second of experts that a team computes, posted as the
    engine posts them (``n_cpu`` random experts of one layer per job, the
    poster waiting for each answer), on a mailbox of its own."""
    rng = np.random.default_rng(seed)
    d = layout.n_embd
    flags, done = np.zeros(1, np.int64), np.zeros(1, np.int64)
    boxes, results = np.zeros((1, 3 * n_used + d), np.float32), np.zeros((1, d), np.float32)
    stop = np.zeros(1, np.int64)
    team = Team(buf, [offset], [layout], impl, threads, flags, done, boxes, results, stop, n_used)
    team.start()
    k = min(n_cpu, n_used)
    try:
        serial, n, t0 = 0, 0, 0.0
        while True:
            serial += 1
            b = boxes[0]
            b[:n_used] = rng.choice(n_expert, n_used, replace=False)
            b[n_used:2 * n_used] = 1.0 / n_used
            b[2 * n_used:3 * n_used] = 0.0
            b[3 * n_used - k:3 * n_used] = 1.0
            b[3 * n_used:] = rng.standard_normal(d).astype(np.float32) * 0.1
            flags[0] = serial * 256 + k
            while done[0] != serial:
                if not team.alive():
                    raise RuntimeError("the CPU team stopped while it was measured")
            if serial == 2:          # the first two jobs warm the caches and the members
                t0 = time.perf_counter()
            elif serial > 2:
                n += 1
                el = time.perf_counter() - t0
                if (n >= 5 and el >= seconds) or el > 10 * seconds:
                    return n * k * layout.expert_bytes / el
    finally:
        stop[0] = 1
        team.join()
