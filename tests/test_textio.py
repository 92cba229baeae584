"""Strict JSON reading and atomic small-file writing shared by the CLIs."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fle_quant.errors import FleError
from fle_quant.textio import read_json_file, write_json_atomic, write_text_atomic


def test_read_json_file_errors(tmp_path):
    p = tmp_path / "t.json"
    with pytest.raises(FleError, match="no such file; give the table JSON file"):
        read_json_file(p, "table")
    with pytest.raises(FleError, match="no such file; custom advice"):
        read_json_file(p, "table", missing_hint="custom advice")
    p.write_text('{"a": 1, "a": 2}')
    with pytest.raises(FleError, match="key 'a' appears twice"):
        read_json_file(p, "table")
    p.write_bytes(b"\xff\xfe")
    with pytest.raises(FleError, match="not UTF-8"):
        read_json_file(p, "table")
    p.write_text("{")
    with pytest.raises(FleError, match="not valid JSON"):
        read_json_file(p, "table")
    with pytest.raises(FleError, match="is a directory"):
        read_json_file(tmp_path, "table")
    p.write_text('{"a": [1, {"b": 2}]}')
    obj, raw = read_json_file(p, "table")
    assert obj == {"a": [1, {"b": 2}]} and raw == p.read_bytes()


def test_write_atomic_refuses_existing_and_leaves_no_temp(tmp_path):
    p = tmp_path / "o.json"
    write_json_atomic(p, {"x": 1})
    with pytest.raises(FleError, match="exists; .*--force"):
        write_json_atomic(p, {"x": 2})
    assert p.read_text() == '{\n "x": 1\n}\n'
    write_json_atomic(p, {"x": 2}, force=True)
    assert '"x": 2' in p.read_text()
    with pytest.raises(FleError, match="does not exist"):
        write_text_atomic(tmp_path / "nope" / "o.txt", "x")
    assert sorted(os.listdir(tmp_path)) == ["o.json"]


def test_disk_full_leaves_nothing(tmp_path):
    out = tmp_path / "big.txt"
    code = ("import resource, signal, sys\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
            "from fle_quant.errors import FleError\n"
            "from fle_quant.textio import write_text_atomic\n"
            "try:\n"
            f"    write_text_atomic({str(out)!r}, 'x' * 100000)\n"
            "except FleError as e:\n"
            "    print(e); sys.exit(2)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2 and "disk full" in r.stdout
    assert os.listdir(tmp_path) == []
