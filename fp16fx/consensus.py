"""Found-inf consensus: every process skips or applies a step together, decided on the device.

Layer: ``step`` (docs/design.md), beside the step that calls it: both the functional state and the
facade hold one, so it sits below both (the ``distributed`` layer re-exports it). The
transport is ``torch.distributed`` alone; this module depends on nothing else of fp16fx.

Each process checks its own gradients (:func:`fp16fx.scaling.unscale_and_check`, the one
definition of "unscale and check"), then one all-reduce of two float64 numbers combines::

    replicated grads (DDP: every rank holds the same averaged grads)
        bad  = max over ranks of (not finite)          # one rank's fault skips every rank
        norm = max over ranks of the local norm        # equal on healthy ranks
    sharded grads (each rank holds its own slice of the gradient)
        bad  = sum over ranks of (not finite)
        norm = sqrt(sum over ranks of local norm**2)   # the global L2 norm
    finite = (bad == 0);  norm = inf where not finite

It runs inside the step, after the check and before any state changes, so no rank reads a
tensor on the host and the loss-scale state (moved by ``finite`` alone) stays identical on every
rank. Non-finite local norms are replaced by 0 before the reduction, so a NaN on one rank
cannot turn into a NaN norm that some backend reduces differently.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Consensus:
    """Agrees ``(finite, grad_norm)`` across the processes of ``group`` (a static option).

    Attributes:
      group: the ``torch.distributed`` process group; ``None`` means the default (world) group.
      sharded: the ranks hold *different* parts of the gradient (ZeRO-1 shards), so the global
        norm is the root of the summed squares; False: they hold the same (replicated) grads.

    Called as ``finite, norm = consensus(finite, norm)`` by :func:`fp16fx.step.apply_updates`.
    Eagerly it is one ``dist.all_reduce``; under ``torch.compile(fullgraph=True)`` Dynamo
    traces that call into a functional collective (checked on CPU/gloo with torch 2.14).
    """

    group: Any = None
    sharded: bool = False

    def __post_init__(self) -> None:
        refuse_non_member(self.group)

    def __call__(
        self, finite: torch.Tensor, norm: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        local = torch.where(finite, norm.double(), torch.zeros_like(norm, dtype=torch.float64))
        if self.sharded:
            local = local * local
        both = torch.stack([(~finite).double(), local])
        op = dist.ReduceOp.SUM if self.sharded else dist.ReduceOp.MAX
        _all_reduce(both, op, self.group, CONSENSUS)
        agreed = both[0] == 0
        total = torch.sqrt(both[1]) if self.sharded else both[1]
        inf = torch.full_like(norm, float("inf"))
        return agreed, torch.where(agreed, total.to(norm.dtype), inf)


#: What a failure of the consensus's collective is named (:func:`collective_error`).
CONSENSUS = "the found-inf consensus of a step"


def _all_reduce(tensor: torch.Tensor, op: Any, group: Any, what: str) -> None:
    """``dist.all_reduce``; eagerly, a failure is re-raised naming ``what`` and the rank.
    Traced into a compiled step, there is no Python around it at run time: the compiled
    region's caller (``fp16fx.compile._run_region``) names its failure."""
    if torch.compiler.is_compiling():
        dist.all_reduce(tensor, op=op, group=group)
        return
    try:
        dist.all_reduce(tensor, op=op, group=group)
    except RuntimeError as err:
        raise collective_error(what, err) from err


def collective_error(what: str, err: Exception) -> RuntimeError:
    """Returns the error for a failed collective: which one, on which rank, and why likely."""
    return RuntimeError(
        f"fp16fx: {what} failed on rank {dist.get_rank()} of {dist.get_world_size()}: another "
        "process died, or did not reach the same step within the process group's timeout "
        f"(init_process_group(timeout=...)). Backend error: {err}"
    )


def refuse_non_member(group: Any) -> None:
    """Raises ValueError if ``group`` is what ``dist.new_group`` returns to a process outside
    it (torch's -100): torch's collectives would skip it with a warning, and a division by
    its world size (-1) would flip the grads' sign."""
    if not dist.is_available():
        return
    non_member = getattr(dist.GroupMember, "NON_GROUP_MEMBER", None)
    if non_member is not None and type(group) is type(non_member) and group == non_member:
        raise ValueError(
            "the process group given is torch's value for a group this process is not in "
            "(new_group returns it to the processes it leaves out): give a group on its own "
            "processes only"
        )


def default_consensus(process_group: Any = "auto") -> Consensus | None:
    """Returns the consensus a replicated optimizer should use, or None for a single process.

    ``process_group``: ``"auto"`` (the world group when torch.distributed is initialized and
    has more than one process, else none), ``None``/``False`` (off), or a process group
    (ValueError for one this process is not in, :func:`refuse_non_member`).
    """
    if process_group is None or process_group is False:
        return None
    if isinstance(process_group, str):
        if process_group != "auto":
            raise ValueError(
                f"process_group must be 'auto', None or a group, got {process_group!r}"
            )
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        return Consensus()
    refuse_non_member(process_group)
    if not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        raise TypeError(
            "process_group must be 'auto', None or a torch.distributed process group, got "
            f"{process_group!r}"
        )
    if not dist.is_initialized():
        raise RuntimeError("a process_group was given but torch.distributed is not initialized")
    return Consensus(group=process_group)
