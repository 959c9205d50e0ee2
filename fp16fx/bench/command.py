"""The ``fp16fx bench`` command line: argument parsing and output, no measuring logic.

Registered into ``fp16fx``'s CLI by :func:`add_parser`; also runs as ``python -m fp16fx.bench``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fp16fx import cli
from fp16fx.bench.harness import BenchOptions, run_bench
from fp16fx.bench.measure import ROOFLINE_BYTES_PER_PARAM
from fp16fx.bench.presets import PRESETS, Preset, custom_shapes, preset
from fp16fx.bench.report import format_report, to_json
from fp16fx.bench.results import ROOFLINE, BenchResult
from fp16fx.bench.runner import BenchConfig, Runner, runner_classes
from fp16fx.bench.sharded import (
    ShardedOptions,
    available_cores,
    format_sharded_report,
    run_sharded,
    sharded_to_json,
)
from fp16fx.precision import MASTERS, MOMENTS, Precision

__all__ = ["add_arguments", "add_parser", "main", "run"]

DESCRIPTION = """\
Time one Adam step (lr 1e-3, static loss scale 2**16) on FP16 (or --dtype bfloat16) params
with scaled grads, for fp16fx and for the baselines users would pick instead, side by side:
median ms/step, effective GB/s and fraction of the roofline (30 B/param / measured copy
bandwidth; a compact-precision contender's own bytes for it), speed-ups vs torch-fused and
apex-style, cold/warm compile time, recompiles, peak memory during the timed steps and
persistent optimizer bytes per param."""

DEFAULT_STEPS = 30
DEFAULT_WARMUP = 5
DEFAULT_TIME_BUDGET_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``fp16fx bench``'s options to ``parser``."""
    parser.add_argument(
        "--preset",
        action="append",
        choices=sorted(PRESETS),
        dest="presets",
        help="parameter set from real model shapes (repeatable; default: resnet18 unless "
        "--params is given)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float16", "bfloat16"],
        default="float16",
        help="dtype of the params and grads (default float16); the contenders keep their "
        "masters as they would for FP16 (FP32, or compensated), and the roofline is the same",
    )
    parser.add_argument("--params", type=int, help="custom parameter set: total params")
    parser.add_argument("--leaves", type=int, help="custom parameter set: number of tensors")
    parser.add_argument(
        "--steps",
        type=_at_least(1),
        default=DEFAULT_STEPS,
        help=f"timed steps per contender (default {DEFAULT_STEPS})",
    )
    parser.add_argument(
        "--warmup",
        type=_at_least(0),
        default=DEFAULT_WARMUP,
        help=f"untimed steps before timing, at least one (default {DEFAULT_WARMUP})",
    )
    parser.add_argument(
        "--rounds",
        type=_at_least(1),
        default=1,
        help="measure every contender this many times, in alternating order, and the copy "
        "bandwidth at the start of each round; report the median of the rounds' medians and "
        "of their speed-ups and fractions of the roofline (default 1; 3 or more on a machine "
        "with other work; with --interleave, the interleaved loop's times replace them)",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="after the usual measurement, time the contenders' steps again in turn, every "
        "state alive at once (memory for all of them), beside a copy that times the "
        "roofline's bandwidth in each iteration, and take ms/step, the fraction of the "
        "roofline and the speed-ups from that: the steadiest side-by-side comparison on a "
        "machine whose speed drifts",
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="run only this contender (repeatable), e.g. torch-fused, apex-style, "
        "fp16fx-compiled; see --list",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--threads",
        type=_threads,
        default=None,
        help="torch intra-op threads, at most the CPUs available (default: torch's current "
        "setting); with --world-sizes: the cores the d processes share (default: all available)",
    )
    parser.add_argument(
        "--world-sizes",
        type=_world_sizes,
        metavar="D,D,...",
        help="instead of the contenders: the sharded (ZeRO-1) Adam step of "
        "fp16fx.distributed in D local gloo processes per size, per rank (ms/step, persistent "
        "bytes/param vs 4 + 12/d); d=1, the unsharded state, is always included. E.g. 2,4",
    )
    parser.add_argument(
        "--masters",
        "--master",
        dest="master",
        choices=MASTERS,
        default=None,
        help="with --world-sizes: how the sharded state keeps its masters (default fp32; "
        "compensated: a correction, no FP32 copy; docs/precision.md)",
    )
    parser.add_argument(
        "--moments",
        choices=MOMENTS,
        default=None,
        help="with --world-sizes: how the sharded state keeps Adam's moments (default fp32)",
    )
    parser.add_argument(
        "--no-compile-times",
        dest="compile_times",
        action="store_false",
        help="skip the cold/warm compile-time measurement of compiled contenders",
    )
    parser.add_argument(
        "--time-budget",
        type=_at_least(0, float),
        default=DEFAULT_TIME_BUDGET_S,
        metavar="SECONDS",
        help="stop timing a contender after this many seconds of timed steps (at least 5 "
        f"steps run; default {DEFAULT_TIME_BUDGET_S:g}; 0 = no limit)",
    )
    parser.add_argument("--seed", type=cli.seed, default=0, help="seed of params and grads")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument(
        "--list", action="store_true", help="list the registered contenders and exit"
    )


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``bench`` subcommand on ``subparsers``; its handler is :func:`run`."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmark fp16fx's optimizer step against torch and apex-style baselines",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(handler=run)
    return parser


def _at_least(low: float, kind: type = int) -> Callable[[str], Any]:
    """Returns an argparse type reading one ``kind`` number, finite and at least ``low``."""

    what = "an integer" if kind is int else "a finite number"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (math.isfinite(value) and value >= low):
            raise argparse.ArgumentTypeError(f"must be {what} >= {low:g}, got {text}")
        return value

    return parse


def _threads(text: str) -> int:
    """Parse ``--threads``: at least 1, and at most the CPUs this process may run on (torch
    starts every thread it is told to: 100,000 of them crashed the process, silently)."""
    value, cores = _at_least(1)(text), available_cores()
    if value > cores:
        raise argparse.ArgumentTypeError(
            f"must be at most the {cores} CPUs this process may run on, got {value}"
        )
    return value


def _world_sizes(text: str) -> list[int]:
    """Parse ``--world-sizes``: comma-separated process counts, each at least 1."""
    try:
        return [_at_least(1)(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"world sizes must be integers >= 1, like 2,4; got {text!r}"
        ) from None


def _presets(args: argparse.Namespace) -> list[Preset]:
    if (args.params is None) != (args.leaves is None):
        raise SystemExit("fp16fx bench: --params and --leaves go together")
    chosen = [preset(name) for name in args.presets or []]
    if args.params is not None:
        try:
            shapes = custom_shapes(args.params, args.leaves)
        except ValueError as exc:
            raise SystemExit(f"fp16fx bench: {exc}") from None
        chosen.append(Preset(f"params={args.params},leaves={args.leaves}", tuple(shapes)))
    return chosen or [preset("resnet18")]


def _config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(dtype=getattr(torch, args.dtype))


def _listed(cls: type[Runner]) -> str:
    """Returns ``cls``'s label, with its own roofline if it has one (FP16; BF16 if other)."""
    fp16, bf16 = cls.moved_bytes(torch.float16), cls.moved_bytes(torch.bfloat16)
    if fp16 == bf16 == ROOFLINE_BYTES_PER_PARAM:
        return cls.label
    return f"{cls.label} ({fp16:g} B/param roof" + (f"; BF16 {bf16:g})" if bf16 != fp16 else ")")


def _list_contenders_json() -> str:
    """Returns the registered contenders as one JSON document (``--list --json``)."""
    contenders = [
        {
            "name": cls.name,
            "label": cls.label,
            "default": cls.default,
            "moved_bytes_per_param": {
                "float16": cls.moved_bytes(torch.float16),
                "bfloat16": cls.moved_bytes(torch.bfloat16),
            },
        }
        for cls in runner_classes()
    ]
    return json.dumps({"schema": 1, "contenders": contenders}, indent=2)


def _list_contenders() -> str:
    rows = [("roofline", "30 B/param / measured copy bandwidth (always reported)")]
    rows += [
        (cls.name, _listed(cls) + ("" if cls.default else " [not in the default set]"))
        for cls in runner_classes()
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {label}" for name, label in rows)


def run(args: argparse.Namespace) -> int:
    """Run ``fp16fx bench`` with parsed ``args``; print the table or JSON; return 0, or 1 if
    every contender failed."""
    if args.list:
        print(_list_contenders_json() if args.json else _list_contenders())
        return 0
    if args.world_sizes is not None:
        return _run_sharded(args)
    if args.master is not None or args.moments is not None:
        raise SystemExit(
            "fp16fx bench: --masters and --moments choose the precision of --world-sizes' "
            "sharded step; the contenders name theirs (e.g. fp16fx-compensated-int8: --list)"
        )
    opts = BenchOptions(
        presets=_presets(args),
        only=args.only,
        steps=args.steps,
        warmup=args.warmup,
        device=args.device,
        threads=args.threads,
        compile_times=args.compile_times,
        time_budget_s=args.time_budget if args.time_budget > 0 else None,
        seed=args.seed,
        rounds=args.rounds,
        interleave=args.interleave,
        config=_config(args),
    )
    result = _measure_and_print(args, lambda say: run_bench(opts, say), to_json, format_report)
    if _every_contender_failed(result):  # the table says why
        print("fp16fx bench: every contender failed", file=sys.stderr)
        return 1
    return 0


def _every_contender_failed(result: BenchResult) -> bool:
    rows = [row for p in result.presets for row in p.results if row.name != ROOFLINE]
    return bool(rows) and all(row.status == "error" for row in rows)


def _measure_and_print(
    args: argparse.Namespace,
    measure: Callable[[Callable[[str], None] | None], Any],
    as_json: Callable[[Any], str],
    as_text: Callable[[Any], str],
) -> Any:
    """Runs ``measure`` (progress on stderr unless ``--quiet``), prints its result as text or
    ``--json``, and returns it; bad options or a failed run exit with one line."""
    try:
        result = measure(None if args.quiet else _progress)
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"fp16fx bench: {exc}") from None
    sys.stdout.write(as_json(result) + "\n" if args.json else as_text(result))
    return result


def _progress(message: str) -> None:
    print(f"fp16fx bench: {message}", file=sys.stderr, flush=True)


def _run_sharded(args: argparse.Namespace) -> int:
    """Run ``fp16fx bench --world-sizes``; print its table or JSON; return 0."""
    if args.only:
        raise SystemExit(
            "fp16fx bench: --world-sizes measures fp16fx's sharded step only; drop --only"
        )
    ignored = [
        flag
        for flag, given in (
            ("--rounds", args.rounds != 1),
            ("--interleave", args.interleave),
            ("--no-compile-times", not args.compile_times),
        )
        if given
    ]
    if ignored:
        raise SystemExit(
            "fp16fx bench: --world-sizes measures one round of the sharded step, not "
            f"interleaved, and times no compiles; drop {', '.join(ignored)}"
        )
    if args.device != "cpu":
        raise SystemExit("fp16fx bench: --world-sizes runs on CPU with gloo only for now")
    opts = ShardedOptions(
        presets=_presets(args),
        world_sizes=[1, *args.world_sizes],
        steps=args.steps,
        warmup=args.warmup,
        time_budget_s=args.time_budget if args.time_budget > 0 else None,
        seed=args.seed,
        cores=args.threads,
        config=_config(args),
        precision=Precision(args.master or "fp32", args.moments or "fp32"),
    )
    _measure_and_print(
        args, lambda say: run_sharded(opts, say), sharded_to_json, format_sharded_report
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m fp16fx.bench``: parse ``argv`` and :func:`run`."""
    parser = argparse.ArgumentParser(
        prog="python -m fp16fx.bench",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
