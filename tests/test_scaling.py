"""Loss-scale policies: the dynamic rule against a reference model, exact unscaling, errors."""

from __future__ import annotations

import math

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import fp16fx
from fp16fx.scaling import (
    DynamicLossScale,
    NoLossScale,
    StaticLossScale,
    is_power_of_two,
    unscale_and_check,
)


class DynamicScaleMachine(RuleBasedStateMachine):
    """Drives DynamicLossScale.adjust with random finite/non-finite steps and checks it against
    a plain-Python model of the documented rule after every step."""

    @initialize(
        init_exp=st.integers(-4, 24),
        growth_exp=st.integers(0, 2),
        backoff_exp=st.integers(-2, -1),
        growth_interval=st.integers(1, 6),
        hysteresis=st.integers(1, 3),
        min_exp=st.integers(-3, 4),
        span=st.integers(0, 12),
    )
    def setup(self, init_exp, growth_exp, backoff_exp, growth_interval, hysteresis, min_exp, span):
        self.policy = DynamicLossScale(
            init_scale=2.0**init_exp,
            growth_factor=2.0**growth_exp,
            backoff_factor=2.0**backoff_exp,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            min_scale=2.0**min_exp,
            max_scale=2.0 ** (min_exp + span),
        )
        self.state = self.policy.init()
        p = self.policy
        self.scale = min(max(p.init_scale, p.min_scale), p.max_scale)
        self.good = 0
        self.overflows = 0
        self.floored = False

    @rule(finite=st.booleans())
    def step(self, finite):
        p = self.policy
        self.floored = False
        if finite:
            self.good += 1
            if self.good == p.growth_interval:
                self.scale = min(self.scale * p.growth_factor, p.max_scale)
                self.good = self.overflows = 0
        else:
            self.floored = self.scale == p.min_scale
            self.good = 0
            self.overflows += 1
            if self.overflows == p.hysteresis:
                self.scale = max(self.scale * p.backoff_factor, p.min_scale)
                self.overflows = 0
        self.state, floored = self.policy.adjust(self.state, torch.tensor(finite))
        assert bool(floored) == self.floored

    @invariant()
    def matches_reference(self):
        assert self.state.scale.item() == self.scale
        assert self.state.good_steps.item() == self.good
        assert self.state.overflows.item() == self.overflows
        assert self.policy.min_scale <= self.scale <= self.policy.max_scale
        assert self.state.scale.dtype == torch.float32


TestDynamicScaleRule = DynamicScaleMachine.TestCase


def test_growth_happens_after_exactly_growth_interval_clean_steps():
    policy = DynamicLossScale(init_scale=8.0, growth_interval=3)
    state = policy.init()
    scales = []
    for _ in range(7):
        state, _ = policy.adjust(state, torch.tensor(True))
        scales.append(state.scale.item())
    assert scales == [8, 8, 16, 16, 16, 32, 32]


def test_hysteresis_backs_off_on_the_nth_overflow_and_a_clean_step_does_not_reset_it():
    policy = DynamicLossScale(init_scale=64.0, hysteresis=3)
    state = policy.init()
    for finite, expected in [(False, 64), (True, 64), (False, 64), (False, 32), (False, 32)]:
        state, _ = policy.adjust(state, torch.tensor(finite))
        assert state.scale.item() == expected


def test_every_overflow_at_the_floor_is_reported_whatever_the_hysteresis():
    """The scale can go no lower: a closure re-run at it cannot help, back-off or not."""
    policy = DynamicLossScale(init_scale=1.0, min_scale=1.0, hysteresis=2)
    state, floored = policy.adjust(policy.init(), torch.tensor(False))
    assert (state.overflows.item(), floored.item()) == (1, True)
    state, floored = policy.adjust(state, torch.tensor(False))
    assert (state.overflows.item(), floored.item()) == (0, True)
    assert not policy.adjust(state, torch.tensor(True))[1].item()


@pytest.mark.parametrize("backoff_factor", [0.5, 0.25])
def test_floor_clamps_and_reports_an_overflow_that_found_the_scale_there(backoff_factor):
    """A back-off clamped on its way down (2 -> 1, not 0.5) is no floored one: the next
    gradients are made at the lower scale, and may well be finite."""
    policy = DynamicLossScale(init_scale=2.0, min_scale=1.0, backoff_factor=backoff_factor)
    state = policy.init()
    state, floored = policy.adjust(state, torch.tensor(False))
    assert (state.scale.item(), floored.item()) == (1.0, False)
    state, floored = policy.adjust(state, torch.tensor(False))
    assert (state.scale.item(), floored.item()) == (1.0, True)


def test_the_norm_of_a_sparse_grad_sums_repeated_indices_first():
    """An embedding's sparse grad repeats a row's index for each repeated token: its norm is
    the dense grad's, not that of its entries apart."""
    grad = torch.sparse_coo_tensor([[1, 1, 1]], torch.ones(3, 2), (4, 2), check_invariants=True)
    checked = unscale_and_check([grad], torch.tensor(2.0))
    dense_norm = torch.linalg.vector_norm(grad.to_dense() / 2)
    assert checked.norm.item() == dense_norm.item() and dense_norm.item() > 2.1


@pytest.mark.parametrize("policy", [NoLossScale(), StaticLossScale(1000.0)])
def test_fixed_policies_never_move(policy):
    state = policy.init()
    first = state.scale.clone()  # (adjust hands the state back: one written in place moved)
    for finite in [False, True, False]:
        state, floored = policy.adjust(state, torch.tensor(finite))
        assert state.scale.item() == first.item() and not floored


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"growth_factor": 3.0}, "growth_factor must be a power of two"),
        ({"backoff_factor": 0.3}, "backoff_factor must be a power of two"),
        ({"init_scale": 1000.0}, "init_scale must be a power of two"),
        ({"init_scale": -2.0}, "init_scale must be a finite number > 0"),
        ({"growth_factor": 0.5}, "growth_factor must be >= 1"),
        # It would never back off: a closure that overflows would be re-run for ever.
        ({"backoff_factor": 1.0}, "backoff_factor must be < 1"),
        ({"growth_interval": 0}, "growth_interval must be an int >= 1"),
        ({"hysteresis": 1.5}, "hysteresis must be an int >= 1"),
        # An int32 counter would wrap in the comparison: growth after every step.
        ({"growth_interval": 2**31}, r"growth_interval must be at most 2\*\*31 - 1.*max_scale"),
        ({"hysteresis": 2**31}, r"hysteresis must be at most 2\*\*31 - 1"),
        ({"min_scale": 4.0, "max_scale": 2.0}, "must not exceed max_scale"),
        # Powers of two beyond FP32's normal range: the state's scale would be inf, or 0.
        ({"max_scale": 2.0**128}, "max_scale must be .* FP32 holds as a normal value"),
        ({"init_scale": 2.0**-127}, "init_scale must be .* FP32 holds as a normal value"),
    ],
)
def test_bad_configuration_is_refused_with_a_clear_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicLossScale(**kwargs)


def test_the_largest_interval_and_hysteresis_are_counted_in_full():
    top = 2**31 - 1
    policy = DynamicLossScale(init_scale=2.0**10, growth_interval=top, hysteresis=top)
    state = policy.init()
    state.good_steps.fill_(top - 2)
    finite, overflow = torch.tensor(True), torch.tensor(False)
    state, _ = policy.adjust(state, finite)
    assert state.scale.item() == 2.0**10 and state.good_steps.item() == top - 1
    grown, _ = policy.adjust(state, finite)
    assert grown.scale.item() == 2.0**11 and grown.good_steps.item() == 0
    kept, _ = policy.adjust(state, overflow)  # one overflow of 2**31 - 1 tolerated
    assert kept.scale.item() == 2.0**10 and kept.overflows.item() == 1


def test_static_scale_must_be_positive():
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        StaticLossScale(0.0)
    for outside in (1e39, 1e-46):  # inf and 0 in the state's FP32 tensor
        with pytest.raises(ValueError, match="FP32 holds as a normal value"):
            StaticLossScale(outside)
    edges = DynamicLossScale(min_scale=2.0**-126, max_scale=2.0**127, init_scale=2.0**127)
    assert edges.init().scale.item() == 2.0**127  # FP32's range itself is accepted


@given(
    init_exp=st.integers(0, 20),
    floor_exp=st.integers(-8, 0),
    hysteresis=st.integers(1, 3),
    growth_interval=st.integers(1, 100),
)
def test_a_flattened_state_keeps_its_policy_down_to_the_floor(
    init_exp, floor_exp, hysteresis, growth_interval
):
    """jmp's DynamicLossScale lost min_loss_scale when flattened: a state rebuilt from its
    leaves then backed off below the floor. fp16fx keeps the policy in the tree's static
    part: the rebuilt state's policy is the one given, and overflows stop at its floor."""
    policy = DynamicLossScale(
        init_scale=2.0**init_exp,
        min_scale=2.0**floor_exp,
        hysteresis=hysteresis,
        growth_interval=growth_interval,
    )
    state = fp16fx.init({"w": torch.ones(3).half()}, fp16fx.sgd(0.1), policy)
    leaves, treedef = optree.tree_flatten(state)
    assert all(isinstance(x, torch.Tensor) for x in leaves)
    rebuilt = optree.tree_unflatten(treedef, leaves)
    assert rebuilt.policy == policy
    for _ in range((init_exp - floor_exp + 2) * hysteresis):
        rebuilt, info = fp16fx.step(rebuilt, {"w": torch.full((3,), math.inf).half()})
        assert not info["finite"].item()
    assert rebuilt.loss_scale.scale.item() == 2.0**floor_exp


@given(
    exp=st.integers(-10, 24),
    values=st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=16), min_size=1, max_size=30),
)
def test_unscaling_by_a_power_of_two_is_exact(exp, values):
    scale = 2.0**exp
    grads = torch.tensor(values, dtype=torch.float16)
    (unscaled,), finite, norm = unscale_and_check([grads], torch.tensor(scale))
    assert torch.equal(unscaled, grads.double().div(scale).float())
    assert finite.item()
    expected = math.sqrt(sum((v / scale) ** 2 for v in grads.tolist()))
    assert norm.item() == pytest.approx(expected, rel=1e-6, abs=1e-30)


@given(
    bad=st.sampled_from([math.inf, -math.inf, math.nan]),
    n=st.integers(1, 20),
    data=st.data(),
)
def test_any_non_finite_element_anywhere_is_detected(bad, n, data):
    grads = [torch.randn(n).half(), torch.randn(3, 2)]
    leaf = data.draw(st.integers(0, 1))
    index = data.draw(st.integers(0, grads[leaf].numel() - 1))
    grads[leaf].view(-1)[index] = bad
    _, finite, _ = unscale_and_check(grads, torch.tensor(1024.0))
    assert not finite.item()


def test_is_power_of_two():
    assert [is_power_of_two(x) for x in (1.0, 0.25, 2.0**30, 3.0, 0.0, -2.0, math.inf)] == [
        True,
        True,
        True,
        False,
        False,
        False,
        False,
    ]


def test_adjust_and_unscale_and_check_name_arguments_of_another_kind():
    """A long or float ``finite`` once failed in torch.where, a 2-element one broadcast the
    scale state to shape (2,); a None grad or the state in place of its scale failed deep in
    torch."""
    policy = DynamicLossScale()
    state = policy.init()
    for finite in (torch.tensor(1), torch.tensor([True, False]), True):
        with pytest.raises(TypeError, match="finite as a 0-d bool tensor"):
            policy.adjust(state, finite)
    with pytest.raises(TypeError, match="finite as a 0-d bool tensor"):
        StaticLossScale(1.0).adjust(StaticLossScale(1.0).init(), torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"grads\[0\] is None, not a tensor"):
        unscale_and_check([None, torch.ones(2)], state.scale)
    with pytest.raises(TypeError, match=r"state.loss_scale.scale"):
        unscale_and_check([torch.ones(2)], state)


def test_unscale_and_check_reads_a_generator_of_grads_as_a_list():
    """A generator was spent by the check for non-tensors: an inf in it came out finite."""
    grads = [torch.tensor([float("inf")]).half(), torch.ones(3).half()]
    as_list = unscale_and_check(grads, torch.tensor(2.0))
    as_generator = unscale_and_check((g for g in grads), torch.tensor(2.0))
    assert not as_generator.finite and torch.equal(as_generator.norm, as_list.norm)
    assert [torch.equal(a, b) for a, b in zip(as_generator.unscaled, as_list.unscaled)] == [
        True,
        True,
    ]
