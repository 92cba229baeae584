"""The verify step of drafted decoding on the engine: the cost of one step
of T = 1 + n tokens (n drafts) against the plain decode step, and the decode
rate that the report's acceptance would give with it.

    python3 bench/verify_step.py --model FILE.gguf --cache-budget third
    python3 bench/verify_step.py --shape 30b-a3b --routing calibrated   # bench/engine.py's file in --work

Steps: load the file under the cache budget (``third``: 1/3 of the file's
expert bytes, as bench/engine.py gives both engines), decode ``--warmup``
random tokens (teacher-forced; the cache policy runs and warms the slots),
then at that position replay each step ``--reps`` times with the cache as
it is: T(0) the decode step, T(n) the verify step of 1 + n tokens (one CUDA
graph each). Printed per n: T(n), T(n)/T(0), the bytes of missed experts
read over PCIe per step (the step reads each distinct missed expert of a
layer once: "union"; T one-token steps would read the sum over tokens), and
a decode rate MODELLED from the measured step costs and the report's
acceptance: with conditional acceptance a1, a2, a3 of drafts 1, 2, 3 (0.86,
0.78, 0.78), a step accepts E(n) = 1 + a1 + a1 a2 + ... tokens on average
and the rate is E(n) / (T(n) + n * draft cost). The draft cost per drafted
token is ``--draft-ms`` (default 0: the rate is then an upper bound for
drafting that is not free).

``--miss-split`` (as the engine's) measures T(n) with the CPU computing its
share of each step's distinct missed experts while the GPU reads the rest
(runtime.split); the table then also prints the bytes of one step on each
side against the per-token sums.

``--drafters eager,step`` (a file with an MTP head, e.g. ``--shape
80b-a3b-mtp``) also measures the drafting itself: for each drafter (the
engine's ``--mtp-drafter``) the engine's speculative loop runs
``--draft-tokens`` tokens at each n = 1..3 and the wall time of its draft
calls is averaged; the modelled rate is then printed per drafter with that
measured cost in place of ``--draft-ms``. The head of a random file accepts
next to nothing, so the call sizes are those of rejections (the queue: the
kept row and the verified token, then n - 1 one-row calls).

On a machine without CUDA, ``--device cpu`` runs the reference operations
on a small file (a smoke test; the times mean nothing).
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import time
from pathlib import Path

import numpy as np

ACCEPT = (0.86, 0.78, 0.78)


def expected_tokens(accept, n: int) -> float:
    """Tokens a step with ``n`` drafts settles on average: 1 + a1 + a1 a2 + ..."""
    e, p = 1.0, 1.0
    for a in accept[:n]:
        p *= a
        e += p
    return e


def _bench_engine():
    """bench/engine.py as a module (its shapes, calibration and factory call)."""
    spec = importlib.util.spec_from_file_location("bench_engine", Path(__file__).with_name("engine.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bench_file(shape: str, routing: str, work: Path) -> Path:
    """bench/engine.py's file for ``shape`` and ``routing`` (written when missing, as bench/engine.py does)."""
    be = _bench_engine()
    sh = be.SHAPES[shape]
    o = sh["overrides"]
    skew = {"uniform": 0.0}.get(routing)
    if skew is None:
        skew = be.calibrate_skew(o["expert_count"], o["expert_used_count"]) if routing == "calibrated" else float(
            routing)
    path = work / f"{shape}-skew{skew:.3f}.gguf"
    if not path.exists():
        from fle_quant.synth.fast import make_fast_model

        work.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        extra = {"mtp": sh["mtp"]} if "mtp" in sh else {}
        make_fast_model(path, sh["arch"], seed=0, mix=sh["mix"], rules=sh["rules"], routing_skew=skew, progress=False,
                        **extra, **be.shape_overrides(o))
        print(f"wrote {path.name} ({path.stat().st_size / 2**30:.1f} GiB) in {time.time() - t0:.0f} s", flush=True)
    return path


def expert_bytes(path: Path) -> "tuple[int, int]":
    """(layers, routed-expert bytes) of the file."""
    from fle_quant.gguf_reader import GGUFModel

    with GGUFModel.open(path) as g:
        return int(g.hparam("block_count")), sum(t.n_bytes for t in g.tensors.values() if "_exps." in t.name)


def third_budget(path: Path) -> int:
    """1/3 of the file's routed-expert bytes (bench/engine.py: the experts of
    a third of the layers)."""
    n_layer, exp_bytes = expert_bytes(path)
    return exp_bytes * (n_layer // 3) // n_layer


def budget_of(path: Path, text: str) -> "int | None":
    """``--cache-budget``: "third", "all" (twice the routed-expert bytes, as
    bench/engine.py's everything-on-the-GPU runs: every expert in a slot, so
    the step's growth with T without a single miss), or the engine's sizes."""
    from fle_engine.runtime import parse_budget

    if text == "third":
        return third_budget(path)
    if text == "all":
        return 2 * expert_bytes(path)[1]
    return parse_budget(text)


def draft_costs(eng, n_max: int, n_tokens: int, seed: int) -> dict:
    """The engine's speculative loop (``eng`` made with an MTP head) for
    ``n_tokens`` tokens after a random 16-token prompt at each n = 1 ..
    ``n_max``: per n, the mean wall time of a draft call (n tokens
    drafted) and of a verify step, and the acceptance (the loop's
    :class:`~fle_engine.speculative.SpecStats`). The first run of each n
    (graphs captured, kernels compiled) is not counted."""
    from fle_engine.speculative import SpecStats

    rng = np.random.default_rng(seed)
    prompt = rng.integers(eng.args.n_vocab, size=16).tolist()
    out = {"kind": eng.drafter.kind, "rows": []}
    for n in range(1, n_max + 1):
        list(eng.speculative(prompt, 8, n_draft=n))                # warm: captures, compiles
        st = SpecStats()
        list(eng.speculative(prompt, n_tokens, n_draft=n, stats=st))
        out["rows"].append({"drafts": n, "draft_calls": st.draft_calls,
                            "draft_ms": st.draft_seconds / max(1, st.draft_calls) * 1e3,
                            "verify_ms": st.verify_seconds / max(1, st.trunk_calls) * 1e3,
                            "acceptance": st.acceptance})
    return out


def run(model: Path, budget, device: str, warmup: int, reps: int, draft_ms: float, accept, seed: int,
        miss_split: str = "gpu", profile: tuple = (), drafters: tuple = (), draft_tokens: int = 64,
        miss_prefetch: int = 0) -> dict:
    from fle_engine.runtime import Engine

    ctx = max(256, warmup + 64, 16 + draft_tokens + 8)
    mtp = dict(mtp=True, mtp_drafter=drafters[0]) if drafters else {}
    eng = Engine(model, device=device, cache_budget=budget, ctx_size=ctx, profile_path="none", progress=False,
                 miss_split=miss_split, miss_prefetch=miss_prefetch, **mtp)
    try:
        rng = np.random.default_rng(seed)
        v = eng.args.n_vocab
        t0 = time.perf_counter()
        eng.generate([int(rng.integers(v))], warmup, feed=rng.integers(v, size=warmup).tolist())
        decode_tok_s = warmup / (time.perf_counter() - t0)
        res = {"model": str(model), "device": device, "cache_bytes": eng.cache.budget_used, "position": eng.launched,
               "warmup_tokens": warmup, "warmup_decode_tok_s": decode_tok_s,
               "warmup_hit_rate": eng.cache.stats.hit_rate, "reps": reps, "draft_ms": draft_ms,
               "accept": list(accept), "miss_split": miss_split, "miss_prefetch": miss_prefetch,
               "cpu_share": eng.split.share / 256 if eng.split is not None else 0.0, "rows": []}
        for n in range(len(accept) + 1):
            if eng.prefetch is not None:
                eng.prefetch.reset_counts()
            c = eng.step_cost(1 + n, reps=reps, seed=seed + n)
            if eng.prefetch is not None:    # experts copied ahead per step, and the share of them the step used
                pf = eng.prefetch.summary(reps + 1)            # step_cost's replays and its unmeasured first
                c = dict(c, prefetch_copied=pf["copied_per_step"], prefetch_used=pf["used_fraction"])
            res["rows"].append(dict(c, drafts=n))
        t_0 = res["rows"][0]["seconds"]
        # the link's speed, for the bound that the drafts' own misses put on T(n) (CUDA only)
        link = _bench_engine().pinned_copy_bps(256) if device == "cuda" else None
        res["pinned_copy_gbps"] = link / 1e9 if link else None
        for r in res["rows"]:
            n = r["drafts"]
            r["ratio"] = r["seconds"] / t_0
            # T(n) >= T(0) + the PCIe bytes the step reads beyond the one-token step's, at the link's speed
            r["pcie_bound_ratio"] = (1 + (r["pcie_bytes"] - res["rows"][0]["pcie_bytes"]) / link / t_0
                                     if link else None)
            r["expected_tokens"] = expected_tokens(accept, n)
            r["modelled_tok_s"] = r["expected_tokens"] / (r["seconds"] + n * draft_ms * 1e-3)
        if profile:
            res["profile"] = {str(n): profile_kernels(eng, 1 + n, min(reps, 20), seed + n) for n in profile}
        if drafters:
            res["drafting"] = [draft_costs(eng, len(accept), draft_tokens, seed)]
    finally:
        eng.close()
    eng = None                           # its device memory goes before the next engine loads
    gc.collect()
    for kind in drafters[1:]:           # the other drafters on an engine of their own, drafting only
        with Engine(model, device=device, cache_budget=budget, ctx_size=ctx, profile_path="none", progress=False,
                    miss_split=miss_split, mtp=True, mtp_drafter=kind) as other:
            res["drafting"].append(draft_costs(other, len(accept), draft_tokens, seed))
    for d in res.get("drafting", ()):
        for r in d["rows"]:
            t = res["rows"][r["drafts"]]
            r["modelled_tok_s"] = t["expected_tokens"] / (t["seconds"] + r["draft_ms"] * 1e-3)
    return res


def profile_kernels(eng, n_tok: int, reps: int, seed: int, top: int = 14) -> list[dict]:
    """GPU time per step of each kernel (by name, summed over its launches in
    the step) of the T = ``n_tok`` step, from torch's profiler over ``reps``
    replays of :meth:`step_cost` (CUPTI records the kernels that a replayed
    CUDA graph runs); the ``top`` largest, and the total over all kernels."""
    from torch.profiler import ProfilerActivity, profile

    eng.step_cost(n_tok, reps=2, seed=seed)              # captured and warm before the profiled replays
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.step_cost(n_tok, reps=reps, seed=seed)
    per = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        d = per.setdefault(e.name, [0.0, 0])
        d[0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        d[1] += 1
    steps = reps + 1                                      # step_cost runs one unmeasured step before its reps
    rows = [{"kernel": k, "us_per_step": v[0] / steps, "launches_per_step": v[1] / steps} for k, v in per.items()]
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    return [{"kernel": "(all kernels)", "us_per_step": total,
             "launches_per_step": sum(r["launches_per_step"] for r in rows)}] + rows[:top]


def report(res: dict) -> None:
    mb = 1e6
    print(f"{Path(res['model']).name}: expert cache {res['cache_bytes'] / 2**30:.2f} GiB, position {res['position']} "
          f"after {res['warmup_tokens']} warm-up tokens ({res['warmup_decode_tok_s']:.1f} tok/s decoding, hit rate "
          f"{res['warmup_hit_rate']:.3f}); {res['reps']} replays per step, cache frozen; --miss-split "
          f"{res.get('miss_split', 'gpu')} (CPU share {res.get('cpu_share', 0.0):.0%} of each layer's distinct misses)")
    print(f"{'n':>2} {'T':>2} {'T(n) ms':>9} {'T(n)/T(0)':>9} {'hit':>6} {'miss MB union':>14} {'sum':>9} "
          f"{'PCIe MB':>8} {'CPU MB':>7} {'PCIe sum':>9} {'CPU sum':>8} "
          f"{'misses':>7} {'distinct':>8} {'E(n)':>6} {'tok/s*':>8}")
    for r in res["rows"]:
        print(f"{r['drafts']:>2} {r['tokens']:>2} {r['seconds'] * 1e3:>9.3f} {r['ratio']:>9.3f} {r['hit_rate']:>6.3f} "
              f"{r['pcie_bytes_union'] / mb:>14.1f} {r['pcie_bytes_sum'] / mb:>9.1f} "
              f"{r['pcie_bytes'] / mb:>8.1f} {r['cpu_bytes'] / mb:>7.1f} {r['pcie_bytes_tokens'] / mb:>9.1f} "
              f"{r['cpu_bytes_tokens'] / mb:>8.1f} {r['miss_rows']:>7.1f} "
              f"{r['distinct_misses']:>8.1f} {r['expected_tokens']:>6.3f} {r['modelled_tok_s']:>8.1f}")
    if res.get("miss_prefetch"):
        print(f"--miss-prefetch {res['miss_prefetch']}: experts copied one layer ahead per step " + ", ".join(
            f"n = {r['drafts']}: {r['prefetch_copied']:.1f} ({r['prefetch_used']:.0%} used)" for r in res["rows"]))
    print("miss MB union / sum: bytes of missed experts per step, each distinct one once / summed over the step's "
          "tokens; PCIe MB / CPU MB: the step's split of the union (runtime.split's union rule), PCIe sum / CPU sum: "
          "what the T tokens' one-token steps would read on each side")
    a = ", ".join(f"{x:g}" for x in res["accept"])
    print(f"* MODELLED, not measured: from the measured step costs and the report's acceptance ({a} for drafts "
          f"1, 2, 3), rate = E(n) / (T(n) + n x {res['draft_ms']:g} ms draft cost per drafted token"
          + (", i.e. drafting taken as free)" if res["draft_ms"] == 0 else ")"))
    if res.get("pinned_copy_gbps"):
        bounds = ", ".join(f"n = {r['drafts']}: {r['pcie_bound_ratio']:.2f}" for r in res["rows"][1:])
        print(f"bound from the link alone (T(0) + the step's extra PCIe bytes at the measured "
              f"{res['pinned_copy_gbps']:.1f} GB/s pinned copy, everything else free), T(n)/T(0) >= {bounds}")
    for d in res.get("drafting", ()):
        rows = d["rows"]
        print(f"drafter '{d['kind']}': " + "; ".join(
            f"n = {r['drafts']}: draft call {r['draft_ms']:.2f} ms ({r['draft_calls']} calls, verify step "
            f"{r['verify_ms']:.2f} ms in the loop, acceptance {r['acceptance']:.2f}), tok/s* "
            f"{r['modelled_tok_s']:.1f}" for r in rows))
    if res.get("drafting"):
        print(f"  (tok/s*: MODELLED as above with each drafter's measured draft call in place of the draft cost; "
              f"plain decoding {1 / res['rows'][0]['seconds']:.1f} tok/s at T(0))")
    for n, rows in res.get("profile", {}).items():
        print(f"kernels of the T = {1 + int(n)} step (GPU us per step, launches per step):")
        for r in rows:
            print(f"  {r['us_per_step']:>9.1f} us {r['launches_per_step']:>6.1f}  {r['kernel'][:100]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="the GGUF file (else --shape/--routing in --work)")
    p.add_argument("--shape", default="30b-a3b", help="bench/engine.py's shape, when no --model (default 30b-a3b)")
    p.add_argument("--routing", default="calibrated", help="bench/engine.py's routing: uniform, calibrated or a skew")
    p.add_argument("--work", type=Path, default=Path("/tmp/fle-bench"), help="bench/engine.py's files (written when "
                   "missing)")
    p.add_argument("--cache-budget", default="third",
                   help="GPU bytes for expert slots: 'third' (1/3 of the expert bytes, bench/engine.py's), 'all' "
                        "(every expert cached: the step's growth with T without misses), 'auto' or a size such as 5GiB")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--warmup", type=int, default=256, help="tokens decoded before the measurement")
    p.add_argument("--reps", type=int, default=50, help="replays per step")
    p.add_argument("--draft-ms", type=float, default=0.0,
                   help="draft cost per drafted token in ms for the modelled rate (default 0: drafting free)")
    p.add_argument("--accept", default=",".join(map(str, ACCEPT)),
                   help="conditional acceptance of drafts 1, 2, 3 (default the report's 0.86,0.78,0.78)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--miss-split", default="gpu",
                   help="the engine's --miss-split (gpu, cpu, auto or the CPU's fraction): with a CPU share, each "
                        "step's distinct misses are split between the CPU and PCIe (default gpu)")
    p.add_argument("--profile", default="", help="draft counts (e.g. 0,2) whose step's kernels are profiled: GPU "
                   "time per step of each kernel, the largest printed")
    p.add_argument("--drafters", default="", help="MTP drafters to time (eager, step: the engine's --mtp-drafter; "
                   "e.g. eager,step) on a file with an MTP head (--shape 80b-a3b-mtp)")
    p.add_argument("--draft-tokens", type=int, default=64, help="tokens of each timed speculative run (default 64)")
    p.add_argument("--miss-prefetch", type=int, default=0,
                   help="the engine's --miss-prefetch: up to N predicted misses per layer copied one layer ahead, "
                        "for all the rows of a T-row step at once (default 0: off)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)

    from fle_quant.errors import FleError

    try:
        if args.profile and args.device != "cuda":
            raise FleError("--profile reads the GPU's kernels: it needs --device cuda")
        path = args.model or bench_file(args.shape, args.routing, args.work)
        budget = budget_of(path, args.cache_budget)
        accept = tuple(float(x) for x in args.accept.split(","))
        res = run(path, "auto" if budget is None else budget, args.device, args.warmup, args.reps, args.draft_ms,
                  accept, args.seed, miss_split=args.miss_split, miss_prefetch=args.miss_prefetch,
                  profile=tuple(int(x) for x in args.profile.split(",") if x.strip()),
                  drafters=tuple(x.strip() for x in args.drafters.split(",") if x.strip()),
                  draft_tokens=args.draft_tokens)
    except FleError as e:
        raise SystemExit(f"verify_step: {e}") from None
    report(res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
