"""``state_dict`` / ``load_state_dict`` for the functional state, keyed by each param's path.

Layer: ``step`` (docs/design.md). The dict holds only tensors and Python primitives, so
``torch.load(path, weights_only=True)`` reads it back::

    {
        "format": "fp16fx.state/1",
        "policy": {"type": "DynamicLossScale", "init_scale": 65536.0, ...},
        "precision": {"master": "fp32", "moments": "fp32", "block": 256},  # how it is stored
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
        "segments": {"fc.weight": 0, ...},           # the segment holding each param
    }

Tensors are views of the live state (as ``torch.optim``'s ``state_dict``): save the dict, or
copy it, before stepping again. ``segments`` (optional when loading: dicts saved before it,
consolidated sharded ones and FSDP2's lack it) says where the state was cut: a param that
missed a gradient got a segment of its own, and the step sums the global gradient norm per
segment, so a run resumes bitwise only over the same cuts, which equal step counts no longer
show. A load cuts the state there (where the state is laid out alike), and keeps the cuts it
had: resume into a fresh state.
Loading checks everything first -- format, policy, optimizer (its keys), every shape and
dtype -- and raises naming the first misfit, having changed nothing.
It converts what it can: another precision (``Precision``), or params of another float dtype.
What a saved dict may hold, and how its leaves read in FP32 terms, is
:mod:`fp16fx.saved_format`'s.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

import optree
import torch

from fp16fx import flat, tree
from fp16fx.precision import (
    Quantized,
    encode_master,
    encode_moment,
    map_moments,
)
from fp16fx.saved_format import (
    FORMAT,
    StateDictError,
    canonical_params,
    check_codes,
    check_compensable,
    check_dense,
    check_fits,
    full_param,
    leaf_scalars,
    master_of,
    misfit,
    past_range,
    precision_dict,
    precision_of,
    value_fault,
)
from fp16fx.segments import MASKED, named_segments
from fp16fx.state import MixedPrecisionState, check_state, recut
from fp16fx.transforms import Hyperparams


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


def moment_signs(opt_state: Any) -> dict[str, bool]:
    """Returns ``{leaf key: never negative}`` for each per-param moment of an optimizer state,
    e.g. ``{"opt[1].mu": False, "opt[1].nu": True}`` (the fields its state classes list in
    ``non_negative`` are never negative)."""
    marked = map_moments(lambda x, non_negative, k: non_negative, opt_state)
    return {
        f"opt{name}": any(v is True for v in node)
        for name, node in named_segments(marked)
        if any(isinstance(v, bool) for v in node)
    }


def non_negative_keys(signs: Mapping[str, bool]) -> frozenset[str]:
    """Returns the leaf keys, e.g. ``opt[1].nu``, of the moments that :func:`moment_signs`'
    ``signs`` say are never negative."""
    return frozenset(key for key, never in signs.items() if never)


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


def state_dict(state: MixedPrecisionState) -> dict[str, Any]:
    """Returns the state as a dict of tensors and primitives keyed by param path (see the
    module docstring); ``torch.save`` it, and ``load_state_dict`` it into a state made by
    ``fp16fx.init`` with the same params tree, optimizer and loss-scale policy."""
    check_state(state, "state_dict")
    trained = [
        (path, entry, mark)
        for path, entry, mark in zip(leaf_paths(state), per_leaf(state), state.layout.marks())
        if entry is not None
    ]
    return {
        "format": FORMAT,
        "policy": policy_dict(state.policy),
        "precision": precision_dict(state.precision),
        "loss_scale": dict(zip(state.loss_scale._fields, state.loss_scale)),
        "count": state.count,
        "hyperparams": hyperparam_tensors(state.opt_state),
        "params": {path: entry for path, entry, _ in trained},
        "segments": {path: mark for path, _, mark in trained},
    }


def state_dict_copy(state: MixedPrecisionState) -> dict[str, Any]:
    """Returns :func:`state_dict` with every tensor copied: a snapshot that a later in-place
    step, or a load into it, does not change."""
    return optree.tree_map(
        lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v,
        state_dict(state),
        none_is_leaf=True,
    )


def in_dtype_of(
    path: str, entry: dict[str, Any], like: Mapping[str, Any] | None, *, compensated: bool
) -> dict[str, Any]:
    """Returns a saved leaf's FP32-terms ``entry`` (at ``path``) for a param of ``like``'s
    dtype in a state with ``compensated`` masters or not. Where the master is encoded again
    -- into a compensated state, or over a param whose dtype changed since (FP16, BF16,
    FP32) -- an FP16/BF16 param's master is :func:`~fp16fx.saved_format.master_of` its saved
    param and master (a param written since is its master); with the dtype changed, that
    master -- or an FP32 param, its own -- stays, and the param is the master rounded to
    nearest. Raises StateDictError if, with the dtype changed, the master is not one a run
    saves (:func:`_master_fault`) or is past the new dtype's range."""
    dtype_changed = like is not None and entry["param"].dtype != like["param"].dtype
    if dtype_changed:  # the new param is rounded from the master: a faulty one is named here
        why = _master_fault(entry)
        if why is not None:
            raise misfit(f"['params'][{path!r}]{why}")
    # Into FP32 masters over the same dtype, param and master load as saved, and the next
    # step adopts a written param as the saving run's would (its weight decay reads the old
    # master). There a master no run saves stays as saved, for check_fits to refuse by name.
    if (compensated or dtype_changed) and _pair_as_saved(entry):
        entry = {**entry, "master": master_of(entry["param"], entry["master"])}
    if not dtype_changed:
        return entry
    master = entry.get("master", entry["param"]).float()
    out = {key: value for key, value in entry.items() if key not in ("param", "master")}
    dtype = like["param"].dtype
    why = past_range(master, dtype)
    if why is not None:
        key = "master" if "master" in entry else "param"
        raise misfit(f"['params'][{path!r}][{key!r}] {why}, which the {dtype} param cannot take")
    out["param"] = master.to(dtype)
    if "master" in like:
        out["master"] = master
    return out


def _master_fault(entry: Mapping[str, Any]) -> str | None:
    """Returns why a saved leaf's master is none a run saves -- an FP16/BF16 param's is a
    finite FP32 tensor of its shape, and an FP32 param is its own -- or None where it is
    one. The reason follows the leaf's name: it starts with the key, or a space."""
    param = entry["param"]
    if param.dtype == torch.float32:
        if "master" in entry:
            return "['master'] sits beside a torch.float32 param, its own master"
        return None
    if "master" not in entry:
        return f" lacks ['master'] beside its {param.dtype} param"
    master = entry["master"]
    if master.dtype != torch.float32:
        return f"['master'] has dtype {master.dtype}, not torch.float32"
    if master.shape != param.shape:
        return f"['master'] has shape {tuple(master.shape)}, its param's {tuple(param.shape)}"
    why = value_fault(master)
    return None if why is None else f"['master'] {why}"


def _pair_as_saved(entry: Mapping[str, Any]) -> bool:
    """Whether ``entry`` holds an FP16/BF16 param and the master a run saves beside it."""
    return entry["param"].dtype != torch.float32 and _master_fault(entry) is None


def _same_layout(
    template: Mapping[str, Any], sd: Mapping[str, Any], non_negative: frozenset[str]
) -> bool:
    """Whether ``sd`` holds exactly the stored tensors ``template`` does, shape for shape --
    an int8 moment's blocks where the state's sit, each block's scale saved alike by every
    leaf in it -- so a raw copy is exact (``non_negative``: as for :func:`check_fits`, which
    a second moment's +inf passes)."""
    try:
        check_fits(template, {**sd, "precision": template["precision"]}, non_negative)
    except (StateDictError, TypeError):
        return False
    return _shared_scales_agree(template, sd) and all(
        int(sd["params"][path][key]) == int(like)
        for path, entry in template["params"].items()
        for key, like in entry.items()
        if key.endswith(".offset")
    )


def _shared_scales_agree(template: Mapping[str, Any], sd: Mapping[str, Any]) -> bool:
    """:func:`scales_agree` for ``sd``'s leaves laid out as ``template``'s, whose
    ``.scales`` are views of the state's: a block is where its scale sits."""
    return scales_agree(
        (like[end].data_ptr(), sd["params"][path][key][end])
        for path, entry in template["params"].items()
        for key, like in entry.items()
        if key.endswith(".scales") and like.numel()  # (an empty leaf's: none)
        for end in (0, -1)
    )


def scales_agree(blocks: Iterable[tuple[Hashable, torch.Tensor]]) -> bool:
    """Whether saved leaves that share an int8 block save its scale alike: ``blocks`` are
    (the block, named alike by every leaf in it; the scale a leaf saved for it), a leaf's
    first and last (only those can hold another leaf too). A dict put together from two
    runs' may not agree, and one scale cannot decode both leaves' codes."""
    saved: dict[Hashable, torch.Tensor] = {}
    return all(torch.equal(saved.setdefault(block, scale), scale) for block, scale in blocks)


def load_state_dict(state: MixedPrecisionState, sd: Mapping[str, Any]) -> MixedPrecisionState:
    """Returns ``state`` holding the values of ``sd`` (a :func:`state_dict`), or raises.

    Every value is written into the state's own tensors (a model built on the params sees the
    loaded values; a compiled step keeps its addresses). Params saved with different step
    counts get segments of their own: the returned state is ``state`` cut where needed, over
    the same tensors (but int8 moments', whose blocks start again at each new segment: new
    codes and scales). Use it from now on.

    A dict saved in the state's precision loads bitwise. One saved in another precision (an
    FP32-master checkpoint into a compensated state, int8 moments into FP32 ones...) is
    decoded to FP32 and stored in the state's: the masters and moments are rounded to nearest
    (a compensated master: to ``1/256`` of an FP16 ulp, from the saved param wherever its
    correction reaches the saved master; compensated ones into FP32 masters load exactly,
    each param as :func:`fp16fx.saved_format.full_param` gives it). So is one saved over
    params of another float dtype
    (FP16, BF16 or FP32: the model's dtype changed): each param's FP32 master (an FP32
    param is its own) is kept, and the param becomes that master rounded to nearest. Either
    way a param written since the save's last step is its master, as the step adopts it
    (:func:`fp16fx.saved_format.master_of`).

    Raises:
      StateDictError: a missing or extra key, a wrong shape or dtype, another optimizer or
        loss-scale policy, a stored tensor its format does not store (a correction or int8
        codes of another dtype or kind, int8 scales that do not count the blocks or that no
        encoding gives), a meta or sparse tensor, a value no run saves (inf or NaN, but
        a second moment may be +inf; a negative count or second moment; a loss scale or
        counter no run under the policy holds), a master past the
        range of a param's new dtype or, into a compensated state, of its dtype (a pair at
        the midpoint to inf) --
        named; TypeError: ``state`` is no MixedPrecisionState, or ``sd`` not a dict. Nothing
        is changed.
    """
    return prepare_load(state, sd)()


def prepare_load(
    state: MixedPrecisionState, sd: Mapping[str, Any]
) -> Callable[[], MixedPrecisionState]:
    """Checks ``sd`` against ``state`` as :func:`load_state_dict` does, changing nothing, and
    returns the function that then writes it (and returns the state to use): for a caller
    that must agree on a load before anything is written (FSDP2's ranks each check their own
    shards). Raises as :func:`load_state_dict` does."""
    check_state(state, "load_state_dict")
    if not isinstance(sd, Mapping):
        raise TypeError(f"load_state_dict expects a dict, got {type(sd).__name__}")
    saved = precision_of(sd)
    if not isinstance(sd.get("params"), Mapping):
        raise misfit("it has no ['params'] dict")
    check_dense(sd)
    template = state_dict(state)
    mine = {**template, "params": canonical_params(template["params"], state.precision.block)}
    their_params = canonical_params(sd["params"], saved.block)
    signs = moment_signs(state.opt_state)
    check_codes(sd["params"], signs)
    theirs = {
        **sd,
        "precision": template["precision"],
        "params": {
            path: in_dtype_of(
                path, entry, mine["params"].get(path), compensated=state.precision.compensated
            )
            for path, entry in their_params.items()
        },
    }
    non_negative = non_negative_keys(signs)
    check_fits(mine, theirs, non_negative)
    if state.precision.compensated:
        check_compensable(theirs["params"])
    paths = leaf_paths(state)
    canon = [theirs["params"].get(path) for path in paths]
    marks = [None if entry is None else leaf_scalars(entry) for entry in canon]
    layout = state.layout.recut(marks)
    if "segments" in sd:  # the saved state's cuts, which equal step counts no longer show
        layout = layout.recut(_saved_cuts(layout, paths, sd["segments"]))
    if saved == state.precision:
        saved_entries = [sd["params"].get(path) for path in paths]
        layout = layout.recut(_block_restarts(layout, saved_entries, saved.block))
    state = recut(state, layout)
    exact = saved == state.precision and _same_layout(state_dict(state), sd, non_negative)

    def write() -> MixedPrecisionState:
        with torch.no_grad():
            if exact:  # as stored: bitwise
                for path, targets in zip(paths, per_leaf(state)):
                    if targets is not None:
                        for key, dst in targets.items():
                            if not key.endswith(".offset"):
                                dst.copy_(sd["params"][path][key])
            else:
                store(state, canon)
            if not state.precision.compensated:
                masters, params = tree.flatten(state.master)[0], tree.flatten(state.params)[0]
                for master, param in zip(masters, params):
                    if param is None:
                        continue
                    if param.dtype == torch.float32:  # a leaf of its own has a master copy
                        master.copy_(param)
                    elif saved.compensated:  # a pair's param may tie with its master's rounding
                        param.copy_(full_param(param, master))
        load_shared(state, sd)
        return state

    return write


def _saved_cuts(layout: flat.Layout, paths: list[str], segments: Mapping[str, int]) -> list[Any]:
    """Returns per flat leaf its saved segment (``segments``), where every saved segment is
    one run of params in one of ``layout``'s buckets (the saved state was laid out alike);
    else no marks at all (in another layout -- a dtype changed, other buckets -- its cuts
    would split buckets at every param that sat in another saved bucket)."""
    marks = [segments.get(path) for path in paths]
    runs = [
        mark
        for bucket in layout.buckets
        for mark, _ in itertools.groupby(marks[i] for i in bucket.indices)
    ]
    return marks if len(runs) == len(set(runs)) else [None] * len(paths)


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
                # The segment's blocks, the bucket's zero padding included (the last one's).
                values = joined(key)
                values = torch.cat([values, values.new_zeros(stored.codes.numel() - len(values))])
                non_negative = stored.codes.dtype == torch.uint8
                q = encode_moment(values, "int8", non_negative, precision.block, None)
                stored.codes.copy_(q.codes)
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
