"""The classic apex-era recipe: ResNet-18 on CIFAR-10 in FP16 with FP16_Optimizer, corrected.

A blog-post script for ``apex.fp16_utils`` was copied widely; as published it does not run:

* ``transforms.Compose[...]`` is a typo for ``transforms.Compose([...])``;
* ``models.resnet18(pretrained=True)`` downloads ImageNet weights (and has 1000 outputs):
  CIFAR-10 wants ``weights=None, num_classes=10``;
* ``optimizer.update()`` does not exist in apex (fp16fx accepts it as an alias of ``step()``).

This is that script fixed, on fp16fx. It trains on a local CIFAR-10 copy (``--data-dir DIR``,
torchvision's format; nothing is downloaded) or, by default, on a few FakeData images so that it
runs anywhere in seconds (FP16 convolutions on a CPU are slow: keep it small there).

Run: ``python examples/resnet18_cifar10.py [--data-dir DIR] [--epochs 1] [--fake-size 32]``.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torchvision
import torchvision.transforms as transforms
from torch import nn
from torchvision import models

import fp16fx
from fp16fx.fp16_utils import network_to_half


def datasets(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[torch.utils.data.Dataset, ...]:
    """Returns (train, test) data sets: CIFAR-10 from ``--data-dir``, else small FakeData."""
    normalize = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    # Fixed: Compose takes a list -- the original read ``transforms.Compose[...]``.
    train_tf = transforms.Compose(
        [
            transforms.RandomCrop(32, padding=4),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            normalize,
        ]
    )
    test_tf = transforms.Compose([transforms.ToTensor(), normalize])
    if args.data_dir is not None:
        # download=False: fp16fx examples never fetch anything.
        try:
            train = torchvision.datasets.CIFAR10(args.data_dir, train=True, transform=train_tf)
            test = torchvision.datasets.CIFAR10(args.data_dir, train=False, transform=test_tf)
        except RuntimeError:  # torchvision's "Dataset not found or corrupted": says download
            parser.error(
                f"--data-dir {args.data_dir} holds no CIFAR-10 that torchvision can read (its "
                "cifar-10-batches-py folder); this example downloads nothing"
            )
        return train, test
    fake = torchvision.datasets.FakeData
    train = fake(args.fake_size, (3, 32, 32), 10, transform=train_tf, random_offset=0)
    test = fake(args.fake_size // 2, (3, 32, 32), 10, transform=test_tf, random_offset=10**6)
    return train, test


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", help="a local CIFAR-10 (torchvision format)")
    parser.add_argument("--fake-size", type=int, default=32, help="FakeData training images")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")
    for name in ("batch_size", "fake_size"):  # BatchNorm trains on 2 or more images a batch
        if getattr(args, name) < 2:
            parser.error(f"--{name.replace('_', '-')} must be >= 2, got {getattr(args, name)}")
    if not (math.isfinite(args.lr) and args.lr >= 0):  # fp16fx's rule for lr: 0 stands still
        parser.error(f"--lr must be a finite number >= 0, got {args.lr}")
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    train_set, test_set = datasets(args, parser)
    lone = len(train_set) % args.batch_size == 1  # a last batch of one: BatchNorm refuses it
    train_loader = torch.utils.data.DataLoader(
        train_set, args.batch_size, shuffle=True, drop_last=lone
    )
    test_loader = torch.utils.data.DataLoader(test_set, args.batch_size)

    # Fixed: no pretrained weights (nothing downloaded), 10 classes for CIFAR-10.
    model = models.resnet18(weights=None, num_classes=10).to(device)
    # FP16 weights, BatchNorm kept in FP32, inputs cast to FP16 by a leading layer.
    model = network_to_half(model)

    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    # FP32 master weights + dynamic loss scaling; apex's static_loss_scale=128.0 works too.
    optimizer = fp16fx.FP16_Optimizer(optimizer, dynamic_loss_scale=True)

    for epoch in range(args.epochs):
        model.train()
        start, skipped, total_loss = time.perf_counter(), 0, 0.0
        for inputs, labels in train_loader:
            inputs, labels = inputs.to(device), labels.to(device)
            optimizer.zero_grad()
            outputs = model(inputs)
            loss = criterion(outputs.float(), labels)  # the loss in FP32
            optimizer.backward(loss)  # scales the loss and backprops; step() unscales and checks
            # Fixed: the original called optimizer.update(), which apex never had; step() it
            # is (fp16fx also accepts update() as an alias). An overflowing step is skipped.
            optimizer.step()
            skipped += int(optimizer.overflow)
            total_loss += loss.item()
        print(
            f"epoch {epoch + 1}/{args.epochs}: loss {total_loss / len(train_loader):.4f}, "
            f"{skipped} skipped steps, loss scale {optimizer.loss_scale:g}, "
            f"{time.perf_counter() - start:.1f} s"
        )

    model.eval()
    correct = 0
    with torch.no_grad():
        for inputs, labels in test_loader:
            outputs = model(inputs.to(device))
            correct += (outputs.argmax(1) == labels.to(device)).sum().item()
    print(f"test accuracy {100 * correct / len(test_set):.1f}% on {len(test_set)} images")


if __name__ == "__main__":
    main()
