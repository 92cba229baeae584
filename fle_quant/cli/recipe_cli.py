"""``fle-recipe``: check release recipes and print what rebuilding a release
takes (downloads, then FLE commands in order). It runs and downloads nothing."""
from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys

from ..errors import FleError
from ..recipe import (FORMAT, FileSource, PruneStep, Recipe, RequantStep, SelectStep, SpliceStep,
                      is_known, load_recipe)
from ..units import format_size
from .common import cli_entry, exit_main

_DESCRIPTION = f"""\
Release recipes ({FORMAT}, one JSON file per release under selections/) record
which public files a released model starts from and which steps build it:
select (choose, per MoE layer, the file its experts come from), splice (copy
those expert layers into the base), prune (remove experts) and requant
(requantize chosen tensors). Values the source report does not state are
"unknown"; every known value names its source."""

_EPILOG = """\
examples:
  fle-recipe validate selections/*.recipe.json
      check every shipped recipe; one line per file, exit status 2 if any fails
  fle-recipe validate selections/
      the same for every *.recipe.json in a folder
  fle-recipe show selections/FLE-IQ3_M.recipe.json
      the files to download and the commands that would rebuild FLE-IQ3_M;
      <UNKNOWN> marks a value the recipe cannot give

Exit status 2 with a one-line message (file and field path) for bad input."""

# The FLE command that carries out each step, and the module that provides it;
# a command whose module is missing is shown as planned, its arguments indicative.
_COMMANDS = {
    "sensitivity": ("fle-sensitivity", "fle_quant.cli.sensitivity_cli"),
    "select": ("fle-select", "fle_quant.cli.select_cli"),
    "splice": ("fle-splice", "fle_quant.cli.splice_cli"),
    "score": ("fle-reap score", "fle_quant.cli.reap_cli"),
    "prune": ("fle-reap prune", "fle_quant.cli.reap_cli"),
    "requant": ("fle-requant", "fle_quant.cli.requant_cli"),
}
_U = "<UNKNOWN>"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fle-recipe", description=_DESCRIPTION, epilog=_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    v = sub.add_parser("validate", help="check recipe files against the schema and their sources",
                       description="Check each recipe: schema (no unknown or missing keys, types, quant "
                                   "type names, regular expressions, sizes), step order "
                                   "select -> splice -> prune -> requant, consistency between steps "
                                   "and expected results, and that every known value has a source. "
                                   "Prints OK or the error for every file; exit status 2 if any fails.")
    v.add_argument("files", nargs="+", metavar="FILE",
                   help="recipe file, or a folder whose *.recipe.json files are all checked")
    s = sub.add_parser("show", help="print the downloads and FLE commands that rebuild a release",
                       description="Print a human-readable plan for one recipe: the public files to "
                                   "download, the FLE commands in the order they would run, the "
                                   "expected result, and every value the recipe marks unknown. "
                                   "Nothing is run or downloaded.")
    s.add_argument("file", metavar="FILE", help="recipe file (format fle.recipe/1)")
    s.add_argument("--models-dir", default="models", metavar="DIR",
                   help="where the plan puts downloaded files (default: models)")
    s.add_argument("--work-dir", default="work", metavar="DIR",
                   help="where the plan puts intermediate and output files (default: work)")
    return p


def _expand(paths: list[str]) -> list[str]:
    out = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".recipe.json"))
            if not found:
                raise FleError(f"{path}: folder holds no *.recipe.json files")
            out.extend(found)
        else:
            out.append(path)
    return out


def _validate(files: list[str]) -> int:
    failed = 0
    for path in _expand(files):
        try:
            r = load_recipe(path)
        except FleError as e:
            failed += 1
            print(f"fle-recipe: error: {e}", file=sys.stderr)
            continue
        print(f"OK {path} ({r.name}; {len(r.steps)} steps; {len(r.unknown_paths)} values unknown)")
    return 2 if failed else 0


# ---------------------------------------------------------------------------
# show

def _v(value) -> str:
    """A value for display; unknown values stand out."""
    return _U if not is_known(value) else str(value)


def _local_dir(models_dir: str, src: FileSource) -> str:
    repo = src.repo if is_known(src.repo) else "UNKNOWN-REPO"
    return os.path.join(models_dir, repo.replace("/", "__"))


def _first_file(models_dir: str, src: FileSource) -> str:
    """Path of the file (first shard for a split model) that FLE commands are given."""
    folder = src.folder if is_known(src.folder) else _U
    name = src.file_pattern.replace("*", "00001", 1) if is_known(src.file_pattern) else _U
    return os.path.join(_local_dir(models_dir, src), folder, name) if folder else \
        os.path.join(_local_dir(models_dir, src), name)


def _download(models_dir: str, role: str, src: FileSource) -> list[str]:
    lines = [f"{role} {src.name}: {_v(src.repo)}  folder {_v(src.folder)!s}  size {_v(src.size)}"]
    if not (is_known(src.repo) and is_known(src.file_pattern) and is_known(src.folder)):
        lines.append(f"    cannot download: repository, folder or file name is {_U}")
        return lines
    include = f"{src.folder}/{src.file_pattern}" if src.folder else src.file_pattern
    cmd = ["hf", "download", src.repo, "--include", include]
    if is_known(src.revision):
        cmd += ["--revision", src.revision]
    cmd += ["--local-dir", _local_dir(models_dir, src)]
    lines.append("    " + shlex.join(cmd))
    if not is_known(src.revision):
        lines.append(f"    revision {_U}: this fetches the repository's current main branch, which may "
                     "differ from the files the release was built from")
    return lines


def _arg(value) -> str:
    return _U if not is_known(value) else shlex.quote(str(value))


def _cmd(step: str, args: list[str]) -> list[str]:
    name, module = _COMMANDS[step]
    try:
        present = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        present = False
    lines = ["    " + " ".join([name, *args])]
    if not present:
        lines.append(f"    ({name} is not part of this FLE version yet; arguments are indicative)")
    return lines


def _step_plan(r: Recipe, models: str, work: str) -> list[str]:
    out: list[str] = []
    base_path = _first_file(models, r.base)
    donor_arg = {n: f"--donor {n}={_first_file(models, d)}" for n, d in r.donors.items()}
    donor_args = list(donor_arg.values())
    current = base_path  # the model file each step starts from
    n = 0
    for step in r.steps:
        n += 1
        if isinstance(step, SelectStep):
            sens = step.sensitivity
            table = os.path.join(work, r.name, "sensitivity.json")
            out.append(f"{n}. measure: predicted error of every candidate's expert layers "
                       f"({_v(sens.tokens)} tokens of {_v(sens.text)}, reference {_v(sens.reference)})")
            cands = [donor_arg[c] for c in step.candidates]
            # the recipe describes the reference and the text; neither is a public file it can name
            out += _cmd("sensitivity", [f"--ref {_U}", f"--base {base_path}", *cands,
                                        f"--tokens {_arg(sens.tokens)}", f"--text {_U}", f"-o {table}"])
            if is_known(sens.reference):
                out.append(f"    --ref: a {sens.reference} file of the model; the recipe names "
                           "no public one")
            if not is_known(sens.text) or "not published" in sens.text:
                out.append("    --text: the capture text is not published; a rebuild must use another "
                           "text and may choose other layers")
            n += 1
            sel = os.path.join(work, r.name, "selection.json")
            step_arg = step.step.replace(" ", "") if is_known(step.step) else _U
            if step.mode == "target":
                goal = f"--target {step.target.replace(' ', '') if is_known(step.target) else _U}"
                what = f"the least predicted error within {_v(step.target)}"
            else:
                goal = f"--max-error {_v(step.max_error)}"
                what = f"the smallest file with summed predicted error at most {_v(step.max_error)}"
            out.append(f"{n}. select: per MoE layer, the base or one of {', '.join(step.candidates)}; "
                       f"{what}")
            out += _cmd("select", [f"--sensitivity {table}", goal, f"--step {step_arg}", f"-o {sel}"])
        elif isinstance(step, SpliceStep):
            dst = os.path.join(work, r.name, f"{r.name}.gguf")
            out.append(f"{n}. splice: copy the chosen layers' expert tensors (/{_v(step.tensors)}/) "
                       f"from the donors into the base")
            # fle-splice always takes whole expert layers (gate, up, down or fused gate_up);
            # the recipe's tensor pattern documents that choice
            out += _cmd("splice", [f"--base {base_path}", *donor_args,
                                   f"--selection {os.path.join(work, r.name, 'selection.json')}",
                                   f"-o {dst}"])
            current = dst
        elif isinstance(step, PruneStep):
            cal = step.calibration
            dst = os.path.join(work, r.name, f"{r.name}-pruned.gguf")
            out.append(f"{n}. prune: keep {step.keep} of {_v(step.experts)} experts per layer by "
                       f"{step.method} saliency, measured over {_v(cal.sequences)} x "
                       f"{_v(cal.sequence_length)} tokens of calibration text")
            out.append(f"    calibration text: {_v(cal.description)}")
            scores = os.path.join(work, r.name, "scores.json")
            tokens = (f"--tokens {cal.sequences * cal.sequence_length} --ctx {cal.sequence_length}"
                      if is_known(cal.sequences) and is_known(cal.sequence_length) else f"--tokens {_U}")
            out += _cmd("score", [current, f"--method {step.method.lower()}", f"--text {_U}", tokens,
                                  f"-o {scores}"])
            out += _cmd("prune", [current, f"--scores {scores}", f"--keep {step.keep}", f"-o {dst}"])
            if is_known(cal.description) and "not published" in cal.description:
                out.append(f"    the calibration text is not published ({_U}): a rebuild must write "
                           "its own and may keep other experts")
            current = dst
        elif isinstance(step, RequantStep):
            src = _first_file(models, step.input)
            dst = os.path.join(work, r.name, step.output if is_known(step.output)
                               else f"{step.input.name}-{step.to_type}.gguf")
            out.append(f"{n}. requant: tensors matching /{step.tensors}/ of {step.input.name} from "
                       f"{_v(step.from_type)} to {step.to_type} "
                       f"({_v(step.tensors_changed)} of {_v(step.tensors_total)} tensors; "
                       f"imatrix {_v(step.imatrix)})")
            imatrix = ([f"--imatrix {shlex.quote(step.imatrix)}"]
                       if is_known(step.imatrix) and step.imatrix.strip().lower() not in ("", "none") else [])
            out += _cmd("requant", [src, f"--tensors {shlex.quote(step.tensors)}", f"--type {step.to_type}",
                                    *imatrix, f"-o {dst}"])
            if not is_known(step.output):
                out.append(f"    release file name {_U}; the name above is chosen by this plan")
            if is_known(step.draft_vocab):
                out.append(f"    draft vocabulary at run time: {step.draft_vocab}")
    return out


def _show(path: str, models: str, work: str) -> int:
    r = load_recipe(path)
    e = r.expected
    lines = [f"{r.name}  ({path})", f"  {r.description}", "",
             f"model {_v(r.model)}; release {_v(r.release.repo)} (files {_v(r.release.file_pattern)})", "",
             "Downloads"]
    srcs = [("base", r.base)] + [("donor", d) for d in r.donors.values()]
    srcs += [("input", s.input) for s in r.steps if isinstance(s, RequantStep)]
    for role, s in srcs:
        lines += ["  " + x for x in _download(models, role, s)]
    total = [s.size_bytes for _, s in srcs]
    if all(t is not None for t in total):
        lines.append(f"  together {format_size(sum(total))}")
    elif all(t is None for t in total):
        lines.append(f"  together {_U} (no file size is known)")
    else:
        known = sum(t for t in total if t is not None)
        lines.append(f"  together at least {format_size(known)} (size of {sum(t is None for t in total)} "
                     f"of {len(total)} files {_U})")
    lines += ["", "Commands, in order"]
    lines += ["  " + x for x in _step_plan(r, models, work)]
    lines += ["", "Expected result"]
    rows = [("file size", e.file_size), ("resident without PLE table", e.resident_size),
            ("parameters (billions)", e.parameters_billions), ("MoE layers", e.moe_layers),
            ("experts per layer", e.experts_per_layer), ("layers from donors", e.donor_layers),
            ("summed predicted error", e.predicted_error),
            ("KLD against BF16", e.kld if not is_known(e.kld) else
             ", ".join(f"{k} {v}" for k, v in e.kld.items())),
            ("per-layer sources", e.per_layer if not is_known(e.per_layer) else
             " ".join(f"{k}:{v}" for k, v in sorted(e.per_layer.items())))]
    paths = ["file_size", "resident_size", "parameters_billions", "moe_layers", "experts_per_layer",
             "donor_layers", "predicted_error", "kld", "per_layer"]
    for (label, value), key in zip(rows, paths):
        src = r.source_of(f"expected.{key}")
        lines.append(f"  {label:28s} {_v(value)}" + (f"   [{src}]" if is_known(value) and src else ""))
    if r.notes:
        lines += ["", "Notes"]
        lines += [f"  - {n.text} [{n.source}]" for n in r.notes]
    holes = sum(x.count(_U) for x in lines if x.startswith("      ") and not x.startswith("      ("))
    if holes:
        lines += ["", f"The commands above hold {holes} {_U} placeholders: the plan cannot run as "
                      "written until they are filled in."]
    lines += ["", f"Unknown ({len(r.unknown_paths)} values; the source report does not state them):"]
    lines += [f"  {p}" for p in r.unknown_paths]
    print("\n".join(lines))
    return 0


@cli_entry("fle-recipe")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "validate":
        return _validate(args.files)
    return _show(args.file, args.models_dir, args.work_dir)


if __name__ == "__main__":
    exit_main(main)
