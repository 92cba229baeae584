"""tools/triton_compile_check.py: the launches of an interpreted test run
compiled for sm_90 without a GPU; a kernel that the interpreter runs but
the compiler refuses is reported and fails the check."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
triton = pytest.importorskip("triton")

TOOL = Path(__file__).parents[1] / "tools" / "triton_compile_check.py"

KERNELS = '''
import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr, n, s, B: tl.constexpr):
    o = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(x_ptr + o, tl.load(x_ptr + o, mask=o < n) * s, mask=o < n)


@triton.jit
def odd_kernel(x_ptr, n, B: tl.constexpr):
    o = tl.arange(0, B)
    tl.store(x_ptr + o, tl.load(x_ptr + o, mask=o < n) + 1, mask=o < n)
'''

TESTS = '''
import torch
import kernels_under_check as k


def test_scale():
    x = torch.ones(100)
    k.scale_kernel[(4,)](x, 100, 2.0, B=32)
    assert float(x.sum()) == 200.0


def test_odd():
    x = torch.ones(8)
    try:
        k.odd_kernel[(1,)](x, 6, B=BLOCK)
    except Exception:
        pass
'''


def _run(tmp_path, block: int):
    (tmp_path / "kernels_under_check.py").write_text(KERNELS)
    (tmp_path / "test_under_check.py").write_text(TESTS.replace("BLOCK", str(block)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, str(TOOL), "--", str(tmp_path / "test_under_check.py"), "-p",
                           "no:cacheprovider", "--rootdir", str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=600)


def test_kernels_that_compile_pass(tmp_path):
    r = _run(tmp_path, 8)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 distinct launches compiled for sm_90: 2 ok, 0 failed" in r.stdout
    assert "ok" in r.stdout and "kernels_under_check.scale_kernel {'B': 32}" in r.stdout


def test_a_kernel_the_compiler_refuses_fails_the_check(tmp_path):
    r = _run(tmp_path, 6)                       # arange over 6 values: not a power of two
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAILED kernels_under_check.odd_kernel {'B': 6}" in r.stdout
    assert "power of 2" in r.stdout
    assert "1 ok, 1 failed" in r.stdout


def test_usage_without_a_test_selection():
    r = subprocess.run([sys.executable, str(TOOL), "--arch", "90"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage:" in r.stderr
