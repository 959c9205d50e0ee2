"""Every name of apex's ``apex.fp16_utils``, so that a script changes one import line::

    from fp16fx.fp16_utils import FP16_Optimizer, network_to_half   # was: from apex.fp16_utils

See docs/migration.md for what each name maps to and what changed.
"""

from fp16fx.facade import FP16_Optimizer
from fp16fx.fp16_utils.conversion import (
    BN_convert_float,
    FP16Model,
    convert_module,
    convert_network,
    network_to_half,
    tofp16,
)
from fp16fx.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler
from fp16fx.fp16_utils.master_params import (
    clip_grad_norm,
    master_params_to_model_params,
    model_grads_to_master_grads,
    prep_param_lists,
    to_python_float,
)

__all__ = [
    "BN_convert_float",
    "DynamicLossScaler",
    "FP16Model",
    "FP16_Optimizer",
    "LossScaler",
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
