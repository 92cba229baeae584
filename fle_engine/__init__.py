"""FLE's decoder for the MoE models fle_quant makes and edits (torch).

``load(path)`` reads a GGUF file and returns a :class:`Model`: prefill logits
(``Model.logits``), incremental decoding over a preallocated state
(``Model.new_state``, ``Model.forward``) and MoE capture hooks
(``Model.capture``, ``Model.capturing``). The reference forward passes, one
module per architecture under :mod:`fle_engine.models`, follow llama.cpp's
graphs; shared blocks are in :mod:`fle_engine.layers`. This package is the
only part of FLE that imports torch."""

from .layers import MoECapture, MoERecord, State
from .loader import Model, Weights, load

__version__ = "0.1.0"

__all__ = ["load", "Model", "Weights", "State", "MoECapture", "MoERecord"]
