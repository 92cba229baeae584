"""Tool calls in a chat answer, in the forms Qwen's chat templates teach:

- JSON in a block: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``
  (Qwen2.5 / Qwen3 templates);
- the XML function form of the newer (Qwen3-Coder style) templates:
  ``<tool_call>\\n<function=f>\\n<parameter=x>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>``,
  a parameter's value taken as JSON unless the tool's schema says string.

:class:`ToolCallStream` takes the content as it is generated and gives
back the content outside the blocks and each call once its block closes,
so streamed answers carry tool-call deltas as they complete.
"""
from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from .schema import ApiError, _show

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNC = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)", re.S)
_ID_CHARS = string.ascii_letters + string.digits


def _partial_suffix(text: str, word: str) -> int:
    for k in range(min(len(text), len(word) - 1), 0, -1):
        if text.endswith(word[:k]):
            return k
    return 0


@dataclass
class ToolCall:
    name: str
    arguments: str          # a JSON text, as OpenAI sends it
    id: str

    def openai(self, index: int) -> dict:
        """The streamed delta form (with ``index``)."""
        return {"index": index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}

    def message(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _new_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def _param_types(tools: list | None, name: str) -> dict[str, Any]:
    for t in tools or []:
        fn = t.get("function") or {}
        if fn.get("name") == name:
            return ((fn.get("parameters") or {}).get("properties") or {})
    return {}


def parse_call(body: str, tools: list | None) -> ToolCall | None:
    """The call inside one ``<tool_call>`` block, or None when it is neither form."""
    body = body.strip()
    if body.startswith("{"):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), _new_id())
    m = _FUNC.search(body)
    if m is None:
        return None
    name = m.group(1).strip()
    types = _param_types(tools, name)
    args: dict[str, Any] = {}
    for pm in _PARAM.finditer(m.group(2)):
        key, raw = pm.group(1).strip(), pm.group(2)
        kind = (types.get(key) or {}).get("type")
        if kind == "string":
            args[key] = raw
            continue
        try:
            args[key] = json.loads(raw)
        except json.JSONDecodeError:
            args[key] = raw
    return ToolCall(name, json.dumps(args, ensure_ascii=False), _new_id())


class ToolCallStream:
    """Splits streamed content into text and tool calls (see the module).
    ``tools`` None passes everything through as content. Without
    ``parallel``, calls after the first are dropped."""

    def __init__(self, tools: list | None, parallel: bool = True):
        self.enabled = tools is not None
        self.tools, self.parallel = tools, parallel
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._inside = False
        self._ws = ""             # whitespace held back: it may only lead into a tool call

    def _take(self, call: ToolCall | None, body: str) -> tuple[str, list[ToolCall]]:
        if call is None:
            return OPEN + body + CLOSE, []
        if self.calls and not self.parallel:
            return "", []
        self.calls.append(call)
        return "", [call]

    def _content(self, text: str, final: bool = False) -> str:
        text = self._ws + text
        self._ws = ""
        if not final:
            stripped = text.rstrip()
            self._ws = text[len(stripped):]
            text = stripped
        elif self.calls:
            text = text.rstrip()
        return text

    def add(self, text: str) -> tuple[str, list[ToolCall]]:
        if not self.enabled:
            return text, []
        self._buf += text
        out, found = "", []
        while True:
            if not self._inside:
                k = self._buf.find(OPEN)
                if k >= 0:
                    out += self._buf[:k]
                    self._buf = self._buf[k + len(OPEN):]
                    self._inside = True
                    self._ws = "" if not out.strip() and not self.calls else self._ws
                    if not out.strip():
                        out = ""
                    continue
                hold = _partial_suffix(self._buf, OPEN)
                out += self._buf[:len(self._buf) - hold]
                self._buf = self._buf[len(self._buf) - hold:]
                break
            k = self._buf.find(CLOSE)
            if k < 0:
                break
            body, self._buf = self._buf[:k], self._buf[k + len(CLOSE):]
            self._inside = False
            extra, got = self._take(parse_call(body, self.tools), body)
            out += extra
            found += got
        if found and not out.strip():
            out, self._ws = "", ""
        return self._content(out), found

    def finish(self) -> tuple[str, list[ToolCall]]:
        if not self.enabled:
            return "", []
        out, found = "", []
        if self._inside:
            call = parse_call(self._buf, self.tools)     # a block the answer did not close
            if call is None:
                out = OPEN + self._buf
            else:
                out, found = self._take(call, self._buf)
        else:
            out = self._buf
        self._buf, self._inside = "", False
        return self._content(out, final=True), found


@dataclass
class Choice:
    mode: str                   # auto, none, required, named
    parallel: bool
    grammar: tuple | None


def _call_schema(tool: dict) -> dict:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_choice(body: dict, tools: list | None) -> Choice:
    """``tool_choice`` and ``parallel_tool_calls``, checked. ``required`` and
    a named function constrain the answer to tool-call blocks (a grammar)."""
    raw = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ApiError(f"Field 'parallel_tool_calls': expected a boolean, got {_show(parallel)}")
    if raw is None:
        return Choice("auto", parallel, None)
    chosen = None
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise ApiError(f"Field 'tool_choice': expected 'auto', 'none', 'required' or a function, got {_show(raw)}")
        mode = raw
    elif isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("function"), dict) \
            and isinstance(raw["function"].get("name"), str):
        mode, chosen = "named", raw["function"]["name"]
    else:
        raise ApiError(f"Field 'tool_choice': expected 'auto', 'none', 'required' or "
                       f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {_show(raw)}")
    if mode in ("auto", "none"):
        return Choice(mode, parallel, None)
    if not tools:
        raise ApiError(f"Field 'tool_choice': {_show(raw)} needs 'tools'")
    pool = tools
    if chosen is not None:
        pool = [t for t in tools if t["function"]["name"] == chosen]
        if not pool:
            raise ApiError(f"Field 'tool_choice': no tool named {_show(chosen)} in 'tools'")
    schema = {"anyOf": [_call_schema(t) for t in pool]} if len(pool) > 1 else _call_schema(pool[0])
    call = f'"{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"'
    more = ' ("\\n" call)*' if parallel else ""
    lark = f"start: call{more}\ncall: {call}\n"
    return Choice(mode, parallel, ("lark", lark, "tool_choice"))
