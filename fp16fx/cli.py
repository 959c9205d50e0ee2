"""The ``fp16fx`` command: one subcommand per module, each registering itself.

Each subcommand's module provides ``add_parser(subparsers)``, which adds its parser and sets
``handler`` (a ``(args) -> int`` function) as a default. This file holds no library logic: to
add a subcommand, add its module to :data:`SUBCOMMANDS`. Subcommand modules import their
optional dependencies lazily, so every subcommand is always listed. Argument types that
several subcommands share (:func:`seed`) live here too.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

__all__ = ["SEEDS", "SUBCOMMANDS", "build_parser", "main", "seed"]

#: Modules providing a subcommand, in the order ``fp16fx --help`` lists them.
SUBCOMMANDS: tuple[str, ...] = ("fp16fx.train", "fp16fx.bench")

#: The seeds ``torch.manual_seed`` takes: a 64-bit integer, signed or not.
SEEDS = range(-(2**63), 2**64)


def seed(text: str) -> int:
    """The argparse type of a ``--seed``: an integer ``torch.manual_seed`` takes."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value not in SEEDS:
        raise argparse.ArgumentTypeError(f"{value} is outside torch's seeds, [-2**63, 2**64)")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Return the ``fp16fx`` argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="fp16fx", description="Mixed-precision FP16 optimizers for PyTorch."
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for module_name in SUBCOMMANDS:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fp16fx`` command on ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    return int(handler(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
