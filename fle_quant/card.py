"""Hugging Face model cards generated from a GGUF file, never typed by hand.

Everything in the card comes from the file itself (its metadata, the
``fle.provenance.*`` keys ``fle-splice`` wrote, and the sizes
:func:`fle_quant.inspect.summarize` measures) or from a quality JSON given
explicitly; a card regenerated from the same inputs is byte-identical (no
dates, no absolute paths).

The card holds: YAML front matter (``base_model`` from the file's
``general.source.repo_url`` or ``general.base_model.N.repo_url`` when they
point at Hugging Face; ``license`` from ``general.license``, else ``other``
with a note; tags ``gguf``, ``moe``, ``fle`` and the architecture), the files
and their sizes, size and bits per weight, the sources with their SHA-256s,
the per-layer source table, and quality numbers when given.

Quality JSON (``--quality``), format ``fle.quality/1``::

    {
      "format": "fle.quality/1",           # optional
      "reference": "BF16 model, llama.cpp", # optional, free text: what KLD is measured against
      "texts": {                           # required, at least one text
        "E": {"mean_kld": 0.0123,          # required, mean KL divergence (nats/token), >= 0
              "kld_se": 0.0004,            # optional, its standard error, >= 0
              "top1": 0.953,               # optional, top-1 agreement with the reference, in [0, 1]
              "n_tokens": 4096}            # optional, tokens evaluated, > 0
      }
    }

Unknown keys are rejected, so that a misspelt number never silently drops
out of a published card.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from .errors import FleError
from .textio import read_json_file, write_text_atomic
from .gguf_reader import GGUFModel
from .inspect import ModelSummary, summarize
from .splice import PROVENANCE_PREFIX

__all__ = ["QUALITY_FORMAT", "load_quality", "parse_quality", "base_models", "make_card", "write_card"]

QUALITY_FORMAT = "fle.quality/1"
_QUALITY_KEYS = {"format", "reference", "texts"}
_TEXT_KEYS = {"mean_kld", "kld_se", "top1", "n_tokens"}
_HF_URL = re.compile(r"^https?://(?:www\.)?(?:huggingface\.co|hf\.co)/([A-Za-z0-9][\w.-]*/[\w.-]+?)/?(?:[?#].*)?$")


# ---------------------------------------------------------------------------
# inputs


def parse_quality(obj: Any, label: str = "quality") -> dict:
    """Validate a decoded quality JSON (see the module docstring)."""
    if not isinstance(obj, dict):
        raise FleError(f"{label}: expected a JSON object with \"texts\"")
    for k in obj:
        if k not in _QUALITY_KEYS:
            raise FleError(f"{label}: unknown key {k!r}; allowed: {', '.join(sorted(_QUALITY_KEYS))}")
    if "format" in obj and obj["format"] != QUALITY_FORMAT:
        raise FleError(f"{label}: format is {obj['format']!r}, expected {QUALITY_FORMAT!r}")
    if "reference" in obj and not isinstance(obj["reference"], str):
        raise FleError(f"{label}: reference must be a string")
    texts = obj.get("texts")
    if not isinstance(texts, dict) or not texts:
        raise FleError(f"{label}: \"texts\" must be a non-empty object TEXT -> {{\"mean_kld\": ...}}")
    out: dict[str, dict] = {}
    for name, entry in texts.items():
        where = f"{label}: texts.{name}"
        if not isinstance(entry, dict):
            raise FleError(f"{where} must be an object with mean_kld")
        for k in entry:
            if k not in _TEXT_KEYS:
                raise FleError(f"{where} has an unknown key {k!r}; allowed: {', '.join(sorted(_TEXT_KEYS))}")
        if "mean_kld" not in entry:
            raise FleError(f"{where} has no \"mean_kld\"")
        for k in ("mean_kld", "kld_se", "top1"):
            if k in entry:
                v = entry[k]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise FleError(f"{where}.{k} must be a finite number >= 0, got {v!r}")
        if "top1" in entry and entry["top1"] > 1:
            raise FleError(f"{where}.top1 is a fraction in [0, 1], got {entry['top1']!r}")
        if "n_tokens" in entry:
            v = entry["n_tokens"]
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise FleError(f"{where}.n_tokens must be a whole number > 0, got {v!r}")
        out[str(name)] = dict(entry)
    return {"reference": obj.get("reference"), "texts": out}


def load_quality(path: "str | os.PathLike[str]") -> dict:
    obj, _ = read_json_file(path, "quality")
    return parse_quality(obj, os.fspath(path))


def base_models(metadata: dict) -> list[str]:
    """Hugging Face repository ids of the model this file was made from: the
    conversion's source repository if it is on Hugging Face, else the
    ``general.base_model.N.repo_url`` entries that are."""
    def repo(url: Any) -> str | None:
        m = _HF_URL.match(url) if isinstance(url, str) else None
        return m.group(1) if m else None

    src = repo(metadata.get("general.source.repo_url"))
    if src:
        return [src]
    out = []
    n = metadata.get("general.base_model.count", 0)
    for i in range(n if isinstance(n, int) else 0):
        r = repo(metadata.get(f"general.base_model.{i}.repo_url"))
        if r and r not in out:
            out.append(r)
    return out


# ---------------------------------------------------------------------------
# rendering


def _y(s: str) -> str:
    """A YAML scalar: JSON's double-quoted strings are valid YAML."""
    return json.dumps(str(s))


def _cell(v: Any) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def _table(head: list[str], rows: list[list[Any]], right: "set[int] | frozenset[int]" = frozenset()) -> list[str]:
    out = ["| " + " | ".join(head) + " |",
           "|" + "|".join("---:" if i in right else "---" for i in range(len(head))) + "|"]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def make_card(model: GGUFModel, name: str, quality: dict | None = None,
              summary: ModelSummary | None = None) -> str:
    """The model card of ``model`` as Markdown with YAML front matter."""
    md = model.metadata
    s = summary if summary is not None else summarize(model)
    prov = {k[len(PROVENANCE_PREFIX):]: v for k, v in md.items() if k.startswith(PROVENANCE_PREFIX)}
    arch = s.arch or "unknown"
    bases = base_models(md)
    license_ = md.get("general.license")
    has_license = isinstance(license_, str) and bool(license_.strip())

    fm = ["---"]
    if len(bases) == 1:
        fm.append(f"base_model: {_y(bases[0])}")
    elif bases:
        fm.append("base_model:")
        fm += [f"- {_y(b)}" for b in bases]
    if bases:
        fm.append(f"base_model_relation: {_y('quantized')}")
    fm.append(f"license: {_y(license_.strip() if has_license else 'other')}")
    if has_license and license_.strip() == "other":
        for key, field in (("general.license.name", "license_name"), ("general.license.link", "license_link")):
            if isinstance(md.get(key), str):
                fm.append(f"{field}: {_y(md[key])}")
    fm.append("tags:")
    fm += [f"- {_y(t)}" for t in ("gguf", "moe", "fle", arch)]
    fm.append("---")

    out = fm + ["", f"# {name}", ""]
    title = md.get("general.name")
    what = f"`{title}`" if isinstance(title, str) and title else "this model"
    if prov:
        out.append(f"A GGUF quantization of {what} ({arch}) whose MoE expert layers come from different "
                   "quantizations of the same model, chosen per layer and spliced by FLE "
                   "(`fle-select`, `fle-splice`). Everything but the routed experts (embeddings, attention, "
                   "routers, shared experts, metadata) is the base file's.")
    else:
        out.append(f"A GGUF quantization of {what} ({arch}).")
    out.append("")
    if not bases:
        out.append("Base model: the file names none (no Hugging Face `general.source.repo_url` or "
                   "`general.base_model.N.repo_url`).")
        out.append("")
    if not has_license:
        out.append("License: the file carries no `general.license`, so the front matter says `other`; "
                   "the base model's license applies, check it before use.")
        out.append("")

    out += ["## Files", ""]
    rows = [[f"`{Path(p).name}`", f"{Path(p).stat().st_size:,}"] for p in s.paths]
    out += _table(["file", "bytes"], rows, right={1})
    out += [""]
    first = Path(s.paths[0]).name
    if len(s.paths) > 1:
        out.append(f"Load it with llama.cpp by its first shard (the others are found next to it): "
                   f"`llama-cli -m {first}`.")
    else:
        out.append(f"Load it with llama.cpp: `llama-cli -m {first}`.")
    out += ["", "## Size", ""]
    out += _table(["quantity", "value"], [
        ["file size", f"{s.file_size:,} bytes ({_gb(s.file_size)})"],
        ["weights", f"{s.n_params:,}"],
        ["bits per weight", f"{s.bits_per_weight:.3f}"],
        ["routed experts", f"{s.expert_bytes:,} bytes ({_gb(s.expert_bytes)})"],
        ["everything else", f"{s.tensor_bytes - s.expert_bytes:,} bytes ({_gb(s.tensor_bytes - s.expert_bytes)})"],
        ["tensors", f"{s.n_tensors:,}"],
    ], right={1})
    out.append("")

    if prov:
        out += ["## Provenance", ""]
        rows = []
        if "base" in prov:
            rows.append([prov["base"], "base", f"`{prov.get('base_file', '?')}`", prov.get("base_shards", "?"),
                         f"`{prov.get('base_sha256', '?')}`"])
        donors = prov.get("donors") or []
        files = prov.get("donor_files") or []
        shards = prov.get("donor_shards") or []
        shas = prov.get("donor_sha256") or []
        for i, d in enumerate(donors):
            pick = lambda a: a[i] if i < len(a) else "?"  # noqa: E731
            rows.append([d, "donor", f"`{pick(files)}`", pick(shards), f"`{pick(shas)}`"])
        out += _table(["source", "role", "file", "shards", "SHA-256"], rows, right={3})
        out.append("")
        if "selection_sha256" in prov:
            out.append(f"Selection: `{prov.get('selection_file', '?')}`, SHA-256 `{prov['selection_sha256']}`.")
        tool = prov.get("tool", "fle")
        out.append(f"Made with `{tool}` (FLE {prov.get('fle_version', '?')}). SHA-256 of a split file is "
                   "the SHA-256 of its shards' 32-byte SHA-256 digests concatenated in order.")
        out.append("")

    out += ["## Expert layers", ""]
    sources = prov.get("layer_sources") or []
    rows = []
    for layer in s.layers:
        if not layer.expert_bytes:
            continue
        t = layer.expert_types
        gate = t.get("ffn_gate_exps", t.get("ffn_gate_up_exps", "-"))
        up = t.get("ffn_up_exps", "(fused)" if "ffn_gate_up_exps" in t else "-")
        src = sources[layer.index] if layer.index < len(sources) and sources[layer.index] else "-"
        rows.append([layer.index, src, gate, up, t.get("ffn_down_exps", "-"), f"{layer.expert_bytes:,}"])
    out += _table(["layer", "source", "gate", "up", "down", "bytes"], rows, right={0, 5})
    out.append("")

    if quality:
        out += ["## Quality", ""]
        if quality.get("reference"):
            out.append(f"KL divergence of the next-token distributions against {quality['reference']}.")
            out.append("")
        rows = []
        for text, q in quality["texts"].items():
            kld = f"{q['mean_kld']:.6f}" + (f" ± {q['kld_se']:.6f}" if "kld_se" in q else "")
            top1 = f"{100 * q['top1']:.2f} %" if "top1" in q else "-"
            rows.append([text, kld, top1, f"{q['n_tokens']:,}" if "n_tokens" in q else "-"])
        out += _table(["text", "mean KLD", "top-1 agreement", "tokens"], rows, right={1, 2, 3})
        out.append("")
    return "\n".join(out)


def write_card(text: str, out: "str | os.PathLike[str]", *, force: bool = False) -> Path:
    """Write ``text`` to ``out`` atomically (a temporary file, then a rename)."""
    out = Path(out)
    if out.exists() and not force:
        raise FleError(f"{out}: output exists; choose another name or pass --force to overwrite")
    if out.is_dir():
        raise FleError(f"{out}: is a directory; give the card's file name, e.g. {out}/NAME.md")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FleError(f"{out}: cannot create directory {out.parent} ({e.strerror})") from None
    write_text_atomic(out, text if text.endswith("\n") else text + "\n", force)
    return out
