"""FP16_Optimizer in compact precision (``master=``, ``moments=``): the same training as the
functional state it runs on, checkpoints in apex's format that resume bitwise and load across
precisions, and clear refusals where compact precision cannot go."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp16fx.fp16_utils import FP16_Optimizer
from fp16fx.precision import Precision, decode_master
from fp16fx.train import command
from tests.test_facade_checkpoint import (
    APEX_SCALERS,
    apex_state_dict,
    assert_same_fingerprint,
    fingerprint,
    load_apex,
    save_and_load,
)
from tests.test_facade_checkpoint import INNER as APEX_INNER
from tests.test_facade_checkpoint import make_model as apex_model
from tests.test_facade_checkpoint import run as apex_run
from tests.test_precision import differing, stored, ulp32, unit

#: Every compact mode the facade offers (FP32 masters and moments is the default).
COMPACT = [
    ("compensated", "fp32"),
    ("compensated", "bf16"),
    ("compensated", "int8"),
    ("fp32", "int8"),
]
_DATA = torch.Generator().manual_seed(0)  # the same data however the tests are collected
X = torch.randn(64, 20, generator=_DATA).half()
Y = torch.randint(0, 5, (64,), generator=_DATA)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 5)).half()


def wrap(model: nn.Module, master: str, moments: str, **kwargs) -> FP16_Optimizer:
    inner = kwargs.pop("inner", lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    kwargs.setdefault("compiled", False)
    return FP16_Optimizer(
        inner(model.parameters()),
        dynamic_loss_scale=True,
        verbose=False,
        master=master,
        moments=moments,
        **kwargs,
    )


def train(model: nn.Module, opt: FP16_Optimizer, steps: int) -> float:
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(X).float(), Y)
        opt.backward(loss)
        opt.step()
    return loss.item()


@pytest.mark.parametrize(("master", "moments"), COMPACT)
def test_a_later_checkpoint_holds_the_masters_of_then(master, moments):
    """The decoded masters were cached at the first read: every later state_dict() held
    them, and loading one moved the weights back to that first step."""
    model = make_model()
    opt = wrap(model, master, moments)
    train(model, opt, 1)
    first = save_and_load(opt.state_dict())
    train(model, opt, 3)
    later = save_and_load(opt.state_dict())
    assert not torch.equal(first["fp32_from_fp16"][0][0], later["fp32_from_fp16"][0][0])
    weights = [p.detach().clone() for p in model.parameters()]
    opt.load_state_dict(later)
    assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters()))


@pytest.mark.parametrize(("master", "moments"), COMPACT)
def test_compact_facade_resumes_bitwise_from_its_apex_format_checkpoint(master, moments):
    model = make_model()
    opt = wrap(model, master, moments)
    start = train(model, opt, 1)
    loss = train(model, opt, 15)
    assert loss < 0.8 * start, "it did not train"
    sd = save_and_load(opt.state_dict())
    # apex's keys: FP32 masters (decoded) for every FP16 param, torch-format moments in FP32.
    assert [len(g) for g in sd["fp32_from_fp16"]] == [4]
    assert all(m.dtype == torch.float32 for m in sd["fp32_from_fp16"][0])
    moments_saved = sd["optimizer_state_dict"]["state"][0]
    assert moments_saved["exp_avg"].dtype == torch.float32

    resumed = make_model()
    resumed.load_state_dict(model.state_dict())
    opt2 = wrap(resumed, master, moments)
    opt2.load_state_dict(sd)
    train(model, opt, 3)
    train(resumed, opt2, 3)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("moments", ["fp32", "int8"])
def test_a_compensated_optimizer_resumes_a_run_whose_momentum_was_switched_on(moments):
    """The param groups hold the model's params, so the load wrote the saved numbers into
    them last, after the engine had rebuilt its step from the old ones (momentum 0): the
    momentum buffers were dropped, and the next step raised a KeyError for 'momentum'."""

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.0)

    model = make_model()
    opt = wrap(model, "compensated", moments, inner=sgd)
    train(model, opt, 1)
    opt.param_groups[0]["momentum"] = 0.9
    train(model, opt, 2)
    sd = save_and_load(opt.state_dict())
    resumed = make_model()
    resumed.load_state_dict(model.state_dict())
    opt2 = wrap(resumed, "compensated", moments, inner=sgd)  # built as the run was
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["momentum"] == 0.9
    assert all(
        "momentum_buffer" in s for s in opt2.state_dict()["optimizer_state_dict"]["state"].values()
    )
    train(model, opt, 2)
    train(resumed, opt2, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))


def train_with_missing_grads(model: nn.Module, opt: FP16_Optimizer, missing: list) -> None:
    """Trains ``model`` one step per entry of ``missing``: the indices of the params that get
    no gradient in that step."""
    params = list(model.parameters())
    for without in missing:
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(model(X).float(), Y))
        for k in without:
            params[k].grad = None
        opt.step()


@pytest.mark.parametrize(
    ("inner", "missing"),
    [
        # torch's SGD keeps no step count: the counts that cut the state are lost.
        ("sgd", [(3,), (), (), (3,), (), ()]),
        # Adam's counts, cut by these misses, are equal again: they cannot place the cut.
        ("adam", [(3,), (0, 1, 2), (), ()]),
    ],
)
@pytest.mark.parametrize("master", ["compensated", "fp32"])
def test_a_compact_optimizer_resumes_bitwise_after_params_missed_gradients(master, inner, missing):
    """A param without a gradient gets a segment of its own, where int8 moments' blocks
    restart; the dict's ``param_segments`` restores the segments (before, the resumed
    moments were re-blocked, and training left the original's bits)."""
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    }[inner]
    model = make_model()
    opt = wrap(model, master, "int8", inner=make)
    train_with_missing_grads(model, opt, missing)
    sd = save_and_load(opt.state_dict())
    assert sd["param_segments"].tolist() == [0, 0, 0, 1]

    resumed = make_model()
    resumed.load_state_dict(model.state_dict())
    opt2 = wrap(resumed, master, "int8", inner=make)
    opt2.load_state_dict(sd)
    train_with_missing_grads(model, opt, [(3,), (), ()])
    train_with_missing_grads(resumed, opt2, [(3,), (), ()])
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("param_segments", torch.tensor([0, 0, 1]), r"param_segments must be .* of shape \(4,\)"),
        ("param_segments", torch.tensor([0, 0, 0, -1]), "param_segments must be a non-negative"),
        ("param_segments", torch.zeros(4), "param_segments must be a non-negative integer"),
        ("applied_steps", torch.tensor([3]), r"applied_steps must be .* of shape \(\)"),
        ("param_segments", torch.zeros(4, dtype=torch.int64, device="meta"), "param_segments"),
        ("applied_steps", torch.tensor(3, device="meta"), "applied_steps must be a non-negative"),
    ],
)
def test_malformed_compact_entries_are_refused_and_change_nothing(key, value, message):
    model = make_model()
    opt = wrap(model, "compensated", "int8")
    train(model, opt, 2)
    sd = {**save_and_load(opt.state_dict()), key: value}
    before = fingerprint(model, opt)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(sd)
    assert_same_fingerprint(before, fingerprint(model, opt))


def test_compensated_param_groups_hold_the_model_params_and_state_shows_fp32():
    model = make_model()
    opt = wrap(model, "compensated", "int8")
    assert opt.param_groups[0]["params"] == list(model.parameters())
    train(model, opt, 2)
    state = opt.state[model[0].weight]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["exp_avg"].dtype == torch.float32 and (state["exp_avg_sq"] >= 0).all()


def test_int8_moments_pad_the_flat_buffers_to_whole_blocks():
    """With int8 moments the facade pads its flat buffers to whole blocks (785 params: 1,024
    values), so the core state over them is whole blocks, each block's scale a broadcast
    (``fp16fx.precision``), and it steps the model's grads where autograd wrote them."""
    model = make_model()
    opt = wrap(model, "compensated", "int8")
    first = train(model, opt, 1)
    last = train(model, opt, 5)
    state = opt._engine.state
    (bucket,) = state.layout.buckets
    assert (bucket.numel, bucket.padded) == (785, 1024)
    assert state.master_segments[0].numel() == 1024  # the corrections cover the padding
    assert model[0].weight.grad.untyped_storage().nbytes() == 1024 * 2
    assert last < first


@pytest.mark.parametrize("moments", ["fp32", "int8"])
def test_steps_again_and_clips_through_checks_with_int8_moments_as_with_fp32_ones(moments):
    """Each check zeroes the padding of the int8 blocks' grad buffers; counted as a write to
    the gradients, it made a clip lost at a later check, and a repeated step unscale the
    stepped grads by the grown scale."""
    torch.manual_seed(0)
    model, x, y = nn.Linear(6, 3).half(), torch.randn(8, 6).half(), torch.randn(8, 3)
    opt = FP16_Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 64.0, "scale_window": 1},  # grows every step
        compiled=False,
        moments=moments,
    )
    opt.backward(((model(x).float() - y) ** 2).mean())
    assert opt.clip_master_grads(1e-3) > 0.1
    moves = []
    for _ in range(2):
        assert opt.inspect_master_grad_data() is not None  # a check, and the int8 padding
        masters = [m for group in opt.param_groups for m in group["params"]]  # FP32
        before = [m.detach().clone() for m in masters]
        opt.step()
        step = torch.cat([(m.detach() - b).flatten() for m, b in zip(masters, before, strict=True)])
        moves.append(float(torch.linalg.vector_norm(step)))
    assert moves[0] == pytest.approx(0.05 * 1e-3, rel=1e-3)  # clipped
    assert moves[1] / moves[0] == pytest.approx(1.9, rel=1e-2)  # momentum (int8: rounded)


def test_compiled_compact_facade_keeps_the_numbers_of_the_eager_one():
    """After five AdamW steps the compiled facade holds the eager one's compact state: every
    int8 code, block scale and count bitwise, the masters (param plus correction) a few units
    apart in under 1% of the values. Inductor's square root is correctly rounded and eager's
    on x86 is not (test_precision.py compares the functional step alike): a correction
    differs by a unit where the two round apart, and a unit or so more a step. No FP16 param
    moves in these five steps for it, so the forward passes, grads and moments stay the same;
    a torch whose rounding moved one would need the moments compared to within a code."""
    states = {}
    for compiled in (False, True):
        model = make_model()
        opt = wrap(model, "compensated", "int8", compiled=compiled)
        train(model, opt, 5)
        assert opt._engine.state.precision == Precision("compensated", "int8")
        states[compiled] = stored(opt._engine.state)
    eager, compiled = states[False], states[True]
    masters = [k.removesuffix(".param") for k in eager if k.endswith(".param")]
    rest = [k for k in eager if not k.endswith((".param", ".correction"))]
    assert len(rest) > 20 and differing(*({k: s[k] for k in rest} for s in states.values())) == []
    for key in masters:
        mine, theirs = (
            decode_master(s[f"{key}.param"], s[f"{key}.correction"]) for s in (compiled, eager)
        )
        torch.testing.assert_close(mine, theirs, rtol=2.0**-16, atol=0.0)
        assert (mine != theirs).float().mean().item() <= 0.01, key


@pytest.mark.parametrize(("master", "moments"), [("fp32", "fp32"), ("compensated", "int8")])
def test_a_checkpoint_loads_across_precisions(master, moments):
    """A full-precision checkpoint loads into a compact optimizer and the reverse: the masters
    are the saved ones (rounded into the target's format), training continues."""
    model = make_model()
    opt = wrap(model, master, moments)
    train(model, opt, 5)
    sd = save_and_load(opt.state_dict())
    other = ("compensated", "int8") if master == "fp32" else ("fp32", "fp32")
    target = make_model()
    target.load_state_dict(model.state_dict())
    opt2 = wrap(target, *other)
    opt2.load_state_dict(sd)
    masters = opt2.state_dict()["fp32_from_fp16"][0]
    saved = sd["fp32_from_fp16"][0]
    if master == "fp32":  # rounded into (param, correction)
        assert_within_half_a_unit(masters, saved, list(target.parameters()))
    else:  # decoded exactly into FP32
        assert all(torch.equal(mine, theirs) for mine, theirs in zip(masters, saved, strict=True))
    before = train(target, opt2, 1)
    assert train(target, opt2, 5) < before


def assert_within_half_a_unit(masters, saved, params):
    """Each compensated master (decoded) is its saved FP32 value rounded to nearest into
    (param, correction): within half a correction unit of its param, plus FP32's rounding
    of the decoded sum (docs/precision.md)."""
    for mine, theirs, p in zip(masters, saved, params, strict=True):
        err = (mine.double() - theirs.double()).abs()
        assert (err <= 0.5 * unit(p.detach()) + ulp32(theirs)).all()


def test_an_apex_checkpoint_loads_into_a_compact_optimizer(tmp_path):
    """apex's FP16_Optimizer(SGD(momentum)) dict with its legacy DynamicLossScaler loads into a
    compensated + int8 optimizer: the masters to within the correction's resolution, the
    momentum to within an int8 code, the scaler's scale and schedule as they were."""
    loss_scaler, scales = APEX_SCALERS["legacy dynamic"]
    apex_sd = apex_state_dict(apex_model(seed=4), loss_scaler)
    model = apex_model()
    opt = FP16_Optimizer(
        APEX_INNER["sgd"](model.parameters()),
        dynamic_loss_scale=True,
        compiled=False,
        master="compensated",
        moments="int8",
    )
    opt.load_state_dict(load_apex(tmp_path, apex_sd))
    assert opt.dynamic_loss_scale and opt.loss_scale == scales[0]
    (masters,) = apex_sd["fp32_from_fp16"]
    loaded = opt.state_dict()
    fp16 = [p for p in model.parameters() if p.dtype != torch.float32]
    assert_within_half_a_unit(loaded["fp32_from_fp16"][0], masters, fp16)
    saved = apex_sd["optimizer_state_dict"]["state"]
    got = loaded["optimizer_state_dict"]["state"]
    largest = max(s["momentum_buffer"].abs().max() for s in saved.values())
    for i in saved:
        # Square-root companding: within 2 d sqrt(|x| s) + d**2 s <= 0.016 s, d = 1/127.
        mine, theirs = got[i]["momentum_buffer"], saved[i]["momentum_buffer"]
        assert torch.allclose(mine, theirs, rtol=0, atol=0.016 * float(largest))
    assert [t[1] for t in apex_run(model, opt, range(4))] == scales


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"path": "generic"}, "fast path only"),
        ({"inner": lambda ps: torch.optim.RMSprop(ps)}, "needs the fast path"),
        ({"moments": "int4"}, "moments must be one of"),
        ({"master": "fp64"}, "master must be one of"),
        # found by the core's init, once after the params had moved into flat buffers
        ({"model": torch.float32}, "these params are all FP32"),
    ],
)
def test_compact_precision_refuses_what_it_cannot_run(kwargs, message):
    settings = {"master": "compensated", "moments": "int8", **kwargs}
    model = make_model().to(settings.pop("model", torch.float16))
    params = list(model.parameters())
    values, storages = [p.detach().clone() for p in params], [p.data_ptr() for p in params]
    master, moments = settings.pop("master"), settings.pop("moments")
    make_inner = settings.pop("inner", lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    inners = []

    def inner(ps):
        inners.append(make_inner(ps))
        return inners[-1]

    with pytest.raises(ValueError, match=message):
        wrap(model, master, moments, inner=inner, **settings)
    # Nothing moved into flat buffers, and the inner optimizer still holds the model's params.
    assert all(torch.equal(a, b) for a, b in zip(params, values))
    assert [p.data_ptr() for p in model.parameters()] == storages
    assert all(a is b for a, b in zip(inners[0].param_groups[0]["params"], params, strict=True))


@pytest.mark.parametrize(("master", "moments"), COMPACT)
def test_adding_a_group_that_trains_nothing_leaves_a_compact_run_as_it_was(master, moments):
    """add_param_group rebuilds the state: it once started the count of applied steps, which
    seeds compact precision's dither, from 0 again, so the steps after it replayed the first
    steps' dither on the same elements."""

    def run(add: bool) -> tuple[list[torch.Tensor], int]:
        model = make_model()
        opt = wrap(model, master, moments)
        train(model, opt, 2)
        if add:
            frozen = nn.Linear(2, 2).half().requires_grad_(False)
            opt.add_param_group({"params": list(frozen.parameters())})
        train(model, opt, 3)
        return [p.detach().clone() for p in model.parameters()], int(
            opt.state_dict()["applied_steps"]
        )

    (alone, steps), (added, steps_added) = run(add=False), run(add=True)
    assert steps == steps_added == 5
    assert all(torch.equal(a, b) for a, b in zip(alone, added, strict=True))


def test_a_compact_optimizer_refuses_to_hand_over_to_the_generic_path():
    model = make_model()
    opt = wrap(model, "compensated", "int8")
    train(model, opt, 1)
    opt.zero_grad()
    opt.backward(nn.functional.cross_entropy(model(X).float(), Y))
    with pytest.raises(ValueError, match="generic path"):
        opt.clip_master_grads(1.0, norm_type=1)


def test_fp16fx_train_runs_in_compact_precision(capsys):
    for api in ("facade", "functional"):
        code = command.main(
            [
                "--api", api, "--masters", "compensated", "--moments", "int8",
                "--epochs", "1", "--limit", "64", "--no-compile", "--batch-size", "32",
            ]
        )  # fmt: skip
        out = capsys.readouterr().out
        assert code == 0
        assert "compensated master, int8 moments" in out  # the stepper's, as it was built
