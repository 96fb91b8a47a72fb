"""Writing the package's output files: regular files only, atomically, with a normal file's mode.

Every file ridgefill-cpp writes (map files, derived model copies, assembled default models, the
reports of ``eval`` and ``tune``, the JSON of ``bench``) goes through :func:`atomic_path`:

- **Regular files only.** An existing target that is not a regular file (a symbolic link, FIFO,
  device node, socket or directory) is refused by name, never replaced (``-o /dev/null --force``
  leaves ``/dev/null`` alone). :func:`check_output` says so before any work starts.
- **Atomic.** The data goes to a temporary file next to the target, renamed over it once complete;
  on any error the target is left as it was and the temporary file is removed.
- **Mode.** A new file gets the mode ``open()`` would give it, ``0666 & ~umask``; a file that is
  replaced keeps its permission bits (``--force`` never makes a 0644 file private or a 0600 file
  public). ``mode=`` sets them explicitly.
- **Recognisable temporary files.** The temporary file is ``<target>.ridgefill-tmp-<pid>-<random>``
  (not hidden). A write that is killed (SIGKILL, power loss) cannot remove it; the next write to
  the same target removes those whose process is gone.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

#: what a temporary file's name has after the target's name
TMP_MARK = ".ridgefill-tmp-"
_TMP_SUFFIX = re.compile(re.escape(TMP_MARK) + r"(\d+)-[0-9a-f]+$")


class OutputPathError(ValueError):
    """An output path that cannot (or must not) be written."""


def _kind(st: os.stat_result) -> str:
    m = st.st_mode
    return ("a symbolic link" if stat.S_ISLNK(m) else "a directory" if stat.S_ISDIR(m) else
            "a FIFO" if stat.S_ISFIFO(m) else "a character device" if stat.S_ISCHR(m) else
            "a block device" if stat.S_ISBLK(m) else "a socket" if stat.S_ISSOCK(m) else "not a regular file")


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def not_regular(path: os.PathLike | str, follow_symlinks: bool = False) -> str | None:
    """What ``path`` is when it exists and is not a regular file (``"a FIFO"``, ``"a symbolic link"``,
    ...), else None. With ``follow_symlinks`` a link to a regular file counts as one."""
    try:
        st = os.stat(path) if follow_symlinks else os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return None if stat.S_ISREG(st.st_mode) else _kind(st)


def check_output(path: os.PathLike | str, *, overwrite: bool = True) -> Path:
    """``path`` as a Path, after checking that a file can be written there: an existing entry must be
    a regular file (and ``overwrite`` true), the parent a writable directory. Raises
    :class:`OutputPathError` (a ``ValueError``) saying what is wrong; ``FileExistsError`` for an
    existing file without ``overwrite``."""
    path = Path(path)
    what = not_regular(path)
    if what is not None:
        raise OutputPathError(f"{path} is {what}, not a regular file: refusing to replace it")
    if not overwrite and _lstat(path) is not None:
        raise FileExistsError(f"{path} exists (use --force to overwrite it)")
    parent = path.parent
    if not parent.is_dir():
        raise OutputPathError(f"cannot write {path}: {parent} is not a writable directory")
    why = _cannot_create_in(parent, directory=False)
    if why is not None:
        raise OutputPathError(f"cannot write {path}: {parent} is not a writable directory ({why})")
    return path


def check_output_dir(path: os.PathLike | str, *, option: str | None = None) -> Path:
    """``path`` as a Path, after checking that a directory of output files can be made there (it is
    created when the files are written, not here): an existing entry must be a directory in which
    files can be created, else its nearest existing ancestor must be a directory in which
    directories can be created. Raises :class:`OutputPathError` naming ``option`` (e.g. ``--out``)."""
    path = Path(path)
    label = f"{option} {path}" if option else str(path)
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"{label} exists and is not a directory")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise OutputPathError(f"{label}: {existing} is not a writable directory")
    why = _cannot_create_in(existing, directory=existing != path)
    if why is not None:
        raise OutputPathError(f"{label}: {existing} is not a writable directory ({why})")
    return path


def _cannot_create_in(parent: Path, *, directory: bool) -> str | None:
    """Why a file (or a directory) cannot be created in ``parent``, found by creating one and removing
    it again; None when it can. (``os.access`` is no test: it says yes to root for /proc, a read-only
    mount or a full disk's quota alike.)"""
    probe = parent / f".ridgefill-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        if directory:
            os.mkdir(probe)
            os.rmdir(probe)
        else:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def remove_stale_temporaries(path: os.PathLike | str) -> list[Path]:
    """Remove the temporary files of earlier writes to ``path`` whose process no longer exists
    (a write that was killed); returns what was removed."""
    path = Path(path)
    removed = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return removed
    prefix = path.name + TMP_MARK
    for e in entries:
        if not e.name.startswith(prefix):
            continue
        m = _TMP_SUFFIX.search(e.name[len(path.name):])
        if m is None or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
            continue
        try:
            if e.is_file(follow_symlinks=False):
                os.unlink(e.path)
                removed.append(Path(e.path))
        except OSError:
            pass
    return removed


@contextmanager
def atomic_path(path: os.PathLike | str, *, mode: int | None = None) -> Iterator[str]:
    """A temporary file's path to write the contents of ``path`` into (opened by the caller, e.g.
    with ``open(tmp, "wb")`` or ``gguf.GGUFWriter(tmp, ...)``); when the block completes it replaces
    ``path`` atomically, on any error it is removed and ``path`` is left as it was. Refuses (an
    :class:`OutputPathError`) a ``path`` that exists and is not a regular file. The new file's
    permission bits: ``mode`` if given, else those of the file it replaces, else ``0666 & ~umask``
    (what ``open()`` gives a new file)."""
    path = Path(path)
    check_output(path)
    remove_stale_temporaries(path)
    while True:
        tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
            break
        except FileExistsError:
            continue
    try:
        try:
            if mode is None:
                old = _lstat(path)
                if old is not None:
                    mode = stat.S_IMODE(old.st_mode)
            if mode is not None:
                os.fchmod(fd, mode)
        finally:
            os.close(fd)
        yield str(tmp)
        what = not_regular(path)  # replaced by something else while we were writing
        if what is not None:
            raise OutputPathError(f"{path} is {what}, not a regular file: refusing to replace it")
        os.replace(tmp, path)
    finally:
        try:
            os.unlink(tmp)
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise


def write_bytes(path: os.PathLike | str, data: bytes, *, mode: int | None = None) -> Path:
    """Write ``data`` to ``path`` atomically (:func:`atomic_path`)."""
    path = Path(path)
    with atomic_path(path, mode=mode) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
    return path


def sha256_file(path: os.PathLike | str) -> str:
    """The hex SHA-256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
