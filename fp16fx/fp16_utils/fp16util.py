"""apex's ``apex.fp16_utils.fp16util`` module path, for scripts that import from it
(``from apex.fp16_utils.fp16util import network_to_half``): its names, from where fp16fx
keeps them (layer: fp16_utils)."""

from fp16fx.fp16_utils.conversion import (
    BN_convert_float,
    FP16Model,
    convert_module,
    convert_network,
    network_to_half,
    tofp16,
)
from fp16fx.fp16_utils.master_params import (
    clip_grad_norm,
    master_params_to_model_params,
    model_grads_to_master_grads,
    prep_param_lists,
    to_python_float,
)

__all__ = [
    "BN_convert_float",
    "FP16Model",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
]
