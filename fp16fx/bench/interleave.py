"""Interleaved timing: step i of every contender, and one copy, in one loop iteration.

A cloud VM's memory speed drifts between moments, so contenders timed one after another see
different machines. Here every contender's state is alive at once and each loop iteration
steps each of them once (in an order that rotates: :func:`_order`); every iteration also times one
``dst.copy_(src)`` of the size :func:`~fp16fx.bench.measure.copy_bandwidth` measures, which
gives that iteration's roofline. A speed-up or a fraction of the roofline is then the median
of same-iteration ratios: two steps taken moments apart.

A contender that raises here (most likely out of memory: every state is alive at once) leaves
the loop, and the others go on.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch

from fp16fx.bench import measure
from fp16fx.bench.measure import StepTimer
from fp16fx.bench.options import MIN_TIMED_STEPS, BenchOptions
from fp16fx.bench.presets import Preset
from fp16fx.bench.results import ROOFLINE
from fp16fx.bench.runner import Runner


class _CopyProbe:
    """One FP32 ``dst.copy_(src)`` of ``buffer_bytes``: the roofline's yardstick."""

    def __init__(self, buffer_bytes: int, device: torch.device) -> None:
        self.buffer_bytes = buffer_bytes
        self.src = torch.rand(buffer_bytes // 4, device=device)
        self.dst = torch.zeros_like(self.src)

    def step(self) -> None:
        self.dst.copy_(self.src)

    def roofline_ms(self, copy_ms: float, roofline_bytes: int) -> float:
        """Returns the time ``roofline_bytes`` take at the bandwidth of a copy of ``copy_ms``."""
        return measure.ms_at(roofline_bytes, measure.gbps_of(2 * self.buffer_bytes, copy_ms))


@dataclasses.dataclass
class Interleaved:
    """What the interleaved loop measured.

    Attributes:
      ms: each contender's step times (ms) in the loop, and under :data:`ROOFLINE` the
        roofline's time at each iteration's copy bandwidth.
      failed: ``{contender: "Error: message"}`` for each one that raised, left out of ``ms``.
    """

    ms: dict[str, list[float]]
    failed: dict[str, str]


def interleaved_ms(
    preset: Preset,
    runners: Sequence[type[Runner]],
    opts: BenchOptions,
    device: torch.device,
    copy_buffer_bytes: int,
    progress: Callable[[str], None],
) -> Interleaved:
    """Times ``runners`` in turn with every state alive at once (:class:`Interleaved`).

    Stops once ``opts.time_budget_s`` per contender (the copy counting as one) is spent, after
    at least :data:`~fp16fx.bench.options.MIN_TIMED_STEPS` iterations.
    """
    # No runner is alive now: drop the compiled code of earlier instances, or a compiled
    # contender made once per round would reach Dynamo's recompile limit and run eagerly.
    measure.forget_compiled()
    # The probe first: memory that runs out does so in a contender's setup, which is handled.
    probe = _CopyProbe(copy_buffer_bytes, device)
    probe.step()
    failed: dict[str, str] = {}
    live: dict[str, Callable[[], None]] = {ROOFLINE: probe.step}
    for cls in runners:
        progress(f"[{preset.name}] {cls.name}: set up for interleaved timing")
        try:
            live[cls.name] = _set_up(cls, preset, opts, device)
            continue
        except Exception as exc:  # a broken contender must not sink the others
            failed[cls.name] = f"{type(exc).__name__}: {exc}"
        measure.release_memory(device)  # out of the except: its traceback held the runner
    measure.synchronize(device)
    timers = {name: StepTimer(device) for name in live}
    budget = None if opts.time_budget_s is None else opts.time_budget_s * len(live)
    start, iterations = time.monotonic(), 0
    while iterations < opts.steps:
        for name in _order(list(live), iterations):
            try:
                timers[name].time(live[name])
                continue
            except Exception as exc:
                if name == ROOFLINE:
                    raise
                failed[name] = f"{type(exc).__name__}: {exc}"
            del live[name], timers[name]  # the step held the runner: its memory goes
            measure.release_memory(device)
        iterations += 1
        spent = time.monotonic() - start
        if budget is not None and spent > budget and iterations >= MIN_TIMED_STEPS:
            break
    progress(f"[{preset.name}] interleaved: {iterations} steps of each contender")
    ms = {name: [t * 1e3 for t in timer.seconds()] for name, timer in timers.items()}
    roofline_bytes = measure.roofline_bytes(preset.num_params)
    ms[ROOFLINE] = [probe.roofline_ms(t, roofline_bytes) for t in ms[ROOFLINE]]
    return Interleaved(ms, failed)


def _order(names: list[str], iteration: int) -> list[str]:
    """Returns iteration ``iteration``'s order: the copy first, then the contenders rotated by
    one more each time, so that each takes every place, the one after the copy included,
    equally often. That place costs a small state its caches: at 20,000 params a step there
    took 0.2-0.4 ms longer (fp16fx-compiled 0.97 ms against 0.77), and when odd iterations
    ran in reverse only the first contender ever took it. (At 4M params: no difference.)"""
    copy, contenders = names[0], names[1:]
    turn = iteration % len(contenders) if contenders else 0
    return [copy, *contenders[turn:], *contenders[:turn]]


def _set_up(
    cls: type[Runner], preset: Preset, opts: BenchOptions, device: torch.device
) -> Callable[[], None]:
    """Returns the step of a new ``cls`` runner over fresh params, set up and warmed up (its
    one reference: the loop drops it to free the runner)."""
    params, grads = opts.param_set(preset, device)
    runner = cls(opts.config)
    runner.setup(params, grads)
    for _ in range(opts.warmup_steps):
        runner.step()
    return runner.step
