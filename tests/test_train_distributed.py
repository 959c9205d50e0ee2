"""Tests of data-parallel ``fp16fx train``: ``--nproc-per-node``, torchrun, and the steps.

Real processes on localhost with gloo. What must hold: each process takes a disjoint part of
every global batch; the processes end with bitwise equal weights; two processes on halves of a
batch step like one process on the whole batch; rank 0 alone reports; bad process counts fail
in one line before any process starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from fp16fx import cli
from fp16fx.train import parallel
from fp16fx.train.data import ImageBatches, Split, TrainTestData
from fp16fx.train.fsdp import FSDPStepper
from fp16fx.train.models import to_half
from fp16fx.train.parallel import Processes
from fp16fx.train.steppers import make_stepper
from tests.processes import run_to_a_clean_exit
from tests.test_train_checkpoint import assert_same_state

APIS = ["functional", "facade"]
SMALL = ("--limit", "320", "--epochs", "1")  # 5 global batches of 2 x 32


def run_command(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    done = run_to_a_clean_exit([sys.executable, *argv], "test accuracy", cwd=cwd, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def summary_rows(out: str) -> dict[str, str]:
    """Returns the summary table's rows, name -> the rest of the line."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("test accuracy"))
    return {line[:16].strip(): line[16:].strip() for line in lines[start : start + 6]}


# --- the data: disjoint parts of the same global batches -----------------------------------


def test_processes_split_every_global_batch_and_the_test_set() -> None:
    images = torch.arange(24 * 3 * 8 * 8).remainder(256).to(torch.uint8).view(24, 3, 8, 8)
    split = Split(images, torch.arange(24))
    data = TrainTestData("tiny", split, split, 24, (0.5,) * 3, (0.25,) * 3, augment=True)
    cpu = torch.device("cpu")

    def epochs(batch_size: int, processes: Processes) -> list[list[tuple[torch.Tensor, ...]]]:
        batches = ImageBatches(split, data, batch_size, cpu, torch.Generator(), processes)
        return [list(batches) for _ in range(2)]  # two epochs: two shuffles

    whole = epochs(8, parallel.SINGLE)  # one process, global batch 8
    parts = [epochs(4, Processes(rank, 2)) for rank in range(2)]  # two processes x 4
    assert len(whole[0]) == 3
    for epoch, batches in enumerate(whole):
        for step, (x, y) in enumerate(batches):
            (x0, y0), (x1, y1) = (parts[r][epoch][step] for r in range(2))
            assert set(y0.tolist()).isdisjoint(y1.tolist())
            # Strided as DistributedSampler, augmented as the one process augmented them.
            assert torch.equal(x[0::2], x0) and torch.equal(x[1::2], x1)
            assert torch.equal(y[0::2], y0) and torch.equal(y[1::2], y1)
    tests = [ImageBatches(split, data, 5, cpu, processes=Processes(r, 2)) for r in range(2)]
    seen = sorted(label for batches in tests for _, y in batches for label in y.tolist())
    assert seen == list(range(24)) and len(tests[0]) == 3  # 12 images each, batches of 5


# --- the steps: two processes on halves equal one process on the whole batch --------------


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    # No BatchNorm: it normalises each process's part on its own, so no run could match.
    return to_half(nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)))


#: Each run: the API and the state's precision (compact: no FP32 copy, int8 moments).
RUNS = {
    "functional": ("functional", {}),
    "facade": ("facade", {}),
    "functional compact": ("functional", {"master": "compensated", "moments": "int8"}),
    "facade compact": ("facade", {"master": "compensated", "moments": "int8"}),
}


def _train_steps(run: str, distributed: bool, rank: int = 0, size: int = 1) -> dict:
    """Returns the weights after 4 steps, this process taking its part of each batch of 16."""
    api, precision = RUNS[run]
    stepper = make_stepper(
        api, _mlp(), lr=1e-2, loss_scale="dynamic", distributed=distributed, **precision
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(16, 1, 8, 8, generator=g), torch.randint(10, (16,), generator=g)
        stepper.train_step(x[rank::size], y[rank::size])
    return {k: v.clone() for k, v in stepper.state_dict()["model"].items()}


def _fsdp_in_sync(processes: Processes) -> list[bool]:
    """Returns whether the processes' replicated state agrees after 2 FSDP2 steps on their
    own parts: before BatchNorm's buffers become rank 0's, after, and after rank 1's loss
    scale is set apart (each holds its own shard of the params, so those are not compared)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 10))
    stepper = FSDPStepper(model, lr=1e-2, loss_scale="dynamic", compile=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = torch.randn(16, 1, 8, 8, generator=g), torch.randint(10, (16,), generator=g)
        stepper.train_step(x[processes.rank :: 2], y[processes.rank :: 2])
    agree = [processes.replicas_equal(stepper.replicated())]
    processes.broadcast_buffers(stepper.model)
    agree.append(processes.replicas_equal(stepper.replicated()))
    if processes.rank == 1:
        stepper.optimizer.loss_scale = stepper.optimizer.loss_scale / 2
    agree.append(processes.replicas_equal(stepper.replicated()))
    return agree


def _worker(out_dir: str) -> None:
    """One process of the data-parallel run: its weights after 4 steps, per run, to a file."""
    processes = Processes.from_env()
    assert processes is not None
    with parallel.process_group(processes, "cpu"):
        weights = {run: _train_steps(run, True, processes.rank, processes.size) for run in RUNS}
        weights["fsdp in sync"] = _fsdp_in_sync(processes)
    torch.save(weights, os.path.join(out_dir, f"rank{processes.rank}.pt"))


def test_two_processes_step_like_one_process_on_the_global_batch(tmp_path) -> None:
    """In FP32 and in compact precision (the dither is the same on every process). The same
    processes check what the end of an FSDP2 run compares (:meth:`FSDPStepper.replicated`)."""
    parallel.launch(_worker, (str(tmp_path),), nproc=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    # The end-of-run check under FSDP2 sees the buffers and the loss scaler, on every rank.
    assert ranks[0]["fsdp in sync"] == ranks[1]["fsdp in sync"] == [False, True, False]
    for run in RUNS:
        single = _train_steps(run, distributed=False)
        for name, value in single.items():
            assert torch.equal(ranks[0][run][name], ranks[1][run][name]), (run, name)
            # Not bitwise: the mean of two FP16 half-batch grads rounds differently from the
            # whole batch's. Measured: 1.2e-4, one FP16 rounding step of these weights, in 12%
            # of them; one process training on its half alone ends 7e-2 away. Compact: a
            # grad that differs in its last bit can move a block's int8 scale and so its
            # moments' codes (measured: 8.4e-4 at most, 4% of the elements past 1.2e-4).
            atol = 2e-3 if RUNS[run][1] else 5e-4
            torch.testing.assert_close(
                ranks[0][run][name].float(), value.float(), rtol=0, atol=atol
            )


# --- the command: both ways to start it ----------------------------------------------------


def test_nproc_per_node_trains_and_only_rank_0_reports(tmp_path) -> None:
    ckpt = tmp_path / "ck.pt"
    done = run_command(
        *("-m", "fp16fx.cli", "train", "--nproc-per-node", "2", *SMALL),
        *("--compare-fp32", "--save", str(ckpt)),
        cwd=tmp_path,
    )
    assert done.stdout.count("test accuracy") == 1  # one table, from rank 0
    rows = summary_rows(done.stdout)
    # Both runs' weights were compared across the processes at the end: bitwise equal.
    assert rows["processes"].split() == ["2,", "in", "sync", "2,", "in", "sync"]
    assert rows["steps skipped"].split()[2] == "5"  # 320 images / (2 x 32) per step
    assert "5 steps x 64 (2 processes x 32)" in done.stdout
    assert "FP16: fp16fx.FP16_Optimizer(Adam), eager, dynamic loss scale; " in done.stdout
    assert "FP16 model, BatchNorm FP32; DDP" in done.stdout
    assert "FP32: torch.optim.Adam; FP32 model; DDP" in done.stdout
    assert done.stderr.count("FP16 epoch 1/1") == 1  # logged by rank 0 alone
    assert torch.load(ckpt, weights_only=True)["epoch"] == 1  # saved by rank 0


def test_torchrun_runs_the_functional_api(tmp_path) -> None:
    """In compact precision: ``--masters`` passes through torchrun's parser (which refuses
    ``--master`` as an ambiguous abbreviation of its ``--master-addr`` and ``--master-port``)."""
    done = run_command(
        *("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        *("-m", "fp16fx.train", "--api", "functional", *SMALL),
        *("--masters", "compensated", "--moments", "int8"),
        cwd=tmp_path,
    )
    rows = summary_rows(done.stdout)
    assert done.stdout.count("test accuracy") == 1
    assert rows["processes"] == "2, in sync"
    assert float(rows["test accuracy"].rstrip("%")) > 20  # it learned (10 classes)
    assert "; fp16fx.distributed.average_grads" in done.stdout
    assert "compensated master, int8 moments" in done.stdout


def trained_sharded(done: subprocess.CompletedProcess[str], label: str) -> None:
    """Checks the report of an ``--fsdp`` run on 2 processes that trained from scratch."""
    rows = summary_rows(done.stdout)
    assert done.stdout.count("test accuracy") == 1
    assert rows["processes"] == "2, in sync"  # buffers and loss scaler agree
    assert float(rows["test accuracy"].rstrip("%")) > 20  # it learned (10 classes)
    assert f"FP16_Optimizer(Adam), eager, dynamic loss scale; {label}, FSDP2" in done.stdout


def test_fsdp_trains_the_default_task_sharded(tmp_path) -> None:
    """FP32 masters; compensated ones train in the next test's first run."""
    done = run_command(
        *("-m", "fp16fx.cli", "train", "--fsdp", "--nproc-per-node", "2", *SMALL), cwd=tmp_path
    )
    trained_sharded(done, "FP32 model")


def test_fsdp_checkpoints_resume_bitwise_and_at_any_number_of_processes(capsys, tmp_path) -> None:
    """An --fsdp run saved after epoch 1 of 2 and resumed ends bitwise like the uninterrupted
    run, which trains in sync from scratch (compact precision: the checkpoint's FP32 terms
    encode back to the same param, correction, codes and scales); the checkpoint also resumes
    on 4 processes with FP32 masters and moments, an FP32 model. Resuming it without --fsdp is
    refused in one line, as is an unsharded checkpoint under --fsdp."""
    common = ("-m", "fp16fx.cli", "train", "--fsdp", "--limit", "320", "--lr-schedule", "constant")
    compact = ("--masters", "compensated", "--moments", "int8")
    two = ("--nproc-per-node", "2", *compact)
    done = run_command(*common, *two, "--epochs", "2", "--save", "whole.pt", cwd=tmp_path)
    trained_sharded(done, "compensated master, int8 moments; FP16 model")
    run_command(*common, *two, "--epochs", "1", "--save", "split.pt", cwd=tmp_path)
    resumed = ("--epochs", "2", "--resume", "split.pt", "--save", "split.pt")
    run_command(*common, *two, *resumed, cwd=tmp_path)
    whole, split = (torch.load(tmp_path / f, weights_only=True) for f in ("whole.pt", "split.pt"))
    assert split["epoch"] == 2 and split["run"]["fsdp"]
    assert_same_state(tmp_path / "whole.pt", tmp_path / "split.pt")
    untimed = [
        {k: v for k, v in e.items() if "seconds" not in k} for e in whole["history"]["epochs"]
    ]
    assert untimed == [
        {k: v for k, v in e.items() if "seconds" not in k} for e in split["history"]["epochs"]
    ]

    four = ("--nproc-per-node", "4", "--epochs", "3", "--resume", "split.pt", "--save", "four.pt")
    fp32 = ("--masters", "fp32", "--moments", "fp32")  # left out, the checkpoint's are kept
    done = run_command(*common, *four, *fp32, cwd=tmp_path)
    assert "resumed from split.pt after epoch 2" in done.stderr
    assert "int8 to --masters fp32 --moments fp32" in done.stderr
    assert "FP32 model, FSDP2" in done.stderr
    assert summary_rows(done.stdout)["processes"] == "4, in sync"
    assert "3 epochs of 2 steps x 128 (4 processes x 32) from epoch 3," in done.stdout
    four_epochs = torch.load(tmp_path / "four.pt", weights_only=True)["history"]["epochs"]
    assert four_epochs[:2] == split["history"]["epochs"] and len(four_epochs) == 3

    path = str(tmp_path / "split.pt")
    error = one_line_error(capsys, "--resume", path)
    assert f"checkpoint {path} was written with --fsdp: resume it with --fsdp" in error
    unsharded = {k: v for k, v in split["run"].items() if k != "fsdp"}
    torch.save({**split, "run": unsharded}, tmp_path / "unsharded.pt")  # no --fsdp recorded
    error = one_line_error(
        capsys, "--fsdp", "--nproc-per-node", "2", "--resume", str(tmp_path / "unsharded.pt")
    )
    assert "was written without --fsdp: resume it without --fsdp" in error


def test_fsdp_refuses_what_it_cannot_do_in_one_line(capsys) -> None:
    assert "add --nproc-per-node N" in one_line_error(capsys, "--fsdp")
    error = one_line_error(capsys, "--fsdp", "--api", "functional", "--nproc-per-node", "2")
    assert "--fsdp trains with FP16_Optimizer: use --api facade" in error


# --- bad process counts: one line, nothing started -----------------------------------------


def one_line_error(capsys, *argv: str) -> str:
    code = cli.main(["train", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("fp16fx train: error: ")
    return err[0]


def test_bad_process_counts_fail_in_one_line(capsys, monkeypatch) -> None:
    assert "--nproc-per-node must be >= 1, got 0" in one_line_error(capsys, "--nproc-per-node", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    error = one_line_error(capsys, "--nproc-per-node", "2", "--device", "cuda")
    assert "--nproc-per-node 2 needs 2 GPUs (one per process), 1 visible" in error
    error = one_line_error(capsys, "--nproc-per-node", "2", "--device", "cuda:0")
    assert "give --device cuda" in error
    monkeypatch.undo()
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    torchrun |= {"MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)  # as if torchrun had started 2 processes
    error = one_line_error(capsys, "--nproc-per-node", "4")
    assert "torchrun started 2 processes per node" in error
