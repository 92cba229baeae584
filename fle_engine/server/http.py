"""The HTTP layer: aiohttp handlers answering as llama-server does.

Generation endpoints hand a :class:`~.slots.Job` to the engine's
scheduler and relay what it releases; the others read the engine's state.
CORS headers go on every answer (``OPTIONS`` preflights answered), and with
an API key every endpoint but ``/health``, ``/v1/health`` and the chat page
at ``/`` wants ``Authorization: Bearer KEY`` (or ``X-Api-Key``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import string
import sys
import threading
import time
import traceback
from typing import Any, Callable

from aiohttp import web

from fle_quant.errors import FleError

from .. import __version__
from ..chat import render_prompt
from . import tools as T
from .schema import ApiError, _chat_prompt, _completion_prompt, _json_field, _options, _prompt_ids, _show
from .slots import Engine, Job, Result, TokenProb
from .text import ReasoningStream

_FINGERPRINT = f"fle-engine-{__version__}"
_ID_CHARS = string.ascii_letters + string.digits

ENGINE = web.AppKey("engine", Engine)
API_KEY = web.AppKey("api_key", object)
ACTIVE = web.AppKey("active", set)
CLOSING = web.AppKey("closing", dict)

_OPEN_PATHS = {"/", "/health", "/v1/health"}    # the chat page loads without the key and asks for it


@web.middleware
async def _cors(request: web.Request, handler):
    if request.method == "OPTIONS":
        resp = web.Response(status=204)
    else:
        resp = await handler(request)
    origin = request.headers.get("Origin")
    resp.headers["Access-Control-Allow-Origin"] = origin or "*"
    if origin:
        resp.headers["Access-Control-Allow-Credentials"] = "true"
    resp.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
    resp.headers["Access-Control-Allow-Headers"] = request.headers.get("Access-Control-Request-Headers", "*")
    return resp


@web.middleware
async def _auth(request: web.Request, handler):
    key = request.app[API_KEY]
    if key and request.method != "OPTIONS" and request.path not in _OPEN_PATHS:
        got = request.headers.get("Authorization", "")
        got = got[len("Bearer "):] if got.startswith("Bearer ") else request.headers.get("X-Api-Key", "")
        if not secrets.compare_digest(got.encode(), str(key).encode()):
            return ApiError("Invalid API Key", 401, "authentication_error").response()
    return await handler(request)


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
        body = json.loads(raw) if raw.strip() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


def _client_gone(request: web.Request) -> bool:
    t = request.transport
    return t is None or t.is_closing()


def _check_open(request: web.Request) -> None:
    if request.app[CLOSING].get("closing"):
        raise ApiError("the server is shutting down", 503, "unavailable_error")


async def _generate(request: web.Request, jobs: list[Job],
                    on_text: Callable[[int, str, list], Any] | None) -> list[Result]:
    """Queue ``jobs`` (the ``n`` completions of one request) on the engine,
    awaiting ``on_text(index, piece, probs)`` for each piece of released
    text (None: an answer that is not streamed; the engine then hands over
    nothing before the end, which spares the event loop a wake-up per
    token). Stops the decode when the client goes away (seen between pieces,
    or by a periodic check while none come) or when ``on_text`` raises."""
    app = request.app
    engine = app[ENGINE]
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()
    if _client_gone(request):
        raise ConnectionResetError("the client went away")

    def emitter(i: int) -> Callable[[str, list], None] | None:
        if on_text is None:
            return None
        return lambda piece, probs: loop.call_soon_threadsafe(queue.put_nowait, (i, piece, probs))

    cfuts = engine.submit_group(jobs, cancel, [emitter(i) for i in range(len(jobs))])
    futs = [asyncio.wrap_future(f) for f in cfuts]
    for fut in futs:
        # a job's emits were scheduled before its result was set, so its end marker comes after them
        fut.add_done_callback(lambda _: loop.call_soon(queue.put_nowait, None))
    app[ACTIVE].add(cancel)
    try:
        left = len(futs)
        while left:
            try:
                item = await asyncio.wait_for(queue.get(), 0.25)
            except asyncio.TimeoutError:
                if _client_gone(request):
                    cancel.set()
                continue
            if item is None:
                left -= 1
                continue
            if _client_gone(request):
                cancel.set()
                raise ConnectionResetError("the client went away")
            if on_text is not None:
                await on_text(*item)
        return [f.result() for f in futs]
    finally:
        cancel.set()
        app[ACTIVE].discard(cancel)
        for fut in futs:
            if not fut.done():
                try:
                    await asyncio.shield(fut)
                except BaseException:  # noqa: BLE001 - not this path's to report
                    pass


_INLINE_BYTES = 16384      # requests up to this size are prepared on the event loop


async def _prepare(request: web.Request, fn, *args):
    """``fn(*args)`` (tokenizing, rendering the template, building a grammar):
    on the event loop for a small request, in a worker thread for a large
    one. A thread hop costs a GIL hand-over each way while the decode thread
    is busy (milliseconds each), which delays a small request's admission by
    several decode rounds; a large one would stall the loop."""
    n = request.content_length
    if n is not None and n <= _INLINE_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def _needs_thread(body: dict) -> bool:
    """Whether building the request's jobs compiles a grammar (slow)."""
    from . import grammar as G

    return G.requested(body) is not None or body.get("tool_choice") not in (None, "auto", "none")


async def _make_jobs(request: web.Request, opts, body: dict, engine: Engine, prompt: list[int], chat=None):
    if _needs_thread(body):
        return await asyncio.to_thread(_jobs, opts, body, engine, prompt, chat)
    return _jobs(opts, body, engine, prompt, chat)


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


async def _streaming(resp: web.StreamResponse, body, done: bool = True) -> web.StreamResponse:
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
        if done:
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        pass
    return resp


# ---------------------------------------------------------------- token probabilities


def _piece(engine: Engine, tid: int) -> tuple[str, list[int]]:
    b = engine.tok.decode_token(tid, special=True) if tid < engine.tok.n_vocab else b""
    return b.decode("utf-8", errors="replace"), list(b)


def _prob_entry(engine: Engine, p: TokenProb, with_id: bool = True) -> dict:
    text, raw = _piece(engine, p.id)
    e = {"id": p.id, "token": text, "logprob": p.logprob, "bytes": raw} if with_id else \
        {"token": text, "logprob": p.logprob, "bytes": raw}
    tops = []
    for tid, lp in p.top:
        tt, tb = _piece(engine, tid)
        tops.append({"id": tid, "token": tt, "logprob": lp, "bytes": tb} if with_id else
                    {"token": tt, "logprob": lp, "bytes": tb})
    e["top_logprobs"] = tops
    return e


def _oai_logprobs(engine: Engine, probs: list[TokenProb], legacy: bool, offset: int = 0) -> dict | None:
    """OpenAI's logprobs object: ``content`` entries, and for completions
    also the legacy ``tokens`` / ``token_logprobs`` / ``top_logprobs`` /
    ``text_offset`` lists."""
    out: dict = {"content": [_prob_entry(engine, p) for p in probs]}
    if legacy:
        toks = [_piece(engine, p.id)[0] for p in probs]
        offs, at = [], offset
        for t in toks:
            offs.append(at)
            at += len(t)
        out.update({"tokens": toks, "token_logprobs": [p.logprob for p in probs],
                    "top_logprobs": [{_piece(engine, tid)[0]: lp for tid, lp in p.top} for p in probs],
                    "text_offset": offs})
    return out


# ---------------------------------------------------------------- completions


def _jobs(opts, body: dict, engine: Engine, prompt: list[int], chat=None) -> list[Job]:
    """The request's ``n`` jobs: the same prompt and settings, each with its
    own grammar matcher; with a seed, completion ``i`` samples with seed + i
    (llama-server's rule)."""
    jobs = []
    for i in range(opts.n):
        job = dataclasses.replace(opts.job, prompt=prompt, constraint=_constraint(body, engine, chat))
        if i and job.params.seed is not None:
            job.params = dataclasses.replace(job.params, seed=(job.params.seed + i) & 0xFFFFFFFF)
        jobs.append(job)
    return jobs


def _usage(results: list[Result]) -> dict:
    """The usage of ``n`` completions: the prompt once, every completion's tokens."""
    u = results[0].usage()
    if len(results) > 1:
        done = sum(r.n_generated for r in results)
        u["completion_tokens"], u["total_tokens"] = done, u["prompt_tokens"] + done
    return u


async def _run(request: web.Request, jobs: list[Job], on_text) -> list[Result]:
    _check_open(request)
    if jobs[0].n_predict == 0:     # llama-server: nothing to generate, an empty answer
        return [Result("", "length", len(j.prompt), 0) for j in jobs]
    return await _generate(request, jobs, on_text)


async def handle_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await _json_body(request)
    prompt = await _prepare(request, _completion_prompt, body, engine)
    opts = _options(body, engine, len(prompt), "completion")
    jobs = await _make_jobs(request, opts, body, engine, prompt)
    want_probs = jobs[0].probs
    cid = _cmpl_id("cmpl-")

    def choice(i: int, res: Result, text: str, probs: list | None) -> dict:
        lp = _oai_logprobs(engine, probs, True) if want_probs and probs is not None else None
        return {"text": text, "index": i, "logprobs": lp, "finish_reason": res.finish_reason}

    if not opts.stream:
        try:
            results = await _run(request, jobs, None)
        except ConnectionResetError:   # nobody is left to read an answer
            return web.Response(status=499, reason="Client Closed Request")
        return web.json_response({**_head(engine, cid, "text_completion"),
                                  "choices": [choice(i, r, r.text, r.probs) for i, r in enumerate(results)],
                                  "usage": _usage(results), "timings": results[0].timings()})
    resp = await _stream(request)
    sent = [0] * len(jobs)

    async def send(i: int, piece: str, probs: list) -> None:
        lp = _oai_logprobs(engine, probs, True, sent[i]) if want_probs else None
        sent[i] += len(piece)
        await resp.write(_sse({**_head(engine, cid, "text_completion"),
                               "choices": [{"text": piece, "index": i, "logprobs": lp, "finish_reason": None}]}))

    async def body_() -> None:
        results = await _run(request, jobs, send)
        for i, res in enumerate(results):
            last = {**_head(engine, cid, "text_completion"), "choices": [choice(i, res, "", None)]}
            if i == len(results) - 1:
                last.update(usage=_usage(results), timings=results[0].timings())
            await resp.write(_sse(last))

    return await _streaming(resp, body_)


async def handle_native_completion(request: web.Request) -> web.StreamResponse:
    """llama-server's ``/completion``: ``content``, ``stop``, ``tokens_cached``,
    ``completion_probabilities`` with ``n_probs``; streamed events carry
    ``content`` pieces and end with the full record (no ``[DONE]``). With
    ``n_cmpl`` / ``n`` > 1 the answer is an array of records, one per
    completion (``index``), as llama-server's."""
    engine = request.app[ENGINE]
    body = await _json_body(request)
    prompt = await _prepare(request, _completion_prompt, body, engine)
    opts = _options(body, engine, len(prompt), "native")
    jobs = await _make_jobs(request, opts, body, engine, prompt)
    want_probs = jobs[0].probs
    return_tokens = _json_field(body, "return_tokens", bool, False)

    def record(i: int, res: Result, content: str, probs: list | None) -> dict:
        out = {"index": i, "content": content, "tokens": res.tokens if return_tokens else [],
               "id_slot": res.id_slot, "stop": True, "model": engine.name,
               "tokens_predicted": res.n_generated, "tokens_evaluated": res.n_prompt,
               "tokens_cached": res.n_cached + res.n_generated,
               "truncated": False, "stop_type": ("word" if res.stop_word else "eos" if res.finish_reason == "stop"
                                                 else "limit" if res.finish_reason == "length" else "none"),
               "stopping_word": res.stop_word or "", "timings": res.timings()}
        if want_probs and probs is not None:
            out["completion_probabilities"] = [_prob_entry(engine, p) for p in probs]
        return out

    if not opts.stream:
        try:
            results = await _run(request, jobs, None)
        except ConnectionResetError:
            return web.Response(status=499, reason="Client Closed Request")
        records = [record(i, r, r.text, r.probs) for i, r in enumerate(results)]
        return web.json_response(records[0] if len(records) == 1 else records)
    resp = await _stream(request)

    async def send(i: int, piece: str, probs: list) -> None:
        ev = {"index": i, "content": piece, "stop": False, "id_slot": -1}
        if want_probs:
            ev["completion_probabilities"] = [_prob_entry(engine, p) for p in probs]
        await resp.write(_sse(ev))

    async def body_() -> None:
        results = await _run(request, jobs, send)
        for i, res in enumerate(results):
            await resp.write(_sse(record(i, res, "", None)))

    return await _streaming(resp, body_, done=False)


async def handle_chat(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await _json_body(request)
    chat = await _prepare(request, _chat_prompt, body, engine)
    opts = _options(body, engine, len(chat.tokens), "chat")
    jobs = await _make_jobs(request, opts, body, engine, chat.tokens, chat)
    want_probs = jobs[0].probs
    cid = _cmpl_id("chatcmpl-")
    splits = [ReasoningStream(chat.thinking_open, chat.split_reasoning) for _ in jobs]
    calls = [T.ToolCallStream(chat.tools if chat.parse_tools else None, chat.parallel_tool_calls) for _ in jobs]

    def finish_reason(i: int, res: Result) -> str:
        return "tool_calls" if calls[i].calls and res.finish_reason == "stop" else res.finish_reason

    if not opts.stream:
        try:
            results = await _run(request, jobs, None)
        except ConnectionResetError:   # nobody is left to read an answer
            return web.Response(status=499, reason="Client Closed Request")
        choices = []
        for i, res in enumerate(results):
            split, cl = splits[i], calls[i]
            split.add(res.text)
            split.finish()
            content, _ = cl.add(split.content)
            more, _ = cl.finish()
            content += more
            message: dict = {"role": "assistant", "content": content if (content or not cl.calls) else None}
            if split.reasoning:
                message["reasoning_content"] = split.reasoning
            if cl.calls:
                message["tool_calls"] = [c.message() for c in cl.calls]
            choice = {"finish_reason": finish_reason(i, res), "index": i, "message": message}
            if want_probs:
                choice["logprobs"] = {"content": [_prob_entry(engine, p) for p in res.probs]}
            choices.append(choice)
        return web.json_response({**_head(engine, cid, "chat.completion"), "choices": choices,
                                  "usage": _usage(results), "timings": results[0].timings()})
    resp = await _stream(request)

    def chunk(i: int, delta: dict, probs: list | None = None) -> bytes:
        choice = {"finish_reason": None, "index": i, "delta": delta}
        if want_probs and probs:
            choice["logprobs"] = {"content": [_prob_entry(engine, p) for p in probs]}
        return _sse({**_head(engine, cid, "chat.completion.chunk"), "choices": [choice]})

    async def send_deltas(i: int, dr: str, dc: str, probs: list | None = None, final: bool = False) -> None:
        cl = calls[i]
        content, found = cl.add(dc)
        if final:
            more, found2 = cl.finish()
            content, found = content + more, found + found2
        if dr:
            await resp.write(chunk(i, {"reasoning_content": dr}, probs))
            probs = None
        if content:
            await resp.write(chunk(i, {"content": content}, probs))
            probs = None
        for c in found:
            await resp.write(chunk(i, {"tool_calls": [c.openai(cl.calls.index(c))]}, probs))
            probs = None
        if probs:
            await resp.write(chunk(i, {}, probs))

    async def send(i: int, piece: str, probs: list) -> None:
        await send_deltas(i, *splits[i].add(piece), probs)

    async def body_() -> None:
        for i in range(len(jobs)):
            await resp.write(chunk(i, {"role": "assistant", "content": None}))
        results = await _run(request, jobs, send)
        for i, res in enumerate(results):
            await send_deltas(i, *splits[i].finish(), final=True)
        for i, res in enumerate(results):
            last = {**_head(engine, cid, "chat.completion.chunk"),
                    "choices": [{"finish_reason": finish_reason(i, res), "index": i, "delta": {}}]}
            if i == len(results) - 1:
                if opts.include_usage:
                    await resp.write(_sse(last))
                    # OpenAI's usage chunk: no choices
                    last = {**_head(engine, cid, "chat.completion.chunk"), "choices": [], "usage": _usage(results)}
                last["timings"] = results[0].timings()
            await resp.write(_sse(last))

    return await _streaming(resp, body_)


def _constraint(body: dict, engine: Engine, chat):
    from . import grammar as G

    spec = G.requested(body)
    if chat is not None and chat.tool_grammar is not None:
        if spec is not None:
            raise ApiError("tool_choice 'required' or a named function cannot be combined with response_format")
        spec = chat.tool_grammar
    if spec is None:
        return None
    if not (engine.stepped or engine.lanes):        # rounds sampled on the host mask each step's logits
        raise ApiError(f"Field '{spec[2]}': structured output runs on the reference path or the engine's lanes, "
                       "without MTP")
    return G.matcher(engine, spec)


# ---------------------------------------------------------------- the other endpoints


_PAGE: list[bytes] = []


async def handle_index(request: web.Request) -> web.Response:
    """The chat page (``chat.html``, package data): one file, inline JS,
    streaming from ``/v1/chat/completions``."""
    if not _PAGE:
        from importlib.resources import files

        _PAGE.append(files(__package__).joinpath("chat.html").read_bytes())
    return web.Response(body=_PAGE[0], content_type="text/html", charset="utf-8")


async def handle_health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def _model_entry(engine: Engine) -> dict:
    args = engine.model.args
    return {"id": engine.name, "object": "model", "created": engine.created, "owned_by": "fle",
            "meta": {"arch": engine.model.arch, "n_vocab": engine.tok.n_vocab, "n_ctx": engine.n_ctx,
                     "n_ctx_slot": engine.n_ctx_slot, "n_ctx_train": engine.n_ctx_train,
                     "n_embd": getattr(args, "n_embd", None), "mtp": engine.mtp}}


async def handle_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_entry(request.app[ENGINE])]})


async def handle_model(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    mid = request.match_info["model_id"]
    if mid != engine.name:
        raise ApiError(f"The model '{mid}' does not exist", 404, "not_found_error")
    return web.json_response(_model_entry(engine))


def _settings(engine: Engine) -> dict:
    return {"id": 0, "n_ctx": engine.n_ctx_slot, "speculative": engine.mtp, "is_processing": False,
            "params": {"n_predict": -1, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                       "typical_p": 1.0, "repeat_last_n": 64, "repeat_penalty": 1.0, "presence_penalty": 0.0,
                       "frequency_penalty": 0.0, "seed": 0xFFFFFFFF, "n_probs": 0, "ignore_eos": False,
                       "stop": [], "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"]}}


async def handle_props(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if request.method == "POST":
        raise ApiError("changing server properties is not supported", 501, "not_supported_error")
    return web.json_response({
        "default_generation_settings": _settings(engine), "total_slots": engine.n_parallel,
        "model_alias": engine.name, "model_path": str(getattr(engine.model, "path", "")),
        "chat_template": engine.tok.chat_template or "", "bos_token": _piece(engine, engine.tok.bos_id)[0]
        if engine.tok.bos_id is not None else "", "eos_token": _piece(engine, engine.tok.eos_id)[0]
        if engine.tok.eos_id is not None else "", "build_info": _FINGERPRINT,
        "modalities": {"vision": False, "audio": False},
        "fle": {"n_ctx": engine.n_ctx, "cache_ram": engine.cache.info(), "arch": engine.model.arch,
                "stepped": engine.stepped}})


async def handle_slots(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if request.query.get("fail_on_no_slot") and engine.n_busy == engine.n_parallel:
        raise ApiError("no slot available", 503, "unavailable_error")
    return web.json_response(engine.slots_info())


async def handle_slot_action(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    try:
        sid = int(request.match_info["id_slot"])
    except ValueError:
        raise ApiError(f"invalid slot id {request.match_info['id_slot']!r}") from None
    action = request.query.get("action")
    if action not in ("save", "restore", "erase"):
        raise ApiError(f"action must be save, restore or erase, got {_show(action)}")
    body = await _json_body(request) if action != "erase" else {}
    filename = body.get("filename")
    if action != "erase" and not isinstance(filename, str):
        raise ApiError("'filename' is required")
    if action != "erase" and not engine.slot_save_path:
        raise ApiError("slot save and restore need the server started with --slot-save-path", 501,
                       "not_supported_error")
    return web.json_response(await asyncio.wrap_future(engine.slot_action(sid, action, filename)))


async def handle_tokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await _json_body(request)
    content = body.get("content")
    if not isinstance(content, str):
        raise ApiError("'content' must be a string")
    add_special = _json_field(body, "add_special", bool, False)
    parse_special = _json_field(body, "parse_special", bool, True)
    with_pieces = _json_field(body, "with_pieces", bool, False)
    ids = engine.tok.encode(content, add_special=add_special, parse_special=parse_special)
    if with_pieces:
        out = []
        for t in ids:
            b = engine.tok.decode_token(t, special=True)
            try:
                piece: Any = b.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(b)
            out.append({"id": t, "piece": piece})
        return web.json_response({"tokens": out})
    return web.json_response({"tokens": ids})


async def handle_detokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await _json_body(request)
    ids = _prompt_ids(body.get("tokens", []), engine, "tokens")
    return web.json_response({"content": engine.tok.decode(ids, special=True)})


async def handle_apply_template(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await _json_body(request)
    chat = await asyncio.to_thread(_chat_prompt, body, engine)
    return web.json_response({"prompt": chat.text})


async def handle_metrics(request: web.Request) -> web.Response:
    from .metrics import render

    return web.Response(body=render(request.app[ENGINE]),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def create_app(engine: Engine, api_key: str | None = None) -> web.Application:
    """The aiohttp application serving ``engine``."""
    app = web.Application(middlewares=[_cors, _errors, _auth], client_max_size=64 * 2**20)
    app[ENGINE] = engine
    app[API_KEY] = api_key
    app[ACTIVE] = set()
    app[CLOSING] = {}

    async def startup(app: web.Application) -> None:
        engine.start()

    async def shutdown(app: web.Application) -> None:
        app[CLOSING]["closing"] = True
        await asyncio.to_thread(engine.stop)     # running requests end with finish reason "abort"

    app.on_startup.append(startup)
    app.on_shutdown.append(shutdown)
    r = app.router
    r.add_get("/", handle_index)
    for prefix in ("", "/v1"):
        r.add_get(prefix + "/health", handle_health)
        r.add_get(prefix + "/models", handle_models)
        r.add_post(prefix + "/completions", handle_completions)
        r.add_post(prefix + "/chat/completions", handle_chat)
    r.add_get("/v1/models/{model_id}", handle_model)
    r.add_post("/completion", handle_native_completion)
    r.add_get("/props", handle_props)
    r.add_post("/props", handle_props)
    r.add_get("/slots", handle_slots)
    r.add_post("/slots/{id_slot}", handle_slot_action)
    r.add_get("/metrics", handle_metrics)
    r.add_post("/tokenize", handle_tokenize)
    r.add_post("/detokenize", handle_detokenize)
    r.add_post("/apply-template", handle_apply_template)
    return app
