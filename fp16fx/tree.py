"""Pytree helpers: flattening with ``None`` kept in place, leaf names, input validation, and
the bytes of distinct storages.

Layer: ``tree`` (docs/design.md). Knows nothing about optimizers or loss scales.

Every tree in fp16fx is flattened with ``none_is_leaf=True`` so that a ``None`` leaf ("not
trained" in params, "no gradient this step" in grads) keeps its position and the flat lists of
params, masters, grads and optimizer state stay aligned index by index.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor

PyTree = Any
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_LAYOUT = operator.attrgetter("layout")

#: Parameter dtypes fp16fx trains. FP64 is refused: its master would be less precise than it.
MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_finite(value: Any) -> bool:
    """``math.isfinite(value)`` for a real number, False (not OverflowError) for an integer
    beyond any float (``10**400``): the one check of user numbers for finiteness."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def flatten(tree: PyTree) -> tuple[list[Any], optree.PyTreeSpec]:
    """Returns ``(leaves, treedef)`` of ``tree`` with ``None`` leaves kept in place."""
    return optree.tree_flatten(tree, none_is_leaf=True)


def unflatten(treedef: optree.PyTreeSpec, leaves: Sequence[Any]) -> PyTree:
    """Returns the tree of ``treedef`` holding ``leaves`` (the inverse of :func:`flatten`)."""
    return optree.tree_unflatten(treedef, list(leaves))


def leaf_names(tree: PyTree, root: str = "params") -> list[str]:
    """Returns a readable name per flat leaf of ``tree``: the expression that reaches it,
    e.g. ``params['fc'][0]``, or ``params.bias`` in a namedtuple."""
    _, treedef = optree.tree_flatten(tree, none_is_leaf=True)
    return [accessor.codify(root) for accessor in treedef.accessors()]


def dict_order_differs(tree: PyTree) -> bool:
    """Whether ``tree`` holds a dict whose keys, as given, are not in the sorted order in
    which optree flattens them (an ``OrderedDict`` keeps its own order)."""
    if isinstance(tree, dict) and not isinstance(tree, OrderedDict):
        try:
            if list(tree) != sorted(tree):
                return True
        except TypeError:  # keys that do not compare: optree's order is its own
            return True
    children = tree.values() if isinstance(tree, Mapping) else tree
    if isinstance(tree, (Mapping, list, tuple)):
        return any(dict_order_differs(child) for child in children)
    return False


def leaf_paths(treedef: optree.PyTreeSpec) -> list[str]:
    """Returns a key per leaf of ``treedef``: its path joined by dots (``fc.weight`` for a
    dict keyed like ``named_parameters()``, ``layers.0.bias`` for nested containers), or the
    full accessor (``['a.b'][0]``) for every leaf when dots would make two keys equal. A lone
    tensor's key is ``params``."""
    paths = treedef.paths()
    keys = [".".join(str(k) for k in path) or "params" for path in paths]
    if len(set(keys)) == len(keys):
        return keys
    return [a.codify("") for a in treedef.accessors()]


def check_params(params: PyTree) -> tuple[list[torch.Tensor | None], optree.PyTreeSpec]:
    """Returns the flat leaves of ``params`` after checking they can be trained.

    Raises:
      ValueError: the tree holds no tensor, holds one tensor twice (tied weights) or two
        that overlap in memory, one whose elements overlap (an expanded view) or one made
        under ``torch.inference_mode()``, or its tensors live on several devices or on the
        meta device.
      TypeError: a leaf is neither ``None`` nor a floating tensor of a dtype in ``MODEL_DTYPES``.
    """
    leaves, treedef = flatten(params)
    names = leaf_names(params)
    for name, leaf in zip(names, leaves):
        if leaf is None:
            continue
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{name} is a {type(leaf).__name__}; every leaf must be a tensor or None"
            )
    check_trainable(names, leaves)
    if all(leaf is None for leaf in leaves):
        raise ValueError("params holds no tensor: there is nothing to train")
    return leaves, treedef


def check_trainable(
    names: Sequence[str], leaves: Sequence[torch.Tensor | None], device: torch.device | None = None
) -> None:
    """Raises, naming the tensor, unless every tensor of ``leaves`` (None ones skipped) is one
    fp16fx can train in place (:func:`_check_leaf`), no two share memory
    (:func:`check_disjoint`), and all live on one device (``device``, if given), not meta.
    The one check of trainable tensors, for ``init`` and ``FP16_Optimizer`` alike."""
    named = [(name, leaf) for name, leaf in zip(names, leaves) if leaf is not None]
    for name, leaf in named:
        _check_leaf(name, leaf)
    check_disjoint(names, leaves)
    if named:
        _check_one_device(named, device)


def _check_one_device(
    named: Sequence[tuple[str, torch.Tensor]], device: torch.device | None = None
) -> None:
    """Raises ValueError naming the first tensor of ``(name, tensor)`` pairs that lives on
    another device than ``device`` (default: the first tensor's), or on the meta device (no
    values to train)."""
    where = "the others" if device is None else "the params trained so far"
    device = device or named[0][1].device
    for name, leaf in named:
        if leaf.device != device:
            raise ValueError(
                f"{name} is on {leaf.device}, {where} on {device}: fp16fx steps one device's "
                "params per state (make one state, or FP16_Optimizer, per device)"
            )
        if leaf.device.type == "meta":
            raise ValueError(
                f"{name} is on the meta device: it holds no values to train; materialize the "
                "model first (e.g. model.to_empty(device=...), then initialize its weights)"
            )


def _check_leaf(name: str, leaf: torch.Tensor) -> None:
    """Raises, naming ``name``, unless the tensor ``leaf`` is one fp16fx can train in place:
    dense (TypeError), FP16, BF16 or FP32 (TypeError), made outside ``torch.inference_mode()``,
    and with no two elements in the same memory (ValueError)."""
    if leaf.layout != torch.strided:
        raise TypeError(
            f"{name} is a {leaf.layout} tensor; fp16fx trains dense (strided) params: pass "
            "it dense (.to_dense()), or leave it out"
        )
    if leaf.dtype not in MODEL_DTYPES:
        raise TypeError(
            f"{name} has dtype {leaf.dtype}; fp16fx trains float16, bfloat16 and float32 "
            "params (integer, bool, complex and float64 tensors cannot be trained: leave them "
            "out, or pass None in their place in a params tree)"
        )
    if leaf.is_inference():
        raise ValueError(
            f"{name} was made under torch.inference_mode(), which forbids updating it in place "
            "outside; build the model (or clone its params) outside inference mode"
        )
    if _overlaps_itself(leaf):
        raise ValueError(
            f"{name} has elements that share memory (an expanded or as_strided view, strides "
            f"{leaf.stride()}): each would be updated on its own; pass a clone"
        )


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether elements of ``t`` may share memory: taking its dims by stride, one does not
    step past everything the smaller ones span (a stride of 0, an expanded dim, does not).
    Judged by spans, as :func:`check_disjoint` is: a rare strided layout that interleaves
    without sharing an element is refused too."""
    if t.numel() == 0:  # no elements to share anything
        return False
    spanned = 0
    for stride, size in sorted((abs(st), n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride <= spanned:
            return True
        spanned += (size - 1) * stride
    return False


def check_disjoint(names: Sequence[str], leaves: Sequence[Any]) -> None:
    """Raises ValueError naming two leaves whose elements may share memory: one tensor given
    twice (tied weights), or two views of one tensor. Stepped as two params, each would get
    its own master and update, and the memory would keep whichever was written last. Judged
    by each leaf's byte span in its storage, so two strided views that interleave without
    sharing an element are refused too (a rare way to hold params)."""
    spans = []
    for order, (name, leaf) in enumerate(zip(names, leaves)):
        # FSDP2's DTensor params: each shard is a tensor of FSDP's, in storage of its own.
        if not isinstance(leaf, torch.Tensor) or isinstance(leaf, DTensor):
            continue
        if leaf.device.type == "meta" or leaf.numel() == 0:  # no memory: the object is all
            storage, low, high = ("id", id(leaf)), 0, 1
        else:
            size = leaf.element_size()
            low = high = leaf.storage_offset()
            for n, stride in zip(leaf.shape, leaf.stride()):
                low, high = low + min(0, (n - 1) * stride), high + max(0, (n - 1) * stride)
            storage = (str(leaf.device), leaf.untyped_storage().data_ptr())
            low, high = low * size, (high + 1) * size
        spans.append((storage, low, high, (order, name), _memory(leaf)))
    spans.sort(key=lambda span: span[:2])
    for (storage, _, end, one, memory), (other, start, _, two, again) in itertools.pairwise(spans):
        if storage != other or start >= end:
            continue
        (_, first), (_, second) = sorted([one, two])
        if memory == again:
            raise ValueError(
                f"{second} is the same tensor as {first}: pass each tensor once (tied "
                "weights are one param, whose gradient sums both uses)"
            )
        raise ValueError(
            f"{second} overlaps {first} in memory (views of one tensor): each would be "
            "stepped on its own and overwrite the other; pass the tensor they view once, "
            "or clone one of them"
        )


def _memory(t: torch.Tensor) -> tuple[Any, ...]:
    """Returns what identifies a tensor's elements in memory (the same for two tensor objects
    over the same elements, e.g. a param and ``param.data``)."""
    if t.device.type == "meta" or t.numel() == 0:
        return (id(t),)
    storage = t.untyped_storage().data_ptr()
    return (t.device, storage, t.storage_offset(), t.dtype, tuple(t.shape), t.stride())


def check_grads(params: PyTree, grads: PyTree) -> list[torch.Tensor | None]:
    """Returns the flat leaves of ``grads`` after checking they match ``params`` leaf by leaf.

    A ``None`` grad is allowed anywhere (that leaf is left untouched this step). Every other grad
    must have its param's shape, dtype and device. A tuple of grads fits a list of params and
    the reverse (``torch.autograd.grad`` returns a tuple).

    Raises:
      ValueError: the tree structures or a leaf's shape differ, or a grad is given for a
        ``None`` (untrained) param.
      TypeError: a grad is not a tensor, or its dtype or device differs from its param's.
    """
    sequences = (list, tuple)
    if type(params) in sequences and type(grads) in sequences and len(params) == len(grads):
        grads = type(params)(grads)
    param_leaves, param_def = flatten(params)
    grad_leaves, grad_def = flatten(grads)
    if grad_def != param_def:
        kinds = (type(params).__name__, type(grads).__name__)
        which = f" (params: {kinds[0]}, grads: {kinds[1]})" if kinds[0] != kinds[1] else ""
        raise ValueError(
            f"grads do not have the structure of params{which}:\n"
            f"  params: {param_def}\n  grads:  {grad_def}"
        )
    pairs = [(p, g) for p, g in zip(param_leaves, grad_leaves) if g is not None]
    if _all_fit(pairs):  # the common case, checked with maps over the leaves
        return grad_leaves
    for i, (param, grad) in enumerate(zip(param_leaves, grad_leaves)):
        if grad is None:
            continue
        problem = _grad_problem(param, grad)
        if problem is not None:
            error, message = problem
            raise error(f"{leaf_names(grads, root='grads')[i]} {message}")
    return grad_leaves


def _all_fit(pairs: list[tuple[Any, Any]]) -> bool:
    params, grads = [p for p, _ in pairs], [g for _, g in pairs]
    return (
        all(map(isinstance, params, itertools.repeat(torch.Tensor)))
        and all(map(isinstance, grads, itertools.repeat(torch.Tensor)))
        and list(map(_SHAPE, grads)) == list(map(_SHAPE, params))
        and list(map(_DTYPE, grads)) == list(map(_DTYPE, params))
        and list(map(_DEVICE, grads)) == list(map(_DEVICE, params))
        and set(map(_LAYOUT, grads)) <= {torch.strided}
    )


def _grad_problem(param: Any, grad: Any) -> tuple[type[Exception], str] | None:
    """Returns ``(error type, message)`` if ``grad`` cannot be ``param``'s gradient, else None.

    The leaf's name is left to the caller: naming every leaf costs more than checking it.
    """
    if param is None:
        return ValueError, "is a gradient for a None (untrained) param"
    if not isinstance(grad, torch.Tensor):
        return TypeError, f"is a {type(grad).__name__}, not a tensor"
    if grad.shape != param.shape:
        return ValueError, f"has shape {tuple(grad.shape)}, its param {tuple(param.shape)}"
    if grad.dtype != param.dtype:
        return TypeError, f"has dtype {grad.dtype}, its param {param.dtype}"
    if grad.device != param.device:
        return TypeError, f"is on {grad.device}, its param on {param.device}"
    if grad.layout != torch.strided:
        return TypeError, f"is a {grad.layout} tensor; fp16fx steps dense gradients"
    return None


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Returns the bytes of the distinct storages behind ``tensors``, each storage once (two
    views of one buffer count once; meta tensors, which hold no memory, not at all)."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        if tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        seen[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())
