"""``fle-select``: pick, per MoE layer, the file its experts come from, so that
the spliced model fits a size target with the least predicted error (or is as
small as possible within an error bound). Reads a sensitivity table, writes a
selection for ``fle-splice``."""
from __future__ import annotations

import argparse
import math

from ..errors import FleError
from ..select import (DEFAULT_STEP_BYTES, format_selection, load_table, select_for_error,
                      select_for_target)
from ..textio import write_json_atomic
from ..units import parse_size
from .common import check_outputs, cli_entry, declare_inputs, exit_main

_EPILOG = """\
sizes: decimal units as llama.cpp and Hugging Face print them (88.9GB = 88.9 x 10^9
bytes; G and GB are the same); binary units need the i: 82.8GiB = 82.8 x 2^30.

examples:
  fle-select --sensitivity sens.json --target 88.9GB -o sel.json
      the best model whose whole .gguf file is at most 88.9 GB
  fle-select --sensitivity sens.json --max-error 0.02 -o sel.json
      the smallest model whose summed predicted error is at most 0.02

The selection is exact for sizes rounded up to --step, so the file never
exceeds the target; a smaller step gets a few MB closer to it and takes longer.
Exit status 2 with a one-line message for bad input; the output is written
under a temporary name and renamed only when complete.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fle-select",
        description="Choose, for every MoE layer, whether its expert tensors come from the base\n"
                    "file or from one of the donor files, using the predicted errors and byte sizes\n"
                    "in a sensitivity table. Layers that lose little accuracy are taken from smaller\n"
                    "donors until the output fits the target. Writes a selection JSON for\n"
                    "fle-splice and prints a per-layer table.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sensitivity", required=True, metavar="TABLE.json",
                   help="sensitivity table (format fle.sensitivity/1): per layer and per source, the "
                        "predicted error and the expert bytes")
    goal = p.add_mutually_exclusive_group(required=True)
    goal.add_argument("--target", metavar="SIZE",
                      help="size of the whole output .gguf file (all shards together), e.g. 88.9GB; "
                           "the selection's file is at most this large")
    goal.add_argument("--max-error", metavar="E", type=float,
                      help="bound on the summed predicted error (sum over layers of "
                           "|y_Q - y_ref|^2 / |y_ref|^2); the smallest file within it is chosen")
    p.add_argument("--step", metavar="SIZE", default="16MB",
                   help="size granularity of the search; every source's layer size is rounded up "
                        f"to whole steps (default 16MB = {DEFAULT_STEP_BYTES} bytes)")
    p.add_argument("-o", "--output", required=True, metavar="SEL.json",
                   help="where to write the selection (format fle.selection/1)")
    p.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    return p


@cli_entry("fle-select")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    declare_inputs(args.sensitivity)
    check_outputs([args.output], args.force)
    step = parse_size(args.step, "--step")
    if step < 1:
        raise FleError("--step must be at least 1 byte")
    table = load_table(args.sensitivity)
    if args.target is not None:
        selection = select_for_target(table, parse_size(args.target, "--target"), step)
    else:
        if not math.isfinite(args.max_error):
            raise FleError(f"--max-error must be a finite number, got {args.max_error}")
        selection = select_for_error(table, args.max_error, step)
    write_json_atomic(args.output, selection.to_json(), args.force)
    print(format_selection(selection))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    exit_main(main)
