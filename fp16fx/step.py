"""The mixed-precision step: a pure function of ``(state, grads)``.

Layer: ``step`` (DESIGN.md). One step, for the leaves that have a gradient::

    scaled grads g, scale s
    u, finite, norm = unscale_and_check(g, s)     # one reduction pass
    updates, opt'   = optimizer.update(u, ...)    # FP32 math on the masters
    master'         = master + updates
    param'          = master'.to(param.dtype)
    keep every old value where not finite         # torch.where: no host sync, exact skip
    loss_scale'     = policy.adjust(loss_scale, finite)

Nothing is mutated; the in-place variant (``fp16fx.compile_step(inplace=True)``) writes the
same values into the state's own tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from fp16fx import buckets, tree
from fp16fx.buckets import Layout
from fp16fx.consensus import Consensus
from fp16fx.scaling import LossScalePolicy, LossScaleState, unscale_and_check
from fp16fx.state import MixedPrecisionState
from fp16fx.transforms import GradientTransformation, replace_hyperparams

Info = dict[str, torch.Tensor]


def scale_loss(state: MixedPrecisionState, loss: torch.Tensor) -> torch.Tensor:
    """Returns ``loss`` in FP32 times the current loss scale (backpropagate through this)."""
    return loss.float() * state.loss_scale.scale


def set_hyperparams(
    state: MixedPrecisionState, *, inplace: bool = False, **values: float
) -> MixedPrecisionState:
    """Returns ``state`` with hyperparameters changed, e.g. ``set_hyperparams(state, lr=1e-4)``.

    Names: ``lr``, ``weight_decay``, ``beta1``, ``beta2``, ``eps``, ``momentum``,
    ``dampening``, ``max_norm``, as the optimizer has them. The values are tensors in the state,
    so a compiled step is not recompiled. ``inplace=True`` overwrites the existing tensors
    (for CUDA-graph replay, which reads fixed addresses) and returns the same state.
    """
    hp = replace_hyperparams(state.opt_state.hyperparams, values, inplace=inplace)
    if inplace:
        return state
    return state.replace(opt_state=state.opt_state._replace(hyperparams=hp))


def apply_updates(
    optimizer: GradientTransformation,
    policy: LossScalePolicy,
    grads: list[torch.Tensor],
    params: list[torch.Tensor | None],
    masters: list[torch.Tensor],
    leaf_states: list[Any],
    hyperparams: Any,
    loss_scale: LossScaleState,
    count: torch.Tensor,
    indices: tuple[int, ...],
    consensus: Consensus | None = None,
) -> tuple[
    list[torch.Tensor | None], list[torch.Tensor], list[Any], LossScaleState, torch.Tensor, Info
]:
    """Returns the stepped ``(params, masters, leaf_states, loss_scale, count, info)``.

    The pure core over flat lists of the leaves that have a gradient (``params[i]`` is None
    where the param is FP32 and so its own master; ``indices`` are their flat leaf indices).
    This is what ``compile_step`` compiles. ``consensus``, when given, replaces this
    process's ``(finite, grad_norm)`` by the one all processes agree on, before anything moves.
    """
    unscaled, finite, grad_norm = unscale_and_check(grads, loss_scale.scale)
    if consensus is not None:
        finite, grad_norm = consensus(finite, grad_norm)
    updates, new_states = optimizer.update(
        unscaled, leaf_states, masters, hyperparams, grad_norm, indices
    )

    def keep_if_skipped(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        return torch.where(finite, new, old)

    new_masters = [keep_if_skipped(m + u, m) for m, u in zip(masters, updates)]
    # A param is always its master rounded (``init`` makes it so and every step keeps it so),
    # so rounding the selected master writes an unchanged param on a skip without reading the
    # old one: 2 of the fused pass's 32 bytes per param.
    new_params = [None if p is None else m.to(p.dtype) for p, m in zip(params, new_masters)]
    new_states = optree.tree_map(keep_if_skipped, new_states, leaf_states)
    new_loss_scale, floored = policy.adjust(loss_scale, finite)
    info = {
        "finite": finite,
        "loss_scale": loss_scale.scale.clone(),  # an in-place step overwrites the state's
        "grad_norm": grad_norm,
        "loss_scale_floored": floored,
    }
    return (
        new_params,
        new_masters,
        new_states,
        new_loss_scale,
        keep_if_skipped(count + 1, count),
        info,
    )


def apply_updates_(
    optimizer: GradientTransformation,
    policy: LossScalePolicy,
    grads: list[torch.Tensor],
    params: list[torch.Tensor | None],
    masters: list[torch.Tensor],
    leaf_states: list[Any],
    hyperparams: Any,
    loss_scale: LossScaleState,
    count: torch.Tensor,
    indices: tuple[int, ...],
    consensus: Consensus | None = None,
) -> Info:
    """Returns ``info`` after writing :func:`apply_updates`' results into its own inputs."""
    *new, info = apply_updates(
        optimizer,
        policy,
        grads,
        params,
        masters,
        leaf_states,
        hyperparams,
        loss_scale,
        count,
        indices,
        consensus,
    )
    old = (params, masters, leaf_states, loss_scale, count)
    optree.tree_map(lambda dst, src: dst.copy_(src), old, tuple(new))
    return info


Core = Callable[..., Any]


def run_step(
    core: Core, state: MixedPrecisionState, grads: Any, *, inplace: bool
) -> tuple[MixedPrecisionState, Info]:
    """Returns ``core`` applied to the leaves of ``state`` that have a gradient in ``grads``.

    Validates ``grads`` first (nothing is touched when they do not fit), gathers the flat
    lists ``core`` takes, and scatters its results back into a new state (or, ``inplace``,
    lets ``core`` write them into ``state``'s tensors and returns ``state``).

    A bucketed state runs ``core`` on its flat buffers. Its grads are used in place when they
    are views laid out like the bucket (as :func:`grad_buffers` makes them); other grads are
    first copied into a flat buffer, one extra pass over them.
    """
    layout = state.layout
    if layout is None:
        grad_leaves = tree.check_grads(state.params, grads)
        params, treedef = tree.flatten(state.params)
        masters = treedef.flatten_up_to(state.master)
        leaf_states = treedef.flatten_up_to(state.opt_state.leaves)
        active = [i for i, g in enumerate(grad_leaves) if g is not None]
        grad_list = [grad_leaves[i] for i in active]
        indices = tuple(active)
    else:
        params, masters = list(state.children()[0]), list(state.children()[1])
        leaf_states = list(state.children()[2].leaves)
        active = list(range(len(layout.buckets)))
        grad_list = _bucket_grads(state, grads)
        indices = layout.first_indices
    args = (
        state.optimizer,
        state.policy,
        grad_list,
        [None if params[i].dtype == torch.float32 else params[i] for i in active],
        [masters[i] for i in active],
        [leaf_states[i] for i in active],
        state.children()[2].hyperparams,
        state.loss_scale,
        state.count,
        indices,
        state.consensus,
    )
    with torch.no_grad():
        if inplace:
            return state, core(*args)
        new_params, new_masters, new_states, loss_scale, count, info = core(*args)
    for slot, i in enumerate(active):
        masters[i] = new_masters[slot]
        params[i] = new_masters[slot] if new_params[slot] is None else new_params[slot]
        leaf_states[i] = new_states[slot]
    if layout is None:
        params = tree.unflatten(treedef, params)
        masters = tree.unflatten(treedef, masters)
        leaf_states = tree.unflatten(treedef, leaf_states)
    new_state = state.replace(
        params=params,
        master=masters,
        opt_state=state.children()[2]._replace(leaves=leaf_states),
        loss_scale=loss_scale,
        count=count,
    )
    return new_state, info


def _bucket_grads(state: MixedPrecisionState, grads: Any) -> list[torch.Tensor]:
    """Returns one flat grad per bucket of ``state``, after checking ``grads`` fit it.

    Grads laid out like the buckets (``grad_buffers``) prove themselves valid by their layout:
    one address check per leaf. Any other grads get the full check, leaf by leaf, and are
    packed into new flat buffers.
    """
    layout, params = state.layout, state.children()[0]
    leaves, treedef = tree.flatten(grads)
    if treedef == layout.treedef:
        flats = [buckets.flat_view(bucket, leaves) for bucket in layout.buckets]
        # flat_view checked shapes and that each bucket's grads share one storage (so one
        # device and dtype); untrained (None) params must have None grads.
        trained = sum(len(bucket.indices) for bucket in layout.buckets)
        if (
            all(
                f is not None and f.dtype == p.dtype and f.device == p.device
                for f, p in zip(flats, params)
            )
            and sum(g is not None for g in leaves) == trained
        ):
            return flats
    leaves = tree.check_grads(state.params, grads)
    _check_whole_buckets(layout, leaves, grads)
    flats = []
    for bucket, param in zip(layout.buckets, params):
        flat = buckets.flat_view(bucket, leaves)
        flats.append(buckets.pack(bucket, leaves, param.dtype) if flat is None else flat)
    return flats


def _check_whole_buckets(layout: Layout, leaves: list[torch.Tensor | None], grads: Any) -> None:
    """Raises ValueError if a trained leaf of a bucketed state has no gradient.

    A bucket keeps one step count for all its leaves, so it can only step as a whole: letting
    one leaf sit out would still advance that leaf's count (torch.optim would not).
    """
    for bucket in layout.buckets:
        for i in bucket.indices:
            if leaves[i] is None:
                raise ValueError(
                    f"{tree.leaf_names(grads, root='grads')[i]} is None, but a bucketed state "
                    "(init(..., buckets=True)) steps whole buckets; pass a zero gradient, or "
                    "use buckets=False for leaves that sometimes have no gradient"
                )


def step(state: MixedPrecisionState, grads: Any) -> tuple[MixedPrecisionState, Info]:
    """Returns ``(new_state, info)`` after one mixed-precision step; never mutates its inputs.

    ``grads`` has the structure of ``state.params`` and holds the gradients of the *scaled*
    loss (``scale_loss``) in the params' dtypes; a ``None`` grad leaves that param and its
    optimizer state untouched. When any grad holds inf or NaN the step is skipped exactly
    (every value bitwise unchanged) and only the loss-scale state moves.

    ``info`` holds 0-d tensors (nothing is synced to the host): ``finite``, ``loss_scale``
    (the scale these grads carry), ``grad_norm`` (global L2 norm of the unscaled grads) and
    ``loss_scale_floored`` (an overflow found the scale already at its minimum).
    """
    return run_step(apply_updates, state, grads, inplace=False)
