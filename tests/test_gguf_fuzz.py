"""Mutated GGUF files open or fail with FleError, never with another
exception, a huge allocation or a long stall."""
from __future__ import annotations

import shutil
import struct
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from fle_quant.errors import FleError
from fle_quant.gguf_format import GGUFValueType, shard_path
from fle_quant.gguf_reader import GGUFModel
from fle_quant.gguf_writer import WritePlan, write_gguf

V = GGUFValueType
MAX_PEAK_BYTES = 4 << 20  # the valid files are ~1 KB: anything near this is a claimed length trusted


def _plan(seed: int, n_tensors: int = 3) -> WritePlan:
    rng = np.random.default_rng(seed)
    plan = WritePlan()
    plan.add_string("general.architecture", "llama")
    plan.add_uint32("llama.block_count", 2)
    plan.add_float32("llama.rope.freq_base", 1e4)
    plan.add_array("tokenizer.ggml.tokens", ["<s>", "a", "bc", "ü"], V.STRING)
    plan.add_array("tokenizer.ggml.scores", [0.0, -1.0, -2.0, -3.0], V.FLOAT32)
    plan.add_bool("t.flag", True)
    for i in range(n_tensors):
        plan.add_tensor(f"blk.{i}.w", [32, 2], "Q8_0", rng.integers(0, 256, 68, dtype=np.uint8))
    plan.add_tensor("blk.0.ffn_up_exps.weight", [32, 1, 2], "Q4_0", rng.integers(0, 256, 36, dtype=np.uint8))
    return plan


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    plain = write_gguf(_plan(0), d / "plain.gguf", progress=False).paths[0]
    split_a = write_gguf(_plan(1), d / "a.gguf", split_max_tensors=2, progress=False).paths
    split_b = write_gguf(_plan(2, n_tensors=5), d / "b.gguf", split_max_tensors=2, progress=False).paths
    return d, plain.read_bytes(), split_a, split_b


HUGE = st.sampled_from([2**64 - 1, 2**63, 2**63 - 1, 2**40, 2**32, 2**32 - 1, 2**31, 65, 5, 0])

MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 4096), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 4096), st.just(0)),
    st.tuples(st.just("u64"), st.integers(0, 4096), HUGE),
    st.tuples(st.just("u32"), st.integers(0, 4096), HUGE.map(lambda v: v & 0xFFFFFFFF)),
    st.tuples(st.just("insert_u64"), st.integers(0, 4096), HUGE),
)


def _mutate(blob: bytes, mutations) -> bytes:
    b = bytearray(blob)
    for kind, pos, val in mutations:
        pos = pos % (len(b) + 1)
        if kind == "flip" and pos < len(b):
            b[pos] ^= val
        elif kind == "truncate":
            del b[pos:]
        elif kind == "u64":
            b[pos : pos + 8] = struct.pack("<Q", val)
        elif kind == "u32":
            b[pos : pos + 4] = struct.pack("<I", val)
        elif kind == "insert_u64":
            b[pos:pos] = struct.pack("<Q", val)
    return bytes(b)


def _open_and_touch(path: Path) -> None:
    """Open; on success read every tensor view (must lie inside the file)."""
    tracemalloc.start()
    try:
        try:
            with GGUFModel.open(path) as m:
                for name, t in m.tensors.items():
                    view = m.tensor_bytes(name)
                    assert view.size == t.n_bytes
                    p, off, n = m.byte_range(name)
                    assert off + n <= p.stat().st_size
                    if t.is_expert:
                        m.expert_bytes(name, t.n_experts - 1)
                    del view  # a view must not outlive the model (a mutated header may hold no tensors)
            event("opened")
        except FleError as e:
            assert str(path.parent) in str(e)  # names the offending file
            event("FleError: " + str(e).split(": ", 1)[1].split(" ")[0])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MAX_PEAK_BYTES, f"peak allocation {peak} bytes"


FUZZ_SETTINGS = settings(
    max_examples=200,
    deadline=2000,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ_SETTINGS
@given(mutations=st.lists(MUTATION, min_size=1, max_size=4))
@example(mutations=[("u64", 5, 0)])  # tensor count 0: a valid file with no tensors
def test_mutated_header(corpus, mutations):
    _, plain, _, _ = corpus
    blob = _mutate(plain, mutations)
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.gguf"
        p.write_bytes(blob)
        _open_and_touch(p)


@settings(max_examples=60, deadline=4000, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    action=st.sampled_from(["delete", "swap_in_other", "mutate", "rename_count"]),
    victim=st.integers(0, 1),
    opener=st.integers(0, 1),
    mutations=st.lists(MUTATION, min_size=1, max_size=3),
)
def test_mutated_shards(corpus, action, victim, opener, mutations):
    _, _, split_a, split_b = corpus
    n = len(split_a)
    victim %= n
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "m.gguf"
        paths = [shard_path(out, i, n) for i in range(n)]
        for src, dst in zip(split_a, paths):
            shutil.copy(src, dst)
        if action == "delete":
            paths[victim].unlink()
        elif action == "swap_in_other":
            shutil.copy(split_b[victim], paths[victim])
        elif action == "mutate":
            paths[victim].write_bytes(_mutate(paths[victim].read_bytes(), mutations))
        else:  # a shard of an n-way split named as if of an (n+1)-way split
            paths[victim].rename(shard_path(out, victim, n + 1))
        start = paths[opener] if paths[opener].exists() else shard_path(out, victim, n + 1)
        if not start.exists():
            start = next(p for p in paths if p.exists())
        if action == "mutate":
            _open_and_touch(start)
        else:
            with pytest.raises(FleError):
                GGUFModel.open(start)


def test_valid_corpus_opens(corpus):
    _, plain, split_a, _ = corpus
    for p in split_a:
        with GGUFModel.open(p) as m:
            assert len(m.tensors) == 4 and len(m.paths) == len(split_a)
