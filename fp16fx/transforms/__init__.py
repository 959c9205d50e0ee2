"""Optimizer math as pure transforms on FP32 values (docs/design.md layer ``transforms``)."""

from fp16fx.transforms.base import (
    GradientTransformation,
    GradNorm,
    Hyperparams,
    chain,
    check_hyperparam,
    hyperparams,
    with_grad_norm,
)
from fp16fx.transforms.groups import (
    MultiTransformState,
    hyperparam_groups,
    multi_transform,
    read_hyperparams,
    replace_hyperparams,
)
from fp16fx.transforms.optimizers import adam, adamw, sgd
from fp16fx.transforms.primitives import (
    ClipByGlobalNormState,
    ScaleByAdamState,
    TraceState,
    add_decayed_weights,
    clip_by_global_norm,
    clip_coefficient,
    scale_by_adam,
    scale_by_learning_rate,
    trace,
)

__all__ = [
    "ClipByGlobalNormState",
    "GradNorm",
    "GradientTransformation",
    "Hyperparams",
    "MultiTransformState",
    "ScaleByAdamState",
    "TraceState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "chain",
    "check_hyperparam",
    "clip_by_global_norm",
    "clip_coefficient",
    "hyperparam_groups",
    "hyperparams",
    "multi_transform",
    "read_hyperparams",
    "replace_hyperparams",
    "scale_by_adam",
    "scale_by_learning_rate",
    "sgd",
    "trace",
    "with_grad_norm",
]
