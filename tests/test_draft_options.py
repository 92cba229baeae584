"""MTP drafting options (fle_engine.draft_vocab, the adaptive draft count of
fle_engine.speculative): a draft vocabulary makes the head draft only its
tokens while the output stays that of plain decoding; the list file is read
and written strictly; the adaptive count's decision rule picks what the
acceptances and costs call for, and the output with it on is the plain
one; fle-engine generate takes both, refusing bad input with one line."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fle_engine  # noqa: E402
from fle_engine import speculative  # noqa: E402
from fle_engine.draft_vocab import DraftVocab, most_frequent, read_list, write_list  # noqa: E402
from fle_engine.mtp import draft  # noqa: E402
from fle_engine.sampling import Sampler, SamplerParams, generate_tokens  # noqa: E402
from fle_engine.speculative import (AdaptiveDraft, SpecStats, best_draft_count, expected_step_time,  # noqa: E402
                                    expected_tokens, generate_speculative)
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402

ARCHS = ["qwen3next", "qwen4exp"]
N = 20


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp(request.param) / "m.gguf", request.param, seed=4, mtp="inside")
    return fle_engine.load(path)


def prompt(m, n=12):
    return np.random.default_rng(3).integers(0, m.n_vocab, n).tolist()


def greedy():
    return Sampler(SamplerParams(temp=0.0))


def half_vocab(m, seed=2):
    return DraftVocab(np.random.default_rng(seed).permutation(m.n_vocab)[:m.n_vocab // 2], "half")


# -- the head restricted to a list ------------------------------------------------------------------------------

def test_restricted_draft_is_the_best_listed_token(model):
    toks = prompt(model, 10)
    st = model.new_state(24)
    model.forward(toks, st)
    full_tok, full = draft(model, st, n_draft=1)
    vocab = half_vocab(model)
    st = model.new_state(24)
    model.forward(toks, st)
    got_tok, got = draft(model, st, n_draft=3, vocab=vocab)
    listed = torch.zeros(model.n_vocab, dtype=torch.bool)
    listed[torch.as_tensor(vocab.ids)] = True
    # the first draft: the full head's best token among the listed ones, the same logits on the list
    assert int(got_tok[0]) == int(torch.where(listed, full[0], float("-inf")).argmax())
    assert torch.allclose(got[0][listed], full[0][listed], rtol=0, atol=1e-5 * float(full.abs().max()))
    assert bool(torch.isinf(got[:, ~listed]).all()) and all(listed[int(t)] for t in got_tok)
    # the view shares the head's weights but its output projection has only the list's rows
    view = vocab.head(model.net.mtp)
    assert view.output.shape == (len(vocab), model.net.mtp.output.shape[1])
    assert model.net.mtp.output.shape[0] == model.n_vocab and view.eh_proj is model.net.mtp.eh_proj
    assert vocab.head(model.net.mtp) is view


def test_whole_vocabulary_drafts_as_without(model):
    toks = prompt(model, 10)
    out = []
    for vocab in (None, DraftVocab(np.random.default_rng(5).permutation(model.n_vocab), "all")):
        st = model.new_state(24)
        model.forward(toks, st)
        out.append(draft(model, st, n_draft=3, vocab=vocab))
    assert torch.equal(out[0][0], out[1][0])
    assert torch.allclose(out[0][1], out[1][1], rtol=0, atol=1e-5 * float(out[0][1].abs().max()))


@pytest.mark.parametrize("n_draft", [1, 3])
def test_greedy_with_draft_vocab_equals_plain(model, monkeypatch, n_draft):
    want = list(generate_tokens(model, prompt(model), N, greedy()))
    seq = prompt(model) + want
    # a list holding half the plain run's continuation: some drafts can be right, others cannot
    keep = sorted(set(want[::2]))
    vocab = DraftVocab(keep + [t for t in range(model.n_vocab) if t not in set(want)][:8], "some")
    seen = []

    def right_when_listed(m, state, next_token=None, n_draft=1, vocab=None):
        # the right tokens after next where the list has them, else the head's listed draft
        real = draft(m, state, next_token=next_token, n_draft=n_draft, vocab=vocab)[0].tolist()
        right = seq[state.length + 1:state.length + 1 + n_draft]
        out = [r if r in vocab.ids else d for r, d in zip(right, real)]
        seen.extend(out)
        return torch.tensor(out), None

    monkeypatch.setattr(speculative, "draft", right_when_listed)
    stats = SpecStats()
    got = list(generate_speculative(model, prompt(model), N, greedy(), n_draft=n_draft, stats=stats, vocab=vocab))
    assert got == want
    assert seen and set(seen) <= set(vocab.ids.tolist())
    assert 0 < stats.accepted < stats.drafted


def test_greedy_with_real_restricted_head_equals_plain(model):
    want = list(generate_tokens(model, prompt(model), N, greedy()))
    stats = SpecStats()
    got = list(generate_speculative(model, prompt(model), N, greedy(), n_draft=2, stats=stats,
                                    vocab=half_vocab(model)))
    assert got == want and stats.drafted > 0


def test_sampled_with_draft_vocab_equals_plain(model):
    params = SamplerParams(temp=1.0, top_k=20, top_p=0.95, min_p=0.0, seed=7)
    want = list(generate_tokens(model, prompt(model), N, Sampler(params)))
    got = list(generate_speculative(model, prompt(model), N, Sampler(params), n_draft=2, vocab=half_vocab(model)))
    assert got == want


def test_restricted_to_ids_beyond_the_head_refused(model):
    st = model.new_state(16)
    model.forward(prompt(model, 4), st)
    with pytest.raises(FleError, match="beyond the vocabulary"):
        draft(model, st, vocab=DraftVocab([1, model.n_vocab + 3], "big"))


# -- the list file ------------------------------------------------------------------------------------------------

class _Tok:
    """A stand-in tokenizer: one id per character."""
    n_vocab = 300

    def encode(self, text, add_special=False, parse_special=False):
        return [ord(c) % self.n_vocab for c in text]


def test_most_frequent_counts_and_orders():
    ids, total, covered = most_frequent(_Tok(), "aaab bb c\n" * 3, 3)
    assert ids == [ord("a"), ord("b"), ord(" ")] and total == 30 and covered == 9 + 9 + 6


def test_list_file_round_trip(tmp_path):
    v = DraftVocab([7, 3, 11], "x")
    write_list(tmp_path / "v.txt", v, ["made by a test"])
    text = (tmp_path / "v.txt").read_text()
    assert text.startswith("# made by a test\n") and text.endswith("7\n3\n11\n")
    assert read_list(tmp_path / "v.txt", 12).ids.tolist() == [7, 3, 11]
    (tmp_path / "v.json").write_text('{"tokens": [5, 1]}')
    assert read_list(tmp_path / "v.json", 12).ids.tolist() == [5, 1]
    (tmp_path / "l.json").write_text('[2, 4]  ')
    assert read_list(tmp_path / "l.json").ids.tolist() == [2, 4]
    (tmp_path / "c.txt").write_text("# a comment\n\n 4  # the fourth\n9\n")
    assert read_list(tmp_path / "c.txt", 10).ids.tolist() == [4, 9]


@pytest.mark.parametrize("body, match", [
    ("1\n2\n12\n", "token id 12 is beyond the vocabulary"),
    ("1\nx\n", "line 2 is 'x', not a token id"),
    ("3\n3\n", "token id 3 appears twice"),
    ("# nothing\n", "no token ids"),
    ('{"tokens": [1, "2"]}', "a list of token ids"),
    ("[1, 2", "not valid JSON"),
    ("-1\n", "token id -1 is beyond"),
])
def test_bad_list_files(tmp_path, body, match):
    (tmp_path / "v.txt").write_text(body)
    with pytest.raises(FleError, match=match) as e:
        read_list(tmp_path / "v.txt", 12)
    assert str(tmp_path / "v.txt") in str(e.value)


def test_missing_list_file(tmp_path):
    with pytest.raises(FleError, match="no such file.*fle_engine.draft_vocab"):
        read_list(tmp_path / "none.txt", 12)


# -- the adaptive draft count: the decision rule --------------------------------------------------------------

def test_expected_tokens_and_time():
    assert expected_tokens([0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([0.9], 3) == pytest.approx(1.9)           # nothing past the list is accepted
    cost = {1: 1.0, 2: 1.2, 3: 1.4}
    # two drafts: the call over 3 tokens, then a settling call after a rejection of draft 1 (1 token) or 2 (2)
    assert expected_step_time([0.8, 0.1], 2, cost) == pytest.approx(1.4 + 0.2 * 1.0 + 0.8 * 0.9 * 1.2)
    assert expected_step_time([0.8, 0.1], 0, cost, {1: 5.0}) == 1.0
    assert expected_step_time([1.0], 1, cost, {1: 0.3}) == pytest.approx(1.2 + 0.3)


def test_cheap_verify_and_high_acceptance_drafts_the_most():
    cheap = {s: 1.0 + 0.02 * s for s in range(1, 6)}
    assert best_draft_count([0.9, 0.85, 0.8, 0.8], cheap, 4) == 4
    assert best_draft_count([0.9, 0.85, 0.8, 0.8], cheap, 2) == 2


def test_low_acceptance_drafts_none():
    cheap = {s: 1.0 + 0.02 * s for s in range(1, 6)}
    # a rejection costs the settling call again: even a cheap check is not worth 5 % acceptance
    assert best_draft_count([0.05, 0.05, 0.05], cheap, 3) == 0
    linear = {s: float(s) for s in range(1, 5)}
    assert best_draft_count([0.5, 0.5, 0.5], linear, 3) == 0


def test_falling_acceptance_stops_early():
    cost = {1: 1.0, 2: 1.2, 3: 1.4}
    # n = 0: 1 / 1; n = 1: 1.8 / 1.4; n = 2: 1.88 / 2.464
    assert best_draft_count([0.8, 0.1], cost, 2) == 1
    # costly drafting tips it to none
    assert best_draft_count([0.8, 0.1], cost, 2, {1: 1.0, 2: 2.0}) == 0


def test_policy_follows_its_measurements():
    p = AdaptiveDraft(3, probe_every=0)
    assert p.choose() == 3                               # nothing measured yet: the most
    for _ in range(40):
        p.observe([True, True, True])
        for s in range(1, 5):
            p.time_trunk(s, 0.010 + 0.0005 * s)
        p.time_draft(3, 0.0006)
    assert p.choose() == 3
    for _ in range(200):
        p.observe([False])
    assert p.acceptance()[0] < 0.1 and p.choose() == 0
    probe = AdaptiveDraft(3, probe_every=4)
    probe.time_trunk(1, 0.01)
    probe.time_trunk(2, 0.02)
    for _ in range(50):
        probe.observe([False])
    picks = [probe.choose() for _ in range(8)]
    assert picks.count(1) == 2 and picks.count(0) == 6       # every fourth step drafts one, to measure again
    assert "adaptive drafting" in probe.line()


def test_unmeasured_sizes_are_estimated():
    p = AdaptiveDraft(3)
    p.time_trunk(1, 1.0)
    p.time_trunk(2, 2.0)
    assert p.trunk[4] == pytest.approx(4.0) and p.trunk[2] == 2.0
    p.time_trunk(2, 4.0)                                  # smoothed, not replaced
    assert 2.0 < p.trunk[2] < 4.0
    p.time_draft(2, 0.2)
    assert p.drafting[3] == pytest.approx(0.3)


# -- the adaptive draft count: the output ----------------------------------------------------------------------

@pytest.mark.parametrize("n_max", [1, 3])
def test_greedy_adaptive_equals_plain(model, n_max):
    want = list(generate_tokens(model, prompt(model), N, greedy()))
    stats = SpecStats()
    policy = AdaptiveDraft(n_max)
    got = list(generate_speculative(model, prompt(model), N, greedy(), n_draft=n_max, stats=stats, adaptive=policy))
    assert got == want
    # one trunk call per step, and one more after each rejection
    assert sum(stats.steps) <= stats.trunk_calls <= 2 * sum(stats.steps)
    assert stats.steps[n_max] >= 1 and policy.trunk[1] > 0


def test_adaptive_with_always_right_drafts(model, monkeypatch):
    """Drafts always right: the policy keeps drafting the most (no call of
    another size is ever measured, so none looks cheaper); output unchanged."""
    want = list(generate_tokens(model, prompt(model), N, greedy()))
    seq = prompt(model) + want

    def oracle(m, state, next_token=None, n_draft=1, vocab=None):
        return torch.tensor(seq[state.length + 1:state.length + 1 + n_draft]), None

    monkeypatch.setattr(speculative, "draft", oracle)
    policy = AdaptiveDraft(2, probe_every=0)
    stats = SpecStats()
    got = list(generate_speculative(model, prompt(model), N, greedy(), n_draft=2, stats=stats, adaptive=policy))
    assert got == want and stats.accepted == stats.drafted
    # every step drafts 2 but maybe the last, capped by the tokens still wanted
    assert policy.acceptance()[0] > 0.8 and stats.steps[2] >= sum(stats.steps) - 1


def test_sampled_adaptive_equals_plain(model):
    params = SamplerParams(temp=1.0, top_k=20, top_p=0.95, min_p=0.0, seed=11)
    want = list(generate_tokens(model, prompt(model), N, Sampler(params)))
    got = list(generate_speculative(model, prompt(model), N, Sampler(params), n_draft=2, adaptive=True,
                                    vocab=half_vocab(model)))
    assert got == want


# -- fle-engine generate -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    m = make_model(d / "m.gguf", "qwen3next", seed=4, mtp="inside")
    (d / "corpus.txt").write_text("the river runs to the sea, and the sea is wide.\n" * 50)
    return m, d


def test_cli_draft_vocab_and_adaptive(cli_files, capsys):
    from fle_engine.cli import main as engine_main
    from fle_engine.draft_vocab import main as vocab_main

    m, d = cli_files
    base = ["generate", str(m), "-p", "the river", "-n", "10", "--temp", "0"]
    assert vocab_main([str(m), str(d / "corpus.txt"), "-n", "8", "-o", str(d / "v.txt")]) == 0
    assert "8 token ids" in capsys.readouterr().err
    assert len(read_list(d / "v.txt").ids) == 8
    outs = []
    for extra in ([], ["--mtp", "--draft-vocab", "8", "--draft-vocab-corpus", str(d / "corpus.txt")],
                  ["--mtp", "--draft-vocab", str(d / "v.txt"), "--draft-max", "3"],
                  ["--mtp", "--draft-adaptive", "--draft-max", "3", "--draft-vocab", str(d / "v.txt")]):
        assert engine_main(base + extra) == 0
        cap = capsys.readouterr()
        outs.append(cap.out)
        assert ("from a draft vocabulary of 8 tokens" in cap.err) == ("--draft-vocab" in extra)
        assert ("drafts per step:" in cap.err) == ("--draft-adaptive" in extra)
    assert outs[1:] == [outs[0]] * 3


def test_cli_refusals(cli_files, capsys):
    from fle_engine.cli import main as engine_main

    m, d = cli_files
    (d / "big.txt").write_text("1\n99999\n")
    base = ["generate", str(m), "-p", "x", "-n", "2", "--temp", "0"]
    cases = [
        (["--mtp", "--draft-vocab", str(d / "none.txt")], f"{d / 'none.txt'}: no such file"),
        (["--mtp", "--draft-vocab", str(d / "big.txt")], "token id 99999 is beyond the vocabulary"),
        (["--mtp", "--draft-vocab", "100000", "--draft-vocab-corpus", str(d / "corpus.txt")],
         "more than the model's vocabulary (512 tokens); give at most 512"),
        (["--mtp", "--draft-vocab", "16"], "needs --draft-vocab-corpus"),
        (["--mtp", "--draft-vocab", "16", "--draft-vocab-corpus", str(d / "no.txt")], f"{d / 'no.txt'}: no such"),
        (["--draft-vocab", "16"], "add --mtp"),
        (["--draft-adaptive"], "add --mtp"),
    ]
    for extra, msg in cases:
        assert engine_main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err and err.count("\n") == 1, (extra, err)
    for extra, msg in ((["--draft-adaptive"], "add --mtp"),
                       (["--mtp", "--draft-vocab", str(d / "none.txt")], f"{d / 'none.txt'}: no such file")):
        assert engine_main(["serve", str(m), *extra]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, (extra, err)
