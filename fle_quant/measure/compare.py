"""The equal-budget comparison: several GGUF files measured on one chain.

Every file gets the same two measurements:

* **quality**: mean KLD and top-1 agreement against one base model's
  log-probabilities on each text (llama-perplexity's base files, made by
  ``fle-kld base`` or ``llama-perplexity --kl-divergence-base``);
* **speed**: paired brackets (:mod:`.bracket`) in which every arm is a
  server started for its file with the same expert cache budget in bytes,
  so that the slot count per layer follows from the expert size instead of
  leaving a smaller file's GPU memory unused. The first file is the
  reference of every bracket; the others run in groups (reference,
  candidates of the group, reference again).

This module holds the plain parts: the server command per file, the
groups, and the rows of the table built from KLD summaries and bracket
results. The forward passes and the servers are run by ``fle-compare``.
"""
from __future__ import annotations

import re
import shlex
import socket
import string
import sys

from ..errors import FleError
from ..units import format_size

__all__ = ["FORMAT", "DEFAULT_SERVER", "server_command", "free_port", "groups", "rows", "markdown", "parse_named"]

FORMAT = "fle-compare/1"
DEFAULT_SERVER = "{python} -m fle_engine.cli serve {model} --port {port} --cache-budget {budget}"
_FIELDS = {"python", "model", "port", "budget"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,99}$")


def parse_named(arg: str, what: str) -> tuple[str | None, str]:
    """``NAME=PATH`` or ``PATH``: (NAME or None, PATH)."""
    head, sep, tail = arg.partition("=")
    if sep and "/" not in head and tail:
        if not _NAME.match(head):
            raise FleError(f"{what} {arg!r}: the name {head!r} must be letters, digits, '.', '_', '+' or '-'")
        return head, tail
    return None, arg


def check_server_template(template: str) -> None:
    try:
        used = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise FleError(f"--server {template!r}: {e}; write fields as {{model}}, {{port}}, {{budget}}") from None
    unknown = used - _FIELDS
    if unknown:
        raise FleError(f"--server: unknown field {{{sorted(unknown)[0]}}}; the fields are "
                       "{python}, {model}, {port} and {budget}")
    for need in ("model", "port"):
        if need not in used:
            raise FleError(f"--server {template!r} has no {{{need}}}; every server needs its file and port")


def server_command(template: str, model: str, port: int, budget: str) -> str:
    """The shell command that serves ``model`` on ``port`` with the cache budget."""
    return template.format(python=shlex.quote(sys.executable), model=shlex.quote(model), port=port,
                           budget=shlex.quote(budget))


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def groups(n_candidates: int, size: int) -> list[list[int]]:
    """Candidate indices (1..n) in brackets of at most ``size``."""
    if size < 1:
        raise FleError(f"--group must be at least 1, got {size}")
    idx = list(range(1, n_candidates + 1))
    return [idx[i:i + size] for i in range(0, len(idx), size)]


def rows(files: list[dict], klds: dict[str, dict[str, dict]], brackets: list[dict]) -> list[dict]:
    """One row per file: its size, its KLD summaries per text and its speed.

    ``files``: ``{name, path, size_bytes}`` in command-line order (the first
    is the bracket reference); ``klds[name][text]``: a KLD summary as a dict
    (``kld_mean``, ``kld_unc``, ``same_top``, ``same_top_unc``);
    ``brackets``: fle-bracket results (with ``analysis``, or ``error``)."""
    out = []
    ref = files[0]["name"]
    for f in files:
        row = {"name": f["name"], "path": f["path"], "size_bytes": f["size_bytes"], "kld": klds.get(f["name"], {}),
               "reference": f["name"] == ref, "speed": []}
        for k, b in enumerate(brackets, 1):
            an = b.get("analysis")
            if an is None:
                continue
            if row["reference"]:
                r = an["reference"]
                row["speed"].append({"bracket": k, "mean_speed": r["mean_speed"], "valid": r["valid"],
                                     "drift": an["drift"]["change"]})
            for c in an["candidates"]:
                if c["name"] == f["name"]:
                    iv = c["interval"]
                    row["speed"].append({"bracket": k, "mean_speed": c["mean_speed"], "change": iv["change"],
                                         "low": iv["low"], "high": iv["high"], "valid": c["valid"],
                                         "drift": an["drift"]["change"]})
        out.append(row)
    return out


def _kld_cell(s: dict | None) -> str:
    """Four decimals, as the report writes KLD; values below 0.01 with their digits."""
    if not s:
        return ""
    m, u = s["kld_mean"], s["kld_unc"]
    if abs(m) >= 0.01 or m == 0:
        return f"{m:.4f} ± {u:.4f}"
    return f"{m:.3g} ± {u:.2g}"


def _top_cell(s: dict | None) -> str:
    if not s:
        return ""
    return f"{100 * s['same_top']:.2f} ± {100 * s['same_top_unc']:.2f}"


def markdown(result: dict) -> str:
    """The comparison table: size, mean KLD and top-1 per text, decode speed
    and the change against the reference with its 95 % interval."""
    texts = result["texts"]
    head = ["file", "size"] + [f"KLD {t}" for t in texts] + [f"top-1 % {t}" for t in texts] + \
           ["t/s", "change", "95 % interval", "bracket", "valid"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        kl = [_kld_cell(r["kld"].get(t)) for t in texts] + [_top_cell(r["kld"].get(t)) for t in texts]
        speeds = r["speed"] or [{}]
        for s in speeds:
            if not s:
                sp = ["", "", "", "", "no speed"]
            elif r["reference"]:
                sp = [f"{s['mean_speed']:.2f}", "reference", "", f"B{s['bracket']}", "yes" if s["valid"] else "NO"]
            else:
                sp = [f"{s['mean_speed']:.2f}", f"{100 * s['change']:+.2f} %",
                      f"[{100 * s['low']:+.2f} .. {100 * s['high']:+.2f}] %", f"B{s['bracket']}",
                      "yes" if s["valid"] else "NO"]
            lines.append("| " + " | ".join([r["name"], format_size(r["size_bytes"])] + kl + sp) + " |")
    st = result["settings"]
    lines.append("")
    lines.append(f"KLD against {st['kld_base']} on {', '.join(texts)} (± one standard error); speed in paired "
                 f"brackets against {result['rows'][0]['name']} at a cache budget of {st['budget']} for every "
                 f"file, {st['n_prompts']} prompts per arm, 95 % paired bootstrap intervals.")
    for k, b in enumerate(result["brackets"], 1):
        an = b.get("analysis")
        if an is None:
            lines.append(f"Bracket B{k}: no analysis ({b.get('error', 'no result')}).")
            continue
        d = an["drift"]
        inv = [f"{p['name']} (pass {p['pass']}): {'; '.join(p['invalid'])}" for p in b["passes"] if p["invalid"]]
        lines.append(f"Bracket B{k}: reference drift {100 * d['change']:+.2f} % "
                     f"({'within' if d['valid'] else 'OUTSIDE'} the {100 * d['limit']:g} % limit)"
                     + (f"; invalid: {', '.join(inv)}" if inv else "") + ".")
    return "\n".join(lines)
