"""bench/serve_load.py, the server's load check, in short: 4 clients for
about 20 s against the real ``fle-engine serve`` on a factory model, and
its leak detectors shown to fire on a forged answer."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("aiohttp")

import fle_engine  # noqa: E402
from fle_engine.tokenizer import Tokenizer  # noqa: E402

_spec = importlib.util.spec_from_file_location("serve_load", Path(__file__).parents[1] / "bench" / "serve_load.py")
SL = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("serve_load", SL)     # its dataclasses look their module up
_spec.loader.exec_module(SL)


def test_load_check_passes_on_the_server(model_path):
    stats, end = SL.run_load(model_path, clients=4, seconds=20, n_verify=20, seed=1, log=lambda *_: None)
    assert SL.failed(stats, end) == [], (SL.report(stats, end, 4), stats.problems, end["log_tail"])
    assert stats.answered > 0 and stats.rejected > 0 and stats.dropped > 0
    assert stats.cache_hits > 0 and stats.verified > 0


def test_the_detectors_fire_on_forged_answers(model_path):
    tok = Tokenizer.from_gguf(model_path)
    st = SL.Stats()
    load = SL.Load("http://unused", tok, 2, st, 0)
    a, b = load.encode("Conversation canary-00-0000-aaaaaa.\n"), load.encode("Conversation canary-01-0001-bbbbbb.\n")
    load.heads = {0: a, 1: b}
    load.seqs = {0: [a], 1: [b, b + load.encode(" more of b")]}
    p = a + load.encode("User: next turn")
    good = {"tokens_evaluated": len(p), "id_slot": 1, "tokens": [5, 6], "tokens_predicted": 2,
            "timings": {"cache_n": len(a)}}
    # a reuse longer than anything conversation 0 sent: another conversation's state
    assert load.check(0, p, 8, {**good, "timings": {"cache_n": len(a) + 3}}, None) is None and st.leaks == 1
    # the server evaluated a prompt of another length, or names no slot
    assert load.check(0, p, 8, {**good, "tokens_evaluated": len(p) + 1}, None) is None and st.echo_errors == 1
    assert load.check(0, p, 8, {**good, "id_slot": 2}, None) is None and st.echo_errors == 2
    # streamed pieces that are not the text of the answer's tokens
    assert load.check(0, p, 8, good, "something else") is None and st.echo_errors == 3
    assert load.check(0, p, 8, good, tok.decode([5, 6])) is not None and st.leaks == 1
    # the next turn may now reuse all of p and its answer
    q = p + [5, 6] + load.encode(" again")
    assert load.check(0, q, 8, {**good, "tokens_evaluated": len(q), "timings": {"cache_n": len(p) + 2}}, None)
    assert st.leaks == 1 and st.echo_errors == 3

    model = fle_engine.load(model_path)
    from fle_engine.sampling import Sampler, SamplerParams, generate_tokens

    ref = list(generate_tokens(model, p, 6, Sampler(SamplerParams(temp=0.0)), stop=tok.eog_ids))
    other = list(generate_tokens(model, b, 6, Sampler(SamplerParams(temp=0.0)), stop=tok.eog_ids))
    assert ref != other
    st2 = SL.Stats()
    SL.verify(model, tok, [SL.Turn(0, p, 6, ref, 0, False), SL.Turn(0, p, 6, other, 0, False)], 2, st2, 0)
    assert st2.verified == 2 and st2.leaks == 1 and st2.near_ties == 0
