"""The training loop of ``fp16fx train``: epochs of steps, evaluation, progress and history.

The loop drives a :class:`~fp16fx.train.steppers.Stepper` and knows nothing of FP16, loss
scales or optimizers beyond what a step reports. It keeps each step's report as device tensors
and looks at them on the host only when something is shown (a progress-bar refresh every
:data:`REFRESH_EVERY` steps, the end of an epoch), so on a GPU the steps run ahead of Python.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from fp16fx.train.data import ImageBatches
from fp16fx.train.steppers import StepOutput, Stepper

__all__ = [
    "REFRESH_EVERY",
    "SCHEDULES",
    "EpochRecord",
    "History",
    "evaluate",
    "fit",
    "learning_rate",
]

logger = logging.getLogger("fp16fx")

#: Steps between progress-bar refreshes (each refresh reads a few values from the device).
REFRESH_EVERY = 10

#: The values of ``--lr-schedule``.
SCHEDULES = ("cosine", "constant")


def learning_rate(base: float, schedule: str, step: int, total_steps: int) -> float:
    """Returns the learning rate of global step ``step`` (0-based) out of ``total_steps``.

    ``constant``: ``base``. ``cosine``: ``base * (1 + cos(pi * step / total_steps)) / 2``,
    from ``base`` down towards 0 at the end of the run. Skipped steps count like any other
    (see docs/faq.md), so the schedule depends on the step index alone.
    """
    if schedule == "constant":
        return base
    if schedule == "cosine":
        return base * 0.5 * (1.0 + math.cos(math.pi * step / max(total_steps, 1)))
    raise ValueError(f"unknown lr schedule {schedule!r} (choose from: {', '.join(SCHEDULES)})")


@dataclasses.dataclass
class EpochRecord:
    """One epoch's numbers (host values, for reports, plots and checkpoints)."""

    epoch: int
    loss: float
    test_accuracy: float
    loss_scale: float
    skipped: int
    steps: int
    images: int
    train_seconds: float
    seconds: float


@dataclasses.dataclass
class History:
    """Everything a run measured: per step (loss, loss scale, skipped) and per epoch."""

    step_loss: list[float] = dataclasses.field(default_factory=list)
    step_loss_scale: list[float] = dataclasses.field(default_factory=list)
    step_skipped: list[bool] = dataclasses.field(default_factory=list)
    epochs: list[EpochRecord] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Returns the history as lists and dicts of Python numbers (checkpoint-safe)."""
        return {
            "step_loss": list(self.step_loss),
            "step_loss_scale": list(self.step_loss_scale),
            "step_skipped": list(self.step_skipped),
            "epochs": [dataclasses.asdict(e) for e in self.epochs],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> History:
        """Returns the history saved by :meth:`to_dict`."""
        return cls(
            step_loss=[float(x) for x in data["step_loss"]],
            step_loss_scale=[float(x) for x in data["step_loss_scale"]],
            step_skipped=[bool(x) for x in data["step_skipped"]],
            epochs=[EpochRecord(**e) for e in data["epochs"]],
        )

    @property
    def steps(self) -> int:
        return len(self.step_loss)

    @property
    def skipped(self) -> int:
        return sum(self.step_skipped)

    @property
    def step_epochs(self) -> list[float]:
        """Where each step sits on an axis of epochs: epoch ``k``'s steps spread over
        ``[k - 1, k)`` by its own count (a run resumed on another number of processes takes
        another number of steps per epoch)."""
        return [e.epoch - 1 + j / e.steps for e in self.epochs for j in range(e.steps)]

    @property
    def test_accuracy(self) -> float:
        return self.epochs[-1].test_accuracy if self.epochs else math.nan

    @property
    def final_loss_scale(self) -> float:
        return self.step_loss_scale[-1] if self.step_loss_scale else math.nan

    @property
    def images_per_second(self) -> float:
        seconds = sum(e.train_seconds for e in self.epochs)
        return sum(e.images for e in self.epochs) / seconds if seconds > 0 else math.nan

    @property
    def wall_seconds(self) -> float:
        return sum(e.seconds for e in self.epochs)


def evaluate(stepper: Stepper, batches: ImageBatches) -> float:
    """Returns the fraction of ``batches``' images that ``stepper``'s model classifies right.

    With several processes each classifies its part of the split with rank 0's BatchNorm
    statistics and the counts are summed: every process returns the same accuracy.
    """
    batches.processes.broadcast_buffers(stepper.model)
    stepper.model.eval()
    correct = torch.zeros((), dtype=torch.int64, device=batches.device)
    with torch.no_grad():
        for images, labels in batches:
            correct += (stepper.logits(images).argmax(dim=1) == labels).sum()
    stepper.model.train()
    return batches.processes.sum(correct).item() / max(len(batches.split), 1)


def _progress_bar(total: int, desc: str, show: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="step",
        file=sys.stderr,
        leave=False,
        dynamic_ncols=True,
        disable=not show,
    )


def _describe(outputs: list[StepOutput], skipped_before: int) -> dict[str, str]:
    recent = outputs[-REFRESH_EVERY:]
    loss = torch.stack([o.loss for o in recent]).mean()
    skipped = torch.stack([o.skipped for o in outputs]).sum()
    values = torch.stack([loss, recent[-1].loss_scale.float(), skipped.float()]).tolist()
    return {
        "loss": f"{values[0]:.4f}",
        "scale": f"{values[1]:g}",
        "skipped": str(skipped_before + int(values[2])),
    }


def fit(
    stepper: Stepper,
    train: ImageBatches,
    test: ImageBatches,
    *,
    epochs: int,
    lr: float,
    schedule: str = "constant",
    history: History | None = None,
    progress: bool = False,
    on_epoch_end: Callable[[int, History], None] | None = None,
    name: str = "",
) -> History:
    """Returns the history after training ``stepper`` up to ``epochs`` epochs in total.

    Training starts after the epochs already in ``history`` (a resumed run), sets the learning
    rate of every step from ``schedule``, evaluates on ``test`` after each epoch and then calls
    ``on_epoch_end(epochs_done, history)`` (where checkpoints are written). ``progress`` shows
    a tqdm bar per epoch on stderr; ``name`` (e.g. ``"FP32"``) prefixes bars and log lines.
    """
    prefix = f"{name} " if name else ""
    history = history if history is not None else History()
    steps_per_epoch = len(train)
    total_steps = epochs * steps_per_epoch
    stepper.model.train()
    for epoch in range(len(history.epochs), epochs):
        start = time.perf_counter()
        outputs: list[StepOutput] = []
        bar = _progress_bar(steps_per_epoch, f"{prefix}epoch {epoch + 1}/{epochs}", progress)
        with bar:
            for i, (images, labels) in enumerate(train):
                global_step = epoch * steps_per_epoch + i
                stepper.set_lr(learning_rate(lr, schedule, global_step, total_steps))
                outputs.append(stepper.train_step(images, labels))
                if progress and ((i + 1) % REFRESH_EVERY == 0 or i + 1 == steps_per_epoch):
                    bar.set_postfix(_describe(outputs, history.skipped))
                bar.update(1)
        # Each process saw its part of every batch: the batch's loss is their mean.
        losses = (
            train.processes.mean(torch.stack([o.loss for o in outputs])).tolist() if outputs else []
        )
        scales = torch.stack([o.loss_scale.float() for o in outputs]).tolist() if outputs else []
        skips = torch.stack([o.skipped for o in outputs]).tolist() if outputs else []
        train_seconds = time.perf_counter() - start
        accuracy = evaluate(stepper, test)
        history.step_loss += losses
        history.step_loss_scale += scales
        history.step_skipped += skips
        record = EpochRecord(
            epoch=epoch + 1,
            loss=sum(losses) / len(losses) if losses else math.nan,
            test_accuracy=accuracy,
            loss_scale=history.final_loss_scale,
            skipped=sum(skips),
            steps=len(outputs),
            images=len(outputs) * train.global_batch_size,
            train_seconds=train_seconds,
            seconds=time.perf_counter() - start,
        )
        history.epochs.append(record)
        scaling = (
            ""
            if math.isnan(record.loss_scale)
            else f", loss scale {record.loss_scale:g}, {record.skipped} skipped steps"
        )
        logger.info(
            "%sepoch %d/%d: loss %.4f, test accuracy %.2f%%%s, %.0f images/s",
            prefix,
            record.epoch,
            epochs,
            record.loss,
            100 * record.test_accuracy,
            scaling,
            record.images / max(record.train_seconds, 1e-9),
        )
        if on_epoch_end is not None:
            on_epoch_end(epoch + 1, history)
    return history
