"""Runs the contenders of ``fp16fx bench`` side by side and collects their measurements.

For each preset and each selected runner, in one process:

1. fresh FP16 params and scaled FP16 grads from the same seed (:func:`make_param_set`);
2. if the runner compiles and compile times are wanted: with a new, empty Inductor cache
   directory, ``setup`` + first ``step`` (the *cold* compile), then ``torch._dynamo.reset()``
   and in-memory caches dropped, a new runner, ``setup`` + first ``step`` again (the *warm*
   compile, from the populated disk cache). Compile time = first-step time - median step time;
3. ``warmup`` untimed steps, then ``steps`` individually timed steps; the median is reported.
   During the timed steps: peak memory above the level when they began (CPU: peak RSS,
   reset via ``/proc/self/clear_refs`` and read as ``VmHWM``, after ``malloc_trim`` returned
   freed heap to the OS; CUDA: ``max_memory_allocated``), and graphs compiled (a rise is a
   recompile);
4. persistent bytes = distinct storages of :meth:`Runner.persistent_tensors` ÷ params.

A runner that is unavailable (``unavailable_reason``) or raises is reported as such and the
run goes on. The roofline (30 B/param ÷ copy bandwidth measured at the start) is a row too.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from fp16fx.bench import measure
from fp16fx.bench.presets import Preset, make_param_set
from fp16fx.bench.runner import BenchConfig, Runner, runner_classes, storage_bytes

__all__ = [
    "BASELINE_APEX",
    "BASELINE_TORCH",
    "BenchOptions",
    "BenchResult",
    "ContenderResult",
    "PresetResult",
    "run_bench",
    "select_runners",
]

#: Names of the two baselines every contender's speed-up is reported against.
BASELINE_TORCH = "torch-fused"
BASELINE_APEX = "apex-style"
ROOFLINE = "roofline"

Progress = Callable[[str], None]


@dataclass
class ContenderResult:
    """What was measured for one contender on one preset (times in ms/s, memory in bytes).

    ``status`` is ``"ok"``, ``"unavailable"`` or ``"error"`` (then ``reason`` says why and the
    measurements are None). ``peak_mem_bytes`` is the peak during the timed steps above the
    memory held when they began: what a step allocates on top of the persistent state (CPU:
    peak RSS delta; CUDA: ``max_memory_allocated`` delta). ``peak_mem_total_bytes`` is the
    same peak above the level before this contender's params existed (params, grads, state
    and temporaries; on CPU it also counts library code first paged in by the contender).
    """

    name: str
    label: str
    kind: str
    status: str = "ok"
    reason: str | None = None
    ms_per_step: float | None = None
    min_ms: float | None = None
    p90_ms: float | None = None
    steps: int = 0
    gbps: float | None = None
    fraction_of_roofline: float | None = None
    speedup_vs_torch_fused: float | None = None
    speedup_vs_apex_style: float | None = None
    cold_compile_s: float | None = None
    warm_compile_s: float | None = None
    recompiles: int | None = None
    peak_mem_bytes: int | None = None
    peak_mem_total_bytes: int | None = None
    persistent_bytes_per_param: float | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class PresetResult:
    """All contenders' results on one parameter set."""

    preset: str
    params: int
    leaves: int
    roofline_bytes: int
    roofline_ms: float
    results: list[ContenderResult]


@dataclass
class BenchResult:
    """One ``fp16fx bench`` run: environment, copy bandwidth and per-preset results."""

    device: str
    device_name: str
    torch_version: str
    threads: int
    steps: int
    warmup: int
    loss_scale: float
    copy_bandwidth_gbps: float
    inplace_bandwidth_gbps: float
    copy_buffer_bytes: int
    roofline_bytes_per_param: int
    load_avg_start: float | None
    load_avg_end: float | None
    cpu_count: int | None
    presets: list[PresetResult]


@dataclass
class BenchOptions:
    """What to run: presets, contenders (None = all registered), steps and device.

    ``time_budget_s`` caps each contender's timed steps: once it is spent, timing stops
    after at least :data:`MIN_TIMED_STEPS` steps (None: always ``steps``).
    ``copy_buffer_bytes`` sizes the bandwidth measurement (None: the default of
    :func:`~fp16fx.bench.measure.copy_bandwidth`; small sizes only for tests).
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
    config: BenchConfig = field(default_factory=BenchConfig)


def select_runners(only: Sequence[str] | None) -> list[type[Runner]]:
    """Return the registered runners named in ``only`` (the default ones if None), in order.

    ``"roofline"`` is accepted and ignored (the roofline row is always reported).
    """
    classes = runner_classes()
    if only is None:
        return [cls for cls in classes if cls.default]
    known = {cls.name for cls in classes}
    unknown = sorted(set(only) - known - {ROOFLINE})
    if unknown:
        raise ValueError(
            f"unknown contender(s) {unknown}; choose from {[ROOFLINE, *sorted(known)]}"
        )
    return [cls for cls in classes if cls.name in set(only)]


#: Timed steps always run, whatever the time budget (unless ``steps`` is smaller).
MIN_TIMED_STEPS = 5


def _timed_steps(
    runner: Runner, opts: BenchOptions, device: torch.device, progress: Progress, tag: str
) -> list[float]:
    timer = measure.StepTimer(device)
    start = last_report = time.monotonic()
    for i in range(opts.steps):
        timer.time(runner.step)
        now = time.monotonic()
        if now - last_report > 2.0:
            progress(f"{tag}: {i + 1}/{opts.steps} timed steps")
            last_report = now
        over_budget = opts.time_budget_s is not None and now - start > opts.time_budget_s
        if over_budget and i + 1 >= MIN_TIMED_STEPS:
            break
    return timer.seconds()


def _first_step_s(runner: Runner, params: list, grads: list, device: torch.device) -> float:
    runner.setup(params, grads)
    measure.synchronize(device)
    return measure.time_call(runner.step, device)


def _measure(
    cls: type[Runner],
    preset: Preset,
    opts: BenchOptions,
    device: torch.device,
    progress: Progress,
) -> ContenderResult:
    tag = f"[{preset.name}] {cls.name}"
    result = ContenderResult(cls.name, cls.label, "baseline" if cls.baseline else "fp16fx")
    probe = measure.MemoryProbe(device)
    measure.release_memory(device)
    level_before = probe.current()
    params, grads = make_param_set(preset.shapes, device, opts.config.loss_scale, opts.seed)
    time_compiles = cls.compiled and opts.compile_times
    with measure.compile_cache(fresh=time_compiles):
        runner = cls(opts.config)
        cold_s = warm_s = None
        if time_compiles:
            progress(f"{tag}: cold compile (empty Inductor cache)")
            cold_s = _first_step_s(runner, params, grads, device)
            del runner
            measure.forget_compiled()
            measure.release_memory(device)
            progress(f"{tag}: warm compile (populated cache)")
            runner = cls(opts.config)
            warm_s = _first_step_s(runner, params, grads, device)
        else:
            runner.setup(params, grads)
        progress(f"{tag}: {opts.warmup} warm-up steps")
        for _ in range(max(opts.warmup, 1 if cls.compiled else 0)):
            runner.step()
        measure.synchronize(device)
        measure.release_memory(device)  # hand back freed heap, so temporaries show as a peak
        graphs_before = measure.graphs_compiled()
        level_start = probe.current()
        peak_ok = probe.reset_peak()
        times = _timed_steps(runner, opts, device, progress, tag)
        measure.synchronize(device)
        peak = probe.peak() if peak_ok else None
        result.recompiles = measure.graphs_compiled() - graphs_before
        persistent = storage_bytes(runner.persistent_tensors())
        result.notes = list(runner.notes)
        del runner
    del params, grads
    measure.release_memory(device)

    median = statistics.median(times)
    result.steps = len(times)
    if len(times) < opts.steps:
        result.notes.append(
            f"{len(times)} of {opts.steps} steps timed (time budget {opts.time_budget_s:g} s)"
        )
    result.ms_per_step = median * 1e3
    result.min_ms = min(times) * 1e3
    result.p90_ms = sorted(times)[min(len(times) - 1, int(0.9 * len(times)))] * 1e3
    if cold_s is not None and warm_s is not None:
        result.cold_compile_s = max(cold_s - median, 0.0)
        result.warm_compile_s = max(warm_s - median, 0.0)
    if peak is not None and level_before is not None and level_start is not None:
        result.peak_mem_bytes = max(peak - level_start, 0)
        result.peak_mem_total_bytes = max(peak - level_before, 0)
    result.persistent_bytes_per_param = persistent / preset.num_params
    progress(f"{tag}: {result.ms_per_step:.2f} ms/step (median of {len(times)})")
    return result


def _fill_ratios(rows: list[ContenderResult], roofline: ContenderResult, nbytes: int) -> None:
    medians = {r.name: r.ms_per_step for r in rows if r.ms_per_step is not None}
    for row in rows:
        if row.ms_per_step is None:
            continue
        row.gbps = nbytes / (row.ms_per_step / 1e3) / 1e9
        row.fraction_of_roofline = roofline.ms_per_step / row.ms_per_step  # type: ignore[operator]
        if BASELINE_TORCH in medians:
            row.speedup_vs_torch_fused = medians[BASELINE_TORCH] / row.ms_per_step
        if BASELINE_APEX in medians:
            row.speedup_vs_apex_style = medians[BASELINE_APEX] / row.ms_per_step


def _run_preset(
    preset: Preset,
    runners: Sequence[type[Runner]],
    opts: BenchOptions,
    device: torch.device,
    bandwidth: measure.Bandwidth,
    progress: Progress,
) -> PresetResult:
    nbytes = measure.roofline_bytes(preset.num_params)
    roofline_ms = nbytes / (bandwidth.gbps * 1e9) * 1e3
    roofline = ContenderResult(
        ROOFLINE, "roofline (30 B/param ÷ copy BW)", "roofline", ms_per_step=roofline_ms
    )
    rows = [roofline]
    for cls in runners:
        reason = cls.unavailable_reason(device)
        if reason is not None:
            progress(f"[{preset.name}] {cls.name}: unavailable ({reason})")
            kind = "baseline" if cls.baseline else "fp16fx"
            rows.append(ContenderResult(cls.name, cls.label, kind, "unavailable", reason))
            continue
        try:
            rows.append(_measure(cls, preset, opts, device, progress))
        except Exception as exc:  # a broken contender must not sink the others
            traceback.print_exc(file=sys.stderr)
            progress(f"[{preset.name}] {cls.name}: error ({type(exc).__name__}: {exc})")
            kind = "baseline" if cls.baseline else "fp16fx"
            reason = f"{type(exc).__name__}: {exc}"
            rows.append(ContenderResult(cls.name, cls.label, kind, "error", reason))
            measure.forget_compiled()
            measure.release_memory(device)
    _fill_ratios(rows, roofline, nbytes)
    return PresetResult(
        preset.name, preset.num_params, preset.num_leaves, nbytes, roofline_ms, rows
    )


def run_bench(opts: BenchOptions, progress: Progress | None = None) -> BenchResult:
    """Run every selected contender on every preset and return all measurements.

    ``progress`` receives one-line status messages (the CLI prints them on stderr).
    """
    say: Progress = progress or (lambda message: None)
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda requested but torch.cuda.is_available() is False")
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    if opts.steps < 1 or opts.warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got {opts.steps}, {opts.warmup}")
    runners = select_runners(opts.only)
    load_start = measure.load_average()
    say(f"measuring copy bandwidth on {device} ({torch.get_num_threads()} threads)")
    bandwidth = measure.copy_bandwidth(device, opts.copy_buffer_bytes)
    say(f"copy bandwidth {bandwidth.gbps:.1f} GB/s")
    if opts.compile_times and any(
        cls.compiled and cls.unavailable_reason(device) is None for cls in runners
    ):
        say("warming up the compiler (imports, worker pool)")
        measure.warm_up_compiler(device)
    presets = [_run_preset(p, runners, opts, device, bandwidth, say) for p in opts.presets]
    device_name = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else measure.cpu_name()
    )
    return BenchResult(
        device=str(device),
        device_name=device_name,
        torch_version=torch.__version__,
        threads=torch.get_num_threads(),
        steps=opts.steps,
        warmup=opts.warmup,
        loss_scale=opts.config.loss_scale,
        copy_bandwidth_gbps=bandwidth.gbps,
        inplace_bandwidth_gbps=bandwidth.inplace_gbps,
        copy_buffer_bytes=bandwidth.buffer_bytes,
        roofline_bytes_per_param=measure.ROOFLINE_BYTES_PER_PARAM,
        load_avg_start=load_start,
        load_avg_end=measure.load_average(),
        cpu_count=os.cpu_count(),
        presets=presets,
    )
