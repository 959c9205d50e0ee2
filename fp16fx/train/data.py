"""Data sets for ``fp16fx train``: in-memory image tensors and a seeded batch iterator.

Every data set is loaded once into two uint8 tensors (images ``N x C x H x W`` and int64
labels) per split, so that a whole epoch's order and augmentation come from one
``torch.Generator``: saving that generator's state in a checkpoint is all it takes to resume
the exact same batches. Nothing here ever downloads anything.

Data sets:

* ``digits``: scikit-learn's bundled handwritten digits (1,797 8x8 grey images, 10 classes),
  split 80/20 with a fixed seed (stratified), so every run tests on the same 360 images.
* ``cifar10``: CIFAR-10 from a local copy in torchvision's format (``--data-dir``), with the
  usual random crop (padding 4) and horizontal flip on the training images.
* ``fake``: torchvision's ``FakeData`` (random 3x32x32 images, random labels): a smoke test of
  the machinery for any model, where accuracy means nothing.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator

import torch

from fp16fx.train.parallel import SINGLE, Processes

__all__ = [
    "DATASETS",
    "DataError",
    "DatasetSpec",
    "ImageBatches",
    "Split",
    "TrainTestData",
    "load_dataset",
]


class DataError(ValueError):
    """A data set cannot be loaded (unknown name, missing local copy); the message says why."""


@dataclasses.dataclass(frozen=True)
class Split:
    """One split of a data set held in memory.

    Attributes:
      images: uint8 tensor ``N x C x H x W`` (values 0..255).
      labels: int64 tensor ``N``.
    """

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def head(self, n: int | None) -> Split:
        """Returns the first ``n`` examples (all of them when ``n`` is None)."""
        if n is None:
            return self
        return Split(self.images[:n], self.labels[:n])


@dataclasses.dataclass(frozen=True)
class TrainTestData:
    """A data set's two splits and how to feed them to a model.

    Attributes:
      name: the data set's name in :data:`DATASETS`.
      train, test: the splits.
      num_classes: number of labels.
      mean, std: per-channel normalisation of images scaled to [0, 1].
      augment: whether training batches get random crops and flips.
    """

    name: str
    train: Split
    test: Split
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: bool = False

    @property
    def in_channels(self) -> int:
        return int(self.train.images.shape[1])


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """A data set's loader and the training defaults that suit it; ``local_copy``: whether it
    is read from ``--data-dir``."""

    load: Callable[[str | None], TrainTestData]
    description: str
    epochs: int
    batch_size: int
    lr: float
    local_copy: bool = False


#: Fixed seed of the digits train/test split: every run tests on the same images.
DIGITS_SPLIT_SEED = 0
FAKE_TRAIN_SIZE = 512
FAKE_TEST_SIZE = 128
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


def _load_digits(data_dir: str | None) -> TrainTestData:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    # Pixel values are 0..16: scale to 0..255 so every data set is uint8 in memory.
    images = torch.from_numpy(digits.images * (255.0 / 16.0)).round().to(torch.uint8)
    labels = torch.from_numpy(digits.target).long()
    train_idx, test_idx = train_test_split(
        range(len(labels)),
        test_size=0.2,
        random_state=DIGITS_SPLIT_SEED,
        stratify=digits.target,
    )
    train_idx, test_idx = torch.tensor(train_idx), torch.tensor(test_idx)
    images = images.unsqueeze(1)  # N x 1 x 8 x 8
    train = Split(images[train_idx], labels[train_idx])
    scaled = train.images.float() / 255.0
    return TrainTestData(
        name="digits",
        train=train,
        test=Split(images[test_idx], labels[test_idx]),
        num_classes=10,
        mean=(scaled.mean().item(),),
        std=(scaled.std().item(),),
    )


def _cifar10_split(root: str, train: bool) -> Split:
    from torchvision.datasets import CIFAR10

    dataset = CIFAR10(root, train=train, download=False)
    images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW
    return Split(images, torch.tensor(dataset.targets, dtype=torch.int64))


def _load_cifar10(data_dir: str | None) -> TrainTestData:
    if data_dir is None:
        raise DataError(
            "--dataset cifar10 needs --data-dir DIR holding torchvision's CIFAR-10 "
            "(DIR/cifar-10-batches-py/); nothing is downloaded"
        )
    try:
        train = _cifar10_split(data_dir, train=True)
        test = _cifar10_split(data_dir, train=False)
    except RuntimeError as exc:  # torchvision: "Dataset not found or corrupted."
        where = os.path.join(data_dir, "cifar-10-batches-py")
        raise DataError(
            f"CIFAR-10 not found (or corrupted) in {where}: extract cifar-10-python.tar.gz "
            f"from https://www.cs.toronto.edu/~kriz/cifar.html into {data_dir}; "
            "fp16fx never downloads anything"
        ) from exc
    return TrainTestData(
        name="cifar10",
        train=train,
        test=test,
        num_classes=10,
        mean=CIFAR10_MEAN,
        std=CIFAR10_STD,
        augment=True,
    )


def _fake_split(size: int, offset: int) -> Split:
    from torchvision.datasets import FakeData
    from torchvision.transforms import PILToTensor

    dataset = FakeData(
        size=size,
        image_size=(3, 32, 32),
        num_classes=10,
        transform=PILToTensor(),
        random_offset=offset,
    )
    images, labels = zip(*(dataset[i] for i in range(size)))
    return Split(torch.stack(images), torch.tensor(labels, dtype=torch.int64))


def _load_fake(data_dir: str | None) -> TrainTestData:
    return TrainTestData(
        name="fake",
        train=_fake_split(FAKE_TRAIN_SIZE, offset=0),
        test=_fake_split(FAKE_TEST_SIZE, offset=FAKE_TRAIN_SIZE),
        num_classes=10,
        mean=(0.5, 0.5, 0.5),
        std=(0.25, 0.25, 0.25),
    )


#: Data sets by name, with the defaults ``fp16fx train`` uses for them.
DATASETS: dict[str, DatasetSpec] = {
    "digits": DatasetSpec(
        _load_digits, "scikit-learn's 8x8 handwritten digits (bundled)", 6, 32, 3e-3
    ),
    "cifar10": DatasetSpec(
        _load_cifar10, "CIFAR-10 from a local copy (--data-dir)", 30, 128, 2e-3, local_copy=True
    ),
    "fake": DatasetSpec(_load_fake, "torchvision FakeData (random images)", 1, 32, 1e-3),
}


def load_dataset(name: str, data_dir: str | None = None) -> TrainTestData:
    """Returns the data set ``name`` of :data:`DATASETS`, loaded into memory.

    Raises:
      DataError: the name is unknown or the data set's local copy is missing.
    """
    spec = DATASETS.get(name)
    if spec is None:
        raise DataError(f"unknown dataset {name!r} (choose from: {', '.join(DATASETS)})")
    return spec.load(data_dir)


def _random_crop_flip(
    images: torch.Tensor, generator: torch.Generator, padding: int = 4, keep: slice = slice(None)
) -> torch.Tensor:
    """Returns ``images[keep]`` (``B x C x H x W``) randomly shifted by up to ``padding`` and
    flipped.

    The standard CIFAR augmentation, vectorised over the batch; the random draws come from
    ``generator`` (on the CPU) so that they are part of the resumable data order. They are
    drawn for all ``B`` images, whatever ``keep``: a process augments only its part of a global
    batch, exactly as the whole batch would be, and its generator stays in step.
    """
    b = images.shape[0]
    dy = torch.randint(0, 2 * padding + 1, (b,), generator=generator)[keep].to(images.device)
    dx = torch.randint(0, 2 * padding + 1, (b,), generator=generator)[keep].to(images.device)
    flip = torch.rand(b, generator=generator)[keep].to(images.device) < 0.5
    images = images[keep]
    b, _, h, w = images.shape
    padded = torch.nn.functional.pad(images, (padding,) * 4)
    rows = (dy[:, None] + torch.arange(h, device=images.device))[:, :, None]  # B x H x 1
    cols = (dx[:, None] + torch.arange(w, device=images.device))[:, None, :]  # B x 1 x W
    cols = torch.where(flip[:, None, None], cols.flip(2), cols)
    batch = torch.arange(b, device=images.device)[:, None, None]
    return padded.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2)


class ImageBatches:
    """An iterable of normalised ``(images, labels)`` batches of one split, on ``device``.

    Images come out as FP32 (a model converted with ``network_to_half`` casts them itself).
    With ``generator`` the order is shuffled and (if ``augment``) the images augmented from it,
    and only full batches are yielded (a fixed number of steps per epoch); without it the split
    is walked in order, the last batch possibly short (for evaluation).

    With several ``processes`` (data parallelism) each process yields its own disjoint part:
    in training, every step's *global* batch of ``batch_size * processes.size`` examples is
    drawn, shuffled and augmented exactly as one process with that batch size would, and this
    process keeps every ``size``-th example from its ``rank`` on (as ``DistributedSampler``
    strides), so the generator stays in step on every process; in evaluation, each process
    walks every ``size``-th example of the split.
    """

    def __init__(
        self,
        split: Split,
        data: TrainTestData,
        batch_size: int,
        device: torch.device,
        generator: torch.Generator | None = None,
        processes: Processes = SINGLE,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        self.split = split
        self.batch_size = batch_size
        self.device = device
        self.generator = generator
        self.processes = processes
        self.augment = data.augment and generator is not None
        shape = (1, -1, 1, 1)
        self._mean = torch.tensor(data.mean, device=device).view(shape)
        self._std = torch.tensor(data.std, device=device).view(shape)
        self._images = split.images.to(device)
        self._labels = split.labels.to(device)

    @property
    def global_batch_size(self) -> int:
        """The examples of one step over all processes: ``batch_size * processes.size``."""
        return self.batch_size * self.processes.size

    def __len__(self) -> int:
        n = len(self.split)
        if self.generator is not None:
            return n // self.global_batch_size
        mine = len(range(self.processes.rank, n, self.processes.size))
        return -(-mine // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n, rank, size = len(self.split), self.processes.rank, self.processes.size
        if self.generator is None:
            order = torch.arange(rank, n, size, device=self.device)
            step = self.batch_size
        else:
            order = torch.randperm(n, generator=self.generator).to(self.device)
            step = self.global_batch_size
        # In training, this process's part of each global batch; in evaluation, all of its own.
        mine = slice(None) if self.generator is None else slice(rank, None, size)
        for i in range(len(self)):
            idx = order[i * step : (i + 1) * step]
            if self.augment:
                assert self.generator is not None
                images = _random_crop_flip(self._images[idx], self.generator, keep=mine)
            else:
                images = self._images[idx[mine]]
            x = (images.float() / 255.0 - self._mean) / self._std
            yield x, self._labels[idx[mine]]
