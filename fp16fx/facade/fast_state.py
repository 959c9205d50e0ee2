"""The fast engine's core state seen from outside: as a checkpoint keeps it, in torch.optim's
per-param format, and what a load of that format hands the core.

Layer: ``facade`` (docs/design.md). Plain functions of the data they are given -- a
:class:`~fp16fx.state.MixedPrecisionState`, the engine's params in ``flat.params`` order, their
param-group entries and group structures -- that return values and change nothing of the
engine's (but :func:`entries`, which makes each FP32 master a leaf that requires grad, as a
param group's params are). :class:`~fp16fx.facade.fast.FastEngine` keeps thin methods over
them and assigns its own attributes. The per-param translation itself is
:mod:`fp16fx.facade.torch_state`'s; the loading, the core's (``fp16fx.checkpoint``) or
``fp16fx.distributed``'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from fp16fx import checkpoint, saved_format, tree
from fp16fx.facade import torch_state
from fp16fx.facade.groups import GroupSpec
from fp16fx.facade.torch_state import PerParamState
from fp16fx.precision import Precision
from fp16fx.scaling import LossScaleState
from fp16fx.segments import Segments
from fp16fx.state import FP32, MixedPrecisionState
from fp16fx.step import adopt_written_, was_written


def fp32_masters(
    params: Sequence[torch.Tensor], state: MixedPrecisionState
) -> dict[int, torch.Tensor]:
    """Returns ``{id(param): FP32 master}`` for every FP16/BF16 param among ``params`` (the
    engine's, in ``flat.params`` order) of ``state``: views of its flat masters, or in a
    compensated state the masters decoded (new tensors)."""
    pairs = zip(params, tree.flatten(state.master)[0])
    return {id(p): master for p, master in pairs if p.dtype != torch.float32}


def entries(
    params: Sequence[torch.Tensor], state: MixedPrecisionState, hold_params: bool
) -> dict[int, torch.Tensor]:
    """Returns ``{id(param): entry}``, what the param groups hold for each of ``params`` (in
    ``flat.params`` order): the param itself where ``hold_params`` (sharded, or compensated
    masters: no FP32 copy to hold) or it is FP32, else its FP32 master in ``state``, a view
    of the core's flat masters, made a leaf that requires grad as torch.optim's params do."""
    if hold_params:
        return {id(p): p for p in params}
    masters = tree.flatten(state.master)[0]
    return {
        id(p): p if p.dtype == torch.float32 else master.requires_grad_(True)
        for p, master in zip(params, masters)
    }


def saved_state(state: MixedPrecisionState) -> MixedPrecisionState:
    """Returns the core state ``state`` as a checkpoint keeps it: where a param was written
    since the last step (a clamp, the model's ``load_state_dict``), with copies of the FP32
    masters in which it has its written value (``step.adopt_written``), as a load must rebuild
    it; else ``state`` itself (one sync to tell). ``state`` is not touched, so saving leaves
    the run as it was: the step adopts a written param after its update, which adopting it in
    place before would change by the written difference's weight decay."""
    pairs = _written_pairs(state)
    if not pairs or not bool(torch.stack([was_written(p, m).any() for p, m in pairs]).any()):
        return state
    layout = state.layout
    copies = [  # (an FP32 param's segment is its own master: saved as it is)
        master if layout.buckets[seg.bucket].dtype == torch.float32 else master.clone()
        for seg, master in zip(layout.segments, state.master_segments)
    ]
    saved = state.replace(master_segments=Segments(copies, state.master_segments.labels))
    adopt_written_(_written_pairs(saved))
    return saved


def _written_pairs(state: MixedPrecisionState) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Returns the (FP16/BF16 param, FP32 master) leaves of ``state`` whose master a write of
    the param can leave behind: none in a compensated state, whose master is read from its
    param."""
    if state.precision.compensated:
        return []
    pairs = zip(tree.flatten(state.params)[0], tree.flatten(state.master)[0])
    return [(p, m) for p, m in pairs if p is not None and p.dtype != torch.float32]


def export(
    state: MixedPrecisionState,
    params: Sequence[torch.Tensor],
    entries: Sequence[torch.Tensor],
    devices: Sequence[torch.device | None],
    dormant: Mapping[int, Mapping[str, torch.Tensor]],
) -> PerParamState:
    """Returns ``state`` (unsharded) in torch.optim's per-param format, keyed by each param's
    entry (``params`` and ``entries`` in ``flat.params`` order), with the torch-format tensors
    its group's structure does not use now (``dormant``, ``{id(param): tensors}``) beside.

    Moments are views of the live buffers, as torch's own ``state_dict`` holds references (in
    a compact state, decoded: new tensors); a step count is on ``devices[i]`` (None: a
    Python-side count, as torch keeps it unless capturable or fused). Params that never took
    a step have no entry."""
    exported = torch_state.export(_leaves_fp32(state), entries, devices)
    for p, entry in zip(params, entries):
        if id(p) in dormant:
            exported.setdefault(entry, {}).update(dormant[id(p)])
    return exported


def _leaves_fp32(state: MixedPrecisionState) -> list[dict[str, torch.Tensor] | None]:
    """Returns each param's part of the core's ``state`` in FP32 terms: views of the live
    tensors, or in a compact state decoded (new tensors)."""
    leaves = checkpoint.per_leaf(state)
    if state.precision == FP32:
        return leaves
    block = state.precision.block
    return [None if leaf is None else saved_format.canonical(leaf, block) for leaf in leaves]


def segment_marks(state: MixedPrecisionState) -> torch.Tensor:
    """Returns, per param in ``flat.params`` order, the index of the core's segment of
    ``state`` that holds it (:meth:`fp16fx.flat.Layout.marks`), as one int64 tensor. A
    checkpoint carries these (``param_segments``): int8 moments' blocks start with each
    segment, and a clip's global norm is summed per segment; torch's format cannot say where
    the segments are, so without them a run would not resume bitwise."""
    return torch.tensor(state.layout.marks(), dtype=torch.int64)


def check_state(
    kind: str,
    params: Sequence[torch.Tensor],
    entries: Sequence[torch.Tensor],
    per_param: PerParamState,
    names: Mapping[int, str],
) -> None:
    """Raises ValueError, naming the param (``names``: ``{id(param): name}``), if a param's
    torch-format state in ``per_param`` (keyed by its entry; ``params`` and ``entries`` in
    ``flat.params`` order) does not fit it (its form, :func:`torch_state.check`: a load or a
    takeover checked its values first, :func:`torch_state.check_values`, and the engine's own
    export holds valid ones)."""
    for p, entry in zip(params, entries):
        try:
            torch_state.check(kind, entry, per_param.get(entry, {}), "state")
        except ValueError as err:
            name = names.get(id(p), "a param")
            raise ValueError(f"the torch-format state of {name}: {err}") from None


def core_state_dict(
    template: Mapping[str, Any],
    per_param: PerParamState,
    masters: Mapping[int, torch.Tensor],
    policy: Any,
    *,
    params: Sequence[torch.Tensor],
    entries: Sequence[torch.Tensor],
    specs: Sequence[GroupSpec],
    precision: Precision,
    device: torch.device,
    names: Mapping[int, str],
    sharded: bool,
) -> tuple[dict[str, Any], LossScaleState]:
    """Returns the state dict a core load takes for torch-format state ``per_param`` (keyed by
    param-group entry) and the FP32 ``masters`` given (``{id(model param): value}``), under
    loss-scale ``policy``, and the policy's first loss-scale state (on ``device``) it holds.

    ``template``: the core's state dict of the state to load into (sharded: the canonical
    template, which holds no masters); ``params``, ``entries`` and ``specs``: each param, its
    entry and its group's structure, in ``flat.params`` order; ``precision``: the state's.

    Raises ValueError when a state does not fit its param, or a param or master that the state
    would be built from holds inf or NaN (:func:`_check_finite_masters`).
    """
    paths = tree.leaf_paths(tree.flatten(params)[1])
    entry_states = torch_state.core_entries(
        template["params"],
        paths,
        params,
        entries,
        specs,
        per_param,
        masters,
        block=precision.block,
        keep_compensated=precision.compensated,
        template_holds_masters=not sharded,
    )
    _check_finite_masters(
        params, (entry_states[path] for path in paths), device, names, sharded=sharded
    )
    # The loss scale is the facade's, which its caller writes (a checkpoint's) or keeps:
    # a static optimizer's setter, or an apex scaler, may put one there that the policy
    # never reaches, which a core load refuses (scale_fault). The core loads the rest
    # beside the policy's first loss-scale state, in tensors of its own.
    first = policy.init(device)
    sd = {
        **saved_format.without_segments(template),  # the segments are given
        "policy": checkpoint.policy_dict(policy),
        "precision": saved_format.precision_dict(FP32),  # the entries are in FP32 terms
        "loss_scale": first._asdict(),
        "params": entry_states,
    }
    return sd, first


def _check_finite_masters(
    params: Sequence[torch.Tensor],
    entries: Iterable[Mapping[str, torch.Tensor]],
    device: torch.device,
    names: Mapping[int, str],
    *,
    sharded: bool,
) -> None:
    """Raises ValueError naming the first param (``params`` in ``flat.params`` order, their
    core-state ``entries`` alike) whose entry a load would build from a param or master
    holding inf or NaN: the model's own weights (a dict's masters are checked where it is
    read), which a rebuild of the state (``add_param_group``, a group's new structure, the
    state a wrapped optimizer held) takes as they are. One sync, on ``device``."""
    values = [
        (p, entry[key])
        for p, entry in zip(params, entries)
        for key in ("param", "master")
        if key in entry
    ]
    # One sync: a dict's masters may sit on another device than the model (map_location)
    flags = [torch.isfinite(value).all().to(device) for _, value in values]
    finite = torch.stack(flags).tolist()
    if all(finite):
        return
    p = values[finite.index(False)][0]
    whose = " (as the group's first rank broadcast it)" if sharded else ""
    raise ValueError(
        f"{names.get(id(p), 'a param')}{whose} holds inf or NaN, and FP16_Optimizer "
        "builds its state here from the weights as they are (each param's master): write "
        "finite values into it first"
    )


__all__ = [
    "check_state",
    "core_state_dict",
    "entries",
    "export",
    "fp32_masters",
    "saved_state",
    "segment_marks",
]
