"""Bucketed states: the same numbers as per-leaf states, views back, grads used in place."""

from __future__ import annotations

import optree
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import fp16fx
from fp16fx import buckets
from tests.strategies import grads_like, has_tensor, pytrees
from tests.test_step import OPTIMIZERS, bitwise_equal


def _clone(tree):
    return optree.tree_map(lambda p: p.clone(), tree)


@given(params=pytrees(), opt=st.sampled_from(sorted(OPTIMIZERS)), seed=st.integers(0, 2**16))
def test_a_bucketed_state_steps_bitwise_like_a_per_leaf_one(params, opt, seed):
    assume(has_tensor(params))
    policy = fp16fx.StaticLossScale(16.0)
    flat = fp16fx.init(_clone(params), OPTIMIZERS[opt](), policy, buckets=True)
    leafy = fp16fx.init(_clone(params), OPTIMIZERS[opt](), policy)
    assert len(optree.tree_leaves(flat.params)) == len(optree.tree_leaves(leafy.params))
    for i in range(3):
        grads = grads_like(params, seed + i, scale=16.0)
        if i == 1:
            next(iter(optree.tree_leaves(grads))).view(-1)[0] = float("nan")
        flat, _ = fp16fx.step(flat, grads)
        leafy, _ = fp16fx.step(leafy, grads)
    assert flat.layout is not None
    for field in ("params", "master", "opt_state"):
        if opt == "adamw+clip":  # the global norm sums in another order: an ulp apart
            for a, b in zip(*(optree.tree_leaves(getattr(s, field)) for s in (flat, leafy))):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        else:
            assert bitwise_equal(getattr(flat, field), getattr(leafy, field)), field


def test_bucketing_repoints_the_given_tensors_and_keeps_one_buffer_per_dtype():
    params = {"w": torch.randn(3, 2).half(), "b": torch.randn(2).half(), "f": torch.randn(4)}
    original = params["w"]
    state = fp16fx.init(params, fp16fx.adam(), fp16fx.NoLossScale(), buckets=True)
    flats = state.children()[0]
    assert [f.dtype for f in flats] == [torch.float16, torch.float32]
    assert [f.numel() for f in flats] == [8, 4]
    # optree orders dict keys: "b" (2 values) comes before "w" in the FP16 bucket.
    assert params["w"] is original and params["w"].data_ptr() == flats[0].data_ptr() + 2 * 2
    assert params["b"].data_ptr() == flats[0].data_ptr()
    assert state.params["f"].data_ptr() == state.master["f"].data_ptr()  # FP32: own master
    mu = state.opt_state.leaves["b"][1].mu
    assert mu.shape == (2,) and mu.dtype == torch.float32


def test_grads_laid_out_like_the_buckets_are_read_in_place():
    params = [torch.randn(5).half(), torch.randn(3).half()]
    state = fp16fx.init(params, fp16fx.sgd(1.0), fp16fx.NoLossScale(), buckets=True)
    grads = fp16fx.grad_buffers(state)
    flat = buckets.flat_view(state.layout.buckets[0], grads)
    assert flat is not None and flat.data_ptr() == grads[0].data_ptr()
    loose = [torch.ones(5).half(), torch.ones(3).half()]
    assert buckets.flat_view(state.layout.buckets[0], loose) is None
    for g, value in zip(grads, loose):
        g.copy_(value)
    via_views, _ = fp16fx.step(state, grads)
    via_copies, _ = fp16fx.step(state, loose)
    assert bitwise_equal(via_views.params, via_copies.params)


def _mutate(grads: list, i: int, how: str) -> None:
    """Breaks the layout at leaf ``i`` in one way a user could."""
    g = grads[i]
    if how == "swap":
        j = (i + 1) % len(grads)
        grads[i], grads[j] = grads[j], g
    else:
        grads[i] = {
            "flattened": lambda: g.view(-1),  # the right bytes, the wrong shape
            "copied": lambda: g.clone(),  # the right shape elsewhere
            "retyped": lambda: g.view(torch.bfloat16),  # the right address and shape
            "transposed": lambda: g.t(),  # the right address, not contiguous
            "missing": lambda: None,
            "not a tensor": lambda: 0.0,
        }[how]()


@given(
    shapes=st.lists(st.tuples(st.integers(2, 4), st.integers(2, 4)), min_size=2, max_size=5),
    leaf=st.integers(0, 4),
    how=st.sampled_from(
        ["swap", "flattened", "copied", "retyped", "transposed", "missing", "not a tensor"]
    ),
)
def test_flat_view_accepts_exactly_the_buckets_layout(shapes, leaf, how):
    params = [torch.zeros(shape, dtype=torch.float16) for shape in shapes]
    state = fp16fx.init(params, fp16fx.sgd(1.0), fp16fx.NoLossScale(), buckets=True)
    (bucket,) = state.layout.buckets
    grads = list(fp16fx.grad_buffers(state))
    flat = buckets.flat_view(bucket, grads)
    assert flat is not None and flat.data_ptr() == grads[0].data_ptr()
    assert flat.numel() == sum(g.numel() for g in grads)
    _mutate(grads, leaf % len(grads), how)
    assert buckets.flat_view(bucket, grads) is None


def test_multi_transform_labels_split_buckets():
    params = [torch.ones(2).half(), torch.ones(2).half()]
    opt = fp16fx.multi_transform([fp16fx.sgd(0.5), fp16fx.sgd(1.0)], labels=[0, 1])
    state = fp16fx.init(params, opt, fp16fx.NoLossScale(), buckets=True)
    assert len(state.layout.buckets) == 2
    state, _ = fp16fx.step(state, [torch.ones(2).half(), torch.ones(2).half()])
    assert state.params[0].tolist() == [0.5, 0.5] and state.params[1].tolist() == [0.0, 0.0]


def test_a_none_grad_in_a_bucketed_state_is_refused_and_changes_nothing():
    params = [torch.ones(2).half(), torch.ones(3).half()]
    state = fp16fx.init(params, fp16fx.adam(1.0), fp16fx.NoLossScale(), buckets=True)
    before = [t.clone() for t in optree.tree_leaves(state)]
    with pytest.raises(ValueError, match=r"grads\[0\] is None, but a bucketed state"):
        fp16fx.step(state, [None, torch.ones(3).half()])
    assert all(torch.equal(a, b) for a, b in zip(before, optree.tree_leaves(state)))
