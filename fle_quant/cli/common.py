"""What every FLE console script shares: bad input becomes one line on
stderr and exit status 2, never a traceback."""
from __future__ import annotations

import functools
import os
import sys
from typing import Callable

from ..errors import FleError


def cli_entry(prog: str) -> Callable[[Callable[[list[str] | None], int | None]], Callable[[list[str] | None], int]]:
    """Wrap ``main(argv)`` so that FleError prints ``prog: error: message``
    and exits 2, and Ctrl-C exits 130 without a traceback."""

    def wrap(main):
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> int:
            try:
                rc = main(argv)
            except FleError as e:
                print(f"{prog}: error: {e}", file=sys.stderr)
                return 2
            except KeyboardInterrupt:
                print(f"{prog}: interrupted; no output was left behind", file=sys.stderr)
                return 130
            except BrokenPipeError:
                # e.g. `fle-inspect x.gguf | head`: not an error of the user's
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                return 0
            return int(rc or 0)

        return run

    return wrap


def exit_main(main: Callable[[list[str] | None], int]) -> None:
    sys.exit(main(None))
