"""The training state: ``MixedPrecisionState``, ``init``, ``recut`` and ``grad_buffers``.

Layer: ``step`` (docs/design.md). The state is a pytree of tensors; the optimizer, the
loss-scale policy, the consensus, the :class:`~fp16fx.flat.Layout`, the precision and the
buckets' starts are static pytree metadata, so they travel with it and never become graph
inputs. ``init``'s arguments are checked first, in :mod:`fp16fx.init_arguments`.

Whatever the tree of params, the state keeps the FP32 masters and the optimizer's moments in
flat buffers, one per *segment* of the layout (a run of leaves of one dtype and label; one per
bucket until leaves step apart), so a compiled step sees a few large tensors however many
leaves there are, and compiles in the same time. The params are kept as given: as views of a
flat buffer when they are (``buckets=True`` makes them so), else as the leaves themselves.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import optree
import torch

from fp16fx import flat, tree
from fp16fx.consensus import Consensus
from fp16fx.flat import Layout
from fp16fx.init_arguments import checked_arguments, mesh_consensus
from fp16fx.precision import (
    Precision,
    correction_dtype,
    decode_master,
    decode_moments,
    encode_moments,
)
from fp16fx.scaling import LossScalePolicy, LossScaleState
from fp16fx.segments import Segments, split
from fp16fx.transforms import GradientTransformation
from fp16fx.transforms.base import check_kept

_CHILDREN = ("param_segments", "master_segments", "opt_state", "loss_scale", "count")
_META = ("optimizer", "policy", "layout", "consensus", "precision", "bucket_starts")
FP32 = Precision()  # FP32 masters and moments: the default


class MixedPrecisionState:
    """The whole training state: a pytree of tensors with static optimizer, policy and layout.

    Attributes:
      param_segments: per segment of ``layout``, its model-dtype params: one flat tensor where
        they are views of one (``init(..., buckets=True)`` makes them so, a pure step returns
        them so), else the tuple of its leaves as given.
      master_segments: per segment, the flat FP32 master (a flat FP32 param is its own); in a
        compensated state, the FP16/BF16 params' integer corrections instead
        (:mod:`fp16fx.precision`).
      opt_state: the optimizer's state (its per-param parts: one entry per segment).
      loss_scale: the loss-scale policy's :class:`~fp16fx.scaling.LossScaleState`.
      count: applied (not skipped) steps, a 0-d int64 tensor.
      optimizer, policy: the transform and the loss-scale policy (pytree metadata).
      layout: the :class:`~fp16fx.flat.Layout` of the params: buckets and segments.
      consensus: ``None``, or a :class:`~fp16fx.consensus.Consensus` agreeing ``finite`` and
        the gradient norm with other processes before any state changes (pytree metadata).
      precision: the :class:`~fp16fx.precision.Precision` the masters and moments are stored
        in (pytree metadata).
      bucket_starts: per bucket of ``layout``, where its first value sits in the flat buffer
        it is a slice of: ``rank * s`` for a ZeRO shard's slice (:mod:`fp16fx.distributed`),
        else 0 (pytree metadata). Compact precision's dither hashes each value's place in
        that whole buffer, so a value rounds alike however the state is cut or sharded.

    ``params`` and ``master`` present the params and masters structured as given to ``init``.
    """

    __slots__ = (*_CHILDREN, *_META, "_views")

    def __init__(
        self,
        *,
        param_segments: Segments,
        master_segments: Segments,
        opt_state: Any,
        loss_scale: LossScaleState,
        count: torch.Tensor,
        optimizer: GradientTransformation,
        policy: LossScalePolicy,
        layout: Layout,
        consensus: Consensus | None = None,
        precision: Precision = FP32,
        bucket_starts: tuple[int, ...] | None = None,
    ) -> None:
        self.param_segments = param_segments
        self.master_segments = master_segments
        self.opt_state = opt_state
        self.loss_scale = loss_scale
        self.count = count
        self.optimizer = optimizer
        self.policy = policy
        self.layout = layout
        self.consensus = consensus
        self.precision = precision
        self.bucket_starts = bucket_starts or (0,) * len(layout.buckets)
        self._views: dict[str, Any] = {}

    @property
    def params(self) -> Any:
        """The params, structured as given to ``init`` (``None`` at untrained leaves)."""
        if "params" not in self._views:
            self._views["params"] = self._tree(self.param_segments)
        return self._views["params"]

    @property
    def master(self) -> Any:
        """The FP32 masters, structured as the params (views of the flat masters; in a
        compensated state decoded anew at each read, copies of the values at that moment)."""
        if self.precision.compensated:  # never cached: in-place steps and loads move them
            return self._tree(self.decoded_masters())
        if "master" not in self._views:
            self._views["master"] = self._tree(self.decoded_masters())
        return self._views["master"]

    def decoded_masters(self) -> Segments:
        """Returns per segment the FP32 master (the stored one, or a compensated one decoded)."""
        if not self.precision.compensated:
            return self.master_segments
        decoded = [
            m if p.dtype == torch.float32 else decode_master(p, m)
            for p, m in zip(self.flat_params(), self.master_segments)
        ]
        return Segments(decoded, self.master_segments.labels)

    def flat_params(self) -> list[torch.Tensor]:
        """Returns per segment its params as one flat tensor (a compensated state's always
        are; elsewhere a segment of separate leaves raises)."""
        out = []
        for seg, params in zip(self.layout.segments, self.param_segments):
            joined = flat.joined_segment(self.layout, seg, params)
            if joined is None:
                raise ValueError("the params of a segment are not one flat tensor")
            out.append(joined)
        return out

    def _tree(self, per_segment: Segments) -> Any:
        leaves: list[Any] = [None] * self.layout.num_leaves
        for seg, value in zip(self.layout.segments, per_segment):
            bucket = self.layout.buckets[seg.bucket]
            parts = value if isinstance(value, tuple) else flat.views(bucket, value, seg.lo, seg.hi)
            for i, part in zip(bucket.indices[seg.lo : seg.hi], parts):
                leaves[i] = part
        return tree.unflatten(self.layout.treedef, leaves)

    def replace(self, **changes: Any) -> MixedPrecisionState:
        """Returns a copy of this state with the given fields changed."""
        fields = {name: getattr(self, name) for name in (*_CHILDREN, *_META)}
        fields.update(changes)
        return MixedPrecisionState(**fields)

    def __copy__(self) -> MixedPrecisionState:
        return self.replace()

    def __deepcopy__(self, memo: dict[int, Any]) -> MixedPrecisionState:
        children = copy.deepcopy({name: getattr(self, name) for name in _CHILDREN}, memo)
        return self.replace(**children)

    def __reduce__(self) -> Any:
        raise TypeError(
            "a MixedPrecisionState cannot be pickled (it holds functions); save "
            "fp16fx.state_dict(state) with torch.save and load it with fp16fx.load_state_dict"
        )

    def __repr__(self) -> str:
        n = sum(b.numel for b in self.layout.buckets)
        segments = len(self.layout.segments)
        return (
            f"MixedPrecisionState({n:,} trained values in {segments} segment(s), "
            f"count={self.count.tolist()}, loss_scale={self.loss_scale.scale.tolist()}, "
            f"policy={self.policy}, precision={self.precision})"
        )


optree.register_pytree_node(
    MixedPrecisionState,
    lambda s: (
        tuple(getattr(s, name) for name in _CHILDREN),
        tuple(getattr(s, name) for name in _META),
        _CHILDREN,
    ),
    lambda meta, children: MixedPrecisionState(
        **dict(zip(_CHILDREN, children)), **dict(zip(_META, meta))
    ),
    namespace=optree.registry.__GLOBAL_NAMESPACE,  # plain optree calls see its tensors
)


def check_state(state: Any, caller: str) -> None:
    """Raises TypeError naming ``caller`` unless ``state`` is a MixedPrecisionState: a slip
    such as passing the params, or ``step``'s arguments swapped, would otherwise surface as
    an AttributeError from deep inside."""
    if not isinstance(state, MixedPrecisionState):
        sharded = isinstance(getattr(state, "shard", None), MixedPrecisionState)
        hint = " (a sharded state: pass its .shard, or use fp16fx.distributed's own call)"
        raise TypeError(
            f"{caller} expects the state fp16fx.init returns, got a {type(state).__name__}"
            + (hint if sharded else "")
        )


def init(
    params: Any,
    optimizer: GradientTransformation,
    loss_scale: LossScalePolicy | None = None,
    *,
    buckets: bool = False,
    consensus: Consensus | None = None,
    master: str = "fp32",
    moments: str = "fp32",
) -> MixedPrecisionState:
    """Returns the initial training state for ``params``.

    Args:
      params: any pytree of FP16, BF16 or FP32 tensors on one device; ``None`` leaves are not
        trained. The tensors are kept, not copied: an in-place step writes into them.
      optimizer: a transform such as ``fp16fx.adam(1e-3)``.
      loss_scale: a policy; by default ``DynamicLossScale()`` when any param is FP16, else
        ``NoLossScale()`` (BF16 has FP32's exponent range and needs no scaling).
      buckets: move the params into one flat buffer per dtype (and ``multi_transform``
        label) and re-point each given tensor at its view (``tensor.data = view``), so that a
        module built on them keeps training in place and the step writes the params in its
        fused pass. Pass the module's own parameters, not detached copies. Without it, the
        masters and moments are flat all the same, and an in-place step packs the given
        tensors into a flat buffer before its fused pass and copies the new values back
        after it (two more passes over the params).
      consensus: agree "finite" and the gradient norm with other processes every step
        (``fp16fx.distributed.init`` sets it; see :class:`fp16fx.consensus.Consensus`).
      master: ``"fp32"`` (an FP32 master per FP16/BF16 param) or ``"compensated"`` (none: the
        param and a short correction carry it; needs the params in flat buffers, e.g.
        ``buckets=True``). See :mod:`fp16fx.precision` and docs/precision.md.
      moments: how the optimizer's per-element state is stored: ``"fp32"``, ``"bf16"`` or
        ``"int8"`` (block-wise; with ``buckets``, or params already so laid out, each flat
        buffer is padded with zeros to whole blocks, whose state is its last segment's).

    DTensor params (an FSDP2 model's ``dict(model.named_parameters())``, sharded on a 1-D
    mesh; :mod:`fp16fx.dtensors`): the state is over their local shards (``state.params``),
    views of FSDP's storage that are never moved or packed; each leaf is a segment of its own,
    so an FP32 shard is its own master and an FP16/BF16 one, compensated, its own flat tensor.
    The consensus is the sharded one over the mesh's process group (or a given
    ``Consensus(group, sharded=True)`` over as many processes). ``buckets`` must be False.

    Raises:
      TypeError, ValueError: the params cannot be trained (or hold one tensor twice), the
        optimizer, policy or precision is not one, ``buckets`` is not a bool, or a compensated
        state's params are not flat or all FP32 (the message names it); nothing is changed.
        TypeError: the optimizer's ``init`` returned a tensor that is not per param
        (:func:`~fp16fx.transforms.base.check_kept`), found once it has run: with
        ``buckets`` the params are then in flat buffers, their values unchanged.
    """
    args = checked_arguments(
        params, optimizer, loss_scale, buckets=buckets, master=master, moments=moments
    )
    leaves, precision, layout = args.leaves, args.precision, args.layout
    if args.mesh is not None:
        consensus = mesh_consensus(consensus, args.mesh, args.group, buckets)
    device = next(p.device for p in leaves if p is not None)
    with torch.no_grad():
        if buckets:
            flats: list[Any] = flat.adopt(layout, leaves)
        else:  # the leaves as given, as one flat tensor where they are one
            flats = [flat.flat_view(bucket, leaves) for bucket in layout.buckets]
        params_of, masters = [], []
        packed: dict[int, torch.Tensor] = {}  # per bucket, its FP32 masters, where copied
        for seg in layout.segments:
            bucket, buffer = layout.buckets[seg.bucket], flats[seg.bucket]
            if buffer is not None:
                own: torch.Tensor | None = buffer[seg.start : seg.stop]
            else:
                own = flat.flat_view(bucket, leaves, seg.lo, seg.hi)
            if own is None:
                params_of.append(tuple(leaves[i] for i in bucket.indices[seg.lo : seg.hi]))
            else:
                params_of.append(own)
            if own is not None and bucket.dtype == torch.float32:
                masters.append(own)  # an FP32 param is its own master
            elif precision.compensated:  # the param is its master: nothing to correct yet
                assert own is not None  # check_compensable_layout
                masters.append(torch.zeros_like(own, dtype=correction_dtype(bucket.dtype)))
            else:
                if seg.bucket not in packed:
                    packed[seg.bucket] = flat.pack(bucket, leaves, torch.float32)
                masters.append(packed[seg.bucket][seg.start : seg.stop])
        labels = [s.label for s in layout.segments]
        state = MixedPrecisionState(
            param_segments=Segments(params_of, labels),
            master_segments=Segments(masters, labels),
            opt_state=(),
            loss_scale=args.policy.init(device),
            count=torch.zeros((), dtype=torch.int64, device=device),
            optimizer=optimizer,
            policy=args.policy,
            layout=layout,
            consensus=consensus,
            precision=precision,
        )
        opt_state = optimizer.init(state.decoded_masters())
        check_kept(opt_state)
        state.opt_state = encode_moments(opt_state, precision)
    if not buckets:
        # The caller's own tensors, not views of them, in containers of the state's own: a
        # tensor the caller later puts into its dict is not one the state steps.
        state._views["params"] = tree.unflatten(args.treedef, leaves)
    return state


def recut(state: MixedPrecisionState, layout: Layout) -> MixedPrecisionState:
    """Returns ``state`` over ``layout``, whose segment boundaries include the state's own.

    Nothing is copied: a segment cut in two becomes two views of its buffers (step counts and
    other per-segment scalars are duplicated), so each part can step on its own. Block-wise
    int8 moments are the exception: their blocks start with their segment, so they are
    decoded, cut and encoded again (new tensors; one more rounding of those moments).
    """
    if layout == state.layout:
        return state
    params, masters = state.param_segments, state.master_segments
    # A block-quantized moment's blocks start where its segment starts: cut it decoded.
    quantized = state.precision.moments == "int8"
    opt_state = decode_moments(state.opt_state, state.precision) if quantized else state.opt_state
    old = state.layout.segments
    for k in reversed(range(len(old))):
        seg = old[k]
        inner = [c for c in layout.cuts[seg.bucket] if seg.lo <= c <= seg.hi]
        if inner == [seg.lo, seg.hi]:
            continue
        bucket = state.layout.buckets[seg.bucket]
        runs = list(itertools.pairwise(inner))
        sizes = [bucket.stop(b) - bucket.offsets[a] for a, b in runs]
        entry = params[k]
        masters = split(masters, k, sizes)
        if isinstance(entry, tuple):
            parts: list[Any] = [entry[a - seg.lo : b - seg.lo] for a, b in runs]
            if bucket.dtype == torch.float32:  # leaves now one flat tensor: their own master,
                # as init makes them (the in-place step writes that tensor, not a copy)
                mine = list(masters.items)
                for j, (a, b) in enumerate(runs):
                    own = flat.joined(parts[j], bucket.shapes[a:b], bucket.offsets[a : b + 1])
                    if own is not None:
                        parts[j] = mine[k + j] = own
                masters = Segments(mine, masters.labels)
        else:
            parts = list(entry.split(sizes))
        params = Segments(
            [*params.items[:k], *parts, *params.items[k + 1 :]],
            [*params.labels[:k], *[params.labels[k]] * len(parts), *params.labels[k + 1 :]],
        )
        opt_state = split(opt_state, k, sizes)
    if quantized:
        opt_state = encode_moments(opt_state, state.precision)
    return state.replace(
        param_segments=params, master_segments=masters, opt_state=opt_state, layout=layout
    )


def grad_buffers(state: MixedPrecisionState) -> Any:
    """Returns zeroed gradients structured like ``state.params``, as views into flat buffers.

    The buffers are laid out like the state's buckets, padding included (int8 moments pad
    them to whole blocks; the step keeps the padding zero), so a step reads them without
    copying. Make them the ``.grad`` of the model's params (autograd then accumulates into
    them in place)::

        state = fp16fx.init(dict(model.named_parameters()), fp16fx.adam(), buckets=True)
        grads = fp16fx.grad_buffers(state)
        for name, p in model.named_parameters():
            p.grad = grads[name]
    """
    check_state(state, "grad_buffers")
    layout = state.layout
    leaves: list[torch.Tensor | None] = [None] * layout.num_leaves
    device = state.count.device
    for bucket in layout.buckets:
        _, bucket_views = flat.new_buffer(bucket, device, zeroed=True)
        for i, view in zip(bucket.indices, bucket_views):
            leaves[i] = view
    return tree.unflatten(layout.treedef, leaves)
