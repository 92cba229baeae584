"""The KLD acceptance rule.

A candidate file is accepted against a reference file (both measured
against the same base model, on the same texts) when, on every text,

* its mean KLD is at most two combined standard errors above the
  reference's: ``kld_c <= kld_r + 2 * sqrt(se_c**2 + se_r**2)``, and
* its top-1 agreement with the base ("Same top p") is at most 0.5
  percentage points below the reference's,

and a held-out text, one not used while the candidate was made, confirms
both. Inputs are the closing statistics of ``fle-kld MODEL --base BASE.kld``
or of ``llama-perplexity --kl-divergence`` as printed (saved with ``tee``),
or the same numbers as JSON (the fields of :class:`fle_quant.kld.KldSummary`:
``kld_mean``, ``kld_unc``, ``same_top``, ``same_top_unc``, fractions for
top-1).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..errors import FleError
from ..textio import parse_json, read_bytes_file
from .stats import combined_se

__all__ = ["KldResult", "TextVerdict", "read_kld_result", "judge_text", "judge", "KLD_SIGMAS", "TOP1_POINTS"]

KLD_SIGMAS = 2.0
TOP1_POINTS = 0.5
_MAX_BYTES = 16 << 20

_NUM = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"
_PM = r"\s*(?:±|\+/-)\s*"
_KLD_RE = re.compile(r"^Mean\s+KLD:\s*" + _NUM + _PM + _NUM, re.M)
_TOP_RE = re.compile(r"^Same top p:\s*" + _NUM + _PM + _NUM + r"\s*%", re.M)


@dataclass
class KldResult:
    """One model's KLD against the base on one text; top-1 in percent."""

    path: str
    kld: float
    kld_se: float
    top1: float
    top1_se: float


def _field(obj: dict, key: str, label: str) -> float:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise FleError(f"{label}: field {key!r} is {'missing' if v is None else repr(v)}; "
                       "give a number (the fields of fle-kld's summary)")
    if v < 0:
        raise FleError(f"{label}: field {key!r} is {v}, below 0")
    return float(v)


def read_kld_result(path: "str | os.PathLike[str]") -> KldResult:
    """The mean KLD and top-1 agreement of one KLD run: its printed closing
    statistics (text) or a JSON summary."""
    label = os.fspath(path)
    raw = read_bytes_file(path, "KLD result", max_bytes=_MAX_BYTES)
    if raw.lstrip()[:1] == b"{":
        obj = parse_json(raw, label, "KLD summary")
        if not isinstance(obj, dict):
            raise FleError(f"{label}: not a KLD summary (a JSON object with kld_mean, kld_unc, same_top, "
                           "same_top_unc)")
        top = _field(obj, "same_top", label)
        if top > 1:
            raise FleError(f"{label}: field 'same_top' is {top}; it is a fraction (0..1)")
        return KldResult(label, _field(obj, "kld_mean", label), _field(obj, "kld_unc", label),
                         100 * top, 100 * _field(obj, "same_top_unc", label))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FleError(f"{label}: not UTF-8 text (byte {e.start}); give fle-kld's or llama-perplexity's "
                       "output") from None
    k = _KLD_RE.findall(text)
    t = _TOP_RE.findall(text)
    if not k:
        raise FleError(f"{label}: no 'Mean    KLD: X ± Y' line; give the output of fle-kld MODEL --base "
                       "BASE.kld or llama-perplexity --kl-divergence")
    if not t:
        raise FleError(f"{label}: no 'Same top p: X ± Y %' line; give the whole closing statistics")
    kld, kse = (float(x) for x in k[-1])
    top, tse = (float(x) for x in t[-1])
    if not 0 <= top <= 100:
        raise FleError(f"{label}: 'Same top p' is {top} %, not a percentage")
    return KldResult(label, kld, kse, top, tse)


@dataclass
class TextVerdict:
    name: str
    held_out: bool
    candidate: KldResult
    reference: KldResult

    @property
    def kld_limit(self) -> float:
        return self.reference.kld + KLD_SIGMAS * combined_se(self.candidate.kld_se, self.reference.kld_se)

    @property
    def kld_ok(self) -> bool:
        return self.candidate.kld <= self.kld_limit

    @property
    def top1_drop(self) -> float:
        """Percentage points the candidate's top-1 is below the reference's."""
        return self.reference.top1 - self.candidate.top1

    @property
    def top1_ok(self) -> bool:
        return self.top1_drop <= TOP1_POINTS + 1e-12

    @property
    def ok(self) -> bool:
        return self.kld_ok and self.top1_ok

    def as_dict(self) -> dict:
        c, r = self.candidate, self.reference
        return {"text": self.name, "held_out": self.held_out,
                "candidate": {"file": c.path, "kld": c.kld, "kld_se": c.kld_se, "top1": c.top1, "top1_se": c.top1_se},
                "reference": {"file": r.path, "kld": r.kld, "kld_se": r.kld_se, "top1": r.top1, "top1_se": r.top1_se},
                "kld_limit": self.kld_limit, "kld_ok": self.kld_ok, "top1_drop_points": self.top1_drop,
                "top1_ok": self.top1_ok, "ok": self.ok}


def judge_text(name: str, candidate: KldResult, reference: KldResult, held_out: bool = False) -> TextVerdict:
    return TextVerdict(name, held_out, candidate, reference)


def judge(verdicts: list[TextVerdict]) -> tuple[bool, str]:
    """The overall verdict and the sentence that says why."""
    fit = [v for v in verdicts if not v.held_out]
    held = [v for v in verdicts if v.held_out]
    if not held:
        return False, "not accepted: no held-out text confirms it"
    bad = [v.name for v in fit if not v.ok]
    if bad:
        return False, f"not accepted: fails the rule on {', '.join(bad)}"
    bad = [v.name for v in held if not v.ok]
    if bad:
        return False, (f"not accepted: the held-out text{'s' if len(bad) > 1 else ''} {', '.join(bad)} "
                       f"{'do' if len(bad) > 1 else 'does'} not confirm it")
    return True, (f"accepted: within the rule on {len(fit)} text{'s' if len(fit) != 1 else ''}, "
                  f"confirmed on held-out {', '.join(v.name for v in held)}")


def format_table(verdicts: list[TextVerdict]) -> str:
    rows = ["| text | candidate KLD | reference KLD | limit | top-1 cand. % | top-1 ref. % | drop (pts) | ok |",
            "|---|---|---|---|---|---|---|---|"]
    for v in verdicts:
        c, r = v.candidate, v.reference
        name = v.name + (" (held out)" if v.held_out else "")
        rows.append(f"| {name} | {c.kld:.6f} ± {c.kld_se:.6f} | {r.kld:.6f} ± {r.kld_se:.6f} | {v.kld_limit:.6f} "
                    f"| {c.top1:.3f} ± {c.top1_se:.3f} | {r.top1:.3f} ± {r.top1_se:.3f} | {v.top1_drop:+.3f} "
                    f"| {'yes' if v.ok else 'NO' + (' (KLD)' if not v.kld_ok else '') + (' (top-1)' if not v.top1_ok else '')} |")
    return "\n".join(rows)
