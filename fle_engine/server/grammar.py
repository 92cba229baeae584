"""Structured output through llguidance (the constrained-decoding library
llama.cpp uses): ``response_format`` ``json_object`` / ``json_schema``,
llama-server's ``json_schema`` and ``grammar`` (GBNF, or Lark) fields, and
the tool-call grammar of ``tool_choice``.

A matcher masks the logits of each step on the host (the reference path
and the engine's lanes sample there anyway) and takes each sampled token;
generation ends when the grammar is complete.
"""
from __future__ import annotations

import json
import threading

import numpy as np

from .schema import ApiError, _show

_LOCK = threading.Lock()


def requested(body: dict) -> tuple[str, str, str] | None:
    """(kind, grammar text, field) of the request's constraint, or None."""
    fmt = body.get("response_format")
    found = []
    if fmt is not None:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type", "text"), str):
            raise ApiError(f"Field 'response_format': expected an object with a 'type', got {_show(fmt)}")
        kind = fmt.get("type", "text")
        if kind == "json_object":
            schema = fmt.get("schema") or {"type": "object"}
            found.append(("json", json.dumps(schema), "response_format"))
        elif kind == "json_schema":
            js = fmt.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            if schema is None and isinstance(fmt.get("schema"), dict):
                schema = fmt["schema"]
            if not isinstance(schema, dict):
                raise ApiError("Field 'response_format': json_schema needs 'json_schema': {'schema': {...}}")
            found.append(("json", json.dumps(schema), "response_format"))
        elif kind != "text":
            raise ApiError(f"Field 'response_format': type must be text, json_object or json_schema, got {_show(kind)}")
    js = body.get("json_schema")
    if js is not None:
        if not isinstance(js, dict):
            raise ApiError(f"Field 'json_schema': expected a JSON schema object, got {_show(js)}")
        found.append(("json", json.dumps(js), "json_schema"))
    g = body.get("grammar")
    if g is not None and g != "":
        if not isinstance(g, str):
            raise ApiError(f"Field 'grammar': expected a string, got {_show(g)}")
        found.append(("grammar", g, "grammar"))
    if len(found) > 1:
        raise ApiError(f"Fields {', '.join(repr(f[2]) for f in found)}: give one constraint, not several")
    return found[0] if found else None


class _GTokenizer:
    """What ``llguidance.TokenizerWrapper`` reads from a tokenizer."""

    def __init__(self, tok, n_vocab: int):
        self.tok = tok
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.eog_ids)
        self.bos_token_id = tok.bos_id
        self.tokens = [tok.decode_token(i, special=False) if i < tok.n_vocab else b"" for i in range(n_vocab)]
        types = getattr(tok, "token_types", None)
        self.special_token_ids = [i for i in range(tok.n_vocab)
                                  if (types is not None and int(types[i]) in (3, 4)) or i in tok.eog_ids]
        for i in self.special_token_ids:
            self.tokens[i] = tok.decode_token(i, special=True)

    def __call__(self, s) -> list[int]:
        if isinstance(s, bytes):
            s = s.decode("utf-8", errors="replace")
        return self.tok.encode(s, add_special=False, parse_special=False)


def _lltokenizer(engine):
    import llguidance

    with _LOCK:
        lt = getattr(engine, "_lltok", None)
        if lt is None:
            n_vocab = engine.model.n_vocab
            gt = _GTokenizer(engine.tok, n_vocab)
            lt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(gt), n_vocab=n_vocab,
                                        eos_token=sorted(engine.tok.eog_ids))
            engine._lltok = lt
        return lt


class Matcher:
    """One request's grammar state: ``mask(logits)``, ``accept(token)``, ``finished()``."""

    def __init__(self, m, n_vocab: int, field: str):
        self.m, self.n_vocab, self.field = m, n_vocab, field

    def mask(self, x: np.ndarray) -> np.ndarray:
        bits = np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:x.size].astype(bool)
        return np.where(allowed, x, -np.inf).astype(np.float32)

    def accept(self, tok: int) -> None:
        self.m.consume_token(int(tok))

    def finished(self) -> bool:
        return self.m.is_stopped()


def matcher(engine, spec: tuple[str, str, str]) -> Matcher:
    try:
        import llguidance
    except ImportError:
        raise ApiError(f"Field '{spec[2]}': structured output needs the llguidance package "
                       "(pip install llguidance)") from None
    kind, text, field = spec
    L = llguidance.LLMatcher
    try:
        if kind == "json":
            grammar = L.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
        elif kind == "lark":
            grammar = L.grammar_from_lark(text)
        else:
            from llguidance.gbnf_to_lark import any_to_lark

            grammar = L.grammar_from_lark(any_to_lark(text))
    except Exception as e:  # noqa: BLE001 - the library's word on a bad grammar
        raise ApiError(f"Field '{field}': {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    lt = _lltokenizer(engine)
    m = L(lt, grammar, log_level=0)
    if m.is_error():
        raise ApiError(f"Field '{field}': {m.get_error().splitlines()[0]}")
    return Matcher(m, engine.model.n_vocab, field)
