"""Request parsing: llama-server's and OpenAI's request fields, checked,
with llama-server's defaults and error wording."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

from aiohttp import web

from ..chat import render_prompt
from ..sampling import SamplerParams
from .slots import Engine
from .text import THINK_START

INT32_MAX = 2**31 - 1

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
