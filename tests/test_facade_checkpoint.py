"""FP16_Optimizer checkpoints: bitwise continuation, weights_only files, dicts that do not fit
(the optimizer must be left exactly as it was) and apex checkpoints of both eras."""

from __future__ import annotations

import copy
import io
import math
import operator
import re

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fp16fx
from fp16fx.facade.policy import NO_CEILING, scaler_from_dict
from fp16fx.fp16_utils import FP16_Optimizer
from fp16fx.scaling import StaticLossScale
from tests.apex_fixtures import AMP_SCALER, LEGACY_DYNAMIC, LEGACY_STATIC, fake_apex, instance

PATHS = ["fast", "generic"]
APEX_KEYS = {
    "loss_scaler",
    "dynamic_loss_scale",
    "overflow",
    "first_closure_call_this_step",
    "optimizer_state_dict",
    "fp32_from_fp16",
}


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).half()
    model[2].bias.data = model[2].bias.data.float()  # an FP32 param among FP16 ones
    return model


def forward(model, x):
    return (model[2].weight.float() @ model[1](model[0](x)).float().T).T + model[2].bias


DATA = [(torch.randn(8, 5).half(), torch.randn(8, 2)) for _ in range(8)]
INNER = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-2),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
}


def wrap(model, path, inner="adam", **kwargs) -> FP16_Optimizer:
    kwargs.setdefault("dynamic_loss_scale", True)
    kwargs.setdefault("dynamic_loss_args", {"init_scale": 2.0**10, "scale_window": 2})
    return FP16_Optimizer(
        INNER[inner](model.parameters()), path=path, compiled=False, verbose=False, **kwargs
    )


def run(model, opt, steps, poison=()):
    """Trains on ``steps`` (indices into DATA); returns [(loss, scale used, skipped)]."""
    state = {"on": False}
    handle = model[0].weight.register_hook(lambda g: g * math.inf if state["on"] else g)
    trace = []
    for i in steps:
        opt.zero_grad()
        state["on"] = i in poison
        x, y = DATA[i]
        loss = ((forward(model, x) - y) ** 2).mean()
        scale = opt.loss_scale
        opt.backward(loss)
        opt.step()
        trace.append((loss.item(), scale, opt.overflow))
    handle.remove()
    return trace


def save_and_load(obj, **load_options):
    """Returns ``obj`` through ``torch.save`` and ``torch.load(weights_only=True)``."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True, **load_options)


def fingerprint(model, opt):
    """Everything an optimizer holds, copied: its state dict's leaves and the model's params."""
    leaves, treedef = optree.tree_flatten(opt.state_dict(), none_is_leaf=True)
    leaves += list(model.parameters())
    return treedef, [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves]


def assert_same_fingerprint(a, b):
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1], strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


@settings(max_examples=10, deadline=None)
@given(
    k=st.integers(1, 7),
    path=st.sampled_from(PATHS),
    inner=st.sampled_from(sorted(INNER)),
    poison=st.sets(st.integers(0, 7), max_size=2),
)
def test_save_load_continue_is_bitwise_the_uninterrupted_run(k, path, inner, poison):
    model = make_model()
    opt = wrap(model, path, inner)
    full = run(model, opt, range(8), poison)

    first = make_model()
    first_opt = wrap(first, path, inner)
    head = run(first, first_opt, range(k), poison)
    ckpt = save_and_load({"model": first.state_dict(), "optimizer": first_opt.state_dict()})
    resumed = make_model(seed=1)  # another init: everything must come from the checkpoint
    resumed_opt = wrap(resumed, path, inner)
    resumed.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["optimizer"])
    tail = run(resumed, resumed_opt, range(k, 8), poison)

    assert head + tail == full  # losses, loss scales (growth counter included), skips
    assert_same_fingerprint(fingerprint(resumed, resumed_opt), fingerprint(model, opt))


def test_a_clipped_run_resumes_bitwise_after_a_param_missed_its_gradient():
    """The missed gradient cut the state; the step counts that would say so are equal again
    (SGD momentum's). The global norm, summed per segment, differed in its last bit over a
    state loaded uncut, and so did the clipped steps after it."""

    def make():
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(5, 300), nn.Tanh(), nn.Linear(300, 2)).half()
        return model, wrap(model, "fast", "sgd")

    def step(model, opt, i, missed=()):
        opt.zero_grad(set_grads_to_None=True)
        x, y = DATA[i]
        opt.backward(((model(x).float() - y) ** 2).mean())
        for p in missed:
            p.grad = None
        opt.clip_master_grads(0.05)
        opt.step()

    model, opt = make()
    for i in range(3):
        step(model, opt, i, missed=[model[2].bias] if i == 1 else [])
    ckpt = save_and_load({"model": model.state_dict(), "optimizer": opt.state_dict()})
    resumed, resumed_opt = make()
    resumed.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["optimizer"])
    for i in range(3, 6):
        step(model, opt, i)
        step(resumed, resumed_opt, i)
    assert_same_fingerprint(fingerprint(resumed, resumed_opt), fingerprint(model, opt))


@pytest.mark.parametrize("path", PATHS)
def test_a_load_right_after_an_overflow_restores_the_flag_and_the_pending_overflows(path):
    """A run resumed then reads ``overflow`` as the saving run did, and its scale backs off
    at the next overflow as that run's would (its second under hysteresis 2)."""
    args = {"init_scale": 2.0**10, "hysteresis": 2}
    model = make_model()
    opt = wrap(model, path, dynamic_loss_args=args)
    run(model, opt, range(3), poison={2})
    sd = opt.state_dict()
    assert sd["overflow"] is True and sd["loss_scaler"]["overflows"] == 1
    resumed = make_model(seed=1)
    resumed_opt = wrap(resumed, path, dynamic_loss_args=args)
    resumed_opt.load_state_dict(sd)
    assert resumed_opt.overflow is True
    assert resumed_opt.state_dict()["loss_scaler"]["overflows"] == 1
    run(model, opt, [3], poison={3})
    run(resumed, resumed_opt, [3], poison={3})
    assert resumed_opt.loss_scale == opt.loss_scale == 2.0**9


@pytest.mark.parametrize("path", PATHS)
def test_state_dict_keeps_apexs_keys_with_a_plain_scaler(path):
    model = make_model()
    opt = wrap(model, path)
    run(model, opt, range(3), poison={1})
    sd = opt.state_dict()
    fast_only = {"applied_steps", "param_segments"} if path == "fast" else set()
    assert set(sd) == APEX_KEYS | {"trainable"} | fast_only
    assert sd["trainable"] == [[0, 1, 2, 3]]  # fp16fx's: which params train (none frozen)
    assert sd["loss_scaler"] == {
        "format": "fp16fx", "dynamic": True, "loss_scale": 2.0**9, "good_steps": 1,
        "overflows": 0, "init_scale": 2.0**10, "growth_factor": 2.0, "backoff_factor": 0.5,
        "growth_interval": 2, "hysteresis": 1, "min_scale": 2.0**-126, "max_scale": 2.0**24,
    }  # fmt: skip
    assert sd["dynamic_loss_scale"] is True and sd["overflow"] is False
    assert sd["first_closure_call_this_step"] is True
    (masters,) = sd["fp32_from_fp16"]
    assert [m.dtype for m in masters] == [torch.float32] * 3  # the FP32 bias is its own master
    assert all(torch.equal(m.half(), p) for m, p in zip(masters, model.parameters()))
    osd = sd["optimizer_state_dict"]
    assert osd["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert [sorted(s) for s in osd["state"].values()] == [["exp_avg", "exp_avg_sq", "step"]] * 4
    assert all(s["step"].item() == 2 for s in osd["state"].values())
    assert opt.state_dict()["loss_scaler"] == save_and_load(sd)["loss_scaler"]
    if path == "fast":  # the core's count of applied steps: a copy, as the step counts are
        run(model, opt, [3])
        assert int(sd["applied_steps"]) == 2 and int(opt.state_dict()["applied_steps"]) == 3
        assert all(s["step"].item() == 2 for s in osd["state"].values())


@pytest.mark.parametrize("path", PATHS)
def test_a_checkpoint_of_other_trained_params_is_refused_and_an_apex_dict_loads_by_position(path):
    """The state and masters are keyed by position among the trained params: saved with one
    param frozen, loaded with another frozen, each param once took its neighbour's values."""

    def build(frozen: int) -> tuple[nn.Module, FP16_Optimizer]:
        torch.manual_seed(0)
        model = nn.ParameterList([nn.Parameter(torch.randn(6).half()) for _ in range(3)])
        model[frozen].requires_grad_(False)
        opt = FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=0.1), path=path,
                             compiled=False, verbose=False, static_loss_scale=4.0)  # fmt: skip
        for i in range(2):
            opt.zero_grad()
            opt.backward(sum((p.float() * (k + i + 1)).sum() for k, p in enumerate(model)))
            opt.step()
        return model, opt

    _, saved = build(frozen=0)
    sd = save_and_load(saved.state_dict())
    assert sd["trainable"] == [[1, 2]]
    model, opt = build(frozen=2)
    before = fingerprint(model, opt)
    with pytest.raises(ValueError, match=r"it trained the params at \[1, 2\] of param group 0, "
                       r"this optimizer those at \[0, 1\]"):  # fmt: skip
        opt.load_state_dict(sd)
    assert_same_fingerprint(fingerprint(model, opt), before)
    del sd["trainable"]  # as apex saved it: by position, as apex loaded it
    opt.load_state_dict(sd)
    assert torch.equal(model[0], sd["fp32_from_fp16"][0][0].half())


def test_a_checkpoint_moves_between_the_fast_and_the_generic_path():
    results = {}
    for source, target in (("fast", "generic"), ("generic", "fast"), ("fast", "fast")):
        model = make_model()
        opt = wrap(model, source)
        run(model, opt, range(3))
        ckpt = save_and_load({"model": model.state_dict(), "optimizer": opt.state_dict()})
        other = make_model(seed=2)
        other_opt = wrap(other, target)
        other.load_state_dict(ckpt["model"])
        other_opt.load_state_dict(ckpt["optimizer"])
        run(other, other_opt, range(3, 6))
        results[source, target] = [p.detach().clone() for p in other_opt.param_groups[0]["params"]]
    for a, b in zip(results["fast", "generic"], results["fast", "fast"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(results["generic", "fast"], results["fast", "fast"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_a_static_scale_set_by_hand_saves_and_loads(path):
    """apex's loss_scale setter takes any scale FP32 holds for a static optimizer, one its
    policy (StaticLossScale(128)) never reaches, which a core state dict may not hold: the
    optimizer keeps it through a group added and through its own checkpoint, loaded into a
    dynamic optimizer at another scale."""
    static = {"dynamic_loss_scale": False, "dynamic_loss_args": None, "static_loss_scale": 128.0}
    opt = wrap(make_model(), path, **static)
    opt.loss_scale = 3.0
    opt.add_param_group({"params": [nn.Parameter(torch.ones(3).half())]})
    assert opt.loss_scale == 3.0
    saved = save_and_load(opt.state_dict())
    other_opt = wrap(make_model(seed=2), path)
    other_opt.add_param_group({"params": [nn.Parameter(torch.ones(3).half())]})
    other_opt.load_state_dict(saved)
    assert other_opt.loss_scale == 3.0 and not other_opt.dynamic_loss_scale


def _set(path, value):
    def corrupt(sd):
        *parents, last = path
        node = sd
        for key in parents:
            node = node[key]
        if value is DELETE:
            del node[last]
        else:
            node[last] = value(node[last]) if callable(value) else value
        return sd

    return corrupt


DELETE = object()
CORRUPTIONS = {
    "not a dict": (lambda sd: list(sd.items()), TypeError, "expects a dict"),
    "missing entry": (
        _set(["optimizer_state_dict"], DELETE),
        ValueError,
        "no \\['optimizer_state_dict'\\]",
    ),
    "unknown entry": (_set(["scheduler"], 1), ValueError, "unknown entries \\['scheduler'\\]"),
    "extra group": (
        _set(["optimizer_state_dict", "param_groups"], lambda gs: gs + gs),
        ValueError,
        "2 param group\\(s\\), this optimizer 1",
    ),
    "fewer params": (
        _set(["optimizer_state_dict", "param_groups", 0, "params"], lambda ps: ps[:-1]),
        ValueError,
        "param group 0 has 3 params in optimizer_state_dict, 4",
    ),
    "master shape": (
        _set(["fp32_from_fp16", 0, 1], torch.zeros(3)),
        ValueError,
        "fp32_from_fp16\\[0\\]\\[1\\] has shape \\(3,\\), its param \\(8,\\)",
    ),
    "master dtype": (
        _set(["fp32_from_fp16", 0, 0], lambda t: t.half()),
        ValueError,
        "fp32_from_fp16\\[0\\]\\[0\\] has dtype torch.float16, expected torch.float32",
    ),
    "master count": (
        _set(["fp32_from_fp16", 0], lambda ms: ms[:2]),
        ValueError,
        "fp32_from_fp16\\[0\\] has 2 master\\(s\\); this optimizer's group 0 has 3",
    ),
    "moment shape": (
        _set(["optimizer_state_dict", "state", 2, "exp_avg"], torch.zeros(7)),
        ValueError,
        "\\['state'\\]\\[2\\]\\['exp_avg'\\] has shape \\(7,\\), its param \\(2, 8\\)",
    ),
    "a moment missing": (
        _set(["optimizer_state_dict", "state", 2, "exp_avg"], DELETE),
        ValueError,
        "\\['state'\\]\\[2\\] lacks \\['exp_avg'\\]",
    ),
    "a moment that is None": (  # torch's own step reads it: once loaded, then every step raised
        _set(["optimizer_state_dict", "state", 2, "exp_avg"], None),
        ValueError,
        "\\['state'\\]\\[2\\]\\['exp_avg'\\] is None, not a tensor",
    ),
    "a step count past int64": (
        _set(["optimizer_state_dict", "state", 2, "step"], torch.tensor(1e30)),
        ValueError,
        "\\['step'\\] is tensor\\(1.0000e\\+30\\), not a step count",
    ),
    "state of another optimizer": (
        _set(["optimizer_state_dict", "state", 0], {"momentum_buffer": torch.zeros(8, 5)}),
        ValueError,
        "\\['momentum_buffer'\\], which torch.optim.Adam does not keep",
    ),
    "state for no param": (
        _set(["optimizer_state_dict", "state", 9], {}),
        ValueError,
        "an entry 9 for no param",
    ),
    "scaler format": (
        _set(["loss_scaler", "format"], "deepspeed"),
        ValueError,
        "unknown format 'deepspeed'",
    ),
    "scaler value": (
        _set(["loss_scaler", "loss_scale"], 0.0),
        ValueError,
        "'loss_scale'\\] must be a finite number > 0",
    ),
    # Values an FP32 scale and int32 counters cannot hold: found before anything is written.
    "scaler value past FP32": (
        _set(["loss_scaler", "loss_scale"], 1e39),
        ValueError,
        "'loss_scale'\\] must be .* FP32 holds as a normal value",
    ),
    "scaler count past int32": (
        _set(["loss_scaler", "good_steps"], 2**40),
        ValueError,
        "'good_steps'\\] must be a count in \\[0, 2\\*\\*31\\)",
    ),
    # One the rule resets first: past it, the int32 counter wrapped and the scale froze.
    "scaler count past its bound": (
        _set(["loss_scaler", "overflows"], 2**31 - 1),
        ValueError,
        "loss_scaler: overflows is 2147483647, but the policy resets it .* hysteresis, 1",
    ),
    # Values no run saves, which would train into NaN: refused before anything is written.
    "a NaN master": (
        _set(["fp32_from_fp16", 0, 1], lambda t: t * math.nan),
        ValueError,
        "fp32_from_fp16\\[0\\]\\[1\\] holds inf or NaN",
    ),
    "a negative second moment": (
        _set(["optimizer_state_dict", "state", 2, "exp_avg_sq"], lambda t: -1 - t),
        ValueError,
        "\\['exp_avg_sq'\\] holds negative values",
    ),
    "a negative step count": (
        _set(["optimizer_state_dict", "state", 2, "step"], lambda t: t - 100),
        ValueError,
        "\\['step'\\] is tensor\\(-97\\.\\), not a step count",
    ),
    "a master past FP16's range": (
        _set(["fp32_from_fp16", 0, 1], lambda t: t + 1e5),
        ValueError,
        "fp32_from_fp16\\[0\\]\\[1\\] holds values past torch.float16's largest \\(65504\\)",
    ),
    "master on meta": (
        _set(["fp32_from_fp16", 0, 1], lambda t: t.to("meta")),
        ValueError,
        "fp32_from_fp16\\[0\\]\\[1\\] is a meta tensor",
    ),
    "scaler entry": (_set(["loss_scaler", "good_steps"], DELETE), ValueError, "no 'good_steps'"),
    "scaler object": (_set(["loss_scaler"], object()), ValueError, "loss_scaler: .*not an apex"),
    "scaler kind": (
        _set(["dynamic_loss_scale"], False),
        ValueError,
        "dynamic_loss_scale is False but",
    ),
    "flag type": (_set(["overflow"], "no"), ValueError, "overflow must be a bool"),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", CORRUPTIONS)
def test_a_state_dict_that_does_not_fit_is_refused_and_changes_nothing(path, name):
    corrupt, error, match = CORRUPTIONS[name]
    model, twin = make_model(), make_model()
    opt, twin_opt = wrap(model, path), wrap(twin, path)
    run(model, opt, range(2))
    run(twin, twin_opt, range(2))
    good = save_and_load(opt.state_dict())
    other = make_model(seed=3)
    other_opt = wrap(other, path)
    run(other, other_opt, range(4), poison={2})
    before = fingerprint(model, opt)
    with pytest.raises(error, match=match):
        opt.load_state_dict(corrupt(copy.deepcopy(save_and_load(other_opt.state_dict()))))
    assert_same_fingerprint(fingerprint(model, opt), before)
    assert run(model, opt, range(2, 4)) == run(twin, twin_opt, range(2, 4))  # still works
    opt.load_state_dict(good)  # and a good dict still loads


#: torch.optim.Adam states for a param that no run holds, each with the fault named: the fast
#: path's takeover of a wrapped optimizer's state checked them by rules of its own, and took
#: a fractional step (rounded down), a key Adam does not keep, an integer moment and an unused
#: maximum of another shape, and refused a negative step by the core's keys, after the check
#: by name, and one past int64 with int()'s OverflowError; a saved dict holding them was refused.
HELD_MISFITS = {
    "a fractional step": (
        {"step": torch.tensor(2.5)},
        "['step'] is tensor(2.5000), not a step count",
    ),
    "a negative step": ({"step": -1}, "['step'] is -1, not a step count"),
    "a step past int64": ({"step": 1e30}, "['step'] is 1e+30, not a step count"),
    "two steps": ({"step": torch.ones(2)}, "['step'] is tensor([1., 1.]), not a step count"),
    "a key Adam does not keep": (
        {"momentum_buffer": torch.zeros(8, 5)},
        " has ['momentum_buffer'], which torch.optim.Adam does not keep",
    ),
    "an integer moment": (
        {"exp_avg": torch.zeros(8, 5, dtype=torch.int64)},
        "['exp_avg'] has dtype torch.int64, expected a floating-point tensor",
    ),
    "a maximum of another shape": (
        {"max_exp_avg_sq": torch.zeros(7)},
        "['max_exp_avg_sq'] has shape (7,), its param (8, 5)",
    ),
}


@pytest.mark.parametrize("name", HELD_MISFITS)
def test_the_takeover_and_the_load_refuse_a_torch_state_alike_changing_nothing(name):
    """What torch.optim's per-param state may hold is defined once: a state the takeover
    accepted could fail to load, and the reverse. Both refuse it by the same fault -- the
    takeover naming the param, the load the dict's entry -- leaving everything as it was."""
    changes, fault = HELD_MISFITS[name]
    model = make_model()
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = model[0].weight
    zeros = torch.zeros(8, 5)
    held = {"step": torch.tensor(3.0), "exp_avg": zeros, "exp_avg_sq": zeros.clone(), **changes}
    inner.state[first] = held
    given = inner.param_groups, inner.param_groups[0], inner.state, dict(held)
    where = [(p.data_ptr(), p.detach().clone()) for p in model.parameters()]
    holds = "the state the optimizer given holds for param_groups[0]['params'][0]: state"
    with pytest.raises(ValueError, match=re.escape(holds + fault)):
        FP16_Optimizer(inner, path="fast", compiled=False, verbose=False)
    assert (inner.param_groups, inner.param_groups[0], inner.state) == given[:3]
    assert all(map(operator.is_, inner.param_groups[0]["params"], model.parameters()))
    assert list(inner.state) == [first] and inner.state[first] is held
    assert held.keys() == given[3].keys() and all(held[k] is v for k, v in given[3].items())
    for p, (ptr, value) in zip(model.parameters(), where, strict=True):
        assert p.data_ptr() == ptr and torch.equal(p, value)

    opt = wrap(model, "fast")
    run(model, opt, range(2))
    sd = save_and_load(opt.state_dict())
    sd["optimizer_state_dict"]["state"][0].update(changes)
    before = fingerprint(model, opt)
    entry = "the state dict does not fit this FP16_Optimizer: optimizer_state_dict['state'][0]"
    with pytest.raises(ValueError, match=re.escape(entry + fault)):
        opt.load_state_dict(sd)
    assert_same_fingerprint(fingerprint(model, opt), before)


def test_a_dict_saved_after_amsgrad_was_switched_on_resumes_bitwise():
    """Saved before the next step, the state has no max_exp_avg_sq yet, which the step would
    start at zero: the load refused it as incomplete, even into the optimizer that saved it."""
    model, resumed = make_model(), make_model(seed=1)
    opt, resumed_opt = wrap(model, "fast"), wrap(resumed, "fast")
    run(model, opt, range(2))
    opt.param_groups[0]["amsgrad"] = True
    ckpt = save_and_load({"model": model.state_dict(), "optimizer": opt.state_dict()})
    resumed.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["optimizer"])
    assert run(model, opt, range(2, 5)) == run(resumed, resumed_opt, range(2, 5))
    assert_same_fingerprint(fingerprint(resumed, resumed_opt), fingerprint(model, opt))
    generic = wrap(make_model(), "generic")  # torch's own step reads the maximum: refused
    before = fingerprint(make_model(), generic)
    with pytest.raises(ValueError, match=r"\['state'\]\[0\] lacks \['max_exp_avg_sq'\]"):
        generic.load_state_dict(ckpt["optimizer"])
    as_none = copy.deepcopy(ckpt["optimizer"])  # torch keeps None where amsgrad is off
    as_none["optimizer_state_dict"]["state"][0]["max_exp_avg_sq"] = None
    with pytest.raises(ValueError, match=r"\['state'\]\[0\] lacks \['max_exp_avg_sq'\]"):
        generic.load_state_dict(as_none)
    assert_same_fingerprint(fingerprint(make_model(), generic), before)


@pytest.mark.parametrize("master", ["fp32", "compensated"])
def test_a_load_that_fails_after_rebuilding_the_groups_puts_them_back(monkeypatch, master):
    """A dict that turns amsgrad on rebuilds the fast path's transform before its state is
    loaded: a failure then once left the new structure with fresh moments. (Every dict that
    does not fit is refused before that point; this failure is forced.) Compensated, the
    groups hold the model's params and take the loaded numbers before the rebuild."""
    model, twin = make_model(), make_model()
    opt, twin_opt = wrap(model, "fast", master=master), wrap(twin, "fast", master=master)
    run(model, opt, range(2))
    run(twin, twin_opt, range(2))
    sd = copy.deepcopy(save_and_load(opt.state_dict()))
    sd["optimizer_state_dict"]["param_groups"][0]["amsgrad"] = True
    for state in sd["optimizer_state_dict"]["state"].values():
        state["max_exp_avg_sq"] = state["exp_avg_sq"].clone()
    before = fingerprint(model, opt)

    def out_of_memory(*args):
        raise RuntimeError("out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(fp16fx.checkpoint, "load_state_dict", out_of_memory)
        with pytest.raises(RuntimeError, match="out of memory"):
            opt.load_state_dict(sd)
    assert_same_fingerprint(fingerprint(model, opt), before)
    assert run(model, opt, range(2, 4)) == run(twin, twin_opt, range(2, 4))


def test_bad_hyperparameters_are_refused_before_loading_on_the_fast_path():
    model = make_model()
    opt = wrap(model, "fast")
    sd = save_and_load(opt.state_dict())
    sd["optimizer_state_dict"]["param_groups"][0]["betas"] = (0.9, 1.5)
    before = fingerprint(model, opt)
    with pytest.raises(
        ValueError,
        match=r"param group 0: hyperparameter 'betas' must be a pair of numbers in \[0, 1\), "
        r"got 1.5",
    ):
        opt.load_state_dict(sd)
    assert_same_fingerprint(fingerprint(model, opt), before)


# -- apex checkpoints ------------------------------------------------------------------------


def apex_state_dict(model, loss_scaler, dynamic=True) -> dict:
    """What apex's FP16_Optimizer(SGD(momentum=0.9)).state_dict() holds after one step."""
    torch.manual_seed(5)
    masters = [
        (p.detach().float() + 0.01 * torch.randn(p.shape)).requires_grad_()
        for p in model.parameters()
    ]
    sgd = torch.optim.SGD(masters, lr=0.05, momentum=0.9)
    for m in masters:
        m.grad = torch.randn(m.shape)
    sgd.step()
    return {
        "loss_scaler": loss_scaler,
        "dynamic_loss_scale": dynamic,
        "overflow": False,
        "first_closure_call_this_step": True,
        "optimizer_state_dict": sgd.state_dict(),
        "fp32_from_fp16": [
            [m for m, p in zip(masters, model.parameters()) if p.dtype != torch.float32]
        ],
    }


def load_apex(tmp_path, sd) -> dict:
    with fake_apex():
        torch.save(sd, tmp_path / "apex.pt")
    return fp16fx.load_apex_checkpoint(tmp_path / "apex.pt")


APEX_SCALERS = {
    "amp": (
        instance(AMP_SCALER, _loss_scale=2.0**13, dynamic=True, _unskipped=1, _scale_seq_len=3,
               _max_loss_scale=2.0**24, _min_loss_scale=None, _has_overflow=False,
               _overflow_buf=torch.zeros(1, dtype=torch.int32)),
        [2.0**13, 2.0**13, 2.0**14, 2.0**14],  # 1 of 3 clean steps done: grows after 2 more
    ),
    "legacy dynamic": (
        instance(LEGACY_DYNAMIC, cur_scale=2.0**12, cur_iter=12, last_overflow_iter=9,
               scale_factor=2.0, scale_window=5),
        [2.0**12, 2.0**12, 2.0**12, 2.0**13],  # grows at iteration 14: (14 - 9) % 5 == 0
    ),
    "legacy static": (instance(LEGACY_STATIC, cur_scale=128.0), [128.0] * 4),
    # Saved beside dynamic_loss_scale=True: its scale never moves, a static one.
    "legacy dynamic, factor 1": (
        instance(LEGACY_DYNAMIC, cur_scale=2.0**12, cur_iter=12, last_overflow_iter=9,
               scale_factor=1.0, scale_window=5),
        [2.0**12] * 4,
    ),
}  # fmt: skip
STATIC_ERAS = ("legacy static", "legacy dynamic, factor 1")


AMP_DICT = {
    "format": "apex.amp", "loss_scale": 2.0**13, "dynamic": True, "unskipped": 1,
    "scale_window": 2000, "min_loss_scale": None, "max_loss_scale": 2.0**24,
}  # fmt: skip


@pytest.mark.parametrize(
    ("entry", "value"),
    [
        ("max_loss_scale", math.nan),
        ("max_loss_scale", 0.0),
        ("min_loss_scale", -1.0),
        ("min_loss_scale", math.inf),
        ("scale_window", math.inf),
        ("scale_window", math.nan),
    ],
)
def test_amp_scaler_bounds_are_checked_by_name_and_an_infinite_ceiling_is_none(entry, value):
    """They once raised bare OverflowErrors and math domain errors from the rounding to a
    power of two; apex amp's own ceiling of inf (no ceiling) loads as none."""
    with pytest.raises(ValueError, match=rf"loss_scaler\['{entry}'\] must be"):
        scaler_from_dict({**AMP_DICT, entry: value})
    policy, values = scaler_from_dict({**AMP_DICT, "max_loss_scale": math.inf})
    assert policy.max_scale == NO_CEILING and values.scale == 2.0**13
    for finite in (2.0**127, 3e38):  # a finite ceiling is never above none
        assert scaler_from_dict({**AMP_DICT, "max_loss_scale": finite})[0].max_scale == NO_CEILING


@pytest.mark.parametrize("entry", ["unskipped", "scale_window", "loss_scale", "min_loss_scale"])
def test_amp_scaler_numbers_past_a_floats_range_are_refused_by_name(entry):
    """An int too large for a float once escaped as an unnamed OverflowError (a ceiling that
    large is none, as amp's inf)."""
    with pytest.raises(ValueError, match=rf"loss_scaler(\['{entry}'\]|: growth_interval)"):
        scaler_from_dict({**AMP_DICT, entry: 10**400})
    assert scaler_from_dict({**AMP_DICT, "max_loss_scale": 10**400})[0].max_scale == NO_CEILING


def test_a_legacy_dynamic_scaler_whose_scale_never_moves_loads_as_a_static_one():
    """apex's legacy DynamicLossScaler(scale_factor=1) divides and multiplies by 1."""
    legacy = {
        "format": "apex.fp16_utils.dynamic", "loss_scale": 2.0**10, "dynamic": True,
        "cur_iter": 40, "last_overflow_iter": 7, "scale_factor": 1.0, "scale_window": 1000,
    }  # fmt: skip
    assert scaler_from_dict(legacy) == (StaticLossScale(2.0**10), (2.0**10, 0, 0))


def test_amp_bounds_an_ulp_off_a_power_of_two_move_inwards():
    """math.log2 rounded them onto the power of two, just outside apex's own bounds."""
    floor, ceiling = math.nextafter(2.0**10, math.inf), math.nextafter(2.0**14, 0.0)
    policy, _ = scaler_from_dict({**AMP_DICT, "min_loss_scale": floor, "max_loss_scale": ceiling})
    assert (policy.min_scale, policy.max_scale) == (2.0**11, 2.0**13)


def test_an_apex_scale_that_underflowed_to_zero_is_refused_by_the_optimizers_load(tmp_path):
    scaler = instance(AMP_SCALER, **{**APEX_SCALERS["amp"][0].__dict__, "_loss_scale": 0.0})
    loaded = load_apex(tmp_path, apex_state_dict(make_model(seed=4), scaler))
    model = make_model()
    opt = FP16_Optimizer(INNER["sgd"](model.parameters()), dynamic_loss_scale=True, compiled=False)
    before = fingerprint(model, opt)
    with pytest.raises(ValueError, match=r"loss_scaler\['loss_scale'\]"):
        opt.load_state_dict(loaded)
    assert_same_fingerprint(fingerprint(model, opt), before)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("era", APEX_SCALERS)
def test_an_apex_checkpoint_loads_and_training_continues(tmp_path, path, era):
    loss_scaler, scales = APEX_SCALERS[era]
    apex_sd = apex_state_dict(make_model(seed=4), loss_scaler, dynamic=era != "legacy static")
    static = era in STATIC_ERAS
    loaded = load_apex(tmp_path, apex_sd)
    assert isinstance(loaded["loss_scaler"], dict)
    model = make_model()
    opt = FP16_Optimizer(
        INNER["sgd"](model.parameters()), dynamic_loss_scale=True, path=path, compiled=False
    )
    opt.load_state_dict(loaded)
    assert opt.dynamic_loss_scale is not static and opt.loss_scale == scales[0]
    (masters,) = apex_sd["fp32_from_fp16"]
    entries = opt.param_groups[0]["params"]
    assert all(torch.equal(e, m) for e, m in zip(entries, masters))
    assert all(torch.equal(p, m.half()) for p, m in zip(model.parameters(), masters))
    saved = apex_sd["optimizer_state_dict"]["state"]
    for i, e in enumerate(entries):
        assert torch.equal(opt.state[e]["momentum_buffer"], saved[i]["momentum_buffer"])
    assert [t[1] for t in run(model, opt, range(4))] == scales

    # The same continuation from the raw dict, its scaler still an (apex) object.
    again = make_model()
    again_opt = FP16_Optimizer(INNER["sgd"](again.parameters()), path=path, compiled=False)
    again_opt.load_state_dict(apex_sd)
    run(again, again_opt, range(4))
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters()))
