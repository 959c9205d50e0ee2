"""The training state: ``MixedPrecisionState``, ``init``, and bucketed layouts.

Layer: ``step`` (DESIGN.md), with :mod:`fp16fx.step`. The state is a pytree of tensors; the
optimizer, the loss-scale policy and (for a bucketed state) the layout of its flat buffers are
static pytree metadata, so they travel with it and never become graph inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optree
import torch

from fp16fx import buckets, tree
from fp16fx.buckets import Layout
from fp16fx.consensus import Consensus
from fp16fx.scaling import DynamicLossScale, LossScalePolicy, LossScaleState, NoLossScale
from fp16fx.transforms import GradientTransformation, TransformState


class MixedPrecisionState:
    """The whole training state: a pytree of tensors with static optimizer and policy.

    Attributes:
      params: the model-dtype params (FP16, BF16 or FP32), structured as given to ``init``.
      master: FP32 master weights, same structure (an FP32 param is its own master).
      opt_state: the optimizer's :class:`~fp16fx.transforms.TransformState`.
      loss_scale: the loss-scale policy's :class:`~fp16fx.scaling.LossScaleState`.
      count: applied (not skipped) steps, a 0-d int64 tensor.
      optimizer, policy: the transform and the loss-scale policy (pytree metadata, not leaves).
      consensus: ``None``, or a :class:`~fp16fx.consensus.Consensus` agreeing ``finite`` and
        the gradient norm with other processes before any state changes (pytree metadata).
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
        (``fp16fx.distributed.init`` sets it; see :class:`fp16fx.consensus.Consensus`).
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
