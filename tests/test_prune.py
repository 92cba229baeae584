"""Expert pruning (``fle_quant.prune``, ``fle-reap prune``) on factory models:
kept experts are byte copies of the source's, router rows and exp_probs_b
entries follow them, everything else is untouched, and bad input ends in
exit status 2 with no output."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest

import fle_quant.gguf_writer as gguf_writer
from fle_quant.cli.reap_cli import main as reap_main
from fle_quant.errors import FleError
from fle_quant.gguf_format import GGUFValueType
from fle_quant.gguf_reader import GGUFModel
from fle_quant.gguf_writer import WritePlan, write_gguf
from fle_quant.prune import choose_kept, load_scores, parse_scores
from fle_quant.synth import make_model, mtp_path

N_EXPERT = 8
# what the file format and llama.cpp's names make per-expert (expert index = last ggml dimension)
PER_EXPERT = re.compile(
    r"^blk\.\d+\.(ffn_(gate|up|down|gate_up)_exps\.(weight|bias|scale)|ffn_gate_inp\.(weight|bias)|exp_probs_b(\.bias)?)$")
MIX = [(r"\.ffn_gate_inp\.weight$", "Q8_0"), (r"_exps\.weight$", "Q4_0"), (r"attn_(q|k|v)\.weight$", "Q8_0")]


# ---------------------------------------------------------------------------
# helpers


def expected_kept(scores, keep):
    """Highest scores first, lower index first on ties; returned ascending."""
    order = sorted(range(len(scores)), key=lambda e: (-scores[e], e))
    return sorted(order[:keep])


def random_scores(seed, layers, n=N_EXPERT, ties=True):
    rng = np.random.default_rng(seed)
    # few distinct values: many ties, so the tie-break is exercised in every layer
    return {l: (rng.integers(0, 4, n).astype(float) if ties else rng.random(n)).tolist() for l in layers}


def write_scores(path, layers, **over):
    obj = {"format": "fle.scores/1", "method": "reap", "model": "model.gguf", "tokens": 4096,
           "layers": {str(k): v for k, v in layers.items()}}
    obj.update(over)
    Path(path).write_text(json.dumps(obj))
    return path


def run(capsys, *args):
    rc = reap_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def leftovers(directory):
    return sorted(p.name for p in Path(directory).iterdir() if ".fle-tmp-" in p.name)


def check_pruned(src_path, out_path, kept, keep, kept_original=None, method="reap", scores_file=None):
    """The pruned file against its source: metadata, every tensor's bytes."""
    src, out = GGUFModel.open(src_path), GGUFModel.open(out_path)
    try:
        arch = src.arch
        n_expert = src.metadata[f"{arch}.expert_count"]
        # metadata: the source's, in its order and types, expert_count changed, fle.reap.* added
        src_keys = list(src.metadata)
        assert list(out.metadata)[: len(src_keys)] == src_keys
        for k in src_keys:
            if k.startswith("fle.reap."):
                continue
            assert out.metadata_types[k] == src.metadata_types[k], k
            assert out.metadata[k] == (keep if k == f"{arch}.expert_count" else src.metadata[k]), k
        extra = [k for k in out.metadata if k not in src.metadata or k.startswith("fle.reap.")]
        assert sorted(extra) == sorted(["fle.reap.method", "fle.reap.scores_sha256",
                                        "fle.reap.original_expert_count"]
                                       + [f"fle.reap.kept.{l}" for l in kept])
        assert out.metadata["fle.reap.method"] == method
        if scores_file is not None:
            assert out.metadata["fle.reap.scores_sha256"] == hashlib.sha256(Path(scores_file).read_bytes()).hexdigest()
        for l in kept:
            assert out.metadata_types[f"fle.reap.kept.{l}"] == (GGUFValueType.ARRAY, GGUFValueType.INT32)
            assert out.metadata[f"fle.reap.kept.{l}"] == (kept_original or kept)[l]
        # tensors: same names in the same order
        assert list(out.tensors) == list(src.tensors)
        n_pruned = 0
        for name, t in src.tensors.items():
            o = out.tensors[name]
            assert o.qtype == t.qtype, name
            if PER_EXPERT.match(name):
                layer = int(name.split(".")[1])
                ks = kept[layer]
                assert o.shape == t.shape[:-1] + (keep,), name
                a = src.tensor_bytes(name).reshape(n_expert, -1)
                b = out.tensor_bytes(name).reshape(keep, -1)
                assert np.array_equal(b, a[ks]), name
                if len(t.shape) == 3:  # and through the reader's own expert API
                    for j, e in enumerate(ks):
                        assert np.array_equal(out.expert_bytes(name, j), src.expert_bytes(name, e))
                n_pruned += 1
            else:
                assert o.shape == t.shape, name
                assert np.array_equal(out.tensor_bytes(name), src.tensor_bytes(name)), name
        return n_pruned
    finally:
        src.close()
        out.close()


# ---------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def qmoe(tmp_path_factory):
    """qwen3moe with quantized experts and a quantized router (byte copy for any type)."""
    return make_model(tmp_path_factory.mktemp("qmoe") / "qmoe.gguf", "qwen3moe", mix=MIX)


@pytest.fixture(scope="module")
def with_bias(tmp_path_factory):
    """A qwen3moe factory model plus the per-expert tensors other architectures
    carry: exp_probs_b, a router bias, per-expert biases and scales, and a
    per-layer ``ffn_norm_exps`` (one vector per layer, not per expert)."""
    d = tmp_path_factory.mktemp("bias")
    base = make_model(d / "base.gguf", "qwen3moe")
    rng = np.random.default_rng(7)
    with GGUFModel.open(base) as m:
        plan = WritePlan.from_model(m)
        n_embd = m.metadata["qwen3moe.embedding_length"]
        for l in range(m.metadata["qwen3moe.block_count"]):
            p = f"blk.{l}."
            plan.add_tensor(p + "exp_probs_b.bias", (N_EXPERT,), "F32", rng.standard_normal(N_EXPERT, dtype=np.float32))
            plan.add_tensor(p + "ffn_gate_inp.bias", (N_EXPERT,), "F16", rng.standard_normal(N_EXPERT).astype(np.float16))
            plan.add_tensor(p + "ffn_down_exps.bias", (n_embd, N_EXPERT), "F32",
                            rng.standard_normal((N_EXPERT, n_embd), dtype=np.float32))
            plan.add_tensor(p + "ffn_gate_exps.scale", (N_EXPERT,), "F32", rng.random(N_EXPERT, dtype=np.float32))
            plan.add_tensor(p + "ffn_norm_exps.weight", (n_embd,), "F32", rng.random(n_embd, dtype=np.float32))
        path = d / "with_bias.gguf"
        write_gguf(plan, path, progress=False)
    return path


@pytest.fixture(scope="module")
def q4exp_separate(tmp_path_factory):
    """qwen4exp trunk (4 blocks) and its separate MTP-head file (block 4)."""
    return make_model(tmp_path_factory.mktemp("q4s") / "q4.gguf", "qwen4exp", mtp="separate")


@pytest.fixture(scope="module")
def q4exp_inside(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("q4i") / "q4i.gguf", "qwen4exp", mtp="inside")


# ---------------------------------------------------------------------------
# the choice


def test_choose_kept_matches_sorting_with_ties():
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(2, 40))
        s = rng.integers(-3, 4, n).astype(float)
        keep = int(rng.integers(1, n + 1))
        assert choose_kept(s, keep) == expected_kept(s.tolist(), keep)


def test_choose_kept_ties_keep_lower_index():
    assert choose_kept([1.0] * 6, 2) == [0, 1]
    # -0.0 and 0.0 are equal scores
    assert choose_kept([0.0, -0.0, 0.0, 5.0], 2) == [0, 3]


# ---------------------------------------------------------------------------
# pruning


def test_prune_qwen3moe_quantized(tmp_path, capsys, qmoe):
    layers = random_scores(1, range(4))
    sc = write_scores(tmp_path / "s.json", layers)
    out = tmp_path / "out.gguf"
    rc, stdout, err = run(capsys, "prune", qmoe, "--scores", sc, "--keep", 5, "-o", out)
    assert rc == 0, err
    kept = {l: expected_kept(v, 5) for l, v in layers.items()}
    n = check_pruned(qmoe, out, kept, 5, scores_file=sc)
    assert n == 4 * 4  # router + gate, up, down in each of 4 layers
    with GGUFModel.open(out) as m:
        assert m.metadata["qwen3moe.expert_count"] == 5
        assert m.metadata["fle.reap.original_expert_count"] == N_EXPERT
        assert m.tensors["blk.0.ffn_gate_inp.weight"].qtype.name == "Q8_0"
        assert m.tensors["blk.0.ffn_down_exps.weight"].qtype.name == "Q4_0"
    assert "wrote" in stdout and str(out) in stdout


def test_prune_exp_probs_b_biases_and_scales(tmp_path, capsys, with_bias):
    layers = random_scores(2, range(4))
    sc = write_scores(tmp_path / "s.json", layers, method="frequency")
    out = tmp_path / "out.gguf"
    rc, _, err = run(capsys, "prune", with_bias, "--scores", sc, "--keep", 3, "-o", out)
    assert rc == 0, err
    kept = {l: expected_kept(v, 3) for l, v in layers.items()}
    # router, gate/up/down, exp_probs_b, router bias, down bias, gate scale; ffn_norm_exps untouched
    assert check_pruned(with_bias, out, kept, 3, method="frequency") == 4 * 8
    with GGUFModel.open(with_bias) as a, GGUFModel.open(out) as b:
        for l in range(4):
            src = np.frombuffer(a.tensor_bytes(f"blk.{l}.exp_probs_b.bias"), np.float32)
            got = np.frombuffer(b.tensor_bytes(f"blk.{l}.exp_probs_b.bias"), np.float32)
            assert np.array_equal(got, src[kept[l]])
            assert b.tensors[f"blk.{l}.ffn_norm_exps.weight"].shape == a.tensors[f"blk.{l}.ffn_norm_exps.weight"].shape


def test_prune_mtp_inside(tmp_path, capsys, q4exp_inside):
    layers = random_scores(3, range(5))  # 4 trunk blocks + the MTP block 4
    sc = write_scores(tmp_path / "s.json", layers)
    out = tmp_path / "out.gguf"
    rc, _, err = run(capsys, "prune", q4exp_inside, "--scores", sc, "--keep", 6, "-o", out)
    assert rc == 0, err
    kept = {l: expected_kept(v, 6) for l, v in layers.items()}
    assert check_pruned(q4exp_inside, out, kept, 6) == 5 * 4
    # without the MTP block's scores: a missing layer
    del layers[4]
    sc2 = write_scores(tmp_path / "s2.json", layers)
    rc, _, err = run(capsys, "prune", q4exp_inside, "--scores", sc2, "--keep", 6, "-o", tmp_path / "o2.gguf")
    assert rc == 2 and '"4"' in err and "MoE layer 4" in err
    assert not (tmp_path / "o2.gguf").exists()


@pytest.mark.parametrize("own_table", [False, True])
def test_prune_separate_mtp_head(tmp_path, capsys, q4exp_separate, own_table):
    head = mtp_path(q4exp_separate)
    layers = random_scores(4, range(5))
    args = []
    if own_table:
        head_layers = {4: layers.pop(4)}
        args = ["--mtp-scores", write_scores(tmp_path / "h.json", head_layers, method="man")]
        layers_all = {**layers, **head_layers}
    else:
        layers_all = layers
    sc = write_scores(tmp_path / "s.json", layers)
    out, hout = tmp_path / "out.gguf", tmp_path / "out-mtp.gguf"
    rc, _, err = run(capsys, "prune", q4exp_separate, "--scores", sc, "--keep", 4, "-o", out,
                     "--mtp-head", head, "--mtp-out", hout, *args)
    assert rc == 0, err
    kept = {l: expected_kept(v, 4) for l, v in layers_all.items()}
    assert check_pruned(q4exp_separate, out, {l: kept[l] for l in range(4)}, 4) == 4 * 4
    assert check_pruned(head, hout, {4: kept[4]}, 4, method="man" if own_table else "reap") == 4


def test_prune_mtp_scores_without_head_refused(tmp_path, capsys, q4exp_separate):
    sc = write_scores(tmp_path / "s.json", random_scores(5, range(5)))
    out = tmp_path / "out.gguf"
    rc, _, err = run(capsys, "prune", q4exp_separate, "--scores", sc, "--keep", 4, "-o", out)
    assert rc == 2 and "[4]" in err and "--mtp-head" in err
    assert not out.exists()
    rc, _, err = run(capsys, "prune", q4exp_separate, "--scores", sc, "--keep", 4, "-o", out,
                     "--mtp-head", mtp_path(q4exp_separate))
    assert rc == 2 and "--mtp-out" in err
    assert not out.exists()


def test_prune_twice_composes_original_indices(tmp_path, capsys, qmoe):
    first = random_scores(6, range(4), ties=False)
    second = random_scores(7, range(4), n=6)
    s1, s2 = write_scores(tmp_path / "s1.json", first), write_scores(tmp_path / "s2.json", second)
    mid, out = tmp_path / "mid.gguf", tmp_path / "out.gguf"
    assert run(capsys, "prune", qmoe, "--scores", s1, "--keep", 6, "-o", mid)[0] == 0
    assert run(capsys, "prune", mid, "--scores", s2, "--keep", 4, "-o", out)[0] == 0
    k1 = {l: expected_kept(v, 6) for l, v in first.items()}
    k2 = {l: expected_kept(v, 4) for l, v in second.items()}
    composed = {l: [k1[l][j] for j in k2[l]] for l in range(4)}
    check_pruned(mid, out, k2, 4, kept_original=composed)
    with GGUFModel.open(out) as m, GGUFModel.open(qmoe) as src:
        assert m.metadata["fle.reap.original_expert_count"] == N_EXPERT
        for l in range(4):
            assert m.metadata[f"fle.reap.kept.{l}"] == composed[l]
            name = f"blk.{l}.ffn_up_exps.weight"
            for j, e in enumerate(composed[l]):
                assert np.array_equal(m.expert_bytes(name, j), src.expert_bytes(name, e))


def test_prune_split_output(tmp_path, capsys, qmoe):
    layers = random_scores(8, range(4))
    sc = write_scores(tmp_path / "s.json", layers)
    out = tmp_path / "out.gguf"
    rc, _, err = run(capsys, "prune", qmoe, "--scores", sc, "--keep", 2, "-o", out, "--split-max-tensors", 20)
    assert rc == 0, err
    shards = sorted(tmp_path.glob("out-*-of-*.gguf"))
    assert len(shards) > 1 and not out.exists()
    check_pruned(qmoe, shards[1], {l: expected_kept(v, 2) for l, v in layers.items()}, 2)


# ---------------------------------------------------------------------------
# refusals: exit 2, nothing written


@pytest.mark.parametrize("keep, words", [(N_EXPERT, "nothing to do"), (N_EXPERT + 3, "nothing to do"),
                                         (1, "expert_used_count"), (0, "expert_used_count")])
def test_keep_out_of_range(tmp_path, capsys, qmoe, keep, words):
    sc = write_scores(tmp_path / "s.json", random_scores(9, range(4)))
    out = tmp_path / "out.gguf"
    rc, _, err = run(capsys, "prune", qmoe, "--scores", sc, "--keep", keep, "-o", out)
    assert rc == 2 and words in err and err.startswith("fle-reap: error:")
    assert "Traceback" not in err
    assert not out.exists() and leftovers(tmp_path) == []


def _malformed():
    good = {str(l): [float(e) for e in range(N_EXPERT)] for l in range(4)}
    base = {"format": "fle.scores/1", "method": "reap", "model": "m.gguf", "tokens": 10, "layers": good}

    def variant(**changes):
        obj = json.loads(json.dumps(base))
        for k, v in changes.items():
            if v is KeyError:
                del obj[k]
            else:
                obj[k] = v
        return json.dumps(obj)

    def layer(key, value):
        obj = json.loads(json.dumps(base))
        if value is KeyError:
            del obj["layers"][key]
        else:
            obj["layers"][key] = value
        return json.dumps(obj)

    return [
        ("not json", "{", "not valid JSON"),
        ("array", "[1, 2]", "JSON object"),
        ("format", variant(format="fle.scores/2"), "format"),
        ("no layers", variant(layers=KeyError), "'layers'"),
        ("method", variant(method=""), "method"),
        ("tokens", variant(tokens=-1), "tokens"),
        ("tokens bool", variant(tokens=True), "tokens"),
        ("unknown key", variant(extra=1), "'extra'"),
        ("nan", layer("2", [0.0] * 5 + [float("nan")] + [0.0] * 2), "layers['2'][5]"),
        ("infinity", layer("1", [float("inf")] + [0.0] * 7), "layers['1'][0]"),
        ("string", layer("0", ["1"] + [0.0] * 7), "layers['0'][0]"),
        ("bool", layer("3", [True] + [0.0] * 7), "layers['3'][0]"),
        ("short", layer("1", [0.0] * 7), 'layers["1"] has 7 scores'),
        ("long", layer("1", [0.0] * 9), 'layers["1"] has 9 scores'),
        ("missing", layer("2", KeyError), 'no entry "2"'),
        ("bad key", layer("01", [0.0] * 8), "'01'"),
        ("other model", layer("7", [0.0] * 8), "[7]"),
        ("duplicate", json.dumps(base)[:-1] + ', "tokens": 3}', "twice"),
    ]


@pytest.mark.parametrize("what, text, words", _malformed(), ids=[m[0] for m in _malformed()])
def test_malformed_scores(tmp_path, capsys, qmoe, what, text, words):
    sc = tmp_path / "s.json"
    sc.write_text(text)
    out = tmp_path / "out.gguf"
    rc, _, err = run(capsys, "prune", qmoe, "--scores", sc, "--keep", 4, "-o", out)
    assert rc == 2, what
    assert words in err, err
    assert str(sc) in err
    assert not out.exists() and leftovers(tmp_path) == []


def test_missing_scores_file(tmp_path, capsys, qmoe):
    rc, _, err = run(capsys, "prune", qmoe, "--scores", tmp_path / "none.json", "--keep", 4, "-o", tmp_path / "o.gguf")
    assert rc == 2 and "no such file" in err


def test_parse_scores_api():
    s = parse_scores({"format": "fle.scores/1", "method": "reap", "model": "m", "tokens": 0,
                      "layers": {"3": [1, 2.5], "0": [0, 0]}, "info": {"dataset": "x"}}, "abc", "t")
    assert list(s.layers) == [0, 3] and s.layers[3].dtype == np.float64 and s.sha256 == "abc"
    with pytest.raises(FleError, match="info"):
        parse_scores({"format": "fle.scores/1", "method": "reap", "model": "m", "tokens": 0,
                      "layers": {"0": [1.0]}, "info": []})


def test_existing_output_needs_force(tmp_path, capsys, qmoe):
    layers = random_scores(10, range(4))
    sc = write_scores(tmp_path / "s.json", layers)
    out = tmp_path / "out.gguf"
    out.write_bytes(b"keep me")
    rc, _, err = run(capsys, "prune", qmoe, "--scores", sc, "--keep", 4, "-o", out)
    assert rc == 2 and "--force" in err
    assert out.read_bytes() == b"keep me"
    rc, _, err = run(capsys, "prune", qmoe, "--scores", sc, "--keep", 4, "-o", out, "--force")
    assert rc == 0, err
    check_pruned(qmoe, out, {l: expected_kept(v, 4) for l, v in layers.items()}, 4)


def test_output_is_input_refused(tmp_path, capsys, qmoe):
    sc = write_scores(tmp_path / "s.json", random_scores(11, range(4)))
    before = Path(qmoe).read_bytes()
    rc, _, err = run(capsys, "prune", qmoe, "--scores", sc, "--keep", 4, "-o", qmoe, "--force")
    assert rc == 2 and "input" in err
    assert Path(qmoe).read_bytes() == before


@pytest.mark.parametrize("kind", ["ffn_gate_chexps.weight", "ffn_foo_exps.weight", "ffn_gate_tid2eid.weight"])
def test_unknown_expert_tensor_refused(tmp_path, capsys, kind):
    base = make_model(tmp_path / "base.gguf", "qwen3moe", block_count=1)
    with GGUFModel.open(base) as m:
        plan = WritePlan.from_model(m)
        plan.add_tensor(f"blk.0.{kind}", (32, N_EXPERT), "F32", np.zeros((N_EXPERT, 32), np.float32))
        write_gguf(plan, tmp_path / "odd.gguf", progress=False)
    sc = write_scores(tmp_path / "s.json", random_scores(12, range(1)))
    rc, _, err = run(capsys, "prune", tmp_path / "odd.gguf", "--scores", sc, "--keep", 4, "-o", tmp_path / "o.gguf")
    assert rc == 2 and f"blk.0.{kind}" in err
    assert not (tmp_path / "o.gguf").exists()


def test_no_subcommand_and_no_score_stub(capsys):
    assert reap_main([]) == 2
    with pytest.raises(SystemExit) as e:
        reap_main(["score", "x.gguf"])
    assert e.value.code == 2
    capsys.readouterr()


# ---------------------------------------------------------------------------
# interruption: no final file, no temporary file


def _interrupt_after(monkeypatch, n_calls):
    real = gguf_writer._Copier.copy_tensor
    calls = {"n": 0}

    def copy_tensor(self, t, out):
        calls["n"] += 1
        if calls["n"] > n_calls:
            raise KeyboardInterrupt
        return real(self, t, out)

    monkeypatch.setattr(gguf_writer._Copier, "copy_tensor", copy_tensor)
    return calls


def test_interrupt_leaves_nothing(tmp_path, capsys, monkeypatch, qmoe):
    sc = write_scores(tmp_path / "s.json", random_scores(13, range(4)))
    out = tmp_path / "out.gguf"
    _interrupt_after(monkeypatch, 10)
    rc, _, err = run(capsys, "prune", qmoe, "--scores", sc, "--keep", 4, "-o", out)
    assert rc == 130 and "interrupted" in err
    assert not out.exists() and leftovers(tmp_path) == []


def test_interrupt_while_writing_head_removes_trunk(tmp_path, capsys, monkeypatch, q4exp_separate):
    sc = write_scores(tmp_path / "s.json", random_scores(14, range(5)))
    out, hout = tmp_path / "out.gguf", tmp_path / "out-mtp.gguf"
    with GGUFModel.open(q4exp_separate) as m:
        n_trunk = len(m.tensors)
    _interrupt_after(monkeypatch, n_trunk + 3)
    rc, _, err = run(capsys, "prune", q4exp_separate, "--scores", sc, "--keep", 4, "-o", out,
                     "--mtp-head", mtp_path(q4exp_separate), "--mtp-out", hout)
    assert rc == 130
    assert not out.exists() and not hout.exists() and leftovers(tmp_path) == []


def test_load_scores_sha(tmp_path):
    p = write_scores(tmp_path / "s.json", {0: [1.0, 2.0]})
    assert load_scores(p).sha256 == hashlib.sha256(p.read_bytes()).hexdigest()


def test_scores_of_another_model_refused(tmp_path, capsys, qmoe, with_bias):
    """A table that records the fingerprint of the file it was measured on
    (as fle-reap score writes it) prunes that file only."""
    from fle_quant.digest import model_fingerprint

    layers = random_scores(6, range(4))
    out = tmp_path / "out.gguf"
    other = write_scores(tmp_path / "o.json", layers, info={"model_fingerprint": model_fingerprint(with_bias)})
    rc, _, err = run(capsys, "prune", qmoe, "--scores", other, "--keep", 5, "-o", out)
    assert rc == 2 and "another model" in err and str(qmoe) in err
    assert not out.exists()
    own = write_scores(tmp_path / "s.json", layers, info={"model_fingerprint": model_fingerprint(qmoe)})
    rc, _, err = run(capsys, "prune", qmoe, "--scores", own, "--keep", 5, "-o", out)
    assert rc == 0, err
    bad = write_scores(tmp_path / "b.json", layers, info={"model_fingerprint": "xyz"})
    rc, _, err = run(capsys, "prune", qmoe, "--scores", bad, "--keep", 5, "-o", tmp_path / "o2.gguf")
    assert rc == 2 and "model_fingerprint" in err


def test_mtp_head_of_another_model_refused(tmp_path, capsys, q4exp_separate):
    other = make_model(tmp_path / "w.gguf", "qwen4exp", mtp="separate", expert_feed_forward_length=32)
    sc = write_scores(tmp_path / "s.json", random_scores(7, range(5)))
    out, hout = tmp_path / "out.gguf", tmp_path / "out-mtp.gguf"
    rc, _, err = run(capsys, "prune", q4exp_separate, "--scores", sc, "--keep", 4, "-o", out,
                     "--mtp-head", mtp_path(other), "--mtp-out", hout)
    assert rc == 2 and "expert_feed_forward_length" in err and "MTP head made for this model" in err
    assert not out.exists() and not hout.exists()
