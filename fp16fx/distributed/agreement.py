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

Blocks of one group nest, and the outermost agrees: ``FP16_Optimizer``'s checks of its own
arguments (or of a checkpoint's entries) and the sharded state's init (or load) beneath them
are one agreement, with one collective.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from fp16fx.saved_format import StateDictError

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
    and kind (``refused``) that has not agreed yet, it is that block's part; anywhere else,
    an agreement of its own (every rank nests alike, so their collectives still pair).
    (An interrupt, a BaseException that is no Exception, tells the others nothing: they wait
    until the group's timeout.)
    """
    outer = _CURRENT.get()
    joins = outer is not None and outer.group is group and outer.refused is refused
    if group is None or (joins and not outer.agreed):
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
    """Runs the checks before an init that every rank of the process group ``group`` makes
    too, before the params are broadcast or moved: where one rank refuses its arguments,
    every rank raises (the others ValueError, naming its rank in the group)
    (:func:`_together`). An init always has a group: None is the world here (torch's
    ValueError where torch.distributed is not initialized), not "this process alone" as
    for :func:`loading_together`."""
    dist.get_world_size(group)  # raises torch's ValueError where there is no such group
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


__all__ = ["checks_passed", "initializing_together", "loading_together"]
