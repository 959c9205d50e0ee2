"""``FP16_Optimizer.load_state_dict``: every entry checked before anything is written.

Layer: ``facade`` (docs/design.md). The dict's format is :mod:`fp16fx.facade.checkpoint`'s.
Loading accepts that dict, apex's own dicts as :func:`fp16fx.load_apex_checkpoint` returns them
(scaler formats ``apex.amp``, ``apex.fp16_utils.dynamic``, ``apex.fp16_utils.static``), and
apex dicts still holding scaler objects (``apex_scaler_to_dict`` converts them). Everything is
checked first; only then is anything written, so a dict that does not fit raises an error naming
the entry and leaves the optimizer exactly as it was. Its ``optimizer_state_dict`` is checked by
:func:`torch_state.check_state_dict`, the param groups torch loads by
:func:`~fp16fx.facade.groups.check_loaded_group_keys`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fp16fx.apex_checkpoint import ApexCheckpointError, apex_scaler_to_dict
from fp16fx.distributed.agreement import compare_too
from fp16fx.facade import torch_state
from fp16fx.facade.checkpoint import (
    FLAGS,
    FSDP_FORMAT,
    KEYS,
    SHARDED_FORMAT,
    group_numbers,
    steps_fsdp2_shards,
    trained_positions,
)
from fp16fx.facade.engines import Engine
from fp16fx.facade.fast import FastEngine
from fp16fx.facade.groups import (
    GroupSpec,
    Unsupported,
    build_transform,
    check_loaded_group_keys,
    group_spec,
    group_values,
)
from fp16fx.facade.params import ParamSet
from fp16fx.facade.policy import (
    FacadePolicy,
    Scaler,
    ScaleValues,
    scaler_from_dict,
    scaler_to_dict,
)
from fp16fx.saved_format import past_range, value_fault
from fp16fx.scaling import DynamicLossScale, check_scale

_REQUIRED = ("loss_scaler", "optimizer_state_dict", "fp32_from_fp16")


def load_fsdp(inner: torch.optim.Optimizer, engine: Engine, params: ParamSet, sd: Any) -> None:
    """Loads an ``FSDP_FORMAT`` dict (filled by ``dcp.load`` at any world size) into an FSDP2
    fast engine, or raises naming what does not fit, having changed nothing. An FSDP2 engine
    takes every dict here (a rank given another format refuses it in the ranks' agreement,
    :func:`~fp16fx.distributed.agreement.loading_together`, which the caller opens)."""
    if not steps_fsdp2_shards(engine):
        raise _fail("it was saved from an FSDP2 model's FP16_Optimizer; this one is not")
    groups, policy = _check_fsdp(inner, engine, params, sd)
    scale = _saved_scale(sd["state"])
    engine.keep_scale_of_the_grads()  # as a set scale does: the grads outlive the load
    engine.load_fsdp(sd["state"], policy, scale)
    for group, saved in zip(inner.param_groups, groups):
        group.update(saved)


def _check_fsdp(
    inner: torch.optim.Optimizer, engine: FastEngine, params: ParamSet, sd: Any
) -> tuple[Sequence[Mapping[str, Any]], Any]:
    """Returns an FSDP2 dict's param groups and loss-scale policy, or raises naming what does
    not fit in it besides the state (which :func:`fsdp.load_state_dict` checks)."""
    if not isinstance(sd, Mapping) or sd.get("format") != FSDP_FORMAT:
        what = f"format {sd.get('format')!r}" if isinstance(sd, Mapping) else type(sd).__name__
        raise _fail(
            f"it is no FSDP2 model's FP16_Optimizer dict ({what}): this one loads the dict its "
            "own state_dict() gives, through torch.distributed.checkpoint (docs/distributed.md)"
        )
    if not isinstance(sd.get("state"), Mapping):
        raise _fail("it has no 'state' dict (the fp16fx state of an FSDP2 FP16_Optimizer)")
    _check_flags(sd, required=True)
    groups = sd.get("param_groups")
    if not isinstance(groups, Sequence) or len(groups) != len(inner.param_groups):
        raise _fail(f"it has {len(groups or [])} param groups, this optimizer "
                    f"{len(inner.param_groups)}")  # fmt: skip
    for k, (saved, group) in enumerate(zip(groups, inner.param_groups)):
        if set(saved) != set(group_numbers(group)):
            raise _fail(f"param_groups[{k}] has keys {sorted(saved)}, this optimizer's "
                        f"{sorted(group_numbers(group))}")  # fmt: skip
    if "trainable" not in sd:
        raise _fail("it does not say which params it trained (saved by an older fp16fx)")
    _check_trained(inner, params, sd["trainable"])
    merged = [{**group, **saved} for saved, group in zip(groups, inner.param_groups)]
    try:
        specs = [group_spec(engine.kind, group, k) for k, group in enumerate(merged)]
    except Unsupported as err:
        raise _fail(f"{engine.whose} cannot run its groups: {err}") from None
    engine.check_structure(specs, loading=True)
    _check_numbers(specs, merged, engine)  # a NaN lr would fail every step after the load
    return groups, _saved_policy(engine.scaler.policy, sd["state"])


def _saved_scale(state: Mapping[str, Any]) -> torch.Tensor | None:
    """Returns the loss scale an FSDP2 dict's core ``state`` saved, a 0-d FP32 tensor checked
    as the ``loss_scale`` setter checks one: any scale FP32 holds as a normal value, also one
    its policy never reaches. None where it saved no such tensor (the core's load names it)."""
    saved = state.get("loss_scale")
    scale = saved.get("scale") if isinstance(saved, Mapping) else None
    held = isinstance(scale, torch.Tensor) and scale.dtype == torch.float32 and scale.ndim == 0
    if not held or scale.is_meta:
        return None
    try:
        check_scale("['state']['loss_scale']['scale']", float(scale))
    except ValueError as err:
        raise _fail(str(err)) from None
    return scale


def _check_trained(inner: torch.optim.Optimizer, params: ParamSet, saved: Any) -> None:
    """Raises unless ``saved`` (a dict's ``trainable``) names the positions this optimizer
    trains in each param group."""
    positions = trained_positions(inner, params)
    if not isinstance(saved, Sequence) or len(saved) != len(positions):
        raise _fail(f"its 'trainable' is {saved!r}: one list per param group expected")
    for k, (theirs, mine) in enumerate(zip(saved, positions)):
        if theirs != mine:
            raise _fail(
                f"it trained the params at {theirs} of param group {k}, this optimizer those "
                f"at {mine}: the state is saved by position among them, and would load into "
                "other params (freeze and unfreeze as when it was saved)"
            )


def _saved_policy(policy: Any, sd: Any) -> Any:
    """Returns ``policy`` with the fields saved in ``sd["policy"]`` (the checkpoint's scaler
    settings win, as in apex), or ``policy`` itself when ``sd`` saved another kind."""
    saved = sd.get("policy") if isinstance(sd, Mapping) else None
    if not (isinstance(saved, Mapping) and saved.get("type") == type(policy).__name__):
        return policy  # fsdp.load_state_dict names the mismatch
    try:
        return dataclasses.replace(policy, **{k: v for k, v in saved.items() if k != "type"})
    except (TypeError, ValueError) as err:
        raise _fail(f"its loss-scale policy {dict(saved)} cannot be rebuilt: {err}") from None


@dataclasses.dataclass
class Plan:
    """A checked state dict: what loading it will write."""

    policy: FacadePolicy
    values: ScaleValues
    osd: Mapping[str, Any]
    groups: list[dict[str, Any]]  # the param groups as they will be after loading
    masters: list[tuple[torch.Tensor, torch.Tensor]]  # (FP16/BF16 param, its saved FP32 master)
    specs: list[GroupSpec] | None  # the fast path's group structures after loading; None: generic
    overflow: bool | None
    first_closure_call: bool
    applied_steps: torch.Tensor | None  # the fast path's count of applied steps, if saved
    param_segments: torch.Tensor | None  # and the core segment of each param, if saved

    def facts(self) -> dict[str, Any]:
        """What every rank's copy of one checkpoint holds alike and the facade loads itself,
        as plain Python values named by where they sit in the dict: the count (if saved), the
        loss scaler, the overflow flags and the numbers each param group steps with (its
        entries of other kinds are the user's, which need not pickle, nor equal themselves:
        NaN)."""
        assert self.specs is not None  # a sharded fast engine's plan (the only caller)
        steps = None if self.applied_steps is None else self.applied_steps.tolist()
        facts = {
            "['applied_steps']": steps,
            "['loss_scaler']": scaler_to_dict(self.policy, self.values),
            "['overflow']": self.overflow,
            "['first_closure_call_this_step']": self.first_closure_call,
        }
        for k, (spec, group) in enumerate(zip(self.specs, self.groups)):
            facts[f"['optimizer_state_dict']['param_groups'][{k}]"] = group_values(spec, group, k)
        return facts


def _fail(message: str) -> ValueError:
    return ValueError(f"the state dict does not fit this FP16_Optimizer: {message}")


def _parse_scaler(sd: Mapping[str, Any]) -> tuple[FacadePolicy, ScaleValues]:
    scaler = sd["loss_scaler"]
    if not isinstance(scaler, Mapping):
        try:
            scaler = apex_scaler_to_dict(scaler)
        except ApexCheckpointError as err:
            raise _fail(f"loss_scaler: {err}") from None
    try:
        policy, values = scaler_from_dict(scaler)
    except ValueError as err:
        raise _fail(str(err)) from None
    # apex's legacy DynamicLossScaler is saved beside dynamic_loss_scale=True, also where it
    # loads as a static policy (scale_factor=1: its scale never moves)
    legacy = scaler.get("format") == "apex.fp16_utils.dynamic"
    saved_dynamic = legacy or isinstance(policy, DynamicLossScale)
    dynamic = sd.get("dynamic_loss_scale", saved_dynamic)
    if dynamic is not saved_dynamic:
        raise _fail(f"dynamic_loss_scale is {dynamic!r} but loss_scaler is {scaler}")
    _check_flags(sd, required=False)
    return policy, values


def _check_numbers(
    specs: list[GroupSpec], groups: list[dict[str, Any]], engine: FastEngine
) -> None:
    """Raises unless the fast path can run ``groups``' numbers (the transform builds)."""
    try:
        build_transform(specs, groups, engine.labels)
    except (ValueError, TypeError, KeyError) as err:
        raise _fail(str(err)) from None


def _check_flags(sd: Mapping[str, Any], *, required: bool) -> None:
    """Raises unless ``sd``'s :data:`FLAGS` are bools (and, if ``required``, present: an
    apex checkpoint may lack them, an FSDP2 one always has them)."""
    for key in FLAGS:
        if key not in sd:
            if required:
                raise _fail(f"it has no {key!r} entry")
        elif not isinstance(sd[key], bool):
            raise _fail(f"{key} must be a bool, got {sd[key]!r}")


def _parse_masters(params: ParamSet, saved: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    current = [[p for p in ps if p.dtype != torch.float32] for ps in params.trainable]
    if not isinstance(saved, (list, tuple)) or len(saved) != len(current):
        n = len(saved) if isinstance(saved, (list, tuple)) else saved
        raise _fail(f"fp32_from_fp16 has {n} group(s), this optimizer {len(current)}")
    pairs = []
    for k, (mine, theirs) in enumerate(zip(current, saved)):
        if not isinstance(theirs, (list, tuple)) or len(theirs) != len(mine):
            n = len(theirs) if isinstance(theirs, (list, tuple)) else theirs
            raise _fail(
                f"fp32_from_fp16[{k}] has {n} master(s); this optimizer's group {k} has "
                f"{len(mine)} FP16/BF16 params"
            )
        for i, (param, value) in enumerate(zip(mine, theirs)):
            name = f"fp32_from_fp16[{k}][{i}]"
            why = torch_state.tensor_fault(value, param, torch.float32) or value_fault(value)
            if why is not None:
                raise _fail(f"{name} {why}")
            why = past_range(value, param.dtype)
            if why is not None:
                raise _fail(f"{name} {why}, which its param cannot take")
            pairs.append((param, value))
    return pairs


_INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _parse_integers(
    sd: Mapping[str, Any], name: str, shape: tuple[int, ...]
) -> torch.Tensor | None:
    """Returns fp16fx's ``sd[name]`` (non-negative integers of ``shape``: the fast path's
    ``applied_steps`` or ``param_segments``), if saved."""
    value = sd.get(name)
    if value is not None and not (
        isinstance(value, torch.Tensor)
        and value.shape == shape
        and value.dtype in _INTEGERS
        and value.layout == torch.strided
        and not value.is_meta  # (neither holds values to compare)
        and bool((value >= 0).all())
    ):
        raise _fail(f"{name} must be a non-negative integer tensor of shape {shape}, got {value!r}")
    return value


def parse(inner: torch.optim.Optimizer, engine: Engine, params: ParamSet, sd: Any) -> Plan:
    """Returns the plan for loading ``sd``; raises naming what does not fit."""
    if not isinstance(sd, Mapping):
        raise TypeError(
            "load_state_dict expects a dict (or the list of a sharded optimizer's per-rank "
            f"dicts), got {type(sd).__name__}"
        )
    if sd.get("format") == SHARDED_FORMAT:
        shard = sd.get("shard", {})
        raise _fail(
            f"it is rank {shard.get('rank')}'s dict of a checkpoint saved by "
            f"{shard.get('world_size')} ranks: pass the list of every rank's dicts (any world "
            "size loads them), or fp16fx.facade.consolidate_state_dict of them"
        )
    missing = [key for key in _REQUIRED if key not in sd]
    if missing:
        raise _fail(
            f"it has no {missing} entries (it has {sorted(map(str, sd))}); an FP16_Optimizer "
            "state dict comes from FP16_Optimizer.state_dict() or fp16fx.load_apex_checkpoint()"
        )
    unknown = sorted(set(map(str, sd)) - set(KEYS))
    if unknown:
        raise _fail(f"it has unknown entries {unknown}")
    policy, values = _parse_scaler(sd)
    try:
        groups = torch_state.check_state_dict(inner, sd["optimizer_state_dict"])
    except ValueError as err:
        raise _fail(str(err)) from None
    if "trainable" in sd:  # fp16fx's; an apex dict loads by position, as apex loaded it
        _check_trained(inner, params, sd["trainable"])
    masters = _parse_masters(params, sd["fp32_from_fp16"])
    specs = None
    if isinstance(engine, FastEngine):
        try:
            specs = [group_spec(engine.kind, g, k) for k, g in enumerate(groups)]
        except Unsupported:
            specs = None  # the loaded options need the generic path
        if specs is not None:
            _check_numbers(specs, groups, engine)
        if engine.sharded is not None:
            if specs is None:
                raise ValueError(
                    "the state dict's param groups need the generic path (e.g. maximize=True), "
                    "which a sharded FP16_Optimizer does not have"
                )
            engine.check_structure(specs, loading=True)
    if specs is None:  # the wrapped optimizer will step the groups
        try:
            torch_state.require_amsgrad_maximum(inner, sd["optimizer_state_dict"], groups)
        except ValueError as err:
            raise _fail(str(err)) from None
    trained = sum(len(ps) for ps in params.trainable)
    return Plan(
        policy=policy,
        values=values,
        osd=sd["optimizer_state_dict"],
        groups=groups,
        masters=masters,
        specs=specs,
        overflow=sd.get("overflow"),
        first_closure_call=sd.get("first_closure_call_this_step", True),
        applied_steps=_parse_integers(sd, "applied_steps", ()),
        param_segments=_parse_integers(sd, "param_segments", (trained,)),
    )


def load(
    inner: torch.optim.Optimizer, engine: Engine, params: ParamSet, scaler: Scaler, plan: Plan
) -> None:
    """Loads a checked ``plan``, or raises having changed nothing.

    Raises:
      Unsupported: the engine is the fast one and the loaded groups need the generic path.
      ValueError: a saved state does not fit its param (found while converting it), or a
        param group torch loaded was saved from another optimizer class.
    """
    if isinstance(engine, FastEngine) and plan.specs is None:
        raise Unsupported("the loaded param groups need it")
    saved = (inner.state, inner.param_groups, scaler.policy)
    group_contents = [dict(group) for group in inner.param_groups]
    try:
        # Where the groups hold the model's FP16 params, torch's load would cast the state to
        # FP16: it is read from the dict instead.
        keep_groups = isinstance(engine, FastEngine) and engine.groups_hold_params
        if keep_groups:
            ids = {}
            for saved_group, group in zip(plan.osd["param_groups"], inner.param_groups):
                ids.update(zip(saved_group["params"], group["params"]))
            per_param = {ids[key]: dict(value) for key, value in plan.osd["state"].items()}
            # The loaded numbers first: the engine builds a changed structure's transform
            # from them (momentum switched on: from the old momentum 0, it built no buffer).
            for group, loaded in zip(inner.param_groups, plan.groups):
                group.update(loaded)
        else:
            inner.load_state_dict(plan.osd)  # torch casts the state to the masters' dtype/device
            try:
                check_loaded_group_keys(inner, group_contents, plan.osd["param_groups"])
            except ValueError as err:
                raise _fail(str(err)) from None
            trained = [m for masters in params.masters for m in masters]
            per_param = {m: inner.state.pop(m) for m in trained if m in inner.state}
        scaler.policy = plan.policy
        master_values = {id(p): value for p, value in plan.masters}
        if isinstance(engine, FastEngine):
            if engine.sharded is not None:  # a stale copy on one rank: every rank refuses it
                compare_too(plan.facts())
            engine.load(
                per_param, master_values, plan.policy, plan.param_segments, plan.specs,
                plan.applied_steps,
            )  # fmt: skip
        else:
            inner.state.update(per_param)
            master_of = params.master_of()
            with torch.no_grad():
                for param, value in plan.masters:
                    master_of[id(param)].copy_(value)
            engine.masters_to_model()
    except BaseException:
        inner.state, inner.param_groups, scaler.policy = saved
        for group, contents in zip(inner.param_groups, group_contents):
            group.clear()
            group.update(contents)
        raise
    engine.keep_scale_of_the_grads()  # as a set scale does: the grads outlive the load
    with torch.no_grad():
        for name in ScaleValues._fields:  # LossScaleState's
            getattr(scaler.state, name).fill_(getattr(plan.values, name))
