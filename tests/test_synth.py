"""The synthetic model factory: names, shapes and keys as llama.cpp loads
them, determinism, independence of float weights from the quant mix,
overrides, MTP layouts, shards and the CLI."""
from __future__ import annotations

import time

import gguf
import numpy as np
import pytest

from fle_quant.errors import FleError
from fle_quant.ggml_types import GGMLType
from fle_quant.gguf_reader import GGUFModel
from fle_quant.synth import ARCHS, make_model, mtp_path
from fle_quant.synth.cli import main as synth_main
from fle_quant.synth.mix import choose_type, parse_mix

# ---------------------------------------------------------------------------
# What llama.cpp (llama-cpp-python 0.3.36) creates when it loads each
# architecture, computed from the file's own hyperparameters. Transcribed
# from load_arch_tensors / load_arch_hparams in src/models/qwen3moe.cpp,
# qwen3next.cpp and qwen4exp.cpp; names from src/llama-arch.cpp.
# Shapes are ggml order (ne0 first). Entries marked "reshape" are loaded with
# TENSOR_ALLOW_RESHAPE, so only their element count must match.

REQUIRED_KEYS = {
    # llama_model_base::load_hparams: context_length, embedding_length, block_count;
    # every arch: layer_norm_rms_epsilon; qwen3next/qwen4exp: the ssm.* keys;
    # qwen4exp: rope.dimension_sections, hyper_connection.*, attention.indexer.*
    "qwen3moe": ["context_length", "embedding_length", "block_count", "attention.layer_norm_rms_epsilon",
                 "attention.head_count", "expert_count", "expert_used_count"],
    "qwen3next": ["context_length", "embedding_length", "block_count", "attention.layer_norm_rms_epsilon",
                  "attention.head_count", "expert_count", "expert_used_count", "ssm.conv_kernel",
                  "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank", "ssm.group_count"],
    "qwen4exp": ["context_length", "embedding_length", "block_count", "attention.layer_norm_rms_epsilon",
                 "attention.head_count", "expert_count", "expert_used_count", "ssm.conv_kernel", "ssm.inner_size",
                 "ssm.state_size", "ssm.time_step_rank", "ssm.group_count", "rope.dimension_sections",
                 "hyper_connection.count", "hyper_connection.low_rank", "attention.indexer.head_count",
                 "attention.indexer.key_length", "attention.indexer.top_k"],
}


def expected_tensors(md: dict, n_vocab: int, n_layer: int) -> dict[str, tuple]:
    arch = md["general.architecture"]
    k = lambda name, default=None: md.get(f"{arch}.{name}", default)  # noqa: E731
    n_embd = k("embedding_length")
    n_head = k("attention.head_count")
    n_head_kv = k("attention.head_count_kv", n_head)
    hd = k("attention.key_length", n_embd // n_head)
    n_expert, n_ff_exp = k("expert_count"), k("expert_feed_forward_length")
    exp: dict[str, tuple] = {"token_embd.weight": (n_embd, n_vocab), "output.weight": (n_embd, n_vocab)}

    def moe(p):
        exp[p + "ffn_gate_inp.weight"] = (n_embd, n_expert)
        exp[p + "ffn_gate_exps.weight"] = (n_embd, n_ff_exp, n_expert)
        exp[p + "ffn_up_exps.weight"] = (n_embd, n_ff_exp, n_expert)
        exp[p + "ffn_down_exps.weight"] = (n_ff_exp, n_embd, n_expert)

    def shexp(p):
        n_ff_sh = k("expert_shared_feed_forward_length")
        exp[p + "ffn_gate_inp_shexp.weight"] = (n_embd,)
        exp[p + "ffn_gate_shexp.weight"] = (n_embd, n_ff_sh)
        exp[p + "ffn_up_shexp.weight"] = (n_embd, n_ff_sh)
        exp[p + "ffn_down_shexp.weight"] = (n_ff_sh, n_embd)

    def gated_attn(p):
        exp[p + "attn_q.weight"] = (n_embd, hd * n_head * 2)
        exp[p + "attn_k.weight"] = (n_embd, hd * n_head_kv)
        exp[p + "attn_v.weight"] = (n_embd, hd * n_head_kv)
        exp[p + "attn_output.weight"] = (hd * n_head, n_embd)
        exp[p + "attn_q_norm.weight"] = (hd,)
        exp[p + "attn_k_norm.weight"] = (hd,)

    if arch == "qwen3moe":
        exp["output_norm.weight"] = (n_embd,)
        for il in range(n_layer):
            p = f"blk.{il}."
            exp[p + "attn_norm.weight"] = (n_embd,)
            exp[p + "attn_q.weight"] = (n_embd, hd * n_head)
            exp[p + "attn_k.weight"] = (n_embd, hd * n_head_kv)
            exp[p + "attn_v.weight"] = (n_embd, hd * n_head_kv)
            exp[p + "attn_output.weight"] = (hd * n_head, n_embd)
            exp[p + "attn_k_norm.weight"] = (hd,)
            exp[p + "attn_q_norm.weight"] = (hd,)
            exp[p + "ffn_norm.weight"] = (n_embd,)
            moe(p)
        return exp

    head_k = k("ssm.state_size")
    n_k, n_v = k("ssm.group_count"), k("ssm.time_step_rank")
    key_dim, value_dim = head_k * n_k, head_k * n_v
    conv_dim = 2 * key_dim + value_dim
    interval = k("full_attention_interval", 4)
    recurrent = k("attention.recurrent_layers")
    is_recr = (lambda il: bool(recurrent[il])) if recurrent else (lambda il: (il + 1) % interval != 0)

    def gdn(p):
        exp[p + "attn_qkv.weight"] = (n_embd, conv_dim)
        exp[p + "attn_gate.weight"] = (n_embd, value_dim)
        exp[p + "ssm_conv1d.weight"] = (k("ssm.conv_kernel"), conv_dim)
        exp[p + "ssm_dt.bias"] = (n_v,)
        exp[p + "ssm_a"] = (n_v,)
        exp[p + "ssm_norm.weight"] = (head_k,)
        exp[p + "ssm_out.weight"] = (value_dim, n_embd)

    if arch == "qwen3next":
        exp["output_norm.weight"] = (n_embd,)
        for il in range(n_layer):
            p = f"blk.{il}."
            exp[p + "attn_norm.weight"] = (n_embd,)
            exp[p + "post_attention_norm.weight"] = (n_embd,)
            if is_recr(il):
                gdn(p)
                exp[p + "ssm_ba.weight"] = (n_embd, 2 * n_v)
            else:
                gated_attn(p)
            moe(p)
            shexp(p)
        return exp

    assert arch == "qwen4exp"
    hc, lr = k("hyper_connection.count"), k("hyper_connection.low_rank")
    hc_dim = hc * n_embd
    exp["output_hc_norm.weight"] = ("reshape", n_embd * hc)
    exp["output_hc_down.weight"] = (hc_dim, lr)
    exp["output_hc_up.weight"] = (lr, hc_dim)
    ple_layers = k("ple.layers") or []
    if ple_layers:
        offsets, sizes = k("ple.head_offsets"), k("ple.head_vocab_sizes")
        rows = max(o + v for o, v in zip(offsets, sizes))
        exp["per_layer_token_embd.weight"] = (k("embedding_length_per_layer_input"), rows)
    idx_dim, idx_h = k("attention.indexer.key_length"), k("attention.indexer.head_count")
    for il in range(n_layer):
        p = f"blk.{il}."
        for side in ("attn", "ffn"):
            exp[p + f"hc_{side}_norm.weight"] = ("reshape", n_embd * hc)
            exp[p + f"hc_{side}_down.weight"] = (hc_dim, lr)
            exp[p + f"hc_{side}_up.weight"] = (lr, hc_dim)
            exp[p + f"hc_{side}_inject.weight"] = (hc_dim, hc)
        if not is_recr(il):
            gated_attn(p)
            exp[p + "indexer.q_proj.weight"] = (n_embd, idx_h * idx_dim)
            exp[p + "indexer.k_proj.weight"] = (n_embd, idx_dim)
            exp[p + "indexer.q_norm.weight"] = (idx_dim,)
            exp[p + "indexer.k_norm.weight"] = (idx_dim,)
        else:
            gdn(p)
            exp[p + "ssm_beta.weight"] = (n_embd, n_v)
            exp[p + "ssm_alpha.weight"] = (n_embd, n_v)
        if il in ple_layers:
            exp[p + "ple_key.weight"] = (n_embd, hc_dim)
            exp[p + "ple_value.weight"] = (n_embd, n_embd)
            for n in ("key", "query", "conv"):
                exp[p + f"ple_norm_{n}.weight"] = ("reshape", n_embd * hc)
            exp[p + "ple_conv1d.weight"] = (k("ple.conv_kernel"), hc_dim)
        moe(p)
        shexp(p)
    return exp


def check_against_llama_layout(path, n_layer_trunk=None):
    with GGUFModel.open(path) as m:
        md = m.metadata
        arch = md["general.architecture"]
        for key in REQUIRED_KEYS[arch]:
            assert f"{arch}.{key}" in md, key
        n_vocab = len(md["tokenizer.ggml.tokens"])
        n_layer = md[f"{arch}.block_count"] - md.get(f"{arch}.nextn_predict_layers", 0)
        if n_layer_trunk is not None:
            assert n_layer == n_layer_trunk
        exp = expected_tensors(md, n_vocab, n_layer)
        got = {n: t.shape for n, t in m.tensors.items()}
        trunk = {n: s for n, s in got.items() if not n.startswith(f"blk.{n_layer}.")}
        assert sorted(trunk) == sorted(exp)
        for name, shape in exp.items():
            if shape[0] == "reshape":
                assert int(np.prod(got[name])) == shape[1], name
            else:
                assert got[name] == shape, name
        return md, got


def gguf_read(path):
    r = gguf.GGUFReader(path)
    return r, {t.name: t for t in r.tensors}


# ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mix", ["f32", "release"])
def test_builds_and_matches_llama_layout(tmp_path, arch, mix):
    t0 = time.perf_counter()
    try:
        path = make_model(tmp_path / f"{arch}.gguf", arch, mix=mix)
    except FleError as e:
        if mix == "release" and "quantize" in str(e):
            pytest.skip(f"quantizers for the release mix unavailable: {e}")
        raise
    elapsed = time.perf_counter() - t0
    print(f"\nmake_model({arch!r}, mix={mix!r}): {elapsed:.2f} s")
    md, got = check_against_llama_layout(path, n_layer_trunk=4)
    r, tensors = gguf_read(path)  # the reference reader agrees on names and shapes
    assert {n: tuple(int(d) for d in t.shape) for n, t in tensors.items()} == got
    assert md["tokenizer.ggml.model"] == "gpt2"
    assert len(md["tokenizer.ggml.tokens"]) == len(md["tokenizer.ggml.token_type"])
    types = {n: t.tensor_type for n, t in tensors.items()}
    for n, t in tensors.items():
        if len(t.shape) == 1:
            assert types[n] == gguf.GGMLQuantizationType.F32, n
    if mix == "f32":
        assert set(types.values()) == {gguf.GGMLQuantizationType.F32}
        assert md["general.file_type"] == 0
    else:
        assert types["blk.0.ffn_up_exps.weight"] == gguf.GGMLQuantizationType.IQ4_XS
        assert types["blk.1.ffn_up_exps.weight"] == gguf.GGMLQuantizationType.IQ3_S
        assert types["blk.1.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.IQ4_XS
        assert types["blk.0.ffn_gate_inp.weight"] == gguf.GGMLQuantizationType.F32
        assert types["output.weight"] == gguf.GGMLQuantizationType.Q6_K
        assert md["general.file_type"] == 30  # LLAMA_FTYPE_MOSTLY_IQ4_XS


def test_qwen4exp_metadata_is_consistent(tmp_path):
    path = make_model(tmp_path / "m.gguf", "qwen4exp")
    with GGUFModel.open(path) as m:
        md, types = m.metadata, m.metadata_types
    a = "qwen4exp."
    n_layer = md[a + "block_count"]
    rec = md[a + "attention.recurrent_layers"]
    assert len(rec) == n_layer and any(rec) and not all(rec)
    assert rec == [(il + 1) % md[a + "full_attention_interval"] != 0 for il in range(n_layer)]
    assert md[a + "attention.compress_ratios"] == [0 if r else 4 for r in rec]
    assert md[a + "attention.indexer.top_k"] < 64  # below typical test contexts: QSA really selects
    ple = md[a + "ple.layers"]
    assert len(ple) == 1 and rec[ple[0]]  # llama.cpp: one PLE layer, and a GDN one
    n_heads = (md[a + "ple.ngram_size"] - 1) * md[a + "ple.heads_per_ngram"]
    assert md[a + "embedding_length_per_layer_input"] * n_heads == md[a + "embedding_length"]
    sizes, offsets = md[a + "ple.head_vocab_sizes"], md[a + "ple.head_offsets"]
    assert len(sizes) == n_heads and offsets == [int(x) for x in np.cumsum([0] + sizes[:-1])]
    mult = md[a + "ple.layer_multipliers"]
    n_vocab = len(md["tokenizer.ggml.tokens"])
    assert len(mult) == md[a + "ple.ngram_size"] and all(m % 2 == 1 and m * n_vocab < 2 ** 63 for m in mult)
    assert md[a + "ple.eos_token_id"] == md["tokenizer.ggml.eos_token_id"]
    for key in ("ple.layer_multipliers", "ple.head_offsets", "ple.head_vocab_sizes"):
        assert types[a + key][1] == gguf.GGUFValueType.UINT64
    assert types[a + "attention.recurrent_layers"][1] == gguf.GGUFValueType.BOOL
    assert sum(md[a + "rope.dimension_sections"]) * 2 == md[a + "rope.dimension_count"]
    assert a + "nextn_predict_layers" not in md  # the trunk stays loadable by llama.cpp


def test_qwen4exp_without_ple(tmp_path):
    path = make_model(tmp_path / "m.gguf", "qwen4exp", ple_layers=[], mtp="none")
    md, got = check_against_llama_layout(path)
    assert not any(k.startswith("qwen4exp.ple.") for k in md)
    assert "per_layer_token_embd.weight" not in got


def test_stored_forms(tmp_path):
    """ssm_a holds -exp(A_log) (negative), gammas sit around 1."""
    path = make_model(tmp_path / "m.gguf", "qwen4exp", mtp="none")
    r, t = gguf_read(path)
    assert np.all(t["blk.0.ssm_a"].data < 0)
    for name in ("blk.0.hc_attn_norm.weight", "blk.1.ple_norm_key.weight", "blk.3.indexer.k_norm.weight",
                 "blk.0.ssm_norm.weight", "output_hc_norm.weight"):
        assert abs(float(np.mean(t[name].data)) - 1.0) < 0.05, name


@pytest.mark.parametrize("arch", ARCHS)
def test_same_seed_same_bytes(tmp_path, arch):
    a = make_model(tmp_path / "a.gguf", arch, seed=7, mix="q8_0", mtp="none")
    b = make_model(tmp_path / "b.gguf", arch, seed=7, mix="q8_0", mtp="none")
    c = make_model(tmp_path / "c.gguf", arch, seed=8, mix="q8_0", mtp="none")
    assert a.read_bytes() == b.read_bytes()
    _, ta = gguf_read(a)
    _, tc = gguf_read(c)
    assert not np.array_equal(ta["blk.0.ffn_up_exps.weight"].data, tc["blk.0.ffn_up_exps.weight"].data)


def test_float_weights_do_not_depend_on_the_mix(tmp_path):
    """Every tensor of a Q8_0 (or mixed) model is exactly the F32 model's
    floats, encoded: F32 tensors are equal, quantized ones equal the F32
    values quantized with gguf-py's reference quantizer."""
    f32 = make_model(tmp_path / "f32.gguf", "qwen4exp", seed=3)
    mixed = make_model(tmp_path / "mix.gguf", "qwen4exp", seed=3,
                       mix=[(r"blk\.(1|3)\.ffn_(gate|up|down)_exps", "Q8_0"), (r"attn_qkv", "F16"),
                            (r"^output\.", "Q8_0")])
    _, tf = gguf_read(f32)
    _, tm = gguf_read(mixed)
    assert tf.keys() == tm.keys()
    seen = set()
    for name, t in tm.items():
        src = np.asarray(tf[name].data)
        seen.add(t.tensor_type.name)
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            assert np.array_equal(np.asarray(t.data), src), name
        elif t.tensor_type == gguf.GGMLQuantizationType.F16:
            assert np.array_equal(np.asarray(t.data), src.astype(np.float16)), name
        else:
            want = gguf.quants.quantize(src.reshape(-1, src.shape[-1]), t.tensor_type)
            assert np.array_equal(np.asarray(t.data).reshape(want.shape), want), name
            back = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(src.shape)
            assert np.abs(back - src).max() <= np.abs(src).max() / 100, name
    assert seen == {"F32", "F16", "Q8_0"}
    # the mix reached the per-layer choice
    assert tm["blk.1.ffn_up_exps.weight"].tensor_type.name == "Q8_0"
    assert tm["blk.0.ffn_up_exps.weight"].tensor_type.name == "F32"
    # the MTP head is drawn from the same rule
    _, hf = gguf_read(mtp_path(f32))
    _, hm = gguf_read(mtp_path(mixed))
    for name in hf:
        if hm[name].tensor_type == gguf.GGMLQuantizationType.F32:
            assert np.array_equal(np.asarray(hm[name].data), np.asarray(hf[name].data)), name


def test_mix_rules():
    rules = parse_mix([(r"blk\.(1|3)\.ffn_(gate|up|down)_exps", "IQ3_S"), (r"_exps", "IQ4_XS"), (r".", "Q8_0")])
    assert choose_type("blk.1.ffn_up_exps.weight", (256, 256, 8), rules) == GGMLType.IQ3_S
    assert choose_type("blk.2.ffn_up_exps.weight", (256, 256, 8), rules) == GGMLType.IQ4_XS
    # row of 96: llama.cpp's fallback for a 256-block IQ type is IQ4_NL
    assert choose_type("blk.1.ffn_down_exps.weight", (96, 256, 8), rules) == GGMLType.IQ4_NL
    # row of 4 fits nothing: F32
    assert choose_type("blk.0.ssm_conv1d.weight", (4, 512), rules) == GGMLType.F32
    assert choose_type("blk.0.attn_norm.weight", (256,), rules) == GGMLType.F32
    assert choose_type("x", (256, 4), parse_mix("f32")) == GGMLType.F32
    assert choose_type("blk.0.ffn_gate_inp.weight", (256, 8), parse_mix("q8_0")) == GGMLType.F32
    with pytest.raises(FleError, match="unknown mix"):
        parse_mix("q9")
    with pytest.raises(FleError, match="regular expression"):
        parse_mix([("(", "Q8_0")])
    with pytest.raises(FleError, match="unknown quant type"):
        parse_mix([(".", "Q9_9")])


def test_overrides(tmp_path):
    path = make_model(tmp_path / "m.gguf", "qwen3next", block_count=6, expert_count=16, expert_used_count=4,
                      embedding_length=512, full_attention_interval=3, vocab_size=700)
    md, got = check_against_llama_layout(path, n_layer_trunk=6)
    assert md["qwen3next.expert_count"] == 16 and md["qwen3next.expert_used_count"] == 4
    assert got["blk.2.attn_q.weight"] == (512, 2 * 64 * 4)  # layer 2 is attention with interval 3
    assert got["blk.5.ffn_down_exps.weight"] == (256, 512, 16)
    assert len(md["tokenizer.ggml.tokens"]) == 700 and got["output.weight"] == (512, 700)

    path = make_model(tmp_path / "q.gguf", "qwen4exp", block_count=8, attention_indexer_top_k=8,
                      hyper_connection_count=2, ple_layers=[5], mtp="none")
    md, got = check_against_llama_layout(path, n_layer_trunk=8)
    assert md["qwen4exp.attention.indexer.top_k"] == 8
    assert "blk.5.ple_key.weight" in got and got["blk.5.ple_key.weight"] == (256, 512)


@pytest.mark.parametrize("kwargs,match", [
    ({"expert_cnt": 4}, "no setting 'expert_cnt'"),
    ({"expert_used_count": 9}, "expert_used_count"),
    ({"block_count": "x"}, "cannot read"),
    ({"ple_layers": [3]}, "GDN layer"),
    ({"full_attention_interval": 9}, "at least one full-attention"),
    ({"mtp": "both"}, "mtp must be"),
    ({"dead_experts": 7}, "live experts"),
    ({"dead_experts": [8]}, "0..7"),
    ({"vocab": "/nonexistent.gguf"}, "no such file"),
])
def test_bad_input_is_a_fle_error(tmp_path, kwargs, match):
    with pytest.raises(FleError, match=match):
        make_model(tmp_path / "m.gguf", "qwen4exp", **kwargs)


def test_unknown_arch_and_no_mtp(tmp_path):
    with pytest.raises(FleError, match="unknown architecture"):
        make_model(tmp_path / "m.gguf", "llama")
    with pytest.raises(FleError, match="no MTP head"):
        make_model(tmp_path / "m.gguf", "qwen3moe", mtp="separate")


def test_mtp_layouts(tmp_path):
    n = 4
    trunk = make_model(tmp_path / "t.gguf", "qwen4exp")  # default: separate
    head = mtp_path(trunk)
    assert head.name == "t-mtp.gguf" and head.exists()
    with GGUFModel.open(trunk) as m:
        assert m.metadata["qwen4exp.block_count"] == n
        assert not any(x.startswith(f"blk.{n}.") for x in m.tensors)
    with GGUFModel.open(head) as h:
        md = h.metadata
        assert md["general.architecture"] == "qwen4exp"
        assert md["qwen4exp.block_count"] == n + 1 and md["qwen4exp.nextn_predict_layers"] == 1
        assert md["qwen4exp.attention.compress_ratios"][-1] == 0
        assert md["qwen4exp.attention.recurrent_layers"][-1] is False
        names = set(h.tensors)
        assert all(x.startswith(f"blk.{n}.") for x in names)
        p = f"blk.{n}."
        e, hc_dim = 256, 4 * 256
        assert h.tensors[p + "nextn.eh_proj.weight"].shape == (2 * e, e)
        assert h.tensors[p + "nextn.enorm.weight"].shape == (e,)
        assert h.tensors[p + "nextn.hnorm.weight"].shape == (hc_dim,)
        for x in ("attn_q", "attn_k", "attn_v", "attn_output", "indexer.q_proj", "indexer.k_proj",
                  "hc_attn_inject", "hc_ffn_inject", "ffn_gate_exps", "ffn_down_shexp",
                  "nextn.hc_head_norm", "nextn.hc_head_down", "nextn.hc_head_up"):
            assert p + x + ".weight" in names, x

    inside = make_model(tmp_path / "i.gguf", "qwen4exp", mtp="inside")
    assert not mtp_path(inside).exists()
    with GGUFModel.open(inside) as m, GGUFModel.open(head) as h:
        assert m.metadata["qwen4exp.block_count"] == n + 1
        assert set(h.tensors) <= set(m.tensors)
    none = make_model(tmp_path / "n.gguf", "qwen4exp", mtp="none")
    assert not mtp_path(none).exists()

    nxt = make_model(tmp_path / "x.gguf", "qwen3next", mtp="separate")
    with GGUFModel.open(mtp_path(nxt)) as h:
        # the converter's MTP-only export keeps the embedding and the head
        assert {"token_embd.weight", "output_norm.weight", "output.weight"} <= set(h.tensors)
        assert h.metadata["qwen3next.block_count"] == n + 1
        assert h.tensors[f"blk.{n}.nextn.eh_proj.weight"].shape == (512, 256)


def test_sharded(tmp_path):
    first = make_model(tmp_path / "s.gguf", "qwen3moe", split_max_tensors=20)
    assert first.name == "s-00001-of-00003.gguf"
    whole = make_model(tmp_path / "w.gguf", "qwen3moe")
    with GGUFModel.open(tmp_path / "s-00002-of-00003.gguf") as s, GGUFModel.open(whole) as w:
        assert len(s.paths) == 3
        assert {n: t.shape for n, t in s.tensors.items()} == {n: t.shape for n, t in w.tensors.items()}
        for name in s.tensors:
            assert np.array_equal(s.tensor_bytes(name), w.tensor_bytes(name)), name


def test_router_knobs(tmp_path):
    """Dead experts lose to every live one on every token embedding by a wide
    margin; a routing skew makes some experts far more popular."""
    def top_counts(path, **_):
        _, t = gguf_read(path)
        e = np.asarray(t["token_embd.weight"].data, dtype=np.float32)
        x = e / np.sqrt((e * e).mean(axis=1, keepdims=True))
        w = np.asarray(t["blk.0.ffn_gate_inp.weight"].data)
        logits = x @ w.T
        return logits, np.bincount(np.argsort(-logits, axis=1)[:, :2].ravel(), minlength=w.shape[0])

    dead = make_model(tmp_path / "d.gguf", "qwen3moe", dead_experts=[1, 6])
    logits, counts = top_counts(dead)
    assert counts[1] == counts[6] == 0
    live = np.delete(logits, [1, 6], axis=1)
    assert (live.min(axis=1) - np.maximum(logits[:, 1], logits[:, 6])).min() > 10

    _, flat = top_counts(make_model(tmp_path / "u.gguf", "qwen3moe", routing_skew=0.0))
    _, skew = top_counts(make_model(tmp_path / "k.gguf", "qwen3moe", routing_skew=3.0))
    assert skew.max() / max(skew.min(), 1) > 5 * flat.max() / max(flat.min(), 1)
    # knobs touch routers only
    _, a = gguf_read(tmp_path / "u.gguf")
    _, b = gguf_read(tmp_path / "k.gguf")
    assert np.array_equal(a["blk.0.ffn_up_exps.weight"].data, b["blk.0.ffn_up_exps.weight"].data)

    counted = make_model(tmp_path / "c.gguf", "qwen3moe", dead_experts=3)
    _, c = top_counts(counted)
    assert (c == 0).sum() >= 3


def test_vocab_from_gguf(tmp_path, llama_models):
    vocab = llama_models / "ggml-vocab-qwen2.gguf"
    path = make_model(tmp_path / "v.gguf", "qwen3moe", vocab=vocab, block_count=1, expert_count=4,
                      embedding_length=128)
    with GGUFModel.open(path) as m, GGUFModel.open(vocab) as src:
        n = len(m.metadata["tokenizer.ggml.tokens"])
        assert n == len(src.metadata["tokenizer.ggml.tokens"])
        assert m.tensors["output.weight"].shape == (128, n)
        for key, value in src.metadata.items():
            if key.startswith("tokenizer."):
                assert m.metadata[key] == value, key
                assert m.metadata_types[key] == src.metadata_types[key], key


def test_cli(tmp_path, capsys):
    out = tmp_path / "c.gguf"
    assert synth_main(["qwen3moe", "-o", str(out), "--set", "block_count=2", "--set", "expert.count=4",
                       "--seed", "5", "--dead-experts", "1"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    with GGUFModel.open(out) as m:
        assert m.metadata["qwen3moe.block_count"] == 2 and m.metadata["qwen3moe.expert_count"] == 4
    # exists, no --force: one line on stderr, status 2
    assert synth_main(["qwen3moe", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists" in err
    assert synth_main(["qwen3moe", "-o", str(out), "--set", "nope=1", "--force"]) == 2
    assert "nope" in capsys.readouterr().err
    assert synth_main(["qwen4exp", "-o", str(tmp_path / "s.gguf"), "--split-max-size", "2M",
                       "--mtp", "none"]) == 0
    shards = sorted(tmp_path.glob("s-*-of-*.gguf"))
    assert len(shards) > 1 and capsys.readouterr().out.strip() == str(shards[0])


def test_cli_rule_writes_donor_with_same_floats(tmp_path, capsys):
    from fle_quant.synth.cli import main as synth_main

    base = tmp_path / "base.gguf"
    donor = tmp_path / "donor.gguf"
    assert synth_main(["qwen3moe", "-o", str(base), "--mix", "q8_0"]) == 0
    assert synth_main(["qwen3moe", "-o", str(donor), "--mix", "q8_0", "--rule", r"blk\.1\.ffn_(gate|up|down)_exps=Q4_0"]) == 0
    with GGUFModel.open(base) as b, GGUFModel.open(donor) as d:
        for name, t in d.tensors.items():
            if name.startswith("blk.1.ffn_") and "_exps" in name:
                assert t.qtype.name == "Q4_0", name
            else:
                assert t.qtype == b.tensors[name].qtype, name
                assert np.array_equal(d.tensor_bytes(name), b.tensor_bytes(name)), name
    capsys.readouterr()
    assert synth_main(["qwen3moe", "-o", str(tmp_path / "x.gguf"), "--rule", "no-type-here"]) == 2
    assert synth_main(["qwen3moe", "-o", str(tmp_path / "x.gguf"), "--rule", "ffn=NOTATYPE"]) == 2
    err = capsys.readouterr().err
    assert "NOTATYPE" in err and "Traceback" not in err
    assert not (tmp_path / "x.gguf").exists()
