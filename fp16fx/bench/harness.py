"""Runs the contenders of ``fp16fx bench`` side by side and collects their measurements.

For each preset and each selected runner, in one process:

1. fresh FP16 params and scaled FP16 grads from the same seed (:func:`make_param_set`);
2. if the runner compiles and compile times are wanted: with a new, empty Inductor cache
   directory, ``setup`` + first ``step`` (the *cold* compile), then ``torch._dynamo.reset()``
   and in-memory caches dropped, a new runner, ``setup`` + first ``step`` again (the *warm*
   compile, from the populated disk cache). Compile time = first-step time - median step time;
3. ``warmup`` untimed steps (at least one), then ``steps`` individually timed steps; the
   median is reported.
   During the timed steps: peak memory above the level when they began (CPU: peak RSS,
   reset via ``/proc/self/clear_refs`` and read as ``VmHWM``, after ``malloc_trim`` returned
   freed heap to the OS; CUDA: ``max_memory_allocated``), and graphs compiled (a rise is a
   recompile);
4. persistent bytes = distinct storages of :meth:`Runner.persistent_tensors` ÷ params.

A runner that raises is reported as such and the run goes on. The roofline (30 B/param ÷ copy
bandwidth measured at the start) is a row too.
With ``interleave``, the steps are timed again in turn (:mod:`fp16fx.bench.interleave`).
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from fp16fx.bench import measure
from fp16fx.bench.interleave import interleaved_ms
from fp16fx.bench.options import MIN_TIMED_STEPS, BenchOptions
from fp16fx.bench.presets import Preset
from fp16fx.bench.results import (
    ROOFLINE,
    BenchResult,
    ContenderResult,
    PresetResult,
    one_line,
)
from fp16fx.bench.runner import Runner, runner_classes
from fp16fx.tree import storage_bytes

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

Progress = Callable[[str], None]


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


def _set_times(row: ContenderResult, ms: list[float]) -> None:
    """Sets ``row``'s median, fastest and p90 step times from ``ms`` and its step count."""
    row.ms_per_step, row.min_ms, row.p90_ms = measure.median_min_p90(ms)
    row.steps = len(ms)


def _row(
    cls: type[Runner], opts: BenchOptions, status: str = "ok", reason: str | None = None
) -> ContenderResult:
    """Returns ``cls``'s result row, nothing measured yet; a contender with a roofline of its
    own says so in its label."""
    kind = "baseline" if cls.baseline else "fp16fx"
    moved = cls.moved_bytes(opts.config.dtype)
    label = cls.label
    if moved != measure.ROOFLINE_BYTES_PER_PARAM:
        label += f" ({moved:g} B/param roof)"
    row = ContenderResult(cls.name, label, kind, status, reason)
    row.moved_bytes_per_param = moved
    return row


def _measure(
    cls: type[Runner],
    preset: Preset,
    opts: BenchOptions,
    device: torch.device,
    progress: Progress,
    round_: int,
) -> ContenderResult:
    tag = f"[{preset.name}] {cls.name}"
    if opts.rounds > 1:
        tag += f" (round {round_ + 1}/{opts.rounds})"
    result = _row(cls, opts)
    time_compiles = cls.compiled and opts.compile_times and round_ == 0
    if cls.compiled and not time_compiles:  # (a fresh compile cache forgets them itself)
        measure.forget_compiled()  # each instance compiles afresh: never near Dynamo's limit
    probe = measure.MemoryProbe(device)
    measure.release_memory(device)
    level_before = probe.current()
    params, grads = opts.param_set(preset, device)
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
        progress(f"{tag}: {opts.warmup_steps} warm-up steps")
        for _ in range(opts.warmup_steps):
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

    _set_times(result, [t * 1e3 for t in times])
    median = result.ms_per_step / 1e3
    if cold_s is not None and warm_s is not None:
        result.cold_compile_s = max(cold_s - median, 0.0)
        result.warm_compile_s = max(warm_s - median, 0.0)
    if peak is not None and level_before is not None and level_start is not None:
        result.peak_mem_bytes = max(peak - level_start, 0)
        result.peak_mem_total_bytes = max(peak - level_before, 0)
    result.persistent_bytes_per_param = persistent / preset.num_params
    progress(f"{tag}: {result.ms_per_step:.2f} ms/step (median of {len(times)})")
    return result


def _merge_rounds(rounds: list[ContenderResult]) -> ContenderResult:
    """Returns one contender's rounds as one result: the median of the rounds' medians, the
    fastest step of all, the median round's p90 (of an even count, the higher middle one: a
    measured time, as each round's is), steps and recompiles summed, the highest peak memory."""
    if len(rounds) == 1:
        return rounds[0]

    def highest(values: list[int | None]) -> int | None:
        known = [v for v in values if v is not None]
        return max(known) if known else None

    return replace(
        rounds[0],
        ms_per_step=statistics.median(r.ms_per_step for r in rounds),
        min_ms=min(r.min_ms for r in rounds),
        p90_ms=statistics.median_high(r.p90_ms for r in rounds),
        steps=sum(r.steps for r in rounds),
        recompiles=sum(r.recompiles or 0 for r in rounds),
        peak_mem_bytes=highest([r.peak_mem_bytes for r in rounds]),
        peak_mem_total_bytes=highest([r.peak_mem_total_bytes for r in rounds]),
        notes=list(dict.fromkeys(n for r in rounds for n in r.notes)),
    )


def _median_ratio(base: list[float] | None, mine: list[float]) -> float | None:
    """Returns the median over rounds of ``base / mine``: a speed-up, or with the roofline's
    times as ``base`` a fraction of it (a single value on either side meets every round of
    the other)."""
    if not base:
        return None
    if len(mine) == 1:
        mine = mine * len(base)
    if len(base) == 1:
        base = base * len(mine)
    return statistics.median(b / m for b, m in zip(base, mine))


def _fill_ratios(
    rows: list[ContenderResult], per_round: dict[str, list[float]], nbytes: int
) -> None:
    """Sets each row's GB/s, fraction of the roofline and speed-ups: medians of ratios taken
    round by round (or iteration by iteration) where ``per_round`` has both sides' times."""
    (roofline_row,) = (row for row in rows if row.name == ROOFLINE)
    roofline = per_round.get(ROOFLINE, [roofline_row.ms_per_step])
    for row in rows:
        if row.ms_per_step is None:
            continue
        mine = per_round.get(row.name, [row.ms_per_step])
        # A contender that moves fewer bytes (compact precision) has its own roofline.
        own = row.moved_bytes_per_param / measure.ROOFLINE_BYTES_PER_PARAM
        row.gbps = measure.gbps_of(nbytes * own, row.ms_per_step)
        fraction = _median_ratio(roofline, mine)
        row.fraction_of_roofline = None if fraction is None else fraction * own
        row.speedup_vs_torch_fused = _median_ratio(per_round.get(BASELINE_TORCH), mine)
        row.speedup_vs_apex_style = _median_ratio(per_round.get(BASELINE_APEX), mine)


def _run_preset(
    preset: Preset,
    runners: Sequence[type[Runner]],
    opts: BenchOptions,
    device: torch.device,
    bandwidth: measure.Bandwidth,
    progress: Progress,
) -> PresetResult:
    """Measures every runner on ``preset``, ``opts.rounds`` times.

    Odd rounds run the contenders in reverse order, so load that drifts during a run (other
    work on the machine, thermal limits) favours none of them; each speed-up is the median of
    the rounds' ratios, each contender measured beside its baseline in the same round. With
    more than one round, each round first measures the copy bandwidth again, and each
    fraction of the roofline is likewise the median of the rounds' ratios.
    """
    nbytes = measure.roofline_bytes(preset.num_params)
    roofline = ContenderResult(
        ROOFLINE,
        "roofline (30 B/param ÷ copy BW)",
        "roofline",
        ms_per_step=measure.ms_at(nbytes, bandwidth.gbps),
    )
    failed: dict[str, ContenderResult] = {}
    measured: dict[str, list[ContenderResult]] = {}
    round_roofline_ms = []
    for round_ in range(opts.rounds):
        if opts.rounds > 1 and not opts.interleave:
            gbps = measure.copy_bandwidth(device, opts.copy_buffer_bytes).gbps
            round_roofline_ms.append(measure.ms_at(nbytes, gbps))
        order = runners if round_ % 2 == 0 else list(reversed(runners))
        for cls in order:
            if cls.name in failed:
                continue
            try:
                result = _measure(cls, preset, opts, device, progress, round_)
            except Exception as exc:  # a broken contender must not sink the others
                progress(f"[{preset.name}] {cls.name}: {traceback.format_exc().rstrip()}")
                progress(f"[{preset.name}] {cls.name}: error ({type(exc).__name__}: {exc})")
                failed[cls.name] = _row(cls, opts, "error", f"{type(exc).__name__}: {exc}")
                measured.pop(cls.name, None)
                measure.forget_compiled()
                measure.release_memory(device)
                continue
            measured.setdefault(cls.name, []).append(result)
    rows = [roofline]
    for cls in runners:
        rows.append(failed[cls.name] if cls.name in failed else _merge_rounds(measured[cls.name]))
    per_round = {name: [r.ms_per_step for r in rounds] for name, rounds in measured.items()}
    looped: set[str] = set()
    if opts.interleave:
        alive = [cls for cls in runners if cls.name in measured]
        loop = interleaved_ms(preset, alive, opts, device, bandwidth.buffer_bytes, progress)
        # A contender that raised in the loop keeps its first pass's time, for its ratios and
        # those against it (a baseline, whose column would otherwise go blank in every row).
        first_pass = {row.name: [row.ms_per_step] for row in rows if row.name in loop.failed}
        per_round, looped = {**first_pass, **loop.ms}, set(loop.ms)
        for row in rows:
            if row.name in loop.ms:
                _set_times(row, loop.ms[row.name])
            elif row.name in loop.failed:
                row.notes.append(
                    f"raised in the interleaved loop ({one_line(loop.failed[row.name])}): its "
                    "times are the first pass's, and its ratios set them against the loop's"
                )
    elif round_roofline_ms:
        per_round[ROOFLINE] = round_roofline_ms
        _set_times(roofline, round_roofline_ms)
    _fill_ratios(rows, per_round, nbytes)
    for row in rows[1:]:  # a time budget that cut the timing short says so
        if row.name in looped:
            of, what = opts.steps, "interleaved iterations"
        else:
            of, what = opts.steps * opts.rounds, "steps"
        if row.status == "ok" and row.steps < of:
            row.notes.append(
                f"{row.steps} of {of} {what} timed "
                f"(time budget {opts.time_budget_s:g} s per contender)"
            )
    return PresetResult(
        preset.name,
        preset.num_params,
        preset.num_leaves,
        nbytes,
        roofline.ms_per_step,
        measure.gbps_of(nbytes, roofline.ms_per_step),
        rows,
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
    if opts.steps < 1 or opts.warmup < 0 or opts.rounds < 1:
        raise ValueError(
            "need steps >= 1, warmup >= 0 and rounds >= 1, got "
            f"{opts.steps}, {opts.warmup}, {opts.rounds}"
        )
    runners = select_runners(opts.only)
    if device.type == "cpu":
        measure.steady_allocator()
    load_start = measure.load_average()
    say(f"measuring copy bandwidth on {device} ({torch.get_num_threads()} threads)")
    bandwidth = measure.copy_bandwidth(device, opts.copy_buffer_bytes)
    say(f"copy bandwidth {bandwidth.gbps:.1f} GB/s")
    if opts.compile_times and any(cls.compiled for cls in runners):
        say("warming up the compiler (imports, worker pool)")
        measure.warm_up_compiler(device)
    with measure.only_new_garbage():
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
        warmup=opts.warmup_steps,
        rounds=opts.rounds,
        interleaved=opts.interleave,
        lr=opts.config.lr,
        betas=opts.config.betas,
        eps=opts.config.eps,
        loss_scale=opts.config.loss_scale,
        dtype=opts.config.dtype_name,
        copy_bandwidth_gbps=bandwidth.gbps,
        inplace_bandwidth_gbps=bandwidth.inplace_gbps,
        copy_buffer_bytes=bandwidth.buffer_bytes,
        roofline_bytes_per_param=measure.ROOFLINE_BYTES_PER_PARAM,
        load_avg_start=load_start,
        load_avg_end=measure.load_average(),
        cpu_count=os.cpu_count(),
        presets=presets,
    )
