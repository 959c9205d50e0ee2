"""``state_dict`` / ``load_state_dict`` for the functional state, keyed by each param's path.

Layer: ``step`` (docs/design.md). The dict holds only tensors and Python primitives, so
``torch.load(path, weights_only=True)`` reads it back::

    {
        "format": "fp16fx.state/1",
        "policy": {"type": "DynamicLossScale", "init_scale": 65536.0, ...},
        "loss_scale": {"scale": tensor, "good_steps": tensor, "overflows": tensor},
        "count": tensor,                             # applied steps
        "hyperparams": {"opt[2]['lr']": tensor, ...}, # by place in the optimizer's state
        "params": {
            "fc.weight": {                           # the param's path in the params tree
                "param": tensor,                     # the model-dtype value
                "master": tensor,                    # FP32 master (FP16/BF16 params only)
                "opt[1].count": tensor,              # the optimizer's per-param state
                "opt[1].mu": tensor, ...
            },
            ...
        },
    }

Tensors are views of the live state (as ``torch.optim``'s ``state_dict``): save the dict, or
copy it, before stepping again. Loading checks everything first -- format, policy, optimizer
(its keys), every shape and dtype -- and raises naming the first misfit, having changed nothing.
It converts what it can: another precision (``Precision``), or params of another float dtype.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

import optree
import torch

from fp16fx import flat, tree
from fp16fx.precision import (
    Precision,
    Quantized,
    correction_dtype,
    decode_master,
    decode_moment,
    encode_master,
    encode_moment,
)
from fp16fx.scaling import check_scale
from fp16fx.segments import MASKED, named_segments
from fp16fx.state import MixedPrecisionState, recut
from fp16fx.transforms import Hyperparams, check_hyperparam

FORMAT = "fp16fx.state/1"


def leaf_paths(state: MixedPrecisionState) -> list[str]:
    """Returns each flat param leaf's key in a state dict: its path, e.g. ``fc.weight``."""
    return tree.leaf_paths(state.layout.treedef)


def policy_dict(policy: Any) -> dict[str, Any]:
    """Returns a loss-scale policy as primitives: its class name and its fields."""
    return {"type": type(policy).__name__, **dataclasses.asdict(policy)}


def hyperparam_tensors(opt_state: Any) -> dict[str, torch.Tensor]:
    """Returns every hyperparameter tensor of an optimizer's state by its key, e.g.
    ``opt[2]['lr']``."""
    accessors, leaves, _ = optree.tree_flatten_with_accessor(
        opt_state, is_leaf=lambda x: isinstance(x, Hyperparams), none_is_leaf=True
    )
    out = {}
    for accessor, leaf in zip(accessors, leaves):
        if isinstance(leaf, Hyperparams):
            for name, t in leaf.items():
                out[f"opt{accessor.codify('')}[{name!r}]"] = t
    return out


def blocks_of(start: int, end: int, block: int) -> slice:
    """Returns which int8 blocks a leaf of values ``[start, end)`` overlaps: the ``.scales``
    a state dict saves for it (its ``.offset`` in the first is ``start % block``)."""
    return slice(start // block, -(-end // block))


def per_leaf(state: MixedPrecisionState) -> list[dict[str, torch.Tensor] | None]:
    """Returns, per flat param leaf, its tensors under their state-dict keys (views of the
    state, as stored): ``param``; ``master`` (an FP16/BF16 param's FP32 master) or
    ``correction`` (a compensated one's); its part of every per-param tensor of the
    optimizer's state -- an int8 moment as ``<key>.codes``, the ``<key>.scales`` of the blocks
    it overlaps and ``<key>.offset`` (where it starts in the first). None for untrained
    leaves."""
    layout, block = state.layout, state.precision.block
    opt = named_segments(state.opt_state)
    out: list[dict[str, torch.Tensor] | None] = [None] * layout.num_leaves
    params = tree.flatten(state.params)[0]
    if state.precision.compensated:
        masters = [None] * layout.num_leaves
    else:
        masters = tree.flatten(state.master)[0]
    for k, seg in enumerate(layout.segments):
        bucket = layout.buckets[seg.bucket]
        n = seg.hi - seg.lo
        parts: dict[str, list[torch.Tensor]] = {}
        if state.precision.compensated and bucket.dtype != torch.float32:
            parts["correction"] = flat.views(bucket, state.master_segments[k], seg.lo, seg.hi)
        for name, node in opt:
            value, key = node[k], f"opt{name}"
            if value is MASKED or value is None:
                continue
            if isinstance(value, Quantized):
                parts[f"{key}.codes"] = flat.views(bucket, value.codes, seg.lo, seg.hi)
                starts = [bucket.offsets[j] - seg.start for j in range(seg.lo, seg.hi + 1)]
                parts[f"{key}.scales"] = [
                    value.scales[blocks_of(a, b, block)] for a, b in itertools.pairwise(starts)
                ]
                parts[f"{key}.offset"] = [
                    torch.tensor(a % block, device=value.codes.device) for a in starts[:-1]
                ]
            elif value.ndim == 0:
                parts[key] = [value] * n
            else:
                parts[key] = flat.views(bucket, value, seg.lo, seg.hi)
        for j, i in enumerate(bucket.indices[seg.lo : seg.hi]):
            entry = {"param": params[i]}
            if masters[i] is not None and bucket.dtype != torch.float32:
                entry["master"] = masters[i]
            entry.update({key: values[j] for key, values in parts.items()})
            out[i] = entry
    return out


def precision_dict(precision: Precision) -> dict[str, Any]:
    """Returns a state's :class:`~fp16fx.precision.Precision` as primitives."""
    return dataclasses.asdict(precision)


def state_dict(state: MixedPrecisionState) -> dict[str, Any]:
    """Returns the state as a dict of tensors and primitives keyed by param path (see the
    module docstring); ``torch.save`` it, and ``load_state_dict`` it into a state made by
    ``fp16fx.init`` with the same params tree, optimizer and loss-scale policy."""
    paths = leaf_paths(state)
    return {
        "format": FORMAT,
        "policy": policy_dict(state.policy),
        "precision": precision_dict(state.precision),
        "loss_scale": dict(zip(state.loss_scale._fields, state.loss_scale)),
        "count": state.count,
        "hyperparams": hyperparam_tensors(state.opt_state),
        "params": {path: entry for path, entry in zip(paths, per_leaf(state)) if entry is not None},
    }


class StateDictError(ValueError):
    """A state dict does not fit the state it is loaded into; the message names the key."""


def _fail(message: str) -> StateDictError:
    return StateDictError(f"the state dict does not fit this state: {message}")


def _check_tensor(where: str, value: Any, like: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor):
        raise _fail(f"{where} is a {type(value).__name__}, not a tensor")
    if value.shape != like.shape:
        raise _fail(f"{where} has shape {tuple(value.shape)}, this state's {tuple(like.shape)}")
    if value.dtype != like.dtype:
        raise _fail(f"{where} has dtype {value.dtype}, this state's {like.dtype}")


def _check_keys(where: str, saved: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    if not isinstance(saved, Mapping):
        raise _fail(f"{where} is a {type(saved).__name__}, not a dict")
    missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing:
        raise _fail(
            f"{where} lacks {missing} (was it saved from another optimizer or other params?)"
        )
    if extra:
        raise _fail(f"{where} has {extra}, which this state does not keep (another optimizer?)")


def check_fits(template: Mapping[str, Any], sd: Any) -> None:
    """Raises naming the first entry of ``sd`` that does not fit ``template`` (a state dict of
    the state it is to be loaded into: its keys, and tensors of the right shape and dtype).

    Raises:
      TypeError: ``sd`` is not a dict; StateDictError: anything else that does not fit.
    """
    if not isinstance(sd, Mapping):
        raise TypeError(f"load_state_dict expects a dict, got {type(sd).__name__}")
    if sd.get("format") != FORMAT:
        raise _fail(f"its format is {sd.get('format')!r}, expected {FORMAT!r}")
    _check_keys("the state dict", sd, template)
    if sd["policy"] != template["policy"]:
        raise _fail(
            f"it was saved with loss-scale policy {sd['policy']}, this state has "
            f"{template['policy']}"
        )
    for group in ("loss_scale", "hyperparams"):
        _check_keys(f"[{group!r}]", sd[group], template[group])
        for key, like in template[group].items():
            _check_tensor(f"[{group!r}][{key!r}]", sd[group][key], like)
    _check_tensor("['count']", sd["count"], template["count"])
    _check_values(sd)
    _check_keys("['params']", sd["params"], template["params"])
    for path, entry in template["params"].items():
        where = f"['params'][{path!r}]"
        _check_keys(where, sd["params"][path], entry)
        for key, like in entry.items():
            _check_tensor(f"{where}[{key!r}]", sd["params"][path][key], like)


def _check_values(sd: Mapping[str, Any]) -> None:
    """Raises StateDictError naming the first of ``sd``'s loss scale, hyperparameters and
    counts whose value the state cannot take: what the loss-scale policies and
    ``set_hyperparams`` refuse (a scale FP32 cannot hold, a NaN or negative lr), a negative
    count. (Meta tensors, a layout without values, are skipped.)"""
    scale = sd["loss_scale"]["scale"]
    if not scale.is_meta:
        try:
            check_scale("the loss scale", float(scale))
        except ValueError as err:
            raise _fail(f"['loss_scale']['scale']: {err}") from None
    for key, value in sd["hyperparams"].items():
        if not value.is_meta:
            try:
                check_hyperparam(key.rsplit("['", 1)[-1].rstrip("']"), value)  # opt[2]['lr']
            except (TypeError, ValueError) as err:
                raise _fail(f"['hyperparams'][{key!r}]: {err}") from None
    counts = {"['count']": sd["count"]}
    for name in ("good_steps", "overflows"):
        counts[f"['loss_scale'][{name!r}]"] = sd["loss_scale"][name]
    for where, count in counts.items():
        if not count.is_meta and int(count) < 0:
            raise _fail(f"{where} is {int(count)}, a count below 0")


def leaf_scalars(entry: Mapping[str, torch.Tensor]) -> tuple[float, ...]:
    """Returns a saved leaf's per-param scalars (step counts), in key order (one sync each)."""
    return tuple(
        float(v)
        for k, v in sorted(entry.items())
        if k.startswith("opt") and not k.endswith(".offset") and v.ndim == 0
    )


def saved_precision(sd: Mapping[str, Any]) -> Precision:
    """Returns the precision state dict ``sd`` was saved in (FP32 masters and moments for a
    dict saved before compact precision); raises StateDictError naming a malformed one."""
    saved = sd.get("precision", precision_dict(Precision()))
    try:
        return Precision(**saved)
    except (TypeError, ValueError) as err:
        raise _fail(f"['precision'] is {saved!r}: {err}") from None


def canonical(entry: Mapping[str, torch.Tensor], block: int) -> dict[str, torch.Tensor]:
    """Returns a saved leaf's entry in FP32 terms, whatever precision it was saved in: its
    ``param``, its ``master`` (FP16/BF16 params), and every optimizer tensor decoded.

    Raises _NotStored, naming the key, where a stored tensor is not of a dtype or shape its
    format stores (decoding it would silently give other numbers)."""
    _check_stored(entry, block)
    out = {"param": entry["param"]}
    if "master" in entry:
        out["master"] = entry["master"]
    elif "correction" in entry:
        out["master"] = decode_master(entry["param"], entry["correction"])
    for key, value in entry.items():
        if not key.startswith("opt") or key.endswith((".scales", ".offset")):
            continue
        if key.endswith(".codes"):
            name = key[: -len(".codes")]
            out[name] = _decode_leaf(value, entry[f"{name}.scales"], entry[f"{name}.offset"], block)
        else:
            out[key] = value.float() if value.ndim else value
    return out


class _NotStored(ValueError):
    """A saved leaf's tensor that its format does not store (named by its key)."""


def _check_stored(entry: Mapping[str, torch.Tensor], block: int) -> None:
    """Raises _NotStored naming the first tensor of a saved leaf whose dtype or shape its
    format does not store."""
    for key, value in entry.items():
        if not isinstance(value, torch.Tensor):
            raise _NotStored(f"[{key!r}] is a {type(value).__name__}, not a tensor")
    param = entry["param"]
    if param.dtype not in tree.MODEL_DTYPES:
        raise _NotStored(f"['param'] has dtype {param.dtype}, not FP16, BF16 or FP32")
    if "correction" in entry:
        if param.dtype == torch.float32:
            raise _NotStored("['correction'] beside an FP32 param, which is its own master")
        wanted = correction_dtype(param.dtype)
        if entry["correction"].dtype != wanted:
            raise _NotStored(
                f"['correction'] has dtype {entry['correction'].dtype}; a {param.dtype} "
                f"param's is {wanted}"
            )
    for key, value in entry.items():
        if key.endswith(".codes"):
            name = key[: -len(".codes")]
            offset, scales = entry[f"{name}.offset"], entry[f"{name}.scales"]
            # (Meta tensors, a layout without values, are checked for their kind only.)
            bad_kind = offset.ndim or offset.dtype != torch.int64
            if bad_kind or not (offset.is_meta or 0 <= int(offset) < block):
                raise _NotStored(f"[{name + '.offset'!r}] is not an int64 in [0, {block})")
            if value.dtype not in (torch.int8, torch.uint8):
                raise _NotStored(f"[{key!r}] has dtype {value.dtype}, not int8 or uint8 codes")
            blocks = None if offset.is_meta else -(-(int(offset) + value.numel()) // block)
            if (
                scales.dtype != torch.float32
                or scales.ndim != 1
                or blocks not in (None, len(scales))
            ):
                raise _NotStored(
                    f"[{name + '.scales'!r}] is {scales.dtype} of shape {tuple(scales.shape)}; "
                    f"its codes need {blocks} FP32 scales"
                )
        elif (
            key.startswith("opt")
            and value.ndim
            and not key.endswith(".scales")
            and value.dtype not in (torch.float32, torch.bfloat16)
        ):
            raise _NotStored(f"[{key!r}] has dtype {value.dtype}, not FP32 or BF16")


def _decode_leaf(
    codes: torch.Tensor, scales: torch.Tensor, offset: torch.Tensor, block: int
) -> torch.Tensor:
    """Returns the FP32 values of one leaf's part of an int8 moment (uint8 codes: a
    non-negative one)."""
    start = int(offset)
    padded = torch.cat([codes.reshape(-1).new_zeros(start), codes.reshape(-1)])
    stored = Quantized(padded, scales)
    return decode_moment(stored, codes.dtype == torch.uint8, block)[start:].view(codes.shape)


def canonical_params(params: Mapping[str, Any], block: int) -> dict[str, Any]:
    """Returns :func:`canonical` of every leaf entry of a state dict's ``params`` saved with
    int8 blocks of ``block`` values; raises StateDictError naming a malformed one."""
    out = {}
    for path, entry in params.items():
        where = f"['params'][{path!r}]"
        if not isinstance(entry, Mapping):
            raise _fail(f"{where} is a {type(entry).__name__}, not a dict")
        try:
            out[path] = canonical(entry, block)
        except KeyError as err:
            raise _fail(f"{where} lacks {err}") from None
        except _NotStored as err:
            raise _fail(f"{where}{err}") from None
        except (AttributeError, IndexError, TypeError, RuntimeError, ValueError) as err:
            raise _fail(f"{where} holds a malformed compact tensor: {err}") from None
    return out


def _in_dtype_of(entry: dict[str, Any], like: Mapping[str, Any] | None) -> dict[str, Any]:
    """Returns a saved leaf's FP32-terms ``entry`` for a param of ``like``'s dtype, where the
    model's dtype has changed since (FP16, BF16, FP32): its master -- the saved one, or an
    FP32 param, its own -- stays, and the param is that master rounded to nearest."""
    if like is None or entry["param"].dtype == like["param"].dtype:
        return entry
    master = entry.get("master", entry["param"]).float()
    out = {key: value for key, value in entry.items() if key not in ("param", "master")}
    out["param"] = master.to(like["param"].dtype)
    if "master" in like:
        out["master"] = master
    return out


def _same_layout(template: Mapping[str, Any], sd: Mapping[str, Any]) -> bool:
    """Whether ``sd`` holds exactly the stored tensors ``template`` does, shape for shape --
    an int8 moment's blocks where the state's sit -- so a raw copy is exact."""
    try:
        check_fits(template, {**sd, "precision": template["precision"]})
    except (StateDictError, TypeError):
        return False
    return all(
        int(sd["params"][path][key]) == int(like)
        for path, entry in template["params"].items()
        for key, like in entry.items()
        if key.endswith(".offset")
    )


def _check_dense(sd: Mapping[str, Any]) -> None:
    """Raises StateDictError naming the first tensor of ``sd`` that holds no values to load
    (a meta or sparse one)."""
    paths, leaves, _ = optree.tree_flatten_with_path(sd, is_leaf=torch.is_tensor)
    for path, value in zip(paths, leaves):
        if isinstance(value, torch.Tensor) and (value.is_meta or value.layout != torch.strided):
            kind = "meta" if value.is_meta else value.layout
            where = "".join(f"[{key!r}]" for key in path)
            raise _fail(f"{where} is a {kind} tensor, not one holding its values")


def load_state_dict(state: MixedPrecisionState, sd: Mapping[str, Any]) -> MixedPrecisionState:
    """Returns ``state`` holding the values of ``sd`` (a :func:`state_dict`), or raises.

    Every value is written into the state's own tensors (a model built on the params sees the
    loaded values; a compiled step keeps its addresses). Params saved with different step
    counts get segments of their own: the returned state is ``state`` cut where needed, over
    the same tensors. Use it from now on.

    A dict saved in the state's precision loads bitwise. One saved in another precision (an
    FP32-master checkpoint into a compensated state, int8 moments into FP32 ones...) is
    decoded to FP32 and stored in the state's: the masters and moments are rounded to nearest
    (a compensated master: to ``1/256`` of an FP16 ulp, from the saved param wherever its
    correction reaches the saved master). So is one saved over params of another float dtype
    (FP16, BF16 or FP32: the model's dtype changed): each param's FP32 master (an FP32
    param is its own) is kept, and the param becomes that master rounded to nearest.

    Raises:
      StateDictError: a missing or extra key, a wrong shape or dtype, another optimizer or
        loss-scale policy, a stored tensor its format does not store (a correction or int8
        codes of another dtype, int8 scales that do not count the blocks), a meta or sparse
        tensor -- named; TypeError: ``sd`` is not a dict. Nothing is changed.
    """
    if not isinstance(sd, Mapping):
        raise TypeError(f"load_state_dict expects a dict, got {type(sd).__name__}")
    saved = saved_precision(sd)
    if not isinstance(sd.get("params"), Mapping):
        raise _fail("it has no ['params'] dict")
    _check_dense(sd)
    template = state_dict(state)
    mine = {**template, "params": canonical_params(template["params"], state.precision.block)}
    their_params = canonical_params(sd["params"], saved.block)
    theirs = {
        **sd,
        "precision": template["precision"],
        "params": {
            path: _in_dtype_of(entry, mine["params"].get(path))
            for path, entry in their_params.items()
        },
    }
    check_fits(mine, theirs)
    paths = leaf_paths(state)
    canon = [theirs["params"].get(path) for path in paths]
    marks = [None if entry is None else leaf_scalars(entry) for entry in canon]
    layout = state.layout.recut(marks)
    if saved == state.precision:
        saved_entries = [sd["params"].get(path) for path in paths]
        layout = layout.recut(_block_restarts(layout, saved_entries, saved.block))
    state = recut(state, layout)
    exact = saved == state.precision and _same_layout(state_dict(state), sd)
    with torch.no_grad():
        if exact:  # as stored: bitwise
            for path, targets in zip(paths, per_leaf(state)):
                if targets is not None:
                    for key, dst in targets.items():
                        if not key.endswith(".offset"):
                            dst.copy_(sd["params"][path][key])
        else:
            store(state, canon)
        # An FP32 param kept as a leaf of its own has an FP32 master copy: it is the param.
        if not state.precision.compensated:
            for master, param in zip(tree.flatten(state.master)[0], tree.flatten(state.params)[0]):
                if param is not None and param.dtype == torch.float32:
                    master.copy_(param)
    load_shared(state, sd)
    return state


def _block_restarts(
    layout: flat.Layout, saved: list[Mapping[str, Any] | None], block: int
) -> list[int]:
    """Returns per flat leaf a mark that changes wherever the saved int8 moments' blocks
    restart and ``layout``'s would not: the saved state was cut there (its params' step
    counts, which cut it, have become equal again). A cut on a block boundary moves no block,
    and gets no mark."""
    marks = [0] * layout.num_leaves
    for bucket, cuts in zip(layout.buckets, layout.cuts):
        restarts, start = 0, 0
        for j, i in enumerate(bucket.indices):
            if j in cuts:
                start = bucket.offsets[j]
            offsets = [v for key, v in (saved[i] or {}).items() if key.endswith(".offset")]
            if offsets and int(offsets[0]) != (bucket.offsets[j] - start) % block:
                restarts, start = restarts + 1, bucket.offsets[j]
            marks[i] = restarts
    return marks


def store(state: MixedPrecisionState, entries: list[Any]) -> None:
    """Writes FP32-terms entries (:func:`canonical`), one per flat param leaf of ``state``,
    into its tensors segment by segment, encoding them in the state's precision (to nearest;
    a compensated master from the entry's param wherever its correction reaches)."""
    layout, precision = state.layout, state.precision
    opt = named_segments(state.opt_state)
    params = tree.flatten(state.params)[0]
    for k, seg in enumerate(layout.segments):
        bucket = layout.buckets[seg.bucket]
        mine = [entries[i] for i in bucket.indices[seg.lo : seg.hi]]
        for i, entry in zip(bucket.indices[seg.lo : seg.hi], mine):
            params[i].copy_(entry["param"])
        leaves = slice(0, seg.end - seg.start)  # the segment's padding keeps its zeros

        def joined(key: str, mine: list[Any] = mine) -> torch.Tensor:
            return torch.cat([e[key].reshape(-1) for e in mine])

        if bucket.dtype != torch.float32:
            master = joined("master")
            if precision.compensated:
                p, c = encode_master(master, bucket.dtype, None, param=joined("param"))
                state.flat_params()[k][leaves].copy_(p)
                state.master_segments[k][leaves].copy_(c)
            else:
                state.master_segments[k][leaves].copy_(master)
        for name, node in opt:
            stored, key = node[k], f"opt{name}"
            if stored is MASKED or stored is None:
                continue
            if isinstance(stored, Quantized):
                values = joined(key)
                non_negative = stored.codes.dtype == torch.uint8
                q = encode_moment(values, "int8", non_negative, precision.block, None)
                stored.codes[leaves].copy_(q.codes)
                stored.scales.copy_(q.scales)
            elif stored.ndim == 0:
                stored.copy_(mine[0][key])
            else:
                stored[leaves].copy_(joined(key).to(stored.dtype))


def load_shared(state: MixedPrecisionState, sd: Mapping[str, Any]) -> None:
    """Copies ``sd``'s loss-scale state, count and hyperparameters into ``state``'s tensors."""
    with torch.no_grad():
        for name, dst in zip(state.loss_scale._fields, state.loss_scale):
            dst.copy_(sd["loss_scale"][name])
        state.count.copy_(sd["count"])
        for key, dst in hyperparam_tensors(state.opt_state).items():
            dst.copy_(sd["hyperparams"][key])
