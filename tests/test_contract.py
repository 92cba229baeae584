"""The contract every console script keeps, checked through one matrix.

Every command in ``COMMANDS`` (one entry per console script or subcommand)
runs through the same cases:

- an output naming one of the command's inputs (the same path, a hard link,
  a symbolic link, a name of the same split model), with --force: refused;
- outputs that cannot be written (a folder, a name too long, /proc, a
  missing folder, a read-only or full file system where the test can mount
  one): one line;
- inputs that are no regular file (a FIFO, a folder, a device, a loop of
  symbolic links, a missing file) and malformed JSON (deep nesting, a
  5,000-digit integer, 1e400, NaN, bad syntax, not UTF-8, oversize): one line;
- an existing output without --force: refused, unchanged;
- SIGINT / SIGTERM while the output is being written: 130 / 143, one line,
  nothing left; SIGKILL there or between the renames of a split output: no
  complete-looking output, and the next run (without --force) cleans up and
  succeeds;
- two runs writing the same output at once: exactly one succeeds.

Every refusal: exit status 2, one line ``PROG: error: ...`` naming the path
or field, no traceback, inputs byte-identical (SHA-256) and no temporary or
lock file left. A new command gets all of this by being added to
``COMMANDS``.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Cmd:
    """One command of the matrix. ``argv``: arguments with ``{role}``
    placeholders for its files (``{out}`` the output); ``inputs``: the roles
    that are input files; ``json``: those that are JSON; ``out``: what the
    output is (``gguf`` may be split, None: writes nothing); ``torch``: runs
    the forward pass (subprocess cases are kept few for it)."""

    name: str
    module: str
    argv: list[str]
    inputs: list[str]
    json: list[str] = field(default_factory=list)
    out: str | None = None
    torch: bool = False
    split: list[str] = field(default_factory=list)  # extra arguments that make a split output

    @property
    def prog(self) -> str:
        return {"fle_quant.cli.reap_cli": "fle-reap", "fle_quant.cli.kld_cli": "fle-kld",
                "fle_engine.cli": "fle-engine", "fle_quant.synth.cli": "fle-synth"}.get(
            self.module, "fle-" + self.module.rsplit(".", 1)[1].removesuffix("_cli"))

    def args(self, files: dict[str, str]) -> list[str]:
        return [a.format(**files) for a in self.argv]


COMMANDS = [
    Cmd("inspect", "fle_quant.cli.inspect_cli", ["{model}"], ["model"]),
    Cmd("synth", "fle_quant.synth.cli", ["qwen3moe", "--vocab", "{model}", "--set", "block_count=2", "-o", "{out}"],
        ["model"], out="gguf", split=["--split-max-tensors", "8"]),
    Cmd("select", "fle_quant.cli.select_cli", ["--sensitivity", "{sens}", "--max-error", "1e9", "-o", "{out}"],
        ["sens"], json=["sens"], out="json"),
    Cmd("inspect-json", "fle_quant.cli.inspect_cli", ["{model}", "--json"], ["model"]),
    Cmd("recipe", "fle_quant.cli.recipe_cli", ["validate", "{recipe}"], ["recipe"], json=["recipe"]),
    Cmd("recipe-show", "fle_quant.cli.recipe_cli", ["show", "{recipe}"], ["recipe"], json=["recipe"]),
    Cmd("card-recipe", "fle_quant.cli.card_cli", ["--recipe", "{recipe}", "-o", "{out}"], ["recipe"], json=["recipe"],
        out="md"),
    Cmd("build-dry-run", "fle_quant.cli.build_cli", ["{recipe}", "--dry-run", "--offline", "--dir", "{outdir}"],
        ["recipe"], json=["recipe"]),
    Cmd("splice", "fle_quant.cli.splice_cli",
        ["--base", "{model}", "--donor", "Q8={donor}", "--selection", "{sel}", "-o", "{out}"],
        ["model", "donor", "sel"], json=["sel"], out="gguf", split=["--split-max-tensors", "8"]),
    Cmd("card", "fle_quant.cli.card_cli", ["{model}", "--quality", "{quality}", "-o", "{out}"],
        ["model", "quality"], json=["quality"], out="md"),
    Cmd("reap-prune", "fle_quant.cli.reap_cli", ["prune", "{model}", "--scores", "{scores}", "--keep", "6", "-o", "{out}"],
        ["model", "scores"], json=["scores"], out="gguf", split=["--split-max-tensors", "8"]),
    Cmd("requant", "fle_quant.cli.requant_cli", ["{model}", "--tensors", "ffn_down_exps", "--type", "Q8_0", "-o", "{out}"],
        ["model"], out="gguf", split=["--split-max-tensors", "8"]),
    Cmd("reap-score", "fle_quant.cli.reap_cli",
        ["score", "{model}", "--text", "{text}", "--tokens", "16", "--ctx", "8", "-o", "{out}"],
        ["model", "text"], out="json", torch=True),
    Cmd("sensitivity", "fle_quant.cli.sensitivity_cli",
        ["--ref", "{model}", "--donor", "Q8={donor}", "--text", "{text}", "--tokens", "16", "--ctx", "8",
         "--work-dir", "{outdir}", "-o", "{out}"],
        ["model", "donor", "text"], out="json", torch=True),
    Cmd("kld-base", "fle_quant.cli.kld_cli", ["base", "{model}", "--text", "{text}", "-c", "8", "--chunks", "2",
                                              "-o", "{out}"], ["model", "text"], out="kld", torch=True),
    Cmd("kld", "fle_quant.cli.kld_cli", ["{model}", "--base", "{kld}"], ["model", "kld"], torch=True),
    Cmd("generate", "fle_engine.cli", ["generate", "{model}", "-p", "hello", "-n", "2", "--temp", "0",
                                       "--device", "cpu", "--cache-profile", "none"], ["model"], torch=True),
    # the server: its model is checked before it listens (the HTTP side's bad requests: tests/test_server*.py)
    Cmd("serve", "fle_engine.cli", ["serve", "{model}", "--device", "cpu", "--port", "0"], ["model"], torch=True),
    # the measurement tools (fle-bracket and fle-probe runs talk to servers: tests/test_measure_*.py)
    Cmd("accept", "fle_quant.cli.accept_cli", ["--text", "a", "{kldres}", "{kldres}", "--held-out", "b", "{kldres}",
                                               "{kldres}", "--json", "{out}"], ["kldres"], out="json"),
    Cmd("bracket-table", "fle_quant.cli.bracket_cli", ["table", "{bracket}", "-o", "{out}"], ["bracket"],
        json=["bracket"], out="md"),
    Cmd("probe-compare", "fle_quant.cli.probe_cli", ["compare", "{probe}", "{probe}", "--n-boot", "100"], ["probe"],
        json=["probe"]),
    Cmd("plot-size-kld", "fle_quant.cli.plot_cli", ["size-kld", "--point", "a", "{model}", "{kldres}", "-o", "{out}"],
        ["model", "kldres"], out="png"),
    Cmd("plot-heatmap", "fle_quant.cli.plot_cli", ["heatmap", "{sens}", "--selection", "{sel}", "-o", "{out}"],
        ["sens", "sel"], json=["sens", "sel"], out="png"),
    Cmd("plot-predicted", "fle_quant.cli.plot_cli", ["predicted", "--file", "a", "{sel}", "{kldres}", "--file", "b",
                                                     "{sel}", "{kldres}", "-o", "{out}"], ["sel", "kldres"],
        json=["sel"], out="png"),
    Cmd("plot-forest", "fle_quant.cli.plot_cli", ["forest", "{bracket}", "-o", "{out}"], ["bracket"],
        json=["bracket"], out="png"),
    Cmd("accept-texts", "fle_quant.cli.accept_cli", ["texts", "-o", "{outdir}/texts", "--manifest", "{manifest}",
                                                     "--offline"], ["manifest"], json=["manifest"]),
    # its inputs are checked before any forward pass or server (the runs: tests/test_measure_compare.py)
    Cmd("compare", "fle_quant.cli.compare_cli", ["{model}", "b={donor}", "--reference", "{model}", "--text", "{text}",
                                                 "--budget", "1GiB", "--out", "{outdir}/cmp"],
        ["model", "donor", "text"], torch=True),
]
WRITERS = [c for c in COMMANDS if c.out]
BY_NAME = {c.name: c for c in COMMANDS}
_OUT_NAME = {"gguf": "out.gguf", "json": "out.json", "md": "out.md", "kld": "out.kld", "png": "out.png"}

TEXT = ("The quick brown fox jumps over the lazy dog. " * 40 + "\n")


# ---------------------------------------------------------------------------
# the files the commands read


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """Inputs for every command, made once: a tiny model and a donor, a
    split model, a text, and the JSON and KLD files the commands exchange."""
    from fle_quant.synth import make_model

    d = tmp_path_factory.mktemp("inputs")
    os.environ["FLE_CACHE_DIR"] = str(d / "cache")
    size = dict(block_count=2, expert_count=8, expert_used_count=2, context_length=64)
    files = {
        "model": str(make_model(d / "model.gguf", "qwen3moe", seed=3, **size)),
        "donor": str(make_model(d / "donor.gguf", "qwen3moe", seed=3, mix=[(r"_exps\.weight$", "Q8_0")], **size)),
        "split": str(make_model(d / "split.gguf", "qwen3moe", seed=3, split_max_tensors=8, **size)),
    }
    (d / "text.txt").write_text(TEXT)
    files["text"] = str(d / "text.txt")
    files["recipe"] = str(REPO / "selections" / "FLE-IQ2_M.recipe.json")
    shutil.copy(files["recipe"], d / "r.recipe.json")
    files["recipe"] = str(d / "r.recipe.json")
    (d / "quality.json").write_text(json.dumps({"format": "fle.quality/1", "texts": {"E": {"mean_kld": 0.01}}}))
    files["quality"] = str(d / "quality.json")
    made = {"sens": ("sensitivity", []), "scores": ("reap-score", []), "sel": ("select", ["sens"]),
            "kld": ("kld-base", [])}
    for role in ("sens", "scores", "sel", "kld"):
        cmd = BY_NAME[made[role][0]]
        out = d / (role + (".kld" if role == "kld" else ".json"))
        rc, err = call(cmd, cmd.args({**files, "out": str(out), "outdir": str(d)}))
        assert rc == 0, err
        files[role] = str(out)
    # a selection that takes layer 1 from the donor, so that fle-splice uses every input
    import dataclasses

    from fle_quant.select import load_selection

    sel = load_selection(files["sel"])
    sel = dataclasses.replace(sel, sources={0: sel.base, 1: "Q8"})
    Path(files["sel"]).write_text(json.dumps(sel.to_json()))
    measure_inputs(d, files)
    return files


def measure_inputs(d: Path, files: dict[str, str]) -> None:
    """A KLD result as fle-kld prints it, an fle-bracket and an fle-probe result."""
    from fle_quant.measure import probe
    from fle_quant.measure.bracket import analyse, build_result, standard_prompts

    (d / "kld.txt").write_text("Mean    KLD:   0.012000 ±   0.000300\nSame top p: 93.000 ± 0.100 %\n")
    files["kldres"] = str(d / "kld.txt")
    ps = standard_prompts()[:4]
    passes = [{"name": n, "url": "http://127.0.0.1:1", "pass": k + 1, "memory_pressure_avg10": None,
               "requests": [{"id": p.id, "category": p.category, "ok": True, "finish_reason": "stop",
                             "completion_tokens": 10, "wall_s": 1.0, "speed": 10.0 + i + k, "speed_source": "timings"}
                            for i, p in enumerate(ps)]} for k, n in enumerate(("ref", "cand", "ref"))]
    (d / "bracket.json").write_text(json.dumps(build_result(passes, {}, ps, analyse(passes, n_boot=100))))
    files["bracket"] = str(d / "bracket.json")
    recs = [{"id": q.id, "reply": "x", "grade": g, "error": None}
            for q, g in zip(probe.standard_questions()[:4], ("correct", "wrong", "abstain", "correct"))]
    (d / "probe.json").write_text(json.dumps(probe.result("a", "http://127.0.0.1:1", "en", "standard", recs)))
    files["probe"] = str(d / "probe.json")
    (d / "manifest.json").write_text(json.dumps({"format": "fle.texts/1", "texts": [
        {"name": "a", "url": "http://127.0.0.1:1/a", "sha256": "0" * 64}]}))
    files["manifest"] = str(d / "manifest.json")


def sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def input_digests(files: dict[str, str]) -> dict[str, str]:
    return {k: sha(v) for k, v in files.items() if Path(v).is_file()}


class _Timeout(Exception):
    pass


def call(cmd: Cmd, argv: list[str], limit: int = 120) -> tuple[int, str]:
    """Run ``cmd``'s main in this process; (exit status, stderr). A hang
    (a FIFO opened for reading) fails the test after ``limit`` seconds."""
    main = importlib.import_module(cmd.module).main
    err, out = io.StringIO(), io.StringIO()

    def alarm(signum, frame):
        raise _Timeout(f"{cmd.name} {argv} ran past {limit} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(limit)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse
                rc = e.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return rc, err.getvalue()


def helper_files(folder: Path) -> list[str]:
    return sorted(p.name for p in Path(folder).iterdir() if ".fle-" in p.name or p.name.startswith("fle-sens"))


def expect_refusal(cmd: Cmd, argv: list[str], words: list[str], digests: dict[str, str], files: dict[str, str],
                   folders=()) -> str:
    rc, err = call(cmd, argv)
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith(f"{cmd.prog}: note:")]
    assert rc == 2, (cmd.name, argv, err)
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith(f"{cmd.prog}: error: "), err
    for w in words:
        assert w in lines[0], (w, err)
    assert input_digests(files) == digests
    for f in folders:
        assert helper_files(f) == [], (cmd.name, helper_files(f))
    return lines[0]


@pytest.fixture
def outdir(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    return d


def files_for(ws, outdir: Path, cmd: Cmd) -> dict[str, str]:
    return {**ws, "outdir": str(outdir), "out": str(outdir / _OUT_NAME.get(cmd.out or "", "none"))}


# ---------------------------------------------------------------------------
# outputs that name an input


_OVERWRITE_CASES = [(c, role) for c in WRITERS for role in c.inputs]


@pytest.mark.parametrize("cmd, role", _OVERWRITE_CASES, ids=[f"{c.name}-{r}" for c, r in _OVERWRITE_CASES])
@pytest.mark.parametrize("how", ["same", "hardlink", "symlink"])
def test_output_naming_an_input_is_refused(ws, outdir, cmd, role, how):
    files = files_for(ws, outdir, cmd)
    target = Path(files[role])
    if how == "same":
        out = target
    else:
        out = outdir / ("link-" + target.name)
        (os.link if how == "hardlink" else os.symlink)(target, out)
    digests = input_digests(ws)
    expect_refusal(cmd, cmd.args({**files, "out": str(out)}) + ["--force"], ["overwrite an input"], digests, ws,
                   [target.parent, outdir])


_SPLIT_CASES = [c for c in WRITERS if c.out == "gguf" and "model" in c.inputs]


@pytest.mark.parametrize("cmd", _SPLIT_CASES, ids=[c.name for c in _SPLIT_CASES])
@pytest.mark.parametrize("split_out", [False, True], ids=["one-file", "split"])
def test_output_with_the_stem_of_a_split_input_is_refused(ws, outdir, cmd, split_out):
    """A split input ``split-0000k-of-0000N.gguf`` and ``-o split.gguf``: every
    shard name of the output is a name of the input's model."""
    files = {**files_for(ws, outdir, cmd), "model": ws["split"]}
    out = Path(ws["split"]).with_name("split.gguf")
    argv = cmd.args({**files, "out": str(out)}) + ["--force"] + (cmd.split if split_out else [])
    expect_refusal(cmd, argv, ["overwrite an input", "same split model"], input_digests(ws), ws, [out.parent])


# ---------------------------------------------------------------------------
# outputs that cannot be written


def _unwritable(kind: str, outdir: Path, cmd: Cmd) -> tuple[str, list[str]]:
    name = _OUT_NAME[cmd.out]
    if kind == "directory":
        (outdir / name).mkdir()
        return str(outdir / name), ["is a directory"]
    if kind == "name-too-long":
        return str(outdir / ("x" * 300 + name)), ["name too long"]
    if kind == "proc":
        return f"/proc/{name}", ["/proc"]
    if kind == "missing-folder":
        return str(outdir / "no" / "such" / name), ["does not exist"]
    if kind == "not-a-folder":
        (outdir / "file").write_text("x")
        return str(outdir / "file" / name), ["file"]
    raise AssertionError(kind)


@pytest.mark.parametrize("cmd", WRITERS, ids=[c.name for c in WRITERS])
@pytest.mark.parametrize("kind", ["directory", "name-too-long", "proc", "missing-folder", "not-a-folder"])
def test_unwritable_output_is_one_line(ws, outdir, cmd, kind):
    if kind == "missing-folder" and cmd.name in ("card", "card-recipe"):
        pytest.skip("fle-card makes the card's folder")
    out, words = _unwritable(kind, outdir, cmd)
    files = files_for(ws, outdir, cmd)
    expect_refusal(cmd, cmd.args({**files, "out": out}) + ["--force"], words, input_digests(ws), ws, [outdir])


@pytest.mark.parametrize("cmd", WRITERS, ids=[c.name for c in WRITERS])
def test_unwritable_folder_is_one_line(ws, outdir, cmd):
    if os.geteuid() == 0:
        pytest.skip("root writes in any folder; the read-only file system case covers this")
    os.chmod(outdir, 0o555)
    try:
        files = files_for(ws, outdir, cmd)
        expect_refusal(cmd, cmd.args(files), ["permission denied"], input_digests(ws), ws, [outdir])
    finally:
        os.chmod(outdir, 0o755)


@pytest.mark.parametrize("cmd", WRITERS, ids=[c.name for c in WRITERS])
def test_existing_output_is_kept_without_force(ws, outdir, cmd):
    files = files_for(ws, outdir, cmd)
    Path(files["out"]).write_bytes(b"precious")
    expect_refusal(cmd, cmd.args(files), [files["out"], "exists", "--force"], input_digests(ws), ws, [outdir])
    assert Path(files["out"]).read_bytes() == b"precious"


# ---------------------------------------------------------------------------
# inputs that are not regular files, malformed JSON


_INPUT_CASES = [(c, role) for c in COMMANDS for role in c.inputs]


def _bad_input(kind: str, folder: Path) -> tuple[str, str]:
    p = folder / f"bad-{kind}"
    if kind == "fifo":
        os.mkfifo(p)
        return str(p), "FIFO"
    if kind == "directory":
        p.mkdir()
        return str(p), "directory"
    if kind == "device":
        return "/dev/null", "device"
    if kind == "symlink-loop":
        os.symlink(folder / "bad-loop-b", p)
        os.symlink(p, folder / "bad-loop-b")
        return str(p), "loop"
    if kind == "missing":
        return str(p), "no such file"
    raise AssertionError(kind)


@pytest.mark.parametrize("cmd, role", _INPUT_CASES, ids=[f"{c.name}-{r}" for c, r in _INPUT_CASES])
@pytest.mark.parametrize("kind", ["fifo", "directory", "device", "symlink-loop", "missing"])
def test_input_that_is_no_regular_file_is_refused_at_once(ws, outdir, cmd, role, kind):
    bad, word = _bad_input(kind, outdir)
    if role in ("model", "donor") and kind == "missing":
        word = "no such file"
    files = {**files_for(ws, outdir, cmd), role: bad}
    t0 = time.monotonic()
    line = expect_refusal(cmd, cmd.args(files), [bad], input_digests(ws), ws, [outdir])
    assert word.lower() in line.lower(), line
    assert time.monotonic() - t0 < 60


def _json_cases(folder: Path) -> dict[str, tuple[bytes, str]]:
    return {
        "deep": (b"[" * 200_000 + b"]" * 200_000, "nested"),
        "long-int": (b'{"format": ' + b"9" * 5000 + b"}", "digits"),
        "1e400": (b'{"format": "x", "v": 1e400}', "infinite"),
        "nan": (b'{"format": "x", "v": NaN}', "NaN"),
        "syntax": (b'{"format": ', "not valid JSON"),
        "not-utf8": (b'{"format": "\xff"}', "UTF-8"),
        "wrong-type": (b"[1, 2, 3]", ""),
        "huge-size": (b"", "bytes"),
    }


_JSON_CASES = [(c, role) for c in COMMANDS for role in c.json]


@pytest.mark.parametrize("cmd, role", _JSON_CASES, ids=[f"{c.name}-{r}" for c, r in _JSON_CASES])
@pytest.mark.parametrize("kind", list(_json_cases(Path("."))))
def test_malformed_json_is_one_line(ws, outdir, cmd, role, kind):
    data, word = _json_cases(outdir)[kind]
    bad = outdir / f"bad-{kind}.json"
    bad.write_bytes(data)
    if kind == "huge-size":
        os.truncate(bad, 1 << 30)  # sparse: a size no table has, read no further than its stat
    files = {**files_for(ws, outdir, cmd), role: str(bad)}
    expect_refusal(cmd, cmd.args(files), [str(bad), word], input_digests(ws), ws, [outdir])


# ---------------------------------------------------------------------------
# in subprocesses: signals, kills, races, full and read-only file systems


_AT_POINT = textwrap.dedent(
    """
    import os, signal, sys, importlib
    from fle_quant import files
    module, point, sig = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if point == "temp":
        real_create = files.OutputSet.create
        def create(self, final):
            fd = real_create(self, final)
            os.kill(os.getpid(), sig)
            return fd
        files.OutputSet.create = create
    elif point == "rename":
        real_replace = os.replace
        def replace(src, dst):
            real_replace(src, dst)
            if files.TMP_TAG in os.fspath(src):
                os.kill(os.getpid(), sig)
        files.os.replace = replace
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(importlib.import_module(module).main(sys.argv[4:]))
    """
)


def _env(ws) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["FLE_CACHE_DIR"] = str(Path(ws["model"]).parent / "cache")
    return env


def run_at(ws, cmd: Cmd, argv: list[str], point: str, sig: int, timeout: int = 300):
    return subprocess.run([sys.executable, "-c", _AT_POINT, cmd.module, point, str(int(sig)), *argv],
                          capture_output=True, text=True, env=_env(ws), timeout=timeout)


def run_plain(ws, cmd: Cmd, argv: list[str], timeout: int = 300):
    return subprocess.run([sys.executable, "-m", cmd.module, *argv], capture_output=True, text=True,
                          env=_env(ws), timeout=timeout)


def finals(outdir: Path) -> list[str]:
    return sorted(p.name for p in outdir.iterdir() if not p.name.startswith("."))


@pytest.mark.parametrize("cmd", WRITERS, ids=[c.name for c in WRITERS])
@pytest.mark.parametrize("sig, rc, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
                         ids=["SIGINT", "SIGTERM"])
def test_signal_while_writing_leaves_nothing(ws, outdir, cmd, sig, rc, word):
    files = files_for(ws, outdir, cmd)
    digests = input_digests(ws)
    r = run_at(ws, cmd, cmd.args(files), "temp", sig)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == rc, r.stderr
    assert "Traceback" not in r.stderr and len(lines) == 1 and lines[0] == f"{cmd.prog}: {word}; no output was " \
                                                                          "left behind", r.stderr
    assert sorted(p.name for p in outdir.iterdir()) == []
    assert input_digests(ws) == digests


_KILL_CASES = [(c, "temp") for c in WRITERS] + [(c, "rename") for c in WRITERS if c.split]


@pytest.mark.parametrize("cmd, point", _KILL_CASES, ids=[f"{c.name}-{p}" for c, p in _KILL_CASES])
def test_sigkill_then_next_run_cleans_up(ws, outdir, cmd, point):
    """Killed after its temporary was created, or (split outputs) after the
    first rename: no complete-looking output; the next run, without --force,
    removes the leftovers and succeeds."""
    files = files_for(ws, outdir, cmd)
    argv = cmd.args(files) + (cmd.split if point == "rename" else [])
    r = run_at(ws, cmd, argv, point, signal.SIGKILL)
    assert r.returncode == -signal.SIGKILL, r.stderr
    left = finals(outdir)
    assert Path(files["out"]).name not in left
    if point == "rename":
        assert left and all("-of-" in n for n in left), left  # a later shard appeared, never shard 1
        assert not any("-00001-of-" in n for n in left)
    assert helper_files(outdir), "the kill left no temporary file: the test did not kill mid-write"
    r = run_plain(ws, cmd, argv)
    assert r.returncode == 0, r.stderr
    assert helper_files(outdir) == []
    names = finals(outdir)
    if point == "rename":
        count = len(names)
        stem = Path(files["out"]).name.removesuffix(".gguf")
        assert names == [f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    else:
        assert names == [Path(files["out"]).name]


@pytest.mark.parametrize("cmd", [c for c in WRITERS if not c.torch], ids=[c.name for c in WRITERS if not c.torch])
def test_sigkill_at_random_times_then_rerun(ws, outdir, cmd):
    """Killed at random moments: never a partial file under the final name;
    a rerun with --force leaves exactly the output."""
    rng = random.Random(cmd.name)
    files = files_for(ws, outdir, cmd)
    argv = cmd.args(files) + ["--force"]
    for _ in range(3):
        p = subprocess.Popen([sys.executable, "-m", cmd.module, *argv], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=_env(ws))
        time.sleep(rng.uniform(0.2, 1.5))
        p.kill()
        p.wait()
        if Path(files["out"]).exists():
            r = run_plain(ws, BY_NAME["inspect"], [files["out"]]) if cmd.out == "gguf" else None
            assert r is None or r.returncode == 0, r.stderr
    r = run_plain(ws, cmd, argv)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in outdir.iterdir()) == [Path(files["out"]).name]


RACE_TRIALS = {"splice": 50, "select": 50}


@pytest.mark.parametrize("cmd", WRITERS, ids=[c.name for c in WRITERS])
def test_two_writers_exactly_one_succeeds(ws, tmp_path, cmd):
    trials = RACE_TRIALS.get(cmd.name, 1 if cmd.torch else 3)
    outcomes = []
    for i in range(trials):
        outdir = tmp_path / f"race{i}"
        outdir.mkdir()
        files = files_for(ws, outdir, cmd)
        argv = [sys.executable, "-m", cmd.module, *cmd.args(files)]
        procs = [subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(ws))
                 for _ in range(2)]
        results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
        for p in procs:
            p.stderr.close()
        rcs = sorted(rc for rc, _ in results)
        assert rcs == [0, 2], results
        loser = next(err for rc, err in results if rc == 2).strip().splitlines()
        assert len(loser) == 1 and ("exists" in loser[0] or "another FLE process" in loser[0]), loser
        assert sorted(p.name for p in outdir.iterdir()) == [Path(files["out"]).name]
        outcomes.append("locked" if "another FLE process" in loser[0] else "exists")
    print(f"{cmd.name}: {trials} races, exactly one writer won each: {outcomes.count('locked')} refused by the lock, "
          f"{outcomes.count('exists')} by the finished output")


def _mount_works() -> bool:
    if not shutil.which("unshare") or os.geteuid() != 0:
        return False
    probe = Path("/tmp") / f"fle-mount-probe-{os.getpid()}"
    probe.mkdir(exist_ok=True)
    try:
        r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {probe}"],
                           capture_output=True, timeout=30)
        return r.returncode == 0
    finally:
        probe.rmdir()


@pytest.fixture(scope="module")
def small_fs():
    if not _mount_works():
        pytest.skip("cannot mount a small file system here (needs unshare and root)")


@pytest.mark.parametrize("cmd", WRITERS, ids=[c.name for c in WRITERS])
@pytest.mark.parametrize("fs", ["full", "read-only"])
def test_full_or_read_only_file_system(ws, small_fs, outdir, cmd, fs):
    """The output folder is a private tmpfs: full (a filler file takes all
    but a few KB) or read-only. One line naming the output; nothing left."""
    files = files_for(ws, outdir, cmd)
    argv = " ".join(f"'{a}'" for a in cmd.args(files))
    prep = (f"dd if=/dev/zero of={outdir}/filler bs=4k 2>/dev/null"
            if fs == "full" else f"mount -o remount,ro {outdir}")
    script = (f"mount -t tmpfs -o size=256k tmpfs {outdir} && {prep} ; "
              f"{sys.executable} -m {cmd.module} {argv}; rc=$?; ls -A {outdir} >&2; exit $rc")
    r = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=_env(ws),
                       timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    err = [ln for ln in lines if ln.startswith(f"{cmd.prog}: error: ")]
    assert len(err) == 1, r.stderr
    assert ("disk full" if fs == "full" else "read-only") in err[0], err
    listing = [ln for ln in lines if not ln.startswith(f"{cmd.prog}:")]
    assert listing in ([], ["filler"]), listing  # the folder as the command left it


# ---------------------------------------------------------------------------
# requests bounded by the model and the machine


def test_generate_caps_n_at_the_context(ws):
    cmd = BY_NAME["generate"]
    rc, err = call(cmd, ["generate", ws["model"], "-p", "hello", "-n", "99999999999999999999", "--temp", "0",
                         "--device", "cpu", "--cache-profile", "none"])
    assert rc == 0, err
    assert "does not fit the context of 64 tokens" in err and "generating at most" in err, err


def test_generate_refuses_a_prompt_longer_than_the_context(ws):
    rc, err = call(BY_NAME["generate"], ["generate", ws["model"], "-p", "word " * 200, "--device", "cpu",
                                         "--cache-profile", "none"])
    assert rc == 2 and "fills the context of 64 tokens" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if "--device" in " ".join(c.argv) or c.name in
                                 ("sensitivity", "reap-score", "kld-base", "kld")],
                         ids=lambda c: c.name)
@pytest.mark.parametrize("device, words", [("foo", "not a device torch knows"), ("cuda:7", "cuda"),
                                           ("meta", "cpu or cuda")])
def test_device_names_are_checked(ws, outdir, cmd, device, words):
    torch = pytest.importorskip("torch")
    if device == "cuda:7" and torch.cuda.is_available() and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    files = files_for(ws, outdir, cmd)
    argv = cmd.args(files)
    if "--device" in argv:
        argv[argv.index("--device") + 1] = device
    else:
        argv += ["--device", device]
    expect_refusal(cmd, argv, [device, words], input_digests(ws), ws, [outdir])


def test_a_donor_of_another_model_is_refused_before_the_forward_pass(ws, outdir):
    from fle_quant.synth import make_model

    other = make_model(outdir / "other.gguf", "qwen3moe", seed=3, block_count=3, expert_count=8,
                       expert_used_count=2, context_length=64)
    cmd = BY_NAME["sensitivity"]
    files = {**files_for(ws, outdir, cmd), "donor": str(other)}
    expect_refusal(cmd, cmd.args(files), ["block_count"], input_digests(ws), ws)


def test_kld_base_file_claiming_more_than_it_holds(ws, outdir):
    """A header claiming 2^31 chunks and a truncated file: refused from the
    file's size, before anything is allocated."""
    raw = Path(ws["kld"]).read_bytes()
    claim = bytearray(raw)
    claim[len(b"_logits_") + 8:len(b"_logits_") + 12] = (2 ** 31 - 1).to_bytes(4, "little")
    for name, data in (("claim.kld", bytes(claim)), ("short.kld", raw[:-10])):
        (outdir / name).write_bytes(data)
        files = {**files_for(ws, outdir, BY_NAME["kld"]), "kld": str(outdir / name)}
        expect_refusal(BY_NAME["kld"], BY_NAME["kld"].args(files), [name, "truncated"], input_digests(ws), ws)
