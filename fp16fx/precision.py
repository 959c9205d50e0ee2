"""Compact precision: how the masters and the optimizer's moments are stored between steps.

Layer: ``step`` (docs/design.md). The optimizer computes in FP32 either way; this module only
decodes the stored state into FP32 before the update and encodes the results after it, inside
the same fused pass. docs/precision.md gives the formats' error bounds and measurements.

Masters (``Precision.master``):

* ``"fp32"``: an FP32 master beside each FP16/BF16 param (4 bytes).
* ``"compensated"``: no FP32 copy. The param ``p`` plus a short integer correction ``c`` carry
  the master: ``master = p + c * q(p)``, ``q(p) = ulp(p) / 2**k`` -- an int8 correction
  (k = 8: 1 byte) for FP16 params, an int16 one (k = 16) for BF16 params, whose 8-bit
  significand needs 16 more bits to match FP32's 24. ``p`` is the master rounded to nearest, as
  with an FP32 master; ``c`` is the rest, rounded *stochastically*: an update far below half an
  ulp (1e-5 on a weight of 1.0) would otherwise round the same way every step, and a
  short correction would bias every step alike. The dither is a hash of the element's place
  (its flat bucket and index there) and the step count: deterministic, the same eager and
  compiled, and the same for a value however the state is cut into segments or sharded.
  Small weights lose nothing: ``q`` follows the param's exponent, down into FP16's
  subnormals.

Moments (``Precision.moments``), every per-element FP32 tensor of the optimizer's state:

* ``"fp32"``: 4 bytes each.
* ``"bf16"``: 2 bytes, rounded stochastically (a second moment decaying by 0.999 a step would
  otherwise stagnate in BF16's 8 bits).
* ``"int8"``: 1 byte, plus an FP32 scale per block of ``block`` values: signed moments (Adam's
  ``mu``, SGD's momentum) as ``scale * sign(c) * (c/127)**2`` (square-root companding keeps
  small values), rounded stochastically; non-negative ones (Adam's ``nu``, a transform state
  lists them in its ``non_negative`` attribute) as ``scale * (c/255)**4``, rounded
  stochastically too (a second moment decaying by 0.999 a step moves its fourth root far
  less than a code: rounded one way it would never decay), a positive value to code 1 at
  least, so that no update is divided by zero. ``scale`` is the block's largest magnitude.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch._dynamo
import torch._inductor.config

from fp16fx.segments import MASKED, Segments
from fp16fx.transforms.base import Hyperparams

MASTERS = ("fp32", "compensated")
MOMENTS = ("fp32", "bf16", "int8")

#: The correction's integer dtype and its bits below the param's ulp, per param dtype.
_CORRECTION = {torch.float16: (torch.int8, 8), torch.bfloat16: (torch.int16, 16)}


@dataclasses.dataclass(frozen=True)
class Precision:
    """How a state stores its masters and moments (static metadata of the state).

    Attributes:
      master: ``"fp32"`` or ``"compensated"`` (see the module docstring).
      moments: ``"fp32"``, ``"bf16"`` or ``"int8"``.
      block: values per scale of ``"int8"`` moments.
    """

    master: str = "fp32"
    moments: str = "fp32"
    block: int = 256

    def __post_init__(self) -> None:
        if self.master not in MASTERS:
            raise ValueError(f"master must be one of {MASTERS}, got {self.master!r}")
        if self.moments not in MOMENTS:
            raise ValueError(f"moments must be one of {MOMENTS}, got {self.moments!r}")
        positive = isinstance(self.block, int) and self.block >= 1
        if not (positive and self.block & (self.block - 1) == 0):
            raise ValueError(f"block must be a power of two, got {self.block!r}")

    @property
    def compensated(self) -> bool:
        return self.master == "compensated"

    @property
    def multiple(self) -> int:
        """The multiple of values that flat buffers are padded to: whole blocks of int8
        moments (so that the state over them is whole blocks), else 1."""
        return self.block if self.moments == "int8" else 1


# -- the dither ------------------------------------------------------------------------------


def hash_bits(numel: int, salt: int, count: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Returns ``numel`` pseudo-random 32-bit values (int64) hashed from (index, ``salt``,
    ``count``) for the indices ``start, start + 1, ...``: a multiply-xorshift finaliser,
    every product below 2**63 (for indices below 2**31). The same values eager and compiled,
    different for every index, salt and count; the step hashes a value's place (its bucket
    as the salt, its index in the bucket's whole buffer) and its applied-step count. The
    stochastic roundings of a step draw from them (:func:`master_noise`: the low byte;
    :func:`moment_noise`: the high half, then halves of the value hashed again)."""
    x = torch.arange(start, start + numel, dtype=torch.int64, device=count.device) & 0xFFFFFFFF
    x = (x * 0x9E3779B1 + (salt * 0x27D4EB2F + count * 0x165667B1)) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
    return x ^ (x >> 13)


def master_noise(bits: torch.Tensor) -> torch.Tensor:
    """Returns the dither of a compensated master: the low byte of :func:`hash_bits`' ``bits``
    as (byte + 1/2) / 256, a value in (0, 1). A correction's unit is 1/256 of an FP16 ulp
    (1/65536 of a BF16 one) already: a finer dither would round its rest more finely than
    the update's own FP32 rounding."""
    return _dither(bits, 0, 8)


def moment_noise(bits: torch.Tensor, i: int) -> torch.Tensor:
    """Returns the dither of the ``i``-th short moment of a segment, 16 bits of the step's
    hash as (k + 1/2) / 65536: the first moment's from the high half of ``bits`` (above the
    master's byte), each next two the halves of ``bits`` hashed once more.

    Sixteen bits, not eight: stochastic rounding moves a value up with probability ``f``,
    its place between two codes, as drawn on the dither's grid: a change below half a step
    of that grid is never applied. Adam's second moment decaying by beta2 = 0.9999 a step
    moves 1/10,000 of its value, at code 78 1/512 of the way to the next code down: with one
    byte, every lower code froze (and rose with its block's scale)."""
    if i == 0:
        return _dither(bits, 16, 16)
    mixed = bits
    for _ in range((i + 1) // 2):  # a bijection of 32 bits: (1, 2) once, (3, 4) twice...
        mixed = ((mixed ^ (mixed >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        mixed = mixed ^ (mixed >> 16)
    return _dither(mixed, 16 * ((i - 1) % 2), 16)


def _dither(bits: torch.Tensor, shift: int, width: int) -> torch.Tensor:
    """Returns bits ``shift .. shift + width`` of ``bits`` as (k + 1/2) / 2**width (exact in
    FP32 for ``width`` up to 23)."""
    return (((bits >> shift) & ((1 << width) - 1)).float() + 0.5) * (1.0 / (1 << width))


# -- masters ---------------------------------------------------------------------------------


def correction_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """Returns the dtype of a compensated param's correction."""
    return _CORRECTION[param_dtype][0]


#: Per param dtype: the exponent field (FP32's) of the smallest ``|p|`` whose unit follows its
#: exponent, and the correction's bits below the param's last one plus the param's own.
_UNIT_EXPONENT = {torch.float16: (127 - 14, 8 + 10), torch.bfloat16: (1 + 23, 16 + 7)}


def _unit(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(unit, 1 / unit)`` of params ``p``: ``ulp(p) / 2**k`` (FP32, a power of two,
    read from ``p``'s exponent bits), the correction's step.

    FP16 subnormals and zero take the unit of the smallest normal (their ulp is the same);
    BF16 values below ``2**-103`` take ``2**-126``. A power of two makes ``p + c * unit``
    exact in FP32 and the division a multiplication.
    """
    lowest, shift = _UNIT_EXPONENT[p.dtype]
    exponent = torch.clamp((p.float().view(torch.int32) >> 23) & 0xFF, min=lowest) - shift
    unit = (exponent << 23).view(torch.float32)
    return unit, ((254 - exponent) << 23).view(torch.float32)


def decode_master(p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Returns the FP32 master ``p + c * unit(p)`` of a compensated param (exact)."""
    return p.float() + c.float() * _unit(p)[0]


def decode_to_step(p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Returns :func:`decode_master`'s master for a step to update: the same, but where a
    param written in place to FP16's (BF16's) lowest value kept a correction of ``-top``
    from before, one unit short of it, as :func:`split_master` stores every master there.
    (Decoded as it is, that pair is the midpoint to -inf: a step, even a zero one, would
    round the param to -inf, where an FP32 master adopts the written value.)"""
    return decode_master(p, torch.maximum(c.float(), _lowest_correction(p.float(), p.dtype)))


def _lowest_correction(p32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Returns the least correction a master over params ``p32`` may store: ``-top``, but
    ``1 - top`` at ``dtype``'s lowest value, where ``-top`` units decode to the midpoint to
    -inf, which rounds to -inf (the correction stops a unit short there, as it does below
    the midpoint to +inf at the largest value)."""
    top = 2 ** (_CORRECTION[dtype][1] - 1)
    return torch.where(p32 == -torch.finfo(dtype).max, 1.0 - top, float(-top))


def encode_master(
    master: torch.Tensor,
    dtype: torch.dtype,
    noise: torch.Tensor | None,
    param: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(p, c)`` of :func:`split_master`, stored: ``p`` in ``dtype``, ``c`` in the
    correction's integer dtype."""
    p, c = split_master(master, dtype, noise, param)
    return p.to(dtype), c.to(correction_dtype(dtype))


def split_master(
    master: torch.Tensor,
    dtype: torch.dtype,
    noise: torch.Tensor | None,
    param: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(p, c)`` as FP32 tensors whose values ``dtype`` and the correction's dtype
    hold exactly: ``p`` the master rounded to nearest in ``dtype``, ``c`` the rest in units
    of ``unit(p)``, rounded down after adding ``noise`` in (0, 1) (stochastic rounding), or
    to nearest without it. (In FP32 so that a step chooses between them and the old values
    before the one cast into storage.)

    The rest lies within half an ulp of ``p``: ``[-2**(k-1), 2**(k-1)]`` units. Where it
    rounds to ``2**(k-1)``, one more than the correction holds (the master within a unit
    below the midpoint above a power of two, or above an FP16 subnormal), ``p`` is the next
    value up and ``c`` the rest from there (otherwise such a master would stay put forever).

    ``param``: a value of ``p`` to keep wherever the correction can reach the master from it,
    ``-2**(k-1)`` to ``2**(k-1) - 1`` units (a checkpoint's own param: loading its ``(param,
    master)`` then restores ``(p, c)`` exactly, although the master decoded from them need
    not round to ``p``)."""
    top = 2 ** (_CORRECTION[dtype][1] - 1)
    p = master.to(dtype)
    if param is not None:
        p = torch.where(reaches(param, master), param.to(dtype), p)
    unit, per_unit = _unit(p)
    p32 = p.float()
    rest = (master - p32) * per_unit
    c = torch.floor(rest + noise) if noise is not None else torch.round(rest)
    # The rest is at most ``top`` units, so the bump is from c == top: to ``up``, the next
    # value (exact in FP32; finite unless p is the largest), whose rest is -top units of p's:
    # -top of its own, or -top / 2 where ``up`` is a power of two, its unit twice p's.
    bump = (c >= top) & (p32 < torch.finfo(dtype).max)
    # Negated twice so that the step up from -2**-24 (FP16) lands on -0, IEEE's next value up
    # (``p32 + 2 * top * unit`` would give +0; either zero decodes alike).
    up = -(-p32 - 2 * top * unit)
    doubled = up * per_unit == 2.0 ** (_UNIT_EXPONENT[dtype][1] + 1)
    c = torch.where(bump, torch.where(doubled, -top / 2, float(-top)), c)
    p32 = torch.where(bump, up, p32)
    return p32, torch.clamp(torch.maximum(c, _lowest_correction(p32, dtype)), max=top - 1)


def reaches(param: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """Returns where a correction can carry FP16/BF16 ``param`` to FP32 ``master``: it holds
    ``-2**(k-1)`` to ``2**(k-1) - 1`` units of ``param``'s (:func:`split_master`)."""
    top = 2 ** (_CORRECTION[param.dtype][1] - 1)
    rest, unit = master - param.float(), _unit(param)[0]
    return (rest >= -top * unit) & (rest <= (top - 1) * unit)


def require_rounding_casts() -> None:
    """Refuses to be traced by ``torch.compile`` unless Inductor keeps FP16/BF16 rounding.

    Called by code whose FP32 arithmetic reads rounded values: the check that a param is its
    master rounded (``p != m.to(p.dtype)``: ``step.adopt_written``, in the step and the facade) and
    the rest of a compensated master (``master - master.to(dtype)``). Inductor's default
    fuses such a cast away and computes on in FP32: the check then fails for every param,
    each master restarts from its FP16 param every step, and an update below half an ulp is
    lost as if there were no master (a compensated master's correction stays zero).
    ``fp16fx.compile_step`` compiles with ``emulate_precision_casts`` on
    (``fp16fx/compile.py``); a ``torch.compile`` of one's own around ``fp16fx.step`` or
    ``FP16_Optimizer.step`` must turn it on too.
    """
    if torch.compiler.is_compiling() and not torch._inductor.config.emulate_precision_casts:
        _refuse_compiling_without_rounding()


@torch._dynamo.disable
def _refuse_compiling_without_rounding() -> None:
    # Run, not traced: an exception raised while tracing makes Dynamo run the frame eagerly
    # instead, silently; a Dynamo-disabled call is a graph break that raises when it runs.
    raise RuntimeError(
        "fp16fx's step is being compiled by torch.compile with Inductor's default numerics, "
        "which fuse away the FP16/BF16 rounding the step relies on: every master would "
        "restart from its FP16 param each step. Set "
        "torch._inductor.config.emulate_precision_casts = True before compiling "
        "(fp16fx.compile_step does, for the regions it compiles)"
    )


# -- moments ---------------------------------------------------------------------------------


#: The scale of an int8 block of zeros (or of FP32 subnormals): the smallest normal, since
#: decoding multiplies by the scale stored, and it must be the one divided by.
ZERO_BLOCK_SCALE = torch.finfo(torch.float32).tiny
_FP32_MAX = torch.finfo(torch.float32).max


class Quantized(NamedTuple):
    """An int8 moment: one code per value and an FP32 scale per block of values."""

    codes: torch.Tensor
    scales: torch.Tensor


def _block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Returns the largest ``|x|`` of every block of ``block`` values of ``x`` (1-D), the last
    block possibly shorter. (Whole blocks as rows and the tail on its own: padding ``x`` to
    whole blocks makes Inductor read past the tail.)"""
    whole = x.numel() // block * block
    amax = x[:whole].view(-1, block).abs().amax(dim=1)
    if whole == x.numel():
        return amax
    return torch.cat([amax, x[whole:].abs().amax().view(1)])


def _per_value(scales: torch.Tensor, numel: int, block: int) -> torch.Tensor:
    """Returns each value's block scale: broadcast over whole blocks, gathered by
    ``index >> log2(block)`` where the last block is short. (A broadcast is one load per
    block; but with a short block, Inductor (torch 2.14, CPU) turns it into a loop over
    ``(numel // block, block)`` that never computes the last ``numel % block`` values:
    docs/precision.md, "Speed".)"""
    if numel % block == 0:
        return scales[:, None].expand(-1, block).reshape(-1)
    return scales[torch.arange(numel, device=scales.device) >> (block.bit_length() - 1)]


def encode_moment(
    x: torch.Tensor, how: str, non_negative: bool, block: int, noise: torch.Tensor | None
) -> Any:
    """Returns an FP32 moment ``x`` (1-D) stored as ``how`` (see the module docstring): what
    :func:`round_moment` returns, cast into the storage dtype."""
    rounded = round_moment(x, how, non_negative, block, noise)
    if isinstance(rounded, Quantized):
        codes = rounded.codes.to(torch.uint8 if non_negative else torch.int8)
        return Quantized(codes, rounded.scales)
    return rounded.to(torch.bfloat16) if how == "bf16" else rounded


def round_moment(
    x: torch.Tensor, how: str, non_negative: bool, block: int, noise: torch.Tensor | None
) -> Any:
    """Returns a moment ``x`` (1-D) rounded as ``how`` stores it, in FP32 (BF16 values, or
    int8 codes beside their scales), so that a step chooses between them and the old values
    before the one cast into storage. (A transform of one's own may keep its per-param
    state in another float dtype: FP32 holds FP16's and BF16's values, and FP64's as
    nearly as the compact format can.)"""
    if how == "fp32":
        return x
    x = x.float()
    if how == "bf16":
        if noise is None:
            return x.to(torch.bfloat16).float()
        # Stochastic rounding: add the dither below BF16's last bit, then truncate (IEEE floats
        # are sign and magnitude: this rounds the magnitude).
        bits = x.view(torch.int32) + (noise * 65536.0).to(torch.int32)
        return (bits & -65536).view(torch.float32)
    # An overflowed value (inf) keeps the largest finite scale and the top code (its y is
    # inf, which _round_code takes to the top): the block's other values stay finite.
    scales = torch.clamp(_block_amax(x, block), min=ZERO_BLOCK_SCALE, max=_FP32_MAX)
    n = x.numel()
    if _in_rows(x, block):
        y = x.view(-1, block) / scales[:, None]
        noise = None if noise is None else noise.view(-1, block)
    else:
        y = x / _per_value(scales, n, block)
    if non_negative:
        r = _round_code(y, 255.0, 4, noise)
        # A positive value keeps code 1 at least: it never decodes to zero.
        return Quantized(torch.maximum(r, (y > 0).float()).reshape(n), scales)
    r = torch.copysign(_round_code(torch.abs(y), 127.0, 2, noise), y)
    return Quantized(r.reshape(n), scales)


def _round_code(y: torch.Tensor, top: float, power: int, noise: torch.Tensor | None) -> Any:
    """Returns the code ``c`` in 0..``top`` of ``y`` in [0, 1] (or inf: ``top``) stored as
    ``(c / top) ** power``: to nearest in the companded domain without ``noise``; with it,
    ``floor(t)`` or the code above, ``t = top * y ** (1 / power)``, the upper one with the
    probability that makes the *decoded value* unbiased: ``(y - lo) / (hi - lo)`` of the two
    codes' values. (Rounding ``t`` itself stochastically is unbiased in the companded
    domain, and so biased upward in value: 2.5x at 1e-5 of the block's scale for a signed
    moment, and an average of such moments grew with every step.)"""
    t = top * (torch.sqrt(torch.sqrt(y)) if power == 4 else torch.sqrt(y))
    if noise is None:
        return torch.clamp(torch.round(t), 0, top)
    lo = torch.clamp(torch.floor(t), 0, top - 1)
    below, above = _expanded(lo / top, power), _expanded((lo + 1) / top, power)
    return lo + (noise * (above - below) < y - below).float()


def _expanded(t: torch.Tensor, power: int) -> torch.Tensor:
    """Returns ``t ** power`` for ``t`` >= 0 (``power`` 2 or 4), bitwise as decoding
    computes a code's value."""
    return torch.square(torch.square(t)) if power == 4 else torch.square(t)


#: The devices Inductor writes Triton for (NVIDIA and AMD GPUs, Intel's).
_TRITON_DEVICES = ("cuda", "xpu")


def as_rows(t: torch.Tensor, precision: Precision) -> torch.Tensor:
    """Returns a segment's per-value tensor ``t`` as rows of ``precision.block`` values where
    the step computes int8 blocks as rows (see :func:`_in_rows`), else ``t``: the step writes
    its new values through it."""
    if precision.moments == "int8" and _in_rows(t, precision.block):
        return t.view(-1, precision.block)
    return t


def _in_rows(t: torch.Tensor, block: int) -> bool:
    """Whether the step codes ``t``'s int8 blocks as rows ``(blocks, block)``: where ``t`` is
    whole blocks and Inductor writes Triton for its device (GPUs).

    The codes of a block can only be written once its largest new value is known. Coded as
    rows (:func:`round_moment`) and written as rows (:func:`as_rows`), the step's stores
    iterate like the block maximum, and Triton's persistent reduction takes the maximum and
    writes every new value in one kernel that reads each value once: 14 B/param for Adam with
    compensated masters, the roofline. Written flat, they run in a second kernel that reads
    every input again. Inductor's C++ code (CPUs) goes the other way on rows: it stores FP32
    temporaries, and the resnet18 int8 step took 3x as long (docs/precision.md, "Speed");
    there the values stay flat. The numbers are the same either way."""
    triton = t.device.type in _TRITON_DEVICES or (
        t.device.type == "cpu" and torch._inductor.config.cpu_backend == "triton"
    )
    return triton and t.ndim == 1 and t.numel() % block == 0


def decode_moment(stored: Any, non_negative: bool, block: int) -> torch.Tensor:
    """Returns the FP32 moment of what :func:`encode_moment` stored."""
    if isinstance(stored, Quantized):
        n = stored.codes.numel()
        scale = _per_value(stored.scales, n, block)
        if non_negative:
            return scale * _expanded(stored.codes.float() / 255.0, 4)
        c = stored.codes.float() / 127.0
        return scale * c * torch.abs(c)
    return stored.float()


# -- walking an optimizer's state ------------------------------------------------------------


def _is_moment(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, Quantized)) and (
        isinstance(value, Quantized) or (value.ndim == 1 and value.is_floating_point())
    )


def map_moments(fn: Callable[[Any, bool, int], Any], state: Any) -> Any:
    """Returns ``state`` with each per-element moment ``x`` of segment ``k`` (in NamedTuple
    states, tuples, lists and dicts) replaced by ``fn(x, non_negative, k)``;
    ``non_negative`` comes from the owning NamedTuple class's ``non_negative`` attribute (the
    names of its fields that are never negative)."""

    def visit(node: Any, non_negative: bool) -> Any:
        if isinstance(node, Segments):
            return Segments(
                [
                    fn(v, non_negative, k) if v is not MASKED and _is_moment(v) else v
                    for k, v in enumerate(node)
                ],
                node.labels,
            )
        if isinstance(node, tuple) and hasattr(node, "_fields"):  # a NamedTuple state
            marked = getattr(type(node), "non_negative", ())
            return type(node)(*(visit(getattr(node, f), f in marked) for f in node._fields))
        if isinstance(node, (tuple, list)):
            return type(node)(visit(child, False) for child in node)
        if isinstance(node, dict) and not isinstance(node, Hyperparams):
            out = copy.copy(node)  # its own kind of dict, an OrderedDict's order and all
            for key, child in node.items():
                out[key] = visit(child, False)
            return out
        return node

    return visit(state, False)


def encode_moments(opt_state: Any, precision: Precision) -> Any:
    """Returns an optimizer state's FP32 moments stored as ``precision.moments`` (rounded to
    nearest; the step itself rounds stochastically)."""
    if precision.moments == "fp32":
        return opt_state
    return map_moments(
        lambda x, non_negative, k: encode_moment(
            x, precision.moments, non_negative, precision.block, None
        ),
        opt_state,
    )


def decode_moments(opt_state: Any, precision: Precision) -> Any:
    """Returns an optimizer state with every stored moment decoded to FP32."""
    if precision.moments == "fp32":
        return opt_state
    return map_moments(
        lambda x, non_negative, k: decode_moment(x, non_negative, precision.block), opt_state
    )
