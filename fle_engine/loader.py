"""Open a GGUF model for FLE's reference forward pass: read the metadata,
dequantize only the tensors the architecture asks for, one at a time, and
wrap the architecture's module in :class:`Model`, the interface the rest of
the engine uses (prefill logits, decode state, MoE capture).

This module knows nothing about any one architecture; those live in
:mod:`fle_engine.models`, one file each, found by ``general.architecture``.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from fle_quant.errors import FleError
from fle_quant.ggml_types import GGMLType
from fle_quant.gguf_reader import GGUFModel

from .layers import MoE, MoECapture, State
from .quantized import QuantExperts, QuantRows

__all__ = ["Weights", "Model", "load"]

_MISSING = object()


class Weights:
    """Tensors and hyperparameters of one open GGUF file.

    ``get(name)`` dequantizes one tensor to ``dtype`` on ``device`` in numpy
    (= torch) axis order, the reverse of ggml's: a matrix stored as ggml
    ``[n_in, n_out]`` comes back ``[n_out, n_in]`` (nn.Linear's layout) and a
    stacked expert tensor ``[n_in, n_out, E]`` as ``[E, n_out, n_in]``."""

    def __init__(self, gguf: GGUFModel, device: "str | torch.device" = "cpu", dtype: torch.dtype = torch.float32,
                 stream: bool = False):
        self.gguf = gguf
        self.path = gguf.paths[0]
        self.arch = gguf.arch
        self.device = torch.device(device)
        self.dtype = dtype
        self.stream = stream    # experts and big tables stay quantized in the file (fle_engine.quantized)

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def hp(self, key: str, default: Any = _MISSING) -> Any:
        """Hyperparameter ``{arch}.{key}``; FleError naming the key when it is
        missing and no default is given."""
        return self.gguf.hparam(key, default) if default is not _MISSING else self.gguf.hparam(key)

    def get(self, name: str, shape: Sequence[int] | None = None) -> Tensor:
        """Tensor ``name`` dequantized; ``shape`` (torch order), when given,
        is checked."""
        info = self.gguf.info(name)
        want = tuple(reversed(info.shape))
        if shape is not None and tuple(shape) != want:
            raise FleError(f"{self.path}: tensor {name!r} has shape {list(want)} (torch order), "
                           f"the {self.arch} hyperparameters need {list(shape)}; the file is inconsistent")
        raw = self.gguf.tensor_bytes(name)
        if info.qtype == GGMLType.F32:
            values = np.array(raw.view(np.float32))
        elif info.qtype == GGMLType.F16:
            values = raw.view(np.float16).astype(np.float32)
        else:
            from fle_quant.quants import dequantize  # numba kernels: compiled only when a quantized file is read

            values = dequantize(raw, info.qtype)
        values = values.reshape(want)
        return torch.from_numpy(values).to(device=self.device, dtype=self.dtype)

    def experts(self, name: str, shape: Sequence[int]):
        """A stacked expert tensor [E, n_out, n_in]: dequantized, or left in
        the file as a :class:`~fle_engine.quantized.QuantExperts` when
        streaming."""
        if self.stream:
            return QuantExperts(self.gguf, name, shape, self.device, self.dtype)
        return self.get(name, shape)

    def experts_split(self, name: str, shape: Sequence[int]):
        """(gate, up) of a fused gate_up expert tensor (gate rows first),
        each of ``shape`` [E, F, n_in]."""
        n_exp, n_ff, n_in = shape
        if self.stream:
            return (QuantExperts(self.gguf, name, shape, self.device, self.dtype, rows=(0, n_ff)),
                    QuantExperts(self.gguf, name, shape, self.device, self.dtype, rows=(n_ff, 2 * n_ff)))
        both = self.get(name, (n_exp, 2 * n_ff, n_in))
        return both[:, :n_ff].contiguous(), both[:, n_ff:].contiguous()

    def table(self, name: str):
        """A lookup table [rows, n] (an embedding): dequantized, or left in
        the file as a :class:`~fle_engine.quantized.QuantRows` when
        streaming."""
        if self.stream:
            return QuantRows(self.gguf, name, self.device, self.dtype)
        return torch.nn.Parameter(self.get(name), requires_grad=False)


class Model:
    """A loaded model: the architecture's module plus the interface FLE uses.

    - ``logits(tokens)``: prefill from an empty state, float32 numpy
      ``[n_tokens, n_vocab]``.
    - ``new_state(max_tokens)`` and ``forward(tokens, state)``: incremental
      decoding; ``forward`` appends the tokens' positions to ``state`` and
      returns their logits ``[T, n_vocab]`` (a torch tensor on the device).
      It serves prefill (many tokens) and decode (one token) alike.
    - ``capture``: a :class:`~fle_engine.layers.MoECapture` (or None, the
      default) that records every MoE call; ``capturing()`` is the context
      manager form.
    """

    def __init__(self, net: torch.nn.Module, path: Path):
        self.net = net
        self.path = path
        self.arch: str = net.args.arch
        self.args = net.args
        self._capture: MoECapture | None = None

    @property
    def n_vocab(self) -> int:
        return self.net.args.n_vocab

    @property
    def device(self) -> torch.device:
        return self.net.device

    def new_state(self, max_tokens: int) -> State:
        if int(max_tokens) < 1:
            raise FleError(f"max_tokens must be at least 1, got {max_tokens}")
        return self.net.new_state(int(max_tokens))

    def forward(self, tokens: "Tensor | Sequence[int]", state: State) -> Tensor:
        """Logits ``[T, n_vocab]`` of ``tokens`` (a device tensor, or ids
        checked against the vocabulary here) appended to ``state``."""
        if not isinstance(tokens, Tensor):
            tokens = [int(t) for t in tokens]
            self._check_ids(tokens)
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        n = tokens.shape[0]
        if n == 0:
            raise FleError("forward needs at least one token")
        if state.length + n > state.max_tokens:
            raise FleError(f"the state holds {state.max_tokens} positions; {state.length} are used and "
                           f"{n} more do not fit; make the state with a larger max_tokens")
        with torch.inference_mode():
            out = self.net(tokens, state)
        state.length += n
        return out

    __call__ = forward

    def forward_batch(self, tokens: "Sequence[Sequence[int]]", states: Sequence[State]) -> list[Tensor]:
        """``forward`` of several sequences at once: ``tokens[i]`` appended to
        ``states[i]`` (distinct states), each one's logits ``[T_i, n_vocab]``.
        The architectures run the token-wise work (embedding, MoE, head) on
        all tokens together; one that cannot runs the sequences one by one."""
        if len(tokens) != len(states):
            raise FleError(f"forward_batch: {len(tokens)} token lists for {len(states)} states")
        if len({id(s) for s in states}) != len(states):
            raise FleError("forward_batch: a state appears twice")
        batch = []
        for toks, state in zip(tokens, states):
            toks = [int(t) for t in toks]
            self._check_ids(toks)
            if not toks:
                raise FleError("forward needs at least one token")
            if state.length + len(toks) > state.max_tokens:
                raise FleError(f"the state holds {state.max_tokens} positions; {state.length} are used and "
                               f"{len(toks)} more do not fit; make the state with a larger max_tokens")
            batch.append(torch.tensor(toks, dtype=torch.long, device=self.device))
        run = getattr(self.net, "forward_batch", None)
        with torch.inference_mode():
            if run is None:
                out = [self.net(t, s) for t, s in zip(batch, states)]
            else:
                out = run(batch, states)
        for t, state in zip(batch, states):
            state.length += t.shape[0]
        return out

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        toks = [int(t) for t in tokens]
        if not toks:
            raise FleError("logits needs at least one token")
        state = self.new_state(len(toks))
        return self.forward(toks, state).float().cpu().numpy()

    def _check_ids(self, toks: list[int]) -> None:
        bad = [t for t in toks if not 0 <= t < self.n_vocab]
        if bad:
            raise FleError(f"token id {bad[0]} is outside the vocabulary of {self.path} (0..{self.n_vocab - 1})")

    # MoE capture -------------------------------------------------------------
    def moe_layers(self) -> list[MoE]:
        return [m for m in self.net.modules() if isinstance(m, MoE)]

    @property
    def capture(self) -> MoECapture | None:
        return self._capture

    @capture.setter
    def capture(self, cap: MoECapture | None) -> None:
        self._capture = cap
        for m in self.moe_layers():
            m.capture = cap

    @contextlib.contextmanager
    def capturing(self) -> Iterator[MoECapture]:
        """``with model.capturing() as cap: model.logits(...)`` records every
        MoE call into ``cap`` and detaches it afterwards."""
        old = self._capture
        cap = MoECapture()
        self.capture = cap
        try:
            yield cap
        finally:
            self.capture = old

    def __repr__(self) -> str:
        return f"Model({str(self.path)!r}, arch={self.arch!r}, device={self.device})"


EXPERT_MODES = ("auto", "resident", "stream")


def _streamed_bytes(gguf: GGUFModel, dtype: torch.dtype) -> int:
    """Bytes the tensors that streaming leaves in the file (routed experts,
    the PLE table) take when dequantized to ``dtype``."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(int(np.prod(t.shape)) * size for t in gguf.tensors.values()
               if t.name.endswith("_exps.weight") or t.name == "per_layer_token_embd.weight")


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def load(path: "str | os.PathLike[str]", device: "str | torch.device" = "cpu",
         dtype: torch.dtype = torch.float32, experts: str = "auto") -> Model:
    """Load the GGUF model at ``path`` (any shard of a split model) for the
    reference forward pass on ``device`` in ``dtype``.

    ``experts``: ``"resident"`` dequantizes every tensor now; ``"stream"``
    leaves the routed experts and the PLE table quantized in the
    memory-mapped file and dequantizes per call only what the call uses, so
    that process memory is the dense weights in ``dtype`` plus one expert
    (a few of its matrices) at a time; ``"auto"`` (default) streams when the
    resident form of those tensors would exceed half of the device's memory
    (RAM for the CPU). Streaming syncs with the host in every MoE call: no
    CUDA graphs."""
    from .models import get_arch

    if experts not in EXPERT_MODES:
        raise FleError(f"experts must be one of {', '.join(EXPERT_MODES)}, not {experts!r}")
    gguf = GGUFModel.open(path)
    try:
        if gguf.arch is None:
            raise FleError(f"{gguf.paths[0]}: no general.architecture key; not a model file")
        mod = get_arch(gguf.arch, gguf.paths[0])
        device = torch.device(device)
        stream = experts == "stream" or (
            experts == "auto" and _streamed_bytes(gguf, dtype) > _memory_bytes(device) // 2)
        weights = Weights(gguf, device, dtype, stream=stream)
        net = mod.Transformer.from_weights(weights)
    finally:
        gguf.close()
    net.eval()
    net.streamed = stream
    return Model(net, Path(path))
