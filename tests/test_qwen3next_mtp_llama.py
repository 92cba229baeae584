"""FLE's qwen3next MTP head against llama.cpp's own MTP graph
(``llama_model_qwen3next::graph_mtp``, src/models/qwen3next.cpp).

``tests/llama_mtp_dump.cpp`` (compiled by the ``llama_program`` fixture)
runs a factory model with its MTP block inside through llama.cpp: the trunk
over all tokens, keeping logits and ``h_nextn`` (the post-``output_norm``
hidden state) of every position, then a second context of type MTP over the
pairs (h_j, t_{j+1}), which llama.cpp decodes at position j + 1
(common/speculative.cpp, ``common_speculative_impl_draft_mtp``). FLE must
match all three: trunk logits, hidden states and head logits. Positions
enter only through RoPE, which sees relative positions, so FLE's head at
positions 0 .. n-2 computes what llama.cpp's does at 1 .. n-1.

llama.cpp's speculative driver also feeds the head one pair more: when a
prompt is decoded it pairs the first token with an all-zero hidden state at
position 0, and the head's later rows attend to that row. The dump holds the
head's logits over that batch too ("hook"); FLE's head given the same rows
must match it, and the row must matter (FLE's drafting, fle_engine.mtp,
starts from (h_0, t_1) instead, as the pairs above do).

On the "release" mix llama.cpp quantizes activations before each quantized
matrix product, so the test also runs llama.cpp on an F32 copy holding the
dequantized weights: FLE on the quantized file must match that copy as
tightly as an F32 model.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.reference, pytest.mark.usefixtures("one_torch_thread")]

torch = pytest.importorskip("torch")

import fle_engine  # noqa: E402
from fle_engine import mtp  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.requant import requant  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402

N_TOKENS = 192
CONTEXT = 512
KLD_EXACT = 1e-3   # mean KL(llama || FLE), same weights, same arithmetic up to rounding
KLD_RELEASE = 5e-3  # the trunk on the quantized file, where llama.cpp quantizes activations
TOP1_MIN = 0.99
H_REL_MAX = 1e-4   # ||h_FLE - h_llama|| / ||h_llama||
KLD_DISTINCT = 1e-2  # head against trunk logits: a head that ran differs by more


@pytest.fixture(scope="module")
def llama_mtp_dump(llama_program) -> Path:
    return llama_program("llama_mtp_dump.cpp", "llama-mtp-dump", common=False)



def run_dump(exe: Path, path: Path, toks: list[int], out: Path) -> dict[str, np.ndarray]:
    out.mkdir()
    r = subprocess.run([str(exe), str(path), str(out), "2"], input=" ".join(map(str, toks)).encode(),
                       capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-3000:]
    n, n_vocab, n_embd = map(int, (out / "meta.txt").read_text().split())
    assert n == len(toks)
    rows = {"trunk_logits": (n, n_vocab), "h_nextn": (n, n_embd), "mtp_logits": (n - 1, n_vocab),
            "mtp_logits_hook": (n, n_vocab), "mtp_h_nextn": (n - 1, n_embd)}
    return {k: np.fromfile(out / f"{k}.f32", dtype=np.float32).reshape(shape) for k, shape in rows.items()}


def compare(ref, got) -> tuple[float, float]:
    """(mean KL(ref || got) over the full softmax, top-1 agreement)."""
    lp = torch.log_softmax(torch.as_tensor(np.asarray(ref), dtype=torch.float64), -1)
    lq = torch.log_softmax(torch.as_tensor(np.asarray(got), dtype=torch.float64), -1)
    kld = (lp.exp() * (lp - lq)).sum(-1)
    return float(kld.mean()), float((lp.argmax(-1) == lq.argmax(-1)).double().mean())


def fle_run(model, toks: list[int]) -> dict[str, np.ndarray]:
    """FLE's trunk logits and hidden states of ``toks``, and its head's
    logits over the same rows as the dump's."""
    assert model.net.mtp is not None, "the MTP block inside the file was not loaded"
    state = model.new_state(len(toks))
    logits = model.forward(toks, state)
    h = state.hidden
    assert h.shape == (len(toks), model.args.n_embd)
    zero_first = torch.cat([torch.zeros_like(h[:1]), h[:-1]])
    head = model.net.mtp
    n = len(toks)
    with torch.inference_mode():
        _, head_h = head(h[:-1], torch.tensor(toks[1:]), head.new_state(n).cache, torch.arange(n - 1),
                         state.rope_cos, state.rope_sin, return_hidden=True)
    return {"trunk_logits": logits.double().numpy(), "h_nextn": h.double().numpy(),
            "mtp_logits": mtp.head_logits(model.net, state, h[:-1], toks[1:]).double().numpy(),
            "mtp_logits_hook": mtp.head_logits(model.net, state, zero_first, toks).double().numpy(),
            "mtp_h_nextn": head_h.double().numpy()}


def check_exact(ref: dict, got: dict, label: str) -> None:
    results = {k: compare(ref[k], got[k]) for k in ("trunk_logits", "mtp_logits", "mtp_logits_hook")}
    for what, (kld, top1) in results.items():
        print(f"\n{label} {what}: mean KLD {kld:.3g}, top-1 {top1:.4f}", end="")
    # the trunk's hidden state, and the head's own (what drafting a second token feeds back)
    for key in ("h_nextn", "mtp_h_nextn"):
        h_rel = float(np.linalg.norm(got[key] - ref[key]) / np.linalg.norm(ref[key]))
        print(f"\n{label} {key}: relative error {h_rel:.3g}", end="")
        assert h_rel < H_REL_MAX, f"{label} {key}: relative error {h_rel:.3g}"
    for what, (kld, top1) in results.items():
        assert kld <= KLD_EXACT and top1 >= TOP1_MIN, f"{label} {what}: mean KLD {kld:.3g}, top-1 {top1:.4f}"


def check_head_ran(ref: dict, label: str) -> None:
    """The head's logits are its own: not the trunk's at the same row nor at
    the row that predicts the same token, and the zero-state row at position
    0 of the hook batch changes the rows after it."""
    head = ref["mtp_logits"]
    same_row = compare(head, ref["trunk_logits"][:-1])
    same_target = compare(head, ref["trunk_logits"][1:])
    hook = compare(ref["mtp_logits_hook"][1:], head)
    print(f"\n{label} head vs trunk, same row: mean KLD {same_row[0]:.3g}; same target: {same_target[0]:.3g}; "
          f"hook rows 1.. vs pairs: {hook[0]:.3g}", end="")
    assert same_row[0] > KLD_DISTINCT and same_target[0] > KLD_DISTINCT
    assert hook[0] > 1e-4, "the zero-state row at position 0 left the head's later rows unchanged"


def test_mtp_head_matches_llama_cpp_f32(tmp_path, llama_mtp_dump):
    path = make_model(tmp_path / "m.gguf", "qwen3next", mtp="inside", context_length=CONTEXT)
    model = fle_engine.load(path)
    toks = np.random.default_rng(0).integers(0, model.n_vocab, N_TOKENS).tolist()
    ref = run_dump(llama_mtp_dump, path, toks, tmp_path / "llama")
    assert all(np.isfinite(v).all() for v in ref.values())
    check_exact(ref, fle_run(model, toks), "f32")
    check_head_ran(ref, "f32")


def test_mtp_head_matches_llama_cpp_release(tmp_path, llama_mtp_dump):
    try:
        path = make_model(tmp_path / "r.gguf", "qwen3next", mtp="inside", mix="release", context_length=CONTEXT)
    except FleError as e:
        if "quantize" in str(e):
            pytest.skip(f"quantizers for the release mix unavailable: {e}")
        raise
    model = fle_engine.load(path)
    toks = np.random.default_rng(0).integers(0, model.n_vocab, N_TOKENS).tolist()
    got = fle_run(model, toks)
    ref = run_dump(llama_mtp_dump, path, toks, tmp_path / "llama")
    assert all(np.isfinite(v).all() for v in ref.values())
    dequantized = tmp_path / "dequantized.gguf"
    requant(path, ".", "F32", dequantized, progress=False)
    exact = run_dump(llama_mtp_dump, dequantized, toks, tmp_path / "llama-dequantized")

    # llama.cpp on the quantized file: its quantized activations move the
    # trunk a little, and the head, fed the trunk's moved hidden states, more
    trunk = compare(ref["trunk_logits"], got["trunk_logits"])
    head = compare(ref["mtp_logits"], got["mtp_logits"])
    h_rel = float(np.linalg.norm(got["h_nextn"] - ref["h_nextn"]) / np.linalg.norm(ref["h_nextn"]))
    print(f"\nrelease, llama.cpp on the quantized file: trunk mean KLD {trunk[0]:.3g}, top-1 {trunk[1]:.4f}; "
          f"h_nextn relative error {h_rel:.3g}; head mean KLD {head[0]:.3g}, top-1 {head[1]:.4f}", end="")
    assert trunk[0] <= KLD_RELEASE and trunk[1] >= TOP1_MIN
    check_exact(exact, got, "release (llama.cpp on the dequantized F32 copy)")
    check_head_ran(ref, "release")
