"""The files ``fp16fx train`` writes (``--save``, ``--plot``): checked before any work, and
checked without leaving anything behind, so that a refused run changes nothing on disk."""

from __future__ import annotations

import os
import tempfile

__all__ = ["make_parent", "problem", "same_file"]


def problem(path: str) -> str | None:
    """Returns why a file cannot be written at ``path``, or None when it can. Creates nothing:
    a directory that does not exist yet is made when the file is written (:func:`make_parent`),
    and only its nearest existing ancestor is checked now."""
    if os.path.isdir(path) or path.endswith(os.sep) or not os.path.basename(path):
        return "it names a directory, not a file"
    directory = os.path.dirname(os.path.abspath(path))
    existing = directory
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is not a directory"
    if existing != directory:
        if os.access(existing, os.W_OK | os.X_OK):
            return None
        return f"cannot create a directory in {existing}: permission denied"
    try:  # a real write: os.access cannot see every refusal (ACLs, full or read-only disks)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".fp16fx-probe-"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def make_parent(path: str) -> None:
    """Creates the directory ``path`` goes into, if it does not exist (raises OSError)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file (after links, ``..`` and the like)."""
    return os.path.realpath(a) == os.path.realpath(b)
