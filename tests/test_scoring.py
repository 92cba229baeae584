"""fle-reap score on factory models: REAP, MAN and frequency equal a plain
NumPy computation (router softmax, top-k, renormalised weights and SwiGLU
experts from the file's F32 weights, on the captured layer inputs); score ->
prune runs end to end; on a model with skewed routing, pruning by REAP
scores costs less KL divergence than pruning random experts; the MTP head of
a qwen4exp model is scored under its block index; bad input exits 2."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.usefixtures("two_torch_threads")
torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from fle_quant.cli.reap_cli import main as reap_main  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.prune import load_scores, parse_scores, prune  # noqa: E402
from fle_quant.scoring import score  # noqa: E402
from textgen import write_text  # noqa: E402  (this folder's helper)
from fle_quant.synth import make_model, mtp_path  # noqa: E402

SEED = 5
N_TOKENS = 256
CTX = 128
N_EXPERT, N_USED, KEEP = 8, 2, 4




@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("score")
    return {
        "dir": d,
        "text": write_text(d / "calib.txt", 2000, 0),
        "eval": write_text(d / "eval.txt", 1000, 1),
        "model": make_model(d / "skewed.gguf", "qwen3moe", seed=SEED, mix="f32", routing_skew=3.0,
                            block_count=3, expert_count=N_EXPERT, expert_used_count=N_USED),
    }


@pytest.fixture(scope="module")
def tables(files):
    return {m: score(files["model"], files["text"], method=m, n_tokens=N_TOKENS, ctx=CTX)
            for m in ("reap", "man", "frequency")}


def _numpy_scores(files) -> dict[str, dict[int, np.ndarray]]:
    """The three scores per layer, written out in NumPy from the layer inputs
    of fle_engine's capture and the file's F32 router and expert weights
    (read with gguf-py)."""
    import fle_engine
    from fle_engine.tokenizer import Tokenizer

    ids = Tokenizer.from_gguf(files["model"]).encode(files["text"].read_text(encoding="utf-8"))[:N_TOKENS]
    model = fle_engine.load(files["model"])
    with model.capturing() as cap:
        for s in range(0, N_TOKENS, CTX):
            model.logits(ids[s:s + CTX])
    weights = {t.name: np.asarray(t.data, dtype=np.float64) for t in gguf.GGUFReader(files["model"]).tensors}
    out = {"reap": {}, "man": {}, "frequency": {}}
    for layer, recs in cap.layers.items():
        x = np.concatenate([r.hidden.numpy() for r in recs]).astype(np.float64)      # [N, D]
        router = weights[f"blk.{layer}.ffn_gate_inp.weight"]                         # [E, D]
        gate, up, down = (weights[f"blk.{layer}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
        logits = x @ router.T
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        count = np.zeros(N_EXPERT)
        norm_sum = np.zeros(N_EXPERT)
        gnorm_sum = np.zeros(N_EXPERT)
        for t in range(x.shape[0]):
            chosen = np.argsort(-probs[t], kind="stable")[:N_USED]
            g = probs[t, chosen] / probs[t, chosen].sum()
            for e, ge in zip(chosen, g):
                a = gate[e] @ x[t]
                f = down[e] @ (a / (1.0 + np.exp(-a)) * (up[e] @ x[t]))
                count[e] += 1
                norm_sum[e] += np.linalg.norm(f)
                gnorm_sum[e] += ge * np.linalg.norm(f)
        seen = count > 0
        reap, man = np.zeros(N_EXPERT), np.zeros(N_EXPERT)
        reap[seen] = gnorm_sum[seen] / count[seen]
        man[seen] = norm_sum[seen] / count[seen]
        out["reap"][layer], out["man"][layer] = reap, man
        out["frequency"][layer] = count / x.shape[0]
    return out


def test_scores_match_numpy(files, tables):
    want = _numpy_scores(files)
    for method, table in tables.items():
        parsed = parse_scores(table)
        assert parsed.method == method and parsed.tokens == N_TOKENS
        assert sorted(parsed.layers) == [0, 1, 2]
        for layer, values in parsed.layers.items():
            np.testing.assert_allclose(values, want[method][layer], rtol=1e-5, atol=1e-12,
                                       err_msg=f"{method} layer {layer}")
    # the skew leaves some experts unrouted: they score 0 by every method
    freq = parse_scores(tables["frequency"]).layers
    never = {layer: np.flatnonzero(v == 0) for layer, v in freq.items()}
    assert any(len(v) for v in never.values())
    for method in ("reap", "man"):
        for layer, idx in never.items():
            assert np.all(parse_scores(tables[method]).layers[layer][idx] == 0.0)
    for layer, v in freq.items():
        assert v.sum() == pytest.approx(N_USED)


def _eval_ids(files) -> list[int]:
    from fle_engine.tokenizer import Tokenizer

    return Tokenizer.from_gguf(files["model"]).encode(files["eval"].read_text(encoding="utf-8"))[:192]


def _kld(ref_logits: np.ndarray, path: Path, ids: list[int]) -> float:
    """Mean over positions of KL(p_ref || p_pruned)."""
    import fle_engine

    q = fle_engine.load(path).logits(ids).astype(np.float64)
    p = ref_logits.astype(np.float64)
    lp = p - np.logaddexp.reduce(p, axis=1, keepdims=True)
    lq = q - np.logaddexp.reduce(q, axis=1, keepdims=True)
    return float((np.exp(lp) * (lp - lq)).sum(1).mean())


def test_reap_pruning_beats_random_pruning(files, tables, tmp_path):
    import fle_engine

    ids = _eval_ids(files)
    ref = fle_engine.load(files["model"]).logits(ids)
    reap_path = tmp_path / "reap.json"
    reap_path.write_text(json.dumps(tables["reap"]))
    prune(files["model"], reap_path, KEEP, tmp_path / "reap.gguf", progress=False)
    kld_reap = _kld(ref, tmp_path / "reap.gguf", ids)

    rng = np.random.default_rng(0)
    random_klds = []
    for i in range(3):
        table = {"format": "fle.scores/1", "method": "random", "model": str(files["model"]), "tokens": 0,
                 "layers": {k: [float(v) for v in rng.random(N_EXPERT)] for k in tables["reap"]["layers"]}}
        p = tmp_path / f"random{i}.json"
        p.write_text(json.dumps(table))
        prune(files["model"], p, KEEP, tmp_path / f"random{i}.gguf", progress=False)
        random_klds.append(_kld(ref, tmp_path / f"random{i}.gguf", ids))
    assert kld_reap >= 0.0
    assert kld_reap < np.mean(random_klds), (kld_reap, random_klds)


def test_score_then_prune_cli(files, tmp_path, capsys):
    scores = tmp_path / "s.json"
    rc = reap_main(["score", str(files["model"]), "--text", str(files["text"]), "--tokens", "64", "--ctx", "32",
                    "--method", "man", "-o", str(scores)])
    assert rc == 0, capsys.readouterr().err
    assert "wrote" in capsys.readouterr().out
    s = load_scores(scores)
    assert s.method == "man" and s.tokens == 64 and sorted(s.layers) == [0, 1, 2]
    rc = reap_main(["prune", str(files["model"]), "--scores", str(scores), "--keep", str(KEEP),
                    "-o", str(tmp_path / "p.gguf")])
    assert rc == 0, capsys.readouterr().err
    import fle_engine

    pruned = fle_engine.load(tmp_path / "p.gguf")
    assert pruned.args.n_expert == KEEP
    assert np.isfinite(pruned.logits([1, 2, 3])).all()

    # ... and on to fle-kld: the unpruned model's base file, then the pruned model against it
    from fle_quant.cli.kld_cli import main as kld_main

    base = tmp_path / "base.kld"
    assert kld_main(["base", str(files["model"]), "--text", str(files["eval"]), "-c", "64", "--chunks", "2",
                     "-o", str(base)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert kld_main([str(tmp_path / "p.gguf"), "--base", str(base)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    mean_kld = float(out.split("Mean    KLD:")[1].split()[0])
    assert mean_kld > 0.0   # removing routed experts changes the distribution
    assert "Same top p" in out


@pytest.mark.parametrize("arch", ["qwen4exp", "qwen3next"])
def test_mtp_head_scored_under_its_block(tmp_path, arch):
    trunk = make_model(tmp_path / "m.gguf", arch, seed=SEED, mix="f32", mtp="separate")
    text = write_text(tmp_path / "t.txt", 300, 2)
    table = score(trunk, text, method="reap", n_tokens=48, ctx=24, mtp_head=mtp_path(trunk))
    parsed = parse_scores(table)
    n_layer = max(parsed.layers)
    assert table["info"]["mtp"].startswith("scored")
    assert table["info"]["layer_tokens"][str(n_layer)] == 2 * 23      # (ctx - 1) pairs per window
    assert table["info"]["layer_tokens"]["0"] == 48
    assert all(v >= 0 for v in parsed.layers[n_layer]) and max(parsed.layers[n_layer]) > 0
    # without the head the block is missing
    plain = score(trunk, text, method="frequency", n_tokens=24, ctx=24)
    assert str(n_layer) not in plain["layers"] and plain["info"]["mtp"] == "none"


def test_qwen3next_mtp_inside_scored_and_pruned(tmp_path):
    """A qwen3next file with its MTP block inside: the block is scored with
    the trunk, pruned with it, and the pruned file's head runs."""
    import fle_engine
    from fle_engine.mtp import head_logits

    model = make_model(tmp_path / "m.gguf", "qwen3next", seed=SEED, mix="f32", mtp="inside")
    text = write_text(tmp_path / "t.txt", 300, 3)
    table = score(model, text, method="reap", n_tokens=48, ctx=24)
    assert table["info"]["mtp"] == "scored (block 4)" and table["info"]["layer_tokens"]["4"] == 2 * 23
    scores = tmp_path / "s.json"
    scores.write_text(json.dumps(table))
    out = tmp_path / "p.gguf"
    assert reap_main(["prune", str(model), "--scores", str(scores), "--keep", "6", "-o", str(out)]) == 0
    pruned = fle_engine.load(out)
    assert pruned.args.n_expert == 6 and pruned.net.mtp is not None and pruned.net.mtp.moe.n_expert == 6
    toks = list(range(1, 17))
    st = pruned.new_state(16)
    pruned.forward(toks, st)
    assert torch.isfinite(head_logits(pruned, st, st.hidden[:-1], toks[1:])).all()


# ---------------------------------------------------------------------------
# bad input


def _run_bad(capsys, argv) -> str:
    rc = reap_main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("fle-reap: error: ") and err.count("\n") == 1, err
    return err


def test_cli_bad_input(files, tmp_path, capsys):
    model, text, out = str(files["model"]), str(files["text"]), str(tmp_path / "s.json")
    assert "no such file" in _run_bad(capsys, ["score", model, "--text", str(tmp_path / "none.txt"), "-o", out])
    assert "no such file" in _run_bad(capsys, ["score", str(tmp_path / "none.gguf"), "--text", text, "-o", out])
    assert "fewer" in _run_bad(capsys, ["score", model, "--text", text, "--tokens", "1000000", "-o", out])
    assert "--tokens" in _run_bad(capsys, ["score", model, "--text", text, "--tokens", "0", "-o", out])
    assert "MTP" in _run_bad(capsys, ["score", model, "--text", text, "--tokens", "16", "--mtp-head", model,
                                      "-o", out])
    (tmp_path / "exists.json").write_text("{}")
    assert "--force" in _run_bad(capsys, ["score", model, "--text", text, "-o", str(tmp_path / "exists.json")])
    with pytest.raises(SystemExit) as e:
        reap_main(["score", model, "--text", text, "--method", "loudest", "-o", out])
    assert e.value.code == 2
    assert not (tmp_path / "s.json").exists()
    with pytest.raises(FleError, match="method"):
        score(files["model"], files["text"], method="loudest")
