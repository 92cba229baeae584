"""``fle-engine``: run a GGUF model with FLE's engine.

``fle-engine generate MODEL --prompt TEXT -n N`` continues a prompt, or
answers it as a chat message with ``--chat``, streaming the text to stdout;
sampling follows llama.cpp's default chain and defaults (see
:mod:`fle_engine.sampling`), ``--temp 0`` is greedy.

``fle-engine serve MODEL`` answers OpenAI-style HTTP requests the way
llama.cpp's ``llama-server`` does (see :mod:`fle_engine.server`)."""
from __future__ import annotations

import argparse
import sys
import time

from fle_quant.cli.common import check_device, cli_entry, declare_inputs, exit_main
from fle_quant.files import check_outputs
from fle_quant.errors import FleError

_DESCRIPTION = "Run a GGUF model with FLE's engine (torch)."
UBATCH_MAX = 8192        # the largest micro-batch prefill is laid out and measured for (bench/engine.py --fle-ubatch)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """Device, threads and MTP drafting, shared by generate and serve."""
    p.add_argument("--device", default="auto",
                   help="cuda runs the engine (GPU expert cache, CUDA-graph steps); cpu the reference forward "
                        "pass; auto (default): cuda when there is a CUDA device")
    p.add_argument("--cache-budget", default="auto", metavar="SIZE",
                   help="engine: GPU bytes for routed experts, e.g. 17GiB, 16G or 5000000000; auto (default): free "
                        "GPU memory after the weights, KV cache and buffers")
    p.add_argument("--cache-type-k", "-ctk", default="f16", choices=("f16", "bf16", "f32", "q8_0"),
                   help="engine: KV cache type of K (q8_0: ggml's 8-bit blocks, as llama.cpp's -ctk q8_0)")
    p.add_argument("--cache-type-v", "-ctv", default="f16", choices=("f16", "bf16", "f32", "q8_0"),
                   help="engine: KV cache type of V")
    p.add_argument("--cache-profile", default="auto", metavar="FILE",
                   help="engine: expert usage profile, loaded at start and saved every 600 s and at exit; "
                        "auto (default): ~/.cache/fle/profiles/<model fingerprint>.json; none: no profile")
    p.add_argument("--miss-split", default="auto", metavar="auto|cpu|gpu|FRACTION",
                   help="engine: who computes the cache misses: auto (default): the GPU reading host memory over "
                        "PCIe and the CPU at once, in the share that gives the shortest layer on both sides' times "
                        "measured at start; "
                        "gpu: the GPU alone; cpu: the CPU alone; FRACTION: that fraction on the CPU "
                        "(docs/benchmarks.md)")
    p.add_argument("--host-experts", default="auto", choices=("auto", "pinned", "mapped"),
                   help="engine: where the routed experts live on the host: pinned: one page-locked buffer read once "
                        "from the file (the GPU reads misses from it; an error when the machine cannot hold or lock "
                        "it); mapped: left memory-mapped in the file, no copy held (the OS page cache keeps what was "
                        "read), every miss computed on the CPU; auto (default): pinned when it fits the available "
                        "RAM less 4 GiB and can be locked, else mapped (said in one line)")
    p.add_argument("--miss-prefetch", type=int, default=0, metavar="N",
                   help="engine: copy up to N predicted misses per layer into GPU slots on a copy stream one layer "
                        "ahead (the next layer's router applied to this layer's input); 0 (default): off. The "
                        "slots come out of --cache-budget; measured slower except with GPU-only misses at near-uniform routing "
                        "(docs/benchmarks.md)")
    p.add_argument("--miss-activations", default="float", choices=("float", "q8"),
                   help="engine: what the GPU's misses multiply: float (default) the activations as they are; q8: "
                        "rounded as the CPU kernels quantize them (ggml's vec_dot_type), so that a token's numbers "
                        "do not depend on which side computed a miss (for checks; costs two small kernels a layer)")
    p.add_argument("--cpu-kernels", default="auto", choices=("auto", "ggml", "numba", "reference"),
                   help="engine: CPU expert kernels for the CPU's misses; auto (default): FLE's numba kernels where "
                        "their AVX-512 versions cover the file's expert types (faster than ggml's there), else "
                        "ggml's (from llama-cpp-python) when present, else FLE's numba kernels")
    p.add_argument("--ubatch", "-ub", type=int, default=8192, metavar="N",
                   help="engine: prompts of at least --prefill-min tokens are processed N tokens at a time, each "
                        "layer's uncached experts streamed to the GPU once per micro-batch (default 8192, by measurement; larger "
                        f"micro-batches stream less per token; 1 to {UBATCH_MAX}; 0: prompts run as decode steps)")
    p.add_argument("--prefill-min", type=int, default=32, metavar="N",
                   help="engine: shorter prompts run as decode steps (at least 1; default 32)")
    p.add_argument("--prompt-rows", type=int, default=4, metavar="N",
                   help="engine: a prompt that is not prefilled (shorter than --prefill-min, or a chat turn's new "
                        "tokens) runs N of its tokens per step, each distinct expert read once for them (1 to 4; "
                        "default 4, by measurement; 1: one token per step)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    p.add_argument("--mtp", action="store_true",
                   help="speculative decoding with the model's MTP head (inside the model file, or --mtp-head): "
                        "same tokens, fewer trunk steps when drafts are right; generate on the engine (qwen3next, "
                        "up to 3 drafts per verify step), serve on the reference path (--device cpu)")
    p.add_argument("--mtp-head", default=None, metavar="FILE", help="a separate MTP-head GGUF (implies --mtp)")
    p.add_argument("--mtp-drafter", default="auto", choices=["auto", "step", "eager"], dest="mtp_drafter",
                   help="generate --mtp on the engine: 'step', the head's block on the engine's kernels on its GGUF "
                        "bytes, its experts resident, one CUDA graph per call size (qwen3next, qwen4exp); 'eager', the "
                        "reference head in float32; 'auto' (default): step where the architecture has one")
    p.add_argument("--draft-max", type=int, default=2, dest="draft_max",
                   help="with --mtp: tokens drafted ahead per trunk call (default: 2); with --draft-adaptive "
                        "the most")
    p.add_argument("--draft-adaptive", action="store_true", dest="draft_adaptive",
                   help="generate --mtp: pick each step's draft count, 0 to --draft-max, for the most expected "
                        "tokens per second, from the acceptance by draft position and the trunk-call times by "
                        "size measured during the run")
    p.add_argument("--draft-vocab", default=None, metavar="N|FILE", dest="draft_vocab",
                   help="generate --mtp: draft only tokens of a list, the MTP head computing only those output "
                        "rows; FILE: a list (one token id per line, or JSON; make one with python -m "
                        "fle_engine.draft_vocab MODEL CORPUS -n N -o FILE); N: the N most frequent tokens of "
                        "--draft-vocab-corpus. The output is the same; fewer drafts may be accepted")
    p.add_argument("--draft-vocab-corpus", default=None, metavar="FILE", dest="draft_vocab_corpus",
                   help="with --draft-vocab N: UTF-8 text, tokenised with the model's tokenizer, whose N most "
                        "frequent tokens are the list")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fle-engine", description=_DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    g = sub.add_parser(
        "generate", help="continue a prompt (or answer it as a chat message) and print the text",
        description="Tokenize the prompt, prefill it, then sample one token at a time through the KV cache, "
                    "printing the text as it comes, until -n tokens or an end-of-generation token. Sampling "
                    "is llama.cpp's default chain: top-k, top-p, min-p, then temperature; --temp 0 is greedy.",
    )
    g.add_argument("model", help="GGUF model (any shard of a split model)")
    g.add_argument("-p", "--prompt", required=True, help="prompt text; special-token texts such as <|im_start|> "
                                                        "are recognised, as llama.cpp does")
    g.add_argument("-n", "--n-predict", type=int, default=128, dest="n_predict",
                   help="tokens to generate at most (default: 128)")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the model's chat template")
    g.add_argument("--system", default=None, help="with --chat: a system message before the prompt")
    g.add_argument("--temp", type=float, default=0.8, help="temperature; 0 or less is greedy (default: 0.8)")
    g.add_argument("--top-k", type=int, default=40, help="keep the K most likely tokens; 0 = off (default: 40)")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus probability; 1 = off (default: 0.95)")
    g.add_argument("--min-p", type=float, default=0.05,
                   help="drop tokens below this fraction of the top probability; 0 = off (default: 0.05)")
    g.add_argument("-s", "--seed", type=int, default=None, help="random seed (default: a random one)")
    g.add_argument("--special", action="store_true", help="print control tokens' text too")
    g.add_argument("--stats-json", default=None, metavar="FILE",
                   help="engine: write the expert cache's hits per step (fle.engine-stats/1; fle-plot hit-rate "
                        "draws the hit rate over time); replaced if it exists")
    g.add_argument("-c", "--ctx-size", type=int, default=None, dest="ctx_size", metavar="N",
                   help="engine: KV cache positions; 0 = the model's context (default: prompt + -n, at most the "
                        "model's)")
    _add_run_options(g)

    s = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server, as llama.cpp's llama-server",
        description="Serve the model over HTTP: GET /health and /v1/models, POST /v1/completions and "
                    "/v1/chat/completions, with llama-server's request fields and defaults (temperature 0.8, "
                    "top_k 40, top_p 0.95, min_p 0.05; max_tokens until end of generation or the end of the "
                    "context), streaming as server-sent events, and a chat answer's <think> part in "
                    "reasoning_content, tool calls, structured output, a RAM prompt cache and parallel slots.",
    )
    s.add_argument("model", help="GGUF model (any shard of a split model)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8080, help="port to listen on; 0 picks a free one (default: 8080)")
    s.add_argument("-c", "--ctx-size", type=int, default=None, dest="ctx_size", metavar="N",
                   help="context size in tokens, prompt and answer together; 0 = the model's own "
                        "(default: the model's, at most 8192)")
    _add_run_options(s)
    s.add_argument("-a", "--alias", default=None, metavar="NAME",
                   help="model name in responses and /v1/models (default: the file name)")
    s.add_argument("-np", "--parallel", type=int, default=2, dest="parallel", metavar="N",
                   help="slots: sequences served at once, each with its own state; they share --ctx-size "
                        "(each gets ctx-size / N) (default: 2)")
    s.add_argument("--cache-ram", type=float, default=0, dest="cache_ram", metavar="MiB",
                   help="RAM prompt cache: finished sequences' states kept up to this many MiB, least recently "
                        "used out first; 0 = off (default: 0)")
    s.add_argument("--cache-protect-slot", type=int, action="append", default=[], dest="cache_protect_slot",
                   metavar="ID",
                   help="keep the conversation of slot ID (the requests naming it with id_slot) in the RAM prompt "
                        "cache: other slots' traffic does not evict it, and requests naming no slot take slot ID "
                        "only when no other slot is idle; repeatable; needs --cache-ram")
    s.add_argument("--slot-save-path", default=None, dest="slot_save_path", metavar="DIR",
                   help="folder for POST /slots/{id}?action=save|restore")
    s.add_argument("--api-key", default=None, dest="api_key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    return p


def check_run_options(args) -> None:
    """The engine's sizes (--ubatch, --prefill-min, --prompt-rows, --cache-budget), checked
    before any file is read, whether or not the engine runs: a bad value is
    refused, never silently left unused. The budget is parsed by the
    engine's own parser."""
    from .runtime import parse_budget
    from .runtime.mtp import VERIFY_MAX

    if not 0 <= args.ubatch <= UBATCH_MAX:
        raise FleError(f"--ubatch {args.ubatch}: give 1 to {UBATCH_MAX} tokens per micro-batch, or 0 to run prompts "
                       f"as decode steps")
    if args.prefill_min < 1:
        raise FleError(f"--prefill-min {args.prefill_min}: give the shortest prompt to prefill, at least 1 token")
    if not 1 <= args.prompt_rows <= VERIFY_MAX:      # the T-row step's largest graph (the verify step's)
        raise FleError(f"--prompt-rows {args.prompt_rows}: give 1 to {VERIFY_MAX} prompt tokens per step")
    parse_budget(args.cache_budget)             # a FleError naming the option for anything that is no size


def _prompt_tokens(tok, args) -> list[int]:
    text = args.prompt
    if args.chat:
        from .chat import render_prompt

        messages = ([{"role": "system", "content": args.system}] if args.system is not None else [])
        messages.append({"role": "user", "content": text})
        text = render_prompt(tok, messages, add_generation_prompt=True)
    elif args.system is not None:
        raise FleError("--system needs --chat")
    return tok.encode(text, add_special=True, parse_special=True)


def _generate(args) -> int:
    import torch

    from .loader import load
    from .sampling import Sampler, SamplerParams, generate_tokens
    from .speculative import AdaptiveDraft, SpecStats, generate_speculative
    from .tokenizer import Tokenizer

    if args.n_predict < 1:
        raise FleError(f"-n must be at least 1, got {args.n_predict}")
    check_run_options(args)
    if args.threads is not None:
        if args.threads < 1:
            raise FleError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    declare_inputs(args.model, args.mtp_head, args.draft_vocab_corpus)
    check_outputs([args.stats_json], True)
    device = resolve_device(args.device)
    sampler = Sampler(SamplerParams(args.temp, args.top_k, args.top_p, args.min_p, args.seed))
    tok = Tokenizer.from_gguf(args.model)
    vocab = _draft_options(args, tok)
    prompt = _prompt_tokens(tok, args)
    if not prompt:
        raise FleError("the prompt tokenizes to nothing; give a non-empty --prompt")
    args.n_predict, args.ctx_size = bound_request(args.model, len(prompt), args.n_predict, args.ctx_size)
    if device == "cuda" and use_engine(args.model, args, mtp_on_engine=True):
        return _generate_engine(args, tok, prompt, sampler, vocab)
    if args.stats_json:
        raise FleError("--stats-json records the engine's expert cache: it needs the engine (a CUDA device)")
    model = load(args.model, device=device)
    if tok.n_vocab > model.n_vocab:
        raise FleError(f"{args.model}: the vocabulary has {tok.n_vocab} tokens but the model outputs "
                       f"{model.n_vocab}; the file is inconsistent")
    spec = None
    if args.mtp or args.mtp_head:
        if args.mtp_head:
            if not hasattr(model.net, "load_mtp"):
                raise FleError(f"{args.model}: FLE runs no MTP head for {model.arch} models")
            model.net.load_mtp(args.mtp_head)
        spec = SpecStats()
        policy = AdaptiveDraft(args.draft_max) if args.draft_adaptive else None
        tokens = generate_speculative(model, prompt, args.n_predict, sampler, stop=tok.eog_ids,
                                      n_draft=args.draft_max, stats=spec, vocab=vocab, adaptive=policy)
    else:
        tokens = generate_tokens(model, prompt, args.n_predict, sampler, stop=tok.eog_ids)
    t0 = time.perf_counter()
    n, stopped = _print_tokens(tokens, tok, args.special)
    dt = time.perf_counter() - t0
    why = "end of generation" if stopped else f"{args.n_predict} tokens"
    drafts = ""
    if spec is not None:
        drafts = (f", MTP drafts accepted {spec.accepted}/{spec.drafted} ({100 * spec.acceptance:.1f} %)"
                  f"{'' if vocab is None else f' from a draft vocabulary of {len(vocab)} tokens'}, "
                  f"{spec.trunk_calls} trunk calls")
    print(f"[prompt {len(prompt)} tokens, generated {n} tokens ({why}), {dt:.2f} s, "
          f"seed {sampler.seed}{drafts}]", file=sys.stderr)
    if spec is not None and spec.line():
        print(f"[{spec.line()}]", file=sys.stderr)
    if spec is not None and args.draft_adaptive:
        print(f"[{spec.steps_line()}; {policy.line()}]", file=sys.stderr)
    return 0


def _draft_options(args, tok):
    """Check the MTP drafting options; the draft vocabulary they ask for
    (a :class:`~fle_engine.draft_vocab.DraftVocab`) or None."""
    from .draft_vocab import resolve

    mtp = args.mtp or args.mtp_head
    if mtp and args.draft_max < 1:
        raise FleError(f"--draft-max must be at least 1, got {args.draft_max}")
    for flag, given in (("--draft-adaptive", args.draft_adaptive), ("--draft-vocab", args.draft_vocab),
                        ("--draft-vocab-corpus", args.draft_vocab_corpus)):
        if given and not mtp:
            raise FleError(f"{flag} drafts with the MTP head: add --mtp (or --mtp-head FILE)")
    return resolve(args.draft_vocab, args.draft_vocab_corpus, tok) if mtp else None


def _print_tokens(tokens, tok, special: bool) -> tuple[int, bool]:
    """Write the text of ``tokens`` to stdout as they come, up to an
    end-of-generation token; (tokens taken, whether one ended it)."""
    stream = tok.stream(special=special)
    out = sys.stdout
    n, stopped = 0, False
    for t in tokens:
        n += 1
        if t in tok.eog_ids:
            stopped = True
            break
        out.write(stream.add(t))
        out.flush()
    out.write(stream.flush() + "\n")
    out.flush()
    return n, stopped


def resolve_device(device: str) -> str:
    """``auto`` -> cuda when a CUDA device is there, else cpu; ``cuda``
    without one, a CUDA index torch does not see, or another name is refused
    with a message."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    check_device(device)
    if device != "cpu" and not device.startswith("cuda"):
        raise FleError(f"--device {device!r}: expected auto, cpu or cuda")
    return device


def bound_request(model: str, n_prompt: int, n_predict: int, ctx_size: "int | None") -> "tuple[int, int | None]":
    """``(n_predict, ctx_size)`` within the model's context length: a prompt
    that fills the context is refused; -n and -c beyond it are capped, with a
    message saying so."""
    from fle_quant.gguf_reader import GGUFModel

    with GGUFModel.open(model) as g:
        n_ctx_train = int(g.hparam("context_length", 0) or 0)
    if ctx_size is not None and ctx_size < 0:
        raise FleError(f"--ctx-size must be 0 (the model's own) or a number of tokens, got {ctx_size}")
    if not n_ctx_train:
        return n_predict, ctx_size
    if ctx_size and ctx_size > n_ctx_train:
        print(f"fle-engine: note: -c {ctx_size} is more than the model's context ({n_ctx_train} tokens); "
              f"using {n_ctx_train}", file=sys.stderr)
        ctx_size = n_ctx_train
    ctx = ctx_size or n_ctx_train
    if n_prompt >= ctx:
        raise FleError(f"the prompt is {n_prompt} tokens, which fills the context of {ctx} tokens"
                       f"{' (the model' + chr(39) + 's)' if ctx == n_ctx_train else ''}; shorten --prompt"
                       f"{'' if ctx == n_ctx_train else ' or raise -c'}")
    if n_prompt + n_predict > ctx:
        room = ctx - n_prompt
        print(f"fle-engine: note: -n {n_predict} does not fit the context of {ctx} tokens after the prompt's "
              f"{n_prompt}; generating at most {room}", file=sys.stderr)
        n_predict = room
    return n_predict, ctx_size


def use_engine(model: str, args, mtp_on_engine: bool = False) -> bool:
    """Whether ``model`` runs on the engine (GPU expert cache); otherwise the
    reference pass runs it on the GPU, with a warning saying why.
    ``mtp_on_engine``: the caller drafts with the MTP head on the engine
    (generate and serve, for the architectures of
    :data:`fle_engine.runtime.mtp.HEADS`); otherwise --mtp is refused here."""
    from fle_quant.gguf_reader import GGUFModel

    from .runtime import ARCHS
    from .runtime.mtp import HEADS

    with GGUFModel.open(model) as g:
        arch = g.arch
    if arch not in ARCHS:
        print(f"fle-engine: warning: the engine does not run {arch} files yet; using the reference forward pass "
              f"(slow)", file=sys.stderr)
        return False
    if args.mtp or args.mtp_head:
        if not mtp_on_engine:
            raise FleError("--mtp does not run on the engine here: add --device cpu, or drop --mtp")
        if arch not in HEADS:
            raise FleError(f"--mtp on the engine runs {', '.join(HEADS)} files; {arch} drafts on the reference "
                           f"path for now: add --device cpu, or drop --mtp")
    return True


def _engine_mtp(args):
    """The engine's ``mtp`` argument for --mtp / --mtp-head (None without
    them), --draft-max checked against its verify step's size."""
    from .runtime.engine import VERIFY_MAX

    mtp = args.mtp_head or (True if args.mtp else None)
    if mtp and not 1 <= args.draft_max <= VERIFY_MAX - 1:
        raise FleError(f"--draft-max {args.draft_max}: the engine drafts 1 to {VERIFY_MAX - 1} tokens ahead (its "
                       f"verify step takes up to {VERIFY_MAX} tokens); lower --draft-max, or draft on the "
                       f"reference path (--device cpu)")
    return mtp


def _generate_engine(args, tok, prompt, sampler, vocab=None) -> int:
    from .runtime import Engine
    from .runtime.engine import VERIFY_MAX
    from .speculative import AdaptiveDraft, SpecStats

    from fle_quant.gguf_reader import GGUFModel

    with GGUFModel.open(args.model) as g:
        n_ctx_train = int(g.hparam("context_length", 0) or 0)
    # without -c: room for the prompt and -n, at most the model's context (as llama.cpp stops there)
    ctx = args.ctx_size if args.ctx_size is not None else len(prompt) + args.n_predict
    if args.ctx_size is None and n_ctx_train:
        ctx = min(ctx, n_ctx_train)
    if ctx < 0:
        raise FleError(f"--ctx-size must be 0 (the model's own) or a number of tokens, got {ctx}")
    mtp = _engine_mtp(args)
    with Engine(args.model, device="cuda", cache_budget=args.cache_budget, ctx_size=ctx,
                cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,
                profile_path=args.cache_profile, miss_split=args.miss_split, cpu_impl=args.cpu_kernels,
                miss_activations=args.miss_activations, ubatch=args.ubatch, prefill_min=args.prefill_min, mtp=mtp,
                prompt_rows=args.prompt_rows,
                miss_prefetch=args.miss_prefetch, mtp_drafter=args.mtp_drafter,
                host_experts=args.host_experts) as eng:
        n_predict = min(args.n_predict, eng.ctx_size - len(prompt))
        picker = None if args.temp <= 0 else sampler
        if mtp:
            spec = SpecStats()
            policy = AdaptiveDraft(args.draft_max, resettle=False) if args.draft_adaptive else None
            tokens = eng.speculative(prompt, n_predict, stop=tok.eog_ids, n_draft=args.draft_max, sampler=picker,
                                     stats=spec, vocab=vocab, adaptive=policy)
        else:
            tokens = eng.tokens(prompt, n_predict, stop=tok.eog_ids, sampler=picker)
        n, stopped = _print_tokens(tokens, tok, args.special)
        why = "end of generation" if stopped else f"{n_predict} tokens"
        drafts = ""
        if mtp:
            drafts = (f", MTP drafts accepted {spec.accepted}/{spec.drafted} ({100 * spec.acceptance:.1f} %)"
                      f"{'' if vocab is None else f' from a draft vocabulary of {len(vocab)} tokens'}, "
                      f"{spec.trunk_calls} verify steps")
        print(f"[prompt {len(prompt)} tokens, generated {n} tokens ({why}){drafts}]", file=sys.stderr)
        if mtp and spec.line():
            print(f"[{spec.line()}]", file=sys.stderr)
        if mtp and spec.time_line():
            print(f"[{spec.time_line()} ({eng.drafter.kind} drafter)]", file=sys.stderr)
        if mtp and args.draft_adaptive:
            print(f"[{spec.steps_line()}; {policy.line()}]", file=sys.stderr)
        print(eng.stats.summary(eng.cache), file=sys.stderr)
        if eng.prefetch is not None:
            print(eng.prefetch.line(eng.cache.stats.steps), file=sys.stderr)
        if eng.prefill is not None and eng.prefill.stats.tokens:
            print(eng.prefill.stats.line(), file=sys.stderr)
        if args.stats_json:
            eng.save_stats(args.stats_json, force=True)
    return 0


def _serve(args) -> int:
    from .server import serve

    mtp = args.mtp or args.mtp_head
    for flag, given in (("--draft-adaptive", args.draft_adaptive), ("--draft-vocab", args.draft_vocab),
                        ("--draft-vocab-corpus", args.draft_vocab_corpus)):
        if given and not mtp:
            raise FleError(f"{flag} drafts with the MTP head: add --mtp (or --mtp-head FILE)")
    check_run_options(args)
    declare_inputs(args.model, args.mtp_head, args.draft_vocab_corpus)
    device = resolve_device(args.device)
    runtime = None
    if device == "cuda" and use_engine(args.model, args, mtp_on_engine=True):
        runtime = dict(cache_budget=args.cache_budget, cache_type_k=args.cache_type_k,
                       cache_type_v=args.cache_type_v, profile_path=args.cache_profile,
                       miss_split=args.miss_split, cpu_impl=args.cpu_kernels, ubatch=args.ubatch,
                       prefill_min=args.prefill_min, prompt_rows=args.prompt_rows,
                       miss_activations=args.miss_activations,
                       miss_prefetch=args.miss_prefetch, host_experts=args.host_experts)
        if mtp:        # the head on the engine too (one sequence: the slots take turns)
            runtime.update(mtp=_engine_mtp(args), mtp_drafter=args.mtp_drafter)
    return serve(args.model, host=args.host, port=args.port, ctx_size=args.ctx_size, device=device,
                 threads=args.threads, mtp=args.mtp, mtp_head=args.mtp_head, n_draft=args.draft_max,
                 draft_vocab=args.draft_vocab, draft_vocab_corpus=args.draft_vocab_corpus,
                 draft_adaptive=args.draft_adaptive, alias=args.alias, runtime=runtime, n_parallel=args.parallel, cache_ram=args.cache_ram,
                 slot_save_path=args.slot_save_path, api_key=args.api_key,
                 cache_protect_slots=tuple(args.cache_protect_slot))


@cli_entry("fle-engine")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        return _serve(args)
    raise FleError(f"unknown command {args.command!r}")  # argparse rejects it first


if __name__ == "__main__":
    exit_main(main)
