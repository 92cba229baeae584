"""The few CUDA runtime calls the engine makes between steps, at their
host cost.

Between two decode steps the engine copies the step's routed ids to pinned
memory, writes the expert->slot map, copies admitted experts into their
slots on a side stream and orders all of it with events. Through torch
each of those calls costs ~5-25 us of host time (dispatch, a new
``torch.cuda.Event`` per use); the same calls made straight to the CUDA
runtime that torch has loaded cost ~1 us. Both sides of this module do the
same thing in the same order, so which one runs changes host time only:

- :class:`Direct`: ``cudaMemcpyAsync``, ``cudaEventRecord``,
  ``cudaStreamWaitEvent``, ``cudaEventSynchronize`` through ctypes on the
  ``libcudart`` that this process already maps (torch's), events created
  once and reused;
- :class:`Torch`: the same through torch (``Tensor.copy_``,
  ``torch.cuda.Event``), used when that library cannot be found or with
  ``FLE_CUDA_CALLS=torch``.

Copies take contiguous tensors (a slot row, a pinned buffer) and are
asynchronous on the given stream; events are handles made by
:meth:`event` and may be recorded again after a synchronize.

:func:`capture_graph` is how every captured step is made (the decode step,
the T-token step, the lanes' steps, the MTP step drafter's calls).
"""
from __future__ import annotations

import ctypes
import os

import torch

__all__ = ["Direct", "Torch", "pick"]

_DEFAULT = 4                # cudaMemcpyDefault: the direction from the pointers (unified addressing)
_DISABLE_TIMING = 2         # cudaEventDisableTiming


def _mapped_cudart() -> "str | None":
    """The path of the libcudart this process has mapped (torch's), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "/libcudart.so" in path:
                    return path
    except OSError:
        return None
    return None


class Torch:
    """The calls through torch."""
    name = "torch"

    def event(self):
        return [torch.cuda.Event()]          # a box: record() puts a fresh event in it

    def record(self, ev, stream) -> None:
        e = torch.cuda.Event()
        e.record(stream)
        ev[0] = e

    def wait(self, stream, ev) -> None:
        stream.wait_event(ev[0])

    def synchronize(self, ev) -> None:
        ev[0].synchronize()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def copy_rows(self, dst: torch.Tensor, dst_rows, src: torch.Tensor, src_rows, stream) -> None:
        with torch.cuda.stream(stream):
            for d, s in zip(dst_rows, src_rows):
                dst[d].copy_(src[s], non_blocking=True)


class Direct:
    """The calls straight to the process's CUDA runtime (see the module
    docstring)."""
    name = "cudart"

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        self._memcpy = lib.cudaMemcpyAsync
        self._memcpy.argtypes = [vp, vp, sz, ctypes.c_int, vp]
        self._memcpy.restype = ctypes.c_int
        self._create = lib.cudaEventCreateWithFlags
        self._create.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        self._create.restype = ctypes.c_int
        self._record = lib.cudaEventRecord
        self._record.argtypes = [vp, vp]
        self._record.restype = ctypes.c_int
        self._wait = lib.cudaStreamWaitEvent
        self._wait.argtypes = [vp, vp, ctypes.c_uint]
        self._wait.restype = ctypes.c_int
        self._sync = lib.cudaEventSynchronize
        self._sync.argtypes = [vp]
        self._sync.restype = ctypes.c_int
        self._destroy = lib.cudaEventDestroy
        self._destroy.argtypes = [vp]
        self._errstr = lib.cudaGetErrorString
        self._errstr.argtypes = [ctypes.c_int]
        self._errstr.restype = ctypes.c_char_p
        self.path = path

    def _check(self, rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(f"{what}: CUDA error {rc} ({self._errstr(rc).decode()})")

    def event(self):
        h = ctypes.c_void_p()
        self._check(self._create(ctypes.byref(h), _DISABLE_TIMING), "cudaEventCreateWithFlags")
        return h.value

    def record(self, ev, stream) -> None:
        self._check(self._record(ev, stream.cuda_stream), "cudaEventRecord")

    def wait(self, stream, ev) -> None:
        self._check(self._wait(stream.cuda_stream, ev, 0), "cudaStreamWaitEvent")

    def synchronize(self, ev) -> None:
        self._check(self._sync(ev), "cudaEventSynchronize")

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        n = dst.nbytes
        if src.nbytes != n or not (dst.is_contiguous() and src.is_contiguous()):
            raise ValueError("internal: a direct copy takes two contiguous tensors of the same size")
        self._check(self._memcpy(dst.data_ptr(), src.data_ptr(), n, _DEFAULT, stream.cuda_stream),
                    "cudaMemcpyAsync")

    def copy_rows(self, dst: torch.Tensor, dst_rows, src: torch.Tensor, src_rows, stream) -> None:
        """Row ``dst_rows[i]`` of the 2-D ``dst`` from row ``src_rows[i]`` of
        ``src`` (rows contiguous, of one size), each one copy."""
        n = dst.shape[1] * dst.element_size()
        if src.shape[1] * src.element_size() != n or dst.stride(1) != 1 or src.stride(1) != 1:
            raise ValueError("internal: row copies take rows of one size, contiguous")
        db, ds = dst.data_ptr(), dst.stride(0) * dst.element_size()
        sb, ss = src.data_ptr(), src.stride(0) * src.element_size()
        h, mc = stream.cuda_stream, self._memcpy
        for d, s in zip(dst_rows, src_rows):
            rc = mc(db + d * ds, sb + s * ss, n, _DEFAULT, h)
            if rc:
                self._check(rc, "cudaMemcpyAsync")


def pick(device: torch.device):
    """The calls for ``device`` (CUDA): :class:`Direct` where the runtime
    library is found, else :class:`Torch`; ``FLE_CUDA_CALLS=torch`` forces
    the latter."""
    torch.cuda.init()
    torch.empty(1, device=device)            # the runtime loaded and its context made
    if os.environ.get("FLE_CUDA_CALLS", "").lower() == "torch":
        return Torch()
    path = _mapped_cudart()
    if path is None:
        return Torch()
    try:
        return Direct(path)
    except (OSError, AttributeError):
        return Torch()


def capture_graph(device: torch.device, pool, run, reset=None) -> "torch.cuda.CUDAGraph":
    """``run()`` captured as one CUDA graph in memory ``pool`` (None: a new
    one; the graph's is ``g.pool()``): first run twice eagerly on a side
    stream, which compiles every kernel, with ``reset()`` after each (put
    back what a run advances: positions, recurrent states), then captured."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
            if reset is not None:
                reset()
    torch.cuda.current_stream(device).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        run()
    return g
