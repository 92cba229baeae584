"""``fle-build``: download what a release recipe names and build the release
with FLE's own steps, then write its model card."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..build import format_plan, free_space, plan_build, run_build
from ..errors import Terminated
from ..files import check_input
from ..recipe import load_recipe
from .common import cli_entry, declare_inputs, exit_main

_EPILOG = """\
The downloads are only the recipe's files (its folder and shard pattern at
its pinned revision), with huggingface_hub: resumable, with progress bars,
after a free-disk check, each file's SHA-256 checked against the Hub's LFS
hash. HF_ENDPOINT and HF_TOKEN are the client's own settings. Files land in
DIR/models/OWNER__NAME/, steps work in DIR/work/NAME/NN-KIND/; a step whose
inputs' SHA-256 and parameters are unchanged is not run again, so a build
that stopped resumes where it stopped.

The recipes name no public reference model, capture text or calibration
text; give them with --ref, --text and --calibration where a step needs
them. A value the build needs that the recipe marks "unknown" stops it with
one line naming the field.

examples:
  fle-build selections/FLE-IQ3_M.recipe.json --dry-run
      the downloads with their sizes, the steps, the disk needed, and what
      would stop the build; no network
  fle-build selections/FLE-IQ3_XXS.recipe.json --dir /data/fle --ref bf16.gguf --text capture.txt

Exit status 2 with a one-line message for bad input.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fle-build", description="Build a release from its recipe: download "
                                "the public files, run the recipe's steps, write the model card.",
                                epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", metavar="RECIPE", help="release recipe (fle.recipe/1), e.g. selections/FLE-IQ3_M.recipe.json")
    p.add_argument("--dir", default="fle-build", metavar="DIR",
                   help="where downloads and step outputs go (default: ./fle-build)")
    p.add_argument("--offline", action="store_true",
                   help="use only files downloaded and checked before; no network")
    p.add_argument("--dry-run", action="store_true", help="print the plan and stop; no network")
    p.add_argument("--ref", metavar="REF.gguf", help="reference model (e.g. BF16) for the select step's sensitivity")
    p.add_argument("--text", metavar="FILE", help="capture text for the select step's sensitivity")
    p.add_argument("--calibration", metavar="FILE", help="calibration text for the prune step's scores")
    p.add_argument("--device", default="cpu", help="torch device for sensitivity and scores (default: cpu)")
    return p


@cli_entry("fle-build")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    declare_inputs(args.recipe, args.ref, args.text, args.calibration)
    recipe = load_recipe(args.recipe)
    for opt, path in (("--ref", args.ref), ("--text", args.text), ("--calibration", args.calibration)):
        if path is not None:
            check_input(path, f"file given as {opt}")
    plan = plan_build(recipe, Path(args.dir), ref=args.ref, text=args.text, calibration=args.calibration)
    if args.dry_run:
        print(format_plan(plan, free_space(Path(args.dir))))
        return 0
    if args.device != "cpu":
        from .common import check_device

        check_device(args.device)
    try:
        run_build(plan, ref=args.ref, text=args.text, calibration=args.calibration, offline=args.offline,
                  device=args.device)
    except (KeyboardInterrupt, Terminated) as e:
        # a step's unfinished output is removed by the step; a download's bytes so far are kept on purpose
        word, rc = ("terminated", 143) if isinstance(e, Terminated) else ("interrupted", 130)
        print(f"fle-build: {word}; finished steps and downloaded bytes are kept, run it again to resume",
              file=sys.stderr)
        return rc
    return 0


if __name__ == "__main__":
    exit_main(main)
