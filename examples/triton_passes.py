"""The kernels Inductor writes for one compiled fp16fx step as Triton, the code a GPU gets, on a
machine without one: how many passes over the values each precision's step takes.

Usage::

    python examples/triton_passes.py [--values 262144] [--leaves 4] [--mode compensated+int8]

With ``torch._inductor.config.cpu_backend = "triton"`` Inductor schedules, fuses and writes the
step for CPU tensors exactly as it does for a GPU's: Triton kernels. They cannot run here (no
GPU, and Triton's CPU backend is not installed), so this stops once Inductor has written
them, and prints every kernel the step launches over all the values (the smaller ones, over
a few scalars or per-block maxima, are left out): its kind (``poi``: pointwise; ``red`` and
``per``: a reduction, looped or persistent), its iteration (values x reduced values) and how
many arrays it loads and stores per value (each counted once: the bytes it moves). A kernel
over all the values is a pass over them: every step checks the grads in one (a reduction)
and updates in another. With compensated masters and int8 moments the update reads 7
B/param and writes 5, so with the check's 2 the step moves 14 B/param, its roofline, if it
takes each block's maximum in the update's pass (``fp16fx.precision._in_rows`` says how),
and 21 if the maxima take a pass of their own.

It leans on two private hooks of torch 2.14's Inductor (``GraphLowering.save_output_code``
and ``AsyncCompile.triton``) and one of ``torch.utils._triton``: a diagnostic, not an API.
"""

from __future__ import annotations

import argparse
import re
from typing import Any
from unittest import mock

import torch
import torch._inductor.async_compile
import torch._inductor.config
import torch.utils._triton
from torch._inductor.graph import GraphLowering

import fp16fx

MODES = {  # as examples/precision_table.py names them
    "fp32": {},
    "compensated": {"master": "compensated"},
    "compensated+bf16": {"master": "compensated", "moments": "bf16"},
    "compensated+int8": {"master": "compensated", "moments": "int8"},
}
LAUNCH = re.compile(r"(triton_(poi|red|per)_\w+)\.run\((.*)\)")


class Written(Exception):
    """Raised in place of the first kernel launch: Inductor has written the step."""


class _Unlaunchable:
    def run(self, *args: Any, **kwargs: Any) -> None:
        raise Written


def step_code(values: int, leaves: int, precision: dict[str, str]) -> str:
    """Returns the Python module Inductor writes for the step's update (Triton kernels and the
    code launching them) of an Adam state over ``leaves`` FP16 params of ``values`` in all."""
    torch.manual_seed(0)
    params = {f"p{i}": torch.randn(values // leaves, dtype=torch.float16) for i in range(leaves)}
    state = fp16fx.init(
        params, fp16fx.adam(1e-3), fp16fx.StaticLossScale(1.0), buckets=True, **precision
    )
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    written: list[str] = []
    with (
        torch._inductor.config.patch(cpu_backend="triton"),
        mock.patch.object(GraphLowering, "save_output_code", written.append),
        mock.patch.object(
            torch._inductor.async_compile.AsyncCompile,
            "triton",
            lambda self, *args, **kwargs: _Unlaunchable(),
        ),
        # A kernel's cache key names Triton's GPU backend; there is none.
        mock.patch.object(torch.utils._triton, "triton_hash_with_backend", lambda: "NO-GPU"),
    ):
        torch._dynamo.reset()
        try:
            fp16fx.compile_step(inplace=True)(state, grads)
        except Written:
            pass
        except Exception as err:  # Dynamo wraps what the compiled code raised
            if not isinstance(err.__cause__, Written) and "Written" not in str(err):
                raise
    return max(written, key=len)  # the update's region (the other one checks the grads)


def accesses(source: str, call: str, pointers: str) -> list[tuple[str, str]]:
    """Returns ``(pointer, index)`` of each ``call(pointer + (index), ...)`` in a kernel's
    ``source`` (``pointers``: a pattern of pointer names), the index whole, parentheses and
    all: ``tl.store(out_ptr11 + (tl.broadcast_to(r0_0, [XBLOCK, R0_BLOCK])), ...)``."""
    found = []
    for match in re.finditer(rf"{re.escape(call)}\(({pointers}) \+ \(", source):
        depth, end = 1, match.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(source[end], 0)
            end += 1
        found.append((match.group(1), source[match.end() : end - 1]))
    return found


def per_value(index: str, kind: str) -> bool:
    """Whether a kernel of ``kind`` indexes an access per value (not per block or scalar) with
    ``index``: a reduction's has its reduced variable, a pointwise one's is ``x0``; either
    maybe broadcast (``tl.broadcast_to(r0_0, [XBLOCK, R0_BLOCK])``)."""
    broadcast = re.fullmatch(r"tl\.broadcast_to\((.*), \[[^]]*\]\)", index)
    if broadcast is not None:
        index = broadcast.group(1)
    return index == "x0" if kind == "poi" else re.search(r"\br0_\w", index) is not None


def kernels(code: str) -> list[tuple[str, int, int, int, int, int]]:
    """Returns each kernel launch in ``code`` as ``(kind, values, reduced, loads, stores,
    operations)``: ``values`` x ``reduced`` its iteration, ``loads``/``stores`` how many
    distinct arrays it reads/writes per value (indexed per value, not per block or scalar; an
    array read twice, as a fused check-and-update kernel reads the grads, counts once: the
    figure stands for the bytes it moves per value), ``operations`` how many values it
    computes per iteration (Triton ``tmp`` assignments other than loads, constants and
    broadcasts: a rough count of its arithmetic, casts and selections included)."""
    found = []
    for line in code.splitlines():
        launch = LAUNCH.search(line)
        if launch is None:
            continue
        name, kind, args = launch.groups()
        sizes = [int(a) for a in re.findall(r"(?<![\w.])(\d+)(?=,|$)", args.split("stream=")[0])]
        numel, reduced = (sizes[-2], sizes[-1]) if kind != "poi" else (sizes[-1], 1)
        source = code[code.index(f"def {name}(") :]
        source = source[: source.index("''', device_str=")]
        read = accesses(source, "tl.load", r"(?:in_out|in)_ptr\d+")
        written = accesses(source, "tl.store", r"(?:in_out|out)_ptr\d+")
        loads = len({pointer for pointer, index in read if per_value(index, kind)})
        stores = len({pointer for pointer, index in written if per_value(index, kind)})
        assigned = re.findall(r"^\s+tmp\d+ = (.*)$", source, re.M)
        free = ("tl.load(", "tl.full(", "tl.broadcast_to(", "in_ptr")
        operations = sum(not value.startswith(free) for value in assigned)
        found.append((kind, numel, reduced, loads, stores, operations))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", type=int, default=262144, help="(whole int8 blocks)")
    parser.add_argument("--leaves", type=int, default=4)
    parser.add_argument("--mode", choices=MODES, action="append", help="(default: all)")
    args = parser.parse_args()
    if args.leaves < 1:
        parser.error(f"--leaves must be >= 1, got {args.leaves}")
    if args.values < args.leaves:
        parser.error(f"--values must be >= --leaves ({args.leaves}), got {args.values}")
    values = args.leaves * (args.values // args.leaves)  # what the params hold
    if values != args.values:
        print(f"{args.leaves} leaves of {args.values // args.leaves:,} values: {values:,} in all")
    for mode in args.mode or MODES:
        found = kernels(step_code(args.values, args.leaves, MODES[mode]))
        over_values = [k for k in found if k[1] * k[2] >= values]
        print(f"{mode}: {len(over_values)} passes over the values")
        for kind, numel, reduced, loads, stores, operations in over_values:
            print(
                f"  {kind} {numel} x {reduced}: {loads} loads, {stores} stores, "
                f"{operations} operations per value"
            )


if __name__ == "__main__":
    main()
