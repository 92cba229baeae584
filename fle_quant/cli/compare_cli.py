"""``fle-compare``: several GGUF files measured on one chain, KLD against one
base model on each text and decode speed in paired brackets at one cache
budget, written as a table, JSON and a plot (see
:mod:`fle_quant.measure.compare`)."""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

from ..errors import FleError
from .bracket_cli import add_bracket_options, prompts_and_body
from .common import check_device, check_outputs, cli_entry, declare_inputs, exit_main

_SHARD = re.compile(r"-\d{5}-of-\d{5}$")


def _parser() -> argparse.ArgumentParser:
    from ..measure.compare import DEFAULT_SERVER

    p = argparse.ArgumentParser(
        prog="fle-compare",
        description="Compare GGUF files of one model at an equal expert cache budget: for every file the mean "
                    "KLD and top-1 agreement against a base model on each text (FLE's forward pass, "
                    "llama-perplexity's files), and its decode speed in paired brackets against the first file "
                    "(reference, candidates, reference again), every file served with the same --budget. Writes "
                    "DIR/compare.md (the table), DIR/compare.json, DIR/compare.png (size against KLD and speed), "
                    "each bracket's fle-bracket JSON and each KLD result as fle-kld prints it (for fle-accept).",
        epilog="Example: fle-compare FLE-IQ3_M.gguf UD-IQ3_XXS.gguf --reference BF16.gguf --text E.txt --text "
               "W.txt --budget 17035MiB --out cmp. With --base E=E.kld the base log-probabilities come from "
               "'fle-kld base' or 'llama-perplexity --kl-divergence-base' instead of --reference.")
    p.add_argument("files", nargs="+", metavar="[NAME=]FILE",
                   help="GGUF files (any shard of a split file), the speed reference first; NAME defaults to the "
                        "file name")
    p.add_argument("--reference", metavar="MODEL", help="base model of the KLD (e.g. the BF16 file); its "
                                                        "log-probabilities on each --text are written to DIR")
    p.add_argument("--text", action="append", default=[], metavar="[NAME=]FILE",
                   help="UTF-8 text for the KLD (repeat for several); NAME defaults to the file's stem")
    p.add_argument("--base", action="append", default=[], metavar="[NAME=]FILE.kld",
                   help="base log-probabilities of a text, instead of --reference and --text")
    p.add_argument("--budget", required=True, metavar="SIZE",
                   help="expert cache budget of every server, e.g. 17035MiB or 17GiB")
    p.add_argument("--out", "-o", default="compare", metavar="DIR", help="output folder (default: compare)")
    p.add_argument("--server", default=DEFAULT_SERVER, metavar="TEMPLATE",
                   help="shell command that serves one file, with fields {model}, {port}, {budget} and {python} "
                        f"(default: '{DEFAULT_SERVER}'); add the engine's options here, e.g. -c 8192 --mtp, or "
                        "give llama-server's command")
    p.add_argument("--group", type=int, default=3, metavar="N",
                   help="candidates per bracket, each bracket against the first file (default: 3)")
    p.add_argument("--start-timeout", type=float, default=900.0, metavar="S",
                   help="seconds to wait for a server to answer after its start (default: 900)")
    p.add_argument("--no-kld", action="store_true", help="measure speed only")
    p.add_argument("--no-speed", action="store_true", help="measure KLD only")
    p.add_argument("-c", "--ctx-size", type=int, default=512, dest="n_ctx", metavar="N",
                   help="KLD tokens per chunk with --reference (default: 512, as llama-perplexity)")
    p.add_argument("--chunks", type=int, default=None, metavar="N", help="KLD: at most this many chunks per text")
    p.add_argument("--device", default="cpu", help="torch device of the KLD forward passes (default: cpu)")
    p.add_argument("-b", "--batch-size", type=int, default=512, dest="n_batch", metavar="N",
                   help="KLD tokens per forward call (default: 512)")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N", help="KLD: CPU threads for torch")
    add_bracket_options(p)
    p.add_argument("--force", action="store_true", help="replace output files that exist")
    return p


def _name_of(path: str) -> str:
    stem = Path(path).name
    stem = stem[:-5] if stem.endswith(".gguf") else stem
    return _SHARD.sub("", stem)


def _named(args: list[str], what: str, default) -> list[tuple[str, str]]:
    from ..measure.compare import parse_named

    out = []
    for a in args:
        name, path = parse_named(a, what)
        out.append((name or default(path), path))
    names = [n for n, _ in out]
    for n in names:
        if names.count(n) > 1:
            raise FleError(f"{what}: the name {n!r} is given twice; name them NAME=FILE")
    return out


def _print(line: str) -> None:
    print(line, flush=True)


@cli_entry("fle-compare")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from ..measure import compare
    from ..measure.plot import comparison, file_size
    from ..textio import write_json_atomic, write_text_atomic
    from ..units import parse_size

    files = _named(args.files, "file", _name_of)
    texts = _named(args.text, "--text", lambda p: Path(p).stem)
    bases = _named(args.base, "--base", lambda p: Path(p).stem)
    if args.no_kld and args.no_speed:
        raise FleError("--no-kld and --no-speed leave nothing to measure; give at most one")
    if not args.no_kld:
        if bases and (args.reference or texts):
            raise FleError("give either --reference with --text, or --base; not both")
        if not bases and not (args.reference and texts):
            raise FleError("the KLD needs a base: --reference MODEL with one or more --text FILE, or --base "
                           "FILE.kld (or --no-kld)")
        if args.n_ctx < 4:
            raise FleError(f"-c {args.n_ctx} is too small; use -c 4 or more (llama.cpp uses 512 by default)")
        if args.chunks is not None and args.chunks < 1:
            raise FleError(f"--chunks must be at least 1, got {args.chunks}")
        if args.n_batch < 1:
            raise FleError(f"--batch-size must be at least 1, got {args.n_batch}")
    if not args.no_speed and len(files) < 2:
        raise FleError("a speed comparison needs two or more files (the reference first); or give --no-speed")
    budget = parse_size(args.budget, "--budget")
    if budget < 1:
        raise FleError("--budget must be a size above zero; every file gets this many bytes of expert cache")
    compare.check_server_template(args.server)
    group = compare.groups(len(files) - 1, args.group)
    declare_inputs(*(p for _, p in files), args.reference, *(p for _, p in texts), *(p for _, p in bases))
    from ..files import check_input

    for what, items in (("GGUF model", files + ([("", args.reference)] if args.reference else [])),
                        ("text file", texts), ("KLD base file", bases)):
        for _, p in items:
            check_input(p, what)
    prompts, body = prompts_and_body(args) if not args.no_speed else ([], {})

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise FleError(f"{out}: exists and is not a folder; give --out a folder for the results")
    text_names = [] if args.no_kld else [n for n, _ in texts] or [n for n, _ in bases]
    base_out = {n: out / f"base.{n}.kld" for n, _ in texts}
    kld_out = {(f, t): out / f"kld.{f}.{t}.txt" for f, _ in files for t in text_names} if not args.no_kld else {}
    bracket_out = [out / f"bracket-B{k}.json" for k in range(1, len(group) + 1)] if not args.no_speed else []
    finals = [out / "compare.json", out / "compare.md", out / "compare.png"]
    out.mkdir(parents=True, exist_ok=True)
    check_outputs([*base_out.values(), *kld_out.values(), *bracket_out, *finals], args.force)

    entries = [{"name": n, "path": p, "size_bytes": file_size(p)} for n, p in files]
    klds: dict[str, dict[str, dict]] = {}
    if not args.no_kld:
        klds = _measure_kld(args, files, texts, bases, base_out, kld_out)
    brackets = [] if args.no_speed else _measure_speed(args, files, group, prompts, body, bracket_out)

    result = {"format": compare.FORMAT, "texts": text_names, "rows": compare.rows(entries, klds, brackets),
              "settings": {"budget": args.budget, "budget_bytes": budget, "server": args.server,
                           "kld_base": args.reference or ", ".join(p for _, p in bases), "n_ctx": args.n_ctx,
                           "n_prompts": len(prompts), "group": args.group, **body},
              "brackets": brackets}
    table = compare.markdown(result)
    print()
    print(table)
    write_json_atomic(finals[0], result, args.force)
    write_text_atomic(finals[1], table + "\n", args.force)
    what, _ = comparison(result, str(finals[2]), force=args.force)
    print(f"wrote {finals[0]}, {finals[1]}")
    print(what)
    valid = all(b.get("analysis") and b["analysis"]["valid"] for b in brackets)
    return 0 if valid else 1


def _measure_kld(args, files, texts, bases, base_out, kld_out) -> dict[str, dict[str, dict]]:
    check_device(args.device)
    try:
        from fle_engine import kld_run, load
    except ImportError as e:
        raise FleError(f"the KLD forward pass needs FLE's engine ({e}); install it with: pip install "
                       "'fle[engine]'") from None
    from ..kld import format_summary, read_header
    from ..textio import write_text_atomic

    kld_run.set_threads(args.threads)
    base_files = dict(bases)
    for name, _ in bases:
        read_header(base_files[name])  # a bad base file is refused before any model is loaded
    if texts:
        ref = load(args.reference, device=args.device)
        for name, path in texts:
            _print(f"base log-probabilities of {args.reference} on {name} -> {base_out[name]}")
            kld_run.write_base(ref, kld_run.read_text(path), base_out[name], args.n_ctx, args.chunks,
                               device=args.device, n_batch=args.n_batch, force=args.force)
            base_files[name] = str(base_out[name])
        del ref
    klds: dict[str, dict[str, dict]] = {}
    for fname, path in files:
        model = load(path, device=args.device)
        for tname, base in base_files.items():
            s = kld_run.compare_to_base(model, base, device=args.device, n_batch=args.n_batch)
            klds.setdefault(fname, {})[tname] = dataclasses.asdict(s)
            write_text_atomic(kld_out[(fname, tname)], format_summary(s) + "\n", args.force)
            _print(f"KLD {fname} on {tname}: {s.kld_mean:.6f} ± {s.kld_unc:.6f}, same top "
                   f"{100 * s.same_top:.2f} ± {100 * s.same_top_unc:.2f} %")
        del model
    return klds


def _measure_speed(args, files, group, prompts, body, bracket_out) -> list[dict]:
    from ..measure import compare
    from ..measure.bracket import analyse, build_result, markdown, run_bracket
    from ..measure.client import ServerArm
    from ..textio import write_json_atomic

    def arm(k: int) -> ServerArm:
        name, path = files[k]
        port = compare.free_port()
        return ServerArm(name, f"http://127.0.0.1:{port}", compare.server_command(args.server, path, port,
                                                                                   args.budget),
                         None, args.start_timeout)

    results = []
    for k, members in enumerate(group, 1):
        arms = [arm(0)] + [arm(i) for i in members]
        _print(f"bracket B{k}: {', '.join(a.name for a in arms)} at a cache budget of {args.budget}")
        settings = {**body, "arms": [{"name": a.name, "url": a.url, "start": a.start, "stop": None} for a in arms],
                    "allow_length": args.allow_length, "n_boot": args.n_boot, "boot_seed": args.boot_seed,
                    "timeout": args.timeout, "budget": args.budget}
        passes = run_bracket(arms, prompts, body, timeout=args.timeout, log=_print)
        try:
            analysis = analyse(passes, allow_length=args.allow_length, n_boot=args.n_boot, seed=args.boot_seed)
        except FleError as e:
            # the requests are kept; the table says why this bracket has no numbers
            r = build_result(passes, settings, prompts, None)
            r["error"] = str(e)
            _print(f"bracket B{k}: no analysis: {e}")
        else:
            r = build_result(passes, settings, prompts, analysis)
            _print(markdown(r))
        write_json_atomic(bracket_out[k - 1], r, args.force)
        results.append(r)
    return results


if __name__ == "__main__":
    exit_main(main)
