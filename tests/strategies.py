"""Hypothesis strategies shared by the core's tests: random pytrees of small tensors."""

from __future__ import annotations

from typing import NamedTuple

import torch
from hypothesis import strategies as st


class Pair(NamedTuple):
    first: object
    second: object


DTYPES = (torch.float16, torch.bfloat16, torch.float32)

shapes = st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple)


@st.composite
def tensors(draw, dtypes=DTYPES):
    """A small random tensor of one of ``dtypes`` (values of moderate size)."""
    shape = draw(shapes)
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


def pytrees(dtypes=DTYPES, allow_none=True):
    """Nested dicts, lists, tuples and NamedTuples of tensors (and None leaves)."""
    leaf = tensors(dtypes)
    if allow_none:
        leaf = st.one_of(leaf, leaf, leaf, st.none())
    return st.recursive(
        leaf,
        lambda children: st.one_of(
            st.dictionaries(st.sampled_from("abcdef"), children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=3),
            st.tuples(children, children),
            st.builds(Pair, children, children),
        ),
        max_leaves=6,
    )


def has_tensor(tree) -> bool:
    import optree

    return any(isinstance(x, torch.Tensor) for x in optree.tree_leaves(tree))


def grads_like(params, seed: int, scale: float = 1.0, none_prob: float = 0.0):
    """Random grads with the structure and dtypes of ``params`` (some None if asked)."""
    import optree

    gen = torch.Generator().manual_seed(seed)

    def make(p):
        if p is None:
            return None
        if none_prob and torch.rand((), generator=gen).item() < none_prob:
            return None
        return (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)

    return optree.tree_map(make, params, none_is_leaf=True)
