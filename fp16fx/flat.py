"""Flat buffers: many leaves as views into a few contiguous buffers — their one owner.

Layer: ``tree`` (docs/design.md). Knows nothing about optimizers.

A compiled step over 2,000 separate tensors compiles 2,000 kernels and checks 2,000 guards per
call; over one contiguous buffer per dtype it compiles one and checks one. A :class:`Layout`
records, statically, which leaves of a tree share a :class:`Bucket` (one per dtype and label,
e.g. a param group) and where each sits, and how each bucket is cut into *segments*: runs of
consecutive leaves that an optimizer steps as one tensor (one step count each).

This module is the only place in fp16fx that re-points a tensor at a view of a flat buffer
(:func:`adopt`); :class:`FlatParams` adds the flat gradient buffers a model's params use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import operator
import weakref
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor

_SHAPE = operator.attrgetter("shape")
_GRAD = operator.attrgetter("grad")
_DTYPE = operator.attrgetter("dtype")
_LAYOUT = operator.attrgetter("layout")

#: The padded flat buffers fp16fx made, by their storage's place: the padding after a bucket's
#: last leaf is fp16fx's own only in these. A buffer of the user's that happens to be as long
#: is not one of them: what follows the leaves there is memory fp16fx was never given.
_OWN_BUFFERS: weakref.WeakValueDictionary[tuple[str, int], torch.Tensor] = (
    weakref.WeakValueDictionary()
)


def own_buffer(buffer: torch.Tensor) -> torch.Tensor:
    """Returns ``buffer``, a new flat buffer of some bucket's padded length, recorded as one
    fp16fx made (:func:`flat_view` extends a view of its leaves over its padding)."""
    _OWN_BUFFERS[_place(buffer)] = buffer
    return buffer


def _place(tensor: torch.Tensor) -> tuple[str, int]:
    storage = tensor.untyped_storage()
    return str(storage.device), storage.data_ptr()


@dataclasses.dataclass(frozen=True)
class Bucket:
    """The leaves of one dtype and label, back to back in one flat buffer.

    Attributes:
      dtype, label: what the leaves share (``label`` is e.g. a param group; None if unused).
      indices: the leaves' positions among the tree's flat leaves, in buffer order.
      offsets: ``len(indices) + 1`` element offsets: leaf ``k`` is ``[offsets[k], offsets[k+1])``.
      shapes: the leaves' shapes.
      padded: the buffer's length: the leaves' total, rounded up to the layout's multiple
        (whole slices for sharding, whole int8 blocks for int8 moments; zeros after).
    """

    dtype: torch.dtype
    label: Hashable
    indices: tuple[int, ...]
    offsets: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    padded: int

    @property
    def numel(self) -> int:
        """The number of values the leaves hold (the buffer's length without padding)."""
        return self.offsets[-1]

    def __len__(self) -> int:
        return len(self.indices)

    def stop(self, hi: int) -> int:
        """Returns where the state of a segment ending before leaf ``hi`` ends: that leaf's
        offset, or after the last leaf the padded length (the padding's state is the last
        segment's)."""
        return self.padded if hi == len(self.indices) else self.offsets[hi]


@dataclasses.dataclass(frozen=True)
class Segment:
    """Leaves ``[lo, hi)`` of bucket ``bucket``, at ``[start, end)`` of its flat buffer.

    The segment's state spans ``[start, stop)``: the bucket's last segment also owns the
    buffer's padding (``stop`` is ``bucket.padded``; elsewhere ``stop == end``), so that the
    state of a bucket padded to whole int8 blocks is whole blocks (fp16fx.precision).
    """

    bucket: int
    lo: int
    hi: int
    start: int
    end: int
    stop: int
    label: Hashable

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Layout:
    """A static plan of flat buckets for the leaves of a tree, and their cut into segments.

    Attributes:
      treedef: the tree's structure (``None`` leaves are in no bucket: they are not trained).
      buckets: one per (dtype, label), in the order first seen.
      cuts: per bucket, the leaf positions where its segments start, then ``len(bucket)``.
    """

    treedef: optree.PyTreeSpec
    buckets: tuple[Bucket, ...]
    cuts: tuple[tuple[int, ...], ...]

    @functools.cached_property
    def segments(self) -> tuple[Segment, ...]:
        """Every segment, bucket by bucket (made once: the step's bookkeeping reads them
        several times a step)."""
        return tuple(
            Segment(
                bucket=b,
                lo=lo,
                hi=hi,
                start=bucket.offsets[lo],
                end=bucket.offsets[hi],
                stop=bucket.stop(hi),
                label=bucket.label,
            )
            for b, (bucket, cut) in enumerate(zip(self.buckets, self.cuts))
            for lo, hi in itertools.pairwise(cut)
        )

    @property
    def num_leaves(self) -> int:
        return self.treedef.num_leaves

    def marks(self) -> list[int]:
        """Returns, per flat leaf, the index in :attr:`segments` of the segment that holds it
        (-1: in no bucket): ``recut(marks())`` is this layout."""
        marks = [-1] * self.num_leaves
        for k, seg in enumerate(self.segments):
            for i in self.buckets[seg.bucket].indices[seg.lo : seg.hi]:
                marks[i] = k
        return marks

    def recut(self, marks: Sequence[Hashable]) -> Layout:
        """Returns this layout with a segment boundary wherever ``marks[i]`` (one per flat
        leaf) changes within a bucket, beside the boundaries it had."""
        cuts = []
        for bucket, cut in zip(self.buckets, self.cuts):
            at = {0, len(bucket), *cut}
            at |= {
                k
                for k in range(1, len(bucket))
                if marks[bucket.indices[k]] != marks[bucket.indices[k - 1]]
            }
            cuts.append(tuple(sorted(at)))
        return dataclasses.replace(self, cuts=tuple(cuts))


def plan(
    leaves: Sequence[torch.Tensor | None],
    treedef: optree.PyTreeSpec,
    labels: Sequence[Hashable] | None = None,
    multiple: int = 1,
) -> Layout:
    """Returns a layout putting leaves of equal dtype (and equal ``labels[i]``) in one bucket,
    one segment per bucket, each buffer padded to a multiple of ``multiple`` values."""
    groups: dict[tuple[torch.dtype, Hashable], list[int]] = {}
    for i, leaf in enumerate(leaves):
        if leaf is not None:
            groups.setdefault((leaf.dtype, None if labels is None else labels[i]), []).append(i)
    buckets = []
    for (dtype, label), indices in groups.items():
        shapes = tuple(tuple(leaves[i].shape) for i in indices)
        offsets = (0, *itertools.accumulate(math.prod(s) for s in shapes))
        padded = math.ceil(offsets[-1] / multiple) * multiple
        buckets.append(
            Bucket(
                dtype=dtype,
                label=label,
                indices=tuple(indices),
                offsets=offsets,
                shapes=shapes,
                padded=padded,
            )
        )
    cuts = tuple((0, len(b)) for b in buckets)
    return Layout(treedef, tuple(buckets), cuts)


def views(
    bucket: Bucket, flat: torch.Tensor, lo: int = 0, hi: int | None = None
) -> list[torch.Tensor]:
    """Returns leaves ``[lo, hi)`` of ``bucket`` as views into ``flat``, which holds the
    bucket's buffer from its leaf ``lo`` on (the whole buffer, or a segment of it)."""
    hi = len(bucket) if hi is None else hi
    sizes = [bucket.offsets[k + 1] - bucket.offsets[k] for k in range(lo, hi)]
    rest = flat.numel() - (bucket.offsets[hi] - bucket.offsets[lo])
    parts = flat.split([*sizes, rest]) if rest else flat.split(sizes)
    return list(map(torch.Tensor.view, parts[: hi - lo], bucket.shapes[lo:hi]))


def new_buffer(
    bucket: Bucket, device: torch.device, segment: Segment | None = None, *, zeroed: bool = False
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Returns a new flat buffer of ``bucket``'s dtype on ``device``, and its leaves' views:
    the whole bucket, padding included (recorded as fp16fx's own: :func:`own_buffer`), or the
    leaves of one ``segment`` of it; filled with zeros where ``zeroed``, else left for a copy
    to fill."""
    make = torch.zeros if zeroed else torch.empty
    if segment is None:
        buffer = own_buffer(make(bucket.padded, dtype=bucket.dtype, device=device))
        return buffer, views(bucket, buffer)
    buffer = make(segment.numel, dtype=bucket.dtype, device=device)
    return buffer, views(bucket, buffer, segment.lo, segment.hi)


def pack(
    bucket: Bucket,
    leaves: Sequence[torch.Tensor | None],
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    out_views: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Returns a flat buffer (``out``, or a new one of ``bucket.padded`` values of ``dtype``,
    the bucket's by default) holding the bucket's leaves picked from ``leaves``; zeros where a
    leaf is None and in the padding. ``out_views`` are ``views(bucket, out)``, if known."""
    if out is None:
        first = next(leaves[i] for i in bucket.indices if leaves[i] is not None)
        out = own_buffer(
            torch.empty(bucket.padded, dtype=dtype or bucket.dtype, device=first.device)
        )
    targets = views(bucket, out) if out_views is None else out_views
    picked = [leaves[i] for i in bucket.indices]
    with torch.no_grad():
        out[bucket.numel :].zero_()
        present = [(t, leaf) for t, leaf in zip(targets, picked) if leaf is not None]
        copy_all([t for t, _ in present], [leaf for _, leaf in present])
        for target, leaf in zip(targets, picked):
            if leaf is None:
                target.zero_()
    return out


#: Tensors of at least this many elements are copied one by one (each copy uses every
#: thread); smaller ones in one ``_foreach_copy_`` (one call, whose CPU kernel runs on one).
_LARGE = 1 << 16


def copy_all(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """Copies each of ``srcs`` into the same-shaped tensor of ``dsts`` (casting the dtype)."""
    small = [(d, s) for d, s in zip(dsts, srcs) if d.numel() < _LARGE]
    if small:
        torch._foreach_copy_([d for d, _ in small], [s for _, s in small])
    for d, s in zip(dsts, srcs):
        if d.numel() >= _LARGE:
            d.copy_(s)


def flat_view(
    bucket: Bucket, leaves: Sequence[Any], lo: int = 0, hi: int | None = None
) -> torch.Tensor | None:
    """Returns the flat tensor that leaves ``[lo, hi)`` of ``bucket`` (picked from the tree's
    flat ``leaves``) are views of, or None (see :func:`joined`).

    It spans the state of their segment (``bucket.stop(hi)``): after a padded bucket's last
    leaf, the padding too, zeroed (no leaf covers it); then it is None unless the storage is
    exactly one padded buffer of the bucket that fp16fx made, as ``fp16fx.grad_buffers`` and
    :class:`FlatParams` make them (:func:`own_buffer`).
    """
    hi = len(bucket) if hi is None else hi
    found = joined(
        [leaves[i] for i in bucket.indices[lo:hi]],
        bucket.shapes[lo:hi],
        bucket.offsets[lo : hi + 1],
    )
    if found is None or bucket.stop(hi) == bucket.offsets[hi]:
        return found
    return _over_padding(bucket, found, bucket.offsets[lo])


def joined(
    tensors: Sequence[Any],
    shapes: Sequence[tuple[int, ...]],
    offsets: Sequence[int] | None = None,
) -> torch.Tensor | None:
    """Returns the flat tensor that ``tensors`` are consecutive views of, or None.

    True when every one is a contiguous tensor of one dtype, of its shape in ``shapes``, and
    they sit in order back to back in one storage (``offsets``: where each starts, relative,
    and where the last ends, if known). The check reads addresses and shapes only (no data),
    each a ``map`` over the tensors rather than a Python loop: ~0.2 µs a tensor.
    """
    if not all(map(isinstance, tensors, itertools.repeat(torch.Tensor))):
        return None
    if set(map(_LAYOUT, tensors)) != {torch.strided}:  # sparse: no addresses to compare
        return None
    if offsets is None:
        offsets = tuple(itertools.accumulate((math.prod(s) for s in shapes), initial=0))
    first = tensors[0]
    addresses = list(map(torch.Tensor.data_ptr, tensors))
    size = first.element_size()
    expected = _byte_offsets(tuple(offsets), size)
    anchor = 0  # the tensor whose storage the flat tensor is read from
    if 0 in addresses:  # a zero-size tensor's address is 0 wherever it sits: skip it
        anchor = next((k for k, t in enumerate(tensors) if t.numel()), 0)
        at = addresses[anchor] - expected[anchor]
        addresses = [at + e if a == 0 else a for a, e in zip(addresses, expected)]
    start = addresses[anchor] - expected[anchor]
    if (
        list(map(operator.sub, addresses, itertools.repeat(start))) != expected
        or list(map(_SHAPE, tensors)) != list(shapes)  # torch.Size equals a tuple
        or set(map(_DTYPE, tensors)) != {first.dtype}
        or not all(map(torch.Tensor.is_contiguous, tensors))
    ):
        return None
    numel = offsets[-1] - offsets[0]
    head = tensors[anchor]
    offset = head.storage_offset() - (offsets[anchor] - offsets[0])
    if offset < 0 or offset + numel > head.untyped_storage().nbytes() // size:
        return None
    return head.detach().as_strided((numel,), (1,), offset)


def joined_segment(layout: Layout, seg: Segment, params: Any) -> torch.Tensor | None:
    """Returns a segment's params as one flat tensor: ``params`` itself where it is one,
    else its leaves :func:`joined` (None when they are not consecutive views of one)."""
    if isinstance(params, torch.Tensor):
        return params
    bucket = layout.buckets[seg.bucket]
    return joined(params, bucket.shapes[seg.lo : seg.hi], bucket.offsets[seg.lo : seg.hi + 1])


def whole_storage(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Returns one flat tensor over the storage that ``tensors`` (contiguous, of one dtype, in
    any order) exactly tile, or None."""
    first = tensors[0]
    if any(t.dtype != first.dtype or not t.is_contiguous() for t in tensors):
        return None
    spans = sorted((t.storage_offset(), t.storage_offset() + t.numel()) for t in tensors)
    n = first.untyped_storage().nbytes() // first.element_size()
    tiled = spans[0][0] == 0 and spans[-1][1] == n
    if not tiled or any(a[1] != b[0] for a, b in itertools.pairwise(spans)):
        return None
    return first.detach().as_strided((n,), (1,), 0)


def _over_padding(bucket: Bucket, view: torch.Tensor, start: int) -> torch.Tensor | None:
    """Returns ``view`` (1-D: the bucket's values from offset ``start`` to its last leaf's end)
    extended over the bucket's padding, with that padding zeroed (no leaf covers it), when
    its storage is exactly one padded buffer of the bucket that fp16fx made
    (:func:`own_buffer`: ``fp16fx.grad_buffers``', :class:`FlatParams`'); else None."""
    own = _OWN_BUFFERS.get(_place(view))
    if own is None or own.numel() != bucket.padded or view.storage_offset() != start:
        return None
    extended = view.as_strided((bucket.padded - start,), (1,), start)
    # Through .data: the padding is no gradient's, so no version counter moves (the facade
    # reads them to tell whether the gradients changed since it last saw them).
    extended.data[bucket.numel - start :].zero_()
    return extended


# Run, not traced, where a torch.compile of one's own wraps the step: Dynamo would trace
# through the cache and warn (the addresses read beside it break the graph anyway).
@torch._dynamo.disable
@functools.lru_cache(maxsize=256)
def _byte_offsets(offsets: tuple[int, ...], size: int) -> list[int]:
    """Returns where each of consecutive tensors starting at ``offsets`` (elements of
    ``size`` bytes) begins, in bytes from the first."""
    return [(o - offsets[0]) * size for o in offsets[:-1]]


def adopt(layout: Layout, leaves: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """Returns one new flat buffer per bucket holding the leaves, after re-pointing each given
    tensor at its view (``leaf.data = view``, as FSDP's flat parameters do), so a module built
    on them reads and trains the buffer in place."""
    flats = []
    with torch.no_grad():
        for bucket in layout.buckets:
            flat = pack(bucket, leaves)
            for i, view in zip(bucket.indices, views(bucket, flat)):
                leaves[i].data = view
            flats.append(flat)
    return flats


@contextlib.contextmanager
def put_back_on_failure(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Runs the block; where it raises, re-points each param's ``.data`` and ``.grad`` at the
    tensors they were before it: a build that moved them into flat buffers
    (:class:`FlatParams`) and then refused leaves the model on its own storage, unchanged (the
    move copies out of it). DTensor params (FSDP2's, which stay where FSDP keeps them) are
    left alone."""
    held = [(p, p.data, p.grad) for p in params if not isinstance(p, DTensor)]
    try:
        yield
    except BaseException:
        for p, data, grad in held:
            p.data, p.grad = data, grad
        raise


def first_sparse_grad(params: Sequence[torch.Tensor]) -> int | None:
    """Returns the index of the first param whose gradient is not dense (a flat buffer holds
    dense ones only), else None."""
    return next(
        (i for i, p in enumerate(params) if p.grad is not None and p.grad.layout != torch.strided),
        None,
    )


def _refuse_sparse_grads(params: Sequence[torch.Tensor]) -> None:
    i = first_sparse_grad(params)
    if i is not None:
        raise TypeError(f"param {i} has a {params[i].grad.layout} gradient, not a dense one")


class FlatParams:
    """A model's params moved into flat buffers, with flat gradient buffers as their ``.grad``.

    Stateful: it re-points each param's ``.data`` at its view of a per-(dtype, label) param
    buffer and makes ``p.grad`` a view of a matching grad buffer. Autograd accumulates into an
    existing ``p.grad`` in place, so after ``backward`` each bucket's whole gradient sits in
    one tensor, however many params there are.

    A grad stays a view as long as nobody replaces it; :meth:`collect_grads` copies a grad that
    was set to None and recreated by autograd, or assigned, back into the buffer (one extra
    read and write of that grad) and re-binds ``p.grad``.

    Attributes:
      params: the params, flat list (their ``.data`` are views of ``param_buffers``).
      layout: the :class:`Layout` of ``params`` (one segment per bucket).
      param_buffers, grad_buffers: one flat buffer per bucket, ``bucket.padded`` long.
      grad_views: per param, its view of its grad buffer.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        labels: Sequence[Hashable] | None = None,
        multiple: int = 1,
    ) -> None:
        self.params = list(params)
        _refuse_sparse_grads(self.params)  # before anything moves
        leaves, treedef = optree.tree_flatten(self.params, none_is_leaf=True)
        self.layout = plan(leaves, treedef, labels, multiple)
        with torch.no_grad():
            self.param_buffers = adopt(self.layout, self.params)
        self.grad_buffers = []
        self.grad_views: list[torch.Tensor] = [None] * len(self.params)  # type: ignore[list-item]
        for bucket, param_buffer in zip(self.layout.buckets, self.param_buffers):
            grad_buffer, grad_views = new_buffer(bucket, param_buffer.device, zeroed=True)
            self.grad_buffers.append(grad_buffer)
            for i, view in zip(bucket.indices, grad_views):
                self.grad_views[i] = view
        for p, view in zip(self.params, self.grad_views):
            if p.grad is not None:
                with torch.no_grad():
                    view.copy_(p.grad)
                p.grad = view
        self._grad_addresses = list(map(torch.Tensor.data_ptr, self.grad_views))
        self._addresses = [p.data_ptr() for p in self.params]
        self._dtypes = [p.dtype for p in self.params]

    def moved(self) -> int | None:
        """Returns the index of the first param whose ``.data`` left its buffer (replaced by
        ``model.half()``, ``.to(...)``, ``load_state_dict(assign=True)``...), else None."""
        addresses = list(map(torch.Tensor.data_ptr, self.params))
        dtypes = list(map(_DTYPE, self.params))
        if addresses == self._addresses and dtypes == self._dtypes:
            return None
        if dtypes == self._dtypes and addresses == self._view_addresses():
            # The buffers moved whole, their views with them (model.share_memory() after the
            # build moves each storage into shared memory in place)
            self._addresses = addresses
            return None
        return next(
            i
            for i, (a, d) in enumerate(zip(addresses, dtypes))
            if a != self._addresses[i] or d != self._dtypes[i]
        )

    def _view_addresses(self) -> list[int]:
        """Returns where each param's view of its buffer begins now (0 for a zero-size one,
        as ``data_ptr`` gives)."""
        addresses = [0] * len(self.params)
        for bucket, flat in zip(self.layout.buckets, self.param_buffers):
            base, size = flat.data_ptr(), flat.element_size()
            for k, i in enumerate(bucket.indices):
                empty = bucket.offsets[k + 1] == bucket.offsets[k]
                addresses[i] = 0 if empty else base + bucket.offsets[k] * size
        return addresses

    def collect_grads(self) -> list[bool]:
        """Returns, per param, whether it has a gradient now; moves stray grads into the buffer.

        Raises:
          TypeError: a param's gradient is sparse (a flat buffer holds dense ones), before
            anything is moved.
        """
        grads = list(map(_GRAD, self.params))
        if all(map(operator.is_, grads, self.grad_views)):  # the usual case: all are views
            return [True] * len(grads)
        _refuse_sparse_grads(self.params)
        has_grad = []
        for p, view in zip(self.params, self.grad_views):
            grad = p.grad
            if grad is None:
                has_grad.append(False)
                continue
            if grad is not view:
                with torch.no_grad():
                    view.copy_(grad)
                p.grad = view
            has_grad.append(True)
        return has_grad

    def grads(self) -> list[torch.Tensor | None]:
        """Returns, per param, its grad view (None where the param has no gradient)."""
        return [view if has else None for view, has in zip(self.grad_views, self.collect_grads())]

    def zero_grads(self, set_to_none: bool) -> None:
        """Zeroes every grad in place (one kernel per bucket), or sets every ``p.grad`` to None.

        Zeroing keeps apex's rule that a None grad stays None; a grad that exists but is not a
        view is replaced by its (zeroed) view. Set to None, the buffers are zeroed too, so a
        param left without a gradient never brings old values into a step that packs it.
        """
        for flat in self.grad_buffers:
            flat.zero_()
        if list(map(torch.Tensor.data_ptr, self.grad_views)) != self._grad_addresses:
            self._view_grads_again()
        for p, view in zip(self.params, self.grad_views):
            if set_to_none:
                p.grad = None
            elif p.grad is not None and p.grad is not view:
                p.grad = view

    def _view_grads_again(self) -> None:
        """Makes every grad view one of its buffer again: ``p.grad.data = x`` gives the view
        object itself other storage, and autograd would then accumulate there, never zeroed."""
        for bucket, flat in zip(self.layout.buckets, self.grad_buffers):
            for i, view in zip(bucket.indices, views(bucket, flat)):
                if self.grad_views[i].data_ptr() != view.data_ptr():
                    self.grad_views[i] = view
        self._grad_addresses = list(map(torch.Tensor.data_ptr, self.grad_views))


def shard_slice(bucket: Bucket, rank: int, world_size: int) -> slice:
    """Returns rank ``rank``'s equal slice of ``bucket``'s padded buffer (of ``world_size``)."""
    size = bucket.padded // world_size
    return slice(rank * size, (rank + 1) * size)
