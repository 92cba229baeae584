"""``fle-inspect FILE``: architecture, hyperparameters, size, bits per weight
and the per-layer expert table of a GGUF model (any shard of it)."""
from __future__ import annotations

import argparse
import json

from ..gguf_reader import GGUFModel
from ..inspect import format_summary, summarize, to_json
from .common import cli_entry, exit_main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fle-inspect",
        description="Show what a GGUF file holds: architecture, key hyperparameters, total size, "
                    "bits per weight and, per layer, the types and bytes of the expert tensors. "
                    "Give any shard of a split model; the other shards are found next to it.",
    )
    p.add_argument("file", help="GGUF file, or any shard NAME-0000k-of-0000N.gguf of a split model")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    return p


@cli_entry("fle-inspect")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    with GGUFModel.open(args.file) as model:
        summary = summarize(model)
    if args.json:
        print(json.dumps(to_json(summary), indent=1, default=str))
    else:
        print(format_summary(summary))
    return 0


if __name__ == "__main__":
    exit_main(main)
