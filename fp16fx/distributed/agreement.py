"""What the ranks of a process group do together: all of them go on, or none.

Layer: ``distributed`` (docs/design.md). A check can pass on one rank and fail on another:
ranks may be given other arguments or other copies of a file, and an FSDP2 rank reads only
its own shards. A rank that went on beside one that refused would train from a mixture of two
states, silently (the params' broadcast or all-gather spreads it to every rank), and a rank
that refused alone would leave the others waiting in their next collective. So a sharded or
replicated init (:func:`check_on_every_rank`, before the params are broadcast) and a load
(:func:`loading_together`) each run as one agreement::

    with loading_together(group):   # or initializing_together: every rank of the group, once
        ...check everything...      # a raise here on any rank: every rank raises
        checks_passed()             # one all_gather_object: each rank's refusal, or its facts
        ...write...

Blocks of one group nest, and the outermost agrees: ``FP16_Optimizer``'s checks of its own
arguments (or of a checkpoint's entries) and the sharded state's init (or load) beneath them
are one agreement, with one collective.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fp16fx import checkpoint, dtensors, tree
from fp16fx.saved_format import StateDictError
from fp16fx.state import Arguments, MixedPrecisionState, checked_arguments, init
from fp16fx.step import step
from fp16fx.transforms import GradientTransformation

#: Builds the error a rank raises where rank ``r`` of the group (its index) refused ``why``.
Refused = Callable[[Any, int, str], Exception]


class _Agreement:
    """One agreement of the ranks of ``group``; ``agreed`` once this rank took part."""

    def __init__(self, group: Any, refused: Refused) -> None:
        self.group = group
        self.refused = refused
        self.agreed = False

    def agree(self, refusal: Exception | None, facts: Any = None) -> list[Any]:
        """Tells the other ranks this rank's ``refusal`` (None: it would go on) or its
        ``facts`` and hears theirs; returns every rank's facts, in group order. Raises
        :attr:`refused`'s error naming a rank that refused, where this one did not."""
        self.agreed = True  # before the collective: a failing one is not retried
        told: list[tuple[str | None, Any]] = [(None, None)] * dist.get_world_size(self.group)
        mine = (None if refusal is None else str(refusal), facts)
        dist.all_gather_object(told, mine, group=self.group)
        other = next(((r, why) for r, (why, _) in enumerate(told) if why is not None), None)
        if refusal is None and other is not None:
            raise self.refused(self.group, *other)
        return [facts for _, facts in told]


_CURRENT: contextvars.ContextVar[_Agreement | None] = contextvars.ContextVar(
    "fp16fx_agreement", default=None
)


@contextlib.contextmanager
def _together(group: Any, refused: Refused) -> Iterator[None]:
    """Runs a block that every rank of the process group ``group`` runs too (``None``: no
    group, this process alone): the one agreement behind :func:`loading_together` and
    :func:`initializing_together`.

    The block checks, calls :func:`checks_passed` before it changes anything, then goes on.
    Where it raises before that, the other ranks (waiting in their ``checks_passed``) raise
    ``refused``'s error naming this rank, and this rank raises its own error; a block that
    ends without calling it agrees at its end. Inside another such block of the same group
    that has not agreed yet, it is that block's part; anywhere else, an agreement of its own.
    (An interrupt, a BaseException that is no Exception, tells the others nothing: they wait
    until the group's timeout.)
    """
    outer = _CURRENT.get()
    if group is None or (outer is not None and outer.group is group and not outer.agreed):
        yield
        return
    agreement = _Agreement(group, refused)
    token = _CURRENT.set(agreement)
    try:
        yield
    except Exception as err:
        if not agreement.agreed:
            try:
                agreement.agree(err)
            except Exception as failed:  # (a rank gone, say): the refusal still comes first
                err.add_note(f"fp16fx could not tell the other ranks of the group: {failed}")
        raise
    finally:
        _CURRENT.reset(token)
    if not agreement.agreed:
        agreement.agree(None)


def _refused_the_dict(group: Any, rank: int, why: str) -> Exception:
    return StateDictError(f"rank {dist.get_global_rank(group, rank)} refused the dict: {why}")


def _refused_its_arguments(group: Any, rank: int, why: str) -> Exception:
    return ValueError(f"rank {rank} of the group refused its arguments: {why}")


def loading_together(group: Any) -> contextlib.AbstractContextManager[None]:
    """Runs a load that every rank of the process group ``group`` runs too (``None``: no
    group, this process alone; the default group is ``dist.group.WORLD``): where one rank
    refuses the dict, every rank raises (the others StateDictError, naming its global rank),
    and none wrote anything (:func:`_together`)."""
    return _together(group, _refused_the_dict)


def initializing_together(group: Any) -> contextlib.AbstractContextManager[None]:
    """Runs the checks before an init that every rank of the process group ``group`` (None:
    the world) makes too, before the params are broadcast or moved: where one rank refuses
    its arguments, every rank raises (the others ValueError, naming its rank in the group)
    (:func:`_together`)."""
    return _together(dist.group.WORLD if group is None else group, _refused_its_arguments)


def checks_passed(facts: Any = None) -> list[Any] | None:
    """In a block of :func:`loading_together` or :func:`initializing_together`: this rank
    would go on, with ``facts`` to compare (any picklable value). Returns every rank's facts,
    in group order; raises where another rank refused (nothing changed on any rank). Outside
    a block, or where the block agreed already: returns None."""
    agreement = _CURRENT.get()
    if agreement is None or agreement.agreed:
        return None
    return agreement.agree(None, facts)


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


__all__ = [
    "check_on_every_rank",
    "checks_passed",
    "initializing_together",
    "loading_together",
]
