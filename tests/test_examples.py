"""The examples run, as a user runs them (a subprocess each), with small arguments.

Each prints what it claims to show; these tests read it back.
"""

from __future__ import annotations

import importlib.util
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir

import fp16fx.compile
from tests.fallbacks import FALLBACK
from tests.processes import run_to_a_clean_exit

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        ("functional_step.py", ["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        ("migrate_from_apex.py", ["--steps", "-1"], "--steps must be >= 1, got -1"),
        ("resnet18_cifar10.py", ["--epochs", "0"], "--epochs must be >= 1, got 0"),
        ("resnet18_cifar10.py", ["--fake-size", "1"], "--fake-size must be >= 2, got 1"),
        ("resnet18_cifar10.py", ["--batch-size", "1"], "--batch-size must be >= 2, got 1"),
        ("resnet18_cifar10.py", ["--data-dir", "/nonexistent"], "holds no CIFAR-10"),
        ("compact_arithmetic.py", ["--sizes", "abc"], "--sizes must be comma-separated"),
        ("precision_table.py", ["--steps", "0"], "--steps must be >= 1, got 0"),
        ("fsdp2_fp16.py", [], "run it under torchrun"),
        ("functional_step.py", ["--lr=-1"], "--lr must be a finite number >= 0, got -1.0"),
        ("resnet18_cifar10.py", ["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
        ("compare_sharding.py", ["--mode=ddp", "--width=0"], "--width must be >= 1, got 0"),
        ("compare_sharding.py", ["--mode=ddp", "--depth=0"], "--depth must be >= 1, got 0"),
        ("compare_sharding.py", ["--mode=ddp", "--batch=0"], "--batch must be >= 1, got 0"),
        ("compare_sharding.py", ["--mode=ddp", "--check-pass"], "it needs --mode fsdp2, not ddp"),
        ("precision_table.py", ["--device", "mps"], "this script runs on cpu or cuda"),
        pytest.param(
            "precision_table.py",
            ["--device", "cuda"],
            "CUDA is not available here",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available"),
        ),
        ("triton_passes.py", ["--values", "0"], "--values must be >= --leaves (4), got 0"),
        ("triton_passes.py", ["--leaves", "0"], "--leaves must be >= 1, got 0"),
    ],
)
def test_an_example_refuses_a_bad_argument_before_any_work(
    name, args, message, monkeypatch, capsys
):
    """Each once ran on (loss nan, "after -1 steps") or failed in a traceback, some only after
    minutes of work (precision_table.py's --steps, after its digits study; its --device cuda
    without CUDA, after the header). Run in this process as ``python examples/NAME ARGS`` runs
    it, as ``__main__``: a refusal takes a moment, a fresh interpreter seconds."""
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / name), *args])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    assert exited.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


def run_example(name: str, *args: str) -> str:
    """Returns the stdout of ``python examples/NAME ARGS`` after checking it exited with 0."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert FALLBACK not in result.stderr, result.stderr[-3000:]  # a compiled step ran eagerly
    return result.stdout


@pytest.mark.compile
def test_functional_step_example_never_recompiles_and_skips_exactly() -> None:
    out = run_example("functional_step.py", "--steps", "20")
    assert "recompiles after the first step: 0" in out
    assert "step   11  overflow: step skipped; loss scale now 32768" in out
    assert "params unchanged: True" in out
    assert "after 20 steps (19 applied)" in out
    assert "the module's params are the state's: True" in out  # in place
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert losses and all(loss < 1.5 for loss in losses)


def test_migrate_from_apex_example_runs_static_and_dynamic_scaling() -> None:
    out = run_example("migrate_from_apex.py", "--steps", "30")
    static, dynamic = out.split("dynamic loss scale")
    assert "static step 30:" in static and "loss scale 128," in static
    assert "skipped so far 1" in static and "skipped so far 1" in dynamic
    assert "loss scale 32768" in dynamic  # 2**16 halved by the one overflow
    assert out.count("saved and reloaded") == 2
    short = run_example("migrate_from_apex.py", "--steps", "2")  # once a modulo by zero
    assert "dynamic step 2:" in short


def test_migrate_from_apex_example_changes_only_the_import() -> None:
    source = (EXAMPLES / "migrate_from_apex.py").read_text()
    assert "# from apex.fp16_utils import FP16_Optimizer, network_to_half\n" in source
    assert "\nfrom fp16fx.fp16_utils import FP16_Optimizer, network_to_half\n" in source
    for call in ("optimizer.backward(", "optimizer.step()", "FP16_Optimizer(optimizer"):
        assert call in source


def test_resnet18_cifar10_example_trains_on_fake_data() -> None:
    # 9 images in batches of 4: the last batch of one, which BatchNorm refuses, is dropped
    out = run_example("resnet18_cifar10.py", "--fake-size", "9", "--batch-size", "4")
    assert re.search(r"epoch 1/1: loss \d+\.\d+, [0-2] skipped steps, loss scale \d+", out)
    assert "test accuracy" in out and "on 4 images" in out


def test_resnet18_cifar10_example_has_the_three_fixes() -> None:
    source = (EXAMPLES / "resnet18_cifar10.py").read_text()
    body = source.split('"""', 2)[2]  # after the module docstring, which quotes the mistakes
    code = "\n".join(line.split("#")[0] for line in body.splitlines())  # and comments
    assert re.search(r"transforms\.Compose\(\s*\[", code) and "Compose[" not in code
    assert "resnet18(weights=None, num_classes=10)" in code and "pretrained" not in code
    assert "optimizer.step()" in code and ".update()" not in code
    assert "download=True" not in code


def test_functional_docs_example_runs_and_learns() -> None:
    text = (EXAMPLES.parent / "docs" / "functional.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]  # "A complete example"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"accuracy (\d+\.\d)%, state: MixedPrecisionState", result.stdout)
    assert match and float(match.group(1)) >= 95
    assert "count=200" in result.stdout  # no step was skipped


@pytest.mark.compile
@pytest.mark.parametrize(
    "precision", [(), ("--masters", "compensated", "--moments", "int8")], ids=["fp32", "compact"]
)
def test_fsdp2_example_runs_under_torchrun_and_resumes_bitwise(precision, tmp_path) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    example = [str(EXAMPLES / "fsdp2_fp16.py"), "--steps", "10", *precision]
    result = run_to_a_clean_exit(
        [*torchrun, "--nproc-per-node", "2", *example],
        "same: True",
        timeout=300,
        env={
            **os.environ,
            "PYTHONWARNINGS": "ignore",
            "TMPDIR": str(tmp_path),  # where its checkpoint goes, and must go from
            "TORCHINDUCTOR_CACHE_DIR": cache_dir(),  # the usual one, not one in tmp_path
        },
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step   10  loss" in result.stdout
    assert "resumed from step 5" in result.stdout and "same: True" in result.stdout
    left = [p for p in tmp_path.rglob("*") if p.name == ".metadata" or p.suffix == ".distcp"]
    assert not left, left  # the DCP checkpoint, removed


@pytest.mark.compile
def test_the_int8_step_is_one_update_pass_in_the_triton_a_gpu_gets() -> None:
    """Inductor's Triton code for the compensated + int8 step, written on this CPU: the grads'
    check, then one pass over (blocks, 256) that takes each block's maximum and writes every
    new value (5 loads, 4 stores per value). Coded flat, the maxima took a pass of their own
    that read the 5 inputs too (fp16fx.precision._in_rows)."""
    out = run_example("triton_passes.py", "--values", "4096", "--mode", "compensated+int8")
    assert "compensated+int8: 2 passes over the values" in out, out
    assert re.search(r"^  (red|per) \d+ x \d+: 1 loads, 0 stores, \d+ operations", out, re.M), out
    assert re.search(r"^  per 16 x 256: 5 loads, 4 stores, \d+ operations", out, re.M), out


@pytest.mark.compile
def test_triton_passes_counts_each_array_once_over_the_values_the_leaves_hold() -> None:
    """At 4096 values Inductor fuses the FP32-master step into one looped reduction that reads
    the grads twice (check, then update) and stores through ``tl.broadcast_to(r0_0, ...)``:
    once counted as 6 loads and 0 stores. And 4099 values over 4 leaves are 4 x 1024: the
    passes were once filtered against 4099 ("0 passes")."""
    out = run_example("triton_passes.py", "--values", "4099", "--leaves", "4", "--mode", "fp32")
    assert "4 leaves of 1,024 values: 4,096 in all" in out, out
    assert "fp32: 1 passes over the values" in out, out
    assert re.search(r"^  red 1 x 4096: 5 loads, 4 stores, \d+ operations", out, re.M), out


def load_example(name: str):
    """Returns the module ``examples/NAME``, imported (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), EXAMPLES / name)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_compact_arithmetics_target_is_the_fp32_update_at_the_largest_size() -> None:
    """The target is "from memory": at the largest size, wherever --sizes puts it (the
    script once took the last one)."""
    script = load_example("compact_arithmetic.py")
    line = script.target_line([262144, 4096], [1.6e-9, 1.6e-8])
    assert "at 262,144 values (the largest size)" in line
    assert f"takes {script.RESNET18 * 1e-6:.1f} ms" in line  # 1.6e-9 s x values / 1.6


@pytest.mark.compile
def test_compact_arithmetic_example_times_each_format_under_fp16fxs_settings() -> None:
    script = load_example("compact_arithmetic.py")
    assert script.SETTINGS == fp16fx.compile._INDUCTOR_SETTINGS  # the floor of fp16fx's kernels

    out = run_example("compact_arithmetic.py", "--sizes", "4096", "--rounds", "1")
    row = r"^(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%$"  # update, ns, ms, same as eager
    rows = {m[0]: m[1:] for m in re.findall(row, out, re.M)}
    assert sorted(rows) == ["compensated", "compensated+int8", "fp32"], out
    for ns, _ms, same in rows.values():
        assert float(ns) > 0 and float(same) > 99.0  # the compiled kernels store eager's values
    assert re.search(r"^target: .* takes [\d.]+ ms at resnet18's size", out, re.M), out
