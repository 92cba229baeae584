"""``fle-engine serve``: an OpenAI-compatible HTTP server on FLE's reference
forward pass, answering the way llama.cpp's ``llama-server`` does.

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (each also without the ``/v1`` prefix).
Requests take llama-server's fields and defaults: ``max_tokens`` (also
``max_completion_tokens`` and ``n_predict``; default: until an
end-of-generation token or the end of the context), ``temperature`` 0.8,
``top_k`` 40, ``top_p`` 0.95, ``min_p`` 0.05, ``seed`` (-1 = random),
``stop``, ``stream`` (server-sent events, ending with ``data: [DONE]``),
``n`` (1 only). Out-of-range sampling values are clamped as llama-server
clamps them. Bad requests are HTTP 400 with ``{"error": {"code", "message",
"type"}}``: type ``invalid_request_error``, or ``exceed_context_size_error``
(with ``n_prompt_tokens`` and ``n_ctx``) when the prompt plus ``max_tokens``
does not fit the context, as llama-server words it; in a streaming request
too, before any event.

Generated text is cut at the first stop string, which is not returned; while
streaming, text that could still turn into a stop string is held back until
it cannot. A chat answer's thinking -- what comes between ``<think>`` and
``</think>`` at its start, or before ``</think>`` when the rendered prompt
already ends inside an open ``<think>`` -- goes to ``reasoning_content``,
the rest to ``content``, as llama-server's default reasoning format does;
surrounding whitespace of the thinking is dropped. Tool definitions reach the
chat template; tool calls in the answer stay in ``content`` (they are not
parsed into ``tool_calls``).

One sequence runs at a time: requests queue on a lock, and the decode loop
runs in a worker thread so that the event loop keeps answering (``/health``
during a long generation). A streaming client that goes away stops its
generation at the next token; so does a waiting non-streaming one.
"""
from __future__ import annotations

import asyncio
import json
import math
import secrets
import signal
import string
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TextIO

from aiohttp import web

from fle_quant.errors import FleError

from . import __version__
from .chat import render_prompt
from .sampling import Sampler, SamplerParams, generate_tokens
from .speculative import SpecStats, generate_speculative

__all__ = ["Engine", "StopScanner", "ReasoningStream", "split_reasoning", "create_app", "default_ctx_size", "serve"]

CTX_CAP = 8192          # default context: the model's own, at most this many tokens
INT32_MAX = 2**31 - 1
THINK_START, THINK_END = "<think>", "</think>"
_FINGERPRINT = f"fle-engine-{__version__}"
_ID_CHARS = string.ascii_letters + string.digits


# ---------------------------------------------------------------- text handling


def _partial_suffix(text: str, word: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``word``."""
    for k in range(min(len(text), len(word) - 1), 0, -1):
        if text.endswith(word[:k]):
            return k
    return 0


class StopScanner:
    """Cuts generated text at the first of the stop strings.

    ``add(text)`` takes the next piece and returns what can be released:
    text before a stop string (then ``stopped`` is set and the stop string
    and everything after it are dropped), or text that cannot become part of
    one; an end that could still grow into a stop string is held back.
    ``finish()`` releases what is held when generation ends otherwise."""

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = [s for s in stops if s]
        self.stopped = False
        self.stop_word: str | None = None
        self._held = ""

    def add(self, text: str) -> str:
        if self.stopped:
            return ""
        buf = self._held + text
        hit: tuple[int, str] | None = None
        for word in self.stops:
            pos = buf.find(word)
            if pos >= 0 and (hit is None or pos < hit[0]):
                hit = (pos, word)
        if hit is not None:
            self.stopped, self.stop_word, self._held = True, hit[1], ""
            return buf[:hit[0]]
        hold = max((_partial_suffix(buf, w) for w in self.stops), default=0)
        self._held = buf[len(buf) - hold:]
        return buf[:len(buf) - hold]

    def finish(self) -> str:
        out, self._held = self._held, ""
        return out


def split_reasoning(text: str, thinking_open: bool = False, partial: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a chat answer.

    The answer thinks when it starts (after whitespace) with ``<think>``, or
    from its first character when ``thinking_open`` (the prompt ended inside
    an open ``<think>``). The thinking runs to ``</think>`` (or the end of an
    unfinished answer) and is stripped of surrounding whitespace; the content
    is what follows, without leading whitespace. An answer that does not
    think is all content, unchanged.

    ``partial``: ``text`` is an answer still being generated. What could
    still change meaning -- a beginning that may become ``<think>``, an end
    that may become ``</think>``, trailing whitespace of the thinking -- is
    left out, so that the results for growing texts only ever grow.
    """
    if thinking_open:
        body = text
    else:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_START):
            if partial and THINK_START.startswith(stripped):
                return "", ""
            return "", text
        body = stripped[len(THINK_START):]
    end = body.find(THINK_END)
    if end < 0:
        if partial:
            body = body[:len(body) - _partial_suffix(body, THINK_END)]
        return body.strip(), ""
    return body[:end].strip(), body[end + len(THINK_END):].lstrip()


class ReasoningStream:
    """Splits a streamed chat answer into reasoning and content deltas:
    ``add(text)`` and ``finish()`` return (reasoning delta, content delta);
    the deltas concatenate to :func:`split_reasoning` of the whole answer.
    ``enabled=False`` passes everything through as content."""

    def __init__(self, thinking_open: bool = False, enabled: bool = True):
        self.thinking_open, self.enabled = thinking_open, enabled
        self.text = ""
        self.reasoning = self.content = ""

    def _update(self, partial: bool) -> tuple[str, str]:
        if self.enabled:
            r, c = split_reasoning(self.text, self.thinking_open, partial)
        else:
            r, c = "", self.text
        if not (r.startswith(self.reasoning) and c.startswith(self.content)):  # split_reasoning guarantees it
            raise RuntimeError("reasoning split went back on text it had released")
        dr, dc = r[len(self.reasoning):], c[len(self.content):]
        self.reasoning, self.content = r, c
        return dr, dc

    def add(self, text: str) -> tuple[str, str]:
        self.text += text
        return self._update(partial=True)

    def finish(self) -> tuple[str, str]:
        return self._update(partial=False)


# ---------------------------------------------------------------- the engine


@dataclass
class Job:
    prompt: list[int]
    n_predict: int
    params: SamplerParams
    stop: list[str] = field(default_factory=list)


@dataclass
class Result:
    text: str
    finish_reason: str          # "stop" (end of generation or a stop string) or "length"
    n_prompt: int
    n_generated: int            # sampled tokens, the end-of-generation token included
    cancelled: bool = False
    stop_word: str | None = None
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0
    drafted: int = 0
    accepted: int = 0

    def timings(self) -> dict:
        t = {
            "prompt_n": self.n_prompt,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / self.n_prompt if self.n_prompt else 0.0,
            "prompt_per_second": 1e3 * self.n_prompt / self.prompt_ms if self.prompt_ms > 0 else 0.0,
            "predicted_n": self.n_generated,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": self.predicted_ms / self.n_generated if self.n_generated else 0.0,
            "predicted_per_second": 1e3 * self.n_generated / self.predicted_ms if self.predicted_ms > 0 else 0.0,
        }
        if self.drafted:
            t["draft_n"], t["draft_n_accepted"] = self.drafted, self.accepted
        return t

    def usage(self) -> dict:
        return {"completion_tokens": self.n_generated, "prompt_tokens": self.n_prompt,
                "total_tokens": self.n_prompt + self.n_generated}


class Engine:
    """A loaded model and its tokenizer, serving one sequence at a time.

    ``run(job, cancel, emit)`` decodes ``job`` synchronously (call it from a
    worker thread), passes released text to ``emit`` as it comes, stops
    early when ``cancel`` is set, and returns the :class:`Result`."""

    def __init__(self, model, tokenizer, *, n_ctx: int, name: str, n_ctx_train: int | None = None,
                 mtp: bool = False, n_draft: int = 2, log: TextIO | None = None):
        if n_ctx < 2:
            raise FleError(f"the context size must be at least 2 tokens, got {n_ctx}")
        if mtp and getattr(model.net, "mtp", None) is None:
            raise FleError(f"{model.path}: no MTP head loaded; --mtp needs a model file with the MTP block "
                           "inside, or --mtp-head FILE")
        self.model, self.tok = model, tokenizer
        self.n_ctx, self.name, self.n_ctx_train, self.mtp, self.log = n_ctx, name, n_ctx_train, mtp, log
        if n_draft < 1:
            raise FleError(f"--draft-max must be at least 1, got {n_draft}")
        self.n_draft = n_draft
        self.created = int(time.time())
        self._lock = threading.Lock()   # the hard guarantee: one decode at a time, whatever the HTTP side does
        tokenizer.stream()              # builds the detokenizer tables now, not in the first request

    def run(self, job: Job, cancel: threading.Event, emit: Callable[[str], None]) -> Result:
        with self._lock:
            return self._run(job, cancel, emit)

    def _run(self, job: Job, cancel: threading.Event, emit: Callable[[str], None]) -> Result:
        tok = self.tok
        eog = tok.eog_ids
        sampler = Sampler(job.params)
        spec = SpecStats() if self.mtp else None
        if spec is not None:
            tokens = generate_speculative(self.model, job.prompt, job.n_predict, sampler, stop=eog,
                                          n_draft=self.n_draft, stats=spec)
        elif getattr(self.model, "runtime", False):
            # the GPU engine: greedy steps with look-ahead, or its logits sampled on the host
            tokens = self.model.tokens(job.prompt, job.n_predict, stop=eog,
                                       sampler=None if job.params.temp <= 0 else sampler)
        else:
            tokens = generate_tokens(self.model, job.prompt, job.n_predict, sampler, stop=eog)
        decoder = tok.stream()
        scan = StopScanner(job.stop)
        pieces: list[str] = []

        def release(text: str) -> None:
            if text:
                pieces.append(text)
                emit(text)

        n, finish, cancelled = 0, "length", False
        t0 = time.perf_counter()
        t_first = None
        try:
            for t in tokens:
                if t_first is None:
                    t_first = time.perf_counter()
                n += 1
                if t in eog:
                    finish = "stop"
                    break
                release(scan.add(decoder.add(t)))
                if scan.stopped:
                    finish = "stop"
                    break
                if cancel.is_set():
                    cancelled = True
                    break
        finally:
            tokens.close()
        if not scan.stopped and not cancelled:
            release(scan.add(decoder.flush()))
            if scan.stopped:
                finish = "stop"
            else:
                release(scan.finish())
        t_end = time.perf_counter()
        t_first = t_end if t_first is None else t_first
        res = Result("".join(pieces), finish, len(job.prompt), n, cancelled, scan.stop_word,
                     prompt_ms=1e3 * (t_first - t0), predicted_ms=1e3 * (t_end - t_first),
                     drafted=spec.drafted if spec else 0, accepted=spec.accepted if spec else 0)
        if self.log is not None:
            tm = res.timings()
            why = "client gone" if cancelled else ("stop string" if scan.stopped else
                                                   "end of generation" if finish == "stop" else "length")
            drafts = f", MTP drafts {res.accepted}/{res.drafted}" if res.drafted else ""
            print(f"fle-engine: prompt {res.n_prompt} tokens ({tm['prompt_per_second']:.1f} t/s), generated "
                  f"{res.n_generated} tokens ({tm['predicted_per_second']:.1f} t/s), {why}, seed {sampler.seed}"
                  f"{drafts}", file=self.log, flush=True)
        return res


def default_ctx_size(n_ctx_train: int | None, requested: int | None) -> int:
    """``--ctx-size``: None -> the model's context length capped at
    :data:`CTX_CAP`; 0 -> the model's own; N -> N."""
    if requested is None:
        return min(n_ctx_train, CTX_CAP) if n_ctx_train else CTX_CAP
    if requested == 0:
        return n_ctx_train if n_ctx_train else CTX_CAP
    return requested


# ---------------------------------------------------------------- request parsing


class ApiError(Exception):
    """A request the server answers with an error object."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error", **extra: Any):
        super().__init__(message)
        self.message, self.status, self.kind, self.extra = message, status, kind, extra

    def response(self) -> web.Response:
        body = {"error": {"code": self.status, "message": self.message, "type": self.kind, **self.extra}}
        return web.json_response(body, status=self.status)


def _show(v: Any) -> str:
    s = json.dumps(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _number(body: dict, names: Sequence[str], default, *, integer: bool = False, lo=None, hi=None,
            clamp: bool = False):
    """The first of ``names`` present and not null in ``body``, checked: a
    number (an integral one when ``integer``), finite, and within [lo, hi]
    -- clamped into it when ``clamp`` (llama-server's soft limits), an error
    otherwise."""
    for name in names:
        v = body.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ApiError(f"Field '{name}': expected {'an integer' if integer else 'a number'}, got {_show(v)}")
        if integer:
            if isinstance(v, float) and not v.is_integer():
                raise ApiError(f"Field '{name}': expected an integer, got {_show(v)}")
            v = int(v)
        if clamp:
            return min(max(v, lo), hi) if hi is not None else max(v, lo)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ApiError(f"Field '{name}': value must be between {lo} and {hi}, got {v}")
        return v
    return default


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"Field '{name}': expected a boolean, got {_show(v)}")
    return v


@dataclass
class Options:
    n_predict: int
    params: SamplerParams
    stop: list[str]
    stream: bool
    include_usage: bool


def _options(body: dict, engine: Engine, n_prompt: int) -> Options:
    n = _number(body, ("n",), 1, integer=True)
    if n != 1:
        raise ApiError(f"Field 'n': only 1 completion per request is supported, got {n}")
    for name in ("best_of", "suffix"):
        if name in body:
            raise ApiError(f"Unsupported param: {name}")
    if body.get("echo"):
        raise ApiError("Only no echo is supported")
    if body.get("logprobs") or body.get("top_logprobs") or body.get("n_probs"):
        raise ApiError("logprobs are not supported by fle-engine serve")
    for name in ("grammar", "json_schema"):
        if body.get(name):
            raise ApiError(f"Unsupported param: {name}")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type", "text") == "text"):
        raise ApiError("response_format: only {\"type\": \"text\"} is supported by fle-engine serve")
    n_predict = _number(body, ("n_predict", "max_completion_tokens", "max_tokens"), -1, integer=True,
                        lo=-1, hi=INT32_MAX)
    temp = _number(body, ("temperature",), 0.8, lo=0.0, clamp=True)
    top_k = _number(body, ("top_k",), 40, integer=True, lo=0, hi=INT32_MAX, clamp=True)
    top_p = _number(body, ("top_p",), 0.95, lo=0.0, hi=1.0, clamp=True)
    min_p = _number(body, ("min_p",), 0.05, lo=0.0, hi=1.0, clamp=True)
    seed = _number(body, ("seed",), -1, integer=True, lo=-1, hi=0xFFFFFFFF)
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = [s for s in stop if s]
    else:
        raise ApiError(f"Field 'stop': expected a string or a list of strings, got {_show(stop)}")
    stream = _bool(body, "stream", False)
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise ApiError(f"Field 'stream_options': expected an object, got {_show(so)}")
        include_usage = _bool(so, "include_usage", False)

    n_ctx = engine.n_ctx
    if n_prompt >= n_ctx:
        raise ApiError(f"request ({n_prompt} tokens) exceeds the available context size ({n_ctx} tokens), "
                       "try increasing it", kind="exceed_context_size_error", n_prompt_tokens=n_prompt, n_ctx=n_ctx)
    if n_predict > n_ctx - n_prompt:
        raise ApiError(f"the request exceeds the available context size: {n_prompt} prompt tokens + {n_predict} "
                       f"max_tokens > {n_ctx} tokens; lower max_tokens or start the server with a larger --ctx-size",
                       kind="exceed_context_size_error", n_prompt_tokens=n_prompt, n_ctx=n_ctx)
    if n_predict < 0:
        n_predict = n_ctx - n_prompt
    # -1 and 0xFFFFFFFF (llama.cpp's LLAMA_DEFAULT_SEED) both mean a random seed
    params = SamplerParams(float(temp), int(top_k), float(top_p), float(min_p),
                           None if seed in (-1, 0xFFFFFFFF) else int(seed))
    return Options(n_predict, params, stops, stream, include_usage)


def _completion_prompt(body: dict, engine: Engine) -> list[int]:
    if "prompt" not in body:
        raise ApiError('"prompt" is required')
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]    # one prompt in a list
    if isinstance(p, str):
        ids = engine.tok.encode(p, add_special=True, parse_special=True)
    elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        n_vocab = min(engine.tok.n_vocab, engine.model.n_vocab)
        bad = [t for t in p if not 0 <= t < n_vocab]
        if bad:
            raise ApiError(f"\"prompt\": token id {bad[0]} is out of range (the vocabulary has {n_vocab} tokens)")
        ids = list(p)
    elif isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise ApiError(f"\"prompt\": one prompt per request is supported, got {len(p)}")
    else:
        raise ApiError('"prompt" must be a string or a list of token ids')
    if not ids:
        raise ApiError('"prompt" must not be empty')
    return ids


def _message_content(msg: dict, i: int) -> dict:
    msg = dict(msg)
    content = msg.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text", ""), str):
                raise ApiError(f"messages[{i}].content: unsupported content part {_show(part)}; "
                               "fle-engine serve takes text only")
            texts.append(part.get("text", ""))
        msg["content"] = "\n".join(texts)   # text parts joined with newlines, as llama.cpp does
    elif content is not None and not isinstance(content, str):
        raise ApiError(f"messages[{i}]: expected 'content' to be a string or an array")
    return msg


_RESERVED_VARS = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "template",
                  "enable_thinking"}


@dataclass
class ChatPrompt:
    tokens: list[int]
    thinking_open: bool
    split_reasoning: bool


def _chat_prompt(body: dict, engine: Engine) -> ChatPrompt:
    if "messages" not in body:
        raise ApiError("'messages' is required")
    raw = body["messages"]
    if not isinstance(raw, list):
        raise ApiError("Expected 'messages' to be an array")
    messages = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ApiError(f"messages[{i}]: expected an object with a string 'role'")
        if msg["role"] == "assistant":
            if "content" not in msg and "tool_calls" not in msg:
                raise ApiError("Assistant message must contain either 'content' or 'tool_calls'!")
        elif "content" not in msg:
            raise ApiError("All non-assistant messages must contain 'content'")
        messages.append(_message_content(msg, i))
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ApiError(f"Expected 'tools' to be an array of objects, got {_show(tools)}")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError(f"Field 'chat_template_kwargs': expected an object, got {_show(kwargs)}")
    kwargs = dict(kwargs)
    enable_thinking = kwargs.pop("enable_thinking", True)
    if not isinstance(enable_thinking, bool):
        raise ApiError(f"invalid type for \"enable_thinking\" (expected boolean, got {type(enable_thinking).__name__})")
    effort = body.get("reasoning_effort")
    if effort == "none":
        enable_thinking = False
    elif isinstance(effort, str) and effort:
        kwargs.setdefault("reasoning_effort", effort)   # a template variable, as llama-server passes it
    clash = sorted(_RESERVED_VARS & kwargs.keys())
    if clash:
        raise ApiError(f"chat_template_kwargs may not set {clash[0]!r}")
    fmt = body.get("reasoning_format")
    if fmt is not None and fmt not in ("none", "auto", "deepseek"):
        raise ApiError(f"Field 'reasoning_format': expected 'none', 'auto' or 'deepseek', got {_show(fmt)}")
    text = render_prompt(engine.tok, messages, add_generation_prompt=True, tools=tools,
                         enable_thinking=enable_thinking, **kwargs)
    tokens = engine.tok.encode(text, add_special=True, parse_special=True)
    if not tokens:
        raise ApiError("the chat prompt is empty")
    return ChatPrompt(tokens, text.rstrip().endswith(THINK_START), fmt != "none")


# ---------------------------------------------------------------- HTTP


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


# ---------------------------------------------------------------- the program


async def _listen(engine: Engine, host: str, port: int, log: TextIO) -> None:
    app = create_app(engine)
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
              f"tokens{', MTP drafts' if engine.mtp else ''})", file=log, flush=True)
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
          n_draft: int = 2, alias: str | None = None, log: TextIO = sys.stderr, runtime: dict | None = None) -> int:
    """Load ``model_path`` and serve it until SIGINT or SIGTERM; with
    ``runtime`` (the engine's options) on the GPU engine."""
    import os

    import torch

    from fle_quant.gguf_reader import GGUFModel

    from .loader import load
    from .tokenizer import Tokenizer

    if not 0 <= port <= 65535:
        raise FleError(f"--port must lie in 0..65535, got {port}")
    if ctx_size is not None and ctx_size < 0:
        raise FleError(f"--ctx-size must be 0 (the model's own) or a number of tokens, got {ctx_size}")
    if threads is not None:
        if threads < 1:
            raise FleError(f"--threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    tok = Tokenizer.from_gguf(model_path)
    with GGUFModel.open(model_path) as g:
        n_ctx_train = g.hparam("context_length", None) if g.arch else None
    n_ctx_train = int(n_ctx_train) if n_ctx_train else None
    n_ctx = default_ctx_size(n_ctx_train, ctx_size)
    if n_ctx_train and n_ctx > n_ctx_train:
        print(f"fle-engine: warning: --ctx-size {n_ctx} is beyond the model's training context ({n_ctx_train})",
              file=log)
    print(f"fle-engine: loading {model_path} on {device}", file=log, flush=True)
    if runtime is not None:
        from .runtime import Engine as Runtime

        model = Runtime(model_path, device=device, ctx_size=n_ctx, log=lambda m: print(m, file=log, flush=True),
                        **runtime)
    else:
        model = load(model_path, device=device)
    if tok.n_vocab > model.n_vocab:
        raise FleError(f"{model_path}: the vocabulary has {tok.n_vocab} tokens but the model outputs "
                       f"{model.n_vocab}; the file is inconsistent")
    if mtp_head:
        if not hasattr(model.net, "load_mtp"):
            raise FleError(f"{model_path}: FLE runs no MTP head for {model.arch} models")
        model.net.load_mtp(mtp_head)
        mtp = True
    name = alias or os.path.basename(str(model_path))
    engine = Engine(model, tok, n_ctx=n_ctx, name=name, n_ctx_train=n_ctx_train, mtp=mtp, n_draft=n_draft, log=log)
    try:
        asyncio.run(_listen(engine, host, port, log))
    finally:
        if runtime is not None:
            model.close()            # saves the expert cache's usage profile
    return 0
