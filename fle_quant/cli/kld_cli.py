"""``fle-kld``: KL divergence of a model against a base model, with
llama-perplexity's files and numbers.

``fle-kld base MODEL --text FILE -c N [--chunks K] -o BASE.kld`` saves the
base model's log-probabilities (llama-perplexity ``--kl-divergence-base``);
``fle-kld MODEL --base BASE.kld`` compares a candidate with them and prints
llama-perplexity ``--kl-divergence``'s statistics. Files from either tool
work with the other. The forward pass is FLE's engine (torch)."""
from __future__ import annotations

import argparse
import sys

from ..errors import FleError
from .common import check_device, check_outputs, cli_entry, declare_inputs, exit_main

_DESCRIPTION = (
    "Measure how far a model's next-token distributions are from a base model's, as "
    "llama-perplexity --kl-divergence does. Step 1, 'fle-kld base MODEL --text FILE -o BASE.kld', runs "
    "the base model over a text and saves its log-probabilities (the same file as llama-perplexity "
    "--kl-divergence-base). Step 2, 'fle-kld MODEL --base BASE.kld', runs a candidate on the same tokens "
    "and prints perplexities, KL divergence and top-token agreement. Either step can be done by "
    "llama-perplexity instead."
)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="torch device for the forward pass (default: cpu)")
    p.add_argument("-b", "--batch-size", type=int, default=512, dest="n_batch", metavar="N",
                   help="tokens per forward call (default: 512); changes memory use, not results")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="CPU threads for torch (default: torch's)")


def _base_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fle-kld base", description="Run the base model over a text and save its "
                                "log-probabilities in llama-perplexity's --kl-divergence-base format.")
    p.add_argument("model", help="base GGUF model (any shard of a split model)")
    p.add_argument("--text", "-f", required=True, help="UTF-8 text file (e.g. wiki.test.raw)")
    p.add_argument("-c", "--ctx-size", type=int, default=512, dest="n_ctx", metavar="N",
                   help="tokens per chunk (default: 512, as llama-perplexity); the second half of each is scored")
    p.add_argument("--chunks", type=int, default=None, metavar="N", help="use at most this many chunks (default: all)")
    p.add_argument("-o", "--output", required=True, help="base file to write")
    p.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    _common(p)
    return p


def _compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fle-kld", description=_DESCRIPTION,
                                epilog="Run 'fle-kld base --help' for the options of step 1.")
    p.add_argument("model", help="candidate GGUF model (any shard of a split model)")
    p.add_argument("--base", required=True, help="base file from 'fle-kld base' or llama-perplexity "
                                                 "--kl-divergence-base")
    _common(p)
    return p


def _print(line: str) -> None:
    print(line, flush=True)


@cli_entry("fle-kld")
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    base_mode = bool(argv) and argv[0] == "base"
    args = (_base_parser() if base_mode else _compare_parser()).parse_args(argv[1:] if base_mode else argv)
    if args.n_batch < 1:
        raise FleError(f"--batch-size must be at least 1, got {args.n_batch}")
    check_device(args.device)
    if base_mode:
        declare_inputs(args.model, args.text)
        check_outputs([args.output], args.force)
        if args.n_ctx < 4:
            raise FleError(f"-c {args.n_ctx} is too small; use -c 4 or more (llama.cpp uses 512 by default)")
        if args.chunks is not None and args.chunks < 1:
            raise FleError(f"--chunks must be at least 1, got {args.chunks}")
    else:
        declare_inputs(args.model, args.base)
        from ..kld import read_header

        read_header(args.base)  # a bad base file is refused before the model is loaded
    # torch is imported only here: fle_quant itself never needs it
    try:
        from fle_engine import kld_run
    except ImportError as e:
        raise FleError(f"the forward pass needs FLE's engine ({e}); "
                       "install it with: pip install 'fle[engine]'") from None
    from ..kld import format_summary

    kld_run.set_threads(args.threads)
    if base_mode:
        text = kld_run.read_text(args.text)
        w = kld_run.write_base(args.model, text, args.output, args.n_ctx, args.chunks, device=args.device,
                               n_batch=args.n_batch, log=_print, force=args.force)
        ppl, unc = w.ppl_estimate()
        print(f"Final estimate: PPL = {ppl:.4f} +/- {unc:.5f}")
        print(f"wrote {w.path}: {w.header.n_chunk} chunks x {w.header.n_scored} scored tokens, "
              f"n_ctx={w.header.n_ctx}, n_vocab={w.header.n_vocab}")
        return 0
    summary = kld_run.compare_to_base(args.model, args.base, device=args.device, n_batch=args.n_batch, log=_print)
    print()
    print(format_summary(summary))
    return 0


if __name__ == "__main__":
    exit_main(main)
