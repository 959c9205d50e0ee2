"""What one ``fp16fx bench`` run measures: :class:`BenchOptions`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fp16fx.bench.presets import Preset, make_param_set
from fp16fx.bench.runner import BenchConfig

#: Timed steps always run, whatever the time budget (unless ``steps`` is smaller).
MIN_TIMED_STEPS = 5


@dataclass
class BenchOptions:
    """What to run: presets, contenders (None = all registered), steps and device.

    ``time_budget_s`` caps each contender's timed steps: once it is spent, timing stops
    after at least :data:`MIN_TIMED_STEPS` steps (None: always ``steps``).
    ``copy_buffer_bytes`` sizes the bandwidth measurement (None: the default of
    :func:`~fp16fx.bench.measure.copy_bandwidth`; small sizes only for tests).
    ``rounds`` measures every contender that many times, in alternating order (see
    :func:`fp16fx.bench.harness.run_bench`); compile times come from the first round.
    ``interleave`` then times the steps again with all contenders alive at once, in turn,
    beside a copy that measures the roofline's bandwidth in the same loop
    (:func:`fp16fx.bench.interleave.interleaved_ms`): ms/step, the fraction of the roofline
    and the speed-ups come from that.
    """

    presets: Sequence[Preset]
    only: Sequence[str] | None = None
    steps: int = 30
    warmup: int = 5
    device: str = "cpu"
    threads: int | None = None
    compile_times: bool = True
    time_budget_s: float | None = 10.0
    copy_buffer_bytes: int | None = None
    seed: int = 0
    rounds: int = 1
    interleave: bool = False
    config: BenchConfig = field(default_factory=BenchConfig)

    @property
    def warmup_steps(self) -> int:
        """The untimed steps every contender runs before timing: ``warmup``, and at least one
        (a compiled contender's first step compiles)."""
        return max(self.warmup, 1)

    def param_set(self, preset: Preset, device: torch.device) -> tuple[list[Tensor], list[Tensor]]:
        """Returns a contender's fresh params and scaled grads: the same for every contender."""
        return make_param_set(
            preset.shapes, device, self.config.loss_scale, self.seed, self.config.dtype
        )
