"""``FP16_Optimizer.state_dict``: apex's keys and meanings, and the sharded and FSDP2 forms.

Layer: ``facade`` (docs/design.md). The dict keeps apex's keys and meanings:

* ``optimizer_state_dict`` -- the wrapped optimizer's state dict in torch.optim's format, FP32
  masters in place of FP16/BF16 params (on the fast path it is produced from the core's
  state: ``exp_avg``, ``momentum_buffer``, ``step``... as torch names them);
* ``fp32_from_fp16`` -- per param group, the FP32 masters of its FP16/BF16 params;
* ``loss_scaler`` -- a plain dict (:func:`fp16fx.facade.policy.scaler_to_dict`), never a
  pickled object, so ``torch.load(..., weights_only=True)`` reads the file;
* ``dynamic_loss_scale``, ``overflow``, ``first_closure_call_this_step`` -- bools;
* ``applied_steps`` and ``param_segments`` (fp16fx's, the fast path's) -- the core's count of
  applied steps, which seeds compact precision's stochastic rounding (and tells a sharded
  load's ranks that their copies were saved at one step), and per param (one int64 tensor in
  param-group order) the core's segment that holds it: where int8 moments' blocks start,
  and the units the global gradient norm is summed over. torch's format keeps neither
  (absent: as they are, and as the step counts imply);
* ``trainable`` (fp16fx's) -- per param group, the positions of the params it trains (not
  frozen when it was built): the state and masters are keyed by position among them, so a
  load checks that the same params train (an apex dict lacks it: loaded by position, as
  apex did).

On an FSDP2 model the dict is DCP's (``FSDP_FORMAT``): the core's state with every per-param
tensor a DTensor laid out like its param (:func:`fp16fx.distributed.fsdp.state_dict`), the
param groups' numbers and the flags; ``torch.distributed.checkpoint`` saves and reshards it.

A sharded optimizer's dict is its rank's: ``fp16fx.distributed.state_dict`` of its state, its
param groups and the scaler entries; :func:`consolidate_state_dict` joins every rank's
(through ``fp16fx.distributed.consolidate``, the one consolidator) into the apex-format dict.

Loading one, every entry checked before anything changes, is :mod:`fp16fx.facade.loading`.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

import fp16fx.distributed as fdist
from fp16fx import dtensors, saved_format
from fp16fx.distributed import fsdp
from fp16fx.facade import torch_state
from fp16fx.facade.engines import Engine
from fp16fx.facade.fast import FastEngine
from fp16fx.facade.generic import GenericEngine
from fp16fx.facade.params import ParamSet
from fp16fx.facade.policy import Scaler, ScaleValues, scaler_to_dict
from fp16fx.scaling import DynamicLossScale

KEYS = (
    "loss_scaler",
    "dynamic_loss_scale",
    "overflow",
    "first_closure_call_this_step",
    "optimizer_state_dict",
    "fp32_from_fp16",
    "applied_steps",
    "param_segments",
    "trainable",
)
#: apex's two flags, saved beside the scaler.
FLAGS = ("overflow", "first_closure_call_this_step")
SHARDED_FORMAT = "fp16fx.FP16_Optimizer.sharded/2"
FSDP_FORMAT = "fp16fx.FP16_Optimizer.fsdp/1"


@contextlib.contextmanager
def _added(state: dict[torch.Tensor, Any], extra: dict[torch.Tensor, Any]) -> Iterator[None]:
    state.update(extra)
    try:
        yield
    finally:
        for key in extra:
            state.pop(key, None)


def scaler_entries(scaler: Scaler, flags: Mapping[str, bool]) -> dict[str, Any]:
    """Returns the entries beside the optimizer state: ``loss_scaler`` (a plain dict),
    ``dynamic_loss_scale``, and the ``flags`` (``overflow``, ``first_closure_call_this_step``)."""
    numbers = torch.stack([t.double() for t in scaler.state]).tolist()  # one sync
    values = ScaleValues(**dict(zip(scaler.state._fields, numbers)))
    return {
        "loss_scaler": scaler_to_dict(scaler.policy, values),
        "dynamic_loss_scale": isinstance(scaler.policy, DynamicLossScale),
        **{key: flags[key] for key in FLAGS},
    }


def trained_positions(inner: torch.optim.Optimizer, params: ParamSet) -> list[list[int]]:
    """Returns, per param group, the positions of the params it trains: all but those frozen
    when their group was added (``requires_grad`` then, whatever it is now), among which a
    checkpoint keys their state and masters by position."""
    frozen = {id(p) for p in params.frozen}  # a frozen param stays in its group itself
    return [
        [i for i, e in enumerate(g["params"]) if id(e) not in frozen] for g in inner.param_groups
    ]


def steps_fsdp2_shards(engine: Engine) -> bool:
    """Whether ``engine`` is the fast path over an FSDP2 model's shards (whose checkpoint is
    ``FSDP_FORMAT``, through DCP)."""
    return isinstance(engine, FastEngine) and engine.fsdp


def refuse_the_generic_path_on_fsdp2(
    inner: torch.optim.Optimizer, engine: Engine, params: ParamSet, call: str
) -> None:
    """Raises RuntimeError, naming ``call``, if ``engine`` is the generic path over an FSDP2
    model's DTensor params: it has no checkpoint, saved or loaded."""
    if steps_fsdp2_shards(engine) or not dtensors.has_dtensors(
        [p for ps in params.trainable for p in ps]
    ):
        return
    raise RuntimeError(
        f"{call} of an FP16_Optimizer on the generic path (the wrapped "
        f"torch.optim.{type(inner).__name__}) over an FSDP2 model is not supported: its state "
        "is the wrapped optimizer's, per-param DTensor shards that no FP16_Optimizer format "
        "holds (a fresh optimizer's DCP dict has no room for them, so a DCP load would drop "
        "them silently; an apex-format dict holds whole tensors). On FSDP2, checkpoint "
        "through the fast path: SGD, Adam or AdamW without maximize, path 'auto' or 'fast' "
        "(docs/distributed.md)"
    )


def state_dict(
    inner: torch.optim.Optimizer,
    engine: Engine,
    params: ParamSet,
    scaler: Scaler,
    flags: Mapping[str, bool],
) -> dict[str, Any]:
    """Returns the checkpoint dict (see the module docstring); a sync or two."""
    refuse_the_generic_path_on_fsdp2(inner, engine, params, "state_dict()")
    on_fsdp2 = steps_fsdp2_shards(engine)
    steps: dict[str, Any] = {}
    if isinstance(engine, GenericEngine):
        engine.resync_masters()  # a written param is saved as written (its step adopts it too)
        extra = {}
        masters = [
            [m for p, m in zip(ps, ms) if m is not p]
            for ps, ms in zip(params.trainable, params.masters)
        ]
    else:
        saved = engine.saved_state()  # a written param is saved as written
        if on_fsdp2:
            return {
                "format": FSDP_FORMAT,
                "state": fsdp.state_dict(saved, engine.flat.params),
                "param_groups": [group_numbers(g) for g in inner.param_groups],
                "trainable": trained_positions(inner, params),
                **{key: flags[key] for key in FLAGS},
            }
        if (sharded := engine.sharded) is not None:
            groups = inner.state_dict()["param_groups"]  # the state is the engine's
            positions = trained_positions(inner, params)
            trainable = [[g["params"][i] for i in at] for g, at in zip(groups, positions)]
            shard = fdist.ShardedState(
                sharded.flat, sharded.sharding, saved, sharded.treedef, sharded.trained
            )
            return {
                "format": SHARDED_FORMAT,
                "shard": fdist.state_dict(shard),
                "param_groups": groups,
                "trainable": trainable,
                **scaler_entries(scaler, flags),
            }
        extra, fp32 = engine.export(), engine.fp32_masters(saved)
        masters = [[fp32[id(p)] for p in ps if id(p) in fp32] for ps in params.trainable]
        # The count compact precision's rounding reads; in any precision, what tells a copy
        # saved a step later apart where the state holds no step counts (momentum SGD).
        steps["applied_steps"] = engine.state.count.clone()  # a copy, as torch's step counts
        # Where the state is cut: int8 blocks start there, and the global norm sums per
        # segment (a clip resumes bitwise only over the same cuts).
        steps["param_segments"] = engine.segment_marks()
    with _added(inner.state, extra):
        osd = inner.state_dict()
    return {
        **scaler_entries(scaler, flags),
        "optimizer_state_dict": osd,
        "fp32_from_fp16": masters,
        "trainable": trained_positions(inner, params),
        **steps,
    }


def group_numbers(group: Mapping[str, Any]) -> dict[str, Any]:
    """Returns a param group's entries but its params (lr, betas, ...)."""
    return {key: value for key, value in group.items() if key != "params"}


def consolidate_state_dict(shards: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Returns the apex-format ``FP16_Optimizer`` dict of a sharded run from all its ranks'
    dicts (any order); no process group needed.

    It loads into any ``FP16_Optimizer`` over the same params and optimizer: unsharded, or
    sharded at any world size. Tensors are views of one joined tensor per bucket and key.
    ``overflow`` is whether any rank's saw inf/NaN: each rank reads its own grads until a
    step agrees on them, and the step skips where any rank's hold one.

    Raises:
      ValueError: the dicts are not one complete sharded ``FP16_Optimizer`` checkpoint (or
        their param groups, trained params or loss scalers differ).
    """
    if not (
        isinstance(shards, Sequence)
        and len(shards) > 0
        and all(isinstance(d, Mapping) and d.get("format") == SHARDED_FORMAT for d in shards)
    ):
        raise ValueError(
            f"expected the list of every rank's {SHARDED_FORMAT!r} dict (a sharded "
            f"FP16_Optimizer's state_dict()), got {type(shards).__name__}"
        )
    full = fdist.consolidate([d["shard"] for d in shards])
    ranked = sorted(shards, key=lambda d: d["shard"]["rank"])
    first = ranked[0]
    for d in ranked[1:]:
        for key in ("param_groups", "trainable", "loss_scaler", "dynamic_loss_scale"):
            if d[key] != first[key]:
                raise ValueError(
                    f"rank {d['shard']['rank']}'s dict has another {key!r} than rank 0's: the "
                    "dicts were saved at different steps, or by different runs"
                )
    groups, trainable = first["param_groups"], first["trainable"]
    precision = saved_format.precision_of(full)
    leaves = [
        saved_format.canonical(full["params"][str(k)], precision.block)
        for k in range(len(full["params"]))
    ]
    keys = [pid for pids in trainable for pid in pids]
    state = torch_state.export(leaves, keys, [None] * len(leaves))
    rest = iter(leaves)
    masters = [
        [leaf["master"] for leaf in itertools.islice(rest, len(pids)) if "master" in leaf]
        for pids in trainable
    ]
    return {
        **{key: first[key] for key in ("loss_scaler", "dynamic_loss_scale", *FLAGS)},
        "overflow": any(d["overflow"] for d in ranked),
        "optimizer_state_dict": {"state": state, "param_groups": groups},
        "fp32_from_fp16": masters,
        "trainable": [
            [g["params"].index(pid) for pid in pids] for g, pids in zip(groups, trainable)
        ],
        # The ranks' count (a compact run's rounding reads it), in any precision: a sharded
        # state loaded from these dicts saves it again. A compact run's int8 blocks are one
        # run per bucket, as the step counts imply: no param_segments.
        "applied_steps": full["count"],
    }
