"""apex-compatible helpers that convert a network's weights to FP16 (layer: fp16_utils).

These mirror ``apex.fp16_utils``' conversion functions, which scripts import by name:

    from fp16fx.fp16_utils import network_to_half, FP16Model

Every helper converts *in place* (parameter objects keep their identity, only their data
changes dtype), so optimizers and hooks that already hold the parameters keep working.
BatchNorm layers with affine parameters stay in FP32, as in apex: their running statistics and
scale/shift lose too much precision in FP16, and cuDNN accepts FP16 inputs with FP32 BN weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils.rnn import PackedSequence

__all__ = [
    "BN_convert_float",
    "FP16Model",
    "convert_module",
    "convert_network",
    "network_to_half",
    "tofp16",
]


def _is_affine_batchnorm(module: nn.Module) -> bool:
    return isinstance(module, _BatchNorm) and module.affine


class tofp16(nn.Module):  # apex's name, lower case
    """A layer whose forward returns its input cast to FP16 (``input.half()``)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input.half()


def BN_convert_float(module: nn.Module) -> nn.Module:
    """Returns ``module`` after moving every affine BatchNorm inside it (recursively) to FP32."""
    if _is_affine_batchnorm(module):
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network: nn.Module) -> nn.Sequential:
    """Returns ``nn.Sequential(tofp16(), network)``, network in FP16 except affine BatchNorm.

    The network is converted in place by ``network.half()`` and then ``BN_convert_float``.
    """
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Returns None; casts ``module``'s own floating-point params, grads and buffers to ``dtype``.

    Only the module's direct parameters and buffers are touched (not its children's); integer
    buffers such as BatchNorm's ``num_batches_tracked`` are left alone. Conversion is in place:
    each ``Parameter`` object is kept and its ``.data`` replaced.
    """
    for param in module.parameters(recurse=False):
        if param.is_floating_point():
            param.data = param.data.to(dtype)
        if param.grad is not None and param.grad.is_floating_point():
            param.grad.data = param.grad.data.to(dtype)
    for buf in module.buffers(recurse=False):
        if buf.is_floating_point():
            buf.data = buf.data.to(dtype)


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Returns ``network`` after converting every module except affine BatchNorm to ``dtype``.

    Each module goes through ``convert_module``; recurrent layers get ``flatten_parameters()``
    afterwards so cuDNN sees contiguous weights in the new dtype.
    """
    for module in network.modules():
        if _is_affine_batchnorm(module):
            continue
        convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


def _to_half(value: Any) -> Any:
    """Returns ``value`` with floating-point tensors cast to FP16, recursing into tuples
    (named ones too), lists and dicts; a ``PackedSequence``'s data is cast whole."""
    if isinstance(value, torch.Tensor):
        return value.half() if value.is_floating_point() else value
    if isinstance(value, PackedSequence):
        return value.half() if value.data.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_to_half(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_to_half(v) for v in value)
    if isinstance(value, dict):
        out = value.copy()  # its own type: a defaultdict keeps its factory
        out.update((k, _to_half(v)) for k, v in value.items())
        return out
    return value


class FP16Model(nn.Module):
    """A wrapper running ``network`` in FP16 (affine BatchNorm kept FP32) on FP16-cast inputs.

    The wrapped network is ``self.network = convert_network(network, torch.half)``. ``forward``
    casts every floating-point tensor among its arguments (also inside tuples, named ones such
    as a ``PackedSequence``, lists and dicts) to FP16; integer tensors, such as token ids, pass
    through unchanged.
    """

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.network(*_to_half(inputs), **{k: _to_half(v) for k, v in kwargs.items()})
