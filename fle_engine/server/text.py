"""Text handling of generated answers: stop strings and the split of a
chat answer's thinking into ``reasoning_content``."""
from __future__ import annotations

from typing import Sequence

THINK_START, THINK_END = "<think>", "</think>"

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
        if not self.stops:
            return text
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
