"""The pure mixed-precision step: purity, exact skips, None grads, errors, BF16."""

from __future__ import annotations

import collections
import io
import math
import re

import optree
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import fp16fx
from fp16fx.compile import StepFunction
from tests.strategies import grads_like, has_tensor, pytrees

OPTIMIZERS = {
    "sgd": lambda: fp16fx.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda: fp16fx.adam(1e-2, amsgrad=True, weight_decay=0.01),
    "adamw+clip": lambda: fp16fx.chain(fp16fx.clip_by_global_norm(1.0), fp16fx.adamw(1e-2)),
}
optimizers = st.sampled_from(sorted(OPTIMIZERS))


def snapshot(tree):
    return [x.clone() for x in optree.tree_leaves(tree)]


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether two tensors are bitwise identical (NaN payloads and signed zeros included)."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.is_floating_point():
        as_int = _INT_OF_SIZE[x.element_size()]
        return torch.equal(x.contiguous().view(as_int), y.contiguous().view(as_int))
    return torch.equal(x, y)


def bitwise_equal(a, b) -> bool:
    leaves_a, leaves_b = optree.tree_leaves(a), optree.tree_leaves(b)
    return len(leaves_a) == len(leaves_b) and all(map(same_bits, leaves_a, leaves_b))


def scaled_grads(state, seed, none_prob=0.0):
    return grads_like(state.params, seed, scale=state.loss_scale.scale.item(), none_prob=none_prob)


@given(
    params=pytrees(),
    opt=optimizers,
    seed=st.integers(0, 2**16),
    none_prob=st.sampled_from([0, 0.3]),
)
def test_step_never_mutates_its_inputs(params, opt, seed, none_prob):
    assume(has_tensor(params))
    state = fp16fx.init(params, OPTIMIZERS[opt](), fp16fx.StaticLossScale(4.0))
    state, _ = fp16fx.step(state, scaled_grads(state, seed))  # non-trivial moments
    grads = scaled_grads(state, seed + 1, none_prob)
    before_state, before_grads = snapshot(state), snapshot(grads)
    fp16fx.step(state, grads)
    assert bitwise_equal(before_state, snapshot(state))
    assert bitwise_equal(before_grads, snapshot(grads))


@given(
    params=pytrees(),
    opt=optimizers,
    seed=st.integers(0, 2**16),
    bad=st.sampled_from([math.inf, -math.inf, math.nan]),
    data=st.data(),
)
def test_a_non_finite_grad_anywhere_skips_the_step_exactly(params, opt, seed, bad, data):
    assume(has_tensor(params))
    policy = fp16fx.DynamicLossScale(init_scale=2.0**10, hysteresis=1)
    state = fp16fx.init(params, OPTIMIZERS[opt](), policy)
    state, _ = fp16fx.step(state, scaled_grads(state, seed))
    grads = scaled_grads(state, seed + 1)
    grad_leaves = [g for g in optree.tree_leaves(grads)]
    victim = data.draw(st.sampled_from(grad_leaves))
    victim.view(-1)[data.draw(st.integers(0, victim.numel() - 1))] = bad
    fields = ("params", "master", "opt_state", "count")
    # Copies: a step that wrote into the state's own tensors would show.
    before = {field: snapshot(getattr(state, field)) for field in fields}

    new, info = fp16fx.step(state, grads)

    assert not info["finite"].item()
    assert math.isnan(info["grad_norm"].item()) or math.isinf(info["grad_norm"].item())
    for field in fields:
        assert bitwise_equal(getattr(new, field), before[field]), field
    assert new.loss_scale.scale.item() == state.loss_scale.scale.item() / 2
    assert info["loss_scale"].item() == state.loss_scale.scale.item()


@given(
    params=pytrees(),
    opt=optimizers,
    seed=st.integers(0, 2**16),
    overflows=st.lists(st.booleans(), min_size=1, max_size=4),
)
def test_every_param_is_its_master_rounded_after_any_steps(params, opt, seed, overflows):
    # The step rounds the selected master rather than reading the old param (step.py): that
    # a skip leaves the param bitwise unchanged rests on this invariant.
    assume(has_tensor(params))
    state = fp16fx.init(params, OPTIMIZERS[opt](), fp16fx.DynamicLossScale(init_scale=2.0**10))
    for k, overflow in enumerate(overflows):
        grads = scaled_grads(state, seed + k)
        if overflow:
            optree.tree_leaves(grads)[0].view(-1)[0] = math.inf
        state, _ = fp16fx.step(state, grads)
        for p, m in zip(optree.tree_leaves(state.params), optree.tree_leaves(state.master)):
            assert same_bits(p, m.to(p.dtype))


@given(
    params=pytrees(allow_none=False),
    buckets=st.booleans(),
    inplace=st.booleans(),
    overflows=st.lists(st.booleans(), min_size=2, max_size=2),
    seed=st.integers(0, 2**16),
)
def test_a_param_written_between_steps_keeps_its_written_value(
    params, buckets, inplace, overflows, seed
):
    """Whatever the layout (the leaves as given, or views of one buffer: ``buckets``, and a
    pure step's result) and pure or in place, the step adopts a param written since the last
    one as its master (docs/design.md, step 3), exactly, applied or skipped. (The leaves as
    given once went unread: their masters were stepped and copied back over the write.)"""
    assume(has_tensor(params))
    policy = fp16fx.DynamicLossScale(init_scale=2.0**10)
    state = fp16fx.init(params, fp16fx.sgd(0.0), policy, buckets=buckets)  # moves nothing
    step_fn = StepFunction(inplace=inplace, compile_options=None)
    for k, overflow in enumerate(overflows):
        written = grads_like(state.params, seed + 2 * k)
        with torch.no_grad():
            for p, w in zip(optree.tree_leaves(state.params), optree.tree_leaves(written)):
                p.copy_(w)
        grads = scaled_grads(state, seed + 2 * k + 1)
        if overflow:
            optree.tree_leaves(grads)[0].view(-1)[0] = math.nan
        state, info = step_fn(state, grads)
        assert bool(info.finite) != overflow
        assert bitwise_equal(state.params, written)
        masters = optree.tree_map(lambda w: w.float(), written)
        assert bitwise_equal(state.master, masters)


@pytest.mark.parametrize("buckets", [False, True])
def test_the_step_after_a_write_decays_the_master_it_had(buckets):
    """The written param is adopted after the update is computed, not before
    (docs/design.md, step 3): AdamW's decoupled decay of that step is the old master's, so
    the new master is the written value plus the update a run without the write takes."""
    params = {"w": torch.linspace(-2, 2, 12).half()}
    grads = {"w": torch.linspace(1, -1, 12).half() * 2**8}
    masters = {}
    for write in (False, True):
        state = fp16fx.init(
            {"w": params["w"].clone()},
            fp16fx.adamw(0.1, weight_decay=0.5),
            fp16fx.StaticLossScale(2.0**8),
            buckets=buckets,
        )
        state, _ = fp16fx.step(state, grads)
        before = state.master["w"].clone()
        if write:
            with torch.no_grad():
                state.params["w"].mul_(-1)  # written: every value moves far
        state, _ = fp16fx.step(state, grads)
        masters[write] = (before, state.master["w"])
    (old, unwritten), (_, stepped) = masters[False], masters[True]
    written = -old.half().float()
    torch.testing.assert_close(stepped, written + (unwritten - old), rtol=0, atol=1e-6)


def test_one_in_place_step_function_steps_states_of_two_dtypes_as_their_own_would():
    """Its buffers for params that are not one flat tensor are its own per dtype (keyed by a
    segment's place alone, a BF16 state once got an FP16 one's and lost its updates)."""

    def make(dtype):
        params = {"w": torch.randn(4, 3).to(dtype), "b": torch.randn(3).to(dtype)}
        return fp16fx.init(params, fp16fx.sgd(1e-4), fp16fx.StaticLossScale(1.0))

    torch.manual_seed(0)
    fp16, bf16 = make(torch.float16), make(torch.bfloat16)
    torch.manual_seed(0)
    make(torch.float16)  # the same draws again: the BF16 state alike
    alone = make(torch.bfloat16)
    shared, own = (StepFunction(inplace=True, compile_options=None) for _ in range(2))
    shared(fp16, optree.tree_map(torch.zeros_like, fp16.params))
    for _ in range(3):
        bf16, _ = shared(bf16, optree.tree_map(torch.ones_like, bf16.params))
        alone, _ = own(alone, optree.tree_map(torch.ones_like, alone.params))
    assert bitwise_equal(bf16.master, alone.master) and bitwise_equal(bf16.params, alone.params)


@given(params=pytrees(allow_none=False), seed=st.integers(0, 2**16), data=st.data())
def test_a_none_grad_leaves_its_param_and_optimizer_state_untouched(params, seed, data):
    leaves, treedef = optree.tree_flatten(params)
    assume(len(leaves) >= 2)
    state = fp16fx.init(params, fp16fx.adam(1e-2), fp16fx.NoLossScale())
    grad_leaves = optree.tree_leaves(grads_like(params, seed))
    skipped = data.draw(st.integers(0, len(leaves) - 1))
    grad_leaves[skipped] = None
    old_states = [_copy(e) for e in fp16fx.state_dict(state)["params"].values()]
    old_values = [p.clone() for p in leaves]
    new, info = fp16fx.step(state, optree.tree_unflatten(treedef, grad_leaves))
    assert info["finite"].item()
    new_states = list(fp16fx.state_dict(new)["params"].values())
    for i, (p_old, p_new) in enumerate(zip(leaves, optree.tree_leaves(new.params))):
        if i == skipped:  # the same memory, bitwise unchanged
            assert p_new.data_ptr() == p_old.data_ptr() and same_bits(p_new, old_values[i])
            assert bitwise_equal(new_states[i], old_states[i])
        else:
            assert new_states[i]["opt[1].count"].item() == 1  # the leaf's own Adam step count


@given(
    params=pytrees(allow_none=False), seeds=st.lists(st.integers(0, 2**16), min_size=2, max_size=3)
)
def test_in_place_steps_with_none_grads_end_as_pure_ones(params, seeds):
    """Each step leaves out other leaves (cutting segments), in place and purely: the params,
    the masters and the state dict end bitwise alike. (A cut once made an FP32 leaf that was
    not one flat tensor with its neighbours a flat one, which the in-place step wrote while
    its master stayed a packed copy of the old value.)"""
    assume(len(optree.tree_leaves(params)) >= 2)
    copy = optree.tree_map(torch.clone, params)
    pure = fp16fx.init(params, fp16fx.adam(1e-2), fp16fx.NoLossScale())
    in_place = fp16fx.init(copy, fp16fx.adam(1e-2), fp16fx.NoLossScale())
    step = StepFunction(inplace=True, compile_options=None)
    for seed in seeds:
        grads = grads_like(params, seed, none_prob=0.4)
        pure, _ = fp16fx.step(pure, grads)
        in_place, _ = step(in_place, grads)
    assert bitwise_equal(in_place.params, pure.params)
    assert bitwise_equal(in_place.master, pure.master)
    saved, saved_pure = fp16fx.state_dict(in_place), fp16fx.state_dict(pure)
    assert bitwise_equal(saved["params"], saved_pure["params"])


def _copy(entry: dict) -> dict:
    return {key: t.clone() for key, t in entry.items()}


def test_state_is_a_pytree_of_tensors_that_round_trips():
    params = {"a": torch.ones(2).half(), "frozen": None, "b": [torch.zeros(3)]}
    state = fp16fx.init(params, fp16fx.adam(), fp16fx.DynamicLossScale(min_scale=0.25))
    leaves, treedef = optree.tree_flatten(state)
    assert all(isinstance(x, torch.Tensor) for x in leaves)
    rebuilt = optree.tree_unflatten(treedef, leaves)
    assert rebuilt.policy == state.policy and rebuilt.optimizer is state.optimizer
    b = params["b"][0]  # an FP32 leaf is its own master: the same memory
    assert rebuilt.master["b"][0].data_ptr() == b.data_ptr() == rebuilt.params["b"][0].data_ptr()
    assert rebuilt.master["a"].dtype == torch.float32
    assert state.loss_scale.scale.item() == 2.0**16


def test_default_policy_follows_the_params_dtypes():
    assert isinstance(
        fp16fx.init([torch.ones(1).half()], fp16fx.sgd(1.0)).policy, fp16fx.DynamicLossScale
    )
    assert isinstance(
        fp16fx.init([torch.ones(1).bfloat16()], fp16fx.sgd(1.0)).policy, fp16fx.NoLossScale
    )


def test_bf16_params_train_with_fp32_masters_and_skip_exactly_on_nan():
    params = {"w": torch.randn(4, 4).bfloat16()}
    state = fp16fx.init(params, fp16fx.adamw(1e-2), fp16fx.NoLossScale())
    state, info = fp16fx.step(state, {"w": torch.randn(4, 4).bfloat16()})
    assert info["finite"].item() and state.master["w"].dtype == torch.float32
    assert torch.equal(state.params["w"], state.master["w"].bfloat16())
    bad = torch.randn(4, 4).bfloat16()
    bad[1, 2] = float("nan")
    new, info = fp16fx.step(state, {"w": bad})
    assert not info["finite"].item()
    assert bitwise_equal(new.master, state.master) and bitwise_equal(new.opt_state, state.opt_state)


def test_clipping_uses_the_norm_of_the_unscaled_grads():
    scale = 2.0**12
    params = [torch.zeros(4).half()]
    state = fp16fx.init(
        params,
        fp16fx.chain(fp16fx.clip_by_global_norm(1.0), fp16fx.sgd(1.0)),
        fp16fx.StaticLossScale(scale),
    )
    unscaled = torch.tensor([3.0, 4.0, 0.0, 0.0])  # norm 5
    new, info = fp16fx.step(state, [(unscaled * scale).half()])
    assert info["grad_norm"].item() == pytest.approx(5.0)
    torch.testing.assert_close(new.master[0], -unscaled / (5.0 + 1e-6))


def test_scale_loss_multiplies_the_fp32_loss_by_the_current_scale():
    state = fp16fx.init([torch.ones(1).half()], fp16fx.sgd(1.0), fp16fx.StaticLossScale(256.0))
    scaled = fp16fx.scale_loss(state, torch.tensor(1.5, dtype=torch.float16))
    assert scaled.dtype == torch.float32 and scaled.item() == 384.0


def test_count_counts_applied_steps_only():
    state = fp16fx.init([torch.ones(2).half()], fp16fx.sgd(0.1), fp16fx.StaticLossScale(1.0))
    for g in ([1.0, 1.0], [float("inf"), 1.0], [1.0, 1.0]):
        state, _ = fp16fx.step(state, [torch.tensor(g).half()])
    assert state.count.item() == 2


GOOD = {"w": torch.ones(2, 2).half(), "b": torch.ones(2).half()}


@pytest.mark.parametrize(
    ("params", "error", "message"),
    [
        (
            {"w": torch.ones(2, dtype=torch.int32)},
            TypeError,
            r"params\['w'\] has dtype torch.int32",
        ),
        ({"w": torch.ones(2, dtype=torch.complex64)}, TypeError, "complex64"),
        ({"w": torch.ones(2, dtype=torch.float64)}, TypeError, "float64"),
        ({"w": [1.0, 2.0]}, TypeError, r"params\['w'\]\[0\] is a float"),
        ({}, ValueError, "holds no tensor"),
        ({"w": None}, ValueError, "holds no tensor"),
        # Once accepted, then failing inside the step (torch's own error, after the masters,
        # moments and count were written) or at the first copy (meta: no values).
        (
            {"w": torch.ones(1).half().expand(4)},
            ValueError,
            r"params\['w'\] has elements that share memory .* strides \(0,\)",
        ),
        (
            {"w": torch.ones(2, device="meta").half()},
            ValueError,
            r"params\['w'\] is on the meta device: it holds no values",
        ),
    ],
)
def test_init_refuses_untrainable_params(params, error, message):
    with pytest.raises(error, match=message):
        fp16fx.init(params, fp16fx.sgd(0.1))


def test_the_state_steps_the_tensors_given_not_what_the_callers_dict_holds_later():
    params = {"a": torch.ones(3).half(), "b": torch.ones(2).half()}
    state = fp16fx.init(params, fp16fx.sgd(0.5), fp16fx.NoLossScale())
    given = params["a"]
    params["a"] = torch.full((3,), 7.0).half()  # the caller's dict, reused
    assert state.params["a"] is given
    saved = fp16fx.state_dict(state)["params"]["a"]
    assert torch.equal(saved["param"], saved["master"].half())  # one tensor's values
    state, _ = fp16fx.step(state, {"a": torch.ones(3).half(), "b": torch.ones(2).half()})
    assert torch.equal(state.params["a"], torch.full((3,), 0.5).half())


def test_init_refuses_a_non_transform_optimizer():
    with pytest.raises(TypeError, match="fp16fx transform"):
        fp16fx.init(GOOD, torch.optim.SGD)


@pytest.mark.parametrize(
    ("grads", "error", "message"),
    [
        ({"w": torch.ones(2, 2).half()}, ValueError, "structure of params"),
        (
            {"w": torch.ones(2, 2).half(), "b": torch.ones(3).half()},
            ValueError,
            r"grads\['b'\] has shape \(3,\)",
        ),
        (
            {"w": torch.ones(2, 2), "b": torch.ones(2).half()},
            TypeError,
            r"grads\['w'\] has dtype torch.float32",
        ),
        (
            {"w": torch.ones(2, 2, device="meta").half(), "b": torch.ones(2).half()},
            TypeError,
            "is on meta",
        ),
        ({"w": 1.0, "b": torch.ones(2).half()}, TypeError, r"grads\['w'\] is a float"),
    ],
)
@pytest.mark.parametrize("bucketed", [False, True])
def test_step_refuses_grads_that_do_not_fit_and_changes_nothing(grads, error, message, bucketed):
    params = {k: v.clone() for k, v in GOOD.items()}
    state = fp16fx.init(params, fp16fx.adam(), fp16fx.DynamicLossScale(), buckets=bucketed)
    before = snapshot(state)
    with pytest.raises(error, match=message):
        fp16fx.step(state, grads)
    assert bitwise_equal(before, snapshot(state))


@pytest.mark.parametrize("bucketed", [False, True])
def test_a_grad_for_an_untrained_leaf_is_refused(bucketed):
    params = {"w": torch.ones(2).half(), "n": None}
    state = fp16fx.init(params, fp16fx.sgd(0.1), buckets=bucketed)
    grads = fp16fx.grad_buffers(state)  # laid out like the buckets, when there are buckets
    grads["n"] = torch.ones(2).half()
    with pytest.raises(ValueError, match=r"grads\['n'\] is a gradient for a None"):
        fp16fx.step(state, grads)


def test_grads_laid_out_like_the_buckets_but_of_another_dtype_are_refused():
    state = fp16fx.init({k: v.clone() for k, v in GOOD.items()}, fp16fx.sgd(0.1), buckets=True)
    other = fp16fx.init({k: v.bfloat16() for k, v in GOOD.items()}, fp16fx.sgd(0.1), buckets=True)
    with pytest.raises(TypeError, match=r"grads\['b'\] has dtype torch.bfloat16"):
        fp16fx.step(state, fp16fx.grad_buffers(other))


def test_a_namedtuples_leaves_are_named_by_their_fields_in_errors():
    Layer = collections.namedtuple("Layer", "weight bias")
    state = fp16fx.init(Layer(torch.ones(3).half(), torch.ones(2).half()), fp16fx.sgd(0.1))
    with pytest.raises(TypeError, match=r"^grads\.bias has dtype torch.float32"):
        fp16fx.step(state, Layer(torch.ones(3).half(), torch.ones(2)))
    with pytest.raises(TypeError, match=r"^params\.bias has dtype torch.int32"):
        fp16fx.init(Layer(torch.ones(3).half(), torch.ones(2, dtype=torch.int32)), fp16fx.sgd(0.1))


def test_a_tuple_of_grads_fits_a_list_of_params_and_the_reverse():
    """``torch.autograd.grad`` returns a tuple; list params once refused it, showing two
    PyTreeSpecs that differed only in their brackets."""
    params = [torch.ones(3).half(), torch.full((2,), 2.0).half()]
    grads = [torch.full((3,), 4.0).half(), torch.full((2,), -8.0).half()]
    for tree, other in ((params, tuple(grads)), (tuple(params), grads)):
        state = fp16fx.init(tree, fp16fx.adam(0.1), fp16fx.StaticLossScale(1.0))
        expected, _ = fp16fx.step(state, type(tree)(grads))
        stepped, _ = fp16fx.step(state, other)
        assert bitwise_equal(snapshot(stepped), snapshot(expected))
    state = fp16fx.init({"a": params[0]}, fp16fx.sgd(0.1))
    with pytest.raises(ValueError, match=r"\(params: dict, grads: OrderedDict\)"):
        fp16fx.step(state, collections.OrderedDict(a=grads[0]))


def test_odd_but_trainable_layouts_are_accepted():
    """The check of params whose elements share memory judges spans: layouts that share
    nothing pass, an empty expanded one included."""
    layouts = {
        "transposed": torch.ones(3, 4).half().t(),
        "strided": torch.ones(6, 4).half()[::2],
        "channels_last": torch.ones(2, 3, 4, 5).half().to(memory_format=torch.channels_last),
        "empty_expanded": torch.zeros(0, 1).half().expand(0, 4),
        "scalar": torch.tensor(1.0).half(),
    }
    state = fp16fx.init(layouts, fp16fx.sgd(0.1), fp16fx.StaticLossScale(1.0))
    state, info = fp16fx.step(state, {k: torch.ones_like(v) for k, v in layouts.items()})
    expected = {k: (v.float() - 0.1).half() for k, v in layouts.items()}  # SGD, grads of 1
    assert bool(info.finite) and all(torch.equal(state.params[k], expected[k]) for k in layouts)


def test_params_made_in_inference_mode_are_refused():
    with torch.inference_mode():
        params = {"w": torch.ones(2).half()}
    with pytest.raises(ValueError, match=r"params\['w'\] was made under torch.inference_mode"):
        fp16fx.init(params, fp16fx.sgd(0.1))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("sparse", [torch.Tensor.to_sparse, torch.Tensor.to_sparse_csr])
def test_sparse_params_are_refused_by_name(sparse):
    """Once a stride question about shared memory, or torch's own error (CSR)."""
    params = {"b": torch.ones(2).half(), "w": sparse(torch.eye(3).half())}
    with pytest.raises(TypeError, match=r"params\['w'\] is a torch.sparse_c.. tensor.*dense"):
        fp16fx.init(params, fp16fx.sgd(0.1))


def test_params_on_several_devices_are_refused():
    with pytest.raises(ValueError, match=r"params\[1\] is on meta, the others on cpu"):
        fp16fx.init([torch.ones(1), torch.ones(1, device="meta")], fp16fx.sgd(0.1))


@pytest.mark.parametrize("buckets", [False, True])
def test_a_tensor_given_twice_is_refused_and_left_as_it_was(buckets):
    """Tied weights passed as two leaves would get two masters and two updates (and with
    buckets, be untied: the tensor re-pointed at the second leaf's slot). Also through
    ``.data``, another object over the same memory."""
    w = torch.randn(4).half()
    before, storage = w.clone(), w.untyped_storage().data_ptr()
    for params in ({"a": w, "b": w}, {"a": w, "b": {"c": w.data}}):
        with pytest.raises(ValueError, match=r"params\['b'\].* is the same tensor as "):
            fp16fx.init(params, fp16fx.sgd(0.1), buckets=buckets)
    assert torch.equal(w, before) and w.untyped_storage().data_ptr() == storage
    # Views of one buffer are separate params where they are disjoint: init accepts them.
    flat = torch.randn(8).half()
    fp16fx.init({"a": flat[:4], "b": flat[4:]}, fp16fx.sgd(0.1), buckets=buckets)
    # Overlapping views would each be stepped and overwrite the other: refused.
    base = torch.randn(16).half()
    base_storage = base.untyped_storage().data_ptr()
    for params in ({"a": base, "b": base.view(4, 4)}, {"a": base[4:12], "b": base[:8]}):
        with pytest.raises(ValueError, match=r"params\['b'\] overlaps params\['a'\] in memory"):
            fp16fx.init(params, fp16fx.sgd(0.1), buckets=buckets)
    assert base.untyped_storage().data_ptr() == base_storage  # not moved into a bucket


def test_step_info_reads_as_the_dict_it_used_to_be():
    """``"finite" in info`` was False (a tuple's membership of values) and get/values were
    missing, for code written against the dict."""
    state = fp16fx.init([torch.ones(2).half()], fp16fx.sgd(0.1), fp16fx.StaticLossScale(1.0))
    _, info = fp16fx.step(state, [torch.ones(2).half()])
    assert "finite" in info and "lr" not in info
    assert info.get("grad_norm") is info.grad_norm and info.get("lr", 0) == 0
    assert dict(zip(info.keys(), info.values())) == dict(info.items())
    assert info["finite"] is info.finite and bool(info.finite)
    with pytest.raises(KeyError, match="a step reports"):
        info["lr"]


# -- checkpoints: where the state was cut ----------------------------------------------------


def _clipped_sgd_state(seed: int):
    g = torch.Generator().manual_seed(seed)
    params = {"a": torch.randn(300, generator=g).half(), "b": torch.randn(700, generator=g).half()}
    chain = fp16fx.chain(fp16fx.clip_by_global_norm(1.0), fp16fx.sgd(0.1))
    return fp16fx.init(params, chain, fp16fx.StaticLossScale(1.0))


def _saved_and_loaded(sd):
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("seed", range(4))
def test_a_clipped_run_resumes_bitwise_after_a_param_missed_its_gradient(seed):
    """The missed gradient cut the state, and plain SGD keeps no step count to say so. The
    global norm sums per segment: over a state loaded uncut it differed in its last bit, and
    so did every clipped step after it."""
    g = torch.Generator().manual_seed(100 + seed)
    run, _ = fp16fx.step(
        _clipped_sgd_state(seed), {"a": torch.randn(300, generator=g).half(), "b": None}
    )
    resumed = fp16fx.load_state_dict(
        _clipped_sgd_state(seed + 10), _saved_and_loaded(fp16fx.state_dict(run))
    )
    assert resumed.layout.cuts == run.layout.cuts == ((0, 1, 2),)
    grads = {
        "a": torch.randn(300, generator=g).half() * 3,
        "b": torch.randn(700, generator=g).half() * 3,
    }
    (run, run_info), (resumed, resumed_info) = fp16fx.step(run, grads), fp16fx.step(resumed, grads)
    assert same_bits(run_info.grad_norm, resumed_info.grad_norm)
    assert all(same_bits(run.master[k], resumed.master[k]) for k in grads)


FP32 = ("bn_weight", "bn_bias")


def test_a_load_makes_every_fp32_leaf_its_own_master():
    """An FP32 leaf (a BatchNorm weight) is its own master; in a state without buckets its
    master is a tensor of its own, which a load once left at its value before the load."""
    g = torch.Generator().manual_seed(0)

    def state(offset: float) -> fp16fx.MixedPrecisionState:
        params = {"w": torch.randn(5, generator=g).half()}
        params |= {k: torch.randn(3, generator=g) + offset for k in ("bn_weight", "bn_bias")}
        return fp16fx.init(params, fp16fx.sgd(0.1), fp16fx.StaticLossScale(1.0))

    run, _ = fp16fx.step(state(0.0), {"w": torch.ones(5).half()} | {k: torch.ones(3) for k in FP32})
    loaded = fp16fx.load_state_dict(state(10.0), _saved_and_loaded(fp16fx.state_dict(run)))
    for key in FP32:
        assert same_bits(loaded.params[key], run.params[key])
        assert same_bits(loaded.master[key], run.params[key])


def test_a_dict_without_segments_loads_as_before_and_a_malformed_one_is_refused():
    run, _ = fp16fx.step(_clipped_sgd_state(0), {"a": torch.ones(300).half(), "b": None})
    sd = _saved_and_loaded(fp16fx.state_dict(run))
    assert sd["segments"] == {"a": 0, "b": 1}
    older = {key: value for key, value in sd.items() if key != "segments"}
    loaded = fp16fx.load_state_dict(_clipped_sgd_state(1), older)  # saved before segments
    assert loaded.layout.cuts == ((0, 2),) and torch.equal(loaded.master["a"], run.master["a"])
    target = _clipped_sgd_state(2)
    before = {k: v.clone() for k, v in target.master.items()}
    for segments, message in (
        ({"a": 0}, r"\['segments'\] lacks \['b'\]"),
        ({"a": 0, "b": 1, "c": 2}, r"\['segments'\] has \['c'\]"),
        ({"a": 0, "b": -1}, r"\['segments'\]\['b'\] is -1, not a segment's index"),
        ({"a": 0, "b": 1.0}, r"\['segments'\]\['b'\] is 1.0, not a segment's index"),
        ([0, 1], r"\['segments'\] is a list, not a dict"),
    ):
        with pytest.raises(fp16fx.StateDictError, match=message):
            fp16fx.load_state_dict(target, {**sd, "segments": segments})
    assert all(torch.equal(target.master[k], v) for k, v in before.items())


@pytest.mark.parametrize(
    ("counter", "value", "bound"),
    [("good_steps", 5, "growth_interval, 5"), ("overflows", 2**31 - 1, "hysteresis, 2")],
)
def test_loss_scale_counters_no_run_holds_are_refused(counter, value, bound):
    """The dynamic rule resets each counter at its bound; loaded past it, the int32 counter
    wrapped before meeting it again, and the scale stopped moving."""
    policy = fp16fx.DynamicLossScale(growth_interval=5, hysteresis=2)
    target = fp16fx.init({"w": torch.ones(4).half()}, fp16fx.sgd(0.1), policy)
    sd = fp16fx.state_dict(target)
    sd["loss_scale"][counter] = torch.tensor(value, dtype=torch.int32)
    before = [t.clone() for t in target.loss_scale]
    with pytest.raises(fp16fx.StateDictError, match=rf"{counter} is {value}, .*{bound}"):
        fp16fx.load_state_dict(target, sd)
    assert all(torch.equal(a, b) for a, b in zip(target.loss_scale, before))
    sd["loss_scale"][counter] = torch.tensor(1, dtype=torch.int32)  # one a run holds
    assert getattr(fp16fx.load_state_dict(target, sd).loss_scale, counter).item() == 1


@pytest.mark.parametrize(
    ("setting", "saved", "message"),
    [
        ("growth_interval", 3.0, "growth_interval must be an int >= 1, got 3.0"),
        ("hysteresis", True, "hysteresis must be an int >= 1, got True"),
    ],
)
def test_a_saved_policy_equal_to_the_states_but_of_another_type_is_refused_by_key(
    setting, saved, message
):
    """3.0 == 3 and True == 1 pass the comparison with the state's policy; building the
    saved one then raised the constructor's bare ValueError, naming no key."""
    target = fp16fx.init(
        {"w": torch.ones(4).half()},
        fp16fx.sgd(0.1),
        fp16fx.DynamicLossScale(growth_interval=3, hysteresis=1),
    )
    sd = fp16fx.state_dict(target)
    sd["policy"] = {**sd["policy"], setting: saved}
    with pytest.raises(fp16fx.StateDictError, match=rf"\['policy'\]: {message}"):
        fp16fx.load_state_dict(target, sd)


_FP32 = torch.finfo(torch.float32)
_FP32_NORMAL = st.floats(_FP32.tiny, _FP32.max, width=32)
_POWERS = st.integers(-126, 127).map(lambda k: 2.0**k)
_POLICIES = st.one_of(
    st.just(fp16fx.NoLossScale()),
    _FP32_NORMAL.map(fp16fx.StaticLossScale),
    st.tuples(_POWERS, _POWERS).map(
        lambda b: fp16fx.DynamicLossScale(min_scale=min(b), max_scale=max(b))
    ),
)


def _held_scales(policy) -> tuple[float, float]:
    """The lowest and highest loss scale a run under ``policy`` holds, in FP32: its one
    scale, or a dynamic one's bounds (each reached: the rule clamps into them)."""
    if isinstance(policy, fp16fx.DynamicLossScale):
        return policy.min_scale, policy.max_scale
    fixed = policy.scale if isinstance(policy, fp16fx.StaticLossScale) else 1.0
    return (torch.tensor(fixed).item(),) * 2


def _fp32_neighbours(x: float) -> list[float]:
    """The FP32 values next to ``x`` that are FP32 normals (a scale the state could hold)."""
    t = torch.tensor(x)
    near = [torch.nextafter(t, torch.tensor(end)).item() for end in (0.0, math.inf)]
    return [v for v in near if _FP32.tiny <= v <= _FP32.max]


@given(policy=_POLICIES, data=st.data())
def test_a_loaded_loss_scale_outside_its_policys_range_is_refused(policy, data):
    """A run holds only the scales its policy reaches; loaded outside them, NoLossScale at
    2**24 skipped every step for ever, and a dynamic scale below min_scale was raised to it by
    the next overflow, reported as floored. Both bounds are held, and load."""
    low, high = _held_scales(policy)
    edges = [low, high, *_fp32_neighbours(low), *_fp32_neighbours(high)]
    scale = data.draw(st.sampled_from(edges) | st.floats(low, high, width=32) | _FP32_NORMAL)

    def state(value: float) -> fp16fx.MixedPrecisionState:
        return fp16fx.init({"w": torch.full((4,), value).half()}, fp16fx.sgd(0.1), policy)

    sd = fp16fx.state_dict(state(2.0))
    sd["loss_scale"] = {**sd["loss_scale"], "scale": torch.tensor(scale)}
    target = state(1.0)
    if low <= scale <= high:
        assert fp16fx.load_state_dict(target, sd).loss_scale.scale.item() == scale
        return
    before = snapshot((target.params, target.master, target.loss_scale))
    bounds = f"only {low:.9g}" if low == high else f"from {low:.9g} to {high:.9g}"
    name = type(policy).__name__
    message = rf"it is {re.escape(f'{scale:.9g}')}, .*{name}.*{re.escape(bounds)}"
    with pytest.raises(fp16fx.StateDictError, match=message):
        fp16fx.load_state_dict(target, sd)
    assert bitwise_equal((target.params, target.master, target.loss_scale), before)


def test_saved_segments_apply_only_to_a_state_laid_out_alike():
    """Saved over FP16 a, c and FP32 b, d (two buckets, each its own segment), loaded over
    all-FP32 params (the model's dtype changed): one bucket, whose params came from two saved
    segments in turn. Their marks cut it at every param; the saved layout says nothing here."""

    def state(dtypes):
        params = {k: torch.ones(3, dtype=dtype) for k, dtype in zip("abcd", dtypes)}
        return fp16fx.init(params, fp16fx.sgd(0.1), fp16fx.StaticLossScale(1.0))

    half, single = torch.float16, torch.float32
    sd = _saved_and_loaded(fp16fx.state_dict(state([half, single, half, single])))
    assert sd["segments"] == {"a": 0, "b": 1, "c": 0, "d": 1}
    assert fp16fx.load_state_dict(state([single] * 4), sd).layout.cuts == ((0, 4),)
