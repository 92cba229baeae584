"""``fle-probe``: a knowledge probe against OpenAI-compatible servers;
``fle-probe compare`` between two saved results."""
from __future__ import annotations

import argparse
import sys

from ..errors import FleError
from .common import check_outputs, cli_entry, declare_inputs, exit_main


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fle-probe",
        description="Ask short factual questions (JSONL in MKQA's layout; default: the project's small file) of "
                    "one or two OpenAI-compatible servers with an answer-only prompt that allows 'I don't know', "
                    "and count the answers that match an alias (lower-cased, accents and punctuation removed), "
                    "abstentions apart. Sampling: temperature 1.0, top-p 0.95, top-k 20, min-p 0, thinking off, "
                    "256 tokens, one seed per question. With two --arm, the second is compared with the first "
                    "(paired bootstrap 95 %% interval of the accuracy difference, exact McNemar test).",
        epilog="Run 'fle-probe compare --help' to compare two saved results.")
    p.add_argument("--arm", nargs=2, action="append", default=[], required=True, metavar=("NAME", "URL"),
                   help="a server: its name and base URL (once or twice)")
    p.add_argument("--questions", metavar="FILE|hf://datasets/OWNER/NAME[@REV]/PATH",
                   help="JSONL question file in MKQA's layout, plain or .gz (MKQA's mkqa.jsonl.gz), a path or a "
                        "file of a Hub dataset (downloaded with huggingface_hub into its cache; HF_HUB_OFFLINE=1 "
                        "uses the cached copy)")
    p.add_argument("--lang", default="en", help="language of the questions and answers (default: en)")
    p.add_argument("--limit", type=int, metavar="N", help="ask only the first N questions")
    p.add_argument("--model", default="", help="model name sent with each request (default: none)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S", help="seconds per request (default: 300)")
    p.add_argument("--n-boot", type=int, default=10000, metavar="N", help="bootstrap resamples (default: 10000)")
    p.add_argument("--json", metavar="PREFIX", help="write each arm's result to PREFIX.NAME.json")
    p.add_argument("--force", action="store_true", help="replace output files that exist")
    return p


def _compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fle-probe compare",
                                description="Compare two fle-probe results question by question: B against A.")
    p.add_argument("a", help="fle-probe result JSON (the reference)")
    p.add_argument("b", help="fle-probe result JSON (the candidate)")
    p.add_argument("--n-boot", type=int, default=10000, metavar="N")
    return p


@cli_entry("fle-probe")
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from ..measure import probe

    if argv and argv[0] == "compare":
        args = _compare_parser().parse_args(argv[1:])
        declare_inputs(args.a, args.b)
        a, b = probe.read_result(args.a), probe.read_result(args.b)
        for name, r in (("A", a), ("B", b)):
            print(probe.format_score(r.get("name") or name, probe.score(r["records"])))
        print(probe.format_compare(probe.compare(a, b, n_boot=args.n_boot)))
        return 0
    args = _run_parser().parse_args(argv)
    from ..measure.client import normalize_url
    from ..textio import write_json_atomic

    if len(args.arm) > 2:
        raise FleError("give one or two --arm; compare more results pairwise with 'fle-probe compare'")
    if len(args.arm) == 2 and args.arm[0][0] == args.arm[1][0]:
        raise FleError("arm names must differ; each --arm needs its own NAME")
    if args.n_boot < 100:
        raise FleError(f"--n-boot must be at least 100, got {args.n_boot}")
    source, local = args.questions or "standard", args.questions
    if args.questions and args.questions.startswith("hf://"):
        probe.parse_hub_spec(args.questions)  # a malformed name is refused before anything else
    elif args.questions:
        declare_inputs(args.questions)
    outs = [f"{args.json}.{n}.json" for n, _ in args.arm] if args.json else []
    check_outputs(outs, args.force)
    if args.questions and args.questions.startswith("hf://"):
        local, source = probe.download_questions(args.questions)
        print(f"questions: {source} ({local})", flush=True)
    qs = probe.load_questions(local, args.lang)
    if args.limit is not None:
        if args.limit < 1:
            raise FleError(f"--limit must be at least 1, got {args.limit}")
        qs = qs[:args.limit]
    results = []
    for name, url in args.arm:
        base = normalize_url(url, f"--arm {name}")
        print(f"{name} at {base}: {len(qs)} questions ({args.lang})", flush=True)
        recs = probe.run_probe(base, qs, model=args.model, timeout=args.timeout,
                               log=lambda s: print(s, flush=True))
        results.append(probe.result(name, base, args.lang, source, recs))
    print()
    for r in results:
        print(probe.format_score(r["name"], r["score"]))
    if len(results) == 2:
        print(probe.format_compare(probe.compare(results[0], results[1], n_boot=args.n_boot)))
    for out, r in zip(outs, results):
        write_json_atomic(out, r, args.force)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    exit_main(main)
