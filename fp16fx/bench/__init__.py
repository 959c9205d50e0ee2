"""``fp16fx bench``: fp16fx's optimizer step against the roofline and the baselines.

Measures, in one process, the median step time of an Adam step on FP16 params (with a static
loss scale) for each registered contender on parameter sets built from real model shapes, and
reports it against the roofline (30 B/param ÷ measured copy bandwidth). See
``docs/benchmarks.md``.

Modules: :mod:`~fp16fx.bench.runner` (the :class:`Runner` interface and registry),
:mod:`~fp16fx.bench.presets` (parameter sets), :mod:`~fp16fx.bench.baselines` (torch-native
and apex-style contenders), :mod:`~fp16fx.bench.fp16fx_runners` (fp16fx's contenders),
:mod:`~fp16fx.bench.measure` (timers, roofline, memory, compile caches),
:mod:`~fp16fx.bench.options` (what a run measures), :mod:`~fp16fx.bench.harness` (running
them), :mod:`~fp16fx.bench.interleave` (``--interleave``: every contender's step i in one loop
iteration), :mod:`~fp16fx.bench.results` (what was measured), :mod:`~fp16fx.bench.report`
(table, JSON),
:mod:`~fp16fx.bench.sharded` and :mod:`~fp16fx.bench.sharded_worker` (``--world-sizes``: the
sharded step per rank in local gloo processes) and :mod:`~fp16fx.bench.command` (the command
line).
"""

from fp16fx.bench.command import add_parser, main, run
from fp16fx.bench.harness import BenchOptions, BenchResult, run_bench
from fp16fx.bench.runner import BenchConfig, Runner, register_runner, runner_classes

__all__ = [
    "BenchConfig",
    "BenchOptions",
    "BenchResult",
    "Runner",
    "add_parser",
    "main",
    "register_runner",
    "run",
    "run_bench",
    "runner_classes",
]
