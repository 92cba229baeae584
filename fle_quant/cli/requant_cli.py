"""``fle-requant``: requantize the tensors of a GGUF file that match a regular
expression to another quant type; everything else is copied byte for byte."""
from __future__ import annotations

import argparse

from ..errors import FleError
from ..imatrix import KEY_IMATRIX_SHA256
from ..requant import MEASURE_ROWS, format_report, requant
from ..units import format_size, parse_size
from .common import check_outputs, cli_entry, declare_inputs, exit_main

_EPILOG = f"""\
--tensors is a Python regular expression searched anywhere in each tensor name
(anchor it with ^...$ to match whole names). Each matching tensor is decoded
to float32 and encoded in --type a chunk of rows at a time, so memory stays
bounded for tensors of any size. For each one the table shows its bytes before
and after and the relative error ||x_new - x_src||^2 / ||x_src||^2 against the
decoded source on its first {MEASURE_ROWS:,} rows.

--imatrix takes the importance matrix files that llama-quantize takes (GGUF or
legacy .dat, as written by llama-imatrix) and uses them as llama-quantize
does: each tensor is encoded with its entry's mean squared activations (rows
of stacked *_exps experts with their own expert's), a tensor without an entry
is encoded without one, and an entry of another size is refused. IQ3_XXS
needs an importance matrix for every tensor (as in llama-quantize), with or
without --imatrix. The output records the file in llama-quantize's
quantize.imatrix.* keys and its SHA-256 in {KEY_IMATRIX_SHA256};
the table then says which tensors had an entry.

examples:
  fle-requant model-mtp.gguf --tensors 'blk\\.48\\.ffn_(gate|up|down)_exps' --type IQ4_NL -o mtp-iq4nl.gguf
  fle-requant model.gguf --tensors '^per_layer_token_embd\\.weight$' --type MXFP4 -o model-ple-mxfp4.gguf
  fle-requant model-mtp.gguf --tensors 'ffn_(gate|up|down)_exps' --type IQ4_NL --imatrix imatrix.gguf -o mtp.gguf

Exit status 2 with a one-line message for bad input (unknown type, a type FLE
cannot encode, a type whose block does not divide a matched row, a pattern
matching nothing, a bad or mismatched imatrix); the output is written under a
temporary name and renamed only when complete.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fle-requant",
        description="Requantize the tensors whose names match --tensors to --type and print the\n"
                    "relative error each one gets.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="FILE.gguf", help="the input file (any shard of a split model)")
    p.add_argument("--tensors", required=True, metavar="REGEX", help="which tensors to requantize (re.search)")
    p.add_argument("--type", required=True, metavar="TYPE",
                   help="target quant type, e.g. IQ4_NL, MXFP4, Q8_0, IQ4_XS, Q6_K")
    p.add_argument("--imatrix", metavar="FILE",
                   help="importance matrix from llama-imatrix (GGUF or legacy .dat), used as llama-quantize does")
    p.add_argument("-o", "--output", required=True, metavar="OUT.gguf", help="where to write the result")
    p.add_argument("--split-max-size", metavar="SIZE",
                   help="split the output into shards of at most SIZE of tensor data (e.g. 48G)")
    p.add_argument("--split-max-tensors", type=int, metavar="N", help="split the output every N tensors")
    p.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    return p


@cli_entry("fle-requant")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.split_max_tensors is not None and args.split_max_tensors <= 0:
        raise FleError(f"--split-max-tensors must be positive, got {args.split_max_tensors}")
    split = parse_size(args.split_max_size, "--split-max-size") if args.split_max_size is not None else None
    declare_inputs(args.model, args.imatrix)
    check_outputs([args.output], args.force)
    reports, written = requant(args.model, args.tensors, args.type, args.output, force=args.force,
                               split_max_size=split, split_max_tensors=args.split_max_tensors,
                               imatrix=args.imatrix)
    print(format_report(reports))
    for path in written.paths:
        print(f"wrote {path} ({format_size(path.stat().st_size)})")
    return 0


if __name__ == "__main__":
    exit_main(main)
