"""Throughput of ``fle-engine serve`` with 1 and with 2 slots on a factory
model (reference path, CPU): N clients at once, each asking for a fixed
number of tokens (ignore_eos), generated tokens per second of wall time
and per second of this process's CPU time, and the decode thread's rounds
split into the engine's calls and the rest (the server's host work per
round and per token); torch runs on ``--threads``
threads. On a shared machine single runs swing by 2x either way, so the
1-slot and 2-slot runs alternate ``--repeat`` times and the ratio printed
last is the median of the pairs' ratios.

The factory model has its default sizes: 28 MiB of float32 weights, which
a server CPU's last-level cache holds, so a step is bound by compute and
per-operation overhead. ``--set KEY=VALUE`` (repeatable) passes GGUF sizes
to the factory, e.g. ``--set block_count=8 --set embedding_length=1024
--set expert_feed_forward_length=1024`` for a model larger than the
caches (a decode bound by reading the weights, as a real model's). The
model's weight size is printed first.

With ``--engine`` the server runs on the engine (``runtime.Engine``: CUDA
graphs and the Triton kernels with CUDA, else its reference operations):
at 2 slots the engine holds two lanes and every round is one batched step
of both, at 1 slot one lane (``--mix``: the factory's quant mix, ``release``
by default there; ``--device``).

    PYTHONPATH=. python bench/serve_slots.py [--arch qwen3moe] [--clients 4] [--tokens 64] [--threads 1] [--repeat 5]
        [--set KEY=VALUE ...] [--engine [--device cuda|cpu] [--mix release]] [--host-profile N]
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch
from aiohttp.test_utils import TestClient, TestServer

import fle_engine
from fle_engine.server import Engine, create_app
from fle_engine.tokenizer import Tokenizer
from fle_quant.synth import make_model


def _count_decode_cpu(engine, prof=None) -> dict:
    """Accumulate the decode thread's own CPU time over its rounds (the
    model and the scheduler, without the HTTP side), and the rounds' wall
    time split into the engine's calls (on lanes ``launch_lanes``,
    ``finish_lanes`` (its wait for the step) and ``lane_prompt``; on one sequence its decode steps ``_launch`` /
    ``_consume`` and prefill) and the rest of the round: the server's host
    work (sampling, text, bookkeeping)."""
    acc = {"cpu": 0.0, "round": 0.0, "engine": 0.0, "rounds": 0, "tokens": 0}
    inner = engine._round

    def timed(active):
        t, w = time.thread_time(), time.perf_counter()
        n0 = sum(s.n_decoded for s in active)
        if prof is not None:
            prof.enable()
        try:
            inner(active)
        finally:
            if prof is not None:
                prof.disable()
            acc["cpu"] += time.thread_time() - t
            acc["round"] += time.perf_counter() - w
            acc["rounds"] += 1
            acc["tokens"] += sum(s.n_decoded for s in active) - n0

    engine._round = timed
    model = engine.model
    names = () if not engine.runtime else ("launch_lanes", "finish_lanes", "lane_prompt") if engine.lanes else \
        ("_launch", "_consume", "_prefill_prompt")          # (the reference path: all of a round is "the rest")
    for name in names:
        real = getattr(model, name, None)
        if real is None:
            continue

        def wrapped(*a, _real=real, **kw):
            w = time.perf_counter()
            try:
                return _real(*a, **kw)
            finally:
                acc["engine"] += time.perf_counter() - w

        setattr(model, name, wrapped)
    return acc


def _split_line(acc: dict, before: dict, n_slots: int) -> str:
    d = {k: acc[k] - before[k] for k in ("round", "engine", "rounds", "tokens")}
    r = max(d["rounds"], 1)
    rest = d["round"] - d["engine"]
    return (f"per round ({d['rounds']} rounds, {d['tokens'] / r:.2f} tokens each): {1e3 * d['round'] / r:.3f} ms = "
            f"engine {1e3 * d['engine'] / r:.3f} ms + the rest {1e3 * rest / r:.3f} ms "
            f"({1e3 * rest / max(d['tokens'], 1):.3f} ms per token; {n_slots} slot(s))")


def _step_times(models: dict, reps: int = 100) -> str:
    """The engine alone, CUDA: GPU time per step of the one-sequence graph
    (1 slot) and of the batched graph of 1 and 2 rows (2 slots), replayed
    back to back between two events, and wall time per ``step_lanes`` call
    (launch, wait, read, policy). The lanes and the sequence are reset
    afterwards."""
    one, two = models[1], models[2]
    parts = []

    def gpu_ms(run) -> float:
        run()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            run()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / reps

    one.reset()
    list(one.tokens([1, 2, 3], 2))             # the graphs captured
    one.reset()
    parts.append(f"one-sequence step {gpu_ms(one._run_one):.3f} ms")
    one.reset()
    for n in (1, 2):
        lanes = list(range(n))
        two.step_lanes(lanes, [1] * n)          # captured
        w = time.perf_counter()
        for _ in range(reps):
            two.step_lanes(lanes, [1] * n)
        wall = (time.perf_counter() - w) / reps
        parts.append(f"batched step of {n} row(s) {gpu_ms(lambda: two._run_lanes(n)):.3f} ms "
                     f"(step_lanes {1e3 * wall:.3f} ms wall)")
        two.flush()
        for i in lanes:
            two.lane_reset(i)
    torch.cuda.synchronize()
    return "GPU time per step, replayed back to back: " + ", ".join(parts)


async def _load(engine, decode: dict, n_clients: int, n_tokens: int) -> tuple[float, float, float, int]:
    async with TestClient(TestServer(create_app(engine))) as client:
        async def one(i):
            r = await client.post("/v1/completions", json={"prompt": f"client {i} says hello to the river",
                                                           "max_tokens": n_tokens, "ignore_eos": True,
                                                           "temperature": 0.7, "seed": i})
            return (await r.json())["usage"]["completion_tokens"]
        # warm-up: every slot and batch size once (the engine captures a lane's graphs on their first use)
        await asyncio.gather(*(one(90 + i) for i in range(engine.n_parallel)))
        t0, c0, d0 = time.perf_counter(), time.process_time(), decode["cpu"]
        before = dict(decode)
        got = await asyncio.gather(*(one(i) for i in range(n_clients)))
        decode["last"] = _split_line(decode, before, engine.n_parallel)
        return time.perf_counter() - t0, time.process_time() - c0, decode["cpu"] - d0, sum(got)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen3moe")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5, help="alternating 1-slot / 2-slot pairs")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a factory model size, GGUF key without the arch prefix, dots as underscores")
    ap.add_argument("--engine", action="store_true", help="serve on runtime.Engine (slots as its lanes)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="with --engine")
    ap.add_argument("--mix", default=None, help="the factory's quant mix (f32; release with --engine)")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="profile the decode thread's rounds (cProfile) and print the N functions with the most "
                         "own time, per slot count (the profiler's overhead inflates the times)")
    args = ap.parse_args()
    sizes = {}
    for kv in args.set:
        key, _, value = kv.partition("=")
        sizes[key] = int(value)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        mix = args.mix or ("release" if args.engine else "f32")
        path = make_model(Path(d) / "m.gguf", args.arch, mix=mix, **sizes)
        tok = Tokenizer.from_gguf(path)
        if args.engine:
            from fle_engine.runtime import Engine as Runtime

            models = {n: Runtime(path, device=args.device, ctx_size=512 * n, n_seq=n, profile_path="none",
                                 progress=False, log=lambda m: None) for n in (1, 2)}
            print(f"{args.arch}: factory model ({mix}) {' '.join(args.set) or '(default sizes)'} on the engine "
                  f"({args.device}, {'CUDA graphs' if models[1]._graph is not None else 'eager'}): "
                  f"{models[1].net.dense_bytes / 2**20:.1f} MiB of dense weights, "
                  f"{models[1].host.nbytes / 2**20:.1f} MiB of experts")
        else:
            model = fle_engine.load(path)
            models = {1: model, 2: model}
            n_bytes = sum(t.numel() * t.element_size() for t in model.net.parameters())
            print(f"{args.arch}: factory model {' '.join(args.set) or '(default sizes)'}: {n_bytes / 2**20:.1f} MiB "
                  f"of weights, {model.args}")
        if args.engine and args.device == "cuda" and models[1]._graph is not None:
            print(f"{args.arch}: {_step_times(models)}")
        engines = {n: Engine(models[n], tok, n_ctx=512 * n, name="bench", n_parallel=n) for n in (1, 2)}
        profs = {n: cProfile.Profile() if args.host_profile else None for n in (1, 2)}
        decode = {n: _count_decode_cpu(e, profs[n]) for n, e in engines.items()}
        wall_ratios, cpu_ratios, dec_ratios = [], [], []
        for rep in range(args.repeat):
            rates = {}
            for n_par in (1, 2) if rep % 2 == 0 else (2, 1):
                wall, cpu, dec, n = asyncio.run(_load(engines[n_par], decode[n_par], args.clients, args.tokens))
                rates[n_par] = (n / wall, n / cpu, n / dec)
                print(f"{args.arch}: {n_par} slot(s), {args.clients} clients x {args.tokens} tokens: {n} tokens in "
                      f"{wall:.2f} s = {n / wall:.1f} tokens/s ({cpu:.2f} CPU s = {n / cpu:.1f} tokens per CPU "
                      f"second; decode thread {1e3 * dec / n:.2f} CPU ms per token)")
                print(f"{args.arch}: {n_par} slot(s): {decode[n_par]['last']}")
            wall_ratios.append(rates[2][0] / rates[1][0])
            cpu_ratios.append(rates[2][1] / rates[1][1])
            dec_ratios.append(rates[2][2] / rates[1][2])
            print(f"{args.arch}: pair {rep + 1}: 2 slots / 1 slot = {wall_ratios[-1]:.2f}x wall, "
                  f"{cpu_ratios[-1]:.2f}x per CPU second, {dec_ratios[-1]:.2f}x per decode-thread CPU second")
        for eng in engines.values():
            eng.stop()
        if args.engine:
            for m in models.values():
                m.close()
        for n, prof in profs.items():
            if prof is not None:
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.host_profile)
                print(f"{args.arch}: {n} slot(s): the decode thread's rounds, by own time\n{out.getvalue()}")
        print(f"{args.arch}: 2 slots / 1 slot, median of {args.repeat} pairs = {statistics.median(wall_ratios):.2f}x "
              f"wall, {statistics.median(cpu_ratios):.2f}x per CPU second, {statistics.median(dec_ratios):.2f}x per "
              f"decode-thread CPU second (pairs, wall: "
              f"{' '.join(f'{r:.2f}' for r in wall_ratios)})")


if __name__ == "__main__":
    main()
