"""``fle-reap``: expert pruning of MoE models.

Subcommands:

- ``score``: measure per-expert scores (REAP saliency, mean activation
  norm or routing frequency) over a calibration text with FLE's reference
  forward pass and write the score table (see :mod:`fle_quant.scoring`);
- ``prune``: remove the lowest-scored experts of every MoE layer, given a
  score table (format ``fle.scores/1``, see :mod:`fle_quant.prune`).

New subcommands register in ``_COMMANDS``.
"""
from __future__ import annotations

import argparse

from ..errors import FleError
from ..prune import prune
from ..units import format_size, parse_size
from .common import check_device, check_outputs, cli_entry, declare_inputs, exit_main

_PRUNE_EPILOG = """\
The score table (format fle.scores/1) holds, per MoE layer, one score per
expert, higher = more important; an MTP block inside the model is scored under
its block index. Every MoE layer keeps the same number of experts (the file has
one expert_count); on equal scores the lower expert index is kept. Expert
slices, router rows and exp_probs_b entries of the kept experts are copied
byte for byte in their original order; every other tensor and all metadata are
copied unchanged, except expert_count and the fle.reap.* provenance keys
(fle.reap.kept.N lists the kept experts' original indices of layer N).

examples:
  fle-reap prune model.gguf --scores scores.json --keep 448 -o model-reap448.gguf
  fle-reap prune trunk.gguf --scores scores.json --keep 448 -o out.gguf \\
      --mtp-head trunk-mtp.gguf --mtp-out out-mtp.gguf
      also prunes a separate MTP-head file (its block's scores from the same
      table, or from --mtp-scores)

Exit status 2 with a one-line message for bad input; outputs are written under
temporary names and renamed only when complete.
"""


def _add_prune(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser(
        "prune",
        help="remove the lowest-scored experts of every MoE layer",
        description="Remove the lowest-scored routed experts of every MoE layer, keeping --keep\n"
                    "experts per layer, and write the pruned model.",
        epilog=_PRUNE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL.gguf", help="the model (any shard of a split model)")
    p.add_argument("--scores", required=True, metavar="SCORES.json",
                   help="expert score table (format fle.scores/1)")
    p.add_argument("--keep", required=True, type=int, metavar="K",
                   help="experts to keep per layer: at least expert_used_count, below expert_count")
    p.add_argument("-o", "--output", required=True, metavar="OUT.gguf",
                   help="where to write the pruned model (shards OUT-0000k-of-0000N.gguf when split)")
    p.add_argument("--mtp-head", metavar="MTP.gguf",
                   help="a separate MTP-head file to prune to the same expert count")
    p.add_argument("--mtp-out", metavar="OUT-mtp.gguf", help="where to write the pruned MTP head")
    p.add_argument("--mtp-scores", metavar="SCORES.json",
                   help="the MTP head's own score table (default: its block in --scores)")
    p.add_argument("--split-max-size", metavar="SIZE",
                   help="split the output into shards of at most SIZE of tensor data (e.g. 48G)")
    p.add_argument("--split-max-tensors", type=int, metavar="N", help="split the output every N tensors")
    p.add_argument("--force", action="store_true", help="replace outputs that exist")
    p.set_defaults(run=_run_prune)


def _run_prune(args: argparse.Namespace) -> int:
    if args.split_max_tensors is not None and args.split_max_tensors <= 0:
        raise FleError(f"--split-max-tensors must be positive, got {args.split_max_tensors}")
    split = parse_size(args.split_max_size, "--split-max-size") if args.split_max_size is not None else None
    if args.mtp_out is not None and args.mtp_head is None:
        raise FleError("--mtp-out needs --mtp-head (the MTP-head file to prune)")
    declare_inputs(args.model, args.scores, args.mtp_head, args.mtp_scores)
    check_outputs([args.output, args.mtp_out], args.force)
    result = prune(args.model, args.scores, args.keep, args.output, mtp_head=args.mtp_head, mtp_out=args.mtp_out,
                   mtp_scores=args.mtp_scores, split_max_size=split, split_max_tensors=args.split_max_tensors,
                   force=args.force)
    parts = [(result.trunk, result.trunk_written)]
    if result.head is not None:
        parts.append((result.head, result.head_written))
    for pp, written in parts:
        print(f"{pp.path}: {pp.n_expert} -> {pp.keep} experts in {len(pp.layers)} MoE layers")
        for lp in pp.layers.values():
            s = lp.scores
            removed = s[lp.removed]
            line = (f"  layer {lp.layer:>3}: removed {len(lp.removed):>4}  highest removed score "
                    f"{removed.max():.6g}  lowest kept {s[lp.kept].min():.6g}")
            if s.min() >= 0 and s.sum() > 0:  # a share only means something for non-negative scores
                line += f"  removed share of the score {removed.sum() / s.sum():.3%}"
            print(line)
        for p in written.paths:
            print(f"wrote {p} ({format_size(p.stat().st_size)})")
    return 0


_SCORE_EPILOG = """\
Methods, per MoE layer and expert j, over the tokens whose top-k includes j
(f_j(x): the expert's own output; g_j(x): the router's top-k probabilities
renormalised to sum 1):
  reap       mean of g_j(x) * ||f_j(x)||_2   (REAP saliency)
  man        mean of ||f_j(x)||_2            (mean activation norm)
  frequency  routed tokens / tokens seen
An expert no token was routed to scores 0. The text is tokenized with the
model's own tokenizer; its first --tokens tokens run in windows of --ctx, each
from an empty state. The model is held in memory as float32 on --device.

An MTP block (qwen3next, qwen4exp) is scored under its block index: a head
inside the model, or one given as --mtp-head. The table's info.mtp says
whether it was.

examples:
  fle-reap score model.gguf --text wiki.txt --tokens 4096 -o scores.json
  fle-reap score trunk.gguf --mtp-head trunk-mtp.gguf --text wiki.txt -o scores.json
  fle-reap prune model.gguf --scores scores.json --keep 448 -o model-reap448.gguf

Exit status 2 with a one-line message for bad input; the table is written
under a temporary name and renamed only when complete.
"""


def _add_score(sub: "argparse._SubParsersAction") -> None:
    from ..scoring import METHODS
    from ..sensitivity import DEFAULT_CTX, DEFAULT_TOKENS

    p = sub.add_parser(
        "score",
        help="measure per-expert scores over a calibration text",
        description="Run the model over a calibration text and score every routed expert of every\n"
                    "MoE layer; writes the score table (format fle.scores/1) that prune reads.",
        epilog=_SCORE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL.gguf", help="the model (any shard of a split model)")
    p.add_argument("--text", required=True, metavar="FILE", help="calibration text (UTF-8)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, metavar="N",
                   help=f"tokens of the text to score over (default {DEFAULT_TOKENS})")
    p.add_argument("--ctx", type=int, default=DEFAULT_CTX, metavar="N",
                   help=f"tokens per window (default {DEFAULT_CTX})")
    p.add_argument("--method", default="reap", choices=METHODS, help="the score (default reap)")
    p.add_argument("--mtp-head", metavar="MTP.gguf", help="a separate MTP-head file to score with the model")
    p.add_argument("--device", default="cpu", metavar="DEV", help="torch device, e.g. cuda (default cpu)")
    p.add_argument("-o", "--output", required=True, metavar="SCORES.json", help="where to write the table")
    p.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    p.set_defaults(run=_run_score)


def _run_score(args: argparse.Namespace) -> int:
    from ..files import check_input
    from ..scoring import score
    from ..textio import write_json_atomic

    declare_inputs(args.model, args.text, args.mtp_head)
    for what, path in [("MODEL", args.model), ("--text", args.text)] + \
            ([("--mtp-head", args.mtp_head)] if args.mtp_head else []):
        check_input(path, f"file given as {what}")
    if args.tokens < 1:
        raise FleError(f"--tokens must be at least 1, got {args.tokens}")
    if args.ctx < 1:
        raise FleError(f"--ctx must be at least 1, got {args.ctx}")
    check_outputs([args.output], args.force)
    check_device(args.device)
    table = score(args.model, args.text, method=args.method, n_tokens=args.tokens, ctx=args.ctx,
                  mtp_head=args.mtp_head, device=args.device, progress=True)
    write_json_atomic(args.output, table, args.force)
    routed = table["info"]["routed_tokens"]
    for layer, values in table["layers"].items():
        never = sum(1 for c in routed[layer] if c == 0)
        print(f"  layer {layer:>3}: {len(values)} experts, {never} never routed, "
              f"score {min(values):.6g} .. {max(values):.6g}")
    if table["info"]["mtp"].startswith("not scored"):
        print(f"note: MTP block {table['info']['mtp']}")
    print(f"wrote {args.output} ({args.method}, {table['tokens']} tokens, {len(table['layers'])} layers)")
    return 0


# name -> adds its parser (which sets ``run``)
_COMMANDS = {
    "score": _add_score,
    "prune": _add_prune,
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fle-reap",
        description="Expert pruning for MoE models: score the routed experts of every layer over a\n"
                    "calibration text (score), then remove the least important ones (prune).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for add in _COMMANDS.values():
        add(sub)
    return p


@cli_entry("fle-reap")
def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.run(args)


if __name__ == "__main__":
    exit_main(main)
