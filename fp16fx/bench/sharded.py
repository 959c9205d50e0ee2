"""``fp16fx bench --world-sizes``: the sharded (ZeRO-1 style) Adam step, measured per rank.

For each preset and each world size d (the CLI always adds d = 1, the unsharded state), d
local processes are spawned with ``torch.multiprocessing`` on a gloo process group (threads
per process: the cores ÷ d, at least 1, so the ranks do not oversubscribe the CPU). Every
rank builds the same FP16 params and scaled grads as the single-process bench, then times
its steps (:mod:`fp16fx.bench.sharded_worker`):

* d = 1: ``fp16fx.init(params, fp16fx.adam(lr), StaticLossScale(s), buckets=True)``, grads in
  ``fp16fx.grad_buffers(state)``, stepped by ``fp16fx.compile_step(inplace=True)``;
* d > 1: ``fp16fx.distributed.init(..., shard=True)``, grads in ``fdist.grad_buffers(state)``,
  stepped by ``fdist.sharded_step(state, grads, step=fp16fx.compile_step(inplace=True))``:
  reduce-scatter, the shard's compiled step, all-gather.

Both in the precision of :attr:`ShardedOptions.precision` (``master=``, ``moments=``; FP32
masters and moments by default). Reported per rank: median and fastest ms/step, and the
persistent bytes per param measured from the actual tensors (``fdist.persistent_bytes``) next
to the formula 4 + s/d (s = 12 for FP32 masters and moments, 3.03 for compensated + int8).

A worker that raises or dies ends the run with an error naming it (the other workers are
stopped); a worker that hangs in a collective fails after the process group's timeout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue as queue_module
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.multiprocessing as mp

from fp16fx.bench import measure
from fp16fx.bench.presets import Preset
from fp16fx.bench.report import align, format_number, load_note, preset_line
from fp16fx.bench.runner import BenchConfig
from fp16fx.bench.sharded_worker import (
    Job,
    RankResult,
    divided_bytes_per_param,
    warmup_steps,
    worker,
)
from fp16fx.precision import Precision

__all__ = [
    "SHARDED_JSON_SCHEMA_VERSION",
    "ShardedOptions",
    "ShardedPresetResult",
    "ShardedResult",
    "format_sharded_report",
    "format_sharded_table",
    "run_sharded",
    "sharded_to_json",
]

#: Bumped when the sharded JSON document's fields change meaning.
SHARDED_JSON_SCHEMA_VERSION = 1

Progress = Callable[[str], None]


@dataclass
class ShardedOptions:
    """What to run: presets, world sizes (d = 1: the unsharded state), steps, CPU cores.

    ``cores`` is split among the d processes of a world size: each gets
    ``max(1, cores // d)`` torch threads (None: the CPUs this process may run on).
    ``timeout_s`` is the process group's collective timeout. ``precision``: how the state
    stores masters and moments (``fp16fx.init``'s ``master=``, ``moments=``).
    """

    presets: Sequence[Preset]
    world_sizes: Sequence[int] = (1, 2)
    steps: int = 30
    warmup: int = 5
    time_budget_s: float | None = 10.0
    seed: int = 0
    cores: int | None = None
    timeout_s: float = 300.0
    config: BenchConfig = field(default_factory=BenchConfig)
    precision: Precision = field(default_factory=Precision)


@dataclass
class ShardedPresetResult:
    """Every rank's result at every world size on one parameter set."""

    preset: str
    params: int
    leaves: int
    ranks: list[RankResult]


@dataclass
class ShardedResult:
    """One ``fp16fx bench --world-sizes`` run: environment and per-preset results."""

    device: str
    device_name: str
    torch_version: str
    backend: str
    cores: int
    world_sizes: list[int]
    steps: int
    warmup: int
    lr: float
    betas: tuple[float, float]
    eps: float
    loss_scale: float
    dtype: str
    master: str
    moments: str
    divided_bytes_per_param: float
    load_avg_start: float | None
    load_avg_end: float | None
    cpu_count: int | None
    presets: list[ShardedPresetResult]


def available_cores() -> int:
    """Return the number of CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _drain(queue: mp.Queue, ranks: list[RankResult], say: Progress) -> None:
    while True:
        try:
            kind, payload = queue.get_nowait()
        except queue_module.Empty:
            return
        if kind == "progress":
            say(payload)
        else:
            ranks.append(payload)


def _failure(exc: Exception, job: Job) -> RuntimeError:
    """Return the error that ends the run when a worker of ``job`` failed."""
    if isinstance(exc, mp.ProcessRaisedException):
        print(str(exc), file=sys.stderr)  # the worker's traceback
        last = str(exc).strip().splitlines()[-1]
        what = f"rank {exc.error_index} raised {last}"
    else:
        what = str(exc)  # e.g. "process 1 terminated with signal SIGKILL" (out of memory?)
    return RuntimeError(
        f"sharded bench of {job.preset} at d={job.world_size} failed: {what}; "
        "the other workers were stopped"
    )


def _run_world(job: Job, say: Progress) -> list[RankResult]:
    """Spawn ``job.world_size`` workers, relay their progress, return their results."""
    queue = mp.get_context("spawn").Queue()
    ranks: list[RankResult] = []
    context = mp.spawn(worker, args=(job, queue), nprocs=job.world_size, join=False)
    try:
        while not context.join(timeout=0.25):
            _drain(queue, ranks, say)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        raise _failure(exc, job) from None
    finally:
        for process in context.processes:  # only after an interrupt are any still running
            if process.is_alive():
                process.terminate()
    _drain(queue, ranks, say)
    return sorted(ranks, key=lambda r: r.rank)


def run_sharded(opts: ShardedOptions, progress: Progress | None = None) -> ShardedResult:
    """Measure every preset at each of ``opts.world_sizes``; return every rank's row.

    ``progress`` receives one-line status messages (the CLI prints them on stderr).
    """
    say: Progress = progress or (lambda message: None)
    if opts.steps < 1 or opts.warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got {opts.steps}, {opts.warmup}")
    if any(d < 1 for d in opts.world_sizes):
        raise ValueError(f"world sizes must be >= 1, got {list(opts.world_sizes)}")
    sizes = sorted(set(opts.world_sizes))
    cores = opts.cores or available_cores()
    load_start = measure.load_average()
    presets = []
    for preset in opts.presets:
        ranks: list[RankResult] = []
        for d in sizes:
            threads = max(1, cores // d)
            say(f"[{preset.name}] d={d}: spawning {d} process(es), {threads} thread(s) each")
            with tempfile.TemporaryDirectory(prefix="fp16fx-bench-store-") as tmp:
                job = Job(
                    preset=preset.name,
                    shapes=preset.shapes,
                    world_size=d,
                    threads=threads,
                    steps=opts.steps,
                    warmup=opts.warmup,
                    time_budget_s=opts.time_budget_s,
                    seed=opts.seed,
                    config=opts.config,
                    timeout_s=opts.timeout_s,
                    init_method=(Path(tmp) / "store").as_uri(),  # a FileStore: no port to pick
                    precision=opts.precision,
                )
                found = _run_world(job, say)
            for r in found:
                say(
                    f"[{preset.name}] d={d} rank {r.rank}: {r.ms_per_step:.2f} ms/step, "
                    f"{r.bytes_per_param:.2f} B/param"
                )
            ranks += found
        presets.append(
            ShardedPresetResult(preset.name, preset.num_params, preset.num_leaves, ranks)
        )
    return ShardedResult(
        device="cpu",
        device_name=measure.cpu_name(),
        torch_version=torch.__version__,
        backend="gloo",
        cores=cores,
        world_sizes=sizes,
        steps=opts.steps,
        warmup=warmup_steps(opts.warmup),  # the steps run
        lr=opts.config.lr,
        betas=opts.config.betas,
        eps=opts.config.eps,
        loss_scale=opts.config.loss_scale,
        dtype=opts.config.dtype_name,
        master=opts.precision.master,
        moments=opts.precision.moments,
        divided_bytes_per_param=divided_bytes_per_param(opts.precision, opts.config.dtype),
        load_avg_start=load_start,
        load_avg_end=measure.load_average(),
        cpu_count=os.cpu_count(),
        presets=presets,
    )


COLUMNS: Sequence[tuple[str, Callable[[RankResult], str]]] = (
    ("state", lambda r: "sharded" if r.sharded else "unsharded"),
    ("d", lambda r: str(r.world_size)),
    ("rank", lambda r: str(r.rank)),
    ("threads", lambda r: str(r.threads)),
    ("step", lambda r: r.step),
    ("ms/step", lambda r: format_number(r.ms_per_step, ".2f")),
    ("min ms", lambda r: format_number(r.min_ms, ".2f")),
    ("comm ms", lambda r: format_number(r.comm_ms, ".2f")),
    ("timed", lambda r: str(r.steps)),
    ("MB/rank", lambda r: format_number(r.persistent_bytes / 1e6, ".1f")),
    ("B/param", lambda r: format_number(r.bytes_per_param, ".2f")),
    ("4+s/d", lambda r: format_number(r.formula_bytes_per_param, ".2f")),
)


def format_sharded_table(preset: ShardedPresetResult, bench: ShardedResult) -> str:
    """Return one preset's per-rank rows as an aligned text table with its header line."""
    header = preset_line(preset.preset, preset.params, preset.leaves, bench)
    rows = [[cell(r) for _, cell in COLUMNS] for r in preset.ranks]
    body = align([name for name, _ in COLUMNS], rows)
    # The ranks of one world size step together, so they share their notes: print them once.
    notes = list(
        dict.fromkeys(f"note: d={r.world_size}: {n}" for r in preset.ranks for n in r.notes)
    )
    return "\n".join([header, "", *body, *notes])


def format_sharded_report(bench: ShardedResult) -> str:
    """Return the whole sharded run as text: environment lines, then one table per preset."""
    intro = "\n".join(
        [
            f"fp16fx bench --world-sizes on {bench.device} ({bench.device_name}), torch "
            f"{bench.torch_version}; {bench.backend} on localhost, {bench.cores} cores shared "
            "by the d processes",
            f"median of {bench.steps} steps after {bench.warmup} warm-up, per rank; the ranks "
            "begin each step together (reduce-scatter, shard step, all-gather)",
            "comm ms: that reduce-scatter and all-gather alone, on buffers of the same sizes",
            "step: compiled = fp16fx.compile_step(inplace=True) (for d > 1: the core of "
            "fdist.sharded_step)",
            f"state: master={bench.master!r}, moments={bench.moments!r}",
            "B/param: this rank's persistent bytes per param, measured by fdist.persistent_bytes",
            "(FP16 params and grads in full, its masters and moments, 0-d scalars); 4+s/d: "
            f"Adam's formula, s = {bench.divided_bytes_per_param:g} B/param of masters and "
            "moments divided among the d ranks",
            *load_note(bench.load_avg_start, bench.load_avg_end, bench.cpu_count),
        ]
    )
    tables = (format_sharded_table(p, bench) for p in bench.presets)
    return "\n\n".join([intro, *tables]) + "\n"


def sharded_to_json(bench: ShardedResult) -> str:
    """Return the sharded run as one JSON document: ``schema``, ``benchmark``, every field."""
    doc = {
        "schema": SHARDED_JSON_SCHEMA_VERSION,
        "benchmark": "sharded",
        **dataclasses.asdict(bench),
    }
    return json.dumps(doc, indent=2)
