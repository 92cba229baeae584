"""fle-build: --dry-run on the release recipes (no network), fields still
"unknown" stopping the build by name, and builds end to end of every
release recipe's structure against a stand-in for the Hugging Face Hub on
loopback, so that huggingface_hub's own listing and download code runs:
download, resume after a kill mid-download, every step, reuse of unchanged
steps, the card, SHA-256 checks and --offline."""
from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fle_quant.cli.build_cli import main as build_main
from fle_quant.synth import make_model
from hubstandin import COMMIT, Hub  # this folder's stand-in for the Hugging Face Hub

REPO = Path(__file__).resolve().parent.parent
RELEASES = ["FLE-IQ3_M", "FLE-IQ3_XXS", "FLE-IQ2_M", "FLE-IQ3_M-REAP448"]
KW = dict(seed=3, block_count=4, expert_count=4, expert_used_count=2)


def run(argv, capsys):
    rc = build_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------------------
# the real recipes, without network


@pytest.mark.parametrize("name", RELEASES)
def test_dry_run_on_release_recipes(name, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: no request may be made
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe = json.loads((REPO / "selections" / f"{name}.recipe.json").read_text())
    rc, out, err = run([REPO / "selections" / f"{name}.recipe.json", "--dir", tmp_path / "b", "--dry-run"], capsys)
    assert rc == 0, err
    assert not (tmp_path / "b").exists()
    base = recipe["base"]
    assert f"{base['repo']} @ " in out and f"{base['folder']}/{base['file_pattern']}" in out
    if base["size"] != "unknown":
        assert base["size"] in out
    for d in recipe["donors"].values():
        assert d["repo"] in out and d["file_pattern"] in out
    for i, s in enumerate(recipe["steps"]):
        assert f"{i + 1}. {s['kind']}" in out
    assert "Disk" in out and "needed" in out
    assert "base.revision is \"unknown\"" in out  # the releases pin no base revision


def test_unknown_field_stops_the_build(tmp_path, capsys):
    rc, out, err = run([REPO / "selections/FLE-IQ3_M.recipe.json", "--dir", tmp_path / "b"], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert "base.revision" in err and "unknown" in err and "--dry-run" in err
    assert not (tmp_path / "b").exists()


def test_bad_input(tmp_path, capsys):
    rc, _, err = run([tmp_path / "missing.recipe.json", "--dry-run"], capsys)
    assert rc == 2 and "missing.recipe.json" in err and err.count("\n") == 1
    bad = json.loads((REPO / "selections/FLE-IQ3_M.recipe.json").read_text())
    bad["steps"][0]["colour"] = "red"
    (tmp_path / "bad.recipe.json").write_text(json.dumps(bad))
    rc, _, err = run([tmp_path / "bad.recipe.json", "--dry-run"], capsys)
    assert rc == 2 and "steps[0].colour" in err and err.count("\n") == 1
    rc, _, err = run([REPO / "selections/FLE-IQ3_M.recipe.json", "--ref", tmp_path / "nope.gguf", "--dry-run"],
                     capsys)
    assert rc == 2 and "--ref" in err and err.count("\n") == 1


def _text(path: Path) -> Path:
    words = ("the expert cache keeps hot experts on the gpu while the cpu computes the misses "
             "and the router picks ten of five hundred twelve experts per token ").split()
    path.write_text(" ".join(words[(i * 7) % len(words)] for i in range(1500)))
    return path


def _factory(d: Path) -> dict:
    """Factory files standing for the public ones, by quant name."""
    d.mkdir(parents=True, exist_ok=True)
    exp = lambda q: [(r"ffn_(gate|up|down)_exps", q)]  # noqa: E731
    return {
        "ref": make_model(d / "ref.gguf", "qwen3moe", mix="f32", **KW),
        "base": make_model(d / "base.gguf", "qwen3moe", mix="q8_0", split_max_tensors=30, **KW),
        "F16": make_model(d / "f16.gguf", "qwen3moe", mix=exp("F16"), **KW),
        "Q4_0": make_model(d / "q4.gguf", "qwen3moe", mix=exp("Q4_0"), **KW),
        "mtp": make_model(d / "mtp.gguf", "qwen3moe", mix="q8_0", **KW),
    }


def _standin_recipe(name: str, fac: dict, hub: Hub) -> dict:
    """The release recipe ``name`` with its structure kept (files, roles, steps
    and their kinds and modes) and its values filled in for the factory files."""
    r = json.loads((REPO / "selections" / f"{name}.recipe.json").read_text())
    r = copy.deepcopy(r)
    donors = list(r["donors"])
    local = {r["base"]["name"]: fac["base"]}
    for i, n in enumerate(donors):
        local[n] = fac["F16"] if i == 0 else fac["Q4_0"]

    def publish(src: dict, first: Path, repo: str) -> None:
        shards = sorted(first.parent.glob(first.name.replace("00001", "*"))) if "-00001-of-" in first.name \
            else [first]
        folder = src["name"]
        stem = re.sub(r"-00001-of-\d+\.gguf$|\.gguf$", "", first.name)
        for s in shards:
            hub.files.setdefault(repo, {})[f"{folder}/{s.name}"] = s
        src.update(repo=repo, folder=folder, revision=COMMIT[:12],
                   file_pattern=f"{stem}-*-of-*.gguf" if len(shards) > 1 else first.name,
                   size=f"{sum(s.stat().st_size for s in shards)} B")

    publish(r["base"], fac["base"], "standin/base")
    for n in donors:
        publish(r["donors"][n], local[n], "standin/donors")
    for s in r["steps"]:
        if s["kind"] == "select":
            if s["mode"] == "target":
                s["target"] = "1 GB"
            else:
                s["max_error"] = 1e6
            s["step"] = "4 KB"
            s["sensitivity"]["tokens"] = 128
        elif s["kind"] == "prune":
            s["experts"] = KW["expert_count"]
            s["keep"] = KW["expert_count"] - 1
            s["calibration"]["sequences"] = 2
            s["calibration"]["sequence_length"] = 32
        elif s["kind"] == "requant":
            publish(s["input"], fac["mtp"], "standin/mtp")
            s["tensors"] = r"blk\.3\.ffn_(gate|up|down)_exps"
            s["imatrix"] = "none"
            s["tensors_total"] = "unknown"
            s["tensors_changed"] = 3
    r["expected"] = {k: "unknown" for k in r["expected"]}
    r["release"] = {"repo": "standin/release", "file_pattern": "unknown"}
    r["notes"] = []
    r["sources"] = {k: "stand-in factory files" for k in ("model", "license", "release", "base", "donors", "steps")}
    return r


def _env(monkeypatch, tmp_path: Path, hub: Hub) -> dict:
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HUB_ENABLE_HF_TRANSFER": "0", "HF_HUB_DISABLE_XET": "1", "FLE_CACHE_DIR": str(tmp_path / "cache"),
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return env


@pytest.fixture(scope="module")
def factory(tmp_path_factory):
    d = tmp_path_factory.mktemp("standin")
    fac = _factory(d / "files")
    fac["text"] = _text(d / "text.txt")
    return fac


@pytest.fixture()
def hub():
    with Hub() as h:
        yield h


def _reload_endpoint():
    """huggingface_hub reads HF_ENDPOINT when imported; the caller points its
    constants at this test's stand-in."""
    import huggingface_hub.constants as c

    return c


@pytest.mark.parametrize("name", RELEASES)
def test_build_end_to_end(name, factory, hub, tmp_path, capsys, monkeypatch):
    _env(monkeypatch, tmp_path, hub)
    c = _reload_endpoint()
    monkeypatch.setattr(c, "ENDPOINT", hub.url)
    monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    recipe = _standin_recipe(name, factory, hub)
    rpath = tmp_path / f"{name}.recipe.json"
    rpath.write_text(json.dumps(recipe, indent=1))
    args = [rpath, "--dir", tmp_path / "b", "--ref", factory["ref"], "--text", factory["text"]]
    if any(s["kind"] == "prune" for s in recipe["steps"]):
        args += ["--calibration", factory["text"]]
    rc, out, err = run(args + ["--dry-run"], capsys)
    assert rc == 0 and "Nothing is missing" in out, out + err
    rc, out, err = run(args, capsys)
    assert rc == 0, err
    work = tmp_path / "b" / "work" / name
    card = (work / f"{name}.md").read_text()
    assert card.startswith("---\n") and f"# {name}" in card and "## Provenance" in card
    from fle_quant.gguf_reader import GGUFModel

    final = sorted(work.glob("0*-*/" + name + "*.gguf"))[-1]
    with GGUFModel.open(final) as m:
        assert any(k.startswith("fle.provenance.") for k in m.metadata)
        if any(s["kind"] == "prune" for s in recipe["steps"]):
            assert m.metadata["qwen3moe.expert_count"] == KW["expert_count"] - 1
    if any(s["kind"] == "requant" for s in recipe["steps"]):
        assert list(work.glob("0*-requant/*.gguf"))
    n_gets = len(hub.gets)
    # a second run: every file checked again, no step run again, nothing downloaded again
    rc, out2, err = run(args, capsys)
    assert rc == 0, err
    assert out2.count("unchanged inputs") == len(recipe["steps"])
    # offline: the checked downloads are used without the network
    hub.server.shutdown()
    rc, out3, err = run(args + ["--offline"], capsys)
    assert rc == 0, err
    assert out3.count("unchanged inputs") == len(recipe["steps"])
    assert len(hub.gets) == n_gets


def test_changed_input_reruns_steps_and_bad_hash_stops(factory, hub, tmp_path, capsys, monkeypatch):
    _env(monkeypatch, tmp_path, hub)
    c = _reload_endpoint()
    monkeypatch.setattr(c, "ENDPOINT", hub.url)
    monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    recipe = _standin_recipe("FLE-IQ3_XXS", factory, hub)
    rpath = tmp_path / "r.recipe.json"
    rpath.write_text(json.dumps(recipe))
    args = [rpath, "--dir", tmp_path / "b", "--ref", factory["ref"], "--text", factory["text"]]
    assert run(args, capsys)[0] == 0
    # another capture text: the select step runs again, and so does everything after it
    other = _text(tmp_path / "other.txt")
    other.write_text(other.read_text()[::-1])
    rc, out, err = run(args[:-1] + [other], capsys)
    assert rc == 0, err
    assert "step 1 select: measuring" in out
    # a downloaded file that no longer matches the Hub's LFS hash stops the build, naming it
    shard = sorted((tmp_path / "b" / "models").rglob("*.gguf"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    rc, out, err = run(args + ["--offline"], capsys)
    assert rc == 2 and shard.name in err and "SHA-256" in err and err.count("\n") == 1


def _stall_biggest_donor(hub: Hub) -> tuple[str, int]:
    """Stall the first download of the largest donor file just after the
    client has written its first piece (huggingface_hub writes in pieces of
    DOWNLOAD_CHUNK_SIZE); returns its path and that piece's size."""
    import huggingface_hub.constants as c

    files = hub.files["standin/donors"]
    big = max(files, key=lambda p: files[p].stat().st_size)
    chunk = c.DOWNLOAD_CHUNK_SIZE
    assert files[big].stat().st_size > chunk + 1, "the factory donor must be larger than one download piece"
    hub.stall[big] = chunk + 1
    return big, chunk


def test_resume_after_kill_mid_download(factory, hub, tmp_path):
    recipe = _standin_recipe("FLE-IQ3_XXS", factory, hub)
    rpath = tmp_path / "r.recipe.json"
    rpath.write_text(json.dumps(recipe))
    big, chunk = _stall_biggest_donor(hub)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"),
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1", "FLE_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("HF_HUB_OFFLINE", None)
    cmd = [sys.executable, "-m", "fle_quant.cli.build_cli", str(rpath), "--dir", str(tmp_path / "b"),
           "--ref", str(factory["ref"]), "--text", str(factory["text"])]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    part = None
    while time.time() < deadline and p.poll() is None:
        found = [f for f in (tmp_path / "b").rglob("*.part") if f.stat().st_size >= chunk]
        if found:
            part = found[0]
            break
        time.sleep(0.05)
    assert part is not None, p.communicate()
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert part.stat().st_size < hub.files["standin/donors"][big].stat().st_size
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    starts = [int(re.match(r"bytes=(\d+)-", r).group(1)) for p_, r in hub.ranges if p_ == big]
    assert starts and starts[0] >= chunk, hub.ranges
    assert "resuming at" in done.stdout
    assert not list((tmp_path / "b").rglob("*.part"))


def test_sigterm_mid_download_keeps_the_part_and_says_so(factory, hub, tmp_path):
    recipe = _standin_recipe("FLE-IQ2_M", factory, hub)
    rpath = tmp_path / "r.recipe.json"
    rpath.write_text(json.dumps(recipe))
    big, chunk = _stall_biggest_donor(hub)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"),
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1", "FLE_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("HF_HUB_OFFLINE", None)
    cmd = [sys.executable, "-m", "fle_quant.cli.build_cli", str(rpath), "--dir", str(tmp_path / "b"),
           "--ref", str(factory["ref"]), "--text", str(factory["text"])]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if [f for f in (tmp_path / "b").rglob("*.part") if f.stat().st_size >= chunk]:
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143, err
    assert err.strip().splitlines() == ["fle-build: terminated; finished steps and downloaded bytes are kept, "
                                        "run it again to resume"]
    assert list((tmp_path / "b").rglob("*.part"))


def test_hub_errors_are_one_line(factory, hub, tmp_path, capsys, monkeypatch):
    _env(monkeypatch, tmp_path, hub)
    c = _reload_endpoint()
    recipe = _standin_recipe("FLE-IQ3_XXS", factory, hub)
    args = lambda r: [r, "--dir", tmp_path / "b", "--ref", factory["ref"], "--text", factory["text"]]  # noqa: E731

    def write(obj):
        path = tmp_path / "r.recipe.json"
        path.write_text(json.dumps(obj))
        return path

    # nothing listens
    monkeypatch.setattr(c, "ENDPOINT", "http://127.0.0.1:9")
    rc, _, err = run(args(write(recipe)), capsys)
    assert rc == 2 and err.count("\n") == 1 and "cannot reach the Hub" in err and "base" in err
    monkeypatch.setattr(c, "ENDPOINT", hub.url)
    monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    # a revision the Hub does not have
    bad = copy.deepcopy(recipe)
    bad["base"]["revision"] = "deadbeefdead"
    rc, _, err = run(args(write(bad)), capsys)
    assert rc == 2 and err.count("\n") == 1 and "base.revision" in err
    # --offline before anything was downloaded
    rc, _, err = run(args(write(recipe)) + ["--offline"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "--offline" in err and "base" in err
    # not enough room for the downloads: stopped before the first byte
    import fle_quant.build as build

    monkeypatch.setattr(build, "free_space", lambda path: 1000)
    rc, _, err = run(args(write(recipe)), capsys)
    assert rc == 2 and err.count("\n") == 1 and "free" in err and "--dir" in err
    assert not list((tmp_path / "b").rglob("*.gguf*"))
    monkeypatch.undo()
    _env(monkeypatch, tmp_path, hub)
    monkeypatch.setattr(c, "ENDPOINT", hub.url)
    monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    # a pattern that matches nothing
    bad = copy.deepcopy(recipe)
    bad["donors"][next(iter(bad["donors"]))]["file_pattern"] = "nothing-*-of-*.gguf"
    rc, _, err = run(args(write(bad)), capsys)
    assert rc == 2 and err.count("\n") == 1 and ".file_pattern" in err
