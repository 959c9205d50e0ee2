"""Flat per-(group, dtype) buffers that a model's params and grads live in (stateful).

Layer: ``facade`` (DESIGN.md): the one place that owns buffers. A :class:`FlatBucket` copies the
params of one param group and one dtype back to back into a flat param buffer and rebinds each
param to a view of it (``p.data = view``, as FSDP's flat parameters do); their grads get the same
treatment in a flat grad buffer (``p.grad = view``). Autograd accumulates into an existing
``p.grad`` in place, so after ``backward`` a bucket's whole gradient sits in one tensor and the
compiled step sees a few large tensors, however many params the model has.

A grad stays a view as long as nobody replaces it: ``zero_grad()`` zeroes the buffers in place.
When a grad is set to None (``zero_grad(set_grads_to_None=True)``, ``model.zero_grad()``) or
assigned by the user, the next :meth:`FlatBucket.collect_grads` copies the new gradient into the
buffer and re-binds ``p.grad`` to its view: one extra read and write of that gradient.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch

from fp16fx import buckets, tree


class FlatBucket:
    """One param group's params of one dtype, stored in a flat buffer, grads in another.

    Attributes:
      group: the index of the param group the params belong to.
      params: the model's params (their ``.data`` are views of ``param_buffer``).
      param_buffer, grad_buffer: flat 1-D tensors of the params' dtype, zero-padded to a
        multiple of ``multiple`` values (a sharded optimizer's d slices; the padding stays 0).
      offsets: ``params[i]`` occupies ``[offsets[i], offsets[i + 1])`` of each buffer.
      grad_views: ``grad_views[i]`` is ``params[i]``'s view of ``grad_buffer``.
    """

    def __init__(self, group: int, params: Sequence[torch.Tensor], multiple: int = 1) -> None:
        if not params:
            raise ValueError("a FlatBucket needs at least one param")
        self.group = group
        self.params = list(params)
        self.dtype = self.params[0].dtype
        self.device = self.params[0].device
        leaves, treedef = tree.flatten(self.params)
        (layout,) = buckets.plan(leaves, treedef).buckets  # one dtype: one bucket
        self.offsets = [*layout.offsets, layout.numel]
        with torch.no_grad():
            self.param_buffer = buckets.pack(layout, leaves, self.dtype, multiple)
            self.grad_buffer = torch.zeros_like(self.param_buffer)
            self.grad_views = buckets.views(layout, self.grad_buffer)
            for p, view, grad_view in zip(
                self.params, buckets.views(layout, self.param_buffer), self.grad_views
            ):
                p.data = view
                if p.grad is not None:
                    grad_view.copy_(p.grad)
                    p.grad = grad_view
        self._addresses = [p.data_ptr() for p in self.params]

    def spans(self) -> list[tuple[int, int]]:
        """Returns ``[(start, end)]``: each param's range in the flat buffers."""
        return list(itertools.pairwise(self.offsets))

    def __len__(self) -> int:
        return len(self.params)

    def check_params(self, names: Mapping[int, str]) -> None:
        """Raises RuntimeError if a param's data no longer lives in ``param_buffer``.

        ``names``: ``{id(param): name}``, read only for the error (a lookup per param per
        step would cost more than the check).
        """
        for p, address in zip(self.params, self._addresses):
            if p.data_ptr() != address or p.dtype != self.dtype:
                raise RuntimeError(
                    f"{names.get(id(p), 'a param')} no longer lives in FP16_Optimizer's flat "
                    "buffer: its .data was replaced (e.g. by model.half(), model.to(...), or "
                    "load_state_dict(..., assign=True)) after the optimizer was built. Convert "
                    "and move the model first, then build the FP16_Optimizer."
                )

    def collect_grads(self) -> list[bool]:
        """Returns, per param, whether it has a gradient now; moves stray grads into the buffer.

        A ``p.grad`` that is not this bucket's view (set to None and recreated by autograd, or
        assigned) is copied into the buffer and ``p.grad`` re-bound to the view.
        """
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

    def zero_grads(self, set_to_none: bool) -> None:
        """Zeroes every grad in place (one kernel), or sets every ``p.grad`` to None.

        Zeroing keeps apex's rule that a None grad stays None; a grad that exists but is not a
        view is replaced by its (zeroed) view.
        """
        if set_to_none:
            for p in self.params:
                p.grad = None
            return
        self.grad_buffer.zero_()
        for p, view in zip(self.params, self.grad_views):
            if p.grad is not None and p.grad is not view:
                p.grad = view


#: The dtypes of a param group's flat buckets, in the order they are made.
BUCKET_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def group_buckets(
    group: int, params: Sequence[torch.Tensor], multiple: int = 1
) -> list[FlatBucket]:
    """Returns param group ``group``'s flat buckets: one per dtype its ``params`` have, in
    :data:`BUCKET_DTYPES` order, each padded to a multiple of ``multiple`` values."""
    return [
        FlatBucket(group, same, multiple)
        for dtype in BUCKET_DTYPES
        if (same := [p for p in params if p.dtype == dtype])
    ]
