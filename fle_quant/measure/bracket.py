"""Paired speed brackets against OpenAI-compatible servers.

A bracket runs the same prompts with the same sampling on every arm, in the
order reference, candidates..., reference again. Each request's decode speed
is the server's own ``timings.predicted_per_second`` (llama-server and
``fle-engine serve`` both report it), or completion tokens over the wall
time of the request where a server gives no timings. The reference's value
for a prompt is the mean of its two passes; each candidate's change is the
ratio of mean speeds over the prompts all arms answered, with a paired
bootstrap 95 % interval; the reference's drift between its passes must stay
within 5 % for the bracket to be valid. An arm is flagged invalid when a
request failed, when a reply stopped at the token limit (its speed is then
measured over a truncated answer; ``--allow-length`` accepts them), or when
the OS reported memory pressure during the arm (Linux PSI).
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from importlib import resources

import numpy as np

from ..errors import FleError
from ..textio import parse_json, read_bytes_file
from .client import ServerArm, chat
from .stats import DRIFT_LIMIT, N_BOOT, drift, paired_bootstrap

__all__ = ["Prompt", "load_prompts", "standard_prompts", "run_bracket", "analyse", "markdown", "summary_table",
           "read_bracket", "CATEGORIES", "MEMORY_PRESSURE_LIMIT"]

CATEGORIES = ("code", "math", "physics", "prose")
FORMAT = "fle-bracket/1"
# "some avg10" of /proc/pressure/memory above this (percent of time some task
# waited on memory over 10 s) flags an arm
MEMORY_PRESSURE_LIMIT = 10.0


@dataclass
class Prompt:
    id: str
    category: str
    prompt: str


def _parse_prompts(text: str, label: str) -> list[Prompt]:
    out: list[Prompt] = []
    seen: set[str] = set()
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        obj = parse_json(line.encode(), f"{label} line {n}", "prompt file")
        if not isinstance(obj, dict):
            raise FleError(f"{label} line {n}: not a JSON object with id, category and prompt")
        for key in ("id", "category", "prompt"):
            if not isinstance(obj.get(key), str) or not obj[key]:
                raise FleError(f"{label} line {n}: field {key!r} is missing or not a non-empty string")
        if obj["id"] in seen:
            raise FleError(f"{label} line {n}: id {obj['id']!r} appears twice; give each prompt its own id")
        seen.add(obj["id"])
        out.append(Prompt(obj["id"], obj["category"], obj["prompt"]))
    if not out:
        raise FleError(f"{label}: no prompts; give a JSONL file with one {{id, category, prompt}} per line")
    return out


def standard_prompts() -> list[Prompt]:
    """The project's 24 prompts: code 9, math 6, physics 3, prose 6."""
    text = resources.files(__package__).joinpath("data/prompts.jsonl").read_text("utf-8")
    return _parse_prompts(text, "the standard prompt set")


def load_prompts(path: str | None) -> list[Prompt]:
    if path is None:
        return standard_prompts()
    raw = read_bytes_file(path, "prompt file", max_bytes=16 << 20)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FleError(f"{path}: not UTF-8 text (byte {e.start}); give a JSONL prompt file") from None
    return _parse_prompts(text, os.fspath(path))


def _memory_pressure() -> float | None:
    try:
        with open("/proc/pressure/memory") as f:
            for line in f:
                if line.startswith("some "):
                    return float(dict(kv.split("=") for kv in line.split()[1:])["avg10"])
    except (OSError, ValueError, KeyError):
        return None
    return None


def _request_record(p: Prompt, reply) -> dict:
    rec = {"id": p.id, "category": p.category, "ok": reply.ok, "finish_reason": reply.finish_reason,
           "completion_tokens": reply.completion_tokens, "wall_s": reply.wall_s}
    if not reply.ok:
        rec.update(error=reply.error, speed=None, speed_source=None)
        return rec
    tps = reply.timings.get("predicted_per_second")
    n = reply.timings.get("predicted_n", reply.completion_tokens)
    if isinstance(tps, (int, float)) and not isinstance(tps, bool) and tps > 0:
        rec.update(speed=float(tps), speed_source="timings", predicted_n=n)
    elif reply.completion_tokens > 0 and reply.wall_s > 0:
        rec.update(speed=reply.completion_tokens / reply.wall_s, speed_source="wall")
    else:
        rec.update(ok=False, error="no tokens generated", speed=None, speed_source=None)
    return rec


def run_pass(arm: ServerArm, prompts: list[Prompt], body: dict, timeout: float, log) -> dict:
    """One arm's pass over the prompts."""
    with arm:
        psi0 = _memory_pressure()
        worst = psi0
        recs = []
        for i, p in enumerate(prompts):
            reply = chat(arm.url, {**body, "messages": [{"role": "user", "content": p.prompt}],
                                   "seed": body.get("seed", 0)}, timeout)
            rec = _request_record(p, reply)
            recs.append(rec)
            psi = _memory_pressure()
            if psi is not None:
                worst = psi if worst is None else max(worst, psi)
            log(f"  {arm.name} {i + 1}/{len(prompts)} {p.id}: "
                + (f"{rec['speed']:.2f} t/s ({rec['speed_source']}), {rec['completion_tokens']} tokens, "
                   f"{rec['finish_reason']}" if rec["ok"] else f"FAILED: {rec['error']}"))
    return {"name": arm.name, "url": arm.url, "requests": recs, "memory_pressure_avg10": worst}


def run_bracket(arms: list[ServerArm], prompts: list[Prompt], body: dict, *, timeout: float = 600.0,
                log=print) -> list[dict]:
    """Passes in bracket order: reference, candidates..., reference again."""
    if len(arms) < 2:
        raise FleError("a bracket needs a reference arm and at least one candidate arm (two --arm)")
    order = [arms[0], *arms[1:], arms[0]]
    passes = []
    for k, arm in enumerate(order):
        log(f"pass {k + 1}/{len(order)}: {arm.name} at {arm.url}")
        passes.append({**run_pass(arm, prompts, body, timeout, log), "pass": k + 1})
    return passes


def _invalid(p: dict, allow_length: bool) -> list[str]:
    why = []
    failed = [r["id"] for r in p["requests"] if not r["ok"]]
    if failed:
        why.append(f"{len(failed)} failed request{'s' if len(failed) > 1 else ''} ({', '.join(failed[:5])})")
    length = [r["id"] for r in p["requests"] if r["ok"] and r["finish_reason"] == "length"]
    if length and not allow_length:
        why.append(f"{len(length)} length-limit hit{'s' if len(length) > 1 else ''} ({', '.join(length[:5])})")
    psi = p.get("memory_pressure_avg10")
    if psi is not None and psi > MEMORY_PRESSURE_LIMIT:
        why.append(f"memory pressure (PSI some avg10 {psi:.1f} % > {MEMORY_PRESSURE_LIMIT:g} %)")
    return why


def analyse(passes: list[dict], *, allow_length: bool = False, n_boot: int = N_BOOT, seed: int = 0,
            drift_limit: float = DRIFT_LIMIT) -> dict:
    """Intervals, drift, validity and the per-category breakdown of a bracket's passes."""
    ref1, ref2, cands = passes[0], passes[-1], passes[1:-1]
    for p in passes:
        p["invalid"] = _invalid(p, allow_length)
    speeds = [{r["id"]: r["speed"] for r in p["requests"] if r["ok"]} for p in passes]
    common = [r["id"] for r in ref1["requests"] if all(r["id"] in s for s in speeds)]
    if len(common) < 2:
        raise FleError(f"only {len(common)} prompt(s) were answered by every arm; a bracket needs at least 2")
    cat = {r["id"]: r["category"] for r in ref1["requests"]}
    a = np.array([speeds[0][i] for i in common])
    b = np.array([speeds[-1][i] for i in common])
    ref = (a + b) / 2
    d = drift(a, b, drift_limit)
    out = {"paired_prompts": common, "reference": {"name": ref1["name"], "mean_speed": float(ref.mean()),
                                                     "pass1_mean_speed": float(a.mean()),
                                                     "pass2_mean_speed": float(b.mean()),
                                                     "valid": not ref1["invalid"] and not ref2["invalid"]},
           "drift": d.as_dict(), "candidates": []}
    for k, p in enumerate(cands, 1):
        c = np.array([speeds[k][i] for i in common])
        iv = paired_bootstrap(ref, c, n_boot=n_boot, seed=seed)
        cats = {}
        for name in dict.fromkeys(cat[i] for i in common):
            m = np.array([cat[i] == name for i in common])
            entry = {"n": int(m.sum()), "reference": float(ref[m].mean()), "candidate": float(c[m].mean()),
                     "change": float(c[m].mean() / ref[m].mean() - 1)}
            if m.sum() >= 2:
                civ = paired_bootstrap(ref[m], c[m], n_boot=n_boot, seed=seed)
                entry.update(low=civ.low, high=civ.high)
            cats[name] = entry
        out["candidates"].append({"name": p["name"], "mean_speed": float(c.mean()), "interval": iv.as_dict(),
                                  "categories": cats,
                                  "valid": not p["invalid"] and out["reference"]["valid"] and d.valid})
    out["valid"] = d.valid and out["reference"]["valid"] and all(not p["invalid"] for p in cands)
    return out


def markdown(result: dict) -> str:
    """One bracket as a markdown table, with its drift and invalid arms."""
    an = result["analysis"]
    ref = an["reference"]
    cats = list(dict.fromkeys(c for cand in an["candidates"] for c in cand["categories"]))
    head = "| arm | t/s | change | 95 % interval | " + " | ".join(cats) + " | valid |"
    rows = [head, "|" + "---|" * (5 + len(cats))]
    rows.append(f"| {ref['name']} (reference) | {ref['mean_speed']:.2f} | | | "
                + " | ".join("" for _ in cats) + f" | {'yes' if ref['valid'] else 'NO'} |")
    for c in an["candidates"]:
        iv = c["interval"]
        cc = " | ".join(f"{100 * c['categories'][k]['change']:+.1f} %" if k in c["categories"] else ""
                        for k in cats)
        rows.append(f"| {c['name']} | {c['mean_speed']:.2f} | {100 * iv['change']:+.2f} % | "
                    f"[{100 * iv['low']:+.2f}, {100 * iv['high']:+.2f}] % | {cc} | {'yes' if c['valid'] else 'NO'} |")
    d = an["drift"]
    lines = rows + ["", f"Reference drift {100 * d['change']:+.2f} % ({'within' if d['valid'] else 'OUTSIDE'} "
                        f"the {100 * d['limit']:g} % limit); {len(an['paired_prompts'])} paired prompts."]
    for p in result["passes"]:
        if p["invalid"]:
            lines.append(f"Invalid: {p['name']} (pass {p['pass']}): {'; '.join(p['invalid'])}.")
    return "\n".join(lines)


def build_result(passes: list[dict], settings: dict, prompts: list[Prompt], analysis: dict) -> dict:
    return {"format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "host": platform.node(), "settings": settings,
            "prompts": [{"id": p.id, "category": p.category} for p in prompts],
            "passes": passes, "analysis": analysis}


def read_bracket(path: str) -> dict:
    from ..textio import read_json_file

    obj, _ = read_json_file(path, "bracket result")
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise FleError(f"{path}: not an fle-bracket result (field 'format' is not {FORMAT!r})")
    an = obj.get("analysis")
    if an is None and isinstance(obj.get("error"), str):
        raise FleError(f"{path}: a bracket without an analysis ({obj['error']}); run it again")
    if not isinstance(an, dict) or not isinstance(an.get("candidates"), list) or "reference" not in an:
        raise FleError(f"{path}: field 'analysis' is missing or incomplete; give fle-bracket's --json output")
    return obj


def summary_table(results: list[tuple[str, dict]]) -> str:
    """One row per candidate over many brackets."""
    rows = ["| bracket | candidate | reference | ref. t/s | cand. t/s | change | 95 % interval | drift | valid |",
            "|---|---|---|---|---|---|---|---|---|"]
    for label, r in results:
        an = r["analysis"]
        for c in an["candidates"]:
            iv = c["interval"]
            rows.append(f"| {label} | {c['name']} | {an['reference']['name']} | {an['reference']['mean_speed']:.2f} "
                        f"| {c['mean_speed']:.2f} | {100 * iv['change']:+.2f} % | [{100 * iv['low']:+.2f}, "
                        f"{100 * iv['high']:+.2f}] % | {100 * an['drift']['change']:+.2f} % "
                        f"| {'yes' if c['valid'] else 'NO'} |")
    return "\n".join(rows)
