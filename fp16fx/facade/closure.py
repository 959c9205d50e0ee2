"""``FP16_Optimizer.step(closure)``: apex's re-run-until-finite closure protocol.

Layer: ``facade`` (docs/design.md). The closure zeroes the grads, calls
``optimizer.backward(loss)`` and returns the loss. apex re-ran it while its gradients
overflowed (each overflow lowering the scale), so that an optimizer calling it several times
per step (LBFGS) never sees inf/NaN. fp16fx does the same, and raises FloatingPointError where
apex looped forever: when the gradients cannot become finite because the scale cannot go lower
(static, or at its floor). Knowing whether to re-run needs the answer on the host: one sync per
closure call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from fp16fx.facade.generic import GenericEngine
from fp16fx.facade.groups import Unsupported
from fp16fx.facade.phase import Phase
from fp16fx.facade.policy import Scaler
from fp16fx.scaling import StaticLossScale
from fp16fx.step import StepInfo

logger = logging.getLogger("fp16fx")


#: ``generic_step``'s ``first_loss`` when no closure call is pending.
NOT_RUN = object()


class HandOver(Exception):
    """The fast path cannot step the grads a closure call just made (``reason``: its
    Unsupported); ``loss``: what that call returned. Nothing was stepped."""

    def __init__(self, reason: Unsupported, loss: Any) -> None:
        super().__init__(str(reason))
        self.reason, self.loss = reason, loss


def fast_step(
    closure: Callable[[], Any],
    attempt: Callable[[], StepInfo],
    phase: Phase,
    scaler: Scaler,
    stepped: Callable[[Any], Any],
) -> Any:
    """Returns the loss of the first ``closure()`` whose step (``attempt()``: the fast path's
    compiled step, skipped exactly on overflow) applied; ``stepped`` is told of each step.
    ``phase.first_closure_call`` reads False inside the closure, as apex's wrapped closure
    left it from its first call on, and True again after the step.

    Raises HandOver when ``attempt()`` raises Unsupported: the generic path takes the grads
    that call made (a closure may draw the next batch: running it again would skip one).
    """
    phase.first_closure_call = False
    try:
        while True:
            with torch.enable_grad():
                loss = closure()
            try:
                info = attempt()
            except Unsupported as err:
                raise HandOver(err, loss) from err
            stepped(None)
            finite, floored = torch.stack([info.finite, info.loss_scale_floored]).tolist()
            if finite:
                return loss
            _overflowed(scaler, floored)
    finally:  # the generic step a HandOver leads to starts afresh too
        phase.first_closure_call = True


def generic_step(
    closure: Callable[[], Any],
    engine: GenericEngine,
    phase: Phase,
    scaler: Scaler,
    check: Callable[[], None],
    first_loss: Any = NOT_RUN,
) -> Any:
    """Returns the wrapped optimizer's result of one ``step`` driven by ``closure``.

    The wrapped optimizer gets a closure that refreshes the FP16 params from the masters
    before every call but the first and re-runs ``closure`` until its gradients are finite
    (backing the scale off after each overflow), as apex's ``_step_with_closure`` did.
    ``check()`` runs on each call's grads, before they are used (it raises to refuse them).
    ``first_loss``: a closure call already made (at a handover), whose grads are in place.

    The scale moves once per step, as on the fast path and in a step without a closure: each
    overflow backs it off (so that the re-run can help), and the step, once the wrapped
    optimizer returns, counts one finite step however many times it called the closure
    (LBFGS: up to ``max_eval``). A step that raises, or whose optimizer never called the
    closure, counts none.
    """
    pending = [] if first_loss is NOT_RUN else [first_loss]
    finished = False  # a closure call returned finite grads

    def wrapped_closure() -> Any:
        nonlocal finished
        if phase.first_closure_call:
            phase.first_closure_call = False
        else:  # the wrapped optimizer may have moved the masters since the last call
            engine.masters_to_model()
        while True:
            loss = pending.pop() if pending else closure()
            check()
            if phase.grads != "unscaled":
                engine.update_master_grads()
            engine.agree()
            if engine.finite():
                finished = True
                return loss
            _overflowed(scaler, bool(engine.adjust_scale()))

    try:
        result = engine.optimizer.step(wrapped_closure)
    finally:  # a closure that raised ends the step too: the next one starts afresh
        phase.first_closure_call = True
    if finished:  # the last call's grads, finite: the step's one good step
        engine.adjust_scale()
    engine.masters_to_model()
    return result


def _overflowed(scaler: Scaler, floored: bool) -> None:
    """Returns if re-running the closure can help (the scale went down), else raises."""
    scale = float(scaler.state.scale)
    if isinstance(scaler.policy, StaticLossScale) or floored:
        where = "minimum" if floored else "static"
        raise FloatingPointError(
            f"the closure's gradients are not finite at the {where} loss scale {scale:g}: "
            "re-running it cannot help. The model produces inf/NaN; lower the learning rate "
            "or the static loss scale, or use a dynamic one"
        )
    logger.debug("fp16fx: overflow within the closure; re-running it at scale %g", scale)
