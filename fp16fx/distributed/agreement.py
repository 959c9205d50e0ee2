"""Loads that every rank of a process group makes together: all of them load, or none.

Layer: ``distributed`` (docs/design.md). A checkpoint's checks can pass on one rank and fail on
another: an FSDP2 rank reads only its own shards, and ranks may be handed different copies of a
file. A rank that loaded beside one that refused would train from a mixture of two states,
silently (the params' all-gather spreads it to every rank), and a rank that refused alone
would leave the others waiting in their next collective. So a load runs as::

    with loading_together(group):   # every rank of the group, once per load
        ...check everything...      # a raise here on any rank: every rank raises
        checks_passed()             # one all_gather_object: each rank's refusal, or None
        ...write...

Blocks of one group nest, and the outermost agrees: ``FP16_Optimizer``'s checks of its own
entries and the sharded state's load beneath them are one load, with one collective.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from fp16fx.saved_format import StateDictError


class _Load:
    """One load the ranks of ``group`` agree on; ``agreed`` once this rank told them."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.agreed = False

    def agree(self, refusal: Exception | None) -> None:
        """Tells the other ranks this rank's ``refusal`` (None: it would load) and hears
        theirs; raises StateDictError naming a rank that refused, where this one did not."""
        self.agreed = True  # before the collective: a failing one is not retried
        refusals: list[str | None] = [None] * dist.get_world_size(self.group)
        mine = None if refusal is None else str(refusal)
        dist.all_gather_object(refusals, mine, group=self.group)
        other = next(((r, why) for r, why in enumerate(refusals) if why is not None), None)
        if refusal is None and other is not None:
            rank = dist.get_global_rank(self.group, other[0])
            raise StateDictError(f"rank {rank} refused the dict: {other[1]}")


_CURRENT: contextvars.ContextVar[_Load | None] = contextvars.ContextVar("fp16fx_load", default=None)


@contextlib.contextmanager
def loading_together(group: Any) -> Iterator[None]:
    """Runs a load that every rank of the process group ``group`` runs too (``None``: no
    group, this process alone; the default group is ``dist.group.WORLD``).

    The block checks what it loads, calls :func:`checks_passed` before it writes anything,
    then writes. Where it raises before that, the other ranks (waiting in their
    ``checks_passed``) raise StateDictError naming this rank, and this rank raises its own
    error; a block that ends without calling it agrees at its end. Inside another such block
    of the same group that has not agreed yet, it is that block's part; anywhere else, a load
    of its own. (An interrupt, a BaseException that is no Exception, tells the others nothing:
    they wait until the group's timeout.)
    """
    outer = _CURRENT.get()
    if group is None or (outer is not None and outer.group is group and not outer.agreed):
        yield
        return
    load = _Load(group)
    token = _CURRENT.set(load)
    try:
        yield
    except Exception as err:
        if not load.agreed:
            try:
                load.agree(err)
            except Exception as failed:  # (a rank gone, say): the refusal still comes first
                err.add_note(f"fp16fx could not tell the other ranks of the group: {failed}")
        raise
    finally:
        _CURRENT.reset(token)
    if not load.agreed:
        load.agree(None)


def checks_passed() -> None:
    """In :func:`loading_together`'s block: this rank would load. Raises StateDictError
    where another rank refused (nothing written on any rank). Outside one: nothing."""
    load = _CURRENT.get()
    if load is not None and not load.agreed:
        load.agree(None)
