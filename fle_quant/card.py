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

__all__ = ["QUALITY_FORMAT", "load_quality", "parse_quality", "base_models", "make_card", "make_recipe_card",
           "write_card"]

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


# ---------------------------------------------------------------------------
# cards from a recipe (no built file): what the release is and how it is made,
# every figure as the recipe's source reports it


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")


def make_recipe_card(recipe, recipe_path: str) -> str:
    """The model card of the release ``recipe`` (a :class:`fle_quant.recipe.Recipe`)
    describes, before or without building it. Every figure comes from the
    recipe and is printed with the source the recipe names for it; values the
    recipe marks unknown are listed as such. ``recipe_path`` is how the card
    names the recipe in its reproduction commands (a path relative to the
    repository, so that the card does not depend on where it was made)."""
    from .recipe import PruneStep, RequantStep, SelectStep, SpliceStep, is_known

    r = recipe
    U = "unknown"

    def v(x: Any) -> str:
        return str(x) if is_known(x) else U

    def src(path: str) -> str:
        s = r.source_of(path)
        return s if s else "-"

    def row(label: str, value: Any, path: str) -> list[str]:
        return [label, v(value), src(path) if is_known(value) else "not stated"]

    files = [("base", r.base, "base")] + [("donor", d, f"donors.{n}") for n, d in r.donors.items()]
    files += [("requant input", s.input, f"steps[{i}].input") for i, s in enumerate(r.steps)
              if isinstance(s, RequantStep)]
    repos: list[str] = []
    for _, f, _ in files:
        if is_known(f.repo) and f.repo not in repos:
            repos.append(f.repo)

    fm = ["---"]
    if repos:
        fm.append("base_model:")
        fm += [f"- {_y(b)}" for b in repos]
    if is_known(r.license):
        fm.append(f"license: {_y('other')}")
        fm.append(f"license_name: {_y(_slug(r.license))}")
    else:
        fm.append(f"license: {_y('other')}")
    if is_known(r.release.repo):
        fm.append(f"quantized_by: {_y(r.release.repo.split('/')[0])}")
    tags = ["gguf", "moe", "fle"] + (["pruned"] if r.step("prune") else [])
    if is_known(r.model):
        tags.append(_slug(r.model))
    fm.append("tags:")
    fm += [f"- {_y(t)}" for t in tags]
    fm.append("---")

    out = fm + ["", f"# {r.name}", ""]
    out += [f"{r.description} [summary from the recipe; each figure is listed below with its source]", ""]
    out += ["This card is generated by `fle-card --recipe` from "
            f"`{recipe_path}`. Every figure in it is as reported by the source named next to it "
            "(a section of the measurement report or a public file listing); none was re-measured "
            "for this card. A card made for a built file (`fle-card FILE`) takes its numbers from "
            "the file itself.", ""]
    out += _table(["", "value", "source"], [
        row("model", r.model, "model"),
        row("release repository", r.release.repo, "release.repo"),
        row("release files", r.release.file_pattern, "release.file_pattern"),
        row("license", r.license, "license"),
    ])
    out.append("")
    if not is_known(r.license):
        out += ["License: the recipe states none, so the front matter says `other`; "
                "the base model's license applies, check it before use.", ""]

    out += ["## Source files", ""]
    rows = []
    for role, f, path in files:
        rows.append([role, f.name, f"`{v(f.repo)}`", f"`{v(f.folder)}`", f"`{v(f.file_pattern)}`",
                     f"`{v(f.revision)}`", v(f.size),
                     "; ".join(dict.fromkeys(src(f"{path}.{k}") for k in
                                             ("repo", "folder", "file_pattern", "revision", "size")
                                             if is_known(getattr(f, k)))) or "-"])
    out += _table(["role", "name", "repository", "folder", "files", "revision", "size", "source"], rows)
    out.append("")
    unpinned = [f.name for _, f, _ in files if not is_known(f.revision)]
    if unpinned:
        out += [f"Revision unknown for {', '.join(unpinned)}: `fle-build` downloads only pinned revisions "
                "and stops until it is filled in; a download of the current main branch may differ from "
                "the files the release was built from.", ""]

    out += ["## How it was made", ""]
    for i, s in enumerate(r.steps):
        p = f"steps[{i}]"
        if isinstance(s, SelectStep):
            goal = (row("target size", s.target, f"{p}.target") if s.mode == "target"
                    else row("bound on the summed predicted error", s.max_error, f"{p}.max_error"))
            out += [f"{i + 1}. **select** (`fle-sensitivity`, `fle-select`): per MoE layer, the base or one "
                    f"of {', '.join(s.candidates)}, chosen "
                    + ("as the least predicted error within a target size." if s.mode == "target"
                       else "as the smallest file under a bound on the summed predicted error."), ""]
            out += _table(["parameter", "value", "source"], [
                row("mode", s.mode, f"{p}.mode"), goal, row("knapsack step", s.step, f"{p}.step"),
                row("candidates", ", ".join(s.candidates), f"{p}.candidates"),
                row("sensitivity tokens", s.sensitivity.tokens, f"{p}.sensitivity.tokens"),
                row("sensitivity text", s.sensitivity.text, f"{p}.sensitivity.text"),
                row("sensitivity reference", s.sensitivity.reference, f"{p}.sensitivity.reference")])
        elif isinstance(s, SpliceStep):
            out += [f"{i + 1}. **splice** (`fle-splice`): the chosen layers' expert tensors, whole layers, "
                    "copied from the donors into the base; everything else is the base's.", ""]
            out += _table(["parameter", "value", "source"], [row("tensors", f"`{s.tensors}`"
                                                                 if is_known(s.tensors) else s.tensors,
                                                                 f"{p}.tensors")])
        elif isinstance(s, PruneStep):
            c = s.calibration
            out += [f"{i + 1}. **prune** (`fle-reap score`, `fle-reap prune`): the lowest-ranked experts of "
                    f"every layer removed by {s.method} saliency; kept expert slices and router rows are "
                    "copied.", ""]
            out += _table(["parameter", "value", "source"], [
                row("method", s.method, f"{p}.method"), row("experts per layer before", s.experts, f"{p}.experts"),
                row("experts kept", s.keep, f"{p}.keep"),
                row("calibration sequences", c.sequences, f"{p}.calibration.sequences"),
                row("calibration sequence length", c.sequence_length, f"{p}.calibration.sequence_length"),
                row("calibration text", c.description, f"{p}.calibration.description")])
        elif isinstance(s, RequantStep):
            out += [f"{i + 1}. **requant** (`fle-requant`): tensors of {s.input.name} requantized.", ""]
            out += _table(["parameter", "value", "source"], [
                row("tensors", f"`{s.tensors}`", f"{p}.tensors"), row("from type", s.from_type, f"{p}.from_type"),
                row("to type", s.to_type, f"{p}.to_type"), row("imatrix", s.imatrix, f"{p}.imatrix"),
                row("tensors in the file", s.tensors_total, f"{p}.tensors_total"),
                row("tensors changed", s.tensors_changed, f"{p}.tensors_changed"),
                row("draft vocabulary (run time)", s.draft_vocab, f"{p}.draft_vocab"),
                row("output file", s.output, f"{p}.output")])
        out.append("")

    e = r.expected
    out += ["## Expert layers", ""]
    if is_known(e.per_layer):
        out += _table(["layer", "source"], [[k, n] for k, n in sorted(e.per_layer.items())], right={0})
        out += ["", f"Source of this list: {src('expected.per_layer')}.", ""]
    else:
        out += ["The recipe does not know which file each MoE layer's experts come from "
                "(`expected.per_layer` is unknown: its source does not list them). A build with "
                "`fle-build` chooses its own layers; the card of the built file (`fle-card FILE`) "
                "lists them from the file's provenance.", ""]

    out += ["## Reproduce", "", "```sh",
            f"fle-build {recipe_path} --dry-run   # downloads, steps and disk needed",
            f"fle-build {recipe_path}             # download, build, verify, write the card",
            f"fle-recipe show {recipe_path}       # the same plan as commands", "```", ""]
    extra = []
    if r.step("select"):
        extra.append("`--ref` (a reference file of the model, e.g. BF16) and `--text` (the capture text) "
                     "for the select step")
    if r.step("prune"):
        extra.append("`--calibration` (the calibration text) for the prune step")
    if extra:
        out += ["The recipe names no public file for these; `fle-build` takes " + " and ".join(extra) + ".", ""]
    if r.unknown_paths:
        out += ["The build stops at a field it needs that the recipe marks unknown, naming it; "
                "fill it in, with its source, first.", ""]

    out += ["## Reported figures", "",
            "As reported by the named source, not re-measured here.", ""]
    kld = e.kld if is_known(e.kld) else U
    exp_rows = [row("file size", e.file_size, "expected.file_size"),
                row("resident without the PLE table", e.resident_size, "expected.resident_size"),
                row("parameters (billions)", e.parameters_billions, "expected.parameters_billions"),
                row("MoE layers", e.moe_layers, "expected.moe_layers"),
                row("experts per layer", e.experts_per_layer, "expected.experts_per_layer"),
                row("layers from donors", e.donor_layers, "expected.donor_layers"),
                row("summed predicted error", e.predicted_error, "expected.predicted_error"),
                ["KLD against BF16", ", ".join(f"{k} {x}" for k, x in kld.items()) if is_known(kld) else U,
                 src("expected.kld") if is_known(kld) else "not stated"]]
    out += _table(["quantity", "value", "source"], exp_rows)
    out.append("")
    if r.notes:
        out += ["Notes:", ""]
        out += [f"- {n.text} [{n.source}]" for n in r.notes]
        out.append("")
    if r.unknown_paths:
        out += [f"Unknown in the recipe (its sources do not state them): "
                + ", ".join(f"`{p}`" for p in r.unknown_paths) + ".", ""]
    return "\n".join(out)
