"""fp16fx's own contenders for ``fp16fx bench``, written against fp16fx's public API.

* ``fp16fx-compiled`` — ``fp16fx.compile_step(inplace=True)`` over the bucketed state of
  ``fp16fx.init(params, fp16fx.adam(lr), fp16fx.StaticLossScale(scale), buckets=True)``, grads
  in ``fp16fx.grad_buffers(state)``; ``fp16fx-compiled-leaves`` is the same over separate leaves.
* ``fp16fx-facade`` — ``fp16fx.FP16_Optimizer(torch.optim.Adam(params), static_loss_scale=…)``
  with grads in ``p.grad``; ``opt.step()`` takes the facade's fast (compiled) path.
* ``fp16fx-eager`` — the pure, uncompiled ``fp16fx.step(state, grads)``.

Each runner checks for the API it needs (:meth:`unavailable_reason`), so ``fp16fx bench`` still
measures the baselines while parts of fp16fx are missing. fp16fx's runners keep their FP16
weights in their own state: ``persistent_tensors`` counts that state's distinct storages plus
the grads (the FP16 params handed to ``setup`` count only if the state shares their storage).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import optree
import torch
from torch import Tensor

from fp16fx.bench.runner import Runner, register_runner, tensors_in

__all__ = [
    "Fp16fxCompiledLeavesRunner",
    "Fp16fxCompiledRunner",
    "Fp16fxEagerRunner",
    "Fp16fxFacadeRunner",
]


def _fp16fx() -> Any:
    """Return the ``fp16fx`` package (imported lazily: it may be mid-construction)."""
    import fp16fx

    return fp16fx


def _missing(names: Iterable[str]) -> str | None:
    """Return a reason naming the ``fp16fx.<name>`` attributes that do not exist, or None."""
    try:
        package = _fp16fx()
    except Exception as exc:  # any import-time failure of the package makes it unavailable
        return f"import fp16fx failed: {type(exc).__name__}: {exc}"
    absent = [name for name in names if not hasattr(package, name)]
    return None if not absent else "fp16fx lacks " + ", ".join(f"fp16fx.{n}" for n in absent)


class _FunctionalRunner(Runner):
    """Shared setup of the functional contenders: ``state = fp16fx.init(...)``."""

    api: tuple[str, ...] = ("init", "adam", "StaticLossScale")

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        del device
        return _missing(cls.api)

    def make_transform(self) -> Any:
        """Return the fp16fx optimizer transform: ``fp16fx.adam(lr)`` (default betas/eps)."""
        return _fp16fx().adam(lr=self.config.lr)

    def setup(self, params: list[Tensor], grads: list[Tensor]) -> None:
        fp16fx = _fp16fx()
        self.grad_tree = grads
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
        # optree finds leaves of registered state types; the attribute walk finds the rest.
        found = optree.tree_leaves((self.state, self.grad_tree), namespace="fp16fx")
        found += list(tensors_in((self.state, self.grad_tree), depth=8))
        return [x for x in found if isinstance(x, Tensor)]


@register_runner
class Fp16fxCompiledRunner(_FunctionalRunner):
    """fp16fx's compiled functional step as its docs recommend for speed: a bucketed state
    (``init(..., buckets=True)``), grads in ``grad_buffers(state)``, stepped in place."""

    name = "fp16fx-compiled"
    label = "fp16fx compile_step(inplace), buckets"
    order = 10
    compiled = True
    api = (*_FunctionalRunner.api, "compile_step", "grad_buffers")

    def setup(self, params: list[Tensor], grads: list[Tensor]) -> None:
        fp16fx = _fp16fx()
        self.state = fp16fx.init(
            params,
            self.make_transform(),
            fp16fx.StaticLossScale(self.config.loss_scale),
            buckets=True,
        )
        self.grad_tree = fp16fx.grad_buffers(self.state)
        with torch.no_grad():
            for view, grad in zip(self.grad_tree, grads, strict=True):
                view.copy_(grad)
        self.info = None
        self._step = self.make_step()

    def make_step(self) -> Callable[[Any, Any], tuple[Any, Any]]:
        return _fp16fx().compile_step(inplace=True)


@register_runner
class Fp16fxCompiledLeavesRunner(_FunctionalRunner):
    """The same compiled step over separate leaves (no buckets): one kernel per leaf and
    a longer compile. Not in the default set (``--only fp16fx-compiled-leaves``)."""

    name = "fp16fx-compiled-leaves"
    label = "fp16fx compile_step(inplace), leaves"
    order = 12
    compiled = True
    default = False
    api = (*_FunctionalRunner.api, "compile_step")

    def make_step(self) -> Callable[[Any, Any], tuple[Any, Any]]:
        return _fp16fx().compile_step(inplace=True)


@register_runner
class Fp16fxEagerRunner(_FunctionalRunner):
    """fp16fx's pure step run eagerly: ``fp16fx.step(state, grads)`` (new state each step)."""

    name = "fp16fx-eager"
    label = "fp16fx step (eager)"
    order = 30
    api = (*_FunctionalRunner.api, "step")

    def make_step(self) -> Callable[[Any, Any], tuple[Any, Any]]:
        return _fp16fx().step


@register_runner
class Fp16fxFacadeRunner(Runner):
    """fp16fx's apex-compatible facade: ``FP16_Optimizer(torch.optim.Adam(params))``.

    Grads live in ``p.grad`` of the FP16 params (the harness sets them); each step is
    ``opt.step()``, which takes the facade's fast path (compiled over flat buffers).
    """

    name = "fp16fx-facade"
    label = "fp16fx FP16_Optimizer.step"
    order = 20
    compiled = True

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        del device
        return _missing(["FP16_Optimizer"])

    def setup(self, params: list[Tensor], grads: list[Tensor]) -> None:
        fp16fx = _fp16fx()
        cfg = self.config
        self.params = params
        self.grads = grads
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        inner = torch.optim.Adam(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
        kwargs: dict[str, Any] = {"static_loss_scale": cfg.loss_scale}
        if "verbose" in inspect.signature(fp16fx.FP16_Optimizer).parameters:
            kwargs["verbose"] = False
        self.opt = fp16fx.FP16_Optimizer(inner, **kwargs)

    def step(self) -> None:
        self.opt.step()

    def persistent_tensors(self) -> Iterable[Tensor]:
        # The facade may move params and grads into flat buffers (p.data / p.grad become
        # views): count what the params hold now, not the grads handed to setup.
        grads = [p.grad for p in self.params if p.grad is not None]
        return [*self.params, *grads, *tensors_in(self.opt, depth=8)]
