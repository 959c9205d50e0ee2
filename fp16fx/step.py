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

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from fp16fx import buckets, tree
from fp16fx.buckets import Layout
from fp16fx.scaling import (
    DynamicLossScale,
    LossScalePolicy,
    LossScaleState,
    NoLossScale,
    unscale_and_check,
)
from fp16fx.transforms import GradientTransformation, TransformState, replace_hyperparams

Info = dict[str, torch.Tensor]

#: Combines this process's ``(finite, grad_norm)`` with other processes' (see
#: :class:`fp16fx.distributed.Consensus`): returns the ``(finite, grad_norm)`` every process
#: then acts on, so all of them skip or apply together. Static, hashable pytree metadata.
Consensus = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class MixedPrecisionState:
    """The whole training state: a pytree of tensors with static optimizer and policy.

    Attributes:
      params: the model-dtype params (FP16, BF16 or FP32), structured as given to ``init``.
      master: FP32 master weights, same structure (an FP32 param is its own master).
      opt_state: the optimizer's :class:`~fp16fx.transforms.TransformState`.
      loss_scale: the loss-scale policy's :class:`~fp16fx.scaling.LossScaleState`.
      count: applied (not skipped) steps, a 0-d int64 tensor.
      optimizer, policy: the transform and the loss-scale policy (pytree metadata, not leaves).
      consensus: ``None``, or a :data:`Consensus` agreeing ``finite`` and the gradient norm
        with other processes before any state changes (pytree metadata).
      layout: ``None``, or the :class:`~fp16fx.buckets.Layout` of a bucketed state, whose
        pytree leaves are a few flat buffers; ``params``, ``master`` and ``opt_state`` then
        present views into them, structured as the params were given.
    """

    __slots__ = (
        "_master",
        "_opt_state",
        "_params",
        "_views",
        "consensus",
        "count",
        "layout",
        "loss_scale",
        "optimizer",
        "policy",
    )

    def __init__(
        self,
        params: Any,
        master: Any,
        opt_state: TransformState,
        loss_scale: LossScaleState,
        count: torch.Tensor,
        optimizer: GradientTransformation,
        policy: LossScalePolicy,
        layout: Layout | None = None,
        consensus: Consensus | None = None,
    ) -> None:
        self._params = params
        self._master = master
        self._opt_state = opt_state
        self.loss_scale = loss_scale
        self.count = count
        self.optimizer = optimizer
        self.policy = policy
        self.layout = layout
        self.consensus = consensus
        self._views: dict[str, Any] = {}

    @property
    def params(self) -> Any:
        return self._present("params")

    @property
    def master(self) -> Any:
        return self._present("master")

    @property
    def opt_state(self) -> TransformState:
        return self._present("opt_state")

    def _present(self, name: str) -> Any:
        raw = getattr(self, "_" + name)
        if self.layout is None:
            return raw
        if name not in self._views:
            self._views[name] = _unbucket(self.layout, name, raw)
        return self._views[name]

    def children(self) -> tuple[Any, ...]:
        """Returns the pytree children: params, master, opt_state (raw), loss_scale, count."""
        return (self._params, self._master, self._opt_state, self.loss_scale, self.count)

    def replace(self, **changes: Any) -> MixedPrecisionState:
        """Returns a copy of this state with the given fields (raw, for a bucketed state)."""
        fields = dict(zip(_CHILDREN, self.children()))
        fields.update(
            optimizer=self.optimizer,
            policy=self.policy,
            layout=self.layout,
            consensus=self.consensus,
        )
        fields.update(changes)
        return MixedPrecisionState(**fields)

    def __repr__(self) -> str:
        n = sum(m.numel() for m in tree.flatten(self._master)[0] if m is not None)
        buckets = "" if self.layout is None else f", {len(self.layout.buckets)} buckets"
        return (
            f"MixedPrecisionState({n:,} trained values{buckets}, count={self.count.tolist()}, "
            f"loss_scale={self.loss_scale.scale.tolist()}, policy={self.policy})"
        )


_CHILDREN = ("params", "master", "opt_state", "loss_scale", "count")

optree.register_pytree_node(
    MixedPrecisionState,
    lambda s: (s.children(), (s.optimizer, s.policy, s.layout, s.consensus), _CHILDREN),
    lambda meta, children: MixedPrecisionState(*children, *meta),
    namespace=optree.registry.__GLOBAL_NAMESPACE,  # plain optree calls see its tensors
)


def _unbucket(layout: Layout, name: str, raw: Any) -> Any:
    """Returns the user-structured tree of views into the flat buffers ``raw``."""
    n_leaves = layout.treedef.num_leaves
    if name == "opt_state":
        per_leaf: list[Any] = [None] * n_leaves
        for bucket, bucket_state in zip(layout.buckets, raw.leaves):
            tensors, state_def = optree.tree_flatten(bucket_state)
            # Per-element tensors (moments) split into views; scalars (counts) are shared.
            split = [
                buckets.views(bucket, t)
                if t.ndim == 1 and t.shape[0] == bucket.numel
                else [t] * len(bucket.indices)
                for t in tensors
            ]
            for k, i in enumerate(bucket.indices):
                per_leaf[i] = state_def.unflatten([parts[k] for parts in split])
        return raw._replace(leaves=tree.unflatten(layout.treedef, per_leaf))
    leaves: list[Any] = [None] * n_leaves
    for bucket, flat in zip(layout.buckets, raw):
        for i, view in zip(bucket.indices, buckets.views(bucket, flat)):
            leaves[i] = view
    return tree.unflatten(layout.treedef, leaves)


def _default_policy(params: Sequence[torch.Tensor | None]) -> LossScalePolicy:
    if any(p is not None and p.dtype == torch.float16 for p in params):
        return DynamicLossScale()
    return NoLossScale()


def init(
    params: Any,
    optimizer: GradientTransformation,
    loss_scale: LossScalePolicy | None = None,
    *,
    buckets: bool = False,
    consensus: Consensus | None = None,
) -> MixedPrecisionState:
    """Returns the initial training state for ``params``.

    Args:
      params: any pytree of FP16, BF16 or FP32 tensors on one device; ``None`` leaves are not
        trained. The tensors are kept, not copied: an in-place step writes into them.
      optimizer: a transform such as ``fp16fx.adam(1e-3)``.
      loss_scale: a policy; by default ``DynamicLossScale()`` when any param is FP16, else
        ``NoLossScale()`` (BF16 has FP32's exponent range and needs no scaling).
      buckets: keep params, masters and optimizer moments in one flat buffer per dtype (and
        per ``multi_transform`` label), so a compiled step runs a few large kernels whatever
        the number of leaves. The given tensors are re-pointed (``tensor.data = view``) at
        their place in the buffer, so a model built on them keeps training in place.
      consensus: agree "finite" and the gradient norm with other processes every step
        (``fp16fx.distributed.init`` sets it; see :class:`fp16fx.distributed.Consensus`).
    """
    if not isinstance(optimizer, GradientTransformation):
        raise TypeError(
            f"optimizer must be an fp16fx transform such as fp16fx.adam(), got {optimizer!r}"
        )
    leaves, treedef = tree.check_params(params)
    device = next(p.device for p in leaves if p is not None)
    policy = _default_policy(leaves) if loss_scale is None else loss_scale
    if not callable(getattr(policy, "adjust", None)):
        raise TypeError(f"loss_scale must be a loss-scale policy, got {policy!r}")
    with torch.no_grad():
        layout = None
        if buckets:
            layout = bucket_layout(leaves, treedef, optimizer)
            params, leaves, indices = _into_buckets(layout, leaves)
        else:
            indices = range(len(leaves))
        masters = [
            None if p is None else p if p.dtype == torch.float32 else p.detach().float()
            for p in leaves
        ]
        leaf_states = [
            None if m is None else optimizer.init_leaf(m, i) for i, m in zip(indices, masters)
        ]
        if layout is None:
            masters = tree.unflatten(treedef, masters)
            leaf_states = tree.unflatten(treedef, leaf_states)
        return MixedPrecisionState(
            params=params,
            master=masters,
            opt_state=TransformState(optimizer.init_hyperparams(device), leaf_states),
            loss_scale=policy.init(device),
            count=torch.zeros((), dtype=torch.int64, device=device),
            optimizer=optimizer,
            policy=policy,
            layout=layout,
            consensus=consensus,
        )


def bucket_layout(
    leaves: Sequence[torch.Tensor | None], treedef: Any, optimizer: GradientTransformation
) -> Layout:
    """Returns the bucket layout for ``leaves``: one bucket per dtype and optimizer label."""
    return buckets.plan(leaves, treedef, keys=optimizer.partition)


def _into_buckets(
    layout: Layout, leaves: list[torch.Tensor | None]
) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple[int, ...]]:
    """Returns ``(flat params, the same, first leaf indices)`` after moving ``leaves`` into
    new flat buffers and re-pointing each given tensor at its view."""
    flats = []
    for bucket in layout.buckets:
        flat = buckets.pack(bucket, leaves, leaves[bucket.indices[0]].dtype)
        for i, view in zip(bucket.indices, buckets.views(bucket, flat)):
            leaves[i].data = view
        flats.append(flat)
    return flats, flats, layout.first_indices


def grad_buffers(state: MixedPrecisionState) -> Any:
    """Returns zeroed gradients structured like ``state.params``, as views into flat buffers.

    For a bucketed state the buffers are laid out like its buckets, so a step reads them
    without copying. Make them the ``.grad`` of the model's params (autograd then
    accumulates into them in place) and zero them in place between steps::

        grads = fp16fx.grad_buffers(state)
        for p, g in zip(model.parameters(), optree.tree_leaves(grads)):
            p.grad = g
    """
    leaves, treedef = tree.flatten(state.params)
    layout = state.layout or buckets.plan(leaves, treedef)
    grads: list[torch.Tensor | None] = [None] * len(leaves)
    for bucket in layout.buckets:
        first = leaves[bucket.indices[0]]
        flat = torch.zeros(bucket.numel, dtype=first.dtype, device=first.device)
        for i, view in zip(bucket.indices, buckets.views(bucket, flat)):
            grads[i] = view
    return tree.unflatten(treedef, grads)


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
    new_params = [
        None if p is None else keep_if_skipped(m.to(p.dtype), p)
        for p, m in zip(params, new_masters)
    ]
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
    grad_leaves = tree.check_grads(state.params, grads)
    layout = state.layout
    if layout is not None:
        _check_whole_buckets(layout, grad_leaves, tree.leaf_names(grads, root="grads"))
    if layout is None:
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
        grad_list = [_flat_grads(b, grad_leaves, p.dtype) for b, p in zip(layout.buckets, params)]
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


def _check_whole_buckets(
    layout: Layout, grads: list[torch.Tensor | None], names: list[str]
) -> None:
    """Raises ValueError if a trained leaf of a bucketed state has no gradient.

    A bucket keeps one step count for all its leaves, so it can only step as a whole: letting
    one leaf sit out would still advance that leaf's count (torch.optim would not).
    """
    for bucket in layout.buckets:
        for i in bucket.indices:
            if grads[i] is None:
                raise ValueError(
                    f"{names[i]} is None, but a bucketed state (init(..., buckets=True)) steps "
                    "whole buckets; pass a zero gradient, or use buckets=False for leaves that "
                    "sometimes have no gradient"
                )


def _flat_grads(
    bucket: buckets.Bucket, grads: list[torch.Tensor | None], dtype: torch.dtype
) -> torch.Tensor:
    flat = buckets.flat_view(bucket, grads)
    return buckets.pack(bucket, grads, dtype) if flat is None else flat


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
