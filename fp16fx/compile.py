"""Turning the step into fused kernels with ``torch.compile``; the math stays in ``step``.

Layer: ``compile`` (docs/design.md): the one module of the library that calls
``torch.compile`` (``fp16fx bench`` compiles its torch baselines itself). The compiled region
sees a few flat tensors per state (one per segment): the bookkeeping around it (checking the
grads, cutting segments, rebuilding the state) runs on the host and costs microseconds.
Hyperparameters, the loss scale and step counts are tensor inputs, so changing them never
recompiles.

Each state layout -- which buckets and segments, which of them have gradients, which policy --
gets a compiled region of its own, made from a fresh copy of the core's code: torch's
recompile limits count per code object, so no number of layouts in a process (a notebook
sweeping model widths, an optimizer per model) ever reaches them.
"""

from __future__ import annotations

import inspect
import types
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import optree
import torch
import torch._dynamo
import torch._inductor
from torch.utils import _python_dispatch

from fp16fx import tree
from fp16fx.consensus import CONSENSUS, collective_error
from fp16fx.prepare import Prepared, Scratch, checked, finish, gathered
from fp16fx.scaling import GradCheck
from fp16fx.state import MixedPrecisionState
from fp16fx.step import StepInfo, apply_updates, apply_updates_, check

#: The errors ``torch.compile`` raises when it cannot compile (no C++ compiler, an Inductor
#: bug); raised before the compiled code runs, so nothing has changed.
COMPILE_ERRORS: tuple[type[Exception], ...] = tuple(
    getattr(module, name)
    for module, name in (
        (torch._dynamo.exc, "BackendCompilerFailed"),
        (torch._inductor.exc, "InductorError"),
    )
    if hasattr(module, name)
)


def _fresh_copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Returns ``fn`` with a new code object: Dynamo keeps its cache and limits per code."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


#: Inductor settings for every compiled region (``torch._inductor.config``):
#:
#: * ``emulate_precision_casts``: without it Inductor drops a cast to FP16 that feeds more
#:   arithmetic, computing on in FP32; the step's check that a param is its master rounded
#:   (``p != m.to(p.dtype)``) would then compare against the unrounded master, and re-sync
#:   every param from its FP16 value.
#: * ``realize_reads_threshold`` (default 4): a value read more often is stored in a
#:   temporary. An int8 moment's new value is read by its block's maximum, its encoding and
#:   the update; stored, it costs 8 B/param of FP32 temporaries, written and read back.
#:   Recomputed in each pass from the 1-byte codes it is cheaper: resnet18's compensated
#:   int8 step took 48 ms instead of 107 on the 2-core CPU (docs/precision.md), the other
#:   modes unchanged.
_INDUCTOR_SETTINGS = {"emulate_precision_casts": True, "realize_reads_threshold": 16}

#: Inductor's C++ backend warns once per fused loop that reads both FP16 and BF16 (FP16 params
#: beside BF16 moments), then computes in FP32, as the step means to: nothing a user can act on.
_SILENCED = "bf16 and fp16 are mixed in the scheduler node"


def _with_settings(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """Returns ``compiled`` run (and so compiled) under :data:`_INDUCTOR_SETTINGS`, without
    Inductor's :data:`_SILENCED` warning."""

    def run(*args: Any) -> Any:
        with torch._inductor.config.patch(_INDUCTOR_SETTINGS), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SILENCED, category=UserWarning)
            return compiled(*args)

    return run


#: Compiled regions, shared by every StepFunction of the process: one per layout (buckets,
#: segments, which have gradients, which params are written), policy, consensus, core and
#: compile options. Regions differing only in the optimizer's static structure (nesterov,
#: amsgrad...) share one, as separate graphs of it, up to ``_GRAPHS_PER_REGION``.
_REGIONS: dict[Hashable, Callable[..., Any]] = {}
_GRAPHS_PER_REGION = 64
_HAS_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters


def _dynamo_runs_it_uncompiled() -> bool:
    """Whether Dynamo would run a compiled region's frame as it is, uncompiled: its tracing
    switched off (``torch._dynamo.config.disable``), or a TorchDispatchMode active (say
    ``FlopCounterMode`` around a training step), whose ops Dynamo leaves to the mode. With
    ``fullgraph=True`` it then raises "found no compiled frames" only after the frame ran: an
    in-place step would have written the state, and a pure one's result would be lost."""
    if torch._dynamo.config.disable:
        return True
    if getattr(torch._dynamo.config, "inline_torch_dispatch_torch_compile", False):
        return _python_dispatch.any_torch_dispatch_mode_on_stack()
    return _python_dispatch.is_in_any_mode_without_ignore_compile_internals()


def _run_region(
    key: Hashable,
    fn: Callable[..., Any],
    options: dict[str, Any],
    args: tuple[Any, ...],
    consensus: Any,
) -> Any:
    """Returns ``fn(*args)`` through the compiled region of ``key`` (made on first use, and
    made anew, fresh, if it ever reaches its graph limit: no limit is process-wide), or run
    eagerly where Dynamo would run it uncompiled. ``consensus``: the state's (None: none),
    whose collective, traced into the region, fails there with no Python around it to name
    it (:func:`_collective_failure`)."""
    if not torch.compiler.is_compiling() and _dynamo_runs_it_uncompiled():
        return fn(*args)  # (eagerly, the consensus names its own failure)
    if key not in _REGIONS:
        limit = {"recompile_limit": _GRAPHS_PER_REGION} if _HAS_LIMIT else {}  # torch >= 2.8
        _REGIONS[key] = _with_settings(torch.compile(_fresh_copy(fn), **limit, **options))
    try:
        return _REGIONS[key](*args)
    except torch._dynamo.exc.FailOnRecompileLimitHit:  # before anything ran
        del _REGIONS[key]
        return _run_region(key, fn, options, args, consensus)
    except RuntimeError as err:
        if consensus is None or not _collective_failure(err):
            raise
        raise collective_error(CONSENSUS, err) from err


def _collective_failure(err: RuntimeError) -> bool:
    """Whether ``err``, raised by a compiled region over a state with a consensus, reads as
    its collective failing (a peer died, or timed out): torch raises those as a plain
    RuntimeError (gloo) or a DistError (NCCL). Its compile, memory and device errors have
    classes of their own; a plain RuntimeError raised elsewhere in the region (Dynamo's
    "found no compiled frames", were its skip rule to change) would read as one too, its
    own message kept as the cause."""
    return type(err) is RuntimeError or isinstance(err, torch.distributed.DistError)


class StepFunction:
    """``fp16fx.step``, compiled or eager, pure or in place (stateful: its buffers).

    Call it as ``state, info = step_fn(state, grads)``. In place, it keeps flat buffers
    (:data:`~fp16fx.prepare.Scratch`): one per bucket into which grads that are not already
    laid out like the buckets are packed, and one per segment whose params are not one flat
    tensor, so a step allocates nothing of the model's size. ``compile_options``:
    ``torch.compile``'s arguments, or None to run the core eagerly.
    """

    def __init__(
        self,
        *,
        inplace: bool,
        compile_options: dict[str, Any] | None,
        cuda_graph: bool = False,
    ) -> None:
        self.inplace = inplace
        self.compile_options = compile_options
        self.cuda_graph = cuda_graph
        self._scratch: Scratch = {}

    def kept_buffers(self) -> list[torch.Tensor]:
        """Returns the buffers it keeps from call to call (in place: the flat buffers grads
        and params not laid out like the state's buckets are packed into), which count in
        the memory a training run holds between steps."""
        return [buffer for buffer, _ in self._scratch.values()]

    def _run(self, fn: Callable[..., Any], prepared: Prepared, *args: Any) -> Any:
        if self.compile_options is None:
            return fn(*args)
        state = prepared.state
        key = (
            fn.__name__,
            tuple(sorted(self.compile_options.items())),
            state.layout,
            prepared.active,
            tuple(p is not None for p in prepared.trained.params),
            state.policy,
            state.consensus,
            state.precision,
            state.bucket_starts,
        )
        return _run_region(key, fn, self.compile_options, args, state.consensus)

    def _prepare(self, state: MixedPrecisionState, grads: Any, gather: bool = True) -> Prepared:
        scratch = self._scratch if self.inplace else None
        prepared = checked(state, grads, scratch)
        if self.inplace:  # before gathering, which writes FP32 leaves into their masters
            _refuse_aliases(prepared, grads)
        if gather:
            prepared = gathered(prepared, scratch)
        if self.cuda_graph:
            _mark_static(optree.tree_leaves((prepared.grads, prepared.trained)))
        return prepared

    def __call__(
        self, state: MixedPrecisionState, grads: Any
    ) -> tuple[MixedPrecisionState, StepInfo]:
        prepared = self._prepare(state, grads)
        args = prepared.core_args()
        with torch.no_grad():
            if self.inplace:
                info = self._run(apply_updates_, prepared, *args)
                return finish(prepared, None), info
            new, info = self._run(apply_updates, prepared, *args)
        return finish(prepared, new), info

    def check(self, state: MixedPrecisionState, grads: Any) -> GradCheck:
        """Returns what a step on ``grads`` would find; nothing moves (the state's segments
        may be cut, as the step would cut them)."""
        prepared = self._prepare(state, grads, gather=False)
        with torch.no_grad():
            finite, norm = self._run(
                check, prepared, state.consensus, prepared.grads, state.loss_scale.scale
            )
        return GradCheck(finite, norm)


def compile_step(
    *,
    inplace: bool = False,
    cuda_graph: bool = False,
    mode: str | None = None,
    dynamic: bool | None = False,
    backend: str = "inductor",
) -> StepFunction:
    """Returns ``fp16fx.step`` compiled with ``torch.compile(fullgraph=True)``.

    Args:
      inplace: write the new values into the state's own tensors (params, masters, moments,
        counts, loss scale) and return that state (a new state object over the same tensors
        only when a None gradient cut a segment). No second copy of the state is allocated;
        the params given to ``init`` (e.g. a model's) are updated in place.
      cuda_graph: capture the whole step (reduction, update, loss-scale adjustment) in one
        CUDA graph and replay it (``mode="reduce-overhead"``). Needs ``inplace=True``: the
        state's tensors and the grads are marked as static addresses, so keep passing the
        same state and the same grad tensors (e.g. ``grad_buffers(state)``), change
        hyperparameters with ``set_hyperparams(..., inplace=True)``, and clone ``info`` if
        you keep it past the next step (replay overwrites it).
      mode, dynamic, backend: passed to ``torch.compile``. ``dynamic=False`` (the default)
        specialises kernels to the buffers' lengths.

    Where Dynamo would not compile (its tracing disabled, or a TorchDispatchMode such as
    ``FlopCounterMode`` active) the step runs eagerly, as :func:`fp16fx.step`.

    The returned callable gives the numbers of :func:`fp16fx.step` but for two roundings:
    the gradient norm's sum of squares (another order: a last-bit difference a clip carries
    into the update) and Adam's square root (eager's on x86 CPUs is not correctly rounded);
    docs/functional.md, "In place or pure".
    """
    # Checked here, not at the first step, where torch.compile would raise its own errors.
    if dynamic not in (None, True, False):
        raise TypeError(f"dynamic must be None, True or False, got {dynamic!r}")
    modes = torch._inductor.list_mode_options()
    if mode is not None and mode not in modes:
        raise ValueError(f"unknown mode {mode!r}; torch.compile knows {sorted(modes)}")
    if isinstance(backend, str) and backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(
            f"unknown backend {backend!r}; torch.compile's backends include "
            f"{torch._dynamo.list_backends()}"
        )
    if cuda_graph:
        if not inplace:
            raise ValueError("cuda_graph=True needs inplace=True: a graph replays fixed addresses")
        if mode not in (None, "reduce-overhead"):
            raise ValueError(f"cuda_graph=True is mode='reduce-overhead'; got mode={mode!r} too")
        mode = "reduce-overhead"
    options = {"fullgraph": True, "dynamic": dynamic, "mode": mode, "backend": backend}
    return StepFunction(inplace=inplace, compile_options=options, cuda_graph=cuda_graph)


def _refuse_aliases(prepared: Prepared, grads: Any) -> None:
    """Raises ValueError, naming the grad, if a gradient the core reads shares a storage with
    a tensor it writes: an in-place step could overwrite it while reading it. (A storage, not
    the bytes: views of one buffer are refused even where they do not overlap. Empty storages
    hold no memory to share; they all have address 0.)"""
    leaves = optree.tree_leaves(prepared.trained)
    written = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
    written.discard(0)  # empty storages
    layout = prepared.state.layout
    active = [seg for seg, on in zip(layout.segments, prepared.active) if on]
    for seg, g in zip(active, prepared.grads):
        if g.untyped_storage().data_ptr() in written:
            leaf = layout.buckets[seg.bucket].indices[seg.lo]
            name = tree.leaf_names(grads, root="grads")[leaf]
            raise ValueError(
                f"{name} shares a storage with the state (its params, masters or moments): "
                "an in-place step could overwrite it while reading it. Pass a copy, or use "
                "the pure fp16fx.step"
            )


def _mark_static(tensors: list[Any]) -> None:
    """Marks each tensor as a static input (once), so graph replay reads it in place
    instead of copying it into the graph's own input buffers every step."""
    for t in tensors:
        # The attribute mark_static_address sets; checking it keeps repeat calls cheap.
        if isinstance(t, torch.Tensor) and getattr(t, "_dynamo_static_input_type", None) is None:
            torch._dynamo.mark_static_address(t)
