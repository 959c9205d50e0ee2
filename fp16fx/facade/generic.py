"""The generic path: any torch optimizer stepped on FP32 master copies, as apex did it.

Layer: ``facade`` (docs/design.md). The optimizer math is the wrapped optimizer's own; the
loss-scale math is :func:`fp16fx.scaling.unscale_and_check` (one fused reduction over all
grads) and the policy's ``adjust``, applied once per step as on the fast path (apex moved the
scale in every ``update_master_grads``, so accumulated gradients mixed scales). The only
host-device sync is the skip decision, one bool per step -- the price torch's
``GradScaler.step`` pays.

Across processes each rank unscales and checks its own grads; the ranks agree on the check
where a decision is taken (:meth:`GenericEngine.agree`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

from fp16fx import dtensors
from fp16fx.facade.grads import GradFacts, GradStamp
from fp16fx.facade.policy import Scaler
from fp16fx.scaling import CheckedGrads, GradCheck, all_finite, unscale_and_check
from fp16fx.step import adopt_written_
from fp16fx.transforms.primitives import clip_coefficient


class GenericEngine:
    """apex's ``FP16_Optimizer`` algorithm around any ``torch.optim.Optimizer`` (stateful).

    ``trainable[k]`` are group ``k``'s params that require grad and ``masters[k]`` what the
    group holds for each (an FP32 copy for FP16/BF16 params, the param itself for FP32 ones).
    ``stepped_finite``: whether the last step's grads were finite, where an engine stepped
    before this one (a handover).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        trainable: Sequence[Sequence[torch.Tensor]],
        masters: Sequence[Sequence[torch.Tensor]],
        scaler: Scaler,
        stepped_finite: torch.Tensor | None = None,
    ) -> None:
        self.optimizer, self.scaler = optimizer, scaler
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        # The check a decision reads: this rank's own, or agreed by the last ``agree``
        self._finite: torch.Tensor | None = None
        self._finite_read: tuple[torch.Tensor, bool] | None = None  # _finite, and on the host
        self._norm: torch.Tensor | None = None  # the last checked grads' global L2 norm
        self._local: GradCheck | None = None  # this rank's own check of the masters' grads
        self._stepped_finite = (  # the last step's check
            torch.ones((), dtype=torch.bool) if stepped_finite is None else stepped_finite
        )
        self._unscaled: GradStamp | None = None  # the grads as update_master_grads left them
        self._unscaled_by: torch.Tensor | None = None  # and the loss scale it divided them by
        self.grad_facts = GradFacts(self.grad_stamp)  # (the grads' scale, where set by hand)
        for params, group_masters in zip(trainable, masters, strict=True):
            self.add_group(params, group_masters)

    @staticmethod
    def make_masters(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Returns apex's masters: a detached FP32 copy per FP16/BF16 param, FP32 params as is."""
        return [
            p if p.dtype == torch.float32 else p.detach().clone().float().requires_grad_(True)
            for p in params
        ]

    def add_group(self, params: Sequence[torch.Tensor], masters: Sequence[torch.Tensor]) -> None:
        """Adds a param group's ``params`` and ``masters``. If the others' grads are unscaled
        into their masters already (and unchanged since), the new params' grads, if any, are
        unscaled now too, by the same loss scale (one backward made them all), and join the
        check: the next step, which leaves unscaled grads as they are, steps them as well
        (and a clip or a second step does not unscale the others' twice)."""
        kept = self._still_unscaled()
        pairs = list(zip(params, masters, strict=True))
        if kept and any(p.grad is not None for p in params):
            assert self._unscaled is not None and self._unscaled_by is not None
            assert self._local is not None
            # Over no grads at all, that scale says nothing of these, made with the current one.
            scale = self.scaler.state.scale if self._unscaled.empty else self._unscaled_by
            finite, norm = self._unscale(pairs, scale)  # (raising, it added nothing)
            self._checked(
                GradCheck(self._local.finite & finite, torch.hypot(self._local.norm, norm))
            )
        self.pairs.extend(pairs)
        self._unscaled = self.grad_stamp() if kept else None

    def update_master_grads(self, scale: torch.Tensor | None = None) -> None:
        """Unscales the model grads into the masters' grads and checks them (no state moves).

        ``scale``: the loss scale the grads were made with, if not the current one (grads a
        fast step had stepped, at a handover).

        A param without a grad gives its master a None grad, so the wrapped optimizer leaves it
        and its state alone (apex left the previous step's master grad there). Grads unscaled
        here already, which nothing wrote since, are left as they are: an FP32 param's is
        unscaled in place (it is its own master), and a second ``step()`` without a new
        ``backward`` would divide it again.
        """
        if self._still_unscaled():
            return
        scale = (self._made_with() if scale is None else scale).clone()  # the state's moves on
        self._checked(self._unscale(self.pairs, scale))
        self._unscaled, self._unscaled_by = self.grad_stamp(), scale

    def _checked(self, local: GradCheck) -> None:
        """Makes ``local``, this rank's check of the masters' grads, the one decisions read
        (until :meth:`agree`)."""
        self._local = local
        self._finite, self._norm = local

    def agree(self) -> None:
        """Makes the check decisions read the one every process agrees on (one collective;
        without a consensus, nothing to do): this rank's own, agreed.

        The facade calls it where a decision is taken -- a step, a clip, each attempt of a
        closure's step -- calls every rank makes alike, so that it is one collective on every
        rank, whatever each rank's grads did since: whether they changed is one rank's own
        knowledge (a rank may write its grads alone), and unscaling them is local. Agreeing
        the ranks' unchanged checks again gives what the last agreement gave, the ranks'
        maximum (or root of the summed squares) of the same numbers (after an FSDP2 clip: of
        the clipped norms, to rounding)."""
        consensus = self.scaler.consensus
        if consensus is None:
            return
        assert self._local is not None  # (a decision follows an unscale)
        self._finite, self._norm = consensus(*self._local)

    def take_agreed(self, agreed: GradCheck) -> None:
        """Makes the check decisions read ``agreed``, which the ranks agreed on for the grads
        :meth:`update_master_grads` just unscaled (the fast path's, at a switch), as
        :meth:`agree` would give it, without a collective."""
        self._finite, self._norm = agreed

    def _still_unscaled(self) -> bool:
        """Whether the model grads are the ones ``update_master_grads`` (or a clip) left,
        unscaled into the masters' grads. (Over no grads at all: none now either, whatever
        came and went since; the masters have none.)"""
        return self._unscaled is not None and self._unscaled.unchanged()

    def _made_with(self) -> torch.Tensor:
        """Returns the loss scale the current grads were made with."""
        made_at = self.grad_facts.made_at()
        return self.scaler.state.scale if made_at is None else made_at

    def _unscaled_copies(
        self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], scale: torch.Tensor
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor], CheckedGrads]:
        """Returns the ``pairs`` whose param has a grad, those grads (FSDP2's DTensor grads:
        their local shards), and their ``unscale_and_check`` by ``scale`` (new tensors;
        nothing is written)."""
        with_grad = [(p, m) for p, m in pairs if p.grad is not None]
        grads, _, _ = dtensors.local_shards([p.grad for p, _ in with_grad], root="grads")
        return with_grad, grads, unscale_and_check(grads, scale)

    def _unscale(
        self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], scale: torch.Tensor
    ) -> GradCheck:
        """Unscales the grads of ``pairs``' params by ``scale`` into their masters' grads;
        returns this rank's check of them."""
        with_grad, grads, checked = self._unscaled_copies(pairs, scale)
        with torch.no_grad():
            for (p, master), local, grad in zip(with_grad, grads, checked.unscaled):
                if master is p:
                    local.copy_(grad)
                else:
                    master.grad = dtensors.like(grad, p) if isinstance(p, DTensor) else grad
            for p, master in pairs:
                if p.grad is None and master is not p:
                    master.grad = None
        return GradCheck(checked.finite, checked.norm)

    def keep_scale_of_the_grads(self) -> None:
        """Makes the current grads, not unscaled yet, keep the loss scale they were made with
        (the current one, unless they carry one already), which is about to be set by hand."""
        self.grad_facts.keep_scale(self.scaler.state.scale)

    def grad_stamp(self) -> GradStamp:
        """Returns the trained params' gradients now, to tell later whether any changed."""
        return GradStamp([p for p, _ in self.pairs])

    def local_finite(self) -> bool:
        """Returns whether this rank's model grads are all finite (one sync, no collective,
        nothing written: an FP32 param's grad, unscaled in place, would mix scales with the
        grads a later backward accumulates)."""
        grads = [p.grad for p, _ in self.pairs if p.grad is not None]
        return all_finite(dtensors.local_shards(grads, root="grads")[0])

    def finite(self) -> bool:
        """Returns whether the last ``update_master_grads`` found finite grads (as agreed, if
        :meth:`agree` ran since; one sync per check: on one process a clip and the step that
        follows read the same check once, across processes each reads its own agreement)."""
        if self._finite is None:
            return True
        if self._finite_read is None or self._finite_read[0] is not self._finite:
            self._finite_read = (self._finite, bool(self._finite))
        return self._finite_read[1]

    def adjust_scale(self) -> torch.Tensor:
        """Moves the loss scale for the last checked grads (once per step); returns whether
        an overflow found the scale at its floor (a 0-d tensor: no sync)."""
        finite = torch.ones((), dtype=torch.bool) if self._finite is None else self._finite
        self._stepped_finite = finite
        return self.scaler.adjust(finite.to(self.scaler.state.scale.device))

    def stepped_finite(self) -> bool:
        """Returns whether the last step's grads were finite (one sync; True before any)."""
        return bool(self._stepped_finite)

    def resync_masters(self) -> None:
        """Makes each master take its param's value where the param no longer is the master
        rounded (written since the last step: ``load_state_dict``, a clamp); exact."""
        adopt_written_((p, master) for p, master in self.pairs if master is not p)

    def masters_to_model(self) -> None:
        """Copies every master into its FP16/BF16 model param."""
        with torch.no_grad():
            for p, master in self.pairs:
                if master is not p:
                    p.copy_(master)

    def step(self) -> object:
        """Steps the wrapped optimizer unless the grads overflowed, then moves the scale;
        returns its result. (In that order: a wrapped step that raises leaves the scale, too,
        as it was.)"""
        if not self.finite():
            self.adjust_scale()
            return None
        result = self.optimizer.step()
        self.adjust_scale()
        self.masters_to_model()
        return result

    def clip(self, max_norm: float, norm_type: float) -> float:
        """Clips the masters' grads to total norm ``max_norm``; returns their norm before
        (-1 on overflow), by ``clip_grad_norm_``'s rule (:meth:`_clip`): on one process their
        own norm (apex's clip); across processes the norm the ranks agree on, as the fast path
        clips, so that every rank clips alike and returns the same number. A ``norm_type``
        other than 2 is the caller's to check first (:meth:`check_norm_type`), before it
        unscales the grads."""
        if not self.finite():
            return -1.0
        norm = self._clip([m for _, m in self.pairs if m.grad is not None], max_norm, norm_type)
        self._unscaled = self.grad_stamp()  # clipped in place, still the unscaled grads
        return norm

    def check_norm_type(self, norm_type: float) -> None:
        """Raises ValueError where the ranks cannot agree on the ``norm_type`` norm of the
        grads: FSDP2's shards agree on the L2 norm only. (Every rank alike: the params'
        kind is the same on all.)"""
        if float(norm_type) != 2.0 and any(isinstance(m, DTensor) for _, m in self.pairs):
            raise ValueError("an FSDP2 model's FP16_Optimizer clips by the L2 norm only")

    def _clip(self, masters: list[torch.Tensor], max_norm: float, norm_type: float) -> float:
        """Scales the grads of ``masters`` (their local shards, on FSDP2) by
        ``clip_grad_norm_``'s rule, in its FP32 (:func:`clip_coefficient`, which keeps
        :data:`NO_CLIP` a no-clip where FP32's inf over an inf norm would be NaN), for their
        norm; returns it. On one process it is their own, as ``clip_grad_norm_`` sums it
        (``get_total_norm``: apex's clip, bitwise). Across processes it is the norm the ranks
        agree on: the L2 norm the last :meth:`agree` gave (the ranks' largest; FSDP2's
        shards: the global one), or another norm agreed now (the ranks' largest: one more
        collective). Each rank's own norm would clip by its own coefficient, wherever a
        rank's grads differ (a rank-local hook), and return another number on each."""
        consensus = self.scaler.consensus
        assert self._local is not None and self._norm is not None
        grads = [m.grad for m in masters]
        grads = [dtensors.local(g) if isinstance(g, DTensor) else g for g in grads]
        if consensus is None:
            total = torch.nn.utils.get_total_norm(grads, norm_type)
        elif float(norm_type) == 2.0:
            total = self._norm
        else:  # replicated ranks (FSDP2 refused it): the finite check agreed already
            # (on the device the consensus took the L2 norm on: no grads give a CPU 0)
            local = torch.nn.utils.get_total_norm(grads, norm_type).to(self._norm.device)
            _, total = consensus(torch.ones((), dtype=torch.bool, device=local.device), local)
        coef = clip_coefficient(max_norm, total, torch.float32)
        if grads:  # (foreach takes no empty list)
            with torch.no_grad():
                torch._foreach_mul_(grads, coef)
        # The clipped grads' L2 norm, which a second clip reads (and agrees): 0 where an inf
        # norm clipped them to zeros, which inf * 0 would make NaN.
        self._norm = torch.where(coef > 0, self._norm * coef, 0.0)
        self._local = self._local._replace(norm=torch.where(coef > 0, self._local.norm * coef, 0.0))
        return float(total)

    def zero_grad(self, set_to_none: bool) -> None:
        """Zeroes (or sets to None) the grads of the model params and of the masters."""
        for p, master in self.pairs:
            for t in (p, master):
                if set_to_none:
                    t.grad = None
                elif t.grad is not None:
                    if t.grad.grad_fn is not None:
                        t.grad = t.grad.detach()
                    t.grad.zero_()

    def unscaled_grads(self, fresh: bool = False) -> dict[torch.Tensor, torch.Tensor]:
        """Returns ``{master: grad}`` for every master that has a grad; with ``fresh`` (the
        model grads may not be unscaled yet), unless ``update_master_grads`` unscaled these
        very grads, for every param with a grad, that grad unscaled now (new tensors: nothing
        is written, as more grads may accumulate on them)."""
        if not fresh or self._still_unscaled():
            return {m: m.grad for _, m in self.pairs if m.grad is not None}
        with_grad, _, checked = self._unscaled_copies(self.pairs, self._made_with())
        return {
            m: dtensors.like(grad, p) if isinstance(p, DTensor) else grad
            for (p, m), grad in zip(with_grad, checked.unscaled)
        }
