"""Compile for a CUDA GPU the Triton kernels that a CPU test run launches,
on a machine without one.

Without CUDA the tests run FLE's Triton kernels in Triton's interpreter,
which executes the kernel's Python and so never meets the compiler: a
kernel can pass every CPU test and still fail to compile on the GPU
machine, where device time is scarce. This tool closes that gap in two
steps:

1. record: the given pytest selection runs with ``TRITON_INTERPRET=1`` and
   a plugin (this file, ``-p triton_compile_check``) that writes every
   launch's kernel, argument types and compile-time constants to a JSON
   lines file;
2. compile: in a fresh process (no interpreter, so the kernels are
   ``JITFunction`` objects) each distinct launch is compiled with
   ``triton.compile`` for ``--arch`` (default 90: sm_90, the H100 / H200)
   through PTX to a cubin with Triton's own ``ptxas``; no device is needed.

    python tools/triton_compile_check.py [--arch 90] [--keep FILE] -- PYTEST_ARGS...
    python tools/triton_compile_check.py -- tests/test_kernels.py tests/test_miss_prefetch.py -k stage

Prints one line per distinct launch and exits 1 if any failed to compile
(with the compiler's message), 2 for bad use. What it proves is compilation
under this machine's Triton (which may be newer than the GPU machine's),
not speed or results: those stay with the tests on the GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_RECORD_ENV = "FLE_TRITON_RECORD"
_TORCH_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64",
                "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1", "uint16": "u16",
                "uint32": "u32", "uint64": "u64"}


# ---------------------------------------------------------------------------
# step 1: the pytest plugin that records launches (imported by pytest with -p)


def _arg_type(v) -> "tuple[str, object]":
    """(Triton signature type, constant or None) of one launch argument."""
    dt = getattr(v, "dtype", None)
    if dt is not None and hasattr(v, "data_ptr"):
        name = str(dt).replace("torch.", "")
        if name not in _TORCH_TYPES:
            raise TypeError(f"argument of dtype {dt}")
        return "*" + _TORCH_TYPES[name], None
    if v is None:
        return "constexpr", None
    if isinstance(v, bool):
        return "i1", None
    if isinstance(v, int):
        return ("i32" if -2 ** 31 <= v < 2 ** 31 else "i64"), None
    if isinstance(v, float):
        return "fp32", None
    raise TypeError(f"argument of type {type(v).__name__}")


def _record_launch(fn, arg_names, constexpr_names, args, kwargs, out) -> None:
    opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "num_ctas", "maxnreg") if k in kwargs}
    kwargs.pop("launch_pdl", None)
    sig, consts = {}, {}
    bound = dict(zip(arg_names, args))
    bound.update({k: v for k, v in kwargs.items() if k in arg_names})
    for name in arg_names:
        if name not in bound:
            continue                            # a default: left to the kernel's signature
        v = bound[name]
        if name in constexpr_names:
            sig[name] = "constexpr"
            consts[name] = v.value if hasattr(v, "value") else v
            continue
        ty, _ = _arg_type(v)
        sig[name] = ty
        if ty == "constexpr":
            consts[name] = None
    rec = {"module": fn.__module__, "name": fn.__name__, "signature": sig, "constexprs": consts, "options": opts}
    out.write(json.dumps(rec, sort_keys=True, default=repr) + "\n")
    out.flush()


def pytest_configure(config):      # noqa: D103 - pytest's hook
    path = os.environ.get(_RECORD_ENV)
    if not path:
        return
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    out = open(path, "a")
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        names = list(params)
        const = {n for n, p in params.items() if p.annotation in (tl.constexpr, "tl.constexpr", "constexpr")}
        try:
            _record_launch(self.fn, names, const, args, dict(kwargs), out)
        except TypeError as e:             # an argument this tool cannot type: said, the run goes on
            out.write(json.dumps({"module": self.fn.__module__, "name": self.fn.__name__, "skip": str(e)}) + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recording_run


# ---------------------------------------------------------------------------
# step 2: compile what was recorded


def compile_records(path: Path, arch: int) -> int:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    seen, failed, skipped = set(), 0, 0
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "skip" in rec:
            print(f"skipped {rec['module']}.{rec['name']}: {rec['skip']}")
            skipped += 1
            continue
        key = json.dumps(rec, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        fn = getattr(importlib.import_module(rec["module"]), rec["name"], None)
        what = f"{rec['module']}.{rec['name']} {rec['constexprs']} {rec['options']}"
        if fn is None or not hasattr(fn, "arg_names"):
            print(f"not found as a module-level kernel: {what}")
            skipped += 1
            continue
        t0 = time.perf_counter()
        try:
            triton.compile(ASTSource(fn, rec["signature"], rec["constexprs"]), target=target,
                           options=rec["options"] or None)
        except Exception as e:  # noqa: BLE001 - the compiler's message is the result
            failed += 1
            msg = str(e).strip().splitlines()
            print(f"FAILED {what}\n    " + "\n    ".join(msg[-12:]))
            continue
        print(f"ok {time.perf_counter() - t0:5.1f} s  {what}")
    print(f"{len(seen)} distinct launches compiled for sm_{arch}: {len(seen) - failed} ok, {failed} failed"
          + (f", {skipped} not compiled (above)" if skipped else ""))
    return 1 if failed else 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: tools/triton_compile_check.py [--arch 90] [--keep FILE] -- PYTEST_ARGS...", file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="the GPU's compute capability as one number (default 90)")
    p.add_argument("--keep", type=Path, default=None, help="keep the recorded launches in this file")
    args = p.parse_args(argv[:cut])
    tests = argv[cut + 1:]
    rec = args.keep or Path(tempfile.mkstemp(suffix=".jsonl", prefix="triton-launches-")[1])
    rec.write_text("")
    here = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET="1", **{_RECORD_ENV: str(rec)})
    env["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "triton_compile_check", *tests], env=env)
    if r.returncode not in (0, 5):
        print(f"the recording test run failed (exit {r.returncode}); compiling what it launched", file=sys.stderr)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(here.parent), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    code = ("import sys; sys.path.insert(0, %r); import triton_compile_check as t; "
            "raise SystemExit(t.compile_records(t.Path(%r), %d))" % (str(here), str(rec), args.arch))
    c = subprocess.run([sys.executable, "-c", code], env=env)
    if args.keep is None:
        rec.unlink(missing_ok=True)
    return c.returncode if r.returncode in (0, 5) else max(1, c.returncode)


if __name__ == "__main__":
    raise SystemExit(main())
