"""fp16fx on FSDP2 (``fully_shard``): its params' gradients, and checkpoints through DCP.

Layer: ``distributed`` (docs/design.md). The step itself needs nothing from here:
``fp16fx.init(dict(model.named_parameters()), ...)`` takes DTensor params (see
:mod:`fp16fx.dtensors`) and steps their local shards in place, agreeing the skip and the global
gradient norm over the mesh in one all-reduce. This module adds what a stateful client needs
(:class:`FSDPParams`, the facade's fast path on an FSDP2 model) and Distributed Checkpoint
(``torch.distributed.checkpoint``) conversions, which reshard between world sizes::

    model = ...; fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    params = dict(model.named_parameters())
    state = fp16fx.init(params, fp16fx.adamw(1e-3), fp16fx.DynamicLossScale())
    ...
    dcp.save({"model": get_model_state_dict(model),
              "optim": fsdp.state_dict(state, params)}, checkpoint_id=path)

    # any world size: a fresh state's dict (copies) is the template DCP loads into, then checked
    sd = {"model": get_model_state_dict(model), "optim": fsdp.state_dict(state, params)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    state = fsdp.load_state_dict(state, sd["optim"], params)

Or as one file (:func:`full_state_dict` gathers every DTensor whole; any world size loads it,
each rank taking its own shard)::

    whole = fsdp.full_state_dict(fsdp.state_dict(state, params))  # every rank gathers
    if dist.get_rank() == 0:
        torch.save(whole, "optim.pt")
    state = fsdp.load_state_dict(state, torch.load("optim.pt", weights_only=True), params)
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from fp16fx import checkpoint, dtensors, saved_format, tree
from fp16fx.distributed.agreement import checks_passed, loading_together
from fp16fx.state import FP32, MixedPrecisionState


class FSDPParams:
    """An FSDP2 model's DTensor params and their gradients' local shards (stateful).

    The counterpart of :class:`fp16fx.flat.FlatParams` for params that must stay where FSDP
    keeps them: nothing is moved or re-pointed; FSDP writes each ``p.grad`` (a DTensor,
    already reduce-scattered) and this reads its local shard, a view.

    Attributes:
      params: the params (DTensors sharded on one 1-D mesh).
      mesh, group: their device mesh and its process group.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        _, self.mesh, self.group = dtensors.local_shards(self.params)
        if self.mesh is None:
            raise ValueError("FSDPParams takes DTensor params (an FSDP2 model's)")
        self._addresses = [dtensors.local(p).data_ptr() for p in self.params]

    def grads(self) -> list[torch.Tensor | None]:
        """Returns each param's gradient's local shard (None: it has none).

        Raises:
          ValueError: a gradient is not laid out like its param (named).
        """
        grads = list(map(operator.attrgetter("grad"), self.params))
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is not None and (
                not isinstance(g, DTensor)
                or g.device_mesh != p.device_mesh
                or g.placements != p.placements
            ):
                raise ValueError(
                    f"param {i}'s gradient is not a DTensor placed like its param "
                    f"({tuple(p.placements)} on {p.device_mesh}): was it made outside FSDP?"
                )
        return [None if g is None else dtensors.local(g) for g in grads]

    def collect_grads(self) -> list[bool]:
        """Returns, per param, whether it has a gradient now."""
        return [p.grad is not None for p in self.params]

    @property
    def grad_buffers(self) -> list[torch.Tensor]:
        """The local shards of the gradients that exist."""
        return [g for g in self.grads() if g is not None]

    def moved(self) -> int | None:
        """Returns the index of the first param whose local shard is no longer where it was
        (the model was moved or re-sharded after the optimizer was built), else None."""
        for i, (p, address) in enumerate(zip(self.params, self._addresses)):
            if dtensors.local(p).data_ptr() != address:
                return i
        return None

    def zero_grads(self, set_to_none: bool) -> None:
        """Zeroes every gradient's local shard in place, or sets every ``p.grad`` to None."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                dtensors.local(p.grad).zero_()


def _by_path(state: MixedPrecisionState, params: Any) -> dict[str, torch.Tensor]:
    """Returns ``{path: param}`` for ``params``, the tree given to ``init``."""
    leaves, treedef = tree.flatten(params)
    if treedef != state.layout.treedef:
        raise ValueError(
            "params do not have the structure of the params this state was made from:\n"
            f"  state:  {state.layout.treedef}\n  params: {treedef}"
        )
    return dict(zip(checkpoint.leaf_paths(state), leaves))


def state_dict(state: MixedPrecisionState, params: Any) -> dict[str, Any]:
    """Returns ``fp16fx.state_dict(state)`` (without ``segments``) with each per-param tensor
    as a DTensor laid out like its param, for ``torch.distributed.checkpoint`` (which then
    saves each rank's part and reshards on load). 0-d tensors (loss scale, counts,
    hyperparameters) and primitives stay as they are: they are equal on every rank, and DCP
    keeps one copy.

    ``params``: the DTensor params given to ``init`` (e.g. ``dict(model.named_parameters())``).
    Every tensor is a copy: ``dcp.load`` into this dict writes nothing live, and
    :func:`load_state_dict` checks it all before it loads anything (a dict that does not fit
    leaves the state and the params as they were). Saving costs one copy of this rank's state.

    A compact state (docs/precision.md) gives its entries in FP32 terms, as copies
    (:func:`fp16fx.saved_format.canonical`: each FP16/BF16 param's FP32 master, FP32 moments),
    which :func:`load_state_dict` encodes back. So a DCP checkpoint is the same whatever
    precision saved it, and any state loads it (rounded to nearest into its own precision;
    into FP32 masters, a compensated pair's param as written: docs/precision.md);
    a state like the one that saved it, at the same world size, loads it bitwise, since
    decoding and encoding to nearest give back the same param, correction, codes and scales.
    (Int8 moments could not be saved as stored anyway: their block scales are cut where each
    rank's shard starts, which moves with the world size.)
    """
    # Without segments: an FSDP2 state keeps each DTensor param in a segment of its own
    # anyway, and DCP's load needs every key of this dict in the checkpoint (those saved
    # before segments lack it).
    sd = saved_format.without_segments(checkpoint.state_dict_copy(state))
    if state.precision != FP32:  # in FP32 terms (see above)
        block = state.precision.block
        decoded = {path: saved_format.canonical(e, block) for path, e in sd["params"].items()}
        sd = {**sd, "precision": saved_format.precision_dict(FP32), "params": decoded}
    by_path = _by_path(state, params)
    wrapped = {}
    for path, entries in sd["params"].items():
        param = by_path[path]
        wrapped[path] = {
            key: dtensors.like(value, param)
            if isinstance(param, DTensor) and value.ndim > 0
            else value
            for key, value in entries.items()
        }
    return {**sd, "params": wrapped}


def full_state_dict(sd: Mapping[str, Any]) -> dict[str, Any]:
    """Returns ``sd`` (nested dicts: a :func:`state_dict`, ``FP16_Optimizer.state_dict()`` on
    an FSDP2 model, a model's) with every DTensor gathered into a whole tensor on the CPU, for
    one ``torch.save`` file that :func:`load_state_dict` takes back at any world size. A
    collective: every rank calls it, and gets the whole state (its memory, on the CPU)."""
    return optree.tree_map(
        lambda v: v.full_tensor().cpu() if isinstance(v, DTensor) else v, dict(sd)
    )


def load_state_dict(
    state: MixedPrecisionState, sd: Mapping[str, Any], params: Any
) -> MixedPrecisionState:
    """Returns ``state`` holding ``sd``'s values: a :func:`state_dict` filled by ``dcp.load``
    (at any world size) or saved by it, or one gathered by :func:`full_state_dict`. Each
    DTensor is checked to be laid out like its param; of a whole tensor, each rank takes the
    shard its param holds. Then the values are loaded as by ``fp16fx.load_state_dict`` (which
    checks every key, shape and dtype first).

    The checks of values (finite, >= 0, in the param's range) read each rank's own shards, so
    one rank may refuse what another would load: the ranks of the params' mesh agree on the
    outcome (:func:`~fp16fx.distributed.agreement.loading_together`: one
    ``all_gather_object``), and where any refuses, every one raises and none has loaded it.

    Raises:
      fp16fx.StateDictError, ValueError: an entry does not fit (named; on the other ranks,
        with the refusing rank); nothing is changed, on any rank.
    """
    with loading_together(mesh_group(params)):
        write = checkpoint.prepare_load(state, _own_shards(state, sd, params))
        checks_passed()
        return write()


def mesh_group(params: Any) -> dist.ProcessGroup | None:
    """The process group of the DTensors among ``params`` (None: no DTensor)."""
    leaves = tree.flatten(params)[0]
    mesh = next((leaf.device_mesh for leaf in leaves if isinstance(leaf, DTensor)), None)
    return None if mesh is None else mesh.get_group()


def _own_shards(state: MixedPrecisionState, sd: Mapping[str, Any], params: Any) -> dict[str, Any]:
    """Returns ``sd`` with each per-param tensor replaced by this rank's shard of it (a
    DTensor checked to be laid out like its param: its local shard; a whole tensor: the part
    its param holds)."""
    by_path = _by_path(state, params)
    saved = sd.get("params", {})
    if not isinstance(saved, Mapping):
        raise saved_format.misfit(f"['params'] is a {type(saved).__name__}, not a dict")
    local: dict[str, Any] = {}
    for path, entries in saved.items():
        param = by_path.get(path)
        if param is None or not isinstance(entries, Mapping):
            local[path] = entries  # named by fp16fx.load_state_dict's checks, before any read
            continue
        out = {}
        for key, value in entries.items():
            where = f"['params'][{path!r}][{key!r}]"
            if isinstance(value, DTensor):
                _check_like(where, value, param)
                value = dtensors.local(value)
            elif isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.ndim:
                value = _own_shard(where, value, param)
            out[key] = value
        local[path] = out
    return {**sd, "params": local}


def _own_shard(where: str, whole: torch.Tensor, param: DTensor) -> torch.Tensor:
    """Returns this rank's shard of ``whole``, a tensor of ``param``'s global shape."""
    if whole.shape != param.shape:
        raise saved_format.StateDictError(
            f"the state dict does not fit this state: {where} is {tuple(whole.shape)}, a "
            f"whole tensor of its param's shape {tuple(param.shape)} or a DTensor laid out "
            "like it was expected"
        )
    # Every rank holds the whole tensor: each keeps its own shard, nothing is sent.
    mine = distribute_tensor(
        whole.to(param.device), param.device_mesh, param.placements, src_data_rank=None
    )
    return dtensors.local(mine)


def _check_like(where: str, value: DTensor, param: Any) -> None:
    if not (
        isinstance(param, DTensor)
        and value.device_mesh == param.device_mesh
        and tuple(value.placements) == tuple(param.placements)
        and value.shape == param.shape
    ):
        laid_out = (
            f"{tuple(param.shape)} placed {tuple(param.placements)} on {param.device_mesh}"
            if isinstance(param, DTensor)
            else f"{tuple(param.shape)}, not a DTensor"
        )
        raise saved_format.StateDictError(
            f"the state dict does not fit this state: {where} is {tuple(value.shape)} placed "
            f"{tuple(value.placements)} on {value.device_mesh}; its param is {laid_out}"
        )


__all__ = ["FSDPParams", "full_state_dict", "load_state_dict", "state_dict"]
