"""Flat buffers: bucketed and per-leaf states step alike, views back, grads used in place,
segments cut where a leaf has no gradient."""

from __future__ import annotations

import optree
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import fp16fx
from fp16fx import flat
from tests.strategies import grads_like, has_tensor, pytrees
from tests.test_step import OPTIMIZERS, bitwise_equal


def _clone(tree):
    return optree.tree_map(lambda p: p.clone(), tree)


@given(params=pytrees(), opt=st.sampled_from(sorted(OPTIMIZERS)), seed=st.integers(0, 2**16))
def test_a_bucketed_state_steps_bitwise_like_a_per_leaf_one(params, opt, seed):
    assume(has_tensor(params))
    policy = fp16fx.StaticLossScale(16.0)
    bucketed = fp16fx.init(_clone(params), OPTIMIZERS[opt](), policy, buckets=True)
    leafy = fp16fx.init(_clone(params), OPTIMIZERS[opt](), policy)
    assert len(optree.tree_leaves(bucketed.params)) == len(optree.tree_leaves(leafy.params))
    for i in range(4):
        grads = grads_like(params, seed + i, scale=16.0, none_prob=0.3 if i == 2 else 0.0)
        if i == 1:
            next(iter(optree.tree_leaves(grads))).view(-1)[0] = float("nan")
        bucketed, _ = fp16fx.step(bucketed, grads)
        leafy, _ = fp16fx.step(leafy, grads)
    assert bucketed.layout == leafy.layout  # the same segments: the same flat core
    for field in ("params", "master", "opt_state"):
        assert bitwise_equal(getattr(bucketed, field), getattr(leafy, field)), field


def test_bucketing_repoints_the_given_tensors_and_keeps_one_buffer_per_dtype():
    params = {"w": torch.randn(3, 2).half(), "b": torch.randn(2).half(), "f": torch.randn(4)}
    original = params["w"]
    state = fp16fx.init(params, fp16fx.adam(), fp16fx.NoLossScale(), buckets=True)
    flats = list(state.param_segments)
    assert [f.dtype for f in flats] == [torch.float16, torch.float32]
    assert [f.numel() for f in flats] == [8, 4]
    # optree orders dict keys: "b" (2 values) comes before "w" in the FP16 bucket.
    assert params["w"] is original and params["w"].data_ptr() == flats[0].data_ptr() + 2 * 2
    assert params["b"].data_ptr() == flats[0].data_ptr()
    assert state.params["f"].data_ptr() == state.master["f"].data_ptr()  # FP32: own master
    mu = fp16fx.state_dict(state)["params"]["b"]["opt[1].mu"]
    assert mu.shape == (2,) and mu.dtype == torch.float32
    assert mu.data_ptr() == state.opt_state[1].mu[0].data_ptr()  # a view of the flat moment


def test_grads_laid_out_like_the_buckets_are_read_in_place():
    params = [torch.randn(5).half(), torch.randn(3).half()]
    state = fp16fx.init(params, fp16fx.sgd(1.0), fp16fx.NoLossScale(), buckets=True)
    grads = fp16fx.grad_buffers(state)
    viewed = flat.flat_view(state.layout.buckets[0], grads)
    assert viewed is not None and viewed.data_ptr() == grads[0].data_ptr()
    loose = [torch.ones(5).half(), torch.ones(3).half()]
    assert flat.flat_view(state.layout.buckets[0], loose) is None
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
    viewed = flat.flat_view(bucket, grads)
    assert viewed is not None and viewed.data_ptr() == grads[0].data_ptr()
    assert viewed.numel() == sum(g.numel() for g in grads)
    _mutate(grads, leaf % len(grads), how)
    assert flat.flat_view(bucket, grads) is None


def test_multi_transform_labels_split_buckets():
    params = [torch.ones(2).half(), torch.ones(2).half()]
    opt = fp16fx.multi_transform([fp16fx.sgd(0.5), fp16fx.sgd(1.0)], labels=[0, 1])
    state = fp16fx.init(params, opt, fp16fx.NoLossScale(), buckets=True)
    assert len(state.layout.buckets) == 2
    state, _ = fp16fx.step(state, [torch.ones(2).half(), torch.ones(2).half()])
    assert state.params[0].tolist() == [0.5, 0.5] and state.params[1].tolist() == [0.0, 0.0]


def test_a_none_grad_cuts_its_leaf_a_segment_of_its_own_and_leaves_it_untouched():
    params = [torch.ones(2).half(), torch.ones(3).half(), torch.ones(4).half()]
    state = fp16fx.init(params, fp16fx.adam(1.0), fp16fx.NoLossScale(), buckets=True)
    state, _ = fp16fx.step(state, [None, torch.ones(3).half(), torch.ones(4).half()])
    assert state.layout.cuts == ((0, 1, 3),)  # leaf 0 apart; leaves 1 and 2 still one segment
    assert state.params[0].tolist() == [1.0, 1.0] and state.params[1].tolist() == [0.0] * 3
    counts = [entry["opt[1].count"].item() for entry in fp16fx.state_dict(state)["params"].values()]
    assert counts == [0, 1, 1]  # as torch.optim: a param without a grad does not count a step
    state, _ = fp16fx.step(state, [torch.ones(2).half()] * 1 + [torch.ones(3).half(), None])
    assert state.layout.cuts == ((0, 1, 2, 3),)
    counts = [entry["opt[1].count"].item() for entry in fp16fx.state_dict(state)["params"].values()]
    assert counts == [1, 2, 1]


@given(params=pytrees(), labels=st.data())
def test_a_layouts_segment_marks_rebuild_its_cuts(params, labels):
    leaves, treedef = optree.tree_flatten(params, none_is_leaf=True)
    assume(has_tensor(params))
    layout = flat.plan(leaves, treedef)
    cut_marks = labels.draw(st.lists(st.integers(0, 2), min_size=len(leaves), max_size=len(leaves)))
    layout = layout.recut(cut_marks)
    marks = layout.marks()
    assert [m == -1 for m in marks] == [leaf is None for leaf in leaves]
    assert layout.recut(marks) == layout
    assert sorted(set(marks) - {-1}) == list(range(len(layout.segments)))


@pytest.mark.parametrize("empty_at", [0, 1, 2])
def test_a_zero_size_tensor_among_consecutive_views_leaves_them_joined(empty_at):
    """A zero-size tensor's address is 0 wherever it sits: one among a bucket's params once
    made every step pack the bucket's grads and params into copies."""
    buffer = torch.arange(7.0)
    parts = [buffer[:3], buffer[3:7]]
    parts.insert(empty_at, buffer[3:3] if empty_at == 1 else buffer[:0])
    shapes = [tuple(t.shape) for t in parts]
    whole = flat.joined(parts, shapes)
    assert whole is not None and whole.data_ptr() == buffer.data_ptr() and whole.numel() == 7
    apart = [buffer[:3], buffer[:0], torch.arange(4.0)]
    assert flat.joined(apart, [tuple(t.shape) for t in apart]) is None
