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
  is posted for ``rows[i]`` = T rows (1 for a one-token step); its
  ``box[i]`` holds the rows' ``ids``, ``weights``, ``miss`` flags (T x K
  each, row-major, float32) and their normed activations ``x`` (T x D).
  The CPU computes the last ``n_cpu`` of the distinct missed experts in
  order of the first row routed to each (T = 1: the last ``n_cpu`` misses
  in routing order), each for every row routed to it.
- member 0 (the leader) waits for the flags in layer order, as the worker
  of :mod:`fle_engine.runtime.split` did, and publishes each layer with CPU
  work as a job (a generation counter); the other members wait for the
  generation only, so that all members always work on the same job.
- a job: every member quantizes the T rows of ``x`` for itself, computes
  its contiguous share of the gate and up rows of all the job's experts
  (each weight row read once and multiplied by every row routed to the
  expert), meets the others at a barrier, makes ``silu(gate) * up`` of
  every (row, expert) pair (quantized for the down rows) for itself, and
  computes its share of the output rows of every row t:
  ``out[t, r] = sum_p w_p * down_p[r] . h_p`` over t's pairs in routing
  order from zero (the order of :func:`.plan.weighted_sum`, so the result
  equals the one-call kernels' bit for bit); a row without CPU experts
  gets zeros. The leader waits for all members, then stores
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

__all__ = ["Team", "measure", "job_seconds", "load_acquire", "store_release", "fetch_add"]

# job words
_J_LAYER, _J_NCPU, _J_SERIAL, _J_ROWS = 0, 1, 2, 3
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
def _rows(fn, w, stride, r0, r1, nb, xq, xd, xs, arow, aoff, orow, ooff, nt, out):
    """Row kernel ``fn`` (.rows) on rows r0..r1 at address w: activation rows
    arow[aoff:aoff + nt] of (xq, xd, xs) into output rows orow[ooff:ooff + nt]
    of out (each weight row read once for the nt rows)."""
    call_rows(fn, w, stride, r0, r1, nb, np.int64(xq.ctypes.data), np.int64(xd.ctypes.data),
              np.int64(xs.ctypes.data), xq.shape[0], xq.shape[1], xd.shape[1], xs.shape[1],
              np.int64(arow.ctypes.data) + 8 * aoff, np.int64(orow.ctypes.data) + 8 * ooff, nt,
              np.int64(out.ctypes.data), out.shape[1])


@njit(nogil=True, cache=True)
def _first_miss(box, R, r):
    """Row r of the mailbox's R rows is a miss and the first row of its expert."""
    if box[2 * R + r] <= 0.5:
        return False
    for q in range(r):
        if box[q] == box[r]:
            return False
    return True


@njit(nogil=True, cache=True)
def _plan(box, K, T, n_cpu, uexp, prow, ptok, cst, cpl, ctok, tst):
    """The job's pairs from the mailbox (module docstring): the distinct
    missed experts of the T x K rows in order of their first row, the last
    ``n_cpu`` of them the CPU's (``uexp``); a pair for each row routed to
    one of them, in row order (``prow``: its row, ``ptok``: its token;
    token t's pairs are ``tst[t]:tst[t + 1]``); expert c's pairs
    ``cpl[cst[c]:cst[c + 1]]`` (their tokens ``ctok``). -> pairs."""
    R = T * K
    n_d = 0
    for r in range(R):
        if _first_miss(box, R, r):
            n_d += 1
    c = 0
    m = 0
    for r in range(R):
        if _first_miss(box, R, r):
            if m >= n_d - n_cpu:
                uexp[c] = r          # the expert's first row (its id is box[r])
                c += 1
            m += 1
    n_p = 0
    for t in range(T):
        tst[t] = n_p
        for j in range(K):
            r = t * K + j
            for cc in range(n_cpu):
                if box[uexp[cc]] == box[r]:
                    prow[n_p] = r
                    ptok[n_p] = t
                    n_p += 1
                    break
    tst[T] = n_p
    q = 0
    for cc in range(n_cpu):
        cst[cc] = q
        for p in range(n_p):
            if box[prow[p]] == box[uexp[cc]]:
                cpl[q] = p
                ctok[q] = ptok[p]
                q += 1
    cst[n_cpu] = q
    return n_p


@njit(nogil=True, cache=True)
def _job(tid, nthr, kind, p, buf, li, n_cpu, T, box, K, res, sync, gen, g, u, uexp, prow, ptok, cst, cpl, ctok,
         tst, xq, xq8, xd, xs, hq, hq8, hd, hs, acc, dn, tmp, h):
    """One member's part of layer ``li``'s job of T rows (module docstring);
    ``p``: the layer's parameters."""
    base_off, eb, gu_rb, n_ff = p[_P_OFF], p[_P_EB], p[_P_GU_RB], p[_P_NFF]
    d_off, d_rb, n_embd = p[_P_DOFF], p[_P_D_RB], p[_P_NEMBD]
    gu_code, d_code = p[_P_GU_CODE], p[_P_D_CODE]
    R = T * K
    n_p = _plan(box, K, T, n_cpu, uexp, prow, ptok, cst, cpl, ctok, tst)
    addr = np.int64(buf.ctypes.data) + base_off
    for t in range(T):
        x = box[3 * R + t * n_embd:3 * R + (t + 1) * n_embd]
        if kind == KIND_GGML:
            _call_from_float(p[_P_GU_FF], np.int64(x.ctypes.data), np.int64(xq[t].ctypes.data), n_embd)
        else:
            quantize_row(x, fle_numba.dot_k(gu_code), xd[t], xq8[t, :n_embd], xs[t], tmp)
            arrange(p[_P_GU_LAY], xq8[t, :n_embd])
    # gate and up rows: this member's contiguous share of the n_cpu * n_ff, each for all the expert's pairs
    rows = n_cpu * n_ff
    r0 = tid * rows // nthr
    r1 = (tid + 1) * rows // nthr
    nbg = gu_rb // fle_numba.BLOCK_BYTES[gu_code]
    if kind == KIND_GGML:
        for q in range(r0, r1):
            cc = q // n_ff
            r = q - cc * n_ff
            e = np.int64(box[uexp[cc]])
            wg = e * eb + r * gu_rb
            wu = e * eb + (n_ff + r) * gu_rb
            for j in range(cst[cc], cst[cc + 1]):
                pp = cpl[j]
                xa = np.int64(xq[ctok[j]].ctypes.data)
                _call_vec_dot(p[_P_GU_VD], n_embd, np.int64(g[pp, r:].ctypes.data), addr + wg, xa)
                _call_vec_dot(p[_P_GU_VD], n_embd, np.int64(u[pp, r:].ctypes.data), addr + wu, xa)
    else:
        # the row kernel (.rows) on each expert's part of the share: its pairs' rows of g and u
        for cc in range(r0 // n_ff, min(n_cpu, (r1 + n_ff - 1) // n_ff)):
            a = max(r0 - cc * n_ff, 0)
            b = min(r1 - cc * n_ff, n_ff)
            if a >= b:
                continue
            w = addr + np.int64(box[uexp[cc]]) * eb
            j0, nt = cst[cc], cst[cc + 1] - cst[cc]
            _rows(p[_P_GU_ROWS], w, gu_rb, a, b, nbg, xq8, xd, xs, ctok, j0, cpl, j0, nt, g)
            _rows(p[_P_GU_ROWS], w + n_ff * gu_rb, gu_rb, a, b, nbg, xq8, xd, xs, ctok, j0, cpl, j0, nt, u)
    # every member's gate and up rows are in
    fetch_add(sync, _S_MID, np.int64(1))
    while load_acquire(sync, _S_MID) < gen * nthr:
        pass
    # silu(gate) * up of every pair, quantized, for this member
    for pp in range(n_p):
        silu_mul_row(g[pp, :n_ff], u[pp, :n_ff], h[:n_ff])
        if kind == KIND_GGML:
            _call_from_float(p[_P_D_FF], np.int64(h.ctypes.data), np.int64(hq[pp].ctypes.data), n_ff)
        else:
            quantize_row(h[:n_ff], fle_numba.dot_k(d_code), hd[pp], hq8[pp, :n_ff], hs[pp], tmp)
            arrange(p[_P_D_LAY], hq8[pp, :n_ff])
    # output rows: this member's share of every row's, each the sum over the row's pairs in routing order
    # from zero (zero for a row without CPU experts)
    r0 = tid * n_embd // nthr
    r1 = (tid + 1) * n_embd // nthr
    nbd = d_rb // fle_numba.BLOCK_BYTES[d_code]
    if kind != KIND_GGML and r1 > r0:
        # each expert's rows of the share into dn[pair] (the row kernel, activation row = pair)
        for cc in range(n_cpu):
            j0, nt = cst[cc], cst[cc + 1] - cst[cc]
            _rows(p[_P_D_ROWS], addr + np.int64(box[uexp[cc]]) * eb + d_off, d_rb, r0, r1, nbd, hq8, hd, hs, cpl,
                  j0, cpl, j0, nt, dn)
    for t in range(T):
        for r in range(r0, r1):
            tot = np.float32(0.0)
            for pp in range(tst[t], tst[t + 1]):
                if kind == KIND_GGML:
                    e = np.int64(box[prow[pp]])
                    wo = e * eb + d_off + r * d_rb
                    _call_vec_dot(p[_P_D_VD], n_ff, np.int64(acc.ctypes.data), addr + wo,
                                  np.int64(hq[pp].ctypes.data))
                    v = acc[0]
                else:
                    v = dn[pp, r]
                tot = tot + box[R + prow[pp]] * v
            res[li, t * n_embd + r] = tot


@njit(nogil=True, cache=True)
def _member(tid, nthr, kind, P, buf, flags, done, nrows, boxes, res, stop, job, sync, stats, g, u, K, t_max,
            max_embd, max_qb, clk, nap):
    """One member's life (module docstring)."""
    ts = np.zeros(2, np.int64)
    n_l = flags.shape[0]
    RM = g.shape[0]                    # pairs at most: t_max * K
    max_ff = g.shape[1]
    uexp = np.zeros(RM, np.int64)
    prow = np.zeros(RM, np.int64)
    ptok = np.zeros(RM, np.int64)
    cst = np.zeros(RM + 1, np.int64)
    cpl = np.zeros(RM, np.int64)
    ctok = np.zeros(RM, np.int64)
    tst = np.zeros(t_max + 1, np.int64)
    xq = np.zeros((t_max, max_qb + 64), np.uint8)
    xq8 = np.zeros((t_max, max_embd), np.int8)
    xd = np.zeros((t_max, max_embd // 32 + 1), np.float32)
    xs = np.zeros((t_max, max_embd // 32 + 1), np.int32)
    hq = np.zeros((RM, max_qb + 64), np.uint8)
    hq8 = np.zeros((RM, max_ff), np.int8)
    hd = np.zeros((RM, max_ff // 32 + 1), np.float32)
    hs = np.zeros((RM, max_ff // 32 + 1), np.int32)
    acc = np.zeros(1, np.float32)
    dn = np.zeros((RM, max_embd), np.float32)
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
            _job(tid, nthr, kind, P[li], buf, li, job[_J_NCPU], job[_J_ROWS], boxes[li], K, res, sync, gen, g, u,
                 uexp, prow, ptok, cst, cpl, ctok, tst, xq, xq8, xd, xs, hq, hq8, hd, hs, acc, dn, tmp, h)
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
            n_rows = min(max(nrows[li], np.int64(1)), t_max)
            n_cpu = min(n_cpu, n_rows * K)
            job[_J_LAYER] = li
            job[_J_NCPU] = n_cpu
            job[_J_SERIAL] = serial
            job[_J_ROWS] = n_rows
            gen += 1
            store_release(sync, _S_GEN, gen)
            _job(0, nthr, kind, P[li], buf, li, n_cpu, n_rows, boxes[li], K, res, sync, gen, g, u, uexp, prow, ptok,
                 cst, cpl, ctok, tst, xq, xq8, xd, xs, hq, hq8, hd, hs, acc, dn, tmp, h)
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
    ``flags``, ``done`` int64 [L], ``boxes`` float32 [L, t_max (3 K + D)],
    ``results`` float32 [L, t_max D], ``stop`` int64 [1]; ``rows`` int64
    [L]: the rows T of each layer's post (None: always one, the one-token
    mailbox)."""

    def __init__(self, buf, offsets, layouts, impl: str, threads: int, flags, done, boxes, results, stop,
                 n_used: int, rows=None, t_max: int = 1):
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
        self.t_max, self.n_used = max(1, int(t_max)), K
        self._max_embd = max(lay.n_embd for lay in layouts)
        if rows is None:
            rows = np.ones(L, np.int64)
        self._words = (flags, done, rows, boxes, results, stop)
        self._g = np.zeros((K * self.t_max, max_ff), np.float32)
        self._u = np.zeros((K * self.t_max, max_ff), np.float32)
        self._job = np.zeros(8, np.int64)
        self._sync = np.zeros(24, np.int64)
        self.stats = np.zeros(8, np.int64)
        self._max_qb = max_qb
        self._clk, self._nap = _libc_addresses()
        self._threads: list[threading.Thread] = []

    def _args(self, tid, stop, job, sync, stats):
        flags, done, rows, boxes, results, _ = self._words
        return (tid, self.n, self.kind, self._P, self._buf, flags, done, rows, boxes, results, stop, job, sync, stats,
                self._g, self._u, self.n_used, self.t_max, self._max_embd, self._max_qb, self._clk, self._nap)

    def start(self) -> None:
        # compiled once before the members start (a run that stops at once, on words of its own)
        one = np.ones(1, np.int64)
        _member(*self._args(0, one, np.zeros(8, np.int64), np.zeros(24, np.int64), np.zeros(8, np.int64)))
        _member(*self._args(1, one, np.zeros(8, np.int64), np.zeros(24, np.int64), np.zeros(8, np.int64)))
        stop = self._words[5]
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


def job_seconds(buf, offset: int, layout, impl: str, threads: int, n_used: int, n_expert: int, n_cpu: int,
                seconds: float = 0.2, seed: int = 0) -> float:
    """Median seconds from posting a job of ``n_cpu`` random experts of one
    layer (as the engine posts them, on a mailbox of its own) to its answer
    (the median: a job that the OS preempts does not move it).
    Only that span is timed: the poster writes the next job's box before it
    posts, as the GPU's post kernel has its box ready, so the Python work
    between jobs is not counted as the team's."""
    rng = np.random.default_rng(seed)
    d = layout.n_embd
    flags, done = np.zeros(1, np.int64), np.zeros(1, np.int64)
    boxes, results = np.zeros((1, 3 * n_used + d), np.float32), np.zeros((1, d), np.float32)
    stop = np.zeros(1, np.int64)
    team = Team(buf, [offset], [layout], impl, threads, flags, done, boxes, results, stop, n_used)
    team.start()
    k = min(n_cpu, n_used)
    try:
        serial, n, busy, t_start, times = 0, 0, 0.0, time.perf_counter(), []
        while True:
            serial += 1
            b = boxes[0]
            b[:n_used] = rng.choice(n_expert, n_used, replace=False)
            b[n_used:2 * n_used] = 1.0 / n_used
            b[2 * n_used:3 * n_used] = 0.0
            b[3 * n_used - k:3 * n_used] = 1.0
            b[3 * n_used:] = rng.standard_normal(d).astype(np.float32) * 0.1
            t0 = time.perf_counter()
            flags[0] = serial * 256 + k
            while done[0] != serial:
                if not team.alive():
                    raise RuntimeError("the CPU team stopped while it was measured")
            if serial > 2:           # the first two jobs warm the caches and the members
                n += 1
                times.append(time.perf_counter() - t0)
                busy += times[-1]
                if (n >= 5 and busy >= seconds) or time.perf_counter() - t_start > 10 * seconds:
                    return float(np.median(times))
    finally:
        stop[0] = 1
        team.join()


def measure(buf, offset: int, layout, impl: str, threads: int, n_used: int, n_expert: int, n_cpu: int,
            seconds: float = 0.2, seed: int = 0) -> float:
    """Bytes per second of experts that a team computes in jobs of
    ``n_cpu`` experts (:func:`job_seconds`)."""
    t = job_seconds(buf, offset, layout, impl, threads, n_used, n_expert, n_cpu, seconds, seed)
    return min(n_cpu, n_used) * layout.expert_bytes / t
