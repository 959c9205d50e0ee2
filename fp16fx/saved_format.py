"""The format of a saved functional state dict: what it may hold, checked against the state
it is loaded into, and its leaves read in FP32 terms whatever precision they were saved in.

Layer: ``step`` (docs/design.md). :mod:`fp16fx.checkpoint` writes and loads the dict (its
docstring shows the layout); the sharded stack, FSDP2's checkpoints and the facade read saved
leaves through :func:`canonical`. Everything here only reads: a dict that does not fit raises
:class:`StateDictError` naming the first misfit before anything is written.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Collection, Mapping
from typing import Any

import torch

from fp16fx import tree
from fp16fx.precision import (
    ZERO_BLOCK_SCALE,
    Precision,
    Quantized,
    correction_dtype,
    decode_master,
    decode_moment,
    reaches,
)
from fp16fx.scaling import (
    DynamicLossScale,
    NoLossScale,
    StaticLossScale,
    check_scale,
    scale_fault,
)
from fp16fx.step import adopt_written
from fp16fx.transforms import check_hyperparam

FORMAT = "fp16fx.state/1"


def precision_dict(precision: Precision) -> dict[str, Any]:
    """Returns a state's :class:`~fp16fx.precision.Precision` as primitives."""
    return dataclasses.asdict(precision)


def as_number(value: Any, kind: type[int] | type[float]) -> int | float:
    """Returns ``value``, a real number of a saved loss scaler (numpy's too; not a bool), as
    a Python ``kind``: a count only if it is whole (an int of any size, never through a
    float), a float as it is (inf, NaN and an int past a float's range, as inf, are left for
    the caller's checks to refuse by name). Raises TypeError for anything that is not a
    number, ValueError for a count that is not whole."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{value!r} is not a number")
    if kind is int:
        if not (isinstance(value, numbers.Integral) or float(value).is_integer()):
            raise ValueError(f"{value!r} is not a whole number")
        return int(value)
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


class StateDictError(ValueError):
    """A state dict does not fit the state it is loaded into; the message names the key."""


def misfit(message: str) -> StateDictError:
    return StateDictError(f"the state dict does not fit this state: {message}")


def past_range(master: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Returns why ``master`` cannot be rounded into a ``dtype`` param -- it holds finite values
    past ``dtype``'s largest, which round to inf -- or None where it can. (Meta tensors hold no
    values; inf and NaN ones are named as such elsewhere.)"""
    if master.is_meta or not bool((torch.isfinite(master) & master.to(dtype).isinf()).any()):
        return None
    return f"holds values past {dtype}'s largest ({torch.finfo(dtype).max:g})"


def _check_tensor(where: str, value: Any, like: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor):
        raise misfit(f"{where} is a {type(value).__name__}, not a tensor")
    if value.shape != like.shape:
        raise misfit(f"{where} has shape {tuple(value.shape)}, this state's {tuple(like.shape)}")
    if value.dtype != like.dtype:
        raise misfit(f"{where} has dtype {value.dtype}, this state's {like.dtype}")


def _check_keys(where: str, saved: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    if not isinstance(saved, Mapping):
        raise misfit(f"{where} is a {type(saved).__name__}, not a dict")
    missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing:
        raise misfit(
            f"{where} lacks {missing} (was it saved from another optimizer or other params?)"
        )
    if extra:
        raise misfit(f"{where} has {extra}, which this state does not keep (another optimizer?)")


def check_fits(
    template: Mapping[str, Any], sd: Any, non_negative: Collection[str] = frozenset()
) -> None:
    """Raises naming the first entry of ``sd`` that does not fit ``template`` (a state dict of
    the state it is to be loaded into: its keys, and tensors of the right shape and dtype,
    holding values a run can save: finite, ``>= 0`` counts and, under the leaf keys named in
    ``non_negative``, the state's moments that are never negative, no NaN and no negative
    values, +inf allowed: :func:`value_fault`).

    Raises:
      TypeError: ``sd`` is not a dict; StateDictError: anything else that does not fit.
    """
    if not isinstance(sd, Mapping):
        raise TypeError(f"load_state_dict expects a dict, got {type(sd).__name__}")
    if sd.get("format") != FORMAT:
        raise misfit(f"its format is {sd.get('format')!r}, expected {FORMAT!r}")
    _check_keys("the state dict", without_segments(sd), without_segments(template))
    if "segments" in sd:
        _check_segments(sd["segments"], template["params"])
    if sd["policy"] != template["policy"]:
        raise misfit(
            f"it was saved with loss-scale policy {sd['policy']}, this state has "
            f"{template['policy']}: build it with the saved policy to load this dict"
        )
    for group in ("loss_scale", "hyperparams"):
        _check_keys(f"[{group!r}]", sd[group], template[group])
        for key, like in template[group].items():
            _check_tensor(f"[{group!r}][{key!r}]", sd[group][key], like)
    _check_tensor("['count']", sd["count"], template["count"])
    _check_values(sd)
    _check_keys("['params']", sd["params"], template["params"])
    for path, entry in template["params"].items():
        where = f"['params'][{path!r}]"
        _check_keys(where, sd["params"][path], entry)
        for key, like in entry.items():
            value = sd["params"][path][key]
            _check_tensor(f"{where}[{key!r}]", value, like)
            _check_leaf_value(f"{where}[{key!r}]", key, value, key in non_negative)


def check_compensable(params: Mapping[str, Any]) -> None:
    """Raises StateDictError naming a leaf of a state dict's ``params`` (as saved, or in FP32
    terms: :func:`canonical_params`) whose master rounds past its FP16/BF16 param's largest
    value, which a compensated state cannot hold: its param would step to inf. (A compensated
    pair at the midpoint to inf, which steps before ``52d58d2`` could save; an FP32-master
    state holding such a master beside a finite param takes the param as written.)"""
    for path, entry in params.items():
        if "correction" in entry:
            master = decode_master(entry["param"], entry["correction"])
        elif "master" in entry:
            master = entry["master"]
        else:
            continue
        if (why := past_range(master, entry["param"].dtype)) is not None:
            raise misfit(
                f"['params'][{path!r}]: its master {why}, which a compensated state cannot "
                "hold (its param would step to inf)"
            )


def without_segments(sd: Mapping[str, Any]) -> dict[str, Any]:
    """Returns state dict ``sd`` without its optional ``segments`` entry."""
    return {key: value for key, value in sd.items() if key != "segments"}


def _check_segments(segments: Any, params: Mapping[str, Any]) -> None:
    """Raises StateDictError unless ``segments`` gives every saved param (the keys of
    ``params``) a segment index: a non-negative Python int."""
    _check_keys("['segments']", segments, params)
    for path, index in segments.items():
        if type(index) is not int or index < 0:
            raise misfit(
                f"['segments'][{path!r}] is {index!r}, not a segment's index (an int >= 0)"
            )


def _check_values(sd: Mapping[str, Any]) -> None:
    """Raises StateDictError naming the first of ``sd``'s loss scale, hyperparameters and
    counts whose value the state cannot take: what the loss-scale policies and
    ``set_hyperparams`` refuse (a scale FP32 cannot hold, a NaN or negative lr), a negative
    count, a scale or counter no run under the saved policy holds
    (:func:`~fp16fx.scaling.scale_fault`, ``counter_fault``). (Meta tensors, a layout without
    values, are skipped.)"""
    scale = sd["loss_scale"]["scale"]
    if not scale.is_meta:
        try:
            check_scale("the loss scale", float(scale))
        except ValueError as err:
            raise misfit(f"['loss_scale']['scale']: {err}") from None
    for key, value in sd["hyperparams"].items():
        if not value.is_meta:
            try:
                check_hyperparam(key.rsplit("['", 1)[-1].rstrip("']"), value)  # opt[2]['lr']
            except (TypeError, ValueError) as err:
                raise misfit(f"['hyperparams'][{key!r}]: {err}") from None
    counts = {"['count']": sd["count"]}
    for name in ("good_steps", "overflows"):
        counts[f"['loss_scale'][{name!r}]"] = sd["loss_scale"][name]
    for where, count in counts.items():
        if not count.is_meta and int(count) < 0:
            raise misfit(f"{where} is {int(count)}, a count below 0")
    try:  # equal to the state's, but a value of another type (3.0 for 3) builds none
        policy = _policy(sd["policy"])
    except (TypeError, ValueError) as err:
        raise misfit(f"['policy']: {err}") from None
    scale_state = sd["loss_scale"]
    # A policy of one's own (None here) has a rule this check does not know.
    if policy is not None and not scale.is_meta:
        fault = scale_fault(policy, float(scale))
        if fault is not None:
            raise misfit(f"['loss_scale']['scale']: {fault}")
    if isinstance(policy, DynamicLossScale) and not scale_state["good_steps"].is_meta:
        counters = (int(scale_state["good_steps"]), int(scale_state["overflows"]))
        fault = policy.counter_fault(*counters)
        if fault is not None:
            raise misfit(f"['loss_scale']: {fault}")


#: The built-in loss-scale policies, by the type name a state dict saves them under.
_POLICIES = {cls.__name__: cls for cls in (NoLossScale, StaticLossScale, DynamicLossScale)}


def _policy(saved: Mapping[str, Any]) -> NoLossScale | StaticLossScale | DynamicLossScale | None:
    """Returns the built-in policy a state dict's ``policy`` entry names (equal to the loading
    state's, :func:`check_fits` has checked), or None for a policy of one's own."""
    cls = _POLICIES.get(saved.get("type"))
    return None if cls is None else cls(**{k: v for k, v in saved.items() if k != "type"})


def value_fault(value: torch.Tensor, non_negative: bool = False) -> str | None:
    """Returns why no run saves the floating-point ``value`` -- it holds inf or NaN, or, where
    it is ``non_negative`` (Adam's second moment), NaN or negative values -- or None (one
    sync: loading is rare; meta tensors, a layout without values, are passed).

    A ``non_negative`` moment may hold +inf: a finite gradient past 1.8e19 (BF16 holds
    them) squares past FP32's range, and Adam's second moment then stays inf and its value
    stops moving, in torch.optim as in fp16fx; such a run saves it and must resume."""
    if value.is_meta or not value.is_floating_point():
        return None
    if non_negative:
        if bool(value.isnan().any()):
            return "holds NaN (saved from a run that diverged?)"
        if bool((value < 0).any()):
            return "holds negative values, which this moment never takes"
        return None
    if not bool(torch.isfinite(value).all()):
        return "holds inf or NaN (saved from a run that diverged?)"
    return None


def _check_leaf_value(where: str, key: str, value: torch.Tensor, non_negative: bool) -> None:
    """Raises StateDictError unless a leaf's saved ``value`` is one a run saves: a finite
    param, master and moment, a step count >= 0, a ``non_negative`` moment (Adam's second)
    without NaN or negative values (:func:`value_fault`)."""
    why = value_fault(value, non_negative)
    if why is not None:
        raise misfit(f"{where} {why}")
    if not value.is_meta and key.endswith(".count") and value.ndim == 0 and float(value) < 0:
        raise misfit(f"{where} is {float(value):g}, a step count below 0")


def is_step_count(key: str, value: torch.Tensor) -> bool:
    """Whether a saved leaf's entry ``key`` is one of its optimizer state's step counts: a 0-d
    integer tensor (not an int8 block's offset; a 0-d param's moments are 0-d too: floating,
    or stored as int8 ``.codes``)."""
    return (
        key.startswith("opt")
        and not key.endswith((".offset", ".codes"))
        and value.ndim == 0
        and not value.is_floating_point()
    )


def leaf_scalars(entry: Mapping[str, torch.Tensor]) -> tuple[float, ...]:
    """Returns a saved leaf's step counts (:func:`is_step_count`), in key order (one sync
    each)."""
    return tuple(float(v) for k, v in sorted(entry.items()) if is_step_count(k, v))


def precision_of(sd: Mapping[str, Any]) -> Precision:
    """Returns the precision state dict ``sd`` was saved in (FP32 masters and moments for a
    dict saved before compact precision); raises StateDictError naming a malformed one."""
    saved = sd.get("precision", precision_dict(Precision()))
    try:
        return Precision(**saved)
    except (TypeError, ValueError) as err:
        raise misfit(f"['precision'] is {saved!r}: {err}") from None


def canonical(entry: Mapping[str, torch.Tensor], block: int) -> dict[str, torch.Tensor]:
    """Returns a saved leaf's entry in FP32 terms, whatever precision it was saved in: its
    ``param``, its ``master`` (FP16/BF16 params), and every optimizer tensor decoded.

    A compensated leaf's param stays the stored one: encoded again from it, the pair comes
    back as stored. (A state of FP32 masters loading a compensated dict takes it as
    :func:`full_param` says; in FP32 terms it cannot tell such a param from a written one.)

    Raises ValueError (``_NotStored``), naming the key, where a stored tensor is not of a
    dtype or shape its format stores (decoding it would silently give other numbers);
    KeyError where int8 codes lack their scales or offset."""
    _check_stored(entry, block)
    out = {"param": entry["param"]}
    if "master" in entry:
        out["master"] = entry["master"]
    elif "correction" in entry:
        out["master"] = decode_master(entry["param"], entry["correction"])
    for key, value in entry.items():
        if not key.startswith("opt") or key.endswith((".scales", ".offset")):
            continue
        if key.endswith(".codes"):
            name = key[: -len(".codes")]
            out[name] = _decode_leaf(value, entry[f"{name}.scales"], entry[f"{name}.offset"], block)
        else:
            # A BF16 moment in FP32 terms; step counts, and what a transform of one's own keeps
            # in a dtype of its choosing, stay (the state's own dtype must then match).
            out[key] = value.float() if value.dtype == torch.bfloat16 else value
    return out


def full_param(param: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """Returns the param a state of FP32 masters holds for a compensated pair's FP16/BF16
    ``param`` and decoded ``master``: the master rounded to nearest where ``param`` is as near
    to it and differs, else ``param``.

    A correction of -128 units (FP16; BF16's -32768) puts the master at the midpoint below
    its param: a tie, which rounding to nearest-even settles on the other neighbour of an
    odd param. Loaded as it is, the full state's next step would take it for a written param
    (``step.adopt_written``) and drop the master. (Differences of FP16/BF16 values from an
    FP32 master within an ulp are exact in FP32.) Not covered: BF16 values below 2**-118,
    whose correction's unit (2**-126) exceeds half their ulp; their next step may adopt the
    param, moving the master by at most 2**-126."""
    rounded = master.to(param.dtype)
    tie = (master - param.float()).abs() == (master - rounded.float()).abs()
    return torch.where(tie & (rounded != param), rounded, param)


def master_of(param: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """Returns the FP32 master that a saved FP16/BF16 ``param`` and FP32 ``master`` (FP32
    terms) stand for: ``master``, but where no correction reaches it from the param and the
    param was written since the save's last step (a clamp), the written param
    (``step.adopt_written``). A state of FP32 masters adopts it at its next step; a conversion
    that encodes the master again (into a compensated state, over params of another dtype)
    would otherwise undo the write.

    Within a correction's reach the master stays: a compensated pair's param need not be its
    master rounded (a midpoint, a param written over its old correction), and FP32 terms
    (FSDP2's DCP dicts) cannot tell it from a written one. So a write that lands within half
    an ulp of the old master (a one-ulp move) keeps that master: the write is undone."""
    return torch.where(reaches(param, master), master, adopt_written(param, master))


class _NotStored(ValueError):
    """A saved leaf's tensor that its format does not store (named by its key)."""


def _check_stored(entry: Mapping[str, torch.Tensor], block: int) -> None:
    """Raises _NotStored naming the first tensor of a saved leaf whose dtype or shape its
    format does not store."""
    for key, value in entry.items():
        if key not in ("param", "master", "correction") and not key.startswith("opt"):
            raise _NotStored(f"[{key!r}] is no key a saved leaf has (another format?)")
        if not isinstance(value, torch.Tensor):
            raise _NotStored(f"[{key!r}] is a {type(value).__name__}, not a tensor")
    if "master" in entry and "correction" in entry:
        raise _NotStored("['correction'] beside a ['master']: a leaf saves one or the other")
    param = entry["param"]
    if param.dtype not in tree.MODEL_DTYPES:
        raise _NotStored(f"['param'] has dtype {param.dtype}, not FP16, BF16 or FP32")
    if "correction" in entry:
        if param.dtype == torch.float32:
            raise _NotStored("['correction'] beside an FP32 param, which is its own master")
        wanted = correction_dtype(param.dtype)
        if entry["correction"].dtype != wanted:
            raise _NotStored(
                f"['correction'] has dtype {entry['correction'].dtype}; a {param.dtype} "
                f"param's is {wanted}"
            )
    for key, value in entry.items():
        # One value per param value: the correction, int8 codes, FP32/BF16 moments (not the
        # scales of int8 blocks, nor int64 step counts; a 0-d param's moments are 0-d).
        per_value = key == "correction" or key.endswith(".codes")
        moment = key.startswith("opt") and value.is_floating_point()
        of_blocks = key.endswith((".scales", ".offset"))
        if (per_value or (moment and not of_blocks)) and value.shape != param.shape:
            if key.endswith(".count") and value.ndim == 0:  # as the core's transforms name it
                raise _NotStored(f"[{key!r}] is a 0-d {value.dtype}: a step count is an integer")
            raise _NotStored(
                f"[{key!r}] has shape {tuple(value.shape)}; its ['param'] has {tuple(param.shape)}"
            )
    for key in entry:
        name = key.rpartition(".")[0]
        if key.endswith((".scales", ".offset")) and f"{name}.codes" not in entry:
            raise _NotStored(
                f"[{key!r}] without the int8 codes it belongs to, [{name + '.codes'!r}]"
            )
    for key, value in entry.items():
        if key.endswith(".codes"):
            name = key[: -len(".codes")]
            offset, scales = entry[f"{name}.offset"], entry[f"{name}.scales"]
            # (Meta tensors, a layout without values, are checked for their kind only.)
            bad_kind = offset.ndim or offset.dtype != torch.int64
            if bad_kind or not (offset.is_meta or 0 <= int(offset) < block):
                raise _NotStored(f"[{name + '.offset'!r}] is not an int64 in [0, {block})")
            if value.dtype not in (torch.int8, torch.uint8):
                raise _NotStored(f"[{key!r}] has dtype {value.dtype}, not int8 or uint8 codes")
            blocks = None if offset.is_meta else -(-(int(offset) + value.numel()) // block)
            if (
                scales.dtype != torch.float32
                or scales.ndim != 1
                or blocks not in (None, len(scales))
            ):
                raise _NotStored(
                    f"[{name + '.scales'!r}] is {scales.dtype} of shape {tuple(scales.shape)}; "
                    f"its codes need {blocks} FP32 scales"
                )


def _decode_leaf(
    codes: torch.Tensor, scales: torch.Tensor, offset: torch.Tensor, block: int
) -> torch.Tensor:
    """Returns the FP32 values of one leaf's part of an int8 moment (uint8 codes: a
    non-negative one)."""
    start = int(offset)
    padded = torch.cat([codes.reshape(-1).new_zeros(start), codes.reshape(-1)])
    stored = Quantized(padded, scales)
    return decode_moment(stored, codes.dtype == torch.uint8, block)[start:].view(codes.shape)


def canonical_params(params: Mapping[str, Any], block: int) -> dict[str, Any]:
    """Returns :func:`canonical` of every leaf entry of a state dict's ``params`` saved with
    int8 blocks of ``block`` values; raises StateDictError naming a malformed one."""
    out = {}
    for path, entry in params.items():
        where = f"['params'][{path!r}]"
        if not isinstance(entry, Mapping):
            raise misfit(f"{where} is a {type(entry).__name__}, not a dict")
        try:
            out[path] = canonical(entry, block)
        except KeyError as err:
            raise misfit(f"{where} lacks {err}") from None
        except _NotStored as err:
            raise misfit(f"{where}{err}") from None
        except (AttributeError, IndexError, TypeError, RuntimeError, ValueError) as err:
            raise misfit(f"{where} holds a malformed compact tensor: {err}") from None
    return out


def check_codes(params: Mapping[str, Any], signs: Mapping[str, bool]) -> None:
    """Raises StateDictError naming an int8 moment of a state dict's ``params`` (well formed:
    :func:`canonical_params` or :func:`check_fits` passed) whose codes are not the kind the
    loading state's moment takes -- ``signs``, ``{key: never negative}``
    (:func:`fp16fx.checkpoint.moment_signs`): uint8 codes for a non-negative moment, int8 for
    a signed one; decoded as the other kind they would give other numbers -- or that hold a
    signed code of -128 or block scales no encoding gives (each is a finite block maximum, at
    least FP32's smallest normal). One sync per check; meta tensors, a layout without values,
    are skipped. (A block's scale above all of its values would need the whole block, which
    may span several params' entries: not checked.)"""
    for path, entry in params.items():
        for key, codes in entry.items():
            if not key.endswith(".codes"):
                continue
            where, name = f"['params'][{path!r}]", key[: -len(".codes")]
            if name in signs:
                wanted = torch.uint8 if signs[name] else torch.int8
                if codes.dtype != wanted:
                    kind = "non-negative" if signs[name] else "signed"
                    raise misfit(
                        f"{where}[{key!r}] has dtype {codes.dtype}; this {kind} moment's codes "
                        f"are {wanted}"
                    )
            if codes.dtype == torch.int8 and not codes.is_meta and bool((codes == -128).any()):
                raise misfit(
                    f"{where}[{key!r}] holds the code -128, which no encoding gives (signed "
                    "codes are -127 to 127)"
                )
            scales = entry[f"{name}.scales"]
            valid = torch.isfinite(scales) & (scales >= ZERO_BLOCK_SCALE)
            if not scales.is_meta and not bool(valid.all()):
                raise misfit(
                    f"{where}[{name + '.scales'!r}] holds a scale that is not finite and at least "
                    f"FP32's smallest normal ({ZERO_BLOCK_SCALE:g}), which no int8 block has"
                )


def check_dense(node: Any, where: str = "") -> None:
    """Raises StateDictError naming the first tensor in state dict ``node`` (at ``where``) that
    holds no values to load (a meta or sparse one). Walks any Mapping, not only dicts (a
    pytree flatten would take a Mapping of another type for one leaf)."""
    if isinstance(node, torch.Tensor):
        if node.is_meta or node.layout != torch.strided:
            kind = "meta" if node.is_meta else node.layout
            raise misfit(f"{where} is a {kind} tensor, not one holding its values")
    elif isinstance(node, Mapping):
        for key, value in node.items():
            check_dense(value, f"{where}[{key!r}]")
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            check_dense(value, f"{where}[{i}]")
