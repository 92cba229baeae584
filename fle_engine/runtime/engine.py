"""The engine: a loaded file, its KV cache, the GPU expert cache, and the
decode step replayed as a CUDA graph with the cache policy one step behind.

``Engine(path, cache_budget=...)`` loads the file (dense weights in their
GGUF bytes on the device, the routed experts page-locked in host memory, or
left memory-mapped in the file with every miss computed on the CPU:
``host_experts``, :func:`~fle_engine.runtime.weights.open_host_experts`),
plans the slots under the budget, warm-starts them from a saved usage
profile, allocates the KV cache for ``ctx_size`` positions and captures
one decode step. ``generate(prompt, n)`` runs steps with one step of
look-ahead: step n is launched before the host reads step n - 1's token
and routing, so the policy (:class:`~fle_engine.runtime.cache.ExpertCache`)
runs while the GPU computes.

Without CUDA the same step runs eagerly with the reference operations
(``impl="reference"``) and the same ordering of policy and steps.

Drafted decoding checks n drafted tokens in one step of T = 1 + n tokens:
:meth:`Engine.verify_step` (a CUDA graph per T, captured on first use),
:meth:`Engine.rewind` to drop the rejected positions, and
:meth:`Engine.step_cost` to measure such a step.

Several sequences: ``Engine(..., n_seq=N)`` holds N lanes, each with its
own KV cache rows, recurrent state and position (``ctx_size / N``
positions each, as llama-server shares ``--ctx-size`` among ``--parallel``
slots). :meth:`Engine.select` makes a lane the one that the one-sequence
methods (``tokens``, ``generate``, prefill, ``reset``) run on;
:meth:`Engine.lane_prompt` processes a lane's prompt and
:meth:`Engine.step_lanes` runs one batched decode step of one token for
each of several lanes (a CUDA graph per batch size).
"""
from __future__ import annotations

import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from fle_quant.errors import FleError
from fle_quant.gguf_reader import GGUFModel

from ..expert_cache import CachePolicy, Profile, load_profile, model_fingerprint, save_profile
from ..kernels import engine_ops
from ..layers import rope_table
from ..loader import Weights
from . import qwen3moe, qwen3next, qwen4exp
from .cache import ExpertCache, expert_products
from .cudacalls import capture_graph
from .mtp import VERIFY_MAX
from .prefill import Prefill, prefill_bytes
from .split import SHARE_ONE, MissSplit, choose_share, cpu_experts, job_model, parse_split, split_bytes
from .split import cpu_threads as split_threads
from .weights import check_host_mode, open_host_experts

__all__ = ["Engine", "LaneSnapshot", "RunStats", "ARCHS", "KV_TYPES", "VERIFY_MAX", "parse_budget"]

ARCHS = {"qwen3moe": qwen3moe, "qwen3next": qwen3next, "qwen4exp": qwen4exp}
KV_TYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "q8_0": "q8_0"}
_KV_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}       # bytes per value
PROFILE_EVERY_S = 600.0
# prompts of at least this many tokens are prefilled in micro-batches (runtime.prefill), shorter ones run as
# decode steps: a micro-batch streams every uncached expert once (~10 GB for the 30B-A3B shape at 1/3 cached,
# ~0.2 s over PCIe 5), which decode steps beat below a few dozen tokens
PREFILL_MIN = 32
# a prompt that is not prefilled (shorter than --prefill-min, or a chat turn's new tokens after a cached prefix)
# runs its tokens but the last this many per step, in the verify step's T-row pass (each distinct expert read
# once for the step's tokens). On an H100 (2026-12-07, docs/benchmarks.md; 30B-A3B shape, calibrated skew, the
# CUDA C union kernel) a step of 2 / 3 / 4 tokens cost 1.44-1.68x / 1.97-2.29x / 2.38-2.85x a one-token step:
# 4 tokens per step take such a prompt 1.4-1.7x faster than one token per step
PROMPT_ROWS = 4
_RING = 8

_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "M": 1000 ** 2, "MB": 1000 ** 2, "G": 1000 ** 3, "GB": 1000 ** 3,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40, "T": 1000 ** 4, "TB": 1000 ** 4}


def parse_budget(text: "str | int | None") -> "int | None":
    """``17GiB``, ``16G``, ``5000000000`` -> bytes; ``auto`` / None -> None."""
    if text is None or isinstance(text, int):
        return text
    t = str(text).strip()
    if t.lower() == "auto":
        return None
    num = t.rstrip("KMGTiBkmgtib")
    unit = t[len(num):].upper()
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not 0 <= value < 2 ** 64 / _UNITS[unit]:      # nan, inf and 1e400 too
        raise FleError(f"--cache-budget {text!r}: expected 'auto' or a size such as 17GiB, 16G or 5000000000")
    return int(value * _UNITS[unit])


@dataclass
class RunStats:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    gen_tokens: int = 0
    gen_seconds: float = 0.0
    launch_seconds: float = 0.0
    replay_seconds: float = 0.0        # of which the graph replays (or eager steps) themselves
    # T-row steps (verify, batched lanes): bytes of missed experts the steps read over PCIe and on the CPU
    # (each distinct missed expert of a layer once, split by runtime.split's union rule), against the sum over
    # their tokens (what one-token steps would read, split by the one-token rule)
    multi_steps: int = 0
    multi_tokens: int = 0
    multi_pcie_bytes: int = 0
    multi_cpu_bytes: int = 0
    multi_pcie_bytes_sum: int = 0
    multi_cpu_bytes_sum: int = 0

    def multi_summary(self) -> str:
        """The T-row steps' miss bytes per step against the per-token sum."""
        n = max(self.multi_steps, 1)
        mb = 1e6 * n
        return (f"T-row steps: {self.multi_steps} ({self.multi_tokens} rows), missed experts per step "
                f"{self.multi_pcie_bytes / mb:.1f} MB over PCIe + {self.multi_cpu_bytes / mb:.1f} MB on the CPU "
                f"(per-token sum {self.multi_pcie_bytes_sum / mb:.1f} + {self.multi_cpu_bytes_sum / mb:.1f} MB)")

    def summary(self, cache) -> str:
        """Throughput, the expert cache's figures and the host time; "per
        token" divides by the rows the steps ran (a batched or verify step
        carries several), not by steps."""
        st = cache.stats
        tokens = max(st.tokens, 1)
        p_tps = self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0
        g_tps = self.gen_tokens / self.gen_seconds if self.gen_seconds else 0.0
        return (f"prompt: {self.prompt_tokens} tokens, {self.prompt_seconds * 1e3:.1f} ms ({p_tps:.2f} tok/s) | "
                f"eval: {self.gen_tokens} tokens, {self.gen_seconds * 1e3:.1f} ms ({g_tps:.2f} tok/s) | "
                f"expert cache: hit rate {st.hit_rate:.3f}, {st.misses_per_token():.1f} misses/token, "
                f"{st.admissions} admissions | host time {st.host_seconds / tokens * 1e3:.3f} ms/token policy, "
                f"{self.launch_seconds / tokens * 1e3:.3f} ms/token launches "
                f"({self.replay_seconds / tokens * 1e3:.3f} of them graph replays)")


# what the engine keeps per lane besides the device state (Engine.select swaps them in)
_LANE_FIELDS = ("state", "history", "launched", "consumed", "length", "_last_tok", "cached_tokens", "_multi_at",
                "_graphs")


def _lane_caches(kv_all: list, i: int) -> list:
    """Lane ``i``'s per-layer state as views of the lane-stacked state."""
    return [tuple(engine_ops.lane_of(t, i) for t in c) for c in kv_all]


def _out_views(buf: torch.Tensor, n_layer: int, k: int):
    """(ids [L, K] int32, hits [L, K] int32, token [1] int64) as views of
    the int32 buffer ``buf`` of ``2 * L * K + 2`` values (the token's offset
    is even: 8-byte aligned)."""
    n = n_layer * k
    return buf[:n].view(n_layer, k), buf[n:2 * n].view(n_layer, k), buf[2 * n:2 * n + 2].view(torch.int64)


def _out_log(n_layer: int, k: int, device) -> tuple:
    buf = torch.zeros(2 * n_layer * k + 2, dtype=torch.int32, device=device)
    return buf, _out_views(buf, n_layer, k)


@dataclass
class LaneSnapshot:
    """A sequence of the engine copied to host memory
    (:meth:`Engine.lane_snapshot`): its tokens, the net's
    :meth:`held_state` at their length (attention K/V rows up to it; GDN
    states, qwen4exp's PLE histories whole; QSA indexer and block keys up
    to it) and the greedy token after them."""
    tokens: list
    parts: list
    last_tok: "int | None" = None

    @property
    def n(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """Host bytes held: the state's tensors and 8 per token."""
        return sum(t.numel() * t.element_size() for t in self.parts) + 8 * len(self.tokens)

    def to_dict(self) -> dict:
        return {"kind": "lane", "tokens": list(self.tokens), "parts": list(self.parts), "last_tok": self.last_tok}

    @classmethod
    def from_dict(cls, d: dict) -> "LaneSnapshot":
        last = d.get("last_tok")
        return cls([int(t) for t in d["tokens"]], list(d["parts"]), None if last is None else int(last))


class Engine:
    runtime = True              # what the server asks to tell the engine from the reference Model

    def __init__(self, path, *, device="cuda", cache_budget="auto", ctx_size: int = 4096,
                 cache_type_k: str = "f16", cache_type_v: str = "f16", impl: str = "auto", miss_split="gpu",
                 cpu_impl: str = "auto", miss_activations: str = "float", ubatch: int = 8192, prefill_min: int = PREFILL_MIN,
                 prompt_rows: int = PROMPT_ROWS, profile_path="auto", policy: CachePolicy = CachePolicy(), graphs: bool = True,
                 progress: bool = True, log=None, mtp=None, mtp_experts: str = "auto", n_seq: int = 1,
                 miss_prefetch: int = 0, mtp_drafter: str = "auto", host_experts: str = "auto"):
        self.log = log if log is not None else (lambda msg: print(msg, file=sys.stderr))
        self.n_seq = int(n_seq)
        if self.n_seq < 1:
            raise FleError(f"the engine holds at least one sequence, not {n_seq}")
        if self.n_seq > 1 and mtp:
            raise FleError(f"MTP drafting runs on one sequence: with --mtp the engine serves --parallel 1, "
                           f"not {self.n_seq}")
        self.device = torch.device(device)
        self.net = None
        self._layer_bytes_list = None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise FleError("--device cuda: no CUDA device is available here; use --device cpu (the reference path)")
        self.cuda = self.device.type == "cuda"
        self.ops = engine_ops.pick(impl, self.device)
        self.fast = self.ops is not engine_ops.REFERENCE
        for name, want in (("--cache-type-k", cache_type_k), ("--cache-type-v", cache_type_v)):
            if want not in KV_TYPES:
                raise FleError(f"{name} {want!r}: the engine keeps the KV cache as {', '.join(KV_TYPES)}")
        parse_split(miss_split)
        self.miss_prefetch = int(miss_prefetch)
        if self.miss_prefetch < 0 or self.miss_prefetch > 16:
            raise FleError(f"--miss-prefetch {miss_prefetch}: 0 (off) to 16 experts per layer")
        if self.miss_prefetch and self.n_seq > 1:
            raise FleError(f"--miss-prefetch runs on one sequence: serve it with --parallel 1, not {self.n_seq}")
        check_host_mode(host_experts)             # before the file is read
        if miss_activations not in ("float", "q8"):
            raise FleError(f"--miss-activations {miss_activations!r}: float or q8")
        self.cpu_impl = cpu_impl
        self.path = Path(path)
        t0 = time.perf_counter()
        gguf = GGUFModel.open(path)
        self._gguf = gguf
        arch = ARCHS.get(gguf.arch)
        if arch is None:
            raise FleError(f"{gguf.paths[0]}: the engine runs {', '.join(ARCHS)} files; {gguf.arch} runs on the "
                           f"reference path (--device cpu or fle_engine.load)")
        self.net = arch.Net(gguf, Weights(gguf), self.device, self.fast)
        a = self.args = self.net.args
        why = self.net.lanes_unsupported() if self.n_seq > 1 else None
        if why:
            raise FleError(f"{gguf.paths[0]}: several sequences at once (--parallel {self.n_seq}) on the engine: "
                           f"{why}; serve it with --parallel 1")
        # the MTP head before the KV cache and the expert budget, which take the memory that is left
        if mtp_drafter not in ("auto", "step", "eager"):
            raise FleError(f"the MTP drafter is auto, step or eager, not {mtp_drafter!r}")
        head = self._load_mtp(mtp, mtp_experts, mtp_drafter) if mtp else None
        self.drafter = None
        max_ctx = int(gguf.hparam("context_length", 262144))
        if ctx_size <= 0:
            ctx_size = max_ctx
        if ctx_size > max_ctx:
            self.log(f"fle-engine: warning: --ctx-size {ctx_size} is beyond the model's training context ({max_ctx})")
        self.ctx_size = int(ctx_size) // self.n_seq          # positions per sequence (lane)
        if self.ctx_size < 2:
            raise FleError(f"--ctx-size {ctx_size} shared by {self.n_seq} sequences leaves fewer than 2 positions "
                           f"each")

        # routed experts: one host buffer, read once from the file, or the file's pages (memory-mapped)
        self.host = open_host_experts(self.net.layouts, a.n_expert, self.net.expert_sources, host_experts,
                                      pin=self.cuda, log=self.log, path=self.path)
        if not self.host.mapped:
            self._fill_host(progress)
        self.net.expert_sources = {}
        if self.host.mapped and self.cuda and self.miss_prefetch:
            self.log("misses: --miss-prefetch off: its copies read the experts from page-locked host memory, and "
                     "they stay memory-mapped in the file")
            self.miss_prefetch = 0

        # KV cache, rotary table, step buffers
        kd, vd = KV_TYPES[cache_type_k], KV_TYPES[cache_type_v]
        st = self.state = SimpleNamespace(fast=self.fast, bufs=SimpleNamespace())
        n_pos = self.ctx_size * self.n_seq
        try:
            kv_all = self.net.new_caches(self.ctx_size, kd, vd, self.n_seq)
        except torch.OutOfMemoryError:
            per = a.n_layer * a.n_head_kv * a.head_dim * (_KV_BYTES[cache_type_k] + _KV_BYTES[cache_type_v])
            raise FleError(f"the KV cache for {n_pos} positions needs about {per * n_pos / 2**30:.1f} "
                           f"GiB of GPU memory, more than is free; lower --ctx-size") from None
        st.kv = kv_all if self.n_seq == 1 else _lane_caches(kv_all, 0)
        cos, sin = rope_table(a.n_rot, a.rope_base, self.ctx_size, a.rope_freq_scale)
        st.rope_cos, st.rope_sin = torch.from_numpy(cos).to(self.device), torch.from_numpy(sin).to(self.device)
        # what a step gives the host, in one buffer (one copy per step): routed ids, hit flags, the next token
        st.out_log, (st.ids_log, st.hit_log, st.tok) = _out_log(a.n_layer, a.n_expert_used, self.device)
        if self.n_seq == 1:
            st.pos = torch.zeros(1, dtype=torch.int64, device=self.device)
        else:       # every lane's position, on the device; lane i's state holds a view of its own
            self._lane_pos = torch.zeros(self.n_seq, dtype=torch.int64, device=self.device)
            st.pos = self._lane_pos[:1]
        st.serial = torch.zeros(1, dtype=torch.int64, device=self.device)      # steps run (runtime.split)
        st.split = None
        # q8: the GPU's misses multiply their activations rounded as the CPU kernels quantize them (ggml's
        # vec_dot_type), so that a token's numbers do not depend on which side computed a miss
        st.miss_q8 = miss_activations == "q8"
        self.net.alloc(st)
        self.kv_bytes = sum(engine_ops.kv_nbytes(t) for c in kv_all for t in c)
        if head is not None:
            from .mtp import Drafter, StepDrafter

            if isinstance(head, tuple):         # the head's block on the engine's kernels, its experts resident
                self.drafter = StepDrafter(self.net, *head, self.ops, st.rope_cos, st.rope_sin, self.ctx_size,
                                           KV_TYPES[cache_type_k], KV_TYPES[cache_type_v], graphs)
            else:
                self.drafter = Drafter(head, st.rope_cos, st.rope_sin, self.ctx_size)
        self._lanes = None
        self._lane = 0
        if self.n_seq > 1:
            self._setup_lanes(kv_all)

        # the expert cache under its budget
        self.fingerprint = model_fingerprint(gguf)
        self.profile_path = self._profile_path(profile_path)
        profile = self._load_profile()
        budget = parse_budget(cache_budget)
        total_experts = sum(lay.expert_bytes for lay in self.net.layouts.values()) * a.n_expert
        prefill_on = bool(getattr(self.net, "supports_prefill", False) and ubatch > 0)
        no_kernel = sorted({qt.name for lay in self.net.layouts.values() for qt in (lay.gu_type, lay.down_type)
                            if qt not in engine_ops.WORDS})
        if prefill_on and no_kernel:            # (the GPU engine refuses such experts at start anyway)
            self.log(f"fle-engine: prefill off: experts of type {', '.join(no_kernel)} have no prefill kernels; "
                     f"prompts run as decode steps")
            prefill_on = False
        self.prefill_bytes = prefill_bytes(self.net, ubatch) if prefill_on else 0
        if budget is None:
            if self.cuda:
                free, _ = torch.cuda.mem_get_info(self.device)
                # keep 1.25 GiB for graphs and the allocator, and room for prefill's buffers (its staging is lent)
                budget = max(0, free - (1 << 30) - (256 << 20) - self.prefill_bytes)
            else:
                budget = total_experts
        budget = min(budget, total_experts)
        self.cache = ExpertCache(self.net.layouts, self.host, a.n_expert, budget, self.device, policy, profile,
                                 stage_rows=self.miss_prefetch)
        if profile is not None:
            self.cache.warm(profile)
        # layers that fit whole are on the GPU from the start (with memory-mapped experts on CUDA their cold
        # misses would also have nowhere to run: such layers are not in the miss split)
        self.cache.fill_whole_layers()
        if self._lanes is not None and self.cuda:
            self._lanes_ev = self.cache.calls.event()
        self.prefetch = st.stage = None
        if self.miss_prefetch and any(self.cache.slots_per_layer[l] < a.n_expert for l in self.net.layouts):
            from .stage import MissPrefetch

            self.prefetch = st.stage = MissPrefetch(self.net, self.cache, self.miss_prefetch, self.device, self.fast,
                                                    t_max=VERIFY_MAX)
            self.log(f"misses: up to {self.miss_prefetch} predicted misses per layer copied one layer ahead on a "
                     f"copy stream ({self.cache.stage_nbytes / 2**20:.0f} MiB of the budget)")
        self.split = None
        self.miss_bandwidths = None      # bytes/s of misses on each side, when auto measured them
        self._setup_split(miss_split)
        self._graph = None
        self._graphs = {}
        self.stats = RunStats()
        # cached experts used per step, for the hit rate over time (the last 2^20 steps: bounded in a server)
        self.step_hits = deque(maxlen=1 << 20)
        # per lane: routed-expert lookups and hits of its rows in the steps read (a request's hit rate)
        self.lane_routed = np.zeros((self.n_seq, 2), np.int64)
        self.length = 0
        self.history: list = []          # the tokens whose effect the state holds, position by position
        self._last_tok = None            # the output of the last step read (or of a prefill)
        self.cached_tokens = 0           # the last prompt's leading tokens kept from the sequence before it
        self.prefill = None
        self.prefill_min = int(prefill_min)
        if not 1 <= int(prompt_rows) <= VERIFY_MAX:
            raise FleError(f"prompt_rows {prompt_rows}: a step takes 1 to {VERIFY_MAX} of a prompt's tokens")
        self.prompt_rows = int(prompt_rows)
        if prefill_on:
            self.prefill = Prefill(self, ubatch)
        self._rings()
        if self.cuda and graphs and self.fast:      # the reference operations synchronise: they run eagerly
            self._capture()
            if self._prompt_rows_on():              # the prompts' T-row step too: not in the first prompt's time
                self._multi_ready()
                self._capture_multi(self.prompt_rows)
        self.load_seconds = time.perf_counter() - t0
        self._last_profile_save = time.monotonic()
        self.report()

    @property
    def n_vocab(self) -> int:
        return self.args.n_vocab

    @property
    def arch(self) -> str:
        """The file's architecture (as the reference Model names it)."""
        return self.args.arch

    # set-up ------------------------------------------------------------------------
    def _fill_host(self, progress: bool) -> None:
        layers = sorted(self.net.layouts)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=self.host.nbytes, unit="B", unit_scale=True, desc="experts to host memory",
                       file=sys.stderr, leave=False)
        for il in layers:
            self.host.fill(il, self.net.expert_sources[il])
            if bar is not None:
                bar.update(self.host.n_expert * self.net.layouts[il].expert_bytes)
        if bar is not None:
            bar.close()
        self.net.expert_sources = {}

    def _load_mtp(self, spec, experts: str, drafter: str = "auto"):
        """The MTP head (``spec``: True for the one inside the model file, or
        a head file) for :meth:`speculative`; refused on nets without a
        T-token verify step. ``drafter``: ``step``, the head's block on the
        engine's kernels (the net's ``mtp_step``; a tuple (block, expert
        store) for :class:`~.mtp.StepDrafter`); ``eager``, the reference
        head in float32 (:func:`~.mtp.load_head`); ``auto``, step where the
        net has one."""
        from .mtp import load_head, load_step_head

        why = self.net.multi_unsupported()
        if why:
            raise FleError(f"MTP drafting on the engine needs its verify step: {why}; draft on the reference path "
                           f"(--device cpu)")
        a = self.args
        if spec is True:
            if f"blk.{a.n_layer}.nextn.eh_proj.weight" not in self._gguf.tensors:
                raise FleError(f"{self._gguf.paths[0]}: no MTP head inside (no blk.{a.n_layer}.nextn.* tensors); "
                               f"give a separate head file (--mtp-head FILE)")
            spec = self._gguf.paths[0]
        step = bool(getattr(self.net, "engine_mtp", False))
        if drafter == "step" and not step:
            raise FleError(f"the engine has no MTP head step for {a.arch}; use the eager drafter")
        # auto: the engine's step where the architecture has one, else the eager head
        if drafter == "step" or (drafter == "auto" and step):
            return load_step_head(self.net, spec, self.device)
        return load_head(self.net, spec, self.device, self.ops, self.fast, experts)

    def _setup_split(self, spec) -> None:
        """The CPU's share of the misses (``--miss-split``), measured for
        ``auto``; nothing to split when every layer's experts are cached."""
        a = self.args
        if self._lanes is not None:
            self._bst.miss_q8 = self.state.miss_q8
        share = parse_split(spec)
        layers = [il for il in self.net.layouts if self.cache.slots_per_layer[il] < a.n_expert]
        if not layers:
            return
        # t_max: room for the rows of the verify step and of the batched step of several sequences
        t_max = min(max(VERIFY_MAX, self.n_seq), 255 // a.n_expert_used)
        if self.host.mapped and self.cuda:
            # the GPU cannot read pageable memory: every miss of every step goes to the CPU
            if t_max < max(VERIFY_MAX, self.n_seq):
                raise FleError(f"with the routed experts memory-mapped the CPU computes every miss, for at most "
                               f"{t_max} rows a step; serve at most {t_max} sequences (--parallel), or run with "
                               f"--host-experts pinned")
            share = SHARE_ONE
        if not share or (share == "auto" and not self.cuda):
            return
        try:
            cpu = cpu_experts(self.host, self.net.layouts, self.cpu_impl)
        except FleError as e:
            if self.host.mapped and self.cuda:
                raise FleError(f"the routed experts are memory-mapped, so the CPU computes every miss, and: {e}; "
                               f"pick other --cpu-kernels or run with --host-experts pinned") from None
            if share != "auto":
                raise FleError(f"--miss-split {spec}: {e}") from None
            self.log(f"misses: all on the GPU ({e})")
            return
        if share == "auto":
            # the cold case, where the split matters most: routing spread evenly, so each routed expert misses
            # as often as the split layers leave experts out of their slots
            p_miss = float(np.mean([1 - self.cache.slots_per_layer[l] / a.n_expert for l in layers]))
            share = self._measure_split(cpu, layers[0], p_miss)
        if share:
            self.split = self.state.split = MissSplit(cpu, layers, a.n_embd, a.n_expert_used, share, self.cuda,
                                                      self.log, t_max=t_max)
            for rec in self._lanes or ():           # every lane's steps and the batched step share the counter
                rec.state.split = self.split
            if self._lanes is not None:
                self._bst.split, self._bst.serial = self.split, self.state.serial
            self.log(f"misses: {share / SHARE_ONE:.0%} computed on the CPU ({cpu.name} kernels), the rest read "
                     f"by the GPU over PCIe")
        assert not (self.host.mapped and self.cuda) or (self.split is not None and self.split.share == SHARE_ONE), \
            "internal: memory-mapped experts need every miss on the CPU"

    def _measure_split(self, cpu, il: int, p_miss: float) -> int:
        """``--miss-split auto``: measure layer ``il``'s expert launch on the
        GPU with every expert in a slot and with every expert missed, and the
        CPU's jobs at two sizes; decide with :func:`split.choose_share` for
        experts that miss with probability ``p_miss``."""
        a, lay, dev = self.args, self.net.layouts[il], self.device
        k, eb = a.n_expert_used, lay.expert_bytes
        rng = np.random.default_rng(0)
        ids = torch.from_numpy(rng.choice(a.n_expert, k, replace=False).astype(np.int64)).to(dev)
        none = torch.full((a.n_expert,), -1, dtype=torch.int32, device=dev)
        x = torch.from_numpy(rng.standard_normal((1, a.n_embd)).astype(np.float32) * 0.1).to(dev)   # no CUDA RNG
        h = torch.zeros(k, lay.n_ff, device=dev)
        y = torch.zeros(k, a.n_embd, device=dev)
        w = torch.full((k,), 1.0 / k, device=dev)
        n_slots = self.cache.slots_per_layer[il]
        hits = None
        if n_slots:                     # the routed experts in the layer's slots (their bytes do not matter)
            hits = none.clone()
            hits[ids] = torch.arange(k, dtype=torch.int32, device=dev) % n_slots

        gate_up, down = expert_products(self.cache, il, lay, a.n_embd, self.fast)   # as the step's launch

        def gpu_once(smap):
            self.ops.experts_ffn(gate_up, down, smap, ids, x, h, y, k, w, mode="miss")

        def eager_seconds(smap, reps=20):
            sync = torch.cuda.synchronize if self.cuda else (lambda d: None)   # the CPU: the same steps, in tests
            gpu_once(smap)
            sync(dev)
            t0 = time.perf_counter()
            for _ in range(reps):
                gpu_once(smap)
            sync(dev)
            return (time.perf_counter() - t0) / reps

        def gpu_seconds(smap, reps=20):
            # on CUDA the launches replayed from a graph, as the decode step runs them: timed eagerly, a layer with
            # every expert cached took 100-230 us of launch overhead for ~25 us of kernels (2026-12-07), which the
            # decision then took for GPU work
            if not self.cuda:
                return eager_seconds(smap, reps)
            try:
                g = capture_graph(dev, None, lambda: [gpu_once(smap) for _ in range(reps)])
                g.replay()
                torch.cuda.synchronize(dev)
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    g.replay()
                    torch.cuda.synchronize(dev)
                    best = min(best, (time.perf_counter() - t0) / reps)
                del g
                return best
            except RuntimeError as e:       # a launch that cannot be captured here: the eager time, said
                self.log(f"misses measured eagerly (graph capture failed: {str(e).splitlines()[0][:120]})")
                torch.cuda.synchronize(dev)
                return eager_seconds(smap, reps)

        t_miss = gpu_seconds(none)
        t_base = gpu_seconds(hits) if hits is not None else 0.0
        gpu = k * eb / t_miss
        # the CPU's jobs as the worker gets them, at two sizes: about 3/8 and 3/4 of a token's experts
        n1 = max(1, k * 3 // 8)
        sizes = (n1, min(k, max(n1 + 1, k * 3 // 4)))          # one size when a token routes to one expert
        if cpu.impl in ("ggml", "numba"):
            from ..kernels.cpu_experts.team import job_seconds

            assert not self.host.mapped, "internal: --miss-split auto is not measured on memory-mapped experts"
            t_job = [job_seconds(self.host.buf, self.host.offsets[il], lay, cpu.impl, split_threads(), k,
                                 a.n_expert, kc) for kc in dict.fromkeys(sizes)]
        else:
            xs = x.view(-1).cpu().numpy()
            out = np.zeros(a.n_embd, np.float32)
            t_job = []
            for kc in dict.fromkeys(sizes):
                w_h = np.full(kc, 1.0 / kc, np.float32)
                busy, reps = 0.0, 0
                while reps < 5 or busy < 0.2:
                    e = rng.choice(a.n_expert, kc, replace=False)
                    t0 = time.perf_counter()
                    cpu.ffn(il, e, w_h, xs, out)
                    busy += time.perf_counter() - t0
                    reps += 1
                t_job.append(busy / reps)
        if len(t_job) == 1:                     # one size: its time for both
            t_job = t_job * 2
        cpu_bw = sizes[0] * eb / t_job[0]
        share = choose_share(job_model(sizes[0], t_job[0], sizes[1], t_job[1]), t_base, max(0.0, t_miss - t_base) / k,
                             k, p_miss)
        share = share if share >= SHARE_ONE // 32 else 0
        self.miss_bandwidths = {"gpu": gpu, "cpu": cpu_bw, "gpu_base_s": t_base, "cpu_job_s": dict(zip(sizes, t_job)),
                                "p_miss": p_miss}
        self.log(f"misses measured: GPU reads {gpu / 1e9:.1f} GB/s over PCIe (the layer's launch "
                 f"{t_base * 1e6:.0f} us with every expert cached, {t_miss * 1e6:.0f} us with none), the CPU "
                 f"({cpu.name} kernels) {cpu_bw / 1e9:.1f} GB/s ({sizes[0]} experts {t_job[0] * 1e6:.0f} us, "
                 f"{sizes[1]} {t_job[1] * 1e6:.0f} us) -> CPU share {share / SHARE_ONE:.0%} (at {p_miss:.0%} "
                 f"of the routed experts missed)")
        return share

    def _profile_path(self, spec) -> "Path | None":
        if spec is None or spec == "none":
            return None
        if spec == "auto":
            root = Path(os.environ.get("FLE_CACHE_DIR", Path.home() / ".cache" / "fle")) / "profiles"
            return root / f"{self.fingerprint[:16]}.json"
        return Path(spec)

    def _load_profile(self) -> "Profile | None":
        p = self.profile_path
        if p is None or not p.exists():
            return None
        try:
            prof = load_profile(p, self.fingerprint)
        except FleError as e:
            self.log(f"expert cache profile not used: {e}; starting cold")
            return None
        if set(prof.counts) != set(self.net.layouts) or any(
                len(c) != self.args.n_expert for c in prof.counts.values()):
            self.log(f"expert cache profile {p} does not match this model's layers; starting cold")
            return None
        self.log(f"expert cache: warm start from {p}")
        return prof

    def save_stats(self, path, force: bool = False) -> None:
        """The cache's hit counts per decode step as ``fle.engine-stats/1``
        JSON (``fle-plot hit-rate`` draws them)."""
        self._flush_lanes()
        from fle_quant.textio import write_json_atomic

        a = self.args
        write_json_atomic(path, {"format": "fle.engine-stats/1", "model": str(self.path),
                                 "requests_per_step": a.n_layer * a.n_expert_used,
                                 "cache_bytes": self.cache.budget_used,
                                 "hits": list(self.step_hits)}, force=force)

    def save_profile(self) -> None:
        if self.profile_path is None:
            return
        self._flush_lanes()
        self.profile_path.parent.mkdir(parents=True, exist_ok=True)
        save_profile(self.profile_path, Profile(self.fingerprint, self.cache.profile_counts()))
        self._last_profile_save = time.monotonic()

    def _host(self, *shape, dt) -> torch.Tensor:
        """A host buffer the GPU copies to and from: page-locked with CUDA."""
        t = torch.zeros(*shape, dtype=dt)
        return t.pin_memory() if self.cuda else t

    def _rings(self) -> None:
        a = self.args
        mk = self._host
        self._ring_out = [mk(self.state.out_log.numel(), dt=torch.int32) for _ in range(_RING)]
        views = [_out_views(r, a.n_layer, a.n_expert_used) for r in self._ring_out]
        # the host reads them through numpy views made once
        self._ring_ids, self._ring_hits, self._ring_tok = ([v[j].numpy() for v in views] for j in range(3))
        self._ring_ev = [self.cache.calls.event() for _ in range(_RING)] if self.cuda else [None] * _RING
        self._tok_in = mk(_RING, dt=torch.int64)
        self._tok_np = self._tok_in.numpy()                      # written by the host, read by copies
        self._tok_rows = [self._tok_in[i:i + 1] for i in range(_RING)]
        self.launched = self.consumed = 0

    def _capture(self) -> None:
        """One CUDA graph per variant of the step (``net.variants``: length
        buckets where the step's shapes follow the used length), sharing one
        memory pool (they never run at once)."""
        pool = None
        for lane in range(self.n_seq):                   # with several lanes: each lane's own graphs
            if self.n_seq > 1:
                self.select(lane)
            st = self.state
            graphs = {}
            for v in self.net.variants(self.ctx_size):
                self.net.set_variant(st, v)
                g = capture_graph(self.device, pool, self._step)
                pool = g.pool()
                graphs[v] = g
                st.pos.zero_()
                self.net.reset(st)
                torch.cuda.synchronize(self.device)
            self._graphs = graphs
            self._graph = next(iter(graphs.values()))
        if self.n_seq > 1:
            self.select(0)

    def _step(self) -> None:
        self.state.serial.add_(1)
        self.net.step(self.state, self.ops, self.cache)

    def memory_report(self) -> dict:
        rep = {"dense_weights": self.net.dense_bytes, "kv_cache": self.kv_bytes, "expert_slots": self.cache.nbytes,
               "expert_budget_used": self.cache.budget_used, "host_experts": self.host.nbytes,
               "host_experts_mode": self.host.mode,
               "prefill_buffers": self.prefill_bytes}
        if self.drafter is not None:
            rep["mtp_head"] = self.drafter.nbytes
        if self.cuda:
            rep["allocated"] = torch.cuda.memory_allocated(self.device)
            rep["reserved"] = torch.cuda.memory_reserved(self.device)
        return rep

    def report(self) -> None:
        m = self.memory_report()
        gib = 2 ** 30
        slots = self.cache.slots_per_layer
        n_slots = sum(slots.values())
        self.log(f"fle-engine: {self.path.name}: {self.args.arch}, {self.args.n_layer} layers, "
                 f"{self.args.n_expert} experts ({self.args.n_expert_used} used), context {self.ctx_size}"
                 + (f" per sequence x {self.n_seq} sequences" if self.n_seq > 1 else "") + ", "
                 f"loaded in {self.load_seconds:.1f} s")
        self.log(f"memory: expert cache {m['expert_slots'] / gib:.2f} GiB ({n_slots} slots, "
                 f"{n_slots / (self.args.n_expert * self.args.n_layer):.1%} of the experts) + dense weights "
                 f"{m['dense_weights'] / gib:.2f} GiB + KV {m['kv_cache'] / gib:.2f} GiB"
                 + (f" = {m['allocated'] / gib:.2f} GiB allocated on the GPU ({m['reserved'] / gib:.2f} reserved)"
                    if self.cuda else "")
                 + (f"; prefill buffers up to {m['prefill_buffers'] / gib:.2f} GiB while a prompt is prefilled"
                    if m["prefill_buffers"] else "")
                 + (f"; MTP head {m['mtp_head'] / gib:.2f} GiB ({self.drafter.kind})" if "mtp_head" in m else "")
                 + f"; host experts {m['host_experts'] / gib:.2f} GiB {self._host_where()}; "
                 + (("CUDA graph" if len(self._graphs) == 1 else f"CUDA graph ({len(self._graphs)} length buckets)")
                    if self._graph is not None else "eager")
                 + f" steps ({'triton' if self.fast else 'reference'})")

    def _host_where(self) -> str:
        return {"pinned": "page-locked", "process": "in process memory",
                "mapped": f"memory-mapped in {self.path.name}"}[self.host.mode]

    # stepping ---------------------------------------------------------------------
    def _launch(self, token: "int | None") -> None:
        st = self.state
        self._flush_lanes()
        self.cache.boundary()
        t0 = time.perf_counter()
        i = self.launched % _RING
        if self.cuda:
            c, main = self.cache.calls, self.cache.main
        if token is not None:
            if self.cuda:
                c.synchronize(self._ring_ev[i])     # the copy out of this ring entry, _RING steps ago, is done
                self._tok_np[i] = token
                c.copy(st.tok, self._tok_rows[i], main)
            else:
                self._tok_np[i] = token
                st.tok.copy_(self._tok_rows[i])
        # a step fed on the device takes the previous step's output: known once that step is read (else None,
        # filled in then)
        self.history.append(self._last_tok if token is None and self.consumed == self.launched else token)
        t1 = time.perf_counter()
        self._run_one()
        self.stats.replay_seconds += time.perf_counter() - t1
        if self.cuda:
            c.copy(self._ring_out[i], st.out_log, main)
            c.record(self._ring_ev[i], main)
        else:
            self._ring_out[i].copy_(st.out_log)
        self.launched += 1
        self.stats.launch_seconds += time.perf_counter() - t0

    def _run_one(self) -> None:
        """One decode step at the current position: its graph replayed, or eagerly."""
        v = self.net.variant_for(self.launched, self.ctx_size)      # the step's position: steps since reset
        if self._graph is not None:
            self._graphs[v].replay()
        else:
            self.net.set_variant(self.state, v)
            with torch.inference_mode():
                self._step()

    def _consume(self) -> int:
        i = self.consumed % _RING
        if self.cuda:
            self.cache.calls.synchronize(self._ring_ev[i])
        hits = self._ring_hits[i]
        self.cache.observe(self._ring_ids[i], hits)
        n_hit = int(np.count_nonzero(hits))
        self.step_hits.append(n_hit)
        self.lane_routed[self._lane] += (hits.size, n_hit)
        if self.split is not None:
            self.split.check()
        self.consumed += 1
        if self.profile_path is not None and time.monotonic() - self._last_profile_save > PROFILE_EVERY_S:
            self.save_profile()
        tok = self._last_tok = int(self._ring_tok[i][0])
        h = self.history                 # the step's output is the token the next step was fed
        if self.consumed < len(h) and h[self.consumed] is None:
            h[self.consumed] = tok
        return tok

    def reset(self) -> None:
        """Start a new sequence at position 0 (the expert cache keeps its contents)."""
        self.state.pos.zero_()
        self.net.reset(self.state)
        self.launched = self.consumed = 0
        self.length = 0
        self.history = []
        self._last_tok = None
        self._multi_at = None

    def _reuse(self, prompt: list[int]) -> int:
        """How many leading tokens of ``prompt`` the sequence in the state
        already holds (llama-server's cache_prompt): with only positional
        state (qwen3moe: the KV cache) the longest common prefix with the
        tokens processed, at most all but the prompt's last token; with
        recurrent state (GDN, PLE, hyper-connections) the whole of them,
        when the prompt extends them; else 0."""
        h = self.history
        if not h or None in h or self.launched != len(h) or self.consumed != self.launched:
            return 0
        n = 0
        for a, b in zip(h, prompt):
            if a != b:
                break
            n += 1
        if getattr(self.net, "positional_state", False):
            return min(n, len(prompt) - 1)
        return n if n == len(h) and n < len(prompt) else 0

    def _resume(self, start: int) -> None:
        """Continue the sequence from position ``start`` (its first ``start``
        tokens kept; later positions are written again)."""
        self.history = self.history[:start]
        self.state.pos.fill_(start)
        self.launched = self.consumed = start
        self.length = start

    def generate(self, prompt: Sequence[int], n_predict: int, stop: "set[int] | None" = None,
                 on_token: "Callable[[int], None] | None" = None, sampler=None,
                 feed: "Sequence[int] | None" = None, cache_prompt: bool = True) -> list[int]:
        """The tokens of :meth:`tokens` as a list (``on_token`` is called with each)."""
        out = []
        for t in self.tokens(prompt, n_predict, stop, sampler=sampler, feed=feed, cache_prompt=cache_prompt):
            out.append(t)
            if on_token is not None:
                on_token(t)
        return out

    def tokens(self, prompt: Sequence[int], n_predict: int, stop: "set[int] | None" = None, sampler=None,
               feed: "Sequence[int] | None" = None, cache_prompt: bool = True) -> Iterator[int]:
        """Process ``prompt`` (in micro-batches, or one token per step) and
        yield up to ``n_predict`` generated tokens, stopping after one in
        ``stop``, or at the end of the context. Greedy by default, with one
        step of look-ahead; with ``sampler`` (a :class:`~fle_engine.sampling.Sampler`)
        each step's logits are read on the host and sampled there.
        ``feed``: tokens to feed instead of the generated ones (teacher
        forcing, as llama-bench feeds random tokens). ``cache_prompt``: the
        leading tokens that the state already holds from the previous
        sequence are not computed again (:meth:`_reuse`; ``cached_tokens``
        says how many were kept)."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise FleError("generation needs at least one prompt token")
        self._flush_lanes()
        if len(prompt) >= self.ctx_size:
            raise FleError(f"the prompt has {len(prompt)} tokens; the context holds {self.ctx_size}")
        n_predict = max(0, min(int(n_predict), self.ctx_size - len(prompt)))   # stop at the context's end
        stop = stop or set()
        start = self._reuse(prompt) if cache_prompt else 0
        if start:
            self._resume(start)
        else:
            self.reset()
        self.cached_tokens = start
        if n_predict == 0:
            return
        gen = self._sampled(prompt, n_predict, stop, sampler) if sampler is not None else \
            self._greedy(prompt, n_predict, stop, feed)
        yield from gen

    def _greedy(self, prompt, n_predict, stop, feed) -> Iterator[int]:
        total = len(prompt) + n_predict - 1        # steps to run; the last token needs none
        t_start = time.perf_counter()
        t_prompt_end = None
        n_out = 0
        try:
            first = self._prefill_prompt(prompt) if self._use_prefill(prompt) else None
            if first is None:
                self._prompt_in_rows(prompt)
            else:
                t_prompt_end = time.perf_counter()
                n_out = 1
                self.length = len(prompt) + 1
                yield first
                if first in stop or n_out >= n_predict:
                    return
            while True:
                if self.launched < total:
                    n = self.launched
                    tok = prompt[n] if n < len(prompt) else (feed[n - len(prompt)] if feed is not None else None)
                    self._launch(tok)
                pending = self.launched - self.consumed
                if pending >= 2 or (pending >= 1 and self.launched >= total):
                    step = self.consumed
                    tok = self._consume()
                    if step == len(prompt) - 1:
                        t_prompt_end = time.perf_counter()
                    if step >= len(prompt) - 1:
                        n_out += 1
                        self.length = len(prompt) + n_out
                        yield tok
                        if tok in stop or n_out >= n_predict:
                            return
                if self.consumed >= total:
                    return
        finally:
            while self.consumed < self.launched:     # steps launched past a stop: their routing still counts
                self._consume()
            t_end = time.perf_counter()
            t_prompt_end = t_prompt_end or t_end
            self.stats.prompt_tokens += len(prompt) - self.cached_tokens
            self.stats.prompt_seconds += t_prompt_end - t_start
            self.stats.gen_tokens += max(0, n_out - 1)
            self.stats.gen_seconds += t_end - t_prompt_end

    def _prompt_rows_on(self) -> bool:
        return self.prompt_rows > 1 and self.n_seq == 1 and not self.net.multi_unsupported()

    def _prompt_in_rows(self, prompt, on_step: "Callable[[int], None] | None" = None) -> None:
        """The prompt's tokens from the current position up to its last (not
        included: the step loop runs that one and reads its logits) in
        steps of ``prompt_rows`` tokens, the verify step's T-row pass
        (:meth:`verify_step`; its outputs are not needed), the fewer left
        one per step: one T, so one graph, captured with the decode step's.
        ``on_step(T)`` is called after each step (the MTP head reads its
        rows). Nothing on an engine of several sequences, a net without
        that pass, or with ``prompt_rows`` 1."""
        if not self._prompt_rows_on():
            return
        end = len(prompt) - 1
        while end - self.launched >= self.prompt_rows:
            toks = prompt[self.launched:self.launched + self.prompt_rows]
            self.verify_step(toks)
            self.history.extend(toks)
            if on_step is not None:
                on_step(len(toks))
        self._multi_at = None           # no rewind into a prompt

    def _use_prefill(self, prompt) -> bool:
        return self.prefill is not None and len(prompt) - self.launched >= self.prefill_min

    def _prefill_prompt(self, prompt, keep_hidden: bool = False) -> "int | None":
        """The prompt in micro-batches (runtime.prefill); the steps that
        follow continue from its end. Returns the greedy next token, or None
        when the GPU ran out of memory or failed: prefill is then off for
        this engine, the sequence is reset and the prompt runs as decode
        steps (said in one line). ``keep_hidden``: the prompt's rows that an
        MTP head reads are left in ``self.prefill.hidden``."""
        start = self.launched
        try:
            self.prefill.run(prompt[start:], start, keep_history=True, keep_hidden=keep_hidden)
        except Exception as e:  # noqa: BLE001 - on the GPU: out of memory, a kernel that fails to build or run
            if not self.cuda:
                raise
            self.log(f"fle-engine: prefill failed ({type(e).__name__}: {str(e).splitlines()[0][:160]}); prompts "
                     f"run as decode steps from now on (a smaller -ub needs less memory)")
            self.prefill = None
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self.reset()
            self.cached_tokens = 0
            return None
        self.history.extend(prompt[start:])
        self.launched = self.consumed = len(prompt)
        first = self._last_tok = int(self.state.tok[0])
        return first

    def _sampled(self, prompt, n_predict, stop, sampler) -> Iterator[int]:
        t0 = time.perf_counter()
        t1 = None
        n_out = 0
        try:
            if self._use_prefill(prompt) and self._prefill_prompt(prompt) is not None:
                t1 = time.perf_counter()
                tok = int(sampler(self.state.bufs.logits[0].float().cpu().numpy()))
                n_out = 1
                self.length = len(prompt) + 1
                yield tok
                if tok in stop or n_out >= n_predict:
                    return
            else:
                self._prompt_in_rows(prompt)
                tok = prompt[self.launched]
            while True:
                self._launch(tok)
                self._consume()
                n = self.launched
                if n < len(prompt):
                    tok = prompt[n]
                    continue
                if t1 is None:
                    t1 = time.perf_counter()
                tok = int(sampler(self.state.bufs.logits[0].float().cpu().numpy()))
                n_out += 1
                self.length = len(prompt) + n_out
                yield tok
                if tok in stop or n_out >= n_predict:
                    return
        finally:
            t2 = time.perf_counter()
            self.stats.prompt_tokens += len(prompt) - self.cached_tokens
            self.stats.prompt_seconds += (t1 or t2) - t0
            self.stats.gen_tokens += max(0, n_out - 1)
            self.stats.gen_seconds += t2 - (t1 or t2)

    # several sequences (lanes) ------------------------------------------------------
    def _setup_lanes(self, kv_all: list) -> None:
        """Lane i's device state: its views of the lane-stacked caches and
        recurrent states, its position (a view of ``_lane_pos``), the shared
        scratch buffers (with the net's per-lane parts); and the state of
        the batched step, whose ``kv`` are the stacked tensors."""
        st, n = self.state, self.n_seq
        lane_bufs, batch_bufs = self.net.lane_bufs(st, n)
        self._lanes = []
        for i in range(n):
            ls = st if i == 0 else SimpleNamespace(**vars(st))
            ls.kv = _lane_caches(kv_all, i)
            ls.pos = self._lane_pos[i:i + 1]
            ls.bufs = lane_bufs[i]
            self._lanes.append(SimpleNamespace(state=ls, history=[], launched=0, consumed=0, length=0,
                                               _last_tok=None, cached_tokens=0, _multi_at=None, _graphs={}))
        dev = self.device
        b = self._bst = SimpleNamespace(fast=st.fast, kv=kv_all, bufs=batch_bufs, rope_cos=st.rope_cos,
                                        rope_sin=st.rope_sin, lane_pos=self._lane_pos, split=None,
                                        rows=torch.zeros(n, dtype=torch.int64, device=dev),
                                        row_pos=torch.zeros(n, dtype=torch.int64, device=dev))
        self.net.alloc_multi(b, n, snapshots=False)
        k = self.args.n_expert_used
        mk = self._host
        self._b_tok = mk(n, dt=torch.int64)
        self._b_rows = mk(n, dt=torch.int64)
        self._b_tok_np, self._b_rows_np = self._b_tok.numpy(), self._b_rows.numpy()   # filled from lists
        self._b_next = mk(n, dt=torch.int64)
        self._b_logits = mk(n, self.args.n_vocab, dt=torch.float32)
        # the routing logs of two consecutive steps: step t's is read by the host (the cache policy) while step
        # t + 1 runs and copies its own into the other pair
        self._b_ids = [mk(self.args.n_layer, n * k, dt=torch.int32) for _ in range(2)]
        self._b_hits = [mk(self.args.n_layer, n * k, dt=torch.int32) for _ in range(2)]
        self._b_parity = 0
        self._lanes_inflight = None      # (lanes, tokens, rows, start time, parity) of the step launched, not read
        self._lanes_routing = None       # (parity, rows) of the last step read, its routing not yet observed
        self._lanes_ev = None            # the batched step's event: made with the expert cache's calls (below)
        self._lane_graphs, self._lane_pool = {}, None

    def select(self, lane: int) -> None:
        """Make lane ``lane`` the sequence that the one-sequence methods
        (``tokens``, ``generate``, ``reset``, prefill) run on; the lane
        before keeps its state and tokens. No steps may be in flight."""
        lane = int(lane)
        if not 0 <= lane < self.n_seq:
            raise FleError(f"lane {lane}: the engine holds lanes 0..{self.n_seq - 1}")
        if getattr(self, "_lanes_inflight", None) is not None:
            raise FleError("internal: a lane call while a batched step is in flight (finish_lanes reads it)")
        self._flush_lanes()
        if lane == self._lane:
            return
        if self.launched != self.consumed:
            raise FleError("internal: a lane switch while decode steps are in flight")
        self._park()
        self._unpark(lane)

    def _park(self) -> None:
        rec = self._lanes[self._lane]
        for f in _LANE_FIELDS:
            setattr(rec, f, getattr(self, f, None))

    def _unpark(self, lane: int) -> None:
        rec = self._lanes[lane]
        for f in _LANE_FIELDS:
            setattr(self, f, getattr(rec, f))
        self._lane = lane

    @property
    def lane(self) -> int:
        """The selected lane (0 on an engine of one sequence)."""
        return self._lane

    def lane_reuse(self, lane: int, prompt: Sequence[int]) -> int:
        """How many leading tokens of ``prompt`` lane ``lane`` would keep (:meth:`_reuse`)."""
        self.select(lane)
        return self._reuse([int(t) for t in prompt])

    def lane_reset(self, lane: int) -> None:
        """Lane ``lane`` starts a new sequence (nothing kept for its next prompt)."""
        self.select(lane)
        self.reset()

    def lane_prompt(self, lane: int, prompt: Sequence[int], cache_prompt: bool = True) -> "tuple[torch.Tensor, int]":
        """Process ``prompt`` on lane ``lane`` (prefill, or one-token steps
        when short; the leading tokens the lane already holds are kept with
        ``cache_prompt``, as :meth:`tokens` keeps them) -> (the logits after
        its last token, float32 [V] on the host; the tokens kept). The lane
        then holds the prompt; its next token goes to :meth:`step_lanes`."""
        self.select(lane)
        got = []

        def keep(x) -> int:
            got.append(torch.from_numpy(np.array(x, dtype=np.float32, copy=True)))
            return 0

        for _ in self.tokens(prompt, 1, sampler=keep, cache_prompt=cache_prompt):
            pass
        return got[0], self.cached_tokens

    def step_lanes(self, lanes: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """One batched decode step: token ``tokens[b]`` appended to lane
        ``lanes[b]`` (distinct lanes) at that lane's position, all rows
        through every layer at once (each row's attention over its own
        lane's cache, the routed experts of all rows as one union: each
        distinct expert read once; one CUDA graph per batch size with
        CUDA). Returns the logits of every row, float32 [B, V] on the host;
        the cache policy sees all B rows' routed ids as one step, one step
        late (at the next step's launch, while it runs; :meth:`flush` gives
        it at once). The greedy token after each row is in ``next_tokens``.
        :meth:`launch_lanes` and :meth:`finish_lanes` are its two halves."""
        self.launch_lanes(lanes, tokens)
        return self.finish_lanes()

    def launch_lanes(self, lanes: Sequence[int], tokens: Sequence[int]) -> None:
        """The first half of :meth:`step_lanes`: the batched step launched
        (with CUDA it runs on the device while this returns), then the
        routing of the step before it given to the cache policy, so that
        the policy's host work overlaps this step. Until :meth:`finish_lanes`
        reads it, no other call may use the lanes (they refuse)."""
        if self._lanes is None:
            raise FleError("step_lanes needs an engine of several sequences (n_seq > 1)")
        if self._lanes_inflight is not None:
            raise FleError("internal: a batched step is already in flight (finish_lanes reads it)")
        ls, toks = [int(i) for i in lanes], [int(t) for t in tokens]
        n = len(ls)
        if not 1 <= n <= self.n_seq or len(toks) != n or len(set(ls)) != n or not all(
                0 <= i < self.n_seq for i in ls):
            raise FleError(f"a batched step takes 1 to {self.n_seq} distinct lanes and one token each, not lanes "
                           f"{ls} and {len(toks)} tokens")
        self._park()
        for i in ls:
            rec = self._lanes[i]
            if rec.launched != rec.consumed:
                raise FleError("internal: a batched step while a lane has decode steps in flight")
            if rec.launched + 1 > self.ctx_size:
                raise FleError(f"lane {i} holds {rec.launched} positions: its context ({self.ctx_size}) is full")
        b, k = self._bst, self.args.n_expert_used
        t_start = time.perf_counter()
        self.cache.boundary()
        t0 = time.perf_counter()
        self._b_tok_np[:n] = toks
        self._b_rows_np[:n] = ls
        par = self._b_parity = 1 - self._b_parity
        m = b.multi
        # the routing logs are copied whole (n_seq x k columns: a few KiB), so that every copy is of contiguous
        # memory; the host reads their first n x k columns
        ins = ((b.toks[:n], self._b_tok[:n]), (b.rows[:n], self._b_rows[:n]))
        outs = ((self._b_logits[:n], m.logits[:n]), (self._b_next[:n], b.next_toks[:n]),
                (self._b_ids[par], m.ids_log), (self._b_hits[par], m.hit_log))
        if self.cuda:
            c, main = self.cache.calls, self.cache.main
            for dst, src in ins:
                c.copy(dst, src, main)
        else:
            for dst, src in ins:
                dst.copy_(src)
        t1 = time.perf_counter()
        self._run_lanes(n)
        self.stats.replay_seconds += time.perf_counter() - t1
        if self.cuda:
            for dst, src in outs:
                c.copy(dst, src, main)
            c.record(self._lanes_ev, main)
        else:
            for dst, src in outs:
                dst.copy_(src)
        for i in ls:
            self._lanes[i].launched += 1          # in flight: the lane refuses other calls until it is read
        self._unpark(self._lane)
        self._lanes_inflight = (ls, toks, n, t_start, par)
        self.stats.launch_seconds += time.perf_counter() - t0
        self._flush_lanes()                       # the step before: its routing to the policy, while this one runs

    def finish_lanes(self) -> torch.Tensor:
        """The second half of :meth:`step_lanes`: waits for the launched
        batched step and returns its logits, float32 [B, V] on the host
        (``next_tokens``: the greedy token after each row)."""
        if self._lanes_inflight is None:
            raise FleError("internal: no batched step in flight (launch_lanes starts one)")
        ls, toks, n, t_start, par = self._lanes_inflight
        self._lanes_inflight = None
        t0 = time.perf_counter()
        if self.cuda:
            self.cache.calls.synchronize(self._lanes_ev)
        self.stats.launch_seconds += time.perf_counter() - t0
        self._lanes_routing = (par, n)
        # each row's lookups and hits go to its lane now (distinct lanes), so a request ending here counts them
        n_layer, k = self.args.n_layer, self.args.n_expert_used
        self.lane_routed[ls, 0] += n_layer * k
        self.lane_routed[ls, 1] += np.count_nonzero(self._b_hits[par][:, :n * k].numpy().reshape(n_layer, n, k),
                                                    axis=(0, 2))
        self._park()
        nxt = self._b_next[:n].tolist()
        for j, i in enumerate(ls):
            rec = self._lanes[i]
            rec.history.append(toks[j])
            rec.consumed += 1
            rec.length = rec.launched + 1
            rec._last_tok = nxt[j]
            rec._multi_at = None
        self._unpark(self._lane)
        self.next_tokens = nxt
        if self.profile_path is not None and time.monotonic() - self._last_profile_save > PROFILE_EVERY_S:
            self.save_profile()
        self.stats.gen_tokens += n
        self.stats.gen_seconds += time.perf_counter() - t_start
        return self._b_logits[:n].clone()

    def flush(self) -> None:
        """The routing of the last batched step read (:meth:`finish_lanes`)
        given to the cache policy and the counters now (``cache.stats``,
        ``stats.multi_*``, ``step_hits``); otherwise the next step's launch
        or any other use of the engine gives it."""
        if getattr(self, "_lanes_inflight", None) is not None:
            raise FleError("internal: a batched step is in flight (finish_lanes reads it)")
        self._flush_lanes()

    def _flush_lanes(self) -> None:
        r = getattr(self, "_lanes_routing", None)
        if r is None:
            return
        self._lanes_routing = None
        par, n = r
        k = self.args.n_expert_used
        hits = self._b_hits[par][:, :n * k].numpy()
        ids = self._b_ids[par][:, :n * k].numpy()
        self.cache.observe(ids, hits, n)
        self._count_multi(ids, hits, n)
        self._token_hits(hits, n)

    def _token_hits(self, hits: np.ndarray, n: int) -> None:
        """A step of n rows (hits [L, n K]) in ``step_hits``: one entry per row,
        as one-token steps give (``save_stats``' requests per step)."""
        rows = hits.reshape(hits.shape[0], n, -1)
        self.step_hits.extend(np.count_nonzero(rows, axis=(0, 2)).tolist())

    def _run_lanes(self, n: int) -> None:
        """The batched step of n rows on the device (its graph replayed, or eagerly)."""
        if self._graph is not None:
            g = self._lane_graphs.get(n)
            (g if g is not None else self._capture_lanes(n)).replay()
        else:
            with torch.inference_mode():
                self.net.step_multi(self._bst, self.ops, self.cache, n)

    def _capture_lanes(self, n: int):
        """The CUDA graph of the batched step of n rows, captured with the
        rows as they are: the two eager runs that compile its kernels write
        the K/V the step itself is about to write, and the lanes' positions
        and recurrent states are put back after each."""
        b = self._bst
        backup = self.net.recurrent_backup(b)
        pos = b.lane_pos.clone()

        def reset():
            b.lane_pos.copy_(pos)
            self.net.recurrent_restore(b, backup)

        g = capture_graph(self.device, self._lane_pool, lambda: self.net.step_multi(b, self.ops, self.cache, n),
                          reset)
        self._lane_pool = g.pool()
        self._lane_graphs[n] = g
        return g

    # lane snapshots: a lane's sequence copied to host memory and put back ---------------
    def lane_tokens(self, lane: int) -> list:
        """The tokens whose effect lane ``lane`` holds (empty when a step of
        it is still in flight)."""
        self.select(lane)
        h = self.history
        if None in h or self.launched != len(h) or self.consumed != self.launched:
            return []
        return list(h)

    def lane_snapshot(self, lane: int) -> LaneSnapshot:
        """A host copy of lane ``lane``'s sequence at the tokens it holds
        (see :class:`LaneSnapshot`); the lane is left as it is."""
        tokens = self.lane_tokens(lane)
        if not tokens:
            raise FleError(f"lane {lane} holds no finished sequence to keep")
        with torch.inference_mode():
            parts = [v.detach().to("cpu", copy=True) for v in self.net.held_state(self.state, len(tokens))]
        return LaneSnapshot(tokens, parts, self._last_tok)

    def lane_restore(self, lane: int, snap: LaneSnapshot) -> None:
        """Put ``snap`` into lane ``lane``: it then holds that sequence, as if
        it had computed its tokens (a following prompt that extends them
        computes only the new ones; :meth:`step_lanes` continues it).
        Copied into the lane's own tensors in place (captured graphs keep
        their addresses)."""
        n = snap.n
        if not 0 < n <= self.ctx_size:
            raise FleError(f"a sequence of {n} tokens does not fit a lane of {self.ctx_size} positions")
        self.select(lane)
        if self.launched != self.consumed:
            raise FleError("internal: a lane restore while decode steps are in flight")
        views = self.net.held_state(self.state, n)
        if len(views) != len(snap.parts) or any(v.shape != p.shape or v.dtype != p.dtype
                                                for v, p in zip(views, snap.parts)):
            raise FleError("the kept sequence is of another model or KV cache type (its state's shapes differ)")
        with torch.inference_mode():
            for v, p in zip(views, snap.parts):
                v.copy_(p)
            self.state.pos.fill_(n)
        self.history = list(snap.tokens)
        self.launched = self.consumed = self.length = n
        self._last_tok = snap.last_tok
        self.cached_tokens = 0
        self._multi_at = None

    # verify steps: T = 1 + n tokens in one pass ------------------------------------
    def _one_lane(self, what: str) -> None:
        if self.n_seq > 1:
            raise FleError(f"{what} runs on an engine of one sequence; this one holds {self.n_seq} (n_seq)")

    def _multi_ready(self) -> None:
        """Refuse nets without a T-token step; allocate its buffers once."""
        self._one_lane("the verify step")
        why = self.net.multi_unsupported()
        if why:
            raise FleError(why)
        if self.launched != self.consumed:
            raise FleError("internal: a verify step while decode steps are in flight")
        if getattr(self.state, "multi", None) is None:
            self.net.alloc_multi(self.state, VERIFY_MAX)
            a = self.args
            mk = self._host
            self._multi_tok_in = mk(VERIFY_MAX, dt=torch.int64)
            self._multi_tok_out = mk(VERIFY_MAX, dt=torch.int64)
            self._multi_ids = mk(a.n_layer, VERIFY_MAX * a.n_expert_used, dt=torch.int32)
            self._multi_hits = mk(a.n_layer, VERIFY_MAX * a.n_expert_used, dt=torch.int32)
            self._multi_graphs, self._multi_pool = {}, None

    def _capture_multi(self, n: int):
        """The CUDA graph of the n-token step, captured at the current
        position: the two eager runs that compile its kernels write K/V at
        the positions the step itself is about to write, and the position
        is put back after each."""
        st = self.state
        backup = self.net.recurrent_backup(st)     # the eager runs advance GDN states: put back after each

        def reset():
            st.pos.sub_(n)
            self.net.recurrent_restore(st, backup)

        g = capture_graph(self.device, self._multi_pool, lambda: self.net.step_multi(st, self.ops, self.cache, n),
                          reset)
        self._multi_pool = g.pool()
        self._multi_graphs[n] = g
        return g

    def _run_multi(self, n: int) -> None:
        """One n-token step on the device (replayed, or eager without graphs)."""
        if self._graph is not None:
            g = self._multi_graphs.get(n)
            (g if g is not None else self._capture_multi(n)).replay()
        else:
            with torch.inference_mode():
                self.net.step_multi(self.state, self.ops, self.cache, n)

    def verify_step(self, tokens: Sequence[int]) -> list[int]:
        """Run ``tokens`` (1 to :data:`VERIFY_MAX`: the next token and up to
        three drafts) at the current position in one step and return the
        greedy token after each; the position advances by T = len(tokens).
        A caller that accepts the first j drafts keeps j + 1 of the returned
        tokens and calls :meth:`rewind` with T - 1 - j.

        Continues the sequence that :meth:`generate` (or earlier verify
        steps) left: after ``generate(prompt, 1)`` returned ``[g]``, pass
        ``[g, d1, ...]``. T = 1 is the plain decode step; T > 1 is the
        net's :meth:`~fle_engine.runtime.qwen3moe.Net.step_multi` (qwen3moe;
        qwen3next with its GDN layers run token by token inside the step and
        their states snapshotted for :meth:`rewind`), one CUDA graph per T (captured on first use) with CUDA and graphs.
        The step's routed ids (T x K per layer, repeats counted) and hit
        flags go to the cache policy as one step, synchronously. With the
        misses split (``miss_split``) the CPU computes its share of each
        layer's distinct missed experts for all the rows routed to them
        (runtime.split's union rule), the GPU reads the rest over PCIe;
        ``stats.multi_*`` count the bytes."""
        toks = [int(t) for t in tokens]
        n = len(toks)
        if not 1 <= n <= VERIFY_MAX:
            raise FleError(f"a verify step takes 1 to {VERIFY_MAX} tokens (the next one and up to "
                           f"{VERIFY_MAX - 1} drafts), not {n}")
        if self.launched + n > self.ctx_size:
            raise FleError(f"a verify step of {n} tokens at position {self.launched} runs past the context "
                           f"({self.ctx_size} positions)")
        self._one_lane("the verify step")
        if n == 1:
            self._launch(toks[0])
            out = [self._consume()]
            self.length = self.launched + 1
            self._multi_at = None
            return out
        self._multi_ready()
        st, k = self.state, self.args.n_expert_used
        self.cache.boundary()
        t0 = time.perf_counter()
        self._multi_tok_in[:n] = torch.tensor(toks, dtype=torch.int64)
        st.toks[:n].copy_(self._multi_tok_in[:n], non_blocking=True)
        self._run_multi(n)
        m = st.multi
        for dst, src in ((self._multi_tok_out[:n], st.next_toks[:n]),
                         (self._multi_ids[:, :n * k], m.ids_log[:, :n * k]),
                         (self._multi_hits[:, :n * k], m.hit_log[:, :n * k])):
            dst.copy_(src, non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self.stats.launch_seconds += time.perf_counter() - t0
        self.launched += n
        self.consumed += n
        self.length = self.launched + 1
        ids, hits = self._multi_ids[:, :n * k].numpy(), self._multi_hits[:, :n * k].numpy()
        self.cache.observe(ids, hits, n)
        self._count_multi(ids, hits, n)
        self._token_hits(hits, n)
        self.lane_routed[self._lane] += (hits.size, np.count_nonzero(hits))
        self._multi_at = (self.launched, n)        # what a rewind of a recurrent net may undo
        return self._multi_tok_out[:n].tolist()

    def rewind(self, n: int) -> None:
        """Move the position back by ``n`` (the rejected drafts of the last
        verify step): the KV cache is addressed by position, so the dropped
        positions are simply written again by later steps. On nets with
        recurrent state (qwen3next's GDN layers) ``n`` must be below the
        last verify step's T, right after it: the states are put back to the
        snapshots that step kept after each of its tokens (the kept tokens
        are not run again)."""
        n = int(n)
        self._one_lane("rewind")
        why = self.net.multi_unsupported()
        if why:
            raise FleError(f"rewind: {why}")
        if not 0 <= n <= self.launched:
            raise FleError(f"rewind by {n}: the sequence has {self.launched} positions")
        if self.launched != self.consumed:
            raise FleError("internal: rewind while steps are in flight")
        if n and not getattr(self.net, "positional_state", True):
            last = getattr(self, "_multi_at", None)
            if last is None or last[0] != self.launched or n >= last[1]:
                raise FleError(f"rewind by {n}: a net with recurrent state (GDN layers) can only drop up to T - 1 "
                               f"tokens of the verify step that just ran (its states are snapshotted per token)")
            self.net.restore_multi(self.state, last[1] - 1 - n)
        if n:
            self.state.pos.sub_(n)
            self.launched -= n
            self.consumed -= n
            self.length = self.launched + 1
        self._multi_at = None

    def speculative(self, prompt: Sequence[int], n_predict: int, stop: "set[int] | None" = None, n_draft: int = 2,
                    sampler=None, stats=None, vocab=None, adaptive=None) -> Iterator[int]:
        """Tokens as :meth:`tokens` gives them, drafted ahead by the MTP head
        (the engine made with ``mtp``) and checked in verify steps: see
        :func:`fle_engine.runtime.mtp.generate`. The sequence starts afresh
        (no prompt reuse)."""
        from .mtp import generate

        return generate(self, prompt, n_predict, stop or (), n_draft=n_draft, sampler=sampler, stats=stats,
                        vocab=vocab, adaptive=adaptive)

    def _layer_bytes(self) -> list:
        if self._layer_bytes_list is None:          # the layouts are fixed once the net is loaded
            lays = self.net.layouts
            self._layer_bytes_list = [lays[il].expert_bytes if il in lays else 0
                                      for il in range(self.args.n_layer)]     # ids_log row = layer
        return self._layer_bytes_list

    def miss_bytes(self, ids, hits, n_rows: int) -> dict:
        """:func:`~fle_engine.runtime.split.split_bytes` of a T-row step's
        routing log with this engine's share of the misses (0: all over PCIe)."""
        share = self.split.share if self.split is not None and self.split.rows_fit(n_rows) else 0
        return split_bytes(ids, hits, self._layer_bytes(), self.args.n_expert_used, share)

    def _count_multi(self, ids, hits, n_rows: int) -> None:
        b = self.miss_bytes(ids, hits, n_rows)
        st = self.stats
        st.multi_steps += 1
        st.multi_tokens += n_rows
        st.multi_pcie_bytes += b["pcie"]
        st.multi_cpu_bytes += b["cpu"]
        st.multi_pcie_bytes_sum += b["pcie_sum"]
        st.multi_cpu_bytes_sum += b["cpu_sum"]

    def step_cost(self, n_tok: int, reps: int = 20, seed: int = 0) -> dict:
        """The T = ``n_tok`` step measured at the current position with the
        cache as it is (no policy steps): ``seconds`` per replay (mean over
        ``reps``, after one unmeasured run), and per step the bytes of the
        missed experts read over PCIe: ``pcie_bytes_union`` (each distinct
        missed expert of a layer once, what the step reads) against
        ``pcie_bytes_sum`` (the sum over tokens, what T one-token steps
        would read), with ``miss_rows`` and ``distinct_misses``; with the
        misses split (``miss_share``) the step's ``pcie_bytes`` and
        ``cpu_bytes`` (the union rule) against ``pcie_bytes_tokens`` and
        ``cpu_bytes_tokens`` (each token by the one-token rule). The tokens
        are random, new ones each replay; the position is put back after
        each, so the sequence is left as it was (positions from the current
        one on are overwritten, as a later step would)."""
        n = int(n_tok)
        self._one_lane("step_cost")
        if not 1 <= n <= VERIFY_MAX or self.launched + n > self.ctx_size:
            raise FleError(f"step_cost: {n} tokens at position {self.launched} (1 to {VERIFY_MAX}, within the "
                           f"context of {self.ctx_size})")
        if n > 1:
            self._multi_ready()
        a, st, dev = self.args, self.state, self.device
        k = a.n_expert_used
        rng = np.random.default_rng(seed)
        toks = torch.from_numpy(rng.integers(a.n_vocab, size=(reps + 1, n))).to(dev)
        ids_log = st.ids_log if n == 1 else st.multi.ids_log[:, :n * k]
        hit_log = st.hit_log if n == 1 else st.multi.hit_log[:, :n * k]
        ids = torch.zeros(reps + 1, *ids_log.shape, dtype=torch.int32, device=dev)
        hits = torch.zeros_like(ids)

        backup = self.net.recurrent_backup(st)      # GDN states are put back after each replay too
        self._multi_at = None                       # the replays overwrite the verify step's snapshots

        def once(i: int) -> None:
            if n == 1:
                st.tok.copy_(toks[i])
                self._run_one()
            else:
                st.toks[:n].copy_(toks[i])
                self._run_multi(n)
            st.pos.sub_(n)
            self.net.recurrent_restore(st, backup)
            ids[i].copy_(ids_log)
            hits[i].copy_(hit_log)

        once(reps)                                   # compiles, captures, warms
        if self.cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for i in range(reps):
            once(i)
        if self.cuda:
            torch.cuda.synchronize(dev)
        seconds = (time.perf_counter() - t0) / reps
        eb = self._layer_bytes()
        ids_h, hits_h = ids[:reps].cpu().numpy(), hits[:reps].cpu().numpy()
        union = total = rows = distinct = 0.0
        sides = dict(pcie=0, cpu=0, pcie_sum=0, cpu_sum=0)
        for i in range(reps):
            for key, v in self.miss_bytes(ids_h[i], hits_h[i], n).items():
                sides[key] += v
            for li in range(ids_h.shape[1]):
                missed = ids_h[i, li][hits_h[i, li] == 0]
                n_distinct = len(np.unique(missed))
                rows += len(missed)
                distinct += n_distinct
                total += len(missed) * eb[li]
                union += n_distinct * eb[li]
        return {"tokens": n, "seconds": seconds, "pcie_bytes_union": union / reps, "pcie_bytes_sum": total / reps,
                "miss_rows": rows / reps, "distinct_misses": distinct / reps,
                "miss_share": self.split.share / SHARE_ONE if self.split is not None else 0.0,
                "pcie_bytes": sides["pcie"] / reps, "cpu_bytes": sides["cpu"] / reps,
                "pcie_bytes_tokens": sides["pcie_sum"] / reps, "cpu_bytes_tokens": sides["cpu_sum"] / reps,
                "hit_rate": float(hits_h.mean()) if hits_h.size else 1.0}

    def close(self) -> None:
        if getattr(self, "_lanes_inflight", None) is not None:
            self.finish_lanes()
        self._flush_lanes()
        if getattr(self, "cache", None) is not None and self.profile_path is not None:
            try:
                self.save_profile()
            except FleError as e:
                self.log(f"expert cache profile not saved: {e}")
        self._graph = None
        self._graphs = {}
        self._multi_graphs = {}
        self._lane_graphs = {}
        for rec in getattr(self, "_lanes", None) or ():
            rec._graphs = {}
        if getattr(self, "split", None) is not None:
            torch.cuda.synchronize(self.device) if self.cuda else None
            self.split.close()
            self.split = None
        if getattr(self, "prefill", None) is not None:
            self.prefill.close()
            self.prefill = None      # it refers back to the engine: without this cycle the device memory goes with
                                     # the last reference, not at the next garbage collection
        if getattr(self, "host", None) is not None:
            self.host.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

