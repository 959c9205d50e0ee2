"""The contender interface of ``fp16fx bench`` and the registry that holds the contenders.

A *runner* is one way a user could take an Adam step on FP16 params with a loss scale: fp16fx's
compiled step, its facade, PyTorch's fused optimizer on FP32 master copies, an apex-style loop…
The harness hands every runner the same FP16 params and (scaled) FP16 grads, calls ``setup`` once
and ``step`` many times, and measures each call from outside. A runner therefore holds the whole
optimizer, its buffers and the hyperparameters of :class:`BenchConfig`; it never times itself.

Registering a contender::

    from fp16fx.bench import Runner, register_runner

    @register_runner
    class MyRunner(Runner):
        name = "mine"                  # what ``--only mine`` selects
        label = "my optimizer"         # the table's row label
        order = 45                     # rows are sorted by ``order``
        compiled = True                # measure cold/warm compile time

        def setup(self, params, grads): ...
        def step(self): ...
        def persistent_tensors(self): ...
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch
from torch import Tensor

from fp16fx.bench.results import ROOFLINE

__all__ = [
    "BenchConfig",
    "Runner",
    "register_runner",
    "runner_classes",
]


@dataclass(frozen=True)
class BenchConfig:
    """The step every contender takes: Adam with a static loss scale, no overflow.

    Attributes:
        lr: Adam's learning rate.
        betas: Adam's (beta1, beta2).
        eps: Adam's epsilon.
        loss_scale: the static loss scale the grads were multiplied by; runners unscale by it.
        dtype: the params' and grads' dtype, ``torch.float16`` or ``torch.bfloat16`` (both 2
            bytes: the roofline is the same, but for state that follows the dtype:
            :meth:`Runner.moved_bytes`). BF16 grads are scaled too, so that every contender
            does the same work in either dtype.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    loss_scale: float = 2.0**16
    dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        if self.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the bench steps FP16 or BF16 params, not {self.dtype}")

    @property
    def dtype_name(self) -> str:
        """``"float16"`` or ``"bfloat16"``."""
        return str(self.dtype).removeprefix("torch.")


class Runner(abc.ABC):
    """One contender of the benchmark: an optimizer that steps FP16 params in place.

    Subclasses set the class attributes and implement :meth:`setup` and :meth:`step`. The
    harness calls ``setup(params, grads)`` once, then ``step()`` repeatedly; after every step
    the FP16 ``params`` must hold the new weights, and ``grads`` are re-read on every step
    (the harness never changes them, so every step does the same work).

    Class attributes:
        name: the CLI name (``--only NAME``); unique in the registry.
        label: the row label in the text table.
        order: rows are listed by increasing ``order``.
        compiled: whether the runner compiles with ``torch.compile`` (the harness then
            measures cold and warm compile time and counts recompiles).
        baseline: whether this is one of the reference baselines users would pick instead
            of fp16fx (as opposed to fp16fx's own runners).
        default: whether a run without ``--only`` includes it.
        moved_bytes_per_param: what one step must move per param on FP16 params, its
            roofline's bytes (30: FP32 masters and moments); :meth:`moved_bytes` gives it
            per dtype.
    """

    name: ClassVar[str]
    label: ClassVar[str]
    order: ClassVar[int] = 100
    compiled: ClassVar[bool] = False
    baseline: ClassVar[bool] = False
    default: ClassVar[bool] = True
    moved_bytes_per_param: ClassVar[float] = 30.0

    @classmethod
    def moved_bytes(cls, dtype: torch.dtype) -> float:
        """Returns what one step must move per param on ``dtype`` params: the same for FP16
        and BF16 (both 2 bytes) unless the runner keeps state whose size follows the dtype."""
        return cls.moved_bytes_per_param

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.notes: list[str] = []

    @abc.abstractmethod
    def setup(self, params: list[Tensor], grads: list[Tensor]) -> None:
        """Build the optimizer's state for FP16 ``params`` whose grads are ``grads``.

        ``grads[i]`` is the scaled FP16 gradient of ``params[i]`` (the harness also sets
        ``params[i].grad = grads[i]`` for runners that read ``.grad``).
        """

    @abc.abstractmethod
    def step(self) -> None:
        """Take one optimizer step: unscale, check finiteness, update, write the FP16 params."""

    @abc.abstractmethod
    def persistent_tensors(self) -> Iterable[Tensor]:
        """Return every tensor this contender keeps between steps, params and grads included.

        The harness counts each underlying storage once, so views into flat buffers and
        tensors listed twice are not double-counted.
        """

    def masters(self) -> list[Tensor]:
        """Return the FP32 master weights, one per param (used by correctness tests)."""
        raise NotImplementedError(f"runner {self.name!r} does not expose master weights")


R = TypeVar("R", bound=type[Runner])

_REGISTRY: dict[str, type[Runner]] = {}

#: Modules whose import registers the built-in runners; loaded by :func:`runner_classes`.
DEFAULT_RUNNER_MODULES: tuple[str, ...] = (
    "fp16fx.bench.baselines",
    "fp16fx.bench.fp16fx_runners",
)


def register_runner(cls: R) -> R:
    """Add a :class:`Runner` subclass to the registry (usable as a class decorator).

    Re-registering a name replaces the earlier class, so an edited runner can be
    registered again in the same process.
    """
    if not (isinstance(cls, type) and issubclass(cls, Runner)):
        raise TypeError(f"register_runner expects a Runner subclass, got {cls!r}")
    if not getattr(cls, "name", None) or not getattr(cls, "label", None):
        raise TypeError(f"runner class {cls.__qualname__} must set `name` and `label`")
    if cls.name == ROOFLINE:
        raise ValueError(f"{ROOFLINE!r} names the report's roofline row: pick another name")
    _REGISTRY[cls.name] = cls
    return cls


def runner_classes() -> list[type[Runner]]:
    """Return all registered runner classes, built-ins included, sorted by ``order``."""
    for module in DEFAULT_RUNNER_MODULES:
        importlib.import_module(module)
    return sorted(_REGISTRY.values(), key=lambda cls: (cls.order, cls.name))
