"""The core's per-param state <-> torch.optim's per-param state dicts, and what they may hold.

Layer: ``facade`` (docs/design.md). Which entry of a param's part of the core's state
(:func:`fp16fx.checkpoint.per_leaf`: ``opt[...].mu``, ``opt[...].count``...) torch.optim
calls ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``momentum_buffer`` and ``step``.
torch keeps no state for a param before its first step, and SGD without momentum keeps none
at all. Loading goes through the core's own state dict in FP32 terms (:func:`core_entries`),
so that the core's checks and encodings apply unchanged.

What SGD's, Adam's and AdamW's per-param state may hold is defined once (:data:`STATE_KEYS`,
:func:`check`, :func:`check_values`): a loaded ``optimizer_state_dict``
(:func:`check_state_dict`) and the state a wrapped optimizer already holds when the fast path
takes it over (:mod:`fp16fx.facade.takeover`) are checked by it alike.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch

from fp16fx import saved_format
from fp16fx.facade.groups import GroupSpec, check_saved_numbers, describe, fast_kind
from fp16fx.precision import reaches
from fp16fx.tree import is_finite

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


#: What torch.optim's SGD, Adam and AdamW keep per param, by kind (:func:`fast_kind`).
_ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
STATE_KEYS = {"sgd": ("momentum_buffer",), "adam": _ADAM_KEYS, "adamw": _ADAM_KEYS}
#: The buffers torch starts lazily, which a state may lack or hold as None: SGD's momentum
#: (none before a step with momentum), AMSGrad's maximum (none while amsgrad is off). A state
#: that is not empty holds every other key of its kind: torch's step reads them.
LAZY = frozenset({"momentum_buffer", "max_exp_avg_sq"})
#: The tensors that are never negative (Adam's second moments).
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


def check(kind: str | None, like: torch.Tensor, state: Any, where: str) -> None:
    """Raises ValueError, naming the entry as ``where[key]``, unless ``state`` has the form of
    the per-param state torch.optim's ``kind`` optimizer keeps for a param shaped like
    ``like``: a dict of its :data:`STATE_KEYS` only; once not empty, each but the
    :data:`LAZY` buffers, which may be None; a ``step`` that is a number or a one-element
    tensor; the others floating-point tensors of the param's shape, holding their values (not
    meta, not sparse). ``kind`` None: a class whose state fp16fx does not know (a dict, loaded
    as torch loads it). Reads no values: :func:`check_values` does."""
    if not isinstance(state, Mapping):
        raise ValueError(f"{where} is not a dict")
    if kind is None or not state:
        return
    extra = sorted(set(state) - set(STATE_KEYS[kind]))
    if extra:
        raise ValueError(
            f"{where} has {extra}, which torch.optim.{describe(GroupSpec(kind))} does not "
            "keep (from another optimizer's state?)"
        )
    missing = sorted(set(STATE_KEYS[kind]) - LAZY - set(state))
    if missing:
        raise ValueError(f"{where} lacks {missing}")
    for key, value in state.items():
        if key == "step":
            if not _one_number(value):
                raise ValueError(f"{where}['step'] is {value!r}, not a step count")
        elif value is None:
            if key not in LAZY:
                raise ValueError(f"{where}[{key!r}] is None, not a tensor")
        else:
            why = tensor_fault(value, like)
            if why is not None:
                raise ValueError(f"{where}[{key!r}] {why}")


def check_values(kind: str | None, state: Mapping[str, Any], where: str) -> None:
    """Raises ValueError, naming the entry as ``where[key]``, where ``state`` (one
    :func:`check` passed) holds values no run keeps: a ``step`` that is no step count
    (:func:`is_torch_step_count`), inf or NaN in a moment, NaN or negative values in a second moment
    (:func:`~fp16fx.saved_format.value_fault`). ``kind`` None: nothing is checked (see
    :func:`check`). One sync per tensor."""
    if kind is None:
        return
    for key, value in state.items():
        if key == "step":
            if not is_torch_step_count(value):
                raise ValueError(f"{where}['step'] is {value!r}, not a step count")
        elif value is not None:
            why = saved_format.value_fault(value, key in _NON_NEGATIVE)
            if why is not None:
                raise ValueError(f"{where}[{key!r}] {why}")


def _one_number(value: Any) -> bool:
    """Whether ``value`` is a real number (not a bool) or a one-element tensor holding one."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_meta
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_torch_step_count(value: Any) -> bool:
    """Whether ``value`` (a number or a one-element tensor: one sync) is a step count as
    torch.optim keeps one: a whole number >= 0 that the core's int64 counts hold."""
    if not _one_number(value):
        return False
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):  # a tensor's bool, complex
        return False
    return is_finite(value) and 0 <= value < 2**63 and value == int(value)


def tensor_fault(value: Any, like: torch.Tensor, dtype: torch.dtype | None = None) -> str | None:
    """Returns why ``value`` cannot stand for a floating-point tensor (of ``dtype``, if given)
    of ``like``'s shape -- it is no tensor, a meta or sparse one, or has another shape or
    dtype -- or None where it can. Reads no values."""
    if not isinstance(value, torch.Tensor):
        return f"is a {type(value).__name__}, not a tensor"
    if value.is_meta or value.layout != torch.strided:
        what = "meta" if value.is_meta else value.layout
        return f"is a {what} tensor, not one holding its values"
    if value.shape != like.shape:
        return f"has shape {tuple(value.shape)}, its param {tuple(like.shape)}"
    if dtype is not None and value.dtype != dtype:
        return f"has dtype {value.dtype}, expected {dtype}"
    if not value.is_floating_point():
        return f"has dtype {value.dtype}, expected a floating-point tensor"
    return None


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
        master = master.detach().reshape(p.shape)
        leaf["param"] = master.to(p.dtype)
        if keep_compensated and p.dtype != torch.float32:
            # Not where no correction reaches the master: the load would take the model's
            # param there for one written since the save (saved_format.master_of).
            kept = p.detach().to(master.device)
            leaf["param"] = torch.where(reaches(kept, master), kept, leaf["param"])
        if "master" in mine:
            leaf["master"] = master.float()
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


# -- a torch.optim state dict loaded into an FP16_Optimizer -----------------------------------


def check_state_dict(optimizer: torch.optim.Optimizer, osd: Any) -> list[dict[str, Any]]:
    """Returns ``optimizer``'s param groups as they will be after loading ``osd`` (the
    ``optimizer_state_dict`` of an FP16_Optimizer dict); raises ValueError naming the first
    entry that does not fit: the number of groups and of params per group, the numbers
    ``optimizer``'s class steps with (SGD, Adam, AdamW), and each param's state (:func:`check`,
    :func:`check_values`; any other class's: a dict).

    An AMSGrad group's state may lack ``max_exp_avg_sq`` here: the fast path starts it at
    zero, as when amsgrad is switched on (a dict saved then lacks it). Where torch's own step
    will run the groups, :func:`require_amsgrad_maximum` refuses that."""
    if not (isinstance(osd, Mapping) and {"state", "param_groups"} <= set(osd)):
        raise ValueError("optimizer_state_dict must be a dict with 'state' and 'param_groups'")
    saved_groups, groups = osd["param_groups"], optimizer.param_groups
    if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(groups):
        n = len(saved_groups) if isinstance(saved_groups, (list, tuple)) else saved_groups
        raise ValueError(
            f"optimizer_state_dict has {n} param group(s), this optimizer {len(groups)}"
        )
    entries: dict[Any, torch.Tensor] = {}
    merged = []
    for k, (saved, group) in enumerate(zip(saved_groups, groups)):
        ids = saved.get("params") if isinstance(saved, Mapping) else None
        if not isinstance(ids, (list, tuple)) or len(ids) != len(group["params"]):
            n = len(ids) if isinstance(ids, (list, tuple)) else ids
            raise ValueError(
                f"param group {k} has {n} params in optimizer_state_dict, "
                f"{len(group['params'])} in this optimizer"
            )
        check_saved_numbers(optimizer, k, saved)
        entries.update(zip(ids, group["params"]))
        merged.append({**group, **saved, "params": group["params"]})
    state = osd["state"]
    if not isinstance(state, Mapping):
        raise ValueError("optimizer_state_dict['state'] must be a dict")
    kind = fast_kind(optimizer)
    for key, value in state.items():
        if key not in entries:
            raise ValueError(f"optimizer_state_dict['state'] has an entry {key!r} for no param")
        where = f"optimizer_state_dict['state'][{key!r}]"
        check(kind, entries[key], value, where)
        check_values(kind, value, where)
    return merged


def require_amsgrad_maximum(
    optimizer: torch.optim.Optimizer, osd: Mapping[str, Any], groups: list[dict[str, Any]]
) -> None:
    """Raises ValueError unless each param that stepped in an AMSGrad group has its
    ``max_exp_avg_sq``: torch's own step reads it (``osd`` one :func:`check_state_dict`
    passed; ``groups`` the groups it returned)."""
    if fast_kind(optimizer) not in ("adam", "adamw"):
        return
    amsgrad = [(bool(g.get("amsgrad")), s["params"]) for s, g in zip(osd["param_groups"], groups)]
    lacking = lacking_amsgrad_maximum(amsgrad, osd["state"])
    if lacking:
        raise ValueError(f"optimizer_state_dict['state'][{lacking[0]!r}] lacks ['max_exp_avg_sq']")
