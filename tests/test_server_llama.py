"""``fle-engine serve`` next to a real llama.cpp ``llama-server`` on the same
factory model (tools/compare_llama_server.py, whose table is in
docs/server.md): every greedy answer has the same text, and the status codes
differ only where docs/server.md says so. Reference tier: needs a
``llama-server`` built from the llama-cpp-python sdist ($FLE_LLAMA_SERVER,
or the build directory docs/server.md names); skipped without one."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.reference

ROOT = Path(__file__).resolve().parents[1]
_CACHE = Path(os.environ.get("FLE_CACHE_DIR", Path.home() / ".cache" / "fle"))
CANDIDATES = [os.environ.get("FLE_LLAMA_SERVER", ""),
              str(_CACHE / "llama-tools-0.3.36" / "build-server" / "bin" / "llama-server")]
# where FLE answers otherwise on purpose (docs/server.md)
STATUS_DIFFERS = {"error: messages []": (200, 400), "error: unknown role": (200, 400),
                  "error: malformed JSON": (500, 400)}


@pytest.fixture(scope="module")
def rows():
    exe = next((c for c in CANDIDATES if c and os.access(c, os.X_OK)), None)
    if exe is None:
        pytest.skip("no llama-server (set FLE_LLAMA_SERVER; docs/server.md shows the build)")
    spec = importlib.util.spec_from_file_location("compare_llama_server", ROOT / "tools" / "compare_llama_server.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return {r["request"]: r for r in mod.run(exe)}


def test_greedy_answers_have_the_same_text(rows):
    compared = [n for n, r in rows.items() if r["text_equal"] is not None]
    assert len(compared) >= 10, compared
    differ = [n for n in compared if not rows[n]["text_equal"] and n != "chat json_object"]
    assert differ == []


def test_status_codes_differ_only_where_documented(rows):
    for name, r in rows.items():
        assert tuple(r["status"]) == STATUS_DIFFERS.get(name, (r["status"][0], r["status"][0])), (name, r["status"])


def test_answer_shapes_of_generation_agree(rows):
    """The OpenAI answers carry the same keys with the same types (FLE's
    completions logprobs add OpenAI's legacy lists)."""
    for name in ("completions", "completions stream", "completions n=2", "chat", "chat stream", "chat logprobs"):
        r = rows[name]
        assert r["only_llama_server"] == [] and r["only_fle"] == [] and r["type_differs"] == [], (name, r)
