"""Tests of ``fp16fx train``'s parts: data sets, batches, models, schedule, report, plotting."""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import sys

import numpy as np
import pytest
import torch

from fp16fx.train import data as train_data
from fp16fx.train.data import DataError, ImageBatches, Split, TrainTestData, load_dataset
from fp16fx.train.loop import EpochRecord, History, learning_rate
from fp16fx.train.models import ModelError, build_model, to_half
from fp16fx.train.report import PlotError, RunSummary, check_plotting, format_summary, save_plot

# --- data ----------------------------------------------------------------------------------


def test_digits_split_is_fixed_stratified_and_disjoint() -> None:
    a, b = load_dataset("digits"), load_dataset("digits")
    assert (len(a.train), len(a.test)) == (1437, 360)
    assert torch.equal(a.test.images, b.test.images) and torch.equal(a.test.labels, b.test.labels)
    assert a.train.images.shape[1:] == (1, 8, 8) and a.train.images.dtype == torch.uint8
    assert torch.bincount(a.test.labels, minlength=10).min() >= 35  # every class, ~36 each
    train_rows = {tuple(x.flatten().tolist()) for x in a.train.images}
    overlap = sum(tuple(x.flatten().tolist()) in train_rows for x in a.test.images)
    assert overlap <= 3  # distinct images (a few digits are pixel-identical duplicates)


def test_unknown_dataset_names_the_choices() -> None:
    with pytest.raises(DataError, match=r"unknown dataset 'mnist'.*digits, cifar10, fake"):
        load_dataset("mnist")


def test_cifar10_without_a_local_copy_says_where_to_put_it(tmp_path) -> None:
    with pytest.raises(DataError, match="nothing is downloaded"):
        load_dataset("cifar10")
    with pytest.raises(DataError) as err:
        load_dataset("cifar10", str(tmp_path))
    message = str(err.value)
    assert os.path.join(str(tmp_path), "cifar-10-batches-py") in message
    assert "never downloads" in message and "\n" not in message
    assert not os.listdir(tmp_path)  # nothing was fetched or created


def _write_fake_cifar10(root, n_per_batch: int = 4) -> np.ndarray:
    """Writes a tiny CIFAR-10 in torchvision's on-disk format; returns the first train batch."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    first = None
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        pixels = rng.integers(0, 256, size=(n_per_batch, 3 * 32 * 32), dtype=np.uint8)
        first = pixels if first is None else first
        entry = {"data": pixels, "labels": list(rng.integers(0, 10, n_per_batch))}
        (folder / name).write_bytes(pickle.dumps(entry))
    meta = {"label_names": [f"c{i}" for i in range(10)]}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta))
    return first


def test_cifar10_local_copy_is_read_as_nchw_uint8(tmp_path, monkeypatch) -> None:
    from torchvision.datasets import cifar

    first = _write_fake_cifar10(tmp_path)
    # The fake files cannot match CIFAR-10's md5 sums: accept them.
    monkeypatch.setattr(cifar, "check_integrity", lambda path, md5=None: os.path.isfile(path))
    data = load_dataset("cifar10", str(tmp_path))
    assert (len(data.train), len(data.test), data.in_channels) == (20, 4, 3)
    assert data.train.images.dtype == torch.uint8
    # CIFAR-10 rows are the R plane, then G, then B, each 32x32 row-major: that is NCHW.
    assert torch.equal(data.train.images[0], torch.from_numpy(first[0].reshape(3, 32, 32)))
    assert data.augment


def test_fake_data_is_deterministic_and_disjoint() -> None:
    a, b = load_dataset("fake"), load_dataset("fake")
    assert a.train.images.shape == (train_data.FAKE_TRAIN_SIZE, 3, 32, 32)
    assert torch.equal(a.train.images, b.train.images)
    train = {image.numpy().tobytes() for image in a.train.images}
    assert not any(image.numpy().tobytes() in train for image in a.test.images)


def _tiny_data(n: int = 10, augment: bool = False) -> TrainTestData:
    images = torch.arange(n * 3 * 8 * 8, dtype=torch.int64).remainder(256).to(torch.uint8)
    split = Split(images.view(n, 3, 8, 8), torch.arange(n) % 10)
    return TrainTestData("tiny", split, split, 10, (0.5,) * 3, (0.25,) * 3, augment)


def test_training_batches_are_full_shuffled_and_reproducible() -> None:
    data = _tiny_data(10)
    batches = ImageBatches(data.train, data, 4, torch.device("cpu"), torch.Generator())
    assert len(batches) == 2  # the last 2 examples of the epoch's order are dropped
    first = [y.tolist() for _, y in batches]
    assert all(len(y) == 4 for y in first) and len({i for y in first for i in y}) == 8
    again = ImageBatches(data.train, data, 4, torch.device("cpu"), torch.Generator())
    assert [y.tolist() for _, y in again] == first  # same seed, same order
    assert [y.tolist() for _, y in batches] != first  # the next epoch is reshuffled


def test_eval_batches_cover_the_split_in_order_and_normalise() -> None:
    data = _tiny_data(10)
    batches = ImageBatches(data.test, data, 4, torch.device("cpu"))
    assert len(batches) == 3
    xs, ys = zip(*batches)
    assert torch.cat(ys).tolist() == data.test.labels.tolist()
    x = torch.cat(xs)
    assert x.dtype == torch.float32
    expected = (data.test.images.float() / 255 - 0.5) / 0.25
    torch.testing.assert_close(x, expected)


def test_augmentation_crops_a_padded_shift_and_flips() -> None:
    images = torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8)
    out = train_data._random_crop_flip(images, torch.Generator().manual_seed(1), padding=2)
    assert out.shape == images.shape and out.dtype == images.dtype
    padded = torch.nn.functional.pad(images, (2, 2, 2, 2))
    for img, aug in zip(padded, out):
        candidates = [
            win
            for dy in range(5)
            for dx in range(5)
            for win in (img[:, dy : dy + 8, dx : dx + 8], img[:, dy : dy + 8, dx : dx + 8].flip(2))
        ]
        assert any(torch.equal(aug, c) for c in candidates)
    assert not torch.equal(out, images)  # some image moved


# --- models --------------------------------------------------------------------------------


def test_models_build_for_any_channels_and_convert_to_half_with_fp32_batchnorm() -> None:
    for name in ("cnn", "resnet18"):
        model = to_half(build_model(name, in_channels=1, num_classes=10))
        dtypes = {type(m).__name__: p.dtype for m in model.modules() for p in m.parameters(False)}
        assert dtypes["BatchNorm2d"] == torch.float32
        assert dtypes["Conv2d"] == torch.float16
        out = model(torch.randn(2, 1, 8, 8))
        assert out.shape == (2, 10) and out.dtype == torch.float16


def test_unknown_model_names_the_choices() -> None:
    with pytest.raises(ModelError, match=r"unknown model 'vgg'.*cnn, resnet18"):
        build_model("vgg", 3, 10)


# --- schedule ------------------------------------------------------------------------------


def test_cosine_schedule_starts_at_base_and_decays_to_zero() -> None:
    assert learning_rate(0.1, "cosine", 0, 100) == 0.1
    assert learning_rate(0.1, "cosine", 50, 100) == pytest.approx(0.05)
    assert learning_rate(0.1, "cosine", 99, 100) < 1e-4
    lrs = [learning_rate(0.1, "cosine", s, 100) for s in range(100)]
    assert lrs == sorted(lrs, reverse=True)
    assert learning_rate(0.1, "constant", 99, 100) == 0.1
    with pytest.raises(ValueError, match="cosine, constant"):
        learning_rate(0.1, "step", 0, 10)


# --- report --------------------------------------------------------------------------------


def _history(acc: float, scale: float, skipped: list[bool]) -> History:
    steps = len(skipped)
    return History(
        step_loss=[1.0 / (i + 1) for i in range(steps)],
        step_loss_scale=[scale] * steps,
        step_skipped=skipped,
        epochs=[EpochRecord(1, 0.5, acc, scale, sum(skipped), steps, 32 * steps, 2.0, 2.5)],
    )


def test_summary_table_has_one_column_per_run() -> None:
    fp16 = RunSummary("FP16", "facade", _history(0.975, 32768.0, [False, True, False, False]))
    fp32 = RunSummary("FP32", "torch", _history(0.98, math.nan, [False] * 4))
    text = format_summary("title", [fp16, fp32])
    rows = {line[:16].strip(): line[16:].split() for line in text.splitlines()[4:9]}
    assert rows["test accuracy"] == ["97.50%", "98.00%"]
    assert rows["images/s"] == ["64", "64"]
    assert rows["steps skipped"] == ["1", "/", "4", "0", "/", "4"]
    assert rows["final loss scale"] == ["32768", "-"]
    assert rows["wall time"] == ["2.5", "s", "2.5", "s"]
    assert "FP16: facade" in text and "FP32: torch" in text


def test_history_round_trips_through_primitives() -> None:
    h = _history(0.9, 128.0, [False, True])
    again = History.from_dict(h.to_dict())
    assert again == h
    assert (again.steps, again.skipped, again.final_loss_scale) == (2, 1, 128.0)


def test_each_epochs_steps_spread_over_that_epoch_on_the_plots_axis() -> None:
    """A run resumed on two processes took 8 steps, then 4 per epoch: the plot put them at
    i / (12 // 2), epoch 1's last step past 1 and epoch 2's inside [1.33, 1.83]."""
    h = _history(0.9, 128.0, [False] * 8)
    h.epochs.append(dataclasses.replace(h.epochs[0], epoch=2, steps=4))
    h.step_loss += [0.1] * 4
    assert h.step_epochs == [j / 8 for j in range(8)] + [1 + j / 4 for j in range(4)]
    assert len(h.step_epochs) == h.steps


def test_the_plot_draws_each_step_where_its_epoch_is(tmp_path, monkeypatch) -> None:
    import matplotlib.axes

    h = _history(0.9, 128.0, [False] * 8)
    h.epochs.append(dataclasses.replace(h.epochs[0], epoch=2, steps=4))
    h.step_loss += [0.1] * 4
    h.step_loss_scale += [128.0] * 4
    drawn = []
    plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(
        matplotlib.axes.Axes, "plot", lambda ax, x, *a, **k: drawn.append(x) or plot(ax, x, *a, **k)
    )
    save_plot(str(tmp_path / "curves.png"), [RunSummary("FP16", "facade", h)])
    assert drawn == [h.step_epochs, [1, 2], h.step_epochs]  # loss, accuracy, loss scale


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(PlotError, match=r"pip install 'fp16fx\[plot\]'"):
        check_plotting("curves.png")


def test_plot_writes_an_image(tmp_path) -> None:
    path = str(tmp_path / "curves.png")
    runs = [
        RunSummary("FP16", "facade", _history(0.9, 128.0, [False, True])),
        RunSummary("FP32", "torch", _history(0.9, math.nan, [False, False])),
    ]
    save_plot(path, runs)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(PlotError, match=r"\.png, \.pdf or \.svg"):
        check_plotting(str(tmp_path / "curves.txt"))
