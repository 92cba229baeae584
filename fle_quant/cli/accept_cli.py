"""``fle-accept``: the KLD acceptance rule over several texts."""
from __future__ import annotations

import argparse
import sys

from ..errors import FleError
from .common import check_outputs, cli_entry, declare_inputs, exit_main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fle-accept",
        description="Accept or refuse a candidate GGUF against a reference by their KL divergence from the "
                    "same base model: on every text the candidate's mean KLD is at most two combined standard "
                    "errors above the reference's and its top-1 agreement at most 0.5 points below, and a "
                    "held-out text confirms. Each RESULT is the saved output of 'fle-kld MODEL --base BASE.kld' "
                    "or 'llama-perplexity --kl-divergence', or a JSON summary with kld_mean, kld_unc, same_top, "
                    "same_top_unc. Exit status: 0 accepted, 1 not accepted, 2 bad input.",
        epilog="Run 'fle-accept texts --help' to rebuild the evaluation texts.")
    p.add_argument("--text", nargs=3, action="append", default=[], metavar=("NAME", "CANDIDATE", "REFERENCE"),
                   help="one text: its name and the candidate's and the reference's KLD results (repeatable)")
    p.add_argument("--held-out", nargs=3, action="append", default=[], required=True,
                   metavar=("NAME", "CANDIDATE", "REFERENCE"),
                   help="a held-out text that must confirm the verdict (repeatable, at least one)")
    p.add_argument("--json", metavar="FILE", help="also write the numbers and the verdict as JSON")
    p.add_argument("--force", action="store_true", help="replace the --json file if it exists")
    return p


def _texts_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fle-accept texts",
        description="Rebuild the evaluation texts of a manifest (default: the report's public texts E, W and K): "
                    "the Python language reference from the running Python's pydoc_data (offline), and every "
                    "text with a URL fetched and checked against its SHA-256 before anything is written. Texts "
                    "whose hash the manifest does not know (unpinned) are fetched only with --record FILE, which "
                    "writes the manifest with the hashes it saw; rebuilds from FILE are checked against them.",
        epilog="Manifest: JSON {\"format\": \"fle.texts/1\", \"texts\": [{name, url or builtin, sha256, "
               "part_of, ...}]} (docs/measure.md); texts with the same part_of are also written joined as PART.txt.")
    p.add_argument("-o", "--output-dir", required=True, metavar="DIR", help="folder to write NAME.txt files into")
    p.add_argument("--manifest", default="report", metavar="FILE|report",
                   help="texts to rebuild (default: report, the project's manifest of the report's texts)")
    p.add_argument("--offline", action="store_true", help="write the built-in texts only; fetch nothing")
    p.add_argument("--record", metavar="FILE", help="fetch unpinned texts too and write the manifest with every "
                                                    "text's SHA-256 to FILE")
    p.add_argument("--force", action="store_true", help="replace texts that exist")
    return p


@cli_entry("fle-accept")
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "texts":
        from ..measure.texts import REPORT_MANIFEST, build

        targs = _texts_parser().parse_args(argv[1:])
        if targs.manifest != REPORT_MANIFEST:
            declare_inputs(targs.manifest)
        check_outputs([targs.record], targs.force)
        build(targs.output_dir, targs.manifest, targs.force, offline=targs.offline, record=targs.record)
        return 0
    args = _parser().parse_args(argv)
    from ..measure.accept import format_table, judge, judge_text, read_kld_result
    from ..textio import write_json_atomic

    rows = [(t, False) for t in args.text] + [(t, True) for t in args.held_out]
    names = [t[0] for t, _ in rows]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise FleError(f"text name {dup[0]!r} is given twice; give each text once")
    for (_, c, r), _ in rows:
        declare_inputs(c, r)
    check_outputs([args.json], args.force)
    verdicts = [judge_text(name, read_kld_result(c), read_kld_result(r), held) for (name, c, r), held in rows]
    ok, why = judge(verdicts)
    print(format_table(verdicts))
    print()
    print(why)
    if args.json:
        write_json_atomic(args.json, {"accepted": ok, "verdict": why, "texts": [v.as_dict() for v in verdicts],
                                      "rule": {"kld_sigmas": 2.0, "top1_points": 0.5}}, args.force)
        print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    exit_main(main)
