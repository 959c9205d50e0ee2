"""Parameter sets for ``fp16fx bench``, built from real model shapes.

A preset is only a list of shapes; :func:`make_param_set` turns it into FP16 params with scaled
FP16 grads. Presets:

* ``resnet18``: torchvision's ResNet-18 (11,689,512 params in 62 leaves), its shapes written
  out from the architecture (checked against torchvision's model in the tests).
* ``gpt2``: GPT-2 small as in Hugging Face's ``GPT2LMHeadModel`` with the LM head tied to the
  token embedding (124,439,808 params in 148 leaves).
* ``many-small``: 2,000 leaves of varied small shapes, 10,000,000 params in all; the case where
  per-tensor launch overhead, not bandwidth, decides the step time.
* :func:`custom_shapes`: any ``params``/``leaves`` count, split as evenly as integers allow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod

import torch
from torch import Tensor

__all__ = [
    "PRESETS",
    "Preset",
    "custom_shapes",
    "gpt2_shapes",
    "make_param_set",
    "many_small_shapes",
    "preset",
    "resnet18_shapes",
]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Preset:
    """A named list of parameter shapes."""

    name: str
    shapes: tuple[Shape, ...]

    @property
    def num_params(self) -> int:
        """Return the total number of parameters (elements)."""
        return sum(prod(shape) for shape in self.shapes)

    @property
    def num_leaves(self) -> int:
        """Return the number of parameter tensors."""
        return len(self.shapes)


def resnet18_shapes(num_classes: int = 1000) -> list[Shape]:
    """Return ResNet-18's parameter shapes in torchvision's ``model.parameters()`` order.

    A 7x7 stem convolution and its batch norm, four stages of two basic blocks (3x3 conv, BN,
    3x3 conv, BN; the first block of stages 2-4 halves the resolution and adds a 1x1 conv and
    BN on its shortcut), then the classifier (He et al., 2016). Written out here so that the
    bench needs no torchvision; a test checks it against torchvision's model.
    """
    shapes: list[Shape] = [(64, 3, 7, 7), (64,), (64,)]
    channels = 64
    for stage, width in enumerate((64, 128, 256, 512)):
        for block in range(2):
            shapes += [(width, channels, 3, 3), (width,), (width,)]
            shapes += [(width, width, 3, 3), (width,), (width,)]
            if stage > 0 and block == 0:
                shapes += [(width, channels, 1, 1), (width,), (width,)]
            channels = width
    return [*shapes, (num_classes, 512), (num_classes,)]


def gpt2_shapes(
    vocab: int = 50257, positions: int = 1024, width: int = 768, layers: int = 12
) -> list[Shape]:
    """Return GPT-2's parameter shapes (defaults: GPT-2 small), LM head tied to ``wte``.

    Layout per block, as in Hugging Face's ``GPT2Model`` (``Conv1D`` weights are in x out):
    ln_1 (w, b), attn.c_attn (w, b), attn.c_proj (w, b), ln_2 (w, b), mlp.c_fc (w, b),
    mlp.c_proj (w, b); then the final ln_f (w, b).
    """
    shapes: list[Shape] = [(vocab, width), (positions, width)]
    for _ in range(layers):
        shapes += [(width,), (width,)]  # ln_1
        shapes += [(width, 3 * width), (3 * width,)]  # attn.c_attn
        shapes += [(width, width), (width,)]  # attn.c_proj
        shapes += [(width,), (width,)]  # ln_2
        shapes += [(width, 4 * width), (4 * width,)]  # mlp.c_fc
        shapes += [(4 * width, width), (width,)]  # mlp.c_proj
    shapes += [(width,), (width,)]  # ln_f
    return shapes


def many_small_shapes(leaves: int = 2000, total: int = 10_000_000) -> list[Shape]:
    """Return ``leaves`` varied small shapes holding exactly ``total`` params.

    A deterministic cycle of biases, norm weights, linear and 3x3/1x1 conv weights of
    assorted widths; the last leaf is a vector holding whatever remains of ``total``.
    """
    shapes: list[Shape] = []
    for i in range(leaves - 1):
        kind = i % 5
        if kind == 0:  # bias / norm weight
            shapes.append((64 * (1 + (7 * i) % 8),))
        elif kind == 1:  # linear
            shapes.append((32 * (1 + (3 * i) % 6), 32 * (1 + (5 * i) % 4)))
        elif kind == 2:  # 3x3 conv
            shapes.append((16 * (1 + (11 * i) % 4), 8 * (1 + (13 * i) % 4), 3, 3))
        elif kind == 3:  # small bias
            shapes.append((16 * (1 + i % 4),))
        else:  # 1x1 conv
            shapes.append((62 * (1 + i % 3), 32 * (1 + (i // 5) % 4), 1, 1))
    remainder = total - sum(prod(s) for s in shapes)
    if remainder <= 0:
        raise ValueError(f"many_small_shapes: {leaves} leaves already exceed {total} params")
    shapes.append((remainder,))
    return shapes


def custom_shapes(params: int, leaves: int) -> list[Shape]:
    """Return ``leaves`` 1-D shapes holding ``params`` params, sizes differing by at most one."""
    if leaves < 1 or params < leaves:
        raise ValueError(f"need 1 <= leaves <= params, got params={params}, leaves={leaves}")
    base, extra = divmod(params, leaves)
    return [(base + 1,) if i < extra else (base,) for i in range(leaves)]


PRESETS: dict[str, Callable[[], list[Shape]]] = {
    "resnet18": resnet18_shapes,
    "gpt2": gpt2_shapes,
    "many-small": many_small_shapes,
}


def preset(name: str) -> Preset:
    """Return the named preset (one of :data:`PRESETS`)."""
    try:
        build = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
    return Preset(name, tuple(build()))


def make_param_set(
    shapes: Sequence[Shape],
    device: torch.device | str = "cpu",
    loss_scale: float = 2.0**16,
    seed: int = 0,
    dtype: torch.dtype = torch.float16,
) -> tuple[list[Tensor], list[Tensor]]:
    """Return ``(params, grads)``: FP16 params and their scaled FP16 grads, one per shape.

    Params are ``N(0, 0.02)`` in ``torch.nn.Parameter`` s (``requires_grad=True``, as
    ``model.parameters()`` yields; optimizers leave ``requires_grad=False`` params alone).
    Grads are ``N(0, 1e-4) * loss_scale``: small true gradients already multiplied by the
    loss scale, as after ``backward`` of a scaled loss; with the default scale 2**16 they
    stay far from FP16's overflow. Each param's ``.grad`` is set to its grad. The values
    depend only on ``seed`` and the shapes.
    """
    generator = torch.Generator().manual_seed(seed)
    params: list[Tensor] = []
    grads: list[Tensor] = []
    for shape in shapes:
        data = torch.randn(shape, generator=generator).mul_(0.02).to(device, dtype)
        p = torch.nn.Parameter(data)
        g = torch.randn(shape, generator=generator).mul_(1e-4 * loss_scale).to(device, dtype)
        p.grad = g
        params.append(p)
        grads.append(g)
    return params, grads
