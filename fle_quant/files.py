"""The one way FLE reads its inputs and writes its outputs.

Inputs: :func:`check_input` accepts regular files only (a FIFO, device,
socket, folder or symlink loop is refused at once, before anything blocks on
it) and records the file as an input of the running command.

Outputs: :class:`OutputSet` writes every file FLE produces (GGUF models and
their shards, JSON tables, Markdown cards, KLD base files):

- it refuses an output that resolves (real path, hard link, or any shard name
  of the same split model) to an input of the command, before anything is
  written;
- it takes a lock per output: ``.NAME.fle-lock`` next to it, held with
  ``flock`` for the whole write, so a second writer to the same output is
  refused at once and a killed writer's lock file holds nothing (the kernel
  drops the lock with the process);
- under the lock it removes what a killed writer left for the same output:
  temporary files, and the shards of a set whose publishing was cut short
  (recorded in ``.NAME.fle-publish`` while the shards are renamed);
- it creates each temporary file ``.FINAL.fle-tmp-<pid>`` exclusively
  (``O_EXCL``), and publishes by renaming: every shard but the first, then the
  first, so a complete-looking set (shard 1 is what loaders are given) never
  exists before the whole set does;
- on any error or interruption its temporary files and lock are removed, and
  errors of the file system (permission, a folder in the way, a name too
  long, a read-only or full file system, a file too large) become one
  :class:`FleError` line naming the output.

:func:`scratch_dir` makes scratch folders with the same promise: removed on
every exit path, and a killed run's folder removed by the next run.

Which files are the command's inputs: console scripts run inside
:func:`command_scope` (``cli_entry`` does this); every file opened through
:func:`check_input` (GGUF shards, JSON, texts, imatrix and KLD files) is
recorded there, and commands also :func:`declare_inputs` from their arguments
so that an output naming an input is refused before any work starts. Library
callers pass ``inputs=`` explicitly.
"""
from __future__ import annotations

import contextlib
import contextvars
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from .errors import FleError

__all__ = [
    "TMP_TAG",
    "LOCK_TAG",
    "check_input",
    "declare_inputs",
    "command_scope",
    "refuse_inputs",
    "write_error",
    "OutputSet",
    "output_family",
    "scratch_dir",
]

TMP_TAG = ".fle-tmp-"
LOCK_TAG = ".fle-lock"
PUBLISH_TAG = ".fle-publish"
_NAME_MAX = 255
_SHARD_SUFFIX = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


# ---------------------------------------------------------------------------
# errors of the file system, as one line


def write_error(path: "str | os.PathLike[str]", e: OSError) -> FleError:
    """One line for an OSError met while creating or writing ``path``."""
    p = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(p))
    n = e.errno
    if n in _DISK_FULL:
        return FleError(f"{p}: disk full while writing it ({os.strerror(n)}); free space or write elsewhere")
    if n == errno.EFBIG:
        return FleError(f"{p}: disk full for this file: larger than the file system or the process's file size "
                        "limit allows; split the output or write elsewhere")
    if n in (errno.EACCES, errno.EPERM):
        return FleError(f"{p}: permission denied writing in {folder}; choose a folder you can write to")
    if n == errno.EROFS:
        return FleError(f"{p}: {folder} is on a read-only file system; write elsewhere")
    if n == errno.EISDIR:
        return FleError(f"{p}: is a directory; give a file name for the output")
    if n == errno.ENOTDIR:
        return FleError(f"{p}: a part of the path is not a folder; give a path in an existing folder")
    if n == errno.ENAMETOOLONG:
        return FleError(f"{p}: file name too long for the file system; choose a shorter name")
    if n == errno.ENOENT:
        if os.path.isdir(folder):
            return FleError(f"{p}: files cannot be created in {folder}; write elsewhere")
        return FleError(f"{p}: the folder {folder} does not exist")
    if n == errno.EEXIST:
        return FleError(f"{p}: exists; choose another name or pass --force to replace it")
    return FleError(f"{p}: cannot write it ({e.strerror or e}); write elsewhere")


def _read_error(path: str, e: OSError, what: str) -> FleError:
    n = e.errno
    if n == errno.ENOENT:
        return FleError(f"{path}: no such file; give the {what}")
    if n == errno.ELOOP:
        return FleError(f"{path}: a loop of symbolic links; give the {what} itself")
    if n in (errno.EACCES, errno.EPERM):
        return FleError(f"{path}: permission denied; give a {what} you can read")
    if n == errno.ENAMETOOLONG:
        return FleError(f"{path}: file name too long; give the {what}")
    if n == errno.ENOTDIR:
        return FleError(f"{path}: a part of the path is not a folder; give the {what}")
    return FleError(f"{path}: cannot read it ({e.strerror or e}); give the {what}")


# ---------------------------------------------------------------------------
# the inputs of the running command


@dataclass
class _Inputs:
    files: set[tuple[int, int]] = field(default_factory=set)  # (st_dev, st_ino)
    paths: dict[str, str] = field(default_factory=dict)  # real path -> as given
    families: dict[tuple[str, str], str] = field(default_factory=dict)  # (real folder, stem) -> as given


_SCOPE: contextvars.ContextVar[_Inputs | None] = contextvars.ContextVar("fle_inputs", default=None)


@contextlib.contextmanager
def command_scope() -> Iterator[None]:
    """Record the inputs of one command run (console scripts run in one)."""
    token = _SCOPE.set(_Inputs())
    try:
        yield
    finally:
        _SCOPE.reset(token)


def family_of(path: "str | os.PathLike[str]") -> tuple[str, str]:
    """(real folder, stem): the names ``stem.gguf`` and ``stem-0000k-of-0000N.gguf``
    share one; any other file is a family of its own name."""
    p = Path(path)
    name = p.name
    m = _SHARD_SUFFIX.search(name)
    if m is not None:
        stem = name[: m.start()]
    elif name.endswith(".gguf"):
        stem = name[: -len(".gguf")]
    else:
        stem = name
    try:
        folder = os.path.realpath(p.parent)
    except (OSError, ValueError):
        folder = os.path.abspath(p.parent)
    return folder, stem if (m is not None or name.endswith(".gguf")) else "\0" + name


def _record(inputs: _Inputs, path: str, st: os.stat_result | None) -> None:
    with contextlib.suppress(OSError, ValueError):
        inputs.paths.setdefault(os.path.realpath(path), path)
    if st is not None:
        inputs.files.add((st.st_dev, st.st_ino))
    fam = family_of(path)
    if not fam[1].startswith("\0"):
        inputs.families.setdefault(fam, path)


def declare_inputs(*paths: "str | os.PathLike[str] | None", into: _Inputs | None = None) -> None:
    """Record files given as inputs (None entries are skipped), whether or
    not they exist yet; a GGUF name stands for every shard of its model."""
    inputs = into if into is not None else _SCOPE.get()
    if inputs is None:
        return
    for p in paths:
        if p is None:
            continue
        path = os.fspath(p)
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            st = None
        _record(inputs, path, st)


def check_input(path: "str | os.PathLike[str]", what: str = "input file") -> os.stat_result:
    """Stat ``path`` and accept only a regular file; records it as an input.

    Refused at once: a missing file, a folder, a FIFO, a device or socket, a
    loop of symbolic links (nothing is opened, so nothing can block)."""
    label = os.fspath(path)
    try:
        st = os.stat(label)
    except OSError as e:
        raise _read_error(label, e, what) from None
    except ValueError:
        raise FleError(f"{label!r}: not a valid file name; give the {what}") from None
    mode = st.st_mode
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        raise FleError(f"{label}: is {kind}, not a regular file; give the {what} itself")
    inputs = _SCOPE.get()
    if inputs is not None:
        _record(inputs, label, st)
    return st


def open_input(path: "str | os.PathLike[str]", what: str = "input file"):
    """``open(path, "rb")`` after :func:`check_input`, with one-line errors."""
    check_input(path, what)
    label = os.fspath(path)
    try:
        return open(label, "rb")
    except OSError as e:
        raise _read_error(label, e, what) from None


def refuse_inputs(outputs: Iterable["str | os.PathLike[str]"],
                  inputs: Iterable["str | os.PathLike[str]"] = ()) -> None:
    """FleError when an output names an input of the command: the same real
    path, the same file under another name (a hard link), or a name of the
    same split model (``x.gguf`` / ``x-0000k-of-0000N.gguf``). ``inputs``
    adds to those recorded by the running command."""
    recorded = _SCOPE.get()
    known = _Inputs()
    if recorded is not None:
        known.files |= recorded.files
        known.paths.update(recorded.paths)
        known.families.update(recorded.families)
    declare_inputs(*inputs, into=known)
    for out in outputs:
        o = os.fspath(out)
        try:
            real = os.path.realpath(o)
        except (OSError, ValueError):
            real = os.path.abspath(o)
        src = known.paths.get(real)
        if src is None:
            try:
                st = os.stat(o)
            except (OSError, ValueError):
                st = None
            if st is not None and (st.st_dev, st.st_ino) in known.files:
                src = "an input (the same file under another name)"
        if src is None:
            fam = family_of(o)
            if fam in known.families:
                src = f"{known.families[fam]} (a file of the same split model)"
        if src is not None:
            raise FleError(f"{o}: the output would overwrite an input, {src}; choose another output name")


# ---------------------------------------------------------------------------
# outputs


def output_family(final: Path) -> tuple[str, str]:
    """(stem, suffix) of an output name: ``x-00002-of-00003.gguf`` ->
    ``("x", "-00002-of-00003.gguf")``; ``sel.json`` -> ``("sel.json", "")``."""
    name = final.name
    m = _SHARD_SUFFIX.search(name)
    if m is not None:
        return name[: m.start()], name[m.start():]
    if name.endswith(".gguf"):
        return name[: -len(".gguf")], ".gguf"
    return name, ""


def _tag(stem: str) -> str:
    """The stem as it appears in helper names; a hash when the name would get too long."""
    if len(os.fsencode(stem)) <= _NAME_MAX - 64:
        return stem
    return "fle-" + hashlib.sha256(os.fsencode(stem)).hexdigest()[:24]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _Group:
    """One output (a file, or the shards of one split file) and its lock."""

    def __init__(self, finals: list[Path]):
        self.finals = finals
        self.folder = finals[0].parent
        stem, _ = output_family(finals[0])
        self.stem = stem
        self.tag = _tag(stem)
        self.lock_path = self.folder / f".{self.tag}{LOCK_TAG}"
        self.journal = self.folder / f".{self.tag}{PUBLISH_TAG}"
        self.lock_fd: int | None = None

    def temp(self, final: Path) -> Path:
        _, suffix = output_family(final)
        return final.with_name(f".{self.tag}{suffix}{TMP_TAG}{os.getpid()}")

    def lock(self) -> None:
        import fcntl

        while True:
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            except OSError as e:
                raise write_error(self.finals[0], e) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise FleError(f"{self.finals[0]}: another FLE process is writing this output now; wait for it "
                               "to finish or stop it") from None
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    os.close(fd)
                    raise write_error(self.finals[0], e) from None
                # a file system without locks: the exclusive temporary files still keep writers apart
            try:
                st_fd, st_path = os.fstat(fd), os.stat(self.lock_path)
            except FileNotFoundError:
                os.close(fd)
                continue  # the holder removed it as we opened it: take the next one
            if (st_fd.st_dev, st_fd.st_ino) != (st_path.st_dev, st_path.st_ino):
                os.close(fd)
                continue
            self.lock_fd = fd
            return

    def unlock(self) -> None:
        if self.lock_fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.lock_path)
        os.close(self.lock_fd)
        self.lock_fd = None

    def _leftovers(self) -> list[Path]:
        found = []
        prefix = f".{self.tag}"
        try:
            names = os.listdir(self.folder)
        except OSError:
            return []
        for name in names:
            if not name.startswith(prefix) or TMP_TAG not in name:
                continue
            middle, _, pid = name[len(prefix):].rpartition(TMP_TAG)
            if pid.isdigit() and (middle in ("", ".gguf") or _SHARD_SUFFIX.fullmatch(middle)):
                found.append(self.folder / name)
        return found

    def _journal_names(self) -> list[str] | None:
        """The shard names a cut-short publish recorded, or None."""
        try:
            raw = self.journal.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise write_error(self.journal, e) from None
        try:
            names = json.loads(raw.decode("utf-8"))
            return [n for n in names if isinstance(n, str) and "/" not in n and n not in ("", ".", "..")]
        except (ValueError, TypeError):
            return []

    def incomplete(self) -> set[str]:
        """Names of a shard set whose publishing was cut short (shard 1, renamed
        last, is missing): a killed run's leftovers, not an output."""
        names = self._journal_names()
        if names and not (self.folder / names[0]).exists():
            return set(names)
        return set()

    def clean(self) -> None:
        """Under the lock: remove what killed writers of this output left."""
        for p in self._leftovers():
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        if self._journal_names() is None:
            return
        for n in self.incomplete():
            with contextlib.suppress(FileNotFoundError):
                (self.folder / n).unlink()
        with contextlib.suppress(FileNotFoundError):
            self.journal.unlink()


class OutputSet:
    """The files one command writes, published together.

    ``outputs``: one list of final names per output (a single file, or the
    shards of a split file, shard 1 first). Use as a context manager::

        with OutputSet([[out]], force=force) as outs:
            with outs.open(out) as f:
                f.write(...)
            outs.commit()

    Entering checks the inputs, takes the locks, removes a killed run's
    leftovers and refuses existing outputs unless ``force``; leaving without
    :meth:`commit` (an error, Ctrl-C) removes every temporary file.
    """

    def __init__(self, outputs: list[list["str | os.PathLike[str]"]], *, force: bool = False,
                 inputs: Iterable["str | os.PathLike[str]"] = ()):
        self.groups = [_Group([Path(p) for p in finals]) for finals in outputs if finals]
        self.force = force
        self.inputs = list(inputs)
        self._temps: dict[Path, Path] = {}
        self._group_of: dict[Path, _Group] = {g_f: g for g in self.groups for g_f in g.finals}
        self.committed = False

    # setup -----------------------------------------------------------------
    def check(self) -> None:
        """Checks that need no lock: inputs, folders, existing outputs."""
        finals = [f for g in self.groups for f in g.finals]
        seen: dict[tuple[str, str], Path] = {}
        for g in self.groups:
            fam = family_of(g.finals[0])
            if fam in seen:
                raise FleError(f"{g.finals[0]}: the same output name as {seen[fam]}; give each output its own name")
            seen[fam] = g.finals[0]
        refuse_inputs(finals, self.inputs)
        for f in finals:
            check_output_path(f, self.force)

    def __enter__(self) -> "OutputSet":
        self.check()
        try:
            for g in self.groups:
                g.lock()
                g.clean()
            if not self.force:  # again, now that no other FLE writer can add one
                for f in self._group_of:
                    if os.path.lexists(f):
                        raise FleError(f"{f}: output exists; choose another name or pass --force to overwrite")
        except BaseException:
            self._release()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._release()
        if isinstance(exc, OSError) and not isinstance(exc, FleError):
            where = getattr(exc, "filename", None)
            target = next((f for f, t in self._temps.items() if os.fspath(t) == where), None)
            target = target or next(iter(self._temps), None) or next(iter(self._group_of), Path("output"))
            raise write_error(target, exc) from None

    def _release(self) -> None:
        if not self.committed:
            for t in self._temps.values():
                with contextlib.suppress(OSError):
                    os.unlink(t)
        for g in self.groups:
            g.unlock()

    # writing ---------------------------------------------------------------
    def create(self, final: "str | os.PathLike[str]") -> int:
        """Create ``final``'s temporary file exclusively; a writable fd."""
        final = Path(final)
        g = self._group_of.get(final)
        if g is None:
            raise FleError(f"{final}: not one of this command's outputs")
        tmp = g.temp(final)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise write_error(final, e) from None
        self._temps[final] = tmp
        return fd

    def open(self, final: "str | os.PathLike[str]", mode: str = "wb", **kw):
        """A file object on ``final``'s temporary file (``wb`` or ``w``)."""
        fd = self.create(final)
        return os.fdopen(fd, mode, **kw)

    def temp(self, final: "str | os.PathLike[str]") -> Path:
        return self._temps[Path(final)]

    def commit(self) -> list[Path]:
        """Publish every output: fsync'd temporaries renamed to their final
        names, shard 1 of each output last."""
        for final in self._group_of:
            if final not in self._temps:
                raise FleError(f"{final}: was not written")
        try:
            for final, tmp in self._temps.items():
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            multi = [g for g in self.groups if len(g.finals) > 1]
            for g in multi:
                data = json.dumps([f.name for f in g.finals]).encode()
                with open(g.journal, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                # an older complete set loses its shard 1 first: a mixed set never looks complete
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(g.finals[0])
            for g in self.groups:
                for final in g.finals[1:][::-1]:
                    os.replace(self._temps[final], final)
            for g in self.groups:
                os.replace(self._temps[g.finals[0]], g.finals[0])
            for g in multi:
                with contextlib.suppress(FileNotFoundError):
                    g.journal.unlink()
            for folder in {g.folder for g in self.groups}:
                _fsync_dir(folder)
        except OSError as e:
            raise write_error(next(iter(self._group_of)), e) from None
        self.committed = True
        return list(self._group_of)


def check_output_path(path: "str | os.PathLike[str]", force: bool) -> None:
    """Refuse before any work an output whose folder is missing, that is a
    folder, whose name is too long, or that exists (without ``force``)."""
    p = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(p))
    if not os.path.isdir(folder):
        raise FleError(f"{p}: the folder {folder} does not exist")
    if os.path.isdir(p):
        raise FleError(f"{p}: is a directory; give a file name for the output")
    if len(os.fsencode(os.path.basename(p))) > _NAME_MAX:
        raise write_error(p, OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG)))
    if not force and os.path.lexists(p) and os.path.basename(p) not in _Group([Path(p)]).incomplete():
        raise FleError(f"{p}: output exists; choose another name or pass --force to overwrite")
    # can a file be made there at all (permissions, a read-only file system, /proc)? try the temporary's name
    probe = _Group([Path(p)]).temp(Path(p))
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        return  # a leftover of a killed run: the writer removes it under its lock
    except OSError as e:
        raise write_error(p, e) from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)


def check_outputs(paths: Iterable["str | os.PathLike[str] | None"], force: bool) -> None:
    """The checks of :class:`OutputSet` that need no lock, for a command to
    run before its work starts (inputs declared first)."""
    paths = [p for p in paths if p is not None]
    OutputSet([[p] for p in paths], force=force).check()


def write_bytes_atomic(path: "str | os.PathLike[str]", data: bytes, force: bool = False,
                       inputs: Iterable["str | os.PathLike[str]"] = ()) -> Path:
    """``data`` under ``path`` through an :class:`OutputSet`."""
    final = Path(path)
    with OutputSet([[final]], force=force, inputs=inputs) as outs:
        fd = outs.create(final)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError as e:
            raise write_error(final, e) from None
        finally:
            os.close(fd)
        outs.commit()
    return final


# ---------------------------------------------------------------------------
# scratch folders


_SCRATCH_LOCK = ".fle-scratch-lock"


def _sweep_scratch(parent: Path, prefix: str) -> None:
    import fcntl
    import time

    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(prefix):
            continue
        d = parent / name
        try:
            if not stat.S_ISDIR(os.lstat(d).st_mode):
                continue
            fd = os.open(d / _SCRATCH_LOCK, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            # made before its lock existed: only an old one is a leftover
            with contextlib.suppress(OSError):
                if time.time() - os.lstat(d).st_mtime > 300:
                    shutil.rmtree(d, ignore_errors=True)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a live run's
        try:
            shutil.rmtree(d, ignore_errors=True)
        finally:
            os.close(fd)


@contextlib.contextmanager
def scratch_dir(parent: "str | os.PathLike[str] | None", prefix: str) -> Iterator[Path]:
    """A scratch folder ``<parent>/<prefix>XXXX`` (parent: the system's
    temporary folder when None), held with a lock while in use and removed
    on every exit path; folders of killed runs with the same prefix are
    removed first."""
    import fcntl

    base = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    _sweep_scratch(base, prefix)
    try:
        d = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    except OSError as e:
        raise write_error(base / prefix, e) from None
    fd = None
    try:
        try:
            fd = os.open(d / _SCRATCH_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise write_error(d, e) from None
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
        if fd is not None:
            os.close(fd)


def preallocate(fd: int, n_bytes: int, path: "str | os.PathLike[str]") -> None:
    """Reserve ``n_bytes`` for a file that will be memory-mapped, so that a
    full disk is an error now rather than SIGBUS at a page write later."""
    try:
        os.posix_fallocate(fd, 0, n_bytes)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return  # the file system cannot reserve; writes will tell
        raise write_error(path, e) from None
