"""Weights as the engine holds them: dense matrices in their GGUF bytes on
the device (multiplied by the quantized kernels, never dequantized; F16 and
BF16 matrices as float16/bfloat16 tensors, widened in the float kernel's
registers, never copied to float32), small
vectors in float32, and the routed experts of every layer in one host
buffer, read once from the file and page-locked so that the GPU reads
missed experts from it directly (:class:`HostExperts`), or, when the
machine cannot hold or lock that buffer, left memory-mapped in the file
and packed on demand (:class:`MappedExperts`; :func:`open_host_experts`
decides).

Host layout: layer l's region holds ``E`` experts of ``expert_bytes[l]``
bytes each; an expert is its gate rows, then its up rows (one block, so one
kernel multiplies both), then, at the next 16-byte boundary, its down rows
(the padding bytes are zero). Regions start on 4 KiB boundaries.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fle_quant.errors import FleError
from fle_quant.ggml_types import BLOCK_GEOMETRY, GGMLType

from ..kernels import engine_ops
from ..kernels.cpu_experts import Geometry

__all__ = ["DenseMatrix", "ExpertLayout", "HostExperts", "MappedExperts", "PackBuffer", "open_host_experts",
           "pack_experts", "available_memory", "HOST_MODES", "check_host_mode", "dense", "vector", "FAST_TYPES"]

FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
_FLOAT_DTYPES = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}
FAST_TYPES = tuple(engine_ops.WORDS)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class DenseMatrix:
    """``[n_out, n_in]`` weights: raw GGUF rows (uint8 ``[n_out, row_bytes]``)
    of ``qtype``, or for float types a tensor of the file's own float type
    (float32, float16 or bfloat16: the file's bytes)."""
    name: str
    qtype: GGMLType
    data: Tensor
    n_out: int
    n_in: int

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def matvec(self, x: Tensor, out: Tensor, impl: str) -> Tensor:
        """``out`` [T, n_out] = x [T, n_in] @ W.T (float32)."""
        if self.qtype in FLOAT_TYPES:
            # 16-bit weights through the float kernel, which widens them as it reads them; a float32 matrix
            # keeps torch's matmul (the reference's product), as before 16-bit matrices stayed 16-bit
            if impl == "triton" and self.data.dtype != torch.float32:
                from ..kernels.triton_engine import float_mv

                return float_mv(x, self.data, out)
            return engine_ops.float_mv_ref(x, self.data, out)
        if impl == "triton":
            from ..kernels import cuda_mv, triton_quant

            if cuda_mv.dense_supported(self.data, self.qtype, x, out):
                return cuda_mv.dense(self.data, self.qtype, x, out)

            return triton_quant.mul_mat(self.data, self.qtype, x, config=_dense_config(self.n_out, x.shape[0]),
                                        out=out)
        from ..kernels import reference

        out.copy_(reference.mul_mat(self.data, self.qtype, x))
        return out


def _dense_config(n_out: int, n_tok: int):
    """Launch parameters of a dense product: at T = 1 enough programs to
    fill the GPU (~1,000: a 2048-row matrix in 16-row programs is 128 of
    them, 357 GB/s on an H200, bench/engine_kernels.py), else the defaults."""
    if n_tok != 1:
        return None
    from ..kernels.triton_quant import Config

    block_n = 16
    while block_n > 2 and n_out // block_n < 1024:
        block_n //= 2
    return Config(block_n=block_n, num_warps=4 if block_n >= 8 else 2, t_pad=1)


def dense(gguf, name: str, device, n_out: int, n_in: int, *, fast_needed: bool, rows=None) -> DenseMatrix:
    """Tensor ``name`` as a :class:`DenseMatrix` on ``device``; ``rows``
    (indices) keeps those rows only, in that order (rows are quantized one
    by one, so their bytes move as they are). A block type without a fast
    kernel is refused when ``fast_needed``."""
    info = gguf.info(name)
    shape = tuple(reversed(info.shape))
    want = (n_out if rows is None else shape[0], n_in)
    if len(shape) != 2 or shape != want or (rows is not None and len(rows) != n_out):
        raise FleError(f"{gguf.paths[0]}: tensor {name!r} has shape {list(shape)}; the hyperparameters "
                       f"need {[n_out, n_in]}")
    raw = gguf.tensor_bytes(name).reshape(shape[0], -1)
    if rows is not None:
        raw = raw[np.asarray(rows)]
    qt = GGMLType(info.qtype)
    if qt in FLOAT_TYPES:
        # the file's bytes as a tensor of its float type (the float kernel widens 16-bit values as it reads them)
        data = torch.from_numpy(np.array(raw)).view(_FLOAT_DTYPES[qt]).reshape(n_out, n_in)
    else:
        if fast_needed and qt not in FAST_TYPES:
            raise FleError(f"{gguf.paths[0]}: tensor {name!r} is {qt.name}, which the engine has no fast GPU "
                           f"kernel for (fast: {', '.join(t.name for t in FAST_TYPES)}); run it with "
                           f"--device cpu (the reference path) or requantize the tensor (fle-requant)")
        data = torch.from_numpy(np.array(raw).reshape(n_out, -1))
    return DenseMatrix(name, qt, data.to(device), n_out, n_in)


def unique_bytes(mats) -> int:
    """Bytes of the matrices' storage, each storage once (row views of a
    concatenated matrix share it)."""
    seen = {}
    for m in mats:
        st = m.data.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def concat(mats: list[DenseMatrix], name: str) -> "DenseMatrix | None":
    """Row-concatenation of matrices of one quant type (q, k, v as one
    product), or None when their types differ."""
    if len({m.qtype for m in mats}) != 1 or len({m.n_in for m in mats}) != 1:
        return None
    data = torch.cat([m.data for m in mats], 0)
    return DenseMatrix(name, mats[0].qtype, data, sum(m.n_out for m in mats), mats[0].n_in)


def vector(gguf, name: str, device, n: int) -> Tensor:
    """A small float tensor (norm weights) as float32 [n]."""
    from ..quantized import dequantize_rows

    info = gguf.info(name)
    if int(np.prod(info.shape)) != n:
        raise FleError(f"{gguf.paths[0]}: tensor {name!r} has {int(np.prod(info.shape))} values, expected {n}")
    vals = dequantize_rows(gguf.tensor_bytes(name).reshape(1, -1), GGMLType(info.qtype), n)
    return torch.from_numpy(np.ascontiguousarray(vals.reshape(n))).to(device)


# where the parts of one layer's experts sit in an expert's bytes: one definition, torch-free, shared
# with the CPU expert kernels
ExpertLayout = Geometry


def expert_layout(gguf, il: int, n_ff: int, n_embd: int, *, fast_needed: bool) -> tuple[ExpertLayout, list]:
    """The layout of layer ``il``'s experts and their sources (raw views of
    the file: gate, up (or one fused gate_up) and down)."""
    p = f"blk.{il}."
    if p + "ffn_gate_up_exps.weight" in gguf.tensors:
        gu = gguf.info(p + "ffn_gate_up_exps.weight")
        sources = [gguf.tensor_bytes(gu.name)]
        gu_types = {GGMLType(gu.qtype)}
        gu_rb = gu.row_bytes
    else:
        g, u = gguf.info(p + "ffn_gate_exps.weight"), gguf.info(p + "ffn_up_exps.weight")
        if g.qtype != u.qtype:
            raise FleError(f"{gguf.paths[0]}: layer {il}: ffn_gate_exps is {GGMLType(g.qtype).name} but ffn_up_exps "
                           f"{GGMLType(u.qtype).name}; the engine multiplies both in one kernel and needs one type")
        sources = [gguf.tensor_bytes(g.name), gguf.tensor_bytes(u.name)]
        gu_types = {GGMLType(g.qtype)}
        gu_rb = g.row_bytes
    d = gguf.info(p + "ffn_down_exps.weight")
    sources.append(gguf.tensor_bytes(d.name))
    lay = ExpertLayout(n_ff, n_embd, gu_types.pop(), gu_rb, GGMLType(d.qtype), d.row_bytes)
    if fast_needed:
        for qt, nm in ((lay.gu_type, "gate/up"), (lay.down_type, "down")):
            if qt not in FAST_TYPES:
                raise FleError(f"{gguf.paths[0]}: layer {il} {nm} experts are {qt.name}, which the engine has no "
                               f"fast GPU kernel for (fast: {', '.join(t.name for t in FAST_TYPES)}); run with "
                               f"--device cpu (the reference path) or requantize them (fle-requant)")
    for qt, rb, n_in in ((lay.gu_type, gu_rb, n_embd), (lay.down_type, d.row_bytes, n_ff)):
        vals, size = BLOCK_GEOMETRY[qt]
        if rb % size or rb // size * vals != n_in:
            raise FleError(f"{gguf.paths[0]}: layer {il}: expert rows of {rb} bytes do not hold {n_in} {qt.name} values")
    return lay, sources


def _cudart():
    return torch.cuda.cudart()


def host_buffer(nbytes: int, huge: bool = False) -> np.ndarray:
    """uint8 [nbytes] of host memory; ``huge``: an anonymous mapping advised
    to use transparent huge pages (2 MiB, Linux's MADV_HUGEPAGE; ignored
    where the kernel does not offer them), so that a page-locked buffer
    that the GPU reads is mapped with fewer, larger pages. The mapping is
    returned when the array is collected."""
    import mmap

    if not huge or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(nbytes, np.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(m, np.uint8)


def huge_pages() -> bool:
    """The routed experts' host buffer asks for huge pages (:func:`host_buffer`) unless FLE_HOST_HUGEPAGES=0."""
    import os

    return os.environ.get("FLE_HOST_HUGEPAGES", "1") != "0"


def pin_host(buf: np.ndarray, what: str, why: str) -> None:
    """Page-lock ``buf`` and map it for the GPU: cudaHostRegister (portable
    | mapped), so the pages stay resident and the GPU reads them by their
    host address (torch's pinned allocator would round the size up to a
    power of two). Undo with ``cudaHostUnregister`` before freeing."""
    err = _cudart().cudaHostRegister(buf.ctypes.data, buf.nbytes, 3)
    code = int(getattr(err, "value", err))
    if code != 0:
        raise FleError(f"cannot page-lock {buf.nbytes / 2**30:.1f} GiB of host memory for {what} "
                       f"(cudaHostRegister error {code}); raise the locked-memory limit (ulimit -l) or free "
                       f"RAM; {why}")


class PageLocked:
    """A host buffer ``self.buf`` page-locked and mapped for the GPU while
    its owner lives (:func:`pin_host`); the registration ends in
    :meth:`close` or at collection, before the memory goes back to the
    allocator, which may hand the same addresses to the next buffer."""

    pinned = False

    def lock(self, what: str, why: str) -> None:
        pin_host(self.buf.reshape(-1), what, why)
        self.pinned = True

    def close(self) -> None:
        if self.pinned:
            _cudart().cudaHostUnregister(self.buf.ctypes.data)
            self.pinned = False

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def pack_experts(lay: ExpertLayout, sources: list, sel, out: np.ndarray) -> np.ndarray:
    """Experts ``sel`` (a slice or int indices) of one layer packed from the
    file views ``sources`` ([gate, up, down] or [gate_up, down]) into
    ``out`` uint8 [n, expert_bytes] in the host layout; returns ``out``.
    Only the selected experts' bytes of the file are read."""
    half = lay.n_ff * lay.gu_row_bytes
    gu_end = 2 * half
    down_end = lay.down_offset + lay.n_embd * lay.down_row_bytes
    *gu_parts, down = sources
    o = 0
    for src in gu_parts:                    # one fused gate_up block, or gate then up
        w = src.reshape(src.shape[0], -1)
        out[:, o:o + w.shape[1]] = w[sel]
        o += w.shape[1]
    out[:, gu_end:lay.down_offset] = 0
    out[:, lay.down_offset:down_end] = down.reshape(down.shape[0], -1)[sel]
    out[:, down_end:] = 0
    return out


class HostExperts(PageLocked):
    """Every layer's routed experts in one host buffer (page-locked on CUDA).

    ``view(l)``: uint8 [E, expert_bytes[l]] of layer l; ``address(l)``: its
    address (the GPU reads it at the same address when the buffer is
    page-locked)."""

    mapped = False

    def __init__(self, layouts: dict[int, ExpertLayout], n_expert: int, pin: bool):
        self.layouts, self.n_expert = layouts, n_expert
        self.offsets, off = {}, 0
        for il in sorted(layouts):
            self.offsets[il] = off
            off = _align(off + n_expert * layouts[il].expert_bytes, 4096)
        self.nbytes = off
        try:
            self.buf = host_buffer(max(off, 1), huge=pin and huge_pages())
        except (MemoryError, OSError):
            raise FleError(f"the routed experts take {off / 2**30:.1f} GiB of host memory and this machine "
                           f"cannot allocate that; use a smaller file or a machine with more RAM") from None
        self.tensor = torch.from_numpy(self.buf)
        if pin:
            self.lock("the routed experts", "misses are read by the GPU from page-locked memory")

    def view(self, il: int) -> Tensor:
        n = self.n_expert * self.layouts[il].expert_bytes
        o = self.offsets[il]
        return self.tensor[o:o + n].view(self.n_expert, self.layouts[il].expert_bytes)

    def address(self, il: int) -> int:
        return self.buf.ctypes.data + self.offsets[il]

    @property
    def mode(self) -> str:
        return "pinned" if self.pinned else "process"

    def rows(self, il: int) -> Tensor:
        """Layer ``il``'s experts indexable by expert id (a packed expert each)."""
        return self.view(il)

    def expert(self, il: int, e: int, out: "np.ndarray | None" = None) -> np.ndarray:
        """uint8 [expert_bytes]: expert ``e`` of layer ``il`` (a view; copied into ``out`` when given)."""
        row = self.view(il)[int(e)].numpy()
        if out is None:
            return row
        out[...] = row
        return out

    def gather(self, il: int, ids, out: np.ndarray) -> np.ndarray:
        """Experts ``ids`` of layer ``il`` packed into ``out[:n]`` ([n, expert_bytes])."""
        ids = np.asarray(ids, np.int64)
        return np.take(self.view(il).numpy(), ids, axis=0, out=out[:len(ids)])

    def fill(self, il: int, sources: list) -> None:
        """Copy layer ``il``'s experts from the file views into the buffer."""
        pack_experts(self.layouts[il], sources, slice(None), self.view(il).numpy())


class _MappedRows:
    """One layer of :class:`MappedExperts` indexable by expert id, as the
    reference operations and the slot copies index a layer of the host
    buffer: ``rows[e]`` is expert e packed (uint8 [expert_bytes], a fresh
    array)."""

    def __init__(self, store: "MappedExperts", il: int):
        self.store, self.il = store, il

    def __getitem__(self, e) -> Tensor:
        return torch.from_numpy(self.store.expert(self.il, int(e)))


class MappedExperts:
    """Every layer's routed experts left in the memory-mapped file: no copy
    is held (the OS page cache keeps what was read). The interface of
    :class:`HostExperts` for what can be asked of pageable memory:
    ``expert``, ``gather`` and ``rows`` pack experts on demand; there is
    no address for the GPU (every miss is computed on the CPU)."""

    mapped = True
    pinned = False
    mode = "mapped"

    def __init__(self, layouts: dict[int, ExpertLayout], n_expert: int, sources: dict[int, list], path=None):
        self.layouts, self.n_expert, self.path = layouts, n_expert, path
        self.sources = {il: sources[il] for il in layouts}
        self.nbytes = sum(n_expert * lay.expert_bytes for lay in layouts.values())

    def rows(self, il: int) -> _MappedRows:
        return _MappedRows(self, il)

    def expert(self, il: int, e: int, out: "np.ndarray | None" = None) -> np.ndarray:
        lay = self.layouts[il]
        dst = np.empty(lay.expert_bytes, np.uint8) if out is None else out
        pack_experts(lay, self.sources[il], slice(int(e), int(e) + 1), dst.reshape(1, -1))
        return dst

    def gather(self, il: int, ids, out: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        return pack_experts(self.layouts[il], self.sources[il], ids, out[:len(ids)])

    def address(self, il: int) -> int:
        raise AssertionError("internal: memory-mapped experts have no address for the GPU; every miss must go to "
                             "the CPU")

    def close(self) -> None:
        pass


class PackBuffer(PageLocked):
    """Host memory that memory-mapped experts are packed into before a copy
    to the device: page-locked when ``pin`` (so the copy runs
    asynchronously), grown on demand. Its user waits for the last copy
    out of it before packing again."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.buf = np.empty(0, np.uint8)

    def take(self, nbytes: int) -> np.ndarray:
        """uint8 [nbytes] of the buffer (its earlier contents are given up)."""
        if nbytes > self.buf.nbytes:
            self.close()
            self.buf = np.empty(_align(nbytes, 1 << 20), np.uint8)
            if self.pin:
                self.lock("packing memory-mapped experts", "or give the machine more free RAM")
        return self.buf[:nbytes]


HOST_MODES = ("auto", "pinned", "mapped")
MARGIN = 4 << 30            # RAM left to the rest of the process and the OS when "auto" takes the host buffer


def available_memory() -> "int | None":
    """Bytes of RAM available to a new allocation (psutil where installed,
    else MemAvailable of /proc/meminfo); None when neither says."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_mode(mode: str) -> None:
    """A FleError naming ``--host-experts``' modes unless ``mode`` is one."""
    if mode not in HOST_MODES:
        raise FleError(f"--host-experts {mode!r}: auto, pinned or mapped")


def _mapped_line(need: int, why: str) -> str:
    return (f"fle-engine: the routed experts take {need / 2**30:.1f} GiB and {why}: they stay memory-mapped in "
            f"the file (misses computed on the CPU; --host-experts pinned to insist)")


def open_host_experts(layouts: dict[int, ExpertLayout], n_expert: int, sources: dict[int, list], mode: str,
                      pin: bool, log=print, path=None) -> "HostExperts | MappedExperts":
    """The engine's store of the routed experts for ``--host-experts``
    ``mode``: "pinned", the host buffer (page-locked when ``pin``) or a
    FleError naming the amount; "mapped", :class:`MappedExperts`; "auto",
    the host buffer when it fits the available RAM less :data:`MARGIN`
    and can be allocated (and locked), else memory-mapped, said in one
    line. The host buffer comes back empty (fill it)."""
    check_host_mode(mode)
    if mode == "mapped":
        return MappedExperts(layouts, n_expert, sources, path)
    need = sum(n_expert * lay.expert_bytes for lay in layouts.values())
    avail = available_memory()
    if avail is not None and need > avail - (MARGIN if mode == "auto" else 0):
        if mode == "pinned":
            raise FleError(f"the routed experts take {need / 2**30:.1f} GiB of host memory and "
                           f"{avail / 2**30:.1f} GiB of RAM is available; use --host-experts mapped (or auto), a "
                           f"smaller file or a machine with more RAM")
        log(_mapped_line(need, f"{avail / 2**30:.1f} GiB of RAM is available"))
        return MappedExperts(layouts, n_expert, sources, path)
    try:
        return HostExperts(layouts, n_expert, pin)
    except FleError as e:
        if mode == "pinned":
            raise
        why = str(e)
    # the failed buffer is gone with the exception: the file's pages are what is read from now on
    log(_mapped_line(need, f"the host buffer failed ({why.split(';')[0]})"))
    return MappedExperts(layouts, n_expert, sources, path)
