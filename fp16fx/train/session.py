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
from typing import Any

import torch

from fp16fx.train import checkpoint, outputs
from fp16fx.train.config import SetupError, TrainConfig, check_batch, check_config, resolve_device
from fp16fx.train.data import ImageBatches, TrainTestData, load_dataset
from fp16fx.train.fsdp import FSDPStepper
from fp16fx.train.loop import History, fit
from fp16fx.train.models import build_model, to_half
from fp16fx.train.parallel import Processes
from fp16fx.train.report import PlotError, RunSummary
from fp16fx.train.steppers import DEFAULT_PRECISION, Stepper, TorchStepper, make_stepper

__all__ = ["TrainResult", "preflight", "train"]

logger = logging.getLogger("fp16fx")


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """A finished session: its runs (FP16 first, then FP32 if compared) and a one-line title."""

    title: str
    runs: list[RunSummary]


def preflight(config: TrainConfig, processes: int = 1) -> None:
    """Returns None when ``config``'s names, device, files and batch size (over ``processes``
    processes) pass the checks :func:`train` makes first; raises what it would. Lets a
    launcher fail in one line before starting any process."""
    check_config(config)
    resolve_device(config.device)
    _resumed(config)
    data = _limited(load_dataset(config.dataset, config.data_dir), config.limit)
    check_batch(config, len(data.train), processes)


def _resumed(config: TrainConfig) -> dict[str, Any] | None:
    """Returns the checkpoint ``--resume`` names (None without one), checked against the run:
    its settings, and that ``--epochs`` leaves epochs to train."""
    if config.resume is None:
        return None
    ckpt = checkpoint.load_checkpoint(config.resume, config.identity())
    if ckpt["epoch"] >= config.epochs_or_default():
        raise SetupError(
            f"checkpoint {config.resume} has {ckpt['epoch']} epochs done: --epochs "
            f"{config.epochs_or_default()} leaves none to train (give more)"
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
    lr, precision = config.lr_or_default(), {"master": config.master, "moments": config.moments}
    if config.fsdp:  # FSDP2 shards the FP32 model, or the FP16 one it makes
        return FSDPStepper(model, lr, config.loss_scale, compile_step, **precision)
    return make_stepper(
        config.api,
        to_half(model),
        lr=lr,
        loss_scale=config.loss_scale,
        compile=compile_step,
        distributed=distributed,
        **precision,
    )


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
    batch_size = config.batch_size_or_default()
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
        epochs=config.epochs_or_default(),
        lr=config.lr_or_default(),
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
    check_config(config)
    device = resolve_device(config.device)
    processes = Processes.current()
    ckpt = _resumed(config)
    config = _with_precision(config, ckpt)
    data = _limited(load_dataset(config.dataset, config.data_dir), config.limit)
    epochs, batch_size = config.epochs_or_default(), config.batch_size_or_default()
    lr = config.lr_or_default()
    check_batch(config, len(data.train), processes.size)
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
