"""The one error class FLE raises for bad user input.

Every problem a user can fix (a truncated file, a missing shard, an unknown
quant type, an output that already exists) is reported as a :class:`FleError`
whose message names the file, tensor or field and says what to do. Console
scripts catch it, print one line and exit with status 2; anything else that
escapes is a bug in FLE.
"""


class FleError(Exception):
    """A problem with the user's input, explained in one line."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process was, so that the same cleanup as for
    Ctrl-C runs; console scripts exit 143 on it."""
