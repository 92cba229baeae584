"""One-token products in CUDA C (``cuda_mv.cu``), for the decode step's
two heaviest kinds of launch: the routed IQ4_XS experts (from their cache
slots or over PCIe from page-locked host memory, as
:func:`triton_engine.experts`) and Q8_0 dense matrices. The T-row step's experts
(each distinct expert read once for all its rows) have a CUDA C kernel too
(:data:`UNION_DEFAULT`, ``FLE_CUDA_MV_UNION=0`` for Triton's), and the Q8_0 dense products of 2..4
activation rows (:data:`DENSE_T_MAX`). Triton's versions
of all of them stay the fast side's fallback for every other case (other types,
T > 1 dense rows past :data:`DENSE_T_MAX`, unaligned buffers) and the form the tests run without a GPU; the
references in :mod:`engine_ops` stay the slow, obvious twins.

The source is compiled once per process with NVRTC (the library that
torch's CUDA build ships) for the device's architecture and loaded through
the driver API; launches go on torch's current stream, so they are
captured into CUDA graphs like any kernel. ``FLE_CUDA_MV=0`` turns the
CUDA C kernels off (Triton's kernels everywhere).

On an H100 (``bench/engine_kernels.py --cuda``, docs/benchmarks.md,
2026-12-06) the CUDA C kernels beat Triton's for Q8_0 dense rows (0.39-0.95
of the device copy against 0.28-0.70) and for experts read over PCIe (0.88
of the pinned copy against 0.79), not for a layer whose experts are all in
their slots (25 us against Triton's 21 us): that launch ("hit" mode) stays
Triton's. Since 2026-12-07 the Q8_0 rows are staged through shared memory
(:data:`DENSE_DEFAULT` says by how much that was faster).

Launch shapes (output rows per warp, warps per block, row iterations
whose weights a lane loads into registers first), per kernel and mode, are
in :data:`EXPERT_CONFIG` and :data:`DENSE_CONFIG`, measured with
``bench/engine_kernels.py --cuda``; ``FLE_CUDA_MV_CONFIG`` overrides the
shapes for tuning (``gu_rows,gu_warps,down_rows,down_warps[,dense_rows,dense_warps]``)
and ``FLE_CUDA_MV_PRE`` the loads first (``gu,down,dense``).

``FLE_PDL=1`` (the switch Triton's expert kernels read too) launches the
kernels with programmatic dependent launch (sm_90+, :data:`PDL_DEFAULT`
when unset): a kernel may start while the one
before it ends, and the down product and dense products load their
weights before they wait for it (``cuda_mv.cu`` says what may be read
early).
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from pathlib import Path

import torch
from torch import Tensor

from fle_quant.errors import FleError
from fle_quant.ggml_types import GGMLType

from .ptx_decode import BOOK_WORDS

__all__ = ["enabled", "experts_supported", "experts", "union_supported", "experts_union", "ffn_supported",
           "experts_ffn", "dense_supported", "dense", "dense_staged", "dense_t_max", "UNION_DEFAULT", "EXPERT_CONFIG", "FFN_CONFIG", "DENSE_CONFIG", "DENSE_T_MAX"]

SOURCE = Path(__file__).with_name("cuda_mv.cu")
DEFAULT = "1"             # FLE_CUDA_MV when unset

# (rows per warp, warps per block) of the gate+up and the down kernel, per mode ("hit": every
# expert of every layer cached; "miss": a layer may read over PCIe); None: Triton's kernel takes
# that mode. Measured on an H100 (bench/engine_kernels.py --cuda; docs/benchmarks.md, 2026-12-06):
# "miss" 2,4 / 4,4 read 8 missed experts in 413 us (Triton 461), a layer with one miss in 94 us
# (Triton 105); the best "hit" shape, 4,4 / 8,4, took 25.0 us against Triton's 21.1.
# The third number of each: the row iterations loaded first (0: none; cuda_mv.cu's PRE).
EXPERT_CONFIG = {"hit": None, "miss": ((2, 4, 0), (4, 4, 0))}
_GU_ROWS = (1, 2, 4)
_DN_ROWS = (1, 2, 4, 8)
_EXPERT_PRE = (0, 1, 2)
# gate+up and down of a layer in one launch (cuda_mv.cu's iq4xs_ffn): (gate+up rows per warp, down
# rows per warp, warps per block, down row iterations loaded first), per mode as EXPERT_CONFIG; None:
# two launches. Off until a GPU run has timed it (bench/engine_kernels.py --cuda);
# FLE_CUDA_MV_FFN=g,d,w,p turns it on for measurements, FLE_CUDA_MV_FFN=0 off.
FFN_CONFIG = {"hit": None, "miss": None}
_FFN_ROWS = ((2, 4), (2, 8), (4, 8))
_FFN_PRE = (0, 1, 2)
_SYNC_WORDS = 4096        # the fused launch's counters: a ticket, a done count, one per routed row
# (rows per warp, warps per block) of the Q8_0 product below / from DENSE_LARGE output rows:
# 2,2 took 9.5 us for 5120 x 2048 and 2048 x 4096 (Triton 10.6 and 13.2), 4,2 143 us for the
# 151936 x 2048 output matrix (Triton 194).
DENSE_CONFIG = ((2, 2, 0), (4, 2, 0))
# FLE_CUDA_MV_DENSE when unset: "stage" (rows copied into shared memory with 16-byte copies, four
# values per lane: cuda_mv.cu's q8_0_mvs) or "word" (the kernel above: a lane per 34-byte block, its
# weights and activations loaded straight from global memory). On an H100 (2026-12-07 18:46,
# docs/benchmarks.md) the staged kernel took 9.9 / 8.6 / 129 us for qkv / wo / the output matrix at
# T = 1 against 10.5 / 10.0 / 153, and 12.3 / 15.4 us for qkv / wo at T = 3 against 21.1 / 19.4.
DENSE_DEFAULT = "stage"
# its (rows per warp, warps per block): [T > 1][n_out >= DENSE_LARGE], the best measured shape of each
# (1,8 and 2,8 at T = 1; 2,2 for 2..4 rows; the output matrix at T > 1 was not timed: 2,8)
STAGE_CONFIG = (((1, 8), (2, 8)), ((2, 2), (2, 8)))
_Q8S_CHUNK = 128          # blocks of each row staged at once (cuda_mv.cu's Q8S_CHUNK)
DENSE_LARGE = 32768
_DENSE_ROWS = (1, 2, 4)
_DENSE_PRE = (0, 1, 2, 4)
# activation rows a dense product takes in one launch (the verify step's 2..4 tokens, batched lanes); more
# rows go to Triton's kernel. On an H100 (2026-12-07 15:10, docs/benchmarks.md) 2..4 rows took 14.8 / 20.7 /
# 26.0 us for qkv (Triton 15.0 / 25.1 / 25.7) and 14.5 / 19.4 / 23.2 us for wo (Triton 22.4 / 21.9 / 23.2), and
# the verify step of 3 tokens 11.20 ms against 11.80 with Triton's; FLE_CUDA_MV_DENSE_T=1 for Triton's
DENSE_T_MAX = 4
_DENSE_T = (1, 2, 3, 4)
# FLE_PDL when unset: off. On an H100 (2026-12-07, docs/benchmarks.md) it took 3.4 us off a cached layer's
# CUDA C experts with loads-first, but the captured decode step ran slower with it (294.6 against 304.5 tok/s
# with every expert cached); loads-first slowed layers read over PCIe by 30 %, so PRE stays 0.
PDL_DEFAULT = "0"

# FLE_CUDA_MV_UNION when unset: the T-row step's experts (verify steps, batched lanes), each distinct expert
# read once for its rows, in CUDA C (cuda_mv.cu's iq4xs_union) instead of Triton's union kernel, whose
# launches took 3.87x the one-token step's at T = 3 on an H200 (2026-12-04) while the bytes grew 2.9x. On an
# H100 (2026-12-07 15:10, docs/benchmarks.md) the verify step of 3 tokens took 11.80 ms with it against
# 15.86 with Triton's (T(0) 4.9-5.0 ms), its gate+up launch 2.74x and down 3.09x the one-token launch's
# time for 3.1x the missed bytes; it takes the miss mode's launch shapes (EXPERT_CONFIG) without
# loads-first. FLE_CUDA_MV_UNION=0 for Triton's.
UNION_DEFAULT = "1"
_UNION_MAX = 16           # rows per expert the kernel takes (cuda_mv.cu's UMAX): tokens in one step

_IQ4_SUPER = 136          # bytes of an IQ4_XS super-block (256 values)
_Q8_BLOCK = 34


def _env_ints(name: str, counts: tuple, usage: str) -> "list[int] | None":
    """A tuning variable's comma list of integers, or None when unset; a malformed one is
    refused naming the variable."""
    env = os.environ.get(name)
    if not env:
        return None
    try:
        v = [int(x) for x in env.split(",")]
    except ValueError:
        v = []
    if len(v) not in counts or min(v) < 0:
        raise FleError(f"{name}={env!r}: it takes {usage}; unset it for the measured defaults")
    return v


def _env_config():
    return _env_ints("FLE_CUDA_MV_CONFIG", (4, 6), "gu_rows,gu_warps,down_rows,down_warps[,dense_rows,dense_warps]")


def _env_pre():
    return _env_ints("FLE_CUDA_MV_PRE", (3,), "gu,down,dense (row iterations whose weights are loaded first)")


def _pre_kernel(pre: int, n_iter: int, have: tuple) -> int:
    """The compiled PRE variant for ``pre`` iterations asked on rows of ``n_iter``: no more than
    the row has, rounded up to one that exists."""
    want = min(pre, n_iter)
    return min(p for p in have if p >= want) if want <= have[-1] else have[-1]


class _LaunchAttr(ctypes.Structure):          # CUlaunchAttribute: an id, then a 64-byte value union at 8
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):        # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("n_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6     # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_MAX_DYNAMIC_SHARED = 8                    # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def _check(res: int, what: str) -> None:
    if res != 0:
        raise FleError(f"CUDA C kernels: {what} failed with error {res}")


def _nvrtc() -> ctypes.CDLL:
    major = (torch.version.cuda or "12").split(".")[0]
    names = [f"libnvrtc.so.{major}", "libnvrtc.so"]
    for p in sys.path:                          # the pip wheels (nvidia-cuda-nvrtc) that torch's build uses
        names += sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib", f"libnvrtc.so.{major}*")))
        names += sorted(glob.glob(os.path.join(p, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")))
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise FleError("CUDA C kernels: no NVRTC library (libnvrtc) found; set FLE_CUDA_MV=0 to use Triton's kernels")


class _Module:
    """The compiled source on the current device: its kernels by name. ``ffn``: only the fused
    gate+up+down kernels (FLE_ONLY_FFN), compiled when first asked for, so that a process that
    does not use them does not wait for them."""

    def __init__(self, ffn: bool = False):
        torch.cuda.init()
        dev = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(dev)
        book = "".join(f"#define KV{i} 0x{w:08X}u\n" for i, w in enumerate(BOOK_WORDS))
        src = (book + ("#define FLE_ONLY_FFN 1\n" if ffn else "") + SOURCE.read_text()).encode()
        nv = _nvrtc()
        prog = ctypes.c_void_p()
        _check(nv.nvrtcCreateProgram(ctypes.byref(prog), src, b"cuda_mv.cu", 0, None, None), "nvrtcCreateProgram")
        opts = [f"--gpu-architecture=sm_{major}{minor}".encode(), b"--std=c++17"]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        res = nv.nvrtcCompileProgram(prog, len(opts), arr)
        if res != 0:
            size = ctypes.c_size_t()
            nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nv.nvrtcGetProgramLog(prog, log)
            raise FleError(f"CUDA C kernels: {SOURCE.name} did not compile:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _check(nv.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(nv.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        nv.nvrtcDestroyProgram(ctypes.byref(prog))
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.cuda.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        self.launch_ex = getattr(self.cuda, "cuLaunchKernelEx", None) if major >= 9 else None
        if self.launch_ex is not None:
            self.launch_ex.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_void_p]
            self.pdl_attr = _LaunchAttr(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
            self.pdl_attr.value[0] = 1
        self.device = dev
        cu_dev = ctypes.c_int()
        _check(self.cuda.cuDeviceGet(ctypes.byref(cu_dev), dev), "cuDeviceGet")
        self.ctx = ctypes.c_void_p()
        _check(self.cuda.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), cu_dev), "cuDevicePrimaryCtxRetain")
        self._ensure_ctx()
        self.module = ctypes.c_void_p()
        _check(self.cuda.cuModuleLoadData(ctypes.byref(self.module), cubin), "cuModuleLoadData")
        self.funcs: dict[str, ctypes.c_void_p] = {}
        self.shared_ok: dict[str, int] = {}     # kernel -> dynamic shared bytes it is allowed past 48 KiB
        self.local = threading.local()
        self.sync: "Tensor | None" = None

    def ffn_sync(self) -> "Tensor | None":
        """The fused launches' counters (zero between launches; one set per device, so fused launches
        on a device never run at the same time), made on first use; None while a graph is being
        captured before they exist (such a launch then takes two launches)."""
        if self.sync is None and not torch.cuda.is_current_stream_capturing():
            self.sync = torch.zeros(_SYNC_WORDS, dtype=torch.int32, device=f"cuda:{self.device}")
        return self.sync

    def _ensure_ctx(self) -> None:
        cur = ctypes.c_void_p()
        _check(self.cuda.cuCtxGetCurrent(ctypes.byref(cur)), "cuCtxGetCurrent")
        if cur.value != self.ctx.value:
            _check(self.cuda.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def func(self, name: str) -> ctypes.c_void_p:
        f = self.funcs.get(name)
        if f is None:
            f = ctypes.c_void_p()
            _check(self.cuda.cuModuleGetFunction(ctypes.byref(f), self.module, name.encode()), f"kernel {name}")
            self.funcs[name] = f
        return f

    def launch(self, name: str, grid: tuple, block: int, args: list, shared: int = 0) -> None:
        """One launch on torch's current stream; ``shared``: bytes of dynamic shared memory
        (past 48 KiB the kernel is allowed that much first)."""
        if not getattr(self.local, "ctx_ok", False):     # a thread's first launch: torch's context current
            self._ensure_ctx()
            self.local.ctx_ok = True
        f = self.func(name)
        if shared > self.shared_ok.get(name, 48 * 1024):
            _check(self.cuda.cuFuncSetAttribute(f, _MAX_DYNAMIC_SHARED, ctypes.c_int(shared)),
                   f"{name}: {shared} bytes of shared memory")
            self.shared_ok[name] = shared
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        stream = torch.cuda.current_stream().cuda_stream
        if self.launch_ex is not None and pdl_on():
            cfg = _LaunchConfig(grid[0], grid[1], 1, block, 1, 1, shared, stream, ctypes.pointer(self.pdl_attr), 1)
            _check(self.launch_ex(ctypes.byref(cfg), f, params, None), f"launch of {name}")
            return
        _check(self.cuda.cuLaunchKernel(f, grid[0], grid[1], 1, block, 1, 1, shared, stream, params, None),
               f"launch of {name}")


_MODULES: "dict[bool, _Module]" = {}     # ffn -> the compiled module (a failure sets _FAILED instead)
_FAILED: "str | None" = None
_LOCK = threading.Lock()


def enabled() -> bool:
    """Whether the CUDA C kernels are on (a CUDA device, FLE_CUDA_MV not 0)."""
    return _switched_on() and torch.cuda.is_available()


def _switched_on() -> bool:
    return os.environ.get("FLE_CUDA_MV", DEFAULT) != "0"


def pdl_on() -> bool:
    """Whether launches ask for programmatic dependent launch (FLE_PDL=1, as for Triton's
    expert kernels; taken where the device has it, sm_90+)."""
    return os.environ.get("FLE_PDL", PDL_DEFAULT) == "1"


def _module(ffn: bool = False) -> "_Module | None":
    """The compiled kernels (``ffn``: the fused ones), or None (with one warning) when they cannot
    be built here; the fused ones are not built while a graph is being captured."""
    global _FAILED
    if ffn not in _MODULES and _FAILED is None:
        if ffn and torch.cuda.is_current_stream_capturing():
            return None
        with _LOCK:
            if ffn not in _MODULES and _FAILED is None:
                try:
                    _MODULES[ffn] = _Module(ffn)
                except (FleError, OSError) as e:
                    _FAILED = str(e)
                    print(f"warning: {e}; the engine uses Triton's kernels instead", file=sys.stderr)
    return _MODULES.get(ffn)


def _aligned(t: Tensor, n: int) -> bool:
    return t.data_ptr() % n == 0


def _p(t: "Tensor | int") -> ctypes.c_void_p:
    return ctypes.c_void_p(t if isinstance(t, int) else t.data_ptr())


# ---------------------------------------------------------------------------
# experts


def experts_supported(words: Tensor, qtype: GGMLType, x: Tensor, out: Tensor, x_miss: "Tensor | None",
                      expert_bytes: int, part_bytes: int, mode: str = "miss") -> bool:
    """Whether :func:`experts` takes this call (else Triton's kernel does)."""
    if qtype != GGMLType.IQ4_XS or not words.is_cuda or not _switched_on():     # CUDA tensors: a device
        return False
    if EXPERT_CONFIG.get(mode) is None and not _env_config():
        return False
    if not (x.dtype == out.dtype == torch.float32 and x.stride(-1) == 1 and out.stride(-1) == 1):
        return False
    if not (_aligned(words, 8) and expert_bytes % 8 == 0 and part_bytes % 8 == 0):
        return False
    if not (_aligned(x, 16) and x.stride(0) % 4 == 0):
        return False
    if x_miss is not None and (not _aligned(x_miss, 16) or x_miss.stride(0) != x.stride(0)):
        return False
    return _module() is not None


def _expert_config(gate_up: bool, mode: str) -> tuple[int, int, int]:
    config = EXPERT_CONFIG.get(mode) or EXPERT_CONFIG["miss"]
    rows, warps, pre = config[0 if gate_up else 1]
    env, env_pre = _env_config(), _env_pre()
    if env:
        rows, warps = (env[0], env[1]) if gate_up else (env[2], env[3])
    if env_pre:
        pre = env_pre[0 if gate_up else 1]
    return rows, warps, pre


def _experts_launch(kernel: str, words: Tensor, host_delta: int, part_words: int, expert_words: int, n_out: int,
                    row_bytes: int, slot_of: Tensor, ids: Tensor, x: Tensor, out: Tensor, gate_up: bool, n_used: int,
                    weights: "Tensor | None", mode: str, cpu_share: int, x_miss: "Tensor | None",
                    extra: tuple = ()) -> Tensor:
    """One launch of an experts kernel (``kernel``: its name's stem, the rows per warp and
    loads-first appended as the source names its variants; ``extra``: arguments after the
    common ones), a block per output-row tile of each routed row."""
    word = words.element_size()
    rows, warps, pre = _expert_config(gate_up, mode)
    if rows not in (_GU_ROWS if gate_up else _DN_ROWS):
        raise FleError(f"FLE_CUDA_MV_CONFIG: no {'gate+up' if gate_up else 'down'} kernel with {rows} rows per "
                       f"warp (there are {_GU_ROWS if gate_up else _DN_ROWS})")
    n_sub = row_bytes // _IQ4_SUPER * 8
    name = kernel.format(kind="gu" if gate_up else "dn", rows=rows,
                         pre=_pre_kernel(pre, (n_sub + 31) // 32, _EXPERT_PRE))
    x_delta = 0 if x_miss is None else (x_miss.data_ptr() - x.data_ptr()) // 4
    grid = ((n_out + rows * warps - 1) // (rows * warps), ids.shape[0])
    args = [_p(words), ctypes.c_longlong(host_delta * word), ctypes.c_longlong(part_words * word),
            ctypes.c_longlong(expert_words * word), _p(slot_of), _p(ids), _p(out if weights is None else weights),
            _p(x), _p(out), ctypes.c_int(n_out), ctypes.c_int(n_sub), ctypes.c_longlong(row_bytes),
            ctypes.c_int(n_used), ctypes.c_int(x.stride(0)), ctypes.c_int(out.stride(0)), ctypes.c_int(int(cpu_share)),
            ctypes.c_longlong(x_delta), *extra]
    _module().launch(name, grid, 32 * warps, args)
    return out


def experts(words: Tensor, qtype: GGMLType, host_delta: int, part_words: int, expert_words: int,
            n_out: int, row_bytes: int, slot_of: Tensor, ids: Tensor, x: Tensor, out: Tensor,
            gate_up: bool, n_used: int, weights: "Tensor | None" = None, mode: str = "miss",
            cpu_share: int = 0, x_miss: "Tensor | None" = None) -> Tensor:
    """:func:`triton_engine.experts` (same arguments and result) for IQ4_XS
    experts in the CUDA C kernel; callers check :func:`experts_supported`."""
    return _experts_launch("iq4xs_{kind}_{rows}_p{pre}", words, host_delta, part_words, expert_words, n_out,
                           row_bytes, slot_of, ids, x, out, gate_up, n_used, weights, mode, cpu_share, x_miss)


def union_on() -> bool:
    """Whether the T-row step's experts may take the CUDA C union kernel (FLE_CUDA_MV_UNION=1, else
    :data:`UNION_DEFAULT`)."""
    return os.environ.get("FLE_CUDA_MV_UNION", UNION_DEFAULT) == "1"


def union_supported(words: Tensor, qtype: GGMLType, x: Tensor, out: Tensor, x_miss: "Tensor | None",
                    expert_bytes: int, part_bytes: int, n_rows: int, n_used: int,
                    reads: "Tensor | None" = None) -> bool:
    """Whether :func:`experts_union` takes this call (else Triton's union kernel does): IQ4_XS,
    at most 16 tokens (rows per expert), no read log."""
    if not union_on() or reads is not None or n_rows > _UNION_MAX * n_used:
        return False
    return experts_supported(words, qtype, x, out, x_miss, expert_bytes, part_bytes, "miss")


def experts_union(words: Tensor, qtype: GGMLType, host_delta: int, part_words: int, expert_words: int,
                  n_out: int, row_bytes: int, slot_of: Tensor, ids: Tensor, x: Tensor, out: Tensor,
                  gate_up: bool, n_used: int, weights: "Tensor | None" = None, mode: str = "miss",
                  reads: "Tensor | None" = None, cpu_share: int = 0, x_miss: "Tensor | None" = None) -> Tensor:
    """:func:`triton_engine.experts_union` (same arguments and result: each distinct expert read
    once for all the rows routed to it, runtime.split's union rule for ``cpu_share``) for IQ4_XS
    experts in the CUDA C kernel; callers check :func:`union_supported`."""
    if reads is not None:
        raise FleError("internal: the CUDA C union kernel keeps no read log (union_supported refuses it)")
    # the miss mode's launch shapes, without loads-first (the kernel has none)
    return _experts_launch("iq4xs_u{kind}_{rows}", words, host_delta, part_words, expert_words, n_out, row_bytes,
                           slot_of, ids, x, out, gate_up, n_used, weights, "miss", cpu_share, x_miss,
                           (ctypes.c_int(ids.shape[0]),))


def ffn_config(mode: str = "miss") -> "tuple[int, int, int, int] | None":
    """The fused launch's (gate+up rows, down rows, warps, down loads-first) for ``mode``, or None for
    two launches (FLE_CUDA_MV_FFN, else FFN_CONFIG)."""
    env = _env_ints("FLE_CUDA_MV_FFN", (1, 4), "gu_rows,down_rows,warps,down_pre, or 0 for two launches")
    if env is None:
        return FFN_CONFIG.get(mode)
    if len(env) == 1:
        if env[0]:
            raise FleError(f"FLE_CUDA_MV_FFN={env[0]}: it takes gu_rows,down_rows,warps,down_pre, or 0")
        return None
    if tuple(env[:2]) not in _FFN_ROWS or env[3] not in _FFN_PRE or not 1 <= env[2] <= 8:
        raise FleError(f"FLE_CUDA_MV_FFN={','.join(map(str, env))}: no such fused kernel (rows {_FFN_ROWS}, "
                       f"loads-first {_FFN_PRE}, 1 to 8 warps)")
    return tuple(env)


def ffn_supported(words: Tensor, qtype: GGMLType, x: Tensor, h: Tensor, y: Tensor, x_miss: "Tensor | None",
                  expert_bytes: int, down_part_bytes: int, n_rows: int, mode: str = "miss") -> bool:
    """Whether :func:`experts_ffn` takes a layer's gate+up and down (the same words for both, IQ4_XS)."""
    if qtype != GGMLType.IQ4_XS or not words.is_cuda or not _switched_on() or ffn_config(mode) is None:
        return False
    if n_rows + 2 > _SYNC_WORDS or not (h.dtype == y.dtype == torch.float32 and y.stride(-1) == 1):
        return False
    if not (h.stride(-1) == 1 and _aligned(h, 16) and h.stride(0) % 4 == 0):
        return False
    if not experts_supported(words, qtype, x, h, x_miss, expert_bytes, down_part_bytes, "miss"):
        return False
    mod = _module(ffn=True)
    return mod is not None and mod.ffn_sync() is not None


def experts_ffn(words: Tensor, qtype: GGMLType, host_delta: int, down_part_words: int, expert_words: int,
                n_ff: int, n_embd: int, gu_row_bytes: int, down_row_bytes: int, slot_of: Tensor, ids: Tensor,
                x: Tensor, h: Tensor, y: Tensor, n_used: int, weights: Tensor, mode: str = "miss",
                cpu_share: int = 0, x_miss: "Tensor | None" = None) -> Tensor:
    """:func:`experts` with ``gate_up=True`` into ``h``, then with ``gate_up=False`` from ``h`` into
    ``y``, in one launch; callers check :func:`ffn_supported`."""
    word = words.element_size()
    go, do, warps, pre = ffn_config(mode)
    n_sub_gu, n_sub_dn = gu_row_bytes // _IQ4_SUPER * 8, down_row_bytes // _IQ4_SUPER * 8
    pre = _pre_kernel(pre, (n_sub_dn + 31) // 32, _FFN_PRE)
    x_delta = 0 if x_miss is None else (x_miss.data_ptr() - x.data_ptr()) // 4
    n_rows = ids.shape[0]
    gu_bpr = (n_ff + go * warps - 1) // (go * warps)
    dn_bpr = (n_embd + do * warps - 1) // (do * warps)
    mod = _module(ffn=True)
    sync = mod.ffn_sync()
    if sync is None:        # first used inside a capture: ffn_supported, called before, makes them
        raise RuntimeError("experts_ffn: the fused launch's counters do not exist yet (call ffn_supported first)")
    args = [_p(words), ctypes.c_longlong(host_delta * word), ctypes.c_longlong(down_part_words * word),
            ctypes.c_longlong(expert_words * word), _p(slot_of), _p(ids), _p(weights), _p(x), _p(h), _p(y),
            ctypes.c_int(n_ff), ctypes.c_int(n_embd), ctypes.c_int(n_sub_gu), ctypes.c_int(n_sub_dn),
            ctypes.c_longlong(gu_row_bytes), ctypes.c_longlong(down_row_bytes), ctypes.c_int(n_used),
            ctypes.c_int(x.stride(0)), ctypes.c_int(h.stride(0)), ctypes.c_int(y.stride(0)),
            ctypes.c_int(int(cpu_share)), ctypes.c_longlong(x_delta), _p(sync), ctypes.c_int(gu_bpr),
            ctypes.c_int(dn_bpr), ctypes.c_int(n_rows)]
    mod.launch(f"iq4xs_ffn_{go}_{do}_p{pre}", ((gu_bpr + dn_bpr) * n_rows, 1), 32 * warps, args)
    return y


# ---------------------------------------------------------------------------
# dense


def dense_t_max() -> int:
    """The most activation rows :func:`dense` takes (FLE_CUDA_MV_DENSE_T, else DENSE_T_MAX)."""
    env = _env_ints("FLE_CUDA_MV_DENSE_T", (1,), "the most activation rows of a dense launch, 1 to 4")
    if env is None:
        return DENSE_T_MAX
    if env[0] not in _DENSE_T:
        raise FleError(f"FLE_CUDA_MV_DENSE_T={env[0]}: there are dense kernels for {_DENSE_T} activation rows")
    return env[0]


def dense_supported(w: Tensor, qtype: GGMLType, x: Tensor, out: Tensor) -> bool:
    """Whether :func:`dense` takes this product (Q8_0, up to :func:`dense_t_max` tokens, aligned rows)."""
    if qtype != GGMLType.Q8_0 or not w.is_cuda or not _switched_on():
        return False
    n_tok = x.shape[0]
    if out.shape[0] != n_tok or (n_tok != 1 and not 1 < n_tok <= dense_t_max()):     # one row: no lookup
        return False
    row_bytes = w.shape[-1]
    if row_bytes % (2 * _Q8_BLOCK) or not _aligned(w, 4):
        return False
    if not (x.dtype == out.dtype == torch.float32 and x.stride(-1) == 1 and out.stride(-1) == 1 and _aligned(x, 16)):
        return False
    if n_tok > 1 and x.stride(0) % 4:
        return False
    return _module() is not None


def dense(w: Tensor, qtype: GGMLType, x: Tensor, out: Tensor) -> Tensor:
    """``out [T, n_out] = x [T, n_in] @ W.T`` for Q8_0 rows ``w`` (uint8
    ``[n_out, row_bytes]``), T up to 4; callers check :func:`dense_supported`."""
    env, env_pre = _env_config(), _env_pre()
    n_out = w.shape[0]
    staged = dense_staged(w)
    if staged:
        rows, warps = STAGE_CONFIG[x.shape[0] > 1][n_out >= DENSE_LARGE]
        pre = 0
    else:
        rows, warps, pre = DENSE_CONFIG[n_out >= DENSE_LARGE]
    if env and len(env) == 6:
        rows, warps = env[4], env[5]
    if env_pre:
        pre = env_pre[2]
    if rows not in _DENSE_ROWS:
        raise FleError(f"FLE_CUDA_MV_CONFIG: no dense kernel with {rows} rows per warp (there are {_DENSE_ROWS})")
    row_bytes = w.shape[-1]
    n_blocks = row_bytes // _Q8_BLOCK
    n_tok = x.shape[0]
    shared = 0
    if staged:                          # rows through shared memory (cuda_mv.cu's q8_0_mvs)
        name = f"q8_0_ms_{rows}_t{n_tok}"
        shared = warps * rows * min(n_blocks, _Q8S_CHUNK) * _Q8_BLOCK + 16
    elif n_tok == 1:
        name = f"q8_0_mv_{rows}_p{_pre_kernel(pre, (n_blocks + 31) // 32, _DENSE_PRE)}"
    else:                               # several activation rows: no loads-first variants
        name = f"q8_0_mv_{rows}_p0_t{n_tok}"
    grid = ((n_out + rows * warps - 1) // (rows * warps), 1)
    _module().launch(name, grid, 32 * warps,
                     [_p(w), _p(x), _p(out), ctypes.c_int(n_out), ctypes.c_int(n_blocks),
                      ctypes.c_longlong(row_bytes), ctypes.c_int(x.stride(0)), ctypes.c_int(out.stride(0))], shared)
    return out


def dense_staged(w: Tensor) -> bool:
    """Whether :func:`dense` takes the kernel that stages rows through shared memory
    (FLE_CUDA_MV_DENSE=stage, else =word for the one-block-per-lane kernel; unset:
    :data:`DENSE_DEFAULT`): rows of a multiple of 8 blocks, 16-byte aligned."""
    mode = os.environ.get("FLE_CUDA_MV_DENSE") or DENSE_DEFAULT
    if mode not in ("stage", "word"):
        raise FleError(f"FLE_CUDA_MV_DENSE={mode!r}: it takes stage or word; unset it for the measured default")
    return mode == "stage" and (w.shape[-1] // _Q8_BLOCK) % 8 == 0 and _aligned(w, 16)
