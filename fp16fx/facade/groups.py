"""torch.optim param groups -> the core's transforms (which groups the fast path can run).

Layer: ``facade`` (DESIGN.md). A param group of ``torch.optim.SGD``, ``Adam`` or ``AdamW``
becomes ``chain(clip_by_global_norm(max_norm), sgd | adam | adamw)`` from
:mod:`fp16fx.transforms`, the one definition of each optimizer's math. Its *structure*
(:class:`GroupSpec`: momentum on/off, nesterov, amsgrad, decoupled decay) is fixed when the
transform is built; its *numbers* (lr, betas, eps, weight decay, momentum, dampening, and the
clipping threshold) are 0-d tensors in the state, rewritten from ``param_groups`` each step.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch

from fp16fx.transforms import GradientTransformation, adam, adamw, chain, clip_by_global_norm, sgd

#: ``max_norm`` meaning "do not clip": the clip coefficient is then exactly 1.
NO_CLIP = sys.float_info.max
_KINDS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adam"}


class Unsupported(Exception):
    """The fast path cannot run this configuration; raised before anything is changed."""


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """The structure of a param group's transform (changing it means rebuilding)."""

    name: str  # "sgd", "adam" or "adamw"
    momentum: bool = False
    nesterov: bool = False
    amsgrad: bool = False


def fast_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """Returns ``"sgd"`` or ``"adam"`` when ``optimizer`` is exactly SGD, Adam or AdamW.

    Subclasses are excluded: they may change the math. ``foreach``, ``fused`` and
    ``capturable`` do not change it and are ignored.
    """
    return _KINDS.get(type(optimizer))


def group_spec(kind: str, group: dict[str, Any], index: int) -> GroupSpec:
    """Returns the structure of param group ``index``; raises Unsupported if the core lacks it."""
    for flag in ("maximize", "differentiable"):
        if group.get(flag):
            raise Unsupported(f"param group {index} has {flag}=True")
    if kind == "sgd":
        momentum = group["momentum"] != 0
        return GroupSpec("sgd", momentum=momentum, nesterov=momentum and bool(group["nesterov"]))
    name = "adamw" if group.get("decoupled_weight_decay") else "adam"
    return GroupSpec(name, amsgrad=bool(group["amsgrad"]))


def group_values(spec: GroupSpec, group: dict[str, Any]) -> dict[str, Any]:
    """Returns the core's hyperparameters for ``group`` (torch's ``betas`` -> beta1, beta2)."""
    values = {"lr": group["lr"], "weight_decay": group["weight_decay"]}
    if spec.name == "sgd":
        if spec.momentum:
            values.update(momentum=group["momentum"], dampening=group["dampening"])
    else:
        beta1, beta2 = group["betas"]
        values.update(beta1=beta1, beta2=beta2, eps=group["eps"])
    return values


def build_transform(spec: GroupSpec, values: dict[str, Any]) -> GradientTransformation:
    """Returns ``chain(clip_by_global_norm(NO_CLIP), <the group's optimizer>)``.

    Raises ValueError/TypeError (from the transforms) when a value is out of range.
    """
    v = {k: float(x) if isinstance(x, torch.Tensor) else x for k, x in values.items()}
    if spec.name == "sgd":
        momentum, dampening = v.get("momentum", 0.0), v.get("dampening", 0.0)
        named = sgd(v["lr"], momentum, dampening, v["weight_decay"], spec.nesterov)
    else:
        make = adamw if spec.name == "adamw" else adam
        named = make(v["lr"], (v["beta1"], v["beta2"]), v["eps"], v["weight_decay"], spec.amsgrad)
    return chain(clip_by_global_norm(NO_CLIP), named)
