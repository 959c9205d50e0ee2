"""The files ``fp16fx train`` writes (``--save`` checkpoints, ``--plot`` images): checked
before the run by doing what writing them will do, and written atomically."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Callable
from typing import BinaryIO

__all__ = ["problem", "same_file", "write_atomic"]


def problem(path: str) -> str | None:
    """Returns why :func:`write_atomic` cannot write ``path``, or None when it can.

    Found by doing what the write will do: the file's directory is made if it is missing (it
    stays: the write needs it), and a file named as the write's temporary one is created and
    removed. So what the file system refuses -- permissions, a read-only disk, a name too
    long -- shows now, not after training. (A full disk shows only when the file is written.)
    """
    if os.path.isdir(path) or path.endswith(os.sep) or os.path.basename(path) in ("", ".", ".."):
        return "it names a directory, not a file"
    if os.path.lexists(path) and not os.path.isfile(path):
        return "it exists and is not a regular file (a device, a pipe or a dangling link)"
    path = _target(path)
    if _owned_by_another_in_a_sticky_directory(path):
        return (
            "it belongs to another user, in a directory (like /tmp) where only they may replace it"
        )
    name = None
    try:
        _make_parent(path)
        candidate = _temporary_name(path)
        os.close(os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        name = candidate  # ours to remove (a name taken already is someone else's)
        os.unlink(name)  # the write's rename needs this right too
        name = None
    except (FileExistsError, NotADirectoryError) as exc:
        return _not_a_directory(path) or exc.strerror or str(exc)
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        if name is not None:  # interrupted, or not removable: as far as it can be
            with contextlib.suppress(OSError):
                os.unlink(name)
    return None


def write_atomic(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Writes the file ``path`` with ``write(f)``, atomically.

    The bytes go to a temporary file beside ``path`` (the same file system), which is
    flushed, fsync-ed and renamed over ``path`` with ``os.replace``; the directory is then
    fsync-ed so that the rename itself survives a power cut. A crash at any point leaves the
    old file or the new one, never a torn one. The file keeps the permissions of the one it
    replaces (a new one: the umask's); a missing directory is made. On any error the
    temporary file is removed, ``path`` is left as it was, and the error raised. A ``path``
    that is a link to a file writes that file (the link stays).
    """
    path = _target(path)
    _make_parent(path)
    name = _temporary_name(path)
    try:
        # Inside the try, so that an interrupt right after it removes the file; a name taken
        # already (FileExistsError, one in 2**32) is someone else's, not removed.
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # minus the umask
        with os.fdopen(fd, "wb") as f:
            replaced = _stat(path)
            if replaced is not None and stat.S_ISREG(replaced.st_mode):
                os.fchmod(f.fileno(), stat.S_IMODE(replaced.st_mode))
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(name, path)
    except FileExistsError:
        raise
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise
    _fsync_directory(_directory(path))


def same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file (after links, hard ones too, ``..`` and
    the like; one that does not exist yet by its resolved path)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _target(path: str) -> str:
    """The file a write to ``path`` replaces: a link's target (the link stays), else ``path``."""
    return os.path.realpath(path) if os.path.islink(path) else path


def _owned_by_another_in_a_sticky_directory(path: str) -> bool:
    """Whether ``path`` exists in a sticky directory (``/tmp``) and belongs to another user,
    so that renaming a file over it is refused (and the first save would fail)."""
    try:
        mine, directory = os.stat(path), os.stat(_directory(path))
    except OSError:
        return False
    sticky = directory.st_mode & stat.S_ISVTX
    owners = (mine.st_uid, directory.st_uid)
    return bool(sticky) and os.geteuid() != 0 and os.geteuid() not in owners


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def _directory(path: str) -> str:
    # As written, not normalised: the kernel resolves "link/.." through the link.
    return os.path.dirname(path) or "."


def _make_parent(path: str) -> None:
    os.makedirs(_directory(path), exist_ok=True)


def _temporary_name(path: str) -> str:
    """A new name beside ``path``, 14 characters longer than its name (as mkstemp's are)."""
    return os.path.join(_directory(path), f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")


def _not_a_directory(path: str) -> str | None:
    """Names the nearest ancestor of ``path`` that exists and is not a directory, if any."""
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    return None if os.path.isdir(ancestor) else f"{ancestor} is not a directory"


def _fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
