"""``fle-synth``: write a small synthetic model (see :mod:`fle_quant.synth`)."""
from __future__ import annotations

import argparse
import sys

from ..cli.common import check_outputs, cli_entry, declare_inputs, exit_main
from ..errors import FleError

_SIZE_SUFFIX = {"": 1, "K": 1000, "M": 1000 ** 2, "G": 1000 ** 3}


def _size(text: str) -> int:
    t = text.strip().upper().removesuffix("B")
    unit = t[-1:] if t[-1:] in _SIZE_SUFFIX and t[-1:] else ""
    try:
        value = float(t[: len(t) - len(unit)] if unit else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 10M, 500K, 1G)") from None
    return int(value * _SIZE_SUFFIX[unit])


def _dead(text: str):
    """``3`` (a count per layer) or ``1,6`` / ``[1]`` (expert indices)."""
    try:
        if "," in text or "[" in text:
            return [int(p) for p in text.strip("[] ").replace(",", " ").split()]
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count or a list of expert indices: {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    from . import ARCHS

    p = argparse.ArgumentParser(
        prog="fle-synth",
        description="Write a small synthetic model with llama.cpp's names, shapes and metadata, "
                    "deterministic random weights and a chosen quant mix. With --fast, a model of any size "
                    "(random valid quant blocks for the big tensors) for speed benchmarks.",
        epilog="Example: fle-synth qwen4exp -o tiny.gguf --mix release --set block_count=8 "
               "--set attention_indexer_top_k=32. Fast: fle-synth qwen3moe --fast -o big.gguf --mix q8_0 "
               "--rule 'ffn_(gate|up|down)_exps=IQ4_XS' --set block_count=48 --set embedding_length=2048 "
               "--set vocab_size=151936 ...",
    )
    p.add_argument("arch", choices=ARCHS, help="architecture (general.architecture)")
    p.add_argument("-o", "--output", required=True, help="output file (x.gguf; shards become x-0000k-of-0000N.gguf)")
    p.add_argument("--seed", type=int, default=0, help="weights depend only on the seed, tensor name and shape")
    p.add_argument("--mix", default=None,
                   help="quant mix preset: f32, q8_0 or release (default f32; with --fast, release)")
    p.add_argument("--rule", action="append", default=[], metavar="REGEX=TYPE",
                   help="quant type for the tensors whose name matches REGEX, checked before the preset's "
                        "rules (first match wins), e.g. --rule 'ffn_(gate|up|down)_exps=IQ3_S'; repeatable. "
                        "The same seed with other rules writes a donor with the same float weights")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a size: GGUF key without the arch prefix, dots as underscores "
                        "(block_count=6, expert_count=16, vocab_size=1024); repeatable")
    p.add_argument("--split-max-size", type=_size, default=None, metavar="SIZE",
                   help="split into llama.cpp shards of at most SIZE tensor bytes (e.g. 10M)")
    p.add_argument("--split-max-tensors", type=int, default=None, metavar="N", help="at most N tensors per shard")
    p.add_argument("--mtp", choices=("separate", "inside", "none"), default=None,
                   help="MTP head: its own <stem>-mtp.gguf, inside the trunk, or none "
                        "(default: separate for qwen4exp, none otherwise)")
    p.add_argument("--vocab", default=None, metavar="VOCAB.gguf",
                   help="take the tokenizer from this GGUF (e.g. llama.cpp's models/ggml-vocab-qwen2.gguf)")
    p.add_argument("--routing-skew", type=float, default=0.0, metavar="X",
                   help="bias routers so some experts are popular (router logit offsets in [-X, X]; 0 = uniform; "
                        "with --fast, offsets X * N(0, 1) per layer and expert)")
    p.add_argument("--dead-experts", type=_dead, default=None, metavar="N|I,J,...",
                   help="N experts per layer (chosen at random), or the listed expert indices (1,6 or 1,), "
                        "are never routed")
    p.add_argument("--fast", action="store_true",
                   help="random valid blocks for big tensors: real-scale files in seconds, for speed benchmarks; "
                        "the weights carry no meaning (same names, shapes, types and metadata as without --fast)")
    p.add_argument("--force", action="store_true", help="overwrite existing output")
    return p


@cli_entry("fle-synth")
def main(argv=None) -> int:
    from . import make_model

    args = build_parser().parse_args(argv)
    declare_inputs(args.vocab)
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise FleError(f"--set {item!r}: expected KEY=VALUE")
        overrides[key.strip().replace(".", "_")] = value.strip()
    mix = args.mix if args.mix is not None else ("release" if args.fast else "f32")
    if args.rule:
        from .mix import PRESETS

        if mix.lower() not in PRESETS:
            raise FleError(f"unknown mix {mix!r}; presets: {', '.join(PRESETS)}")
        rules = []
        for item in args.rule:
            regex, sep, qtype = item.rpartition("=")
            if not sep or not regex:
                raise FleError(f"--rule {item!r}: expected REGEX=TYPE, e.g. 'ffn_up_exps=IQ3_S'")
            rules.append((regex, qtype.strip()))
        mix = rules + list(PRESETS[mix.lower()])
    check_outputs([args.output], args.force)
    if args.fast:
        from .fast import make_fast_model

        path = make_fast_model(args.output, args.arch, args.seed, mix=mix,
                               split_max_size=args.split_max_size, split_max_tensors=args.split_max_tensors,
                               mtp=args.mtp, vocab=args.vocab, force=args.force,
                               routing_skew=args.routing_skew, dead_experts=args.dead_experts,
                               progress=True, **overrides)
    else:
        path = make_model(args.output, args.arch, args.seed, mix=mix, split_max_size=args.split_max_size,
                          split_max_tensors=args.split_max_tensors, mtp=args.mtp, vocab=args.vocab,
                          force=args.force, routing_skew=args.routing_skew, dead_experts=args.dead_experts,
                          **overrides)
    print(path)
    return 0


if __name__ == "__main__":
    exit_main(main)
