"""The core's per-param state <-> torch.optim's per-param state dicts.

Layer: ``facade`` (docs/design.md). Bookkeeping only: which entry of a param's part of the
core's state (:func:`fp16fx.checkpoint.per_leaf`: ``opt[...].mu``, ``opt[...].count``...)
torch.optim calls ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``momentum_buffer`` and
``step``. torch keeps no state for a param before its first step, and SGD without momentum
keeps none at all. Loading goes through the core's own state dict in FP32 terms
(:func:`core_entries`), so that the core's checks and encodings apply unchanged.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch

from fp16fx import saved_format
from fp16fx.facade.groups import GroupSpec

#: torch.optim's per-param state, keyed by the tensor its param group holds.
PerParamState = dict[torch.Tensor, dict[str, Any]]

#: The core's names (the last part of a per-param key) -> torch.optim's.
TORCH_NAMES = {
    "mu": "exp_avg",
    "nu": "exp_avg_sq",
    "nu_max": "max_exp_avg_sq",
    "momentum_buffer": "momentum_buffer",
}


def field(key: str) -> str:
    """Returns the core's name of a per-param key, e.g. ``mu`` for ``opt[1].inner[0][0].mu``."""
    return key.rsplit(".", 1)[-1]


def count_key(leaf: Mapping[str, Any]) -> str | None:
    """Returns the key of a param's step count in its part of the core's state, if any."""
    return next((key for key in leaf if field(key) == "count"), None)


#: torch.optim's per-param tensors that are never negative (Adam's second moments).
_NON_NEGATIVE = frozenset({"exp_avg_sq", "max_exp_avg_sq"})


def keys(spec: GroupSpec) -> tuple[str, ...]:
    """Returns the per-param tensors torch.optim keeps for a group of structure ``spec``."""
    if spec.optimizer == "sgd":
        return ("momentum_buffer",) if spec.has_momentum else ()
    return ("exp_avg", "exp_avg_sq", *(("max_exp_avg_sq",) if spec.amsgrad else ()))


def lacking_amsgrad_maximum(
    groups: Iterable[tuple[bool, Iterable[Hashable]]], state: Mapping[Any, Mapping[str, Any]]
) -> list[Hashable]:
    """Returns the params (keys of ``state``) that have stepped in a group with amsgrad on,
    ``groups`` giving each group's ``(amsgrad, params)``, yet hold no ``max_exp_avg_sq`` (or None):
    amsgrad was switched on since their last step. The fast path starts that maximum at
    zero; torch's own step reads it."""
    return [
        key
        for amsgrad, params in groups
        if amsgrad
        for key in params
        if state.get(key) and state[key].get("max_exp_avg_sq") is None
    ]


def to_torch(
    leaf: Mapping[str, torch.Tensor], count: int, step_device: torch.device | None
) -> dict[str, Any]:
    """Returns torch.optim's state of a param whose part of the core's state is ``leaf``
    (``{}`` before its first step, or when torch keeps none: SGD without momentum). Tensors are
    views of the core's; Adam's ``step`` is a new float32 tensor on ``step_device`` (torch
    keeps it on the CPU unless the optimizer is capturable or fused)."""
    out: dict[str, Any] = {}
    for key, tensor in leaf.items():
        name = TORCH_NAMES.get(field(key))
        if name is not None:
            out[name] = tensor
    if count == 0 or not out:
        return {}
    if "exp_avg" in out:
        out = {"step": torch.tensor(float(count), dtype=torch.float32, device=step_device), **out}
    return out


def export(
    leaves: Sequence[Mapping[str, torch.Tensor] | None],
    keys: Sequence[Any],
    step_devices: Sequence[torch.device | None],
) -> dict[Any, dict[str, Any]]:
    """Returns torch.optim's per-param state of the params whose parts of the core's state
    are ``leaves`` (in FP32 terms; None: not trained), keyed by ``keys[i]``, Adam's ``step``
    on ``step_devices[i]`` (see :func:`to_torch`). Reads every step count in one sync."""
    count_keys = [None if leaf is None else count_key(leaf) for leaf in leaves]
    counts_at = [i for i, key in enumerate(count_keys) if key is not None]
    if not counts_at:
        return {}
    counts = torch.stack([leaves[i][count_keys[i]] for i in counts_at]).tolist()
    count_of = dict(zip(counts_at, counts))
    out = {}
    for i, leaf in enumerate(leaves):
        state = {} if leaf is None else to_torch(leaf, count_of.get(i, 0), step_devices[i])
        if state:
            out[keys[i]] = state
    return out


def from_torch(
    spec: GroupSpec, mine: Mapping[str, torch.Tensor], saved: Mapping[str, Any]
) -> dict[str, Any]:
    """Returns a param's part of the core's state dict (keys and shapes of ``mine``, its
    current part) holding torch.optim's state ``saved`` (``{}``: a param that never stepped).

    Moments torch starts lazily (SGD's buffer, AMSGrad's maximum) and absent ones are zeros;
    SGD's step count is 1 once it has a momentum buffer, so the next step decays it.
    """
    out: dict[str, Any] = {}
    for key, like in mine.items():
        name = field(key)
        if name == "count":
            if spec.optimizer == "sgd":
                has = saved.get("momentum_buffer") is not None
                out[key] = torch.tensor(int(has), dtype=like.dtype)
            else:
                out[key] = torch.tensor(int(float(saved.get("step", 0))), dtype=like.dtype)
            continue
        value = saved.get(TORCH_NAMES.get(name, ""))
        if value is None:
            out[key] = torch.zeros_like(like, device="cpu")
        else:
            out[key] = value.detach().reshape(like.shape).to(like.dtype)
    return out


def check(spec: GroupSpec, entry: torch.Tensor, saved: Mapping[str, Any]) -> None:
    """Raises ValueError if ``saved`` cannot be the torch state of ``entry`` under ``spec``."""
    if not saved:
        return
    if spec.optimizer != "sgd" and "step" not in saved:
        raise ValueError(f"the saved state of a param of shape {tuple(entry.shape)} has no 'step'")
    step = saved.get("step")
    number = isinstance(step, (int, float)) and not isinstance(step, bool)
    if "step" in saved and not (number or (isinstance(step, torch.Tensor) and step.numel() == 1)):
        raise ValueError(
            f"the saved 'step' of a param of shape {tuple(entry.shape)} is {step!r}, not a "
            "number or a one-element tensor"
        )
    for key in keys(spec):
        value = saved.get(key)
        if value is None and (spec.optimizer == "sgd" or key == "max_exp_avg_sq"):
            continue  # torch starts these lazily
        if not isinstance(value, torch.Tensor) or value.shape != entry.shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else value
            raise ValueError(f"the saved {key!r} of a param of shape {tuple(entry.shape)} is {got}")


def check_values(spec: GroupSpec, saved: Mapping[str, Any]) -> None:
    """Raises ValueError where a tensor of ``saved``, a torch state :func:`check` passed, holds
    values no run keeps (inf or NaN; negative second moments): for a state that comes with no
    checks of its own, the one a wrapped optimizer holds (a loaded dict's values are checked
    where it is read, one sync per tensor)."""
    for key in keys(spec):
        value = saved.get(key)
        why = None if value is None else saved_format.value_fault(value, key in _NON_NEGATIVE)
        if why is not None:
            raise ValueError(f"the saved {key!r} of a param of shape {tuple(value.shape)} {why}")


def check_one_count_per_bucket(
    specs: Sequence[GroupSpec],
    labels: Sequence[int],
    params: Sequence[torch.Tensor],
    held: Sequence[Any],
    names: Mapping[int, str],
) -> None:
    """Raises ValueError where two params of one sharded flat bucket (one param group and
    dtype: ``labels[i]`` is param ``i``'s group) hold different step counts in ``held``
    (per param, :func:`summary` of its torch.optim state; None: no step taken): each rank's
    slice of a bucket keeps one."""
    first: dict[tuple[int, torch.dtype], tuple[float, torch.Tensor]] = {}
    for label, p, state in zip(labels, params, held, strict=True):
        if specs[label].optimizer == "sgd":  # torch's SGD counts no steps
            continue
        steps = (state or {}).get("step", 0.0)
        other_steps, other = first.setdefault((label, p.dtype), (steps, p))
        if steps != other_steps:
            raise ValueError(
                f"{names[id(p)]} has taken {steps:g} steps in the optimizer given, "
                f"{names[id(other)]} {other_steps:g}: a sharded FP16_Optimizer keeps one step "
                f"count per param group and dtype (param_groups[{label}], {p.dtype})"
            )


def summary(state: Mapping[str, Any] | None) -> Any:
    """Returns a param's torch.optim ``state`` as a value processes can compare: its keys
    and step count (None: no state)."""
    if not state:
        return None
    return {
        key: float(value) if key == "step" else type(value).__name__ for key, value in state.items()
    }


def core_entries(
    template: Mapping[str, Mapping[str, torch.Tensor]],
    paths: Sequence[str],
    params: Sequence[torch.Tensor],
    entries: Sequence[torch.Tensor],
    specs: Sequence[GroupSpec],
    per_param: PerParamState,
    masters: Mapping[int, torch.Tensor],
    *,
    block: int,
    keep_compensated: bool,
    template_holds_masters: bool,
) -> dict[str, dict[str, Any]]:
    """Returns the ``"params"`` of a core state dict in FP32 terms that holds torch.optim's
    state ``per_param`` (keyed by param-group entry) for ``params``: ``template`` is the
    core's current ``"params"``, ``paths[i]`` param ``i``'s key there, ``entries[i]`` its
    entry and ``specs[i]`` its group's structure; ``block`` the state's int8 block.

    A param's FP32 master is ``masters[id(param)]`` if given, else the template's (where
    ``template_holds_masters``: a sharded template is shapes only) or the param's own value;
    the param is its master rounded, or, with ``keep_compensated``, stays as it is (a
    compensated param stays where its correction reaches the master: load the model's weights
    first, and saving and loading is exact; else it is rounded).
    """
    out = {}
    for path, p, entry, spec in zip(paths, params, entries, specs, strict=True):
        mine = saved_format.canonical(template[path], block)
        opt = {key: value for key, value in mine.items() if key.startswith("opt")}
        leaf = from_torch(spec, opt, per_param.get(entry, {}))
        master = masters.get(id(p))
        if master is None:
            master = mine.get("master", p) if template_holds_masters else p
        keep = keep_compensated and p.dtype != torch.float32
        leaf["param"] = (p.detach().clone() if keep else master.detach().to(p.dtype)).reshape(
            p.shape
        )
        if "master" in mine:
            leaf["master"] = master.detach().float().reshape(p.shape)
        out[path] = leaf
    return out


def unused(
    per_param: PerParamState,
    params: Sequence[torch.Tensor],
    entries: Sequence[torch.Tensor],
    specs: Sequence[GroupSpec],
) -> dict[int, dict[str, torch.Tensor]]:
    """Returns ``{id(param): the tensors of its state in per_param that its group's structure
    (``specs[i]``) does not use}``, copies in FP32 on the param's device: torch.optim keeps
    them (amsgrad or momentum off, then on again, resumes them)."""
    out = {}
    for p, entry, spec in zip(params, entries, specs, strict=True):
        saved, used = per_param.get(entry, {}), keys(spec)
        dormant = {
            name: saved[name].detach().to(p.device, torch.float32, copy=True)
            for name in TORCH_NAMES.values()
            if name not in used and isinstance(saved.get(name), torch.Tensor)
        }
        if dormant:
            out[id(p)] = dormant
    return out
