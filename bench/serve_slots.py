"""Throughput of ``fle-engine serve`` with 1 and with 2 slots on a factory
model (reference path, CPU): N clients at once, each asking for a fixed
number of tokens (ignore_eos), generated tokens per second of wall time
and per second of this process's CPU time (steadier when other work shares
the cores; torch runs on ``--threads`` threads).

    PYTHONPATH=. python bench/serve_slots.py [--arch qwen3moe] [--clients 4] [--tokens 64] [--threads 1]
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import torch
from aiohttp.test_utils import TestClient, TestServer

import fle_engine
from fle_engine.server import Engine, create_app
from fle_engine.tokenizer import Tokenizer
from fle_quant.synth import make_model


async def _load(engine, n_clients: int, n_tokens: int) -> tuple[float, float, int]:
    async with TestClient(TestServer(create_app(engine))) as client:
        async def one(i):
            r = await client.post("/v1/completions", json={"prompt": f"client {i} says hello to the river",
                                                           "max_tokens": n_tokens, "ignore_eos": True,
                                                           "temperature": 0.7, "seed": i})
            return (await r.json())["usage"]["completion_tokens"]
        await one(99)                                    # warm-up
        t0, c0 = time.perf_counter(), time.process_time()
        got = await asyncio.gather(*(one(i) for i in range(n_clients)))
        return time.perf_counter() - t0, time.process_time() - c0, sum(got)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen3moe")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        path = make_model(Path(d) / "m.gguf", args.arch, mix="f32")
        model, tok = fle_engine.load(path), Tokenizer.from_gguf(path)
        rates = {}
        for n_par in (1, 2):
            eng = Engine(model, tok, n_ctx=512 * n_par, name="bench", n_parallel=n_par)
            wall, cpu, n = asyncio.run(_load(eng, args.clients, args.tokens))
            eng.stop()
            rates[n_par] = (n / wall, n / cpu)
            print(f"{args.arch}: {n_par} slot(s), {args.clients} clients x {args.tokens} tokens: {n} tokens in "
                  f"{wall:.2f} s = {n / wall:.1f} tokens/s ({cpu:.2f} CPU s = {n / cpu:.1f} tokens per CPU second)")
        print(f"{args.arch}: 2 slots / 1 slot = {rates[2][0] / rates[1][0]:.2f}x wall, "
              f"{rates[2][1] / rates[1][1]:.2f}x per CPU second (steadier on a shared machine)")


if __name__ == "__main__":
    main()
