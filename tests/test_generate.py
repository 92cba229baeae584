"""fle_engine.sampling (llama.cpp's default sampler chain) and
``fle-engine generate`` on a factory model.

The reference test at the end runs llama.cpp's own samplers (through
llama-cpp-python) on the same logits with the same seeds and expects the
same tokens.
"""
from __future__ import annotations

import ctypes
import re
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.usefixtures("two_torch_threads")
torch = pytest.importorskip("torch")

import fle_engine  # noqa: E402
from fle_engine.cli import main as engine_main  # noqa: E402
from fle_engine.sampling import MT19937, Sampler, SamplerParams, filter_candidates, generate_tokens  # noqa: E402
from fle_engine.tokenizer import Tokenizer  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402

GREEDY = SamplerParams(temp=0.0, seed=0)



class Recorder:
    """Wraps a model's forward and records how many tokens each call got."""

    def __init__(self, model):
        self.model, self.calls = model, []
        self._forward = model.forward

    def forward(self, tokens, state):
        self.calls.append(len(tokens))
        return self._forward(tokens, state)

    def __getattr__(self, name):
        return getattr(self.model, name)


# ---------------------------------------------------------------- the random source


def test_mt19937_is_std_mt19937():
    # the C++ standard fixes the 10000th output of a default-constructed mt19937 (seed 5489)
    rng = MT19937(5489)
    for _ in range(9999):
        rng.next_u32()
    assert rng.next_u32() == 4123659995
    # and numpy's legacy seeding is the same init_genrand
    for seed in (0, 1, 1234, 2**32 - 1):
        ours = MT19937(seed)
        raw = np.random.RandomState(seed)._bit_generator.random_raw(1300)
        assert [ours.next_u32() for _ in range(1300)] == raw.tolist()
    r = MT19937(7)
    a, b = r.next_u32(), r.next_u32()
    assert MT19937(7).uniform() == (a + b * 2.0**32) / 2.0**64


# ---------------------------------------------------------------- the filters


def test_filters_semantics():
    logits = np.array([1.0, 3.0, 2.0, 0.0, 3.0, -1.0], np.float32)
    p = SamplerParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
    ids, x, srt = filter_candidates(logits, p)  # no filter: vocabulary order kept
    assert ids.tolist() == list(range(6)) and not srt
    ids, x, srt = filter_candidates(logits, SamplerParams(1.0, 3, 1.0, 0.0))
    assert ids.tolist() == [1, 4, 2] and srt  # top-3, sorted, ties by id
    # top-p on the untempered softmax: the shortest sorted prefix reaching p
    probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    order = np.argsort(-logits, kind="stable")
    for top_p in (0.3, 0.6, 0.9, 0.99):
        want = order[: int(np.searchsorted(np.cumsum(probs[order]), top_p - 1e-7)) + 1]
        for temp in (0.5, 1.0, 5.0):
            ids, x, _ = filter_candidates(logits, SamplerParams(temp, 0, top_p, 0.0))
            assert ids.tolist() == want.tolist()
            np.testing.assert_allclose(x, logits[want] / temp, rtol=1e-6)
    # min-p keeps p_i >= min_p * p_max, i.e. logit >= max + log(min_p), in vocabulary order
    ids, _, _ = filter_candidates(logits, SamplerParams(1.0, 0, 1.0, np.exp(-1.5)))
    assert ids.tolist() == [1, 2, 4]
    # greedy: the first highest logit, the rest at -inf
    ids, x, _ = filter_candidates(logits, SamplerParams(0.0, 0, 1.0, 0.0))
    assert np.isfinite(x).sum() == 1 and ids[np.argmax(x)] == 1


def test_sampling_distribution_and_determinism():
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.07, 0.03], np.float32))
    s = Sampler(SamplerParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42))
    draws = np.array([s(logits) for _ in range(4000)])
    freq = np.bincount(draws, minlength=5) / draws.size
    np.testing.assert_allclose(freq, [0.5, 0.25, 0.15, 0.07, 0.03], atol=0.025)
    # temperature 2 flattens: p ~ sqrt(p)
    s = Sampler(SamplerParams(temp=2.0, top_k=0, top_p=1.0, min_p=0.0, seed=43))
    freq = np.bincount([s(logits) for _ in range(4000)], minlength=5) / 4000
    flat = np.sqrt([0.5, 0.25, 0.15, 0.07, 0.03])
    np.testing.assert_allclose(freq, flat / flat.sum(), atol=0.025)
    # the same seed gives the same tokens; another seed other tokens
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((50, 300)).astype(np.float32)
    params = SamplerParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
    runs = [[Sampler(SamplerParams(**{**params.__dict__, "seed": seed}))(r) for r in rows] for seed in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    for bad in (dict(top_p=1.5), dict(min_p=-0.1), dict(temp=float("nan")), dict(seed=-1)):
        with pytest.raises(FleError):
            Sampler(SamplerParams(**bad))


# ---------------------------------------------------------------- decoding a model


def test_greedy_equals_prefill_argmax(model, tok):
    prompt = tok.encode("the river and the mountain", add_special=True, parse_special=True)
    n = 16
    rec = Recorder(model)
    out = list(generate_tokens(rec, prompt, n, Sampler(GREEDY)))
    assert len(out) == n
    # prompt prefilled in one call, then one token per step through the KV cache
    assert rec.calls == [len(prompt)] + [1] * (n - 1)
    logits = model.logits(prompt + out)
    np.testing.assert_array_equal(logits[len(prompt) - 1:-1].argmax(-1), out)
    # a prompt longer than the prefill batch is fed in batches
    rec = Recorder(model)
    assert list(generate_tokens(rec, prompt, n, Sampler(GREEDY), n_batch=2)) == out
    assert rec.calls == [2] * (len(prompt) // 2) + [len(prompt) % 2] * (len(prompt) % 2) + [1] * (n - 1)


def test_sampled_generation(model, tok):
    prompt = tok.encode("the city", add_special=True, parse_special=True)
    greedy = list(generate_tokens(model, prompt, 12, Sampler(GREEDY)))
    hot = SamplerParams(temp=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=5)
    a = list(generate_tokens(model, prompt, 12, Sampler(hot)))
    b = list(generate_tokens(model, prompt, 12, Sampler(hot)))
    assert a == b
    for seed in (1, 2):  # top-k 1 leaves one candidate: greedy whatever the temperature and seed
        k1 = SamplerParams(temp=1.5, top_k=1, top_p=1.0, min_p=0.0, seed=seed)
        assert list(generate_tokens(model, prompt, 12, Sampler(k1))) == greedy
    # with several candidates left, seeds lead to different continuations
    outs = {tuple(generate_tokens(model, prompt, 12, Sampler(SamplerParams(3.0, 0, 1.0, 0.0, seed))))
            for seed in range(3)}
    assert len(outs) > 1


def test_stop_tokens(model, tok):
    prompt = tok.encode("the", add_special=True, parse_special=True)
    script = iter([10, 20, sorted(tok.eog_ids)[0], 30])
    rec = Recorder(model)
    out = list(generate_tokens(rec, prompt, 10, lambda logits: next(script), stop=tok.eog_ids))
    assert out == [10, 20, sorted(tok.eog_ids)[0]]
    assert rec.calls == [len(prompt), 1, 1]
    with pytest.raises(FleError):
        next(generate_tokens(model, [], 3, Sampler(GREEDY)))
    with pytest.raises(FleError):
        next(generate_tokens(model, prompt, 0, Sampler(GREEDY)))


# ---------------------------------------------------------------- the CLI


def test_cli_generate(model_path, model, tok, capsys):
    prompt_text = "the river"
    assert engine_main(["generate", str(model_path), "-p", prompt_text, "-n", "10", "--temp", "0", "-t", "2"]) == 0
    out = capsys.readouterr().out
    prompt = tok.encode(prompt_text, add_special=True, parse_special=True)
    want = []
    for t in generate_tokens(model, prompt, 10, Sampler(GREEDY), stop=tok.eog_ids):
        if t in tok.eog_ids:
            break
        want.append(t)
    assert out == tok.decode(want) + "\n"
    # a chat turn through the model's template, sampled with a seed: runs and is reproducible
    args = ["generate", str(model_path), "-p", "hello", "-n", "8", "--chat", "--seed", "3", "--system", "be brief"]
    assert engine_main(args) == 0
    first = capsys.readouterr().out
    assert engine_main(args) == 0
    assert capsys.readouterr().out == first


def test_cli_errors(model_path, tmp_path, capsys):
    bad = [
        ["generate", str(tmp_path / "missing.gguf"), "-p", "x"],
        ["generate", str(model_path), "-p", "x", "-n", "0"],
        ["generate", str(model_path), "-p", "x", "--top-p", "2"],
        ["generate", str(model_path), "-p", "", "-n", "3"],
        ["generate", str(model_path), "-p", "x", "--system", "s"],
    ]
    for argv in bad:
        assert engine_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("fle-engine: error: ") and len(err.strip().splitlines()) == 1, err
    for argv in (["generate", str(model_path)], ["run", str(model_path)], ["generate", str(model_path), "-p", "x",
                                                                           "-n", "many"]):
        with pytest.raises(SystemExit) as e:
            engine_main(argv)
        assert e.value.code == 2
    # as a program: the exit status itself
    r = subprocess.run([sys.executable, "-m", "fle_engine.cli", "generate", str(tmp_path / "none.gguf"), "-p", "x"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "none.gguf" in r.stderr and "Traceback" not in r.stderr


def test_cli_engine_sizes_refused(tmp_path, capsys):
    """--ubatch, --prefill-min, --prompt-rows and --cache-budget out of range or unparsable:
    one line naming the option, exit status 2, checked before the model is
    read (the missing file is never reached), for generate and serve alike
    and whether or not the engine would run. In-range values pass the
    check (the missing file is then what is reported)."""
    missing = str(tmp_path / "missing.gguf")
    commands = (["generate", missing, "-p", "x"], ["serve", missing, "--port", "0"])
    bad = [(["-ub", "-1"], "--ubatch -1: give 1 to 8192"), (["--ubatch", "8193"], "--ubatch 8193: give 1 to 8192"),
           (["--prefill-min", "0"], "--prefill-min 0: "), (["--prefill-min", "-4"], "--prefill-min -4: "),
           (["--prompt-rows", "0"], "--prompt-rows 0: give 1 to 4"), (["--prompt-rows", "5"], "--prompt-rows 5: "),
           (["--cache-budget", "lots"], "--cache-budget 'lots': expected 'auto' or a size"),
           (["--cache-budget=-3G"], "--cache-budget '-3G': expected"),
           (["--cache-budget", "nan"], "--cache-budget 'nan': expected"),
           (["--cache-budget", "inf"], "--cache-budget 'inf': expected")]
    for extra, says in bad:
        for cmd in commands:
            assert engine_main(cmd + extra) == 2, extra
            err = capsys.readouterr().err
            assert err.startswith(f"fle-engine: error: {says}") and len(err.strip().splitlines()) == 1, err
    for extra in (["-ub", "0"], ["-ub", "8192"], ["--prefill-min", "1"], ["--prompt-rows", "1"], ["--cache-budget", "17GiB"],
                  ["--cache-budget", "0"], ["--cache-budget", "auto"]):
        for cmd in commands:
            assert engine_main(cmd + extra) == 2
            assert "missing.gguf" in capsys.readouterr().err, extra
    r = subprocess.run([sys.executable, "-m", "fle_engine.cli", "generate", missing, "-p", "x", "-ub", "-1"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("fle-engine: error: --ubatch -1") and "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def quant_path(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("gen_q") / "q.gguf", "qwen3moe", seed=3, mix="release",
                      routing_skew=1.0)


def test_cli_prints_the_prefill_line(quant_path, monkeypatch, capsys):
    """``generate`` on the engine prints the prefill's line
    (``PrefillStats.line``) after a prompt that was prefilled, and none when
    prompts run as decode steps (-ub 0, or shorter than --prefill-min). The
    CLI runs the engine only on CUDA; here its engine path gets an engine
    on the CPU (the reference operations), which prefills the same way."""
    import fle_engine.cli as cli
    import fle_engine.runtime as rt

    real = rt.Engine
    monkeypatch.setattr(rt, "Engine", lambda *a, **k: real(*a, **{**k, "device": "cpu", "progress": False}))
    monkeypatch.setattr(cli, "resolve_device", lambda device: "cuda")
    text = "the river runs to the sea and the sea runs to the river"
    n = len(Tokenizer.from_gguf(quant_path).encode(text, add_special=True, parse_special=True))
    argv = ["generate", str(quant_path), "-p", text, "-n", "3", "--temp", "0", "--cache-profile", "none",
            "--cache-budget", "1MiB", "--prefill-min", "4"]
    assert engine_main(argv + ["-ub", "4"]) == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("prefill:")]
    assert len(lines) == 1, lines
    m = re.fullmatch(r"prefill: (\d+) tokens in (\d+) micro-batches, [\d.]+ ms \([\d.]+ tok/s\); "
                     r"experts streamed [\d.]+ GB, compute waiting for copies 0\.0 ms", lines[0])
    assert m and int(m[1]) == n and int(m[2]) == -(-n // 4), lines[0]
    for off in (["-ub", "0"], ["-ub", "4", "--prefill-min", str(n + 1)]):
        assert engine_main(argv + off) == 0
        err = capsys.readouterr().err
        assert "[prompt" in err and not any(x.startswith("prefill:") for x in err.splitlines()), off


# ---------------------------------------------------------------- llama.cpp's own samplers


@pytest.mark.reference
def test_same_tokens_as_llama_cpp_sampler_chain():
    llama_cpp = pytest.importorskip("llama_cpp")

    def llama_sample(chain, logits):
        n = logits.size
        arr = (llama_cpp.llama_token_data * n)()
        for i in range(n):
            arr[i].id, arr[i].logit, arr[i].p = i, float(logits[i]), 0.0
        cur = llama_cpp.llama_token_data_array(data=arr, size=n, selected=-1, sorted=False)
        llama_cpp.llama_sampler_apply(chain, ctypes.byref(cur))
        tok = arr[cur.selected].id
        llama_cpp.llama_sampler_accept(chain, tok)
        return tok

    rng = np.random.default_rng(0)
    cases = [SamplerParams(0.8, 40, 0.95, 0.05, 1), SamplerParams(1.0, 0, 1.0, 0.0, 7),
             SamplerParams(1.5, 0, 0.9, 0.0, 9), SamplerParams(0.7, 0, 1.0, 0.1, 11),
             SamplerParams(0.0, 40, 0.95, 0.05, 5), SamplerParams(2.0, 5, 1.0, 0.0, 13),
             SamplerParams(1.0, 300, 0.5, 0.0, 17), SamplerParams(1.2, 0, 0.8, 0.02, 2**32 - 2)]
    total = 0
    for params in cases:
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        for s in (llama_cpp.llama_sampler_init_top_k(params.top_k),
                  llama_cpp.llama_sampler_init_top_p(params.top_p, 0),
                  llama_cpp.llama_sampler_init_min_p(params.min_p, 0),
                  llama_cpp.llama_sampler_init_temp_ext(params.temp, 0.0, 1.0),
                  llama_cpp.llama_sampler_init_dist(params.seed)):
            llama_cpp.llama_sampler_chain_add(chain, s)
        ours = Sampler(params)
        try:
            for _ in range(40):
                logits = (rng.standard_normal(2000) * 2.5).astype(np.float32)
                assert ours(logits) == llama_sample(chain, logits), params
                total += 1
        finally:
            llama_cpp.llama_sampler_free(chain)
    assert total == 40 * len(cases)


@pytest.mark.parametrize("kind", ["normal", "few values", "masked", "flat"])
def test_top_k_by_partition_equals_the_full_stable_sort(kind):
    """top-k picks its candidates with a partition instead of sorting the
    whole vocabulary; the order (ties by token id) must be the full sort's."""
    from fle_engine.sampling import _desc, _top_desc

    rng = np.random.default_rng({"normal": 0, "few values": 1, "masked": 2, "flat": 3}[kind])
    for _ in range(300):
        n, k = int(rng.integers(1, 4000)), int(rng.integers(1, 80))
        if kind == "normal":
            x = rng.standard_normal(n).astype(np.float32)
        elif kind == "few values":
            x = rng.integers(-3, 3, n).astype(np.float32)         # ties across the k-th place
        elif kind == "masked":
            x = np.where(rng.random(n) < 0.7, -np.inf, rng.integers(0, 4, n)).astype(np.float32)
        else:
            x = np.zeros(n, np.float32)
        assert np.array_equal(_top_desc(x, k), _desc(x)[:k]), (n, k)


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e400", "1e30GiB", "-1", "lots", "5XB"])
def test_budget_parser_refuses_what_is_no_size(text):
    """The engine's own budget parser: one FleError naming the option, never a
    ValueError or OverflowError from the arithmetic."""
    from fle_engine.runtime import parse_budget

    with pytest.raises(FleError, match="--cache-budget"):
        parse_budget(text)
    assert parse_budget("0") == 0 and parse_budget("1.5GiB") == 3 * 2 ** 29
