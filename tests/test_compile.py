"""compile_step: same numbers as step, in place without a second state, zero recompiles."""

from __future__ import annotations

import warnings

import optree
import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.utils.flop_counter
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import fp16fx
from fp16fx.consensus import Consensus
from fp16fx.precision import decode_master
from tests.strategies import grads_like, has_tensor, pytrees
from tests.test_step import OPTIMIZERS, bitwise_equal, snapshot

pytestmark = pytest.mark.compile


def _steps(state, step, seeds, overflow_at=()):
    infos = []
    for i, seed in enumerate(seeds):
        grads = grads_like(state.params, seed, scale=float(state.loss_scale.scale))
        if i in overflow_at:
            next(g for g in optree.tree_leaves(grads)).view(-1)[0] = float("inf")
        state, info = step(state, grads)
        infos.append({k: v.clone() for k, v in info.items()})
    return state, infos


def _tensors(state) -> list[torch.Tensor]:
    """Returns every tensor of the state's state dict, keyed alike whatever its layout."""
    return [x for x in optree.tree_leaves(fp16fx.state_dict(state)) if isinstance(x, torch.Tensor)]


def _fresh(params):
    return optree.tree_map(lambda p: p.clone(), params)


@settings(max_examples=4)
@given(params=pytrees(), opt=st.sampled_from(["sgd", "adam"]), seed=st.integers(0, 2**16))
def test_compiled_step_gives_the_numbers_of_step(params, opt, seed):
    """Bitwise for SGD. Adam differs by an ulp at most: eager ``torch.sqrt`` on x86 CPUs is
    not correctly rounded (Inductor's is), so it is compared to 1e-6."""
    assume(has_tensor(params))
    torch._dynamo.reset()
    policy = fp16fx.DynamicLossScale(init_scale=2.0**8, growth_interval=2)
    seeds = [seed + i for i in range(4)]
    eager, eager_infos = _steps(
        fp16fx.init(_fresh(params), OPTIMIZERS[opt](), policy), fp16fx.step, seeds, {2}
    )
    for inplace in (False, True):
        state = fp16fx.init(_fresh(params), OPTIMIZERS[opt](), policy)
        compiled, infos = _steps(state, fp16fx.compile_step(inplace=inplace), seeds, {2})
        assert (compiled is state) == inplace
        assert [i["finite"].item() for i in infos] == [True, True, False, True]
        assert [i["loss_scale"].item() for i in infos] == [
            i["loss_scale"].item() for i in eager_infos
        ]
        assert bitwise_equal(compiled.loss_scale, eager.loss_scale)
        assert bitwise_equal(compiled.count, eager.count)
        if opt == "sgd":
            assert bitwise_equal(compiled.master, eager.master)
            assert bitwise_equal(compiled.params, eager.params)
        else:
            for a, b in zip(*(_tensors(s) for s in (compiled, eager))):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_inplace_step_writes_into_the_states_own_tensors():
    params = {"w": torch.randn(16, 8).half(), "b": torch.randn(8)}
    state = fp16fx.init(params, fp16fx.adam(1e-2), fp16fx.StaticLossScale(2.0**10))
    addresses = [t.data_ptr() for t in optree.tree_leaves(state)]
    reference = fp16fx.init(_fresh(params), fp16fx.adam(1e-2), fp16fx.StaticLossScale(2.0**10))
    step = fp16fx.compile_step(inplace=True)
    grads = grads_like(params, 3, scale=2.0**10)
    out, info = step(state, grads)
    expected, _ = fp16fx.step(reference, grads)
    assert out is state and info["finite"].item()
    assert [t.data_ptr() for t in optree.tree_leaves(state)] == addresses
    assert state.params["w"] is params["w"]  # the caller's tensor, updated in place
    assert not torch.equal(params["w"], reference.params["w"])
    for a, b in zip(*(_tensors(s) for s in (state, expected))):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("inplace", [True, False])
def test_fifty_steps_with_changing_lr_scale_and_overflows_compile_once(inplace):
    """One graph, whose regions never recompile: also pure, where the state's params are the
    leaves as given in the first step and flat ones after (gathered alike, ``prepare``)."""
    torch._dynamo.reset()
    counters.clear()
    params = {"w": torch.randn(32, 16).half(), "b": torch.randn(16).half(), "f": torch.randn(4)}
    policy = fp16fx.DynamicLossScale(init_scale=2.0**8, growth_interval=3, hysteresis=2)
    state = fp16fx.init(
        params, fp16fx.chain(fp16fx.clip_by_global_norm(10.0), fp16fx.adamw()), policy
    )
    step = fp16fx.compile_step(inplace=inplace)
    state, _ = step(state, grads_like(params, 0, scale=2.0**8))  # the one compile
    scales, skipped = set(), []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(1, 51):
            state = fp16fx.set_hyperparams(state, lr=1e-3 / i, weight_decay=0.01 * (i % 3))
            grads = grads_like(params, i, scale=float(state.loss_scale.scale))
            if i % 7 == 0:
                grads["b"][i % 16] = float("nan")
            state, info = step(state, grads)
            scales.add(float(info["loss_scale"]))
            if not info["finite"]:
                skipped.append(i)
    # Every injected NaN skips; the scale grows until real FP16 overflows back it off.
    assert {7, 14, 21, 28, 35, 42, 49} <= set(skipped) and len(scales) > 2
    assert counters["stats"]["unique_graphs"] == 1
    assert fp16fx.get_hyperparams(state)["lr"] == pytest.approx(1e-3 / 50)


def test_compiling_fp16_params_beside_bf16_moments_warns_nothing():
    """Inductor warns that a fused loop mixes FP16 and BF16 (it computes in FP32, as the step
    means to); the compiled region silences that one warning. Its graph cache is off here: a
    cached kernel skips the code generation that warns."""
    params = {"w": torch.randn(300).half(), "b": torch.randn(7).half()}
    policy = fp16fx.StaticLossScale(2.0**10)
    state = fp16fx.init(
        params, fp16fx.adam(), policy, buckets=True, master="compensated", moments="bf16"
    )
    grads = grads_like(params, 0, scale=2.0**10)
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        _, info = fp16fx.compile_step()(state, grads)
    assert info["finite"].item()
    assert [str(w.message) for w in caught] == []


def _sub_ulp_sgd_steps(step, master):
    """Ten SGD steps of 1e-4 on FP16 weights of 1.0 (ulp 2**-10: each update is below half
    of it). Returns the masters, in FP32."""
    params = {"w": torch.ones(16).half()}
    state = fp16fx.init(
        params, fp16fx.sgd(1e-4), fp16fx.StaticLossScale(1.0), buckets=True, master=master
    )
    for _ in range(10):
        state, _ = step(state, {"w": torch.ones(16).half()})
    entry = fp16fx.state_dict(state)["params"]["w"]
    if master == "fp32":
        return entry["master"].clone()
    return decode_master(entry["param"], entry["correction"])


@pytest.mark.parametrize("master", ["fp32", "compensated"])
def test_torch_compile_of_step_keeps_the_master_only_with_rounding_casts(master):
    """Inductor's default fuses ``x.to(float16)`` away inside FP32 arithmetic: compiled that
    way the step would restart every master from its FP16 param, losing these updates. So
    ``torch.compile(fp16fx.step)`` is refused until ``emulate_precision_casts`` is set, and
    then it gives the eager step's masters."""
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="emulate_precision_casts"):
        _sub_ulp_sgd_steps(torch.compile(fp16fx.step), master)
    eager = _sub_ulp_sgd_steps(fp16fx.step, master)
    with torch._inductor.config.patch(emulate_precision_casts=True):
        compiled = _sub_ulp_sgd_steps(torch.compile(fp16fx.step), master)
    assert torch.equal(compiled, eager)
    assert (eager < 1.0 - 5e-4).all()  # the masters moved by about 1e-3


def _sub_ulp_facade_steps(compiled):
    """Ten Adagrad steps (the facade's generic path) of at most 1e-4 on FP16 weights of 1.0.
    Returns the FP32 masters."""
    w = torch.nn.Parameter(torch.ones(16).half())
    opt = fp16fx.FP16_Optimizer(torch.optim.Adagrad([w], lr=1e-4), static_loss_scale=1.0)
    step = torch.compile(opt.step) if compiled else opt.step
    for _ in range(10):
        w.grad = torch.ones(16).half()
        step()
    assert opt.path == "generic"
    return opt.state_dict()["fp32_from_fp16"][0][0].clone()


def test_torch_compile_of_the_facades_generic_step_keeps_the_master_only_with_rounding_casts():
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="emulate_precision_casts"):
        _sub_ulp_facade_steps(compiled=True)
    eager = _sub_ulp_facade_steps(compiled=False)
    with torch._inductor.config.patch(emulate_precision_casts=True):
        compiled = _sub_ulp_facade_steps(compiled=True)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-7)
    assert (eager < 1.0 - 3e-4).all()  # ten sub-ulp updates, kept by the master


@pytest.mark.parametrize("context", ["FlopCounterMode", "dynamo disabled"])
def test_a_step_dynamo_would_not_compile_runs_eagerly(context):
    """Under a TorchDispatchMode (FlopCounterMode, counting a training step's FLOPs) or with
    Dynamo's tracing disabled, Dynamo ran the frame uncompiled and then raised "found no
    compiled frames": the in-place state written, and the facade's skip uncounted."""

    def around():
        if context == "dynamo disabled":
            return torch._dynamo.config.patch(disable=True)
        return torch.utils.flop_counter.FlopCounterMode(display=False)

    params = {"w": torch.randn(8).half(), "b": torch.randn(3)}
    state = fp16fx.init(params, fp16fx.adam(1e-2), fp16fx.StaticLossScale(2.0**4))
    reference = fp16fx.init(_fresh(params), fp16fx.adam(1e-2), fp16fx.StaticLossScale(2.0**4))
    grads = grads_like(params, 1, scale=2.0**4)
    with around():
        state, info = fp16fx.compile_step(inplace=True)(state, grads)
    expected, _ = fp16fx.step(reference, grads)
    assert bitwise_equal(state.params, expected.params) and info["finite"].item()
    assert bitwise_equal(state.master, expected.master)

    model = torch.nn.Linear(3, 2).half()
    opt = fp16fx.FP16_Optimizer(
        torch.optim.Adam(model.parameters()), dynamic_loss_scale=True, verbose=False
    )
    before = [p.detach().clone() for p in model.parameters()]
    opt.backward(model(torch.ones(1, 3).half()).float().sum() * float("inf"))
    with around():
        opt.step()
    assert opt.skipped_steps == 1 and opt.loss_scale == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_failed_consensus_a_compiled_step_runs_eagerly_is_named_once(tmp_path, monkeypatch):
    """Where Dynamo would run the step uncompiled, the consensus names its own failure; the
    compiled step's naming of a failure inside its graph once named it a second time."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        state = fp16fx.init([torch.ones(4).half()], fp16fx.sgd(0.1), consensus=Consensus())

        def reset_by_peer(*args, **kwargs):
            raise RuntimeError("Connection reset by peer")

        monkeypatch.setattr(dist, "all_reduce", reset_by_peer)
        with torch._dynamo.config.patch(disable=True), pytest.raises(RuntimeError) as failed:
            fp16fx.compile_step(inplace=True)(state, [torch.ones(4).half()])
    finally:
        dist.destroy_process_group()
    message = str(failed.value)
    assert message.startswith("fp16fx: the found-inf consensus of a step failed on rank 0 of 1")
    assert message.count("fp16fx:") == 1 and message.endswith("Connection reset by peer")


def test_inplace_step_refuses_bad_grads_before_touching_anything():
    params = {"w": torch.randn(4).half()}
    state = fp16fx.init(params, fp16fx.sgd(0.1), fp16fx.StaticLossScale(1.0))
    before = snapshot(state)
    with pytest.raises(ValueError, match="shape"):
        fp16fx.compile_step(inplace=True)(state, {"w": torch.randn(5).half()})
    assert bitwise_equal(before, snapshot(state))


def test_cuda_graph_mode_needs_inplace():
    with pytest.raises(ValueError, match="needs inplace=True"):
        fp16fx.compile_step(cuda_graph=True)


def test_a_thousand_bucketed_steps_with_a_schedule_and_overflows_compile_once():
    torch._dynamo.reset()
    params = {"w": torch.randn(8, 4).half(), "b": torch.randn(4).half()}
    policy = fp16fx.DynamicLossScale(init_scale=2.0**4, growth_interval=10)
    state = fp16fx.init(params, fp16fx.adam(1e-3), policy, buckets=True)
    grads = fp16fx.grad_buffers(state)
    step = fp16fx.compile_step(inplace=True)
    state, _ = step(state, grads)  # the one compile (zero grads)
    finite = torch.zeros(1000, dtype=torch.bool)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(1000):
            fp16fx.set_hyperparams(state, inplace=True, lr=1e-3 * (1 - i / 1000))
            for g in optree.tree_leaves(grads):
                g.copy_(torch.randn(g.shape) * 0.01 * state.loss_scale.scale)
            if i % 37 == 0:
                grads["w"][0, 0] = float("inf")
            state, info = step(state, grads)
            finite[i] = info["finite"]
    skipped = (~finite).nonzero().flatten().tolist()
    # Every injected inf is caught; the scale, growing between them, overflows FP16 too.
    assert set(range(0, 1000, 37)) <= set(skipped)
    assert state.count.item() == 1001 - len(skipped)
    assert all(torch.isfinite(p).all() for p in optree.tree_leaves(state.params))
    assert state.loss_scale.scale.item() > 2.0**4  # it grew between overflows
