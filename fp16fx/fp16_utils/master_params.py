"""apex-compatible helpers for manual FP32 master weights (layer: fp16_utils).

The manual mixed-precision recipe these serve, as apex documented it:

    model_params, master_params = prep_param_lists(model)
    optimizer = torch.optim.SGD(master_params, lr=0.1)
    ...
    (loss.float() * scale).backward()
    model_grads_to_master_grads(model_params, master_params)
    for p in master_params:
        p.grad.mul_(1.0 / scale)
    optimizer.step()
    master_params_to_model_params(model_params, master_params)

With ``flat_master=True`` the masters are a single flat FP32 ``Parameter`` holding every
trainable parameter back to back, in ``model.parameters()`` order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "clip_grad_norm",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "prep_param_lists",
    "to_python_float",
]

#: apex re-exported torch's in-place gradient clipping under this name.
clip_grad_norm = torch.nn.utils.clip_grad_norm_


def prep_param_lists(
    model: nn.Module, flat_master: bool = False
) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """Returns ``(model_params, master_params)``: the trainable params and their FP32 masters.

    ``model_params`` is ``[p for p in model.parameters() if p.requires_grad]``. Without
    ``flat_master``, ``master_params`` holds one detached FP32 clone per model param, with
    ``requires_grad=True``. With ``flat_master=True`` it holds a single FP32 ``nn.Parameter``,
    the concatenation of all flattened model params; as in apex, its ``.grad`` is allocated up
    front (here filled with zeros rather than left uninitialised), so code that writes into
    ``master_params[0].grad`` works before the first backward.

    Raises:
        TypeError: ``flat_master=True`` and the trainable params do not all share one dtype.
        ValueError: ``flat_master=True`` and the model has no trainable params.
    """
    model_params = [p for p in model.parameters() if p.requires_grad]
    if not flat_master:
        masters = [p.detach().clone().float().requires_grad_(True) for p in model_params]
        return model_params, masters
    if not model_params:
        raise ValueError("prep_param_lists(flat_master=True): the model has no trainable params")
    dtypes = sorted({str(p.dtype) for p in model_params})
    if len(dtypes) > 1:
        raise TypeError(
            "prep_param_lists(flat_master=True) needs all trainable params in one dtype, but "
            f"the model mixes {', '.join(dtypes)}; use flat_master=False or FP16_Optimizer"
        )
    flat = torch.cat([p.detach().reshape(-1) for p in model_params]).float()
    master = nn.Parameter(flat, requires_grad=True)
    master.grad = torch.zeros_like(flat)
    return model_params, [master]


@torch.no_grad()  # a grad made with create_graph=True: its copy stays out of the graph
def model_grads_to_master_grads(
    model_params: Iterable[torch.Tensor],
    master_params: Iterable[torch.Tensor],
    flat_master: bool = False,
) -> None:
    """Returns None; copies each model param's ``.grad`` into its master's ``.grad`` (as FP32).

    A master's ``.grad`` is allocated on first use. A model param whose grad is None gives its
    master a None grad. With ``flat_master=True`` the single master's grad becomes the
    concatenation of the model grads; a None model grad contributes zeros there, since one flat
    buffer cannot be partly absent. No unscaling happens here: divide by the loss scale after.
    """
    model_params, master_params = list(model_params), list(master_params)
    _check_lists(model_params, master_params, flat_master, "model_grads_to_master_grads")
    for i, p in enumerate(model_params):
        if p.grad is not None and p.grad.layout != torch.strided:
            raise TypeError(
                f"model_grads_to_master_grads: model_params[{i}] has a {p.grad.layout} grad; "
                "the masters take dense grads (nothing was copied)"
            )
    if flat_master:
        (master,) = master_params
        flat = torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                for p in model_params
            ]
        )
        if master.grad is None:
            master.grad = torch.empty_like(master)
        master.grad.copy_(flat)
        return
    for model, master in zip(model_params, master_params, strict=True):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        master.grad.copy_(model.grad)


@torch.no_grad()
def master_params_to_model_params(
    model_params: Iterable[torch.Tensor],
    master_params: Iterable[torch.Tensor],
    flat_master: bool = False,
) -> None:
    """Returns None; copies each master's values into its model param (cast to the model dtype).

    With ``flat_master=True`` the single flat master is split into views shaped like the model
    params, in order, and each view is copied into its param.
    """
    model_params, master_params = list(model_params), list(master_params)
    _check_lists(model_params, master_params, flat_master, "master_params_to_model_params")
    if flat_master:
        (master,) = master_params
        sources: Sequence[torch.Tensor] = torch.split(
            master.detach(), [p.numel() for p in model_params]
        )
    else:
        sources = master_params
    for model, source in zip(model_params, sources, strict=True):
        model.copy_(source.reshape(model.shape))


def _check_lists(
    model_params: Sequence[torch.Tensor],
    master_params: Sequence[torch.Tensor],
    flat_master: bool,
    caller: str,
) -> None:
    """Raises ValueError, before anything is copied, unless ``master_params`` are FP32 masters
    of ``model_params`` as ``prep_param_lists(model, flat_master)`` made them: one per param of
    its shape, or one flat master of all their values."""
    if flat_master:
        total = sum(p.numel() for p in model_params)
        if len(master_params) != 1 or master_params[0].numel() != total:
            raise ValueError(
                f"{caller}(flat_master=True) needs the one flat master of {total} values that "
                f"prep_param_lists(model, flat_master=True) returns; got {len(master_params)} "
                "tensors (was prep_param_lists called with another flat_master?)"
            )
        return
    if len(master_params) != len(model_params):
        raise ValueError(
            f"{caller}: {len(model_params)} model params but {len(master_params)} masters "
            "(was prep_param_lists called with another flat_master, or another model?)"
        )
    for i, (model, master) in enumerate(zip(model_params, master_params)):
        if master.shape != model.shape or master.dtype != torch.float32:
            raise ValueError(
                f"{caller}: master_params[{i}] is {master.dtype} of shape {tuple(master.shape)}, "
                f"not the FP32 master of model_params[{i}] ({tuple(model.shape)}); are the "
                "arguments swapped?"
            )


def to_python_float(t: Any) -> float:
    """Returns the Python number held by ``t``: ``t.item()`` for a tensor, else ``t`` itself."""
    return t.item() if hasattr(t, "item") else t
