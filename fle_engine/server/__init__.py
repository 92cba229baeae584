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

from .http import create_app
from .main import serve
from .slots import Engine, default_ctx_size
from .text import ReasoningStream, StopScanner, split_reasoning

__all__ = ["Engine", "StopScanner", "ReasoningStream", "split_reasoning", "create_app", "default_ctx_size", "serve"]
