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

__all__ = ["SUBCOMMANDS", "build_parser", "main", "seed", "seed_fault"]

#: Modules providing a subcommand, in the order ``fp16fx --help`` lists them.
SUBCOMMANDS: tuple[str, ...] = ("fp16fx.train", "fp16fx.bench")


def seed_fault(value: object) -> str | None:
    """Returns why ``value`` is no seed torch's generators take -- they take a Python int
    (not a bool) in [-2**63, 2**64) -- or None where it is one."""
    if type(value) is not int:
        return f"{value!r} is a {type(value).__name__}, not an int"
    if not -(2**63) <= value < 2**64:
        return f"{value} is outside torch's seeds, [-2**63, 2**64)"
    return None


def seed(text: str) -> int:
    """The argparse type of a ``--seed``: an integer ``torch.manual_seed`` takes."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    why = seed_fault(value)
    if why is not None:
        raise argparse.ArgumentTypeError(why)
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
