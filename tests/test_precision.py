"""Compact precision (issue 13): compensated masters and FP32 / BF16 / int8 moments.

What is pinned here:

* Stagnation is gone (issue 13, item 1): FP16 and BF16 weights that receive 2,000 updates far
  below half an ulp move as an FP32 master does (each element within 2%, the mean within a
  tenth of that: the rounding is unbiased), where plain FP16 does not move at all -- small
  and subnormal weights included.
* The rounding of a master into (param, correction), against an FP64 reference: the param is
  the master rounded to nearest (or the next value up, where the rest would overflow the
  correction); the decoded master is within one unit (stochastic) or half a unit (to nearest)
  of the master, and stochastic rounding is unbiased over the dither.
* int8 moments decode within their companding's error bound; second moments decode to at
  least their true value (to 4 parts in 2**20) and never to zero, and still decay. Training
  with them tracks FP32 moments.
* The invariants of every step hold in compact modes: an overflowing step changes nothing but
  the loss scale (every stored tensor bitwise), eager and compiled steps agree bitwise (Adam:
  up to eager torch.sqrt's last bit), and changing the learning rate and the loss scale
  never recompiles.
* Bad input is refused by name and changes nothing; compact checkpoints round-trip bitwise and
  convert to and from full precision as ``load_state_dict`` documents.
* Persistent bytes per parameter for Adam: 16 / 13 / 9 / 7.03 for the four modes.

The compiled tests share one layout (a segment of 1,320 values: five whole int8 blocks and a
tail of 40), one loss-scale policy and two optimizers (Adam; SGD for the bitwise test), so
each (optimizer, master, moments, pure/inplace) compiles once in the whole file: 18 regions,
about 35 s on two busy cores with Inductor's cache warm, 2-3 minutes cold.
"""

from __future__ import annotations

import collections
import math
import re
import types

import optree
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import fp16fx
from fp16fx import precision
from fp16fx.compile import StepFunction
from fp16fx.distributed import persistent_bytes
from fp16fx.precision import (
    Precision,
    Quantized,
    decode_master,
    decode_moment,
    encode_master,
    encode_moment,
    round_moment,
)
from fp16fx.saved_format import StateDictError, canonical, precision_dict
from fp16fx.segments import named_segments
from fp16fx.transforms.base import hyperparams
from tests.strategies import grads_like
from tests.test_facade_checkpoint import save_and_load
from tests.test_step import same_bits

MASTERS = ("fp32", "compensated")
MOMENTS = ("fp32", "bf16", "int8")
COMBOS = [(m, mo) for m in MASTERS for mo in MOMENTS]

#: One loss-scale policy for every compiled test (it is part of a compiled region's key).
POLICY = fp16fx.DynamicLossScale(init_scale=2.0**8, growth_interval=3)
BLOCK = Precision().block  # 256


def adam():
    return fp16fx.adam(1e-2)


def sgd_momentum():
    return fp16fx.sgd(1e-2, momentum=0.9, nesterov=True, weight_decay=1e-2)


def tail_params(seed: int = 0) -> dict[str, torch.Tensor]:
    """FP16 params of 1,320 values: 5 whole int8 blocks of 256 and a tail of 40. In buckets
    the state pads them to 6 whole blocks; as given, they end in a short block, whose scale
    ``precision._per_value`` gathers (Inductor's loop split loses a broadcast one)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"w": (30, 20), "b": (20,), "c": (700,)}
    return {k: torch.randn(s, generator=gen).half() for k, s in shapes.items()}


def tail_state(master: str, moments: str, seed: int = 0, optimizer=None, buckets=True):
    return fp16fx.init(
        tail_params(seed),
        optimizer or adam(),
        POLICY,
        buckets=buckets,
        master=master,
        moments=moments,
    )


def scaled_grads(state, seed: int):
    return grads_like(state.params, seed, scale=float(state.loss_scale.scale))


def stored(state) -> dict[str, torch.Tensor]:
    """Returns a copy of every tensor of ``fp16fx.state_dict(state)``, keyed by its path."""
    paths, leaves, _ = optree.tree_flatten_with_path(fp16fx.state_dict(state))
    return {
        ".".join(map(str, path)): leaf.clone()
        for path, leaf in zip(paths, leaves)
        if isinstance(leaf, torch.Tensor)
    }


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Returns the keys whose tensors are not bitwise equal (all of them if the keys differ)."""
    assert a.keys() == b.keys()
    return [k for k in a if not same_bits(a[k], b[k])]


def ulp32(x: torch.Tensor) -> torch.Tensor:
    """An upper bound of the FP32 spacing at ``x`` (FP64): ``|x| * 2**-23``, at least the
    smallest subnormal's."""
    return torch.clamp(x.double().abs() * 2.0**-23, min=2.0**-149)


def unit(p: torch.Tensor) -> torch.Tensor:
    """Returns the correction's unit for params ``p`` (FP64) as docs/precision.md defines it,
    from ``p``'s binary exponent ``e`` (``2**e <= |p| < 2**(e + 1)``), independently of
    ``fp16fx.precision``'s bit manipulation: FP16's ulp ``2**(e - 10)`` (``2**-24`` for its
    subnormals and zero) over ``2**8``; BF16's ulp ``2**(e - 7)`` over ``2**16``, and
    ``2**-126`` (FP32's smallest normal) below ``2**-103``."""
    a = p.double().abs()
    e = torch.frexp(a).exponent.double() - 1
    if p.dtype == torch.float16:
        return torch.where(a >= 2.0**-14, 2.0 ** (e - 10), 2.0**-24) / 2**8
    assert p.dtype == torch.bfloat16
    return torch.where(a >= 2.0**-103, 2.0 ** (e - 7 - 16), 2.0**-126)


def next_up(p: torch.Tensor) -> torch.Tensor:
    """Returns the next value of ``p``'s dtype above ``p``."""
    return torch.nextafter(p, torch.full_like(p, math.inf))


def only_moments(state) -> dict[str, object]:
    """Returns the per-element moments of a one-segment state by name (``[1].mu`` ...)."""
    return {
        name: seg[0]
        for name, seg in named_segments(state.opt_state)
        if isinstance(seg[0], Quantized) or seg[0].ndim == 1
    }


# -- 1. stagnation ---------------------------------------------------------------------------

STEPS = 2000
WIDTH = 64
LR = 1e-5

#: name -> (param dtype, initial weight, gradient, tolerance of each element's movement):
#: each update is ``LR * gradient``. The issue's cases move every element within 2%. A
#: subnormal weight's update of 1e-10 is 0.43 of its correction's unit (2**-32): stochastic
#: rounding walks each element by sqrt(2000 * 0.43 * 0.57) = 22 units of the 859 it moves in
#: all (2.6%); 12% is 4.6 of those. (Measured worst elements: 0.5-0.7% for FP16, 0.0% for
#: BF16, whose int16 correction's unit is FP32's ulp; 7.6% for the subnormals.)
STAGNATION = {
    "fp16 1.0, updates 1e-5": (torch.float16, 1.0, 1.0, 0.02),
    "fp16 1.0, updates -1e-5 (upwards)": (torch.float16, 1.0, -1.0, 0.02),
    "fp16 1e-4, updates 1e-9": (torch.float16, 1e-4, 1e-4, 0.02),
    "bf16 1.0, updates 1e-5": (torch.bfloat16, 1.0, 1.0, 0.02),
    "fp16 1e-6 (subnormal), updates 1e-10": (torch.float16, 1e-6, 1e-5, 0.12),
}


@pytest.fixture(scope="module")
def stagnation_run():
    """Trains every case of STAGNATION side by side (one state: one eager loop of STEPS SGD
    steps) with compensated masters; returns per case (initial, final masters, FP32 master's
    final values, plain FP16's final values)."""
    params = {n: torch.full((WIDTH,), w, dtype=d) for n, (d, w, *_) in STAGNATION.items()}
    grads = {n: torch.full((WIDTH,), g, dtype=d) for n, (d, _, g, _) in STAGNATION.items()}
    initial = {n: p.clone() for n, p in params.items()}
    state = fp16fx.init(
        params, fp16fx.sgd(LR), fp16fx.StaticLossScale(1.0), buckets=True, master="compensated"
    )
    for _ in range(STEPS):
        state, _ = fp16fx.step(state, grads)
    out = {}
    for name in STAGNATION:
        update = torch.tensor(LR, dtype=torch.float32) * grads[name].float()  # the SGD update
        fp32_master = initial[name].float()
        plain = initial[name].clone()
        for _ in range(STEPS):
            fp32_master = fp32_master - update
            plain = plain - update.to(plain.dtype)  # FP16/BF16 arithmetic, no master
        out[name] = (initial[name], state.master[name].clone(), fp32_master, plain)
    return out


@pytest.mark.parametrize("case", list(STAGNATION))
def test_updates_far_below_half_an_ulp_move_compensated_weights_as_an_fp32_master(
    stagnation_run, case
):
    initial, master, fp32_master, plain = stagnation_run[case]
    assert torch.equal(plain, initial), "plain low precision should not move at all"
    expected = (fp32_master.double() - initial.double())[0]  # the same for every element
    moved = master.double() - initial.double()
    tolerance = STAGNATION[case][3]
    worst = ((moved - expected) / expected).abs().max().item()
    assert worst <= tolerance, f"an element moved {worst:.2%} off the FP32 master's {expected:.3e}"
    # Unbiased: the errors of 64 elements average out (measured: at most 0.06% off; the
    # subnormals 0.5%, a tenth of a sample spread of 2.6% / 8 = 0.3%).
    bias = ((moved.mean() - expected) / expected).item()
    assert abs(bias) <= tolerance / 10, f"mean movement {bias:+.2%} off the FP32 master's"


# -- 2. rounding into (param, correction) vs FP64 ----------------------------------------------

#: The bit patterns of the params drawn (and their negatives).
FP16_BITS = st.integers(0, 0x7400)  # |p| <= 2**14: far from overflow after any update
BF16_BITS = st.integers(0, 0x7180)  # |p| <= 2**100
NOISE = st.integers(0, 255).map(lambda j: (j + 0.5) / 256)  # the grid of precision.master_noise


def _param(bits: int, negative: bool, dtype: torch.dtype) -> torch.Tensor:
    p = torch.tensor([bits], dtype=torch.int16).view(dtype)
    return -p if negative else p


@st.composite
def masters_and_updates(draw, dtype: torch.dtype):
    """A compensated master (p, c), an update over 30 binades relative to the weight (small
    weights: relative to FP16's smallest normal), the FP32 sum the step computes and its FP64
    reference."""
    bits = draw(FP16_BITS if dtype == torch.float16 else BF16_BITS)
    p = _param(bits, draw(st.booleans()), dtype)
    limit = 127 if dtype == torch.float16 else 32767
    c = torch.tensor(
        [draw(st.integers(-limit, limit))], dtype=torch.int8 if limit == 127 else torch.int16
    )
    floor = 2.0**-14 if dtype == torch.float16 else 2.0**-126
    size = draw(st.floats(-30.0, 1.0))
    u64 = (-1.0 if draw(st.booleans()) else 1.0) * 2.0**size * max(abs(p.item()), floor)
    return p, c, u64


def _sums(p, c, u64):
    """Returns the step's FP32 master ``decode + u`` and its FP64 reference."""
    start = decode_master(p, c)
    x32 = start + torch.tensor([u64], dtype=torch.float32)
    x64 = p.double() + c.double() * unit(p) + u64
    # The step's own FP32 rounding (two operations), not the encoding's:
    assert (x32.double() - x64).abs().item() <= (ulp32(start) + ulp32(x32)).item()
    return x32, x64


def _check_rounding(p, c, u64, noise, half):
    x32, x64 = _sums(p, c, u64)
    p1, c1 = encode_master(x32, p.dtype, noise)
    # The param is the master rounded to nearest -- or, where the rest rounds to half an ulp
    # (one more than the correction holds), the next value up (precision.encode_master).
    nearest = x32.to(p.dtype)
    assert same_bits(p1, nearest) or same_bits(p1, next_up(nearest)), (p1, nearest)
    assert c1.dtype == c.dtype
    y = decode_master(p1, c1)
    q = unit(p1)
    slack = ulp32(y)  # the decode's own FP32 rounding
    err = (y.double() - x32.double()).abs()
    assert (err <= half * q + slack).all(), (
        f"decoded {y.item()!r} is {(err / q).item():.3f} units from {x32.item()!r}"
    )
    err64 = (y.double() - x64).abs()
    assert (err64 <= half * q + slack + ulp32(x32) + ulp32(decode_master(p, c))).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_correction_unit_of_every_finite_param_is_its_ulp_below_8_or_16_bits(dtype):
    """``precision._unit`` reads the unit from the exponent bits; the reference above from
    the value. Every finite FP16 and BF16 value, subnormals, zeros and the largest
    included."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    p = bits.view(dtype)
    p = p[torch.isfinite(p)]
    found, inverse = precision._unit(p)
    assert torch.equal(found.double(), unit(p))
    assert torch.equal(inverse.double(), 1 / unit(p))


@settings(max_examples=200, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([torch.float16, torch.bfloat16]), noise=NOISE)
def test_stochastic_rounding_into_param_and_correction_is_within_one_unit(data, dtype, noise):
    p, c, u64 = data.draw(masters_and_updates(dtype))
    _check_rounding(p, c, u64, torch.tensor([noise]), half=1.0)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_rounding_to_nearest_into_param_and_correction_is_within_half_a_unit(data, dtype):
    p, c, u64 = data.draw(masters_and_updates(dtype))
    _check_rounding(p, c, u64, None, half=0.5)


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    noise=st.none() | NOISE,
    again=st.none() | NOISE,
)
def test_a_stored_pair_encodes_to_itself(data, dtype, noise, again):
    """Decoding a stored (param, correction) and encoding it again, to nearest or with any
    dither, stores the same pair: a step that leaves a master where it is (a zero update)
    leaves its param and correction as they were. (Not for BF16 params below 2**-103: their
    unit stops at FP32's smallest normal, a few to their ulp, and a rest can round onto the
    tie between two params.)"""
    p, c, u64 = data.draw(masters_and_updates(dtype))
    x32, _ = _sums(p, c, u64)
    dither = None if noise is None else torch.tensor([noise])
    p1, c1 = encode_master(x32, dtype, dither)
    assume(dtype == torch.float16 or p1.abs().item() >= 2.0**-103)
    p2, c2 = encode_master(
        decode_master(p1, c1), dtype, None if again is None else torch.tensor([again])
    )
    # By value: decoding (-0, 0) sums opposite zeros, which IEEE makes +0.
    assert torch.equal(p2, p1) and torch.equal(c2, c1), (p1, c1, p2, c2)


def test_rounding_up_from_the_largest_negative_subnormal_reaches_zero():
    """A master just past half the smallest FP16 subnormal below zero: the rest rounds to
    half an ulp, so the param is bumped up to -0, the next value up, as IEEE's nextafter
    gives it (found by the property test above)."""
    p, c = torch.tensor([0.0], dtype=torch.float16), torch.tensor([-97], dtype=torch.int8)
    _check_rounding(p, c, -7.290930018482358e-09, None, half=0.5)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_master_just_inside_fp16s_largest_value_stays_finite(sign):
    """A master 127.9 units past FP16's largest value (65504, unit 1/8) rounds to the largest
    value and the correction's limit, a unit short of the midpoint to inf, on either side:
    at -65504 a correction of -128 once decoded to -65520, the midpoint, and the next step
    (a zero update too) rounded it to -inf, where an FP32 master keeps -65504."""
    master = torch.tensor([sign * (65504.0 + 127.9 / 8)])
    grid = (torch.arange(256, dtype=torch.float32) + 0.5) / 256
    for noise in (None, grid):
        p, c = encode_master(master.expand(256), torch.float16, noise)
        assert (p == sign * 65504.0).all() and (c == sign * 127).all(), (p.unique(), c.unique())
        again = encode_master(decode_master(p, c), torch.float16, grid)
        assert torch.equal(again[0], p) and torch.equal(again[1], c)  # a fixed point


@pytest.mark.parametrize(
    ("dtype", "compiled"), [(torch.float16, False), (torch.bfloat16, False), (torch.float16, True)]
)
def test_a_param_written_to_the_lowest_value_beside_the_lowest_correction_steps_finite(
    dtype, compiled
):
    """A correction of -top left by earlier steps beside a param written to -max in place
    (a weight clamp) decoded to the midpoint to -inf: a zero step rounded the param to -inf,
    where an FP32 master adopts the written value. The step takes the master a unit short."""
    params = {"w": torch.ones(4, dtype=dtype)}
    state = fp16fx.init(params, fp16fx.sgd(0.1), fp16fx.StaticLossScale(1.0), master="compensated")
    (correction,) = state.master_segments
    lowest = torch.finfo(dtype).min
    correction.fill_(torch.iinfo(correction.dtype).min)
    params["w"].fill_(lowest)
    step = fp16fx.compile_step(inplace=True) if compiled else fp16fx.step
    state, info = step(state, {"w": torch.zeros(4, dtype=dtype)})
    assert info["finite"].item() and (state.params["w"] == lowest).all(), state.params["w"]
    top = -torch.iinfo(correction.dtype).min
    assert (state.master["w"] == lowest - (top - 1) * unit(state.params["w"])).all()


def _mean_over_noise(p, c, u64):
    """Returns (mean decoded master over the 256 dithers ``master_noise`` can draw, FP32 master,
    the unit of its param)."""
    x32, _ = _sums(p, c, u64)
    grid = precision.master_noise(torch.arange(256))  # every low byte of the step's hash
    p1, c1 = encode_master(x32.expand(256), p.dtype, grid)
    return decode_master(p1, c1).double().mean(), x32.double().squeeze(), unit(p1).max()


def _check_unbiased(p, c, u64):
    mean, x, q = _mean_over_noise(p, c, u64)
    bound = q / 512 + 2 * ulp32(x)  # half a step of the dither's grid (a grid off by that: 1/256)
    assert abs(mean - x) <= bound, f"bias {((mean - x) / q).item():+.3f} units at {x.item()!r}"


@settings(max_examples=100, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_stochastic_rounding_is_unbiased_over_the_dither(data, dtype):
    """Averaged over every dither the hash can draw, the decoded master is the master."""
    _check_unbiased(*data.draw(masters_and_updates(dtype)))


def test_bf16_moments_round_stochastically_unbiased_over_every_dither():
    """Averaged over all 2**16 dithers below BF16's last bit, a moment rounds to itself: a
    dither on half that range would round every moment down (second moments then decay
    too fast, which no accuracy figure shows in a few steps)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, generator=g) * torch.logspace(-20, 5, 64)
    dithers = (torch.arange(2**16, dtype=torch.float64) + 0.5) / 2**16
    noise = dithers.float().repeat_interleave(x.numel())
    rounded = round_moment(x.repeat(2**16), "bf16", False, 256, noise)
    assert torch.equal(rounded, rounded.bfloat16().float())  # BF16 values
    mean = rounded.view(2**16, -1).double().mean(0)
    torch.testing.assert_close(mean, x.double(), rtol=1e-12, atol=0)


def test_a_step_rounds_each_moment_of_a_segment_with_its_own_dither():
    """Adam's first step from zero moments, BF16: whether ``mu`` and ``nu`` rounded up are
    all but uncorrelated (measured 0.02 over these 20,000 values; 0.38 when the step gave
    both moments the first one's dither, and their errors went up and down together)."""
    g = torch.Generator().manual_seed(11)
    params = {"w": torch.randn(20000, generator=g).half()}
    grads = {"w": (torch.randn(20000, generator=g) * 2**8).half()}
    state = fp16fx.init(
        params, adam(), fp16fx.StaticLossScale(2.0**8), buckets=True, master="compensated",
        moments="bf16",
    )  # fmt: skip
    state, _ = fp16fx.step(state, grads)
    moments = state.opt_state[1]
    (b1, b2), unscaled = moments.hyperparams["betas"].tolist(), grads["w"].float() / 2**8
    mu, nu = (unscaled * (1 - b1)).double(), (unscaled.square() * (1 - b2)).double()
    up_mu = moments.mu[0].double().abs() > mu.abs()
    up_nu = moments.nu[0].double() > nu
    rounded = (moments.mu[0].double() != mu) & (moments.nu[0].double() != nu)
    a, b = up_mu[rounded].double(), up_nu[rounded].double()
    correlation = ((a - a.mean()) * (b - b.mean())).mean() / (a.std() * b.std())
    assert abs(correlation) < 0.1, correlation


def test_a_value_draws_its_dither_from_its_place_however_the_state_is_cut():
    """Compensated masters, BF16 moments: "b" shares a bucket with "a". When "a" has no
    gradient the step cuts "b" into a segment of its own, and "b" still rounds exactly as
    when "a" took a zero gradient (Adam is elementwise: "b" sees nothing of "a"): its dither
    hashes its place in the bucket, not its segment."""
    g = torch.Generator().manual_seed(3)
    params = {k: torch.randn(300, generator=g).half() for k in "ab"}
    grads = {k: (torch.randn(300, generator=g) * 64).half() for k in "ab"}
    found = {}
    for case, grad_of_a in (("cut", None), ("whole", torch.zeros(300).half())):
        state = fp16fx.init(
            {k: v.clone() for k, v in params.items()},
            fp16fx.adam(1e-5),
            buckets=True,
            master="compensated",
            moments="bf16",
        )
        state, _ = fp16fx.step(state, {**grads, "a": grad_of_a})
        found[case] = state
    assert len(found["cut"].layout.segments) == 2 and len(found["whole"].layout.segments) == 1
    cut, whole = found["cut"], found["whole"]
    assert torch.equal(cut.params["b"], whole.params["b"])
    assert torch.equal(cut.master_segments[1], whole.master_segments[0][300:])
    whole_moments = dict(named_segments(whole.opt_state))
    moments = [(n, seg) for n, seg in named_segments(cut.opt_state) if seg[1].ndim == 1]
    assert len(moments) == 2  # Adam's mu and nu
    for name, segments in moments:
        assert torch.equal(segments[1], whole_moments[name][0][300:]), name


#: Masters whose rest is close to half an ulp, where the correction reaches its limit: the
#: ulp is exactly 256 units above a power of two and everywhere among the subnormals.
EDGES = {
    # The largest FP16 value below 2, 127.7 units of 2**-18 up: the rest rounds to 128
    # units, the param steps up to 2.0, a power of two whose unit is twice as large, and
    # keeps -64 of those (-128 once decoded 64 units low).
    "fp16 2 - ulp + 127.7 units": (
        torch.tensor([2.0 - 2.0**-10]).half(),
        torch.tensor([127], dtype=torch.int8),
        0.7 * 2.0**-18,
    ),
    # The same for BF16 (unit 2**-23 below 2, correction limit 32767).
    "bf16 2 - ulp + 32767.7 units": (
        torch.tensor([2.0 - 2.0**-7]).bfloat16(),
        torch.tensor([32767], dtype=torch.int16),
        0.7 * 2.0**-23,
    ),
    # 1.0 plus 127.75 units of 2**-18 (the next FP16 value is 256 units up).
    "fp16 1.0 + 127.75 units": (
        torch.tensor([1.0]).half(),
        torch.tensor([127], dtype=torch.int8),
        0.75 * 2.0**-18,
    ),
    # Just above FP16's lowest value, -65504, 127.75 units of 1/8 up: the rest rounds to 128
    # units, the param steps up to -65472 and keeps -128 of them (its correction's limit,
    # which -65504 does not reach: a clamp for -65504 once caught this pair, 1.25 units off).
    "fp16 -65504 + 127.75 units": (
        torch.tensor([-65504.0]).half(),
        torch.tensor([127], dtype=torch.int8),
        0.75 / 8,
    ),
    # A subnormal weight (17 * 2**-24), 127.43 units of 2**-32 below.
    "fp16 subnormal - 127.43 units": (
        torch.tensor([17 * 2.0**-24]).half(),
        torch.tensor([-127], dtype=torch.int8),
        -0.43 * 2.0**-32,
    ),
}


@pytest.mark.parametrize("edge", list(EDGES))
def test_rounding_at_the_corrections_limit_is_to_nearest_and_unbiased(edge):
    p, c, u64 = EDGES[edge]
    _check_rounding(p, c, u64, None, half=0.5)
    _check_unbiased(p, c, u64)


# -- 3. exact skip ---------------------------------------------------------------------------


def _runner(kind: str):
    if kind == "eager":
        return fp16fx.step
    return fp16fx.compile_step(inplace=kind == "inplace")


@pytest.mark.compile
@pytest.mark.parametrize("kind", ["eager", "pure", "inplace"])
@pytest.mark.parametrize(
    ("master", "moments"), [("compensated", "int8"), ("compensated", "bf16"), ("fp32", "int8")]
)
def test_an_overflowing_step_changes_nothing_but_the_loss_scale(master, moments, kind):
    step = _runner(kind)
    state = tail_state(master, moments)
    state, info = step(state, scaled_grads(state, 1))  # non-trivial moments first
    assert info["finite"].item()
    before = stored(state)
    grads = scaled_grads(state, 2)
    grads["w"][29, 19] = math.nan  # the last value of the segment: in its tail block
    grads["b"][3] = math.inf
    new, info = step(state, grads)
    assert not info["finite"].item()
    after = stored(new)
    assert set(differing(before, after)) <= {k for k in before if k.startswith("loss_scale.")}
    assert after["loss_scale.scale"].item() == before["loss_scale.scale"].item() / 2
    assert info["loss_scale"].item() == before["loss_scale.scale"].item()
    # The test means something: the compact tensors it compared are not trivial.
    compact = [k for k in before if k.endswith((".codes", ".scales", "correction"))]
    assert compact and all(before[k].abs().sum() > 0 for k in compact)


# -- 4. eager == compiled --------------------------------------------------------------------


def _three_adam_steps(master, moments, step, buckets=True):
    state = tail_state(master, moments, buckets=buckets)
    for seed in range(3):
        state, _ = step(state, scaled_grads(state, seed))
    return stored(state)


@pytest.mark.compile
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize(("master", "moments"), COMBOS)
def test_compiled_steps_give_the_numbers_of_eager_steps(master, moments, inplace):
    """Bitwise, but for Adam's update itself: eager ``torch.sqrt`` on x86 CPUs is not
    correctly rounded (15% of FP32 inputs here), Inductor's is, so an update may differ by an
    FP32 ulp (tests/test_compile.py). An FP32 master shows it as such; a compensated one
    rounds it into the correction, which then differs by one unit where the update straddled
    a unit's boundary. Moments, codes, scales, params, counts: bitwise."""
    eager = _three_adam_steps(master, moments, fp16fx.step)
    compiled = _three_adam_steps(master, moments, fp16fx.compile_step(inplace=inplace))
    _assert_the_numbers_of_eager(eager, compiled)


@pytest.mark.compile
def test_int8_moments_ending_in_a_short_block_compile_to_the_numbers_of_eager_steps():
    """In buckets the int8 state is padded to whole blocks, whose scales are broadcast (one
    load per block); params as given end in a short block, whose scales are gathered instead
    (``precision._per_value``): compiled, the same numbers as eager steps either way (the
    padded form: the test above)."""
    assert tail_state("fp32", "int8").opt_state[1].mu[0].codes.numel() == 6 * BLOCK
    assert tail_state("fp32", "int8", buckets=False).opt_state[1].mu[0].codes.numel() == 1320
    eager = _three_adam_steps("fp32", "int8", fp16fx.step, buckets=False)
    compiled = _three_adam_steps("fp32", "int8", fp16fx.compile_step(inplace=True), False)
    _assert_the_numbers_of_eager(eager, compiled)


@pytest.mark.compile
def test_int8_blocks_coded_as_rows_as_a_gpu_codes_them_store_the_same_bits():
    """Where Inductor writes Triton (GPUs) the step codes and writes whole int8 blocks as rows
    (``precision._in_rows``: one pass with the block maxima; tests/test_examples.py shows the
    kernels). Forced on this CPU (``cpu_backend="triton"``, run eagerly: the pure step, and
    the in-place one through Dynamo's eager backend), the rows store the flat form's bits."""
    flat = _three_adam_steps("compensated", "int8", fp16fx.step)
    assert not precision._in_rows(torch.zeros(BLOCK), BLOCK)
    with torch._inductor.config.patch(cpu_backend="triton"):
        assert precision._in_rows(torch.zeros(BLOCK), BLOCK)
        rows = _three_adam_steps("compensated", "int8", fp16fx.step)
        step = fp16fx.compile_step(inplace=True, backend="eager")
        in_place = _three_adam_steps("compensated", "int8", step)
    assert differing(flat, rows) == [] and differing(flat, in_place) == []


def test_grad_buffers_of_a_padded_state_are_read_with_their_padding_zeroed():
    """A state padded to whole int8 blocks reads ``grad_buffers`` in place, padding included
    (no copy); whatever the padding held, the step zeroes it, and the step is the one that
    separate grads (packed into a zero-padded buffer) give, bitwise."""
    in_place, packed = (tail_state("compensated", "int8") for _ in range(2))
    grads = fp16fx.grad_buffers(in_place)
    for g, value in zip(grads.values(), scaled_grads(in_place, 0).values()):
        g.copy_(value)
    buffer = torch.empty(0, dtype=torch.float16).set_(grads["w"].untyped_storage())
    assert buffer.numel() == 6 * BLOCK
    buffer[1320:] = float("nan")
    in_place, info = fp16fx.step(in_place, grads)
    assert info["finite"].item() and not buffer[1320:].any()
    packed, _ = fp16fx.step(packed, {k: g.clone() for k, g in grads.items()})
    assert differing(stored(in_place), stored(packed)) == []


def test_adam_at_eps_zero_keeps_the_padding_of_int8_blocks_zero():
    """The padding's grads and moments are 0: at eps = 0, Adam's 0 / 0 there once made it NaN,
    which weight decay carried into the last block's first moments, whose NaN scale then made
    that block's real values NaN."""
    state = tail_state("compensated", "int8", optimizer=fp16fx.adam(1e-3, eps=0.0))
    for seed in range(3):
        state, info = fp16fx.step(state, scaled_grads(state, seed))
        assert info["finite"].item()
    assert all(value.isfinite().all() for value in stored(state).values())
    assert not state.param_segments[0][1320:].any()


@pytest.mark.parametrize("inplace", [False, True])
def test_memory_after_the_params_in_a_buffer_of_the_users_is_never_taken_as_padding(inplace):
    """Params at the start of a user's buffer two int8 blocks long: what follows them there
    is not fp16fx's padding, however long the buffer is; init and steps leave it alone."""
    buffer = torch.full((2 * BLOCK,), 5.0, dtype=torch.float16)
    params = {"a": buffer[:300], "b": buffer[300:400]}
    state = fp16fx.init(params, fp16fx.adamw(0.1, weight_decay=0.5), moments="int8")
    step = StepFunction(inplace=True, compile_options=None) if inplace else fp16fx.step
    for _ in range(3):
        state, _ = step(state, {k: torch.ones_like(p) for k, p in params.items()})
    assert torch.equal(buffer[400:], torch.full((2 * BLOCK - 400,), 5.0, dtype=torch.float16))
    assert (state.params["a"] < 5.0).all()  # stepped (in place: in the buffer)


def test_the_dithers_are_the_centred_grids_the_roundings_are_unbiased_over():
    """A master's dither is (k + 1/2) / 256 for each low byte k of the hash, a moment's
    (k + 1/2) / 65536 for each 16 bits: a grid k / 256 would round every master down by
    1/512 of a unit on average."""
    master = precision.master_noise(torch.arange(256) + (torch.arange(256) << 8))
    assert torch.equal(master, (torch.arange(256, dtype=torch.float32) + 0.5) / 256)
    first = precision.moment_noise(torch.arange(1 << 16) << 16, 0)
    assert torch.equal(first, (torch.arange(1 << 16, dtype=torch.float32) + 0.5) / (1 << 16))
    bits = precision.hash_bits(1 << 16, 0, torch.tensor(3))
    for i in range(1, 4):
        k = precision.moment_noise(bits, i) * (1 << 16) - 0.5
        assert torch.equal(k, k.round()) and k.min() >= 0 and k.max() < 1 << 16


def _assert_independent(a: torch.Tensor, b: torch.Tensor, what: object) -> None:
    """Asserts that two dithers are not one: they rarely match and do not correlate."""
    assert (a == b).float().mean() < 0.01, what
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 0.02, what


def test_each_bucket_and_step_draws_its_own_dither():
    """The hash mixes the bucket (salt) and the applied-step count: two buckets, or two
    steps, with the same dither would round their values up and down together."""
    n, count = 1 << 16, torch.tensor(3)
    base = precision.master_noise(precision.hash_bits(n, 0, count))
    for other in (precision.hash_bits(n, 1, count), precision.hash_bits(n, 0, count + 1)):
        _assert_independent(precision.master_noise(other), base, "salt or count")


def test_each_moment_of_a_segment_draws_its_own_dither():
    """A transform may keep more than three moments; the fourth once reused the first's
    dither, so their roundings went up and down together."""
    bits = precision.hash_bits(1 << 16, 0, torch.tensor(3))
    noises = [precision.moment_noise(bits, i) for i in range(6)]
    for a in range(6):
        for b in range(a):
            _assert_independent(noises[a], noises[b], (a, b))


def _assert_the_numbers_of_eager(eager, compiled):
    off = differing(eager, compiled)
    for key in [k for k in off if k.endswith((".master", ".correction"))]:
        off.remove(key)
        if key.endswith(".master"):
            torch.testing.assert_close(compiled[key], eager[key], rtol=1e-6, atol=1e-7)
        else:
            steps = (compiled[key].int() - eager[key].int()).abs()
            assert steps.max().item() <= 1 and (steps > 0).float().mean().item() <= 0.01, key
    assert off == []


@pytest.mark.compile
@pytest.mark.parametrize(("master", "moments"), COMBOS)
def test_compiled_sgd_steps_are_bitwise_those_of_eager_steps(master, moments):
    """Without a square root every operation is correctly rounded both ways: bitwise."""

    def run(step):
        state = tail_state(master, moments, optimizer=sgd_momentum())
        for seed in range(3):
            state, _ = step(state, scaled_grads(state, seed))
        return stored(state)

    assert differing(run(fp16fx.step), run(fp16fx.compile_step())) == []


@pytest.mark.compile
@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="torch 2.14's CPU loop split drops the tail; once this passes, precision._per_value "
    "can broadcast after a short last block too (docs/precision.md, Speed)",
)
def test_inductor_computes_the_tail_of_a_broadcast_block_scale():
    """Why the step gathers each value's block scale where a segment ends in a short block:
    Inductor (CPU) cuts a loop that reads a broadcast block scale into rows of a block, and
    never computes the values past the last whole block. This fails loudly when torch fixes
    it, and whole-block segments' broadcast could then serve every segment."""

    def scaled(x, scales):
        return x * scales[:, None].expand(-1, BLOCK).reshape(-1)[: x.numel()]

    x, scales = torch.randn(4 * BLOCK + 40), torch.randn(5)
    compiled = torch.compile(scaled, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x, scales), scaled(x, scales))


# -- 5. zero recompiles ----------------------------------------------------------------------


@pytest.mark.compile
@pytest.mark.parametrize("inplace", [False, True])
def test_compact_steps_with_changing_lr_and_loss_scale_compile_once(inplace):
    state = tail_state("compensated", "int8")
    step = fp16fx.compile_step(inplace=inplace)
    state, _ = step(state, scaled_grads(state, 0))  # compiles (or reuses) the one region
    scales, skipped = set(), []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(1, 31):
            state = fp16fx.set_hyperparams(state, inplace=inplace, lr=1e-2 / i)
            grads = scaled_grads(state, i)
            if i % 7 == 0:
                grads["c"][-1] = math.nan
            state, info = step(state, grads)
            scales.add(info["loss_scale"].item())
            if not info["finite"].item():
                skipped.append(i)
    assert skipped == [7, 14, 21, 28] and len(scales) > 2
    assert fp16fx.get_hyperparams(state)["lr"] == pytest.approx(1e-2 / 30)
    assert state.count.item() == 31 - len(skipped)


# -- 6. int8 moments -------------------------------------------------------------------------

SIGNED_STEP = 1 / 127  # the companded code's step (sqrt scale)
UNSIGNED_STEP = 1 / 255  # (4th-root scale)


@st.composite
def blocks(draw, signed: bool):
    """A moment of 1 to 3 blocks (a tail block included), magnitudes spanning 1e-12..1e3."""
    n = draw(st.integers(1, 3 * BLOCK))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    exponents = torch.empty(n, dtype=torch.float64).uniform_(-12, 3, generator=gen)
    x = torch.pow(10.0, exponents)
    if signed:
        x = x * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    return x.float()


def _block_scales(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([b.abs().max() for b in x.split(BLOCK)])


def _per_value(scales: torch.Tensor, n: int) -> torch.Tensor:
    return scales.repeat_interleave(BLOCK)[:n].double()


@settings(max_examples=60, deadline=None)
@given(x=blocks(signed=True), stochastic=st.booleans(), seed=st.integers(0, 2**16))
def test_signed_int8_moments_decode_within_the_square_root_companding_bound(x, stochastic, seed):
    noise = torch.rand(x.numel(), generator=torch.Generator().manual_seed(seed))
    q = encode_moment(x, "int8", False, BLOCK, noise if stochastic else None)
    assert q.codes.dtype == torch.int8 and torch.equal(q.scales, _block_scales(x))
    y = decode_moment(q, False, BLOCK).double()
    scale, a = _per_value(q.scales, x.numel()), x.double().abs()
    d = SIGNED_STEP if stochastic else SIGNED_STEP / 2  # in sqrt(|x| / scale) units
    # |s^2 - (s + d)^2| with s = sqrt(|x| / scale), in value units, plus FP32 rounding:
    bound = 2 * d * torch.sqrt(a * scale) + d * d * scale + 4 * ulp32(scale)
    err = (y - x.double()).abs()
    assert (err <= bound).all(), f"worst {(err / bound).max().item():.3f} of the bound"
    assert (torch.sign(y) * torch.sign(x.double()) >= 0).all()  # never the wrong sign


@settings(max_examples=60, deadline=None)
@given(x=blocks(signed=False), stochastic=st.booleans(), seed=st.integers(0, 2**16))
def test_second_moments_decode_within_the_fourth_root_bound_and_never_zero(x, stochastic, seed):
    noise = torch.rand(x.numel(), generator=torch.Generator().manual_seed(seed))
    q = encode_moment(x, "int8", True, BLOCK, noise if stochastic else None)
    assert q.codes.dtype == torch.uint8
    assert torch.equal(q.scales, torch.clamp(_block_scales(x), min=torch.finfo().tiny))
    y = decode_moment(q, True, BLOCK).double()
    scale, v = _per_value(q.scales, x.numel()), x.double()
    assert ((y > 0) == (v > 0)).all(), "a positive second moment decoded to zero"
    d = UNSIGNED_STEP if stochastic else UNSIGNED_STEP / 2  # in (x / scale)**(1/4) units
    t = torch.pow(v / scale, 0.25)
    # A positive value's code is 1 at least: it may decode up to (1/255)**4 * scale.
    high = scale * torch.maximum(torch.pow(t + d, 4), torch.full_like(t, UNSIGNED_STEP**4))
    low = scale * torch.pow(torch.clamp(t - d, min=0), 4)
    slack = 4 * ulp32(scale)
    assert ((y <= high + slack) & (y >= low - slack)).all()


@settings(max_examples=40, deadline=None)
@given(signed=st.booleans(), data=st.data(), stochastic=st.booleans(), seed=st.integers(0, 2**16))
def test_int8_moments_encode_back_to_their_own_codes_and_scales(signed, data, stochastic, seed):
    """Decoding then encoding to nearest is the identity: what lets an int8 state leave as
    FP32 values (an FSDP2 DCP checkpoint) and come back bitwise. A block's largest code is
    the extreme one, so its value decodes to the scale itself, exactly."""
    x = data.draw(blocks(signed=signed))
    noise = torch.rand(x.numel(), generator=torch.Generator().manual_seed(seed))
    q = encode_moment(x, "int8", not signed, BLOCK, noise if stochastic else None)
    again = encode_moment(decode_moment(q, not signed, BLOCK), "int8", not signed, BLOCK, None)
    assert torch.equal(again.codes, q.codes) and same_bits(again.scales, q.scales)


@settings(max_examples=60, deadline=None)
@given(
    exponent=st.floats(-12.0, 0.0),
    non_negative=st.booleans(),
)
def test_int8_moments_round_stochastically_unbiased_in_value(exponent, non_negative):
    """Over every dither ``moment_noise`` can draw, a value's decoded int8 code averages to
    the value, however far below its block's scale (the block's other value, 1): within the
    dither grid's 1/65536 of a code's step. (A positive second moment below code 1's value
    is raised to it: never zero, the one bias, left out here.) Rounding the companded value
    instead was 2.5x too large on average at 1e-5 of the scale."""
    y = 10.0**exponent
    low = 0 if not non_negative else (1 / 255) ** 4
    assume(y >= low)
    n = 1 << 16
    x = torch.cat([torch.ones(1), torch.full((n,), y)])
    grid = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    noise = torch.cat([torch.full((1,), 0.5), grid])
    stored = encode_moment(x, "int8", non_negative, 1 << 17, noise)
    decoded = decode_moment(stored, non_negative, 1 << 17)[1:].double()
    top, power = (255, 4) if non_negative else (127, 2)
    code = math.floor(top * y ** (1 / power))
    below, above = (code / top) ** power, ((code + 1) / top) ** power  # the codes around y
    slack = 4 * ulp32(torch.tensor(above))  # FP32 decoding
    assert ((decoded >= below - slack) & (decoded <= above + slack)).all()
    bias = (decoded.mean() - y).abs()
    assert bias <= (above - below) / n + slack, f"bias {bias / y:.2e} of the value"


@pytest.mark.parametrize("non_negative", [False, True])
def test_an_overflowed_moment_leaves_its_blocks_other_values_finite(non_negative):
    """An inf moment (a BF16 gradient past 1e21 squared) is stored as FP32's largest value,
    and the other values of its block as they would be beside it: once, the block's scale
    was inf and every value decoded to 0 * inf, NaN."""
    x = torch.tensor([1.0, 2.0, float("inf"), 3.0])
    for noise in (None, torch.full((4,), 0.5)):
        y = decode_moment(encode_moment(x, "int8", non_negative, BLOCK, noise), non_negative, BLOCK)
        assert y[2] == torch.finfo().max and torch.isfinite(y).all()
        assert (y[[0, 1, 3]] < 1e36).all()


@pytest.mark.parametrize(("master", "moments"), [("fp32", "fp32"), ("compensated", "bf16")])
def test_a_second_moment_that_overflowed_to_inf_saves_and_resumes_bitwise(master, moments):
    """A BF16 gradient of 1e22 squares past FP32's range: Adam's second moment is inf and its
    value stops moving, as in torch.optim. Such a run's dict was once refused on load ("holds
    inf or NaN"); it resumes now, and NaN is still refused."""
    params = {"w": torch.ones(300, dtype=torch.bfloat16)}
    state = fp16fx.init(params, fp16fx.adam(1e-3), buckets=True, master=master, moments=moments)
    huge = torch.full((300,), 1e-3, dtype=torch.bfloat16)
    huge[0] = 1e22
    state, info = fp16fx.step(state, {"w": huge})
    assert bool(info["finite"])
    saved = save_and_load(fp16fx.state_dict(state))
    assert math.isinf(saved["params"]["w"]["opt[1].nu"][0])
    again = fp16fx.init(
        {"w": torch.zeros(300, dtype=torch.bfloat16)},
        fp16fx.adam(1e-3),
        buckets=True,
        master=master,
        moments=moments,
    )
    fp16fx.load_state_dict(again, saved)
    grads = {"w": torch.full((300,), 1e-3, dtype=torch.bfloat16)}
    for _ in range(2):
        state, _ = fp16fx.step(state, {"w": grads["w"].clone()})
        again, _ = fp16fx.step(again, {"w": grads["w"].clone()})
    assert all(map(same_bits, optree.tree_leaves(state), optree.tree_leaves(again)))
    assert state.params["w"][0] == 1 and (state.params["w"][1:] < 1).all()
    saved["params"]["w"]["opt[1].nu"][0] = math.nan
    with pytest.raises(StateDictError, match=r"\['opt\[1\].nu'\] holds NaN"):
        fp16fx.load_state_dict(again, saved)


def test_second_moments_of_a_subnormal_block_decode_within_the_bound_and_non_zero():
    """Second moments decay by 0.999 a step; an unused row's reach FP32's subnormals after
    ~50,000 steps. The block's scale is then the smallest normal value, divided by and
    multiplied by alike."""
    x = torch.tensor([1e-40, 5e-41, 1e-45])
    q = encode_moment(x, "int8", True, BLOCK, None)
    y = decode_moment(q, True, BLOCK)
    assert q.scales.item() == torch.finfo().tiny
    assert (y > 0).all(), f"{x.tolist()} -> {y.tolist()}"
    t = torch.pow(x.double() / q.scales.double(), 0.25)
    assert (torch.pow(y.double() / q.scales.double(), 0.25) - t).abs().max() <= 0.5 / 255 + 1e-6


QUADRATIC_N = 300  # two blocks, the second a tail
QUADRATIC_STEPS = 150


def _quadratic():
    """Returns (curvatures a spanning 0.1..10, targets) of 0.5 * sum(a * (w - t)^2)."""
    gen = torch.Generator().manual_seed(7)
    a = torch.pow(10.0, torch.empty(QUADRATIC_N).uniform_(-1, 1, generator=gen))
    return a, torch.randn(QUADRATIC_N, generator=gen)


def _train_quadratic(optimizer, moments: str) -> torch.Tensor:
    """Returns the FP32 masters after QUADRATIC_STEPS steps from w = 0 (only the moments'
    precision varies)."""
    a, target = _quadratic()
    params = {"w": torch.zeros(QUADRATIC_N, dtype=torch.float16)}
    state = fp16fx.init(params, optimizer, fp16fx.StaticLossScale(1.0), moments=moments)
    for _ in range(QUADRATIC_STEPS):
        w = state.params["w"].float()
        state, _ = fp16fx.step(state, {"w": (a * (w - target)).half()})
    return state.master["w"].clone()


@pytest.mark.parametrize(
    ("make", "tolerance"),
    [
        # Measured max |w_int8 - w_fp32|: 0.0023 (bf16 moments: 0.0010).
        pytest.param(lambda: fp16fx.sgd(0.02, momentum=0.9), 0.01, id="sgd momentum"),
        # Measured with bf16 moments: 0.0085; with int8 moments: 0.028 (each second moment
        # rounds stochastically: its weight's steps are noisier, not biased).
        pytest.param(lambda: fp16fx.adam(0.02), 0.05, id="adam"),
    ],
)
def test_training_with_int8_moments_tracks_fp32_moments(make, tolerance):
    a, target = _quadratic()
    start = (0.5 * a * target**2).sum().item()  # the loss at w = 0
    w_full = _train_quadratic(make(), "fp32")
    w_int8 = _train_quadratic(make(), "int8")
    loss_full = (0.5 * a * (w_full - target) ** 2).sum().item()
    loss_int8 = (0.5 * a * (w_int8 - target) ** 2).sum().item()
    assert loss_full < 0.01 * start, f"it did not train: {loss_full} of {start}"
    assert abs(loss_int8 - loss_full) <= 0.01 * start
    worst = (w_int8 - w_full).abs().max().item()
    assert worst <= tolerance, f"a weight is {worst:.4f} off its FP32-moment value"


def test_int8_second_moments_decay_as_fp32_ones_on_average():
    """Adam's nu decays by beta2 = 0.999 a step once its gradient is gone: 1/1,000 of its
    value, at code 40 1/40 of the way to the next code down. Rounded one way, an int8 nu
    would never decay (or never stop growing); rounded stochastically in value, each
    element's nu walks randomly around the FP32 one, unbiased: their mean decays as the FP32
    nu does. (Rounded in the companded domain it was 1.38x the FP32 one by these steps.)"""
    beta2, steps = 0.999, 4000
    n = BLOCK  # element 0 keeps a gradient of 1 (the block's scale), the others have none
    nus = {}
    for moments in ("fp32", "int8"):
        state = fp16fx.init(
            {"w": torch.zeros(n, dtype=torch.float16)},
            fp16fx.adam(1e-3, betas=(0.9, beta2)),
            fp16fx.StaticLossScale(1.0),
            moments=moments,
        )
        state, _ = fp16fx.step(state, {"w": torch.ones(n, dtype=torch.float16)})
        grad = torch.zeros(n, dtype=torch.float16)
        grad[0] = 1.0
        for _ in range(steps):
            state, _ = fp16fx.step(state, {"w": grad})
        nu = only_moments(state)["[1].nu"]
        nus[moments] = decode_moment(nu, True, BLOCK) if isinstance(nu, Quantized) else nu
    full, int8 = nus["fp32"][1:], nus["int8"][1:]
    expected = torch.tensor((1 - beta2) * beta2**steps)
    assert torch.allclose(full, expected, rtol=1e-3)
    # Each element's walk spreads about 30%; the mean of 255 of them, about 2%.
    assert int8.mean().item() == pytest.approx(full.mean().item(), rel=0.1)


def test_a_slowly_decaying_second_moment_is_not_frozen_by_its_dither():
    """nu decaying by beta2 = 0.9999 a step moves 1/10,000 of its value: at code 40, 1/200 of
    the way to the next code down, below half a step of a one-byte dither's grid (1/512), so
    with one byte every such code froze (the block's mean 2.7x the FP32 value after 10,000
    steps, here). Each step here is what Adam's does to a moment whose gradient is gone:
    decode, decay, round with the step's dither for a second moment; the block's scale held
    at 1 by its first value."""
    steps, beta2 = 10000, 0.9999
    x = torch.full((BLOCK,), (40 / 255) ** 4)
    x[0] = 1.0
    for t in range(steps):
        decayed = torch.cat([x[:1], x[1:] * beta2])
        noise = precision.moment_noise(precision.hash_bits(BLOCK, 0, torch.tensor(t)), 1)
        x = decode_moment(encode_moment(decayed, "int8", True, BLOCK, noise), True, BLOCK)
    expected = (40 / 255) ** 4 * beta2**steps
    assert x[1:].mean().item() == pytest.approx(expected, rel=0.05)


# -- 7. bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"master": "fp64"}, "master must be one of .*'fp64'"),
        ({"moments": "fp8"}, "moments must be one of .*'fp8'"),
        ({"master": "bf16"}, "master must be one of .*'bf16'"),
    ],
)
def test_unknown_precisions_are_refused_by_name(keywords, message):
    params = {"w": torch.ones(4).half()}
    before, storage = params["w"].clone(), params["w"].untyped_storage().data_ptr()
    with pytest.raises(ValueError, match=message):
        fp16fx.init(params, adam(), buckets=True, **keywords)
    # Not moved into a bucket (which keeps the values): refused before anything changed.
    assert params["w"].untyped_storage().data_ptr() == storage
    assert same_bits(params["w"], before)


def test_compensated_fp32_params_are_refused():
    with pytest.raises(ValueError, match=r"all FP32.*master='fp32'"):
        fp16fx.init({"w": torch.ones(4), "b": torch.ones(2)}, adam(), master="compensated")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_compensated_params_that_are_not_flat_need_buckets(dtype):
    """FP16 ones, or FP32 ones (a norm layer's) beside a flat FP16 param: the step writes
    every param in its fused pass (once an AssertionError deep in ``init``)."""
    params = {"w": torch.ones(4, 3).half()[:, :2], "b": torch.ones(2).half()}
    if dtype == torch.float32:
        params = {"w": torch.ones(8).half(), "ln.w": torch.ones(3), "ln.b": torch.zeros(3)}
    with pytest.raises(ValueError, match="buckets=True"):
        fp16fx.init(params, adam(), master="compensated")
    fp16fx.init(params, adam(), master="compensated", buckets=True)  # fine with buckets


@pytest.mark.parametrize("block", [100, 0, -256, 3, 256.0])
def test_a_block_that_is_not_a_power_of_two_is_refused(block):
    with pytest.raises(ValueError, match="block must be a power of two"):
        Precision(block=block)


def _mismatches():
    """name -> (a function making a compact state dict that does not fit ``tail_state``,
    the error message expected)."""

    def saved(optimizer=None, params=None, master="compensated", moments="int8"):
        state = fp16fx.init(
            params or tail_params(1),
            optimizer or adam(),
            POLICY,
            buckets=True,
            master=master,
            moments=moments,
        )
        state, _ = fp16fx.step(state, scaled_grads(state, 5))
        return fp16fx.state_dict(state)

    def other_shapes():
        return saved(params={**tail_params(1), "c": torch.randn(600).half()})

    def other_policy():
        sd = saved()
        sd["policy"] = {**sd["policy"], "growth_interval": 7}
        return sd

    def bad_precision():
        sd = saved()
        sd["precision"] = {"master": "fp8", "moments": "int8", "block": 256}
        return sd

    def truncated_scales():
        sd = saved()
        entry = sd["params"]["c"]
        entry["opt[1].mu.scales"] = entry["opt[1].mu.scales"][:-1].clone()
        return sd

    def wrong_corrections():
        sd = saved()
        sd["params"]["w"]["correction"] = sd["params"]["w"]["correction"][:, :10].clone()
        return sd

    def a_pair_past_fp16s_largest():
        """(-65504, -128): its master, -65520, is the midpoint to -inf (steps before
        52d58d2 could save it; the next step made the param -inf)."""
        sd = saved()
        sd["params"]["w"]["param"][0, 0] = -65504.0
        sd["params"]["w"]["correction"][0, 0] = -128
        return sd

    def changed(key, change):
        """The dict with ``['params']['w'][key]`` (or ``[key]`` at the top) changed."""

        def make():
            sd = saved()
            where = sd if key == "count" else sd["params"]["w"]
            where[key] = change(where[key])
            return sd

        return make

    def added(key, value):
        """The dict with ``value`` under ``['params']['w'][key]``."""

        def make():
            sd = saved()
            sd["params"]["w"][key] = value
            return sd

        return make

    def negative_full_moment():
        sd = saved(master="fp32", moments="fp32")
        sd["params"]["w"]["opt[1].nu"] = -1 - sd["params"]["w"]["opt[1].nu"]
        return sd

    def read_only(make):
        """The dict of ``make`` with its params in a read-only mapping (not a dict)."""

        def wrapped():
            sd = make()
            return {**sd, "params": types.MappingProxyType(sd["params"])}

        return wrapped

    def valued(group, key, value):
        """The dict with ``[group][key]`` filled with ``value``."""

        def make():
            sd = saved()
            sd[group][key] = torch.full_like(sd[group][key], value)
            return sd

        return make

    # Stored tensors of a kind the format does not store: decoded, they would give other numbers.
    return {
        "a correction of another dtype": (
            changed("correction", lambda c: c.to(torch.int16) * 2),
            r"\['correction'\] has dtype torch.int16; a torch.float16 param's is torch.int8",
        ),
        "more int8 scales than blocks": (
            changed("opt[1].mu.scales", lambda t: torch.cat([t, t])),
            r"\['opt\[1\].mu.scales'\] is torch.float32 of shape .*its codes need",
        ),
        "a float block offset": (
            changed("opt[1].nu.offset", lambda t: t.float()),
            r"\['opt\[1\].nu.offset'\] is not an int64",
        ),
        "an integer param": (
            changed("param", lambda t: t.long()),
            r"\['param'\] has dtype torch.int64, not FP16, BF16 or FP32",
        ),
        "a meta tensor": (changed("count", lambda t: t.to("meta")), r"\['count'\] is a meta"),
        # A Mapping not a dict was once one leaf to the check: its meta tensor went unseen.
        "a meta tensor in a read-only mapping": (
            read_only(changed("opt[1].count", lambda t: t.to("meta"))),
            r"\['w'\]\['opt\[1\].count'\] is a meta",
        ),
        # Values the state cannot take, refused as set_hyperparams and the policies refuse them.
        "a NaN learning rate": (
            valued("hyperparams", "opt[2]['lr']", math.nan),
            r"\['hyperparams'\]\[\"opt\[2\]\['lr'\]\"\]: hyperparameter 'lr' must be",
        ),
        "an infinite loss scale": (
            valued("loss_scale", "scale", math.inf),
            r"\['loss_scale'\]\['scale'\]: the loss scale must be",
        ),
        "a negative count": (changed("count", lambda t: t - 10), r"\['count'\] is -9, a count"),
        "a count of -1": (changed("count", lambda t: t - 2), r"\['count'\] is -1, a count"),
        "a negative step count of a param": (
            changed("opt[1].count", lambda t: t - 10),
            r"\['w'\]\['opt\[1\].count'\] is -9, a step count below 0",
        ),
        "a NaN param": (
            changed("param", lambda t: t * math.nan),
            r"\['w'\]\['(param|master)'\] holds inf or NaN",
        ),
        # Keys no saved leaf has, once dropped unread (a master beside the correction was
        # decoded in its place).
        "a stray key in a leaf": (
            added("notes", torch.zeros(1)),
            r"\['w'\]\['notes'\] is no key a saved leaf has",
        ),
        "block scales without their codes": (
            added("opt[7].zz.scales", torch.ones(2)),
            r"\['w'\]\['opt\[7\].zz.scales'\] without the int8 codes it belongs to",
        ),
        "a step count that is not 0-d": (
            changed("opt[1].count", lambda t: t.reshape(1)),
            r"\['w'\]\['opt\[1\].count'\] has shape \(1,\), this state's \(\)",
        ),
        # Once refused as a moment: "has shape (); its ['param'] has (30, 20)".
        "a step count saved as a float": (
            changed("opt[1].count", lambda t: t.float()),
            r"\['w'\]\['opt\[1\].count'\] is a 0-d torch.float32: a step count is an integer",
        ),
        "a master beside the correction": (
            added("master", torch.zeros(30, 20)),
            r"\['w'\]\['correction'\] beside a \['master'\]",
        ),
        # Codes of the other kind would decode to other numbers (a second moment below zero,
        # whose square root is NaN; a first moment without its signs); so would block scales
        # no encoding gives. A second moment saved in FP32 is checked for its sign.
        "a second moment stored as signed codes": (
            changed("opt[1].nu.codes", lambda t: -(t // 2).to(torch.int8) - 1),
            r"\['w'\]\['opt\[1\].nu.codes'\] has dtype torch.int8; this non-negative "
            r"moment's codes are torch.uint8",
        ),
        "a first moment stored as unsigned codes": (
            changed("opt[1].mu.codes", lambda t: t.abs().to(torch.uint8)),
            r"\['w'\]\['opt\[1\].mu.codes'\] has dtype torch.uint8; this signed moment's "
            r"codes are torch.int8",
        ),
        "a signed code of -128": (
            changed("opt[1].mu.codes", lambda t: torch.where(t == t.min(), -128, t).to(t.dtype)),
            r"\['w'\]\['opt\[1\].mu.codes'\] holds the code -128, which no encoding gives",
        ),
        "negative block scales": (
            changed("opt[1].mu.scales", torch.neg),
            r"\['w'\]\['opt\[1\].mu.scales'\] holds a scale that is not finite and at least",
        ),
        "zero block scales": (
            changed("opt[1].nu.scales", torch.zeros_like),
            r"\['w'\]\['opt\[1\].nu.scales'\] holds a scale that is not finite and at least",
        ),
        "a negative FP32 second moment": (
            negative_full_moment,
            r"\['w'\]\['opt\[1\].nu'\] holds negative values",
        ),
        "other shapes": (other_shapes, r"\['c'\]\['param'\] has shape \(600,\), this state's"),
        "another optimizer": (
            lambda: saved(fp16fx.sgd(0.1, momentum=0.9)),
            r"\['hyperparams'\] lacks .*betas.*another optimizer",
        ),
        "another loss-scale policy": (
            other_policy,
            r"it was saved with loss-scale policy .*'growth_interval': 7.*, this state has .*"
            r": build it with the saved policy to load this dict",
        ),
        "an unknown precision": (bad_precision, r"\['precision'\] is .*master must be one of"),
        "truncated int8 scales": (
            truncated_scales,
            r"\['c'\]\['opt\[1\].mu.scales'\] is torch.float32 of shape \(2,\); its codes need 3",
        ),
        "codes of another shape": (
            changed("opt[1].mu.codes", lambda t: t.reshape(-1)),
            r"\['w'\]\['opt\[1\].mu.codes'\] has shape \(600,\); its \['param'\] has \(30, 20\)",
        ),
        "a compensated pair past FP16's largest": (
            a_pair_past_fp16s_largest,
            r"\['w'\]: its master holds values past torch.float16's largest \(65504\), which a "
            "compensated state cannot hold",
        ),
        "a correction of another shape": (
            wrong_corrections,
            r"\['w'\]\['correction'\] has shape \(30, 10\); its \['param'\] has \(30, 20\)",
        ),
    }


MISMATCHES = _mismatches()


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_a_compact_checkpoint_that_does_not_fit_is_refused_and_changes_nothing(name):
    make, message = MISMATCHES[name]
    sd = make()
    state = tail_state("compensated", "int8")
    state, _ = fp16fx.step(state, scaled_grads(state, 3))
    before = stored(state)
    with pytest.raises(StateDictError, match=message):
        fp16fx.load_state_dict(state, sd)
    assert differing(before, stored(state)) == []


# -- 8. checkpoints --------------------------------------------------------------------------


def _trained(master: str, moments: str, seed: int = 0):
    state = tail_state(master, moments, seed=seed)
    for i in range(3):
        state, _ = fp16fx.step(state, scaled_grads(state, 10 + i))
    return state


@pytest.mark.parametrize("moments", MOMENTS)
def test_a_compact_checkpoint_round_trips_bitwise_and_steps_alike(moments):
    source = _trained("compensated", moments)
    target = fp16fx.load_state_dict(
        tail_state("compensated", moments, seed=9), save_and_load(fp16fx.state_dict(source))
    )
    assert differing(stored(source), stored(target)) == []
    grads = scaled_grads(source, 99)
    a, _ = fp16fx.step(source, grads)
    b, _ = fp16fx.step(target, grads)
    assert differing(stored(a), stored(b)) == []


def _momentum_kept_in_a_dict(kind: type = dict) -> fp16fx.transforms.GradientTransformation:
    """A transform of a user's own whose per-param state is a dict (of ``kind``), not a
    NamedTuple."""

    def init(params):
        return kind(
            hyperparams=hyperparams(params, momentum=0.9),
            buf=optree.tree_map(torch.zeros_like, params),
        )

    def update(updates, state, params):
        beta = state["hyperparams"]["momentum"].float()
        buf = optree.tree_map(lambda b, g: beta * b + g, state["buf"], updates)
        return buf, kind(state, buf=buf)

    return fp16fx.chain(fp16fx.transforms.GradientTransformation(init, update), fp16fx.sgd(0.1))


@pytest.mark.parametrize("kind", [dict, collections.OrderedDict])
@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_moments_a_transform_keeps_in_a_dict_are_stored_compact(moments, kind):
    """Before, only NamedTuple states' moments were: a dict's stayed FP32, silently."""
    source = tail_state("compensated", moments, optimizer=_momentum_kept_in_a_dict(kind))
    for i in range(3):
        source, _ = fp16fx.step(source, scaled_grads(source, 10 + i))
    buf = source.opt_state[0]["buf"][0]
    assert isinstance(buf, Quantized) if moments == "int8" else buf.dtype == torch.bfloat16
    target = tail_state("compensated", moments, seed=9, optimizer=_momentum_kept_in_a_dict(kind))
    target = fp16fx.load_state_dict(target, save_and_load(fp16fx.state_dict(source)))
    assert differing(stored(source), stored(target)) == []


def test_a_dict_spliced_from_two_checkpoints_loads_each_leaf_by_its_own_int8_scales():
    """c's entry from another run: c shares an int8 block with b and one with w, and each
    saved that block's scale as its own codes need. One scale cannot decode both, so the
    load encodes the decoded values anew (it copied the codes as stored, the last leaf's
    scale overwriting each shared one: b's and c's moments loaded up to 12% off, silently)."""
    spliced = fp16fx.checkpoint.state_dict_copy(_trained("compensated", "int8"))
    other = tail_state("compensated", "int8")
    for i in range(3):  # other grads: other moments
        other, _ = fp16fx.step(other, scaled_grads(other, 50 + i))
    spliced["params"]["c"] = fp16fx.checkpoint.state_dict_copy(other)["params"]["c"]
    decoded = fp16fx.load_state_dict(tail_state("compensated", "fp32", seed=9), spliced)
    target = fp16fx.load_state_dict(tail_state("compensated", "int8", seed=9), spliced)
    compact = only_moments(target)
    for name, x in only_moments(decoded).items():
        q = encode_moment(x, "int8", name.endswith("nu"), BLOCK, None)
        assert same_bits(compact[name].codes[: x.numel()], q.codes), name
        assert same_bits(compact[name].scales, q.scales), name


def test_a_checkpoint_cut_where_step_counts_are_equal_again_round_trips_bitwise():
    """A param without a gradient gets a segment of its own; int8 blocks restart there. When
    the step counts that cut the state become equal again, the saved blocks' offsets still
    place the cut (before, the load re-blocked those moments)."""
    state = tail_state("compensated", "int8")
    for i, missing in enumerate([("w",), ("b", "c"), ()]):
        grads = scaled_grads(state, 20 + i)
        state, _ = fp16fx.step(state, {k: None if k in missing else g for k, g in grads.items()})
    counts = {e["opt[1].count"].item() for e in fp16fx.state_dict(state)["params"].values()}
    # Equal counts; the leaves sit as b, c, w (sorted keys): w, at 720, starts a block.
    assert counts == {2} and state.layout.cuts == ((0, 2, 3),)
    target = fp16fx.load_state_dict(
        tail_state("compensated", "int8", seed=9), save_and_load(fp16fx.state_dict(state))
    )
    assert differing(stored(state), stored(target)) == []
    grads = scaled_grads(state, 99)
    a, _ = fp16fx.step(state, grads)
    b, _ = fp16fx.step(target, grads)
    assert differing(stored(a), stored(b)) == []


def test_a_full_checkpoint_loads_into_a_compact_state_rounded_to_nearest():
    """Each param loads as saved wherever the correction reaches the master from it (the
    rest rounds to -128..127 units), else as the next FP16 value up (the rest rounds to 128:
    one more than an int8 holds); the correction is the rest from the loaded param,
    rounded to nearest. int8 moments are encoded to nearest (second moments up), block by
    block from the segment's start."""
    source = _trained("fp32", "fp32")
    target = fp16fx.load_state_dict(
        tail_state("compensated", "int8", seed=9), save_and_load(fp16fx.state_dict(source))
    )
    corrections = fp16fx.state_dict(target)["params"]
    for path, master in source.master.items():
        saved, p = source.params[path], target.params[path]
        reaches = torch.round((master.double() - saved.double()) / unit(saved)) <= 127
        assert same_bits(p[reaches], saved[reaches]), path
        assert same_bits(p[~reaches], next_up(saved[~reaches])), path
        rest = (master.double() - p.double()) / unit(p)
        assert torch.equal(corrections[path]["correction"].double(), torch.round(rest)), path
        err = (target.master[path].double() - master.double()).abs()
        assert (err <= 0.5 * unit(p) + ulp32(master)).all(), path
    full, compact = only_moments(source), only_moments(target)
    assert full.keys() == compact.keys() == {"[1].mu", "[1].nu"}
    for name, x in full.items():
        q = encode_moment(x, "int8", name.endswith("nu"), BLOCK, None)
        codes, padding = compact[name].codes.split([x.numel(), -x.numel() % BLOCK])
        assert same_bits(codes, q.codes) and not padding.any(), name
        assert same_bits(compact[name].scales, q.scales), name
    assert target.count.item() == source.count.item() == 3


@pytest.mark.parametrize("master", ["fp32", "compensated"])
def test_a_checkpoint_cut_by_step_counts_loads_into_int8_blocks_that_run_into_the_padding(
    master,
):
    """Saved with different step counts, a and b get segments of their own; b's, from value
    200 (not a block's start), also holds the bucket's padding, 600 to 768, which its blocks
    cover: 3 blocks over 400 values. The load encoded b's values alone (2 blocks) and raised
    a bare RuntimeError, its params already written."""

    def params():
        g = torch.Generator().manual_seed(0)
        return {
            "a": torch.randn(200, generator=g).half(),
            "b": torch.randn(400, generator=g).half(),
        }

    source = fp16fx.init(params(), adam(), POLICY)
    grad = torch.randn(200, generator=torch.Generator().manual_seed(1)).half()
    source, _ = fp16fx.step(source, {"a": grad * 256, "b": None})
    target = fp16fx.init(params(), adam(), POLICY, buckets=True, master=master, moments="int8")
    target = fp16fx.load_state_dict(target, save_and_load(fp16fx.state_dict(source)))
    assert target.layout.cuts == ((0, 1, 2),)  # a | b
    saved, loaded = fp16fx.state_dict(source)["params"], fp16fx.state_dict(target)["params"]
    for path in ("a", "b"):
        for name in ("mu", "nu"):
            q = encode_moment(saved[path][f"opt[1].{name}"], "int8", name == "nu", BLOCK, None)
            assert same_bits(loaded[path][f"opt[1].{name}.codes"], q.codes), (path, name)
            assert same_bits(loaded[path][f"opt[1].{name}.scales"], q.scales), (path, name)


def test_a_compensated_state_comes_back_as_stored_through_fp32_terms():
    """FP32 terms (FSDP2's DCP dict) keep each stored param, which its master need not round
    to: a param written in place (a clamp) keeps its old correction. Encoded again from it,
    every pair comes back as stored (rounding the param from its master moved 82 of 512)."""
    state = _trained("compensated", "fp32")
    with torch.no_grad():
        for p in state.params.values():
            p.clamp_(-0.5, 0.5)
    saved = save_and_load(fp16fx.state_dict(state))
    in_fp32_terms = {
        **saved,
        "precision": precision_dict(Precision()),
        "params": {k: canonical(e, BLOCK) for k, e in saved["params"].items()},
    }
    target = fp16fx.load_state_dict(tail_state("compensated", "fp32", seed=9), in_fp32_terms)
    assert differing(stored(state), stored(target)) == []


def test_a_midpoint_pair_loads_into_fp32_masters_as_its_masters_rounding():
    """A correction of -128 puts the master at the midpoint below its param: a tie, which
    rounding to nearest-even settles on the other neighbour for an odd param (1.000977 goes
    to 1.0, -1.000977 to -1.001953; -1.999023 to -2.0, a power of two whose unit is twice
    its own: encoding from it gives another pair, (-2.0, 64), for the same master, so only
    the stored param gives the pair back). Loaded as stored, the next step took the param
    for a written one and dropped the master by half an ulp. A param written in place (0.5,
    over a correction made for another) loads as written, and is adopted."""
    values = [1.0009765625, -1.9990234375, -1.0009765625, 0.5]  # odd, odd, odd, written
    params = {"w": torch.tensor(values, dtype=torch.float16)}
    state = fp16fx.init(params, fp16fx.sgd(0.0), POLICY, master="compensated")
    fp16fx.state_dict(state)["params"]["w"]["correction"].fill_(-128)
    master = state.master["w"].clone()
    sd = save_and_load(fp16fx.state_dict(state))
    full = fp16fx.init({"w": torch.zeros(4).half()}, fp16fx.sgd(0.0), POLICY)
    full = fp16fx.load_state_dict(full, sd)
    assert full.params["w"].tolist() == [1.0, -2.0, -1.001953125, 0.5]  # the even neighbours
    stepped, _ = fp16fx.step(full, {"w": torch.zeros(4).half()})
    assert same_bits(stepped.master["w"][:3], master[:3])  # kept: the decoded masters
    assert stepped.master["w"][3].item() == 0.5  # adopted: the written param


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_full_checkpoint_loads_a_param_written_at_a_tie_as_written(dtype):
    """A full run's master sits on a midpoint, and its param was written to the odd
    neighbour since (a clamp): as near, but not the rounding. Loaded into a full state the
    param is the written one, and the next step adopts it, as the run that never stopped."""
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    state = fp16fx.init({"w": torch.ones(2, dtype=dtype)}, fp16fx.sgd(0.0), POLICY)
    with torch.no_grad():
        state.master["w"].fill_(1 + ulp / 2)  # rounds to 1.0 (even)
        state.params["w"].fill_(1 + ulp)  # written: as near, odd
    loaded = fp16fx.load_state_dict(
        fp16fx.init({"w": torch.zeros(2, dtype=dtype)}, fp16fx.sgd(0.0), POLICY),
        save_and_load(fp16fx.state_dict(state)),
    )
    assert loaded.params["w"].tolist() == [1 + ulp] * 2
    grads = {"w": torch.zeros(2, dtype=dtype)}
    (a, _), (b, _) = fp16fx.step(state, grads), fp16fx.step(loaded, grads)
    assert same_bits(a.master["w"], b.master["w"]) and a.master["w"].tolist() == [1 + ulp] * 2


def test_a_compact_checkpoint_loads_into_a_full_state_as_its_decoded_values():
    """The masters load exactly, and each param is its master rounded, as in any full state:
    a pair whose correction is -128 decodes to the midpoint below its param, which rounds to
    the lower neighbour of an odd param. (The param was loaded as saved: the next step took
    it for one written since, and dropped the master.) Steps make such pairs now and then;
    here every fifth value of a param that is no power of two is one (over a power of two,
    -128 units reach the FP16 value below: only a param written in place has it)."""
    sd = save_and_load(fp16fx.state_dict(_trained("compensated", "int8")))
    for entry in sd["params"].values():
        param, correction = entry["param"].view(-1), entry["correction"].view(-1)
        every_fifth = torch.arange(len(param)) % 5 == 0
        no_power_of_two = (param.view(torch.int16) & 0x3FF) != 0
        correction[every_fifth & no_power_of_two] = -128
    source = fp16fx.load_state_dict(tail_state("compensated", "int8", seed=3), sd)
    target = fp16fx.load_state_dict(tail_state("fp32", "fp32", seed=9), save_and_load(sd))
    moved = 0
    for path in source.params:
        assert same_bits(target.master[path], source.master[path]), path  # decoded
        assert same_bits(target.params[path], source.master[path].half()), path
        moved += int((target.params[path] != source.params[path]).sum())
    assert moved > 0  # midpoints below odd params: one FP16 ulp down
    stepped, _ = fp16fx.step(fp16fx.set_hyperparams(target, lr=0.0), scaled_grads(target, 7))
    assert all(same_bits(stepped.master[path], source.master[path]) for path in source.params)
    compact, full = only_moments(source), only_moments(target)
    for name, q in compact.items():
        decoded = decode_moment(q, name.endswith("nu"), BLOCK)  # and the bucket's padding
        assert same_bits(full[name], decoded[: full[name].numel()]), name


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_a_0d_params_short_moments_load_into_full_ones(moments):
    """A 0-d param's moments are 0-d: they were read as step counts, and BF16 ones stayed
    BF16 (the load refused them: "has dtype torch.bfloat16, this state's torch.float32")."""

    def state(moments: str):
        params = {"s": torch.tensor(0.5).half(), "w": tail_params(0)["w"]}
        return fp16fx.init(params, adam(), POLICY, buckets=True, moments=moments)

    source = state(moments)
    for i in range(2):
        source, _ = fp16fx.step(source, scaled_grads(source, i))
    target = fp16fx.load_state_dict(state("fp32"), save_and_load(fp16fx.state_dict(source)))
    saved = fp16fx.state_dict(source)["params"]["s"]
    for name in ("opt[1].mu", "opt[1].nu"):
        key = name if moments == "bf16" else f"{name}.codes"
        loaded = fp16fx.state_dict(target)["params"]["s"][name]
        assert saved[key].ndim == 0 and loaded.dtype == torch.float32
        if moments == "bf16":
            assert same_bits(loaded, saved[key].float())


@pytest.mark.parametrize("shape", [(), (4,)], ids=["0-d", "1-d"])
def test_a_moment_of_a_dtype_no_state_stores_is_refused_whatever_its_params_shape(shape):
    # A 0-d param's moments are 0-d: not dtype-checked, a float64 one loaded cast to FP32.
    def state():
        return fp16fx.init({"w": torch.ones(shape).half()}, adam(), POLICY)

    source, _ = fp16fx.step(state(), {"w": torch.ones(shape).half()})
    sd = save_and_load(fp16fx.state_dict(source))
    sd["params"]["w"]["opt[1].mu"] = sd["params"]["w"]["opt[1].mu"].double()
    target = state()
    before = stored(target)
    with pytest.raises(StateDictError, match=r"\['opt\[1\].mu'\] has dtype torch.float64"):
        fp16fx.load_state_dict(target, sd)
    assert differing(before, stored(target)) == []


def _state_over(dtype: torch.dtype, master: str, moments: str):
    params = {k: v.to(dtype) for k, v in tail_params(9).items()}
    return fp16fx.init(params, adam(), POLICY, buckets=True, master=master, moments=moments)


@pytest.mark.parametrize(
    ("saved_in", "loaded_in"),
    [
        (torch.float16, torch.bfloat16),
        (torch.float16, torch.float32),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.float16),
    ],
    ids=["fp16-bf16", "fp16-fp32", "fp32-fp16", "bf16-fp16"],
)
def test_a_checkpoint_loads_over_params_of_another_dtype_keeping_every_master(saved_in, loaded_in):
    """The model's dtype changed since the save: each param's FP32 master (an FP32 param is
    its own) loads as it was into an FP32 master, and the param is it rounded to nearest; a
    compensated master is within half a unit of it. The moments load as saved."""
    source = _state_over(saved_in, "fp32", "fp32")
    for i in range(3):
        source, _ = fp16fx.step(source, scaled_grads(source, 10 + i))
    sd = save_and_load(fp16fx.state_dict(source))
    masters = source.params if saved_in == torch.float32 else source.master
    full = fp16fx.load_state_dict(_state_over(loaded_in, "fp32", "fp32"), sd)
    for path, master in masters.items():
        assert same_bits(full.params[path], master.to(loaded_in)), path
        if loaded_in != torch.float32:
            assert same_bits(full.master[path], master), path
    assert only_moments(full).keys() == only_moments(source).keys()
    for name, moment in only_moments(source).items():
        assert same_bits(only_moments(full)[name], moment), name
    if loaded_in != torch.float32:
        compact = fp16fx.load_state_dict(_state_over(loaded_in, "compensated", "fp32"), sd)
        for path, master in masters.items():
            p = compact.params[path]
            err = (compact.master[path].double() - master.double()).abs()
            assert (err <= 0.5 * unit(p) + ulp32(master)).all(), path
    # The bytes as saved: the same dict loads into a state over the saved dtype bitwise.
    again = fp16fx.load_state_dict(_state_over(saved_in, "fp32", "fp32"), sd)
    assert differing(stored(source), stored(again)) == []


@pytest.mark.parametrize(
    ("saved_in", "key"), [(torch.bfloat16, "master"), (torch.float32, "param")]
)
def test_a_master_past_the_new_dtypes_range_is_refused_by_name(saved_in, key):
    """A BF16 or FP32 master that FP16 cannot hold was once refused as "inf or NaN (saved from
    a run that diverged?)": the param it would round to is inf."""
    sd = save_and_load(fp16fx.state_dict(_state_over(saved_in, "fp32", "fp32")))
    entry = sd["params"]["w"]
    entry[key] = entry[key] + 1e5
    # The BF16 param its master rounded, as a run saves it (else it was written since, and
    # is the master: saved_format.master_of).
    entry["param"] = entry[key].to(saved_in)
    state = _state_over(torch.float16, "fp32", "fp32")
    before = stored(state)
    message = rf"\['params'\]\['w'\]\['{key}'\] holds values past torch.float16's largest"
    with pytest.raises(StateDictError, match=message):
        fp16fx.load_state_dict(state, sd)
    assert differing(before, stored(state)) == []


@pytest.mark.parametrize(
    ("saved_in", "master", "message"),
    [
        (torch.float16, lambda e: e["master"].half(), r"\['master'\] has dtype torch.float16"),
        (torch.bfloat16, lambda e: e["master"].long(), r"\['master'\] has dtype torch.int64"),
        (torch.float16, lambda e: e["master"][:-1], r"\['master'\] has shape \(29, 20\)"),
        (torch.bfloat16, lambda e: e["master"] / 0, r"\['master'\] holds inf or NaN"),
        (torch.float32, lambda e: e["param"].clone(), r"\['master'\] sits beside a"),
        (torch.float16, lambda e: None, r" lacks \['master'\]"),
    ],
    ids=["fp16", "int64", "short", "inf", "beside-fp32-param", "missing"],
)
def test_a_master_no_run_saves_is_refused_by_name_over_params_of_another_dtype(
    saved_in, master, message
):
    """Over params whose dtype changed, the saved master is what the new param is rounded
    from: one that is not FP32, not of its param's shape or not finite, one beside an FP32
    param (its own master), or none (``master`` gives None) beside an FP16 one, was once
    taken as it came (an FP16 master over BF16 params loaded its rounding) or blamed on the
    param."""
    sd = save_and_load(fp16fx.state_dict(_state_over(saved_in, "fp32", "fp32")))
    entry = sd["params"]["w"]
    entry["master"] = master(entry)
    if entry["master"] is None:
        del entry["master"]
    loaded_in = torch.bfloat16 if saved_in == torch.float16 else torch.float16
    state = _state_over(loaded_in, "fp32", "fp32")
    before = stored(state)
    with pytest.raises(StateDictError, match=rf"\['params'\]\['w'\]{message}"):
        fp16fx.load_state_dict(state, sd)
    assert differing(before, stored(state)) == []


def _clamped_state(master: str):
    """An FP16 state whose masters every format holds exactly (each param plus -63 to 63
    units of its correction: FP32 masters, compensated pairs, over BF16 params too), its
    params since clamped to [-0.5, 0.5] as a WGAN's critic is: ``(state, where written,
    the master its next step takes)`` -- the written value where a state of FP32 masters
    wrote, the written param over its old correction where a compensated one did."""
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(1000, generator=gen).half()
    c = torch.randint(-63, 64, (1000,), generator=gen)
    state = fp16fx.init({"w": p}, fp16fx.sgd(1e-2), POLICY, buckets=True, master=master)
    with torch.no_grad():
        if master == "compensated":
            fp16fx.state_dict(state)["params"]["w"]["correction"].copy_(c)
        else:
            state.master["w"].copy_(decode_master(p, c))
        written = state.params["w"].abs() > 0.5
        state.params["w"].clamp_(-0.5, 0.5)
    if master == "compensated":
        return state, written, decode_master(state.params["w"], c)
    return state, written, torch.where(written, state.params["w"].float(), state.master["w"])


@pytest.mark.parametrize(
    ("saved_in", "loaded_in", "dtype"),
    [
        (saved_in, loaded_in, dtype)
        for saved_in in MASTERS
        for loaded_in in MASTERS
        for dtype in (torch.float16, torch.bfloat16, torch.float32)
        if not (loaded_in == "compensated" and dtype == torch.float32)
    ],
    ids=lambda v: str(v).removeprefix("torch."),
)
def test_a_param_written_since_the_last_step_loads_as_written_in_every_conversion(
    saved_in, loaded_in, dtype
):
    """A param written since the last step (a clamp) is its master (``step.adopt_written``):
    loaded into any precision, over params of any dtype, it is the param, and the master
    the next step takes is the one the saving run's would take, exactly. From FP32 masters
    into a compensated state, or over params of another dtype, the load encoded the old
    master and dropped the write."""
    source, written, truth = _clamped_state(saved_in)
    sd = save_and_load(fp16fx.state_dict(source))
    target = fp16fx.init(
        {"w": torch.zeros(1000, dtype=dtype)},
        fp16fx.sgd(1e-2),
        POLICY,
        buckets=True,
        master=loaded_in,
    )
    target = fp16fx.load_state_dict(target, sd)
    assert same_bits(target.params["w"][written], truth[written].to(dtype))
    target, _ = fp16fx.step(target, {"w": torch.zeros(1000, dtype=dtype)})  # moves nothing
    assert same_bits(target.params["w"][written], truth[written].to(dtype))
    master = target.params["w"] if dtype == torch.float32 else target.master["w"]
    assert same_bits(master, truth)


@pytest.mark.parametrize("loaded_in", MASTERS)
@pytest.mark.parametrize(
    ("master", "fault"),
    [
        (lambda m: m.index_fill(0, torch.tensor([7]), math.inf), "holds inf or NaN"),
        (lambda m: m.index_fill(0, torch.tensor([7]), math.nan), "holds inf or NaN"),
        (lambda m: m[:1], "has shape (1,)"),
        (lambda m: m.half(), "has dtype torch.float16"),
    ],
    ids=["inf", "nan", "shape", "dtype"],
)
def test_a_master_no_run_saves_is_refused_not_taken_for_a_written_param(loaded_in, master, fault):
    """No param rounds to an inf or NaN master, and no run saves one of another shape or
    dtype: converted, such a master was taken for a written param's and replaced by the
    param (broadcast, promoted), loading a dict no run saves (FSDP2's DCP dicts convert)."""
    source, _, _ = _clamped_state("fp32")
    sd = save_and_load(fp16fx.state_dict(source))
    sd["params"]["w"]["master"] = master(sd["params"]["w"]["master"])
    target = _clamped_state(loaded_in)[0]
    before = stored(target)
    with pytest.raises(StateDictError, match=re.escape(f"['params']['w']['master'] {fault}")):
        fp16fx.load_state_dict(target, sd)
    assert differing(before, stored(target)) == []


# -- 9. memory -------------------------------------------------------------------------------

MILLION = 1 << 20


@pytest.mark.parametrize(
    ("master", "moments", "expected"),
    [
        ("fp32", "fp32", 16.0),  # param 2 + grad 2 + master 4 + moments 4 + 4
        ("compensated", "fp32", 13.0),  # correction 1
        ("compensated", "bf16", 9.0),  # moments 2 + 2
        ("compensated", "int8", 7.03125),  # moments 1 + 1, and a 4-byte scale per 256 each
        ("fp32", "int8", 10.03125),  # master 4, moments as above
    ],
)
def test_persistent_bytes_per_param_for_adam(master, moments, expected):
    params = {"w": torch.zeros(1024, 1000).half(), "b": torch.zeros(MILLION - 1024000).half()}
    state = fp16fx.init(params, adam(), buckets=True, master=master, moments=moments)
    per_param = persistent_bytes(state, fp16fx.grad_buffers(state)) / MILLION
    assert per_param == pytest.approx(expected, abs=0.005)
    if master == "compensated" and moments == "int8":
        assert per_param <= 7.2  # issue 13, "What must hold" 3


def test_a_compensated_states_masters_are_read_as_they_are_now():
    """``state.master`` of a compensated state was decoded once and cached on the state
    object, which in-place steps and loads keep: it went on showing the first read."""
    state = tail_state("compensated", "int8")
    step = StepFunction(inplace=True, compile_options=None)  # the core, eagerly, in place
    first = {k: v.clone() for k, v in state.master.items()}
    state, _ = step(state, scaled_grads(state, 1))
    fresh = state.replace()  # a new state object over the same tensors: nothing cached
    assert all(torch.equal(state.master[k], fresh.master[k]) for k in first)
    assert not all(torch.equal(state.master[k], first[k]) for k in first)
