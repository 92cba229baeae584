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
from .slots import Engine, Job, Penalties
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
    job: Job
    stream: bool
    include_usage: bool
    truncated: bool            # max_tokens was cut to what the context leaves
    n: int = 1                 # completions of the prompt (choices)


# llama-server sampling fields FLE does not implement: refused unless at their neutral value
_NEUTRAL = {"typical_p": 1.0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "mirostat": 0, "top_n_sigma": -1.0,
            "dynatemp_range": 0.0, "n_indent": 0, "n_discard": 0, "t_max_predict_ms": 0}
_REFUSED = ("samplers", "lora", "image_data", "multimodal_data", "input_extra", "input_prefix", "input_suffix",
            "best_of", "suffix")


def _logit_bias(body: dict, engine: Engine) -> dict[int, float]:
    raw = body.get("logit_bias")
    if raw is None:
        return {}
    n_vocab = min(engine.tok.n_vocab, engine.model.n_vocab)
    pairs: list[tuple[Any, Any]]
    if isinstance(raw, dict):
        pairs = list(raw.items())
    elif isinstance(raw, list) and all(isinstance(p, list) and len(p) == 2 for p in raw):
        pairs = [tuple(p) for p in raw]
    else:
        raise ApiError(f"Field 'logit_bias': expected an object of token id -> bias or a list of [token, bias] "
                       f"pairs, got {_show(raw)}")
    out: dict[int, float] = {}
    for key, bias in pairs:
        if bias is False:
            b = -math.inf               # llama-server: false bans the token
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise ApiError(f"Field 'logit_bias': bias must be a finite number or false, got {_show(bias)}")
        else:
            b = float(bias)
        if isinstance(key, str) and key.lstrip("-").isdigit() and isinstance(raw, dict):
            ids = [int(key)]
        elif isinstance(key, int) and not isinstance(key, bool):
            ids = [key]
        elif isinstance(key, str) and isinstance(raw, list):
            ids = engine.tok.encode(key, add_special=False, parse_special=False)   # every token of the text
        else:
            raise ApiError(f"Field 'logit_bias': expected token ids as keys, got {_show(key)}")
        for t in ids:
            if not 0 <= t < n_vocab:
                raise ApiError(f"Field 'logit_bias': token id {t} is out of range (the vocabulary has {n_vocab} "
                               "tokens)")
            out[t] = b
    return out


def _options(body: dict, engine: Engine, n_prompt: int, kind: str = "completion") -> Options:
    """The request's generation settings; ``kind``: ``completion`` (OpenAI
    completions), ``chat`` or ``native`` (llama-server's /completion)."""
    # llama-server: n (n_cmpl) completions of the prompt, at most one per slot
    n = _number(body, ("n_cmpl", "n"), 1, integer=True, lo=1, hi=engine.n_parallel)
    for name in _REFUSED:
        if name in body and body[name] not in (None, [], "", {}):
            raise ApiError(f"Unsupported param: {name}")
    for name, neutral in _NEUTRAL.items():
        v = body.get(name)
        if v is not None and v != neutral:
            raise ApiError(f"Field '{name}': not supported by fle-engine serve (only {neutral} is)")
    if body.get("echo"):
        raise ApiError("Only no echo is supported")
    if body.get("post_sampling_probs"):
        raise ApiError("Field 'post_sampling_probs': not supported by fle-engine serve")
    # token probabilities
    want_probs, n_probs = False, 0
    if kind == "chat":
        want_probs = _bool(body, "logprobs", False)
        n_probs = _number(body, ("top_logprobs",), 0, integer=True, lo=0, hi=20)
        if n_probs and not want_probs:
            raise ApiError("Field 'top_logprobs': needs 'logprobs': true")
    elif kind == "completion":
        lp = body.get("logprobs")
        if isinstance(lp, bool):
            want_probs = lp
        elif lp is not None:
            n_probs = _number(body, ("logprobs",), 0, integer=True, lo=0, hi=20)
            want_probs = True
    n_native = _number(body, ("n_probs",), 0, integer=True, lo=0, hi=100)
    if n_native:
        want_probs, n_probs = True, max(n_probs, n_native)
    n_predict = _number(body, ("n_predict", "max_completion_tokens", "max_tokens"), -1, integer=True,
                        lo=-1, hi=INT32_MAX)
    temp = _number(body, ("temperature",), 0.8, lo=0.0, clamp=True)
    top_k = _number(body, ("top_k",), 40, integer=True, lo=0, hi=INT32_MAX, clamp=True)
    top_p = _number(body, ("top_p",), 0.95, lo=0.0, hi=1.0, clamp=True)
    min_p = _number(body, ("min_p",), 0.05, lo=0.0, hi=1.0, clamp=True)
    seed = _number(body, ("seed",), -1, integer=True, lo=-1, hi=0xFFFFFFFF)
    pen = Penalties(repeat=float(_number(body, ("repeat_penalty",), 1.0, lo=0.0, hi=1e6)),
                    last_n=int(_number(body, ("repeat_last_n",), 64, integer=True, lo=-1, hi=INT32_MAX)),
                    presence=float(_number(body, ("presence_penalty",), 0.0, lo=-1e6, hi=1e6)),
                    frequency=float(_number(body, ("frequency_penalty",), 0.0, lo=-1e6, hi=1e6)))
    if pen.repeat == 0.0:
        raise ApiError("Field 'repeat_penalty': must be positive (1.0 = off)")
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
    id_slot = _number(body, ("id_slot", "slot_id"), -1, integer=True, lo=-1, hi=engine.n_parallel - 1)
    cache_prompt = _bool(body, "cache_prompt", True)
    ignore_eos = _bool(body, "ignore_eos", False)
    bias = _logit_bias(body, engine)
    # rounds sampled on the host (the reference path, the engine's lanes) apply these to each step's logits; MTP
    # drafts and an engine of one sequence run token generators
    if not (engine.stepped or engine.lanes):
        pen_on = pen.active
        used = [name for name, on in (("logit_bias", bias), ("n_probs" if n_native else "logprobs", want_probs),
                                      ("repeat_penalty", pen_on and pen.repeat != 1.0),
                                      ("presence_penalty", pen_on and pen.presence != 0.0),
                                      ("frequency_penalty", pen_on and pen.frequency != 0.0),
                                      ("id_slot", id_slot >= 0)) if on]
        if used:
            raise ApiError(f"Field '{used[0]}': not supported with MTP drafts or an engine of one sequence; serve "
                           "on the reference path (--device cpu, no --mtp) or the engine's lanes (--parallel 2 or "
                           "more, no --mtp) for it")

    n_ctx = engine.n_ctx_slot
    if n_prompt >= n_ctx:
        raise ApiError(f"request ({n_prompt} tokens) exceeds the available context size ({n_ctx} tokens), "
                       "try increasing it", kind="exceed_context_size_error", n_prompt_tokens=n_prompt, n_ctx=n_ctx)
    room = n_ctx - n_prompt
    truncated = n_predict > room
    if n_predict < 0 or truncated:
        n_predict = room            # llama-server: generation stops at the end of the context
    # -1 and 0xFFFFFFFF (llama.cpp's LLAMA_DEFAULT_SEED) both mean a random seed
    params = SamplerParams(float(temp), int(top_k), float(top_p), float(min_p),
                           None if seed in (-1, 0xFFFFFFFF) else int(seed))
    job = Job([], n_predict, params, stops, id_slot=int(id_slot), cache_prompt=cache_prompt, ignore_eos=ignore_eos,
              logit_bias=bias, penalties=pen, probs=want_probs, n_probs=int(n_probs))
    return Options(job, stream, include_usage, truncated, int(n))


def _json_field(body: dict, name: str, kind: type, default):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise ApiError(f"Field '{name}': expected {kind.__name__}, got {_show(v)}")
    return v


def _prompt_ids(p, engine: Engine, name: str = "prompt") -> list[int]:
    if not (isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)):
        raise ApiError(f"'{name}' must be a list of token ids")
    n_vocab = min(engine.tok.n_vocab, engine.model.n_vocab)
    bad = [t for t in p if not 0 <= t < n_vocab]
    if bad:
        raise ApiError(f"\"{name}\": token id {bad[0]} is out of range (the vocabulary has {n_vocab} tokens)")
    return list(p)


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


ROLES = ("system", "developer", "user", "assistant", "tool")
_RESERVED_VARS = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "template",
                  "enable_thinking"}


@dataclass
class ChatPrompt:
    tokens: list[int]
    thinking_open: bool
    split_reasoning: bool
    text: str = ""
    tools: list | None = None           # the request's tools, when tool calls are parsed
    parse_tools: bool = False
    parallel_tool_calls: bool = True
    tool_grammar: tuple | None = None   # a constraint forcing a tool call (tool_choice required / named)


def _chat_prompt(body: dict, engine: Engine) -> ChatPrompt:
    if "messages" not in body:
        raise ApiError("'messages' is required")
    raw = body["messages"]
    if not isinstance(raw, list):
        raise ApiError("Expected 'messages' to be an array")
    if not raw:
        raise ApiError("'messages' must not be empty")
    messages = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ApiError(f"messages[{i}]: expected an object with a string 'role'")
        if msg["role"] not in ROLES:
            raise ApiError(f"messages[{i}]: unknown role {_show(msg['role'])}; expected one of {', '.join(ROLES)}")
        if msg["role"] == "assistant":
            if "content" not in msg and "tool_calls" not in msg:
                raise ApiError("Assistant message must contain either 'content' or 'tool_calls'!")
        elif "content" not in msg:
            raise ApiError("All non-assistant messages must contain 'content'")
        messages.append(_message_content(msg, i))
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ApiError(f"Expected 'tools' to be an array of objects, got {_show(tools)}")
    for i, t in enumerate(tools or []):
        fn = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ApiError(f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(f"tools[{i}].function: 'name' must be a non-empty string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ApiError(f"tools[{i}].function: 'parameters' must be a JSON schema object")
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
    from .tools import tool_choice

    choice = tool_choice(body, tools)
    if choice.mode == "none":
        tools = None                    # the model is not told of tools it may not call
    text = render_prompt(engine.tok, messages, add_generation_prompt=True, tools=tools,
                         enable_thinking=enable_thinking, **kwargs)
    tokens = engine.tok.encode(text, add_special=True, parse_special=True)
    if not tokens:
        raise ApiError("the chat prompt is empty")
    return ChatPrompt(tokens, text.rstrip().endswith(THINK_START), fmt != "none", text, tools,
                      bool(tools) and choice.mode != "none", choice.parallel, choice.grammar)
