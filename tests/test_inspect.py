"""fle-inspect on factory models: every architecture, a split model and an
MTP-head file; bad input answered with one line and exit status 2."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from fle_quant.cli.inspect_cli import main as inspect_main
from fle_quant.gguf_reader import GGUFModel
from fle_quant.synth import make_model


def _run(argv, capsys):
    rc = inspect_main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next", "qwen4exp"])
@pytest.mark.parametrize("mix", ["f32", "release"])
def test_inspect_every_arch(tmp_path, capsys, arch, mix):
    path = make_model(tmp_path / f"{arch}.gguf", arch, mix=mix)
    rc, out, err = _run([str(path)], capsys)
    assert rc == 0, err
    assert f"arch:     {arch}" in out
    with GGUFModel.open(path) as m:
        n_layers = m.metadata[f"{arch}.block_count"]
        n_experts = m.metadata[f"{arch}.expert_count"]
        size = m.file_size
        exp_types = {t.qtype.name for n, t in m.tensors.items() if "_exps" in n}
    # one table row per trunk layer, each naming the expert types and count
    rows = [l for l in out.splitlines() if re.match(r"^\s+\d+\s", l)]
    assert len(rows) == n_layers
    for row in rows:
        assert str(n_experts) in row.split()
    for t in exp_types:
        assert t in out
    assert f"{size:,} bytes" in out

    rc, out, _ = _run([str(path), "--json"], capsys)
    d = json.loads(out)
    assert d["arch"] == arch and d["file_size"] == size
    assert 0 < d["bits_per_weight"] <= 32.0 + 1e-9
    if mix == "f32":
        assert d["bits_per_weight"] == pytest.approx(32.0)
    else:
        assert d["bits_per_weight"] < 32.0


def test_inspect_split_model_from_any_shard(tmp_path, capsys):
    first = make_model(tmp_path / "m.gguf", "qwen3moe", mix="release", split_max_tensors=8)
    shards = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(shards) > 1 and shards[0] == first
    outs = []
    for shard in (shards[0], shards[-1]):
        rc, out, err = _run([str(shard), "--json"], capsys)
        assert rc == 0, err
        outs.append(json.loads(out))
    assert outs[0] == outs[1]
    assert len(outs[0]["paths"]) == len(shards)
    assert outs[0]["file_size"] == sum(p.stat().st_size for p in shards)


def test_inspect_mtp_head_file(tmp_path, capsys):
    make_model(tmp_path / "q.gguf", "qwen4exp", mix="release", mtp="separate")
    heads = [p for p in tmp_path.glob("*.gguf") if "mtp" in p.name]
    assert len(heads) == 1
    rc, out, err = _run([str(heads[0])], capsys)
    assert rc == 0, err
    assert "mtp" in out
    assert "_exps" not in err


@pytest.mark.parametrize("content", [b"", b"NOPE" + b"\0" * 60, b"GGUF\x03\0\0\0"])
def test_inspect_bad_file_one_line_exit_2(tmp_path, content):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    r = subprocess.run([sys.executable, "-m", "fle_quant.cli.inspect_cli", str(bad)],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad.gguf" in lines[0]


def test_inspect_missing_file(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fle_quant.cli.inspect_cli", str(tmp_path / "none.gguf")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "none.gguf" in r.stderr and "Traceback" not in r.stderr
