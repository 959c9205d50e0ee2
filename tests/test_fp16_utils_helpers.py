"""Tests for the apex-compatible fp16_utils helpers: conversion, master params, legacy scalers."""

from __future__ import annotations

import collections
import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fp16fx.fp16_utils.conversion import (
    BN_convert_float,
    FP16Model,
    convert_module,
    convert_network,
    network_to_half,
    tofp16,
)
from fp16fx.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler
from fp16fx.fp16_utils.master_params import (
    clip_grad_norm,
    master_params_to_model_params,
    model_grads_to_master_grads,
    prep_param_lists,
    to_python_float,
)


def small_net() -> nn.Sequential:
    """A net with an affine BN (index 1), a non-affine BN (index 3) and a Linear (index 5)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.BatchNorm2d(4, affine=False),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 2),
    )


def param_and_buffer_dtypes(module: nn.Module) -> set[torch.dtype]:
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return {t.dtype for t in tensors if t.is_floating_point()}


# --- conversion -----------------------------------------------------------------------------


def test_convert_module_casts_only_own_floating_tensors_and_keeps_parameter_objects():
    bn = nn.BatchNorm1d(3)
    weight = bn.weight
    bn.weight.grad = torch.ones(3)
    convert_module(bn, torch.half)
    assert bn.weight is weight
    assert param_and_buffer_dtypes(bn) == {torch.half}
    assert bn.weight.grad.dtype == torch.half
    assert bn.num_batches_tracked.dtype == torch.long

    seq = nn.Sequential(nn.Linear(2, 2))
    convert_module(seq, torch.half)
    assert seq[0].weight.dtype == torch.float32  # children are not the module's own


def test_convert_network_keeps_only_affine_batchnorm_in_fp32():
    net = small_net()
    assert convert_network(net, torch.half) is net
    assert param_and_buffer_dtypes(net[0]) == {torch.half}
    assert param_and_buffer_dtypes(net[1]) == {torch.float32}
    assert param_and_buffer_dtypes(net[3]) == {torch.half}  # running stats, no affine params
    assert param_and_buffer_dtypes(net[5]) == {torch.half}
    assert net[3].num_batches_tracked.dtype == torch.long


def test_convert_network_to_bfloat16_and_back():
    net = convert_network(small_net(), torch.bfloat16)
    assert net[5].weight.dtype == torch.bfloat16
    convert_network(net, torch.float32)
    assert {p.dtype for p in net.parameters()} == {torch.float32}


def test_bn_convert_float_restores_affine_batchnorm_recursively():
    outer = nn.Sequential(small_net(), nn.BatchNorm1d(2)).half()
    assert BN_convert_float(outer) is outer
    assert param_and_buffer_dtypes(outer[0][1]) == {torch.float32}
    assert param_and_buffer_dtypes(outer[1]) == {torch.float32}
    assert param_and_buffer_dtypes(outer[0][3]) == {torch.half}
    assert outer[0][0].weight.dtype == torch.half


def test_network_to_half_casts_inputs_and_returns_half_output():
    net = small_net()
    wrapped = network_to_half(net)
    assert isinstance(wrapped, nn.Sequential) and isinstance(wrapped[0], tofp16)
    assert wrapped[1] is net
    assert net[0].weight.dtype == torch.half and net[1].weight.dtype == torch.float32
    out = wrapped(torch.randn(2, 3, 5, 5))
    assert out.dtype == torch.half and out.shape == (2, 2)


def test_tofp16_returns_half():
    assert tofp16()(torch.randn(3, dtype=torch.float64)).dtype == torch.half


class Probe(nn.Module):
    """Returns its inputs, so a test can see what the wrapper passed in."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.bn = nn.BatchNorm1d(2)

    def forward(self, x, pair, ids, extra=None):
        return x, pair, ids, extra


def test_fp16_model_casts_floating_inputs_recursively_and_converts_network():
    model = FP16Model(Probe())
    assert model.network.linear.weight.dtype == torch.half
    assert model.network.bn.weight.dtype == torch.float32
    ids = torch.arange(3)
    x, pair, out_ids, extra = model(
        torch.randn(2),
        [torch.randn(2), (torch.randn(2, dtype=torch.float64),)],
        ids,
        extra=torch.ones(1),
    )
    assert x.dtype == torch.half
    assert isinstance(pair, list) and isinstance(pair[1], tuple)
    assert pair[0].dtype == torch.half and pair[1][0].dtype == torch.half
    assert out_ids is ids
    assert extra.dtype == torch.half


def test_fp16_model_casts_named_tuples_packed_sequences_and_dicts():
    """A PackedSequence (rebuilt as a plain tuple of its fields) and other named tuples
    once failed inside torch, and dicts were passed on uncast; apex called ``.half()``."""
    lstm = FP16Model(nn.LSTM(3, 4))
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(5, 2, 3), [5, 3])
    out, _ = lstm(packed)
    assert isinstance(out, nn.utils.rnn.PackedSequence) and out.data.dtype == torch.half
    Pair = collections.namedtuple("Pair", "x steps")
    model = FP16Model(Probe())
    inputs = (Pair(torch.randn(2), 3), {"a": torch.randn(2), "ids": torch.arange(2)}, None)
    pair, mapping = model(*inputs)[:2]
    assert type(pair) is Pair and pair.x.dtype == torch.half and pair.steps == 3
    assert mapping["a"].dtype == torch.half and mapping["ids"].dtype == torch.int64
    counts = collections.defaultdict(list, a=torch.randn(2))  # rebuilt by its type: no factory
    mapping = model(None, counts, None)[1]
    assert mapping.default_factory is list and mapping["a"].dtype == torch.half


# --- master params --------------------------------------------------------------------------


def half_model_with_frozen_param() -> nn.Module:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).half()
    model[1].bias.requires_grad_(False)
    return model


def test_prep_param_lists_makes_fp32_leaf_clones_of_trainable_params():
    model = half_model_with_frozen_param()
    model_params, masters = prep_param_lists(model)
    assert model_params == [model[0].weight, model[0].bias, model[1].weight]
    for p, m in zip(model_params, masters, strict=True):
        assert m.dtype == torch.float32 and m.requires_grad and m.is_leaf
        assert torch.equal(m, p.float())
    masters[0].data.add_(1)
    assert not torch.equal(masters[0], model_params[0].float())  # no shared storage


def test_prep_param_lists_flat_master_is_one_fp32_parameter_laid_out_in_order():
    model = half_model_with_frozen_param()
    model_params, masters = prep_param_lists(model, flat_master=True)
    (flat,) = masters
    assert isinstance(flat, nn.Parameter) and flat.requires_grad
    assert flat.dtype == torch.float32 and flat.shape == (4 * 3 + 4 + 2 * 4,)
    offset = 0
    for p in model_params:
        assert torch.equal(flat[offset : offset + p.numel()].view(p.shape), p.float())
        offset += p.numel()
    assert flat.grad is not None and torch.equal(flat.grad, torch.zeros_like(flat))


def test_prep_param_lists_flat_master_refuses_mixed_dtypes_naming_them():
    model = nn.Sequential(nn.Linear(2, 2).half(), nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"torch\.float16.*torch\.float32"):
        prep_param_lists(model, flat_master=True)
    assert len(prep_param_lists(model)[1]) == 4  # the unflat path accepts mixed dtypes


def test_prep_param_lists_flat_master_refuses_a_model_without_trainable_params():
    with pytest.raises(ValueError, match="no trainable"):
        prep_param_lists(nn.ReLU(), flat_master=True)


def random_half_grads(params, none_index=None):
    gen = torch.Generator().manual_seed(2)
    for i, p in enumerate(params):
        p.grad = None if i == none_index else torch.randn(p.shape, generator=gen).half()


def test_grads_to_master_copy_exactly_and_a_none_grad_stays_none():
    model_params, masters = prep_param_lists(half_model_with_frozen_param())
    masters[1].grad = torch.ones_like(masters[1])  # stale grad must be dropped
    random_half_grads(model_params, none_index=1)
    model_grads_to_master_grads(model_params, masters)
    assert masters[1].grad is None
    for i in (0, 2):
        assert masters[i].grad.dtype == torch.float32
        assert torch.equal(masters[i].grad, model_params[i].grad.float())
    grad_storage = masters[0].grad.data_ptr()
    random_half_grads(model_params)
    model_grads_to_master_grads(model_params, masters)
    assert masters[0].grad.data_ptr() == grad_storage  # reused, not reallocated
    assert torch.equal(masters[1].grad, model_params[1].grad.float())


def test_grads_to_flat_master_concatenate_with_zeros_for_none():
    model_params, (flat,) = prep_param_lists(half_model_with_frozen_param(), flat_master=True)
    random_half_grads(model_params, none_index=1)
    model_grads_to_master_grads(model_params, [flat], flat_master=True)
    expected = torch.cat(
        [
            model_params[0].grad.float().reshape(-1),
            torch.zeros(model_params[1].numel()),
            model_params[2].grad.float().reshape(-1),
        ]
    )
    assert torch.equal(flat.grad, expected)


@pytest.mark.parametrize("flat_master", [False, True])
def test_master_to_model_round_trip_is_bitwise(flat_master):
    model = half_model_with_frozen_param()
    before = [p.detach().clone() for p in model.parameters()]
    model_params, masters = prep_param_lists(model, flat_master=flat_master)
    for p in model_params:
        p.data.zero_()
    master_params_to_model_params(model_params, masters, flat_master=flat_master)
    for p, b in zip(model.parameters(), before, strict=True):
        assert p.dtype == torch.half and torch.equal(p, b)

    for m in masters:  # an update, rounded on the way back to FP16
        m.data.add_(1 / 3)
    master_params_to_model_params(model_params, masters, flat_master=flat_master)
    flat = torch.cat([m.reshape(-1) for m in masters])
    assert torch.equal(torch.cat([p.reshape(-1) for p in model_params]), flat.half())


def test_master_param_helpers_refuse_mismatched_lists_before_copying_anything():
    """zip(strict=True) once raised only after copying the pairs before the shorter list's
    end; masters of another flat_master or swapped arguments got torch's or unpacking
    errors, or set every model grad to None."""
    model_params, masters = prep_param_lists(half_model_with_frozen_param())
    for p, m in zip(model_params, masters):
        p.grad, m.grad = torch.ones_like(p), None
    before = [p.detach().clone() for p in model_params]
    calls = {
        "2 model params but 1 masters": lambda: master_params_to_model_params(
            model_params[:2], masters[:1]
        ),
        "3 model params but 2 masters": lambda: model_grads_to_master_grads(
            model_params, masters[:-1]
        ),
        r"flat_master=True\) needs the one flat master": lambda: master_params_to_model_params(
            model_params, masters, flat_master=True
        ),
        r"master_params\[0\] is torch.float16 .* arguments swapped": (
            lambda: model_grads_to_master_grads(masters, model_params)
        ),
    }
    for message, call in calls.items():
        with pytest.raises(ValueError, match=message):
            call()
    assert all(torch.equal(a, p) for a, p in zip(before, model_params))
    assert all(m.grad is None for m in masters) and all(p.grad is not None for p in model_params)


def test_to_python_float():
    assert to_python_float(torch.tensor(2.5)) == 2.5
    assert type(to_python_float(torch.tensor([0.25], dtype=torch.half))) is float
    assert to_python_float(3.0) == 3.0
    assert to_python_float(7) == 7


def test_clip_grad_norm_is_torchs_in_place_clipping():
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    total = clip_grad_norm([p], max_norm=1.0)
    assert total.item() == pytest.approx(5.0)
    assert torch.allclose(p.grad, torch.tensor([0.6, 0.8]))


# --- legacy loss scalers --------------------------------------------------------------------


def reference_scales(init, factor, window, overflows):
    """Returns the scale after each iteration, computed from the whole history at once.

    Iteration i grows the scale when it is clean and i minus the index of the last overflow
    before it (-1 if none) is a multiple of the window; an overflow divides, floored at 1.
    """
    scales, scale = [], init
    for i, overflow in enumerate(overflows):
        last = max([j for j in range(i) if overflows[j]], default=-1)
        if overflow:
            scale = max(scale / factor, 1)
        elif (i - last) % window == 0:
            scale = scale * factor
        scales.append(scale)
    return scales


@settings(max_examples=150, deadline=None)
@given(
    init=st.sampled_from([1.0, 2.0, 3.0, 2.0**10, 2.0**32]),
    factor=st.sampled_from([2.0, 1.5, 4.0]),
    window=st.integers(1, 6),
    overflows=st.lists(st.booleans(), min_size=1, max_size=40),
)
def test_dynamic_loss_scaler_follows_apex_rule(init, factor, window, overflows):
    scaler = DynamicLossScaler(init_scale=init, scale_factor=factor, scale_window=window)
    expected = reference_scales(init, factor, window, overflows)
    last_overflow = -1
    for i, (overflow, want) in enumerate(zip(overflows, expected, strict=True)):
        before = scaler.cur_scale
        scaler.update_scale(overflow)
        last_overflow = i if overflow else last_overflow
        assert scaler.cur_scale == want
        assert scaler.loss_scale == want
        assert scaler.cur_iter == i + 1 and scaler.last_overflow_iter == last_overflow
        assert scaler.cur_scale >= min(before, 1)
        if overflow:
            assert scaler.cur_scale <= before


def test_dynamic_loss_scaler_defaults_and_first_growth():
    scaler = DynamicLossScaler()
    assert (scaler.cur_scale, scaler.scale_factor, scaler.scale_window) == (2**32, 2.0, 1000)
    assert (scaler.cur_iter, scaler.last_overflow_iter) == (0, -1)
    for _ in range(999):
        scaler.update_scale(False)
    assert scaler.cur_scale == 2**32
    scaler.update_scale(False)  # iteration 999 is 1000 after the virtual overflow at -1
    assert scaler.cur_scale == 2**33
    scaler.update_scale(True)
    assert scaler.cur_scale == 2**32 and scaler.last_overflow_iter == 1000


def test_static_loss_scaler_never_changes_or_reports_overflow():
    scaler = LossScaler(scale=128)
    p = nn.Parameter(torch.zeros(1))
    p.grad = torch.tensor([math.inf])
    assert scaler.has_overflow([p]) is False
    scaler.update_scale(True)
    assert scaler.cur_scale == 128 and scaler.loss_scale == 128
    assert LossScaler().cur_scale == 1


@pytest.mark.parametrize(
    ("grads", "expected"),
    [
        ([torch.ones(2), None], False),
        ([torch.ones(2), torch.tensor([1.0, math.inf])], True),
        ([torch.tensor([-math.inf]).half()], True),
        ([None, torch.tensor([math.nan, 0.0])], True),
        ([torch.full((3,), 6.0e4).half()], False),  # large but finite FP16
    ],
)
def test_dynamic_has_overflow_detects_inf_and_nan(grads, expected):
    params = []
    for g in grads:
        p = nn.Parameter(torch.zeros(2) if g is None else torch.zeros_like(g))
        p.grad = g
        params.append(p)
    assert DynamicLossScaler().has_overflow(params) is expected


def test_dynamic_has_overflow_takes_an_integer_grad_as_finite():
    """As apex's FP32 sum did; a norm of it, taken to check all grads at once, raised."""
    counts = torch.zeros(2, dtype=torch.long)
    counts.grad = torch.ones(2, dtype=torch.long)
    weight = nn.Parameter(torch.zeros(2))
    weight.grad = torch.ones(2)
    assert DynamicLossScaler().has_overflow([weight, counts]) is False
    weight.grad = torch.tensor([0.0, math.inf])
    assert DynamicLossScaler().has_overflow([counts, weight]) is True


def test_dynamic_has_overflow_reads_a_sparse_grad_by_its_values():
    """An nn.Embedding(sparse=True) grad once raised NotImplementedError (apex answered)."""
    embedding = nn.Embedding(5, 2, sparse=True)
    embedding(torch.tensor([1, 3])).sum().backward()
    assert embedding.weight.grad.is_sparse
    assert DynamicLossScaler().has_overflow(embedding.parameters()) is False
    embedding.weight.grad = embedding.weight.grad * math.inf
    assert DynamicLossScaler().has_overflow(embedding.parameters()) is True
    # Stored values, uncoalesced: a repeated index whose FP16 sum would overflow is finite.
    index, big = torch.tensor([[1, 1], [0, 0]]), torch.full((2,), 6.0e4, dtype=torch.half)
    half = nn.Parameter(torch.zeros(5, 2, dtype=torch.half))
    half.grad = torch.sparse_coo_tensor(index, big, (5, 2), check_invariants=True)
    assert DynamicLossScaler().has_overflow([half]) is False


@pytest.mark.parametrize("scaler", [LossScaler(8), DynamicLossScaler(init_scale=8)])
def test_backward_scales_the_loss(scaler):
    w = nn.Parameter(torch.ones(3, dtype=torch.half))
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.half)
    loss = (w * x).sum()
    scaler.backward(loss, retain_graph=True)
    assert torch.equal(w.grad, (8 * x))
    scaler.backward(loss)  # the graph was retained
    assert torch.equal(w.grad, (16 * x))


def test_a_scale_past_fp16s_range_gives_an_fp16_loss_inf_grads_as_apexs_did():
    """The first dynamic scale, 2**32, overflows an FP16 loss's gradient: the first step is
    skipped and the scale halves, as in apex."""
    w = nn.Parameter(torch.ones(2, dtype=torch.half))
    scaler = DynamicLossScaler()
    scaler.backward((w * 1e-3).sum())
    assert torch.isinf(w.grad).all() and scaler.has_overflow([w])


def test_backward_keeps_an_fp64_loss_in_fp64():
    """As apex's loss * scale: the loss was once cast down to FP32 first."""
    w = nn.Parameter(torch.ones(1, dtype=torch.float64))
    LossScaler(0.1).backward((w * 1.0).sum())
    assert w.grad.item() == 0.1


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_grads_to_master_accept_generators_and_stay_out_of_the_graph():
    """A parameters() generator was consumed by the length check (then a torch.cat error);
    a grad made with create_graph=True gave the master's grad a grad_fn (apex copied .data);
    a sparse grad failed after the earlier masters were written."""
    model = nn.Linear(3, 2)
    _, masters = prep_param_lists(model)
    (model(torch.ones(1, 3)) ** 2).sum().backward(create_graph=True)
    model_grads_to_master_grads(model.parameters(), iter(masters))
    assert all(m.grad.grad_fn is None and not m.grad.requires_grad for m in masters)
    assert torch.equal(masters[0].grad, model.weight.grad.detach())
    master_params_to_model_params(model.parameters(), iter(masters))
    embedding = nn.Embedding(4, 2, sparse=True)
    dense = nn.Parameter(torch.zeros(2))
    dense.grad = torch.ones(2)
    embedding(torch.tensor([1])).sum().backward()
    params = [dense, embedding.weight]
    _, masters = prep_param_lists(nn.ParameterList(params))
    with pytest.raises(TypeError, match=r"model_params\[1\] has a torch.sparse_coo grad"):
        model_grads_to_master_grads(params, masters)
    assert masters[0].grad is None  # nothing was copied


def test_scale_gradient_multiplies_each_incoming_gradient():
    scaler = DynamicLossScaler(init_scale=4)
    out = scaler.scale_gradient(nn.Identity(), (torch.ones(2), torch.full((1,), 0.5)), None)
    assert isinstance(out, tuple)
    assert torch.equal(out[0], torch.full((2,), 4.0)) and torch.equal(out[1], torch.full((1,), 2.0))


def test_apex_submodule_paths_import_the_same_objects():
    """Scripts import from apex.fp16_utils.fp16util, .fp16_optimizer and .loss_scaler too."""
    import importlib

    import fp16fx.fp16_utils as package

    for module, names in {
        "fp16util": ["network_to_half", "BN_convert_float", "FP16Model", "prep_param_lists",
                     "model_grads_to_master_grads", "master_params_to_model_params",
                     "to_python_float", "clip_grad_norm", "convert_module", "convert_network",
                     "tofp16"],
        "fp16_optimizer": ["FP16_Optimizer"],
        "loss_scaler": ["LossScaler", "DynamicLossScaler", "to_python_float"],
    }.items():  # fmt: skip
        found = importlib.import_module(f"fp16fx.fp16_utils.{module}")
        assert all(getattr(found, name) is getattr(package, name) for name in names)
    # apex's package imported its submodules: apex.fp16_utils.fp16_optimizer needed no import
    # of its own (a fresh interpreter: this one may have imported them already).
    script = "import fp16fx.fp16_utils as u; print(u.fp16util, u.fp16_optimizer, u.loss_scaler)"
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)
