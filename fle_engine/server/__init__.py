"""``fle-engine serve``: an OpenAI-compatible HTTP server on FLE's reference
forward pass (or the GPU engine), answering the way llama.cpp's
``llama-server`` does.

The package's homes: :mod:`.http` (aiohttp handlers, CORS, API key),
:mod:`.schema` (request fields, their checks and llama-server's defaults
and error wording), :mod:`.slots` (the engine: slots with their own state on
one model, and the scheduler that decodes them in batched rounds),
:mod:`.cache` (state snapshots, the RAM prompt cache, slot files),
:mod:`.text` (stop strings, the ``<think>`` split into
``reasoning_content``), :mod:`.tools` (tool-call parsing), :mod:`.grammar`
(structured output through llguidance), :mod:`.metrics` (Prometheus text)
and :mod:`.main` (the program). docs/engine.md lists the endpoints and
fields.

Bad requests are HTTP 4xx with ``{"error": {"code", "message", "type"}}``:
type ``invalid_request_error``, or ``exceed_context_size_error`` (with
``n_prompt_tokens`` and ``n_ctx``) when the prompt alone does not fit a
slot's context; a prompt plus ``max_tokens`` beyond it is accepted and
stops at its end. The decode runs in a worker thread so that the event loop
keeps answering; a client that goes away stops its generation at the next
round.
"""
from __future__ import annotations

from .http import create_app
from .main import serve
from .slots import Engine, default_ctx_size
from .text import ReasoningStream, StopScanner, split_reasoning

__all__ = ["Engine", "StopScanner", "ReasoningStream", "split_reasoning", "create_app", "default_ctx_size", "serve"]
