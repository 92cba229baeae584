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
from hypothesis import settings

# Property tests draw the same examples on every run, so that a test run (and
# CI) is reproducible; `pytest --hypothesis-profile=explore` draws new ones.
settings.register_profile("fle", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("fle")

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


LLAMA_TOOLS = _CACHE.with_name(f"llama-tools-{LLAMA_CPP_PYTHON}")
_CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DLLAMA_BUILD_TOOLS=ON",
                "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF"]


@pytest.fixture(scope="session")
def llama_build(llama_src):
    """``build(*targets) -> build dir``: builds llama.cpp targets of the sdist
    (static, ``-DGGML_NATIVE=OFF``) into one cached build directory,
    configured once and shared by every test that needs llama.cpp's own
    tools or libraries. Skips when cmake or a C++ compiler is missing or the
    build fails (the log says why)."""
    src = llama_src / "vendor" / "llama.cpp"
    build_dir = LLAMA_TOOLS / "build"

    def build(*targets: str) -> Path:
        if not (src / "CMakeLists.txt").is_file():
            pytest.skip(f"{src} holds no llama.cpp sources; set FLE_LLAMA_SRC to a full llama-cpp-python sdist")
        if not shutil.which("cmake") or not (shutil.which("c++") or shutil.which("g++")):
            pytest.skip("building llama.cpp needs cmake and a C++ compiler")
        LLAMA_TOOLS.mkdir(parents=True, exist_ok=True)
        cmds = []
        if not (build_dir / "CMakeCache.txt").is_file():
            cfg = ["cmake", "-S", str(src), "-B", str(build_dir), *_CMAKE_FLAGS]
            if shutil.which("ninja"):
                cfg += ["-G", "Ninja"]
            cmds.append(cfg)
        cmds.append(["cmake", "--build", str(build_dir), "--target", *targets, "-j2"])
        log = LLAMA_TOOLS / "build.log"
        with open(log, "a") as f:
            for cmd in cmds:
                if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=3600).returncode:
                    pytest.skip(f"building llama.cpp ({' '.join(targets)}) failed; see {log}")
        return build_dir

    return build
