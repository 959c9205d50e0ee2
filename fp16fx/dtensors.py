"""DTensor leaves as their local shards: how fp16fx steps an FSDP2 (``fully_shard``) model.

Layer: ``tree`` (docs/design.md). Builds on ``torch.distributed.tensor`` alone.

FSDP2 holds every parameter as a ``DTensor`` placed ``Shard(0)`` on a 1-D device mesh: each
rank stores rows ``[r*c, (r+1)*c)`` of dim 0, ``c = ceil(rows / d)`` (the last ranks may hold
fewer rows, or none). After backward the gradients are DTensors of the same layout, already
reduce-scattered. Every optimizer fp16fx has works element by element, so a step runs on the
local shards as ordinary tensors -- views of FSDP's own storage, so writing them in place
writes the parameters FSDP gathers next -- and only the found-inf decision and the gradient
norm need the other ranks: one all-reduce over the mesh's process group.

Only ``Shard`` placements on a 1-D mesh are taken: there every element lives on exactly one
rank, so the global L2 norm is the root of the ranks' summed squares. ``Replicate`` (HSDP)
would count replicas more than once, and ``Partial`` values are summands, not elements.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, DTensor

from fp16fx import tree


def has_dtensors(leaves: list[Any]) -> bool:
    """Returns whether any of ``leaves`` is a DTensor."""
    return any(map(isinstance, leaves, itertools.repeat(DTensor)))


def local(t: DTensor) -> torch.Tensor:
    """Returns ``t``'s local shard: a plain tensor without autograd history that shares
    ``t``'s storage and version counter (writing it in place, under ``torch.no_grad()``,
    writes ``t``)."""
    with torch.no_grad():  # (DTensor.detach would give the shard a version counter of its own)
        return t.to_local().detach()


def local_shards(
    tree_: Any, root: str = "params", name_of: Callable[[int], str] | None = None
) -> tuple[Any, DeviceMesh | None, dist.ProcessGroup | None]:
    """Returns ``(tree_ with each DTensor leaf replaced by its local shard, mesh, group)``.

    ``mesh`` and ``group`` are the DTensors' device mesh and its process group (both None
    when no leaf is a DTensor; then ``tree_`` itself is returned). ``None`` leaves stay.

    Raises:
      ValueError: naming the leaf (``name_of(i)`` for leaf ``i``, if given; else its path in
        the tree, which ``root`` names): a placement other than
        ``Shard``, a mesh of more than one dim, DTensors on different meshes, or a plain
        tensor among DTensors (its elements would be counted once per rank). Nothing changes.
    """
    leaves, treedef = tree.flatten(tree_)
    if not has_dtensors(leaves):
        return tree_, None, None
    mesh = next(leaf.device_mesh for leaf in leaves if isinstance(leaf, DTensor))
    name_of = name_of or functools.partial(_name, tree_, root)
    for i, leaf in enumerate(leaves):  # names are made only for an error: they cost more
        if leaf is None:
            continue
        name = functools.partial(name_of, i)
        if not isinstance(leaf, DTensor):
            raise ValueError(
                f"{name()} is a plain {type(leaf).__name__} among DTensors: give every param "
                "as a DTensor of one mesh (fully_shard every module that holds params, or the "
                "root), or none"
            )
        check_placements(name, leaf)
        if leaf.device_mesh != mesh:
            raise ValueError(
                f"{name()} lives on {leaf.device_mesh}, the first DTensor on {mesh}: one step "
                "needs all DTensors on one device mesh (one process group agrees its skip)"
            )
    out = [None if leaf is None else local(leaf) for leaf in leaves]
    return tree.unflatten(treedef, out), mesh, mesh.get_group()


def _name(tree_: Any, root: str, i: int) -> str:
    return tree.leaf_names(tree_, root=root)[i]


def check_placements(name: Callable[[], str], t: DTensor) -> None:
    """Raises ValueError, naming the leaf (``name()``), unless ``t`` is sharded on a 1-D mesh."""
    if t.device_mesh.ndim != 1:
        raise ValueError(
            f"{name()} lives on a {t.device_mesh.ndim}-D mesh {t.device_mesh}: fp16fx steps "
            "DTensors sharded on a 1-D mesh (FSDP2's fully_shard), not HSDP or TP layouts"
        )
    placement = t.placements[0]
    if not placement.is_shard():
        raise ValueError(
            f"{name()} is placed {tuple(t.placements)}: fp16fx steps Shard placements only "
            f"({placement} does not give each rank its own elements; redistribute it to "
            "Shard first)"
        )


def like(value: torch.Tensor, t: DTensor) -> DTensor:
    """Returns ``value``, shaped like ``t``'s local shard, as a DTensor laid out like ``t``
    (sharing ``value``'s storage)."""
    return DTensor.from_local(
        value, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    )
