"""``fle-plot``: the measurement plots as PNG files (matplotlib, Agg)."""
from __future__ import annotations

import argparse
import os
import sys

from ..errors import FleError
from .common import check_outputs, cli_entry, declare_inputs, exit_main

_KINDS = {
    "size-kld": "file size against mean KLD over many files, FLE's and the public ones, speed as colour",
    "heatmap": "a sensitivity table's predicted error per layer and source, a selection marked",
    "predicted": "several built files' predicted summed error against measured KLD, with the rank correlation",
    "forest": "an fle-bracket result's speed changes with their 95 % intervals, per category",
    "hit-rate": "the engine's expert cache hit rate over decode steps (fle-engine generate --stats-json)",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fle-plot", description="Draw FLE's measurement plots as PNG files: "
                                + "; ".join(f"{k}: {v}" for k, v in _KINDS.items()) + ".")
    sub = p.add_subparsers(dest="kind", required=True, metavar="KIND")
    s = sub.add_parser("size-kld", help=_KINDS["size-kld"])
    s.add_argument("--point", nargs=3, action="append", default=[], metavar=("NAME", "MODEL|SIZE", "KLD"),
                   help="an FLE file: name, its GGUF (or a size like 12.3GB) and its KLD result "
                        "(fle-kld / llama-perplexity output or JSON summary)")
    s.add_argument("--public", nargs=3, action="append", default=[], metavar=("NAME", "MODEL|SIZE", "KLD"),
                   help="a public file, drawn with its own marker")
    s.add_argument("--speed", nargs=2, action="append", default=[], metavar=("NAME", "T/S"),
                   help="decode speed of point NAME; colours the points when every point has one")
    s.add_argument("--title", default="")
    h = sub.add_parser("heatmap", help=_KINDS["heatmap"])
    h.add_argument("table", help="sensitivity table (fle-sensitivity -o)")
    h.add_argument("--selection", help="selection to mark (fle-select -o)")
    r = sub.add_parser("predicted", help=_KINDS["predicted"])
    r.add_argument("--file", nargs=3, action="append", default=[], metavar=("NAME", "SEL.json", "KLD"),
                   help="a built file: name, the selection it was spliced from (fle-select -o) and its KLD result")
    f = sub.add_parser("forest", help=_KINDS["forest"])
    f.add_argument("bracket", help="fle-bracket --json result")
    f.add_argument("--no-categories", action="store_true", help="only each candidate's overall interval")
    t = sub.add_parser("hit-rate", help=_KINDS["hit-rate"])
    t.add_argument("stats", help="engine statistics (fle-engine generate --stats-json)")
    t.add_argument("--window", type=int, default=64, help="steps of the moving mean (default 64)")
    for q in (s, h, r, f, t):
        q.add_argument("-o", "--output", required=True, help="PNG file to write")
        q.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    return p


def _size(text: str, name: str) -> int:
    """A size (``88.9GB``) or, when it is none, a GGUF model whose bytes are counted."""
    from ..measure.plot import file_size
    from ..units import parse_size

    try:
        return parse_size(text, f"size of {name}")
    except FleError:
        return file_size(text)


@cli_entry("fle-plot")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from ..measure import plot

    if args.kind == "size-kld":
        from ..measure.accept import read_kld_result

        rows = [(r, False) for r in args.point] + [(r, True) for r in args.public]
        names = [r[0] for r, _ in rows]
        if len(set(names)) != len(names):
            raise FleError("point names must differ; give each --point / --public its own NAME")
        speeds = {}
        for n, v in args.speed:
            if n not in names:
                raise FleError(f"--speed {n!r}: no point of that name")
            try:
                speeds[n] = float(v)
            except ValueError:
                raise FleError(f"--speed {n} {v!r}: not a number of tokens per second") from None
        for (n, m, k), _ in rows:
            declare_inputs(k, m if os.path.lexists(m) else None)
        check_outputs([args.output], args.force)
        pts = []
        for (n, m, k), public in rows:
            r = read_kld_result(k)
            pts.append(plot.SizePoint(n, _size(m, n), r.kld, r.kld_se, public, speeds.get(n)))
        what, _ = plot.size_kld(pts, args.output, force=args.force, title=args.title)
    elif args.kind == "heatmap":
        from ..select import load_selection, load_table

        declare_inputs(args.table, args.selection)
        check_outputs([args.output], args.force)
        table = load_table(args.table)
        sel = load_selection(args.selection) if args.selection else None
        what, _ = plot.sensitivity_heatmap(table, args.output, sel, force=args.force)
    elif args.kind == "predicted":
        from ..measure.accept import read_kld_result
        from ..select import load_selection

        names = [n for n, _, _ in args.file]
        if len(set(names)) != len(names):
            raise FleError("file names must differ; give each --file its own NAME")
        for _, sel, k in args.file:
            declare_inputs(sel, k)
        check_outputs([args.output], args.force)
        pred, kl, se = [], [], []
        for _, sel, k in args.file:
            pred.append(load_selection(sel).predicted_error)
            res = read_kld_result(k)
            kl.append(res.kld)
            se.append(res.kld_se)
        what, _, _ = plot.predicted_vs_measured(names, pred, kl, se, args.output, force=args.force)
    elif args.kind == "hit-rate":
        from ..textio import read_json_file

        declare_inputs(args.stats)
        check_outputs([args.output], args.force)
        if args.window < 1:
            raise FleError(f"--window must be at least 1, got {args.window}")
        obj, _ = read_json_file(args.stats, "engine statistics")
        try:
            what, _ = plot.hit_rate(obj, args.output, window=args.window, force=args.force)
        except FleError as e:
            raise FleError(f"{args.stats}: {e}") from None
    else:
        from ..measure.bracket import read_bracket

        declare_inputs(args.bracket)
        check_outputs([args.output], args.force)
        what, _ = plot.forest(read_bracket(args.bracket), args.output, force=args.force,
                              categories=not args.no_categories)
    print(f"wrote {what}")
    return 0


if __name__ == "__main__":
    exit_main(main)
