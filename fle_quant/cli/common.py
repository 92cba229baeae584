"""What every FLE console script shares: bad input becomes one line on
stderr and exit status 2, never a traceback; Ctrl-C exits 130 and SIGTERM
143, each with one line, after the output mechanism removed what the run had
started to write (see :mod:`fle_quant.files`)."""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
from typing import Callable, Iterator

from ..errors import FleError, Terminated
from ..files import check_outputs, command_scope, declare_inputs, write_error

__all__ = ["cli_entry", "exit_main", "declare_inputs", "check_outputs", "check_device"]


def check_device(device: str, option: str = "--device") -> str:
    """A torch device name that torch can use here: ``cpu``, or ``cuda`` /
    ``cuda:N`` with that GPU present; anything else is one line. Imports
    torch (only commands that run torch call it)."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise FleError(f"{option} {device!r}: not a device torch knows; use cpu or cuda") from None
    if dev.type == "cpu":
        return device
    if dev.type != "cuda":
        raise FleError(f"{option} {device!r}: FLE runs on cpu or cuda")
    if not torch.cuda.is_available():
        raise FleError(f"{option} {device}: no CUDA device is available here; use {option} cpu")
    n = torch.cuda.device_count()
    if dev.index is not None and dev.index >= n:
        raise FleError(f"{option} {device}: this machine has {n} CUDA device{'s' if n != 1 else ''} "
                       f"(cuda:0{f'..cuda:{n - 1}' if n > 1 else ''}); use one of them")
    return device


def _raise_terminated(signum, frame):
    raise Terminated()


@contextlib.contextmanager
def _signals() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` while the command runs (when the
    process left SIGTERM at its default); SIGINT stays Python's."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.getsignal(signal.SIGTERM)
    if old is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        if old is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, old)


def cli_entry(prog: str) -> Callable[[Callable[[list[str] | None], int | None]], Callable[[list[str] | None], int]]:
    """Wrap ``main(argv)`` so that FleError prints ``prog: error: message``
    and exits 2, Ctrl-C exits 130 and SIGTERM 143 without a traceback, and
    the command's inputs are recorded for its outputs to be checked against."""

    def wrap(main):
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> int:
            try:
                with command_scope(), _signals():
                    rc = main(argv)
            except FleError as e:
                print(f"{prog}: error: {e}", file=sys.stderr)
                return 2
            except Terminated:
                print(f"{prog}: terminated; no output was left behind", file=sys.stderr)
                return 143
            except KeyboardInterrupt:
                print(f"{prog}: interrupted; no output was left behind", file=sys.stderr)
                return 130
            except BrokenPipeError:
                # e.g. `fle-inspect x.gguf | head`: not an error of the user's
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                return 0
            except MemoryError:
                print(f"{prog}: error: out of memory; give smaller sizes or use a machine with more memory",
                      file=sys.stderr)
                return 2
            except OSError as e:
                # a file-system error no check foresaw: still one line
                print(f"{prog}: error: {write_error(e.filename or '?', e) if e.filename else e.strerror or e}",
                      file=sys.stderr)
                return 2
            return int(rc or 0)

        return run

    return wrap


def exit_main(main: Callable[[list[str] | None], int]) -> None:
    sys.exit(main(None))
