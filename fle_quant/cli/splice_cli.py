"""``fle-splice``: build a model whose expert layers come from different
quantizations of the same model, as a selection from ``fle-select`` says."""
from __future__ import annotations

import argparse
import sys

from ..errors import FleError
from ..splice import execute, fill_provenance, format_plan, plan_splice
from ..units import parse_size
from .common import check_outputs, cli_entry, declare_inputs, exit_main

_EPILOG = """\
The selection names a source per MoE layer: its "base" name stands for --base,
every other name must be given as --donor NAME=FILE. A layer's expert tensors
(ffn_gate_exps, ffn_up_exps, ffn_down_exps or the fused ffn_gate_up_exps, with
their biases and scales) come from that source; everything else (router, shared
expert, attention, embeddings, metadata) comes from the base, in the base's order.

example:
  fle-splice --base Q4_K_M/model-00001-of-00002.gguf \\
             --donor IQ3_S=IQ3_S/model-00001-of-00002.gguf \\
             --selection sel.json -o out/model.gguf --split-max-size 48G

All inputs are checked before anything is written: same architecture and
expert hyperparameters, same shapes for every spliced tensor, every donor the
selection names given. The inputs' SHA-256s (cached in $FLE_CACHE_DIR/digests.json,
default ~/.cache/fle) are recorded in the output's fle.provenance.* metadata.
The output is written under a temporary name and renamed only when complete.
Exit status 2 with a one-line message for bad input, 130 when interrupted.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fle-splice",
        description="Splice whole expert layers from donor GGUF files into a base GGUF file, as a\n"
                    "selection JSON (from fle-select) says. Prints a per-layer table and the output size.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base", required=True, metavar="BASE.gguf",
                   help="the model everything not selected comes from (any shard of a split model)")
    p.add_argument("--donor", action="append", default=[], metavar="NAME=FILE",
                   help="a donor: its candidate NAME as in the selection and its file (any shard); repeat "
                        "for each donor")
    p.add_argument("--selection", required=True, metavar="SEL.json",
                   help="selection written by fle-select (format fle.selection/1)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.gguf",
                   help="output file; with splitting, OUT-0000k-of-0000N.gguf next to it")
    p.add_argument("--split-max-size", metavar="SIZE",
                   help="split the output into shards of at most SIZE of tensor data, e.g. 48G "
                        "(decimal units as llama.cpp's gguf-split)")
    p.add_argument("--split-max-tensors", metavar="N", type=int,
                   help="split the output into shards of at most N tensors")
    p.add_argument("--dry-run", action="store_true",
                   help="check the inputs and print the table, then stop (nothing is hashed or written)")
    p.add_argument("--force", action="store_true", help="overwrite existing output files")
    return p


def _donors(specs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        name = name.strip()
        if not sep or not name or not path:
            raise FleError(f"--donor {spec!r}: write NAME=FILE, NAME as the selection names the candidate")
        if name in out:
            raise FleError(f"--donor {name!r} is given twice ({out[name]} and {path}); give each donor once")
        out[name] = path
    return out


@cli_entry("fle-splice")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    split_size = parse_size(args.split_max_size, "--split-max-size") if args.split_max_size else None
    if split_size is not None and split_size <= 0:
        raise FleError("--split-max-size must be positive")
    if args.split_max_tensors is not None and args.split_max_tensors <= 0:
        raise FleError("--split-max-tensors must be positive")
    donors = _donors(args.donor)
    declare_inputs(args.base, args.selection, *donors.values())
    if not args.dry_run:
        check_outputs([args.output], args.force)
    plan = plan_splice(args.base, donors, args.selection, args.output,
                       split_max_size=split_size, split_max_tensors=args.split_max_tensors, force=args.force)
    for name in plan.unused_donors:
        print(f"fle-splice: warning: donor {name!r} is not used by the selection; ignored", file=sys.stderr)
    print(format_plan(plan), flush=True)
    if args.dry_run:
        return 0
    fill_provenance(plan)
    result = execute(plan, force=args.force)
    for p in result.paths:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    exit_main(main)
