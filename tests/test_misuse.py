"""What careless and demanding users did to fp16fx, and what it does about it.

Each test is a scenario that once trained wrongly without an error, crashed, or refused
something it should not have; it fails on the code before the fix.
"""

from __future__ import annotations

import copy
import logging
import operator
import pickle
import re

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch._dynamo.utils import counters

import fp16fx
import fp16fx.distributed as fdist
from fp16fx.compile import StepFunction
from fp16fx.flat import FlatParams
from fp16fx.fp16_utils import FP16_Optimizer

PATHS = ["fast", "generic"]


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).half()


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 4, generator=g).half(), torch.randn(8, 2, generator=g)


def loss_of(model: nn.Module, i: int) -> torch.Tensor:
    x, y = batch(i)
    return ((model(x).float() - y) ** 2).mean()


def wrap(model: nn.Module, path: str, inner=None, **kwargs) -> FP16_Optimizer:
    inner = inner or torch.optim.Adam(model.parameters(), lr=1e-2)
    kwargs.setdefault("verbose", False)
    return FP16_Optimizer(inner, path=path, compiled=False, **kwargs)


# -- 1. gradient accumulation: the scale moves once per step, on both paths ----------------


@pytest.mark.parametrize("path", PATHS)
def test_accumulated_grads_carry_one_scale_and_the_scale_moves_once_per_step(path):
    model = nn.Linear(1, 1, bias=False).half()
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = wrap(
        model,
        path,
        torch.optim.SGD(model.parameters(), lr=0.0),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 1024, "scale_window": 2},
    )
    x = torch.ones(1, 1).half()
    for step in range(3):
        opt.zero_grad()
        for _ in range(4):  # the default update_master_grads=True, each time
            opt.backward(model(x).float().sum() / 4)
        (grads,) = opt.inspect_master_grad_data()
        assert grads[0].item() == 1.0  # d(sum of 4 quarters)/dw, exactly
        opt.step()
        assert opt.loss_scale == 1024 * 2 ** ((step + 1) // 2)  # grows every 2 steps


EVENTS = st.lists(
    st.sampled_from(["backward", "backward", "overflow", "step", "zero_grad"]),
    min_size=1,
    max_size=12,
)


@settings(max_examples=25, deadline=None)
@given(events=EVENTS)
def test_both_paths_follow_the_same_scale_and_grads_through_any_sequence(events):
    """hypothesis picks the sequence of backward, overflowing backward, step and zero_grad."""
    runs = {}
    for path in PATHS:
        model = make_model()
        first = next(model.parameters())
        bad = {"on": False}
        first.register_hook(lambda g, bad=bad: g * float("inf") if bad["on"] else g)
        opt = wrap(
            model,
            path,
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            dynamic_loss_scale=True,
            dynamic_loss_args={"init_scale": 2.0**10, "scale_window": 2},
        )
        trace = []
        for i, event in enumerate(["zero_grad", *events, "step"]):
            if event == "zero_grad":
                opt.zero_grad()
            elif event == "step":
                opt.step()
            else:
                bad["on"] = event == "overflow"
                opt.backward(loss_of(model, i))
                bad["on"] = False
            trace.append(opt.loss_scale)
        runs[path] = trace, [p.detach().clone() for p in model.parameters()]
    assert runs["fast"][0] == runs["generic"][0]
    for a, b in zip(runs["fast"][1], runs["generic"][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)  # FP16 params, ulp apart


# -- 2. weights written after the optimizer was built ---------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("how", ["load_state_dict", "clamp through .data", "no_grad copy"])
def test_weights_written_after_wrapping_are_kept_not_undone(path, how):
    model = make_model()
    opt = wrap(model, path, torch.optim.Adam(model.parameters(), lr=1e-4))
    for i in range(3):
        opt.zero_grad()
        opt.backward(loss_of(model, i))
        opt.step()
    target = make_model(seed=7)
    if how == "load_state_dict":
        model.load_state_dict(target.state_dict())
    elif how == "clamp through .data":  # the classic WGAN weight clipping
        for p in model.parameters():
            p.data.clamp_(-0.01, 0.01)
    else:
        with torch.no_grad():
            for p, q in zip(model.parameters(), target.parameters()):
                p.copy_(q)
    written = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    opt.backward(loss_of(model, 9))
    opt.step()  # lr 1e-4: one step moves each weight by about 1e-4, not back to the old ones
    for p, w in zip(model.parameters(), written):
        assert (p.float() - w.float()).abs().max().item() < 2e-3
    masters = [m for g in opt.param_groups for m in g["params"]]
    for m, w in zip(masters, written):
        assert (m.detach() - w.float()).abs().max().item() < 2e-3


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("then", ["state_dict, resume", "add_param_group", "momentum on"])
def test_weights_written_before_a_checkpoint_or_a_rebuild_stay_written(path, then):
    """The step adopts a written weight; a checkpoint, a new param group or a structural
    change before that step once saved or rebuilt the fast path's state from the old FP32
    masters and set the weights back to them (a resumed run lost a WGAN clamp)."""

    def sgd(model):
        return wrap(model, path, torch.optim.SGD(model.parameters(), lr=1e-2))

    model = make_model()
    opt = sgd(model)
    for i in range(3):
        opt.zero_grad()
        opt.backward(loss_of(model, i))
        opt.step()
    written = make_model(seed=7).state_dict()
    model.load_state_dict(written)
    if then == "state_dict, resume":
        sd = opt.state_dict()
        model = make_model(seed=3)
        model.load_state_dict(written)
        opt = sgd(model)
        opt.load_state_dict(sd)
    elif then == "add_param_group":
        opt.add_param_group({"params": [torch.zeros(3, dtype=torch.half, requires_grad=True)]})
    else:  # the fast path rebuilds its state at the next step
        opt.param_groups[0]["momentum"] = 0.9
    opt.param_groups[0]["lr"] = 0.0  # a step that moves nothing: the weights stay written
    opt.zero_grad()
    opt.backward(loss_of(model, 5))
    opt.step()
    assert all(torch.equal(p, written[k]) for k, p in model.state_dict().items())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("inner", ["adamw", "sgd"])
def test_saving_after_weights_were_written_leaves_the_run_as_it_was(path, inner):
    """The dict holds the written weights, and the run that saved it steps on bitwise as one
    that never did: the fast step decays the old master, then adopts the written weight;
    saving once adopted it in place first, which dropped that decay from the saving run."""

    def run(save: bool) -> list[torch.Tensor]:
        model = make_model()
        opt = wrap(
            model,
            path,
            torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.5)
            if inner == "adamw"
            else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.5),
        )
        for i in range(4):
            opt.zero_grad()
            opt.backward(loss_of(model, i))
            opt.step()
            if i == 1:
                with torch.no_grad():
                    model[0].weight.clamp_(-0.1, 0.1)
                if save:  # the master rounds to the written weight (clamped to 0.1)
                    master = opt.state_dict()["fp32_from_fp16"][0][0]
                    assert torch.equal(master.half(), model[0].weight)
        return [p.detach().clone() for p in model.parameters()]

    never, saved = run(save=False), run(save=True)
    assert all(torch.equal(a, b) for a, b in zip(never, saved, strict=True))


def test_saving_copies_the_masters_only_where_a_weight_was_written():
    """torch.optim's state_dict holds references; so does the fast path's, for masters whose
    weights nobody wrote (a copy of every master at each save costs 4 B/param)."""
    model = make_model()
    opt = wrap(model, "fast")
    opt.backward(loss_of(model, 0))
    opt.step()
    live = opt.param_groups[0]["params"][0]
    assert opt.state_dict()["fp32_from_fp16"][0][0].data_ptr() == live.data_ptr()
    with torch.no_grad():
        model[0].weight.clamp_(-0.1, 0.1)
    before = live.detach().clone()
    saved = opt.state_dict()["fp32_from_fp16"][0][0]
    assert saved.data_ptr() != live.data_ptr() and torch.equal(saved.half(), model[0].weight)
    assert torch.equal(live, before)


@pytest.mark.parametrize("path", PATHS)
def test_a_model_whose_params_were_replaced_is_refused_by_name(path):
    model = make_model()
    opt = wrap(model, path)
    model.load_state_dict(make_model(seed=3).state_dict(), assign=True)
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[0\].*assign=True"):
        opt.backward(loss_of(model, 0))
        opt.step()


# -- 3. many layouts in one process ----------------------------------------------------------


@pytest.mark.compile
def test_more_layouts_than_dynamos_recompile_limit_each_compile_their_own_step():
    torch._dynamo.reset()
    counters.clear()
    step = fp16fx.compile_step(inplace=True)
    widths = range(1, torch._dynamo.config.recompile_limit + 3)  # a notebook sweeping widths
    for width in widths:
        params = {"w": torch.ones(width, 3).half(), "b": torch.ones(width).half()}
        state = fp16fx.init(params, fp16fx.sgd(0.25), fp16fx.StaticLossScale(1.0), buckets=True)
        grads = fp16fx.grad_buffers(state)
        for g in optree.tree_leaves(grads):
            g.fill_(1.0)
        state, info = step(state, grads)
        assert bool(info.finite) and params["b"].tolist() == [0.75] * width
    assert counters["stats"]["unique_graphs"] == len(widths)  # compiled, none ran eagerly


# -- 4. sparse gradients ----------------------------------------------------------------------


def test_sparse_gradients_take_the_generic_path_and_train():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True).half()
    before = emb.weight.detach().clone()
    opt = FP16_Optimizer(torch.optim.SGD(emb.parameters(), lr=0.5), verbose=False)
    idx = torch.tensor([1, 4])
    for _ in range(2):
        opt.zero_grad()
        opt.backward(emb(idx).float().sum())
        opt.step()
    assert opt.path == "generic"
    moved = (emb.weight.float() - before.float()).abs().sum(dim=1) > 0
    assert moved.tolist() == [i in (1, 4) for i in range(10)]


def test_overflow_and_state_dict_read_a_sparse_gradient_before_the_step_hands_it_over():
    """apex scripts read ``overflow`` after backward: with a sparse grad still on the fast
    path, it (and state_dict, which saves it) raised TypeError from the flat buffers."""
    emb = nn.Embedding(10, 3, sparse=True).half()
    opt = FP16_Optimizer(torch.optim.SGD(emb.parameters(), lr=0.5), verbose=False)
    opt.backward(emb(torch.tensor([1, 4])).float().sum())
    assert opt.path == "fast" and opt.overflow is False
    assert opt.state_dict()["overflow"] is False
    opt.zero_grad()
    opt.backward(emb(torch.tensor([1])).float().sum() * float("inf"))
    assert opt.overflow is True


def test_clip_and_inspect_hand_a_sparse_gradient_over_as_step_does():
    """clip_master_grads and inspect_master_grad_data raised the fast path's internal
    Unsupported for a sparse grad, where step() switched to the generic path."""
    for call in ("clip", "inspect"):
        torch.manual_seed(0)
        emb = nn.Embedding(10, 4, sparse=True).half()
        opt = FP16_Optimizer(
            torch.optim.SGD(emb.parameters(), lr=0.1), static_loss_scale=4.0, verbose=False
        )
        opt.backward(emb(torch.tensor([1, 2, 2])).float().sum() * 0.5)
        opt.loss_scale = 8.0  # the grads keep the scale they were made with (it once lapsed)
        if call == "clip":
            assert opt.clip_master_grads(0.5) == pytest.approx(5**0.5)  # rows 1 and 2 (twice)
        else:
            (grad,) = opt.inspect_master_grad_data()[0]
            assert grad.to_dense()[2].tolist() == [1.0] * 4
        assert opt.path == "generic"
        opt.step()


def test_a_sparse_gradient_held_when_the_optimizer_is_built_takes_the_generic_path():
    """It once failed inside the flat buffers' copy of the grads, after the params had moved
    into them; FlatParams (the facade's and fdist.init(shard=True)'s buffers) refuses it
    before moving anything."""
    emb = nn.Embedding(10, 3, sparse=True).half()
    emb(torch.tensor([1, 4])).float().sum().backward()
    opt = FP16_Optimizer(torch.optim.SGD(emb.parameters(), lr=0.5), verbose=False)
    assert opt.path == "generic"
    opt.step()
    weight = emb.weight
    before = (weight.data_ptr(), weight.detach().clone())
    with pytest.raises(TypeError, match=r"param 0 has a torch\.sparse_coo gradient"):
        FlatParams([weight])
    assert weight.data_ptr() == before[0] and torch.equal(weight, before[1])


@pytest.mark.parametrize(
    ("inner", "refused"),
    [
        (lambda ps: torch.optim.Adam(ps), r"torch\.optim\.Adam does not"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.01), "SGD with weight_decay does"),
    ],
)
def test_a_sparse_gradient_the_optimizer_refuses_is_refused_before_switching_paths(inner, refused):
    """torch's Adam takes no sparse grad, nor its SGD with weight decay: the switch to the
    generic path once happened for good, and torch then refused the step. A load, which
    replaces the state, still switches (its step refuses the grad, as torch's would)."""
    emb = nn.Embedding(10, 3, sparse=True).half()
    opt = FP16_Optimizer(inner(emb.parameters()), static_loss_scale=4.0, verbose=False)
    saved = opt.state_dict()
    opt.backward(emb(torch.tensor([1, 4])).float().sum())
    with pytest.raises(ValueError, match=refused):
        opt.step()
    assert opt.path == "fast" and "param_segments" in opt.state_dict()
    saved["optimizer_state_dict"]["param_groups"][0]["maximize"] = True  # the generic path's
    opt.load_state_dict(saved)
    assert opt.path == "generic"


def test_the_generic_path_refuses_params_whose_data_was_replaced():
    """model.half() after wrapping turned an FP32 param, its own master, into an FP16 one the
    generic path stepped without a master (the fast path finds it out of its flat buffer)."""
    model = nn.Sequential(nn.Linear(4, 2)).half()
    gain = nn.Parameter(torch.ones(2))
    opt = FP16_Optimizer(
        torch.optim.SGD([*model.parameters(), gain], lr=0.1), path="generic", verbose=False
    )
    model.half()
    gain.data = gain.data.half()
    opt.backward((model(torch.ones(1, 4).half()).float() * gain.float()).sum())
    with pytest.raises(
        RuntimeError, match=r"was torch.float32 \(2,\) on cpu when FP16_Optimizer took"
    ):
        opt.step()


def test_loss_scale_takes_a_one_element_tensor():
    """apex's setter took any value; a tensor was refused as no number."""
    opt = FP16_Optimizer(
        torch.optim.SGD(nn.Linear(2, 2).half().parameters(), lr=0.1), verbose=False
    )
    opt.loss_scale = torch.tensor(8.0)
    assert opt.loss_scale == 8.0


# -- 5. finite but huge gradients --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_grads_whose_squares_overflow_are_applied_not_skipped(dtype):
    params = {"w": torch.zeros(4, dtype=dtype)}
    state = fp16fx.init(params, fp16fx.sgd(1e-20), fp16fx.NoLossScale())
    state, info = fp16fx.step(state, {"w": torch.full((4,), 1e19, dtype=dtype)})
    assert bool(info.finite) and state.count.item() == 1
    assert torch.isinf(info.grad_norm)  # the FP32 norm overflows, as torch's clip_grad_norm_'s
    assert state.params["w"].float().tolist() == pytest.approx([-0.1] * 4, rel=1e-2)


# -- 6. a NaN burst that drives the scale below 1 -------------------------------------------


def test_a_scale_below_one_is_reported_once_with_the_remedy(caplog):
    model = make_model()
    opt = FP16_Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        dynamic_loss_scale=True,
        verbose=False,
        compiled=False,
        report_interval=5,
    )
    first = next(model.parameters())
    first.register_hook(lambda g: g * float("nan"))
    with caplog.at_level(logging.WARNING, logger="fp16fx"):
        for i in range(40):  # 2**16 halved 40 times: far below 1
            opt.zero_grad()
            opt.backward(loss_of(model, i))
            opt.step()
    below = [r for r in caplog.records if "below 1" in r.getMessage()]
    assert len(below) == 1 and "min_loss_scale" in below[0].getMessage()


# -- 7. smaller ones ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_a_param_listed_twice_in_a_group_is_refused_by_name(path):
    model = make_model()
    params = list(model.parameters())
    with pytest.warns(UserWarning, match="duplicate parameters"):  # torch.optim's own
        inner = torch.optim.SGD([*params, params[0]], lr=0.1)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[4\] is .*twice"):
        wrap(model, path, inner)


@pytest.mark.parametrize("held", ["no step", "a step that is no number"])
@pytest.mark.parametrize("path", PATHS)
def test_a_held_state_that_does_not_fit_is_refused_with_the_optimizer_as_given(path, held):
    """The wrapped optimizer already holds a state that cannot be its params': refused when
    wrapped, the optimizer as given -- its group list, groups, params lists and state object
    (the groups once held the FP32 masters, the state keyed by them, where torch's own load
    refused it on the generic path) -- and wrapping it again, fixed, trains."""
    model = make_model()
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = next(model.parameters())
    saved = {"exp_avg": torch.zeros_like(first), "exp_avg_sq": torch.zeros_like(first)}
    if held == "a step that is no number":
        saved["step"] = "abc"
    inner.state[first] = dict(saved)
    given = inner.param_groups, inner.param_groups[0], inner.param_groups[0]["params"]
    state = inner.state
    with pytest.raises(ValueError, match="the state the optimizer given holds"):
        wrap(model, path, inner)
    now = inner.param_groups, inner.param_groups[0], inner.param_groups[0]["params"]
    assert all(map(operator.is_, now, given))
    assert all(map(operator.is_, given[2], model.parameters())) and inner.state is state
    assert list(inner.state) == [first] and inner.state[first] == saved
    inner.state[first]["step"] = torch.tensor(0.0)
    opt = wrap(model, path, inner)
    before = first.detach().clone()
    x, y = batch(0)
    opt.backward(nn.functional.mse_loss(model(x).float(), y))
    opt.step()
    assert not torch.equal(first, before)


PRECISIONS = [("fp32", "fp32"), ("compensated", "int8")]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", ["a held moment", "a weight"])
def test_inf_or_nan_in_a_held_state_or_its_weight_is_refused_by_name_changing_nothing(
    case, precision
):
    """The fast path takes over the state a wrapped optimizer holds, its masters the weights
    as they are: a moment or a weight holding NaN was refused as "the state dict" by the
    core's keys, after the params had moved into flat buffers (an alias of a weight no longer
    saw it). Refused by the param's name, every param where and as it was."""
    model = make_model()
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = next(model.parameters())
    moment = torch.zeros_like(first, dtype=torch.float32)
    inner.state[first] = {"step": torch.tensor(1.0), "exp_avg": moment.clone()}
    inner.state[first]["exp_avg_sq"] = moment
    with torch.no_grad():
        (inner.state[first]["exp_avg"] if case == "a held moment" else first)[0, 0] = torch.nan
    storages = [p.data_ptr() for p in model.parameters()]
    name = re.escape("param_groups[0]['params'][0]")
    with pytest.raises(ValueError, match=f"{name}.*holds inf or NaN"):
        wrap(model, "fast", inner, master=precision[0], moments=precision[1])
    assert [p.data_ptr() for p in model.parameters()] == storages


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", ["add_param_group", "a new group's weight", "amsgrad on"])
def test_a_rebuild_refused_for_a_weight_holding_nan_changes_nothing(case, precision):
    """add_param_group and a group's new structure rebuild the fast path's state from the
    weights as they are. A weight holding NaN was refused as "the state dict" by the core's
    keys, and add_param_group then left an optimizer that could not step, a new structure a
    NaN master. Refused by the param's name (a new group's too); with the weight written
    back, the run goes on bitwise as if never asked."""

    def fresh() -> tuple[nn.Module, FP16_Optimizer]:
        model = make_model()
        return model, wrap(model, "fast", master=precision[0], moments=precision[1])

    def train(model: nn.Module, opt: FP16_Optimizer, steps: range) -> None:
        for i in steps:
            opt.zero_grad()
            opt.backward(loss_of(model, i))
            opt.step()

    model, opt = fresh()
    train(model, opt, range(2))
    first = next(model.parameters())
    weight, added = first.detach().clone(), torch.zeros(3, dtype=torch.half, requires_grad=True)
    with torch.no_grad():
        (added if case == "a new group's weight" else first)[0] = torch.nan
    name = "param_groups[1]['params'][0]" if case == "a new group's weight" else "[0]['params'][0]"
    with pytest.raises(ValueError, match=f"{re.escape(name)} holds inf or NaN"):
        if case == "amsgrad on":
            opt.param_groups[0]["amsgrad"] = True
            train(model, opt, range(2, 3))
        else:
            opt.add_param_group({"params": [added]})
    assert len(opt.param_groups) == 1
    opt.param_groups[0]["amsgrad"] = False
    with torch.no_grad():
        first.copy_(weight)
    train(model, opt, range(2, 4))
    untried, untried_opt = fresh()
    train(untried, untried_opt, range(4))
    assert all(map(torch.equal, model.parameters(), untried.parameters()))


@pytest.mark.parametrize("path", PATHS)
def test_a_group_changed_behind_the_optimizers_back_is_refused_before_a_step(path):
    """A group appended to param_groups by hand (torch.optim steps it; here the fast path
    never did, the generic one stepped its FP16 params without masters, by grads still
    scaled), or a param removed from a group: the step names it, nothing stepped; after
    add_param_group the new group trains."""
    model = make_model()
    opt = wrap(model, path)
    extra = nn.Parameter(torch.ones(3, dtype=torch.float16))
    opt.param_groups.append({**opt.param_groups[0], "params": [extra]})
    x, y = batch(0)
    loss = nn.functional.mse_loss(model(x).float(), y) + extra.float().sum()
    opt.backward(loss)
    before = [p.detach().clone() for p in (*model.parameters(), extra)]
    with pytest.raises(ValueError, match=r"held \[4\] params, they now hold \[4, 1\]"):
        opt.step()
    assert all(map(torch.equal, before, (*model.parameters(), extra)))
    opt.param_groups.pop()
    opt.add_param_group({"params": [extra]})
    opt.step()
    assert not torch.equal(extra, before[-1])
    removed = opt.param_groups[0]["params"].pop()
    with pytest.raises(ValueError, match=r"now hold \[3, 1\]"):
        opt.step()
    opt.param_groups[0]["params"].append(removed)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("change", ["groups reordered", "params swapped", "param replaced"])
def test_a_group_reordered_or_a_param_swapped_behind_its_back_is_refused_before_a_step(
    path, change
):
    """The groups keep their sizes, so only the tensors in their places tell: the fast path
    reads each group's numbers by its place, and stepped a reordered group's params with
    the other group's lr (a replaced param: the old one stepped, the new one left). The step
    names the place, nothing stepped; put back, the optimizer steps as if nothing happened."""
    model = make_model()
    first, second = list(model[0].parameters()), list(model[2].parameters())
    inner = torch.optim.SGD([{"params": first, "lr": 0.0}, {"params": second, "lr": 0.5}])
    opt = wrap(model, path, inner)
    groups = opt.param_groups
    kept = [list(group["params"]) for group in groups]
    if change == "groups reordered":
        groups.reverse()
        place = r"param_groups\[0\]\['params'\]\[0\]"
    elif change == "params swapped":
        groups[0]["params"], groups[1]["params"] = groups[1]["params"], groups[0]["params"]
        place = r"param_groups\[0\]\['params'\]\[0\]"
    else:
        groups[1]["params"][1] = torch.zeros_like(groups[1]["params"][1])
        place = r"param_groups\[1\]\['params'\]\[1\]"
    opt.backward(loss_of(model, 0))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=place + " holds another tensor than the one it put"):
        opt.step()
    assert all(map(torch.equal, before, model.parameters()))
    if change == "groups reordered":
        groups.reverse()
    for group, params in zip(groups, kept):
        group["params"] = params
    opt.step()
    assert all(map(torch.equal, before[:2], model[0].parameters()))  # lr 0: unmoved
    assert not any(map(torch.equal, before[2:], model[2].parameters()))


def test_an_in_place_step_given_the_params_as_grads_is_refused_before_compiling():
    params = {"w": torch.randn(4).half()}
    state = fp16fx.init(params, fp16fx.sgd(0.1), fp16fx.StaticLossScale(1.0), buckets=True)
    step = fp16fx.compile_step(inplace=True)
    with pytest.raises(ValueError, match=r"grads\['w'\] shares a storage with the state"):
        step(state, state.params)
    state, info = fp16fx.step(state, state.params)  # pure: nothing is overwritten, allowed
    assert bool(info.finite)


def test_a_refused_in_place_step_has_not_copied_a_written_fp32_param_into_its_master():
    # An FP32 param that is not one flat tensor (transposed) is gathered into its master
    # before the core runs: the refusal of aliased grads came after that copy.
    params = {"f": torch.randn(3, 2).t(), "w": torch.randn(3).half()}
    state = fp16fx.init(params, fp16fx.sgd(0.1))
    with torch.no_grad():
        params["f"].fill_(7.0)  # written since the last step
    before = state.master["f"].clone()
    step = StepFunction(inplace=True, compile_options=None)
    with pytest.raises(ValueError, match=r"grads\['w'\] shares a storage with the state"):
        step(state, {"f": torch.ones(2, 3), "w": state.params["w"]})
    assert torch.equal(state.master["f"], before)


def test_an_in_place_step_over_a_bucket_of_empty_params_is_no_alias():
    # Every empty storage has address 0: the check took the empty grad for the empty param.
    def params():
        return {"w": torch.linspace(-1, 1, 8).half(), "e": torch.empty(0)}

    grads = {"w": torch.linspace(0, 1, 8).half(), "e": torch.empty(0)}
    pure, _ = fp16fx.step(fp16fx.init(params(), fp16fx.sgd(0.1)), grads)
    in_place = StepFunction(inplace=True, compile_options=None)
    state, info = in_place(fp16fx.init(params(), fp16fx.sgd(0.1)), grads)
    assert bool(info.finite) and torch.equal(state.params["w"], pure.params["w"])


def test_pickling_a_functional_state_says_to_use_state_dict():
    state = fp16fx.init({"w": torch.ones(2)}, fp16fx.adam())
    with pytest.raises(TypeError, match=re.escape("fp16fx.state_dict(state)")):
        pickle.dumps(state)


def test_misused_arguments_get_errors_that_name_them():
    """Each of these once failed deep inside (an AttributeError, or torch's own error about
    a sparse tensor's data pointer) without saying what was wrong."""
    params = {"w": torch.randn(4).half()}
    with pytest.raises(TypeError, match=r"an instance\), got <class"):
        fp16fx.init(params, fp16fx.sgd(0.1), fp16fx.DynamicLossScale)
    state = fp16fx.init(params, fp16fx.sgd(0.1))
    with pytest.raises(TypeError, match=r"scale_loss expects the loss as a tensor, got 1\.0"):
        fp16fx.scale_loss(state, 1.0)
    # An integer beyond any float once raised a bare OverflowError from math.isfinite.
    with pytest.raises(ValueError, match="'lr' must be >= 0, got a number too large for a"):
        fp16fx.set_hyperparams(state, lr=10**400)
    with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
        wrap(make_model(), "fast").clip_master_grads(10**400)
    with pytest.raises(ValueError, match="init_scale"):
        fp16fx.DynamicLossScale(init_scale=10**400)
    sparse = torch.ones(4).half().to_sparse()
    with pytest.raises(TypeError, match=r"grads\['w'\] is a torch.sparse_coo tensor"):
        fp16fx.step(state, {"w": sparse})
    model = make_model()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), compiled=False)
    for loss in (1.0, model(batch(0)[0]).float()):  # a number, a (8, 2) tensor
        with pytest.raises(TypeError, match="backward expects the loss as a one-element tensor"):
            opt.backward(loss)


def test_a_functional_call_given_something_other_than_a_state_names_what_it_got():
    """The params in place of the state, or step's arguments swapped, once raised an
    AttributeError from deep inside ('dict' object has no attribute 'layout')."""
    params = {"w": torch.randn(4).half()}
    state = fp16fx.init(params, fp16fx.sgd(0.1))
    calls = {
        "step": lambda: fp16fx.step(params, state),
        "state_dict": lambda: fp16fx.state_dict(params),
        "load_state_dict": lambda: fp16fx.load_state_dict(params, fp16fx.state_dict(state)),
        "scale_loss": lambda: fp16fx.scale_loss(params, torch.tensor(1.0)),
        "grad_buffers": lambda: fp16fx.grad_buffers(params),
        "get_hyperparams": lambda: fp16fx.get_hyperparams(params),
        "set_hyperparams": lambda: fp16fx.set_hyperparams(params, lr=1.0),
    }
    for name, call in calls.items():
        with pytest.raises(
            TypeError, match=f"^{name} expects the state fp16fx.init returns, got a dict"
        ):
            call()


@pytest.mark.parametrize("path", PATHS)
def test_an_empty_param_group_is_accepted_as_torch_accepts_it(path):
    """A "no decay" group left empty once raised an IndexError while choosing the device."""
    model = make_model()
    inner = torch.optim.AdamW(
        [{"params": [], "weight_decay": 0.0}, {"params": list(model.parameters())}], lr=1e-2
    )
    opt = wrap(model, path, inner)
    before = [p.detach().clone() for p in model.parameters()]
    opt.backward(loss_of(model, 0))
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert [len(g["params"]) for g in opt.param_groups] == [0, 4]


@pytest.mark.parametrize(
    ("lr", "message"),
    [
        (None, r"param group 0: hyperparameter 'lr' must be a number, got None"),
        ("0.1", r"param group 0: hyperparameter 'lr' must be a number, got '0.1'"),
        (torch.tensor([0.1, 0.2]), r"param group 0: hyperparameter 'lr' must be a scalar"),
    ],
)
def test_a_param_groups_lr_that_is_no_number_is_named_and_changes_nothing(lr, message):
    """None and a 2-element tensor once failed in float() without naming the group or lr; a
    string was read as a number (and would break any LR scheduler)."""
    model = make_model()
    opt = wrap(model, "fast")
    opt.param_groups[0]["lr"] = lr
    opt.backward(loss_of(model, 0))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises((TypeError, ValueError), match=message):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.param_groups[0]["lr"] = 1e-2
    opt.step()  # the grads are still there: a number goes on
    assert not any(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("path", PATHS)
def test_a_model_made_in_inference_mode_or_on_meta_is_refused_by_name(path):
    """Once torch's "Inference tensors do not track version counter" while flattening the
    params (fast path); a meta model was built and trained nothing."""
    with torch.inference_mode():
        frozen_in_inference = nn.Linear(3, 2).half()
    with torch.device("meta"):
        on_meta = nn.Linear(3, 2).half()
    for model, message in (
        (frozen_in_inference, r"\['params'\]\[0\] was made under torch.inference_mode"),
        (on_meta, r"\['params'\]\[0\] is on the meta device"),
    ):
        with pytest.raises(ValueError, match=message):
            wrap(model, path, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("group", [True, 0, object()])
def test_a_process_group_that_is_no_group_is_refused_when_built_moving_nothing(group):
    """``process_group=True`` (as ``shard=True`` reads) built an optimizer whose first
    step failed on every rank in torch's words ("Process group True is not initialized")."""
    model = make_model()
    weight = model[0].weight
    with pytest.raises(TypeError, match=r"process_group must be 'auto', None or a torch"):
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), process_group=group)
    with pytest.raises(TypeError, match=r"process_group must be 'auto', None or a torch"):
        fp16fx.distributed.init(
            dict(model.named_parameters()), fp16fx.sgd(0.1), process_group=group
        )
    assert model[0].weight is weight and weight.data_ptr() == model[0].weight.data_ptr()


@pytest.mark.parametrize("init", [fp16fx.init, fdist.init])
def test_a_switch_that_is_no_bool_is_refused_by_name_moving_nothing(init):
    """``shard="no"`` once sharded the state, by the string's truthiness (``buckets`` alike)."""
    params = {"w": torch.ones(3, dtype=torch.float16), "b": torch.zeros(2, dtype=torch.float16)}
    where = {k: v.data_ptr() for k, v in params.items()}
    switches = [{"buckets": "no"}]
    if init is fdist.init:  # sharded, the state is always bucketed: "no" is a mistake still
        switches += [{"shard": "no"}, {"shard": True, "buckets": "no"}]
    for switch in switches:
        name = "shard" if switch.get("shard") == "no" else "buckets"
        with pytest.raises(TypeError, match=f"^{name} must be True or False, got 'no'$"):
            init(params, fp16fx.sgd(0.1), **switch)
    assert {k: v.data_ptr() for k, v in params.items()} == where  # not moved into a buffer


@pytest.mark.parametrize("shard", ["yes", 0, 1])
def test_a_shard_that_is_no_group_is_refused_by_name_moving_nothing(shard):
    """It was taken for a process group, which torch then failed to read ('str' object has
    no attribute 'size')."""
    model = make_model()
    weight = model[0].weight
    with pytest.raises(TypeError, match=r"shard must be True \(the world group\), False, None"):
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), shard=shard)
    assert model[0].weight is weight and weight.data_ptr() == model[0].weight.data_ptr()


@pytest.mark.parametrize("path", PATHS)
def test_clip_master_grads_names_a_norm_type_that_is_no_number(path):
    """None and "fro" once failed in float() with torch's words; the optimizer stays usable
    and "inf" is taken, as torch's clip_grad_norm_ takes it."""
    model = make_model()
    opt = wrap(model, path)
    opt.backward(loss_of(model, 0))
    for bad in (None, "fro", True):
        with pytest.raises(ValueError, match=r"norm_type must be a number \(2, 1, inf...\)"):
            opt.clip_master_grads(1.0, norm_type=bad)
    assert opt.path == path  # nothing handed over
    norms = [opt.clip_master_grads(1e3, norm_type=kind) for kind in (2, "inf")]
    assert 0 < norms[1] <= norms[0]


def test_compile_step_checks_its_options_when_called_not_at_the_first_step():
    """A bad mode, backend or dynamic once passed compile_step and failed inside torch.compile
    at the first step (dynamic="yes": an AssertionError); cuda_graph=True silently replaced
    the mode given beside it."""
    for options, message in (
        ({"dynamic": "yes"}, "dynamic must be None, True or False, got 'yes'"),
        ({"mode": "fast"}, "unknown mode 'fast'; torch.compile knows"),
        ({"backend": "nope"}, "unknown backend 'nope'"),
        ({"cuda_graph": True, "inplace": True, "mode": "max-autotune"}, "is mode='reduce-ov"),
    ):
        with pytest.raises((TypeError, ValueError), match=message):
            fp16fx.compile_step(**options)
    fp16fx.compile_step(mode="max-autotune-no-cudagraphs", backend="eager", dynamic=None)


@pytest.mark.parametrize("path", PATHS)
def test_a_checkpoint_of_another_optimizer_class_is_refused_at_load_not_at_the_next_step(path):
    """An SGD dict without momentum (no per-param state to tell) loaded into Adam: torch
    keeps the saved groups whole, and the next step failed with a bare KeyError: 'betas'."""
    sgd_model, adam_model = make_model(0), make_model(1)
    sgd = wrap(sgd_model, path, torch.optim.SGD(sgd_model.parameters(), lr=0.1))
    adam = wrap(adam_model, path)
    before = [p.detach().clone() for p in adam_model.parameters()]
    with pytest.raises(ValueError, match=r"\['param_groups'\]\[0\] lacks \['betas', 'eps'\]"):
        adam.load_state_dict(sgd.state_dict())
    with pytest.raises(
        ValueError, match=r"\['param_groups'\]\[0\] lacks \['dampening', 'momentum'\]"
    ):
        sgd.load_state_dict(adam.state_dict())
    assert "betas" in adam.param_groups[0] and "betas" not in sgd.param_groups[0]
    # A group saved before torch had amsgrad / nesterov loads: torch fills those in.
    for opt, newer in ((adam, "amsgrad"), (sgd, "nesterov")):
        older = opt.state_dict()
        del older["optimizer_state_dict"]["param_groups"][0][newer]
        opt.load_state_dict(older)
        assert opt.param_groups[0][newer] is False
    adam.backward(loss_of(adam_model, 0))
    adam.step()  # unchanged, and usable
    assert not any(torch.equal(a, p) for a, p in zip(before, adam_model.parameters()))


def test_a_checkpoint_of_another_class_is_refused_on_the_generic_path_for_any_class():
    """Classes only the generic path steps: an Adagrad dict loaded into RMSprop once loaded
    whole, and every step after it failed with a bare KeyError: 'square_avg' (or 'alpha')."""
    trained, fresh = make_model(0), make_model(1)
    adagrad = wrap(trained, "generic", torch.optim.Adagrad(trained.parameters(), lr=0.1))
    for i in range(2):
        adagrad.zero_grad()
        adagrad.backward(loss_of(trained, i))
        adagrad.step()
    rmsprop = wrap(fresh, "generic", torch.optim.RMSprop(fresh.parameters(), lr=1e-2))
    rmsprop.backward(loss_of(fresh, 0))
    rmsprop.step()
    before = copy.deepcopy((rmsprop.state_dict(), [p.detach().clone() for p in fresh.parameters()]))
    with pytest.raises(ValueError, match=r"\['param_groups'\]\[0\] lacks \['alpha'\] and has "
                       r"\[.*'lr_decay'\]: it was saved from another optimizer than "
                       r"torch.optim.RMSprop"):  # fmt: skip
        rmsprop.load_state_dict(adagrad.state_dict())
    after = (rmsprop.state_dict(), [p.detach().clone() for p in fresh.parameters()])
    assert optree.tree_all(optree.tree_map(_same, before, after))
    rmsprop.zero_grad()
    rmsprop.backward(loss_of(fresh, 1))
    rmsprop.step()  # unchanged, and usable
    assert "square_avg" in rmsprop.optimizer.state[rmsprop.optimizer.param_groups[0]["params"][0]]
    # Its own dicts load, twice (torch's load adds 'differentiable' to LBFGS's defaults, not
    # its groups), and so does one of an older LBFGS without 'maximize' (read as False).
    model = make_model(2)
    lbfgs = wrap(model, "generic", torch.optim.LBFGS(model.parameters(), lr=0.1))
    closure = lambda: (lbfgs.zero_grad(), lbfgs.backward(loss := loss_of(model, 0)), loss)[-1]  # noqa: E731
    lbfgs.step(closure)
    own = lbfgs.state_dict()
    lbfgs.load_state_dict(own)
    lbfgs.load_state_dict(own)
    del own["optimizer_state_dict"]["param_groups"][0]["maximize"]
    lbfgs.load_state_dict(own)
    lbfgs.step(closure)
    # Keys of schedulers on either side alone (saved under OneCycleLR, resumed under SWALR).
    lbfgs.param_groups[0]["swa_lr"] = 0.05
    own = lbfgs.state_dict()
    del own["optimizer_state_dict"]["param_groups"][0]["swa_lr"]
    own["optimizer_state_dict"]["param_groups"][0].update(max_lr=0.1, min_lr=1e-4)
    lbfgs.load_state_dict(own)
    lbfgs.step(closure)
    # Both: an older LBFGS's dict saved under a scheduler (lacking 'maximize', with
    # 'initial_lr') was once refused as another class's, by an LBFGS whose group has it.
    group = own["optimizer_state_dict"]["param_groups"][0]
    group.pop("maximize", None)
    group["initial_lr"] = 0.1
    newer = make_model(3)
    wrap(newer, "generic", torch.optim.LBFGS(newer.parameters(), lr=0.1)).load_state_dict(own)


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("path", PATHS)
def test_a_closure_that_raises_leaves_the_next_step_starting_afresh(path):
    """On the generic path apex's first-closure-call flag stayed False after a closure
    raised, and the next step's first call then refreshed the params as if it were a
    re-run."""
    model = make_model()
    opt = wrap(model, path)

    def broken():
        raise RuntimeError("the data loader died")

    with pytest.raises(RuntimeError, match="data loader died"):
        opt.step(broken)
    assert opt.first_closure_call_this_step
    assert opt.state_dict()["first_closure_call_this_step"] is True


def test_consolidation_and_grad_averaging_name_inputs_of_another_kind():
    """None and [] once raised TypeError: 'NoneType' object is not iterable, and a message
    naming the functional format; a list of numbers an AttributeError."""
    from fp16fx.distributed import average_grads
    from fp16fx.facade import consolidate_state_dict

    for shards in (None, [], [{}], {"format": "fp16fx.FP16_Optimizer.sharded/2"}):
        with pytest.raises(ValueError, match=r"the list of every rank's 'fp16fx.FP16_Optimizer"):
            consolidate_state_dict(shards)
    with pytest.raises(TypeError, match="a pytree of tensors, got a leaf 1"):
        average_grads([1, 2])


def test_persistent_bytes_names_an_input_that_is_no_state():
    """An FP16_Optimizer, or grads holding a number, once raised AttributeError: ... has no
    attribute 'untyped_storage'."""
    from fp16fx.distributed import persistent_bytes

    params = [torch.zeros(4, dtype=torch.half, requires_grad=True)]
    with pytest.raises(TypeError, match="got FP16_Optimizer"):
        persistent_bytes(FP16_Optimizer(torch.optim.SGD(params, lr=0.1)))
    state = fp16fx.init([torch.zeros(4, dtype=torch.half)], fp16fx.sgd(0.1))
    with pytest.raises(TypeError, match="grads must be a tree of tensors, got a leaf 1"):
        persistent_bytes(state, [1])
    grads = [torch.zeros(4, dtype=torch.half)]
    assert persistent_bytes(state, grads) == persistent_bytes(state) + grads[0].nbytes


def test_zero_grad_zeroes_a_grad_whose_data_was_replaced():
    """``p.grad.data = x`` gives the grad view itself other storage: zero_grad once zeroed
    the flat buffers only, and that grad then summed every later backward."""
    lin = nn.Linear(4, 1, bias=False).half()
    opt = FP16_Optimizer(torch.optim.SGD(lin.parameters(), lr=1.0), compiled=False)
    x = torch.ones(1, 4).half()
    master = opt.param_groups[0]["params"][0]
    moves = []
    for i in range(4):
        opt.zero_grad()
        opt.backward(lin(x).float().sum())
        if i == 1:
            lin.weight.grad.data = lin.weight.grad.data * 2
        before = master.detach().clone()
        opt.step()
        moves.append((before - master).mean().item())
    assert moves == pytest.approx([1.0, 2.0, 1.0, 1.0])


def test_params_in_shared_memory_take_the_generic_path_and_stay_shared():
    """Hogwild: a child process's optimizer over a shared model must train the shared
    storage. The fast path moved the params into a buffer of its own."""
    model = nn.Linear(4, 2).half()
    model.share_memory()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), compiled=False)
    assert opt.path == "generic" and all(p.is_shared() for p in model.parameters())
    with pytest.raises(ValueError, match=r"in shared memory .* Hogwild"):
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), path="fast")
    # Nor does a fast optimizer move them when a group of them is added: it hands over.
    model_b = nn.Linear(4, 2).half()
    opt = FP16_Optimizer(torch.optim.SGD(model_b.parameters(), lr=0.1), compiled=False)
    opt.add_param_group({"params": list(model.parameters())})
    assert opt.path == "generic" and all(p.is_shared() for p in model.parameters())


def test_a_model_shared_after_the_build_keeps_training():
    """share_memory() moves each storage whole, the flat buffer and its views with it: every
    step after it was refused as if a param had left its buffer."""
    torch.manual_seed(0)
    models = [nn.Linear(4, 2).half() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    x = torch.randn(3, 4).half()
    opts = [FP16_Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), compiled=False) for m in models]
    for step in range(3):
        for model, opt in zip(models, opts):
            if step == 1 and model is models[1]:
                model.share_memory()
            opt.zero_grad()
            opt.backward(model(x).float().pow(2).sum())
            opt.step()
    assert opts[1].path == "fast" and all(p.is_shared() for p in models[1].parameters())
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))


@pytest.mark.parametrize("bad", [-1.0, float("nan"), 1e39])
def test_a_param_groups_lr_the_step_cannot_hold_is_refused_by_that_step(bad):
    model = nn.Linear(4, 2).half()
    opt = FP16_Optimizer(torch.optim.Adam(model.parameters()), verbose=False, compiled=False)

    def step():
        opt.zero_grad()
        opt.backward(model(torch.ones(3, 4).half()).float().sum())
        opt.step()

    step()
    opt.param_groups[0]["lr"] = bad  # 1e39: inf in FP32, which stepped the weights to inf
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="param group 0: hyperparameter 'lr'"):
        step()
    assert all(map(torch.equal, before, model.parameters()))
    opt.param_groups[0]["lr"] = 1e-3
    step()
    assert all(p.isfinite().all() for p in model.parameters())
