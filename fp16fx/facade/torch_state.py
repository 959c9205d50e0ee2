"""The core's per-segment optimizer state <-> torch.optim's per-param state dicts.

Layer: ``facade`` (DESIGN.md). Bookkeeping only: which tensor of the core's leaf state
(:class:`~fp16fx.transforms.TraceState`, :class:`~fp16fx.transforms.ScaleByAdamState`) holds
what torch.optim calls ``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` and
``step``. A *segment* is a run of consecutive params of one flat bucket; its leaf state holds
one step count and flat moments, of which each param owns a slice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import optree
import torch

from fp16fx.facade.groups import GroupSpec
from fp16fx.transforms import ScaleByAdamState, TraceState

#: torch.optim's per-param state, keyed by the tensor its param group holds.
PerParamState = dict[torch.Tensor, dict[str, Any]]
_STATEFUL = (TraceState, ScaleByAdamState)


@dataclasses.dataclass(frozen=True)
class Segment:
    """Params ``[lo, hi)`` of bucket ``bucket``, at ``[start, end)`` of its flat buffers."""

    bucket: int
    lo: int
    hi: int
    start: int
    end: int


def slice_leaf(leaf: Any, start: int, end: int, length: int) -> Any:
    """Returns the leaf state of elements ``[start, end)`` of a flat leaf state of ``length``.

    Moments become views (no copy); step counts become new 0-d tensors.
    """

    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.ndim == 0:
            return t.clone()
        if t.numel() == 0:
            return t.new_empty(0)
        if t.shape != (length,):
            raise RuntimeError(f"cannot segment a leaf state of shape {tuple(t.shape)}")
        return t[start:end]

    return optree.tree_map(cut, leaf)


def stateful(leaf: Any) -> TraceState | ScaleByAdamState | None:
    """Returns the part of a chain's leaf state that torch.optim would keep, if any."""
    found = optree.tree_leaves(leaf, is_leaf=lambda x: isinstance(x, _STATEFUL))
    return next((x for x in found if isinstance(x, _STATEFUL)), None)


def named_tensors(inner: TraceState | ScaleByAdamState) -> dict[str, torch.Tensor]:
    """Returns the leaf state's flat tensors under torch.optim's names (some may be empty)."""
    if isinstance(inner, TraceState):
        return {"momentum_buffer": inner.momentum_buffer}
    return {"exp_avg": inner.mu, "exp_avg_sq": inner.nu, "max_exp_avg_sq": inner.nu_max}


def keys(spec: GroupSpec) -> tuple[str, ...]:
    """Returns the per-param tensors torch.optim keeps for a group of structure ``spec``."""
    if spec.name == "sgd":
        return ("momentum_buffer",) if spec.momentum else ()
    return ("exp_avg", "exp_avg_sq", *(("max_exp_avg_sq",) if spec.amsgrad else ()))


def signature(spec: GroupSpec, saved: dict[str, Any]) -> int:
    """Returns what must be equal across a segment: Adam's step, or whether SGD has a buffer."""
    if spec.name == "sgd":
        return int(spec.momentum and saved.get("momentum_buffer") is not None)
    return int(float(saved.get("step", 0)))


def check(spec: GroupSpec, entry: torch.Tensor, saved: dict[str, Any]) -> None:
    """Raises ValueError if ``saved`` cannot be the torch state of ``entry`` under ``spec``."""
    if not saved:
        return
    if spec.name != "sgd" and "step" not in saved:
        raise ValueError(f"the saved state of a param of shape {tuple(entry.shape)} has no 'step'")
    for key in keys(spec):
        value = saved.get(key)
        if value is None and (spec.name == "sgd" or key == "max_exp_avg_sq"):
            continue  # torch starts these lazily
        if not isinstance(value, torch.Tensor) or value.shape != entry.shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else value
            raise ValueError(f"the saved {key!r} of a param of shape {tuple(entry.shape)} is {got}")


def fill(
    leaf: Any, spans: Sequence[tuple[int, int]], saved: Sequence[dict[str, Any]], count: int
) -> None:
    """Writes torch states ``saved`` (one per param, ``{}``: fresh) into a segment's leaf.

    ``spans`` are the params' ranges within the segment; ``count`` is their common signature.
    """
    inner = stateful(leaf)
    if inner is None:
        return
    with torch.no_grad():
        inner.count.fill_(count)
        for key, flat in named_tensors(inner).items():
            if flat.numel() == 0:
                continue
            for (a, z), state in zip(spans, saved):
                value = state.get(key)
                if value is None:
                    flat[a:z].zero_()
                else:
                    flat[a:z].copy_(value.reshape(-1))


def export(
    leaf: Any,
    count: int,
    spans: Sequence[tuple[int, int]],
    entries: Sequence[torch.Tensor],
    step_device: torch.device | None,
) -> PerParamState:
    """Returns torch states for a segment's params (``{}`` if they never took a step).

    Moments are views of the segment's buffers; ``step`` is a new float32 tensor on
    ``step_device`` (torch keeps it on the CPU unless the optimizer is capturable or fused).
    """
    inner = stateful(leaf)
    if inner is None or count == 0:
        return {}
    tensors = named_tensors(inner)
    out: PerParamState = {}
    for (a, z), entry in zip(spans, entries):
        state: dict[str, Any] = {}
        if isinstance(inner, ScaleByAdamState):
            state["step"] = torch.tensor(float(count), dtype=torch.float32, device=step_device)
        for key, flat in tensors.items():
            if flat.numel():
                state[key] = flat[a:z].view(entry.shape)
        out[entry] = state
    return out
