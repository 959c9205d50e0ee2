"""What ``fp16fx bench`` measured: per contender, per preset, per run (plain dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ROOFLINE", "BenchResult", "ContenderResult", "PresetResult", "one_line"]

#: The name of every preset's roofline row.
ROOFLINE = "roofline"


def one_line(reason: str, width: int = 160) -> str:
    """Returns an error's ``reason`` as the report's table row or note shows it: each run of
    whitespace one space (a compile error's message spans lines, with its cause on the
    second and stack frames after), cut at ``width`` characters. The JSON keeps it whole."""
    text = " ".join(reason.split())
    return text if len(text) <= width else text[: width - 3] + "..."


@dataclass
class ContenderResult:
    """What was measured for one contender on one preset (times in ms/s, memory in bytes).

    ``status`` is ``"ok"`` or ``"error"`` (then ``reason`` says why and the
    measurements are None). ``peak_mem_bytes`` is the peak during the timed steps above the
    memory held when they began: what a step allocates on top of the persistent state (CPU:
    peak RSS delta; CUDA: ``max_memory_allocated`` delta). ``peak_mem_total_bytes`` is the
    same peak above the level before this contender's params existed (params, grads, state
    and temporaries; on CPU it also counts library code first paged in by the contender).
    ``moved_bytes_per_param`` is what its step must move (its own roofline): 30 for an Adam
    step with FP32 masters and moments, less in compact precision.
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
    moved_bytes_per_param: float = 30.0
    notes: list[str] = field(default_factory=list)


@dataclass
class PresetResult:
    """All contenders' results on one parameter set.

    ``copy_bandwidth_gbps`` is the bandwidth the roofline row is set at: the run's
    (:attr:`BenchResult.copy_bandwidth_gbps`), the one at the median of the rounds' copy times
    (``rounds`` > 1), or, timed interleaved, the median of the copies timed beside the
    contenders' steps.
    """

    preset: str
    params: int
    leaves: int
    roofline_bytes: int
    roofline_ms: float
    copy_bandwidth_gbps: float
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
    rounds: int
    interleaved: bool
    lr: float
    betas: tuple[float, float]
    eps: float
    loss_scale: float
    dtype: str
    copy_bandwidth_gbps: float
    inplace_bandwidth_gbps: float
    copy_buffer_bytes: int
    roofline_bytes_per_param: int
    load_avg_start: float | None
    load_avg_end: float | None
    cpu_count: int | None
    presets: list[PresetResult]
