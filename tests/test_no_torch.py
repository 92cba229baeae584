"""``import fle_quant`` (and every module and console script of it) must work
without torch: file surgery runs where no torch is installed."""
from __future__ import annotations

import pkgutil
import subprocess
import sys

import fle_quant


def test_fle_quant_never_imports_torch():
    modules = sorted(m.name for m in pkgutil.walk_packages(fle_quant.__path__, "fle_quant."))
    assert "fle_quant.cli.splice_cli" in modules and "fle_quant.sensitivity" in modules
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "print('torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"
