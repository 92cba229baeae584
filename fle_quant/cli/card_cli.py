"""``fle-card``: write the Hugging Face model card of a GGUF file (usually one
made by ``fle-splice``) from the file's own metadata and provenance."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..card import load_quality, make_card, write_card
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

example:
  fle-card out/model-00001-of-00002.gguf -o model-cards/Model-FLE-88GB.md --quality kld.json

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
    p.add_argument("file", help="GGUF file, or any shard NAME-0000k-of-0000N.gguf of a split model")
    p.add_argument("-o", "--output", required=True, metavar="CARD.md", help="where to write the card")
    p.add_argument("--name", help="the card's title (default: the output file name without .md)")
    p.add_argument("--quality", metavar="KLD.json", help="quality numbers to include (format fle.quality/1)")
    p.add_argument("--force", action="store_true", help="overwrite an existing card")
    return p


@cli_entry("fle-card")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.output)
    name = args.name or (out.name[: -len(".md")] if out.name.endswith(".md") else out.name)
    declare_inputs(args.file, args.quality)
    if out.parent.is_dir():  # else the card's folder is made when it is written
        check_outputs([out], args.force)
    quality = load_quality(args.quality) if args.quality else None
    with GGUFModel.open(args.file) as model:
        text = make_card(model, name, quality)
    write_card(text, out, force=args.force)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    exit_main(main)
