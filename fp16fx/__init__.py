"""fp16fx: FP16/BF16 training with FP32 master weights and loss scaling, as a pure compiled step.

The functional API::

    state = fp16fx.init(params, fp16fx.adam(1e-3))          # FP16 params -> dynamic scaling
    loss = fp16fx.scale_loss(state, loss)                    # backprop this
    state, info = fp16fx.step(state, grads)                  # pure; skips on inf/NaN
    step = fp16fx.compile_step(inplace=True)                 # the same, fused and in place
    torch.save(fp16fx.state_dict(state), path)               # keyed by each param's path
"""

from fp16fx.apex_checkpoint import load_apex_checkpoint
from fp16fx.checkpoint import load_state_dict, state_dict
from fp16fx.compile import compile_step
from fp16fx.facade import FP16_Optimizer
from fp16fx.saved_format import StateDictError
from fp16fx.scaling import (
    DynamicLossScale,
    LossScaleState,
    NoLossScale,
    StaticLossScale,
    unscale_and_check,
)
from fp16fx.state import MixedPrecisionState, grad_buffers, init
from fp16fx.step import StepInfo, get_hyperparams, scale_loss, set_hyperparams, step
from fp16fx.transforms import (
    GradientTransformation,
    adam,
    adamw,
    add_decayed_weights,
    chain,
    clip_by_global_norm,
    multi_transform,
    scale_by_adam,
    scale_by_learning_rate,
    sgd,
    trace,
)

__version__ = "0.1.0"

__all__ = [
    "DynamicLossScale",
    "FP16_Optimizer",
    "GradientTransformation",
    "LossScaleState",
    "MixedPrecisionState",
    "NoLossScale",
    "StateDictError",
    "StaticLossScale",
    "StepInfo",
    "adam",
    "adamw",
    "add_decayed_weights",
    "chain",
    "clip_by_global_norm",
    "compile_step",
    "get_hyperparams",
    "grad_buffers",
    "init",
    "load_apex_checkpoint",
    "load_state_dict",
    "multi_transform",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_loss",
    "set_hyperparams",
    "sgd",
    "state_dict",
    "step",
    "trace",
    "unscale_and_check",
]
