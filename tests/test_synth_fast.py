"""Fast mode of the model factory: the same file layout as the normal
factory, random valid blocks of the intended scale for the big tensors,
normal-factory values for the rest, a routing skew that skews expert
popularity, determinism, and a model the torch reference runs."""
from __future__ import annotations

import filecmp

import numpy as np
import pytest

from fle_quant.errors import FleError
from fle_quant.ggml_types import BLOCK_GEOMETRY, GGMLType
from fle_quant.gguf_reader import GGUFModel
from fle_quant.gguf_writer import planned_layout
from fle_quant.quants import dequantize
from fle_quant.synth import ARCHS, make_model, mtp_path
from fle_quant.synth.cli import build_parser
from fle_quant.synth.cli import main as synth_main
from fle_quant.synth.common import shared_direction
from fle_quant.synth.fast import (FAST_SHARED, FAST_TYPES, SMALL_GAIN, _RandomSource, fast_gain, fast_plans,
                                  make_fast_model)

SMALL = 1 << 14  # random blocks for every matrix of the small test models
FLOATS = {GGMLType.F32, GGMLType.F16, GGMLType.BF16}


def values(m: GGUFModel, name: str) -> np.ndarray:
    t = m.tensors[name]
    raw = m.tensor_bytes(name)
    if t.qtype in FLOATS:
        return np.asarray(raw.view({GGMLType.F32: np.float32, GGMLType.F16: np.float16}[t.qtype]),
                          dtype=np.float32).reshape(tuple(reversed(t.shape)))
    return dequantize(raw.reshape(-1, t.row_bytes), t.qtype).reshape(tuple(reversed(t.shape)))


def is_random(name: str, t) -> bool:
    return (t.qtype not in FLOATS and int(np.prod(t.shape)) >= SMALL and name != "token_embd.weight"
            and not name.endswith("ffn_gate_inp.weight"))


def layout(path):
    with GGUFModel.open(path) as m:
        return ([(n, t.shape, t.qtype) for n, t in m.tensors.items()],
                {k: (v, m.metadata_types[k]) for k, v in m.metadata.items()})


@pytest.mark.parametrize("arch", ARCHS)
def test_same_layout_as_the_normal_factory(tmp_path, arch):
    kw = dict(mix="release", seed=3)
    fast = make_fast_model(tmp_path / "f.gguf", arch, random_min_values=SMALL, progress=False, **kw)
    slow = make_model(tmp_path / "s.gguf", arch, **kw)
    pairs = [(fast, slow)]
    if arch == "qwen4exp":  # MTP head in its own file by default
        pairs.append((mtp_path(fast), mtp_path(slow)))
    for f, s in pairs:
        (ft, fmeta), (st, smeta) = layout(f), layout(s)
        assert ft == st
        assert fmeta == smeta
    with GGUFModel.open(fast) as fm, GGUFModel.open(slow) as sm:
        kinds = set()
        for name, t in fm.tensors.items():
            same = np.array_equal(fm.tensor_bytes(name), sm.tensor_bytes(name))
            if is_random(name, t):
                kinds.add(t.qtype)
                assert not same, name
            elif name.endswith("_norm.weight") and len(t.shape) == 1:
                assert np.all(fm.tensor_bytes(name).view(np.float32) == 1.0), name    # unit norm weights
            elif name != "token_embd.weight" and not name.endswith("ffn_gate_inp.weight"):
                # biases, HC mixers, anything small or float: the normal factory's bytes
                assert same, name
        assert {GGMLType.Q8_0, GGMLType.IQ4_XS, GGMLType.IQ3_S, GGMLType.Q6_K} <= kinds


def test_random_blocks_have_the_intended_scale(tmp_path):
    path = make_fast_model(tmp_path / "f.gguf", "qwen3next", random_min_values=SMALL, progress=False,
                           rules=[(r"blk\.0\.ffn_(gate|up|down)_exps", "Q4_K"), (r"blk\.1\.ffn_(gate|up)_exps", "Q2_K"),
                                  (r"blk\.1\.ffn_down_exps", "IQ2_XS"), (r"blk\.2\.ffn_(gate|up|down)_exps", "Q5_K"),
                                  (r"blk\.3\.ffn_(gate|up|down)_exps", "IQ2_S"), (r"attn_qkv", "IQ3_XXS")])
    seen = set()
    with GGUFModel.open(path) as m:
        for name, t in m.tensors.items():
            if not is_random(name, t):
                continue
            v = values(m, name)
            assert np.isfinite(v).all(), name
            want = fast_gain(name) / np.sqrt(t.shape[0])
            assert abs(v.std() / want - 1) < 0.2, (name, t.qtype.name, v.std(), want)
            assert abs(v.mean()) < 0.05 * want, name  # centred, also the K-quants with a min
            seen.add(t.qtype)
    assert {GGMLType.Q4_K, GGMLType.Q2_K, GGMLType.Q5_K, GGMLType.IQ2_XS, GGMLType.IQ2_S,
            GGMLType.IQ3_XXS, GGMLType.Q6_K, GGMLType.Q8_0} <= seen
    assert fast_gain("blk.0.ffn_down_exps.weight") == fast_gain("blk.3.ssm_out.weight") == SMALL_GAIN
    assert fast_gain("blk.0.attn_output.weight") == fast_gain("blk.0.ffn_down_shexp.weight") == SMALL_GAIN
    assert fast_gain("blk.0.ffn_up_exps.weight") == fast_gain("output.weight") == 1.0


@pytest.mark.parametrize("qtype", FAST_TYPES, ids=lambda t: t.name)
def test_every_fast_type(qtype):
    """Random blocks of each type: finite, centred, std gain / sqrt(n_in),
    and the same bytes whatever the chunk size."""
    block = BLOCK_GEOMETRY[qtype][0]
    shape = (8 * max(block, 64), 257)
    src = _RandomSource("blk.0.ffn_up_exps.weight", shape, qtype, seed=1)
    raw = b"".join(bytes(c) for c in src.chunks(1 << 20))
    assert len(raw) == src.n_bytes
    assert raw == b"".join(bytes(c) for c in src.chunks(1000))
    v = dequantize(np.frombuffer(raw, np.uint8), qtype)
    assert np.isfinite(v).all()
    want = 1.0 / np.sqrt(shape[0])
    assert abs(v.std() / want - 1) < 0.05
    assert abs(v.mean()) < 0.02 * want


def test_unsupported_type_is_a_fle_error(tmp_path):
    with pytest.raises(FleError, match=r"blk\.0\.ffn_up_exps\.weight.*IQ1_M"):
        make_fast_model(tmp_path / "x.gguf", "qwen3moe", random_min_values=SMALL, progress=False,
                        rules=[("ffn_up_exps", "IQ1_M")])
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen4exp"])
def test_same_seed_same_bytes(tmp_path, arch):
    kw = dict(random_min_values=SMALL, progress=False, routing_skew=1.0)
    a = make_fast_model(tmp_path / "a.gguf", arch, 7, **kw)
    b = make_fast_model(tmp_path / "b.gguf", arch, 7, **kw)
    c = make_fast_model(tmp_path / "c.gguf", arch, 8, **kw)
    assert filecmp.cmp(a, b, shallow=False)
    assert not filecmp.cmp(a, c, shallow=False)


def test_embedding_carries_the_shared_direction(tmp_path):
    path = make_fast_model(tmp_path / "e.gguf", "qwen3moe", 2, progress=False, vocab_size=5000)
    with GGUFModel.open(path) as m:
        e = values(m, "token_embd.weight")
    d = shared_direction(2, e.shape[1])
    cos = (e @ d) / np.linalg.norm(e, axis=1) / np.linalg.norm(d)
    assert abs(cos.mean() - FAST_SHARED) < 0.02 and cos.min() > 0.75
    assert abs(np.sqrt((e * e).mean()) - 1) < 0.05


def expert_counts(path, layer=0):
    with GGUFModel.open(path) as m:
        e = values(m, "token_embd.weight")
        w = values(m, f"blk.{layer}.ffn_gate_inp.weight")
        k = m.metadata["qwen3moe.expert_used_count"]
    x = e / np.sqrt((e * e).mean(axis=1, keepdims=True))
    logits = x @ w.T
    top = np.argsort(-logits, axis=1)[:, :k]
    return np.bincount(top.ravel(), minlength=w.shape[0])


def test_routing_skew_makes_popularity_uneven(tmp_path):
    kw = dict(vocab_size=4096, expert_count=16, expert_used_count=2, block_count=2, progress=False)
    spread = {}
    for skew in (0.0, 0.25, 1.0):
        counts = expert_counts(make_fast_model(tmp_path / f"r{skew}.gguf", "qwen3moe", routing_skew=skew, **kw))
        spread[skew] = counts.std() / counts.mean()
    assert spread[0.0] < 0.15  # near-uniform
    assert spread[0.25] > 3 * spread[0.0]
    assert spread[1.0] > 1.5 * spread[0.25]
    # the skew is drawn per layer
    a = expert_counts(tmp_path / "r1.0.gguf", 0)
    b = expert_counts(tmp_path / "r1.0.gguf", 1)
    assert np.argmax(a) != np.argmax(b) or np.argmin(a) != np.argmin(b)

    dead = make_fast_model(tmp_path / "d.gguf", "qwen3moe", dead_experts=[1, 6], routing_skew=1.0, **kw)
    counts = expert_counts(dead)
    assert counts[1] == counts[6] == 0


def test_torch_reference_runs_the_fast_model(tmp_path):
    fle_engine = pytest.importorskip("fle_engine")
    path = make_fast_model(tmp_path / "t.gguf", "qwen3moe", random_min_values=SMALL, progress=False)
    logits = fle_engine.load(path).logits([1, 5, 9, 200, 3, 77])
    assert logits.shape[0] == 6 and np.isfinite(logits).all()


def test_plans_for_big_shapes_build_without_writing(tmp_path):
    """A Qwen3-30B-A3B-shaped plan: sizes from the plan alone."""
    plans = fast_plans(tmp_path / "big.gguf", "qwen3moe", mix="q8_0", rules=[("ffn_(gate|up|down)_exps", "IQ4_XS")],
                       block_count=48, embedding_length=2048, expert_count=128, expert_used_count=8,
                       expert_feed_forward_length=768, attention_head_count=32, attention_head_count_kv=4,
                       attention_key_length=128, vocab_size=151936)
    (path, plan), = plans
    _, sizes = planned_layout(plan, path)
    assert 15e9 < sizes[0] < 19e9
    types = {t.name: t.qtype for t in plan.tensors}
    assert types["blk.47.ffn_down_exps.weight"] == GGMLType.IQ4_XS
    assert types["blk.0.attn_q.weight"] == types["output.weight"] == GGMLType.Q8_0
    assert types["blk.0.ffn_gate_inp.weight"] == types["blk.0.attn_norm.weight"] == GGMLType.F32
    assert not list(tmp_path.iterdir())


def test_cli_fast(tmp_path, capsys):
    assert "random valid blocks for big tensors" in " ".join(build_parser().format_help().split())
    out = tmp_path / "c.gguf"
    assert synth_main(["qwen3moe", "--fast", "-o", str(out), "--set", "block_count=2",
                       "--rule", "ffn_(gate|up|down)_exps=IQ4_XS", "--mix", "q8_0", "--routing-skew", "1"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    ref = tmp_path / "r.gguf"
    assert synth_main(["qwen3moe", "-o", str(ref), "--set", "block_count=2",
                       "--rule", "ffn_(gate|up|down)_exps=IQ4_XS", "--mix", "q8_0"]) == 0
    assert layout(out) == layout(ref)
    assert synth_main(["qwen3moe", "--fast", "-o", str(tmp_path / "x.gguf"), "--rule", "ffn_up_exps=MXFP4",
                       "--set", "expert_feed_forward_length=2048"]) == 2
    err = capsys.readouterr().err
    assert "MXFP4" in err and "Traceback" not in err
