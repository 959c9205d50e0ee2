"""Interleaved timing: step i of every contender, and one copy, in one loop iteration.

A cloud VM's memory speed drifts between moments, so contenders timed one after another see
different machines. Here every contender's state is alive at once and each loop iteration
steps each of them once (odd iterations in reverse order); every iteration also times one
``dst.copy_(src)`` of the size :func:`~fp16fx.bench.measure.copy_bandwidth` measures, which
gives that iteration's roofline. A speed-up or a fraction of the roofline is then the median
of same-iteration ratios: two steps taken moments apart.
"""

from __future__ import annotations

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


def interleaved_ms(
    preset: Preset,
    runners: Sequence[type[Runner]],
    opts: BenchOptions,
    device: torch.device,
    copy_buffer_bytes: int,
    progress: Callable[[str], None],
) -> dict[str, list[float]]:
    """Returns each runner's step times (ms), and under :data:`ROOFLINE` the roofline's time
    at each iteration's copy bandwidth, timed in turn with every state alive at once.

    Stops once ``opts.time_budget_s`` per runner is spent, after at least
    :data:`~fp16fx.bench.options.MIN_TIMED_STEPS` iterations.
    """
    live: list[tuple[str, Callable[[], None]]] = []
    for cls in runners:
        progress(f"[{preset.name}] {cls.name}: set up for interleaved timing")
        params, grads = opts.param_set(preset, device)
        runner = cls(opts.config)
        runner.setup(params, grads)
        for _ in range(max(opts.warmup, 1)):
            runner.step()
        live.append((cls.name, runner.step))
    probe = _CopyProbe(copy_buffer_bytes, device)
    probe.step()
    live.insert(0, (ROOFLINE, probe.step))
    measure.synchronize(device)
    timers = {name: StepTimer(device) for name, _ in live}
    budget = None if opts.time_budget_s is None else opts.time_budget_s * len(runners)
    start = time.monotonic()
    for i in range(opts.steps):
        for name, step in live if i % 2 == 0 else live[::-1]:
            timers[name].time(step)
        if budget is not None and time.monotonic() - start > budget and i + 1 >= MIN_TIMED_STEPS:
            break
    progress(f"[{preset.name}] interleaved: {i + 1} steps of each contender")
    ms = {name: [t * 1e3 for t in timer.seconds()] for name, timer in timers.items()}
    roofline_bytes = measure.roofline_bytes(preset.num_params)
    ms[ROOFLINE] = [probe.roofline_ms(t, roofline_bytes) for t in ms[ROOFLINE]]
    return ms
