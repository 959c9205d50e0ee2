"""The files ``fp16fx train`` writes (``--save``, ``--plot``): checked before any work, and
checked without leaving anything behind, so that a refused run changes nothing on disk."""

from __future__ import annotations

import contextlib
import os
import secrets

__all__ = ["make_parent", "problem", "same_file", "temporary_name"]


def problem(path: str) -> str | None:
    """Returns why a file cannot be written at ``path``, or None when it can.

    Checked by doing it: the missing directories are made, a file named as
    :func:`temporary_name` names one is created, and both are removed again, so that what the
    file system refuses (permissions, a read-only or full disk, a name too long) shows now and
    nothing is left behind. (The directories are made for good when the file is written:
    :func:`make_parent`.)"""
    if os.path.isdir(path) or path.endswith(os.sep) or not os.path.basename(path):
        return "it names a directory, not a file"
    directory = os.path.dirname(os.path.abspath(path))
    missing, existing = [], directory
    while not os.path.lexists(existing):
        missing.append(existing)
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is not a directory"
    made = []
    try:
        for new in reversed(missing):
            os.mkdir(new)
            made.append(new)
        probe = temporary_name(path)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        for new in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(new)
    return None


def temporary_name(path: str) -> str:
    """Returns a new name beside ``path`` for a file that will be renamed to ``path``: 14
    characters longer than its name, as ``tempfile.mkstemp``'s are."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.{secrets.token_hex(4)}.tmp")


def make_parent(path: str) -> None:
    """Creates the directory ``path`` goes into, if it does not exist (raises OSError)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file (after links, ``..`` and the like)."""
    return os.path.realpath(a) == os.path.realpath(b)
