"""Tests of ``examples/precision_table.py``, the accuracy study of compact precision.

The study itself takes half an hour; here it runs in its ``--quick`` configuration, on the
baseline mode (FP32 masters and moments), as a user runs it: a subprocess, the markdown table
read back from its output.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from fp16fx.train import command, session
from fp16fx.train.models import build_model, to_half
from fp16fx.train.steppers import FunctionalStepper

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "precision_table.py"


def load_script() -> ModuleType:
    """Returns the script imported as a module (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location("precision_table", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def table_rows(section: str) -> list[list[str]]:
    """Returns the cells of the body rows of the first markdown table in ``section``."""
    lines = [line for line in section.splitlines() if line.startswith("|")]
    assert len(lines) >= 3 and set(lines[1]) <= set("|-: "), section
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def test_quick_run_prints_a_table_per_task_with_the_baseline_row() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--seeds", "1", "--modes", "fp32"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    # As it goes: one line per run, then the report.
    assert re.search(r"fp32 +seed 0: test accuracy \d+\.\d\d%", out)
    assert re.search(r"fp32 +seed 0: eval loss \d+\.\d{4} nats/char", out)
    report = out.split("## fp16fx compact precision", 1)[1]
    digits, lm = report.split("### Digits")[1].split("### Character-level language model")

    assert "**FP16 storage, FP16 math**" in digits
    (row,) = table_rows(digits)
    assert row[:2] == ["fp32 (baseline)", "fp32"]
    assert re.fullmatch(r"\d+\.\d\d ± n/a", row[2])  # one seed: no spread
    assert row[3] == "—"  # the baseline has no difference to itself

    assert "**FP16 storage, FP32 math**" in lm
    assert "held out" in lm and "unigram" in lm
    (row,) = table_rows(lm)
    assert row[:2] == ["fp32 (baseline)", "fp32"]
    loss = float(row[2].split(" ± ")[0])
    assert 0 < loss < 6  # ln 256 = 5.55 nats/char: a uniform guess


def test_modes_parse_with_the_baseline_first_and_once() -> None:
    script = load_script()
    modes = script.parse_modes("compensated+int8,fp32,compensated")
    assert [m.name for m in modes] == ["fp32", "compensated+int8", "compensated"]
    assert modes[0].is_baseline and modes[0].keywords() == {}  # runs on any fp16fx
    assert modes[1].keywords() == {"master": "compensated", "moments": "int8"}
    assert script.Mode("fp32", "bf16").keywords() == {"moments": "bf16"}
    with pytest.raises(Exception, match="bad mode 'fp8'"):
        script.parse_modes("fp8")


def test_runs_report_mean_and_sample_spread() -> None:
    script = load_script()
    runs = script.Runs(script.BASELINE, [0.5, 0.7, 0.6], [1.0, 1.0, 1.0])
    assert runs.mean == pytest.approx(0.6) and runs.std == pytest.approx(0.1)


def test_train_precision_flags_reach_the_config_and_a_new_run_defaults_to_fp32() -> None:
    """Left out, the flags are None ("not given"): FP32 in a new run, the checkpoint's in a
    resumed one (tests/test_train_checkpoint.py)."""
    parser = command.argparse.ArgumentParser()
    command.add_arguments(parser)
    config = command.config_from_args(parser.parse_args([]))
    assert config.precision() == {"master": None, "moments": None}
    new_run = session._with_precision(config, ckpt=None)
    assert new_run.precision() == {"master": "fp32", "moments": "fp32"}
    for spelling in ("--masters", "--master"):  # --masters passes through torchrun
        args = parser.parse_args([spelling, "compensated", "--moments", "int8"])
        config = command.config_from_args(args)
        assert (config.master, config.moments) == ("compensated", "int8")
    with pytest.raises(SystemExit):
        parser.parse_args(["--moments", "fp8"])


def test_the_default_precision_passes_no_keyword_and_keeps_the_label() -> None:
    model = to_half(build_model("cnn", 1, 10))
    stepper = FunctionalStepper(model, lr=1e-3, loss_scale="dynamic")
    assert "master" not in stepper.label and "moments" not in stepper.label
    with pytest.raises(ValueError, match=r"moments must be one of .* got 'fp8'"):
        FunctionalStepper(model, lr=1e-3, loss_scale="dynamic", moments="fp8")
