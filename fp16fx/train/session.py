"""One ``fp16fx train`` session: settings in, trained runs out.

:func:`train` loads the data, builds the FP16 model and its stepper, resumes from a checkpoint
if asked, trains (saving a checkpoint after every epoch), and with ``compare_fp32`` trains the
same model from the same initial weights and batches in FP32 for comparison. The command line
(:mod:`fp16fx.train.command`) is a thin layer over it; tests and notebooks call it directly.

Called in each of several processes with ``torch.distributed`` initialized, it trains one model
data-parallel: ``batch_size`` is per process (a step's global batch is ``batch_size`` times the
number of processes), every process resumes from the checkpoint, and only rank 0 saves it and
shows progress bars. (With ``fsdp`` every process takes part in saving: it gathers its shards
for rank 0 to write, :mod:`fp16fx.train.fsdp`.)
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch

from fp16fx.precision import MASTERS, MOMENTS
from fp16fx.train import checkpoint, outputs
from fp16fx.train.data import DATASETS, DataError, ImageBatches, TrainTestData, load_dataset
from fp16fx.train.fsdp import FSDPStepper
from fp16fx.train.loop import History, fit
from fp16fx.train.models import MODELS, ModelError, build_model, to_half
from fp16fx.train.parallel import Processes
from fp16fx.train.report import PlotError, RunSummary, check_plotting
from fp16fx.train.steppers import (
    DEFAULT_PRECISION,
    LossScale,
    Stepper,
    TorchStepper,
    make_stepper,
)
from fp16fx.transforms import check_hyperparam

__all__ = [
    "SetupError",
    "TrainConfig",
    "TrainResult",
    "check_processes",
    "preflight",
    "resolve_device",
    "train",
]

logger = logging.getLogger("fp16fx")


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
            "batch_size": _batch_size(self),
            "lr": _lr(self),
            "lr_schedule": self.lr_schedule,
            "limit": self.limit,
        }

    def precision(self) -> dict[str, str | None]:
        """Returns the precision flags, recorded in a checkpoint beside :meth:`identity` (once
        :func:`train` has decided those left None)."""
        return {"master": self.master, "moments": self.moments}


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


def preflight(config: TrainConfig, processes: int = 1) -> None:
    """Returns None when ``config``'s names, device, files and batch size (over ``processes``
    processes) pass the checks :func:`train` makes first; raises what it would. Lets a
    launcher fail in one line before starting any process."""
    _check(config)
    resolve_device(config.device)
    _resumed(config)
    data = _limited(load_dataset(config.dataset, config.data_dir), config.limit)
    _check_batch(config, len(data.train), processes)


def _check_batch(config: TrainConfig, images: int, processes: int) -> None:
    """Raises SetupError where the global batch exceeds the ``images`` of the training split."""
    batch_size = _batch_size(config)
    if batch_size * processes > images:
        default = " (the default)" if config.batch_size is None else ""
        per_process = f" x {processes} processes" if processes > 1 else ""
        limited = f" (--limit {config.limit})" if config.limit is not None else ""
        raise SetupError(
            f"--batch-size {batch_size}{default}{per_process} exceeds the {images} "
            f"training images{limited}"
        )


def _resumed(config: TrainConfig) -> dict[str, Any] | None:
    """Returns the checkpoint ``--resume`` names (None without one), checked against the run:
    its settings, and that ``--epochs`` leaves epochs to train."""
    if config.resume is None:
        return None
    ckpt = checkpoint.load_checkpoint(config.resume, config.identity())
    if ckpt["epoch"] >= _epochs(config):
        raise SetupError(
            f"checkpoint {config.resume} has {ckpt['epoch']} epochs done: --epochs "
            f"{_epochs(config)} leaves none to train (give more)"
        )
    return ckpt


def _with_precision(config: TrainConfig, ckpt: dict[str, Any] | None) -> TrainConfig:
    """Returns ``config`` with its ``master`` and ``moments`` decided: each one given stays (a
    resumed checkpoint's state is converted to it); one left None is the resumed checkpoint's,
    or FP32 in a new run. (A resumed run once became FP32 unless the flags were repeated.)"""
    saved = checkpoint.saved_precision(ckpt) if ckpt is not None else DEFAULT_PRECISION
    given = config.precision()
    return dataclasses.replace(
        config, **{key: saved[key] if given[key] is None else given[key] for key in saved}
    )


def _limited(data: TrainTestData, limit: int | None) -> TrainTestData:
    if limit is None:
        return data
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


def _fp16_stepper(
    config: TrainConfig, data: TrainTestData, device: torch.device, distributed: bool
) -> Stepper:
    model = build_model(config.model, data.in_channels, data.num_classes).to(device)
    compile_step = device.type == "cuda" if config.compile is None else config.compile
    precision = {"master": config.master, "moments": config.moments}
    if config.fsdp:  # FSDP2 shards the FP32 model, or the FP16 one it makes
        return FSDPStepper(model, _lr(config), config.loss_scale, compile_step, **precision)
    return make_stepper(
        config.api,
        to_half(model),
        lr=_lr(config),
        loss_scale=config.loss_scale,
        compile=compile_step,
        distributed=distributed,
        **precision,
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
    if config.data_dir is not None and not DATASETS[config.dataset].local_copy:
        raise SetupError(
            f"--data-dir is where a local copy of cifar10 lives; --dataset {config.dataset} "
            "reads none (drop --data-dir, or add --dataset cifar10)"
        )
    for name in ("epochs", "batch_size", "limit"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise SetupError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    batch_size, fewest = _batch_size(config), MODELS[config.model].min_batch
    if batch_size < fewest:
        raise SetupError(
            f"--batch-size {batch_size} is too small for --model {config.model}: its "
            f"BatchNorm layers need at least {fewest} images per process"
        )
    if config.master is not None and config.master not in MASTERS:
        raise SetupError(f"unknown master {config.master!r} (choose from: {', '.join(MASTERS)})")
    if config.moments is not None and config.moments not in MOMENTS:
        raise SetupError(f"unknown moments {config.moments!r} (choose from: {', '.join(MOMENTS)})")
    if config.lr is not None and not (math.isfinite(config.lr) and config.lr > 0):
        raise SetupError(f"--lr must be a finite number > 0, got {config.lr}")
    if config.lr is not None:
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
        checkpoint.check_new(config.save, config.resume, config.identity(), _epochs(config))


def _check_outputs(config: TrainConfig) -> None:
    """Checks that ``--plot`` and ``--save`` can be written, by doing what writing them will
    (their directories are made): last, once the data, the model and the checkpoint's state
    are loaded, so that a run refused for anything else leaves nothing behind. Every process
    checks, so that all fail alike (rank 0 alone writes)."""
    if config.plot is not None:
        reason = outputs.problem(config.plot)
        if reason is not None:
            raise PlotError(f"cannot write the plot {config.plot}: {reason}")
    if config.save is not None:
        checkpoint.check_writable(config.save)


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
    processes: Processes,
    *,
    resume_from: dict[str, Any] | None = None,
    save_to: str | None = None,
    announce: tuple[str, ...] = (),
    name: str = "",
    check_outputs: bool = False,
) -> History:
    """Returns the history of training ``stepper``, resumed from and saved to checkpoints.

    ``announce`` are log lines written once the run is set up (after any error in resuming);
    ``check_outputs``: check ``--save`` and ``--plot`` then (:func:`_check_outputs`).
    """
    generator = torch.Generator().manual_seed(config.seed)
    batch_size = _batch_size(config)
    train_batches = ImageBatches(data.train, data, batch_size, device, generator, processes)
    test_batches = ImageBatches(data.test, data, batch_size, device, processes=processes)
    history = History()
    if resume_from is not None:
        history = _resume(stepper, resume_from, generator, device)
    if check_outputs:
        _check_outputs(config)
    for line in announce:
        logger.info("%s", line)
    if resume_from is not None:
        logger.info("resumed from %s after epoch %d", config.resume, len(history.epochs))
        saved = checkpoint.saved_precision(resume_from)
        if saved != config.precision():
            logger.info(
                "converted its optimizer state from --masters %s --moments %s to --masters %s "
                "--moments %s (decoded exactly into FP32, rounded to nearest into a shorter "
                "format: docs/precision.md)",
                saved["master"], saved["moments"], config.master, config.moments,
            )  # fmt: skip

    def save(epochs_done: int, history: History) -> None:
        if save_to is None or not (processes.is_main or stepper.collective_state_dict):
            return
        state = stepper.state_dict()  # under FSDP2 a collective: every process gathers
        if not processes.is_main:  # rank 0 alone writes
            return
        checkpoint.save_atomic(
            {
                "format": checkpoint.FORMAT,
                "run": {**config.identity(), **config.precision()},
                "epoch": epochs_done,
                "stepper": state,
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
        progress=config.progress and processes.is_main,
        on_epoch_end=save,
        name=name,
    )


def train(config: TrainConfig) -> TrainResult:
    """Returns the results of the session ``config`` after training (and comparing).

    Every check that can fail on the user's input (names, paths, data, checkpoint) runs before
    the first step. Under an initialized ``torch.distributed`` this is one of several processes
    training together (see the module's docstring); every process returns the same losses
    and accuracies.

    Raises:
      SetupError, DataError, ModelError, CheckpointError, PlotError, StateMismatchError: bad
        settings or files, each with a one-line message naming the problem.
    """
    _check(config)
    device = resolve_device(config.device)
    processes = Processes.current()
    ckpt = _resumed(config)
    config = _with_precision(config, ckpt)
    data = _limited(load_dataset(config.dataset, config.data_dir), config.limit)
    epochs, batch_size, lr = _epochs(config), _batch_size(config), _lr(config)
    _check_batch(config, len(data.train), processes.size)
    global_batch = batch_size * processes.size
    distributed = processes.size > 1
    if config.fsdp and not distributed:
        raise SetupError("--fsdp shards the model over processes: add --nproc-per-node N (N > 1)")
    torch.manual_seed(config.seed)
    stepper = _fp16_stepper(config, data, device, distributed)
    per_process = f" ({processes.size} processes x {batch_size})" if distributed else ""
    # A resumed run's earlier epochs were another session's (another process count, maybe)
    per_process += "" if ckpt is None else f" from epoch {ckpt['epoch'] + 1}"
    title = (
        f"fp16fx train: {config.model} on {config.dataset} "
        f"({len(data.train):,} train / {len(data.test):,} test images), {device.type}, "
        f"{epochs} epoch{'' if epochs == 1 else 's'} of {len(data.train) // global_batch} steps "
        f"x {global_batch}{per_process}, "
        f"lr {lr:g} ({config.lr_schedule}), seed {config.seed}"
    )
    history = _run(
        stepper,
        data,
        config,
        device,
        processes,
        resume_from=ckpt,
        save_to=config.save,
        announce=(title, f"FP16: {stepper.label}"),
        name="FP16" if config.compare_fp32 else "",
        check_outputs=True,
    )
    runs = [_summary("FP16", stepper, history, processes)]
    if config.compare_fp32:
        torch.manual_seed(config.seed)  # the same initial weights as the FP16 run
        model = build_model(config.model, data.in_channels, data.num_classes).to(device)
        baseline = TorchStepper(model, lr=lr, distributed=distributed)
        history = _run(
            baseline,
            data,
            config,
            device,
            processes,
            announce=(f"FP32: {baseline.label}",),
            name="FP32",
        )
        runs.append(_summary("FP32", baseline, history, processes))
    return TrainResult(title, runs)


def _summary(name: str, stepper: Stepper, history: History, processes: Processes) -> RunSummary:
    """Returns the run's summary, with whether every process ended with rank 0's replicated
    state (:meth:`Stepper.replicated`)."""
    in_sync = processes.replicas_equal(stepper.replicated())
    if not in_sync:
        logger.warning("%s: the processes' replicated state differs at the end of the run", name)
    return RunSummary(name, stepper.label, history, processes.size, in_sync)
