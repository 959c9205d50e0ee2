"""Overflow and minimum-scale reports through ``logging``: rate-limited, no per-step sync.

Layer: ``facade`` (docs/design.md). apex printed a line for every skipped step, from a decision
it had already synced to the host. fp16fx's fast path never syncs in a step, so the step itself
counts, on the device, the steps it skipped and the overflows that found the scale at its
floor (``info.loss_scale_floored``) into a 2-element tensor. The :class:`OverflowReporter` reads
that tensor every ``interval`` steps -- one 16-byte device-to-host copy, the only sync it adds --
and turns what happened since into at most two log lines on the ``fp16fx`` logger:

* ``WARNING fp16fx: 3 of the last 100 steps were skipped ...`` (only with ``verbose=True``);
* ``WARNING fp16fx: the loss scale is at its minimum ...`` whenever an overflow could not lower
  the scale any further (always: a model that overflows at the minimum scale is broken, and
  no amount of scaling will save it);
* ``WARNING fp16fx: the loss scale fell to ..., below 1`` once when a run of inf/NaN steps took
  the scale below 1, where ordinary FP16 gradients underflow to zero (always; again only after
  it has come back above 1).
"""

from __future__ import annotations

import logging

import torch

from fp16fx.facade.engines import Engine
from fp16fx.facade.fast import FastEngine
from fp16fx.facade.params import ParamSet
from fp16fx.facade.policy import Scaler
from fp16fx.scaling import StaticLossScale

logger = logging.getLogger("fp16fx")


class OverflowReporter:
    """Logs skipped steps and overflows at the scale's floor at most once per ``interval``
    steps (stateful).

    Attributes:
      skipped_total: skipped steps up to the last read of the device counters.
    """

    def __init__(self, *, verbose: bool, interval: int) -> None:
        if not (isinstance(interval, int) and interval >= 1):
            raise ValueError(f"report_interval must be an int >= 1, got {interval!r}")
        self.verbose, self.interval = verbose, interval
        self.steps = 0
        self.skipped_total = 0
        self._warned_below_one = False

    def stepped(self, stats: torch.Tensor, scale: torch.Tensor) -> None:
        """Counts one step; every ``interval`` steps reads ``stats`` and logs (one sync)."""
        self.steps += 1
        if self.steps >= self.interval:
            self.flush(stats, scale)

    def flush(self, stats: torch.Tensor, scale: torch.Tensor) -> None:
        """Reads and zeroes the device counters ``stats`` = (skipped, floored) and logs them."""
        skipped, floored, now = torch.cat([stats.double(), scale.double().reshape(1)]).tolist()
        skipped, floored, steps = int(skipped), int(floored), self.steps
        stats.zero_()
        self.steps = 0
        self.skipped_total += skipped
        if floored:
            logger.warning(
                "fp16fx: the loss scale is at its minimum (%g) and the gradients still "
                "overflowed %d time(s) in the last %d step(s); those steps were skipped. The "
                "model itself produces inf/NaN: lowering the scale cannot fix that.",
                now, floored, steps,
            )  # fmt: skip
        if now < 1 and not self._warned_below_one:
            logger.warning(
                "fp16fx: the loss scale fell to %g, below 1, after steps with inf/NaN "
                "gradients: FP16 gradients of ordinary size now underflow to zero, and steps "
                "change little or nothing until the scale grows back (it doubles once per "
                "scale window of clean steps). Give it a floor: "
                "dynamic_loss_args={'min_loss_scale': 1}.",
                now,
            )  # fmt: skip
        self._warned_below_one = now < 1
        if skipped and self.verbose:
            logger.warning(
                "fp16fx: %d of the last %d step(s) were skipped (inf/NaN gradients); "
                "loss scale now %g",
                skipped, steps, now,
            )  # fmt: skip


def describe(inner: torch.optim.Optimizer, engine: Engine, params: ParamSet, scaler: Scaler) -> str:
    """Returns ``repr`` of an FP16_Optimizer: wrapped optimizer, path, groups, values trained,
    scaling (reads the scale: one sync)."""
    trained = [p for ps in params.trainable for p in ps]
    low = sum(p.numel() for p in trained if p.dtype != torch.float32)
    full = sum(p.numel() for p in trained if p.dtype == torch.float32)
    policy = scaler.policy
    if isinstance(policy, StaticLossScale):
        scaling = f"static loss scale {policy.scale:g}"
    else:
        scaling = (
            f"dynamic loss scale {float(scaler.state.scale):g} (x{policy.growth_factor:g} "
            f"after {policy.growth_interval} clean steps, x{policy.backoff_factor:g} after "
            f"{policy.hysteresis} overflow(s), in [{policy.min_scale:g}, {policy.max_scale:g}])"
        )
    masters = "FP32 masters"
    if isinstance(engine, FastEngine):
        precision = engine.state.precision
        if precision.compensated:
            masters = "compensated masters"
        if precision.moments != "fp32":
            masters += f" and {precision.moments.upper()} moments"
        how = "compiled" if engine.step_fn.compile_options is not None else "eager"
        where = f"fast path ({how})"
        if engine.sharded is not None:
            where += f", sharded over {engine.sharded.sharding.world_size} ranks"
        if engine.fsdp:
            where += f", FSDP2 shards over {engine.flat.mesh.size()} ranks"
    else:
        where = "generic path"
    return (
        f"FP16_Optimizer({type(inner).__name__}, {where}, {len(inner.param_groups)} param "
        f"group(s), {low:,} FP16/BF16 values with {masters}, {full:,} FP32 values, {scaling})"
    )
