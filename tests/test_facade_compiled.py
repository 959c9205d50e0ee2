"""The compiled fast path: every LR scheduler without recompiling, parity with the generic path,
checkpoints, folded clipping, and apex's seed recipe on ResNet-18.

Compiles are slow on CPU, so every test here builds the same model and optimizer structure
(:func:`build`) and shares one compiled step: after the first test, none compiles again.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torchvision
from torch import nn
from torch._dynamo.utils import counters

import fp16fx.compile
from fp16fx.fp16_utils import FP16_Optimizer, network_to_half
from fp16fx.transforms import read_hyperparams
from tests.test_facade_checkpoint import save_and_load

pytestmark = pytest.mark.compile
_DATA = torch.Generator().manual_seed(0)  # the same data however the tests are collected
X = torch.randn(16, 6, generator=_DATA).half()
Y = torch.randn(16, 3, generator=_DATA)


def build(path="fast", lr=1e-3, seed=0, device="cpu", **kwargs) -> tuple[nn.Module, FP16_Optimizer]:
    """An FP16 MLP with two param groups under Adam, dynamic loss scaling."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).half().to(device)
    inner = torch.optim.Adam(
        [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 2 * lr}],
        lr=lr,
        weight_decay=1e-2,
    )
    kwargs.setdefault("verbose", False)
    return model, FP16_Optimizer(inner, dynamic_loss_scale=True, path=path, **kwargs)


def train_step(model, opt, i=0, clip=None):
    opt.zero_grad()
    x, y = (t[i % 4 :].to(next(model.parameters()).device) for t in (X, Y))
    loss = ((model(x).float() - y) ** 2).mean()
    opt.backward(loss)
    norm = None if clip is None else opt.clip_master_grads(clip)
    opt.step()
    return loss.item(), norm


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def masters(opt):
    return [p.detach().clone() for g in opt.param_groups for p in g["params"]]


S = torch.optim.lr_scheduler
SCHEDULERS = {
    "LambdaLR": lambda o: S.LambdaLR(o, lr_lambda=lambda e: 0.8**e),
    "MultiplicativeLR": lambda o: S.MultiplicativeLR(o, lr_lambda=lambda e: 0.7),
    "StepLR": lambda o: S.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: S.MultiStepLR(o, milestones=[1, 3], gamma=0.5),
    "ConstantLR": lambda o: S.ConstantLR(o, factor=0.5, total_iters=2),
    "LinearLR": lambda o: S.LinearLR(o, start_factor=0.25, total_iters=3),
    "ExponentialLR": lambda o: S.ExponentialLR(o, gamma=0.8),
    "SequentialLR": lambda o: S.SequentialLR(
        o, [S.ConstantLR(o, factor=0.5, total_iters=2), S.ExponentialLR(o, gamma=0.8)], [2]
    ),
    "PolynomialLR": lambda o: S.PolynomialLR(o, total_iters=4, power=2.0),
    "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, T_max=4),
    "ChainedScheduler": lambda o: S.ChainedScheduler(
        [S.ConstantLR(o, factor=0.5, total_iters=2), S.ExponentialLR(o, gamma=0.8)]
    ),
    "ReduceLROnPlateau": lambda o: S.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "CyclicLR": lambda o: S.CyclicLR(o, base_lr=1e-4, max_lr=1e-2, step_size_up=2),
    "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=1e-2, total_steps=10),
    "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=2),
}


def test_every_scheduler_class_in_torch_is_covered():
    found = {
        name
        for name, cls in inspect.getmembers(S, inspect.isclass)
        if issubclass(cls, (S.LRScheduler, S.ReduceLROnPlateau))
        and cls not in (S.LRScheduler, S._LRScheduler)
    }
    assert found == set(SCHEDULERS)


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_lr_scheduler_drives_the_compiled_step_without_recompiling(name):
    model, opt = build()
    scheduler = SCHEDULERS[name](opt)
    seen = []
    for i in range(6):
        lrs = [g["lr"] for g in opt.param_groups]
        beta1s = [g["betas"][0] for g in opt.param_groups]
        train_step(model, opt, i)
        if i == 0:
            compiled = graphs()
        in_state = read_hyperparams(opt._engine.state.opt_state)
        assert [h["lr"] for h in in_state] == lrs  # what the compiled step just used
        assert [h["betas"][0] for h in in_state] == beta1s  # CyclicLR/OneCycleLR cycle these
        seen.append(lrs)
        scheduler.step(float(i)) if name == "ReduceLROnPlateau" else scheduler.step()
    assert len({tuple(lrs) for lrs in seen}) > 1, "the scheduler never changed the lr"
    assert opt.path == "fast" and graphs() == compiled, "a new lr recompiled the step"


def test_compiled_fast_path_matches_the_generic_path_after_20_adam_steps():
    # Not bitwise: the core orders Adam's arithmetic differently from torch.optim.Adam
    # (reciprocal bias corrections, m + (1 - b1)(g - m) instead of lerp) and Inductor fuses
    # it, so masters differ in their last bits -- and a last-bit difference that flips the
    # rounding of an FP16 param is amplified by the next forward. With lr=1e-3 over 20 steps
    # that stays below 1e-6.
    runs = {}
    for path in ("fast", "generic"):
        model, opt = build(path)
        runs[path] = ([train_step(model, opt, i)[0] for i in range(20)], masters(opt))
        assert opt.path == path
    assert runs["fast"][0] == pytest.approx(runs["generic"][0], rel=1e-5)
    for a, b in zip(runs["fast"][1], runs["generic"][1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    moved = [(a - b).abs().max() for a, b in zip(runs["fast"][1], masters(build()[1]))]
    assert min(moved) > 1e-4


def test_compiled_checkpoint_round_trip_is_bitwise():
    model, opt = build()
    full = [train_step(model, opt, i) for i in range(6)]
    first, first_opt = build()
    head = [train_step(first, first_opt, i) for i in range(3)]
    ckpt = save_and_load({"model": first.state_dict(), "optimizer": first_opt.state_dict()})
    resumed, resumed_opt = build(seed=1)
    resumed.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["optimizer"])
    compiled = graphs()
    tail = [train_step(resumed, resumed_opt, i) for i in range(3, 6)]
    assert head + tail == full and graphs() == compiled
    assert all(torch.equal(a, b) for a, b in zip(masters(resumed_opt), masters(opt)))


def test_clipping_is_folded_into_the_compiled_step():
    runs = {}
    for path in ("fast", "generic"):
        model, opt = build(path, lr=1e-2)
        runs[path] = [train_step(model, opt, i, clip=0.05) for i in range(4)], masters(opt)
    norms = {path: [n for _, n in runs[path][0]] for path in runs}
    assert all(n > 0.05 for n in norms["generic"])  # every step was clipped
    assert norms["fast"] == pytest.approx(norms["generic"], rel=1e-5)
    for a, b in zip(runs["fast"][1], runs["generic"][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_apex_seed_recipe_on_resnet18():
    torch.manual_seed(0)
    model = network_to_half(torchvision.models.resnet18(num_classes=10))
    optimizer = FP16_Optimizer(
        torch.optim.Adam(model.parameters(), lr=1e-3), dynamic_loss_scale=True, verbose=False
    )
    assert optimizer.path == "fast" and "compiled" in repr(optimizer)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([3, 7])
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]

    def iteration():
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y)
        optimizer.backward(loss)
        optimizer.update()
        return loss.item()

    # At 2**16 the FP16 gradients of this tiny-batch ResNet overflow: apex's rule skips each
    # step exactly and halves the scale.
    losses = [iteration() for _ in range(2)]
    assert optimizer.skipped_steps == 2 and optimizer.loss_scale == 2.0**14
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    optimizer.loss_scale = 8.0  # apex's settable scale, low enough for these gradients
    losses.append(iteration())
    assert optimizer.overflow is False and optimizer.loss_scale == 8.0
    assert all(math.isfinite(v) for v in losses)
    bn = model[1].bn1
    assert bn.weight.dtype == bn.running_mean.dtype == torch.float32
    assert model[1].conv1.weight.dtype == torch.float16
    changed = sum(not torch.equal(p, b) for p, b in zip(params, before))
    assert changed == len(params)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fast_path_on_cuda_matches_the_generic_path_and_its_checkpoint_loads_on_cpu():
    runs = {}
    for path in ("fast", "generic"):
        model, opt = build(path, device="cuda")
        runs[path] = [train_step(model, opt, i)[0] for i in range(10)], masters(opt)
        assert opt.path == path and opt._scaler.stats.is_cuda
    for a, b in zip(runs["fast"][1], runs["generic"][1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    saved = save_and_load(opt.state_dict(), map_location="cpu")
    model, cpu_opt = build()
    cpu_opt.load_state_dict(saved)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(masters(cpu_opt), runs["generic"][1]))


@pytest.mark.compile_fallback
def test_a_step_torch_compile_cannot_compile_runs_eagerly_with_one_warning(
    monkeypatch, _compiled_steps_stay_compiled
):
    """Inductor failing (no C++ compiler, a compiler bug) before anything ran: the facade
    says so once and steps the same core eagerly, to the same bits as an eager optimizer."""

    def fail(*args, **kwargs):
        raise torch._inductor.exc.InductorError(RuntimeError("no C++ compiler"), None)

    monkeypatch.setattr(fp16fx.compile, "_run_region", fail)
    model, opt = build()
    eager_model, eager = build(compiled=False)
    for i in range(3):
        train_step(model, opt, i)
        train_step(eager_model, eager, i)
    assert "eager" in repr(opt)
    assert len(_compiled_steps_stay_compiled.messages) == 1
    assert "no C++ compiler" in _compiled_steps_stay_compiled.messages[0]
    assert all(torch.equal(a, b) for a, b in zip(masters(opt), masters(eager), strict=True))
