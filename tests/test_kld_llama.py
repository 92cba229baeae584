"""fle-kld against llama.cpp's own ``llama-perplexity`` on factory models.

llama-perplexity is a C++ tool that the llama-cpp-python wheel does not
ship; it is built once from the sdist's vendored llama.cpp (target
``llama-perplexity`` only, portable CPU code) into
``$FLE_CACHE_DIR/llama-tools-0.3.36`` (default ``~/.cache/fle``), which
takes several minutes on two cores the first time. Tests skip when the
sources, cmake or a C++ compiler are missing.

Checked:
* both tools tokenize and chunk the text alike (identical headers and
  tokens in their base files);
* each tool reads the other's base file, and on the same candidate the mean
  KL divergences of all four (writer, reader) pairs agree within the
  forward-pass tolerance;
* fed llama.cpp's own candidate logits (through llama-cpp-python, same
  context and batch), FLE's statistics print the numbers llama-perplexity
  prints.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.reference

llama_cpp = pytest.importorskip("llama_cpp")
torch = pytest.importorskip("torch")

from fle_engine import kld_run  # noqa: E402
from fle_engine.tokenizer import Tokenizer  # noqa: E402
from fle_quant import kld  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"
N_CTX = 128
N_CHUNKS = 4  # 4 x 63 = 252 scored tokens; llama-perplexity prints its summary from 100 on
KLD_TOL = 1e-3  # the forward-pass tolerance between FLE and llama.cpp (see test_forward_llama.py)
_TOOLS = Path(os.environ.get("FLE_CACHE_DIR", Path.home() / ".cache" / "fle")) / f"llama-tools-{LLAMA_CPP_PYTHON}"


@pytest.fixture(scope="session")
def llama_perplexity(llama_build) -> Path:
    exe = _TOOLS / "build" / "bin" / "llama-perplexity"
    if not exe.is_file():
        llama_build("llama-perplexity")
        if not exe.is_file():
            pytest.skip(f"the build did not produce {exe}")
    return exe


def run_perplexity(exe: Path, *args: str) -> str:
    """llama-perplexity's stdout (then stderr). Its logger prints from a
    thread that the program does not flush before exiting (common/log.cpp
    in this llama.cpp version), so the tail of a KL-divergence report is
    sometimes lost; such runs are repeated (the results are deterministic)."""
    cmd = [str(exe), "-c", str(N_CTX), "-b", str(N_CTX), "-t", "2", "-fa", "off", "--no-warmup", *args]
    complete = "--kl-divergence" not in args
    for _ in range(8):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-3000:]
        if complete or "\nSame top p:" in r.stdout:
            return out
    pytest.fail(f"llama-perplexity printed no complete report in 8 runs:\n{out[-3000:]}")


_LINE = re.compile(r"^(?P<label>[^:\n]*?)\s*:\s*(?P<val>-?(?:[\d.]+|nan|inf))%?"
                   r"(?:\s*±\s*(?P<unc>-?(?:[\d.]+|nan|inf)))?\s*%?\s*$")


def summary_values(text: str) -> dict[str, tuple[float, float | None]]:
    """label -> (value, uncertainty) of the closing statistics' lines."""
    start = text.find("====== Perplexity statistics ======")
    assert start >= 0, text[-3000:]
    out = {}
    section = ""
    for line in text[start:].splitlines():
        if line.startswith("======"):
            section = line
            continue
        if not line.strip():
            continue
        m = _LINE.match(line)
        if not m:
            break  # the end of the statistics
        unc = m.group("unc")
        out[f"{section[7:10]} {m.group('label')}"] = (float(m.group("val")), float(unc) if unc else None)
    return out


def text_file(path: Path, n_lines: int = 200) -> Path:
    rng = np.random.default_rng(0)
    words = ("the of and to in is was for on as with by at from his her that it an are were which this be "
             "river mountain city language music science history village station church engine garden").split()
    path.write_text("\n".join(" ".join(rng.choice(words, 12)) + "." for _ in range(n_lines)) + "\n")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory, llama_perplexity):
    d = tmp_path_factory.mktemp("kld_llama")
    base = make_model(d / "base.gguf", "qwen3moe", mix="f32", context_length=1024)
    cand = make_model(d / "cand.gguf", "qwen3moe", mix="q8_0", context_length=1024)
    text = text_file(d / "text.txt")
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    llama_base = d / "llama.kld"
    run_perplexity(llama_perplexity, "-m", str(base), "-f", str(text), "--chunks", str(N_CHUNKS),
                   "--kl-divergence-base", str(llama_base))
    fle_base = d / "fle.kld"
    kld_run.write_base(base, kld_run.read_text(text), fle_base, N_CTX, N_CHUNKS)
    yield {"dir": d, "base": base, "cand": cand, "text": text, "llama_base": llama_base, "fle_base": fle_base,
           "exe": llama_perplexity}
    torch.set_num_threads(old)


def test_base_files_agree(setup):
    ll, fl = kld.read_header(setup["llama_base"]), kld.read_header(setup["fle_base"])
    assert (ll.n_ctx, ll.n_vocab, ll.n_chunk) == (fl.n_ctx, fl.n_vocab, fl.n_chunk) == (N_CTX, 512, N_CHUNKS)
    np.testing.assert_array_equal(ll.tokens, fl.tokens)
    tok = Tokenizer.from_gguf(setup["base"])
    ids = kld_run.perplexity_tokens(tok, kld_run.read_text(setup["text"]))
    np.testing.assert_array_equal(ll.tokens.reshape(-1), ids[:N_CTX * N_CHUNKS])
    # the stored distributions are the same up to the forward pass
    klds = []
    for a, b in zip(kld.iter_chunks(ll), kld.iter_chunks(fl)):
        pa = kld.decode_records(a, ll.n_vocab).astype(np.float64)
        pb = kld.decode_records(b, fl.n_vocab).astype(np.float64)
        klds.append((np.exp(pa) * (pa - pb)).sum(-1))
        assert (a[:, 4:].argmax(-1) == b[:, 4:].argmax(-1)).mean() > 0.99
    print(f"\nKL(llama base file || FLE base file) mean {np.mean(klds):.3g}, max {np.max(klds):.3g}")
    assert abs(np.mean(klds)) < KLD_TOL


def test_each_reads_the_other(setup):
    exe, cand = setup["exe"], str(setup["cand"])
    results = {}
    for writer in ("llama", "fle"):
        base = setup[f"{writer}_base"]
        out = run_perplexity(exe, "-m", cand, "--kl-divergence", "--kl-divergence-base", str(base))
        results[(writer, "llama")] = summary_values(out)["KL  Mean    KLD"][0]
        results[(writer, "fle")] = kld_run.compare_to_base(cand, base).kld_mean
    # and the base model against its own base file, written by the other tool
    self_kld = kld_run.compare_to_base(setup["base"], setup["llama_base"]).kld_mean
    out = run_perplexity(exe, "-m", str(setup["base"]), "--kl-divergence", "--kl-divergence-base",
                         str(setup["fle_base"]))
    llama_self = summary_values(out)["KL  Mean    KLD"][0]
    print("\nmean KLD of the q8_0 candidate (base writer, reader): "
          + ", ".join(f"{k}: {v:.6f}" for k, v in results.items())
          + f"; base model vs the other tool's base file: FLE {self_kld:.2e}, llama {llama_self:.2e}")
    values = list(results.values())
    assert min(values) > 1e-5  # the candidate differs measurably
    assert max(values) - min(values) <= KLD_TOL
    assert abs(self_kld) <= KLD_TOL and abs(llama_self) <= KLD_TOL


def llama_cpp_scored_logits(path, header):
    """llama.cpp's candidate logits at the scored positions, chunk by chunk,
    evaluated as llama-perplexity evaluates them."""
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=N_CTX, n_batch=N_CTX, n_threads=2,
                          flash_attn=False, verbose=False)
    try:
        assert not llm.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true"
        for c in range(header.n_chunk):
            llm.reset()
            llm.eval(header.tokens[c].tolist())
            yield np.array(llm.scores[header.first:N_CTX - 1], dtype=np.float32)
    finally:
        llm.close()


def test_summary_equals_llama_perplexity_output(setup):
    header = kld.read_header(setup["llama_base"])
    stats = kld.KldStats(header.n_vocab)
    for c, (logits, records) in enumerate(zip(llama_cpp_scored_logits(setup["cand"], header),
                                              kld.iter_chunks(header))):
        stats.add(logits, records, header.targets(c))
    ours = summary_values(kld.format_summary(stats.summary()))
    out = run_perplexity(setup["exe"], "-m", str(setup["cand"]), "--kl-divergence", "--kl-divergence-base",
                         str(setup["llama_base"]))
    theirs = summary_values(out)
    assert set(ours) == set(theirs) and len(ours) == 6 + 12 + 16
    worst = 0.0
    for label, (val, unc) in theirs.items():
        mine, mine_unc = ours[label]
        for a, b in ((mine, val), (mine_unc, unc)):
            if b is None:
                continue
            # printed with 3 to 6 decimals: allow one unit in the last place plus 1e-4 relative
            step = 1e-3 if "Δp" in label or "top p" in label else 1e-6
            assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1.01 * step), (label, a, b)
            worst = max(worst, abs(a - b) / step)
    print(f"\nFLE's statistics vs llama-perplexity's printout: largest difference {worst:.2f} units "
          "in the last printed digit")
