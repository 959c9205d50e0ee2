"""One rank of ``fp16fx bench --world-sizes``: build a state, time its steps, count its bytes.

Runs in a process spawned by :mod:`fp16fx.bench.sharded` (``torch.multiprocessing.spawn``
pickles :func:`worker` by name). At d = 1 the state is the unsharded, bucketed
``fp16fx.init(..., buckets=True)`` stepped by ``fp16fx.compile_step(inplace=True)``; at d > 1
it is ``fp16fx.distributed.init(..., shard=True)`` stepped by ``fdist.sharded_step`` with that
same compiled core, on a gloo process group whose collectives time out after
:attr:`Job.timeout_s` (a hung peer fails the run instead of stalling it).

Every rank sends one :class:`RankResult` on the queue; rank 0 also sends progress lines.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import fp16fx
import fp16fx.distributed as fdist
from fp16fx.bench import measure
from fp16fx.bench.harness import MIN_TIMED_STEPS
from fp16fx.bench.presets import Shape, make_param_set
from fp16fx.bench.runner import BenchConfig
from fp16fx.precision import Precision, correction_dtype

__all__ = ["STEP", "Job", "RankResult", "divided_bytes_per_param", "warmup_steps", "worker"]

#: How every rank steps its state (the shard's, for d > 1): ``fp16fx.compile_step(inplace=True)``.
STEP = "compiled"


def warmup_steps(asked: int) -> int:
    """Returns how many warm-up steps a rank runs for ``asked``: two at least, as the first
    compiles and the time budget is planned from the last."""
    return max(asked, 2)


@dataclass(frozen=True)
class Job:
    """What every rank of one world size measures (sent to the spawned processes)."""

    preset: str
    shapes: tuple[Shape, ...]
    world_size: int
    threads: int
    steps: int
    warmup: int
    time_budget_s: float | None
    seed: int
    config: BenchConfig
    timeout_s: float
    init_method: str
    precision: Precision = field(default_factory=Precision)


@dataclass
class RankResult:
    """One rank's measurements (times in ms, memory in bytes).

    ``ms_per_step`` is the median wall time of one step on this rank: for d > 1 the
    reduce-scatter of the grads, the shard's compiled step (with the consensus all-reduce)
    and the all-gather of the params. ``persistent_bytes`` is
    ``fdist.persistent_bytes(state, grads)``: every distinct storage the state and its grad
    buffers hold (FP16 params and grads in full, this rank's masters and moments, the 0-d
    scalars); ``formula_bytes_per_param`` is 4 + s/d, s :func:`divided_bytes_per_param`
    (12 for FP32 masters and moments). ``comm_ms`` (d > 1) is the median
    time of the step's collectives alone: a reduce-scatter and an all-gather of FP16 buffers
    of the state's sizes, so ``ms_per_step - comm_ms`` is roughly the shard's own work.
    """

    world_size: int
    rank: int
    threads: int
    sharded: bool
    step: str
    ms_per_step: float
    min_ms: float
    p90_ms: float
    comm_ms: float | None
    steps: int
    persistent_bytes: int
    bytes_per_param: float
    formula_bytes_per_param: float
    notes: list[str] = field(default_factory=list)


def divided_bytes_per_param(precision: Precision, dtype: torch.dtype) -> float:
    """Returns the bytes per param of an Adam state that sharding divides among the ranks:
    the master (an FP32 copy, or a compensated param's correction) and two moments (FP32,
    BF16, or int8 codes with an FP32 scale per block)."""
    master = correction_dtype(dtype).itemsize if precision.compensated else 4
    moment = {"fp32": 4, "bf16": 2, "int8": 1 + 4 / precision.block}[precision.moments]
    return master + 2 * moment


def _build(job: Job, params: list[torch.Tensor]) -> tuple[Any, Any, Callable[[], object]]:
    """Return ``(state, grads, step)``: the state of ``params``, its grad buffers, one step."""
    cfg = job.config
    for p in params:
        p.grad = None  # the grads live in the state's buffers
    optimizer = fp16fx.adam(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    policy = fp16fx.StaticLossScale(cfg.loss_scale)
    compiled = fp16fx.compile_step(inplace=True)
    how = {"master": job.precision.master, "moments": job.precision.moments}
    if job.world_size == 1:
        state = fp16fx.init(params, optimizer, policy, buckets=True, **how)
        grads = fp16fx.grad_buffers(state)
        return state, grads, lambda: compiled(state, grads)
    state = fdist.init(params, optimizer, policy, shard=True, **how)
    grads = fdist.grad_buffers(state)
    return state, grads, lambda: fdist.sharded_step(state, grads, step=compiled)


def _planned_steps(job: Job, last_warmup_s: float) -> int:
    """Return how many steps to time, the same on every rank (they step together).

    The time budget is spent at the slowest rank's pace, as estimated from the last warm-up
    step (an all-reduce MAX): a per-rank decision could leave one rank waiting in a
    collective that the others never join.
    """
    if job.time_budget_s is None:
        return job.steps
    slowest = torch.tensor([last_warmup_s], dtype=torch.float64)
    if job.world_size > 1:
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    affordable = int(job.time_budget_s / max(float(slowest), 1e-9))
    return min(job.steps, max(MIN_TIMED_STEPS, affordable))


def _collectives(state: fdist.ShardedState) -> Callable[[], None]:
    """Return a function running the collectives of one ``sharded_step`` of ``state`` alone.

    The state's own reduce-scatter and all-gather (:class:`fp16fx.distributed.sharded.Sharding`),
    on padded flat FP16 buffers of their own (zeros).
    """
    flats = [torch.zeros_like(flat) for flat in state.flat.param_buffers]

    def run() -> None:
        state.sharding.reduce_scatter(state.buckets, flats)
        state.sharding.all_gather(state.buckets, flats)

    return run


def _time_calls(
    what: str,
    count: int,
    prepare: Callable[[], object],
    fn: Callable[[], object],
    say: Callable[[str], None],
) -> list[float]:
    """Return the seconds of ``count`` calls of ``fn``, each after an untimed ``prepare()``;
    ``say`` a progress line naming ``what`` every 2 s."""
    timer = measure.StepTimer(torch.device("cpu"))
    last_report = time.monotonic()
    for i in range(count):
        prepare()
        timer.time(fn)
        if time.monotonic() - last_report > 2.0:
            say(f"{what}: {i + 1}/{count}")
            last_report = time.monotonic()
    return timer.seconds()


def _measure(rank: int, job: Job, say: Callable[[str], None]) -> RankResult:
    params, pristine = make_param_set(
        job.shapes, "cpu", job.config.loss_scale, job.seed, job.config.dtype
    )
    state, grads, step = _build(job, params)
    del params  # now views into the state's flat buffers
    sharded = job.world_size > 1

    def prepare() -> None:
        # sharded_step divides its grad buffers by d in place; restoring them keeps every
        # step's work and values the same, as in the single-process bench.
        with torch.no_grad():
            for g, saved in zip(grads, pristine, strict=True):
                g.copy_(saved)
        if sharded:
            dist.barrier()  # every rank starts the step together: no skew from the restore

    say(f"{warmup_steps(job.warmup)} warm-up steps (the first compiles)")
    warmup = _time_calls("warm-up steps", warmup_steps(job.warmup), prepare, step, say)
    planned = _planned_steps(job, warmup[-1])
    times = _time_calls("timed steps", planned, prepare, step, say)
    comm = None
    if sharded:
        collectives = _collectives(state)
        comm_times = _time_calls("collectives alone", planned, dist.barrier, collectives, say)
        comm = statistics.median(comm_times)
    persistent = fdist.persistent_bytes(state, grads)
    num_params = sum(g.numel() for g in pristine)
    notes = []
    if planned < job.steps:
        notes.append(f"{planned} of {job.steps} steps timed (time budget {job.time_budget_s:g} s)")
    d = job.world_size
    median_ms, min_ms, p90_ms = measure.median_min_p90([t * 1e3 for t in times])
    return RankResult(
        world_size=d,
        rank=rank,
        threads=torch.get_num_threads(),
        sharded=sharded,
        step=STEP,
        ms_per_step=median_ms,
        min_ms=min_ms,
        p90_ms=p90_ms,
        comm_ms=None if comm is None else comm * 1e3,
        steps=len(times),
        persistent_bytes=persistent,
        bytes_per_param=persistent / num_params,
        formula_bytes_per_param=4 + divided_bytes_per_param(job.precision, job.config.dtype) / d,
        notes=notes,
    )


def worker(rank: int, job: Job, queue: Any) -> None:
    """Measure one rank of ``job`` and put ``("result", RankResult)`` on ``queue``.

    Rank 0 also puts ``("progress", message)`` lines. The gloo group (d > 1) is joined with
    ``job.timeout_s`` as its collective timeout, and left on the way out. A rank that
    delivered its result leaves without the interpreter's teardown.
    """
    torch.set_num_threads(job.threads)

    def say(message: str) -> None:
        if rank == 0:
            queue.put(("progress", f"[{job.preset}] d={job.world_size}: {message}"))

    if job.world_size > 1:
        dist.init_process_group(
            "gloo",
            init_method=job.init_method,
            rank=rank,
            world_size=job.world_size,
            timeout=datetime.timedelta(seconds=job.timeout_s),
        )
    try:
        queue.put(("result", _measure(rank, job, say)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Now and then torch 2.14 aborts a gloo process at interpreter exit, its work done ("terminate
    # called without an active exception": a joinable C++ thread destroyed), and the spawn
    # then stops the other ranks before they deliver: send the result, and leave.
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
