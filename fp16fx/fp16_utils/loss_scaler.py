"""The legacy ``apex.fp16_utils`` loss scalers, host-side as apex had them (layer: fp16_utils).

These are kept so old scripts that build ``DynamicLossScaler`` or ``LossScaler`` by hand keep
running. They decide on the host: ``DynamicLossScaler.has_overflow`` reads the gradients' verdict
back to the CPU (one sync per device, every step), which is exactly what fp16fx's own compiled
step avoids. Use them for compatibility, not for speed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from fp16fx.fp16_utils.master_params import to_python_float
from fp16fx.scaling import all_finite

__all__ = ["DynamicLossScaler", "LossScaler", "to_python_float"]  # apex's module had all three


class LossScaler:
    """A static loss scaler: every loss is multiplied by the constant ``cur_scale``.

    ``has_overflow`` always answers False and ``update_scale`` does nothing, so a static scale
    never skips a step; choose a scale small enough that FP16 gradients never overflow.
    """

    def __init__(self, scale: float = 1) -> None:
        self.cur_scale = scale

    @property
    def loss_scale(self) -> float:
        """Returns the current loss scale, ``cur_scale``."""
        return self.cur_scale

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        """Returns False: a static scaler never checks gradients."""
        return False

    def update_scale(self, overflow: bool) -> None:
        """Returns None; a static scale never changes."""

    def scale_gradient(
        self, module: nn.Module, grad_in: tuple[torch.Tensor, ...], grad_out: object
    ) -> tuple[torch.Tensor, ...]:
        """Returns ``grad_in`` with each gradient multiplied by the loss scale (a backward hook)."""
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Returns None; backpropagates ``loss * loss_scale``, as apex did. (Computing the
        product in FP32 would change no gradient: the gradient reaching an FP16 loss is FP16,
        so a scale past its range, like apex's first, 2**32, gives inf grads either way.)"""
        (loss * self.loss_scale).backward(retain_graph=retain_graph)


class DynamicLossScaler(LossScaler):
    """A dynamic loss scaler with apex's legacy rule; each ``update_scale`` call is one iteration.

    State: ``cur_scale``, ``cur_iter`` (starts at 0), ``last_overflow_iter`` (starts at -1),
    ``scale_factor``, ``scale_window``. The rule, applied by ``update_scale(overflow)``::

        if overflow:
            cur_scale = max(cur_scale / scale_factor, 1)   # floor at 1
            last_overflow_iter = cur_iter
        elif (cur_iter - last_overflow_iter) % scale_window == 0:
            cur_scale = cur_scale * scale_factor           # no ceiling
        cur_iter += 1

    So the scale grows after every ``scale_window`` clean iterations counted from the last
    overflow (from iteration -1 at the start), and shrinks on every overflow, never below 1.
    """

    def __init__(
        self, init_scale: float = 2**32, scale_factor: float = 2.0, scale_window: int = 1000
    ) -> None:
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        """Returns True if any param's ``.grad`` holds an inf or NaN (syncs with the device);
        a sparse grad, by its stored values. (apex summed each grad in FP32, so a finite FP32 grad
        whose sum overflowed counted too.)"""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is None:
                continue
            # A sparse grad by its stored values, uncoalesced: adding repeated indices in
            # FP16 could overflow where no value does.
            values = p.grad._values() if p.grad.is_sparse else p.grad
            if values.is_floating_point() or values.is_complex():  # integers are all finite
                by_device.setdefault(values.device, []).append(values)
        return not all(all_finite(grads) for grads in by_device.values())  # a sync per device

    def update_scale(self, overflow: bool) -> None:
        """Returns None; advances one iteration by the rule in the class docstring."""
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1
