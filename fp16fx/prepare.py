"""The host-side bookkeeping around the pure step: checking grads, cutting segments, rebuilding.

Layer: ``step`` (docs/design.md). :func:`prepare` checks a step's grads against the state and
gathers what the core reads and writes (:class:`Trained`, one entry per segment that has a
gradient), cutting a segment where only some of its leaves have a gradient; :func:`finish`
rebuilds the state from the core's results. Both run on the host, outside the compiled region,
and neither changes a value the core computes.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import torch

from fp16fx import dtensors, flat, tree
from fp16fx.consensus import Consensus
from fp16fx.precision import Precision
from fp16fx.scaling import LossScalePolicy, LossScaleState
from fp16fx.segments import Segments, merge, select
from fp16fx.state import MixedPrecisionState, check_state, recut
from fp16fx.transforms import GradientTransformation

#: Flat buffers (``flat.new_buffer``'s) reused every step, with their views: per (bucket,
#: device), one that grads are packed into; per (bucket, segment, device) whose params are
#: not one flat tensor, one they are packed into.
Scratch = dict[Hashable, tuple[torch.Tensor, list[torch.Tensor]]]


class Trained(NamedTuple):
    """The tensors a step reads and writes, one entry per segment that has a gradient.

    Attributes:
      params: the flat FP16/BF16 params to check against their masters and to write (for
        leaves that are not one flat tensor, a flat copy: :func:`_core_params`); None where
        the param is its own master (FP32), or when not gathered (a check).
      masters, opt_state, loss_scale, count: as in :class:`~fp16fx.state.MixedPrecisionState`
        (a compensated state's masters are its params' corrections: :mod:`fp16fx.precision`).
    """

    params: Segments
    masters: Segments
    opt_state: Any
    loss_scale: LossScaleState
    count: torch.Tensor


class CoreArgs(NamedTuple):
    """The arguments of the core (``step.apply_updates`` and ``apply_updates_``), in order.

    Attributes:
      optimizer, policy, consensus, precision: the state's own.
      places: per active segment, its bucket and its start in the bucket's flat buffer
        (where its per-value rounding noise is drawn from).
      grads, trained: :class:`Prepared`'s.
    """

    optimizer: GradientTransformation
    policy: LossScalePolicy
    consensus: Consensus | None
    precision: Precision
    places: tuple[tuple[int, int], ...]
    grads: Segments
    trained: Trained


class Prepared(NamedTuple):
    """A step's inputs, checked and gathered on the host (:func:`prepare`).

    Attributes:
      state: the state, with segments cut so that each has a gradient for all or none of its
        leaves (the given state when no cut was needed).
      active: per segment of ``state``, whether it has gradients this step.
      targets: per segment, the one flat tensor its params are views of, which the step
        writes itself (for FP32 params: the master itself), or None: an in-place step copies
        such a segment's new values into its params after (:func:`finish`).
      grads: the active segments' flat gradients.
      trained: the active segments' tensors.
    """

    state: MixedPrecisionState
    active: tuple[bool, ...]
    targets: tuple[torch.Tensor | None, ...]
    grads: Segments
    trained: Trained

    def core_args(self) -> CoreArgs:
        """Returns the arguments of the core (``apply_updates`` and ``apply_updates_``)."""
        state = self.state
        places = tuple(
            (seg.bucket, state.bucket_starts[seg.bucket] + seg.start)
            for seg, active in zip(state.layout.segments, self.active)
            if active
        )
        return CoreArgs(
            optimizer=state.optimizer,
            policy=state.policy,
            consensus=state.consensus,
            precision=state.precision,
            places=places,
            grads=self.grads,
            trained=self.trained,
        )


def prepare(state: MixedPrecisionState, grads: Any) -> Prepared:
    """Returns the step's inputs after checking ``grads`` against ``state``'s params
    (:func:`gathered` of :func:`checked`).

    Raises:
      TypeError: ``state`` is no MixedPrecisionState; ValueError, TypeError: the grads do
        not fit the params (named). Nothing is changed.
    """
    return gathered(checked(state, grads))


def checked(state: MixedPrecisionState, grads: Any, scratch: Scratch | None = None) -> Prepared:
    """Returns the step's inputs after checking ``grads`` against ``state``'s params, with
    params that are not one flat tensor not yet gathered (:func:`gathered`): nothing of the
    state's has been written.

    Grads laid out like the state's buckets (``grad_buffers``) prove themselves valid by
    their addresses: one check per leaf, no copy. Any other grads get the full check, leaf by
    leaf, and are packed into one flat buffer per bucket (``scratch``'s, reused from step to
    step, when given). A leaf whose grad is None, in a segment whose other leaves have one,
    gets a segment of its own (the state is cut; a compiled step compiles once per new
    pattern of which segments have a gradient).

    Raises:
      TypeError: ``state`` is no MixedPrecisionState; ValueError, TypeError: the grads do
        not fit the params (named). Nothing is changed.
    """
    check_state(state, "step")
    layout = state.layout
    grads = _local_grads(state, grads)
    flats = _laid_out(state, grads)
    if flats is None:
        leaves = tree.check_grads(state.params, grads)
        has = [g is not None for g in leaves]
        cut = layout.recut(has)
        if cut != layout:
            state, layout = recut(state, cut), cut
        active = tuple(has[layout.buckets[s.bucket].indices[s.lo]] for s in layout.segments)
        grad_list = _segment_grads(layout, leaves, active, scratch)
    else:
        active = (True,) * len(layout.segments)
        grad_list = [flats[s.bucket][s.start : s.stop] for s in layout.segments]
    seg_grads = Segments(grad_list, [s.label for s, on in zip(layout.segments, active) if on])
    targets = _targets(state)
    params, masters = _core_params(state, active, targets, scratch, gather=False)
    trained = Trained(
        params=params,
        masters=masters,
        opt_state=select(state.opt_state, active),
        loss_scale=state.loss_scale,
        count=state.count,
    )
    return Prepared(state, active, targets, seg_grads, trained)


def gathered(prepared: Prepared, scratch: Scratch | None = None) -> Prepared:
    """Returns :func:`checked`'s ``prepared`` with the params that are not one flat tensor
    gathered into one (:func:`_core_params`; in place, FP32 ones into their masters)."""
    state = prepared.state
    params, masters = _core_params(state, prepared.active, prepared.targets, scratch, gather=True)
    return prepared._replace(trained=prepared.trained._replace(params=params, masters=masters))


def _targets(state: MixedPrecisionState) -> tuple[torch.Tensor | None, ...]:
    """Per segment, the one flat tensor its params are views of (None: they are not)."""
    layout = state.layout
    return tuple(
        flat.joined_segment(layout, seg, p) for seg, p in zip(layout.segments, state.param_segments)
    )


def _core_params(
    state: MixedPrecisionState,
    active: tuple[bool, ...],
    targets: Sequence[torch.Tensor | None],
    scratch: Scratch | None,
    gather: bool,
) -> tuple[Segments, Segments]:
    """Returns the params and masters the core reads, one per active segment.

    A segment whose params are one flat tensor gives it (None where it is FP32: its own
    master). Unless ``gather`` is False (not yet, or a check, which reads only the grads),
    the leaves of any other are packed, so that the core adopts a value written into them
    since the last step (docs/design.md, step 3) as it does a flat param's, and a pure step
    compiles one graph, not a second one for the flat params it returns: FP16/BF16 leaves
    into a flat buffer (``scratch``'s, reused, in place), which the core writes the new
    params into and :func:`finish` copies to the leaves; FP32 leaves, their own masters, into
    their master (in place) or a copy of it (pure).
    """
    layout = state.layout
    params, masters = [], []
    for seg, on, target, given, master in zip(
        layout.segments, active, targets, state.param_segments, state.master_segments
    ):
        if not on:
            continue
        bucket = layout.buckets[seg.bucket]
        fp32 = bucket.dtype == torch.float32
        if target is None and gather:
            if scratch is None:  # pure: a new flat tensor
                target, views = flat.new_buffer(bucket, master.device, seg)
            elif fp32:  # in place: into their own master
                target, views = master, flat.views(bucket, master, seg.lo, seg.hi)
            else:
                key = (bucket, seg, master.device)  # a Segment alone names no dtype
                if key not in scratch:
                    scratch[key] = flat.new_buffer(bucket, master.device, seg)
                target, views = scratch[key]
            with torch.no_grad():
                flat.copy_all(views, given)
        params.append(None if target is None or fp32 else target)
        masters.append(target if fp32 and target is not None else master)
    labels = [s.label for s, on in zip(layout.segments, active) if on]
    return Segments(params, labels), Segments(masters, labels)


def _local_grads(state: MixedPrecisionState, grads: Any) -> Any:
    """Returns ``grads`` with DTensor leaves as their local shards, after checking that the
    state steps shards (made by ``init`` from DTensor params)."""
    local, mesh, _ = dtensors.local_shards(grads, root="grads")
    if mesh is not None:
        consensus = state.consensus
        if consensus is None or not consensus.sharded:
            raise ValueError(
                f"the grads are DTensors on {mesh}, but this state was not made from DTensor "
                "params of that mesh (fp16fx.init(dict(model.named_parameters()), ...))"
            )
    return local


def _segment_grads(
    layout: flat.Layout,
    leaves: list[torch.Tensor | None],
    active: tuple[bool, ...],
    scratch: Scratch | None,
) -> list[torch.Tensor]:
    """Returns each active segment's flat gradient, over its state's span (padding
    included): a view where its grads are one flat tensor (a single leaf always is; a padded
    bucket's last segment needs a buffer of the bucket's own, ``flat.flat_view``), else a
    slice of the bucket's packed grads."""
    packed: dict[int, torch.Tensor] = {}
    out = []
    for s, on in zip(layout.segments, active):
        if not on:
            continue
        bucket = layout.buckets[s.bucket]
        own = flat.flat_view(bucket, leaves, s.lo, s.hi) if s.hi - s.lo < len(bucket) else None
        if own is None:
            if s.bucket not in packed:
                packed[s.bucket] = _pack(bucket, leaves, scratch)
            own = packed[s.bucket][s.start : s.stop]
        out.append(own)
    return out


def _laid_out(state: MixedPrecisionState, grads: Any) -> list[torch.Tensor | None] | None:
    """Returns one flat grad per bucket when ``grads`` are views laid out like the buckets
    (every trained leaf has one, of its param's dtype and device; a padded bucket's in a
    padded buffer of its own, ``flat.flat_view``), else None."""
    layout = state.layout
    leaves, treedef = tree.flatten(grads)
    if treedef != layout.treedef:
        return None
    device = state.count.device
    flats: list[torch.Tensor | None] = []
    for bucket in layout.buckets:
        found = flat.flat_view(bucket, leaves)
        if found is None or found.dtype != bucket.dtype or found.device != device:
            return None
        flats.append(found)
    trained = sum(len(bucket) for bucket in layout.buckets)
    given = sum(map(operator.is_not, leaves, itertools.repeat(None)))
    if given != trained:  # a grad for an untrained leaf
        return None
    return flats


def _pack(
    bucket: flat.Bucket, leaves: list[torch.Tensor | None], scratch: Scratch | None
) -> torch.Tensor:
    """Returns the bucket's grads as one flat tensor: their own buffer when they are views of
    one, else a copy (into ``scratch``'s buffer for the bucket, when given)."""
    if all(leaves[i] is not None for i in bucket.indices):
        found = flat.flat_view(bucket, leaves)
        if found is not None:
            return found
    if scratch is None:
        return flat.pack(bucket, leaves)
    device = next(leaves[i] for i in bucket.indices if leaves[i] is not None).device
    key = (bucket, device)  # one step function may step states of one layout on two devices
    if key not in scratch:
        scratch[key] = flat.new_buffer(bucket, device)
    buffer, views = scratch[key]
    return flat.pack(bucket, leaves, out=buffer, out_views=views)


def finish(prepared: Prepared, new: Trained | None) -> MixedPrecisionState:
    """Returns the state after the step: ``new``'s values merged into a new state (pure), or,
    with ``new=None`` (the core wrote in place), the prepared state after copying the new
    params into params that are not one flat tensor, from the flat ones the core wrote
    (:func:`_core_params`)."""
    state, active = prepared.state, prepared.active
    if new is None:
        layout = state.layout
        segments = [k for k, on in enumerate(active) if on]
        core = zip(segments, prepared.trained.params, prepared.trained.masters)
        with torch.no_grad():
            for k, written, master in core:
                if prepared.targets[k] is None:  # one more pass over them
                    seg = layout.segments[k]
                    source = master if written is None else written
                    views = flat.views(layout.buckets[seg.bucket], source, seg.lo, seg.hi)
                    flat.copy_all(state.param_segments[k], views)
        return state
    params = Segments(
        [m if p is None else p for p, m in zip(new.params, new.masters)], new.params.labels
    )
    return state.replace(
        param_segments=merge(state.param_segments, params, active),
        master_segments=merge(state.master_segments, new.masters, active),
        opt_state=merge(state.opt_state, new.opt_state, active),
        loss_scale=new.loss_scale,
        count=new.count,
    )
