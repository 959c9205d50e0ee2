"""How long one Adam update's arithmetic takes per value, in each storage format: the floor
under a compiled step, whatever bytes it saves.

docs/precision.md ("Speed") argues that on a CPU the compact steps are compute-bound: their
arithmetic alone takes longer than the whole step a compact step must beat. This script
measures that arithmetic, stripped of everything else a step does (no grad check, no loss
scale, no skip, no segments), for three formats of the stored state:

* ``fp32``: an FP32 master and FP32 moments (fp16fx's default).
* ``compensated``: the FP16 param plus an int8 correction (``fp16fx.precision.decode_master``
  / ``encode_master``, stochastic rounding from ``hash_bits``), FP32 moments.
* ``compensated+int8``: the same, and both moments as int8 codes with a scale per block
  (``decode_moment`` / ``encode_moment``).

Each update is one function, compiled with ``torch.compile(fullgraph=True)`` under the
Inductor settings fp16fx compiles its own step with (:data:`SETTINGS`), and timed at two
sizes: 262,144 values, where every operand stays in cache (no memory limit), and resnet18's
11,689,512. Printed per format: the median time per value over ``--rounds`` rounds, the
milliseconds that makes at resnet18's size, and the share of stored values that the compiled
kernel writes as the eager update does. The rest differ because eager ``torch.sqrt`` on x86
CPUs is not correctly rounded and Inductor's is (``tests/test_compile.py`` compares Adam to
1e-6 for that reason). Without :data:`SETTINGS`, the compensated kernels run about as fast
but match eager in under 1% of the corrections: Inductor drops the FP16 rounding they rely
on. The last line is the target docs/precision.md compares against: a step 1.6x faster than
the ``fp32`` update from memory.

Run::

    python examples/compact_arithmetic.py                    # both sizes, 11 rounds
    python examples/compact_arithmetic.py --sizes 262144 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from fp16fx import precision

#: The Inductor settings of fp16fx's compiled regions (``fp16fx/compile.py`` says why).
SETTINGS = {"emulate_precision_casts": True, "realize_reads_threshold": 16}
RESNET18 = 11_689_512
BLOCK = precision.Precision().block
LR, B1, B2, EPS = 1e-3, 0.9, 0.999, 1e-8


def adam(master: torch.Tensor, g: torch.Tensor, mu: torch.Tensor, nu: torch.Tensor):
    """Returns the new (master, mu, nu) of one Adam step (bias correction left out)."""
    g = g.float()
    mu = B1 * mu + (1 - B1) * g
    nu = B2 * nu + (1 - B2) * g * g
    return master - LR * mu / (nu.sqrt() + EPS), mu, nu


def fp32(p, m, g, mu, nu, count):
    """FP32 master ``m`` and moments; the FP16 param ``p`` is the master rounded."""
    new, mu2, nu2 = adam(m, g, mu, nu)
    m.copy_(new)
    p.copy_(new.half())
    mu.copy_(mu2)
    nu.copy_(nu2)


def compensated(p, c, g, mu, nu, count):
    """The master is ``p`` + ``c`` units; FP32 moments."""
    dither = precision.master_noise(precision.hash_bits(p.numel(), 0, count))
    new, mu2, nu2 = adam(precision.decode_master(p, c), g, mu, nu)
    p2, c2 = precision.encode_master(new, torch.float16, dither)
    p.copy_(p2)
    c.copy_(c2)
    mu.copy_(mu2)
    nu.copy_(nu2)


def compensated_int8(p, c, g, mu_codes, mu_scales, nu_codes, nu_scales, count):
    """The master is ``p`` + ``c`` units; each moment is int8 codes and a scale per block."""
    bits = precision.hash_bits(p.numel(), 0, count)
    mu = precision.decode_moment(precision.Quantized(mu_codes, mu_scales), False, BLOCK)
    nu = precision.decode_moment(precision.Quantized(nu_codes, nu_scales), True, BLOCK)
    new, mu2, nu2 = adam(precision.decode_master(p, c), g, mu, nu)
    p2, c2 = precision.encode_master(new, torch.float16, precision.master_noise(bits))
    qmu = precision.encode_moment(mu2, "int8", False, BLOCK, precision.moment_noise(bits, 0))
    qnu = precision.encode_moment(nu2, "int8", True, BLOCK, precision.moment_noise(bits, 1))
    for stored, value in zip(
        (p, c, mu_codes, mu_scales, nu_codes, nu_scales), (p2, c2, *qmu, *qnu)
    ):
        stored.copy_(value)


def operands(name: str, n: int) -> list[torch.Tensor]:
    """Returns the arguments of update ``name`` over ``n`` values: a plausible trained state."""
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=gen) * 0.05
    g = (torch.randn(n, generator=gen) * 1e-3).half()
    mu, nu = torch.randn(n, generator=gen) * 1e-4, torch.rand(n, generator=gen) * 1e-6
    count = torch.tensor(7)
    if name == "fp32":
        return [master.half(), master, g, mu, nu, count]
    p, c = precision.encode_master(master, torch.float16, None)
    if name == "compensated":
        return [p, c, g, mu, nu, count]
    mu_stored = precision.encode_moment(mu, "int8", False, BLOCK, None)
    nu_stored = precision.encode_moment(nu, "int8", True, BLOCK, None)
    return [p, c, g, *mu_stored, *nu_stored, count]


UPDATES: dict[str, Callable[..., None]] = {
    "fp32": fp32,
    "compensated": compensated,
    "compensated+int8": compensated_int8,
}


def matches_eager(name: str, compiled: Callable[..., None], n: int) -> float:
    """Returns the fraction of stored values the compiled update writes as the eager one does."""
    eager_args, compiled_args = operands(name, n), operands(name, n)
    UPDATES[name](*eager_args)
    compiled(*compiled_args)
    pairs = [(a, b) for a, b in zip(eager_args, compiled_args) if a.numel() == n]
    return min((a == b).float().mean().item() for a, b in pairs)


def time_per_value(fn: Callable[..., None], args: list[torch.Tensor], rounds: int) -> float:
    """Returns the median seconds per value of ``fn(*args)`` over ``rounds`` rounds."""
    n = args[0].numel()
    calls = max(1, 50_000_000 // n)
    fn(*args)  # compiles
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        samples.append((time.perf_counter() - start) / calls / n)
    return statistics.median(samples)


def target_line(sizes: list[int], fp32_per_value: list[float]) -> str:
    """Returns the last line printed: the target docs/precision.md compares against, a step
    1.6x faster than the ``fp32`` update from memory -- timed at the largest of ``sizes``
    (``fp32_per_value``: its seconds per value at each), the one least in cache."""
    largest = max(range(len(sizes)), key=sizes.__getitem__)
    ms = fp32_per_value[largest] * RESNET18 * 1e3 / 1.6
    return (
        f"target: a step 1.6x faster than the fp32 update at {sizes[largest]:,} values (the "
        f"largest size) takes {ms:.1f} ms at resnet18's size, all included"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=f"262144,{RESNET18}", help="values per update")
    parser.add_argument("--rounds", type=int, default=11, help="timed rounds (median)")
    args = parser.parse_args()
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if args.rounds < 1 or min(sizes) < 1:
        parser.error("--rounds and every --sizes value must be >= 1")
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads; ns per value (median of {args.rounds})")
    columns = "".join(f"{n:>14,}" for n in sizes)
    print(f"{'update':<18}{columns}   ms at {RESNET18:,}   same as eager")
    fp32_per_value: list[float] = []
    for name, update in UPDATES.items():
        with torch._inductor.config.patch(SETTINGS):
            compiled = torch.compile(update, fullgraph=True, dynamic=False)
            per_value = [time_per_value(compiled, operands(name, n), args.rounds) for n in sizes]
            same = matches_eager(name, compiled, min(sizes))
        ms = " / ".join(f"{t * RESNET18 * 1e3:.1f}" for t in per_value)
        times = "".join(f"{t * 1e9:>14.2f}" for t in per_value)
        print(f"{name:<18}{times}   {ms:<18} {same:.2%}")
        if name == "fp32":
            fp32_per_value = per_value
        torch._dynamo.reset()
    print(target_line(sizes, fp32_per_value))


if __name__ == "__main__":
    main()
