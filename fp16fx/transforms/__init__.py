"""Optimizer math as pure transforms on FP32 values (DESIGN.md layer ``transforms``)."""

from fp16fx.transforms.base import (
    GradientTransformation,
    TransformState,
    chain,
    multi_transform,
    replace_hyperparams,
)
from fp16fx.transforms.optimizers import adam, adamw, sgd
from fp16fx.transforms.primitives import (
    ScaleByAdamState,
    TraceState,
    add_decayed_weights,
    clip_by_global_norm,
    scale_by_adam,
    scale_by_learning_rate,
    trace,
)

__all__ = [
    "GradientTransformation",
    "ScaleByAdamState",
    "TraceState",
    "TransformState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "chain",
    "clip_by_global_norm",
    "multi_transform",
    "replace_hyperparams",
    "scale_by_adam",
    "scale_by_learning_rate",
    "sgd",
    "trace",
]
