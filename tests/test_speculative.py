"""MTP speculative decoding (fle_engine.speculative): the same tokens as
plain decoding, greedy and sampled; a rejected draft leaves the state as if
it had never been checked; with drafts that are always right, every trunk
call settles two tokens."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fle_engine  # noqa: E402
from fle_engine import speculative  # noqa: E402
from fle_engine.sampling import Sampler, SamplerParams, generate_tokens  # noqa: E402
from fle_engine.speculative import SpecStats, generate_speculative, restore, snapshot  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402

ARCHS = ["qwen3next", "qwen4exp"]
N = 24


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp(request.param) / "m.gguf", request.param, seed=4, mtp="inside")
    return fle_engine.load(path)


def prompt(m, n=12):
    return np.random.default_rng(3).integers(0, m.n_vocab, n).tolist()


@pytest.mark.parametrize("n_draft", [1, 2, 3])
def test_greedy_equals_plain(model, n_draft):
    want = list(generate_tokens(model, prompt(model), N, Sampler(SamplerParams(temp=0.0))))
    stats = SpecStats()
    got = list(generate_speculative(model, prompt(model), N, Sampler(SamplerParams(temp=0.0)), n_draft=n_draft,
                                    stats=stats))
    assert got == want
    assert stats.drafted > 0 and stats.trunk_calls >= stats.drafted / n_draft


@pytest.mark.parametrize("n_draft", [1, 2])
def test_sampled_equals_plain(model, n_draft):
    params = SamplerParams(temp=1.0, top_k=20, top_p=0.95, min_p=0.0, seed=7)
    want = list(generate_tokens(model, prompt(model), N, Sampler(params)))
    got = list(generate_speculative(model, prompt(model), N, Sampler(params), n_draft=n_draft))
    assert got == want


@pytest.mark.parametrize("n_draft", [1, 2, 3])
def test_always_right_drafts(model, monkeypatch, n_draft):
    greedy = Sampler(SamplerParams(temp=0.0))
    want = list(generate_tokens(model, prompt(model), N, greedy))
    seq = prompt(model) + want

    def oracle(m, state, next_token=None, n_draft=1, vocab=None):
        # the tokens after next, from the plain greedy run
        return torch.tensor(seq[state.length + 1:state.length + 1 + n_draft]), None

    monkeypatch.setattr(speculative, "draft", oracle)
    stats = SpecStats()
    got = list(generate_speculative(model, prompt(model), N, Sampler(SamplerParams(temp=0.0)), n_draft=n_draft,
                                    stats=stats))
    assert got == want
    # the first token comes from the prompt, then n_draft + 1 per trunk call, no rollback
    assert stats.accepted == stats.drafted and stats.trunk_calls == -(-(N - 1) // (n_draft + 1))
    assert stats.by_position() == [1.0] * n_draft and sum(stats.reached) == stats.drafted


def test_wrong_second_draft_keeps_the_first(model, monkeypatch):
    """Drafts right, then wrong: the first is kept, the state rolled back to
    just after it, and the tokens are still the plain ones."""
    greedy = Sampler(SamplerParams(temp=0.0))
    want = list(generate_tokens(model, prompt(model), N, greedy))
    seq = prompt(model) + want

    def half_right(m, state, next_token=None, n_draft=1, vocab=None):
        right = seq[state.length + 1:state.length + 1 + n_draft]
        return torch.tensor([right[0]] + [(t + 1) % m.n_vocab for t in right[1:]]), None

    monkeypatch.setattr(speculative, "draft", half_right)
    stats = SpecStats()
    got = list(generate_speculative(model, prompt(model), N, Sampler(SamplerParams(temp=0.0)), n_draft=2,
                                    stats=stats))
    assert got == want
    assert stats.accepted == stats.drafted // 2 and stats.accepted > 0
    # per position: every first draft right, every second one reached and wrong
    assert stats.by_position()[0] == 1.0 and stats.right[1] == 0 and stats.reached[1] == stats.reached[0]
    assert "1: 100.0 %" in stats.line()


def test_rollback_restores_the_state(model):
    toks = prompt(model, 20)
    fresh = model.new_state(32)
    model.forward(toks[:10], fresh)
    want = model.forward(toks[10:14], fresh)
    st = model.new_state(32)
    model.forward(toks[:10], st)
    snap = snapshot(st)
    model.forward([toks[10], 5, 6], st)      # a wrong continuation, then rolled back
    restore(st, snap)
    got = model.forward(toks[10:14], st)
    assert st.length == fresh.length and int(st.pos) == int(fresh.pos)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_needs_a_head(tmp_path):
    m = fle_engine.load(make_model(tmp_path / "p.gguf", "qwen3moe"))
    with pytest.raises(FleError, match="MTP"):
        list(generate_speculative(m, [1, 2], 4, Sampler(SamplerParams(temp=0.0))))


def test_cli_mtp(tmp_path, capsys):
    from fle_engine.cli import main as engine_main
    from fle_quant.synth import mtp_path

    inside = make_model(tmp_path / "i.gguf", "qwen3next", seed=4, mtp="inside")
    separate = make_model(tmp_path / "s.gguf", "qwen3next", seed=4, mtp="separate")
    outs = []
    for argv in (["generate", str(inside), "-p", "the river", "-n", "12", "--temp", "0"],
                 ["generate", str(inside), "-p", "the river", "-n", "12", "--temp", "0", "--mtp"],
                 ["generate", str(separate), "-p", "the river", "-n", "12", "--temp", "0",
                  "--mtp-head", str(mtp_path(separate))]):
        assert engine_main(argv) == 0
        cap = capsys.readouterr()
        outs.append(cap.out)
        assert ("MTP drafts accepted" in cap.err) == ("--mtp" in " ".join(argv))
    assert outs[0] == outs[1] == outs[2]
    assert engine_main(["generate", str(separate), "-p", "x", "--mtp"]) == 2
    assert "no MTP head" in capsys.readouterr().err
