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

__all__ = ["Weights", "Model", "load"]

_MISSING = object()


class Weights:
    """Tensors and hyperparameters of one open GGUF file.

    ``get(name)`` dequantizes one tensor to ``dtype`` on ``device`` in numpy
    (= torch) axis order, the reverse of ggml's: a matrix stored as ggml
    ``[n_in, n_out]`` comes back ``[n_out, n_in]`` (nn.Linear's layout) and a
    stacked expert tensor ``[n_in, n_out, E]`` as ``[E, n_out, n_in]``."""

    def __init__(self, gguf: GGUFModel, device: "str | torch.device" = "cpu", dtype: torch.dtype = torch.float32):
        self.gguf = gguf
        self.path = gguf.paths[0]
        self.arch = gguf.arch
        self.device = torch.device(device)
        self.dtype = dtype

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


def load(path: "str | os.PathLike[str]", device: "str | torch.device" = "cpu",
         dtype: torch.dtype = torch.float32) -> Model:
    """Load the GGUF model at ``path`` (any shard of a split model) for the
    reference forward pass on ``device`` in ``dtype``."""
    from .models import get_arch

    gguf = GGUFModel.open(path)
    try:
        if gguf.arch is None:
            raise FleError(f"{gguf.paths[0]}: no general.architecture key; not a model file")
        mod = get_arch(gguf.arch, gguf.paths[0])
        weights = Weights(gguf, device, dtype)
        net = mod.Transformer.from_weights(weights)
    finally:
        gguf.close()
    net.eval()
    return Model(net, Path(path))
