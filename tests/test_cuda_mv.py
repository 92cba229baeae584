"""The CUDA C one-token kernels (fle_engine.kernels.cuda_mv) against the
references: the routed IQ4_XS experts (slots, misses from page-locked host
memory, the CPU's share skipped, the rounded activations of misses) and
Q8_0 dense products, at every rows-per-warp shape. On a machine without
CUDA only the source's compilation (nvcc, when present) and the fallback
are checked; the engine's own tests run these kernels on CUDA too."""
from __future__ import annotations

import shutil
import subprocess

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fle_engine.kernels import cuda_mv, engine_ops, reference  # noqa: E402
from fle_engine.kernels.ptx_decode import BOOK_WORDS  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.ggml_types import GGMLType  # noqa: E402
from fle_quant.quants import quantize  # noqa: E402

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@pytest.fixture(autouse=True)
def _on(monkeypatch):
    """The kernels on, whatever the default (a test may turn them off); launch settings from
    the test alone."""
    monkeypatch.setenv("FLE_CUDA_MV", "1")
    for name in ("FLE_CUDA_MV_CONFIG", "FLE_CUDA_MV_PRE", "FLE_PDL", "FLE_CUDA_MV_DENSE_T", "FLE_CUDA_MV_FFN",
                 "FLE_CUDA_MV_UNION"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("name,value", [("FLE_CUDA_MV_CONFIG", "2,4"), ("FLE_CUDA_MV_CONFIG", "a,b,c,d"),
                                        ("FLE_CUDA_MV_PRE", "1,1"), ("FLE_CUDA_MV_PRE", "1,-1,0")])
def test_malformed_tuning_variables_are_named(name, value, monkeypatch):
    from fle_quant.errors import FleError

    monkeypatch.setenv(name, value)
    with pytest.raises(FleError, match=name):
        cuda_mv._env_config() if name == "FLE_CUDA_MV_CONFIG" else cuda_mv._env_pre()
    monkeypatch.setenv(name, "2,4,4,4" if name == "FLE_CUDA_MV_CONFIG" else "2,1,2")
    assert (cuda_mv._env_config() if name == "FLE_CUDA_MV_CONFIG" else cuda_mv._env_pre()) is not None


@pytest.mark.parametrize("value", ["5", "0", "2,2", "x"])
def test_dense_rows_variable_is_checked(value, monkeypatch):
    from fle_quant.errors import FleError

    assert cuda_mv.dense_t_max() == cuda_mv.DENSE_T_MAX
    monkeypatch.setenv("FLE_CUDA_MV_DENSE_T", value)
    with pytest.raises(FleError, match="FLE_CUDA_MV_DENSE_T"):
        cuda_mv.dense_t_max()
    monkeypatch.setenv("FLE_CUDA_MV_DENSE_T", "3")
    assert cuda_mv.dense_t_max() == 3


def test_pre_variant_choice():
    """The compiled variant for the iterations asked: never more than a row has, rounded up to
    one that exists."""
    have = (0, 1, 2, 4)
    assert cuda_mv._pre_kernel(0, 5, have) == 0
    assert cuda_mv._pre_kernel(2, 1, have) == 1
    assert cuda_mv._pre_kernel(3, 5, have) == 4
    assert cuda_mv._pre_kernel(4, 2, have) == 2
    assert cuda_mv._pre_kernel(8, 9, have) == 4
    assert cuda_mv._pre_kernel(2, 3, (0, 1, 2)) == 2


@pytest.mark.parametrize("ffn", [False, True])
def test_source_compiles(ffn, tmp_path):
    """Both modules of the source: the products, and the fused gate+up+down kernels alone."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc here (the engine compiles the source with NVRTC on the GPU machine)")
    src = tmp_path / "k.cu"
    src.write_text("".join(f"#define KV{i} 0x{w:08X}u\n" for i, w in enumerate(BOOK_WORDS))
                   + ("#define FLE_ONLY_FFN 1\n" if ffn else "") + cuda_mv.SOURCE.read_text())
    out = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-o", str(tmp_path / "k.cubin"), str(src)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    names = (tmp_path / "k.cubin").read_bytes()           # the ELF's string table holds the kernels' names
    assert (b"iq4xs_ffn_2_4_p1" in names) == ffn and (b"q8_0_mv_2_p0" in names) != ffn
    assert (b"iq4xs_ugu_2" in names) != ffn and (b"iq4xs_udn_8" in names) != ffn
    assert (b"q8_0_ms_2_t3" in names) != ffn and (b"q8_0_mv_2_p0_t3" in names) != ffn


def test_off_without_cuda_or_when_asked(monkeypatch):
    monkeypatch.setenv("FLE_CUDA_MV", "0")
    assert not cuda_mv.enabled()
    w = torch.zeros(4, 68, dtype=torch.uint8)
    assert not cuda_mv.dense_supported(w, GGMLType.Q8_0, torch.zeros(1, 64), torch.zeros(1, 4))
    monkeypatch.setenv("FLE_CUDA_MV", "1")
    assert cuda_mv.enabled() == CUDA
    monkeypatch.delenv("FLE_CUDA_MV")
    assert cuda_mv.enabled() == (CUDA and cuda_mv.DEFAULT == "1")


@gpu
def test_hit_mode_left_to_triton(monkeypatch):
    """A layer whose experts are all in their slots runs Triton's kernel (measured faster there)
    unless a launch shape is forced for tuning; the miss mode takes the CUDA C kernel."""
    monkeypatch.delenv("FLE_CUDA_MV_CONFIG", raising=False)
    words = torch.zeros(1024, dtype=torch.int32, device="cuda")
    x, out = torch.zeros(1, 256, device="cuda"), torch.zeros(1, 8, device="cuda")
    args = (words, GGMLType.IQ4_XS, x, out, None, 1088, 544)
    assert cuda_mv.experts_supported(*args, mode="miss") == (cuda_mv.EXPERT_CONFIG["miss"] is not None)
    assert cuda_mv.experts_supported(*args, mode="hit") == (cuda_mv.EXPERT_CONFIG["hit"] is not None)
    monkeypatch.setenv("FLE_CUDA_MV_CONFIG", "2,4,4,4")
    assert cuda_mv.experts_supported(*args, mode="hit")


def _close(a, b, tol=2e-5):
    scale = float(b.abs().max()) or 1.0
    assert float((a - b).abs().max()) <= tol * scale, float((a - b).abs().max()) / scale


def _experts_setup(share: int, rounded: bool, n_embd: int = 512, seed: int = 5):
    """A layer's routed experts (7 experts, 3 of them in slots, 3 tokens of 3 each, some missed) with
    the reference's h and y, and the same on CUDA (misses from page-locked host memory)."""
    qtype = GGMLType.IQ4_XS
    rng_w, rng = np.random.default_rng(5), np.random.default_rng(seed)     # seed: routing and activations
    n_exp, n_ff, n_used, T = 7, 40, 3, 3          # 40 rows: warps with rows past the end
    rb_gu, rb_d = n_embd // 256 * 136, 256 // 256 * 136       # down: 256 inputs (n_ff padded as the engine pads)
    gu = quantize(rng_w.standard_normal((n_exp * 2 * n_ff, n_embd)).astype(np.float32) * 0.1, qtype)
    dn = quantize(rng_w.standard_normal((n_exp * n_embd, 256)).astype(np.float32) * 0.1, qtype)
    d_off = 2 * n_ff * rb_gu
    eb = d_off + n_embd * rb_d
    host = torch.zeros(n_exp, eb, dtype=torch.uint8)
    host[:, :d_off] = torch.from_numpy(gu.reshape(n_exp, -1))
    host[:, d_off:] = torch.from_numpy(dn.reshape(n_exp, -1))
    slots = torch.zeros(3, eb, dtype=torch.uint8)
    slot_of = torch.full((n_exp,), -1, dtype=torch.int32)
    for s, e in enumerate((4, 1, 6)):
        slots[s] = host[e]
        slot_of[e] = s
    ids = torch.from_numpy(np.concatenate([rng.permutation(n_exp)[:n_used] for _ in range(T)]))
    ids[:4] = torch.tensor([1, 2, 4, 0])          # every token has misses; the first has a hit among them
    R = ids.numel()
    x = torch.from_numpy(rng.standard_normal((T, n_embd)).astype(np.float32) * 0.5)
    x_miss = (x * 64).round() / 64 if rounded else None
    wts = torch.from_numpy(rng.random(R).astype(np.float32))
    st = engine_ops.ExpertWords(slots, host, 4)
    ref_h = torch.zeros(R, n_ff)
    engine_ops.experts_ref(st, qtype, 0, 0, 0, n_ff, rb_gu, slot_of, ids, x, ref_h, True, n_used, cpu_share=share,
                           x_miss=x_miss)
    h_in = torch.nn.functional.pad(ref_h, (0, 256 - n_ff))
    ref_y = torch.zeros(R, n_embd)
    engine_ops.experts_ref(st, qtype, 0, d_off // 4, 0, n_embd, rb_d, slot_of, ids, h_in, ref_y, False, n_used, wts,
                           cpu_share=share)
    # misses read over PCIe from page-locked host memory, addressed from the slot buffer's pointer
    pinned = host.pin_memory()
    dev_slots = slots.cuda()
    words = dev_slots.view(-1).view(torch.int32)
    xs = torch.zeros(2, T, n_embd, device="cuda")        # x and its rounded copy, one buffer (aligned rows)
    xs[0] = x.cuda()
    if rounded:
        xs[1] = x_miss.cuda()
    keep = [r for r in range(R) if ref_y[r].any()]
    assert len(keep) < R if share else len(keep) == R
    return SimpleNamespace(
        qtype=qtype, n_ff=n_ff, n_embd=n_embd, n_used=n_used, R=R, rb_gu=rb_gu, rb_d=rb_d, d_off=d_off, eb=eb,
        pinned=pinned, dev_slots=dev_slots, words=words, delta=(pinned.data_ptr() - words.data_ptr()) // 4,
        smap=slot_of.cuda(), ids=ids.cuda(), x=xs[0], x_miss=xs[1] if rounded else None, xs=xs, wts=wts.cuda(),
        h_in=h_in.cuda().contiguous(), ref_h=ref_h, ref_y=ref_y, keep=keep, share=share)


def _experts_case(share: int, rounded: bool, n_embd: int = 512):
    c = _experts_setup(share, rounded, n_embd)
    h = torch.full((c.R, c.n_ff), 7.0, device="cuda")
    assert cuda_mv.experts_supported(c.words, c.qtype, c.x, h, c.x_miss, c.eb, 0)
    cuda_mv.experts(c.words, c.qtype, c.delta, 0, c.eb // 4, c.n_ff, c.rb_gu, c.smap, c.ids, c.x, h, True,
                    c.n_used, cpu_share=share, x_miss=c.x_miss)
    y = torch.full((c.R, c.n_embd), 7.0, device="cuda")
    cuda_mv.experts(c.words, c.qtype, c.delta, c.d_off // 4, c.eb // 4, c.n_embd, c.rb_d, c.smap, c.ids, c.h_in, y,
                    False, c.n_used, c.wts, cpu_share=share)
    torch.cuda.synchronize()
    _close(h.cpu()[c.keep], c.ref_h[c.keep])
    _close(y.cpu(), c.ref_y)


def _ffn(c, h, y):
    cuda_mv.experts_ffn(c.words, c.qtype, c.delta, c.d_off // 4, c.eb // 4, c.n_ff, c.n_embd, c.rb_gu, c.rb_d,
                        c.smap, c.ids, c.x, h, y, c.n_used, c.wts, cpu_share=c.share, x_miss=c.x_miss)


def _ffn_buffers(c):
    h = torch.zeros(c.R, 256, device="cuda")           # padded to the down rows' 256 inputs, as the engine's
    return h, torch.full((c.R, c.n_embd), 7.0, device="cuda")


def _ffn_check(c, h, y):
    _close(h[:, :c.n_ff].cpu()[c.keep], c.ref_h[c.keep])
    assert not h[:, c.n_ff:].any()
    _close(y.cpu(), c.ref_y)


@gpu
@pytest.mark.parametrize("config", ["1,4,1,4", "2,4,4,4", "4,2,8,1", "1,1,2,2"])
@pytest.mark.parametrize("share,rounded", [(0, False), (128, False), (0, True)])
def test_experts_against_reference(config, share, rounded, monkeypatch):
    monkeypatch.setenv("FLE_CUDA_MV_CONFIG", config)
    _experts_case(share, rounded)


@gpu
@pytest.mark.parametrize("pre", ["0,0,0", "1,1,0", "2,2,0"])
@pytest.mark.parametrize("pdl", ["0", "1"])
@pytest.mark.parametrize("share,rounded", [(0, False), (128, True)])
def test_experts_loads_first_and_pdl(pre, pdl, share, rounded, monkeypatch):
    """Rows of 72 sub-blocks (three iterations: loaded first, then the loop), with and without
    programmatic dependent launch."""
    monkeypatch.setenv("FLE_CUDA_MV_CONFIG", "2,4,4,4")
    monkeypatch.setenv("FLE_CUDA_MV_PRE", pre)
    monkeypatch.setenv("FLE_PDL", pdl)
    _experts_case(share, rounded, n_embd=2304)


@gpu
@pytest.mark.parametrize("config", ["2,4,4,0", "2,8,4,1", "4,8,2,2", "4,8,1,0", "2,4,8,2"])
@pytest.mark.parametrize("share,rounded", [(0, False), (128, False), (0, True), (256, False)])
def test_fused_experts_against_reference(config, share, rounded, monkeypatch):
    """Gate+up and down in one launch (the down part's warps wait for their row's gate+up blocks)
    equal the references, with misses, the CPU's share and rounded activations of misses; launched
    three times in a row, so the counters are back at zero after each launch."""
    monkeypatch.setenv("FLE_CUDA_MV_FFN", config)
    monkeypatch.setenv("FLE_PDL", "0")
    c = _experts_setup(share, rounded, n_embd=2304)
    h, y = _ffn_buffers(c)
    assert cuda_mv.ffn_supported(c.words, c.qtype, c.x, h, y, c.x_miss, c.eb, c.d_off, c.R)
    for _ in range(3):
        h.zero_()
        y.fill_(7.0)
        _ffn(c, h, y)
        torch.cuda.synchronize()
        _ffn_check(c, h, y)
    assert not cuda_mv._module(ffn=True).sync.any()


@gpu
@pytest.mark.parametrize("pdl", ["0", "1"])
def test_fused_experts_in_a_graph(pdl, monkeypatch):
    """The fused launch captured in a CUDA graph between other kernels and replayed on new
    activations, routed ids and slot maps, with and without programmatic dependent launch."""
    monkeypatch.setenv("FLE_CUDA_MV_FFN", "2,4,4,1")
    monkeypatch.setenv("FLE_PDL", pdl)
    c = _experts_setup(0, False, n_embd=2304)
    h, y = _ffn_buffers(c)
    out = torch.zeros(c.n_embd, device="cuda")
    _ffn(c, h, y)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        c.x.mul_(1.0)
        _ffn(c, h, y)
        out.copy_(y.sum(0))
    for seed in (6, 7, 8):
        d = _experts_setup(0, False, n_embd=2304, seed=seed)     # the same expert bytes, new routing and x
        c.x.copy_(d.x)
        c.ids.copy_(d.ids)
        c.wts.copy_(d.wts)
        g.replay()
        torch.cuda.synchronize()
        _close(y.cpu(), d.ref_y)
        _close(out.cpu(), d.ref_y.sum(0), tol=1e-4)
    assert not cuda_mv._module(ffn=True).sync.any()


@gpu
@pytest.mark.parametrize("ffn", ["2,8,4,1", "0"])
def test_ops_table_takes_the_fused_launch(ffn, monkeypatch):
    """The fast side's experts_ffn launches once when FLE_CUDA_MV_FFN gives a shape and twice
    otherwise, with the reference's result either way."""
    monkeypatch.setenv("FLE_CUDA_MV_FFN", ffn)
    c = _experts_setup(128, True, n_embd=2304)
    h, y = _ffn_buffers(c)
    launches = []
    real = cuda_mv._Module.launch
    monkeypatch.setattr(cuda_mv._Module, "launch", lambda self, name, *a: (launches.append(name), real(self, name, *a)))
    gate_up = (c.words, c.qtype, c.delta, 0, c.eb // 4, c.n_ff, c.rb_gu)
    down = (c.words, c.qtype, c.delta, c.d_off // 4, c.eb // 4, c.n_embd, c.rb_d)
    engine_ops._experts_ffn_fast(gate_up, down, c.smap, c.ids, c.x, h, y, c.n_used, c.wts, cpu_share=c.share,
                                 x_miss=c.x_miss)
    torch.cuda.synchronize()
    _ffn_check(c, h, y)
    assert [n.split("_")[1] for n in launches] == (["ffn"] if ffn != "0" else ["gu", "dn"])


@pytest.mark.parametrize("value", ["3", "2,4", "4,4,4,0", "2,4,4,5", "2,4,9,0", "x"])
def test_fused_variable_is_checked(value, monkeypatch):
    from fle_quant.errors import FleError

    monkeypatch.setenv("FLE_CUDA_MV_FFN", value)
    with pytest.raises(FleError, match="FLE_CUDA_MV_FFN"):
        cuda_mv.ffn_config()
    monkeypatch.setenv("FLE_CUDA_MV_FFN", "0")
    assert cuda_mv.ffn_config() is None
    monkeypatch.delenv("FLE_CUDA_MV_FFN")
    assert cuda_mv.ffn_config() == cuda_mv.FFN_CONFIG["miss"]


@gpu
@pytest.mark.parametrize("kind", ["word", "stage"])
@pytest.mark.parametrize("rows,warps", [(1, 4), (2, 4), (4, 2), (2, 1)])
@pytest.mark.parametrize("n_out,n_in", [(37, 256), (130, 2048), (9, 64)])
def test_dense_q8_0_against_reference(kind, rows, warps, n_out, n_in, monkeypatch):
    """Both Q8_0 kernels (64 inputs: 2 blocks, not a multiple of 8, so the staged one's rows go to
    the one-block-per-lane kernel)."""
    monkeypatch.setenv("FLE_CUDA_MV_DENSE", kind)
    monkeypatch.setenv("FLE_CUDA_MV_CONFIG", f"1,4,1,4,{rows},{warps}")
    _dense_case(n_out, n_in)


def _dense_case(n_out, n_in, n_tok=1, pad=0):
    """T = n_tok activation rows; ``pad`` extra floats between rows of x and of out (strided rows)."""
    rng = np.random.default_rng(n_out)
    w = torch.from_numpy(quantize(rng.standard_normal((n_out, n_in)).astype(np.float32), GGMLType.Q8_0)).cuda()
    x = torch.randn(n_tok, n_in + pad, device="cuda")[:, :n_in]
    out = torch.full((n_tok, n_out + pad), 7.0, device="cuda")
    assert cuda_mv.dense_supported(w, GGMLType.Q8_0, x, out[:, :n_out])
    cuda_mv.dense(w, GGMLType.Q8_0, x, out[:, :n_out])
    _close(out[:, :n_out].cpu(), reference.mul_mat(w.cpu(), GGMLType.Q8_0, x.cpu()))
    assert bool((out[:, n_out:] == 7.0).all())             # nothing written between the rows


@gpu
@pytest.mark.parametrize("n_tok", [2, 3, 4])
@pytest.mark.parametrize("rows,warps", [(1, 4), (2, 2), (4, 2)])
@pytest.mark.parametrize("n_out,n_in,pad", [(37, 256, 0), (130, 2048, 4), (9, 4160, 8)])
def test_dense_several_rows_against_reference(n_tok, rows, warps, n_out, n_in, pad, monkeypatch):
    """Dense products of 2..4 activation rows in one launch (each weight block read once), rows
    contiguous or strided: the one-block-per-lane kernel (the staged one's test is below)."""
    monkeypatch.setenv("FLE_CUDA_MV_DENSE", "word")
    monkeypatch.setenv("FLE_CUDA_MV_DENSE_T", "4")
    monkeypatch.setenv("FLE_CUDA_MV_CONFIG", f"1,4,1,4,{rows},{warps}")
    _dense_case(n_out, n_in, n_tok, pad)


@gpu
@pytest.mark.parametrize("n_tok", [1, 2, 3, 4])
@pytest.mark.parametrize("rows,warps", [(1, 4), (2, 2), (2, 4), (4, 2)])
@pytest.mark.parametrize("n_out,n_in,pad", [(37, 256, 0), (130, 2048, 4), (9, 8192, 8), (5, 4352, 0)])
def test_dense_staged_against_reference(n_tok, rows, warps, n_out, n_in, pad, monkeypatch):
    """The kernel that stages rows through shared memory: rows of one chunk, of two (8192 inputs:
    256 blocks) and of a full chunk and a partial one (4352: 128 + 8 blocks), output rows that do
    not fill the last warp, 1..4 activation rows, contiguous or strided."""
    monkeypatch.setenv("FLE_CUDA_MV_DENSE", "stage")
    monkeypatch.setenv("FLE_CUDA_MV_DENSE_T", "4")
    monkeypatch.setenv("FLE_CUDA_MV_CONFIG", f"1,4,1,4,{rows},{warps}")
    _dense_case(n_out, n_in, n_tok, pad)


@gpu
def test_dense_staged_where_it_applies(monkeypatch):
    """Rows whose block count is not a multiple of 8, or a matrix not 16-byte aligned, take the
    one-block-per-lane kernel (test_captured_in_a_graph runs the staged one in a graph)."""
    monkeypatch.setenv("FLE_CUDA_MV_DENSE", "stage")
    w = torch.zeros(4, 2176, dtype=torch.uint8, device="cuda")
    assert cuda_mv.dense_staged(w)
    odd = torch.zeros(4, 130 * 34, dtype=torch.uint8, device="cuda")
    assert not cuda_mv.dense_staged(odd)
    buf = torch.zeros(4 * 2176 + 4, dtype=torch.uint8, device="cuda")
    assert not cuda_mv.dense_staged(buf[4:].view(4, 2176))
    monkeypatch.setenv("FLE_CUDA_MV_DENSE", "word")
    assert not cuda_mv.dense_staged(w)


def test_dense_kernel_variable_is_checked(monkeypatch):
    monkeypatch.setenv("FLE_CUDA_MV_DENSE", "tiles")
    with pytest.raises(FleError, match="FLE_CUDA_MV_DENSE='tiles'"):
        cuda_mv.dense_staged(torch.zeros(4, 272, dtype=torch.uint8))


def test_several_rows_up_to_the_measured_limit(monkeypatch):
    """Products of up to DENSE_T_MAX activation rows take the CUDA C kernel (measured faster than
    Triton's for 2..4 rows), more rows Triton's; FLE_CUDA_MV_DENSE_T=1 leaves every T > 1 to Triton."""
    dev = "cuda" if CUDA else "cpu"
    w = torch.zeros(4, 68, dtype=torch.uint8, device=dev)
    assert cuda_mv.DENSE_T_MAX == 4
    for t in (2, 4, 5):
        x, out = torch.zeros(t, 64, device=dev), torch.zeros(t, 4, device=dev)
        assert cuda_mv.dense_supported(w, GGMLType.Q8_0, x, out) == (CUDA and t <= 4)
    monkeypatch.setenv("FLE_CUDA_MV_DENSE_T", "1")
    x, out = torch.zeros(2, 64, device=dev), torch.zeros(2, 4, device=dev)
    assert not cuda_mv.dense_supported(w, GGMLType.Q8_0, x, out)


@gpu
@pytest.mark.parametrize("pre", [0, 1, 2, 4])
@pytest.mark.parametrize("pdl", ["0", "1"])
@pytest.mark.parametrize("n_out,n_in", [(37, 4160), (130, 2048)])
def test_dense_loads_first_and_pdl(pre, pdl, n_out, n_in, monkeypatch):
    monkeypatch.setenv("FLE_CUDA_MV_DENSE", "word" if pre else "stage")     # loads first: the word kernel's
    monkeypatch.setenv("FLE_CUDA_MV_CONFIG", "1,4,1,4,2,2")
    monkeypatch.setenv("FLE_CUDA_MV_PRE", f"0,0,{pre}")
    monkeypatch.setenv("FLE_PDL", pdl)
    _dense_case(n_out, n_in)


@gpu
def test_pdl_chain_in_a_graph(monkeypatch):
    """Each kernel reads what the one before it wrote, launched with programmatic dependent
    launch and loading its weights first: a dense product feeding a dense product feeding the
    experts (gate+up, then down), captured and replayed on new inputs, equals the references."""
    monkeypatch.setenv("FLE_PDL", "1")
    monkeypatch.setenv("FLE_CUDA_MV_CONFIG", "2,4,4,4,2,2")
    monkeypatch.setenv("FLE_CUDA_MV_PRE", "2,1,2")
    qtype = GGMLType.IQ4_XS
    rng = np.random.default_rng(3)
    n_in, n_embd, n_ff, n_exp, k = 1024, 512, 256, 4, 2
    wa = torch.from_numpy(quantize(rng.standard_normal((4096, n_in)).astype(np.float32) * 0.05, GGMLType.Q8_0))
    wb = torch.from_numpy(quantize(rng.standard_normal((n_embd, 4096)).astype(np.float32) * 0.05, GGMLType.Q8_0))
    rb_gu, rb_d = n_embd // 256 * 136, n_ff // 256 * 136
    gu = quantize(rng.standard_normal((n_exp * 2 * n_ff, n_embd)).astype(np.float32) * 0.1, qtype)
    dn = quantize(rng.standard_normal((n_exp * n_embd, n_ff)).astype(np.float32) * 0.1, qtype)
    d_off = 2 * n_ff * rb_gu
    eb = d_off + n_embd * rb_d
    host = torch.zeros(n_exp, eb, dtype=torch.uint8)
    host[:, :d_off] = torch.from_numpy(gu.reshape(n_exp, -1))
    host[:, d_off:] = torch.from_numpy(dn.reshape(n_exp, -1))
    slot_of = torch.arange(n_exp, dtype=torch.int32)
    ids = torch.tensor([3, 1], dtype=torch.int64)
    wts = torch.tensor([0.7, 0.3])
    dwa, dwb, slots = wa.cuda(), wb.cuda(), host.cuda()
    words = slots.view(-1).view(torch.int32)
    x = torch.zeros(1, n_in, device="cuda")
    a = torch.zeros(1, 4096, device="cuda")
    b = torch.zeros(1, n_embd, device="cuda")
    h = torch.zeros(k, n_ff, device="cuda")
    y = torch.zeros(k, n_embd, device="cuda")
    smap, dids, dw = slot_of.cuda(), ids.cuda(), wts.cuda()

    def chain():
        cuda_mv.dense(dwa, GGMLType.Q8_0, x, a)
        cuda_mv.dense(dwb, GGMLType.Q8_0, a, b)
        cuda_mv.experts(words, qtype, 0, 0, eb // 4, n_ff, rb_gu, smap, dids, b, h, True, k, mode="hit")
        cuda_mv.experts(words, qtype, 0, d_off // 4, eb // 4, n_embd, rb_d, smap, dids, h, y, False, k, dw,
                        mode="hit")

    chain()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain()
    st = engine_ops.ExpertWords(host, host, 4)
    for seed in range(3):
        xin = torch.from_numpy(np.random.default_rng(seed).standard_normal((1, n_in)).astype(np.float32))
        x.copy_(xin)
        g.replay()
        torch.cuda.synchronize()
        ra = reference.mul_mat(wa, GGMLType.Q8_0, xin)
        rb = reference.mul_mat(wb, GGMLType.Q8_0, a.cpu())
        _close(a.cpu(), ra)
        _close(b.cpu(), rb)
        rh = torch.zeros(k, n_ff)
        engine_ops.experts_ref(st, qtype, 0, 0, 0, n_ff, rb_gu, slot_of, ids, b.cpu(), rh, True, k)
        _close(h.cpu(), rh)
        ry = torch.zeros(k, n_embd)
        engine_ops.experts_ref(st, qtype, 0, d_off // 4, 0, n_embd, rb_d, slot_of, ids, h.cpu(), ry, False, k, wts)
        _close(y.cpu(), ry)


@gpu
@pytest.mark.parametrize("kind", ["word", "stage"])
def test_captured_in_a_graph(kind, monkeypatch):
    """Either Q8_0 kernel captured, then replayed on new activations, equals the reference."""
    monkeypatch.setenv("FLE_CUDA_MV_DENSE", kind)
    assert cuda_mv.DENSE_DEFAULT == "stage"
    rng = np.random.default_rng(1)
    w = torch.from_numpy(quantize(rng.standard_normal((64, 512)).astype(np.float32), GGMLType.Q8_0)).cuda()
    x = torch.randn(1, 512, device="cuda")
    out = torch.zeros(1, 64, device="cuda")
    cuda_mv.dense(w, GGMLType.Q8_0, x, out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cuda_mv.dense(w, GGMLType.Q8_0, x, out)
    x.copy_(torch.randn(1, 512, device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    _close(out.cpu(), reference.mul_mat(w.cpu(), GGMLType.Q8_0, x.cpu()))


def test_union_kernel_switch_and_limits(monkeypatch):
    """The CUDA C union kernel takes a T-row step only when switched on (FLE_CUDA_MV_UNION=1, else
    UNION_DEFAULT), never a call that wants the read log or more than 16 tokens, never CPU tensors."""
    dev = "cuda" if CUDA else "cpu"
    words = torch.zeros(1024, dtype=torch.int32, device=dev)
    x, out = torch.zeros(3, 256, device=dev), torch.zeros(9, 8, device=dev)
    args = (words, GGMLType.IQ4_XS, x, out, None, 1088, 544)
    monkeypatch.setenv("FLE_CUDA_MV_UNION", "0")
    assert not cuda_mv.union_supported(*args, 9, 3)
    monkeypatch.setenv("FLE_CUDA_MV_UNION", "1")
    assert cuda_mv.union_supported(*args, 9, 3) == CUDA
    assert not cuda_mv.union_supported(*args, 9, 3, reads=torch.zeros(9, dtype=torch.int32, device=dev))
    assert not cuda_mv.union_supported(*args, 17 * 3, 3)
    assert not cuda_mv.union_supported(words, GGMLType.Q4_K, x, out, None, 1088, 544, 9, 3)
    monkeypatch.delenv("FLE_CUDA_MV_UNION")
    assert cuda_mv.union_supported(*args, 9, 3) == (CUDA and cuda_mv.UNION_DEFAULT == "1")


@gpu
@pytest.mark.parametrize("config", ["1,4,1,4", "2,4,4,4", "4,2,8,1"])
@pytest.mark.parametrize("share,rounded", [(0, False), (128, False), (0, True), (256, True), (100, False)])
def test_union_experts_against_reference(config, share, rounded, monkeypatch):
    """The T-row step's experts in the CUDA C union kernel (each distinct expert read once for its
    rows, misses over PCIe, runtime.split's union rule for the CPU's share, rounded activations of
    misses) equal experts_union_ref, and the routing repeats experts across tokens; launched twice
    in a captured graph on new routing too."""
    monkeypatch.setenv("FLE_CUDA_MV_CONFIG", config)
    monkeypatch.setenv("FLE_CUDA_MV_UNION", "1")
    c = _experts_setup(0, rounded, n_embd=2304)
    ids_h = c.ids.cpu()
    assert len(set(ids_h.tolist())) < c.R                       # some expert serves several tokens
    st = engine_ops.ExpertWords(c.dev_slots.cpu(), c.pinned, 4)
    smap_h = c.smap.cpu()
    x_h = c.x.cpu()
    xm_h = c.x_miss.cpu() if rounded else None

    def reference(ids):
        h = torch.zeros(c.R, c.n_ff)
        engine_ops.experts_union_ref(st, c.qtype, 0, 0, 0, c.n_ff, c.rb_gu, smap_h, ids, x_h, h, True, c.n_used,
                                     cpu_share=share, x_miss=xm_h)
        h_in = torch.nn.functional.pad(h, (0, 256 - c.n_ff))
        y = torch.zeros(c.R, c.n_embd)
        engine_ops.experts_union_ref(st, c.qtype, 0, c.d_off // 4, 0, c.n_embd, c.rb_d, smap_h, ids, h_in, y, False,
                                     c.n_used, c.wts.cpu(), cpu_share=share)
        return h, h_in, y

    h = torch.full((c.R, c.n_ff), 7.0, device="cuda")
    y = torch.full((c.R, c.n_embd), 7.0, device="cuda")
    h_in = torch.zeros(c.R, 256, device="cuda")

    def run(ids):
        assert cuda_mv.union_supported(c.words, c.qtype, c.x, h, c.x_miss, c.eb, 0, c.R, c.n_used)
        cuda_mv.experts_union(c.words, c.qtype, c.delta, 0, c.eb // 4, c.n_ff, c.rb_gu, c.smap, ids, c.x, h, True,
                              c.n_used, cpu_share=share, x_miss=c.x_miss)
        cuda_mv.experts_union(c.words, c.qtype, c.delta, c.d_off // 4, c.eb // 4, c.n_embd, c.rb_d, c.smap, ids,
                              h_in, y, False, c.n_used, c.wts, cpu_share=share)

    ref_h, ref_hin, ref_y = reference(ids_h)
    h_in.copy_(ref_hin.cuda())
    run(c.ids)
    torch.cuda.synchronize()
    keep = [r for r in range(c.R) if ref_y[r].any()]
    assert (len(keep) < c.R) == (share > 0)
    _close(h.cpu()[keep], ref_h[keep])
    _close(y.cpu(), ref_y)
    # the dispatch table picks it for the T-row step when switched on
    y.fill_(7.0)
    fast = engine_ops.pick("triton", torch.device("cuda"))
    fast.experts_union(c.words, c.qtype, c.delta, c.d_off // 4, c.eb // 4, c.n_embd, c.rb_d, c.smap, c.ids, h_in, y,
                       False, c.n_used, c.wts, cpu_share=share)
    torch.cuda.synchronize()
    _close(y.cpu(), ref_y)
    # captured, replayed on other routing (ids written in place)
    ids_dev = c.ids.clone()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(ids_dev)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        run(ids_dev)
    new = torch.roll(ids_h.view(-1, c.n_used), 1, dims=0).reshape(-1)
    ids_dev.copy_(new.cuda())
    ref_h, ref_hin, ref_y = reference(new)
    h_in.copy_(ref_hin.cuda())
    g.replay()
    torch.cuda.synchronize()
    _close(y.cpu(), ref_y)
