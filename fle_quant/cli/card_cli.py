"""``fle-card``: write the Hugging Face model card of a GGUF file (usually one
made by ``fle-splice``) from the file's own metadata and provenance."""
from __future__ import annotations

import argparse
from pathlib import Path

import os

from ..card import load_quality, make_card, make_recipe_card, write_card
from ..errors import FleError
from ..gguf_reader import GGUFModel
from .common import check_outputs, cli_entry, declare_inputs, exit_main

_EPILOG = """\
Everything in the card is read from the file: front matter (base_model from
general.source.repo_url or general.base_model.N.repo_url, license from
general.license, else "other" with a note), files and sizes, bits per weight,
the fle.provenance.* sources and SHA-256s, and the per-layer source table.
Quality numbers appear only when given with --quality, a JSON file:

  {"format": "fle.quality/1",
   "reference": "BF16 model, llama.cpp",
   "texts": {"E": {"mean_kld": 0.0123, "kld_se": 0.0004, "top1": 0.953, "n_tokens": 4096}}}

(mean_kld required per text; kld_se, top1 in [0, 1], n_tokens optional; "format"
and "reference" optional; unknown keys are an error).

examples:
  fle-card out/model-00001-of-00002.gguf -o model-cards/Model-FLE-88GB.md --quality kld.json
  fle-card --recipe selections/FLE-IQ3_M.recipe.json -o model-cards/FLE-IQ3_M.md
      the card of a release from its recipe alone: what it is, how it is made,
      the reproduction command and the recipe's figures, each with its source

The card is written under a temporary name and renamed when complete. Exit
status 2 with a one-line message for bad input.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fle-card",
        description="Generate a Hugging Face model card (Markdown with YAML front matter) for a GGUF file.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("file", nargs="?", help="GGUF file, or any shard NAME-0000k-of-0000N.gguf of a split model")
    p.add_argument("--recipe", metavar="R.recipe.json",
                   help="make the card from a release recipe instead of a file (no FILE then)")
    p.add_argument("-o", "--output", required=True, metavar="CARD.md", help="where to write the card")
    p.add_argument("--name", help="the card's title (default: the output file name without .md)")
    p.add_argument("--quality", metavar="KLD.json", help="quality numbers to include (format fle.quality/1)")
    p.add_argument("--force", action="store_true", help="overwrite an existing card")
    return p


def _shown_path(path: str) -> str:
    """The recipe's path as the card shows it: relative to the working
    directory when inside it, else its file name (no absolute paths)."""
    rel = os.path.relpath(os.path.abspath(path))
    return Path(rel).as_posix() if not rel.startswith("..") else Path(path).name


@cli_entry("fle-card")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.output)
    name = args.name or (out.name[: -len(".md")] if out.name.endswith(".md") else out.name)
    if (args.file is None) == (args.recipe is None):
        raise FleError("give either a GGUF FILE or --recipe R.recipe.json, not both or neither")
    if args.recipe and args.quality:
        raise FleError("--quality: a card from a recipe takes its figures from the recipe; "
                       "make the card of the built file to add measured quality")
    if args.recipe and args.name:
        raise FleError("--name: a card from a recipe is titled with the recipe's name")
    declare_inputs(args.file or args.recipe, args.quality)
    if out.parent.is_dir():  # else the card's folder is made when it is written
        check_outputs([out], args.force)
    if args.recipe:
        from ..recipe import load_recipe

        recipe = load_recipe(args.recipe)
        text = make_recipe_card(recipe, _shown_path(args.recipe))
    else:
        quality = load_quality(args.quality) if args.quality else None
        with GGUFModel.open(args.file) as model:
            text = make_card(model, name, quality)
    write_card(text, out, force=args.force)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    exit_main(main)
