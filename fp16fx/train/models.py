"""Models for ``fp16fx train``: a small CNN for the default run and torchvision's ResNet-18.

Models are built in FP32 from the global torch RNG (seed it first for reproducible weights)
and converted to FP16 by the caller (:func:`to_half`), which keeps affine BatchNorm in FP32 as
apex did. Nothing is ever downloaded: ResNet-18 starts from random weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from fp16fx.fp16_utils.conversion import network_to_half

__all__ = ["MODELS", "ModelError", "ModelSpec", "build_model", "small_cnn", "to_half"]


class ModelError(ValueError):
    """A model name is unknown; the message lists the known ones."""


def small_cnn(in_channels: int, num_classes: int, width: int = 16) -> nn.Sequential:
    """Returns a 3-conv CNN with BatchNorm (about 8.5k params) for small images such as 8x8.

    conv3x3(width) → BN → ReLU → conv3x3(width) → BN → ReLU → max-pool 2 →
    conv3x3(2·width) → BN → ReLU → adaptive max-pool 2x2 → linear.
    Kept small on purpose: FP16 convolutions on a CPU run far slower than FP32 ones.
    """

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(in_channels, width),
        *block(width, width),
        nn.MaxPool2d(2),
        *block(width, 2 * width),
        nn.AdaptiveMaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * width * 4, num_classes),
    )


def resnet18(in_channels: int, num_classes: int) -> nn.Module:
    """Returns torchvision's ResNet-18 with random weights and ``num_classes`` outputs.

    ``weights=None``: no pretrained weights, nothing downloaded. For inputs with other than
    3 channels the stem convolution is replaced by one taking ``in_channels``.
    """
    from torchvision.models import resnet18 as tv_resnet18

    model = tv_resnet18(weights=None, num_classes=num_classes)
    if in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model by name: how to build it, what it is, and the fewest images per batch it
    trains on (training-mode BatchNorm needs two values per channel)."""

    build: Callable[[int, int], nn.Module]
    description: str
    min_batch: int = 1


#: Models by name.
MODELS: dict[str, ModelSpec] = {
    "cnn": ModelSpec(small_cnn, "small 3-conv CNN with BatchNorm (8.5k params)"),
    # Its last BatchNorm sees 1x1 maps on these small images: one value per image.
    "resnet18": ModelSpec(resnet18, "torchvision ResNet-18, random init (11.2M params)", 2),
}


def build_model(name: str, in_channels: int, num_classes: int) -> nn.Module:
    """Returns a new FP32 model ``name`` of :data:`MODELS`.

    Raises:
      ModelError: the name is unknown.
    """
    spec = MODELS.get(name)
    if spec is None:
        raise ModelError(f"unknown model {name!r} (choose from: {', '.join(MODELS)})")
    return spec.build(in_channels, num_classes)


def to_half(model: nn.Module) -> nn.Module:
    """Returns ``model`` in FP16 (affine BatchNorm kept FP32) behind an input cast to FP16.

    This is apex's ``network_to_half``: ``nn.Sequential(tofp16(), model.half() with BN
    float)``, so the returned module's state-dict keys are the model's prefixed with ``1.``.
    """
    return network_to_half(model)
