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

import optree
import torch
import torch._dynamo

from fp16fx.state import MixedPrecisionState
from fp16fx.step import Info, apply_updates, apply_updates_, run_step

StepFn = Callable[[MixedPrecisionState, Any], tuple[MixedPrecisionState, Info]]


def compile_step(
    *,
    inplace: bool = False,
    cuda_graph: bool = False,
    mode: str | None = None,
    dynamic: bool | None = False,
    backend: str = "inductor",
) -> StepFn:
    """Returns ``step`` compiled with ``torch.compile(fullgraph=True)``.

    Args:
      inplace: write the new values into the state's own tensors (params, masters, moments,
        counts, loss scale) and return that same state. No second copy of the state is ever
        allocated; the params you passed to ``init`` (e.g. a model's) are updated in place.
      cuda_graph: capture the whole step (reduction, update, loss-scale adjustment) in one
        CUDA graph and replay it (``mode="reduce-overhead"``). Needs ``inplace=True``: the
        state's tensors and the grads are marked as static addresses, so keep passing the
        same state and the same grad tensors (e.g. ``grad_buffers(state)``), change
        hyperparameters with ``set_hyperparams(..., inplace=True)``, and clone ``info`` if
        you keep it past the next step (replay overwrites it).
      mode, dynamic, backend: passed to ``torch.compile``. ``dynamic=False`` (the default)
        specialises kernels to the leaves' shapes.

    The returned callable gives the same numbers as :func:`fp16fx.step`.
    """
    if cuda_graph:
        if not inplace:
            raise ValueError("cuda_graph=True needs inplace=True: a graph replays fixed addresses")
        mode = "reduce-overhead"
    core = torch.compile(
        apply_updates_ if inplace else apply_updates,
        fullgraph=True,
        dynamic=dynamic,
        mode=mode,
        backend=backend,
    )

    def compiled_step(state: MixedPrecisionState, grads: Any) -> tuple[MixedPrecisionState, Info]:
        if cuda_graph:
            _mark_static(optree.tree_leaves((state, grads)))
        return run_step(core, state, grads, inplace=inplace)

    compiled_step.__doc__ = f"fp16fx.step compiled (inplace={inplace}, mode={mode!r})."
    return compiled_step


def _mark_static(tensors: list[torch.Tensor]) -> None:
    """Marks each tensor as a static input (once), so graph replay reads it in place
    instead of copying it into the graph's own input buffers every step."""
    for t in tensors:
        # The attribute mark_static_address sets; checking it keeps repeat calls cheap.
        if getattr(t, "_dynamo_static_input_type", None) is None:
            torch._dynamo.mark_static_address(t)
