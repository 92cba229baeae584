"""The engine side of the server: one loaded model, its slots, the decode loop."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

from fle_quant.errors import FleError

from ..sampling import Sampler, SamplerParams, generate_tokens
from ..speculative import SpecStats, generate_speculative
from .text import StopScanner

CTX_CAP = 8192          # default context: the model's own, at most this many tokens

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
