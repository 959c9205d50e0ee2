"""Checkpoints of ``fp16fx train``: atomic writes, safe loads, and a check that they fit.

A checkpoint is one ``torch.save`` file holding only tensors and Python primitives, so it is
read with ``torch.load(weights_only=True)`` (no pickled code runs)::

    {
        "format": "fp16fx.train/2",
        "run": {"model": ..., "dataset": ..., "api": ..., "seed": ...,  # must match
                "fsdp": ..., "master": ..., "moments": ...},
        "epoch": 3,                                  # epochs completed
        "stepper": {"model": ..., "optimizer": ...}, # Stepper.state_dict()
        "rng": {"torch": ByteTensor, "data": ByteTensor[, "cuda": ByteTensor]},
        "history": {...},                            # loop.History.to_dict()
    }

:func:`save_atomic` writes a temporary file in the target's directory, flushes and fsyncs it,
then ``os.replace``-s it over the target: a crash or error at any point leaves either the old
checkpoint or the new one, never a torn file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

import torch

__all__ = [
    "FORMAT",
    "CheckpointError",
    "check_writable",
    "load_checkpoint",
    "save_atomic",
    "saved_precision",
]

FORMAT = "fp16fx.train/2"
_REQUIRED = ("format", "run", "epoch", "stepper", "rng", "history")

#: The settings of checkpoints written before their ``run`` recorded them.
_IDENTITY_DEFAULTS = {"fsdp": False}

#: The precision of checkpoints written before their ``run`` recorded one.
_PRECISION_DEFAULTS = {"master": "fp32", "moments": "fp32"}


def saved_precision(ckpt: dict[str, Any]) -> dict[str, str]:
    """Returns the ``master`` and ``moments`` a checked checkpoint was written with (FP32 for
    one written before its ``run`` recorded them)."""
    return {key: ckpt["run"].get(key, value) for key, value in _PRECISION_DEFAULTS.items()}


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read, or does not fit this run; the message says why."""


def check_writable(path: str) -> None:
    """Returns None when a checkpoint can be written at ``path`` (creating its directory).

    Checked before training starts, so that a bad ``--save`` fails in a second, not after the
    first epoch. Raises :class:`CheckpointError` naming the problem.
    """
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or path.endswith(os.sep) or not os.path.basename(path):
        raise CheckpointError(f"cannot save to {path!r}: it names a directory, not a file")
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".fp16fx-probe-"):
            pass
    except OSError as exc:
        raise CheckpointError(f"cannot save to {path}: {exc.strerror or exc}") from None


def save_atomic(obj: Any, path: str) -> None:
    """Writes ``obj`` with ``torch.save`` to ``path`` atomically.

    The bytes go to a temporary file next to ``path`` (same file system), which is flushed,
    fsync-ed and renamed over ``path`` with ``os.replace``; the directory is then fsync-ed so
    that the rename itself survives a power cut. On any error the temporary file is removed and
    ``path`` is left as it was; the error is raised as :class:`CheckpointError`.
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp_path = None
    try:
        fd, tmp_path = tempfile.mkstemp(
            dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp"
        )
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
        tmp_path = None
        _fsync_directory(directory)
    except Exception as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise CheckpointError(f"could not save checkpoint {path}: {reason}") from exc
    finally:
        if tmp_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp_path)


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


def load_checkpoint(path: str, run: dict[str, Any]) -> dict[str, Any]:
    """Returns the checkpoint at ``path`` after checking that it was written for ``run``.

    Loads with ``torch.load(weights_only=True)`` onto the CPU. ``run`` holds the settings that
    decide the shape of the state (model, dataset, API, seed); each must equal the
    checkpoint's.

    Raises:
      CheckpointError: the file is missing, unreadable, corrupted, not an ``fp16fx train``
        checkpoint, or written for other settings -- the message says which.
    """
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"checkpoint {path} is corrupted or not a torch checkpoint ({first[:200]})"
        ) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not an fp16fx train checkpoint (no 'format': {FORMAT!r} entry)"
        )
    missing = [key for key in _REQUIRED if key not in ckpt]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {', '.join(missing)}")
    saved_run = ckpt["run"]
    for key, value in run.items():
        if key not in saved_run and key not in _IDENTITY_DEFAULTS:
            continue  # written before the run recorded it (the loss scale): not compared
        saved = saved_run.get(key, _IDENTITY_DEFAULTS.get(key))
        if saved != value:
            flag = f"--{key.replace('_', '-')}"
            if isinstance(value, bool):  # a switch: say how to resume it
                how = "with" if saved else "without"
                raise CheckpointError(
                    f"checkpoint {path} was written {how} {flag}: resume it {how} {flag}"
                )
            raise CheckpointError(
                f"checkpoint {path} was written with {flag} {saved}, this run has {value}"
            )
    return ckpt
