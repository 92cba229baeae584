"""``fle-engine serve`` under load: N concurrent clients over 2 slots for a
while, with canary content per conversation, on a factory model.

    PYTHONPATH=. python bench/serve_load.py [--clients 16] [--seconds 600] [--parallel 2] [--threads 1]

The script makes a factory model (fle_quant.synth.make_model), starts the
real program (``python -m fle_engine.cli serve MODEL --port 0 -np 2
--cache-ram 64``) and runs N clients against it. Each client runs
multi-turn conversations through llama-server's native ``/completion``
(greedy, ``cache_prompt`` on, ``return_tokens``): every conversation has a
canary string of its own (``canary-<client>-<n>-<random hex>``) written at
its start and in every user turn, and each turn's prompt is the previous
turn's prompt, its answer and a new user turn asking for the canary back,
so follow-up turns are served from a slot's tokens or the RAM prompt
cache. Mixed in: streams the client drops after the first events, bodies
that are not JSON, and prompts longer than a slot's context.

How a leak is detected. A factory model's text is meaningless, so the
answer cannot be read for the canary; what a leak changes is checked:

1. What the server must echo, on every answer: ``tokens_evaluated`` must be
   the number of tokens of *this* request's prompt (the client tokenizes it
   with the model's own tokenizer), ``id_slot`` must name a slot, and
   ``tokens_predicted`` must match the ``tokens`` returned (streamed: the
   streamed pieces must join into the text of those tokens).
2. Cache accounting, on every answer: the ``timings.cache_n`` prompt tokens
   the server says it reused must be a prefix the server was really given.
   The client keeps every token sequence it sent or was answered (prompt,
   prompt + answer tokens) per conversation; ``cache_n`` must not exceed the
   longest common prefix of the prompt with its own conversation's
   sequences or, for the header every conversation shares, with any other
   conversation's. Since the canary comes within the first tokens, a reuse
   past that header that is not explained by the own conversation is
   counted as a leak (state of another conversation, or of nothing sent).
3. The answer itself, on a sample (``--verify``, half of it drawn from
   turns that reused their own conversation's earlier tokens): greedy decoding makes the answer a
   function of the prompt alone, so the script recomputes it cold with the
   engine's own decode loop (``fle_engine.sampling.generate_tokens``, no
   slots, no cache, no scheduler) and compares token ids. A state loaded
   from another conversation, or a busy slot's state replaced, changes the
   answer. Where the two differ, the logits of the cold run at the first
   differing token decide: a margin under ``1e-3`` between the two tokens is
   a numerical tie between the batched and the one-by-one forward (counted
   apart as ``near_ties``), anything more a leak.
4. ``/slots``, polled every second: two slots, at most two processing,
   no slot holding more tokens than its context.

Outcomes are counted per request: ``answered`` (a valid request given 200
and passing 1-3), ``rejected`` (a malformed body or an oversize prompt given
the 400 it should get), ``dropped`` (streams the client cut), ``5xx``,
``unexpected`` (a valid request not answered with 200, a bad one not given
400, a transport error). At the end the server process must be alive,
``/health`` ``ok``, no slot processing, no traceback in its log, and it must
exit 0 on SIGTERM. Any failure: exit status 1.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

N_CTX_SLOT = 1024
TIE = 1e-3


def lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Stats:
    answered: int = 0
    rejected: int = 0
    dropped: int = 0
    errors_5xx: int = 0
    unexpected: int = 0
    leaks: int = 0
    echo_errors: int = 0
    slots_errors: int = 0
    near_ties: int = 0
    verified: int = 0
    cache_hits: int = 0
    tokens_generated: int = 0
    prompt_tokens: int = 0
    turns_cached_tokens: int = 0
    conversations: int = 0
    problems: list[str] = field(default_factory=list)

    def problem(self, what: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(what)


@dataclass
class Turn:
    conv: int
    prompt_ids: list[int]
    n_predict: int
    tokens: list[int]
    cache_n: int
    own_reuse: bool             # cache_n reaches past the header shared with other conversations


class Server:
    """``fle-engine serve`` as a child process; its log is drained in a thread."""

    def __init__(self, model_path: Path, n_parallel: int, threads: int, cache_ram: int):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fle_engine.cli", "serve", str(model_path), "--port", "0", "-np",
             str(n_parallel), "-c", str(N_CTX_SLOT * n_parallel), "-t", str(threads), "--cache-ram", str(cache_ram)],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.log: list[str] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.log.append(line)
            if "listening on http://" in line:
                self.base = line.split("listening on ")[1].split()[0]
                break
        else:
            line = ""
        if not self.log or "listening on" not in self.log[-1]:
            self.proc.kill()
            raise RuntimeError("the server did not start:\n" + "".join(self.log))
        self._drain = threading.Thread(target=self._read, daemon=True)
        self._drain.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)

    def tracebacks(self) -> int:
        return sum("Traceback" in line for line in self.log)

    def stop(self) -> int | None:
        if self.proc.poll() is not None:
            return self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


class Load:
    def __init__(self, base: str, tok, n_parallel: int, stats: Stats, seed: int):
        self.base, self.tok, self.n_parallel, self.st = base, tok, n_parallel, stats
        self.seed = seed
        self.seqs: dict[int, list[list[int]]] = {}    # per conversation: every sequence it sent or got
        self.heads: dict[int, list[int]] = {}         # per conversation: its first 64 tokens
        self.turns: list[Turn] = []
        self.n_conv = 0

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special=True, parse_special=True)

    def bound(self, conv: int, ids: list[int]) -> tuple[int, int]:
        own = max((lcp(ids, s) for s in self.seqs.get(conv, ())), default=0)
        head = ids[:64]
        cross = max((lcp(head, h) for c, h in self.heads.items() if c != conv), default=0)
        return own, cross

    # ---------------------------------------------------------------- checks on an answer

    def check(self, conv: int, ids: list[int], n_predict: int, rec: dict, streamed: str | None) -> Turn | None:
        st = self.st
        bad = []
        if rec.get("tokens_evaluated") != len(ids):
            bad.append(f"tokens_evaluated {rec.get('tokens_evaluated')} for a prompt of {len(ids)} tokens")
        if not isinstance(rec.get("id_slot"), int) or not 0 <= rec["id_slot"] < self.n_parallel:
            bad.append(f"id_slot {rec.get('id_slot')!r}")
        toks = rec.get("tokens")
        if not isinstance(toks, list) or rec.get("tokens_predicted") != len(toks) or len(toks) > n_predict:
            bad.append(f"tokens_predicted {rec.get('tokens_predicted')} with {len(toks or [])} tokens")
            toks = toks if isinstance(toks, list) else []
        text = self.tok.decode(toks)
        if streamed is not None and streamed != text:
            bad.append(f"streamed text {streamed[:40]!r} is not the text of the tokens {text[:40]!r}")
        if bad:
            st.echo_errors += 1
            st.problem(f"conversation {conv}: " + "; ".join(bad))
            return None
        cache_n = rec.get("timings", {}).get("cache_n", -1)
        own, cross = self.bound(conv, ids)
        if not 0 <= cache_n <= len(ids) or cache_n > max(own, cross):
            st.leaks += 1
            st.problem(f"conversation {conv}: cache_n {cache_n} but the prompt shares {own} tokens with its own "
                       f"conversation and {cross} with the others")
            return None
        st.tokens_generated += len(toks)
        st.prompt_tokens += len(ids)
        if cache_n > cross:
            st.cache_hits += 1
            st.turns_cached_tokens += cache_n
        self.seqs.setdefault(conv, []).append(ids + toks)
        return Turn(conv, ids, n_predict, toks, cache_n, cache_n > cross)

    # ---------------------------------------------------------------- a client

    async def client(self, i: int, session: aiohttp.ClientSession, t_end: float) -> None:
        rng = random.Random(self.seed * 1000 + i)
        st = self.st
        conv, text, k = -1, "", 0
        while time.monotonic() < t_end:
            if conv < 0 or len(self.encode(text)) > N_CTX_SLOT - 160:
                conv, k = self.n_conv, 0
                self.n_conv += 1
                st.conversations += 1
                canary = f"canary-{i:02d}-{conv:04d}-{secrets.token_hex(3)}"
                text = f"Conversation {canary}.\n"
                self.heads[conv] = self.encode(text)[:64]
            k += 1
            turn_text = text + f"User ({canary}) turn {k}: repeat the code {canary} back to me.\nAssistant:"
            ids = self.encode(turn_text)
            self.seqs.setdefault(conv, []).append(ids)
            n_predict = rng.randint(4, 24)
            r = rng.random()
            try:
                if r < 0.05:
                    await self.malformed(session, rng)
                    k -= 1
                    continue
                if r < 0.09:
                    await self.oversize(session, rng)
                    k -= 1
                    continue
                if r < 0.15:
                    await self.drop(session, turn_text, n_predict)
                    k -= 1                         # the user asks the same turn again
                    continue
                rec, streamed = await self.turn(session, turn_text, n_predict, stream=r < 0.45)
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
                st.unexpected += 1
                st.problem(f"client {i}: {type(e).__name__}: {e}")
                await asyncio.sleep(0.5)
                continue
            if rec is None:
                continue
            t = self.check(conv, ids, n_predict, rec, streamed)
            if t is None:
                continue
            st.answered += 1
            self.turns.append(t)
            text = turn_text + " " + self.tok.decode(t.tokens).replace("\x00", "") + "\n"

    def status(self, code: int, want: int, what: str) -> bool:
        st = self.st
        if code >= 500:
            st.errors_5xx += 1
            st.problem(f"{what}: HTTP {code}")
            return False
        if code != want:
            st.unexpected += 1
            st.problem(f"{what}: HTTP {code}, expected {want}")
            return False
        return True

    async def turn(self, session, prompt: str, n_predict: int, stream: bool):
        body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "cache_prompt": True,
                "return_tokens": True, "stream": stream}
        async with session.post(self.base + "/completion", json=body) as r:
            if not self.status(r.status, 200, "a conversation turn"):
                await r.read()
                return None, None
            if not stream:
                return await r.json(), None
            pieces, last = [], None
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    self.status(ev["error"].get("code", 500), 200, "a streamed turn's error event")
                    return None, None
                if ev.get("stop"):
                    last = ev
                else:
                    pieces.append(ev.get("content", ""))
            if last is None:
                self.st.unexpected += 1
                self.st.problem("a stream ended without its final record")
                return None, None
            return last, "".join(pieces)

    async def drop(self, session, prompt: str, n_predict: int) -> None:
        body = {"prompt": prompt, "n_predict": max(n_predict, 16), "temperature": 0, "stream": True,
                "ignore_eos": True}
        async with session.post(self.base + "/completion", json=body) as r:
            if not self.status(r.status, 200, "a stream to drop"):
                return
            n = 0
            async for raw in r.content:
                if raw.startswith(b"data: "):
                    n += 1
                    if n >= 2:
                        break
            r.close()                               # the client goes away mid-stream
        self.st.dropped += 1

    async def malformed(self, session, rng: random.Random) -> None:
        data = rng.choice([b'{"prompt": "unterminated', b"not json at all", b'{"prompt": [1, 2,', b"\xff\xfe{}",
                           b'{"prompt": "x", "n_predict": }'])
        path = rng.choice(["/completion", "/v1/completions", "/v1/chat/completions"])
        async with session.post(self.base + path, data=data, headers={"Content-Type": "application/json"}) as r:
            await r.read()
            if self.status(r.status, 400, f"a malformed body to {path}"):
                self.st.rejected += 1

    async def oversize(self, session, rng: random.Random) -> None:
        words = " ".join(f"w{rng.randint(0, 999)}" for _ in range(N_CTX_SLOT + 200))
        async with session.post(self.base + "/completion", json={"prompt": words, "n_predict": 4}) as r:
            await r.read()
            if self.status(r.status, 400, "an oversize prompt"):
                self.st.rejected += 1

    async def poll_slots(self, session, t_end: float) -> None:
        st = self.st
        while time.monotonic() < t_end:
            try:
                async with session.get(self.base + "/slots") as r:
                    if r.status != 200:
                        st.slots_errors += 1
                        st.problem(f"/slots: HTTP {r.status}")
                    else:
                        s = await r.json()
                        if (len(s) != self.n_parallel or sum(x["is_processing"] for x in s) > self.n_parallel
                                or any(x["n_cached_tokens"] > x["n_ctx"] for x in s)):
                            st.slots_errors += 1
                            st.problem(f"/slots: {s}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                st.slots_errors += 1
                st.problem(f"/slots: {type(e).__name__}: {e}")
            await asyncio.sleep(1.0)

    async def run(self, n_clients: int, seconds: float) -> None:
        t_end = time.monotonic() + seconds
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        async with aiohttp.ClientSession(timeout=timeout,
                                         connector=aiohttp.TCPConnector(limit=n_clients + 4)) as session:
            await asyncio.gather(self.poll_slots(session, t_end),
                                 *(self.client(i, session, t_end) for i in range(n_clients)))


def verify(model, tok, turns: list[Turn], n: int, stats: Stats, seed: int) -> None:
    """Compare a sample of the answers with cold greedy runs of the decode loop."""
    import torch

    from fle_engine.sampling import Sampler, SamplerParams, generate_tokens

    rng = random.Random(seed)
    hits = [t for t in turns if t.own_reuse]
    sample = rng.sample(hits, min(len(hits), n // 2))
    rest = [t for t in turns if not t.own_reuse]
    sample += rng.sample(rest, min(len(rest), n - len(sample)))
    greedy = SamplerParams(temp=0.0, seed=0)
    for t in sample:
        ref = list(generate_tokens(model, t.prompt_ids, t.n_predict, Sampler(greedy), stop=tok.eog_ids))
        stats.verified += 1
        if ref == t.tokens:
            continue
        j = lcp(ref, t.tokens)
        if j < len(ref) and j < len(t.tokens):
            state = model.new_state(len(t.prompt_ids) + j + 1)
            with torch.no_grad():
                logits = model.forward(t.prompt_ids + ref[:j], state)[-1].float()
            margin = float(logits[ref[j]] - logits[t.tokens[j]])
            if margin < TIE:
                stats.near_ties += 1
                continue
            what = f"margin {margin:.4f} at token {j}"
        else:
            what = f"lengths {len(t.tokens)} and {len(ref)} with equal tokens up to {j}"
        stats.leaks += 1
        stats.problem(f"conversation {t.conv}: answer {t.tokens} differs from a cold run's {ref} ({what})")


def run_load(model_path: Path, *, clients: int = 16, seconds: float = 600, n_parallel: int = 2, threads: int = 1,
             n_verify: int = 300, seed: int = 0, cache_ram: int = 64, log=print) -> tuple[Stats, dict]:
    """The load check against a fresh ``fle-engine serve`` of ``model_path``;
    returns the counts and the end state (server alive, health, exit status)."""
    import fle_engine
    from fle_engine.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(model_path)
    stats = Stats()
    server = Server(model_path, n_parallel, threads, cache_ram)
    end: dict = {}
    try:
        load = Load(server.base, tok, n_parallel, stats, seed)
        t0 = time.monotonic()
        asyncio.run(load.run(clients, seconds))
        end["wall_s"] = time.monotonic() - t0
        end["alive"] = server.proc.poll() is None

        async def finish() -> None:
            async with aiohttp.ClientSession() as s:
                async with s.get(server.base + "/health") as r:
                    end["health"] = (await r.json()).get("status") if r.status == 200 else f"HTTP {r.status}"
                for _ in range(50):                    # dropped streams end within the server's check period
                    async with s.get(server.base + "/slots") as r:
                        end["idle"] = not any(x["is_processing"] for x in await r.json())
                    if end["idle"]:
                        break
                    await asyncio.sleep(0.2)
        if end["alive"]:
            try:
                asyncio.run(finish())
            except aiohttp.ClientError as e:
                end["health"] = f"{type(e).__name__}: {e}"
        log(f"load done in {end['wall_s']:.0f} s; verifying {min(n_verify, len(load.turns))} answers against cold runs")
        import torch

        torch.set_num_threads(threads)
        verify(fle_engine.load(model_path), tok, load.turns, n_verify, stats, seed)
    finally:
        end["exit"] = server.stop()
        end["tracebacks"] = server.tracebacks()
        end["log_tail"] = "".join(server.log[-20:])
    return stats, end


def failed(stats: Stats, end: dict) -> list[str]:
    out = []
    for name in ("leaks", "errors_5xx", "unexpected", "echo_errors", "slots_errors"):
        if getattr(stats, name):
            out.append(f"{name} {getattr(stats, name)}")
    if stats.answered == 0:
        out.append("no request answered")
    if not end.get("alive"):
        out.append("the server died")
    if end.get("health") != "ok":
        out.append(f"/health {end.get('health')!r}")
    if not end.get("idle"):
        out.append("a slot still processing at the end")
    if end.get("tracebacks"):
        out.append(f"{end['tracebacks']} tracebacks in the server log")
    if end.get("exit") != 0:
        out.append(f"exit status {end.get('exit')} on SIGTERM")
    return out


def report(stats: Stats, end: dict, clients: int) -> str:
    n = stats.answered + stats.rejected + stats.dropped + stats.errors_5xx + stats.unexpected
    lines = [
        f"requests {n}: answered {stats.answered}, rejected as they should be {stats.rejected} "
        f"(malformed JSON, oversize prompts), dropped mid-stream by the client {stats.dropped}",
        f"5xx {stats.errors_5xx}, unexpected {stats.unexpected}, leaks {stats.leaks}, echo errors "
        f"{stats.echo_errors}, /slots errors {stats.slots_errors}",
        f"conversations {stats.conversations} by {clients} clients; turns reusing their conversation's "
        f"cached tokens {stats.cache_hits} ({stats.turns_cached_tokens} prompt tokens); answers verified against cold runs "
        f"{stats.verified} (near ties {stats.near_ties})",
        f"answered turns: {stats.prompt_tokens} prompt tokens, {stats.tokens_generated} generated tokens",
        f"server: alive {end.get('alive')}, /health {end.get('health')!r}, idle at the end {end.get('idle')}, "
        f"tracebacks {end.get('tracebacks')}, exit status on SIGTERM {end.get('exit')}; load wall "
        f"{end.get('wall_s', 0):.0f} s",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server (and of the verifier)")
    ap.add_argument("--verify", type=int, default=300, help="answers compared with cold runs afterwards")
    ap.add_argument("--arch", default="qwen3moe")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from fle_quant.synth import make_model

    with tempfile.TemporaryDirectory() as d:
        path = make_model(Path(d) / "m.gguf", args.arch, mix="f32")
        stats, end = run_load(path, clients=args.clients, seconds=args.seconds, n_parallel=args.parallel,
                              threads=args.threads, n_verify=args.verify, seed=args.seed)
    print(report(stats, end, args.clients))
    bad = failed(stats, end)
    for p in stats.problems[:20]:
        print("  problem:", p)
    if bad:
        print("FAILED:", "; ".join(bad))
        print(end.get("log_tail", ""))
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
