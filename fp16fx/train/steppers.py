"""How ``fp16fx train`` takes one optimizer step, through each of fp16fx's APIs.

A :class:`Stepper` owns a model and its optimizer and exposes the few operations the training
loop needs: one training step on a batch, the logits of a batch for evaluation, the learning
rate, and a checkpointable state dict. Three implementations:

* :class:`FacadeStepper`: the apex-compatible ``fp16fx.FP16_Optimizer`` over ``torch.optim.Adam``
  (``optimizer.backward(loss)``, ``optimizer.step()``), exactly as an apex script does it.
* :class:`FunctionalStepper`: the pure API. The model is used through
  ``torch.func.functional_call`` on a dict of params held in an ``fp16fx.init`` state, grads
  come from ``torch.func.grad`` and the step is ``fp16fx.step`` (pure) or
  ``fp16fx.compile_step(inplace=True)`` (fused, in place).
* :class:`TorchStepper`: plain FP32 ``torch.optim.Adam``, the baseline of ``--compare-fp32``.

(``--fsdp`` trains with a fourth, :class:`fp16fx.train.fsdp.FSDPStepper`: the facade on a model
sharded by FSDP2.)

The two fp16fx steppers take the state's precision (``--masters``, ``--moments``): FP32 masters
and moments by default, or a compensated master (no FP32 copy: the FP16 param plus an int8
correction) and BF16 or int8 moments. They pass it to ``fp16fx.init`` / ``FP16_Optimizer``
only when it differs from the default.

None of them holds optimizer or loss-scale logic: that is fp16fx's job. With
``distributed=True`` (``torch.distributed`` initialized, one stepper per process) each averages
the gradients over the processes the way its API's docs/distributed.md says: the facade and the
FP32 baseline train through ``DistributedDataParallel``, the functional stepper holds an
``fp16fx.distributed.init`` state (found-inf consensus) and calls
``fp16fx.distributed.average_grads``. ``model`` stays the plain module in every case, so
evaluation and checkpoints do not depend on the number of processes.

Every step reports 0-d tensors on the model's device; the loop decides when to look at them.
The functional stepper never syncs with the device; the facade stepper reads the public
``optimizer.overflow`` and ``optimizer.loss_scale``, each a host sync, after every step.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad
from torch.nn.parallel import DistributedDataParallel

import fp16fx
import fp16fx.checkpoint
import fp16fx.distributed as fdist

__all__ = [
    "APIS",
    "FacadeStepper",
    "FunctionalStepper",
    "LossScale",
    "StateMismatchError",
    "StepOutput",
    "Stepper",
    "TorchStepper",
    "make_stepper",
]

#: ``"dynamic"`` or a static loss scale.
LossScale = str | float

#: The values of ``--api``.
APIS = ("facade", "functional")

#: The state's default precision: FP32 masters and moments.
DEFAULT_PRECISION = {"master": "fp32", "moments": "fp32"}


class StateMismatchError(ValueError):
    """A state dict does not fit this model/optimizer; the message names the first misfit."""


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What one training step reports, as 0-d tensors on the model's device.

    Attributes:
      loss: the (unscaled) FP32 loss of the batch.
      skipped: True when the step was skipped because the gradients overflowed.
      loss_scale: the loss scale after the step (NaN when there is none).
    """

    loss: torch.Tensor
    skipped: torch.Tensor
    loss_scale: torch.Tensor


#: How a stepper's label names the FP16 model it trains.
FP16_MODEL = "FP16 model, BatchNorm FP32"


def _describe_scale(loss_scale: LossScale) -> str:
    if loss_scale == "dynamic":
        return "dynamic loss scale"
    return f"static loss scale {float(loss_scale):g}"


def _precision(master: str, moments: str) -> dict[str, str]:
    """Returns the precision keywords of ``fp16fx.init`` / ``FP16_Optimizer`` that differ
    from their defaults (none for FP32 masters and moments)."""
    given = {"master": master, "moments": moments}
    return {key: value for key, value in given.items() if value != DEFAULT_PRECISION[key]}


def _describe_precision(precision: dict[str, str]) -> str:
    """Returns ``"; compensated master, int8 moments"`` (the parts not default), or ``""``."""
    parts = []
    if "master" in precision:
        parts.append(f"{precision['master']} master")
    if "moments" in precision:
        parts.append(f"{precision['moments']} moments")
    return "; " + ", ".join(parts) if parts else ""


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels)


def _data_parallel(model: nn.Module) -> nn.Module:
    """Returns ``model`` under DDP, which broadcasts rank 0's weights and buffers now and
    averages the gradients in every backward (on a GPU: this process's current device)."""
    device = next(model.parameters()).device
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)


class Stepper(abc.ABC):
    """One model with its optimizer, seen by the training loop.

    Attributes:
      model: the ``nn.Module`` (for the functional API: the structure only, called through
        ``functional_call`` with the state's params).
      label: a short description for reports, e.g.
        ``"fp16fx.FP16_Optimizer(Adam), eager, dynamic loss scale; FP16 model, BatchNorm FP32"``.
      collective_state_dict: whether :meth:`state_dict` is a collective that every process
        calls (it gathers shards), not just the one that saves.
    """

    model: nn.Module
    label: str
    collective_state_dict: bool = False

    @abc.abstractmethod
    def train_step(self, images: torch.Tensor, labels: torch.Tensor) -> StepOutput:
        """Returns the step's report after one optimizer step on the batch."""

    @abc.abstractmethod
    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """Returns the model's output for ``images`` (the caller sets eval mode, no_grad)."""

    @abc.abstractmethod
    def set_lr(self, lr: float) -> None:
        """Sets the learning rate used by the next steps."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Returns ``{"model": ..., "optimizer": ...}``: tensors and primitives only."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict`; raises :class:`StateMismatchError` if it does not fit."""

    @abc.abstractmethod
    def replicated(self) -> list[torch.Tensor]:
        """Returns the tensors every process holds bitwise alike at the end of a run, which
        the run's summary compares with rank 0's: under data parallelism, the model's weights
        and buffers."""


class OptimizerStepper(Stepper):
    """A stepper around a stateful optimizer object (``torch.optim`` or ``FP16_Optimizer``):
    the model is called directly, the lr lives in ``param_groups``, both have state dicts.

    Training calls ``forward``: the model itself, or the model under DDP. A checkpoint holds
    the state dict of :attr:`weights`.
    """

    optimizer: torch.optim.Optimizer
    forward: nn.Module

    @property
    def weights(self) -> nn.Module:
        """The module whose state dict a checkpoint holds: the model itself."""
        return self.model

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def set_lr(self, lr: float) -> None:
        # Both read hyperparameters from param_groups at every step.
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.weights.state_dict(), "optimizer": self.optimizer.state_dict()}

    def replicated(self) -> list[torch.Tensor]:
        return list(self.weights.state_dict().values())

    def _load_weights(self, weights: dict[str, Any]) -> None:
        self.weights.load_state_dict(weights)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self._load_weights(state["model"])
        except (RuntimeError, TypeError, AttributeError, ValueError, KeyError) as exc:
            first = str(exc).strip().splitlines()
            raise StateMismatchError(
                f"the model weights do not fit this model: {' '.join(first[:2])}"
            ) from None
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as exc:
            raise StateMismatchError(
                f"the optimizer state does not fit this optimizer: {exc}"
            ) from None


class FacadeStepper(OptimizerStepper):
    """``fp16fx.FP16_Optimizer`` over ``torch.optim.Adam`` on an FP16 model, the apex way.

    ``compile`` picks the facade's compiled fast path (``compiled=True``, its default) or the
    same core run eagerly (cheaper on a CPU for small models: no compile time). ``master`` and
    ``moments`` are the state's precision (docs/precision.md), passed to
    ``FP16_Optimizer`` when not the default.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        loss_scale: LossScale,
        compile: bool = True,
        distributed: bool = False,
        master: str = "fp32",
        moments: str = "fp32",
    ) -> None:
        precision = _precision(master, moments)
        self.model = model
        # DDP first: its broadcast of rank 0's weights must precede the masters' copy of them.
        self.forward = _data_parallel(model) if distributed else model
        adam = torch.optim.Adam(model.parameters(), lr=lr)
        if loss_scale == "dynamic":
            scaling = {"dynamic_loss_scale": True}
        else:
            scaling = {"static_loss_scale": float(loss_scale)}
        self.optimizer = fp16fx.FP16_Optimizer(
            adam, **scaling, verbose=False, compiled=compile, **precision
        )
        how = "compiled" if compile else "eager"
        self.label = (
            f"fp16fx.FP16_Optimizer(Adam), {how}, {_describe_scale(loss_scale)}"
            f"{_describe_precision(precision)}; {FP16_MODEL}" + ("; DDP" if distributed else "")
        )

    def train_step(self, images: torch.Tensor, labels: torch.Tensor) -> StepOutput:
        self.optimizer.zero_grad()
        loss = _loss(self.forward(images), labels)
        self.optimizer.backward(loss)
        self.optimizer.step()
        return StepOutput(
            loss=loss.detach(),
            skipped=torch.as_tensor(self.optimizer.overflow, device=loss.device).clone(),
            loss_scale=torch.as_tensor(
                self.optimizer.loss_scale, dtype=torch.float32, device=loss.device
            ).clone(),
        )


class FunctionalStepper(Stepper):
    """The pure API: ``functional_call`` + ``torch.func.grad`` + ``fp16fx.step``.

    The training state is ``self.state`` (an ``fp16fx.init`` state over the model's params as a
    dict keyed like ``model.named_parameters()``); the module's buffers (BatchNorm running
    statistics) are passed to ``functional_call`` alongside, and updated by it in place.
    With ``compile=True`` the step is ``fp16fx.compile_step(inplace=True)``, which writes into
    the state's tensors (and so into the model's own params); otherwise the pure
    ``fp16fx.step`` returns a new state each time.

    ``master`` and ``moments`` are the state's precision (docs/precision.md),
    passed to ``fp16fx.init`` when not the default. A compensated master needs the params in
    flat buckets: the state is then built with ``buckets=True`` on the module's own params,
    which it re-points at views of its buffers.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        loss_scale: LossScale,
        compile: bool = False,
        distributed: bool = False,
        master: str = "fp32",
        moments: str = "fp32",
    ) -> None:
        self.model = model
        self.distributed = distributed
        precision = _precision(master, moments)
        buckets = master == "compensated"
        layout = {"buckets": True} if buckets else {}
        params = {
            # buckets=True re-points the given tensors: give the module's own (so it keeps
            # training in place), not detached copies, which alone would be re-pointed.
            name: p if buckets else p.detach()
            for name, p in model.named_parameters()
        }
        self.buffers = dict(model.named_buffers())
        policy = (
            fp16fx.DynamicLossScale()
            if loss_scale == "dynamic"
            else fp16fx.StaticLossScale(float(loss_scale))
        )
        # fdist.init: rank 0's params on every process, and the found-inf consensus.
        init = fdist.init if distributed else fp16fx.init
        self.state = init(params, fp16fx.adam(lr), loss_scale=policy, **layout, **precision)
        self._step = fp16fx.compile_step(inplace=True) if compile else fp16fx.step
        self._grad = grad(self._scaled_loss, has_aux=True)
        how = "compile_step(inplace=True)" if compile else "step"
        self.label = (
            f"fp16fx.{how} over fp16fx.adam, torch.func.grad of functional_call, "
            f"{_describe_scale(loss_scale)}{_describe_precision(precision)}; {FP16_MODEL}"
            + ("; fp16fx.distributed.average_grads" if distributed else "")
        )

    def _scaled_loss(
        self,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        images: torch.Tensor,
        labels: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Buffers are an argument (not captured) because BatchNorm updates them in place,
        # which torch.func allows only for a function's inputs.
        loss = _loss(functional_call(self.model, (params, buffers), (images,)), labels)
        return fp16fx.scale_loss(self.state, loss), loss.detach()

    def train_step(self, images: torch.Tensor, labels: torch.Tensor) -> StepOutput:
        grads, loss = self._grad(self.state.params, self.buffers, images, labels)
        if self.distributed:
            fdist.average_grads(grads)
        self.state, info = self._step(self.state, grads)
        return StepOutput(
            loss=loss,
            skipped=~info.finite,
            # Cloned: the in-place step overwrites this tensor at the next step.
            loss_scale=self.state.loss_scale.scale.clone(),
        )

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, (self.state.params, self.buffers), (images,))

    def set_lr(self, lr: float) -> None:
        # In place: a tensor in the state changes, the compiled step is not recompiled.
        fp16fx.set_hyperparams(self.state, lr=lr, inplace=True)

    def state_dict(self) -> dict[str, Any]:
        return {
            # Keyed like model.state_dict(): a plain nn.Module can load these weights.
            "model": {**self.state.params, **self.buffers},
            "optimizer": fp16fx.state_dict(self.state),
        }

    def replicated(self) -> list[torch.Tensor]:
        return [*self.state.params.values(), *self.buffers.values()]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        model_state, opt_state = state["model"], state["optimizer"]
        for name, dst in self.buffers.items():
            if name not in model_state:
                raise StateMismatchError(f"the model weights lack buffer {name!r}")
            _check_like(name, model_state[name], dst)
        # Checked whole before anything is written, then copied into the existing tensors
        # (the compiled step keeps them); another precision's state is converted.
        try:
            self.state = fp16fx.load_state_dict(self.state, opt_state)
        except (ValueError, TypeError) as exc:
            raise StateMismatchError(str(exc)) from None
        with torch.no_grad():
            for name, dst in self.buffers.items():
                dst.copy_(model_state[name])


def _check_like(name: str, src: Any, dst: torch.Tensor) -> None:
    if not isinstance(src, torch.Tensor):
        raise StateMismatchError(f"{name} is a {type(src).__name__} in the state, not a tensor")
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise StateMismatchError(
            f"{name} is {src.dtype} {tuple(src.shape)} in the state; "
            f"this model needs {dst.dtype} {tuple(dst.shape)}"
        )


class TorchStepper(OptimizerStepper):
    """Plain FP32 ``torch.optim.Adam``: the ``--compare-fp32`` baseline."""

    def __init__(self, model: nn.Module, lr: float, distributed: bool = False) -> None:
        self.model = model
        self.forward = _data_parallel(model) if distributed else model
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        self.label = "torch.optim.Adam; FP32 model" + ("; DDP" if distributed else "")

    def train_step(self, images: torch.Tensor, labels: torch.Tensor) -> StepOutput:
        self.optimizer.zero_grad(set_to_none=True)
        loss = _loss(self.forward(images), labels)
        loss.backward()
        self.optimizer.step()
        return StepOutput(
            loss=loss.detach(),
            skipped=torch.zeros((), dtype=torch.bool, device=loss.device),
            loss_scale=torch.full((), math.nan, device=loss.device),
        )


def make_stepper(
    api: str,
    model: nn.Module,
    lr: float,
    loss_scale: LossScale,
    compile: bool = False,
    distributed: bool = False,
    master: str = "fp32",
    moments: str = "fp32",
) -> Stepper:
    """Returns the stepper of ``api`` (one of :data:`APIS`) for an FP16 ``model`` (FSDP2:
    :class:`fp16fx.train.fsdp.FSDPStepper`).

    ``distributed``: one of several processes (``torch.distributed`` initialized), each
    stepping on its part of every batch with the gradients averaged over all of them.
    ``master``, ``moments``: the state's precision (docs/precision.md).
    """
    options = {"compile": compile, "distributed": distributed, "master": master, "moments": moments}
    if api == "facade":
        return FacadeStepper(model, lr, loss_scale, **options)
    if api == "functional":
        return FunctionalStepper(model, lr, loss_scale, **options)
    raise ValueError(f"unknown api {api!r} (choose from: {', '.join(APIS)})")
