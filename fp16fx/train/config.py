"""The settings of one ``fp16fx train`` session, and the checks they pass before anything loads.

:class:`TrainConfig` mirrors the command's flags (None: the data set's default, filled in by its
``*_or_default`` methods). :func:`check_config`, :func:`resolve_device` and
:func:`check_processes` refuse settings that cannot work from the settings alone (and the files
they name); :func:`check_batch` once the size of the training split is known.
:mod:`fp16fx.train.session` runs them before it loads the data.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from fp16fx.cli import seed_fault
from fp16fx.precision import MASTERS, MOMENTS
from fp16fx.scaling import check_scale
from fp16fx.train import checkpoint, outputs
from fp16fx.train.data import DATASETS, DataError
from fp16fx.train.loop import SCHEDULES
from fp16fx.train.models import MODELS, ModelError
from fp16fx.train.report import check_plotting
from fp16fx.train.steppers import APIS, LossScale
from fp16fx.transforms import check_hyperparam

__all__ = [
    "SetupError",
    "TrainConfig",
    "check_batch",
    "check_config",
    "check_processes",
    "resolve_device",
]


class SetupError(ValueError):
    """The settings cannot work (e.g. CUDA asked for but absent); the message says why."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The settings of one session; ``None`` means "the data set's default" (see DATASETS).

    Attributes mirror the ``fp16fx train`` flags: ``model``, ``dataset``, ``data_dir``,
    ``api`` (``"facade"`` or ``"functional"``), ``device`` (None: CUDA when available),
    ``epochs``, ``batch_size``, ``lr``, ``lr_schedule``, ``seed``, ``loss_scale``
    (``"dynamic"`` or a number), ``master`` and ``moments`` (the optimizer state's precision,
    docs/precision.md; None: ``"fp32"`` in a new run, the checkpoint's in a resumed one, which
    a value given converts), ``compile`` (the facade's compiled path or ``compile_step``; None: on
    CUDA only), ``limit`` (use only the first N train and test images), ``compare_fp32``,
    ``save`` and ``resume`` (checkpoint paths), ``progress`` (tqdm bars), ``plot`` and ``fsdp``
    (shard the FP32 model with FSDP2; several processes, facade only).
    """

    model: str = "cnn"
    dataset: str = "digits"
    data_dir: str | None = None
    api: str = "facade"
    device: str | None = None
    epochs: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    lr_schedule: str = "cosine"
    seed: int = 0
    loss_scale: LossScale = "dynamic"
    master: str | None = None
    moments: str | None = None
    compile: bool | None = None
    limit: int | None = None
    compare_fp32: bool = False
    save: str | None = None
    resume: str | None = None
    progress: bool = False
    plot: str | None = None
    fsdp: bool = False

    def identity(self) -> dict[str, Any]:
        """Returns the settings a checkpoint must share with this session to be resumed.

        The seed is one: a resumed run continues the checkpoint's random streams (batch order,
        augmentation), so a different ``--seed`` would be printed but not used; ``fsdp`` is one,
        since the optimizer's state dict has another form under FSDP2. The precision (``master``,
        ``moments``) is not: a checkpoint resumes in its own (those left None) or in another one
        given, its optimizer state converted (docs/precision.md, "Checkpoints"), under FSDP2 too,
        where the masters decide the model's dtype (FP32 shards are their own masters, compensated
        ones FP16). Nor is the number of processes. The loss scale is one: the checkpoint's
        loss-scale state continues, so another ``--loss-scale`` would be printed but not used. So
        are the batch size (per process), the learning rate and its schedule, and ``--limit``: with
        others the resumed run would quietly differ from the one it continues (its batches, or the
        learning rate of every step). ``--epochs`` may change (the cosine schedule is recomputed
        over the new total), and so may the number of processes, as said (each process then takes
        ``batch_size`` examples a step)."""
        return {
            "model": self.model,
            "dataset": self.dataset,
            "api": self.api,
            "seed": self.seed,
            "fsdp": self.fsdp,
            "loss_scale": self.loss_scale,
            "batch_size": self.batch_size_or_default(),
            "lr": self.lr_or_default(),
            "lr_schedule": self.lr_schedule,
            "limit": self.limit,
        }

    def precision(self) -> dict[str, str | None]:
        """Returns the precision flags, recorded in a checkpoint beside :meth:`identity` (once
        :func:`~fp16fx.train.session.train` has decided those left None)."""
        return {"master": self.master, "moments": self.moments}

    def epochs_or_default(self) -> int:
        """Returns ``epochs``, or the data set's default when it is None."""
        return DATASETS[self.dataset].epochs if self.epochs is None else self.epochs

    def batch_size_or_default(self) -> int:
        """Returns ``batch_size`` (per process), or the data set's default when it is None."""
        return DATASETS[self.dataset].batch_size if self.batch_size is None else self.batch_size

    def lr_or_default(self) -> float:
        """Returns ``lr``, or the data set's default when it is None."""
        return DATASETS[self.dataset].lr if self.lr is None else self.lr


def resolve_device(name: str | None) -> torch.device:
    """Returns the torch device for ``--device`` (None: ``cuda`` when available, else ``cpu``)."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise SetupError(f"unknown device {name!r} (use cpu or cuda)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SetupError("--device cuda: CUDA is not available here (use --device cpu)")
    if device.type not in ("cpu", "cuda"):
        raise SetupError(f"unsupported device {name!r} (use cpu or cuda)")
    return device


def check_processes(nproc: int, device: torch.device) -> None:
    """Returns None when ``nproc`` processes per machine can train on ``device``.

    Raises:
      SetupError: fewer than one process, a GPU named by index (each process takes
        ``cuda:LOCAL_RANK``), or more processes than visible GPUs.
    """
    if nproc < 1:
        raise SetupError(f"--nproc-per-node must be >= 1, got {nproc}")
    if device.type != "cuda" or nproc == 1:
        return
    if device.index is not None:
        raise SetupError(
            f"--device {device} names one GPU, but each of the {nproc} processes uses its own "
            "(cuda:LOCAL_RANK): give --device cuda"
        )
    visible = torch.cuda.device_count()
    if nproc > visible:
        raise SetupError(
            f"--nproc-per-node {nproc} needs {nproc} GPUs (one per process), {visible} visible; "
            "use --device cpu for CPU processes"
        )


def check_batch(config: TrainConfig, images: int, processes: int) -> None:
    """Returns None when the global batch (``processes`` times the batch size) fits in the
    ``images`` of the training split; raises SetupError where it exceeds them."""
    batch_size = config.batch_size_or_default()
    if batch_size * processes > images:
        default = " (the default)" if config.batch_size is None else ""
        per_process = f" x {processes} processes" if processes > 1 else ""
        limited = f" (--limit {config.limit})" if config.limit is not None else ""
        raise SetupError(
            f"--batch-size {batch_size}{default}{per_process} exceeds the {images} "
            f"training images{limited}"
        )


def check_config(config: TrainConfig) -> None:
    """Returns None when ``config``'s names, numbers and output paths can work; the checks
    :func:`~fp16fx.train.session.train` makes before it loads anything.

    Raises:
      SetupError, DataError, ModelError, CheckpointError, PlotError: the first setting that
        cannot work, named in a one-line message.
    """
    if config.model not in MODELS:
        raise ModelError(f"unknown model {config.model!r} (choose from: {', '.join(MODELS)})")
    if config.dataset not in DATASETS:
        raise DataError(f"unknown dataset {config.dataset!r} (choose from: {', '.join(DATASETS)})")
    if config.data_dir is not None and not DATASETS[config.dataset].local_copy:
        raise SetupError(
            f"--data-dir is where a local copy of cifar10 lives; --dataset {config.dataset} "
            "reads none (drop --data-dir, or add --dataset cifar10)"
        )
    for name in ("epochs", "batch_size", "limit"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise SetupError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    why = seed_fault(config.seed)
    if why is not None:
        raise SetupError(f"--seed: {why}")
    batch_size, fewest = config.batch_size_or_default(), MODELS[config.model].min_batch
    if batch_size < fewest:
        raise SetupError(
            f"--batch-size {batch_size} is too small for --model {config.model}: its "
            f"BatchNorm layers need at least {fewest} images per process"
        )
    if config.api not in APIS:
        raise SetupError(f"unknown api {config.api!r} (choose from: {', '.join(APIS)})")
    if config.lr_schedule not in SCHEDULES:
        raise SetupError(
            f"unknown lr schedule {config.lr_schedule!r} (choose from: {', '.join(SCHEDULES)})"
        )
    if config.loss_scale != "dynamic":
        try:
            check_scale("a static loss scale", config.loss_scale)
        except ValueError as err:
            raise SetupError(f"--loss-scale: {err}") from None
    if config.master is not None and config.master not in MASTERS:
        raise SetupError(f"unknown master {config.master!r} (choose from: {', '.join(MASTERS)})")
    if config.moments is not None and config.moments not in MOMENTS:
        raise SetupError(f"unknown moments {config.moments!r} (choose from: {', '.join(MOMENTS)})")
    if config.lr is not None:  # > 0 (the optimizer takes 0), and a number FP32 holds
        if not (math.isfinite(config.lr) and config.lr > 0):
            raise SetupError(f"--lr must be a finite number > 0, got {config.lr}")
        if torch.tensor(config.lr, dtype=torch.float32).item() == 0:  # trains nothing, as 0
            raise SetupError(f"--lr {config.lr} rounds to 0 in FP32, where the step computes")
        try:
            check_hyperparam("lr", config.lr)  # the optimizer's own check, before any data
        except ValueError as err:
            raise SetupError(f"--lr {config.lr}: {err}") from None
    if config.fsdp and config.api != "facade":
        raise SetupError("--fsdp trains with FP16_Optimizer: use --api facade")
    if config.plot is not None:
        for flag, other in (("--save", config.save), ("--resume", config.resume)):
            if other is not None and outputs.same_file(config.plot, other):
                raise SetupError(f"--plot and {flag} name the same file, {config.plot}")
        check_plotting(config.plot)
    if config.save is not None:  # a file it would replace: before anything loads
        checkpoint.check_new(
            config.save, config.resume, config.identity(), config.epochs_or_default()
        )
