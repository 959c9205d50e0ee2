"""FP16_Optimizer's API beyond the training loop: construction, bad input, params without
grads, frozen and mixed-dtype params, attributes, logging, param groups, engine switches."""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import pickle
import sys
import warnings
import weakref
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fp16fx
import fp16fx.fp16_utils
from fp16fx.facade.generic import GenericEngine
from fp16fx.facade.policy import NO_CEILING, NO_FLOOR
from fp16fx.fp16_utils import FP16_Optimizer
from fp16fx.scaling import DynamicLossScale, StaticLossScale

PATHS = ["fast", "generic"]
APEX_NAMES = [
    "FP16_Optimizer",
    "LossScaler",
    "DynamicLossScaler",
    "network_to_half",
    "BN_convert_float",
    "FP16Model",
    "convert_module",
    "convert_network",
    "prep_param_lists",
    "model_grads_to_master_grads",
    "master_params_to_model_params",
    "tofp16",
    "to_python_float",
    "clip_grad_norm",
]


class TwoHeads(nn.Module):
    """An FP16 trunk and two heads; ``forward(x, heads)`` uses only the listed heads."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Linear(5, 8)
        self.a = nn.Linear(8, 2)
        self.b = nn.Linear(8, 2)
        self.half()

    def forward(self, x: torch.Tensor, heads: str = "ab") -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return sum(getattr(self, name)(h).float().square().mean() for name in heads)


_DATA = torch.Generator().manual_seed(0)  # the same data however the tests are collected
X = torch.randn(8, 5, generator=_DATA).half()


def wrap(model, path, inner=None, **kwargs) -> FP16_Optimizer:
    inner = inner or torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-2)
    kwargs.setdefault("verbose", False)
    return FP16_Optimizer(inner, path=path, compiled=False, **kwargs)


def train(model, opt, steps, heads="ab", to_none=False):
    for _ in range(steps):
        opt.zero_grad(set_grads_to_None=to_none)
        opt.backward(model(X, heads))
        opt.step()


def snapshot(opt) -> list[torch.Tensor]:
    return [p.detach().clone() for g in opt.param_groups for p in g["params"]]


def close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


# -- construction ------------------------------------------------------------------------


def test_is_a_torch_optimizer_and_the_fp16_utils_namespace_has_every_apex_name():
    opt = wrap(TwoHeads(), "fast")
    assert isinstance(opt, torch.optim.Optimizer)
    assert sorted(fp16fx.fp16_utils.__all__) == sorted(APEX_NAMES)
    assert all(getattr(fp16fx.fp16_utils, name) is not None for name in APEX_NAMES)
    assert fp16fx.FP16_Optimizer is FP16_Optimizer
    assert fp16fx.fp16_utils.FP16_Optimizer.__module__ == "fp16fx.facade.optimizer"


@pytest.mark.parametrize(
    "bad", [list(TwoHeads().parameters()), TwoHeads(), None], ids=["params", "module", "None"]
)
def test_rejects_what_is_not_a_torch_optimizer(bad):
    with pytest.raises(TypeError, match=r"wraps a torch\.optim\.Optimizer"):
        FP16_Optimizer(bad)


def test_rejects_wrapping_twice_and_unknown_paths():
    opt = wrap(TwoHeads(), "generic")
    with pytest.raises(TypeError, match="already an FP16_Optimizer"):
        FP16_Optimizer(opt)
    with pytest.raises(ValueError, match="path must be"):
        wrap(TwoHeads(), "fastest")


def test_rejects_float64_params_naming_them():
    model = nn.Linear(2, 2).double()
    with pytest.raises(
        TypeError, match=r"param_groups\[0\]\['params'\]\[0\] has dtype torch.float64"
    ):
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    named = torch.optim.SGD(model.named_parameters(), lr=0.1)
    with pytest.raises(TypeError, match="'weight'"):
        FP16_Optimizer(named)


@pytest.mark.parametrize(
    "args, error, match",
    [
        ({"scale_windows": 10}, ValueError, r"unknown key\(s\) \['scale_windows'\]"),
        ({"scale_window": 10, "growth_interval": 10}, ValueError, "growth_interval twice"),
        ({"scale_factor": 2.0, "growth_factor": 4.0}, ValueError, "growth_factor twice"),
        ({"init_scale": 1000.0}, ValueError, "init_scale must be a power of two"),
        ({"scale_window": 0}, ValueError, "growth_interval must be an int >= 1"),
        ({"scale_factor": 1.0}, ValueError, "scale_factor"),
        ([("init_scale", 2.0)], TypeError, "must be a dict"),
    ],
)
def test_bad_dynamic_loss_args_are_named(args, error, match):
    with pytest.raises(error, match=match):
        wrap(TwoHeads(), "fast", dynamic_loss_scale=True, dynamic_loss_args=args)


def test_dynamic_defaults_are_apexs_and_no_floor_is_2_to_the_minus_126():
    opt = wrap(TwoHeads(), "fast", dynamic_loss_scale=True)
    assert opt._scaler.policy == DynamicLossScale(
        init_scale=2.0**16, growth_interval=2000, max_scale=2.0**24, min_scale=2.0**-126
    )
    assert opt.loss_scale == 2.0**16 and opt.dynamic_loss_scale
    static = wrap(TwoHeads(), "fast", static_loss_scale=1000.0)
    assert static._scaler.policy == StaticLossScale(1000.0) and static.loss_scale == 1000.0
    with pytest.warns(UserWarning, match="dynamic_loss_args is ignored"):
        wrap(TwoHeads(), "fast", dynamic_loss_args={"scale_window": 10})
    with warnings.catch_warnings():  # nothing is ignored
        warnings.simplefilter("error")
        wrap(TwoHeads(), "fast", static_loss_scale=8.0, dynamic_loss_args={})


@pytest.mark.parametrize("path", ["fast", "generic"])
def test_a_floor_above_the_ceiling_is_refused_by_name(path):
    args = {"min_loss_scale": 2.0**10, "max_loss_scale": 2.0**8}
    with pytest.raises(ValueError, match=r"dynamic_loss_args .* must not exceed max_scale"):
        wrap(TwoHeads(), path, dynamic_loss_scale=True, dynamic_loss_args=args)


@settings(max_examples=25, deadline=None)
@given(
    init=st.integers(-4, 30),
    window=st.integers(1, 5000),
    floor=st.one_of(st.none(), st.just(0), st.integers(-10, 0)),
    ceiling=st.one_of(st.integers(0, 30), st.just(math.inf)),  # inf: apex's "no ceiling"
    factor=st.sampled_from([None, 2, 4]),
    hysteresis=st.one_of(st.none(), st.integers(1, 4)),
)
def test_apex_dynamic_loss_args_map_onto_dynamic_loss_scale(
    init, window, floor, ceiling, factor, hysteresis
):
    args = {"init_scale": 2.0**init, "scale_window": window, "max_loss_scale": 2.0**ceiling}
    max_scale = NO_CEILING if ceiling == math.inf else 2.0**ceiling
    args["min_loss_scale"] = floor if floor in (None, 0) else 2.0**floor
    if factor is not None:
        args["scale_factor"] = factor
    if hysteresis is not None:
        args["hysteresis"] = hysteresis
    min_scale = NO_FLOOR if not args["min_loss_scale"] else args["min_loss_scale"]
    opt = wrap(TwoHeads(), "generic", dynamic_loss_scale=True, dynamic_loss_args=args)
    policy = opt._scaler.policy
    assert dataclasses.asdict(policy) == {
        "init_scale": 2.0**init,
        "growth_factor": float(factor or 2),
        "backoff_factor": 1.0 / (factor or 2),
        "growth_interval": window,
        "hysteresis": hysteresis or 1,
        "min_scale": min_scale,
        "max_scale": max_scale,
    }
    assert opt.loss_scale == min(max(2.0**init, min_scale), max_scale)  # apex: min(init, max)


@pytest.mark.parametrize(
    "make, path",
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1), "fast"),
        (lambda ps: torch.optim.Adam(ps, foreach=False, capturable=False), "fast"),
        (lambda ps: torch.optim.AdamW(ps), "fast"),
        (lambda ps: torch.optim.Adam(ps, maximize=True), "generic"),
        (lambda ps: torch.optim.RMSprop(ps), "generic"),
        (lambda ps: torch.optim.LBFGS(ps), "generic"),
        (lambda ps: type("MyAdam", (torch.optim.Adam,), {})(ps), "generic"),
    ],
)
def test_auto_picks_the_fast_path_only_for_exactly_sgd_adam_adamw(make, path):
    model = TwoHeads()
    assert wrap(model, "auto", make(model.parameters())).path == path
    if path == "generic":
        with pytest.raises(ValueError, match="path='fast' is not possible"):
            wrap(TwoHeads(), "fast", make(TwoHeads().parameters()))
    assert wrap(TwoHeads(), "generic", make(TwoHeads().parameters())).path == "generic"


# -- which params are trained --------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_fp16_and_bf16_params_get_masters_fp32_ones_and_frozen_ones_stay(path):
    torch.manual_seed(0)
    fp16, bf16 = nn.Parameter(torch.randn(4).half()), nn.Parameter(torch.randn(4).bfloat16())
    fp32, frozen = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4).half(), False)
    frozen_before = frozen.detach().clone()
    params = [fp16, frozen, bf16, fp32]
    opt = wrap(nn.Module(), path, torch.optim.Adam(params, lr=0.1))
    entries = opt.param_groups[0]["params"]
    assert entries[1] is frozen and entries[3] is fp32
    assert entries[0] is not fp16 and entries[0].dtype == entries[2].dtype == torch.float32
    assert torch.equal(entries[0], fp16.float()) and torch.equal(entries[2], bf16.float())
    for _ in range(3):
        opt.zero_grad()
        opt.backward(sum((p.float() * torch.arange(4.0)).sum() for p in params if p.requires_grad))
        opt.step()
    assert torch.equal(frozen, frozen_before) and frozen.grad is None and frozen not in opt.state
    assert fp16.dtype == torch.float16 and bf16.dtype == torch.bfloat16
    assert torch.equal(fp16, entries[0].half()) and torch.equal(bf16, entries[2].bfloat16())
    assert all(opt.state[e]["step"].item() == 3 for e in (entries[0], entries[2], fp32))


@pytest.mark.parametrize("path", PATHS)
def test_a_param_without_grad_is_not_updated_and_its_state_is_untouched(path):
    model = TwoHeads()
    b_before = [p.detach().clone() for p in model.b.parameters()]
    opt = wrap(model, path)
    train(model, opt, 3, heads="a")  # head b never gets a gradient
    assert all(torch.equal(p, q) for p, q in zip(model.b.parameters(), b_before))
    b_entries = [e for e in opt.param_groups[0]["params"][-2:]]
    assert all(e not in opt.state for e in b_entries)
    if path == "fast":  # head b sits in a segment of its own, which the step leaves out
        assert len(opt._engine.state.layout.segments) == 2


def test_params_missing_grads_in_some_steps_keep_torch_step_counts():
    states = {}
    for path in PATHS:
        model = TwoHeads()
        opt = wrap(model, path)
        train(model, opt, 1)
        train(model, opt, 2, heads="b", to_none=True)  # head a: no grad for 2 steps
        train(model, opt, 2, to_none=True)
        train(model, opt, 1, heads="a")  # set to zero, not None: b is stepped with zero grads
        states[path] = opt.state_dict()["optimizer_state_dict"]["state"]
        states[path + "-masters"] = snapshot(opt)
    steps = {path: [s["step"].item() for s in states[path].values()] for path in PATHS}
    assert steps["fast"] == steps["generic"] == [6, 6, 4, 4, 6, 6]
    close(states["fast-masters"], states["generic-masters"])
    for a, b in zip(states["fast"].values(), states["generic"].values()):
        close([a["exp_avg"], a["exp_avg_sq"]], [b["exp_avg"], b["exp_avg_sq"]])


@pytest.mark.parametrize("path", PATHS)
def test_a_grad_set_to_none_by_the_model_does_not_replay_the_last_one(path):
    # torch's model.zero_grad() sets grads to None behind the optimizer's back; apex then
    # stepped the param again with its master's stale gradient from the previous step.
    model = TwoHeads()
    opt = wrap(model, path, torch.optim.SGD(model.parameters(), lr=0.1))
    train(model, opt, 1)
    a_before = [p.detach().clone() for p in model.a.parameters()]
    model.zero_grad()
    opt.backward(model(X, heads="b"))
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.a.parameters(), a_before))


@pytest.mark.parametrize("path", PATHS)
def test_grads_assigned_by_the_user_are_used(path):
    results = {}
    for how in ("assigned", "backward"):
        model = TwoHeads()
        opt = wrap(model, path, static_loss_scale=4.0)
        for _ in range(2):
            opt.zero_grad(set_grads_to_None=how == "assigned")
            if how == "assigned":
                grads = torch.autograd.grad(model(X) * 4.0, list(model.parameters()))
                for p, g in zip(model.parameters(), grads):
                    p.grad = g.clone()
            else:
                opt.backward(model(X))
            opt.step()
        results[how] = snapshot(opt)
    assert all(torch.equal(a, b) for a, b in zip(results["assigned"], results["backward"]))


def test_fast_path_grads_are_views_of_one_buffer_and_zero_grad_keeps_them():
    model = TwoHeads()
    opt = wrap(model, "fast")
    train(model, opt, 1)
    flat = opt._engine.flat
    ((grad_buffer,), (param_buffer,)) = flat.grad_buffers, flat.param_buffers
    for buffer, tensors in (
        (grad_buffer, [p.grad for p in model.parameters()]),
        (param_buffer, list(model.parameters())),
    ):
        start, end = buffer.data_ptr(), buffer.data_ptr() + 2 * buffer.numel()
        assert all(start <= t.data_ptr() < end for t in tensors)
    grads = [p.grad for p in model.parameters()]
    opt.zero_grad()
    assert all(p.grad is g and not g.any() for p, g in zip(model.parameters(), grads))
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())


def step_now_or_by_closure(opt, model, by_closure, x=X):
    """Backpropagates ``model(x)`` and steps: by ``step()``, or inside ``step(closure)``."""

    def closure():
        opt.zero_grad()
        loss = model(x)
        opt.backward(loss)
        return loss

    if by_closure:
        return opt.step(closure)
    closure()
    return opt.step()


@pytest.mark.parametrize("by_closure", [False, True], ids=["step", "closure"])
@pytest.mark.parametrize("path", PATHS)
def test_unfreezing_a_param_after_wrapping_is_reported(path, by_closure):
    model = TwoHeads()
    model.b.weight.requires_grad_(False)
    opt = wrap(model, path)
    model.b.weight.requires_grad_(True)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="had requires_grad=False"):
        step_now_or_by_closure(opt, model, by_closure)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("by_closure", [False, True], ids=["step", "closure"])
def test_moving_the_model_after_wrapping_is_reported(by_closure):
    model = TwoHeads()
    opt = wrap(model, "fast")
    model.float()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[0\] no longer lives"):
        step_now_or_by_closure(opt, model, by_closure, X.float())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# -- attributes and methods ----------------------------------------------------------------


def poisoned_backward(model, opt):
    model.trunk.weight.register_hook(lambda g: g * math.inf)
    opt.backward(model(X))


@pytest.mark.parametrize("path", PATHS)
def test_overflow_is_computed_when_read_and_matches_the_step(path):
    model = TwoHeads()
    opt = wrap(model, path, dynamic_loss_scale=True)
    assert opt.overflow is False
    train(model, opt, 1)
    assert opt.overflow is False and opt.loss_scale == 2.0**16
    before = snapshot(opt)
    opt.zero_grad()
    poisoned_backward(model, opt)
    assert opt.overflow is True  # read before the step
    opt.step()
    assert opt.overflow is True and opt.loss_scale == 2.0**15 and opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(opt)))


@pytest.mark.parametrize("path", PATHS)
def test_inspect_master_grad_data_gives_unscaled_grads_or_none_on_overflow(path, caplog):
    model = TwoHeads()
    model.a.bias.requires_grad_(False)
    opt = wrap(model, path, static_loss_scale=64.0)
    opt.backward(model(X))
    want = torch.autograd.grad(model(X), [model.trunk.weight, model.b.bias])
    (grads,) = opt.inspect_master_grad_data()
    assert len(grads) == 6 and grads[3] is None
    torch.testing.assert_close(grads[0], want[0].float(), rtol=0, atol=0)
    torch.testing.assert_close(grads[5], want[1].float(), rtol=0, atol=0)
    opt.zero_grad()
    poisoned_backward(model, opt)
    with caplog.at_level(logging.WARNING, logger="fp16fx"):
        assert opt.inspect_master_grad_data() is None
    assert "overflowed" in caplog.text


@pytest.mark.parametrize("path", PATHS)
def test_loss_scale_can_be_set_and_update_is_step(path):
    results = []
    for method in ("step", "update"):
        model = TwoHeads()
        opt = wrap(model, path, dynamic_loss_scale=True)
        opt.loss_scale = 8.0
        assert opt.loss_scale == 8.0
        params = list(model.parameters())
        unscaled = torch.autograd.grad(model(X), params)
        opt.zero_grad()
        opt.backward(model(X))  # the loss times the scale just set: 8, not the default 2**16
        for p, g in zip(params, unscaled, strict=True):
            torch.testing.assert_close(p.grad.float(), 8 * g.float(), rtol=1e-3, atol=1e-6)
        for _ in range(2):
            opt.zero_grad()
            opt.backward(model(X))
            getattr(opt, method)()
        results.append(snapshot(opt))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    for bad in (0.0, -1.0, math.inf, "8", True, 1e39, 1e-46):  # the last two: inf, 0 in FP32
        with pytest.raises(ValueError, match="loss_scale must be"):
            opt.loss_scale = bad
    assert opt.loss_scale == 8.0


@pytest.mark.parametrize("path", PATHS)
def test_a_dynamic_loss_scale_is_set_within_its_bounds_only(path):
    """The setter once took a scale below min_loss_scale, which the next overflow then
    *raised* to the floor (and one above max_loss_scale, which a growth then lowered)."""
    a = nn.Parameter(torch.ones(3, dtype=torch.float16))
    args = {"init_scale": 64.0, "min_loss_scale": 16.0, "max_loss_scale": 128.0}
    opt = wrap(a, path, torch.optim.SGD([a], lr=0.0), dynamic_loss_scale=True,
               dynamic_loss_args=args)  # fmt: skip
    for bad in (4.0, 8.0, 256.0, torch.tensor(4.0)):
        with pytest.raises(ValueError, match=r"bounds, min_loss_scale 16 to max_loss_scale 128"):
            opt.loss_scale = bad
        assert opt.loss_scale == 64.0
    for good in (16.0, 128.0, 100.0):  # the bounds themselves, and any value between
        opt.loss_scale = good
        assert opt.loss_scale == good
    opt.loss_scale = 16.0
    opt.zero_grad()
    opt.backward(a.float().sum() * math.inf)
    opt.step()
    assert opt.overflow and opt.loss_scale == 16.0  # at the floor, never moved up to it
    static = wrap(a, path, torch.optim.SGD([a], lr=0.0), static_loss_scale=8.0)
    static.loss_scale = 2.0**30  # a static scale has no bounds (but FP32's)
    assert static.loss_scale == 2.0**30


@pytest.mark.parametrize("path", PATHS)
def test_step_hooks_run_and_schedulers_accept_it(path):
    model = TwoHeads()
    opt = wrap(model, path)
    calls = []
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(o is opt))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, opt, 1)
    scheduler.step()
    assert calls == [True] and opt.param_groups[0]["lr"] == 5e-3


@pytest.mark.parametrize("path", PATHS)
def test_state_dict_hooks_run_as_in_torch_optim(path):
    """Registered through torch.optim.Optimizer's methods, once ignored by the overrides."""
    model = TwoHeads()
    opt = wrap(model, path)
    train(model, opt, 1)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("save, before"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "epoch": 3})
    saved = opt.state_dict()
    assert calls == ["save, before"] and saved["epoch"] == 3

    def drop_epoch(o, sd):
        calls.append(sd.pop("epoch"))  # a shallow copy: the caller's dict keeps its key

    opt.register_load_state_dict_pre_hook(drop_epoch)
    opt.register_load_state_dict_post_hook(lambda o: calls.append(o is opt))
    opt.load_state_dict(saved)  # refuses keys apex's dict lacks, unless a hook drops them
    assert calls == ["save, before", 3, True] and saved["epoch"] == 3

    refusal = ValueError("a pre-hook refused it")

    def refuse(o, sd):
        raise refusal

    opt.register_load_state_dict_pre_hook(refuse)
    with pytest.raises(ValueError) as raised:
        opt.load_state_dict(saved)
    assert raised.value is refusal and calls == ["save, before", 3, True, 3]  # no post hook


class _Dict(dict):
    """A dict a weak reference can follow."""


def test_a_refused_load_holds_no_reference_to_the_dict_given():
    """The refusal, kept in a local beside a traceback that holds its frame, once made a
    reference cycle: the dict (a checkpoint's tensors) lived until the next gc pass."""
    model = TwoHeads()
    opt = wrap(model, "fast")

    def refuse(o, sd):
        raise ValueError("refused")

    opt.register_load_state_dict_pre_hook(refuse)
    checkpoint = _Dict(opt.state_dict())
    alive = weakref.ref(checkpoint)
    gc.disable()
    try:
        with pytest.raises(ValueError, match="refused"):
            opt.load_state_dict(checkpoint)
        del checkpoint
        assert alive() is None
    finally:
        gc.enable()


def test_cannot_be_pickled_as_in_apex():
    with pytest.raises(RuntimeError, match="state_dict"):
        pickle.dumps(wrap(TwoHeads(), "fast"))


def test_repr_says_what_runs():
    text = repr(wrap(TwoHeads(), "fast", dynamic_loss_scale=True))
    assert text.startswith("FP16_Optimizer(Adam, fast path (eager), 1 param group(s)")
    assert (
        "84 FP16/BF16 values with FP32 masters, 0 FP32 values" in text
        and "dynamic loss scale 65536" in text
    )
    text = repr(wrap(TwoHeads(), "fast", master="compensated", moments="int8"))
    assert "84 FP16/BF16 values with compensated masters and INT8 moments" in text
    text = repr(wrap(TwoHeads(), "generic", static_loss_scale=128.0))
    assert "generic path" in text and "static loss scale 128" in text


def count_lines(caplog, text):
    return sum(text in r.getMessage() for r in caplog.records if r.name == "fp16fx")


@pytest.mark.parametrize("verbose", [True, False])
def test_skipped_steps_are_logged_at_most_once_per_interval(verbose, caplog):
    model = TwoHeads()
    opt = wrap(model, "fast", dynamic_loss_scale=True, verbose=verbose, report_interval=5)
    poison = {"on": False}
    model.trunk.weight.register_hook(lambda g: g * math.inf if poison["on"] else g)
    with caplog.at_level(logging.INFO, logger="fp16fx"):
        for i in range(20):
            poison["on"] = i in (1, 2, 3, 12)
            train(model, opt, 1)
    lines = [r.getMessage() for r in caplog.records if "were skipped" in r.getMessage()]
    if verbose:
        assert lines == [
            "fp16fx: 3 of the last 5 step(s) were skipped (inf/NaN gradients); loss scale now 8192",
            "fp16fx: 1 of the last 5 step(s) were skipped (inf/NaN gradients); loss scale now 4096",
        ]
    else:
        assert lines == []
    assert opt.skipped_steps == 4


@pytest.mark.parametrize("path", PATHS)
def test_overflow_at_the_minimum_scale_is_reported_even_when_not_verbose(path, caplog):
    model = TwoHeads()
    args = {"init_scale": 2.0**4, "min_loss_scale": 2.0**3}
    opt = wrap(model, path, dynamic_loss_scale=True, dynamic_loss_args=args, report_interval=4)
    model.trunk.weight.register_hook(lambda g: g * math.inf)
    with caplog.at_level(logging.INFO, logger="fp16fx"):
        train(model, opt, 4)
    assert opt.loss_scale == 8.0
    assert count_lines(caplog, "the loss scale is at its minimum (8) and the gradients still "
                               "overflowed 3 time(s) in the last 4 step(s)") == 1  # fmt: skip


@pytest.mark.parametrize("path", PATHS)
def test_add_param_group_trains_the_new_params_with_masters(path):
    model = TwoHeads()
    opt = wrap(model, path, torch.optim.Adam(model.trunk.parameters(), lr=1e-2))
    train(model, opt, 1)
    opt.add_param_group(
        {"params": list(model.a.parameters()) + list(model.b.parameters()), "lr": 0.1}
    )
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [model.trunk.weight]})
    assert len(opt.param_groups) == 2 and opt.path == path
    entries = opt.param_groups[1]["params"]
    assert all(e.dtype == torch.float32 for e in entries) and opt.param_groups[1]["lr"] == 0.1
    before = [p.detach().clone() for p in model.parameters()]
    train(model, opt, 2)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert torch.equal(model.a.weight, entries[0].half())


@pytest.mark.parametrize("path", PATHS)
def test_a_param_group_listing_a_param_twice_is_refused_and_changes_nothing(path):
    model = TwoHeads()
    opt = wrap(model, path, torch.optim.Adam(model.trunk.parameters(), lr=1e-2))
    train(model, opt, 1)
    params = list(model.parameters())
    values, storages = [p.detach().clone() for p in params], [p.data_ptr() for p in params]
    state = snapshot(opt)
    # torch's add_param_group warns of the duplicate, then fp16fx refuses it.
    with (
        pytest.warns(UserWarning, match="duplicate parameters"),
        pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[1\] is .*\[0\] again"),
    ):
        opt.add_param_group({"params": [model.a.weight, model.a.weight]})
    assert len(opt.param_groups) == 1
    assert [p.data_ptr() for p in params] == storages  # nothing moved into new buffers
    assert all(map(torch.equal, params, values)) and all(map(torch.equal, snapshot(opt), state))
    train(model, opt, 1)  # and it still trains
    assert not torch.equal(model.trunk.weight, values[0])


def test_a_group_that_fails_to_join_the_generic_path_leaves_no_trace():
    """add_param_group's rollback pops the group; the generic engine once kept its params (it
    joined them before unscaling their grads, which raised), so that every later step read
    their grads: an inf there skipped every step."""
    model = TwoHeads()
    opt = wrap(model, "generic", torch.optim.Adam(model.trunk.parameters(), lr=1e-2))
    model.a.weight.register_hook(lambda g: g * math.inf)  # a head no group trains
    opt.zero_grad()
    opt.backward(model(X))
    opt.update_master_grads()  # the new group's grads would be unscaled as they join
    with (
        mock.patch.object(GenericEngine, "_unscale", side_effect=KeyboardInterrupt),
        pytest.raises(KeyboardInterrupt),
    ):
        opt.add_param_group({"params": list(model.a.parameters())})
    assert len(opt.param_groups) == 1
    before = model.trunk.weight.detach().clone()
    train(model, opt, 1)
    assert not opt.overflow and not torch.equal(model.trunk.weight, before)


@pytest.mark.parametrize("path", PATHS)
def test_params_that_overlap_in_memory_are_refused(path):
    model = TwoHeads()
    view = nn.Parameter(model.trunk.weight.data[:2])  # a view of a trained param's memory
    with pytest.raises(ValueError, match=r"overlaps .*in memory"):
        wrap(model, path, torch.optim.Adam([*model.parameters(), view]))
    opt = wrap(model, path, torch.optim.Adam(model.trunk.parameters(), lr=1e-2))
    train(model, opt, 1)
    values, state = [p.detach().clone() for p in model.parameters()], snapshot(opt)
    view = nn.Parameter(model.trunk.weight.data[:2])  # the trunk's memory now: a flat buffer
    with pytest.raises(ValueError, match=r"overlaps .*in memory"):
        opt.add_param_group({"params": [view]})
    assert len(opt.param_groups) == 1 and all(map(torch.equal, snapshot(opt), state))
    assert all(map(torch.equal, model.parameters(), values))
    train(model, opt, 1)


class FailingSGD(torch.optim.SGD):
    """An SGD whose step raises (e.g. torch's Adam on a sparse gradient)."""

    def step(self, closure=None):
        raise RuntimeError("this optimizer cannot step these grads")


def test_a_wrapped_step_that_raises_leaves_the_loss_scale_as_it_was():
    model = TwoHeads()
    args = {"scale_window": 1}  # a clean step would double the scale
    opt = wrap(model, "generic", FailingSGD(model.parameters(), lr=0.1),
               dynamic_loss_scale=True, dynamic_loss_args=args)  # fmt: skip
    before = opt.state_dict()["loss_scaler"]
    opt.zero_grad()
    opt.backward(model(X))
    with pytest.raises(RuntimeError, match="cannot step these grads"):
        opt.step()
    assert opt.state_dict()["loss_scaler"] == before and opt.loss_scale == 2.0**16


def test_add_param_group_matches_between_paths():
    masters = {}
    for path in PATHS:
        model = TwoHeads()
        opt = wrap(model, path, torch.optim.SGD(model.trunk.parameters(), lr=0.1, momentum=0.9))
        train(model, opt, 2)
        opt.add_param_group({"params": list(model.a.parameters()), "momentum": 0.5})
        train(model, opt, 2)
        masters[path] = snapshot(opt)
    close(masters["fast"], masters["generic"])


CHANGES = {
    "amsgrad on": lambda g: g.update(amsgrad=True),
    "momentum on": lambda g: g.update(momentum=0.9),
    "nesterov on": lambda g: g.update(nesterov=True),
    "maximize on": lambda g: g.update(maximize=True),
}


@pytest.mark.parametrize("change", CHANGES)
def test_changing_a_structural_option_rebuilds_or_hands_over_and_stays_correct(change):
    masters = {}
    for path in PATHS:
        model = TwoHeads()
        if change == "amsgrad on":
            inner = torch.optim.Adam(model.parameters(), lr=1e-2)
        else:
            momentum = 0.0 if change == "momentum on" else 0.9
            inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
        opt = wrap(model, path, inner)
        train(model, opt, 2)
        CHANGES[change](opt.param_groups[0])
        if change == "amsgrad on":  # torch itself crashes here: it has no max_exp_avg_sq yet
            for e in opt.param_groups[0]["params"]:
                opt.optimizer.state.get(e, {}).setdefault("max_exp_avg_sq", torch.zeros_like(e))
        train(model, opt, 2)
        assert opt.path == ("generic" if change == "maximize on" else path)
        masters[path] = snapshot(opt)
    # The paths round differently (torch's CPU kernels fuse multiply-adds, the compiled step
    # does not); through FP16 forwards over a mid-run change that grows to ~1e-5 relative.
    close(masters["fast"], masters["generic"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("option", ["amsgrad", "momentum"])
def test_a_structural_option_turned_off_and_on_again_resumes_its_state_as_torch_does(option):
    # torch.optim keeps max_exp_avg_sq / momentum_buffer while unused, and resumes them.
    masters, kept = {}, {}
    for path in PATHS:
        model = TwoHeads()
        if option == "amsgrad":
            inner, values = torch.optim.Adam(model.parameters(), lr=0.1, amsgrad=True), (0, 1)
        else:
            inner, values = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), (0, 0.9)
        opt = wrap(model, path, inner)
        train(model, opt, 3)
        opt.param_groups[0][option] = values[0]
        train(model, opt, 2)
        kept[path] = {k: v.clone() for k, v in opt.state[model.trunk.bias].items()}
        opt.param_groups[0][option] = values[1]
        train(model, opt, 2)
        masters[path] = snapshot(opt)
    assert list(kept["fast"]) == list(kept["generic"])
    close(list(kept["fast"].values()), list(kept["generic"].values()))
    close(masters["fast"], masters["generic"], rtol=1e-4, atol=1e-5)  # as in the test above


def test_amsgrad_and_maximize_switched_on_together_hand_over_with_the_maximum_at_zero():
    # The fast path starts a new AMSGrad maximum at zero; torch's step, taking over for
    # maximize, read one that was not there (KeyError: 'max_exp_avg_sq').
    model = TwoHeads()
    opt = wrap(model, "fast", torch.optim.Adam(model.parameters(), lr=1e-2))
    train(model, opt, 2)
    opt.param_groups[0].update(amsgrad=True, maximize=True)
    train(model, opt, 1)
    assert opt.path == "generic"
    for state in opt.state.values():
        assert torch.equal(state["max_exp_avg_sq"], state["exp_avg_sq"])  # max(0, v) = v


@pytest.mark.parametrize("path", PATHS)
def test_an_infinite_max_norm_clips_nothing_as_clip_grad_norm_does(path):
    """torch's clip_grad_norm_ takes max_norm=inf for "no clip"; clip_master_grads once
    refused it as not a finite number > 0. 0 and negative numbers, which zero the grads or
    flip their sign there, it still refuses, nothing changed."""
    runs = []
    for max_norm in (None, math.inf, torch.tensor(math.inf)):
        model = TwoHeads()
        opt = wrap(model, path)
        norms = []
        for _ in range(2):
            opt.zero_grad()
            opt.backward(model(X))
            if max_norm is not None:
                norms.append(opt.clip_master_grads(max_norm))
            opt.step()
        runs.append((snapshot(opt), norms))
    (unclipped, _), *clipped = runs
    for masters, norms in clipped:
        assert all(map(torch.equal, masters, unclipped))
        assert len(norms) == 2 and all(0 < norm < math.inf for norm in norms)
    opt.zero_grad()
    opt.backward(model(X))
    before = [g.clone() for group in opt.inspect_master_grad_data() for g in group]
    for refused in (0.0, -1.0, -math.inf):
        with pytest.raises(ValueError, match=r"max_norm must be a finite number > 0 \(or inf"):
            opt.clip_master_grads(refused)
    after = [g for group in opt.inspect_master_grad_data() for g in group]
    assert all(map(torch.equal, after, before))  # the grads were left whole


@pytest.mark.parametrize("max_norm", [math.inf, sys.float_info.max], ids=["inf", "float max"])
@pytest.mark.parametrize("path", PATHS)
def test_no_clip_over_grads_whose_norm_overflows_steps_them_as_they_are(path, max_norm):
    """Finite grads whose FP32 norm is inf: clip_grad_norm_ with a max_norm of inf (or of the
    largest float, inf in FP32) scales them by inf / inf, NaN. The generic path on one process
    once clipped with it, and stepped NaN weights with no overflow reported."""
    model = nn.Linear(4, 3)  # FP32: its own master
    opt = wrap(model, path, torch.optim.SGD(model.parameters(), lr=1e-35))
    opt.zero_grad()
    opt.backward(model(torch.ones(2, 4)).sum() * 1e30)
    assert opt.clip_master_grads(max_norm) == math.inf
    opt.step()
    assert not opt.overflow and all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize("number", [float, torch.tensor], ids=["float", "tensor"])
def test_a_nan_dampening_with_nesterov_is_refused_by_name_not_handed_over(number):
    """A nesterov group's dampening is read to tell whether the fast path can step it: a NaN
    one (a float; a tensor one since that read takes tensors) handed over to torch's SGD,
    which stepped NaN weights, where every other NaN hyperparameter is refused by name."""
    model = TwoHeads()
    inner = torch.optim.SGD(model.trunk.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    opt = wrap(model, "auto", inner)
    train(model, opt, 1)
    opt.param_groups[0]["dampening"] = number(math.nan)
    with pytest.raises(ValueError, match="param group 0: hyperparameter 'dampening' must be a"):
        train(model, opt, 1)
    assert opt.path == "fast" and all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize("number", [float, torch.tensor], ids=["float", "tensor"])
@pytest.mark.parametrize("how", ["set later", "in an added group"])
def test_nesterov_with_dampening_hands_over_to_torch_which_steps_it(how, number):
    """torch.optim.SGD refuses nesterov with dampening only when built, and steps it when a
    group gets it later. The fast path's momentum refuses it always: it once raised at a
    later, unrelated rebuild, and refused such an add_param_group; a tensor dampening went on
    to those, where a float one handed over. torch's path takes it."""
    masters = {}
    for path in PATHS:
        model = TwoHeads()
        inner = torch.optim.SGD(model.trunk.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        opt = wrap(model, path, inner)
        if how == "in an added group":
            opt.add_param_group({"params": list(model.a.parameters()), "dampening": number(0.3)})
        train(model, opt, 2)
        if how == "set later":
            opt.param_groups[0]["dampening"] = number(0.5)
            train(model, opt, 1)
            opt.param_groups[0]["momentum"] = 0.0  # a rebuild, then another
            train(model, opt, 1)
            opt.param_groups[0]["momentum"] = 0.9
        train(model, opt, 2)
        assert opt.path == "generic"
        masters[path] = snapshot(opt)
    close(masters["fast"], masters["generic"])


@pytest.mark.parametrize("path", PATHS)
def test_apex_group_attributes_name_the_live_params_and_masters(path):
    """apex's fp16_groups / fp32_from_fp16_groups / fp32_from_fp32_groups, which apex-era
    checkpoint code reads: the model's FP16 params, the FP32 masters the groups hold for them
    (live: they follow a step and an add_param_group), the FP32 params."""
    model, gain = TwoHeads(), torch.ones(3, requires_grad=True)  # FP32: its own master
    opt = wrap(model, path, torch.optim.SGD(model.trunk.parameters(), lr=0.1))
    opt.add_param_group({"params": [*model.a.parameters(), gain]})
    train(model, opt, 2)
    assert [[id(p) for p in g] for g in opt.fp16_groups] == [
        [id(p) for p in model.trunk.parameters()],
        [id(p) for p in model.a.parameters()],
    ]
    assert [[id(p) for p in g] for g in opt.fp32_from_fp32_groups] == [[], [id(gain)]]
    groups = zip(opt.param_groups, opt.fp16_groups, opt.fp32_from_fp16_groups, strict=True)
    for group, fp16, masters in groups:
        assert all(any(m is e for e in group["params"]) for m in masters)
        assert all(m.dtype == torch.float32 for m in masters)
        assert all(torch.equal(m.half(), p) for m, p in zip(masters, fp16, strict=True))
    compact = wrap(TwoHeads(), "fast", master="compensated")
    with pytest.raises(RuntimeError, match="holds no FP32 master tensors"):
        _ = compact.fp32_from_fp16_groups


def test_grads_made_without_the_optimizer_after_a_handover_are_the_ones_stepped():
    # The handover marked the stepped grads as the next step's, unscaled: a model.zero_grad()
    # and backward() after it went unseen, and the next step stepped the old grads again.
    torch.manual_seed(0)
    a, b = nn.Linear(4, 3).half(), nn.Linear(5, 2).half()
    opt = FP16_Optimizer(torch.optim.SGD(a.parameters(), lr=1e-2), verbose=False, compiled=False)
    x, y = torch.ones(2, 4).half(), torch.ones(2, 5).half()
    a(x).float().sum().backward()  # every bias grad 2
    opt.step()
    opt.add_param_group({"params": list(b.parameters()), "maximize": True})  # torch's path
    assert opt.path == "generic"
    a_master, b_master = opt.param_groups[0]["params"][1], opt.param_groups[1]["params"][1]
    before = a_master.detach().clone(), b_master.detach().clone()
    a.zero_grad()
    b.zero_grad()
    (a(x).float().sum() * 2 + b(y).float().sum() * 2).backward()  # every bias grad 4
    opt.step()
    torch.testing.assert_close(a_master, before[0] - 1e-2 * 4)
    torch.testing.assert_close(b_master, before[1] + 1e-2 * 4)  # maximize
