"""The routed experts memory-mapped in the file (``--host-experts mapped``,
fle_engine.runtime.weights.MappedExperts) against the host buffer.

With the experts left in the file the engine packs them on demand: the
reference operations' missed experts, the cache's admissions, prefill's
streamed layers and the CPU kernels' experts (gathered into scratch rows).
Every byte is the same, so the tokens and logits are the same. On CUDA
every miss goes to the CPU (the GPU cannot read pageable memory): the
tokens equal those of the host buffer's run.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fle_engine.runtime import Engine  # noqa: E402
from fle_engine.runtime import weights as W  # noqa: E402
from fle_quant.errors import FleError  # noqa: E402
from fle_quant.gguf_reader import GGUFModel  # noqa: E402
from fle_quant.synth import make_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("exact_float32")
DEVICE = torch.device("cuda" if CUDA else "cpu")
N_TOKENS = 32
PROMPT = [1, 17, 42, 99]
LONG = [int(t) for t in np.random.default_rng(7).integers(1, 200, 20)]        # prefilled (prefill_min 8)
ARCHS = {"qwen3moe": 3, "qwen3next": 4, "qwen4exp": 5}                       # architecture -> seed


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mapped")
    return {arch: make_model(d / f"{arch}.gguf", arch, seed=seed, mix="release", routing_skew=1.0)
            for arch, seed in ARCHS.items()}


def _engine(path, n_slots=None, log=None, **kw):
    """An engine on ``path`` whose cache holds ``n_slots`` experts per layer
    (None: a budget of 0 to probe); prompts of 8 tokens or more are
    prefilled in micro-batches of 8."""
    budget = 0
    if n_slots is not None:
        probe = _engine(path)
        budget = n_slots * sum(lay.expert_bytes for lay in probe.net.layouts.values())
        probe.close()
    return Engine(path, device=DEVICE, cache_budget=budget, ctx_size=N_TOKENS + len(LONG) + 16, cache_type_k="f32",
                  cache_type_v="f32", profile_path="none", progress=False, log=log or (lambda m: None), ubatch=8,
                  prefill_min=8, **kw)


def _same_logits(a, b) -> bool:
    """Equal bytes on the CPU (the reference operations); on CUDA the runs
    replay the same kernels on the same bytes, checked to a tolerance."""
    return torch.equal(a, b) if not CUDA else torch.allclose(a, b, rtol=0, atol=1e-3)


def _run(eng, prompt, n):
    """Greedy tokens of ``prompt`` and the logits after its first token and after the last."""
    first = eng.generate(prompt, 1)
    logits = [eng.state.bufs.logits[0].float().cpu().clone()]
    toks = eng.generate(prompt, n)
    logits.append(eng.state.bufs.logits[0].float().cpu().clone())
    assert toks[0] == first[0]
    return toks, logits


@pytest.mark.parametrize("arch", list(ARCHS))
def test_mapped_equals_host_buffer(files, arch):
    """Decode steps and prefill with 2 of the experts of each layer cached:
    the same tokens and logits from the file's pages as from the host
    buffer, with misses and admissions on the way."""
    path = files[arch]
    runs = {}
    # on CUDA the mapped run computes every miss on the CPU: so does the buffer's run here
    split = "cpu" if CUDA else "gpu"
    for mode in ("auto", "mapped"):
        eng = _engine(path, 2, host_experts=mode, miss_split=split)
        assert eng.host.mapped == (mode == "mapped")
        want_mode = "mapped" if mode == "mapped" else ("pinned" if CUDA else "process")
        assert eng.memory_report()["host_experts_mode"] == want_mode
        short = _run(eng, PROMPT, N_TOKENS)
        assert eng.prefill.stats.tokens == 0                    # a short prompt runs as decode steps
        long = _run(eng, LONG, N_TOKENS)
        assert eng.prefill.stats.tokens == len(LONG) and eng.prefill.stats.ubatches == 3
        assert eng.prefill.stats.bytes_copied > 0
        st = eng.cache.stats
        assert 0 < st.hit_rate < 1 and st.admissions > 0
        runs[mode] = (short, long)
        eng.close()
    for (t0, l0), (t1, l1) in zip(runs["auto"], runs["mapped"]):
        assert t0 == t1
        for a, b in zip(l0, l1):
            assert _same_logits(a, b)


def test_mapped_misses_on_the_cpu_kernels(files):
    """--miss-split cpu: the CPU kernels read the experts gathered into
    scratch rows; the tokens and logits equal those read from the buffer."""
    path = files["qwen3moe"]
    got = {}
    for mode in ("pinned", "mapped"):
        eng = _engine(path, 2, host_experts=mode, miss_split="cpu")
        assert eng.split is not None and eng.split.cpu.mapped == (mode == "mapped")
        got[mode] = _run(eng, PROMPT, N_TOKENS)
        assert eng.split.cpu_experts > 0
        eng.close()
    assert got["pinned"][0] == got["mapped"][0]
    assert all(_same_logits(a, b) for a, b in zip(got["pinned"][1], got["mapped"][1]))


def _stores(path):
    """(HostExperts filled, MappedExperts) of the file's layers."""
    eng = _engine(path, host_experts="pinned")
    layouts, n_expert = eng.net.layouts, eng.args.n_expert
    host = eng.host
    eng.host = None             # kept past the engine
    eng.close()
    g = GGUFModel.open(path)
    sources = {il: W.expert_layout(g, il, lay.n_ff, lay.n_embd, fast_needed=False)[1] for il, lay in layouts.items()}
    return host, W.MappedExperts(layouts, n_expert, sources), sources


@pytest.mark.parametrize("arch", list(ARCHS))
def test_gather_equals_host_view(files, arch):
    host, mapped, _ = _stores(files[arch])
    assert mapped.nbytes == sum(host.n_expert * lay.expert_bytes for lay in host.layouts.values())
    assert not mapped.pinned and mapped.mapped and mapped.mode == "mapped"
    rng = np.random.default_rng(0)
    for il, lay in host.layouts.items():
        ids = rng.integers(0, host.n_expert, 5)
        out = np.full((8, lay.expert_bytes), 7, np.uint8)
        assert np.array_equal(mapped.gather(il, ids, out), host.view(il).numpy()[ids])
        assert np.array_equal(host.gather(il, ids, np.zeros_like(out)), host.view(il).numpy()[ids])
        # a whole layer packed = the layer of the host buffer
        whole = mapped.gather(il, np.arange(host.n_expert), np.empty((host.n_expert, lay.expert_bytes), np.uint8))
        assert np.array_equal(whole, host.view(il).numpy())
        for e in (0, host.n_expert - 1):
            assert np.array_equal(mapped.expert(il, e), host.expert(il, e))
            assert torch.equal(mapped.rows(il)[e], host.rows(il)[e])
    with pytest.raises(AssertionError, match="no address"):
        mapped.address(min(host.layouts))
    mapped.close()
    host.close()


def test_pack_fused_gate_up(files):
    """A fused gate_up source packs as gate and up apart do."""
    host, _, sources = _stores(files["qwen3moe"])
    il = min(host.layouts)
    lay = host.layouts[il]
    gate, up, down = sources[il]
    fused = np.concatenate([gate.reshape(gate.shape[0], -1), up.reshape(up.shape[0], -1)], axis=1)
    ids = np.array([3, 0, 3])
    out = np.empty((3, lay.expert_bytes), np.uint8)
    assert np.array_equal(W.pack_experts(lay, [fused, down], ids, out), host.view(il).numpy()[ids])
    host.close()


def test_cpu_experts_gather_scratch_rows(files):
    """CpuExperts on mapped experts (distinct ids gathered, remapped)
    gives the bytes of CpuExperts on the host buffer."""
    from fle_engine.runtime.split import cpu_experts

    host, mapped, _ = _stores(files["qwen3moe"])
    rng = np.random.default_rng(1)
    for il, lay in host.layouts.items():
        a, b = cpu_experts(host, host.layouts), cpu_experts(mapped, host.layouts)
        ids = rng.integers(0, host.n_expert, (3, 4)).astype(np.int64)
        ids[0, 1] = ids[2, 3] = -1
        ids[1, 0] = ids[2, 0]                      # an expert of two rows
        w = rng.random((3, 4)).astype(np.float32)
        x = rng.standard_normal((3, lay.n_embd)).astype(np.float32)
        oa, ob = np.empty((3, lay.n_embd), np.float32), np.empty((3, lay.n_embd), np.float32)
        a.ffn_rows(il, ids, w, x, oa)
        b.ffn_rows(il, ids, w, x, ob)
        assert np.array_equal(oa, ob) and np.abs(oa).sum() > 0
    host.close()


def test_auto_maps_when_memory_is_short(files, monkeypatch):
    lines = []
    monkeypatch.setattr(W, "available_memory", lambda: 3 << 30)
    eng = _engine(files["qwen3moe"], 2, host_experts="auto", log=lines.append)
    assert eng.host.mapped
    said = [m for m in lines if "memory-mapped in the file" in m]
    assert len(said) == 1, lines
    assert said[0].startswith("fle-engine: the routed experts take 0.0 GiB and 3.0 GiB of RAM is available: they "
                              "stay memory-mapped in the file (misses computed on the CPU; --host-experts pinned")
    assert any("memory-mapped in qwen3moe.gguf" in m for m in lines)        # the memory line
    eng.close()
    lines.clear()
    monkeypatch.setattr(W, "available_memory", lambda: 64 << 30)
    eng = _engine(files["qwen3moe"], 2, host_experts="auto", log=lines.append)
    assert not eng.host.mapped and not any("memory-mapped" in m for m in lines)
    eng.close()


def test_auto_maps_when_the_buffer_fails(files, monkeypatch):
    """Allocation or locking fails: auto goes mapped, saying why; pinned
    stops with the error."""
    def fail(*a, **k):
        raise FleError("cannot page-lock 1.0 GiB of host memory for the routed experts (cudaHostRegister error 2); "
                       "raise the locked-memory limit")

    monkeypatch.setattr(W, "HostExperts", fail)
    lines = []
    eng = _engine(files["qwen3moe"], 2, host_experts="auto", log=lines.append)
    assert eng.host.mapped
    said = [m for m in lines if "memory-mapped in the file" in m]
    assert len(said) == 1 and "cudaHostRegister error 2" in said[0], lines
    eng.close()
    with pytest.raises(FleError, match="cudaHostRegister"):
        _engine(files["qwen3moe"], 2, host_experts="pinned")


def test_pinned_refuses_short_memory(files, monkeypatch):
    monkeypatch.setattr(W, "available_memory", lambda: 1 << 20)
    with pytest.raises(FleError, match=r"take 0\.0 GiB of host memory and 0\.0 GiB of RAM is available; use "
                                       r"--host-experts mapped"):
        _engine(files["qwen3moe"], 2, host_experts="pinned")
    with pytest.raises(FleError, match="--host-experts 'copied'"):
        _engine(files["qwen3moe"], 2, host_experts="copied")


def test_available_memory_probe():
    n = W.available_memory()
    assert n is None or n > 0


def test_cli_host_experts(files, monkeypatch, capsys):
    """fle-engine generate --host-experts mapped runs the engine (here on the
    CPU: the engine's device forced) with the experts in the file; serve
    passes the option to the engine."""
    import fle_engine.cli as cli
    import fle_engine.runtime as rt
    import fle_engine.server as server

    made = []

    class CpuEngine(Engine):
        def __init__(self, path, **kw):
            kw.update(device="cpu", progress=False)
            super().__init__(path, **kw)
            made.append(self)

    monkeypatch.setattr(cli, "resolve_device", lambda d: "cuda")
    monkeypatch.setattr(rt, "Engine", CpuEngine)
    path = str(files["qwen3moe"])
    out = {}
    for mode in ("pinned", "mapped"):
        argv = ["generate", path, "-p", "the river", "-n", "6", "--temp", "0", "--cache-profile", "none",
                "--miss-split", "gpu", "--host-experts", mode]
        assert cli.main(argv) == 0
        out[mode] = capsys.readouterr()
        assert made[-1].host.mode == ("mapped" if mode == "mapped" else "process")
    assert out["mapped"].out == out["pinned"].out and out["mapped"].out.strip()
    assert "memory-mapped in qwen3moe.gguf" in out["mapped"].err

    seen = {}
    monkeypatch.setattr(server, "serve", lambda *a, **kw: seen.update(kw) or 0)
    assert cli.main(["serve", path, "--host-experts", "mapped"]) == 0
    assert seen["runtime"]["host_experts"] == "mapped"
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["generate", path, "--host-experts", "copied"])


@pytest.mark.skipif(not CUDA, reason="needs CUDA: every miss of the mapped experts goes to the CPU worker")
def test_mapped_on_cuda_equals_host_buffer(files):
    """On CUDA the GPU cannot read the file's pages: every miss is computed
    by the CPU worker thread (not the team, which reads the buffer by
    address); the greedy tokens equal those of the page-locked buffer."""
    path = files["qwen3moe"]
    base = _engine(path, 2, host_experts="pinned", miss_split="gpu")
    assert base.host.pinned
    want = [base.generate(PROMPT, 64), base.generate(LONG, 32)]
    base.close()
    eng = _engine(path, 2, host_experts="mapped", miss_split="gpu", miss_prefetch=2)
    assert eng.host.mapped and eng.prefetch is None
    assert eng.split is not None and eng.split.share == 256 and eng.split.team is None
    assert [eng.generate(PROMPT, 64), eng.generate(LONG, 32)] == want
    assert eng.split.cpu_experts > 0 and eng.cache.stats.admissions > 0 and eng.prefill.stats.tokens == len(LONG)
    eng.close()
