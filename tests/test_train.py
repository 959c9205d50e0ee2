"""Tests of ``fp16fx train`` end to end: real runs that must learn, and one-line errors.

The default run (a small FP16 CNN on scikit-learn's digits) must reach 95% test accuracy:
that is the promise of the README's first command, so it is tested as it ships.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from fp16fx import cli
from fp16fx.train import command, session
from fp16fx.train.config import SetupError, TrainConfig
from fp16fx.train.models import build_model


def train_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Returns ``(exit code, stdout, stderr)`` of ``fp16fx train ARGV`` run in this process."""
    code = cli.main(["train", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def table(out: str) -> dict[str, list[str]]:
    """Returns the summary table's rows: name -> the cells of each column."""
    lines = out.strip().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("test accuracy"))
    rows = {}
    for line in lines[start : start + 5]:
        name, cells = line[:16].strip(), line[16:].replace(" / ", "/").replace(" s", "s")
        rows[name] = cells.split()
    return rows


def accuracy(cell: str) -> float:
    return float(cell.rstrip("%")) / 100


# --- real runs -----------------------------------------------------------------------------


def test_default_run_learns_digits_in_fp16_to_95_percent(capsys) -> None:
    code, out, err = train_cli(capsys)  # exactly the README's command: no flags
    assert code == 0, err
    rows = table(out)
    assert accuracy(rows["test accuracy"][0]) >= 0.95
    assert "FP16: fp16fx.FP16_Optimizer(Adam), eager, dynamic loss scale" in out
    assert "cnn on digits (1,437 train / 360 test images)" in out
    skipped, steps = map(int, rows["steps skipped"][0].split("/"))
    assert steps == 6 * 44 and 0 <= skipped < steps
    assert float(rows["final loss scale"][0]) >= 1
    assert "epoch 6/6" in err  # the log lines (logger "fp16fx" on stderr)


def test_functional_api_learns_digits_to_95_percent(capsys) -> None:
    code, out, err = train_cli(capsys, "--api", "functional", "--epochs", "3")
    assert code == 0, err
    assert accuracy(table(out)["test accuracy"][0]) >= 0.95
    assert "fp16fx.step over fp16fx.adam, torch.func.grad of functional_call" in out


def test_compare_fp32_trains_both_from_the_same_start(capsys, monkeypatch) -> None:
    built = []

    def build_and_record(*args, **kwargs):
        model = build_model(*args, **kwargs)
        built.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return model

    monkeypatch.setattr(session, "build_model", build_and_record)
    code, out, err = train_cli(
        capsys, "--compare-fp32", "--epochs", "2", "--limit", "640", "--quiet"
    )
    assert code == 0, err
    fp16_start, fp32_start = built
    assert fp16_start.keys() == fp32_start.keys()
    assert all(torch.equal(fp16_start[k], fp32_start[k]) for k in fp16_start)
    assert err == ""  # --quiet: nothing but the table
    rows = table(out)
    fp16, fp32 = (accuracy(c) for c in rows["test accuracy"])
    assert fp16 >= 0.85 and fp32 >= 0.85 and abs(fp16 - fp32) < 0.08
    assert rows["final loss scale"][1] == "-" and rows["steps skipped"][1] == "0/40"
    assert "FP32: torch.optim.Adam; FP32 model" in out


@pytest.mark.parametrize("api", ["functional", "facade"])
def test_every_step_overflows_at_a_huge_static_scale_and_is_skipped(capsys, api) -> None:
    # FP16's largest value is 65504: a loss scaled by 1e30 overflows in every backward pass.
    code, out, err = train_cli(
        capsys, "--api", api, "--loss-scale", "1e30", "--epochs", "1", "--limit", "96", "--quiet"
    )
    assert code == 0, err
    rows = table(out)
    assert rows["steps skipped"] == ["3/3"]
    assert float(rows["final loss scale"][0]) == 1e30  # static: never moves
    assert accuracy(rows["test accuracy"][0]) < 0.5  # nothing was learned


@pytest.mark.parametrize("api", ["functional", "facade"])
def test_resnet18_smoke_run_on_fake_data(capsys, api) -> None:
    code, out, err = train_cli(
        capsys,
        *("--model", "resnet18", "--dataset", "fake", "--api", api),
        *("--limit", "8", "--batch-size", "4", "--epochs", "1", "--quiet"),
    )
    assert code == 0, err
    assert table(out)["steps skipped"][0].endswith("/2")
    assert "resnet18 on fake (8 train / 8 test images)" in out


@pytest.mark.compile
def test_functional_compiled_run_never_recompiles_as_the_lr_changes(capsys) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # forget graphs other tests compiled
    graphs_before = counters["stats"]["unique_graphs"]
    code, out, err = train_cli(
        capsys, "--api", "functional", "--compile", "--epochs", "2", "--limit", "64", "--quiet"
    )
    assert code == 0, err
    assert "fp16fx.compile_step(inplace=True) over fp16fx.adam" in out
    # Cosine schedule: the lr changed at each of the 4 steps; one graph was ever compiled.
    assert counters["stats"]["unique_graphs"] - graphs_before == 1


def test_progress_bar_shows_loss_scale_and_skipped_steps(capsys) -> None:
    from fp16fx.train import TrainConfig, train

    train(TrainConfig(api="functional", epochs=1, limit=320, progress=True))
    err = capsys.readouterr().err
    assert "epoch 1/1" in err and "scale=65536" in err and "skipped=0" in err


def test_no_progress_bar_when_stderr_is_not_a_terminal(capsys) -> None:
    args = cli.build_parser().parse_args(["train"])
    assert command.config_from_args(args).progress is False  # pytest's stderr is no TTY


# --- bad input: one line, no traceback, non-zero exit --------------------------------------


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fp16fx train: error: ")
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--model", "vgg16"], ["unknown model 'vgg16'", "cnn, resnet18"]),
        (["--dataset", "mnist"], ["unknown dataset 'mnist'", "digits, cifar10, fake"]),
        (["--dataset", "cifar10"], ["--data-dir", "nothing is downloaded"]),
        (["--device", "tpu"], ["unknown device 'tpu'", "use cpu or cuda"]),
        pytest.param(
            ["--device", "cuda"],
            ["CUDA is not available here", "use --device cpu"],
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available"),
        ),
        (["--epochs", "0"], ["--epochs must be >= 1"]),
        (["--lr", "inf"], ["--lr must be a finite number > 0, got inf"]),
        (["--lr", "1e39"], ["--lr 1e+39: hyperparameter 'lr' is 1e+39, which rounds to inf"]),
        (["--lr", "1e-46"], ["--lr 1e-46 rounds to 0 in FP32, where the step computes"]),
        (["--batch-size", "5000"], ["exceeds the 1437 training images"]),
        # Checked before the data loads (and, with --nproc-per-node, before any process).
        (["--limit", "0"], ["--limit must be >= 1, got 0"]),
        (["--model", "resnet18", "--batch-size", "1"], ["--batch-size 1 is too small for"]),
        (["--data-dir", "/tmp"], ["--dataset digits reads none (drop --data-dir"]),
        (
            ["--limit", "10"],
            ["--batch-size 32 (the default) exceeds the 10 training images (--limit 10)"],
        ),
        (["--resume", "/nonexistent/ck.pt"], ["checkpoint /nonexistent/ck.pt does not exist"]),
    ],
)
def test_bad_settings_fail_in_one_line(capsys, argv, fragments) -> None:
    code, out, err = train_cli(capsys, *argv, "--api", "functional")
    assert_one_line_error(code, err, *fragments)
    assert out == ""


def test_limit_and_data_dir_are_checked_before_the_data_loads(capsys, monkeypatch) -> None:
    monkeypatch.setattr(session, "load_dataset", lambda *args: pytest.fail("the data loaded"))
    code, _, err = train_cli(capsys, "--limit", "0")
    assert_one_line_error(code, err, "--limit must be >= 1, got 0")
    code, _, err = train_cli(capsys, "--dataset", "fake", "--data-dir", "/tmp")
    assert_one_line_error(code, err, "--dataset fake reads none")


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"api": "jax"}, "unknown api 'jax' (choose from: facade, functional)"),
        ({"lr_schedule": "linear"}, "unknown lr schedule 'linear' (choose from: cosine, constant)"),
        ({"loss_scale": "big"}, "--loss-scale: a static loss scale must be a finite number"),
        ({"loss_scale": 0.0}, "--loss-scale: a static loss scale must be a finite number"),
        ({"seed": 2**64}, f"--seed: {2**64} is outside torch's seeds, [-2**63, 2**64)"),
        ({"seed": 7.5}, "--seed: 7.5 is a float, not an int"),
        ({"seed": True}, "--seed: True is a bool, not an int"),
    ],
)
def test_a_python_config_argparse_would_refuse_fails_before_the_data_loads(
    monkeypatch, setting, message
) -> None:
    """A TrainConfig built in Python skips argparse's choices and types: train() checks what
    they check, before the data loads."""
    monkeypatch.setattr(session, "load_dataset", lambda *args: pytest.fail("the data loaded"))
    with pytest.raises(SetupError, match=re.escape(message)):
        session.train(TrainConfig(**setting))


def test_a_global_batch_the_data_cannot_hold_fails_before_any_process_starts(
    capsys, monkeypatch
) -> None:
    monkeypatch.setattr(command, "launch", lambda *args: pytest.fail("processes started"))
    code, _, err = train_cli(capsys, "--nproc-per-node", "2", "--batch-size", "1000")
    assert_one_line_error(code, err, "--batch-size 1000 x 2 processes exceeds the 1437")


def test_a_stray_world_size_is_named_in_one_line(capsys, monkeypatch) -> None:
    """WORLD_SIZE alone once went on to torch.distributed's rendezvous and its traceback."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    code, _, err = train_cli(capsys, "--limit", "64")
    assert_one_line_error(code, err, "WORLD_SIZE is set but RANK, MASTER_ADDR, MASTER_PORT not")


@pytest.mark.parametrize(("name", "value"), [("WORLD_SIZE", "abc"), ("MASTER_PORT", "notaport")])
def test_a_torchrun_variable_that_is_no_integer_is_named_in_one_line(
    capsys, monkeypatch, name, value
) -> None:
    """Each once ended in int()'s traceback (MASTER_PORT's inside torch's rendezvous)."""
    torchrun = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    for key, setting in {**torchrun, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, setting)
    monkeypatch.setenv(name, value)
    code, _, err = train_cli(capsys, "--limit", "64")
    assert_one_line_error(code, err, f"the environment's {name} is {value!r}, not a non-negative")


def test_missing_cifar10_says_where_to_put_it(capsys, tmp_path) -> None:
    code, _, err = train_cli(capsys, "--dataset", "cifar10", "--data-dir", str(tmp_path))
    assert_one_line_error(code, err, "cifar-10-batches-py", "never downloads")


def test_unwritable_save_path_fails_before_training(capsys, tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code, _, err = train_cli(capsys, "--save", str(blocker / "ck.pt"))
    assert_one_line_error(code, err, f"cannot save to {blocker / 'ck.pt'}")
    # A directory, also one not made yet: the latter once failed after the first epoch.
    for directory in (str(tmp_path), str(tmp_path / "not-yet") + "/", "", "not-yet/."):
        code, _, err = train_cli(capsys, "--save", directory)
        assert_one_line_error(code, err, "it names a directory, not a file")


def test_a_refused_run_creates_no_directory(capsys, tmp_path) -> None:
    """The check of --save once made its directories, left behind by a run refused next."""
    new = tmp_path / "new"
    for argv in (
        ["--plot", "curves.txt"],
        ["--resume", str(tmp_path / "missing.pt")],
        ["--limit", "10"],  # refused once the data is loaded
    ):
        code, _, err = train_cli(capsys, "--save", str(new / "sub" / "ck.pt"), *argv)
        assert code == 1 and err
        assert not new.exists()


def test_plot_and_checkpoint_paths_are_checked_before_training(capsys, tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code, _, err = train_cli(capsys, "--plot", str(blocker / "curves.png"))
    assert_one_line_error(code, err, f"cannot write the plot {blocker / 'curves.png'}")
    assert "a-file is not a directory" in err
    code, _, err = train_cli(capsys, "--save", str(blocker / "sub" / "ck.pt"))
    assert_one_line_error(code, err, "a-file is not a directory")
    # The plot would have overwritten the checkpoint, or the checkpoint resumed from.
    same = str(tmp_path / "run.png")
    code, _, err = train_cli(capsys, "--save", same, "--plot", same)
    assert_one_line_error(code, err, f"--plot and --save name the same file, {same}")
    blocker.rename(tmp_path / "run.png")
    roundabout = str(tmp_path / ".." / tmp_path.name / "run.png")
    code, _, err = train_cli(capsys, "--resume", same, "--plot", roundabout)
    assert_one_line_error(code, err, "--plot and --resume name the same file")


def test_plot_without_matplotlib_fails_before_training(capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = train_cli(capsys, "--plot", "curves.png")
    assert_one_line_error(code, err, "--plot needs matplotlib", "pip install 'fp16fx[plot]'")


def test_without_the_train_extra_the_error_says_how_to_install_it(capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn now fails
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    code, _, err = train_cli(capsys)
    assert_one_line_error(code, err, "'sklearn' module is missing", "pip install 'fp16fx[train]'")


def test_plot_is_written_after_a_run(capsys, tmp_path) -> None:
    path = tmp_path / "plots" / "curves.png"  # its directory made when it is written
    code, out, err = train_cli(
        capsys, "--api", "functional", "--epochs", "1", "--limit", "64", "--plot", str(path)
    )
    assert code == 0, err
    assert path.read_bytes()[:4] == b"\x89PNG" and f"plot saved to {path}" in out


def test_bad_loss_scale_is_an_argparse_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--loss-scale", "lots"])
    assert exit_info.value.code == 2
    assert "'lots' is neither 'dynamic' nor a number" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # once a traceback from FP16_Optimizer
        cli.main(["train", "--loss-scale", "1e40"])
    assert exit_info.value.code == 2
    assert "FP32 holds as a normal value" in capsys.readouterr().err


@pytest.mark.parametrize("seed", [str(2**64), str(-(2**63) - 1), "7.5"])
def test_a_seed_torch_cannot_take_is_an_argparse_error(capsys, seed) -> None:
    """A seed past 2**64 once ended in a traceback ('Overflow when unpacking long long')."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--seed", seed])
    assert exit_info.value.code == 2
    assert "argument --seed: " in capsys.readouterr().err


def test_fp16fx_command_lists_train() -> None:
    assert "train" in cli.build_parser().format_help()


def test_python_dash_m_fp16fx_is_the_fp16fx_command() -> None:
    """It once failed with "No module named fp16fx.__main__"."""
    done = subprocess.run(
        [sys.executable, "-m", "fp16fx", "train", "--epochs", "0"], capture_output=True, text=True
    )
    assert done.returncode == 1 and "fp16fx train: error: --epochs must be >= 1" in done.stderr


def test_installed_command_fails_cleanly_in_a_subprocess() -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "fp16fx.cli", "train", "--model", "nope"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == [
        "fp16fx train: error: unknown model 'nope' (choose from: cnn, resnet18)"
    ]
