"""What every rank checks before a sharded or replicated init, agreed across the ranks.

Layer: ``distributed`` (docs/design.md). Before the params are broadcast (or moved into a
sharded state's buffers), every rank checks its arguments as ``fp16fx.init`` does, and the
ranks compare what they would build: params of the same structure, dtypes and shapes, and the
same state of them (precision, loss-scale policy, optimizer and hyperparameters). One
agreement (:func:`~fp16fx.distributed.agreement.initializing_together`) carries each rank's
refusal or its facts; every rank then compares the same facts and raises alike.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor

from fp16fx import checkpoint, dtensors, tree
from fp16fx.distributed.agreement import checks_passed, initializing_together
from fp16fx.init_arguments import Arguments, checked_arguments
from fp16fx.state import MixedPrecisionState, init
from fp16fx.step import step
from fp16fx.transforms import GradientTransformation


def check_on_every_rank(
    params: Any,
    optimizer: GradientTransformation,
    loss_scale: Any,
    group: Any,
    *,
    master: str,
    moments: str,
    buckets: bool,
    names: Sequence[str] | None = None,
    agreed: Sequence[tuple[str, Any]] = (),
) -> Arguments:
    """Returns ``fp16fx.init``'s checks of its arguments (:func:`checked_arguments`), run on
    every rank of ``group`` (None: the world) before the params are broadcast (or moved):
    where any rank refuses, holds other params, or builds another state of them (other
    ``master`` or ``moments``, loss-scale policy, optimizer or hyperparameters:
    :func:`_settings`; or any of the ``(name, value)`` pairs ``agreed``), every rank raises,
    nothing changed (a rank left alone would wait in the broadcast; ranks stepping by other
    rules would drift apart silently). A collective (or, inside an
    :func:`initializing_together` block of the group, that block's agreement). ``names``:
    each leaf's name in errors (default: its path in ``params``)."""
    with initializing_together(group):  # a label function's KeyError too: none must wait
        _refuse_dtensors(params)
        args = checked_arguments(
            params, optimizer, loss_scale, buckets=buckets, master=master, moments=moments
        )
        leaves, treedef = optree.tree_flatten(params, none_is_leaf=True)
        settings = [*_settings(args, optimizer), *agreed]
        ranks = checks_passed((str(treedef), [_kind(leaf) for leaf in leaves], settings))
    assert ranks is not None, "an initializing_together block agrees in its checks_passed"
    _check_alike(ranks, params, names)
    return args


def _settings(args: Arguments, optimizer: GradientTransformation) -> list[tuple[str, Any]]:
    """Returns what a state built from checked ``args`` keeps besides the params, as named
    Python values every rank can compare: the precision, the loss-scale policy (its fields,
    where it is a dataclass as fp16fx's are; else its class), and the optimizer's structure
    and hyperparameters -- read from the state it builds over one stand-in value per flat
    bucket (each bucket one segment of the state, labelled as the params are), so a
    transform's settings need no description of their own. What a transform keeps in no
    state entry (SGD's ``nesterov``, a flag of its update) shows in the state two steps of
    its update give the stand-ins (:func:`_stepped_stand_ins`)."""
    buckets = args.layout.buckets
    device = next(leaf.device for leaf in args.leaves if leaf is not None)
    stand_ins = [torch.zeros(1, dtype=b.dtype, device=device) for b in buckets]
    labels = tuple(b.label for b in buckets)
    probe = init(
        stand_ins,
        optimizer._replace(param_labels=None if args.labels is None else lambda _: labels),
        args.policy,
        buckets=True,
        master=args.precision.master,
        moments=args.precision.moments,
    )
    policy = args.policy
    accessors, _, _ = optree.tree_flatten_with_accessor(probe.opt_state, none_is_leaf=True)
    hyperparams = checkpoint.hyperparam_tensors(probe.opt_state)
    return [
        ("master", args.precision.master),
        ("moments", args.precision.moments),
        (
            "the loss-scale policy",
            checkpoint.policy_dict(policy)
            if dataclasses.is_dataclass(policy)
            else type(policy).__qualname__,
        ),
        ("the optimizer's state entries", [a.codify("opt") for a in accessors]),
        *((f"the hyperparameter {key}", t.tolist()) for key, t in hyperparams.items()),
        (
            "the update's result on a stand-in (it shows flags no state entry keeps, such as "
            "SGD's nesterov): a value",
            _stepped_stand_ins(probe, stand_ins),
        ),
    ]


def _stepped_stand_ins(probe: MixedPrecisionState, stand_ins: list[torch.Tensor]) -> list[str]:
    """Returns every value of ``probe``'s state after two steps (grads 1 and 1/2: a transform
    may treat a param's first step apart), to 6 significant digits: the ranks of one job run
    the same kernels on the same values. The steps draw from a generator seeded alike on
    every rank (a transform may draw noise, from ranks seeded apart) and restored after. A
    transform made for real shapes only gives the name of its error on a 1-value stand-in."""
    device = stand_ins[0].device  # one device holds every param
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        torch.random.default_generator.manual_seed(0)
        if cuda:
            index = torch.cuda.current_device() if device.index is None else device.index
            torch.cuda.default_generators[index].manual_seed(0)
        try:
            stepped = probe
            for grad in (1.0, 0.5):
                stepped, _ = step(stepped, [torch.full_like(t, grad) for t in stand_ins])
        except Exception as err:  # alike on every rank, as the transform is
            return [f"{type(err).__name__} on a 1-value stand-in"]
    return [
        f"{value:.6g}"
        for leaf in optree.tree_leaves(stepped)
        if isinstance(leaf, torch.Tensor)
        for value in leaf.double().flatten().tolist()
    ]


def _refuse_dtensors(params: Any) -> None:
    """Raises TypeError naming the first DTensor leaf of ``params``, if any."""
    leaves = optree.tree_leaves(params, none_is_leaf=True)
    if dtensors.has_dtensors(leaves):
        name = tree.leaf_names(params)[[isinstance(p, DTensor) for p in leaves].index(True)]
        raise TypeError(
            f"{name} is a DTensor (an FSDP2 model's param): FSDP2 shards the params and "
            "keeps the ranks in step itself; give them to fp16fx.init, whose skip and norm "
            "agree over their mesh (docs/distributed.md)"
        )


def _check_alike(ranks: Sequence[Any], params: Any, names: Sequence[str] | None) -> None:
    """Raises ValueError (on every rank alike: they all hold ``ranks``) unless every rank's
    params have the group's first rank's structure, dtypes and shapes (as DDP checks: the
    broadcast would pour its values into other shapes, or fail inside the backend) and its
    settings, named values. ``ranks``: each rank's ``(structure, kinds, settings)``."""
    first = ranks[0]
    for rank, theirs in enumerate(ranks):
        if theirs == first:
            continue
        if theirs[0] != first[0]:
            what = f"params of the structure {theirs[0]}, its first rank {first[0]}"
        elif theirs[1] != first[1]:
            i = next(i for i, (a, b) in enumerate(zip(first[1], theirs[1])) if a != b)
            name = (tree.leaf_names(params) if names is None else names)[i]
            what = f"{name} as {theirs[1][i]}, its first rank as {first[1][i]}"
        else:
            what = _first_difference(theirs[2], first[2])
        raise ValueError(
            f"rank {rank} of the group has {what}: every rank must build its state from the "
            "same model, optimizer and arguments"
        )


def _first_difference(theirs: Sequence[tuple[str, Any]], first: Sequence[tuple[str, Any]]) -> str:
    """Names the first of a rank's named ``theirs`` that differs from the first rank's; in a
    list, its first differing item (a state's entries: one name, not two whole lists)."""
    missing = ("nothing", None)
    pairs = itertools.zip_longest(theirs, first, fillvalue=missing)
    (name, value), (its_name, its) = next(p for p in pairs if p[0] != p[1])
    if name != its_name:
        return f"{name} where its first rank has {its_name}"
    if isinstance(value, list) and isinstance(its, list):
        k = next(k for k, p in enumerate(itertools.zip_longest(value, its)) if p[0] != p[1])
        item, its_item = (v[k] if k < len(v) else "nothing" for v in (value, its))
        return f"{name} {item} where its first rank has {its_item}"
    return f"{name} {value!r}, its first rank {its!r}"


def _kind(leaf: Any) -> str:
    if not isinstance(leaf, torch.Tensor):
        return type(leaf).__name__  # refused by tree.check_params, alike on every rank
    return f"{str(leaf.dtype).removeprefix('torch.')}{list(leaf.shape)}"


__all__ = ["check_on_every_rank"]
