"""Renders a :class:`~fp16fx.bench.harness.BenchResult` as aligned text tables or JSON.

Table columns (one table per preset):

========== =============================================================================
ms/step    median step time over the timed steps
min ms     fastest timed step (robust to other work on the machine; the median is not)
GB/s       effective bandwidth: roofline bytes (30 B/param) ÷ step time
roof       fraction of the roofline reached: roofline time ÷ step time
×torch     speed-up vs ``torch-fused`` (its time ÷ this time)
×apex      speed-up vs ``apex-style``
cold s     compile time with an empty Inductor cache (first step − median step)
warm s     compile time again after ``torch._dynamo.reset()``, cache populated
recomp     graphs compiled during the timed steps (after warm-up)
peak MB    peak memory during the timed steps above the memory held when they began
B/param    persistent bytes per param: state kept between steps, params and grads included
========== =============================================================================
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from fp16fx.bench.results import BenchResult, ContenderResult, PresetResult, one_line

if TYPE_CHECKING:  # sharded.py imports this module
    from fp16fx.bench.sharded import ShardedResult

__all__ = [
    "JSON_SCHEMA_VERSION",
    "align",
    "format_number",
    "format_report",
    "format_table",
    "load_note",
    "preset_line",
    "to_json",
    "to_jsonable",
]

#: Bumped when the JSON document's fields change meaning.
JSON_SCHEMA_VERSION = 1

Cell = Callable[[ContenderResult], str]


def format_number(value: float | None, fmt: str) -> str:
    """Return ``value`` formatted with ``fmt``, or ``-`` for a missing value."""
    return "-" if value is None else format(value, fmt)


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e6:.0f}"


COLUMNS: Sequence[tuple[str, Cell]] = (
    ("ms/step", lambda r: format_number(r.ms_per_step, ".2f")),
    ("min ms", lambda r: format_number(r.min_ms, ".2f")),
    ("GB/s", lambda r: format_number(r.gbps, ".1f")),
    ("roof", lambda r: _percent(r.fraction_of_roofline)),
    ("×torch", lambda r: _times(r.speedup_vs_torch_fused)),
    ("×apex", lambda r: _times(r.speedup_vs_apex_style)),
    ("cold s", lambda r: format_number(r.cold_compile_s, ".1f")),
    ("warm s", lambda r: format_number(r.warm_compile_s, ".1f")),
    ("recomp", lambda r: "-" if r.recompiles is None else str(r.recompiles)),
    ("peak MB", lambda r: _mb(r.peak_mem_bytes)),
    ("B/param", lambda r: format_number(r.persistent_bytes_per_param, ".1f")),
)


def align(names: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Return a header line, a rule and one line per row, in aligned columns.

    The first column is left-aligned, the others right-aligned. A row with fewer cells than
    ``names`` (a failed entry) prints its second cell as free text after the
    first, and does not widen the columns.
    """
    full_rows = [r for r in rows if len(r) == len(names)]
    widths = [max(len(name), *(len(r[i]) for r in full_rows)) for i, name in enumerate(names)]
    widths[0] = max(widths[0], *(len(r[0]) for r in rows))

    def line(cells: Sequence[str]) -> str:
        if len(cells) != len(names):
            return f"{cells[0]:<{widths[0]}}  {cells[1]}"
        first = f"{cells[0]:<{widths[0]}}"
        rest = (f"{c:>{w}}" for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest])

    return [line(names), "-" * len(line(names)), *(line(r) for r in rows)]


#: How a report names the params' dtype (``BenchResult.dtype``).
DTYPE_LABELS = {"float16": "FP16", "bfloat16": "BF16"}


def preset_line(name: str, params: int, leaves: int, bench: BenchResult | ShardedResult) -> str:
    """Return a table's first header line: the preset, its size and what is stepped."""
    return (
        f"preset {name}: {params:,} params in {leaves:,} leaves; Adam (lr {bench.lr:g}, betas "
        f"({bench.betas[0]:g}, {bench.betas[1]:g}), eps {bench.eps:g}) on "
        f"{DTYPE_LABELS[bench.dtype]} params, static loss scale {bench.loss_scale:g}"
    )


def load_note(start: float | None, end: float | None, cpu_count: int | None) -> list[str]:
    """Return the load-average line of a report (none where the platform has no load)."""
    if start is None or end is None:
        return []
    return [
        f"load average {start:.2f} at start, {end:.2f} at end on {cpu_count} CPUs "
        "(other work on the machine skews the timings)"
    ]


def _copy_timing(bench: BenchResult) -> str:
    """Says where the roofline's copies were timed, unless only at the start of the run."""
    if bench.interleaved:
        return ", timed in each interleaved iteration"
    if bench.rounds > 1:
        return f", at the median of {bench.rounds} rounds' copy times"
    return ""


def format_table(preset: PresetResult, bench: BenchResult) -> str:
    """Return one preset's results as an aligned text table with its header lines."""
    header = [
        preset_line(preset.preset, preset.params, preset.leaves, bench),
        f"copy bandwidth {preset.copy_bandwidth_gbps:.1f} GB/s "
        f"({bench.copy_buffer_bytes >> 20} MiB FP32 dst.copy_(src), read+write"
        f"{_copy_timing(bench)}) -> roofline "
        f"{bench.roofline_bytes_per_param} B/param x {preset.params:,} = "
        f"{preset.roofline_bytes / 1e6:.1f} MB = {preset.roofline_ms:.2f} ms/step "
        f"(in-place read+write: {bench.inplace_bandwidth_gbps:.1f} GB/s)",
    ]
    names = ["contender", *(name for name, _ in COLUMNS)]
    rows: list[list[str]] = []
    notes: list[str] = []
    for result in preset.results:
        label = f"{result.label} [{result.name}]" if result.kind != "roofline" else result.label
        if result.status != "ok":
            rows.append([label, f"{result.status}: {one_line(result.reason)}"])
            continue
        cells = [cell(result) for _, cell in COLUMNS]
        if result.kind == "roofline":
            cells[1] = "-"
            cells[6:] = ["-"] * (len(cells) - 6)
        rows.append([label, *cells])
        notes += [f"{result.name}: {note}" for note in result.notes]
    body = align(names, rows)
    footer = [f"note: {n}" for n in notes]
    return "\n".join([*header, "", *body, *footer])


def format_report(bench: BenchResult) -> str:
    """Return the whole run as text: an environment line, then one table per preset."""
    intro = (
        f"fp16fx bench on {bench.device} ({bench.device_name}), {bench.threads} threads, "
        f"torch {bench.torch_version}; median of {bench.steps} steps after "
        f"{bench.warmup} warm-up"
    )
    if bench.interleaved:
        intro += (
            "\ntimed interleaved: every contender's step i in one loop iteration, states alive "
            "at once; roof, ×torch and ×apex are medians of same-iteration ratios"
        )
    if bench.rounds > 1 and bench.interleaved:
        intro += (
            f"\n{bench.rounds} rounds in alternating order before it gave the compile times and "
            "peak memory; every time and ratio is the interleaved loop's"
        )
    elif bench.rounds > 1:
        intro += (
            f"\n{bench.rounds} rounds in alternating order: ms/step is the median of the rounds' "
            "medians, roof, ×torch and ×apex the median of the rounds' ratios"
        )
    for line in load_note(bench.load_avg_start, bench.load_avg_end, bench.cpu_count):
        intro += f"\n{line}"
    return "\n\n".join([intro, *(format_table(p, bench) for p in bench.presets)]) + "\n"


def to_jsonable(bench: BenchResult) -> dict:
    """Return the run as plain JSON-ready data (``schema`` + every dataclass field)."""
    return {"schema": JSON_SCHEMA_VERSION, **dataclasses.asdict(bench)}


def to_json(bench: BenchResult) -> str:
    """Return the run as one JSON document (see :func:`to_jsonable`)."""
    return json.dumps(to_jsonable(bench), indent=2)
