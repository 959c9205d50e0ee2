"""Checkpoints of ``fp16fx train``: atomic writes, safe loads, and a check that they fit.

A checkpoint is one ``torch.save`` file holding only tensors and Python primitives, so it is
read with ``torch.load(weights_only=True)`` (no pickled code runs)::

    {
        "format": "fp16fx.train/2",
        "run": {"model": ..., "dataset": ..., "api": ..., "seed": ...,  # must match
                "fsdp": ..., "loss_scale": ..., "batch_size": ..., "lr": ...,
                "lr_schedule": ..., "limit": ...,
                "master": ..., "moments": ...},                # may differ
        "epoch": 3,                                  # epochs completed
        "stepper": {"model": ..., "optimizer": ...}, # Stepper.state_dict()
        "rng": {"torch": ByteTensor, "data": ByteTensor[, "cuda": ByteTensor]},
        "history": {...},                            # loop.History.to_dict()
    }

:func:`save_atomic` writes it atomically (:func:`fp16fx.train.outputs.write_atomic`): a crash
or error at any point leaves either the old checkpoint or the new one, never a torn file.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from typing import Any

import torch

from fp16fx.precision import MASTERS, MOMENTS
from fp16fx.train import outputs
from fp16fx.train.steppers import DEFAULT_PRECISION

__all__ = [
    "FORMAT",
    "CheckpointError",
    "check_new",
    "check_writable",
    "load_checkpoint",
    "save_atomic",
    "saved_precision",
]

FORMAT = "fp16fx.train/2"
#: The entries that are dicts, and all a checkpoint must hold.
_DICTS = ("run", "stepper", "rng", "history")
_REQUIRED = ("format", "epoch", *_DICTS)

#: The settings of checkpoints written before their ``run`` recorded them.
_IDENTITY_DEFAULTS = {"fsdp": False}

#: The values a checkpoint's recorded precision may take, per flag.
_PRECISION_NAMES = {"master": MASTERS, "moments": MOMENTS}


def saved_precision(ckpt: dict[str, Any]) -> dict[str, str]:
    """Returns the ``master`` and ``moments`` a checked checkpoint was written with
    (:data:`~fp16fx.train.steppers.DEFAULT_PRECISION` for one written before its ``run``
    recorded them). Raises :class:`CheckpointError` where the
    checkpoint records one that does not exist."""
    saved = {key: ckpt["run"].get(key, value) for key, value in DEFAULT_PRECISION.items()}
    for key, value in saved.items():
        if value not in _PRECISION_NAMES[key]:
            raise CheckpointError(f"the checkpoint is malformed: its run's {key} is {value!r}")
    return saved


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read, or does not fit this run; the message says why."""


def check_writable(path: str) -> None:
    """Returns None when a checkpoint can be written at ``path`` (its directory is made).

    Checked before training starts, so that a bad ``--save`` fails in a second, not after the
    first epoch (:func:`fp16fx.train.outputs.problem`). Raises :class:`CheckpointError`
    naming the problem.
    """
    reason = outputs.problem(path)
    if reason is not None:
        raise CheckpointError(f"cannot save to {path}: {reason}")


def check_new(path: str, resume: str | None, run: dict[str, Any], epochs: int) -> None:
    """Returns None when a checkpoint saved to ``path`` replaces nothing: no file, an empty
    one, or ``resume``, the checkpoint the run continues (also named otherwise).

    Anything else at ``path`` -- a checkpoint of another run, of this one, a file that is no
    checkpoint -- would be lost at the first save, so it is refused before training starts
    (what is not a regular file is left to :func:`check_writable`). Raises
    :class:`CheckpointError` naming the file, what it holds and what to do: ``--resume`` only
    where resuming this run (``run``: its settings, ``epochs`` its length) would work.
    """
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    if resume is not None and outputs.same_file(path, resume):
        return
    instead = "remove it, or choose another --save path"
    try:
        ckpt = _read(path)
    except CheckpointError as exc:
        raise CheckpointError(
            f"--save {path} exists and is no checkpoint this run can replace ({exc}): {instead}"
        ) from None
    epoch = ckpt["epoch"]
    try:
        _check_run(path, ckpt, run)
    except CheckpointError as exc:
        raise CheckpointError(
            f"--save {path} holds a checkpoint of another run ({exc}), which this run would "
            f"replace: {instead}"
        ) from None
    if epoch >= epochs:
        advice = f"pass --resume {path} with more than --epochs {epoch} to train it further"
    else:
        advice = f"pass --resume {path} to continue it"
    raise CheckpointError(
        f"--save {path} holds this run's checkpoint at epoch {epoch}, which this run would "
        f"replace: {advice}, or {instead}"
    )


def save_atomic(obj: Any, path: str) -> None:
    """Writes ``obj`` with ``torch.save`` to ``path`` atomically
    (:func:`fp16fx.train.outputs.write_atomic`): a crash or error at any point leaves either
    the old checkpoint or the new one. Raises :class:`CheckpointError` on any error, ``path``
    left as it was."""
    try:
        outputs.write_atomic(path, lambda f: torch.save(obj, f))
    except Exception as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise CheckpointError(f"could not save checkpoint {path}: {reason}") from exc


def _names_an_object(refusal: str) -> bool:
    """Whether a weights-only load was refused for a Python object that exists: the global
    torch names is in a module already imported (a truncated file names a cut-off one, and a
    name in a checkpoint is not worth importing a module for)."""
    found = re.search(r"unsupported global:? (?:GLOBAL )?([\w.]+)", refusal, re.IGNORECASE)
    if found is None:
        return False
    module, _, name = found.group(1).rpartition(".")
    return hasattr(sys.modules.get(module), name)


def load_checkpoint(path: str, run: dict[str, Any]) -> dict[str, Any]:
    """Returns the checkpoint at ``path`` after checking that it was written for ``run``.

    Loads with ``torch.load(weights_only=True)`` onto the CPU. ``run`` holds the settings that
    decide the state or the run it continues (``TrainConfig.identity``); each must equal the
    checkpoint's, unless the checkpoint was written before it recorded that setting (then it
    is not compared; ``fsdp`` is then compared with False).

    Raises:
      CheckpointError: the file is missing, unreadable, corrupted, not an ``fp16fx train``
        checkpoint, or written for other settings -- the message says which.
    """
    ckpt = _read(path)
    _check_run(path, ckpt, run)
    return ckpt


def _read(path: str) -> dict[str, Any]:
    """Returns the ``fp16fx train`` checkpoint at ``path``, its entries' kinds checked (not
    the run it was written for: :func:`_check_run`)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a pipe would block the read forever
            raise CheckpointError(f"checkpoint {path} is not a regular file")
        file = open(path, "rb")  # noqa: SIM115 (closed below; its errors are not torch's)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from None
    try:
        with file:
            ckpt = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:
        if _names_an_object(str(exc)):  # not torch's advice (weights_only=False): unsafe
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
    for key in _DICTS:
        if not isinstance(ckpt[key], dict):
            got = type(ckpt[key]).__name__
            raise CheckpointError(
                f"checkpoint {path} is malformed: its {key!r} is not a dict ({got})"
            )
    fault = _history_fault(ckpt["history"], epoch)
    if fault is not None:
        raise CheckpointError(f"checkpoint {path} is malformed: {fault}")
    return ckpt


def _history_fault(history: dict[str, Any], epoch: int) -> str | None:
    """Returns why ``history`` (``loop.History.to_dict()``'s form) cannot be the one of a run
    after ``epoch`` epochs, or None: the loop resumes after its last epoch, the run's count
    after ``epoch``, and the two must agree, as must its per-step lists with its epochs'
    steps."""
    epochs = history.get("epochs")
    if not isinstance(epochs, list) or len(epochs) != epoch:
        held = f"{len(epochs)} epoch(s)" if isinstance(epochs, list) else "no list of epochs"
        return f"its 'history' holds {held}, its 'epoch' says {epoch}"
    per_step = {key: history.get(key) for key in ("step_loss", "step_loss_scale", "step_skipped")}
    steps = [e.get("steps") if isinstance(e, dict) else None for e in epochs]
    if not all(isinstance(s, int) for s in steps):
        return "an epoch of its 'history' has no step count"
    for key, values in per_step.items():
        if not isinstance(values, list) or len(values) != sum(steps):
            held = f"{len(values)} values" if isinstance(values, list) else "no list"
            return f"its history's {key!r} holds {held}, its epochs {sum(steps)} steps"
    return None


def _check_run(path: str, ckpt: dict[str, Any], run: dict[str, Any]) -> None:
    """Raises :class:`CheckpointError` naming every setting in which checkpoint ``ckpt`` (read
    from ``path``) differs from ``run``'s (see :func:`load_checkpoint`)."""
    saved_run = ckpt["run"]
    differences = []
    for key, value in run.items():
        if key not in saved_run and key not in _IDENTITY_DEFAULTS:
            continue  # written before the run recorded it (loss scale, batches): not compared
        saved = saved_run.get(key, _IDENTITY_DEFAULTS.get(key))
        if saved == value:
            continue
        flag = f"--{key.replace('_', '-')}"
        if isinstance(value, bool):  # a switch: say how to resume it
            how = "with" if saved else "without"
            differences.append(f"{how} {flag}: resume it {how} {flag}")
        elif saved is None or value is None:  # an option given on one side only
            how = f"without {flag}" if saved is None else f"with {flag} {saved}"
            differences.append(f"{how}: resume it {how}")
        else:
            differences.append(f"with {flag} {saved}, this run has {value}")
    if differences:
        raise CheckpointError(f"checkpoint {path} was written {'; '.join(differences)}")
