"""Turning the step into fused kernels with ``torch.compile``; the math stays in ``step``.

Layer: ``compile`` (DESIGN.md). The compiled region sees flat lists of tensors: the pytree
bookkeeping (validation, gathering the leaves that have a gradient, rebuilding the state) runs
on the host around it and costs microseconds. Hyperparameters, the loss scale and step counts
are tensor inputs, so changing them never recompiles; what does recompile is a change of
shapes, dtypes, or of which leaves have a ``None`` gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fp16fx.step import Info, MixedPrecisionState, apply_updates, apply_updates_, run_step

StepFn = Callable[[MixedPrecisionState, Any], tuple[MixedPrecisionState, Info]]


def compile_step(
    *,
    inplace: bool = False,
    mode: str | None = None,
    dynamic: bool | None = False,
    backend: str = "inductor",
) -> StepFn:
    """Returns ``step`` compiled with ``torch.compile(fullgraph=True)``.

    Args:
      inplace: write the new values into the state's own tensors (params, masters, moments,
        counts, loss scale) and return that same state. No second copy of the state is ever
        allocated; the params you passed to ``init`` (e.g. a model's) are updated in place.
      mode, dynamic, backend: passed to ``torch.compile``. ``dynamic=False`` (the default)
        specialises kernels to the leaves' shapes.

    The returned callable gives the same numbers as :func:`fp16fx.step`.
    """
    core = torch.compile(
        apply_updates_ if inplace else apply_updates,
        fullgraph=True,
        dynamic=dynamic,
        mode=mode,
        backend=backend,
    )

    def compiled_step(state: MixedPrecisionState, grads: Any) -> tuple[MixedPrecisionState, Info]:
        return run_step(core, state, grads, inplace=inplace)

    compiled_step.__doc__ = f"fp16fx.step compiled (inplace={inplace}, mode={mode!r})."
    return compiled_step
