"""``FP16_Optimizer.load_state_dict``: every entry checked before anything is written.

Layer: ``facade`` (docs/design.md). The dict's format is :mod:`fp16fx.facade.checkpoint`'s.
Loading accepts that dict, apex's own dicts as :func:`fp16fx.load_apex_checkpoint` returns them
(scaler formats ``apex.amp``, ``apex.fp16_utils.dynamic``, ``apex.fp16_utils.static``), and
apex dicts still holding scaler objects (``apex_scaler_to_dict`` converts them). Everything is
checked first; only then is anything written, so a dict that does not fit raises an error naming
the entry and leaves the optimizer exactly as it was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fp16fx.apex_checkpoint import ApexCheckpointError, apex_scaler_to_dict
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
    SAVED_NUMBERS,
    GroupSpec,
    Unsupported,
    build_transform,
    fast_kind,
    group_spec,
)
from fp16fx.facade.params import ParamSet
from fp16fx.facade.policy import FacadePolicy, Scaler, ScaleValues, scaler_from_dict
from fp16fx.saved_format import past_range, value_fault
from fp16fx.scaling import DynamicLossScale
from fp16fx.tree import is_finite

_REQUIRED = ("loss_scaler", "optimizer_state_dict", "fp32_from_fp16")
#: Per-param state keys of the optimizers whose states are checked entry by entry.
_STATE_KEYS: dict[type, tuple[str, ...]] = {
    torch.optim.SGD: ("momentum_buffer",),
    torch.optim.Adam: ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    torch.optim.AdamW: ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
}

#: The state entries torch keeps as None: a buffer not made yet (the maximum: amsgrad off).
_MAY_BE_NONE = ("momentum_buffer", "max_exp_avg_sq")


def load_fsdp(inner: torch.optim.Optimizer, engine: Engine, params: ParamSet, sd: Any) -> None:
    """Loads an ``FSDP_FORMAT`` dict (filled by ``dcp.load`` at any world size) into an FSDP2
    fast engine, or raises naming what does not fit, having changed nothing. An FSDP2 engine
    takes every dict here (a rank given another format refuses it in the ranks' agreement,
    :func:`~fp16fx.distributed.agreement.loading_together`, which the caller opens)."""
    if not steps_fsdp2_shards(engine):
        raise _fail("it was saved from an FSDP2 model's FP16_Optimizer; this one is not")
    groups, policy = _check_fsdp(inner, engine, params, sd)
    engine.keep_scale_of_the_grads()  # as a set scale does: the grads outlive the load
    engine.load_fsdp(sd["state"], policy)
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


def _fail(message: str) -> ValueError:
    return ValueError(f"the state dict does not fit this FP16_Optimizer: {message}")


def _check_tensor(
    name: str,
    value: Any,
    like: torch.Tensor,
    dtype: torch.dtype | None,
    non_negative: bool = False,
) -> None:
    if not isinstance(value, torch.Tensor):
        raise _fail(f"{name} is a {type(value).__name__}, not a tensor")
    if value.is_meta or value.layout != torch.strided:
        raise _fail(f"{name} is a {'meta' if value.is_meta else value.layout} tensor, not one "
                    "holding its values")  # fmt: skip
    if value.shape != like.shape:
        raise _fail(f"{name} has shape {tuple(value.shape)}, its param {tuple(like.shape)}")
    if dtype is not None and value.dtype != dtype:
        raise _fail(f"{name} has dtype {value.dtype}, expected {dtype}")
    if not value.is_floating_point():
        raise _fail(f"{name} has dtype {value.dtype}, expected a floating-point tensor")
    why = value_fault(value, non_negative)
    if why is not None:
        raise _fail(f"{name} {why}")


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


def _parse_optimizer(inner: torch.optim.Optimizer, osd: Any) -> list[dict[str, Any]]:
    """Checks ``optimizer_state_dict``; returns the param groups as they will be after loading.

    An AMSGrad group's state may lack ``max_exp_avg_sq`` here: the fast path starts it at
    zero, as when amsgrad is switched on (a dict saved then lacks it). Where torch's own step
    will run the groups, :func:`_require_amsgrad_maximum` refuses that."""
    if not (isinstance(osd, Mapping) and {"state", "param_groups"} <= set(osd)):
        raise _fail("optimizer_state_dict must be a dict with 'state' and 'param_groups'")
    saved_groups, groups = osd["param_groups"], inner.param_groups
    if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(groups):
        n = len(saved_groups) if isinstance(saved_groups, (list, tuple)) else saved_groups
        raise _fail(f"optimizer_state_dict has {n} param group(s), this optimizer {len(groups)}")
    entries: dict[Any, torch.Tensor] = {}
    merged = []
    for k, (saved, group) in enumerate(zip(saved_groups, groups)):
        ids = saved.get("params") if isinstance(saved, Mapping) else None
        if not isinstance(ids, (list, tuple)) or len(ids) != len(group["params"]):
            n = len(ids) if isinstance(ids, (list, tuple)) else ids
            raise _fail(
                f"param group {k} has {n} params in optimizer_state_dict, "
                f"{len(group['params'])} in this optimizer"
            )
        _check_group_keys(inner, k, saved)
        entries.update(zip(ids, group["params"]))
        merged.append({**group, **saved, "params": group["params"]})
    state = osd["state"]
    if not isinstance(state, Mapping):
        raise _fail("optimizer_state_dict['state'] must be a dict")
    known = _STATE_KEYS.get(type(inner))
    adam = type(inner) in (torch.optim.Adam, torch.optim.AdamW)
    for key, value in state.items():
        if key not in entries:
            raise _fail(f"optimizer_state_dict['state'] has an entry {key!r} for no param")
        if not isinstance(value, Mapping):
            raise _fail(f"optimizer_state_dict['state'][{key!r}] is not a dict")
        if known is None:
            continue
        name = type(inner).__name__
        extra = sorted(set(value) - set(known))
        if extra:
            raise _fail(
                f"optimizer_state_dict['state'][{key!r}] has {extra}, which torch.optim.{name} "
                "does not keep (was it saved from another optimizer?)"
            )
        if adam and value:  # a param that stepped has them all: torch's step reads them
            missing = sorted({"step", "exp_avg", "exp_avg_sq"} - set(value))
            if missing:
                raise _fail(f"optimizer_state_dict['state'][{key!r}] lacks {missing}")
        for field, tensor in value.items():
            where = f"optimizer_state_dict['state'][{key!r}][{field!r}]"
            if field == "step":
                if not _is_count(tensor):
                    raise _fail(f"{where} is {tensor!r}, not a step count")
            elif tensor is not None:
                _check_tensor(where, tensor, entries[key], None, field.endswith("exp_avg_sq"))
            elif field not in _MAY_BE_NONE:  # torch's step reads it
                raise _fail(f"{where} is None, not a tensor")
    return merged


def _require_amsgrad_maximum(
    inner: torch.optim.Optimizer, osd: Mapping[str, Any], groups: list[dict[str, Any]]
) -> None:
    """Raises unless each param that stepped in an AMSGrad group has its ``max_exp_avg_sq``:
    torch's own step reads it (a checked ``optimizer_state_dict``; ``groups`` merged)."""
    if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
        return
    amsgrad = [(bool(g.get("amsgrad")), s["params"]) for s, g in zip(osd["param_groups"], groups)]
    lacking = torch_state.lacking_amsgrad_maximum(amsgrad, osd["state"])
    if lacking:
        raise _fail(f"optimizer_state_dict['state'][{lacking[0]!r}] lacks ['max_exp_avg_sq']")


def _check_group_keys(inner: torch.optim.Optimizer, k: int, saved: Mapping[str, Any]) -> None:
    """Raises unless saved param group ``k`` has the hyperparameters ``inner``'s class steps
    with: a group saved from another optimizer would load (torch keeps the saved group whole)
    and the next step fail on the missing key."""
    kind = fast_kind(inner)
    missing = sorted(SAVED_NUMBERS[kind] - set(saved)) if kind else []
    if missing:
        raise _fail(
            f"optimizer_state_dict['param_groups'][{k}] lacks {missing}: it was saved from "
            f"another optimizer than torch.optim.{type(inner).__name__}"
        )


#: The keys torch.optim's LR schedulers add to a param group (``lr_scheduler``, ``swa_utils``).
_SCHEDULER_KEYS = frozenset(
    {"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "swa_lr"}
)


def _check_loaded_group_keys(
    inner: torch.optim.Optimizer,
    before: Sequence[Mapping[str, Any]],
    saved: Sequence[Mapping[str, Any]],
) -> None:
    """Raises where a param group torch loaded was saved from another optimizer class: it
    lacks hyperparameters (keys of the class's defaults) the group had ``before`` the load,
    even once torch filled in the keys the class gained since (``__setstate__``), and has
    keys neither the group nor the class's defaults have. The check for any class (the fast
    path's are checked by name, before loading): torch keeps a saved group whole, so a dict
    of another class loaded and the next step failed on the key it lacks (``KeyError:
    'alpha'``). Either alone is allowed: a dict of an older or newer version of the class
    (LBFGS reads a ``maximize`` it lacks as False), or keys of a scheduler (``initial_lr``,
    ``max_lr``) or the user's on one side only. torch's schedulers' keys are never foreign:
    an older dict of the class, saved under a scheduler, has both otherwise."""
    hyperparams = set(inner.defaults)
    known = {"params", "param_names", *hyperparams, *_SCHEDULER_KEYS}
    for k, (mine, loaded, theirs) in enumerate(zip(before, inner.param_groups, saved)):
        missing = sorted((hyperparams & set(mine)) - set(loaded))
        foreign = sorted(set(theirs) - set(mine) - known)
        if missing and foreign:
            cls = type(inner)
            name = (f"torch.optim.{cls.__name__}" if getattr(torch.optim, cls.__name__, None) is cls
                    else f"{cls.__module__}.{cls.__qualname__}")  # fmt: skip
            raise _fail(
                f"optimizer_state_dict['param_groups'][{k}] lacks {missing} and has {foreign}: "
                f"it was saved from another optimizer than {name}"
            )


def _is_count(value: Any) -> bool:
    """Whether ``value`` (a number or a one-element tensor) is a whole number >= 0 that the
    core's int64 counts hold."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_meta:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return is_finite(value) and 0 <= value < 2**63 and value == int(value)


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
            _check_tensor(name, value, param, torch.float32)
            why = past_range(value, param.dtype)
            if why is not None:
                raise _fail(f"{name} {why}, which its param cannot take")
            pairs.append((param, value))
    return pairs


_INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _parse_integers(
    sd: Mapping[str, Any], name: str, shape: tuple[int, ...]
) -> torch.Tensor | None:
    """Returns compact precision's ``sd[name]`` (non-negative integers of ``shape``), if saved."""
    value = sd.get(name)
    if value is not None and not (
        isinstance(value, torch.Tensor)
        and value.shape == shape
        and value.dtype in _INTEGERS
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
    groups = _parse_optimizer(inner, sd["optimizer_state_dict"])
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
        _require_amsgrad_maximum(inner, sd["optimizer_state_dict"], groups)
    trained = sum(len(ps) for ps in params.trainable)
    return Plan(
        policy, values, sd["optimizer_state_dict"], groups, masters, specs,
        sd.get("overflow"), sd.get("first_closure_call_this_step", True),
        _parse_integers(sd, "applied_steps", ()), _parse_integers(sd, "param_segments", (trained,)),
    )  # fmt: skip


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
            _check_loaded_group_keys(inner, group_contents, plan.osd["param_groups"])
            trained = [m for masters in params.masters for m in masters]
            per_param = {m: inner.state.pop(m) for m in trained if m in inner.state}
        scaler.policy = plan.policy
        master_values = {id(p): value for p, value in plan.masters}
        if isinstance(engine, FastEngine):
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
