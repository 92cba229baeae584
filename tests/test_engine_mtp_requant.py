"""The MTP head requantized to IQ4_NL (``fle-requant``, as the releases ship
it) drafts on the engine's own step: its routed experts resident on the
device in their IQ4_NL bytes, read by the trunk's expert kernels. The
drafts equal the eager float32 head's on the same file, call for call.
Without CUDA the engine runs its reference operations."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fle_engine.runtime import Engine  # noqa: E402
from fle_engine.runtime import mtp as rmtp  # noqa: E402
from fle_engine.speculative import SpecStats  # noqa: E402
from fle_quant.gguf_reader import GGUFModel  # noqa: E402
from fle_quant.ggml_types import GGMLType  # noqa: E402
from fle_quant.requant import requant  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("exact_float32")
DEVICE = torch.device("cuda" if CUDA else "cpu")
PROMPT = [1, 17, 42, 99, 5, 7]


@pytest.fixture(scope="module")
def nl_file(tmp_path_factory):
    """qwen3next with its MTP block inside, the block's routed experts requantized to IQ4_NL."""
    d = tmp_path_factory.mktemp("mtp_nl")
    src = make_model(d / "n.gguf", "qwen3next", seed=4, mix="release", routing_skew=1.0, mtp="inside")
    with GGUFModel.open(src) as g:
        head = int(g.hparam("block_count")) - 1
    out = d / "n-nl.gguf"
    reports, _ = requant(src, rf"^blk\.{head}\.ffn_(gate|up|down)_exps\.weight$", "IQ4_NL", out, progress=False)
    assert len(reports) == 3
    return out, head


def _engine(path, drafter):
    return Engine(path, device=DEVICE, cache_budget="auto" if CUDA else 0, ctx_size=160, cache_type_k="f32",
                  cache_type_v="f32", profile_path="none", progress=False, log=lambda m: None, mtp=True,
                  mtp_drafter=drafter)


def _drafts(eng, n_tok, n_draft):
    """(the tokens, each draft call's (next token, drafts)) of a speculative run."""
    calls, real = [], eng.drafter.draft

    def logged(tok, n, vocab=None):
        d = real(tok, n, vocab)
        calls.append((int(tok), list(d)))
        return d

    eng.drafter.draft = logged
    st = SpecStats()
    toks = list(eng.speculative(PROMPT, n_tok, n_draft=n_draft, stats=st))
    return toks, calls, st


def test_requantized_head_drafts_on_the_step(nl_file):
    path, head = nl_file
    with GGUFModel.open(path) as g:
        assert {GGMLType(g.info(f"blk.{head}.ffn_{m}_exps.weight").qtype) for m in ("gate", "up", "down")} == {
            GGMLType.IQ4_NL}
    runs = {}
    for kind in ("eager", "step"):
        eng = _engine(path, kind)
        if kind == "step":
            assert type(eng.drafter) is rmtp.StepDrafter
            assert eng.drafter.store.layouts[0].gu_type == GGMLType.IQ4_NL
        runs[kind] = _drafts(eng, 48, 2)
        eng.close()
    plain = _engine(path, "eager")
    want = plain.generate(PROMPT, 48)
    plain.close()
    (t_e, c_e, s_e), (t_s, c_s, s_s) = runs["eager"], runs["step"]
    assert t_e == t_s == want
    assert len(c_s) == len(c_e) > 10
    assert c_s == c_e
    assert s_s.accepted == s_e.accepted
