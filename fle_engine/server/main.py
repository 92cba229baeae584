"""``serve``: load a model and serve it until SIGINT or SIGTERM."""
from __future__ import annotations

import os

import asyncio
import signal
import sys
from typing import TextIO

from aiohttp import web

from fle_quant.errors import FleError

from .http import create_app
from .slots import Engine, default_ctx_size

async def _listen(engine: Engine, host: str, port: int, log: TextIO, api_key: str | None = None) -> None:
    app = create_app(engine, api_key)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as e:
            raise FleError(f"cannot listen on {host}:{port}: {e.strerror or e}; "
                           "pick another --host or --port") from None
        addr = runner.addresses[0]
        shown = f"[{addr[0]}]" if ":" in str(addr[0]) else str(addr[0])
        print(f"fle-engine: listening on http://{shown}:{addr[1]} (model {engine.name!r}, context {engine.n_ctx} "
              f"tokens, {engine.n_parallel} slots of {engine.n_ctx_slot}{', MTP drafts' if engine.mtp else ''}"
              f"{f', prompt cache {engine.cache.limit >> 20} MiB' if engine.cache.enabled else ''})", file=log, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
                pass
        await stop.wait()
        print("fle-engine: shutting down", file=log, flush=True)
    finally:
        await runner.cleanup()


def serve(model_path: str, *, host: str = "127.0.0.1", port: int = 8080, ctx_size: int | None = None,
          device: str = "cpu", threads: int | None = None, mtp: bool = False, mtp_head: str | None = None,
          n_draft: int = 2, alias: str | None = None, log: TextIO = sys.stderr, runtime: dict | None = None,
          n_parallel: int = 2, cache_ram: float = 0, slot_save_path: str | None = None,
          api_key: str | None = None, draft_vocab: str | None = None, draft_vocab_corpus: str | None = None,
          draft_adaptive: bool = False, cache_protect_slots=()) -> int:
    """Load ``model_path`` and serve it until SIGINT or SIGTERM; with
    ``runtime`` (the engine's options) on the GPU engine. ``draft_vocab``
    (N or a list file, with ``draft_vocab_corpus`` for N) and
    ``draft_adaptive``: the MTP drafting options of ``fle-engine generate``;
    ``cache_protect_slots``: slots whose conversations other traffic does
    not push out of the RAM prompt cache (``--cache-protect-slot``)."""
    import os

    import torch

    from fle_quant.gguf_reader import GGUFModel

    from ..loader import load
    from ..tokenizer import Tokenizer

    if n_parallel < 1:
        raise FleError(f"--parallel must be at least 1, got {n_parallel}")
    if cache_ram < 0:
        raise FleError(f"--cache-ram must be 0 (off) or a size in MiB, got {cache_ram}")
    for i in cache_protect_slots:
        if not 0 <= i < n_parallel:
            raise FleError(f"--cache-protect-slot {i}: the server has slots 0..{n_parallel - 1} (--parallel)")
    # on the engine the slots are its lanes, decoded in batched steps (MTP drafts one sequence);
    # FLE_ENGINE_LANES=0 keeps one sequence that serves one slot at a time
    lanes_ok = os.environ.get("FLE_ENGINE_LANES", "1") != "0"
    n_seq = n_parallel if lanes_ok and not (mtp or mtp_head) else 1
    one_sequence = runtime is not None and n_seq == 1
    if cache_protect_slots and (not cache_ram or mtp or mtp_head or one_sequence):
        raise FleError("--cache-protect-slot needs the RAM prompt cache (--cache-ram MiB) on the reference path "
                       "or the engine's lanes, without --mtp")
    if slot_save_path:
        os.makedirs(slot_save_path, exist_ok=True)
    if not 0 <= port <= 65535:
        raise FleError(f"--port must lie in 0..65535, got {port}")
    if ctx_size is not None and ctx_size < 0:
        raise FleError(f"--ctx-size must be 0 (the model's own) or a number of tokens, got {ctx_size}")
    if threads is not None:
        if threads < 1:
            raise FleError(f"--threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    tok = Tokenizer.from_gguf(model_path)
    vocab = None
    if mtp or mtp_head:
        from ..draft_vocab import resolve

        vocab = resolve(draft_vocab, draft_vocab_corpus, tok, log=log)       # before the model's (long) load
    with GGUFModel.open(model_path) as g:
        n_ctx_train = g.hparam("context_length", None) if g.arch else None
    n_ctx_train = int(n_ctx_train) if n_ctx_train else None
    n_ctx = default_ctx_size(n_ctx_train, ctx_size)
    if n_ctx_train and n_ctx > n_ctx_train:
        print(f"fle-engine: warning: --ctx-size {n_ctx} is beyond the model's training context ({n_ctx_train})",
              file=log)
    print(f"fle-engine: loading {model_path} on {device}", file=log, flush=True)
    if runtime is not None:
        from ..runtime import Engine as Runtime

        model = Runtime(model_path, device=device, ctx_size=n_ctx, log=lambda m: print(m, file=log, flush=True),
                        n_seq=n_seq, **runtime)
    else:
        model = load(model_path, device=device)
    if tok.n_vocab > model.n_vocab:
        raise FleError(f"{model_path}: the vocabulary has {tok.n_vocab} tokens but the model outputs "
                       f"{model.n_vocab}; the file is inconsistent")
    if runtime is not None and (mtp or mtp_head):
        mtp = True                   # the engine loaded the head (runtime's mtp, mtp_drafter)
    elif mtp_head:
        if not hasattr(model.net, "load_mtp"):
            raise FleError(f"{model_path}: FLE runs no MTP head for {model.arch} models")
        model.net.load_mtp(mtp_head)
        mtp = True
    name = alias or os.path.basename(str(model_path))
    engine = Engine(model, tok, n_ctx=n_ctx, name=name, n_ctx_train=n_ctx_train, mtp=mtp, n_draft=n_draft, log=log,
                    n_parallel=n_parallel, cache_ram_mib=cache_ram, slot_save_path=slot_save_path,
                    draft_vocab=vocab, draft_adaptive=draft_adaptive, cache_protect_slots=cache_protect_slots)
    try:
        asyncio.run(_listen(engine, host, port, log, api_key))
    finally:
        if runtime is not None:
            model.close()            # saves the expert cache's usage profile, counts the last step's routing
            _print_summary(model, log)
    return 0


def _print_summary(model, log: TextIO) -> None:
    """The engine's run as ``fle-engine generate`` ends it (throughput, the
    expert cache's hit rate and misses per token, host time per token), as
    llama-server prints its timings at exit; nothing if nothing ran."""
    st = model.stats
    if st.prompt_tokens or st.gen_tokens or model.cache.stats.tokens:
        print(f"fle-engine: {st.summary(model.cache)}", file=log, flush=True)
