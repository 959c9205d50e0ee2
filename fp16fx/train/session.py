"""One ``fp16fx train`` session: settings in, trained runs out.

:func:`train` loads the data, builds the FP16 model and its stepper, resumes from a checkpoint
if asked, trains (saving a checkpoint after every epoch), and with ``compare_fp32`` trains the
same model from the same initial weights and batches in FP32 for comparison. The command line
(:mod:`fp16fx.train.command`) is a thin layer over it; tests and notebooks call it directly.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from fp16fx.train import checkpoint
from fp16fx.train.data import DATASETS, DataError, ImageBatches, TrainTestData, load_dataset
from fp16fx.train.loop import History, fit
from fp16fx.train.models import MODELS, ModelError, build_model, to_half
from fp16fx.train.report import RunSummary, check_plotting
from fp16fx.train.steppers import LossScale, Stepper, TorchStepper, make_stepper

__all__ = ["SetupError", "TrainConfig", "TrainResult", "resolve_device", "train"]

logger = logging.getLogger("fp16fx")


class SetupError(ValueError):
    """The settings cannot work (e.g. CUDA asked for but absent); the message says why."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The settings of one session; ``None`` means "the data set's default" (see DATASETS).

    Attributes mirror the ``fp16fx train`` flags: ``model``, ``dataset``, ``data_dir``,
    ``api`` (``"facade"`` or ``"functional"``), ``device`` (None: CUDA when available),
    ``epochs``, ``batch_size``, ``lr``, ``lr_schedule``, ``seed``, ``loss_scale``
    (``"dynamic"`` or a number), ``compile`` (the facade's compiled path or ``compile_step``;
    None: on CUDA only), ``limit`` (use only the first N train and test images),
    ``compare_fp32``, ``save`` and ``resume`` (checkpoint paths), ``progress`` (tqdm bars) and
    ``plot``.
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
    compile: bool | None = None
    limit: int | None = None
    compare_fp32: bool = False
    save: str | None = None
    resume: str | None = None
    progress: bool = False
    plot: str | None = None

    def identity(self) -> dict[str, Any]:
        """Returns the settings a checkpoint must share with this session to be resumed."""
        return {"model": self.model, "dataset": self.dataset, "api": self.api}


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """A finished session: its runs (FP16 first, then FP32 if compared) and a one-line title."""

    title: str
    runs: list[RunSummary]


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


def _limited(data: TrainTestData, limit: int | None) -> TrainTestData:
    if limit is None:
        return data
    if limit < 1:
        raise SetupError(f"--limit must be >= 1, got {limit}")
    return dataclasses.replace(data, train=data.train.head(limit), test=data.test.head(limit))


def _rng_state(generator: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state(), "data": generator.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _restore_rng(state: dict[str, Any], generator: torch.Generator, device: torch.device) -> None:
    try:
        torch.set_rng_state(state["torch"])
        generator.set_state(state["data"])
        if device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], device)
    except (KeyError, TypeError, RuntimeError) as exc:
        raise checkpoint.CheckpointError(
            f"the checkpoint's RNG states are unusable: {exc}"
        ) from None


def _fp16_stepper(config: TrainConfig, data: TrainTestData, device: torch.device) -> Stepper:
    model = to_half(build_model(config.model, data.in_channels, data.num_classes)).to(device)
    compile_step = device.type == "cuda" if config.compile is None else config.compile
    return make_stepper(
        config.api, model, lr=_lr(config), loss_scale=config.loss_scale, compile=compile_step
    )


def _epochs(config: TrainConfig) -> int:
    return DATASETS[config.dataset].epochs if config.epochs is None else config.epochs


def _batch_size(config: TrainConfig) -> int:
    return DATASETS[config.dataset].batch_size if config.batch_size is None else config.batch_size


def _lr(config: TrainConfig) -> float:
    return DATASETS[config.dataset].lr if config.lr is None else config.lr


def _check(config: TrainConfig) -> None:
    if config.model not in MODELS:
        raise ModelError(f"unknown model {config.model!r} (choose from: {', '.join(MODELS)})")
    if config.dataset not in DATASETS:
        raise DataError(f"unknown dataset {config.dataset!r} (choose from: {', '.join(DATASETS)})")
    for name in ("epochs", "batch_size"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise SetupError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if config.lr is not None and not config.lr > 0:
        raise SetupError(f"--lr must be > 0, got {config.lr}")
    if config.save is not None:
        checkpoint.check_writable(config.save)
    if config.plot is not None:
        check_plotting(config.plot)


def _resume(
    stepper: Stepper, ckpt: dict[str, Any], generator: torch.Generator, device: torch.device
) -> History:
    """Returns the checkpoint's history after loading its state into ``stepper`` and RNGs."""
    try:
        stepper.load_state_dict(ckpt["stepper"])
        history = History.from_dict(ckpt["history"])
    except (ValueError, KeyError, TypeError) as exc:
        raise checkpoint.CheckpointError(f"the checkpoint does not fit this run: {exc}") from None
    _restore_rng(ckpt["rng"], generator, device)
    return history


def _run(
    stepper: Stepper,
    data: TrainTestData,
    config: TrainConfig,
    device: torch.device,
    *,
    resume_from: dict[str, Any] | None = None,
    save_to: str | None = None,
    announce: tuple[str, ...] = (),
    name: str = "",
) -> History:
    """Returns the history of training ``stepper``, resumed from and saved to checkpoints.

    ``announce`` are log lines written once the run is set up (after any error in resuming).
    """
    generator = torch.Generator().manual_seed(config.seed)
    batch_size = _batch_size(config)
    train_batches = ImageBatches(data.train, data, batch_size, device, generator)
    test_batches = ImageBatches(data.test, data, batch_size, device)
    history = History()
    if resume_from is not None:
        history = _resume(stepper, resume_from, generator, device)
    for line in announce:
        logger.info("%s", line)
    if resume_from is not None:
        logger.info("resumed from %s after epoch %d", config.resume, len(history.epochs))

    def save(epochs_done: int, history: History) -> None:
        if save_to is None:
            return
        checkpoint.save_atomic(
            {
                "format": checkpoint.FORMAT,
                "run": config.identity(),
                "epoch": epochs_done,
                "stepper": stepper.state_dict(),
                "rng": _rng_state(generator, device),
                "history": history.to_dict(),
            },
            save_to,
        )
        logger.debug("saved checkpoint %s (epoch %d)", save_to, epochs_done)

    return fit(
        stepper,
        train_batches,
        test_batches,
        epochs=_epochs(config),
        lr=_lr(config),
        schedule=config.lr_schedule,
        history=history,
        progress=config.progress,
        on_epoch_end=save,
        name=name,
    )


def train(config: TrainConfig) -> TrainResult:
    """Returns the results of the session ``config`` after training (and comparing).

    Every check that can fail on the user's input (names, paths, data, checkpoint) runs before
    the first step.

    Raises:
      SetupError, DataError, ModelError, CheckpointError, PlotError, StateMismatchError: bad
        settings or files, each with a one-line message naming the problem.
    """
    _check(config)
    device = resolve_device(config.device)
    ckpt = None
    if config.resume is not None:
        ckpt = checkpoint.load_checkpoint(config.resume, config.identity())
    data = _limited(load_dataset(config.dataset, config.data_dir), config.limit)
    epochs, batch_size, lr = _epochs(config), _batch_size(config), _lr(config)
    if batch_size > len(data.train):
        raise SetupError(f"--batch-size {batch_size} exceeds the {len(data.train)} training images")
    torch.manual_seed(config.seed)
    stepper = _fp16_stepper(config, data, device)
    title = (
        f"fp16fx train: {config.model} on {config.dataset} "
        f"({len(data.train):,} train / {len(data.test):,} test images), {device.type}, "
        f"{epochs} epoch{'' if epochs == 1 else 's'} of {len(data.train) // batch_size} steps "
        f"x {batch_size}, "
        f"lr {lr:g} ({config.lr_schedule}), seed {config.seed}"
    )
    history = _run(
        stepper,
        data,
        config,
        device,
        resume_from=ckpt,
        save_to=config.save,
        announce=(title, f"FP16: {stepper.label}"),
        name="FP16" if config.compare_fp32 else "",
    )
    runs = [RunSummary("FP16", stepper.label, history)]
    if config.compare_fp32:
        torch.manual_seed(config.seed)  # the same initial weights as the FP16 run
        model = build_model(config.model, data.in_channels, data.num_classes).to(device)
        baseline = TorchStepper(model, lr=lr)
        history = _run(
            baseline, data, config, device, announce=(f"FP32: {baseline.label}",), name="FP32"
        )
        runs.append(RunSummary("FP32", baseline.label, history))
    return TrainResult(title, runs)
