"""FP16_Optimizer in apex's usage shapes, against reference loops written from apex's rules.

Every test runs both engines against a reference loop, bitwise:

* ``generic`` (the wrapped torch optimizer on FP32 masters) against apex's algorithm written
  out with torch.optim on FP32 masters and the dynamic-scale rule;
* ``fast`` (flat buffers, segments, the core's transforms; run eagerly here) against the same
  loop with the optimizer update done by the functional core on per-param leaves
  (``fp16fx.compile.StepFunction``, eager). Elementwise math does not care about flat buffers,
  so any difference is a bookkeeping bug of the facade.

That the fast path's transforms match torch.optim's options is tested over a few steps with a
tight tolerance (its arithmetic is ordered differently, and over many steps a last-bit
difference in a master can flip the rounding of its FP16 param, which the next forward then
amplifies). The compiled fast path is tested in test_facade_compiled.py.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fp16fx
from fp16fx.compile import StepFunction
from fp16fx.facade.policy import NO_FLOOR
from fp16fx.fp16_utils import (
    FP16_Optimizer,
    FP16Model,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
)

PATHS = ["fast", "generic"]
INF = float("inf")


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).half()


def make_data(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(16, 6, generator=g).half(), torch.randn(16, 3, generator=g)) for _ in range(n)
    ]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x).float() - y) ** 2).mean()


class Poison:
    """A grad hook on the model's first param that turns its gradient into inf/NaN on demand."""

    def __init__(self, model: nn.Module) -> None:
        self.on = False
        next(model.parameters()).register_hook(lambda g: g * INF if self.on else g)


def wrap(model, inner, path, **kwargs) -> FP16_Optimizer:
    return FP16_Optimizer(
        inner(model.parameters()), path=path, compiled=False, verbose=False, **kwargs
    )


def facade_run(model, opt, data, poison=(), *, clip=None, micro=1):
    """The apex training loop; returns [(loss, loss scale used, skipped)] per step."""
    hook, trace = Poison(model), []
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        scale = opt.loss_scale
        hook.on = i in poison
        if micro == 1:
            loss = loss_fn(model, x, y)
            opt.backward(loss)
        else:
            for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
                loss = loss_fn(model, xs, ys)
                opt.backward(loss, update_master_grads=False)
            opt.update_master_grads()
        if clip is not None:
            opt.clip_master_grads(clip)
        opt.step()
        trace.append((loss.item(), scale, opt.overflow))
    return trace


def reference_run(model, inner, data, poison=(), *, scale, window=None, clip=None, micro=1):
    """apex's FP16_Optimizer written out, the update by ``inner`` (a torch.optim factory) on
    FP32 masters or, if ``inner`` is an fp16fx transform, by the functional core.

    With a ``window``: the dynamic rule (halve on overflow, no floor; double after ``window``
    clean steps, capped at 2**24). Returns the trace as :func:`facade_run` and the masters.
    """
    hook, trace = Poison(model), []
    params = list(model.parameters())
    if isinstance(inner, fp16fx.GradientTransformation):
        return core_run(model, inner, data, poison, scale=scale, window=window, micro=micro)
    masters = [p.detach().clone().float().requires_grad_() for p in params]
    opt, clean = inner(masters), 0
    for i, (x, y) in enumerate(data):
        for p in params:
            p.grad = None
        hook.on = i in poison
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            loss = loss_fn(model, xs, ys)
            (loss.float() * scale).backward()
        finite = all(bool(torch.isfinite(p.grad).all()) for p in params)
        trace.append((loss.item(), scale, not finite))
        if not finite:
            scale, clean = (scale / 2, 0) if window else (scale, 0)
            continue
        for p, m in zip(params, masters):
            m.grad = p.grad.float() * (1.0 / scale)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        clean += 1
        if window and clean == window:
            scale, clean = min(scale * 2, 2.0**24), 0
    return trace, masters


def core_run(model, transform, data, poison=(), *, scale, window=None, micro=1):
    """The same loop with the functional core doing unscale/check/update/scale per param."""
    hook, trace = Poison(model), []
    params = list(model.parameters())
    policy = (
        fp16fx.DynamicLossScale(scale, growth_interval=window, min_scale=NO_FLOOR)
        if window
        else fp16fx.StaticLossScale(scale)
    )
    state = fp16fx.init(params, transform, policy)
    step = StepFunction(inplace=True, compile_options=None)  # the core, eagerly, in place
    for i, (x, y) in enumerate(data):
        for p in params:
            p.grad = None
        hook.on = i in poison
        scale = state.loss_scale.scale.item()
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            loss = loss_fn(model, xs, ys)
            fp16fx.scale_loss(state, loss).backward()
        state, info = step(state, [p.grad for p in params])
        trace.append((loss.item(), scale, not bool(info["finite"])))
    return trace, list(state.master)


def masters_of(opt: FP16_Optimizer) -> list[torch.Tensor]:
    return [p.detach().clone() for g in opt.param_groups for p in g["params"]]


def assert_same(got, want):
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def assert_close_engines(fast, generic):
    """The core's SGD/Adam against torch.optim's over a few steps: float32 rounding."""
    for a, b in zip(fast, generic, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def mixed_model() -> nn.Module:
    """An FP32 layer, whose params are their own masters, feeding an FP16 one."""
    torch.manual_seed(0)
    return nn.ModuleList([nn.Linear(6, 3), nn.Linear(3, 3).half()])


def mixed_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model[1](torch.tanh(model[0](x.float())).half()).float() - y) ** 2).mean()


#: A dynamic loss scale that grows after every clean step.
GROWING = {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 64.0, "scale_window": 1}}


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)


def adam(params):
    return torch.optim.Adam(params, lr=1e-3, weight_decay=1e-3)


#: What each path is compared with: torch.optim on masters, or the core's same transform.
REFERENCE = {
    ("generic", sgd): sgd,
    ("fast", sgd): fp16fx.sgd(0.05, momentum=0.9, weight_decay=1e-3),
    ("generic", adam): adam,
    ("fast", adam): fp16fx.adam(1e-3, weight_decay=1e-3),
}


@pytest.mark.parametrize("path", PATHS)
def test_static_scale_sgd_with_momentum_matches_reference(path):
    data = make_data(8)
    opt = wrap(model := make_model(), sgd, path, static_loss_scale=128.0)
    assert opt.path == path and not opt.dynamic_loss_scale and opt.loss_scale == 128.0
    got = facade_run(model, opt, data)
    want, masters = reference_run(make_model(), REFERENCE[path, sgd], data, scale=128.0)
    assert got == want and [t[1:] for t in got] == [(128.0, False)] * 8
    assert_same(masters_of(opt), masters)


@pytest.mark.parametrize("path", PATHS)
def test_static_scale_skips_an_overflowing_step_instead_of_applying_it(path):
    # apex applied inf grads at a static scale (its static scaler never checks); fp16fx skips.
    opt = wrap(model := make_model(), sgd, path, static_loss_scale=128.0)
    data = make_data(3)
    facade_run(model, opt, data[:1])
    before = masters_of(opt) + [p.detach().clone() for p in model.parameters()]
    trace = facade_run(model, opt, data[1:2], poison={0})
    assert trace[0][2] is True and opt.skipped_steps == 1 and opt.loss_scale == 128.0
    after = masters_of(opt) + [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@settings(max_examples=12, deadline=None)
@given(poison=st.sets(st.integers(0, 11), max_size=5), path=st.sampled_from(PATHS))
def test_dynamic_scale_trajectory_matches_reference_with_injected_overflows(poison, path):
    data = make_data(12)
    args = {"init_scale": 2.0**10, "scale_window": 3}
    opt = wrap(model := make_model(), adam, path, dynamic_loss_scale=True, dynamic_loss_args=args)
    got = facade_run(model, opt, data, poison)
    ref = REFERENCE[path, adam]
    want, masters = reference_run(make_model(), ref, data, poison, scale=2.0**10, window=3)
    assert got == want  # loss, loss scale used, skipped: every step
    assert opt.skipped_steps == len(poison)
    assert_same(masters_of(opt), masters)


def first_call_overflows(opt, model, data, calls):
    """Returns the apex closure over ``data``, recording in ``calls`` the loss scale of each
    call; the very first call's gradient overflows."""
    hook = Poison(model)

    def closure():
        calls.append(opt.loss_scale)
        opt.zero_grad()
        hook.on = len(calls) == 1
        loss = loss_fn(model, *data)
        opt.backward(loss)
        return loss

    return closure


def test_lbfgs_with_closure_reruns_the_closure_on_overflow_like_apex():
    data = make_data(1)[0]
    model, calls = make_model(), []
    opt = FP16_Optimizer(
        torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4),
        dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**10}, verbose=False,
    )  # fmt: skip
    assert opt.path == "generic"
    closure = first_call_overflows(opt, model, data, calls)
    for _ in range(3):
        opt.step(closure)
    assert calls[:2] == [2.0**10, 2.0**9] and set(calls[1:]) == {2.0**9}

    # Reference: LBFGS on FP32 masters at the scale apex settled on, refreshing the FP16
    # model from the masters before every closure call, as apex's wrapped closure does.
    ref = make_model()
    params = list(ref.parameters())
    masters = [p.detach().clone().float().requires_grad_() for p in params]
    lbfgs, ref_calls = torch.optim.LBFGS(masters, lr=0.5, max_iter=4), []

    def ref_closure():
        ref_calls.append(1)
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
                p.grad = None
        loss = loss_fn(ref, *data)
        (loss.float() * 2.0**9).backward()
        for p, m in zip(params, masters):
            m.grad = p.grad.float() / 2.0**9
        return loss

    for _ in range(3):
        lbfgs.step(ref_closure)
    assert len(calls) == len(ref_calls) + 1
    assert all(torch.equal(a, b) for a, b in zip(masters_of(opt), masters))
    assert all(torch.equal(p, m.half()) for p, m in zip(model.parameters(), masters))


def lbfgs(params):
    return torch.optim.LBFGS(params, lr=0.5, max_iter=4)


@pytest.mark.parametrize(
    ("path", "inner"),
    [("fast", adam), ("generic", adam), ("generic", lbfgs)],
    ids=["fast-adam", "generic-adam", "generic-lbfgs"],
)
def test_a_closure_step_moves_the_scale_once_however_often_the_closure_runs(path, inner):
    """The generic path once moved the scale at every finite closure call: LBFGS, which
    calls it several times a step, counted each as a clean step, and with a window of 3
    the scale grew within the first step. An overflow inside a closure backs the scale off
    (the re-run then helps, as in apex); the step then counts one clean step."""
    data = make_data(1)[0]
    model, calls = make_model(), []
    args = {"init_scale": 2.0**10, "scale_window": 3}
    opt = wrap(model, inner, path, dynamic_loss_scale=True, dynamic_loss_args=args)
    closure = first_call_overflows(opt, model, data, calls)
    scales, per_step = [], []
    for _ in range(4):
        before = len(calls)
        opt.step(closure)
        per_step.append(len(calls) - before)
        scales.append(opt.loss_scale)
    assert per_step[0] >= 2 and calls[:2] == [2.0**10, 2.0**9]  # the overflow, the re-run
    if inner is lbfgs:
        assert min(per_step[1:]) > 1  # LBFGS calls the closure several times a step
    # Step 1 backs off once and counts one clean step; the third clean step grows the scale.
    assert scales == [2.0**9, 2.0**9, 2.0**10, 2.0**10]
    assert opt.state_dict()["loss_scaler"]["good_steps"] == 1
    assert not opt.overflow and opt.skipped_steps == 1


@pytest.mark.parametrize("path", PATHS)
def test_closure_that_can_never_be_finite_raises_and_changes_nothing(path):
    model = make_model()
    opt = wrap(model, adam, path, static_loss_scale=8.0)
    hook = Poison(model)
    hook.on = True
    before = [p.detach().clone() for p in model.parameters()]

    def closure():
        opt.zero_grad()
        loss = loss_fn(model, *make_data(1)[0])
        opt.backward(loss)
        return loss

    with pytest.raises(FloatingPointError, match="static loss scale 8"):
        opt.step(closure)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("path", PATHS)
def test_grads_made_after_a_closure_step_that_raised_are_stepped(path):
    """The generic path took a raised closure step's inf grads, unscaled into its masters,
    for the grads a plain ``loss.backward()`` made next: that step skipped."""
    model = make_model()
    opt = wrap(model, adam, path, static_loss_scale=8.0)
    hook = Poison(model)
    x, y = make_data(1)[0]

    def closure():
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        opt.backward(loss)
        return loss

    hook.on = True
    with pytest.raises(FloatingPointError):
        opt.step(closure)
    hook.on = False
    before = [p.detach().clone() for p in model.parameters()]
    model.zero_grad()
    (loss_fn(model, x, y) * 8.0).backward()  # grads of the scaled loss, without backward()
    opt.step()
    assert not opt.overflow
    assert not any(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("path", PATHS)
def test_a_closure_that_raises_before_making_grads_leaves_the_pending_ones(path):
    """A closure that raised before its backward (the data ran out) once marked the grads
    of the backward before it spent: ``overflow`` then read the last step's result."""
    model = make_model()
    opt = wrap(model, adam, path, dynamic_loss_scale=True)
    hook = Poison(model)
    hook.on = True
    opt.backward(loss_fn(model, *make_data(1)[0]))
    assert opt.overflow

    def exhausted():
        raise StopIteration

    with pytest.raises(StopIteration):
        opt.step(exhausted)
    assert opt.overflow and opt.inspect_master_grad_data() is None


@pytest.mark.parametrize("path", PATHS)
def test_first_closure_call_this_step_reads_as_apex_left_it(path):
    """apex's wrapped closure set the flag False before its first call: inside the closure
    it reads False, on the re-run after an overflow too (the fast path read True)."""
    model, seen = make_model(), []
    opt = wrap(model, adam, path, dynamic_loss_scale=True)
    hook = Poison(model)

    def closure():
        seen.append(opt.first_closure_call_this_step)
        opt.zero_grad()
        hook.on = len(seen) == 1  # the first attempt overflows
        loss = loss_fn(model, *make_data(1)[0])
        opt.backward(loss)
        return loss

    opt.step(closure)
    assert seen == [False, False] and opt.first_closure_call_this_step


def test_closure_on_the_fast_path_matches_the_generic_path():
    results = {}
    for path in PATHS:
        model, data, calls = make_model(), make_data(4), []
        opt = wrap(
            model, adam, path, dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**8}
        )
        hook = Poison(model)
        for i, (x, y) in enumerate(data):

            def closure(x=x, y=y, i=i, model=model, opt=opt, hook=hook, calls=calls):
                calls.append(i)
                opt.zero_grad()
                hook.on = i == 1 and calls.count(i) == 1  # step 1's first attempt overflows
                loss = loss_fn(model, x, y)
                opt.backward(loss)
                return loss

            opt.step(closure)
        results[path] = (calls, opt.loss_scale, masters_of(opt))
    assert results["fast"][:2] == results["generic"][:2] == ([0, 1, 1, 2, 3], 2.0**7)
    assert_close_engines(results["fast"][2], results["generic"][2])


def test_a_closure_runs_once_in_a_step_that_hands_over_to_the_generic_path():
    # maximize=True, which the fast path lacks, is seen once the closure made the grads: the
    # generic path steps those. Run again, a closure drawing batches would skip one.
    results = {}
    for path in PATHS:
        model, batches = make_model(), iter(make_data(3))
        opt = wrap(model, adam, path, static_loss_scale=8.0)

        def closure(model=model, opt=opt, batches=batches):
            opt.zero_grad()
            loss = loss_fn(model, *next(batches))
            opt.backward(loss)
            return loss

        opt.step(closure)
        opt.param_groups[0]["maximize"] = True
        opt.step(closure)
        assert opt.path == "generic"
        results[path] = (len(list(batches)), masters_of(opt))
    assert results["fast"][0] == results["generic"][0] == 1  # one batch left: two drawn
    assert_close_engines(results["fast"][1], results["generic"][1])


def test_a_group_the_fast_path_lacks_added_by_a_closure_switches_paths_in_that_step():
    """The generic path steps the grads that closure made, as where the group was added
    before the step; the closure runs once. (The step once failed in a bare AssertionError.)"""
    results = {}
    for inside in (True, False):
        model, batches = make_model(), iter(make_data(3))
        group = {"params": [nn.Parameter(torch.ones(3, dtype=torch.float16))], "maximize": True}
        opt = wrap(model, adam, "fast", static_loss_scale=8.0)
        adding = []  # the closure adds the group in the second step, if inside

        def closure(model=model, opt=opt, batches=batches, adding=adding, group=group):
            opt.zero_grad()
            loss = loss_fn(model, *next(batches))
            opt.backward(loss)
            if adding:
                opt.add_param_group(adding.pop())
            return loss

        opt.step(closure)
        assert opt.path == "fast"
        if inside:
            adding.append(group)
        else:
            opt.add_param_group(group)
        opt.step(closure)
        assert opt.path == "generic" and len(list(batches)) == 1  # two drawn
        results[inside] = masters_of(opt)
    assert_same(results[True], results[False])


@pytest.mark.parametrize("path", PATHS)
def test_gradient_accumulation_moves_the_scale_once_per_update(path):
    data = make_data(4)
    args = {"init_scale": 2.0**8, "scale_window": 2}
    opt = wrap(model := make_model(), adam, path, dynamic_loss_scale=True, dynamic_loss_args=args)
    got = facade_run(model, opt, data, micro=4)
    ref = REFERENCE[path, adam]
    want, masters = reference_run(make_model(), ref, data, scale=2.0**8, window=2, micro=4)
    assert got == want and [t[1] for t in got] == [2.0**8, 2.0**8, 2.0**9, 2.0**9]
    assert opt.loss_scale == 2.0**10  # 4 updates of 4 micro-batches: grew twice, not 8 times
    assert_same(masters_of(opt), masters)


@pytest.mark.parametrize("path", PATHS)
def test_clip_master_grads_returns_the_unscaled_norm_and_clips(path):
    data = make_data(5)
    opt = wrap(model := make_model(), sgd, path, static_loss_scale=64.0)
    got = facade_run(model, opt, data, clip=0.05)
    want, masters = reference_run(make_model(), sgd, data, scale=64.0, clip=0.05)
    _, unclipped = reference_run(make_model(), sgd, data, scale=64.0)
    assert not all(map(torch.equal, masters, unclipped)), "0.05 clipped nothing: a void test"
    if path == "generic":
        assert got == want
        assert_same(masters_of(opt), masters)
    else:  # the step's own norm, summed in another order: the clip factor's last bit may differ
        assert_close_engines(masters_of(opt), masters)

    x, y = data[0]
    opt.zero_grad()
    opt.backward(loss_fn(model, x, y))
    reference = [p.grad.float() / 64.0 for p in model.parameters()]
    expected = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g) for g in reference])
    )
    norm = opt.clip_master_grads(0.05)
    assert isinstance(norm, float) and norm > 0.05
    assert math.isclose(norm, expected.item(), rel_tol=1e-5)
    Poison(model).on = True
    opt.zero_grad()
    opt.backward(loss_fn(model, x, y))
    assert opt.clip_master_grads(0.05) == -1


# (1e-6, 1e-6): torch's second factor, 1e-6 / (1e-6 + 1e-6), halves the grads again.
@pytest.mark.parametrize("limits", [(1e-3, 10.0), (0.5, 0.05), (10.0, 1e-3), (1e-6, 1e-6)])
def test_clipping_twice_clips_the_clipped_grads_on_both_paths(limits):
    """As clip_grad_norm_ twice (apex's): the second call sees the grads the first clipped
    and returns their norm. The fast path, which folds the clip into the step, once took the
    second limit alone (1e-3 then 10 did not clip) and returned the unclipped norm again."""
    (x, y), *_ = make_data(1)
    norms, moved, applied = {}, {}, {}
    for path in PATHS:
        opt = wrap(model := make_model(), sgd, path, static_loss_scale=64.0)
        before = masters_of(opt)
        opt.zero_grad()
        opt.backward(loss_fn(model, x, y))
        norms[path] = [opt.clip_master_grads(limit) for limit in limits]
        grads = [g.flatten() for group in opt.inspect_master_grad_data() for g in group]
        applied[path] = torch.linalg.vector_norm(torch.cat(grads)).item()  # as the step clips
        opt.step()
        moved[path] = [a - b for a, b in zip(masters_of(opt), before, strict=True)]
    first, second = norms["generic"]
    assert first > 0.1 and math.isclose(second, min(first, limits[0]), rel_tol=1e-4)
    for got, want in zip(norms["fast"], norms["generic"], strict=True):
        assert math.isclose(got, want, rel_tol=1e-5)
    assert math.isclose(applied["fast"], applied["generic"], rel_tol=1e-5)
    assert_close_engines(moved["fast"], moved["generic"])


@pytest.mark.parametrize("then", ["zero_grad, backward", "backward"])
def test_a_clip_is_forgotten_when_new_gradients_replace_the_clipped_ones(then):
    """apex clipped the masters' grads, which the next backward rebuilt: the fast path, which
    folds the clip into the step, once kept it and clipped the new gradients too. Until
    then inspect_master_grad_data shows the grads clipped, as apex's masters held them."""
    (x, y), (x2, y2) = make_data(2)
    moved = {}
    for path in PATHS:
        opt = wrap(model := make_model(), sgd, path, static_loss_scale=64.0)
        before = masters_of(opt)
        opt.zero_grad()
        opt.backward(loss_fn(model, x, y))
        norm = opt.clip_master_grads(1e-3)
        clipped = [g for group in opt.inspect_master_grad_data() for g in group]
        total = torch.linalg.vector_norm(torch.cat([g.flatten() for g in clipped]))
        assert norm > 0.1 and math.isclose(total.item(), 1e-3, rel_tol=1e-4)
        if then == "zero_grad, backward":  # a batch thrown away, another one instead
            opt.zero_grad()
        opt.backward(loss_fn(model, x2, y2))
        opt.step()
        moved[path] = [a - b for a, b in zip(masters_of(opt), before, strict=True)]
    assert_close_engines(moved["fast"], moved["generic"])
    step = torch.linalg.vector_norm(torch.cat([d.flatten() for d in moved["fast"]]))
    assert step > 100 * 0.05 * 1e-3  # lr times the clipped norm: far more, not clipped


@pytest.mark.parametrize("clip", [None, 0.05])
def test_a_second_step_without_backward_steps_the_same_unscaled_grads_on_both_paths(clip):
    """As apex (and torch.optim) step the same grads again. The generic path once unscaled
    an FP32 param's grad (its own master's, unscaled in place) again: an update 1/64 the
    size. The fast path, which reads the scaled grads at each step, once unscaled them by
    the scale the first step had grown: an update half the size."""
    x, y = make_data(1)[0]
    moved = {}
    for path in PATHS:
        model = mixed_model()
        opt = wrap(model, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), path, **GROWING)
        opt.zero_grad()
        opt.backward(mixed_loss(model, x, y))
        if clip is not None:
            opt.clip_master_grads(clip)
        steps = []
        for _ in range(2):
            before = masters_of(opt)
            opt.step()
            steps.append([a - b for a, b in zip(masters_of(opt), before, strict=True)])
        moved[path] = steps
    for path in PATHS:
        first, second = moved[path]
        for a, b in zip(first, second, strict=True):  # momentum 0.9: 1.9 times the first
            torch.testing.assert_close(b, 1.9 * a, rtol=1e-4, atol=1e-7)
    assert_close_engines(moved["fast"][1], moved["generic"][1])


@pytest.mark.parametrize("zero", ["optimizer", "model"])
def test_new_gradients_are_told_from_stepped_ones_however_they_are_zeroed(zero):
    """model.zero_grad() frees the grads, and autograd's new ones have version 0, as the
    fast path's own buffer views once counted: new grads were taken for the stepped ones
    (rescaled by the grown scale, clipped by the last clip). The grads are also kept alive,
    which once made the generic path compare them elementwise (an error)."""
    data, moved, kept = make_data(3), {}, []
    for path in PATHS:
        opt = wrap(model := make_model(), sgd, path, **GROWING)
        moved[path] = []
        for i, (x, y) in enumerate(data):
            (opt if zero == "optimizer" else model).zero_grad()
            opt.backward(loss_fn(model, x, y))
            kept.append([p.grad for p in model.parameters()])
            if i == 0:
                opt.clip_master_grads(1e-3)  # this batch only
            before = masters_of(opt)
            opt.step()
            moved[path].append([a - b for a, b in zip(masters_of(opt), before, strict=True)])
    for fast, generic in zip(moved["fast"], moved["generic"], strict=True):
        assert_close_engines(fast, generic)
    later = torch.linalg.vector_norm(torch.cat([d.flatten() for d in moved["fast"][1]]))
    assert later > 100 * 0.05 * 1e-3  # not clipped


@pytest.mark.parametrize("path", PATHS)
def test_a_clip_holds_across_add_param_group(path):
    """add_param_group moves the fast path's grads into new buffers: still the clipped ones."""
    x, y = make_data(1)[0]
    opt = wrap(model := make_model(), lambda ps: torch.optim.SGD(ps, lr=0.1), path)
    opt.zero_grad()
    opt.backward(loss_fn(model, x, y))
    assert opt.clip_master_grads(1e-3) > 0.1
    opt.add_param_group({"params": list(nn.Linear(2, 2).half().parameters())})
    before = masters_of(opt)[:4]
    opt.step()
    step = torch.cat([(a - b).flatten() for a, b in zip(masters_of(opt), before)])
    assert torch.linalg.vector_norm(step) == pytest.approx(0.1 * 1e-3, rel=1e-3)


@pytest.mark.parametrize("path", PATHS)
def test_a_repeated_step_near_fp16s_largest_value_steps_and_grows_the_scale(path):
    """The fast path once brought stepped grads to the grown scale in place: 40 * 2048 is
    past FP16's range, so the grad became inf for good and every later step skipped."""
    model = nn.Linear(1, 1, bias=False).half()
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = wrap(
        model,
        lambda ps: torch.optim.SGD(ps, lr=1e-3),
        path,
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 1024.0, "scale_window": 1},
    )
    opt.backward(model(torch.full((1, 1), 40.0).half()).float().sum())  # grad 40 * 1024
    for k in range(1, 4):
        opt.step()
        assert opt.loss_scale == 1024.0 * 2**k and not opt.overflow
    assert model.weight.grad.item() == 40.0 * 1024  # the model's grad, as backward left it
    assert model.weight.item() == pytest.approx(1.0 - 3 * 40e-3, abs=1e-3)


@pytest.mark.parametrize("then", ["maximize: to the generic path", "add_param_group"])
def test_stepped_grads_step_again_alike_after_a_handover_or_a_new_group(then):
    """Handed over, the generic path once unscaled them by the grown scale (and an FP32
    param's grad twice); after add_param_group, the generic path unscaled them anew."""
    x, y = make_data(1)[0]
    moved = {}
    for path in PATHS:
        model = mixed_model()
        opt = wrap(model, lambda ps: torch.optim.SGD(ps, lr=0.05), path, **GROWING)
        opt.backward(mixed_loss(model, x, y))
        opt.step()
        if then == "add_param_group":
            opt.add_param_group({"params": list(nn.Linear(2, 2).half().parameters())})
        else:
            opt.param_groups[0]["maximize"] = True
        before = masters_of(opt)[:4]
        opt.step()
        moved[path] = [a - b for a, b in zip(masters_of(opt), before)]
    assert_close_engines(moved["fast"], moved["generic"])


def test_a_clip_holds_across_a_handover():
    """The generic path that takes over in a step clips the grads as clip_master_grads asked
    the fast one to (it makes the masters' grads then, and clips them)."""
    x, y = make_data(1)[0]
    moved = {}
    for path in PATHS:
        model = mixed_model()
        opt = wrap(model, lambda ps: torch.optim.SGD(ps, lr=0.05), path, **GROWING)
        opt.backward(mixed_loss(model, x, y))
        assert opt.clip_master_grads(1e-3) > 1e-2  # so the clip matters
        opt.param_groups[0]["maximize"] = True
        before = masters_of(opt)
        opt.step()
        assert opt.path == "generic"  # the fast one handed over
        moved[path] = [a - b for a, b in zip(masters_of(opt), before)]
    assert_close_engines(moved["fast"], moved["generic"])


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh grads", "grads stepped once"])
def test_a_group_added_between_backward_and_step_is_stepped(stepped):
    """The generic path once left a param group added after the grads were unscaled without
    grads on its masters: the step skipped it, where torch.optim and the fast path step it.
    Then it unscaled them by the current loss scale, where a step had grown it since the
    backward that made them."""
    x, y = make_data(1)[0]
    moved = {}
    for path in PATHS:
        model = mixed_model()
        opt = wrap(model[0], lambda ps: torch.optim.SGD(ps, lr=0.05), path, **GROWING)
        opt.backward(mixed_loss(model, x, y))  # the FP16 layer gets grads too
        if stepped:
            opt.step()
        opt.add_param_group({"params": list(model[1].parameters())})
        before = masters_of(opt)
        opt.step()
        moved[path] = [a - b for a, b in zip(masters_of(opt), before)]
        assert all(bool(d.abs().sum() > 0) for d in moved[path])
    assert_close_engines(moved["fast"], moved["generic"])


@pytest.mark.parametrize("update", [True, False], ids=["backward", "update_master_grads later"])
def test_a_scale_set_between_backward_and_step_leaves_the_grads_as_made(update):
    """The fast path once unscaled the grads by a loss scale set after they were made (apex
    had unscaled them at backward); the generic path did too where update_master_grads came
    after the set. The step and the clip's norm are the ones without the set."""
    x, y = make_data(1)[0]
    moved, norms = {}, {}
    for path, set_scale in itertools.product(PATHS, [False, True]):
        model = mixed_model()
        opt = wrap(model, lambda ps: torch.optim.SGD(ps, lr=0.05), path, **GROWING)
        before = masters_of(opt)
        opt.backward(mixed_loss(model, x, y), update_master_grads=update)
        if set_scale:  # twice: the grads keep the scale they were made with
            opt.loss_scale = 8.0
            opt.loss_scale = 2.0
        opt.update_master_grads()
        norms[path, set_scale] = opt.clip_master_grads(100.0)
        opt.step()
        moved[path, set_scale] = [a - b for a, b in zip(masters_of(opt), before)]
        assert opt.loss_scale == (4.0 if set_scale else 128.0)  # it grows from the set one
    for path in PATHS:
        assert norms[path, True] == norms[path, False]
        assert_same(moved[path, True], moved[path, False])


@pytest.mark.parametrize("case", ["scale set", "stepped again", "clipped"])
def test_a_load_that_needs_the_generic_path_keeps_the_grads_scale_and_clip(case):
    """A loaded dict whose groups the fast path cannot run hands it over to the generic one;
    the grads' scale (set by hand after their backward, or left by the step that read them)
    and a pending clip once went with the replaced state, not with the grads."""
    x, y = make_data(1)[0]
    moved = {}
    for path in PATHS:
        model = mixed_model()
        opt = wrap(model, lambda ps: torch.optim.SGD(ps, lr=0.05), path, **GROWING)
        saved = copy.deepcopy(opt.state_dict())
        saved["optimizer_state_dict"]["param_groups"][0]["maximize"] = True  # generic only
        before = masters_of(opt)
        opt.backward(mixed_loss(model, x, y))
        if case == "stepped again":  # a step() without a new backward, as apex allowed
            opt.step()
        if case == "clipped":
            opt.clip_master_grads(1e-3)
        else:
            opt.loss_scale = 8.0
        opt.load_state_dict(saved)
        opt.step()
        moved[path] = [a - b for a, b in zip(masters_of(opt), before)]
    assert_close_engines(moved["fast"], moved["generic"])


@pytest.mark.parametrize("read", ["overflow", "state_dict", "inspect_master_grad_data"])
def test_reading_between_accumulated_backwards_changes_no_grad(read):
    """On the generic path, reading these between two backward(update_master_grads=False)
    once unscaled an FP32 param's grad in place: the next backward added scaled grads to it."""
    data = make_data(2)
    moved = {}
    for path, reading in itertools.product(PATHS, [False, True]):
        model = mixed_model()
        opt = wrap(model, lambda ps: torch.optim.SGD(ps, lr=0.05), path, **GROWING)
        before = masters_of(opt)
        opt.backward(mixed_loss(model, *data[0]), update_master_grads=False)
        if reading:
            value = getattr(opt, read)
            if callable(value):
                value()
        opt.backward(mixed_loss(model, *data[1]), update_master_grads=False)
        opt.update_master_grads()
        opt.step()
        moved[path, reading] = [a - b for a, b in zip(masters_of(opt), before)]
    for path in PATHS:
        assert_same(moved[path, True], moved[path, False])


@pytest.mark.parametrize("path", PATHS)
def test_overflow_reads_grads_with_an_empty_one(path):
    """Reading overflow between backward and step (no unscale since the generic path's
    change) once failed on an empty gradient, as an FSDP2 rank's empty shard is."""
    model = mixed_model()
    empty = nn.Parameter(torch.zeros(0))
    opt = wrap(model, lambda ps: torch.optim.SGD([*ps, empty], lr=0.05), path)
    x, y = make_data(1)[0]
    opt.backward(mixed_loss(model, x, y) + empty.sum(), update_master_grads=False)
    assert opt.overflow is False and opt.state_dict()["overflow"] is False


@pytest.mark.parametrize("inf", [False, True], ids=["finite", "inf"])
def test_a_group_added_with_grads_brings_new_grads(inf):
    """Params that hold grads no step has seen, added by add_param_group after zero_grad:
    overflow and inspect_master_grad_data read them. The generic path once showed the new
    masters' missing grads (an FP32 one's still scaled) and the last check's overflow; the
    fast path, the last step's overflow."""
    x, y = make_data(1)[0]
    shown = {}
    for path in PATHS:
        model = mixed_model()
        opt = wrap(model[0], lambda ps: torch.optim.SGD(ps, lr=0.05), path, static_loss_scale=64.0)
        opt.backward(mixed_loss(model, x, y))  # the FP16 layer gets grads too
        opt.step()
        opt.zero_grad()
        if inf:
            model[1].weight.grad[0, 0] = math.inf
        opt.add_param_group({"params": list(model[1].parameters())})
        assert opt.overflow is inf
        shown[path] = opt.inspect_master_grad_data()
    if inf:
        assert shown == {"fast": None, "generic": None}
        return
    want = [[torch.zeros_like(p.float()) for p in model[0].parameters()]]
    want.append([p.grad.float() / 64.0 for p in model[1].parameters()])
    for path in PATHS:
        for got_group, want_group in zip(shown[path], want, strict=True):
            assert_same(got_group, want_group)


@pytest.mark.parametrize("path", PATHS)
def test_overflow_after_zero_grad_is_the_last_steps(path):
    """As the phase table says. The generic path once reported the check of the grads that
    zero_grad threw away."""
    model = mixed_model()
    opt = wrap(model, lambda ps: torch.optim.SGD(ps, lr=0.05), path, static_loss_scale=64.0)
    x, y = make_data(1)[0]
    for then, last_step_overflowed in [("zero_grad", False), ("step", True)]:
        opt.backward(mixed_loss(model, x, y) * math.inf)
        assert opt.overflow
        getattr(opt, then)()
        opt.zero_grad()
        opt.backward(mixed_loss(model, x, y))
        assert not opt.overflow
        opt.zero_grad()  # no step: these grads are thrown away
        assert opt.overflow is last_step_overflowed


def test_overflow_is_the_last_steps_after_a_handover():
    """The generic engine that took over once reported its own start: no step, no overflow."""
    model = mixed_model()
    opt = wrap(model, lambda ps: torch.optim.SGD(ps, lr=0.05), "fast", static_loss_scale=8.0)
    x, y = make_data(1)[0]
    opt.backward(mixed_loss(model, x, y) * math.inf)
    opt.step()
    opt.zero_grad()
    assert opt.overflow
    opt.add_param_group({"params": list(nn.Linear(2, 2).parameters()), "maximize": True})
    assert opt.path == "generic" and opt.overflow


@pytest.mark.parametrize("path", PATHS)
def test_a_scale_set_after_a_load_leaves_the_grads_as_made(path):
    """Grads no step has seen, kept through load_state_dict (which once marked them "stale"):
    the fast path once unscaled them by a scale set after it (apex's masters held them
    unscaled)."""
    x, y = make_data(1)[0]
    norms = []
    for set_scale in (False, True):
        model = mixed_model()
        opt = wrap(model, lambda ps: torch.optim.SGD(ps, lr=0.05), path, static_loss_scale=128.0)
        opt.backward(mixed_loss(model, x, y))
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        if set_scale:
            opt.loss_scale = 16.0
        norms.append(opt.clip_master_grads(100.0))
    assert norms[0] == norms[1]


def test_a_clip_of_no_grads_does_not_come_back():
    """The fast path's clip of no grads at all held again once the grads were None again (a
    backward, then zero_grad(set_to_none=True)), and clipped a group added with grads."""
    x, y = make_data(1)[0]
    moved = {}
    for path in PATHS:
        model = mixed_model()
        opt = wrap(model[0], lambda ps: torch.optim.SGD(ps, lr=0.05), path)
        assert opt.clip_master_grads(1e-3) == 0.0  # no grads yet
        opt.backward(mixed_loss(model, x, y), update_master_grads=False)
        opt.zero_grad(set_to_none=True)  # the FP16 layer, not trained yet, keeps its grads
        opt.add_param_group({"params": list(model[1].parameters())})
        before = masters_of(opt)
        opt.step()
        moved[path] = [a - b for a, b in zip(masters_of(opt), before)]
    assert_close_engines(moved["fast"], moved["generic"])


def test_a_check_is_redone_for_grads_written_without_the_optimizer():
    """The fast path's cached norm once outlived a loss.backward() made without it. (The
    generic path, as apex, rebuilds the masters' grads at backward and update_master_grads
    only: its clip sees the masters' grads.)"""
    x, y = make_data(1)[0]
    opt = wrap(model := make_model(), sgd, "fast", static_loss_scale=64.0)
    opt.backward(loss_fn(model, x, y))
    norm = opt.clip_master_grads(0.05)
    (loss_fn(model, x, y) * 64.0).backward()  # the same grads again: twice the norm
    assert opt.clip_master_grads(0.05) == pytest.approx(2 * norm, rel=1e-5)


def test_clipping_every_step_holds_across_add_param_group():
    """add_param_group rebuilt the fast path's core with no clip but kept the note that the
    clip was written: the same max_norm again was never written, and clipping stopped."""
    data, moved = make_data(4), {}
    for path in PATHS:
        opt = wrap(model := make_model(), lambda ps: torch.optim.SGD(ps, lr=0.1), path)
        moved[path] = []
        for i, (x, y) in enumerate(data):
            if i == 2:
                opt.add_param_group({"params": list(nn.Linear(2, 2).half().parameters())})
            opt.zero_grad()
            opt.backward(loss_fn(model, x, y))
            opt.clip_master_grads(0.05)
            before = masters_of(opt)[:4]
            opt.step()
            step = torch.cat([(a - b).flatten() for a, b in zip(masters_of(opt), before)])
            moved[path].append(float(torch.linalg.vector_norm(step)))
    assert moved["fast"] == pytest.approx(moved["generic"], rel=1e-3)
    assert moved["fast"] == pytest.approx([0.1 * 0.05] * 4, rel=1e-3)


@pytest.mark.parametrize("path", PATHS)
def test_grads_written_in_place_after_backward_are_unscaled_once(path):
    """A mixed model's FP32 params are their own masters, their grads unscaled in place at
    backward: an in-place write before step (a no-op clip_grad_norm_, a manual all-reduce's
    division) must not make the generic path unscale them again."""
    x, y = make_data(1)[0]
    moved = {}
    for halve in (False, True):
        model = mixed_model()
        opt = wrap(model, lambda ps: torch.optim.SGD(ps, lr=0.1), path, static_loss_scale=64.0)
        opt.backward(mixed_loss(model, x, y))
        if halve:
            with torch.no_grad():
                for p in model.parameters():
                    p.grad.mul_(0.5)  # written after backward: apex's masters took the grads
        before = masters_of(opt)
        opt.step()
        moved[halve] = [a - b for a, b in zip(masters_of(opt), before, strict=True)]
    # The FP32 layer's (first two) grads are the ones its step reads, halved; apex's FP16
    # masters had taken their copy at backward, the fast path reads the model's at step.
    halved = [0.5, 0.5, *[1.0 if path == "generic" else 0.5] * 2]
    for k, factor in enumerate(halved):
        torch.testing.assert_close(moved[True][k], factor * moved[False][k], rtol=1e-3, atol=1e-8)


def test_clip_with_another_norm_type_hands_the_fast_path_over_and_stays_correct():
    data = make_data(4)
    results = {}
    for path in PATHS:
        opt = wrap(model := make_model(), sgd, path, static_loss_scale=64.0)
        for x, y in data:
            opt.zero_grad()
            opt.backward(loss_fn(model, x, y))
            results.setdefault(path, []).append(opt.clip_master_grads(0.01, norm_type=INF))
            opt.step()
        assert opt.path == "generic"
        results[path + "-masters"] = masters_of(opt)
    assert results["fast"] == pytest.approx(results["generic"], rel=1e-6)
    assert_close_engines(results["fast-masters"], results["generic-masters"])


def conv_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 2)
    )


@pytest.mark.parametrize("convert", ["network_to_half", "FP16Model"])
def test_converted_networks_train_with_batchnorm_kept_fp32(convert):
    torch.manual_seed(3)
    x, y = torch.randn(4, 3, 6, 6), torch.tensor([0, 1, 1, 0])
    results = {}
    for path in PATHS:
        model = (
            network_to_half(conv_net()) if convert == "network_to_half" else FP16Model(conv_net())
        )
        bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = wrap(model, adam, path, dynamic_loss_scale=True)
        entries = [p for g in opt.param_groups for p in g["params"]]
        assert bn.weight.dtype == torch.float32 and any(e is bn.weight for e in entries)
        assert all(e.dtype == torch.float32 for e in entries)
        for _ in range(3):
            opt.zero_grad()
            opt.backward(nn.functional.cross_entropy(model(x).float(), y))
            opt.step()
        assert bn.running_mean.dtype == torch.float32
        for name, p in model.named_parameters():
            in_bn = p is bn.weight or p is bn.bias
            assert p.dtype == (torch.float32 if in_bn else torch.float16), name
            assert not torch.equal(p, before[name]), f"{name} did not train"
        results[path] = masters_of(opt)
    assert_close_engines(results["fast"], results["generic"])


@pytest.mark.parametrize("flat_master", [False, True])
def test_manual_master_params_recipe_matches_fp16_optimizer(flat_master):
    data, scale = make_data(4), 128.0
    model = make_model()
    model_params, master_params = prep_param_lists(model, flat_master=flat_master)
    inner = sgd(master_params)
    for x, y in data:
        model.zero_grad()
        (loss_fn(model, x, y).float() * scale).backward()
        model_grads_to_master_grads(model_params, master_params, flat_master=flat_master)
        for m in master_params:
            m.grad.mul_(1.0 / scale)
        inner.step()
        master_params_to_model_params(model_params, master_params, flat_master=flat_master)

    opt = wrap(reference := make_model(), sgd, "generic", static_loss_scale=scale)
    facade_run(reference, opt, data)
    manual = torch.cat([m.reshape(-1) for m in master_params])
    assert torch.equal(manual, torch.cat([m.reshape(-1) for m in masters_of(opt)]))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    initial = torch.cat([p.float().reshape(-1) for p in make_model().parameters()])
    assert not torch.equal(manual, initial)


OPTIONS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-momentum-dampening": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3),
    "sgd-nesterov-decay": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.8, nesterov=True, weight_decay=0.05
    ),
    "adam": lambda ps: torch.optim.Adam(
        ps, lr=1e-2, betas=(0.8, 0.95), eps=1e-4, weight_decay=0.05
    ),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.2),
    "adam-decoupled": lambda ps: torch.optim.Adam(
        ps, lr=1e-2, weight_decay=0.2, decoupled_weight_decay=True
    ),
    "two-groups": lambda ps: torch.optim.Adam(
        [{"params": ps[:2], "lr": 1e-2}, {"params": ps[2:], "weight_decay": 0.1}], lr=3e-3
    ),
}


def test_adamw_groups_without_the_decoupled_key_still_decay_decoupled():
    # torch < 2.7's AdamW has no "decoupled_weight_decay" in its groups: it is still AdamW.
    data, masters = make_data(3), []
    for drop_key in (False, True):
        model = make_model()
        inner = OPTIONS["adamw"](list(model.parameters()))
        if drop_key:
            del inner.param_groups[0]["decoupled_weight_decay"]
        opt = FP16_Optimizer(inner, static_loss_scale=256.0, compiled=False)
        facade_run(model, opt, data)
        masters.append(torch.cat([m.reshape(-1) for m in masters_of(opt)]))
    assert torch.equal(masters[0], masters[1])


@pytest.mark.parametrize("name", OPTIONS)
def test_fast_path_maps_every_torch_option_onto_the_core(name):
    data, masters = make_data(3), {}
    for path in PATHS:
        model = make_model()
        opt = FP16_Optimizer(
            OPTIONS[name](list(model.parameters())), static_loss_scale=256.0, path=path,
            compiled=False,
        )  # fmt: skip
        assert opt.path == path
        facade_run(model, opt, data)
        masters[path] = masters_of(opt)
    initial = [p.float() for p in make_model().parameters()]
    moved = [(a - b).abs().max() for a, b in zip(masters["generic"], initial)]
    assert min(moved) > 1e-4  # every param moved far more than the tolerance below
    for a, b in zip(masters["fast"], masters["generic"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-7)
