"""Chat prompts from a model's own ``tokenizer.chat_template``.

Templates are Jinja2, rendered the way HF transformers and llama.cpp render
them: a sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, HF's ``{% generation %}`` tag accepted and
ignored, a ``tojson`` filter that does not escape non-ASCII or HTML
characters, and the globals ``raise_exception`` and ``strftime_now``.
Messages are plain dicts (``role``, ``content``, optionally ``tool_calls``
with ``function.arguments`` as a dict, ``reasoning_content``); ``tools`` is
a list of OpenAI-style tool dicts.

This module knows nothing about token ids; tokenize the rendered prompt with
``Tokenizer.encode(prompt, add_special=..., parse_special=True)``.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import TYPE_CHECKING, Any, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fle_quant.errors import FleError

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

__all__ = ["apply_chat_template", "render_prompt"]


class _GenerationTag(jinja2.ext.Extension):
    """HF's ``{% generation %}...{% endgeneration %}`` marks assistant text for
    training masks; for rendering it is a no-op around its body."""

    tags = {"generation"}

    def parse(self, parser):
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str):
    raise FleError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which templates for
    # chat prompts do not want
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise FleError(f"chat template: syntax error on line {e.lineno}: {e.message}; fix or replace the template") from None


def normalize_messages(messages: Sequence[dict]) -> list[dict]:
    """OpenAI-style messages as llama.cpp hands them to a template: a message
    without ``content`` gets ``""``, and tool-call ``arguments`` given as a
    JSON string become the object they encode (templates iterate over them)."""
    out = []
    for msg in messages:
        msg = dict(msg)
        if msg.get("content") is None:
            msg["content"] = ""
        calls = msg.get("tool_calls")
        if calls:
            fixed = []
            for call in calls:
                call = dict(call)
                fn = call.get("function")
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        args = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        raise FleError(f"tool call {fn.get('name', '?')!r}: arguments are not valid JSON") from None
                    call["function"] = {**fn, "arguments": args}
                fixed.append(call)
            msg["tool_calls"] = fixed
        out.append(msg)
    return out


def apply_chat_template(template: str, messages: Sequence[dict], add_generation_prompt: bool = True, *,
                        tools: Sequence[dict] | None = None, enable_thinking: bool | None = True,
                        bos_token: str = "", eos_token: str = "", **kwargs: Any) -> str:
    """Render ``template`` for ``messages``.

    Messages are first normalized as llama.cpp does (:func:`normalize_messages`).
    ``enable_thinking`` defaults to true and is always passed, as llama.cpp
    does (``common_chat_templates_inputs``); None leaves it undefined, as
    transformers and llama-cpp-python's Python formatter do, so that templates
    testing ``enable_thinking is defined`` see their own default. The two
    differ for templates that test ``not enable_thinking`` (QwQ,
    DeepSeek-R1-Distill-Qwen): undefined closes the think block.
    Further ``kwargs`` become template variables (e.g. ``add_vision_id``).
    """
    if not isinstance(template, str) or not template:
        raise FleError("chat template is empty; the model has no tokenizer.chat_template, pass one explicitly")
    variables = dict(kwargs)
    if enable_thinking is not None:
        variables["enable_thinking"] = enable_thinking
    try:
        return _compile(template).render(
            messages=normalize_messages(messages),
            tools=list(tools) if tools is not None else None,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **variables,
        )
    except (jinja2.TemplateError, TypeError) as e:  # TypeError: e.g. str + None for a missing content
        raise FleError(f"chat template: {e}; check the messages against what the template expects") from None


def render_prompt(tokenizer: "Tokenizer", messages: Sequence[dict], add_generation_prompt: bool = True,
                  *, template: str | None = None, **kwargs: Any) -> str:
    """:func:`apply_chat_template` with the model's own template (or
    ``template``) and its BOS/EOS token texts."""
    template = template if template is not None else tokenizer.chat_template
    if not template:
        raise FleError(f"{tokenizer.source}: the model has no tokenizer.chat_template; pass template=...")
    bos = tokenizer.tokens[tokenizer.bos_id] if tokenizer.bos_id is not None else ""
    eos = tokenizer.tokens[tokenizer.eos_id] if tokenizer.eos_id is not None else ""
    return apply_chat_template(template, messages, add_generation_prompt, bos_token=bos, eos_token=eos, **kwargs)
