"""Release recipes: how a released FLE model is rebuilt from public files.

A recipe (``selections/NAME.recipe.json``, format ``fle.recipe/1``) names the
public files a release starts from (one base, several donors), the steps that
turn them into the release, in the fixed order select -> splice -> prune ->
requant, and what the result should look like. It is a plan and a record, not
a script: it knows nothing about GGUF files, runs nothing and downloads
nothing. ``fle-recipe show`` turns it into a list of downloads and commands.

Recipes document a report, so they must never claim more than it states.
Every value the report (or a public file listing) does not give is the string
``"unknown"``; every known value has a source, given in the ``sources`` map by
its field path or by the path of an enclosing object (``"donors.IQ3_S"``
covers all fields of that donor). A source for an unknown value, or a known
value without one, is an error.

Schema (``?`` marks a value that may be ``"unknown"``)::

    {
      "format": "fle.recipe/1",
      "name": "FLE-IQ3_M",                    # release name, [A-Za-z0-9._-]
      "description": "one paragraph",         # free text, needs no source
      "model": "Qwen3.8-Flash-Next",          # ? the model the files hold
      "license": "Qwen Community License 1.0", # optional; ? the release's license, as its source names it
      "release": {"repo": "owner/name",       # ? Hugging Face repository of the release
                  "file_pattern": "*.gguf"},  # ? its file name(s), a glob
      "base": FILE,                           # where every tensor not spliced comes from
      "donors": {"NAME": FILE, ...},          # candidates for whole expert layers
      "steps": [STEP, ...],                   # at least one, see below
      "expected": EXPECTED,
      "notes": [{"text": "...", "source": "report §3"}, ...],
      "sources": {"field.path": "where the value comes from", ...}
    }

    FILE = {"name": "UD-IQ4_XS",              # short name used in steps and per-layer lists
            "repo": "owner/name",             # ? Hugging Face repository
            "folder": "UD-IQ4_XS",            # ? folder in the repository ("" = top level)
            "file_pattern": "X-*-of-*.gguf",  # ? shard file names, a glob ending in .gguf
            "revision": "eb2a07ecb33b",       # ? git revision (7-40 hex digits)
            "size": "93.68 GB"}               # ? all shards together (fle_quant.units sizes)

    select  = {"kind": "select", "mode": "target" | "max_error",
               "target": SIZE?,               # mode "target" only
               "max_error": NUMBER?,          # mode "max_error" only: summed predicted error
               "step": SIZE?,                 # knapsack granularity
               "candidates": ["IQ3_S", ...],  # donor names offered to the knapsack
               "sensitivity": {"tokens": INT?, "text": STR?, "reference": STR?}}
    splice  = {"kind": "splice", "tensors": REGEX?}     # which tensors make up an expert layer
    prune   = {"kind": "prune", "method": "REAP" | "MAN" | "EAN" | "frequency",
               "experts": INT?,               # routed experts per layer before pruning
               "keep": INT,                   # experts kept per layer (> 0, < experts)
               "calibration": {"sequences": INT?, "sequence_length": INT?,
                               "description": STR?}}
    requant = {"kind": "requant", "input": FILE,
               "tensors": REGEX,              # re.search on tensor names
               "from_type": TYPE?, "to_type": TYPE, "imatrix": STR?,
               "draft_vocab": STR?, "output": STR?,
               "tensors_total": INT?, "tensors_changed": INT?}

    EXPECTED = {"file_size": SIZE?, "resident_size": SIZE?,
                "parameters_billions": NUMBER?, "moe_layers": INT?,
                "experts_per_layer": INT?, "donor_layers": INT?,
                "predicted_error": NUMBER?,   # summed over layers
                "kld": {"TEXT": NUMBER, ...}?,
                "per_layer": {"0": "NAME", ...}?}   # source of every MoE layer

TYPE is a ggml type name (``fle_quant.ggml_types.parse_type``), SIZE a string
such as ``"88.87 GB"`` (``fle_quant.units.parse_size``), REGEX a Python
regular expression. Field paths in messages and in ``sources`` read like
``steps[2].keep`` or ``donors.IQ3_S.revision``.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Union

from .errors import FleError
from .ggml_types import BLOCK_GEOMETRY, parse_type
from .units import parse_size

FORMAT = "fle.recipe/1"
UNKNOWN = "unknown"
STEP_ORDER = ("select", "splice", "prune", "requant")
PRUNE_METHODS = ("REAP", "MAN", "EAN", "frequency")

Unknown = str  # the literal "unknown"
MaybeInt = Union[int, Unknown]
MaybeNum = Union[float, int, Unknown]
MaybeStr = str


def is_known(value: Any) -> bool:
    return not (isinstance(value, str) and value == UNKNOWN)


# ---------------------------------------------------------------------------
# The parsed recipe: plain data, validated once by load_recipe / parse_recipe.

@dataclass(frozen=True)
class FileSource:
    name: str
    repo: MaybeStr
    folder: MaybeStr
    file_pattern: MaybeStr
    revision: MaybeStr
    size: MaybeStr  # as written ("93.68 GB"); size_bytes has the parsed value

    @property
    def size_bytes(self) -> "int | None":
        return parse_size(self.size) if is_known(self.size) else None


@dataclass(frozen=True)
class Release:
    repo: MaybeStr
    file_pattern: MaybeStr


@dataclass(frozen=True)
class Sensitivity:
    tokens: MaybeInt
    text: MaybeStr
    reference: MaybeStr


@dataclass(frozen=True)
class SelectStep:
    mode: str                 # "target" or "max_error"
    target: "MaybeStr | None"   # mode "target" only
    max_error: "MaybeNum | None"  # mode "max_error" only
    step: MaybeStr
    candidates: tuple[str, ...]
    sensitivity: Sensitivity
    kind: str = "select"


@dataclass(frozen=True)
class SpliceStep:
    tensors: MaybeStr
    kind: str = "splice"


@dataclass(frozen=True)
class Calibration:
    sequences: MaybeInt
    sequence_length: MaybeInt
    description: MaybeStr


@dataclass(frozen=True)
class PruneStep:
    method: str
    experts: MaybeInt
    keep: int
    calibration: Calibration
    kind: str = "prune"


@dataclass(frozen=True)
class RequantStep:
    input: FileSource
    tensors: str
    from_type: MaybeStr
    to_type: str
    imatrix: MaybeStr
    draft_vocab: MaybeStr
    output: MaybeStr
    tensors_total: MaybeInt
    tensors_changed: MaybeInt
    kind: str = "requant"


Step = Union[SelectStep, SpliceStep, PruneStep, RequantStep]


@dataclass(frozen=True)
class Expected:
    file_size: MaybeStr
    resident_size: MaybeStr
    parameters_billions: MaybeNum
    moe_layers: MaybeInt
    experts_per_layer: MaybeInt
    donor_layers: MaybeInt
    predicted_error: MaybeNum
    kld: "dict[str, float] | Unknown"
    per_layer: "dict[int, str] | Unknown"


@dataclass(frozen=True)
class Note:
    text: str
    source: str


@dataclass(frozen=True)
class Recipe:
    path: str
    name: str
    description: str
    model: MaybeStr
    release: Release
    base: FileSource
    donors: dict[str, FileSource]
    steps: tuple[Step, ...]
    expected: Expected
    notes: tuple[Note, ...]
    sources: dict[str, str]
    unknown_paths: tuple[str, ...] = field(default=())  # every field whose value is "unknown"
    license: MaybeStr = UNKNOWN  # optional in the file; absent reads as "unknown"

    def step(self, kind: str) -> "Step | None":
        return next((s for s in self.steps if s.kind == kind), None)

    def source_of(self, path: str) -> "str | None":
        """The source of the value at ``path``: its own entry or its nearest enclosing one."""
        for p in _ancestors(path):
            if p in self.sources:
                return self.sources[p]
        return None


# ---------------------------------------------------------------------------
# Validation: each field has a checker; objects list their keys.

class _Ctx:
    def __init__(self, file: str):
        self.file = file
        self.unknown: list[str] = []
        self.known_leaves: list[str] = []

    def fail(self, path: str, problem: str) -> "FleError":
        where = f"{self.file}: {path}" if path else self.file
        return FleError(f"{where}: {problem}")


Checker = Callable[[_Ctx, str, Any], Any]


def _leaf(check: Checker, may_be_unknown: bool = True, needs_source: bool = True) -> Checker:
    """Wrap a value checker: handles "unknown" and records the leaf for source checks."""
    def run(ctx: _Ctx, path: str, v: Any) -> Any:
        if isinstance(v, str) and v == UNKNOWN:
            if not may_be_unknown:
                raise ctx.fail(path, "must be known; \"unknown\" is not allowed here")
            ctx.unknown.append(path)
            return v
        out = check(ctx, path, v)
        if needs_source:
            ctx.known_leaves.append(path)
        return out
    return run


def _type_name(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _str(ctx: _Ctx, path: str, v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ctx.fail(path, f"must be a non-empty string, got {_type_name(v)}" if not isinstance(v, str)
                       else "must be a non-empty string")
    return v


def _pos_int(ctx: _Ctx, path: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ctx.fail(path, f"must be a positive integer, got {_type_name(v)} {v!r}")
    if v < 1:
        raise ctx.fail(path, f"must be a positive integer, got {v}")
    return v


def _number(ctx: _Ctx, path: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ctx.fail(path, f"must be a finite number, got {_type_name(v)} {v!r}")
    if v < 0:
        raise ctx.fail(path, f"must not be negative, got {v}")
    return v


def _size(ctx: _Ctx, path: str, v: Any) -> str:
    if not isinstance(v, str):
        raise ctx.fail(path, f"must be a size string such as \"88.87 GB\", got {_type_name(v)} {v!r}")
    try:
        parse_size(v, "size")
    except FleError as e:
        raise ctx.fail(path, str(e)) from None
    return v


def _regex(ctx: _Ctx, path: str, v: Any) -> str:
    _str(ctx, path, v)
    try:
        re.compile(v)
    except re.error as e:
        raise ctx.fail(path, f"invalid regular expression {v!r}: {e}") from None
    return v


def _qtype(ctx: _Ctx, path: str, v: Any) -> str:
    if not isinstance(v, str):
        raise ctx.fail(path, f"must be a quant type name such as \"IQ4_NL\", got {_type_name(v)} {v!r}")
    try:
        t = parse_type(v)
    except FleError as e:
        raise ctx.fail(path, str(e)) from None
    if t not in BLOCK_GEOMETRY:
        raise ctx.fail(path, f"{v!r} has no block layout FLE can write")
    return t.name


_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_REV = re.compile(r"^[0-9a-f]{7,40}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


def _repo(ctx: _Ctx, path: str, v: Any) -> str:
    if not isinstance(v, str) or not _REPO.match(v):
        raise ctx.fail(path, f"must be a Hugging Face repository \"owner/name\", got {v!r}")
    return v


def _revision(ctx: _Ctx, path: str, v: Any) -> str:
    if not isinstance(v, str) or not _REV.match(v):
        raise ctx.fail(path, f"must be a git revision of 7 to 40 lower-case hex digits, got {v!r}")
    return v


def _folder(ctx: _Ctx, path: str, v: Any) -> str:
    if not isinstance(v, str):
        raise ctx.fail(path, f"must be a folder name (\"\" for the top level), got {_type_name(v)}")
    if v.startswith("/") or ".." in v.split("/") or "\\" in v:
        raise ctx.fail(path, f"must be a relative folder inside the repository, got {v!r}")
    return v.strip("/")


def _gguf_pattern(ctx: _Ctx, path: str, v: Any) -> str:
    _str(ctx, path, v)
    if "/" in v or not v.endswith(".gguf"):
        raise ctx.fail(path, f"must be a file name glob ending in .gguf without folders, got {v!r}")
    return v


def _name(ctx: _Ctx, path: str, v: Any) -> str:
    if not isinstance(v, str) or not _NAME.match(v):
        raise ctx.fail(path, f"must be a name of letters, digits and . _ + -, got {v!r}")
    return v


def _obj(ctx: _Ctx, path: str, v: Any, spec: dict[str, Checker], optional: tuple[str, ...] = ()) -> dict:
    """Check an object against ``spec``: no unknown keys, no missing keys."""
    if not isinstance(v, dict):
        raise ctx.fail(path, f"must be an object, got {_type_name(v)}")
    extra = sorted(set(v) - set(spec))
    if extra:
        raise ctx.fail(_join(path, extra[0]), f"unknown key; allowed here: {', '.join(spec)}")
    missing = [k for k in spec if k not in v and k not in optional]
    if missing:
        raise ctx.fail(_join(path, missing[0]), "missing; every field must be given (write \"unknown\" "
                                                "where the value is not known)")
    return {k: spec[k](ctx, _join(path, k), v[k]) for k in spec if k in v}


def _join(path: str, key: "str | int") -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _file_source(ctx: _Ctx, path: str, v: Any) -> FileSource:
    d = _obj(ctx, path, v, {
        "name": _leaf(_name, may_be_unknown=False, needs_source=False),
        "repo": _leaf(_repo),
        "folder": _leaf(_folder),
        "file_pattern": _leaf(_gguf_pattern),
        "revision": _leaf(_revision),
        "size": _leaf(_size),
    })
    return FileSource(**d)


def _str_list(ctx: _Ctx, path: str, v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not v:
        raise ctx.fail(path, "must be a non-empty list of names")
    out = tuple(_name(ctx, _join(path, i), x) for i, x in enumerate(v))
    if len(set(out)) != len(out):
        raise ctx.fail(path, "lists a name twice")
    return out


def _kld(ctx: _Ctx, path: str, v: Any) -> dict[str, float]:
    if not isinstance(v, dict) or not v:
        raise ctx.fail(path, "must be an object TEXT -> KL divergence, or \"unknown\"")
    return {k: _number(ctx, _join(path, k), x) for k, x in v.items()}


def _per_layer(ctx: _Ctx, path: str, v: Any) -> dict[int, str]:
    if not isinstance(v, dict) or not v:
        raise ctx.fail(path, "must be an object LAYER -> source name, or \"unknown\"")
    out = {}
    for k, x in v.items():
        if not (isinstance(k, str) and k.isdigit() and str(int(k)) == k):
            raise ctx.fail(_join(path, k), "layer keys must be decimal layer indices such as \"0\"")
        out[int(k)] = _name(ctx, _join(path, k), x)
    return out


def _choice(options: tuple[str, ...]) -> Checker:
    def check(ctx: _Ctx, path: str, v: Any) -> str:
        if v not in options:
            raise ctx.fail(path, f"must be one of {', '.join(options)}; got {v!r}")
        return v
    return check


_STEP_SPECS: dict[str, dict[str, Checker]] = {
    "select": {
        "kind": _leaf(_str, needs_source=False),
        "mode": _leaf(_choice(("target", "max_error")), may_be_unknown=False),
        "target": _leaf(_size),
        "max_error": _leaf(_number),
        "step": _leaf(_size),
        "candidates": _leaf(_str_list, may_be_unknown=False),
        "sensitivity": lambda ctx, p, v: Sensitivity(**_obj(ctx, p, v, {
            "tokens": _leaf(_pos_int), "text": _leaf(_str), "reference": _leaf(_str)})),
    },
    "splice": {
        "kind": _leaf(_str, needs_source=False),
        "tensors": _leaf(_regex),
    },
    "prune": {
        "kind": _leaf(_str, needs_source=False),
        "method": _leaf(_choice(PRUNE_METHODS), may_be_unknown=False),
        "experts": _leaf(_pos_int),
        "keep": _leaf(_pos_int, may_be_unknown=False),
        "calibration": lambda ctx, p, v: Calibration(**_obj(ctx, p, v, {
            "sequences": _leaf(_pos_int), "sequence_length": _leaf(_pos_int),
            "description": _leaf(_str)})),
    },
    "requant": {
        "kind": _leaf(_str, needs_source=False),
        "input": _file_source,
        "tensors": _leaf(_regex, may_be_unknown=False),
        "from_type": _leaf(_qtype),
        "to_type": _leaf(_qtype, may_be_unknown=False),
        "imatrix": _leaf(_str),
        "draft_vocab": _leaf(_str),
        "output": _leaf(_gguf_pattern),
        "tensors_total": _leaf(_pos_int),
        "tensors_changed": _leaf(_pos_int),
    },
}
_STEP_CLASSES = {"select": SelectStep, "splice": SpliceStep, "prune": PruneStep, "requant": RequantStep}


def _step(ctx: _Ctx, path: str, v: Any) -> Step:
    if not isinstance(v, dict):
        raise ctx.fail(path, f"must be an object, got {_type_name(v)}")
    if "kind" not in v:
        raise ctx.fail(_join(path, "kind"), f"missing; one of {', '.join(STEP_ORDER)}")
    kind = v["kind"]
    if kind not in _STEP_SPECS:
        raise ctx.fail(_join(path, "kind"), f"must be one of {', '.join(STEP_ORDER)}; got {kind!r}")
    spec = _STEP_SPECS[kind]
    optional: tuple[str, ...] = ()
    if kind == "select":
        mode = v.get("mode")
        if mode not in ("target", "max_error"):
            raise ctx.fail(_join(path, "mode"), f"must be target or max_error; got {mode!r}")
        if mode == "target":
            if "max_error" in v:
                raise ctx.fail(_join(path, "max_error"), "not allowed with mode \"target\"")
            optional = ("max_error",)
        elif mode == "max_error":
            if "target" in v:
                raise ctx.fail(_join(path, "target"), "not allowed with mode \"max_error\"")
            optional = ("target",)
    d = _obj(ctx, path, v, spec, optional)
    if kind == "select":
        d.setdefault("target", None)
        d.setdefault("max_error", None)
    return _STEP_CLASSES[kind](**d)


def _steps(ctx: _Ctx, path: str, v: Any) -> tuple[Step, ...]:
    if not isinstance(v, list) or not v:
        raise ctx.fail(path, "must be a non-empty list of steps")
    steps = tuple(_step(ctx, _join(path, i), s) for i, s in enumerate(v))
    last = -1
    for i, s in enumerate(steps):
        rank = STEP_ORDER.index(s.kind)
        if rank <= last:
            raise ctx.fail(_join(path, i), f"step {s.kind!r} is out of order; steps run in the order "
                                           f"{' -> '.join(STEP_ORDER)}, each at most once")
        last = rank
    kinds = [s.kind for s in steps]
    if "select" in kinds and "splice" not in kinds:
        raise ctx.fail(_join(path, kinds.index("select")), "a select step needs a splice step after it "
                                                         "to use its selection")
    if "splice" in kinds and "select" not in kinds:
        raise ctx.fail(_join(path, kinds.index("splice")), "a splice step needs a select step before it "
                                                         "to say which layers come from which file")
    return steps


def _expected(ctx: _Ctx, path: str, v: Any) -> Expected:
    return Expected(**_obj(ctx, path, v, {
        "file_size": _leaf(_size),
        "resident_size": _leaf(_size),
        "parameters_billions": _leaf(_number),
        "moe_layers": _leaf(_pos_int),
        "experts_per_layer": _leaf(_pos_int),
        "donor_layers": _leaf(_number_int_nonneg),
        "predicted_error": _leaf(_number),
        "kld": _leaf(_kld),
        "per_layer": _leaf(_per_layer),
    }))


def _number_int_nonneg(ctx: _Ctx, path: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ctx.fail(path, f"must be a non-negative integer, got {v!r}")
    return v


def _notes(ctx: _Ctx, path: str, v: Any) -> tuple[Note, ...]:
    if not isinstance(v, list):
        raise ctx.fail(path, f"must be a list of {{\"text\", \"source\"}} objects, got {_type_name(v)}")
    return tuple(Note(**_obj(ctx, _join(path, i), n, {"text": _str, "source": _str}))
                 for i, n in enumerate(v))


def _donors(ctx: _Ctx, path: str, v: Any) -> dict[str, FileSource]:
    if not isinstance(v, dict):
        raise ctx.fail(path, f"must be an object NAME -> file, got {_type_name(v)}")
    out = {}
    for k, x in v.items():
        _name(ctx, _join(path, k), k)
        src = _file_source(ctx, _join(path, k), x)
        if src.name != k:
            raise ctx.fail(_join(_join(path, k), "name"), f"must equal the donor's key {k!r}")
        out[k] = src
    return out


def _sources(ctx: _Ctx, path: str, v: Any) -> dict[str, str]:
    if not isinstance(v, dict):
        raise ctx.fail(path, f"must be an object FIELD.PATH -> source, got {_type_name(v)}")
    return {k: _str(ctx, _join(path, k), x) for k, x in v.items()}


_TOP: dict[str, Checker] = {
    "format": lambda ctx, p, v: v,  # checked before anything else
    "name": _leaf(_name, may_be_unknown=False, needs_source=False),
    "description": _leaf(_str, needs_source=False),
    "model": _leaf(_str),
    "license": _leaf(_str),
    "release": lambda ctx, p, v: Release(**_obj(ctx, p, v, {"repo": _leaf(_repo),
                                                            "file_pattern": _leaf(_gguf_pattern)})),
    "base": _file_source,
    "donors": _donors,
    "steps": _steps,
    "expected": _expected,
    "notes": _notes,
    "sources": _sources,
}


def _ancestors(path: str) -> list[str]:
    """``a.b[2].c`` -> [``a.b[2].c``, ``a.b[2]``, ``a.b``, ``a``]."""
    out = [path]
    while True:
        cut = max(path.rfind("."), path.rfind("["))
        if cut <= 0:
            return out
        path = path[:cut]
        out.append(path)


def _cross_checks(ctx: _Ctx, r: dict) -> None:
    base: FileSource = r["base"]
    donors: dict[str, FileSource] = r["donors"]
    steps: tuple[Step, ...] = r["steps"]
    exp: Expected = r["expected"]
    if base.name in donors:
        raise ctx.fail(f"donors.{base.name}", "has the base's name; give the base and each donor "
                                              "distinct names")
    used: set[str] = set()
    for i, s in enumerate(steps):
        if isinstance(s, SelectStep):
            for j, c in enumerate(s.candidates):
                if c not in donors:
                    raise ctx.fail(f"steps[{i}].candidates[{j}]", f"{c!r} is not a donor; donors: "
                                                                  f"{', '.join(donors) or 'none'}")
            used.update(s.candidates)
        if isinstance(s, PruneStep):
            if is_known(s.experts) and s.keep >= s.experts:
                raise ctx.fail(f"steps[{i}].keep", f"keeps {s.keep} of {s.experts} experts; it must "
                                                   "keep fewer than there are")
            if is_known(exp.experts_per_layer) and exp.experts_per_layer != s.keep:
                raise ctx.fail("expected.experts_per_layer", f"is {exp.experts_per_layer} but "
                                                             f"steps[{i}].keep is {s.keep}")
    for name in donors:
        if name not in used:
            raise ctx.fail(f"donors.{name}", "is not a candidate of any select step; remove it or "
                                             "list it under candidates")
    if is_known(exp.donor_layers) and is_known(exp.moe_layers) and exp.donor_layers > exp.moe_layers:
        raise ctx.fail("expected.donor_layers", f"{exp.donor_layers} donor layers but only "
                                                f"{exp.moe_layers} MoE layers")
    if is_known(exp.per_layer):
        allowed = {base.name, *donors}
        for layer, src in exp.per_layer.items():
            if src not in allowed:
                raise ctx.fail(f"expected.per_layer.{layer}", f"{src!r} is neither the base nor a donor")
        if is_known(exp.moe_layers) and sorted(exp.per_layer) != list(range(exp.moe_layers)):
            raise ctx.fail("expected.per_layer", f"must list every MoE layer 0..{exp.moe_layers - 1} once")
        n_donor = sum(1 for s in exp.per_layer.values() if s != base.name)
        if is_known(exp.donor_layers) and n_donor != exp.donor_layers:
            raise ctx.fail("expected.per_layer", f"takes {n_donor} layers from donors but "
                                                 f"expected.donor_layers is {exp.donor_layers}")


def _check_sources(ctx: _Ctx, sources: dict[str, str], raw: dict) -> None:
    for key in sources:
        node = _resolve(raw, key)
        if node is _MISSING:
            raise ctx.fail(f"sources.{key}", "names no field of this recipe")
        if not any(p == key or p.startswith(key + ".") or p.startswith(key + "[")
                   for p in ctx.known_leaves):
            raise ctx.fail(f"sources.{key}", "gives a source for a value that is \"unknown\" "
                                             "(or needs none); remove it")
    for leaf in ctx.known_leaves:
        if not any(p in sources for p in _ancestors(leaf)):
            raise ctx.fail(leaf, "has no source; add it (or an enclosing field) to \"sources\", "
                                 "or write \"unknown\"")


_MISSING = object()
_PATH_TOKEN = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _resolve(raw: Any, path: str) -> Any:
    node = raw
    pos = 0
    for m in _PATH_TOKEN.finditer(path):
        if m.start() not in (pos, pos + 1):
            return _MISSING
        pos = m.end()
        if m.group(1) is not None:
            if not isinstance(node, dict) or m.group(1) not in node:
                return _MISSING
            node = node[m.group(1)]
        else:
            i = int(m.group(2))
            if not isinstance(node, list) or i >= len(node):
                return _MISSING
            node = node[i]
    return node if pos == len(path) and path else _MISSING


def parse_recipe(obj: Any, path: str = "<recipe>") -> Recipe:
    """Validate a decoded JSON recipe; FleError naming ``path`` and the field on any problem."""
    ctx = _Ctx(path)
    if not isinstance(obj, dict):
        raise ctx.fail("", f"must hold one JSON object, got {_type_name(obj)}")
    if obj.get("format") != FORMAT:
        raise ctx.fail("format", f"must be {FORMAT!r}, got {obj.get('format')!r}")
    d = _obj(ctx, "", obj, _TOP, optional=("license",))
    _cross_checks(ctx, d)
    _check_sources(ctx, d["sources"], obj)
    del d["format"]
    return Recipe(path=path, unknown_paths=tuple(ctx.unknown), **d)


def load_recipe(path: str) -> Recipe:
    """Read and validate ``path`` (format ``fle.recipe/1``)."""
    from .textio import parse_json, read_bytes_file

    raw = read_bytes_file(path, "recipe file", max_bytes=16 << 20)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FleError(f"{path}: not UTF-8 text; a recipe is a JSON file") from None
    try:
        json.loads(raw)  # the recipe's own wording for a syntax error
    except json.JSONDecodeError as e:
        raise FleError(f"{path}: line {e.lineno} column {e.colno}: not valid JSON: {e.msg}") from None
    except (ValueError, RecursionError):
        pass  # limits: parse_json says which
    return parse_recipe(parse_json(raw, path, "recipe"), path)
