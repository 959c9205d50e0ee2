"""Optimizer math: each transform against torch.optim, hyperparameters as tensors."""

from __future__ import annotations

import io
import math
import sys
from typing import Any, NamedTuple

import optree
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import fp16fx
from fp16fx.segments import Segments
from fp16fx.transforms import with_grad_norm
from fp16fx.transforms.primitives import NO_CLIP, clip_coefficient
from tests.test_step import same_bits

STEPS = 20


def _run_both(make_ours, make_torch, params, seed, dtype=torch.float32):
    """Runs ``STEPS`` steps of fp16fx (eager) and torch.optim on the same grads.

    torch.optim runs on FP32 copies of the masters and is fed the very grads fp16fx sees
    (upcast from the params' dtype), so the two must agree to float32 rounding.
    """
    model_params = {k: v.to(dtype) for k, v in params.items()}
    state = fp16fx.init(model_params, make_ours(), fp16fx.NoLossScale())
    reference = {k: v.float().clone().requires_grad_(True) for k, v in model_params.items()}
    optimizer = make_torch(list(reference.values()))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        grads = {k: torch.randn(v.shape, generator=gen).to(dtype) for k, v in params.items()}
        state, info = fp16fx.step(state, grads)
        assert info["finite"].item()
        for k, p in reference.items():
            p.grad = grads[k].float()
        optimizer.step()
    return state, reference


def _assert_close(state, reference, rtol=1e-6):
    for k, expected in reference.items():
        torch.testing.assert_close(state.master[k], expected.detach(), rtol=rtol, atol=1e-6)


# torch.optim.AdamW decays with a separate multiply, p * (1 - lr * wd), rounded on its own; the
# transform adds the decay into one update. The two differ by at most one float32 rounding of
# p per step, so after STEPS steps by at most STEPS ulps: a relative bound, not 1e-6.
ADAMW_RTOL = STEPS * torch.finfo(torch.float32).eps


PARAMS = {"w": torch.randn(7, 5), "b": torch.randn(5), "s": torch.randn(())}
lrs = st.floats(1e-4, 1e-1)
decays = st.sampled_from([0.0, 1e-3, 0.1])


@given(
    lr=lrs,
    momentum=st.sampled_from([0.0, 0.5, 0.9]),
    dampening=st.sampled_from([0.0, 0.3]),
    weight_decay=decays,
    nesterov=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_sgd_matches_torch(lr, momentum, dampening, weight_decay, nesterov, seed):
    if nesterov and (momentum == 0 or dampening != 0):
        with pytest.raises(ValueError, match="nesterov"):
            fp16fx.sgd(lr, momentum, dampening, weight_decay, nesterov)
        return
    hp = dict(
        lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov
    )
    state, reference = _run_both(
        lambda: fp16fx.sgd(**hp), lambda ps: torch.optim.SGD(ps, **hp), PARAMS, seed
    )
    _assert_close(state, reference)


@given(
    momenta=st.lists(st.sampled_from([0.0, 0.5, 0.9]), min_size=STEPS, max_size=STEPS),
    dampenings=st.lists(st.sampled_from([0.0, 0.3]), min_size=STEPS, max_size=STEPS),
    nesterov=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_sgd_momentum_set_between_steps_matches_torch(momenta, dampenings, nesterov, seed):
    """Momentum and dampening set between steps, as torch.optim.SGD's param groups allow: a
    momentum of 0 steps the plain grad and keeps the buffer (a dampened buffer once shrank
    every update by 1 - dampening), a buffer never made starts from the grad, and Nesterov
    with a dampening (which both refuse when built) steps as torch steps it."""
    hp = dict(lr=0.1, momentum=0.9, nesterov=nesterov)
    state = fp16fx.init(dict(PARAMS), fp16fx.sgd(**hp), fp16fx.NoLossScale())
    reference = {k: v.clone().requires_grad_(True) for k, v in PARAMS.items()}
    optimizer = torch.optim.SGD(list(reference.values()), **hp)
    gen = torch.Generator().manual_seed(seed)
    for momentum, dampening in zip(momenta, dampenings):
        state = fp16fx.set_hyperparams(state, momentum=momentum, dampening=dampening)
        optimizer.param_groups[0].update(momentum=momentum, dampening=dampening)
        grads = {k: torch.randn(v.shape, generator=gen) for k, v in PARAMS.items()}
        state, _ = fp16fx.step(state, grads)
        for k, p in reference.items():
            p.grad = grads[k]
        optimizer.step()
    _assert_close(state, reference)


@pytest.mark.parametrize("name", ["adam", "adamw"])
@given(
    lr=lrs,
    beta1=st.sampled_from([0.0, 0.8, 0.9]),
    beta2=st.sampled_from([0.95, 0.999]),
    eps=st.sampled_from([1e-8, 1e-3]),
    weight_decay=decays,
    amsgrad=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_adam_family_matches_torch(name, lr, beta1, beta2, eps, weight_decay, amsgrad, seed):
    hp = dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
    torch_cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    state, reference = _run_both(
        lambda: getattr(fp16fx, name)(**hp), lambda ps: torch_cls(ps, **hp), PARAMS, seed
    )
    _assert_close(state, reference, rtol=ADAMW_RTOL if name == "adamw" else 1e-6)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_at_eps_zero_leaves_values_without_gradient_alone(amsgrad):
    """At eps = 0, torch's Adam divides 0 by 0 where a value has had only zero gradients (NaN);
    fp16fx's update is 0 there (eps counts as at least 2**-126), and everywhere else it is
    torch's at eps = 0: the same math in fp16fx's order (reciprocals where torch divides),
    so close as the other Adam comparisons here, not bitwise (bitwise on an AMD EPYC by
    chance; on an AVX-512 Intel Xeon, 2 of 48 values a float32 rounding apart)."""
    hp = dict(lr=1e-2, eps=0.0, amsgrad=amsgrad)
    params = {"w": torch.randn(64)}
    state = fp16fx.init(params, fp16fx.adam(**hp), fp16fx.NoLossScale())
    reference = params["w"].clone().requires_grad_(True)
    optimizer = torch.optim.Adam([reference], foreach=False, **hp)
    gen = torch.Generator().manual_seed(0)
    silent = torch.arange(64) % 4 == 0  # these values only ever get 0
    for _ in range(3):
        grad = torch.randn(64, generator=gen).masked_fill(silent, 0.0)
        state, _ = fp16fx.step(state, {"w": grad})
        reference.grad = grad.clone()
        optimizer.step()
    ours, theirs = state.master["w"], reference.detach()
    assert theirs[silent].isnan().all()  # what fp16fx does not do
    assert torch.equal(ours[silent], params["w"][silent])
    torch.testing.assert_close(ours[~silent], theirs[~silent], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_params_follow_torch_run_on_their_fp32_masters(dtype):
    state, reference = _run_both(
        lambda: fp16fx.adamw(1e-2), lambda ps: torch.optim.AdamW(ps, 1e-2), PARAMS, 7, dtype
    )
    _assert_close(state, reference, rtol=ADAMW_RTOL)
    for k, expected in reference.items():
        assert state.params[k].dtype == dtype
        assert torch.equal(state.params[k], expected.detach().to(dtype))


@pytest.mark.parametrize("size", [5.0, 0.01], ids=["clipped", "left as they are"])
def test_clip_by_global_norm_matches_torch_clip_grad_norm(size):
    """Above ``max_norm`` scaled by torch's rule; below it (a coefficient clamped to 1)
    untouched, as torch leaves them."""
    grads = [torch.randn(10) * size, torch.randn(3, 3) * size]
    reference = [g.clone().requires_grad_(False) for g in grads]
    holders = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for h, g in zip(holders, reference):
        h.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(holders, max_norm=1.5)
    clip = fp16fx.clip_by_global_norm(1.5)
    norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    state = with_grad_norm(clip.init(grads), norm)  # as the step fills it
    out, same = clip.update(grads, state, grads)
    assert same is state
    for o, h in zip(out, holders):
        torch.testing.assert_close(o, h.grad, rtol=1e-6, atol=0)
    if size < 1:
        assert all(torch.equal(o, g) for o, g in zip(out, reference))


def test_a_norm_that_overflowed_is_clipped_to_zero_unless_no_clip_was_asked():
    """Finite grads past 1.8e19 make the FP32 norm inf: torch's rule then scales them by 0,
    as ``clip_grad_norm_`` does; NO_CLIP (which FP16_Optimizer's chain holds until a clip is
    asked for) once did too, and froze every param of such a step."""
    inf = torch.tensor(math.inf)
    assert clip_coefficient(1.0, inf) == 0
    assert clip_coefficient(sys.float_info.max / 2, inf) == 0
    assert clip_coefficient(NO_CLIP, inf) == 1 and clip_coefficient(NO_CLIP, torch.tensor(3.0)) == 1
    clip = fp16fx.clip_by_global_norm(NO_CLIP)
    grads = [torch.full((3,), 1e20)]
    out, _ = clip.update(grads, with_grad_norm(clip.init(grads), inf), grads)
    assert torch.equal(out[0], grads[0])


def test_chain_and_multi_transform_apply_each_group_its_own_hyperparameters():
    params = [torch.ones(3), torch.ones(2)]
    opt = fp16fx.multi_transform([fp16fx.sgd(0.1), fp16fx.sgd(1.0)], labels=[0, 1])
    state = fp16fx.init(params, opt, fp16fx.NoLossScale())
    state, _ = fp16fx.step(state, [torch.ones(3), torch.ones(2)])
    assert state.params[0].tolist() == pytest.approx([0.9] * 3)
    assert state.params[1].tolist() == [0.0, 0.0]


def test_hyperparameters_are_float64_tensors_read_and_replaced_by_name():
    state = fp16fx.init([torch.ones(2)], fp16fx.adam(1e-3), fp16fx.NoLossScale())
    got = fp16fx.get_hyperparams(state)
    assert sorted(got) == ["betas", "eps", "lr", "weight_decay"]
    assert got["betas"] == pytest.approx((0.9, 0.999)) and got["lr"] == pytest.approx(1e-3)
    lr = state.opt_state[2]["lr"]
    assert lr.dtype == torch.float64 and lr.shape == ()
    new = fp16fx.set_hyperparams(state, lr=0.5, betas=(0.5, 0.75))
    assert fp16fx.get_hyperparams(new)["lr"] == 0.5
    assert fp16fx.get_hyperparams(new)["betas"] == (0.5, 0.75)
    assert fp16fx.get_hyperparams(state)["lr"] == pytest.approx(1e-3)  # pure
    same = fp16fx.set_hyperparams(state, inplace=True, lr=0.25)
    assert same is state and lr.item() == 0.25  # the same tensor, overwritten


def test_multi_transform_hyperparameters_are_per_group():
    opt = fp16fx.chain(
        fp16fx.clip_by_global_norm(2.0),
        fp16fx.multi_transform([fp16fx.sgd(0.1, momentum=0.9), fp16fx.adam(1e-3)], labels=[1, 0]),
    )
    state = fp16fx.init([torch.ones(2), torch.ones(3)], opt, fp16fx.NoLossScale())
    sgd_group, adam_group = fp16fx.get_hyperparams(state)
    assert sgd_group["lr"] == pytest.approx(0.1) and sgd_group["max_norm"] == 2.0
    assert adam_group["betas"] == pytest.approx((0.9, 0.999)) and adam_group["max_norm"] == 2.0
    state = fp16fx.set_hyperparams(state, group=1, lr=0.5)
    assert [g["lr"] for g in fp16fx.get_hyperparams(state)] == pytest.approx([0.1, 0.5])
    state = fp16fx.set_hyperparams(state, max_norm=3.0)
    assert [g["max_norm"] for g in fp16fx.get_hyperparams(state)] == [3.0, 3.0]
    with pytest.raises(KeyError, match=r"no hyperparameter named \['betas'\] in group 0"):
        fp16fx.set_hyperparams(state, group=0, betas=(0.5, 0.5))
    with pytest.raises(KeyError, match="no param group 2"):
        fp16fx.set_hyperparams(state, group=2, lr=0.5)


def test_every_groups_hyperparameters_are_read_in_one_copy_to_the_host(monkeypatch):
    """``get_hyperparams`` once copied each hyperparameter to the host alone: on a GPU, a
    sync per hyperparameter and group."""
    opt = fp16fx.multi_transform([fp16fx.sgd(0.1, momentum=0.9), fp16fx.adam(1e-3)], labels=[1, 0])
    state = fp16fx.init([torch.ones(2), torch.ones(3)], opt, fp16fx.NoLossScale())
    copies = []
    to_host = torch.Tensor.cpu

    def counted(tensor, *args, **kwargs):
        copies.append(tensor.numel())
        return to_host(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counted)
    sgd_group, adam_group = fp16fx.get_hyperparams(state)
    assert copies == [len(sgd_group) + len(adam_group) + 1]  # betas: two values
    assert adam_group["betas"] == pytest.approx((0.9, 0.999)) and sgd_group["momentum"] == 0.9


def test_a_group_without_params_keeps_its_hyperparameters_on_the_params_device():
    """A param group whose params are all frozen owns no segment: its hyperparameters were
    made on the CPU beside a GPU's params (a CUDA graph skips a step reading CPU tensors).
    The meta device stands in for the GPU."""
    opt = fp16fx.multi_transform([fp16fx.sgd(0.1), fp16fx.adam(1e-3)], labels=[0, 0])
    params = Segments([torch.zeros(3, device="meta"), torch.zeros(2, device="meta")], [0, 0])
    tensors = [x for x in optree.tree_leaves(opt.init(params)) if isinstance(x, torch.Tensor)]
    assert len(tensors) == 6 and {t.device.type for t in tensors} == {"meta"}


def test_a_group_whose_transform_has_no_hyperparameters_keeps_its_number():
    """A group of a transform without hyperparameters (a user's "freeze") is still group 0:
    the group after it stays group 1, not renumbered into its place."""
    freeze = fp16fx.transforms.GradientTransformation(
        init=lambda params: (),
        update=lambda updates, state, params: (optree.tree_map(torch.zeros_like, updates), state),
    )
    opt = fp16fx.multi_transform([freeze, fp16fx.sgd(0.1)], labels=[0, 1])
    state = fp16fx.init([torch.ones(2), torch.ones(3)], opt, fp16fx.NoLossScale())
    assert fp16fx.get_hyperparams(state) == [{}, {"lr": pytest.approx(0.1), "weight_decay": 0.0}]
    state = fp16fx.set_hyperparams(state, group=1, lr=0.5)
    assert fp16fx.get_hyperparams(state)[1]["lr"] == 0.5
    with pytest.raises(KeyError, match=r"no hyperparameter named \['lr'\] in group 0"):
        fp16fx.set_hyperparams(state, group=0, lr=0.5)


@pytest.mark.parametrize(
    ("values", "error", "message"),
    [
        ({"lr": -1.0}, ValueError, "'lr' must be >= 0"),
        ({"betas": (0.9, 1.0)}, ValueError, r"'betas' must be a pair of numbers in \[0, 1\)"),
        ({"eps": float("nan")}, ValueError, "'eps' must be >= 0"),
        ({"lr": "fast"}, TypeError, "'lr' must be a number"),
        ({"lr": torch.empty((), device="meta")}, TypeError, "'lr' is a meta tensor"),
        ({"momentum": 0.9}, KeyError, "no hyperparameter named"),
        ({"eps": 1e39}, ValueError, "'eps' is 1e\\+39, which rounds to inf in FP32"),
    ],
)
def test_bad_hyperparameters_are_refused_and_change_nothing(values, error, message):
    state = fp16fx.init([torch.ones(2)], fp16fx.adam(1e-3), fp16fx.NoLossScale())
    before = {k: v.clone() for k, v in fp16fx.state_dict(state)["hyperparams"].items()}
    with pytest.raises(error, match=message):
        fp16fx.set_hyperparams(state, inplace=True, **{"lr": 0.5, **values})
    now = fp16fx.state_dict(state)["hyperparams"]
    assert before.keys() == now.keys() and all(torch.equal(before[k], now[k]) for k in before)


@given(
    x=st.floats(min_value=0, allow_nan=False, allow_infinity=False)
    | st.floats(min_value=3.40282e38, max_value=3.40283e38)  # about FP32's largest value
)
@example(x=2.0**128 - 2.0**103)  # half an ulp past FP32's largest: rounds to inf
@example(x=math.nextafter(2.0**128 - 2.0**103, 0))  # rounds down to the largest
def test_a_hyperparameter_is_accepted_exactly_where_fp32_holds_it(x):
    holds = bool(torch.tensor(x, dtype=torch.float64).float().isfinite())
    for name in ("lr", "eps", "weight_decay"):
        if holds:
            assert fp16fx.transforms.check_hyperparam(name, x) == x
        else:
            with pytest.raises(ValueError, match=f"'{name}' is .*, which rounds to inf in FP32"):
                fp16fx.transforms.check_hyperparam(name, x)
    assert fp16fx.transforms.check_hyperparam("max_norm", x or 1.0) == (x or 1.0)  # no limit


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: fp16fx.adam(lr=-1e-3), "'lr' must be >= 0"),
        (lambda: fp16fx.sgd(0.1, momentum=-0.5), "'momentum' must be >= 0"),
        (lambda: fp16fx.adamw(betas=(1.5, 0.9)), r"'betas' must be a pair of numbers in \[0, 1\)"),
        (lambda: fp16fx.clip_by_global_norm(0.0), "'max_norm' must be > 0"),
        (lambda: fp16fx.adam(lr=1e39), "'lr' is 1e\\+39, which rounds to inf in FP32"),
        (
            lambda: fp16fx.sgd(0.1, momentum=0.9, dampening=-1e300),
            "'dampening' is -1e\\+300, which rounds to inf",
        ),
        (lambda: fp16fx.chain(), "at least one transform"),
        (lambda: fp16fx.multi_transform(fp16fx.sgd(1.0), [0]), "a list of .* got one transform"),
        (lambda: fp16fx.multi_transform([fp16fx.sgd(1.0)], None), "needs labels"),
    ],
)
def test_bad_optimizer_arguments_are_refused(factory, message):
    with pytest.raises((ValueError, TypeError), match=message):
        factory()


def _decayed(labels):
    """Which params of a two-layer FP16 model a step with zero grads changes, when
    ``labels`` route them to SGD with weight decay (0) or without (1)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).half()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = fp16fx.multi_transform([fp16fx.sgd(1.0, weight_decay=0.5), fp16fx.sgd(1.0)], labels)
    state = fp16fx.init(params, opt, fp16fx.StaticLossScale(1.0))
    state, _ = fp16fx.step(state, {name: torch.zeros_like(p) for name, p in params.items()})
    return {name for name in params if not torch.equal(state.params[name], params[name])}


def test_multi_transform_labels_a_dict_of_params_by_name():
    """A flat list for named_parameters() (weight before bias) once routed by optree's
    sorted order instead: the biases were decayed and the weights not, silently."""
    weights = {"0.weight", "1.weight"}
    by_name = {"0.weight": 0, "0.bias": 1, "1.weight": 0, "1.bias": 1}
    assert _decayed(by_name) == weights
    by_rank = {"0.weight": 0, "0.bias": 1, "1.weight": 0, "1.bias": 1}
    assert _decayed(lambda params: {n: by_rank[n] for n in params}) == weights  # optax's form
    with pytest.raises(ValueError, match="keys are not in sorted order"):
        _decayed([0, 1, 0, 1])  # named_parameters()' order, which optree's is not
    # A dict whose keys are given sorted takes a flat list in that order.
    opt = fp16fx.multi_transform([fp16fx.sgd(1.0), fp16fx.sgd(0.5)], [1, 0])
    state = fp16fx.init({"a": torch.ones(2), "b": torch.ones(2)}, opt, fp16fx.NoLossScale())
    state, _ = fp16fx.step(state, {"a": torch.ones(2), "b": torch.ones(2)})
    assert state.params["a"].tolist() == [0.5, 0.5] and state.params["b"].tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    ("labels", "error", "message"),
    [
        ({"a": 0, "b": 2}, ValueError, r"label of params\['b'\] is 2: there are 2"),
        ({"a": 0, "b": "x"}, TypeError, r"label of params\['b'\] is 'x', not an index"),
        ({"a": 0, "b": True}, TypeError, "not an index"),
        ([0, {1}], TypeError, r"label of params\['b'\] is \{1\}, not an index"),  # unhashable
        ([0, 1, 1], ValueError, "neither the structure of the params"),
    ],
)
def test_multi_transform_labels_that_do_not_fit_the_params_are_named(labels, error, message):
    opt = fp16fx.multi_transform([fp16fx.sgd(1.0), fp16fx.sgd(0.1)], labels)
    with pytest.raises(error, match=message):
        fp16fx.init({"a": torch.ones(2), "b": torch.ones(2)}, opt)


def test_numpy_numbers_are_taken_as_python_ones():
    """np.float32 hyperparameters, scales and group indices were refused as "not a number"
    (torch.optim takes them); they are stored as Python numbers, so a checkpoint still loads
    with weights_only=True."""
    import numpy as np  # the test extra brings it (scikit-learn)

    policy = fp16fx.DynamicLossScale(init_scale=np.float32(1024), growth_interval=np.int64(10))
    assert (type(policy.init_scale), type(policy.growth_interval)) == (float, int)
    opt = fp16fx.multi_transform([fp16fx.adam(np.float32(0.5)), fp16fx.sgd(0.1)], [0, 1])
    state = fp16fx.init([torch.ones(2), torch.ones(2)], opt, policy)
    state = fp16fx.set_hyperparams(state, group=np.int64(1), lr=np.float64(0.25))
    assert [g["lr"] for g in fp16fx.get_hyperparams(state)] == [0.5, 0.25]
    buffer = io.BytesIO()
    torch.save(fp16fx.state_dict(state), buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["policy"]["init_scale"] == 1024.0
    with pytest.raises(ValueError, match="growth_interval must be an int >= 1, got True"):
        fp16fx.DynamicLossScale(growth_interval=True)


def test_multi_transform_labels_are_taken_as_given_when_built():
    """Review of the labels-by-tree change: a single tensor's [0], a generator, a list the
    caller changes later, equal labels over an unsorted dict, and two multi_transforms of
    one chain labelling alike all worked before it, and work again."""
    sgd = fp16fx.sgd
    fp16fx.init(torch.ones(3), fp16fx.multi_transform([sgd(0.1)], [0]))
    fp16fx.init(torch.ones(3), fp16fx.multi_transform([sgd(0.1)], (label for label in [0])))
    labels = [1, 0]
    opt = fp16fx.multi_transform([sgd(1.0), sgd(0.5)], labels)
    labels[0] = 0  # after building: changes nothing
    state = fp16fx.init([torch.ones(2), torch.ones(2)], opt, fp16fx.NoLossScale())
    state, _ = fp16fx.step(state, [torch.ones(2), torch.ones(2)])
    assert [p.tolist() for p in state.params] == [[0.5, 0.5], [0.0, 0.0]]
    fp16fx.init(
        {"w": torch.ones(2), "b": torch.ones(2)}, fp16fx.multi_transform([sgd(0.1)], [0, 0])
    )
    both = [fp16fx.multi_transform([sgd(0.1), sgd(0.2)], [0, 1]) for _ in range(2)]
    fp16fx.init([torch.ones(2), torch.ones(2)], fp16fx.chain(*both))
    with pytest.raises(ValueError, match="must label the params alike"):
        fp16fx.chain(both[0], fp16fx.multi_transform([sgd(0.1), sgd(0.2)], [1, 0]))


class _SeenState(NamedTuple):
    count: Any  # per value: the steps that gave it a nonzero gradient


def test_a_transforms_own_per_value_float_count_round_trips_through_the_state_dict():
    """A field of one's own may be called ``count``: per value and floating, it is no step
    count (a check of 4c6eb10's, by its name alone, refused this state's own dict)."""

    def init(params):
        return _SeenState(optree.tree_map(torch.zeros_like, params))

    def update(updates, state, params):
        counts = optree.tree_map(lambda u, c: c + (u != 0), updates, state.count)
        return optree.tree_map(lambda u, c: u / c.clamp(min=1), updates, counts), _SeenState(counts)

    seen = fp16fx.GradientTransformation(init, update)
    state = fp16fx.init({"w": torch.ones(4, 3).half()}, fp16fx.chain(seen, fp16fx.sgd(1e-2)))
    state, _ = fp16fx.step(state, {"w": torch.ones(4, 3).half()})
    fresh = fp16fx.init({"w": torch.ones(4, 3).half()}, fp16fx.chain(seen, fp16fx.sgd(1e-2)))
    loaded = fp16fx.load_state_dict(fresh, fp16fx.state_dict(state))
    count = fp16fx.state_dict(loaded)["params"]["w"]["opt[0].count"]
    assert torch.equal(count, torch.ones(4, 3))


class _HitsState(NamedTuple):
    hits: Any  # per value: the steps that gave it a nonzero gradient, in a dtype of one's own


def _counting_hits(dtype: torch.dtype) -> fp16fx.GradientTransformation:
    def init(params):
        return _HitsState(optree.tree_map(lambda p: torch.zeros_like(p, dtype=dtype), params))

    def update(updates, state, params):
        hits = optree.tree_map(lambda u, c: c + (u != 0).to(c.dtype), updates, state.hits)
        return updates, _HitsState(hits)

    return fp16fx.GradientTransformation(init, update)


@pytest.mark.parametrize(("dtype", "moments"), [(torch.float64, "fp32"), (torch.float16, "int8")])
def test_a_transforms_own_state_in_a_float_dtype_of_its_own_round_trips(dtype, moments):
    """Per-param state that init and the step take round-trips in its own dtype, and a dict
    holding it in another is refused by its key (an FP64 state's own dict was refused as
    "not FP32 or BF16"; FP16 state under int8 moments failed to build in torch's words, its
    scales made in FP16)."""

    def fresh():
        optimizer = fp16fx.chain(_counting_hits(dtype), fp16fx.sgd(1e-2, momentum=0.9))
        return fp16fx.init({"w": torch.ones(4, 3).half()}, optimizer, moments=moments)

    state, _ = fp16fx.step(fresh(), {"w": torch.ones(4, 3).half()})
    saved = fp16fx.checkpoint.state_dict_copy(state)
    loaded = fp16fx.state_dict(fp16fx.load_state_dict(fresh(), saved))["params"]["w"]
    assert loaded.keys() == saved["params"]["w"].keys()
    assert all(same_bits(v, saved["params"]["w"][k]) for k, v in loaded.items())
    if moments == "fp32":
        other = 0.5 + saved["params"]["w"]["opt[0].hits"].float()
        saved["params"]["w"]["opt[0].hits"] = other
        untouched = fresh()
        with pytest.raises(fp16fx.StateDictError, match=r"\['opt\[0\].hits'\] has dtype"):
            fp16fx.load_state_dict(untouched, saved)
        assert not untouched.opt_state[0].hits[0].any()


def test_a_transforms_own_integer_state_per_value_is_refused_when_built():
    """A state dict tells a step count by its dtype: a 0-d param's int32 hits, saved 0-d,
    loaded as a count that cut the state anew; before, no dict of such a state loaded."""
    with pytest.raises(TypeError, match=r"torch.int32 values per param at state\[0\]"):
        fp16fx.init({"w": torch.ones(3).half()}, fp16fx.chain(_counting_hits(torch.int32)))


def test_a_transforms_own_floating_value_per_param_is_refused_when_built():
    """One FP32 value per param (a running maximum, say) stepped and saved, and then its own
    state dict was refused: "['opt[0].seen'] has shape (); its ['param'] has (3,)"."""

    def init(params):
        return optree.tree_map(lambda p: torch.zeros((), dtype=torch.float32), params)

    running_max = fp16fx.GradientTransformation(init, lambda u, s, params: (u, s))
    params = {"w": torch.ones(4, 3).half(), "b": torch.ones(3).half()}
    with pytest.raises(TypeError, match=r"one torch.float32 value per param at state\["):
        fp16fx.init(params, fp16fx.chain(running_max, fp16fx.sgd(1e-2)))


def test_a_transforms_own_segments_of_no_tensors_are_refused_when_built():
    """Segments of pairs stepped, then the state dict failed in torch's words ("'tuple'
    object has no attribute 'ndim'")."""

    def init(params):
        return Segments([(torch.zeros_like(t), torch.zeros_like(t)) for t in params], params.labels)

    pairs = fp16fx.GradientTransformation(init, lambda updates, state, params: (updates, state))
    with pytest.raises(TypeError, match=r"Segments holding a tuple at state\[0\]"):
        fp16fx.init({"w": torch.ones(3).half()}, fp16fx.chain(pairs, fp16fx.sgd(0.1)))


def _scale_by(coef: float) -> fp16fx.GradientTransformation:
    """A transform of one's own with a hyperparameter fp16fx does not know: ``-coef * u``."""
    return fp16fx.GradientTransformation(
        lambda params: fp16fx.transforms.hyperparams(params, coef=coef),
        lambda updates, h, params: (optree.tree_map(lambda u: -h["coef"].float() * u, updates), h),
    )


def test_a_transforms_own_hyperparameter_changes_saves_and_loads():
    """A hyperparameter of one's own is a number like fp16fx's: set_hyperparams changes it
    without a new transform, and the state's own dict loads (its check knew fp16fx's names
    only, and raised a bare KeyError on any other: no checkpoint of such a state loaded)."""
    grads = {"w": torch.ones(4).half()}
    state = fp16fx.init({"w": torch.zeros(4).half()}, _scale_by(0.25), fp16fx.NoLossScale())
    fp16fx.set_hyperparams(state, coef=0.5, inplace=True)
    state, _ = fp16fx.step(state, grads)
    assert torch.equal(state.params["w"], torch.full((4,), -0.5).half())
    saved = fp16fx.checkpoint.state_dict_copy(state)
    fresh = fp16fx.init({"w": torch.zeros(4).half()}, _scale_by(0.25), fp16fx.NoLossScale())
    loaded = fp16fx.load_state_dict(fresh, saved)
    assert fp16fx.get_hyperparams(loaded) == {"coef": 0.5}
    assert torch.equal(fp16fx.step(loaded, grads)[0].params["w"], torch.full((4,), -1.0).half())
    saved["hyperparams"]["opt['coef']"] = torch.tensor(math.inf, dtype=torch.float64)
    untouched = fp16fx.init({"w": torch.zeros(4).half()}, _scale_by(0.25), fp16fx.NoLossScale())
    with pytest.raises(fp16fx.StateDictError, match="'coef' must be a finite number, got inf"):
        fp16fx.load_state_dict(untouched, saved)
    assert fp16fx.get_hyperparams(untouched) == {"coef": 0.25}


def test_a_transform_state_tensor_that_is_not_per_param_is_refused_by_its_path():
    """A step keeps a transform's per-param state, Hyperparams and GradNorm slots: a global
    count (optax's scale_by_schedule) was dropped by the pure step and the state dict while
    the in-place step kept it, so the two trained differently."""

    def init(params):
        mu = optree.tree_map(torch.zeros_like, params)  # per param: kept
        return {"count": torch.zeros((), dtype=torch.int64), "mu": mu}

    def update(updates, state, params):
        return updates, {**state, "count": state["count"] + 1}

    counting = fp16fx.GradientTransformation(init, update)
    with pytest.raises(TypeError, match=r"tensor at state\[0\]\['count'\] that is not per param"):
        fp16fx.init({"w": torch.ones(3)}, fp16fx.chain(counting, fp16fx.sgd(1.0)))
