"""The HTTP layer: aiohttp handlers answering as llama-server does."""
from __future__ import annotations

import asyncio
import json
import secrets
import string
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from aiohttp import web

from fle_quant.errors import FleError

from .. import __version__
from .schema import ApiError, _chat_prompt, _completion_prompt, _options
from .slots import Engine, Job, Result
from .text import ReasoningStream

_FINGERPRINT = f"fle-engine-{__version__}"
_ID_CHARS = string.ascii_letters + string.digits

ENGINE = web.AppKey("engine", Engine)
LOCK = web.AppKey("lock", asyncio.Lock)
EXECUTOR = web.AppKey("executor", ThreadPoolExecutor)
ACTIVE = web.AppKey("active", set)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except FleError as e:   # bad input found deeper: a template error, text that cannot be tokenized
        return ApiError(str(e)).response()
    except web.HTTPException as e:
        if e.status == 404:
            return ApiError("File Not Found", 404, "not_found_error").response()
        if e.status >= 400:
            return ApiError(e.reason, e.status).response()
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:  # noqa: BLE001 - a bug: answer 500 and leave the traceback in the log
        traceback.print_exc(file=sys.stderr)
        return ApiError(f"{type(e).__name__}: {e}", 500, "server_error").response()


async def _json_body(request: web.Request) -> dict:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


def _client_gone(request: web.Request) -> bool:
    t = request.transport
    return t is None or t.is_closing()


async def _generate(request: web.Request, job: Job, on_text: Callable[[str], Any]) -> Result:
    """Run ``job`` in the worker thread once the lock is ours, awaiting
    ``on_text(piece)`` for each piece of released text. Stops the decode
    when the client goes away (seen between pieces, or by a periodic check
    while none come) or when ``on_text`` raises."""
    app = request.app
    engine = app[ENGINE]
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()
    async with app[LOCK]:
        if _client_gone(request):
            raise ConnectionResetError("the client went away while the request waited")
        app[ACTIVE].add(cancel)

        def emit(piece: str) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, piece)

        fut = loop.run_in_executor(app[EXECUTOR], engine.run, job, cancel, emit)
        # the emits were scheduled before the worker returned, so this comes last
        fut.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while True:
                try:
                    piece = await asyncio.wait_for(queue.get(), 0.25)
                except asyncio.TimeoutError:
                    if _client_gone(request):
                        cancel.set()
                    continue
                if piece is None:
                    break
                if _client_gone(request):
                    cancel.set()
                    raise ConnectionResetError("the client went away")
                await on_text(piece)
            return fut.result()
        finally:
            cancel.set()
            app[ACTIVE].discard(cancel)
            if not fut.done():
                # hold the lock until the worker has stopped; its error, or a
                # second cancellation of ours, is not this path's to report
                # (Engine.run's own lock still keeps a stray worker exclusive)
                try:
                    await asyncio.shield(fut)
                except BaseException:  # noqa: BLE001
                    pass


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _cmpl_id(prefix: str) -> str:
    return prefix + "".join(secrets.choice(_ID_CHARS) for _ in range(32))


def _head(engine: Engine, cid: str, obj: str) -> dict:
    return {"id": cid, "object": obj, "created": int(time.time()), "model": engine.name,
            "system_fingerprint": _FINGERPRINT}


async def _stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def _streaming(resp: web.StreamResponse, body) -> web.StreamResponse:
    """Run ``body`` (which writes the events) and end the stream with
    ``[DONE]``; an error after the headers went out becomes an error event,
    as llama-server sends it; a client that went away gets nothing more."""
    try:
        try:
            await body()
        except ConnectionResetError:
            raise
        except (ApiError, FleError) as e:
            err = e if isinstance(e, ApiError) else ApiError(str(e))
            await resp.write(_sse({"error": {"code": err.status, "message": err.message, "type": err.kind}}))
        except Exception as e:  # noqa: BLE001 - a bug: report it in the stream and the log
            traceback.print_exc(file=sys.stderr)
            await resp.write(_sse({"error": {"code": 500, "message": f"{type(e).__name__}: {e}",
                                             "type": "server_error"}}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        pass
    return resp


async def handle_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await _json_body(request)
    prompt = await asyncio.to_thread(_completion_prompt, body, engine)
    opts = _options(body, engine, len(prompt))
    cid = _cmpl_id("cmpl-")
    job = Job(prompt, opts.n_predict, opts.params, opts.stop)

    def final(res: Result, text: str) -> dict:
        return {**_head(engine, cid, "text_completion"),
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": res.finish_reason}],
                "usage": res.usage(), "timings": res.timings()}

    if not opts.stream:
        try:
            res = await _run(request, job, None)
        except ConnectionResetError:   # nobody is left to read an answer
            return web.Response(status=499, reason="Client Closed Request")
        return web.json_response(final(res, res.text))
    resp = await _stream(request)

    async def send(piece: str) -> None:
        await resp.write(_sse({**_head(engine, cid, "text_completion"),
                               "choices": [{"text": piece, "index": 0, "logprobs": None, "finish_reason": None}]}))

    async def body_() -> None:
        res = await _run(request, job, send)
        await resp.write(_sse(final(res, "")))

    return await _streaming(resp, body_)


async def handle_chat(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await _json_body(request)
    chat = await asyncio.to_thread(_chat_prompt, body, engine)
    opts = _options(body, engine, len(chat.tokens))
    cid = _cmpl_id("chatcmpl-")
    job = Job(chat.tokens, opts.n_predict, opts.params, opts.stop)
    split = ReasoningStream(chat.thinking_open, chat.split_reasoning)

    if not opts.stream:
        try:
            res = await _run(request, job, None)
        except ConnectionResetError:   # nobody is left to read an answer
            return web.Response(status=499, reason="Client Closed Request")
        split.add(res.text)
        split.finish()
        message = {"role": "assistant", "content": split.content}
        if split.reasoning:
            message["reasoning_content"] = split.reasoning
        return web.json_response({**_head(engine, cid, "chat.completion"),
                                  "choices": [{"finish_reason": res.finish_reason, "index": 0, "message": message}],
                                  "usage": res.usage(), "timings": res.timings()})
    resp = await _stream(request)

    def chunk(delta: dict) -> bytes:
        return _sse({**_head(engine, cid, "chat.completion.chunk"),
                     "choices": [{"finish_reason": None, "index": 0, "delta": delta}]})

    async def send_deltas(dr: str, dc: str) -> None:
        if dr:
            await resp.write(chunk({"reasoning_content": dr}))
        if dc:
            await resp.write(chunk({"content": dc}))

    async def send(piece: str) -> None:
        await send_deltas(*split.add(piece))

    async def body_() -> None:
        await resp.write(chunk({"role": "assistant", "content": None}))
        res = await _run(request, job, send)
        await send_deltas(*split.finish())
        last = {**_head(engine, cid, "chat.completion.chunk"),
                "choices": [{"finish_reason": res.finish_reason, "index": 0, "delta": {}}]}
        if opts.include_usage:
            await resp.write(_sse(last))
            # OpenAI's usage chunk: no choices
            last = {**_head(engine, cid, "chat.completion.chunk"), "choices": [], "usage": res.usage()}
        last["timings"] = res.timings()
        await resp.write(_sse(last))

    return await _streaming(resp, body_)


async def _run(request: web.Request, job: Job, on_text) -> Result:
    if job.n_predict == 0:     # llama-server: nothing to generate, an empty answer
        return Result("", "length", len(job.prompt), 0)

    async def ignore(_: str) -> None:
        pass

    return await _generate(request, job, on_text or ignore)


async def handle_health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def handle_models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    args = engine.model.args
    return web.json_response({"object": "list", "data": [{
        "id": engine.name, "object": "model", "created": engine.created, "owned_by": "fle",
        "meta": {"arch": engine.model.arch, "n_vocab": engine.tok.n_vocab, "n_ctx": engine.n_ctx,
                 "n_ctx_train": engine.n_ctx_train, "n_embd": getattr(args, "n_embd", None), "mtp": engine.mtp},
    }]})


def create_app(engine: Engine) -> web.Application:
    """The aiohttp application serving ``engine``."""
    app = web.Application(middlewares=[_errors], client_max_size=64 * 2**20)
    app[ENGINE] = engine
    app[ACTIVE] = set()

    async def startup(app: web.Application) -> None:
        app[LOCK] = asyncio.Lock()
        app[EXECUTOR] = ThreadPoolExecutor(1, thread_name_prefix="fle-decode")

    async def shutdown(app: web.Application) -> None:
        for cancel in list(app[ACTIVE]):
            cancel.set()

    async def cleanup(app: web.Application) -> None:
        app[EXECUTOR].shutdown(wait=True)

    app.on_startup.append(startup)
    app.on_shutdown.append(shutdown)
    app.on_cleanup.append(cleanup)
    for prefix in ("", "/v1"):
        app.router.add_get(prefix + "/health", handle_health)
        app.router.add_get(prefix + "/models", handle_models)
        app.router.add_post(prefix + "/completions", handle_completions)
        app.router.add_post(prefix + "/chat/completions", handle_chat)
    return app
