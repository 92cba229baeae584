"""The knowledge probe: short factual questions asked of a server, answers
matched against aliases.

Question files are JSONL in MKQA's layout, one question a line::

    {"example_id": "...", "queries": {"en": "...", "de": "...", ...},
     "answers": {"en": [{"type": "entity", "text": "Paris", "aliases": ["Paris, France"]}], ...}}

Each question is asked with an answer-only system prompt that allows the
reply "I don't know"; sampling as in the report: temperature 1.0, top-p
0.95, top-k 20, min-p 0, thinking off, at most 256 tokens, one seed per
question (from its ``example_id``, so the same in every file and
language). A reply is correct when one of the answer's text or aliases,
normalized (lower-cased, accents and punctuation removed, spaces
collapsed), equals the normalized reply or appears in it as whole words;
an abstention ("I don't know") is counted apart, neither right nor a wrong
answer. Two servers (or two saved results) are compared question by
question: the difference in accuracy with a paired bootstrap 95 % interval
and the exact McNemar test.
"""
from __future__ import annotations

import hashlib
import io
import os
import re
import time
import unicodedata
from dataclasses import dataclass
from importlib import resources

import numpy as np

from ..errors import FleError
from ..textio import parse_json, read_bytes_file
from .client import chat
from .stats import N_BOOT, mcnemar_exact, paired_bootstrap_diff

__all__ = ["Question", "normalize", "is_abstention", "is_correct", "parse_questions", "load_questions",
           "standard_questions", "parse_hub_spec", "download_questions", "question_seed", "run_probe", "score",
           "compare", "SYSTEM_PROMPT", "SAMPLING"]

FORMAT = "fle-probe/1"
SYSTEM_PROMPT = ("Answer the question with the answer only: a name, number, date or a few words, with no "
                 "explanation. If you do not know the answer, reply exactly: I don't know")
SAMPLING = {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "max_tokens": 256,
            "chat_template_kwargs": {"enable_thinking": False}}
_ABSTAIN = ("i dont know", "i do not know")
_THINK = re.compile(r"<think>.*?</think>", re.S)


def normalize(text: str) -> str:
    """Lower-cased, accents removed (NFKD, combining marks dropped),
    punctuation and symbols replaced by spaces, whitespace collapsed.
    Apostrophes vanish rather than split a word ("don't" -> "dont")."""
    t = unicodedata.normalize("NFKD", text.lower())
    out = []
    for ch in t:
        cat = unicodedata.category(ch)
        if cat == "Mn":
            continue
        if ch in "'’ʼ`":
            continue
        out.append(" " if cat[0] in "PSZC" else ch)
    return " ".join("".join(out).split())


def is_abstention(reply: str) -> bool:
    n = normalize(reply)
    return any(n == a or n.startswith(a + " ") or n.endswith(" " + a) for a in _ABSTAIN)


def is_correct(reply: str, aliases: list[str]) -> bool:
    n = f" {normalize(reply)} "
    for a in aliases:
        na = normalize(a)
        if na and f" {na} " in n:
            return True
    return False


@dataclass
class Question:
    id: str
    query: str
    aliases: list[str]


def parse_questions(text: str, label: str, lang: str) -> list[Question]:
    out, seen = [], set()
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{label} line {n}"
        obj = parse_json(line.encode(), where, "question file")
        if not isinstance(obj, dict):
            raise FleError(f"{where}: not a JSON object (example_id, queries, answers)")
        qid = obj.get("example_id")
        if isinstance(qid, int) and not isinstance(qid, bool):
            qid = str(qid)
        if not isinstance(qid, str) or not qid:
            raise FleError(f"{where}: field 'example_id' is missing or not a string")
        if qid in seen:
            raise FleError(f"{where}: example_id {qid!r} appears twice")
        seen.add(qid)
        queries, answers = obj.get("queries"), obj.get("answers")
        if not isinstance(queries, dict) or not isinstance(answers, dict):
            raise FleError(f"{where}: fields 'queries' and 'answers' must be objects keyed by language")
        q = queries.get(lang)
        if not isinstance(q, str) or not q.strip():
            raise FleError(f"{where}: no question in language {lang!r} (queries has {', '.join(sorted(queries))})")
        ans = answers.get(lang)
        if not isinstance(ans, list):
            raise FleError(f"{where}: field answers[{lang!r}] is missing or not a list")
        aliases: list[str] = []
        for k, a in enumerate(ans):
            if not isinstance(a, dict):
                raise FleError(f"{where}: answers[{lang!r}][{k}] is not an object with text and aliases")
            if isinstance(a.get("text"), str):
                aliases.append(a["text"])
            al = a.get("aliases", [])
            if not isinstance(al, list) or not all(isinstance(s, str) for s in al):
                raise FleError(f"{where}: answers[{lang!r}][{k}].aliases is not a list of strings")
            aliases += al
        aliases = [s for s in aliases if normalize(s)]
        if not aliases:
            continue  # MKQA's unanswerable questions: nothing to match
        out.append(Question(qid, q, aliases))
    if not out:
        raise FleError(f"{label}: no answerable questions in language {lang!r}")
    return out


def standard_questions(lang: str = "en") -> list[Question]:
    """The project's small question file (English and German)."""
    text = resources.files(__package__).joinpath("data/questions.jsonl").read_text("utf-8")
    return parse_questions(text, "the standard question file", lang)


HUB_PREFIX = "hf://datasets/"
_HUB_SPEC = re.compile(r"^hf://datasets/([A-Za-z0-9][\w.-]*/[\w.-]+)(?:@([^/]+))?/(.+)$")


def parse_hub_spec(spec: str) -> tuple[str, str | None, str]:
    """``hf://datasets/OWNER/NAME[@REVISION]/PATH``: (repo, revision or None, path)."""
    m = _HUB_SPEC.match(spec)
    if not m or ".." in m.group(3).split("/"):
        raise FleError(f"--questions {spec!r}: write a Hub file as hf://datasets/OWNER/NAME[@REVISION]/PATH, e.g. "
                       "hf://datasets/OWNER/mkqa@main/mkqa.jsonl.gz")
    return m.group(1), m.group(2), m.group(3)


def download_questions(spec: str) -> tuple[str, str]:
    """A question file on the Hugging Face Hub, downloaded (or taken from the
    local cache) with ``huggingface_hub``: (local path, ``hf://`` label with
    the commit it resolved to)."""
    repo, rev, path = parse_hub_spec(spec)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    try:
        local = hf_hub_download(repo, path, repo_type="dataset", revision=rev)
    except RepositoryNotFoundError:
        raise FleError(f"--questions {spec}: the Hub has no dataset {repo!r} (or it needs a login: "
                       "hf auth login)") from None
    except RevisionNotFoundError:
        raise FleError(f"--questions {spec}: dataset {repo} has no revision {rev!r}") from None
    except LocalEntryNotFoundError:
        raise FleError(f"--questions {spec}: not in the local Hub cache and the Hub cannot be reached "
                       "(offline?); download it once when online") from None
    except EntryNotFoundError:
        raise FleError(f"--questions {spec}: dataset {repo} has no file {path!r} at "
                       f"{rev or 'main'}; check the path") from None
    except HfHubHTTPError as e:
        raise FleError(f"--questions {spec}: the Hub answered {str(e).splitlines()[0]}") from None
    except OSError as e:
        raise FleError(f"--questions {spec}: cannot download it ({e})") from None
    parts = os.path.normpath(local).split(os.sep)
    commit = parts[parts.index("snapshots") + 1] if "snapshots" in parts else (rev or "main")
    return local, f"hf://datasets/{repo}@{commit}/{path}"


def load_questions(path: str | None, lang: str) -> list[Question]:
    """Questions from a JSONL file in MKQA's layout, plain or gzip-compressed
    (MKQA's own ``mkqa.jsonl.gz``); None: the project's small file."""
    if path is None:
        return standard_questions(lang)
    raw = read_bytes_file(path, "question file", max_bytes=512 << 20)
    if raw[:2] == b"\x1f\x8b":
        import gzip
        import zlib

        try:
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as g:
                raw = g.read((1 << 30) + 1)
        except (OSError, EOFError, zlib.error) as e:
            raise FleError(f"{path}: a damaged gzip file ({e}); download it again") from None
        if len(raw) > 1 << 30:
            raise FleError(f"{path}: decompresses to more than 1 GiB; give an MKQA-sized question file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FleError(f"{path}: not UTF-8 text (byte {e.start}); give a JSONL question file") from None
    return parse_questions(text, os.fspath(path), lang)


def question_seed(qid: str) -> int:
    """The question's sampling seed: the same for every file and language."""
    return int.from_bytes(hashlib.sha256(qid.encode("utf-8")).digest()[:4], "little") & 0x7FFFFFFF


def grade(reply: str, aliases: list[str]) -> str:
    """``correct``, ``abstain`` or ``wrong``."""
    reply = _THINK.sub("", reply).strip()
    if is_correct(reply, aliases):
        return "correct"
    if is_abstention(reply):
        return "abstain"
    return "wrong"


def run_probe(url: str, questions: list[Question], *, model: str = "", timeout: float = 300.0, log=print) -> list[dict]:
    recs = []
    for i, q in enumerate(questions):
        body = {**SAMPLING, "seed": question_seed(q.id),
                "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q.query}]}
        if model:
            body["model"] = model
        r = chat(url, body, timeout)
        g = grade(r.text, q.aliases) if r.ok else "failed"
        recs.append({"id": q.id, "reply": r.text, "grade": g, "error": r.error or None})
        log(f"  {i + 1}/{len(questions)} {q.id}: {g}")
    return recs


def score(records: list[dict]) -> dict:
    n = len(records)
    c = {g: sum(r["grade"] == g for r in records) for g in ("correct", "wrong", "abstain", "failed")}
    answered = c["correct"] + c["wrong"]
    return {"n": n, **c, "accuracy": c["correct"] / n if n else 0.0,
            "abstention_rate": c["abstain"] / n if n else 0.0,
            "precision": c["correct"] / answered if answered else 0.0}


def result(name: str, url: str, lang: str, source: str, records: list[dict]) -> dict:
    return {"format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "name": name,
            "url": url, "lang": lang, "questions": source, "sampling": SAMPLING, "system_prompt": SYSTEM_PROMPT,
            "records": records, "score": score(records)}


def read_result(path: str) -> dict:
    from ..textio import read_json_file

    obj, _ = read_json_file(path, "probe result")
    if not isinstance(obj, dict) or obj.get("format") != FORMAT or not isinstance(obj.get("records"), list):
        raise FleError(f"{path}: not an fle-probe result (field 'format' is not {FORMAT!r}); give fle-probe's "
                       "--json output")
    for k, r in enumerate(obj["records"]):
        if not isinstance(r, dict) or not isinstance(r.get("id"), str) or r.get("grade") not in (
                "correct", "wrong", "abstain", "failed"):
            raise FleError(f"{path}: records[{k}] is not a graded question (id, grade)")
    return obj


def compare(a: dict, b: dict, *, n_boot: int = N_BOOT, seed: int = 0) -> dict:
    """B against A over the questions both answered without a failed request."""
    ga = {r["id"]: r["grade"] for r in a["records"]}
    gb = {r["id"]: r["grade"] for r in b["records"]}
    ids = [i for i in ga if i in gb and ga[i] != "failed" and gb[i] != "failed"]
    if len(ids) < 2:
        raise FleError(f"only {len(ids)} question(s) were graded in both results; a comparison needs 2 or more")
    x = np.array([ga[i] == "correct" for i in ids], dtype=np.float64)
    y = np.array([gb[i] == "correct" for i in ids], dtype=np.float64)
    iv = paired_bootstrap_diff(x, y, n_boot=n_boot, seed=seed)
    n10, n01, p = mcnemar_exact(x, y)
    return {"a": a.get("name"), "b": b.get("name"), "n": len(ids), "accuracy_a": float(x.mean()),
            "accuracy_b": float(y.mean()), "difference": iv.as_dict(), "a_only": n10, "b_only": n01,
            "mcnemar_p": p}


def format_compare(c: dict) -> str:
    d = c["difference"]
    return (f"{c['b']} vs {c['a']} on {c['n']} questions: accuracy {100 * c['accuracy_b']:.1f} % vs "
            f"{100 * c['accuracy_a']:.1f} %, difference {100 * d['change']:+.1f} points "
            f"[{100 * d['low']:+.1f}, {100 * d['high']:+.1f}] (95 %); right only in {c['a']}: {c['a_only']}, "
            f"only in {c['b']}: {c['b_only']}; exact McNemar p = {c['mcnemar_p']:.3g}")


def format_score(name: str, s: dict) -> str:
    return (f"{name}: {s['correct']}/{s['n']} correct ({100 * s['accuracy']:.1f} %), {s['wrong']} wrong, "
            f"{s['abstain']} abstained ({100 * s['abstention_rate']:.1f} %), {s['failed']} failed; "
            f"precision when answering {100 * s['precision']:.1f} %")
