"""Score every routed expert of every MoE layer by how much the model uses
it: the "measure" step before :mod:`fle_quant.prune`, writing its score
table (format ``fle.scores/1``).

The model runs through FLE's reference forward pass (:mod:`fle_engine`) over
the first ``n_tokens`` tokens of a calibration text (its own tokenizer,
windows of ``ctx`` tokens each from an empty state) with an MoE capture
that, per layer, adds up over the tokens routed to each expert j (those
whose top-k includes j):

- ``count_j``: how many tokens were routed to j;
- ``sum_j ||f_j(x)||_2``: the L2 norm of j's own (unweighted) output;
- ``sum_j g_j(x) ||f_j(x)||_2``, with g_j(x) the router's top-k
  probabilities renormalised to sum 1 over the chosen experts (the same
  weights the layer mixes with, before any ``expert_weights_scale``).

Scores, higher = more important, 0 for an expert no token was routed to:

- ``reap``: REAP saliency, mean over j's routed tokens of g_j(x) ||f_j(x)||_2;
- ``man``: mean activation norm, mean over j's routed tokens of ||f_j(x)||_2;
- ``frequency``: count_j / the tokens the layer saw.

Only per-layer sums of ``n_expert`` numbers are kept, so memory does not grow
with the token count.

MTP blocks (qwen3next, qwen4exp: the head inside the model file, or a
separate head file given as ``mtp_head``): the head is run after each window
on the trunk's hidden states paired with the next tokens (``ctx - 1`` pairs
per window) and its MoE layer is scored under its block index, which is
where ``fle-reap prune`` (also with ``--mtp-head``) looks for it. Should a
file declare an MTP block that FLE's forward pass does not run, the table's
``info.mtp`` says so, and such a file cannot be pruned with that table.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import __version__
from .digest import model_fingerprint
from .errors import FleError
from .gguf_reader import GGUFModel
from .prune import SCORES_FORMAT, parse_scores
from .sensitivity import DEFAULT_CTX, DEFAULT_TOKENS, check_device, read_tokens, run_windows

__all__ = ["METHODS", "ExpertStats", "StatsCapture", "expert_stats", "scores_from_stats", "score"]

METHODS = ("reap", "man", "frequency")


@dataclass
class ExpertStats:
    """Sums over the tokens one MoE layer saw: ``count`` [E] int64 (tokens
    routed to each expert), ``norm`` [E] (sum of ||f_j||) and ``gnorm`` [E]
    (sum of g_j ||f_j||), float64; ``tokens``: the tokens the layer saw."""
    n_expert: int
    count: np.ndarray = field(init=False)
    norm: np.ndarray = field(init=False)
    gnorm: np.ndarray = field(init=False)
    tokens: int = 0

    def __post_init__(self) -> None:
        self.count = np.zeros(self.n_expert, np.int64)
        self.norm = np.zeros(self.n_expert, np.float64)
        self.gnorm = np.zeros(self.n_expert, np.float64)


class StatsCapture:
    """An MoE capture (the ``record`` interface of
    :class:`fle_engine.MoECapture`) that keeps only :class:`ExpertStats`."""

    def __init__(self) -> None:
        self.layers: dict[int, ExpertStats] = {}

    def record(self, rec) -> None:
        probs = rec.probs.double()                                       # [T, E]
        experts = rec.experts                                            # [T, K]
        top = probs.gather(1, experts)
        g = top / top.sum(1, keepdim=True)                              # renormalised over the chosen K
        norms = rec.expert_out.double().norm(dim=-1)                     # [T, K]
        st = self.layers.get(rec.layer)
        if st is None:
            st = self.layers[rec.layer] = ExpertStats(probs.shape[1])
        idx = experts.reshape(-1).cpu().numpy()
        st.count += np.bincount(idx, minlength=st.n_expert)
        st.norm += np.bincount(idx, weights=norms.reshape(-1).cpu().numpy(), minlength=st.n_expert)
        st.gnorm += np.bincount(idx, weights=(g * norms).reshape(-1).cpu().numpy(), minlength=st.n_expert)
        st.tokens += int(probs.shape[0])

    def clear(self) -> None:
        self.layers.clear()


def scores_from_stats(stats: dict[int, ExpertStats], method: str) -> dict[int, np.ndarray]:
    """Per layer, one score per expert (see the module docstring)."""
    if method not in METHODS:
        raise FleError(f"unknown scoring method {method!r}; choose one of {', '.join(METHODS)}")
    out = {}
    for layer, st in stats.items():
        routed = st.count > 0
        s = np.zeros(st.n_expert, np.float64)
        if method == "frequency":
            s = st.count / max(st.tokens, 1)
        elif method == "man":
            s[routed] = st.norm[routed] / st.count[routed]
        else:
            s[routed] = st.gnorm[routed] / st.count[routed]
        out[layer] = s
    return out


def _run_mtp_head(net, window, state) -> None:
    """Run the MTP head over the window's (trunk hidden state, next token)
    pairs from a fresh head cache; the capture sees its MoE call."""
    from fle_engine.mtp import head_logits

    if len(window) < 2 or getattr(state, "hidden", None) is None:
        return
    head_logits(net, state, state.hidden[:-1], window[1:])


def expert_stats(model_path: "str | os.PathLike[str]", tokens, ctx: int = DEFAULT_CTX, *,
                 mtp_head: "str | os.PathLike[str] | None" = None, device: str = "cpu",
                 progress: bool = False) -> tuple[dict[int, ExpertStats], dict]:
    """Run the model over ``tokens`` and return per MoE layer its
    :class:`ExpertStats`, and a note on the MTP block (``info["mtp"]``)."""
    import fle_engine

    check_device(device)
    model = fle_engine.load(model_path, device=device)
    net = model.net
    if mtp_head is not None:
        if not hasattr(net, "load_mtp"):
            raise FleError(f"{mtp_head}: FLE's forward pass runs no MTP head for {model.arch} models; "
                           "score the model without --mtp-head")
        net.load_mtp(mtp_head)
    with GGUFModel.open(model_path) as g:
        n_mtp = int(g.hparam("nextn_predict_layers", 0) or 0)
    head = getattr(net, "mtp", None)
    if head is not None:
        mtp_note = f"scored (block {head.moe.layer})"
    elif n_mtp:
        mtp_note = (f"not scored: FLE's forward pass does not run the MTP block of {model.arch} models; "
                    "its experts have no scores")
    else:
        mtp_note = "none"
    after = (lambda window, state: _run_mtp_head(net, window, state)) if head is not None else None
    cap = StatsCapture()
    model.capture = cap          # after load_mtp, so the head's MoE layer is attached too
    try:
        run_windows(model, tokens, ctx, progress=progress, desc="scoring", after=after)
    finally:
        model.capture = None
    if not cap.layers:
        raise FleError(f"{model_path}: the forward pass called no MoE layer; not an MoE model")
    return dict(sorted(cap.layers.items())), {"mtp": mtp_note}


def score(model_path: "str | os.PathLike[str]", text: "str | os.PathLike[str]", *, method: str = "reap",
          n_tokens: int = DEFAULT_TOKENS, ctx: int = DEFAULT_CTX, mtp_head: "str | os.PathLike[str] | None" = None,
          device: str = "cpu", progress: bool = False) -> dict:
    """The ``fle.scores/1`` table (validated) of ``model_path`` by ``method``
    over the first ``n_tokens`` tokens of ``text``."""
    if method not in METHODS:
        raise FleError(f"unknown scoring method {method!r}; choose one of {', '.join(METHODS)}")
    if ctx < 1:
        raise FleError(f"--ctx must be at least 1, got {ctx}")
    tokens = read_tokens(model_path, text, n_tokens)
    stats, note = expert_stats(model_path, tokens, ctx, mtp_head=mtp_head, device=device, progress=progress)
    scores = scores_from_stats(stats, method)
    table = {
        "format": SCORES_FORMAT,
        "method": method,
        "model": str(model_path),
        "tokens": len(tokens),
        "layers": {str(layer): [float(v) for v in s] for layer, s in scores.items()},
        "info": {
            "tool": f"fle-reap score {__version__}",
            "text": str(text),
            "text_sha256": hashlib.sha256(Path(text).read_bytes()).hexdigest(),
            "ctx": ctx,
            "mtp_head": None if mtp_head is None else str(mtp_head),
            "model_fingerprint": model_fingerprint(model_path),
            "mtp_head_fingerprint": None if mtp_head is None else model_fingerprint(mtp_head),
            "mtp": note["mtp"],
            "layer_tokens": {str(layer): st.tokens for layer, st in stats.items()},
            "routed_tokens": {str(layer): [int(c) for c in st.count] for layer, st in stats.items()},
        },
    }
    parse_scores(table, source="the measured score table")  # what fle-reap prune will read
    return table
