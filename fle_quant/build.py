"""``fle-build``: rebuild a release from its recipe.

A build has two halves:

1. **Downloads.** Every file the recipe names (base, donors, requant inputs)
   is fetched with ``huggingface_hub`` from its repository, only the files of
   its folder matching its shard pattern, at its pinned revision (resolved
   with the Hub's revision API; it must be a commit). Downloads resume where
   an interrupted one stopped (a file's bytes so far are kept in
   ``NAME.part`` next to it and fetched on from there with a ranged request),
   show progress bars, and start only when the disk holding ``--dir`` has
   room for what is still missing. Each file's SHA-256 is checked against
   the Hub's LFS hash; the checked list is kept in ``DIR/models/REPO/
   downloads.json`` so that ``--offline`` builds can check the files again
   without the network.
2. **Steps**, in the recipe's order, each through FLE's own Python API:
   select (``fle_quant.sensitivity.measure`` against ``--ref`` on ``--text``,
   then ``fle_quant.select``), splice (``fle_quant.splice``), prune
   (``fle_quant.scoring.score`` on ``--calibration``, then
   ``fle_quant.prune``) and requant (``fle_quant.requant``); then the card of
   the result (``fle_quant.card.make_card``). Each step works in its own
   folder ``DIR/work/NAME/NN-KIND/`` and records there (``step.json``) the
   SHA-256 of its inputs (``fle_quant.digest``) and its parameters; a step
   whose record matches and whose outputs are present is not run again, so an
   interrupted build resumes at the step it stopped in.

A value the build needs that the recipe marks ``"unknown"`` stops it with
one line naming the field and how to fill it. ``--dry-run`` prints the plan
(downloads with sizes, steps, disk needed and what would stop the build) and
needs no network.
"""
from __future__ import annotations

import fnmatch
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import FleError
from .recipe import FileSource, PruneStep, Recipe, RequantStep, SelectStep, SpliceStep, is_known
from .units import format_size, parse_size

__all__ = ["STEP_FORMAT", "MANIFEST_FORMAT", "Download", "PlannedStep", "BuildPlan", "plan_build",
           "format_plan", "download", "run_build"]

STEP_FORMAT = "fle.build-step/1"
MANIFEST_FORMAT = "fle.downloads/1"


@dataclass
class Download:
    role: str          # base, donor, requant input
    path: str          # recipe field path of the file, e.g. donors.IQ3_S
    src: FileSource
    local_dir: Path    # where the repository's files land (folder structure kept)

    @property
    def include(self) -> str:
        return f"{self.src.folder}/{self.src.file_pattern}" if self.src.folder else self.src.file_pattern


@dataclass
class PlannedStep:
    index: int
    kind: str
    what: str
    folder: Path
    needs: list[str] = field(default_factory=list)  # lines naming what is missing


@dataclass
class BuildPlan:
    recipe: Recipe
    root: Path
    downloads: list[Download]
    steps: list[PlannedStep]
    blockers: list[str]      # one line each: field, why, how to fill it

    @property
    def download_bytes(self) -> "int | None":
        sizes = [d.src.size_bytes for d in self.downloads]
        return None if any(s is None for s in sizes) else sum(sizes)

    def output_bytes(self) -> "int | None":
        """Room for the step outputs: the spliced file, then each pruned or
        requantized copy, at the recipe's expected or its input's size."""
        r = self.recipe
        total = 0
        current = r.base.size_bytes
        for s in r.steps:
            if isinstance(s, SpliceStep):
                current = parse_size(r.expected.file_size) if is_known(r.expected.file_size) else current
                if current is None:
                    return None
                total += current
            elif isinstance(s, PruneStep):
                if current is None:
                    return None
                total += current
            elif isinstance(s, RequantStep):
                if s.input.size_bytes is None:
                    return None
                total += s.input.size_bytes
        return total


def _missing(path: str, how: str) -> str:
    return f"{path} is \"unknown\"; {how}"


def plan_build(recipe: Recipe, root: "str | os.PathLike[str]", *, ref: "str | None" = None,
               text: "str | None" = None, calibration: "str | None" = None) -> BuildPlan:
    """What building ``recipe`` under ``root`` takes; runs and downloads nothing."""
    r = recipe
    root = Path(root)
    models = root / "models"
    work = root / "work" / r.name
    fill = f"fill it in {r.path} with its source, then run fle-recipe validate"
    blockers: list[str] = []
    downloads: list[Download] = []
    srcs = [("base", "base", r.base)] + [("donor", f"donors.{n}", d) for n, d in r.donors.items()]
    srcs += [("requant input", f"steps[{i}].input", s.input) for i, s in enumerate(r.steps)
             if isinstance(s, RequantStep)]
    for role, path, src in srcs:
        for key, how in (("repo", "the Hugging Face repository owner/name"),
                         ("folder", "the folder in the repository (\"\" for the top level)"),
                         ("file_pattern", "the shard file names, a glob ending in .gguf"),
                         ("revision", "the commit the release was built from (7-40 hex digits)")):
            if not is_known(getattr(src, key)):
                blockers.append(_missing(f"{path}.{key}", f"give {how}; {fill}"))
        repo = src.repo if is_known(src.repo) else "UNKNOWN"
        downloads.append(Download(role, path, src, models / repo.replace("/", "__")))

    steps: list[PlannedStep] = []
    for i, s in enumerate(r.steps):
        folder = work / f"{i + 1:02d}-{s.kind}"
        p = f"steps[{i}]"
        if isinstance(s, SelectStep):
            ps = PlannedStep(i, "select", f"sensitivity of {', '.join(s.candidates)} against the reference "
                             f"on {s.sensitivity.tokens} tokens, then select "
                             + (f"within {s.target}" if s.mode == "target" else f"under error {s.max_error}"),
                             folder)
            goal = "target" if s.mode == "target" else "max_error"
            if not is_known(getattr(s, goal)):
                ps.needs.append(_missing(f"{p}.{goal}", "give the " + ("target size, e.g. \"88.87 GB\""
                                                                       if goal == "target" else
                                                                       "bound on the summed predicted error")
                                         + f"; {fill}"))
            if not is_known(s.step):
                ps.needs.append(_missing(f"{p}.step", f"give the knapsack step, e.g. \"16 MB\"; {fill}"))
            if not is_known(s.sensitivity.tokens):
                ps.needs.append(_missing(f"{p}.sensitivity.tokens", f"give the token count; {fill}"))
            if ref is None:
                ps.needs.append(f"{p}.sensitivity.reference: the recipe names no public reference file "
                                f"({s.sensitivity.reference}); give one with --ref FILE")
            if text is None:
                ps.needs.append(f"{p}.sensitivity.text: the recipe names no public text "
                                f"({s.sensitivity.text}); give one with --text FILE")
        elif isinstance(s, SpliceStep):
            ps = PlannedStep(i, "splice", "copy the selected expert layers from the donors into the base",
                             folder)
        elif isinstance(s, PruneStep):
            ps = PlannedStep(i, "prune", f"{s.method} scores, keep {s.keep} of {s.experts} experts per layer",
                             folder)
            if s.method.lower() not in ("reap", "man", "frequency"):
                ps.needs.append(f"{p}.method: {s.method!r} is not a scoring method of fle-reap score "
                                "(REAP, MAN, frequency)")
            for key in ("sequences", "sequence_length"):
                if not is_known(getattr(s.calibration, key)):
                    ps.needs.append(_missing(f"{p}.calibration.{key}", f"give it; {fill}"))
            if calibration is None:
                ps.needs.append(f"{p}.calibration.description: the recipe names no public calibration text; "
                                "give one with --calibration FILE")
        elif isinstance(s, RequantStep):
            ps = PlannedStep(i, "requant", f"tensors /{s.tensors}/ of {s.input.name} to {s.to_type}", folder)
            if not is_known(s.imatrix):
                ps.needs.append(_missing(f"{p}.imatrix", "write the importance matrix used, or \"none\" "
                                                         f"when none was; {fill}"))
        steps.append(ps)
        blockers += ps.needs
    return BuildPlan(r, root, downloads, steps, blockers)


def format_plan(plan: BuildPlan, free_bytes: "int | None" = None) -> str:
    r = plan.recipe
    lines = [f"{r.name}: build plan under {plan.root}", "", "Downloads"]
    for d in plan.downloads:
        s = d.src
        rev = s.revision if is_known(s.revision) else "unknown revision"
        lines.append(f"  {d.role:13s} {s.name}: {s.repo} @ {rev}, {d.include}, "
                     f"{s.size if is_known(s.size) else 'size unknown'}")
    db = plan.download_bytes
    known = sum(d.src.size_bytes or 0 for d in plan.downloads)
    n_unknown = sum(d.src.size_bytes is None for d in plan.downloads)
    lines.append(f"  together {format_size(db)}" if db is not None else
                 f"  together at least {format_size(known)} ({n_unknown} of {len(plan.downloads)} sizes unknown)")
    lines += ["", "Steps"]
    for ps in plan.steps:
        lines.append(f"  {ps.index + 1}. {ps.kind}: {ps.what}")
        lines.append(f"     in {ps.folder}")
    lines.append(f"  card: {plan.root / 'work' / r.name / (r.name + '.md')}")
    ob = plan.output_bytes()
    lines += ["", "Disk"]
    dl = format_size(db) if db is not None else f"at least {format_size(known)}"
    out = (f"about {format_size(ob)} (each output at the recipe's expected size, else its input's)"
           if ob is not None else "unknown (an input's size is unknown)")
    lines.append(f"  downloads {dl}")
    lines.append(f"  step outputs {out}")
    if db is not None and ob is not None:
        lines.append(f"  needed about {format_size(db + ob)}")
    else:
        lines.append(f"  needed at least {format_size(known + (ob or 0))}; some sizes are unknown")
    if free_bytes is not None:
        lines.append(f"  free under {plan.root}: {format_size(free_bytes)}")
    if plan.blockers:
        lines += ["", f"The build would stop: {len(plan.blockers)} value(s) it needs are missing"]
        lines += [f"  {b}" for b in plan.blockers]
    else:
        lines += ["", "Nothing is missing: the build can run."]
    return "\n".join(lines)


def free_space(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


# ---------------------------------------------------------------------------
# downloads


def _manifest_path(d: Download) -> Path:
    return d.local_dir / "downloads.json"


def _read_manifest(path: Path) -> dict:
    # the build's own bookkeeping, rewritten by it: not an input of the command
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise FleError(f"{path}: unreadable download list ({e}); remove it to download again") from None
    if not isinstance(obj, dict) or obj.get("format") != MANIFEST_FORMAT or not isinstance(obj.get("files"), dict):
        raise FleError(f"{path}: not a {MANIFEST_FORMAT} download list; remove it to download again")
    return obj["files"]


def _write_manifest(path: Path, files: dict) -> None:
    from .textio import write_json_atomic

    write_json_atomic(path, {"format": MANIFEST_FORMAT, "files": dict(sorted(files.items()))}, force=True)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _net_errors() -> tuple[type[BaseException], ...]:
    """What the Hub client raises for a failed request: its HTTP errors, the
    HTTP library's transport errors, and OS-level connection errors."""
    import importlib

    errs: list[type[BaseException]] = [OSError]
    from huggingface_hub.errors import HfHubHTTPError

    errs.append(HfHubHTTPError)
    for mod in ("httpx2", "httpx"):
        try:
            errs.append(importlib.import_module(mod).HTTPError)
        except (ImportError, AttributeError):
            pass
    return tuple(errs)


def _remote_files(d: Download) -> list[tuple[str, int, "str | None"]]:
    """(path in the repository, size, LFS SHA-256) of the files to fetch."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    s = d.src
    api = HfApi()
    try:
        commit = api.model_info(s.repo, revision=s.revision).sha
    except HfHubHTTPError as e:
        raise FleError(f"{d.path}.revision: {s.repo} has no revision {s.revision} the Hub will serve "
                       f"({_one_line(e)})") from None
    except _net_errors() as e:
        raise FleError(f"{d.path}: cannot reach the Hub for {s.repo} ({_one_line(e)})") from None
    if commit and not commit.startswith(s.revision):
        raise FleError(f"{d.path}.revision: {s.revision} resolves to commit {commit} on the Hub; pin a commit, "
                       "not a branch or tag")
    try:
        entries = list(api.list_repo_tree(s.repo, path_in_repo=s.folder or None, revision=commit or s.revision,
                                          recursive=False))
    except HfHubHTTPError as e:
        raise FleError(f"{d.path}: cannot list {s.repo} @ {s.revision} folder {s.folder!r} "
                       f"({_one_line(e)})") from None
    except _net_errors() as e:
        raise FleError(f"{d.path}: cannot reach the Hub for {s.repo} ({_one_line(e)})") from None
    out = []
    for e in entries:
        name = e.path.rsplit("/", 1)[-1]
        if getattr(e, "size", None) is None or not fnmatch.fnmatchcase(name, s.file_pattern):
            continue
        lfs = getattr(e, "lfs", None)
        out.append((e.path, int(e.size), getattr(lfs, "sha256", None) if lfs is not None else None))
    if not out:
        raise FleError(f"{d.path}: {s.repo} @ {s.revision} has no file {d.include}; check "
                       f"{d.path}.folder and {d.path}.file_pattern")
    return sorted(out)


def _fetch(d: Download, p: str, size: int, local: Path, log: Callable[[str], None]) -> None:
    """Fetch ``p`` of ``d``'s repository into ``local`` through huggingface_hub:
    the client's metadata request (commit, ETag, size headers), then its
    ranged GET into ``local`` + ``.part``, resumed from that file's length
    when an earlier run stopped; renamed into place when complete."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    from .files import write_error

    s = d.src
    url = hf_hub_url(s.repo, p, revision=s.revision)
    try:
        meta = get_hf_file_metadata(url)
    except HfHubHTTPError as e:
        raise FleError(f"{d.path}: cannot get {p} from {s.repo} @ {s.revision} ({_one_line(e)})") from None
    except _net_errors() as e:
        raise FleError(f"{d.path}: cannot reach the Hub for {s.repo} ({_one_line(e)})") from None
    if meta.commit_hash and not meta.commit_hash.startswith(s.revision):
        raise FleError(f"{d.path}.revision: the Hub serves {p} from commit {meta.commit_hash}, not "
                       f"{s.revision}")
    if meta.size is not None and meta.size != size:
        raise FleError(f"{d.path}: the Hub's listing gives {p} {size} bytes but its download {meta.size}")
    part = local.with_name(local.name + ".part")
    try:
        local.parent.mkdir(parents=True, exist_ok=True)
        with open(part, "ab") as f:
            have = f.tell()
            if have > size:
                f.truncate(0)
                have = 0
            log(f"download {s.repo}/{p} ({format_size(size)}" +
                (f", resuming at {format_size(have)})" if have else ")"))
            if have < size:
                http_get(meta.location, f, resume_size=have, headers=build_hf_headers(), expected_size=size,
                         displayed_filename=Path(p).name)
        os.replace(part, local)
    except OSError as e:
        if e.filename:
            raise write_error(e.filename, e) from None
        raise FleError(f"{d.path}: download of {p} from {s.repo} failed ({_one_line(e)}); "
                       "run again to resume") from None
    except _net_errors() as e:
        raise FleError(f"{d.path}: download of {p} from {s.repo} failed ({_one_line(e)}); "
                       "run again to resume") from None


def download(plan: BuildPlan, *, offline: bool = False, progress: bool = True,
             log: Callable[[str], None] = print) -> dict[str, list[Path]]:
    """Fetch (or, offline, find and check) every file of ``plan``; returns
    the local shard paths per recipe field path, in shard order."""
    from .digest import sha256_file

    lists: dict[str, tuple[Download, list[tuple[str, int, "str | None"]]]] = {}
    for d in plan.downloads:
        if offline:
            man = _read_manifest(_manifest_path(d))
            files = [(p, m["size"], m["sha256"]) for p, m in man.items()
                     if p.startswith(f"{d.src.folder}/" if d.src.folder else "")
                     and fnmatch.fnmatchcase(p.rsplit("/", 1)[-1], d.src.file_pattern)
                     and m.get("revision") == d.src.revision]
            if not files:
                raise FleError(f"{d.path}: --offline, but no checked download of {d.include} @ "
                               f"{d.src.revision} under {d.local_dir}; run once without --offline")
            lists[d.path] = (d, sorted(files))
        else:
            lists[d.path] = (d, _remote_files(d))
    if not offline:
        missing = 0
        for d, files in lists.values():
            for p, size, _ in files:
                have = d.local_dir / p
                if not (have.is_file() and have.stat().st_size == size):
                    part = have.with_name(have.name + ".part")
                    missing += size - (min(part.stat().st_size, size) if part.is_file() else 0)
        free = free_space(plan.root)
        if missing > free:
            raise FleError(f"{plan.root}: {format_size(missing)} still to download but only "
                           f"{format_size(free)} free; free space or choose another --dir")
    out: dict[str, list[Path]] = {}
    for key, (d, files) in lists.items():
        man = _read_manifest(_manifest_path(d))
        paths = []
        for p, size, sha in files:
            local = d.local_dir / p
            if not offline and not (local.is_file() and local.stat().st_size == size):
                _fetch(d, p, size, local, log)
            if not local.is_file():
                raise FleError(f"{local}: missing; run without --offline to download it")
            if local.stat().st_size != size:
                raise FleError(f"{local}: {local.stat().st_size} bytes, the Hub lists {size}; "
                               "remove it to download it again")
            digest = sha256_file(local, progress=progress)
            if sha is None:
                raise FleError(f"{d.path}: the Hub gives no LFS SHA-256 for {p}; it cannot be checked")
            if digest != sha:
                raise FleError(f"{local}: SHA-256 {digest} differs from the Hub's LFS hash {sha}; "
                               "remove it to download it again")
            man[p] = {"size": size, "sha256": sha, "revision": d.src.revision}
            paths.append(local)
        _write_manifest(_manifest_path(d), man)
        out[key] = paths
    return out


# ---------------------------------------------------------------------------
# steps


def _digest(paths: "list[Path] | Path", progress: bool) -> str:
    from .digest import sha256_model

    return sha256_model([paths] if isinstance(paths, Path) else paths, progress=progress)


def _model_paths(first: Path) -> list[Path]:
    from .gguf_reader import GGUFModel

    with GGUFModel.open(first) as m:
        return [Path(p) for p in m.paths]


def _outputs_present(folder: Path, names: list[str]) -> bool:
    return all((folder / n).is_file() for n in names)


def _cached(folder: Path, record: dict) -> "list[Path] | None":
    """The outputs of a step already run with this record, else None."""
    f = folder / "step.json"
    try:
        old = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(old, dict) or {k: v for k, v in old.items() if k != "outputs"} != record:
        return None
    outs = old.get("outputs")
    if not isinstance(outs, list) or not outs or not _outputs_present(folder, outs):
        return None
    return [folder / n for n in outs]


def _record_step(folder: Path, record: dict, outputs: list[Path]) -> None:
    from .textio import write_json_atomic

    write_json_atomic(folder / "step.json", {**record, "outputs": [p.name for p in outputs]}, force=True)


def _fresh(folder: Path) -> None:
    """An empty step folder: the outputs of an outdated run are removed."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)


def run_build(plan: BuildPlan, *, ref: "str | None" = None, text: "str | None" = None,
              calibration: "str | None" = None, offline: bool = False, device: str = "cpu",
              progress: bool = True, log: Callable[[str], None] = print) -> dict[str, Path]:
    """Download and build; returns the final model's first file, the MTP
    head (when the recipe requantizes one) and the card."""
    if plan.blockers:
        raise FleError(f"{plan.recipe.path}: {plan.blockers[0]}"
                       + (f" (and {len(plan.blockers) - 1} more; see fle-build --dry-run)"
                          if len(plan.blockers) > 1 else ""))
    r = plan.recipe
    files = download(plan, offline=offline, progress=progress, log=log)
    base = files["base"]
    donors = {n: files[f"donors.{n}"] for n in r.donors}
    current = base          # the trunk each step starts from
    selection: "Path | None" = None
    results: dict[str, Path] = {}
    for ps in plan.steps:
        s = r.steps[ps.index]
        folder = ps.folder
        if isinstance(s, SelectStep):
            inputs = {"ref": _digest(_model_paths(Path(ref)), progress), "text": _digest(Path(text), progress),
                      "base": _digest(base, progress),
                      **{f"donor.{n}": _digest(donors[n], progress) for n in s.candidates}}
            params = {"mode": s.mode, "target": s.target, "max_error": s.max_error, "step": s.step,
                      "tokens": s.sensitivity.tokens, "candidates": list(s.candidates), "base": r.base.name,
                      "device": device}
            record = {"format": STEP_FORMAT, "kind": "select", "inputs": inputs, "params": params}
            outs = _cached(folder, record)
            if outs is None:
                log(f"step {ps.index + 1} select: measuring")
                from .select import load_table, select_for_error, select_for_target
                from .sensitivity import measure
                from .textio import write_json_atomic

                _fresh(folder)
                table = measure(ref, {n: donors[n][0] for n in s.candidates}, text,
                                n_tokens=s.sensitivity.tokens, base=base[0], base_name=r.base.name,
                                device=device, work_dir=folder, progress=progress)
                tpath = folder / "sensitivity.json"
                write_json_atomic(tpath, table)
                t = load_table(tpath)
                step_bytes = parse_size(s.step)
                sel = (select_for_target(t, parse_size(s.target), step_bytes) if s.mode == "target"
                       else select_for_error(t, float(s.max_error), step_bytes))
                spath = folder / "selection.json"
                write_json_atomic(spath, sel.to_json())
                outs = [tpath, spath]
                _record_step(folder, record, outs)
            else:
                log(f"step {ps.index + 1} select: unchanged inputs, kept {outs[-1]}")
            selection = outs[-1]
        elif isinstance(s, SpliceStep):
            assert selection is not None
            inputs = {"base": _digest(base, progress), "selection": _digest(selection, progress),
                      **{f"donor.{n}": _digest(p, progress) for n, p in donors.items()}}
            record = {"format": STEP_FORMAT, "kind": "splice", "inputs": inputs, "params": {"tensors": s.tensors}}
            outs = _cached(folder, record)
            if outs is None:
                log(f"step {ps.index + 1} splice")
                from .splice import splice

                _fresh(folder)
                _, written = splice(base[0], {n: p[0] for n, p in donors.items()}, selection,
                                    folder / f"{r.name}.gguf", progress=progress)
                outs = [Path(p) for p in written.paths]
                _record_step(folder, record, outs)
            else:
                log(f"step {ps.index + 1} splice: unchanged inputs, kept {outs[0]}")
            current = outs
        elif isinstance(s, PruneStep):
            seq, length = s.calibration.sequences, s.calibration.sequence_length
            inputs = {"model": _digest(current, progress), "calibration": _digest(Path(calibration), progress)}
            params = {"method": s.method, "keep": s.keep, "tokens": seq * length, "ctx": length,
                      "device": device}
            record = {"format": STEP_FORMAT, "kind": "prune", "inputs": inputs, "params": params}
            outs = _cached(folder, record)
            if outs is None:
                log(f"step {ps.index + 1} prune: scoring")
                from .prune import prune
                from .scoring import score
                from .textio import write_json_atomic

                _fresh(folder)
                table = score(current[0], calibration, method=s.method.lower(), n_tokens=seq * length,
                              ctx=length, device=device, progress=progress)
                spath = folder / "scores.json"
                write_json_atomic(spath, table)
                res = prune(current[0], spath, s.keep, folder / f"{r.name}.gguf", progress=progress)
                outs = [spath] + [Path(p) for p in res.trunk_written.paths]
                _record_step(folder, record, outs)
            else:
                log(f"step {ps.index + 1} prune: unchanged inputs, kept {outs[1]}")
            current = outs[1:]
        elif isinstance(s, RequantStep):
            src = files[f"steps[{ps.index}].input"]
            imatrix = s.imatrix if s.imatrix.strip().lower() not in ("", "none") else None
            inputs = {"input": _digest(src, progress)}
            if imatrix:
                inputs["imatrix"] = _digest(Path(imatrix), progress)
            params = {"tensors": s.tensors, "to_type": s.to_type}
            record = {"format": STEP_FORMAT, "kind": "requant", "inputs": inputs, "params": params}
            outs = _cached(folder, record)
            if outs is None:
                log(f"step {ps.index + 1} requant")
                from .requant import requant

                _fresh(folder)
                name = s.output if is_known(s.output) else f"{s.input.name}-{s.to_type}.gguf"
                _, written = requant(src[0], s.tensors, s.to_type, folder / name, progress=progress,
                                     imatrix=imatrix)
                outs = [Path(p) for p in written.paths]
                _record_step(folder, record, outs)
            else:
                log(f"step {ps.index + 1} requant: unchanged inputs, kept {outs[0]}")
            results["mtp_head"] = outs[0]
    from .card import make_card, write_card
    from .gguf_reader import GGUFModel

    card = plan.root / "work" / r.name / f"{r.name}.md"
    with GGUFModel.open(current[0]) as m:
        write_card(make_card(m, r.name), card, force=True)
    results["model"] = current[0]
    results["card"] = card
    log(f"built {current[0]}")
    log(f"wrote {card}")
    return results
