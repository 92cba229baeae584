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


# link order: dependents first; the group lets the linker revisit them
LLAMA_COMMON_LIBS = ("common/libllama-common.a", "common/libllama-common-base.a", "src/libllama.a",
                     "ggml/src/libggml.a", "ggml/src/libggml-cpu.a", "ggml/src/libggml-base.a")
LLAMA_LIBS = LLAMA_COMMON_LIBS[2:]  # libllama and ggml, without common/


@pytest.fixture(scope="session")
def llama_program(llama_src, llama_build):
    """``program(source_name, exe_name, common=True) -> Path``: compiles
    ``tests/<source_name>`` against the static libraries of the
    ``llama_build`` directory (libllama and ggml, and llama.cpp's common
    libraries unless ``common`` is false; those missing are built first) and
    caches the executable there as ``exe_name``, rebuilt when the source or a
    library is newer. Headers: llama.cpp's ``include``, ``common``,
    ``vendor``, ``ggml/include`` and ``src`` (its staging API). Skips when no
    C++ compiler is found or the build lacks a library."""
    src = llama_src / "vendor" / "llama.cpp"
    build_dir = LLAMA_TOOLS / "build"

    def program(source_name: str, exe_name: str, common: bool = True) -> Path:
        cxx = shutil.which("c++") or shutil.which("g++")
        if not cxx:
            pytest.skip(f"compiling {source_name} needs a C++ compiler")
        source = Path(__file__).with_name(source_name)
        paths = [build_dir / lib for lib in (LLAMA_COMMON_LIBS if common else LLAMA_LIBS)]
        missing = [p for p in paths if not p.is_file()]
        if missing:
            llama_build(*(p.name[len("lib"):-len(".a")] for p in missing))  # lib<target>.a
            missing = [str(p) for p in paths if not p.is_file()]
            if missing:
                pytest.skip(f"the build did not produce {', '.join(missing)}")
        exe = LLAMA_TOOLS / exe_name
        newest = max(p.stat().st_mtime for p in [source, *paths])
        if not exe.is_file() or exe.stat().st_mtime < newest:
            tmp = exe.with_name(f"{exe.name}.{os.getpid()}.tmp")
            cmd = [cxx, "-std=c++17", "-O1", str(source), "-o", str(tmp),
                   *(f"-I{src / d}" for d in ("include", "common", "vendor", "ggml/include", "src")),
                   "-Wl,--start-group", *map(str, paths), "-Wl,--end-group", "-fopenmp", "-lpthread", "-ldl"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if r.returncode:
                tmp.unlink(missing_ok=True)
                pytest.fail(f"compiling {source_name} failed:\n{r.stderr[-3000:]}")
            tmp.replace(exe)  # atomic, for concurrent sessions
        return exe

    return program


def _torch_threads(n: int):
    torch = pytest.importorskip("torch")
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a whole test module, restored afterwards:
    OpenMP threads that wait on each other crawl on a busy two-core machine,
    and one thread keeps float results independent of the thread count.
    Modules ask for it with ``pytest.mark.usefixtures("one_torch_thread")``."""
    yield from _torch_threads(1)


@pytest.fixture(scope="module")
def two_torch_threads():
    """torch on two threads (the CI machine's cores) for a whole test module."""
    yield from _torch_threads(2)


@pytest.fixture(scope="module")
def exact_float32():
    """CUDA matmuls in full float32 for a test module: TF32 would round
    their inputs to 10 mantissa bits, beyond the float32 bounds the tests
    hold results to. Restored afterwards."""
    torch = pytest.importorskip("torch")
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


# the small model of the generation and server tests (test_generate, test_server*): a qwen3moe factory model in
# float32, its reference forward pass and its tokenizer, made once per module that asks for them (a module
# with a model of its own defines these names itself)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from fle_quant.synth import make_model

    return make_model(tmp_path_factory.mktemp("tiny") / "m.gguf", "qwen3moe", mix="f32")


@pytest.fixture(scope="module")
def model(model_path):
    pytest.importorskip("torch")
    import fle_engine

    return fle_engine.load(model_path)


@pytest.fixture(scope="module")
def tok(model_path):
    from fle_engine.tokenizer import Tokenizer

    return Tokenizer.from_gguf(model_path)
