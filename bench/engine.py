"""FLE's engine against upstream llama.cpp, decode speed on the same file
with the same GPU bytes for routed experts, in one run.

    python3 bench/engine.py --llama-src SDIST_OR_DIR   # builds llama-bench (CUDA) first
    python3 bench/engine.py --llama-bench PATH         # or takes a built one

Steps: build upstream's ``llama-bench`` (CUDA, sm_90 by default), write the
benchmark files with the factory's fast mode (Qwen3-30B-A3B shape: 48
layers, 128 experts, 8 used, IQ4_XS experts, Q8_0 dense; or ``--shape``
80b-a3b, qwen4exp-scaled), then per file:

- upstream with the experts of 1/3 of the layers on the GPU (``-ncmoe``
  for the other 2/3: llama.cpp's CPU runs those experts), and with
  everything on the GPU;
- FLE with a cache budget of the same bytes (1/3 of the expert bytes), and
  with every expert cached.

Both decode random tokens one at a time from position 0 (llama-bench's tg
test; FLE feeds the same kind of tokens). FLE's expert cache is warmed by
one unmeasured run first (llama-bench's warm-up run does the same for its
caches) of ``--fle-warmup`` tokens (default 512, at least ``-n``): with 512
experts per layer the policy needs a few hundred tokens to settle, which a
saved usage profile gives a user's engine at start; its hit rate and
misses per token are printed. Routing: near-uniform (skew 0) and a skew calibrated so that
FLE's policy hits 88-93 % at 1/3 of the experts cached (the report's
91.2 % at 173 of 512 slots); the calibration simulates the policy on the
file's routing model and prints the curve beside the report's points.

``--prefill 1024,4096,8192`` adds prompt processing on the first routing's
file: upstream with ``-ub 512`` and ``-ub 4096`` (flash attention on, the
logical batch as large as the longest prompt), FLE with ``--fle-ubatch``
micro-batches, the same GPU bytes; the ratio of the bests per length, the
bytes FLE streamed and the time its compute waited for copies.
``--no-decode`` skips the decode runs.

``--verify calibrated`` adds the verify step of drafted decoding on that
routing's file (bench/verify_step.py, in the same run): the cost T(n) of a
step of 1 + n tokens, n = 0..3, with the same cache budget, the PCIe bytes
per step against the sum over its tokens, and the decode rate that T(n)
gives at the report's acceptance (MODELLED, printed as such); on a file
with an MTP head also the head's measured acceptance.

``--device cpu --skip-upstream --shape tiny`` runs FLE's side on the CPU
(a smoke test of the script; its times mean nothing).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REPORT_CURVE = {173 / 512: 0.912, 146 / 512: 0.888, 120 / 512: 0.848}

SHAPES = {
    "30b-a3b": dict(arch="qwen3moe", overrides=dict(
        block_count=48, embedding_length=2048, feed_forward_length=6144, expert_count=128, expert_used_count=8,
        expert_feed_forward_length=768, attention_head_count=32, attention_head_count_kv=4,
        attention_key_length=128, context_length=40960, vocab_size=151936),
        rules=[(r"\.ffn_(gate|up|down)_exps\.weight$", "IQ4_XS")], mix="q8_0"),
    # Qwen3-Next-80B-A3B: GDN layers with full attention every 4th, 512 experts, 10 used, a shared expert
    "80b-a3b": dict(arch="qwen3next", overrides=dict(
        block_count=48, embedding_length=2048, expert_count=512, expert_used_count=10,
        expert_feed_forward_length=512, expert_shared_feed_forward_length=512, attention_head_count=16,
        attention_head_count_kv=2, attention_key_length=256, ssm_state_size=128, ssm_group_count=16,
        ssm_time_step_rank=32, ssm_conv_kernel=4, context_length=262144, vocab_size=151936),
        rules=[(r"\.ffn_(gate|up|down)_exps\.weight$", "IQ4_XS")], mix="q8_0"),
    # qwen4exp scaled to a 64 GB disk: 48 layers (3 GDN + 1 QSA), HC 4, PLE (16 heads of ~1 M rows), 512 experts,
    # 10 used, a shared expert; widths reduced (2560 -> 1536, experts 640 -> 512): 32 GiB. One file of the shape
    # is kept at a time (the previous routing's is removed before the next is written).
    "qwen4exp-scaled": dict(arch="qwen4exp", one_file=True, overrides=dict(
        block_count=48, embedding_length=1536, expert_count=512, expert_used_count=10,
        expert_feed_forward_length=512, expert_shared_feed_forward_length=512, attention_head_count=12,
        attention_head_count_kv=2, attention_key_length=256, ssm_state_size=128, ssm_group_count=16,
        ssm_time_step_rank=32, ssm_conv_kernel=4, hyper_connection_count=4, hyper_connection_low_rank=192,
        attention_indexer_head_count=4, attention_indexer_key_length=128, attention_indexer_top_k=2048,
        rope_dimension_count=64, ple_heads_per_ngram=8, ple_head_vocab_sizes="primes:16:1000000",
        context_length=262144, vocab_size=248320),
        rules=[(r"\.ffn_(gate|up|down)_exps\.weight$", "IQ4_XS"), (r"^per_layer_token_embd\.weight$", "IQ4_NL")],
        mix="q8_0", mtp="none"),
    # a small shape for trying the script on any machine
    "tiny": dict(arch="qwen3moe", overrides=dict(
        block_count=8, embedding_length=512, expert_count=32, expert_used_count=4, expert_feed_forward_length=256,
        attention_head_count=8, attention_head_count_kv=2, attention_key_length=64, vocab_size=4096),
        rules=[(r"\.ffn_(gate|up|down)_exps\.weight$", "IQ4_XS")], mix="q8_0"),
}
# the 80B-A3B shape with its MTP head inside the file (one more gated-attention block, 512 experts):
# bench/verify_step.py --drafters
SHAPES["80b-a3b-mtp"] = dict(SHAPES["80b-a3b"], mtp="inside")
# the scaled qwen4exp shape with its MTP block inside (for qwen4exp's drafters; not yet run)
SHAPES["qwen4exp-scaled-mtp"] = dict(SHAPES["qwen4exp-scaled"], mtp="inside")


# ---------------------------------------------------------------------------
# calibration of the routing skew


def simulate_hit_rate(skew: float, n_expert: int, n_used: int, frac: float, steps: int = 3000,
                      layers: int = 8, seed: int = 0) -> float:
    """Hit rate of FLE's policy when logits are ``skew * z_e + N(0, 1)``
    per token (the fast factory's routing model, independent tokens)."""
    from fle_engine.expert_cache import BatchedCache

    rng = np.random.default_rng(seed)
    z = rng.standard_normal((layers, n_expert)) * skew
    slots = int(round(frac * n_expert))
    cache = BatchedCache(n_expert, [slots] * layers)
    hits = total = 0
    warm = steps // 3
    for t in range(steps):
        logits = z + rng.standard_normal((layers, n_expert))
        ids = np.argpartition(-logits, n_used - 1, axis=1)[:, :n_used]
        h, _ = cache.step(ids)
        if t >= warm:
            hits += int(h.sum())
            total += h.size
    return hits / total


def calibrate_skew(n_expert: int, n_used: int, frac: float = 1 / 3, target: float = 0.905) -> float:
    lo, hi = 0.0, 4.0
    for _ in range(14):
        mid = (lo + hi) / 2
        if simulate_hit_rate(mid, n_expert, n_used, frac) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# ---------------------------------------------------------------------------
# upstream


def build_llama_bench(src: Path, work: Path, arch: str = "90") -> Path:
    """Build llama-bench with CUDA from an unpacked llama.cpp (or the
    llama-cpp-python sdist, whose vendor/llama.cpp is used) or a tarball."""
    if src.is_file():
        dest = work / "llama-src"
        if not dest.exists():
            with tarfile.open(src) as tar:
                tar.extractall(dest, filter="data")
        src = dest
    cands = [src, src / "vendor" / "llama.cpp", src / "llama.cpp"] + [p for p in src.glob("*/vendor/llama.cpp")]
    top = next((c for c in cands if (c / "tools" / "llama-bench").is_dir()), None)
    if top is None:
        raise SystemExit(f"{src}: no llama.cpp source with tools/llama-bench found")
    build = work / "llama-build"
    exe = build / "bin" / "llama-bench"
    if exe.exists():
        return exe
    t0 = time.time()
    subprocess.run(["cmake", "-S", str(top), "-B", str(build), "-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}",
                    "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-bench", "-j", str(os.cpu_count() or 8)],
                   check=True, stdout=subprocess.DEVNULL)
    print(f"built {exe} in {time.time() - t0:.0f} s", flush=True)
    return exe


def upstream_decode(exe: Path, model: Path, n_cpu_moe: int, n_gen: int, threads: int, reps: int) -> float:
    """Upstream's decode tok/s; a run that fails (e.g. a graph that cannot load the file) raises
    :class:`UpstreamFailed` with the last lines of its output."""
    rows = _llama_bench(exe, model, n_cpu_moe, threads, reps, ["-p", "0", "-n", str(n_gen)], "could not load")
    return float(rows[0]["avg_ts"])


def _llama_bench(exe: Path, model: Path, n_cpu_moe: int, threads: int, reps: int, extra: list[str],
                 failed: str) -> list[dict]:
    """The JSON rows of one llama-bench run (-ngl 99, -ncmoe, -lm none)."""
    cmd = [str(exe), "-m", str(model), "-ngl", "99", "-ncmoe", str(n_cpu_moe), "-t", str(threads), *extra,
           "-r", str(reps), "-lm", "none", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    try:
        rows = json.loads(out.stdout) if out.returncode == 0 else None
    except json.JSONDecodeError:
        rows = None
    if not rows:
        tail = " | ".join((out.stderr or out.stdout or "").strip().splitlines()[-3:])
        raise UpstreamFailed(f"upstream {failed} {model.name} (exit {out.returncode}): {tail}")
    return rows


class UpstreamFailed(RuntimeError):
    pass


def upstream_prefill(exe: Path, model: Path, n_cpu_moe: int, prompts: list[int], ubatches: list[int], threads: int,
                     reps: int) -> list[dict]:
    """Upstream's prompt processing tok/s per (prompt length, micro-batch),
    flash attention on (its faster prefill), the logical batch as large as
    the largest prompt so that ``-ub`` takes effect."""
    rows = _llama_bench(exe, model, n_cpu_moe, threads, reps,
                        ["-p", ",".join(map(str, prompts)), "-n", "0", "-b", str(max(prompts + ubatches)),
                         "-ub", ",".join(map(str, ubatches)), "-fa", "1"], "prefill failed on")
    return [{"n_prompt": int(r["n_prompt"]), "n_ubatch": int(r["n_ubatch"]), "tok_s": float(r["avg_ts"])}
            for r in rows]


def shape_overrides(o: dict) -> dict:
    """The factory overrides of a shape; ``"primes:N:START"`` is the N primes from START."""
    from fle_quant.synth.common import prime_at_least

    out = dict(o)
    for k, v in o.items():
        if isinstance(v, str) and v.startswith("primes:"):
            _, n, v0 = v.split(":")
            vals, p = [], int(v0)
            while len(vals) < int(n):
                p = prime_at_least(p)
                vals.append(p)
                p += 1
            out[k] = vals
    return out


# ---------------------------------------------------------------------------
# FLE


def fle_decode(model: Path, budget: "int | str", n_gen: int, reps: int, seed: int = 0,
               miss_split: str = "gpu", prefetch: int = 0, host_experts: str = "auto", device: str = "cuda",
               warmup: int = 0) -> dict:
    import torch

    from fle_engine.runtime import Engine

    cuda = device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def allocated():
        return torch.cuda.memory_allocated() if cuda else 0

    warmup = max(warmup, n_gen)
    eng = Engine(model, device=device, cache_budget=budget, ctx_size=max(512, warmup + 8), profile_path="none",
                 progress=False, miss_split=miss_split, miss_prefetch=prefetch, host_experts=host_experts)
    rng = np.random.default_rng(seed)
    n_vocab = eng.args.n_vocab
    first = int(rng.integers(n_vocab))
    eng.generate([first], warmup, feed=rng.integers(n_vocab, size=warmup).tolist())    # warm-up (unmeasured)
    speeds = []
    st0 = eng.cache.stats
    h0, r0, s0, a0, host0 = st0.hits, st0.requests, st0.tokens, st0.admissions, st0.host_seconds
    launch0, replay0, bnd0 = eng.stats.launch_seconds, eng.stats.replay_seconds, st0.boundary_seconds
    sp = eng.split
    cpu0, busy0 = (sp.cpu_experts, sp.busy_seconds) if sp is not None else (0, 0.0)
    mem0 = allocated()
    if eng.prefetch is not None:
        eng.prefetch.reset_counts()
    for _ in range(reps):
        feed = rng.integers(n_vocab, size=n_gen).tolist()
        sync()
        t0 = time.perf_counter()
        eng.generate([int(rng.integers(n_vocab))], n_gen, feed=feed)
        sync()
        speeds.append(n_gen / (time.perf_counter() - t0))
    st = eng.cache.stats
    steps = st.tokens - s0          # tokens decoded (one per step here)
    res = dict(tok_s=float(np.mean(speeds)), tok_s_runs=speeds, warmup_tokens=warmup,
               hit_rate=(st.hits - h0) / max(1, st.requests - r0),
               misses_per_token=(st.requests - r0 - (st.hits - h0)) / max(1, steps),
               admissions_per_token=(st.admissions - a0) / max(1, steps),
               host_policy_ms_per_token=(st.host_seconds - host0) / max(1, steps) * 1e3,
               host_launch_ms_per_token=(eng.stats.launch_seconds - launch0) / max(1, steps) * 1e3,
               host_boundary_ms_per_token=(st.boundary_seconds - bnd0) / max(1, steps) * 1e3,
               host_replay_ms_per_token=(eng.stats.replay_seconds - replay0) / max(1, steps) * 1e3,
               cuda_calls=getattr(getattr(eng.cache, "calls", None), "name", None),
               cache_bytes=eng.cache.budget_used, slots=sum(eng.cache.slots_per_layer.values()),
               gpu_allocated=allocated(), gpu_allocated_before=mem0,
               miss_split=miss_split, cpu_share=(sp.share / 256 if sp is not None else 0.0),
               cpu_kernels=(sp.cpu.name if sp is not None else None),
               cpu_misses_per_token=((sp.cpu_experts - cpu0) / max(1, steps) if sp is not None else 0.0),
               cpu_busy_ms_per_token=((sp.busy_seconds - busy0) / max(1, steps) * 1e3 if sp is not None else 0.0),
               miss_bandwidths=eng.miss_bandwidths, miss_prefetch=prefetch,
               prefetch=(eng.prefetch.summary(steps) if eng.prefetch is not None else None),
               expert_bytes_mean=float(np.mean([lay.expert_bytes for lay in eng.net.layouts.values()])))
    eng.close()
    del eng
    gc.collect()                # an engine left in reference cycles keeps its GPU tensors until collected
    if cuda:
        torch.cuda.empty_cache()
    return res


def _verify_step_module():
    """bench/verify_step.py as a module (its run and report)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_verify_step", Path(__file__).with_name("verify_step.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fle_verify(model: Path, budget: int, miss_split: str, warmup: int, reps: int, device: str, mtp: bool) -> dict:
    """The verify step's cost T(n), n = 0..3, on ``model`` with ``budget`` bytes of cache
    (bench/verify_step.py's measurement, printed with its report); with an MTP head in the
    file, the engine's step drafter also runs, giving the head's measured acceptance."""
    vs = _verify_step_module()
    res = vs.run(model, budget, device, warmup, reps, 0.0, vs.ACCEPT, 0, miss_split=miss_split,
                 drafters=("step",) if mtp else ())
    vs.report(res)
    if not mtp:
        print("measured acceptance: none here (this file has no MTP head; the modelled rates use the report's)")
    return res


KERNEL_SETS = {
    "triton": {"FLE_CUDA_MV": "0"},
    "cuda": {"FLE_CUDA_MV": "1", "FLE_PDL": "0", "FLE_CUDA_MV_FFN": "0"},
    # programmatic dependent launch (FLE_PDL: the CUDA C kernels and Triton's expert kernels), the weights of two
    # row iterations (gate+up, dense) and one (down) loaded first
    "cuda-pdl": {"FLE_CUDA_MV": "1", "FLE_PDL": "1", "FLE_CUDA_MV_PRE": "2,1,2"},
    # the same with the CUDA C kernels for the hit launch too (the miss launch's shapes)
    "cuda-pdl-hit": {"FLE_CUDA_MV": "1", "FLE_PDL": "1", "FLE_CUDA_MV_PRE": "2,1,2", "FLE_CUDA_MV_CONFIG": "2,4,4,4"},
    # a layer's gate+up and down in one CUDA C launch (cuda_mv.FFN_CONFIG; FLE_CUDA_MV_FFN's shape)
    "cuda-ffn": {"FLE_CUDA_MV": "1", "FLE_PDL": "0", "FLE_CUDA_MV_FFN": os.environ.get("FLE_CUDA_MV_FFN") or "2,4,4,1"},
    "default": {},
}


@contextlib.contextmanager
def _kernels(which: str):
    """FLE's one-token kernels for the runs inside, by the environment settings of KERNEL_SETS:
    "cuda" (FLE_CUDA_MV=1: the CUDA C kernels where they apply), "cuda-pdl" (and programmatic
    dependent launch), "cuda-pdl-hit" (also the hit launch), "triton" (FLE_CUDA_MV=0) or "default"
    (whatever the environment says)."""
    if which not in KERNEL_SETS:
        raise SystemExit(f"--kernels: {which!r} is not one of {', '.join(KERNEL_SETS)}")
    old = {k: os.environ.get(k) for k in KERNEL_SETS[which]}
    os.environ.update(KERNEL_SETS[which])
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def fle_prefill(model: Path, budget: "int | str", prompts: list[int], ubatches: list[int], reps: int,
                seed: int = 0, row_steps: bool = False) -> list[dict]:
    """FLE's prefill tok/s per (prompt length, micro-batch), the expert cache
    warmed by 64 decode steps first (1/3 of each layer's experts in their
    slots); bytes streamed and the time the compute stream waited for copies.
    Prompts below ``--prefill-min`` or prefilled with the routed experts
    only (and every prompt with ``row_steps``) are also run as decode steps,
    one token and ``--prompt-rows`` tokens per step: which way is faster
    at each length is what ``--prefill-min`` follows."""
    import torch

    from fle_engine.runtime import Engine

    eng = Engine(model, device="cuda", cache_budget=budget, ctx_size=max(prompts) + 80, profile_path="none",
                 progress=False, miss_split="gpu")
    rng = np.random.default_rng(seed)
    n_vocab = eng.args.n_vocab
    eng.generate([int(rng.integers(n_vocab))], 64, feed=rng.integers(n_vocab, size=64).tolist())
    out = []
    for ub in ubatches:
        eng.prefill.ubatch = ub
        eng.prefill.run(rng.integers(n_vocab, size=min(ub, max(prompts))).tolist(), 0)     # compile, warm
        for n in prompts:
            runs = []
            for _ in range(reps):
                torch.cuda.synchronize()
                st = eng.prefill.run(rng.integers(n_vocab, size=n).tolist(), 0)
                runs.append(st)
            sec = float(np.mean([r.seconds for r in runs]))
            last = runs[-1]
            out.append({"n_prompt": n, "n_ubatch": ub, "tok_s": n / sec, "tok_s_runs": [n / r.seconds for r in runs],
                        "ubatches": last.ubatches, "gb_streamed": last.bytes_copied / 1e9,
                        "stream_gbps": last.bytes_copied / last.seconds / 1e9,
                        "copy_wait_ms": last.copy_wait_seconds * 1e3, "lent_layers": len(last.lent_layers)})
            print(f"  FLE prefill {n} tokens, -ub {ub}: {n / sec:.0f} tok/s ({last.ubatches} micro-batches, "
                  f"{last.bytes_copied / 1e9:.2f} GB streamed{', routed experts only' if last.routed_only else ''}, "
                  f"compute waiting for copies {last.copy_wait_seconds * 1e3:.0f} of {last.seconds * 1e3:.0f} ms)",
                  flush=True)
            if last.routed_only:          # the same prompts copying whole layers
                eng.prefill.force_routed = False
                whole = [eng.prefill.run(rng.integers(n_vocab, size=n).tolist(), 0) for _ in range(reps)]
                eng.prefill.force_routed = None
                out[-1]["tok_s_whole_layers"] = n / float(np.mean([r.seconds for r in whole]))
                out[-1]["gb_whole_layers"] = whole[-1].bytes_copied / 1e9
            if row_steps or last.routed_only or n < eng.prefill_min:
                # as decode steps: one token per step, and --prompt-rows tokens per T-row step (its graphs
                # captured by a first, untimed prompt)
                keep_min, keep_rows, eng.prefill_min = eng.prefill_min, eng.prompt_rows, n + 1
                for key, rows in (("tok_s_decode_steps", 1), ("tok_s_row_steps", keep_rows)):
                    eng.prompt_rows = rows
                    eng.generate(rng.integers(n_vocab, size=n).tolist(), 1, cache_prompt=False)
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        eng.generate(rng.integers(n_vocab, size=n).tolist(), 1, cache_prompt=False)
                    out[-1][key] = n * reps / (time.perf_counter() - t0)
                eng.prefill_min, eng.prompt_rows = keep_min, keep_rows
                o = out[-1]
                whole = (f"{o['tok_s_whole_layers']:.0f} tok/s copying whole layers ({o['gb_whole_layers']:.2f} GB), "
                         if "tok_s_whole_layers" in o else "")
                print(f"  the same {n} tokens: {whole}{o['tok_s_decode_steps']:.0f} tok/s as decode steps, "
                      f"{o['tok_s_row_steps']:.0f} tok/s {keep_rows} tokens per step", flush=True)
    eng.close()
    del eng
    gc.collect()                # an engine left in reference cycles keeps its GPU tensors until collected
    torch.cuda.empty_cache()
    return out


def prefill_ratios(up: list[dict], fle: list[dict]) -> dict:
    """Per prompt length: FLE's best micro-batch against upstream's best."""
    res = {}
    for n in sorted({r["n_prompt"] for r in fle}):
        f = max((r for r in fle if r["n_prompt"] == n), key=lambda r: r["tok_s"])
        u = [r for r in up if r["n_prompt"] == n]
        row = {"fle_tok_s": f["tok_s"], "fle_ubatch": f["n_ubatch"]}
        if u:
            b = max(u, key=lambda r: r["tok_s"])
            row.update(upstream_tok_s=b["tok_s"], upstream_ubatch=b["n_ubatch"], ratio=f["tok_s"] / b["tok_s"])
        res[str(n)] = row
    return res


def pinned_copy_bps(mib: int = 1024) -> float:
    """Bytes per second of a pinned host -> device copy (the link's measured speed)."""
    import torch

    src = torch.empty(mib << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    bps = 3 * src.numel() / (time.perf_counter() - t0)
    del src, dst
    return bps


def link_model(row: dict, link_bps: float, pinned_bps: float) -> "dict | None":
    """Decode speed on a slower PCIe link, modelled from this machine's
    measurements (labelled as a model wherever it is printed): a token's
    time is the rest of the step plus its miss bytes at the speed of the
    side(s) that read them.

    From the GPU-only run: ``t_rest = 1 / tok_s - M / B_z`` with ``M`` the
    miss bytes per token and ``B_z`` the zero-copy read speed that ``auto``
    measured; on the slower link ``B_z' = B_z * link / pinned`` (zero-copy
    reads scale with the link). GPU-only: ``t_rest + M / B_z'``; hybrid in
    the share ``auto`` would pick there: ``t_rest + M / (B_c + B_z') + o``
    with ``o`` the hybrid's own overhead measured here (its measured time
    minus the same formula at this link's speed, not below 0); CPU-only
    reads nothing over PCIe and keeps its measured speed. Upstream's
    ``-ncmoe`` decode computes its misses on the CPU and moves only
    activations over PCIe, so its measured speed stands."""
    runs = row.get("fle_split", {})
    g, a = runs.get("gpu"), runs.get("auto")
    if not g or not a or not a.get("miss_bandwidths"):
        return None
    b_z, b_c = a["miss_bandwidths"]["gpu"], a["miss_bandwidths"]["cpu"]
    m = g["misses_per_token"] * g["expert_bytes_mean"]
    t_rest = max(0.0, 1.0 / g["tok_s"] - m / b_z)
    b_z2 = b_z * link_bps / pinned_bps
    over = max(0.0, 1.0 / a["tok_s"] - (t_rest + m / (b_c + b_z)))
    out = {"link_gbps": link_bps / 1e9, "pinned_gbps": pinned_bps / 1e9, "zero_copy_gbps": b_z2 / 1e9,
           "cpu_gbps": b_c / 1e9, "rest_ms": t_rest * 1e3, "hybrid_overhead_ms": over * 1e3,
           "gpu_tok_s": 1.0 / (t_rest + m / b_z2), "hybrid_tok_s": 1.0 / (t_rest + m / (b_c + b_z2) + over),
           "hybrid_cpu_share": b_c / (b_c + b_z2)}
    if runs.get("cpu"):
        out["cpu_tok_s"] = runs["cpu"]["tok_s"]
    if "upstream_tok_s" in row:
        out["upstream_tok_s"] = row["upstream_tok_s"]
        out["hybrid_ratio"] = out["hybrid_tok_s"] / row["upstream_tok_s"]
        out["gpu_ratio"] = out["gpu_tok_s"] / row["upstream_tok_s"]
    return out


def step_time_at(model: Path, ctx: int, position: int, budget, n: int = 64, device: str = "cuda") -> float:
    """Seconds per decode step just after ``position`` with ``ctx`` positions allocated."""
    from fle_engine.runtime import Engine

    eng = Engine(model, device=device, cache_budget=budget, ctx_size=ctx, profile_path="none", progress=False)
    rng = np.random.default_rng(1)
    v = eng.args.n_vocab
    prompt = rng.integers(v, size=position).tolist()
    best = float("inf")
    for _ in range(2):
        g0, s0 = eng.stats.gen_tokens, eng.stats.gen_seconds
        eng.generate(prompt, n, feed=rng.integers(v, size=n).tolist())
        best = min(best, (eng.stats.gen_seconds - s0) / (eng.stats.gen_tokens - g0))
    eng.close()
    return best


def ctx_check(model: Path, budget) -> dict:
    """A decode step at position ~1,000 with 8,192 and 131,072 positions allocated."""
    out = {}
    for ctx in (8192, 131072):
        out[ctx] = step_time_at(model, ctx, 1000, budget)
        print(f"ctx {ctx}: {out[ctx] * 1e3:.2f} ms per decode step at position ~1,000", flush=True)
    out["ratio"] = out[131072] / out[8192]
    return out


def position_check(model: Path, budget, positions: list[int], device: str = "cuda", n: int = 64) -> dict:
    """A decode step's cost after prompts of each length in ``positions``
    (each with just the positions it needs allocated), over ``n`` decoded
    tokens: how a step grows with the sequence (attention over the used
    length; everything else flat)."""
    out = {}
    for p in positions:
        out[p] = step_time_at(model, p + 2 * n, p, budget, n, device)
        print(f"position {p}: {out[p] * 1e3:.2f} ms per decode step ({out[p] / out[positions[0]]:.2f}x position "
              f"{positions[0]})", flush=True)
    return out


def memory_check(model: Path, budget, n: int) -> dict:
    """GPU memory before and after ``n`` decoded tokens, and the host time per token."""
    import torch

    from fle_engine.runtime import Engine

    gc.collect()                 # nothing of an earlier engine in this process left in the figures
    torch.cuda.empty_cache()
    eng = Engine(model, device="cuda", cache_budget=budget, ctx_size=n + 16, profile_path="none", progress=False)
    rng = np.random.default_rng(2)
    v = eng.args.n_vocab
    before = torch.cuda.memory_allocated()
    reserved_before = torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    eng.generate([1], n, feed=rng.integers(v, size=n).tolist())
    dt = time.perf_counter() - t0
    res = dict(tokens=n, allocated_before=before, allocated_after=torch.cuda.memory_allocated(),
               reserved_before=reserved_before, reserved_after=torch.cuda.memory_reserved(), tok_s=n / dt,
               hit_rate=eng.cache.stats.hit_rate,
               host_policy_ms_per_token=eng.cache.stats.host_seconds / max(1, eng.cache.stats.steps) * 1e3,
               memory=eng.memory_report())
    print(f"memory over {n} tokens: allocated {before / 2**30:.3f} -> {res['allocated_after'] / 2**30:.3f} GiB, "
          f"reserved {reserved_before / 2**30:.3f} -> {res['reserved_after'] / 2**30:.3f} GiB; {res['tok_s']:.1f} tok/s, "
          f"hit rate {res['hit_rate']:.3f}", flush=True)
    eng.close()
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-bench", type=Path, default=None, help="a built llama-bench (CUDA)")
    p.add_argument("--llama-src", type=Path, default=None, help="llama.cpp source (dir, sdist or tarball) to build it")
    p.add_argument("--work", type=Path, default=Path("/tmp/fle-bench"), help="files and the build go here")
    p.add_argument("--shape", choices=sorted(SHAPES), default="30b-a3b")
    p.add_argument("--routing", default="uniform,calibrated", help="uniform, calibrated or a skew value; comma list")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="tokens decoded per run (llama-bench -n)")
    p.add_argument("-r", "--reps", type=int, default=3)
    p.add_argument("--fle-warmup", type=int, default=512,
                   help="tokens FLE decodes, unmeasured, before its timed runs (at least -n; default 512)")
    p.add_argument("-t", "--threads", type=int, default=16)
    p.add_argument("--no-all-gpu", action="store_true", help="skip the runs with every expert on the GPU")
    p.add_argument("--skip-upstream", action="store_true")
    p.add_argument("--miss-prefetch", default="0",
                   help="FLE runs with these --miss-prefetch settings (predicted misses copied per layer one layer "
                        "ahead; 0: off), comma list, each with every --miss-split")
    p.add_argument("--miss-split", default="gpu",
                   help="FLE runs with these --miss-split settings (gpu, cpu, auto, a fraction), comma list")
    p.add_argument("--mapped", action="store_true", dest="host_experts_mapped",
                   help="also an FLE run with the experts memory-mapped in the file (--host-experts mapped: every "
                        "miss on the CPU)")
    p.add_argument("--kernels", default="default",
                   help="FLE's one-token kernels, comma list, each run in turn: default (the environment's), cuda "
                        "(FLE_CUDA_MV=1: the CUDA C experts and Q8_0 dense products where they apply), cuda-pdl "
                        "(with programmatic dependent launch), cuda-pdl-hit (also the hit launch), triton "
                        "(FLE_CUDA_MV=0)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--link-gbps", type=float, default=25.0,
                   help="also print the modelled decode speed on a PCIe link of this speed (GB/s; default 25, a "
                        "PCIe 4 x16 GPU reading host memory), from the gpu and auto runs' measurements; 0: off")
    p.add_argument("--checks", action="store_true",
                   help="also: decode step cost at position 1,000 with 8,192 and 131,072 positions allocated, and "
                        "GPU memory over --memory-tokens decoded tokens (on the last file)")
    p.add_argument("--memory-tokens", type=int, default=10000)
    p.add_argument("--positions", default="",
                   help="also: the decode step's cost after prompts of these lengths, comma list (e.g. "
                        "1000,8192,32768), on the last file: how a step grows with the sequence")
    p.add_argument("--prefill", default="",
                   help="also prompt processing at these lengths, comma list (e.g. 1024,4096,8192): upstream with "
                        "-ub 512 and 4096, FLE with --fle-ubatch, the same GPU bytes, on the first routing's file")
    p.add_argument("--fle-ubatch", default="4096,8192", help="FLE's micro-batches for --prefill, comma list")
    p.add_argument("--no-decode", action="store_true", help="skip the decode runs (with --prefill)")
    p.add_argument("--row-steps", action="store_true",
                   help="with --prefill: every prompt length also as decode steps (one token and --prompt-rows "
                        "tokens per step), not only those below --prefill-min (to choose --prefill-min)")
    p.add_argument("--verify", default="",
                   help="routings (comma list, e.g. calibrated) whose file also gets the verify step's cost T(n), "
                        "n = 0..3, with the same cache budget (bench/verify_step.py)")
    p.add_argument("--verify-split", default="auto", help="the verify step's --miss-split (default auto)")
    p.add_argument("--verify-warmup", type=int, default=256, help="tokens decoded before the verify step is timed")
    p.add_argument("--verify-reps", type=int, default=30, help="replays per verify step size")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="FLE's device (cpu: a smoke test of the script, with --skip-upstream; times mean nothing)")
    args = p.parse_args(argv)
    kernel_sets = args.kernels.split(",")
    if args.device != "cuda" and not args.skip_upstream:
        raise SystemExit("--device cpu runs FLE alone: add --skip-upstream")
    if args.device != "cuda" and args.prefill:
        raise SystemExit("--prefill measures on the GPU: leave out --device cpu")
    if args.device != "cuda":
        args.link_gbps = 0              # the link model reads the pinned copy speed of a GPU

    from fle_quant.gguf_reader import GGUFModel
    from fle_quant.synth.fast import make_fast_model

    shape = SHAPES[args.shape]
    o = shape["overrides"]
    n_layer, n_exp, n_used = o["block_count"], o["expert_count"], o["expert_used_count"]
    args.work.mkdir(parents=True, exist_ok=True)
    exe = None
    if not args.skip_upstream:
        exe = args.llama_bench or (build_llama_bench(args.llama_src, args.work) if args.llama_src else None)
        if exe is None:
            raise SystemExit("give --llama-bench PATH or --llama-src SRC (or --skip-upstream)")
    gpu_layers = n_layer // 3                       # upstream: experts of this many layers on the GPU
    results = {"shape": args.shape, "n_gen": args.n_gen, "threads": args.threads, "runs": []}
    for routing in args.routing.split(","):
        if routing == "uniform":
            skew = 0.0
        elif routing == "calibrated":
            skew = calibrate_skew(n_exp, n_used)
        else:
            skew = float(routing)
        curve = {f"{f:.3f}": round(simulate_hit_rate(skew, n_exp, n_used, f), 3) for f in REPORT_CURVE}
        path = args.work / f"{args.shape}-skew{skew:.3f}.gguf"
        if not path.exists():
            if shape.get("one_file"):
                for old in args.work.glob(f"{args.shape}-skew*.gguf"):
                    old.unlink()
            t0 = time.time()
            extra = {"mtp": shape["mtp"]} if "mtp" in shape else {}
            make_fast_model(path, shape["arch"], seed=0, mix=shape["mix"], rules=shape["rules"], routing_skew=skew,
                            progress=False, **extra, **shape_overrides(o))
            print(f"wrote {path.name} ({path.stat().st_size / 2**30:.1f} GiB) in {time.time() - t0:.0f} s", flush=True)
        with GGUFModel.open(path) as g:
            exp_bytes = sum(t.n_bytes for t in g.tensors.values() if "_exps." in t.name)
        budget = exp_bytes * gpu_layers // n_layer
        row = {"routing": routing, "skew": skew, "simulated_curve": curve, "report_curve": {
            f"{f:.3f}": v for f, v in REPORT_CURVE.items()}, "expert_bytes": exp_bytes, "budget": budget}
        if exe is not None and not args.no_decode:
            try:
                row["upstream_tok_s"] = upstream_decode(exe, path, n_layer - gpu_layers, args.n_gen, args.threads,
                                                        args.reps)
                print(f"[{routing}] upstream -ncmoe {n_layer - gpu_layers}: {row['upstream_tok_s']:.1f} tok/s",
                      flush=True)
            except UpstreamFailed as e:
                row["upstream_error"] = str(e)
                print(f"[{routing}] {e}", flush=True)
        if args.prefill and routing == args.routing.split(",")[0]:
            prompts = [int(v) for v in args.prefill.split(",")]
            pf = row["prefill"] = {"prompts": prompts}
            if exe is not None:
                try:
                    pf["upstream"] = upstream_prefill(exe, path, n_layer - gpu_layers, prompts, [512, 4096],
                                                      args.threads, args.reps)
                    for r in pf["upstream"]:
                        print(f"[{routing}] upstream prefill {r['n_prompt']} tokens, -ub {r['n_ubatch']}: "
                              f"{r['tok_s']:.0f} tok/s", flush=True)
                except UpstreamFailed as e:
                    pf["upstream_error"] = str(e)
                    print(f"[{routing}] {e}", flush=True)
            pf["fle"] = fle_prefill(path, budget, prompts, [int(v) for v in args.fle_ubatch.split(",")], args.reps,
                                    row_steps=args.row_steps)
            pf["ratios"] = prefill_ratios(pf.get("upstream", []), pf["fle"])
            for n, r in pf["ratios"].items():
                if "ratio" in r:
                    print(f"[{routing}] prefill {n} tokens: FLE {r['fle_tok_s']:.0f} tok/s (-ub {r['fle_ubatch']}) / "
                          f"upstream {r['upstream_tok_s']:.0f} (-ub {r['upstream_ubatch']}) = {r['ratio']:.2f}",
                          flush=True)
        row["fle_split"] = {}
        runs = [(split, int(pf), "auto") for split in args.miss_split.split(",") for pf in args.miss_prefetch.split(",")]
        if args.host_experts_mapped:
            runs.append(("cpu", 0, "mapped"))         # every miss on the CPU, from the file's pages
        runs = [r + (k,) for k in kernel_sets for r in runs]
        for split, pf, host, kern in ([] if args.no_decode else runs):
            key = "mapped" if host == "mapped" else split if not pf else f"{split}+prefetch{pf}"
            key += "" if kern == "cuda" else f"/{kern}"
            with _kernels(kern):
                f = row["fle_split"][key] = fle_decode(path, budget, args.n_gen, args.reps, miss_split=split,
                                                       prefetch=pf, host_experts=host, device=args.device,
                                                       warmup=args.fle_warmup)
            f["kernels"] = kern
            if f["prefetch"] is not None:
                q = f["prefetch"]
                print(f"[{routing}] prefetch {pf}/layer: {q['copied_per_step']:.1f} experts/token copied ahead, "
                      f"{100 * q['used_fraction']:.1f} % of them used", flush=True)
            split = key
            print(f"[{routing}] FLE cache {budget / 2**30:.2f} GiB, misses {split} (CPU share {f['cpu_share']:.0%}, "
                  f"{f['cpu_kernels']} kernels): {f['tok_s']:.1f} tok/s, hit rate {f['hit_rate']:.3f}, "
                  f"{f['misses_per_token']:.1f} misses/token ({f['cpu_misses_per_token']:.1f} on the CPU, "
                  f"{f['cpu_busy_ms_per_token']:.2f} ms/token CPU busy), host {f['host_policy_ms_per_token']:.3f} "
                  f"ms/token policy ({f['host_boundary_ms_per_token']:.3f} at boundaries) + "
                  f"{f['host_launch_ms_per_token']:.3f} launch ({f['host_replay_ms_per_token']:.3f} replays; "
                  f"{f['cuda_calls']} calls)", flush=True)
            if "upstream_tok_s" in row:
                f["ratio"] = f["tok_s"] / row["upstream_tok_s"]
                print(f"[{routing}] ratio FLE (misses {split}) / upstream = {f['ratio']:.2f}", flush=True)
        if args.link_gbps and not args.no_decode:
            pinned = results.setdefault("pinned_copy_gbps", pinned_copy_bps() / 1e9)
            lm = row["link_model"] = link_model(row, args.link_gbps * 1e9, pinned * 1e9)
            if lm is not None:
                msg = (f"[{routing}] MODEL, not measured: PCIe at {args.link_gbps:g} GB/s (this link {pinned:.1f}): "
                       f"FLE misses on the GPU {lm['gpu_tok_s']:.1f} tok/s, hybrid {lm['hybrid_tok_s']:.1f} "
                       f"(CPU share {lm['hybrid_cpu_share']:.0%})")
                if "cpu_tok_s" in lm:
                    msg += f", misses on the CPU {lm['cpu_tok_s']:.1f} (measured: no PCIe)"
                if "upstream_tok_s" in lm:
                    msg += (f"; upstream {lm['upstream_tok_s']:.1f} (measured: its misses run on the CPU); "
                            f"ratio hybrid / upstream {lm['hybrid_ratio']:.2f}")
                print(msg, flush=True)
        if args.positions and routing == args.routing.split(",")[-1]:
            results["positions"] = position_check(path, budget, [int(v) for v in args.positions.split(",")],
                                                  args.device, 64 if args.device == "cuda" else 4)
        if args.no_decode:
            results["runs"].append(row)
            continue
        best = max(row["fle_split"], key=lambda k: row["fle_split"][k]["tok_s"])
        row["fle"] = f = row["fle_split"][best]
        if "upstream_tok_s" in row:
            row["ratio"] = f["tok_s"] / row["upstream_tok_s"]
            print(f"[{routing}] best: misses {best}, ratio FLE / upstream = {row['ratio']:.2f}", flush=True)
        if not args.no_all_gpu and routing == args.routing.split(",")[0]:
            if "upstream_tok_s" in row:
                row["upstream_all_gpu_tok_s"] = upstream_decode(exe, path, 0, args.n_gen, args.threads, args.reps)
            for kern in kernel_sets:
                tag = "" if kern == kernel_sets[0] else f"_{kern}"
                with _kernels(kern):
                    g = row["fle_all_gpu" + tag] = fle_decode(path, exp_bytes * 2, args.n_gen, args.reps,
                                                              device=args.device, warmup=args.fle_warmup)
                g["kernels"] = kern
                msg = f"[all on the GPU] FLE ({kern} kernels) {g['tok_s']:.1f} tok/s"
                if "upstream_tok_s" in row:
                    row["all_gpu_ratio" + tag] = g["tok_s"] / row["upstream_all_gpu_tok_s"]
                    msg += f", upstream {row['upstream_all_gpu_tok_s']:.1f}, ratio {row['all_gpu_ratio' + tag]:.2f}"
                print(msg, flush=True)
        if routing in args.verify.split(","):
            print(f"[{routing}] verify step (misses {args.verify_split}):", flush=True)
            row["verify"] = fle_verify(path, budget, args.verify_split, args.verify_warmup, args.verify_reps,
                                       args.device, shape.get("mtp", "none") != "none")
        results["runs"].append(row)
        if args.checks and routing == args.routing.split(",")[-1]:
            results["checks"] = {"ctx": ctx_check(path, budget), "memory": memory_check(path, budget,
                                                                                         args.memory_tokens)}
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
