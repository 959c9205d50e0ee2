"""What the ranks of a process group do together: all of them go on, or none.

Layer: ``distributed`` (docs/design.md). A check can pass on one rank and fail on another:
ranks may be given other arguments or other copies of a file, and an FSDP2 rank reads only
its own shards. A rank that went on beside one that refused would train from a mixture of two
states, silently (the params' broadcast or all-gather spreads it to every rank), and a rank
that refused alone would leave the others waiting in their next collective. So a sharded or
replicated init (before the params are broadcast:
:func:`~fp16fx.distributed.init_checks.check_on_every_rank`) and a load each run as one
agreement::

    with loading_together(group):   # or initializing_together: every rank of the group, once
        ...check everything...      # a raise here on any rank: every rank raises
        checks_passed()             # one all_gather_object: each rank's refusal, or its facts
        ...write...

Blocks of one group (the same object) and kind nest, and the outermost agrees:
``FP16_Optimizer``'s checks of its own arguments (or of a checkpoint's entries) and the
sharded state's init (or load) beneath them are one agreement, with one collective. A block
of the other kind inside one that has not agreed yet is refused (RuntimeError): a rank that
refused before reaching it would pair its refusal with the inner block's collective.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch.distributed as dist

from fp16fx.consensus import refuse_non_member
from fp16fx.saved_format import StateDictError

Kind = Literal["load", "init"]
_WHAT = {"load": "a load", "init": "an init"}


class _Agreement:
    """One agreement of the ranks of ``group`` on a load or an init; ``agreed`` once this
    rank took part."""

    def __init__(self, group: Any, kind: Kind) -> None:
        self.group = group
        self.kind = kind
        self.agreed = False
        self.facts: dict[str, Any] = {}  # what the blocks around the agreeing one add to compare

    def agree(self, refusal: Exception | None, facts: Any = None) -> list[Any]:
        """Tells the other ranks this rank's ``refusal`` (None: it would go on) or its
        ``facts`` and hears theirs; returns every rank's facts, in group order. Raises,
        where this rank did not refuse and another did, an error naming that rank."""
        self.agreed = True  # before the collective: a failing one is not retried
        told: list[tuple[str | None, Any]] = [(None, None)] * dist.get_world_size(self.group)
        mine = (None if refusal is None else str(refusal), facts)
        dist.all_gather_object(told, mine, group=self.group)
        other = next(((r, why) for r, (why, _) in enumerate(told) if why is not None), None)
        if refusal is None and other is not None:
            raise self._refused(*other)
        return [facts for _, facts in told]

    def _refused(self, rank: int, why: str) -> Exception:
        if self.kind == "load":
            global_rank = dist.get_global_rank(self.group, rank)
            return StateDictError(f"rank {global_rank} refused the dict: {why}")
        return ValueError(f"rank {rank} of the group refused its arguments: {why}")


_CURRENT: contextvars.ContextVar[_Agreement | None] = contextvars.ContextVar(
    "fp16fx_agreement", default=None
)


@contextlib.contextmanager
def _together(group: Any, kind: Kind) -> Iterator[None]:
    """Runs a block that every rank of the process group ``group`` runs too (``None``: no
    group, this process alone): the one agreement behind :func:`loading_together` and
    :func:`initializing_together`.

    The block checks, calls :func:`checks_passed` before it changes anything, then goes on.
    Where it raises before that, the other ranks (waiting in their ``checks_passed``) raise
    an error naming this rank, and this rank raises its own error; a block that ends without
    calling it agrees at its end. Inside another such block of the same group object and kind
    that has not agreed yet, it is that block's part; inside one of the other kind, it raises
    RuntimeError; anywhere else, it is an agreement of its own. (An interrupt, a
    BaseException that is no Exception, tells the others nothing: they wait until the
    group's timeout.)
    """
    outer = _CURRENT.get()
    if group is None:
        yield
        return
    if outer is not None and outer.group is group and not outer.agreed:
        if outer.kind != kind:
            inner, around = _WHAT[kind], _WHAT[outer.kind]
            raise RuntimeError(
                f"fp16fx cannot agree on {inner} inside {around} over the same process group "
                f"before that agreed: a rank that refused {around} would pair its refusal "
                f"with the collective of {inner}"
            )
        yield
        return
    agreement = _Agreement(group, kind)
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


def loading_together(group: Any) -> contextlib.AbstractContextManager[None]:
    """Runs a load that every rank of the process group ``group`` runs too (``None``: no
    group, this process alone; the default group is ``dist.group.WORLD``): where one rank
    refuses the dict, every rank raises (the others StateDictError, naming its global rank),
    and none wrote anything (:func:`_together`)."""
    return _together(group, "load")


def initializing_together(group: Any) -> contextlib.AbstractContextManager[None]:
    """Runs the checks before an init that every rank of the process group ``group`` makes
    too, before the params are broadcast or moved: where one rank refuses its arguments,
    every rank raises (the others ValueError, naming its rank in the group)
    (:func:`_together`). An init always has a group: None is the world here (torch's
    ValueError where torch.distributed is not initialized), not "this process alone" as
    for :func:`loading_together`; a group this process is not in is refused
    (:func:`~fp16fx.consensus.refuse_non_member`)."""
    refuse_non_member(group)
    if group is None:
        dist.get_world_size()  # torch's ValueError where torch.distributed is not initialized
        group = dist.group.WORLD
    return _together(group, "init")


def checks_passed(facts: Any = None) -> list[Any] | None:
    """In a block of :func:`loading_together` or :func:`initializing_together`: this rank
    would go on, with ``facts`` to compare (any picklable value; a dict takes those that
    :func:`compare_too` added). Returns every rank's facts, in group order; raises where
    another rank refused (nothing changed on any rank). Outside a block, or where the block
    agreed already: returns None."""
    agreement = _CURRENT.get()
    if agreement is None or agreement.agreed:
        return None
    if isinstance(facts, dict):
        facts = {**agreement.facts, **facts}
    return agreement.agree(None, facts)


def compare_too(facts: Mapping[str, Any]) -> None:
    """In a block of :func:`loading_together` that has not agreed yet: adds ``facts``
    (picklable values, named by where they sit) to the dict of facts that the check inside
    it passes to :func:`checks_passed` and compares across the ranks. A block around the
    core's load adds the entries it loads itself, which the core never sees (the sharded
    ``FP16_Optimizer``: its dict's count, loss scaler, overflow flags and param groups'
    numbers). Elsewhere: nothing."""
    agreement = _CURRENT.get()
    if agreement is not None and not agreement.agreed:
        agreement.facts.update(facts)


__all__ = ["checks_passed", "compare_too", "initializing_together", "loading_together"]
