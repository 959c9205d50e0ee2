"""fp16fx's own contenders for ``fp16fx bench``, written against fp16fx's public API.

* ``fp16fx-compiled`` — ``fp16fx.compile_step(inplace=True)`` over the bucketed state of
  ``fp16fx.init(params, fp16fx.adam(lr), fp16fx.StaticLossScale(scale), buckets=True)``, grads
  in ``fp16fx.grad_buffers(state)``; ``fp16fx-compiled-leaves`` is the same over the params as
  separate leaves, with separate grads (``torch.func.grad``'s way).
* ``fp16fx-facade`` — ``fp16fx.FP16_Optimizer(torch.optim.Adam(params), static_loss_scale=…)``
  with grads in ``p.grad``; ``opt.step()`` takes the facade's fast (compiled) path.
* ``fp16fx-eager`` — the pure, uncompiled ``fp16fx.step(state, grads)``.
* ``fp16fx-compensated``, ``fp16fx-compensated-bf16``, ``fp16fx-compensated-int8`` — the
  compiled step in compact precision (``init(..., master="compensated", moments=...)``, no
  FP32 copy of the weights; docs/precision.md), each beside its own roofline: the bytes its
  step must move.

fp16fx's runners keep their FP16 weights in their own state: ``persistent_tensors`` counts
that state's distinct storages plus the grads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import optree
import torch
from torch import Tensor

import fp16fx
from fp16fx.bench.runner import Runner, register_runner
from fp16fx.compile import StepFunction
from fp16fx.precision import correction_dtype

__all__ = [
    "Fp16fxCompactRunner",
    "Fp16fxCompensatedBf16Runner",
    "Fp16fxCompensatedInt8Runner",
    "Fp16fxCompensatedRunner",
    "Fp16fxCompiledLeavesRunner",
    "Fp16fxCompiledRunner",
    "Fp16fxEagerRunner",
    "Fp16fxFacadeRunner",
]


class _FunctionalRunner(Runner):
    """Shared setup of the functional contenders: ``state = fp16fx.init(...)``."""

    def make_transform(self) -> fp16fx.GradientTransformation:
        """Return the fp16fx optimizer transform: ``fp16fx.adam`` with the config's numbers."""
        cfg = self.config
        return fp16fx.adam(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)

    def setup(self, params: list[Tensor], grads: list[Tensor]) -> None:
        self.grad_tree: Any = grads
        self.state = fp16fx.init(
            params, self.make_transform(), fp16fx.StaticLossScale(self.config.loss_scale)
        )
        self.info: Any = None
        self._step = self.make_step()

    def make_step(self) -> Callable[[Any, Any], tuple[Any, Any]]:
        """Return the ``(state, grads) -> (state, info)`` function this runner calls."""
        raise NotImplementedError

    def step(self) -> None:
        self.state, self.info = self._step(self.state, self.grad_tree)

    def persistent_tensors(self) -> Iterable[Tensor]:
        kept = optree.tree_leaves((self.state, self.grad_tree))
        if isinstance(self._step, StepFunction):  # an in-place step's packing buffers
            kept += self._step.kept_buffers()
        return [t for t in kept if t is not None]

    def masters(self) -> list[Tensor]:
        """The FP32 masters (a compensated state's decoded: copies)."""
        return optree.tree_leaves(self.state.master)


@register_runner
class Fp16fxCompiledRunner(_FunctionalRunner):
    """fp16fx's compiled functional step as its docs recommend for speed: a bucketed state
    (``init(..., buckets=True)``), grads in ``grad_buffers(state)``, stepped in place."""

    name = "fp16fx-compiled"
    label = "fp16fx compile_step(inplace), buckets"
    order = 10
    compiled = True
    master: ClassVar[str] = "fp32"
    moments: ClassVar[str] = "fp32"

    def setup(self, params: list[Tensor], grads: list[Tensor]) -> None:
        self.state = fp16fx.init(
            params,
            self.make_transform(),
            fp16fx.StaticLossScale(self.config.loss_scale),
            buckets=True,
            master=self.master,
            moments=self.moments,
        )
        self.grad_tree = fp16fx.grad_buffers(self.state)
        with torch.no_grad():
            for view, grad in zip(self.grad_tree, grads, strict=True):
                view.copy_(grad)
        self.info = None
        self._step = self.make_step()

    def make_step(self) -> Callable[[Any, Any], tuple[Any, Any]]:
        return fp16fx.compile_step(inplace=True)


class Fp16fxCompactRunner(Fp16fxCompiledRunner):
    """``fp16fx-compiled`` with its state in compact precision: ``master`` and ``moments``.

    A step moves, per param: the grads twice (the check, then the update: 4), the FP16 param
    and its int8 correction read and written (6), and each moment read and written. A BF16
    param's correction is int16 (``fp16fx.precision.correction_dtype``): 2 bytes more.
    """

    master = "compensated"

    @classmethod
    def moved_bytes(cls, dtype: torch.dtype) -> float:
        wider = correction_dtype(dtype).itemsize - correction_dtype(torch.float16).itemsize
        return cls.moved_bytes_per_param + 2 * wider  # read and written


@register_runner
class Fp16fxCompensatedRunner(Fp16fxCompactRunner):
    name = "fp16fx-compensated"
    label = "fp16fx compile_step, compensated master"
    order = 14
    moments = "fp32"
    moved_bytes_per_param = 26.0


@register_runner
class Fp16fxCompensatedBf16Runner(Fp16fxCompactRunner):
    name = "fp16fx-compensated-bf16"
    label = "fp16fx compile_step, compensated + bf16 moments"
    order = 15
    moments = "bf16"
    moved_bytes_per_param = 18.0


@register_runner
class Fp16fxCompensatedInt8Runner(Fp16fxCompactRunner):
    name = "fp16fx-compensated-int8"
    label = "fp16fx compile_step, compensated + int8 moments"
    order = 16
    moments = "int8"
    moved_bytes_per_param = 14.0


@register_runner
class Fp16fxCompiledLeavesRunner(_FunctionalRunner):
    """The same compiled step over the params as separate leaves and separate grads: the
    grads are packed into a flat buffer, and the new params copied out, each step. Not in
    the default set (``--only fp16fx-compiled-leaves``)."""

    name = "fp16fx-compiled-leaves"
    label = "fp16fx compile_step(inplace), leaves"
    order = 12
    compiled = True
    default = False

    def make_step(self) -> Callable[[Any, Any], tuple[Any, Any]]:
        return fp16fx.compile_step(inplace=True)


@register_runner
class Fp16fxEagerRunner(_FunctionalRunner):
    """fp16fx's pure step run eagerly: ``fp16fx.step(state, grads)`` (new state each step)."""

    name = "fp16fx-eager"
    label = "fp16fx step (eager)"
    order = 30

    def make_step(self) -> Callable[[Any, Any], tuple[Any, Any]]:
        return fp16fx.step


@register_runner
class Fp16fxFacadeRunner(Runner):
    """fp16fx's apex-compatible facade: ``FP16_Optimizer(torch.optim.Adam(params))``.

    Grads live in ``p.grad`` of the FP16 params (the harness sets them); each step is
    ``opt.step()``, which takes the facade's fast (compiled) path.
    """

    name = "fp16fx-facade"
    label = "fp16fx FP16_Optimizer.step"
    order = 20
    compiled = True

    def setup(self, params: list[Tensor], grads: list[Tensor]) -> None:
        cfg = self.config
        self.params = params
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        inner = torch.optim.Adam(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
        self.opt = fp16fx.FP16_Optimizer(inner, static_loss_scale=cfg.loss_scale, verbose=False)

    def step(self) -> None:
        self.opt.step()

    def persistent_tensors(self) -> Iterable[Tensor]:
        # The params and grads now live in the facade's flat buffers (p.data and p.grad are
        # views); its state dict holds views of its masters and moments.
        grads = [p.grad for p in self.params if p.grad is not None]
        kept = optree.tree_leaves(self.opt.state_dict())
        return [*self.params, *grads, *(t for t in kept if isinstance(t, Tensor))]

    def masters(self) -> list[Tensor]:
        return [m for group in self.opt.fp32_from_fp16_groups for m in group]
