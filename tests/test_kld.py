"""fle_quant.kld (llama.cpp's KL-divergence base files and statistics) and
fle-kld on factory models.

The file layout is checked by parsing it here with ``struct``, the uint16
encoding against a scalar transcription of llama-perplexity's loop, and the
statistics against a plain float64 NumPy computation of the same
definitions. Interchange with llama-perplexity itself is in
test_kld_llama.py.
"""
from __future__ import annotations

import math
import re
import struct

import numpy as np
import pytest

from fle_quant.errors import FleError
from fle_quant.kld import (BaseWriter, KldStats, decode_records, encode_records, format_summary, iter_chunks,
                           n_scored, percentile, read_header, record_words)

# ---------------------------------------------------------------- helpers


def make_logits(rng, n, n_vocab, spread=6.0):
    """Rows of logits with a few strong tokens and a long tail, some of it
    more than 16 below the top (the part the file clips)."""
    x = rng.standard_normal((n, n_vocab)).astype(np.float32) * spread
    x[np.arange(n), rng.integers(0, n_vocab, n)] += 12
    return x


def log_softmax64(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def parse_file(path):
    """The base file parsed independently of fle_quant.kld."""
    data = path.read_bytes()
    assert data[:8] == b"_logits_"
    n_ctx, n_vocab, n_chunk = struct.unpack_from("<iii", data, 8)
    off = 20
    tokens = np.frombuffer(data, "<i4", n_ctx * n_chunk, off).reshape(n_chunk, n_ctx)
    off += 4 * n_ctx * n_chunk
    n_sc = n_ctx - 1 - n_ctx // 2
    words = 2 * ((n_vocab + 1) // 2) + 4
    assert len(data) == off + n_chunk * n_sc * words * 2
    recs = np.frombuffer(data, "<u2", n_chunk * n_sc * words, off).reshape(n_chunk, n_sc, words)
    heads = np.frombuffer(data, "<f4", offset=off).reshape(n_chunk, n_sc, words // 2)[..., :2]
    return n_ctx, n_vocab, n_chunk, tokens, recs, heads


def llama_encode_row(logits, tok):
    """llama-perplexity's log_softmax(.., uint16 *, tok) transcribed one
    scalar at a time in float32 (double where the C code uses double)."""
    f = np.float32
    mx = logits[0]
    mn = logits[0]
    for v in logits[1:]:
        mx = max(mx, v)
        mn = min(mn, v)
    mn = max(mn, f(mx - f(16)))
    s = 0.0
    for v in logits:
        s += float(np.exp(f(v - mx)))
    lse = f(math.log(s))
    min_lp = f(f(mn - mx) - lse)
    scale = f(f(mx - mn) / f(65535))
    q = np.zeros(len(logits), np.uint16)
    if scale:
        inv = f(f(1) / scale)
        for i, v in enumerate(logits):
            if v > mn:
                q[i] = int(np.rint(f(inv * f(v - mn))))
    return scale, min_lp, q, float(f(f(mx + lse) - logits[tok]))


def text_file(path, n_words=1500, seed=0):
    rng = np.random.default_rng(seed)
    words = ("the of and to in is was for on as with by at from his her that it an are were which this be "
             "river mountain city language music science history village station church engine garden").split()
    lines = [" ".join(rng.choice(words, 12)) + "." for _ in range(n_words // 12)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------- the file


@pytest.mark.parametrize("n_vocab", [101, 64])  # odd: one padding word per record
def test_write_read_round_trip(tmp_path, n_vocab):
    rng = np.random.default_rng(n_vocab)
    n_ctx, n_chunk = 10, 3
    tokens = rng.integers(0, n_vocab, (n_chunk, n_ctx))
    logits = [make_logits(rng, n_scored(n_ctx), n_vocab) for _ in range(n_chunk)]
    path = tmp_path / "base.kld"
    with BaseWriter(path, n_ctx, n_vocab, tokens) as w:
        for x in logits:
            w.add_chunk(x)

    ctx2, voc2, nch2, toks2, recs, heads = parse_file(path)
    assert (ctx2, voc2, nch2) == (n_ctx, n_vocab, n_chunk)
    assert recs.shape[-1] == record_words(n_vocab) == n_vocab + 4 + n_vocab % 2
    np.testing.assert_array_equal(toks2, tokens)
    if n_vocab % 2:
        assert (recs[..., 4 + n_vocab:] == 0).all()

    hdr = read_header(path)
    assert (hdr.n_ctx, hdr.n_vocab, hdr.n_chunk, hdr.n_scored) == (n_ctx, n_vocab, n_chunk, 4)
    np.testing.assert_array_equal(hdr.tokens, tokens)
    chunks = list(iter_chunks(hdr))
    assert len(chunks) == n_chunk
    nll_all = []
    for c, (x, rec) in enumerate(zip(logits, chunks)):
        np.testing.assert_array_equal(rec, recs[c])
        lp = decode_records(rec, n_vocab).astype(np.float64)
        ref = log_softmax64(x)
        scale = heads[c, :, 0].astype(np.float64)
        kept = ref > ref.max(-1, keepdims=True) - 16
        err = np.abs(lp - ref)
        # within half a quantization step (and float32 rounding) where stored
        assert (err <= (scale[:, None] / 2 + 2e-5))[kept].all()
        # clipped values sit at the clipping floor, 16 below the top
        assert np.allclose(lp[~kept], np.broadcast_to(heads[c, :, 1:2], lp.shape)[~kept])
        targets = tokens[c, n_ctx // 2 + 1:]
        nll_all.append(-ref[np.arange(len(targets)), targets])
    nll_all = np.concatenate(nll_all)
    assert w.count == nll_all.size
    assert math.isclose(w.ppl, math.exp(nll_all.mean()), rel_tol=1e-5)


def test_encoding_matches_llama_perplexity_loop():
    rng = np.random.default_rng(1)
    x = make_logits(rng, 6, 57)
    x[3] = 0.5  # constant row: scale 0, all q = 0
    x[4, :5] = x[4].max()  # ties at the top
    targets = rng.integers(0, 57, 6)
    rec, nll = encode_records(x, targets)
    for r in range(6):
        scale, min_lp, q, want_nll = llama_encode_row(x[r], targets[r])
        head = rec[r, :4].view(np.float32)
        assert head[0] == scale and head[1] == min_lp
        np.testing.assert_array_equal(rec[r, 4:4 + 57], q)
        assert nll[r] == want_nll


def test_bad_files(tmp_path):
    rng = np.random.default_rng(2)
    path = tmp_path / "base.kld"
    with BaseWriter(path, 8, 20, rng.integers(0, 20, 16)) as w:
        for _ in range(2):
            w.add_chunk(make_logits(rng, n_scored(8), 20))
    good = path.read_bytes()
    cases = {"magic": b"_logitz_" + good[8:], "truncated": good[:-3], "empty": b"",
             "vocab": good[:12] + struct.pack("<i", 21) + good[16:],
             "tokens": good[:20] + struct.pack("<i", 99) + good[24:]}
    for name, data in cases.items():
        bad = tmp_path / f"{name}.kld"
        bad.write_bytes(data)
        with pytest.raises(FleError, match=str(bad)):
            read_header(bad)
    with pytest.raises(FleError, match="no such|cannot read"):
        read_header(tmp_path / "missing.kld")
    # a writer that is not given every chunk leaves nothing behind
    out = tmp_path / "partial.kld"
    with pytest.raises(FleError, match="1 of 2 chunks"):
        with BaseWriter(out, 8, 20, rng.integers(0, 20, 16)) as w:
            w.add_chunk(make_logits(rng, n_scored(8), 20))
    assert not out.exists() and not list(tmp_path.glob("partial*"))
    with pytest.raises(FleError, match="shape"):
        with BaseWriter(tmp_path / "x.kld", 8, 20, rng.integers(0, 20, 16)) as w:
            w.add_chunk(np.zeros((2, 20), np.float32))
    assert not (tmp_path / "x.kld").exists() and not list(tmp_path.glob("x.kld*"))
    nan = make_logits(rng, n_scored(8), 20)
    nan[1, 3] = np.nan
    with pytest.raises(FleError, match="position 1 are not finite"):
        encode_records(nan, np.zeros(3, int))
    with pytest.raises(FleError, match="not finite"):
        KldStats(20).add(nan, encode_records(nan[:1] * 0, [0])[0].repeat(3, 0), np.zeros(3, int))


# ---------------------------------------------------------------- statistics


def plain_numpy_stats(base_recs, n_vocab, cand_logits, targets):
    """The statistics llama-perplexity defines, in float64 NumPy."""
    scale = np.concatenate([r[:, :4].copy().view(np.float32)[:, 0] for r in base_recs]).astype(np.float64)
    lo = np.concatenate([r[:, :4].copy().view(np.float32)[:, 1] for r in base_recs]).astype(np.float64)
    q = np.concatenate([r[:, 4:4 + n_vocab] for r in base_recs]).astype(np.float64)
    lpb = scale[:, None] * q + lo[:, None]
    lq = log_softmax64(np.concatenate(cand_logits))
    t = np.concatenate(targets)
    rows = np.arange(t.size)
    n = t.size
    kld = np.where(lpb > -16, np.exp(lpb) * (lpb - lq), 0).sum(-1)
    nll, nll_b = -lq[rows, t], -lpb[rows, t]

    def se(v):
        return math.sqrt(v.var() / (n - 1))

    cov = np.mean(nll * nll_b) - nll.mean() * nll_b.mean()
    dp = np.exp(-nll) - np.exp(-nll_b)
    same = float(np.mean(lq.argmax(-1) == lpb.argmax(-1)))
    rms = math.sqrt(np.mean(dp ** 2))
    return {
        "ppl": math.exp(nll.mean()), "ppl_base": math.exp(nll_b.mean()),
        "ppl_unc": math.exp(nll.mean()) * se(nll),
        "log_ppl_cor": cov / (nll.std() * nll_b.std()),
        "log_ppl_ratio": nll.mean() - nll_b.mean(),
        "log_ppl_ratio_unc": math.sqrt(se(nll) ** 2 + se(nll_b) ** 2 - 2 * cov / (n - 1)),
        "kld_mean": kld.mean(), "kld_unc": se(kld),
        "kld": kld, "dp": dp, "dp_mean": dp.mean(), "dp_unc": se(dp), "rms_dp": rms,
        "rms_dp_unc": 0.5 / rms * math.sqrt(np.var(dp ** 2) / (n - 1)),
        "same_top": same, "same_top_unc": math.sqrt(same * (1 - same) / (n - 1)),
    }


def test_statistics_equal_plain_numpy(tmp_path):
    rng = np.random.default_rng(3)
    n_ctx, n_vocab, n_chunk = 64, 300, 4
    tokens = rng.integers(0, n_vocab, (n_chunk, n_ctx))
    base = [make_logits(rng, n_scored(n_ctx), n_vocab) for _ in range(n_chunk)]
    cand = [x + rng.standard_normal(x.shape).astype(np.float32) * 0.7 for x in base]
    path = tmp_path / "base.kld"
    with BaseWriter(path, n_ctx, n_vocab, tokens) as w:
        for x in base:
            w.add_chunk(x)
    hdr = read_header(path)
    stats = KldStats(n_vocab)
    recs = list(iter_chunks(hdr))
    for c, rec in enumerate(recs):
        stats.add(cand[c], rec, hdr.targets(c))
    s = stats.summary()
    want = plain_numpy_stats(recs, n_vocab, cand, [hdr.targets(c) for c in range(n_chunk)])
    assert s.count == n_chunk * n_scored(n_ctx) == 124
    assert 0.05 < want["kld_mean"] < 5 and 0.3 < want["same_top"] < 1  # a real difference to measure
    for key in ("ppl", "ppl_base", "ppl_unc", "log_ppl_cor", "log_ppl_ratio", "log_ppl_ratio_unc", "kld_mean",
                "kld_unc", "dp_mean", "dp_unc", "rms_dp", "rms_dp_unc", "same_top", "same_top_unc"):
        assert math.isclose(getattr(s, key), want[key], rel_tol=2e-4, abs_tol=1e-6), (key, getattr(s, key), want[key])
    assert math.isclose(s.ppl_ratio, math.exp(want["log_ppl_ratio"]), rel_tol=1e-5)
    assert math.isclose(s.ppl_diff, want["ppl"] - want["ppl_base"], rel_tol=1e-4)
    # percentiles: linear interpolation at fraction * (n - 1), as np.quantile's default
    for label, frac in (("Maximum", 1), ("99.9%", .999), ("99.0%", .99), ("95.0%", .95), ("90.0%", .9),
                        ("Median", .5), ("10.0%", .1), (" 5.0%", .05), (" 1.0%", .01), (" 0.1%", .001),
                        ("Minimum", 0)):
        assert math.isclose(s.kld_percentiles[label], np.quantile(want["kld"], frac), rel_tol=1e-4, abs_tol=1e-6), label
    for label, frac in (("75.0%", .75), ("Median", .5), ("25.0%", .25)):
        assert math.isclose(s.dp_percentiles[label], np.quantile(want["dp"], frac), rel_tol=1e-4, abs_tol=1e-6), label
    # the printed summary carries these numbers in llama.cpp's layout
    text = format_summary(s)
    assert f"Mean    KLD: {s.kld_mean:10.6f} ± {s.kld_unc:10.6f}" in text
    assert f"Same top p: {100 * s.same_top:6.3f} ± {100 * s.same_top_unc:5.3f} %" in text
    assert f"99.9%   KLD: {s.kld_percentiles['99.9%']:10.6f}" in text
    assert len(text.splitlines()) == (1 + 6 + 1) + (1 + 1 + 11 + 1) + (1 + 1 + 13 + 2)


def test_percentile_definition():
    rng = np.random.default_rng(4)
    for n in (1, 2, 7, 100, 1001):
        v = np.sort(rng.standard_normal(n).astype(np.float32))
        for frac in (0.001, 0.1, 0.5, 0.9, 0.999):
            assert math.isclose(percentile(v, frac), np.quantile(v.astype(np.float64), frac), rel_tol=1e-5,
                                abs_tol=1e-6)
        assert math.isclose(percentile(v, None), float(np.median(v.astype(np.float64))), rel_tol=1e-6, abs_tol=1e-7)
        assert percentile(v, 0.0) == v[0] and percentile(v, 1.0) == v[-1]


def test_identical_logits_give_zero_kld(tmp_path):
    rng = np.random.default_rng(5)
    n_ctx, n_vocab = 32, 200
    tokens = rng.integers(0, n_vocab, (3, n_ctx))
    base = [make_logits(rng, n_scored(n_ctx), n_vocab) for _ in range(3)]
    for c, x in enumerate(base):  # likely targets: far above the 16-nat clip of the base file
        tokens[c, n_ctx // 2 + 1:] = x.argmax(-1)
    with BaseWriter(tmp_path / "b.kld", n_ctx, n_vocab, tokens) as w:
        for x in base:
            w.add_chunk(x)
    hdr = read_header(tmp_path / "b.kld")
    stats = KldStats(n_vocab)
    for c, rec in enumerate(iter_chunks(hdr)):
        stats.add(base[c], rec, hdr.targets(c))
    s = stats.summary()
    half_step = 16 / 65535 / 2
    assert abs(s.kld_mean) < 1e-5
    assert max(abs(s.kld_percentiles["Maximum"]), abs(s.kld_percentiles["Minimum"])) <= half_step * 1.01
    assert s.same_top == 1.0 and abs(s.log_ppl_ratio) < half_step


# ---------------------------------------------------------------- fle-kld on factory models

pytestmark = pytest.mark.usefixtures("two_torch_threads")
torch = pytest.importorskip("torch")
fle_engine = pytest.importorskip("fle_engine")

from fle_engine import kld_run  # noqa: E402
from fle_quant.cli.kld_cli import main as kld_main  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402



@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("kld_models")
    return {"f32": make_model(d / "m-f32.gguf", "qwen3moe", mix="f32"),
            "q8_0": make_model(d / "m-q8.gguf", "qwen3moe", mix="q8_0"),
            "other_vocab": make_model(d / "m-v600.gguf", "qwen3moe", mix="f32", vocab_size=600),
            "text": text_file(d / "text.txt")}


def summary_numbers(out):
    nums = {}
    for line in out.splitlines():
        m = re.match(r"^(Mean    KLD|Same top p|Mean PPL\(Q\)/PPL\(base\))\s*:\s*(-?[\d.]+)", line)
        if m:
            nums[m.group(1)] = float(m.group(2))
    return nums


def test_cli_base_then_compare(models, tmp_path, capsys):
    base = tmp_path / "base.kld"
    assert kld_main(["base", str(models["f32"]), "--text", str(models["text"]), "-c", "64", "--chunks", "3",
                     "-o", str(base), "-b", "40"]) == 0
    out = capsys.readouterr().out
    assert "Final estimate: PPL =" in out
    hdr = read_header(base)
    assert (hdr.n_ctx, hdr.n_chunk, hdr.n_vocab) == (64, 3, 512)
    tok = fle_engine.tokenizer.Tokenizer.from_gguf(models["f32"])
    want = kld_run.perplexity_tokens(tok, kld_run.read_text(models["text"]))[:3 * 64]
    np.testing.assert_array_equal(hdr.tokens.reshape(-1), want)

    # the same model against its own base: only the uint16 rounding is left
    assert kld_main([str(models["f32"]), "--base", str(base)]) == 0
    out = capsys.readouterr().out
    nums = summary_numbers(out)
    assert abs(nums["Mean    KLD"]) <= 2e-6 and nums["Same top p"] == 100.0
    assert "KL divergence statistics" in out and out.count("\n   ") >= 3  # the per-chunk table

    # a quantized copy is measurably different, and still close
    s = kld_run.compare_to_base(models["q8_0"], base)
    assert 1e-5 < s.kld_mean < 0.05 and s.same_top > 0.9
    print(f"\nfactory qwen3moe: q8_0 vs f32 mean KLD {s.kld_mean:.3g}, same top {100 * s.same_top:.2f} %")


def test_chunks_bos_and_batches(models, tmp_path):
    from fle_quant.gguf_reader import GGUFModel
    from fle_quant.gguf_writer import WritePlan, write_gguf

    # the same model with a vocabulary that adds BOS
    src = GGUFModel.open(models["f32"])
    plan = WritePlan()
    keep = []
    try:
        for k, v in src.metadata.items():
            vt, it = src.metadata_types[k]
            plan.add(k, True if k == "tokenizer.ggml.add_bos_token" else v, vt, it)
        if "tokenizer.ggml.add_bos_token" not in src.metadata:
            from gguf import GGUFValueType
            plan.add("tokenizer.ggml.add_bos_token", True, GGUFValueType.BOOL)
        for name, t in src.tensors.items():
            raw = np.array(src.tensor_bytes(name))
            keep.append(raw)
            plan.add_tensor(name, t.shape, t.qtype, raw)
        path = write_gguf(plan, tmp_path / "bos.gguf", force=True).paths[0]
    finally:
        src.close()
    model = fle_engine.load(path)
    tok = fle_engine.tokenizer.Tokenizer.from_gguf(path)
    assert tok.add_bos
    ids = kld_run.perplexity_tokens(tok, kld_run.read_text(models["text"]))
    assert ids[0] == tok.bos_id
    chunks = kld_run.chunk_tokens(ids, 48, 2)
    assert chunks.shape == (2, 48)
    np.testing.assert_array_equal(chunks.reshape(-1), ids[:96])
    # chunk 2 is evaluated with BOS in place of its first token, scored from n_ctx/2 to n_ctx-2
    got = kld_run.scored_logits(model, chunks[1], tok.bos_id, n_batch=512)
    ref = model.logits([tok.bos_id] + chunks[1, 1:].tolist())[24:47]
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)
    # batching changes nothing but memory
    np.testing.assert_allclose(kld_run.scored_logits(model, chunks[1], tok.bos_id, n_batch=7), got, atol=1e-4)
    with pytest.raises(FleError, match="at least 96"):
        kld_run.chunk_tokens(ids[:95], 48)


def test_cli_errors(models, tmp_path, capsys):
    base = tmp_path / "base.kld"
    assert kld_main(["base", str(models["f32"]), "--text", str(models["text"]), "-c", "32", "--chunks", "2",
                     "-o", str(base)]) == 0
    short = tmp_path / "short.txt"
    short.write_text("the river\n")
    notkld = tmp_path / "x.kld"
    notkld.write_bytes(b"GGUF" + bytes(40))
    cases = [
        [str(models["other_vocab"]), "--base", str(base)],  # another vocabulary
        [str(models["f32"]), "--base", str(notkld)],
        [str(models["f32"]), "--base", str(tmp_path / "missing.kld")],
        ["base", str(models["f32"]), "--text", str(short), "-c", "32", "-o", str(tmp_path / "o.kld")],
        ["base", str(models["f32"]), "--text", str(models["text"]), "-c", "2", "-o", str(tmp_path / "o.kld")],
        ["base", str(models["f32"]), "--text", str(tmp_path / "none.txt"), "-o", str(tmp_path / "o.kld")],
        ["base", str(tmp_path / "none.gguf"), "--text", str(models["text"]), "-o", str(tmp_path / "o.kld")],
    ]
    for argv in cases:
        assert kld_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("fle-kld: error: ") and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o.kld").exists()
    with pytest.raises(SystemExit) as e:
        kld_main([str(models["f32"])])  # --base missing
    assert e.value.code == 2
