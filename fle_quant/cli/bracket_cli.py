"""``fle-bracket``: a paired speed bracket against OpenAI-compatible servers;
``fle-bracket table`` a table over many brackets."""
from __future__ import annotations

import argparse
import sys

from ..errors import FleError
from .common import check_outputs, cli_entry, declare_inputs, exit_main


def add_bracket_options(p: argparse.ArgumentParser) -> None:
    """The prompts, sampling and analysis options of a bracket (fle-bracket and fle-compare)."""
    p.add_argument("--prompts", metavar="FILE", help="JSONL prompts {id, category, prompt} (default: the "
                                                     "standard set of 24: code 9, math 6, physics 3, prose 6)")
    p.add_argument("--only", metavar="IDS", help="comma-separated prompt ids or categories to run")
    p.add_argument("--limit", type=int, metavar="N", help="run only the first N prompts")
    p.add_argument("--model", default="", help="model name sent with each request (default: none)")
    p.add_argument("--max-tokens", type=int, default=512, metavar="N", help="tokens per reply (default: 512)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1, help="sampling seed of every request (default: 1)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="seconds per request (default: 600)")
    p.add_argument("--allow-length", action="store_true",
                   help="do not flag an arm whose replies stop at --max-tokens")
    p.add_argument("--n-boot", type=int, default=10000, metavar="N", help="bootstrap resamples (default: 10000)")
    p.add_argument("--boot-seed", type=int, default=0, metavar="S", help="bootstrap seed (default: 0)")


def prompts_and_body(args) -> tuple[list, dict]:
    """The prompts a bracket runs and the request body every arm gets, from
    :func:`add_bracket_options`' arguments (checked)."""
    from ..measure.bracket import load_prompts

    for opt, v, lo in (("--max-tokens", args.max_tokens, 1), ("--n-boot", args.n_boot, 100)):
        if v < lo:
            raise FleError(f"{opt} must be at least {lo}, got {v}")
    if args.prompts:
        declare_inputs(args.prompts)
    prompts = load_prompts(args.prompts)
    if args.only:
        keys = {k.strip() for k in args.only.split(",") if k.strip()}
        prompts = [p for p in prompts if p.id in keys or p.category in keys]
        if not prompts:
            raise FleError(f"--only {args.only!r}: no prompt has one of these ids or categories")
    if args.limit is not None:
        if args.limit < 2:
            raise FleError(f"--limit must be at least 2 (a paired interval needs 2 prompts), got {args.limit}")
        prompts = prompts[:args.limit]
    body = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "min_p": args.min_p, "seed": args.seed}
    if args.model:
        body["model"] = args.model
    return prompts, body


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fle-bracket",
        description="Measure decode speed on OpenAI-compatible servers (fle-engine serve, llama-server) in a "
                    "paired bracket: the reference arm (the first --arm), each candidate arm, then the reference "
                    "again, with the same prompts and sampling. Prints each candidate's change with a paired "
                    "bootstrap 95 %% interval, the reference's drift (valid within 5 %%), invalid arms and a "
                    "per-category breakdown.",
        epilog="Run 'fle-bracket table --help' for a table over many bracket results.")
    p.add_argument("--arm", nargs=2, action="append", default=[], metavar=("NAME", "URL"), required=True,
                   help="an arm: its name and base URL (http://HOST:PORT); the first is the reference")
    p.add_argument("--start", nargs=2, action="append", default=[], metavar=("NAME", "COMMAND"),
                   help="shell command that starts arm NAME's server before each of its passes")
    p.add_argument("--stop", nargs=2, action="append", default=[], metavar=("NAME", "COMMAND"),
                   help="shell command that stops it after each pass (default: SIGTERM to what --start started)")
    p.add_argument("--start-timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait for a started server to answer (default: 600)")
    add_bracket_options(p)
    p.add_argument("--json", metavar="FILE", help="write the requests, settings and results as JSON")
    p.add_argument("--markdown", metavar="FILE", help="write the markdown table")
    p.add_argument("--force", action="store_true", help="replace output files that exist")
    return p


def _table_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fle-bracket table",
                                description="One markdown table over many fle-bracket --json results, a row per "
                                            "candidate: speeds, change, interval, drift and validity.")
    p.add_argument("results", nargs="+", help="fle-bracket --json files")
    p.add_argument("-o", "--output", help="write the table here as well as printing it")
    p.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    return p


def _table(argv: list[str]) -> int:
    from ..measure.bracket import read_bracket, summary_table
    from ..textio import write_text_atomic

    args = _table_parser().parse_args(argv)
    declare_inputs(*args.results)
    check_outputs([args.output], args.force)
    from pathlib import Path

    table = summary_table([(Path(r).stem, read_bracket(r)) for r in args.results])
    print(table)
    if args.output:
        write_text_atomic(args.output, table + "\n", args.force)
    return 0


@cli_entry("fle-bracket")
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "table":
        return _table(argv[1:])
    args = _run_parser().parse_args(argv)
    from ..measure.bracket import analyse, build_result, markdown, run_bracket
    from ..measure.client import ServerArm, normalize_url
    from ..textio import write_json_atomic, write_text_atomic

    names = [n for n, _ in args.arm]
    if len(names) < 2:
        raise FleError("give at least two --arm NAME URL: the reference first, then the candidates")
    if len(set(names)) != len(names):
        raise FleError("arm names must differ; each --arm needs its own NAME")
    for opt, pairs in (("--start", args.start), ("--stop", args.stop)):
        for n, _ in pairs:
            if n not in names:
                raise FleError(f"{opt} {n!r}: no --arm of that name (arms: {', '.join(names)})")
    prompts, body = prompts_and_body(args)
    check_outputs([args.json, args.markdown], args.force)
    start, stop = dict(args.start), dict(args.stop)
    arms = [ServerArm(n, normalize_url(u, f"--arm {n}"), start.get(n), stop.get(n), args.start_timeout)
            for n, u in args.arm]
    settings = {**body, "arms": [{"name": a.name, "url": a.url, "start": a.start, "stop": a.stop} for a in arms],
                "allow_length": args.allow_length, "n_boot": args.n_boot, "boot_seed": args.boot_seed,
                "timeout": args.timeout}
    passes = run_bracket(arms, prompts, body, timeout=args.timeout, log=lambda s: print(s, flush=True))
    try:
        analysis = analyse(passes, allow_length=args.allow_length, n_boot=args.n_boot, seed=args.boot_seed)
    except FleError as e:
        # the requests are kept: a long run is not lost to an arm that failed
        result = build_result(passes, settings, prompts, None)
        result["error"] = str(e)
        print(f"fle-bracket: no analysis: {e}", file=sys.stderr)
        if args.json:
            write_json_atomic(args.json, result, args.force)
            print(f"wrote {args.json} (requests only)")
        return 1
    result = build_result(passes, settings, prompts, analysis)
    table = markdown(result)
    print()
    print(table)
    if args.json:
        write_json_atomic(args.json, result, args.force)
        print(f"wrote {args.json}")
    if args.markdown:
        write_text_atomic(args.markdown, table + "\n", args.force)
        print(f"wrote {args.markdown}")
    return 0 if analysis["valid"] else 1


if __name__ == "__main__":
    exit_main(main)
