"""Tests of ``fp16fx train``'s checkpoints: atomic writes, exact resume, bad files.

Resuming must be invisible: a run interrupted and resumed ends with weights and optimizer state
bitwise equal to an uninterrupted run's (CPU kernels are deterministic).
"""

from __future__ import annotations

import datetime
import os
import pathlib
import stat
import threading

import pytest
import torch

from fp16fx import cli
from fp16fx.train import checkpoint, command, loop, session
from fp16fx.train.checkpoint import CheckpointError, load_checkpoint, save_atomic
from fp16fx.train.config import TrainConfig
from fp16fx.train.models import build_model, to_half

APIS = ["functional", "facade"]
SMALL = ("--limit", "160", "--quiet")  # 5 steps per epoch


def train_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["train", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def leaves(tree: object, prefix: str = "") -> dict[str, object]:
    """Returns every leaf (tensor or primitive) inside nested dicts/lists, keyed by its path."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    found: dict[str, object] = {}
    for key, value in items:
        found.update(leaves(value, f"{prefix}/{key}"))
    return found


def assert_same_state(path_a: str, path_b: str) -> None:
    """Asserts that two checkpoints hold bitwise equal model and optimizer states."""
    a = leaves(torch.load(path_a, weights_only=True)["stepper"])
    b = leaves(torch.load(path_b, weights_only=True)["stepper"])
    assert a.keys() == b.keys()
    assert sum(isinstance(v, torch.Tensor) for v in a.values()) > 10
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == b[key].dtype, key
            assert torch.equal(value, b[key]), f"{key} differs"
        else:
            assert value == b[key], key


def leftovers(directory) -> list[str]:
    return [name for name in os.listdir(directory) if name.endswith(".tmp")]


# --- atomic writes -------------------------------------------------------------------------


def test_save_is_readable_weights_only_and_leaves_no_temp_file(tmp_path) -> None:
    path = str(tmp_path / "ck.pt")
    save_atomic({"w": torch.arange(3), "epoch": 1}, path)
    assert torch.load(path, weights_only=True)["epoch"] == 1
    assert leftovers(tmp_path) == []


def test_a_save_failing_midway_keeps_the_previous_checkpoint(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "ck.pt")
    save_atomic({"w": torch.ones(1000), "epoch": 1}, path)
    real_save = torch.save

    def save_half_then_fail(obj, f, *args, **kwargs):
        real_save({"partial": torch.zeros(10)}, f)  # some bytes of a would-be checkpoint...
        f.write(b"\x00" * 100)
        raise OSError(28, "No space left on device")  # ...then the disk fills up

    monkeypatch.setattr(torch, "save", save_half_then_fail)
    with pytest.raises(CheckpointError, match=r"could not save checkpoint .*No space left"):
        save_atomic({"w": torch.zeros(1000), "epoch": 2}, path)
    old = torch.load(path, weights_only=True)
    assert old["epoch"] == 1 and torch.equal(old["w"], torch.ones(1000))
    assert leftovers(tmp_path) == []


def test_a_failing_save_during_training_is_one_line_and_keeps_the_old_file(
    capsys, tmp_path, monkeypatch
) -> None:
    path = str(tmp_path / "ck.pt")
    assert train_cli(capsys, "--api", "functional", "--epochs", "1", "--save", path, *SMALL)[0] == 0
    with open(path, "rb") as f:
        before = f.read()

    def fail(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 torn")
        raise RuntimeError("interrupted write")

    monkeypatch.setattr(torch, "save", fail)
    code, _, err = train_cli(
        capsys, "--api", "functional", "--epochs", "2", "--resume", path, "--save", path, *SMALL
    )
    assert code == 1
    assert err.strip().splitlines() == [
        f"fp16fx train: error: could not save checkpoint {path}: interrupted write"
    ]
    with open(path, "rb") as f:
        assert f.read() == before
    assert leftovers(tmp_path) == []


# --- exact resume --------------------------------------------------------------------------


@pytest.mark.parametrize("api", APIS)
def test_resume_equals_an_uninterrupted_run_bitwise(capsys, tmp_path, api) -> None:
    whole, split = str(tmp_path / "whole.pt"), str(tmp_path / "split.pt")
    common = ("--api", api, "--lr-schedule", "constant", *SMALL)
    assert train_cli(capsys, *common, "--epochs", "2", "--save", whole)[0] == 0
    assert train_cli(capsys, *common, "--epochs", "1", "--save", split)[0] == 0
    assert torch.load(split, weights_only=True)["epoch"] == 1
    code, out, err = train_cli(capsys, *common, "--epochs", "2", "--resume", split, "--save", split)
    assert code == 0, err
    assert torch.load(split, weights_only=True)["epoch"] == 2
    assert_same_state(whole, split)
    assert "0 / 10" in out  # the summary covers both epochs


@pytest.mark.parametrize("api", APIS)
def test_interrupted_run_resumes_exactly_with_the_cosine_schedule(
    capsys, tmp_path, monkeypatch, api
) -> None:
    whole, crashed = str(tmp_path / "whole.pt"), str(tmp_path / "crashed.pt")
    common = ("--api", api, "--epochs", "3", *SMALL)
    assert train_cli(capsys, *common, "--save", whole)[0] == 0

    real_evaluate, calls = loop.evaluate, []

    def evaluate_then_interrupt(stepper, batches):
        calls.append(1)
        if len(calls) == 2:  # Ctrl-C during epoch 2, after epoch 1's checkpoint
            raise KeyboardInterrupt
        return real_evaluate(stepper, batches)

    monkeypatch.setattr(loop, "evaluate", evaluate_then_interrupt)
    code, _, err = train_cli(capsys, *common, "--save", crashed)
    assert code == 130 and f"interrupted; the last checkpoint is {crashed}" in err
    monkeypatch.setattr(loop, "evaluate", real_evaluate)

    assert torch.load(crashed, weights_only=True)["epoch"] == 1
    code, _, err = train_cli(capsys, *common, "--resume", crashed, "--save", crashed)
    assert code == 0, err
    assert_same_state(whole, crashed)


COMPACT = ("--masters", "compensated", "--moments", "int8")
FP32 = ("--masters", "fp32", "--moments", "fp32")


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("direction", ["fp32 to compact", "compact to fp32"])
def test_a_checkpoint_resumes_in_another_precision(capsys, tmp_path, api, direction) -> None:
    """An epoch saved with FP32 masters and moments resumes with compensated masters and int8
    moments, or the reverse (given explicitly: left out, the checkpoint's precision is kept):
    the optimizer state is converted, the second epoch trains with no skipped step, and the
    new checkpoint holds and records the new precision."""
    first, then = ((), COMPACT) if direction == "fp32 to compact" else (COMPACT, FP32)
    path = str(tmp_path / "ck.pt")
    common = ("--api", api, "--lr-schedule", "constant", *SMALL)
    assert train_cli(capsys, *common, *first, "--epochs", "1", "--save", path)[0] == 0
    code, out, err = train_cli(
        capsys, *common, *then, "--epochs", "2", "--resume", path, "--save", path
    )
    assert code == 0, err
    assert "0 / 10" in out  # both epochs summarized, no step skipped
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["epoch"] == 2
    compact = then == COMPACT
    master, moments = ("compensated", "int8") if compact else ("fp32", "fp32")
    assert (ckpt["run"]["master"], ckpt["run"]["moments"]) == (master, moments)
    keys = leaves(ckpt["stepper"]["optimizer"])
    if api == "functional":
        assert ckpt["stepper"]["optimizer"]["precision"]["master"] == master
        assert any(key.endswith("/correction") for key in keys) == compact
    else:  # apex's format, in FP32 terms whatever the precision, with the core's count
        assert "/applied_steps" in keys
        assert not any(key.endswith("/correction") for key in keys)


@pytest.mark.parametrize("api", APIS)
def test_a_resumed_run_keeps_the_checkpoints_precision_unless_told_otherwise(
    capsys, tmp_path, api
) -> None:
    """Resuming a compact checkpoint without --masters or --moments once converted it to FP32
    masters and moments without a word (the flags defaulted to fp32), and the next save stored
    FP32 state. Left out, a flag keeps the checkpoint's; given, it alone converts."""
    path = str(tmp_path / "ck.pt")
    common = ("--api", api, "--limit", "64")  # not --quiet: the log lines say what happened
    assert train_cli(capsys, *common, *COMPACT, "--epochs", "1", "--save", path)[0] == 0
    code, out, err = train_cli(capsys, *common, "--epochs", "2", "--resume", path, "--save", path)
    assert code == 0, err
    assert "compensated master, int8 moments" in out  # the label of the state it trained
    assert "converted" not in err
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["epoch"] == 2
    assert (ckpt["run"]["master"], ckpt["run"]["moments"]) == ("compensated", "int8")
    keys = leaves(ckpt["stepper"]["optimizer"])
    if api == "functional":
        stored = ckpt["stepper"]["optimizer"]["precision"]
        assert (stored["master"], stored["moments"]) == ("compensated", "int8")
        assert any(key.endswith("/correction") for key in keys)
    else:
        assert "/applied_steps" in keys
    # One flag given: it converts its part; the other part stays the checkpoint's.
    code, out, err = train_cli(
        capsys, *common, "--moments", "fp32", "--epochs", "3", "--resume", path, "--save", path
    )
    assert code == 0, err
    assert "compensated master; " in out and "int8" not in out
    assert "--moments int8 to --masters compensated --moments fp32" in err
    ckpt = torch.load(path, weights_only=True)
    assert (ckpt["run"]["master"], ckpt["run"]["moments"]) == ("compensated", "fp32")


def test_functional_checkpoint_weights_load_into_a_plain_module(capsys, tmp_path) -> None:
    path = str(tmp_path / "ck.pt")
    assert train_cli(capsys, "--api", "functional", "--epochs", "1", "--save", path, *SMALL)[0] == 0
    ckpt = torch.load(path, weights_only=True)
    model = to_half(build_model("cnn", 1, 10))
    model.load_state_dict(ckpt["stepper"]["model"])  # strict: every key, every shape
    optimizer = ckpt["stepper"]["optimizer"]  # fp16fx.state_dict: keyed like the model
    trained = {name for name, p in model.named_parameters()}
    assert optimizer["format"] == "fp16fx.state/1" and set(optimizer["params"]) == trained


# --- --save replaces no file but the checkpoint the run continues ---------------------------


def test_save_refuses_a_file_it_would_replace_before_anything_loads(
    capsys, tmp_path, monkeypatch
) -> None:
    """--save once replaced whatever its path held without a word: a 2-epoch checkpoint by a
    1-epoch one (the same command without --resume), a text file by a zip. Such a path is
    refused before the data loads (or any process starts), in one line naming the file, what
    it holds and what to do -- ``--resume`` only where resuming would work; the file stays
    as it was."""
    monkeypatch.setattr(session, "load_dataset", lambda *args: pytest.fail("the data loaded"))
    monkeypatch.setattr(command, "launch", lambda *args: pytest.fail("processes started"))
    ck, notes, other = tmp_path / "ck1.pt", tmp_path / "notes.txt", tmp_path / "other.pt"
    link, hard, empty = tmp_path / "latest.pt", tmp_path / "hard.pt", tmp_path / "empty.pt"
    steps: dict = {"step_loss": [], "step_loss_scale": [], "step_skipped": []}
    history = {"epochs": [{"steps": 0}] * 2, **steps}  # the two epochs' (none saved)
    parts = {"format": checkpoint.FORMAT, "epoch": 2, "stepper": {}, "rng": {}, "history": history}
    save_atomic({**parts, "run": {}}, str(ck))
    save_atomic({**parts, "run": {"fsdp": True}}, str(other))
    notes.write_text("my notes\n")
    link.symlink_to(ck.name)
    os.link(ck, hard)
    empty.touch()
    before = {path: path.read_bytes() for path in (ck, notes, other)}
    held = "holds this run's checkpoint at epoch 2, which this run would replace"
    for argv, said in [
        (
            ("--epochs", "1", "--save", str(ck)),
            f"--save {ck} {held}: pass --resume {ck} with more than --epochs 2 to train it",
        ),
        (("--epochs", "3", "--save", str(link)), f"--save {link} {held}: pass --resume {link} to"),
        (("--nproc-per-node", "2", "--epochs", "3", "--save", str(ck)), f"{held}: pass --resume"),
        (("--save", str(other)), f"--save {other} holds a checkpoint of another run (checkpoint"),
        (
            ("--resume", str(ck), "--save", str(notes)),
            f"--save {notes} exists and is no checkpoint",
        ),
    ]:
        code, out, err = train_cli(capsys, *argv, *SMALL)
        line = one_line(err)
        assert code == 1 and out == "" and said in line, line
        assert line.endswith(" remove it, or choose another --save path"), line
    assert {path: path.read_bytes() for path in (ck, notes, other)} == before
    # The checkpoint the run resumes is the one file it replaces, also through a link, and
    # an empty file (mktemp's) holds nothing to lose.
    run = TrainConfig().identity()
    checkpoint.check_new(str(ck), str(ck), run, 3)
    checkpoint.check_new(str(link), str(tmp_path / "." / "ck1.pt"), run, 3)
    checkpoint.check_new(str(hard), str(ck), run, 3)
    checkpoint.check_new(str(tmp_path / "new.pt"), None, run, 3)
    checkpoint.check_new(str(empty), None, run, 3)


def test_a_malformed_recorded_precision_is_named(capsys, tmp_path, saved) -> None:
    """A checkpoint whose run records a precision that does not exist once resumed into a
    ValueError traceback from the stepper."""
    for key, value in (("master", "bogus"), ("moments", None)):
        ckpt = torch.load(saved, weights_only=True)
        ckpt["run"][key] = value
        bad = str(tmp_path / "bad.pt")
        torch.save(ckpt, bad)
        code, _, err = train_cli(
            capsys, "--api", "functional", "--epochs", "2", "--resume", bad, *SMALL
        )
        assert code == 1 and f"its run's {key} is {value!r}" in one_line(err), err


# --- bad checkpoints: one line, nothing trained ---------------------------------------------


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fp16fx train: error: ")
    return lines[0]


@pytest.fixture
def saved(capsys, tmp_path) -> str:
    """A functional-API checkpoint after one short epoch."""
    path = str(tmp_path / "ck.pt")
    assert train_cli(capsys, "--api", "functional", "--epochs", "1", "--save", path, *SMALL)[0] == 0
    return path


def test_a_saved_checkpoint_keeps_the_mode_of_the_file_it_replaces(tmp_path) -> None:
    """A checkpoint was once always written 0600 (mkstemp's), whatever the umask."""
    path = tmp_path / "ck.pt"
    save_atomic({"epoch": 1}, str(path))
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    path.chmod(0o640)
    save_atomic({"epoch": 2}, str(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert torch.load(path, weights_only=True)["epoch"] == 2


def test_malformed_checkpoint_fields_are_named(capsys, tmp_path, saved) -> None:
    """A wrong type once ended in a TypeError or AttributeError traceback."""
    for key, value, said in [
        ("epoch", "1", "its 'epoch' is '1'"),
        ("epoch", None, "its 'epoch' is None"),
        ("epoch", -1, "its 'epoch' is -1"),
        ("run", [1, 2], "its 'run' is not a dict (list)"),
        ("history", 3, "its 'history' is not a dict (int)"),
        # The loop resumes after the history's last epoch: once silently another than 'epoch'
        ("epoch", 2, "its 'history' holds 1 epoch(s), its 'epoch' says 2"),
        ("history.step_loss", [], "its history's 'step_loss' holds 0 values, its epochs"),
    ]:
        ckpt = torch.load(saved, weights_only=True)
        held, name = (ckpt["history"], key[8:]) if key.startswith("history.") else (ckpt, key)
        held[name] = value
        bad = str(tmp_path / "bad.pt")
        torch.save(ckpt, bad)
        code, _, err = train_cli(capsys, "--api", "functional", "--epochs", "3", "--resume", bad)
        assert code == 1 and f"checkpoint {bad} is malformed: {said}" in one_line(err)


def test_a_checkpoint_path_is_checked_by_writing(tmp_path) -> None:
    """The check makes a new --save's directories and a file named like the save's temporary
    one, which it removes: what the file system refuses shows before training."""
    checkpoint.check_writable(str(tmp_path / "new" / "sub" / "ck.pt"))
    assert os.listdir(tmp_path / "new" / "sub") == []
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="it exists and is not a regular file"):
        checkpoint.check_writable(str(fifo))  # a save would have replaced it
    # 242 bytes fit a name, but not its temporary file's, 14 longer (255 at most): such a
    # name once failed only when the first epoch's save did.
    with pytest.raises(CheckpointError, match="File name too long"):
        checkpoint.check_writable(str(tmp_path / ("L" * 239 + ".pt")))
    save_atomic({"epoch": 1}, str(tmp_path / ("L" * 238 + ".pt")))  # the longest that fits


def test_an_unreadable_or_foreign_file_is_named_as_such(tmp_path, monkeypatch, saved) -> None:
    """Bytes that are no pickle were once said to hold Python objects (torch wraps every
    unpickling error of a weights-only load alike), an unreadable file to be corrupted, and
    a truncated checkpoint to be unreadable (torch's reader raises OSError on a short one)."""
    data = pathlib.Path(saved).read_bytes()
    for name, head in [
        ("json.pt", b'{"a": 1}'),
        ("image.png", b"\x89PNG\r\n\x1a\n" * 8),
        *((f"cut{n}.pt", data[:n]) for n in (100, 4104, 5000, len(data) - 1)),
    ]:
        path = tmp_path / name
        path.write_bytes(head)
        with pytest.raises(CheckpointError, match=r"is corrupted or not a torch checkpoint"):
            load_checkpoint(str(path), {})
    fifo = str(tmp_path / "fifo.pt")
    os.mkfifo(fifo)
    refused = []  # in a thread: opened for reading, a pipe blocks until a writer comes
    reader = threading.Thread(target=lambda: refused.append(_refusal(fifo)), daemon=True)
    reader.start()
    reader.join(timeout=30)
    assert refused == [f"checkpoint {fifo} is not a regular file"]

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(checkpoint, "open", denied, raising=False)  # the file, not torch
    with pytest.raises(CheckpointError, match=r"^cannot read checkpoint .*: Permission denied$"):
        load_checkpoint(str(tmp_path / "json.pt"), {})


def _refusal(path: str) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, {})
    return str(info.value)


class _RunsACommand:
    def __reduce__(self):
        return (os.system, ("true",))


def test_a_checkpoint_that_does_not_fit_creates_no_save_directory(capsys, tmp_path, saved):
    """--save's directory was once made before the checkpoint's state was found not to fit."""
    ckpt = torch.load(saved, weights_only=True)
    ckpt["stepper"] = {}
    bad = str(tmp_path / "bad.pt")
    torch.save(ckpt, bad)
    new = tmp_path / "new"
    argv = ["--api", "functional", "--epochs", "2", "--resume", bad, *SMALL]
    code, _, err = train_cli(capsys, *argv, "--save", str(new / "ck.pt"))
    assert code == 1 and "the checkpoint does not fit this run" in one_line(err)
    assert not new.exists()


def test_a_pickle_of_objects_is_refused_without_torchs_unsafe_advice(capsys, tmp_path) -> None:
    for name, value in [("objects.pt", datetime.date(2026, 1, 1)), ("evil.pt", _RunsACommand())]:
        path = str(tmp_path / name)
        torch.save({"value": value}, path)
        code, _, err = train_cli(capsys, "--resume", path)
        line = one_line(err)
        assert code == 1 and "holds Python objects other than tensors" in line
        assert "weights_only set to False" not in line
    # Cut short, an old-format (non-zip) file names a cut-off global: corrupted, not objects.
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(100)}, legacy, _use_new_zipfile_serialization=False)
    data = legacy.read_bytes()
    for n in range(1, len(data), 7):
        legacy.write_bytes(data[:n])
        with pytest.raises(CheckpointError, match="is corrupted or not a torch checkpoint"):
            load_checkpoint(str(legacy), {})


def test_what_the_first_save_would_meet_is_refused_by_the_check(tmp_path, monkeypatch) -> None:
    """Found by doing it, or by what the kernel would refuse: a file another user owns in a
    sticky directory (/tmp) cannot be replaced; a directory where files cannot be removed
    (append-only) fails the save's rename too."""
    sticky = tmp_path / "shared"
    sticky.mkdir()
    sticky.chmod(0o1777)
    theirs = sticky / "ck.pt"
    theirs.write_bytes(b"another user's")
    os.chown(theirs, 4321, 4321)
    monkeypatch.setattr(os, "geteuid", lambda: 1234)  # not root, not the owner
    with pytest.raises(CheckpointError, match="belongs to another user"):
        checkpoint.check_writable(str(theirs))
    monkeypatch.undo()

    def refuse(path, *args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "unlink", refuse)
    with pytest.raises(CheckpointError, match="Operation not permitted"):
        checkpoint.check_writable(str(tmp_path / "append-only" / "ck.pt"))


def test_an_interrupted_save_leaves_no_temporary_file(tmp_path, monkeypatch) -> None:
    save_atomic({"epoch": 1}, str(tmp_path / "ck.pt"))
    real_open = os.open

    def interrupted(*args, **kwargs):  # as the temporary file was opened, before its use
        os.close(real_open(*args, **kwargs))
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "open", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_atomic({"epoch": 2}, str(tmp_path / "ck.pt"))
    monkeypatch.undo()
    assert leftovers(tmp_path) == []
    assert torch.load(tmp_path / "ck.pt", weights_only=True)["epoch"] == 1


def test_a_checkpoint_saved_through_a_link_keeps_the_link(tmp_path) -> None:
    target, link = tmp_path / "run3.pt", tmp_path / "latest.pt"
    save_atomic({"epoch": 1}, str(target))
    link.symlink_to(target.name)
    save_atomic({"epoch": 2}, str(link))
    assert link.is_symlink() and torch.load(target, weights_only=True)["epoch"] == 2


def test_an_interrupt_before_any_save_says_nothing_was_saved(
    capsys, tmp_path, monkeypatch, saved
) -> None:
    """The message once named --save's file as the last checkpoint, although no epoch had
    finished to write it."""

    def interrupt(stepper, batches):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "evaluate", interrupt)
    fresh = str(tmp_path / "fresh.pt")
    code, _, err = train_cli(capsys, "--api", "functional", "--save", fresh, *SMALL)
    assert code == 130 and f"no epoch finished, so nothing was saved to {fresh}" in err
    assert not os.path.exists(fresh)
    code, _, err = train_cli(
        capsys, "--api", "functional", "--epochs", "2", "--resume", saved, "--save", saved, *SMALL
    )
    assert code == 130 and f"{saved} is the last checkpoint" in err
    # Under torchrun, a rank other than 0 saves nothing and cannot see what rank 0 saved.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    config = command.config_from_args(cli.build_parser().parse_args(["train", "--save", fresh]))
    assert command._last_checkpoint(config, None) == ""


def test_corrupted_checkpoint_is_refused(capsys, tmp_path, saved) -> None:
    with open(saved, "rb") as f:
        data = f.read()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(data[: len(data) // 2])
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"this is not a checkpoint" * 10)
    for bad in (truncated, garbage):
        code, out, err = train_cli(capsys, "--api", "functional", "--resume", str(bad))
        assert code == 1 and out == ""
        assert f"checkpoint {bad} is corrupted or not a torch checkpoint" in one_line(err)


def test_checkpoint_of_another_run_is_refused(capsys, saved) -> None:
    code, _, err = train_cli(capsys, "--api", "facade", "--resume", saved)
    assert code == 1
    assert "was written with --api functional, this run has facade" in one_line(err)
    code, _, err = train_cli(
        capsys, "--api", "functional", "--model", "resnet18", "--resume", saved
    )
    assert "was written with --model cnn, this run has resnet18" in one_line(err)
    # A resumed run continues the checkpoint's random streams: another seed would be ignored.
    code, _, err = train_cli(capsys, "--api", "functional", "--seed", "5", "--resume", saved)
    assert code == 1 and "was written with --seed 0, this run has 5" in one_line(err)
    # Every difference at once, not the first alone
    code, _, err = train_cli(capsys, "--seed", "5", "--resume", saved, *SMALL, "--lr", "0.01")
    assert code == 1 and (
        "was written with --api functional, this run has facade; with --seed 0, this run has "
        "5; with --lr 0.003, this run has 0.01" in one_line(err)
    )
    # ...and its loss-scale state: the facade once printed the new scale and ran the old one.
    code, _, err = train_cli(
        capsys, "--api", "functional", "--loss-scale", "128", "--resume", saved
    )
    assert code == 1 and "was written with --loss-scale dynamic, this run has 128" in one_line(err)
    # Other batches, or another learning rate at every step, would quietly change the run it
    # continues; the defaults are compared as the values they stand for.
    for flags, message in (
        ((), "was written with --limit 160: resume it with --limit 160"),
        (("--batch-size", "16", *SMALL), "was written with --batch-size 32, this run has 16"),
        (("--lr", "0.01", *SMALL), "was written with --lr 0.003, this run has 0.01"),
        (("--lr-schedule", "constant", *SMALL), "--lr-schedule cosine, this run has constant"),
        (("--limit", "320", "--quiet"), "was written with --limit 160, this run has 320"),
    ):
        code, _, err = train_cli(capsys, "--api", "functional", *flags, "--resume", saved)
        assert code == 1 and message in one_line(err)
    # A value equal to the default is the default.
    code, _, err = train_cli(
        capsys, "--api", "functional", "--epochs", "2", "--resume", saved, *SMALL,
        "--batch-size", "32", "--lr", "3e-3", "--lr-schedule", "cosine",
    )  # fmt: skip
    assert code == 0, err
    # A checkpoint written before its run recorded them: not compared.
    older = torch.load(saved, weights_only=True)
    for key in ("batch_size", "lr", "lr_schedule", "limit"):
        del older["run"][key]
    torch.save(older, saved)
    code, _, err = train_cli(
        capsys, "--api", "functional", "--epochs", "2", "--resume", saved, "--limit", "96",
        "--quiet", "--batch-size", "16", "--lr", "0.01", "--lr-schedule", "constant",
    )  # fmt: skip
    assert code == 0, err
    # An --epochs the checkpoint has done already once ran nothing and saved nothing.
    code, _, err = train_cli(
        capsys, "--api", "functional", "--epochs", "1", "--resume", saved, *SMALL
    )
    assert code == 1 and "has 1 epochs done: --epochs 1 leaves none to train" in one_line(err)


def test_foreign_torch_file_is_refused(capsys, tmp_path) -> None:
    path = str(tmp_path / "weights.pt")
    torch.save({"state_dict": {"w": torch.ones(2)}}, path)
    code, _, err = train_cli(capsys, "--resume", path)
    assert code == 1 and "is not an fp16fx train checkpoint" in one_line(err)


def test_checkpoint_with_a_misshapen_tensor_names_it(capsys, tmp_path, saved) -> None:
    ckpt = torch.load(saved, weights_only=True)
    params = ckpt["stepper"]["optimizer"]["params"]
    path = next(path for path, entry in params.items() if entry["master"].dim() == 4)
    params[path]["opt[1].mu"] = torch.zeros(3, 3)
    bad = str(tmp_path / "bad.pt")
    torch.save(ckpt, bad)
    code, _, err = train_cli(capsys, "--api", "functional", "--resume", bad, *SMALL)
    line = one_line(err)
    assert code == 1 and f"['params'][{path!r}]['opt[1].mu']" in line and "(3, 3)" in line


def test_load_checkpoint_checks_every_identity_field(tmp_path) -> None:
    path = str(tmp_path / "ck.pt")
    run = {"model": "cnn", "dataset": "digits", "api": "facade"}
    history = {"epochs": [{"steps": 0}], "step_loss": [], "step_loss_scale": [], "step_skipped": []}
    empty = {"stepper": {}, "rng": {}, "history": history}
    save_atomic({"format": checkpoint.FORMAT, "run": run, "epoch": 1, **empty}, path)
    assert load_checkpoint(path, run)["epoch"] == 1
    with pytest.raises(CheckpointError, match="--dataset digits, this run has fake"):
        load_checkpoint(path, {**run, "dataset": "fake"})
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(str(tmp_path / "nope.pt"), run)
