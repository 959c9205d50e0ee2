"""Measuring primitives of ``fp16fx bench``: the roofline, step timers, memory and compile caches.

Nothing here knows about optimizers; :mod:`fp16fx.bench.harness` combines these into one
contender's measurement.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "ROOFLINE_BYTES_PER_PARAM",
    "Bandwidth",
    "MemoryProbe",
    "StepTimer",
    "compile_cache",
    "copy_bandwidth",
    "cpu_name",
    "forget_compiled",
    "gbps_of",
    "graphs_compiled",
    "load_average",
    "median_min_p90",
    "ms_at",
    "only_new_garbage",
    "release_memory",
    "roofline_bytes",
    "steady_allocator",
    "synchronize",
    "time_call",
    "warm_up_compiler",
]

#: Bytes an Adam step on FP16 params with FP32 master and moments must move per parameter
#: (docs/design.md, "The step's data flow"): read grad 2 + master 4 + m 4 + v 4, write master 4 +
#: m 4 + v 4 + FP16 param 2 = 28, plus one read pass over the FP16 grads (2) to learn "all
#: finite" and the global norm before any state may change.
ROOFLINE_BYTES_PER_PARAM = 30


def roofline_bytes(num_params: int) -> int:
    """Return the bytes one Adam step on ``num_params`` FP16 params must move (30 B/param)."""
    return ROOFLINE_BYTES_PER_PARAM * num_params


def ms_at(num_bytes: float, gbps: float) -> float:
    """Return the milliseconds moving ``num_bytes`` takes at ``gbps`` GB/s (1e9 bytes/s)."""
    return num_bytes / gbps / 1e6


def gbps_of(num_bytes: float, ms: float) -> float:
    """Return the GB/s (1e9 bytes/s) of moving ``num_bytes`` in ``ms`` milliseconds."""
    return num_bytes / ms / 1e6


def synchronize(device: torch.device) -> None:
    """Wait for all queued work on ``device`` (a no-op on CPU, where ops are synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Bandwidth:
    """A measured copy bandwidth.

    Attributes:
        gbps: ``dst.copy_(src)`` bytes moved (read + write) per second, in GB/s (1e9 bytes);
            the roofline's denominator.
        buffer_bytes: size of the copied FP32 buffer (each of source and destination).
        inplace_gbps: for reference, the same for an in-place ``buf.mul_(1.0)`` (read +
            write of one buffer). On CPUs that read a cache line before writing it
            ("write-allocate"), a copy's destination costs a hidden extra read, so
            in-place kernels (an optimizer's updates) can beat the copy bandwidth.
    """

    gbps: float
    buffer_bytes: int
    inplace_gbps: float


def copy_bandwidth(
    device: torch.device, buffer_bytes: int | None = None, reps: int = 20
) -> Bandwidth:
    """Return the median bandwidth of ``dst.copy_(src)`` between two large FP32 buffers.

    Each copy counts ``2 * buffer_bytes`` (one read, one write). The buffers (default
    256 MiB on CPU, 1 GiB on CUDA) are far larger than any cache; both are touched once
    before timing. On CUDA each copy is timed with CUDA events (a device-to-device copy).
    """
    if buffer_bytes is None:
        buffer_bytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    numel = buffer_bytes // 4
    copies, inplace = _time_copies(numel, device, reps)
    release_memory(device)
    moved = 2 * numel * 4
    return Bandwidth(
        gbps=moved / statistics.median(copies) / 1e9,
        buffer_bytes=numel * 4,
        inplace_gbps=moved / statistics.median(inplace) / 1e9,
    )


def _time_copies(numel: int, device: torch.device, reps: int) -> tuple[list[float], list[float]]:
    src = torch.rand(numel, device=device)
    dst = torch.zeros(numel, device=device)
    dst.copy_(src)
    synchronize(device)
    copies = [time_call(lambda: dst.copy_(src), device) for _ in range(reps)]
    inplace = [time_call(lambda: dst.mul_(1.0), device) for _ in range(reps)]
    return copies, inplace


def time_call(fn: Callable[[], object], device: torch.device) -> float:
    """Return the seconds ``fn()`` takes, its device work included.

    CPU: wall time around the call. CUDA: elapsed time between CUDA events recorded
    before and after the call, read after a synchronize.
    """
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class StepTimer:
    """Times a sequence of calls without synchronizing between them.

    CPU: wall time around each call (CPU ops finish before they return). CUDA: a pair of
    CUDA events around each call, read after one synchronize in :meth:`seconds`, so the
    host may run ahead as in training; an event pair measures the device's time from the
    start of the call's work to its end, idle gaps (a host-bound step) included.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._wall: list[float] = []
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def time(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` once and record its time."""
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            self._events.append((start, end))
            return
        t0 = time.perf_counter()
        fn()
        self._wall.append(time.perf_counter() - t0)

    def seconds(self) -> list[float]:
        """Return the recorded times in seconds, in call order."""
        if self.device.type != "cuda":
            return list(self._wall)
        synchronize(self.device)
        return [start.elapsed_time(end) / 1e3 for start, end in self._events]


def median_min_p90(times: Sequence[float]) -> tuple[float, float, float]:
    """Return the median, the fastest and the 90th percentile of ``times`` (in their unit).

    The percentile is by nearest rank: the smallest time at least 90% of the times are at or
    below (of 10 times, the 9th fastest; of 20, the 18th), always one that was measured.
    """
    ordered = sorted(times)
    return (
        statistics.median(ordered),
        ordered[0],
        ordered[-(-9 * len(ordered) // 10) - 1],  # the ceil(0.9 n)-th, in integers
    )


def _libc_malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


#: glibc's ``mallopt`` parameters (malloc.h) and the ceilings its dynamic thresholds reach.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20


def steady_allocator() -> bool:
    """Fixes glibc malloc's thresholds where a training loop leaves them; returns whether it could.

    glibc raises its mmap threshold (up to 32 MiB) and its trim threshold (twice that) each time
    a large block is freed, so whether a contender's temporaries are reused from the heap or
    mapped and faulted in afresh every step depends on what ran before it in the process (seen:
    the apex-style loop on resnet18 took 16.5 or 23 ms by run order alone). Fixed at those
    ceilings, every contender meets the allocator a training loop's forward and backward leave
    behind: temporaries up to 32 MiB reused, larger ones mapped per use. glibc only.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(
            libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
            and libc.mallopt(_M_TRIM_THRESHOLD, 2 * _MMAP_THRESHOLD_MAX)
        )
    except (OSError, AttributeError):
        return False


def release_memory(device: torch.device) -> None:
    """Free what the previous contender left behind, so memory deltas start clean."""
    gc.collect()  # within only_new_garbage: a scan of what the run made, milliseconds
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        _libc_malloc_trim()


@contextlib.contextmanager
def only_new_garbage() -> Iterator[None]:
    """Within it, a garbage collection scans only the objects made inside: those from before
    are frozen (:func:`gc.freeze`), and thawed after it. Torch's own objects are hundreds of
    thousands, a test session's millions: scanning them takes a fifth of a second, which
    :func:`release_memory` would spend several times per contender. A process that froze
    objects itself is left as it is (thawing would thaw its objects too)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class MemoryProbe:
    """Reads current and peak memory of the process (CPU) or of the device (CUDA).

    CPU (Linux): current = ``VmRSS``; the high-water mark is reset by writing ``5`` to
    ``/proc/self/clear_refs`` and read back as ``VmHWM`` from ``/proc/self/status``.
    CUDA: ``torch.cuda.memory_allocated`` / ``reset_peak_memory_stats`` /
    ``max_memory_allocated``. Values are bytes; None where the platform cannot tell.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> int | None:
        """Return the memory in use now, in bytes."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        kib = _proc_status_kib("VmRSS")
        return None if kib is None else kib * 1024

    def reset_peak(self) -> bool:
        """Start a new peak measurement at the current level; return whether that worked."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return True
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
        except OSError:
            return False
        return True

    def peak(self) -> int | None:
        """Return the highest memory in use since :meth:`reset_peak`, in bytes."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        kib = _proc_status_kib("VmHWM")
        return None if kib is None else kib * 1024


def graphs_compiled() -> int:
    """Return how many graphs Dynamo has compiled in this process so far.

    Read from ``torch._dynamo.utils.counters["stats"]["unique_graphs"]``; a rise after
    warm-up is a recompile.
    """
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _clear_inductor_memory_caches() -> None:
    with contextlib.suppress(ImportError, AttributeError):
        from torch._inductor.utils import clear_caches

        clear_caches()


def forget_compiled() -> None:
    """Drop every compiled artifact held in memory, as if the process had just started.

    ``torch._dynamo.reset()`` plus Inductor's in-memory code caches; disk caches stay, so
    the next compile is a *warm* one if the cache directory is populated.
    """
    torch._dynamo.reset()
    _clear_inductor_memory_caches()


@contextlib.contextmanager
def compile_cache(fresh: bool) -> Iterator[str | None]:
    """Run the body with a new, empty Inductor cache directory if ``fresh``.

    Points ``TORCHINDUCTOR_CACHE_DIR`` (and ``TRITON_CACHE_DIR``) at a new temporary
    directory, forgets compiled code held in memory, and on exit restores the variables
    and deletes the directory. With ``fresh=False`` it does nothing (the user's cache).
    """
    if not fresh:
        yield None
        return
    path = tempfile.mkdtemp(prefix="fp16fx-bench-inductor-")
    saved = {key: os.environ.get(key) for key in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    os.environ["TRITON_CACHE_DIR"] = os.path.join(path, "triton")
    forget_compiled()
    try:
        yield path
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(path, ignore_errors=True)


def warm_up_compiler(device: torch.device) -> None:
    """Compile a trivial function once, so later compile times exclude one-off imports.

    The first ``torch.compile`` in a process imports Inductor and starts its compile
    workers — seconds that belong to no contender. Uses a throwaway cache directory.
    """
    with compile_cache(fresh=True):
        fn = torch.compile(lambda x: x * 2 + 1, fullgraph=True)
        fn(torch.ones(8, device=device))
        synchronize(device)
    forget_compiled()


def load_average() -> float | None:
    """Return the 1-minute load average (other work on the machine skews timings)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def cpu_name() -> str:
    """Return the CPU's model name (``/proc/cpuinfo``), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"
