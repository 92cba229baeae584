"""Shared test fixtures.

``llama_src`` is the unpacked llama-cpp-python 0.3.36 sdist: its vendored
llama.cpp holds real vocabularies with expected tokenizations, real chat
templates, and the converter from Hugging Face checkpoints to GGUF. Found through $FLE_LLAMA_SRC, else a cache under ~/.cache/fle;
downloaded (sdist only, ~75 MB) into that cache when missing; tests that need
it skip with the reason when none of this works.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

LLAMA_CPP_PYTHON = "0.3.36"
_CACHE = Path(os.environ.get("FLE_CACHE_DIR", Path.home() / ".cache" / "fle")) / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"


def _llama_src_dir() -> Path | None:
    env = os.environ.get("FLE_LLAMA_SRC")
    candidates = [Path(env)] if env else []
    candidates.append(_CACHE)
    for c in candidates:
        if (c / "vendor" / "llama.cpp" / "models").is_dir():
            return c
    try:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                 f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp],
                check=True, capture_output=True, timeout=600,
            )
            sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            staging = _CACHE.with_name(_CACHE.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)
            with tarfile.open(sdist) as tar:
                prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/"
                members = []
                for m in tar.getmembers():
                    rel = m.name[len(prefix):] if m.name.startswith(prefix) else None
                    if rel and (m.isfile() or m.isdir()):
                        m.name = rel
                        members.append(m)
                tar.extractall(staging, members=members, filter="data")
            staging.rename(_CACHE)
            return _CACHE
    except Exception:  # noqa: BLE001 - any failure means: skip the tests that need it
        return None


@pytest.fixture(scope="session")
def llama_src() -> Path:
    d = _llama_src_dir()
    if d is None:
        pytest.skip("llama-cpp-python sdist not available (set FLE_LLAMA_SRC to an unpacked sdist)")
    return d


@pytest.fixture(scope="session")
def llama_models(llama_src) -> Path:
    """``vendor/llama.cpp/models`` of the sdist: vocab GGUFs, .inp/.out, templates/."""
    return llama_src / "vendor" / "llama.cpp" / "models"
