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
import stat
from typing import Any

import torch

from fp16fx.train import outputs

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
    """Returns None when a checkpoint can be written at ``path``; creates nothing.

    Checked before training starts, so that a bad ``--save`` fails in a second, not after the
    first epoch. Raises :class:`CheckpointError` naming the problem.
    """
    reason = outputs.problem(path)
    if reason is not None:
        raise CheckpointError(f"cannot save to {path}: {reason}")


def save_atomic(obj: Any, path: str) -> None:
    """Writes ``obj`` with ``torch.save`` to ``path`` atomically.

    The bytes go to a temporary file next to ``path`` (same file system), which is flushed,
    fsync-ed and renamed over ``path`` with ``os.replace``; the directory is then fsync-ed so
    that the rename itself survives a power cut. The file keeps the permissions of the one it
    replaces (a new one: the umask's). The directory is created if it does not exist. On any
    error the temporary file is removed and ``path`` is left as it was; the error is raised as
    :class:`CheckpointError`.
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp_path = None
    try:
        outputs.make_parent(path)
        name = outputs.temporary_name(path)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # minus the umask
        tmp_path = name
        with os.fdopen(fd, "wb") as f:
            if os.path.isfile(path):
                os.fchmod(f.fileno(), stat.S_IMODE(os.stat(path).st_mode))
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
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} is a directory, not a file")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from None
    except Exception as exc:
        if "Unsupported global" in str(exc):  # torch's advice (weights_only=False) is unsafe
            raise CheckpointError(
                f"{path} is not an fp16fx train checkpoint: it holds Python objects other than "
                "tensors and primitives, which fp16fx does not load (weights_only=True)"
            ) from None
        # torch's reader says what is wrong with a torch file (a truncated archive); the
        # unpickler's errors on other bytes ("105", "pop from empty list") say nothing, and
        # its weights_only messages advise an unsafe load.
        first = str(exc).strip().splitlines()[0] if isinstance(exc, RuntimeError) else ""
        detail = f" ({first[:200]})" if first and "weights_only" not in first else ""
        raise CheckpointError(
            f"checkpoint {path} is corrupted or not a torch checkpoint{detail}"
        ) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not an fp16fx train checkpoint (no 'format': {FORMAT!r} entry)"
        )
    missing = [key for key in _REQUIRED if key not in ckpt]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {', '.join(missing)}")
    epoch = ckpt["epoch"]
    if not (isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0):
        raise CheckpointError(f"checkpoint {path} is malformed: its 'epoch' is {epoch!r}")
    for key in ("run", "stepper", "rng", "history"):
        if not isinstance(ckpt[key], dict):
            got = type(ckpt[key]).__name__
            raise CheckpointError(
                f"checkpoint {path} is malformed: its {key!r} is not a dict ({got})"
            )
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
