"""``fle-sensitivity``: measure, per MoE layer and per candidate file, the
relative error of the layer's output when its experts come from that file,
and write the sensitivity table ``fle-select`` reads."""
from __future__ import annotations

import argparse
import os

from ..errors import FleError
from ..files import check_input
from ..sensitivity import DEFAULT_BASE_NAME, DEFAULT_CTX, DEFAULT_TOKENS, check_output, measure, write_json_atomic
from .common import check_device, check_outputs, cli_entry, declare_inputs, exit_main

_EPILOG = """\
The reference (--ref) is the most accurate file you have (BF16, Q8_0, ...). It
runs once over the first --tokens tokens of --text (windows of --ctx tokens,
each from an empty state); every MoE layer's inputs and routing are kept. Then
each candidate's experts are read one layer at a time and the layer is
recomputed with the reference's routing, router and shared expert:

  error = sum over tokens |y_cand - y_ref|^2 / sum over tokens |y_ref|^2

The base is the file fle-splice starts from: the reference itself (error 0)
unless --base names another file. Donor names become the candidate names that
fle-select prints and fle-splice's --donor NAME=FILE expects.

examples:
  fle-sensitivity --ref Q8_0/model.gguf --donor IQ3_S=IQ3_S/model.gguf \\
      --donor IQ2_M=IQ2_M/model.gguf --text wiki.txt -o sens.json
  fle-sensitivity --ref BF16/model-00001-of-00004.gguf --base Q4_K_M/model.gguf \\
      --base-name Q4_K_M --donor IQ3_S=IQ3_S/model.gguf --text wiki.txt -o sens.json
  fle-select --sensitivity sens.json --target 88.9GB -o sel.json

Memory and disk: the reference model is held in memory for its pass, then
only one layer of one file's experts. Scratch space (--work-dir, default the
system's temporary folder): 4 x tokens x embedding width bytes per MoE layer.
Exit status 2 with a one-line message for bad input; the table is written
under a temporary name and renamed only when complete.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fle-sensitivity",
        description="Measure how much each MoE layer's output changes when its expert tensors come\n"
                    "from a donor quantization instead of the reference, and write the sensitivity\n"
                    "table (format fle.sensitivity/1) that fle-select reads.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--ref", required=True, metavar="REF.gguf",
                   help="the reference model (any shard): its outputs are the truth the errors are measured "
                        "against, and its tokenizer reads --text")
    p.add_argument("--donor", action="append", default=[], metavar="NAME=FILE",
                   help="a candidate source of expert layers: its name and file (any shard); repeat for each")
    p.add_argument("--text", required=True, metavar="FILE", help="calibration text (UTF-8)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, metavar="N",
                   help=f"tokens of the text to measure over (default {DEFAULT_TOKENS})")
    p.add_argument("--ctx", type=int, default=DEFAULT_CTX, metavar="N",
                   help=f"tokens per window (default {DEFAULT_CTX})")
    p.add_argument("--base", metavar="BASE.gguf",
                   help="the file fle-splice will start from, when it is not the reference; its error is "
                        "measured like a donor's")
    p.add_argument("--base-name", default=DEFAULT_BASE_NAME, metavar="NAME",
                   help=f"the base's candidate name in the table (default {DEFAULT_BASE_NAME!r})")
    p.add_argument("--device", default="cpu", metavar="DEV", help="torch device, e.g. cuda (default cpu)")
    p.add_argument("--work-dir", metavar="DIR", help="folder for the scratch files (default the system's temp)")
    p.add_argument("-o", "--output", required=True, metavar="TABLE.json", help="where to write the table")
    p.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    return p


def parse_donors(items: list[str]) -> dict[str, str]:
    donors: dict[str, str] = {}
    for item in items:
        name, eq, path = item.partition("=")
        if not eq or not name or not path:
            raise FleError(f"--donor {item!r}: write NAME=FILE, e.g. --donor IQ3_S=model-IQ3_S.gguf")
        if name in donors:
            raise FleError(f"--donor: the name {name!r} is given twice; every donor needs its own name")
        donors[name] = path
    return donors


def _check_inputs(args: argparse.Namespace, donors: dict[str, str]) -> None:
    for what, path in [("--ref", args.ref), ("--text", args.text)] + ([("--base", args.base)] if args.base else []) \
            + [(f"--donor {n}", p) for n, p in donors.items()]:
        check_input(path, f"file given as {what}")
    if args.tokens < 1:
        raise FleError(f"--tokens must be at least 1, got {args.tokens}")
    if args.ctx < 1:
        raise FleError(f"--ctx must be at least 1, got {args.ctx}")
    if args.work_dir is not None and not os.path.isdir(args.work_dir):
        raise FleError(f"--work-dir {args.work_dir}: no such folder")


@cli_entry("fle-sensitivity")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    donors = parse_donors(args.donor)
    if not donors and args.base is None:
        raise FleError("no candidates: give at least one --donor NAME=FILE (or a --base to measure)")
    declare_inputs(args.ref, args.text, args.base, *donors.values())
    _check_inputs(args, donors)
    check_outputs([args.output], args.force)
    check_device(args.device)
    table = measure(args.ref, donors, args.text, n_tokens=args.tokens, ctx=args.ctx, base=args.base,
                    base_name=args.base_name, device=args.device, work_dir=args.work_dir, progress=True)
    write_json_atomic(args.output, table, args.force)
    names = list(table["layers"][0]["candidates"])
    print(f"{'layer':>5}  " + "  ".join(f"{n:>14}" for n in names))
    for row in table["layers"]:
        print(f"{row['layer']:>5}  " + "  ".join(f"{row['candidates'][n]['error']:>14.6g}" for n in names))
    print(f"wrote {args.output}: {len(table['layers'])} layers, {len(names)} candidates, "
          f"fixed_bytes {table['fixed_bytes']:,}")
    return 0


if __name__ == "__main__":
    exit_main(main)
