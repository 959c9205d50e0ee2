"""``FP16_Optimizer.step(closure)``: apex's re-run-until-finite closure protocol.

Layer: ``facade`` (DESIGN.md). The closure zeroes the grads, calls ``optimizer.backward(loss)``
and returns the loss. apex re-ran it while its gradients overflowed (each overflow lowering the
scale), so that an optimizer calling it several times per step (LBFGS) never sees inf/NaN.
fp16fx does the same, and raises FloatingPointError where apex looped forever: when the
gradients cannot become finite because the scale cannot go lower (static, or at its floor).
Knowing whether to re-run needs the answer on the host: one sync per closure call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from fp16fx.facade.fast import FastEngine
from fp16fx.facade.generic import GenericEngine
from fp16fx.facade.groups import Unsupported
from fp16fx.scaling import StaticLossScale

if TYPE_CHECKING:
    from fp16fx.facade.optimizer import FP16_Optimizer

logger = logging.getLogger("fp16fx")


def step_with_closure(opt: FP16_Optimizer, closure: Callable[[], Any]) -> Any:
    """Returns the loss (or the wrapped optimizer's result) of one step driven by ``closure``.

    Fast path: call the closure, run the compiled step (skipped exactly on overflow), repeat
    until a step applied. Generic path: hand the wrapped optimizer a closure that refreshes the
    FP16 params from the masters before every call but the first and re-runs ``closure`` until
    its gradients are finite, as apex's ``_step_with_closure`` did.
    """
    if isinstance(opt._engine, FastEngine):
        while True:
            with torch.enable_grad():
                loss = closure()
            try:
                info = opt._engine.step()
            except Unsupported as err:
                opt._handover(err)
                break
            opt._stepped(None)
            finite, floored = torch.stack([info["finite"], info["loss_scale_floored"]]).tolist()
            if finite:
                return loss
            _overflowed(opt, floored)
    engine = opt._engine
    assert isinstance(engine, GenericEngine)

    def wrapped_closure() -> Any:
        if opt.first_closure_call_this_step:
            opt.first_closure_call_this_step = False
        else:  # the wrapped optimizer may have moved the masters since the last call
            engine.masters_to_model()
        while True:
            opt._processed = False
            loss = closure()
            if not opt._processed:
                engine.update_master_grads()
            if engine.finite():
                return loss
            _overflowed(opt, engine.floored())

    result = opt.optimizer.step(wrapped_closure)
    opt.first_closure_call_this_step = True
    engine.masters_to_model()
    return opt._stepped(result)


def _overflowed(opt: FP16_Optimizer, floored: bool) -> None:
    """Returns if re-running the closure can help (the scale went down), else raises."""
    if isinstance(opt._scaler.policy, StaticLossScale) or floored:
        where = "minimum" if floored else "static"
        raise FloatingPointError(
            f"the closure's gradients are not finite at the {where} loss scale "
            f"{opt.loss_scale:g}: re-running it cannot help. The model produces inf/NaN; "
            "lower the learning rate or the static loss scale, or use a dynamic one"
        )
    logger.debug("fp16fx: overflow within the closure; re-running it at scale %g", opt.loss_scale)
