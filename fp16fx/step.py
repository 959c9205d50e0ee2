"""The mixed-precision step: a pure function of ``(state, grads)``.

Layer: ``step`` (docs/design.md). One step, over the segments that have a gradient::

    scaled grads g, scale s
    u, finite, norm = unscale_and_check(g, s)     # one reduction pass (+ consensus)
    updates, opt'   = optimizer.update(u, opt, master)   # FP32 math; clipping reads ``norm``
    master          = param where param != master rounded, else master   # a written param wins
    master'         = master + updates
    keep every old value where not finite         # torch.where: no host sync, exact skip
    param'          = master'.to(param.dtype)
    loss_scale'     = policy.adjust(loss_scale, finite)

:func:`apply_updates` is that math over flat tensors (what ``compile_step`` compiles);
:mod:`fp16fx.prepare` holds the host-side bookkeeping around it. Nothing is mutated; the
in-place variant (:func:`apply_updates_`) writes the same values into the state's own tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import optree
import torch

from fp16fx.consensus import Consensus
from fp16fx.precision import (
    Precision,
    Quantized,
    as_rows,
    decode_moments,
    decode_to_step,
    hash_bits,
    map_moments,
    master_noise,
    moment_noise,
    require_rounding_casts,
    round_moment,
    split_master,
)
from fp16fx.prepare import Trained, finish, prepare
from fp16fx.scaling import CheckedGrads, GradCheck, LossScalePolicy, unscale_and_check
from fp16fx.segments import Segments
from fp16fx.state import MixedPrecisionState, check_state
from fp16fx.transforms import (
    GradientTransformation,
    Hyperparams,
    read_hyperparams,
    replace_hyperparams,
    with_grad_norm,
)


class StepInfo(NamedTuple):
    """What a step reports, as 0-d tensors (nothing is synced to the host).

    Also readable as a mapping (``info["finite"]``, ``info.items()``), for callers that treat
    a step's report as a dict of named values.

    Attributes:
      finite: False when the step was skipped (some gradient held inf or NaN).
      loss_scale: the scale these gradients carried (the state holds the next one).
      grad_norm: the global L2 norm of the unscaled gradients (inf/NaN when not finite;
        inf also for finite ones past ~1.8e19, whose squares overflow FP32).
      loss_scale_floored: an overflow found the scale already at its minimum.
    """

    finite: torch.Tensor
    loss_scale: torch.Tensor
    grad_norm: torch.Tensor
    loss_scale_floored: torch.Tensor

    def __getitem__(self, key: Any) -> Any:  # type: ignore[override]
        if isinstance(key, str):
            if key not in self._fields:
                raise KeyError(f"{key!r}: a step reports {list(self._fields)}")
            return getattr(self, key)
        return tuple.__getitem__(self, key)

    def __contains__(self, key: Any) -> bool:  # "finite" in info, as in the dict
        return key in self._fields if isinstance(key, str) else tuple.__contains__(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        """Returns the field named ``key``, or ``default`` if there is none (``dict.get``)."""
        return getattr(self, key) if key in self._fields else default

    def keys(self) -> tuple[str, ...]:
        """Returns the field names, in order."""
        return self._fields

    def values(self) -> tuple[torch.Tensor, ...]:
        """Returns the fields' values, in order."""
        return tuple(self)

    def items(self) -> list[tuple[str, torch.Tensor]]:
        """Returns ``(name, value)`` for each field, in order."""
        return list(zip(self._fields, self))


def _is_hyperparams(x: Any) -> bool:
    return isinstance(x, Hyperparams)


def apply_updates(
    optimizer: GradientTransformation,
    policy: LossScalePolicy,
    consensus: Consensus | None,
    precision: Precision,
    places: tuple[tuple[int, int], ...],
    grads: Segments,
    trained: Trained,
) -> tuple[Trained, StepInfo]:
    """Returns the stepped tensors and the step's info: the pure core, over flat tensors.

    ``grads`` are the scaled gradients of the segments in ``trained``. ``consensus``, when
    given, replaces this process's ``(finite, norm)`` by the one all processes agree on,
    before anything moves. ``precision`` says how masters and moments are stored: they are
    decoded to FP32 before the update and encoded after it, in the same fused pass; its
    stochastic rounding draws each value's dither from its place, ``places[k]`` being segment
    ``k``'s bucket and where its first value sits in that bucket's whole buffer
    (:attr:`~fp16fx.state.MixedPrecisionState.bucket_starts` included). The new
    params are the new masters rounded (None where the param is its own FP32 master).
    """
    if any(p is not None for p in trained.params):
        require_rounding_casts()
    checked = unscale_and_agree(list(grads), trained.loss_scale.scale, consensus)
    finite, norm = checked.finite, checked.norm

    def keep_if_skipped(new: Any, old: Any) -> Any:
        if new is old:
            return new
        if new.dtype != old.dtype:
            # Compact state comes FP32 from split_master and round_moment: chosen between
            # as floats (exact for these values), then cast once into the stored dtype.
            # Inductor's CPU code selects between int8 vectors about six times slower than
            # between float ones, and it rounds every narrow intermediate
            # (emulate_precision_casts): cast, read back and cast again, a compensated step
            # took ~12% longer on resnet18 (~18% with BF16 moments).
            return torch.where(finite, new, old.float()).to(old.dtype)
        return torch.where(finite, new, old)

    pairs = list(zip(trained.params, trained.masters))
    if precision.compensated:
        masters = [m if p is None else decode_to_step(p, m) for p, m in pairs]  # FP32: its own
    else:
        masters = list(trained.masters)
    labels = trained.masters.labels
    updates, opt_state = optimizer.update(
        Segments(checked.unscaled, grads.labels),
        with_grad_norm(decode_moments(trained.opt_state, precision), norm),
        Segments(masters, labels),
    )
    bits = (
        [hash_bits(g.numel(), b, trained.count, start) for (b, start), g in zip(places, grads)]
        if precision.compensated or precision.moments != "fp32"
        else [None] * len(grads)
    )
    new_params, new_masters = [], []
    for (p, m), master, u, g, h in zip(pairs, masters, updates, grads, bits):
        if g.dtype == torch.float32:  # its own master
            new_params.append(None)
            new_masters.append(keep_if_skipped(master + u, m))
        elif precision.compensated:  # the param and its correction are the master
            p_new, c_new = split_master(master + u, p.dtype, master_noise(h))
            new_params.append(keep_if_skipped(p_new, p))
            new_masters.append(keep_if_skipped(c_new, m))
        else:
            if p is not None:
                # Adopted after the update, not before: fed into the update, the check made
                # the CPU's fused Adam step take 1.5x as long (6.6 -> 10.1 ms on resnet18's
                # 11.7M values). So the step after a write decays the master as it was:
                # decoupled decay (AdamW) is lr * wd * (written - old) off, once; L2 decay
                # (SGD's, Adam's) puts wd * old into the grad, and momentum carries it on.
                master = adopt_written(p, m)
            new_master = keep_if_skipped(master + u, master)
            new_params.append(new_master.to(g.dtype))
            new_masters.append(new_master)
    opt_state = _keep_moments(
        round_stepped_moments(opt_state, precision, bits),
        trained.opt_state,
        keep_if_skipped,
    )
    loss_scale, floored = policy.adjust(trained.loss_scale, finite)
    info = StepInfo(
        finite=finite,
        loss_scale=trained.loss_scale.scale.clone(),  # an in-place step overwrites the state's
        grad_norm=norm.float(),
        loss_scale_floored=floored,
    )
    count = keep_if_skipped(trained.count + 1, trained.count)
    new = Trained(
        params=Segments(new_params, grads.labels),
        masters=Segments(new_masters, labels),
        opt_state=opt_state,
        loss_scale=loss_scale,
        count=count,
    )
    return new, info


def adopt_written(param: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """Returns the FP32 master of FP16/BF16 ``param``: ``master``, unless the param is no
    longer the master rounded -- someone wrote it (a clamp, the model's ``load_state_dict``)
    -- and then the written value, which is the truth. Exact; the one definition for the
    step (which applies the update to it) and the facade (before it saves or rebuilds)."""
    require_rounding_casts()
    return torch.where(was_written(param, master), param.float(), master)


def was_written(param: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """Returns where FP16/BF16 ``param`` is no longer its FP32 ``master`` rounded: there
    someone wrote it (:func:`adopt_written`)."""
    return param != master.to(param.dtype)


def adopt_written_(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Makes each FP32 master of ``(FP16/BF16 param, master)`` pairs :func:`adopt_written`'s
    value, in place (the facade's engines, before they save or rebuild from the masters)."""
    with torch.no_grad():
        for param, master in pairs:
            master.copy_(adopt_written(param, master))


def _is_quantized(node: Any) -> bool:
    return isinstance(node, Quantized)


def _keep_moments(new: Any, old: Any, keep: Callable[[Any, Any], Any]) -> Any:
    """Returns the optimizer state ``new``, with ``old``'s values where the step is skipped
    (hyperparameters, never changed by a step, are passed through)."""
    return optree.tree_map(
        lambda n, o: n if _is_hyperparams(n) else optree.tree_map(keep, n, o),
        new,
        old,
        is_leaf=_is_hyperparams,
    )


def round_stepped_moments(
    opt_state: Any, precision: Precision, bits: list[torch.Tensor | None]
) -> Any:
    """Returns a stepped optimizer state's FP32 moments rounded as ``precision.moments``
    stores them (:func:`fp16fx.precision.round_moment`: still FP32, cast when kept),
    stochastically, each moment of segment ``k`` with its own dither from the step's hash
    ``bits[k]`` (:func:`fp16fx.precision.moment_noise`)."""
    if precision.moments == "fp32":
        return opt_state
    seen: dict[int, int] = {}

    def rounded(x: torch.Tensor, non_negative: bool, k: int) -> Any:
        noise = moment_noise(bits[k], seen.setdefault(k, 0))
        seen[k] += 1
        return round_moment(x, precision.moments, non_negative, precision.block, noise)

    return map_moments(rounded, opt_state)


def apply_updates_(
    optimizer: GradientTransformation,
    policy: LossScalePolicy,
    consensus: Consensus | None,
    precision: Precision,
    places: tuple[tuple[int, int], ...],
    grads: Segments,
    trained: Trained,
) -> StepInfo:
    """Returns the info of :func:`apply_updates` after writing its results into ``trained``'s
    own tensors (params only where given)."""
    new, info = apply_updates(optimizer, policy, consensus, precision, places, grads, trained)

    def write(dst: Any, src: Any) -> None:
        if isinstance(dst, Quantized):  # the codes per value, the scales per block
            write(dst.codes, src.codes)
            dst.scales.copy_(src.scales)
        elif dst is not src:
            as_rows(dst, precision).copy_(as_rows(src, precision))

    for old, value in zip(trained.params, new.params):
        if old is not None:
            write(old, value)
    optree.tree_map(write, _kept(trained), _kept(new), is_leaf=_is_quantized)
    return info


def _kept(trained: Trained) -> tuple[Any, ...]:
    """Returns what the state keeps of ``trained``, the params aside."""
    return trained.masters, trained.opt_state, trained.loss_scale, trained.count


def unscale_and_agree(
    grads: list[torch.Tensor], scale: torch.Tensor, consensus: Consensus | None
) -> CheckedGrads:
    """Returns :func:`~fp16fx.scaling.unscale_and_check`'s result with ``finite`` and ``norm``
    those every process agrees on (``consensus``; None: this process's own): what a step
    decides by."""
    checked = unscale_and_check(grads, scale)
    if consensus is None:
        return checked
    finite, norm = consensus(checked.finite, checked.norm)
    return checked._replace(finite=finite, norm=norm)


def check(consensus: Consensus | None, grads: Segments, scale: torch.Tensor) -> GradCheck:
    """Returns what a step on ``grads`` would find (no state moves)."""
    checked = unscale_and_agree(list(grads), scale, consensus)
    return GradCheck(checked.finite, checked.norm.float())


def step(state: MixedPrecisionState, grads: Any) -> tuple[MixedPrecisionState, StepInfo]:
    """Returns ``(new_state, info)`` after one mixed-precision step; never mutates its inputs.

    ``grads`` has the structure of ``state.params`` and holds the gradients of the *scaled*
    loss (``scale_loss``) in the params' dtypes; a ``None`` grad leaves that param and its
    optimizer state untouched. When any grad holds inf or NaN the step is skipped exactly
    (every value bitwise unchanged) and only the loss-scale state moves. ``info`` is a
    :class:`StepInfo` of 0-d tensors (nothing is synced to the host). (Grads in
    ``grad_buffers`` of a state padded to whole int8 blocks are read with their buffer's
    padding, which no grad covers; the step zeroes it.)
    """
    prepared = prepare(state, grads)
    with torch.no_grad():
        new, info = apply_updates(*prepared.core_args())
    return finish(prepared, new), info


def scale_loss(state: MixedPrecisionState, loss: torch.Tensor) -> torch.Tensor:
    """Returns ``loss`` in FP32 times the current loss scale (backpropagate through this)."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"scale_loss expects the loss as a tensor, got {loss!r}")
    check_state(state, "scale_loss")
    return loss.float() * state.loss_scale.scale


def get_hyperparams(state: MixedPrecisionState) -> dict[str, Any] | list[dict[str, Any]]:
    """Returns the hyperparameters by name, e.g. ``{"lr": 1e-3, "betas": (0.9, 0.999), ...}``
    (one sync); with ``multi_transform`` of several param groups, a list of such dicts, one
    per group."""
    check_state(state, "get_hyperparams")
    groups = read_hyperparams(state.opt_state)
    return groups[0] if len(groups) == 1 else groups


def set_hyperparams(
    state: MixedPrecisionState,
    *,
    group: int | None = None,
    inplace: bool = False,
    **values: Any,
) -> MixedPrecisionState:
    """Returns ``state`` with hyperparameters changed, e.g. ``set_hyperparams(state, lr=1e-4)``.

    Names: ``lr``, ``weight_decay``, ``betas``, ``eps``, ``momentum``, ``dampening``,
    ``max_norm``, as the optimizer has them; ``group=k`` changes param group ``k`` of a
    ``multi_transform`` alone. The values are tensors in the state, so a compiled step is not
    recompiled. ``inplace=True`` overwrites the existing tensors (for CUDA-graph replay, which
    reads fixed addresses) and returns the same state.

    Raises:
      KeyError, ValueError, TypeError: an unknown name or group, or a value out of range;
        nothing is changed.
    """
    check_state(state, "set_hyperparams")
    opt_state = replace_hyperparams(state.opt_state, values, group=group, inplace=inplace)
    return state if inplace else state.replace(opt_state=opt_state)
